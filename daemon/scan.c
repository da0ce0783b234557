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
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "link.h"
#include "util.h"

/* PAGEMAP_SCAN (Linux 6.7); Debian 12's headers are 6.1's. */
struct pf_pm_scan_arg {
    guint64 size, flags, start, end, walk_end, vec, vec_len, max_pages;
    guint64 category_inverted, category_mask, category_anyof_mask, return_mask;
};
struct pf_page_region {
    guint64 start, end, categories;
};
#define PF_PAGEMAP_SCAN _IOWR('f', 16, struct pf_pm_scan_arg)
#define PF_PAGE_IS_FILE (1ull << 2)
#define PF_PAGE_IS_PRESENT (1ull << 3)
#define PF_PAGE_IS_PFNZERO (1ull << 5)

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

#define PAGEMAP_PRESENT (1ull << 63)
#define PAGEMAP_FILE (1ull << 61)
#define PAGEMAP_EXCLUSIVE (1ull << 56)
/* How long an agent that was sent no request since may take to drop a
 * chunk (check_dropped()). */
#define DROP_GRACE_USEC (60 * G_USEC_PER_SEC)

/* A page found equal to node, whose slot its VM may not read. */
typedef struct {
    guint32 chunk; /* the node's slot's, then: */
    guint32 vm;    /* the page's VM's serial */
    guint32 slot;
    guint32 page;
    guint32 node;
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

struct _PfScanner {
    PfKnobs knobs;
    const PfHashAlgo *algo;
    PfHashFunc hash;
    guint64 zero_checksum;

    GPtrArray *vms;     /* PfVm*, owned */
    GPtrArray *regions; /* PfRegion* of all VMs, sorted by base */
    PfRegion *last_region;

    PfStableTree stable;
    PfUnstableTree unstable;
    GArray *joins;       /* Joining: pages found equal to nodes their VM may
                          * not read, joined when it ends (make_joins()) */
    GHashTable *partial; /* chunk << 32 | VM serial -> the pass in which the
                          * VM's pages matched part of the chunk */
    PfPool *pool;        /* created with the first merging VM */
    guint32 next_serial; /* the last PfVm.serial given */
    GPtrArray *leftovers; /* Leftover* */
    guint64 max_map_count;
    gboolean pagemap_scan; /* the kernel has PAGEMAP_SCAN */
    int kpageflags_fd;     /* /proc/kpageflags: is a page part of a THP */

    /* cursor: the next page to visit */
    gboolean in_pass;
    guint cur_vm;
    guint cur_region;
    gsize cur_page;
    gsize data_end; /* end of the memfd data extent holding cur_page */

    guint64 full_scans;
    guint64 memcmp_calls;
    guint64 stable_nodes_examined;
    guint listed_sharing; /* the max_page_sharing that decided which nodes
                           * are full (node_relist()) */
    gint64 pass_start_usec;
    guint64 last_pass_usec;

    guint timer_id;
    gint64 last_batch_usec;
    PfVmGoneFunc vm_gone;
    gpointer vm_gone_user;
};

/* ---- knobs ---- */

typedef struct {
    const char *name;
    gsize offset;
    guint min, max;
    const char *help;
} KnobInfo;

#define K(field, lo, hi, help) { #field, G_STRUCT_OFFSET(PfKnobs, field), lo, hi, help }

static const KnobInfo knob_info[] = {
    K(pages_to_scan, 1, 1u << 30, "pages to scan per wake-up"),
    K(sleep_millisecs, 0, 3600000, "milliseconds to sleep between wake-ups"),
    K(cpu_percent, 1, 100, "cap on the scanner's CPU, percent of one core"),
    K(target_pass_millisecs, 0, 86400000,
      "if not 0, scan so that a full pass takes about this long"),
    K(max_page_sharing, 2, G_MAXUINT16, "guest pages per canonical page"),
    K(smart_scan, 0, 1, "skip pages that keep failing to merge"),
    K(use_zero_pages, 0, 1, "treat all-zero pages apart"),
    K(run, 0, 2, "0: stop scanning, 1: scan, 2: unmerge all pages and stop"),
    K(max_vma_percent, 1, 90, "share of vm.max_map_count a VM may reach through merges"),
};

#undef K

void
pf_knobs_init_default(PfKnobs *k)
{
    /* KSM's defaults, so a KSM user finds the same pace. */
    k->pages_to_scan = 100;
    k->sleep_millisecs = 20;
    k->cpu_percent = 100;
    k->target_pass_millisecs = 0;
    k->max_page_sharing = 256;
    k->smart_scan = TRUE;
    k->use_zero_pages = TRUE;
    k->run = TRUE;
    k->max_vma_percent = 50;
}

static guint *
knob_field(PfKnobs *k, const KnobInfo *ki)
{
    /* gboolean and guint share a size and every knob is one of them. */
    G_STATIC_ASSERT(sizeof(gboolean) == sizeof(guint));
    return (guint *)((char *)k + ki->offset);
}

gboolean
pf_knobs_set(PfKnobs *k, const char *name, guint64 value, GError **error)
{
    for (gsize i = 0; i < G_N_ELEMENTS(knob_info); i++) {
        const KnobInfo *ki = &knob_info[i];

        if (g_strcmp0(ki->name, name) != 0) {
            continue;
        }
        if (value < ki->min || value > ki->max) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s must be between %u and %u, not %" G_GUINT64_FORMAT,
                        name, ki->min, ki->max, value);
            return FALSE;
        }
        if (g_str_equal(name, "target_pass_millisecs") && value != 0 && value < 10) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "target_pass_millisecs must be 0 (off) or at least 10");
            return FALSE;
        }
        *knob_field(k, ki) = (guint)value;
        return TRUE;
    }
    g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                "unknown knob '%s'", name ? name : "");
    return FALSE;
}

