/*
 * hook.c - pagefold-libvirt-hook, the libvirt qemu hook: libvirtd runs it
 * (as /etc/libvirt/hooks/qemu.d/pagefold) as
 *
 *   pagefold-libvirt-hook [OPTIONS] NAME OP SUBOP EXTRA   < domain XML
 *
 * and it makes sure pagefoldd runs before a VM with shared memfd RAM
 * starts (prepare, start), attaches the VM by QEMU's pid once it runs
 * (started, reconnect, attach) and detaches it when it stops (stopped,
 * release), saying what it did on stderr and in libvirt's log of the
 * domain.
 *
 * Owns nothing that outlives it but a pagefoldd it started.  Must never
 * exit other than 0 (a failing hook refuses a VM's start, and one at
 * reconnect kills the VM), never wait long (libvirtd waits for it: every
 * wait is bounded by one deadline), never call into libvirt (libvirtd
 * waits for it: deadlock), never write to stdout (for migrate and restore
 * libvirt takes it as the domain XML, empty meaning unchanged), and never
 * leave a process holding its stdout or stderr (libvirtd reads them to
 * EOF).
 *
 * This file has the operations and main(), and calls down into the
 * others, never the other way: the command line is parsed in hook-args.c,
 * pagefoldd started in start-pagefoldd.c, and what they share (the Hook,
 * saying what it does, control calls, reading the domain XML) is in
 * hook-common.c, which calls none of them; the XML is parsed by
 * daemon/domain-xml.c, which pagefoldd parses libvirt's status files with.
 */
#include <errno.h>
#include <fcntl.h>
#include <gio/gio.h>
#include <glib.h>
#include <json-glib/json-glib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "client.h"
#include "domain-xml.h"
#include "hook-args.h"
#include "hook-common.h"
#include "hook-config.h"
#include "label.h"
#include "libvirt-status.h"
#include "start-pagefoldd.h"
#include "util.h"

#define DEFAULT_RUN_DIR "/run/libvirt/qemu"
#define DEFAULT_LOG_DIR "/var/log/libvirt/qemu"
#define DEFAULT_PAGEFOLDD_LOG "/var/log/pagefold/pagefoldd.log"
#define DEFAULT_AGENT_GROUP "libvirt-qemu"

static const char usage_text[] =
    "usage: pagefold-libvirt-hook [OPTION...] NAME OP SUBOP EXTRA  < domain XML\n"
    "libvirt's qemu hook for pagefold; options come before libvirt's four arguments:\n"
    "  --socket PATH          pagefoldd's control socket (" PF_DEFAULT_SOCKET ")\n"
    "  --pagefoldd PATH       pagefoldd to start, rather than systemd's " SYSTEMD_UNIT "\n"
    "                         (" PF_INSTALLED_PAGEFOLDD ")\n"
    "  --pagefoldd-arg ARG    one more argument for a pagefoldd it starts (repeatable)\n"
    "  --pagefoldd-log FILE   where a pagefoldd it starts writes (" DEFAULT_PAGEFOLDD_LOG ")\n"
    "  --agent-group GROUP    the agent socket's group, if it exists (" DEFAULT_AGENT_GROUP
    "; '' none)\n"
    "  --run-dir DIR          where libvirt keeps NAME.xml, the domain's status (" DEFAULT_RUN_DIR ")\n"
    "  --log-dir DIR          libvirt's per-domain logs (" DEFAULT_LOG_DIR ")\n"
    "   or: pagefold-libvirt-hook [OPTION...] --start-pagefoldd\n"
    "  start pagefoldd as for a domain about to start, where it does not answer\n"
    "  (the package's postinst, after an upgrade where systemd does not run);\n"
    "  exit status 0 once it answers\n";

/* ---- the domain's name and log ---- */

static void
open_domain_log(Hook *h)
{
    g_autofree char *base = g_strconcat(h->name, ".log", NULL);
    g_autofree char *path = g_build_filename(h->log_dir, base, NULL);

    /* Not there before the first start: made as libvirt makes it.  A
     * link is not followed: the hook runs as root. */
    h->log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY,
                     0600);
}

/* ---- the operations ---- */

/* The VM is not pagefold's: said once per way a VM comes to run, at
 * prepare (not again at start or started, which follow it), reconnect or
 * attach. */
static void
say_not_ours(Hook *h)
{
    hook_say(h, "RAM not shared memfd (<memoryBacking><source type='memfd'/><access "
        "mode='shared'/>): not pagefold's; kernel KSM is what merges private RAM");
}

