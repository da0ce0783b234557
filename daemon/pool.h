/*
 * pool.h - the pool: canonical pages in memfd chunks that agents map
 * MAP_PRIVATE over merged guest pages.
 *
 * Each chunk is sealed F_SEAL_FUTURE_WRITE|GROW|SHRINK|SEAL as soon as it is
 * created: no one can map it writable or resize it any more, and agents
 * refuse chunks without those seals.  pagefoldd fills slots through the
 * writable mapping it made before sealing.  The rule that keeps guests
 * safe: a slot is written only while no guest page maps it (refs == 0).
 * Slots are handed out in ascending order so that a run of guest pages
 * merged together gets a run of slots, and their mappings coalesce into
 * one VMA per run.  Zero slots are not counted: they are never written.
 */
#pragma once

#include <glib.h>

#define PF_POOL_SLOT_NONE 0u
/* The first slots of the first chunk are never written: they read as
 * zeros, and the zero pages of every VM map them.  (Mapping a private
 * anonymous page instead would rely on the kernel mapping its shared zero
 * page on a read fault; some kernels allocate a page there.) */
#define PF_POOL_ZERO_SLOTS 512u

typedef struct {
    guint32 id;
    int fd;
    guint8 *map; /* pagefoldd's own writable mapping, made before sealing */
    guint32 n_slots;
} PfPoolChunk;

typedef struct _PfPool PfPool;

/* Called for every new chunk, so that agents learn of it before use. */
typedef void (*PfPoolChunkFunc)(const PfPoolChunk *chunk, gpointer user);

PfPool *pf_pool_new(guint32 slots_per_chunk, PfPoolChunkFunc new_chunk, gpointer user);
void pf_pool_free(PfPool *p);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfPool, pf_pool_free)

/* Slot ids are 1-based; PF_POOL_SLOT_NONE is never a slot. */
guint32 pf_pool_alloc(PfPool *p, const guint8 *content, GError **error);
void pf_pool_ref(PfPool *p, guint32 slot);
/* Returns TRUE when that was the last reference and the slot is free. */
gboolean pf_pool_unref(PfPool *p, guint32 slot);
guint32 pf_pool_refs(PfPool *p, guint32 slot);
gboolean pf_pool_is_zero_slot(guint32 slot);
/* The zero slot after `prev` (for a run of zero pages), or the first. */
guint32 pf_pool_zero_slot(PfPool *p, guint32 prev, GError **error);

const guint8 *pf_pool_data(PfPool *p, guint32 slot);
void pf_pool_locate(PfPool *p, guint32 slot, guint32 *chunk, guint32 *index);
GPtrArray *pf_pool_chunks(PfPool *p);
gsize pf_pool_slots_in_use(PfPool *p);
/* Bytes of pool memory allocated (slots ever filled). */
gsize pf_pool_bytes(PfPool *p);
