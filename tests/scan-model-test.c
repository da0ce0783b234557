/*
 * scan-model-test.c - the scanner's pool accounting under a model of its
 * agents: after every step, each pool slot's references are exactly those
 * pagefoldd can account for, and once every VM is gone the pool is empty.
 *
 * The real scanner, linked as pagefoldd links it, played at the boundary
 * the agent link plays it at: the model's agents drain each VM's outbox
 * (outbox.h) when its drain callback says there is something to send, take
 * the chunks and drops the scanner's listener call tells of, and answer
 * through pf_scanner_answer().  It reads the scanner's state through
 * scan-core.h (white-box: the stable nodes, the leftovers, the
 * waiting joins) and plays the copy on write that pagefoldd finds in
 * pagemap (cow_found()); nothing of the scanner is replaced.  Its agents
 * act as the real one does, on the guest's memfd: they compare the page
 * with its slot, punch a merged page out of the memfd, write it back when
 * unmerged or when they step back to advise mode; and they answer as each
 * test says, honestly, with the errors a real agent meets, or lying, or go
 * (hang up, or their process exits) with requests unanswered.  Everything
 * else is real: the outboxes, the pool's sealed memfd chunks, the trees,
 * the scanner, and the VMs, agents' VMs of child processes that hold
 * memfd guest RAM (guestmem.h).  Pages merged here are not remapped, so a
 * guest's write lands in its memfd, and the model tells the scanner of the
 * copy on write itself.
 *
 * What is accounted for (pool.h, ledger.c): a slot's references are its
 * stable node's own, one per member page, one per request in flight that
 * names it (the slot of a merge or unmerge, the slot of the node a move
 * leaves), and one per reference a leftover holds (a VM detached while its
 * process lives, which may still map the slot).
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "guestmem.h"
#include "jobs.h"
#include "scan-helpers.h"
#include "scan-core.h"

/* ---- the model: guests, and what their agents do ---- */

/* A batch of requests as the agent received it. */
typedef struct {
    guint32 seq;
    GArray *items;   /* PfWireItem */
    GArray *pending; /* PfPending, one per item: the outbox's own, which
                      * the scanner settles in place */
} ModelBatch;

/* One RAM region of a guest: a memfd its agent announced. */
typedef struct {
    PfGuest *guest;
    guint8 *content;  /* what the guest sees in each page */
    gboolean *merged; /* pages its agent punched out of the memfd */
    gboolean *kept;   /* ... of them, those merged under an earlier agent
                       * of an attach before the last: the pagefoldd that
                       * let it go keeps their slots, uncounted (DESIGN
                       * 2.9), until they are merged, unmerged or written */
    gboolean gone;    /* it left the VM (GONE): the agent does nothing with
                       * it any more, and refuses items that name it */
} ModelRegion;

typedef struct _ModelAgent ModelAgent;

typedef struct {
    int pid;          /* the process holding region 0; 0 once it exited */
    PfVm *vm;         /* NULL while not attached */
    ModelAgent *agent; /* its agent, while attached */
    GPtrArray *regions; /* ModelRegion*, by the agent's index: [0] the RAM its
                         * process holds, then RAM plugged in since */
    GPtrArray *old;   /* ModelRegion* plugged in under an earlier agent */
} ModelVm;

/* A VM's agent: what it received and has not answered, the chunks it
 * holds. */
struct _ModelAgent {
    PfVm *vm;
    ModelVm *mv;
    GQueue in_flight;      /* ModelBatch*, oldest first */
    gsize n_in_flight;
    GHashTable *held;      /* ids of the pool chunks the agent holds */
    guint answer_source;   /* the agent answers from the main loop */
};

/* May change an answer before the agent acts on it. */
typedef void (*ModelAnswerFunc)(ModelAgent *l, const PfWireItem *item, const PfPending *pd,
                                PfResultStatus *status, int *err);
/* What comes before an agent's answers to a batch: news (a step back),
 * or its end (it hung up, or its process exited).  FALSE when the agent
 * went, with its VM. */
typedef gboolean (*ModelBatchFunc)(ModelAgent *l, const ModelBatch *b);

typedef struct {
    PfScanner *s;
    GPtrArray *vms;          /* ModelVm*, every one of the test's */
    ModelAnswerFunc answer;  /* NULL: the honest agent's answer */
    ModelBatchFunc before_answer;
    gboolean lying;          /* the agents do nothing they answer */
    gboolean step_back;      /* fuzz: agents step back now and then */
    GRand *rand;
    PfVm *detaching;         /* the VM the model is detaching */
    PfVm *chosen;            /* the VM a case singles out */
    gboolean chosen_exits;   /* ... whose process exits as its agent goes */
    gboolean chosen_on_move; /* ... at a batch that moves its pages */
    guint stepped_back;
    guint moves;             /* requests that move a merged page */
    guint evacuating;        /* fuzz: scans that left a chunk to empty */
    guint joined, gone;      /* fuzz: regions plugged in, and gone */
    guint n_made;
    char context[64];        /* where we are, for failure messages */
} Model;

/* One model at a time: the scanner's callbacks find it here. */
static Model *model;

static void
batch_free(ModelBatch *b)
{
    g_array_unref(b->items);
    g_array_unref(b->pending);
    g_free(b);
}

static ModelVm *
model_vm_of(PfVm *vm)
{
    for (guint i = 0; i < model->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(model->vms, i);

        if (mv->vm == vm) {
            return mv;
        }
    }
    return NULL;
}

static ModelRegion *
model_region(ModelVm *mv, guint index)
{
    g_assert_cmpuint(index, <, mv->regions->len);
    return g_ptr_array_index(mv->regions, index);
}

/* The agent folds the page back into its memfd: the guest's content. */
static void
fold_back(ModelRegion *mr, gsize idx)
{
    if (mr->merged[idx]) {
        memcpy(mr->guest->mem + idx * PF_PAGE_SIZE, mr->content + idx * PF_PAGE_SIZE,
               PF_PAGE_SIZE);
        mr->merged[idx] = FALSE;
    }
    mr->kept[idx] = FALSE;
}

/* The agent's own compare, against the slot the item names in the chunk
 * it was sent: what makes a page merged (invariant 3, docs/DESIGN.md). */
static gboolean
agent_compare(ModelAgent *l, const PfWireItem *item)
{
    const PfPoolChunk *c = pf_pool_chunk(pf_scanner_get_pool(model->s), item->chunk);

    g_assert_nonnull(c);
    g_assert_cmpuint(item->slot, <, c->n_slots);
    return memcmp(model_region(l->mv, item->region)->content + item->page * PF_PAGE_SIZE,
                  c->map + (gsize)item->slot * PF_PAGE_SIZE, PF_PAGE_SIZE) == 0;
}

/* The agent's answer to one item; what it does is left to the batch. */
static void
agent_answer(ModelAgent *l, const PfWireItem *item, const PfPending *pd,
             PfResultStatus *status, int *err)
{
    ModelRegion *mr = model_region(l->mv, item->region);

    *status = PF_RESULT_DONE;
    *err = 0;
    g_assert_cmpuint(item->page, <, mr->guest->n_pages);
    if (mr->gone) {
        /* Sent before pagefoldd read GONE: the agent forgot the region. */
        *status = PF_RESULT_ERROR;
        *err = ENOENT;
    } else if (item->kind == PF_ITEM_COLLAPSE) {
        return;
    } else if (!pf_vm_merges(l->vm)) {
        /* Stepped back: its pages are all in the memfd already. */
        if (item->kind != PF_ITEM_UNMERGE) {
            *status = PF_RESULT_ERROR;
            *err = EPERM;
        }
    } else if (item->kind != PF_ITEM_UNMERGE && !agent_compare(l, item)) {
        *status = PF_RESULT_CHANGED;
    }
    if (model->answer != NULL) {
        model->answer(l, item, pd, status, err);
    }
}

/* A descriptor as region.c's tables keep it: plus one. */
static void
close_fd_value(gpointer p)
{
    close(GPOINTER_TO_INT(p) - 1);
}

/* Pages [first, end) leave the memfd: mapped from the pool now. */
static void
punch(ModelRegion *mr, gsize first, gsize end)
{
    if (first < end) {
        g_assert_cmpint(fallocate(mr->guest->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                  (off_t)(first * PF_PAGE_SIZE),
                                  (off_t)((end - first) * PF_PAGE_SIZE)), ==, 0);
    }
}

/* The agent deals with a whole batch, then sends one RESULT for it: the
 * pages it merged are punched out of the memfd (a run at a time), those
 * it unmerged written back. */
static void
agent_does(ModelAgent *l, const ModelBatch *b, const PfWireResult *res)
{
    ModelRegion *run = NULL;
    gsize first = 0, end = 0;

    for (guint i = 0; i < b->items->len && !model->lying; i++) {
        const PfWireItem *item = &g_array_index(b->items, PfWireItem, i);
        ModelRegion *mr = model_region(l->mv, item->region);

        /* A gone region is not the agent's any more, whatever it says. */
        if (res[i].status != PF_RESULT_DONE || item->kind == PF_ITEM_COLLAPSE || mr->gone) {
            continue;
        }
        if (item->kind == PF_ITEM_UNMERGE) {
            fold_back(mr, item->page);
            continue;
        }
        if (item->page != end || mr != run) {
            if (run != NULL) {
                punch(run, first, end);
            }
            run = mr;
            first = item->page;
        }
        end = item->page + 1;
        mr->merged[item->page] = TRUE;
        mr->kept[item->page] = FALSE;
    }
    if (run != NULL) {
        punch(run, first, end);
    }
}

/* Whatever an answer asked for went out as it ended, to this VM's agent
 * or another's (a node that moved): nothing waits for a scan to send it,
 * where a scan-now job between passes would wait for it for good. */
static void
assert_nothing_queued(void)
{
    for (guint i = 0; i < model->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(model->vms, i);

        if (mv->vm != NULL) {
            g_assert_cmpuint(pf_outbox_in_flight(mv->vm->outbox), ==,
                             pf_outbox_n_batched(mv->vm->outbox));
        }
    }
}

/* The agent answers up to max of the batches it was sent, in order. */
static void
answer_batches(ModelAgent *l, guint max)
{
    PfVm *vm = l->vm;

    for (guint n = 0; n < max && !g_queue_is_empty(&l->in_flight); n++) {
        ModelBatch *b = g_queue_peek_head(&l->in_flight);
        g_autofree PfWireResult *res = NULL;

        if (model->before_answer != NULL && !model->before_answer(l, b)) {
            return;
        }
        res = g_new0(PfWireResult, b->items->len);
        for (guint i = 0; i < b->items->len; i++) {
            PfResultStatus status;
            int err;

            agent_answer(l, &g_array_index(b->items, PfWireItem, i),
                         &g_array_index(b->pending, PfPending, i), &status, &err);
            res[i].status = (guint8)status;
            res[i].err = err;
        }
        agent_does(l, b, res);
        g_queue_pop_head(&l->in_flight);
        l->n_in_flight -= b->items->len;
        /* As the real link: the answer must answer the oldest batch. */
        g_assert_true(pf_outbox_answers(vm->outbox, b->seq, b->items->len));
        pf_scanner_answer(model->s, vm, res, b->items->len);
        batch_free(b);
        assert_nothing_queued();
    }
}

/* Whether any request not answered names the chunk (and holds a slot of
 * it: not one settled when its region went, which the agent refuses if
 * sent, and which is never sent if not). */
typedef struct {
    guint32 chunk;
    gboolean named;
} NamesChunk;

