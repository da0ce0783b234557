/*
 * agent-cow-test.c - copy-on-write of merged pages against stand-in VMMs
 * and the real pagefoldd: seen both ways (PAGEMAP_SCAN, or pagemap entries
 * as on kernels before 6.7), and the copies the kernel hides (swapped out,
 * merged again by host KSM, in memfd data a failed huge page split left);
 * and guest RAM in transparent huge pages, split by merging and collapsed
 * again by unmerging.
 *
 * Owns: the host-wide settings its tests change: a swap file of its own,
 * host KSM's knobs, shmem_enabled of transparent huge pages.  It must never
 * leave one changed: each goes back once it has done its work, most of
 * them by a child that outlives a test that aborts (undo_at_exit()).  No
 * other agent program touches these, so that no two programs meson runs
 * side by side race on one knob.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/swap.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent-helpers.h"
#include "testproc.h"
#include "util.h"

/* pagefoldd seeing copy-on-write the way named: "PAGEMAP_SCAN", or
 * "pagemap" (entries read as on kernels before 6.7). */
static PfTestDaemon *
daemon_seeing(const char *path)
{
    PfTestDaemon *d;

    if (g_str_equal(path, "pagemap")) {
        g_setenv("PAGEFOLD_NO_PAGEMAP_SCAN", "1", TRUE);
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g_unsetenv("PAGEFOLD_NO_PAGEMAP_SCAN");
    return d;
}

/* Does pagefoldd (stats s) see copy-on-write the way path names?  If not,
 * the test is skipped: PAGEMAP_SCAN came in Linux 6.7 (Debian 12's
 * 6.1 has not got it). */
static gboolean
seeing(JsonObject *s, const char *path)
{
    if (g_str_equal(json_object_get_string_member(s, "cow_detection"), path)) {
        return TRUE;
    }
    g_assert_cmpstr(path, ==, "PAGEMAP_SCAN");
    g_test_skip("this kernel has no PAGEMAP_SCAN");
    return FALSE;
}

/* A merged page written: copied on write, counted out, content intact;
 * written back to what it was, it merges again. */
static void
test_cow_and_remerge(gconstpointer data)
{
    const char *path = data;
    g_autoptr(PfTestDaemon) d = NULL;
    Vmm *a, *b;
    g_autoptr(JsonObject) s = NULL;
    g_autofree char *r1 = NULL, *r2 = NULL;

    /* Both ways of seeing copy-on-write: the kernel's PAGEMAP_SCAN, and
     * reading pagemap entries as on kernels before 6.7. */
    d = daemon_seeing(path);
    a = vmm_start(d, "a", 1, 0, FALSE);
    b = vmm_start(d, "b", 2, 0, FALSE);
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        return;
    }

    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    r1 = pf_test_vmm_cmd(a, "write 5");
    g_assert_cmpstr(r1, ==, "ok");
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "cow"), ==, 1);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b); /* b's page 5 still maps the pool: unchanged */

    r2 = pf_test_vmm_cmd(a, "restore 5");
    g_assert_cmpstr(r2, ==, "ok");
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(json_object_get_int_member(s, "pool_slots"), ==, IDENTICAL);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
}

/* Huge pages mapped in a VM's guest RAM, in KiB. */
static gint64
huge_kib(int pid, guint64 ram)
{
    return pf_test_smaps_sum(pid, ram, PAGES * PF_PAGE_SIZE, "ShmemPmdMapped");
}

/* RAM in transparent huge pages: merging splits them, unmerging an
 * extent back collapses it into a huge page again. */
