/*
 * scan.c - the scanner's life (scan.h): making and freeing it, the pacing
 * of its background batches (a timer every sleep_millisecs, then slices),
 * VM lookups by key, unmerge marks, and its counters (pf_scanner_collect(),
 * a VM's share of pages_shared apportioned).  The pass itself is
 * scan-pass.c's, the listeners scan-events.c's; scan-core.h maps the rest.
 *
 * Writes of the scanner's state only its pacing (timer_id, batch_*) and
 * what it makes and frees; never frees a VM (scan-vms.c does, after the
 * listeners heard that it goes).
 */
#include "scan.h"

#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "guard.h"
#include "scan-core.h"
#include "util.h"

/* ---- VMs ---- */

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

PfVm *
pf_scanner_lookup_vm(PfScanner *s, const char *key, GError **error)
{
    g_autofree PfVmKey *keys = g_new(PfVmKey, MAX(s->vms->len, 1));
    gssize i;

    for (guint k = 0; k < s->vms->len; k++) {
        PfVm *vm = g_ptr_array_index(s->vms, k);

        keys[k] = (PfVmKey){ vm->name, vm->pid, vm->uuid };
    }
    i = pf_vm_key_find(keys, s->vms->len, key, error);
    return i < 0 ? NULL : g_ptr_array_index(s->vms, i);
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
    struct timespec ts;

    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (gint64)ts.tv_sec * G_USEC_PER_SEC + ts.tv_nsec / 1000;
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
    guint64 pages = 0, period_usec;

    if (s->knobs.target_pass_millisecs == 0) {
        return s->knobs.pages_to_scan;
    }
    for (guint i = 0; i < s->vms->len; i++) {
        pages += present_pages(g_ptr_array_index(s->vms, i));
    }
    period_usec = (guint64)s->knobs.sleep_millisecs * 1000 + (guint64)s->last_batch_usec;
    return (gsize)MAX(1, (pages * period_usec + s->knobs.target_pass_millisecs * 1000ull - 1) /
                             (s->knobs.target_pass_millisecs * 1000ull));
}

/* One slice of a wake-up's batch: a big pages_to_scan (or a big VM under
 * target_pass_millisecs) is scanned a slice at a time, the main loop
 * answering the control socket and reading the agents' answers between
 * slices. */
#define SLICE_USEC 20000

/* The batch is done, or its agents' outboxes are full (their answers come
 * while it sleeps): how long to sleep, cpu_percent kept. */
static guint64
batch_done(PfScanner *s)
{
    guint64 sleep_ms = s->knobs.sleep_millisecs;
    gint64 cpu = thread_cpu_usec() - s->batch_cpu;

    s->batch_left = 0;
    s->last_batch_usec = g_get_monotonic_time() - s->batch_start;
    if (s->knobs.cpu_percent < 100) {
        guint64 cap_ms = (guint64)cpu * (100 - s->knobs.cpu_percent) / s->knobs.cpu_percent /
                         1000;

        sleep_ms = MAX(sleep_ms, cap_ms);
    }
    return sleep_ms;
}

