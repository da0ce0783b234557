/*
 * agent-test.c - pagefoldd merging for real: stand-in VMMs (guest RAM
 * mapped like QEMU's, the agent library linked in, writer threads that
 * check every byte they wrote) against the real pagefoldd.  Here: what a
 * merge frees and how it maps, the pool behind it (apart per VM, chunks let
 * go and emptied, ids reused), unmerging, stepping back, discards, the
 * mapping budget, and guests that write all the while.
 *
 * The agent suite's other stand-in programs, on the same helpers
 * (agent-helpers.h): agent-cow-test (copy-on-write, and the host memory
 * settings it needs changed), agent-restart-test (pagefoldd and VMMs
 * killed, restarted, detached), agent-trust-test (stand-ins that are not
 * root, and who vouches for them).
 *
 * Owns: its stand-ins and pagefoldds, one set per test.  It must never
 * change a host-wide setting: those tests are agent-cow-test's and
 * agent-trust-test's, which put them back.
 */
#include <fcntl.h>
#include <glib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "agent-helpers.h"
#include "testproc.h"
#include "util.h"

static guint64
pfn_of(int pid, guint64 addr)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/pagemap", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    guint64 e = 0;

    g_assert_cmpint(pread(fd, &e, 8, (off_t)(addr / PF_PAGE_SIZE * 8)), ==, 8);
    close(fd);
    return e & ((1ull << 55) - 1);
}

/* Three VMs, no writes: exactly what the layout predicts. */
static void
test_merge_exact(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[3];
    g_autoptr(JsonObject) s = NULL;
    gint64 kib_before[3];
    gint64 vmas_before[3], vmas;
    gint64 pss_before = 0, pss_after = 0;
    guint64 ram[3];
    int daemon_pid = pf_test_daemon_pid(d);

    for (int i = 0; i < 3; i++) {
        g_autofree char *name = g_strdup_printf("vm%d", i);

        v[i] = vmm_start(d, name, i + 1, 0, FALSE);
        g_assert_cmpstr(v[i]->mode, ==, "merge");
        kib_before[i] = pf_test_memfd_kib(v[i]->pid);
        vmas_before[i] = pf_test_count_vmas(v[i]->pid, 0, 0);
    }
    for (int i = 0; i < 3; i++) {
        g_autofree char *name = g_strdup_printf("vm%d", i);

        ram[i] = guest_addr(d, name);
        pss_before += pf_test_smaps_sum(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE, "Pss");
    }
    pss_before += pf_test_rollup_kib(daemon_pid, "Pss_Shmem");
    /* Two passes to merge, the third VM's pages moving the others' to a
     * slot of all three (pool.h) as the second ends; the mappings are
     * counted as the next begins, the last to see the old chunks go. */
    s = stats(d, "scan-now", "4");
    g_assert_cmpstr(json_object_get_string_member(s, "mode"), ==, "merge");
    g_assert_cmpint(total(s, "pages_shared"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "pages_sharing"), ==, 2 * IDENTICAL);
    g_assert_cmpint(total(s, "zero_pages"), ==, 3 * ZERO);
    g_assert_cmpint(total(s, "pages_unshared"), ==, 3 * UNIQUE);
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
    g_assert_cmpint(json_object_get_int_member(s, "pool_bytes"), ==, IDENTICAL * PF_PAGE_SIZE);
    for (int i = 0; i < 3; i++) {
        g_autofree char *name = g_strdup_printf("vm%d", i);
        JsonObject *vm = vm_of(s, name);

        /* The memory really went: only unique pages are left in the memfd. */
        g_assert_cmpint(pf_test_memfd_kib(v[i]->pid), ==, UNIQUE * 4);
        g_assert_cmpint(kib_before[i], ==, PAGES * 4);
        g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
        /* Runs of merged pages share mappings: far fewer than pages. */
        vmas = pf_test_count_vmas(v[i]->pid, 0, 0);
        g_assert_cmpint(json_object_get_int_member(vm, "vmas"), ==, vmas);
        g_assert_cmpint((vmas - vmas_before[i]) * 10, <, IDENTICAL + ZERO);
        pf_test_vmm_verify(v[i]);
    }
    /* Memory actually freed, counted as the kernel counts it: the Pss of
     * the VMMs' guest RAM plus pagefoldd's share of the guest RAM and pool
     * pages it maps (its heap is its metadata, counted in general_profit;
     * the test programs' heaps are beside the point) falls by
     * two copies of each identical page and every zero page, less the
     * zero slots the guests read (at most 512 pages): within 10%. */
    for (int i = 0; i < 3; i++) {
        pss_after += pf_test_smaps_sum(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE, "Pss");
    }
    pss_after += pf_test_rollup_kib(daemon_pid, "Pss_Shmem");
    g_test_message("Pss %" G_GINT64_FORMAT " KiB -> %" G_GINT64_FORMAT " KiB", pss_before,
                   pss_after);
    g_assert_cmpint(pss_before - pss_after, >=, (2 * IDENTICAL + 3 * ZERO - 512) * 4 * 9 / 10);
    g_assert_cmpint(pss_before - pss_after, <=, (2 * IDENTICAL + 3 * ZERO) * 4 * 11 / 10);

    /* One physical page behind guest page 7 of every VM. */
    {
        guint64 pfn0 = pfn_of(v[0]->pid, guest_addr(d, "vm0") + 7 * PF_PAGE_SIZE);

        g_assert_cmpuint(pfn0, !=, 0);
        for (int i = 1; i < 3; i++) {
            g_autofree char *name = g_strdup_printf("vm%d", i);

            g_assert_cmpuint(pfn_of(v[i]->pid, guest_addr(d, name) + 7 * PF_PAGE_SIZE), ==, pfn0);
        }
    }
    for (int i = 0; i < 3; i++) {
        pf_test_vmm_quit(v[i]);
    }
}

