/*
 * control.c - see control.h.
 */
#include "control.h"

#include "jobs.h"

#include <errno.h>
#include <fcntl.h>
#include <glib-unix.h>
#include <glib/gstdio.h>
#include <json-glib/json-glib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "pf-config.h"
#include "util.h"

#define MAX_CLIENTS 64
#define MAX_PENDING_OUTPUT (16u << 20)
#define MAX_SCAN_NOW_PASSES 1000

struct _PfControl {
    PfScanner *scanner;
    char *path;
    int listen_fd;
    guint listen_watch;
    GPtrArray *clients;
    struct _Later *starting; /* set by a command that replies later */
};

typedef struct _Later Later;

typedef struct {
    PfControl *ctl;
    int fd;
    guint watch;
    guint out_watch;
    GByteArray *in;
    GByteArray *out;
    gboolean discarding; /* inside an over-long line: drop to its end */
    Later *later;        /* the command it waits for: its next lines wait
                          * too, as QMP answers in order */
} Client;

/*
 * A command that replies when its job is done (scan-now, unmerge, set run
 * 2): the main loop runs on meanwhile, other clients are answered, and
 * the reply says what was done, or why not all of it.
 */
struct _Later {
    PfControl *c;
    Client *cl;      /* NULL: pf_control_execute()'s caller waits */
    JsonNode *id;
    const char *command;
    int pid;         /* unmerge of one VM (its stats in the reply); 0: all */
    PfScanJob *job;
    char *reply;     /* once done */
};

/* ---- argument checking ---- */

typedef enum { ARG_INT, ARG_STRING } ArgType;

typedef struct {
    const char *name;
    ArgType type;
    gboolean required;
} ArgSpec;

static gboolean
check_args(JsonObject *args, const ArgSpec *spec, GError **error)
{
    g_autoptr(GList) members = args ? json_object_get_members(args) : NULL;

    for (GList *l = members; l != NULL; l = l->next) {
        const ArgSpec *a = spec;

        while (a->name != NULL && g_strcmp0(a->name, l->data) != 0) {
            a++;
        }
        if (a->name == NULL) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "parameter '%s' is unexpected", (const char *)l->data);
            return FALSE;
        }
    }
    for (const ArgSpec *a = spec; a->name != NULL; a++) {
        JsonNode *n = args ? json_object_get_member(args, a->name) : NULL;
        GType want = a->type == ARG_INT ? G_TYPE_INT64 : G_TYPE_STRING;

        if (n == NULL) {
            if (a->required) {
                g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                            "parameter '%s' is missing", a->name);
                return FALSE;
            }
            continue;
        }
        if (!JSON_NODE_HOLDS_VALUE(n) || json_node_get_value_type(n) != want) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "parameter '%s' must be %s", a->name,
                        a->type == ARG_INT ? "an integer" : "a string");
            return FALSE;
        }
    }
    return TRUE;
}

static gint64
arg_int(JsonObject *args, const char *name, gint64 dflt)
{
    return args && json_object_has_member(args, name)
               ? json_object_get_int_member(args, name) : dflt;
}

static const char *
arg_str(JsonObject *args, const char *name)
{
    return args && json_object_has_member(args, name)
               ? json_object_get_string_member(args, name) : NULL;
}

/* A VM by pid, UUID or name (pf_scanner_lookup_vm()). */
static PfVm *
find_vm(PfControl *c, const char *key, GError **error)
{
    return pf_scanner_lookup_vm(c->scanner, key, error);
}

/* ---- commands ---- */

/* The members that name a VM in every answer about it. */
static void
vm_identity_to_json(PfVm *vm, JsonBuilder *b)
{
    char uuid[37];

    json_builder_set_member_name(b, "name");
    json_builder_add_string_value(b, vm->name);
    json_builder_set_member_name(b, "pid");
    json_builder_add_int_value(b, vm->pid);
    json_builder_set_member_name(b, "uuid");
    if (pf_vm_uuid_string(vm, uuid) != NULL) {
        json_builder_add_string_value(b, uuid);
    } else {
        json_builder_add_null_value(b);
    }
    json_builder_set_member_name(b, "merge_domain");
    json_builder_add_string_value(b, vm->scanner ? pf_scanner_merge_domain(vm->scanner, vm)
                                                 : "default");
    json_builder_set_member_name(b, "mode");
    json_builder_add_string_value(b, pf_vm_mode_name(vm));
    if (vm->mode_reason != NULL) {
        json_builder_set_member_name(b, "mode_reason");
        json_builder_add_string_value(b, vm->mode_reason);
    }
}