static void
names_chunk_cb(const PfWireItem *it, const PfPending *pd, gboolean sent, gpointer user)
{
    NamesChunk *nc = user;

    if (!pd->settled && (it->kind == PF_ITEM_MERGE || it->kind == PF_ITEM_ZERO) &&
        it->chunk == nc->chunk) {
        nc->named = TRUE;
    }
}

static gboolean
outbox_names_chunk(PfOutbox *ob, guint32 chunk)
{
    NamesChunk nc = { chunk, FALSE };

    pf_outbox_foreach(ob, names_chunk_cb, &nc);
    return nc.named;
}

/* What the real agent does on its thread while pagefoldd's main loop
 * runs: answers, as pagefoldd waits for them (a scan-now or unmerge job). */
static gboolean
answer_idle(gpointer user)
{
    ModelAgent *l = user;

    l->answer_source = 0;
    answer_batches(l, G_MAXUINT); /* may end the agent */
    return G_SOURCE_REMOVE;
}

/* The agent receives what the outbox lets go: as the real link sends it. */
static void
agent_drain(PfOutbox *ob, gpointer user)
{
    ModelAgent *l = user;
    const PfOutBatch *ob_batch;

    while ((ob_batch = pf_outbox_take(ob)) != NULL) {
        ModelBatch *b = g_new0(ModelBatch, 1);

        b->seq = ob_batch->seq;
        b->items = g_array_ref(ob_batch->items);
        b->pending = g_array_ref(ob_batch->pending);
        for (guint i = 0; i < b->items->len; i++) {
            const PfWireItem *item = &g_array_index(b->items, PfWireItem, i);

            /* Never a request for a region that is not the VM's any more. */
            g_assert_false(model_region(l->mv, item->region)->gone);
            g_assert_true(pf_region_live(g_ptr_array_index(l->vm->regions, item->region)));
            /* An agent is sent a chunk before any request that names it. */
            if (item->kind == PF_ITEM_MERGE || item->kind == PF_ITEM_ZERO) {
                g_assert_true(g_hash_table_contains(l->held, GUINT_TO_POINTER(item->chunk)));
            }
            model->moves += g_array_index(b->pending, PfPending, i).from != 0;
        }
        g_queue_push_tail(&l->in_flight, b);
        l->n_in_flight += b->items->len;
    }
    if (l->answer_source == 0 && l->n_in_flight > 0) {
        /* Below the scanner's own steps: a pass decides all it can before
         * the agents answer, as the cases here expect (the real agents
         * answer as fast as they do; the cases that answer mid-pass say
         * so with before_answer). */
        l->answer_source = g_idle_add_full(G_PRIORITY_LOW, answer_idle, l, NULL);
    }
}

static ModelAgent *
agent_new(PfVm *vm, ModelVm *mv)
{
    ModelAgent *l = g_new0(ModelAgent, 1);

    l->vm = vm;
    l->mv = mv;
    g_queue_init(&l->in_flight);
    l->held = g_hash_table_new(NULL, NULL);
    pf_outbox_set_drain(vm->outbox, agent_drain, l);
    return l;
}

static void
agent_free(ModelAgent *l)
{
    g_queue_clear_full(&l->in_flight, (GDestroyNotify)batch_free);
    g_clear_handle_id(&l->answer_source, g_source_remove);
    g_hash_table_unref(l->held);
    g_free(l);
}

/* Chunks, as the scanner tells its listeners: only to the chunk's own VMs
 * (pool.h), once until dropped; and dropped only when no request holds a
 * slot of it. */
static void
agent_chunk(PfScanner *s, PfVm *vm, const PfPoolChunk *chunk, gboolean drop, gpointer user)
{
    ModelVm *mv = model_vm_of(vm);
    ModelAgent *l = mv != NULL ? mv->agent : NULL;
    gboolean for_it = chunk->n_vms == 0;

    g_assert_nonnull(l);
    if (drop) {
        g_assert_true(g_hash_table_remove(l->held, GUINT_TO_POINTER(chunk->id)));
        g_assert_false(outbox_names_chunk(vm->outbox, chunk->id));
        return;
    }
    for (guint i = 0; i < chunk->n_vms; i++) {
        for_it |= chunk->vms[i] == vm->scan->serial;
    }
    g_assert_true(for_it);
    g_assert_false(g_hash_table_contains(l->held, GUINT_TO_POINTER(chunk->id)));
    g_hash_table_add(l->held, GUINT_TO_POINTER(chunk->id));
}

/* ---- the accounting ---- */

static void
want_ref(GHashTable *want, guint32 slot)
{
    gpointer n;

    if (slot == PF_POOL_SLOT_NONE || pf_pool_is_zero_slot(slot)) {
        return; /* zero slots are not counted */
    }
    n = g_hash_table_lookup(want, GUINT_TO_POINTER(slot));
    g_hash_table_insert(want, GUINT_TO_POINTER(slot), GUINT_TO_POINTER(GPOINTER_TO_UINT(n) + 1));
}

/* A node that a request or leftover names holds that slot: its reference
 * keeps the node, so that the node is there to put it back to. */
static void
assert_node_holds(PfScanner *s, guint32 node, guint32 slot)
{
    const PfStableNode *n = node_at(s, node);

    g_assert_true(n->live);
    g_assert_cmpuint(n->slot, ==, slot);
}

typedef struct {
    ModelVm *mv;
    GPtrArray *all; /* const PfPending* */
} Requests;

static void
collect_request(const PfWireItem *item, const PfPending *pd, gboolean sent, gpointer user)
{
    Requests *rq = user;

    /* A request for a region that went holds nothing since, and is sent
     * only if it was before the region went. */
    if (model_region(rq->mv, item->region)->gone) {
        g_assert_true(sent);
        g_assert_true(pd->settled);
    }
    g_ptr_array_add(rq->all, (gpointer)pd);
}

/* Each request to vm's agent not answered yet: the references it holds;
 * its page is the VM's, PENDING, and no other request names it.  The
 * agent has received exactly what the outbox says was sent. */
static void
account_requests(PfScanner *s, PfVm *vm, GHashTable *want)
{
    ModelVm *mv = model_vm_of(vm);
    g_autoptr(GHashTable) pages = g_hash_table_new(NULL, NULL);
    g_autoptr(GPtrArray) all = g_ptr_array_new();
    Requests rq = { mv, all };

    g_assert_cmpuint(mv->agent->n_in_flight, ==, pf_outbox_n_sent(vm->outbox));
    pf_outbox_foreach(vm->outbox, collect_request, &rq);
    for (guint i = 0; i < all->len; i++) {
        const PfPending *pd = g_ptr_array_index(all, i);
        PfRegion *r;

        if (pd->kind == PF_ITEM_COLLAPSE || pd->settled) {
            continue;
        }
        if (pd->kind == PF_ITEM_MERGE || pd->kind == PF_ITEM_UNMERGE) {
            want_ref(want, pd->slot);
            if (pd->node != 0) {
                assert_node_holds(s, pd->node, pd->slot);
            }
        }
        if (pd->from != 0) {
            want_ref(want, node_at(s, pd->from)->slot);
            g_assert_true(node_at(s, pd->from)->live);
        }
        r = region_of(s, pd->page);
        g_assert_true(r->vm == vm);
        g_assert_cmpuint(pf_region_page_state(r, pd->page - r->base), ==, PF_PAGE_PENDING);
        g_assert_true(g_hash_table_add(pages, GUINT_TO_POINTER(pd->page)));
    }
    g_assert_cmpuint(vm->scan->count[PF_PAGE_PENDING], ==, g_hash_table_size(pages));
}

/* Whether the stable tree's lookups find node id. */
static gboolean
node_listed(PfScanner *s, guint32 id)
{
    PfTableIter it;
    guint32 v;

    pf_table_iter_init(&it, &s->stable.table, node_at(s, id)->checksum);
    while ((v = pf_table_iter_next(&it)) != 0) {
        if (v == id) {
            return TRUE;
        }
    }
    return FALSE;
}

/*
 * Every reference on every slot of the pool is accounted for, no more and
 * no fewer: one too many is a slot (and its chunk) that never comes back,
 * one too few a slot freed and reused while a guest page still maps it.
 */
/* Every page the agent keeps merged is one pagefoldd counts merged, or
 * has a request in flight for.  (Not the other way: a page written while
 * its unmerge was in flight, which was refused, is counted merged until
 * the next pass finds its copy on write again, which the model does not
 * play.) */
static void
assert_merged_counted(ModelVm *mv, guint k, const PfRegion *r, const char *when)
{
    const ModelRegion *mr = model_region(mv, k);

    for (gsize i = 0; i < r->n_pages; i++) {
        PfPageState st = pf_region_page_state(r, i);

        if (!mr->merged[i] || mr->kept[i] || st == PF_PAGE_SHARED || st == PF_PAGE_ZERO ||
            st == PF_PAGE_PENDING) {
            continue;
        }
        g_test_message("%s, %s: VM %s region %u page %zu: merged by its agent, state %u in "
                       "pagefoldd", model->context, when, mv->vm->name, k, i, st);
        g_assert_not_reached();
    }
}

