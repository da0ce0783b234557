/*
 * agent-backend-test.c - stand-in VMMs with a stand-in vhost-user back-end
 * (standin-backend.c: a second process that maps guest RAM from the memfd
 * and hands the agent its userfaultfd), and the real pagefoldd: the VMs
 * merge, and the back-end reads and writes guest RAM meanwhile, with the
 * CPU and with system calls, never seeing a hole nor losing a write; a
 * back-end attached after pages merged folds back what it touches; one
 * killed, or stopped, costs its VM nothing; pagefoldd killed with -9
 * partway; a back-end that hands something else than its userfaultfd, or
 * wrong ranges, is refused and the VM steps back; the agent's system
 * calls failing on the way.
 *
 * Owns: its stand-ins and pagefoldds, one set per test.  It must never
 * leave a back-end stopped (a stopped one holds its VMM's device writers).
 */
#include <errno.h>
#include <glib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "agent-helpers.h"
#include "testproc.h"
#include "util.h"

/* Two VMs with back-ends, no writes: they merge exactly as without; then
 * one back-end reads every page, which folds back each merged page it
 * touches, and pagefoldd hears of each. */
static void
test_exact(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start_full(d, "b0", 1, 0, FALSE, "--backend"),
                  vmm_start_full(d, "b1", 2, 0, FALSE, "--backend") };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autoptr(JsonObject) after = NULL;
    gint64 remapped;

    g_assert_cmpstr(v[0]->mode, ==, "merge");
    g_assert_cmpint(total(s, "pages_shared"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO);
    remapped = pf_test_vmm_stat(v[0], "remapped");
    g_assert_cmpint(remapped, ==, IDENTICAL + ZERO);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "backend_fold_backs"), ==, 0);
    pf_test_vmm_verify(v[0]);

    g_free(pf_test_vmm_cmd(v[0], "backend verify"));
    g_assert_cmpint(pf_test_vmm_stat(v[0], "backend_fold_backs"), ==, remapped);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "remapped"), ==, 0);
    g_assert_cmpint(pf_test_vmm_number(v[0], "device", "bad"), ==, 0);
    g_assert_cmpint(pf_test_vmm_number(v[0], "device", "reads"), ==, PAGES);
    after = stats(d, "scan-now", "1");
    g_assert_cmpint(pf_test_vm_counter(d, "b0", "zero_pages"), ==, 0);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* Both VMs' guests and devices write while pages merge, are written and
 * fold back; pagefoldd is killed with -9 halfway and started again.  No
 * write is lost, no read sees a page other than the last written, in
 * guest RAM or through the back-end. */
static void
test_writers(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "target_pass_millisecs=50",
                                                     "--set", "sleep_millisecs=1", NULL);
    Vmm *v[2] = { vmm_start_full(d, "w0", 1, 2, FALSE, "--backend --device-writers=2"),
                  vmm_start_full(d, "w1", 2, 2, FALSE, "--backend --device-writers=2") };

    for (int half = 0; half < 2; half++) {
        /* Until pages merge and the devices have folded some back. */
        for (int k = 0; k < 600 && (pf_test_vmm_stat(v[0], "merged") < 100 * (half + 1) ||
                                    pf_test_vmm_stat(v[0], "backend_fold_backs") < 10 * (half + 1));
             k++) {
            g_usleep(50000);
        }
        g_assert_cmpint(pf_test_vmm_stat(v[0], "backend_fold_backs"), >=, 10 * (half + 1));
        if (half == 0) {
            pf_test_daemon_kill(d);
            for (int i = 0; i < 2; i++) {
                wait_disconnected(v[i]);
            }
            pf_test_daemon_restart(d, "--set", "target_pass_millisecs=50", "--set",
                                   "sleep_millisecs=1", NULL);
            wait_merging(d, "w0");
            wait_merging(d, "w1");
        }
    }
    for (int i = 0; i < 2; i++) {
        g_test_message("w%d: %" G_GINT64_FORMAT " device reads, %" G_GINT64_FORMAT " writes, "
                       "%" G_GINT64_FORMAT " fold-backs", i,
                       pf_test_vmm_number(v[i], "device", "reads"),
                       pf_test_vmm_number(v[i], "device", "writes"),
                       pf_test_vmm_stat(v[i], "backend_fold_backs"));
        g_assert_cmpint(pf_test_vmm_number(v[i], "device", "bad"), ==, 0);
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* A back-end attached after pages merged: its first touch of each merged
 * page folds it back; then the VM merges again around it. */
static void
test_late(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "l0", 1, 0, FALSE), vmm_start(d, "l1", 2, 0, FALSE) };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autoptr(JsonObject) again = NULL;
    g_autofree char *said = NULL;
    gint64 remapped = pf_test_vmm_stat(v[0], "remapped");

    g_assert_cmpint(remapped, ==, IDENTICAL + ZERO);
    said = pf_test_vmm_cmd(v[0], "backend start");
    g_assert_cmpstr(said, ==, "ok merge");
    g_free(pf_test_vmm_cmd(v[0], "backend verify"));
    g_assert_cmpint(pf_test_vmm_stat(v[0], "backend_fold_backs"), ==, remapped);
    g_assert_cmpint(pf_test_vmm_number(v[0], "device", "bad"), ==, 0);
    again = stats(d, "scan-now", "3");
    /* pagefoldd heard of each (pagefoldctl stats, Prometheus, virsh
     * metadata show it per VM). */
    g_assert_cmpint(total(again, "backend_fold_backs"), ==, remapped);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "remapped"), ==, remapped);
    g_free(pf_test_vmm_cmd(v[0], "backend verify"));
    g_assert_cmpint(pf_test_vmm_number(v[0], "device", "bad"), ==, 0);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/*
 * Each system call a window of merges or a back-end's fault takes fails a
 * few times, at a random point, while pages merge and the device writes:
 * windows are refused and undone, faults wait and are met once the calls
 * work again.  No write is lost, no read sees another page, and the
 * device's writers go on after each (no fault is left blocked).
 */
