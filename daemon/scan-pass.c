/*
 * scan-pass.c - the pass loop: the cursor over every VM's regions, holes of
 * the memfds stepped over (where they are read ahead on a thread), pages
 * read in slices under the SIGBUS guard, each VM looked at again where due
 * as the cursor comes to it, and the VMs whose agent has as much to answer
 * as its outbox takes, or whose look or window is not read yet: left for
 * later in the pass, and waited for a bounded while at its end.
 *
 * Owns the cursor; a visit's decision is scan-visit.c's.  Never blocks:
 * a scan stops at the end of its slice, of its pages, of the pass, or at
 * a full outbox, and never waits for an agent.  The holes' lseek()s and
 * pagemap reads, which wait on a VMM's locks, are a thread's (a window's
 * read that failed there is made here).
 */
#include "scan-core.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "extents.h"
#include "guard.h"

/* How long an agent that was sent no request since may take to drop a
 * chunk (check_dropped()). */
#define DROP_GRACE_USEC (60 * G_USEC_PER_SEC)
/* Past this long without an answer, an agent whose outbox is full is
 * passed over for the rest of the pass: one stopped VM must not hold up
 * the scanning of the others (its link gives it up later). */
#define STUCK_USEC (G_USEC_PER_SEC / 2)
/* Past this long, a VM whose look at its process is not done is passed
 * over for the rest of the pass: a process holds its mmap lock, which the
 * read of its maps waits for, as long as it likes. */
#define LOOK_USEC (5 * G_USEC_PER_SEC)

/* How often an agent's VM is looked at when nothing calls for it sooner
 * (look_due()). */
#define LOOK_PERIOD_USEC (10 * G_USEC_PER_SEC)
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

gboolean
pf_scanner_joining(PfScanner *s)
{
    return s->joining->len > 0;
}

gboolean
pf_scanner_looking(PfScanner *s)
{
    for (guint i = 0; i < s->vms->len; i++) {
        const PfVm *vm = g_ptr_array_index(s->vms, i);

        if (vm->looking != NULL || vm->reading != NULL) {
            return TRUE;
        }
    }
    return FALSE;
}

guint64
pf_scanner_full_scans(PfScanner *s)
{
    return s->full_scans;
}

gboolean
pf_scanner_in_pass(PfScanner *s)
{
    return s->in_pass;
}

/* Visits up to n pages of r from the cursor on, within the slice. */
static gsize
scan_range(PfScanner *s, PfRegion *r, gsize n)
{
    sigjmp_buf env;
    volatile gsize i = s->cur_page;
    gsize start = s->cur_page;

    if (sigsetjmp(env, 0) != 0) {
        pf_guard_env = NULL;
        s->cur_page = i;
        vms_faulted(s);
        return i - start;
    }
    pf_guard_env = &env;
    while (i < start + n && (i == start || !past_slice(s))) {
        guint8 resident[RESIDENT_PAGES];
        gsize k = MIN(start + n - i, RESIDENT_PAGES);

        /* Just before reading: a page the VMM discarded (a balloon, free
         * page reporting) since find_data() saw its extent, or one swapped
         * out, is not read, which would allocate it again. */
        if (mincore((void *)(r->map + i * PF_PAGE_SIZE), k * PF_PAGE_SIZE, resident) < 0) {
            memset(resident, 1, k);
        }
        for (gsize j = 0; j < k && (j == 0 || !past_slice(s)); j++, i++) {
            if (resident[j] & 1) {
                visit_page(s, r, i, FALSE);
            } else {
                cow_leave_hole(s, r, i, i + 1, TRUE);
            }
        }
    }
    pf_guard_env = NULL;
    s->cur_page = i;
    return i - start;
}

/*
 * A read of a VM's process on a thread (its look, a window of its memfds):
 * the VM keeps the cancellable, cancelled when it goes, so that the end
 * touches nothing of it then; the pid stays in pids (the scanner's
 * looking_pids or reading_pids) until the thread returns, so that a
 * process that makes its reads wait holds one thread of each kind,
 * however often its agent reconnects.
 */
typedef struct {
    PfVm *vm;
    GCancellable *cancel;
    GHashTable *pids; /* referenced */
    int pid;
} ThreadCall;