void
pf_knobs_to_json(const PfKnobs *k, JsonBuilder *b)
{
    for (gsize i = 0; i < G_N_ELEMENTS(knob_info); i++) {
        json_builder_set_member_name(b, knob_info[i].name);
        json_builder_add_int_value(b, *knob_field((PfKnobs *)k, &knob_info[i]));
    }
}

const char *const *
pf_knob_names(void)
{
    static const char *names[G_N_ELEMENTS(knob_info) + 1];

    if (names[0] == NULL) {
        for (gsize i = 0; i < G_N_ELEMENTS(knob_info); i++) {
            names[i] = knob_info[i].name;
        }
    }
    return names;
}

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
    PfRegion *r = region_of(user, id);

    return &r->pages[id - r->base];
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
    PfPage *p = &r->pages[idx];

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
    for (gsize i = 0; i < r->n_pages; i++) {
        if (r->pages[i].state != PF_PAGE_ABSENT) {
            forget_page(s, r, i, keep);
        }
    }
    r->vm->count[PF_PAGE_ABSENT] -= r->n_pages;
    pf_table_clear(&s->unstable.table);
    g_array_set_size(s->joins, 0);
    g_ptr_array_remove(s->regions, r);
    s->last_region = NULL;
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

static inline gboolean
page_equal(PfScanner *s, const guint8 *data, guint32 other)
{
    s->memcmp_calls++;
    return memcmp(data, page_data(s, other), PF_PAGE_SIZE) == 0;
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

/* The content a stable node stands for: its pool slot once merged, its
 * first guest page in advise mode. */
static const guint8 *
node_data(PfScanner *s, const PfStableNode *n)
{
    return n->slot != PF_POOL_SLOT_NONE ? pf_pool_data(s->pool, n->slot)
                                         : page_data(s, n->members[0]);
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
    return pf_vm_merges(vm) && vm->vmas < vm->vma_budget;
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
        PfPageState st = r->pages[i].state;

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
static void end_sharing(PfScanner *s, PfRegion *r, gsize idx);

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
    to = pf_stable_tree_create(&s->stable, checksum, slot); /* n may move */
    pf_stable_tree_retire(&s->stable, id, to);
    for (guint32 i = 0; i < n_members; i++) {
        PfRegion *mr = region_of(s, members[i]);

        if (can_merge(mr->vm)) {
            join_node(s, mr, &mr->pages[members[i] - mr->base], members[i], to);
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
    guint32 node = r->pages[idx].node, to = node_at(s, node)->next;
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
                join_node(s, r, &r->pages[idx], r->base + (guint32)idx, to);
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

    return r->pages[j->page - r->base].state == PF_PAGE_UNSHARED && can_merge(r->vm) &&
           n->live && n->next == 0 && n->slot == j->slot &&
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

                join_node(s, r, &r->pages[j->page - r->base], j->page, j->node);
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
    PfPage *p = &r->pages[idx];
    const guint8 *data = r->map + idx * PF_PAGE_SIZE;
    gboolean merge_domain = pf_vm_merges(r->vm);
    gboolean merging = can_merge(r->vm);
    PfTableIter it;
    guint64 c;
    guint32 other;

    if (p->state == PF_PAGE_PENDING) {
        return; /* its agent has it */
    }
    if (merge_domain && (p->state == PF_PAGE_SHARED || p->state == PF_PAGE_ZERO)) {
        /* Merged: nothing to read.  A merged page is a hole of the memfd,
         * where copy-on-write is looked for; one found among data (its
         * fold-back failed after copying) is looked at here. */
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
            node_sharers(s, n) >= s->knobs.max_page_sharing ||
            (s->memcmp_calls++, memcmp(data, node_data(s, n), PF_PAGE_SIZE) != 0)) {
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
        o = &orr->pages[other - orr->base];
        if (other == id || o->state != PF_PAGE_UNSHARED ||
            can_merge(orr->vm) != merging || pf_vm_merges(orr->vm) != merge_domain ||
            !page_equal(s, data, other)) {
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
            if (memcmp(pf_pool_data(s->pool, slot), page_data(s, other), PF_PAGE_SIZE) != 0 ||
                memcmp(pf_pool_data(s->pool, slot), data, PF_PAGE_SIZE) != 0) {
                pf_pool_unref(s->pool, slot);
                continue;
            }
        }
        pf_table_remove(&s->unstable.table, c, other);
        node = pf_stable_tree_create(&s->stable, c, slot);
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
    p = &r->pages[pd->page - r->base];
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
                end_sharing(s, r, pd->page - r->base);
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
    for (; i < start + n; i++) {
        visit(s, r, i);
    }
    guard_env = NULL;
    s->cur_page = start + n;
    return n;
}

/*
 * Merged pages are holes of the memfd.  One the guest wrote has been
 * copied on write into an anonymous page of its own, which pagemap shows
 * present, not file-backed and mapped once (a merged zero page that was
 * only read maps the shared zero page: not "exclusive").  Such a page
 * leaves its node now, and its agent is asked to fold it back into the
 * memfd, where the scanner can see it again.
 */
/* Ends a page's sharing.  A merged page is folded back into its memfd by
 * its agent, its slot reference held until the agent answers; a page of an
 * advise-mode VM just forgets its node. */
static void
end_sharing(PfScanner *s, PfRegion *r, gsize idx)
{
    PfPage *p = &r->pages[idx];
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
    PfPageState st = r->pages[idx].state;

    if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO) {
        r->vm->cow++;
        end_sharing(s, r, idx);
    }
}

/* One ioctl finds the written pages of a range: present, not file-backed,
 * not the shared zero page. */
static gboolean
check_merged_scan(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    struct pf_page_region vec[256];
    guint64 start = r->host_addr + from * PF_PAGE_SIZE, end = r->host_addr + to * PF_PAGE_SIZE;

    while (start < end) {
        struct pf_pm_scan_arg arg = {
            .size = sizeof(arg), .start = start, .end = end,
            .vec = (guint64)(guintptr)vec, .vec_len = G_N_ELEMENTS(vec),
            .category_inverted = PF_PAGE_IS_FILE | PF_PAGE_IS_PFNZERO,
            .category_mask = PF_PAGE_IS_PRESENT | PF_PAGE_IS_FILE | PF_PAGE_IS_PFNZERO,
            .return_mask = PF_PAGE_IS_PRESENT,
        };
        long n = ioctl(r->vm->pagemap_fd, PF_PAGEMAP_SCAN, &arg);

        if (n < 0) {
            return FALSE;
        }
        for (long k = 0; k < n; k++) {
            for (guint64 a = vec[k].start; a < vec[k].end; a += PF_PAGE_SIZE) {
                cow_found(s, r, (a - r->host_addr) / PF_PAGE_SIZE);
            }
        }
        start = arg.walk_end > start ? arg.walk_end : end;
    }
    return TRUE;
}

static void
check_merged(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    PfVm *vm = r->vm;

    while (from < to) {
        guint64 entries[512];
        gsize n = MIN(to - from, G_N_ELEMENTS(entries));
        gboolean any = FALSE;
        ssize_t got;

        for (gsize i = from; i < from + n && !any; i++) {
            any = r->pages[i].state == PF_PAGE_SHARED || r->pages[i].state == PF_PAGE_ZERO;
        }
        if (!any) {
            from += n;
            continue;
        }
        if (s->pagemap_scan && check_merged_scan(s, r, from, from + n)) {
            from += n;
            continue;
        }
        got = pread(vm->pagemap_fd, entries, n * sizeof(guint64),
                    (off_t)((r->host_addr / PF_PAGE_SIZE + from) * sizeof(guint64)));
        if (got != (ssize_t)(n * sizeof(guint64))) {
            return; /* the process is going: its pidfd will say so */
        }
        for (gsize i = 0; i < n; i++) {
            guint64 e = entries[i];

            if ((e & PAGEMAP_PRESENT) && !(e & PAGEMAP_FILE) && (e & PAGEMAP_EXCLUSIVE)) {
                cow_found(s, r, from + i);
            }
        }
        from += n;
    }
}

/* Moves the cursor over holes of the memfd (never touched by the guest, or
 * discarded): reading them through the mapping would allocate them. */
static void
find_data(PfScanner *s, PfRegion *r)
{
    off_t pos = (off_t)(r->file_offset + s->cur_page * PF_PAGE_SIZE);
    off_t data = lseek(r->fd, pos, SEEK_DATA);
    gsize first, end;

    if (data < 0) {
        first = errno == ENXIO ? r->n_pages : s->cur_page;
        end = r->n_pages;
    } else {
        off_t hole = lseek(r->fd, data, SEEK_HOLE);

        first = MIN(r->n_pages, (gsize)(data - (off_t)r->file_offset) / PF_PAGE_SIZE);
        end = hole < 0 ? r->n_pages
                       : MIN(r->n_pages, (gsize)(hole - (off_t)r->file_offset) / PF_PAGE_SIZE);
    }
    if (pf_vm_merges(r->vm)) {
        check_merged(s, r, s->cur_page, first);
    }
    for (gsize i = s->cur_page; i < first; i++) {
        PfPageState st = r->pages[i].state;

        if (pf_vm_merges(r->vm) && st == PF_PAGE_SHARED) {
            follow_move(s, r, i);
        } else if (st != PF_PAGE_ABSENT && st != PF_PAGE_PENDING &&
                   !(pf_vm_merges(r->vm) && st == PF_PAGE_ZERO)) {
            make_absent(s, r, i);
        }
    }
    s->cur_page = first;
    s->data_end = MAX(end, first + 1);
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

    for (guint i = 0; i < s->vms->len;) {
        PfVm *vm = g_ptr_array_index(s->vms, i);
        g_autoptr(GPtrArray) gone = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
        g_autoptr(GPtrArray) added = g_ptr_array_new();
        g_autoptr(GError) error = NULL;

        if (!pf_vm_refresh(vm, gone, added, &error)) {
            pf_scanner_detach(s, vm, error->message);
            continue;
        }
        if (!check_dropped(s, vm, &error)) {
            pf_scanner_detach(s, vm, error->message);
            continue;
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
        candidates += pf_vm_n_pages(vm) - vm->count[PF_PAGE_SHARED] -
                      vm->count[PF_PAGE_ZERO] - vm->count[PF_PAGE_PENDING];
        if (pf_vm_merges(vm)) {
            vm->vmas = pf_vm_count_vmas(vm);
            vm->vma_budget = s->max_map_count * s->knobs.max_vma_percent / 100;
        }
        i++;
    }
    if (s->vms->len == 0) {
        return FALSE;
    }
    pf_table_clear(&s->unstable.table);
    pf_table_reserve(&s->unstable.table, candidates);
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
    s->cur_region = 0;
    s->cur_page = 0;
    s->data_end = 0;
    s->pass_start_usec = g_get_monotonic_time();
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

gsize
pf_scanner_scan(PfScanner *s, gsize max_pages)
{
    gsize done = 0;

    while (done < max_pages) {
        PfVm *vm;
        PfRegion *r;

        if (!s->in_pass && !begin_pass(s)) {
            break;
        }
        if (s->cur_vm >= s->vms->len) {
            end_pass(s);
            break;
        }
        vm = g_ptr_array_index(s->vms, s->cur_vm);
        if (s->cur_region >= vm->regions->len) {
            vm->full_scans++;
            s->cur_vm++;
            s->cur_region = 0;
            s->cur_page = 0;
            s->data_end = 0;
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
            find_data(s, r);
            done += s->cur_page - from;
            continue;
        }
        done += scan_range(s, r, MIN(max_pages - done, s->data_end - s->cur_page));
    }
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *v = g_ptr_array_index(s->vms, i);

        if (v->link != NULL) {
            pf_link_flush(v->link);
        }
    }
    return done;
}

static void settle(PfScanner *s);

/* KSM's run=2: every merged page back into its memfd.  Advise-mode VMs
 * just forget what they would share.  A merge or move that was in flight
 * may land meanwhile: it is unmerged in the next round. */
void
pf_scanner_unmerge(PfScanner *s, PfVm *only)
{
    g_array_set_size(s->joins, 0);
    for (guint round = 0; round < 4; round++) {
        gsize asked = 0;

        for (guint v = 0; v < s->vms->len; v++) {
            PfVm *vm = g_ptr_array_index(s->vms, v);

            if (only != NULL && vm != only) {
                continue;
            }
            for (guint k = 0; k < vm->regions->len; k++) {
                PfRegion *r = g_ptr_array_index(vm->regions, k);

                for (gsize i = 0; i < r->n_pages; i++) {
                    if (r->pages[i].state == PF_PAGE_SHARED ||
                        r->pages[i].state == PF_PAGE_ZERO) {
                        end_sharing(s, r, i);
                        asked++;
                    }
                }
            }
            if (vm->link != NULL) {
                pf_link_flush(vm->link);
            }
        }
        settle(s);
        if (asked == 0) {
            break;
        }
    }
}

/* Pages back in their memfd: what they shared is let go, and they are read
 * again from scratch.  A page in flight is settled by its agent's answer,
 * which comes after this news. */
static void
back_in_memfd(PfScanner *s, PfRegion *r, gsize from, gsize to)
{
    for (gsize i = from; i < to; i++) {
        if (r->pages[i].state == PF_PAGE_SHARED || r->pages[i].state == PF_PAGE_ZERO) {
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

/* Waits for the agents' answers to every request sent so far.  An answer
 * may call for more, to its VM or another (a page merged into a node that
 * moved meanwhile follows it): those are waited for too, but an agent is
 * waited for once at most if it does not answer. */
static void
settle(PfScanner *s)
{
    g_autoptr(GPtrArray) silent = g_ptr_array_new();
    gboolean again = TRUE;

    for (guint round = 0; again && round < 16; round++) {
        again = FALSE;
        for (guint i = 0; i < s->vms->len;) {
            PfVm *v = g_ptr_array_index(s->vms, i);

            if (v->link != NULL && pf_link_in_flight(v->link) > 0 &&
                !g_ptr_array_find(silent, v, NULL)) {
                again = TRUE;
                pf_link_settle(v->link, 10000);
                /* settling may have detached (and freed) it */
                if (i >= s->vms->len || g_ptr_array_index(s->vms, i) != v) {
                    continue;
                }
                if (v->link != NULL && pf_link_in_flight(v->link) > 0) {
                    g_ptr_array_add(silent, v);
                }
            }
            i++;
        }
    }
}

void
pf_scanner_run_passes(PfScanner *s, guint n)
{
    guint64 target = s->full_scans + n + (s->in_pass ? 1 : 0);

    while (s->full_scans < target && s->vms->len > 0) {
        pf_scanner_scan(s, G_MAXSIZE);
        settle(s);
    }
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
abandon_cb(const PfPending *pd, gpointer user)
{
    Abandon *ab = user;
    PfRegion *r;
    PfPage *p;

    if (pd->kind == PF_ITEM_COLLAPSE || pd->kind == PF_PENDING_SETTLED) {
        return;
    }
    r = region_of(ab->s, pd->page);
    p = &r->pages[pd->page - r->base];
    /* The agent may have done it or not: its slot may be mapped, and the
     * one it was moving from. */
    if (pd->kind != PF_ITEM_ZERO) {
        hold_or_put(ab->s, ab->keep, pd->slot, pd->node);
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
    } else if (idx == s->cur_vm) {
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

typedef struct {
    PfScanner *s;
    guint32 first, n_pages; /* the page ids of the region that went */
} GoneRange;

/* A request for a page of a region that left the VM: whatever the agent
 * did with it, the page maps no pool slot now (the agent mapped all of the
 * region from its memfd before it said GONE), so what the request held
 * (pf_scanner_complete()'s references) is let go now, once, and its answer,
 * if it comes, changes nothing. */
static gboolean
settle_gone_cb(PfPending *pd, gpointer user)
{
    GoneRange *g = user;

    if (pd->kind == PF_PENDING_SETTLED || pd->page - g->first >= g->n_pages) {
        return FALSE;
    }
    if (pd->kind != PF_ITEM_COLLAPSE) {
        put_slot(g->s, pd->slot, pd->node);
        if (pd->from != 0) {
            put_slot(g->s, node_at(g->s, pd->from)->slot, pd->from);
        }
    }
    pd->kind = PF_PENDING_SETTLED;
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
    g_message("VM %s (pid %d) detached: %s", vm->name, vm->pid, why);
    if (s->vm_gone != NULL) {
        s->vm_gone(s, vm, why, s->vm_gone_user);
    }
    pf_scanner_remove_vm(s, vm);
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

/* Agents with more than a few batches to answer are behind: scanning on
 * would only read again pages that have not changed, at the agents' CPU's
 * expense, and decide nothing new for the pages in flight. */
#define BEHIND_ITEMS (4 * PF_PROTO_MAX_ITEMS)

static gboolean
agents_behind(PfScanner *s)
{
    for (guint i = 0; i < s->vms->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

        if (vm->link != NULL && pf_link_in_flight(vm->link) > BEHIND_ITEMS) {
            return TRUE;
        }
    }
    return FALSE;
}

static gboolean
scanner_tick(gpointer user)
{
    PfScanner *s = user;
    guint64 sleep_ms = s->knobs.sleep_millisecs;

    s->timer_id = 0;
    if (s->knobs.run && s->vms->len > 0 && !agents_behind(s)) {
        gint64 t0 = g_get_monotonic_time();
        gint64 cpu0 = thread_cpu_usec();
        gint64 cpu;

        pf_scanner_scan(s, batch_size(s));
        s->last_batch_usec = g_get_monotonic_time() - t0;
        cpu = thread_cpu_usec() - cpu0;
        if (s->knobs.cpu_percent < 100) {
            guint64 cap_ms = (guint64)cpu * (100 - s->knobs.cpu_percent) /
                             s->knobs.cpu_percent / 1000;

            sleep_ms = MAX(sleep_ms, cap_ms);
        }
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
        size_share[i] = (double)pf_vm_n_pages(vm);
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
        c->metadata_bytes = n_pages * sizeof(PfPage) + meta[i];
        c->general_profit = (gint64)((c->pages_sharing + c->zero_pages) * PF_PAGE_SIZE) -
                            (gint64)c->metadata_bytes;
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
    info->cow_detection = s->pagemap_scan ? "PAGEMAP_SCAN" : "pagemap";
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
    s->max_map_count = 65530;
    s->kpageflags_fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
    {
        int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        struct pf_page_region v;
        struct pf_pm_scan_arg arg = {
            .size = sizeof(arg), .start = (guint64)(guintptr)&v & ~(guint64)(PF_PAGE_SIZE - 1),
            .vec = (guint64)(guintptr)&v, .vec_len = 1, .return_mask = PF_PAGE_IS_PRESENT,
        };

        arg.end = arg.start + PF_PAGE_SIZE;
        s->pagemap_scan = fd >= 0 && ioctl(fd, PF_PAGEMAP_SCAN, &arg) >= 0 &&
                          !g_getenv("PAGEFOLD_NO_PAGEMAP_SCAN");
        if (fd >= 0) {
            close(fd);
        }
    }
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
    while (s->vms->len > 0) {
        pf_scanner_remove_vm(s, g_ptr_array_index(s->vms, s->vms->len - 1));
    }
    g_ptr_array_unref(s->vms);
    g_ptr_array_unref(s->regions);
    g_ptr_array_unref(s->leftovers);
    g_clear_pointer(&s->pool, pf_pool_free);
    if (s->kpageflags_fd >= 0) {
        close(s->kpageflags_fd);
    }
    pf_stable_tree_destroy(&s->stable);
    pf_unstable_tree_destroy(&s->unstable);
    g_array_unref(s->joins);
    g_hash_table_unref(s->partial);
    g_free(s);
}