static void
vm_to_json(PfVm *vm, JsonBuilder *b)
{
    json_builder_begin_object(b);
    vm_identity_to_json(vm, b);
    json_builder_set_member_name(b, "pages");
    json_builder_add_int_value(b, (gint64)pf_vm_n_pages(vm));
    json_builder_set_member_name(b, "regions");
    json_builder_begin_array(b);
    for (guint i = 0; i < vm->regions->len; i++) {
        PfRegion *r = g_ptr_array_index(vm->regions, i);

        json_builder_begin_object(b);
        json_builder_set_member_name(b, "name");
        json_builder_add_string_value(b, r->name);
        json_builder_set_member_name(b, "host_addr");
        json_builder_add_int_value(b, (gint64)r->host_addr);
        json_builder_set_member_name(b, "size");
        json_builder_add_int_value(b, (gint64)r->size);
        /* A placeholder keeps the agent's index: say why it is not
         * scanned. */
        if (r->refused != NULL) {
            json_builder_set_member_name(b, "refused");
            json_builder_add_string_value(b, r->refused);
        } else if (r->gone) {
            json_builder_set_member_name(b, "gone");
            json_builder_add_boolean_value(b, TRUE);
        }
        json_builder_end_object(b);
    }
    json_builder_end_array(b);
    json_builder_end_object(b);
}

/* "merge" when every VM merges, "advise" when none does, else "mixed". */
static const char *
daemon_mode(GPtrArray *vms)
{
    guint merging = 0;

    for (guint i = 0; i < vms->len; i++) {
        merging += pf_vm_merges(g_ptr_array_index(vms, i));
    }
    return merging == 0 ? "advise" : merging == vms->len ? "merge" : "mixed";
}

static void
notes_to_json(JsonBuilder *b, const char *name, GPtrArray *notes)
{
    if (notes == NULL || notes->len == 0) {
        return;
    }
    json_builder_set_member_name(b, name);
    json_builder_begin_array(b);
    for (guint i = 0; i < notes->len; i++) {
        json_builder_add_string_value(b, g_ptr_array_index(notes, i));
    }
    json_builder_end_array(b);
}

/* detached, passed_over: notes of the VMs a command could not do all for
 * (scan.h), or NULL. */
static void
stats_to_json(PfControl *c, PfVm *only, JsonBuilder *b, GPtrArray *detached,
              GPtrArray *passed_over)
{
    GPtrArray *vms = pf_scanner_get_vms(c->scanner);
    g_autofree PfCounters *per_vm = g_new0(PfCounters, MAX(vms->len, 1));
    PfCounters total;
    PfScanInfo info;

    pf_scanner_collect(c->scanner, &total, per_vm);
    pf_scanner_get_info(c->scanner, &info);
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "mode");
    json_builder_add_string_value(b, daemon_mode(vms));
    json_builder_set_member_name(b, "hash");
    json_builder_add_string_value(b, pf_scanner_get_hash(c->scanner)->name);
    json_builder_set_member_name(b, "last_pass_usec");
    json_builder_add_int_value(b, (gint64)info.last_pass_usec);
    json_builder_set_member_name(b, "cow_detection");
    json_builder_add_string_value(b, info.cow_detection);
    json_builder_set_member_name(b, "pool_slots");
    json_builder_add_int_value(b, (gint64)info.pool_slots);
    json_builder_set_member_name(b, "pool_bytes");
    json_builder_add_int_value(b, (gint64)info.pool_bytes);
    json_builder_set_member_name(b, "pool_chunks");
    json_builder_add_int_value(b, (gint64)info.pool_chunks);
    json_builder_set_member_name(b, "knobs");
    json_builder_begin_object(b);
    pf_knobs_to_json(pf_scanner_get_knobs(c->scanner), b);
    json_builder_end_object(b);
    json_builder_set_member_name(b, "total");
    json_builder_begin_object(b);
    pf_counters_to_json(&total, b);
    json_builder_end_object(b);
    json_builder_set_member_name(b, "vms");
    json_builder_begin_array(b);
    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);

        if (only != NULL && only != vm) {
            continue;
        }
        json_builder_begin_object(b);
        vm_identity_to_json(vm, b);
        pf_counters_to_json(&per_vm[i], b);
        json_builder_end_object(b);
    }
    json_builder_end_array(b);
    notes_to_json(b, "detached", detached);
    notes_to_json(b, "passed_over", passed_over);
    json_builder_end_object(b);
}

