/*
 * scan-internal.h - the scanner's state, shared by the files that make it
 * up: scan.c (the pass loop, the visit, the merges and their answers) and
 * jobs.c (scan-now and unmerge, run from the main loop).  Nothing outside
 * daemon/scan*.c and daemon/jobs.c includes it.
 */
#pragma once

#include "cow.h"
#include "link.h"
#include "scan.h"

/* A page found equal to node, whose slot its VM may not read. */
typedef struct {
    guint32 chunk; /* the node's slot's, then: */
    guint32 vm;    /* the page's VM's serial */
    guint32 slot;
    guint32 page;
    guint32 node;
} Joining;

/* Past this many, joins are made before the pass ends. */
#define MAX_JOINING 65536u

/* Pool slots a process still maps after its VM was detached. */
typedef struct {
    guint32 slot;
    guint32 node;
} HeldRef;

typedef struct {
    PfScanner *s;
    int pidfd;
    guint watch;
    GArray *refs; /* HeldRef */
} Leftover;

struct _PfScanner {
    PfKnobs knobs;
    const PfHashAlgo *algo;
    PfHashFunc hash;
    guint64 zero_checksum;

    GPtrArray *vms;     /* PfVm*, owned */
    GPtrArray *domains; /* char*: merge domain i + 1's name (0: default) */
    GPtrArray *regions; /* PfRegion* of all VMs, sorted by base */
    PfRegion *last_region;

    PfStableTree stable;
    PfUnstableTree unstable;
    GArray *joins;       /* Joining: pages found equal to nodes their VM may
                          * not read, joined when it ends (make_joins()) */
    GHashTable *partial; /* chunk << 32 | VM serial -> the pass in which the
                          * VM's pages matched part of the chunk */
    PfPool *pool;        /* created with the first merging VM */
    guint32 next_serial; /* the last PfVm.serial given */
    GPtrArray *leftovers; /* Leftover* */
    guint64 max_map_count;
    PfCow *cow;            /* finds merged pages written since */
    int kpageflags_fd;     /* /proc/kpageflags: is a page part of a THP */

    /* cursor: the next page to visit */
    gboolean in_pass;
    guint cur_vm;
    guint entered;  /* the VM at cur_vm was looked at (enter_vm()) */
    guint cur_region;
    gsize cur_page;
    gsize data_end; /* end of the memfd data extent holding cur_page */
    gboolean blocked; /* the last scan stopped at an agent's full link */
    gint64 slice_end; /* monotonic: a scan stops here (0: at max_pages) */

    guint64 full_scans;
    guint64 memcmp_calls;
    guint64 stable_nodes_examined;
    guint listed_sharing; /* the max_page_sharing that decided which nodes
                           * are full (node_relist()) */
    gint64 pass_start_usec;
    guint64 last_pass_usec;

    GPtrArray *jobs;   /* PfScanJob*, running */

    guint timer_id;
    gsize batch_left;  /* of the wake-up's batch, scanned in slices */
    gint64 batch_start;
    gint64 batch_cpu;  /* thread CPU time when it began */
    gint64 last_batch_usec;
    PfVmGoneFunc vm_gone;
    gpointer vm_gone_user;
};

/* Past this long without an answer, an agent whose window is full is
 * passed over for the rest of the pass: one stopped VM must not hold up
 * the scanning of the others (its link gives it up later). */
#define STUCK_USEC (G_USEC_PER_SEC / 2)

/* Whether the VM's agent has had requests to answer and answered none of
 * them for STUCK_USEC: passed over, not waited for. */
static inline gboolean
pf_agent_silent(PfVm *vm)
{
    return vm->link != NULL && pf_link_waiting_usec(vm->link) > STUCK_USEC;
}

/* Scans for about usec, or up to max_pages, or to the end of the pass;
 * returns the pages visited. */
gsize pf_scanner_scan_slice(PfScanner *s, gsize max_pages, gint64 usec);
/* Ends a page's sharing: a merged page is asked back into its memfd, a
 * page of an advise-mode VM forgets its node. */
void pf_scanner_end_sharing(PfScanner *s, PfRegion *r, gsize idx);

/* jobs.c: a VM leaves (why: NULL when it is only removed); and the end of
 * every job still running, as the scanner goes. */
void pf_scan_jobs_vm_gone(PfScanner *s, PfVm *vm, const char *why);
/* The scanner passed over the rest of a VM whose agent is not answering. */
void pf_scan_jobs_passed_over(PfScanner *s, PfVm *vm);
/* Whether a scan-now job scans: the timer's batches wait meanwhile. */
gboolean pf_scan_jobs_scanning(PfScanner *s);
void pf_scan_jobs_end(PfScanner *s);
