/*
 * scale-test.c - pagefoldd at sizes the other tests never reach: a VM of
 * gigabytes merged or unmerged in one command, an agent that stops
 * answering next to one that does not, unmerging while merges are in
 * flight.  Stand-in VMMs (tests/standin-vmm: the real agent library on
 * memfd RAM laid out as QEMU's) and the real pagefoldd.  Cases that need
 * more memory than the machine has free skip.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "testproc.h"
#include "util.h"

typedef PfTestVmm Vmm;

/* MemAvailable in MiB. */
static guint64
available_mib(void)
{
    g_autofree char *text = NULL;
    const char *at;

    if (!g_file_get_contents("/proc/meminfo", &text, NULL, NULL) ||
        (at = strstr(text, "MemAvailable:")) == NULL) {
        return 0;
    }
    return g_ascii_strtoull(at + strlen("MemAvailable:"), NULL, 10) / 1024;
}

static gboolean
skip_unless_memory(guint64 mib)
{
    if (available_mib() < mib) {
        g_autofree char *why = g_strdup_printf("needs %" G_GUINT64_FORMAT " MiB free, "
                                               "the machine has %" G_GUINT64_FORMAT,
                                               mib, available_mib());

        g_test_skip(why);
        return FALSE;
    }
    return TRUE;
}

/* A stand-in VMM of mib MiB; extra: more standin-vmm options, NULL-ended. */
static Vmm *
vmm_start(PfTestDaemon *d, const char *name, guint mib, const char *first, ...)
{
    g_autofree char *guest = g_strdup_printf("guest=%s", name);
    g_autofree char *size = g_strdup_printf("%u", mib);
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    const char *a;
    va_list ap;
    Vmm *v;

    g_ptr_array_add(argv, (char *)pf_test_bin("STANDIN_VMM"));
    g_ptr_array_add(argv, (char *)"-name");
    g_ptr_array_add(argv, guest);
    g_ptr_array_add(argv, (char *)"--agent-socket");
    g_ptr_array_add(argv, d->agent_sock);
    g_ptr_array_add(argv, (char *)"--mib");
    g_ptr_array_add(argv, size);
    va_start(ap, first);
    for (a = first; a != NULL; a = va_arg(ap, const char *)) {
        g_ptr_array_add(argv, (char *)a);
    }
    va_end(ap);
    g_ptr_array_add(argv, NULL);
    v = pf_test_vmm_spawn((const char *const *)argv->pdata);
    g_assert_nonnull(v);
    g_assert_cmpstr(v->mode, ==, "merge");
    pf_test_daemon_wait_vmm(d, v);
    return v;
}

/* ---- the control socket, timed ---- */

typedef struct {
    int fd;
    GString *in;
} Ctl;

static gboolean
ctl_read_line(Ctl *c, char **line)
{
    char buf[4096];
    const char *nl;
    ssize_t n;

    while ((nl = memchr(c->in->str, '\n', c->in->len)) == NULL) {
        n = recv(c->fd, buf, sizeof(buf), 0);
        if (n <= 0) {
            return FALSE;
        }
        g_string_append_len(c->in, buf, n);
    }
    *line = g_strndup(c->in->str, (gsize)(nl - c->in->str));
    g_string_erase(c->in, 0, nl - c->in->str + 1);
    return TRUE;
}

