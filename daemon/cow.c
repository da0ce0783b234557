/*
 * cow.c - copy-on-write found from outside a VM's process (cow.h): reads
 * its pagemap and the page flags of the frames it names, nothing else of
 * it, and never decides what a written page becomes (the scanner does).
 *
 * What a merged page's page table entry can be, in the VM's process, and
 * what each means:
 *   - none: never touched since the merge (or a clean pool page dropped
 *     by reclaim): not written;
 *   - present, a file page: the pool slot itself: not written;
 *   - present, anonymous: a copy made on write.  Mapped once it is the
 *     guest's private page; mapped more than once, host KSM merged it with
 *     other anonymous pages of the same content (a process whose new
 *     mappings are mergeable: PR_SET_MEMORY_MERGE, systemd's MemoryKSM=);
 *   - present, the kernel's zero page: a copy of zeros that host KSM merged
 *     with use_zero_pages=1 (or, where the kernel maps it on read faults,
 *     a zero slot only read).  The caller knows which the page was: a zero
 *     page still reads zero, a shared page was overwritten with zeros;
 *   - a swap entry: an anonymous copy swapped out (file pages are never
 *     swap entries in a process; a file page being migrated shows as a
 *     migration entry whose page is not anonymous, which pagemap marks
 *     "file");
 *   - a uffd-wp marker: the agent write-protected a window of guest RAM
 *     around a merge (its exec_window()), which leaves a marker in every
 *     entry of a shmem mapping that was none, pool mappings included.  It
 *     reads as swapped out, but is not written: PAGEMAP_SCAN does not call
 *     it WRITTEN, pagemap sets its uffd-wp bit.  An anonymous copy swapped
 *     out while so protected looks the same; the protection is lifted as
 *     the window ends, and the next look sees it.
 * Other markers (guard regions, poisoned entries) are not made in guest
 * RAM by QEMU or the agent.
 */
#include "cow.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "util.h"

/* PAGEMAP_SCAN (Linux 6.7); Debian 12's headers are 6.1's. */
struct pf_pm_scan_arg {
    guint64 size, flags, start, end, walk_end, vec, vec_len, max_pages;
    guint64 category_inverted, category_mask, category_anyof_mask, return_mask;
};
struct pf_page_region {
    guint64 start, end, categories;
};
#define PF_PAGEMAP_SCAN _IOWR('f', 16, struct pf_pm_scan_arg)
#define PF_PAGE_IS_WRITTEN (1ull << 1)
#define PF_PAGE_IS_FILE (1ull << 2)
#define PF_PAGE_IS_PRESENT (1ull << 3)
#define PF_PAGE_IS_SWAPPED (1ull << 4)
#define PF_PAGE_IS_PFNZERO (1ull << 5)

/* /proc/PID/pagemap entries (Documentation/admin-guide/mm/pagemap.rst). */
#define PM_PRESENT (1ull << 63)
#define PM_SWAP (1ull << 62)
#define PM_FILE (1ull << 61)
#define PM_UFFD_WP (1ull << 57)
#define PM_MMAP_EXCLUSIVE (1ull << 56)
#define PM_PFN_MASK ((1ull << 55) - 1)
/* /proc/kpageflags */
#define KPF_ZERO_PAGE (1ull << 24)

struct _PfCow {
    gboolean pagemap_scan; /* the kernel has PAGEMAP_SCAN */
    int kpageflags_fd;     /* to tell the zero page from a KSM page */
};

PfCow *
pf_cow_new(void)
{
    PfCow *c = g_atomic_rc_box_new0(PfCow);
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    struct pf_page_region v;
    struct pf_pm_scan_arg arg = {
        .size = sizeof(arg), .start = (guint64)(guintptr)&v & ~(guint64)(PF_PAGE_SIZE - 1),
        .vec = (guint64)(guintptr)&v, .vec_len = 1, .return_mask = PF_PAGE_IS_PRESENT,
    };

    arg.end = arg.start + PF_PAGE_SIZE;
    c->pagemap_scan = fd >= 0 && ioctl(fd, PF_PAGEMAP_SCAN, &arg) >= 0 &&
                      !g_getenv("PAGEFOLD_NO_PAGEMAP_SCAN");
    if (fd >= 0) {
        close(fd);
    }
    c->kpageflags_fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
    return c;
}

static void
cow_clear(PfCow *c)
{
    if (c->kpageflags_fd >= 0) {
        close(c->kpageflags_fd);
    }
}

PfCow *
pf_cow_ref(PfCow *c)
{
    return g_atomic_rc_box_acquire(c);
}

void
pf_cow_free(PfCow *c)
{
    if (c != NULL) {
        g_atomic_rc_box_release_full(c, (GDestroyNotify)cow_clear);
    }
}

