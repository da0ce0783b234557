/*
 * tree-test.c - the checksum-keyed tables behind KSM's two trees: equal
 * checksums coexist, removal leaves the others findable, growth keeps all,
 * a table sized for its entries takes them without growing.
 */
#include <glib.h>
#include <string.h>

#include "tree.h"

/* Value v has key keys[v]: a test double for "page id -> checksum". */
static guint64 keys[5000];

static guint64
key_of(guint32 v, gpointer user)
{
    return keys[v];
}

static GArray *
find_all(PfTable *t, guint64 checksum)
{
    GArray *out = g_array_new(FALSE, FALSE, sizeof(guint32));
    PfTableIter it;
    guint32 v;

    pf_table_iter_init(&it, t, checksum);
    while ((v = pf_table_iter_next(&it)) != 0) {
        g_array_append_val(out, v);
    }
    return out;
}

static void
test_table_duplicates(void)
{
    PfTable t;
    g_autoptr(GArray) found = NULL;

    pf_table_init(&t, key_of, NULL);
    /* 1..3 share a checksum; 4 differs only in its high half (same tag
     * fold would differ), 5 collides in the folded tag only. */
    keys[1] = keys[2] = keys[3] = 0x1234567887654321ull;
    keys[4] = 0x9999567887654321ull;
    keys[5] = 0x8765432112345678ull; /* same xor-fold as keys[1] */
    for (guint32 v = 1; v <= 5; v++) {
        pf_table_insert(&t, keys[v], v);
    }
    found = find_all(&t, keys[1]);
    g_assert_cmpuint(found->len, ==, 3);
    g_assert_true(pf_table_remove(&t, keys[1], 2));
    g_assert_false(pf_table_remove(&t, keys[1], 2));
    g_clear_pointer(&found, g_array_unref);
    found = find_all(&t, keys[1]);
    g_assert_cmpuint(found->len, ==, 2);
    g_assert_cmpuint(g_array_index(found, guint32, 0) + g_array_index(found, guint32, 1), ==, 1 + 3);
    g_clear_pointer(&found, g_array_unref);
    found = find_all(&t, keys[5]);
    g_assert_cmpuint(found->len, ==, 1);
    g_assert_cmpuint(g_array_index(found, guint32, 0), ==, 5);
    g_assert_cmpuint(t.n, ==, 4);
    pf_table_clear(&t);
    g_clear_pointer(&found, g_array_unref);
    found = find_all(&t, keys[1]);
    g_assert_cmpuint(found->len, ==, 0);
    pf_table_destroy(&t);
}

/* Keys of up to 64 bits through a key function, or of 32 held whole in
 * the table (key NULL): each stays findable through growth and churn,
 * within the table's load (max_load_num / max_load_den). */
