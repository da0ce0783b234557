/*
 * agent-items.c - serving one REQUEST of pagefoldd: each item checked
 * against the regions and pool chunks held, merge and zero items batched
 * into windows that share one write protection, unmerges likewise, collapses,
 * a result per item in one RESULT, and the counters.  Never trusts
 * pagefoldd: an item out of range is refused with nothing touched, and a
 * page is merged only where it compares equal to its slot here, under
 * write protection (pagefoldd's checksums and memcmp only propose).
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <linux/userfaultfd.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

#define MAX_RUN 512
#define WINDOW_PAGES 4096u /* 16 MiB */
#define WINDOW_GAP 16u

static gboolean
item_valid(PfAgent *a, const PfWireItem *it)
{
    const Region *r;

    if (it->region >= a->regions->len) {
        return FALSE;
    }
    r = &g_array_index(a->regions, Region, it->region);
    /*
     * A region gone has no pages; one refused is not write-protected, one
     * leaving takes no new merge (an unmerge finds nothing remapped there,
     * or folds its page back, and says so).
     */
    if (r->gone ||
        ((r->refused != NULL || r->leaving) && it->kind != PF_ITEM_UNMERGE) ||
        it->page >= r->n_pages) {
        return FALSE;
    }
    if (it->kind == PF_ITEM_COLLAPSE) {
        return it->page % HUGE_PAGES == 0 &&
               it->page + HUGE_PAGES <= r->n_pages &&
               (guintptr)(r->host + it->page * PF_PAGE_SIZE) %
               (HUGE_PAGES * PF_PAGE_SIZE) == 0;
    }
    if (it->kind == PF_ITEM_MERGE || it->kind == PF_ITEM_ZERO) {
        const Chunk *c = pfa_held_chunk(a, it->chunk);

        return c != NULL && it->slot < c->n_slots;
    }
    return TRUE;
}

/* Does it continue the run of k items that first begins? */
static gboolean
continues(const PfWireItem *first, guint32 k, const PfWireItem *it)
{
    return it->kind == first->kind &&
           (it->kind == PF_ITEM_MERGE || it->kind == PF_ITEM_ZERO) &&
           it->region == first->region && it->page == first->page + k &&
           it->chunk == first->chunk && it->slot == first->slot + k;
}

static guint64
extent_of_page(const Region *r, guint64 page)
{
    return ((guintptr)r->host + page * PF_PAGE_SIZE) /
           (HUGE_PAGES * PF_PAGE_SIZE);
}

/* Which items share a window: merges with zeros, unmerges with unmerges. */
static int
window_of(PfItemKind kind)
{
    return kind == PF_ITEM_MERGE || kind == PF_ITEM_ZERO ? 1 :
           kind == PF_ITEM_UNMERGE ? 2 : 0;
}

/*
 * Does it join the window of first, which spans pages [lo, hi)?  With no
 * more than WINDOW_GAP pages between them, WINDOW_PAGES in all, and never
 * across a 2 MiB extent with no item in it: protecting a page splits its
 * huge mapping, which merging does anyway where it merges, but must not
 * do where it does not.  Protecting and lifting walk every page of the
 * span, a gap page as dearly as a merged one (an empty one gets a
 * marker), so a window does not reach across a wide gap to save a call.
 */
static gboolean
is_window_item(PfAgent *a, const PfWireItem *first, const PfWireItem *it,
               guint64 lo, guint64 hi)
{
    const Region *r;
    guint64 e;

    if (window_of(it->kind) != window_of(first->kind) ||
        it->region != first->region || !item_valid(a, it) ||
        MAX(hi, it->page + 1) - MIN(lo, it->page) > WINDOW_PAGES ||
        (it->page >= hi ? it->page - hi : lo - MIN(lo, it->page + 1)) >
            WINDOW_GAP) {
        return FALSE;
    }
    r = &g_array_index(a->regions, Region, it->region);
    e = extent_of_page(r, it->page);
    return e + 1 >= extent_of_page(r, lo) && e <= extent_of_page(r, hi - 1) + 1;
}

static void
set_result(PfWireResult *res, PfResultStatus status, int err)
{
    memset(res, 0, sizeof(*res));
    res->status = (guint8)status;
    res->err = err;
}

/*
 * k consecutive pages to k consecutive pool slots: the slots' content
 * (merge), or zero slots when the pages are zero (zero).  The pages are
 * write-protected already (exec_window): what is compared is what stays.
 * A page in DMA is refused: a device may write it behind the protection.
 * moved[t] says whether page t, if done, came from another slot.
 */