static void
check_model(Model *m, const char *when)
{
    PfScanner *s = m->s;
    g_autoptr(GHashTable) want = g_hash_table_new(NULL, NULL);
    /* What each VM is told it holds of the nodes (tree.h), walked. */
    g_autoptr(GHashTable) parts = g_hash_table_new_full(NULL, NULL, NULL, g_free);
    GHashTableIter it;
    gpointer key, value;
    gsize shared = 0, n_chunks, seen = 0, in_use = 0, nodes_in_use = 0;
    guint bad = 0;

    for (guint32 id = 1; id < s->stable.nodes->len; id++) {
        const PfStableNode *n = node_at(s, id);

        if (!n->live) {
            continue;
        }
        /* Lookups find exactly the nodes that can take one more sharer:
         * the full ones of a content cost them nothing. */
        g_assert_cmpint(node_listed(s, id), ==,
                        n->next == 0 && ledger_sharers(s, n) < s->setup.knobs.max_page_sharing);
        want_ref(want, n->slot);
        nodes_in_use += n->n_members > 0;
        g_assert_cmpint(g_hash_table_contains(s->stable.untracked, GUINT_TO_POINTER(id)), ==,
                        n->n_members > PF_SHARE_TRACKED);
        for (guint32 k = 0; k < n->n_members; k++) {
            PfRegion *r = region_of(s, n->members[k]);
            const PfPage *p = pf_region_page(r, n->members[k] - r->base);
            guint64 *part = g_hash_table_lookup(parts, r->vm);

            if (part == NULL) {
                part = g_new0(guint64, 1);
                g_hash_table_insert(parts, r->vm, part);
            }
            *part += n->n_members <= PF_SHARE_TRACKED ? PF_SHARE_ONE / n->n_members : 0;

            g_assert_cmpuint(p->state, ==, PF_PAGE_SHARED);
            g_assert_cmpuint(p->node, ==, id);
            if (n->slot == PF_POOL_SLOT_NONE) {
                continue;
            }
            /* Pool sharing is a merging VM's, whose agent holds the chunk
             * the page maps. */
            g_assert_true(pf_vm_merges(r->vm));
            g_assert_true(g_hash_table_contains(model_vm_of(r->vm)->agent->held,
                                                GUINT_TO_POINTER((n->slot - 1) /
                                                                 PF_POOL_CHUNK_SLOTS)));
            want_ref(want, n->slot);
        }
    }
    for (guint i = 0; i < s->vms.list->len; i++) {
        PfVm *vm = g_ptr_array_index(s->vms.list, i);
        ModelVm *mv = model_vm_of(vm);
        gsize counted = 0;

        /* Every page of the VM's live regions is in one state, and a
         * region that went is a placeholder that holds none. */
        for (guint k = 0; k < PF_PAGE_N_STATES; k++) {
            counted += vm->scan->count[k];
        }
        g_assert_cmpuint(counted, ==, pf_vm_n_pages(vm));
        {
            const guint64 *part = g_hash_table_lookup(parts, vm);

            g_assert_cmpuint(vm->scan->share, ==, part != NULL ? *part : 0);
        }
        g_assert_cmpuint(vm->regions->len, ==, mv->regions->len);
        for (guint k = 0; k < vm->regions->len; k++) {
            const PfRegion *r = g_ptr_array_index(vm->regions, k);

            g_assert_cmpint(pf_region_live(r), ==, !model_region(mv, k)->gone);
            g_assert_true(pf_region_live(r) || (r->n_pages == 0 && r->map == NULL &&
                                                r->fd < 0 && r->extents == NULL));
            if (pf_region_live(r) && !m->lying) {
                assert_merged_counted(mv, k, r, when);
            }
        }
        shared += vm->scan->count[PF_PAGE_SHARED];
        if (vm->kind == PF_VM_AGENT) {
            account_requests(s, vm, want);
        } else {
            g_assert_cmpuint(vm->scan->count[PF_PAGE_PENDING], ==, 0);
        }
    }
    g_assert_cmpuint(shared, ==, s->stable.n_members);
    g_assert_cmpuint(nodes_in_use, ==, s->stable.n_in_use);
    for (guint i = 0; i < s->vms.leftovers->len; i++) {
        Leftover *lo = g_ptr_array_index(s->vms.leftovers, i);

        for (guint k = 0; k < lo->refs->len; k++) {
            const HeldRef *h = &g_array_index(lo->refs, HeldRef, k);

            want_ref(want, h->slot);
            assert_node_holds(s, h->node, h->slot);
        }
    }
    if (s->pool == NULL) {
        g_assert_cmpuint(g_hash_table_size(want), ==, 0);
        return;
    }

    /* No reference is accounted to a slot of a chunk that is gone... */
    g_hash_table_iter_init(&it, want);
    while (g_hash_table_iter_next(&it, &key, NULL)) {
        g_assert_nonnull(pf_pool_chunk(s->pool, (GPOINTER_TO_UINT(key) - 1) /
                                                    PF_POOL_CHUNK_SLOTS));
    }
    /* ... and every slot of those there has what is accounted for.
     * Chunk ids are reused first: they stay dense. */
    n_chunks = pf_pool_n_chunks(s->pool);
    for (guint32 c = 0; seen < n_chunks && c < PF_PROTO_MAX_CHUNKS; c++) {
        if (pf_pool_chunk(s->pool, c) == NULL) {
            continue;
        }
        seen++;
        if (c == 0) {
            continue; /* the zero chunk */
        }
        for (guint32 k = 0; k < PF_POOL_CHUNK_SLOTS; k++) {
            guint32 slot = c * PF_POOL_CHUNK_SLOTS + k + 1;
            guint32 refs = pf_pool_refs(s->pool, slot);

            value = g_hash_table_lookup(want, GUINT_TO_POINTER(slot));
            if (refs != GPOINTER_TO_UINT(value) && bad++ < 8) {
                g_test_message("%s, %s: pool slot %u has %u reference(s), %u accounted for",
                               m->context, when, slot, refs, GPOINTER_TO_UINT(value));
            }
            in_use += refs > 0;
        }
    }
    g_assert_cmpuint(seen, ==, n_chunks);
    if (bad > 0) {
        g_test_message("%s, %s: %u slot(s) with references not accounted for", m->context,
                       when, bad);
    }
    g_assert_cmpuint(bad, ==, 0);
    g_assert_cmpuint(in_use, ==, pf_pool_slots_in_use(s->pool));
}

/* ---- setting up, ending ---- */

/* A VM goes when the model ends it or its process exits, never on
 * pagefoldd's own initiative here (a chunk it was told to drop, RAM that
 * faulted): that would be a false alarm. */
static void
vm_gone(PfScanner *s, PfVm *vm, const char *why, gpointer user)
{
    ModelVm *mv = model_vm_of(vm);

    g_assert_nonnull(mv);
    if (vm != model->detaching && mv->pid != 0) {
        g_test_message("%s: VM %s detached: %s", model->context, vm->name, why);
        g_assert_not_reached();
    }
    /* Its agent goes with it (the scanner has taken back what its outbox
     * held, or does so as this returns). */
    g_clear_pointer(&mv->agent, agent_free);
    mv->vm = NULL;
}

static const PfScanEvents model_events = {
    .vm_gone = vm_gone,
    .chunk = agent_chunk,
};

static void
model_detach(Model *m, ModelVm *mv, const char *why)
{
    m->detaching = mv->vm;
    pf_scanner_detach(m->s, mv->vm, why);
    m->detaching = NULL;
}

/* pagefoldd's messages are many here, and none is news: shown with
 * --verbose. */
static void
quiet(const char *domain, GLogLevelFlags level, const char *message, gpointer user)
{
    if (g_test_verbose()) {
        g_log_default_handler(domain, level, message, user);
    }
}

static Model *
model_new(void)
{
    Model *m = g_new0(Model, 1);

    g_assert_null(model);
    model = m;
    m->s = pf_scanner_new(NULL);
    m->vms = g_ptr_array_new();
    /* Every page is visited at every pass: the tests count passes. */
    pf_scanner_get_knobs(m->s)->smart_scan = FALSE;
    pf_scanner_add_listener(m->s, &model_events, m, NULL);
    g_strlcpy(m->context, g_test_get_path(), sizeof(m->context));
    return m;
}

/* A region as its agent announces it (link.c has checked it; here it is
 * this process's own mapping of the memfd, at the address the holder of
 * region 0, forked from it, maps it too). */
static PfRegion *
announced_region(ModelRegion *mr)
{
    g_autoptr(GError) error = NULL;
    int fd = fcntl(mr->guest->fd, F_DUPFD_CLOEXEC, 3);
    PfRegion *r = pf_region_new("memory-backend-memfd", fd, (guint64)(guintptr)mr->guest->mem,
                                0, mr->guest->n_pages * PF_PAGE_SIZE, &error);

    g_assert_no_error(error);
    return r;
}

/* A VM (again) with its agent, in merge mode: as link.c makes it at
 * READY, its process pinned by a pidfd and its /proc directory; pooled:
 * what its region check found its process maps from pool chunks (a
 * pagefoldd started again), or NULL. */
static void
model_attach_pooled(Model *m, ModelVm *mv, PfPoolMapped *pooled)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *name = g_strdup_printf("vm%u", m->n_made++);
    g_autofree char *proc = g_strdup_printf("/proc/%d", mv->pid);
    g_autoptr(GPtrArray) regions = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    static const guint8 no_uuid[16];
    int pidfd = (int)syscall(SYS_pidfd_open, mv->pid, 0);
    int proc_dir = open(proc, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

    g_assert_cmpint(pidfd, >=, 0);
    g_assert_cmpint(proc_dir, >=, 0);
    /* Its agent announces the RAM its process holds (the model's region
     * 0); RAM plugged in under an earlier agent is of no VM any more. */
    while (mv->regions->len > 1) {
        g_ptr_array_add(mv->old, g_ptr_array_steal_index(mv->regions, mv->regions->len - 1));
    }
    model_region(mv, 0)->gone = FALSE;
    for (gsize i = 0; i < model_region(mv, 0)->guest->n_pages && pooled == NULL; i++) {
        model_region(mv, 0)->kept[i] = model_region(mv, 0)->merged[i];
    }
    g_ptr_array_add(regions, announced_region(model_region(mv, 0)));
    ((PfRegion *)g_ptr_array_index(regions, 0))->pooled = pooled;
    mv->vm = pf_vm_new_from_agent(mv->pid, pidfd, proc_dir, name, no_uuid,
                                  g_steal_pointer(&regions),
                                  PF_MODE_MERGE, NULL, &error);
    g_assert_no_error(error);
    close(pidfd);
    close(proc_dir);
    g_assert_cmpuint(mv->vm->regions->len, ==, 1);
    mv->agent = agent_new(mv->vm, mv);
    pf_scanner_add_vm(m->s, mv->vm);
    if (pooled != NULL) {
        pf_scanner_adopt(m->s, mv->vm);
    }
}

static void
model_attach(Model *m, ModelVm *mv)
{
    model_attach_pooled(m, mv, NULL);
}

/* The holder of a guest's RAM is forked from this process, where the
 * pool's chunks are mapped writable and shared: it must not inherit them,
 * or it would be seen to hold chunks it was told to drop (vm.c's
 * pf_vm_held_pool()).  (QEMU is never a child of pagefoldd.) */
static void
keep_pool_from_children(Model *m)
{
    gsize n_chunks, seen = 0;

    if (m->s->pool == NULL) {
        return;
    }
    n_chunks = pf_pool_n_chunks(m->s->pool);
    for (guint32 c = 0; seen < n_chunks && c < PF_PROTO_MAX_CHUNKS; c++) {
        const PfPoolChunk *chunk = pf_pool_chunk(m->s->pool, c);

        if (chunk != NULL) {
            g_assert_cmpint(madvise(chunk->map, (gsize)chunk->n_slots * PF_PAGE_SIZE,
                                    MADV_DONTFORK), ==, 0);
            seen++;
        }
    }
}

static ModelRegion *
model_region_new(const PfLayout *layout, guint32 seed)
{
    ModelRegion *mr = g_new0(ModelRegion, 1);
    gsize written;

    mr->guest = pf_guest_new("memory-backend-memfd", layout, seed);
    /* Reading the layout's holes through the mapping would allocate them. */
    written = mr->guest->n_pages - layout->holes;
    mr->content = g_malloc0(mr->guest->n_pages * PF_PAGE_SIZE);
    memcpy(mr->content, mr->guest->mem, written * PF_PAGE_SIZE);
    mr->merged = g_new0(gboolean, mr->guest->n_pages);
    mr->kept = g_new0(gboolean, mr->guest->n_pages);
    return mr;
}

static void
model_region_free(gpointer data)
{
    ModelRegion *mr = data;

    pf_guest_free(mr->guest);
    g_free(mr->content);
    g_free(mr->merged);
    g_free(mr->kept);
    g_free(mr);
}

static ModelVm *
model_add_vm(Model *m, const PfLayout *layout, guint32 seed)
{
    ModelVm *mv = g_new0(ModelVm, 1);

    mv->regions = g_ptr_array_new_with_free_func(model_region_free);
    mv->old = g_ptr_array_new_with_free_func(model_region_free);
    g_ptr_array_add(mv->regions, model_region_new(layout, seed));
    keep_pool_from_children(m);
    mv->pid = pf_guest_hold(model_region(mv, 0)->guest);
    g_ptr_array_add(m->vms, mv);
    model_attach(m, mv);
    return mv;
}

/* RAM plugged into the VM: its agent announces it with the next index,
 * after READY; link.c has checked it (here it is this process's own
 * mapping: the scanner reads the memfd, not the VM's process). */
static guint
model_region_join(Model *m, ModelVm *mv, const PfLayout *layout, guint32 seed)
{
    ModelRegion *mr = model_region_new(layout, seed);
    PfRegion *r = announced_region(mr);

    g_ptr_array_add(mv->regions, mr);
    g_assert_true(pf_scanner_add_region(m->s, mv->vm, r));
    g_assert_cmpuint(mv->vm->regions->len, ==, mv->regions->len);
    return mv->regions->len - 1;
}

