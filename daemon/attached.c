/*
 * attached.c - what a restart would lose, kept in a file (attached.h): a
 * JSON object with the VMs attached by pid ("vms") and the merge domains
 * of agents' VMs ("domains"), one object per VM, written whole (a
 * temporary file renamed) when it changed.
 */
#include "attached.h"

#include <errno.h>
#include <fcntl.h>
#include <json-glib/json-glib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "label.h"
#include "util.h"
#include "vm.h"

/* How often the file is brought up to date. */
#define WRITE_PERIOD_MS 1000
/* Far more than the VMs one host runs take. */
#define MAX_FILE_BYTES (16u << 20)

/* The merge domain of an agent's VM: "default", "unlabelled" or a name. */
typedef struct {
    guint64 start_time;
    char *domain;
} Kept;

/* What the file read at start said of agents' VMs' domains. */
typedef enum {
    KEPT_NONE, /* nothing: a pagefoldd that kept none wrote it */
    KEPT_LIST, /* every agent's VM it knew: one it does not name is unknown */
    KEPT_LOST, /* no file, or one that cannot be read: every VM is unknown */
} KeptState;

struct _PfAttached {
    PfScanner *scanner;
    char *path;
    char *written;    /* what the file holds */
    guint timer;
    GHashTable *kept; /* pid -> Kept: agents' VMs' domains, as the file said
                       * and as they changed since */
    KeptState state;
};

static void
kept_free(gpointer p)
{
    Kept *k = p;

    g_free(k->domain);
    g_free(k);
}

/* This boot's id: a pid and start time name a process of one boot only
 * (where the file outlives a boot: a --socket that is not in /run). */
static char *
boot_id(void)
{
    char *id = NULL;

    if (!g_file_get_contents("/proc/sys/kernel/random/boot_id", &id, NULL, NULL)) {
        return g_strdup("");
    }
    return g_strstrip(id);
}

static void
add_domain(JsonBuilder *b, int pid, guint64 started, const char *domain)
{
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "pid");
    json_builder_add_int_value(b, pid);
    json_builder_set_member_name(b, "start_time");
    json_builder_add_int_value(b, (gint64)started);
    json_builder_set_member_name(b, "merge_domain");
    json_builder_add_string_value(b, domain);
    json_builder_end_object(b);
}

static char *
snapshot(PfAttached *a)
{
    g_autoptr(JsonBuilder) b = json_builder_new();
    g_autoptr(JsonNode) root = NULL;
    g_autofree char *boot = boot_id();
    PfScanner *s = a->scanner;
    GPtrArray *vms = pf_scanner_get_vms(s);
    GHashTableIter it;
    gpointer key, value;

    json_builder_begin_object(b);
    json_builder_set_member_name(b, "boot_id");
    json_builder_add_string_value(b, boot);
    json_builder_set_member_name(b, "vms");
    json_builder_begin_array(b);
    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);
        char uuid[37];

        if (vm->kind == PF_VM_AGENT) {
            continue; /* an agent's: it comes back by itself */
        }
        json_builder_begin_object(b);
        json_builder_set_member_name(b, "pid");
        json_builder_add_int_value(b, vm->pid);
        json_builder_set_member_name(b, "start_time");
        json_builder_add_int_value(b, (gint64)vm->start_time);
        json_builder_set_member_name(b, "name");
        json_builder_add_string_value(b, vm->name);
        if (pf_vm_uuid_string(vm, uuid) != NULL) {
            json_builder_set_member_name(b, "uuid");
            json_builder_add_string_value(b, uuid);
        }
        json_builder_set_member_name(b, "merge_domain");
        json_builder_add_string_value(b, pf_scanner_merge_domain(s, vm));
        json_builder_end_object(b);
    }
    json_builder_end_array(b);
    /* Every agent's VM's domain, default and unlabelled too: a VM that
     * merged before and is not named is one whose domain is unknown. */
    json_builder_set_member_name(b, "domains");
    json_builder_begin_array(b);
    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);

        if (vm->kind == PF_VM_AGENT && vm->start_time != 0) {
            add_domain(b, vm->pid, vm->start_time, pf_scanner_merge_domain(s, vm));
        }
    }
    /* Those the file named that are not back yet, while their processes
     * run: another restart before they come back must not lose them. */
    g_hash_table_iter_init(&it, a->kept);
    while (g_hash_table_iter_next(&it, &key, &value)) {
        Kept *k = value;
        int pid = GPOINTER_TO_INT(key);
        PfVm *vm = pf_scanner_find_vm_by_pid(s, pid);

        if (vm != NULL && vm->kind == PF_VM_AGENT && vm->start_time == k->start_time) {
            continue; /* said above */
        }
        if (pf_process_start_time(pid) != k->start_time) {
            g_hash_table_iter_remove(&it); /* it exited */
            continue;
        }
        add_domain(b, pid, k->start_time, k->domain);
    }
    json_builder_end_array(b);
    json_builder_end_object(b);
    root = json_builder_get_root(b);
    return json_to_string(root, FALSE);
}

