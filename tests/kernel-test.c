/*
 * kernel-test.c - the agent suite (the agent-*-test programs, link-test and
 * link-peers-test) on another kernel than the host's: Debian 12's own 6.1
 * (GUEST_KERNEL), booted once under QEMU from an initramfs of this build's
 * programs (scripts/build-test-initrd).  Inside, each test path runs on its
 * own under a watchdog; here each becomes one case, /kernel/6.1/agent/...,
 * that passes, skips or fails as it did in the guest, with its output's
 * tail and the kernel's messages meanwhile.
 *
 * Owns: the guest's QEMU process and its logs.  It must never run the
 * agent tests on the host (the agent suite does), never take longer than
 * KERNEL_TEST_DEADLINE (a hung path costs its own timeout, a hung guest
 * the deadline; what the guest reported before that still counts), and
 * never print anything but TAP on stdout (meson reads it).
 *
 * Environment: QEMU_BINARY and GUEST_KERNEL (scripts/run-tests; without
 * them every case skips), KERNEL_TEST_KERNEL (another bzImage instead),
 * and from tests/meson.build KERNEL_TEST_INITRD, KERNEL_TEST_PROGRAMS (the
 * host's copies, listed with -l to name the cases), KERNEL_TEST_LOG_DIR,
 * KERNEL_TEST_PATH_TIMEOUT, KERNEL_TEST_DEADLINE.
 */
#include <gio/gio.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

#include "testproc.h"

#define TAIL_LINES 40

typedef struct {
    char *prog; /* basename, as the guest names it */
    char *path; /* the path inside that program */
} Case;

typedef struct {
    int rc;
    char *secs;
    GPtrArray *output; /* its last lines, as the guest sent them */
    GPtrArray *kernel; /* console lines the kernel printed while it ran */
} Result;

static struct {
    char *label;   /* "6.1": the kernel's version, in the case names */
    char *only;    /* pf.only for the guest, from -p; NULL: every path */
    gboolean booted;
    gboolean done;     /* the guest got through its list */
    char *release;     /* uname -r in the guest */
    char *why;         /* why it stopped early */
    char *running;     /* "prog path" it was running then, if any */
    double secs;
    GHashTable *results; /* "prog path" -> Result */
    GPtrArray *console;
} guest;

static void
result_free(gpointer p)
{
    Result *r = p;

    g_free(r->secs);
    g_ptr_array_unref(r->output);
    g_ptr_array_unref(r->kernel);
    g_free(r);
}

static int
env_int(const char *var, int dflt)
{
    const char *v = g_getenv(var);

    return v != NULL && atoi(v) > 0 ? atoi(v) : dflt;
}

static const char *
kernel_path(void)
{
    const char *k = g_getenv("KERNEL_TEST_KERNEL");

    return k != NULL ? k : g_getenv("GUEST_KERNEL");
}

/* The release a bzImage was built as, from its boot header (the
 * kernel_version field points at "6.1.0-NN-amd64 (...) #1 SMP ..."): the
 * case names must say which kernel ran without booting it to list them. */
static char *
bzimage_release(const char *path)
{
    g_autofree char *data = NULL;
    gsize len = 0;
    gsize off;

    if (!g_file_get_contents(path, &data, &len, NULL) || len < 0x210 ||
        memcmp(data + 0x202, "HdrS", 4) != 0) {
        return NULL;
    }
    off = 0x200 + ((guint8)data[0x20e] | (gsize)(guint8)data[0x20f] << 8);
    if (off >= len) {
        return NULL;
    }
    return g_strndup(data + off, strcspn(data + off, " "));
}

/* "6.1.0-57-amd64" -> "6.1". */
static char *
release_label(const char *release)
{
    g_autoptr(GRegex) re = g_regex_new("^[0-9]+\\.[0-9]+", 0, 0, NULL);
    g_autoptr(GMatchInfo) m = NULL;

    if (release != NULL && g_regex_match(re, release, 0, &m)) {
        return g_match_info_fetch(m, 0);
    }
    return g_strdup("guest");
}

/* The guest runs only what the -p options select: gtest's own filter
 * applies to our case names, this one to the paths inside.  Returns NULL
 * for every path. */
