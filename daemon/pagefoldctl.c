/*
 * pagefoldctl.c - the command-line client of pagefoldd's control socket.
 *
 * Sends one command, prints the answer as a table (default), JSON (--json)
 * or Prometheus text (--prometheus).  Exit status: 0 done, 1 pagefoldd said
 * no or could not be reached, 2 bad usage.  It never changes what pagefoldd
 * answers, only how it is shown.
 */
#include <glib.h>
#include <json-glib/json-glib.h>
#include <locale.h>
#include <string.h>

#include "client.h"
#include "config.h"
#include "escape.h"
#include "stats.h"
#include "util.h"

static const char usage_text[] =
    "Commands:\n"
    "  attach PID [--name NAME]   start scanning a QEMU process's memfd RAM\n"
    "  detach VM                  stop; VM is a pid, a UUID or a name (names may be\n"
    "                             shared: a name two VMs have is refused)\n"
    "  list                       the attached VMs\n"
    "  stats [VM]                 KSM's counters, per VM and in total\n"
    "  knobs                      the knobs and their values\n"
    "  set KNOB VALUE             set a knob (KSM's names)\n"
    "  scan-now [PASSES]          run full passes now, then print stats\n"
    "  unmerge [VM]               put every merged page back in its VM's memory\n"
    "  reload                     read pagefoldd's configuration file again (SIGHUP)\n"
    "  merge-domain VM [NAME]     the VMs it may share pages with; NAME sets it\n"
    "                             (refused while it shares pages; 'default': all)\n";

/*
 * What pagefoldd said, as it is shown in a table or a line: escaped
 * (escape.h).  pagefoldd escapes its peers' words already; this holds
 * for a pagefoldd that did not, or for text that reached it some other
 * way.  JSON (--json) is json-glib's, which escapes control characters.
 * Freed with the next call but three: a line needs at most four.
 */
static const char *
shown(const char *text)
{
    static char *ring[8];
    static guint next;
    char **slot = &ring[next++ % G_N_ELEMENTS(ring)];

    g_free(*slot);
    *slot = text != NULL ? pf_escape_text(text, -1) : NULL;
    return *slot;
}

static int
usage_error(const char *msg)
{
    g_printerr("pagefoldctl: %s\n%s", msg, usage_text);
    return 2;
}

static void
print_json(JsonNode *node)
{
    g_autoptr(JsonGenerator) gen = json_generator_new();
    g_autofree char *text = NULL;

    json_generator_set_pretty(gen, TRUE);
    json_generator_set_root(gen, node);
    text = json_generator_to_data(gen, NULL);
    g_print("%s\n", text);
}

static void
print_list(JsonArray *vms)
{
    g_print("%-20s %7s %-7s %-16s %8s %10s %-36s\n", "VM", "PID", "MODE", "MERGE_DOMAIN",
            "REGIONS", "RAM_MIB", "UUID");
    for (guint i = 0; i < json_array_get_length(vms); i++) {
        JsonObject *vm = json_array_get_object_element(vms, i);
        JsonArray *regions = json_object_get_array_member(vm, "regions");
        const char *uuid = json_object_get_string_member_with_default(vm, "uuid", NULL);
        const char *reason = json_object_get_string_member_with_default(vm, "mode_reason",
                                                                        NULL);

        g_print("%-20s %7" G_GINT64_FORMAT " %-7s %-16s %8u %10.1f %-36s\n",
                shown(json_object_get_string_member(vm, "name")),
                json_object_get_int_member(vm, "pid"),
                shown(json_object_get_string_member(vm, "mode")),
                shown(json_object_get_string_member_with_default(vm, "merge_domain", "-")),
                json_array_get_length(regions),
                (double)json_object_get_int_member(vm, "pages") * PF_PAGE_SIZE / 1048576.0,
                uuid != NULL ? shown(uuid) : "-");
        /* Why it does not merge, where it does not. */
        if (reason != NULL && *reason != '\0') {
            g_print("  advise mode: %s\n", shown(reason));
        }
        /* Regions that are not scanned, and why. */
        for (guint k = 0; k < json_array_get_length(regions); k++) {
            JsonObject *r = json_array_get_object_element(regions, k);
            const char *why = json_object_get_string_member_with_default(r, "refused", NULL);

            if (why != NULL) {
                g_print("  region %u (%s) refused: %s\n", k,
                        shown(json_object_get_string_member(r, "name")), shown(why));
            } else if (json_object_get_boolean_member_with_default(r, "gone", FALSE)) {
                g_print("  region %u (%s) gone\n", k,
                        shown(json_object_get_string_member(r, "name")));
            }
        }
    }
}

static void
print_knobs(JsonObject *knobs)
{
    g_autoptr(GList) names = json_object_get_members(knobs);

    for (GList *l = names; l != NULL; l = l->next) {
        g_print("%-22s %" G_GINT64_FORMAT "\n", shown(l->data),
                json_object_get_int_member(knobs, l->data));
    }
}