static Ctl *
ctl_connect(PfTestDaemon *d)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    g_autofree char *greeting = NULL;
    Ctl *c = g_new0(Ctl, 1);

    c->in = g_string_new(NULL);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    g_strlcpy(addr.sun_path, d->sock, sizeof(addr.sun_path));
    g_assert_cmpint(connect(c->fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    g_assert_true(ctl_read_line(c, &greeting));
    return c;
}

static void
ctl_free(Ctl *c)
{
    close(c->fd);
    g_string_free(c->in, TRUE);
    g_free(c);
}

/* Sends one command; returns its reply line, and how long it took. */
static char *
ctl_run(Ctl *c, const char *json, double *seconds)
{
    g_autofree char *line = g_strconcat(json, "\n", NULL);
    gint64 t0 = g_get_monotonic_time();
    char *reply = NULL;

    g_assert_cmpint(send(c->fd, line, strlen(line), MSG_NOSIGNAL), ==, (ssize_t)strlen(line));
    g_assert_true(ctl_read_line(c, &reply));
    if (seconds != NULL) {
        *seconds = (g_get_monotonic_time() - t0) / 1e6;
    }
    return reply;
}

/*
 * Sends cmd and, in the same write, stats: pagefoldd reads both at once,
 * so stats shows the state cmd left, before any answer that arrives after
 * it.  Returns cmd's reply; *vm: the VM's stats then, or NULL.
 */
static JsonNode *
ctl_then_stats(Ctl *c, const char *cmd, const char *name, JsonObject **vm)
{
    g_autofree char *both = g_strdup_printf("%s\n{\"execute\": \"stats\"}\n", cmd);
    g_autofree char *reply = NULL, *line = NULL;
    g_autoptr(JsonParser) p = json_parser_new();
    JsonObject *o;

    g_assert_cmpint(send(c->fd, both, strlen(both), MSG_NOSIGNAL), ==, (ssize_t)strlen(both));
    g_assert_true(ctl_read_line(c, &reply));
    g_assert_true(ctl_read_line(c, &line));
    g_assert_true(json_parser_load_from_data(p, line, -1, NULL));
    o = json_object_get_object_member(json_node_get_object(json_parser_get_root(p)), "return");
    o = pf_test_find_vm(json_object_get_array_member(o, "vms"), name);
    *vm = o != NULL ? json_object_ref(o) : NULL;
    g_assert_true(json_parser_load_from_data(p, reply, -1, NULL));
    return json_node_copy(json_parser_get_root(p));
}

/* Asserts a reply is {"return": ...}. */
static void
assert_return(JsonNode *reply)
{
    JsonObject *o = json_node_get_object(reply);

    if (!json_object_has_member(o, "return")) {
        g_error("%s", json_to_string(reply, FALSE));
    }
}

/* ---- the cases ---- */

#define BIG_MIB 1536u
#define BIG_PAGES (BIG_MIB * 256u)

/*
 * A big VM, all zero as a guest that zeroes its RAM at boot leaves it:
 * one scan-now decides a request for each of its 393216 pages, far more
 * than both ends' socket buffers hold.  The requests go as the agent
 * answers, so the VM stays attached, every page is merged when scan-now
 * says it is done, and unmerge brings every page back before it says so.
 */
static void
test_burst(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) o = NULL;
    g_autoptr(JsonNode) r = NULL;
    Vmm *v;
    Ctl *c;

    if (!skip_unless_memory(BIG_MIB + 1024)) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    v = vmm_start(d, "big", BIG_MIB, "--zero", "100", "--identical", "0", NULL);
    c = ctl_connect(d);
    r = ctl_then_stats(c, "{\"execute\": \"scan-now\", \"arguments\": {\"passes\": 2}}",
                       "big", &o);
    assert_return(r);
    g_assert_nonnull(o);
    g_assert_cmpint(json_object_get_int_member(o, "pages_pending"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(o, "zero_pages"), ==, BIG_PAGES);
    g_assert_cmpint(pf_test_vmm_stat(v, "remapped"), ==, BIG_PAGES);
    g_assert_cmpint(pf_test_vmm_stat(v, "connected"), ==, 1);
    pf_test_vmm_verify(v);

    g_clear_pointer(&o, json_object_unref);
    g_clear_pointer(&r, json_node_unref);
    r = ctl_then_stats(c, "{\"execute\": \"unmerge\", \"arguments\": {\"vm\": \"big\"}}",
                       "big", &o);
    assert_return(r);
    g_assert_nonnull(o);
    g_assert_cmpint(json_object_get_int_member(o, "pages_pending"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(o, "zero_pages"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(v, "remapped"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(v, "connected"), ==, 1);
    ctl_free(c);
    pf_test_vmm_quit(v);
}

static gpointer
continue_later(gpointer data)
{
    g_usleep(12 * G_USEC_PER_SEC);
    kill(GPOINTER_TO_INT(data), SIGCONT);
    return NULL;
}

/*
 * KSM's run=2 unmerges everything before it returns: merges still in
 * flight when it is set land after it began, and are unmerged too, even
 * from an agent that takes its time (stopped for 12 s here, more than any
 * wait pagefoldd once had).
 */
static void
test_run2_in_flight(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) o = NULL;
    g_autoptr(JsonNode) r = NULL;
    Vmm *v;
    GThread *waker;
    Ctl *c;
    gint64 t0;

    if (!skip_unless_memory(512 + 1024)) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", "--set", "pages_to_scan=200000",
                             "--set", "sleep_millisecs=5", NULL);
    v = vmm_start(d, "inflight", 512, "--zero", "100", "--identical", "0", NULL);
    json_node_unref(pf_test_ctl_json(d, "set", "run", "1", NULL));
    t0 = g_get_monotonic_time();
    while (pf_test_vmm_stat(v, "zeroed") == 0) {
        g_assert_cmpint(g_get_monotonic_time() - t0, <, 120 * G_USEC_PER_SEC);
        g_usleep(2000);
    }
    g_assert_cmpint(kill(v->pid, SIGSTOP), ==, 0);
    waker = g_thread_new("sigcont", continue_later, GINT_TO_POINTER(v->pid));
    c = ctl_connect(d);
    r = ctl_then_stats(c, "{\"execute\": \"set\", \"arguments\": "
                          "{\"knob\": \"run\", \"value\": 2}}", "inflight", &o);
    assert_return(r);
    g_assert_cmpint(json_object_get_int_member(
                        json_object_get_object_member(json_node_get_object(r), "return"), "run"),
                    ==, 0);
    g_test_message("run=2 set after the agent had zeroed pages; it now holds %" G_GINT64_FORMAT
                   " remapped", pf_test_vmm_stat(v, "remapped"));
    g_assert_nonnull(o);
    g_assert_cmpint(json_object_get_int_member(o, "zero_pages"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(o, "pages_sharing"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(o, "pages_pending"), ==, 0);
    g_thread_join(waker);
    g_assert_cmpint(pf_test_vmm_stat(v, "remapped"), ==, 0);
    ctl_free(c);
    pf_test_vmm_quit(v);
}

/*
 * An agent that stops answering (its VMM stopped) holds up nobody: the
 * VM next to it is scanned on, the control socket answers at once all
 * along, and once it has answered nothing for --agent-timeout it is
 * detached.  Its merged pages stay valid: when it runs again, every byte
 * is as it wrote it.
 */
static void
test_stuck_agent(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-timeout", "4",
                                                     NULL);
    Vmm *stuck = vmm_start(d, "stuck", 256, "--zero", "100", "--identical", "0", NULL);
    Vmm *busy = vmm_start(d, "busy", 32, NULL);
    Ctl *c = ctl_connect(d);
    double worst = 0, t;
    gint64 t0, scans0, gone = 0;

    g_assert_cmpint(kill(stuck->pid, SIGSTOP), ==, 0);
    json_node_unref(pf_test_ctl_json(d, "set", "pages_to_scan", "20000", NULL));
    json_node_unref(pf_test_ctl_json(d, "set", "sleep_millisecs", "10", NULL));
    scans0 = pf_test_vm_counter(d, "busy", "full_scans");
    g_assert_cmpint(scans0, >=, 0); /* attached */
    json_node_unref(pf_test_ctl_json(d, "set", "run", "1", NULL));
    t0 = g_get_monotonic_time();
    while (g_get_monotonic_time() - t0 < 30 * G_USEC_PER_SEC) {
        g_autofree char *r = ctl_run(c, "{\"execute\": \"list\"}", &t);

        worst = MAX(worst, t);
        if (strstr(r, "\"stuck\"") == NULL) {
            gone = g_get_monotonic_time();
            break;
        }
        g_usleep(20000);
    }
    g_test_message("the stopped agent was given up after %.1f s; the slowest control answer "
                   "took %.3f s; the other VM made %" G_GINT64_FORMAT " passes meanwhile",
                   (gone - t0) / 1e6, worst, pf_test_vm_counter(d, "busy", "full_scans") - scans0);
    g_assert_cmpint(gone, !=, 0);
    /* Its pages were decided in the second pass: the timeout runs from
     * its first unanswered request. */
    g_assert_cmpfloat((gone - t0) / 1e6, >=, 3.5);
    /* Far from the seconds a wait for the stopped agent would take. */
    g_assert_cmpfloat(worst, <, 1.0);
    g_assert_cmpint(pf_test_vm_counter(d, "busy", "full_scans") - scans0, >=, 10);
    ctl_free(c);

    g_assert_cmpint(kill(stuck->pid, SIGCONT), ==, 0);
    pf_test_vmm_verify(stuck);
    pf_test_vmm_quit(stuck);
    pf_test_vmm_quit(busy);
}

/*
 * An agent that takes its requests and answers none, but is not given up
 * (a long --agent-timeout): scan-now does its passes over the other VM,
 * waits a bounded time for the stopped one's answers, and says it did not
 * get them ("passed_over"), rather than wait as long as the agent likes.
 * The other VM's pages that pair with the stopped one's queue nothing on
 * its full link.
 */
static void
test_scan_now_bounded(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-timeout", "600",
                                                     NULL);
    Vmm *x = vmm_start(d, "x", 128, "--zero", "0", "--identical", "100", NULL);
    Vmm *y = vmm_start(d, "y", 128, "--zero", "0", "--identical", "100", NULL);
    Ctl *c = ctl_connect(d);
    g_autoptr(JsonParser) p = json_parser_new();
    g_autofree char *reply = NULL;
    JsonObject *ret;
    JsonArray *notes;
    double t;

    g_assert_cmpint(kill(x->pid, SIGSTOP), ==, 0);
    reply = ctl_run(c, "{\"execute\": \"scan-now\", \"arguments\": {\"passes\": 3}}", &t);
    g_test_message("scan-now took %.1f s with x stopped: %.300s", t, reply);
    g_assert_true(json_parser_load_from_data(p, reply, -1, NULL));
    ret = json_object_get_object_member(json_node_get_object(json_parser_get_root(p)), "return");
    g_assert_nonnull(ret);
    g_assert_true(json_object_has_member(ret, "passed_over"));
    notes = json_object_get_array_member(ret, "passed_over");
    g_assert_nonnull(strstr(json_array_get_string_element(notes, 0), "VM x"));
    /* The wait for answers is 30 s after the last pass. */
    g_assert_cmpfloat(t, <, 60);
    g_assert_nonnull(pf_test_find_vm(json_object_get_array_member(ret, "vms"), "x"));
    g_assert_cmpint(kill(x->pid, SIGCONT), ==, 0);
    ctl_free(c);
    pf_test_vmm_quit(x);
    pf_test_vmm_quit(y);
}

/*
 * An unmerge whose VM is detached before its pages are back fails: they
 * stay merged in its process.  (It once replied success, with the other
 * VMs' stats.)
 */
static void
test_unmerge_detached(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *x = vmm_start(d, "x", 64, "--zero", "100", "--identical", "0", NULL);
    Vmm *y = vmm_start(d, "y", 32, "--zero", "100", "--identical", "0", NULL);
    Ctl *c = ctl_connect(d);
    const char *unmerge = "{\"execute\": \"unmerge\", \"arguments\": {\"vm\": \"x\"}}\n";
    g_autofree char *scanned = NULL, *reply = NULL;

    scanned = ctl_run(c, "{\"execute\": \"scan-now\", \"arguments\": {\"passes\": 2}}", NULL);
    g_assert_cmpint(pf_test_vm_counter(d, "x", "zero_pages"), ==, 64 * 256);
    g_assert_cmpint(kill(x->pid, SIGSTOP), ==, 0);
    g_assert_cmpint(send(c->fd, unmerge, strlen(unmerge), MSG_NOSIGNAL), ==,
                    (ssize_t)strlen(unmerge));
    g_usleep(300000);
    json_node_unref(pf_test_ctl_json(d, "detach", "x", NULL));
    g_assert_true(ctl_read_line(c, &reply));
    g_test_message("unmerge x, x detached meanwhile: %s", reply);
    g_assert_nonnull(strstr(reply, "\"error\""));
    g_assert_nonnull(strstr(reply, "detached on request"));
    g_assert_cmpint(kill(x->pid, SIGCONT), ==, 0);
    ctl_free(c);
    pf_test_vmm_quit(x);
    pf_test_vmm_quit(y);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/scale/burst", test_burst);
    g_test_add_func("/scale/run2-in-flight", test_run2_in_flight);
    g_test_add_func("/scale/stuck-agent", test_stuck_agent);
    g_test_add_func("/scale/scan-now-bounded", test_scan_now_bounded);
    g_test_add_func("/scale/unmerge-detached", test_unmerge_detached);
    return g_test_run();
}
