/*
 * scan.c - see scan.h.
 *
 * Reading guest RAM can fault: a memfd truncated under us raises SIGBUS.
 * QEMU seals its RAM against shrinking, but pagefoldd must survive any
 * process it is pointed at, so page reads run under a SIGBUS guard and a
 * faulting region is dropped, never the daemon.
 */
#include "scan.h"

#include <errno.h>
#include <fcntl.h>
#include <glib-unix.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cow.h"
#include "link.h"
#include "scan-internal.h"
#include "util.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

#define PAGEMAP_PRESENT (1ull << 63)
/* How long an agent that was sent no request since may take to drop a
 * chunk (check_dropped()). */
#define DROP_GRACE_USEC (60 * G_USEC_PER_SEC)


/* ---- the SIGBUS guard ---- */

static __thread sigjmp_buf *guard_env;
static __thread void *guard_addr;

static void
sigbus_handler(int sig, siginfo_t *si, void *uc)
{
    if (guard_env != NULL) {
        guard_addr = si->si_addr;
        siglongjmp(*guard_env, 1);
    }
    /* Not ours: let the default action happen on return. */
    signal(SIGBUS, SIG_DFL);
}

static void
guard_install_once(void)
{
    static gsize done;

    if (g_once_init_enter(&done)) {
        struct sigaction sa = { 0 };

        sa.sa_sigaction = sigbus_handler;
        /* NODEFER: we leave the handler by siglongjmp without restoring
         * the mask, and a second fault must not find SIGBUS blocked. */
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGBUS, &sa, NULL);
        g_once_init_leave(&done, 1);
    }
}

/* ---- page space: page ids -> regions ---- */

