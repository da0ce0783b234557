/*
 * agent-stepback.c - giving guest RAM back to plain memfd mappings, on the
 * VMM's word: the whole VM stepping back to advise mode (before
 * vhost-user, a migration or a pinning device uses its RAM), a region
 * leaving, a range about to be discarded; and the DISCARDs that tell
 * pagefoldd which pages are back in their memfd.  Folds back one 2 MiB
 * extent per hold of the locks, so that the guest, the VMM's DMA and its
 * discards go on meanwhile.  Never tells pagefoldd that a page is back
 * while it is still mapped from a pool slot: pagefoldd would reuse the
 * slot.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <unistd.h>

#define FOLD_CHUNK HUGE_PAGES /* pages folded back per hold of the locks */

/*
 * Folds back the remapped pages of region i (with copy, their content
 * too) a chunk at a time, holding work and dma, and write-protecting, one
 * chunk only: the guest writes elsewhere, and the VMM's DMA and discards
 * go on, meanwhile.  pagefoldd is told of every page back in its memfd.
 * The caller has made sure nothing merges there meanwhile (advise mode, a
 * region leaving).  Runs in DMA are left and -EBUSY returned at the end;
 * any other failure stops at once.  Called without work.
 */
int
pfa_fold_back_region(PfAgent *a, guint i, gboolean copy)
{
    gboolean busy = FALSE;
    gsize at = 0;
    int rc = 0;

    for (;;) {
        guint64 was[FOLD_CHUNK / 64] = { 0 };
        gsize first, n, stop;
        Region *r;

        g_mutex_lock(&a->work);
        /* The array may have lost a region never told (at its end). */
        if (i >= a->regions->len) {
            g_mutex_unlock(&a->work);
            break;
        }
        r = &g_array_index(a->regions, Region, i);
        first = r->gone ? r->n_pages
                        : pfa_find_remapped(r, at, r->n_pages, TRUE);
        if (first >= r->n_pages) {
            g_mutex_unlock(&a->work);
            break;
        }
        /*
         * To the end of first's 2 MiB extent: protecting a page splits its
         * huge mapping, and this extent's is split already.
         */
        n = MIN(FOLD_CHUNK - (gsize)((guintptr)(r->host + first *
                                                PF_PAGE_SIZE) /
                                     PF_PAGE_SIZE % FOLD_CHUNK),
                r->n_pages - first);
        for (gsize k = 0; k < n; k++) {
            was[k / 64] |= (guint64)pfa_is_remapped(r, first + k) << (k % 64);
        }
        if (copy && a->uffd < 0) {
            rc = -EBADF; /* no safe way to fold back any more */
        } else {
            rc = pfa_fold_back(a, r, first, n, copy, &stop, NULL);
        }
        pfa_tell_folded(a, i, first, n, was, FALSE);
        g_mutex_unlock(&a->work);
        if (rc == -EBUSY) {
            busy = TRUE;
            rc = 0;
        }
        if (rc < 0) {
            break;
        }
        at = first + n;
    }
    return rc < 0 ? rc : busy ? -EBUSY : 0;
}

/*
 * Folds back the first n regions, a chunk at a time, again after a
 * failure too: pages in DMA are left, and the other regions folded back
 * all the same; any other failure stops.  Returns the first failure, with
 * its region's name in *failed.  Called without work.
 */
int
pfa_fold_back_regions(PfAgent *a, guint n, char **failed)
{
    int rc = 0;

    for (guint i = 0; i < n; i++) {
        int rc1 = pfa_fold_back_region(a, i, TRUE);

        if (rc1 < 0 && rc == 0) {
            rc = rc1;
            g_mutex_lock(&a->work);
            *failed = g_strdup(i < a->regions->len
                               ? g_array_index(a->regions, Region, i).name
                               : "a region");
            g_mutex_unlock(&a->work);
        }
        if (rc1 < 0 && rc1 != -EBUSY) {
            break;
        }
    }
    return rc;
}

/*
 * What pagefoldd hears once the fold-back of a step back is over (rc):
 * ADVISE when every page came back; when some did not and the step back
 * is final, an ERROR, so that it lets go of this VM.  Called with work
 * held.
 */
