/*
 * vm.h - one attached VM: its process, its guest-RAM regions and its share
 * of the counters.
 *
 * vm.c finds a VM's RAM the way QEMU lays it out (shared memfd mappings in
 * /proc/PID/maps), takes each memfd read-only and maps it PROT_READ.  It
 * must never map guest RAM writable, and never touch the pages (touching a
 * hole of a memfd through a mapping allocates it): the scanner reads them.
 * What an agent announces is believed only once checked against what its
 * process maps (pf_region_check_mapping()), before anything is allocated
 * for it; a region too large to track is refused, never an abort.
 */
#pragma once

#include <glib.h>
#include <sys/types.h>

#include "label.h"
#include "outbox.h"
#include "page.h"
#include "proto.h"

/* Smaller shared memfds are not guest RAM (QEMU's RAM blocks are MiBs). */
#define PF_MIN_REGION_SIZE (1u << 20)
/* The most guest RAM an agent may announce, per region and per VM: page
 * ids are 32-bit and shared by all VMs (16 TiB in all), and each page costs
 * a 16-byte record, so one VM's claim must not use up everyone's. */
#define PF_MAX_REGION_BYTES (G_GUINT64_CONSTANT(1) << 40)
#define PF_MAX_VM_BYTES (G_GUINT64_CONSTANT(1) << 40)
/* Regions an agent may announce in its VM's life, refused and gone ones
 * included (indexes are never reused): HELLO's bound (proto.c), kept at run
 * time, so that a VMM that plugs and unplugs RAM forever cannot grow a
 * VM's records without end. */
#define PF_MAX_VM_REGIONS 256u

typedef struct _PfVm PfVm;

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
    char *name;          /* memfd name, e.g. "memory-backend-memfd" */
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
    gboolean gone;       /* a placeholder: the region left the VM */
} PfRegion;

typedef struct {
    guint64 ino;  /* the chunk's memfd */
    guint32 seq;  /* the link's last request batch when told */
    gint64 usec;  /* monotonic time when told */
} PfDropped;

/* The key of a merge domain of one VM's own (an agent no root process
 * vouched for): this bit and the VM's serial.  Other keys are the index
 * of a named domain, 0 the host's default. */
#define PF_DOMAIN_UNLABELLED 0x80000000u

struct _PfVm {
    char *name;          /* a label: VMs may share one (the pid is who) */
    int pid;
    guint8 uuid[16];     /* as the agent or QEMU's -uuid says; all zero:
                          * none.  A label too: a peer may claim any */
    int pidfd;
    GPtrArray *regions;  /* PfRegion*, owned */
    PfMode mode;         /* merge only with an agent that merges */
    char *mode_reason;   /* why advise, when it is */
    PfOutbox *outbox;    /* an agent's VM: its requests, owned; NULL if
                          * attached by pid */
    int pagemap_fd;      /* /proc/PID/pagemap, to see copy-on-write */
    /* pages of this VM in each PfPageState */
    gsize count[PF_PAGE_N_STATES];
    guint64 pages_scanned;
    guint64 pages_skipped;
    guint64 full_scans;
    guint64 cow;         /* merged pages written since (copy-on-write) */
    guint64 vmas;        /* mappings of the process: counted at each pass,
                          * plus the most the requests since can add */
    guint64 vma_budget;  /* no merges once vmas reaches it */
    guint32 run_next_page; /* the request that would continue the last run */
    guint32 run_next_slot;
    guint8 run_kind;
    guint watch_id;      /* pidfd watch, owned by the scanner */
    gpointer scanner;    /* the PfScanner that owns this VM */
    guint32 serial;      /* its name in the pool, never reused */
    GArray *dropped;     /* PfDropped: chunks it was told to let go of,
                          * until it is seen to have */
    guint stats_index;   /* scratch for the scanner's attribution */
    guint unmerging;     /* unmerges of it running: no merges meanwhile */
    /* Its merge domain: it shares pages only with VMs of the same one
     * (pf_scanner_set_merge_domain()). */
    gboolean unlabelled; /* one of its own */
    guint32 domain;      /* else: 0 the host's default, i the named
                          * domain i */
};

/* The merge domain's key, as stable nodes keep it (PF_DOMAIN_UNLABELLED). */
static inline guint32
pf_vm_domain_key(const PfVm *vm)
{
    return vm->unlabelled ? PF_DOMAIN_UNLABELLED | vm->serial : vm->domain;
}

PfVm *pf_vm_attach(int pid, const char *name, GError **error);
/* A VM announced by its agent: regions as the agent described them (each
 * checked by pf_region_check_mapping()), the memfds it passed, and the mode
 * it chose (reason: why advise).  pidfd and proc_dir (its /proc/PID, opened
 * while pidfd showed it alive) pin the process the agent's socket came
 * from; pidfd is duplicated.  Its regions never change behind the agent's
 * back; its requests go through its outbox. */
PfVm *pf_vm_new_from_agent(int pid, int pidfd, int proc_dir, const char *name,
                           const guint8 uuid[16], GPtrArray *regions, PfMode mode,
                           const char *reason, GError **error);
/* "merge" or "advise", as users read it. */
const char *pf_vm_mode_name(const PfVm *vm);
/* Appends a region to the VM: its index is the next. */
void pf_vm_add_region(PfVm *vm, PfRegion *r);
/* Takes region k out of a VM attached by pid (an agent's keep their
 * indexes), returning it; those after it move down. */
PfRegion *pf_vm_steal_region(PfVm *vm, guint k);
/* The VM's UUID as text (36 characters and a NUL into buf), or NULL if it
 * has none. */
const char *pf_vm_uuid_string(const PfVm *vm, char buf[37]);
/*
 * Whether fd may be taken as guest RAM that the process of proc_dir maps at
 * host_addr..host_addr + size from offset: a memfd (shmem, 4 KiB pages)
 * sealed against shrinking (pagefoldd's reads would fault past a
 * truncation), at most PF_MAX_REGION_BYTES, that range within it, and the
 * process mapping exactly that file there, shared, at those offsets, in
 * one mapping or several.  Allocates nothing for the region.
 */
gboolean pf_region_check_mapping(int proc_dir, int fd, const char *name, guint64 host_addr,
                                 guint64 offset, guint64 size, GError **error);
/* Whether every page of the regions is registered for userfaultfd write
 * protection in the process of proc_dir ("uw" in smaps' VmFlags), as an
 * agent's are before it may merge.  Placeholders are skipped. */
gboolean pf_regions_check_write_protected(int proc_dir, GPtrArray *regions, GError **error);
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
gboolean pf_vm_merges(const PfVm *vm);
/* The inodes (guint64*) of the pool chunks the process maps or holds a
 * descriptor of: what it keeps from being freed.  Empty if it is gone. */
GHashTable *pf_vm_held_pool(const PfVm *vm);
/* Lines of /proc/PID/maps: the mappings the process holds. */
guint64 pf_vm_count_vmas(const PfVm *vm);
void pf_vm_free(PfVm *vm);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfVm, pf_vm_free)

gboolean pf_vm_exited(const PfVm *vm);
gsize pf_vm_n_pages(const PfVm *vm);

/*
 * Re-reads the VM's mappings.  Regions no longer mapped by the VM move from
 * vm->regions to *gone (the caller releases their pages, then frees them);
 * new ones are appended to vm->regions and to *added.
 */
gboolean pf_vm_refresh(PfVm *vm, GPtrArray *gone, GPtrArray *added,
                       GError **error);

void pf_region_free(PfRegion *r);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfRegion, pf_region_free)
