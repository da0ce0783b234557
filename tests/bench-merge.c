/*
 * bench-merge.c - the agent's side of merging, measured in one run:
 *   - merges per second and microseconds per merged page, one page per
 *     request and 512 pages per request (agent library, real kernel
 *     mechanisms, the protocol played by hand for pagefoldd);
 *   - folding back pages the guest wrote after merging, one page per
 *     request and 512 per request, merged to consecutive slots (a run is
 *     one mapping) or scattered ones (a mapping per page);
 *   - the write fault that breaks a merged page: pagefold's (private file
 *     mapping copied on write) next to kernel KSM's (anonymous memory,
 *     MADV_MERGEABLE) in the same run;
 *   - the floor under those: the same merges by the bare system calls, and
 *     the agent's cost as a multiple of it;
 *   - mappings added per merged page, on a layout of mixed runs;
 *   - the same merges with the memfd mapped by a second process too, as
 *     pagefoldd maps what it reads: sleeping, or running on another CPU,
 *     whose TLB each punch then shoots down (the agent's CPU a page); and
 *     with a thread of the VMM reading guest RAM on another CPU, as a vCPU
 *     does, whose TLB every change of the VMM's mappings shoots down.
 * One JSON line per result.  KSM's settings are restored as found.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent.h"
#include "bench-common.h"
#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

#define PAGES 16384u /* 64 MiB */

typedef struct {
    PfTestPeer *peer;
    PfGuest *g;
    PfAgent *agent;
    int pool_fd;
    guint8 *pool;
    guint32 seq;
} Rig;

static Rig *
rig_new(const PfLayout *l)
{
    Rig *r = g_new0(Rig, 1);
    PfAgentRegion reg;
    PfWirePool p = { 0, PAGES };

    r->peer = pf_test_peer_new();
    r->g = pf_guest_new("memory-backend-memfd", l, 1);
    r->agent = pf_agent_new("bench", NULL);
    reg = (PfAgentRegion){ "pc.ram", r->g->mem, PAGES * PF_PAGE_SIZE, r->g->fd, 0 };
    g_assert_true(pf_agent_add_region(r->agent, &reg, NULL));
    g_assert_cmpint(pf_test_peer_accept(r->peer, r->agent), ==, PF_MODE_MERGE);
    /* The pool holds a copy of every page: any page can merge with its slot. */
    r->pool_fd = pf_test_pool_chunk(PAGES, FALSE, &r->pool);
    memcpy(r->pool, r->g->mem, PAGES * PF_PAGE_SIZE);
    g_assert_cmpint(fcntl(r->pool_fd, F_ADD_SEALS, 0x0010 | F_SEAL_GROW | F_SEAL_SHRINK), ==, 0);
    g_assert_true(pf_proto_send(r->peer->conn, PF_MSG_POOL, 0, &p, sizeof(p), &r->pool_fd, 1,
                                NULL));
    return r;
}

static void
rig_free(Rig *r)
{
    pf_agent_free(r->agent);
    pf_test_peer_free(r->peer);
    munmap(r->pool, PAGES * PF_PAGE_SIZE);
    close(r->pool_fd);
    pf_guest_free(r->g);
    g_free(r);
}

/* Sends n items and waits for the answer; returns how many were done. */
static guint32
roundtrip(Rig *r, const PfWireItem *items, guint32 n)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    const PfWireResult *res;
    guint32 got, done = 0;

    g_assert_true(pf_proto_send_items(r->peer->conn, ++r->seq, items, n, NULL));
    g_assert_true(pf_proto_recv(r->peer->conn, m, NULL));
    res = pf_msg_results(m, &got);
    for (guint32 i = 0; i < got; i++) {
        done += res[i].status == PF_RESULT_DONE;
    }
    return done;
}

static void
merge_item(PfWireItem *it, guint64 page)
{
    memset(it, 0, sizeof(*it));
    it->kind = PF_ITEM_MERGE;
    it->page = page;
    it->slot = (guint32)page;
}

/* The CPU time, in seconds, of the task named name under dir_path (a
 * process's task/ or /proc), from schedstat's nanoseconds; 0 if none. */
