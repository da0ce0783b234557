/*
 * jobs.c - scan-now and unmerge as jobs (jobs.h): a step at a time from the
 * main loop, which reads the agents' answers and the control socket between
 * steps.  Owns the jobs, kept in a list that is the scanner's listener, so
 * that VMs that go leave their jobs first and jobs end with the scanner.
 * Never waits in a call, never decides a merge (it asks the scanner).
 */
#include "jobs.h"

#include "cpu-use.h"
#include "util.h"

typedef enum {
    JOB_PASSES,
    JOB_UNMERGE,
} JobKind;

typedef enum {
    STEP_AGAIN, /* more to do now */
    STEP_WAIT,  /* waiting for answers */
    STEP_RETRY, /* waiting for pages the agents could not unmerge yet */
    STEP_DONE,
} StepResult;

/* The jobs of one scanner: its listener. */
typedef struct {
    PfScanner *s;
    GPtrArray *jobs; /* PfScanJob*, running */
} JobList;

struct _PfScanJob {
    PfScanner *s;
    JobList *list;
    JobKind kind;
    guint64 target;     /* JOB_PASSES: full_scans to reach */
    GPtrArray *targets; /* JOB_UNMERGE: the VMs (PfVm*) still attached */
    GString *trouble;   /* why it did not do all it says, or empty */
    GPtrArray *detached; /* "VM NAME (pid N): why", of VMs detached
                          * while it ran (their processes live on) */
    GPtrArray *passed_over; /* the same, of VMs a passes job did not scan
                             * all of, or whose answers it did not wait
                             * for to the end */
    PfScanJobFunc done;
    gpointer user;
    guint source;
    /* JOB_UNMERGE: where the sweep is, and how it went */
    guint vm_idx, region_idx;
    gsize page;
    gboolean sweeping;
    gboolean paused;  /* before the next sweep */
    guint sweeps;
};

/* A step's share of the main loop: the control socket and the agents'
 * answers wait at most this long for it. */
#define STEP_USEC 10000
/* How long a passes job waits for an agent that answers nothing. */
#define SETTLE_USEC (30 * G_USEC_PER_SEC)
/* Pages an unmerge sweep looks at between looks at the clock. */
#define SWEEP_PAGES 65536
/* An unmerge sweeps again this long after the last, this many times at
 * most, for pages still merged (in DMA: EBUSY) before it gives up. */
#define RETRY_MS 100
#define RETRIES 50

/* Whether any request to an agent of vms is still to be answered (by an
 * agent that answers: not counting those stopped for a while, if
 * answering).  A request still in an open batch (a job's scans flush
 * theirs as they end; a background batch's wait to be ripe) goes with a
 * later flush: not waited for. */
static gboolean
answers_due(GPtrArray *vms, gboolean answering)
{
    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);

        if (vm->kind == PF_VM_AGENT && pf_outbox_n_batched(vm->outbox) > 0 &&
            !(answering && pf_scanner_agent_silent(vm))) {
            return TRUE;
        }
    }
    return FALSE;
}

/* Notes a VM a passes job did not scan all of, once per job. */
static void
note_passed_over(PfScanJob *j, PfVm *vm, const char *why)
{
    g_autofree char *prefix = g_strdup_printf("VM %s (pid %d): ", vm->name, vm->pid);

    for (guint i = 0; i < j->passed_over->len; i++) {
        if (g_str_has_prefix(g_ptr_array_index(j->passed_over, i), prefix)) {
            return;
        }
    }
    g_ptr_array_add(j->passed_over, g_strconcat(prefix, why, NULL));
}

/* Each pass begins once the last one's requests are answered, as KSM's
 * do (its merges are made as it scans): a pass sees what the last one
 * did.  The job ends when every request is answered, or its agent has
 * answered nothing for SETTLE_USEC: an agent that answers, however slowly,
 * is waited for (what it has to answer is bounded by its outbox's room); one
 * that stopped, but not for long enough to be given up, is noted. */
