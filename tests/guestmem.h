/*
 * guestmem.h - synthetic guest RAM for the tests and benchmarks: a memfd
 * mapped shared, exactly as QEMU maps memory-backend-memfd,share=on, filled
 * with a known layout.  Not a VMM: the stand-in guest (standin-guest.c) and
 * the test programs map these and pagefoldd attaches to their pid.
 *
 * Page kinds, in this order within the memfd:
 *   identical  same content in every guest (a function of the index only)
 *   duplicate  one content repeated (within a guest and across guests)
 *   unique     content of this guest only
 *   zero       all zero, written (allocated) by the guest
 *   volatile   rewritten by pf_guest_churn() between passes
 * Pages after those are never written: holes of the memfd.
 */
#pragma once

#include <glib.h>

typedef struct {
    gsize identical;
    gsize duplicate;
    gsize unique;
    gsize zero;
    gsize volatile_;
    gsize holes;
} PfLayout;

typedef struct {
    int fd;
    guint8 *mem;
    gsize n_pages;
    guint32 seed;
    PfLayout layout;
    guint64 generation;
} PfGuest;

gsize pf_layout_pages(const PfLayout *l);
/* Creates, maps (rw, shared) and fills a guest. */
PfGuest *pf_guest_new(const char *name, const PfLayout *l, guint32 seed);
/* huge: 2 MiB aligned and MADV_HUGEPAGE, as QEMU maps RAM for THP. */
PfGuest *pf_guest_new_full(const char *name, const PfLayout *l, guint32 seed, gboolean huge);
/* 2 MiB aligned, no advice: a guest smaller than 2 MiB lies in one 2 MiB
 * extent, which the agent folds back at once (tests that count what a
 * fold-back leaves must not depend on where mmap() put the guest). */
PfGuest *pf_guest_new_aligned(const char *name, const PfLayout *l, guint32 seed);
void pf_guest_free(PfGuest *g);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfGuest, pf_guest_free)

/* Rewrites every volatile page with content of the next generation; the
 * same generation gives the same content in every guest. */
void pf_guest_churn(PfGuest *g);
/* Fills one page from a 64-bit seed (xorshift); seed 0 gives zeros. */
void pf_fill_page(guint8 *page, guint64 seed);
guint64 pf_page_seed(int kind, guint32 guest, guint64 index, guint64 gen);

/* Forks a child that keeps only this guest's mapping (like a QEMU process
 * holding its RAM) and waits to be killed; it dies with the test. */
int pf_guest_hold(PfGuest *g);
/* Kills and reaps a holder. */
void pf_guest_release(int pid);
