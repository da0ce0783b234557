/*
 * scan.h - the scanner: KSM's scan loop over the guest RAM of attached VMs.
 *
 * Each visit of a page, in KSM's order:
 *   1. smart scan may skip a page that has kept failing to merge;
 *   2. the page's checksum is computed; if it changed since the last visit
 *      the page is volatile: counted, and skipped this pass;
 *   3. an all-zero page becomes a zero page (use_zero_pages);
 *   4. the stable tree is searched: an equal canonical page (checksum, then
 *      memcmp) takes the page as one more sharer;
 *   5. the unstable tree is searched: an equal candidate (checksum, then
 *      memcmp) and this page become a new stable node; else the page is
 *      inserted as a candidate.
 * The unstable tree is emptied at the start of each pass.
 *
 * In mode=merge (a VM whose agent can remap its RAM) a decision becomes a
 * request to the agent: the page is PENDING until the agent answers, and
 * only the agent's answer makes it SHARED (mapped from a pool slot) or
 * ZERO.  A merged page is a hole in the guest memfd; a write to it copies
 * on write, which the scanner sees in /proc/PID/pagemap and answers by
 * asking the agent to fold the page back into the memfd.
 *
 * In mode=advise nothing is merged: a stable node points at its first guest
 * page and the counters say what merging would save.  Sharers are checked
 * against that page (memcmp) at each visit and leave when they differ, as a
 * merged page would leave on copy-on-write.
 *
 * The scanner runs on the main loop's thread and must never block there for
 * long: its batches are bounded by pages_to_scan (or the pass-time target)
 * and scanned in slices of a few milliseconds, its CPU by cpu_percent, and
 * the requests it makes of each agent by what that agent's link takes: it
 * never waits for an agent, it waits at one (and passes over one that has
 * stopped answering).
 */
#pragma once

#include <glib.h>

#include "hash.h"
#include "knobs.h"
#include "pool.h"
#include "proto.h"
#include "stats.h"
#include "tree.h"
#include "vm.h"

typedef struct _PfScanner PfScanner;

typedef void (*PfVmGoneFunc)(PfScanner *s, PfVm *vm, const char *why, gpointer user);

PfScanner *pf_scanner_new(const PfHashAlgo *hash);
void pf_scanner_free(PfScanner *s);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfScanner, pf_scanner_free)

/* Tests may bring their own (weak) checksum to forge collisions. */
void pf_scanner_set_hash_func(PfScanner *s, PfHashFunc func);
const PfHashAlgo *pf_scanner_get_hash(PfScanner *s);

PfKnobs *pf_scanner_get_knobs(PfScanner *s);
/* Called when a VM leaves on its own (its process exited). */
void pf_scanner_set_vm_gone_func(PfScanner *s, PfVmGoneFunc func, gpointer user);

/* Takes ownership of vm. */
void pf_scanner_add_vm(PfScanner *s, PfVm *vm);
/* Releases everything the VM holds in the trees, then frees it. */
void pf_scanner_remove_vm(PfScanner *s, PfVm *vm);

/* A VM's merge domain: it shares pages only with VMs of the same one (zero
 * pages excepted: every VM has them).  NULL, "" or "default": the host's
 * default, where every VM starts.  Refused for a VM that shares pages
 * already (they would stay shared across the boundary): unmerge it first. */
gboolean pf_scanner_set_merge_domain(PfScanner *s, PfVm *vm, const char *domain,
                                     GError **error);
const char *pf_scanner_merge_domain(PfScanner *s, const PfVm *vm);
/* Puts the VM in a merge domain of its own ("unlabelled"), until root
 * gives it one (pf_scanner_set_merge_domain()): for the agent of a QEMU
 * that is not root's, which may be any process of the agent socket's
 * group (a compromised QEMU reconnecting, or forking another agent, to
 * leave its domain) until libvirt's hook says which domain it is. */
void pf_scanner_set_unlabelled(PfScanner *s, PfVm *vm);
GPtrArray *pf_scanner_get_vms(PfScanner *s);
PfVm *pf_scanner_find_vm_by_pid(PfScanner *s, int pid);
/* The VM a user means by key: a pid (digits), a UUID, or a name that only
 * one VM has.  Names and UUIDs are labels, not identities: a key that two
 * VMs answer to is an error that lists their pids. */
PfVm *pf_scanner_lookup_vm(PfScanner *s, const char *key, GError **error);
/* pf_scanner_lookup_vm() without the error. */
PfVm *pf_scanner_find_vm(PfScanner *s, const char *key);

/* Visits up to max_pages pages; stops early at the end of a pass, or at a
 * VM whose agent has as many requests to answer as its link takes.
 * Returns the pages visited, holes of the memfd stepped over included. */
gsize pf_scanner_scan(PfScanner *s, gsize max_pages);