/* NULL when a read of this kind is under way for the pid; else *cancel
 * holds the new call's cancellable. */
static ThreadCall *
thread_call_new(PfVm *vm, GHashTable *pids, GCancellable **cancel)
{
    ThreadCall *call;

    if (g_hash_table_contains(pids, GINT_TO_POINTER(vm->pid))) {
        return NULL;
    }
    call = g_new0(ThreadCall, 1);
    call->vm = vm;
    call->cancel = g_cancellable_new();
    call->pids = g_hash_table_ref(pids);
    call->pid = vm->pid;
    g_hash_table_add(pids, GINT_TO_POINTER(vm->pid));
    *cancel = g_object_ref(call->cancel);
    return call;
}

/* The thread returned: the VM its call was for, or NULL if it went. */
static PfVm *
thread_call_end(ThreadCall *call)
{
    PfVm *vm = g_cancellable_is_cancelled(call->cancel) ? NULL : call->vm;

    g_hash_table_remove(call->pids, GINT_TO_POINTER(call->pid));
    g_hash_table_unref(call->pids);
    g_object_unref(call->cancel);
    g_free(call);
    return vm;
}

static void
window_read(GObject *source, GAsyncResult *res, gpointer user)
{
    PfExtents *x = pf_extents_read_finish(res);
    PfVm *vm = thread_call_end(user);

    if (vm == NULL) {
        pf_extents_free(x);
        return;
    }
    g_clear_object(&vm->reading);
    vm->read_failed = x == NULL;
    if (vm->extents == NULL) {
        vm->extents = x;
    } else {
        pf_extents_free(vm->extents_next);
        vm->extents_next = x;
    }
}

/* Starts reading the window of vm's memfds from page page of region k on
 * (or of the next region with pages), unless a read is under way for it,
 * or for its process still (a VM that went, its agent back since). */
static void
read_window(PfScanner *s, PfVm *vm, guint k, gsize page)
{
    ThreadCall *call;
    PfRegion *r = NULL;

    for (; k < vm->regions->len; k++, page = 0) {
        r = g_ptr_array_index(vm->regions, k);
        if (page < r->n_pages) {
            break;
        }
    }
    if (k >= vm->regions->len || vm->reading != NULL ||
        (call = thread_call_new(vm, s->reading_pids, &vm->reading)) == NULL) {
        return;
    }
    pf_extents_read_async(r, pf_vm_merges(vm) ? vm->pagemap_fd : -1, s->cow, page, call->cancel,
                          window_read, call);
}

/* The index of the first of n records (of size bytes, in order of the
 * guint32 page index at offset) whose page is at least page. */