static void
growth_and_tombstones(PfTableKeyFunc key, guint max_load_num, guint max_load_den)
{
    PfTable t;

    pf_table_init(&t, key, NULL);
    for (guint32 v = 1; v < G_N_ELEMENTS(keys); v++) {
        keys[v] = g_random_int() | (key != NULL ? (guint64)(v % 7) << 40 : 0);
        pf_table_insert(&t, keys[v], v);
        /* Grown by room for half as many entries again, not doubled. */
        if (t.capacity > 64) {
            g_assert_cmpuint(t.capacity, <=, (t.n + t.n / 2) * max_load_den / max_load_num + 1);
        }
    }
    g_assert_cmpuint(t.n, ==, G_N_ELEMENTS(keys) - 1);
    g_assert_cmpuint(t.capacity * max_load_num / max_load_den, >=, t.n);
    /* Remove and re-add many times: tombstones must not fill the table. */
    for (int round = 0; round < 20; round++) {
        for (guint32 v = 1; v < G_N_ELEMENTS(keys); v += 2) {
            g_assert_true(pf_table_remove(&t, keys[v], v));
        }
        for (guint32 v = 1; v < G_N_ELEMENTS(keys); v += 2) {
            pf_table_insert(&t, keys[v], v);
        }
    }
    for (guint32 v = 1; v < G_N_ELEMENTS(keys); v++) {
        g_autoptr(GArray) found = find_all(&t, keys[v]);
        gboolean seen = FALSE;

        for (guint i = 0; i < found->len; i++) {
            seen |= g_array_index(found, guint32, i) == v;
        }
        g_assert_true(seen);
    }
    g_assert_cmpuint(t.n + t.removed, <=, t.capacity * max_load_num / max_load_den);

    /* Sized for what is to come, not to a power of two: those entries go
     * in without the table growing. */
    pf_table_reset(&t, 3001);
    g_assert_cmpuint(t.capacity, <=, 3001 * max_load_den / max_load_num + 1);
    for (guint32 v = 1; v <= 3001; v++) {
        gsize capacity = t.capacity;

        pf_table_insert(&t, keys[v], v);
        g_assert_cmpuint(t.capacity, ==, capacity);
    }

    /* Tombstones overload a table whose live entries are just over half
     * of it: it rehashes, to no fewer slots than it had. */
    pf_table_reset(&t, 875);
    {
        gsize capacity = t.capacity, most = capacity * max_load_num / max_load_den;
        guint32 v = 1;

        for (; v <= most; v++) {
            pf_table_insert(&t, keys[v], v);
        }
        g_assert_cmpuint(t.capacity, ==, capacity);
        for (guint32 gone = 1; t.n > capacity / 2 + 1; gone++) {
            g_assert_true(pf_table_remove(&t, keys[gone], gone));
        }
        pf_table_insert(&t, keys[v], v);
        g_assert_cmpuint(t.removed, ==, 0);
        g_assert_cmpuint(t.capacity, >=, capacity);
    }
    pf_table_destroy(&t);
}

static void
test_table_growth_and_tombstones(void)
{
    growth_and_tombstones(key_of, 3, 4);
}

static void
test_table_whole_keys(void)
{
    growth_and_tombstones(NULL, 7, 8);
}

/* ---- stable tree ---- */

static PfPage pages[600];

static PfPage *
page_of(guint32 id, gpointer user)
{
    return &pages[id];
}

static void
test_stable_tree_members(void)
{
    PfStableTree t;
    guint32 n;
    const PfStableNode *node;

    pf_stable_tree_init(&t, page_of, NULL, NULL);
    n = pf_stable_tree_create(&t, 42, 0, 0);
    for (guint32 id = 10; id < 20; id++) {
        pf_stable_tree_add(&t, n, id);
    }
    node = pf_stable_tree_node(&t, n);
    g_assert_cmpuint(node->n_members, ==, 10);
    g_assert_cmpuint(node->members[0], ==, 10);
    g_assert_cmpuint(t.n_nodes, ==, 1);
    g_assert_cmpuint(t.n_members, ==, 10);

    /* The provider leaves: another member takes its place, and every
     * record still points at its own slot. */
    g_assert_false(pf_stable_tree_remove(&t, 10));
    node = pf_stable_tree_node(&t, n);
    g_assert_cmpuint(node->n_members, ==, 9);
    g_assert_cmpuint(node->members[0], ==, 19);
    for (guint32 i = 0; i < node->n_members; i++) {
        g_assert_cmpuint(pages[node->members[i]].slot, ==, i);
        g_assert_cmpuint(pages[node->members[i]].node, ==, n);
    }
    for (guint32 id = 11; id < 20; id++) {
        g_assert_true(pf_stable_tree_remove(&t, id) == (id == 19));
    }
    /* The last one out says so; dropping frees the node and its entry. */
    g_assert_cmpuint(t.n_nodes, ==, 1);
    pf_stable_tree_drop(&t, n);
    g_assert_cmpuint(t.n_nodes, ==, 0);
    g_assert_cmpuint(t.n_members, ==, 0);
    g_assert_cmpuint(t.table.n, ==, 0);
    g_assert_cmpuint(t.member_bytes, ==, 0);
    /* Its id is reused. */
    g_assert_cmpuint(pf_stable_tree_create(&t, 43, 0, 0), ==, n);
    pf_stable_tree_destroy(&t);
}

static PfPage *
page_in(guint32 id, gpointer user)
{
    return &((PfPage *)user)[id];
}

