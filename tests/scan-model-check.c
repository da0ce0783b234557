/*
 * scan-model-check.c - what the model (scan-model.h) asserts after every
 * step: check_model(), the pool's accounting and the scanner's counts
 * against what the model's agents and guests did.
 *
 * What is accounted for (pool.h, ledger.c): a slot's references are its
 * stable node's own, one per member page, one per request in flight that
 * names it (the slot of a merge or unmerge, the slot of the node a move
 * leaves), and one per reference a leftover holds (a VM detached while its
 * process lives, which may still map the slot).
 *
 * Owns the checks alone.  Must never change the scanner or the model,
 * not even a reference it counts: the cases and the agents' hooks check
 * in the middle of a step (an answer half given, a region gone with
 * requests in flight), and a check that changed what it looked at would
 * hide what it is there to find.
 */
#include "scan-model.h"

static void
want_ref(GHashTable *want, guint32 slot)
{
    gpointer n;

    if (slot == PF_POOL_SLOT_NONE || pf_pool_is_zero_slot(slot)) {
        return; /* zero slots are not counted */
    }
    n = g_hash_table_lookup(want, GUINT_TO_POINTER(slot));
    g_hash_table_insert(want, GUINT_TO_POINTER(slot), GUINT_TO_POINTER(GPOINTER_TO_UINT(n) + 1));
}

/* A node that a request or leftover names holds that slot: its reference
 * keeps the node, so that the node is there to put it back to. */
static void
assert_node_holds(PfScanner *s, guint32 node, guint32 slot)
{
    const PfStableNode *n = node_at(s, node);

    g_assert_true(n->live);
    g_assert_cmpuint(n->slot, ==, slot);
}

typedef struct {
    ModelVm *mv;
    GPtrArray *all; /* const PfPending* */
} Requests;

static void
collect_request(const PfWireItem *item, const PfPending *pd, gboolean sent, gpointer user)
{
    Requests *rq = user;

    /* A request for a region that went holds nothing since, and is sent
     * only if it was before the region went. */
    if (model_region(rq->mv, item->region)->gone) {
        g_assert_true(sent);
        g_assert_true(pd->settled);
    }
    g_ptr_array_add(rq->all, (gpointer)pd);
}

/* Each request to vm's agent not answered yet: the references it holds;
 * its page is the VM's, PENDING, and no other request names it.  The
 * agent has received exactly what the outbox says was sent. */
static void
account_requests(PfScanner *s, PfVm *vm, GHashTable *want)
{
    ModelVm *mv = model_vm_of(vm);
    g_autoptr(GHashTable) pages = g_hash_table_new(NULL, NULL);
    g_autoptr(GPtrArray) all = g_ptr_array_new();
    Requests rq = { mv, all };

    g_assert_cmpuint(mv->agent->n_in_flight, ==, pf_outbox_n_sent(vm->outbox));
    pf_outbox_foreach(vm->outbox, collect_request, &rq);
    for (guint i = 0; i < all->len; i++) {
        const PfPending *pd = g_ptr_array_index(all, i);
        PfRegion *r;

        if (pd->kind == PF_ITEM_COLLAPSE || pd->settled) {
            continue;
        }
        if (pd->kind == PF_ITEM_MERGE || pd->kind == PF_ITEM_UNMERGE) {
            want_ref(want, pd->slot);
            if (pd->node != 0) {
                assert_node_holds(s, pd->node, pd->slot);
            }
        }
        if (pd->from != 0) {
            want_ref(want, node_at(s, pd->from)->slot);
            g_assert_true(node_at(s, pd->from)->live);
        }
        r = region_of(s, pd->page);
        g_assert_true(r->vm == vm);
        g_assert_cmpuint(pf_region_page_state(r, pd->page - r->base), ==, PF_PAGE_PENDING);
        g_assert_true(g_hash_table_add(pages, GUINT_TO_POINTER(pd->page)));
    }
    g_assert_cmpuint(vm->scan->count[PF_PAGE_PENDING], ==, g_hash_table_size(pages));
}

