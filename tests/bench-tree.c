/*
 * bench-tree.c - one unstable-tree pass three ways, on the same pages:
 *   memcmp-tree    ordered by memcmp alone, as kernel KSM's rb-trees
 *   checksum-tree  ordered by checksum, memcmp between equal checksums
 *                  (the 2017 "use checksum and memcmp for rb_tree" patch)
 *   checksum-table pagefold: open addressing keyed by checksum (tree.c)
 * Each page is searched and, if no equal page is found, inserted; an equal
 * page is taken out, as KSM does when it merges.  The trees are GLib's
 * balanced GTree (AVL, pointer-chasing like an rb-tree).  Checksums are
 * computed beforehand: this measures the trees, not the hash.
 */
#include <string.h>

#include "bench-common.h"
#include "guestmem.h"
#include "hash.h"
#include "tree.h"
#include "util.h"

#define PAGES (2u * 65536u) /* two 256 MiB guests */

static guint8 *mem;
static guint64 *sums;
static guint64 memcmps;

static inline const guint8 *
page(guint32 id)
{
    return mem + (gsize)(id - 1) * PF_PAGE_SIZE;
}

static gint
cmp_memcmp(gconstpointer a, gconstpointer b, gpointer user)
{
    memcmps++;
    return memcmp(page(GPOINTER_TO_UINT(a)), page(GPOINTER_TO_UINT(b)), PF_PAGE_SIZE);
}

static gint
cmp_checksum(gconstpointer a, gconstpointer b, gpointer user)
{
    guint64 x = sums[GPOINTER_TO_UINT(a)], y = sums[GPOINTER_TO_UINT(b)];

    if (x != y) {
        return x < y ? -1 : 1;
    }
    return cmp_memcmp(a, b, user);
}

static double
pass_gtree(GCompareDataFunc cmp)
{
    g_autoptr(GTree) t = g_tree_new_full(cmp, NULL, NULL, NULL);
    double start = bench_now();

    for (guint32 id = 1; id <= PAGES; id++) {
        gpointer key = GUINT_TO_POINTER(id);

        if (g_tree_lookup_extended(t, key, NULL, NULL)) {
            g_tree_remove(t, key);
        } else {
            g_tree_insert(t, key, key);
        }
    }
    return bench_now() - start;
}

static guint64
key_of(guint32 v, gpointer user)
{
    return sums[v];
}

static double
pass_table(void)
{
    PfTable t;
    double start;

    pf_table_init(&t, key_of, NULL);
    pf_table_reserve(&t, PAGES);
    start = bench_now();
    for (guint32 id = 1; id <= PAGES; id++) {
        PfTableIter it;
        guint32 other;
        gboolean found = FALSE;

        pf_table_iter_init(&it, &t, sums[id]);
        while ((other = pf_table_iter_next(&it)) != 0) {
            memcmps++;
            if (memcmp(page(id), page(other), PF_PAGE_SIZE) == 0) {
                pf_table_remove(&t, sums[id], other);
                found = TRUE;
                break;
            }
        }
        if (!found) {
            pf_table_insert(&t, sums[id], id);
        }
    }
    start = bench_now() - start;
    pf_table_destroy(&t);
    return start;
}

int
main(int argc, char **argv)
{
    int reps = bench_reps();
    const char *names[] = { "memcmp-tree", "checksum-tree", "checksum-table" };

    mem = g_malloc((gsize)PAGES * PF_PAGE_SIZE);
    sums = g_new(guint64, PAGES + 1);
    /* Guest-like: per guest 50% identical across guests, 20% zero, the
     * rest unique. */
    for (guint32 i = 0; i < PAGES; i++) {
        guint32 guest = i / (PAGES / 2), idx = i % (PAGES / 2);
        guint64 seed = idx < PAGES / 4 ? pf_page_seed(1, 0, idx, 0)
                       : idx < PAGES / 4 + PAGES / 10 ? 0
                       : pf_page_seed(3, guest + 1, idx, 0);

        pf_fill_page(mem + (gsize)i * PF_PAGE_SIZE, seed);
        sums[i + 1] = pf_hash_default()->func(mem + (gsize)i * PF_PAGE_SIZE);
    }
    for (int v = 0; v < 3; v++) {
        g_autofree double *secs = g_new(double, reps);
        guint64 calls = 0;

        for (int r = 0; r < reps; r++) {
            memcmps = 0;
            secs[r] = v == 0 ? pass_gtree(cmp_memcmp)
                      : v == 1 ? pass_gtree(cmp_checksum) : pass_table();
            calls = memcmps;
        }
        printf("{\"bench\":\"tree\",\"variant\":\"%s\",\"pages\":%u,\"pass_s\":%.4f,"
               "\"ns_per_page\":%.1f,\"memcmp_per_pass\":%" G_GUINT64_FORMAT
               ",\"memcmp_per_page\":%.2f,\"reps\":%d}\n",
               names[v], PAGES, bench_median(secs, reps), bench_median(secs, reps) * 1e9 / PAGES,
               calls, (double)calls / PAGES, reps);
    }
    g_free(sums);
    g_free(mem);
    return 0;
}
