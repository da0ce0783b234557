/*
 * hash.h - page checksums.  The scanner keys both trees by a checksum and
 * marks a page volatile when its checksum changes between two visits.
 *
 * A checksum only orders and filters: nothing in pagefold may treat two
 * pages as equal because their checksums are (memcmp decides, see
 * scan-visit.c).
 */
#pragma once

#include <glib.h>

typedef guint64 (*PfHashFunc)(const void *page);

typedef struct {
    const char *name;
    PfHashFunc func;
    const char *description;
} PfHashAlgo;

/* XXH3-64 unless told otherwise; the others exist to be compared with it. */
const PfHashAlgo *pf_hash_default(void);
const PfHashAlgo *pf_hash_lookup(const char *name);
const PfHashAlgo *pf_hash_all(gsize *n_algos);

gboolean pf_page_is_zero(const void *page);
