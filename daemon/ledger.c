/*
 * ledger.c - the slot/node ledger of the scanner core (scan-core.h):
 * the only place a pool slot's references are taken or given back, and a
 * stable node made listed, unlisted or dropped for it.
 *
 * A slot's references are: its stable node's own, one per member page,
 * one per request in flight that names it (the slot of a merge or
 * unmerge, the slot of the node a move leaves), one per hold a leftover
 * keeps (a VM detached while its process lives).  A node lives while any
 * of those do.  Nothing here decides a merge or sends anything.
 */
#include "scan-core.h"

guint32
ledger_sharers(PfScanner *s, const PfStableNode *n)
{
    return n->slot != PF_POOL_SLOT_NONE ? pf_pool_refs(s->pool, n->slot) - 1 : n->n_members;
}

void
ledger_relist(PfScanner *s, guint32 id)
{
    const PfStableNode *n = node_at(s, id);

    if (n->live) {
        pf_stable_tree_set_full(&s->stable, id,
                                ledger_sharers(s, n) >= setup_of(s)->knobs.max_page_sharing);
    }
}

/* Every path that lets a sharer go comes here: a node that stays may have
 * room again. */
void
ledger_maybe_drop(PfScanner *s, guint32 id)
{
    const PfStableNode *n = node_at(s, id);
    guint32 slot = n->slot;

    if (!n->live) {
        return;
    }
    if (n->n_members > 0 || (slot != PF_POOL_SLOT_NONE && pf_pool_refs(s->pool, slot) > 1)) {
        ledger_relist(s, id);
        return;
    }
    pf_stable_tree_drop(&s->stable, id);
    if (slot != PF_POOL_SLOT_NONE) {
        pf_pool_unref(s->pool, slot);
    }
}

guint32
ledger_new_slot(PfScanner *s, const guint32 *vms, guint n_vms, const guint8 *data,
                GError **error)
{
    return pf_pool_alloc(s->pool, vms, n_vms, data, error);
}

void
ledger_take(PfScanner *s, guint32 slot, guint32 node)
{
    pf_pool_ref(s->pool, slot);
    if (node != 0) {
        ledger_relist(s, node);
    }
}

gboolean
ledger_adopt_slot(PfScanner *s, guint32 slot)
{
    if (pf_pool_adopt_slot(s->pool, slot)) {
        return TRUE;
    }
    pf_pool_unref(s->pool, slot); /* the one pf_pool_adopt_slot() took */
    return FALSE;
}

void
ledger_put(PfScanner *s, guint32 slot, guint32 node)
{
    if (slot != PF_POOL_SLOT_NONE) {
        pf_pool_unref(s->pool, slot);
    }
    if (node != 0) {
        ledger_maybe_drop(s, node);
    }
}

void
ledger_hold_or_put(PfScanner *s, GArray *keep, guint32 slot, guint32 node)
{
    if (slot == PF_POOL_SLOT_NONE) {
        if (node != 0) {
            ledger_maybe_drop(s, node);
        }
        return;
    }
    if (keep != NULL) {
        HeldRef h = { slot, node };

        g_array_append_val(keep, h);
    } else {
        ledger_put(s, slot, node);
    }
}

void
ledger_forget_page(PfScanner *s, PfRegion *r, gsize idx, GArray *keep)
{
    PfPage *p = pf_region_page(r, idx);

    if (p == NULL) {
        return;
    }
    if (p->state == PF_PAGE_SHARED) {
        guint32 node = p->node;

        pf_stable_tree_remove(&s->stable, r->base + (guint32)idx);
        ledger_hold_or_put(s, keep, node_at(s, node)->slot, node);
    }
    reset_page(r, p, PF_PAGE_ABSENT);
}
