/*
 * agent-remap.c - which memory backs a guest page, and changing it: pool
 * slots mapped over pages that compared equal to them (a merge, a zero, a
 * move), the memfd mapped back over remapped pages (a fold-back), the
 * punch that frees a merged page's memfd copy, and the bitmap of which
 * pages are remapped.  Never changes a mapping whose content must be kept
 * outside write protection, and never leaves a hole in guest RAM: where
 * no mapping can be put back, the process ends, as the guest's next
 * access there would end it.
 *
 * A MAP_FIXED that fails may have unmapped the old pages already, and a
 * private writable mapping can fail on commit accounting
 * (vm.overcommit_memory=2): the memfd is mapped back at once, after the
 * content of pages that were mapped from the pool (a move to another
 * slot) is written into it, where their memfd pages are holes.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>

const guint8 pfa_zero_page[PF_PAGE_SIZE];

/* ---- which pages are remapped ---- */

/* Marks pages [from, to) remapped or not; returns how many changed. */
gsize
pfa_mark_remapped(PfAgent *a, Region *r, gsize from, gsize to, gboolean on)
{
    gsize changed = 0;

    for (gsize page = from; page < to; page++) {
        if (on != pfa_is_remapped(r, page)) {
            r->remapped[page / 64] ^= 1ull << (page % 64);
            changed++;
        }
    }
    g_mutex_lock(&a->lock);
    if (on) {
        a->stats.remapped += changed;
    } else {
        a->stats.remapped -= changed;
    }
    g_mutex_unlock(&a->lock);
    return changed;
}

/* The first page in [from, to) that is remapped (want) or not, or to. */
gsize
pfa_find_remapped(const Region *r, gsize from, gsize to, gboolean want)
{
    while (from < to && pfa_is_remapped(r, from) != want) {
        if (from % 64 == 0 && to - from >= 64 &&
            r->remapped[from / 64] == (want ? 0 : ~0ull)) {
            from += 64;
        } else {
            from++;
        }
    }
    return MIN(from, to);
}

/* ---- the memfd mapped back ---- */

/* A fresh mapping has none of the region's advice: give it again. */
static int
readvise(PfAgent *a, const Region *r, void *addr, gsize len)
{
    for (guint i = 0; i < G_N_ELEMENTS(r->advice) && r->advice[i] != 0; i++) {
        if (a->sys.madvise(addr, len, r->advice[i]) < 0) {
            return -errno;
        }
    }
    return 0;
}

/*
 * Is every page of [addr, addr + len) mapped?  A MAP_FIXED that failed may
 * have unmapped the old pages first; mincore() fails with ENOMEM where
 * any page is not mapped, mapped pages need not be resident.
 */
static gboolean
range_mapped(const guint8 *addr, gsize len)
{
    unsigned char vec[64];

    for (gsize off = 0; off < len; off += sizeof(vec) * PF_PAGE_SIZE) {
        if (mincore((void *)(addr + off),
                    MIN(len - off, sizeof(vec) * PF_PAGE_SIZE), vec) < 0 &&
            errno == ENOMEM) {
            return FALSE;
        }
    }
    return TRUE;
}

/*
 * Maps pages [from, to) of r from its memfd again, shared, as the VMM
 * mapped them.  Called where the previous mapping is to go, or is gone
 * already: a failed MAP_FIXED may have unmapped it first (mincore() tells
 * a hole).  A hole cannot be left in guest RAM, so a failure there is
 * tried once more and then ends the process, as the guest's next access
 * there would.  Returns 0 with the memfd mapped, or -errno with the old
 * mapping still in place.
 */