static char *
inner_filter(int argc, char **argv, const char *prefix)
{
    g_autoptr(GPtrArray) inner = g_ptr_array_new_with_free_func(g_free);
    gboolean any = FALSE;
    gsize plen = strlen(prefix);

    for (int i = 1; i < argc; i++) {
        const char *p = NULL;

        if (g_str_equal(argv[i], "-p") && i + 1 < argc) {
            p = argv[++i];
        } else if (g_str_has_prefix(argv[i], "-p=")) {
            p = argv[i] + 3;
        }
        if (p == NULL) {
            continue;
        }
        any = TRUE;
        if (g_str_has_prefix(prefix, p) && (prefix[strlen(p)] == '\0' ||
                                            prefix[strlen(p)] == '/' ||
                                            g_str_has_suffix(p, "/"))) {
            return NULL;
        }
        if (g_str_has_prefix(p, prefix) && p[plen] == '/') {
            g_ptr_array_add(inner, g_strdup(p + plen));
        }
    }
    if (!any) {
        return NULL;
    }
    /* Nothing of ours selected: no case runs, so no guest boots; "-"
     * would select no path if one did. */
    if (inner->len == 0) {
        return g_strdup("-");
    }
    g_ptr_array_add(inner, NULL);
    return g_strjoinv(",", (char **)inner->pdata);
}

static void
die_with_parent(gpointer user)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
}

static gboolean
on_deadline(gpointer data)
{
    GSubprocess *p = data;

    g_free(guest.why);
    guest.why = g_strdup_printf("the guest was killed at the %d s deadline",
                                env_int("KERNEL_TEST_DEADLINE", 840));
    g_subprocess_force_exit(p);
    return G_SOURCE_REMOVE;
}

static void
qemu_exited(GObject *source, GAsyncResult *res, gpointer data)
{
    g_subprocess_wait_finish(G_SUBPROCESS(source), res, NULL);
    g_main_loop_quit(data);
}

static GPtrArray *
read_lines(const char *path)
{
    g_autofree char *text = NULL;
    GPtrArray *lines = g_ptr_array_new_with_free_func(g_free);
    g_auto(GStrv) split = NULL;

    if (!g_file_get_contents(path, &text, NULL, NULL)) {
        return lines;
    }
    /* The serial ports are ttys: each line ends in \r\n. */
    g_strdelimit(text, "\r", '\n');
    split = g_strsplit(text, "\n", -1);
    for (char **l = split; *l != NULL; l++) {
        if (**l != '\0') {
            g_ptr_array_add(lines, g_strdup(*l));
        }
    }
    return lines;
}

/* The second serial port: PFK START/BEGIN/END/DONE around each path's
 * output (scripts/build-test-initrd says the format). */
static void
parse_results(GPtrArray *lines)
{
    Result *cur = NULL;

    for (guint i = 0; i < lines->len; i++) {
        const char *l = lines->pdata[i];

        if (g_str_has_prefix(l, "PFK START ")) {
            g_free(guest.release);
            guest.release = g_strdup(l + strlen("PFK START "));
        } else if (g_str_has_prefix(l, "PFK BEGIN ")) {
            cur = g_new0(Result, 1);
            cur->rc = -1;
            cur->output = g_ptr_array_new_with_free_func(g_free);
            cur->kernel = g_ptr_array_new_with_free_func(g_free);
            g_hash_table_replace(guest.results, g_strdup(l + strlen("PFK BEGIN ")), cur);
        } else if (g_str_has_prefix(l, "| ") && cur != NULL) {
            g_ptr_array_add(cur->output, g_strdup(l + 2));
        } else if (g_str_has_prefix(l, "PFK END ") && cur != NULL) {
            const char *rc = strstr(l, " rc=");
            const char *secs = strstr(l, " secs=");

            cur->rc = rc != NULL ? atoi(rc + 4) : -1;
            cur->secs = g_strdup(secs != NULL ? secs + 6 : "?");
            cur = NULL;
        } else if (g_str_equal(l, "PFK DONE")) {
            guest.done = TRUE;
        }
    }
}

/* The console: what the kernel printed between "pfk: run PROG PATH" and
 * "pfk: result ..." belongs to that path (a hung task, a warning, an
 * oops). */
