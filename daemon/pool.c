/*
 * pool.c - see pool.h.
 *
 * A freed slot cannot be punched out (the write seal forbids fallocate), so
 * it keeps its memory and is reused first: the pool's memory is the
 * high-water mark of slots in use.  It is zeroed when freed: agents map
 * whole chunks, and a page no guest shares any more is nobody's to read.
 */
#include "pool.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

struct _PfPool {
    guint32 slots_per_chunk;
    GPtrArray *chunks;  /* PfPoolChunk* */
    GArray *refs;       /* guint32 per slot id (index 0 unused) */
    GArray *free_slots; /* guint32, freed slots to reuse */
    guint32 next;       /* next never-used slot id */
    gsize in_use;
    PfPoolChunkFunc new_chunk;
    gpointer user;
};

static void
chunk_free(gpointer data)
{
    PfPoolChunk *c = data;

    munmap(c->map, (gsize)c->n_slots * PF_PAGE_SIZE);
    close(c->fd);
    g_free(c);
}

PfPool *
pf_pool_new(guint32 slots_per_chunk, PfPoolChunkFunc new_chunk, gpointer user)
{
    PfPool *p = g_new0(PfPool, 1);

    p->slots_per_chunk = slots_per_chunk;
    p->chunks = g_ptr_array_new_with_free_func(chunk_free);
    p->refs = g_array_new(FALSE, TRUE, sizeof(guint32));
    g_array_set_size(p->refs, 1);
    p->free_slots = g_array_new(FALSE, FALSE, sizeof(guint32));
    p->next = 1 + PF_POOL_ZERO_SLOTS;
    p->new_chunk = new_chunk;
    p->user = user;
    return p;
}

void
pf_pool_free(PfPool *p)
{
    if (p == NULL) {
        return;
    }
    g_ptr_array_unref(p->chunks);
    g_array_unref(p->refs);
    g_array_unref(p->free_slots);
    g_free(p);
}

static gboolean
add_chunk(PfPool *p, GError **error)
{
    g_autofree char *name = g_strdup_printf("pagefold-pool-%u", p->chunks->len);
    gsize size = (gsize)p->slots_per_chunk * PF_PAGE_SIZE;
    PfPoolChunk *c;
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    void *map;

    if (fd < 0 || ftruncate(fd, (off_t)size) < 0) {
        int e = errno;

        if (fd >= 0) {
            close(fd);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pool chunk: %s", g_strerror(e));
        return FALSE;
    }
    map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED ||
        fcntl(fd, F_ADD_SEALS,
              F_SEAL_FUTURE_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0) {
        int e = errno;

        if (map != MAP_FAILED) {
            munmap(map, size);
        }
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pool chunk: %s", g_strerror(e));
        return FALSE;
    }
    c = g_new0(PfPoolChunk, 1);
    c->id = p->chunks->len;
    c->fd = fd;
    c->map = map;
    c->n_slots = p->slots_per_chunk;
    g_ptr_array_add(p->chunks, c);
    g_array_set_size(p->refs, p->refs->len + p->slots_per_chunk);
    if (p->new_chunk != NULL) {
        p->new_chunk(c, p->user);
    }
    return TRUE;
}

void
pf_pool_locate(PfPool *p, guint32 slot, guint32 *chunk, guint32 *index)
{
    *chunk = (slot - 1) / p->slots_per_chunk;
    *index = (slot - 1) % p->slots_per_chunk;
}

static guint8 *
slot_data(PfPool *p, guint32 slot)
{
    guint32 chunk, index;

    pf_pool_locate(p, slot, &chunk, &index);
    return ((PfPoolChunk *)g_ptr_array_index(p->chunks, chunk))->map +
           (gsize)index * PF_PAGE_SIZE;
}

guint32
pf_pool_alloc(PfPool *p, const guint8 *content, GError **error)
{
    guint32 slot;

    /* Fresh slots in order keep runs contiguous; freed ones are reused
     * first all the same, since they hold memory already. */
    if (p->free_slots->len > 0) {
        slot = g_array_index(p->free_slots, guint32, p->free_slots->len - 1);
        g_array_set_size(p->free_slots, p->free_slots->len - 1);
    } else {
        if (p->next > (guint64)p->chunks->len * p->slots_per_chunk && !add_chunk(p, error)) {
            return PF_POOL_SLOT_NONE;
        }
        slot = p->next++;
    }
    g_assert(g_array_index(p->refs, guint32, slot) == 0);
    memcpy(slot_data(p, slot), content, PF_PAGE_SIZE);
    g_array_index(p->refs, guint32, slot) = 1;
    p->in_use++;
    return slot;
}

gboolean
pf_pool_is_zero_slot(guint32 slot)
{
    return slot != PF_POOL_SLOT_NONE && slot <= PF_POOL_ZERO_SLOTS;
}

guint32
pf_pool_zero_slot(PfPool *p, guint32 prev, GError **error)
{
    if (p->chunks->len == 0 && !add_chunk(p, error)) {
        return PF_POOL_SLOT_NONE;
    }
    return pf_pool_is_zero_slot(prev) && prev < PF_POOL_ZERO_SLOTS ? prev + 1 : 1;
}

void
pf_pool_ref(PfPool *p, guint32 slot)
{
    if (pf_pool_is_zero_slot(slot)) {
        return;
    }
    g_assert(g_array_index(p->refs, guint32, slot) > 0);
    g_array_index(p->refs, guint32, slot)++;
}

gboolean
pf_pool_unref(PfPool *p, guint32 slot)
{
    guint32 *r;

    if (pf_pool_is_zero_slot(slot)) {
        return FALSE;
    }
    r = &g_array_index(p->refs, guint32, slot);
    g_assert(*r > 0);
    if (--*r > 0) {
        return FALSE;
    }
    /* No guest maps it any more; every agent still holds the chunk, so
     * what the slot held must not stay readable there. */
    memset(slot_data(p, slot), 0, PF_PAGE_SIZE);
    g_array_append_val(p->free_slots, slot);
    p->in_use--;
    return TRUE;
}

guint32
pf_pool_refs(PfPool *p, guint32 slot)
{
    return g_array_index(p->refs, guint32, slot);
}

const guint8 *
pf_pool_data(PfPool *p, guint32 slot)
{
    return slot_data(p, slot);
}

GPtrArray *
pf_pool_chunks(PfPool *p)
{
    return p->chunks;
}

gsize
pf_pool_slots_in_use(PfPool *p)
{
    return p->in_use;
}

gsize
pf_pool_bytes(PfPool *p)
{
    return (gsize)(p->next - 1 - PF_POOL_ZERO_SLOTS) * PF_PAGE_SIZE;
}
