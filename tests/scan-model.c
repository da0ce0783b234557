/*
 * scan-model.c - the model scan-model-test.c's cases are told through
 * (scan-model.h): the real scanner, linked as pagefoldd links it, played
 * at the boundary the agent link plays it at.  The model's agents drain
 * each VM's outbox (outbox.h) when its drain callback says there is
 * something to send, take the chunks and drops the scanner's listener
 * call tells of, and answer through pf_scanner_answer().  The model plays
 * the copy on write that pagefoldd finds in pagemap (cow_found());
 * nothing of the scanner is replaced.  Its agents act as the real one
 * does, on the guest's memfd: they compare the page with its slot, punch
 * a merged page out of the memfd, write it back when unmerged or when
 * they step back to advise mode; and they answer as each test says,
 * honestly, with the errors a real agent meets, or lying, or go (hang
 * up, or their process exits) with requests unanswered.  Everything else
 * is real: the outboxes, the pool's sealed memfd chunks, the trees, the
 * scanner, and the VMs, agents' VMs of child processes that hold memfd
 * guest RAM (guestmem.h).  Pages merged here are not remapped, so a
 * guest's write lands in its memfd, and the model tells the scanner of
 * the copy on write itself.
 *
 * Owns the model's VMs, guests and agents, and setting the model up and
 * ending it.  Must never write the scanner's records (scan-core.h), only
 * read them, and call the scanner only as the layers above it do
 * (link.c, the control socket): a model that reached in would test
 * itself, not pagefoldd.  Its agents must never act but as a real agent
 * could, on what they were sent.
 */
#include "scan-model.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "jobs.h"

/* ---- the agents: what they do with what they are sent ---- */

Model *model;

static void
batch_free(ModelBatch *b)
{
    g_array_unref(b->items);
    g_array_unref(b->pending);
    g_free(b);
}

ModelVm *
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

ModelRegion *
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

/* What each VM's open batch holds (a background batch's requests wait
 * there to be ripe). */
static GArray *
queued_now(void)
{
    GArray *q = g_array_new(FALSE, TRUE, sizeof(gsize));

    g_array_set_size(q, model->vms->len);
    for (guint i = 0; i < model->vms->len; i++) {
        ModelVm *mv = g_ptr_array_index(model->vms, i);

        if (mv->vm != NULL) {
            g_array_index(q, gsize, i) = pf_outbox_n_queued(mv->vm->outbox);
        }
    }
    return q;
}

/* Whatever an answer asked for went out as it ended, to this VM's agent
 * or another's (a node that moved): nothing it queued waits for a scan to
 * send it, where a scan-now job between passes would wait for it for
 * good. */
static void
assert_nothing_queued(GArray *before)
{
    for (guint i = 0; i < model->vms->len && i < before->len; i++) {
        ModelVm *mv = g_ptr_array_index(model->vms, i);

        if (mv->vm != NULL) {
            g_assert_cmpuint(pf_outbox_n_queued(mv->vm->outbox), <=,
                             g_array_index(before, gsize, i));
        }
    }
}

/* The agent answers up to max of the batches it was sent, in order. */
void
answer_batches(ModelAgent *l, guint max)
{
    PfVm *vm = l->vm;

    for (guint n = 0; n < max && !g_queue_is_empty(&l->in_flight); n++) {
        ModelBatch *b = g_queue_peek_head(&l->in_flight);
        g_autofree PfWireResult *res = NULL;
        g_autoptr(GArray) before = NULL;

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
        before = queued_now();
        pf_scanner_answer(model->s, vm, res, b->items->len);
        batch_free(b);
        assert_nothing_queued(before);
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

void
model_detach(Model *m, ModelVm *mv, const char *why)
{
    m->detaching = mv->vm;
    pf_scanner_detach(m->s, mv->vm, why);
    m->detaching = NULL;
}

Model *
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

void
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

ModelVm *
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
guint
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
void
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

void
model_exit(ModelVm *mv)
{
    pf_guest_release(mv->pid);
    mv->pid = 0;
}

/* The agent folds its merged pages back into the memfd, then says so. */
void
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
void
agent_ends(Model *m, ModelVm *mv, gboolean exits)
{
    if (exits) {
        model_exit(mv);
    }
    model_detach(m, mv, exits ? "its process exited" : "its agent hung up");
}

/* The guest writes a page.  A merged page copies on write, which
 * pagefoldd finds in pagemap at its next look: here, at once. */
void
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
void
guest_discards(Model *m, ModelVm *mv, guint region, gsize first, gsize n)
{
    ModelRegion *mr = model_region(mv, region);

    g_assert_cmpint(fallocate(mr->guest->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              (off_t)(first * PF_PAGE_SIZE), (off_t)(n * PF_PAGE_SIZE)), ==, 0);
    memset(mr->content + first * PF_PAGE_SIZE, 0, n * PF_PAGE_SIZE);
    memset(mr->merged + first, 0, n * sizeof(gboolean));
    memset(mr->kept + first, 0, n * sizeof(gboolean));
    pf_scanner_discarded(m->s, mv->vm, region, first, n, FALSE);
}

void
run_passes(Model *m, guint n, const char *when)
{
    for (guint i = 0; i < n; i++) {
        pf_scan_job_run_passes_wait(m->s, 1);
        check_model(m, when);
    }
}

/* Detached VMs whose processes exited: pagefoldd puts back what they
 * held when their pidfd says so, on its main loop. */
void
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
void
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

void
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

PfCounters
totals(Model *m)
{
    PfCounters total;
    g_autofree PfCounters *per_vm = g_new0(PfCounters, MAX(1, m->s->vms.list->len));

    pf_scanner_collect(m->s, &total, per_vm);
    return total;
}

/* ---- earlier pagefoldds' merged pages ---- */

const PfLayout identical_only = { .identical = N_IDENTICAL };

/* A guest whose agent merged every page of its RAM to the slots of an
 * earlier pagefoldd's pool, slots[i] for page i (one chunk), then
 * connects to this one: attached with what its region check found. */
ModelVm *
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
void
wait_adopted(Model *m)
{
    gint64 deadline = g_get_monotonic_time() + 10 * G_USEC_PER_SEC;

    while (m->s->adopt.source != 0 || g_main_context_pending(NULL)) {
        g_assert_cmpint(g_get_monotonic_time(), <, deadline);
        g_main_context_iteration(NULL, FALSE);
    }
}
