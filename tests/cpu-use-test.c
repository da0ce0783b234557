/*
 * cpu-use-test.c - daemon/cpu-use.c's marks: time and faults go to the
 * innermost mark open when they were spent, marks made on another thread
 * than the one that turned counting on are not counted, nor any once it
 * is off, an unwind closes what a siglongjmp() jumped out of, and the
 * marks' own cost is told apart.  CPU is burnt by the thread's own clock, so
 * a busy machine only makes the test take longer.
 */
#include <glib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu-use.h"

#define BURN_USEC 30000

static void
burn(guint64 usec)
{
    guint64 end = pf_thread_cpu_nsec() + usec * 1000;

    while (pf_thread_cpu_nsec() < end) {
    }
}

/* Faults in n pages never touched before; they stay mapped (leaked) so
 * that no later mapping reuses them already populated. */
static void
fault_pages(gsize n)
{
    volatile char *p = mmap(NULL, n * 4096, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

    g_assert_true(p != MAP_FAILED);
    for (gsize i = 0; i < n; i++) {
        p[i * 4096] = 1;
    }
}

typedef struct {
    guint64 usec[PF_CPU_N], minflt[PF_CPU_N], spans[PF_CPU_N];
} Reading;

static Reading
reading(void)
{
    Reading r;

    pf_cpu_read(r.usec, r.minflt, r.spans);
    return r;
}

static void
test_innermost(void)
{
    Reading a, b;

    pf_cpu_use_set(TRUE);
    a = reading();
    pf_cpu_enter(PF_CPU_SCAN);
    burn(BURN_USEC);
    pf_cpu_enter(PF_CPU_VISITS);
    burn(BURN_USEC);
    fault_pages(256);
    pf_cpu_leave();
    pf_cpu_leave();
    b = reading();
    g_assert_cmpuint(b.usec[PF_CPU_SCAN] - a.usec[PF_CPU_SCAN], >=, BURN_USEC);
    g_assert_cmpuint(b.usec[PF_CPU_SCAN] - a.usec[PF_CPU_SCAN], <, 4 * BURN_USEC);
    g_assert_cmpuint(b.usec[PF_CPU_VISITS] - a.usec[PF_CPU_VISITS], >=, BURN_USEC);
    g_assert_cmpuint(b.minflt[PF_CPU_VISITS] - a.minflt[PF_CPU_VISITS], >=, 256);
    g_assert_cmpuint(b.minflt[PF_CPU_SCAN] - a.minflt[PF_CPU_SCAN], <, 256);
    g_assert_cmpuint(pf_cpu_depth(), ==, 0);

    /* Outside every mark: the loop's, charged at the next mark. */
    burn(BURN_USEC);
    pf_cpu_enter(PF_CPU_ANSWERS);
    pf_cpu_leave();
    a = reading();
    g_assert_cmpuint(a.usec[PF_CPU_LOOP] - b.usec[PF_CPU_LOOP], >=, BURN_USEC);
}

/* Short parts between sleeps, as the main loop runs them: each is charged
 * what it spent, not what the scheduler had yet to account for when it
 * ended (getrusage()'s times move only at ticks and switches, and would
 * charge most of it to the sleep's mark).  The work here reads no CPU
 * clock, which would bring the scheduler's count up to date. */
static void
test_between_sleeps(void)
{
    Reading a, b;
    guint64 visits, loop;

    pf_cpu_use_set(TRUE);
    a = reading();
    for (int i = 0; i < 10; i++) {
        gint64 end = g_get_monotonic_time() + 2000;

        pf_cpu_enter(PF_CPU_VISITS);
        while (g_get_monotonic_time() < end) {
        }
        pf_cpu_leave();
        g_usleep(5000);
    }
    pf_cpu_enter(PF_CPU_SCAN);
    pf_cpu_leave();
    b = reading();
    visits = b.usec[PF_CPU_VISITS] - a.usec[PF_CPU_VISITS];
    loop = b.usec[PF_CPU_LOOP] - a.usec[PF_CPU_LOOP];
    g_test_message("between sleeps: visits %" G_GUINT64_FORMAT " us, loop %" G_GUINT64_FORMAT
                   " us", visits, loop);
    g_assert_cmpuint(visits, >, 4 * loop);
}

/* Marks around nothing: what they cost goes to "counting", not to the
 * part they mark. */
static void
test_counting(void)
{
    Reading a, b;
    guint64 jobs, counting;

    pf_cpu_use_set(TRUE);
    a = reading();
    for (int i = 0; i < 2000; i++) {
        pf_cpu_enter(PF_CPU_JOBS);
        pf_cpu_leave();
    }
    b = reading();
    jobs = b.usec[PF_CPU_JOBS] - a.usec[PF_CPU_JOBS];
    counting = b.usec[PF_CPU_COUNTING] - a.usec[PF_CPU_COUNTING];
    g_test_message("2000 empty marks: jobs %" G_GUINT64_FORMAT " us, counting %" G_GUINT64_FORMAT
                   " us", jobs, counting);
    g_assert_cmpuint(counting, >, 0);
    g_assert_cmpuint(jobs, <, counting);
    g_assert_cmpuint(b.spans[PF_CPU_JOBS] - a.spans[PF_CPU_JOBS], ==, 2000);
    g_assert_cmpuint(b.spans[PF_CPU_COUNTING] - a.spans[PF_CPU_COUNTING], ==, 4000);
}

static gpointer
other_thread(gpointer data)
{
    pf_cpu_enter(PF_CPU_JOBS);
    burn(BURN_USEC);
    pf_cpu_leave();
    g_assert_cmpuint(pf_cpu_depth(), ==, 0);
    return NULL;
}

static void
test_other_thread(void)
{
    Reading a, b;

    pf_cpu_use_set(TRUE);
    a = reading();
    g_thread_join(g_thread_new("other", other_thread, NULL));
    b = reading();
    g_assert_cmpuint(b.usec[PF_CPU_JOBS], ==, a.usec[PF_CPU_JOBS]);
}

static void
test_off(void)
{
    Reading a, b;

    pf_cpu_use_set(TRUE);
    pf_cpu_enter(PF_CPU_JOBS);
    pf_cpu_use_set(FALSE); /* the open mark is forgotten */
    g_assert_cmpuint(pf_cpu_depth(), ==, 0);
    a = reading();
    pf_cpu_enter(PF_CPU_JOBS);
    burn(BURN_USEC);
    pf_cpu_leave();
    pf_cpu_leave();
    b = reading();
    g_assert_cmpuint(b.usec[PF_CPU_JOBS], ==, a.usec[PF_CPU_JOBS]);
    g_assert_cmpuint(b.usec[PF_CPU_LOOP], ==, a.usec[PF_CPU_LOOP]);
    g_assert_cmpuint(pf_cpu_depth(), ==, 0);
}

static void
test_unwind(void)
{
    guint depth;
    Reading a, b;

    pf_cpu_use_set(TRUE);
    pf_cpu_enter(PF_CPU_SCAN);
    depth = pf_cpu_depth();
    for (int i = 0; i < 20; i++) { /* past the stack's depth */
        pf_cpu_enter(PF_CPU_VISITS);
    }
    g_assert_cmpuint(pf_cpu_depth(), ==, depth + 20);
    pf_cpu_unwind(depth);
    g_assert_cmpuint(pf_cpu_depth(), ==, depth);
    a = reading();
    burn(BURN_USEC);
    pf_cpu_leave();
    b = reading();
    g_assert_cmpuint(b.usec[PF_CPU_SCAN] - a.usec[PF_CPU_SCAN], >=, BURN_USEC);
    g_assert_cmpuint(pf_cpu_depth(), ==, 0);
    for (guint i = 0; i < PF_CPU_N; i++) {
        g_assert_nonnull(pf_cpu_use_name(i));
    }
    g_assert_null(pf_cpu_use_name(PF_CPU_N));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/cpu-use/innermost", test_innermost);
    g_test_add_func("/cpu-use/between-sleeps", test_between_sleeps);
    g_test_add_func("/cpu-use/counting", test_counting);
    g_test_add_func("/cpu-use/other-thread", test_other_thread);
    g_test_add_func("/cpu-use/unwind", test_unwind);
    g_test_add_func("/cpu-use/off", test_off);
    return g_test_run();
}
