/*
 * scan-pass.c - the pass loop: the cursor (scan-cursor.c) over every VM's
 * regions, pages read in slices under the SIGBUS guard, each VM taken up
 * again as the cursor comes to it (its look, where one was due:
 * scan-reads.c), and the VMs whose agent has as much to answer as its
 * outbox takes, or whose look or window is not read yet: left for later in
 * the pass, and waited for a bounded while at its end.
 *
 * Owns the pass (in_pass, full_scans, the deferral's clocks), and moves
 * the cursor; a visit's decision is scan-visit.c's, what is read of a VM
 * off the main loop scan-reads.c's.  Never blocks: a scan stops at the end
 * of its slice, of its pages, of the pass, or at a full outbox, and never
 * waits for an agent.
 */
#include "scan-core.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "extents.h"
#include "guard.h"

/* Past this long without an answer, an agent whose outbox is full is
 * passed over for the rest of the pass: one stopped VM must not hold up
 * the scanning of the others (its link gives it up later). */
#define STUCK_USEC (G_USEC_PER_SEC / 2)
/* Past this long, a VM whose look at its process is not done is passed
 * over for the rest of the pass: a process holds its mmap lock, which the
 * read of its maps waits for, as long as it likes. */
#define LOOK_USEC (5 * G_USEC_PER_SEC)

/* The pass waits, in all, at least this long for the VMs it left for later
 * (a quarter of its scanning time if more); then it ends without them,
 * and the next pass visits them on from where they were left.  An agent
 * answering just often enough not to look silent slows the other VMs'
 * passes by at most that. */
#define DEFERRED_WAIT_USEC (2 * G_USEC_PER_SEC)

gboolean
pf_scanner_agent_silent(PfVm *vm)
{
    return vm->kind == PF_VM_AGENT && pf_outbox_waiting_usec(vm->outbox) > STUCK_USEC;
}

gsize
pf_scanner_vm_merged(const PfVm *vm)
{
    const gsize *count = vm->scan->count;

    return count[PF_PAGE_SHARED] + count[PF_PAGE_ZERO] + count[PF_PAGE_PENDING];
}

gboolean
pf_scanner_joining(PfScanner *s)
{
    return moves_of(s)->joining->len > 0;
}

gboolean
pf_scanner_looking(PfScanner *s)
{
    for (guint i = 0; i < vm_count(s); i++) {
        const PfVm *vm = vm_at(s, i);

        if (vm->scan->looking != NULL || vm->scan->reading != NULL) {
            return TRUE;
        }
    }
    return FALSE;
}

guint64
pf_scanner_full_scans(PfScanner *s)
{
    return s->pass.full_scans;
}

gboolean
pf_scanner_in_pass(PfScanner *s)
{
    return s->pass.in_pass;
}

/* Visits up to n pages of r from the cursor on, within the slice. */
static gsize
scan_range(PfScanner *s, PfRegion *r, gsize n)
{
    sigjmp_buf env;
    volatile gsize i = cursor_of(s)->page;
    gsize start = cursor_of(s)->page;
    guint marks = pf_cpu_depth();

    if (sigsetjmp(env, 0) != 0) {
        pf_guard_env = NULL;
        pf_cpu_unwind(marks);
        cursor_to_page(s, i);
        vms_faulted(s);
        return i - start;
    }
    pf_guard_env = &env;
    while (i < start + n && (i == start || !past_slice(s))) {
        guint8 resident[RESIDENT_PAGES];
        gsize k = MIN(start + n - i, RESIDENT_PAGES);

        /* Just before reading: a page the VMM discarded (a balloon, free
         * page reporting) since reads_find_data() saw its extent, or one swapped
         * out, is not read, which would allocate it again. */
        pf_cpu_enter(PF_CPU_MINCORE);
        if (mincore((void *)(r->map + i * PF_PAGE_SIZE), k * PF_PAGE_SIZE, resident) < 0) {
            memset(resident, 1, k);
        }
        pf_cpu_leave();
        pf_cpu_enter(PF_CPU_VISITS);
        for (gsize j = 0; j < k && (j == 0 || !past_slice(s)); j++, i++) {
            if (resident[j] & 1) {
                visit_page(s, r, i, FALSE);
            } else {
                cow_leave_hole(s, r, i, i + 1, TRUE);
            }
        }
        pf_cpu_leave();
    }
    pf_guard_env = NULL;
    cursor_to_page(s, i);
    return i - start;
}

/* The cursor leaves the VM it is at before its end: to come back to it in
 * this pass if later, and to start where it left it next time. */
static void
leave_vm(PfScanner *s, PfVm *vm, gboolean later)
{
    vm->scan->deferred = later;
    cursor_leave_vm(s, vm);
}

