/*
 * pool.c - the pool of canonical pages (pool.h): its sealed memfd chunks,
 * their slots, references and sets of VMs.  Never writes a slot a guest
 * page may map, and never sends a chunk anywhere (its owner is told).
 *
 * A freed slot cannot be punched out (the write seal forbids fallocate), so
 * it keeps its memory until its chunk goes; it is zeroed all the same, and
 * reused first, within its chunk, for the same set of VMs.  Chunks are
 * small (2 MiB) so that going whole is often enough, and sparse ones are
 * emptied by the caller (pf_pool_evacuating()).
 */
#include "pool.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "proto.h"
#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

#define SLOTS PF_POOL_CHUNK_SLOTS

typedef struct _Set Set;

typedef struct {
    PfPoolChunk pub;
    Set *set;        /* NULL for the zero chunk */
    guint32 next;    /* slots handed out so far, from 0 up */
    guint32 live;    /* slots in use */
    GArray *free;    /* guint32 indexes freed, reused first */
    gboolean evacuating;
    /* made by an earlier pagefoldd (pf_pool_adopt_chunk()): no writable
     * mapping, so no slot is filled, zeroed or reused, and no VM joins its
     * set (a freed slot still holds what it held) */
    gboolean adopted;
    guint32 *tags;   /* adopted: the caller's word per slot (its node) */
} Chunk;

/* The chunks that belong to one set of VMs. */
struct _Set {
    char *key;      /* the serials, "1,4,9" */
    GArray *vms;    /* guint32, ascending */
    GPtrArray *chunks; /* Chunk*, not owned, oldest first */
};

struct _PfPool {
    GPtrArray *chunks;  /* Chunk* by id, NULL where none */
    GArray *free_ids;   /* guint32 ids of chunks gone, reused first */
    GHashTable *sets;   /* key -> Set* */
    GArray *refs;       /* guint32 per slot id (index 0 unused) */
    gsize in_use;
    gsize bytes;
    guint n_evacuating;
    gboolean unmarked; /* a chunk could not be marked: said once */
    GHashTable *by_ino; /* its memfd's inode (guint64*) -> chunk id */
    PfPoolChunkFunc new_chunk, drop_chunk;
    gpointer user;
};

static void
set_free(gpointer data)
{
    Set *set = data;

    g_free(set->key);
    g_array_unref(set->vms);
    g_ptr_array_unref(set->chunks);
    g_free(set);
}

static void
chunk_free(gpointer data)
{
    Chunk *c = data;

    if (c == NULL) {
        return;
    }
    munmap(c->pub.map, (gsize)c->pub.n_slots * PF_PAGE_SIZE);
    close(c->pub.fd);
    g_array_unref(c->free);
    g_free(c->tags);
    g_free(c);
}

/* A chunk of id, its memfd fd (owned) mapped at map, of that inode. */
static Chunk *
chunk_new(guint32 id, int fd, void *map, guint64 ino)
{
    Chunk *c = g_new0(Chunk, 1);

    c->pub.id = id;
    c->pub.fd = fd;
    c->pub.map = map;
    c->pub.n_slots = SLOTS;
    c->pub.ino = ino;
    return c;
}

/* The id a new chunk gets: one freed first. */
static gboolean
next_id(PfPool *p, guint32 *id, GError **error)
{
    if (p->free_ids->len > 0) {
        *id = g_array_index(p->free_ids, guint32, p->free_ids->len - 1);
    } else if ((*id = p->chunks->len) >= PF_PROTO_MAX_CHUNKS) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pool chunk: all %u chunks in use",
                    PF_PROTO_MAX_CHUNKS);
        return FALSE;
    }
    return TRUE;
}

