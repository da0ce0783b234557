/*
 * scan-visit.c - one visit of a page, in KSM's order (scan.h): smart scan,
 * the checksum and the stable tree, zero pages, then the unstable tree, as
 * mm/ksm.c's cmp_and_merge_page() does with stable_tree_search() and
 * unstable_tree_search_insert().
 *
 * Owns the decision for one page; what a decision does to slots goes
 * through the ledger, what it asks of an agent through requests, and a
 * page its VM may not yet read through the moves.  Never reads a page that
 * is not in memory, and never blocks.
 */
#include "scan-core.h"

#include <string.h>

/* Is another guest page equal to data?  Not if it is not in memory. */
static gboolean
page_equal(PfScanner *s, const guint8 *data, guint32 other)
{
    const guint8 *o = page_data(s, other);

    if (!page_in_memory(o)) {
        return FALSE;
    }
    s->visits.memcmp_calls++;
    return memcmp(data, o, PF_PAGE_SIZE) == 0;
}

/* Is data the content a stable node stands for: its pool slot once
 * merged, its first guest page in advise mode? */
static gboolean
node_equal(PfScanner *s, const guint8 *data, const PfStableNode *n)
{
    if (n->slot == PF_POOL_SLOT_NONE) {
        return page_equal(s, data, n->members[0]);
    }
    s->visits.memcmp_calls++;
    return memcmp(data, pf_pool_data(s->pool, n->slot), PF_PAGE_SIZE) == 0;
}

/* The passes between visits of a page that has failed to merge age times
 * (passes since it last merged or was first seen), KSM's back-off: three
 * visits at full rate, then every 2nd, every 4th, at most every 8th pass. */
static guint
skip_period(guint age)
{
    if (age < 3) {
        return 1;
    }
    if (age < 5) {
        return 2;
    }
    if (age < 13) {
        return 4;
    }
    return 8;
}

/* KSM's smart scan (6.7), with one change: a backed-off page is visited on
 * the passes whose number its period divides, not after a countdown of its
 * own.  Every period divides 8, so any two pages are both visited at least
 * every 8th pass, and equal ones meet in the unstable tree: with KSM's
 * countdowns, two pages whose back-offs began in different passes could
 * stay out of step for good, as a VM's pages did with those of a VM that
 * came into its merge domain later (/scan/smart-scan-late-partner).  A
 * page the cursor does not reach every pass (its VM's walk cut short each
 * pass, by a slow agent) might miss every such pass: one not visited for
 * twice its period is visited then. */
static gboolean
smart_skip(PfPage *p, guint64 pass)
{
    guint age = p->age, period = skip_period(age);

    if (age != PF_PAGE_AGE_MAX) {
        p->age++;
    }
    return pass % period != 0 && ((pass - p->seen) & 31) < 2 * period;
}

/*
 * Advise mode: an advise node's content is its first page, which (unlike
 * a pool slot) its guest may change.  A first page found changed, by the
 * checksum, while a sharer still holds the node's content leaves the node
 * then, rather than at its own visit: whichever page the cursor reaches
 * first, the node lives on with the pages that still hold its content.
 * FALSE when members[0] was not that: the sharer is the one to leave.
 */
static gboolean
advise_drop_changed_first(PfScanner *s, guint32 node, guint64 c)
{
    const PfStableNode *n = node_at(s, node);
    guint32 first = n->members[0];
    const guint8 *fdata = page_data(s, first);
    PfRegion *fr;
    PfPage *fp;

    if (c != n->checksum || !page_in_memory(fdata) || setup_of(s)->hash(fdata) == n->checksum) {
        return FALSE;
    }
    fr = region_of(s, first);
    fp = pf_region_page(fr, first - fr->base);
    pf_stable_tree_remove(&s->stable, first);
    fp->checksum = pf_page_sum(n->checksum);
    ledger_maybe_drop(s, node);
    set_state(fr, fp, PF_PAGE_VOLATILE);
    return TRUE;
}

/*
 * Advise mode: does a page that would be merged still hold what it
 * shares?  A merged page would have left by copy-on-write.  A sharer must
 * still equal its node's first page (memcmp, no checksum needed); the
 * first page itself must keep the node's checksum; a zero page must be
 * zero.  TRUE when it does (nothing more to do); else it leaves, with its
 * checksum in *c, and is judged like any other.
 */
