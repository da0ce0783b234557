/*
 * bench-qemu.c - pagefold and kernel KSM side by side, in one run, on the
 * baseline workload: 4 TCG guests x 512 MiB, each filling 256 MiB (50%
 * identical across guests, 20% zero, 1% rewritten every 500 ms).
 *   pagefold: memfd share=on RAM, the agent, pagefoldd (target_pass 500 ms)
 *   ksm-N:    QEMU's default anonymous RAM (mem-merge=on), kernel KSM with
 *             pages_to_scan N (100, 1000, 5000), sleep_millisecs 20
 *   pagefold+ksm-100: pagefold, and kernel KSM at its defaults
 *             (pages_to_scan 100) for QEMU's own smaller RAM blocks, as a
 *             host runs both; ksmd's CPU and rmap_items counted too
 *   pagefold+virtiofs: pagefold, every guest holding a virtiofs mount
 *             served by the patched virtiofsd, which joins the merge
 *             (writing and reading back 16 pages of a file a second
 *             instead of sleeping); the virtiofsds' Pss counted with the
 *             guests' (backends_own_mib says how much of it is not guest
 *             RAM: the processes' own), and their fold-backs a second
 * All guests are headless (-vga none): the video memory a VGA card adds
 * is private RAM either way, merged by kernel KSM in its runs only.
 * For each: memory freed (drop of the summed Pss of the QEMU processes, plus
 * pagefoldd's own for pagefold), time to 90% of the final saving, CPU
 * seconds spent to get there (pagefoldd and the agent threads; ksmd), and
 * the guests' slowdown (their full check of memory, after / before).
 * freed_net_mib is the saving less the deduplicator's own memory:
 * pagefoldd's is in its Pss already, KSM's rmap_items (in the kernel) are
 * charged as its general_profit counter charges them; used_mib is what is
 * held at the end, counted the same way (the guests' Pss, and pagefoldd's
 * or KSM's rmap_items); tcg_mib is the QEMUs' Pss at the end of the code
 * TCG translated the guests' into (QEMU's writable, executable anonymous
 * mapping), the stand-in's own memory, which KVM does not have.
 * Runs every system PAGEFOLD_BENCH_REPS times (default 5, at most 16),
 * alternating: one run of each per round, so that what else the host does
 * falls on all of them alike.  Prints one JSON line per run as it ends,
 * one per system with the medians of its runs, then every run and the
 * medians as CSV, and the medians as a table.
 * Needs QEMU_BINARY, GUEST_KERNEL, GUEST_INITRD (scripts/run-tests sets
 * them); KSM's settings are restored as found.  PAGEFOLD_BENCH_GUESTS, _MIB
 * change the size; PAGEFOLD_BENCH_ONLY=pagefold,ksm-5000 runs some systems
 * only; PAGEFOLD_BENCH_PASS_MS sets pagefoldd's target_pass_millisecs
 * (500); PAGEFOLD_BENCH_SMAPS=1 shows what the memory held at the end is
 * (guest RAM, pool, other anonymous memory, heap, files: the QEMUs' and
 * pagefoldd's Pss) and the deduplicator's counters.
 */
#include <fcntl.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench-common.h"
#include "testguest.h"
#include "testproc.h"

typedef struct {
    char name[32];
    double saved_mib;
    double net_mib;  /* saved_mib less the deduplicator's own memory */
    double start_mib; /* held before merging: the guests' Pss, and pagefoldd's */
    double used_mib; /* held at the end: the guests' Pss, and pagefoldd's or
                      * KSM's rmap_items */
    double t90_s;
    double cpu90_s;
    double slowdown;
    double agent90_s; /* of cpu90_s, the agents' part (pagefold) */
    double fold_backs_per_s; /* pages folded back for virtiofsd (+virtiofs) */
    double backends_own_mib; /* of used_mib, the virtiofsds' memory other
                              * than guest RAM (+virtiofs) */
    double tcg_mib;  /* the QEMUs' Pss, at the end, of the code TCG
                      * translated the guests' into (held, so counted in
                      * used_mib): the stand-in's own, which KVM does not
                      * have, and which a guest running more kinds of code
                      * grows */
} Result;

