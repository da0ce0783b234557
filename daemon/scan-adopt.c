/*
 * scan-adopt.c - merged pages taken back: a VM whose agent connects after
 * its pagefoldd went (a restart, an upgrade, a crash) has pages mapped from
 * pool chunks that pagefoldd made.  Its region checks found them in the
 * process's mappings (region.h's PfPoolMapped: the kernel's word, and the
 * pool's mark on each chunk, which only root can set); here they become
 * what they were: members of a stable node per slot, each holding a
 * reference on it, the chunk one of the pool's again, sent to the VM
 * under its new id.  Nothing is copied or unmerged, but a page that would
 * now share across merge domains: it is folded back.
 *
 * A VM of a TiB may have a few hundred million pages to take back, and a
 * peer may connect again and again: they are taken back ADOPT_PAGES at a
 * time from an idle source of the main loop, which runs between its other
 * work.  Until then a page is a hole the scanner passes over, as it passes
 * over every merged page.
 *
 * Owns the idle source.  The node of each slot of an adopted chunk is
 * kept with the slot (pf_pool_set_adopted_tag()): the next VM that maps
 * the slot joins that node, up to what a node can hold.  Never takes a
 * page the process does not map from a marked chunk, and never fills or
 * zeroes a slot of an adopted chunk (pool.h).
 */
#include "scan-core.h"

/* Pages taken back per turn of the main loop: a few milliseconds. */
#define ADOPT_PAGES 32768u

/* The chunk of a run, one of the pool's (adopted now if it was not), the
 * VM one of its VMs; 0 where it cannot be. */
static guint32
run_chunk(PfScanner *s, PfVm *vm, const PfPoolMapped *pooled, const PfPoolRun *run)
{
    PfPool *pool = pf_scanner_get_pool(s);
    guint32 chunk = pf_pool_find_ino(pool, run->ino);

    if (chunk == 0) {
        int fd = GPOINTER_TO_INT(g_hash_table_lookup(pooled->fds, &run->ino)) - 1;

        /* pf_pool_adopt_chunk() sends it to the VM, as any new chunk;
         * failing, the run stays merged, uncounted (said at the end). */
        return pf_pool_adopt_chunk(pool, fd, vm->scan->serial, NULL);
    }
    /* One of this pagefoldd's own: the VM's agent lost its link to this
     * very pagefoldd, whose leftover holds its slots until the process
     * exits.  They stay so. */
    if (!pf_pool_is_adopted(pool, chunk)) {
        return 0;
    }
    if (pf_pool_adopt_holder(pool, chunk, vm->scan->serial)) {
        scan_emit_chunk(s, vm, pf_pool_chunk(pool, chunk), FALSE);
    }
    return chunk;
}

/*
 * A page that maps a slot but cannot be taken back (its node is full, or
 * something else holds the slot) is folded back into its memfd: left
 * merged and uncounted, it would keep a slot of a chunk pagefoldd may drop
 * (and its VM would be detached for still mapping it), and a COLLAPSE of
 * its extent would be asked as if it were not merged.  The request holds
 * a reference on the slot until answered, as any unmerge's does.
 */
static void
fold_back_refused(PfScanner *s, PfRegion *r, gsize idx, PfPage *p, guint32 slot, guint32 node)
{
    /* The node, where there is one on the slot: its answer puts the
     * reference through it (a node whose last sharer this was goes), and
     * a fold-back that fails leaves the page one of its members, counted
     * (a node full at ADOPT_MAX_SHARERS sharers still has room for that
     * one in a 16-bit member index). */
    ledger_take(s, slot, node);
    request_page(s, r, p, r->base + (guint32)idx, PF_ITEM_UNMERGE, slot, node, 0);
}

/*
 * Page idx maps slot index of chunk: a member of the slot's node.  FALSE
 * when it cannot be: folded back (its node is full, or its slot held by
 * another), or left as this pagefoldd knows it (no memory for its
 * record; a record already: what the region check saw is stale, the page
 * folded back since and maybe merged again by this pagefoldd, or a
 * request in flight for it decides).
 */
static gboolean
adopt_page(PfScanner *s, PfRegion *r, gsize idx, guint32 chunk, guint32 index)
{
    PfPool *pool = s->pool;
    guint32 slot = chunk * PF_POOL_CHUNK_SLOTS + index + 1;
    guint32 node = pf_pool_adopted_tag(pool, slot);
    const PfStableNode *n = node != 0 ? node_at(s, node) : NULL;
    PfPage *p = pf_region_page_make(r, idx);

    if (p == NULL || p->state != PF_PAGE_ABSENT) {
        return FALSE;
    }
    if (n != NULL && n->live && n->slot == slot) {
        if (ledger_sharers(s, n) >= setup_of(s)->adopt_max_sharers) {
            fold_back_refused(s, r, idx, p, slot, node);
            return FALSE;
        }
    } else if (!ledger_adopt_slot(s, slot)) {
        fold_back_refused(s, r, idx, p, slot, 0);
        return FALSE;
    } else {
        /* A slot with no node had no reference either: the node's own is
         * its first. */
        node = pf_stable_tree_create(&s->stable, setup_of(s)->hash(pf_pool_data(pool, slot)), slot,
                                     pf_vm_domain_key(r->vm));
        pf_pool_set_adopted_tag(pool, slot, node);
        n = node_at(s, node);
    }
    ledger_take(s, slot, node);
    pf_stable_tree_add(&s->stable, node, r->base + (guint32)idx);
    mark_merged(r, p, PF_PAGE_SHARED);
    if (n->domain != pf_vm_domain_key(r->vm)) {
        /* Shared with a VM of another merge domain under the earlier
         * pagefoldd, or by one that has no domain yet: no more. */
        pf_scanner_end_sharing(s, r, idx);
    }
    return TRUE;
}

