/*
 * scan-moves.c - who may read a slot.  A VM maps only slots of the chunks
 * it was sent, each made for one set of VMs (pool.h).  A page that joins a
 * node its VM holds no chunk of either waits until the cursor is done with
 * its VM in that pass, when its VM is made one of the chunk's if its pages
 * match every slot of it in use, or the node moves: the content gets a
 * slot for its members' VMs and the newcomer's, the members are merged
 * over to it (the agent compares and remaps, as for any merge), and the
 * old node is retired, going with its last member.  KSM has no such
 * step: in one kernel every page is in every process's reach.
 *
 * Owns the joins waiting and the order of a move; never gives a VM a chunk
 * with content it does not share, and changes slot references only
 * through the ledger.
 */
#include "scan-core.h"

#include <stdlib.h>
#include <string.h>

static int
cmp_u32(gconstpointer a, gconstpointer b)
{
    guint32 x = *(const guint32 *)a, y = *(const guint32 *)b;

    return x < y ? -1 : x > y;
}

gboolean
moves_chunk_is_for(const PfPoolChunk *chunk, const PfVm *vm)
{
    if (vm->kind == PF_VM_BY_PID) {
        return FALSE;
    }
    if (chunk->n_vms == 0) {
        return TRUE;
    }
    return bsearch(&vm->scan->serial, chunk->vms, chunk->n_vms, sizeof(guint32), cmp_u32) != NULL;
}

static guint32 move_node(PfScanner *s, guint32 node, PfVm *joiner);

void
moves_join(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, guint32 to)
{
    guint32 from = p->state == PF_PAGE_SHARED ? p->node : 0, slot;

    if (!pf_pool_readable(s->pool, node_at(s, to)->slot, r->vm->scan->serial) &&
        (to = move_node(s, to, r->vm)) == 0) {
        return;
    }
    slot = node_at(s, to)->slot;
    if (from != 0) {
        /* Its reference on the old slot goes when the agent answers. */
        pf_stable_tree_remove(&s->stable, id);
    }
    ledger_take(s, slot, to);
    request_page(s, r, p, id, PF_ITEM_MERGE, slot, to, from);
}

/* The VMs a node's slot is for that are still here, and the joiner:
 * sorted, each once (the joiner holds no chunk of the node's). */
static GArray *
move_vms(PfScanner *s, const PfStableNode *n, PfVm *joiner)
{
    GArray *vms = g_array_new(FALSE, FALSE, sizeof(guint32));
    guint32 c, index;
    const PfPoolChunk *chunk;

    pf_pool_locate(s->pool, n->slot, &c, &index);
    chunk = pf_pool_chunk(s->pool, c);
    if (joiner != NULL) {
        g_array_append_val(vms, joiner->scan->serial);
    }
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (pf_vm_merges(vm) && moves_chunk_is_for(chunk, vm)) {
            g_array_append_val(vms, vm->scan->serial);
        }
    }
    g_array_sort(vms, cmp_u32);
    return vms;
}

/*
 * Gives node id's content a new slot, for the VMs its slot was for (those
 * of its members, and of pages on their way in) that are still here, and
 * the joiner's, and moves its members there.  A member whose VM is at its
 * mapping budget, or a page still on its way in, follows later
 * (moves_follow()).  Returns the new node, or 0 (the node as it was) if it
 * cannot move now.
 */
static guint32
move_node(PfScanner *s, guint32 id, PfVm *joiner)
{
    g_autoptr(GArray) vms = move_vms(s, node_at(s, id), joiner);
    g_autoptr(GError) error = NULL;
    g_autofree guint32 *members = NULL;
    const PfStableNode *n = node_at(s, id);
    guint32 n_members = n->n_members, slot, to;
    guint64 checksum = n->checksum;

    slot = ledger_new_slot(s, (const guint32 *)(gpointer)vms->data, vms->len,
                           pf_pool_data(s->pool, n->slot), &error);
    if (slot == PF_POOL_SLOT_NONE) {
        g_warning("pool: %s", error->message);
        return 0;
    }
    members = g_memdup2(n->members, n_members * sizeof(guint32));
    to = pf_stable_tree_create(&s->stable, checksum, slot, n->domain); /* n may move */
    pf_stable_tree_retire(&s->stable, id, to);
    for (guint32 i = 0; i < n_members; i++) {
        PfRegion *mr = region_of(s, members[i]);

        if (can_merge(mr->vm)) {
            moves_join(s, mr, pf_region_page(mr, members[i] - mr->base), members[i], to);
        }
    }
    if (joiner == NULL && node_at(s, to)->n_members == 0 && pf_pool_refs(s->pool, slot) == 1) {
        /* Nobody could move: the old node stays as it was. */
        ledger_maybe_drop(s, to);
        pf_stable_tree_unretire(&s->stable, id);
        return 0;
    }
    return to;
}

