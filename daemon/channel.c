/*
 * channel.c - the sending side of one agent connection (channel.h): the
 * queue of messages the socket could not take, the G_IO_OUT watch that
 * drains it and the stall timer that gives a silent reader up.  Owns the
 * queued messages and the descriptors they carry; never the socket.
 */
#include "channel.h"

#include <errno.h>
#include <fcntl.h>
#include <glib-unix.h>
#include <unistd.h>

#include "util.h"

/* A message the socket could not take yet. */
typedef struct {
    PfMsgType type;
    guint32 seq;
    guint8 *data; /* the payload, or a REQUEST's items */
    gsize len;
    int fd;       /* owned, or -1 */
} OutMsg;

struct _PfChannel {
    int sock;
    GQueue out;        /* OutMsg*, oldest first */
    guint out_watch;   /* G_IO_OUT, while out is not empty */
    guint stall_timer; /* while out is not empty */
    gint64 last_sent;  /* the socket last took a message, or out filled */
    gboolean broken;   /* nothing more is sent */
    PfChannelBrokenFunc on_broken;
    gpointer user;
};

static void
out_msg_free(OutMsg *m)
{
    if (m->fd >= 0) {
        close(m->fd);
    }
    g_free(m->data);
    g_free(m);
}

static void
out_clear(PfChannel *ch)
{
    g_queue_clear_full(&ch->out, (GDestroyNotify)out_msg_free);
    g_clear_handle_id(&ch->out_watch, g_source_remove);
    g_clear_handle_id(&ch->stall_timer, g_source_remove);
}

PfChannel *
pf_channel_new(int sock, PfChannelBrokenFunc broken, gpointer user)
{
    PfChannel *ch = g_new0(PfChannel, 1);

    ch->sock = sock;
    g_queue_init(&ch->out);
    ch->on_broken = broken;
    ch->user = user;
    return ch;
}

void
pf_channel_free(PfChannel *ch)
{
    if (ch == NULL) {
        return;
    }
    out_clear(ch);
    g_free(ch);
}

gboolean
pf_channel_broken(PfChannel *ch)
{
    return ch->broken;
}

/* Nothing more can be sent. */
static void
channel_break(PfChannel *ch, const char *why)
{
    if (ch->broken) {
        return;
    }
    ch->broken = TRUE;
    out_clear(ch);
    ch->on_broken(why, ch->user);
}

static gboolean
out_send(PfChannel *ch, const OutMsg *m, GError **error)
{
    if (m->type == PF_MSG_REQUEST) {
        return pf_proto_send_items(ch->sock, m->seq, (const PfWireItem *)m->data,
                                   (guint32)(m->len / sizeof(PfWireItem)), error);
    }
    return pf_proto_send(ch->sock, m->type, m->seq, m->data, m->len, &m->fd,
                         m->fd >= 0 ? 1 : 0, error);
}

/* Sends what waits, as far as the socket takes it, without waiting. */
static void
out_flush(PfChannel *ch)
{
    OutMsg *m;

    while (!ch->broken && (m = g_queue_peek_head(&ch->out)) != NULL) {
        g_autoptr(GError) error = NULL;

        if (!out_send(ch, m, &error)) {
            if (!g_error_matches(error, PF_ERROR, PF_ERROR_WOULD_BLOCK)) {
                channel_break(ch, error->message);
            }
            return;
        }
        out_msg_free(g_queue_pop_head(&ch->out));
        ch->last_sent = g_get_monotonic_time();
    }
    if (g_queue_is_empty(&ch->out)) {
        g_clear_handle_id(&ch->stall_timer, g_source_remove);
    }
}

static gboolean
out_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfChannel *ch = user;

    out_flush(ch);
    if (ch->broken || g_queue_is_empty(&ch->out)) {
        ch->out_watch = 0;
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

/* How long the peer has left to take something from its socket. */
static gint64
stall_left_ms(PfChannel *ch)
{
    return (ch->last_sent + (gint64)SEND_STALL_MS * 1000 - g_get_monotonic_time()) / 1000;
}

static gboolean
stall_cb(gpointer user)
{
    PfChannel *ch = user;
    gint64 left;

    ch->stall_timer = 0;
    out_flush(ch);
    if (ch->broken || g_queue_is_empty(&ch->out)) {
        return G_SOURCE_REMOVE;
    }
    left = stall_left_ms(ch);
    if (left <= 0) {
        channel_break(ch, "not reading its socket: it took nothing for "
                          G_STRINGIFY(SEND_STALL_MS) " ms");
        return G_SOURCE_REMOVE;
    }
    ch->stall_timer = g_timeout_add((guint)left + 1, stall_cb, ch);
    return G_SOURCE_REMOVE;
}

void
pf_channel_send(PfChannel *ch, PfMsgType type, guint32 seq, gconstpointer data, gsize len,
                int fd)
{
    OutMsg *m;

    if (ch->broken) {
        return;
    }
    if (g_queue_is_empty(&ch->out)) {
        OutMsg now = { type, seq, (guint8 *)data, len, fd };
        g_autoptr(GError) error = NULL;

        if (out_send(ch, &now, &error)) {
            ch->last_sent = g_get_monotonic_time();
            return;
        }
        if (!g_error_matches(error, PF_ERROR, PF_ERROR_WOULD_BLOCK)) {
            channel_break(ch, error->message);
            return;
        }
        /* The stall clock starts when the socket first says no. */
        ch->last_sent = g_get_monotonic_time();
    }
    m = g_new0(OutMsg, 1);
    m->type = type;
    m->seq = seq;
    m->data = g_memdup2(data, len);
    m->len = len;
    /* Our own descriptor: the pool may free its chunk meanwhile. */
    m->fd = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 3) : -1;
    if (fd >= 0 && m->fd < 0) {
        g_autofree char *why = g_strdup_printf("cannot keep a descriptor to send: %s",
                                               g_strerror(errno));

        out_msg_free(m);
        channel_break(ch, why);
        return;
    }
    g_queue_push_tail(&ch->out, m);
    if (ch->out_watch == 0) {
        ch->out_watch = pf_fd_add(ch->sock, G_IO_OUT, out_cb, ch);
    }
    if (ch->stall_timer == 0) {
        ch->stall_timer = g_timeout_add(SEND_STALL_MS, stall_cb, ch);
    }
    out_flush(ch);
}