static gboolean
cmd_attach(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    gint64 pid;
    const char *name, *uuid_text, *domain;
    guint8 uuid[16];
    g_autoptr(PfVm) vm = NULL;
    PfVm *added;
    GPtrArray *vms = pf_scanner_get_vms(c->scanner);

    pid = arg_int(args, "pid", 0);
    name = arg_str(args, "name");
    uuid_text = arg_str(args, "uuid");
    domain = arg_str(args, "merge-domain");
    if (pid <= 0 || pid > G_MAXINT) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pid must be a positive process id, not %" G_GINT64_FORMAT, pid);
        return FALSE;
    }
    if (name != NULL && !pf_label_is_valid("a VM name", name, error)) {
        return FALSE;
    }
    /* The caller's UUID (libvirt's, from the domain XML through its hook)
     * labels the VM rather than what QEMU's -uuid says, if anything. */
    if (uuid_text != NULL && !pf_uuid_parse(uuid_text, uuid)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "uuid must be 32 hex digits, dashes or not, not '%s'", uuid_text);
        return FALSE;
    }
    if (domain != NULL && !pf_label_is_valid("a merge domain", domain, error)) {
        return FALSE;
    }
    for (guint i = 0; i < vms->len; i++) {
        PfVm *o = g_ptr_array_index(vms, i);

        if (o->pid == pid) {
            g_set_error(error, PF_ERROR, PF_ERROR_EXISTS,
                        "process %d is already attached as VM '%s'", o->pid, o->name);
            return FALSE;
        }
    }
    /* A name is a label, which another VM may have too: only the process
     * must not be attached twice. */
    vm = pf_vm_attach((int)pid, name, error);
    if (vm == NULL) {
        return FALSE;
    }
    if (uuid_text != NULL) {
        memcpy(vm->uuid, uuid, sizeof(vm->uuid));
    }
    g_message("VM %s (pid %d) attached in mode %s: %u region(s), %zu pages",
              vm->name, vm->pid, pf_vm_mode_name(vm), vm->regions->len, pf_vm_n_pages(vm));
    added = g_steal_pointer(&vm);
    pf_scanner_add_vm(c->scanner, added);
    /* In its domain before the scanner sees a page of it (the libvirt
     * hook's case): set later, it could be refused, having shared pages
     * in the default one.  Nothing shared yet: it cannot fail. */
    if (domain != NULL && !pf_scanner_set_merge_domain(c->scanner, added, domain, error)) {
        pf_scanner_remove_vm(c->scanner, added);
        return FALSE;
    }
    vm_to_json(added, b);
    return TRUE;
}

/* Reads a VM's merge domain, or sets it (name). */
static gboolean
cmd_merge_domain(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = find_vm(c, arg_str(args, "vm"), error);
    const char *name = arg_str(args, "name");

    if (vm == NULL || (name != NULL && !pf_label_is_valid("a merge domain", name, error)) ||
        (name != NULL && !pf_scanner_set_merge_domain(c->scanner, vm, name, error))) {
        return FALSE;
    }
    json_builder_begin_object(b);
    vm_identity_to_json(vm, b);
    json_builder_end_object(b);
    return TRUE;
}

static gboolean
cmd_detach(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = find_vm(c, arg_str(args, "vm"), error);

    if (vm == NULL) {
        return FALSE;
    }
    pf_scanner_detach(c->scanner, vm, "detached on request");
    json_builder_begin_object(b);
    json_builder_end_object(b);
    return TRUE;
}

static gboolean
cmd_list(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    GPtrArray *vms = pf_scanner_get_vms(c->scanner);

    json_builder_begin_array(b);
    for (guint i = 0; i < vms->len; i++) {
        vm_to_json(g_ptr_array_index(vms, i), b);
    }
    json_builder_end_array(b);
    return TRUE;
}

static gboolean
cmd_stats(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = NULL;

    if (arg_str(args, "vm") != NULL && (vm = find_vm(c, arg_str(args, "vm"), error)) == NULL) {
        return FALSE;
    }
    stats_to_json(c, vm, b, NULL, NULL);
    return TRUE;
}