/* The id next_id() gave is taken by c, of set (NULL: the zero chunk). */
static void
place_chunk(PfPool *p, Chunk *c, Set *set)
{
    if (p->free_ids->len > 0) {
        g_array_set_size(p->free_ids, p->free_ids->len - 1);
    } else {
        g_ptr_array_add(p->chunks, NULL);
        g_array_set_size(p->refs, p->refs->len + SLOTS);
    }
    c->free = g_array_new(FALSE, FALSE, sizeof(guint32));
    c->set = set;
    if (set != NULL) {
        c->pub.vms = (const guint32 *)(gpointer)set->vms->data;
        c->pub.n_vms = set->vms->len;
        g_ptr_array_add(set->chunks, c);
    }
    g_ptr_array_index(p->chunks, c->pub.id) = c;
    g_hash_table_insert(p->by_ino, &c->pub.ino, GUINT_TO_POINTER(c->pub.id));
    if (p->new_chunk != NULL) {
        p->new_chunk(&c->pub, p->user);
    }
}

PfPool *
pf_pool_new(PfPoolChunkFunc new_chunk, PfPoolChunkFunc drop_chunk, gpointer user)
{
    PfPool *p = g_new0(PfPool, 1);

    p->chunks = g_ptr_array_new_with_free_func(chunk_free);
    p->free_ids = g_array_new(FALSE, FALSE, sizeof(guint32));
    p->sets = g_hash_table_new_full(g_str_hash, g_str_equal, NULL, set_free);
    p->refs = g_array_new(FALSE, TRUE, sizeof(guint32));
    p->by_ino = g_hash_table_new(g_int64_hash, g_int64_equal);
    g_array_set_size(p->refs, 1);
    p->new_chunk = new_chunk;
    p->drop_chunk = drop_chunk;
    p->user = user;
    return p;
}

void
pf_pool_free(PfPool *p)
{
    if (p == NULL) {
        return;
    }
    g_hash_table_unref(p->by_ino);
    g_ptr_array_unref(p->chunks);
    g_array_unref(p->free_ids);
    g_hash_table_unref(p->sets);
    g_array_unref(p->refs);
    g_free(p);
}

static Chunk *
chunk_at(PfPool *p, guint32 id)
{
    return id < p->chunks->len ? g_ptr_array_index(p->chunks, id) : NULL;
}

static Chunk *
chunk_of(PfPool *p, guint32 slot)
{
    Chunk *c = chunk_at(p, (slot - 1) / SLOTS);

    g_assert(c != NULL);
    return c;
}

static Set *find_set(PfPool *p, const guint32 *vms, guint n_vms);
static void drop_chunk(PfPool *p, Chunk *c);

/* A sealed memfd, mapped writable by us before the seal, and marked as
 * the pool's where only root can mark (pf_pool_adopt_chunk()). */
static Chunk *
add_chunk(PfPool *p, Set *set, GError **error)
{
    gsize size = (gsize)SLOTS * PF_PAGE_SIZE;
    guint32 id;
    g_autofree char *name = NULL;
    const char *mark = set != NULL ? PF_POOL_MARK_CHUNK : PF_POOL_MARK_ZERO;
    struct stat st;
    Chunk *c;
    int fd;
    void *map;

    if (!next_id(p, &id, error)) {
        return NULL;
    }
    name = g_strdup_printf("pagefold-pool-%u", id);
    fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)size) < 0) {
        int e = errno;

        if (fd >= 0) {
            close(fd);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pool chunk: %s", g_strerror(e));
        return NULL;
    }
    /* Without the mark the pool works as before; only a VM's merged pages
     * on this chunk are not taken back by a later pagefoldd. */
    if (fsetxattr(fd, PF_POOL_MARK, mark, strlen(mark), 0) < 0 && !p->unmarked) {
        g_warning("pool chunks cannot be marked as pagefoldd's (%s: %s): a pagefoldd started "
                  "after this one will not take back the VMs' merged pages",
                  PF_POOL_MARK, g_strerror(errno));
        p->unmarked = TRUE;
    }
    map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED || fstat(fd, &st) < 0 ||
        fcntl(fd, F_ADD_SEALS,
              F_SEAL_FUTURE_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0) {
        int e = errno;

        if (map != MAP_FAILED) {
            munmap(map, size);
        }
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pool chunk: %s", g_strerror(e));
        return NULL;
    }
    c = chunk_new(id, fd, map, st.st_ino);
    place_chunk(p, c, set);
    return c;
}