/* A merged page both VMs wrote, whose fold-back fails for a while: it
 * stays merged in pagefoldd's books (its slot is still mapped), and once
 * the kernel agrees both fold back and the slot is free: no reference
 * leaks, nothing is lost. */
static void
test_unmerge_fails(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "a", 1, 0, FALSE), vmm_start(d, "b", 2, 0, FALSE) };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");

    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
    for (int i = 0; i < 2; i++) {
        g_autofree char *f = pf_test_vmm_cmd(v[i], "fault mmap-shared 0 -1 12"); /* ENOMEM */
        g_autofree char *w = pf_test_vmm_cmd(v[i], "write 5");

        g_assert_cmpstr(f, ==, "ok");
        g_assert_cmpstr(w, ==, "ok");
    }
    for (int pass = 0; pass < 2; pass++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "scan-now", "1");
        g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
        g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    }
    g_assert_cmpint(pf_test_vmm_stat(v[0], "errors"), >=, 1);
    for (int i = 0; i < 2; i++) {
        g_autofree char *f = pf_test_vmm_cmd(v[i], "fault none");

        pf_test_vmm_verify(v[i]);
    }
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "2");
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL - 1);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    pf_test_vmm_quit(v[0]);
    pf_test_vmm_quit(v[1]);
}

/* A compromised VMM reads every pool chunk it holds a descriptor or a
 * mapping of: it must find no page that other VMs share without it.  a and
 * b are guests of one seed: they share their unique pages; c shares only
 * the identical block with them (which moves to a slot of all three when
 * c joins), and is sent nothing else. */