static gboolean
cmd_knobs(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    json_builder_begin_object(b);
    pf_knobs_to_json(pf_scanner_get_knobs(c->scanner), b);
    json_builder_end_object(b);
    return TRUE;
}

static void later_done(PfScanner *s, const GError *error, GPtrArray *detached,
                       GPtrArray *passed_over, gpointer user);

/* The command being run replies when its job is done. */
static Later *
reply_later(PfControl *c, const char *command)
{
    Later *l = g_new0(Later, 1);

    l->c = c;
    l->command = command;
    c->starting = l;
    return l;
}

static gboolean
cmd_set(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    gint64 value = arg_int(args, "value", 0);

    if (value < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%s must not be negative", arg_str(args, "knob"));
        return FALSE;
    }
    if (!pf_knobs_set(pf_scanner_get_knobs(c->scanner), arg_str(args, "knob"),
                      (guint64)value, error)) {
        return FALSE;
    }
    if (g_str_equal(arg_str(args, "knob"), "run") && value == 2) {
        /* As KSM: unmerge everything, then stay stopped; the reply comes
         * when every page is unmerged. */
        Later *l = reply_later(c, "set run 2");

        pf_scanner_get_knobs(c->scanner)->run = 0;
        l->job = pf_scanner_unmerge_async(c->scanner, NULL, later_done, l);
        return TRUE;
    }
    pf_scanner_kick(c->scanner);
    return cmd_knobs(c, NULL, b, error);
}

static gboolean
cmd_scan_now(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    gint64 passes = arg_int(args, "passes", 1);

    if (passes < 1 || passes > MAX_SCAN_NOW_PASSES) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "passes must be between 1 and %d", MAX_SCAN_NOW_PASSES);
        return FALSE;
    }
    {
        Later *l = reply_later(c, "scan-now");

        l->job = pf_scanner_run_passes_async(c->scanner, (guint)passes, later_done, l);
    }
    return TRUE;
}

static gboolean
cmd_unmerge(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = NULL;

    Later *l;

    if (arg_str(args, "vm") != NULL && (vm = find_vm(c, arg_str(args, "vm"), error)) == NULL) {
        return FALSE;
    }
    l = reply_later(c, "unmerge");
    l->pid = vm != NULL ? vm->pid : 0;
    l->job = pf_scanner_unmerge_async(c->scanner, vm, later_done, l);
    return TRUE;
}

static gboolean
cmd_capabilities(PfControl *c, JsonObject *args, JsonBuilder *b, GError **error)
{
    json_builder_begin_object(b);
    json_builder_end_object(b);
    return TRUE;
}

typedef gboolean (*CommandFunc)(PfControl *c, JsonObject *args, JsonBuilder *b,
                                GError **error);

#define ARGS(...) ((const ArgSpec[]){ __VA_ARGS__ { NULL } })

/* Each command's arguments are checked here, before it runs. */
static const struct {
    const char *name;
    CommandFunc func;
    const ArgSpec *args;
} commands[] = {
    { "qmp_capabilities", cmd_capabilities, ARGS() },
    { "attach", cmd_attach, ARGS({ "pid", ARG_INT, TRUE }, { "name", ARG_STRING, FALSE },
                                 { "uuid", ARG_STRING, FALSE },
                                 { "merge-domain", ARG_STRING, FALSE }, ) },
    { "detach", cmd_detach, ARGS({ "vm", ARG_STRING, TRUE }, ) },
    { "merge-domain", cmd_merge_domain,
      ARGS({ "vm", ARG_STRING, TRUE }, { "name", ARG_STRING, FALSE }, ) },
    { "list", cmd_list, ARGS() },
    { "stats", cmd_stats, ARGS({ "vm", ARG_STRING, FALSE }, ) },
    { "knobs", cmd_knobs, ARGS() },
    { "set", cmd_set, ARGS({ "knob", ARG_STRING, TRUE }, { "value", ARG_INT, TRUE }, ) },
    { "scan-now", cmd_scan_now, ARGS({ "passes", ARG_INT, FALSE }, ) },
    { "unmerge", cmd_unmerge, ARGS({ "vm", ARG_STRING, FALSE }, ) },
};

#undef ARGS

/* ---- requests ---- */

