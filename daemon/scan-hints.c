/*
 * scan-hints.c - the pages an agent says a device just wrote (a disk read
 * landed there: HINT), visited before the cursor comes to them.  A read of
 * an image other VMs read too (their root disk's backing file) fills pages
 * their page caches hold as well: visited now, such a page meets its
 * copies in the unstable tree within seconds, where the cursor would reach
 * it minutes later (the idea of XLH, USENIX ATC 2013).  A page the device
 * just wrote is taken as unchanged since its last visit: the two visits
 * KSM asks of a page before the unstable tree are what the hint stands
 * for, and the agent's compare still decides every merge.
 *
 * Owns each VM's queue of hinted ranges.  A hint is a peer's word: it is
 * checked against the VM's regions (link.c), kept within a bound a VM
 * (PF_HINT_PAGES), visited within half of each scan's budget, VMs in turn,
 * a page once a pass (visit_page()), and it changes nothing but the order
 * of visits: a VM that floods hints spends its own turns, and its own
 * pages' smart scan.  Must never let hints take the cursor's half.
 */
#include "scan-core.h"

#include <setjmp.h>

#include "guard.h"

/* Hinted pages a VM may have waiting: a 256 MiB read at once.  Past it,
 * the pages wait for the cursor, as with no hint. */
#define PF_HINT_PAGES 65536u
/* Ranges a VM may have waiting (a read of scattered pages is many). */
#define PF_HINT_RANGES 8192u
/* Pages of one range visited before the next VM's turn. */
#define HINT_TURN 64u

void
pf_scanner_hinted(PfScanner *s, PfVm *vm, guint region, guint64 first, guint64 n)
{
    guint64 take = MIN(n, PF_HINT_PAGES - vm->scan->hint_pages);

    if (!setup_of(s)->knobs.io_hints) {
        return;
    }
    if (vm->scan->hints == NULL) {
        vm->scan->hints = g_array_new(FALSE, FALSE, sizeof(PfHint));
    }
    /* What does not fit waits for the cursor, as with no hint. */
    vm->scan->hints_dropped += n - take;
    if (take == 0) {
        return;
    }
    if (vm->scan->hints->len > vm->scan->hint_head) {
        PfHint *last = &g_array_index(vm->scan->hints, PfHint, vm->scan->hints->len - 1);

        /* Reads of one file come one after another. */
        if (last->region == region && last->page + last->n_pages == first) {
            last->n_pages += (guint32)take;
            vm->scan->hint_pages += take;
            return;
        }
    }
    if (vm->scan->hints->len - vm->scan->hint_head >= PF_HINT_RANGES) {
        vm->scan->hints_dropped += take;
        return;
    }
    g_array_append_val(vm->scan->hints, ((PfHint){ region, (guint32)take, first }));
    vm->scan->hint_pages += take;
}

void
hints_forget(PfVm *vm)
{
    if (vm->scan->hints != NULL) {
        g_array_set_size(vm->scan->hints, 0);
    }
    vm->scan->hint_head = 0;
    vm->scan->hint_pages = 0;
}

/* Visits up to max pages of vm's first hinted range; returns how many
 * pages it took off the queue. */
static gsize
visit_hinted(PfScanner *s, PfVm *vm, gsize max)
{
    PfHint *h = &g_array_index(vm->scan->hints, PfHint, vm->scan->hint_head);
    PfRegion *r = h->region < vm->regions->len ? g_ptr_array_index(vm->regions, h->region)
                                               : NULL;
    gsize n = MIN(MIN(max, HINT_TURN), MIN(h->n_pages, outbox_visits(vm)));
    guint8 resident[HINT_TURN];
    guint marks = pf_cpu_depth();
    sigjmp_buf env;
    int rc = -1;

    /* A region that left since, or refused: nothing to visit. */
    if (r != NULL && pf_region_live(r) && h->page + n <= r->n_pages) {
        pf_cpu_enter(PF_CPU_MINCORE);
        rc = mincore((void *)(r->map + h->page * PF_PAGE_SIZE), n * PF_PAGE_SIZE, resident);
        pf_cpu_leave();
    }
    if (rc == 0) {
        if (sigsetjmp(env, 0) != 0) {
            pf_guard_env = NULL;
            pf_cpu_unwind(marks);
            vms_faulted(s);
            return 0; /* the VM's queue may be gone with it */
        }
        pf_guard_env = &env;
        pf_cpu_enter(PF_CPU_VISITS);
        for (gsize j = 0; j < n; j++) {
            /* Never read a page not in memory: that would allocate it. */
            if (resident[j] & 1) {
                visit_page(s, r, h->page + j, TRUE);
            }
        }
        pf_cpu_leave();
        pf_guard_env = NULL;
    }
    h->page += n;
    h->n_pages -= (guint32)n;
    vm->scan->hint_pages -= n;
    if (h->n_pages == 0 && ++vm->scan->hint_head == vm->scan->hints->len) {
        hints_forget(vm); /* empty: it starts over */
    } else if (vm->scan->hint_head >= 1024 && vm->scan->hint_head * 2 >= vm->scan->hints->len) {
        /* Never emptied (hints come as fast as they go): the ranges
         * visited go, a few at a time. */
        g_array_remove_range(vm->scan->hints, 0, vm->scan->hint_head);
        vm->scan->hint_head = 0;
    }
    return n;
}

gsize
hints_visit(PfScanner *s, gsize max)
{
    gsize done = 0;
    guint idle = 0;

    if (!setup_of(s)->knobs.io_hints) {
        /* Turned off: what was hinted is not visited when it comes on. */
        for (guint i = 0; i < vm_count(s); i++) {
            hints_forget(vm_at(s, i));
        }
        return 0;
    }
    /* A VM at a time, a range's turn each, until the budget is spent or
     * no VM that may take requests has hints. */
    while (done < max && vm_count(s) > 0 && idle < vm_count(s) && !past_slice(s)) {
        PfVm *vm;

        s->hints.vm = (s->hints.vm + 1) % vm_count(s);
        vm = vm_at(s, s->hints.vm);
        /* A merging VM not before the cursor first counted its
         * mappings: no request for it goes before (max_vma_percent). */
        if (vm->scan->hint_pages == 0 || vm->scan->unmerging ||
            (pf_vm_merges(vm) && !vm->scan->counted) ||
            (vm->kind == PF_VM_AGENT && outbox_visits(vm) == 0)) {
            idle++;
            continue;
        }
        idle = 0;
        done += visit_hinted(s, vm, max - done);
    }
    return done;
}