static guint
first_at_least(const void *records, guint n, gsize size, gsize offset, gsize page)
{
    guint lo = 0, hi = n;

    while (lo < hi) {
        guint mid = lo + (hi - lo) / 2;
        guint32 v;

        memcpy(&v, (const guint8 *)records + mid * size + offset, sizeof(v));
        if (v < page) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/* Whether window x counts: one read before this pass may show holes that
 * hold data since, or miss pages written since, for longer than a pass. */
static gboolean
window_of_pass(PfScanner *s, const PfExtents *x)
{
    return x != NULL && x->usec >= s->pass_start_usec;
}

/* The window of this pass that holds the cursor, if there is one. */
static PfExtents *
window_at(PfScanner *s, PfVm *vm, PfRegion *r)
{
    for (int k = 0; k < 2; k++) {
        PfExtents *x = k == 0 ? vm->extents : vm->extents_next;

        if (window_of_pass(s, x) && x->region == r && x->from <= s->cur_page &&
            s->cur_page < x->to) {
            if (k == 1) {
                pf_extents_free(vm->extents);
                vm->extents = g_steal_pointer(&vm->extents_next);
            }
            return vm->extents;
        }
    }
    return NULL;
}

/*
 * Where the cursor, stepping over the holes [from, end), stops having
 * passed budget pages present: merged pages, which are holes of the memfd
 * but pages of the guest (KSM visits its merged pages too).  Guest RAM
 * never touched is not present, and costs nothing of the budget: a 512 GiB
 * VM using 8 GiB takes a pass as long as one of 8 GiB.  *present says how
 * many were passed.
 */
static gsize
hole_stop(const PfRegion *r, gsize from, gsize end, gsize budget, gsize *present)
{
    *present = 0;
    if (!pf_vm_merges(r->vm)) {
        return end;
    }
    for (gsize i = pf_region_next_recorded(r, from, end); i < end;
         i = pf_region_next_recorded(r, i + 1, end)) {
        PfPageState st = pf_region_page_state(r, i);

        if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO || st == PF_PAGE_PENDING) {
            if (*present == budget) {
                return i;
            }
            (*present)++;
        }
    }
    return end;
}

/*
 * Moves the cursor over holes of the memfd (cow_leave_hole()), up to the
 * next data or budget pages present (hole_stop()): a merged VM's RAM is
 * one long hole, whose merged pages are looked at for copy-on-write, and a
 * tick must stay short however big the VM.  Where the holes are, and which
 * merged pages were written, come from a window read ahead on a thread
 * (extents.h); FALSE when the cursor must wait for it (the VM is left for
 * later).  A read that failed on a thread is made here.  *present says how
 * many pages present the cursor passed.
 */
static gboolean
find_data(PfScanner *s, PfVm *vm, PfRegion *r, gsize budget, gsize *present)
{
    PfExtents *x = window_at(s, vm, r);
    const PfExtent *e;
    gsize first, stop;
    guint i;

    if (x == NULL && vm->read_failed) {
        vm->read_failed = FALSE;
        pf_extents_free(vm->extents);
        vm->extents = x = pf_extents_read(r, pf_vm_merges(vm) ? vm->pagemap_fd : -1, s->cow,
                                          s->cur_page);
    }
    *present = 0;
    if (x == NULL) {
        read_window(s, vm, r->index, s->cur_page);
        if (vm->window_wait == 0) {
            vm->window_wait = g_get_monotonic_time();
        }
        return FALSE;
    }
    vm->window_wait = 0;
    if (!window_of_pass(s, vm->extents_next)) {
        read_window(s, vm, r->index, x->to); /* ahead */
    }
    i = first_at_least(x->data->data, x->data->len, sizeof(PfExtent),
                       G_STRUCT_OFFSET(PfExtent, end), s->cur_page + 1);
    e = i < x->data->len ? &g_array_index(x->data, PfExtent, i) : NULL;
    first = e != NULL ? MAX(e->first, s->cur_page) : x->to;
    stop = hole_stop(r, s->cur_page, first, MAX(budget, 1), present);
    for (i = first_at_least(x->cow->data, x->cow->len, sizeof(PfCowSeen),
                            G_STRUCT_OFFSET(PfCowSeen, page), s->cur_page);
         i < x->cow->len && g_array_index(x->cow, PfCowSeen, i).page < stop; i++) {
        const PfCowSeen *c = &g_array_index(x->cow, PfCowSeen, i);

        cow_seen_in_hole(s, r, c->page, c->zero_pfn);
    }
    if (stop > s->cur_page) {
        cow_leave_hole(s, r, s->cur_page, stop, FALSE);
    }
    s->cur_page = stop;
    /* The rest of a long hole: looked up again from here next time.  The
     * data extent is a hint only: pages discarded since are found by
     * scan_range() before they are read. */
    s->data_end = stop < first || e == NULL ? stop : e->end;
    return TRUE;
}

/*
 * An agent is told to drop a chunk when no page of its VM maps it: its
 * memory can only come back once every process lets go of it.  One that
 * still held it when its look began (enter_vm()), having answered a
 * request sent after the DROP by then (or a minute after, if none was),
 * keeps memory pagefoldd freed, and could do so with every chunk it is
 * sent: its VM is detached.  (A compromised VMM can hide a descriptor
 * where /proc does not show it: see the README's trust boundary.)
 */
static gboolean
check_dropped(PfScanner *s, PfVm *vm, const PfVmLook *look, GError **error)
{
    GHashTable *held = pf_vm_look_held_pool(look);
    guint kept = 0;

    if (vm->dropped == NULL || vm->kind == PF_VM_BY_PID) {
        return TRUE;
    }
    for (guint i = 0; i < vm->dropped->len;) {
        const PfDropped *d = &g_array_index(vm->dropped, PfDropped, i);

        if (d->usec >= vm->look_usec) {
            i++; /* dropped after the look began: for the next one */
            continue;
        }
        if (!g_hash_table_contains(held, &d->ino)) {
            g_array_remove_index_fast(vm->dropped, i);
            continue;
        }
        kept += pf_outbox_seq_after(vm->look_answered, d->seq) ||
                vm->look_usec - d->usec > DROP_GRACE_USEC;
        i++;
    }
    if (kept > 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "it keeps %u pool chunk(s) it was told to let go of", kept);
        return FALSE;
    }
    return TRUE;
}

