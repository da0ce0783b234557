/*
 * agent-test.c - pagefoldd merging for real: stand-in VMMs (guest RAM
 * mapped like QEMU's, the agent library linked in, writer threads that
 * check every byte they wrote) against the real pagefoldd.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guestmem.h"
#include "testproc.h"
#include "util.h"

#define MIB 16
#define PAGES (MIB * 256)
#define IDENTICAL (PAGES / 2)
#define ZERO (PAGES * 20 / 100)
#define UNIQUE (PAGES - IDENTICAL - ZERO)

typedef PfTestVmm Vmm;

static Vmm *vmm_start_full(PfTestDaemon *d, const char *name, int seed, int writers,
                           gboolean as_nobody, const char *extra);

static Vmm *
vmm_start(PfTestDaemon *d, const char *name, int seed, int writers, gboolean as_nobody)
{
    return vmm_start_full(d, name, seed, writers, as_nobody, NULL);
}

/* extra: one more standin-vmm option, e.g. "--interleave", or NULL. */
static Vmm *
vmm_start_full(PfTestDaemon *d, const char *name, int seed, int writers, gboolean as_nobody,
               const char *extra)
{
    g_autofree char *guest = g_strdup_printf("guest=%s", name);
    g_autofree char *seedarg = g_strdup_printf("%d", seed);
    g_autofree char *wr = g_strdup_printf("%d", writers);
    g_autofree char *mib = g_strdup_printf("%d", MIB);
    const char *argv[] = {
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket", d->agent_sock,
        "--mib", mib, "--seed", seedarg, "--writers", wr, "--writes-per-sec", "2000",
        extra, NULL
    };
    Vmm *v = pf_test_vmm_spawn(as_nobody ? argv : argv + 4);

    g_assert_nonnull(v);
    pf_test_daemon_wait_vmm(d, v);
    return v;
}

/* The agent sees its connection closed once it is done with the batch it
 * was serving (a full one takes a while under load), and the test may ask
 * before it has read the close. */
static void
wait_disconnected(Vmm *v)
{
    for (int k = 0; k < 200 && pf_test_vmm_stat(v, "connected") != 0; k++) {
        g_usleep(50000);
    }
    g_assert_cmpint(pf_test_vmm_stat(v, "connected"), ==, 0);
}

static JsonObject *
stats(PfTestDaemon *d, const char *cmd, const char *arg)
{
    JsonNode *n = pf_test_ctl_json(d, cmd, arg, NULL);
    JsonObject *o = json_object_ref(json_node_get_object(n));

    json_node_unref(n);
    return o;
}

static gint64
total(JsonObject *s, const char *name)
{
    return json_object_get_int_member(json_object_get_object_member(s, "total"), name);
}

static JsonObject *
vm_of(JsonObject *s, const char *name)
{
    return pf_test_find_vm(json_object_get_array_member(s, "vms"), name);
}
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

static guint64
guest_addr(PfTestDaemon *d, const char *vm)
{
    JsonNode *n = pf_test_ctl_json(d, "list", NULL);
    JsonArray *a = json_node_get_array(n);
    guint64 addr = 0;

    for (guint i = 0; i < json_array_get_length(a); i++) {
        JsonObject *o = json_array_get_object_element(a, i);

        if (g_str_equal(json_object_get_string_member(o, "name"), vm)) {
            JsonArray *regions = json_object_get_array_member(o, "regions");

            addr = (guint64)json_object_get_int_member(json_array_get_object_element(regions, 0),
                                                       "host_addr");
        }
    }
    json_node_unref(n);
    return addr;
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

/* pagefoldd seeing copy-on-write the way named: "PAGEMAP_SCAN", or
 * "pagemap" (entries read as on kernels before 6.7). */
static PfTestDaemon *
daemon_seeing(const char *path)
{
    PfTestDaemon *d;

    if (g_str_equal(path, "pagemap")) {
        g_setenv("PAGEFOLD_NO_PAGEMAP_SCAN", "1", TRUE);
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g_unsetenv("PAGEFOLD_NO_PAGEMAP_SCAN");
    return d;
}

/* Does pagefoldd (stats s) see copy-on-write the way path names?  If not,
 * the test is skipped: PAGEMAP_SCAN came in Linux 6.7 (Debian 12's
 * 6.1 has not got it). */
static gboolean
seeing(JsonObject *s, const char *path)
{
    if (g_str_equal(json_object_get_string_member(s, "cow_detection"), path)) {
        return TRUE;
    }
    g_assert_cmpstr(path, ==, "PAGEMAP_SCAN");
    g_test_skip("this kernel has no PAGEMAP_SCAN");
    return FALSE;
}

/* A merged page written: copied on write, counted out, content intact;
 * written back to what it was, it merges again. */
static void
test_cow_and_remerge(gconstpointer data)
{
    const char *path = data;
    g_autoptr(PfTestDaemon) d = NULL;
    Vmm *a, *b;
    g_autoptr(JsonObject) s = NULL;
    g_autofree char *r1 = NULL, *r2 = NULL;

    /* Both ways of seeing copy-on-write: the kernel's PAGEMAP_SCAN, and
     * reading pagemap entries as on kernels before 6.7. */
    d = daemon_seeing(path);
    a = vmm_start(d, "a", 1, 0, FALSE);
    b = vmm_start(d, "b", 2, 0, FALSE);
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        return;
    }

    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    r1 = pf_test_vmm_cmd(a, "write 5");
    g_assert_cmpstr(r1, ==, "ok");
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "cow"), ==, 1);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b); /* b's page 5 still maps the pool: unchanged */

    r2 = pf_test_vmm_cmd(a, "restore 5");
    g_assert_cmpstr(r2, ==, "ok");
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
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
        g_assert_cmpint(pf_test_memfd_kib(v[i]->pid), >=, pf_test_vmm_number(v[i], "nonzero", "nonzero") * 4);
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

