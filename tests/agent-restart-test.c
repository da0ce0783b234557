/*
 * agent-restart-test.c - stand-in VMMs and the real pagefoldd when one of
 * them goes: pagefoldd killed with -9 while merging, moving or unmerging,
 * and started again, taking back what its predecessor merged and the
 * merge domains it kept; a VMM killed mid-batch; a VM that root detaches.
 * No write is lost, and the pool ends holding exactly what is mapped.
 *
 * Environment: PAGEFOLD_TEST_RESTARTS, how many times /agent/restart kills
 * pagefoldd (20; the kernel suite's guest, under TCG, asks for fewer).
 *
 * Owns: its stand-ins and pagefoldds, one set per test.  It must never
 * kill a process it did not start, nor start the next pagefoldd before
 * the one it killed is reaped (both would hold the same sockets).
 */
#include <glib.h>
#include <signal.h>

#include "agent-helpers.h"
#include "testproc.h"
#include "util.h"

/* pagefoldd killed at random points while merging: every VM's data is
 * intact and the VMs keep running (their agents just disconnect). */
static void
test_kill_daemon(void)
{
    for (int round = 0; round < 3; round++) {
        g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "target_pass_millisecs=50",
                                                         "--set", "sleep_millisecs=1", NULL);
        Vmm *v[2] = { vmm_start(d, "k0", 1, 2, FALSE), vmm_start(d, "k1", 2, 2, FALSE) };

        g_usleep(g_random_int_range(50000, 600000));
        pf_test_daemon_kill(d);
        for (int i = 0; i < 2; i++) {
            pf_test_vmm_verify(v[i]);
            wait_disconnected(v[i]);
            pf_test_vmm_verify(v[i]);
            pf_test_vmm_quit(v[i]);
        }
    }
}

/* Once every request is answered, the pool holds exactly the slots that
 * guest pages map, the counters add up, and nothing is in flight. */
static void
assert_settled(PfTestDaemon *d)
{
    g_autoptr(JsonObject) s = stats(d, "scan-now", "1");

    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, total(s, "pages_shared"));
}

/* How many times /agent/restart kills pagefoldd: 20, or fewer where a
 * slow machine says so (the kernel suite's guest, under TCG). */
static int
restarts(void)
{
    const char *n = g_getenv("PAGEFOLD_TEST_RESTARTS");
    guint64 v = 20;

    if (n != NULL) {
        g_assert_true(pf_parse_u64(n, 1, 1000, &v, NULL));
    }
    return (int)v;
}

/*
 * pagefoldd killed with -9 and started again, restarts() times, at random
 * points of merging, copy-on-write (the writers), moves (three VMs, whose
 * pages join nodes of chunks they do not hold) and unmerge (every fourth
 * time, while 'set run 2' runs).  Each time every VM comes back merging,
 * with the pages it had merged taken back rather than merged again, the
 * pool exactly what is mapped, and no write lost; at the end an unmerge
 * gives every page back.
 */
