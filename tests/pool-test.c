/*
 * pool-test.c - the pool on its own: sealed chunks, one set of VMs per
 * chunk, slots handed out in order so runs stay contiguous, references,
 * what a freed slot holds, and chunks that go.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "guestmem.h"
#include "pool.h"
#include "util.h"

typedef struct {
    guint made, dropped;
    guint32 last_dropped;
    guint last_n_vms;
} Seen;

static void
made_cb(const PfPoolChunk *chunk, gpointer user)
{
    Seen *seen = user;

    seen->made++;
    seen->last_n_vms = chunk->n_vms;
}

static void
dropped_cb(const PfPoolChunk *chunk, gpointer user)
{
    Seen *seen = user;

    seen->dropped++;
    seen->last_dropped = chunk->id;
}

static const guint32 vm12[] = { 1, 2 }, vm13[] = { 1, 3 };

/* Chunks are sealed before anyone sees them; slots come in order. */
static void
test_alloc(void)
{
    Seen seen = { 0 };
    g_autoptr(PfPool) p = pf_pool_new(made_cb, dropped_cb, &seen);
    guint8 page[PF_PAGE_SIZE];
    guint32 a, b, chunk, index;
    const PfPoolChunk *c;

    pf_fill_page(page, 1);
    a = pf_pool_alloc(p, vm12, 2, page, NULL);
    b = pf_pool_alloc(p, vm12, 2, page, NULL);
    g_assert_cmpuint(b, ==, a + 1);
    g_assert_false(pf_pool_is_zero_slot(a));
    /* The zero chunk, then the set's. */
    g_assert_cmpuint(seen.made, ==, 2);
    g_assert_cmpuint(seen.last_n_vms, ==, 2);
    pf_pool_locate(p, a, &chunk, &index);
    c = pf_pool_chunk(p, chunk);
    g_assert_cmpint(fcntl(c->fd, F_GET_SEALS) & (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), ==,
                    F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
    /* Nobody else can write it. */
    g_assert_true(mmap(NULL, PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd, 0) ==
                  MAP_FAILED);
    g_assert_cmpint(memcmp(pf_pool_data(p, a), page, PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 2);
    g_assert_cmpuint(pf_pool_bytes(p), ==, 2 * PF_PAGE_SIZE);
}

/* A freed slot reads as zeros to every agent that maps its chunk, before
 * it is reused: the page it held is nobody's any more. */
static void
test_freed_slot_is_zeroed(void)
{
    g_autoptr(PfPool) p = pf_pool_new(NULL, NULL, NULL);
    static const guint8 zero[PF_PAGE_SIZE];
    guint8 secret[PF_PAGE_SIZE];
    guint32 slot, keep, chunk, index;
    const PfPoolChunk *c;
    guint8 *agent_view;

    pf_fill_page(secret, 42);
    keep = pf_pool_alloc(p, vm12, 2, secret, NULL);
    slot = pf_pool_alloc(p, vm12, 2, secret, NULL);
    pf_pool_ref(p, slot);
    pf_pool_locate(p, slot, &chunk, &index);
    c = pf_pool_chunk(p, chunk);
    agent_view = mmap(NULL, (gsize)c->n_slots * PF_PAGE_SIZE, PROT_READ, MAP_SHARED, c->fd, 0);
    g_assert_true(agent_view != MAP_FAILED);
    g_assert_cmpint(memcmp(agent_view + (gsize)index * PF_PAGE_SIZE, secret, PF_PAGE_SIZE), ==, 0);
    g_assert_false(pf_pool_unref(p, slot));
    g_assert_cmpint(memcmp(agent_view + (gsize)index * PF_PAGE_SIZE, secret, PF_PAGE_SIZE), ==, 0);
    g_assert_true(pf_pool_unref(p, slot));
    g_assert_cmpint(memcmp(agent_view + (gsize)index * PF_PAGE_SIZE, zero, PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 1);
    munmap(agent_view, (gsize)c->n_slots * PF_PAGE_SIZE);
    g_assert_true(pf_pool_unref(p, keep));
}

/* Slots for different sets of VMs never share a chunk: a VM is sent only
 * its sets' chunks, and reads nothing of the others. */
static void
test_sets_apart(void)
{
    Seen seen = { 0 };
    g_autoptr(PfPool) p = pf_pool_new(made_cb, dropped_cb, &seen);
    guint8 page[PF_PAGE_SIZE];
    guint32 a, b, ca, cb, index;

    pf_fill_page(page, 3);
    a = pf_pool_alloc(p, vm12, 2, page, NULL);
    b = pf_pool_alloc(p, vm13, 2, page, NULL);
    pf_pool_locate(p, a, &ca, &index);
    pf_pool_locate(p, b, &cb, &index);
    g_assert_cmpuint(ca, !=, cb);
    g_assert_true(pf_pool_readable(p, a, 2));
    g_assert_false(pf_pool_readable(p, a, 3));
    g_assert_true(pf_pool_readable(p, b, 3));
    g_assert_false(pf_pool_readable(p, b, 2));
    g_assert_true(pf_pool_readable(p, pf_pool_zero_slot(p, 0, NULL), 7));
    g_assert_cmpuint(pf_pool_n_chunks(p), ==, 3);
}

/* A chunk extended to one more VM is that VM's to read, and its free
 * slots are for the new set only. */
static void
test_extend(void)
{
    g_autoptr(PfPool) p = pf_pool_new(NULL, NULL, NULL);
    static const guint32 vm123[] = { 1, 2, 3 };
    guint8 page[PF_PAGE_SIZE];
    guint32 a, b, c, ca, cb, cc, index;

    pf_fill_page(page, 9);
    a = pf_pool_alloc(p, vm13, 2, page, NULL);
    b = pf_pool_alloc(p, vm13, 2, page, NULL);
    pf_pool_locate(p, a, &ca, &index);
    g_assert_false(pf_pool_readable(p, a, 2));
    g_assert_cmpuint(pf_pool_chunk_live(p, ca), ==, 2);
    pf_pool_extend(p, ca, 2);
    g_assert_true(pf_pool_readable(p, a, 2));
    g_assert_cmpuint(pf_pool_chunk(p, ca)->n_vms, ==, 3);
    /* {1,3} gets a chunk of its own again; {1,2,3} the extended one. */
    c = pf_pool_alloc(p, vm13, 2, page, NULL);
    pf_pool_locate(p, c, &cc, &index);
    g_assert_cmpuint(cc, !=, ca);
    pf_pool_unref(p, c);
    c = pf_pool_alloc(p, vm123, 3, page, NULL);
    pf_pool_locate(p, c, &cb, &index);
    g_assert_cmpuint(cb, ==, ca);
    pf_pool_unref(p, a);
    pf_pool_unref(p, b);
    pf_pool_unref(p, c);
    g_assert_null(pf_pool_chunk(p, ca));
}

/* A chunk goes with its last slot in use: its VMs are told, its memory can
 * come back, and its id is used again. */
static void
test_chunk_goes(void)
{
    Seen seen = { 0 };
    g_autoptr(PfPool) p = pf_pool_new(made_cb, dropped_cb, &seen);
    guint32 slots[3 * PF_POOL_CHUNK_SLOTS / 2], chunk, index, again;
    guint8 page[PF_PAGE_SIZE];

    for (guint i = 0; i < G_N_ELEMENTS(slots); i++) {
        pf_fill_page(page, i);
        slots[i] = pf_pool_alloc(p, vm12, 2, page, NULL);
    }
    g_assert_cmpuint(pf_pool_n_chunks(p), ==, 3);
    g_assert_cmpuint(pf_pool_bytes(p), ==, G_N_ELEMENTS(slots) * PF_PAGE_SIZE);
    for (guint i = 0; i < PF_POOL_CHUNK_SLOTS; i++) {
        pf_pool_unref(p, slots[i]);
    }
    pf_pool_locate(p, slots[0], &chunk, &index);
    g_assert_cmpuint(seen.dropped, ==, 1);
    g_assert_cmpuint(seen.last_dropped, ==, chunk);
    g_assert_null(pf_pool_chunk(p, chunk));
    g_assert_cmpuint(pf_pool_bytes(p), ==, PF_POOL_CHUNK_SLOTS / 2 * PF_PAGE_SIZE);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, PF_POOL_CHUNK_SLOTS / 2);
    /* Another set gets the id back. */
    again = pf_pool_alloc(p, vm13, 2, page, NULL);
    g_assert_cmpuint(again, ==, slots[0]);
    pf_pool_unref(p, again);
    for (guint i = PF_POOL_CHUNK_SLOTS; i < G_N_ELEMENTS(slots); i++) {
        pf_pool_unref(p, slots[i]);
    }
    g_assert_cmpuint(pf_pool_bytes(p), ==, 0);
    g_assert_cmpuint(pf_pool_n_chunks(p), ==, 1); /* the zero chunk stays */
}

/* A full chunk that falls to a quarter in use is to be emptied: no slot is
 * handed out there again. */
static void
test_evacuating(void)
{
    g_autoptr(PfPool) p = pf_pool_new(NULL, NULL, NULL);
    guint32 slots[PF_POOL_CHUNK_SLOTS], other, c0, c1, index;
    guint8 page[PF_PAGE_SIZE];

    pf_fill_page(page, 5);
    for (guint i = 0; i < G_N_ELEMENTS(slots); i++) {
        slots[i] = pf_pool_alloc(p, vm12, 2, page, NULL);
    }
    for (guint i = 0; i < PF_POOL_CHUNK_SLOTS * 3 / 4 - 1; i++) {
        pf_pool_unref(p, slots[i]);
    }
    g_assert_false(pf_pool_evacuating(p, slots[PF_POOL_CHUNK_SLOTS - 1]));
    other = pf_pool_alloc(p, vm12, 2, page, NULL);
    pf_pool_locate(p, other, &c0, &index);
    pf_pool_locate(p, slots[0], &c1, &index);
    g_assert_cmpuint(c0, ==, c1); /* a freed slot, reused */
    pf_pool_unref(p, other);
    pf_pool_unref(p, slots[PF_POOL_CHUNK_SLOTS * 3 / 4 - 1]);
    g_assert_true(pf_pool_evacuating(p, slots[PF_POOL_CHUNK_SLOTS - 1]));
    g_assert_cmpuint(pf_pool_n_evacuating(p), ==, 1);
    other = pf_pool_alloc(p, vm12, 2, page, NULL);
    pf_pool_locate(p, other, &c0, &index);
    g_assert_cmpuint(c0, !=, c1);
    for (guint i = PF_POOL_CHUNK_SLOTS * 3 / 4; i < G_N_ELEMENTS(slots); i++) {
        pf_pool_unref(p, slots[i]);
    }
    g_assert_cmpuint(pf_pool_n_evacuating(p), ==, 0);
    g_assert_null(pf_pool_chunk(p, c1));
}

/* ---- a guest page that faults while it is copied ---- */

static sigjmp_buf *bus_env;

static void
bus_handler(int sig)
{
    siglongjmp(*bus_env, 1);
}

/* pf_pool_alloc() under a SIGBUS guard like the scanner's (guard.h):
 * PF_POOL_SLOT_NONE when the copy faulted and jumped out of it. */
static guint32
alloc_guarded(PfPool *p, const guint32 *vms, guint n_vms, const guint8 *content,
              gboolean *faulted)
{
    struct sigaction sa = { 0 }, old;
    sigjmp_buf env;
    volatile guint32 slot = PF_POOL_SLOT_NONE;

    sa.sa_handler = bus_handler;
    sa.sa_flags = SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    g_assert_cmpint(sigaction(SIGBUS, &sa, &old), ==, 0);
    bus_env = &env;
    *faulted = sigsetjmp(env, 1) != 0;
    if (!*faulted) {
        slot = pf_pool_alloc(p, vms, n_vms, content, NULL);
    }
    bus_env = NULL;
    g_assert_cmpint(sigaction(SIGBUS, &old, NULL), ==, 0);
    return slot;
}

/*
 * The scanner hands pf_pool_alloc() a page of guest RAM, and a memfd
 * truncated under it faults there (SIGBUS), which its guard turns into a
 * jump out of the copy.  The pool must be as it was: the slot it was
 * filling free again (reused first, as before), no chunk and no byte
 * more, and no part of the page in a slot.  Here the content straddles
 * the end of a memfd: its first half is there, its second half faults.
 */
static void
test_alloc_faults(void)
{
    Seen seen = { 0 };
    g_autoptr(PfPool) p = pf_pool_new(made_cb, dropped_cb, &seen);
    static const guint8 zero[PF_PAGE_SIZE];
    guint8 page[PF_PAGE_SIZE];
    guint32 keep, freed, slot, chunk, index;
    const PfPoolChunk *c;
    gboolean faulted;
    guint8 *ram, *agent_view;
    int fd = memfd_create("guest", MFD_CLOEXEC);

    g_assert_cmpint(fd, >=, 0);
    g_assert_cmpint(ftruncate(fd, 2 * PF_PAGE_SIZE), ==, 0);
    ram = mmap(NULL, 2 * PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    g_assert_true(ram != MAP_FAILED);
    memset(ram, 0xa5, PF_PAGE_SIZE);
    g_assert_cmpint(ftruncate(fd, PF_PAGE_SIZE), ==, 0);

    pf_fill_page(page, 11);
    keep = pf_pool_alloc(p, vm12, 2, page, NULL);
    freed = pf_pool_alloc(p, vm12, 2, page, NULL);
    g_assert_true(pf_pool_unref(p, freed));
    pf_pool_locate(p, keep, &chunk, &index);
    c = pf_pool_chunk(p, chunk);
    agent_view = mmap(NULL, (gsize)c->n_slots * PF_PAGE_SIZE, PROT_READ, MAP_SHARED, c->fd, 0);
    g_assert_true(agent_view != MAP_FAILED);

    /* A freed slot was next. */
    slot = alloc_guarded(p, vm12, 2, ram + PF_PAGE_SIZE / 2, &faulted);
    g_assert_true(faulted);
    g_assert_cmpuint(slot, ==, PF_POOL_SLOT_NONE);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 1);
    g_assert_cmpuint(pf_pool_bytes(p), ==, 2 * PF_PAGE_SIZE);
    for (guint32 i = 1; i < c->n_slots; i++) {
        g_assert_cmpint(memcmp(agent_view + (gsize)i * PF_PAGE_SIZE, zero, PF_PAGE_SIZE), ==, 0);
    }
    g_assert_cmpuint(pf_pool_alloc(p, vm12, 2, page, NULL), ==, freed);

    /* A fresh slot was next. */
    slot = alloc_guarded(p, vm12, 2, ram + PF_PAGE_SIZE / 2, &faulted);
    g_assert_true(faulted);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 2);
    g_assert_cmpuint(pf_pool_bytes(p), ==, 2 * PF_PAGE_SIZE);
    g_assert_cmpint(memcmp(agent_view + 2 * PF_PAGE_SIZE, zero, PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(pf_pool_alloc(p, vm12, 2, page, NULL), ==, freed + 1);

    /* A new chunk was next: none is made. */
    slot = alloc_guarded(p, vm13, 2, ram + PF_PAGE_SIZE / 2, &faulted);
    g_assert_true(faulted);
    g_assert_cmpuint(seen.made, ==, 2);
    g_assert_cmpuint(pf_pool_n_chunks(p), ==, 2);
    g_assert_cmpuint(pf_pool_slots_in_use(p), ==, 3);

    munmap(agent_view, (gsize)c->n_slots * PF_PAGE_SIZE);
    munmap(ram, 2 * PF_PAGE_SIZE);
    close(fd);
}

/*
 * A chunk an earlier pool made, taken back by a new one (a restart): it is
 * marked as the pool's (a memfd of anyone else's is not), its content is
 * as it was, its slots take references as pages are taken back, a freed
 * one is neither zeroed nor handed out again, a second holder joins its
 * set, and once settled a chunk no page maps goes.
 */
static void
test_adopt(void)
{
    Seen seen = { 0 };
    g_autoptr(PfPool) old = pf_pool_new(NULL, NULL, NULL);
    g_autoptr(PfPool) p = pf_pool_new(made_cb, dropped_cb, &seen);
    guint8 page[PF_PAGE_SIZE];
    guint32 slot, chunk, index, id, again;
    gboolean zero = TRUE;
    int other = memfd_create("not-the-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    if (geteuid() != 0) {
        g_test_skip("needs CAP_SYS_ADMIN: the pool's mark is a trusted.* attribute");
        close(other);
        return;
    }
    pf_fill_page(page, 7);
    slot = pf_pool_alloc(old, vm12, 2, page, NULL);
    pf_pool_locate(old, slot, &chunk, &index);
    g_assert_true(pf_pool_is_marked(pf_pool_chunk(old, chunk)->fd, &zero));
    g_assert_false(zero);
    g_assert_true(pf_pool_is_marked(pf_pool_zero_chunk(old)->fd, &zero));
    g_assert_true(zero);
    g_assert_cmpint(ftruncate(other, PF_POOL_CHUNK_SLOTS * PF_PAGE_SIZE), ==, 0);
    g_assert_false(pf_pool_is_marked(other, &zero));
    close(other);

    id = pf_pool_adopt_chunk(p, pf_pool_chunk(old, chunk)->fd, 1, NULL);
    g_assert_cmpuint(id, >, 0);
    g_assert_cmpuint(seen.made, ==, 2); /* its zero chunk, then this one */
    g_assert_true(pf_pool_is_adopted(p, id));
    g_assert_cmpuint(pf_pool_find_ino(p, pf_pool_chunk(old, chunk)->ino), ==, id);
    again = id * PF_POOL_CHUNK_SLOTS + index + 1;
    g_assert_cmpmem(pf_pool_data(p, again), PF_PAGE_SIZE, page, PF_PAGE_SIZE);
    g_assert_true(pf_pool_adopt_slot(p, again));
    g_assert_false(pf_pool_adopt_slot(p, again));
    g_assert_cmpuint(pf_pool_refs(p, again), ==, 2);
    pf_pool_set_adopted_tag(p, again, 42);
    g_assert_cmpuint(pf_pool_adopted_tag(p, again), ==, 42);
    g_assert_true(pf_pool_adopt_holder(p, id, 2));
    g_assert_false(pf_pool_adopt_holder(p, id, 2));
    g_assert_true(pf_pool_readable(p, again, 2));
    /* No slot of it is handed out: a new one for the same VMs goes to a
     * chunk of its own. */
    g_assert_cmpuint(pf_pool_alloc(p, vm12, 2, page, NULL) / PF_POOL_CHUNK_SLOTS, !=, id);
    pf_pool_unref(p, again);
    g_assert_cmpmem(pf_pool_data(p, again), PF_PAGE_SIZE, page, PF_PAGE_SIZE);
    pf_pool_unref(p, again);
    g_assert_cmpuint(seen.dropped, ==, 1);
    g_assert_cmpuint(seen.last_dropped, ==, id);

    /* Taken, no page of it taken back: it goes as it settles. */
    id = pf_pool_adopt_chunk(p, pf_pool_chunk(old, chunk)->fd, 1, NULL);
    g_assert_cmpuint(id, >, 0);
    pf_pool_adopted_settle(p, id);
    g_assert_cmpuint(seen.dropped, ==, 2);
    g_assert_null(pf_pool_chunk(p, id));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/pool/alloc", test_alloc);
    g_test_add_func("/pool/freed-slot-is-zeroed", test_freed_slot_is_zeroed);
    g_test_add_func("/pool/sets-apart", test_sets_apart);
    g_test_add_func("/pool/chunk-goes", test_chunk_goes);
    g_test_add_func("/pool/extend", test_extend);
    g_test_add_func("/pool/evacuating", test_evacuating);
    g_test_add_func("/pool/alloc-faults", test_alloc_faults);
    g_test_add_func("/pool/adopt", test_adopt);
    return g_test_run();
}
