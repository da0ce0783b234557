/*
 * vm-test.c - attaching to real processes: a child that maps a memfd shared
 * like QEMU, processes that are no VM, and VMs that misbehave mid-pass
 * (exit, unmap their RAM, truncate it).  The daemon side must carry on.
 */
#include <glib.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guestmem.h"
#include "jobs.h"
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

    pf_scanner_run_passes(p->s, 2);
    pf_test_scan(p->s, 300); /* part of the next pass, inside VM a */
    pf_guest_release(p->pid[0]);
    p->pid[0] = 0;
    while (p->gone == 0) {
        g_main_context_iteration(NULL, TRUE);
    }
    g_assert_cmpuint(pf_scanner_get_vms(p->s)->len, ==, 1);
    pf_scanner_run_passes(p->s, 1);
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

    pf_scanner_run_passes(p->s, 2);
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
        pf_scanner_run_passes(p->s, 2);
        kill(pid, SIGUSR1);
        g_assert_cmpint(read(ready[0], &c, 1), ==, 1);
        pf_scanner_run_passes(p->s, 1);
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

    pf_scanner_run_passes(p->s, 2);
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
    pf_scanner_run_passes(p->s, 1);
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
    pf_scanner_run_passes(p->s, 2);
    g_assert_cmpuint(a->regions->len, ==, 0);
    g_assert_cmpint(ftruncate(p->g[0]->fd, (off_t)(p->g[0]->n_pages * PF_PAGE_SIZE)), ==, 0);
    pf_scanner_run_passes(p->s, 1);
    g_assert_cmpuint(a->regions->len, ==, 1);
    pf_scanner_collect(p->s, &total, per);
    g_assert_cmpuint(per[0].pages_tracked, ==, 0); /* holes only */
    g_assert_cmpuint(total.pages_shared, ==, 512);
    assert_sums(p->s);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/vm/attach-child", test_attach_child);
    g_test_add_func("/vm/not-a-vm", test_not_a_vm);
    g_test_add("/vm/exit-mid-pass", Pair, NULL, pair_setup, test_exit_mid_pass, pair_teardown);
    g_test_add("/vm/region-vanishes", Pair, NULL, pair_setup, test_region_vanishes,
               pair_teardown);
    g_test_add("/vm/truncated-under-us", Pair, NULL, pair_setup, test_truncated_under_us,
               pair_teardown);
    return g_test_run();
}
