/*
 * bench-common.h - helpers for the benchmarks: timing, medians, and one
 * machine-readable JSON object per result line on stdout.
 */
#pragma once

#include <glib.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static inline double
bench_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int
bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static inline double
bench_median(double *v, gsize n)
{
    qsort(v, n, sizeof(double), bench_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Repetitions, from PAGEFOLD_BENCH_REPS (default 5). */
static inline int
bench_reps(void)
{
    const char *e = g_getenv("PAGEFOLD_BENCH_REPS");
    int n = e ? atoi(e) : 5;

    return n > 0 ? n : 5;
}
