/*
 * scan-reads.c - what a pass reads of a VM's process and memfds off the
 * main loop, on threads of GLib's pool, and takes up as the cursor comes
 * to it: its look (its mappings, counted for its budget, and the pool
 * chunks it holds, which decide whether it kept one it was told to drop),
 * and windows of its memfds read ahead (their data extents, and the
 * merged pages in their holes copied on write), with which the cursor
 * steps over the holes.  Each read waits on a VMM's locks (its mmap lock,
 * a punch's inode lock) as long as the VMM likes: hence the threads, one
 * of each kind per process at a time.
 *
 * Writes a VM's look and window fields (looking, look, look_usec,
 * look_answered, vmas_since_look, reading, extents, extents_next,
 * read_failed, window_wait); never moves the cursor, and never blocks
 * the main loop (a window's read that failed on a thread is made
 * here, once).
 */
#include "scan-core.h"

#include <string.h>

#include "extents.h"

/* How long an agent that was sent no request since may take to drop a
 * chunk (reads_check_dropped()). */
#define DROP_GRACE_USEC (60 * G_USEC_PER_SEC)
/* How often an agent's VM is looked at when nothing calls for it sooner
 * (reads_look_due()). */
#define LOOK_PERIOD_USEC (10 * G_USEC_PER_SEC)

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
    g_clear_object(&vm->scan->reading);
    vm->scan->read_failed = x == NULL;
    if (vm->scan->extents == NULL) {
        vm->scan->extents = x;
    } else {
        pf_extents_free(vm->scan->extents_next);
        vm->scan->extents_next = x;
    }
}

/* Starts reading the window of vm's memfds from page page of region k on
 * (or of the next region with pages), unless a read is under way for it,
 * or for its process still (a VM that went, its agent back since). */
void
reads_window(PfScanner *s, PfVm *vm, guint k, gsize page)
{
    ThreadCall *call;
    PfRegion *r = NULL;

    for (; k < vm->regions->len; k++, page = 0) {
        r = g_ptr_array_index(vm->regions, k);
        if (page < r->n_pages) {
            break;
        }
    }
    if (k >= vm->regions->len || vm->scan->reading != NULL ||
        (call = thread_call_new(vm, s->reads.reading_pids, &vm->scan->reading)) == NULL) {
        return;
    }
    pf_extents_read_async(r, pf_vm_merges(vm) ? vm->pagemap_fd : -1, setup_of(s)->cow, page,
                          call->cancel, window_read, call);
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
    return x != NULL && x->usec >= pass_of(s)->pass_start_usec;
}