/* Whether the stable tree's lookups find node id. */
static gboolean
node_listed(PfScanner *s, guint32 id)
{
    PfTableIter it;
    guint32 v;

    pf_table_iter_init(&it, &s->stable.table, node_at(s, id)->checksum);
    while ((v = pf_table_iter_next(&it)) != 0) {
        if (v == id) {
            return TRUE;
        }
    }
    return FALSE;
}

/* Every page the agent keeps merged is one pagefoldd counts merged, or
 * has a request in flight for.  (Not the other way: a page written while
 * its unmerge was in flight, which was refused, is counted merged until
 * the next pass finds its copy on write again, which the model does not
 * play.) */
static void
assert_merged_counted(ModelVm *mv, guint k, const PfRegion *r, const char *when)
{
    const ModelRegion *mr = model_region(mv, k);

    for (gsize i = 0; i < r->n_pages; i++) {
        PfPageState st = pf_region_page_state(r, i);

        if (!mr->merged[i] || mr->kept[i] || st == PF_PAGE_SHARED || st == PF_PAGE_ZERO ||
            st == PF_PAGE_PENDING) {
            continue;
        }
        g_test_message("%s, %s: VM %s region %u page %zu: merged by its agent, state %u in "
                       "pagefoldd", model->context, when, mv->vm->name, k, i, st);
        g_assert_not_reached();
    }
}

/*
 * Every reference on every slot of the pool is accounted for, no more and
 * no fewer: one too many is a slot (and its chunk) that never comes back,
 * one too few a slot freed and reused while a guest page still maps it.
 */
