/*
 * agent.h - the agent library: linked into the VM's process (QEMU, or the
 * stand-in VMM of the tests), it performs the merges pagefoldd decides,
 * because only the process that maps guest RAM can change its mappings.
 *
 * For each item, under userfaultfd write protection of the guest page:
 *   merge   memcmp with the pool slot; if equal, map the slot MAP_PRIVATE
 *           over the page and punch the page out of the guest memfd (a
 *           page mapped from the pool already moves to the new slot)
 *   zero    check the page is zero; if so, map a pool slot that is never
 *           written (reads share one page, a write copies on write)
 *   unmerge copy the page back into the memfd and map the memfd again
 * then wake any writer that blocked meanwhile.  A page that differs is left
 * as it was: its blocked writer's write lands.  This compare is the last
 * word on every merge; pagefoldd's checksums and its own memcmp only
 * propose.
 *
 * Owns: its connection to pagefoldd, one thread, a userfaultfd, the pool
 * chunk fds it was sent, until pagefoldd drops them.  Never: writes guest
 * RAM other than by copying a page's own content back into the memfd (an
 * unmerge, or a move whose new mapping failed after the old one went),
 * keeps a page write-protected past the item, or accepts a pool chunk that
 * pagefoldd could still write through a new mapping (it must be sealed).
 * When pagefoldd goes away, every merged page stays valid: the mappings
 * hold the pool memory; the agent connects again (10 ms, doubling to 5 s)
 * and announces the VM as at the start, and the pagefoldd that answers
 * takes back the merged pages it finds mapped.  When pagefoldd lets the VM
 * go instead (it says so, with ERROR), or the agent gives up on it, the
 * VM runs on unmerged.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#pragma once

#include <glib.h>
#include <sys/types.h>

#include "proto.h"

typedef struct {
    const char *name;
    void *host;      /* where this process maps the region, MAP_SHARED */
    gsize size;
    int fd;          /* the memfd (the agent keeps a dup) */
    guint64 offset;  /* of host in the memfd */
    /*
     * madvise() advice the VMM gave the region (MADV_HUGEPAGE, MADV_DONTDUMP,
     * ...), 0-terminated: given again to every page the agent remaps, so the
     * new mappings behave, and coalesce, like the old
     */
    int advice[4];
} PfAgentRegion;

typedef struct {
    /* items done, since the start: pages from the memfd to a pool slot */
    guint64 merged;
    /*
     * merge or zero items done on a page mapped from the pool already: from
     * one slot to another
     */
    guint64 moved;
    guint64 zeroed;
    guint64 unmerged;
    guint64 changed;   /* merges the last compare refused */
    guint64 errors;
    guint64 requests;
    guint64 remapped;  /* pages mapped from the pool now */
    /*
     * remapped pages given their memfd back to be discarded (balloon,
     * virtio-mem)
     */
    guint64 discarded;
    /* pages a device wrote that pagefoldd was told of (HINT) */
    guint64 hinted;
    /*
     * pages a device wrote that pagefoldd was not told of: more came
     * between two sends than the agent keeps, no link of protocol 2 was
     * ready or it ended before they went, or pagefoldd had not read what
     * was sent yet
     */
    guint64 hints_dropped;
    /*
     * merged pages folded back because a back-end touched them (KSM has
     * no such thing: its merges are invisible to other processes)
     */
    guint64 backend_fold_backs;
} PfAgentStats;

typedef struct _PfAgent PfAgent;

PfAgent *pf_agent_new(const char *vm_name, const guint8 *uuid);
/*
 * Guest RAM to merge, before pf_agent_start() or at any time after (RAM
 * plugged in: pagefoldd is told at once, and the region is write-protected
 * first when the VM merges).  A region that cannot be merged (its memfd
 * cannot be punched, a NUMA binding, a file system without write
 * protection) is refused on its own: the others merge, and
 * pf_agent_get_regions() says why.  FALSE only when its memfd cannot be
 * kept (no descriptor left).
 */
gboolean pf_agent_add_region(PfAgent *a, const PfAgentRegion *r,
                             GError **error);
/*
 * The region at host leaves the VM (a DIMM unplugged, merging turned off
 * for it): its merged pages get their memfd mapping back (with keep, and
 * their content, no write lost; without, the memory is about to be freed),
 * its write protection is dropped, pagefoldd forgets it, and the agent's
 * dup of its memfd is closed, so that the memory is freed with the VMM's.
 * Call it before the VMM unmaps or frees the region.  FALSE when a page
 * could not be folded back with keep: the region stays as it was (merged
 * pages valid), and calling again tries again.
 */
gboolean pf_agent_remove_region(PfAgent *a, void *host, gboolean keep,
                                GError **error);