/* Whether vm waits for a window of its memfd that is not read yet: one
 * under way, or one no read can start for while a read for its process
 * has not returned (a VM that went, its agent back since). */
static gboolean
window_pending(PfScanner *s, PfVm *vm)
{
    return vm->scan->window_wait != 0 &&
           (vm->scan->reading != NULL ||
            g_hash_table_contains(reads_of(s)->reading_pids, GINT_TO_POINTER(vm->pid)));
}

static gboolean
waited_enough(PfScanner *s, gint64 now)
{
    const PfScanPass *pass = &s->pass;
    gint64 waited = pass->deferred_wait + (pass->wait_since != 0 ? now - pass->wait_since : 0);
    gint64 scanning = now - pass->pass_start_usec - waited;

    return !pass->whole_passes && waited > MAX(DEFERRED_WAIT_USEC, scanning / 4);
}

/*
 * Every VM had its turn: the cursor goes back to one it deferred that has
 * room now (or whose agent went silent: vm_room() passes it over).  While
 * none has, the pass waits for them (the scan stops, blocked), a bounded
 * while (waited_enough()).  FALSE when the pass may end: the VMs still
 * deferred are visited on next pass.
 */
static gboolean
to_deferred(PfScanner *s)
{
    gint64 now = g_get_monotonic_time();
    gboolean waiting = FALSE;

    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (!vm->scan->deferred) {
            continue;
        }
        if ((!vm->scan->entered && vm->scan->look == NULL &&
             now - vm->scan->look_usec > LOOK_USEC) ||
            (vm->scan->window_wait != 0 && now - vm->scan->window_wait > LOOK_USEC)) {
            g_debug("VM %s: its process's mappings or its memfd took over %d s to read: "
                    "passed over", vm->name, (int)(LOOK_USEC / G_USEC_PER_SEC));
            vm->scan->deferred = FALSE;
            vm->scan->window_wait = 0;
            scan_emit_passed_over(s, vm);
            continue;
        }
        /* vm_room() takes it now, or passes it over. */
        if ((vm->scan->entered || vm->scan->look != NULL) && !window_pending(s, vm) &&
            (outbox_visits(vm) > 0 || vm->scan->unmerging || pf_scanner_agent_silent(vm))) {
            if (s->pass.wait_since != 0) {
                s->pass.deferred_wait += now - s->pass.wait_since;
                s->pass.wait_since = 0;
            }
            vm->scan->deferred = FALSE;
            cursor_revisit(s, TRUE);
            cursor_to_vm(s, i);
            return TRUE;
        }
        waiting = TRUE;
    }
    if (!waiting) {
        return FALSE;
    }
    if (s->pass.wait_since == 0) {
        s->pass.wait_since = now;
    }
    if (!waited_enough(s, now)) {
        s->pass.blocked = TRUE;
        return FALSE;
    }
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (vm->scan->deferred) {
            g_debug("VM %s: its agent answers slowly: the pass ends without the rest of it",
                    vm->name);
        }
    }
    return FALSE;
}

static gboolean
begin_pass(PfScanner *s)
{
    gint64 now = g_get_monotonic_time();
    gsize candidates = 0;

    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        /* Only a page that kept its checksum since its last visit enters
         * the unstable tree: one volatile or unshared now.  Not counted,
         * the table grows for them: in advise mode, a sharer that leaves
         * its node unchanged (the node's first page changed), which is
         * rare, while counting every advise-mode sharer would cost a slot
         * each, more than its record. */
        candidates += vm->scan->count[PF_PAGE_VOLATILE] + vm->scan->count[PF_PAGE_UNSHARED];
    }
    if (vm_count(s) == 0) {
        return FALSE;
    }
    pf_table_reset(&s->unstable.table, candidates);
    if (s->pass.listed_sharing != setup_of(s)->knobs.max_page_sharing) {
        /* The knob changed: nodes full by the old value may have room
         * now, others none.  (KSM refuses the change while pages share.) */
        s->pass.listed_sharing = setup_of(s)->knobs.max_page_sharing;
        for (guint32 id = 1; id < s->stable.nodes->len; id++) {
            ledger_relist(s, id);
        }
    }
    moves_evacuate(s);
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        /* A look the last pass ended without is taken as it is: its count
         * of mappings is made up by what was asked since
         * (vmas_since_look). */
        vm->scan->entered = FALSE;
        if (reads_look_due(s, vm, now)) {
            reads_look_start(s, vm);
        }
        if (s->pass.whole_passes) {
            cursor_forget_vm(vm); /* root asked for whole passes */
        }
    }
    s->pass.in_pass = TRUE;
    cursor_revisit(s, FALSE);
    s->pass.deferred_wait = 0;
    s->pass.wait_since = 0;
    s->pass.pass_start_usec = g_get_monotonic_time();
    /* Each VM's first window of memfd, read while the cursor is at the
     * VMs before it (before the cursor takes the first VM's resume). */
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        vm->scan->window_wait = 0;
        reads_window(s, vm, vm->scan->resume ? vm->scan->resume_region : 0,
                     vm->scan->resume ? vm->scan->resume_page : 0);
    }
    cursor_to_vm(s, 0);
    return TRUE;
}