static void
write_now(PfAttached *a)
{
    g_autofree char *now = snapshot(a);
    g_autoptr(GError) error = NULL;

    if (g_strcmp0(now, a->written) == 0) {
        return;
    }
    if (!g_file_set_contents_full(a->path, now, -1, G_FILE_SET_CONTENTS_CONSISTENT, 0600,
                                  &error)) {
        /* An older file would give VMs domains root has changed since:
         * none at all keeps those that merged apart. */
        g_warning("cannot keep the VMs attached by pid and the merge domains in %s: %s; it "
                  "is removed (a pagefoldd started again would not attach those VMs, and "
                  "would keep agents' VMs that merged apart)", a->path, error->message);
        if (unlink(a->path) < 0 && errno != ENOENT) {
            g_warning("cannot remove %s: %s", a->path, g_strerror(errno));
        }
        g_clear_pointer(&a->written, g_free);
        return;
    }
    g_free(a->written);
    a->written = g_steal_pointer(&now);
}

static gboolean
write_cb(gpointer user)
{
    write_now(user);
    return G_SOURCE_CONTINUE;
}

void
pf_attached_keep_domain(PfAttached *a, PfVm *vm)
{
    if (a->scanner == NULL) {
        return;
    }
    if (vm->kind == PF_VM_AGENT && vm->start_time != 0) {
        Kept *k = g_new0(Kept, 1);

        k->start_time = vm->start_time;
        k->domain = g_strdup(pf_scanner_merge_domain(a->scanner, vm));
        g_hash_table_replace(a->kept, GINT_TO_POINTER(vm->pid), k);
    }
    write_now(a);
}

/* Before the change is answered: a pagefoldd killed right after it must
 * not wake up with the VM back in its old domain; nor one whose agent
 * connects again to this pagefoldd (its link broke). */
static void
domain_changed(PfScanner *s, PfVm *vm, gpointer user)
{
    pf_attached_keep_domain(user, vm);
}

static const PfScanEvents attached_events = {
    .domain = domain_changed,
};

/* The scanner went first. */
static void
scanner_gone(gpointer user)
{
    PfAttached *a = user;

    a->scanner = NULL;
    g_clear_handle_id(&a->timer, g_source_remove);
}

static guint restore(PfAttached *a);

PfAttached *
pf_attached_new(PfScanner *scanner, const char *path, guint *n_restored)
{
    PfAttached *a = g_new0(PfAttached, 1);
    guint n;

    a->scanner = scanner;
    a->path = g_strdup(path);
    a->kept = g_hash_table_new_full(NULL, NULL, NULL, kept_free);
    n = restore(a);
    if (n_restored != NULL) {
        *n_restored = n;
    }
    write_now(a);
    a->timer = g_timeout_add(WRITE_PERIOD_MS, write_cb, a);
    pf_scanner_add_listener(scanner, &attached_events, a, scanner_gone);
    return a;
}

void
pf_attached_free(PfAttached *a)
{
    if (a == NULL) {
        return;
    }
    if (a->scanner != NULL) {
        pf_scanner_remove_listener(a->scanner, &attached_events, a);
    }
    g_clear_handle_id(&a->timer, g_source_remove);
    g_hash_table_unref(a->kept);
    g_free(a->path);
    g_free(a->written);
    g_free(a);
}

const char *
pf_attached_agent_domain(PfAttached *a, const PfVm *vm, gboolean *unknown)
{
    Kept *k = g_hash_table_lookup(a->kept, GINT_TO_POINTER(vm->pid));

    if (k != NULL && vm->start_time != 0 && k->start_time == vm->start_time) {
        *unknown = FALSE;
        return k->domain;
    }
    *unknown = a->state != KEPT_NONE;
    return NULL;
}

/* A member of the file's, of the type it must have, or 0 / NULL. */
static gint64
member_int(JsonObject *o, const char *name)
{
    JsonNode *n = json_object_get_member(o, name);

    return n != NULL && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_INT64
               ? json_node_get_int(n)
               : 0;
}

static const char *
member_str(JsonObject *o, const char *name)
{
    JsonNode *n = json_object_get_member(o, name);

    return n != NULL && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING
               ? json_node_get_string(n)
               : NULL;
}

/* One VM the file names, attached again if its process is the one it was. */
static gboolean
restore_one(PfScanner *s, JsonObject *o)
{
    gint64 pid = member_int(o, "pid");
    gint64 started = member_int(o, "start_time");
    const char *name = member_str(o, "name");
    const char *uuid = member_str(o, "uuid");
    const char *domain = member_str(o, "merge_domain");
    g_autoptr(GError) error = NULL;
    PfVm *vm;

    if (pid <= 0 || pid > G_MAXINT || started <= 0 ||
        pf_process_start_time((int)pid) != (guint64)started ||
        pf_scanner_find_vm_by_pid(s, (int)pid) != NULL ||
        (name != NULL && !pf_label_is_valid("a VM name", name, NULL))) {
        return FALSE;
    }
    vm = pf_vm_attach((int)pid, name, &error);
    /* The pidfd pins it now: the same process, if it still started then. */
    if (vm == NULL || vm->start_time != (guint64)started) {
        if (vm != NULL) {
            pf_vm_free(vm);
        }
        return FALSE;
    }
    if (uuid != NULL && !pf_uuid_parse(uuid, vm->uuid)) {
        memset(vm->uuid, 0, sizeof(vm->uuid));
    }
    pf_scanner_add_vm(s, vm);
    if (domain != NULL && !g_str_equal(domain, "unlabelled") &&
        pf_label_is_valid("a merge domain", domain, NULL)) {
        (void)pf_scanner_set_merge_domain(s, vm, domain, NULL);
    }
    g_message("VM %s (pid %d) attached again, as before pagefoldd started: mode %s, merge "
              "domain '%s'", vm->name, vm->pid, pf_vm_mode_name(vm),
              pf_scanner_merge_domain(s, vm));
    return TRUE;
}