gboolean
pf_pool_is_marked(int fd, gboolean *zero)
{
    char mark[16] = "";
    ssize_t n = fgetxattr(fd, PF_POOL_MARK, mark, sizeof(mark) - 1);
    int seals = fcntl(fd, F_GET_SEALS);
    struct stat st;

    if (n < 0 || seals < 0 || fstat(fd, &st) < 0 ||
        (seals & PF_POOL_SEALS) != PF_POOL_SEALS ||
        st.st_size != (off_t)SLOTS * PF_PAGE_SIZE) {
        return FALSE;
    }
    mark[n] = '\0';
    *zero = g_str_equal(mark, PF_POOL_MARK_ZERO);
    return *zero || g_str_equal(mark, PF_POOL_MARK_CHUNK);
}

guint32
pf_pool_find_ino(PfPool *p, guint64 ino)
{
    return GPOINTER_TO_UINT(g_hash_table_lookup(p->by_ino, &ino));
}

void
pf_pool_adopted_settle(PfPool *p, guint32 chunk)
{
    Chunk *c = chunk_at(p, chunk);

    if (c == NULL || !c->adopted) {
        return;
    }
    if (c->live == 0) {
        drop_chunk(p, c);
    } else if (!c->evacuating && c->live * 4 <= SLOTS) {
        c->evacuating = TRUE;
        p->n_evacuating++;
    }
}

guint32
pf_pool_adopt_chunk(PfPool *p, int fd, guint32 vm, GError **error)
{
    gsize size = (gsize)SLOTS * PF_PAGE_SIZE;
    struct stat st;
    guint32 id;
    Chunk *c;
    void *map;

    /* Chunk 0 stays the zero chunk. */
    if ((p->chunks->len == 0 && pf_pool_zero_slot(p, PF_POOL_SLOT_NONE, error) == 0) ||
        !next_id(p, &id, error)) {
        return 0;
    }
    fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    map = fd < 0 ? MAP_FAILED : mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED || fstat(fd, &st) < 0) {
        int e = errno;

        if (map != MAP_FAILED) {
            munmap(map, size);
        }
        if (fd >= 0) {
            close(fd);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pool chunk: %s", g_strerror(e));
        return 0;
    }
    c = chunk_new(id, fd, map, st.st_ino);
    c->adopted = TRUE;
    c->tags = g_new0(guint32, SLOTS);
    /* Every slot counts as filled: which ones were is not known. */
    c->next = SLOTS;
    p->bytes += size;
    place_chunk(p, c, find_set(p, &vm, 1));
    return id;
}

gboolean
pf_pool_adopt_slot(PfPool *p, guint32 slot)
{
    Chunk *c = chunk_at(p, (slot - 1) / SLOTS);

    g_return_val_if_fail(c != NULL && c->adopted, FALSE);
    if (g_array_index(p->refs, guint32, slot)++ > 0) {
        return FALSE;
    }
    c->live++;
    p->in_use++;
    return TRUE;
}

guint32
pf_pool_adopted_tag(PfPool *p, guint32 slot)
{
    Chunk *c = chunk_at(p, (slot - 1) / SLOTS);

    return c != NULL && c->adopted ? c->tags[(slot - 1) % SLOTS] : 0;
}

void
pf_pool_set_adopted_tag(PfPool *p, guint32 slot, guint32 tag)
{
    Chunk *c = chunk_at(p, (slot - 1) / SLOTS);

    g_return_if_fail(c != NULL && c->adopted);
    c->tags[(slot - 1) % SLOTS] = tag;
}

gboolean
pf_pool_is_adopted(PfPool *p, guint32 chunk)
{
    Chunk *c = chunk_at(p, chunk);

    return c != NULL && c->adopted;
}

/* Its last slot is free: its VMs are told, and its memory goes with the
 * last mapping of it. */
static void
drop_chunk(PfPool *p, Chunk *c)
{
    Set *set = c->set;

    if (p->drop_chunk != NULL) {
        p->drop_chunk(&c->pub, p->user);
    }
    if (c->evacuating) {
        p->n_evacuating--;
    }
    p->bytes -= (gsize)c->next * PF_PAGE_SIZE;
    g_ptr_array_remove(set->chunks, c);
    if (set->chunks->len == 0) {
        g_hash_table_remove(p->sets, set->key);
    }
    g_array_append_val(p->free_ids, c->pub.id);
    g_ptr_array_index(p->chunks, c->pub.id) = NULL;
    g_hash_table_remove(p->by_ino, &c->pub.ino);
    chunk_free(c);
}