static StepResult
passes_step(PfScanJob *j)
{
    PfScanner *s = j->s;
    GPtrArray *vms = pf_scanner_get_vms(s);
    gboolean due = FALSE, progress;

    if (pf_scanner_joining(s)) {
        /* The joins begun (a VM's, or the last pass's), made: their
         * requests are the pass's. */
        pf_scanner_scan_slice(s, G_MAXSIZE, STEP_USEC, TRUE, &progress);
        return STEP_AGAIN;
    }
    if (pf_scanner_full_scans(s) < j->target && vms->len > 0) {
        if (!pf_scanner_in_pass(s) && answers_due(vms, TRUE)) {
            return STEP_WAIT;
        }
        pf_scanner_scan_slice(s, G_MAXSIZE, STEP_USEC, TRUE, &progress);
        return progress ? STEP_AGAIN : STEP_WAIT;
    }
    pf_scanner_flush(s);
    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);

        if (vm->kind == PF_VM_BY_PID || pf_outbox_in_flight(vm->outbox) == 0) {
            continue;
        }
        if (pf_outbox_waiting_usec(vm->outbox) < SETTLE_USEC) {
            due = TRUE;
        } else {
            g_autofree char *why = g_strdup_printf("%zu request item(s) not answered: its "
                                                   "agent answered nothing for %d s",
                                                   pf_outbox_in_flight(vm->outbox),
                                                   (int)(SETTLE_USEC / G_USEC_PER_SEC));

            note_passed_over(j, vm, why);
        }
    }
    return due ? STEP_WAIT : STEP_DONE;
}

/* Pages of the targets still merged, or on their way in or out. */
static gsize
still_merged(PfScanJob *j)
{
    gsize n = 0;

    for (guint i = 0; i < j->targets->len; i++) {
        n += pf_scanner_vm_merged(g_ptr_array_index(j->targets, i));
    }
    return n;
}

/* Asks for every merged page of r from page j->page on, within the step;
 * FALSE when it stops before the end (an outbox full, or the step's time
 * up: *result says which). */
static gboolean
sweep_region(PfScanJob *j, PfVm *vm, PfRegion *r, gint64 end, StepResult *result)
{
    while (j->page < r->n_pages) {
        gsize stop = MIN(r->n_pages, j->page + SWEEP_PAGES);

        if (vm->kind == PF_VM_AGENT && pf_outbox_room(vm->outbox) == 0) {
            pf_scanner_flush(j->s);
            *result = STEP_WAIT;
            return FALSE;
        }
        for (j->page = pf_region_next_recorded(r, j->page, stop); j->page < stop;
             j->page = pf_region_next_recorded(r, j->page + 1, stop)) {
            PfPageState st = pf_region_page_state(r, j->page);

            if (st == PF_PAGE_SHARED || st == PF_PAGE_ZERO) {
                pf_scanner_end_sharing(j->s, r, j->page);
                if (vm->kind == PF_VM_AGENT && pf_outbox_room(vm->outbox) == 0) {
                    j->page++;
                    break;
                }
            }
        }
        if (g_get_monotonic_time() >= end) {
            pf_scanner_flush(j->s);
            *result = STEP_AGAIN;
            return FALSE;
        }
    }
    return TRUE;
}

/* Whether the next sweep may begin (*result: else what to do). */
static gboolean
sweep_due(PfScanJob *j, StepResult *result)
{
    gsize left;

    if (answers_due(j->targets, FALSE)) {
        *result = STEP_WAIT;
        return FALSE;
    }
    if ((left = still_merged(j)) == 0) {
        *result = STEP_DONE;
        return FALSE;
    }
    /* Pages still merged after a sweep and its answers: merges that were
     * in flight, or pages their agents refused to unmerge (in DMA: EBUSY),
     * asked again a little later, a bounded number of times. */
    if (j->sweeps > RETRIES) {
        g_string_append_printf(j->trouble, "%s%zu page(s) could not be unmerged: their "
                               "agents refused %u times (in DMA?)",
                               j->trouble->len ? "; " : "", left, RETRIES);
        *result = STEP_DONE;
        return FALSE;
    }
    if (j->sweeps > 0 && !j->paused) {
        j->paused = TRUE;
        *result = STEP_RETRY;
        return FALSE;
    }
    return TRUE;
}

/*
 * Sweeps the targets' pages and asks their agents to unmerge every merged
 * one, as fast as the agents answer.  Merges in flight land meanwhile (the
 * targets take no new ones): the sweep is made again once every answer is
 * in, until no page is merged.
 */
