/*
 * pool.h - the pool: canonical pages in memfd chunks that agents map
 * MAP_PRIVATE over merged guest pages.
 *
 * Each chunk is sealed F_SEAL_FUTURE_WRITE|GROW|SHRINK|SEAL as soon as it is
 * created: no one can map it writable or resize it any more, and agents
 * refuse chunks without those seals.  pagefoldd fills slots through the
 * writable mapping it made before sealing.  The rules that keep guests
 * safe and apart:
 *   - a slot is written only while no guest page maps it (refs == 0);
 *   - a chunk belongs to one set of VMs, fixed when it is made: only they
 *     are sent it, and a slot is filled only for pages of exactly that set.
 *     A VM reads nothing in the pool that its own pages do not share (an
 *     agent holding a chunk can read all of it, whatever it was told);
 *   - a chunk goes as soon as no slot of it is in use, the only way its
 *     memory can come back (the write seal forbids punching a slot out).
 * Slots are handed out in ascending order so that a run of guest pages
 * merged together gets a run of slots, and their mappings coalesce into
 * one VMA per run.  The zero slots are a chunk of their own, for every VM:
 * they are never written.
 *
 * The pool knows VMs only as serial numbers the caller never reuses, and
 * never decides who shares what: the caller names the set for each slot.
 */
#pragma once

#include <glib.h>

#define PF_POOL_SLOT_NONE 0u
/* 2 MiB: small enough to go whole often, few enough for one mapping each
 * in pagefoldd (vm.max_map_count) and in the agents. */
#define PF_POOL_CHUNK_SLOTS 512u
/* Chunk 0 is never written: its slots read as zeros, and the zero pages
 * of every VM map them.  (Mapping a private anonymous page instead would
 * rely on the kernel mapping its shared zero page on a read fault; some
 * kernels allocate a page there.) */
#define PF_POOL_ZERO_SLOTS PF_POOL_CHUNK_SLOTS

typedef struct {
    guint32 id;
    int fd;
    guint8 *map;  /* pagefoldd's own writable mapping, made before sealing */
    guint32 n_slots;
    guint64 ino;        /* of the memfd: how processes that hold it show it */
    const guint32 *vms; /* the serials of the VMs that may map it, ascending; */
    guint n_vms;        /* none: every VM (the zero chunk) */
} PfPoolChunk;

typedef struct _PfPool PfPool;

/* Called for every new chunk, so that its VMs learn of it before use, and
 * for every chunk that goes, after its last slot was freed. */
typedef void (*PfPoolChunkFunc)(const PfPoolChunk *chunk, gpointer user);

PfPool *pf_pool_new(PfPoolChunkFunc new_chunk, PfPoolChunkFunc drop_chunk, gpointer user);
void pf_pool_free(PfPool *p);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfPool, pf_pool_free)

/* A slot holding content, for the pages of exactly the VMs vms[0..n_vms)
 * (ascending serials, n_vms > 0).  Slot ids are 1-based; PF_POOL_SLOT_NONE
 * is never a slot.  content may fault (a SIGBUS the caller catches): the
 * pool is then as it was. */
guint32 pf_pool_alloc(PfPool *p, const guint32 *vms, guint n_vms, const guint8 *content,
                      GError **error);
void pf_pool_ref(PfPool *p, guint32 slot);
/* Returns TRUE when that was the last reference and the slot is free. */
gboolean pf_pool_unref(PfPool *p, guint32 slot);
guint32 pf_pool_refs(PfPool *p, guint32 slot);
gboolean pf_pool_is_zero_slot(guint32 slot);
/* The zero slot after `prev` (for a run of zero pages), or the first. */
guint32 pf_pool_zero_slot(PfPool *p, guint32 prev, GError **error);
/* Whether the VM of that serial may map the slot (holds its chunk). */
gboolean pf_pool_readable(PfPool *p, guint32 slot, guint32 vm);
/*
 * Whether the slot's chunk is to be emptied: all its slots were handed out
 * and at most a quarter are in use.  No slot is handed out there again;
 * the caller moves the pages that map it elsewhere, and the chunk goes.
 * That bounds the pool's memory: at most four times the slots in use, plus
 * a chunk per set of VMs being filled.
 */
