/*
 * agent-dma.c - the guest RAM a device writes outside the VM's page
 * tables, as the VMM reports it (an O_DIRECT or io_uring read pins the
 * pages it lands in).  Write protection does not stop a device's writes
 * into a pinned page, so no page of these ranges is merged, zeroed or
 * folded back; the rest of the agent asks pfa_in_dma() under a->dma,
 * which it holds across every change of a mapping.  The VMM's I/O threads
 * call in here: never anything slower than a mutex and an array.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-internal.h"

void
pf_agent_dma_map(PfAgent *a, void *host, gsize len)
{
    DmaRange d = { host, (const guint8 *)host + len };

    g_mutex_lock(&a->dma);
    g_array_append_val(a->dma_ranges, d);
    g_mutex_unlock(&a->dma);
}

void
pf_agent_dma_unmap(PfAgent *a, void *host, gsize len)
{
    g_mutex_lock(&a->dma);
    for (guint i = 0; i < a->dma_ranges->len; i++) {
        DmaRange *d = &g_array_index(a->dma_ranges, DmaRange, i);

        if (d->lo == host && d->hi == (const guint8 *)host + len) {
            g_array_remove_index_fast(a->dma_ranges, i);
            break;
        }
    }
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