static void
test_huge_pages(void)
{
    const char *knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    g_autofree char *old = NULL;
    g_autoptr(PfTestDaemon) d = NULL;
    Vmm *v[2];
    guint64 ram[2];
    gint64 before[2];
    JsonNode *n;
    g_autoptr(JsonObject) s = NULL;

    if (!g_file_get_contents(knob, &old, NULL, NULL)) {
        g_test_skip("no shmem transparent huge pages in this kernel");
        return;
    }
    /* "always within_size advise [never] deny force": keep the choice. */
    g_strdelimit(old, "[]", '\n');
    {
        g_auto(GStrv) parts = g_strsplit(old, "\n", -1);

        g_free(old);
        old = g_strdup(g_strv_length(parts) > 1 ? g_strstrip(parts[1]) : "never");
    }
    /* Huge pages for the guests' RAM, then the knob as it was at once
     * (collapsing does not need it). */
    pf_test_write_sysfs(knob, "advise");
    d = pf_test_daemon_start("--set", "run=0", NULL);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("h%d", i);

        v[i] = vmm_start_full(d, name, i + 1, 0, FALSE, "--huge");
        ram[i] = guest_addr(d, name);
        before[i] = huge_kib(v[i]->pid, ram[i]);
    }
    pf_test_write_sysfs(knob, old);
    if (before[0] == 0) {
        for (int i = 0; i < 2; i++) {
            pf_test_vmm_free(v[i]);
        }
        g_test_skip("guest RAM got no huge pages");
        return;
    }
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    /* Merged: the identical and zero extents are split into small pages. */
    g_assert_cmpint(huge_kib(v[0]->pid, ram[0]), <, before[0]);
    n = pf_test_ctl_json(d, "set", "run", "2", NULL);
    json_node_unref(n);
    for (int i = 0; i < 2; i++) {
        /* Every extent unmerged is a huge page again, but one of zero
         * pages only: the merge punched those, and a hole reads zero for
         * free.  Mapped as one once touched (the check reads every page):
         * where a fold-back unmapped a whole extent's page table, Linux
         * 6.1's collapse leaves the huge page to the next fault to map. */
        gint64 zero_extents = PAGES / 512 - (IDENTICAL + UNIQUE + 511) / 512;

        pf_test_vmm_verify(v[i]);
        g_assert_cmpint(huge_kib(v[i]->pid, ram[i]), ==, before[i] - zero_extents * 2048);
        g_assert_cmpint(pf_test_count_vmas(v[i]->pid, ram[i], PAGES * PF_PAGE_SIZE), ==, 1);
        pf_test_vmm_quit(v[i]);
    }
}

/* ---- copy-on-write the kernel hides: swapped out, merged by host KSM,
 * in memfd data that a failed huge page split left ---- */

/* Host settings a test changes are put back by a child process once the
 * test process is gone, however it goes (an assertion aborts it): the
 * child waits for the end of a pipe only the test holds.  What it does is
 * prepared before the fork, and is system calls only. */
typedef void (*UndoFunc)(gconstpointer data);

typedef struct {
    pid_t pid;
    int fd;
} Undo;

static Undo
undo_at_exit(UndoFunc undo, gconstpointer data)
{
    int p[2];
    pid_t pid;

    g_assert_cmpint(pipe2(p, O_CLOEXEC), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        char c;
        ssize_t n;

        /* A timeout signals the test's whole process group. */
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
        signal(SIGHUP, SIG_IGN);
        for (int fd = 3; fd < 1024; fd++) {
            if (fd != p[0]) {
                close(fd);
            }
        }
        do {
            n = read(p[0], &c, 1);
        } while (n > 0 || (n < 0 && errno == EINTR));
        undo(data);
        _exit(0);
    }
    close(p[0]);
    return (Undo){ pid, p[1] };
}

static void
undo_now(Undo *u)
{
    if (u->fd >= 0) {
        close(u->fd);
        waitpid(u->pid, NULL, 0);
        u->fd = -1;
    }
}

#define MAX_KNOBS 6

/* sysfs knobs to write back, in this order. */
typedef struct {
    guint n;
    char path[MAX_KNOBS][128];
    char value[MAX_KNOBS][64];
} Knobs;

static void
knobs_add(Knobs *k, const char *path, const char *value)
{
    g_assert_cmpuint(k->n, <, MAX_KNOBS);
    g_strlcpy(k->path[k->n], path, sizeof(k->path[0]));
    g_strlcpy(k->value[k->n], value, sizeof(k->value[0]));
    k->n++;
}

