/*
 * scan-core.h - the scanner core's state and the calls between the
 * files that make it up (scan.h), from the top down, each calling only
 * files below it:
 *
 *   scan.c          the scanner's life, pacing, VM lookups, counters
 *   scan-pass.c     the pass loop: moving the cursor, slices, entering a VM,
 *                   VMs left for later
 *   scan-hints.c    pages a device just wrote, visited before the cursor's
 *   scan-vms.c      VMs and regions coming and going, merge domains
 *   scan-cursor.c   where the pass is, kept right as VMs and regions go
 *   scan-reads.c    a VM's look and its memfds' windows, read on threads;
 *                   the holes the cursor steps over with them
 *   scan-adopt.c    merged pages of an earlier pagefoldd, taken back
 *   scan-visit.c    one visit of a page: KSM's stable and unstable search
 *   scan-answers.c  what the agents' answers make of a page
 *   scan-cow.c      copy-on-write found, sharing ended, pages back in memfd
 *   scan-moves.c    who may read a slot: the pool's chunks and who is sent
 *                   them, joins, node moves, evacuation
 *   scan-requests.c requests to agents, and what they hold until answered
 *   scan-huge.c     transparent huge pages split by merging, made again
 *   ledger.c        the slot/node ledger: the only place a pool slot's
 *                   references or a stable node's life change
 *   scan-events.c   the listeners: how the core tells the layers above
 *
 * and below them the leaves: the trees, the pool, the page-id space, the
 * VM records and their outboxes, hashing, counters.  Nothing outside the
 * core includes this header but white-box tests that read it.
 */
#pragma once

#include <sys/mman.h>

#include "cow.h"
#include "cpu-use.h"
#include "pagespace.h"
#include "scan.h"
#include "util.h"

/* A page found equal to node, whose slot its VM may not read.  Ids are
 * reused as soon as they are free (nothing holds a waiting join's node):
 * born tells the node it was found equal to from one made since under its
 * id. */
typedef struct {
    guint32 chunk; /* the node's slot's, then: */
    guint32 vm;    /* the page's VM's serial */
    guint32 slot;
    guint32 page;
    guint32 node;
    guint64 born;
    guint8 equal;  /* its page equalled the slot when its batch was made */
} Joining;

/* Past this many, joins are made before the pass ends. */
#define MAX_JOINING 65536u

/* Pool slots a process still maps after its VM was detached. */
typedef struct {
    guint32 slot;
    guint32 node;
} HeldRef;

typedef struct {
    PfScanner *s;
    int pidfd;
    guint watch;
    GArray *refs; /* HeldRef */
} Leftover;

/* Sharers a node may have as pages are adopted into it (tree.c keeps
 * 16-bit member indexes).  Counted as the ledger counts them, its requests
 * in flight included: merges asked for before a restart's adoption filled
 * the node still join it when answered, and with max_page_sharing at its
 * most they would take it past what a member index holds. */
#define ADOPT_MAX_SHARERS (G_MAXUINT16 - 1u)

/*
 * What the scanner core keeps of a VM (PfVm.scan): made as the VM is added
 * (pf_scanner_add_vm()), freed as it goes (scan-vms.c), grouped by the
 * file that writes it (the page-state helpers below count as the file
 * that calls them).  No layer above reads it: they have the
 * counters (pf_scanner_collect()) and scan.h's questions.
 */
struct _PfScanVm {
    /* scan-vms.c: its place among the scanner's VMs. */
    guint32 serial;      /* its name in the pool, never reused */
    guint watch_id;      /* pidfd watch */
    /* Its merge domain: it shares pages only with VMs of the same one
     * (pf_scanner_set_merge_domain()). */
    gboolean unlabelled; /* one of its own */
    guint32 domain;      /* else: 0 the host's default, i the named
                          * domain i */
    /* pages of this VM in each PfPageState (the page-state helpers) */
    gsize count[PF_PAGE_N_STATES];
    /* Merged and zero pages its regions had as they left (QEMU frees
     * guest RAM, telling its agent, as it exits): told with its last
     * figures. */
    gsize gone_shared;
    gsize gone_zero;

    /* scan-visit.c: its visits. */
    guint64 pages_scanned;
    guint64 pages_skipped;
    guint64 pages_hinted;

