/*
 * scan-test.c - the scanner on synthetic guests with known layouts: the
 * counters must be exactly those KSM's rules give, pass after pass.
 * Guests are real memfds held by child processes, attached by pid.
 */
#include <fcntl.h>
#include <glib.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "extents.h"
#include "guestmem.h"
#include "jobs.h"
#include "scan-core.h" /* white-box: a VM's hints and counts (PfScanVm) */
#include "scan-helpers.h"
#include "scan.h"
#include "util.h"

/* Two 64 MiB guests (16384 pages each). */
static const PfLayout layout64 = {
    .identical = 8000, .duplicate = 500, .unique = 3000,
    .zero = 3000, .volatile_ = 1000, .holes = 884,
};

typedef struct {
    PfGuest *guest[2];
    int pid[2];
    PfScanner *scanner;
    PfCounters total;
    PfCounters vm[2];
} Fixture;

static void
collect(Fixture *f)
{
    PfCounters sum = { 0 };

    pf_scanner_collect(f->scanner, &f->total, f->vm);
    /* Per-VM figures add up exactly to the totals. */
    pf_counters_add(&sum, &f->vm[0]);
    pf_counters_add(&sum, &f->vm[1]);
    g_assert_cmpuint(sum.pages_shared, ==, f->total.pages_shared);
    g_assert_cmpuint(sum.pages_sharing, ==, f->total.pages_sharing);
    g_assert_cmpuint(sum.pages_unshared, ==, f->total.pages_unshared);
    g_assert_cmpuint(sum.pages_volatile, ==, f->total.pages_volatile);
    g_assert_cmpuint(sum.zero_pages, ==, f->total.zero_pages);
    g_assert_cmpuint(sum.pages_scanned, ==, f->total.pages_scanned);
    g_assert_cmpuint(sum.pages_skipped, ==, f->total.pages_skipped);
    g_assert_cmpint(sum.general_profit, ==, f->total.general_profit);
    g_assert_cmpuint(sum.metadata_bytes, ==, f->total.metadata_bytes);
}

static void
fixture_setup(Fixture *f, gconstpointer data)
{
    const PfLayout *l = data ? data : &layout64;

    for (int i = 0; i < 2; i++) {
        f->guest[i] = pf_guest_new("memory-backend-memfd", l, (guint32)i + 1);
        f->pid[i] = pf_guest_hold(f->guest[i]);
    }
    f->scanner = pf_scanner_new(NULL);
    for (int i = 0; i < 2; i++) {
        g_autoptr(GError) error = NULL;
        PfVm *vm = pf_vm_attach(f->pid[i], i == 0 ? "a" : "b", &error);

        g_assert_no_error(error);
        g_assert_cmpuint(vm->regions->len, ==, 1);
        pf_scanner_add_vm(f->scanner, vm);
    }
}

static void
fixture_teardown(Fixture *f, gconstpointer data)
{
    pf_scanner_free(f->scanner);
    for (int i = 0; i < 2; i++) {
        pf_guest_release(f->pid[i]);
        pf_guest_free(f->guest[i]);
    }
}

static void
pass_and_churn(Fixture *f)
{
    pf_scan_job_run_passes_wait(f->scanner, 1);
    pf_guest_churn(f->guest[0]);
    pf_guest_churn(f->guest[1]);
}

static void
test_two_guests(Fixture *f, gconstpointer data)
{
    const gsize written = 16384 - 884;

    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;

    /* Pass 1: every page is new, so its checksum "changed": all volatile. */
    pass_and_churn(f);
    collect(f);
    g_assert_cmpuint(f->total.full_scans, ==, 1);
    g_assert_cmpuint(f->total.pages_tracked, ==, 2 * written);
    g_assert_cmpuint(f->total.pages_volatile, ==, 2 * written);
    g_assert_cmpuint(f->total.pages_shared + f->total.pages_sharing +
                     f->total.pages_unshared + f->total.zero_pages, ==, 0);
    g_assert_cmpuint(f->total.pages_scanned, ==, 2 * written);

    /* Pass 2: stable checksums go to the trees.
     * identical: 8000 nodes of 2 pages.  duplicate: 1000 pages of one
     * content, max_page_sharing 256: nodes of 256+256+256+232.
     * unique: in the unstable tree.  volatile: rewritten, so volatile. */
    for (int pass = 2; pass <= 4; pass++) {
        pass_and_churn(f);
        collect(f);
        g_assert_cmpuint(f->total.full_scans, ==, pass);
        g_assert_cmpuint(f->total.pages_shared, ==, 8000 + 4);
        g_assert_cmpuint(f->total.pages_sharing, ==, 8000 + 996);
        g_assert_cmpuint(f->total.pages_unshared, ==, 2 * 3000);
        g_assert_cmpuint(f->total.zero_pages, ==, 2 * 3000);
        g_assert_cmpuint(f->total.pages_volatile, ==, 2 * 1000);
        g_assert_cmpuint(f->total.pages_skipped, ==, 0);
        g_assert_cmpuint(f->total.pages_scanned, ==, pass * 2 * written);

        /* Attribution: identical nodes count 1/2 to each VM; of the
         * duplicate nodes a has 1 + 244/256, b 12/256 + 2: a 4001.95,
         * b 4002.05, rounded by largest remainder to 4002 + 4002. */
        for (int v = 0; v < 2; v++) {
            g_assert_cmpuint(f->vm[v].pages_shared, ==, 4002);
            g_assert_cmpuint(f->vm[v].pages_sharing, ==, 8500 - 4002);
            g_assert_cmpuint(f->vm[v].pages_unshared, ==, 3000);
            g_assert_cmpuint(f->vm[v].zero_pages, ==, 3000);
            g_assert_cmpuint(f->vm[v].pages_volatile, ==, 1000);
            g_assert_cmpuint(f->vm[v].full_scans, ==, pass);
        }
    }
    /* KSM's general_profit: (sharing + zero) pages minus the metadata. */
    g_assert_cmpint(f->total.general_profit, ==,
                    (gint64)((8996 + 6000) * PF_PAGE_SIZE) - (gint64)f->total.metadata_bytes);
    g_assert_cmpuint(f->total.metadata_bytes, >=, 2 * 16384 * 16);
}

