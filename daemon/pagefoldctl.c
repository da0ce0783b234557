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
    "  merge-domain VM [NAME]     the VMs it may share pages with; NAME sets it\n"
    "                             (refused while it shares pages; 'default': all)\n";

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
    g_print("%-20s %7s %-7s %8s %10s %-36s\n", "VM", "PID", "MODE", "REGIONS", "RAM_MIB",
            "UUID");
    for (guint i = 0; i < json_array_get_length(vms); i++) {
        JsonObject *vm = json_array_get_object_element(vms, i);
        JsonArray *regions = json_object_get_array_member(vm, "regions");
        const char *uuid = json_object_get_string_member_with_default(vm, "uuid", NULL);

        g_print("%-20s %7" G_GINT64_FORMAT " %-7s %8u %10.1f %-36s\n",
                json_object_get_string_member(vm, "name"),
                json_object_get_int_member(vm, "pid"),
                json_object_get_string_member(vm, "mode"),
                json_array_get_length(regions),
                (double)json_object_get_int_member(vm, "pages") * PF_PAGE_SIZE / 1048576.0,
                uuid != NULL ? uuid : "-");
        /* Regions that are not scanned, and why. */
        for (guint k = 0; k < json_array_get_length(regions); k++) {
            JsonObject *r = json_array_get_object_element(regions, k);
            const char *why = json_object_get_string_member_with_default(r, "refused", NULL);

            if (why != NULL) {
                g_print("  region %u (%s) refused: %s\n", k,
                        json_object_get_string_member(r, "name"), why);
            } else if (json_object_get_boolean_member_with_default(r, "gone", FALSE)) {
                g_print("  region %u (%s) gone\n", k, json_object_get_string_member(r, "name"));
            }
        }
    }
}

static void
print_knobs(JsonObject *knobs)
{
    g_autoptr(GList) names = json_object_get_members(knobs);

    for (GList *l = names; l != NULL; l = l->next) {
        g_print("%-22s %" G_GINT64_FORMAT "\n", (const char *)l->data,
                json_object_get_int_member(knobs, l->data));
    }
}

