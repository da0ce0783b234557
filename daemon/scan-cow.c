/*
 * scan-cow.c - the end of sharing.  Merged pages are holes of the memfd
 * (or, where a punch could not free a page of a huge one, zeroed data
 * nobody maps: the visit looks there).  One the guest wrote has been
 * copied on write into an anonymous page of its own, which cow.c finds in
 * pagemap, swapped out or merged by host KSM as well.  Such a page leaves
 * its node now, and its agent is asked to fold it back into the memfd,
 * where the scanner can see it again.  Pages an agent put back in the
 * memfd itself (it stepped back, or RAM was discarded) are forgotten here
 * too.  Never reads a page: only page tables and records.
 */
#include "scan-core.h"

void
pf_scanner_end_sharing(PfScanner *s, PfRegion *r, gsize idx)
{
    PfPage *p = pf_region_page(r, idx);
    guint32 id = r->base + (guint32)idx, node = 0, slot = PF_POOL_SLOT_NONE;

    if (p->state == PF_PAGE_SHARED) {
        node = p->node;
        slot = node_at(s, node)->slot;
        pf_stable_tree_remove(&s->stable, id);
    }
    if (pf_vm_merges(r->vm)) {
        /* Its slot reference is held until the agent answers. */
        request_page(s, r, p, id, PF_ITEM_UNMERGE, slot, node, 0);
        return;
    }
    if (node != 0) {
        ledger_maybe_drop(s, node);
    }
    reset_page(r, p, PF_PAGE_VOLATILE);
}

void
cow_found(PfScanner *s, PfRegion *r, gsize idx)
{
    PfPageState st = pf_region_page_state(r, idx);

    if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO) {
        r->vm->scan->cow++;
        pf_scanner_end_sharing(s, r, idx);
    }
}

typedef struct {
    PfScanner *s;
    PfRegion *r;
} CowCtx;

/* A page written since it was merged (cow.h).  One that maps the zero
 * page reads zero: a zero page still holds what it was merged for (read
 * only, or written with zeros that host KSM merged: nothing to fold back),
 * a shared page was overwritten with zeros. */
static void
cow_seen(gsize idx, gboolean zero_pfn, gpointer user)
{
    CowCtx *ctx = user;
    PfPageState st = pf_region_page_state(ctx->r, idx);

    if (st == PF_PAGE_SHARED || (st == PF_PAGE_ZERO && !zero_pfn)) {
        cow_found(ctx->s, ctx->r, idx);
    }
}

void
cow_seen_in_hole(PfScanner *s, PfRegion *r, gsize idx, gboolean zero_pfn)
{
    CowCtx ctx = { s, r };

    cow_seen(idx, zero_pfn, &ctx);
}

/* Whether any page of [from, to) is merged. */
static gboolean
any_merged(PfRegion *r, gsize from, gsize to)
{
    for (gsize i = pf_region_next_recorded(r, from, to); i < to;
         i = pf_region_next_recorded(r, i + 1, to)) {
        PfPageState st = pf_region_page_state(r, i);

        if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO) {
            return TRUE;
        }
    }
    return FALSE;
}

void
cow_check_merged(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    CowCtx ctx = { s, r };

    while (from < to) {
        /* One look at up to 128 MiB of a process's page tables: a merged
         * VM of a TiB is a few thousand of them, not half a million. */
        gsize n = MIN(to - from, 32768u);

        if (any_merged(r, from, from + n) &&
            !pf_cow_find(setup_of(s)->cow, r->vm->pagemap_fd, r->host_addr, from, from + n,
                         cow_seen, &ctx)) {
            return; /* the process is going: its pidfd will say so */
        }
        from += n;
    }
}

/*
 * A merged page is a hole too: it is looked at for copy-on-write; every
 * other page is forgotten, and the records of extents left with no page
 * are freed.
 */
void
cow_leave_hole(PfScanner *s, PfRegion *r, gsize from, gsize to, gboolean look)
{
    gboolean merges = pf_vm_merges(r->vm);

    if (merges && look) {
        cow_check_merged(s, r, from, to);
    }
    for (gsize i = pf_region_next_recorded(r, from, to); i < to;
         i = pf_region_next_recorded(r, i + 1, to)) {
        PfPageState st = pf_region_page_state(r, i);
        const PfPage *p = pf_region_page(r, i);

        if (merges && st == PF_PAGE_SHARED) {
            moves_follow(s, r, i);
        } else if (st != PF_PAGE_ABSENT && st != PF_PAGE_PENDING &&
                   !(merges && st == PF_PAGE_ZERO) &&
                   /* Not one a device wrote since the window was read
                    * (which saw a hole): a hinted visit found it in
                    * memory in this pass. */
                   !(p->hinted && p->seen == (pass_of(s)->full_scans & 31))) {
            ledger_forget_page(s, r, i, NULL);
        }
    }
    pf_region_trim(r, from, to);
}

/* Pages back in their memfd: what they shared is let go, and they are read
 * again from scratch.  A page in flight is settled by its agent's answer,
 * which comes after this news. */
static void
back_in_memfd(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    for (gsize i = pf_region_next_recorded(r, from, to); i < to;
         i = pf_region_next_recorded(r, i + 1, to)) {
        PfPageState st = pf_region_page_state(r, i);

        if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO) {
            ledger_forget_page(s, r, i, NULL);
        }
    }
}

void
pf_scanner_step_back(PfScanner *s, PfVm *vm, const char *reason)
{
    for (guint k = 0; k < vm->regions->len; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        back_in_memfd(s, r, 0, r->n_pages);
    }
    vm->mode = PF_MODE_ADVISE;
    g_free(vm->mode_reason);
    vm->mode_reason = g_strdup(reason);
    g_message("VM %s (pid %d) is in advise mode from now on: %s", vm->name, vm->pid, reason);
}

void
pf_scanner_discarded(PfScanner *s, PfVm *vm, guint region, guint64 first, guint64 n,
                     gboolean backend)
{
    PfRegion *r = g_ptr_array_index(vm->regions, region);

    if (backend) {
        vm->scan->backend_fold_backs += n;
    }

    /* Pages merged under an earlier pagefoldd, not taken back yet, are
     * not to be: they map no pool chunk any more (scan-adopt.c). */
    if (r->pooled != NULL) {
        pf_pool_mapped_back(r->pooled, r->n_pages, first, first + n);
    }
    back_in_memfd(s, r, first, first + n);
}
