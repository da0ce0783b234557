/*
 * main.c - pagefoldd: options, the main loop, signals, readiness.
 *
 * Owns the process: the scanner and the control socket live on the main
 * loop's thread.  Must never exit on a client's or a VM's error: only on a
 * bad command line, a socket it cannot listen on, or SIGTERM/SIGINT.
 */
#include <glib-unix.h>
#include <glib.h>
#include <locale.h>
#include <malloc.h>
#include <signal.h>
#include <stdlib.h>

#include "attached.h"
#include "config.h"
#include "control.h"
#include "escape.h"
#include "libvirt-metadata.h"
#include "libvirt-status.h"
#include "link-server.h"
#include "pf-config.h"
#include "scan.h"
#include "util.h"

#if PF_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

/*
 * Every line pagefoldd logs, escaped (escape.h) on its way out.  Peers'
 * words are escaped where they come in (link.c, handshake.c, vm.c); this
 * is the one place no line can pass by, whoever adds it later.  Escaping
 * is idempotent: text escaped already shows the same.
 */
static GLogWriterOutput
escaping_writer(GLogLevelFlags level, const GLogField *fields, gsize n_fields, gpointer user)
{
    g_autofree GLogField *copy = g_memdup2(fields, n_fields * sizeof(*fields));
    g_autofree char *message = NULL;

    for (gsize i = 0; i < n_fields; i++) {
        if (g_str_equal(copy[i].key, "MESSAGE") && copy[i].value != NULL) {
            message = pf_escape_text(copy[i].value, copy[i].length);
            copy[i].value = message;
            copy[i].length = -1;
        }
    }
    return g_log_writer_default(level, copy, n_fields, user);
}

static gboolean
on_signal(gpointer user)
{
    g_main_loop_quit(user);
    return G_SOURCE_CONTINUE;
}

/* What the command line asked for. */
typedef struct {
    char *socket_path;
    char *agent_path;
    char *hash_name;
    char *agent_group;
    char *libvirt_uri;
    char *libvirt_run_dir;
    GStrv attach;
    GStrv sets;
    char *config_path;
    PfConfig *config;   /* what it said at start */
    gboolean version;
    gint agent_timeout; /* -1: not given */
    gboolean agent_timeout_given; /* on the command line: a reload keeps it */
    const PfHashAlgo *hash; /* hash_name's, or the default */
} Options;

static void
options_clear(Options *o)
{
    g_free(o->socket_path);
    g_free(o->agent_path);
    g_free(o->hash_name);
    g_free(o->agent_group);
    g_free(o->libvirt_uri);
    g_free(o->libvirt_run_dir);
    g_strfreev(o->attach);
    g_strfreev(o->sets);
    g_free(o->config_path);
    pf_config_free(o->config);
}
G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Options, options_clear)

/*
 * What runs.  daemon_clear() frees it in this order: the loop, then what
 * points into the scanner (the two sockets, libvirt's thread, which must
 * be stopped before the figures it reads go), then the scanner.
 */
typedef struct {
    GMainLoop *loop;
    const Options *options; /* the command line's, and the file's at start */
    PfLinkServer *links;
    PfControl *control;
    PfAttached *attached;
#if PF_HAVE_LIBVIRT
    PfLibvirtMetadata *metadata;
#endif
    PfScanner *scanner;
} Daemon;

static void
daemon_clear(Daemon *d)
{
    g_clear_pointer(&d->loop, g_main_loop_unref);
    g_clear_pointer(&d->links, pf_link_server_free);
    g_clear_pointer(&d->control, pf_control_free);
    g_clear_pointer(&d->attached, pf_attached_free);
#if PF_HAVE_LIBVIRT
    g_clear_pointer(&d->metadata, pf_libvirt_metadata_free);
#endif
    g_clear_pointer(&d->scanner, pf_scanner_free);
}
G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Daemon, daemon_clear)

/* What a step returns to let main() go on; any other value is the exit
 * status. */
#define GO_ON (-1)

static const char *
socket_path(const Options *o)
{
    return o->socket_path ? o->socket_path : PF_DEFAULT_SOCKET;
}

static const char *
agent_path(const Options *o)
{
    return o->agent_path ? o->agent_path : PF_DEFAULT_AGENT_SOCKET;
}

/* An option the command line did not give, from the configuration file. */
static void
take_option(char **option, char *from_file)
{
    if (*option == NULL) {
        *option = g_strdup(from_file);
    }
}

/* The configuration file (o->config), read at start: the options the
 * command line left out are its. */