/* Page idx maps a slot of an earlier pagefoldd's zero chunk: a zero page,
 * as if it mapped this pagefoldd's (no reference is held on either). */
static gboolean
adopt_zero(PfScanner *s, PfRegion *r, gsize idx)
{
    PfPage *p = pf_region_page_make(r, idx);

    if (p == NULL || p->state != PF_PAGE_ABSENT) {
        return FALSE;
    }
    p->checksum = pf_page_sum(setup_of(s)->zero_checksum);
    mark_merged(r, p, PF_PAGE_ZERO);
    return TRUE;
}

/* Region r is taken back: its chunks settle, and it is said. */
static void
region_adopted(PfScanner *s, PfRegion *r)
{
    g_autoptr(PfPoolMapped) pooled = g_steal_pointer(&r->pooled);
    GHashTableIter it;
    gpointer ino;

    g_hash_table_iter_init(&it, pooled->fds);
    while (g_hash_table_iter_next(&it, &ino, NULL)) {
        PfPool *pool = pf_scanner_get_pool(s);

        pf_pool_adopted_settle(pool, pf_pool_find_ino(pool, *(guint64 *)ino));
    }
    g_message("VM %s (pid %d): region %u: took back %zu merged page(s) and %zu zero page(s) "
              "on %u pool chunk(s) of an earlier pagefoldd%s%s",
              r->vm->name, r->vm->pid, r->index, pooled->shared, pooled->zero,
              g_hash_table_size(pooled->fds), pooled->refused > 0 ? "; the others are " : "",
              pooled->refused > 0 ? "folded back, or stay merged where they cannot be" : "");
}

/* Takes back up to *budget pages of region r (its agent's VM merging). */
static void
adopt_region(PfScanner *s, PfRegion *r, guint *budget)
{
    PfPoolMapped *m = r->pooled;

    while (m->at_run < m->runs->len && *budget > 0) {
        const PfPoolRun *run = &g_array_index(m->runs, PfPoolRun, m->at_run);
        guint32 chunk = run->zero ? 0 : run_chunk(s, r->vm, m, run);

        if (!run->zero && chunk == 0) {
            m->refused += run->n_pages - m->at_page;
            m->at_page = run->n_pages;
        }
        for (; m->at_page < run->n_pages && *budget > 0; m->at_page++, (*budget)--) {
            gsize idx = run->page + m->at_page;

            /* Discarded since READY: in the memfd, nothing to take. */
            if (pf_pool_mapped_is_back(m, idx)) {
                continue;
            }
            if (run->zero ? adopt_zero(s, r, idx)
                          : adopt_page(s, r, idx, chunk, run->index + (guint32)m->at_page)) {
                (*(run->zero ? &m->zero : &m->shared))++;
            } else {
                m->refused++;
            }
        }
        if (m->at_page == run->n_pages) {
            m->at_run++;
            m->at_page = 0;
        }
    }
    if (m->at_run == m->runs->len) {
        region_adopted(s, r);
    }
}

/* One turn: ADOPT_PAGES of whichever VMs have pages to take back. */
static gboolean
adopt_cb(gpointer user)
{
    PfScanner *s = user;
    guint budget = ADOPT_PAGES;

    for (guint i = 0; i < vm_count(s) && budget > 0; i++) {
        PfVm *vm = vm_at(s, i);

        for (guint k = 0; k < vm->regions->len && budget > 0; k++) {
            PfRegion *r = g_ptr_array_index(vm->regions, k);

            if (r->pooled == NULL) {
                continue;
            }
            /* In advise mode its agent folded every page back before
             * READY; one that says otherwise keeps what it maps,
             * uncounted. */
            if (!pf_region_live(r) || !pf_vm_merges(vm)) {
                g_clear_pointer(&r->pooled, pf_pool_mapped_free);
                continue;
            }
            adopt_region(s, r, &budget);
        }
    }
    /* What it asked (pages folded back) goes now, not with the next scan. */
    pf_scanner_flush(s);
    if (budget > 0) {
        s->adopt.source = 0;
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

void
pf_scanner_adopt(PfScanner *s, PfVm *vm)
{
    gboolean any = FALSE;

    for (guint k = 0; k < vm->regions->len && !any; k++) {
        any = ((PfRegion *)g_ptr_array_index(vm->regions, k))->pooled != NULL;
    }
    if (any && s->adopt.source == 0) {
        s->adopt.source = g_idle_add(adopt_cb, s);
    }
}

void
adopt_clear(PfScanner *s)
{
    g_clear_handle_id(&s->adopt.source, g_source_remove);
}