/* prepare, start: pagefoldd runs before QEMU does (its agent connects at
 * once). */
static void
op_ensure_daemon(Hook *h, const Domain *dom)
{
    g_autoptr(GError) error = NULL;

    if (!domain_is_ours(dom)) {
        if (g_str_equal(h->op, "prepare")) {
            say_not_ours(h);
        }
        return;
    }
    if (hook_ping(h, &error)) {
        hook_say(h, "pagefoldd answers on %s", h->socket_path);
        return;
    }
    if (g_error_matches(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT)) {
        hook_say(h, "pagefoldd is there but did not answer (%s): not starting another",
            error->message);
        return;
    }
    hook_say(h, "pagefoldd does not answer (%s): starting it", error->message);
    hook_start_pagefoldd(h);
}

static const char *
member_str(JsonObject *o, const char *name)
{
    JsonNode *n = o ? json_object_get_member(o, name) : NULL;

    return n != NULL && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING
               ? json_node_get_string(n) : NULL;
}

static gint64
member_int(JsonObject *o, const char *name)
{
    JsonNode *n = o ? json_object_get_member(o, name) : NULL;

    return n != NULL && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_INT64
               ? json_node_get_int(n) : -1;
}

/* The VMs of a list reply (JSON objects), NULL if it is not one. */
static JsonArray *
as_array(JsonNode *n)
{
    return n != NULL && JSON_NODE_HOLDS_ARRAY(n) ? json_node_get_array(n) : NULL;
}

static JsonObject *
element_object(JsonArray *a, guint i)
{
    JsonNode *n = json_array_get_element(a, i);

    return JSON_NODE_HOLDS_OBJECT(n) ? json_node_get_object(n) : NULL;
}

static JsonObject *
find_by_pid(JsonArray *vms, int pid)
{
    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *vm = element_object(vms, i);

        if (member_int(vm, "pid") == pid) {
            return vm;
        }
    }
    return NULL;
}

static JsonNode *
request_vm(const char *command, const char *vm, const char *name)
{
    g_autoptr(JsonBuilder) args = json_builder_new();

    json_builder_begin_object(args);
    json_builder_set_member_name(args, "vm");
    json_builder_add_string_value(args, vm);
    if (name != NULL) {
        json_builder_set_member_name(args, "name");
        json_builder_add_string_value(args, name);
    }
    json_builder_end_object(args);
    return hook_request_new(command, args);
}

/*
 * A VM attached before the hook (by its agent, as QEMU started) is in
 * the default merge domain: moved into the XML's.  pagefoldd refuses
 * once it shares pages there; it is then detached, so that it shares no
 * more with VMs it must not (those it shares stay until QEMU exits).
 */
static void
set_merge_domain(Hook *h, int pid, JsonObject *vm, const char *domain)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *key = g_strdup_printf("%d", pid);
    g_autoptr(JsonNode) req = request_vm("merge-domain", key, domain);
    g_autoptr(JsonNode) ret = hook_control(h, req, &error);
    g_autoptr(JsonNode) dreq = NULL;
    g_autoptr(JsonNode) done = NULL;

    if (ret != NULL) {
        hook_say(h, "pid %d moved from merge domain '%s' to '%s'", pid,
            member_str(vm, "merge_domain") ? member_str(vm, "merge_domain") : "?", domain);
        return;
    }
    if (!g_error_matches(error, PF_CLIENT_ERROR, PF_CLIENT_ERROR_REFUSED)) {
        hook_say(h, "cannot put pid %d in merge domain '%s': %s", pid, domain, error->message);
        return;
    }
    hook_say(h, "pagefoldd did not put pid %d in merge domain '%s': %s", pid, domain,
        error->message);
    g_clear_error(&error);
    dreq = request_vm("detach", key, NULL);
    done = hook_control(h, dreq, &error);
    if (done != NULL) {
        hook_say(h, "detached pid %d rather than let it share pages outside merge domain '%s'",
            pid, domain);
    } else {
        hook_say(h, "detach of pid %d failed too: %s", pid, error->message);
    }
}

/* A merge domain pagefoldd did not hear of would let the VM share pages
 * with VMs it must not: no merge rather than that.  A merge domain is a
 * label, as a VM's name is: pagefoldd's rule (the XML is UTF-8 already). */