/* Huge pages mapped in a VM's guest RAM, in KiB. */
static gint64
huge_kib(int pid, guint64 ram)
{
    return pf_test_smaps_sum(pid, ram, PAGES * PF_PAGE_SIZE, "ShmemPmdMapped");
}

/* RAM in transparent huge pages: merging splits them, unmerging an
 * extent back collapses it into a huge page again. */
static void
test_huge_pages(void)
{
    const char *knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    g_autofree char *old = NULL;
    g_autoptr(PfTestDaemon) d = NULL;
    Vmm *v[2];
    guint64 ram[2];
    gint64 before[2];
    JsonNode *n;
    g_autoptr(JsonObject) s = NULL;

    if (!g_file_get_contents(knob, &old, NULL, NULL)) {
        g_test_skip("no shmem transparent huge pages in this kernel");
        return;
    }
    /* "always within_size advise [never] deny force": keep the choice. */
    g_strdelimit(old, "[]", '\n');
    {
        g_auto(GStrv) parts = g_strsplit(old, "\n", -1);

        g_free(old);
        old = g_strdup(g_strv_length(parts) > 1 ? g_strstrip(parts[1]) : "never");
    }
    /* Huge pages for the guests' RAM, then the knob as it was at once
     * (collapsing does not need it). */
    pf_test_write_sysfs(knob, "advise");
    d = pf_test_daemon_start("--set", "run=0", NULL);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("h%d", i);

        v[i] = vmm_start_full(d, name, i + 1, 0, FALSE, "--huge");
        ram[i] = guest_addr(d, name);
        before[i] = huge_kib(v[i]->pid, ram[i]);
    }
    pf_test_write_sysfs(knob, old);
    if (before[0] == 0) {
        for (int i = 0; i < 2; i++) {
            pf_test_vmm_free(v[i]);
        }
        g_test_skip("guest RAM got no huge pages");
        return;
    }
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    /* Merged: the identical and zero extents are split into small pages. */
    g_assert_cmpint(huge_kib(v[0]->pid, ram[0]), <, before[0]);
    n = pf_test_ctl_json(d, "set", "run", "2", NULL);
    json_node_unref(n);
    for (int i = 0; i < 2; i++) {
        /* Every extent unmerged is a huge page again, but one of zero
         * pages only: the merge punched those, and a hole reads zero for
         * free. */
        gint64 zero_extents = PAGES / 512 - (IDENTICAL + UNIQUE + 511) / 512;

        g_assert_cmpint(huge_kib(v[i]->pid, ram[i]), ==, before[i] - zero_extents * 2048);
        g_assert_cmpint(pf_test_count_vmas(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE), ==, 1);
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
    }
}

/* ---- copy-on-write the kernel hides: swapped out, merged by host KSM,
 * in memfd data that a failed huge page split left ---- */

/* Host settings a test changes are put back by a child process once the
 * test process is gone, however it goes (an assertion aborts it): the
 * child waits for the end of a pipe only the test holds.  What it does is
 * prepared before the fork, and is system calls only. */
typedef void (*UndoFunc)(gconstpointer data);

typedef struct {
    pid_t pid;
    int fd;
} Undo;

static Undo
undo_at_exit(UndoFunc undo, gconstpointer data)
{
    int p[2];
    pid_t pid;

    g_assert_cmpint(pipe2(p, O_CLOEXEC), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        char c;
        ssize_t n;

        /* A timeout signals the test's whole process group. */
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
        signal(SIGHUP, SIG_IGN);
        for (int fd = 3; fd < 1024; fd++) {
            if (fd != p[0]) {
                close(fd);
            }
        }
        do {
            n = read(p[0], &c, 1);
        } while (n > 0 || (n < 0 && errno == EINTR));
        undo(data);
        _exit(0);
    }
    close(p[0]);
    return (Undo){ pid, p[1] };
}

static void
undo_now(Undo *u)
{
    if (u->fd >= 0) {
        close(u->fd);
        waitpid(u->pid, NULL, 0);
        u->fd = -1;
    }
}

#define MAX_KNOBS 6

/* sysfs knobs to write back, in this order. */
typedef struct {
    guint n;
    char path[MAX_KNOBS][128];
    char value[MAX_KNOBS][64];
} Knobs;

static void
knobs_add(Knobs *k, const char *path, const char *value)
{
    g_assert_cmpuint(k->n, <, MAX_KNOBS);
    g_strlcpy(k->path[k->n], path, sizeof(k->path[0]));
    g_strlcpy(k->value[k->n], value, sizeof(k->value[0]));
    k->n++;
}

/* Adds the knob's value as it is now; FALSE if it cannot be read. */
static gboolean
knobs_save(Knobs *k, const char *path)
{
    g_autofree char *v = NULL;
    char *open_b, *close_b;

    if (!g_file_get_contents(path, &v, NULL, NULL)) {
        return FALSE;
    }
    /* "always within_size advise [never] deny force": the one chosen. */
    if ((open_b = strchr(v, '[')) != NULL && (close_b = strchr(open_b, ']')) != NULL) {
        *close_b = '\0';
        memmove(v, open_b + 1, strlen(open_b + 1) + 1);
    }
    knobs_add(k, path, g_strstrip(v));
    return TRUE;
}

static void
knobs_undo(gconstpointer data)
{
    const Knobs *k = data;

    for (guint i = 0; i < k->n; i++) {
        int fd = open(k->path[i], O_WRONLY | O_CLOEXEC);

        if (fd >= 0) {
            ssize_t rc = write(fd, k->value[i], strlen(k->value[i]));

            (void)rc; /* nothing better to do in a child about to exit */
            close(fd);
        }
    }
}