typedef enum { ENTER_DONE, ENTER_LATER, ENTER_GONE } Enter;

/*
 * The cursor comes to a VM: what it maps is looked at again where due
 * (reads_look_due(): its regions if attached by pid, the pool chunks it was
 * told to drop, its mappings).
 * Each look reads its /proc/PID/maps, which waits for the process's mmap
 * lock, held by a busy VMM remapping its RAM (or a hostile one) as long as
 * it likes: so the look runs on a thread, started as the pass begins, and
 * a VM whose look is not done yet is left for later in the pass
 * (ENTER_LATER).  ENTER_GONE when the VM was detached (the cursor is at
 * the next one then).
 */
static Enter
enter_vm(PfScanner *s, PfVm *vm)
{
    g_autoptr(GPtrArray) gone = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    g_autoptr(GPtrArray) added = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    g_autoptr(PfVmLook) look = NULL;
    gboolean ok;

    /* A VM that came during the pass is due: its budget is unknown. */
    if (vm->scan->look == NULL && vm->scan->looking == NULL &&
        !reads_look_due(s, vm, g_get_monotonic_time())) {
        if (pf_vm_exited(vm)) {
            pf_scanner_detach(s, vm, "its process has exited");
            return ENTER_GONE;
        }
        vm->scan->entered = TRUE;
        return ENTER_DONE;
    }
    if (vm->scan->look == NULL) {
        reads_look_start(s, vm);
        return ENTER_LATER;
    }
    look = g_steal_pointer(&vm->scan->look);
    ok = pf_vm_refresh(vm, look, gone, added, &error) && reads_check_dropped(s, vm, look, &error);
    /* Regions it no longer maps leave the page space before they are
     * freed, whether or not the VM stays. */
    for (guint k = 0; k < gone->len; k++) {
        vms_release_region(s, g_ptr_array_index(gone, k), NULL);
    }
    if (!ok) {
        pf_scanner_detach(s, vm, error->message);
        return ENTER_GONE;
    }
    if (gone->len > 0) {
        cursor_to_vm(s, cursor_of(s)->vm); /* where it was left may be another region now */
    }
    vm->scan->entered = TRUE;
    for (guint k = 0; k < added->len; k++) {
        PfRegion *r = g_ptr_array_index(added, k);

        if (!vms_place_region(s, r)) {
            g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
            pf_region_free(pf_vm_steal_region(vm, r->index));
        }
    }
    if (pf_vm_merges(vm)) {
        vm->scan->vmas = pf_vm_look_vmas(look) + vm->scan->vmas_since_look;
        vm->scan->vma_budget = vmas_allowed(s);
    }
    vm->scan->counted = TRUE;
    return ENTER_DONE;
}

static void
end_pass(PfScanner *s)
{
    for (guint i = 0; i < vm_count(s); i++) {
        ((PfVm *)vm_at(s, i))->scan->deferred = FALSE;
    }
    moves_make_joins(s);
    s->pass.in_pass = FALSE;
    s->pass.full_scans++;
    s->pass.last_pass_usec = (guint64)(g_get_monotonic_time() - s->pass.pass_start_usec);
}

/*
 * How many pages of vm the cursor may take now.  A merging VM's agent
 * answers at its own pace: while its outbox has no room for more requests
 * (0) the cursor leaves it for later in the pass; a VM being unmerged, or
 * whose agent has answered nothing for a while, is passed over for this
 * pass (*skip).
 */
static gsize
vm_room(PfScanner *s, PfVm *vm, gboolean *skip)
{
    gsize room;

    *skip = vm->scan->unmerging;
    if (*skip) {
        return G_MAXSIZE;
    }
    room = outbox_visits(vm);
    if (room == 0 && pf_scanner_agent_silent(vm)) {
        g_debug("VM %s: its agent has answered nothing for %" G_GINT64_FORMAT
                " ms: passed over", vm->name, pf_outbox_waiting_usec(vm->outbox) / 1000);
        scan_emit_passed_over(s, vm);
        *skip = TRUE;
    }
    return room;
}

