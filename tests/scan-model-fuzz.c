/*
 * scan-model-fuzz.c - the model (scan-model.h) driven at random:
 * /scan-model/fuzz/MODE, rounds of scans and batches, agents' answers
 * (honest with a real agent's errors, or lying), their steps back and
 * ends, VMs and RAM coming and going, guests writing and ballooning, the
 * model checked after each round's scan and after its events.
 *
 * Owns the fuzz's modes, its events and its seeds.  Must never draw from
 * anything but the model's GRand, seeded with the run's seed: a failure
 * names its seed, and SCAN_MODEL_SEED=N makes the same draws again (where
 * time slices end is the only other chance in it).  Never takes a step a
 * case could not: everything goes through the model's calls, so that what
 * it finds a case can tell again.
 */
#include "scan-model.h"

#include <errno.h>
#include <string.h>

#include "jobs.h"
#include "scan-helpers.h"

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

/* A real agent's failures: a page in DMA, a back-end settling, an I/O error, out of mappings.
 * A lying one answers anything, for anything. */
static void
fuzz_answer(ModelAgent *l, const PfWireItem *item, const PfPending *pd,
            PfResultStatus *status, int *err)
{
    static const int errs[] = { EBUSY, EIO, ENOMEM, EPERM, EFAULT, EINPROGRESS };
    guint x = g_rand_int_range(model->rand, 0, 100);

    if (model->lying) {
        *status = (PfResultStatus)g_rand_int_range(model->rand, 0, 3);
        *err = *status == PF_RESULT_ERROR
                   ? errs[g_rand_int_range(model->rand, 0, G_N_ELEMENTS(errs))] : 0;
        return;
    }
    if (*status != PF_RESULT_DONE || !pf_vm_merges(l->vm)) {
        return;
    }
    /* A quarter of the refusals of merge and zero items are a back-end
     * settling, which the agent answers for those alone. */
    if (x < 8) {
        *status = PF_RESULT_ERROR;
        *err = x >= 6 && (item->kind == PF_ITEM_MERGE || item->kind == PF_ITEM_ZERO)
                   ? EINPROGRESS : EBUSY;
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
    return some->len == 0
               ? NULL
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
            ModelVm *o = g_ptr_array_index(m->vms,
                                           g_rand_int_range(m->rand, 0, (gint32)m->vms->len));
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

void
scan_model_add_fuzz(void)
{
    for (gsize i = 0; i < G_N_ELEMENTS(fuzz_modes); i++) {
        g_autofree char *path = g_strdup_printf("/scan-model/fuzz/%s", fuzz_modes[i].name);

        g_test_add_data_func(path, &fuzz_modes[i], test_fuzz);
    }
}