static void
test_smart_scan(Fixture *f, gconstpointer data)
{
    const gsize written = 16384 - 884;

    for (int pass = 1; pass <= 6; pass++) {
        pass_and_churn(f);
    }
    collect(f);
    /* Unique and volatile pages never merge: passes 0-2 visit them at full
     * rate; then every 2nd pass (3 skipped, 4 visited), then every 4th (5
     * skipped).  The counters keep their meaning while pages are skipped. */
    g_assert_cmpuint(f->total.pages_skipped, ==, 2 * 2 * (3000 + 1000));
    g_assert_cmpuint(f->total.pages_scanned, ==, 6 * 2 * written - 2 * 2 * 4000);
    g_assert_cmpuint(f->total.pages_shared, ==, 8004);
    g_assert_cmpuint(f->total.pages_sharing, ==, 8996);
    g_assert_cmpuint(f->total.pages_unshared, ==, 6000);
    g_assert_cmpuint(f->total.pages_volatile, ==, 2000);
}

/* A page that changes leaves its group, like a merged page on a write;
 * it comes back as soon as it is equal again. */
static void
test_leave_and_rejoin(Fixture *f, gconstpointer data)
{
    guint8 *page = f->guest[1]->mem; /* b's first identical page */
    g_autofree guint8 *saved = g_memdup2(page, PF_PAGE_SIZE);

    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;
    /* Without churn the "volatile" pages are stable and identical across
     * the guests too: 1000 more nodes of 2. */
    pf_scan_job_run_passes_wait(f->scanner, 2);
    collect(f);
    g_assert_cmpuint(f->total.pages_sharing, ==, 9996);

    page[100] ^= 0xff;
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    /* Its node keeps a's page: pages_shared stays, one sharer fewer. */
    g_assert_cmpuint(f->total.pages_shared, ==, 9004);
    g_assert_cmpuint(f->total.pages_sharing, ==, 9995);
    g_assert_cmpuint(f->vm[1].pages_volatile, ==, 1);

    /* Back to the node's content: it joins at once, as KSM's search of
     * the stable tree comes before its checksum test; its checksum
     * changed, which keeps a page only out of the unstable tree. */
    memcpy(page, saved, PF_PAGE_SIZE);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(f->total.pages_sharing, ==, 9996);
    g_assert_cmpuint(f->vm[1].pages_volatile, ==, 0);

    /* The first page of a node (its content provider) changes: the node
     * lives on with the other sharer providing the content. */
    f->guest[0]->mem[7] ^= 1;
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared, ==, 9004);
    g_assert_cmpuint(f->total.pages_sharing, ==, 9995);
    f->guest[0]->mem[7] ^= 1;
    pf_scan_job_run_passes_wait(f->scanner, 2);
    collect(f);
    g_assert_cmpuint(f->total.pages_sharing, ==, 9996);
}

/* A checksum anyone can collide: XOR of the page's 64-bit words.  Swapping
 * two words keeps it and changes the content. */
static guint64
weak_hash(const void *page)
{
    const guint64 *w = page;
    guint64 h = 0;

    for (gsize i = 0; i < PF_PAGE_SIZE / 8; i++) {
        h ^= w[i];
    }
    return h;
}

static void
swap_words(guint8 *page)
{
    guint64 a, b;

    memcpy(&a, page, 8);
    memcpy(&b, page + 8, 8);
    memcpy(page, &b, 8);
    memcpy(page + 8, &a, 8);
}

static const PfLayout layout_small = {
    .identical = 64, .unique = 64, .zero = 8, .volatile_ = 8, .holes = 256 - 144,
};

static void
test_forged_collision(Fixture *f, gconstpointer data)
{
    guint8 *a0 = f->guest[0]->mem;
    guint8 *b0 = f->guest[1]->mem;
    guint8 *b1 = f->guest[1]->mem + PF_PAGE_SIZE;
    PfScanInfo info;

    pf_scanner_set_hash_func(f->scanner, weak_hash);
    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;
    /* b's first page: a's first page with two words swapped.  Same weak
     * checksum, different content: they must never be grouped. */
    swap_words(b0);
    g_assert_cmpuint(weak_hash(a0), ==, weak_hash(b0));
    g_assert_cmpint(memcmp(a0, b0, PF_PAGE_SIZE), !=, 0);

    pf_scan_job_run_passes_wait(f->scanner, 3);
    collect(f);
    pf_scanner_get_info(f->scanner, &info);
    /* 63 identical and 8 unchurned volatile pages pair up. */
    g_assert_cmpuint(f->total.pages_shared, ==, 63 + 8);
    g_assert_cmpuint(f->total.pages_sharing, ==, 63 + 8);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * 64 + 2);
    g_assert_cmpuint(info.memcmp_calls, >, 0);

    /* A sharer rewritten to a colliding content keeps its checksum; the
     * memcmp with the provider still throws it out of the group. */
    swap_words(b1);
    g_assert_cmpuint(weak_hash(b1), ==, weak_hash(f->guest[0]->mem + PF_PAGE_SIZE));
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(f->total.pages_sharing, ==, 62 + 8);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * 64 + 3);
}

/* Volatile pages are identical across the guests at every generation, yet
 * they change between visits: never mergeable. */
static void
test_volatile_never_merge(Fixture *f, gconstpointer data)
{
    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;
    for (int pass = 0; pass < 5; pass++) {
        pass_and_churn(f);
        collect(f);
        g_assert_cmpuint(f->total.pages_volatile, ==, pass == 0 ? 2 * 144 : 2 * 8);
        g_assert_cmpuint(f->total.pages_shared + f->total.pages_sharing, ==,
                         pass == 0 ? 0 : 64 + 64);
    }
}