static double
task_cpu_s(const char *dir_path, const char *name)
{
    g_autoptr(GDir) dir = g_dir_open(dir_path, 0, NULL);
    const char *t;

    while (dir != NULL && (t = g_dir_read_name(dir)) != NULL) {
        g_autofree char *comm_path = g_strdup_printf("%s/%s/comm", dir_path, t);
        g_autofree char *stat_path = g_strdup_printf("%s/%s/schedstat", dir_path, t);
        g_autofree char *comm = NULL, *stat = NULL;

        if (g_ascii_isdigit(t[0]) && g_file_get_contents(comm_path, &comm, NULL, NULL) &&
            g_str_equal(g_strstrip(comm), name) &&
            g_file_get_contents(stat_path, &stat, NULL, NULL)) {
            return (double)g_ascii_strtoull(stat, NULL, 10) * 1e-9;
        }
    }
    return 0;
}

/* This process's thread named name (the agent's names itself). */
static double
thread_cpu_s(const char *name)
{
    return task_cpu_s("/proc/self/task", name);
}

/*
 * A second process that maps the guest's memfd read-only, every page
 * present, as pagefoldd's read mappings are: each punch must unmap its
 * page there too, and, while it runs on another CPU (spinning), shoot down
 * that CPU's TLB entry as well.  Its pid, once its pages are mapped.
 */
typedef enum { READER_NONE, READER_SLEEPING, READER_SPINNING, READER_VCPU, READER_KINDS } Reader;
static const char *const reader_names[READER_KINDS] = { "none", "sleeping", "spinning", "vcpu" };

/* A thread of this process (the VMM) reading guest RAM until told to stop. */
typedef struct {
    GThread *thread;
    gint stop;
    const volatile guint8 *mem;
    gsize pages;
} Vcpu;

static gpointer
vcpu_thread(gpointer data)
{
    Vcpu *v = data;
    guint8 c = 0;

    for (gsize i = 0; !g_atomic_int_get(&v->stop); i++) {
        c ^= v->mem[(i % v->pages) * PF_PAGE_SIZE];
    }
    return GUINT_TO_POINTER(c);
}

static void
vcpu_start(Vcpu *v, const guint8 *mem, gsize pages)
{
    *v = (Vcpu){ NULL, 0, mem, pages };
    v->thread = g_thread_new("vcpu", vcpu_thread, v);
}

static void
vcpu_stop(Vcpu *v)
{
    if (v->thread != NULL) {
        g_atomic_int_set(&v->stop, 1);
        (void)g_thread_join(v->thread);
        v->thread = NULL;
    }
}

static pid_t
reader_start(Rig *r, Reader kind)
{
    int ready[2];
    pid_t pid;
    char c = 0;

    g_assert_cmpint(pipe(ready), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        const volatile guint8 *m = mmap(NULL, PAGES * PF_PAGE_SIZE, PROT_READ, MAP_SHARED,
                                        r->g->fd, 0);

        /* A spinning one left behind by a benchmark that failed would
         * take a CPU for good. */
        close(ready[0]);
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || m == MAP_FAILED) {
            _exit(1);
        }
        for (gsize i = 0; i < PAGES; i++) {
            c ^= m[i * PF_PAGE_SIZE];
        }
        if (write(ready[1], &c, 1) != 1) {
            _exit(1);
        }
        for (;;) {
            if (kind == READER_SLEEPING) {
                pause();
            }
        }
    }
    close(ready[1]);
    g_assert_cmpint(read(ready[0], &c, 1), ==, 1);
    close(ready[0]);
    return pid;
}

static void
reader_stop(pid_t pid)
{
    kill(pid, SIGKILL);
    g_assert_cmpint(waitpid(pid, NULL, 0), ==, pid);
}

/* Microseconds per page merged, wall, and (*agent_us) of the agent
 * thread's CPU, with reader's second mapping of the memfd. */