static PfRegion *
region_of(PfScanner *s, guint32 id)
{
    PfRegion *r = s->last_region;
    guint lo = 0, hi = s->regions->len;

    if (r != NULL && id - r->base < r->n_pages) {
        return r;
    }
    while (hi - lo > 1) {
        guint mid = (lo + hi) / 2;

        if (((PfRegion *)g_ptr_array_index(s->regions, mid))->base <= id) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    g_assert(lo < s->regions->len);
    r = g_ptr_array_index(s->regions, lo);
    g_assert(id - r->base < r->n_pages);
    s->last_region = r;
    return r;
}

static PfPage *
page_of(guint32 id, gpointer user)
{
    /* A page without a record reads as absent, with no checksum: should
     * the unstable tree name one (it is emptied at each pass, and a page
     * it holds is forgotten only when the cursor comes back to it, in the
     * next), it is passed over.  The stable tree writes only the records
     * of its members, which are pages present. */
    static PfPage absent;
    PfRegion *r = region_of(user, id);
    PfPage *p = pf_region_page(r, id - r->base);

    if (p == NULL) {
        absent = (PfPage){ 0 };
        return &absent;
    }
    return p;
}

static const guint8 *
page_data(PfScanner *s, guint32 id)
{
    PfRegion *r = region_of(s, id);

    return r->map + (gsize)(id - r->base) * PF_PAGE_SIZE;
}

static gboolean
place_region(PfScanner *s, PfRegion *r)
{
    guint64 candidate = 1;
    guint pos = 0;

    for (; pos < s->regions->len; pos++) {
        PfRegion *o = g_ptr_array_index(s->regions, pos);

        if (o->base - candidate >= r->n_pages) {
            break;
        }
        candidate = (guint64)o->base + o->n_pages;
    }
    if (candidate + r->n_pages >= G_MAXUINT32) {
        return FALSE;
    }
    r->base = (guint32)candidate;
    g_ptr_array_insert(s->regions, (gint)pos, r);
    r->vm->count[PF_PAGE_ABSENT] += r->n_pages;
    return TRUE;
}

/* ---- page states ---- */

static inline void
set_state(PfRegion *r, PfPage *p, PfPageState state)
{
    r->vm->count[p->state]--;
    r->vm->count[state]++;
    p->state = state;
}

/* Seen again from scratch: two stable visits before any decision. */
static void
reset_page(PfRegion *r, PfPage *p, PfPageState state)
{
    set_state(r, p, state);
    p->checksum = 0;
    p->age = 0;
    p->skips = 0;
}

static const PfStableNode *
node_at(PfScanner *s, guint32 id)
{
    return pf_stable_tree_node(&s->stable, id);
}

static guint32 node_sharers(PfScanner *s, const PfStableNode *n);

/* A node with max_page_sharing sharers leaves the lookup table, and comes
 * back once it has room (tree.h): called wherever its sharers change. */
static void
node_relist(PfScanner *s, guint32 id)
{
    const PfStableNode *n = node_at(s, id);

    if (n->live) {
        pf_stable_tree_set_full(&s->stable, id,
                                node_sharers(s, n) >= s->knobs.max_page_sharing);
    }
}

/* A node goes when no page shares it and, in merge mode, no request or
 * leftover mapping holds its slot: its own reference is then the last.
 * Every path that lets a sharer go comes here: a node that stays may have
 * room again. */
static void
node_maybe_drop(PfScanner *s, guint32 id)
{
    const PfStableNode *n = node_at(s, id);
    guint32 slot = n->slot;

    if (!n->live) {
        return;
    }
    if (n->n_members > 0 || (slot != PF_POOL_SLOT_NONE && pf_pool_refs(s->pool, slot) > 1)) {
        node_relist(s, id);
        return;
    }
    pf_stable_tree_drop(&s->stable, id);
    if (slot != PF_POOL_SLOT_NONE) {
        pf_pool_unref(s->pool, slot);
    }
}

/* A page's hold on a pool slot ends (its mapping is gone). */
static void
put_slot(PfScanner *s, guint32 slot, guint32 node)
{
    if (slot != PF_POOL_SLOT_NONE) {
        pf_pool_unref(s->pool, slot);
    }
    if (node != 0) {
        node_maybe_drop(s, node);
    }
}

/* A slot reference that must outlive the page's record: either its
 * process is gone (put it now) or it may still map the slot (keep). */
static void
hold_or_put(PfScanner *s, GArray *keep, guint32 slot, guint32 node)
{
    if (slot == PF_POOL_SLOT_NONE) {
        if (node != 0) {
            node_maybe_drop(s, node);
        }
        return;
    }
    if (keep != NULL) {
        HeldRef h = { slot, node };

        g_array_append_val(keep, h);
    } else {
        put_slot(s, slot, node);
    }
}

/* Forgets what the scanner knows of a page.  Slots the page maps go to
 * keep when the process may still map them, else are put back. */
static void
forget_page(PfScanner *s, PfRegion *r, gsize idx, GArray *keep)
{
    PfPage *p = pf_region_page(r, idx);

    if (p == NULL) {
        return;
    }
    if (p->state == PF_PAGE_SHARED) {
        guint32 node = p->node;

        pf_stable_tree_remove(&s->stable, r->base + (guint32)idx);
        hold_or_put(s, keep, node_at(s, node)->slot, node);
    }
    reset_page(r, p, PF_PAGE_ABSENT);
}

static void
make_absent(PfScanner *s, PfRegion *r, gsize idx)
{
    forget_page(s, r, idx, NULL);
}

/* Takes the region out of the page space and the trees; the caller frees
 * it.  Candidates of this pass may point into it: the unstable tree is
 * emptied, which costs at most a pass of merges. */
static void
release_region(PfScanner *s, PfRegion *r, GArray *keep)
{
    for (gsize i = pf_region_next_recorded(r, 0, r->n_pages); i < r->n_pages;
         i = pf_region_next_recorded(r, i + 1, r->n_pages)) {
        if (pf_region_page_state(r, i) != PF_PAGE_ABSENT) {
            forget_page(s, r, i, keep);
        }
    }
    r->vm->count[PF_PAGE_ABSENT] -= r->n_pages;
    pf_table_clear(&s->unstable.table);
    g_array_set_size(s->joins, 0);
    g_ptr_array_remove(s->regions, r);
    s->last_region = NULL;
}

typedef struct {
    PfScanner *s;
    guint32 first, n_pages; /* the page ids of the region that went */
} GoneRange;

/* A request for a page of a region that left the VM: whatever the agent
 * did with it, the page maps no pool slot now (the agent mapped all of the
 * region from its memfd before it said GONE), so what the request held
 * (pf_scanner_complete()'s references) is let go now, once, and its answer,
 * if it comes, changes nothing.  It is marked settled before its
 * references go: the last of them may free its node, its slot and the
 * slot's chunk, and the chunk's DROP goes out (drop_chunk_cb()) while the
 * link still has the request, which must then read as holding nothing
 * (pool.h: a chunk goes only when no request holds a slot of it). */
static gboolean
settle_gone_cb(PfPending *pd, gpointer user)
{
    GoneRange *g = user;
    PfPending held = *pd;

    if (pd->kind == PF_PENDING_SETTLED || pd->page - g->first >= g->n_pages) {
        return FALSE;
    }
    pd->kind = PF_PENDING_SETTLED;
    if (held.kind != PF_ITEM_COLLAPSE) {
        put_slot(g->s, held.slot, held.node);
        if (held.from != 0) {
            put_slot(g->s, node_at(g->s, held.from)->slot, held.from);
        }
    }
    return TRUE;
}

/* Takes the region out of the scanner and out of its VM.  An agent's
 * region keeps its index, as a placeholder (the agent names regions by
 * index); a placeholder holds nothing to release. */
static void
drop_region(PfScanner *s, PfRegion *r, GArray *keep)
{
    PfVm *vm = r->vm;
    guint k;

    if (!g_ptr_array_find(vm->regions, r, &k)) {
        g_return_if_reached();
    }
    if (vm->link != NULL && pf_region_live(r)) {
        /* Requests for it are settled now, as for a region gone: their
         * answers, when they come, change nothing. */
        GoneRange g = { s, r->base, (guint32)r->n_pages };

        pf_link_withdraw(vm->link, settle_gone_cb, &g);
    }
    if (pf_region_live(r)) {
        release_region(s, r, keep);
    }
    if (vm->link != NULL) {
        pf_region_refuse(r, "it faulted when read (truncated under us?)");
        return; /* n_pages 0 now: the cursor steps over it */
    }
    if (s->cur_vm < s->vms->len && g_ptr_array_index(s->vms, s->cur_vm) == vm) {
        if (k < s->cur_region) {
            s->cur_region--;
        } else if (k == s->cur_region) {
            s->cur_page = 0;
            s->data_end = 0;
        }
    }
    g_ptr_array_remove_index(vm->regions, k);
}

/* ---- one visit ---- */

/* Whether a guest page is in memory: one discarded since it was seen, or
 * swapped out, is not read (that would allocate it, or swap it in).  The
 * VMM may discard it right after this: a window of a memcmp. */
static gboolean
in_memory(const guint8 *page)
{
    unsigned char v = 0;

    return mincore((void *)page, PF_PAGE_SIZE, &v) == 0 && (v & 1);
}

/* Is another guest page equal to data?  Not if it is not in memory. */
static inline gboolean
page_equal(PfScanner *s, const guint8 *data, guint32 other)
{
    const guint8 *o = page_data(s, other);

    if (!in_memory(o)) {
        return FALSE;
    }
    s->memcmp_calls++;
    return memcmp(data, o, PF_PAGE_SIZE) == 0;
}

static guint
skip_age(guint age)
{
    if (age <= 3) {
        return 1;
    }
    if (age <= 5) {
        return 2;
    }
    if (age <= 8) {
        return 4;
    }
    return 8;
}

/* KSM's smart scan (6.7): a page gets three visits at full rate, then is
 * skipped for 1, 2, 4 and at most 8 passes between visits while it keeps
 * failing to merge. */
static gboolean
smart_skip(PfPage *p)
{
    guint age = p->age;

    if (age != G_MAXUINT8) {
        p->age++;
    }
    if (age < 3) {
        return FALSE;
    }
    if (p->skips == 0) {
        p->skips = skip_age(age);
        return FALSE;
    }
    p->skips--;
    return TRUE;
}

static void
merged(PfRegion *r, PfPage *p, PfPageState state)
{
    set_state(r, p, state);
    p->age = 0;
    p->skips = 0;
}

/* Is data the content a stable node stands for: its pool slot once
 * merged, its first guest page in advise mode? */
static gboolean
node_equal(PfScanner *s, const guint8 *data, const PfStableNode *n)
{
    if (n->slot == PF_POOL_SLOT_NONE) {
        return page_equal(s, data, n->members[0]);
    }
    s->memcmp_calls++;
    return memcmp(data, pf_pool_data(s->pool, n->slot), PF_PAGE_SIZE) == 0;
}

/* Guest pages already sharing the node, or on their way in. */
static guint32
node_sharers(PfScanner *s, const PfStableNode *n)
{
    return n->slot != PF_POOL_SLOT_NONE ? pf_pool_refs(s->pool, n->slot) - 1 : n->n_members;
}

/* May this VM's pages be merged for real now?  Merging VMs group only with
 * merging VMs: a pool node is physical sharing, an advise node is not. */
static gboolean
can_merge(PfVm *vm)
{
    return pf_vm_merges(vm) && vm->vmas < vm->vma_budget && !vm->unmerging;
}

/* ---- huge pages ---- */

#define HUGE_SHIFT 21
#define HUGE_PAGES (1u << (HUGE_SHIFT - PF_PAGE_SHIFT))
#define KPF_THP (1ull << 22)

/* Extents of 2 MiB are counted from the region's first 2 MiB-aligned
 * address; a region not aligned so never had huge pages to restore. */
static gboolean
extent_of(PfRegion *r, gsize idx, gsize *extent)
{
    if (r->host_addr % (1u << HUGE_SHIFT) != 0 || r->file_offset % (1u << HUGE_SHIFT) != 0) {
        return FALSE;
    }
    *extent = idx / HUGE_PAGES;
    return (*extent + 1) * HUGE_PAGES <= r->n_pages;
}

/* Before the first merge in an extent: is it a transparent huge page? */
static void
note_huge(PfScanner *s, PfRegion *r, gsize idx)
{
    gsize e;
    guint64 entry = 0, flags = 0;
    off_t at;

    if (!extent_of(r, idx, &e) || (r->huge_seen[e / 8] & (1u << (e % 8))) ||
        s->kpageflags_fd < 0 || r->vm->pagemap_fd < 0) {
        return;
    }
    r->huge_seen[e / 8] |= 1u << (e % 8);
    at = (off_t)((r->host_addr / PF_PAGE_SIZE + e * HUGE_PAGES) * sizeof(guint64));
    if (pread(r->vm->pagemap_fd, &entry, sizeof(entry), at) == sizeof(entry) &&
        (entry & PAGEMAP_PRESENT) &&
        pread(s->kpageflags_fd, &flags, sizeof(flags),
              (off_t)((entry & ((1ull << 55) - 1)) * sizeof(guint64))) == sizeof(flags) &&
        (flags & KPF_THP)) {
        r->huge_was[e / 8] |= 1u << (e % 8);
    }
}

/* After an unmerge: an extent that was a huge page and has no merged page
 * left is collapsed into a huge page again, in the VM's process. */
static void
restore_huge(PfScanner *s, PfRegion *r, gsize idx)
{
    gsize e;
    struct iovec iov;

    if (!extent_of(r, idx, &e) || !(r->huge_was[e / 8] & (1u << (e % 8)))) {
        return;
    }
    for (gsize i = e * HUGE_PAGES; i < (e + 1) * HUGE_PAGES; i++) {
        PfPageState st = pf_region_page_state(r, i);

        if (st == PF_PAGE_PENDING ||
            (pf_vm_merges(r->vm) && (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO))) {
            return;
        }
    }
    r->huge_seen[e / 8] &= ~(1u << (e % 8));
    r->huge_was[e / 8] &= ~(1u << (e % 8));
    if (r->vm->link != NULL) {
        /* The agent collapses: only it can lift its write protection. */
        PfWireItem item = { 0 };
        PfPending pd = { .page = r->base + (guint32)(e * HUGE_PAGES),
                         .kind = PF_ITEM_COLLAPSE };
        guint k;

        g_ptr_array_find(r->vm->regions, r, &k);
        item.kind = PF_ITEM_COLLAPSE;
        item.region = k;
        item.page = e * HUGE_PAGES;
        pf_link_queue(r->vm->link, &item, &pd);
        return;
    }
    iov.iov_base = (void *)(guintptr)(r->host_addr + e * HUGE_PAGES * PF_PAGE_SIZE);
    iov.iov_len = HUGE_PAGES * PF_PAGE_SIZE;
    if (syscall(SYS_process_madvise, r->vm->pidfd, &iov, 1, MADV_COLLAPSE, 0) < 0) {
        g_debug("VM %s: MADV_COLLAPSE at %p: %s", r->vm->name, iov.iov_base, g_strerror(errno));
    }
}

/* Asks the page's agent to act; the page waits in PENDING.  from: see
 * PfPending. */
static void
request(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, PfItemKind kind, guint32 slot,
        guint32 node, guint32 from)
{
    PfWireItem item = { 0 };
    PfPending pd = { .page = id, .slot = slot, .node = node, .from = from, .kind = (guint8)kind };
    guint k;

    if (!g_ptr_array_find(r->vm->regions, r, &k)) {
        g_return_if_reached();
    }
    item.kind = (guint8)kind;
    item.region = k;
    item.page = id - r->base;
    if (slot != PF_POOL_SLOT_NONE && kind != PF_ITEM_UNMERGE) {
        pf_pool_locate(s->pool, slot, &item.chunk, &item.slot);
    }
    if (kind != PF_ITEM_UNMERGE) {
        note_huge(s, r, id - r->base);
    }
    set_state(r, p, PF_PAGE_PENDING);
    /* A remap that does not continue the previous one splits a mapping in
     * three at worst: count that until the next pass counts for real, so
     * a pass cannot overshoot the budget. */
    if (kind != PF_ITEM_UNMERGE &&
        !(id == r->vm->run_next_page && kind == r->vm->run_kind &&
          (kind == PF_ITEM_ZERO || slot == r->vm->run_next_slot))) {
        r->vm->vmas += 2;
    }
    r->vm->run_next_page = id + 1;
    r->vm->run_next_slot = slot + 1;
    r->vm->run_kind = (guint8)kind;
    pf_link_queue(r->vm->link, &item, &pd);
}

static void check_merged(PfScanner *s, PfRegion *r, gsize from, gsize to);

/* ---- who may read a slot ---- */

/*
 * A VM maps only slots of the chunks it was sent, each made for one set of
 * VMs (pool.h).  A page that joins a node its VM holds no chunk of moves
 * the node first: the content gets a slot for its members' VMs and the
 * newcomer's, the members are merged over to it (the agent compares and
 * remaps, as for any merge), and the old node is retired, going with its
 * last member.  KSM has no such step: in one kernel every page is in
 * every process's reach.
 */
static guint32 move_node(PfScanner *s, guint32 node, PfVm *joiner);
static gboolean chunk_is_for(const PfPoolChunk *chunk, const PfVm *vm);

/* Page id (unmerged, or merged on another node) is to share node `to`. */
static void
join_node(PfScanner *s, PfRegion *r, PfPage *p, guint32 id, guint32 to)
{
    guint32 from = p->state == PF_PAGE_SHARED ? p->node : 0, slot;

    if (!pf_pool_readable(s->pool, node_at(s, to)->slot, r->vm->serial) &&
        (to = move_node(s, to, r->vm)) == 0) {
        return;
    }
    slot = node_at(s, to)->slot;
    if (from != 0) {
        /* Its reference on the old slot goes when the agent answers. */
        pf_stable_tree_remove(&s->stable, id);
    }
    pf_pool_ref(s->pool, slot);
    node_relist(s, to);
    request(s, r, p, id, PF_ITEM_MERGE, slot, to, from);
}

static int
cmp_u32(gconstpointer a, gconstpointer b)
{
    guint32 x = *(const guint32 *)a, y = *(const guint32 *)b;

    return x < y ? -1 : x > y;
}

/*
 * Gives node id's content a new slot, for the VMs its slot was for (those
 * of its members, and of pages on their way in) that are still here, and
 * the joiner's, and moves its members there.  A member whose VM is at its
 * mapping budget, or a page still on its way in, follows later
 * (follow_move()).  Returns the new node, or 0 (the node as it was) if it
 * cannot move now.
 */
static guint32
move_node(PfScanner *s, guint32 id, PfVm *joiner)
{
    g_autoptr(GArray) vms = g_array_new(FALSE, FALSE, sizeof(guint32));
    g_autoptr(GError) error = NULL;
    g_autofree guint32 *members = NULL;
    const PfStableNode *n = node_at(s, id);
    guint32 n_members = n->n_members, slot, to, c, index;
    guint64 checksum = n->checksum;
    const PfPoolChunk *chunk;

    pf_pool_locate(s->pool, n->slot, &c, &index);
    chunk = pf_pool_chunk(s->pool, c);
    if (joiner != NULL) {
        g_array_append_val(vms, joiner->serial);
    }
    /* Each VM once: the joiner holds no chunk of the node's. */
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (pf_vm_merges(vm) && chunk_is_for(chunk, vm)) {
            g_array_append_val(vms, vm->serial);
        }
    }
    g_array_sort(vms, cmp_u32);
    slot = pf_pool_alloc(s->pool, (const guint32 *)(gpointer)vms->data, vms->len,
                         pf_pool_data(s->pool, n->slot), &error);
    if (slot == PF_POOL_SLOT_NONE) {
        g_warning("pool: %s", error->message);
        return 0;
    }
    members = g_memdup2(n->members, n_members * sizeof(guint32));
    to = pf_stable_tree_create(&s->stable, checksum, slot, n->domain); /* n may move */
    pf_stable_tree_retire(&s->stable, id, to);
    for (guint32 i = 0; i < n_members; i++) {
        PfRegion *mr = region_of(s, members[i]);

        if (can_merge(mr->vm)) {
            join_node(s, mr, pf_region_page(mr, members[i] - mr->base), members[i], to);
        }
    }
    if (joiner == NULL && node_at(s, to)->n_members == 0 && pf_pool_refs(s->pool, slot) == 1) {
        /* Nobody could move: the old node stays as it was. */
        node_maybe_drop(s, to);
        pf_stable_tree_unretire(&s->stable, id);
        return 0;
    }
    return to;
}