static guint64
pagemap_of(int pid, guint64 addr)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/pagemap", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    guint64 e = 0;

    g_assert_cmpint(pread(fd, &e, 8, (off_t)(addr / PF_PAGE_SIZE * 8)), ==, 8);
    close(fd);
    return e;
}

#define PM_PRESENT (1ull << 63)
#define PM_SWAP (1ull << 62)
#define PM_PFN(e) ((e) & ((1ull << 55) - 1))
#define KPF_KSM (1ull << 21)
#define KPF_ZERO_PAGE (1ull << 24)

/* /proc/kpageflags of the page behind a VMM's address; 0 if not present. */
static guint64
kpageflags_of(int pid, guint64 addr)
{
    guint64 e = pagemap_of(pid, addr), flags = 0;
    int fd;

    if (!(e & PM_PRESENT) || PM_PFN(e) == 0 ||
        (fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC)) < 0) {
        return 0;
    }
    if (pread(fd, &flags, 8, (off_t)(PM_PFN(e) * 8)) != 8) {
        flags = 0;
    }
    close(fd);
    return flags;
}

/* The first zero page of a guest's layout (identical, unique, zero). */
#define ZERO_FIRST (IDENTICAL + UNIQUE)

/* A swap file of our own, on only for the test. */
typedef struct {
    char path[256];
} SwapFile;

static void
swap_undo(gconstpointer data)
{
    const SwapFile *sw = data;

    swapoff(sw->path);
    unlink(sw->path);
}

/* Makes and enables a 64 MiB swap file (written whole: swapon refuses
 * holes), as mkswap would; FALSE with why if the host will not have it. */
static gboolean
swap_on(SwapFile *sw, Undo *undo, char **why)
{
    const gsize pages = 64 * 256;
    g_autofree guint8 *page = g_malloc0(PF_PAGE_SIZE);
    guint32 header[3] = { 1, (guint32)(pages - 1), 0 }; /* version, last page, bad */
    const char *dir = g_file_test("/var/tmp", G_FILE_TEST_IS_DIR) ? "/var/tmp" : g_get_tmp_dir();
    int fd;

    g_snprintf(sw->path, sizeof(sw->path), "%s/pagefold-agent-test.%d.swap", dir, getpid());
    fd = open(sw->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        *why = g_strdup_printf("%s: %s", sw->path, g_strerror(errno));
        return FALSE;
    }
    /* The swap file goes with the test, whatever happens from here on. */
    *undo = undo_at_exit(swap_undo, sw);
    memcpy(page + 1024, header, sizeof(header));
    memcpy(page + PF_PAGE_SIZE - 10, "SWAPSPACE2", 10);
    for (gsize i = 0; i < pages; i++) {
        g_assert_cmpint(write(fd, page, PF_PAGE_SIZE), ==, PF_PAGE_SIZE);
        if (i == 0) {
            memset(page, 0, PF_PAGE_SIZE);
        }
    }
    g_assert_cmpint(fsync(fd), ==, 0);
    close(fd);
    if (swapon(sw->path, 0) < 0) {
        *why = g_strdup_printf("swapon %s: %s", sw->path, g_strerror(errno));
        undo_now(undo);
        return FALSE;
    }
    return TRUE;
}

/* Every thread of process pid onto one CPU, the first this test may use
 * (a cpuset may leave it only some).  A page a thread writes waits first
 * in its CPU's LRU batch, and MADV_PAGEOUT drains only the batch of the
 * CPU it runs on: a page written on one CPU and paged out from another is
 * passed over, however often asked, until that other CPU adds enough
 * pages to flush its batch, which an idle CPU never does. */
static void
pin_to_one_cpu(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/task", pid);
    g_autoptr(GDir) dir = g_dir_open(path, 0, NULL);
    cpu_set_t mine, one;
    const char *tid;
    int cpu = 0;

    g_assert_cmpint(sched_getaffinity(0, sizeof(mine), &mine), ==, 0);
    while (!CPU_ISSET(cpu, &mine)) {
        cpu++;
    }
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    g_assert_nonnull(dir);
    while ((tid = g_dir_read_name(dir)) != NULL) {
        /* A thread may end meanwhile; one made later takes its maker's. */
        if (sched_setaffinity(atoi(tid), sizeof(one), &one) < 0) {
            g_assert_cmpint(errno, ==, ESRCH);
        }
    }
}

/* A merged page written, then its private copy swapped out before
 * pagefoldd looks: not present, but written all the same.  Both a shared
 * page and a zero page. */
static void
test_cow_swapped(gconstpointer data)
{
    const char *path = data;
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) s = NULL;
    g_autofree char *why = NULL;
    SwapFile sw = { { 0 } };
    Undo undo = { 0, -1 };
    const guint pages[2] = { 5, ZERO_FIRST + 3 };
    Vmm *a, *b;
    guint64 ram;

    if (geteuid() != 0) {
        g_test_skip("swapon needs root");
        return;
    }
    if (!swap_on(&sw, &undo, &why)) {
        g_test_skip(why);
        return;
    }
    d = daemon_seeing(path);
    a = vmm_start(d, "a", 1, 0, FALSE);
    b = vmm_start(d, "b", 2, 0, FALSE);
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        undo_now(&undo);
        return;
    }
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO);
    ram = guest_addr(d, "a");
    /* Written and paged out on one CPU: see pin_to_one_cpu(). */
    pin_to_one_cpu(a->pid);
    g_free(pf_test_vmm_cmdf(a, "write %u", pages[0]));
    g_free(pf_test_vmm_cmdf(a, "fill %u 77", pages[1]));
    for (guint i = 0; i < G_N_ELEMENTS(pages); i++) {
        guint64 e = 0;

        /* Really out: a swap entry where the copy was.  Isolating a
         * page from the LRU can still fail for a moment (reclaim or
         * compaction holding it): again, a few times. */
        for (int tries = 0; tries < 50 && (e & (PM_PRESENT | PM_SWAP)) != PM_SWAP; tries++) {
            g_autofree char *r = pf_test_vmm_cmdf(a, "pageout %u 1", pages[i]);

            g_assert_cmpstr(r, ==, "ok");
            e = pagemap_of(a->pid, ram + pages[i] * PF_PAGE_SIZE);
            if ((e & (PM_PRESENT | PM_SWAP)) != PM_SWAP) {
                g_usleep(20000);
            }
        }
        g_assert_cmphex(e & (PM_PRESENT | PM_SWAP), ==, PM_SWAP);
    }
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "cow"), ==, 2);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 1);
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(a, "unmerged"), ==, 2);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
    undo_now(&undo);
}