static double
bench_merge_rate(guint32 batch, guint32 pages, Reader reader, double *agent_us)
{
    PfLayout l = { .unique = PAGES };
    Rig *r = rig_new(&l);
    g_autofree PfWireItem *items = g_new0(PfWireItem, batch);
    pid_t reader_pid = reader == READER_SLEEPING || reader == READER_SPINNING ?
                       reader_start(r, reader) : 0;
    Vcpu vcpu = { NULL };
    guint32 done = 0;
    double t0, secs, cpu0;

    if (reader == READER_VCPU) {
        vcpu_start(&vcpu, r->g->mem, PAGES);
    }
    t0 = bench_now();
    cpu0 = thread_cpu_s("pagefold-agent");

    /* Every other page, so single merges cannot coalesce into one mmap. */
    for (guint32 p = 0; p < pages; p += batch) {
        for (guint32 k = 0; k < batch; k++) {
            merge_item(&items[k], batch == 1 ? (guint64)p * 2 % PAGES : p + k);
        }
        done += roundtrip(r, items, batch);
    }
    secs = bench_now() - t0;
    *agent_us = (thread_cpu_s("pagefold-agent") - cpu0) * 1e6 / pages;
    if (reader_pid > 0) {
        reader_stop(reader_pid);
    }
    vcpu_stop(&vcpu);
    g_assert_cmpuint(done, ==, pages);
    g_assert_cmpfloat(*agent_us, >, 0);
    rig_free(r);
    return secs * 1e6 / pages;
}

/*
 * Microseconds per page folded back after the guest wrote it (merged,
 * then each page written once: copied on write), wall, and (*agent_us) of
 * the agent thread's CPU: batch 1, one unmerge per request, or batch
 * consecutive pages per request, as pagefoldd asks for pages a guest
 * wrote in a run.  Merged to consecutive slots, a run of pages is one
 * mapping; scattered (page p on slot p ^ 1), each page is a mapping of its
 * own, as pages merged with content from all over the pool are.
 */
static double
bench_fold_back_rate(guint32 batch, guint32 pages, gboolean scattered, double *agent_us)
{
    PfLayout l = { .unique = PAGES };
    Rig *r = rig_new(&l);
    g_autofree PfWireItem *items = g_new0(PfWireItem, MAX(batch, 512));
    guint32 done = 0;
    double t0, secs, cpu0;
    PfAgentStats st;

    g_assert_cmpuint(pages % batch, ==, 0);
    g_assert_cmpuint(pages % 512, ==, 0);
    if (scattered) {
        /* Still writable: the seal forbids only new writable mappings. */
        for (guint32 p = 0; p < PAGES; p++) {
            memcpy(r->pool + (gsize)(p ^ 1) * PF_PAGE_SIZE, r->g->mem + (gsize)p * PF_PAGE_SIZE,
                   PF_PAGE_SIZE);
        }
    }
    for (guint32 p = 0; p < pages; p += 512) {
        for (guint32 k = 0; k < 512; k++) {
            merge_item(&items[k], p + k);
            items[k].slot = scattered ? (p + k) ^ 1 : p + k;
        }
        g_assert_cmpuint(roundtrip(r, items, 512), ==, 512);
    }
    for (guint32 p = 0; p < pages; p++) {
        r->g->mem[(gsize)p * PF_PAGE_SIZE + 7]++;
    }
    t0 = bench_now();
    cpu0 = thread_cpu_s("pagefold-agent");
    for (guint32 p = 0; p < pages; p += batch) {
        for (guint32 k = 0; k < batch; k++) {
            memset(&items[k], 0, sizeof(items[k]));
            items[k].kind = PF_ITEM_UNMERGE;
            items[k].page = p + k;
        }
        done += roundtrip(r, items, batch);
    }
    secs = bench_now() - t0;
    *agent_us = (thread_cpu_s("pagefold-agent") - cpu0) * 1e6 / pages;
    g_assert_cmpuint(done, ==, pages);
    pf_agent_get_stats(r->agent, &st);
    g_assert_cmpuint(st.remapped, ==, 0);
    g_assert_cmpfloat(*agent_us, >, 0);
    rig_free(r);
    return secs * 1e6 / pages;
}

