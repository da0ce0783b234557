/*
 * cpu-use.h - pagefoldd's main-thread CPU time and minor faults, charged
 * to what the thread was doing when it spent them (a stack of marks: the
 * innermost is charged).  For `pagefoldctl stats` and the benchmarks, so
 * that the daemon's cost per page can be taken apart on hosts where no
 * profiler can be trusted.  Reads the thread's usage and nothing else:
 * it never changes what the code it measures does.
 */
#pragma once

#include <glib.h>

typedef enum {
    PF_CPU_LOOP,     /* GLib's loop (poll(), timers, dispatch) and unmarked code */
    PF_CPU_SCAN,     /* the cursor's walk: passes, VMs entered, windows taken up, joins */
    PF_CPU_VISITS,   /* guest pages read, checksummed and sought in the trees */
    PF_CPU_MINCORE,  /* mincore() before each run of pages read */
    PF_CPU_REQUESTS, /* requests encoded and sent to agents */
    PF_CPU_ANSWERS,  /* agents' messages read and acted on */
    PF_CPU_JOBS,     /* the steps of control commands' jobs */
    PF_CPU_CONTROL,  /* commands run, and the counters published every second */
    PF_CPU_COUNTING, /* the marks' own cost, taken out of the others' (never entered) */
    PF_CPU_N
} PfCpuUse;

/* The calling thread's CPU time so far, in nanoseconds: what the marks
 * read, and what the scanner's pacing measures a batch by. */
guint64 pf_thread_cpu_nsec(void);

/* Counting on or off (the cpu_use knob); the thread that turns it on is
 * the one counted.  Off, a mark costs a test. */
void pf_cpu_use_set(gboolean on);

/* A mark: what follows, until the matching leave, is charged to use.
 * Marks nest. */
void pf_cpu_enter(PfCpuUse use);
void pf_cpu_leave(void);

/* The marks open now, for pf_cpu_unwind() after a siglongjmp() jumped
 * out of some. */
guint pf_cpu_depth(void);
void pf_cpu_unwind(guint depth);

/* Totals so far, any thread: the time, the minor faults, and the spans
 * between two readings charged (for the loop: about its iterations; for
 * counting: every reading). */
const char *pf_cpu_use_name(PfCpuUse use);
void pf_cpu_read(guint64 usec[PF_CPU_N], guint64 minflt[PF_CPU_N], guint64 spans[PF_CPU_N]);
