/*
 * pagespace.c - the page-id space (pagespace.h): a sorted array of
 * regions, first-fit placement, binary search from an id.  Owns only the
 * order; never frees a region nor touches a record.
 */
#include "pagespace.h"

#include "util.h"

void
pf_page_space_init(PfPageSpace *ps)
{
    ps->regions = g_ptr_array_new();
    ps->last = NULL;
}

void
pf_page_space_destroy(PfPageSpace *ps)
{
    g_clear_pointer(&ps->regions, g_ptr_array_unref);
    ps->last = NULL;
}

gboolean
pf_page_space_place(PfPageSpace *ps, PfRegion *r)
{
    /* Id 0 is PF_PAGE_ID_NONE. */
    guint64 candidate = 1;
    guint pos = 0;

    for (; pos < ps->regions->len; pos++) {
        PfRegion *o = g_ptr_array_index(ps->regions, pos);

        if (o->base - candidate >= r->n_pages) {
            break;
        }
        candidate = (guint64)o->base + o->n_pages;
    }
    if (candidate + r->n_pages >= G_MAXUINT32) {
        return FALSE;
    }
    r->base = (guint32)candidate;
    g_ptr_array_insert(ps->regions, (gint)pos, r);
    return TRUE;
}

void
pf_page_space_remove(PfPageSpace *ps, PfRegion *r)
{
    g_ptr_array_remove(ps->regions, r);
    ps->last = NULL;
}

PfRegion *
pf_page_space_region(PfPageSpace *ps, guint32 id)
{
    PfRegion *r = ps->last;
    guint lo = 0, hi = ps->regions->len;

    if (r != NULL && id - r->base < r->n_pages) {
        return r;
    }
    while (hi - lo > 1) {
        guint mid = (lo + hi) / 2;

        if (((PfRegion *)g_ptr_array_index(ps->regions, mid))->base <= id) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    g_assert(lo < ps->regions->len);
    r = g_ptr_array_index(ps->regions, lo);
    g_assert(id - r->base < r->n_pages);
    ps->last = r;
    return r;
}

PfPage *
pf_page_space_page(PfPageSpace *ps, guint32 id)
{
    PfRegion *r = pf_page_space_region(ps, id);

    return pf_region_page(r, id - r->base);
}

const guint8 *
pf_page_space_data(PfPageSpace *ps, guint32 id)
{
    PfRegion *r = pf_page_space_region(ps, id);

    return r->map + (gsize)(id - r->base) * PF_PAGE_SIZE;
}

PfRegion *
pf_page_space_at_address(PfPageSpace *ps, const void *addr)
{
    for (guint i = 0; i < ps->regions->len; i++) {
        PfRegion *r = g_ptr_array_index(ps->regions, i);

        if ((const guint8 *)addr >= r->map && (const guint8 *)addr < r->map + r->size) {
            return r;
        }
    }
    return NULL;
}