gboolean pf_pool_evacuating(PfPool *p, guint32 slot);
guint pf_pool_n_evacuating(PfPool *p);

/*
 * The chunk belongs to one more VM from now on: the caller has seen that
 * VM's pages share the content of every slot of it in use (freed slots
 * read zero), and sends it the chunk.  Its free slots are for the new set.
 * Not the zero chunk, nor an adopted one (its freed slots are not zeroed).
 */
void pf_pool_extend(PfPool *p, guint32 chunk, guint32 vm);
guint32 pf_pool_chunk_live(PfPool *p, guint32 chunk);

/*
 * Taking back what an earlier pagefoldd made (a restart): its chunks are
 * marked with PF_POOL_MARK, an extended attribute of the trusted
 * namespace, which only a process with CAP_SYS_ADMIN can set or read, so
 * a VMM cannot pass off a memfd of its own as one.  The seals of every
 * chunk, which agents check too.
 */
#define PF_POOL_MARK "trusted.pagefold.pool"
#define PF_POOL_MARK_CHUNK "chunk"
#define PF_POOL_MARK_ZERO "zero"
#define PF_POOL_SEALS (0x0010 /* F_SEAL_FUTURE_WRITE */ | 0x0004 /* F_SEAL_GROW */ | \
                       0x0002 /* F_SEAL_SHRINK */ | 0x0001 /* F_SEAL_SEAL */)
/* Whether fd is a pool chunk some pagefoldd made: marked, sealed, of a
 * chunk's size; *zero: its zero chunk, whose slots were never written. */
gboolean pf_pool_is_marked(int fd, gboolean *zero);
/* The chunk whose memfd has that inode number, or 0 (chunk 0 is this
 * pool's zero chunk, never looked for). */
guint32 pf_pool_find_ino(PfPool *p, guint64 ino);
/*
 * Takes a chunk fd (dup'd) an earlier pagefoldd made as one of this pool's,
 * for the VM of that serial, whose pages map it: its id, or 0 and error.
 * No slot of it is in use until pf_pool_adopt_slot(); none is ever filled
 * again (there is no writable mapping of it any more), and no other VM is
 * made one of its VMs but by pf_pool_adopt_holder(): its freed slots keep
 * what they held.  Emptied as any chunk is (pf_pool_evacuating()).
 */
guint32 pf_pool_adopt_chunk(PfPool *p, int fd, guint32 vm, GError **error);
/* Another VM maps the adopted chunk, held since the earlier pagefoldd sent
 * it: one of its VMs now.  FALSE if it was already. */
gboolean pf_pool_adopt_holder(PfPool *p, guint32 chunk, guint32 vm);
/* A slot of an adopted chunk takes a reference; TRUE when it is its first
 * (the slot's node is to be made). */
gboolean pf_pool_adopt_slot(PfPool *p, guint32 slot);
gboolean pf_pool_is_adopted(PfPool *p, guint32 chunk);
/* A number the caller keeps with each slot of an adopted chunk, 0 until
 * set, gone with the chunk (the scanner's: the slot's stable node). */
guint32 pf_pool_adopted_tag(PfPool *p, guint32 slot);
void pf_pool_set_adopted_tag(PfPool *p, guint32 slot, guint32 tag);
/* Every page that maps the adopted chunk was taken back, for now: one
 * that none maps goes (its VMs are told), one mostly empty is to be
 * emptied (pf_pool_evacuating()). */
void pf_pool_adopted_settle(PfPool *p, guint32 chunk);

const guint8 *pf_pool_data(PfPool *p, guint32 slot);
void pf_pool_locate(PfPool *p, guint32 slot, guint32 *chunk, guint32 *index);
const PfPoolChunk *pf_pool_chunk(PfPool *p, guint32 id);
/* The zero chunk, or NULL before the first zero page. */
const PfPoolChunk *pf_pool_zero_chunk(PfPool *p);
gsize pf_pool_slots_in_use(PfPool *p);
gsize pf_pool_n_chunks(PfPool *p);
/* Bytes of memory the pool's chunks hold: every slot ever filled in a
 * chunk that is still there (a freed slot keeps its page). */
gsize pf_pool_bytes(PfPool *p);