/*
 * A merged page of a retired node (it could not move with the others, or
 * came in while they moved) follows the node's successor.  With none left
 * (every page that moved there has gone since), the node takes its place
 * again.
 */
void
moves_follow(PfScanner *s, PfRegion *r, gsize idx)
{
    guint32 node = pf_region_page(r, idx)->node, to = node_at(s, node)->next;
    const PfStableNode *n = node_at(s, node);

    if (to == 0 || !can_merge(r->vm) || setup_of(s)->knobs.run == 2) {
        return;
    }
    for (guint hops = 0; to != 0 && hops < 8; hops++) {
        const PfStableNode *t = node_at(s, to);

        if (!t->live || t->slot == PF_POOL_SLOT_NONE || t->checksum != n->checksum ||
            memcmp(pf_pool_data(s->pool, t->slot), pf_pool_data(s->pool, n->slot),
                   PF_PAGE_SIZE) != 0) {
            break;
        }
        if (t->next == 0) {
            if (ledger_sharers(s, t) < setup_of(s)->knobs.max_page_sharing) {
                moves_join(s, r, pf_region_page(r, idx), r->base + (guint32)idx, to);
                return;
            }
            break;
        }
        to = t->next;
    }
    pf_stable_tree_unretire(&s->stable, node);
}

/* Could any member of the node be moved now? */
static gboolean
node_can_move(PfScanner *s, const PfStableNode *n)
{
    for (guint32 i = 0; i < n->n_members; i++) {
        if (can_merge(region_of(s, n->members[i])->vm)) {
            return TRUE;
        }
    }
    return FALSE;
}

/* Not while none of their pages could follow: that would only make and
 * free a slot each pass. */
void
moves_evacuate(PfScanner *s)
{
    if (s->pool == NULL || pf_pool_n_evacuating(s->pool) == 0) {
        return;
    }
    for (guint32 id = 1; id < s->stable.nodes->len; id++) {
        const PfStableNode *n = node_at(s, id);

        if (n->live && n->next == 0 && n->slot != PF_POOL_SLOT_NONE &&
            pf_pool_evacuating(s->pool, n->slot) && node_can_move(s, n)) {
            move_node(s, id, NULL);
        }
    }
}

/* The pages waiting to join one node (s->moves.waiting, by node id): joins found
 * and not yet made or given up.  born tells them from the joins of an
 * earlier node under the same id, which the reused id does not count. */
typedef struct {
    guint64 born;
    guint32 n;
} Waiting;

static guint32
waiting_for(PfScanner *s, guint32 node)
{
    const Waiting *w = g_hash_table_lookup(s->moves.waiting, GUINT_TO_POINTER(node));

    return w != NULL && w->born == node_at(s, node)->born ? w->n : 0;
}

/* A join leaves the waiting: made, found stale, put off a pass, or its VM
 * moved to another merge domain (a VM that goes takes all joins along, and
 * the table is cleared).  The entry goes with its last join, so the table
 * holds only the nodes that pages wait for. */
static void
waiting_done(PfScanner *s, const Joining *j)
{
    Waiting *w = g_hash_table_lookup(s->moves.waiting, GUINT_TO_POINTER(j->node));

    if (w != NULL && w->born == j->born && --w->n == 0) {
        g_hash_table_remove(s->moves.waiting, GUINT_TO_POINTER(j->node));
    }
}

gboolean
moves_room_to_wait(PfScanner *s, guint32 node)
{
    return ledger_sharers(s, node_at(s, node)) + waiting_for(s, node) <
           setup_of(s)->knobs.max_page_sharing;
}