/*
 * Host KSM merges the private copies of merged pages (their mappings are
 * mergeable: a QEMU under PR_SET_MEMORY_MERGE makes every new mapping so,
 * the agent's remaps included): two copies of equal content become one
 * KSM page, mapped twice, no longer "exclusive"; a copy of zeros becomes
 * the kernel's zero page (use_zero_pages=1).  All were written: a shared
 * page overwritten with zeros too.  Only a zero page written with zeros
 * still holds what it was merged for.
 */
static void
test_cow_ksm(gconstpointer data)
{
    const char *path = data;
    const char *ksm = "/sys/kernel/mm/ksm";
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) s = NULL;
    Knobs knobs = { 0 };
    Undo undo = { 0, -1 };
    const guint z = ZERO_FIRST + 3;
    Vmm *a, *b;
    guint64 ram;
    gboolean merged = FALSE;

    if (geteuid() != 0 || !g_file_test("/sys/kernel/mm/ksm/use_zero_pages", G_FILE_TEST_EXISTS)) {
        g_test_skip("needs root and host KSM with use_zero_pages");
        return;
    }
    /* As found: unmerge everything first, then the old settings, run last. */
    {
        g_autofree char *run = g_strdup_printf("%s/run", ksm);
        const char *names[] = { "use_zero_pages", "pages_to_scan", "sleep_millisecs", "run" };

        knobs_add(&knobs, run, "2");
        for (guint i = 0; i < G_N_ELEMENTS(names); i++) {
            g_autofree char *p = g_strdup_printf("%s/%s", ksm, names[i]);

            g_assert_true(knobs_save(&knobs, p));
        }
    }
    d = daemon_seeing(path);
    a = vmm_start(d, "a", 1, 0, FALSE);
    b = vmm_start(d, "b", 2, 0, FALSE);
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        return;
    }
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO);
    ram = guest_addr(d, "a");
    /* Shared pages: 5 zeroed, 6 and 7 made equal; zero pages: z and z + 1
     * made equal, z + 2 written with zeros. */
    g_free(pf_test_vmm_cmd(a, "fill 5 0"));
    g_free(pf_test_vmm_cmd(a, "fill 6 4242"));
    g_free(pf_test_vmm_cmd(a, "fill 7 4242"));
    g_free(pf_test_vmm_cmdf(a, "fill %u 4343", z));
    g_free(pf_test_vmm_cmdf(a, "fill %u 4343", z + 1));
    g_free(pf_test_vmm_cmdf(a, "fill %u 0", z + 2));
    for (guint i = 0; i < 2; i++) {
        g_autofree char *r = pf_test_vmm_cmdf(a, "mergeable %u 3", i == 0 ? 5u : z);

        g_assert_cmpstr(r, ==, "ok");
    }
    undo = undo_at_exit(knobs_undo, &knobs);
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/use_zero_pages", "1"));
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/pages_to_scan", "5000"));
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/sleep_millisecs", "10"));
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/run", "1"));
    for (gint64 until = g_get_monotonic_time() + 60 * G_USEC_PER_SEC;
         !merged && g_get_monotonic_time() < until;) {
        guint64 p6 = pagemap_of(a->pid, ram + 6 * PF_PAGE_SIZE);
        guint64 pz = pagemap_of(a->pid, ram + z * PF_PAGE_SIZE);

        merged = (kpageflags_of(a->pid, ram + 5 * PF_PAGE_SIZE) & KPF_ZERO_PAGE) &&
                 (kpageflags_of(a->pid, ram + 6 * PF_PAGE_SIZE) & KPF_KSM) &&
                 PM_PFN(p6) == PM_PFN(pagemap_of(a->pid, ram + 7 * PF_PAGE_SIZE)) &&
                 (kpageflags_of(a->pid, ram + z * PF_PAGE_SIZE) & KPF_KSM) &&
                 PM_PFN(pz) == PM_PFN(pagemap_of(a->pid, ram + (z + 1) * PF_PAGE_SIZE)) &&
                 (kpageflags_of(a->pid, ram + (z + 2) * PF_PAGE_SIZE) & KPF_ZERO_PAGE);
        if (!merged) {
            g_usleep(50000);
        }
    }
    /* Stopped, KSM keeps what it merged. */
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/run", "0"));
    if (!merged) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        undo_now(&undo);
        g_test_skip("host KSM did not merge the copies within 60 s");
        return;
    }
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "cow"), ==, 5);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 3);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 2);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
    undo_now(&undo);
}

/*
 * Guest RAM in transparent huge pages, one of them held by a reference
 * (a vmsplice()d page: a pipe, an I/O in flight): a merge of part of it
 * remaps those pages, but the punch cannot split the huge page, so it
 * only zeroes them and their memfd offsets stay data.  (A punch of a
 * whole huge page needs no split: each extent here keeps one page
 * unmerged.)  Such a merged page is scanned among data, and its
 * copy-on-write must be found there as in a hole, smart scan on
 * (pagefoldd's default).
 */