static void
test_syscalls(void)
{
    /* wp-off last: a back-end whose protection cannot be lifted is
     * broken for good, and its VM merges no more (its faults are still
     * met). */
    static const char *const calls[] = { "wp-on", "mmap-private", "mmap-shared", "pwrite",
                                         "fallocate", "wp-off" };
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "target_pass_millisecs=50",
                                                     "--set", "sleep_millisecs=1", NULL);
    Vmm *v[2] = { vmm_start_full(d, "f0", 1, 2, FALSE, "--backend --device-writers=2"),
                  vmm_start_full(d, "f1", 2, 2, FALSE, "--backend --device-writers=2") };

    for (int k = 0; k < 1200 && (pf_test_vmm_stat(v[0], "merged") < 100 ||
                                 pf_test_vmm_stat(v[0], "backend_fold_backs") < 10); k++) {
        g_usleep(50000);
    }
    g_assert_cmpint(pf_test_vmm_stat(v[0], "merged"), >=, 100);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "backend_fold_backs"), >=, 10);
    for (guint i = 0; i < G_N_ELEMENTS(calls); i++) {
        g_autofree char *fault = g_strdup_printf("fault %s %d 3 %d", calls[i],
                                                 g_test_rand_int_range(0, 20), EIO);
        gint64 writes, merged = pf_test_vmm_stat(v[0], "merged");

        g_free(pf_test_vmm_cmd(v[0], fault));
        /* Until it failed at least once. */
        for (int k = 0; k < 1200 && pf_test_vmm_number(v[0], "fault hits", "hits") == 0; k++) {
            g_usleep(50000);
        }
        g_assert_cmpint(pf_test_vmm_number(v[0], "fault hits", "hits"), >, 0);
        g_usleep(g_test_rand_int_range(0, 500000));
        g_free(pf_test_vmm_cmd(v[0], "fault none"));
        writes = pf_test_vmm_number(v[0], "device", "writes");
        for (int k = 0; k < 600 && pf_test_vmm_number(v[0], "device", "writes") < writes + 100;
             k++) {
            g_usleep(50000);
        }
        g_test_message("%s failing: merged %" G_GINT64_FORMAT " -> %" G_GINT64_FORMAT
                       ", folded back for the back-end %" G_GINT64_FORMAT, calls[i], merged,
                       pf_test_vmm_stat(v[0], "merged"),
                       pf_test_vmm_stat(v[0], "backend_fold_backs"));
        g_assert_cmpint(pf_test_vmm_number(v[0], "device", "writes"), >=, writes + 100);
        g_assert_cmpint(pf_test_vmm_number(v[0], "device", "bad"), ==, 0);
    }
    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(pf_test_vmm_number(v[i], "device", "bad"), ==, 0);
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/*
 * Nothing merges while a back-end is expected (QEMU is about to send it a
 * memory table) until it says where it maps guest RAM; nor after it
 * disconnected while it still maps guest RAM, until its process is gone.
 * pagefoldd says so, once.
 */
