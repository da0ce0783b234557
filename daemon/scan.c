/*
 * scan.c - the scanner's life (scan.h): making and freeing it, the pacing
 * of its background batches (a timer every sleep_millisecs, then slices),
 * VM lookups by key, unmerge marks, and its counters (pf_scanner_collect(),
 * a VM's share of pages_shared apportioned).  The pass itself is
 * scan-pass.c's, the listeners scan-events.c's; scan-core.h maps the rest.
 *
 * Writes of the scanner's state only its own records (setup, pacing) and
 * the leaves' it makes and frees; the other records are made and freed by
 * their files.  Never frees a VM (scan-vms.c does, after the listeners
 * heard that it goes).
 */
#include "scan.h"

#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "guard.h"
#include "scan-core.h"
#include "util.h"

static void set_resting(PfScanner *s, gboolean resting);

/* ---- VMs ---- */

GPtrArray *
pf_scanner_get_vms(PfScanner *s)
{
    return vms_of(s)->list;
}

PfVm *
pf_scanner_find_vm_by_pid(PfScanner *s, int pid)
{
    for (guint i = 0; i < vm_count(s); i++) {
        PfVm *vm = vm_at(s, i);

        if (vm->pid == pid) {
            return vm;
        }
    }
    return NULL;
}

PfVm *
pf_scanner_lookup_vm(PfScanner *s, const char *key, GError **error)
{
    g_autofree PfVmKey *keys = g_new(PfVmKey, MAX(vm_count(s), 1));
    gssize i;

    for (guint k = 0; k < vm_count(s); k++) {
        PfVm *vm = vm_at(s, k);

        keys[k] = (PfVmKey){ vm->name, vm->pid, vm->uuid };
    }
    i = pf_vm_key_find(keys, vm_count(s), key, error);
    return i < 0 ? NULL : vm_at(s, i);
}

PfVm *
pf_scanner_find_vm(PfScanner *s, const char *key)
{
    return pf_scanner_lookup_vm(s, key, NULL);
}

void
pf_scanner_begin_unmerge(PfScanner *s, PfVm *vm)
{
    vm->scan->unmerging++;
    set_resting(s, FALSE); /* the unmerge waits for answers */
    moves_forget_joins(s, NULL);
    hints_forget(vm);
}

void
pf_scanner_end_unmerge(PfScanner *s, PfVm *vm)
{
    g_return_if_fail(vm->scan->unmerging > 0);
    vm->scan->unmerging--;
}

/* ---- pacing ---- */

static gint64
thread_cpu_usec(void)
{
    return (gint64)(pf_thread_cpu_nsec() / 1000);
}

/* The pages of vm a pass visits (pf_scanner_scan()): those its memfds
 * hold, whether visited yet or not (what fstat() says they take), and its
 * merged pages (pages on their way in are still the memfd's). */
static guint64
present_pages(const PfVm *vm)
{
    const gsize *count = vm->scan->count;
    guint64 n = pf_vm_merges(vm) ? count[PF_PAGE_SHARED] + count[PF_PAGE_ZERO] : 0;

    for (guint k = 0; k < vm->regions->len; k++) {
        const PfRegion *r = g_ptr_array_index(vm->regions, k);
        struct stat st;

        if (pf_region_live(r) && fstat(r->fd, &st) == 0) {
            n += MIN((guint64)st.st_blocks * 512 / PF_PAGE_SIZE, r->n_pages);
        }
    }
    return n;
}

static gsize
batch_size(PfScanner *s)
{
    const PfKnobs *k = &s->setup.knobs;
    guint64 pages = 0, period_usec;

    if (k->target_pass_millisecs == 0) {
        return k->pages_to_scan;
    }
    for (guint i = 0; i < vm_count(s); i++) {
        pages += present_pages(vm_at(s, i));
    }
    period_usec = (guint64)k->sleep_millisecs * 1000 + (guint64)s->pacing.last_batch_usec;
    return (gsize)MAX(1, (pages * period_usec + k->target_pass_millisecs * 1000ull - 1) /
                             (k->target_pass_millisecs * 1000ull));
}

/* One slice of a wake-up's batch: a big pages_to_scan (or a big VM under
 * target_pass_millisecs) is scanned a slice at a time, the main loop
 * answering the control socket and reading the agents' answers between
 * slices. */
#define SLICE_USEC 20000