static double
proc_cpu_s(const char *stat_path)
{
    g_autofree char *text = NULL;
    const char *p;
    unsigned long long ut = 0, st = 0;

    if (!g_file_get_contents(stat_path, &text, NULL, NULL) || (p = strrchr(text, ')')) == NULL) {
        return 0;
    }
    /* fields after "(comm)": state is 3rd; utime 14th, stime 15th */
    sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st);
    return (double)(ut + st) / sysconf(_SC_CLK_TCK);
}

/* CPU of the agent threads in a QEMU process. */
static double
agent_cpu_s(int pid)
{
    g_autofree char *dir = g_strdup_printf("/proc/%d/task", pid);
    g_autoptr(GDir) d = g_dir_open(dir, 0, NULL);
    const char *t;
    double sum = 0;

    while (d && (t = g_dir_read_name(d)) != NULL) {
        g_autofree char *comm_path = g_strdup_printf("%s/%s/comm", dir, t);
        g_autofree char *stat_path = g_strdup_printf("%s/%s/stat", dir, t);
        g_autofree char *comm = NULL;

        if (g_file_get_contents(comm_path, &comm, NULL, NULL) &&
            g_str_has_prefix(comm, "pagefold-agent")) {
            sum += proc_cpu_s(stat_path);
        }
    }
    return sum;
}

