/*
 * tree.c - KSM's two trees as checksum-keyed tables (tree.h): owns the
 * tables and the stable nodes, never a page's content.  Linear probing with
 * tombstones: removal is rare next to lookups, and tombstones avoid having
 * to re-key neighbours (a cache miss into a page record each).  A table
 * of 32-bit keys (no key function: the unstable tree's folded checksums)
 * holds each key whole in its entry and never looks anywhere else.
 */
#include "tree.h"

#include <string.h>

#define TOMBSTONE G_MAXUINT32
#define MIN_CAPACITY 64

static inline guint32
fold_tag(guint64 checksum)
{
    return (guint32)checksum ^ (guint32)(checksum >> 32);
}

static inline gsize
home_slot(const PfTable *t, guint64 checksum)
{
    /* Fibonacci hashing: jhash2 and crc32c leave bits unused, xxh3 does not
     * need it, and the multiply costs nothing next to the cache miss. */
    guint64 h = checksum * 0x9E3779B97F4A7C15ull;

    /* Any capacity, not only powers of two: the high bits of h scaled to
     * it (a table sized for its entries is up to half the size). */
    return (gsize)(((unsigned __int128)h * t->capacity) >> 64);
}

/* The slot a probe goes to after i. */
static inline gsize
next_slot(const PfTable *t, gsize i)
{
    return i + 1 == t->capacity ? 0 : i + 1;
}

void
pf_table_init(PfTable *t, PfTableKeyFunc key, gpointer user)
{
    memset(t, 0, sizeof(*t));
    t->key = key;
    t->user = user;
    t->capacity = MIN_CAPACITY;
    t->slots = g_new0(PfTableEntry, MIN_CAPACITY);
}

void
pf_table_destroy(PfTable *t)
{
    g_clear_pointer(&t->slots, g_free);
    t->n = t->removed = 0;
}

void
pf_table_clear(PfTable *t)
{
    memset(t->slots, 0, t->capacity * sizeof(PfTableEntry));
    t->n = t->removed = 0;
}

static void
table_place(PfTable *t, guint64 checksum, guint32 value)
{
    gsize i = home_slot(t, checksum);

    while (t->slots[i].value != 0 && t->slots[i].value != TOMBSTONE) {
        i = next_slot(t, i);
    }
    if (t->slots[i].value == TOMBSTONE) {
        t->removed--;
    }
    t->slots[i].tag = fold_tag(checksum);
    t->slots[i].value = value;
    t->n++;
}

static void
table_rehash(PfTable *t, gsize capacity)
{
    PfTableEntry *old = t->slots;
    gsize old_capacity = t->capacity;

    t->slots = g_new0(PfTableEntry, capacity);
    t->capacity = capacity;
    t->n = t->removed = 0;
    for (gsize i = 0; i < old_capacity; i++) {
        guint32 v = old[i].value;

        if (v != 0 && v != TOMBSTONE) {
            table_place(t, t->key != NULL ? t->key(v, t->user) : old[i].tag, v);
        }
    }
    g_free(old);
}

/* Whether n entries (tombstones included) are too many for a capacity:
 * past 3/4 where a probe may call the key function (a cache miss into a
 * record or a node), past 7/8 where entries hold their keys whole and a
 * probe reads only the table's own cache lines. */
static gboolean
overloaded(const PfTable *t, gsize n, gsize capacity)
{
    return t->key != NULL ? n * 4 > capacity * 3 : n * 8 > capacity * 7;
}

/* The least capacity that n_entries do not overload. */
static gsize
capacity_for(const PfTable *t, gsize n_entries)
{
    gsize extra = t->key != NULL ? n_entries / 3 : n_entries / 7;

    return MAX(MIN_CAPACITY, n_entries + extra + 1);
}

void
pf_table_reserve(PfTable *t, gsize n_entries)
{
    gsize want = capacity_for(t, n_entries);

    if (want > t->capacity) {
        table_rehash(t, want);
    }
}

/* Tables larger than this are freed by a thread of their own: giving back
 * gigabytes takes the kernel a while, and the caller is the main loop. */
