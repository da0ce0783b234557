/*
 * scan.h - the scanner: KSM's scan loop over the guest RAM of attached VMs.
 *
 * Each visit of a page, in KSM's order:
 *   1. smart scan may skip a page that has kept failing to merge;
 *   2. the page's checksum is computed, and the stable tree searched: an
 *      equal canonical page (checksum, then memcmp) takes the page as one
 *      more sharer (not a page just back from a merge);
 *   3. if the checksum changed since the last visit the page is volatile:
 *      counted, and skipped this pass;
 *   4. an all-zero page becomes a zero page (use_zero_pages);
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
 * the requests it makes of each agent by what that agent's outbox takes:
 * it never waits for an agent, it waits at one (and passes over one that
 * has stopped answering).
 *
 * The scanner is the core: it calls only down (trees, pool, VM records and
 * their outboxes, hashing, counters).  The layers above (the agent links,
 * the jobs, the control socket) call it, drain the outboxes it fills, and
 * hear from it through listeners (PfScanEvents); it never calls them
 * otherwise.  It owns every VM added to it, and frees it when it goes.
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

/*
 * What the scanner tells those above it, each call made from inside a
 * scanner call: a listener must not change the scanner (it may read it),
 * only take note (or send).  Any member may be NULL.
 */
typedef struct {
    /* A VM leaves the scanner, which frees it when this returns: detached
     * (why says why) or removed (why NULL). */
    void (*vm_gone)(PfScanner *s, PfVm *vm, const char *why, gpointer user);
    /* The pass goes past the rest of a VM whose agent is not answering. */
    void (*passed_over)(PfScanner *s, PfVm *vm, gpointer user);
    /* The VM's agent is to map a pool chunk (drop FALSE), or to let go of
     * one (drop TRUE); chunk->fd is valid during the call only. */
    void (*chunk)(PfScanner *s, PfVm *vm, const PfPoolChunk *chunk, gboolean drop,
                  gpointer user);
    /* The VM's merge domain changed (pf_scanner_merge_domain() says the
     * new one). */
    void (*domain)(PfScanner *s, PfVm *vm, gpointer user);
    /* The scanner sleeps until its next background batch (TRUE), nothing
     * waiting for the agents' answers until then; or it wakes, or
     * something now waits for them (FALSE).  Answers that come while it
     * rests may be left unread until it wakes: it then lets the main loop
     * turn once, at a higher priority than its own, before it goes on. */
    void (*resting)(PfScanner *s, gboolean resting, gpointer user);
} PfScanEvents;

PfScanner *pf_scanner_new(const PfHashAlgo *hash);
void pf_scanner_free(PfScanner *s);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfScanner, pf_scanner_free)

/* Tests may bring their own (weak) checksum to forge collisions. */
void pf_scanner_set_hash_func(PfScanner *s, PfHashFunc func);
const PfHashAlgo *pf_scanner_get_hash(PfScanner *s);

PfKnobs *pf_scanner_get_knobs(PfScanner *s);

/* events (static: it names the listener) until removed, or until the
 * scanner is freed, which calls destroy(user). */
void pf_scanner_add_listener(PfScanner *s, const PfScanEvents *events, gpointer user,
                             GDestroyNotify destroy);
void pf_scanner_remove_listener(PfScanner *s, const PfScanEvents *events, gpointer user);
/* The user of the first listener with these events, or NULL. */
gpointer pf_scanner_find_listener(PfScanner *s, const PfScanEvents *events);

/* Takes ownership of vm. */
void pf_scanner_add_vm(PfScanner *s, PfVm *vm);
/* Releases everything the VM holds in the trees, then frees it. */
void pf_scanner_remove_vm(PfScanner *s, PfVm *vm);
/* An agent's VM takes the place of old, attached by pid (the same
 * process): it keeps old's merge domain, which was said of the process. */
void pf_scanner_replace_vm(PfScanner *s, PfVm *old, PfVm *vm);
/* Its agent's regions had pages mapped from pool chunks of an earlier
 * pagefoldd (region.h's pooled): they become merged pages of this one, in
 * its merge domain (set before this), counted as such, a slice at a time
 * from the main loop, starting now.  Once, after the VM was added. */
void pf_scanner_adopt(PfScanner *s, PfVm *vm);
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

/* Visits up to max_pages pages present, as KSM's pages_to_scan counts
 * them: pages of the memfd, and merged pages (holes of the memfd, but the
 * guest's); RAM never touched costs nothing.  Stops early at the end of a
 * pass, or when every VM left in the pass has an agent with as many
 * requests to answer as its outbox takes.  Returns the pages present
 * visited; *progress says whether anything moved on (the cursor, a pass,
 * joins), which a walk over holes alone does with 0 pages. */