/* The window of this pass that holds the cursor, if there is one. */
static PfExtents *
window_at(PfScanner *s, PfVm *vm, PfRegion *r, gsize at)
{
    for (int k = 0; k < 2; k++) {
        PfExtents *x = k == 0 ? vm->scan->extents : vm->scan->extents_next;

        if (window_of_pass(s, x) && x->region == r && x->from <= at && at < x->to) {
            if (k == 1) {
                pf_extents_free(vm->scan->extents);
                vm->scan->extents = g_steal_pointer(&vm->scan->extents_next);
            }
            return vm->scan->extents;
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
 * Steps over the holes of the memfd from page `at` (cow_leave_hole()), up
 * to the next data or budget pages present (hole_stop()): a merged VM's
 * RAM is one long hole, whose merged pages are looked at for
 * copy-on-write, and a tick must stay short however big the VM.  Where
 * the holes are, and which merged pages were written, come from a window
 * read ahead on a thread (extents.h); FALSE when the cursor must wait for
 * it (the VM is left for later).  A read that failed on a thread is made
 * here.  *stop: where the cursor goes on from; *data_end: where the data
 * it stops at ends (a hint: pages discarded since are found before they
 * are read); *present: how many pages present it passed.  The cursor is
 * moved by its caller (scan-cursor.c's functions).
 */
gboolean
reads_find_data(PfScanner *s, PfVm *vm, PfRegion *r, gsize at, gsize budget, gsize *stop_out,
                gsize *data_end, gsize *present)
{
    PfExtents *x = window_at(s, vm, r, at);
    const PfExtent *e;
    gsize first, stop;
    guint i;

    if (x == NULL && vm->scan->read_failed) {
        vm->scan->read_failed = FALSE;
        pf_extents_free(vm->scan->extents);
        vm->scan->extents = x = pf_extents_read(r, pf_vm_merges(vm) ? vm->pagemap_fd : -1,
                                                setup_of(s)->cow, at);
    }
    *present = 0;
    if (x == NULL) {
        reads_window(s, vm, r->index, at);
        if (vm->scan->window_wait == 0) {
            vm->scan->window_wait = g_get_monotonic_time();
        }
        return FALSE;
    }
    vm->scan->window_wait = 0;
    if (!window_of_pass(s, vm->scan->extents_next)) {
        reads_window(s, vm, r->index, x->to); /* ahead */
    }
    i = first_at_least(x->data->data, x->data->len, sizeof(PfExtent),
                       G_STRUCT_OFFSET(PfExtent, end), at + 1);
    e = i < x->data->len ? &g_array_index(x->data, PfExtent, i) : NULL;
    first = e != NULL ? MAX(e->first, at) : x->to;
    stop = hole_stop(r, at, first, MAX(budget, 1), present);
    for (i = first_at_least(x->cow->data, x->cow->len, sizeof(PfCowSeen),
                            G_STRUCT_OFFSET(PfCowSeen, page), at);
         i < x->cow->len && g_array_index(x->cow, PfCowSeen, i).page < stop; i++) {
        const PfCowSeen *c = &g_array_index(x->cow, PfCowSeen, i);

        cow_seen_in_hole(s, r, c->page, c->zero_pfn);
    }
    if (stop > at) {
        cow_leave_hole(s, r, at, stop, FALSE);
    }
    *stop_out = stop;
    /* The rest of a long hole: looked up again from here next time. */
    *data_end = stop < first || e == NULL ? stop : e->end;
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
gboolean
reads_check_dropped(PfScanner *s, PfVm *vm, const PfVmLook *look, GError **error)
{
    GHashTable *held = pf_vm_look_held_pool(look);
    guint kept = 0;

    if (vm->scan->dropped == NULL || vm->kind == PF_VM_BY_PID) {
        return TRUE;
    }
    for (guint i = 0; i < vm->scan->dropped->len;) {
        const PfDropped *d = &g_array_index(vm->scan->dropped, PfDropped, i);

        if (d->usec >= vm->scan->look_usec) {
            i++; /* dropped after the look began: for the next one */
            continue;
        }
        if (!g_hash_table_contains(held, &d->ino)) {
            g_array_remove_index_fast(vm->scan->dropped, i);
            continue;
        }
        kept += pf_outbox_seq_after(vm->scan->look_answered, d->seq) ||
                vm->scan->look_usec - d->usec > DROP_GRACE_USEC;
        i++;
    }
    if (kept > 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "it keeps %u pool chunk(s) it was told to let go of", kept);
        return FALSE;
    }
    return TRUE;
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
    vm->scan->look = look;
    g_clear_object(&vm->scan->looking);
}

/* Starts the VM's look, unless one is under way or done, or a look at its
 * process is still reading (a VM that went, its agent back since). */
void
reads_look_start(PfScanner *s, PfVm *vm)
{
    PfScanVm *sv = vm->scan;
    ThreadCall *call;

    if (vm->scan->looking != NULL || vm->scan->look != NULL ||
        (call = thread_call_new(vm, s->reads.looking_pids, &vm->scan->looking)) == NULL) {
        return;
    }
    /* What a background batch holds back would not be in the maps read,
     * nor counted after them. */
    if (vm->kind == PF_VM_AGENT) {
        pf_outbox_flush(vm->outbox);
    }
    vm->scan->look_usec = g_get_monotonic_time();
    vm->scan->vmas_since_look = 0;
    vm->scan->look_answered = vm->kind == PF_VM_AGENT ? pf_outbox_answered_seq(vm->outbox) : 0;
    pf_vm_look_async(vm,
                     (vm->kind == PF_VM_BY_PID ? PF_VM_LOOK_RANGES : 0) |
                         (sv->dropped != NULL && sv->dropped->len > 0 ? PF_VM_LOOK_HELD : 0),
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
gboolean
reads_look_due(const PfScanner *s, const PfVm *vm, gint64 now)
{
    const PfScanVm *sv = vm->scan;

    return pass_of(s)->whole_passes || vm->kind == PF_VM_BY_PID ||
           (sv->dropped != NULL && sv->dropped->len > 0) || sv->vma_budget == 0 ||
           sv->vmas >= sv->vma_budget || sv->vmas_since_look >= sv->vma_budget / 8 ||
           now - sv->look_usec >= LOOK_PERIOD_USEC;
}


/* A read under way is let go: its callback sees it cancelled, and
 * touches nothing of the VM. */
static void
cancel_read(GCancellable **read)
{
    if (*read != NULL) {
        g_cancellable_cancel(*read);
        g_clear_object(read);
    }
}

void
reads_forget_windows(PfVm *vm)
{
    cancel_read(&vm->scan->reading);
    g_clear_pointer(&vm->scan->extents, pf_extents_free);
    g_clear_pointer(&vm->scan->extents_next, pf_extents_free);
}

void
reads_forget(PfVm *vm)
{
    cancel_read(&vm->scan->looking);
    g_clear_pointer(&vm->scan->look, pf_vm_look_free);
    reads_forget_windows(vm);
}

void
reads_init(PfScanner *s)
{
    s->reads.looking_pids = g_hash_table_new(NULL, NULL);
    s->reads.reading_pids = g_hash_table_new(NULL, NULL);
}

void
reads_clear(PfScanner *s)
{
    g_hash_table_unref(s->reads.looking_pids);
    g_hash_table_unref(s->reads.reading_pids);
}