/* The longest sleep between batches over which the agents' answers may
 * wait unread (PfScanEvents.resting): pagefoldd's every wake-up costs it
 * tens of microseconds on some hosts (docs/DESIGN.md, section 6), and
 * answers would wake it once more for most sleeps; over a longer sleep
 * that no longer counts, and an answer should not wait that long. */
#define REST_MAX_MS 100

static void
set_resting(PfScanner *s, gboolean resting)
{
    if (s->pacing.resting != resting) {
        s->pacing.resting = resting;
        scan_emit_resting(s, resting);
    }
}

/* Whether nothing waits for the agents' answers before the next batch:
 * no unmerge runs (a job's passes pause the batches). */
static gboolean
may_rest(PfScanner *s)
{
    for (guint i = 0; i < vm_count(s); i++) {
        if (vm_at(s, i)->scan->unmerging > 0) {
            return FALSE;
        }
    }
    return TRUE;
}

/* The batch is done, or its agents' outboxes are full (their answers come
 * while it sleeps): how long to sleep, cpu_percent kept. */
static guint64
batch_done(PfScanner *s)
{
    guint64 sleep_ms = s->setup.knobs.sleep_millisecs;
    gint64 cpu = thread_cpu_usec() - s->pacing.batch_cpu;

    s->pacing.batch_left = 0;
    s->pacing.last_batch_usec = g_get_monotonic_time() - s->pacing.batch_start;
    if (s->setup.knobs.cpu_percent < 100) {
        guint64 cap_ms = (guint64)cpu * (100 - s->setup.knobs.cpu_percent) /
                         s->setup.knobs.cpu_percent / 1000;

        sleep_ms = MAX(sleep_ms, cap_ms);
    }
    return sleep_ms;
}

static gboolean
scanner_tick(gpointer user)
{
    PfScanner *s = user;
    guint64 sleep_ms = s->setup.knobs.sleep_millisecs;

    s->pacing.timer_id = 0;
    if (s->pacing.resting) {
        /* What the agents answered meanwhile first: their readers come
         * before this idle source. */
        set_resting(s, FALSE);
        s->pacing.timer_id = g_idle_add_full(G_PRIORITY_DEFAULT_IDLE, scanner_tick, s, NULL);
        return G_SOURCE_REMOVE;
    }
    pf_cpu_use_set(s->setup.knobs.cpu_use);
    pf_cpu_enter(PF_CPU_SCAN);
    if (s->setup.knobs.run && vm_count(s) > 0 && s->pacing.batches_paused == 0) {
        if (s->pacing.batch_left == 0) {
            s->pacing.batch_left = batch_size(s);
            s->pacing.batch_start = g_get_monotonic_time();
            s->pacing.batch_cpu = thread_cpu_usec();
        }
        guint64 scans = pass_of(s)->full_scans;
        gboolean progress;
        gsize done = pf_scanner_scan_slice(s, s->pacing.batch_left, SLICE_USEC, FALSE, &progress);

        s->pacing.batch_left -= MIN(s->pacing.batch_left, done);
        /* A wake-up ends with its pass, as KSM's does: with fewer pages
         * present than pages_to_scan, passes would follow each other
         * without a sleep (and with none present, spin).  What the pass
         * asked for goes with it. */
        if (pass_of(s)->full_scans != scans) {
            s->pacing.batch_left = 0;
            pf_scanner_flush(s);
        }
        if (s->pacing.batch_left > 0 && !pass_of(s)->blocked) {
            s->pacing.timer_id = g_idle_add_full(G_PRIORITY_DEFAULT_IDLE, scanner_tick, s, NULL);
            pf_cpu_leave();
            return G_SOURCE_REMOVE;
        }
        sleep_ms = batch_done(s);
        /* Held no longer than it would wait for the next wake-up. */
        pf_scanner_flush_ripe(s, (gint64)sleep_ms * G_TIME_SPAN_MILLISECOND);
        set_resting(s, sleep_ms > 0 && sleep_ms <= REST_MAX_MS && may_rest(s));
    } else {
        s->pacing.batch_left = 0;
        pf_scanner_flush(s); /* stopped or paused: nothing is held back */
    }
    s->pacing.timer_id = g_timeout_add((guint)sleep_ms, scanner_tick, s);
    pf_cpu_leave();
    return G_SOURCE_REMOVE;
}

void
pf_scanner_start(PfScanner *s)
{
    if (s->pacing.timer_id == 0) {
        s->pacing.timer_id = g_timeout_add(s->setup.knobs.sleep_millisecs, scanner_tick, s);
    }
}