static void
test_pool_apart(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[3] = { vmm_start(d, "a", 1, 0, FALSE), vmm_start(d, "b", 1, 0, FALSE),
                  vmm_start(d, "c", 2, 0, FALSE) };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autofree char *probe_c = NULL, *probe_a = NULL;
    g_autofree char *want_a = g_strdup_printf("found %d", UNIQUE);

    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(total(s, "pages_shared"), ==, IDENTICAL + UNIQUE);
    g_assert_cmpint(total(s, "pages_sharing"), ==, 2 * IDENTICAL + UNIQUE);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL + UNIQUE);
    /* Moved, the identical block's old slots went, and their chunks. */
    g_assert_cmpint(json_object_get_int_member(s, "pool_bytes"), <=,
                    (IDENTICAL + UNIQUE + 2 * 512) * PF_PAGE_SIZE);
    g_assert_cmpint(pf_test_memfd_kib(v[2]->pid), ==, UNIQUE * 4);
    probe_c = pf_test_vmm_cmdf(v[2], "pool-probe 1 %d", UNIQUE);
    probe_a = pf_test_vmm_cmdf(v[0], "pool-probe 1 %d", UNIQUE);
    g_test_message("c: %s; a: %s", probe_c, probe_a);
    /* The probe sees what a holds: a and b's pages, once each. */
    g_assert_true(g_str_has_suffix(probe_a, want_a));
    /* c holds chunks (its identical pages are merged), none of theirs. */
    g_assert_true(g_str_has_suffix(probe_c, " found 0"));
    g_assert_false(g_str_has_prefix(probe_c, "probe files 0 "));
    /* a and b rewrite their unique pages: once the slots are free, what
     * they held is nowhere in the pool, not even for a. */
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_vmm_cmdf(v[i], "scribble %d %d 0", IDENTICAL, UNIQUE));
    }
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
    g_clear_pointer(&probe_a, g_free);
    probe_a = pf_test_vmm_cmdf(v[0], "pool-probe 1 %d", UNIQUE);
    g_assert_true(g_str_has_suffix(probe_a, " found 0"));
    for (int i = 0; i < 3; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* Waits until VM name has finished n more passes. */
static void
wait_vm_passes(PfTestDaemon *d, const char *name, int n)
{
    gint64 want = pf_test_vm_counter(d, name, "full_scans") + n;

    for (int i = 0; i < 3000 && pf_test_vm_counter(d, name, "full_scans") < want; i++) {
        g_usleep(10000);
    }
    g_assert_cmpint(pf_test_vm_counter(d, name, "full_scans"), >=, want);
}

/* How many pages of fill seed seed v can read in the pool ("pool-find"). */
static gsize
pool_find(Vmm *v, guint64 seed)
{
    g_autofree char *probe = pf_test_vmm_cmdf(v, "pool-find %" G_GUINT64_FORMAT, seed);
    gsize files, pages, found;

    g_assert_cmpint(sscanf(probe, "probe files %zu pages %zu found %zu", &files, &pages, &found),
                    ==, 3);
    return found;
}

/* Waits until v can read one page of fill seed seed in the pool (it is
 * merged; within 10 passes of VM "x"), then n more passes of x. */
static void
wait_pooled(PfTestDaemon *d, Vmm *v, guint64 seed, int n)
{
    for (int i = 0; i < 10 && pool_find(v, seed) != 1; i++) {
        wait_vm_passes(d, "x", 1);
    }
    g_assert_cmpuint(pool_find(v, seed), ==, 1);
    wait_vm_passes(d, "x", n);
}

/*
 * Ids reused, live (the model's /scan-model/ids-reused, with real
 * stand-ins and the background scan): x comes to hold content K1 that a
 * and b share in a chunk of theirs alone, and is to be sent that chunk
 * once the cursor is done with x; in that pass a and b zero K1, so its
 * node, slot and chunk are freed, and pair K2 (written when x wrote K1),
 * which may be given them anew.  x is first in the cursor's order and each write
 * comes as a pass begins, so x's page is looked at before theirs.  x must
 * never hold K2; a does.  (With the join checked by node id, liveness and
 * slot only, as before issue 20, x held K2 in the first round, 3 runs of
 * 3 here.)
 */
static void
test_ids_reused_live(void)
{
    /* Every page visited each pass (no smart scan skipping the unique
     * pages that never matched), at 5000 pages a second. */
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start(
        "--set", "pages_to_scan=100", "--set", "sleep_millisecs=20", "--set", "smart_scan=0",
        NULL);
    Vmm *x = vmm_start(d, "x", 3, 0, FALSE);
    Vmm *ab[2] = { vmm_start(d, "a", 1, 0, FALSE), vmm_start(d, "b", 2, 0, FALSE) };
    /* K1 early in each VM's RAM, K2 at its end: by the time the cursor
     * comes to K2, the agents have answered for K1, and its slot, chunk
     * and node are free to be given again. */
    const gsize page = IDENTICAL, last = IDENTICAL + UNIQUE - 1;

    for (guint64 round = 0; round < 2; round++) {
        guint64 k1 = 1000 + round, k2 = 2000 + round;

        for (int i = 0; i < 2; i++) {
            g_free(pf_test_vmm_cmdf(ab[i], "fill %zu %" G_GUINT64_FORMAT, page, k1));
        }
        wait_pooled(d, ab[0], k1, 0);
        /* A page is looked up in the trees once its checksum held for a
         * pass: x's K1 and a and b's K2 are first seen in the next pass,
         * and looked up in the one after, in which a and b zero K1. */
        wait_vm_passes(d, "b", 1);
        g_free(pf_test_vmm_cmdf(x, "fill %zu %" G_GUINT64_FORMAT, page, k1));
        for (int i = 0; i < 2; i++) {
            g_free(pf_test_vmm_cmdf(ab[i], "fill %zu %" G_GUINT64_FORMAT, last, k2));
        }
        wait_vm_passes(d, "b", 1);
        for (int i = 0; i < 2; i++) {
            g_free(pf_test_vmm_cmdf(ab[i], "fill %zu 0", page));
        }
        wait_pooled(d, ab[0], k2, 2);
        g_assert_cmpuint(pool_find(x, k2), ==, 0);
        /* Nothing of this round is left shared for the next. */
        for (int i = 0; i < 2; i++) {
            g_free(pf_test_vmm_cmdf(ab[i], "fill %zu 0", last));
        }
        g_free(pf_test_vmm_cmdf(x, "fill %zu 0", page));
        wait_vm_passes(d, "x", 3);
    }
    pf_test_vmm_verify(x);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(ab[i]);
        pf_test_vmm_quit(ab[i]);
    }
    pf_test_vmm_quit(x);
}