static gboolean
merge_domain_ok(Hook *h, const Domain *dom)
{
    if (dom->has_config && (dom->merge_domain == NULL ||
                            !pf_label_is_valid("a merge domain", dom->merge_domain, NULL))) {
        hook_say(h, "<pagefold:config> (%s) wants merge-domain=\"NAME\" (1 to %d bytes, no "
            "control characters): not attaching it", PAGEFOLD_NS, PF_MAX_LABEL_LEN);
        return FALSE;
    }
    return TRUE;
}

/* pagefoldd's list of VMs (the reply's "return"), or NULL with error. */
static JsonNode *
list_vms(Hook *h, GError **error)
{
    g_autoptr(JsonNode) lreq = hook_request_new("list", NULL);

    return hook_control(h, lreq, error);
}

/* Never merged, and not even read, as kernel KSM never scans it: a
 * patched QEMU's agent (mem-merge=off) has attached it in advise mode,
 * with no RAM to scan, to say so; no other QEMU is attached. */
static void
say_nosharepages(Hook *h, int pid)
{
    g_autoptr(JsonNode) list = list_vms(h, NULL);

    hook_say(h, "<memoryBacking><nosharepages/>: never merged; %s",
             find_by_pid(as_array(list), pid) != NULL
                 ? "its agent keeps it in advise mode (mem-merge=off)"
                 : "not attached");
}

static JsonNode *
attach_request(int pid, const Domain *dom)
{
    g_autoptr(JsonBuilder) args = json_builder_new();

    json_builder_begin_object(args);
    json_builder_set_member_name(args, "pid");
    json_builder_add_int_value(args, pid);
    json_builder_set_member_name(args, "name");
    json_builder_add_string_value(args, dom->name);
    json_builder_set_member_name(args, "uuid");
    json_builder_add_string_value(args, dom->uuid);
    if (dom->merge_domain != NULL) {
        json_builder_set_member_name(args, "merge-domain");
        json_builder_add_string_value(args, dom->merge_domain);
    }
    json_builder_end_object(args);
    return hook_request_new("attach", args);
}

static void
say_attached(Hook *h, int pid, const Domain *dom, JsonNode *ret)
{
    JsonObject *o = JSON_NODE_HOLDS_OBJECT(ret) ? json_node_get_object(ret) : NULL;
    JsonNode *regions = o ? json_object_get_member(o, "regions") : NULL;
    gint64 pages = member_int(o, "pages");

    hook_say(h, "attached pid %d as VM '%s' (uuid %s%s%s) in mode %s: %u region(s), %.1f MiB",
        pid, dom->name, dom->uuid, dom->merge_domain ? ", merge domain " : "",
        dom->merge_domain ? dom->merge_domain : "",
        member_str(o, "mode") ? member_str(o, "mode") : "?",
        regions && JSON_NODE_HOLDS_ARRAY(regions)
            ? json_array_get_length(json_node_get_array(regions)) : 0,
        pages > 0 ? (double)pages * PF_PAGE_SIZE / 1048576.0 : 0.0);
}

/* Refused: already attached (its agent connected it as QEMU started), or
 * not attachable.  The list says which. */
static void
on_attach_refused(Hook *h, int pid, const Domain *dom, const GError *refusal)
{
    g_autoptr(JsonNode) list = list_vms(h, NULL);
    JsonObject *vm = find_by_pid(as_array(list), pid);
    const char *want = dom->merge_domain ? dom->merge_domain : "default";

    if (vm == NULL) {
        hook_say(h, "pagefoldd did not attach pid %d: %s", pid, refusal->message);
        return;
    }
    hook_say(h, "pid %d is attached already, as VM '%s' (uuid %s) in mode %s: its agent "
        "connected it, or an earlier hook", pid,
        member_str(vm, "name") ? member_str(vm, "name") : "?",
        member_str(vm, "uuid") ? member_str(vm, "uuid") : "none",
        member_str(vm, "mode") ? member_str(vm, "mode") : "?");
    /* Its agent (not root's) shares with nobody until told which domain
     * it is in: the XML's, or the host's default. */
    if (g_strcmp0(member_str(vm, "merge_domain"), want) != 0) {
        set_merge_domain(h, pid, vm, want);
    }
}