void
pf_scanner_stop(PfScanner *s)
{
    g_clear_handle_id(&s->pacing.timer_id, g_source_remove);
    set_resting(s, FALSE);
}

void
pf_scanner_kick(PfScanner *s)
{
    if (s->pacing.timer_id != 0) {
        pf_scanner_stop(s);
        pf_scanner_start(s);
    }
}

void
pf_scanner_pause_batches(PfScanner *s)
{
    s->pacing.batches_paused++;
    set_resting(s, FALSE); /* the job reads the answers */
}

void
pf_scanner_resume_batches(PfScanner *s)
{
    g_return_if_fail(s->pacing.batches_paused > 0);
    s->pacing.batches_paused--;
}

/* ---- counters ---- */

/* The parts of the nodes too big to be told as they change (tree.h),
 * added to share. */
static void
share_untracked(PfScanner *s, double *share)
{
    GHashTableIter it;
    gpointer key;

    g_hash_table_iter_init(&it, s->stable.untracked);
    while (g_hash_table_iter_next(&it, &key, NULL)) {
        const PfStableNode *n = pf_stable_tree_node(&s->stable, GPOINTER_TO_UINT(key));

        for (guint32 m = 0; m < n->n_members; m++) {
            share[region_of(s, n->members[m])->vm->scan->stats_index] +=
                (double)PF_SHARE_ONE / n->n_members;
        }
    }
}

/* One VM's counters, given its share of the nodes and of the trees. */
static void
vm_counters(const PfVm *vm, guint64 shared, guint64 meta, PfCounters *c)
{
    memset(c, 0, sizeof(*c));
    /* Never more than its sharers, however the parts were rounded. */
    c->pages_shared = MIN(shared, vm->scan->count[PF_PAGE_SHARED]);
    c->pages_sharing = vm->scan->count[PF_PAGE_SHARED] - c->pages_shared;
    c->pages_unshared = vm->scan->count[PF_PAGE_UNSHARED];
    c->pages_volatile = vm->scan->count[PF_PAGE_VOLATILE];
    c->zero_pages = vm->scan->count[PF_PAGE_ZERO];
    c->pages_pending = vm->scan->count[PF_PAGE_PENDING];
    c->cow = vm->scan->cow;
    c->backend_fold_backs = vm->scan->backend_fold_backs;
    c->vmas = vm->scan->vmas;
    c->pages_skipped = vm->scan->pages_skipped;
    c->pages_scanned = vm->scan->pages_scanned;
    c->pages_hinted = vm->scan->pages_hinted;
    c->hints_dropped = vm->scan->hints_dropped;
    c->full_scans = vm->scan->full_scans;
    c->pages_tracked = pf_vm_n_pages(vm) - vm->scan->count[PF_PAGE_ABSENT];
    c->metadata_bytes =
        meta + (vm->scan->hints != NULL ? vm->scan->hints->len * sizeof(PfHint) : 0);
    for (guint k = 0; k < vm->regions->len; k++) {
        const PfRegion *r = g_ptr_array_index(vm->regions, k);

        if (pf_region_live(r)) {
            c->metadata_bytes += pf_region_record_bytes(r);
        }
    }
    c->general_profit = (gint64)pf_counters_saved_bytes(c) - (gint64)c->metadata_bytes;
}

void
pf_scanner_collect(PfScanner *s, PfCounters *total, PfCounters *per_vm)
{
    guint n_vms = vm_count(s);
    g_autofree double *share = g_new0(double, MAX(n_vms, 1));
    g_autofree double *size_share = g_new0(double, MAX(n_vms, 1));
    g_autofree guint64 *shared = g_new0(guint64, MAX(n_vms, 1));
    g_autofree guint64 *meta = g_new0(guint64, MAX(n_vms, 1));
    guint64 common_bytes = pf_stable_tree_bytes(&s->stable) +
                           pf_table_bytes(&s->unstable.table);

    for (guint i = 0; i < n_vms; i++) {
        PfVm *vm = vm_at(s, i);

        /* Each canonical page counts 1/n to the VM of each of its n
         * sharers (a node whose pages are all still on their way in
         * shares nothing); the trees hold the pages that are present. */
        share[i] = (double)vm->scan->share;
        vm->scan->stats_index = i;
        size_share[i] = (double)(pf_vm_n_pages(vm) - vm->scan->count[PF_PAGE_ABSENT]);
    }
    share_untracked(s, share);
    pf_apportion(s->stable.n_in_use, share, n_vms, shared);
    pf_apportion(common_bytes, size_share, n_vms, meta);

    memset(total, 0, sizeof(*total));
    for (guint i = 0; i < n_vms; i++) {
        vm_counters(vm_at(s, i), shared[i], meta[i], &per_vm[i]);
        pf_counters_add(total, &per_vm[i]);
    }
    /* A pass covers all VMs: the total counts passes, not their sum. */
    total->full_scans = pass_of(s)->full_scans;
}

