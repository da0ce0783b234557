/*
 * bench-kernel-build-test.c - scripts/bench-kernel-build's own failure
 * paths: bad options get a usage error and start nothing; a run
 * interrupted (Ctrl-C) while its guests boot stops every guest and daemon
 * it started, removes its work folder and puts KSM's knobs back as found.
 * The benchmark itself runs in the bench suite, its smoke form in qemu.
 *
 * The interrupt case needs QEMU_BINARY and BENCH_GUEST (scripts/run-tests
 * sets them) and root; it skips without.
 */
#include <gio/gio.h>
#include <glib/gstdio.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char *
script(void)
{
    return g_build_filename(g_getenv("PAGEFOLD_SOURCE_DIR"), "scripts", "bench-kernel-build",
                            NULL);
}

/* The work folders runs leave in /var/tmp, by name. */
static GHashTable *
work_dirs(void)
{
    GHashTable *set = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, NULL);
    g_autoptr(GDir) d = g_dir_open("/var/tmp", 0, NULL);
    const char *e;

    while (d != NULL && (e = g_dir_read_name(d)) != NULL) {
        if (g_str_has_prefix(e, "pagefold-bench-")) {
            g_hash_table_add(set, g_strdup(e));
        }
    }
    return set;
}

static void
test_bad_options(void)
{
    static const char *const cases[][3] = {
        { "--guests", "0", "--guests: '0' must be at least 1" },
        { "--mib", "lots", "--mib: 'lots' is not a whole number" },
        { "--systems", "ksm,zfs", "unknown system(s) zfs" },
        { "--systems", "ksm,ksm", "a system is named twice" },
        { "--target", "two words", "--target: 'two words' is not a make target" },
        { "--frobnicate", "1", "unrecognized arguments: --frobnicate" },
    };
    g_autofree char *path = script();
    g_autoptr(GHashTable) before = work_dirs();
    g_autoptr(GHashTable) after = NULL;

    for (gsize i = 0; i < G_N_ELEMENTS(cases); i++) {
        const char *argv[] = { path, cases[i][0], cases[i][1], NULL };
        g_autofree char *out = NULL, *err = NULL;
        g_autoptr(GError) error = NULL;
        int status;

        g_assert_true(g_spawn_sync(NULL, (char **)argv, NULL, G_SPAWN_DEFAULT, NULL, NULL, &out,
                                   &err, &status, &error));
        g_assert_no_error(error);
        g_test_message("%s %s: %s", cases[i][0], cases[i][1], err);
        g_assert_true(WIFEXITED(status));
        g_assert_cmpint(WEXITSTATUS(status), ==, 2);
        g_assert_cmpstr(out, ==, "");
        g_assert_nonnull(strstr(err, "usage: bench-kernel-build"));
        g_assert_nonnull(strstr(err, cases[i][2]));
    }
    after = work_dirs();
    g_assert_cmpuint(g_hash_table_size(after), ==, g_hash_table_size(before));
}

static char *
ksm_knobs(void)
{
    GString *s = g_string_new(NULL);
    const char *knobs[] = { "run", "pages_to_scan", "sleep_millisecs", "advisor_mode" };

    for (gsize i = 0; i < G_N_ELEMENTS(knobs); i++) {
        g_autofree char *path = g_strconcat("/sys/kernel/mm/ksm/", knobs[i], NULL);
        g_autofree char *v = NULL;

        if (g_file_get_contents(path, &v, NULL, NULL)) {
            g_string_append_printf(s, "%s=%s ", knobs[i], g_strstrip(v));
        }
    }
    return g_string_free(s, FALSE);
}

/* Processes whose command line names dir: what the run started there. */
static guint
processes_in(const char *dir)
{
    g_autoptr(GDir) d = g_dir_open("/proc", 0, NULL);
    const char *e;
    guint n = 0;

    while (d != NULL && (e = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_strdup_printf("/proc/%s/cmdline", e);
        g_autofree char *cmd = NULL;
        gsize len;

        if (!g_ascii_isdigit(e[0]) || !g_file_get_contents(path, &cmd, &len, NULL)) {
            continue;
        }
        for (gsize i = 0; i + 1 < len; i++) {
            if (cmd[i] == '\0') {
                cmd[i] = ' ';
            }
        }
        n += strstr(cmd, dir) != NULL;
    }
    return n;
}

static void
test_interrupt(void)
{
    g_autofree char *path = script();
    g_autofree char *tmp = g_dir_make_tmp("bench-kbt-XXXXXX", NULL);
    g_autofree char *out = g_build_filename(tmp, "results", NULL);
    g_autofree char *ksm_before = NULL, *ksm_after = NULL, *work = NULL;
    const char *argv[] = { path, "--guests", "2", "--mib", "256", "--systems", "ksm-fast",
                           "--out", out, NULL };
    g_autoptr(GHashTable) before = NULL;
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;

    if (g_getenv("QEMU_BINARY") == NULL || g_getenv("BENCH_GUEST") == NULL) {
        g_test_skip("needs QEMU_BINARY and BENCH_GUEST (scripts/run-tests sets them)");
        return;
    }
    if (getuid() != 0 || !g_file_test("/sys/kernel/mm/ksm/run", G_FILE_TEST_EXISTS)) {
        g_test_skip("needs root and kernel KSM");
        return;
    }
    ksm_before = ksm_knobs();
    before = work_dirs();
    p = g_subprocess_newv(argv, G_SUBPROCESS_FLAGS_STDERR_SILENCE, &error);
    g_assert_no_error(error);
    /* Until both guests' QEMUs run in the run's work folder. */
    for (int i = 0; i < 600 && work == NULL; i++) {
        g_autoptr(GHashTable) now = work_dirs();
        GHashTableIter it;
        gpointer name;

        g_hash_table_iter_init(&it, now);
        while (g_hash_table_iter_next(&it, &name, NULL)) {
            g_autofree char *dir = g_build_filename("/var/tmp", name, NULL);

            if (!g_hash_table_contains(before, name) && processes_in(dir) >= 2) {
                work = g_steal_pointer(&dir);
            }
        }
        if (work == NULL) {
            g_usleep(100000);
        }
    }
    /* Its KSM knobs are set before its guests start. */
    g_assert_nonnull(work);
    g_subprocess_send_signal(p, SIGINT);
    g_assert_true(g_subprocess_wait(p, NULL, &error));
    g_assert_true(g_subprocess_get_if_exited(p));
    g_assert_cmpint(g_subprocess_get_exit_status(p), ==, 130);
    g_assert_cmpuint(processes_in(work), ==, 0);
    g_assert_false(g_file_test(work, G_FILE_TEST_EXISTS));
    g_assert_false(g_file_test(out, G_FILE_TEST_EXISTS));
    ksm_after = ksm_knobs();
    g_assert_cmpstr(ksm_after, ==, ksm_before);
    g_rmdir(tmp);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/bench-kernel-build/bad-options", test_bad_options);
    g_test_add_func("/bench-kernel-build/interrupt", test_interrupt);
    return g_test_run();
}