int
main(int argc, char **argv)
{
    g_autofree char *socket_path = NULL;
    g_autofree char *name = NULL;
    gboolean as_json = FALSE, as_prom = FALSE;
    GOptionEntry entries[] = {
        { "socket", 's', 0, G_OPTION_ARG_FILENAME, &socket_path,
          "pagefoldd's control socket (default " PF_DEFAULT_SOCKET ")", "PATH" },
        { "name", 'n', 0, G_OPTION_ARG_STRING, &name, "Name for attach", "NAME" },
        { "json", 0, 0, G_OPTION_ARG_NONE, &as_json, "Print JSON", NULL },
        { "prometheus", 0, 0, G_OPTION_ARG_NONE, &as_prom,
          "Print stats in Prometheus text format", NULL },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx = g_option_context_new("COMMAND [ARGS]");
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonBuilder) b = json_builder_new();
    g_autoptr(JsonNode) request = NULL;
    g_autoptr(JsonNode) reply = NULL;
    JsonObject *robj;
    JsonNode *ret;
    const char *cmd;
    guint64 num = 0;

    setlocale(LC_ALL, "");
    g_option_context_add_main_entries(ctx, entries, NULL);
    g_option_context_set_description(ctx, usage_text);
    if (!g_option_context_parse(ctx, &argc, &argv, &error)) {
        return usage_error(error->message);
    }
    if (argc < 2) {
        return usage_error("no command given");
    }
    if (as_json && as_prom) {
        return usage_error("--json and --prometheus exclude each other");
    }
    cmd = argv[1];
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "execute");
    json_builder_add_string_value(b, cmd);
    json_builder_set_member_name(b, "arguments");
    json_builder_begin_object(b);
    if (g_str_equal(cmd, "attach")) {
        if (argc != 3) {
            return usage_error("attach takes one PID");
        }
        if (!pf_parse_u64(argv[2], 1, G_MAXINT, &num, &error)) {
            return usage_error(error->message);
        }
        json_builder_set_member_name(b, "pid");
        json_builder_add_int_value(b, (gint64)num);
        if (name != NULL) {
            json_builder_set_member_name(b, "name");
            json_builder_add_string_value(b, name);
        }
    } else if (g_str_equal(cmd, "detach")) {
        if (argc != 3) {
            return usage_error("detach takes one VM");
        }
        json_builder_set_member_name(b, "vm");
        json_builder_add_string_value(b, argv[2]);
    } else if (g_str_equal(cmd, "merge-domain")) {
        if (argc != 3 && argc != 4) {
            return usage_error("merge-domain takes VM [NAME]");
        }
        json_builder_set_member_name(b, "vm");
        json_builder_add_string_value(b, argv[2]);
        if (argc == 4) {
            json_builder_set_member_name(b, "name");
            json_builder_add_string_value(b, argv[3]);
        }
    } else if (g_str_equal(cmd, "stats") || g_str_equal(cmd, "unmerge")) {
        if (argc > 3) {
            return usage_error("this command takes at most one VM");
        }
        if (argc == 3) {
            json_builder_set_member_name(b, "vm");
            json_builder_add_string_value(b, argv[2]);
        }
    } else if (g_str_equal(cmd, "set")) {
        if (argc != 4) {
            return usage_error("set takes KNOB VALUE");
        }
        if (!pf_parse_u64(argv[3], 0, G_MAXINT64, &num, &error)) {
            return usage_error(error->message);
        }
        json_builder_set_member_name(b, "knob");
        json_builder_add_string_value(b, argv[2]);
        json_builder_set_member_name(b, "value");
        json_builder_add_int_value(b, (gint64)num);
    } else if (g_str_equal(cmd, "scan-now")) {
        if (argc > 3) {
            return usage_error("scan-now takes at most one PASSES");
        }
        if (argc == 3) {
            if (!pf_parse_u64(argv[2], 1, 1000, &num, &error)) {
                return usage_error(error->message);
            }
            json_builder_set_member_name(b, "passes");
            json_builder_add_int_value(b, (gint64)num);
        }
    } else if (g_str_equal(cmd, "list") || g_str_equal(cmd, "knobs")) {
        if (argc != 2) {
            return usage_error("this command takes no arguments");
        }
    } else {
        g_autofree char *msg = g_strdup_printf("unknown command '%s'", cmd);

        return usage_error(msg);
    }
    json_builder_end_object(b);
    json_builder_end_object(b);
    request = json_builder_get_root(b);

    reply = pf_client_call(socket_path ? socket_path : PF_DEFAULT_SOCKET, request, -1, &error);
    if (reply == NULL) {
        g_printerr("pagefoldctl: %s\n", error->message);
        return 1;
    }
    robj = JSON_NODE_HOLDS_OBJECT(reply) ? json_node_get_object(reply) : NULL;
    if (robj != NULL && json_object_has_member(robj, "error")) {
        JsonObject *e = json_object_get_object_member(robj, "error");

        g_printerr("pagefoldctl: %s: %s\n", cmd, json_object_get_string_member(e, "desc"));
        return 1;
    }
    if (robj == NULL || !json_object_has_member(robj, "return")) {
        g_printerr("pagefoldctl: pagefoldd sent a reply without 'return'\n");
        return 1;
    }
    ret = json_object_get_member(robj, "return");
    for (guint k = 0; k < 2 && JSON_NODE_HOLDS_OBJECT(ret); k++) {
        static const char *const notes[] = { "detached", "passed_over" };
        JsonObject *r = json_node_get_object(ret);
        JsonArray *d = json_object_has_member(r, notes[k])
                           ? json_object_get_array_member(r, notes[k]) : NULL;

        for (guint i = 0; d != NULL && i < json_array_get_length(d); i++) {
            g_printerr("pagefoldctl: %s: %s: %s\n", cmd, k == 0 ? "detached meanwhile"
                                                               : "not all done",
                       json_array_get_string_element(d, i));
        }
    }
    if (as_json) {
        print_json(ret);
    } else if (g_str_equal(cmd, "stats") || g_str_equal(cmd, "scan-now") ||
               g_str_equal(cmd, "unmerge")) {
        g_autofree char *text = as_prom
            ? pf_stats_format_prometheus(json_node_get_object(ret))
            : pf_stats_format_table(json_node_get_object(ret));

        g_print("%s", text);
    } else if (g_str_equal(cmd, "list")) {
        print_list(json_node_get_array(ret));
    } else if (g_str_equal(cmd, "knobs") || g_str_equal(cmd, "set")) {
        print_knobs(json_node_get_object(ret));
    } else if (g_str_equal(cmd, "attach")) {
        JsonObject *vm = json_node_get_object(ret);

        g_print("attached VM %s (pid %" G_GINT64_FORMAT ", mode %s): %u region(s), %.1f MiB\n",
                json_object_get_string_member(vm, "name"), json_object_get_int_member(vm, "pid"),
                json_object_get_string_member(vm, "mode"),
                json_array_get_length(json_object_get_array_member(vm, "regions")),
                (double)json_object_get_int_member(vm, "pages") * PF_PAGE_SIZE / 1048576.0);
    } else if (g_str_equal(cmd, "detach")) {
        g_print("detached VM %s\n", argv[2]);
    } else if (g_str_equal(cmd, "merge-domain")) {
        JsonObject *vm = json_node_get_object(ret);

        g_print("VM %s (pid %" G_GINT64_FORMAT "): merge domain %s\n",
                json_object_get_string_member(vm, "name"), json_object_get_int_member(vm, "pid"),
                json_object_get_string_member(vm, "merge_domain"));
    }
    return 0;
}