static gboolean
take_config(Options *o)
{
    g_autoptr(GError) error = NULL;
    PfConfig *c = pf_config_load(o->config_path ? o->config_path : PF_DEFAULT_CONFIG,
                                 o->config_path != NULL, &error);

    if (c == NULL) {
        g_printerr("pagefoldd: %s\n", error->message);
        return FALSE;
    }
    take_option(&o->socket_path, c->socket);
    take_option(&o->agent_path, c->agent_socket);
    take_option(&o->agent_group, c->agent_group);
    take_option(&o->hash_name, c->hash);
    take_option(&o->libvirt_uri, c->libvirt_uri);
    take_option(&o->libvirt_run_dir, c->libvirt_run_dir);
    if (!o->agent_timeout_given) {
        o->agent_timeout = c->agent_timeout != 0 ? c->agent_timeout : 30;
    }
    o->config = c;
    return TRUE;
}

/* The command line into o, checked; 0 after --version. */
static int
parse_options(Options *o, int argc, char **argv)
{
    GOptionEntry entries[] = {
        { "socket", 's', 0, G_OPTION_ARG_FILENAME, &o->socket_path,
          "Control socket (default " PF_DEFAULT_SOCKET ")", "PATH" },
        { "agent-socket", 0, 0, G_OPTION_ARG_FILENAME, &o->agent_path,
          "Socket the agents in QEMU connect to (default " PF_DEFAULT_AGENT_SOCKET ")", "PATH" },
        { "agent-group", 0, 0, G_OPTION_ARG_STRING, &o->agent_group,
          "Let this group's processes connect to the agent socket too (mode 0660), "
          "e.g. libvirt-qemu (default: root only)", "GROUP" },
        { "libvirt-run-dir", 0, 0, G_OPTION_ARG_FILENAME, &o->libvirt_run_dir,
          "Where libvirt keeps its domains' status files: an agent not run by root gets "
          "/dev/userfaultfd only if its domain's file there names its process "
          "(default " PF_LIBVIRT_QEMU_RUN_DIR ")", "DIR" },
        { "hash", 0, 0, G_OPTION_ARG_STRING, &o->hash_name,
          "Page checksum: xxh3 (default), xxh64, crc32c, jhash2", "NAME" },
        { "set", 0, 0, G_OPTION_ARG_STRING_ARRAY, &o->sets,
          "Set a knob at start, e.g. --set pages_to_scan=1000 (repeatable)", "KNOB=VALUE" },
        { "agent-timeout", 0, 0, G_OPTION_ARG_INT, &o->agent_timeout,
          "Detach a VM whose agent answers none of its requests for this long "
          "(default 30)", "SECONDS" },
        { "libvirt-uri", 0, 0, G_OPTION_ARG_STRING, &o->libvirt_uri,
          "libvirt to put each VM's figures in its domain's metadata through "
          "(default qemu:///system)", "URI" },
        { "attach", 'a', 0, G_OPTION_ARG_STRING_ARRAY, &o->attach,
          "Attach a VM at start: PID or PID:NAME (repeatable)", "PID[:NAME]" },
        { "config", 'c', 0, G_OPTION_ARG_FILENAME, &o->config_path,
          "Configuration file: options in [pagefoldd], knobs in [knobs], read again on "
          "SIGHUP and pagefoldctl reload; the command line wins (default "
          PF_DEFAULT_CONFIG ", if there is one)", "FILE" },
        { "version", 0, 0, G_OPTION_ARG_NONE, &o->version, "Print the version", NULL },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx =
        g_option_context_new("- memory deduplication for QEMU VMs with shared memfd RAM");
    g_autoptr(GError) error = NULL;

    g_option_context_add_main_entries(ctx, entries, NULL);
    g_option_context_set_description(ctx,
        "Knobs (KSM's names): pages_to_scan, sleep_millisecs, cpu_percent,\n"
        "target_pass_millisecs, max_page_sharing, smart_scan, use_zero_pages, run,\n"
        "max_vma_percent, libvirt_metadata_millisecs, io_hints, cpu_use.\n"
        "A VM whose QEMU runs the pagefold agent is merged (mode=merge); a VM\n"
        "attached by pid is in mode=advise: pagefoldd reports what merging would\n"
        "save and changes no guest memory.");
    if (!g_option_context_parse(ctx, &argc, &argv, &error)) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 2;
    }
    if (o->version) {
        g_print("pagefoldd %s\n", PF_VERSION);
        return 0;
    }
    if (argc > 1) {
        g_printerr("pagefoldd: unexpected argument '%s'\n", argv[1]);
        return 2;
    }
    o->agent_timeout_given = o->agent_timeout != -1;
    if (o->agent_timeout_given && (o->agent_timeout < 1 || o->agent_timeout > 3600)) {
        g_printerr("pagefoldd: --agent-timeout must be between 1 and 3600 seconds\n");
        return 2;
    }
    if (!take_config(o)) {
        return 2;
    }
#if !PF_HAVE_LIBVIRT
    if (o->libvirt_uri != NULL) {
        g_printerr("pagefoldd: --libvirt-uri: this pagefoldd was built without libvirt\n");
        return 2;
    }
#endif
    if (o->hash_name != NULL && (o->hash = pf_hash_lookup(o->hash_name)) == NULL) {
        /* (The configuration file's was checked as it was read.) */
        g_printerr("pagefoldd: unknown --hash '%s' (xxh3, xxh64, crc32c, jhash2)\n",
                   o->hash_name);
        return 2;
    }
    return GO_ON;
}

