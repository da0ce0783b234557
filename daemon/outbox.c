/*
 * outbox.c - one VM's requests to its agent, queued, held and sent, with
 * the window that keeps neither end waiting for the other.  Owns the
 * batches and their numbers; must never send, read a socket, or look at
 * what a request means (that is the scanner's, in PfPending).
 */
#include "outbox.h"

#include "cpu-use.h"

/* Huge pages to make again, per batch at most: each is a compaction and a
 * 2 MiB copy in the agent, and a batch must be answered well within the
 * answer timeout. */
#define MAX_COLLAPSES 32

struct _PfOutbox {
    GArray *queue_items;   /* PfWireItem: the open batch */
    GArray *queue_pending; /* PfPending */
    guint queue_collapses; /* PF_ITEM_COLLAPSE items queued */
    gint64 queue_since;    /* monotonic: the open batch's first item */
    GQueue held;           /* PfOutBatch*: formed, waiting for the window */
    gsize n_held;
    GQueue sent;           /* PfOutBatch*, oldest first */
    gsize n_sent;
    guint32 next_seq;
    guint32 answered_seq;  /* of the last batch answered */
    gint64 last_answer;    /* monotonic: the last answer, or when the
                            * window last opened from empty */
    PfOutboxDrainFunc drain;
    gpointer drain_user;
};

static void
queue_reset(PfOutbox *ob)
{
    ob->queue_items = g_array_new(FALSE, FALSE, sizeof(PfWireItem));
    ob->queue_pending = g_array_new(FALSE, FALSE, sizeof(PfPending));
    ob->queue_collapses = 0;
}

PfOutbox *
pf_outbox_new(void)
{
    PfOutbox *ob = g_new0(PfOutbox, 1);

    queue_reset(ob);
    g_queue_init(&ob->held);
    g_queue_init(&ob->sent);
    return ob;
}

void
pf_out_batch_free(PfOutBatch *b)
{
    g_array_unref(b->pending);
    g_array_unref(b->items);
    g_free(b);
}

void
pf_outbox_free(PfOutbox *ob)
{
    if (ob == NULL) {
        return;
    }
    g_queue_clear_full(&ob->sent, (GDestroyNotify)pf_out_batch_free);
    g_queue_clear_full(&ob->held, (GDestroyNotify)pf_out_batch_free);
    g_array_unref(ob->queue_items);
    g_array_unref(ob->queue_pending);
    g_free(ob);
}

void
pf_outbox_set_drain(PfOutbox *ob, PfOutboxDrainFunc func, gpointer user)
{
    ob->drain = func;
    ob->drain_user = user;
}

typedef struct {
    PfWireItem item;
    PfPending pd;
} Entry;

/* Unmerges after the rest, each kind in the order of its pages; items of
 * one page keep their order (g_qsort_with_data() is stable). */
static gint
entry_cmp(gconstpointer a, gconstpointer b, gpointer user)
{
    const PfWireItem *x = &((const Entry *)a)->item, *y = &((const Entry *)b)->item;
    int kx = x->kind == PF_ITEM_UNMERGE, ky = y->kind == PF_ITEM_UNMERGE;

    if (x->region != y->region) {
        return x->region < y->region ? -1 : 1;
    }
    if (kx != ky) {
        return kx - ky;
    }
    return x->page < y->page ? -1 : x->page > y->page;
}

/*
 * A batch in the order of guest addresses: the agent protects pages near
 * each other as one window and maps consecutive ones as one run, and a
 * window's protection and its lifting each cost a TLB flush on every CPU
 * the VM runs on.  Decisions come in the scanner's order: hinted pages,
 * the cursor's, the partners they matched anywhere.
 */
static void
sort_batch(GArray *items, GArray *pending)
{
    g_autofree Entry *e = g_new(Entry, items->len);

    for (guint i = 0; i < items->len; i++) {
        e[i].item = g_array_index(items, PfWireItem, i);
        e[i].pd = g_array_index(pending, PfPending, i);
    }
    g_qsort_with_data(e, (gint)items->len, sizeof(*e), entry_cmp, NULL);
    for (guint i = 0; i < items->len; i++) {
        g_array_index(items, PfWireItem, i) = e[i].item;
        g_array_index(pending, PfPending, i) = e[i].pd;
    }
}

