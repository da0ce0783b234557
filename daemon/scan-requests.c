/*
 * scan-requests.c - what the scanner asks of agents, through each VM's
 * outbox, and what their answers make of a page.
 *
 * A request holds what its PfPending says (a reference on the slot of a
 * merge or unmerge, one on the slot a move leaves) from the moment it is
 * queued until it is answered, settled (its region left the VM) or
 * abandoned (its VM left).  Only an answer makes a page SHARED or ZERO:
 * the agent compares under write protection and has the last word.  Never
 * sends anything itself: the outbox's drain does.
 */
#include "scan-internal.h"

#include <errno.h>

/* Whether a remap of page id (kind, slot) continues the VM's last one: the
 * two then share a mapping in its process. */
static gboolean
continues_run(const PfVm *vm, guint32 id, PfItemKind kind, guint32 slot)
{
    return id == vm->run_next_page && kind == vm->run_kind &&
           (kind == PF_ITEM_ZERO || slot == vm->run_next_slot);
}

void
request_page(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, PfItemKind kind, guint32 slot,
             guint32 node, guint32 from)
{
    PfWireItem item = { 0 };
    PfPending pd = { .page = id, .slot = slot, .node = node, .from = from, .kind = (guint8)kind };
    PfVm *vm = r->vm;

    item.kind = (guint8)kind;
    item.region = r->index;
    item.page = id - r->base;
    if (slot != PF_POOL_SLOT_NONE && kind != PF_ITEM_UNMERGE) {
        pf_pool_locate(s->pool, slot, &item.chunk, &item.slot);
    }
    if (kind != PF_ITEM_UNMERGE) {
        huge_note(s, r, id - r->base);
    }
    set_state(r, p, PF_PAGE_PENDING);
    /* A remap that does not continue the previous one splits a mapping in
     * three at worst: count that until the next pass counts for real, so
     * a pass cannot overshoot the budget. */
    if (kind != PF_ITEM_UNMERGE && !continues_run(vm, id, kind, slot)) {
        vm->vmas += 2;
    }
    vm->run_next_page = id + 1;
    vm->run_next_slot = slot + 1;
    vm->run_kind = (guint8)kind;
    pf_outbox_push(vm->outbox, &item, &pd);
}

void
request_collapse(PfScanner *s, PfRegion *r, gsize idx)
{
    PfWireItem item = { .kind = PF_ITEM_COLLAPSE, .region = r->index, .page = idx };
    PfPending pd = { .page = r->base + (guint32)idx, .kind = PF_ITEM_COLLAPSE };

    pf_outbox_push(r->vm->outbox, &item, &pd);
}

/* What a request held (its slot, and the slot of the node it moves from)
 * is let go. */
static void
put_request(PfScanner *s, const PfPending *pd)
{
    ledger_put(s, pd->slot, pd->node);
    if (pd->from != 0) {
        ledger_put(s, node_at(s, pd->from)->slot, pd->from);
    }
}

typedef struct {
    PfScanner *s;
    guint32 first, n_pages; /* the page ids of the region that went */
} GoneRange;

/* A request for a page of a region that left the VM: whatever the agent
 * did with it, the page maps no pool slot now (the agent mapped all of the
 * region from its memfd before it said GONE), so what the request held is
 * let go now, once, and its answer, if it comes, changes nothing.  It is
 * marked settled before its references go: the last of them may free its
 * node, its slot and the slot's chunk, and the chunk's DROP goes out
 * while the outbox still has the request, which must then read as holding
 * nothing (pool.h: a chunk goes only when no request holds a slot of
 * it). */
static gboolean
settle_gone_cb(PfPending *pd, gpointer user)
{
    GoneRange *g = user;
    PfPending held = *pd;

    if (pd->settled || pd->page - g->first >= g->n_pages) {
        return FALSE;
    }
    pd->settled = TRUE;
    if (held.kind != PF_ITEM_COLLAPSE) {
        put_request(g->s, &held);
    }
    return TRUE;
}

