/*
 * control-commands.c - the commands of pagefoldd's control socket (see
 * control-commands.h): each request checked whole before anything runs,
 * then one command against the scanner, its reply built here, or a job's
 * once it ends.
 *
 * Owns the PfControlLater of a command that waits for its job, until its
 * caller frees it.  Must never touch a socket or a client, never hold a
 * VM past the request (a VM is looked up again when a job ends: it may
 * have gone), and never start a job for a request it refuses.
 */
#include "control-commands.h"

#include <json-glib/json-glib.h>
#include <string.h>

#include "cpu-use.h"
#include "jobs.h"
#include "util.h"

#define MAX_SCAN_NOW_PASSES 1000

/*
 * One request being executed: on the main loop, against the scanner; or,
 * for a command that only reads (commands[].reads), elsewhere against a
 * view (scanner NULL).
 */
typedef struct {
    PfScanner *scanner;
    const PfControlReload *reload; /* or NULL */
    PfView *view;             /* what the reply is built from, or NULL */
    gboolean counters_read;   /* the reply tells counters */
    PfControlLater *starting; /* set by a command that replies later */
} Request;

/*
 * A command that replies when its job is done (scan-now, unmerge, set run
 * 2): the main loop runs on meanwhile, other clients are answered, and
 * the reply says what was done, or why not all of it.
 */
struct _PfControlLater {
    JsonNode *id;
    const char *command;
    int pid;         /* unmerge of one VM (its stats in the reply); 0: all */
    PfScanJob *job;
    char *reply;     /* once done */
    PfView *view;    /* the scanner as the job left it */
    PfControlLaterFunc func; /* NULL: the caller steals the reply */
    gpointer user;
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
find_vm(Request *r, const char *key, GError **error)
{
    return pf_scanner_lookup_vm(r->scanner, key, error);
}

/* The view a reading command answers from: the one it was given, or the
 * scanner as it is now.  counters: the reply tells them. */
static PfView *
request_view(Request *r, gboolean counters)
{
    r->counters_read |= counters;
    if (r->scanner != NULL && r->view == NULL) {
        r->view = pf_view_new(r->scanner);
    }
    return r->view;
}

/* ---- replies ---- */

/* {"return": ...: what follows is the command's. */
static JsonBuilder *
begin_return(void)
{
    JsonBuilder *b = json_builder_new();

    json_builder_begin_object(b);
    json_builder_set_member_name(b, "return");
    return b;
}

/* The request's id, if it had one, and the reply as text. */
static char *
end_reply(JsonBuilder *b, JsonNode *id)
{
    g_autoptr(JsonNode) root = NULL;

    if (id != NULL) {
        json_builder_set_member_name(b, "id");
        json_builder_add_value(b, json_node_copy(id));
    }
    json_builder_end_object(b);
    root = json_builder_get_root(b);
    return json_to_string(root, FALSE);
}

/*
 * desc made valid UTF-8 first: a reply is JSON, and json-glib's own parse
 * errors quote the request's bad token undecoded (a broken \u escape
 * comes out as bytes of no character), which the generator would copy
 * into a reply no client can parse.
 */
char *
pf_control_reply_error(const char *klass, const char *desc, JsonNode *id)
{
    g_autoptr(JsonBuilder) b = json_builder_new();
    g_autofree char *valid = g_utf8_make_valid(desc, -1);

    json_builder_begin_object(b);
    json_builder_set_member_name(b, "error");
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "class");
    json_builder_add_string_value(b, klass);
    json_builder_set_member_name(b, "desc");
    json_builder_add_string_value(b, valid);
    json_builder_end_object(b);
    return end_reply(b, id);
}

static const char *
error_class(const GError *error)
{
    if (g_error_matches(error, PF_ERROR, PF_ERROR_NOT_FOUND)) {
        return "DeviceNotFound";
    }
    return "GenericError";
}

/* ---- the JSON views of VMs and counters ---- */

/* The members that name a VM in every answer about it. */
static void
vm_identity_to_json(const PfViewVm *vm, JsonBuilder *b)
{
    char uuid[37];

    json_builder_set_member_name(b, "name");
    json_builder_add_string_value(b, vm->name);
    json_builder_set_member_name(b, "pid");
    json_builder_add_int_value(b, vm->pid);
    json_builder_set_member_name(b, "uuid");
    if (pf_uuid_text(vm->uuid, uuid) != NULL) {
        json_builder_add_string_value(b, uuid);
    } else {
        json_builder_add_null_value(b);
    }
    json_builder_set_member_name(b, "merge_domain");
    json_builder_add_string_value(b, vm->merge_domain);
    json_builder_set_member_name(b, "mode");
    json_builder_add_string_value(b, vm->mode);
    if (vm->mode_reason != NULL) {
        json_builder_set_member_name(b, "mode_reason");
        json_builder_add_string_value(b, vm->mode_reason);
    }
}