static void
attach_kernel_lines(void)
{
    Result *cur = NULL;

    for (guint i = 0; i < guest.console->len; i++) {
        const char *l = guest.console->pdata[i];

        if (g_str_has_prefix(l, "pfk: run ")) {
            cur = g_hash_table_lookup(guest.results, l + strlen("pfk: run "));
            g_free(guest.running);
            guest.running = g_strdup(l + strlen("pfk: run "));
        } else if (g_str_has_prefix(l, "pfk: ")) {
            cur = NULL;
            g_clear_pointer(&guest.running, g_free);
        } else if (cur != NULL) {
            g_ptr_array_add(cur->kernel, g_strdup(l));
        }
    }
}

/* Boots the guest once, for whichever case runs first, and waits for it
 * to power off or for the deadline. */
/* KVM where QEMU really runs a guest under it (scripts/probe-kvm: /dev/kvm
 * can exist where QEMU 7.2 cannot use it), TCG otherwise: the kernel is
 * the point, not the accelerator. */
static const char *
accelerator(void)
{
    g_autofree char *why = NULL;

    if (pf_test_probe_kvm(kernel_path(), g_getenv("KERNEL_TEST_INITRD"), &why)) {
        return "kvm";
    }
    g_test_message("the guest runs under TCG: %s", why);
    return "tcg";
}

static void
guest_run(void)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GSubprocessLauncher) l = NULL;
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GMainContext) ctx = g_main_context_new();
    g_autoptr(GMainLoop) loop = g_main_loop_new(ctx, FALSE);
    g_autoptr(GSource) deadline = NULL;
    const char *logdir = g_getenv("KERNEL_TEST_LOG_DIR");
    g_autofree char *dir = NULL;
    g_autofree char *console = NULL, *results = NULL, *qemu_log = NULL;
    g_autofree char *append = NULL;
    g_autofree char *serial0 = NULL, *serial1 = NULL;
    g_autoptr(GPtrArray) res_lines = NULL;
    gint64 t0 = g_get_monotonic_time();

    if (guest.booted) {
        return;
    }
    guest.booted = TRUE;
    guest.results = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, result_free);
    if (logdir != NULL) {
        g_mkdir_with_parents(logdir, 0755);
        dir = g_strdup(logdir);
    } else {
        dir = g_dir_make_tmp("pagefold-kernel-XXXXXX", &error);
        g_assert_no_error(error);
    }
    console = g_build_filename(dir, "console.log", NULL);
    results = g_build_filename(dir, "results.log", NULL);
    qemu_log = g_build_filename(dir, "qemu.log", NULL);
    serial0 = g_strdup_printf("file:%s", console);
    serial1 = g_strdup_printf("file:%s", results);
    append = g_strdup_printf("console=ttyS0 no_timer_check rdinit=/init panic=-1 quiet pf.timeout=%d%s%s",
                             env_int("KERNEL_TEST_PATH_TIMEOUT", 120),
                             guest.only != NULL ? " pf.only=" : "",
                             guest.only != NULL ? guest.only : "");
    {
        /* 2 GiB: the tests' stand-in VMMs map up to 3 x 16 MiB of guest
         * RAM each, pagefoldd its pool. */
        const char *argv[] = {
            g_getenv("QEMU_BINARY"), "-machine", "pc", "-accel", accelerator(),
            "-m", "2048", "-smp", "2", "-kernel", kernel_path(),
            "-initrd", g_getenv("KERNEL_TEST_INITRD"), "-append", append,
            "-nic", "none", "-display", "none", "-vga", "none", "-monitor", "none",
            "-serial", serial0, "-serial", serial1, "-no-reboot",
            "-L", "/usr/share/seabios", "-L", "/usr/share/qemu", NULL,
        };

        g_test_message("booting %s with %s", kernel_path(), g_getenv("KERNEL_TEST_INITRD"));
        if (logdir != NULL) {
            g_test_message("console: %s", console);
        }
        l = g_subprocess_launcher_new(G_SUBPROCESS_FLAGS_STDERR_MERGE);
        g_subprocess_launcher_set_stdout_file_path(l, qemu_log);
        g_subprocess_launcher_set_child_setup(l, die_with_parent, NULL, NULL);
        p = g_subprocess_launcher_spawnv(l, argv, &error);
    }
    if (p == NULL) {
        guest.why = g_strdup_printf("QEMU did not start: %s", error->message);
        guest.console = g_ptr_array_new_with_free_func(g_free);
        return;
    }
    g_main_context_push_thread_default(ctx);
    g_subprocess_wait_async(p, NULL, qemu_exited, loop);
    deadline = g_timeout_source_new_seconds((guint)env_int("KERNEL_TEST_DEADLINE", 840));
    g_source_set_callback(deadline, on_deadline, p, NULL);
    g_source_attach(deadline, ctx);
    g_main_loop_run(loop);
    g_source_destroy(deadline);
    g_main_context_pop_thread_default(ctx);
    guest.secs = (double)(g_get_monotonic_time() - t0) / G_USEC_PER_SEC;

    res_lines = read_lines(results);
    parse_results(res_lines);
    guest.console = read_lines(console);
    attach_kernel_lines();
    if (!guest.done && guest.why == NULL) {
        g_autoptr(GPtrArray) q = read_lines(qemu_log);

        guest.why = g_strdup_printf("the guest stopped early (QEMU %s%s)",
                                    q->len > 0 ? "said: " : "exited",
                                    q->len > 0 ? (char *)q->pdata[q->len - 1] : "");
    }
    if (logdir == NULL) {
        g_unlink(console);
        g_unlink(results);
        g_unlink(qemu_log);
        g_rmdir(dir);
    }
}

