/*
 * stats.h - KSM's counters, how they are attributed to VMs, and how they are
 * shown (JSON on the control socket; a table and Prometheus text in
 * pagefoldctl, which formats from that JSON).
 *
 * The names and meanings are KSM's (Documentation/admin-guide/mm/ksm.rst):
 *   pages_shared    canonical pages in use (stable nodes)
 *   pages_sharing   pages that share them, beyond the canonical one: saved
 *   pages_unshared  unique pages repeatedly checked (in the unstable tree)
 *   pages_volatile  pages changing too fast to be put in a tree
 *   pages_skipped   smart scan: visits skipped, cumulative
 *   pages_scanned   pages visited, cumulative
 *   full_scans      completed passes
 *   zero_pages      all-zero pages (KSM's ksm_zero_pages with use_zero_pages)
 *   general_profit  bytes saved minus the bytes of pagefold's metadata
 * and pagefold's own:
 *   pages_pending   pages an agent is merging or unmerging right now
 *   cow             merged pages the guest wrote since (copy-on-write)
 *   backend_fold_backs  merged pages folded back because a vhost-user
 *                   back-end (virtiofsd) touched them, cumulative; KSM has
 *                   no such thing, since no other process maps what it merges
 *   vmas            mappings of the VM's process (merge mode)
 *   pages_hinted    visits of pages its agent said a device had just
 *                   written (disk reads), made before the cursor's: of
 *                   pages_scanned, cumulative
 *   hints_dropped   such pages not visited first, since more came than
 *                   pagefoldd keeps for a VM (65536 pages in 8192 ranges),
 *                   cumulative
 *
 * Attribution: a canonical page used by n guest pages counts 1/n to the VM
 * of each of them.  Those fractions are rounded by the largest-remainder
 * method so that the per-VM integers add up exactly to the totals; every
 * per-VM pages_shared is within 1 of its exact share.
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

typedef struct {
    guint64 pages_shared;
    guint64 pages_sharing;
    guint64 pages_unshared;
    guint64 pages_volatile;
    guint64 pages_skipped;
    guint64 pages_scanned;
    guint64 full_scans;
    guint64 zero_pages;
    guint64 pages_pending;
    guint64 cow;
    guint64 backend_fold_backs;
    guint64 vmas;
    guint64 pages_hinted;
    guint64 hints_dropped;
    guint64 pages_tracked;  /* pages with a record: KSM's rmap_items */
    guint64 metadata_bytes;
    gint64 general_profit;
} PfCounters;

/*
 * Splits total (an integer) into n integer parts proportional to shares,
 * by largest remainder: parts sum to total exactly.  shares need not sum to
 * total; ties go to the lower index.
 */
void pf_apportion(guint64 total, const double *shares, gsize n, guint64 *parts);

void pf_counters_add(PfCounters *sum, const PfCounters *c);
/* The bytes merging saves (or, in advise mode, would save): a page each
 * that shares a canonical page beyond it, and each zero page, KSM's
 * general_profit before the metadata is taken off.  The SAVED_MIB column
 * and libvirt's metadata (libvirt-metadata.h) show it. */
guint64 pf_counters_saved_bytes(const PfCounters *c);
void pf_counters_to_json(const PfCounters *c, JsonBuilder *b);

/* The field names of PfCounters in output order, NULL-terminated. */
const char *const *pf_counter_names(void);

/* Render the JSON returned by the "stats" command. */
/* with_total: a last row of all VMs' figures (not when one VM was asked
 * for). */
char *pf_stats_format_table(JsonObject *stats, gboolean with_total);
char *pf_stats_format_prometheus(JsonObject *stats);