/* The command line, once parsed. */
typedef struct {
    char *socket_path;
    char *name;
    gboolean as_json;
    gboolean as_prom;
    int argc; /* argv[1] the command, then its arguments */
    char **argv;
} Invocation;

static void
invocation_clear(Invocation *inv)
{
    g_free(inv->socket_path);
    g_free(inv->name);
}
G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Invocation, invocation_clear)

/* The options into inv; 0, or 2 after a usage error (said). */
static int
parse_options(Invocation *inv, int argc, char **argv)
{
    GOptionEntry entries[] = {
        { "socket", 's', 0, G_OPTION_ARG_FILENAME, &inv->socket_path,
          "pagefoldd's control socket (default: the configuration file's, else "
          PF_DEFAULT_SOCKET ")", "PATH" },
        { "name", 'n', 0, G_OPTION_ARG_STRING, &inv->name, "Name for attach", "NAME" },
        { "json", 0, 0, G_OPTION_ARG_NONE, &inv->as_json, "Print JSON", NULL },
        { "prometheus", 0, 0, G_OPTION_ARG_NONE, &inv->as_prom,
          "Print stats in Prometheus text format", NULL },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx = g_option_context_new("COMMAND [ARGS]");
    g_autoptr(GError) error = NULL;

    g_option_context_add_main_entries(ctx, entries, NULL);
    g_option_context_set_description(ctx, usage_text);
    if (!g_option_context_parse(ctx, &argc, &argv, &error)) {
        return usage_error(error->message);
    }
    if (argc < 2) {
        return usage_error("no command given");
    }
    if (inv->as_json && inv->as_prom) {
        return usage_error("--json and --prometheus exclude each other");
    }
    inv->argc = argc;
    inv->argv = argv;
    return 0;
}

/* ---- each command's arguments: into the request's "arguments", 0, or 2
 * after a usage error (said) ---- */

static void
add_string(JsonBuilder *b, const char *member, const char *value)
{
    json_builder_set_member_name(b, member);
    json_builder_add_string_value(b, value);
}

/* A number in [min, max] as an integer member. */
static int
add_number(JsonBuilder *b, const char *member, const char *text, guint64 min, guint64 max)
{
    g_autoptr(GError) error = NULL;
    guint64 num;

    if (!pf_parse_u64(text, min, max, &num, &error)) {
        return usage_error(error->message);
    }
    json_builder_set_member_name(b, member);
    json_builder_add_int_value(b, (gint64)num);
    return 0;
}

static int
args_attach(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc != 3) {
        return usage_error("attach takes one PID");
    }
    if (add_number(b, "pid", inv->argv[2], 1, G_MAXINT) != 0) {
        return 2;
    }
    if (inv->name != NULL) {
        add_string(b, "name", inv->name);
    }
    return 0;
}

static int
args_detach(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc != 3) {
        return usage_error("detach takes one VM");
    }
    add_string(b, "vm", inv->argv[2]);
    return 0;
}

static int
args_merge_domain(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc != 3 && inv->argc != 4) {
        return usage_error("merge-domain takes VM [NAME]");
    }
    add_string(b, "vm", inv->argv[2]);
    if (inv->argc == 4) {
        add_string(b, "name", inv->argv[3]);
    }
    return 0;
}

/* stats and unmerge: of one VM, or of all. */
static int
args_maybe_vm(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc > 3) {
        return usage_error("this command takes at most one VM");
    }
    if (inv->argc == 3) {
        add_string(b, "vm", inv->argv[2]);
    }
    return 0;
}

static int
args_set(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc != 4) {
        return usage_error("set takes KNOB VALUE");
    }
    add_string(b, "knob", inv->argv[2]);
    return add_number(b, "value", inv->argv[3], 0, G_MAXINT64);
}

static int
args_scan_now(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc > 3) {
        return usage_error("scan-now takes at most one PASSES");
    }
    if (inv->argc == 3) {
        return add_number(b, "passes", inv->argv[2], 1, 1000);
    }
    return 0;
}

/* list and knobs. */
static int
args_none(JsonBuilder *b, const Invocation *inv)
{
    if (inv->argc != 2) {
        return usage_error("this command takes no arguments");
    }
    return 0;
}

/* ---- each command's answer as text (--json prints it as it is) ---- */

/* stats, scan-now and unmerge answer with the figures. */
static void
show_stats(JsonNode *ret, const Invocation *inv)
{
    g_autofree char *text = inv->as_prom
        ? pf_stats_format_prometheus(json_node_get_object(ret))
        : pf_stats_format_table(json_node_get_object(ret),
                                /* stats VM, unmerge VM: that VM's row */
                                inv->argc < 3 || g_str_equal(inv->argv[1], "scan-now"));

    g_print("%s", text);
}

static void
show_list(JsonNode *ret, const Invocation *inv)
{
    print_list(json_node_get_array(ret));
}

/* knobs and set answer with every knob. */
static void
show_knobs(JsonNode *ret, const Invocation *inv)
{
    print_knobs(json_node_get_object(ret));
}

