/*
 * knobs.h - the scanner's knobs: KSM's names, defaults and meaning (plus
 * pagefold's own few), their bounds, and their JSON.
 *
 * Owns the table of knobs and the checking of a value before it is set;
 * must never act on a knob (the scanner reads them as it runs).
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

typedef struct {
    guint pages_to_scan;         /* pages per wake-up (KSM) */
    guint sleep_millisecs;       /* sleep between wake-ups (KSM) */
    guint cpu_percent;           /* cap: % of one core, 1..100 */
    guint target_pass_millisecs; /* 0: off; else sets the batch size so a
                                  * full pass takes about this long */
    guint max_page_sharing;      /* sharers per canonical page (KSM) */
    gboolean smart_scan;         /* KSM >= 6.7 */
    gboolean use_zero_pages;     /* zero pages apart (KSM) */
    gboolean io_hints;           /* visit first what agents say a device
                                  * just wrote (scan-hints.c) */
    gboolean cpu_use;            /* charge the main thread's CPU to what
                                  * it does, for stats (cpu-use.h) */
    gboolean run;                /* 0: stopped, 1: scanning (KSM) */
    guint max_vma_percent;       /* share of vm.max_map_count a VM may
                                  * reach through merges */
    guint libvirt_metadata_millisecs; /* 0: off; else how often each VM's
                                  * figures go into its libvirt domain's
                                  * live metadata (libvirt-metadata.h);
                                  * always 0 in a build without libvirt */
} PfKnobs;

void pf_knobs_init_default(PfKnobs *k);
/* Validates and sets one knob by its KSM name. */
gboolean pf_knobs_set(PfKnobs *k, const char *name, guint64 value, GError **error);
void pf_knobs_to_json(const PfKnobs *k, JsonBuilder *b);
const char *const *pf_knob_names(void);