static int
ksmd_pid(void)
{
    g_autoptr(GDir) d = g_dir_open("/proc", 0, NULL);
    const char *e;

    while (d && (e = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_strdup_printf("/proc/%s/comm", e);
        g_autofree char *comm = NULL;

        if (g_ascii_isdigit(e[0]) && g_file_get_contents(path, &comm, NULL, NULL) &&
            g_str_equal(g_strstrip(comm), "ksmd")) {
            return atoi(e);
        }
    }
    return -1;
}

static char *ksm_get(const char *knob);

/*
 * KSM's own memory, which no process's Pss shows: its rmap_items, as its
 * general_profit counter charges them ((pages_sharing + ksm_zero_pages)
 * pages, less general_profit).  pagefoldd's is in its Pss.
 */
static double
ksm_metadata_mib(void)
{
    g_autofree char *sharing = ksm_get("pages_sharing"), *zero = ksm_get("ksm_zero_pages");
    g_autofree char *profit = ksm_get("general_profit");

    return ((double)(g_ascii_strtoll(sharing, NULL, 10) + g_ascii_strtoll(zero, NULL, 10)) *
                4096.0 -
            (double)g_ascii_strtoll(profit, NULL, 10)) /
           (1024.0 * 1024.0);
}

static gboolean
ksm_set(const char *knob, const char *value)
{
    g_autofree char *path = g_strdup_printf("/sys/kernel/mm/ksm/%s", knob);

    return pf_test_write_sysfs(path, value);
}

static char *
ksm_get(const char *knob)
{
    g_autofree char *path = g_strdup_printf("/sys/kernel/mm/ksm/%s", knob);
    char *v = NULL;

    g_file_get_contents(path, &v, NULL, NULL);
    return v ? g_strstrip(v) : g_strdup("");
}

/* The check times pfguest printed since last asked ("..., T ms"). */
static void
drain_checks(Guest **g, int n, GArray *ms)
{
    for (int i = 0; i < n; i++) {
        char *line;

        while ((line = g_async_queue_try_pop(g[i]->lines)) != NULL) {
            const char *p = strstr(line, "differ, ");

            if (g_str_has_prefix(line, "PFGUEST CHECK ok") && p != NULL) {
                double v = g_ascii_strtod(p + 8, NULL);

                g_array_append_val(ms, v);
            } else if (strstr(line, "FAIL") != NULL) {
                g_error("%s: %s", g[i]->name, line);
            }
            g_free(line);
        }
    }
}

static double
median_of(GArray *a)
{
    return a->len ? bench_median((double *)a->data, a->len) : -1;
}

/* What a process's Pss is made of, added to kib[] by kind (PSS_*): the
 * guest's RAM (its memfd, or the anonymous mapping of exactly its size),
 * pagefold's pool, TCG's translated code (QEMU's one anonymous mapping
 * that is writable and executable), other anonymous memory, the heap,
 * mapped files. */
enum { PSS_RAM, PSS_POOL, PSS_TCG, PSS_ANON, PSS_HEAP, PSS_FILES, PSS_KINDS };
static const char *const pss_kinds[PSS_KINDS] = { "guest RAM", "pool", "TCG code",
                                                  "other anon", "heap", "files" };

static void
pss_by_kind(int pid, guint64 ram_bytes, double kib[PSS_KINDS])
{
    g_autofree char *path = g_strdup_printf("/proc/%d/smaps", pid);
    g_autofree char *text = NULL;
    g_auto(GStrv) lines = NULL;
    int kind = PSS_FILES;

    if (!g_file_get_contents(path, &text, NULL, NULL)) {
        return;
    }
    lines = g_strsplit(text, "\n", -1);
    for (char **l = lines; *l != NULL; l++) {
        guint64 from, to;
        gint64 pss;
        char perms[5] = "";
        int name_at = 0;

        if (sscanf(*l, "%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x %4s %*s %*s %*s %n",
                   &from, &to, perms, &name_at) == 3 && name_at > 0) {
            const char *n = *l + name_at;

            if (strstr(n, "memory-backend") != NULL || (*n == '\0' && to - from == ram_bytes)) {
                kind = PSS_RAM;
            } else if (strstr(n, "pagefold-pool") != NULL) {
                kind = PSS_POOL;
            } else if (*n == '\0' && g_str_equal(perms, "rwxp")) {
                kind = PSS_TCG;
            } else if (*n == '\0') {
                kind = PSS_ANON;
            } else {
                kind = g_str_equal(n, "[heap]") ? PSS_HEAP : PSS_FILES;
            }
        } else if (sscanf(*l, "Pss: %" G_GINT64_FORMAT, &pss) == 1) {
            kib[kind] += (double)pss;
        }
    }
}

/* Where the held memory is at the end, by kind, for all the guests and
 * pagefoldd; and the deduplicator's own counters. */
static void
dump_pss(const char *system, Guest **g, int n_guests, guint64 ram_bytes, int daemon_pid,
         gboolean ksm)
{
    double qemu[PSS_KINDS] = { 0 }, daemon[PSS_KINDS] = { 0 };

    for (int i = 0; i < n_guests; i++) {
        pss_by_kind(g[i]->pid, ram_bytes, qemu);
    }
    if (daemon_pid > 0) {
        pss_by_kind(daemon_pid, ram_bytes, daemon);
    }
    for (int k = 0; k < PSS_KINDS; k++) {
        printf("# %s: Pss of %-10s QEMUs %8.1f MiB, pagefoldd %8.1f MiB\n", system,
               pss_kinds[k], qemu[k] / 1024.0, daemon[k] / 1024.0);
    }
    if (ksm) {
        static const char *const counters[] = { "pages_shared", "pages_sharing",
                                                "pages_unshared", "pages_volatile",
                                                "ksm_zero_pages", "full_scans" };

        for (guint i = 0; i < G_N_ELEMENTS(counters); i++) {
            g_autofree char *p = g_strdup_printf("/sys/kernel/mm/ksm/%s", counters[i]);
            g_autofree char *v = NULL;

            if (g_file_get_contents(p, &v, NULL, NULL)) {
                printf("# %s: %s %s", system, counters[i], v);
            }
        }
    }
}

/* The deduplicators' own CPU seconds: pagefoldd's and ksmd's, each where
 * its /proc/PID/stat is given (the agents are counted apart). */
static double
dedup_cpu_s(const char *daemon_stat, const char *ksm_stat)
{
    return (daemon_stat != NULL ? proc_cpu_s(daemon_stat) : 0) +
           (ksm_stat != NULL ? proc_cpu_s(ksm_stat) : 0);
}

/* One system: boot, wait, measure a baseline, start deduplicating,
 * sample until `seconds` have passed. */
static Result
run_system(const char *name, gboolean pf, guint pages_to_scan, gboolean vfs, int n_guests,
           int mib, int seconds)
{
    Result res = { 0 };
    gboolean ksm = pages_to_scan != 0;
    const int ram_mib = MAX(2 * mib, mib + 192);
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[8];
    PfVirtiofsd *fsd[8] = { NULL };
    int vfs_pid[8] = { 0 };
    int daemon_pid = 0, ksmd = ksmd_pid();
    g_autoptr(GArray) before = g_array_new(FALSE, FALSE, sizeof(double));
    g_autoptr(GArray) after = g_array_new(FALSE, FALSE, sizeof(double));
    g_autoptr(GArray) t = g_array_new(FALSE, FALSE, sizeof(double));
    g_autoptr(GArray) saving = g_array_new(FALSE, FALSE, sizeof(double));
    g_autoptr(GArray) cpu = g_array_new(FALSE, FALSE, sizeof(double));
    g_autoptr(GArray) agent_cpu = g_array_new(FALSE, FALSE, sizeof(double));
    g_autofree char *ksm_stat = g_strdup_printf("/proc/%d/stat", ksmd);
    g_autofree char *daemon_stat = NULL;
    double pss0 = 0, cpu0 = 0, agent0 = 0, t0, final;

    g_strlcpy(res.name, name, sizeof(res.name));
    if (pf) {
        const char *pass_ms = g_getenv("PAGEFOLD_BENCH_PASS_MS");
        g_autofree char *target = g_strdup_printf("target_pass_millisecs=%s",
                                                  pass_ms ? pass_ms : "500");

        d = pf_test_daemon_start("--set", "run=0", "--set", target, NULL);
        daemon_pid = pf_test_daemon_pid(d);
        daemon_stat = g_strdup_printf("/proc/%d/stat", daemon_pid);
    }
    for (int i = 0; i < n_guests; i++) {
        g_autofree char *gname = g_strdup_printf("%s-%d", name, i);
        g_autofree char *chardev = NULL;
        /* Headless: a VGA card's memory is private RAM that only kernel
         * KSM could merge (and does, in its runs), not guest RAM. */
        static const char *const headless[] = { "-vga", "none", NULL };
        const char *with_fs[] = { "-vga", "none", "-chardev", NULL, "-device",
                                  "vhost-user-fs-pci,chardev=c0,tag=pf", NULL };
        PfGuestSpec spec = { gname, pf ? d->agent_sock : NULL, ram_mib, mib, i + 1,
                             seconds + 60, 5, FALSE, FALSE, headless, NULL };

        if (vfs) {
            g_autofree char *binary = pf_test_qemu_tool("virtiofsd");

            fsd[i] = pf_virtiofsd_start(binary);
            vfs_pid[i] = atoi(g_subprocess_get_identifier(fsd[i]->proc));
            chardev = g_strdup_printf("socket,id=c0,path=%s", fsd[i]->sock);
            with_fs[3] = chardev;
            spec.extra = with_fs;
            spec.cmdline = "pfguest.virtiofs=16 pfguest.virtiofs_pause_ms=1000";
        }
        g[i] = pf_test_guest_start(&spec);
    }
    for (int i = 0; i < n_guests; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 300));
    }
    /* Each guest's first full check, undisturbed: the baseline. */
    for (int i = 0; i < n_guests; i++) {
        char *line = pf_test_guest_expect(g[i], "PFGUEST CHECK ok", 120);
        double v = g_ascii_strtod(strstr(line, "differ, ") + 8, NULL);

        g_array_append_val(before, v);
        g_free(line);
    }
    for (int i = 0; i < n_guests; i++) {
        /* A virtiofsd's share of the guest RAM it maps is in its Pss. */
        pss0 += pf_test_rollup_kib(g[i]->pid, "Pss") +
                (vfs ? pf_test_rollup_kib(vfs_pid[i], "Pss") : 0);
        agent0 += pf ? agent_cpu_s(g[i]->pid) : 0;
    }
    cpu0 += agent0;
    pss0 += pf ? pf_test_rollup_kib(daemon_pid, "Pss") : 0;
    cpu0 += dedup_cpu_s(pf ? daemon_stat : NULL, ksm ? ksm_stat : NULL);

    if (pf) {
        JsonNode *n = pf_test_ctl_json(d, "set", "run", "1", NULL);

        json_node_unref(n);
    }
    if (!ksm) {
        /* However the host had it: pagefold's runs alone are without. */
        ksm_set("run", "0");
    } else {
        g_autofree char *pts = g_strdup_printf("%u", pages_to_scan);

        ksm_set("pages_to_scan", pts);
        ksm_set("sleep_millisecs", "20");
        ksm_set("run", "1");
    }
    t0 = bench_now();
    while (bench_now() - t0 < seconds) {
        double pss = 0, c = 0, ac = 0, now_s = bench_now() - t0, save;

        for (int i = 0; i < n_guests; i++) {
            pss += pf_test_rollup_kib(g[i]->pid, "Pss") +
                   (vfs ? pf_test_rollup_kib(vfs_pid[i], "Pss") : 0);
            ac += pf ? agent_cpu_s(g[i]->pid) : 0;
        }
        c = ac;
        ac -= agent0;
        g_array_append_val(agent_cpu, ac);
        pss += pf ? pf_test_rollup_kib(daemon_pid, "Pss") : 0;
        c += dedup_cpu_s(pf ? daemon_stat : NULL, ksm ? ksm_stat : NULL);
        save = (pss0 - pss) / 1024.0;
        c -= cpu0;
        g_array_append_val(t, now_s);
        g_array_append_val(saving, save);
        g_array_append_val(cpu, c);
        drain_checks(g, n_guests, after);
        g_usleep(250000);
    }
    final = g_array_index(saving, double, saving->len - 1);
    res.saved_mib = final;
    res.net_mib = final - (ksm ? ksm_metadata_mib() : 0);
    /* What the host holds at the end, the deduplicator's own memory
     * included, as the kernel-build benchmark counts it. */
    res.start_mib = pss0 / 1024.0;
    res.used_mib = res.start_mib - res.net_mib;
    res.t90_s = -1;
    for (guint k = 0; k < saving->len; k++) {
        if (g_array_index(saving, double, k) >= 0.9 * final) {
            res.t90_s = g_array_index(t, double, k);
            res.cpu90_s = g_array_index(cpu, double, k);
            res.agent90_s = g_array_index(agent_cpu, double, k);
            break;
        }
    }
    res.slowdown = median_of(after) / median_of(before);
    if (g_getenv("PAGEFOLD_BENCH_SMAPS") != NULL) {
        dump_pss(name, g, n_guests, (guint64)ram_mib << 20, daemon_pid, ksm);
        if (pf) {
            JsonNode *q = pf_test_guest_qmp(g[0], "x-query-pagefold", NULL);
            g_autofree char *text = json_to_string(q, FALSE);
            JsonNode *st = pf_test_ctl_json(d, "stats", NULL);
            g_autofree char *stext = json_to_string(st, FALSE);

            printf("# %s agent: %s\n# pagefoldd stats: %s\n", g[0]->name, text, stext);
            json_node_unref(q);
            json_node_unref(st);
        }
    }
    if (ksm) {
        ksm_set("run", "2");
    }
    for (int i = 0; vfs && i < n_guests; i++) {
        double kib[PSS_KINDS] = { 0 };

        res.fold_backs_per_s += pf_test_guest_agent_stat(g[i], "backend-fold-backs") /
                                (bench_now() - t0);
        pss_by_kind(vfs_pid[i], (guint64)ram_mib << 20, kib);
        for (int k = PSS_POOL; k < PSS_KINDS; k++) {
            res.backends_own_mib += kib[k] / 1024.0;
        }
    }
    for (int i = 0; i < n_guests; i++) {
        double kib[PSS_KINDS] = { 0 };

        pss_by_kind(g[i]->pid, (guint64)ram_mib << 20, kib);
        res.tcg_mib += kib[PSS_TCG] / 1024.0;
    }
    for (int i = 0; i < n_guests; i++) {
        pf_test_guest_free(g[i]);
        if (fsd[i] != NULL) {
            pf_virtiofsd_free(fsd[i]);
        }
    }
    return res;
}