/* pagefoldd's pool memory, measured by the kernel (the blocks of every
 * pool memfd it and the VMMs still hold), follows what is shared: chunks
 * whose slots all went are let go by everyone, sparse ones are emptied
 * into fuller ones, and nothing stays once nothing is shared. */
static gint64
pool_kib_after(PfTestDaemon *d, Vmm **v, JsonObject **s, guint *chunks)
{
    int daemon_pid = pf_test_daemon_pid(d);
    gint64 kib;

    /* Copy-on-write is found, folded back, slots freed, sparse chunks
     * emptied (a pass each, at most). */
    for (int pass = 0; pass < 4; pass++) {
        g_clear_pointer(s, json_object_unref);
        *s = stats(d, "scan-now", "1");
    }
    g_assert_cmpint(total(*s, "pages_pending"), ==, 0);
    kib = pf_test_pool_kib(daemon_pid, chunks);
    g_assert_cmpint(kib * 1024, ==, json_object_get_int_member(*s, "pool_bytes"));
    for (int i = 0; i < 2; i++) {
        guint n;

        /* The VMMs hold no chunk pagefoldd let go. */
        g_assert_cmpint(pf_test_pool_kib(v[i]->pid, &n), <=, kib);
        g_assert_cmpuint(n, <=, *chunks);
        pf_test_vmm_verify(v[i]);
    }
    return kib;
}

static void
test_pool_memory(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "a", 1, 0, FALSE), vmm_start(d, "b", 1, 0, FALSE) };
    JsonObject *s = NULL;
    const gint64 shared = IDENTICAL + UNIQUE, kept = (shared + 7) / 8;
    gint64 kib;
    guint chunks;

    kib = pool_kib_after(d, v, &s, &chunks);
    g_test_message("all shared: %" G_GINT64_FORMAT " KiB in %u chunks", kib, chunks);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, shared);
    g_assert_cmpint(kib, ==, shared * 4);
    /* Seven pages in eight rewritten: what is left fits in two chunks
     * (one was being filled, the rest are moved into it and one more). */
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_vmm_cmdf(v[i], "scribble 0 %d 8", IDENTICAL + UNIQUE));
    }
    kib = pool_kib_after(d, v, &s, &chunks);
    g_test_message("one in eight shared: %" G_GINT64_FORMAT " KiB in %u chunks", kib, chunks);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, kept);
    g_assert_cmpint(total(s, "pages_sharing"), ==, kept);
    g_assert_cmpuint(chunks, <=, 2);
    g_assert_cmpint(kib, <=, 2 * 512 * 4);
    /* Nothing shared: nothing held. */
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_vmm_cmdf(v[i], "scribble 0 %d 0", IDENTICAL + UNIQUE));
    }
    kib = pool_kib_after(d, v, &s, &chunks);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, 0);
    g_assert_cmpint(kib, ==, 0);
    g_assert_cmpuint(chunks, ==, 0);
    g_clear_pointer(&s, json_object_unref);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_quit(v[i]);
    }
}