/* A node's count and room are 16 bits and a shift (40-byte nodes): it
 * still takes as many members as a record's 16-bit slot indexes. */
static void
test_stable_tree_most_members(void)
{
    g_autofree PfPage *many = g_new0(PfPage, G_MAXUINT16 + 1);
    PfStableTree t;
    const PfStableNode *node;
    guint32 n;

    pf_stable_tree_init(&t, page_in, NULL, many);
    n = pf_stable_tree_create(&t, 42, 0, 0);
    for (guint32 id = 1; id <= G_MAXUINT16; id++) {
        pf_stable_tree_add(&t, n, id);
    }
    node = pf_stable_tree_node(&t, n);
    g_assert_cmpuint(node->n_members, ==, G_MAXUINT16);
    g_assert_cmpuint(t.member_bytes, ==, (G_MAXUINT16 + 1) * sizeof(guint32));
    g_assert_cmpuint(node->members[G_MAXUINT16 - 1], ==, G_MAXUINT16);
    g_assert_cmpuint(many[G_MAXUINT16].slot, ==, G_MAXUINT16 - 1);
    g_assert_false(pf_stable_tree_remove(&t, 7));
    g_assert_cmpuint(node->members[6], ==, G_MAXUINT16);
    g_assert_cmpuint(many[G_MAXUINT16].slot, ==, 6);
    for (guint32 id = 1; id <= G_MAXUINT16; id++) {
        if (id != 7) {
            pf_stable_tree_remove(&t, id);
        }
    }
    g_assert_cmpuint(node->n_members, ==, 0);
    pf_stable_tree_drop(&t, n);
    g_assert_cmpuint(t.member_bytes, ==, 0);
    /* Its id comes back with no array: room for 4 when 3 join. */
    g_assert_cmpuint(pf_stable_tree_create(&t, 43, 0, 0), ==, n);
    for (guint32 id = 1; id <= 3; id++) {
        pf_stable_tree_add(&t, n, id);
    }
    g_assert_cmpuint(t.member_bytes, ==, 4 * sizeof(guint32));
    pf_stable_tree_destroy(&t);
}

static gboolean
found(PfStableTree *t, guint64 checksum, guint32 id)
{
    PfTableIter it;
    guint32 v;

    pf_table_iter_init(&it, &t->table, checksum);
    while ((v = pf_table_iter_next(&it)) != 0) {
        if (v == id) {
            return TRUE;
        }
    }
    return FALSE;
}

/* A full node is out of the table, as a retired one is; it comes back
 * when it has room, unless retired meanwhile, and a retired node comes
 * back only if it has room. */
static void
test_stable_tree_full(void)
{
    PfStableTree t;
    guint32 a, b;

    pf_stable_tree_init(&t, page_of, NULL, NULL);
    a = pf_stable_tree_create(&t, 42, 0, 0);
    b = pf_stable_tree_create(&t, 42, 0, 0);
    pf_stable_tree_add(&t, a, 100);
    pf_stable_tree_set_full(&t, a, TRUE);
    g_assert_false(found(&t, 42, a));
    g_assert_true(found(&t, 42, b));
    pf_stable_tree_set_full(&t, a, TRUE);
    g_assert_cmpuint(t.table.n, ==, 1);
    pf_stable_tree_set_full(&t, a, FALSE);
    g_assert_true(found(&t, 42, a));

    pf_stable_tree_retire(&t, a, b);
    pf_stable_tree_set_full(&t, a, TRUE);
    pf_stable_tree_set_full(&t, a, FALSE);
    g_assert_false(found(&t, 42, a));
    pf_stable_tree_set_full(&t, a, TRUE);
    pf_stable_tree_unretire(&t, a);
    g_assert_false(found(&t, 42, a));
    pf_stable_tree_set_full(&t, a, FALSE);
    g_assert_true(found(&t, 42, a));

    /* Dropped while full: nothing of it is left in the table. */
    pf_stable_tree_set_full(&t, a, TRUE);
    pf_stable_tree_remove(&t, 100);
    pf_stable_tree_drop(&t, a);
    g_assert_cmpuint(t.table.n, ==, 1);
    g_assert_cmpuint(pf_stable_tree_create(&t, 43, 0, 0), ==, a);
    g_assert_true(found(&t, 43, a));
    g_assert_false(pf_stable_tree_node(&t, a)->full);
    pf_stable_tree_destroy(&t);
}

