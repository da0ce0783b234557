/*
 * cpu-use.c - the marks of cpu-use.h.  Each mark reads the thread's CPU
 * clock (CLOCK_THREAD_CPUTIME_ID, exact to the nanosecond) and its minor
 * faults (getrusage(RUSAGE_THREAD), whose CPU times are not used: they
 * move only at scheduler ticks and switches, so a part would be charged
 * for time spent before it ran), about a microsecond together, and
 * charges what was spent since the last mark to the mark innermost then,
 * less what a reading costs (measured when counting starts): each span
 * between two readings holds one reading's cost, the end of one and the
 * start of the next, which goes to PF_CPU_COUNTING instead.  Marks are
 * placed where the main loop hands control to a part and around each run
 * of pages read (a few hundred to a few thousand a second), never per
 * page: too many to leave on, hence the knob.  Writes its totals only
 * from the owning thread; never blocks.
 */
#include "cpu-use.h"

#include <sys/resource.h>
#include <time.h>

#define MAX_DEPTH 16

static gboolean counting;
static GThread *owner;
static PfCpuUse stack[MAX_DEPTH];
static guint depth, overflow;
static guint64 last_nsec, last_minflt;
static guint64 reading_nsec; /* what one reading costs, measured at the start */
static guint64 used_nsec[PF_CPU_N], used_minflt[PF_CPU_N], used_spans[PF_CPU_N];

static const char *const names[PF_CPU_N] = {
    [PF_CPU_LOOP] = "loop",         [PF_CPU_SCAN] = "scan",
    [PF_CPU_VISITS] = "visits",     [PF_CPU_MINCORE] = "mincore",
    [PF_CPU_REQUESTS] = "requests", [PF_CPU_ANSWERS] = "answers",
    [PF_CPU_JOBS] = "jobs",         [PF_CPU_CONTROL] = "control",
    [PF_CPU_COUNTING] = "counting",
};

guint64
pf_thread_cpu_nsec(void)
{
    struct timespec ts;

    /* Cannot fail for the calling thread's own clock. */
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (guint64)ts.tv_sec * 1000000000u + (guint64)ts.tv_nsec;
}

/* The thread's usage now; FALSE where it is not counted. */
static gboolean
usage(guint64 *nsec, guint64 *minflt)
{
    struct rusage ru;

    /* Read on any thread: a mark off the owner's is a test and no more. */
    if (!__atomic_load_n(&counting, __ATOMIC_RELAXED) ||
        __atomic_load_n(&owner, __ATOMIC_RELAXED) != g_thread_self()) {
        return FALSE;
    }
    *nsec = pf_thread_cpu_nsec();
    if (getrusage(RUSAGE_THREAD, &ru) < 0) {
        return FALSE;
    }
    *minflt = (guint64)ru.ru_minflt;
    return TRUE;
}

void
pf_cpu_use_set(gboolean on)
{
    if (on == counting) {
        return;
    }
    /* Marks open when it turns on or off are forgotten: what they hold
     * goes to the loop. */
    depth = overflow = 0;
    __atomic_store_n(&owner, g_thread_self(), __ATOMIC_RELAXED);
    __atomic_store_n(&counting, on, __ATOMIC_RELAXED);
    if (on) {
        guint64 first = 0, minflt;
        gboolean ok = usage(&first, &minflt);

        /* The cheapest of 64 readings' cost (a reading cut short by
         * another task, as on a busy host, is not one's cost). */
        reading_nsec = G_MAXUINT64;
        for (int i = 0; ok && i < 64; i++) {
            ok = usage(&last_nsec, &last_minflt);
            reading_nsec = MIN(reading_nsec, last_nsec - MIN(last_nsec, first));
            first = last_nsec;
        }
        if (!ok) {
            __atomic_store_n(&counting, FALSE, __ATOMIC_RELAXED);
        }
    }
}

/* Charges what was spent since the last mark; FALSE where not counted. */
static gboolean
charge(void)
{
    PfCpuUse use = depth == 0 ? PF_CPU_LOOP : stack[depth - 1];
    guint64 nsec, minflt, span, own;

    if (!usage(&nsec, &minflt)) {
        return FALSE;
    }
    span = nsec - MIN(nsec, last_nsec);
    own = MIN(span, reading_nsec);
    __atomic_add_fetch(&used_nsec[use], span - own, __ATOMIC_RELAXED);
    __atomic_add_fetch(&used_nsec[PF_CPU_COUNTING], own, __ATOMIC_RELAXED);
    __atomic_add_fetch(&used_spans[use], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&used_spans[PF_CPU_COUNTING], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&used_minflt[use], minflt - MIN(minflt, last_minflt), __ATOMIC_RELAXED);
    last_nsec = nsec;
    last_minflt = minflt;
    return TRUE;
}

void
pf_cpu_enter(PfCpuUse use)
{
    if (!charge()) {
        return;
    }
    if (depth < MAX_DEPTH) {
        stack[depth++] = use;
    } else {
        overflow++;
    }
}

void
pf_cpu_leave(void)
{
    if (!charge()) {
        return;
    }
    if (overflow > 0) {
        overflow--;
    } else if (depth > 0) {
        depth--;
    }
}

guint
pf_cpu_depth(void)
{
    return __atomic_load_n(&counting, __ATOMIC_RELAXED) &&
                   __atomic_load_n(&owner, __ATOMIC_RELAXED) == g_thread_self()
               ? depth + overflow
               : 0;
}

void
pf_cpu_unwind(guint to)
{
    while (pf_cpu_depth() > to) {
        pf_cpu_leave();
    }
}

const char *
pf_cpu_use_name(PfCpuUse use)
{
    return use < PF_CPU_N ? names[use] : NULL;
}

void
pf_cpu_read(guint64 usec[PF_CPU_N], guint64 minflt[PF_CPU_N], guint64 spans[PF_CPU_N])
{
    for (guint i = 0; i < PF_CPU_N; i++) {
        usec[i] = __atomic_load_n(&used_nsec[i], __ATOMIC_RELAXED) / 1000;
        minflt[i] = __atomic_load_n(&used_minflt[i], __ATOMIC_RELAXED);
        spans[i] = __atomic_load_n(&used_spans[i], __ATOMIC_RELAXED);
    }
}