    /* scan-hints.c: ranges of its pages its agent says a device just
     * wrote, visited before the cursor's: PfHint, hint_pages pages. */
    GArray *hints;
    guint hint_head;     /* its first range not visited yet */
    gsize hint_pages;
    guint64 hints_dropped;

    /* scan-cursor.c: where the cursor left it before its end (its outbox
     * was full, or its agent silent): it starts there when it next comes. */
    gboolean resume;
    guint resume_region;
    gsize resume_page;

    /* scan-pass.c: the pass's dealings with it.  Left before its end, it
     * comes back to it later in the pass if deferred. */
    guint64 full_scans;
    gboolean deferred;
    gboolean entered;    /* looked at in this pass (enter_vm()) */
    gboolean counted;    /* its mappings were counted once: requests may go */
    /* Mappings of its process (invariant 5): counted at its last look
     * (scan-pass.c), plus the most the requests since can add
     * (scan-requests.c), or its budget after an ENOMEM (scan-answers.c). */
    guint64 vmas;
    guint64 vma_budget;  /* no merges once vmas reaches it (scan-pass.c,
                          * first set by scan-vms.c) */

    /* scan-reads.c: what is read of it on threads (its look is taken by
     * scan-pass.c as the cursor enters it, its window wait reset there
     * as a pass begins). */
    GCancellable *looking; /* its look under way, or NULL */
    PfVmLook *look;      /* its look, done, not yet taken */
    guint32 look_answered; /* its outbox's last answered batch, and the time, */
    gint64 look_usec;    /* when its look began */
    guint64 vmas_since_look; /* mappings its requests may have added since
                              * (scan-requests.c adds) */
    /* Its memfds ahead of the cursor (extents.h): the window the cursor is
     * in or comes to next, the one after, and the read under way. */
    PfExtents *extents;
    PfExtents *extents_next;
    GCancellable *reading;
    gboolean read_failed; /* the last read on a thread failed */
    gint64 window_wait;  /* since when the cursor waits for its window, or 0 */

    /* scan-requests.c: the run its last request continues. */
    guint32 run_next_page; /* the request that would continue the last run */
    guint32 run_next_slot;
    guint8 run_kind;

    /* scan-cow.c and scan-answers.c: merged pages written since
     * (copy-on-write). */
    guint64 cow;
    /* scan-cow.c: merged pages folded back as a back-end touched them. */
    guint64 backend_fold_backs;
    /* scan-answers.c: the errno its agent's last refusal said, which the
     * log said once (EINPROGRESS: merges wait for a back-end to settle);
     * 0 once a merge goes through. */
    int refusing;

    /* scan-moves.c: chunks it was told to let go of (PfDropped), until
     * its look (scan-reads.c) sees it did. */
    GArray *dropped;

    /* scan.c: counting and unmerging. */
    guint64 share;       /* its pages' parts of the stable nodes they
                          * share (PF_SHARE_ONE a node, tree.h): its part
                          * of pages_shared, nodes too big to track aside */
    guint stats_index;   /* scratch for the scanner's attribution */
    guint unmerging;     /* unmerges of it running: no merges meanwhile */
};

/* The merge domain's key, as stable nodes keep it (PF_DOMAIN_UNLABELLED). */
static inline guint32
pf_vm_domain_key(const PfVm *vm)
{
    return vm->scan->unlabelled ? PF_DOMAIN_UNLABELLED | vm->scan->serial : vm->scan->domain;
}

/*
 * The scanner's state: one record per file that writes it.  Only the
 * record's file names it (s->pass in scan-pass.c); the other files of the
 * core read it through its *_of() function below, and change it by
 * calling its file.  The view is const one level deep: a member of the
 * record cannot be assigned through it, but what a pointer member points
 * at (an array, a table) could be changed, and only the rule stops that.
 * scripts/record-writers (unit suite) checks the rule by name: no other
 * file names a record, nor hands a view's pointer member to GLib's
 * changing calls, nor casts a view back.  A record with something to
 * make or free is made and freed by its file (its *_init() and *_clear(),
 * called by scan.c in pf_scanner_new() and pf_scanner_free()); the others
 * start zeroed.
 */