/*
 * The floor under bench_merge_rate(): the same pages merged by the bare
 * system calls the agent makes for them, with no protocol, no checks and
 * no bookkeeping.  A window of batch pages (1, or 512 contiguous):
 * registered and write-protected, each page compared with its slot, the
 * slots mapped over it (one mmap for contiguous slots), the memfd copies
 * punched, then registered again and unprotected.  What the agent costs
 * beyond this is its own.
 */
static double
bench_merge_floor(guint32 batch, guint32 pages)
{
    PfLayout l = { .unique = PAGES };
    PfGuest *g = pf_guest_new("memory-backend-memfd", &l, 1);
    guint8 *pool = NULL;
    int pool_fd = pf_test_pool_chunk(PAGES, FALSE, &pool);
    int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM };
    guint32 equal = 0;
    double t0, secs;

    g_assert_cmpint(uffd, >=, 0);
    g_assert_cmpint(ioctl(uffd, UFFDIO_API, &api), ==, 0);
    memcpy(pool, g->mem, PAGES * PF_PAGE_SIZE);
    t0 = bench_now();
    for (guint32 p = 0; p < pages; p += batch) {
        guint64 first = batch == 1 ? (guint64)p * 2 % PAGES : p;
        guint8 *hva = g->mem + first * PF_PAGE_SIZE;
        gsize len = (gsize)batch * PF_PAGE_SIZE;
        struct uffdio_register reg = { { (guint64)(guintptr)hva, len },
                                       UFFDIO_REGISTER_MODE_WP, 0 };
        struct uffdio_writeprotect wp = { { (guint64)(guintptr)hva, len },
                                          UFFDIO_WRITEPROTECT_MODE_WP };

        g_assert_cmpint(ioctl(uffd, UFFDIO_REGISTER, &reg), ==, 0);
        g_assert_cmpint(ioctl(uffd, UFFDIO_WRITEPROTECT, &wp), ==, 0);
        for (guint32 k = 0; k < batch; k++) {
            equal += memcmp(hva + (gsize)k * PF_PAGE_SIZE,
                            pool + (first + k) * PF_PAGE_SIZE, PF_PAGE_SIZE) == 0;
        }
        g_assert_true(mmap(hva, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, pool_fd,
                           (off_t)(first * PF_PAGE_SIZE)) == hva);
        g_assert_cmpint(fallocate(g->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                  (off_t)(first * PF_PAGE_SIZE), (off_t)len), ==, 0);
        g_assert_cmpint(ioctl(uffd, UFFDIO_REGISTER, &reg), ==, 0);
        wp.mode = 0;
        g_assert_cmpint(ioctl(uffd, UFFDIO_WRITEPROTECT, &wp), ==, 0);
    }
    secs = bench_now() - t0;
    g_assert_cmpuint(equal, ==, pages);
    close(uffd);
    munmap(pool, PAGES * PF_PAGE_SIZE);
    close(pool_fd);
    pf_guest_free(g);
    return secs * 1e6 / pages;
}

static int
cmp_double(const void *a, const void *b)
{
    return bench_cmp_double(a, b);
}

/* Median microseconds of a one-byte write to each of n merged pages. */
static double
cow_latency(guint8 *mem, gsize n)
{
    g_autofree double *t = g_new(double, n);

    for (gsize i = 0; i < n; i++) {
        double t0 = bench_now();

        mem[i * PF_PAGE_SIZE + 7]++;
        t[i] = (bench_now() - t0) * 1e6;
    }
    qsort(t, n, sizeof(double), cmp_double);
    return t[n / 2];
}

static double
pagefold_cow(gsize n)
{
    PfLayout l = { .unique = PAGES };
    Rig *r = rig_new(&l);
    g_autofree PfWireItem *items = g_new0(PfWireItem, 512);
    double us;

    for (guint32 p = 0; p < n; p += 512) {
        for (guint32 k = 0; k < 512; k++) {
            merge_item(&items[k], p + k);
        }
        g_assert_cmpuint(roundtrip(r, items, 512), ==, 512);
    }
    /* Read each page first, as a guest would have: the write then breaks
     * a present mapping, not a missing one. */
    for (gsize i = 0; i < n; i++) {
        (void)*(volatile guint8 *)(r->g->mem + i * PF_PAGE_SIZE);
    }
    us = cow_latency(r->g->mem, n);
    rig_free(r);
    return us;
}

