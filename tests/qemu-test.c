/*
 * qemu-test.c - the patched QEMU booting tiny Linux guests under TCG, with
 * memfd shared RAM and the pagefold agent, against the real pagefoldd.
 * Each guest runs pfguest (tests/guest/): it fills memory as real guests
 * do, keeps writing, checks every byte, and prints PASS or FAIL.
 *
 * The binaries come from scripts/build-qemu and scripts/build-guest
 * (scripts/run-tests exports QEMU_BINARY, GUEST_KERNEL, GUEST_INITRD).
 * TCG stands in for KVM, which this machine lacks; nothing here depends on
 * TCG: KVM follows remapped host pages through its MMU notifier.
 */
#include <fcntl.h>
#include <signal.h>
#include <glib.h>
#include <string.h>
#include <sys/stat.h>

#include "testproc.h"
#include "util.h"

#define GUEST_MIB 256
#define FILL_MIB 64
#define FILL_PAGES (FILL_MIB * 256)

typedef struct {
    GSubprocess *proc;
    GAsyncQueue *lines; /* char*, from the serial console */
    GThread *reader;
    int pid;
    char *name;
} Guest;

static gpointer
read_console(gpointer data)
{
    Guest *g = data;
    g_autoptr(GDataInputStream) in =
        g_data_input_stream_new(g_subprocess_get_stdout_pipe(g->proc));
    char *line;

    while ((line = g_data_input_stream_read_line(in, NULL, NULL, NULL)) != NULL) {
        /* The firmware's escape sequences may precede a line. */
        const char *at = strstr(line, "PFGUEST");

        if (at != NULL) {
            g_async_queue_push(g->lines, g_strdup(at));
        } else if (strstr(line, "pagefold") != NULL) {
            g_async_queue_push(g->lines, g_strdup(line));
        }
        g_free(line);
    }
    g_async_queue_push(g->lines, g_strdup("EOF"));
    return NULL;
}

