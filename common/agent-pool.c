/*
 * agent-pool.c - the pool chunks pagefoldd sends (POOL) and lets go of
 * (DROP): their descriptors, which merges map slots from, and read-only
 * mappings, which merges compare against.  Never accepts a chunk that
 * pagefoldd could still write through a new mapping (it must be sealed),
 * nor one smaller than its slots, nor an id already held; never writes to
 * a chunk.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define POOL_SEALS (F_SEAL_FUTURE_WRITE | F_SEAL_GROW | F_SEAL_SHRINK)

/* The chunk of this id that pagefoldd sent and has not dropped, or NULL. */
Chunk *
pfa_held_chunk(PfAgent *a, guint32 id)
{
    return id < a->chunks->len ? g_ptr_array_index(a->chunks, id) : NULL;
}

gboolean
pfa_take_chunk(PfAgent *a, PfMsg *msg, GError **error)
{
    const PfWirePool *p = pf_msg_pool(msg);
    int fd = msg->fds[0];
    int seals = fcntl(fd, F_GET_SEALS);
    struct stat st;
    Chunk *c;
    void *map;

    msg->n_fds = 0; /* ours now */
    if (seals < 0 || (seals & POOL_SEALS) != POOL_SEALS) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pool chunk %u is not sealed against writing and resizing "
                    "(seals 0x%x)", p->chunk, seals < 0 ? 0 : seals);
        return FALSE;
    }
    /*
     * pf_proto_recv() refused larger ids already: the array of chunks
     * stays within what the protocol allows.
     */
    if (p->chunk >= PF_PROTO_MAX_CHUNKS ||
        pfa_held_chunk(a, p->chunk) != NULL) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pool chunk %u is out of range, or sent again without a "
                    "DROP", p->chunk);
        return FALSE;
    }
    if (fstat(fd, &st) < 0 ||
        (guint64)st.st_size < (guint64)p->n_slots * PF_PAGE_SIZE) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pool chunk %u is smaller than its %u slots", p->chunk,
                    p->n_slots);
        return FALSE;
    }
    map = mmap(NULL, (gsize)p->n_slots * PF_PAGE_SIZE, PROT_READ, MAP_SHARED,
               fd, 0);
    if (map == MAP_FAILED) {
        int e = errno;

        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot map pool chunk %u: %s", p->chunk, g_strerror(e));
        return FALSE;
    }
    c = g_new0(Chunk, 1);
    c->fd = fd;
    c->map = map;
    c->n_slots = p->n_slots;
    if (p->chunk >= a->chunks->len) {
        g_ptr_array_set_size(a->chunks, (gint)p->chunk + 1);
    }
    g_ptr_array_index(a->chunks, p->chunk) = c;
    return TRUE;
}

void
pfa_chunk_free(gpointer p)
{
    Chunk *c = p;

    if (c == NULL) {
        return;
    }
    /*
     * Merged pages keep their own references to the memory.  Neither
     * call can fail on what pfa_take_chunk() made; if one did, the chunk's
     * memory would only stay taken.
     */
    if (munmap((void *)c->map, (gsize)c->n_slots * PF_PAGE_SIZE) < 0) {
        g_warning("pagefold agent: cannot unmap a pool chunk: %s",
                  g_strerror(errno));
    }
    if (close(c->fd) < 0) {
        g_warning("pagefold agent: cannot close a pool chunk: %s",
                  g_strerror(errno));
    }
    g_free(c);
}

/*
 * No page of this VM maps the chunk any more, says pagefoldd: its fd and
 * its compare mapping go, and its id may come again in a later POOL (with
 * other memory).  Only a chunk held, of the size it was sent with: any
 * other DROP means pagefoldd's idea of this VM is wrong, and the link is
 * given up.  A page that still mapped it (pagefoldd being wrong after
 * all) would stay valid: its mapping holds the memory.
 */
gboolean
pfa_drop_chunk(PfAgent *a, const PfMsg *msg, GError **error)
{
    const PfWirePool *p = pf_msg_pool(msg);
    Chunk *c = pfa_held_chunk(a, p->chunk);

    if (c == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "DROP of pool chunk %u, which this agent does not hold",
                    p->chunk);
        return FALSE;
    }
    if (c->n_slots != p->n_slots) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "DROP of pool chunk %u of %u slots, which this agent "
                    "holds with %u", p->chunk, p->n_slots, c->n_slots);
        return FALSE;
    }
    g_ptr_array_index(a->chunks, p->chunk) = NULL;
    pfa_chunk_free(c);
    return TRUE;
}