#define FREE_APART_BYTES (1u << 20)

static GMutex freeing_lock;
static GThreadPool *freeing;

static void
free_slots(gpointer data, gpointer user)
{
    g_free(data);
}

static void
free_apart(PfTableEntry *slots, gsize bytes)
{
    g_mutex_lock(&freeing_lock);
    if (bytes > FREE_APART_BYTES && freeing == NULL) {
        freeing = g_thread_pool_new(free_slots, NULL, 1, FALSE, NULL);
    }
    if (bytes > FREE_APART_BYTES && freeing != NULL) {
        g_thread_pool_push(freeing, slots, NULL);
        slots = NULL;
    }
    g_mutex_unlock(&freeing_lock);
    g_free(slots);
}

void
pf_table_reset(PfTable *t, gsize n_entries)
{
    gsize want = capacity_for(t, n_entries), bytes = t->capacity * sizeof(PfTableEntry);
    PfTableEntry *fresh = NULL;

    /* A large table comes zeroed from the kernel, untouched until entries
     * land in it: no pass begins with a memset of gigabytes. */
    if (want != t->capacity || bytes > FREE_APART_BYTES) {
        fresh = g_try_new0(PfTableEntry, want);
    }
    if (fresh == NULL) {
        pf_table_clear(t);
        return;
    }
    free_apart(t->slots, bytes);
    t->slots = fresh;
    t->capacity = want;
    t->n = t->removed = 0;
}

void
pf_table_insert(PfTable *t, guint64 checksum, guint32 value)
{
    g_assert(value != 0 && value != TOMBSTONE);
    g_assert(t->key != NULL || checksum <= G_MAXUINT32);
    if (overloaded(t, t->n + t->removed + 1, t->capacity)) {
        /* Many tombstones: rehashing at the same size is enough.  Else
         * room for half as many entries again, not twice as many (never
         * less than it has: a table churned by tombstones would rehash
         * ever sooner): a table that doubles is about a sixth larger on
         * average, and where VMs share pages the two trees' tables are a
         * fifth of the metadata (README, bench-scale). */
        gsize capacity = t->capacity;

        if ((t->n + 1) * 2 > capacity) {
            capacity = MAX(capacity, capacity_for(t, (t->n + 1) + (t->n + 1) / 2));
        }
        table_rehash(t, capacity);
    }
    table_place(t, checksum, value);
}

void
pf_table_iter_init(PfTableIter *it, const PfTable *t, guint64 checksum)
{
    it->table = t;
    it->checksum = checksum;
    it->tag = fold_tag(checksum);
    it->pos = home_slot(t, checksum);
    it->probes = 0;
}

static gssize
iter_next_slot(PfTableIter *it)
{
    const PfTable *t = it->table;

    while (it->probes < t->capacity) {
        gsize i = it->pos;
        const PfTableEntry *e = &t->slots[i];

        it->pos = next_slot(t, it->pos);
        it->probes++;
        if (e->value == 0) {
            it->probes = t->capacity;
            return -1;
        }
        if (e->value != TOMBSTONE && e->tag == it->tag &&
            (t->key == NULL || t->key(e->value, t->user) == it->checksum)) {
            return (gssize)i;
        }
    }
    return -1;
}

guint32
pf_table_iter_next(PfTableIter *it)
{
    gssize i = iter_next_slot(it);

    return i < 0 ? 0 : it->table->slots[i].value;
}

gboolean
pf_table_remove(PfTable *t, guint64 checksum, guint32 value)
{
    PfTableIter it;
    gssize i;

    pf_table_iter_init(&it, t, checksum);
    while ((i = iter_next_slot(&it)) >= 0) {
        if (t->slots[i].value == value) {
            t->slots[i].value = TOMBSTONE;
            t->n--;
            t->removed++;
            return TRUE;
        }
    }
    return FALSE;
}

gsize
pf_table_bytes(const PfTable *t)
{
    return t->capacity * sizeof(PfTableEntry);
}

/* ---- unstable tree ---- */

