/*
 * link.h - pagefoldd's end of the agent protocol: the agent socket, one
 * PfLink per connected VM, the batches of requests in flight.
 *
 * Owns the agent connections.  A peer is believed only as far as its
 * process shows: its regions must be what that process maps, merge mode
 * must be backed by write protection, and /dev/userfaultfd goes only to a
 * peer with a region that passed.  A region that fails those checks, at the
 * handshake or plugged in later, costs its VM that region only: it stays a
 * refused placeholder at its index, never scanned.  A link that misbehaves
 * (bad message, wrong pid, a region index out of turn, GONE or DISCARD of
 * a region that is not live, a result for no request, a handshake it does
 * not finish, a socket it does not read) is told why and closed, with
 * every descriptor it passed, and its VM is detached; the daemon and the
 * other VMs carry on.  Never waits for a peer on the main loop, and never
 * decides a merge: it carries the scanner's requests and the agents'
 * answers.
 */
#pragma once

#include <glib.h>

#include "pool.h"
#include "scan.h"

typedef struct _PfLinkServer PfLinkServer;

PfLinkServer *pf_link_server_new(PfScanner *s, const char *path, GError **error);
void pf_link_server_free(PfLinkServer *srv);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfLinkServer, pf_link_server_free)

/* Queues one item; sent by pf_link_flush() or when a batch is full.  A
 * batch the socket cannot take yet waits in the link, never in a call. */
void pf_link_queue(PfLink *l, const PfWireItem *item, const PfPending *pd);
void pf_link_flush(PfLink *l);
gsize pf_link_in_flight(PfLink *l);
/* The last request batch sent; whether one sent after that was answered
 * (the agent reads its messages in order: it has dealt with everything
 * sent before). */
guint32 pf_link_sent_seq(PfLink *l);
gboolean pf_link_answered_since(PfLink *l, guint32 seq);
/* Reads answers (sending what still waits) until none is outstanding or
 * timeout_ms passed; a peer that reads nothing is given up sooner. */
void pf_link_settle(PfLink *l, guint timeout_ms);
void pf_link_send_chunk(PfLink *l, const PfPoolChunk *chunk);
void pf_link_send_drop(PfLink *l, const PfPoolChunk *chunk);
/* Hands func every request not answered yet, queued or in flight.  One
 * func returns TRUE for is settled: if queued, it is never sent; if in
 * flight, its answer is still awaited (the agent answers every item) and
 * handed to the scanner as usual (func marks it). */
void pf_link_withdraw(PfLink *l, gboolean (*func)(PfPending *pd, gpointer user),
                      gpointer user);
/* Hands every request still in flight to func, then frees the link. */
void pf_link_free(PfLink *l, void (*func)(const PfPending *pd, gpointer user), gpointer user);
