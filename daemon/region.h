/*
 * region.h - a region of guest RAM: one memfd (or a part of one) a VM
 * maps, read here through a PROT_READ mapping of its own, with a record
 * per page present.
 *
 * region.c maps each memfd read-only and must never map guest RAM
 * writable, nor touch the pages (touching a hole of a memfd through a
 * mapping allocates it): the scanner reads them.  What an agent announces
 * is believed only once checked against what its process maps
 * (pf_region_check_mapping()), before anything is allocated for it; a
 * region too large to track is refused, never an abort.
 */
#pragma once

#include <gio/gio.h>
#include <sys/types.h>

#include "page.h"

/* Smaller shared memfds are not guest RAM (QEMU's RAM blocks are MiBs). */
#define PF_MIN_REGION_SIZE (1u << 20)
/* The most guest RAM an agent may announce, per region and per VM: page
 * ids are 32-bit and shared by all VMs (16 TiB in all), and each page costs
 * an 8-byte record, so one VM's claim must not use up everyone's. */
#define PF_MAX_REGION_BYTES (G_GUINT64_CONSTANT(1) << 40)
#define PF_MAX_VM_BYTES (G_GUINT64_CONSTANT(1) << 40)
/* All VMs of one uid that root vouched for none of (handshake.c): a
 * quarter of the page ids (16 TiB of guest RAM in all); and all such VMs
 * of every uid, half of them. */
#define PF_MAX_UNVOUCHED_UID_BYTES (G_GUINT64_CONSTANT(4) << 40)
#define PF_MAX_UNVOUCHED_BYTES (G_GUINT64_CONSTANT(8) << 40)
/* Regions an agent may announce in its VM's life, refused and gone ones
 * included (indexes are never reused): HELLO's bound (proto.c), kept at run
 * time, so that a VMM that plugs and unplugs RAM forever cannot grow a
 * VM's records without end. */
#define PF_MAX_VM_REGIONS 256u

typedef struct _PfVm PfVm;

/* Pages of a region its process maps from a pool chunk that a pagefoldd
 * made (pool.h's mark): merged before this pagefoldd started. */
typedef struct {
    gsize page;      /* the first, in the region */
    gsize n_pages;
    guint64 ino;     /* the chunk's memfd */
    guint32 index;   /* the slot of page, in the chunk (from 0) */
    gboolean zero;   /* the zero chunk */
} PfPoolRun;

/*
 * The most pool chunk descriptors checks keep open: for one region, for
 * one peer (its process, all its regions and connections), for the peers
 * of one uid root vouched for none of, for all such peers, and for all
 * checks at once.  A region past any is refused (its merged pages stay,
 * uncounted).  A process that hoards chunks, or many of one uid (under
 * libvirt every QEMU's), leaves the VMs root vouched for at least half of
 * them.
 */
typedef struct {
    guint region, peer, unvouched_uid, unvouched, all;
} PfChunkCaps;
#define PF_CHUNK_CAPS_DEFAULT { 16384, 32768, 16384, 32768, 131072 }

/* Who a check holds chunk descriptors for. */
typedef struct {
    int pid;          /* the peer's process */
    uid_t uid;
    gboolean vouched; /* root vouched for it: not counted with its uid */
} PfChunkHolder;

/* Tests set smaller caps; NULL: the defaults. */
void pf_region_set_chunk_caps(const PfChunkCaps *caps);

/* What a region's check found its process maps from pool chunks. */
typedef struct {
    GArray *runs;    /* PfPoolRun, in page order */
    GHashTable *fds; /* ino (guint64*) -> the chunk's memfd plus one (an
                      * int, owned), opened through the process's map_files */
    PfChunkHolder holder; /* whose descriptors fds are ... */
    guint n_held;         /* ... and how many of them are counted */
    guint8 *back;    /* by bit, per page of the region: back in the memfd
                      * since the check (a DISCARD), not to be taken back;
                      * NULL: none */
    guint at_run;    /* how far the scanner took them back (scan-adopt.c) */
    gsize at_page;
    gsize shared, zero, refused; /* ... and how many so far */
} PfPoolMapped;

void pf_pool_mapped_free(PfPoolMapped *m);
/* Pages [from, to) of the region of n_pages are back in the memfd. */
void pf_pool_mapped_back(PfPoolMapped *m, gsize n_pages, gsize from, gsize to);
/* Whether page idx is: then it maps no pool chunk any more. */
gboolean pf_pool_mapped_is_back(const PfPoolMapped *m, gsize idx);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfPoolMapped, pf_pool_mapped_free)

/*
 * A region of guest RAM.  An agent's regions keep the index it gave them
 * (vm->regions[i] is its region i), so a region it announced that was
 * refused, or that left the VM since, stays as a placeholder: no memfd, no
 * mapping, no page (n_pages 0, so nothing ever scans or names it), only
 * what it was announced as and why it is not scanned.
 */