/*
 * A merged page of a retired node (it could not move with the others, or
 * came in while they moved) follows the node's successor.  With none left
 * (every page that moved there has gone since), the node takes its place
 * again.
 */
static void
follow_move(PfScanner *s, PfRegion *r, gsize idx)
{
    guint32 node = pf_region_page(r, idx)->node, to = node_at(s, node)->next;
    const PfStableNode *n = node_at(s, node);

    if (to == 0 || !can_merge(r->vm) || s->knobs.run == 2) {
        return;
    }
    for (guint hops = 0; to != 0 && hops < 8; hops++) {
        const PfStableNode *t = node_at(s, to);

        if (!t->live || t->slot == PF_POOL_SLOT_NONE || t->checksum != n->checksum ||
            memcmp(pf_pool_data(s->pool, t->slot), pf_pool_data(s->pool, n->slot),
                   PF_PAGE_SIZE) != 0) {
            break;
        }
        if (t->next == 0) {
            if (node_sharers(s, t) < s->knobs.max_page_sharing) {
                join_node(s, r, pf_region_page(r, idx), r->base + (guint32)idx, to);
                return;
            }
            break;
        }
        to = t->next;
    }
    pf_stable_tree_unretire(&s->stable, node);
}

/* Could any member of the node be moved now? */
static gboolean
node_can_move(PfScanner *s, const PfStableNode *n)
{
    for (guint32 i = 0; i < n->n_members; i++) {
        if (can_merge(region_of(s, n->members[i])->vm)) {
            return TRUE;
        }
    }
    return FALSE;
}

/* Nodes whose slot is in a chunk being emptied move to fuller ones (not
 * while none of their pages could follow: that would only make and free
 * a slot each pass). */
static void
evacuate(PfScanner *s)
{
    if (s->pool == NULL || pf_pool_n_evacuating(s->pool) == 0) {
        return;
    }
    for (guint32 id = 1; id < s->stable.nodes->len; id++) {
        const PfStableNode *n = node_at(s, id);

        if (n->live && n->next == 0 && n->slot != PF_POOL_SLOT_NONE &&
            pf_pool_evacuating(s->pool, n->slot) && node_can_move(s, n)) {
            move_node(s, id, NULL);
        }
    }
}

