/*
 * vm-test.c - attaching to real processes: a child that maps a memfd shared
 * like QEMU, processes that are no VM, and VMs that misbehave mid-pass
 * (exit, unmap their RAM, truncate it).  The daemon side must carry on.
 */
#include <fcntl.h>
#include <glib.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guestmem.h"
#include "jobs.h"
#include "pool.h"
#include "region.h"
#include "scan-helpers.h"
#include "scan.h"
#include "util.h"

static const PfLayout layout = {
    .identical = 512, .unique = 256, .zero = 128, .volatile_ = 0, .holes = 128,
};

static void
test_attach_child(void)
{
    g_autoptr(PfGuest) g = pf_guest_new("memory-backend-memfd", &layout, 1);
    int pid = pf_guest_hold(g);
    g_autoptr(GError) error = NULL;
    g_autoptr(PfVm) vm = pf_vm_attach(pid, NULL, &error);
    g_autofree char *suffix = g_strdup_printf("-%d", pid);
    PfRegion *r;

    g_assert_no_error(error);
    g_assert_cmpuint(vm->regions->len, ==, 1);
    r = g_ptr_array_index(vm->regions, 0);
    g_assert_cmpstr(r->name, ==, "memory-backend-memfd");
    g_assert_cmpuint(r->size, ==, 1024 * PF_PAGE_SIZE);
    g_assert_cmpuint(r->host_addr, ==, (guint64)(guintptr)g->mem);
    /* Our mapping sees the child's memory, read-only. */
    g_assert_cmpint(memcmp(r->map, g->mem, r->size), ==, 0);
    /* No name given: comm-pid (QEMU's -name guest=X is tested in cli-test). */
    g_assert_true(g_str_has_suffix(vm->name, suffix));
    pf_guest_release(pid);
}

static void
test_not_a_vm(void)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(PfVm) vm = NULL;
    g_autoptr(GSubprocess) sleeper = g_subprocess_new(G_SUBPROCESS_FLAGS_NONE, &error,
                                                      "sleep", "60", NULL);

    g_assert_no_error(error);
    vm = pf_vm_attach(atoi(g_subprocess_get_identifier(sleeper)), NULL, &error);
    g_assert_null(vm);
    g_assert_error(error, PF_ERROR, PF_ERROR_NO_GUEST_RAM);
    g_assert_nonnull(strstr(error->message, "memory-backend-memfd,share=on"));
    g_subprocess_force_exit(sleeper);
    g_clear_error(&error);

    vm = pf_vm_attach(G_MAXINT - 1, NULL, &error);
    g_assert_null(vm);
    g_assert_error(error, PF_ERROR, PF_ERROR_NOT_FOUND);
    g_clear_error(&error);
    vm = pf_vm_attach(0, NULL, &error);
    g_assert_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT);
}

typedef struct {
    PfGuest *g[2];
    int pid[2];
    PfScanner *s;
    int gone;
} Pair;

/* Detached on its own (a VM only removed has no why). */
static void
on_gone(PfScanner *s, PfVm *vm, const char *why, gpointer user)
{
    ((Pair *)user)->gone += why != NULL;
}

static const PfScanEvents pair_events = { .vm_gone = on_gone };

static void
pair_setup(Pair *p, gconstpointer data)
{
    for (int i = 0; i < 2; i++) {
        p->g[i] = pf_guest_new("memory-backend-memfd", &layout, (guint32)i + 1);
        p->pid[i] = pf_guest_hold(p->g[i]);
    }
    p->s = pf_scanner_new(NULL);
    pf_scanner_add_listener(p->s, &pair_events, p, NULL);
    for (int i = 0; i < 2; i++) {
        g_autoptr(GError) error = NULL;
        PfVm *vm = pf_vm_attach(p->pid[i], i ? "b" : "a", &error);

        g_assert_no_error(error);
        pf_scanner_add_vm(p->s, vm);
    }
}

static void
pair_teardown(Pair *p, gconstpointer data)
{
    pf_scanner_free(p->s);
    for (int i = 0; i < 2; i++) {
        if (p->pid[i] > 0) {
            pf_guest_release(p->pid[i]);
        }
        pf_guest_free(p->g[i]);
    }
}