void
moves_wait_to_join(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, guint32 node)
{
    const PfStableNode *n = node_at(s, node);
    Joining j = { 0, r->vm->scan->serial, n->slot, id, node, n->born };
    Waiting *w = g_hash_table_lookup(s->moves.waiting, GUINT_TO_POINTER(node));
    guint32 index;

    if (w == NULL) {
        w = g_new0(Waiting, 1);
        g_hash_table_insert(s->moves.waiting, GUINT_TO_POINTER(node), w);
    }
    if (w->born != n->born) {
        *w = (Waiting){ n->born, 0 };
    }
    w->n++;

    pf_pool_locate(s->pool, n->slot, &j.chunk, &index);
    g_array_append_val(s->moves.joins, j);
    set_state(r, p, PF_PAGE_UNSHARED);
    if (s->moves.joins->len >= MAX_JOINING) {
        moves_make_joins(s);
    }
}

void
moves_forget_joins(PfScanner *s, const PfVm *vm)
{
    if (vm == NULL) {
        g_array_set_size(s->moves.joins, 0);
        g_array_set_size(s->moves.joining, 0);
        s->moves.joining_at = 0;
        g_hash_table_remove_all(s->moves.waiting);
        return;
    }
    for (guint i = s->moves.joins->len; i-- > 0;) {
        if (g_array_index(s->moves.joins, Joining, i).vm == vm->scan->serial) {
            waiting_done(s, &g_array_index(s->moves.joins, Joining, i));
            g_array_remove_index_fast(s->moves.joins, i);
        }
    }
    /* The batch being made stays sorted: one sweep. */
    {
        guint to = s->moves.joining_at;

        for (guint i = s->moves.joining_at; i < s->moves.joining->len; i++) {
            const Joining *j = &g_array_index(s->moves.joining, Joining, i);

            if (j->vm != vm->scan->serial) {
                g_array_index(s->moves.joining, Joining, to++) = *j;
            } else {
                waiting_done(s, j);
            }
        }
        g_array_set_size(s->moves.joining, to);
    }
}