static void
vm_to_json(const PfViewVm *vm, JsonBuilder *b)
{
    json_builder_begin_object(b);
    vm_identity_to_json(vm, b);
    json_builder_set_member_name(b, "pages");
    json_builder_add_int_value(b, (gint64)vm->pages);
    json_builder_set_member_name(b, "regions");
    json_builder_begin_array(b);
    for (guint i = 0; i < vm->n_regions; i++) {
        const PfViewRegion *r = &vm->regions[i];

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

/* Every knob, as an object. */
static void
knobs_to_json(const PfKnobs *k, JsonBuilder *b)
{
    json_builder_begin_object(b);
    pf_knobs_to_json(k, b);
    json_builder_end_object(b);
}

/* "merge" when every VM merges, "advise" when none does, else "mixed". */
static const char *
daemon_mode(const PfView *v)
{
    guint merging = 0;

    for (guint i = 0; i < v->n_vms; i++) {
        merging += g_str_equal(v->vms[i].mode, "merge");
    }
    return merging == 0 ? "advise" : merging == v->n_vms ? "merge" : "mixed";
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

/* Where pagefoldd's main thread spent its CPU time and minor faults
 * (cpu-use.h): what the benchmarks take its cost per page apart with. */
static void
cpu_use_to_json(JsonBuilder *b)
{
    guint64 usec[PF_CPU_N], minflt[PF_CPU_N], spans[PF_CPU_N];

    pf_cpu_read(usec, minflt, spans);
    json_builder_set_member_name(b, "cpu_use");
    json_builder_begin_object(b);
    for (guint i = 0; i < PF_CPU_N; i++) {
        json_builder_set_member_name(b, pf_cpu_use_name(i));
        json_builder_begin_object(b);
        json_builder_set_member_name(b, "usec");
        json_builder_add_int_value(b, (gint64)usec[i]);
        json_builder_set_member_name(b, "minflt");
        json_builder_add_int_value(b, (gint64)minflt[i]);
        json_builder_set_member_name(b, "spans");
        json_builder_add_int_value(b, (gint64)spans[i]);
        json_builder_end_object(b);
    }
    json_builder_end_object(b);
}

/* detached, passed_over: notes of the VMs a command could not do all for
 * (scan.h), or NULL. */
static void
stats_to_json(const PfView *v, const PfViewVm *only, JsonBuilder *b, GPtrArray *detached,
              GPtrArray *passed_over)
{
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "mode");
    json_builder_add_string_value(b, daemon_mode(v));
    json_builder_set_member_name(b, "hash");
    json_builder_add_string_value(b, v->hash);
    json_builder_set_member_name(b, "last_pass_usec");
    json_builder_add_int_value(b, (gint64)v->info.last_pass_usec);
    json_builder_set_member_name(b, "cow_detection");
    json_builder_add_string_value(b, v->info.cow_detection);
    json_builder_set_member_name(b, "pool_slots");
    json_builder_add_int_value(b, (gint64)v->info.pool_slots);
    json_builder_set_member_name(b, "pool_bytes");
    json_builder_add_int_value(b, (gint64)v->info.pool_bytes);
    json_builder_set_member_name(b, "pool_chunks");
    json_builder_add_int_value(b, (gint64)v->info.pool_chunks);
    json_builder_set_member_name(b, "knobs");
    knobs_to_json(&v->knobs, b);
    cpu_use_to_json(b);
    json_builder_set_member_name(b, "total");
    json_builder_begin_object(b);
    pf_counters_to_json(&v->total, b);
    json_builder_end_object(b);
    json_builder_set_member_name(b, "vms");
    json_builder_begin_array(b);
    for (guint i = 0; i < v->n_vms; i++) {
        if (only != NULL && only != &v->vms[i]) {
            continue;
        }
        json_builder_begin_object(b);
        vm_identity_to_json(&v->vms[i], b);
        pf_counters_to_json(&v->vms[i].counters, b);
        json_builder_end_object(b);
    }
    json_builder_end_array(b);
    notes_to_json(b, "detached", detached);
    notes_to_json(b, "passed_over", passed_over);
    json_builder_end_object(b);
}

/* ---- commands ---- */

static gboolean
cmd_attach(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    gint64 pid;
    const char *name, *uuid_text, *domain;
    guint8 uuid[16];
    g_autoptr(PfVm) vm = NULL;
    PfVm *added;
    GPtrArray *vms = pf_scanner_get_vms(r->scanner);

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
    pf_scanner_add_vm(r->scanner, added);
    /* In its domain before the scanner sees a page of it (the libvirt
     * hook's case): set later, it could be refused, having shared pages
     * in the default one.  Nothing shared yet: it cannot fail. */
    if (domain != NULL && !pf_scanner_set_merge_domain(r->scanner, added, domain, error)) {
        pf_scanner_remove_vm(r->scanner, added);
        return FALSE;
    }
    vm_to_json(pf_view_vm_of_pid(request_view(r, FALSE), added->pid), b);
    return TRUE;
}

/* Reads a VM's merge domain, or sets it (name). */
static gboolean
cmd_merge_domain(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = find_vm(r, arg_str(args, "vm"), error);
    const char *name = arg_str(args, "name");

    if (vm == NULL || (name != NULL && !pf_label_is_valid("a merge domain", name, error)) ||
        (name != NULL && !pf_scanner_set_merge_domain(r->scanner, vm, name, error))) {
        return FALSE;
    }
    json_builder_begin_object(b);
    vm_identity_to_json(pf_view_vm_of_pid(request_view(r, FALSE), vm->pid), b);
    json_builder_end_object(b);
    return TRUE;
}

static gboolean
cmd_detach(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = find_vm(r, arg_str(args, "vm"), error);

    if (vm == NULL) {
        return FALSE;
    }
    pf_scanner_detach(r->scanner, vm, "detached on request");
    json_builder_begin_object(b);
    json_builder_end_object(b);
    return TRUE;
}

static gboolean
cmd_list(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfView *v = request_view(r, FALSE);

    json_builder_begin_array(b);
    for (guint i = 0; i < v->n_vms; i++) {
        vm_to_json(&v->vms[i], b);
    }
    json_builder_end_array(b);
    return TRUE;
}

static gboolean
cmd_stats(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfView *v = request_view(r, TRUE);
    const PfViewVm *vm = NULL;

    if (arg_str(args, "vm") != NULL &&
        (vm = pf_view_lookup_vm(v, arg_str(args, "vm"), error)) == NULL) {
        return FALSE;
    }
    stats_to_json(v, vm, b, NULL, NULL);
    return TRUE;
}

static gboolean
cmd_knobs(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    knobs_to_json(r->scanner != NULL ? pf_scanner_get_knobs(r->scanner) : &r->view->knobs, b);
    return TRUE;
}

static void later_done(PfScanner *s, const GError *error, GPtrArray *detached,
                       GPtrArray *passed_over, gpointer user);

/* The command being run replies when its job is done. */
static PfControlLater *
reply_later(Request *r, const char *command)
{
    PfControlLater *l = g_new0(PfControlLater, 1);

    l->command = command;
    r->starting = l;
    return l;
}

static gboolean
cmd_set(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    gint64 value = arg_int(args, "value", 0);

    if (value < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%s must not be negative", arg_str(args, "knob"));
        return FALSE;
    }
    if (!pf_knobs_set(pf_scanner_get_knobs(r->scanner), arg_str(args, "knob"),
                      (guint64)value, error)) {
        return FALSE;
    }
    if (g_str_equal(arg_str(args, "knob"), "run") && value == 2) {
        /* As KSM: unmerge everything, then stay stopped; the reply comes
         * when every page is unmerged. */
        PfControlLater *l = reply_later(r, "set run 2");

        pf_scanner_get_knobs(r->scanner)->run = 0;
        l->job = pf_scan_job_unmerge(r->scanner, NULL, later_done, l);
        return TRUE;
    }
    pf_scanner_kick(r->scanner);
    return cmd_knobs(r, NULL, b, error);
}

/* The configuration file read again, as on SIGHUP; the knobs it left. */
static gboolean
cmd_reload(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    if (r->reload == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "this pagefoldd reads no "
                    "configuration file");
        return FALSE;
    }
    if (!r->reload->func(r->reload->user, error)) {
        return FALSE;
    }
    return cmd_knobs(r, NULL, b, error);
}

static gboolean
cmd_scan_now(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    gint64 passes = arg_int(args, "passes", 1);

    if (passes < 1 || passes > MAX_SCAN_NOW_PASSES) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "passes must be between 1 and %d", MAX_SCAN_NOW_PASSES);
        return FALSE;
    }
    {
        PfControlLater *l = reply_later(r, "scan-now");

        l->job = pf_scan_job_run_passes(r->scanner, (guint)passes, later_done, l);
    }
    return TRUE;
}