void
pf_unstable_tree_init(PfUnstableTree *t)
{
    /* A page's entry keeps the checksum it went in with: one that changed
     * since, or left the tree, is told apart by its record's state and by
     * memcmp(), as any other candidate. */
    pf_table_init(&t->table, NULL, NULL);
}

void
pf_unstable_tree_destroy(PfUnstableTree *t)
{
    pf_table_destroy(&t->table);
    /* What was being freed apart is freed when this returns. */
    g_mutex_lock(&freeing_lock);
    if (freeing != NULL) {
        g_thread_pool_free(freeing, FALSE, TRUE);
        freeing = NULL;
    }
    g_mutex_unlock(&freeing_lock);
}

/* ---- stable tree ---- */

static PfStableNode *
node_at(const PfStableTree *t, guint32 id)
{
    return &g_array_index(t->nodes, PfStableNode, id);
}

static guint32
node_capacity(const PfStableNode *n)
{
    return n->capacity_shift != 0 ? 1u << n->capacity_shift : 0;
}

/* Whether lookups find the node: neither retired nor full. */
static gboolean
listed(const PfStableNode *n)
{
    return n->live && n->next == 0 && !n->full;
}

static guint64
stable_key(guint32 node_id, gpointer user)
{
    return node_at(user, node_id)->checksum;
}

void
pf_stable_tree_init(PfStableTree *t, PfPageFunc page_of, PfShareFunc share, gpointer user)
{
    memset(t, 0, sizeof(*t));
    t->page_of = page_of;
    t->share = share;
    t->user = user;
    t->nodes = g_array_new(FALSE, TRUE, sizeof(PfStableNode));
    g_array_set_size(t->nodes, 1);
    t->free_ids = g_array_new(FALSE, FALSE, sizeof(guint32));
    t->untracked = g_hash_table_new(NULL, NULL);
    pf_table_init(&t->table, stable_key, t);
}

void
pf_stable_tree_destroy(PfStableTree *t)
{
    if (t->nodes == NULL) {
        return;
    }
    for (guint i = 0; i < t->nodes->len; i++) {
        g_free(node_at(t, i)->members);
    }
    g_clear_pointer(&t->nodes, g_array_unref);
    g_clear_pointer(&t->free_ids, g_array_unref);
    g_clear_pointer(&t->untracked, g_hash_table_unref);
    pf_table_destroy(&t->table);
}

guint32
pf_stable_tree_create(PfStableTree *t, guint64 checksum, guint32 slot, guint32 domain)
{
    guint32 id;
    PfStableNode *n;

    if (t->free_ids->len > 0) {
        id = g_array_index(t->free_ids, guint32, t->free_ids->len - 1);
        g_array_set_size(t->free_ids, t->free_ids->len - 1);
    } else {
        id = t->nodes->len;
        g_assert(id < G_MAXUINT32 - 1);
        g_array_set_size(t->nodes, id + 1);
    }
    n = node_at(t, id);
    n->checksum = checksum;
    n->n_members = 0;
    n->slot = slot;
    n->next = 0;
    n->live = TRUE;
    n->full = FALSE;
    n->domain = domain;
    n->born = ++t->births;
    pf_table_insert(&t->table, checksum, id);
    t->n_nodes++;
    return id;
}

/* A member's part of a node of n members, as told (tree.h). */
static gint64
part(guint32 n_members)
{
    return n_members > 0 && n_members <= PF_SHARE_TRACKED ? (gint64)(PF_SHARE_ONE / n_members)
                                                          : 0;
}

static void
tell(PfStableTree *t, guint32 page_id, gint64 delta)
{
    if (t->share != NULL && delta != 0) {
        t->share(page_id, delta, t->user);
    }
}

/* The node's members, as they are, go from a part of `was` to one of
 * `now` members. */
static void
reshare(PfStableTree *t, guint32 id, const PfStableNode *n, guint32 was, guint32 now)
{
    gint64 delta = part(now) - part(was);

    if ((was > PF_SHARE_TRACKED) != (now > PF_SHARE_TRACKED)) {
        if (now > PF_SHARE_TRACKED) {
            g_hash_table_add(t->untracked, GUINT_TO_POINTER(id));
        } else {
            g_hash_table_remove(t->untracked, GUINT_TO_POINTER(id));
        }
    }
    for (guint32 m = 0; delta != 0 && m < n->n_members; m++) {
        tell(t, n->members[m], delta);
    }
}