void
pf_scanner_get_info(PfScanner *s, PfScanInfo *info)
{
    info->memcmp_calls = visits_of(s)->memcmp_calls + moves_of(s)->memcmp_calls;
    info->stable_nodes_examined = visits_of(s)->stable_nodes_examined;
    info->last_pass_usec = pass_of(s)->last_pass_usec;
    info->stable_nodes = s->stable.n_nodes;
    info->cow_detection = pf_cow_method(s->setup.cow);
    info->pool_slots = s->pool ? pf_pool_slots_in_use(s->pool) : 0;
    info->pool_bytes = s->pool ? pf_pool_bytes(s->pool) : 0;
    info->pool_chunks = s->pool ? pf_pool_n_chunks(s->pool) : 0;
}

/* ---- life ---- */

/* The stable tree's way to a member's record (tree.h's PfPageFunc). */
static PfPage *
member_record(guint32 id, gpointer user)
{
    PfScanner *s = user;

    return pf_page_space_page(&s->space, id);
}

static void
page_share(guint32 id, gint64 delta, gpointer user)
{
    PfScanner *s = user;

    region_of(s, id)->vm->scan->share += (guint64)delta;
}

static guint64
read_max_map_count(void)
{
    g_autofree char *text = NULL;

    if (g_file_get_contents("/proc/sys/vm/max_map_count", &text, NULL, NULL)) {
        return g_ascii_strtoull(text, NULL, 10);
    }
    return 65530;
}

PfScanner *
pf_scanner_new(const PfHashAlgo *hash)
{
    PfScanner *s = g_new0(PfScanner, 1);

    pf_guard_install();
    pf_knobs_init_default(&s->setup.knobs);
    pass_init(s);
    s->setup.adopt_max_sharers = ADOPT_MAX_SHARERS;
    s->setup.algo = hash ? hash : pf_hash_default();
    vms_init(s);
    pf_page_space_init(&s->space);
    events_init(s);
    s->setup.max_map_count = read_max_map_count();
    s->setup.kpageflags_fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
    s->setup.cow = pf_cow_new();
    pf_stable_tree_init(&s->stable, member_record, page_share, s);
    pf_unstable_tree_init(&s->unstable);
    moves_init(s);
    reads_init(s);
    pf_scanner_set_hash_func(s, s->setup.algo->func);
    return s;
}

void
pf_scanner_set_hash_func(PfScanner *s, PfHashFunc func)
{
    static const guint8 zero[PF_PAGE_SIZE];

    s->setup.hash = func;
    s->setup.zero_checksum = func(zero);
}

const PfHashAlgo *
pf_scanner_get_hash(PfScanner *s)
{
    return s->setup.algo;
}

PfKnobs *
pf_scanner_get_knobs(PfScanner *s)
{
    return &s->setup.knobs;
}

/* The VMs go first, each heard of by the listeners (an agent's link
 * closes), then the listeners (a job still running is told that pagefoldd
 * stops), then what the VMs held. */
void
pf_scanner_free(PfScanner *s)
{
    if (s == NULL) {
        return;
    }
    pf_scanner_stop(s);
    while (vm_count(s) > 0) {
        pf_scanner_remove_vm(s, vm_at(s, vm_count(s) - 1));
    }
    events_clear(s);
    vms_clear(s);
    pf_page_space_destroy(&s->space);
    g_clear_pointer(&s->pool, pf_pool_free);
    if (s->setup.kpageflags_fd >= 0) {
        close(s->setup.kpageflags_fd);
    }
    pf_cow_free(s->setup.cow);
    pf_stable_tree_destroy(&s->stable);
    pf_unstable_tree_destroy(&s->unstable);
    moves_clear(s);
    reads_clear(s);
    adopt_clear(s);
    g_free(s);
}
