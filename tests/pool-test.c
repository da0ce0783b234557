/*
 * pool-test.c - the pool on its own: sealed chunks, slots handed out in
 * order so runs stay contiguous, references, and what a freed slot holds.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "guestmem.h"
#include "pool.h"
#include "util.h"

static void
count_chunk(const PfPoolChunk *chunk, gpointer user)
{
    (*(guint *)user)++;
}

/* Chunks are sealed before anyone sees them; slots come in order. */
static void
test_alloc(void)
{
    guint chunks = 0;
    g_autoptr(PfPool) p = pf_pool_new(PF_POOL_ZERO_SLOTS + 4, count_chunk, &chunks);
    guint8 page[PF_PAGE_SIZE];
    guint32 a, b;
    const PfPoolChunk *c;

    pf_fill_page(page, 1);
    a = pf_pool_alloc(p, page, NULL);
    b = pf_pool_alloc(p, page, NULL);
    g_assert_cmpuint(b, ==, a + 1);
    g_assert_false(pf_pool_is_zero_slot(a));
    g_assert_cmpuint(chunks, ==, 1);
    c = g_ptr_array_index(pf_pool_chunks(p), 0);
    g_assert_cmpint(fcntl(c->fd, F_GET_SEALS) & (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), ==,
                    F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
    /* Nobody else can write it. */
    g_assert_true(mmap(NULL, PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd, 0) ==
                  MAP_FAILED);
    g_assert_cmpint(memcmp(pf_pool_data(p, a), page, PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 2);
}

/* A freed slot reads as zeros to every agent that maps its chunk, before
 * it is reused: the page it held is nobody's any more. */
static void
test_freed_slot_is_zeroed(void)
{
    g_autoptr(PfPool) p = pf_pool_new(PF_POOL_ZERO_SLOTS + 4, NULL, NULL);
    static const guint8 zero[PF_PAGE_SIZE];
    guint8 secret[PF_PAGE_SIZE];
    guint32 slot, chunk, index;
    const PfPoolChunk *c;
    guint8 *agent_view;

    pf_fill_page(secret, 42);
    slot = pf_pool_alloc(p, secret, NULL);
    pf_pool_ref(p, slot);
    pf_pool_locate(p, slot, &chunk, &index);
    c = g_ptr_array_index(pf_pool_chunks(p), chunk);
    agent_view = mmap(NULL, (gsize)c->n_slots * PF_PAGE_SIZE, PROT_READ, MAP_SHARED, c->fd, 0);
    g_assert_true(agent_view != MAP_FAILED);
    g_assert_cmpint(memcmp(agent_view + (gsize)index * PF_PAGE_SIZE, secret, PF_PAGE_SIZE), ==, 0);
    g_assert_false(pf_pool_unref(p, slot));
    g_assert_cmpint(memcmp(agent_view + (gsize)index * PF_PAGE_SIZE, secret, PF_PAGE_SIZE), ==, 0);
    g_assert_true(pf_pool_unref(p, slot));
    g_assert_cmpint(memcmp(agent_view + (gsize)index * PF_PAGE_SIZE, zero, PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 0);
    munmap(agent_view, (gsize)c->n_slots * PF_PAGE_SIZE);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/pool/alloc", test_alloc);
    g_test_add_func("/pool/freed-slot-is-zeroed", test_freed_slot_is_zeroed);
    return g_test_run();
}