void
pf_pool_locate(PfPool *p, guint32 slot, guint32 *chunk, guint32 *index)
{
    *chunk = (slot - 1) / SLOTS;
    *index = (slot - 1) % SLOTS;
}

static guint8 *
slot_data(PfPool *p, guint32 slot)
{
    return chunk_of(p, slot)->pub.map + (gsize)((slot - 1) % SLOTS) * PF_PAGE_SIZE;
}

static Set *
find_set(PfPool *p, const guint32 *vms, guint n_vms)
{
    g_autoptr(GString) key = g_string_new(NULL);
    Set *set;

    for (guint i = 0; i < n_vms; i++) {
        g_assert(i == 0 || vms[i] > vms[i - 1]);
        g_string_append_printf(key, i == 0 ? "%u" : ",%u", vms[i]);
    }
    set = g_hash_table_lookup(p->sets, key->str);
    if (set == NULL) {
        set = g_new0(Set, 1);
        set->key = g_string_free(g_steal_pointer(&key), FALSE);
        set->vms = g_array_sized_new(FALSE, FALSE, sizeof(guint32), n_vms);
        g_array_append_vals(set->vms, vms, n_vms);
        set->chunks = g_ptr_array_new();
        g_hash_table_insert(p->sets, set->key, set);
    }
    return set;
}