/* On from the VM the cursor is done with (or left): to the next, or, once
 * every VM had its turn, back to those it deferred (to_deferred()). */
static void
next_vm(PfScanner *s)
{
    cursor_to_vm(s, s->revisiting ? s->vms->len : s->cur_vm + 1);
}

/* The cursor leaves the VM it is at before its end: to come back to it in
 * this pass if later, and to start where it left it next time. */
static void
leave_vm(PfScanner *s, PfVm *vm, gboolean later)
{
    vm->resume = TRUE;
    vm->resume_region = s->cur_region;
    vm->resume_page = s->cur_page;
    vm->deferred = later;
    next_vm(s);
}

/* Whether vm waits for a window of its memfd that is not read yet: one
 * under way, or one no read can start for while a read for its process
 * has not returned (a VM that went, its agent back since). */
static gboolean
window_pending(PfScanner *s, PfVm *vm)
{
    return vm->window_wait != 0 &&
           (vm->reading != NULL ||
            g_hash_table_contains(s->reading_pids, GINT_TO_POINTER(vm->pid)));
}

static gboolean
waited_enough(PfScanner *s, gint64 now)
{
    gint64 waited = s->deferred_wait + (s->wait_since != 0 ? now - s->wait_since : 0);
    gint64 scanning = now - s->pass_start_usec - waited;

    return !s->whole_passes && waited > MAX(DEFERRED_WAIT_USEC, scanning / 4);
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

    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (!vm->deferred) {
            continue;
        }
        if ((!vm->entered && vm->look == NULL && now - vm->look_usec > LOOK_USEC) ||
            (vm->window_wait != 0 && now - vm->window_wait > LOOK_USEC)) {
            g_debug("VM %s: its process's mappings or its memfd took over %d s to read: "
                    "passed over", vm->name, (int)(LOOK_USEC / G_USEC_PER_SEC));
            vm->deferred = FALSE;
            vm->window_wait = 0;
            scan_emit_passed_over(s, vm);
            continue;
        }
        /* vm_room() takes it now, or passes it over. */
        if ((vm->entered || vm->look != NULL) && !window_pending(s, vm) &&
            (outbox_visits(vm) > 0 || vm->unmerging || pf_scanner_agent_silent(vm))) {
            if (s->wait_since != 0) {
                s->deferred_wait += now - s->wait_since;
                s->wait_since = 0;
            }
            vm->deferred = FALSE;
            s->revisiting = TRUE;
            cursor_to_vm(s, i);
            return TRUE;
        }
        waiting = TRUE;
    }
    if (!waiting) {
        return FALSE;
    }
    if (s->wait_since == 0) {
        s->wait_since = now;
    }
    if (!waited_enough(s, now)) {
        s->blocked = TRUE;
        return FALSE;
    }
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (vm->deferred) {
            g_debug("VM %s: its agent answers slowly: the pass ends without the rest of it",
                    vm->name);
        }
    }
    return FALSE;
}

static void
look_done(GObject *source, GAsyncResult *res, gpointer user)
{
    PfVmLook *look = pf_vm_look_finish(res, NULL);
    PfVm *vm = thread_call_end(user);

    if (vm == NULL) {
        pf_vm_look_free(look);
        return;
    }
    vm->look = look;
    g_clear_object(&vm->looking);
}

/* Starts the VM's look, unless one is under way or done, or a look at its
 * process is still reading (a VM that went, its agent back since). */