static int
map_memfd(PfAgent *a, Region *r, gsize from, gsize to)
{
    guint8 *addr = r->host + from * PF_PAGE_SIZE;
    gsize len = (to - from) * PF_PAGE_SIZE;
    int rc = 0;

    for (int attempt = 0; attempt < 2; attempt++) {
        if (a->sys.mmap(addr, len, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_FIXED, r->fd,
                        (off_t)(r->offset + from * PF_PAGE_SIZE)) !=
            MAP_FAILED) {
            rc = readvise(a, r, addr, len);
            if (rc < 0) {
                /* The page is right, only its advice is missing. */
                g_warning("pagefold agent: advice for %s at %p+%zu: %s",
                          r->name, addr, len, g_strerror(-rc));
            }
            return 0;
        }
        rc = -errno;
        if (range_mapped(addr, len)) {
            return rc; /* still mapped as before */
        }
    }
    g_error("pagefold agent: cannot map guest RAM %s at %p+%zu back from its "
            "memfd: %s", r->name, addr, len, g_strerror(-rc));
}

/*
 * Copies the remapped pages [from, to) into the memfd, under write
 * protection: their own content, or with src the content they are known
 * to have (src holds page from, then the next ones), for when they are no
 * longer mapped.  A zero page is punched, not trusted to be a hole
 * already: its merge may have left the old page there.
 */
static int
copy_back(PfAgent *a, Region *r, gsize from, gsize to, const guint8 *src)
{
    for (gsize v = from; v < to; v++) {
        const guint8 *page = src != NULL ? src + (v - from) * PF_PAGE_SIZE
                                         : r->host + v * PF_PAGE_SIZE;
        off_t off = (off_t)(r->offset + v * PF_PAGE_SIZE);

        if (memcmp(page, pfa_zero_page, PF_PAGE_SIZE) == 0 &&
            a->sys.fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                             off, PF_PAGE_SIZE) == 0) {
            continue;
        }
        errno = 0;
        if (a->sys.pwrite(r->fd, page, PF_PAGE_SIZE, off) != PF_PAGE_SIZE) {
            return errno ? -errno : -EIO;
        }
    }
    return 0;
}

/*
 * Folds back the run [t, u) of remapped pages: with copy, their content
 * into the memfd first; then the memfd mapped over them.  Returns 0, or
 * -errno with the pages still remapped.
 */
static int
fold_back_run(PfAgent *a, Region *r, gsize t, gsize u, gboolean copy)
{
    int rc = copy ? copy_back(a, r, t, u, NULL) : 0;

    if (rc == 0) {
        rc = map_memfd(a, r, t, u);
    }
    /*
     * Still remapped: its memfd pages are holes again (a copy that failed
     * partway wrote some of them: copies nobody maps, on a tmpfs that may
     * be full), where pagefoldd looks for copy-on-write (it looks among
     * data too, should this punch fail).
     */
    if (rc < 0 && copy &&
        a->sys.fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                         (off_t)(r->offset + t * PF_PAGE_SIZE),
                         (off_t)((u - t) * PF_PAGE_SIZE)) < 0) {
        g_warning("pagefold agent: cannot punch %s again: %s", r->name,
                  g_strerror(errno));
    }
    return rc;
}

/*
 * pfa_fold_back_locked()'s runs, once [first, first + n) is protected
 * (with copy).
 */
static int
fold_back_runs(PfAgent *a, Region *r, gsize first, gsize n, gboolean copy,
               gsize *stop, gsize *folded)
{
    gsize end = first + n;
    gsize t = pfa_find_remapped(r, first, end, TRUE);
    gboolean busy = FALSE;
    int rc = 0;

    while (t < end) {
        gsize u = pfa_find_remapped(r, t, end, FALSE);
        gsize back;

        *stop = t;
        if (copy && pfa_in_dma(a, r->host + t * PF_PAGE_SIZE,
                               r->host + u * PF_PAGE_SIZE)) {
            /* Left as it is; the others are folded back all the same. */
            busy = TRUE;
            t = pfa_find_remapped(r, u, end, TRUE);
            continue;
        }
        rc = fold_back_run(a, r, t, u, copy);
        if (rc < 0) {
            break;
        }
        u = MIN(u, end);
        back = pfa_mark_remapped(a, r, t, u, FALSE);
        if (folded != NULL) {
            *folded += back;
        }
        t = pfa_find_remapped(r, u, end, TRUE);
    }
    if (rc == 0 && busy) {
        rc = -EBUSY;
    } else if (rc == 0) {
        *stop = end;
    }
    return rc;
}