/* A VMM that keeps the pool chunks pagefoldd told it to drop would keep
 * their memory: it is detached, the others go on. */
static void
test_pool_kept(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "a", 1, 0, FALSE), vmm_start(d, "b", 1, 0, FALSE) };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autofree char *held = NULL;

    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL + UNIQUE);
    held = pf_test_vmm_cmd(v[1], "hold-pool");
    g_assert_true(g_str_has_prefix(held, "ok ") && !g_str_equal(held, "ok 0"));
    /* Every page rewritten, but one put back as it was: it merges again,
     * and b's answer to that request says it has read the DROPs. */
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_vmm_cmdf(v[i], "scribble 0 %d 0", IDENTICAL + UNIQUE));
        g_free(pf_test_vmm_cmd(v[i], "restore 1"));
    }
    for (int pass = 0; pass < 5 && vm_of(s, "b") != NULL; pass++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "scan-now", "1");
    }
    g_assert_null(vm_of(s, "b"));
    /* The scan-now it happened in did its passes, and says so. */
    g_assert_true(json_object_has_member(s, "detached"));
    g_assert_nonnull(strstr(json_array_get_string_element(
                                json_object_get_array_member(s, "detached"), 0),
                            "it keeps"));
    g_assert_nonnull(vm_of(s, "a"));
    g_assert_cmpstr(json_object_get_string_member(vm_of(s, "a"), "mode"), ==, "merge");
    wait_disconnected(v[1]);
    /* b's process still maps the slots it merged: they are kept until it
     * exits (how many depends on the passes since, as a's page may have
     * moved off a chunk b held).  Then only a's own slot is left. */
    pf_test_vmm_verify(v[1]);
    pf_test_vmm_quit(v[1]);
    for (int i = 0; i < 600 && json_object_get_int_member(s, "pool_slots") > 1; i++) {
        g_usleep(100000);
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "stats", NULL);
    }
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), <=, 1);
    pf_test_vmm_verify(v[0]);
    pf_test_vmm_quit(v[0]);
}

/* KSM's run=2: every page back in its memfd, the mappings coalesced
 * again, the pool empty, scanning stopped. */