void
requests_settle_region(PfScanner *s, PfRegion *r)
{
    GoneRange g = { s, r->base, (guint32)r->n_pages };

    if (r->vm->outbox != NULL) {
        pf_outbox_withdraw(r->vm->outbox, settle_gone_cb, &g);
    }
}

typedef struct {
    PfScanner *s;
    GArray *keep;
} Abandon;

static void
abandon_cb(const PfPending *pd, gboolean sent, gpointer user)
{
    Abandon *ab = user;
    PfRegion *r;
    PfPage *p;

    if (pd->kind == PF_ITEM_COLLAPSE || pd->settled) {
        return;
    }
    r = region_of(ab->s, pd->page);
    p = pf_region_page(r, pd->page - r->base);
    /* Sent, the agent may have done it or not: its slot may be mapped,
     * and the one it was moving from.  Never sent, nothing was done: only
     * the slot it moved from may be mapped. */
    if (pd->kind != PF_ITEM_ZERO) {
        ledger_hold_or_put(ab->s, sent ? ab->keep : NULL, pd->slot, pd->node);
    }
    if (pd->from != 0) {
        ledger_hold_or_put(ab->s, ab->keep, node_at(ab->s, pd->from)->slot, pd->from);
    }
    reset_page(r, p, PF_PAGE_VOLATILE);
}

void
requests_abandon(PfScanner *s, PfVm *vm, GArray *keep)
{
    Abandon ab = { s, keep };

    if (vm->outbox != NULL) {
        pf_outbox_set_drain(vm->outbox, NULL, NULL);
        pf_outbox_abandon(vm->outbox, abandon_cb, &ab);
    }
}

/* ---- answers ---- */

static void
log_refusal(PfVm *vm, const PfPending *pd, guint32 page, int err)
{
    static const char *const verb[] = { "", "merge", "zero", "unmerge", "collapse" };

    /* A page in DMA (EBUSY), an agent stepping back whose ADVISE is on its
     * way (EPERM): expected, and passing, page after page. */
    if (err == EBUSY || err == EPERM) {
        g_debug("VM %s: agent could not %s page %u: %s", vm->name, verb[pd->kind], page,
                g_strerror(err));
    } else {
        g_message("VM %s: agent could not %s page %u: %s", vm->name, verb[pd->kind], page,
                  g_strerror(err));
    }
    if (err == ENOMEM) {
        /* Out of mappings: no more merges until the next count. */
        vm->vmas = vm->vma_budget;
    }
}

/* A merge answered: DONE makes the page a sharer; otherwise a move that
 * did not happen leaves it on its old node, or unmerged.  TRUE when the
 * page's state is settled. */
static gboolean
merge_answered(PfScanner *s, PfRegion *r, PfPage *p, const PfPending *pd,
               PfResultStatus status, int err)
{
    if (status == PF_RESULT_DONE) {
        pf_stable_tree_add(&s->stable, pd->node, pd->page);
        mark_merged(r, p, PF_PAGE_SHARED);
        if (pd->from != 0) {
            ledger_put(s, node_at(s, pd->from)->slot, pd->from);
        }
        /* Its node moved while it was on its way in: after it. */
        moves_follow(s, r, pd->page - r->base);
        return TRUE;
    }
    ledger_put(s, pd->slot, pd->node);
    if (pd->from == 0) {
        return FALSE;
    }
    /* A move that did not happen: still on the old slot, unless written
     * meanwhile (the compare failed) or the agent had to fold it back (its
     * mapping went with a failed remap).  Only a page in DMA is known to be
     * as it was, and tries again later; the others are unmerged, which is
     * right in each case and keeps the count true. */
    pf_stable_tree_add(&s->stable, pd->from, pd->page);
    mark_merged(r, p, PF_PAGE_SHARED);
    if (status == PF_RESULT_CHANGED) {
        r->vm->cow++;
    }
    if (status != PF_RESULT_ERROR || err != EBUSY) {
        pf_scanner_end_sharing(s, r, pd->page - r->base);
    }
    return TRUE;
}

