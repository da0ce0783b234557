/*
 * extents.c - a window of a region's memfd read ahead of the cursor, on a
 * thread (extents.h).  Owns the reads and its own descriptors; never reads
 * guest RAM, never judges a page.
 */
#include "extents.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include "util.h"

typedef struct {
    PfRegion *region; /* handed back, never touched on the thread */
    int fd;           /* the memfd, duplicated */
    int pagemap_fd;   /* duplicated, or -1 */
    guint64 file_offset;
    guint64 host_addr;
    gsize n_pages;
    gsize from;
    gint64 usec;
    PfCow *cow;
} Read;

static int
dup_cloexec(int fd)
{
    return fcntl(fd, F_DUPFD_CLOEXEC, 3);
}

int (*pf_extents_dup)(int fd) = dup_cloexec;

static void
read_free(Read *rd)
{
    if (rd->fd >= 0) {
        close(rd->fd);
    }
    if (rd->pagemap_fd >= 0) {
        close(rd->pagemap_fd);
    }
    pf_cow_free(rd->cow);
    g_free(rd);
}

void
pf_extents_free(PfExtents *x)
{
    if (x == NULL) {
        return;
    }
    g_array_unref(x->data);
    g_array_unref(x->cow);
    g_free(x);
}

/*
 * Data extents this short between two holes are looked at with them, in
 * one call: a call costs about what walking the page table entries of 70
 * pages does (docs/DESIGN.md, section 6), and merged pages cut a memfd
 * into many short extents.
 */
#define COW_GAP_PAGES 64u

typedef struct {
    PfExtents *x;
    guint next; /* the first data extent that may hold the next page */
} CowLook;

/* A page copied on write, kept if it lies in a hole: a look spans data
 * extents too, whose pages are the visit's to judge (scan-visit.c). */
static void
cow_seen(gsize page, gboolean zero_pfn, gpointer user)
{
    CowLook *look = user;
    GArray *data = look->x->data;
    PfCowSeen c = { (guint32)page, zero_pfn };

    while (look->next < data->len && g_array_index(data, PfExtent, look->next).end <= page) {
        look->next++;
    }
    if (look->next < data->len && g_array_index(data, PfExtent, look->next).first <= page) {
        return;
    }
    g_array_append_val(look->x->cow, c);
}

/* The copy-on-write look at the holes of x, a call for each run of holes
 * with short data between them. */
static void
look_at_holes(const Read *rd, PfExtents *x)
{
    CowLook look = { x, 0 };
    gsize hole = rd->from, from = 0, to = 0;

    for (guint i = 0; i <= x->data->len; i++) {
        const PfExtent *e = i < x->data->len ? &g_array_index(x->data, PfExtent, i) : NULL;
        gsize first = e != NULL ? e->first : x->to;

        if (hole < first) {
            if (to > from && hole - to > COW_GAP_PAGES) {
                if (!pf_cow_find(rd->cow, rd->pagemap_fd, rd->host_addr, from, to, cow_seen,
                                 &look)) {
                    return; /* the process is going: its pidfd will say so */
                }
                from = to;
            }
            if (to == from) {
                from = hole;
            }
            to = first;
        }
        if (e != NULL) {
            hole = MAX(hole, (gsize)e->end);
        }
    }
    if (to > from) {
        (void)pf_cow_find(rd->cow, rd->pagemap_fd, rd->host_addr, from, to, cow_seen, &look);
    }
}

/* The data extents from rd->from on; x->to is where what they say ends. */
static void
read_data(const Read *rd, PfExtents *x)
{
    gsize limit = MIN(rd->n_pages, rd->from + PF_EXTENTS_WINDOW), pos = rd->from;

    while (pos < limit && x->data->len < PF_EXTENTS_MAX) {
        off_t data = lseek(rd->fd, (off_t)(rd->file_offset + pos * PF_PAGE_SIZE), SEEK_DATA);
        PfExtent e;
        gsize first, end;
        off_t hole;

        if (data < 0 && errno == ENXIO) {
            pos = limit; /* nothing but holes to the end of the file */
            break;
        }
        if (data < 0) {
            /* Unknown: taken as data to the end, where each page is looked
             * up in memory before it is read (the scanner's mincore()). */
            e = (PfExtent){ (guint32)pos, (guint32)rd->n_pages };
            g_array_append_val(x->data, e);
            pos = rd->n_pages;
            break;
        }
        first = MIN(rd->n_pages, (gsize)(data - (off_t)rd->file_offset) / PF_PAGE_SIZE);
        if (first >= limit) {
            pos = limit;
            break;
        }
        hole = lseek(rd->fd, data, SEEK_HOLE);
        end = hole < 0 ? rd->n_pages
                       : MIN(rd->n_pages, (gsize)(hole - (off_t)rd->file_offset) / PF_PAGE_SIZE);
        e = (PfExtent){ (guint32)first, (guint32)MAX(end, first + 1) };
        g_array_append_val(x->data, e);
        pos = e.end;
    }
    x->to = pos;
}

static PfExtents *
read_window(const Read *rd)
{
    PfExtents *x = g_new0(PfExtents, 1);

    x->region = rd->region;
    x->from = rd->from;
    x->usec = rd->usec;
    x->data = g_array_new(FALSE, FALSE, sizeof(PfExtent));
    x->cow = g_array_new(FALSE, FALSE, sizeof(PfCowSeen));
    read_data(rd, x);
    /* Merged pages are holes: the copy-on-write look is at the holes. */
    if (rd->pagemap_fd >= 0) {
        look_at_holes(rd, x);
    }
    return x;
}

static void
read_thread(GTask *task, gpointer source, gpointer data, GCancellable *cancel)
{
    g_task_return_pointer(task, read_window(data), (GDestroyNotify)pf_extents_free);
}

static Read
read_of(PfRegion *r, gsize from)
{
    return (Read){
        .region = r, .fd = r->fd, .file_offset = r->file_offset, .host_addr = r->host_addr,
        .n_pages = r->n_pages, .from = from, .usec = g_get_monotonic_time(),
    };
}

PfExtents *
pf_extents_read(PfRegion *r, int pagemap_fd, PfCow *cow, gsize from)
{
    Read rd = read_of(r, from);

    rd.pagemap_fd = pagemap_fd;
    rd.cow = cow;
    return read_window(&rd);
}

void
pf_extents_read_async(PfRegion *r, int pagemap_fd, PfCow *cow, gsize from, GCancellable *cancel,
                      GAsyncReadyCallback callback, gpointer user)
{
    g_autoptr(GTask) task = g_task_new(NULL, cancel, callback, user);
    Read *rd = g_new(Read, 1);

    *rd = read_of(r, from);
    rd->fd = pf_extents_dup(r->fd);
    rd->pagemap_fd = pagemap_fd >= 0 ? pf_extents_dup(pagemap_fd) : -1;
    rd->cow = pf_cow_ref(cow);
    g_task_set_task_data(task, rd, (GDestroyNotify)read_free);
    g_task_set_return_on_cancel(task, TRUE);
    if (rd->fd < 0 || (pagemap_fd >= 0 && rd->pagemap_fd < 0)) {
        /* The caller reads on its own thread instead. */
        g_task_return_new_error(task, G_IO_ERROR, g_io_error_from_errno(errno),
                                "cannot duplicate a descriptor: %s", g_strerror(errno));
        return;
    }
    g_task_run_in_thread(task, read_thread);
}

PfExtents *
pf_extents_read_finish(GAsyncResult *res)
{
    return g_task_propagate_pointer(G_TASK(res), NULL);
}
