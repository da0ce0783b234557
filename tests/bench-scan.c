/*
 * bench-scan.c - full-pass scan throughput on one core over 1 GiB of
 * guest-like memory (two 512 MiB stand-in guests held by child processes:
 * 50% identical across them, 20% zero, 1% rewritten between passes), next
 * to a plain sequential read of the same memory in the same run.  Also the
 * metadata bytes per tracked page.  One JSON line per result (medians).
 */
#include "bench-common.h"
#include "guestmem.h"
#include "jobs.h"
#include "scan.h"
#include "util.h"

#define GUEST_PAGES 131072u /* 512 MiB */

typedef guint64 v4u64 __attribute__((vector_size(32)));

/* The reference: every byte read once, sequentially, nothing else; AVX2
 * with four accumulators was the fastest plain read found here. */
__attribute__((target("avx2"))) static guint64
plain_read_avx2(const v4u64 *p, gsize n)
{
    v4u64 a = { 0 }, b = { 0 }, c = { 0 }, d = { 0 };

    for (gsize i = 0; i + 3 < n; i += 4) {
        a ^= p[i];
        b ^= p[i + 1];
        c ^= p[i + 2];
        d ^= p[i + 3];
    }
    a ^= b ^ c ^ d;
    return a[0] ^ a[1] ^ a[2] ^ a[3];
}

static guint64
plain_read(PfScanner *s)
{
    GPtrArray *vms = pf_scanner_get_vms(s);
    guint64 acc = 0;

    for (guint v = 0; v < vms->len; v++) {
        PfVm *vm = g_ptr_array_index(vms, v);

        for (guint k = 0; k < vm->regions->len; k++) {
            PfRegion *r = g_ptr_array_index(vm->regions, k);

            acc ^= plain_read_avx2((const v4u64 *)r->map, r->size / sizeof(v4u64));
        }
    }
    return acc;
}

/* The checksum alone over the same memory: the floor under a pass. */
static guint64
hash_only(PfScanner *s)
{
    GPtrArray *vms = pf_scanner_get_vms(s);
    PfHashFunc hash = pf_scanner_get_hash(s)->func;
    guint64 acc = 0;

    for (guint v = 0; v < vms->len; v++) {
        PfVm *vm = g_ptr_array_index(vms, v);

        for (guint k = 0; k < vm->regions->len; k++) {
            PfRegion *r = g_ptr_array_index(vm->regions, k);

            for (gsize i = 0; i < r->n_pages; i++) {
                acc ^= hash(r->map + i * PF_PAGE_SIZE);
            }
        }
    }
    return acc;
}

static double
time_pass(PfScanner *s, PfGuest **g)
{
    double t;

    pf_guest_churn(g[0]);
    pf_guest_churn(g[1]);
    t = bench_now();
    pf_scan_job_run_passes_wait(s, 1);
    return bench_now() - t;
}