static char *
reply_error(const char *klass, const char *desc, JsonNode *id)
{
    g_autoptr(JsonBuilder) b = json_builder_new();
    g_autoptr(JsonNode) root = NULL;

    json_builder_begin_object(b);
    json_builder_set_member_name(b, "error");
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "class");
    json_builder_add_string_value(b, klass);
    json_builder_set_member_name(b, "desc");
    json_builder_add_string_value(b, desc);
    json_builder_end_object(b);
    if (id != NULL) {
        json_builder_set_member_name(b, "id");
        json_builder_add_value(b, json_node_copy(id));
    }
    json_builder_end_object(b);
    root = json_builder_get_root(b);
    return json_to_string(root, FALSE);
}

static const char *
error_class(const GError *error)
{
    if (g_error_matches(error, PF_ERROR, PF_ERROR_NOT_FOUND)) {
        return "DeviceNotFound";
    }
    return "GenericError";
}

/* The reply to one request line, or NULL when a job will give it (then
 * *later is that job's). */
static char *
execute(PfControl *c, const char *line, gsize len, Later **later)
{
    g_autoptr(JsonParser) parser = json_parser_new_immutable();
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonBuilder) b = NULL;
    g_autoptr(JsonNode) reply = NULL;
    g_autoptr(GList) members = NULL;
    JsonObject *req, *args = NULL;
    JsonNode *root, *id, *exec, *args_node;
    const char *name;

    if (!g_utf8_validate(line, (gssize)len, NULL)) {
        return reply_error("GenericError", "request is not valid UTF-8", NULL);
    }
    if (!json_parser_load_from_data(parser, line, (gssize)len, &error)) {
        g_autofree char *desc = g_strdup_printf("JSON parse error: %s", error->message);

        return reply_error("GenericError", desc, NULL);
    }
    root = json_parser_get_root(parser);
    if (root == NULL || !JSON_NODE_HOLDS_OBJECT(root)) {
        return reply_error("GenericError", "a request must be a JSON object", NULL);
    }
    req = json_node_get_object(root);
    id = json_object_get_member(req, "id");
    members = json_object_get_members(req);
    for (GList *l = members; l != NULL; l = l->next) {
        if (!g_str_equal(l->data, "execute") && !g_str_equal(l->data, "arguments") &&
            !g_str_equal(l->data, "id")) {
            g_autofree char *desc = g_strdup_printf("request member '%s' is unexpected",
                                                    (const char *)l->data);

            return reply_error("GenericError", desc, id);
        }
    }
    exec = json_object_get_member(req, "execute");
    if (exec == NULL || !JSON_NODE_HOLDS_VALUE(exec) ||
        json_node_get_value_type(exec) != G_TYPE_STRING) {
        return reply_error("GenericError", "'execute' must be a command name (string)", id);
    }
    args_node = json_object_get_member(req, "arguments");
    if (args_node != NULL) {
        if (!JSON_NODE_HOLDS_OBJECT(args_node)) {
            return reply_error("GenericError", "'arguments' must be an object", id);
        }
        args = json_node_get_object(args_node);
    }
    name = json_node_get_string(exec);
    for (gsize i = 0; i < G_N_ELEMENTS(commands); i++) {
        if (!g_str_equal(commands[i].name, name)) {
            continue;
        }
        b = json_builder_new();
        json_builder_begin_object(b);
        json_builder_set_member_name(b, "return");
        c->starting = NULL;
        if (!check_args(args, commands[i].args, &error) ||
            !commands[i].func(c, args, b, &error)) {
            g_assert(c->starting == NULL);
            return reply_error(error_class(error), error->message, id);
        }
        if (c->starting != NULL) {
            *later = g_steal_pointer(&c->starting);
            (*later)->id = id != NULL ? json_node_copy(id) : NULL;
            return NULL;
        }
        if (id != NULL) {
            json_builder_set_member_name(b, "id");
            json_builder_add_value(b, json_node_copy(id));
        }
        json_builder_end_object(b);
        reply = json_builder_get_root(b);
        return json_to_string(reply, FALSE);
    }
    {
        g_autofree char *desc = g_strdup_printf("the command '%s' has not been found", name);

        return reply_error("CommandNotFound", desc, id);
    }
}

static void
later_free(Later *l)
{
    if (l->job != NULL) {
        pf_scan_job_forget(l->job);
    }
    g_clear_pointer(&l->id, json_node_unref);
    g_free(l->reply);
    g_free(l);
}

