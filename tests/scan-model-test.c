/*
 * scan-model-test.c - the scanner's pool accounting under a model of its
 * agents: after every step, each pool slot's references are exactly those
 * pagefoldd can account for, and once every VM is gone the pool is empty.
 *
 * The cases, each a story told through the model (scan-model.h: its
 * agents and guests in scan-model.c, the checks after every step in
 * scan-model-check.c, the fuzz in scan-model-fuzz.c), and main().  They
 * read the scanner's state through scan-core.h (white-box: the stable
 * nodes, the leftovers, the waiting joins) and lower a seam of its now
 * and then (setup's adopt_max_sharers).
 *
 * Owns the cases and the order they run in.  Must never play an agent's
 * or a guest's part but through the model (its calls, and the answer and
 * before_answer hooks), nor replace anything of the scanner: what a case
 * shows must be what pagefoldd does with a real agent.
 */
#include <string.h>
#include <unistd.h>

#include "jobs.h"
#include "scan-helpers.h"
#include "scan-model.h"

/* ---- the cases ---- */

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

/* pagefoldd's messages are many here, and none is news: shown with
 * --verbose. */
static void
quiet(const char *domain, GLogLevelFlags level, const char *message, gpointer user)
{
    if (g_test_verbose()) {
        g_log_default_handler(domain, level, message, user);
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
    /* /scan-model/fuzz/MODE, the slowest, last (scan-model-fuzz.c). */
    scan_model_add_fuzz();
    return g_test_run();
}