/* One step of the cursor within VM vm, up to max pages present: returns
 * the pages present it visited or stepped over; *moved is set where the
 * cursor moved (not where it left the VM to wait for a window). */
static gsize
scan_step(PfScanner *s, PfVm *vm, gsize max, gboolean *moved)
{
    const PfScanCursor *c = cursor_of(s);
    PfRegion *r;

    *moved = TRUE;
    if (c->region >= vm->regions->len) {
        vm->scan->full_scans++;
        moves_make_vm_joins(s, vm);
        cursor_next_vm(s);
        return 0;
    }
    r = g_ptr_array_index(vm->regions, c->region);
    if (c->page >= r->n_pages) {
        cursor_next_region(s);
        return 0;
    }
    if (c->page >= c->data_end) {
        gsize present, stop, data_end;

        if (!reads_find_data(s, vm, r, c->page, max, &stop, &data_end, &present)) {
            leave_vm(s, vm, TRUE); /* the cursor is at another VM now */
            *moved = FALSE;
            return 0;
        }
        cursor_at_page(s, stop, data_end);
        return present;
    }
    return scan_range(s, r, MIN(max, c->data_end - c->page));
}

gsize
pf_scanner_scan(PfScanner *s, gsize max_pages, gboolean *progress)
{
    gboolean moved = FALSE, step_moved, hints_due = TRUE;
    gsize done = 0;

    s->pass.blocked = FALSE;
    if (moves_of(s)->joining->len > 0) {
        /* The joins of a pass come before the next (or the rest of this
         * one): this call makes as many as its slice allows. */
        moves_continue_joins(s);
        pf_scanner_flush(s);
        *progress = TRUE;
        return 0;
    }
    /* Holes cost no budget: the slice bounds a walk over them. */
    while (done < max_pages && !(moved && past_slice(s))) {
        PfVm *vm;
        gsize room;
        gboolean skip;

        if (!s->pass.in_pass && !begin_pass(s)) {
            break;
        }
        if (hints_due) {
            /* First, in this pass's unstable tree: up to half the budget
             * (none of a budget of 1), so that the cursor goes on however
             * many hints come. */
            gint64 end = s->pass.slice_end, now = g_get_monotonic_time();
            gsize hinted;

            /* And half the slice: the time is the cursor's too. */
            if (end != 0) {
                s->pass.slice_end = now + MAX(end - now, 0) / 2;
            }
            hinted = hints_visit(s, (max_pages - done) / 2);
            s->pass.slice_end = end;
            hints_due = FALSE;
            done += hinted;
            moved = moved || hinted > 0;
            continue;
        }
        if (cursor_of(s)->vm >= vm_count(s)) {
            if (to_deferred(s)) {
                continue;
            }
            if (!s->pass.blocked) {
                end_pass(s);
                moved = TRUE;
            }
            break;
        }
        vm = vm_at(s, cursor_of(s)->vm);
        if (!vm->scan->entered) {
            Enter e = enter_vm(s, vm);

            if (e == ENTER_LATER) {
                leave_vm(s, vm, TRUE);
            }
            if (e != ENTER_DONE) {
                continue;
            }
        }
        room = vm_room(s, vm, &skip);
        if (skip || room == 0) {
            leave_vm(s, vm, !skip);
            continue;
        }
        done += scan_step(s, vm, MIN(max_pages - done, room), &step_moved);
        moved = moved || step_moved;
    }
    if (s->pass.holding) {
        pf_scanner_flush_ripe(s, 0);
    } else {
        pf_scanner_flush(s);
    }
    *progress = moved;
    return done;
}

gsize
pf_scanner_scan_slice(PfScanner *s, gsize max_pages, gint64 usec, gboolean whole_passes,
                      gboolean *progress)
{
    guint64 scans = s->pass.full_scans;
    gsize done = 0;

    s->pass.whole_passes = whole_passes;
    s->pass.holding = !whole_passes;
    s->pass.slice_end = g_get_monotonic_time() + usec;
    *progress = FALSE;
    while (done < max_pages) {
        gboolean moved;
        gsize n = pf_scanner_scan(s, MIN(max_pages - done, 4096), &moved);

        done += n;
        *progress = *progress || moved;
        if (!moved || s->pass.blocked || s->pass.full_scans != scans || past_slice(s)) {
            break;
        }
    }
    s->pass.slice_end = 0;
    s->pass.whole_passes = FALSE;
    s->pass.holding = FALSE;
    return done;
}

void
pass_init(PfScanner *s)
{
    s->pass.listed_sharing = setup_of(s)->knobs.max_page_sharing;
}