const char *
pf_cow_method(const PfCow *c)
{
    return c->pagemap_scan ? "PAGEMAP_SCAN" : "pagemap";
}

/*
 * One ioctl finds the pages of a range that are not file pages but are
 * present or swap entries.  Where it fails part way, *done says how far
 * it got.
 */
static gboolean
find_scan(int pagemap_fd, guint64 host_addr, gsize from, gsize to, PfCowFunc found,
          gpointer user, gsize *done)
{
    struct pf_page_region vec[256];
    guint64 start = host_addr + from * PF_PAGE_SIZE, end = host_addr + to * PF_PAGE_SIZE;

    while (start < end) {
        struct pf_pm_scan_arg arg = {
            .size = sizeof(arg), .start = start, .end = end,
            .vec = (guint64)(guintptr)vec, .vec_len = G_N_ELEMENTS(vec),
            .category_inverted = PF_PAGE_IS_FILE,
            .category_mask = PF_PAGE_IS_FILE,
            .category_anyof_mask = PF_PAGE_IS_PRESENT | PF_PAGE_IS_SWAPPED,
            .return_mask = PF_PAGE_IS_PRESENT | PF_PAGE_IS_SWAPPED | PF_PAGE_IS_PFNZERO |
                           PF_PAGE_IS_WRITTEN,
        };
        long n = ioctl(pagemap_fd, PF_PAGEMAP_SCAN, &arg);

        if (n < 0) {
            *done = (gsize)((start - host_addr) / PF_PAGE_SIZE);
            return FALSE;
        }
        for (long k = 0; k < n; k++) {
            guint64 cat = vec[k].categories;

            if ((cat & PF_PAGE_IS_SWAPPED) && !(cat & PF_PAGE_IS_WRITTEN)) {
                continue; /* a uffd-wp marker (see above) */
            }
            for (guint64 a = vec[k].start; a < vec[k].end; a += PF_PAGE_SIZE) {
                found((gsize)((a - host_addr) / PF_PAGE_SIZE), (cat & PF_PAGE_IS_PFNZERO) != 0,
                      user);
            }
        }
        start = arg.walk_end > start ? arg.walk_end : end;
    }
    *done = to;
    return TRUE;
}

/* Is the present anonymous page of this entry the zero page?  A page
 * mapped once is not (the zero page is never counted as mapped); else the
 * frame's flags say, if pagemap shows frames and kpageflags can be read
 * (both need CAP_SYS_ADMIN).  Unknown reads as "may be". */
static gboolean
maps_zero_pfn(PfCow *c, guint64 e)
{
    guint64 pfn = e & PM_PFN_MASK, flags = 0;

    if (e & PM_MMAP_EXCLUSIVE) {
        return FALSE;
    }
    if (pfn == 0 || c->kpageflags_fd < 0 ||
        pread(c->kpageflags_fd, &flags, sizeof(flags), (off_t)(pfn * sizeof(flags))) !=
            sizeof(flags)) {
        return TRUE;
    }
    return (flags & KPF_ZERO_PAGE) != 0;
}

/* The same from pagemap entries, as on kernels before 6.7. */
static gboolean
find_entries(PfCow *c, int pagemap_fd, guint64 host_addr, gsize from, gsize to, PfCowFunc found,
             gpointer user)
{
    while (from < to) {
        guint64 entries[512];
        gsize n = MIN(to - from, G_N_ELEMENTS(entries));
        ssize_t got = pread(pagemap_fd, entries, n * sizeof(guint64),
                            (off_t)((host_addr / PF_PAGE_SIZE + from) * sizeof(guint64)));

        if (got != (ssize_t)(n * sizeof(guint64))) {
            return FALSE;
        }
        for (gsize i = 0; i < n; i++) {
            guint64 e = entries[i];

            if (e & PM_FILE) {
                continue;
            }
            if (e & PM_PRESENT) {
                found(from + i, maps_zero_pfn(c, e), user);
            } else if ((e & PM_SWAP) && !(e & PM_UFFD_WP)) {
                found(from + i, FALSE, user);
            }
        }
        from += n;
    }
    return TRUE;
}

gboolean
pf_cow_find(PfCow *c, int pagemap_fd, guint64 host_addr, gsize from, gsize to, PfCowFunc found,
            gpointer user)
{
    gsize done = from;

    if (pagemap_fd < 0) {
        return FALSE;
    }
    if (c->pagemap_scan && find_scan(pagemap_fd, host_addr, from, to, found, user, &done)) {
        return TRUE;
    }
    /* What the ioctl did not cover, the entries tell. */
    return find_entries(c, pagemap_fd, host_addr, done, to, found, user);
}