static void
test_unmerge_all(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *v[2] = { vmm_start(d, "m0", 1, 1, FALSE), vmm_start(d, "m1", 2, 1, FALSE) };
    guint64 ram[2] = { guest_addr(d, "m0"), guest_addr(d, "m1") };
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autoptr(JsonObject) k = NULL;
    JsonNode *n;

    g_assert_cmpint(total(s, "pages_sharing"), >, 0);
    g_assert_cmpint(pf_test_count_vmas(v[0]->pid, ram[0], PAGES * PF_PAGE_SIZE), >, 1);
    n = pf_test_ctl_json(d, "set", "run", "2", NULL);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(n), "run"), ==, 0);
    json_node_unref(n);
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "stats", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), ==, 0);
    g_assert_cmpint(total(s, "pages_shared"), ==, 0);
    g_assert_cmpint(total(s, "zero_pages"), ==, 0);
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, 0);
    for (int i = 0; i < 2; i++) {
        /* Every page that holds something is back in the memfd; zero
         * pages may stay holes (the merge punched them, and a hole reads
         * zero), and writers zero a page now and then. */
        g_assert_cmpint(pf_test_memfd_kib(v[i]->pid), >=,
                        pf_test_vmm_number(v[i], "nonzero", "nonzero") * 4);
        /* Merged, guest RAM was in many mappings; now in one again. */
        g_assert_cmpint(pf_test_count_vmas(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE), ==, 1);
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* A VM whose VMM needs plain RAM again (a vhost-user device, a migration
 * with postcopy, background snapshot or x-ignore-shared) steps back while
 * merged and written: every page back in its memfd, no write lost, the
 * pool references let go, advise mode with the reason; the other VM stays
 * merged. */
static void
test_step_back(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *a = vmm_start(d, "a", 1, 2, FALSE), *b = vmm_start(d, "b", 2, 0, FALSE);
    guint64 ram = guest_addr(d, "a");
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autofree char *r = NULL;
    JsonObject *vm;

    gint64 b_remapped = pf_test_vmm_stat(b, "remapped");

    g_assert_cmpint(pf_test_vmm_stat(a, "remapped"), >, IDENTICAL / 2);
    g_assert_cmpint(pf_test_count_vmas(a->pid, ram, PAGES * PF_PAGE_SIZE), >, 1);
    r = pf_test_vmm_cmd(a, "step-back a vhost-user device (test)");
    g_assert_cmpstr(r, ==, "ok advise");
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "2");
    vm = vm_of(s, "a");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode_reason"), ==,
                    "a vhost-user device (test)");
    /* No page of a is remapped: guest RAM is one mapping of the memfd
     * again, and what it reads there is what was written. */
    g_assert_cmpint(pf_test_vmm_stat(a, "remapped"), ==, 0);
    g_assert_cmpint(pf_test_count_vmas(a->pid, ram, PAGES * PF_PAGE_SIZE), ==, 1);
    pf_test_vmm_verify(a);
    /* b keeps its merges; the slots are b's alone now. */
    g_assert_cmpint(pf_test_vmm_stat(b, "remapped"), >=, b_remapped);
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "b"), "zero_pages"), ==, ZERO);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==,
                    pf_test_vmm_stat(b, "remapped") - ZERO);
    pf_test_vmm_verify(b);
    /* Once is enough; a link that stepped back stays up. */
    g_clear_pointer(&r, g_free);
    r = pf_test_vmm_cmd(a, "step-back again");
    g_assert_cmpstr(r, ==, "ok advise");
    g_assert_cmpint(pf_test_vmm_stat(a, "connected"), ==, 1);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
}

/* A balloon takes merged pages: the agent maps the memfd back first, so
 * the discard frees them and pagefoldd lets their slots go; written
 * again, they merge again. */
static void
test_discard(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    Vmm *a = vmm_start(d, "a", 1, 0, FALSE), *b = vmm_start(d, "b", 2, 0, FALSE);
    guint64 ram = guest_addr(d, "a");
    gint64 vmas = pf_test_count_vmas(a->pid, ram, PAGES * PF_PAGE_SIZE);
    g_autoptr(JsonObject) s = stats(d, "scan-now", "3");
    g_autofree char *r1 = NULL, *r2 = NULL, *r3 = NULL;
    /* Blocks in the order identical, unique, zero: 16 identical and 16
     * unique pages; 8 unique and 16 zero. */
    g_autofree char *across1 = g_strdup_printf("discard %d 32", IDENTICAL - 16);
    g_autofree char *across2 = g_strdup_printf("discard %d 24", IDENTICAL + UNIQUE - 8);
    g_autofree char *r4 = NULL;
    gint64 merged_vmas = pf_test_count_vmas(a->pid, ram, PAGES * PF_PAGE_SIZE);

    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    /* 64 identical pages, and ranges across blocks. */
    r1 = pf_test_vmm_cmd(a, "discard 0 64");
    g_assert_cmpstr(r1, ==, "ok");
    r2 = pf_test_vmm_cmd(a, across1);
    g_assert_cmpstr(r2, ==, "ok");
    r4 = pf_test_vmm_cmd(a, across2);
    g_assert_cmpstr(r4, ==, "ok");
    g_assert_cmpint(pf_test_vmm_stat(a, "discarded"), ==, 64 + 16 + 16);
    g_assert_cmpint(pf_test_vmm_stat(a, "remapped"), ==, IDENTICAL + ZERO - 96);
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "2");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 80);
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "zero_pages"), ==, ZERO - 16);
    /* The memfd holds nothing new: the discard punched what it took. */
    g_assert_cmpint(pf_test_memfd_kib(a->pid), ==, (UNIQUE - 24) * 4);
    /* Each discard splits at most one mapping in two. */
    g_assert_cmpint(pf_test_count_vmas(a->pid, ram, PAGES * PF_PAGE_SIZE), <=, merged_vmas + 3);
    g_assert_cmpint(vmas, ==, 1);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    /* The guest takes page 0 back and writes what it held: merged again. */
    r3 = pf_test_vmm_cmd(a, "restore 0");
    g_assert_cmpstr(r3, ==, "ok");
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 79);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
}