static void
test_use_zero_pages_off(Fixture *f, gconstpointer data)
{
    PfKnobs *k = pf_scanner_get_knobs(f->scanner);

    k->smart_scan = FALSE;
    k->use_zero_pages = FALSE;
    pf_scan_job_run_passes_wait(f->scanner, 2);
    collect(f);
    /* Zero pages merge like any other content: 16 pages, one node
     * (beside 64 + 8 nodes of identical and unchurned volatile pages). */
    g_assert_cmpuint(f->total.zero_pages, ==, 0);
    g_assert_cmpuint(f->total.pages_shared, ==, 64 + 8 + 1);
    g_assert_cmpuint(f->total.pages_sharing, ==, 64 + 8 + 15);
}

/* VMs in different merge domains share no page, however equal (zero pages
 * excepted: every VM has them); in the same one they do.  A VM that shares
 * pages keeps its domain: moving it would leave them shared across. */
static void
test_merge_domains(Fixture *f, gconstpointer data)
{
    GPtrArray *vms = pf_scanner_get_vms(f->scanner);
    PfVm *a = g_ptr_array_index(vms, 0), *b = g_ptr_array_index(vms, 1);
    g_autoptr(GError) error = NULL;

    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;
    g_assert_cmpstr(pf_scanner_merge_domain(f->scanner, a), ==, "default");
    g_assert_true(pf_scanner_set_merge_domain(f->scanner, a, "tenant-a", &error));
    g_assert_cmpstr(pf_scanner_merge_domain(f->scanner, a), ==, "tenant-a");
    pf_scan_job_run_passes_wait(f->scanner, 3);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared + f->total.pages_sharing, ==, 0);
    g_assert_cmpuint(f->total.zero_pages, ==, 2 * 8);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * (64 + 64 + 8));

    g_assert_true(pf_scanner_set_merge_domain(f->scanner, b, "tenant-a", &error));
    pf_scan_job_run_passes_wait(f->scanner, 2);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared, ==, 64 + 8);
    g_assert_cmpuint(f->total.pages_sharing, ==, 64 + 8);

    /* A third VM with the same content, in the default domain: it finds
     * a and b's nodes (the stable tree) and must not join them. */
    {
        PfGuest *g = pf_guest_new("memory-backend-memfd", data, 3);
        int pid = pf_guest_hold(g);
        PfVm *c = pf_vm_attach(pid, "c", &error);

        g_assert_no_error(error);
        pf_scanner_add_vm(f->scanner, c);
        pf_scan_job_run_passes_wait(f->scanner, 3);
        g_assert_cmpuint(c->scan->count[PF_PAGE_SHARED], ==, 0);
        g_assert_cmpuint(c->scan->count[PF_PAGE_UNSHARED], ==, 64 + 64 + 8);
        pf_scanner_detach(f->scanner, c, "test over");
        pf_guest_release(pid);
        pf_guest_free(g);
    }
    g_assert_false(pf_scanner_set_merge_domain(f->scanner, a, "default", &error));
    g_assert_error(error, PF_ERROR, PF_ERROR_EXISTS);
    g_assert_nonnull(strstr(error->message, "unmerge"));
    g_assert_cmpstr(pf_scanner_merge_domain(f->scanner, a), ==, "tenant-a");
    /* The same domain again is no change. */
    g_assert_true(pf_scanner_set_merge_domain(f->scanner, a, "tenant-a", NULL));
}

/* Smart scan backs off pages that keep failing to merge; put in the
 * domain of the pages they equal, they merge at the next passes, not
 * after the back-off they earned apart. */
static void
test_merge_domain_smart_scan(Fixture *f, gconstpointer data)
{
    GPtrArray *vms = pf_scanner_get_vms(f->scanner);
    PfVm *a = g_ptr_array_index(vms, 0), *b = g_ptr_array_index(vms, 1);

    g_assert_true(pf_scanner_get_knobs(f->scanner)->smart_scan);
    g_assert_true(pf_scanner_set_merge_domain(f->scanner, a, "tenant-a", NULL));
    pf_scan_job_run_passes_wait(f->scanner, 12);
    collect(f);
    g_assert_cmpuint(f->total.pages_skipped, >, 0);
    g_assert_cmpuint(f->total.pages_shared + f->total.pages_sharing, ==, 0);
    g_assert_true(pf_scanner_set_merge_domain(f->scanner, b, "tenant-a", NULL));
    pf_scan_job_run_passes_wait(f->scanner, 2);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared, ==, 64 + 8);
    g_assert_cmpuint(f->total.pages_sharing, ==, 64 + 8);
}

/* Smart scan backs off from a's pages while they have no partner; b
 * comes into a's domain after T passes, for every T modulo the longest
 * back-off.  Each of b's pages must still meet its equal in a within that
 * back-off: backed-off pages that were visited on passes out of step with
 * each other never met (2 in 9 of the T here). */
static void
test_smart_scan_late_partner(void)
{
    for (guint t = 13; t < 13 + 9; t++) {
        Fixture f = { 0 };
        GPtrArray *vms;

        fixture_setup(&f, &layout_small);
        vms = pf_scanner_get_vms(f.scanner);
        g_assert_true(pf_scanner_set_merge_domain(f.scanner, g_ptr_array_index(vms, 0),
                                                  "tenant-a", NULL));
        pf_scan_job_run_passes_wait(f.scanner, t);
        g_assert_true(pf_scanner_set_merge_domain(f.scanner, g_ptr_array_index(vms, 1),
                                                  "tenant-a", NULL));
        pf_scan_job_run_passes_wait(f.scanner, 9);
        collect(&f);
        g_test_message("b came after %u passes: %" G_GUINT64_FORMAT " pages shared", t,
                       f.total.pages_shared);
        g_assert_cmpuint(f.total.pages_shared, ==, 64 + 8);
        g_assert_cmpuint(f.total.pages_sharing, ==, 64 + 8);
        fixture_teardown(&f, &layout_small);
    }
}

