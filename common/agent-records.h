/*
 * agent-records.h - what the agent library's files share, and nothing
 * outside them may use (a VMM has agent.h): the agent's state, its
 * regions, pool chunks and DMA ranges, the order of its locks, and the
 * functions one file offers the others.  Every .c file of the agent
 * includes it first.
 *
 * The rule each of those files keeps on failure: guest RAM stays exactly as
 * the guest last wrote it, and what is reported to pagefoldd is what is
 * true (a page still mapped from a pool slot is never reported as not
 * merged: pagefoldd would reuse its slot).  Every system call that changes
 * guest RAM goes through a->sys, so that tests can make each one fail;
 * every result is checked.
 *
 * Locks, when nested: work, then dma, then lock; work, then out.  lock
 * and out are held only around a few fields, never while taking another.
 *
 * The names shared between the files begin with pfa_: QEMU links this
 * library into one executable with all of its own code.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#pragma once

/*
 * The library's messages, in the VMM's log too (QEMU routes this domain to
 * its own).
 */
#ifndef G_LOG_DOMAIN
#define G_LOG_DOMAIN "pagefold"
#endif

#include "agent.h"

#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

#define HUGE_PAGES 512u /* 4 KiB pages in a 2 MiB huge page */

typedef struct {
    char *name;
    guint8 *host;
    gsize size;
    gsize n_pages;
    int fd;
    guint64 offset;
    int advice[4];
    guint64 *remapped; /* bitmap: pages mapped from the pool */
    /*
     * why this region is not merged (its memfd cannot be remapped here, or
     * write protection refused it), or NULL
     */
    char *refused;
    /*
     * left the VM: no memfd, no bitmap; its index stays, since pagefoldd never
     * reuses one
     */
    gboolean gone;
    gboolean gone_untold; /* gone before READY: GONE follows READY */
    gboolean leaving;     /* being folded back to go: no merge there */
} Region;

typedef struct {
    int fd;
    const guint8 *map; /* PROT_READ, for the compare */
    guint32 n_slots;
} Chunk;

typedef struct {
    const guint8 *lo, *hi;
} DmaRange;

typedef struct _PfBackend PfBackend; /* agent-backend.c's */

struct _PfAgent {
    char *name;
    guint8 uuid[16];
    GArray *regions; /* Region; grows under work, never shrinks */
    guint announced; /* regions pagefoldd has been told of */
    gboolean ready;  /* READY is queued: new regions are told at once */
    /*
     * HELLO is queued and READY not yet: pagefoldd reads the mappings of
     * guest RAM, and they must hold still (no back-end's fold-back)
     */
    gboolean linking;
    char *advise_reason;
    gboolean advise_untold; /* stepped back: ADVISE once all is folded */
    PfAgentSyscalls sys;

    int sock;
    /*
     * pagefoldd's queue was full: the agent thread connects, trying again
     * until it may
     */
    char *connect_to;
    char *socket_path; /* pagefoldd's, connected to again when it goes */
    /* either side said ERROR: not connected again (under work) */
    gboolean parted;
    int relink_ms;     /* the last wait before connecting again */
    guint32 version;   /* of the link, as WELCOME said (under work) */
    int uffd;
    gboolean uffd_lost; /* closed because protection could not be lifted */
    /* /dev/userfaultfd as pagefoldd last passed it, for back-ends, or -1 */
    int uffd_dev;
    GPtrArray *chunks;  /* Chunk*, indexed by chunk id, NULL where unknown */

    PfAgentThreads threads;
    void *thread;
    int stop[2];
    int wake[2]; /* something was queued for pagefoldd */
    /*
     * held while pages are remapped or folded back, and while what pagefoldd
     * must hear of it is queued: the outbox is in the order it happened.
     * Never held while waiting for pagefoldd: the VMM's threads take it (a
     * discard under QEMU's big lock), and pagefoldd may be stuck
     */
    GMutex work;
    /*
     * the ranges in DMA; held across every change of a mapping, so that a new
     * DMA waits for it (lock order: work, then dma)
     */
    GMutex dma;
    GArray *dma_ranges; /* DmaRange, one per mapping the VMM made */
    GArray *written;    /* DmaRange: what devices wrote, untold (under dma) */
    GMutex out;  /* outbox, posting */
    GQueue outbox;      /* Outgoing*, sent by the agent thread alone */
    /*
     * the link takes messages: from the connect until it ends, or an ERROR is
     * queued
     */
    gboolean posting;
    gboolean hangup;    /* an ERROR is queued: shut the link after it */
    /*
     * agent-backend.c's, under work: the back-ends attached, those removed
     * (closed by the fault thread, which may be polling them), and that
     * thread
     */
    GPtrArray *backends;
    GPtrArray *backends_gone;
    void *fault_thread;
    int fault_wake[2];
    gboolean fault_stop;
    GMutex lock; /* stats, connected, settled, mode, reason */
    GCond settled_cond;
    gboolean settled;   /* the handshake ended, one way or the other */
    char *start_error;  /* why it failed, or NULL */
    PfMode mode;        /* changes under work and lock */
    char *reason;
    PfAgentStats stats;
    gboolean connected;
};

/* agent.c: calls no agent-*.c file but agent-pool.c's and
 * agent-outbox.c's freeing functions, so that the others may call it */
void pfa_set_connected(PfAgent *a, gboolean connected);
void pfa_set_mode(PfAgent *a, PfMode mode, const char *reason);
void pfa_region_clear(Region *r);