typedef struct {
    PfVm *vm;
    guint index;         /* in vm->regions (pf_vm_add_region()) */
    char *name;          /* memfd name, e.g. "memory-backend-memfd"; escaped
                          * (escape.h): its VMM's or agent's */
    guint64 host_addr;   /* where the VM process maps it */
    guint64 file_offset; /* of host_addr in the memfd */
    gsize size;
    gsize n_pages;
    dev_t dev;
    ino_t ino;
    int fd;              /* O_RDONLY */
    const guint8 *map;   /* PROT_READ, MAP_SHARED */
    PfPage **extents;    /* the records of each PF_EXTENT_PAGES pages,
                          * made when one of them is first seen and
                          * freed when all are absent again: NULL, all
                          * absent (pf_region_page()) */
    gsize n_extents;
    gsize extents_made;  /* not NULL */
    guint8 *huge_seen;   /* per 2 MiB extent: looked at when first merged */
    guint8 *huge_was;    /* ... and it was a transparent huge page then */
    guint32 base;        /* page id of pages[0] */
    char *refused;       /* a placeholder: why the region was refused */
    PfPoolMapped *pooled; /* pages merged before this pagefoldd started,
                           * until the scanner takes them back */
    gboolean gone;       /* a placeholder: the region left the VM */
} PfRegion;

/*
 * Whether fd may be taken as guest RAM that the process of proc_dir maps at
 * host_addr..host_addr + size from offset: a memfd (shmem, 4 KiB pages)
 * sealed against shrinking (pagefoldd's reads would fault past a
 * truncation), at most PF_MAX_REGION_BYTES, that range within it, and the
 * process mapping exactly that file there, shared, at those offsets, in
 * one mapping or several.  Where pooled is not NULL, pages may be mapped
 * privately from pool chunks instead (an agent whose pagefoldd restarted):
 * *pooled says which, or is NULL where none is, and holds their
 * descriptors, counted against holder's caps (PfChunkCaps).  Allocates
 * nothing for the region.
 */
gboolean pf_region_check_mapping(int proc_dir, int fd, const char *name, guint64 host_addr,
                                 guint64 offset, guint64 size, const PfChunkHolder *holder,
                                 PfPoolMapped **pooled, GCancellable *cancel, GError **error);

/* Guest RAM as announced, for checks made away from the region itself. */
typedef struct {
    char *name;
    guint64 host_addr, size;
} PfRegionSpan;

/* For each span, why[i] is NULL where every page of it is registered for
 * userfaultfd write protection in the process of proc_dir ("uw" in smaps'
 * VmFlags), as an agent's regions are before it may merge, else why not
 * (the caller frees it).  One read of smaps for all of them.  FALSE (error
 * set) where smaps could not be read, or cancel was cancelled. */
gboolean pf_region_spans_protected(int proc_dir, const PfRegionSpan *spans, guint n, char **why,
                                   GCancellable *cancel, GError **error);
/* A placeholder for a region refused as announced (see PfRegion); holds
 * nothing. */
PfRegion *pf_region_new_refused(const char *name, guint64 host_addr, guint64 size,
                                const char *why);
/* Turns a region the scanner has let go of into a placeholder for one that
 * left the VM: its mapping, memfd and page records are freed now. */
void pf_region_retire(PfRegion *r);
/* Turns a region nothing was placed for yet into a refused placeholder. */
void pf_region_refuse(PfRegion *r, const char *why);
/* Pages whose records are made and freed together: a 2 MiB extent.  The
 * records follow the pages present, not the size of the RAM. */
#define PF_EXTENT_PAGES 512u

/* The record of page idx, or NULL if it has none: it is absent. */
static inline PfPage *
pf_region_page(const PfRegion *r, gsize idx)
{
    PfPage *e = r->extents[idx / PF_EXTENT_PAGES];

    return e != NULL ? &e[idx % PF_EXTENT_PAGES] : NULL;
}

static inline PfPageState
pf_region_page_state(const PfRegion *r, gsize idx)
{
    const PfPage *p = pf_region_page(r, idx);

    return p != NULL ? (PfPageState)p->state : PF_PAGE_ABSENT;
}

/* The first page at or after idx (and before end) that has a record:
 * pages without one are absent. */
static inline gsize
pf_region_next_recorded(const PfRegion *r, gsize idx, gsize end)
{
    while (idx < end && r->extents[idx / PF_EXTENT_PAGES] == NULL) {
        idx = (idx / PF_EXTENT_PAGES + 1) * PF_EXTENT_PAGES;
    }
    return MIN(idx, end);
}

/* The record of page idx, made (absent) if it has none; NULL when there
 * is no memory for it (the page is not visited then). */
PfPage *pf_region_page_make(PfRegion *r, gsize idx);
/* Frees the records of the extents of [from, to) whose pages are all
 * absent. */
void pf_region_trim(PfRegion *r, gsize from, gsize to);
/* What the records take. */
gsize pf_region_record_bytes(const PfRegion *r);

/* Neither refused nor gone: a region that is scanned. */
static inline gboolean
pf_region_live(const PfRegion *r)
{
    return r->refused == NULL && !r->gone;
}
/* Maps one memfd read-only; takes fd. */
PfRegion *pf_region_new(const char *name, int fd, guint64 host_addr, guint64 offset,
                        gsize size, GError **error);
void pf_region_free(PfRegion *r);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfRegion, pf_region_free)