static void
test_cow_in_data(gconstpointer data)
{
    const char *path = data;
    const char *knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) s = NULL;
    Knobs knobs = { 0 };
    Undo undo;
    const guint z = PAGES - 96; /* in the last extent, all zero */
    Vmm *v[2];
    g_autofree char *data5 = NULL, *dataz = NULL;

    if (geteuid() != 0 || !knobs_save(&knobs, knob)) {
        g_test_skip("needs root and shmem transparent huge pages");
        return;
    }
    /* Huge pages for the guests' RAM, then the knob as it was at once. */
    undo = undo_at_exit(knobs_undo, &knobs);
    g_assert_true(pf_test_write_sysfs(knob, "advise"));
    d = daemon_seeing(path);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("t%d", i);

        v[i] = vmm_start_full(d, name, i + 1, 0, FALSE, "--huge");
    }
    undo_now(&undo);
    if (huge_kib(v[0]->pid, guest_addr(d, "t0")) == 0) {
        pf_test_vmm_free(v[0]);
        pf_test_vmm_free(v[1]);
        g_test_skip("guest RAM got no huge pages");
        return;
    }
    /* References on the first and the last huge page of t0, and a page
     * of each that stays apart. */
    for (guint i = 0; i < 2; i++) {
        g_autofree char *r = pf_test_vmm_cmdf(v[0], "pin %u", i == 0 ? 100u : (guint)PAGES - 1);
        g_autofree char *f = pf_test_vmm_cmdf(v[0], "fill %u %u", i == 0 ? 300u : (guint)PAGES - 2,
                                      4646 + i);

        g_assert_cmpstr(r, ==, "ok");
        g_assert_cmpstr(f, ==, "ok");
    }
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(v[0]);
        pf_test_vmm_quit(v[1]);
        return;
    }
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 1);
    data5 = pf_test_vmm_cmd(v[0], "data 5");
    dataz = pf_test_vmm_cmdf(v[0], "data %u", z);
    if (!g_str_equal(data5, "data 1") || !g_str_equal(dataz, "data 1")) {
        pf_test_vmm_quit(v[0]);
        pf_test_vmm_quit(v[1]);
        g_test_skip("the huge pages were split in spite of the references: no data left");
        return;
    }
    /* A few passes more: smart scan has looked at everything by then. */
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    g_free(pf_test_vmm_cmd(v[0], "write 5"));
    g_free(pf_test_vmm_cmdf(v[0], "fill %u 77", z));
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "t0"), "cow"), ==, 2);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 2);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 2);
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "unmerged"), ==, 2);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
    }
    g_free(pf_test_vmm_cmd(v[0], "unpin"));
    pf_test_vmm_quit(v[0]);
    pf_test_vmm_quit(v[1]);
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
        g_subprocess_send_signal(d->proc, SIGKILL);
        g_subprocess_wait(d->proc, NULL, NULL);
        for (int i = 0; i < 2; i++) {
            pf_test_vmm_verify(v[i]);
            wait_disconnected(v[i]);
            pf_test_vmm_verify(v[i]);
            pf_test_vmm_quit(v[i]);
        }
    }
}