/* Owners of pages in the share test: page id % N_OWNERS. */
#define N_OWNERS 3
static guint64 owner_share[N_OWNERS];

static void
owner_add(guint32 id, gint64 delta, gpointer user)
{
    owner_share[id % N_OWNERS] += (guint64)delta;
}

/* What the embedder is told, summed per owner, is at every step what a
 * walk over every node of up to PF_SHARE_TRACKED members counts:
 * PF_SHARE_ONE / n for each member of a node of n; bigger ones are those
 * untracked; the nodes in use are those with a member.  Steps add pages
 * to the nodes, then add or remove at random, then remove them all, so
 * nodes grow past the bound and come back under it. */
static void
test_stable_tree_shares(void)
{
    PfStableTree t;
    guint32 nodes[2];
    const guint32 n_pages = G_N_ELEMENTS(pages);
    GRand *rand = g_rand_new_with_seed(7);

    memset(owner_share, 0, sizeof(owner_share));
    pf_stable_tree_init(&t, page_of, owner_add, NULL);
    for (guint i = 0; i < G_N_ELEMENTS(nodes); i++) {
        nodes[i] = pf_stable_tree_create(&t, 100 + i, 0, 0);
    }
    for (guint step = 0; step < 3 * n_pages; step++) {
        guint32 id = (guint32)g_rand_int_range(rand, 1, (gint32)n_pages);
        gboolean add = step < n_pages ? TRUE : step < 2 * n_pages ? g_rand_boolean(rand) : FALSE;
        guint64 want[N_OWNERS] = { 0 };
        gsize in_use = 0, untracked = 0;

        if (pages[id].node != 0 && !add) {
            pf_stable_tree_remove(&t, id);
        } else if (pages[id].node == 0 && add) {
            /* Mostly to the first node, which grows past the bound. */
            pf_stable_tree_add(&t, nodes[g_rand_int_range(rand, 0, 4) == 0], id);
        }
        for (guint i = 0; i < G_N_ELEMENTS(nodes); i++) {
            const PfStableNode *n = pf_stable_tree_node(&t, nodes[i]);

            in_use += n->n_members > 0;
            if (n->n_members > PF_SHARE_TRACKED) {
                g_assert_true(g_hash_table_contains(t.untracked, GUINT_TO_POINTER(nodes[i])));
                untracked++;
                continue;
            }
            for (guint32 m = 0; m < n->n_members; m++) {
                want[n->members[m] % N_OWNERS] += PF_SHARE_ONE / n->n_members;
            }
        }
        for (guint o = 0; o < N_OWNERS; o++) {
            g_assert_cmpuint(owner_share[o], ==, want[o]);
        }
        g_assert_cmpuint(t.n_in_use, ==, in_use);
        g_assert_cmpuint(g_hash_table_size(t.untracked), ==, untracked);
        if (step == n_pages - 1) {
            g_assert_cmpuint(untracked, ==, 1); /* it did grow past */
        }
    }
    for (guint32 id = 1; id < n_pages; id++) {
        if (pages[id].node != 0) {
            pf_stable_tree_remove(&t, id);
        }
    }
    for (guint o = 0; o < N_OWNERS; o++) {
        g_assert_cmpuint(owner_share[o], ==, 0);
    }
    g_assert_cmpuint(t.n_in_use, ==, 0);
    g_rand_free(rand);
    pf_stable_tree_destroy(&t);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/tree/table/duplicates", test_table_duplicates);
    g_test_add_func("/tree/table/growth-and-tombstones", test_table_growth_and_tombstones);
    g_test_add_func("/tree/table/whole-keys", test_table_whole_keys);
    g_test_add_func("/tree/stable/members", test_stable_tree_members);
    g_test_add_func("/tree/stable/most-members", test_stable_tree_most_members);
    g_test_add_func("/tree/stable/full", test_stable_tree_full);
    g_test_add_func("/tree/stable/shares", test_stable_tree_shares);
    return g_test_run();
}