/* agent-outbox.c */
void pfa_post(PfAgent *a, PfMsgType type, guint32 seq, const void *payload,
              gsize length, int fd);
/* ERROR, and the agent parts from pagefoldd for good.  With work held. */
void pfa_post_error(PfAgent *a, const char *text);
gboolean pfa_flush(PfAgent *a, GError **error);
void pfa_outgoing_free(gpointer p);
void pfa_outbox_discard(PfAgent *a);
/* Pages of HINTs sent (told) and not (dropped), into the stats. */
void pfa_count_hints(PfAgent *a, guint64 told, guint64 dropped);
/*
 * Tells pagefoldd (DISCARD) which pages of region i in [from, from + n)
 * are back in their memfd: those remapped in was (bit k: page from + k)
 * and not any more; backend: because a back-end touched them.  With work
 * held.
 */
void pfa_tell_folded(PfAgent *a, guint i, gsize from, gsize n,
                     const guint64 *was, gboolean backend);

/* agent-uffd.c */
int pfa_uffd_ioctl(PfAgent *a, unsigned long request, void *arg);
int pfa_uffd_register(PfAgent *a, void *addr, gsize len);
int pfa_uffd_hold(PfAgent *a, guint8 *addr, gsize len);
/*
 * Write-protects (on) or lifts [addr, addr + len) of the userfaultfd fd's
 * process: a->uffd's, or a back-end's.
 */
int pfa_uffd_protect(PfAgent *a, int fd, guint64 addr, gsize len, gboolean on);
void pfa_uffd_done(PfAgent *a, guint8 *addr, gsize len, gboolean lift);
void pfa_uffd_release(PfAgent *a, guint8 *addr, gsize len);
void pfa_region_protect(PfAgent *a, Region *r);
void pfa_say_refused(PfAgent *a, const Region *r);
gboolean pfa_uffd_setup(PfAgent *a, int dev_fd, char **why);
/*
 * The userfaultfd made for an earlier link: every region write-protected
 * again (those plugged in since too), as pfa_uffd_setup() does; on
 * failure, why, the userfaultfd kept (merged pages may need it to fold
 * back).
 */
gboolean pfa_uffd_resume(PfAgent *a, char **why);

/* agent-dma.c */
gboolean pfa_in_dma(PfAgent *a, const guint8 *lo, const guint8 *hi);
/* What devices wrote since the last call is queued for pagefoldd (HINT),
 * once READY is; dropped before.  On the agent thread, work not held. */
void pfa_post_written(PfAgent *a);

/* agent-remap.c */
extern const guint8 pfa_zero_page[PF_PAGE_SIZE];

static inline gboolean
pfa_is_remapped(const Region *r, gsize page)
{
    return (r->remapped[page / 64] >> (page % 64)) & 1;
}

gsize pfa_mark_remapped(PfAgent *a, Region *r, gsize from, gsize to,
                        gboolean on);
gsize pfa_find_remapped(const Region *r, gsize from, gsize to, gboolean want);
int pfa_fold_back_locked(PfAgent *a, Region *r, gsize first, gsize n,
                         gboolean copy, gsize *stop, gsize *folded);
int pfa_fold_back(PfAgent *a, Region *r, gsize first, gsize n, gboolean copy,
                  gsize *stop, gsize *folded);
void pfa_fold_back_items(PfAgent *a, Region *r, const PfWireItem *items,
                         guint32 n, int *rcs);
int pfa_remap_run(PfAgent *a, Region *r, gsize from, gsize to, const Chunk *c,
                  guint32 slot);

/*
 * agent-link.c: one message of pagefoldd's, checked by pf_proto_recv(),
 * done (the agent thread's serve(), and the fuzzer's seam).
 */
gboolean pfa_dispatch(PfAgent *a, PfMsg *msg, GError **error);

/* agent-items.c */
gboolean pfa_handle_request(PfAgent *a, const PfMsg *msg, GError **error);

/* agent-pool.c */
Chunk *pfa_held_chunk(PfAgent *a, guint32 id);
gboolean pfa_take_chunk(PfAgent *a, PfMsg *msg, GError **error);
gboolean pfa_drop_chunk(PfAgent *a, const PfMsg *msg, GError **error);
void pfa_chunk_free(gpointer p);

/* agent-regions.c */
void pfa_region_join(PfAgent *a, guint i, gboolean protect);

/* agent-backend.c: with work held, but for init, clear and stop */
void pfa_backends_init(PfAgent *a);
void pfa_backends_clear(PfAgent *a);
/* Joins the fault thread and drops every back-end.  Without work. */
void pfa_backends_stop(PfAgent *a);
/*
 * Every back-end's mappings of [addr, addr + len) write-protected, after
 * the VMM's: 0, or -errno with none protected (a back-end expected,
 * changing its mappings or gone without unmapping them: -EINPROGRESS; one
 * whose protection could not be lifted: -EIO).
 */
int pfa_backends_hold(PfAgent *a, const guint8 *addr, gsize len);
void pfa_backends_release(PfAgent *a, const guint8 *addr, gsize len);
/* Nothing is remapped any more, for good: the back-ends' ranges are
 * unregistered, and a fault of theirs still taken (a mapping not told
 * yet) finds the page as the kernel fills it. */
void pfa_backends_let_go(PfAgent *a);

/* agent-stepback.c */
int pfa_fold_back_region(PfAgent *a, guint i, gboolean copy);
/*
 * The first n regions, pages in DMA left for later; the first failure,
 * its region's name in *failed.  Without work.
 */
int pfa_fold_back_regions(PfAgent *a, guint n, char **failed);