static void
show_attached(JsonNode *ret, const Invocation *inv)
{
    JsonObject *vm = json_node_get_object(ret);

    g_print("attached VM %s (pid %" G_GINT64_FORMAT ", mode %s): %u region(s), %.1f MiB\n",
            shown(json_object_get_string_member(vm, "name")),
            json_object_get_int_member(vm, "pid"), shown(json_object_get_string_member(vm, "mode")),
            json_array_get_length(json_object_get_array_member(vm, "regions")),
            (double)json_object_get_int_member(vm, "pages") * PF_PAGE_SIZE / 1048576.0);
}

static void
show_detached(JsonNode *ret, const Invocation *inv)
{
    g_print("detached VM %s\n", shown(inv->argv[2]));
}

static void
show_merge_domain(JsonNode *ret, const Invocation *inv)
{
    JsonObject *vm = json_node_get_object(ret);

    g_print("VM %s (pid %" G_GINT64_FORMAT "): merge domain %s\n",
            shown(json_object_get_string_member(vm, "name")),
            json_object_get_int_member(vm, "pid"),
            shown(json_object_get_string_member(vm, "merge_domain")));
}

typedef struct {
    const char *name;
    int (*arguments)(JsonBuilder *b, const Invocation *inv);
    void (*show)(JsonNode *ret, const Invocation *inv);
} Command;

static const Command commands[] = {
    { "attach", args_attach, show_attached },
    { "detach", args_detach, show_detached },
    { "merge-domain", args_merge_domain, show_merge_domain },
    { "stats", args_maybe_vm, show_stats },
    { "unmerge", args_maybe_vm, show_stats },
    { "set", args_set, show_knobs },
    { "scan-now", args_scan_now, show_stats },
    { "list", args_none, show_list },
    { "knobs", args_none, show_knobs },
    { "reload", args_none, show_knobs },
};

/* {"execute": the command, "arguments": {...}}, or NULL after a usage
 * error (said). */
static JsonNode *
build_request(const Command *command, const Invocation *inv)
{
    g_autoptr(JsonBuilder) b = json_builder_new();

    json_builder_begin_object(b);
    add_string(b, "execute", command->name);
    json_builder_set_member_name(b, "arguments");
    json_builder_begin_object(b);
    if (command->arguments(b, inv) != 0) {
        return NULL;
    }
    json_builder_end_object(b);
    json_builder_end_object(b);
    return json_builder_get_root(b);
}

/* What pagefoldd noted beside its answer: VMs detached while the command
 * ran, and VMs it could not do all of it for. */
static void
print_notes(JsonNode *ret, const char *cmd)
{
    for (guint k = 0; k < 2 && JSON_NODE_HOLDS_OBJECT(ret); k++) {
        static const char *const notes[] = { "detached", "passed_over" };
        JsonObject *r = json_node_get_object(ret);
        JsonArray *d = json_object_has_member(r, notes[k])
                           ? json_object_get_array_member(r, notes[k]) : NULL;

        for (guint i = 0; d != NULL && i < json_array_get_length(d); i++) {
            g_printerr("pagefoldctl: %s: %s: %s\n", cmd, k == 0 ? "detached meanwhile"
                                                               : "not all done",
                       shown(json_array_get_string_element(d, i)));
        }
    }
}

int
main(int argc, char **argv)
{
    g_auto(Invocation) inv = { NULL };
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonNode) request = NULL;
    g_autoptr(JsonNode) ret = NULL;
    const Command *command = NULL;
    const char *cmd;
    int status;

    setlocale(LC_ALL, "");
    if ((status = parse_options(&inv, argc, argv)) != 0) {
        return status;
    }
    cmd = inv.argv[1];
    for (gsize i = 0; i < G_N_ELEMENTS(commands) && command == NULL; i++) {
        command = g_str_equal(commands[i].name, cmd) ? &commands[i] : NULL;
    }
    if (command == NULL) {
        g_autofree char *msg = g_strdup_printf("unknown command '%s'", cmd);

        return usage_error(msg);
    }
    request = build_request(command, &inv);
    if (request == NULL) {
        return 2;
    }
    if (inv.socket_path == NULL) {
        /* Where pagefoldd's configuration file moved it (a file pagefoldd
         * would refuse is pagefoldd's to say so: the default, then). */
        g_autoptr(PfConfig) config = pf_config_load(PF_DEFAULT_CONFIG, FALSE, NULL);

        inv.socket_path = g_strdup(config != NULL && config->socket != NULL ? config->socket
                                                                             : PF_DEFAULT_SOCKET);
    }
    ret = pf_client_execute(inv.socket_path, request, -1,
                            &error);
    if (ret == NULL && g_error_matches(error, PF_CLIENT_ERROR, PF_CLIENT_ERROR_REFUSED)) {
        g_printerr("pagefoldctl: %s: %s\n", cmd, shown(error->message));
        return 1;
    }
    if (ret == NULL) {
        g_printerr("pagefoldctl: %s\n", shown(error->message));
        return 1;
    }
    print_notes(ret, cmd);
    if (inv.as_json) {
        print_json(ret);
    } else {
        command->show(ret, &inv);
    }
    return 0;
}