/* The configuration file's knobs, then --set KNOB=VALUE, each in turn. */
static int
set_knobs(PfScanner *scanner, const PfConfig *config, char **sets)
{
    g_autoptr(GError) config_error = NULL;

    if (!pf_config_set_knobs(config, pf_scanner_get_knobs(scanner), &config_error)) {
        g_printerr("pagefoldd: %s\n", config_error->message);
        return 2;
    }
    for (char **s = sets; s && *s; s++) {
        g_autoptr(GError) error = NULL;
        g_auto(GStrv) kv = g_strsplit(*s, "=", 2);
        guint64 v;

        if (g_strv_length(kv) != 2) {
            g_printerr("pagefoldd: --set wants KNOB=VALUE, not '%s'\n", *s);
            return 2;
        }
        if (!pf_parse_u64(kv[1], 0, G_MAXUINT32, &v, &error) ||
            !pf_knobs_set(pf_scanner_get_knobs(scanner), kv[0], v, &error)) {
            g_printerr("pagefoldd: --set %s: %s\n", *s, error->message);
            return 2;
        }
    }
    return GO_ON;
}

/* The control socket, then the agents' socket. */
static int
open_sockets(Daemon *d, const Options *o)
{
    g_autoptr(GError) error = NULL;

    d->control = pf_control_new(d->scanner, socket_path(o), &error);
    if (d->control == NULL) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 1;
    }
    d->links = pf_link_server_new(d->scanner, agent_path(o), &error);
    if (d->links == NULL) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 1;
    }
    if (o->agent_group != NULL && !pf_link_server_allow_group(d->links, o->agent_group, &error)) {
        g_printerr("pagefoldd: --agent-group: %s\n", error->message);
        return 1;
    }
    pf_link_server_set_answer_timeout(d->links, (guint)o->agent_timeout * 1000);
    if (o->libvirt_run_dir != NULL) {
        pf_link_server_set_libvirt_run_dir(d->links, o->libvirt_run_dir);
    }
    return GO_ON;
}

/* --attach PID[:NAME], each in turn, in advise mode. */
static int
attach_pids(PfScanner *scanner, char **attach)
{
    for (char **a = attach; a && *a; a++) {
        g_autoptr(GError) error = NULL;
        g_auto(GStrv) pn = g_strsplit(*a, ":", 2);
        guint64 pid;
        PfVm *vm;

        if (!pf_parse_u64(pn[0], 1, G_MAXINT, &pid, &error)) {
            g_printerr("pagefoldd: --attach %s: %s\n", *a, error->message);
            return 2;
        }
        vm = pf_vm_attach((int)pid, pn[1], &error);
        if (vm == NULL) {
            /* A VM that cannot be attached is reported, not fatal. */
            g_warning("--attach %s: %s", *a, error->message);
            continue;
        }
        pf_scanner_add_vm(scanner, vm);
    }
    return GO_ON;
}

/*
 * The configuration file read again (SIGHUP, pagefoldctl reload): the
 * knobs it names are set (others keep what they have, pagefoldctl set's
 * included), the command line's --set still winning, and its
 * agent-timeout taken (30 s where it says none) unless the command line
 * gave one; the other options are said to wait for a restart where they
 * changed.  A file with a mistake changes nothing.
 */