static void
assert_sums(PfScanner *s)
{
    PfCounters total, per[2], sum = { 0 };
    GPtrArray *vms = pf_scanner_get_vms(s);

    pf_scanner_collect(s, &total, per);
    for (guint i = 0; i < vms->len; i++) {
        pf_counters_add(&sum, &per[i]);
    }
    g_assert_cmpuint(sum.pages_shared, ==, total.pages_shared);
    g_assert_cmpuint(sum.pages_sharing, ==, total.pages_sharing);
    g_assert_cmpuint(sum.pages_unshared, ==, total.pages_unshared);
}

/* A VM whose process exits in the middle of a pass is dropped when the
 * main loop sees its pidfd; the other VM keeps its pages and counters. */
static void
test_exit_mid_pass(Pair *p, gconstpointer data)
{
    PfCounters total, per[2];

    pf_scan_job_run_passes_wait(p->s, 2);
    pf_test_scan(p->s, 300); /* part of the next pass, inside VM a */
    pf_guest_release(p->pid[0]);
    p->pid[0] = 0;
    while (p->gone == 0) {
        g_main_context_iteration(NULL, TRUE);
    }
    g_assert_cmpuint(pf_scanner_get_vms(p->s)->len, ==, 1);
    pf_scan_job_run_passes_wait(p->s, 1);
    pf_scanner_collect(p->s, &total, per);
    /* b's identical pages were in nodes with a's: each is alone now. */
    g_assert_cmpuint(total.pages_shared, ==, 512);
    g_assert_cmpuint(total.pages_sharing, ==, 0);
    g_assert_cmpuint(total.zero_pages, ==, 128);
    g_assert_cmpuint(per[0].pages_unshared, ==, 256);
    assert_sums(p->s);
}

/* A process that unmaps (hot-unplugs) its RAM: the region is released at
 * the start of the next pass, the VM stays attached with what is left. */