/* Detaching a VM releases its pages from every node; the other VM's
 * counters stay exact. */
static void
test_detach(Fixture *f, gconstpointer data)
{
    PfVm *b;

    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;
    pf_scan_job_run_passes_wait(f->scanner, 2);
    b = pf_scanner_find_vm(f->scanner, "b");
    g_assert_nonnull(b);
    pf_scanner_remove_vm(f->scanner, b);
    pf_scanner_collect(f->scanner, &f->total, f->vm);
    /* a's identical (and unchurned volatile) pages are each alone in their
     * node now: like a KSM page left with one mapping, it stays. */
    g_assert_cmpuint(f->total.pages_shared, ==, 64 + 8);
    g_assert_cmpuint(f->total.pages_sharing, ==, 0);
    g_assert_cmpuint(f->vm[0].pages_shared, ==, 64 + 8);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    pf_scanner_collect(f->scanner, &f->total, f->vm);
    g_assert_cmpuint(f->total.pages_shared, ==, 64 + 8);
    g_assert_cmpuint(f->total.pages_unshared, ==, 64);
    g_assert_nonnull(pf_scanner_find_vm(f->scanner, "a"));
    g_assert_null(pf_scanner_find_vm(f->scanner, "b"));
}

/* One guest of layout l, attached by pid, and a scanner; smart scan off. */
static PfScanner *
lone_guest(const PfLayout *l, PfGuest **g, int *pid)
{
    g_autoptr(GError) error = NULL;
    PfScanner *s = pf_scanner_new(NULL);
    PfVm *vm;

    *g = pf_guest_new("memory-backend-memfd", l, 1);
    *pid = pf_guest_hold(*g);
    vm = pf_vm_attach(*pid, "lone", &error);
    g_assert_no_error(error);
    pf_scanner_add_vm(s, vm);
    pf_scanner_get_knobs(s)->smart_scan = FALSE;
    return s;
}

/* Whether pages [first, first + n) of the guest's memfd are all holes. */
static gboolean
all_holes(PfGuest *g, gsize first, gsize n)
{
    off_t data = lseek(g->fd, (off_t)(first * PF_PAGE_SIZE), SEEK_DATA);

    return data < 0 || data >= (off_t)((first + n) * PF_PAGE_SIZE);
}

/*
 * Pages the VMM discards (a balloon, free page reporting) while the
 * scanner is in the middle of their data extent are not read: reading a
 * hole of a memfd through a mapping allocates it again, which would undo
 * the balloon, and in advise mode change guest memory.  Nor is a
 * candidate of the unstable tree read after it was discarded.
 */
static void
test_discarded_not_read(void)
{
    /* Two equal pages first (a candidate and its match), then unique. */
    const PfLayout l = { .duplicate = 2, .unique = 4094 };
    PfGuest *g;
    int pid;
    PfScanner *s = lone_guest(&l, &g, &pid);

    pf_scan_job_run_passes_wait(s, 1);
    /* The second pass, a page in: page 0 is a candidate now, and the
     * cursor is inside the extent of data that holds every page. */
    g_assert_cmpuint(pf_test_scan(s, 1), ==, 1);
    g_assert_cmpint(fallocate(g->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                              PF_PAGE_SIZE), ==, 0);
    g_assert_cmpint(fallocate(g->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              1000 * PF_PAGE_SIZE, 100 * PF_PAGE_SIZE), ==, 0);
    pf_scan_job_run_passes_wait(s, 2);
    g_assert_true(all_holes(g, 0, 1));
    g_assert_true(all_holes(g, 1000, 100));
    pf_scanner_free(s);
    pf_guest_release(pid);
    pf_guest_free(g);
}

static guint dups_failed;

static int
dup_fails(int fd)
{
    dups_failed++;
    errno = EMFILE;
    return -1;
}

/*
 * The memfd's holes are read ahead on a thread, with descriptors of its
 * own; where none can be had (no descriptor left), the read is made on the
 * main loop, and the passes go on as ever (without that, the VM would wait
 * for a window no thread can read, and the passes with it).
 */
static void
test_window_read_fails(void)
{
    const PfLayout l = { .duplicate = 2, .unique = 100, .holes = 1000 };
    PfCounters total, vm;
    PfGuest *g;
    int pid;
    PfScanner *s = lone_guest(&l, &g, &pid);
    int (*was)(int) = pf_extents_dup;

    pf_extents_dup = dup_fails;
    pf_scan_job_run_passes_wait(s, 3);
    pf_extents_dup = was;
    g_assert_cmpuint(dups_failed, >=, 3);
    pf_scanner_collect(s, &total, &vm);
    g_assert_cmpuint(total.full_scans, ==, 3);
    g_assert_cmpuint(total.pages_tracked, ==, 102);
    g_assert_cmpuint(total.pages_shared, ==, 1);
    g_assert_cmpuint(total.pages_sharing, ==, 1);
    g_assert_cmpuint(total.pages_unshared, ==, 100);
    pf_scanner_free(s);
    pf_guest_release(pid);
    pf_guest_free(g);
}

/*
 * A window's copy-on-write look (extents.c), on this process as the VM:
 * holes of its memfd, some of them mapped privately from another file
 * (merged) and written (copied on write).  The look runs once across
 * holes with short data between them and again after long data, with
 * PAGEMAP_SCAN or pagemap entries; either way it reports the written pages
 * of holes, and neither a merged page not written, nor a hole mapped from
 * the memfd, nor a written page in data (a punch that did not free it).
 */