static gboolean
cmd_unmerge(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    PfVm *vm = NULL;

    PfControlLater *l;

    if (arg_str(args, "vm") != NULL && (vm = find_vm(r, arg_str(args, "vm"), error)) == NULL) {
        return FALSE;
    }
    l = reply_later(r, "unmerge");
    l->pid = vm != NULL ? vm->pid : 0;
    l->job = pf_scan_job_unmerge(r->scanner, vm, later_done, l);
    return TRUE;
}

static gboolean
cmd_capabilities(Request *r, JsonObject *args, JsonBuilder *b, GError **error)
{
    json_builder_begin_object(b);
    json_builder_end_object(b);
    return TRUE;
}

typedef gboolean (*CommandFunc)(Request *r, JsonObject *args, JsonBuilder *b,
                                GError **error);

#define ARGS(...) ((const ArgSpec[]){ __VA_ARGS__ { NULL } })

/* Each command's arguments are checked here, before it runs. */
static const struct {
    const char *name;
    CommandFunc func;
    const ArgSpec *args;
    gboolean reads; /* only reads: a view will do (request_view()) */
} commands[] = {
    { "qmp_capabilities", cmd_capabilities, ARGS(), TRUE },
    { "attach", cmd_attach, ARGS({ "pid", ARG_INT, TRUE }, { "name", ARG_STRING, FALSE },
                                 { "uuid", ARG_STRING, FALSE },
                                 { "merge-domain", ARG_STRING, FALSE }, ) },
    { "detach", cmd_detach, ARGS({ "vm", ARG_STRING, TRUE }, ) },
    { "merge-domain", cmd_merge_domain,
      ARGS({ "vm", ARG_STRING, TRUE }, { "name", ARG_STRING, FALSE }, ) },
    { "list", cmd_list, ARGS(), TRUE },
    { "stats", cmd_stats, ARGS({ "vm", ARG_STRING, FALSE }, ), TRUE },
    { "knobs", cmd_knobs, ARGS(), TRUE },
    { "set", cmd_set, ARGS({ "knob", ARG_STRING, TRUE }, { "value", ARG_INT, TRUE }, ) },
    { "scan-now", cmd_scan_now, ARGS({ "passes", ARG_INT, FALSE }, ) },
    { "reload", cmd_reload, ARGS() },
    { "unmerge", cmd_unmerge, ARGS({ "vm", ARG_STRING, FALSE }, ) },
};