/* Adds the knob's value as it is now; FALSE if it cannot be read. */
static gboolean
knobs_save(Knobs *k, const char *path)
{
    g_autofree char *v = NULL;
    char *open_b, *close_b;

    if (!g_file_get_contents(path, &v, NULL, NULL)) {
        return FALSE;
    }
    /* "always within_size advise [never] deny force": the one chosen. */
    if ((open_b = strchr(v, '[')) != NULL && (close_b = strchr(open_b, ']')) != NULL) {
        *close_b = '\0';
        memmove(v, open_b + 1, strlen(open_b + 1) + 1);
    }
    knobs_add(k, path, g_strstrip(v));
    return TRUE;
}

static void
knobs_undo(gconstpointer data)
{
    const Knobs *k = data;

    for (guint i = 0; i < k->n; i++) {
        int fd = open(k->path[i], O_WRONLY | O_CLOEXEC);

        if (fd >= 0) {
            ssize_t rc = write(fd, k->value[i], strlen(k->value[i]));

            (void)rc; /* nothing better to do in a child about to exit */
            close(fd);
        }
    }
}

static guint64
pagemap_of(int pid, guint64 addr)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/pagemap", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    guint64 e = 0;

    g_assert_cmpint(pread(fd, &e, 8, (off_t)(addr / PF_PAGE_SIZE * 8)), ==, 8);
    close(fd);
    return e;
}

#define PM_PRESENT (1ull << 63)
#define PM_SWAP (1ull << 62)
#define PM_PFN(e) ((e) & ((1ull << 55) - 1))
#define KPF_KSM (1ull << 21)
#define KPF_ZERO_PAGE (1ull << 24)

/* /proc/kpageflags of the page behind a VMM's address; 0 if not present. */
static guint64
kpageflags_of(int pid, guint64 addr)
{
    guint64 e = pagemap_of(pid, addr), flags = 0;
    int fd;

    if (!(e & PM_PRESENT) || PM_PFN(e) == 0 ||
        (fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC)) < 0) {
        return 0;
    }
    if (pread(fd, &flags, 8, (off_t)(PM_PFN(e) * 8)) != 8) {
        flags = 0;
    }
    close(fd);
    return flags;
}

/* The first zero page of a guest's layout (identical, unique, zero). */
#define ZERO_FIRST (IDENTICAL + UNIQUE)

/* A swap file of our own, on only for the test. */
typedef struct {
    char path[256];
} SwapFile;

static void
swap_undo(gconstpointer data)
{
    const SwapFile *sw = data;

    swapoff(sw->path);
    unlink(sw->path);
}

/* Makes and enables a 64 MiB swap file (written whole: swapon refuses
 * holes), as mkswap would; FALSE with why if the host will not have it. */
static gboolean
swap_on(SwapFile *sw, Undo *undo, char **why)
{
    const gsize pages = 64 * 256;
    g_autofree guint8 *page = g_malloc0(PF_PAGE_SIZE);
    guint32 header[3] = { 1, (guint32)(pages - 1), 0 }; /* version, last page, bad */
    const char *dir = g_file_test("/var/tmp", G_FILE_TEST_IS_DIR) ? "/var/tmp" : g_get_tmp_dir();
    int fd;

    g_snprintf(sw->path, sizeof(sw->path), "%s/pagefold-agent-test.%d.swap", dir, getpid());
    fd = open(sw->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        *why = g_strdup_printf("%s: %s", sw->path, g_strerror(errno));
        return FALSE;
    }
    /* The swap file goes with the test, whatever happens from here on. */
    *undo = undo_at_exit(swap_undo, sw);
    memcpy(page + 1024, header, sizeof(header));
    memcpy(page + PF_PAGE_SIZE - 10, "SWAPSPACE2", 10);
    for (gsize i = 0; i < pages; i++) {
        g_assert_cmpint(write(fd, page, PF_PAGE_SIZE), ==, PF_PAGE_SIZE);
        if (i == 0) {
            memset(page, 0, PF_PAGE_SIZE);
        }
    }
    g_assert_cmpint(fsync(fd), ==, 0);
    close(fd);
    if (swapon(sw->path, 0) < 0) {
        *why = g_strdup_printf("swapon %s: %s", sw->path, g_strerror(errno));
        undo_now(undo);
        return FALSE;
    }
    return TRUE;
}