static void
test_region_vanishes(Pair *p, gconstpointer data)
{
    PfCounters total, per[3];
    int status;
    int ready[2];
    int pid;

    pf_scan_job_run_passes_wait(p->s, 2);
    /* VM c maps the RAM of a and b (inherited), then unmaps it all when
     * told, as a QEMU unplugging its memory would. */
    g_assert_cmpint(pipe(ready), ==, 0);
    pid = fork();
    if (pid == 0) {
        PfGuest *mine = p->g[0];
        sigset_t set;
        int sig;
        char c = 0;

        sigemptyset(&set);
        sigaddset(&set, SIGUSR1);
        sigprocmask(SIG_BLOCK, &set, NULL);
        (void)!write(ready[1], &c, 1);
        sigwait(&set, &sig);
        munmap(mine->mem, mine->n_pages * PF_PAGE_SIZE);
        munmap(p->g[1]->mem, p->g[1]->n_pages * PF_PAGE_SIZE);
        (void)!write(ready[1], &c, 1);
        pause();
        _exit(0);
    }
    {
        char c;
        g_autoptr(GError) error = NULL;
        PfVm *vm;

        g_assert_cmpint(read(ready[0], &c, 1), ==, 1);
        vm = pf_vm_attach(pid, "c", &error);
        g_assert_no_error(error);
        g_assert_cmpuint(vm->regions->len, ==, 2); /* it inherited both */
        pf_scanner_add_vm(p->s, vm);
        pf_scan_job_run_passes_wait(p->s, 2);
        kill(pid, SIGUSR1);
        g_assert_cmpint(read(ready[0], &c, 1), ==, 1);
        pf_scan_job_run_passes_wait(p->s, 1);
        g_assert_cmpuint(vm->regions->len, ==, 0);
        g_assert_cmpuint(pf_scanner_get_vms(p->s)->len, ==, 3);
        pf_scanner_collect(p->s, &total, per);
        g_assert_cmpuint(per[2].pages_tracked, ==, 0);
        g_assert_cmpuint(total.pages_sharing, ==, 512);
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    close(ready[0]);
    close(ready[1]);
}

/* A memfd truncated under the scanner raises SIGBUS in the middle of a
 * read: the region is dropped, the daemon and the other VM carry on. */
static int truncate_fd = -1;
static const guint8 *truncate_lo, *truncate_hi; /* the scanner's map of it */
static int hash_calls;

/* Truncates at the 10th page of that memfd hashed, so that the next one,
 * in the extent read before, faults: whichever VM the pass takes first
 * (the 100th page of the pass, of any VM, faulted only where the memfd's
 * extents had been read before it, about 1 run in 8 under ASan). */
static guint64
truncating_hash(const void *page)
{
    if (truncate_fd >= 0 && (const guint8 *)page >= truncate_lo &&
        (const guint8 *)page < truncate_hi && ++hash_calls == 10) {
        g_assert_cmpint(ftruncate(truncate_fd, 0), ==, 0);
    }
    return pf_hash_default()->func(page);
}

static void
test_truncated_under_us(Pair *p, gconstpointer data)
{
    PfCounters total, per[2];
    PfVm *a;
    PfRegion *r;

    pf_scan_job_run_passes_wait(p->s, 2);
    a = pf_scanner_find_vm(p->s, "a");
    r = g_ptr_array_index(a->regions, 0);
    truncate_lo = r->map;
    truncate_hi = r->map + r->size;
    truncate_fd = p->g[0]->fd;
    hash_calls = 0;
    /* Every page is read this pass: none is skipped as unchanged. */
    pf_scanner_get_knobs(p->s)->smart_scan = FALSE;
    pf_scanner_set_hash_func(p->s, truncating_hash);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "VM a: region * faulted at *");
    pf_scan_job_run_passes_wait(p->s, 1);
    g_test_assert_expected_messages();
    truncate_fd = -1;
    a = pf_scanner_find_vm(p->s, "a");
    g_assert_nonnull(a);
    g_assert_cmpuint(a->regions->len, ==, 0);
    pf_scanner_collect(p->s, &total, per);
    g_assert_cmpuint(per[0].pages_tracked, ==, 0);
    g_assert_cmpuint(per[1].zero_pages, ==, 128);
    g_assert_cmpuint(total.pages_shared, ==, 512);
    g_assert_cmpuint(total.pages_sharing, ==, 0);
    assert_sums(p->s);

    /* a's process still maps the memfd, shorter than the mapping now: no
     * pass takes it again (nor faults on it) until it has its size back,
     * and then as a new region, with nothing of the old one's left. */
    pf_scan_job_run_passes_wait(p->s, 2);
    g_assert_cmpuint(a->regions->len, ==, 0);
    g_assert_cmpint(ftruncate(p->g[0]->fd, (off_t)(p->g[0]->n_pages * PF_PAGE_SIZE)), ==, 0);
    pf_scan_job_run_passes_wait(p->s, 1);
    g_assert_cmpuint(a->regions->len, ==, 1);
    pf_scanner_collect(p->s, &total, per);
    g_assert_cmpuint(per[0].pages_tracked, ==, 0); /* holes only */
    g_assert_cmpuint(total.pages_shared, ==, 512);
    assert_sums(p->s);
}

/* Checks the region of pages [first, first + n) of the guest memfd as
 * holder's, pooled; whether it passed (its pooled kept in *pooled). */
static gboolean
check_as(int proc_dir, int memfd, guint8 *base, gsize first, gsize n, int pid, uid_t uid,
         gboolean vouched, PfPoolMapped **pooled)
{
    PfChunkHolder h = { pid, uid, vouched };
    g_autoptr(GError) error = NULL;
    gboolean ok = pf_region_check_mapping(proc_dir, memfd, "pc.ram",
                                          (guint64)(guintptr)(base + first * PF_PAGE_SIZE),
                                          first * PF_PAGE_SIZE, n * PF_PAGE_SIZE, &h, pooled,
                                          NULL, &error);

    if (!ok) {
        g_test_message("pid %d, uid %u%s: %s", pid, (guint)uid, vouched ? ", vouched" : "",
                       error->message);
        g_assert_nonnull(strstr(error->message, "more pool chunks than pagefoldd takes back"));
    }
    return ok;
}

/*
 * Pool chunk descriptors held while regions are checked after a restart
 * are capped per peer, per uid of the peers root vouched for none of, for
 * all of those, and in all: a process that hoards chunks, or many of one
 * uid, cannot get another VM's pooled regions refused, least of all one
 * root vouched for.  Small caps here; the pages are this process's.
 */
