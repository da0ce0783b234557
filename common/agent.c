/*
 * agent.c - the agent's life and what any thread may ask of it: making and
 * freeing a PfAgent, the seams a test or a VMM may replace (its system
 * calls, its thread), and the mode, reason, link state and counters,
 * which are read under a->lock alone.  A reader never takes a->work: a
 * VMM thread asking must not wait behind a merge, nor behind pagefoldd.
 * The work itself is done by the other agent-*.c files (agent-records.h
 * lists what each offers), which call this file; it calls none of theirs
 * but to make and free what they own (agent-pool.c's chunks,
 * agent-outbox.c's messages, agent-backend.c's back-ends and thread), so
 * the files call one way.  pf_agent_free() frees nothing
 * before the agent thread has been joined.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <fcntl.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- the system calls, behind the seam ---- */

static int
real_ioctl(int fd, unsigned long request, void *arg)
{
    return ioctl(fd, request, arg);
}

static const PfAgentSyscalls real_syscalls = {
    mmap, fallocate, pwrite, real_ioctl, madvise,
};

static void *
gthread_create(void *(*fn)(void *), void *arg, void *opaque)
{
    return g_thread_new("pagefold-agent", fn, arg);
}

static void
gthread_join(void *thread, void *opaque)
{
    g_thread_join(thread);
}

static const PfAgentThreads gthreads = { gthread_create, gthread_join, NULL };

void
pf_agent_set_threads(PfAgent *a, const PfAgentThreads *threads)
{
    a->threads = threads != NULL ? *threads : gthreads;
}

void
pf_agent_set_syscalls(PfAgent *a, const PfAgentSyscalls *sys)
{
    a->sys = sys != NULL ? *sys : real_syscalls;
}

/* ---- making and freeing ---- */

PfAgent *
pf_agent_new(const char *vm_name, const guint8 *uuid)
{
    PfAgent *a = g_new0(PfAgent, 1);

    /* A label: pagefoldd tells VMs apart by their pids. */
    a->name = g_strdup(vm_name != NULL && *vm_name ? vm_name : "qemu");
    if (uuid != NULL) {
        memcpy(a->uuid, uuid, 16);
    }
    a->regions = g_array_new(FALSE, TRUE, sizeof(Region));
    a->chunks = g_ptr_array_new_with_free_func(pfa_chunk_free);
    a->dma_ranges = g_array_new(FALSE, FALSE, sizeof(DmaRange));
    a->written = g_array_new(FALSE, FALSE, sizeof(DmaRange));
    a->sys = real_syscalls;
    a->threads = gthreads;
    a->sock = a->uffd = a->uffd_dev = -1;
    pfa_backends_init(a);
    a->stop[0] = a->stop[1] = a->wake[0] = a->wake[1] = -1;
    a->mode = PF_MODE_ADVISE;
    g_mutex_init(&a->lock);
    g_mutex_init(&a->work);
    g_mutex_init(&a->dma);
    g_mutex_init(&a->out);
    g_cond_init(&a->settled_cond);
    g_queue_init(&a->outbox);
    return a;
}

void
pf_agent_free(PfAgent *a)
{
    if (a == NULL) {
        return;
    }
    if (a->thread != NULL) {
        (void)!write(a->stop[1], "x", 1);
        /* A send blocked on a stuck pagefoldd ends now, not in 5 s. */
        shutdown(a->sock, SHUT_RDWR);
        a->threads.join(a->thread, a->threads.opaque);
    }
    pfa_backends_clear(a);
    for (int i = 0; i < 2; i++) {
        if (a->stop[i] >= 0) {
            close(a->stop[i]);
        }
        if (a->wake[i] >= 0) {
            close(a->wake[i]);
        }
    }
    if (a->sock >= 0) {
        close(a->sock);
    }
    if (a->uffd >= 0) {
        close(a->uffd);
    }
    if (a->uffd_dev >= 0) {
        close(a->uffd_dev);
    }
    for (guint i = 0; i < a->regions->len; i++) {
        pfa_region_clear(&g_array_index(a->regions, Region, i));
    }
    g_queue_clear_full(&a->outbox, pfa_outgoing_free);
    g_array_unref(a->regions);
    g_ptr_array_unref(a->chunks);
    g_array_unref(a->dma_ranges);
    g_array_unref(a->written);
    g_mutex_clear(&a->lock);
    g_mutex_clear(&a->work);
    g_mutex_clear(&a->dma);
    g_mutex_clear(&a->out);
    g_cond_clear(&a->settled_cond);
    g_free(a->start_error);
    g_free(a->connect_to);
    g_free(a->socket_path);
    g_free(a->advise_reason);
    g_free(a->reason);
    g_free(a->name);
    g_free(a);
}

/* A region's own memory and descriptor: as it is freed, and as a
 * region plugged in is given up. */
void
pfa_region_clear(Region *r)
{
    g_free(r->name);
    g_free(r->remapped);
    g_free(r->refused);
    if (r->fd >= 0) {
        close(r->fd);
    }
}

/* ---- what any thread may ask ---- */

void
pfa_set_connected(PfAgent *a, gboolean connected)
{
    g_mutex_lock(&a->lock);
    a->connected = connected;
    g_mutex_unlock(&a->lock);
}

/* Mode and reason change under work and lock: readers take either. */
void
pfa_set_mode(PfAgent *a, PfMode mode, const char *reason)
{
    g_mutex_lock(&a->lock);
    a->mode = mode;
    g_free(a->reason);
    a->reason = g_strdup(reason);
    g_mutex_unlock(&a->lock);
}

PfMode
pf_agent_get_mode(PfAgent *a)
{
    PfMode m;

    g_mutex_lock(&a->lock);
    m = a->mode;
    g_mutex_unlock(&a->lock);
    return m;
}

char *
pf_agent_dup_reason(PfAgent *a)
{
    char *r;

    g_mutex_lock(&a->lock);
    r = g_strdup(a->reason ? a->reason : "");
    g_mutex_unlock(&a->lock);
    return r;
}

gboolean
pf_agent_is_connected(PfAgent *a)
{
    gboolean c;

    g_mutex_lock(&a->lock);
    c = a->connected;
    g_mutex_unlock(&a->lock);
    return c;
}

void
pf_agent_get_stats(PfAgent *a, PfAgentStats *stats)
{
    g_mutex_lock(&a->lock);
    *stats = a->stats;
    g_mutex_unlock(&a->lock);
}
