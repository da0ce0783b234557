/*
 * scan-huge.c - transparent huge pages.  Merging a page of a huge page
 * splits it; once no page of that 2 MiB extent is merged any more, it is
 * collapsed into a huge page again (MADV_COLLAPSE): by the agent, which
 * alone can lift its write protection, or, for a VM attached by pid,
 * through process_madvise().  Owns the per-extent marks only, and asks
 * nothing of an agent itself; a failure here costs a huge page, never a
 * guest write.
 */
#include "scan-core.h"

#include <errno.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

#define HUGE_SHIFT 21
#define HUGE_PAGES (1u << (HUGE_SHIFT - PF_PAGE_SHIFT))
#define KPF_THP (1ull << 22)
#define PAGEMAP_PRESENT (1ull << 63)
#define PAGEMAP_PFN_MASK ((1ull << 55) - 1)

/* Extents of 2 MiB are counted from the region's first 2 MiB-aligned
 * address; a region not aligned so never had huge pages to restore. */
static gboolean
extent_of(PfRegion *r, gsize idx, gsize *extent)
{
    if (r->host_addr % (1u << HUGE_SHIFT) != 0 || r->file_offset % (1u << HUGE_SHIFT) != 0) {
        return FALSE;
    }
    *extent = idx / HUGE_PAGES;
    return (*extent + 1) * HUGE_PAGES <= r->n_pages;
}

void
huge_note(PfScanner *s, PfRegion *r, gsize idx)
{
    gsize e;
    guint64 entry = 0, flags = 0;
    off_t at;

    if (!extent_of(r, idx, &e) || (r->huge_seen[e / 8] & (1u << (e % 8))) ||
        setup_of(s)->kpageflags_fd < 0 || r->vm->pagemap_fd < 0) {
        return;
    }
    r->huge_seen[e / 8] |= 1u << (e % 8);
    at = (off_t)((r->host_addr / PF_PAGE_SIZE + e * HUGE_PAGES) * sizeof(guint64));
    if (pread(r->vm->pagemap_fd, &entry, sizeof(entry), at) == sizeof(entry) &&
        (entry & PAGEMAP_PRESENT) &&
        pread(setup_of(s)->kpageflags_fd, &flags, sizeof(flags),
              (off_t)((entry & PAGEMAP_PFN_MASK) * sizeof(guint64))) == sizeof(flags) &&
        (flags & KPF_THP)) {
        r->huge_was[e / 8] |= 1u << (e % 8);
    }
}

/* Whether no page of extent e is merged, or on its way in or out. */
static gboolean
extent_unmerged(PfRegion *r, gsize e)
{
    for (gsize i = e * HUGE_PAGES; i < (e + 1) * HUGE_PAGES; i++) {
        PfPageState st = pf_region_page_state(r, i);

        if (st == PF_PAGE_PENDING ||
            (pf_vm_merges(r->vm) && (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO))) {
            return FALSE;
        }
    }
    return TRUE;
}

gboolean
huge_restorable(PfScanner *s, PfRegion *r, gsize idx, gsize *first)
{
    gsize e;

    if (!extent_of(r, idx, &e) || !(r->huge_was[e / 8] & (1u << (e % 8))) ||
        !extent_unmerged(r, e)) {
        return FALSE;
    }
    r->huge_seen[e / 8] &= ~(1u << (e % 8));
    r->huge_was[e / 8] &= ~(1u << (e % 8));
    *first = e * HUGE_PAGES;
    return TRUE;
}

void
huge_collapse_by_pid(PfRegion *r, gsize first)
{
    struct iovec iov;

    iov.iov_base = (void *)(guintptr)(r->host_addr + first * PF_PAGE_SIZE);
    iov.iov_len = HUGE_PAGES * PF_PAGE_SIZE;
    if (syscall(SYS_process_madvise, r->vm->pidfd, &iov, 1, MADV_COLLAPSE, 0) < 0) {
        g_debug("VM %s: MADV_COLLAPSE at %p: %s", r->vm->name, iov.iov_base, g_strerror(errno));
    }
}
