/*
 * scan-requests.c - what the scanner asks of agents, through each VM's
 * outbox, and what a request holds until it is answered (scan-answers.c),
 * settled (its region left the VM) or abandoned (its VM left): a reference
 * on the slot of a merge or unmerge, one on the slot a move leaves, as its
 * PfPending says.  Never sends anything itself (the outbox's drain does),
 * and never makes a page merged: only an answer does.
 */
#include "scan-core.h"

#include <errno.h>

/* Whether a remap of page id (kind, slot) continues the VM's last one: the
 * two then share a mapping in its process. */
static gboolean
continues_run(const PfVm *vm, guint32 id, PfItemKind kind, guint32 slot)
{
    return id == vm->scan->run_next_page && kind == vm->scan->run_kind &&
           (kind == PF_ITEM_ZERO || slot == vm->scan->run_next_slot);
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
        vm->scan->vmas += 2;
        vm->scan->vmas_since_look += 2;
    }
    vm->scan->run_next_page = id + 1;
    vm->scan->run_next_slot = slot + 1;
    vm->scan->run_kind = (guint8)kind;
    pf_outbox_push(vm->outbox, &item, &pd);
}

void
request_collapse(PfScanner *s, PfRegion *r, gsize idx)
{
    PfWireItem item = { .kind = PF_ITEM_COLLAPSE, .region = r->index, .page = idx };
    PfPending pd = { .page = r->base + (guint32)idx, .kind = PF_ITEM_COLLAPSE };

    pf_outbox_push(r->vm->outbox, &item, &pd);
}

void
request_put(PfScanner *s, const PfPending *pd)
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
        request_put(g->s, &held);
    }
    return TRUE;
}

void
requests_settle_region(PfScanner *s, PfRegion *r)
{
    GoneRange g = { s, r->base, (guint32)r->n_pages };

    if (r->vm->kind == PF_VM_AGENT) {
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

    if (vm->kind == PF_VM_AGENT) {
        pf_outbox_set_drain(vm->outbox, NULL, NULL);
        pf_outbox_abandon(vm->outbox, abandon_cb, &ab);
    }
}

/*
 * A background batch's requests wait a little for the next batches' (the
 * cursor's next pages, at KSM's pace a hundred every 20 ms): an agent
 * pays for each window of pages near each other two TLB flushes, which a
 * few merges a request never share.  A pass's end, a scan the control
 * socket asked for, and the requests an answer leads to go at once.
 */
#define RIPE_ITEMS 256u
#define RIPE_USEC (100 * G_TIME_SPAN_MILLISECOND)

void
pf_scanner_flush_ripe(PfScanner *s, gint64 horizon_usec)
{
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (vm->kind == PF_VM_AGENT &&
            (pf_outbox_n_queued(vm->outbox) >= RIPE_ITEMS ||
             (pf_outbox_n_queued(vm->outbox) > 0 &&
              pf_outbox_queued_usec(vm->outbox) + horizon_usec >= RIPE_USEC))) {
            pf_outbox_flush(vm->outbox);
        }
    }
}

void
pf_scanner_flush(PfScanner *s)
{
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (vm->kind == PF_VM_AGENT) {
            pf_outbox_flush(vm->outbox);
        }
    }
}