/* The median of one field over a system's runs. */
static double
median_field(const Result *runs, int n, gsize offset)
{
    g_autofree double *v = g_new(double, MAX(n, 1));

    for (int k = 0; k < n; k++) {
        v[k] = *(const double *)((const char *)&runs[k] + offset);
    }
    return n ? bench_median(v, n) : -1;
}

/* One run ("run":K) or a system's medians ("median_of":N). */
static void
print_json(const Result *r, const char *what, int k, int n, int mib)
{
    printf("{\"bench\":\"qemu\",\"system\":\"%s\",\"%s\":%d,\"guests\":%d,\"fill_mib\":%d,"
           "\"start_mib\":%.1f,\"freed_mib\":%.1f,\"freed_net_mib\":%.1f,\"used_mib\":%.1f,"
           "\"t90_s\":%.2f,\"cpu_to_90_s\":%.2f,\"agent_cpu_to_90_s\":%.2f,"
           "\"guest_slowdown\":%.2f,\"fold_backs_per_s\":%.1f,\"backends_own_mib\":%.1f,"
           "\"tcg_mib\":%.1f}\n",
           r->name, what, k, n, mib, r->start_mib, r->saved_mib, r->net_mib, r->used_mib,
           r->t90_s, r->cpu90_s, r->agent90_s, r->slowdown, r->fold_backs_per_s,
           r->backends_own_mib, r->tcg_mib);
    fflush(stdout);
}

