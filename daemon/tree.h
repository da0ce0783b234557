/*
 * tree.h - KSM's two trees, ordered by checksum first.
 *
 * KSM keeps pages in rb-trees ordered by memcmp.  pagefold orders them by
 * checksum (64 bits for stable nodes, a page record's 32 for the unstable
 * tree) and stores them in open-addressing hash tables: one probe
 * sequence instead of ~18 pointer-chasing misses per lookup in a 1 GiB tree.
 * The semantics stay KSM's:
 *   - the stable tree holds stable nodes (canonical pages with the guest
 *     pages that share them) and survives passes;
 *   - the unstable tree holds candidate pages seen this pass and is emptied
 *     at the start of every pass.
 * Several entries may carry the same checksum (a collision, or one content
 * in two nodes once max_page_sharing is reached); the iterators return them
 * all and the caller's memcmp decides.  A stable node that can take no more
 * sharers is out of the table (KSM keeps a chain's dup with room first):
 * however many full nodes one content has, a lookup sees only those with
 * room, and the full ones' members know their node from their records.
 * Nothing here ever reads page contents, and nothing here may decide that
 * two pages are equal.
 */
#pragma once

#include <glib.h>

#include "page.h"

/* Returns the record of a page id; the stable tree needs it to keep
 * page->node/slot right when members move (its members always have one). */
typedef PfPage *(*PfPageFunc)(guint32 page_id, gpointer user);

/* NULL for a table of keys below 2^32, which its entries hold whole. */
typedef guint64 (*PfTableKeyFunc)(guint32 value, gpointer user);

/* A stable node's sharing is split evenly over its n members, each holding
 * PF_SHARE_ONE / n of it (rounded down, so a page's part depends only on
 * how many share with it).  The tree tells its embedder every change of a
 * member's part as members come and go, so that what each VM holds of
 * pages_shared is kept up to date instead of counted by walking every
 * node: that walk, once a second, was a tenth of pagefoldd's CPU at KSM's
 * default pace.  2^30 leaves room for 2^34 pages in a 64-bit sum.
 * Past PF_SHARE_TRACKED members a node's parts are not told: that would
 * take a call per member at every join and leave, n^2/2 to fill a node of
 * n one page at a time; such nodes are in `untracked` for the embedder to
 * count by walking them.  KSM's default max_page_sharing fits. */
#define PF_SHARE_ONE (G_GUINT64_CONSTANT(1) << 30)
#define PF_SHARE_TRACKED 256
typedef void (*PfShareFunc)(guint32 page_id, gint64 delta, gpointer user);

typedef struct {
    guint32 tag;   /* folded checksum: filters before the key function */
    guint32 value; /* 0: empty, G_MAXUINT32: removed */
} PfTableEntry;

typedef struct {
    PfTableEntry *slots;
    gsize capacity; /* slots */
    gsize n;       /* live entries */
    gsize removed; /* tombstones */
    PfTableKeyFunc key;
    gpointer user;
} PfTable;

typedef struct {
    const PfTable *table;
    guint64 checksum;
    guint32 tag;
    gsize pos;
    gsize probes;
} PfTableIter;

void pf_table_init(PfTable *t, PfTableKeyFunc key, gpointer user);
void pf_table_destroy(PfTable *t);
void pf_table_clear(PfTable *t);
void pf_table_reserve(PfTable *t, gsize n_entries);
/* Empties the table, sized for n_entries to come (smaller than before,
 * too), without touching the memory of a large one on the caller's
 * thread. */
void pf_table_reset(PfTable *t, gsize n_entries);
void pf_table_insert(PfTable *t, guint64 checksum, guint32 value);
gboolean pf_table_remove(PfTable *t, guint64 checksum, guint32 value);
void pf_table_iter_init(PfTableIter *it, const PfTable *t, guint64 checksum);
/* Next value whose key equals the checksum, or 0 at the end. */
guint32 pf_table_iter_next(PfTableIter *it);
gsize pf_table_bytes(const PfTable *t);

/* ---- unstable tree: page ids keyed by their folded checksum ---- */

typedef struct {
    PfTable table;
} PfUnstableTree;

void pf_unstable_tree_init(PfUnstableTree *t);
void pf_unstable_tree_destroy(PfUnstableTree *t);

/* ---- stable tree: stable nodes, each a canonical page and its sharers ---- */

typedef struct {
    guint64 checksum;
    guint64 born;      /* never the same for two nodes of a tree, whatever
                        * id they had: a node's identity across a pass */
    guint32 *members;  /* page ids of the guest pages sharing it */
    guint32 slot;      /* pool slot holding the content, in merge mode;
                        * 0 in advise mode, where members[0] holds it */
    guint32 next;      /* retired: the node its members move to (the
                        * same content in a slot that more VMs, or a
                        * fuller chunk, hold); it is out of the table */
    guint32 domain;    /* the merge domain of every page it has (vm.h) */
    /* At most G_MAXUINT16, as a record's 16-bit slot indexes members: packed
     * so that a node is 40 bytes, not 48, a byte less of metadata a
     * tracked page where four VMs share (README, bench-scale). */
    guint16 n_members;
    guint8 capacity_shift; /* members has room for 1 << it; 0: no array */
    guint8 live : 1;
    guint8 full : 1;   /* takes no more sharers: out of the table too */
} PfStableNode;

G_STATIC_ASSERT(sizeof(PfStableNode) == 40);

typedef struct {
    PfTable table;    /* checksum -> node id */
    GArray *nodes;    /* PfStableNode, indexed by id; id 0 unused */
    GArray *free_ids; /* guint32 */
    gsize n_nodes;    /* live nodes */
    gsize n_members;  /* pages in all nodes: pages_shared + pages_sharing */
    gsize n_in_use;   /* nodes with a member: pages_shared */
    GHashTable *untracked; /* ids of nodes of over PF_SHARE_TRACKED members */
    gsize member_bytes;
    guint64 births;   /* nodes ever created: the last one's born */
    PfPageFunc page_of;
    PfShareFunc share;
    gpointer user;
} PfStableTree;

/* share may be NULL: nobody is told. */
void pf_stable_tree_init(PfStableTree *t, PfPageFunc page_of, PfShareFunc share,
                         gpointer user);
void pf_stable_tree_destroy(PfStableTree *t);
guint32 pf_stable_tree_create(PfStableTree *t, guint64 checksum, guint32 slot, guint32 domain);
void pf_stable_tree_add(PfStableTree *t, guint32 node_id, guint32 page_id);
/* Takes the page out of its node; TRUE when the node has no member left.
 * The node stays until pf_stable_tree_drop(): in merge mode pages still on
 * their way in or out keep it. */
gboolean pf_stable_tree_remove(PfStableTree *t, guint32 page_id);
void pf_stable_tree_drop(PfStableTree *t, guint32 node_id);
/* Takes the node out of the table, its members staying until they move
 * to next; and back into it, should they have nowhere to go. */
void pf_stable_tree_retire(PfStableTree *t, guint32 node_id, guint32 next);
void pf_stable_tree_unretire(PfStableTree *t, guint32 node_id);
/* The caller counts sharers (in merge mode they are pool references): it
 * says when the node is full, and when it has room again. */
void pf_stable_tree_set_full(PfStableTree *t, guint32 node_id, gboolean full);
const PfStableNode *pf_stable_tree_node(const PfStableTree *t, guint32 node_id);
gsize pf_stable_tree_bytes(const PfStableTree *t);