static void
look_start(PfScanner *s, PfVm *vm)
{
    ThreadCall *call;

    if (vm->looking != NULL || vm->look != NULL ||
        (call = thread_call_new(vm, s->looking_pids, &vm->looking)) == NULL) {
        return;
    }
    vm->look_usec = g_get_monotonic_time();
    vm->vmas_since_look = 0;
    vm->look_answered = vm->kind == PF_VM_AGENT ? pf_outbox_answered_seq(vm->outbox) : 0;
    pf_vm_look_async(vm,
                     (vm->kind == PF_VM_BY_PID ? PF_VM_LOOK_RANGES : 0) |
                         (vm->dropped != NULL && vm->dropped->len > 0 ? PF_VM_LOOK_HELD : 0),
                     call->cancel, look_done, call);
}

/*
 * Whether vm's process is to be looked at in the pass that begins.  A VM
 * attached by pid is, each pass: its look finds its RAM.  An agent's VM
 * announces its RAM; its look counts its mappings and sees whether it let
 * go of the chunks it was told to drop.  Its maps grow a line per merged
 * run, tens of thousands, and reading them each pass of a fast pace took
 * a third of pagefoldd's CPU: it is looked at when it has chunks to let go
 * of, when its count is at its budget (it merges nothing until it is
 * counted again), when what its requests may have added since (counted
 * as the most they can, vmas_since_look) nears an eighth of its budget,
 * and else every LOOK_PERIOD_USEC.  Root's scan-now looks at every VM.
 */
static gboolean
look_due(const PfScanner *s, const PfVm *vm, gint64 now)
{
    return s->whole_passes || vm->kind == PF_VM_BY_PID ||
           (vm->dropped != NULL && vm->dropped->len > 0) || vm->vma_budget == 0 ||
           vm->vmas >= vm->vma_budget || vm->vmas_since_look >= vm->vma_budget / 8 ||
           now - vm->look_usec >= LOOK_PERIOD_USEC;
}

static gboolean
begin_pass(PfScanner *s)
{
    gint64 now = g_get_monotonic_time();
    gsize candidates = 0;

    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        /* Only a page that kept its checksum since its last visit enters
         * the unstable tree: one volatile or unshared now.  Not counted,
         * the table grows for them: in advise mode, a sharer that leaves
         * its node unchanged (the node's first page changed), which is
         * rare, while counting every advise-mode sharer would cost a slot
         * each, more than its record. */
        candidates += vm->count[PF_PAGE_VOLATILE] + vm->count[PF_PAGE_UNSHARED];
    }
    if (s->vms->len == 0) {
        return FALSE;
    }
    pf_table_reset(&s->unstable.table, candidates);
    if (s->listed_sharing != s->knobs.max_page_sharing) {
        /* The knob changed: nodes full by the old value may have room
         * now, others none.  (KSM refuses the change while pages share.) */
        s->listed_sharing = s->knobs.max_page_sharing;
        for (guint32 id = 1; id < s->stable.nodes->len; id++) {
            ledger_relist(s, id);
        }
    }
    moves_evacuate(s);
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        /* A look the last pass ended without is taken as it is: its count
         * of mappings is made up by what was asked since
         * (vmas_since_look). */
        vm->entered = FALSE;
        if (look_due(s, vm, now)) {
            look_start(s, vm);
        }
        if (s->whole_passes) {
            vm->resume = FALSE; /* root asked for whole passes */
        }
    }
    s->in_pass = TRUE;
    s->revisiting = FALSE;
    s->deferred_wait = 0;
    s->wait_since = 0;
    s->pass_start_usec = g_get_monotonic_time();
    /* Each VM's first window of memfd, read while the cursor is at the
     * VMs before it (before the cursor takes the first VM's resume). */
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        vm->window_wait = 0;
        read_window(s, vm, vm->resume ? vm->resume_region : 0, vm->resume ? vm->resume_page : 0);
    }
    cursor_to_vm(s, 0);
    return TRUE;
}

typedef enum { ENTER_DONE, ENTER_LATER, ENTER_GONE } Enter;