/* Every thread of process pid onto one CPU, the first this test may use
 * (a cpuset may leave it only some).  A page a thread writes waits first
 * in its CPU's LRU batch, and MADV_PAGEOUT drains only the batch of the
 * CPU it runs on: a page written on one CPU and paged out from another is
 * passed over, however often asked, until that other CPU adds enough
 * pages to flush its batch, which an idle CPU never does. */
static void
pin_to_one_cpu(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/task", pid);
    g_autoptr(GDir) dir = g_dir_open(path, 0, NULL);
    cpu_set_t mine, one;
    const char *tid;
    int cpu = 0;

    g_assert_cmpint(sched_getaffinity(0, sizeof(mine), &mine), ==, 0);
    while (!CPU_ISSET(cpu, &mine)) {
        cpu++;
    }
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    g_assert_nonnull(dir);
    while ((tid = g_dir_read_name(dir)) != NULL) {
        /* A thread may end meanwhile; one made later takes its maker's. */
        if (sched_setaffinity(atoi(tid), sizeof(one), &one) < 0) {
            g_assert_cmpint(errno, ==, ESRCH);
        }
    }
}

/* A merged page written, then its private copy swapped out before
 * pagefoldd looks: not present, but written all the same.  Both a shared
 * page and a zero page. */
static void
test_cow_swapped(gconstpointer data)
{
    const char *path = data;
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) s = NULL;
    g_autofree char *why = NULL;
    SwapFile sw = { { 0 } };
    Undo undo = { 0, -1 };
    const guint pages[2] = { 5, ZERO_FIRST + 3 };
    Vmm *a, *b;
    guint64 ram;

    if (geteuid() != 0) {
        g_test_skip("swapon needs root");
        return;
    }
    if (!swap_on(&sw, &undo, &why)) {
        g_test_skip(why);
        return;
    }
    d = daemon_seeing(path);
    a = vmm_start(d, "a", 1, 0, FALSE);
    b = vmm_start(d, "b", 2, 0, FALSE);
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        undo_now(&undo);
        return;
    }
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO);
    ram = guest_addr(d, "a");
    /* Written and paged out on one CPU: see pin_to_one_cpu(). */
    pin_to_one_cpu(a->pid);
    g_free(pf_test_vmm_cmdf(a, "write %u", pages[0]));
    g_free(pf_test_vmm_cmdf(a, "fill %u 77", pages[1]));
    for (guint i = 0; i < G_N_ELEMENTS(pages); i++) {
        guint64 e = 0;

        /* Really out: a swap entry where the copy was.  Isolating a
         * page from the LRU can still fail for a moment (reclaim or
         * compaction holding it): again, a few times. */
        for (int tries = 0; tries < 50 && (e & (PM_PRESENT | PM_SWAP)) != PM_SWAP; tries++) {
            g_autofree char *r = pf_test_vmm_cmdf(a, "pageout %u 1", pages[i]);

            g_assert_cmpstr(r, ==, "ok");
            e = pagemap_of(a->pid, ram + pages[i] * PF_PAGE_SIZE);
            if ((e & (PM_PRESENT | PM_SWAP)) != PM_SWAP) {
                g_usleep(20000);
            }
        }
        g_assert_cmphex(e & (PM_PRESENT | PM_SWAP), ==, PM_SWAP);
    }
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "cow"), ==, 2);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 1);
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(a, "unmerged"), ==, 2);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
    undo_now(&undo);
}

/*
 * Host KSM merges the private copies of merged pages (their mappings are
 * mergeable: a QEMU under PR_SET_MEMORY_MERGE makes every new mapping so,
 * the agent's remaps included): two copies of equal content become one
 * KSM page, mapped twice, no longer "exclusive"; a copy of zeros becomes
 * the kernel's zero page (use_zero_pages=1).  All were written: a shared
 * page overwritten with zeros too.  Only a zero page written with zeros
 * still holds what it was merged for.
 */