/*
 * Maps the memfd again over the remapped pages of [first, first + n).
 * With copy, their content goes back into the memfd first, under write
 * protection so that no write falls between the copy and the mapping; a
 * run of remapped pages in DMA is not touched (the device's write would
 * land in the copy left behind), the others are, and -EBUSY says so.  Only
 * the merged pages count: QEMU keeps some guest RAM mapped for writing
 * for as long as a device runs (AHCI's receive areas, vhost's used
 * rings).  Without copy, the pages are about to be discarded and their
 * content does not matter (nor is any page busy).  Stops at the first
 * failure: pages before *stop are in the memfd, the others as they were
 * (remapped and valid).  Returns 0 or -errno; adds the pages folded back
 * to *folded, if given.  The caller holds a->dma.
 */
int
pfa_fold_back_locked(PfAgent *a, Region *r, gsize first, gsize n,
                     gboolean copy, gsize *stop, gsize *folded)
{
    guint8 *hva = r->host + first * PF_PAGE_SIZE;
    gsize len = n * PF_PAGE_SIZE;
    int rc;

    *stop = first;
    if (pfa_find_remapped(r, first, first + n, TRUE) == first + n) {
        *stop = first + n;
        return 0;
    }
    if (copy) {
        rc = pfa_uffd_hold(a, hva, len);
        if (rc < 0) {
            return rc;
        }
    }
    rc = fold_back_runs(a, r, first, n, copy, stop, folded);
    pfa_uffd_done(a, hva, len, copy);
    return rc;
}

/*
 * Folds back the pages of n unmerge items of r under one write protection,
 * of the span of those still remapped: a fold-back alone pays for
 * protecting and unprotecting its page, two TLB flushes, which cost more
 * than its copy and its mapping.  Items of consecutive pages fold back as
 * one run, one mapping; a run that fails is tried again page by page, so
 * that each item gets its own result (a page folded back already finds
 * nothing remapped).  rcs[i]: 0 or -errno for items[i].  The caller holds
 * a->dma.
 */
void
pfa_fold_back_items(PfAgent *a, Region *r, const PfWireItem *items,
                    guint32 n, int *rcs)
{
    gsize lo = r->n_pages, hi = 0, len, stop;
    guint8 *hva;
    int rc;

    for (guint32 i = 0; i < n; i++) {
        rcs[i] = 0;
        if (pfa_is_remapped(r, items[i].page)) {
            lo = MIN(lo, items[i].page);
            hi = MAX(hi, items[i].page + 1);
        }
    }
    if (hi == 0) {
        return; /* in the memfd already, as each one says */
    }
    hva = r->host + lo * PF_PAGE_SIZE;
    len = (hi - lo) * PF_PAGE_SIZE;
    rc = pfa_uffd_hold(a, hva, len);
    for (guint32 i = 0; i < n; i++) {
        rcs[i] = pfa_is_remapped(r, items[i].page) ? rc : 0;
    }
    if (rc < 0) {
        return;
    }
    for (guint32 i = 0, k; i < n; i += k) {
        for (k = 1; i + k < n && items[i + k].page == items[i].page + k; k++) {
        }
        rc = fold_back_runs(a, r, items[i].page, k, TRUE, &stop, NULL);
        for (guint32 t = 0; t < k; t++) {
            rcs[i + t] = k == 1 || rc == 0 ? rc :
                         fold_back_runs(a, r, items[i + t].page, 1, TRUE,
                                        &stop, NULL);
        }
    }
    pfa_uffd_done(a, hva, len, TRUE);
}

/* pfa_fold_back_locked(), for callers that do not hold a->dma. */
int
pfa_fold_back(PfAgent *a, Region *r, gsize first, gsize n, gboolean copy,
              gsize *stop, gsize *folded)
{
    int rc;

    g_mutex_lock(&a->dma);
    rc = pfa_fold_back_locked(a, r, first, n, copy, stop, folded);
    g_mutex_unlock(&a->dma);
    return rc;
}