gsize pf_scanner_scan(PfScanner *s, gsize max_pages, gboolean *progress);
/* Scans for about usec, or up to max_pages pages present, or to the end
 * of the pass; returns the pages present visited, *progress as above.
 * whole_passes: a pass waits for every agent that answers, however slowly
 * (root asked for whole passes); else it waits for slow agents a bounded
 * while, and visits the rest of their VMs next pass, and its requests wait
 * to be ripe (a background batch's: pf_scanner_flush_ripe()). */
gsize pf_scanner_scan_slice(PfScanner *s, gsize max_pages, gint64 usec, gboolean whole_passes,
                            gboolean *progress);
/* Whether joins found by a pass are still being made (a slice at a time):
 * the next scans make them before they visit a page, and return 0. */
gboolean pf_scanner_joining(PfScanner *s);
/* Whether a VM's look at its process (its /proc files, read on a thread as
 * a pass begins), or a read of a window of its memfds ahead of the cursor
 * (extents.h), is under way: a scan may stop for it, and goes on once the
 * main context has run its end. */
gboolean pf_scanner_looking(PfScanner *s);
/* Passes ended so far, and whether one is under way. */
guint64 pf_scanner_full_scans(PfScanner *s);
gboolean pf_scanner_in_pass(PfScanner *s);
/* Whether the VM's agent has had requests to answer and answered none of
 * them for a while (half a second): passed over, not waited for. */
gboolean pf_scanner_agent_silent(PfVm *vm);
/* The VM's pages merged, or with a request in flight (to merge or to
 * unmerge them). */
gsize pf_scanner_vm_merged(const PfVm *vm);

/* Scans in the background on the default main context, paced by knobs. */
void pf_scanner_start(PfScanner *s);
void pf_scanner_stop(PfScanner *s);
/* Call after changing knobs, to re-pace the next wake-up. */
void pf_scanner_kick(PfScanner *s);
/* While paused (as many resumes as pauses), the background batches wait:
 * someone else drives the passes (a scan-now job, jobs.h). */
void pf_scanner_pause_batches(PfScanner *s);
void pf_scanner_resume_batches(PfScanner *s);
/* The requests the scanner decided so far go to their agents (each VM's
 * outbox flushed), as they do when a scan or an answer ends (a background
 * batch's scans hold theirs a little: pf_scanner_flush_ripe()). */
void pf_scanner_flush(PfScanner *s);
/* The VM takes no new merges until as many ends as begins: it is being
 * unmerged.  Pages waiting to join content forget it. */
void pf_scanner_begin_unmerge(PfScanner *s, PfVm *vm);
void pf_scanner_end_unmerge(PfScanner *s, PfVm *vm);

/* Counters of all VMs, and of each (in pf_scanner_get_vms() order). */
void pf_scanner_collect(PfScanner *s, PfCounters *total, PfCounters *per_vm);

/* The agent's answers to the oldest batch sent to it (its outbox said they
 * answer it: pf_outbox_answers()), one per item. */
void pf_scanner_answer(PfScanner *s, PfVm *vm, const PfWireResult *res, guint32 n);
/* Ends a page's sharing: a merged page is asked back into its memfd, a
 * page of an advise-mode VM forgets its node. */
void pf_scanner_end_sharing(PfScanner *s, PfRegion *r, gsize idx);
/* The VM goes (its agent disconnected, or its process exited): counters
 * forget it; pool slots its process may still map stay taken until the
 * process is gone. */
void pf_scanner_detach(PfScanner *s, PfVm *vm, const char *why);
PfPool *pf_scanner_get_pool(PfScanner *s);
/* The VM's agent stepped back to advise mode (a vhost-user device, a
 * migration, ...): every page it had remapped is back in its memfd. */
void pf_scanner_step_back(PfScanner *s, PfVm *vm, const char *reason);
/* A region an agent announced after READY, checked: appended to the VM's
 * regions (its index is the next), scanned from then on if live.  FALSE
 * when it could not be placed: it stays as a refused placeholder.  Takes
 * r, a refused placeholder too. */
gboolean pf_scanner_add_region(PfScanner *s, PfVm *vm, PfRegion *r);
/* A live region of an agent's VM left it (GONE): its agent mapped all of it
 * from its memfd first.  What its pages and the requests for them hold is
 * let go, requests not sent yet are never sent, answers still to come for
 * it change nothing, and it stays a placeholder at its index. */
void pf_scanner_region_gone(PfScanner *s, PfVm *vm, guint index);
/* Pages [first, first + n) of a VM's live region were just written by a
 * device (its agent says: a disk read): they are visited before the
 * cursor's pages, up to a bound a VM (scan-hints.c).  With io_hints 0,
 * nothing. */
void pf_scanner_hinted(PfScanner *s, PfVm *vm, guint region, guint64 first, guint64 n);
/* Pages of a VM's region were mapped from the memfd again and discarded;
 * backend: folded back because a vhost-user back-end touched them. */
void pf_scanner_discarded(PfScanner *s, PfVm *vm, guint region, guint64 first, guint64 n,
                          gboolean backend);

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