/* RAM unplugged: its agent maps every page of it from its memfd again,
 * forgets it, then says GONE (link.c has checked the index and size). */
static void
model_region_gone(Model *m, ModelVm *mv, guint index)
{
    ModelRegion *mr = model_region(mv, index);

    g_assert_false(mr->gone);
    for (gsize i = 0; i < mr->guest->n_pages; i++) {
        fold_back(mr, i);
    }
    mr->gone = TRUE;
    pf_scanner_region_gone(m->s, mv->vm, index);
}

static void
model_exit(ModelVm *mv)
{
    pf_guest_release(mv->pid);
    mv->pid = 0;
}

/* The agent folds its merged pages back into the memfd, then says so. */
static void
model_step_back(Model *m, ModelVm *mv, const char *why)
{
    for (guint k = 0; k < mv->regions->len; k++) {
        ModelRegion *mr = model_region(mv, k);

        for (gsize i = 0; i < mr->guest->n_pages && !mr->gone; i++) {
            fold_back(mr, i);
        }
    }
    pf_scanner_step_back(m->s, mv->vm, why);
    m->stepped_back++;
}

/* Its agent goes: it hung up, or its process exited (pagefoldd hears of
 * it from the socket first, then detaches the VM). */
static void
agent_ends(Model *m, ModelVm *mv, gboolean exits)
{
    if (exits) {
        model_exit(mv);
    }
    model_detach(m, mv, exits ? "its process exited" : "its agent hung up");
}

/* The guest writes a page.  A merged page copies on write, which
 * pagefoldd finds in pagemap at its next look: here, at once. */
static void
guest_writes(Model *m, ModelVm *mv, guint region, gsize idx, const guint8 *data)
{
    ModelRegion *mr = model_region(mv, region);

    g_assert_false(mr->gone);
    memcpy(mr->content + idx * PF_PAGE_SIZE, data, PF_PAGE_SIZE);
    memcpy(mr->guest->mem + idx * PF_PAGE_SIZE, data, PF_PAGE_SIZE);
    mr->merged[idx] = FALSE;
    mr->kept[idx] = FALSE;
    if (mv->vm != NULL && pf_vm_merges(mv->vm)) {
        /* Asked of its agent as a scan's findings are: sent as the next
         * scan slice ends. */
        cow_found(m->s, g_ptr_array_index(mv->vm->regions, region), idx);
    }
}

/* The guest gives pages back (a balloon): holes of its memfd, which read
 * as zeros; its agent tells pagefoldd. */
static void
guest_discards(Model *m, ModelVm *mv, guint region, gsize first, gsize n)
{
    ModelRegion *mr = model_region(mv, region);

    g_assert_cmpint(fallocate(mr->guest->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              (off_t)(first * PF_PAGE_SIZE), (off_t)(n * PF_PAGE_SIZE)), ==, 0);
    memset(mr->content + first * PF_PAGE_SIZE, 0, n * PF_PAGE_SIZE);
    memset(mr->merged + first, 0, n * sizeof(gboolean));
    memset(mr->kept + first, 0, n * sizeof(gboolean));
    pf_scanner_discarded(m->s, mv->vm, region, first, n);
}

static void
run_passes(Model *m, guint n, const char *when)
{
    for (guint i = 0; i < n; i++) {
        pf_scan_job_run_passes_wait(m->s, 1);
        check_model(m, when);
    }
}

/* Detached VMs whose processes exited: pagefoldd puts back what they
 * held when their pidfd says so, on its main loop. */
static void
wait_for_leftovers(Model *m)
{
    gint64 deadline = g_get_monotonic_time() + 10 * G_USEC_PER_SEC;

    while (m->s->vms.leftovers->len > 0) {
        g_assert_cmpint(g_get_monotonic_time(), <, deadline);
        if (!g_main_context_iteration(NULL, FALSE)) {
            g_usleep(1000);
        }
    }
}

/* Every process exits and every VM goes: what their pages held comes
 * back, and nothing is left in the pool. */
static void
model_end(Model *m)
{
    PfScanInfo info;

    for (guint i = 0; i < m->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(m->vms, i);

        if (mv->pid != 0) {
            model_exit(mv);
        }
    }
    for (guint i = 0; i < m->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(m->vms, i);

        if (mv->vm != NULL) {
            model_detach(m, mv, "its process exited");
        }
    }
    wait_for_leftovers(m);
    check_model(m, "all VMs gone");
    g_assert_cmpuint(pf_scanner_get_vms(m->s)->len, ==, 0);
    pf_scanner_get_info(m->s, &info);
    g_assert_cmpuint(info.stable_nodes, ==, 0);
    g_assert_cmpuint(info.pool_slots, ==, 0);
    g_assert_cmpuint(info.pool_bytes, ==, 0);
    g_assert_cmpuint(info.pool_chunks, <=, 1); /* the zero chunk stays */
}

static void
model_free(Model *m)
{
    pf_scanner_free(m->s);
    for (guint i = 0; i < m->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(m->vms, i);

        if (mv->pid != 0) {
            model_exit(mv);
        }
        g_ptr_array_unref(mv->regions);
        g_ptr_array_unref(mv->old);
        g_free(mv);
    }
    g_ptr_array_unref(m->vms);
    g_clear_pointer(&m->rand, g_rand_free);
    g_free(m);
    model = NULL;
}

static PfCounters
totals(Model *m)
{
    PfCounters total;
    g_autofree PfCounters *per_vm = g_new0(PfCounters, MAX(1, m->s->vms.list->len));

    pf_scanner_collect(m->s, &total, per_vm);
    return total;
}

/* ---- the cases ---- */

/* Defined below. */
static const PfLayout identical_only;
#define N_IDENTICAL 256

/* A guest whose agent merged every page of its RAM to the slots of an
 * earlier pagefoldd's pool, slots[i] for page i (one chunk), then
 * connects to this one: attached with what its region check found. */
static ModelVm *
model_add_vm_merged(Model *m, PfPool *old, const guint32 *slots, guint32 seed)
{
    ModelVm *mv = g_new0(ModelVm, 1);
    PfPoolMapped *pooled = g_new0(PfPoolMapped, 1);
    ModelRegion *mr;
    guint32 chunk, index;
    const PfPoolChunk *c;
    PfPoolRun run;

    mv->regions = g_ptr_array_new_with_free_func(model_region_free);
    mv->old = g_ptr_array_new_with_free_func(model_region_free);
    mr = model_region_new(&identical_only, seed);
    g_ptr_array_add(mv->regions, mr);
    pf_pool_locate(old, slots[0], &chunk, &index);
    c = pf_pool_chunk(old, chunk);
    run = (PfPoolRun){ 0, N_IDENTICAL, c->ino, index, FALSE };
    for (guint i = 0; i < N_IDENTICAL; i++) {
        guint32 ci, ii;

        pf_pool_locate(old, slots[i], &ci, &ii);
        g_assert_cmpuint(ci, ==, chunk);
        g_assert_cmpuint(ii, ==, index + i);
        mr->merged[i] = TRUE;
    }
    punch(mr, 0, N_IDENTICAL);
    pooled->holder = (PfChunkHolder){ getpid(), 0, TRUE };
    pooled->runs = g_array_new(FALSE, FALSE, sizeof(PfPoolRun));
    g_array_append_val(pooled->runs, run);
    pooled->fds = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, close_fd_value);
    g_hash_table_insert(pooled->fds, g_memdup2(&c->ino, sizeof(c->ino)),
                        GINT_TO_POINTER(fcntl(c->fd, F_DUPFD_CLOEXEC, 3) + 1));
    keep_pool_from_children(m);
    mv->pid = pf_guest_hold(mr->guest);
    g_ptr_array_add(m->vms, mv);
    model_attach_pooled(m, mv, pooled);
    return mv;
}

/* Until the scanner has taken back every page it will, and the agents
 * answered what that asked. */
static void
wait_adopted(Model *m)
{
    gint64 deadline = g_get_monotonic_time() + 10 * G_USEC_PER_SEC;

    while (m->s->adopt.source != 0 || g_main_context_pending(NULL)) {
        g_assert_cmpint(g_get_monotonic_time(), <, deadline);
        g_main_context_iteration(NULL, FALSE);
    }
}

/*
 * A pagefoldd started again takes back the pages two VMs merged under the
 * one before, as far as a node may take them (a seam lowers that to one
 * sharer here): the pages it cannot take are folded back, never left
 * merged and uncounted, where their chunk could go and their VM be
 * detached for still mapping it.  A page the guest discarded before its
 * turn is not taken back.  After every step each page the agents keep
 * merged is one pagefoldd counts (check_model()).
 */
static void
test_adopt_refused(void)
{
    Model *m = model_new();
    g_autoptr(PfPool) old = NULL;
    guint32 slots[N_IDENTICAL];
    guint32 one = 1;
    ModelVm *a, *b;
    PfCounters t;

    if (geteuid() != 0) {
        g_test_skip("needs root: pool chunks are marked in the trusted namespace");
        model_free(m);
        return;
    }
    old = pf_pool_new(NULL, NULL, NULL);
    {
        g_autoptr(PfGuest) g = pf_guest_new("memory-backend-memfd", &identical_only, 1);

        for (guint i = 0; i < N_IDENTICAL; i++) {
            slots[i] = pf_pool_alloc(old, &one, 1, g->mem + i * PF_PAGE_SIZE, NULL);
        }
    }
    m->s->setup.adopt_max_sharers = 1;
    a = model_add_vm_merged(m, old, slots, 1);
    b = model_add_vm_merged(m, old, slots, 2);
    /* a's page 3 was ballooned away before its turn. */
    guest_discards(m, a, 0, 3, 1);
    wait_adopted(m);
    check_model(m, "taken back");
    /* a took every node but that of page 3, which b took. */
    g_assert_cmpuint(a->vm->scan->count[PF_PAGE_SHARED], ==, N_IDENTICAL - 1);
    g_assert_cmpuint(b->vm->scan->count[PF_PAGE_SHARED], ==, 1);
    for (guint i = 0; i < N_IDENTICAL; i++) {
        g_assert_cmpint(model_region(b, 0)->merged[i], ==, i == 3);
    }
    m->s->setup.adopt_max_sharers = ADOPT_MAX_SHARERS;
    run_passes(m, 4, "merging again");
    t = totals(m);
    g_assert_cmpuint(t.pages_sharing, >=, N_IDENTICAL - 1);
    model_end(m);
    model_free(m);
}

/*
 * A VM put in a merge domain of its own in the middle of a pass, when some
 * of its pages were found equal to content of the default domain (a and
 * b's) and wait to join it (it holds none of its chunk): they must not
 * join.  Nor may it share anything else with a and b.
 */
static void
test_merge_domain_mid_pass(void)
{
    Model *m = model_new();
    ModelVm *c;
    PfCounters t;

    model_add_vm(m, &identical_only, 1);
    model_add_vm(m, &identical_only, 2);
    run_passes(m, 3, "a and b share");
    c = model_add_vm(m, &identical_only, 3);
    /* a's and b's pages, then c's, at their first visit: all found equal,
     * waiting. */
    pf_test_scan(m->s, 3 * N_IDENTICAL);
    g_assert_cmpuint(m->s->moves.joins->len, ==, N_IDENTICAL);
    g_assert_true(pf_scanner_set_merge_domain(m->s, c->vm, "tenant", NULL));
    run_passes(m, 3, "c in a domain of its own");
    g_assert_cmpuint(c->vm->scan->count[PF_PAGE_SHARED] + c->vm->scan->count[PF_PAGE_PENDING], ==,
                     0);
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL);
    model_end(m);
    model_free(m);
}