static int
cmp_joining(gconstpointer a, gconstpointer b)
{
    const Joining *x = a, *y = b;

    if (x->chunk != y->chunk) {
        return x->chunk < y->chunk ? -1 : 1;
    }
    if (x->vm != y->vm) {
        return x->vm < y->vm ? -1 : 1;
    }
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/* Can this waiting page still join the node it was found equal to? */
static gboolean
join_still(PfScanner *s, const Joining *j)
{
    PfRegion *r = region_of(s, j->page);
    const PfStableNode *n = node_at(s, j->node);

    /* Its VM may have changed merge domain since it was found equal. */
    return pf_region_page_state(r, j->page - r->base) == PF_PAGE_UNSHARED && can_merge(r->vm) &&
           n->live && n->next == 0 && n->slot == j->slot && n->domain == r->vm->domain &&
           node_sharers(s, n) < s->knobs.max_page_sharing;
}

/*
 * The pages of this pass that matched nodes their VM may not read.  Where
 * a VM's pages match every slot in use of a chunk (a VM that came to share
 * what others share: typically all of it), the chunk becomes its too (it
 * reads nothing it does not share) and its pages just merge; elsewhere
 * their nodes move (join_node()), which costs a remap of every page
 * already sharing.
 */
static void
make_joins(PfScanner *s)
{
    g_array_sort(s->joins, cmp_joining);
    for (guint i = 0; i < s->joins->len;) {
        const Joining *first = &g_array_index(s->joins, Joining, i);
        guint e = i, distinct = 0;
        guint32 last_slot = PF_POOL_SLOT_NONE;

        while (e < s->joins->len && g_array_index(s->joins, Joining, e).chunk == first->chunk &&
               g_array_index(s->joins, Joining, e).vm == first->vm) {
            const Joining *j = &g_array_index(s->joins, Joining, e);

            if (j->slot != last_slot && join_still(s, j)) {
                distinct++;
                last_slot = j->slot;
            }
            e++;
        }
        if (distinct > 0 && distinct == pf_pool_chunk_live(s->pool, first->chunk)) {
            PfRegion *r = region_of(s, first->page);

            pf_pool_extend(s->pool, first->chunk, first->vm);
            pf_link_send_chunk(r->vm->link, pf_pool_chunk(s->pool, first->chunk));
        } else if (distinct > 0) {
            /* Part of it: the rest may be written by then (a guest that
             * rewrites a block, caught halfway by a pass).  Moving costs
             * every sharer a remap: only at the next pass that sees it. */
            guint64 key = (guint64)first->chunk << 32 | first->vm;
            gpointer seen;

            if (!g_hash_table_lookup_extended(s->partial, &key, NULL, &seen) ||
                GPOINTER_TO_SIZE(seen) >= s->full_scans) {
                g_hash_table_insert(s->partial, g_memdup2(&key, sizeof(key)),
                                    GSIZE_TO_POINTER(s->full_scans));
                i = e;
                continue;
            }
            g_hash_table_remove(s->partial, &key);
        }
        for (; i < e; i++) {
            const Joining *j = &g_array_index(s->joins, Joining, i);

            if (join_still(s, j)) {
                PfRegion *r = region_of(s, j->page);

                join_node(s, r, pf_region_page(r, j->page - r->base), j->page, j->node);
            }
        }
    }
    g_array_set_size(s->joins, 0);
    {
        GHashTableIter it;
        gpointer seen;

        g_hash_table_iter_init(&it, s->partial);
        while (g_hash_table_iter_next(&it, NULL, &seen)) {
            if (GPOINTER_TO_SIZE(seen) + 1 < s->full_scans) {
                g_hash_table_iter_remove(&it);
            }
        }
    }
}

static void
visit(PfScanner *s, PfRegion *r, gsize idx)
{
    guint32 id = r->base + (guint32)idx;
    PfPage *p = pf_region_page_make(r, idx);
    const guint8 *data = r->map + idx * PF_PAGE_SIZE;
    gboolean merge_domain = pf_vm_merges(r->vm);
    gboolean merging = can_merge(r->vm);
    PfTableIter it;
    guint64 c;
    guint32 other;

    if (p == NULL || p->state == PF_PAGE_PENDING) {
        return; /* no memory for its record; or its agent has it */
    }
    if (merge_domain && (p->state == PF_PAGE_SHARED || p->state == PF_PAGE_ZERO)) {
        /* Merged: nothing to read.  A merged page is a hole of the memfd,
         * where copy-on-write is looked for; one found among data (its
         * fold-back failed after copying, or its punch only zeroed it: a
         * huge page that could not be split) is looked at here. */
        check_merged(s, r, idx, idx + 1);
        return;
    }
    if (s->knobs.smart_scan && p->state != PF_PAGE_SHARED &&
        p->state != PF_PAGE_ZERO && smart_skip(p)) {
        r->vm->pages_skipped++;
        return;
    }
    r->vm->pages_scanned++;

    /* Advise mode: do pages that would be merged still hold what they
     * share?  A merged page would have left by copy-on-write.  A sharer
     * must still equal its node's first page (memcmp, no checksum needed);
     * the first page itself must keep the node's checksum; a zero page
     * must be zero.  Whoever fails leaves, and is judged like any other. */
    if (p->state == PF_PAGE_SHARED) {
        const PfStableNode *n = node_at(s, p->node);
        guint32 node = p->node;

        if (n->members[0] != id) {
            if (page_equal(s, data, n->members[0])) {
                return;
            }
            c = s->hash(data);
        } else if ((c = s->hash(data)) == n->checksum) {
            return;
        }
        pf_stable_tree_remove(&s->stable, id);
        node_maybe_drop(s, node);
        set_state(r, p, PF_PAGE_VOLATILE);
    } else if (p->state == PF_PAGE_ZERO) {
        if (pf_page_is_zero(data)) {
            return;
        }
        c = s->hash(data);
        set_state(r, p, PF_PAGE_VOLATILE);
    } else {
        c = s->hash(data);
    }

    if (p->state == PF_PAGE_ABSENT || c != p->checksum) {
        p->checksum = c;
        set_state(r, p, PF_PAGE_VOLATILE);
        return;
    }

    if (s->knobs.use_zero_pages && c == s->zero_checksum && pf_page_is_zero(data)) {
        if (merging) {
            g_autoptr(GError) error = NULL;
            PfVm *vm = r->vm;
            gboolean run = vm->run_kind == PF_ITEM_ZERO && id == vm->run_next_page;
            guint32 zslot = pf_pool_zero_slot(pf_scanner_get_pool(s),
                                              run ? vm->run_next_slot - 1 : PF_POOL_SLOT_NONE,
                                              &error);

            if (zslot != PF_POOL_SLOT_NONE) {
                request(s, r, p, id, PF_ITEM_ZERO, zslot, 0, 0);
            } else {
                g_warning("pool: %s", error->message);
            }
            return;
        }
        if (!merge_domain) {
            merged(r, p, PF_PAGE_ZERO);
            return;
        }
        /* A merging VM at its mapping budget: it waits, unshared. */
    }

    pf_table_iter_init(&it, &s->stable.table, c);
    while (merging || !merge_domain) {
        const PfStableNode *n;

        if ((other = pf_table_iter_next(&it)) == 0) {
            break;
        }
        s->stable_nodes_examined++;
        n = node_at(s, other);
        /* Full nodes are not listed, unless max_page_sharing was lowered
         * this pass (begin_pass()). */
        if ((n->slot != PF_POOL_SLOT_NONE) != merge_domain ||
            n->domain != r->vm->domain ||
            node_sharers(s, n) >= s->knobs.max_page_sharing ||
            !node_equal(s, data, n)) {
            continue;
        }
        if (merging && !pf_pool_readable(s->pool, n->slot, r->vm->serial)) {
            /* Joined when the pass ends, with every other page of this VM
             * that joins the same chunk's content (make_joins()). */
            Joining j = { 0, r->vm->serial, n->slot, id, other };
            guint32 index;

            pf_pool_locate(s->pool, n->slot, &j.chunk, &index);
            g_array_append_val(s->joins, j);
            set_state(r, p, PF_PAGE_UNSHARED);
            if (s->joins->len >= MAX_JOINING) {
                make_joins(s);
            }
        } else if (merging) {
            join_node(s, r, p, id, other);
        } else {
            pf_stable_tree_add(&s->stable, other, id);
            node_relist(s, other);
            merged(r, p, PF_PAGE_SHARED);
        }
        return;
    }

    pf_table_iter_init(&it, &s->unstable.table, c);
    while (merging || !merge_domain) {
        PfRegion *orr;
        PfPage *o;
        guint32 node, slot = PF_POOL_SLOT_NONE;

        if ((other = pf_table_iter_next(&it)) == 0) {
            break;
        }
        orr = region_of(s, other);
        o = page_of(other, s);
        if (other == id || o->state != PF_PAGE_UNSHARED ||
            can_merge(orr->vm) != merging || pf_vm_merges(orr->vm) != merge_domain ||
            orr->vm->domain != r->vm->domain ||
            /* The pair's other request goes to its own agent, which has
             * as much to answer as its link takes: not now. */
            (merging && pf_link_room(orr->vm->link) == 0) || !page_equal(s, data, other)) {
            continue;
        }
        if (merging) {
            g_autoptr(GError) error = NULL;

            /* The two VMs' own slot (pool.h): a VM whose pages join it
             * later is sent its chunk, or it moves (make_joins()). */
            guint32 vms[2] = { MIN(r->vm->serial, orr->vm->serial),
                               MAX(r->vm->serial, orr->vm->serial) };

            /* The canonical copy; checked against both pages again, since
             * either may have changed while it was copied. */
            slot = pf_pool_alloc(s->pool, vms, vms[0] == vms[1] ? 1 : 2, data, &error);
            if (slot == PF_POOL_SLOT_NONE) {
                g_warning("pool: %s", error->message);
                break;
            }
            if (!in_memory(page_data(s, other)) ||
                memcmp(pf_pool_data(s->pool, slot), page_data(s, other), PF_PAGE_SIZE) != 0 ||
                memcmp(pf_pool_data(s->pool, slot), data, PF_PAGE_SIZE) != 0) {
                pf_pool_unref(s->pool, slot);
                continue;
            }
        }
        pf_table_remove(&s->unstable.table, c, other);
        node = pf_stable_tree_create(&s->stable, c, slot, r->vm->domain);
        if (merging) {
            pf_pool_ref(s->pool, slot);
            request(s, orr, o, other, PF_ITEM_MERGE, slot, node, 0);
            pf_pool_ref(s->pool, slot);
            request(s, r, p, id, PF_ITEM_MERGE, slot, node, 0);
        } else {
            pf_stable_tree_add(&s->stable, node, other);
            merged(orr, o, PF_PAGE_SHARED);
            pf_stable_tree_add(&s->stable, node, id);
            merged(r, p, PF_PAGE_SHARED);
        }
        node_relist(s, node); /* max_page_sharing may be 2 */
        return;
    }

    pf_table_insert(&s->unstable.table, c, id);
    set_state(r, p, PF_PAGE_UNSHARED);
}

void
pf_scanner_complete(PfScanner *s, PfVm *vm, const PfPending *pd, PfResultStatus status, int err)
{
    PfRegion *r;
    PfPage *p;

    if (pd->kind == PF_PENDING_SETTLED) {
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
        put_slot(s, pd->slot, pd->node);
        if (pd->from != 0) {
            put_slot(s, node_at(s, pd->from)->slot, pd->from);
        }
        reset_page(r, p, PF_PAGE_VOLATILE);
        return;
    }
    if (status == PF_RESULT_ERROR) {
        static const char *const verb[] = { "", "merge", "zero", "unmerge", "collapse" };

        /* A page in DMA (EBUSY), an agent stepping back whose ADVISE is
         * on its way (EPERM): expected, and passing, page after page. */
        if (err == EBUSY || err == EPERM) {
            g_debug("VM %s: agent could not %s page %u: %s", vm->name, verb[pd->kind],
                    pd->page - r->base, g_strerror(err));
        } else {
            g_message("VM %s: agent could not %s page %u: %s", vm->name, verb[pd->kind],
                      pd->page - r->base, g_strerror(err));
        }
        if (err == ENOMEM) {
            /* Out of mappings: no more merges until the next count. */
            vm->vmas = vm->vma_budget;
        }
    }
    switch (pd->kind) {
    case PF_ITEM_MERGE:
        if (status == PF_RESULT_DONE) {
            pf_stable_tree_add(&s->stable, pd->node, pd->page);
            merged(r, p, PF_PAGE_SHARED);
            if (pd->from != 0) {
                put_slot(s, node_at(s, pd->from)->slot, pd->from);
            }
            /* Its node moved while it was on its way in: after it. */
            follow_move(s, r, pd->page - r->base);
            return;
        }
        put_slot(s, pd->slot, pd->node);
        if (pd->from != 0) {
            /* A move that did not happen: still on the old slot, unless
             * written meanwhile (the compare failed) or the agent had to
             * fold it back (its mapping went with a failed remap).  Only
             * a page in DMA is known to be as it was, and tries again
             * later; the others are unmerged, which is right in each case
             * and keeps the count true. */
            pf_stable_tree_add(&s->stable, pd->from, pd->page);
            merged(r, p, PF_PAGE_SHARED);
            if (status == PF_RESULT_CHANGED) {
                vm->cow++;
            }
            if (status != PF_RESULT_ERROR || err != EBUSY) {
                pf_scanner_end_sharing(s, r, pd->page - r->base);
            }
            return;
        }
        break;
    case PF_ITEM_ZERO:
        if (status == PF_RESULT_DONE) {
            merged(r, p, PF_PAGE_ZERO);
            return;
        }
        break;
    case PF_ITEM_UNMERGE:
        if (status == PF_RESULT_DONE) {
            put_slot(s, pd->slot, pd->node);
            reset_page(r, p, PF_PAGE_VOLATILE);
            restore_huge(s, r, pd->page - r->base);
            return;
        }
        /* Still mapped from its slot (in DMA, or the kernel refused): it
         * is merged as before, and its copy on write is found again at
         * the next pass, which asks again. */
        if (pd->node != 0 && node_at(s, pd->node)->live) {
            pf_stable_tree_add(&s->stable, pd->node, pd->page);
            merged(r, p, PF_PAGE_SHARED);
            return;
        }
        if (pd->slot == PF_POOL_SLOT_NONE) {
            merged(r, p, PF_PAGE_ZERO);
            return;
        }
        g_warning("VM %s: page %u could not be folded back; pool slot %u stays taken",
                  vm->name, pd->page - r->base, pd->slot);
        break;
    default:
        break;
    }
    reset_page(r, p, PF_PAGE_VOLATILE);
}

/* ---- the pass loop ---- */

static PfRegion *
region_at_address(PfScanner *s, const void *addr)
{
    for (guint i = 0; i < s->regions->len; i++) {
        PfRegion *r = g_ptr_array_index(s->regions, i);

        if ((const guint8 *)addr >= r->map && (const guint8 *)addr < r->map + r->size) {
            return r;
        }
    }
    return NULL;
}

static void leave_hole(PfScanner *s, PfRegion *r, gsize from, gsize to);

/*
 * Whether the slice of main-loop time the scan runs in is spent.  Looked
 * at page by page: reading a VMM's pagemap waits for its mmap lock, which
 * its agent holds while it remaps, and lseek() on its memfd for the inode
 * lock a punch holds; each wait is short, but a slice must not add up
 * thousands of them.
 */
static gboolean
past_slice(PfScanner *s)
{
    return s->slice_end != 0 && g_get_monotonic_time() >= s->slice_end;
}

/* Pages looked up in memory at a time (mincore()) before they are read. */
#define RESIDENT_PAGES 32

static gsize
scan_range(PfScanner *s, PfRegion *r, gsize n)
{
    sigjmp_buf env;
    volatile gsize i = s->cur_page;
    gsize start = s->cur_page;

    if (sigsetjmp(env, 0) != 0) {
        PfRegion *bad;

        guard_env = NULL;
        bad = region_at_address(s, guard_addr);
        if (bad == NULL) {
            g_error("SIGBUS at %p outside guest RAM", guard_addr);
        }
        g_warning("VM %s: region %s faulted at %p (truncated under us?); "
                  "dropping it", bad->vm->name, bad->name, guard_addr);
        s->cur_page = i;
        if (pf_vm_merges(bad->vm)) {
            pf_scanner_detach(s, bad->vm, "its RAM faulted (truncated under us?)");
        } else {
            drop_region(s, bad, NULL);
        }
        return i - start;
    }
    guard_env = &env;
    while (i < start + n && (i == start || !past_slice(s))) {
        guint8 in_memory[RESIDENT_PAGES];
        gsize k = MIN(start + n - i, RESIDENT_PAGES);

        /* Just before reading: a page the VMM discarded (a balloon, free
         * page reporting) since find_data() saw its extent, or one swapped
         * out, is not read, which would allocate it again. */
        if (mincore((void *)(r->map + i * PF_PAGE_SIZE), k * PF_PAGE_SIZE, in_memory) < 0) {
            memset(in_memory, 1, k);
        }
        for (gsize j = 0; j < k && (j == 0 || !past_slice(s)); j++, i++) {
            if (in_memory[j] & 1) {
                visit(s, r, i);
            } else {
                leave_hole(s, r, i, i + 1);
            }
        }
    }
    guard_env = NULL;
    s->cur_page = i;
    return i - start;
}

/*
 * Merged pages are holes of the memfd (or, where a punch could not free a
 * page of a huge one, zeroed data nobody maps: visit() looks there).  One
 * the guest wrote has been copied on write into an anonymous page of its
 * own, which cow.c finds in pagemap, swapped out or merged by host KSM
 * as well.  Such a page leaves its node now, and its agent is asked to
 * fold it back into the memfd, where the scanner can see it again.
 */
/* Ends a page's sharing.  A merged page is folded back into its memfd by
 * its agent, its slot reference held until the agent answers; a page of an
 * advise-mode VM just forgets its node. */
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
        request(s, r, p, id, PF_ITEM_UNMERGE, slot, node, 0);
        return;
    }
    if (node != 0) {
        node_maybe_drop(s, node);
    }
    reset_page(r, p, PF_PAGE_VOLATILE);
}