static int
cmp_joining(gconstpointer a, gconstpointer b)
{
    const Joining *x = a, *y = b;

    if (x->chunk != y->chunk) {
        return x->chunk < y->chunk ? -1 : 1;
    }
    if (x->vm != y->vm) {
        return x->vm < y->vm ? -1 : 1;
    }
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/*
 * Whether guest pages are in memory (page_in_memory()), looked up
 * RESIDENT_PAGES at a time: the joins of one chunk and VM come in slot
 * order, which is mostly the order of their pages, and one mincore() a
 * page was a good part of making tens of thousands of joins.
 */
typedef struct {
    const guint8 *base;
    gsize n;
    guint8 v[RESIDENT_PAGES];
} Resident;

static gboolean
resident(Resident *c, const PfRegion *r, const guint8 *page)
{
    if (c->base == NULL || page < c->base || page >= c->base + c->n * PF_PAGE_SIZE) {
        c->base = page;
        c->n = MIN(RESIDENT_PAGES, (gsize)(r->map + r->n_pages * PF_PAGE_SIZE - page) /
                                       PF_PAGE_SIZE);
        /* Failed: none is taken to be (it is not read). */
        if (mincore((void *)page, c->n * PF_PAGE_SIZE, c->v) < 0) {
            memset(c->v, 0, c->n);
        }
    }
    return c->v[(page - c->base) / PF_PAGE_SIZE] & 1;
}

/* Can this waiting page still join the node it was found equal to?  The
 * same node (not one made since under its id), and the page still equal
 * to its slot now (compared where res is given, else as it was then):
 * what decides that its VM may be sent the slot's chunk, or get a slot of
 * that content of its own. */
static gboolean
join_still(PfScanner *s, Joining *j, Resident *res)
{
    PfRegion *r = region_of(s, j->page);
    const PfStableNode *n = node_at(s, j->node);

    /* Its VM may have changed merge domain since it was found equal. */
    if (pf_region_page_state(r, j->page - r->base) != PF_PAGE_UNSHARED || !can_merge(r->vm) ||
        !n->live || n->born != j->born || n->next != 0 || n->slot != j->slot ||
        n->domain != pf_vm_domain_key(r->vm) ||
        ledger_sharers(s, n) >= setup_of(s)->knobs.max_page_sharing) {
        return FALSE;
    }
    if (res != NULL) {
        const guint8 *page = page_data(s, j->page);

        j->equal = resident(res, r, page) &&
                   (s->moves.memcmp_calls++,
                    memcmp(page, pf_pool_data(s->pool, n->slot), PF_PAGE_SIZE) == 0);
    }
    return j->equal;
}

/* The joins of joining[i, e) (one chunk, one VM) whose pages still may
 * join, counted by distinct slot; each page compared with its slot. */
static guint
distinct_joining(PfScanner *s, guint i, guint e)
{
    guint32 last_slot = PF_POOL_SLOT_NONE;
    guint distinct = 0;
    Resident res = { NULL, 0, { 0 } };

    for (; i < e; i++) {
        Joining *j = &g_array_index(s->moves.joining, Joining, i);

        if (join_still(s, j, &res) && j->slot != last_slot) {
            distinct++;
            last_slot = j->slot;
        }
    }
    return distinct;
}

/* A VM's pages matched part of a chunk: the rest may be written by then (a
 * guest that rewrites a block, caught halfway by a pass).  Moving costs
 * every sharer a remap: only at the next pass that sees it.  TRUE when the
 * pages are to wait for that pass. */
static gboolean
partial_waits(PfScanner *s, const Joining *first)
{
    guint64 key = (guint64)first->chunk << 32 | first->vm;
    gpointer seen;

    if (!g_hash_table_lookup_extended(s->moves.partial, &key, NULL, &seen) ||
        GPOINTER_TO_SIZE(seen) >= s->moves.joining_pass) {
        g_hash_table_insert(s->moves.partial, g_memdup2(&key, sizeof(key)),
                            GSIZE_TO_POINTER(s->moves.joining_pass));
        return TRUE;
    }
    g_hash_table_remove(s->moves.partial, &key);
    return FALSE;
}

static void
partial_expire(PfScanner *s)
{
    GHashTableIter it;
    gpointer seen;

    g_hash_table_iter_init(&it, s->moves.partial);
    while (g_hash_table_iter_next(&it, NULL, &seen)) {
        if (GPOINTER_TO_SIZE(seen) + 1 < s->moves.joining_pass) {
            g_hash_table_iter_remove(&it);
        }
    }
}

/*
 * The pages that matched nodes their VM may not read.  Where
 * a VM's pages match every slot in use of a chunk (a VM that came to share
 * what others share: typically all of it), the chunk becomes its too (it
 * reads nothing it does not share) and its pages just merge; elsewhere
 * their nodes move (moves_join()), which costs a remap of every page
 * already sharing.  Tens of thousands of joins take a good part of a
 * second: they are made a chunk and VM at a time, as many as the scan's
 * slice leaves time for, and the scan goes on with the rest first
 * (moves_continue_joins()).  join_still() checks each again as it is made.
 */
static void
queue_joins(PfScanner *s, const Joining *joins, guint n)
{
    g_array_remove_range(s->moves.joining, 0, s->moves.joining_at);
    s->moves.joining_at = 0;
    g_array_append_vals(s->moves.joining, joins, n);
    s->moves.joining_pass = pass_of(s)->full_scans;
    g_array_sort(s->moves.joining, cmp_joining);
}

void
moves_make_joins(PfScanner *s)
{
    if (s->moves.joins->len > 0) {
        queue_joins(s, (const Joining *)(gpointer)s->moves.joins->data, s->moves.joins->len);
        g_array_set_size(s->moves.joins, 0);
    }
    moves_continue_joins(s);
}

void
moves_make_vm_joins(PfScanner *s, const PfVm *vm)
{
    g_autoptr(GArray) mine = g_array_new(FALSE, FALSE, sizeof(Joining));
    guint to = 0;

    for (guint i = 0; i < s->moves.joins->len; i++) {
        const Joining *j = &g_array_index(s->moves.joins, Joining, i);

        if (j->vm == vm->scan->serial) {
            g_array_append_val(mine, *j);
        } else {
            g_array_index(s->moves.joins, Joining, to++) = *j;
        }
    }
    g_array_set_size(s->moves.joins, to);
    if (mine->len > 0) {
        queue_joins(s, (const Joining *)(gpointer)mine->data, mine->len);
        moves_continue_joins(s);
    }
}

gboolean
moves_continue_joins(PfScanner *s)
{
    guint start = s->moves.joining_at, i = start;

    while (i < s->moves.joining->len && !(i > start && past_slice(s))) {
        const Joining *first;
        guint e = i, distinct;

        /* A VM that goes meanwhile takes its joins from here on out. */
        s->moves.joining_at = i;
        first = &g_array_index(s->moves.joining, Joining, i);

        while (e < s->moves.joining->len &&
               g_array_index(s->moves.joining, Joining, e).chunk == first->chunk &&
               g_array_index(s->moves.joining, Joining, e).vm == first->vm) {
            e++;
        }
        distinct = distinct_joining(s, i, e);
        /* An adopted chunk's freed slots keep what they held: a VM joins
         * its nodes by a move. */
        if (pf_pool_is_adopted(s->pool, first->chunk)) {
            distinct = 0;
        }
        if (distinct > 0 && distinct == pf_pool_chunk_live(s->pool, first->chunk)) {
            PfRegion *r = region_of(s, first->page);

            pf_pool_extend(s->pool, first->chunk, first->vm);
            scan_emit_chunk(s, r->vm, pf_pool_chunk(s->pool, first->chunk), FALSE);
        } else if (distinct > 0 && partial_waits(s, first)) {
            for (; i < e; i++) {
                waiting_done(s, &g_array_index(s->moves.joining, Joining, i));
            }
            continue;
        }
        for (; i < e && i < s->moves.joining->len; i++) {
            /* A copy, read again after moves_join(): waiting_done() must
             * not depend on a join leaving joining as it was. */
            Joining j = g_array_index(s->moves.joining, Joining, i);

            if (join_still(s, &j, NULL)) {
                PfRegion *r = region_of(s, j.page);

                moves_join(s, r, pf_region_page(r, j.page - r->base), j.page, j.node);
            }
            waiting_done(s, &j);
        }
    }
    s->moves.joining_at = i;
    if (i < s->moves.joining->len) {
        return FALSE;
    }
    g_array_set_size(s->moves.joining, 0);
    s->moves.joining_at = 0;
    partial_expire(s);
    return TRUE;
}

/* ---- the pool, and who is sent which chunk ---- */

static void
new_chunk_cb(const PfPoolChunk *chunk, gpointer user)
{
    PfScanner *s = user;

    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (pf_vm_merges(vm) && moves_chunk_is_for(chunk, vm)) {
            scan_emit_chunk(s, vm, chunk, FALSE);
        }
    }
}