static void
print_csv(const char *label, const Result *r, int n, int mib)
{
    printf("%s,%d,%d,%.1f,%.1f,%.1f,%.1f,%.2f,%.2f,%.2f,%.2f,%.1f,%.1f,%.1f\n", label, n, mib,
           r->start_mib, r->saved_mib, r->net_mib, r->used_mib, r->t90_s, r->cpu90_s,
           r->agent90_s, r->slowdown, r->fold_backs_per_s, r->backends_own_mib, r->tcg_mib);
}

/* KSM's knobs as found, put back however the run ends: meson's timeout
 * and Ctrl-C end it by a signal. */
static const char *const ksm_knobs[3] = { "pages_to_scan", "sleep_millisecs", "run" };
static char *ksm_found[3], *ksm_paths[3];
static size_t ksm_found_len[3];

static void
ksm_remember(void)
{
    for (int i = 0; i < 3; i++) {
        ksm_found[i] = ksm_get(ksm_knobs[i]);
        ksm_found_len[i] = strlen(ksm_found[i]);
        ksm_paths[i] = g_strdup_printf("/sys/kernel/mm/ksm/%s", ksm_knobs[i]);
    }
}

static void
ksm_restore(void)
{
    for (int i = 0; i < 3; i++) {
        ksm_set(ksm_knobs[i], ksm_found[i]);
    }
}