static void
cow_found(PfScanner *s, PfRegion *r, gsize idx)
{
    PfPageState st = pf_region_page_state(r, idx);

    if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO) {
        r->vm->cow++;
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

static void
check_merged(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    CowCtx ctx = { s, r };

    while (from < to) {
        /* One look at up to 128 MiB of a process's page tables: a merged
         * VM of a TiB is a few thousand of them, not half a million. */
        gsize n = MIN(to - from, 32768u);
        gboolean any = FALSE;

        for (gsize i = pf_region_next_recorded(r, from, from + n); i < from + n && !any;
             i = pf_region_next_recorded(r, i + 1, from + n)) {
            PfPageState st = pf_region_page_state(r, i);

            any = st == PF_PAGE_SHARED || st == PF_PAGE_ZERO;
        }
        if (any && !pf_cow_find(s->cow, r->vm->pagemap_fd, r->host_addr, from, from + n,
                                cow_seen, &ctx)) {
            return; /* the process is going: its pidfd will say so */
        }
        from += n;
    }
}

/*
 * Pages [from, to) of r are holes of the memfd (never touched by the
 * guest, or discarded since), or pages not in memory: reading them through
 * the mapping would allocate them (or swap them in).  A merged page is a
 * hole too: it is looked at for copy-on-write; every other page is
 * forgotten, and the records of extents left with no page are freed.
 */
static void
leave_hole(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    gboolean merges = pf_vm_merges(r->vm);

    if (merges) {
        check_merged(s, r, from, to);
    }
    for (gsize i = pf_region_next_recorded(r, from, to); i < to;
         i = pf_region_next_recorded(r, i + 1, to)) {
        PfPageState st = pf_region_page_state(r, i);

        if (merges && st == PF_PAGE_SHARED) {
            follow_move(s, r, i);
        } else if (st != PF_PAGE_ABSENT && st != PF_PAGE_PENDING &&
                   !(merges && st == PF_PAGE_ZERO)) {
            make_absent(s, r, i);
        }
    }
    pf_region_trim(r, from, to);
}

/* Moves the cursor over holes of the memfd (leave_hole()), at most budget
 * pages of one at a time: a merged VM's RAM is one long hole, whose merged
 * pages are looked at for copy-on-write, and a tick must stay short
 * however big the VM. */
static void
find_data(PfScanner *s, PfRegion *r, gsize budget)
{
    off_t pos = (off_t)(r->file_offset + s->cur_page * PF_PAGE_SIZE);
    off_t data = lseek(r->fd, pos, SEEK_DATA);
    gsize first, end, stop;

    if (data < 0) {
        first = errno == ENXIO ? r->n_pages : s->cur_page;
        end = r->n_pages;
    } else {
        off_t hole = lseek(r->fd, data, SEEK_HOLE);

        first = MIN(r->n_pages, (gsize)(data - (off_t)r->file_offset) / PF_PAGE_SIZE);
        end = hole < 0 ? r->n_pages
                       : MIN(r->n_pages, (gsize)(hole - (off_t)r->file_offset) / PF_PAGE_SIZE);
    }
    stop = MIN(first, s->cur_page + MAX(budget, 1));
    leave_hole(s, r, s->cur_page, stop);
    s->cur_page = stop;
    /* The rest of a long hole: looked up again from here next time.  The
     * data extent is a hint only: pages discarded since are found by
     * scan_range() before they are read. */
    s->data_end = stop < first ? stop : MAX(end, first + 1);
}

/*
 * An agent is told to drop a chunk when no page of its VM maps it: its
 * memory can only come back once every process lets go of it.  One that
 * still holds it once it has answered a request sent after the DROP (or a
 * minute after, if none was) keeps memory pagefoldd freed, and could do
 * so with every chunk it is sent: its VM is detached.  (A compromised VMM
 * can hide a descriptor where /proc does not show it: see the README's
 * trust boundary.)
 */
static gboolean
check_dropped(PfScanner *s, PfVm *vm, GError **error)
{
    g_autoptr(GHashTable) held = NULL;
    guint kept = 0;

    if (vm->dropped == NULL || vm->dropped->len == 0 || vm->link == NULL) {
        return TRUE;
    }
    held = pf_vm_held_pool(vm);
    for (guint i = 0; i < vm->dropped->len;) {
        const PfDropped *d = &g_array_index(vm->dropped, PfDropped, i);

        if (!g_hash_table_contains(held, &d->ino)) {
            g_array_remove_index_fast(vm->dropped, i);
            continue;
        }
        kept += pf_link_answered_since(vm->link, d->seq) ||
                g_get_monotonic_time() - d->usec > DROP_GRACE_USEC;
        i++;
    }
    if (kept > 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "it keeps %u pool chunk(s) it was told to let go of", kept);
        return FALSE;
    }
    return TRUE;
}

static gboolean
begin_pass(PfScanner *s)
{
    gsize candidates = 0;

    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        /* Only a page that kept its checksum since its last visit enters
         * the unstable tree: one volatile or unshared now. */
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
            node_relist(s, id);
        }
    }
    evacuate(s);
    s->in_pass = TRUE;
    s->cur_vm = 0;
    s->entered = G_MAXUINT;
    s->cur_region = 0;
    s->cur_page = 0;
    s->data_end = 0;
    s->pass_start_usec = g_get_monotonic_time();
    return TRUE;
}

/*
 * The cursor comes to a VM: what it maps is looked at again (its regions
 * if attached by pid, the pool chunks it was told to drop, its mappings),
 * here rather than for every VM as the pass begins: each look reads its
 * /proc/PID/maps, which waits for the process's mmap lock, and a busy VMM
 * remapping its RAM holds it for a while.  FALSE when the VM was detached
 * (the cursor is at the next one then).
 */
