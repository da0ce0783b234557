/*
 * bench-virtiofs.c - virtiofs throughput in a merging guest against the
 * same guest unmerged, side by side in one run.  One TCG guest (384 MiB,
 * 128 MiB filled: half of it pages that merge) with a virtiofs share served
 * by the patched virtiofsd, which joins the merge
 * (VHOST_USER_PROTOCOL_F_MEM_FAULTS), writes 64-page files through the
 * share and reads each back, without pause, through its page cache and
 * with O_DIRECT by turns (pfguest.virtiofs).  pagefoldd merges the fill
 * during the warm-up (target_pass_millisecs 200), except for unmerged;
 * then, while the files are counted:
 *   unmerged:    nothing merges (run=0 all the while)
 *   still:       the fill stays merged, nothing more merges (run=0):
 *                virtiofsd's userfaultfd over merged memory, and no
 *                merges (its touches of merged pages would fold them
 *                back; these files are rewritten too often to merge)
 *   merged:      pagefoldd at its defaults, KSM's pace (pages_to_scan
 *                100, sleep_millisecs 20): virtiofsd's mappings are
 *                write-protected around each merge too
 *   merged-fast: target_pass_millisecs 200 still, pagefoldd's passes
 *                taking their CPU beside the guest's
 * Alternating, PAGEFOLD_BENCH_REPS runs of each (default 5), each
 * BENCH_VFS_SECONDS (30) of I/O after a warm-up.  Per run: the files
 * written and read back a second (64 pages each way), and the pages folded
 * back for virtiofsd a second.  One JSON line per run, then the medians
 * and the ratio of each system's throughput to the unmerged one's.
 * Needs root (virtiofsd's sandbox), QEMU_BINARY, GUEST_KERNEL,
 * GUEST_INITRD.
 */
#include <glib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench-common.h"
#include "testguest.h"
#include "testproc.h"

typedef struct {
    double files_per_s;
    double fold_backs_per_s;
    gint64 merged;
} Run;

/* The guest's virtiofs count in line ("PFGUEST VIRTIOFS writes=N ..."). */
static gulong
writes_of(const char *line)
{
    gulong w = 0;

    if (sscanf(line, "PFGUEST VIRTIOFS writes=%lu", &w) != 1) {
        g_error("not a virtiofs count: %s", line);
    }
    return w;
}

typedef enum { UNMERGED, STILL, MERGED, MERGED_FAST, N_SYSTEMS } System;

static const char *const system_names[N_SYSTEMS] = { "unmerged", "still", "merged",
                                                     "merged-fast" };

static Run
run_one(System sys, int seconds)
{
    g_autoptr(PfTestDaemon) d =
        pf_test_daemon_start("--set", sys == UNMERGED ? "run=0" : "run=1", "--set",
                             "target_pass_millisecs=200", NULL);
    g_autofree char *binary = pf_test_qemu_tool("virtiofsd");
    PfVirtiofsd *v = pf_virtiofsd_start(binary);
    g_autofree char *chardev = g_strdup_printf("socket,id=c0,path=%s", v->sock);
    g_autofree char *name = g_strdup_printf("vfs-%s", system_names[sys]);
    const char *extra[] = { "-vga", "none", "-chardev", chardev, "-device",
                            "vhost-user-fs-pci,chardev=c0,tag=pf", NULL };
    PfGuestSpec spec = { name, d->agent_sock, 384, 128, 1,
                         seconds + 120, 2, FALSE, FALSE, extra, "pfguest.virtiofs=64" };
    Guest *g = pf_test_guest_start(&spec);
    Run r = { 0 };
    char *line;
    gulong w0;
    gint64 fb0;
    double t0, t1;

    g_free(pf_test_guest_expect(g, "PFGUEST READY", 300));
    /* Warm-up: the files made, and the fill merged (until a check period
     * adds less than 1% to what merged). */
    for (int i = 0; i < 60; i++) {
        gint64 before = pf_test_guest_agent_merged(g), now;

        g_free(pf_test_guest_expect(g, "PFGUEST VIRTIOFS", 120));
        now = pf_test_guest_agent_merged(g);
        if (i >= 2 && (sys == UNMERGED || now - before < now / 100 + 1)) {
            break;
        }
    }
    if (sys == STILL) {
        json_node_unref(pf_test_ctl_json(d, "set", "run", "0", NULL));
    } else if (sys == MERGED) {
        json_node_unref(pf_test_ctl_json(d, "set", "target_pass_millisecs", "0", NULL));
    }
    line = pf_test_guest_expect(g, "PFGUEST VIRTIOFS", 120);
    t0 = bench_now();
    w0 = writes_of(line);
    g_free(line);
    fb0 = pf_test_guest_agent_stat(g, "backend-fold-backs");
    do {
        line = pf_test_guest_expect(g, "PFGUEST VIRTIOFS", 120);
        t1 = bench_now();
        r.files_per_s = (double)(writes_of(line) - w0) / (t1 - t0);
        g_free(line);
    } while (t1 - t0 < seconds);
    r.fold_backs_per_s =
        (double)(pf_test_guest_agent_stat(g, "backend-fold-backs") - fb0) / (t1 - t0);
    r.merged = pf_test_guest_agent_merged(g);
    g_free(pf_test_guest_expect(g, "PFGUEST CHECK ok", 120));
    pf_test_guest_free(g);
    pf_virtiofsd_free(v);
    return r;
}