void
check_model(Model *m, const char *when)
{
    PfScanner *s = m->s;
    g_autoptr(GHashTable) want = g_hash_table_new(NULL, NULL);
    /* What each VM is told it holds of the nodes (tree.h), walked. */
    g_autoptr(GHashTable) parts = g_hash_table_new_full(NULL, NULL, NULL, g_free);
    GHashTableIter it;
    gpointer key, value;
    gsize shared = 0, n_chunks, seen = 0, in_use = 0, nodes_in_use = 0;
    guint bad = 0;

    for (guint32 id = 1; id < s->stable.nodes->len; id++) {
        const PfStableNode *n = node_at(s, id);

        if (!n->live) {
            continue;
        }
        /* Lookups find exactly the nodes that can take one more sharer:
         * the full ones of a content cost them nothing. */
        g_assert_cmpint(node_listed(s, id), ==,
                        n->next == 0 && ledger_sharers(s, n) < s->setup.knobs.max_page_sharing);
        want_ref(want, n->slot);
        nodes_in_use += n->n_members > 0;
        g_assert_cmpint(g_hash_table_contains(s->stable.untracked, GUINT_TO_POINTER(id)), ==,
                        n->n_members > PF_SHARE_TRACKED);
        for (guint32 k = 0; k < n->n_members; k++) {
            PfRegion *r = region_of(s, n->members[k]);
            const PfPage *p = pf_region_page(r, n->members[k] - r->base);
            guint64 *part = g_hash_table_lookup(parts, r->vm);

            if (part == NULL) {
                part = g_new0(guint64, 1);
                g_hash_table_insert(parts, r->vm, part);
            }
            *part += n->n_members <= PF_SHARE_TRACKED ? PF_SHARE_ONE / n->n_members : 0;

            g_assert_cmpuint(p->state, ==, PF_PAGE_SHARED);
            g_assert_cmpuint(p->node, ==, id);
            if (n->slot == PF_POOL_SLOT_NONE) {
                continue;
            }
            /* Pool sharing is a merging VM's, whose agent holds the chunk
             * the page maps. */
            g_assert_true(pf_vm_merges(r->vm));
            g_assert_true(g_hash_table_contains(model_vm_of(r->vm)->agent->held,
                                                GUINT_TO_POINTER((n->slot - 1) /
                                                                 PF_POOL_CHUNK_SLOTS)));
            want_ref(want, n->slot);
        }
    }
    for (guint i = 0; i < s->vms.list->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms.list, i);
        ModelVm *mv = model_vm_of(vm);
        gsize counted = 0;

        /* Every page of the VM's live regions is in one state, and a
         * region that went is a placeholder that holds none. */
        for (guint k = 0; k < PF_PAGE_N_STATES; k++) {
            counted += vm->scan->count[k];
        }
        g_assert_cmpuint(counted, ==, pf_vm_n_pages(vm));
        {
            const guint64 *part = g_hash_table_lookup(parts, vm);

            g_assert_cmpuint(vm->scan->share, ==, part != NULL ? *part : 0);
        }
        g_assert_cmpuint(vm->regions->len, ==, mv->regions->len);
        for (guint k = 0; k < vm->regions->len; k++) {
            const PfRegion *r = g_ptr_array_index(vm->regions, k);

            g_assert_cmpint(pf_region_live(r), ==, !model_region(mv, k)->gone);
            g_assert_true(pf_region_live(r) || (r->n_pages == 0 && r->map == NULL &&
                                                r->fd < 0 && r->extents == NULL));
            if (pf_region_live(r) && !m->lying) {
                assert_merged_counted(mv, k, r, when);
            }
        }
        shared += vm->scan->count[PF_PAGE_SHARED];
        if (vm->kind == PF_VM_AGENT) {
            account_requests(s, vm, want);
        } else {
            g_assert_cmpuint(vm->scan->count[PF_PAGE_PENDING], ==, 0);
        }
    }
    g_assert_cmpuint(shared, ==, s->stable.n_members);
    g_assert_cmpuint(nodes_in_use, ==, s->stable.n_in_use);
    for (guint i = 0; i < s->vms.leftovers->len; i++) {
        Leftover *lo = g_ptr_array_index(s->vms.leftovers, i);

        for (guint k = 0; k < lo->refs->len; k++) {
            const HeldRef *h = &g_array_index(lo->refs, HeldRef, k);

            want_ref(want, h->slot);
            assert_node_holds(s, h->node, h->slot);
        }
    }
    if (s->pool == NULL) {
        g_assert_cmpuint(g_hash_table_size(want), ==, 0);
        return;
    }

    /* No reference is accounted to a slot of a chunk that is gone... */
    g_hash_table_iter_init(&it, want);
    while (g_hash_table_iter_next(&it, &key, NULL)) {
        g_assert_nonnull(pf_pool_chunk(s->pool, (GPOINTER_TO_UINT(key) - 1) /
                                                    PF_POOL_CHUNK_SLOTS));
    }
    /* ... and every slot of those there has what is accounted for.
     * Chunk ids are reused first: they stay dense. */
    n_chunks = pf_pool_n_chunks(s->pool);
    for (guint32 c = 0; seen < n_chunks && c < PF_PROTO_MAX_CHUNKS; c++) {
        if (pf_pool_chunk(s->pool, c) == NULL) {
            continue;
        }
        seen++;
        if (c == 0) {
            continue; /* the zero chunk */
        }
        for (guint32 k = 0; k < PF_POOL_CHUNK_SLOTS; k++) {
            guint32 slot = c * PF_POOL_CHUNK_SLOTS + k + 1;
            guint32 refs = pf_pool_refs(s->pool, slot);

            value = g_hash_table_lookup(want, GUINT_TO_POINTER(slot));
            if (refs != GPOINTER_TO_UINT(value) && bad++ < 8) {
                g_test_message("%s, %s: pool slot %u has %u reference(s), %u accounted for",
                               m->context, when, slot, refs, GPOINTER_TO_UINT(value));
            }
            in_use += refs > 0;
        }
    }
    g_assert_cmpuint(seen, ==, n_chunks);
    if (bad > 0) {
        g_test_message("%s, %s: %u slot(s) with references not accounted for", m->context,
                       when, bad);
    }
    g_assert_cmpuint(bad, ==, 0);
    g_assert_cmpuint(in_use, ==, pf_pool_slots_in_use(s->pool));
}