static gboolean
enter_vm(PfScanner *s, PfVm *vm)
{
    g_autoptr(GPtrArray) gone = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    g_autoptr(GPtrArray) added = g_ptr_array_new();
    g_autoptr(GError) error = NULL;

    if (!pf_vm_refresh(vm, gone, added, &error) || !check_dropped(s, vm, &error)) {
        pf_scanner_detach(s, vm, error->message);
        s->entered = G_MAXUINT;
        return FALSE;
    }
    for (guint k = 0; k < gone->len; k++) {
        release_region(s, g_ptr_array_index(gone, k), NULL);
    }
    for (guint k = 0; k < added->len; k++) {
        PfRegion *r = g_ptr_array_index(added, k);

        if (!place_region(s, r)) {
            g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
            g_ptr_array_remove(vm->regions, r);
        }
    }
    if (pf_vm_merges(vm)) {
        vm->vmas = pf_vm_count_vmas(vm);
        vm->vma_budget = s->max_map_count * s->knobs.max_vma_percent / 100;
    }
    return TRUE;
}

static void
end_pass(PfScanner *s)
{
    make_joins(s);
    s->in_pass = FALSE;
    s->full_scans++;
    s->last_pass_usec = (guint64)(g_get_monotonic_time() - s->pass_start_usec);
}

/* The cursor leaves the current VM for the next. */
static void
next_vm(PfScanner *s)
{
    s->cur_vm++;
    s->cur_region = 0;
    s->cur_page = 0;
    s->data_end = 0;
}

/*
 * How many pages of vm the cursor may take now.  A merging VM's agent
 * answers at its own pace: while its link has no room for more requests
 * the cursor waits there (0), and goes on as answers come; a VM being
 * unmerged, or whose agent has answered nothing for a while, is passed
 * over for this pass (*skip).
 */
static gsize
vm_room(PfScanner *s, PfVm *vm, gboolean *skip)
{
    gsize room;

    *skip = vm->unmerging;
    if (*skip || vm->link == NULL) {
        return G_MAXSIZE;
    }
    /* A visit asks for two pages at most (a pair from the unstable tree). */
    room = pf_link_room(vm->link) / 2;
    if (room == 0 && pf_agent_silent(vm)) {
        g_debug("VM %s: its agent has answered nothing for %" G_GINT64_FORMAT
                " ms: passed over", vm->name, pf_link_waiting_usec(vm->link) / 1000);
        pf_scan_jobs_passed_over(s, vm);
        *skip = TRUE;
    }
    return room;
}

gsize
pf_scanner_scan(PfScanner *s, gsize max_pages)
{
    gsize done = 0;

    s->blocked = FALSE;
    while (done < max_pages && !(done > 0 && past_slice(s))) {
        PfVm *vm;
        PfRegion *r;
        gsize room;
        gboolean skip;

        if (!s->in_pass && !begin_pass(s)) {
            break;
        }
        if (s->cur_vm >= s->vms->len) {
            end_pass(s);
            break;
        }
        vm = g_ptr_array_index(s->vms, s->cur_vm);
        if (s->entered != s->cur_vm) {
            s->entered = s->cur_vm;
            if (!enter_vm(s, vm)) {
                continue;
            }
        }
        room = vm_room(s, vm, &skip);
        if (skip) {
            next_vm(s);
            continue;
        }
        if (room == 0) {
            s->blocked = TRUE;
            break;
        }
        if (s->cur_region >= vm->regions->len) {
            vm->full_scans++;
            next_vm(s);
            continue;
        }
        r = g_ptr_array_index(vm->regions, s->cur_region);
        if (s->cur_page >= r->n_pages) {
            s->cur_region++;
            s->cur_page = 0;
            s->data_end = 0;
            continue;
        }
        if (s->cur_page >= s->data_end) {
            gsize from = s->cur_page;

            /* Holes count as visited: batch_size() paces passes over all
             * pages, and merged pages are holes too. */
            find_data(s, r, MIN(max_pages - done, room));
            done += s->cur_page - from;
            continue;
        }
        done += scan_range(s, r, MIN(MIN(max_pages - done, room), s->data_end - s->cur_page));
    }
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *v = g_ptr_array_index(s->vms, i);

        if (v->link != NULL) {
            pf_link_flush(v->link);
        }
    }
    return done;
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
            make_absent(s, r, i);
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
    vm->mode = "advise";
    g_free(vm->mode_reason);
    vm->mode_reason = g_strdup(reason);
    g_message("VM %s (pid %d) is in advise mode from now on: %s", vm->name, vm->pid, reason);
}

void
pf_scanner_discarded(PfScanner *s, PfVm *vm, guint region, guint64 first, guint64 n)
{
    back_in_memfd(s, g_ptr_array_index(vm->regions, region), first, first + n);
}

/* ---- VMs ---- */

static gboolean
vm_exited_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfVm *vm = user;

    vm->watch_id = 0;
    pf_scanner_detach(vm->scanner, vm, "its process exited");
    return G_SOURCE_REMOVE;
}

/* Is the VM one of the chunk's (pool.h)?  It was sent the chunk then. */
static gboolean
chunk_is_for(const PfPoolChunk *chunk, const PfVm *vm)
{
    if (vm->link == NULL) {
        return FALSE;
    }
    if (chunk->n_vms == 0) {
        return TRUE;
    }
    return bsearch(&vm->serial, chunk->vms, chunk->n_vms, sizeof(guint32), cmp_u32) != NULL;
}

static void
new_chunk_cb(const PfPoolChunk *chunk, gpointer user)
{
    PfScanner *s = user;

    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (pf_vm_merges(vm) && chunk_is_for(chunk, vm)) {
            pf_link_send_chunk(vm->link, chunk);
        }
    }
}

/* A VM that stepped back to advise mode still holds the chunk: it is told
 * too.  One that is gone lets go of it with its process. */
static void
drop_chunk_cb(const PfPoolChunk *chunk, gpointer user)
{
    PfScanner *s = user;

    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (chunk_is_for(chunk, vm)) {
            PfDropped d = { chunk->ino, pf_link_sent_seq(vm->link), g_get_monotonic_time() };

            pf_link_send_drop(vm->link, chunk);
            if (vm->dropped == NULL) {
                vm->dropped = g_array_new(FALSE, FALSE, sizeof(PfDropped));
            }
            g_array_append_val(vm->dropped, d);
        }
    }
}

PfPool *
pf_scanner_get_pool(PfScanner *s)
{
    if (s->pool == NULL) {
        s->pool = pf_pool_new(new_chunk_cb, drop_chunk_cb, s);
    }
    return s->pool;
}

void
pf_scanner_add_vm(PfScanner *s, PfVm *vm)
{
    vm->scanner = s;
    vm->serial = ++s->next_serial;
    if (vm->domain == PF_DOMAIN_UNLABELLED) {
        /* Set before it had a serial: its own domain is named by it. */
        vm->domain |= vm->serial;
    }
    for (guint k = 0; k < vm->regions->len;) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        if (!pf_region_live(r) || place_region(s, r)) {
            k++;
        } else if (vm->link != NULL) {
            /* The agent names its regions by index: this one stays. */
            g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
            pf_region_refuse(r, "no page ids left for it");
            k++;
        } else {
            g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
            g_ptr_array_remove_index(vm->regions, k);
        }
    }
    vm->watch_id = g_unix_fd_add(vm->pidfd, G_IO_IN, vm_exited_cb, vm);
    if (pf_vm_merges(vm)) {
        const PfPoolChunk *zero = pf_pool_zero_chunk(pf_scanner_get_pool(s));

        /* The only chunk that is every VM's; the others it is sent as its
         * pages come to share them. */
        if (zero != NULL) {
            pf_link_send_chunk(vm->link, zero);
        }
        vm->vmas = pf_vm_count_vmas(vm);
        vm->vma_budget = s->max_map_count * s->knobs.max_vma_percent / 100;
    }
    g_ptr_array_add(s->vms, vm);
}

static gboolean
leftover_cb(gint fd, GIOCondition cond, gpointer user)
{
    Leftover *l = user;

    for (guint i = 0; i < l->refs->len; i++) {
        HeldRef *h = &g_array_index(l->refs, HeldRef, i);

        put_slot(l->s, h->slot, h->node);
    }
    l->watch = 0;
    g_ptr_array_remove(l->s->leftovers, l);
    return G_SOURCE_REMOVE;
}

static void
leftover_free(gpointer data)
{
    Leftover *l = data;

    if (l->watch != 0) {
        g_source_remove(l->watch);
    }
    close(l->pidfd);
    g_array_unref(l->refs);
    g_free(l);
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

    if (pd->kind == PF_ITEM_COLLAPSE || pd->kind == PF_PENDING_SETTLED) {
        return;
    }
    r = region_of(ab->s, pd->page);
    p = pf_region_page(r, pd->page - r->base);
    /* Sent, the agent may have done it or not: its slot may be mapped,
     * and the one it was moving from.  Never sent, nothing was done: only
     * the slot it moved from may be mapped. */
    if (pd->kind != PF_ITEM_ZERO) {
        hold_or_put(ab->s, sent ? ab->keep : NULL, pd->slot, pd->node);
    }
    if (pd->from != 0) {
        hold_or_put(ab->s, ab->keep, node_at(ab->s, pd->from)->slot, pd->from);
    }
    reset_page(r, p, PF_PAGE_VOLATILE);
}