int
main(int argc, char **argv)
{
    int reps = MIN(bench_reps(), 16);
    int seconds = g_getenv("BENCH_VFS_SECONDS") ? atoi(g_getenv("BENCH_VFS_SECONDS")) : 30;
    g_autofree char *binary = NULL;
    double fps[N_SYSTEMS][16], fbs[N_SYSTEMS][16];
    double med[N_SYSTEMS], med_fb[N_SYSTEMS];

    if (!pf_guest_available() || geteuid() != 0) {
        printf("{\"bench\":\"virtiofs\",\"skipped\":\"needs root, QEMU_BINARY, GUEST_KERNEL, "
               "GUEST_INITRD\"}\n");
        return 0;
    }
    binary = pf_test_qemu_tool("virtiofsd");
    if (!g_file_test(binary, G_FILE_TEST_IS_EXECUTABLE)) {
        printf("{\"bench\":\"virtiofs\",\"skipped\":\"scripts/build-qemu built no virtiofsd\"}\n");
        return 0;
    }
    for (int k = 0; k < reps; k++) {
        for (int m = 0; m < N_SYSTEMS; m++) {
            Run r = run_one((System)m, seconds);

            fps[m][k] = r.files_per_s;
            fbs[m][k] = r.fold_backs_per_s;
            printf("{\"bench\":\"virtiofs\",\"system\":\"%s\",\"run\":%d,\"seconds\":%d,"
                   "\"files_per_s\":%.2f,\"fold_backs_per_s\":%.1f,\"merged_pages\":%"
                   G_GINT64_FORMAT "}\n", system_names[m], k + 1, seconds, r.files_per_s,
                   r.fold_backs_per_s, r.merged);
            fflush(stdout);
        }
    }
    for (int m = 0; m < N_SYSTEMS; m++) {
        med[m] = bench_median(fps[m], reps);
        med_fb[m] = bench_median(fbs[m], reps);
    }
    if (med[UNMERGED] <= 0) {
        g_error("the unmerged guest wrote no file");
    }
    for (int m = 0; m < N_SYSTEMS; m++) {
        printf("{\"bench\":\"virtiofs\",\"system\":\"%s\",\"median_of\":%d,"
               "\"files_per_s\":%.2f,\"over_unmerged\":%.3f,\"fold_backs_per_s\":%.1f}\n",
               system_names[m], reps, med[m], med[m] / med[UNMERGED], med_fb[m]);
    }
    printf("\nmedians of %d alternating runs\n%-12s %12s %14s %14s\n", reps, "system",
           "files/s", "over_unmerged", "fold-backs/s");
    for (int m = 0; m < N_SYSTEMS; m++) {
        printf("%-12s %12.2f %14.3f %14.1f\n", system_names[m], med[m], med[m] / med[UNMERGED],
               med_fb[m]);
    }
    return 0;
}