static void
test_extents_cow(gconstpointer method)
{
    const gsize n = 2048, holes[] = { 10, 11, 20, 1000, 1001, 2047 };
    const gsize merged[] = { 10, 15, 20, 500, 1000, 2047 };
    const gsize written[] = { 10, 15, 500, 1000, 2047 };
    int fd = memfd_create("extents-cow", MFD_CLOEXEC), pool = memfd_create("pool", MFD_CLOEXEC);
    int pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    g_autofree guint8 *page = g_malloc0(PF_PAGE_SIZE);
    g_autoptr(PfCow) cow = NULL;
    g_autoptr(PfExtents) x = NULL;
    PfRegion r = { .fd = fd, .n_pages = n, .size = n * PF_PAGE_SIZE };
    guint8 *mem;

    g_assert_cmpint(fd, >=, 0);
    g_assert_cmpint(pool, >=, 0);
    g_assert_cmpint(pagemap, >=, 0);
    if (g_strcmp0(method, "pagemap") == 0) {
        g_setenv("PAGEFOLD_NO_PAGEMAP_SCAN", "1", TRUE);
    }
    cow = pf_cow_new();
    g_unsetenv("PAGEFOLD_NO_PAGEMAP_SCAN");
    if (g_strcmp0(pf_cow_method(cow), method) != 0) {
        g_test_skip("this kernel has no PAGEMAP_SCAN");
        close(fd);
        close(pool);
        close(pagemap);
        return;
    }
    g_assert_cmpint(ftruncate(fd, (off_t)r.size), ==, 0);
    g_assert_cmpint(ftruncate(pool, (off_t)r.size), ==, 0);
    for (gsize i = 0; i < n; i++) {
        page[0] = (guint8)(i + 1);
        g_assert_cmpint(pwrite(fd, page, PF_PAGE_SIZE, (off_t)(i * PF_PAGE_SIZE)), ==,
                        PF_PAGE_SIZE);
    }
    mem = mmap(NULL, r.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    g_assert_true(mem != MAP_FAILED);
    r.host_addr = (guint64)(guintptr)mem;
    for (gsize i = 0; i < n; i++) {
        (void)*(volatile guint8 *)(mem + i * PF_PAGE_SIZE); /* mapped, as QEMU's RAM is */
    }
    for (guint i = 0; i < G_N_ELEMENTS(merged); i++) {
        g_assert_true(mmap(mem + merged[i] * PF_PAGE_SIZE, PF_PAGE_SIZE, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_FIXED, pool, 0) != MAP_FAILED);
        (void)*(volatile guint8 *)(mem + merged[i] * PF_PAGE_SIZE);
    }
    for (guint i = 0; i < G_N_ELEMENTS(written); i++) {
        mem[written[i] * PF_PAGE_SIZE] = 0x5a;
    }
    for (guint i = 0; i < G_N_ELEMENTS(holes); i++) {
        g_assert_cmpint(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                  (off_t)(holes[i] * PF_PAGE_SIZE), PF_PAGE_SIZE), ==, 0);
    }
    x = pf_extents_read(&r, pagemap, cow, 0);
    g_assert_cmpuint(x->to, ==, n);
    g_assert_cmpuint(x->cow->len, ==, 3);
    g_assert_cmpuint(g_array_index(x->cow, PfCowSeen, 0).page, ==, 10);
    g_assert_cmpuint(g_array_index(x->cow, PfCowSeen, 1).page, ==, 1000);
    g_assert_cmpuint(g_array_index(x->cow, PfCowSeen, 2).page, ==, 2047);
    munmap(mem, r.size);
    close(fd);
    close(pool);
    close(pagemap);
}

/*
 * What pagefoldd keeps for a VM follows the pages present, not the size of
 * its RAM: a mostly empty 1 GiB guest costs little, and a guest whose RAM
 * is given back costs less again (the unstable tree shrinks too).
 */
static void
test_metadata_follows_pages(void)
{
    const PfLayout l = { .unique = 16384, .holes = 262144 - 16384 };
    PfCounters total, vm;
    PfGuest *g;
    int pid;
    PfScanner *s = lone_guest(&l, &g, &pid);
    guint64 full;

    pf_scan_job_run_passes_wait(s, 3);
    pf_scanner_collect(s, &total, &vm);
    g_assert_cmpuint(total.pages_tracked, ==, 16384);
    g_test_message("%" G_GUINT64_FORMAT " bytes of metadata for %" G_GUINT64_FORMAT
                   " pages present of 262144", total.metadata_bytes, total.pages_tracked);
    /* 8 bytes a record, the unstable tree's entries, a pointer per 2 MiB. */
    g_assert_cmpuint(total.metadata_bytes, <, 32 * total.pages_tracked);
    full = total.metadata_bytes;

    /* All but the first 1024 pages given back. */
    g_assert_cmpint(fallocate(g->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              1024 * PF_PAGE_SIZE, 15360 * PF_PAGE_SIZE), ==, 0);
    pf_scan_job_run_passes_wait(s, 3);
    pf_scanner_collect(s, &total, &vm);
    g_assert_cmpuint(total.pages_tracked, ==, 1024);
    g_test_message("then %" G_GUINT64_FORMAT " bytes for %" G_GUINT64_FORMAT " pages",
                   total.metadata_bytes, total.pages_tracked);
    g_assert_cmpuint(total.metadata_bytes, <, full / 8);
    pf_scanner_free(s);
    pf_guest_release(pid);
    pf_guest_free(g);
}

/*
 * pages_to_scan counts the pages present, as KSM's does: a wake-up of 50
 * pages in a guest with 100 pages in 256 MiB of RAM (the rest never touched)
 * visits 50 of them, wherever the holes are, so a pass takes two or three
 * wake-ups, not one per 50 pages of holes.
 */
static void
test_pace_present_pages(void)
{
    const PfLayout l = { .duplicate = 2, .unique = 98, .holes = 65536 - 100 };
    PfCounters total, vm;
    PfGuest *g;
    int pid;
    PfScanner *s = lone_guest(&l, &g, &pid);
    guint calls = 0;

    pf_scan_job_run_passes_wait(s, 2);
    pf_scanner_collect(s, &total, &vm);
    g_assert_cmpuint(total.full_scans, ==, 2);
    while (total.full_scans == 2) {
        g_assert_cmpuint(pf_test_scan(s, 50), <=, 50);
        pf_scanner_collect(s, &total, &vm);
        g_assert_cmpuint(++calls, <=, 10);
    }
    g_test_message("a pass over 100 pages present in %u wake-ups of 50", calls);
    g_assert_cmpuint(calls, <=, 3);
    g_assert_cmpuint(total.pages_scanned, ==, 3 * 100);
    pf_scanner_free(s);
    pf_guest_release(pid);
    pf_guest_free(g);
}