/* Merges that cannot share mappings stop at the VM's mapping budget. */
static void
test_vma_budget(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--set",
                                                     "max_vma_percent=1", NULL);
    Vmm *v[2] = { vmm_start_full(d, "i0", 1, 0, FALSE, "--interleave"),
                  vmm_start_full(d, "i1", 2, 0, FALSE, "--interleave") };
    guint64 ram[2] = { guest_addr(d, "i0"), guest_addr(d, "i1") };
    gint64 others[2];
    g_autoptr(JsonObject) s = NULL;
    g_autofree char *text = NULL;
    gint64 budget;

    /* Mappings that are not guest RAM: the process's own business. */
    for (int i = 0; i < 2; i++) {
        others[i] = pf_test_count_vmas(v[i]->pid, 0, 0) -
                    pf_test_count_vmas(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE);
    }
    s = stats(d, "scan-now", "4");

    g_assert_true(g_file_get_contents("/proc/sys/vm/max_map_count", &text, NULL, NULL));
    budget = g_ascii_strtoll(text, NULL, 10) / 100;
    g_assert_cmpint(total(s, "pages_sharing"), >, 0);
    g_assert_cmpint(total(s, "pages_sharing"), <, IDENTICAL / 2);
    for (int i = 0; i < 2; i++) {
        /* A merge may only start while under budget: one over at most. */
        g_assert_cmpint(others[i] + pf_test_count_vmas(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE), <=,
                        budget + 3);
        pf_test_vmm_quit(v[i]);
    }
}

/* Guests writing all the while, pagefoldd scanning in the background:
 * not one byte lost. */
static void
test_concurrent_writers(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "target_pass_millisecs=100",
                                                     "--set", "sleep_millisecs=5", NULL);
    Vmm *v[4];
    g_autoptr(JsonObject) s = NULL;

    for (int i = 0; i < 4; i++) {
        g_autofree char *name = g_strdup_printf("w%d", i);

        v[i] = vmm_start(d, name, i + 1, 2, FALSE);
    }
    for (int round = 0; round < 6; round++) {
        g_usleep(300000);
        for (int i = 0; i < 4; i++) {
            pf_test_vmm_verify(v[i]);
        }
    }
    s = stats(d, "stats", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >, 0);
    g_assert_cmpint(total(s, "cow"), >, 0);
    for (int i = 0; i < 4; i++) {
        pf_test_vmm_quit(v[i]);
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/agent/merge-exact", test_merge_exact);
    g_test_add_func("/agent/unmerge-all", test_unmerge_all);
    g_test_add_func("/agent/pool-apart", test_pool_apart);
    g_test_add_func("/agent/ids-reused", test_ids_reused_live);
    g_test_add_func("/agent/pool-memory", test_pool_memory);
    g_test_add_func("/agent/pool-kept", test_pool_kept);
    g_test_add_func("/agent/unmerge-fails", test_unmerge_fails);
    g_test_add_func("/agent/vma-budget", test_vma_budget);
    g_test_add_func("/agent/step-back", test_step_back);
    g_test_add_func("/agent/discard", test_discard);
    g_test_add_func("/agent/concurrent-writers", test_concurrent_writers);
    return g_test_run();
}