/* scan.c: set as the scanner is made.  The knobs are changed by the layers
 * above through pf_scanner_get_knobs() (main.c, control-commands.c) at any
 * time between batches; the core reads them as they are at each use. */
typedef struct {
    PfKnobs knobs;
    const PfHashAlgo *algo;
    PfHashFunc hash;
    guint64 zero_checksum;
    guint64 max_map_count;
    PfCow *cow;            /* finds merged pages written since */
    int kpageflags_fd;     /* /proc/kpageflags: is a page part of a THP */
    guint32 adopt_max_sharers; /* a node takes adopted pages up to this
                                * (ADOPT_MAX_SHARERS; a model case lowers it) */
} PfScanSetup;

/* scan.c: the pacing of the background batches. */
typedef struct {
    guint timer_id;
    guint batches_paused; /* pf_scanner_pause_batches() calls not resumed */
    gsize batch_left;   /* of the wake-up's batch, scanned in slices */
    gint64 batch_start;
    gint64 batch_cpu;   /* thread CPU time when it began */
    gint64 last_batch_usec;
    gboolean resting;   /* asleep until the next batch (PfScanEvents.resting) */
} PfScanPacing;

/* scan-vms.c: VMs and regions coming and going, merge domains. */
typedef struct {
    GPtrArray *list;     /* PfVm*, owned */
    GPtrArray *domains;  /* char*: merge domain i + 1's name (0: default) */
    guint32 next_serial; /* the last PfScanVm.serial given */
    GPtrArray *leftovers; /* Leftover* */
} PfScanVms;

/* scan-pass.c: the pass. */
typedef struct {
    gboolean in_pass;
    gboolean blocked;     /* the last scan stopped at an agent's full outbox */
    gboolean whole_passes; /* a pass waits for every agent that answers */
    gboolean holding;     /* a background batch's slice: its scans' requests
                           * go when ripe (pf_scanner_flush_ripe()) */
    gint64 deferred_wait; /* usec the pass waited for deferred VMs */
    gint64 wait_since;    /* monotonic: it waits for them since (or 0) */
    gint64 slice_end;     /* monotonic: a scan stops here (0: at max_pages) */
    guint64 full_scans;
    guint listed_sharing; /* the max_page_sharing that decided which nodes
                           * are full (ledger_relist()) */
    gint64 pass_start_usec;
    guint64 last_pass_usec;
} PfScanPass;

/* scan-cursor.c: the next page the pass visits, kept right as VMs and
 * regions go (and where it left each VM: PfScanVm.resume). */
typedef struct {
    guint vm;
    guint region;
    gsize page;
    gsize data_end;       /* end of the memfd data extent holding page */
    gboolean revisiting;  /* every VM had its turn: the cursor goes back to
                           * those it deferred (PfScanVm.deferred) */
} PfScanCursor;

/* scan-hints.c */
typedef struct {
    guint vm;             /* the VM whose hints were visited last */
} PfScanHints;

/* scan-visit.c: its work, counted. */
typedef struct {
    guint64 memcmp_calls;
    guint64 stable_nodes_examined;
} PfScanVisits;

/* scan-moves.c: who may read a slot; joins. */
typedef struct {
    GArray *joining;     /* Joining: the joins being made, sorted, a slice
                          * at a time, from joining_at on */
    guint joining_at;
    guint64 joining_pass; /* full_scans when they were found: the pass */
    GArray *joins;       /* Joining: pages found equal to nodes their VM may
                          * not read, joined once the cursor is done with
                          * their VM (moves_make_vm_joins()) */
    GHashTable *waiting; /* node id -> the pages waiting to join it, of
                          * joins and joining */
    GHashTable *partial; /* chunk << 32 | VM serial -> the pass in which the
                          * VM's pages matched part of the chunk */
    guint64 memcmp_calls; /* the compares of joins */
} PfScanMoves;

/* scan-reads.c: reads on threads, one of each kind per process. */
typedef struct {
    GHashTable *looking_pids; /* pids whose look's thread has not returned */
    GHashTable *reading_pids; /* pids whose memfd window read has not */
} PfScanReads;