static void
on_resting(PfScanner *s, gboolean resting, gpointer user)
{
    g_array_append_val((GArray *)user, resting);
}

static const PfScanEvents rest_events = { .resting = on_resting };

static gboolean
last_said(GArray *said)
{
    return said->len > 0 && g_array_index(said, gboolean, said->len - 1);
}

/* Turns of the main loop, each waiting for the next thing due (a tick). */
static void
turns(guint n)
{
    for (guint i = 0; i < n; i++) {
        g_main_context_iteration(NULL, TRUE);
    }
}

static guint64
scanned(Fixture *f)
{
    collect(f);
    return f->total.pages_scanned;
}

/*
 * Between background batches the scanner says it rests, so that the
 * agents' answers need not wake pagefoldd on their own; it says it wakes
 * before it scans again, and lets the loop turn once first (the answers'
 * readers come before it); and it never rests while something waits for
 * answers (a job's passes, an unmerge), nor over a long sleep.
 */
static void
test_resting(Fixture *f, gconstpointer data)
{
    PfKnobs *k = pf_scanner_get_knobs(f->scanner);
    PfVm *vm = g_ptr_array_index(pf_scanner_get_vms(f->scanner), 0);
    g_autoptr(GArray) said = g_array_new(FALSE, FALSE, sizeof(gboolean));
    guint64 before;
    gint64 end;

    k->sleep_millisecs = 1;
    pf_scanner_add_listener(f->scanner, &rest_events, said, NULL);
    pf_scanner_start(f->scanner);
    /* Its first wake-ups only start reading the VMs, on threads. */
    while (!last_said(said) || scanned(f) == 0) {
        turns(1);
    }
    before = scanned(f);
    while (last_said(said)) {
        turns(1);
    }
    g_assert_cmpuint(scanned(f), ==, before); /* awake, not yet scanning */
    while (!last_said(said)) {
        turns(1);
    }
    g_assert_cmpuint(scanned(f), >, before);

    /* A job's passes read answers from the start. */
    pf_scanner_pause_batches(f->scanner);
    g_assert_false(last_said(said));
    turns(20);
    g_assert_false(last_said(said));
    pf_scanner_resume_batches(f->scanner);
    while (!last_said(said)) {
        turns(1);
    }

    /* So does an unmerge. */
    pf_scanner_begin_unmerge(f->scanner, vm);
    g_assert_false(last_said(said));
    turns(20);
    g_assert_false(last_said(said));
    pf_scanner_end_unmerge(f->scanner, vm);
    while (!last_said(said)) {
        turns(1);
    }

    /* Over a long sleep, answers are read as they come: after the rest
     * begun at 1 ms, never again (the loop also turns for the VMs' reads,
     * so the check goes on for more than two sleeps). */
    k->sleep_millisecs = 200;
    while (last_said(said)) {
        turns(1);
    }
    end = g_get_monotonic_time() + 500 * G_TIME_SPAN_MILLISECOND;
    while (g_get_monotonic_time() < end) {
        turns(1);
        g_assert_false(last_said(said));
    }
    k->sleep_millisecs = 1;
    while (!last_said(said)) {
        turns(1);
    }
    pf_scanner_stop(f->scanner);
    g_assert_false(last_said(said));
    pf_scanner_remove_listener(f->scanner, &rest_events, said);
}

/* One content many times over: 2 x 2048 pages of it, and pages of each
 * guest's own. */
static const PfLayout layout_dups = { .duplicate = 2048, .unique = 16 };

static guint64
nodes_examined(Fixture *f)
{
    PfScanInfo info;

    pf_scanner_get_info(f->scanner, &info);
    return info.stable_nodes_examined;
}

/*
 * max_page_sharing splits one content into many nodes of one checksum
 * (KSM chains them as "dups").  A lookup must cost the same however many
 * of them are full: it looks at the node that can take the page, not at
 * each full one (that made a pass over n copies cost n^2 / 2m).  A full
 * node that loses a sharer takes one again; raising the knob opens every
 * full node to more.
 */
static void
test_full_nodes(Fixture *f, gconstpointer data)
{
    PfKnobs *k = pf_scanner_get_knobs(f->scanner);
    const guint m = 4, copies = 2 * 2048, nodes = copies / m;
    guint8 *page = f->guest[0]->mem + 1000 * PF_PAGE_SIZE; /* a copy */
    guint8 *own = f->guest[1]->mem + 2048 * PF_PAGE_SIZE;  /* b's first own page */
    g_autofree guint8 *saved = g_memdup2(page, PF_PAGE_SIZE);
    guint64 before;

    k->smart_scan = FALSE;
    k->max_page_sharing = m;
    pf_scan_job_run_passes_wait(f->scanner, 1);
    before = nodes_examined(f);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared, ==, nodes);
    g_assert_cmpuint(f->total.pages_sharing, ==, copies - nodes);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * 16);
    /* Pages come in fours: two pair up in the unstable tree, the next two
     * find their node, which is full then. */
    g_test_message("merging %u copies looked at %" G_GUINT64_FORMAT " nodes", copies,
                   nodes_examined(f) - before);
    g_assert_cmpuint(nodes_examined(f) - before, <=, copies / 2);

    /* A sharer leaves, and comes back: to the node it left, the only
     * one of that content with room, in one look. */
    page[0] ^= 1;
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared, ==, nodes);
    g_assert_cmpuint(f->total.pages_sharing, ==, copies - nodes - 1);
    /* Its content back, it joins at its first visit: the stable tree is
     * searched before its checksum is judged. */
    memcpy(page, saved, PF_PAGE_SIZE);
    before = nodes_examined(f);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(nodes_examined(f) - before, ==, 1);
    g_assert_cmpuint(f->total.pages_shared, ==, nodes);
    g_assert_cmpuint(f->total.pages_sharing, ==, copies - nodes);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * 16);

    /* More sharers allowed: a new copy, with no twin in the unstable
     * tree, joins a node that was full. */
    k->max_page_sharing = 2 * m;
    memcpy(own, saved, PF_PAGE_SIZE);
    pf_scan_job_run_passes_wait(f->scanner, 2);
    collect(f);
    g_assert_cmpuint(f->total.pages_shared, ==, nodes);
    g_assert_cmpuint(f->total.pages_sharing, ==, copies - nodes + 1);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * 16 - 1);
}

