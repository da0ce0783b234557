/*
 * pagespace.h - the page-id space: one 32-bit number for every page of
 * guest RAM pagefoldd tracks, in all VMs, and the way back from a number
 * to its region and its record.
 *
 * A region is placed at a base (the first id of a free run as long as it
 * is) and keeps it until it is removed; ids are what the trees and the
 * requests hold.  The space owns no region: it only orders them by base.
 * It must never allocate a record, read guest RAM or know what a page's
 * state means.
 */
#pragma once

#include <glib.h>

#include "vm.h"

typedef struct {
    GPtrArray *regions; /* PfRegion* of all VMs, sorted by base */
    PfRegion *last;     /* the last one looked up: lookups come in runs */
} PfPageSpace;

void pf_page_space_init(PfPageSpace *ps);
void pf_page_space_destroy(PfPageSpace *ps);

/* Gives r a base (r->base) where its pages fit; FALSE when no run of ids
 * is long enough (ids are 32-bit: 16 TiB of RAM in all). */
gboolean pf_page_space_place(PfPageSpace *ps, PfRegion *r);
void pf_page_space_remove(PfPageSpace *ps, PfRegion *r);

/* The region that holds page id, which must be placed. */
PfRegion *pf_page_space_region(PfPageSpace *ps, guint32 id);
/* The record of page id, or NULL if it has none (it is absent). */
PfPage *pf_page_space_page(PfPageSpace *ps, guint32 id);
/* Where page id is mapped in pagefoldd (read-only). */
const guint8 *pf_page_space_data(PfPageSpace *ps, guint32 id);
/* The region whose mapping holds addr, or NULL. */
PfRegion *pf_page_space_at_address(PfPageSpace *ps, const void *addr);