/*
 * A VM's pages that match what others share in a chunk of theirs join as
 * soon as the cursor is done with that VM, not at the pass's end: by then
 * the pass saw every page of it it visits, which is all that whether they
 * match the whole chunk depends on.  Here c's pages are on their way in
 * while the cursor is still in d, a VM after it.
 */
static void
test_joins_within_pass(void)
{
    static const PfLayout own = { .unique = 4 * N_IDENTICAL };
    Model *m = model_new();
    ModelVm *c, *d;
    PfCounters t;

    model_add_vm(m, &identical_only, 1);
    model_add_vm(m, &identical_only, 2);
    run_passes(m, 3, "a and b share");
    c = model_add_vm(m, &identical_only, 3);
    d = model_add_vm(m, &own, 4);
    /* a's, b's and c's pages, then some of d's: c's at their first
     * visit. */
    pf_test_scan(m->s, 4 * N_IDENTICAL);
    g_assert_true(pf_scanner_in_pass(m->s));
    g_assert_true(m->s->cursor.vm < m->s->vms.list->len &&
                  g_ptr_array_index(m->s->vms.list, m->s->cursor.vm) == d->vm);
    g_assert_cmpuint(c->vm->scan->count[PF_PAGE_PENDING] + c->vm->scan->count[PF_PAGE_SHARED], ==,
                     N_IDENTICAL);
    run_passes(m, 2, "c joined");
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, 2 * N_IDENTICAL);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);
    model_end(m);
    model_free(m);
}

/*
 * A page written back with the content it shared (its copy on write
 * folded back) waits for two visits before it merges again, as any page
 * that changed: pages that come in new join content already merged at
 * their first visit, but here an undone merge costs its agent a remap
 * and a punch, and a page written over and over with one content would
 * merge and come back every pass.
 */
static void
test_written_back_waits(void)
{
    Model *m = model_new();
    ModelVm *a = model_add_vm(m, &identical_only, 1);
    guint8 same[PF_PAGE_SIZE];
    const PfPage *p;

    model_add_vm(m, &identical_only, 2);
    run_passes(m, 3, "a and b share");
    p = pf_region_page(g_ptr_array_index(a->vm->regions, 0), 0);
    g_assert_cmpint(p->state, ==, PF_PAGE_SHARED);
    memcpy(same, model_region(a, 0)->content, PF_PAGE_SIZE);
    guest_writes(m, a, 0, 0, same);
    for (guint i = 0; i < 4 && p->state != PF_PAGE_VOLATILE; i++) {
        run_passes(m, 1, "folded back");
    }
    /* Folded back, and visited since in the same pass, or not yet. */
    g_assert_cmpint(p->state, ==, PF_PAGE_VOLATILE);
    if (p->checksum == 0) {
        run_passes(m, 1, "first visit since");
        g_assert_cmpint(p->state, ==, PF_PAGE_VOLATILE);
    }
    run_passes(m, 2, "second visit since");
    g_assert_cmpint(p->state, ==, PF_PAGE_SHARED);
    model_end(m);
    model_free(m);
}

/* Whether any chunk x's agent holds has a slot reading data. */
static gboolean
holds_content(Model *m, ModelVm *x, const guint8 *data)
{
    GHashTableIter it;
    gpointer id;

    g_hash_table_iter_init(&it, x->agent->held);
    while (g_hash_table_iter_next(&it, &id, NULL)) {
        const PfPoolChunk *chunk = pf_pool_chunk(m->s->pool, GPOINTER_TO_UINT(id));

        for (guint32 i = 0; chunk != NULL && i < chunk->n_slots; i++) {
            if (memcmp(chunk->map + (gsize)i * PF_PAGE_SIZE, data, PF_PAGE_SIZE) == 0) {
                return TRUE;
            }
        }
    }
    return FALSE;
}

/*
 * Ids reused within a pass (the trust review's first finding): x's page
 * equals a's and b's shared page (node N, slot s of their chunk C) and
 * waits for the cursor to be done with x to join; then a and b
 * write that page, so N, s and C go, and pair a content x never had,
 * which gets N's id, C's id and slot s again.  x must not be sent the
 * chunk: it would read a page it does not share.
 */
static void
test_ids_reused(void)
{
    static const PfLayout pair = { .identical = 1, .unique = N_IDENTICAL - 1 };
    static const PfLayout own = { .unique = N_IDENTICAL };
    Model *m = model_new();
    ModelVm *x = model_add_vm(m, &own, 3), *a, *b;
    guint8 k1[PF_PAGE_SIZE], k2[PF_PAGE_SIZE], junk[PF_PAGE_SIZE];
    guint64 born;
    guint32 n;

    a = model_add_vm(m, &pair, 1);
    b = model_add_vm(m, &pair, 2);
    run_passes(m, 3, "a and b share their page 0");
    memcpy(k1, model_region(a, 0)->content, PF_PAGE_SIZE);
    memset(k2, 0, sizeof(k2));
    g_strlcpy((char *)k2, "K2-SECRET-of-a-and-b", sizeof(k2));
    guest_writes(m, a, 0, 1, k2);
    guest_writes(m, b, 0, 1, k2);
    run_passes(m, 1, "their checksums taken");
    guest_writes(m, x, 0, 0, k1);
    /* x's pages come first in a pass: its page 0, at its first visit
     * since, waits to join N. */
    pf_test_scan(m->s, N_IDENTICAL);
    g_assert_cmpuint(m->s->moves.joins->len, ==, 1);
    n = g_array_index(m->s->moves.joins, Joining, 0).node;
    born = g_array_index(m->s->moves.joins, Joining, 0).born;
    for (guint i = 0; i < 2; i++) {
        memset(junk, 'a' + i, sizeof(junk));
        guest_writes(m, i == 0 ? a : b, 0, 0, junk);
    }
    pf_scanner_flush(m->s);
    while (g_main_context_iteration(NULL, FALSE)) {
    }
    g_assert_false(node_at(m->s, n)->live);
    /* a's and b's pages: their page 1 pairs, the pass ends. */
    while (pf_scanner_in_pass(m->s)) {
        pf_test_scan(m->s, N_IDENTICAL);
        while (g_main_context_iteration(NULL, FALSE)) {
        }
    }
    /* The id came back, for content x never had. */
    g_assert_true(node_at(m->s, n)->live);
    g_assert_cmpuint(node_at(m->s, n)->born, !=, born);
    run_passes(m, 2, "after");
    g_assert_true(holds_content(m, a, k2));
    g_assert_false(holds_content(m, x, k2));
    g_assert_cmpuint(totals(m).pages_sharing, >=, 1);
    model_end(m);
    model_free(m);
}

/* 1 MiB of pages every guest has: the smallest region vm.c takes. */
static const PfLayout identical_only = { .identical = N_IDENTICAL };
/* The first half of identical_only's pages, then pages of its own. */
static const PfLayout half_identical = { .identical = N_IDENTICAL / 2,
                                         .unique = N_IDENTICAL / 2 };

static gboolean
batch_moves(const ModelBatch *b)
{
    for (guint i = 0; i < b->pending->len; i++) {
        if (g_array_index(b->pending, PfPending, i).from != 0) {
            return TRUE;
        }
    }
    return FALSE;
}

/* The first batch that moves a page of the chosen VM: it steps back
 * (a vhost-user device came) before answering. */
static gboolean
step_back_on_move(ModelAgent *l, const ModelBatch *b)
{
    if (l->vm == model->chosen && model->stepped_back == 0 && batch_moves(b)) {
        model_step_back(model, l->mv, "test: vhost-user");
    }
    return TRUE;
}

/* a and b come and share their pages, in a chunk for the two of them;
 * then c comes, whose pages join half of theirs: c may not read the other
 * half, so the nodes it joins move to slots for all three, a's and b's
 * pages merged over to them (a VM that shares all of a chunk is sent it
 * instead: moves-per-arrival).  Returns a. */
static ModelVm *
share_then_move(Model *m, ModelBatchFunc before_answer, const char *when)
{
    ModelVm *a = model_add_vm(m, &identical_only, 1);

    model_add_vm(m, &identical_only, 2);
    run_passes(m, 3, "a and b sharing");
    g_assert_cmpuint(m->moves, ==, 0);
    m->chosen = a->vm;
    m->before_answer = before_answer;
    model_add_vm(m, &half_identical, 3);
    run_passes(m, 3, when);
    return a;
}

/*
 * a steps back with its moves in flight: its agent refuses them, and both
 * the slot each was going to and the one it was leaving are let go (this
 * once leaked a slot, and its chunk, for good).
 */
static void
test_step_back_during_move(void)
{
    Model *m = model_new();
    ModelVm *a = share_then_move(m, step_back_on_move, "a stepped back mid-move");
    PfCounters t;

    g_assert_cmpuint(m->stepped_back, ==, 1);
    g_assert_cmpstr(pf_vm_mode_name(a->vm), ==, "advise");
    g_assert_cmpuint(m->moves, >=, N_IDENTICAL);
    /* b and c share half the pages; b keeps the other half merged on its
     * own (KSM keeps a node with one page); a is on its own. */
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL / 2);
    g_assert_cmpuint(t.pages_pending, ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);
    model_end(m);
    model_free(m);
}

/* The chosen VM's agent goes before it answers a batch (one that moves
 * its pages, if so chosen), with that batch and any after it in flight. */
static gboolean
end_chosen_agent(ModelAgent *l, const ModelBatch *b)
{
    if (l->vm != model->chosen || (model->chosen_on_move && !batch_moves(b))) {
        return TRUE;
    }
    agent_ends(model, l->mv, model->chosen_exits);
    return FALSE;
}

/*
 * As above, but a's agent goes with its moves in flight (data: whether its
 * process exits too).  The agent may have moved each page or not: both
 * slots a page may map, the one it was moving to and the one it was
 * leaving, stay taken while a's process lives (a leftover) and are put
 * back when it exits.  b and c share each page then, in one slot, and the
 * chunk a and b shared is gone.
 */
static void
test_agent_gone_during_move(gconstpointer data)
{
    Model *m = model_new();
    ModelVm *a;
    PfCounters t;

    m->chosen_exits = GPOINTER_TO_INT(data);
    m->chosen_on_move = TRUE;
    a = share_then_move(m, end_chosen_agent, "a's agent went mid-move");
    g_assert_null(a->vm);
    if (a->pid != 0) {
        Leftover *lo;

        g_assert_cmpuint(m->s->vms.leftovers->len, ==, 1);
        lo = g_ptr_array_index(m->s->vms.leftovers, 0);
        /* Two for each page moving, one for each merged page staying. */
        g_assert_cmpuint(lo->refs->len, ==, 3 * N_IDENTICAL / 2);
        model_exit(a);
        wait_for_leftovers(m);
        check_model(m, "a's process exited");
    }
    g_assert_cmpuint(m->s->vms.leftovers->len, ==, 0);
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL / 2);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);
    /* b's and c's chunk, and a's and b's with half its slots freed. */
    g_assert_cmpuint(pf_pool_bytes(m->s->pool), ==, 3 * N_IDENTICAL / 2 * PF_PAGE_SIZE);
    model_end(m);
    model_free(m);
}

/*
 * The agent that goes while pagefoldd waits for answers is the last VM's.
 * A scan-now job waits for every VM's answers, and an answer may detach
 * the VM (link.c closes a link that breaks); the job must not look at it
 * again, even when it was the last VM (the synchronous wait that came
 * before jobs once read the freed VM's link there, which ASan reported).
 */
