/*
 * bench-virtiofs.c - virtiofs throughput in a merging guest against the
 * same guest unmerged, side by side in one run.  One TCG guest (384 MiB,
 * 128 MiB filled: half of it pages that merge) with a virtiofs share served
 * by the patched virtiofsd, which joins the merge
 * (VHOST_USER_PROTOCOL_F_MEM_FAULTS), writes 64-page files through the
 * share and reads each back, without pause, through its page cache and
 * with O_DIRECT by turns (pfguest.virtiofs):
 *   merged:   pagefoldd merging all the while (target_pass_millisecs 200):
 *             virtiofsd's mappings are write-protected around each merge,
 *             and its touches of merged pages fold them back
 *   unmerged: the same guest and pagefoldd, with run=0: nothing merges
 * Alternating, PAGEFOLD_BENCH_REPS runs of each (default 5), each
 * BENCH_VFS_SECONDS (30) of I/O after a warm-up.  Per run: the files
 * written and read back a second (64 pages each way), and the pages folded
 * back for virtiofsd a second.  One JSON line per run, then the medians
 * and the ratio of the merged guest's throughput to the unmerged one's.
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

static Run
run_one(gboolean merge, int seconds)
{
    g_autoptr(PfTestDaemon) d =
        pf_test_daemon_start("--set", merge ? "run=1" : "run=0", "--set",
                             "target_pass_millisecs=200", NULL);
    g_autofree char *binary = pf_test_qemu_tool("virtiofsd");
    PfVirtiofsd *v = pf_virtiofsd_start(binary);
    g_autofree char *chardev = g_strdup_printf("socket,id=c0,path=%s", v->sock);
    const char *extra[] = { "-vga", "none", "-chardev", chardev, "-device",
                            "vhost-user-fs-pci,chardev=c0,tag=pf", NULL };
    PfGuestSpec spec = { merge ? "vfs-merged" : "vfs-unmerged", d->agent_sock, 384, 128, 1,
                         seconds + 120, 2, FALSE, FALSE, extra, "pfguest.virtiofs=64" };
    Guest *g = pf_test_guest_start(&spec);
    Run r = { 0 };
    char *line;
    gulong w0;
    gint64 fb0;
    double t0, t1;

    g_free(pf_test_guest_expect(g, "PFGUEST READY", 300));
    /* Warm-up: the fill merged (merge), the files made. */
    for (int i = 0; i < 3; i++) {
        g_free(pf_test_guest_expect(g, "PFGUEST VIRTIOFS", 120));
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
    r.merged = pf_test_guest_agent_stat(g, "merged") + pf_test_guest_agent_stat(g, "zeroed");
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
    double fps[2][16], fbs[2][16];
    double med[2], med_fb;

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
        for (int m = 0; m < 2; m++) {
            Run r = run_one(m == 0, seconds);

            fps[m][k] = r.files_per_s;
            fbs[m][k] = r.fold_backs_per_s;
            printf("{\"bench\":\"virtiofs\",\"guest\":\"%s\",\"run\":%d,\"seconds\":%d,"
                   "\"files_per_s\":%.2f,\"fold_backs_per_s\":%.1f,\"merged_pages\":%"
                   G_GINT64_FORMAT "}\n", m == 0 ? "merged" : "unmerged", k + 1, seconds,
                   r.files_per_s, r.fold_backs_per_s, r.merged);
            fflush(stdout);
        }
    }
    for (int m = 0; m < 2; m++) {
        med[m] = bench_median(fps[m], reps);
    }
    med_fb = bench_median(fbs[0], reps);
    printf("{\"bench\":\"virtiofs\",\"median_of\":%d,\"merged_files_per_s\":%.2f,"
           "\"unmerged_files_per_s\":%.2f,\"merged_over_unmerged\":%.3f,"
           "\"fold_backs_per_s\":%.1f}\n", reps, med[0], med[1], med[0] / med[1], med_fb);
    return 0;
}