/* The last 256 pages of each guest's 4096 hold the same content. */
static const PfLayout layout_tail = { .unique = 4096 };

static void
same_tail(Fixture *f)
{
    for (int i = 0; i < 2; i++) {
        for (gsize k = 4096 - 256; k < 4096; k++) {
            pf_fill_page(f->guest[i]->mem + k * PF_PAGE_SIZE, 0x7a11000 + k);
        }
    }
}

/*
 * Pages an agent says a device just wrote (disk reads: HINT) are visited
 * before the cursor's, and enter the unstable tree at that first visit:
 * the two guests' copies at the end of their RAM merge while the cursor
 * is still at the start of the first guest.  With io_hints 0 they wait for
 * the cursor.  The cursor passes by the pages the hints had it visit in
 * this pass, and a VM's hints are kept only up to a bound.
 */
static void
test_hinted_first(Fixture *f, gconstpointer data)
{
    PfKnobs *k = pf_scanner_get_knobs(f->scanner);
    PfVm *a = g_ptr_array_index(pf_scanner_get_vms(f->scanner), 0);
    PfVm *b = g_ptr_array_index(pf_scanner_get_vms(f->scanner), 1);

    same_tail(f);
    k->smart_scan = FALSE;
    k->io_hints = FALSE;
    pf_scanner_hinted(f->scanner, a, 0, 4096 - 256, 256);
    pf_scanner_hinted(f->scanner, b, 0, 4096 - 256, 256);
    for (int i = 0; i < 8; i++) {
        pf_test_scan(f->scanner, 128);
    }
    collect(f);
    g_assert_cmpuint(f->total.pages_hinted, ==, 0);
    g_assert_cmpuint(f->total.pages_sharing, ==, 0);
    g_assert_cmpuint(f->total.full_scans, ==, 0);

    k->io_hints = TRUE;
    pf_scanner_hinted(f->scanner, a, 0, 4096 - 256, 128);
    /* Reads one after another make one range. */
    pf_scanner_hinted(f->scanner, a, 0, 4096 - 128, 128);
    pf_scanner_hinted(f->scanner, b, 0, 4096 - 256, 256);
    g_assert_cmpuint(a->scan->hints->len, ==, 1);
    /* Up to half of each call's budget for hints, a VM's range at a
     * time: the cursor, at the other half, is still in the first guest. */
    for (int i = 0; i < 32 && f->total.pages_hinted < 512; i++) {
        pf_test_scan(f->scanner, 128);
        collect(f);
    }
    g_assert_cmpuint(f->total.pages_hinted, ==, 512);
    g_assert_cmpuint(f->total.pages_shared, ==, 256);
    g_assert_cmpuint(f->total.pages_sharing, ==, 256);
    g_assert_cmpuint(f->total.full_scans, ==, 0);
    g_assert_cmpuint(f->total.pages_scanned - 512, <, 4096 - 256);

    /* Hinted again (a device wrote it again): visited again. */
    pf_scanner_hinted(f->scanner, a, 0, 4096 - 256, 1);
    for (int i = 0; i < 4 && a->scan->hint_pages > 0; i++) {
        pf_test_scan(f->scanner, 128);
    }
    collect(f);
    g_assert_cmpuint(a->scan->hint_pages, ==, 0);
    g_assert_cmpuint(f->total.pages_hinted, ==, 513);
    g_assert_cmpuint(f->total.pages_sharing, ==, 256);

    /* The rest of the pass: every page once, the hinted ones not again. */
    while (f->total.full_scans == 0) {
        pf_test_scan(f->scanner, 4096);
        collect(f);
    }
    g_assert_cmpuint(f->total.full_scans, ==, 1);
    g_assert_cmpuint(f->total.pages_scanned, ==, 2 * 4096 + 1);
    g_assert_cmpuint(f->total.pages_volatile, ==, 2 * (4096 - 256));
    g_assert_cmpuint(f->total.pages_sharing, ==, 256);
    /* The next pass visits them as any other. */
    pf_scan_job_run_passes_wait(f->scanner, 1);
    collect(f);
    g_assert_cmpuint(f->total.pages_scanned, ==, 4 * 4096 + 1);
    g_assert_cmpuint(f->total.pages_sharing, ==, 256);
    g_assert_cmpuint(f->total.pages_unshared, ==, 2 * (4096 - 256));

    /* A flood: 256 MiB of hints are kept, the rest counted. */
    for (int i = 0; i < 300; i++) {
        pf_scanner_hinted(f->scanner, a, 0, 0, 256);
    }
    collect(f);
    g_assert_cmpuint(f->vm[0].hints_dropped, ==, 300 * 256 - 65536);
    g_assert_cmpuint(a->scan->hint_pages, ==, 65536);
    /* Visited at up to half of each scan's pages (more while the cursor
     * waits for a look at a VM), while the cursor goes on. */
    for (int i = 0; i < 8; i++) {
        pf_test_scan(f->scanner, 128);
    }
    collect(f);
    g_assert_cmpuint(f->total.pages_hinted - 513, >, 0);
    g_assert_cmpuint(f->total.pages_scanned - 4 * 4096 - 1, >, f->total.pages_hinted - 513);
    g_assert_cmpuint(a->scan->hint_pages, <, 65536);
    /* A budget of 1 is the cursor's. */
    {
        guint64 hinted = f->total.pages_hinted, scanned = f->total.pages_scanned;

        for (int i = 0; i < 16; i++) {
            pf_test_scan(f->scanner, 1);
        }
        collect(f);
        g_assert_cmpuint(f->total.pages_hinted, ==, hinted);
        g_assert_cmpuint(f->total.pages_scanned, >, scanned);
    }
    /* A range is taken as far as it fits, the rest counted. */
    pf_scanner_hinted(f->scanner, b, 0, 0, 65536 + 10);
    g_assert_cmpuint(b->scan->hint_pages, ==, 65536);
    collect(f);
    g_assert_cmpuint(f->vm[1].hints_dropped, ==, 10);
    /* An unmerge forgets them; so does io_hints=0, at the next scan. */
    pf_scanner_begin_unmerge(f->scanner, a);
    pf_scanner_end_unmerge(f->scanner, a);
    g_assert_cmpuint(a->scan->hint_pages, ==, 0);
    k->io_hints = FALSE;
    pf_test_scan(f->scanner, 128);
    g_assert_cmpuint(b->scan->hint_pages, ==, 0);
}