/* scan-adopt.c */
typedef struct {
    guint source;        /* takes back pages merged under an earlier
                          * pagefoldd, a slice at a time */
} PfScanAdopt;

/* scan-events.c */
typedef struct {
    GArray *listeners;   /* Listener */
} PfScanListeners;

struct _PfScanner {
    PfScanSetup setup;
    PfScanPacing pacing;
    PfScanVms vms;
    PfScanPass pass;
    PfScanCursor cursor;
    PfScanHints hints;
    PfScanVisits visits;
    PfScanMoves moves;
    PfScanReads reads;
    PfScanAdopt adopt;
    PfScanListeners events;

    /* Leaves' records, changed only through their own functions, called
     * where the decision is made.  The trees (tree.c): a page joins or
     * leaves a stable node in the file that decides it (scan-visit.c,
     * scan-answers.c, scan-cow.c, scan-moves.c, scan-adopt.c), a node lives
     * and dies in ledger.c; the unstable tree is reset by scan-pass.c as a
     * pass begins, filled by scan-visit.c, and emptied by scan-vms.c when a
     * region leaves mid-pass (its candidates would name pages gone). */
    PfStableTree stable;
    PfUnstableTree unstable;
    /* The page ids of every VM's live regions (pagespace.c): regions
     * placed and removed by scan-vms.c, looked up by all. */
    PfPageSpace space;
    /* The pool (pool.c), made by scan-moves.c with the first merging VM:
     * its slots' references change in ledger.c alone, its chunks and who
     * is sent them in scan-moves.c. */
    PfPool *pool;
};

/* The records, for the files that read them and do not write them. */
static inline const PfScanSetup *
setup_of(const PfScanner *s)
{
    return &s->setup;
}

static inline const PfScanVms *
vms_of(const PfScanner *s)
{
    return &s->vms;
}

static inline const PfScanPass *
pass_of(const PfScanner *s)
{
    return &s->pass;
}

static inline const PfScanCursor *
cursor_of(const PfScanner *s)
{
    return &s->cursor;
}

static inline const PfScanVisits *
visits_of(const PfScanner *s)
{
    return &s->visits;
}

static inline const PfScanMoves *
moves_of(const PfScanner *s)
{
    return &s->moves;
}

static inline const PfScanReads *
reads_of(const PfScanner *s)
{
    return &s->reads;
}

/* The VMs the scanner has, in the pass's order. */
static inline guint
vm_count(const PfScanner *s)
{
    return s->vms.list->len;
}

static inline PfVm *
vm_at(const PfScanner *s, guint i)
{
    return g_ptr_array_index(s->vms.list, i);
}

/* Each file makes and frees its record (scan.c calls them as it makes and
 * frees the scanner).  pass_init() reads the knobs: after they are set. */
void pass_init(PfScanner *s);
void vms_init(PfScanner *s);
void vms_clear(PfScanner *s);
void moves_init(PfScanner *s);
void moves_clear(PfScanner *s);
void reads_init(PfScanner *s);
void reads_clear(PfScanner *s);
void adopt_clear(PfScanner *s);
void events_init(PfScanner *s);
void events_clear(PfScanner *s);

/* ---- small reads of the state ---- */

/*
 * Whether the slice of main-loop time the scan runs in is spent.  Looked
 * at page by page: reading a VMM's pagemap waits for its mmap lock, which
 * its agent holds while it remaps, and lseek() on its memfd for the inode
 * lock a punch holds; each wait is short, but a slice must not add up
 * thousands of them.
 */
static inline gboolean
past_slice(PfScanner *s)
{
    const PfScanPass *pass = pass_of(s);

    return pass->slice_end != 0 && g_get_monotonic_time() >= pass->slice_end;
}

static inline PfRegion *
region_of(PfScanner *s, guint32 id)
{
    return pf_page_space_region(&s->space, id);
}

static inline const guint8 *
page_data(PfScanner *s, guint32 id)
{
    return pf_page_space_data(&s->space, id);
}

static inline const PfStableNode *
node_at(PfScanner *s, guint32 id)
{
    return pf_stable_tree_node(&s->stable, id);
}

/* Pages looked up in memory at a time (mincore()) before they are read. */
#define RESIDENT_PAGES 32