static Guest *
guest_start(PfTestDaemon *d, const char *name, int seed, int seconds, gboolean reboot)
{
    Guest *g = g_new0(Guest, 1);
    g_autoptr(GError) error = NULL;
    g_autofree char *mem = g_strdup_printf("memory-backend-memfd,id=ram,size=%dM,share=on",
                                           GUEST_MIB);
    g_autofree char *agent = g_strdup_printf("x-pagefold-agent,id=pf0,socket=%s",
                                             d->agent_sock);
    g_autofree char *append = g_strdup_printf(
        "console=ttyS0 quiet pfguest.mib=%d pfguest.seed=%d pfguest.seconds=%d "
        "pfguest.check_s=4 pfguest.reboot=%d", FILL_MIB, seed, seconds, reboot);
    g_autofree char *guestname = g_strdup_printf("guest=%s", name);
    g_autofree char *m = g_strdup_printf("%dM", GUEST_MIB);
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    const char *args[] = {
        pf_test_bin("QEMU_BINARY"), "-machine", "pc,accel=tcg,memory-backend=ram",
        "-m", m, "-object", mem, "-object", agent, "-name", guestname,
        "-kernel", pf_test_bin("GUEST_KERNEL"), "-initrd", pf_test_bin("GUEST_INITRD"),
        "-append", append, "-nographic", "-nic", "none",
        "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
    };

    for (gsize i = 0; i < G_N_ELEMENTS(args); i++) {
        g_ptr_array_add(argv, (char *)args[i]);
    }
    if (!reboot) {
        g_ptr_array_add(argv, (char *)"-no-reboot");
    }
    g_ptr_array_add(argv, NULL);
    g->name = g_strdup(name);
    g->lines = g_async_queue_new_full(g_free);
    g->proc = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_MERGE |
                             G_SUBPROCESS_FLAGS_STDIN_PIPE,
                             (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    g->pid = atoi(g_subprocess_get_identifier(g->proc));
    g->reader = g_thread_new("console", read_console, g);
    return g;
}

/* Waits for a console line starting with prefix; fails on PFGUEST FAIL. */
static char *
guest_expect(Guest *g, const char *prefix, guint seconds)
{
    gint64 end = g_get_monotonic_time() + (gint64)seconds * G_USEC_PER_SEC;

    for (;;) {
        gint64 left = end - g_get_monotonic_time();
        char *line = left > 0 ? g_async_queue_timeout_pop(g->lines, (guint64)left) : NULL;

        if (line == NULL) {
            g_error("guest %s: no '%s' within %u s", g->name, prefix, seconds);
        }
        g_test_message("%s: %s", g->name, line);
        if (strstr(line, "FAIL") != NULL || g_str_equal(line, "EOF")) {
            g_error("guest %s: %s", g->name, line);
        }
        if (g_str_has_prefix(line, prefix)) {
            return line;
        }
        g_free(line);
    }
}

static void
guest_free(Guest *g)
{
    g_subprocess_force_exit(g->proc);
    g_subprocess_wait(g->proc, NULL, NULL);
    g_thread_join(g->reader);
    g_async_queue_unref(g->lines);
    g_object_unref(g->proc);
    g_free(g->name);
    g_free(g);
}

static gint64
total(JsonNode *n, const char *name)
{
    return json_object_get_int_member(
        json_object_get_object_member(json_node_get_object(n), "total"), name);
}

static gint64
memfd_kib(int pid)
{
    g_autofree char *dir = g_strdup_printf("/proc/%d/fd", pid);
    g_autoptr(GDir) d = g_dir_open(dir, 0, NULL);
    const char *e;

    while (d && (e = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_build_filename(dir, e, NULL);
        g_autofree char *target = g_file_read_link(path, NULL);
        struct stat st;

        if (target && g_str_has_prefix(target, "/memfd:memory-backend-memfd") &&
            stat(path, &st) == 0) {
            return st.st_blocks / 2;
        }
    }
    return -1;
}

static gboolean
have_qemu(void)
{
    if (g_getenv("QEMU_BINARY") == NULL || g_getenv("GUEST_KERNEL") == NULL) {
        g_test_skip("QEMU_BINARY and GUEST_KERNEL are not set: scripts/run-tests builds "
                    "QEMU and the guest and sets them");
        return FALSE;
    }
    return TRUE;
}

/* Two guests merge what pfguest makes identical and zero, guest memory
 * falls by that much, and both check every byte while merged, written
 * (copy-on-write) and merged again. */
static void
test_two_guests(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    gint64 before[2];
    JsonNode *s = NULL;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g[0] = guest_start(d, "tcg0", 1, 40, FALSE);
    g[1] = guest_start(d, "tcg1", 2, 40, FALSE);

    for (int i = 0; i < 2; i++) {
        g_free(guest_expect(g[i], "PFGUEST READY", 120));
        before[i] = memfd_kib(g[i]->pid);
    }
    /* Merge while the guests run and write; a few passes settle it. */
    for (int pass = 0; pass < 4; pass++) {
        g_clear_pointer(&s, json_node_unref);
        s = pf_test_ctl_json(d, "scan-now", "2", NULL);
    }
    g_assert_cmpstr(json_object_get_string_member(json_node_get_object(s), "mode"), ==,
                    "merge");
    /* pfguest's identical pages, at the least, are shared across the two. */
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    g_assert_cmpint(total(s, "zero_pages"), >=, 2 * FILL_PAGES / 5 * 9 / 10);
    for (int i = 0; i < 2; i++) {
        gint64 after = memfd_kib(g[i]->pid);

        g_test_message("%s: memfd %" G_GINT64_FORMAT " KiB -> %" G_GINT64_FORMAT " KiB",
                       g[i]->name, before[i], after);
        /* Each guest's memfd lost at least its zero pages and its share of
         * the identical ones (the pool holds one copy for both). */
        g_assert_cmpint(before[i] - after, >=, (FILL_PAGES / 5 + FILL_PAGES / 4) * 4 * 9 / 10);
    }
    /* The guests check everything while merged, and at the end. */
    for (int i = 0; i < 2; i++) {
        g_free(guest_expect(g[i], "PFGUEST CHECK ok", 60));
        g_free(guest_expect(g[i], "PFGUEST PASS", 120));
    }
    json_node_unref(s);
    for (int i = 0; i < 2; i++) {
        guest_free(g[i]);
    }
}

/* Merged, then: one guest reboots (its RAM is rewritten over merged
 * pages), pagefoldd is killed and started again, the other guest powers
 * off.  No guest fails its checks; the stopped VM's slots are freed. */
static void
test_reboot_restart_shutdown(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    JsonNode *s = NULL;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g[0] = guest_start(d, "rb0", 1, 16, TRUE);  /* reboots after 16 s */
    g[1] = guest_start(d, "rb1", 2, 16, FALSE); /* powers off after 16 s */
    for (int i = 0; i < 2; i++) {
        g_free(guest_expect(g[i], "PFGUEST READY", 120));
    }
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    json_node_unref(s);

    /* rb0 reboots: the same RAM, rewritten by a fresh kernel and pfguest. */
    g_free(guest_expect(g[0], "PFGUEST PASS", 120));
    g_free(guest_expect(g[0], "PFGUEST READY", 120));
    s = pf_test_ctl_json(d, "scan-now", "2", NULL);
    json_node_unref(s);
    g_free(guest_expect(g[0], "PFGUEST CHECK ok", 60));

    /* rb1 powers off while merged: its slots go with it. */
    g_free(guest_expect(g[1], "PFGUEST PASS", 120));
    g_subprocess_wait(g[1]->proc, NULL, NULL);
    for (int i = 0; i < 100; i++) {
        s = pf_test_ctl_json(d, "list", NULL);
        if (json_array_get_length(json_node_get_array(s)) == 1) {
            json_node_unref(s);
            break;
        }
        json_node_unref(s);
        g_usleep(100000);
    }
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(s), "pool_slots"), ==,
                    total(s, "pages_shared"));
    json_node_unref(s);

    /* pagefoldd killed and started again: rb0 runs on, merged pages valid. */
    g_subprocess_send_signal(d->proc, SIGKILL);
    g_subprocess_wait(d->proc, NULL, NULL);
    pf_test_daemon_restart(d, "--set", "run=0", NULL);
    g_free(guest_expect(g[0], "PFGUEST CHECK ok", 60));
    g_free(guest_expect(g[0], "PFGUEST PASS", 120));
    for (int i = 0; i < 2; i++) {
        guest_free(g[i]);
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/qemu/two-guests", test_two_guests);
    g_test_add_func("/qemu/reboot-restart-shutdown", test_reboot_restart_shutdown);
    return g_test_run();
}
