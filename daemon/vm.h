/*
 * vm.h - one attached VM: its process, its guest-RAM regions (region.h),
 * its outbox of requests if an agent attached it, and its share of the
 * counters.
 *
 * vm.c finds a VM's RAM the way QEMU lays it out (shared memfd mappings in
 * /proc/PID/maps) when attached by pid, or takes the regions its agent
 * announced (checked by region.c).  Its process is pinned by a pidfd from
 * the start: a reused pid is never taken for it.  Must never map guest RAM
 * writable nor touch a page.  The scanner owns a VM once it is added.
 */
#pragma once

#include <glib.h>
#include <sys/types.h>

#include "label.h"
#include "outbox.h"
#include "proto.h"
#include "region.h"

typedef struct _PfVm PfVm;
typedef struct _PfVmLook PfVmLook; /* pf_vm_look_async() */
typedef struct _PfExtents PfExtents; /* extents.h */

typedef struct {
    guint64 ino;  /* the chunk's memfd */
    guint32 seq;  /* the link's last request batch when told */
    gint64 usec;  /* monotonic time when told */
} PfDropped;

/* Pages [page, page + n_pages) of the VM's region `region`. */
typedef struct {
    guint32 region;
    guint32 n_pages;
    guint64 page;
} PfHint;

/* The key of a merge domain of one VM's own (an agent no root process
 * vouched for): this bit and the VM's serial.  Other keys are the index
 * of a named domain, 0 the host's default. */
#define PF_DOMAIN_UNLABELLED 0x80000000u

/* How a VM came, set as it is made: its agent announced it (its requests
 * go through its outbox), or root attached its process by pid (advise
 * mode, no agent: its regions are what its mappings show). */
typedef enum { PF_VM_BY_PID, PF_VM_AGENT } PfVmKind;

/*
 * A VM: first what every layer reads of it (its identity, mode, regions
 * and outbox), then what only the scanner core keeps of it, grouped by
 * the file that writes it (the page-state and cursor helpers of
 * scan-core.h count as the file that calls them).
 */
struct _PfVm {
    /* vm.c, as it is made; never written after but as said. */
    /* A label: VMs may share one (the pid is who).  An agent's or a
     * process's own is kept escaped (escape.h), root's as given. */
    char *name;
    int pid;
    guint8 uuid[16];     /* as the agent (or libvirt's status file) or
                          * QEMU's -uuid says; all zero: none.  A label too:
                          * a peer may claim any */
    int pidfd;           /* scan-vms.c takes it for a leftover as it goes */
    PfVmKind kind;
    int pagemap_fd;      /* /proc/PID/pagemap, to see copy-on-write */
    PfOutbox *outbox;    /* an agent's VM: its requests, owned; NULL if
                          * attached by pid (kind says which).  The scanner
                          * pushes requests, link.c drains them */
    GPtrArray *regions;  /* PfRegion*, owned; a VM attached by pid follows
                          * its mappings (pf_vm_refresh()), scan-vms.c
                          * adds and retires an agent's */
    PfMode mode;         /* merge only with an agent that merges; */
    char *mode_reason;   /* why advise, when it is; an agent's escaped;
                          * both set again by scan-cow.c on a step back */

    /* scan-vms.c: its place among the scanner's VMs. */
    guint32 serial;      /* its name in the pool, never reused */
    guint watch_id;      /* pidfd watch */
    /* Its merge domain: it shares pages only with VMs of the same one
     * (pf_scanner_set_merge_domain()). */
    gboolean unlabelled; /* one of its own */
    guint32 domain;      /* else: 0 the host's default, i the named
                          * domain i */
    /* pages of this VM in each PfPageState (the page-state helpers) */
    gsize count[PF_PAGE_N_STATES];
    /* Merged and zero pages its regions had as they left (QEMU frees
     * guest RAM, telling its agent, as it exits): told with its last
     * figures. */
    gsize gone_shared;
    gsize gone_zero;

    /* scan-visit.c: its visits. */
    guint64 pages_scanned;
    guint64 pages_skipped;
    guint64 pages_hinted;

    /* scan-hints.c: ranges of its pages its agent says a device just
     * wrote, visited before the cursor's: PfHint, hint_pages pages. */
    GArray *hints;
    guint hint_head;     /* its first range not visited yet */
    gsize hint_pages;
    guint64 hints_dropped;

    /* scan-pass.c: the cursor's dealings with it.  It left it before its
     * end (its outbox was full, or its agent silent): it comes back to it
     * later in the pass if deferred, and starts at resume_region,
     * resume_page when it next comes. */
    guint64 full_scans;
    gboolean resume;
    gboolean deferred;
    guint resume_region;
    gsize resume_page;
    gboolean entered;    /* looked at in this pass (enter_vm()) */
    gboolean counted;    /* its mappings were counted once: requests may go */
    /* Mappings of its process (invariant 5): counted at its last look
     * (scan-pass.c), plus the most the requests since can add
     * (scan-requests.c), or its budget after an ENOMEM (scan-answers.c). */
    guint64 vmas;
    guint64 vma_budget;  /* no merges once vmas reaches it (scan-pass.c,
                          * first set by scan-vms.c) */