/* Whether a guest page is in memory (never read otherwise: reading would
 * allocate it, or swap it in).  The VMM may discard it right after this:
 * a window of a memcmp. */
static inline gboolean
page_in_memory(const guint8 *page)
{
    unsigned char v = 0;

    return mincore((void *)page, PF_PAGE_SIZE, &v) == 0 && (v & 1);
}

/* How many pages of vm may be visited for its outbox now: a visit asks
 * for two pages at most (a pair from the unstable tree). */
static inline gsize
outbox_visits(PfVm *vm)
{
    return vm->kind == PF_VM_BY_PID ? G_MAXSIZE : pf_outbox_room(vm->outbox) / 2;
}

/* Mappings a VM may have before its merges stop (invariant 5). */
static inline guint64
vmas_allowed(const PfScanner *s)
{
    return setup_of(s)->max_map_count * setup_of(s)->knobs.max_vma_percent / 100;
}

/* May this VM's pages be merged for real now?  Merging VMs group only with
 * merging VMs: a pool node is physical sharing, an advise node is not. */
static inline gboolean
can_merge(const PfVm *vm)
{
    return pf_vm_merges(vm) && vm->scan->vmas < vm->scan->vma_budget && !vm->scan->unmerging;
}

/* ---- page states: every change goes through these, which keep the
 * VM's count of pages in each state true ---- */

static inline void
set_state(PfRegion *r, PfPage *p, PfPageState state)
{
    r->vm->scan->count[p->state]--;
    r->vm->scan->count[state]++;
    p->state = state;
}

/* Seen again from scratch: no checksum to keep, smart scan starts over. */
static inline void
reset_page(PfRegion *r, PfPage *p, PfPageState state)
{
    set_state(r, p, state);
    p->checksum = 0;
    p->age = 0;
    p->hinted = 0;
}

/* Merged (or, in advise mode, found shareable): smart scan starts over. */
static inline void
mark_merged(PfRegion *r, PfPage *p, PfPageState state)
{
    set_state(r, p, state);
    p->age = 0;
}

/* ---- ledger.c: slot references and node lives ---- */

/* Guest pages already sharing the node, or on their way in. */
guint32 ledger_sharers(PfScanner *s, const PfStableNode *n);
/* A node with max_page_sharing sharers leaves the lookup table, and comes
 * back once it has room (tree.h): called wherever its sharers change. */
void ledger_relist(PfScanner *s, guint32 id);
/* A node goes when no page shares it and no request or leftover holds
 * its slot. */
void ledger_maybe_drop(PfScanner *s, guint32 id);
/* A new canonical slot for the VMs of serials vms (sorted) holding data,
 * its one reference the node's to be; PF_POOL_SLOT_NONE on failure. */
guint32 ledger_new_slot(PfScanner *s, const guint32 *vms, guint n_vms, const guint8 *data,
                        GError **error);
/* A page (or a request for one) takes a reference on node's slot. */
void ledger_take(PfScanner *s, guint32 slot, guint32 node);
/* A slot of an adopted chunk that nothing holds takes its first
 * reference, its node's to be; FALSE (nothing taken) where something
 * holds it already. */
gboolean ledger_adopt_slot(PfScanner *s, guint32 slot);
/* A hold on a slot ends (its mapping is gone); its node may go. */
void ledger_put(PfScanner *s, guint32 slot, guint32 node);
/* A hold that must outlive the page's record: kept in keep when its
 * process may still map the slot, else put now. */
void ledger_hold_or_put(PfScanner *s, GArray *keep, guint32 slot, guint32 node);
/* Forgets what the scanner knows of a page: its hold on a slot goes to
 * keep (or is put), and it is absent from now on. */
void ledger_forget_page(PfScanner *s, PfRegion *r, gsize idx, GArray *keep);

/* ---- scan-cursor.c ---- */

/* The cursor goes to the VM at index i: where it left it, if it did. */
void cursor_to_vm(PfScanner *s, guint i);
/* On from the VM it is done with (or left): to the next, or, once every
 * VM had its turn (cursor_revisit()), back to those deferred. */
void cursor_next_vm(PfScanner *s);
void cursor_revisit(PfScanner *s, gboolean revisiting);
/* It leaves vm before its end, and starts where it left it next time;
 * on to the next VM. */
