/*
 * libvirt-metadata.h - each attached VM's figures in its libvirt domain's
 * live metadata, so that `virsh metadata DOMAIN urn:pagefold:stats:1`
 * shows them.  (Named for libvirt's metadata: pagefold's own "metadata",
 * as in metadata_bytes, is what it keeps per page.)
 *
 * Owns a worker thread, its libvirt connection, and the timer on the main
 * loop that hands it snapshots.  Must never call libvirt on the main
 * loop's thread: libvirtd runs its qemu hook, which talks to pagefoldd's
 * control socket, while it holds the domain's job, and
 * virDomainSetMetadata() waits for that job, so a main loop blocked in
 * libvirt would deadlock with the hook.  Must never change anything of a
 * domain but pagefold's own metadata element, and only live (never the
 * persistent definition).
 *
 * Every libvirt_metadata_millisecs (a knob; 0: off), the main loop takes a
 * snapshot: for each VM that has a UUID (libvirt names its QEMUs with
 * -uuid), its UUID, its pid and its element's text, the figures taken from
 * pf_scanner_collect() as `pagefoldctl stats VM --json` takes them.  VMs
 * without a UUID are left out.  The worker takes the newest snapshot
 * (older ones not yet taken are dropped), connects if it is not connected,
 * looks each UUID up (one libvirt does not know, or whose domain is not
 * running, is not a libvirt domain: skipped quietly), and sets the element
 * only where the domain's QEMU is the VM's process, then keeps the
 * connection.  An element it set for a VM that is no longer attached, or
 * whose domain's QEMU is no longer its process, is removed.  When libvirt
 * cannot be reached or the connection drops it says so once and tries
 * again with the next snapshot, quietly, until it is connected again.
 *
 * Must never publish a VM's figures by its UUID alone: a UUID is only what
 * the VM's QEMU (or its agent) claims, and a compromised QEMU can claim
 * any domain's, to put its own figures in that domain's metadata.  So the
 * worker reads which process the domain's QEMU is from libvirt's qemu
 * driver's status file for it, which only libvirtd (root) writes
 * (libvirt-status.h; not <name>.pid, which the QEMU holds open for
 * writing).  The VM's pid is pagefoldd's own (the agent's socket peer, or
 * the pid it was attached by), not a claim.  A domain whose status names
 * another process, or that has none to be read (not the qemu driver, or
 * not yet written), is skipped, said once per UUID and pid while that VM
 * claims it.  So of VMs that claim one UUID, the domain's own is published
 * and the others are skipped.  (With another driver than qemu:///system's,
 * qemu:///session's included, there is no status file there: nothing is
 * published.)
 *
 * The element (one, namespace urn:pagefold:stats:1, prefix "pagefold"):
 *   <stats pid="4242" updated="2026-12-01T10:00:00Z">
 *     <mode>advise</mode>
 *     <mode_reason>attached by pid</mode_reason>   (only when there is one)
 *     <pages_shared>4002</pages_shared>
 *     <pages_sharing>4498</pages_sharing>
 *     <zero_pages>3000</zero_pages>
 *     <cow>0</cow>
 *     <saved_bytes>30711808</saved_bytes>
 *   </stats>
 * pid is the VM's QEMU, updated when the figures were taken (UTC), and
 * saved_bytes pf_counters_saved_bytes(): (pages_sharing + zero_pages) x
 * 4096.
 */
#pragma once

#include <glib.h>

#include "libvirt-status.h"

#include "scan.h"

#define PF_LIBVIRT_METADATA_NS "urn:pagefold:stats:1"
#define PF_LIBVIRT_METADATA_PREFIX "pagefold"
#define PF_DEFAULT_LIBVIRT_URI "qemu:///system"
/* Where libvirt's qemu driver (qemu:///system) keeps each running domain's
 * status, <domain name>.xml (libvirt-status.h). */
#define PF_LIBVIRT_QEMU_PID_DIR PF_LIBVIRT_QEMU_RUN_DIR

typedef struct _PfLibvirtMetadata PfLibvirtMetadata;

/*
 * Starts the worker (it connects when there is first something to
 * publish) and the timer on the default main context, which reads the
 * scanner's libvirt_metadata_millisecs knob at least once a second, so
 * that a change takes effect within a second.  uri NULL:
 * PF_DEFAULT_LIBVIRT_URI.  Fails only if the thread cannot be made.
 */
PfLibvirtMetadata *pf_libvirt_metadata_new(PfScanner *scanner, const char *uri,
                                           GError **error);
/*
 * Stops the timer and the worker.  Waits for the worker at most
 * PF_LIBVIRT_METADATA_STOP_WAIT_MS: a libvirt call on a responsive
 * libvirtd takes milliseconds, one waiting for a domain's job (held by a
 * hook) up to libvirt's 30 s, one to a hung libvirtd for ever.  A worker
 * still inside libvirt then is left to end on its own (it holds what it
 * uses): what it was setting is refreshed by the next pagefoldd anyway.
 */
#define PF_LIBVIRT_METADATA_STOP_WAIT_MS 2000
void pf_libvirt_metadata_free(PfLibvirtMetadata *m);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfLibvirtMetadata, pf_libvirt_metadata_free)

/* A snapshot now, e.g. when a VM was attached, so that its element need
 * not wait for the interval, which starts again from now.  Nothing when
 * the knob is 0. */
void pf_libvirt_metadata_refresh(PfLibvirtMetadata *m);

/* The element's text for one VM (its counters as pf_scanner_collect()
 * gives them), taken at when. */
char *pf_libvirt_metadata_element(const PfVm *vm, const PfCounters *c, GDateTime *when);

/* For tests (libvirt's test driver keeps no status files): where the
 * worker reads domains' status files from, instead of
 * PF_LIBVIRT_QEMU_PID_DIR, from the next snapshot on. */
void pf_libvirt_metadata_set_pid_dir(PfLibvirtMetadata *m, const char *dir);

/* What the worker did so far, cumulative. */
typedef struct {
    guint64 snapshots;        /* handed to the worker */
    guint64 published;        /* elements set */
    guint64 removed;          /* elements removed (their VM detached) */
    guint64 skipped;          /* UUIDs libvirt does not know, or domains
                               * not running */
    guint64 other_process;    /* domains skipped because their QEMU is not
                               * the VM's process (or which it is is not
                               * known: no status file) */
    guint64 failed;           /* other failures of a call */
    guint64 connect_failures; /* connections libvirt could not make */
    guint64 load_failures;    /* tries to load libvirt that failed */
    gboolean connected;
} PfLibvirtMetadataCounts;
void pf_libvirt_metadata_get_counts(PfLibvirtMetadata *m, PfLibvirtMetadataCounts *counts);

/* For tests (it blocks, so never on pagefoldd's main loop): waits up to
 * timeout_ms until the worker has dealt with every snapshot handed to it
 * so far.  FALSE on timeout. */
gboolean pf_libvirt_metadata_wait(PfLibvirtMetadata *m, guint timeout_ms);
/* For tests: workers of this process still running, those left to end on
 * their own included. */
guint pf_libvirt_metadata_workers(void);
/* For tests: the library workers load libvirt from (NULL: libvirt's own),
 * loaded again at their next connection. */
void pf_libvirt_metadata_set_library(const char *soname);
