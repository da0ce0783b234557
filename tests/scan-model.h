/*
 * scan-model.h - the model of the scanner's agents and guests that
 * scan-model-test.c's cases are told through: its records, and the calls
 * shared by the files that make it up: scan-model.c (the agents and the
 * guests, setting the model up and ending it), scan-model-check.c (what
 * is asserted after every step) and scan-model-fuzz.c (the model driven
 * at random).
 *
 * Owns the model's records.  Must never be included but by those files
 * and scan-model-test.c: it brings in scan-core.h, the scanner core's own
 * records, which only white-box tests may read.
 */
#pragma once

#include <glib.h>

#include "guestmem.h"
#include "scan-core.h"

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

/* A guest: the process holding its RAM, and its VM and agent while
 * attached. */
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

/* The model: the scanner, every guest, how the case has the agents
 * answer, and what happened, for the log. */
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
extern Model *model;

/* Pages every guest has: 1 MiB, the smallest region vm.c takes. */
#define N_IDENTICAL 256
extern const PfLayout identical_only;

/* ---- scan-model.c: the agents ---- */

/* The model's record of an attached VM, or NULL. */
ModelVm *model_vm_of(PfVm *vm);
/* The region of the agent's index (asserted to exist). */
ModelRegion *model_region(ModelVm *mv, guint index);
/* The agent answers up to max of the batches it was sent, in order; it
 * may go before it is done (before_answer). */
void answer_batches(ModelAgent *l, guint max);

/* ---- scan-model.c: setting up, ending ---- */

/* The model, its scanner with smart_scan off (every page visited at
 * every pass) and its listener; one at a time. */
Model *model_new(void);
/* A guest of layout, held by a child process, attached with its agent in
 * merge mode. */
ModelVm *model_add_vm(Model *m, const PfLayout *layout, guint32 seed);
/* A guest of identical_only whose agent merged every page to slots[i] of
 * an earlier pagefoldd's pool old (one chunk), attached with what its
 * region check found. */
ModelVm *model_add_vm_merged(Model *m, PfPool *old, const guint32 *slots, guint32 seed);
/* The VM attached again, with a new agent, as link.c makes it at READY. */
void model_attach(Model *m, ModelVm *mv);
/* pagefoldd detaches the VM; the model expects it. */
void model_detach(Model *m, ModelVm *mv, const char *why);
/* The process holding the VM's RAM exits. */
void model_exit(ModelVm *mv);
/* RAM plugged into the VM; returns its region's index. */
guint model_region_join(Model *m, ModelVm *mv, const PfLayout *layout, guint32 seed);
/* RAM unplugged: folded back into its memfd, then GONE. */
void model_region_gone(Model *m, ModelVm *mv, guint index);
/* The agent folds its merged pages back, then steps back to advise. */
void model_step_back(Model *m, ModelVm *mv, const char *why);
/* The agent goes: it hung up, or (exits) its process exited. */
void agent_ends(Model *m, ModelVm *mv, gboolean exits);
/* The guest writes a page; a merged one copies on write, which pagefoldd
 * is told of at once. */
void guest_writes(Model *m, ModelVm *mv, guint region, gsize idx, const guint8 *data);
/* The guest gives pages back (a balloon), and its agent says so. */
void guest_discards(Model *m, ModelVm *mv, guint region, gsize first, gsize n);
/* n passes, the model checked after each. */
void run_passes(Model *m, guint n, const char *when);
/* Until every leftover of an exited process is put back (10 s at most). */
void wait_for_leftovers(Model *m);
/* Until the scanner has taken back every page it will, and the agents
 * answered what that asked (10 s at most). */
void wait_adopted(Model *m);
/* Every process exits and every VM goes: asserts the pool is empty. */
void model_end(Model *m);
void model_free(Model *m);
/* The scanner's counters, over every VM. */
PfCounters totals(Model *m);

/* ---- scan-model-check.c ---- */

/* Asserts the accounting after a step (when: the step, for the log). */
void check_model(Model *m, const char *when);

/* ---- scan-model-fuzz.c ---- */

/* Adds /scan-model/fuzz/MODE, for each of its modes. */
void scan_model_add_fuzz(void);