static void
step_back_end(PfAgent *a, int rc, gboolean final)
{
    if (rc < 0 && final && a->advise_untold) {
        g_autofree char *text = g_strdup_printf(
            "cannot fold every merged page back (%s): this VM steps back "
            "with pages still merged", g_strerror(-rc));

        /*
         * pagefoldd is told what came back (DISCARD), not which pages
         * stay merged: it lets go of this VM, whose pool pages stay taken
         * while QEMU maps them.  A later call folds back the rest.
         */
        g_warning("pagefold agent: %s", text);
        pfa_post_error(a, text);
        pfa_set_connected(a, FALSE);
        a->advise_untold = FALSE;
    }
    if (rc == 0) {
        PfWireMode m = { a->version, PF_MODE_ADVISE, "" };

        if (a->uffd >= 0) {
            /*
             * Nothing of this VM is remapped any more; closing the
             * userfaultfd unregisters guest RAM, for whoever needs it
             * next.
             */
            close(a->uffd);
            a->uffd = -1;
        }
        pfa_backends_let_go(a);
        if (a->advise_untold && !a->ready) {
            /* READY says so: the next link's, or this one's to come. */
            a->advise_untold = FALSE;
        } else if (a->advise_untold) {
            pf_wire_set_string(m.reason, sizeof(m.reason), a->reason);
            pfa_post(a, PF_MSG_ADVISE, 0, &m, sizeof(m), -1);
            a->advise_untold = FALSE;
        }
    }
}

static gboolean
step_back(PfAgent *a, const char *reason, gboolean final, GError **error)
{
    g_autofree char *failed = NULL;
    guint n;
    int rc;

    g_mutex_lock(&a->work);
    if (a->advise_reason == NULL) {
        a->advise_reason = g_strdup(reason);
    }
    if (a->mode == PF_MODE_MERGE) {
        g_message("pagefold agent: VM %s steps back to advise mode: %s",
                  a->name, reason);
        pfa_set_mode(a, PF_MODE_ADVISE, reason);
        a->advise_untold = TRUE;
    }
    n = a->regions->len;
    g_mutex_unlock(&a->work);

    /* Nothing merges any more (advise mode). */
    rc = pfa_fold_back_regions(a, n, &failed);

    g_mutex_lock(&a->work);
    step_back_end(a, rc, final);
    g_mutex_unlock(&a->work);
    if (rc < 0) {
        /*
         * What did not come back stays merged and valid; the caller must
         * refuse whoever needed plain RAM.
         */
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "pagefold: cannot fold merged pages of %s back into its "
                    "memfd: %s", failed, g_strerror(-rc));
        return FALSE;
    }
    return TRUE;
}

gboolean
pf_agent_step_back(PfAgent *a, const char *reason, GError **error)
{
    return step_back(a, reason, TRUE, error);
}

gboolean
pf_agent_step_back_try(PfAgent *a, const char *reason)
{
    return step_back(a, reason, FALSE, NULL);
}

void
pf_agent_discard(PfAgent *a, void *host, gsize len)
{
    guint8 *lo = host, *hi = lo + len;

    g_mutex_lock(&a->work);
    for (guint i = 0; i < a->regions->len; i++) {
        Region *r = &g_array_index(a->regions, Region, i);
        gsize first, end, stop, folded = 0;
        PfWireRange wr = { i, 0, 0, 0 };
        int rc;

        if (r->gone || hi <= r->host || lo >= r->host + r->size) {
            continue;
        }
        first = (gsize)(MAX(lo, r->host) - r->host) / PF_PAGE_SIZE;
        end = (gsize)(MIN(hi, r->host + r->size) - r->host +
                      PF_PAGE_SIZE - 1) / PF_PAGE_SIZE;
        if (pfa_find_remapped(r, first, end, TRUE) == end) {
            continue;
        }
        rc = pfa_fold_back(a, r, first, end - first, FALSE, &stop, &folded);
        g_mutex_lock(&a->lock);
        a->stats.discarded += folded;
        g_mutex_unlock(&a->lock);
        if (rc < 0) {
            /*
             * The discard misses the pages from stop on: they keep their
             * content and their pool slots, which pagefoldd must not
             * hear of as free.
             */
            g_warning("pagefold agent: cannot map %s from its memfd again "
                      "before a discard: %s", r->name, g_strerror(-rc));
        }
        wr.page = first;
        wr.n_pages = stop - first;
        if (wr.n_pages > 0 && a->ready) {
            pfa_post(a, PF_MSG_DISCARD, 0, &wr, sizeof(wr), -1);
        }
    }
    g_mutex_unlock(&a->work);
}