static void client_process(Client *cl);
static gboolean client_flush(Client *cl);
static void client_send(Client *cl, const char *text);
static gboolean client_in_cb(gint fd, GIOCondition cond, gpointer user);

static void
later_done(PfScanner *s, const GError *error, GPtrArray *detached, GPtrArray *passed_over,
           gpointer user)
{
    Later *l = user;
    Client *cl = l->cl;
    PfVm *vm = l->pid != 0 ? pf_scanner_find_vm_by_pid(s, l->pid) : NULL;

    l->job = NULL;
    if (error == NULL && l->pid != 0 && vm == NULL) {
        g_autofree char *desc = g_strdup_printf("%s: VM of pid %d went meanwhile (its process "
                                                "exited)", l->command, l->pid);

        l->reply = reply_error("DeviceNotFound", desc, l->id);
    } else if (error != NULL) {
        g_autofree char *desc = g_strdup_printf("%s: %s", l->command, error->message);

        l->reply = reply_error("GenericError", desc, l->id);
    } else {
        g_autoptr(JsonBuilder) b = json_builder_new();
        g_autoptr(JsonNode) root = NULL;

        json_builder_begin_object(b);
        json_builder_set_member_name(b, "return");
        if (g_str_equal(l->command, "set run 2")) {
            json_builder_begin_object(b);
            pf_knobs_to_json(pf_scanner_get_knobs(s), b);
            json_builder_end_object(b);
        } else {
            stats_to_json(l->c, vm, b, detached, passed_over);
        }
        if (l->id != NULL) {
            json_builder_set_member_name(b, "id");
            json_builder_add_value(b, json_node_copy(l->id));
        }
        json_builder_end_object(b);
        root = json_builder_get_root(b);
        l->reply = json_to_string(root, FALSE);
    }
    if (cl == NULL) {
        return; /* pf_control_execute() takes the reply */
    }
    client_send(cl, l->reply);
    cl->later = NULL;
    later_free(l);
    if (cl->watch == 0) {
        cl->watch = g_unix_fd_add(cl->fd, G_IO_IN | G_IO_HUP | G_IO_ERR, client_in_cb, cl);
    }
    /* The lines that waited behind it. */
    client_process(cl);
    client_flush(cl);
}

char *
pf_control_execute(PfControl *c, const char *line, gsize len)
{
    Later *l = NULL;
    char *reply = execute(c, line, len, &l);

    if (reply != NULL) {
        return reply;
    }
    while (l->reply == NULL) {
        g_main_context_iteration(NULL, TRUE);
    }
    reply = g_steal_pointer(&l->reply);
    later_free(l);
    return reply;
}

/* ---- the socket ---- */

static void
client_close(Client *cl)
{
    g_ptr_array_remove(cl->ctl->clients, cl);
}

static gboolean client_out_cb(gint fd, GIOCondition cond, gpointer user);

/* Returns FALSE when it had to close the client (cl is then freed). */
static gboolean
client_flush(Client *cl)
{
    while (cl->out->len > 0) {
        ssize_t n = send(cl->fd, cl->out->data, cl->out->len, MSG_NOSIGNAL);

        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN) {
                break;
            }
            client_close(cl);
            return FALSE;
        }
        g_byte_array_remove_range(cl->out, 0, (guint)n);
    }
    if (cl->out->len > MAX_PENDING_OUTPUT) {
        g_message("control: closing a client that does not read its replies");
        client_close(cl);
        return FALSE;
    }
    if (cl->out->len > 0 && cl->out_watch == 0) {
        cl->out_watch = g_unix_fd_add(cl->fd, G_IO_OUT, client_out_cb, cl);
    }
    return TRUE;
}

static gboolean
client_out_cb(gint fd, GIOCondition cond, gpointer user)
{
    Client *cl = user;

    cl->out_watch = 0;
    client_flush(cl);
    return G_SOURCE_REMOVE;
}

static void
client_send(Client *cl, const char *text)
{
    g_byte_array_append(cl->out, (const guint8 *)text, (guint)strlen(text));
    g_byte_array_append(cl->out, (const guint8 *)"\n", 1);
}