static void
form_batch(PfOutbox *ob)
{
    PfOutBatch *b;

    if (ob->queue_items->len == 0) {
        ob->queue_collapses = 0;
        return;
    }
    b = g_new0(PfOutBatch, 1);
    b->items = ob->queue_items;
    b->pending = ob->queue_pending;
    sort_batch(b->items, b->pending);
    queue_reset(ob);
    g_queue_push_tail(&ob->held, b);
    ob->n_held += b->pending->len;
}

void
pf_outbox_flush(PfOutbox *ob)
{
    if (ob->queue_items->len == 0 && ob->n_held == 0) {
        return;
    }
    pf_cpu_enter(PF_CPU_REQUESTS);
    form_batch(ob);
    if (ob->n_held > 0 && ob->drain != NULL) {
        ob->drain(ob, ob->drain_user);
    }
    pf_cpu_leave();
}

void
pf_outbox_push(PfOutbox *ob, const PfWireItem *item, const PfPending *pd)
{
    if (ob->queue_items->len == 0) {
        ob->queue_since = g_get_monotonic_time();
    }
    g_array_append_vals(ob->queue_items, item, 1);
    g_array_append_vals(ob->queue_pending, pd, 1);
    ob->queue_collapses += item->kind == PF_ITEM_COLLAPSE;
    if (ob->queue_items->len >= PF_PROTO_MAX_ITEMS || ob->queue_collapses >= MAX_COLLAPSES) {
        pf_outbox_flush(ob);
    }
}

const PfOutBatch *
pf_outbox_take(PfOutbox *ob)
{
    PfOutBatch *b = g_queue_peek_head(&ob->held);

    if (b == NULL ||
        (ob->n_sent > 0 && ob->n_sent + b->pending->len > PF_OUTBOX_WINDOW_ITEMS)) {
        return NULL;
    }
    g_queue_pop_head(&ob->held);
    ob->n_held -= b->pending->len;
    b->sent = TRUE;
    b->seq = ++ob->next_seq;
    if (ob->n_sent == 0) {
        /* The agent's time to answer runs from now. */
        ob->last_answer = g_get_monotonic_time();
    }
    g_queue_push_tail(&ob->sent, b);
    ob->n_sent += b->pending->len;
    return b;
}

gboolean
pf_outbox_answers(PfOutbox *ob, guint32 seq, guint32 n)
{
    const PfOutBatch *b = g_queue_peek_head(&ob->sent);

    return b != NULL && b->seq == seq && b->pending->len == n;
}

PfOutBatch *
pf_outbox_pop_answered(PfOutbox *ob)
{
    PfOutBatch *b = g_queue_pop_head(&ob->sent);

    g_return_val_if_fail(b != NULL, NULL);
    ob->n_sent -= b->pending->len;
    ob->answered_seq = b->seq;
    ob->last_answer = g_get_monotonic_time();
    return b;
}

gsize
pf_outbox_n_queued(PfOutbox *ob)
{
    return ob->queue_items->len;
}

gint64
pf_outbox_queued_usec(PfOutbox *ob)
{
    return ob->queue_items->len > 0 ? g_get_monotonic_time() - ob->queue_since : 0;
}

gsize
pf_outbox_in_flight(PfOutbox *ob)
{
    return ob->n_sent + ob->n_held + ob->queue_items->len;
}

gsize
pf_outbox_n_batched(PfOutbox *ob)
{
    return ob->n_sent + ob->n_held;
}

gsize
pf_outbox_n_sent(PfOutbox *ob)
{
    return ob->n_sent;
}

gsize
pf_outbox_room(PfOutbox *ob)
{
    gsize outstanding = pf_outbox_in_flight(ob);

    return outstanding < 2 * PF_OUTBOX_WINDOW_ITEMS ? 2 * PF_OUTBOX_WINDOW_ITEMS - outstanding
                                                    : 0;
}