static gboolean
scanner_tick(gpointer user)
{
    PfScanner *s = user;
    guint64 sleep_ms = s->knobs.sleep_millisecs;

    s->timer_id = 0;
    if (s->knobs.run && s->vms->len > 0 && s->batches_paused == 0) {
        if (s->batch_left == 0) {
            s->batch_left = batch_size(s);
            s->batch_start = g_get_monotonic_time();
            s->batch_cpu = thread_cpu_usec();
        }
        guint64 scans = s->full_scans;
        gboolean progress;

        s->batch_left -= MIN(s->batch_left, pf_scanner_scan_slice(s, s->batch_left, SLICE_USEC,
                                                                   FALSE, &progress));
        /* A wake-up ends with its pass, as KSM's does: with fewer pages
         * present than pages_to_scan, passes would follow each other
         * without a sleep (and with none present, spin). */
        if (s->full_scans != scans) {
            s->batch_left = 0;
        }
        if (s->batch_left > 0 && !s->blocked) {
            s->timer_id = g_idle_add_full(G_PRIORITY_DEFAULT_IDLE, scanner_tick, s, NULL);
            return G_SOURCE_REMOVE;
        }
        sleep_ms = batch_done(s);
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
    g_clear_handle_id(&s->timer_id, g_source_remove);
}

void
pf_scanner_kick(PfScanner *s)
{
    if (s->timer_id != 0) {
        pf_scanner_stop(s);
        pf_scanner_start(s);
    }
}

void
pf_scanner_pause_batches(PfScanner *s)
{
    s->batches_paused++;
}

void
pf_scanner_resume_batches(PfScanner *s)
{
    g_return_if_fail(s->batches_paused > 0);
    s->batches_paused--;
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
    guint n_vms = s->vms->len;
    g_autofree double *share = g_new0(double, MAX(n_vms, 1));
    g_autofree double *size_share = g_new0(double, MAX(n_vms, 1));
    g_autofree guint64 *shared = g_new0(guint64, MAX(n_vms, 1));
    g_autofree guint64 *meta = g_new0(guint64, MAX(n_vms, 1));
    guint64 common_bytes = pf_stable_tree_bytes(&s->stable) +
                           pf_table_bytes(&s->unstable.table);

    for (guint i = 0; i < n_vms; i++) {
        PfVm *vm = g_ptr_array_index(s->vms, i);

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
        vm_counters(g_ptr_array_index(s->vms, i), shared[i], meta[i], &per_vm[i]);
        pf_counters_add(total, &per_vm[i]);
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
    pf_knobs_init_default(&s->knobs);
    s->listed_sharing = s->knobs.max_page_sharing;
    s->adopt_max_sharers = ADOPT_MAX_SHARERS;
    s->algo = hash ? hash : pf_hash_default();
    s->vms = g_ptr_array_new_with_free_func((GDestroyNotify)vms_free_vm);
    pf_page_space_init(&s->space);
    s->leftovers = g_ptr_array_new_with_free_func(vms_leftover_free);
    s->listeners = g_array_new(FALSE, FALSE, sizeof(Listener));
    s->domains = g_ptr_array_new_with_free_func(g_free);
    s->max_map_count = read_max_map_count();
    s->kpageflags_fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
    s->cow = pf_cow_new();
    pf_stable_tree_init(&s->stable, member_record, page_share, s);
    pf_unstable_tree_init(&s->unstable);
    s->joins = g_array_new(FALSE, FALSE, sizeof(Joining));
    s->joining = g_array_new(FALSE, FALSE, sizeof(Joining));
    s->looking_pids = g_hash_table_new(NULL, NULL);
    s->reading_pids = g_hash_table_new(NULL, NULL);
    s->partial = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, NULL);
    s->waiting = g_hash_table_new_full(NULL, NULL, NULL, g_free);
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
    while (s->vms->len > 0) {
        pf_scanner_remove_vm(s, g_ptr_array_index(s->vms, s->vms->len - 1));
    }
    while (s->listeners->len > 0) {
        Listener l = g_array_index(s->listeners, Listener, s->listeners->len - 1);

        g_array_remove_index(s->listeners, s->listeners->len - 1);
        if (l.destroy != NULL) {
            l.destroy(l.user);
        }
    }
    g_array_unref(s->listeners);
    g_ptr_array_unref(s->vms);
    g_ptr_array_unref(s->domains);
    pf_page_space_destroy(&s->space);
    g_ptr_array_unref(s->leftovers);
    g_clear_pointer(&s->pool, pf_pool_free);
    if (s->kpageflags_fd >= 0) {
        close(s->kpageflags_fd);
    }
    pf_cow_free(s->cow);
    pf_stable_tree_destroy(&s->stable);
    pf_unstable_tree_destroy(&s->unstable);
    g_array_unref(s->joins);
    g_array_unref(s->joining);
    g_hash_table_unref(s->looking_pids);
    g_hash_table_unref(s->reading_pids);
    g_hash_table_unref(s->partial);
    g_hash_table_unref(s->waiting);
    g_clear_handle_id(&s->adopt_source, g_source_remove);
    g_free(s);
}