/*
 * The cursor comes to a VM: what it maps is looked at again where due
 * (look_due(): its regions if attached by pid, the pool chunks it was
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
    if (vm->look == NULL && vm->looking == NULL &&
        !look_due(s, vm, g_get_monotonic_time())) {
        if (pf_vm_exited(vm)) {
            pf_scanner_detach(s, vm, "its process has exited");
            return ENTER_GONE;
        }
        vm->entered = TRUE;
        return ENTER_DONE;
    }
    if (vm->look == NULL) {
        look_start(s, vm);
        return ENTER_LATER;
    }
    look = g_steal_pointer(&vm->look);
    ok = pf_vm_refresh(vm, look, gone, added, &error) && check_dropped(s, vm, look, &error);
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
        cursor_to_vm(s, s->cur_vm); /* where it was left may be another region now */
    }
    vm->entered = TRUE;
    for (guint k = 0; k < added->len; k++) {
        PfRegion *r = g_ptr_array_index(added, k);

        if (!vms_place_region(s, r)) {
            g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
            pf_region_free(pf_vm_steal_region(vm, r->index));
        }
    }
    if (pf_vm_merges(vm)) {
        vm->vmas = pf_vm_look_vmas(look) + vm->vmas_since_look;
        vm->vma_budget = s->max_map_count * s->knobs.max_vma_percent / 100;
    }
    vm->counted = TRUE;
    return ENTER_DONE;
}

static void
end_pass(PfScanner *s)
{
    for (guint i = 0; i < s->vms->len; i++) {
        ((PfVm *)g_ptr_array_index(s->vms, i))->deferred = FALSE;
    }
    moves_make_joins(s);
    s->in_pass = FALSE;
    s->full_scans++;
    s->last_pass_usec = (guint64)(g_get_monotonic_time() - s->pass_start_usec);
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

    *skip = vm->unmerging;
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
    PfRegion *r;

    *moved = TRUE;
    if (s->cur_region >= vm->regions->len) {
        vm->full_scans++;
        moves_make_vm_joins(s, vm);
        next_vm(s);
        return 0;
    }
    r = g_ptr_array_index(vm->regions, s->cur_region);
    if (s->cur_page >= r->n_pages) {
        s->cur_region++;
        s->cur_page = 0;
        s->data_end = 0;
        return 0;
    }
    if (s->cur_page >= s->data_end) {
        gsize present;

        if (!find_data(s, vm, r, max, &present)) {
            leave_vm(s, vm, TRUE); /* the cursor is at another VM now */
            *moved = FALSE;
            return 0;
        }
        return present;
    }
    return scan_range(s, r, MIN(max, s->data_end - s->cur_page));
}

gsize
pf_scanner_scan(PfScanner *s, gsize max_pages, gboolean *progress)
{
    gboolean moved = FALSE, step_moved, hints_due = TRUE;
    gsize done = 0;

    s->blocked = FALSE;
    if (s->joining->len > 0) {
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

        if (!s->in_pass && !begin_pass(s)) {
            break;
        }
        if (hints_due) {
            /* First, in this pass's unstable tree: up to half the budget
             * (none of a budget of 1), so that the cursor goes on however
             * many hints come. */
            gint64 end = s->slice_end, now = g_get_monotonic_time();
            gsize hinted;

            /* And half the slice: the time is the cursor's too. */
            if (end != 0) {
                s->slice_end = now + MAX(end - now, 0) / 2;
            }
            hinted = hints_visit(s, (max_pages - done) / 2);
            s->slice_end = end;
            hints_due = FALSE;
            done += hinted;
            moved = moved || hinted > 0;
            continue;
        }
        if (s->cur_vm >= s->vms->len) {
            if (to_deferred(s)) {
                continue;
            }
            if (!s->blocked) {
                end_pass(s);
                moved = TRUE;
            }
            break;
        }
        vm = g_ptr_array_index(s->vms, s->cur_vm);
        if (!vm->entered) {
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
    pf_scanner_flush(s);
    *progress = moved;
    return done;
}

gsize
pf_scanner_scan_slice(PfScanner *s, gsize max_pages, gint64 usec, gboolean whole_passes,
                      gboolean *progress)
{
    guint64 scans = s->full_scans;
    gsize done = 0;

    s->whole_passes = whole_passes;
    s->slice_end = g_get_monotonic_time() + usec;
    *progress = FALSE;
    while (done < max_pages) {
        gboolean moved;
        gsize n = pf_scanner_scan(s, MIN(max_pages - done, 4096), &moved);

        done += n;
        *progress = *progress || moved;
        if (!moved || s->blocked || s->full_scans != scans || past_slice(s)) {
            break;
        }
    }
    s->slice_end = 0;
    s->whole_passes = FALSE;
    return done;
}