gint64
pf_outbox_waiting_usec(PfOutbox *ob)
{
    return ob->n_sent > 0 ? g_get_monotonic_time() - ob->last_answer : 0;
}

guint32
pf_outbox_sent_seq(PfOutbox *ob)
{
    return ob->next_seq;
}

guint32
pf_outbox_answered_seq(PfOutbox *ob)
{
    return ob->answered_seq;
}

/* Drops the requests of a list not sent yet that func settles; returns
 * how many are left. */
static guint
withdraw_unsent(GArray *pending, GArray *items, gboolean (*func)(PfPending *pd, gpointer user),
                gpointer user)
{
    guint kept = 0;

    for (guint i = 0; i < pending->len; i++) {
        if (!func(&g_array_index(pending, PfPending, i), user)) {
            g_array_index(pending, PfPending, kept) = g_array_index(pending, PfPending, i);
            g_array_index(items, PfWireItem, kept) = g_array_index(items, PfWireItem, i);
            kept++;
        }
    }
    g_array_set_size(pending, kept);
    g_array_set_size(items, kept);
    return kept;
}

void
pf_outbox_withdraw(PfOutbox *ob, gboolean (*func)(PfPending *pd, gpointer user), gpointer user)
{
    for (GList *e = ob->sent.head; e != NULL; e = e->next) {
        PfOutBatch *b = e->data;

        for (guint i = 0; i < b->pending->len; i++) {
            func(&g_array_index(b->pending, PfPending, i), user);
        }
    }
    for (GList *e = ob->held.head, *next; e != NULL; e = next) {
        PfOutBatch *b = e->data;
        guint before = b->pending->len;

        next = e->next;
        ob->n_held -= before - withdraw_unsent(b->pending, b->items, func, user);
        if (b->pending->len == 0) {
            g_queue_delete_link(&ob->held, e);
            pf_out_batch_free(b);
        }
    }
    withdraw_unsent(ob->queue_pending, ob->queue_items, func, user);
}

void
pf_outbox_abandon(PfOutbox *ob, void (*func)(const PfPending *pd, gboolean sent, gpointer user),
                  gpointer user)
{
    GQueue all = G_QUEUE_INIT;
    PfOutBatch *b;

    /* Everything out first: what func lets go of may be looked for in
     * the outbox meanwhile (a chunk freed is dropped only when no request
     * names it). */
    form_batch(ob);
    while ((b = g_queue_pop_head(&ob->sent)) != NULL ||
           (b = g_queue_pop_head(&ob->held)) != NULL) {
        g_queue_push_tail(&all, b);
    }
    ob->n_sent = 0;
    ob->n_held = 0;
    while ((b = g_queue_pop_head(&all)) != NULL) {
        for (guint i = 0; i < b->pending->len; i++) {
            func(&g_array_index(b->pending, PfPending, i), b->sent, user);
        }
        pf_out_batch_free(b);
    }
}

static void
foreach_in(const PfOutBatch *b, gboolean sent,
           void (*func)(const PfWireItem *item, const PfPending *pd, gboolean sent,
                        gpointer user),
           gpointer user)
{
    for (guint i = 0; i < b->pending->len; i++) {
        func(&g_array_index(b->items, PfWireItem, i), &g_array_index(b->pending, PfPending, i),
             sent, user);
    }
}

void
pf_outbox_foreach(PfOutbox *ob,
                  void (*func)(const PfWireItem *item, const PfPending *pd, gboolean sent,
                               gpointer user),
                  gpointer user)
{
    PfOutBatch open = { FALSE, 0, ob->queue_items, ob->queue_pending };

    for (GList *e = ob->sent.head; e != NULL; e = e->next) {
        foreach_in(e->data, TRUE, func, user);
    }
    for (GList *e = ob->held.head; e != NULL; e = e->next) {
        foreach_in(e->data, FALSE, func, user);
    }
    foreach_in(&open, FALSE, func, user);
}
