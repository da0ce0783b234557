/*
 * scan-answers.c - what an agent's answers make of a page.  Only an answer
 * makes a page SHARED or ZERO: the agent compares under write protection
 * and has the last word.  An answer settles what its request held (its
 * slot references, through the ledger) and may ask for more (a fold-back,
 * a huge page made again), which goes with the outbox's next flush.
 * Never trusts an answer for a page that is not pending in that VM.
 */
#include "scan-core.h"

#include <errno.h>

/* After an unmerge: an extent that was a huge page, with no merged page
 * left, is made one again, by the agent (only it can lift its write
 * protection) or, attached by pid, from here. */
static void
restore_huge(PfScanner *s, PfRegion *r, gsize idx)
{
    gsize first;

    if (!huge_restorable(s, r, idx, &first)) {
        return;
    }
    if (r->vm->kind == PF_VM_AGENT) {
        request_collapse(s, r, first);
    } else {
        huge_collapse_by_pid(r, first);
    }
}

static void
log_refusal(PfVm *vm, const PfPending *pd, guint32 page, int err)
{
    static const char *const verb[] = { "", "merge", "zero", "unmerge", "collapse" };

    /* A page in DMA (EBUSY), an agent stepping back whose ADVISE is on its
     * way (EPERM): expected, and passing, page after page. */
    if (err == EBUSY || err == EPERM) {
        g_debug("VM %s: agent could not %s page %u: %s", vm->name, verb[pd->kind], page,
                g_strerror(err));
        return;
    }
    /*
     * Said once until a merge goes through: a state that lasts (a back-end
     * that never settles, or one the agent gave up on) refuses every
     * window, and the log is where the user finds out why, not a flood.
     */
    if (err != vm->scan->refusing) {
        if (err == EINPROGRESS) {
            g_message("VM %s: merges wait for a vhost-user back-end of its to map its new "
                      "memory table or let go of guest RAM", vm->name);
        } else {
            g_message("VM %s: agent could not %s page %u: %s (said once until a merge goes "
                      "through)", vm->name, verb[pd->kind], page, g_strerror(err));
        }
        vm->scan->refusing = err;
    }
    if (err == ENOMEM) {
        /* Out of mappings: no more merges until the next count. */
        vm->scan->vmas = vm->scan->vma_budget;
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
     * mapping went with a failed remap).  Only a page in DMA, or one not
     * touched while a back-end settles, is known to be as it was, and
     * tries again later; the others are unmerged, which is right in each
     * case and keeps the count true. */
    pf_stable_tree_add(&s->stable, pd->from, pd->page);
    mark_merged(r, p, PF_PAGE_SHARED);
    if (status == PF_RESULT_CHANGED) {
        r->vm->scan->cow++;
    }
    if (status != PF_RESULT_ERROR || (err != EBUSY && err != EINPROGRESS)) {
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
        restore_huge(s, r, pd->page - r->base);
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
        request_put(s, pd);
        reset_page(r, p, PF_PAGE_VOLATILE);
        return;
    }
    if (status == PF_RESULT_ERROR) {
        log_refusal(vm, pd, pd->page - r->base, err);
    } else if ((pd->kind == PF_ITEM_MERGE || pd->kind == PF_ITEM_ZERO) &&
               vm->scan->refusing != 0) {
        /* Past the agent's holds: an unmerge takes none, and says nothing. */
        if (vm->scan->refusing == EINPROGRESS) {
            g_message("VM %s: merges go on: its back-ends settled", vm->name);
        }
        vm->scan->refusing = 0;
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
    guint n_vms = vm_count(s);
    g_autofree gsize *queued = g_new0(gsize, n_vms);

    g_return_if_fail(b != NULL && b->pending->len == n);
    for (guint i = 0; i < n_vms; i++) {
        queued[i] = vm_at(s, i)->kind == PF_VM_AGENT ? pf_outbox_n_queued(vm_at(s, i)->outbox) : 0;
    }
    for (guint32 i = 0; i < n; i++) {
        complete(s, vm, &g_array_index(b->pending, PfPending, i), (PfResultStatus)res[i].status,
                 res[i].err);
    }
    /*
     * The window has room again; and answers can call for more (a huge
     * page to collapse; a node that moved, whose other members' VMs are
     * asked too): those go now, as a scan's requests go as it ends.  What
     * a background batch holds back waits for its own time.
     */
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *v = vm_at(s, i);

        if (v->kind == PF_VM_AGENT &&
            (vm_count(s) != n_vms || pf_outbox_n_queued(v->outbox) > queued[i])) {
            pf_outbox_flush(v->outbox);
        }
    }
    pf_scanner_flush_ripe(s, 0);
}
