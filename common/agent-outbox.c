/*
 * agent-outbox.c - what pagefoldd hears: messages queued by whichever
 * thread made them true, under a->work so that they are in the order
 * things happened, and sent by the agent thread alone.  A VMM thread never
 * sends here nor waits on pagefoldd's socket: a pagefoldd that is stuck
 * must not stall a vCPU, or QEMU's big lock.  Nothing is queued after an
 * ERROR, nor once the link is gone.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

/* A message for pagefoldd, queued in the order things happened. */
typedef struct {
    PfMsgType type;
    guint32 seq;
    int fd; /* a dup, sent with it and closed; or -1 */
    gsize length;
    guint8 payload[];
} Outgoing;

void
pfa_outgoing_free(gpointer p)
{
    Outgoing *o = p;

    if (o->fd >= 0) {
        close(o->fd);
    }
    g_free(o);
}

/* The pages a HINT tells of; 0 for any other message. */
static guint64
hint_pages(const Outgoing *o)
{
    const PfWireRange *r = (const PfWireRange *)o->payload;
    guint64 n = 0;

    for (gsize i = 0; o->type == PF_MSG_HINT && i < o->length / sizeof(*r); i++) {
        n += r[i].n_pages;
    }
    return n;
}

void
pfa_count_hints(PfAgent *a, guint64 told, guint64 dropped)
{
    if (told + dropped > 0) {
        g_mutex_lock(&a->lock);
        a->stats.hinted += told;
        a->stats.hints_dropped += dropped;
        g_mutex_unlock(&a->lock);
    }
}

/* The link ended: what was not sent never will be, and nothing is queued
 * until the next link says READY.  Called with a->work held. */
void
pfa_outbox_discard(PfAgent *a)
{
    GQueue gone;
    guint64 dropped = 0;

    g_mutex_lock(&a->out);
    a->posting = FALSE;
    a->hangup = FALSE;
    gone = a->outbox;
    g_queue_init(&a->outbox);
    g_mutex_unlock(&a->out);
    for (GList *l = gone.head; l != NULL; l = l->next) {
        dropped += hint_pages(l->data);
    }
    g_queue_clear_full(&gone, pfa_outgoing_free);
    pfa_count_hints(a, 0, dropped);
}

/*
 * Queues a message for pagefoldd; the agent thread sends it.  Called with
 * a->work held (or before the agent thread runs), so that pagefoldd hears
 * of things in the order they happened, and no thread of the VMM waits on
 * pagefoldd's socket.  fd, if not -1, is duplicated.  Nothing is queued
 * after an ERROR, nor once the link is gone.
 */
void
pfa_post(PfAgent *a, PfMsgType type, guint32 seq, const void *payload,
         gsize length, int fd)
{
    Outgoing *o = g_malloc(sizeof(*o) + length);
    int e = 0;

    o->type = type;
    o->seq = seq;
    o->length = length;
    memcpy(o->payload, payload, length);
    o->fd = -1;
    if (fd >= 0) {
        o->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (o->fd < 0) {
            e = errno;
        }
    }
    g_mutex_lock(&a->out);
    if (!a->posting) {
        g_mutex_unlock(&a->out);
        pfa_count_hints(a, 0, hint_pages(o));
        pfa_outgoing_free(o);
        return;
    }
    if (e != 0) {
        /* The message cannot go, and what follows it would be wrong. */
        g_autofree char *text =
            g_strdup_printf("cannot duplicate a descriptor to send: %s",
                            g_strerror(e));

        g_warning("pagefold agent: %s; disconnecting", text);
        o = g_realloc(o, sizeof(*o) + strlen(text));
        o->type = type = PF_MSG_ERROR;
        o->length = strlen(text);
        memcpy(o->payload, text, o->length);
    }
    g_queue_push_tail(&a->outbox, o);
    if (type == PF_MSG_ERROR) {
        a->posting = FALSE;
        a->hangup = TRUE;
    }
    g_mutex_unlock(&a->out);
    /* A full pipe is readable already. */
    (void)!write(a->wake[1], "x", 1);
}

void
pfa_post_error(PfAgent *a, const char *text)
{
    /* The agent gives up on this pagefoldd: no link is made again. */
    a->parted = TRUE;
    pfa_post(a, PF_MSG_ERROR, 0, text, MIN(strlen(text), 1024), -1);
}

/*
 * Sends what was queued, on the agent thread.  FALSE when the link is to
 * end: a send failed (error set), or an ERROR went out (error unset).
 */
gboolean
pfa_flush(PfAgent *a, GError **error)
{
    for (;;) {
        Outgoing *o;
        gboolean ok, hangup;
        guint64 pages;

        g_mutex_lock(&a->out);
        o = g_queue_pop_head(&a->outbox);
        hangup = a->hangup;
        g_mutex_unlock(&a->out);
        if (o == NULL) {
            return !hangup;
        }
        if (o->type == PF_MSG_RESULT) {
            ok = pf_proto_send_results(
                a->sock, o->seq, (const PfWireResult *)o->payload,
                (guint32)(o->length / sizeof(PfWireResult)), error);
        } else if (o->type == PF_MSG_HINT) {
            ok = pf_proto_send_hints(
                a->sock, (const PfWireRange *)o->payload,
                (guint32)(o->length / sizeof(PfWireRange)), error);
            /* Counted as told once sent, as dropped if it cannot be. */
            pages = hint_pages(o);
            pfa_count_hints(a, ok ? pages : 0, ok ? 0 : pages);
        } else {
            ok = pf_proto_send(a->sock, o->type, o->seq, o->payload,
                               o->length, &o->fd, o->fd >= 0 ? 1 : 0, error);
        }
        pfa_outgoing_free(o);
        if (!ok) {
            return FALSE;
        }
    }
}

/*
 * Pages back in their memfd: one DISCARD a span between pages still
 * remapped (pagefoldd passes over the pages of a span that were never
 * merged).
 */
void
pfa_tell_folded(PfAgent *a, guint i, gsize from, gsize n, const guint64 *was,
                gboolean backend)
{
    const Region *r = &g_array_index(a->regions, Region, i);
    gsize k = 0;

    while (k < n) {
        PfWireRange wr = { i, backend && a->version >= PF_PROTO_VERSION_BACKEND
                                  ? PF_RANGE_BACKEND : 0, from + k, 0 };
        gboolean back = FALSE;
        gsize run = k;

        while (run < n && !pfa_is_remapped(r, from + run)) {
            back |= (was[run / 64] >> (run % 64)) & 1;
            run++;
        }
        /*
         * Before READY (a link after the first) pagefoldd reads the
         * process's mappings as they are: no news.
         */
        if (back && a->ready) {
            wr.n_pages = run - k;
            pfa_post(a, PF_MSG_DISCARD, 0, &wr, sizeof(wr), -1);
        }
        k = run + 1;
    }
}