static gboolean
advise_still_shares(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, const guint8 *data,
                    guint64 *c)
{
    if (p->state == PF_PAGE_SHARED) {
        const PfStableNode *n = node_at(s, p->node);
        guint32 node = p->node;
        gboolean hashed = FALSE;

        while (n->members[0] != id) {
            if (page_equal(s, data, n->members[0])) {
                return TRUE;
            }
            if (!hashed) {
                *c = setup_of(s)->hash(data);
                hashed = TRUE;
            }
            if (!advise_drop_changed_first(s, node, *c)) {
                break;
            }
        }
        if (!hashed) {
            *c = setup_of(s)->hash(data);
        }
        if (n->members[0] == id && *c == n->checksum) {
            return TRUE;
        }
        pf_stable_tree_remove(&s->stable, id);
        /* What it held when it joined: it changed since. */
        p->checksum = pf_page_sum(n->checksum);
        ledger_maybe_drop(s, node);
        set_state(r, p, PF_PAGE_VOLATILE);
    } else if (p->state == PF_PAGE_ZERO) {
        if (pf_page_is_zero(data)) {
            return TRUE;
        }
        *c = setup_of(s)->hash(data);
        set_state(r, p, PF_PAGE_VOLATILE);
    } else {
        *c = setup_of(s)->hash(data);
    }
    return FALSE;
}

/* A zero page: merged with a zero slot (a merging VM), or counted zero
 * (advise mode).  FALSE when it stays to be judged as any page: a merging
 * VM at its mapping budget, which waits unshared. */
static gboolean
visit_zero(PfScanner *s, PfRegion *r, PfPage *p, guint32 id)
{
    if (can_merge(r->vm)) {
        g_autoptr(GError) error = NULL;
        PfVm *vm = r->vm;
        gboolean run = vm->scan->run_kind == PF_ITEM_ZERO && id == vm->scan->run_next_page;
        guint32 zslot = pf_pool_zero_slot(pf_scanner_get_pool(s),
                                          run ? vm->scan->run_next_slot - 1 : PF_POOL_SLOT_NONE,
                                          &error);

        if (zslot != PF_POOL_SLOT_NONE) {
            request_page(s, r, p, id, PF_ITEM_ZERO, zslot, 0, 0);
        } else {
            g_warning("pool: %s", error->message);
        }
        return TRUE;
    }
    if (!pf_vm_merges(r->vm)) {
        mark_merged(r, p, PF_PAGE_ZERO);
        return TRUE;
    }
    return FALSE;
}

/* KSM's stable_tree_search(): an equal canonical page of the VM's merge
 * domain, with room, takes the page as one more sharer.  A node of a chunk
 * its VM may not read is taken only when none it may read has room (a
 * join there costs a move), and only while the node has room for the
 * pages already waiting to join it: past that, as in a KSM chain whose
 * nodes are all full, the page goes on to the unstable tree.  TRUE when it
 * joined (or waits to join: moves_wait_to_join()). */
static gboolean
stable_search(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, const guint8 *data, guint64 c)
{
    gboolean merge_domain = pf_vm_merges(r->vm), merging = can_merge(r->vm);
    PfTableIter it;
    guint32 other, unreadable = 0;

    pf_table_iter_init(&it, &s->stable.table, c);
    while (merging || !merge_domain) {
        const PfStableNode *n;
        gboolean readable;

        if ((other = pf_table_iter_next(&it)) == 0) {
            break;
        }
        s->visits.stable_nodes_examined++;
        n = node_at(s, other);
        /* Full nodes are not listed, unless max_page_sharing was lowered
         * this pass (begin_pass()). */
        if ((n->slot != PF_POOL_SLOT_NONE) != merge_domain ||
            n->domain != pf_vm_domain_key(r->vm) ||
            ledger_sharers(s, n) >= setup_of(s)->knobs.max_page_sharing) {
            continue;
        }
        /* Listed are the nodes with room: about one a content and set of
         * VMs, so looking on past an unreadable one costs little. */
        readable = !merging || pf_pool_readable(s->pool, n->slot, r->vm->scan->serial);
        if ((!readable && (unreadable != 0 || !moves_room_to_wait(s, other))) ||
            !node_equal(s, data, n)) {
            continue;
        }
        if (!readable) {
            unreadable = other;
        } else if (merging) {
            moves_join(s, r, p, id, other);
            return TRUE;
        } else {
            pf_stable_tree_add(&s->stable, other, id);
            ledger_relist(s, other);
            mark_merged(r, p, PF_PAGE_SHARED);
            return TRUE;
        }
    }
    if (unreadable != 0) {
        moves_wait_to_join(s, r, p, id, unreadable);
        return TRUE;
    }
    return FALSE;
}