/* An unmerge answered: DONE puts the page back in its memfd; otherwise it
 * is still mapped from its slot (in DMA, or the kernel refused) and its
 * copy on write is found again at the next pass, which asks again.  TRUE
 * when the page's state is settled. */
static gboolean
unmerge_answered(PfScanner *s, PfRegion *r, PfPage *p, const PfPending *pd,
                 PfResultStatus status)
{
    if (status == PF_RESULT_DONE) {
        ledger_put(s, pd->slot, pd->node);
        reset_page(r, p, PF_PAGE_VOLATILE);
        huge_restore(s, r, pd->page - r->base);
        return TRUE;
    }
    if (pd->node != 0 && node_at(s, pd->node)->live) {
        pf_stable_tree_add(&s->stable, pd->node, pd->page);
        mark_merged(r, p, PF_PAGE_SHARED);
        return TRUE;
    }
    if (pd->slot == PF_POOL_SLOT_NONE) {
        mark_merged(r, p, PF_PAGE_ZERO);
        return TRUE;
    }
    g_warning("VM %s: page %u could not be folded back; pool slot %u stays taken", r->vm->name,
              pd->page - r->base, pd->slot);
    return FALSE;
}

/* The agent's answer for one page. */
static void
complete(PfScanner *s, PfVm *vm, const PfPending *pd, PfResultStatus status, int err)
{
    PfRegion *r;
    PfPage *p;
    gboolean done = FALSE;

    if (pd->settled) {
        return; /* its region left the VM: all it held is let go */
    }
    r = region_of(s, pd->page);
    p = pf_region_page(r, pd->page - r->base);
    if (pd->kind == PF_ITEM_COLLAPSE) {
        if (status != PF_RESULT_DONE) {
            g_debug("VM %s: no huge page again at page %u: %s", vm->name, pd->page - r->base,
                    g_strerror(err));
        }
        return;
    }
    g_return_if_fail(r->vm == vm && p->state == PF_PAGE_PENDING);
    if (!pf_vm_merges(vm)) {
        /* It stepped back since (ADVISE): every page it had remapped is
         * in its memfd again, whatever it answers now, and the slots it
         * was merging to or from are let go. */
        put_request(s, pd);
        reset_page(r, p, PF_PAGE_VOLATILE);
        return;
    }
    if (status == PF_RESULT_ERROR) {
        log_refusal(vm, pd, pd->page - r->base, err);
    }
    switch (pd->kind) {
    case PF_ITEM_MERGE:
        done = merge_answered(s, r, p, pd, status, err);
        break;
    case PF_ITEM_ZERO:
        if (status == PF_RESULT_DONE) {
            mark_merged(r, p, PF_PAGE_ZERO);
            done = TRUE;
        }
        break;
    case PF_ITEM_UNMERGE:
        done = unmerge_answered(s, r, p, pd, status);
        break;
    default:
        break;
    }
    if (!done) {
        reset_page(r, p, PF_PAGE_VOLATILE);
    }
}

void
pf_scanner_answer(PfScanner *s, PfVm *vm, const PfWireResult *res, guint32 n)
{
    g_autoptr(PfOutBatch) b = pf_outbox_pop_answered(vm->outbox);

    g_return_if_fail(b != NULL && b->pending->len == n);
    for (guint32 i = 0; i < n; i++) {
        complete(s, vm, &g_array_index(b->pending, PfPending, i), (PfResultStatus)res[i].status,
                 res[i].err);
    }
    /* The window has room again; and answers can call for more (a huge
     * page to collapse, a node that moved): they may go now. */
    pf_outbox_flush(vm->outbox);
}