static char *
ksm_get(const char *knob)
{
    g_autofree char *path = g_strdup_printf("/sys/kernel/mm/ksm/%s", knob);
    char *v = NULL;

    if (g_file_get_contents(path, &v, NULL, NULL)) {
        g_strstrip(v);
    }
    return v;
}

static gboolean
ksm_set(const char *knob, const char *value)
{
    g_autofree char *path = g_strdup_printf("/sys/kernel/mm/ksm/%s", knob);

    return pf_test_write_sysfs(path, value);
}

/* Kernel KSM on anonymous memory: pairs of identical pages. */
static double
ksm_cow(gsize n, gboolean with_vcpu, double *merge_secs, double *ksmd_us)
{
    Vcpu vcpu = { NULL };
    g_autofree char *run = ksm_get("run"), *pts = ksm_get("pages_to_scan");
    g_autofree char *sleep_ms = ksm_get("sleep_millisecs");
    gsize len = 2 * n * PF_PAGE_SIZE;
    guint8 *mem;
    double us = -1, t0, cpu0;
    gboolean merged = FALSE;

    *ksmd_us = -1;
    if (run == NULL || pts == NULL || sleep_ms == NULL) {
        return -1;
    }
    mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(mem, len, MADV_NOHUGEPAGE);
    for (gsize i = 0; i < n; i++) {
        pf_fill_page(mem + i * PF_PAGE_SIZE, i + 1);
        memcpy(mem + (n + i) * PF_PAGE_SIZE, mem + i * PF_PAGE_SIZE, PF_PAGE_SIZE);
    }
    /* ksmd stopped while the pages are offered, so that its CPU from run=1
     * on is what merging them cost. */
    if (ksm_set("run", "0") && madvise(mem, len, MADV_MERGEABLE) == 0 &&
        ksm_set("pages_to_scan", "20000") && ksm_set("sleep_millisecs", "1")) {
        if (with_vcpu) {
            vcpu_start(&vcpu, mem, 2 * n);
        }
        cpu0 = task_cpu_s("/proc", "ksmd");
        t0 = bench_now();
        /* Wait for this process's own KSM figure. */
        for (gboolean on = ksm_set("run", "1"); on && bench_now() - t0 <= 60;) {
            g_autofree char *path = g_strdup_printf("/proc/%d/ksm_merging_pages", getpid());
            g_autofree char *v = NULL;

            if (g_file_get_contents(path, &v, NULL, NULL) &&
                g_ascii_strtoull(v, NULL, 10) >= 2 * n * 95 / 100) {
                merged = ksm_set("run", "0");
                break;
            }
            g_usleep(1000);
        }
        *merge_secs = bench_now() - t0;
        /* Left at -1 where ksmd is not to be seen (another PID namespace). */
        if (merged && cpu0 > 0) {
            *ksmd_us = (task_cpu_s("/proc", "ksmd") - cpu0) * 1e6 / (2.0 * n);
        }
        vcpu_stop(&vcpu);
        us = !merged ? -1 : with_vcpu ? 0 : cow_latency(mem, n);
    }
    /* As found: unmerge everything, then the old settings. */
    ksm_set("run", "2");
    ksm_set("pages_to_scan", pts);
    ksm_set("sleep_millisecs", sleep_ms);
    ksm_set("run", run);
    munmap(mem, len);
    return us;
}

