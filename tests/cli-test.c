/*
 * cli-test.c - pagefoldd and pagefoldctl as a user runs them, against
 * stand-in guests (standin-guest: memfd RAM like QEMU's, not a VM).
 */
#include <gio/gio.h>
#include <gio/gunixsocketaddress.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <json-glib/json-glib.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>

#include "pf-config.h"
#include "testproc.h"

typedef struct {
    PfTestDaemon *d;
    GSubprocess *guest[2];
    int pid[2];
} Fixture;

/* Runs pagefoldctl; returns its exit status, stdout in *out and stderr in
 * *err, which it frees first, so a test can call it again and again. */
static int
ctl(Fixture *f, char **out, char **err, ...)
{
    g_autoptr(GPtrArray) argv = NULL;
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    va_list ap;

    g_clear_pointer(out, g_free);
    g_clear_pointer(err, g_free);
    va_start(ap, err);
    argv = pf_test_argv_new(pf_test_bin("PAGEFOLDCTL"), f->d->sock, ap);
    va_end(ap);
    p = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_PIPE,
               (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    g_subprocess_communicate_utf8(p, NULL, NULL, out, err, &error);
    g_assert_no_error(error);
    return g_subprocess_get_exit_status(p);
}

static JsonObject *
ctl_json(Fixture *f, const char *cmd, const char *arg)
{
    g_autofree char *out = NULL, *err = NULL;
    g_autoptr(JsonParser) p = json_parser_new();
    int rc = arg ? ctl(f, &out, &err, cmd, arg, "--json", NULL)
                 : ctl(f, &out, &err, cmd, "--json", NULL);

    g_assert_cmpint(rc, ==, 0);
    g_assert_true(json_parser_load_from_data(p, out, -1, NULL));
    return json_node_dup_object(json_parser_get_root(p));
}

static GSubprocess *
start_guest(const char *name, int seed, int *pid)
{
    return pf_test_standin_guest(name, NULL, seed, pid);
}

static void
setup(Fixture *f, gconstpointer data)
{
    f->d = pf_test_daemon_start("--set", "run=0", NULL);
    f->guest[0] = start_guest("alpha", 1, &f->pid[0]);
    f->guest[1] = start_guest("beta", 2, &f->pid[1]);
}

static void
teardown(Fixture *f, gconstpointer data)
{
    for (int i = 0; i < 2; i++) {
        if (f->guest[i]) {
            g_subprocess_force_exit(f->guest[i]);
            g_subprocess_wait(f->guest[i], NULL, NULL);
            g_object_unref(f->guest[i]);
        }
    }
    pf_test_daemon_free(f->d);
}

static void
test_user_session(Fixture *f, gconstpointer data)
{
    g_autofree char *pid0 = g_strdup_printf("%d", f->pid[0]);
    g_autofree char *pid1 = g_strdup_printf("%d", f->pid[1]);
    g_autofree char *out = NULL, *err = NULL;
    g_autofree char *line = NULL;
    g_autoptr(JsonObject) stats = NULL;
    JsonObject *total;

    /* No --name: the VM is named from its -name guest=..., like QEMU. */
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid0, NULL), ==, 0);
    g_assert_nonnull(strstr(out, "attached VM alpha"));
    g_assert_nonnull(strstr(out, "mode advise"));
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid1, "--name", "beta-vm", NULL), ==, 0);

    g_assert_cmpint(ctl(f, &out, &err, "scan-now", "2", NULL), ==, 0);
    g_assert_nonnull(strstr(out, "pagefold mode: advise"));
    g_assert_nonnull(strstr(out, "beta-vm"));

    /* 16 MiB each: 2048 identical, 819 zero, 1229 unique pages. */
    stats = ctl_json(f, "stats", NULL);
    total = json_object_get_object_member(stats, "total");
    g_assert_cmpint(json_object_get_int_member(total, "pages_shared"), ==, 2048);
    g_assert_cmpint(json_object_get_int_member(total, "pages_sharing"), ==, 2048);
    g_assert_cmpint(json_object_get_int_member(total, "zero_pages"), ==, 2 * 819);
    g_assert_cmpint(json_object_get_int_member(total, "pages_unshared"), ==, 2 * 1229);

    g_assert_cmpint(ctl(f, &out, &err, "stats", "alpha", "--prometheus", NULL), ==, 0);
    g_free(line);
    line = g_strdup_printf("pagefold_pages_sharing{vm=\"alpha\",pid=\"%d\",mode=\"advise\"} 1024\n", f->pid[0]);
    g_assert_nonnull(strstr(out, line));
    g_assert_null(strstr(out, "beta-vm"));

    g_assert_cmpint(ctl(f, &out, &err, "set", "pages_to_scan", "1000", NULL), ==, 0);
    g_assert_nonnull(strstr(out, "pages_to_scan"));

    /* A guest that dies is dropped by the daemon on its own. */
    g_subprocess_force_exit(f->guest[1]);
    g_subprocess_wait(f->guest[1], NULL, NULL);
    g_clear_object(&f->guest[1]);
    for (int i = 0; i < 100; i++) {
        g_assert_cmpint(ctl(f, &out, &err, "list", NULL), ==, 0);
        if (strstr(out, "beta-vm") == NULL) {
            break;
        }
        g_usleep(50000);
    }
    g_assert_null(strstr(out, "beta-vm"));
    g_assert_nonnull(strstr(out, "alpha"));

    g_assert_cmpint(ctl(f, &out, &err, "detach", "alpha", NULL), ==, 0);

    /* SIGTERM: a clean exit that removes the socket. */
    g_subprocess_send_signal(f->d->proc, SIGTERM);
    g_assert_true(g_subprocess_wait(f->d->proc, NULL, NULL));
    g_assert_true(g_subprocess_get_if_exited(f->d->proc));
    g_assert_cmpint(g_subprocess_get_exit_status(f->d->proc), ==, 0);
    g_assert_false(g_file_test(f->d->sock, G_FILE_TEST_EXISTS));
    g_clear_object(&f->d->proc);
}