static StepResult
unmerge_step(PfScanJob *j)
{
    gint64 end = g_get_monotonic_time() + STEP_USEC;
    StepResult result;

    if (!j->sweeping) {
        if (!sweep_due(j, &result)) {
            return result;
        }
        j->paused = FALSE;
        j->sweeps++;
        j->sweeping = TRUE;
        j->vm_idx = j->region_idx = 0;
        j->page = 0;
    }
    for (; j->vm_idx < j->targets->len; j->vm_idx++, j->region_idx = 0, j->page = 0) {
        PfVm *vm = g_ptr_array_index(j->targets, j->vm_idx);

        for (; j->region_idx < vm->regions->len; j->region_idx++, j->page = 0) {
            if (!sweep_region(j, vm, g_ptr_array_index(vm->regions, j->region_idx), end,
                              &result)) {
                return result;
            }
        }
        pf_scanner_flush(j->s);
    }
    j->sweeping = FALSE;
    return STEP_WAIT;
}

static void job_finish(PfScanJob *j);

static gboolean
job_cb(gpointer user)
{
    PfScanJob *j = user;
    StepResult r;

    pf_cpu_enter(PF_CPU_JOBS);
    r = j->kind == JOB_PASSES ? passes_step(j) : unmerge_step(j);
    pf_cpu_leave();
    j->source = 0;
    switch (r) {
    case STEP_AGAIN:
        /* Below the control socket and the agents' answers. */
        j->source = g_idle_add_full(G_PRIORITY_DEFAULT_IDLE, job_cb, j, NULL);
        break;
    case STEP_WAIT:
        j->source = g_timeout_add(2, job_cb, j);
        break;
    case STEP_RETRY:
        j->source = g_timeout_add(RETRY_MS, job_cb, j);
        break;
    case STEP_DONE:
        job_finish(j);
        break;
    }
    return G_SOURCE_REMOVE;
}

/* ---- the scanner's listener ---- */

/* A VM leaves while jobs run, its process alive: every job notes it, and
 * an unmerge that was to unmerge it fails (its merged pages stay so in
 * its process).  One whose process exited has nothing left to do. */
static void
list_vm_gone(PfScanner *s, PfVm *vm, const char *why, gpointer user)
{
    JobList *list = user;

    for (guint i = 0; i < list->jobs->len; i++) {
        PfScanJob *j = g_ptr_array_index(list->jobs, i);
        gboolean target = g_ptr_array_remove(j->targets, vm);

        if (target && j->kind == JOB_UNMERGE) {
            pf_scanner_end_unmerge(s, vm);
            /* Its place in the sweep is gone: the sweep starts again. */
            j->sweeping = FALSE;
        }
        if (why == NULL || pf_vm_exited(vm)) {
            continue;
        }
        g_ptr_array_add(j->detached, g_strdup_printf("VM %s (pid %d): %s", vm->name, vm->pid,
                                                     why));
        if (target) {
            g_string_append_printf(j->trouble, "%sVM %s (pid %d) was detached: %s",
                                   j->trouble->len ? "; " : "", vm->name, vm->pid, why);
        }
    }
}

static void
list_passed_over(PfScanner *s, PfVm *vm, gpointer user)
{
    JobList *list = user;

    for (guint i = 0; i < list->jobs->len; i++) {
        PfScanJob *j = g_ptr_array_index(list->jobs, i);

        if (j->kind == JOB_PASSES) {
            note_passed_over(j, vm, "passed over: its agent was not answering");
        }
    }
}

/* The scanner goes: every job still running ends. */
static void
list_free(gpointer user)
{
    JobList *list = user;

    while (list->jobs->len > 0) {
        PfScanJob *j = g_ptr_array_index(list->jobs, 0);

        g_string_assign(j->trouble, "pagefoldd is stopping");
        job_finish(j);
    }
    g_ptr_array_unref(list->jobs);
    g_free(list);
}

static const PfScanEvents list_events = {
    .vm_gone = list_vm_gone,
    .passed_over = list_passed_over,
};

static JobList *
job_list(PfScanner *s)
{
    JobList *list = pf_scanner_find_listener(s, &list_events);

    if (list == NULL) {
        list = g_new0(JobList, 1);
        list->s = s;
        list->jobs = g_ptr_array_new();
        pf_scanner_add_listener(s, &list_events, list, list_free);
    }
    return list;
}