static void
test_cow_ksm(gconstpointer data)
{
    const char *path = data;
    const char *ksm = "/sys/kernel/mm/ksm";
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) s = NULL;
    Knobs knobs = { 0 };
    Undo undo = { 0, -1 };
    const guint z = ZERO_FIRST + 3;
    Vmm *a, *b;
    guint64 ram;
    gboolean merged = FALSE;

    if (geteuid() != 0 || !g_file_test("/sys/kernel/mm/ksm/use_zero_pages", G_FILE_TEST_EXISTS)) {
        g_test_skip("needs root and host KSM with use_zero_pages");
        return;
    }
    /* As found: unmerge everything first, then the old settings, run last. */
    {
        g_autofree char *run = g_strdup_printf("%s/run", ksm);
        const char *names[] = { "use_zero_pages", "pages_to_scan", "sleep_millisecs", "run" };

        knobs_add(&knobs, run, "2");
        for (guint i = 0; i < G_N_ELEMENTS(names); i++) {
            g_autofree char *p = g_strdup_printf("%s/%s", ksm, names[i]);

            g_assert_true(knobs_save(&knobs, p));
        }
    }
    d = daemon_seeing(path);
    a = vmm_start(d, "a", 1, 0, FALSE);
    b = vmm_start(d, "b", 2, 0, FALSE);
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        return;
    }
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO);
    ram = guest_addr(d, "a");
    /* Shared pages: 5 zeroed, 6 and 7 made equal; zero pages: z and z + 1
     * made equal, z + 2 written with zeros. */
    g_free(pf_test_vmm_cmd(a, "fill 5 0"));
    g_free(pf_test_vmm_cmd(a, "fill 6 4242"));
    g_free(pf_test_vmm_cmd(a, "fill 7 4242"));
    g_free(pf_test_vmm_cmdf(a, "fill %u 4343", z));
    g_free(pf_test_vmm_cmdf(a, "fill %u 4343", z + 1));
    g_free(pf_test_vmm_cmdf(a, "fill %u 0", z + 2));
    for (guint i = 0; i < 2; i++) {
        g_autofree char *r = pf_test_vmm_cmdf(a, "mergeable %u 3", i == 0 ? 5u : z);

        g_assert_cmpstr(r, ==, "ok");
    }
    undo = undo_at_exit(knobs_undo, &knobs);
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/use_zero_pages", "1"));
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/pages_to_scan", "5000"));
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/sleep_millisecs", "10"));
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/run", "1"));
    for (gint64 until = g_get_monotonic_time() + 60 * G_USEC_PER_SEC;
         !merged && g_get_monotonic_time() < until;) {
        guint64 p6 = pagemap_of(a->pid, ram + 6 * PF_PAGE_SIZE);
        guint64 pz = pagemap_of(a->pid, ram + z * PF_PAGE_SIZE);

        merged = (kpageflags_of(a->pid, ram + 5 * PF_PAGE_SIZE) & KPF_ZERO_PAGE) &&
                 (kpageflags_of(a->pid, ram + 6 * PF_PAGE_SIZE) & KPF_KSM) &&
                 PM_PFN(p6) == PM_PFN(pagemap_of(a->pid, ram + 7 * PF_PAGE_SIZE)) &&
                 (kpageflags_of(a->pid, ram + z * PF_PAGE_SIZE) & KPF_KSM) &&
                 PM_PFN(pz) == PM_PFN(pagemap_of(a->pid, ram + (z + 1) * PF_PAGE_SIZE)) &&
                 (kpageflags_of(a->pid, ram + (z + 2) * PF_PAGE_SIZE) & KPF_ZERO_PAGE);
        if (!merged) {
            g_usleep(50000);
        }
    }
    /* Stopped, KSM keeps what it merged. */
    g_assert_true(pf_test_write_sysfs("/sys/kernel/mm/ksm/run", "0"));
    if (!merged) {
        pf_test_vmm_quit(a);
        pf_test_vmm_quit(b);
        undo_now(&undo);
        g_test_skip("host KSM did not merge the copies within 60 s");
        return;
    }
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "a"), "cow"), ==, 5);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 3);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 2);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
    undo_now(&undo);
}

/*
 * Guest RAM in transparent huge pages, one of them held by a reference
 * (a vmsplice()d page: a pipe, an I/O in flight): a merge of part of it
 * remaps those pages, but the punch cannot split the huge page, so it
 * only zeroes them and their memfd offsets stay data.  (A punch of a
 * whole huge page needs no split: each extent here keeps one page
 * unmerged.)  Such a merged page is scanned among data, and its
 * copy-on-write must be found there as in a hole, smart scan on
 * (pagefoldd's default).
 */