/* A VM that stepped back to advise mode still holds the chunk: it is told
 * too, and checked later (scan-reads.c's reads_check_dropped()).  One that is
 * gone lets go of it with its process. */
static void
drop_chunk_cb(const PfPoolChunk *chunk, gpointer user)
{
    PfScanner *s = user;

    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (moves_chunk_is_for(chunk, vm)) {
            PfDropped d = { chunk->ino, pf_outbox_sent_seq(vm->outbox), g_get_monotonic_time() };

            scan_emit_chunk(s, vm, chunk, TRUE);
            if (vm->scan->dropped == NULL) {
                vm->scan->dropped = g_array_new(FALSE, FALSE, sizeof(PfDropped));
            }
            g_array_append_val(vm->scan->dropped, d);
        }
    }
}

PfPool *
pf_scanner_get_pool(PfScanner *s)
{
    if (s->pool == NULL) {
        s->pool = pf_pool_new(new_chunk_cb, drop_chunk_cb, s);
    }
    return s->pool;
}

void
moves_init(PfScanner *s)
{
    s->moves.joins = g_array_new(FALSE, FALSE, sizeof(Joining));
    s->moves.joining = g_array_new(FALSE, FALSE, sizeof(Joining));
    s->moves.partial = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, NULL);
    s->moves.waiting = g_hash_table_new_full(NULL, NULL, NULL, g_free);
}

void
moves_clear(PfScanner *s)
{
    g_array_unref(s->moves.joins);
    g_array_unref(s->moves.joining);
    g_hash_table_unref(s->moves.partial);
    g_hash_table_unref(s->moves.waiting);
}