/* The file's text: pagefoldd's own (a regular file of its user's that no
 * one else may write, through no link), at most MAX_FILE_BYTES; NULL and
 * error otherwise. */
static char *
read_own(const char *path, GError **error)
{
    g_autoptr(GString) text = g_string_new(NULL);
    char buf[65536];
    struct stat st;
    ssize_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);

    if (fd < 0) {
        g_set_error(error, G_FILE_ERROR, g_file_error_from_errno(errno), "%s",
                    g_strerror(errno));
        return NULL;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "not pagefoldd's (a regular file of its user's that no one else writes)");
        return NULL;
    }
    while ((n = read(fd, buf, sizeof(buf))) > 0 && text->len <= MAX_FILE_BYTES) {
        g_string_append_len(text, buf, n);
    }
    close(fd);
    if (n < 0 || text->len > MAX_FILE_BYTES) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "%s",
                    n < 0 ? g_strerror(errno) : "larger than pagefoldd writes");
        return NULL;
    }
    return g_string_free(g_steal_pointer(&text), FALSE);
}

/* An agent's VM's domain the file names, kept until it comes back. */
static void
keep_domain(PfAttached *a, JsonObject *o)
{
    gint64 pid = member_int(o, "pid");
    gint64 started = member_int(o, "start_time");
    const char *domain = member_str(o, "merge_domain");
    Kept *k;

    if (pid <= 0 || pid > G_MAXINT || started <= 0 || domain == NULL ||
        (!g_str_equal(domain, "unlabelled") &&
         !pf_label_is_valid("a merge domain", domain, NULL))) {
        return;
    }
    k = g_new0(Kept, 1);
    k->start_time = (guint64)started;
    k->domain = g_strdup(domain);
    g_hash_table_replace(a->kept, GINT_TO_POINTER((int)pid), k);
}

/* The file's VMs attached again, and its agents' domains kept; how many
 * VMs were attached. */
static guint
restore(PfAttached *a)
{
    g_autoptr(JsonParser) parser = json_parser_new();
    g_autoptr(GError) error = NULL;
    g_autofree char *text = read_own(a->path, &error);
    g_autofree char *boot = boot_id();
    JsonNode *root, *list, *domains;
    JsonArray *vms;
    guint n = 0;

    /* Until it is read, every domain is unknown. */
    a->state = KEPT_LOST;
    if (text == NULL || !json_parser_load_from_data(parser, text, -1, &error)) {
        if (!g_error_matches(error, G_FILE_ERROR, G_FILE_ERROR_NOENT)) {
            g_warning("%s: %s: no VM attached by pid is attached again, and agents' VMs "
                      "that merged before come back apart", a->path, error->message);
        }
        return 0;
    }
    root = json_parser_get_root(parser);
    list = root != NULL && JSON_NODE_HOLDS_OBJECT(root)
               ? json_object_get_member(json_node_get_object(root), "vms")
               : NULL;
    if (list == NULL || !JSON_NODE_HOLDS_ARRAY(list)) {
        g_warning("%s is not pagefoldd's list of VMs: no VM attached by pid is attached again, "
                  "and agents' VMs that merged before come back apart", a->path);
        return 0;
    }
    if (g_strcmp0(member_str(json_node_get_object(root), "boot_id"), boot) != 0) {
        a->state = KEPT_NONE;
        return 0; /* of another boot: none of its processes runs */
    }
    vms = json_node_get_array(list);
    for (guint i = 0; i < json_array_get_length(vms); i++) {
        JsonNode *e = json_array_get_element(vms, i);

        n += JSON_NODE_HOLDS_OBJECT(e) && restore_one(a->scanner, json_node_get_object(e));
    }
    /* A file of a pagefoldd that kept no domains has none to give, and
     * says nothing of any. */
    domains = json_object_get_member(json_node_get_object(root), "domains");
    a->state = KEPT_NONE;
    if (domains != NULL && JSON_NODE_HOLDS_ARRAY(domains)) {
        a->state = KEPT_LIST;
        JsonArray *list_of = json_node_get_array(domains);

        for (guint i = 0; i < json_array_get_length(list_of); i++) {
            JsonNode *e = json_array_get_element(list_of, i);

            if (JSON_NODE_HOLDS_OBJECT(e)) {
                keep_domain(a, json_node_get_object(e));
            }
        }
    }
    return n;
}