/* Each line its own message: a newline inside one would break the TAP
 * stream meson parses. */
static void
message_tail(const char *what, GPtrArray *lines, guint n)
{
    guint from = lines->len > n ? lines->len - n : 0;

    if (lines->len == 0) {
        return;
    }
    g_test_message("%s%s:", what, from > 0 ? " (its end)" : "");
    for (guint i = from; i < lines->len; i++) {
        g_test_message("  %s", (char *)lines->pdata[i]);
    }
}

static gboolean
have_guest(void)
{
    const char *initrd = g_getenv("KERNEL_TEST_INITRD");
    GStatBuf st;

    if (g_getenv("QEMU_BINARY") == NULL || kernel_path() == NULL || initrd == NULL) {
        g_test_skip("QEMU_BINARY and GUEST_KERNEL are not set: scripts/run-tests builds "
                    "QEMU and the guest kernel and sets them");
        return FALSE;
    }
    /* scripts/build-test-initrd leaves it empty without its packages. */
    if (g_stat(initrd, &st) != 0 || st.st_size == 0) {
        g_test_skip_printf("%s is empty: install busybox-static and cpio "
                           "(scripts/install-deps), then remove it and run again", initrd);
        return FALSE;
    }
    return TRUE;
}

static void
test_boot(void)
{
    if (!have_guest()) {
        return;
    }
    guest_run();
    g_test_message("kernel %s, %u paths reported, %.0f s from boot to power-off",
                   guest.release ? guest.release : "(did not start)",
                   g_hash_table_size(guest.results), guest.secs);
    if (!guest.done) {
        message_tail("console", guest.console, TAIL_LINES);
        g_test_fail_printf("%s", guest.why);
    }
}

/* The first line of the output that says what went wrong (a failed
 * assertion, a Bail out!, a "not ok"; later ones tend to be its echoes),
 * for the one-line TAP reason. */
static const char *
first_error(GPtrArray *out)
{
    for (guint i = 0; i < out->len; i++) {
        const char *l = out->pdata[i];

        if (strstr(l, "ERROR") != NULL || g_str_has_prefix(l, "Bail out!") ||
            g_str_has_prefix(l, "not ok")) {
            return l;
        }
    }
    return out->len > 0 ? out->pdata[out->len - 1] : "no output";
}

