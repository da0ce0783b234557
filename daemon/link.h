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
 * not finish, a socket it does not read, requests it does not answer) is
 * told why and closed, with
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

/* Opens the agent socket to one group besides root (mode 0660), so that an
 * unprivileged QEMU of that group (libvirt's libvirt-qemu) can connect; a
 * peer is then checked by its credentials at connect (SO_PEERCRED,
 * SO_PEERGROUPS) as well as by the socket's mode. */
gboolean pf_link_server_allow_group(PfLinkServer *srv, const char *group, GError **error);

/* An agent that has requests to answer and answers none for this long is
 * given up, its VM detached (default 30 s). */
void pf_link_server_set_answer_timeout(PfLinkServer *srv, guint ms);

/* Queues one item; formed into a batch by pf_link_flush() or when a batch
 * is full.  A batch goes when the link's window (a few batches sent and
 * not answered) has room, as answers come: it waits in the link, never in
 * a call, and the agent never has more answers to send than its socket
 * holds. */
void pf_link_queue(PfLink *l, const PfWireItem *item, const PfPending *pd);
void pf_link_flush(PfLink *l);
/* Items not answered yet: queued, waiting for the window, or sent. */
gsize pf_link_in_flight(PfLink *l);
/* How many more items the scanner may queue before it waits for answers
 * (0: none).  A soft bound: one decision may queue a few past it. */
gsize pf_link_room(PfLink *l);
/* How long the agent has had requests to answer without answering any
 * (0 when none are sent). */
gint64 pf_link_waiting_usec(PfLink *l);
/* The last request batch sent; whether one sent after that was answered
 * (the agent reads its messages in order: it has dealt with everything
 * sent before). */
guint32 pf_link_sent_seq(PfLink *l);
gboolean pf_link_answered_since(PfLink *l, guint32 seq);
void pf_link_send_chunk(PfLink *l, const PfPoolChunk *chunk);
void pf_link_send_drop(PfLink *l, const PfPoolChunk *chunk);
/* Hands func every request not answered yet, queued or in flight.  One
 * func returns TRUE for is settled: if queued, it is never sent; if in
 * flight, its answer is still awaited (the agent answers every item) and
 * handed to the scanner as usual (func marks it). */
void pf_link_withdraw(PfLink *l, gboolean (*func)(PfPending *pd, gpointer user),
                      gpointer user);
/* Hands every request not answered to func (sent: whether it went to the
 * agent, which may have done it), then frees the link. */
void pf_link_free(PfLink *l, void (*func)(const PfPending *pd, gboolean sent, gpointer user),
                  gpointer user);