/* Runs of identical pages among unique and zero ones, lengths 1..32. */
static double
mappings_per_page(guint64 *merged_out)
{
    PfLayout l = { .unique = PAGES };
    Rig *r = rig_new(&l);
    g_autofree PfWireItem *items = g_new0(PfWireItem, PF_PROTO_MAX_ITEMS);
    guint32 n = 0, merged = 0;
    gsize before, after;
    GRand *rnd = g_rand_new_with_seed(42);

    for (guint32 p = 0; p < PAGES;) {
        guint32 run = g_rand_int_range(rnd, 1, 33);
        guint kind = g_rand_int_range(rnd, 0, 3); /* identical, unique, zero */

        for (guint32 k = 0; k < run && p < PAGES; k++, p++) {
            if (kind == 1) {
                continue;
            }
            if (kind == 2) {
                /* Zero page and zero slot, as pagefoldd lays them out. */
                memset(r->g->mem + (gsize)p * PF_PAGE_SIZE, 0, PF_PAGE_SIZE);
                memset(r->pool + (gsize)p * PF_PAGE_SIZE, 0, PF_PAGE_SIZE);
                items[n] = (PfWireItem){ .kind = PF_ITEM_ZERO, .page = p, .slot = p };
            } else {
                merge_item(&items[n], p);
            }
            if (++n == PF_PROTO_MAX_ITEMS) {
                merged += roundtrip(r, items, n);
                n = 0;
            }
        }
    }
    before = 1; /* guest RAM was one mapping */
    if (n > 0) {
        merged += roundtrip(r, items, n);
    }
    after = (gsize)pf_test_count_vmas(getpid(), (guint64)(guintptr)r->g->mem,
                                      PAGES * PF_PAGE_SIZE);
    g_rand_free(rnd);
    rig_free(r);
    *merged_out = merged;
    return (double)(after - before) / merged;
}

