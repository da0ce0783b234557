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
#include "agent-records.h"

#include <errno.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <unistd.h>

/* Ranges noted between two sends of the agent thread, which wakes at the
 * first; past them (the thread held up), the rest are counted, untold. */
#define WRITTEN_MAX 4096u
/* Past this much socket memory not yet read by pagefoldd (half the
 * link's send buffer, agent-link.c), hints are dropped. */
#define HINT_UNSENT_MAX (128 * 1024)

void
pf_agent_dma_map(PfAgent *a, void *host, gsize len)
{
    DmaRange d = { host, (const guint8 *)host + len };

    g_mutex_lock(&a->dma);
    g_array_append_val(a->dma_ranges, d);
    g_mutex_unlock(&a->dma);
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

/* Notes the whole pages of [lo, hi) a device wrote: not a part of a page
 * (a request's status byte, a header), whose other bytes the guest's
 * kernel writes as it likes.  With dma held. */
static gboolean
note_written(PfAgent *a, const guint8 *lo, const guint8 *hi)
{
    DmaRange w = { (const guint8 *)(((guintptr)lo + PF_PAGE_SIZE - 1) &
                                    ~(guintptr)(PF_PAGE_SIZE - 1)),
                   (const guint8 *)((guintptr)hi & ~(guintptr)(PF_PAGE_SIZE - 1)) };
    gboolean first = a->written->len == 0;

    if (w.lo >= w.hi) {
        return FALSE;
    }

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
            /* Not before the agent thread runs to tell it. */
            if (written > 0 && a->wake[1] >= 0) {
                wake = note_written(a, host, (const guint8 *)host + MIN(written, len));
            }
            break;
        }
    }
    g_mutex_unlock(&a->dma);
    /* Only ranges mapped since the start are noted: the pipe is made. */
    if (wake && write(a->wake[1], "x", 1) < 0 && errno != EAGAIN) {
        g_warning("pagefold agent: cannot wake the agent thread: %s", g_strerror(errno));
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
        if (hi - lo >= (gssize)PF_PAGE_SIZE) {
            h.page = (guint64)(lo - r->host) / PF_PAGE_SIZE;
            h.n_pages = (guint64)(hi - lo) / PF_PAGE_SIZE;
            g_array_append_val(hints, h);
        }
    }
}

/* Socket memory of what the link's socket has not sent yet (SIOCOUTQ),
 * 0 if unknown. */
static int
unsent(PfAgent *a)
{
    int n = 0;

    return ioctl(a->sock, SIOCOUTQ, &n) == 0 ? n : 0;
}

void
pfa_post_written(PfAgent *a)
{
    g_autoptr(GArray) written = NULL;
    g_autoptr(GArray) hints = NULL;
    guint64 pages = 0, dropped = 0;

    g_mutex_lock(&a->dma);
    if (a->written->len > 0) {
        written = a->written;
        a->written = g_array_new(FALSE, FALSE, sizeof(DmaRange));
    }
    g_mutex_unlock(&a->dma);
    if (written == NULL) {
        return;
    }
    hints = g_array_new(FALSE, FALSE, sizeof(PfWireRange));
    g_mutex_lock(&a->work);
    for (guint i = 0; i < written->len; i++) {
        hints_of(a, &g_array_index(written, DmaRange, i), hints);
    }
    for (guint i = 0; i < hints->len; i++) {
        pages += g_array_index(hints, PfWireRange, i).n_pages;
    }
    /*
     * Not before READY (pagefoldd reads all of guest RAM at its first
     * pass anyway), nor to a pagefoldd of protocol 1, nor while pagefoldd
     * has not read what was sent: a hint must never hold up an answer.
     */
    if (!a->ready || a->version < PF_PROTO_VERSION_HINT || unsent(a) > HINT_UNSENT_MAX) {
        dropped = pages;
    } else {
        for (guint i = 0; i < hints->len; i += PF_PROTO_MAX_ITEMS) {
            guint n = MIN(hints->len - i, PF_PROTO_MAX_ITEMS);

            pfa_post(a, PF_MSG_HINT, 0, &g_array_index(hints, PfWireRange, i),
                     n * sizeof(PfWireRange), -1);
        }
    }
    g_mutex_unlock(&a->work);
    /* The pages queued are counted as the agent thread sends them. */
    pfa_count_hints(a, 0, dropped);
}