    /* scan-reads.c: what is read of it on threads (its look is taken by
     * scan-pass.c as the cursor enters it, its window wait reset there
     * as a pass begins). */
    GCancellable *looking; /* its look under way, or NULL */
    PfVmLook *look;      /* its look, done, not yet taken */
    guint32 look_answered; /* its outbox's last answered batch, and the time, */
    gint64 look_usec;    /* when its look began */
    guint64 vmas_since_look; /* mappings its requests may have added since
                              * (scan-requests.c adds) */
    /* Its memfds ahead of the cursor (extents.h): the window the cursor is
     * in or comes to next, the one after, and the read under way. */
    PfExtents *extents;
    PfExtents *extents_next;
    GCancellable *reading;
    gboolean read_failed; /* the last read on a thread failed */
    gint64 window_wait;  /* since when the cursor waits for its window, or 0 */

    /* scan-requests.c: the run its last request continues. */
    guint32 run_next_page; /* the request that would continue the last run */
    guint32 run_next_slot;
    guint8 run_kind;

    /* scan-cow.c and scan-answers.c: merged pages written since
     * (copy-on-write). */
    guint64 cow;

    /* scan-moves.c: chunks it was told to let go of (PfDropped), until
     * its look (scan-reads.c) sees it did. */
    GArray *dropped;

    /* scan.c: counting and unmerging. */
    guint64 share;       /* its pages' parts of the stable nodes they
                          * share (PF_SHARE_ONE a node, tree.h): its part
                          * of pages_shared, nodes too big to track aside */
    guint stats_index;   /* scratch for the scanner's attribution */
    guint unmerging;     /* unmerges of it running: no merges meanwhile */
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
 * it chose (reason: why advise).  Takes regions, the array and its
 * regions (freed with it on failure).  pidfd and proc_dir (its /proc/PID,
 * opened while pidfd showed it alive) pin the process the agent's socket
 * came from; pidfd is duplicated.  Its regions never change behind the
 * agent's back; its requests go through its outbox. */
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
gboolean pf_vm_merges(const PfVm *vm);

/* What a VM answers to when a user names it. */
typedef struct {
    const char *name;
    int pid;
    const guint8 *uuid; /* 16 bytes, all zero for none */
} PfVmKey;
/* Which of n VMs key names (its pid, UUID or name): its index, or -1 and
 * error (PF_ERROR_NOT_FOUND when none does). */
gssize pf_vm_key_find(const PfVmKey *keys, guint n, const char *key, GError **error);

/*
 * What the scanner reads of a VM's process when it looks at it, from its
 * /proc/PID/maps (read once for all of it) and fd directory: on a thread
 * of GLib's pool, since each read waits for the process's mmap lock, which
 * a busy (or hostile) VMM holds as long as it likes.  The thread sees only
 * the pid; nothing of the PfVm.
 */

/* Starts the look; what: PF_VM_LOOK_* bits.  callback runs on the calling
 * thread's main context, also when cancelled. */
enum {
    PF_VM_LOOK_RANGES = 1 << 0, /* its shared memfd mappings (attached by pid) */
    PF_VM_LOOK_HELD = 1 << 1,   /* the pool chunks it maps or holds */
};
void pf_vm_look_async(const PfVm *vm, guint what, GCancellable *cancel,
                      GAsyncReadyCallback callback, gpointer user);
/* NULL only when cancelled; a look whose reads failed says so to
 * pf_vm_refresh(). */
PfVmLook *pf_vm_look_finish(GAsyncResult *res, GError **error);
void pf_vm_look_free(PfVmLook *look);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfVmLook, pf_vm_look_free)
/* The inodes (guint64*) of the pool chunks the process mapped or held a
 * descriptor of, with PF_VM_LOOK_HELD: what it kept from being freed.
 * Empty if it was gone. */
GHashTable *pf_vm_look_held_pool(const PfVmLook *look);
/* Lines of its /proc/PID/maps: the mappings the process held (0 if it was
 * gone). */
guint64 pf_vm_look_vmas(const PfVmLook *look);

void pf_vm_free(PfVm *vm);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfVm, pf_vm_free)

gboolean pf_vm_exited(const PfVm *vm);
/* Its windows of memfd read ahead, and any read under way, go: a region
 * of it went, or it did. */
void pf_vm_forget_extents(PfVm *vm);
gsize pf_vm_n_pages(const PfVm *vm);

/*
 * Brings a VM attached by pid up to its mappings as look (with
 * PF_VM_LOOK_RANGES) found them.  Regions no longer mapped by the VM move
 * from vm->regions to *gone (the caller releases their pages, then frees
 * them); new ones are appended to vm->regions and to *added.  An agent's
 * VM says what its RAM is: nothing to do.
 */
gboolean pf_vm_refresh(PfVm *vm, const PfVmLook *look, GPtrArray *gone, GPtrArray *added,
                       GError **error);