int
main(int argc, char **argv)
{
    int reps = bench_reps();
    g_autofree double *single = g_new(double, reps), *batched = g_new(double, reps);
    g_autofree double *single_floor = g_new(double, reps), *batched_floor = g_new(double, reps);
    g_autofree double *single_cpu = g_new(double, reps), *batched_cpu = g_new(double, reps);
    g_autofree double *scattered = g_new(double, reps), *scattered_cpu = g_new(double, reps);
    double s_us, b_us, sf_us, bf_us, sc_us, bc_us;
    double pf_cow, ksm_cow_us, ksm_merge_s = 0, ksm_vcpu_merge_s = 0, ksmd_us[2];
    guint64 merged = 0;
    double mpp;

    /* Alternating, so that both see the same machine. */
    for (int i = 0; i < reps; i++) {
        single[i] = bench_merge_rate(1, 2000, READER_NONE, &single_cpu[i]);
        single_floor[i] = bench_merge_floor(1, 2000);
        batched[i] = bench_merge_rate(512, PAGES, READER_NONE, &batched_cpu[i]);
        batched_floor[i] = bench_merge_floor(512, PAGES);
    }
    s_us = bench_median(single, reps);
    b_us = bench_median(batched, reps);
    sf_us = bench_median(single_floor, reps);
    bf_us = bench_median(batched_floor, reps);
    sc_us = bench_median(single_cpu, reps);
    bc_us = bench_median(batched_cpu, reps);
    printf("{\"bench\":\"merge\",\"single_us_per_page\":%.1f,\"single_merges_per_s\":%.0f,"
           "\"batched_us_per_page\":%.2f,\"batched_merges_per_s\":%.0f,\"batch\":512,\"reps\":%d}\n",
           s_us, 1e6 / s_us, b_us, 1e6 / b_us, reps);
    /* The agent thread's CPU as a multiple of the bare system calls'
     * (wall: its CPU, plus the round trip of pagefoldd's side played
     * here, one request at a time). */
    printf("{\"bench\":\"merge-floor\",\"single_floor_us_per_page\":%.1f,"
           "\"single_agent_cpu_us_per_page\":%.1f,\"single_cpu_to_floor\":%.2f,"
           "\"single_wall_to_floor\":%.2f,\"batched_floor_us_per_page\":%.2f,"
           "\"batched_agent_cpu_us_per_page\":%.2f,\"batched_cpu_to_floor\":%.2f,"
           "\"batched_wall_to_floor\":%.2f,\"target\":1.5,\"reps\":%d}\n",
           sf_us, sc_us, sc_us / sf_us, s_us / sf_us, bf_us, bc_us, bc_us / bf_us,
           b_us / bf_us, reps);
    fflush(stdout);

    /*
     * The same merges with the memfd also mapped by another process, as
     * pagefoldd maps what it reads, or with a vCPU-like thread running:
     * the agent's CPU a page (which a TLB shootdown's wait for the other
     * CPU is part of), alternating.
     */
    {
        double cpu[2][READER_KINDS][16];
        int n = MIN(reps, 16);

        for (int i = 0; i < n; i++) {
            for (int k = 0; k < READER_KINDS; k++) {
                (void)bench_merge_rate(1, 2000, (Reader)k, &cpu[0][k][i]);
                (void)bench_merge_rate(512, PAGES, (Reader)k, &cpu[1][k][i]);
            }
        }
        for (int k = 0; k < READER_KINDS; k++) {
            printf("{\"bench\":\"merge-reader\",\"reader\":\"%s\","
                   "\"single_agent_cpu_us_per_page\":%.2f,\"batched_agent_cpu_us_per_page\":%.2f,"
                   "\"single_to_none\":%.2f,\"batched_to_none\":%.2f,\"batch\":512,\"reps\":%d}\n",
                   reader_names[k], bench_median(cpu[0][k], n), bench_median(cpu[1][k], n),
                   bench_median(cpu[0][k], n) / bench_median(cpu[0][READER_NONE], n),
                   bench_median(cpu[1][k], n) / bench_median(cpu[1][READER_NONE], n), n);
        }
        fflush(stdout);
    }

    for (int i = 0; i < reps; i++) {
        single[i] = bench_fold_back_rate(1, 4096, FALSE, &single_cpu[i]);
        batched[i] = bench_fold_back_rate(512, 4096, FALSE, &batched_cpu[i]);
        scattered[i] = bench_fold_back_rate(512, 4096, TRUE, &scattered_cpu[i]);
    }
    printf("{\"bench\":\"fold-back\",\"pages\":4096,\"single_us_per_page\":%.1f,"
           "\"single_agent_cpu_us_per_page\":%.1f,\"batched_us_per_page\":%.2f,"
           "\"batched_agent_cpu_us_per_page\":%.2f,\"scattered_batched_us_per_page\":%.2f,"
           "\"scattered_batched_agent_cpu_us_per_page\":%.2f,\"batch\":512,\"reps\":%d}\n",
           bench_median(single, reps), bench_median(single_cpu, reps),
           bench_median(batched, reps), bench_median(batched_cpu, reps),
           bench_median(scattered, reps), bench_median(scattered_cpu, reps), reps);
    fflush(stdout);

    pf_cow = pagefold_cow(4096);
    ksm_cow_us = ksm_cow(4096, FALSE, &ksm_merge_s, &ksmd_us[0]);
    printf("{\"bench\":\"cow-fault\",\"pages\":4096,\"pagefold_median_us\":%.2f,"
           "\"ksm_median_us\":%.2f,\"pagefold_to_ksm\":%.2f,\"ksm_merge_s\":%.2f}\n",
           pf_cow, ksm_cow_us, ksm_cow_us > 0 ? pf_cow / ksm_cow_us : -1, ksm_merge_s);
    /* ksmd's whole CPU a page merged (scan, checksums, trees and merge), to
     * set beside the agent's in merge-reader: alone, and with a thread of
     * the process reading the pages on another CPU. */
    if (ksm_cow(4096, TRUE, &ksm_vcpu_merge_s, &ksmd_us[1]) >= 0 && ksmd_us[0] >= 0 &&
        ksmd_us[1] >= 0) {
        printf("{\"bench\":\"ksm-merge\",\"pages\":8192,\"ksmd_cpu_us_per_page\":%.2f,"
               "\"ksmd_cpu_us_per_page_vcpu\":%.2f,\"merge_s\":%.3f,\"merge_s_vcpu\":%.3f}\n",
               ksmd_us[0], ksmd_us[1], ksm_merge_s, ksm_vcpu_merge_s);
    }
    fflush(stdout);

    mpp = mappings_per_page(&merged);
    printf("{\"bench\":\"mappings\",\"merged_pages\":%" G_GUINT64_FORMAT
           ",\"mappings_per_merged_page\":%.3f,\"target\":0.1}\n", merged, mpp);
    return 0;
}
