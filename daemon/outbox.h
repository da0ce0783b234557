/*
 * outbox.h - what pagefoldd has asked of one VM's agent and not yet heard
 * back: the requests, from the scanner's decision to the agent's answer,
 * and the flow control between them.
 *
 * Plain data with one writer at each end.  The scanner core fills it
 * (pf_outbox_push(), pf_outbox_flush()), settles what it no longer needs
 * (pf_outbox_withdraw(), pf_outbox_abandon()) and takes the answered
 * batches back (pf_outbox_pop_answered()); the agent's link drains it
 * (pf_outbox_take()) when the drain callback it registered says there is
 * something to send.  The outbox never sends, never reads a socket and
 * never decides anything; the core never learns who drains it.
 *
 * A request is queued (in the open batch), held (in a batch formed and
 * waiting for the window) or sent (in a numbered batch, waiting for its
 * answer).  It stays the core's until answered: its PfPending says what it
 * holds in the pool and the trees.
 */
#pragma once

#include <glib.h>

#include "proto.h"

/*
 * Items sent and not answered yet, at most.  The agent answers on a
 * blocking socket: the answers to this many must fit in what its socket
 * holds (it asks for 256 KiB; a batch's answer is 16 KiB), or it would
 * wait for pagefoldd while pagefoldd waits for it.  Requests past it are
 * held, formed and numbered when they go.
 */
#define PF_OUTBOX_WINDOW_ITEMS (4 * PF_PROTO_MAX_ITEMS)

/* What pagefoldd asked an agent to do with one page, kept until it
 * answers. */
typedef struct {
    guint32 page; /* page id */
    guint32 slot; /* pool slot referenced for it, or PF_POOL_SLOT_NONE */
    guint32 node; /* stable node, or 0 */
    guint32 from; /* a merged page moving to node: the node it leaves,
                   * whose slot it keeps a reference on until answered */
    guint8 kind;  /* PfItemKind */
    guint8 settled; /* its region left the VM first: what it held is let
                     * go, and its answer changes nothing */
} PfPending;

typedef struct {
    gboolean sent;   /* taken by the drain, numbered */
    guint32 seq;     /* its number, once sent (any value: they wrap) */
    GArray *items;   /* PfWireItem */
    GArray *pending; /* PfPending, one per item */
} PfOutBatch;

typedef struct _PfOutbox PfOutbox;

/* Called when batches wait for pf_outbox_take(). */
typedef void (*PfOutboxDrainFunc)(PfOutbox *ob, gpointer user);

PfOutbox *pf_outbox_new(void);
/* Whatever is still in it goes unanswered: abandon it first. */
void pf_outbox_free(PfOutbox *ob);
void pf_out_batch_free(PfOutBatch *b);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfOutBatch, pf_out_batch_free)

/* The one who sends its batches; NULL when none (nothing is sent). */
void pf_outbox_set_drain(PfOutbox *ob, PfOutboxDrainFunc func, gpointer user);

/* Queues one request; a full batch is formed at once (and the drain told). */
void pf_outbox_push(PfOutbox *ob, const PfWireItem *item, const PfPending *pd);
/* Forms what is queued into a batch, in the order of guest addresses
 * (unmerges last), and tells the drain if any waits. */
void pf_outbox_flush(PfOutbox *ob);

/* The next held batch, now sent (numbered), if the window lets it go;
 * NULL otherwise.  It stays in the outbox until answered. */
const PfOutBatch *pf_outbox_take(PfOutbox *ob);
/* Whether a RESULT numbered seq with n entries answers the oldest batch
 * sent: agents answer in order, every item of every batch. */
gboolean pf_outbox_answers(PfOutbox *ob, guint32 seq, guint32 n);
/* The oldest batch sent, answered: the caller's now. */
PfOutBatch *pf_outbox_pop_answered(PfOutbox *ob);

/* Items in the open batch, and how long its first has waited (0: none). */
gsize pf_outbox_n_queued(PfOutbox *ob);
gint64 pf_outbox_queued_usec(PfOutbox *ob);
/* Items not answered yet: queued, held or sent. */
gsize pf_outbox_in_flight(PfOutbox *ob);
/* Items formed into batches, held or sent, and not answered: what the
 * drain was told of.  (The open batch goes with the next flush: a scan's
 * requests as the scan ends.) */
gsize pf_outbox_n_batched(PfOutbox *ob);
/* Items sent and not answered. */
gsize pf_outbox_n_sent(PfOutbox *ob);
/* How many more items may be queued before the scanner waits for answers
 * (0: none).  A soft bound: one decision may queue a few past it. */
gsize pf_outbox_room(PfOutbox *ob);
/* How long the agent has had requests to answer without answering any
 * (0 when none are sent). */
gint64 pf_outbox_waiting_usec(PfOutbox *ob);
/* The last batch sent, and the last answered; whether that one came after
 * batch seq (the numbers wrap; the agent reads its messages in order: it
 * has dealt with everything sent before). */
guint32 pf_outbox_sent_seq(PfOutbox *ob);
guint32 pf_outbox_answered_seq(PfOutbox *ob);
static inline gboolean
pf_outbox_seq_after(guint32 answered, guint32 seq)
{
    return answered - seq - 1 < G_MAXUINT32 / 2;
}

/* Hands func every request not answered yet, queued, held or sent.  One
 * func returns TRUE for is settled: if not sent, it never is; if sent, its
 * answer is still awaited (the agent answers every item) and handed back
 * as usual (func marks it). */
void pf_outbox_withdraw(PfOutbox *ob, gboolean (*func)(PfPending *pd, gpointer user),
                        gpointer user);
/* Empties the outbox, then hands every request it held to func (sent:
 * whether it went to the agent, which may have done it): func sees an
 * outbox that no longer has them. */
void pf_outbox_abandon(PfOutbox *ob,
                       void (*func)(const PfPending *pd, gboolean sent, gpointer user),
                       gpointer user);
/* Every request not answered, oldest first, for a look. */
void pf_outbox_foreach(PfOutbox *ob,
                       void (*func)(const PfWireItem *item, const PfPending *pd, gboolean sent,
                                    gpointer user),
                       gpointer user);