static void
client_process(Client *cl)
{
    guint8 *nl;

    while (cl->later == NULL && (nl = memchr(cl->in->data, '\n', cl->in->len)) != NULL) {
        gsize len = (gsize)(nl - cl->in->data);

        if (cl->discarding) {
            cl->discarding = FALSE;
        } else {
            gsize l = len;

            if (l > 0 && cl->in->data[l - 1] == '\r') {
                l--;
            }
            if (l > 0) {
                g_autofree char *reply =
                    execute(cl->ctl, (const char *)cl->in->data, l, &cl->later);

                if (reply != NULL) {
                    client_send(cl, reply);
                } else {
                    cl->later->cl = cl;
                }
            }
        }
        g_byte_array_remove_range(cl->in, 0, (guint)len + 1);
    }
    if (cl->later == NULL && cl->in->len > PF_CONTROL_MAX_LINE) {
        if (!cl->discarding) {
            g_autofree char *desc = g_strdup_printf(
                "request longer than %d bytes; discarded up to the next newline",
                PF_CONTROL_MAX_LINE);
            g_autofree char *reply = reply_error("GenericError", desc, NULL);

            client_send(cl, reply);
            cl->discarding = TRUE;
        }
        g_byte_array_set_size(cl->in, 0);
    }
}

static gboolean
client_in_cb(gint fd, GIOCondition cond, gpointer user)
{
    Client *cl = user;
    guint8 buf[16384];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);

    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        return G_SOURCE_CONTINUE;
    }
    if (n <= 0) {
        cl->watch = 0;
        client_close(cl);
        return G_SOURCE_REMOVE;
    }
    g_byte_array_append(cl->in, buf, (guint)n);
    client_process(cl);
    if (!client_flush(cl)) {
        return G_SOURCE_REMOVE;
    }
    if (cl->later != NULL && cl->in->len > PF_CONTROL_MAX_LINE) {
        /* Enough waiting behind the job: read on when it is done. */
        cl->watch = 0;
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

static void
client_free(Client *cl)
{
    if (cl->later != NULL) {
        later_free(cl->later);
    }
    if (cl->watch != 0) {
        g_source_remove(cl->watch);
    }
    if (cl->out_watch != 0) {
        g_source_remove(cl->out_watch);
    }
    close(cl->fd);
    g_byte_array_unref(cl->in);
    g_byte_array_unref(cl->out);
    g_free(cl);
}

static gboolean
listen_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfControl *c = user;
    int cfd = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    Client *cl;
    g_autofree char *greeting = NULL;

    if (cfd < 0) {
        return G_SOURCE_CONTINUE;
    }
    if (c->clients->len >= MAX_CLIENTS) {
        static const char busy[] =
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"too many clients\"}}\n";

        (void)!send(cfd, busy, sizeof(busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        close(cfd);
        return G_SOURCE_CONTINUE;
    }
    cl = g_new0(Client, 1);
    cl->ctl = c;
    cl->fd = cfd;
    cl->in = g_byte_array_new();
    cl->out = g_byte_array_new();
    g_ptr_array_add(c->clients, cl);
    greeting = g_strdup_printf(
        "{\"QMP\": {\"version\": {\"pagefold\": \"%s\"}, \"capabilities\": []}}", PF_VERSION);
    client_send(cl, greeting);
    cl->watch = g_unix_fd_add(cfd, G_IO_IN | G_IO_HUP | G_IO_ERR, client_in_cb, cl);
    client_flush(cl);
    return G_SOURCE_CONTINUE;
}

PfControl *
pf_control_new(PfScanner *scanner, const char *path, GError **error)
{
    g_autoptr(PfControl) c = g_new0(PfControl, 1);

    c->scanner = scanner;
    c->clients = g_ptr_array_new_with_free_func((GDestroyNotify)client_free);
    c->listen_fd = pf_unix_listen(path, SOCK_STREAM, error);
    if (c->listen_fd < 0) {
        return NULL;
    }
    c->path = g_strdup(path);
    c->listen_watch = g_unix_fd_add(c->listen_fd, G_IO_IN, listen_cb, c);
    return g_steal_pointer(&c);
}

void
pf_control_free(PfControl *c)
{
    if (c == NULL) {
        return;
    }
    if (c->listen_watch != 0) {
        g_source_remove(c->listen_watch);
    }
    g_clear_pointer(&c->clients, g_ptr_array_unref);
    if (c->listen_fd >= 0) {
        close(c->listen_fd);
    }
    if (c->path != NULL) {
        unlink(c->path);
    }
    g_free(c->path);
    g_free(c);
}