static void
test_restart(void)
{
    const char *args[] = { "--set", "target_pass_millisecs=50", "--set", "sleep_millisecs=1",
                           NULL };
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start(args[0], args[1], args[2], args[3], NULL);
    const char *names[3] = { "r0", "r1", "r2" };
    Vmm *v[3] = { vmm_start(d, names[0], 1, 2, FALSE), vmm_start(d, names[1], 2, 2, FALSE),
                  vmm_start(d, names[2], 3, 0, FALSE) };
    guint64 before_total = 0, taken_total = 0;
    gint64 wait_total = 0;
    g_autoptr(JsonObject) s = NULL;
    int rounds = restarts();

    for (int round = 0; round < rounds; round++) {
        g_autoptr(GSubprocess) unmerge = NULL;
        guint64 before = 0, taken = 0;
        gint64 start;

        g_usleep(g_random_int_range(50000, 800000));
        if (round % 4 == 3) {
            const char *argv[] = { pf_test_bin("PAGEFOLDCTL"), "--socket", d->sock, "set",
                                   "run", "2", NULL };

            unmerge = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_SILENCE |
                                         G_SUBPROCESS_FLAGS_STDERR_SILENCE,
                                     argv, NULL);
            g_usleep(g_random_int_range(1000, 100000));
        }
        pf_test_daemon_kill(d);
        for (int i = 0; i < 3; i++) {
            wait_disconnected(v[i]);
            before += pf_test_vmm_stat(v[i], "remapped");
        }
        start = g_get_monotonic_time();
        /* Not scanning until every VM is back: what it counts then is
         * what it took back, merged under its predecessor. */
        pf_test_daemon_restart(d, args[0], args[1], args[2], args[3], "--set", "run=0", NULL);
        for (int i = 0; i < 3; i++) {
            wait_merging(d, names[i]);
        }
        wait_total += g_get_monotonic_time() - start;
        /* Taken back a slice at a time, from the main loop. */
        for (int i = 0; i < 500; i++) {
            g_clear_pointer(&s, json_object_unref);
            s = stats(d, "stats", NULL);
            taken = total(s, "pages_shared") + total(s, "pages_sharing") +
                    total(s, "zero_pages");
            if (taken == before) {
                break;
            }
            g_usleep(10000);
        }
        g_test_message("restart %d: %" G_GUINT64_FORMAT " pages mapped from the pool, %"
                       G_GUINT64_FORMAT " taken back", round, before, taken);
        g_assert_cmpuint(taken, ==, before);
        g_assert_cmpint(total(s, "pages_pending"), ==, 0);
        json_node_unref(pf_test_ctl_json(d, "set", "run", "1", NULL));
        before_total += before;
        taken_total += taken;
        for (int i = 0; i < 3; i++) {
            pf_test_vmm_verify(v[i]);
        }
        assert_settled(d);
    }
    g_test_message("%d restarts: %" G_GUINT64_FORMAT " pages merged before them, %"
                   G_GUINT64_FORMAT " taken back; %.2f s to merge again on average",
                   rounds, before_total, taken_total,
                   (double)wait_total / rounds / G_USEC_PER_SEC);
    g_assert_cmpuint(taken_total, >, 0);
    /* Merging goes on after the last one. */
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "2");
    g_assert_cmpint(total(s, "pages_sharing"), >, 0);
    json_node_unref(pf_test_ctl_json(d, "set", "run", "2", NULL));
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "stats", NULL);
    g_assert_cmpint(total(s, "pages_shared") + total(s, "pages_sharing") +
                        total(s, "zero_pages") + total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, 0);
    for (int i = 0; i < 3; i++) {
        g_assert_cmpint(pf_test_vmm_stat(v[i], "remapped"), ==, 0);
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* Passes until pages_sharing stops changing (at most 40); the stats. */
static JsonObject *
scan_until_settled(PfTestDaemon *d)
{
    JsonObject *s = stats(d, "scan-now", "2");

    for (int i = 0; i < 40; i++) {
        JsonObject *next = stats(d, "scan-now", "2");
        gboolean same = total(next, "pages_sharing") == total(s, "pages_sharing") &&
                        total(next, "pages_shared") == total(s, "pages_shared");

        json_object_unref(s);
        s = next;
        if (same) {
            break;
        }
    }
    return s;
}

/*
 * Merge domains root set by hand outlive pagefoldd: four VMs of the same
 * content, two in t1 and two in t2, pagefoldd killed with -9 and started
 * again.  Each comes back in its domain (pagefoldd kept it, written before
 * merge-domain answered), and when t2's pages are unmerged and merge
 * again, they merge with each other, not with t1's: the sharing is what
 * it was, none across the two.  Where what was kept cannot be read, the
 * VMs come back each in a domain of its own, never in default.
 */
static void
test_domains_restart(void)
{
    const char *names[4] = { "d0", "d1", "d2", "d3" };
    const char *domains[4] = { "t1", "t1", "t2", "t2" };
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(JsonObject) before = NULL;
    g_autoptr(JsonObject) after = NULL;
    Vmm *v[4], *late;

    for (int i = 0; i < 4; i++) {
        v[i] = vmm_start(d, names[i], i + 1, 0, FALSE);
        json_node_unref(pf_test_ctl_json(d, "merge-domain", names[i], domains[i], NULL));
    }
    before = scan_until_settled(d);
    g_assert_cmpint(total(before, "pages_sharing"), >=, IDENTICAL * 2);
    /* One more, put in t3 right before the kill: kept before the answer,
     * not a second later. */
    late = vmm_start(d, "d4", 5, 0, FALSE);
    json_node_unref(pf_test_ctl_json(d, "merge-domain", "d4", "t3", NULL));
    pf_test_daemon_kill(d);
    for (int i = 0; i < 4; i++) {
        wait_disconnected(v[i]);
    }
    wait_disconnected(late);
    pf_test_daemon_restart(d, "--set", "run=0", NULL);
    for (int i = 0; i < 4; i++) {
        assert_back_in(d, names[i], domains[i]);
    }
    assert_back_in(d, "d4", "t3");
    /* t2's pages merge again: with each other only. */
    json_node_unref(pf_test_ctl_json(d, "unmerge", names[2], NULL));
    json_node_unref(pf_test_ctl_json(d, "unmerge", names[3], NULL));
    after = scan_until_settled(d);
    g_test_message("pages_shared %" G_GINT64_FORMAT " -> %" G_GINT64_FORMAT
                   ", pages_sharing %" G_GINT64_FORMAT " -> %" G_GINT64_FORMAT,
                   total(before, "pages_shared"), total(after, "pages_shared"),
                   total(before, "pages_sharing"), total(after, "pages_sharing"));
    g_assert_cmpint(total(after, "pages_sharing"), ==, total(before, "pages_sharing"));
    g_assert_cmpint(total(after, "pages_shared"), ==, total(before, "pages_shared"));
    /* What was kept cannot be read: VMs that merged come back apart,
     * never in default. */
    pf_test_daemon_kill(d);
    for (int i = 0; i < 4; i++) {
        wait_disconnected(v[i]);
    }
    wait_disconnected(late);
    {
        g_autofree char *kept = g_strconcat(d->sock, ".attached", NULL);

        g_assert_true(g_file_set_contents_full(kept, "{\"boot_id\": ", -1,
                                               G_FILE_SET_CONTENTS_CONSISTENT, 0600, NULL));
    }
    pf_test_daemon_restart(d, "--set", "run=0", NULL);
    for (int i = 0; i < 4; i++) {
        assert_back_in(d, names[i], "unlabelled");
    }
    for (int i = 0; i < 4; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
    pf_test_vmm_verify(late);
    pf_test_vmm_quit(late);
}

/* A VM that root detaches stays detached: its agent hears why, and
 * connects again only when a pagefoldd dies, not when one lets it go. */
static void
test_detach_stays(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v = vmm_start(d, "gone", 1, 1, FALSE);
    g_autoptr(JsonObject) vm = NULL;

    json_node_unref(pf_test_ctl_json(d, "detach", "gone", NULL));
    wait_disconnected(v);
    /* Far longer than its first try to connect again would take. */
    g_usleep(500000);
    vm = pf_test_listed_vm(d, "gone");
    g_assert_null(vm);
    g_assert_cmpint(pf_test_vmm_stat(v, "connected"), ==, 0);
    pf_test_vmm_verify(v);
    pf_test_vmm_quit(v);
}

/* A VMM killed mid-batch: pagefoldd drops it and frees its slots. */
static void
test_kill_vmm(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "target_pass_millisecs=50",
                                                     "--set", "sleep_millisecs=1", NULL);
    Vmm *a = vmm_start(d, "x", 1, 1, FALSE), *b = vmm_start(d, "y", 2, 1, FALSE);
    g_autoptr(JsonObject) s = NULL;

    g_usleep(g_random_int_range(100000, 500000));
    g_subprocess_send_signal(b->proc, SIGKILL);
    g_subprocess_wait(b->proc, NULL, NULL);
    for (int i = 0; i < 100; i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "stats", NULL);
        if (json_array_get_length(json_object_get_array_member(s, "vms")) == 1) {
            break;
        }
        g_usleep(50000);
    }
    g_assert_cmpuint(json_array_get_length(json_object_get_array_member(s, "vms")), ==, 1);
    /* Once a's requests are answered, every pool slot in use is a page a
     * still maps: none is held for b any more. */
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, total(s, "pages_shared"));
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    pf_test_vmm_verify(a);
    pf_test_vmm_quit(a);
    pf_test_vmm_free(b);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/agent/kill-daemon", test_kill_daemon);
    g_test_add_func("/agent/kill-vmm", test_kill_vmm);
    g_test_add_func("/agent/restart", test_restart);
    g_test_add_func("/agent/detach-stays", test_detach_stays);
    g_test_add_func("/agent/domains-restart", test_domains_restart);
    return g_test_run();
}