/* ---- jobs ---- */

static PfScanJob *
job_new(PfScanner *s, JobKind kind, PfScanJobFunc done, gpointer user)
{
    PfScanJob *j = g_new0(PfScanJob, 1);

    j->s = s;
    j->list = job_list(s);
    j->kind = kind;
    j->targets = g_ptr_array_new();
    j->trouble = g_string_new(NULL);
    j->detached = g_ptr_array_new_with_free_func(g_free);
    j->passed_over = g_ptr_array_new_with_free_func(g_free);
    j->done = done;
    j->user = user;
    j->source = g_idle_add_full(G_PRIORITY_DEFAULT_IDLE, job_cb, j, NULL);
    g_ptr_array_add(j->list->jobs, j);
    return j;
}

static void
job_free(PfScanJob *j)
{
    for (guint i = 0; i < j->targets->len && j->kind == JOB_UNMERGE; i++) {
        pf_scanner_end_unmerge(j->s, g_ptr_array_index(j->targets, i));
    }
    if (j->kind == JOB_PASSES) {
        pf_scanner_resume_batches(j->s);
    }
    g_clear_handle_id(&j->source, g_source_remove);
    g_ptr_array_unref(j->targets);
    g_string_free(j->trouble, TRUE);
    g_ptr_array_unref(j->detached);
    g_ptr_array_unref(j->passed_over);
    g_free(j);
}

static void
job_finish(PfScanJob *j)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GPtrArray) detached = g_ptr_array_ref(j->detached);
    g_autoptr(GPtrArray) passed_over = g_ptr_array_ref(j->passed_over);
    PfScanJobFunc done = j->done;
    gpointer user = j->user;
    PfScanner *s = j->s;

    if (j->trouble->len > 0) {
        error = g_error_new(PF_ERROR, PF_ERROR_FAILED, "%s", j->trouble->str);
    }
    g_ptr_array_remove(j->list->jobs, j);
    job_free(j);
    if (done != NULL) {
        done(s, error, detached, passed_over, user);
    }
}

/* The job's passes are the scanning while it runs.  Were the scanner's
 * batches to go on, a pass would begin before the last one's answers were
 * in, and a VM whose writer churns (a new request for every answer) would
 * keep requests in flight for as long as the job looked: on a slow guest
 * it never saw none, and scan-now never replied. */
PfScanJob *
pf_scan_job_run_passes(PfScanner *s, guint n, PfScanJobFunc done, gpointer user)
{
    PfScanJob *j = job_new(s, JOB_PASSES, done, user);

    pf_scanner_pause_batches(s);
    /* The current pass counts if begun. */
    j->target = pf_scanner_full_scans(s) + n + (pf_scanner_in_pass(s) ? 1 : 0);
    return j;
}

PfScanJob *
pf_scan_job_unmerge(PfScanner *s, PfVm *only, PfScanJobFunc done, gpointer user)
{
    PfScanJob *j = job_new(s, JOB_UNMERGE, done, user);
    GPtrArray *vms = pf_scanner_get_vms(s);

    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);

        if (only == NULL || vm == only) {
            pf_scanner_begin_unmerge(s, vm);
            g_ptr_array_add(j->targets, vm);
        }
    }
    return j;
}

void
pf_scan_job_forget(PfScanJob *j)
{
    j->done = NULL;
}

static void
sync_done(PfScanner *s, const GError *error, GPtrArray *detached, GPtrArray *passed_over,
          gpointer user)
{
    *(gboolean *)user = TRUE;
}

/* The jobs above, waited for on the default main context. */
static void
wait_job(gboolean *done)
{
    while (!*done) {
        g_main_context_iteration(NULL, TRUE);
    }
}

void
pf_scan_job_run_passes_wait(PfScanner *s, guint n)
{
    gboolean done = FALSE;

    pf_scan_job_run_passes(s, n, sync_done, &done);
    wait_job(&done);
}

void
pf_scan_job_unmerge_wait(PfScanner *s, PfVm *only)
{
    gboolean done = FALSE;

    pf_scan_job_unmerge(s, only, sync_done, &done);
    wait_job(&done);
}