static void
exec_run(PfAgent *a, const PfWireItem *first, guint32 k, PfWireResult *res,
         gboolean *moved)
{
    Region *r = &g_array_index(a->regions, Region, first->region);
    const Chunk *c = g_ptr_array_index(a->chunks, first->chunk);
    gboolean zero = first->kind == PF_ITEM_ZERO;
    guint8 *hva = r->host + first->page * PF_PAGE_SIZE;
    gboolean done[MAX_RUN] = { FALSE };

    for (guint32 t = 0; t < k; t++) {
        const guint8 *slot = c->map + (gsize)(first->slot + t) * PF_PAGE_SIZE;
        guint8 *page = hva + (gsize)t * PF_PAGE_SIZE;

        if (pfa_in_dma(a, page, page + PF_PAGE_SIZE)) {
            set_result(&res[t], PF_RESULT_ERROR, EBUSY);
            continue;
        }
        /* A zero page maps a zero slot: both must be zero. */
        done[t] = memcmp(page, slot, PF_PAGE_SIZE) == 0 &&
                  (!zero || memcmp(slot, pfa_zero_page, PF_PAGE_SIZE) == 0);
        moved[t] = done[t] && pfa_is_remapped(r, first->page + t);
        set_result(&res[t], done[t] ? PF_RESULT_DONE : PF_RESULT_CHANGED, 0);
    }
    for (guint32 t = 0; t < k;) {
        guint32 u = t;
        int rc;

        if (!done[t]) {
            t++;
            continue;
        }
        while (u < k && done[u]) {
            u++;
        }
        rc = pfa_remap_run(a, r, first->page + t, first->page + u, c,
                           first->slot + t);
        for (guint32 v = t; rc < 0 && v < u; v++) {
            set_result(&res[v], PF_RESULT_ERROR, -rc);
        }
        t = u;
    }
}

/*
 * Merge and zero items of one region near each other (is_window_item())
 * share their system calls: one write protection of the window (in the
 * VMM, then in each back-end that maps it), runs
 * remapped, then the window registered again (the new mappings are not),
 * unprotected (which wakes every writer that blocked meanwhile; they retry
 * on whatever the page is now).  Each of those calls flushes TLBs or walks
 * mappings: per window, not per run.  A DMA mapping of these pages waits
 * until the window is done.
 */
static void
exec_window(PfAgent *a, const PfWireItem *items, guint32 n, guint64 lo,
            guint64 hi, PfWireResult *res, gboolean *moved)
{
    Region *r = &g_array_index(a->regions, Region, items[0].region);
    guint8 *hva = r->host + lo * PF_PAGE_SIZE;
    gsize len = (hi - lo) * PF_PAGE_SIZE;
    int rc;

    g_mutex_lock(&a->dma);
    rc = pfa_uffd_hold(a, hva, len);
    if (rc == 0) {
        rc = pfa_backends_hold(a, hva, len);
        if (rc < 0) {
            pfa_uffd_release(a, hva, len);
        }
    }
    /*
     * A pagefoldd before version 4 knows a page left as it was by EBUSY
     * alone.
     */
    if (rc == -EINPROGRESS && a->version < PF_PROTO_VERSION_SETTLING) {
        rc = -EBUSY;
    }
    if (rc < 0) {
        for (guint32 t = 0; t < n; t++) {
            set_result(&res[t], PF_RESULT_ERROR, -rc);
        }
        g_mutex_unlock(&a->dma);
        return;
    }
    for (guint32 i = 0; i < n;) {
        guint32 k = 1;

        while (i + k < n && k < MAX_RUN &&
               continues(&items[i], k, &items[i + k])) {
            k++;
        }
        exec_run(a, &items[i], k, &res[i], &moved[i]);
        i += k;
    }
    pfa_uffd_done(a, hva, len, TRUE);
    pfa_backends_release(a, hva, len);
    g_mutex_unlock(&a->dma);
}

/*
 * Folds pages back: their content into the memfd, the memfd mapped again,
 * one window of unmerge items under one write protection.
 */
static void
exec_unmerges(PfAgent *a, const PfWireItem *items, guint32 n,
              PfWireResult *res)
{
    g_autofree int *rcs = g_new(int, n);

    g_mutex_lock(&a->dma);
    pfa_fold_back_items(a, &g_array_index(a->regions, Region, items[0].region),
                        items, n, rcs);
    g_mutex_unlock(&a->dma);
    for (guint32 t = 0; t < n; t++) {
        set_result(&res[t], rcs[t] < 0 ? PF_RESULT_ERROR : PF_RESULT_DONE,
                   -rcs[t]);
    }
}

