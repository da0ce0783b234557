/*
 * agent-dma.c - the guest RAM a device writes outside the VM's page
 * tables, as the VMM reports it (an O_DIRECT or io_uring read pins the
 * pages it lands in).  Write protection does not stop a device's writes
 * into a pinned page, so no page of these ranges is merged, zeroed or
 * folded back; the rest of the agent asks pfa_in_dma() under a->dma,
 * which it holds across every change of a mapping.  The VMM's I/O threads
 * call in here: never anything slower than a mutex and an array.
 *
 * What a device wrote, once its DMA is over, is a hint for pagefoldd: a
 * disk read of an image that other VMs read too lands in pages about to be
 * duplicates of theirs (their page caches).  The I/O threads only note the
 * range; the agent thread tells pagefoldd (HINT).
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-internal.h"

#include <unistd.h>

/* Ranges noted between two sends of the agent thread, which wakes at the
 * first; past them (the thread held up), the rest are counted, untold. */
#define WRITTEN_MAX 4096u

void
pf_agent_dma_map(PfAgent *a, void *host, gsize len)
{
    DmaRange d = { host, (const guint8 *)host + len };

    g_mutex_lock(&a->dma);
    g_array_append_val(a->dma_ranges, d);
    g_mutex_unlock(&a->dma);
}

/* Notes the pages of [lo, hi) a device wrote.  With dma held. */
static gboolean
note_written(PfAgent *a, const guint8 *lo, const guint8 *hi)
{
    DmaRange w = { (const guint8 *)((guintptr)lo & ~(guintptr)(PF_PAGE_SIZE - 1)),
                   (const guint8 *)(((guintptr)hi + PF_PAGE_SIZE - 1) &
                                    ~(guintptr)(PF_PAGE_SIZE - 1)) };
    gboolean first = a->written->len == 0;

    if (!first) {
        DmaRange *last = &g_array_index(a->written, DmaRange, a->written->len - 1);

        /* A read's buffers are often one after another. */
        if (w.lo <= last->hi && last->lo <= w.hi) {
            last->lo = MIN(last->lo, w.lo);
            last->hi = MAX(last->hi, w.hi);
            return FALSE;
        }
    }
    if (a->written->len >= WRITTEN_MAX) {
        g_mutex_lock(&a->lock);
        a->stats.hints_dropped += (gsize)(w.hi - w.lo) / PF_PAGE_SIZE;
        g_mutex_unlock(&a->lock);
        return FALSE;
    }
    g_array_append_val(a->written, w);
    return first;
}

void
pf_agent_dma_unmap(PfAgent *a, void *host, gsize len, gsize written)
{
    gboolean wake = FALSE;

    g_mutex_lock(&a->dma);
    for (guint i = 0; i < a->dma_ranges->len; i++) {
        DmaRange *d = &g_array_index(a->dma_ranges, DmaRange, i);

        if (d->lo == host && d->hi == (const guint8 *)host + len) {
            g_array_remove_index_fast(a->dma_ranges, i);
            if (written > 0) {
                wake = note_written(a, host, (const guint8 *)host + MIN(written, len));
            }
            break;
        }
    }
    g_mutex_unlock(&a->dma);
    if (wake) {
        /* A full pipe is readable already. */
        (void)!write(a->wake[1], "x", 1);
    }
}

/* Appends the pages of w in each told, live region to hints. */
static void
hints_of(PfAgent *a, const DmaRange *w, GArray *hints)
{
    for (guint i = 0; i < MIN(a->announced, a->regions->len); i++) {
        const Region *r = &g_array_index(a->regions, Region, i);
        const guint8 *lo, *hi;
        PfWireRange h = { .region = i };

        if (r->gone || r->leaving || r->refused != NULL) {
            continue;
        }
        lo = MAX(w->lo, r->host);
        hi = MIN(w->hi, r->host + r->size);
        if (lo < hi) {
            h.page = (guint64)(lo - r->host) / PF_PAGE_SIZE;
            h.n_pages = (guint64)(hi - lo) / PF_PAGE_SIZE;
            g_array_append_val(hints, h);
        }
    }
}

void
pfa_post_written(PfAgent *a)
{
    g_autoptr(GArray) written = g_array_new(FALSE, FALSE, sizeof(DmaRange));
    g_autoptr(GArray) hints = g_array_new(FALSE, FALSE, sizeof(PfWireRange));
    guint64 pages = 0;

    g_mutex_lock(&a->work);
    g_mutex_lock(&a->dma);
    if (a->written->len > 0) {
        GArray *t = a->written;

        a->written = written;
        written = t;
    }
    g_mutex_unlock(&a->dma);
    if (!a->ready) {
        /* pagefoldd reads all of guest RAM at its first pass anyway. */
        g_mutex_unlock(&a->work);
        return;
    }
    for (guint i = 0; i < written->len; i++) {
        hints_of(a, &g_array_index(written, DmaRange, i), hints);
    }
    for (guint i = 0; i < hints->len; i += PF_PROTO_MAX_ITEMS) {
        guint n = MIN(hints->len - i, PF_PROTO_MAX_ITEMS);

        pfa_post(a, PF_MSG_HINT, 0, &g_array_index(hints, PfWireRange, i),
                 n * sizeof(PfWireRange), -1);
    }
    g_mutex_unlock(&a->work);
    for (guint i = 0; i < hints->len; i++) {
        pages += g_array_index(hints, PfWireRange, i).n_pages;
    }
    g_mutex_lock(&a->lock);
    a->stats.hinted += pages;
    g_mutex_unlock(&a->lock);
}

/* Is any page of [lo, hi) in DMA?  Called with a->dma held. */
gboolean
pfa_in_dma(PfAgent *a, const guint8 *lo, const guint8 *hi)
{
    for (guint i = 0; i < a->dma_ranges->len; i++) {
        const DmaRange *d = &g_array_index(a->dma_ranges, DmaRange, i);

        if (d->lo < hi && lo < d->hi) {
            return TRUE;
        }
    }
    return FALSE;
}
