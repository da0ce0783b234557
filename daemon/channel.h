/*
 * channel.h - the sending side of one agent connection.  A message the
 * socket cannot take yet waits here, in order, with its own copy of the
 * descriptor it carries; a peer that takes nothing for SEND_STALL_MS, or a
 * send that fails, breaks the channel, which tells its owner once and
 * sends nothing more.  Never blocks, never reads the socket, never closes
 * it (its owner does).
 */
#pragma once

#include <glib.h>

#include "proto.h"

/* A peer whose socket took nothing for this long while we had something
 * to send is not reading it. */
#define SEND_STALL_MS 5000

typedef struct _PfChannel PfChannel;

/* The channel broke (why: what failed); called once, from a send or from
 * the main loop.  Its owner must not free the channel inside it. */
typedef void (*PfChannelBrokenFunc)(const char *why, gpointer user);

PfChannel *pf_channel_new(int sock, PfChannelBrokenFunc broken, gpointer user);
/* Drops what still waits. */
void pf_channel_free(PfChannel *ch);

/*
 * Sends a message, or queues it behind those waiting, and never blocks.
 * The queue needs no bound of its own: a peer that does not drain it is
 * given up after SEND_STALL_MS, and until then it holds at most what the
 * scanner's outbox lets go (its window) plus a message per pool chunk.
 * fd is the caller's: the channel sends it now or keeps a copy.
 */
void pf_channel_send(PfChannel *ch, PfMsgType type, guint32 seq, gconstpointer data,
                     gsize len, int fd);
gboolean pf_channel_broken(PfChannel *ch);