/* The VM is listed by the pagefoldd running now, merging. */
static void
wait_merging(PfTestDaemon *d, const char *name)
{
    for (int i = 0; i < 600; i++) {
        g_autoptr(JsonObject) vm = pf_test_listed_vm(d, name);

        if (vm != NULL && g_str_equal(json_object_get_string_member(vm, "mode"), "merge")) {
            return;
        }
        g_usleep(50000);
    }
    g_error("VM %s is not back in merge mode within 30 s", name);
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
        g_subprocess_send_signal(d->proc, SIGKILL);
        g_subprocess_wait(d->proc, NULL, NULL);
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

/* The merge domain pagefoldd lists the VM in. */
static char *
listed_domain(PfTestDaemon *d, const char *name)
{
    g_autoptr(JsonObject) vm = pf_test_listed_vm(d, name);

    g_assert_nonnull(vm);
    return g_strdup(json_object_get_string_member(vm, "merge_domain"));
}

/* Waits until the VM is back merging, and says it is in merge domain want. */
static void
assert_back_in(PfTestDaemon *d, const char *name, const char *want)
{
    g_autofree char *domain = NULL;

    wait_merging(d, name);
    domain = listed_domain(d, name);
    g_test_message("%s: merge domain %s", name, domain);
    g_assert_cmpstr(domain, ==, want);
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
    g_subprocess_send_signal(d->proc, SIGKILL);
    g_subprocess_wait(d->proc, NULL, NULL);
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
    g_subprocess_send_signal(d->proc, SIGKILL);
    g_subprocess_wait(d->proc, NULL, NULL);
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

/*
 * A stand-in as nobody that libvirt vouches for: root writes libvirt's
 * status file of domain name in run_dir, naming the process's pid, and
 * only then is it the stand-in (exec, as libvirtd lets the QEMU it forked
 * exec only after it wrote that file).
 */
static Vmm *
vmm_launch_vouched_in(PfTestDaemon *d, const char *run_dir, const char *name, int seed,
                      const char *extra, const char *domain_xml)
{
    g_autofree char *status = g_strdup_printf("%s/%s.xml", run_dir, name);
    g_autofree char *guest = g_strdup_printf("guest=%s", name);
    g_autofree char *seedarg = g_strdup_printf("%d", seed);
    g_autofree char *mib = g_strdup_printf("%d", MIB);
    /* By path: the shell may have a setpriv of its own (busybox's, in the
     * kernel suite's guest) that knows no --reuid. */
    g_autofree char *setpriv = g_find_program_in_path("setpriv");
    const char *argv[] = {
        "sh", "-c",
        "umask 022 && printf \"<domstatus state='running' reason='booted' pid='%s'>\\n%s"
        "</domstatus>\\n\" $$ \"$1\" >\"$0\" && shift && exec \"$@\"",
        status, domain_xml != NULL ? domain_xml : "",
        setpriv != NULL ? setpriv : "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket", d->agent_sock,
        "--mib", mib, "--seed", seedarg, "--writers", "1", extra, NULL
    };
    Vmm *v = pf_test_vmm_spawn(argv);

    g_assert_nonnull(v);
    return v;
}

static Vmm *
vmm_start_vouched_in(PfTestDaemon *d, const char *run_dir, const char *name, int seed,
                     const char *extra, const char *domain_xml)
{
    Vmm *v = vmm_launch_vouched_in(d, run_dir, name, seed, extra, domain_xml);

    pf_test_daemon_wait_vmm(d, v);
    return v;
}

static Vmm *
vmm_start_vouched(PfTestDaemon *d, const char *run_dir, const char *name, int seed,
                  const char *extra)
{
    return vmm_start_vouched_in(d, run_dir, name, seed, extra, NULL);
}

/* QEMU under libvirt is not root: the agent makes its userfaultfd from
 * the /dev/userfaultfd fd pagefoldd passes to the QEMU libvirt's status
 * file names (vmm_start_vouched()), and merging works.  Any
 * process of the agent socket's group may be such an agent (a compromised
 * QEMU reconnecting, or forking one, to leave its merge domain): each
 * shares pages with none but itself until root says its domain, as
 * libvirt's hook does. */
static void
test_unprivileged(void)
{
    /* The stand-ins run as nobody:nogroup, as QEMU as libvirt-qemu. */
    g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-group",
                                                     "nogroup", "--libvirt-run-dir", run_dir,
                                                     NULL);
    Vmm *a, *b;
    g_autoptr(JsonObject) s = NULL;
    g_autoptr(JsonObject) vm = NULL;

    g_chmod(d->dir, 0755);
    /* One writer each, at a tenth of the others' pace: a pass of Debian
     * 12's 6.1 under TCG takes about a second, in which 2000 writes a
     * second left no page unchanged for two visits (seen: 6 pages sharing
     * after 40 passes, cow 9245), so sharing never came. */
    a = vmm_start_vouched(d, run_dir, "u0", 1, "--writes-per-sec=200");
    b = vmm_start_vouched(d, run_dir, "u1", 2, "--writes-per-sec=200");
    g_assert_cmpstr(a->mode, ==, "merge");
    g_assert_cmpstr(b->mode, ==, "merge");
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), <, IDENTICAL / 2);
    vm = json_object_ref(pf_test_find_vm(json_object_get_array_member(s, "vms"), "u0"));
    g_assert_cmpstr(json_object_get_string_member(vm, "merge_domain"), ==, "unlabelled");
    g_clear_pointer(&s, json_object_unref);
    json_node_unref(pf_test_ctl_json(d, "merge-domain", "u0", "default", NULL));
    json_node_unref(pf_test_ctl_json(d, "merge-domain", "u1", "default", NULL));
    /* Passes until they share: on Debian 12's 6.1 under TCG three were not
     * always enough (its writers, above). */
    for (int i = 0; i < 40 && (s == NULL || total(s, "pages_sharing") <= IDENTICAL / 2); i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "scan-now", "1");
    }
    g_assert_cmpint(total(s, "pages_sharing"), >, IDENTICAL / 2);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
    pf_test_write_libvirt_status(run_dir, "u0", NULL);
    pf_test_write_libvirt_status(run_dir, "u1", NULL);
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
}

/*
 * libvirt's QEMU, not root, whose status file holds its domain's XML with
 * a merge domain in pagefold's <metadata>: its VM is in that domain from
 * the moment its agent connects, with no hook to say so, and merges with
 * the other VM of the domain.  A pagefoldd killed and started again finds
 * both there again, and takes back the pages they shared.
 */