static void
on_signal(int sig)
{
    /* What a signal handler may call: open(2), write(2), close(2). */
    for (int i = 0; i < 3; i++) {
        int fd = open(ksm_paths[i], O_WRONLY | O_CLOEXEC);

        if (fd >= 0) {
            ssize_t unused G_GNUC_UNUSED = write(fd, ksm_found[i], ksm_found_len[i]);

            close(fd);
        }
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

int
main(int argc, char **argv)
{
    int n = g_getenv("PAGEFOLD_BENCH_GUESTS") ? atoi(g_getenv("PAGEFOLD_BENCH_GUESTS")) : 4;
    int mib = g_getenv("PAGEFOLD_BENCH_MIB") ? atoi(g_getenv("PAGEFOLD_BENCH_MIB")) : 256;
    int reps = MIN(bench_reps(), 16);
    const char *only = g_getenv("PAGEFOLD_BENCH_ONLY");
    g_auto(GStrv) names = only ? g_strsplit(only, ",", -1) : NULL;
    const struct {
        const char *name;
        gboolean pf;
        guint pages_to_scan;
        gboolean vfs;
        int seconds;
    } systems[] = {
        { "pagefold", TRUE, 0, FALSE, 30 }, { "ksm-5000", FALSE, 5000, FALSE, 45 },
        { "ksm-1000", FALSE, 1000, FALSE, 60 }, { "ksm-100", FALSE, 100, FALSE, 200 },
        /* As a host runs both: kernel KSM at its defaults for what is not
         * guest RAM (QEMU's smaller RAM blocks, marked mergeable). */
        { "pagefold+ksm-100", TRUE, 100, FALSE, 30 },
        { "pagefold+virtiofs", TRUE, 0, TRUE, 30 },
    };
    /* runs[i * reps + k]: system i's run k. */
    Result runs[G_N_ELEMENTS(systems) * 16];
    Result med[G_N_ELEMENTS(systems)];
    gboolean ran[G_N_ELEMENTS(systems)] = { FALSE };

    if (!pf_guest_available()) {
        printf("{\"bench\":\"qemu\",\"skipped\":\"QEMU_BINARY, GUEST_KERNEL, GUEST_INITRD unset\"}\n");
        return 0;
    }
    n = CLAMP(n, 1, 8);
    /* Whole names, blanks around them ignored: ksm-100 is not ksm-1000. */
    for (int j = 0; names != NULL && names[j] != NULL; j++) {
        gsize i;

        g_strstrip(names[j]);
        for (i = 0; i < G_N_ELEMENTS(systems) && !g_str_equal(names[j], systems[i].name); i++) {
        }
        if (i == G_N_ELEMENTS(systems)) {
            fprintf(stderr, "bench-qemu: PAGEFOLD_BENCH_ONLY: no system \"%s\" (pagefold, "
                            "ksm-5000, ksm-1000, ksm-100, pagefold+ksm-100, "
                            "pagefold+virtiofs)\n", names[j]);
            return 2;
        }
        ran[i] = TRUE;
    }
    for (gsize i = 0; names == NULL && i < G_N_ELEMENTS(systems); i++) {
        ran[i] = TRUE;
    }
    ksm_remember();
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    /* Alternating: every system once per round, so that whatever else the
     * host does over the run falls on all of them alike. */
    for (int k = 0; k < reps; k++) {
        for (gsize i = 0; i < G_N_ELEMENTS(systems); i++) {
            Result *r = &runs[i * reps + k];

            if (ran[i]) {
                *r = run_system(systems[i].name, systems[i].pf, systems[i].pages_to_scan,
                                systems[i].vfs, n, mib, systems[i].seconds);
                print_json(r, "run", k + 1, n, mib);
            }
        }
    }
    ksm_restore();
    for (gsize i = 0; i < G_N_ELEMENTS(systems); i++) {
        const Result *r = &runs[i * reps];

        if (!ran[i]) {
            continue;
        }
        med[i] = (Result){ 0 };
        g_strlcpy(med[i].name, systems[i].name, sizeof(med[i].name));
#define MEDIAN(field) med[i].field = median_field(r, reps, G_STRUCT_OFFSET(Result, field))
        MEDIAN(start_mib);
        MEDIAN(saved_mib);
        MEDIAN(net_mib);
        MEDIAN(used_mib);
        MEDIAN(t90_s);
        MEDIAN(cpu90_s);
        MEDIAN(agent90_s);
        MEDIAN(slowdown);
        MEDIAN(fold_backs_per_s);
        MEDIAN(backends_own_mib);
        MEDIAN(tcg_mib);
#undef MEDIAN
        print_json(&med[i], "median_of", reps, n, mib);
    }
    /* Every run, then the medians, as CSV; the medians as a table for
     * people. */
    printf("\nsystem,guests,fill_mib,start_mib,freed_mib,freed_net_mib,used_mib,t90_s,"
           "cpu_to_90_s,agent_cpu_to_90_s,guest_slowdown,fold_backs_per_s,backends_own_mib,"
           "tcg_mib\n");
    for (gsize i = 0; i < G_N_ELEMENTS(systems); i++) {
        for (int k = 0; ran[i] && k < reps; k++) {
            g_autofree char *label = g_strdup_printf("%s#%d", systems[i].name, k + 1);

            print_csv(label, &runs[i * reps + k], n, mib);
        }
    }
    for (gsize i = 0; i < G_N_ELEMENTS(systems); i++) {
        g_autofree char *label = g_strdup_printf("%s(median)", systems[i].name);

        if (ran[i]) {
            print_csv(label, &med[i], n, mib);
        }
    }
    printf("\nmedians of %d alternating runs\n%-17s %9s %9s %9s %9s %8s %12s %12s %9s %8s\n",
           reps, "system", "start_MiB", "freed_MiB", "net_MiB", "held_MiB", "t90_s",
           "cpu_to_90_s", "agent_cpu_s", "slowdown", "tcg_MiB");
    for (gsize i = 0; i < G_N_ELEMENTS(systems); i++) {
        if (ran[i]) {
            printf("%-17s %9.1f %9.1f %9.1f %9.1f %8.2f %12.2f %12.2f %9.2f %8.1f\n",
                   med[i].name, med[i].start_mib, med[i].saved_mib, med[i].net_mib,
                   med[i].used_mib, med[i].t90_s, med[i].cpu90_s, med[i].agent90_s,
                   med[i].slowdown, med[i].tcg_mib);
        }
    }
    return 0;
}