#undef ARGS

/* ---- requests ---- */

/*
 * The request's parts, checked: its id (as soon as it is known, for the
 * error replies), the command's name and its arguments (NULL for none).
 * Returns NULL, or the error reply.
 */
static char *
parse_request(JsonParser *parser, const char *line, gsize len, JsonNode **id,
              const char **name, JsonObject **args)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GList) members = NULL;
    JsonObject *req;
    JsonNode *root, *exec, *args_node;

    if (!g_utf8_validate(line, (gssize)len, NULL)) {
        return pf_control_reply_error("GenericError", "request is not valid UTF-8", NULL);
    }
    if (!json_parser_load_from_data(parser, line, (gssize)len, &error)) {
        g_autofree char *desc = g_strdup_printf("JSON parse error: %s", error->message);

        return pf_control_reply_error("GenericError", desc, NULL);
    }
    root = json_parser_get_root(parser);
    if (root == NULL || !JSON_NODE_HOLDS_OBJECT(root)) {
        return pf_control_reply_error("GenericError", "a request must be a JSON object", NULL);
    }
    req = json_node_get_object(root);
    *id = json_object_get_member(req, "id");
    members = json_object_get_members(req);
    for (GList *l = members; l != NULL; l = l->next) {
        if (!g_str_equal(l->data, "execute") && !g_str_equal(l->data, "arguments") &&
            !g_str_equal(l->data, "id")) {
            g_autofree char *desc = g_strdup_printf("request member '%s' is unexpected",
                                                    (const char *)l->data);

            return pf_control_reply_error("GenericError", desc, *id);
        }
    }
    exec = json_object_get_member(req, "execute");
    if (exec == NULL || !JSON_NODE_HOLDS_VALUE(exec) ||
        json_node_get_value_type(exec) != G_TYPE_STRING) {
        return pf_control_reply_error("GenericError",
                                      "'execute' must be a command name (string)", *id);
    }
    args_node = json_object_get_member(req, "arguments");
    if (args_node != NULL) {
        if (!JSON_NODE_HOLDS_OBJECT(args_node)) {
            return pf_control_reply_error("GenericError", "'arguments' must be an object", *id);
        }
        *args = json_node_get_object(args_node);
    }
    *name = json_node_get_string(exec);
    return NULL;
}