static void
test_chunk_caps(void)
{
    const PfChunkCaps small = { .region = 16, .peer = 2, .unvouched_uid = 3, .unvouched = 4,
                                .all = 6 };
    g_autoptr(PfPool) p = pf_pool_new(NULL, NULL, NULL);
    guint8 content[PF_PAGE_SIZE];
    PfPoolMapped *held[8] = { NULL };
    int memfd, proc_dir;
    guint8 *base;

    if (geteuid() != 0) {
        g_test_skip("needs root: pool chunks are marked in the trusted namespace");
        return;
    }
    memfd = memfd_create("guest", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    g_assert_cmpint(ftruncate(memfd, 8 * PF_PAGE_SIZE), ==, 0);
    g_assert_cmpint(fcntl(memfd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), ==, 0);
    base = mmap(NULL, 8 * PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    g_assert_true(base != MAP_FAILED);
    /* Pages 0 and 1 from two chunks (the region of two), page 4 from a
     * third (the region of one), as an agent maps merged pages. */
    for (guint i = 0; i < 3; i++) {
        guint32 vm = i + 1, chunk, index, slot;
        const PfPoolChunk *c;
        gsize page = i < 2 ? i : 4;

        memset(content, 0x11 * (i + 1), sizeof(content));
        slot = pf_pool_alloc(p, &vm, 1, content, NULL);
        pf_pool_locate(p, slot, &chunk, &index);
        c = pf_pool_chunk(p, chunk);
        g_assert_true(mmap(base + page * PF_PAGE_SIZE, PF_PAGE_SIZE, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_FIXED, c->fd,
                           (off_t)index * PF_PAGE_SIZE) != MAP_FAILED);
    }
    proc_dir = open("/proc/self", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    pf_region_set_chunk_caps(&small);
    /* A peer: two chunks, and no more however it asks. */
    g_assert_true(check_as(proc_dir, memfd, base, 0, 2, 100, 1000, FALSE, &held[0]));
    g_assert_false(check_as(proc_dir, memfd, base, 4, 1, 100, 1000, FALSE, &held[1]));
    /* Its uid: three in all. */
    g_assert_true(check_as(proc_dir, memfd, base, 4, 1, 101, 1000, FALSE, &held[2]));
    g_assert_false(check_as(proc_dir, memfd, base, 4, 1, 102, 1000, FALSE, &held[3]));
    /* Unvouched peers: four in all. */
    g_assert_true(check_as(proc_dir, memfd, base, 4, 1, 103, 1001, FALSE, &held[4]));
    g_assert_false(check_as(proc_dir, memfd, base, 4, 1, 104, 1002, FALSE, &held[5]));
    /* A peer root vouched for, of the same uid: the rest. */
    g_assert_true(check_as(proc_dir, memfd, base, 0, 2, 105, 1000, TRUE, &held[6]));
    g_assert_false(check_as(proc_dir, memfd, base, 4, 1, 106, 1000, TRUE, &held[7]));
    /* What a check held is given back with it. */
    g_clear_pointer(&held[0], pf_pool_mapped_free);
    g_assert_true(check_as(proc_dir, memfd, base, 4, 1, 106, 1000, TRUE, &held[7]));
    g_assert_true(check_as(proc_dir, memfd, base, 4, 1, 100, 1000, FALSE, &held[1]));
    for (guint i = 0; i < G_N_ELEMENTS(held); i++) {
        g_clear_pointer(&held[i], pf_pool_mapped_free);
    }
    pf_region_set_chunk_caps(NULL);
    close(proc_dir);
    munmap(base, 8 * PF_PAGE_SIZE);
    close(memfd);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/vm/attach-child", test_attach_child);
    g_test_add_func("/vm/not-a-vm", test_not_a_vm);
    g_test_add_func("/region/chunk-caps", test_chunk_caps);
    g_test_add("/vm/exit-mid-pass", Pair, NULL, pair_setup, test_exit_mid_pass, pair_teardown);
    g_test_add("/vm/region-vanishes", Pair, NULL, pair_setup, test_region_vanishes,
               pair_teardown);
    g_test_add("/vm/truncated-under-us", Pair, NULL, pair_setup, test_truncated_under_us,
               pair_teardown);
    return g_test_run();
}