/* started, reconnect, attach: QEMU runs; attach it by pid. */
static void
op_attach(Hook *h, const Domain *dom)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonNode) req = NULL;
    g_autoptr(JsonNode) ret = NULL;
    int pid;

    if (!domain_is_ours(dom)) {
        if (!g_str_equal(h->op, "started")) {
            say_not_ours(h);
        }
        return;
    }
    if (!merge_domain_ok(h, dom)) {
        return;
    }
    pid = pf_libvirt_domain_pid(h->run_dir, h->name, &error);
    if (pid == 0) {
        hook_say(h, "no QEMU pid (%s): not attached", error->message);
        return;
    }
    if (dom->nosharepages) {
        say_nosharepages(h, pid);
        return;
    }
    req = attach_request(pid, dom);
    ret = hook_control(h, req, &error);
    if (ret != NULL) {
        say_attached(h, pid, dom, ret);
    } else if (!g_error_matches(error, PF_CLIENT_ERROR, PF_CLIENT_ERROR_REFUSED)) {
        hook_say(h, "cannot attach pid %d: %s; the VM runs unmerged", pid, error->message);
    } else {
        on_attach_refused(h, pid, dom, error);
    }
}

/*
 * This domain's VM in pagefoldd's list: by QEMU's pid where libvirt's
 * status file still gives one, else by UUID.  Returns how many match (*mine
 * the last), or -1 where the pid is another VM's now (said).
 */
static int
find_mine(Hook *h, const Domain *dom, int pid, JsonArray *vms, JsonObject **mine)
{
    int n_mine = 0;

    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *vm = element_object(vms, i);
        const char *uuid = member_str(vm, "uuid");

        if (pid != 0 && member_int(vm, "pid") == pid) {
            /* A status file may outlive its QEMU, and the pid be
             * another's by now: the UUID must agree where the VM has one. */
            if (uuid != NULL && !g_str_equal(uuid, dom->uuid)) {
                hook_say(h, "pid %d is attached as another VM ('%s', uuid %s): left alone", pid,
                    member_str(vm, "name") ? member_str(vm, "name") : "?", uuid);
                return -1;
            }
            *mine = vm;
            return 1;
        }
        if (pid == 0 && uuid != NULL && g_str_equal(uuid, dom->uuid)) {
            *mine = vm;
            n_mine++;
        }
    }
    return n_mine;
}

/* A few of the VM's counters, as its figures before it goes, or why there
 * are none. */
static GString *
last_figures(Hook *h, const char *key, int pid)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonNode) sreq = request_vm("stats", key, NULL);
    g_autoptr(JsonNode) stats = hook_control(h, sreq, &error);
    GString *figures = g_string_new(NULL);

    if (stats != NULL && JSON_NODE_HOLDS_OBJECT(stats)) {
        JsonObject *vm = find_by_pid(
            as_array(json_object_get_member(json_node_get_object(stats), "vms")), pid);
        static const char *const shown[] = {
            "pages_shared", "pages_sharing", "zero_pages", "cow", NULL
        };

        for (const char *const *s = shown; vm != NULL && *s; s++) {
            g_string_append_printf(figures, "%s=%" G_GINT64_FORMAT " ", *s, member_int(vm, *s));
        }
        if (vm != NULL) {
            g_string_append_printf(figures, "mode=%s",
                                   member_str(vm, "mode") ? member_str(vm, "mode") : "?");
        }
    }
    if (figures->len == 0) {
        g_string_printf(figures, "none (%s)", error ? error->message : "not in stats");
    }
    return figures;
}

/* stopped, release: detach the VM if pagefoldd still has it, with its
 * last figures. */
static void
op_detach(Hook *h, const Domain *dom)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GError) pid_error = NULL;
    g_autoptr(JsonNode) list = NULL;
    g_autoptr(JsonNode) dreq = NULL;
    g_autoptr(JsonNode) done = NULL;
    g_autoptr(GString) figures = NULL;
    g_autofree char *key = NULL;
    JsonObject *mine = NULL;
    int n_mine;
    int pid;

    if (!domain_is_ours(dom)) {
        return;
    }
    /* Gone by release; there during stopped, though QEMU has exited. */
    pid = pf_libvirt_domain_pid(h->run_dir, h->name, &pid_error);
    list = list_vms(h, &error);
    if (list == NULL) {
        hook_say(h, "cannot ask pagefoldd (%s): nothing detached", error->message);
        return;
    }
    n_mine = find_mine(h, dom, pid, as_array(list), &mine);
    if (n_mine < 0) {
        return;
    }
    if (n_mine == 0) {
        hook_say(h, "%s", g_str_equal(h->op, "stopped")
                   ? "not attached: pagefoldd already dropped it (QEMU exited), "
                     "logging its last figures"
                   : "not attached (detached at stopped, or dropped as QEMU exited)");
        return;
    }
    if (n_mine > 1) {
        hook_say(h, "%u VMs have uuid %s and there is no status file (%s): none detached",
            (guint)n_mine, dom->uuid, pid_error->message);
        return;
    }
    pid = (int)member_int(mine, "pid");
    key = g_strdup_printf("%d", pid);
    figures = last_figures(h, key, pid);
    dreq = request_vm("detach", key, NULL);
    done = hook_control(h, dreq, &error);
    if (done != NULL) {
        hook_say(h, "detached VM '%s' (pid %d); final figures: %s",
            member_str(mine, "name") ? member_str(mine, "name") : "?", pid, figures->str);
    } else {
        hook_say(h, "detach of pid %d: %s; last figures: %s", pid, error->message, figures->str);
    }
}