static void
test_last_agent_gone_while_settling(void)
{
    Model *m;
    ModelVm *b;

    m = model_new();
    model_add_vm(m, &identical_only, 1);
    b = model_add_vm(m, &identical_only, 2);
    m->chosen = b->vm;
    m->before_answer = end_chosen_agent;
    run_passes(m, 3, "b's agent went while settling");
    g_assert_null(b->vm);
    model_end(m);
    model_free(m);
}

/*
 * What a VM's arrival costs the others.  Identical VMs come one at a
 * time: the second's pages and the first's make new nodes, and each VM
 * after shares every slot of their chunk, which becomes its too (pool.h:
 * it reads nothing it does not share): nothing moves.  (Where it shares
 * part of a chunk, the nodes it joins move: step-back-during-move.)  The
 * count is asserted so that a change in move cost shows.
 */
static void
test_moves_per_arrival(void)
{
    Model *m = model_new();

    for (guint k = 1; k <= 8; k++) {
        guint before = m->moves;
        PfCounters t;

        model_add_vm(m, &identical_only, 100 + k);
        run_passes(m, 3, "arrival");
        g_test_message("VM %u's arrival moved %u pages", k, m->moves - before);
        g_assert_cmpuint(m->moves - before, ==, 0);
        if (k < 2) {
            continue;
        }
        t = totals(m);
        g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
        g_assert_cmpuint(t.pages_sharing, ==, (k - 1) * N_IDENTICAL);
        /* One slot per page, in the one chunk. */
        g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);
        g_assert_cmpuint(pf_pool_bytes(m->s->pool), ==, N_IDENTICAL * PF_PAGE_SIZE);
    }
    model_end(m);
    model_free(m);
}

/*
 * Today's behaviour, documented: a VM detached while its process lives
 * (its agent hung up) keeps the slots its merged pages map until the
 * process exits, and a chunk goes only with its last slot.  Here a and b
 * share a full chunk; a writes all but one of its pages and is detached;
 * b writes all of its own.  One slot is left, in a chunk that is to be
 * emptied, but no page pagefoldd knows maps it, so nothing can move off
 * it: the whole 2 MiB stay until a's process exits.
 */
static void
test_detached_pins_chunk(void)
{
    static const PfLayout layout = { .unique = PF_POOL_CHUNK_SLOTS };
    Model *m = model_new();
    ModelVm *a = model_add_vm(m, &layout, 1);
    ModelVm *b = model_add_vm(m, &layout, 1);
    const gsize chunk_bytes = (gsize)PF_POOL_CHUNK_SLOTS * PF_PAGE_SIZE;
    guint8 page[PF_PAGE_SIZE];
    PfScanInfo info;

    run_passes(m, 3, "merging");
    pf_scanner_get_info(m->s, &info);
    g_assert_cmpuint(info.pool_slots, ==, PF_POOL_CHUNK_SLOTS);
    g_assert_cmpuint(info.pool_bytes, ==, chunk_bytes);

    for (gsize i = 1; i < PF_POOL_CHUNK_SLOTS; i++) {
        pf_fill_page(page, pf_page_seed(7, 1, i, 1));
        guest_writes(m, a, 0, i, page);
    }
    run_passes(m, 3, "a wrote its pages");
    model_detach(m, a, "test: its agent hung up");
    check_model(m, "a detached, alive");
    g_assert_cmpuint(m->s->vms.leftovers->len, ==, 1);
    for (gsize i = 0; i < PF_POOL_CHUNK_SLOTS; i++) {
        pf_fill_page(page, pf_page_seed(7, 2, i, 1));
        guest_writes(m, b, 0, i, page);
    }
    run_passes(m, 5, "b wrote its pages");
    pf_scanner_get_info(m->s, &info);
    g_assert_cmpuint(info.pool_slots, ==, 1);
    g_assert_cmpuint(info.pool_bytes, ==, chunk_bytes);
    g_assert_cmpuint(pf_pool_n_evacuating(m->s->pool), ==, 1);

    model_exit(a);
    wait_for_leftovers(m);
    check_model(m, "a's process exited");
    pf_scanner_get_info(m->s, &info);
    g_assert_cmpuint(info.pool_slots, ==, 0);
    g_assert_cmpuint(info.pool_bytes, ==, 0);
    model_end(m);
    model_free(m);
}

/*
 * A chunk all of whose slots were handed out, and of which at most a
 * quarter are still in use, is emptied (pool.h): its nodes move to a new
 * slot for the same VMs, their members following, and it goes.  Here a
 * and b share a full chunk, then both write 400 of those pages: the 112
 * nodes left move, 224 pages, and the pool holds 112 pages, not 512.
 */
static void
test_evacuate(void)
{
    static const PfLayout layout = { .unique = PF_POOL_CHUNK_SLOTS };
    const guint written = 400, left = PF_POOL_CHUNK_SLOTS - written;
    Model *m = model_new();
    ModelVm *vm[2] = { model_add_vm(m, &layout, 1), model_add_vm(m, &layout, 1) };
    guint8 page[PF_PAGE_SIZE];
    PfScanInfo info;
    guint moves;

    run_passes(m, 3, "merging");
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, PF_POOL_CHUNK_SLOTS);
    for (guint k = 0; k < 2; k++) {
        for (gsize i = 0; i < written; i++) {
            pf_fill_page(page, pf_page_seed(7, k, i, 1));
            guest_writes(m, vm[k], 0, i, page);
        }
    }
    /* The pages go now; their slots with the agents' answers. */
    moves = m->moves;
    pf_scan_job_run_passes_wait(m->s, 1);
    check_model(m, "pages written");
    g_assert_cmpuint(pf_pool_n_evacuating(m->s->pool), ==, 1);
    g_assert_cmpuint(m->moves, ==, moves);

    run_passes(m, 2, "evacuating");
    g_assert_cmpuint(m->moves - moves, ==, 2 * left);
    pf_scanner_get_info(m->s, &info);
    g_assert_cmpuint(pf_pool_n_evacuating(m->s->pool), ==, 0);
    g_assert_cmpuint(info.pool_slots, ==, left);
    g_assert_cmpuint(info.pool_bytes, ==, left * PF_PAGE_SIZE);
    g_assert_cmpuint(totals(m).pages_sharing, ==, left);
    model_end(m);
    model_free(m);
}

/*
 * One content many times over, in merging VMs, few sharers per node: a
 * lookup costs the same however many of its nodes are full (each full
 * one was looked at before: n^2 / 2m for a pass over n copies), and a
 * full node whose sharer copies on write takes one again.
 */
static void
test_full_nodes(void)
{
    static const PfLayout layout = { .duplicate = N_IDENTICAL };
    const guint sharing = 4, copies = 2 * N_IDENTICAL, nodes = copies / sharing;
    Model *m = model_new();
    ModelVm *a;
    guint8 page[PF_PAGE_SIZE], saved[PF_PAGE_SIZE];
    PfScanInfo info;
    guint64 before;
    PfCounters t;

    pf_scanner_get_knobs(m->s)->max_page_sharing = sharing;
    a = model_add_vm(m, &layout, 1);
    model_add_vm(m, &layout, 2);
    run_passes(m, 1, "first look");
    pf_scanner_get_info(m->s, &info);
    before = info.stable_nodes_examined;
    run_passes(m, 1, "merging");
    pf_scanner_get_info(m->s, &info);
    g_test_message("merging %u copies looked at %" G_GUINT64_FORMAT " nodes", copies,
                   info.stable_nodes_examined - before);
    g_assert_cmpuint(info.stable_nodes_examined - before, <=, copies / 2);
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, nodes);
    g_assert_cmpuint(t.pages_sharing, ==, copies - nodes);
    g_assert_cmpuint(info.stable_nodes, ==, nodes);

    /* a writes a copy (copy on write: unmerged), then writes it back. */
    memcpy(saved, model_region(a, 0)->content + 100 * PF_PAGE_SIZE, PF_PAGE_SIZE);
    memcpy(page, saved, PF_PAGE_SIZE);
    page[0] ^= 1;
    guest_writes(m, a, 0, 100, page);
    run_passes(m, 1, "a copy written");
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, nodes);
    g_assert_cmpuint(t.pages_sharing, ==, copies - nodes - 1);
    guest_writes(m, a, 0, 100, saved);
    pf_scanner_get_info(m->s, &info);
    before = info.stable_nodes_examined;
    run_passes(m, 2, "written back");
    pf_scanner_get_info(m->s, &info);
    g_assert_cmpuint(info.stable_nodes_examined - before, ==, 1);
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, nodes);
    g_assert_cmpuint(t.pages_sharing, ==, copies - nodes);
    g_assert_cmpuint(info.stable_nodes, ==, nodes);
    model_end(m);
    model_free(m);
}

/*
 * One content in more copies than max_page_sharing, in three VMs: KSM's
 * case of a content whose chain has a node for each max_page_sharing
 * sharers.  Each VM's copies first pair among themselves (their own
 * chunk), and a node with room is of another VM's chunk: only as many of
 * its copies as the node has room for may wait to join it, the rest pair
 * up.  Before, every copy waited for that one node, which then took the
 * few it had room for, and the rest of the VM's copies waited on, looked
 * at less and less often (smart_scan): one of four guests' thousands of
 * 0xcc pages (its freed kernel init memory) unmerged for the 30 s of
 * bench-qemu.
 */
static void
test_crowded_content(void)
{
    static const PfLayout layout = { .duplicate = N_IDENTICAL + 2 };
    const guint sharing = 4, copies = 3 * (N_IDENTICAL + 2);
    Model *m = model_new();
    PfCounters t = { 0 };

    pf_scanner_get_knobs(m->s)->max_page_sharing = sharing;
    /* As by default: a page that waited in vain is looked at less often. */
    pf_scanner_get_knobs(m->s)->smart_scan = TRUE;
    for (guint32 seed = 1; seed <= 3; seed++) {
        model_add_vm(m, &layout, seed);
    }
    run_passes(m, 1, "first look");
    /* Every copy merged at its second visit but for a few, at most the
     * two a VM has beyond its own full nodes: those join a node of
     * another VM's with room, by a move, a pass or two after they are
     * found (partial joins wait a pass; the pages behind the first that
     * moves the node find it retired, and join its successor at their
     * next visit, which smart_scan may put off a pass). */
    for (int pass = 0; pass < 4; pass++) {
        run_passes(m, 1, "merging");
        t = totals(m);
        g_test_message("shared %" G_GUINT64_FORMAT " sharing %" G_GUINT64_FORMAT
                       " unshared %" G_GUINT64_FORMAT, t.pages_shared, t.pages_sharing,
                       t.pages_unshared);
        g_assert_cmpuint(t.pages_unshared, <=, 3 * 2);
        /* A pass makes its joins before it ends: nothing waits. */
        g_assert_cmpuint(m->s->moves.joining->len + m->s->moves.joins->len, ==, 0);
        g_assert_cmpuint(g_hash_table_size(m->s->moves.waiting), ==, 0);
    }
    g_assert_cmpuint(t.pages_unshared, ==, 0);
    g_assert_cmpuint(t.pages_shared + t.pages_sharing, ==, copies);
    /* Full nodes, but for a few. */
    g_assert_cmpuint(t.pages_shared, <=, copies / sharing + 3);
    model_end(m);
    model_free(m);
}

/* ---- RAM that joins and leaves ---- */

/* Pages of a seed's own, and some zero pages: two regions of one seed
 * share all their pages. */