void
pf_scanner_remove_vm(PfScanner *s, PfVm *vm)
{
    guint idx;
    Abandon ab = { s, NULL };

    if (!g_ptr_array_find(s->vms, vm, &idx)) {
        return;
    }
    pf_scan_jobs_vm_gone(s, vm, NULL);
    /* A live process keeps mapping the slots its merged pages use: they
     * stay taken until it exits. */
    if (pf_vm_merges(vm) && !pf_vm_exited(vm)) {
        ab.keep = g_array_new(FALSE, FALSE, sizeof(HeldRef));
    }
    if (vm->link != NULL) {
        pf_link_free(vm->link, abandon_cb, &ab);
        vm->link = NULL;
    }
    for (guint k = 0; k < vm->regions->len; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        if (pf_region_live(r)) {
            release_region(s, r, ab.keep);
        }
    }
    if (ab.keep != NULL && ab.keep->len > 0) {
        Leftover *l = g_new0(Leftover, 1);

        l->s = s;
        l->pidfd = fcntl(vm->pidfd, F_DUPFD_CLOEXEC, 3);
        l->refs = g_steal_pointer(&ab.keep);
        l->watch = g_unix_fd_add(l->pidfd, G_IO_IN, leftover_cb, l);
        g_ptr_array_add(s->leftovers, l);
        g_message("VM %s: %u pool slot reference(s) kept until process %d exits", vm->name,
                  l->refs->len, vm->pid);
    }
    g_clear_pointer(&ab.keep, g_array_unref);
    if (idx < s->cur_vm) {
        s->cur_vm--;
        s->entered -= s->entered != G_MAXUINT;
    } else if (idx == s->cur_vm) {
        s->entered = G_MAXUINT;
        s->cur_region = 0;
        s->cur_page = 0;
        s->data_end = 0;
    }
    g_ptr_array_remove_index(s->vms, idx);
}

gboolean
pf_scanner_add_region(PfScanner *s, PfVm *vm, PfRegion *r)
{
    r->vm = vm;
    g_ptr_array_add(vm->regions, r);
    if (!place_region(s, r)) {
        g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
        pf_region_refuse(r, "no page ids left for it");
        return FALSE;
    }
    return TRUE;
}

void
pf_scanner_region_gone(PfScanner *s, PfVm *vm, guint index)
{
    PfRegion *r = index < vm->regions->len ? g_ptr_array_index(vm->regions, index) : NULL;
    GoneRange g;

    g_return_if_fail(r != NULL && pf_region_live(r));
    g.s = s;
    g.first = r->base;
    g.n_pages = (guint32)r->n_pages;
    if (vm->link != NULL) {
        pf_link_withdraw(vm->link, settle_gone_cb, &g);
    }
    /* Its merged pages' references go with their records: none maps its
     * slot any more. */
    release_region(s, r, NULL);
    pf_region_retire(r);
    if (s->cur_vm < s->vms->len && g_ptr_array_index(s->vms, s->cur_vm) == vm &&
        s->cur_region == index) {
        s->cur_page = 0;
        s->data_end = 0;
    }
    g_message("VM %s (pid %d): region %u (%s) left the VM", vm->name, vm->pid, index, r->name);
}

void
pf_scanner_detach(PfScanner *s, PfVm *vm, const char *why)
{
    char uuid[37];

    /* Its last figures, for whoever asks how much it saved (a VM that
     * stops is dropped by pagefoldd before libvirt's hook could ask): its
     * own counts, not KSM's attributed ones, which would cost a walk of
     * every node at each of many VMs leaving at once. */
    g_message("VM %s (pid %d%s%s) detached: %s; mode %s, merged pages %zu, zero pages %zu, "
              "cow %" G_GUINT64_FORMAT,
              vm->name, vm->pid, pf_vm_uuid_string(vm, uuid) ? ", uuid " : "",
              pf_vm_uuid_string(vm, uuid) ? uuid : "", why, vm->mode,
              vm->count[PF_PAGE_SHARED], vm->count[PF_PAGE_ZERO], vm->cow);
    pf_scan_jobs_vm_gone(s, vm, why);
    if (s->vm_gone != NULL) {
        s->vm_gone(s, vm, why, s->vm_gone_user);
    }
    pf_scanner_remove_vm(s, vm);
}

const char *
pf_scanner_merge_domain(PfScanner *s, const PfVm *vm)
{
    if (vm->domain & PF_DOMAIN_UNLABELLED) {
        return "unlabelled";
    }
    return vm->domain == 0 ? "default" : g_ptr_array_index(s->domains, vm->domain - 1);
}

void
pf_scanner_set_unlabelled(PfScanner *s, PfVm *vm)
{
    /* Serials are never reused, nor reach this bit. */
    vm->domain = PF_DOMAIN_UNLABELLED | vm->serial;
}

gboolean
pf_scanner_set_merge_domain(PfScanner *s, PfVm *vm, const char *domain, GError **error)
{
    guint id = 0;

    if (domain != NULL && *domain != '\0' && !g_str_equal(domain, "default")) {
        if (!g_ptr_array_find_with_equal_func(s->domains, domain, g_str_equal, &id)) {
            g_ptr_array_add(s->domains, g_strdup(domain));
            id = s->domains->len - 1;
        }
        id++;
    }
    if (id == vm->domain) {
        return TRUE;
    }
    /* A page it shares now would stay shared across the new boundary;
     * zero pages are every VM's, in any domain.  Unlabelled, it shares
     * pages only with itself: they may stay so. */
    if (!(vm->domain & PF_DOMAIN_UNLABELLED) &&
        (vm->count[PF_PAGE_SHARED] > 0 || vm->count[PF_PAGE_PENDING] > 0)) {
        g_set_error(error, PF_ERROR, PF_ERROR_EXISTS,
                    "VM %s (pid %d) shares %zu page(s) in merge domain '%s' already: unmerge it "
                    "first (pagefoldctl unmerge %d)",
                    vm->name, vm->pid, vm->count[PF_PAGE_SHARED] + vm->count[PF_PAGE_PENDING],
                    pf_scanner_merge_domain(s, vm), vm->pid);
        return FALSE;
    }
    /* Pages found equal to content of the old domain, waiting for the
     * pass's end to join it, join nothing now. */
    for (guint i = s->joins->len; i-- > 0;) {
        if (g_array_index(s->joins, Joining, i).vm == vm->serial) {
            g_array_remove_index_fast(s->joins, i);
        }
    }
    /* Its pages have other partners now: smart scan's back-off, earned
     * failing to merge in the old domain, starts over. */
    for (guint k = 0; k < vm->regions->len; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        for (gsize i = pf_region_live(r) ? pf_region_next_recorded(r, 0, r->n_pages)
                                          : r->n_pages;
             i < r->n_pages; i = pf_region_next_recorded(r, i + 1, r->n_pages)) {
            PfPage *p = pf_region_page(r, i);

            if (p != NULL) {
                p->age = 0;
                p->skips = 0;
            }
        }
    }
    g_message("VM %s (pid %d): merge domain '%s' (was '%s')", vm->name, vm->pid,
              id == 0 ? "default" : (const char *)g_ptr_array_index(s->domains, id - 1),
              pf_scanner_merge_domain(s, vm));
    vm->domain = id;
    return TRUE;
}

GPtrArray *
pf_scanner_get_vms(PfScanner *s)
{
    return s->vms;
}

PfVm *
pf_scanner_find_vm_by_pid(PfScanner *s, int pid)
{
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (vm->pid == pid) {
            return vm;
        }
    }
    return NULL;
}

/*
 * Names and UUIDs are labels (VMs started without -name are all "qemu",
 * and an agent may claim any UUID): a key that more than one VM answers to
 * names none of them.  Only the pid is an identity.  A key of digits is a
 * pid and a UUID-shaped one a UUID, never a name, so that no VM can name
 * itself after another's pid or UUID and be taken for it.
 */
PfVm *
pf_scanner_lookup_vm(PfScanner *s, const char *key, GError **error)
{
    g_autoptr(GPtrArray) found = g_ptr_array_new();
    guint64 pid = 0;
    guint8 uuid[16];
    gboolean by_pid = key != NULL && *key != '\0' && strspn(key, "0123456789") == strlen(key);
    gboolean by_uuid = !by_pid && key != NULL && pf_uuid_parse(key, uuid);
    const char *what = by_pid ? "pid" : by_uuid ? "UUID" : "name";

    if (key == NULL || *key == '\0') {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "a VM is named by its pid, its UUID or its name");
        return NULL;
    }
    if (by_pid) {
        PfVm *vm = pf_parse_u64(key, 1, G_MAXINT, &pid, NULL)
                       ? pf_scanner_find_vm_by_pid(s, (int)pid) : NULL;

        if (vm == NULL) {
            g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "no VM of pid %s is attached",
                        key);
        }
        return vm;
    }
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (by_uuid ? memcmp(vm->uuid, uuid, sizeof(uuid)) == 0
                    : g_strcmp0(vm->name, key) == 0) {
            g_ptr_array_add(found, vm);
        }
    }
    if (found->len == 1) {
        return g_ptr_array_index(found, 0);
    }
    if (found->len == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "no VM '%s' is attached", key);
    } else {
        g_autoptr(GString) pids = g_string_new(NULL);

        for (guint i = 0; i < found->len; i++) {
            g_string_append_printf(pids, "%s%d", i ? ", " : "",
                                   ((PfVm *)g_ptr_array_index(found, i))->pid);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%u VMs have the %s '%s' (pids %s): name one by its pid", found->len,
                    what, key, pids->str);
    }
    return NULL;
}

PfVm *
pf_scanner_find_vm(PfScanner *s, const char *key)
{
    return pf_scanner_lookup_vm(s, key, NULL);
}

/* ---- pacing ---- */

static gint64
thread_cpu_usec(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (gint64)ts.tv_sec * G_USEC_PER_SEC + ts.tv_nsec / 1000;
}

static gsize
batch_size(PfScanner *s)
{
    guint64 pages = 0, period_usec;

    if (s->knobs.target_pass_millisecs == 0) {
        return s->knobs.pages_to_scan;
    }
    /* All pages, holes too: a pass steps over holes quickly, and pages not
     * visited yet must not make the first pass crawl. */
    for (guint i = 0; i < s->vms->len; i++) {
        pages += pf_vm_n_pages(g_ptr_array_index(s->vms, i));
    }
    period_usec = (guint64)s->knobs.sleep_millisecs * 1000 + (guint64)s->last_batch_usec;
    return (gsize)MAX(1, (pages * period_usec + s->knobs.target_pass_millisecs * 1000ull - 1) /
                             (s->knobs.target_pass_millisecs * 1000ull));
}

