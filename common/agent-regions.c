/*
 * agent-regions.c - the VM's list of guest RAM regions: added before the
 * start or plugged in later, told to pagefoldd (REGION, GONE), given new
 * advice, removed, and listed for the VMM.  A region's index is
 * pagefoldd's name for it: once told, an index is never reused, and a
 * region leaves only after its merged pages are folded back, or with the
 * link to pagefoldd given up (its pool slots must never be freed while
 * the VM still maps them).
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

/*
 * Tells pagefoldd of region i, write-protected first (protect) when this
 * VM merges.  Every region is told, refused ones too: pagefoldd counts
 * indexes.
 */
void
pfa_region_join(PfAgent *a, guint i, gboolean protect)
{
    Region *r = &g_array_index(a->regions, Region, i);
    PfWireRegion wr = { 0 };

    if (protect && a->mode == PF_MODE_MERGE && !r->gone) {
        pfa_region_protect(a, r);
        if (r->refused != NULL) {
            pfa_say_refused(a, r);
        }
    }
    wr.index = i;
    wr.page_size = PF_PAGE_SIZE;
    wr.host_addr = (guint64)(guintptr)r->host;
    wr.size = r->size;
    wr.offset = r->offset;
    pf_wire_set_string(wr.name, sizeof(wr.name), r->name);
    if (!r->gone) {
        pfa_post(a, PF_MSG_REGION, 0, &wr, sizeof(wr), r->fd);
    } else {
        /*
         * Its index stays taken: announced as gone (a link after the
         * first, or a region that left before any).
         */
        PfWireRange gone = { i, 0, 0, r->n_pages };

        pfa_post(a, PF_MSG_GONE, 0, &gone, sizeof(gone), -1);
        r->gone_untold = FALSE;
    }
    a->announced = MAX(a->announced, i + 1);
}

gboolean
pf_agent_add_region(PfAgent *a, const PfAgentRegion *r, GError **error)
{
    Region reg = { 0 };

    reg.fd = fcntl(r->fd, F_DUPFD_CLOEXEC, 3);
    if (reg.fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "region %s: cannot keep its memfd: %s", r->name,
                    g_strerror(errno));
        return FALSE;
    }
    reg.host = r->host;
    reg.size = r->size;
    reg.n_pages = r->size / PF_PAGE_SIZE;
    reg.offset = r->offset;
    reg.remapped = g_new0(guint64, (reg.n_pages + 63) / 64);
    memcpy(reg.advice, r->advice, sizeof(reg.advice));
    reg.advice[G_N_ELEMENTS(reg.advice) - 1] = 0;

    g_mutex_lock(&a->work);
    for (guint i = 0; i < a->regions->len; i++) {
        const Region *o = &g_array_index(a->regions, Region, i);

        if (!o->gone && o->host < reg.host + reg.size &&
            reg.host < o->host + o->size) {
            g_mutex_unlock(&a->work);
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "region %s overlaps region %s, which the agent has "
                        "already", r->name, o->name);
            close(reg.fd);
            g_free(reg.remapped);
            return FALSE;
        }
    }
    /* pagefoldd wants a name to show; QEMU's spare backends have none. */
    reg.name = r->name != NULL && *r->name
               ? g_strdup(r->name)
               : g_strdup_printf("region%u", a->regions->len);
    g_array_append_val(a->regions, reg);
    /*
     * Before the handshake's HELLO it is in the HELLO; during the
     * handshake it follows READY; after, it goes now.
     */
    if (a->ready) {
        pfa_region_join(a, a->regions->len - 1, TRUE);
    }
    g_mutex_unlock(&a->work);
    return TRUE;
}

/*
 * Marks the region at host leaving, so that nothing merges there while it
 * is folded back: TRUE, with its index in *index.  FALSE when there is
 * nothing to fold back: no such region, or one pagefoldd never heard of
 * (so nothing of it is merged), which goes at once, its index with it,
 * since that is nobody's yet.
 */
static gboolean
region_leave(PfAgent *a, void *host, guint *index)
{
    gboolean fold = FALSE;
    guint i;

    g_mutex_lock(&a->work);
    for (i = 0; i < a->regions->len; i++) {
        Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone && !r->leaving && r->host == host) {
            break;
        }
    }
    if (i < a->regions->len && i >= a->announced) {
        pfa_region_clear(&g_array_index(a->regions, Region, i));
        g_array_remove_index(a->regions, i);
    } else if (i < a->regions->len) {
        g_array_index(a->regions, Region, i).leaving = TRUE;
        fold = TRUE;
    }
    g_mutex_unlock(&a->work);
    *index = i;
    return fold;
}