static void
test_path(gconstpointer data)
{
    const Case *c = data;
    g_autofree char *key = g_strdup_printf("%s %s", c->prog, c->path);
    const char *skip = NULL;
    gboolean ok = FALSE, not_ok = FALSE;
    Result *r;

    if (!have_guest()) {
        return;
    }
    guest_run();
    r = g_hash_table_lookup(guest.results, key);
    if (r == NULL || r->secs == NULL) {
        if (r != NULL) {
            message_tail("output", r->output, TAIL_LINES);
        }
        g_test_fail_printf("%s %s: no result: %s%s", c->prog, c->path,
                           guest.why ? guest.why : "the guest did not run it",
                           g_strcmp0(guest.running, key) == 0 ? " while it ran this path" : "");
        return;
    }
    for (guint i = 0; i < r->output->len; i++) {
        const char *l = r->output->pdata[i];

        if (g_str_has_prefix(l, "not ok ")) {
            not_ok = TRUE;
        } else if (g_str_has_prefix(l, "ok ")) {
            ok = TRUE;
            skip = strstr(l, "# SKIP");
        }
    }
    message_tail("kernel", r->kernel, TAIL_LINES);
    if (r->rc == 0 && ok && !not_ok) {
        if (skip != NULL) {
            g_autofree char *why = g_strdup(skip + strlen("# SKIP"));

            g_test_skip_printf("skipped on %s: %s", guest.release, g_strstrip(why));
        } else {
            g_test_message("passed on %s in %s s", guest.release, r->secs);
        }
        return;
    }
    if (r->rc == 77) {
        g_test_skip_printf("skipped on %s (exit status 77)", guest.release);
        return;
    }
    message_tail("output", r->output, TAIL_LINES);
    if (g_getenv("KERNEL_TEST_LOG_DIR") != NULL) {
        g_test_message("its last 200 lines: %s/results.log", g_getenv("KERNEL_TEST_LOG_DIR"));
    }
    if (r->rc == 124 || r->rc == 137) {
        g_test_fail_printf("timed out on %s: killed after %s s (a hang)", guest.release,
                           r->secs);
    } else if (r->rc > 128) {
        g_test_fail_printf("killed by signal %d (%s) on %s after %s s: %s", r->rc - 128,
                           g_strsignal(r->rc - 128), guest.release, r->secs,
                           first_error(r->output));
    } else if (r->rc == 0 && !ok) {
        g_test_fail_printf("no test ran on %s: is %s a path of %s?", guest.release, c->path,
                           c->prog);
    } else {
        g_test_fail_printf("failed on %s (exit status %d) after %s s: %s", guest.release,
                           r->rc, r->secs, first_error(r->output));
    }
}

/* The cases: one per path that `PROGRAM -l` lists on the host. */
static void
add_program(const char *prog, const char *prefix)
{
    g_autofree char *out = NULL;
    g_autofree char *base = g_path_get_basename(prog);
    g_auto(GStrv) lines = NULL;
    g_autoptr(GError) error = NULL;
    const char *argv[] = { prog, "-l", NULL };
    int status = 0;

    if (!g_spawn_sync(NULL, (char **)argv, NULL, G_SPAWN_STDERR_TO_DEV_NULL, NULL, NULL, &out,
                      NULL, &status, &error) ||
        !g_spawn_check_wait_status(status, &error)) {
        g_error("%s -l: %s", prog, error->message);
    }
    lines = g_strsplit(out, "\n", -1);
    for (char **l = lines; *l != NULL; l++) {
        if (**l == '/') {
            Case *c = g_new0(Case, 1);
            g_autofree char *name = g_strconcat(prefix, *l, NULL);

            c->prog = g_strdup(base);
            c->path = g_strdup(*l);
            g_test_add_data_func_full(name, c, test_path, NULL);
        }
    }
}

int
main(int argc, char **argv)
{
    const char *programs = g_getenv("KERNEL_TEST_PROGRAMS");
    g_autofree char *release = NULL;
    g_autofree char *prefix = NULL;
    g_autofree char *boot = NULL;

    release = kernel_path() != NULL ? bzimage_release(kernel_path()) : NULL;
    guest.label = release_label(release);
    prefix = g_strdup_printf("/kernel/%s", guest.label);
    guest.only = inner_filter(argc, argv, prefix);
    /* Keep going past a failed case (GLib 2.74 bails out at the first):
     * every case only reads what the one guest run reported. */
    {
        char **args = g_new0(char *, argc + 2);

        memcpy(args, argv, sizeof(char *) * (gsize)argc);
        args[argc++] = (char *)"--keep-going";
        argv = args;
    }
    g_test_init(&argc, &argv, NULL);

    boot = g_strconcat(prefix, "/boot", NULL);
    g_test_add_func(boot, test_boot);
    if (programs != NULL && g_getenv("QEMU_BINARY") != NULL && kernel_path() != NULL) {
        g_auto(GStrv) progs = g_strsplit(programs, ":", -1);

        for (char **p = progs; *p != NULL; p++) {
            if (**p != '\0') {
                add_program(*p, prefix);
            }
        }
    }
    return g_test_run();
}