static void
test_libvirt_domain(void)
{
    g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
    const char *args[] = { "--set", "run=0", "--agent-group", "nogroup", "--libvirt-run-dir",
                           run_dir, NULL };
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start(args[0], args[1], args[2], args[3],
                                                     args[4], args[5], NULL);
    const char *names[2] = { "blue0", "blue1" };
    const char *uuids[2] = { "4f0c6a4e-3a1b-4e8e-9a51-8f5a0c1d2e01",
                             "4f0c6a4e-3a1b-4e8e-9a51-8f5a0c1d2e02" };
    Vmm *v[2];
    g_autoptr(JsonObject) s = NULL;
    gint64 sharing;

    g_chmod(d->dir, 0755);
    for (int i = 0; i < 2; i++) {
        g_autofree char *xml = g_strdup_printf(
            "<domain type='kvm'><name>%s</name><uuid>%s</uuid><metadata>"
            "<pagefold:config xmlns:pagefold='urn:pagefold:domain:1' merge-domain='blue'/>"
            "</metadata><memoryBacking><source type='memfd'/><access mode='shared'/>"
            "</memoryBacking></domain>\n",
            names[i], uuids[i]);
        g_autofree char *domain = NULL;
        g_autoptr(JsonObject) vm = NULL;

        v[i] = vmm_start_vouched_in(d, run_dir, names[i], i + 1, "--writes-per-sec=200", xml);
        domain = listed_domain(d, names[i]);
        g_assert_cmpstr(domain, ==, "blue");
        vm = pf_test_listed_vm(d, names[i]);
        g_assert_cmpstr(json_object_get_string_member(vm, "uuid"), ==, uuids[i]);
    }
    {
        /* A mistake in the element (an attribute of another name): the
         * hook attaches nothing, and the VM shares with nobody. */
        Vmm *t = vmm_start_vouched_in(
            d, run_dir, "typo", 3, "--writes-per-sec=200",
            "<domain type='kvm'><name>typo</name><uuid>4f0c6a4e-3a1b-4e8e-9a51-8f5a0c1d2e03"
            "</uuid><metadata><pagefold:config xmlns:pagefold='urn:pagefold:domain:1' "
            "merge_domain='blue'/></metadata><memoryBacking><source type='memfd'/><access "
            "mode='shared'/></memoryBacking></domain>\n");
        g_autofree char *domain = listed_domain(d, "typo");

        g_assert_cmpstr(domain, ==, "unlabelled");
        pf_test_vmm_verify(t);
        pf_test_vmm_quit(t);
        pf_test_write_libvirt_status(run_dir, "typo", NULL);
    }
    for (int i = 0; i < 40 && (s == NULL || total(s, "pages_sharing") <= IDENTICAL / 2); i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "scan-now", "1");
    }
    sharing = total(s, "pages_sharing");
    g_assert_cmpint(sharing, >, IDENTICAL / 2);

    g_subprocess_send_signal(d->proc, SIGKILL);
    g_subprocess_wait(d->proc, NULL, NULL);
    for (int i = 0; i < 2; i++) {
        wait_disconnected(v[i]);
    }
    pf_test_daemon_restart(d, args[0], args[1], args[2], args[3], args[4], args[5], NULL);
    g_chmod(d->dir, 0755);
    for (int i = 0; i < 2; i++) {
        assert_back_in(d, names[i], "blue");
    }
    /* Taken back, a slice at a time, not merged again (it does not scan):
     * the writers copied a few on write. */
    for (int i = 0; i < 500; i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "stats", NULL);
        if (total(s, "pages_sharing") > sharing * 9 / 10) {
            break;
        }
        g_usleep(10000);
    }
    g_assert_cmpint(total(s, "pages_sharing"), >, sharing * 9 / 10);
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
        pf_test_write_libvirt_status(run_dir, names[i], NULL);
    }
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
}

/* vm.unprivileged_userfaultfd, set for a test and given back after it. */
#define UNPRIVILEGED_UFFD "/proc/sys/vm/unprivileged_userfaultfd"

static char *
unprivileged_uffd_set(const char *value)
{
    g_autofree char *old = NULL;

    if (!g_file_get_contents(UNPRIVILEGED_UFFD, &old, NULL, NULL) ||
        !pf_test_write_sysfs(UNPRIVILEGED_UFFD, value)) {
        return NULL;
    }
    return g_strstrip(g_steal_pointer(&old));
}

/* Polls pagefoldd's list until it has process pid; FALSE after
 * timeout_s. */
static gboolean
wait_listed_pid(PfTestDaemon *d, int pid, double timeout_s)
{
    gint64 end = g_get_monotonic_time() + (gint64)(timeout_s * G_USEC_PER_SEC);

    for (;;) {
        g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);

        if (pf_test_find_vm_pid(json_node_get_array(list), pid) != NULL) {
            return TRUE;
        }
        if (g_get_monotonic_time() > end) {
            return FALSE;
        }
        g_usleep(50000);
    }
}

/*
 * A flood of handshakes from the very uid libvirt runs every QEMU as (32
 * processes of nobody, as a compromised QEMU could make, reconnecting in
 * a loop) keeps no VM out: the three QEMUs libvirt's status files name
 * attach during the flood, in merge mode, on places the flood cannot
 * take; three stand-ins of that uid that root vouched for none of may
 * lose their handshakes to it, and attach once it is over, their agents
 * trying again as they were told to (PF_ERROR_TRY_AGAIN).
 */
static void
test_flood_same_uid(void)
{
    g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-group",
                                                     "nogroup", "--libvirt-run-dir", run_dir,
                                                     NULL);
    Vmm *vouched[3], *others[3];
    int flooders[32];
    gint64 t0;

    if (g_getenv("PAGEFOLD_TEST_TCG_GUEST") != NULL) {
        g_test_skip("32 flooding processes outpace pagefoldd on two emulated vCPUs: the "
                    "flood tests its handshake places, no kernel mechanism (host only)");
        g_rmdir(run_dir);
        return;
    }
    g_chmod(d->dir, 0755);
    for (guint i = 0; i < G_N_ELEMENTS(flooders); i++) {
        flooders[i] = pf_test_flooder(d, 0);
    }
    g_usleep(G_USEC_PER_SEC); /* the flood under way */
    /* Their first try may find the kernel's listen queue full, or a busy
     * machine may keep their handshake over its 5 s: they try again, as
     * QEMU does, and attach while the flood goes on. */
    for (guint i = 0; i < G_N_ELEMENTS(vouched); i++) {
        g_autofree char *name = g_strdup_printf("v%u", i);

        vouched[i] = vmm_launch_vouched_in(d, run_dir, name, (int)i + 1,
                                           "--run-unattached", NULL);
    }
    for (guint i = 0; i < G_N_ELEMENTS(others); i++) {
        g_autofree char *name = g_strdup_printf("o%u", i);
        g_autofree char *guest = g_strdup_printf("guest=%s", name);
        g_autofree char *seed = g_strdup_printf("%u", i + 10);
        const char *argv[] = { "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket",
                               d->agent_sock, "--mib", "4", "--seed", seed, "--writers", "1",
                               "--writes-per-sec", "200", "--run-unattached", NULL };

        others[i] = pf_test_vmm_spawn(argv);
        g_assert_nonnull(others[i]);
    }
    /* Still flooding: every vouched VM is pagefoldd's, merging. */
    for (guint i = 0; i < G_N_ELEMENTS(vouched); i++) {
        g_autoptr(JsonNode) list = NULL;
        JsonObject *vm;

        g_assert_true(wait_listed_pid(d, vouched[i]->pid, 120));
        list = pf_test_ctl_json(d, "list", NULL);
        vm = pf_test_find_vm_pid(json_node_get_array(list), vouched[i]->pid);
        g_test_message("v%u: mode %s (its agent's first try: %s)", i,
                       json_object_get_string_member(vm, "mode"), vouched[i]->mode);
        g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
    }
    for (guint i = 0; i < G_N_ELEMENTS(flooders); i++) {
        pf_guest_release(flooders[i]);
    }
    t0 = g_get_monotonic_time();
    /* An agent tries again at most 5 s apart; the bound is for a loaded
     * machine, the time it took is said. */
    for (guint i = 0; i < G_N_ELEMENTS(others); i++) {
        g_assert_true(wait_listed_pid(d, others[i]->pid, 60));
    }
    g_test_message("the unvouched VMs were all attached %.1f s after the flood",
                   (g_get_monotonic_time() - t0) / 1e6);
    for (guint i = 0; i < G_N_ELEMENTS(vouched); i++) {
        g_autofree char *name = g_strdup_printf("v%u", i);

        pf_test_vmm_verify(vouched[i]);
        pf_test_vmm_quit(vouched[i]);
        pf_test_vmm_verify(others[i]);
        pf_test_vmm_quit(others[i]);
        pf_test_write_libvirt_status(run_dir, name, NULL);
    }
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
}