/* Scans for about usec, or up to max_pages, or to the end of the pass.
 * Returns the pages visited. */
gsize
pf_scanner_scan_slice(PfScanner *s, gsize max_pages, gint64 usec)
{
    guint64 scans = s->full_scans;
    gsize done = 0;

    s->slice_end = g_get_monotonic_time() + usec;
    while (done < max_pages) {
        gsize n = pf_scanner_scan(s, MIN(max_pages - done, 4096));

        done += n;
        if (n == 0 || s->blocked || s->full_scans != scans || past_slice(s)) {
            break;
        }
    }
    s->slice_end = 0;
    return done;
}

/* One slice of a wake-up's batch: a big pages_to_scan (or a big VM under
 * target_pass_millisecs) is scanned a slice at a time, the main loop
 * answering the control socket and reading the agents' answers between
 * slices. */
#define SLICE_USEC 20000

static gboolean
scanner_tick(gpointer user)
{
    PfScanner *s = user;
    guint64 sleep_ms = s->knobs.sleep_millisecs;

    s->timer_id = 0;
    if (s->knobs.run && s->vms->len > 0 && !pf_scan_jobs_scanning(s)) {
        gint64 cpu;

        if (s->batch_left == 0) {
            s->batch_left = batch_size(s);
            s->batch_start = g_get_monotonic_time();
            s->batch_cpu = thread_cpu_usec();
        }
        s->batch_left -= MIN(s->batch_left, pf_scanner_scan_slice(s, s->batch_left, SLICE_USEC));
        if (s->batch_left > 0 && !s->blocked) {
            s->timer_id = g_idle_add_full(G_PRIORITY_DEFAULT_IDLE, scanner_tick, s, NULL);
            return G_SOURCE_REMOVE;
        }
        /* The batch is done, or its agents' links are full: their answers
         * come while it sleeps. */
        s->batch_left = 0;
        s->last_batch_usec = g_get_monotonic_time() - s->batch_start;
        cpu = thread_cpu_usec() - s->batch_cpu;
        if (s->knobs.cpu_percent < 100) {
            guint64 cap_ms = (guint64)cpu * (100 - s->knobs.cpu_percent) /
                             s->knobs.cpu_percent / 1000;

            sleep_ms = MAX(sleep_ms, cap_ms);
        }
    } else {
        s->batch_left = 0;
    }
    s->timer_id = g_timeout_add((guint)sleep_ms, scanner_tick, s);
    return G_SOURCE_REMOVE;
}

void
pf_scanner_start(PfScanner *s)
{
    if (s->timer_id == 0) {
        s->timer_id = g_timeout_add(s->knobs.sleep_millisecs, scanner_tick, s);
    }
}

void
pf_scanner_stop(PfScanner *s)
{
    if (s->timer_id != 0) {
        g_source_remove(s->timer_id);
        s->timer_id = 0;
    }
}

void
pf_scanner_kick(PfScanner *s)
{
    if (s->timer_id != 0) {
        pf_scanner_stop(s);
        pf_scanner_start(s);
    }
}

/* ---- counters ---- */

void
pf_scanner_collect(PfScanner *s, PfCounters *total, PfCounters *per_vm)
{
    guint n_vms = s->vms->len;
    g_autofree double *share = g_new0(double, MAX(n_vms, 1));
    g_autofree double *size_share = g_new0(double, MAX(n_vms, 1));
    g_autofree guint64 *shared = g_new0(guint64, MAX(n_vms, 1));
    g_autofree guint64 *meta = g_new0(guint64, MAX(n_vms, 1));
    guint64 common_bytes = pf_stable_tree_bytes(&s->stable) +
                           pf_table_bytes(&s->unstable.table);
    guint64 nodes_in_use = 0;

    for (guint i = 0; i < n_vms; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        vm->stats_index = i;
        /* The trees hold the pages that are present. */
        size_share[i] = (double)(pf_vm_n_pages(vm) - vm->count[PF_PAGE_ABSENT]);
    }
    /* Each canonical page counts 1/n to the VM of each of its n sharers.
     * A node whose pages are all still on their way in shares nothing. */
    for (guint id = 1; id < s->stable.nodes->len; id++) {
        const PfStableNode *n = pf_stable_tree_node(&s->stable, id);

        nodes_in_use += n->live && n->n_members > 0;
        for (guint32 m = 0; m < n->n_members; m++) {
            share[region_of(s, n->members[m])->vm->stats_index] += 1.0 / n->n_members;
        }
    }
    pf_apportion(nodes_in_use, share, n_vms, shared);
    pf_apportion(common_bytes, size_share, n_vms, meta);

    memset(total, 0, sizeof(*total));
    for (guint i = 0; i < n_vms; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);
        PfCounters *c = &per_vm[i];
        gsize n_pages = pf_vm_n_pages(vm);

        memset(c, 0, sizeof(*c));
        c->pages_shared = shared[i];
        c->pages_sharing = vm->count[PF_PAGE_SHARED] - shared[i];
        c->pages_unshared = vm->count[PF_PAGE_UNSHARED];
        c->pages_volatile = vm->count[PF_PAGE_VOLATILE];
        c->zero_pages = vm->count[PF_PAGE_ZERO];
        c->pages_pending = vm->count[PF_PAGE_PENDING];
        c->cow = vm->cow;
        c->vmas = vm->vmas;
        c->pages_skipped = vm->pages_skipped;
        c->pages_scanned = vm->pages_scanned;
        c->full_scans = vm->full_scans;
        c->pages_tracked = n_pages - vm->count[PF_PAGE_ABSENT];
        c->metadata_bytes = meta[i];
        for (guint k = 0; k < vm->regions->len; k++) {
            const PfRegion *r = g_ptr_array_index(vm->regions, k);

            if (pf_region_live(r)) {
                c->metadata_bytes += pf_region_record_bytes(r);
            }
        }
        c->general_profit = (gint64)pf_counters_saved_bytes(c) - (gint64)c->metadata_bytes;
        pf_counters_add(total, c);
    }
    /* A pass covers all VMs: the total counts passes, not their sum. */
    total->full_scans = s->full_scans;
}

void
pf_scanner_get_info(PfScanner *s, PfScanInfo *info)
{
    info->memcmp_calls = s->memcmp_calls;
    info->stable_nodes_examined = s->stable_nodes_examined;
    info->last_pass_usec = s->last_pass_usec;
    info->stable_nodes = s->stable.n_nodes;
    info->cow_detection = pf_cow_method(s->cow);
    info->pool_slots = s->pool ? pf_pool_slots_in_use(s->pool) : 0;
    info->pool_bytes = s->pool ? pf_pool_bytes(s->pool) : 0;
    info->pool_chunks = s->pool ? pf_pool_n_chunks(s->pool) : 0;
}

/* ---- life ---- */

PfScanner *
pf_scanner_new(const PfHashAlgo *hash)
{
    PfScanner *s = g_new0(PfScanner, 1);

    guard_install_once();
    pf_knobs_init_default(&s->knobs);
    s->listed_sharing = s->knobs.max_page_sharing;
    s->algo = hash ? hash : pf_hash_default();
    s->vms = g_ptr_array_new_with_free_func((GDestroyNotify)pf_vm_free);
    s->regions = g_ptr_array_new();
    s->leftovers = g_ptr_array_new_with_free_func(leftover_free);
    s->jobs = g_ptr_array_new();
    s->domains = g_ptr_array_new_with_free_func(g_free);
    s->max_map_count = 65530;
    s->kpageflags_fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
    s->cow = pf_cow_new();
    {
        g_autofree char *text = NULL;

        if (g_file_get_contents("/proc/sys/vm/max_map_count", &text, NULL, NULL)) {
            s->max_map_count = g_ascii_strtoull(text, NULL, 10);
        }
    }
    pf_stable_tree_init(&s->stable, page_of, s);
    pf_unstable_tree_init(&s->unstable, page_of, s);
    s->joins = g_array_new(FALSE, FALSE, sizeof(Joining));
    s->partial = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, NULL);
    pf_scanner_set_hash_func(s, s->algo->func);
    return s;
}

void
pf_scanner_set_hash_func(PfScanner *s, PfHashFunc func)
{
    static const guint8 zero[PF_PAGE_SIZE];

    s->hash = func;
    s->zero_checksum = func(zero);
}

const PfHashAlgo *
pf_scanner_get_hash(PfScanner *s)
{
    return s->algo;
}

PfKnobs *
pf_scanner_get_knobs(PfScanner *s)
{
    return &s->knobs;
}

void
pf_scanner_set_vm_gone_func(PfScanner *s, PfVmGoneFunc func, gpointer user)
{
    s->vm_gone = func;
    s->vm_gone_user = user;
}

void
pf_scanner_free(PfScanner *s)
{
    if (s == NULL) {
        return;
    }
    pf_scanner_stop(s);
    pf_scan_jobs_end(s);
    g_ptr_array_unref(s->jobs);
    while (s->vms->len > 0) {
        pf_scanner_remove_vm(s, g_ptr_array_index(s->vms, s->vms->len - 1));
    }
    g_ptr_array_unref(s->vms);
    g_ptr_array_unref(s->domains);
    g_ptr_array_unref(s->regions);
    g_ptr_array_unref(s->leftovers);
    g_clear_pointer(&s->pool, pf_pool_free);
    if (s->kpageflags_fd >= 0) {
        close(s->kpageflags_fd);
    }
    pf_cow_free(s->cow);
    pf_stable_tree_destroy(&s->stable);
    pf_unstable_tree_destroy(&s->unstable);
    g_array_unref(s->joins);
    g_hash_table_unref(s->partial);
    g_free(s);
}