/* Whether the unstable tree's page other can pair with page id of r now. */
static gboolean
pair_candidate(PfScanner *s, PfRegion *r, guint32 id, const guint8 *data, guint32 other)
{
    PfRegion *orr = region_of(s, other);
    const PfPage *o = pf_page_space_page(&s->space, other);
    gboolean merging = can_merge(r->vm);

    return other != id && o != NULL && o->state == PF_PAGE_UNSHARED &&
           can_merge(orr->vm) == merging && pf_vm_merges(orr->vm) == pf_vm_merges(r->vm) &&
           pf_vm_domain_key(orr->vm) == pf_vm_domain_key(r->vm) &&
           /* The pair's other request goes to its own agent, which has as
            * much to answer as its outbox takes: not now. */
           !(merging && pf_outbox_room(orr->vm->outbox) == 0) && page_equal(s, data, other);
}

/* The canonical copy of a pair, in the two VMs' own chunk (pool.h: a VM
 * whose pages join it later is sent its chunk, or it moves); checked
 * against both pages again, since either may have changed while it was
 * copied.  *failed when no slot could be had. */
static guint32
pair_slot(PfScanner *s, PfRegion *r, const guint8 *data, guint32 other, gboolean *failed)
{
    g_autoptr(GError) error = NULL;
    PfVm *ovm = region_of(s, other)->vm;
    guint32 a = r->vm->scan->serial, b = ovm->scan->serial;
    guint32 vms[2] = { MIN(a, b), MAX(a, b) };
    guint32 slot = ledger_new_slot(s, vms, vms[0] == vms[1] ? 1 : 2, data, &error);

    if (slot == PF_POOL_SLOT_NONE) {
        g_warning("pool: %s", error->message);
        *failed = TRUE;
        return PF_POOL_SLOT_NONE;
    }
    if (!page_in_memory(page_data(s, other)) ||
        memcmp(pf_pool_data(s->pool, slot), page_data(s, other), PF_PAGE_SIZE) != 0 ||
        memcmp(pf_pool_data(s->pool, slot), data, PF_PAGE_SIZE) != 0) {
        ledger_put(s, slot, 0);
        return PF_POOL_SLOT_NONE;
    }
    return slot;
}

/* KSM's unstable_tree_search_insert(): an equal candidate and this page
 * become a new stable node; else the page becomes a candidate. */
static void
unstable_search_insert(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, const guint8 *data,
                       guint64 c)
{
    gboolean merge_domain = pf_vm_merges(r->vm), merging = can_merge(r->vm);
    guint32 sum = pf_page_sum(c);
    PfTableIter it;
    guint32 other;

    pf_table_iter_init(&it, &s->unstable.table, sum);
    while (merging || !merge_domain) {
        PfRegion *orr;
        PfPage *o;
        guint32 node, slot = PF_POOL_SLOT_NONE;
        gboolean failed = FALSE;

        if ((other = pf_table_iter_next(&it)) == 0) {
            break;
        }
        if (!pair_candidate(s, r, id, data, other)) {
            continue;
        }
        if (merging && (slot = pair_slot(s, r, data, other, &failed)) == PF_POOL_SLOT_NONE) {
            if (failed) {
                break;
            }
            continue;
        }
        orr = region_of(s, other);
        o = pf_region_page(orr, other - orr->base);
        pf_table_remove(&s->unstable.table, sum, other);
        node = pf_stable_tree_create(&s->stable, c, slot, pf_vm_domain_key(r->vm));
        if (merging) {
            ledger_take(s, slot, 0);
            request_page(s, orr, o, other, PF_ITEM_MERGE, slot, node, 0);
            ledger_take(s, slot, 0);
            request_page(s, r, p, id, PF_ITEM_MERGE, slot, node, 0);
        } else {
            pf_stable_tree_add(&s->stable, node, other);
            mark_merged(orr, o, PF_PAGE_SHARED);
            pf_stable_tree_add(&s->stable, node, id);
            mark_merged(r, p, PF_PAGE_SHARED);
        }
        ledger_relist(s, node); /* max_page_sharing may be 2 */
        return;
    }

    pf_table_insert(&s->unstable.table, sum, id);
    set_state(r, p, PF_PAGE_UNSHARED);
}