static void
test_cow_in_data(gconstpointer data)
{
    const char *path = data;
    const char *knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(JsonObject) s = NULL;
    Knobs knobs = { 0 };
    Undo undo;
    const guint z = PAGES - 96; /* in the last extent, all zero */
    Vmm *v[2];
    g_autofree char *data5 = NULL, *dataz = NULL;

    if (geteuid() != 0 || !knobs_save(&knobs, knob)) {
        g_test_skip("needs root and shmem transparent huge pages");
        return;
    }
    /* Huge pages for the guests' RAM, then the knob as it was at once. */
    undo = undo_at_exit(knobs_undo, &knobs);
    g_assert_true(pf_test_write_sysfs(knob, "advise"));
    d = daemon_seeing(path);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("t%d", i);

        v[i] = vmm_start_full(d, name, i + 1, 0, FALSE, "--huge");
    }
    undo_now(&undo);
    if (huge_kib(v[0]->pid, guest_addr(d, "t0")) == 0) {
        pf_test_vmm_free(v[0]);
        pf_test_vmm_free(v[1]);
        g_test_skip("guest RAM got no huge pages");
        return;
    }
    /* References on the first and the last huge page of t0, and a page
     * of each that stays apart. */
    for (guint i = 0; i < 2; i++) {
        g_autofree char *r = pf_test_vmm_cmdf(v[0], "pin %u", i == 0 ? 100u : (guint)PAGES - 1);
        g_autofree char *f = pf_test_vmm_cmdf(v[0], "fill %u %u", i == 0 ? 300u : (guint)PAGES - 2,
                                      4646 + i);

        g_assert_cmpstr(r, ==, "ok");
        g_assert_cmpstr(f, ==, "ok");
    }
    s = stats(d, "scan-now", "3");
    if (!seeing(s, path)) {
        pf_test_vmm_quit(v[0]);
        pf_test_vmm_quit(v[1]);
        return;
    }
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 1);
    data5 = pf_test_vmm_cmd(v[0], "data 5");
    dataz = pf_test_vmm_cmdf(v[0], "data %u", z);
    if (!g_str_equal(data5, "data 1") || !g_str_equal(dataz, "data 1")) {
        pf_test_vmm_quit(v[0]);
        pf_test_vmm_quit(v[1]);
        g_test_skip("the huge pages were split in spite of the references: no data left");
        return;
    }
    /* A few passes more: smart scan has looked at everything by then. */
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 1);
    g_free(pf_test_vmm_cmd(v[0], "write 5"));
    g_free(pf_test_vmm_cmdf(v[0], "fill %u 77", z));
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(json_object_get_int_member(vm_of(s, "t0"), "cow"), ==, 2);
    g_assert_cmpint(total(s, "pages_sharing"), ==, IDENTICAL - 2);
    g_assert_cmpint(total(s, "zero_pages"), ==, 2 * ZERO - 2);
    g_clear_pointer(&s, json_object_unref);
    s = stats(d, "scan-now", "1");
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    g_assert_cmpint(pf_test_vmm_stat(v[0], "unmerged"), ==, 2);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
    }
    g_free(pf_test_vmm_cmd(v[0], "unpin"));
    pf_test_vmm_quit(v[0]);
    pf_test_vmm_quit(v[1]);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_data_func("/agent/cow-and-remerge/PAGEMAP_SCAN", "PAGEMAP_SCAN",
                         test_cow_and_remerge);
    g_test_add_data_func("/agent/cow-and-remerge/pagemap", "pagemap", test_cow_and_remerge);
    g_test_add_func("/agent/huge-pages", test_huge_pages);
    g_test_add_data_func("/agent/cow-swapped/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_cow_swapped);
    g_test_add_data_func("/agent/cow-swapped/pagemap", "pagemap", test_cow_swapped);
    g_test_add_data_func("/agent/cow-ksm/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_cow_ksm);
    g_test_add_data_func("/agent/cow-ksm/pagemap", "pagemap", test_cow_ksm);
    g_test_add_data_func("/agent/cow-in-data/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_cow_in_data);
    g_test_add_data_func("/agent/cow-in-data/pagemap", "pagemap", test_cow_in_data);
    return g_test_run();
}