/* Runs one command, its arguments checked first: its reply, or NULL when
 * its job will give it (*later). */
static char *
run_command(Request *r, gsize k, JsonObject *args, JsonNode *id, PfControlLater **later)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonBuilder) b = begin_return();

    if (!check_args(args, commands[k].args, &error) ||
        !commands[k].func(r, args, b, &error)) {
        g_assert(r->starting == NULL);
        return pf_control_reply_error(error_class(error), error->message, id);
    }
    if (r->starting != NULL) {
        *later = r->starting;
        (*later)->id = id != NULL ? json_node_copy(id) : NULL;
        return NULL;
    }
    return end_reply(b, id);
}

/* The line's command run as r, or NULL for one that does more than read
 * when r has no scanner. */
static char *
execute(Request *r, const char *line, gsize len, PfControlLater **later)
{
    g_autoptr(JsonParser) parser = json_parser_new_immutable();
    g_autofree char *desc = NULL;
    JsonNode *id = NULL;
    JsonObject *args = NULL;
    const char *name = NULL;
    char *bad = parse_request(parser, line, len, &id, &name, &args);

    if (bad != NULL) {
        return bad;
    }
    for (gsize k = 0; k < G_N_ELEMENTS(commands); k++) {
        if (g_str_equal(commands[k].name, name)) {
            if (r->scanner == NULL && !commands[k].reads) {
                return NULL;
            }
            return run_command(r, k, args, id, later);
        }
    }
    desc = g_strdup_printf("the command '%s' has not been found", name);
    return pf_control_reply_error("CommandNotFound", desc, id);
}

char *
pf_control_command_execute(PfScanner *scanner, const char *line, gsize len,
                           const PfControlReload *reload, PfControlLater **later,
                           PfView **made)
{
    Request r = { scanner, reload, NULL, FALSE, NULL };
    char *reply = execute(&r, line, len, later);

    if (made != NULL && r.view != NULL) {
        *made = g_steal_pointer(&r.view);
    }
    g_clear_pointer(&r.view, pf_view_unref);
    return reply;
}

char *
pf_control_command_answer(PfView *view, const char *line, gsize len, gboolean *counters_read)
{
    Request r = { NULL, NULL, view, FALSE, NULL };
    char *reply = execute(&r, line, len, NULL);

    *counters_read = r.counters_read;
    return reply;
}

/* ---- replies that come when a job is done ---- */

static void
later_done(PfScanner *s, const GError *error, GPtrArray *detached, GPtrArray *passed_over,
           gpointer user)
{
    PfControlLater *l = user;
    PfVm *vm = l->pid != 0 ? pf_scanner_find_vm_by_pid(s, l->pid) : NULL;

    l->job = NULL;
    if (error == NULL && !g_str_equal(l->command, "set run 2")) {
        l->view = pf_view_new(s);
    }
    if (error == NULL && l->pid != 0 && vm == NULL) {
        g_autofree char *desc = g_strdup_printf("%s: VM of pid %d went meanwhile (its process "
                                                "exited)", l->command, l->pid);

        l->reply = pf_control_reply_error("DeviceNotFound", desc, l->id);
    } else if (error != NULL) {
        g_autofree char *desc = g_strdup_printf("%s: %s", l->command, error->message);

        l->reply = pf_control_reply_error("GenericError", desc, l->id);
    } else {
        g_autoptr(JsonBuilder) b = begin_return();

        if (g_str_equal(l->command, "set run 2")) {
            knobs_to_json(pf_scanner_get_knobs(s), b);
        } else {
            stats_to_json(l->view, vm != NULL ? pf_view_vm_of_pid(l->view, vm->pid) : NULL, b,
                          detached, passed_over);
        }
        l->reply = end_reply(b, l->id);
    }
    if (l->func != NULL) {
        l->func(l, l->user);
    }
}

void
pf_control_later_watch(PfControlLater *l, PfControlLaterFunc func, gpointer user)
{
    l->func = func;
    l->user = user;
}

char *
pf_control_later_steal_reply(PfControlLater *l)
{
    return g_steal_pointer(&l->reply);
}

PfView *
pf_control_later_steal_view(PfControlLater *l)
{
    return g_steal_pointer(&l->view);
}

void
pf_control_later_free(PfControlLater *l)
{
    if (l->job != NULL) {
        pf_scan_job_forget(l->job);
    }
    g_clear_pointer(&l->id, json_node_unref);
    g_clear_pointer(&l->view, pf_view_unref);
    g_free(l->reply);
    g_free(l);
}