guint32
pf_pool_alloc(PfPool *p, const guint32 *vms, guint n_vms, const guint8 *content,
              GError **error)
{
    Set *set;
    Chunk *c = NULL;
    guint32 index, slot;
    guint8 copy[PF_PAGE_SIZE];

    g_return_val_if_fail(n_vms > 0, PF_POOL_SLOT_NONE);
    /* content is a guest's page, whose memfd may be truncated under us:
     * the read then raises SIGBUS, which the scanner's guard turns into a
     * jump out of here.  It is read before anything changes, so that the
     * pool stays as it was: no slot taken that nobody holds, and no part
     * of a page in a slot that other VMs' agents can read. */
    memcpy(copy, content, PF_PAGE_SIZE);
    if (p->chunks->len == 0 && pf_pool_zero_slot(p, PF_POOL_SLOT_NONE, error) == 0) {
        return PF_POOL_SLOT_NONE; /* chunk 0 is the zero chunk */
    }
    set = find_set(p, vms, n_vms);
    for (guint i = 0; i < set->chunks->len && c == NULL; i++) {
        Chunk *k = g_ptr_array_index(set->chunks, i);

        if (!k->evacuating && (k->free->len > 0 || k->next < SLOTS)) {
            c = k;
        }
    }
    if (c == NULL && (c = add_chunk(p, set, error)) == NULL) {
        if (set->chunks->len == 0) {
            g_hash_table_remove(p->sets, set->key);
        }
        return PF_POOL_SLOT_NONE;
    }
    /* Freed slots first, since they hold memory already; fresh ones in
     * order keep runs contiguous. */
    if (c->free->len > 0) {
        index = g_array_index(c->free, guint32, c->free->len - 1);
        g_array_set_size(c->free, c->free->len - 1);
    } else {
        index = c->next++;
        p->bytes += PF_PAGE_SIZE;
    }
    slot = c->pub.id * SLOTS + index + 1;
    g_assert(g_array_index(p->refs, guint32, slot) == 0);
    memcpy(slot_data(p, slot), copy, PF_PAGE_SIZE);
    g_array_index(p->refs, guint32, slot) = 1;
    c->live++;
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
    if (p->chunks->len == 0 && add_chunk(p, NULL, error) == NULL) {
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
    guint32 *r, index;
    Chunk *c;

    if (pf_pool_is_zero_slot(slot)) {
        return FALSE;
    }
    r = &g_array_index(p->refs, guint32, slot);
    g_assert(*r > 0);
    if (--*r > 0) {
        return FALSE;
    }
    c = chunk_of(p, slot);
    index = (slot - 1) % SLOTS;
    p->in_use--;
    if (--c->live == 0) {
        drop_chunk(p, c);
        return TRUE;
    }
    if (c->adopted) {
        if (!c->evacuating && c->live * 4 <= SLOTS) {
            c->evacuating = TRUE;
            p->n_evacuating++;
        }
        return TRUE;
    }
    /* The chunk's VMs all shared what the slot held, but whatever a slot
     * held last is nobody's to read once no page maps it. */
    memset(slot_data(p, slot), 0, PF_PAGE_SIZE);
    g_array_append_val(c->free, index);
    if (!c->evacuating && c->next == SLOTS && c->live * 4 <= SLOTS) {
        c->evacuating = TRUE;
        p->n_evacuating++;
    }
    return TRUE;
}

guint32
pf_pool_refs(PfPool *p, guint32 slot)
{
    return g_array_index(p->refs, guint32, slot);
}

guint32
pf_pool_chunk_live(PfPool *p, guint32 chunk)
{
    Chunk *c = chunk_at(p, chunk);

    return c != NULL ? c->live : 0;
}

/* The VM of that serial is one of the chunk's VMs from now on; FALSE if it
 * was already. */
static gboolean
extend_set(PfPool *p, Chunk *c, guint32 vm)
{
    Set *old = c->set;
    g_autoptr(GArray) vms = g_array_copy(old->vms);
    guint at = 0;

    while (at < vms->len && g_array_index(vms, guint32, at) < vm) {
        at++;
    }
    if (at < vms->len && g_array_index(vms, guint32, at) == vm) {
        return FALSE;
    }
    g_array_insert_val(vms, at, vm);
    c->set = find_set(p, (const guint32 *)(gpointer)vms->data, vms->len);
    c->pub.vms = (const guint32 *)(gpointer)c->set->vms->data;
    c->pub.n_vms = c->set->vms->len;
    g_ptr_array_add(c->set->chunks, c);
    g_ptr_array_remove(old->chunks, c);
    if (old->chunks->len == 0) {
        g_hash_table_remove(p->sets, old->key);
    }
    return TRUE;
}

void
pf_pool_extend(PfPool *p, guint32 chunk, guint32 vm)
{
    Chunk *c = chunk_at(p, chunk);

    g_return_if_fail(c != NULL && c->set != NULL && !c->adopted);
    if (!extend_set(p, c, vm)) {
        g_return_if_reached();
    }
}

gboolean
pf_pool_adopt_holder(PfPool *p, guint32 chunk, guint32 vm)
{
    Chunk *c = chunk_at(p, chunk);

    g_return_val_if_fail(c != NULL && c->adopted, FALSE);
    return extend_set(p, c, vm);
}

gboolean
pf_pool_readable(PfPool *p, guint32 slot, guint32 vm)
{
    const Chunk *c;

    if (pf_pool_is_zero_slot(slot)) {
        return TRUE;
    }
    c = chunk_of(p, slot);
    for (guint i = 0; i < c->pub.n_vms; i++) {
        if (c->pub.vms[i] == vm) {
            return TRUE;
        }
    }
    return FALSE;
}

gboolean
pf_pool_evacuating(PfPool *p, guint32 slot)
{
    return !pf_pool_is_zero_slot(slot) && chunk_of(p, slot)->evacuating;
}

guint
pf_pool_n_evacuating(PfPool *p)
{
    return p->n_evacuating;
}

const guint8 *
pf_pool_data(PfPool *p, guint32 slot)
{
    return slot_data(p, slot);
}

const PfPoolChunk *
pf_pool_chunk(PfPool *p, guint32 id)
{
    Chunk *c = chunk_at(p, id);

    return c != NULL ? &c->pub : NULL;
}

const PfPoolChunk *
pf_pool_zero_chunk(PfPool *p)
{
    return pf_pool_chunk(p, 0);
}

gsize
pf_pool_slots_in_use(PfPool *p)
{
    return p->in_use;
}

gsize
pf_pool_n_chunks(PfPool *p)
{
    return p->chunks->len - p->free_ids->len;
}

gsize
pf_pool_bytes(PfPool *p)
{
    return p->bytes;
}
