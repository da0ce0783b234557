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
#include <stdlib.h>

#include "control.h"
#include "libvirt-metadata.h"
#include "link.h"
#include "pf-config.h"
#include "scan.h"
#include "util.h"

#if PF_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

static gboolean
on_signal(gpointer user)
{
    g_main_loop_quit(user);
    return G_SOURCE_CONTINUE;
}

int
main(int argc, char **argv)
{
    g_autofree char *socket_path = NULL;
    g_autofree char *agent_path = NULL;
    g_autofree char *hash_name = NULL;
    g_autofree char *agent_group = NULL;
    g_autofree char *libvirt_uri = NULL;
    g_auto(GStrv) attach = NULL;
    g_auto(GStrv) sets = NULL;
    gboolean version = FALSE;
    gint agent_timeout = 30;
    GOptionEntry entries[] = {
        { "socket", 's', 0, G_OPTION_ARG_FILENAME, &socket_path,
          "Control socket (default " PF_DEFAULT_SOCKET ")", "PATH" },
        { "agent-socket", 0, 0, G_OPTION_ARG_FILENAME, &agent_path,
          "Socket the agents in QEMU connect to (default " PF_DEFAULT_AGENT_SOCKET ")", "PATH" },
        { "agent-group", 0, 0, G_OPTION_ARG_STRING, &agent_group,
          "Let this group's processes connect to the agent socket too (mode 0660), "
          "e.g. libvirt-qemu (default: root only)", "GROUP" },
        { "hash", 0, 0, G_OPTION_ARG_STRING, &hash_name,
          "Page checksum: xxh3 (default), xxh64, crc32c, jhash2", "NAME" },
        { "set", 0, 0, G_OPTION_ARG_STRING_ARRAY, &sets,
          "Set a knob at start, e.g. --set pages_to_scan=1000 (repeatable)", "KNOB=VALUE" },
        { "agent-timeout", 0, 0, G_OPTION_ARG_INT, &agent_timeout,
          "Detach a VM whose agent answers none of its requests for this long "
          "(default 30)", "SECONDS" },
        { "libvirt-uri", 0, 0, G_OPTION_ARG_STRING, &libvirt_uri,
          "libvirt to put each VM's figures in its domain's metadata through "
          "(default qemu:///system)", "URI" },
        { "attach", 'a', 0, G_OPTION_ARG_STRING_ARRAY, &attach,
          "Attach a VM at start: PID or PID:NAME (repeatable)", "PID[:NAME]" },
        { "version", 0, 0, G_OPTION_ARG_NONE, &version, "Print the version", NULL },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx =
        g_option_context_new("- memory deduplication for QEMU VMs with shared memfd RAM");
    g_autoptr(GError) error = NULL;
    g_autoptr(PfScanner) scanner = NULL;
#if PF_HAVE_LIBVIRT
    /* After the scanner: freed before it. */
    g_autoptr(PfLibvirtMetadata) metadata = NULL;
#endif
    g_autoptr(PfControl) control = NULL;
    g_autoptr(PfLinkServer) links = NULL;
    g_autoptr(GMainLoop) loop = NULL;
    const PfHashAlgo *hash = pf_hash_default();

    setlocale(LC_ALL, "");
    g_option_context_add_main_entries(ctx, entries, NULL);
    g_option_context_set_description(ctx,
        "Knobs (KSM's names): pages_to_scan, sleep_millisecs, cpu_percent,\n"
        "target_pass_millisecs, max_page_sharing, smart_scan, use_zero_pages, run,\n"
        "max_vma_percent, libvirt_metadata_millisecs.\n"
        "A VM whose QEMU runs the pagefold agent is merged (mode=merge); a VM\n"
        "attached by pid is in mode=advise: pagefoldd reports what merging would\n"
        "save and changes no guest memory.");
    if (!g_option_context_parse(ctx, &argc, &argv, &error)) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 2;
    }
    if (version) {
        g_print("pagefoldd %s\n", PF_VERSION);
        return 0;
    }
    if (argc > 1) {
        g_printerr("pagefoldd: unexpected argument '%s'\n", argv[1]);
        return 2;
    }
    if (agent_timeout < 1 || agent_timeout > 3600) {
        g_printerr("pagefoldd: --agent-timeout must be between 1 and 3600 seconds\n");
        return 2;
    }
#if !PF_HAVE_LIBVIRT
    if (libvirt_uri != NULL) {
        g_printerr("pagefoldd: --libvirt-uri: this pagefoldd was built without libvirt\n");
        return 2;
    }
#endif
    if (hash_name != NULL && (hash = pf_hash_lookup(hash_name)) == NULL) {
        g_printerr("pagefoldd: unknown --hash '%s' (xxh3, xxh64, crc32c, jhash2)\n", hash_name);
        return 2;
    }
    scanner = pf_scanner_new(hash);
    pf_raise_nofile_limit();
    for (char **s = sets; s && *s; s++) {
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

    loop = g_main_loop_new(NULL, FALSE);
    control = pf_control_new(scanner, socket_path ? socket_path : PF_DEFAULT_SOCKET, &error);
    if (control == NULL) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 1;
    }
    links = pf_link_server_new(scanner, agent_path ? agent_path : PF_DEFAULT_AGENT_SOCKET, &error);
    if (links == NULL) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 1;
    }
    if (agent_group != NULL && !pf_link_server_allow_group(links, agent_group, &error)) {
        g_printerr("pagefoldd: --agent-group: %s\n", error->message);
        return 1;
    }
    pf_link_server_set_answer_timeout(links, (guint)agent_timeout * 1000);
    for (char **a = attach; a && *a; a++) {
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
            g_clear_error(&error);
            continue;
        }
        pf_scanner_add_vm(scanner, vm);
    }
    g_unix_signal_add(SIGTERM, on_signal, loop);
    g_unix_signal_add(SIGINT, on_signal, loop);
    pf_scanner_start(scanner);
#if PF_HAVE_LIBVIRT
    metadata = pf_libvirt_metadata_new(scanner, libvirt_uri, &error);
    if (metadata == NULL) {
        g_printerr("pagefoldd: %s\n", error->message);
        return 1;
    }
#endif
    g_message("pagefoldd %s: control socket %s, agent socket %s, hash %s", PF_VERSION,
              socket_path ? socket_path : PF_DEFAULT_SOCKET,
              agent_path ? agent_path : PF_DEFAULT_AGENT_SOCKET, hash->name);
#if PF_HAVE_SYSTEMD
    sd_notify(0, "READY=1");
#endif
    g_main_loop_run(loop);
#if PF_HAVE_SYSTEMD
    sd_notify(0, "STOPPING=1");
#endif
    g_message("pagefoldd stopping");
    return 0;
}