/*
 * The region at host has new madvise() advice (0-terminated), for the pages
 * the agent remaps from now on; the VMM gives it to what is mapped now, as
 * QEMU's qom-set of a backend's dump does.
 */
void pf_agent_set_advice(PfAgent *a, void *host, const int *advice);
/*
 * This VM's RAM must be plain memfd mappings from now on: a vhost-user
 * backend or a migration is about to use it, or a device pins it.  The VM
 * goes to advise mode (nothing merges any more), every page the agent
 * remapped is folded back into the memfd (under write protection, a 2 MiB
 * extent at a time: no write is lost, and the rest of guest RAM is written
 * and mapped for DMA meanwhile), pagefoldd is told of each page back
 * (DISCARD) and then of the step back (ADVISE), and the userfaultfd is
 * dropped (postcopy and background snapshot need their own).  Before
 * pf_agent_start() it just chooses advise mode.  Blocks while a request
 * is being served.  FALSE when a page could not be folded back (it is in
 * DMA, or the kernel refused; with the userfaultfd lost, it never can):
 * those pages stay merged and valid, pagefoldd lets go of this VM (its
 * pool pages stay taken), and the caller must not hand guest RAM to
 * whoever needed it plain; calling again folds back what is left.
 */
gboolean pf_agent_step_back(PfAgent *a, const char *reason, GError **error);
/*
 * The same, to be followed at once by pf_agent_step_back(): what cannot
 * be folded back yet (pages in DMA) is left for it, and pagefoldd is not
 * let go.  A VMM does the bulk of the work here without its locks, then
 * the rest with its DMA drained.
 */
gboolean pf_agent_step_back_try(PfAgent *a, const char *reason);
/*
 * The VMM is about to discard host..host+len (a balloon inflates,
 * virtio-mem unplugs): remapped pages there get their memfd mapping back
 * first, so that the discard reaches the memfd and pagefoldd drops their
 * pool references.  Their content is not copied: it is being thrown away.
 */
void pf_agent_discard(PfAgent *a, void *host, gsize len);
/*
 * A device is about to write host..host+len outside the VM's page tables
 * (an O_DIRECT or io_uring read lands there: the kernel pins the pages),
 * until pf_agent_dma_unmap() with the same range.  Write protection
 * cannot see such writes, so the agent merges, zeroes and folds back no
 * page of a range in DMA; a merge in progress there finishes before this
 * returns.  Cheap: a mutex and an array append.
 */
void pf_agent_dma_map(PfAgent *a, void *host, gsize len);
/*
 * The DMA of pf_agent_dma_map(a, host, len) is over; the device wrote its
 * first written bytes (a disk read's length; 0 for a write to the disk).
 * pagefoldd hears which pages of guest RAM those were, and visits them
 * first: a disk read of an image other VMs read too is about to be
 * merged (a hint, which changes no page).
 */
void pf_agent_dma_unmap(PfAgent *a, void *host, gsize len, gsize written);

/*
 * A process other than the VMM maps guest RAM from its memfds (a vhost-user
 * back-end), and lets the agent handle its faults there: uffd is a
 * userfaultfd made in that process (without UFFD_USER_MODE_ONLY: its
 * system calls touch guest RAM too), enabled with
 * UFFD_FEATURE_WP_HUGETLBFS_SHMEM and no events, and registered for
 * missing pages and write protection over each of its mappings of guest
 * RAM before it touched them; ranges say where those are.  The agent then
 * write-protects the back-end's mappings of what it merges, and folds a
 * merged page back when the back-end touches it.  Called again with the
 * same name when the back-end's mappings change (a new memory table): it
 * replaces what was said.  The ranges are all it maps of guest RAM: pages
 * elsewhere merge without it.  The agent takes uffd, on failure too.
 * FALSE, with why, when uffd is not a userfaultfd, or a range straddles a
 * region of guest RAM (one outside them is kept, for memory plugged later)
 * or is not registered so in the back-end: the VMM steps back instead
 * (pf_agent_step_back()), as for a back-end that offers nothing.  What
 * write protection cannot see is the back-end's to avoid, as it is the
 * VMM's (pf_agent_dma_map()): it must not pin guest RAM for a device
 * (VFIO, io_uring fixed buffers, O_DIRECT into it) nor write the memfd
 * other than through its mappings; and its userfaultfd, which covers its
 * whole process, is for back-ends of this VM alone.
 */
typedef struct {
    void *host;      /* the VMM's address of the range, in one region */
    gsize size;
    guint64 backend; /* the back-end's address of host */
} PfAgentBackendRange;

gboolean pf_agent_set_backend(PfAgent *a, const char *name, int uffd,
                              const PfAgentBackendRange *ranges, guint n,
                              GError **error);