int
main(int argc, char **argv)
{
    PfLayout l = { 0 };
    PfGuest *g[2];
    int pid[2];
    int reps = bench_reps();
    g_autoptr(PfScanner) s = pf_scanner_new(NULL);
    g_autofree double *read_s = g_new(double, reps);
    g_autofree double *scan_s = g_new(double, reps);
    g_autofree double *hash_s = g_new(double, reps);
    g_autofree double *smart_s = g_new(double, reps);
    PfCounters total, per[2];
    PfScanInfo info0, info1;
    double bytes, read_gibs, scan_gibs, smart_gibs;
    volatile guint64 sink = 0;

    l.identical = GUEST_PAGES / 2;
    l.zero = GUEST_PAGES / 5;
    l.volatile_ = GUEST_PAGES / 100;
    l.unique = GUEST_PAGES - l.identical - l.zero - l.volatile_;
    for (int i = 0; i < 2; i++) {
        g[i] = pf_guest_new("memory-backend-memfd", &l, (guint32)i + 1);
        pid[i] = pf_guest_hold(g[i]);
    }
    for (int i = 0; i < 2; i++) {
        g_autoptr(GError) error = NULL;
        PfVm *vm = pf_vm_attach(pid[i], i ? "b" : "a", &error);

        g_assert_no_error(error);
        pf_scanner_add_vm(s, vm);
    }

    /* Every page hashed at every visit: smart scan off. */
    pf_scanner_get_knobs(s)->smart_scan = FALSE;
    pf_scan_job_run_passes_wait(s, 2);
    pf_scanner_get_info(s, &info0);
    for (int r = 0; r < reps; r++) {
        double t = bench_now();

        sink += plain_read(s);
        read_s[r] = bench_now() - t;
        t = bench_now();
        sink += hash_only(s);
        hash_s[r] = bench_now() - t;
        scan_s[r] = time_pass(s, g);
        if (g_getenv("PAGEFOLD_BENCH_VERBOSE")) {
            g_printerr("read %.1f ms, hash %.1f ms, scan %.1f ms\n", read_s[r] * 1e3,
                       hash_s[r] * 1e3, scan_s[r] * 1e3);
        }
    }
    pf_scanner_get_info(s, &info1);
    pf_scanner_collect(s, &total, per);
    bytes = (double)total.pages_tracked * PF_PAGE_SIZE;
    read_gibs = bytes / bench_median(read_s, reps) / (1 << 30);
    scan_gibs = bytes / bench_median(scan_s, reps) / (1 << 30);
    printf("{\"bench\":\"scan\",\"smart_scan\":0,\"gib\":%.2f,\"read_gib_per_s\":%.2f,"
           "\"hash_only_gib_per_s\":%.2f,\"scan_gib_per_s\":%.2f,\"scan_to_read\":%.2f,"
           "\"pass_ms\":%.1f,\"memcmp_per_pass\":%.0f,\"reps\":%d}\n",
           bytes / (1 << 30), read_gibs, bytes / bench_median(hash_s, reps) / (1 << 30),
           scan_gibs, scan_gibs / read_gibs,
           bench_median(scan_s, reps) * 1e3,
           (double)(info1.memcmp_calls - info0.memcmp_calls) / reps, reps);

    /* Steady state with smart scan, as pagefoldd runs by default. */
    pf_scanner_get_knobs(s)->smart_scan = TRUE;
    for (int r = 0; r < 8; r++) {
        time_pass(s, g);
    }
    for (int r = 0; r < reps; r++) {
        smart_s[r] = time_pass(s, g);
    }
    smart_gibs = bytes / bench_median(smart_s, reps) / (1 << 30);
    pf_scanner_collect(s, &total, per);
    printf("{\"bench\":\"scan\",\"smart_scan\":1,\"gib\":%.2f,\"scan_gib_per_s\":%.2f,"
           "\"pass_ms\":%.1f,\"reps\":%d}\n",
           bytes / (1 << 30), smart_gibs, bench_median(smart_s, reps) * 1e3, reps);
    printf("{\"bench\":\"metadata\",\"pages_tracked\":%" G_GUINT64_FORMAT
           ",\"record_bytes\":%zu,\"metadata_bytes\":%" G_GUINT64_FORMAT
           ",\"bytes_per_tracked_page\":%.2f,\"ksm_rmap_item_bytes\":64,"
           "\"pages_shared\":%" G_GUINT64_FORMAT ",\"pages_sharing\":%" G_GUINT64_FORMAT
           ",\"zero_pages\":%" G_GUINT64_FORMAT "}\n",
           total.pages_tracked, sizeof(PfPage), total.metadata_bytes,
           (double)total.metadata_bytes / (double)total.pages_tracked, total.pages_shared,
           total.pages_sharing, total.zero_pages);

    for (int i = 0; i < 2; i++) {
        pf_guest_release(pid[i]);
        pf_guest_free(g[i]);
    }
    return sink == 42;
}
