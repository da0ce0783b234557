/*
 * jobs.h - what takes as long as the agents take: scan-now's passes and
 * their answers, and unmerge (KSM's run=2 too), run a step at a time on the
 * default main context (which must run meanwhile: the agents' answers come
 * through it).
 *
 * A job sits above the scanner: it drives it through scan.h, reads the
 * VMs' outboxes, and hears of VMs that go through a scanner listener; the
 * scanner never calls it.  A job never waits in a call, never decides a
 * merge, and never outlives the VMs it names: a VM that goes leaves its
 * jobs first.
 *
 * A job says when it is done: error NULL when it did all it says, else
 * why not (a VM to unmerge detached meanwhile, pages that could not be
 * unmerged); detached: the VMs detached while it ran, their processes
 * alive ("VM NAME (pid N): why"); passed_over: the VMs scan-now did not
 * scan all of (their agents stopped answering) or did not wait for to the
 * end (their agents answer, slowly).  The job is freed after done is
 * called.  Jobs still running when the scanner is freed end then, with
 * "pagefoldd is stopping".
 */
#pragma once

#include <glib.h>

#include "scan.h"

typedef struct _PfScanJob PfScanJob;
typedef void (*PfScanJobFunc)(PfScanner *s, const GError *error, GPtrArray *detached,
                              GPtrArray *passed_over, gpointer user);

/* Scans until n passes have ended (the current one counts if begun) and
 * every request they made is answered, but for agents that answered
 * nothing for 30 s (passed_over).  The scanner's own batches wait
 * meanwhile. */
PfScanJob *pf_scan_job_run_passes(PfScanner *s, guint n, PfScanJobFunc done, gpointer user);
/* Unmerges every page of one VM, or of all (KSM's run=2): done when no
 * page of theirs is merged, merges that were in flight included.  They
 * take no new merges meanwhile. */
PfScanJob *pf_scan_job_unmerge(PfScanner *s, PfVm *only, PfScanJobFunc done, gpointer user);
/* Whoever was to be told is gone: done is not called; the job runs on. */
void pf_scan_job_forget(PfScanJob *job);
/* The same, waited for by iterating the default main context: for tests
 * and programs of their own; pagefoldd never waits so. */
void pf_scan_job_run_passes_wait(PfScanner *s, guint n);
void pf_scan_job_unmerge_wait(PfScanner *s, PfVm *only);
