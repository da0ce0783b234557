/*
 * bench-hash.c - checksum cost per 4 KiB page for each --hash, hot (the
 * same few pages, in cache) and cold (one pass over 1 GiB, from memory).
 * Prints one JSON line per result: median of PAGEFOLD_BENCH_REPS runs.
 */
#include "bench-common.h"
#include "guestmem.h"
#include "hash.h"
#include "util.h"

#define COLD_PAGES (262144u) /* 1 GiB */
#define HOT_CALLS 200000u

int
main(int argc, char **argv)
{
    gsize n_algos;
    const PfHashAlgo *algos = pf_hash_all(&n_algos);
    guint8 *mem = g_malloc(COLD_PAGES * (gsize)PF_PAGE_SIZE);
    int reps = bench_reps();
    volatile guint64 sink = 0;

    for (gsize i = 0; i < COLD_PAGES; i++) {
        pf_fill_page(mem + i * PF_PAGE_SIZE, i + 1);
    }
    for (gsize a = 0; a < n_algos; a++) {
        g_autofree double *hot = g_new(double, reps);
        g_autofree double *cold = g_new(double, reps);

        for (int r = 0; r < reps; r++) {
            double t = bench_now();

            for (guint i = 0; i < HOT_CALLS; i++) {
                sink += algos[a].func(mem + (i & 3) * PF_PAGE_SIZE);
            }
            hot[r] = (bench_now() - t) * 1e9 / HOT_CALLS;
            t = bench_now();
            for (gsize i = 0; i < COLD_PAGES; i++) {
                sink += algos[a].func(mem + i * PF_PAGE_SIZE);
            }
            cold[r] = (bench_now() - t) * 1e9 / COLD_PAGES;
        }
        printf("{\"bench\":\"hash\",\"algo\":\"%s\",\"hot_ns_per_page\":%.1f,"
               "\"cold_ns_per_page\":%.1f,\"reps\":%d}\n",
               algos[a].name, bench_median(hot, reps), bench_median(cold, reps), reps);
    }
    {
        g_autofree double *z = g_new(double, reps);
        g_autofree guint8 *zero = g_malloc0(PF_PAGE_SIZE);

        for (int r = 0; r < reps; r++) {
            double t = bench_now();

            for (guint i = 0; i < HOT_CALLS; i++) {
                sink += pf_page_is_zero(zero);
            }
            z[r] = (bench_now() - t) * 1e9 / HOT_CALLS;
        }
        printf("{\"bench\":\"is-zero\",\"hot_ns_per_page\":%.1f,\"reps\":%d}\n",
               bench_median(z, reps), reps);
    }
    g_free(mem);
    return sink == 42;
}