static gboolean
reload(gpointer user, GError **error)
{
    Daemon *d = user;
    const Options *o = d->options;
    const char *path = o->config_path ? o->config_path : PF_DEFAULT_CONFIG;
    g_autoptr(PfConfig) c = pf_config_load(path, o->config_path != NULL, error);
    PfKnobs knobs;
    struct {
        const char *name;
        const char *was, *now;
    } fixed[] = {
        { "socket", o->config->socket, c ? c->socket : NULL },
        { "agent-socket", o->config->agent_socket, c ? c->agent_socket : NULL },
        { "agent-group", o->config->agent_group, c ? c->agent_group : NULL },
        { "hash", o->config->hash, c ? c->hash : NULL },
        { "libvirt-uri", o->config->libvirt_uri, c ? c->libvirt_uri : NULL },
        { "libvirt-run-dir", o->config->libvirt_run_dir, c ? c->libvirt_run_dir : NULL },
    };

    if (c == NULL) {
        return FALSE;
    }
    knobs = *pf_scanner_get_knobs(d->scanner);
    if (!pf_config_set_knobs(c, &knobs, error)) {
        return FALSE;
    }
    for (char **s = o->sets; s && *s; s++) {
        g_auto(GStrv) kv = g_strsplit(*s, "=", 2);

        /* Checked at start. */
        (void)pf_knobs_set(&knobs, kv[0], g_ascii_strtoull(kv[1], NULL, 10), NULL);
    }
    *pf_scanner_get_knobs(d->scanner) = knobs;
    pf_scanner_kick(d->scanner);
    if (!o->agent_timeout_given) {
        pf_link_server_set_answer_timeout(d->links,
                                          (guint)(c->agent_timeout != 0 ? c->agent_timeout
                                                                        : 30) * 1000);
    }
    for (gsize i = 0; i < G_N_ELEMENTS(fixed); i++) {
        if (g_strcmp0(fixed[i].was, fixed[i].now) != 0) {
            g_message("%s: %s changed: pagefoldd takes it at its next start", path,
                      fixed[i].name);
        }
    }
    g_message("%s read again: %u knob(s) set", path, c->knobs->len);
    return TRUE;
}

static gboolean
on_sighup(gpointer user)
{
    g_autoptr(GError) error = NULL;

    if (!reload(user, &error)) {
        g_warning("SIGHUP: %s; nothing changed", error->message);
    }
    return G_SOURCE_CONTINUE;
}

/* Scans, serves and publishes until SIGTERM or SIGINT. */
static int
run(Daemon *d, const Options *o)
{
    g_unix_signal_add(SIGTERM, on_signal, d->loop);
    g_unix_signal_add(SIGINT, on_signal, d->loop);
    g_unix_signal_add(SIGHUP, on_sighup, d);
    pf_control_set_reload(d->control, reload, d);
    pf_scanner_start(d->scanner);
#if PF_HAVE_LIBVIRT
    {
        g_autoptr(GError) error = NULL;

        d->metadata = pf_libvirt_metadata_new(d->scanner, o->libvirt_uri, &error);
        if (d->metadata == NULL) {
            g_printerr("pagefoldd: %s\n", error->message);
            return 1;
        }
    }
#endif
    /* Its greeting means ready, as READY=1 does: a client greeted finds
     * the agent socket open to its group and the attached VMs back. */
    pf_control_start(d->control);
    g_message("pagefoldd %s: control socket %s, agent socket %s, hash %s", PF_VERSION,
              socket_path(o), agent_path(o), o->hash->name);
#if PF_HAVE_SYSTEMD
    sd_notify(0, "READY=1");
#endif
    g_main_loop_run(d->loop);
#if PF_HAVE_SYSTEMD
    sd_notify(0, "STOPPING=1");
#endif
    g_message("pagefoldd stopping");
    return 0;
}

int
main(int argc, char **argv)
{
    g_auto(Options) opts = { .agent_timeout = -1, .hash = pf_hash_default() };
    g_auto(Daemon) d = { NULL };
    int status;

    setlocale(LC_ALL, "");
    /*
     * pagefoldd's big arrays (the trees' tables, a region's array of page
     * record pointers, read-ahead windows) come and go with passes and
     * VMs.  glibc raises its mmap threshold to the size of each bigger one
     * freed (up to 32 MiB), and from then on they come from the heap,
     * where the holes they leave can stay resident (docs/DESIGN.md,
     * section 6).  A fixed threshold keeps them mapped apart, given back
     * when freed, and a table made big comes zeroed from the kernel.
     */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    g_log_set_writer_func(escaping_writer, NULL, NULL);
    /* A peer that hangs up is an error on the write, not the end of
     * pagefoldd: libvirt's client library writes without MSG_NOSIGNAL (a
     * libvirtd killed or restarted), as any library may. */
    signal(SIGPIPE, SIG_IGN);
    if ((status = parse_options(&opts, argc, argv)) != GO_ON) {
        return status;
    }
    d.options = &opts;
    d.scanner = pf_scanner_new(opts.hash);
    pf_raise_nofile_limit();
    if ((status = set_knobs(d.scanner, opts.config, opts.sets)) != GO_ON) {
        return status;
    }
    d.loop = g_main_loop_new(NULL, FALSE);
    if ((status = open_sockets(&d, &opts)) != GO_ON ||
        (status = attach_pids(d.scanner, opts.attach)) != GO_ON) {
        return status;
    }
    {
        /* VMs attached by pid have no agent to come back by, and agents'
         * VMs come back without their merge domains: the last pagefoldd
         * on this socket kept both beside it. */
        g_autofree char *kept = g_strconcat(socket_path(&opts), ".attached", NULL);

        d.attached = pf_attached_new(d.scanner, kept, NULL);
        pf_link_server_set_kept(d.links, d.attached);
    }
    return run(&d, &opts);
}