void cursor_leave_vm(PfScanner *s, PfVm *vm);
/* vm starts from its first page next time. */
void cursor_forget_vm(PfVm *vm);
void cursor_next_region(PfScanner *s);
/* It is at page of its region, in a data extent that ends at data_end. */
void cursor_at_page(PfScanner *s, gsize page, gsize data_end);
/* It is at page, in the same data extent. */
void cursor_to_page(PfScanner *s, gsize page);
/* The VM at index idx left the scanner's list: the cursor stays right (if
 * it was at that VM, on to the next one, or back to those deferred once
 * every VM had its turn). */
void cursor_vm_removed(PfScanner *s, guint idx);
/* Region k of vm left it (removed) or changed: the cursor, if there, and
 * where it left the VM stay right. */
void cursor_region_changed(PfScanner *s, PfVm *vm, guint k, gboolean removed);

/* ---- scan-hints.c ---- */

/* Visits hinted pages, up to max, VMs in turn; returns the pages taken
 * off their queues. */
gsize hints_visit(PfScanner *s, gsize max);
/* The VM's hints go (it is being unmerged, or io_hints went off). */
void hints_forget(PfVm *vm);

/* ---- scan-reads.c ---- */

/* Starts reading the window of vm's memfds from page page of region k on
 * (or of the next region with pages), unless a read is under way for it
 * or for its process. */
void reads_window(PfScanner *s, PfVm *vm, guint k, gsize page);
/* Steps over holes of region r from page at, up to the next data or
 * budget pages present: where the cursor goes on (*stop), where that
 * data ends (*data_end), how many pages present it passed (*present);
 * FALSE when it must wait for the window (the VM is left for later). */
gboolean reads_find_data(PfScanner *s, PfVm *vm, PfRegion *r, gsize at, gsize budget,
                         gsize *stop, gsize *data_end, gsize *present);
/* Whether vm's process is to be looked at now, and starting its look. */
gboolean reads_look_due(const PfScanner *s, const PfVm *vm, gint64 now);
void reads_look_start(PfScanner *s, PfVm *vm);
/* Its windows of memfd read ahead, and any read under way, go (a region
 * of it went); and its look too (it goes). */
void reads_forget_windows(PfVm *vm);
void reads_forget(PfVm *vm);
/* Whether the VM let go of the chunks it was told to drop, as its look
 * saw; FALSE (error says why) when it is to be detached. */
gboolean reads_check_dropped(PfScanner *s, PfVm *vm, const PfVmLook *look, GError **error);

/* ---- scan-visit.c ---- */

/* One page of r, by KSM's rules (scan.h); r's VM has room for two
 * requests.  hinted: a device just wrote it (scan-hints.c). */
void visit_page(PfScanner *s, PfRegion *r, gsize idx, gboolean hinted);

/* ---- scan-moves.c ---- */

/* Is the VM one of the chunk's (pool.h)?  It was sent the chunk then. */
gboolean moves_chunk_is_for(const PfPoolChunk *chunk, const PfVm *vm);
/* Page id (unmerged, or merged on another node) is to share node to. */
void moves_join(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, guint32 to);
/* The page waits for the cursor to be done with its VM to join node,
 * whose slot its VM may not read (moves_make_vm_joins()). */
void moves_wait_to_join(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, guint32 node);
/* Whether node has room for one more page to wait to join it: its
 * sharers and the pages waiting for it, together under max_page_sharing.
 * (Pages of VMs that read the node may still join it first: a waiting
 * page it has no room for then is given up by join_still(), and pairs in
 * the unstable tree at its next visit.) */
gboolean moves_room_to_wait(PfScanner *s, guint32 node);
/* The joins waiting are to be made: as many as the scan's slice leaves
 * time for, the rest by moves_continue_joins(). */
void moves_make_joins(PfScanner *s);
/* The same for vm's joins alone, once the cursor is done with vm in this
 * pass: every page of it the pass visits was seen, which is all that
 * whether they match a whole chunk depends on.  The others wait on. */
void moves_make_vm_joins(PfScanner *s, const PfVm *vm);
/* Makes more of the joins moves_make_joins() began, within the slice;
 * FALSE while some are left. */