/*
 * A process of the agent socket's group that root did not vouch for gets
 * no /dev/userfaultfd from pagefoldd, however proper the RAM it shows (a
 * sealed memfd mapped shared): with vm.unprivileged_userfaultfd=0 it can
 * make no userfaultfd that sees the kernel's faults, so it stays in advise
 * mode, and pagefoldd says why.
 */
static void
test_not_vouched(void)
{
    g_autofree char *old = NULL;
    Vmm *a;
    g_autoptr(JsonObject) vm = NULL;
    const char *why;

    if (geteuid() != 0 || !g_file_test("/dev/userfaultfd", G_FILE_TEST_EXISTS)) {
        g_test_skip("needs root and /dev/userfaultfd");
        return;
    }
    old = unprivileged_uffd_set("0");
    g_assert_nonnull(old);
    {
        g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-group",
                                                         "nogroup", NULL);

        g_chmod(d->dir, 0755);
        a = vmm_start_full(d, "stranger", 1, 1, TRUE, "--writes-per-sec=200");
        /* Its READY may still be on its way to pagefoldd. */
        for (int i = 0; i < 500 && (vm = pf_test_listed_vm(d, "stranger")) == NULL; i++) {
            g_usleep(10000);
        }
        g_assert_nonnull(vm);
        why = json_object_get_string_member_with_default(vm, "mode_reason", "");
        g_test_message("mode %s (stand-in: %s), because %s",
                       json_object_get_string_member(vm, "mode"), a->mode, why);
        g_assert_cmpstr(a->mode, ==, "advise");
        g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
        g_assert_nonnull(strstr(why, "not vouched for by root: no /dev/userfaultfd"));
        pf_test_vmm_verify(a);
        pf_test_vmm_quit(a);
    }
    g_assert_true(pf_test_write_sysfs(UNPRIVILEGED_UFFD, old));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/agent/merge-exact", test_merge_exact);
    g_test_add_data_func("/agent/cow-and-remerge/PAGEMAP_SCAN", "PAGEMAP_SCAN",
                         test_cow_and_remerge);
    g_test_add_data_func("/agent/cow-and-remerge/pagemap", "pagemap", test_cow_and_remerge);
    g_test_add_func("/agent/unmerge-all", test_unmerge_all);
    g_test_add_func("/agent/pool-apart", test_pool_apart);
    g_test_add_func("/agent/ids-reused", test_ids_reused_live);
    g_test_add_func("/agent/pool-memory", test_pool_memory);
    g_test_add_func("/agent/pool-kept", test_pool_kept);
    g_test_add_func("/agent/unmerge-fails", test_unmerge_fails);
    g_test_add_func("/agent/vma-budget", test_vma_budget);
    g_test_add_func("/agent/step-back", test_step_back);
    g_test_add_func("/agent/discard", test_discard);
    g_test_add_func("/agent/huge-pages", test_huge_pages);
    g_test_add_data_func("/agent/cow-swapped/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_cow_swapped);
    g_test_add_data_func("/agent/cow-swapped/pagemap", "pagemap", test_cow_swapped);
    g_test_add_data_func("/agent/cow-ksm/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_cow_ksm);
    g_test_add_data_func("/agent/cow-ksm/pagemap", "pagemap", test_cow_ksm);
    g_test_add_data_func("/agent/cow-in-data/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_cow_in_data);
    g_test_add_data_func("/agent/cow-in-data/pagemap", "pagemap", test_cow_in_data);
    g_test_add_func("/agent/concurrent-writers", test_concurrent_writers);
    g_test_add_func("/agent/kill-daemon", test_kill_daemon);
    g_test_add_func("/agent/kill-vmm", test_kill_vmm);
    g_test_add_func("/agent/restart", test_restart);
    g_test_add_func("/agent/detach-stays", test_detach_stays);
    g_test_add_func("/agent/domains-restart", test_domains_restart);
    g_test_add_func("/agent/unprivileged", test_unprivileged);
    g_test_add_func("/agent/not-vouched", test_not_vouched);
    g_test_add_func("/agent/flood-same-uid", test_flood_same_uid);
    g_test_add_func("/agent/libvirt-domain", test_libvirt_domain);
    return g_test_run();
}