/* The pages a VM's queue of hints holds, counted range by range. */
static gsize
queued_pages(const PfVm *vm)
{
    gsize n = 0;

    for (guint i = vm->scan->hint_head; i < vm->scan->hints->len; i++) {
        n += g_array_index(vm->scan->hints, PfHint, i).n_pages;
    }
    return n;
}

/*
 * Hints that come as fast as they go: the queue is never empty, so it
 * never starts over; the ranges visited go once they are most of it (or
 * 1024), whatever the VM sends.  Every page queued is visited once.
 */
static void
test_hint_queue_kept(Fixture *f, gconstpointer data)
{
    PfKnobs *k = pf_scanner_get_knobs(f->scanner);
    PfVm *a = g_ptr_array_index(pf_scanner_get_vms(f->scanner), 0);
    guint64 sent = 0, page = 0;
    gboolean compacted = FALSE;

    same_tail(f);
    k->smart_scan = FALSE;
    for (int round = 0; round < 100; round++) {
        guint head = a->scan->hint_head;
        /* Kept at 2000 or more (a scan takes at most its 256), so never
         * emptied nor over PF_HINT_RANGES. */
        gsize add = 32 + (a->scan->hint_pages < 2000 ? 2000 - a->scan->hint_pages : 0);

        /* Pages two apart, before the guests' common tail: unique
         * ranges of one page that never join, each visited as hinted. */
        for (gsize i = 0; i < add; i++, page = (page + 2) % (4096 - 256), sent++) {
            pf_scanner_hinted(f->scanner, a, 0, page, 1);
        }
        pf_test_scan(f->scanner, 256);
        g_assert_cmpuint(a->scan->hint_pages, >, 0);
        g_assert_cmpuint(queued_pages(a), ==, a->scan->hint_pages);
        /* What visit_hinted() keeps after every range it visits. */
        g_assert_cmpuint(a->scan->hint_head, <,
                         MAX(1024u, a->scan->hints->len - a->scan->hint_head));
        compacted |= a->scan->hint_head < head;
    }
    g_assert_true(compacted);
    while (a->scan->hint_pages > 0) {
        pf_test_scan(f->scanner, 256);
    }
    collect(f);
    g_assert_cmpuint(f->vm[0].hints_dropped, ==, 0);
    g_assert_cmpuint(f->vm[0].pages_hinted, ==, sent);
    g_assert_cmpuint(a->scan->hints->len, ==, 0);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add("/scan/two-guests-64mib", Fixture, NULL, fixture_setup, test_two_guests,
               fixture_teardown);
    g_test_add("/scan/smart-scan", Fixture, NULL, fixture_setup, test_smart_scan,
               fixture_teardown);
    g_test_add("/scan/leave-and-rejoin", Fixture, NULL, fixture_setup, test_leave_and_rejoin,
               fixture_teardown);
    g_test_add("/scan/forged-collision", Fixture, &layout_small, fixture_setup,
               test_forged_collision, fixture_teardown);
    g_test_add("/scan/volatile-never-merge", Fixture, &layout_small, fixture_setup,
               test_volatile_never_merge, fixture_teardown);
    g_test_add("/scan/use-zero-pages-off", Fixture, &layout_small, fixture_setup,
               test_use_zero_pages_off, fixture_teardown);
    g_test_add("/scan/merge-domains", Fixture, &layout_small, fixture_setup,
               test_merge_domains, fixture_teardown);
    g_test_add("/scan/merge-domain-smart-scan", Fixture, &layout_small, fixture_setup,
               test_merge_domain_smart_scan, fixture_teardown);
    g_test_add_func("/scan/smart-scan-late-partner", test_smart_scan_late_partner);
    g_test_add("/scan/detach", Fixture, &layout_small, fixture_setup, test_detach,
               fixture_teardown);
    g_test_add("/scan/full-nodes", Fixture, &layout_dups, fixture_setup, test_full_nodes,
               fixture_teardown);
    g_test_add_func("/scan/discarded-not-read", test_discarded_not_read);
    g_test_add_func("/scan/metadata-follows-pages", test_metadata_follows_pages);
    g_test_add_func("/scan/window-read-fails", test_window_read_fails);
    g_test_add_data_func("/scan/extents-cow/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_extents_cow);
    g_test_add_data_func("/scan/extents-cow/pagemap", "pagemap", test_extents_cow);
    g_test_add_func("/scan/pace-present-pages", test_pace_present_pages);
    g_test_add("/scan/resting", Fixture, &layout_small, fixture_setup, test_resting,
               fixture_teardown);
    g_test_add("/scan/hinted-first", Fixture, &layout_tail, fixture_setup, test_hinted_first,
               fixture_teardown);
    g_test_add("/scan/hint-queue-kept", Fixture, &layout_tail, fixture_setup,
               test_hint_queue_kept, fixture_teardown);
    return g_test_run();
}