void
visit_page(PfScanner *s, PfRegion *r, gsize idx, gboolean hinted)
{
    guint32 id = r->base + (guint32)idx;
    PfPage *p = pf_region_page_make(r, idx);
    const guint8 *data = r->map + idx * PF_PAGE_SIZE;
    gboolean back, changed, again;
    guint64 c;
    guint32 sum;

    if (p == NULL || p->state == PF_PAGE_PENDING) {
        return; /* no memory for its record; or its agent has it */
    }
    if (pf_vm_merges(r->vm) && (p->state == PF_PAGE_SHARED || p->state == PF_PAGE_ZERO)) {
        /* Merged: nothing to read.  A merged page is a hole of the memfd,
         * where copy-on-write is looked for; one found among data (its
         * fold-back failed after copying, or its punch only zeroed it: a
         * huge page that could not be split) is looked at here. */
        cow_check_merged(s, r, idx, idx + 1);
        return;
    }
    again = p->state != PF_PAGE_ABSENT && p->seen == (pass_of(s)->full_scans & 31);
    if (hinted) {
        /* New content: smart scan starts over; the cursor passes it by
         * in this pass. */
        p->age = 0;
        p->hinted = 1;
        r->vm->scan->pages_hinted++;
    } else if (p->hinted) {
        p->hinted = 0;
        if (p->seen == (pass_of(s)->full_scans & 31)) {
            return;
        }
    } else if (setup_of(s)->knobs.smart_scan && p->state != PF_PAGE_SHARED &&
               p->state != PF_PAGE_ZERO && smart_skip(p, pass_of(s)->full_scans)) {
        r->vm->scan->pages_skipped++;
        return;
    }
    p->seen = pass_of(s)->full_scans & 31;
    r->vm->scan->pages_scanned++;
    if (advise_still_shares(s, r, p, id, data, &c)) {
        return;
    }
    /*
     * KSM's order (cmp_and_merge_page()): the stable tree first, so a copy
     * of content already merged joins at its first visit; only what would
     * start a new node (the zero slots, the unstable tree) waits for a
     * checksum kept over two visits.  A page that changes under the join
     * is the agent's compare to catch.  Not a page back from a merge (its
     * copy on write folded back, its merge found changed or abandoned:
     * reset_page() left it VOLATILE with no checksum): an undone merge
     * costs its agent a remap and a punch, not a fault as in KSM, and a
     * page written over and over with one content would merge and come
     * back every pass.  It waits two visits, as any page that changed.
     */
    back = p->state == PF_PAGE_VOLATILE && p->checksum == 0;
    sum = pf_page_sum(c);
    if (hinted && again && p->state == PF_PAGE_UNSHARED && sum == p->checksum) {
        /* Hinted again in this pass, as it was: in this pass's unstable
         * tree already, or waiting to join a node (once is enough). */
        return;
    }
    /* A page a device just wrote holds what it will hold (a disk read
     * into the page cache): the hint stands for the second visit, but for
     * a page back from a merge, which waits as ever. */
    changed = (back || !hinted) && (p->state == PF_PAGE_ABSENT || sum != p->checksum);
    p->checksum = sum;
    if (!back && stable_search(s, r, p, id, data, c)) {
        return;
    }
    if (changed) {
        set_state(r, p, PF_PAGE_VOLATILE);
        return;
    }
    if (setup_of(s)->knobs.use_zero_pages && c == setup_of(s)->zero_checksum &&
        pf_page_is_zero(data) && visit_zero(s, r, p, id)) {
        return;
    }
    unstable_search_insert(s, r, p, id, data, c);
}