/* ---- pool slots mapped over guest pages ---- */

/*
 * The MAP_FIXED of pool slots over pages [from, to) of r failed after the
 * kernel unmapped the old pages.  Each page's content is known: it
 * compared equal to its slot, under write protection.  A page that was in
 * the memfd still is (nothing was punched), but one remapped already (a
 * move from another slot) has a hole there, which the guest would read as
 * zeros: its slot's content goes into the memfd first.  Then the memfd is
 * mapped over the run.  Guest RAM cannot be left a hole nor lose content:
 * if the copy fails, the process ends, as map_memfd() does (and as the
 * guest's next access there would).
 */
static void
restore_unmapped(PfAgent *a, Region *r, gsize from, gsize to, const Chunk *c,
                 guint32 slot)
{
    for (gsize t = pfa_find_remapped(r, from, to, TRUE); t < to;) {
        gsize u = pfa_find_remapped(r, t, to, FALSE);
        int rc = copy_back(a, r, t, u,
                           c->map + (gsize)(slot + (t - from)) * PF_PAGE_SIZE);

        if (rc < 0) {
            g_error("pagefold agent: cannot write merged pages of guest RAM "
                    "%s at %p+%zu into its memfd, after mapping them from the "
                    "pool failed: %s", r->name, r->host + t * PF_PAGE_SIZE,
                    (u - t) * PF_PAGE_SIZE, g_strerror(-rc));
        }
        t = pfa_find_remapped(r, u, to, TRUE);
    }
    /*
     * The old pages are gone, so this maps the memfd (or ends the
     * process): a failure that leaves the range mapped cannot happen.
     */
    if (map_memfd(a, r, from, to) == 0) {
        pfa_mark_remapped(a, r, from, to, FALSE);
    }
}

/*
 * Maps pool slots over pages [from, to) of r, which are write-protected
 * and equal to them, then punches the pages out of the memfd.  Pages
 * remapped already are moved: pagefoldd maps them from another slot of
 * the same content, and their memfd pages are holes already (the punch
 * changes nothing there).  If the advice or the punch fails, the merge is
 * undone the safe way, by folding back (a write that came since went to
 * the new private copy; a moved page goes into the memfd with what it
 * holds).  Returns 0, or -errno with each page as before (its memfd, or
 * its old slot) or, where the old mapping could not be kept, back in the
 * memfd with its content.  The caller holds a->dma.
 */
int
pfa_remap_run(PfAgent *a, Region *r, gsize from, gsize to, const Chunk *c,
              guint32 slot)
{
    guint8 *addr = r->host + from * PF_PAGE_SIZE;
    gsize len = (to - from) * PF_PAGE_SIZE, stop;
    const char *what;
    int rc;

    if (a->sys.mmap(addr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED,
                    c->fd, (off_t)slot * PF_PAGE_SIZE) == MAP_FAILED) {
        rc = -errno;
        /*
         * Still mapped, the pages are as they were: the memfd, or their
         * old slots (whose memfd pages are holes: mapping the memfd over
         * them would lose them).
         */
        if (!range_mapped(addr, len)) {
            restore_unmapped(a, r, from, to, c, slot);
        }
        return rc;
    }
    pfa_mark_remapped(a, r, from, to, TRUE);
    /* Only now is the old page unreachable: drop it from the memfd. */
    rc = readvise(a, r, addr, len);
    if (rc < 0) {
        what = "advice";
    } else if (a->sys.fallocate(r->fd,
                                FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                (off_t)(r->offset + from * PF_PAGE_SIZE),
                                (off_t)len) < 0) {
        rc = -errno;
        what = "punch";
    } else {
        return 0;
    }
    g_warning("pagefold agent: %s after merging %s at %p+%zu: %s; "
              "folding it back", what, r->name, addr, len, g_strerror(-rc));
    if (pfa_fold_back_locked(a, r, from, to - from, TRUE, &stop, NULL) < 0) {
        /* Still merged, and valid: that is what pagefoldd must hear. */
        return 0;
    }
    return rc;
}