void
pf_stable_tree_add(PfStableTree *t, guint32 node_id, guint32 page_id)
{
    PfStableNode *n = node_at(t, node_id);
    PfPage *p = t->page_of(page_id, t->user);
    guint32 room;

    g_assert(n->n_members < G_MAXUINT16);
    reshare(t, node_id, n, n->n_members, n->n_members + 1);
    t->n_in_use += n->n_members == 0;
    room = node_capacity(n);
    if (n->n_members == room) {
        n->capacity_shift = room != 0 ? n->capacity_shift + 1 : 1;
        n->members = g_renew(guint32, n->members, node_capacity(n));
        t->member_bytes += (node_capacity(n) - room) * sizeof(guint32);
    }
    p->node = node_id;
    p->slot = (guint16)n->n_members;
    n->members[n->n_members++] = page_id;
    t->n_members++;
    tell(t, page_id, part(n->n_members));
}

gboolean
pf_stable_tree_remove(PfStableTree *t, guint32 page_id)
{
    PfPage *p = t->page_of(page_id, t->user);
    guint32 id = p->node, last;
    PfStableNode *n = node_at(t, id);

    g_assert(p->slot < n->n_members && n->members[p->slot] == page_id);
    tell(t, page_id, -part(n->n_members));
    /* Swap the last member in; when slot 0 goes, that member becomes the
     * one holding the content, which was equal at its own last visit. */
    last = n->members[--n->n_members];
    if (last != page_id) {
        n->members[p->slot] = last;
        t->page_of(last, t->user)->slot = p->slot;
    }
    t->n_members--;
    p->node = 0;
    p->slot = 0;
    reshare(t, id, n, n->n_members + 1, n->n_members);
    t->n_in_use -= n->n_members == 0;
    return n->n_members == 0;
}

void
pf_stable_tree_drop(PfStableTree *t, guint32 id)
{
    PfStableNode *n = node_at(t, id);

    g_assert(n->live && n->n_members == 0);
    if (listed(n)) {
        pf_table_remove(&t->table, n->checksum, id);
    }
    n->next = 0;
    n->full = FALSE;
    t->member_bytes -= node_capacity(n) * sizeof(guint32);
    g_clear_pointer(&n->members, g_free);
    n->capacity_shift = 0;
    n->live = FALSE;
    t->n_nodes--;
    g_array_append_val(t->free_ids, id);
}

void
pf_stable_tree_retire(PfStableTree *t, guint32 id, guint32 next)
{
    PfStableNode *n = node_at(t, id);

    g_assert(n->live && n->next == 0 && next != 0 && next != id);
    if (listed(n)) {
        pf_table_remove(&t->table, n->checksum, id);
    }
    n->next = next;
}

void
pf_stable_tree_unretire(PfStableTree *t, guint32 id)
{
    PfStableNode *n = node_at(t, id);

    g_assert(n->live && n->next != 0);
    n->next = 0;
    if (listed(n)) {
        pf_table_insert(&t->table, n->checksum, id);
    }
}

void
pf_stable_tree_set_full(PfStableTree *t, guint32 id, gboolean full)
{
    PfStableNode *n = node_at(t, id);

    g_assert(n->live);
    if (n->full == full) {
        return;
    }
    if (listed(n)) {
        pf_table_remove(&t->table, n->checksum, id);
    }
    n->full = full;
    if (listed(n)) {
        pf_table_insert(&t->table, n->checksum, id);
    }
}

const PfStableNode *
pf_stable_tree_node(const PfStableTree *t, guint32 node_id)
{
    return node_at(t, node_id);
}

gsize
pf_stable_tree_bytes(const PfStableTree *t)
{
    return pf_table_bytes(&t->table) + t->member_bytes +
           t->nodes->len * sizeof(PfStableNode) +
           t->free_ids->len * sizeof(guint32);
}