gboolean moves_continue_joins(PfScanner *s);
/* Forgets the waiting joins of one VM, or of all (vm NULL). */
void moves_forget_joins(PfScanner *s, const PfVm *vm);
/* A merged page of a retired node follows the node's successor. */
void moves_follow(PfScanner *s, PfRegion *r, gsize idx);
/* Nodes whose slot is in a chunk being emptied move to fuller ones. */
void moves_evacuate(PfScanner *s);

/* ---- scan-requests.c ---- */

/* Asks the page's agent to act; the page waits in PENDING.  from: see
 * PfPending. */
void request_page(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, PfItemKind kind,
                  guint32 slot, guint32 node, guint32 from);
/* Asks r's agent to make the 2 MiB extent at page idx a huge page. */
void request_collapse(PfScanner *s, PfRegion *r, gsize idx);
/* What a request held (its slot, and the slot of the node it moves from)
 * is let go. */
void request_put(PfScanner *s, const PfPending *pd);
/* Every request for a page of r is settled: what it holds goes now, its
 * answer changes nothing. */
void requests_settle_region(PfScanner *s, PfRegion *r);
/* Every request of the VM, answered or not, is let go: the slots it may
 * have mapped go to keep (NULL: its process is gone). */
void requests_abandon(PfScanner *s, PfVm *vm, GArray *keep);
/* The requests of VMs with enough of them, or one that will be old
 * horizon_usec from now, go to their agents; the others wait for the next
 * background batch's. */
void pf_scanner_flush_ripe(PfScanner *s, gint64 horizon_usec);

/* ---- scan-cow.c ---- */

/* Merged pages of [from, to) written since: they leave their nodes. */
void cow_check_merged(PfScanner *s, PfRegion *r, gsize from, gsize to);
/* Pages [from, to) of r are holes of the memfd, or not in memory; look:
 * whether to look for copy-on-write among them now (else a window read
 * ahead did, and cow_seen_in_hole() had what it found). */
void cow_leave_hole(PfScanner *s, PfRegion *r, gsize from, gsize to, gboolean look);
/* What a window read ahead found of page idx, in a hole (extents.h). */
void cow_seen_in_hole(PfScanner *s, PfRegion *r, gsize idx, gboolean zero_pfn);
/* A page found written since it was merged. */
void cow_found(PfScanner *s, PfRegion *r, gsize idx);

/* ---- scan-huge.c ---- */

/* Before the first merge in an extent: is it a transparent huge page? */
void huge_note(PfScanner *s, PfRegion *r, gsize idx);
/* After an unmerge: whether page idx's extent was a huge page and has no
 * merged page left (its marks are cleared then: asked once); *first is
 * its first page. */
gboolean huge_restorable(PfScanner *s, PfRegion *r, gsize idx, gsize *first);
/* Makes the extent at first a huge page again from here: a VM attached by
 * pid (an agent's VM asks its agent). */
void huge_collapse_by_pid(PfRegion *r, gsize first);

/* ---- scan-vms.c ---- */

/* Gives r page ids (FALSE: none left); its pages are absent. */
gboolean vms_place_region(PfScanner *s, PfRegion *r);

/* Takes the region out of the page space and the trees; the caller frees
 * it or keeps it as a placeholder. */
void vms_release_region(PfScanner *s, PfRegion *r, GArray *keep);
/* A region that faulted when read leaves the scanner (and a VM attached
 * by pid; an agent's keeps it as a placeholder). */
void vms_drop_region(PfScanner *s, PfRegion *r);
/* A region faulted at pf_guard_addr as it was read: it is dropped, or its
 * VM detached (and freed). */
void vms_faulted(PfScanner *s);

/* ---- scan-events.c: telling the layers above ---- */

void scan_emit_vm_gone(PfScanner *s, PfVm *vm, const char *why);
void scan_emit_passed_over(PfScanner *s, PfVm *vm);
void scan_emit_chunk(PfScanner *s, PfVm *vm, const PfPoolChunk *chunk, gboolean drop);
void scan_emit_domain(PfScanner *s, PfVm *vm);
void scan_emit_resting(PfScanner *s, gboolean resting);