/* Runs prog with the arguments; wants its exit status and a piece of its
 * stderr. */
static void
expect(Fixture *f, int want_rc, const char *want_err, const char *prog, ...)
{
    g_autoptr(GPtrArray) argv = NULL;
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    g_autofree char *out = NULL, *err = NULL;
    va_list ap;

    va_start(ap, prog);
    argv = pf_test_argv_new(prog, NULL, ap);
    va_end(ap);
    p = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_PIPE,
               (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    g_subprocess_communicate_utf8(p, NULL, NULL, &out, &err, &error);
    g_assert_no_error(error);
    if (g_subprocess_get_exit_status(p) != want_rc || strstr(err, want_err) == NULL) {
        g_error("%s ...: exit %d, stderr '%s'; wanted exit %d and '%s'",
                (char *)argv->pdata[1], g_subprocess_get_exit_status(p), err, want_rc, want_err);
    }
}

static void
test_bad_command_lines(Fixture *f, gconstpointer data)
{
    const char *c = pf_test_bin("PAGEFOLDCTL"), *d = pf_test_bin("PAGEFOLDD");
    g_autofree char *nosock = g_build_filename(f->d->dir, "none.sock", NULL);

    expect(f, 2, "no command given", c, "--socket", f->d->sock, NULL);
    expect(f, 2, "unknown command 'frobnicate'", c, "--socket", f->d->sock, "frobnicate", NULL);
    expect(f, 2, "not a non-negative whole number", c, "--socket", f->d->sock, "set",
           "pages_to_scan", "12abc", NULL);
    expect(f, 2, "attach takes one PID", c, "--socket", f->d->sock, "attach", NULL);
    expect(f, 2, "exclude each other", c, "--socket", f->d->sock, "stats", "--json",
           "--prometheus", NULL);
    expect(f, 1, "between 1 and", c, "--socket", f->d->sock, "set", "pages_to_scan", "0", NULL);
    expect(f, 1, "unknown knob", c, "--socket", f->d->sock, "set", "bogus", "1", NULL);
    {
        const char *sleep_argv[] = { "sleep", "60", NULL };
        g_autoptr(GSubprocess) sleeper = pf_test_spawnv(G_SUBPROCESS_FLAGS_NONE, sleep_argv, NULL);

        expect(f, 1, "no guest RAM", c, "--socket", f->d->sock, "attach",
               g_subprocess_get_identifier(sleeper), NULL);
        g_subprocess_force_exit(sleeper);
    }
    expect(f, 1, "no VM 'ghost'", c, "--socket", f->d->sock, "stats", "ghost", NULL);
    expect(f, 1, "is pagefoldd running?", c, "--socket", nosock, "list", NULL);
    if (geteuid() == 0) {
        expect(f, 1, "run this as root", "setpriv", "--reuid=65534", "--regid=65534",
               "--clear-groups", c, "--socket", f->d->sock, "list", NULL);
    }

    expect(f, 2, "unknown --hash 'md5'", d, "--socket", nosock, "--hash", "md5", NULL);
    expect(f, 2, "unknown knob", d, "--socket", nosock, "--set", "nope=1", NULL);
    expect(f, 2, "KNOB=VALUE", d, "--socket", nosock, "--set", "nope", NULL);
    expect(f, 1, "another pagefoldd is listening", d, "--socket", f->d->sock, "--agent-socket",
           nosock, NULL);
    /* The first daemon is unharmed by all of that. */
    {
        g_autofree char *out = NULL, *err = NULL;

        g_assert_cmpint(ctl(f, &out, &err, "knobs", NULL), ==, 0);
        g_assert_nonnull(strstr(out, "sleep_millisecs"));
    }
}

/*
 * A VM is its process; its name is a label.  Two QEMUs of one name (all
 * are "qemu" without -name) both attach; a command that names one by that
 * name is refused with their pids, and the pid or the UUID names each.
 * Prometheus tells their series apart by pid.
 */
static void
test_same_name(Fixture *f, gconstpointer data)
{
    static const char *const uuids[2] = { "6f2a8c1e-0d4b-4e59-9a3c-2b7d1e5f8a90",
                                          "0123456789ABCDEF0123456789abcdef" };
    g_autoptr(GSubprocess) twin0 = NULL;
    g_autoptr(GSubprocess) twin1 = NULL;
    g_autofree char *out = NULL, *err = NULL;
    g_autofree char *want = NULL;
    g_autofree char *pid0 = NULL, *pid1 = NULL;
    g_autoptr(JsonObject) s = NULL;
    int pid[2];
    JsonArray *vms;

    twin0 = pf_test_standin_guest("twin", uuids[0], 1, &pid[0]);
    twin1 = pf_test_standin_guest("twin", uuids[1], 2, &pid[1]);
    pid0 = g_strdup_printf("%d", pid[0]);
    pid1 = g_strdup_printf("%d", pid[1]);
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid0, NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid1, NULL), ==, 0);
    g_assert_nonnull(strstr(out, "attached VM twin"));

    /* Both listed, each with its pid and UUID (as written canonically). */
    g_assert_cmpint(ctl(f, &out, &err, "list", "--json", NULL), ==, 0);
    {
        g_autoptr(JsonParser) p = json_parser_new();

        g_assert_true(json_parser_load_from_data(p, out, -1, NULL));
        vms = json_node_get_array(json_parser_get_root(p));
        g_assert_cmpuint(json_array_get_length(vms), ==, 2);
        g_assert_cmpstr(json_object_get_string_member(pf_test_find_vm_pid(vms, pid[0]), "name"), ==,
                        "twin");
        g_assert_cmpstr(json_object_get_string_member(pf_test_find_vm_pid(vms, pid[0]), "uuid"), ==,
                        uuids[0]);
        g_assert_cmpstr(json_object_get_string_member(pf_test_find_vm_pid(vms, pid[1]), "uuid"), ==,
                        "01234567-89ab-cdef-0123-456789abcdef");
    }

    /* The name is ambiguous: refused, with the pids to choose from. */
    g_assert_cmpint(ctl(f, &out, &err, "stats", "twin", NULL), ==, 1);
    want = g_strdup_printf("2 VMs have the name 'twin' (pids %d, %d)", pid[0], pid[1]);
    if (strstr(err, want) == NULL) {
        g_error("stats twin said '%s', wanted '%s'", err, want);
    }
    g_assert_cmpint(ctl(f, &out, &err, "detach", "twin", NULL), ==, 1);
    g_assert_nonnull(strstr(err, "name one by its pid"));

    /* By pid, and by UUID in either spelling: one VM each. */
    s = ctl_json(f, "stats", pid1);
    vms = json_object_get_array_member(s, "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_nonnull(pf_test_find_vm_pid(vms, pid[1]));
    g_clear_pointer(&s, json_object_unref);
    s = ctl_json(f, "stats", "6F2A8C1E0D4B4E599A3C2B7D1E5F8A90");
    vms = json_object_get_array_member(s, "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_nonnull(pf_test_find_vm_pid(vms, pid[0]));
    g_assert_cmpint(ctl(f, &out, &err, "stats", "00000000-0000-0000-0000-000000000001", NULL),
                    ==, 1);
    g_assert_nonnull(strstr(err, "no VM"));

    /* Prometheus: one series each, told apart by pid. */
    g_assert_cmpint(ctl(f, &out, &err, "scan-now", "--prometheus", NULL), ==, 0);
    g_free(want);
    want = g_strdup_printf("pagefold_pages_scanned_total{vm=\"twin\",pid=\"%d\",", pid[0]);
    g_assert_nonnull(strstr(out, want));
    g_free(want);
    want = g_strdup_printf("pagefold_pages_scanned_total{vm=\"twin\",pid=\"%d\",", pid[1]);
    g_assert_nonnull(strstr(out, want));

    /* Detached by UUID, the other one is the only twin left. */
    g_assert_cmpint(ctl(f, &out, &err, "detach", uuids[1], NULL), ==, 0);
    g_clear_pointer(&s, json_object_unref);
    s = ctl_json(f, "stats", "twin");
    vms = json_object_get_array_member(s, "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_nonnull(pf_test_find_vm_pid(vms, pid[0]));
    g_subprocess_force_exit(twin0);
    g_subprocess_force_exit(twin1);
    g_subprocess_wait(twin0, NULL, NULL);
    g_subprocess_wait(twin1, NULL, NULL);
}

/* With run=1 and a pass-time target, sharing rises on its own. */
static void
test_background_scan(Fixture *f, gconstpointer data)
{
    g_autofree char *pid0 = g_strdup_printf("%d", f->pid[0]);
    g_autofree char *pid1 = g_strdup_printf("%d", f->pid[1]);
    g_autofree char *out = NULL, *err = NULL;
    gint64 sharing = 0;

    g_assert_cmpint(ctl(f, &out, &err, "attach", pid0, NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid1, NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "set", "target_pass_millisecs", "200", NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "set", "run", "1", NULL), ==, 0);
    for (int i = 0; i < 200 && sharing < 2048; i++) {
        g_autoptr(JsonObject) s = ctl_json(f, "stats", NULL);

        sharing = json_object_get_int_member(json_object_get_object_member(s, "total"),
                                             "pages_sharing");
        g_usleep(50000);
    }
    g_assert_cmpint(sharing, ==, 2048);
}

/* The knobs pagefoldctl knobs reports, as JSON. */
static gint64
knob(PfTestDaemon *d, const char *name)
{
    g_autoptr(JsonNode) n = pf_test_ctl_json(d, "knobs", NULL);

    return json_object_get_int_member(json_node_get_object(n), name);
}

/*
 * The configuration file: its knobs and options taken at start, the
 * command line winning; read again on SIGHUP and on pagefoldctl reload,
 * again with the command line winning; one with a mistake is refused
 * whole, with where, at start (exit 2) and on reload (nothing changes).
 */
static void
test_config(Fixture *f, gconstpointer data)
{
    g_autofree char *dir = g_dir_make_tmp("pagefold-config-XXXXXX", NULL);
    g_autofree char *path = g_build_filename(dir, "pagefoldd.conf", NULL);
    const char *c = pf_test_bin("PAGEFOLDCTL"), *dd = pf_test_bin("PAGEFOLDD");
    g_autofree char *out = NULL, *err = NULL;
    g_autoptr(PfTestDaemon) d = NULL;

    g_assert_true(g_file_set_contents(path, "# a comment\n[pagefoldd]\nagent-timeout=7\n\n"
                                            "[knobs]\npages_to_scan=1234\nsleep_millisecs=33\n",
                                      -1, NULL));
    d = pf_test_daemon_start("--config", path, "--set", "sleep_millisecs=44", NULL);
    g_assert_cmpint(knob(d, "pages_to_scan"), ==, 1234);
    g_assert_cmpint(knob(d, "sleep_millisecs"), ==, 44);

    g_assert_true(g_file_set_contents(path, "[knobs]\npages_to_scan=2222\n"
                                            "max_page_sharing=77\nsleep_millisecs=55\n",
                                      -1, NULL));
    g_subprocess_send_signal(d->proc, SIGHUP);
    for (int i = 0; i < 200 && knob(d, "pages_to_scan") != 2222; i++) {
        g_usleep(20000);
    }
    g_assert_cmpint(knob(d, "pages_to_scan"), ==, 2222);
    g_assert_cmpint(knob(d, "max_page_sharing"), ==, 77);
    g_assert_cmpint(knob(d, "sleep_millisecs"), ==, 44);

    g_assert_true(g_file_set_contents(path, "[knobs]\npages_to_scan=3333\n", -1, NULL));
    expect(f, 0, "", c, "--socket", d->sock, "reload", NULL);
    g_assert_cmpint(knob(d, "pages_to_scan"), ==, 3333);

    /* A mistake: nothing changes, and the error says where. */
    g_assert_true(g_file_set_contents(path, "[knobs]\npages_to_scan=4444\nbogus=1\n", -1,
                                      NULL));
    expect(f, 1, "[knobs] bogus", c, "--socket", d->sock, "reload", NULL);
    g_assert_cmpint(knob(d, "pages_to_scan"), ==, 3333);
    g_assert_true(g_file_set_contents(path, "[knobs]\nrun=2\n", -1, NULL));
    expect(f, 1, "pagefoldctl set run 2", c, "--socket", d->sock, "reload", NULL);
    g_assert_true(g_file_set_contents(path, "[pagefoldd]\nagent-timeout=0\n", -1, NULL));
    expect(f, 2, "agent-timeout", dd, "--config", path, "--socket", d->sock, NULL);
    g_assert_true(g_file_set_contents(path, "[scanner]\nx=1\n", -1, NULL));
    expect(f, 2, "[scanner]: no such group", dd, "--config", path, NULL);
    g_unlink(path);
    expect(f, 2, "pagefoldd.conf", dd, "--config", path, NULL);
    g_rmdir(dir);
}

/*
 * VMs attached by pid have no agent to come back by: a pagefoldd killed
 * and started again on the same socket attaches them again, with their
 * names and merge domains; a VM detached before is not, and neither is a
 * process the file names that is not the one it was (a reused pid).
 */
static void
test_attached_again(Fixture *f, gconstpointer data)
{
    g_autofree char *pid0 = g_strdup_printf("%d", f->pid[0]);
    g_autofree char *pid1 = g_strdup_printf("%d", f->pid[1]);
    g_autofree char *kept = g_strconcat(f->d->sock, ".attached", NULL);
    g_autofree char *out = NULL, *err = NULL, *text = NULL;
    g_autoptr(JsonObject) vm = NULL;

    g_assert_cmpint(ctl(f, &out, &err, "attach", pid0, "--name", "kept", NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid1, NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", pid0, "red", NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "detach", pid1, NULL), ==, 0);
    /* Written within a second of a change. */
    for (int i = 0; i < 300; i++) {
        g_clear_pointer(&text, g_free);
        if (g_file_get_contents(kept, &text, NULL, NULL) && strstr(text, "red") != NULL &&
            strstr(text, "beta") == NULL) {
            break;
        }
        g_usleep(10000);
    }
    g_assert_nonnull(strstr(text, "\"merge_domain\":\"red\""));
    g_subprocess_send_signal(f->d->proc, SIGKILL);
    g_subprocess_wait(f->d->proc, NULL, NULL);
    pf_test_daemon_restart(f->d, "--set", "run=0", NULL);
    vm = pf_test_listed_vm(f->d, "kept");
    g_assert_nonnull(vm);
    g_assert_cmpint(json_object_get_int_member(vm, "pid"), ==, f->pid[0]);
    g_assert_cmpstr(json_object_get_string_member(vm, "merge_domain"), ==, "red");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
    g_clear_pointer(&vm, json_object_unref);
    vm = pf_test_listed_vm(f->d, "beta");
    g_assert_null(vm);

    /* A start time that is not the process's: not attached. */
    g_assert_cmpint(ctl(f, &out, &err, "detach", pid0, NULL), ==, 0);
    g_subprocess_send_signal(f->d->proc, SIGKILL);
    g_subprocess_wait(f->d->proc, NULL, NULL);
    g_clear_pointer(&text, g_free);
    {
        g_autofree char *boot = NULL;

        g_assert_true(g_file_get_contents("/proc/sys/kernel/random/boot_id", &boot, NULL, NULL));
        text = g_strdup_printf("{\"boot_id\":\"%s\",\"vms\":[{\"pid\":%d,\"start_time\":1,"
                               "\"name\":\"stale\"},{\"pid\":\"x\",\"name\":[]}]}",
                               g_strstrip(boot), f->pid[0]);
    }
    g_assert_true(g_file_set_contents(kept, text, -1, NULL));
    pf_test_daemon_restart(f->d, "--set", "run=0", NULL);
    vm = pf_test_listed_vm(f->d, "stale");
    g_assert_null(vm);
}

/* pagefoldctl merge-domain: two VMs in different domains share nothing;
 * put in the same one, they do; one that shares pages cannot leave. */
static void
test_merge_domain(Fixture *f, gconstpointer data)
{
    g_autofree char *pid0 = g_strdup_printf("%d", f->pid[0]);
    g_autofree char *pid1 = g_strdup_printf("%d", f->pid[1]);
    g_autofree char *out = NULL, *err = NULL;

    g_assert_cmpint(ctl(f, &out, &err, "attach", pid0, NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "attach", pid1, NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", "alpha", NULL), ==, 0);
    {
        g_autofree char *want = g_strdup_printf("VM alpha (pid %d): merge domain default\n",
                                                f->pid[0]);

        g_assert_cmpstr(out, ==, want);
    }
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", "alpha", "unlabelled", NULL), ==, 1);
    g_assert_nonnull(strstr(err, "no merge domain's name"));
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", "alpha", "red", NULL), ==, 0);
    g_assert_nonnull(strstr(out, "merge domain red"));
    /* list says which, and why a VM does not merge (attached by pid:
     * advise mode). */
    g_assert_cmpint(ctl(f, &out, &err, "list", NULL), ==, 0);
    g_test_message("%s", out);
    g_assert_nonnull(strstr(out, "MERGE_DOMAIN"));
    g_assert_nonnull(strstr(out, " red "));
    g_assert_nonnull(strstr(out, "  advise mode: "));
    g_assert_cmpint(ctl(f, &out, &err, "scan-now", "3", "--json", NULL), ==, 0);
    {
        g_autoptr(JsonObject) s = ctl_json(f, "stats", NULL);

        g_assert_cmpint(json_object_get_int_member(json_object_get_object_member(s, "total"),
                                                   "pages_sharing"), ==, 0);
    }
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", "beta", "red", NULL), ==, 0);
    g_assert_cmpint(ctl(f, &out, &err, "scan-now", "3", "--json", NULL), ==, 0);
    {
        g_autoptr(JsonObject) s = ctl_json(f, "stats", NULL);
        JsonArray *vms = json_object_get_array_member(s, "vms");

        g_assert_cmpint(json_object_get_int_member(json_object_get_object_member(s, "total"),
                                                   "pages_sharing"), ==, 2048);
        g_assert_cmpstr(json_object_get_string_member(pf_test_find_vm(vms, "beta"),
                                                      "merge_domain"), ==, "red");
    }
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", "beta", "default", NULL), ==, 1);
    g_assert_nonnull(strstr(err, "unmerge"));
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", "beta", "", NULL), ==, 1);
    g_assert_nonnull(strstr(err, "merge domain must be"));
    g_assert_cmpint(ctl(f, &out, &err, "merge-domain", NULL), ==, 2);
}

#if PF_HAVE_LIBVIRT
/* A libvirtd that hangs up on pagefoldd (killed, restarted): each
 * connection to it is closed as soon as it is made. */
static gpointer
hang_up_thread(gpointer data)
{
    GSocket *listener = data;

    for (;;) {
        g_autoptr(GSocket) s = g_socket_accept(listener, NULL, NULL);

        if (s == NULL) {
            return NULL;
        }
        g_socket_close(s, NULL);
    }
}
#endif

/* pagefoldd publishing to a libvirtd that goes away (it writes to a socket
 * the other end closed: SIGPIPE, unless ignored) goes on answering. */
static void
test_libvirt_gone(void)
{
#if PF_HAVE_LIBVIRT
    g_autofree char *dir = g_dir_make_tmp("pagefold-test-XXXXXX", NULL);
    g_autofree char *path = g_build_filename(dir, "libvirt-sock", NULL);
    g_autofree char *uri = g_strdup_printf("qemu+unix:///system?socket=%s", path);
    g_autoptr(GSocket) listener = g_socket_new(G_SOCKET_FAMILY_UNIX, G_SOCKET_TYPE_STREAM, 0,
                                               NULL);
    g_autoptr(GSocketAddress) addr = g_unix_socket_address_new(path);
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(GSubprocess) guest = NULL;
    g_autoptr(GThread) t = NULL;
    g_autoptr(JsonNode) list = NULL;
    int pid;

    g_assert_true(g_socket_bind(listener, addr, TRUE, NULL));
    g_assert_true(g_socket_listen(listener, NULL));
    t = g_thread_new("hang-up", hang_up_thread, listener);
    d = pf_test_daemon_start("--libvirt-uri", uri, "--set", "libvirt_metadata_millisecs=1000",
                             NULL);
    guest = pf_test_standin_guest("gamma", "8a6a8a3c-6f3e-4a52-9a2e-0c1d2e3f4a5b", 3, &pid);
    {
        g_autofree char *pidarg = g_strdup_printf("%d", pid);

        json_node_unref(pf_test_ctl_json(d, "attach", pidarg, NULL));
    }
    /* A few rounds of publishing, each hung up on. */
    g_usleep(4 * G_USEC_PER_SEC);
    list = pf_test_ctl_json(d, "list", NULL);
    g_assert_nonnull(pf_test_find_vm(json_node_get_array(list), "gamma"));
    g_socket_shutdown(listener, TRUE, TRUE, NULL);
    g_socket_close(listener, NULL);
    g_thread_join(g_steal_pointer(&t));
    g_subprocess_force_exit(guest);
    g_subprocess_wait(guest, NULL, NULL);
    g_unlink(path);
    g_rmdir(dir);
#else
    g_test_skip("built without libvirt");
#endif
}

#if PF_HAVE_LIBVIRT
/* Whether the process maps libvirt's library. */
static gboolean
maps_libvirt(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/maps", pid);
    g_autofree char *maps = NULL;

    g_assert_true(g_file_get_contents(path, &maps, NULL, NULL));
    return strstr(maps, "/" PF_LIBVIRT_SONAME) != NULL;
}

static void
attach(PfTestDaemon *d, int pid)
{
    g_autofree char *pidarg = g_strdup_printf("%d", pid);

    json_node_unref(pf_test_ctl_json(d, "attach", pidarg, NULL));
}
#endif

/* pagefoldd maps libvirt (and its fifty-odd libraries) only once a VM has
 * a domain to publish to: not at start, not for a VM with no UUID. */
static void
test_libvirt_loaded_late(void)
{
#if PF_HAVE_LIBVIRT
    g_autofree char *dir = g_dir_make_tmp("pagefold-test-XXXXXX", NULL);
    g_autofree char *uri = g_strdup_printf("qemu+unix:///system?socket=%s/none", dir);
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--libvirt-uri", uri, "--set",
                                                     "libvirt_metadata_millisecs=1000", NULL);
    g_autoptr(GSubprocess) plain = NULL;
    g_autoptr(GSubprocess) domain = NULL;
    g_autoptr(JsonNode) list = NULL;
    int daemon_pid = pf_test_daemon_pid(d), pid;

    plain = pf_test_standin_guest("plain", NULL, 1, &pid);
    attach(d, pid);
    /* Two intervals: a VM with no UUID gives the worker nothing to do. */
    g_usleep(2500 * 1000);
    g_assert_false(maps_libvirt(daemon_pid));

    domain = pf_test_standin_guest("domain", "1b4e28ba-2fa1-11d2-883f-0016d3cca427", 2, &pid);
    attach(d, pid);
    for (int i = 0; i < 300 && !maps_libvirt(daemon_pid); i++) {
        g_usleep(100000);
    }
    /* Loaded, though libvirt cannot be reached here: it said so. */
    g_assert_true(maps_libvirt(daemon_pid));
    list = pf_test_ctl_json(d, "list", NULL);
    g_assert_nonnull(pf_test_find_vm(json_node_get_array(list), "plain"));
    g_assert_nonnull(pf_test_find_vm(json_node_get_array(list), "domain"));
    g_subprocess_force_exit(plain);
    g_subprocess_wait(plain, NULL, NULL);
    g_subprocess_force_exit(domain);
    g_subprocess_wait(domain, NULL, NULL);
    g_rmdir(dir);
#else
    g_test_skip("built without libvirt");
#endif
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add("/cli/user-session", Fixture, NULL, setup, test_user_session, teardown);
    g_test_add("/cli/bad-command-lines", Fixture, NULL, setup, test_bad_command_lines, teardown);
    g_test_add("/cli/background-scan", Fixture, NULL, setup, test_background_scan, teardown);
    g_test_add("/cli/same-name", Fixture, NULL, setup, test_same_name, teardown);
    g_test_add("/cli/merge-domain", Fixture, NULL, setup, test_merge_domain, teardown);
    g_test_add("/cli/config", Fixture, NULL, setup, test_config, teardown);
    g_test_add("/cli/attached-again", Fixture, NULL, setup, test_attached_again, teardown);
    g_test_add_func("/cli/libvirt-gone", test_libvirt_gone);
    g_test_add_func("/cli/libvirt-loaded-late", test_libvirt_loaded_late);
    return g_test_run();
}
