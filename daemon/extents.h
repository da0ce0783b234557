/*
 * extents.h - a window of a region's memfd read ahead of the scanner's
 * cursor, on a thread: where its data extents are (lseek SEEK_DATA and
 * SEEK_HOLE), and which pages of its holes the VM's process maps copied
 * on write (cow.h).
 *
 * Both reads wait on locks a VMM holds as long as it likes: SEEK_DATA on
 * the memfd's inode lock, which a punch of GiBs (a guest rebooting, a
 * balloon) holds throughout; pagemap on the process's mmap lock, held by
 * a VMM remapping its RAM.  On the main loop they held up the control
 * socket and every other VM.
 *
 * What this module owns: those reads, on a thread of GLib's pool, with
 * descriptors of their own.  What it must never do: read guest RAM, or
 * judge a page (what it finds was true when it was read; the scanner
 * judges against what it knows since).
 */
#pragma once

#include <gio/gio.h>

#include "cow.h"
#include "region.h"

/* Page indexes within a region, 32 bits (PF_MAX_REGION_BYTES): a window
 * found all copied on write (a guest rebooting) holds 8 bytes a page. */
typedef struct {
    guint32 first, end; /* pages [first, end) of the region hold data */
} PfExtent;

typedef struct {
    guint32 page;       /* in a hole of the memfd, mapped copied on write */
    guint32 zero_pfn;
} PfCowSeen;

typedef struct _PfExtents {
    PfRegion *region; /* whose pages; not owned: the caller's to check */
    gsize from, to;   /* the window read: pages [from, to) of region */
    GArray *data;     /* PfExtent, in order; the last may end past to */
    GArray *cow;      /* PfCowSeen, in order, pages of holes only */
    gint64 usec;      /* when the reads began */
} PfExtents;

/* Reads the window from page from of r, of up to PF_EXTENTS_WINDOW pages
 * or PF_EXTENTS_MAX data extents, whichever ends first; the copy-on-write
 * look only where the VM merges (pagemap_fd >= 0).  callback runs on the
 * calling thread's main context.  1 GiB: RAM never touched costs the
 * cursor no budget, and it waits for a window each time it crosses one. */
#define PF_EXTENTS_WINDOW 262144u
#define PF_EXTENTS_MAX 512u
void pf_extents_read_async(PfRegion *r, int pagemap_fd, PfCow *cow, gsize from,
                           GCancellable *cancel, GAsyncReadyCallback callback, gpointer user);
/* How a read on a thread gets descriptors of its own (F_DUPFD_CLOEXEC):
 * a seam the tests replace, to make it fail as with no descriptor left. */
extern int (*pf_extents_dup)(int fd);
/* NULL when cancelled, or when the memfd could not be read. */
PfExtents *pf_extents_read_finish(GAsyncResult *res);
/* The same read, on the calling thread: where a thread's could not be. */
PfExtents *pf_extents_read(PfRegion *r, int pagemap_fd, PfCow *cow, gsize from);
void pf_extents_free(PfExtents *x);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfExtents, pf_extents_free)
