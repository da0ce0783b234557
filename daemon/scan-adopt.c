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
 * Owns the node of each slot of an adopted chunk (the next VM that maps
 * the slot joins that node, however full: one node per slot, as the
 * ledger counts).  Never takes a page the process does not map from a
 * marked chunk, and never fills or zeroes a slot of an adopted chunk
 * (pool.h).
 */
#include "scan-internal.h"

/* The node of each slot of an adopted chunk, made by the first VM that
 * maps the slot: guint32[PF_POOL_CHUNK_SLOTS] by chunk id. */
static guint32 *
slot_nodes(PfScanner *s, guint32 chunk)
{
    guint32 *nodes = g_hash_table_lookup(s->adopted, GUINT_TO_POINTER(chunk));

    if (nodes == NULL) {
        nodes = g_new0(guint32, PF_POOL_CHUNK_SLOTS);
        g_hash_table_insert(s->adopted, GUINT_TO_POINTER(chunk), nodes);
    }
    return nodes;
}

void
adopt_chunk_gone(PfScanner *s, guint32 chunk)
{
    g_hash_table_remove(s->adopted, GUINT_TO_POINTER(chunk));
}

/* The chunk of a run, one of the pool's (adopted now if it was not), the
 * VM one of its VMs; 0 where it cannot be. */
static guint32
run_chunk(PfScanner *s, PfVm *vm, const PfPoolMapped *pooled, const PfPoolRun *run)
{
    PfPool *pool = pf_scanner_get_pool(s);
    guint32 chunk = pf_pool_find_ino(pool, run->ino);
    g_autoptr(GError) error = NULL;

    if (chunk == 0) {
        int fd = GPOINTER_TO_INT(g_hash_table_lookup(pooled->fds, &run->ino));

        /* pf_pool_adopt_chunk() sends it to the VM, as any new chunk. */
        chunk = pf_pool_adopt_chunk(pool, fd, vm->serial, &error);
        if (chunk == 0) {
            g_warning("VM %s: a pool chunk it maps cannot be taken back: %s", vm->name,
                      error->message);
        }
        return chunk;
    }
    /* One of this pagefoldd's own: the VM's agent lost its link to this
     * very pagefoldd, whose leftover holds its slots until the process
     * exits.  They stay so. */
    if (!pf_pool_is_adopted(pool, chunk)) {
        return 0;
    }
    if (pf_pool_adopt_holder(pool, chunk, vm->serial)) {
        scan_emit_chunk(s, vm, pf_pool_chunk(pool, chunk), FALSE);
    }
    return chunk;
}

/* Page idx maps slot of chunk: a member of the slot's node. */
static void
adopt_page(PfScanner *s, PfRegion *r, gsize idx, guint32 chunk, guint32 index)
{
    PfPool *pool = s->pool;
    guint32 *nodes = slot_nodes(s, chunk);
    guint32 slot = chunk * PF_POOL_CHUNK_SLOTS + index + 1, node = nodes[index];
    PfPage *p = pf_region_page_make(r, idx);
    const PfStableNode *n = node != 0 ? node_at(s, node) : NULL;

    if (p == NULL || p->state != PF_PAGE_ABSENT) {
        return; /* no memory for its record: it stays merged, uncounted */
    }
    if (n == NULL || !n->live || n->slot != slot) {
        /* A slot with no node has no reference either: the node's own
         * is its first. */
        if (!pf_pool_adopt_slot(pool, slot)) {
            g_warning("VM %s: pool slot %u is held without a node; page %zu not taken back",
                      r->vm->name, slot, idx);
            pf_pool_unref(pool, slot);
            return;
        }
        node = pf_stable_tree_create(&s->stable, s->hash(pf_pool_data(pool, slot)), slot,
                                     pf_vm_domain_key(r->vm));
        nodes[index] = node;
        n = node_at(s, node);
    }
    ledger_take(s, slot, node);
    pf_stable_tree_add(&s->stable, node, r->base + (guint32)idx);
    p->checksum = n->checksum;
    mark_merged(r, p, PF_PAGE_SHARED);
    if (n->domain != pf_vm_domain_key(r->vm)) {
        /* Shared with a VM of another merge domain under the earlier
         * pagefoldd, or by one that has no domain yet: no more. */
        pf_scanner_end_sharing(s, r, idx);
    }
}

/* Page idx maps a slot of an earlier pagefoldd's zero chunk: a zero page,
 * as if it mapped this pagefoldd's (no reference is held on either). */
static void
adopt_zero(PfScanner *s, PfRegion *r, gsize idx)
{
    PfPage *p = pf_region_page_make(r, idx);

    if (p != NULL && p->state == PF_PAGE_ABSENT) {
        p->checksum = s->zero_checksum;
        mark_merged(r, p, PF_PAGE_ZERO);
    }
}

void
pf_scanner_adopt(PfScanner *s, PfVm *vm)
{
    gsize shared = vm->count[PF_PAGE_SHARED], zero = vm->count[PF_PAGE_ZERO];
    guint chunks = 0;

    for (guint k = 0; k < vm->regions->len; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);
        g_autoptr(PfPoolMapped) pooled = g_steal_pointer(&r->pooled);

        /* In advise mode its agent folded every page back before READY;
         * one that says otherwise keeps what it maps, uncounted. */
        if (pooled == NULL || !pf_region_live(r) || !pf_vm_merges(vm)) {
            continue;
        }
        for (guint i = 0; i < pooled->runs->len; i++) {
            const PfPoolRun *run = &g_array_index(pooled->runs, PfPoolRun, i);
            guint32 chunk = run->zero ? 0 : run_chunk(s, vm, pooled, run);

            if (!run->zero && chunk == 0) {
                continue;
            }
            for (gsize j = 0; j < run->n_pages; j++) {
                if (run->zero) {
                    adopt_zero(s, r, run->page + j);
                } else {
                    adopt_page(s, r, run->page + j, chunk, run->index + (guint32)j);
                }
            }
        }
        chunks += g_hash_table_size(pooled->fds);
    }
    if (chunks > 0) {
        g_message("VM %s (pid %d): took back %zu merged page(s) and %zu zero page(s) on %u "
                  "pool chunk(s) of an earlier pagefoldd",
                  vm->name, vm->pid, vm->count[PF_PAGE_SHARED] - shared,
                  vm->count[PF_PAGE_ZERO] - zero, chunks);
    }
}