static void
test_expect_leave(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start_logged("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "e0", 1, 2, FALSE),
                  vmm_start_full(d, "e1", 2, 2, FALSE, "--backend") };
    g_autofree char *log = NULL;
    gint64 merged[2];

    /* Merged first: the writers then copy merged pages on write, whose
     * unmerges go through while merges wait, and say nothing; the pages
     * they write back to a content merge again, and are refused.  Each VM
     * needs writers of its own: without, the only merges its next passes
     * ask for are its pages whose partners were written, if any. */
    json_object_unref(stats(d, "scan-now", "2"));
    g_free(pf_test_vmm_cmd(v[0], "backend expect"));
    g_free(pf_test_vmm_cmd(v[1], "backend detach"));
    for (int i = 0; i < 2; i++) {
        merged[i] = pf_test_vmm_merged(v[i]);
    }
    json_object_unref(stats(d, "scan-now", "3"));
    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(pf_test_vmm_merged(v[i]), ==, merged[i]);
        g_assert_cmpint(pf_test_vmm_stat(v[i], "errors"), >, 0);
    }
    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(pf_test_vmm_stat(v[i], "unmerged"), >, 0);
    }
    /* pagefoldd says why, once each. */
    log = pf_test_daemon_log(d);
    for (int i = 0; i < 2; i++) {
        g_autofree char *said = g_strdup_printf("VM e%d: merges wait for a vhost-user back-end",
                                                i);
        g_autofree char *on = g_strdup_printf("VM e%d: merges go on", i);
        const char *at = strstr(log, said);

        g_assert_nonnull(at);
        g_assert_null(strstr(at + 1, said));
        g_assert_null(strstr(log, on));
    }
    g_free(pf_test_vmm_cmd(v[0], "backend start"));
    g_free(pf_test_vmm_cmd(v[1], "backend kill"));
    json_object_unref(stats(d, "scan-now", "3"));
    g_free(log);
    log = pf_test_daemon_log(d);
    for (int i = 0; i < 2; i++) {
        g_autofree char *said = g_strdup_printf("VM e%d: merges go on", i);

        g_assert_cmpint(pf_test_vmm_merged(v[i]), >, merged[i]);
        g_assert_nonnull(strstr(log, said));
    }
    g_free(pf_test_vmm_cmd(v[0], "backend verify"));
    g_assert_cmpint(pf_test_vmm_number(v[0], "device", "bad"), ==, 0);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* A back-end killed while its device writes, and one stopped: the VM
 * merges on; nothing is lost. */
static void
test_killed_stopped(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "target_pass_millisecs=50",
                                                     "--set", "sleep_millisecs=1", NULL);
    Vmm *v[2] = { vmm_start_full(d, "k0", 1, 1, FALSE, "--backend --device-writers=2"),
                  vmm_start_full(d, "k1", 2, 1, FALSE, "--backend --device-writers=2") };
    g_autofree char *said = NULL;
    gint64 merged;

    wait_merging(d, "k0");
    g_usleep(g_random_int_range(100000, 500000));
    g_free(pf_test_vmm_cmd(v[0], "backend kill"));
    said = pf_test_vmm_cmd(v[1], "backend stop");
    g_assert_cmpstr(said, ==, "ok");
    merged = pf_test_vmm_merged(v[1]);
    for (int k = 0; k < 600 && pf_test_vmm_merged(v[1]) < merged + 100; k++) {
        g_usleep(50000);
    }
    g_assert_cmpint(pf_test_vmm_merged(v[1]), >=, merged + 100);
    g_free(pf_test_vmm_cmd(v[1], "backend cont"));
    merged = pf_test_vmm_stat(v[0], "merged");
    for (int k = 0; k < 600 && pf_test_vmm_stat(v[0], "merged") < merged + 100; k++) {
        g_usleep(50000);
    }
    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(pf_test_vmm_number(v[i], "device", "bad"), ==, 0);
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* A back-end that hands a pipe, or says it maps guest RAM where it does
 * not: refused, with why; the VM steps back, its back-end works on plain
 * memory, nothing is lost. */
static void
test_refused(gconstpointer data)
{
    const char *lie = data;
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "r0", 1, 0, FALSE), vmm_start(d, "r1", 2, 0, FALSE) };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autofree char *cmd = g_strdup_printf("backend start %s", lie);
    g_autofree char *said = pf_test_vmm_cmd(v[0], cmd);
    JsonObject *vm;

    g_assert_cmpstr(said, ==, "ok advise");
    g_assert_cmpint(pf_test_vmm_stat(v[0], "remapped"), ==, 0);
    vm = pf_test_listed_vm(d, "r0");
    g_assert_true(strstr(json_object_get_string_member(vm, "mode_reason"),
                         g_str_equal(lie, "notuffd") ? "not a userfaultfd"
                                                     : "cannot take missing-page faults") != NULL);
    g_free(pf_test_vmm_cmd(v[0], "backend verify"));
    g_assert_cmpint(pf_test_vmm_number(v[0], "device", "bad"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "backend_fold_backs"), ==, 0);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    if (geteuid() != 0) {
        /* The back-end makes a userfaultfd that takes the kernel's faults. */
        g_test_skip("needs root");
        return g_test_run();
    }
    g_test_add_func("/agent/backend/exact", test_exact);
    g_test_add_func("/agent/backend/writers", test_writers);
    g_test_add_func("/agent/backend/late", test_late);
    g_test_add_func("/agent/backend/killed-stopped", test_killed_stopped);
    g_test_add_func("/agent/backend/expect-leave", test_expect_leave);
    g_test_add_func("/agent/backend/syscalls", test_syscalls);
    g_test_add_data_func("/agent/backend/refused/not-uffd", "notuffd", test_refused);
    g_test_add_data_func("/agent/backend/refused/range", "range", test_refused);
    return g_test_run();
}