static const PfLayout own_pages = { .unique = N_IDENTICAL, .zero = 16 };

/*
 * A region goes (GONE) while its pages are merged: every reference they
 * held is put back at once (its agent mapped them all from the memfd
 * first), the counters forget its pages as if unmerged, and its slots
 * are freed where no page is left to share them.  a and b share their
 * first regions; then each gets a second, the two sharing all of it.
 */
static void
test_region_gone_merged(void)
{
    Model *m = model_new();
    ModelVm *a = model_add_vm(m, &identical_only, 1);
    ModelVm *b = model_add_vm(m, &identical_only, 2);
    PfCounters t;

    run_passes(m, 3, "a and b sharing");
    g_assert_cmpuint(model_region_join(m, a, &own_pages, 77), ==, 1);
    g_assert_cmpuint(model_region_join(m, b, &own_pages, 77), ==, 1);
    run_passes(m, 3, "their second regions sharing too");
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, 2 * N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, 2 * N_IDENTICAL);
    g_assert_cmpuint(t.zero_pages, ==, 2 * 16);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, 2 * N_IDENTICAL);

    /* a's goes: b's pages are each alone on their node (KSM keeps it). */
    model_region_gone(m, a, 1);
    check_model(m, "a's second region gone");
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, 2 * N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL);
    g_assert_cmpuint(t.zero_pages, ==, 16);
    g_assert_cmpuint(t.pages_pending, ==, 0);
    g_assert_cmpuint(pf_vm_n_pages(a->vm), ==, N_IDENTICAL);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, 2 * N_IDENTICAL);

    /* b's goes: their slots are free. */
    model_region_gone(m, b, 1);
    check_model(m, "b's second region gone");
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL);
    g_assert_cmpuint(t.zero_pages, ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);

    /* Passes go on over the regions left; never a request for those gone
     * (the stand-in link asserts it). */
    run_passes(m, 3, "after");
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);
    model_end(m);
    model_free(m);
}

/* Requests in flight for region 1 of the chosen VM that GONE settled. */
static guint settled_by_gone;

/* Before the chosen VM's agent answers the first batch that merges a page
 * of region 1 with another VM's, that region goes: the batch's items for
 * it are settled by then.  (Its zero pages may come in a batch before,
 * as the cursor visits the VMs in whatever order their reads end.) */
static gboolean
gone_before_answer(ModelAgent *l, const ModelBatch *b)
{
    gboolean names = FALSE;

    for (guint i = 0; i < b->items->len; i++) {
        const PfWireItem *it = &g_array_index(b->items, PfWireItem, i);

        names |= it->region == 1 && it->kind == PF_ITEM_MERGE;
    }
    if (l->vm != model->chosen || !names || model_region(l->mv, 1)->gone) {
        return TRUE;
    }
    model_region_gone(model, l->mv, 1);
    for (guint i = 0; i < b->items->len; i++) {
        if (g_array_index(b->items, PfWireItem, i).region == 1) {
            g_assert_true(g_array_index(b->pending, PfPending, i).settled);
            settled_by_gone++;
        }
    }
    check_model(model, "region 1 gone with requests in flight");
    return TRUE;
}

/* A lying agent: whatever it was asked of a region gone, done. */
static void
done_for_gone(ModelAgent *l, const PfWireItem *item, const PfPending *pd,
              PfResultStatus *status,
              int *err)
{
    if (model_region(l->mv, item->region)->gone) {
        *status = PF_RESULT_DONE;
        *err = 0;
    }
}

/*
 * A region goes with requests for it in flight: their answers come after
 * GONE (the agent refuses them, having forgotten the region, or -- data --
 * lies that it did them).  What each held (its slot, its node) was let go
 * once, at GONE; the answers change nothing, and the pool comes back to
 * what the regions left share.
 */
static void
test_region_gone_in_flight(gconstpointer data)
{
    Model *m = model_new();
    ModelVm *a = model_add_vm(m, &identical_only, 1);
    ModelVm *b = model_add_vm(m, &identical_only, 2);
    PfCounters t;

    settled_by_gone = 0;
    run_passes(m, 3, "a and b sharing");
    m->chosen = a->vm;
    m->before_answer = gone_before_answer;
    m->answer = GPOINTER_TO_INT(data) ? done_for_gone : NULL;
    model_region_join(m, a, &own_pages, 77);
    model_region_join(m, b, &own_pages, 77);
    run_passes(m, 4, "a's second region went mid-merge");
    g_assert_true(model_region(a, 1)->gone);
    g_assert_cmpuint(settled_by_gone, >, 0);
    g_test_message("%u requests in flight settled by GONE", settled_by_gone);
    /* b's second region merged, each page alone on its node. */
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, 2 * N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL);
    g_assert_cmpuint(t.zero_pages, ==, 16);
    g_assert_cmpuint(t.pages_pending, ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, 2 * N_IDENTICAL);
    model_end(m);
    model_free(m);
}

/* The chosen VM's RAM (region 0) goes as its first batch that moves pages
 * is about to be answered. */
static gboolean
gone_on_move(ModelAgent *l, const ModelBatch *b)
{
    if (l->vm == model->chosen && !model_region(l->mv, 0)->gone && batch_moves(b)) {
        model_region_gone(model, l->mv, 0);
        check_model(model, "a's RAM gone mid-move");
    }
    return TRUE;
}

/*
 * A region goes while its merged pages move to a new node (share_then_move:
 * c's arrival moves half of a's and b's): each move held a reference on
 * the slot it went to and on the one it left, both put back at GONE.  b
 * and c then share half the pages, b keeps the other half merged alone,
 * and a is attached with no RAM left to scan.
 */
static void
test_region_gone_during_move(void)
{
    Model *m = model_new();
    ModelVm *a = share_then_move(m, gone_on_move, "a's RAM went mid-move");
    PfCounters t;

    g_assert_true(model_region(a, 0)->gone);
    g_assert_nonnull(a->vm);
    g_assert_cmpuint(pf_vm_n_pages(a->vm), ==, 0);
    g_assert_cmpuint(m->moves, >=, N_IDENTICAL / 2);
    t = totals(m);
    g_assert_cmpuint(t.pages_shared, ==, N_IDENTICAL);
    g_assert_cmpuint(t.pages_sharing, ==, N_IDENTICAL / 2);
    g_assert_cmpuint(t.pages_pending, ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, N_IDENTICAL);
    model_end(m);
    model_free(m);
}

/* One content many times over: a region's pages merge among themselves,
 * on nodes whose slots are in a chunk for their VM alone. */
static const PfLayout duplicates_only = { .duplicate = N_IDENTICAL };

/*
 * A region goes with every request that holds a slot of a chunk in flight:
 * a's second region, whose pages merge only among themselves, goes before
 * its agent answers a merge.  Settling the last of those requests frees
 * their node, its slot and the chunk, whose DROP goes to the agent while
 * its link still has that request: it must read as holding nothing by
 * then (the stand-in link checks that no request it has holds a slot of a
 * chunk dropped).  pagefoldd once marked such a request settled only after
 * letting go of its references; the fuzz came upon it about once in a
 * hundred runs, depending on where time slices ended.
 */
static void
test_region_gone_frees_chunk(void)
{
    Model *m = model_new();
    ModelVm *a = model_add_vm(m, &identical_only, 1);
    const ModelBatch *b;
    const PfWireItem *first;
    guint32 chunk;

    run_passes(m, 2, "a alone, nothing to share");
    g_assert_cmpuint(model_region_join(m, a, &duplicates_only, 1), ==, 1);
    /* A pass that sees its pages once, then one that merges them all;
     * their agent answers nothing meanwhile (no main loop). */
    pf_test_scan(m->s, G_MAXSIZE);
    pf_test_scan(m->s, G_MAXSIZE);
    g_assert_cmpuint(a->vm->scan->count[PF_PAGE_PENDING], ==, N_IDENTICAL);
    g_assert_cmpuint(a->agent->n_in_flight, ==, N_IDENTICAL);
    b = g_queue_peek_head(&a->agent->in_flight);
    g_assert_nonnull(b);
    first = &g_array_index(b->items, PfWireItem, 0);
    g_assert_cmpuint(first->kind, ==, PF_ITEM_MERGE);
    chunk = first->chunk;
    /* The chunk is a's alone, and only these requests hold its slots. */
    g_assert_cmpuint(pf_pool_chunk(m->s->pool, chunk)->n_vms, ==, 1);
    check_model(m, "a's second region merging");

    model_region_gone(m, a, 1);
    check_model(m, "a's second region gone with its merges in flight");
    g_assert_null(pf_pool_chunk(m->s->pool, chunk));
    g_assert_false(g_hash_table_contains(a->agent->held, GUINT_TO_POINTER(chunk)));
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, 0);
    g_assert_cmpuint(a->vm->scan->count[PF_PAGE_PENDING], ==, 0);

    /* The answers come (refused: the agent forgot the region), and change
     * nothing. */
    run_passes(m, 2, "after");
    g_assert_cmpuint(a->agent->n_in_flight, ==, 0);
    g_assert_cmpuint(pf_pool_slots_in_use(m->s->pool), ==, 0);
    model_end(m);
    model_free(m);
}

/* ---- fuzz ---- */

typedef struct {
    const char *name;
    gboolean step_back; /* agents step back to advise mode now and then */
    gboolean lying;     /* agents answer at random and do nothing */
} FuzzMode;

static const FuzzMode fuzz_modes[] = {
    { "honest", FALSE, FALSE },
    { "step-back", TRUE, FALSE },
    { "lying-agent", FALSE, TRUE },
    { "step-back-lying-agent", TRUE, TRUE },
};

#define FUZZ_ROUNDS 32
#define FUZZ_MAX_VMS 7

/* A real agent's failures: a page in DMA, an I/O error, out of mappings.
 * A lying one answers anything, for anything. */
static void
fuzz_answer(ModelAgent *l, const PfWireItem *item, const PfPending *pd,
              PfResultStatus *status,
            int *err)
{
    static const int errs[] = { EBUSY, EIO, ENOMEM, EPERM, EFAULT };
    guint x = g_rand_int_range(model->rand, 0, 100);

    if (model->lying) {
        *status = (PfResultStatus)g_rand_int_range(model->rand, 0, 3);
        *err = *status == PF_RESULT_ERROR ? errs[g_rand_int_range(model->rand, 0, 5)] : 0;
        return;
    }
    if (*status != PF_RESULT_DONE || !pf_vm_merges(l->vm)) {
        return;
    }
    if (x < 8) {
        *status = PF_RESULT_ERROR;
        *err = EBUSY;
    } else if (x < 12 && item->kind != PF_ITEM_UNMERGE) {
        *status = PF_RESULT_ERROR;
        *err = x < 10 ? EIO : ENOMEM;
    }
}

static gboolean
fuzz_before_answer(ModelAgent *l, const ModelBatch *b)
{
    GPtrArray *vms = model->s->vms.list;
    guint x = g_rand_int_range(model->rand, 0, 100);

    /* The agent goes with this batch unanswered (moves, often).  Never
     * the last VM's: test_last_agent_gone_while_settling(). */
    if (x < 2 && vms->len > 1 && g_ptr_array_index(vms, vms->len - 1) != l->vm) {
        agent_ends(model, l->mv, g_rand_boolean(model->rand));
        return FALSE;
    }
    if (model->step_back && pf_vm_merges(l->vm) && x < 5) {
        model_step_back(model, l->mv, "fuzz: vhost-user");
    }
    return TRUE;
}