/*
 * Back to a huge page, once every page of the extent is unmerged.  The
 * kernel will not collapse a range registered for write protection, so it
 * is unregistered for the collapse: no page of it is protected then.  So
 * never while a page of it is still remapped, whatever pagefoldd believes
 * (a page it could not take back after a restart is one it does not
 * count): EBUSY, and nothing changes.
 */
static void
exec_collapse(PfAgent *a, const PfWireItem *it, PfWireResult *res)
{
    Region *r = &g_array_index(a->regions, Region, it->region);
    guint8 *hva = r->host + it->page * PF_PAGE_SIZE;
    gsize len = (gsize)HUGE_PAGES * PF_PAGE_SIZE;
    struct uffdio_range range = { (guint64)(guintptr)hva, len };
    int err = 0, rc;

    if (pfa_find_remapped(r, it->page, it->page + HUGE_PAGES, TRUE) <
        it->page + HUGE_PAGES) {
        set_result(res, PF_RESULT_ERROR, EBUSY);
        return;
    }
    rc = pfa_uffd_ioctl(a, UFFDIO_UNREGISTER, &range);
    if (rc < 0) {
        set_result(res, PF_RESULT_ERROR, -rc);
        return;
    }
    if (a->sys.madvise(hva, len, MADV_COLLAPSE) < 0) {
        err = errno;
    }
    rc = pfa_uffd_register(a, hva, len);
    if (rc < 0) {
        /*
         * Unregistered, these pages cannot be merged: say so, it is
         * tried again at the next merge there.
         */
        err = -rc;
    }
    set_result(res, err ? PF_RESULT_ERROR : PF_RESULT_DONE, err);
}

/*
 * A merge or zero item done on a page that was remapped already moved it
 * from one slot to another: counted apart, so that merged and zeroed stay
 * pages that left the memfd.
 */
static void
count_results(PfAgent *a, const PfWireItem *items, const PfWireResult *res,
              const gboolean *moved, guint32 n)
{
    g_mutex_lock(&a->lock);
    a->stats.requests++;
    for (guint32 i = 0; i < n; i++) {
        if (res[i].status == PF_RESULT_CHANGED) {
            a->stats.changed++;
        } else if (res[i].status == PF_RESULT_ERROR) {
            a->stats.errors++;
        } else if (moved[i]) {
            a->stats.moved++;
        } else if (items[i].kind == PF_ITEM_MERGE) {
            a->stats.merged++;
        } else if (items[i].kind == PF_ITEM_ZERO) {
            a->stats.zeroed++;
        } else if (items[i].kind == PF_ITEM_UNMERGE) {
            a->stats.unmerged++;
        }
    }
    g_mutex_unlock(&a->lock);
}

/* Called with a->work held, on the agent thread. */
gboolean
pfa_handle_request(PfAgent *a, const PfMsg *msg, GError **error)
{
    guint32 n;
    const PfWireItem *items = pf_msg_items(msg, &n);
    g_autofree PfWireResult *res = g_new0(PfWireResult, n);
    g_autofree gboolean *moved = g_new0(gboolean, n);

    for (guint32 i = 0; i < n;) {
        guint32 k = 1;
        guint64 lo = items[i].page, hi = lo + 1;

        if (!item_valid(a, &items[i])) {
            /* Out of range: refused, nothing touched. */
            set_result(&res[i], PF_RESULT_ERROR, EINVAL);
        } else if (items[i].kind != PF_ITEM_UNMERGE &&
                   a->mode != PF_MODE_MERGE) {
            /*
             * Nothing new is merged in advise mode.  Unmerges still are
             * served: after a step back nothing is remapped, and each
             * finds its page in the memfd already and says so.
             */
            set_result(&res[i], PF_RESULT_ERROR, EPERM);
        } else if (items[i].kind == PF_ITEM_COLLAPSE) {
            exec_collapse(a, &items[i], &res[i]);
        } else {
            while (i + k < n &&
                   is_window_item(a, &items[i], &items[i + k], lo, hi)) {
                lo = MIN(lo, items[i + k].page);
                hi = MAX(hi, items[i + k].page + 1);
                k++;
            }
            if (items[i].kind == PF_ITEM_UNMERGE) {
                exec_unmerges(a, &items[i], k, &res[i]);
            } else {
                exec_window(a, &items[i], k, lo, hi, &res[i], &moved[i]);
            }
        }
        i += k;
    }
    count_results(a, items, res, moved, n);
    pfa_post(a, PF_MSG_RESULT, msg->header.seq, res, n * sizeof(*res), -1);
    if (a->uffd_lost) {
        /* Merged pages stay valid; pagefoldd keeps their slots taken. */
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "the userfaultfd had to be closed: this VM cannot merge "
                    "any more");
        return FALSE;
    }
    return TRUE;
}