/* pagefoldd running, started as for a domain about to start where it does
 * not answer; 0 once it answers.  No libvirtd waits on this one: it may
 * wait longer, for a busy host. */
static int
start_pagefoldd_only(Hook *h)
{
    h->deadline = g_get_monotonic_time() + HOOK_START_ONLY_WAIT_MS * 1000;
    h->ready_wait_ms = HOOK_START_ONLY_WAIT_MS;
    return hook_ping(h, NULL) || hook_start_pagefoldd(h) ? 0 : 1;
}

int
main(int argc, char **argv)
{
    Hook h = {
        .socket_path = PF_DEFAULT_SOCKET,
        .pagefoldd = PF_INSTALLED_PAGEFOLDD,
        .pagefoldd_log = DEFAULT_PAGEFOLDD_LOG,
        .agent_group = DEFAULT_AGENT_GROUP,
        .run_dir = DEFAULT_RUN_DIR,
        .log_dir = DEFAULT_LOG_DIR,
        .log_fd = -1,
        .deadline = g_get_monotonic_time() + HOOK_DEADLINE_MS * 1000,
        .ready_wait_ms = HOOK_READY_WAIT_MS,
    };
    g_autoptr(GPtrArray) extra = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    g_autoptr(GString) xml = NULL;
    g_auto(Domain) dom = { 0 };
    gboolean ensure, attach, detach, filter;

    /* A reader gone (libvirtd's end of stderr) must not kill the hook: it
     * exits 0, whatever happens. */
    signal(SIGPIPE, SIG_IGN);
    h.pagefoldd_args = extra;
    if (!hook_parse_args(&h, argc, argv, &error)) {
        hook_say(&h, "%s; nothing done", error->message);
        (void)!write(STDERR_FILENO, usage_text, strlen(usage_text));
        return 0;
    }
    /* Not libvirt: the package's maintainer scripts, which want to know. */
    if (h.start_only) {
        return start_pagefoldd_only(&h);
    }
    if (!hook_name_is_file_name(h.name)) {
        h.name = NULL;
        hook_say(&h, "domain name '%s' cannot name a file: nothing done", argv[argc - 4]);
        return 0;
    }
    open_domain_log(&h);

    ensure = (g_str_equal(h.op, "prepare") || g_str_equal(h.op, "start")) &&
             g_str_equal(h.subop, "begin");
    attach = (g_str_equal(h.op, "started") || g_str_equal(h.op, "reconnect") ||
              g_str_equal(h.op, "attach")) && g_str_equal(h.subop, "begin");
    detach = (g_str_equal(h.op, "stopped") || g_str_equal(h.op, "release")) &&
             g_str_equal(h.subop, "end");
    filter = g_str_equal(h.op, "migrate") || g_str_equal(h.op, "restore") ||
             g_str_equal(h.op, "save");

    /* libvirt writes the XML for every operation: read it all, so that it
     * never meets a closed pipe. */
    xml = domain_xml_read(h.deadline, &error);
    if (filter) {
        /* libvirt reads stdout as the domain XML to go on with; empty is
         * "unchanged".  The VM is attached once QEMU runs (started). */
        hook_say(&h, "domain XML passed through unchanged");
    } else if (!ensure && !attach && !detach) {
        hook_say(&h, "nothing to do for operation '%s %s'", h.op, h.subop);
    } else if (xml == NULL) {
        hook_say(&h, "%s: nothing done", error->message);
    } else if (!domain_xml_parse(h.name, xml, &dom, &error)) {
        hook_say(&h, "%s: nothing done", error->message);
    } else if (ensure) {
        op_ensure_daemon(&h, &dom);
    } else if (attach) {
        op_attach(&h, &dom);
    } else {
        op_detach(&h, &dom);
    }
    if (h.log_fd >= 0) {
        close(h.log_fd);
    }
    return 0;
}
