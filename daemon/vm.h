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
typedef struct _PfScanVm PfScanVm; /* scan-core.h */
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
 * A VM as every layer knows it: its identity, mode, regions and outbox.
 * What the scanner core keeps of it is a record of the core's own
 * (PfScanVm, scan-core.h).
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
    guint64 start_time;  /* when its process started (field 22 of its
                          * /proc/PID/stat), read while pinned; 0: unknown */
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

    /* The scanner core's record of it (scan-core.h), from
     * pf_scanner_add_vm() until it goes: NULL before, and opaque to every
     * other layer. */
    PfScanVm *scan;
};



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
/* When process pid started (field 22 of /proc/PID/stat), or 0: with the
 * pid, a name for a process that a reused pid does not take. */
guint64 pf_process_start_time(int pid);
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