/*
 * The back-end name is about to map guest RAM, or to map it anew (before
 * the VMM sends it a memory table): nothing merges until
 * pf_agent_set_backend() says where it maps it, or
 * pf_agent_remove_backend() lets it go.  Its faults meanwhile are served
 * where it was told, and wait elsewhere.  May wait for a window of merges
 * in flight (milliseconds), never for pagefoldd.
 */
void pf_agent_expect_backend(PfAgent *a, const char *name);
/*
 * The back-end name disconnected.  Its process may still be unmapping
 * guest RAM: its faults are served, and nothing merges, until no page at
 * either end of its ranges is registered (with any userfaultfd) any more,
 * or its process is gone; then the agent closes the descriptor.  Pages
 * stay as they are.
 */
void pf_agent_remove_backend(PfAgent *a, const char *name);
/*
 * A descriptor of /dev/userfaultfd, as pagefoldd passed it to the agent,
 * for a back-end the VMM started itself and vouches for, which cannot make
 * a userfaultfd that takes the kernel's faults (not root); -1 if the agent
 * holds none.  Never for a peer that merely connected: pagefoldd gives it
 * only to VMMs root vouched for, and it lets its holder take faults the
 * kernel takes for it.
 */
int pf_agent_dup_userfaultfd_dev(PfAgent *a);

/*
 * The system calls through which the agent changes guest RAM.  Tests
 * replace them to make each fail (pf_agent_set_syscalls(), before
 * pf_agent_start()); a VMM never needs to.  Each behaves like the libc
 * call it stands for: -1 (MAP_FAILED) and errno on failure.
 */
typedef struct {
    void *(*mmap)(void *addr, size_t len, int prot, int flags, int fd,
                  off_t offset);
    int (*fallocate)(int fd, int mode, off_t offset, off_t len);
    ssize_t (*pwrite)(int fd, const void *buf, size_t count, off_t offset);
    /* the userfaultfd's */
    int (*ioctl)(int fd, unsigned long request, void *arg);

    int (*madvise)(void *addr, size_t len, int advice);
} PfAgentSyscalls;

void pf_agent_set_syscalls(PfAgent *a, const PfAgentSyscalls *sys);

/*
 * How the agent's one thread is made and joined: GLib's by default; a VMM
 * with its own conventions (QEMU blocks signals in its threads) gives its
 * own, before pf_agent_start().
 */
typedef struct {
    void *(*create)(void *(*fn)(void *), void *arg, void *opaque);
    void (*join)(void *thread, void *opaque);
    void *opaque;
} PfAgentThreads;

void pf_agent_set_threads(PfAgent *a, const PfAgentThreads *threads);

/*
 * Connects to pagefoldd and starts the agent's thread, which announces the
 * VM and its regions, settles the mode, and serves.  Never waits for
 * pagefoldd: FALSE only when it cannot be reached at all (no socket, or it
 * accepts nobody); a pagefoldd that does not answer within seconds leaves
 * the VM running unmerged, in advise mode, saying so.  Nor does any other
 * call here wait for pagefoldd: what it must hear is queued, and the
 * agent's thread sends it.  Raises the process's soft limit on
 * descriptors to its hard limit: every pool chunk the VM comes to share
 * is one.
 */
gboolean pf_agent_start(PfAgent *a, const char *socket_path, GError **error);
/*
 * Waits until the handshake has ended; FALSE, with why, when it failed.
 * For VMMs that may wait (tests, stand-ins): QEMU must not.
 */
gboolean pf_agent_wait_settled(PfAgent *a, GError **error);
/* Disconnects and stops the thread; merged pages stay as they are. */
void pf_agent_free(PfAgent *a);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfAgent, pf_agent_free)

/*
 * Any thread.  The mode is settled by the handshake (advise until then,
 * and for good if it fails) and by pf_agent_step_back().
 */
PfMode pf_agent_get_mode(PfAgent *a);
char *pf_agent_dup_reason(PfAgent *a);
gboolean pf_agent_is_connected(PfAgent *a);
void pf_agent_get_stats(PfAgent *a, PfAgentStats *stats);

typedef struct {
    char *name;
    void *host;
    guint64 size;
    char *refused; /* why it is not merged, or NULL */
} PfAgentRegionInfo;

/*
 * Whether the agent write-protects the region at host now (it merges
 * there): a VMM checking whether guest RAM can be write-protected (QEMU's
 * background snapshot) may count it as such.
 */
gboolean pf_agent_region_protected(PfAgent *a, void *host);

/* The regions the VM has now (PfAgentRegionInfo*, freed with the array). */
GPtrArray *pf_agent_get_regions(PfAgent *a);
void pf_agent_region_info_free(gpointer info);