/*
 * Region i, folded back (rc 0) or not (memory about to be freed), leaves
 * for good: pagefoldd hears GONE, the userfaultfd forgets it, its memfd
 * is closed.  Called with work held.
 */
static void
region_gone(PfAgent *a, guint i, int rc)
{
    Region *r = &g_array_index(a->regions, Region, i);
    PfWireRange gone = { 0 };

    if (rc < 0) {
        g_autofree char *text = g_strdup_printf(
            "region %s goes with pages still mapped from the pool: %s",
            r->name, g_strerror(-rc));

        /*
         * The VMM unmaps it next, pool mappings and all.  Until then their
         * slots must stay theirs: pagefoldd lets go of this VM rather
         * than free them.
         */
        g_warning("pagefold agent: %s", text);
        pfa_post_error(a, text);
        pfa_set_connected(a, FALSE);
        pfa_mark_remapped(a, r, 0, r->n_pages, FALSE);
    }
    if (a->uffd >= 0 && r->refused == NULL) {
        struct uffdio_range range = { (guint64)(guintptr)r->host, r->size };

        /*
         * Left registered, it would refuse the next userfaultfd
         * (postcopy) there; nothing there is protected any more.
         */
        rc = pfa_uffd_ioctl(a, UFFDIO_UNREGISTER, &range);
        if (rc < 0) {
            g_warning("pagefold agent: cannot unregister %s: %s", r->name,
                      g_strerror(-rc));
        }
    }
    gone.region = i;
    gone.n_pages = r->n_pages;
    if (a->ready) {
        pfa_post(a, PF_MSG_GONE, 0, &gone, sizeof(gone), -1);
    } else {
        r->gone_untold = TRUE;
    }
    close(r->fd);
    r->fd = -1;
    g_clear_pointer(&r->remapped, g_free);
    r->gone = TRUE;
    r->leaving = FALSE;
}

gboolean
pf_agent_remove_region(PfAgent *a, void *host, gboolean keep, GError **error)
{
    Region *r;
    guint i;
    int rc;

    if (!region_leave(a, host, &i)) {
        return TRUE;
    }
    /*
     * Kept, its content stays its own: the memfd may be used again (the
     * backend plugged in elsewhere, merge=on).  Else the memory is being
     * freed, and only its pool slots matter.
     */
    rc = pfa_fold_back_region(a, i, keep);

    g_mutex_lock(&a->work);
    r = &g_array_index(a->regions, Region, i);
    if (rc < 0 && keep) {
        /* As it was, merging again; the pages folded back are told. */
        r->leaving = FALSE;
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "pagefold: cannot fold merged pages of %s back into its "
                    "memfd: %s", r->name, g_strerror(-rc));
        g_mutex_unlock(&a->work);
        return FALSE;
    }
    region_gone(a, i, rc);
    g_mutex_unlock(&a->work);
    return TRUE;
}

void
pf_agent_set_advice(PfAgent *a, void *host, const int *advice)
{
    g_mutex_lock(&a->work);
    for (guint i = 0; i < a->regions->len; i++) {
        Region *r = &g_array_index(a->regions, Region, i);
        guint n = 0;

        if (r->gone || r->host != host) {
            continue;
        }
        for (; advice[n] != 0 && n + 1 < G_N_ELEMENTS(r->advice); n++) {
            r->advice[n] = advice[n];
        }
        r->advice[n] = 0;
    }
    g_mutex_unlock(&a->work);
}

gboolean
pf_agent_region_protected(PfAgent *a, void *host)
{
    gboolean yes = FALSE;

    g_mutex_lock(&a->work);
    for (guint i = 0; i < a->regions->len; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone && r->host == host) {
            yes = a->mode == PF_MODE_MERGE && a->uffd >= 0 &&
                  r->refused == NULL && !r->leaving;
        }
    }
    g_mutex_unlock(&a->work);
    return yes;
}

GPtrArray *
pf_agent_get_regions(PfAgent *a)
{
    GPtrArray *list = g_ptr_array_new_with_free_func(pf_agent_region_info_free);

    g_mutex_lock(&a->work);
    for (guint i = 0; i < a->regions->len; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);
        PfAgentRegionInfo *info;

        if (r->gone) {
            continue;
        }
        info = g_new0(PfAgentRegionInfo, 1);
        info->name = g_strdup(r->name);
        info->host = r->host;
        info->size = r->size;
        info->refused = g_strdup(r->refused);
        g_ptr_array_add(list, info);
    }
    g_mutex_unlock(&a->work);
    return list;
}

void
pf_agent_region_info_free(gpointer p)
{
    PfAgentRegionInfo *info = p;

    g_free(info->name);
    g_free(info->refused);
    g_free(info);
}