/*
 * What takes as long as the agents take runs as a job, a step at a time on
 * the default main context (which must run meanwhile: the agents' answers
 * come through it), and says when it is done: error NULL when it did all
 * it says, else why not (a VM to unmerge detached meanwhile, pages that
 * could not be unmerged); detached: the VMs detached while it ran, their
 * processes alive ("VM NAME (pid N): why"); passed_over: the VMs scan-now
 * did not scan all of (their agents stopped answering) or did not wait for
 * to the end (their agents answer, slowly).  The job is freed after done
 * is called.
 */
typedef struct _PfScanJob PfScanJob;
typedef void (*PfScanJobFunc)(PfScanner *s, const GError *error, GPtrArray *detached,
                              GPtrArray *passed_over, gpointer user);

/* Scans until n passes have ended (the current one counts if begun) and
 * every request they made is answered, but for agents that answered
 * nothing for 30 s (passed_over). */
PfScanJob *pf_scanner_run_passes_async(PfScanner *s, guint n, PfScanJobFunc done,
                                       gpointer user);
/* Unmerges every page of one VM, or of all (KSM's run=2): done when no
 * page of theirs is merged, merges that were in flight included.  They
 * take no new merges meanwhile. */
PfScanJob *pf_scanner_unmerge_async(PfScanner *s, PfVm *only, PfScanJobFunc done,
                                    gpointer user);
/* Whoever was to be told is gone: done is not called; the job runs on. */
void pf_scan_job_forget(PfScanJob *job);
/* The same, waited for by iterating the default main context: for tests
 * and programs of their own; pagefoldd never waits so. */
void pf_scanner_run_passes(PfScanner *s, guint n);
void pf_scanner_unmerge(PfScanner *s, PfVm *only);

/* Scans in the background on the default main context, paced by knobs. */
void pf_scanner_start(PfScanner *s);
void pf_scanner_stop(PfScanner *s);
/* Call after changing knobs, to re-pace the next wake-up. */
void pf_scanner_kick(PfScanner *s);

/* Counters of all VMs, and of each (in pf_scanner_get_vms() order). */
void pf_scanner_collect(PfScanner *s, PfCounters *total, PfCounters *per_vm);

/* What pagefoldd asked an agent to do with one page, kept until it answers. */
/* PfPending.kind of a request settled before its answer (its region left
 * the VM): the answer, when it comes, changes nothing. */
#define PF_PENDING_SETTLED 0u

typedef struct {
    guint32 page; /* page id */
    guint32 slot; /* pool slot referenced for it, or PF_POOL_SLOT_NONE */
    guint32 node; /* stable node, or 0 */
    guint32 from; /* a merged page moving to node: the node it leaves,
                   * whose slot it keeps a reference on until answered */
    guint8 kind;  /* PfItemKind */
} PfPending;

/* The agent's answer for one page. */
void pf_scanner_complete(PfScanner *s, PfVm *vm, const PfPending *pd, PfResultStatus status,
                         int err);
/* The VM goes (its agent disconnected, or its process exited): counters
 * forget it; pool slots its process may still map stay taken until the
 * process is gone. */
void pf_scanner_detach(PfScanner *s, PfVm *vm, const char *why);
PfPool *pf_scanner_get_pool(PfScanner *s);
/* The VM's agent stepped back to advise mode (a vhost-user device, a
 * migration, ...): every page it had remapped is back in its memfd. */
void pf_scanner_step_back(PfScanner *s, PfVm *vm, const char *reason);
/* A region an agent announced after READY, checked: appended to the VM's
 * regions (its index is the next), scanned from then on.  FALSE when it
 * could not be placed: it stays as a refused placeholder.  Takes r. */
gboolean pf_scanner_add_region(PfScanner *s, PfVm *vm, PfRegion *r);
/* A live region of an agent's VM left it (GONE): its agent mapped all of it
 * from its memfd first.  What its pages and the requests for them hold is
 * let go, requests not sent yet are never sent, answers still to come for
 * it change nothing, and it stays a placeholder at its index. */
void pf_scanner_region_gone(PfScanner *s, PfVm *vm, guint index);
/* Pages of a VM's region were mapped from the memfd again and discarded. */
void pf_scanner_discarded(PfScanner *s, PfVm *vm, guint region, guint64 first, guint64 n);

typedef struct {
    guint64 memcmp_calls;
    guint64 stable_nodes_examined; /* nodes of a page's checksum that the
                                    * stable-tree lookups looked at */
    guint64 last_pass_usec;
    guint64 stable_nodes;
    guint64 pool_slots; /* in use: by merged pages or requests in flight */
    guint64 pool_bytes; /* memory the pool holds */
    guint64 pool_chunks; /* memfds it holds it in, the zero chunk included */
    const char *cow_detection; /* "PAGEMAP_SCAN" (6.7+), else "pagemap" */
} PfScanInfo;
void pf_scanner_get_info(PfScanner *s, PfScanInfo *info);