static ModelVm *
pick_vm(Model *m, gboolean attached, gboolean alive)
{
    g_autoptr(GPtrArray) some = g_ptr_array_new();

    for (guint i = 0; i < m->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(m->vms, i);

        if ((mv->vm != NULL) == attached && (mv->pid != 0) == alive) {
            g_ptr_array_add(some, mv);
        }
    }
    return some->len == 0 ? NULL
                          : g_ptr_array_index(some, g_rand_int_range(m->rand, 0, (gint32)some->len));
}

static guint
n_attached(Model *m)
{
    return m->s->vms.list->len;
}

/* A region of the VM that has not gone, at random, or -1 if none. */
static gint
pick_live_region(Model *m, ModelVm *mv)
{
    g_autoptr(GArray) live = g_array_new(FALSE, FALSE, sizeof(guint));

    for (guint k = 0; k < mv->regions->len; k++) {
        if (!model_region(mv, k)->gone) {
            g_array_append_val(live, k);
        }
    }
    return live->len == 0
               ? -1
               : (gint)g_array_index(live, guint, g_rand_int_range(m->rand, 0, (gint32)live->len));
}

/* What can happen between two batches of the scanner. */
static void
fuzz_events(Model *m, const PfLayout *layout)
{
    guint ev = g_rand_int_range(m->rand, 0, 100);
    ModelVm *mv;

    if (ev < 10 && n_attached(m) < FUZZ_MAX_VMS) {
        model_add_vm(m, layout, (guint32)g_rand_int_range(m->rand, 1, 4));
    } else if (ev < 19 && n_attached(m) > 1 && (mv = pick_vm(m, TRUE, TRUE)) != NULL) {
        if (g_rand_boolean(m->rand)) {
            model_detach(m, mv, "fuzz: its agent hung up");
        } else {
            /* pagefoldd sees it on its main loop, or at its next pass. */
            model_exit(mv);
        }
    } else if (ev < 25 && (mv = pick_vm(m, FALSE, TRUE)) != NULL) {
        if (g_rand_boolean(m->rand) || n_attached(m) >= FUZZ_MAX_VMS) {
            model_exit(mv);
        } else {
            /* Its agent connects again (pagefoldd or the VMM restarted):
             * its merged pages still map what the leftover holds. */
            model_attach(m, mv);
        }
    } else if (ev < 28) {
        /* The control socket's unmerge, of one VM or of all (run=2). */
        if (g_rand_boolean(m->rand) && (mv = pick_vm(m, TRUE, TRUE)) != NULL) {
            pf_scan_job_unmerge_wait(m->s, mv->vm);
        } else {
            pf_scanner_get_knobs(m->s)->run = 2;
            pf_scan_job_unmerge_wait(m->s, NULL);
            pf_scanner_get_knobs(m->s)->run = 1;
        }
    } else if (ev < 31 && m->step_back && (mv = pick_vm(m, TRUE, TRUE)) != NULL &&
               pf_vm_merges(mv->vm)) {
        model_step_back(m, mv, "fuzz: migration");
    } else if (ev < 37 && (mv = pick_vm(m, TRUE, TRUE)) != NULL && mv->regions->len < 6) {
        /* A DIMM plugged in: RAM like the VM's own, its pages to be shared
         * with those already merged, and with requests for them still in
         * flight when (below) it goes. */
        model_region_join(m, mv, layout, (guint32)g_rand_int_range(m->rand, 1, 4));
        m->joined++;
    } else if (ev < 43 && (mv = pick_vm(m, TRUE, TRUE)) != NULL) {
        gint region = pick_live_region(m, mv);

        /* A DIMM (or the RAM it started with) unplugged, whatever is in
         * flight for it. */
        if (region >= 0) {
            model_region_gone(m, mv, (guint)region);
            m->gone++;
        }
    }
}

/* Guests write: content another page has (so that pages come to share, or
 * stop sharing, in new ways), zeros, or content of their own. */
static void
fuzz_writes(Model *m, ModelVm *mv)
{
    guint8 page[PF_PAGE_SIZE];
    gint region;
    ModelRegion *mr;

    for (guint k = 0; k < 16; k++) {
        gsize idx;
        guint x = g_rand_int_range(m->rand, 0, 10);

        if ((region = pick_live_region(m, mv)) < 0) {
            return;
        }
        mr = model_region(mv, (guint)region);
        idx = (gsize)g_rand_int_range(m->rand, 0, (gint32)mr->guest->n_pages);
        if (x < 6) {
            ModelVm *o = g_ptr_array_index(m->vms, g_rand_int_range(m->rand, 0, (gint32)m->vms->len));
            ModelRegion *or = model_region(o, 0);
            gsize j = (gsize)g_rand_int_range(m->rand, 0, (gint32)or->guest->n_pages);

            memcpy(page, or->content + j * PF_PAGE_SIZE, PF_PAGE_SIZE);
        } else if (x < 7) {
            memset(page, 0, sizeof(page));
        } else {
            pf_fill_page(page, pf_page_seed(9, g_rand_int(m->rand), idx, 0));
        }
        guest_writes(m, mv, (guint)region, idx, page);
    }
    if (g_rand_int_range(m->rand, 0, 100) < 4 && (region = pick_live_region(m, mv)) >= 0) {
        gsize first;

        mr = model_region(mv, (guint)region);
        first = (gsize)g_rand_int_range(m->rand, 0, (gint32)mr->guest->n_pages - 8);
        guest_discards(m, mv, (guint)region, first, 8);
    }
}

static void
fuzz_one(const FuzzMode *mode, guint32 seed)
{
    /* 2.4 MiB a guest: pages all guests have, one content many times
     * over, pages shared by guests of one seed, written zeros, and holes.
     * Two guests of one seed share more than a chunk: chunks fill, then
     * thin out as pages are written, and are emptied (evacuate()). */
    static const PfLayout layout = {
        .identical = 352, .duplicate = 32, .unique = 192, .zero = 16, .holes = 16,
    };
    Model *m = model_new();
    PfKnobs *knobs = pf_scanner_get_knobs(m->s);

    g_snprintf(m->context, sizeof(m->context), "fuzz %s, seed %u", mode->name, seed);
    /* Whatever fails next names its seed in the log. */
    g_test_message("%s", m->context);
    m->rand = g_rand_new_with_seed(seed);
    m->step_back = mode->step_back;
    m->lying = mode->lying;
    m->answer = fuzz_answer;
    m->before_answer = fuzz_before_answer;
    /* Few sharers per node: full nodes, several nodes of one content. */
    knobs->max_page_sharing = (guint)g_rand_int_range(m->rand, 2, 6);
    knobs->smart_scan = g_rand_boolean(m->rand);
    if (g_rand_boolean(m->rand)) {
        /* A mapping budget of 200 (half of max_map_count): a VM reaches
         * it within a pass, and its pages cannot follow a move at once. */
        m->s->setup.max_map_count = 400;
    }
    for (guint32 i = 0; i < 3; i++) {
        model_add_vm(m, &layout, 1 + i / 2);
    }
    for (guint round = 0; round < FUZZ_ROUNDS; round++) {
        if (g_rand_boolean(m->rand)) {
            pf_scan_job_run_passes_wait(m->s, 1);
        } else {
            /* A batch, as the scanner's timer scans one; the agents answer
             * some of what they were sent, and the rest stays in flight
             * through what happens next. */
            pf_test_scan(m->s, (gsize)g_rand_int_range(m->rand, 1, 600));
            for (guint i = 0; i < m->vms->len; i++) {
                ModelVm *mv = g_ptr_array_index(m->vms, i);

                if (mv->vm != NULL && g_rand_int_range(m->rand, 0, 100) < 60) {
                    answer_batches(mv->agent, (guint)g_rand_int_range(m->rand, 1, 4));
                }
            }
        }
        check_model(m, "after scanning");
        m->evacuating += m->s->pool != NULL && pf_pool_n_evacuating(m->s->pool) > 0;
        fuzz_events(m, &layout);
        for (guint i = 0; i < m->vms->len; i++) {
            ModelVm *mv = g_ptr_array_index(m->vms, i);

            if (mv->vm != NULL) {
                fuzz_writes(m, mv);
            }
        }
        /* Exits show on pidfds: VMs detached, leftovers put back. */
        while (g_main_context_iteration(NULL, FALSE)) {
        }
        check_model(m, "after events");
    }
    g_test_message("%s: %u VMs, %u moves, %u step-backs, %u scans left a chunk to empty, "
                   "%u regions joined, %u gone",
                   m->context, m->n_made, m->moves, m->stepped_back, m->evacuating, m->joined,
                   m->gone);
    model_end(m);
    model_free(m);
}

/* Two seeds a mode keep this to seconds, under ASan too; -m slow runs 64,
 * and SCAN_MODEL_SEED=N the one a failure names. */
static void
test_fuzz(gconstpointer data)
{
    const FuzzMode *mode = data;
    const char *one = g_getenv("SCAN_MODEL_SEED");
    guint32 first = 1, last = g_test_slow() ? 64 : 2;

    if (one != NULL) {
        first = last = (guint32)g_ascii_strtoull(one, NULL, 10);
    }
    for (guint32 seed = first; seed <= last; seed++) {
        fuzz_one(mode, seed);
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_log_set_handler(G_LOG_DOMAIN, G_LOG_LEVEL_MESSAGE | G_LOG_LEVEL_INFO | G_LOG_LEVEL_DEBUG,
                      quiet, NULL);
    g_test_add_func("/scan-model/step-back-during-move", test_step_back_during_move);
    g_test_add_data_func("/scan-model/agent-gone-during-move/hung-up", GINT_TO_POINTER(FALSE),
                         test_agent_gone_during_move);
    g_test_add_data_func("/scan-model/agent-gone-during-move/exited", GINT_TO_POINTER(TRUE),
                         test_agent_gone_during_move);
    g_test_add_func("/scan-model/last-agent-gone-while-settling",
                    test_last_agent_gone_while_settling);
    g_test_add_func("/scan-model/moves-per-arrival", test_moves_per_arrival);
    g_test_add_func("/scan-model/detached-pins-chunk", test_detached_pins_chunk);
    g_test_add_func("/scan-model/evacuate", test_evacuate);
    g_test_add_func("/scan-model/full-nodes", test_full_nodes);
    g_test_add_func("/scan-model/crowded-content", test_crowded_content);
    g_test_add_func("/scan-model/region-gone-merged", test_region_gone_merged);
    g_test_add_data_func("/scan-model/region-gone-in-flight/refused", GINT_TO_POINTER(FALSE),
                         test_region_gone_in_flight);
    g_test_add_data_func("/scan-model/region-gone-in-flight/lying", GINT_TO_POINTER(TRUE),
                         test_region_gone_in_flight);
    g_test_add_func("/scan-model/region-gone-during-move", test_region_gone_during_move);
    g_test_add_func("/scan-model/region-gone-frees-chunk", test_region_gone_frees_chunk);
    g_test_add_func("/scan-model/merge-domain-mid-pass", test_merge_domain_mid_pass);
    g_test_add_func("/scan-model/adopt-refused", test_adopt_refused);
    g_test_add_func("/scan-model/ids-reused", test_ids_reused);
    g_test_add_func("/scan-model/joins-within-pass", test_joins_within_pass);
    g_test_add_func("/scan-model/written-back-waits", test_written_back_waits);
    for (gsize i = 0; i < G_N_ELEMENTS(fuzz_modes); i++) {
        g_autofree char *path = g_strdup_printf("/scan-model/fuzz/%s", fuzz_modes[i].name);

        g_test_add_data_func(path, &fuzz_modes[i], test_fuzz);
    }
    return g_test_run();
}
