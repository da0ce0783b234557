/*
 * agent.c - see agent.h.
 *
 * Measured pitfalls this code is shaped by (docs/DESIGN.md, measured facts):
 *  - with UFFD_FEATURE_EVENT_UNMAP, a MAP_FIXED over a registered range
 *    blocks until the event is read: no event features are asked for, and
 *    the userfaultfd is non-blocking;
 *  - a VMA mapped over a registered range is not registered: the range is
 *    registered again after every remap, so it coalesces back;
 *  - before Linux 6.4 (Debian 12's 6.1) UFFDIO_WRITEPROTECT refuses a range
 *    that spans mappings (ENOENT), and remapped runs are mappings of their
 *    own: such a range is protected piece by piece;
 *  - QEMU not running as root cannot create a userfaultfd that sees KVM's
 *    faults: pagefoldd may pass a /dev/userfaultfd fd to make one with;
 *  - write protection does not stop writes through another mapping of the
 *    memfd or pwrite() (vhost-user), nor a device's writes into a page
 *    pinned for DMA: such VMs stay in advise mode, such pages are skipped;
 *  - a MAP_FIXED that fails may have unmapped the old pages already, and a
 *    private writable mapping can fail on commit accounting
 *    (vm.overcommit_memory=2): the memfd is mapped back at once, after the
 *    content of pages that were mapped from the pool (a move to another
 *    slot) is written into it, where their memfd pages are holes.
 *
 * Every system call that changes guest RAM goes through a->sys, so that
 * tests can make each one fail; every result is checked.  The rule on
 * failure: guest RAM stays exactly as the guest last wrote it, and what is
 * reported to pagefoldd is what is true (a page still mapped from a pool
 * slot is never reported as not merged: pagefoldd would reuse its slot).
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
/*
 * The library's messages, in the VMM's log too (QEMU routes this domain to
 * its own).
 */
#ifndef G_LOG_DOMAIN
#define G_LOG_DOMAIN "pagefold"
#endif

#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

#define POOL_SEALS (F_SEAL_FUTURE_WRITE | F_SEAL_GROW | F_SEAL_SHRINK)
#define HUGE_PAGES 512u /* 4 KiB pages in a 2 MiB huge page */
#define MAX_RUN 512

typedef struct {
    char *name;
    guint8 *host;
    gsize size;
    gsize n_pages;
    int fd;
    guint64 offset;
    int advice[4];
    guint64 *remapped; /* bitmap: pages mapped from the pool */
    /*
     * why this region is not merged (its memfd cannot be remapped here, or
     * write protection refused it), or NULL
     */
    char *refused;
    /*
     * left the VM: no memfd, no bitmap; its index stays, since pagefoldd never
     * reuses one
     */
    gboolean gone;
    gboolean gone_untold; /* gone before READY: GONE follows READY */
    gboolean leaving;     /* being folded back to go: no merge there */
} Region;

typedef struct {
    int fd;
    const guint8 *map; /* PROT_READ, for the compare */
    guint32 n_slots;
} Chunk;

typedef struct {
    const guint8 *lo, *hi;
} DmaRange;

/* A message for pagefoldd, queued in the order things happened. */
typedef struct {
    PfMsgType type;
    guint32 seq;
    int fd; /* a dup, sent with it and closed; or -1 */
    gsize length;
    guint8 payload[];
} Outgoing;

struct _PfAgent {
    char *name;
    guint8 uuid[16];
    GArray *regions; /* Region; grows under work, never shrinks */
    guint announced; /* regions pagefoldd has been told of */
    gboolean ready;  /* READY is queued: new regions are told at once */
    char *advise_reason;
    gboolean advise_untold; /* stepped back: ADVISE once all is folded */
    PfAgentSyscalls sys;

    int sock;
    int uffd;
    gboolean uffd_lost; /* closed because protection could not be lifted */
    GPtrArray *chunks;  /* Chunk*, indexed by chunk id, NULL where unknown */

    PfAgentThreads threads;
    void *thread;
    int stop[2];
    int wake[2]; /* something was queued for pagefoldd */
    /*
     * held while pages are remapped or folded back, and while what pagefoldd
     * must hear of it is queued: the outbox is in the order it happened.
     * Never held while waiting for pagefoldd: the VMM's threads take it (a
     * discard under QEMU's big lock), and pagefoldd may be stuck
     */
    GMutex work;
    /*
     * the ranges in DMA; held across every change of a mapping, so that a new
     * DMA waits for it (lock order: work, then dma)
     */
    GMutex dma;
    GArray *dma_ranges; /* DmaRange, one per mapping the VMM made */
    GMutex out;  /* outbox, posting */
    GQueue outbox;      /* Outgoing*, sent by the agent thread alone */
    /*
     * the link takes messages: from the connect until it ends, or an ERROR is
     * queued
     */
    gboolean posting;
    gboolean hangup;    /* an ERROR is queued: shut the link after it */
    GMutex lock; /* stats, connected, settled, mode, reason */
    GCond settled_cond;
    gboolean settled;   /* the handshake ended, one way or the other */
    char *start_error;  /* why it failed, or NULL */
    PfMode mode;        /* changes under work and lock */
    char *reason;
    PfAgentStats stats;
    gboolean connected;
};

static const guint8 zero_page[PF_PAGE_SIZE];

/* ---- the system calls, behind the seam ---- */

static int
real_ioctl(int fd, unsigned long request, void *arg)
{
    return ioctl(fd, request, arg);
}

static const PfAgentSyscalls real_syscalls = {
    mmap, fallocate, pwrite, real_ioctl, madvise,
};

static void *
gthread_create(void *(*fn)(void *), void *arg, void *opaque)
{
    return g_thread_new("pagefold-agent", fn, arg);
}

static void
gthread_join(void *thread, void *opaque)
{
    g_thread_join(thread);
}

static const PfAgentThreads gthreads = { gthread_create, gthread_join, NULL };

void
pf_agent_set_threads(PfAgent *a, const PfAgentThreads *threads)
{
    a->threads = threads != NULL ? *threads : gthreads;
}

void
pf_agent_set_syscalls(PfAgent *a, const PfAgentSyscalls *sys)
{
    a->sys = sys != NULL ? *sys : real_syscalls;
}

/* ---- which pages are remapped ---- */

static inline gboolean
is_remapped(const Region *r, gsize page)
{
    return (r->remapped[page / 64] >> (page % 64)) & 1;
}

/* Marks pages [from, to) remapped or not; returns how many changed. */
static gsize
mark_remapped(PfAgent *a, Region *r, gsize from, gsize to, gboolean on)
{
    gsize changed = 0;

    for (gsize page = from; page < to; page++) {
        if (on != is_remapped(r, page)) {
            r->remapped[page / 64] ^= 1ull << (page % 64);
            changed++;
        }
    }
    g_mutex_lock(&a->lock);
    if (on) {
        a->stats.remapped += changed;
    } else {
        a->stats.remapped -= changed;
    }
    g_mutex_unlock(&a->lock);
    return changed;
}

/* The first page in [from, to) that is remapped (want) or not, or to. */
static gsize
find_remapped(const Region *r, gsize from, gsize to, gboolean want)
{
    while (from < to && is_remapped(r, from) != want) {
        if (from % 64 == 0 && to - from >= 64 &&
            r->remapped[from / 64] == (want ? 0 : ~0ull)) {
            from += 64;
        } else {
            from++;
        }
    }
    return MIN(from, to);
}

/* ---- pages in DMA ---- */

void
pf_agent_dma_map(PfAgent *a, void *host, gsize len)
{
    DmaRange d = { host, (const guint8 *)host + len };

    g_mutex_lock(&a->dma);
    g_array_append_val(a->dma_ranges, d);
    g_mutex_unlock(&a->dma);
}

void
pf_agent_dma_unmap(PfAgent *a, void *host, gsize len)
{
    g_mutex_lock(&a->dma);
    for (guint i = 0; i < a->dma_ranges->len; i++) {
        DmaRange *d = &g_array_index(a->dma_ranges, DmaRange, i);

        if (d->lo == host && d->hi == (const guint8 *)host + len) {
            g_array_remove_index_fast(a->dma_ranges, i);
            break;
        }
    }
    g_mutex_unlock(&a->dma);
}

/* Is any page of [lo, hi) in DMA?  Called with a->dma held. */
static gboolean
in_dma(PfAgent *a, const guint8 *lo, const guint8 *hi)
{
    for (guint i = 0; i < a->dma_ranges->len; i++) {
        const DmaRange *d = &g_array_index(a->dma_ranges, DmaRange, i);

        if (d->lo < hi && lo < d->hi) {
            return TRUE;
        }
    }
    return FALSE;
}

/* ---- userfaultfd ---- */

static int
uffd_create(int dev_fd)
{
    int fd = -1;

    if (dev_fd >= 0) {
        fd = ioctl(dev_fd, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
    }
    if (fd < 0) {
        fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    }
    return fd;
}

static int
uffd_ioctl(PfAgent *a, unsigned long request, void *arg)
{
    if (a->uffd < 0) {
        return -EBADF;
    }
    return a->sys.ioctl(a->uffd, request, arg) < 0 ? -errno : 0;
}

static int
uffd_register(PfAgent *a, void *addr, gsize len)
{
    struct uffdio_register reg = {
        .range = { (guint64)(guintptr)addr, len },
        .mode = UFFDIO_REGISTER_MODE_WP,
    };

    return uffd_ioctl(a, UFFDIO_REGISTER, &reg);
}

/*
 * Write-protects [addr, addr + len), or lifts the protection (which wakes
 * the writers that blocked on it).  Before Linux 6.4 one call must stay
 * within one mapping, and ENOENT says it did not: the range is then
 * halved until each piece fits.  A call that fails changes nothing, so
 * the pieces done stay done.  Lifting goes on past a piece that fails, to
 * free every writer it can; a single page that is not registered (mapped
 * since) has no protection to lift.
 */
static int
uffd_protect(PfAgent *a, guint8 *addr, gsize len, gboolean on)
{
    struct uffdio_writeprotect wp = {
        .range = { (guint64)(guintptr)addr, len },
        .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0,
    };
    int rc = uffd_ioctl(a, UFFDIO_WRITEPROTECT, &wp);
    gsize half;

    if (rc != -ENOENT) {
        return rc;
    }
    if (len <= PF_PAGE_SIZE) {
        return on ? rc : 0;
    }
    half = len / PF_PAGE_SIZE / 2 * PF_PAGE_SIZE;
    rc = uffd_protect(a, addr, half, on);
    if (rc == 0 || !on) {
        int rc2 = uffd_protect(a, addr + half, len - half, on);

        rc = rc < 0 ? rc : rc2;
    }
    return rc;
}

/*
 * Lifts the protection of [addr, addr + len).  It must not fail: a page
 * left protected blocks its writer (a vCPU, an I/O thread) for good.  If
 * the kernel refuses, the range is unregistered, which lifts it too
 * (Linux 6.0+), and its writers woken; if even that fails, the
 * userfaultfd is closed, which lets every writer go, and this VM merges
 * nothing more.
 */
static void
uffd_release(PfAgent *a, guint8 *addr, gsize len)
{
    struct uffdio_range range = { (guint64)(guintptr)addr, len };
    int rc = uffd_protect(a, addr, len, FALSE);

    if (rc == 0 || a->uffd < 0) {
        return;
    }
    g_warning("pagefold agent: cannot lift write protection at %p+%zu: %s; "
              "unregistering it", addr, len, g_strerror(-rc));
    /* Unregistering does not wake a writer blocked on protection. */
    rc = uffd_ioctl(a, UFFDIO_UNREGISTER, &range);
    if (rc == 0) {
        rc = uffd_ioctl(a, UFFDIO_WAKE, &range);
        if (rc == 0) {
            return;
        }
    }
    g_warning("pagefold agent: cannot unregister and wake %p+%zu: %s; "
              "closing the userfaultfd", addr, len, g_strerror(-rc));
    close(a->uffd);
    a->uffd = -1;
    a->uffd_lost = TRUE;
}

/* Why the pages of r cannot be remapped in this process, or NULL. */
static char *
region_unsafe(const Region *r)
{
    int seals = fcntl(r->fd, F_GET_SEALS);
    int fl = fcntl(r->fd, F_GETFL);
    int mode = MPOL_DEFAULT;

    /* The punch after each merge must work, or memory is never freed. */
    if (fl < 0 || (fl & O_ACCMODE) != O_RDWR) {
        return g_strdup_printf("region %s: its memfd is not open for writing",
                               r->name);
    }
    if (seals > 0 && (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))) {
        return g_strdup_printf("region %s: its memfd is sealed against writing",
                               r->name);
    }
    /*
     * A page mapped from the pool lives where pagefoldd wrote it, and its
     * copy on write follows the pool file's policy: a private mapping of
     * shmem has no policy of its own (mbind() on it would set the pool
     * file's, for every VM).  Bound RAM stays plain memfd.
     */
    if (syscall(SYS_get_mempolicy, &mode, NULL, 0, r->host, MPOL_F_ADDR) == 0 &&
        mode != MPOL_DEFAULT) {
        return g_strdup_printf("region %s has a NUMA memory policy "
                               "(host-nodes, policy): pages mapped from "
                               "pagefold's pool would not follow it",
                               r->name);
    }
    return NULL;
}

/*
 * Locked guest memory (mlockall(MCL_FUTURE): QEMU -overcommit
 * mem-lock=on, libvirt <locked/>) populates every new private mapping by
 * write faults: each merge would be copied on write at once.  Seen by
 * mapping a page: locked, it is resident before anyone touches it.
 */
static gboolean
memory_locked(void)
{
    unsigned char vec = 0;
    void *probe = mmap(NULL, PF_PAGE_SIZE, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    gboolean locked;

    if (probe == MAP_FAILED) {
        return FALSE;
    }
    locked = mincore(probe, PF_PAGE_SIZE, &vec) == 0 && (vec & 1);
    munmap(probe, PF_PAGE_SIZE);
    return locked;
}

/*
 * Write-protects r for merging, or says in r->refused why it is not
 * merged: one odd region (a memfd this process cannot punch, a NUMA
 * binding, a file system without write protection) costs no other.
 */
static void
region_protect(PfAgent *a, Region *r)
{
    int rc;

    r->refused = region_unsafe(r);
    if (r->refused == NULL) {
        rc = uffd_register(a, r->host, r->size);
        if (rc < 0) {
            r->refused = g_strdup_printf(
                "cannot write-protect region %s: %s%s", r->name,
                g_strerror(-rc),
                rc == -EBUSY ? " (postcopy or background snapshot already "
                               "uses userfaultfd)" : "");
        }
    }
}

static void
say_refused(PfAgent *a, const Region *r)
{
    g_message("pagefold agent: VM %s: %s; its other RAM merges", a->name,
              r->refused);
}

static gboolean
region_merges(const Region *r)
{
    return !r->gone && r->refused == NULL;
}

/*
 * Makes the userfaultfd and registers guest RAM for write protection; on
 * failure says why the VM must stay in advise mode (the reason of the
 * first region when none can merge), and holds nothing registered
 * (postcopy or a background snapshot may want it later).
 */
static gboolean
uffd_setup(PfAgent *a, int dev_fd, char **why)
{
    struct uffdio_api api = { .api = UFFD_API, .features = 0 };
    int probe;
    guint64 supported;

    if (memory_locked()) {
        *why = g_strdup("guest memory is locked (mlockall: -overcommit "
                        "mem-lock=on, libvirt <locked/>): every merged page "
                        "would be copied back at once");
        return FALSE;
    }
    probe = uffd_create(dev_fd);
    if (probe < 0) {
        *why = g_strdup_printf("cannot create a userfaultfd: %s (QEMU needs "
                               "root, or /dev/userfaultfd from pagefoldd)",
                               g_strerror(errno));
        return FALSE;
    }
    if (ioctl(probe, UFFDIO_API, &api) < 0) {
        *why = g_strdup_printf("UFFDIO_API: %s", g_strerror(errno));
        close(probe);
        return FALSE;
    }
    supported = api.features;
    close(probe);
    if (!(supported & UFFD_FEATURE_WP_HUGETLBFS_SHMEM)) {
        *why = g_strdup("this kernel has no userfaultfd write protection for "
                        "shmem (Linux 5.19+)");
        return FALSE;
    }
    a->uffd = uffd_create(dev_fd);
    api.api = UFFD_API;
    api.features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
    if (a->uffd < 0 || ioctl(a->uffd, UFFDIO_API, &api) < 0) {
        *why = g_strdup_printf("userfaultfd: %s", g_strerror(errno));
    }
    for (guint i = 0; i < a->regions->len && *why == NULL; i++) {
        Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone) {
            region_protect(a, r);
        }
    }
    if (*why == NULL) {
        const char *first = NULL;

        for (guint i = 0; i < a->regions->len; i++) {
            const Region *r = &g_array_index(a->regions, Region, i);

            if (region_merges(r)) {
                for (guint j = 0; j < a->regions->len; j++) {
                    r = &g_array_index(a->regions, Region, j);
                    if (!r->gone && r->refused != NULL) {
                        say_refused(a, r);
                    }
                }
                return TRUE;
            }
            first = first != NULL || r->gone ? first : r->refused;
        }
        *why = g_strdup(first != NULL ? first : "no guest RAM left to merge");
    }
    if (a->uffd >= 0) {
        /* Closing it unregisters whatever was registered. */
        close(a->uffd);
        a->uffd = -1;
    }
    return FALSE;
}

/* ---- mappings ---- */

/* A fresh mapping has none of the region's advice: give it again. */
static int
readvise(PfAgent *a, const Region *r, void *addr, gsize len)
{
    for (guint i = 0; i < G_N_ELEMENTS(r->advice) && r->advice[i] != 0; i++) {
        if (a->sys.madvise(addr, len, r->advice[i]) < 0) {
            return -errno;
        }
    }
    return 0;
}

/*
 * Is every page of [addr, addr + len) mapped?  A MAP_FIXED that failed may
 * have unmapped the old pages first; mincore() fails with ENOMEM where
 * any page is not mapped, mapped pages need not be resident.
 */
static gboolean
range_mapped(const guint8 *addr, gsize len)
{
    unsigned char vec[64];

    for (gsize off = 0; off < len; off += sizeof(vec) * PF_PAGE_SIZE) {
        if (mincore((void *)(addr + off),
                    MIN(len - off, sizeof(vec) * PF_PAGE_SIZE), vec) < 0 &&
            errno == ENOMEM) {
            return FALSE;
        }
    }
    return TRUE;
}

/*
 * Maps pages [from, to) of r from its memfd again, shared, as the VMM
 * mapped them.  Called where the previous mapping is to go, or is gone
 * already: a failed MAP_FIXED may have unmapped it first (mincore() tells
 * a hole).  A hole cannot be left in guest RAM, so a failure there is
 * tried once more and then ends the process, as the guest's next access
 * there would.  Returns 0 with the memfd mapped, or -errno with the old
 * mapping still in place.
 */
static int
map_memfd(PfAgent *a, Region *r, gsize from, gsize to)
{
    guint8 *addr = r->host + from * PF_PAGE_SIZE;
    gsize len = (to - from) * PF_PAGE_SIZE;
    int rc = 0;

    for (int attempt = 0; attempt < 2; attempt++) {
        if (a->sys.mmap(addr, len, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_FIXED, r->fd,
                        (off_t)(r->offset + from * PF_PAGE_SIZE)) !=
            MAP_FAILED) {
            rc = readvise(a, r, addr, len);
            if (rc < 0) {
                /* The page is right, only its advice is missing. */
                g_warning("pagefold agent: advice for %s at %p+%zu: %s",
                          r->name, addr, len, g_strerror(-rc));
            }
            return 0;
        }
        rc = -errno;
        if (range_mapped(addr, len)) {
            return rc; /* still mapped as before */
        }
    }
    g_error("pagefold agent: cannot map guest RAM %s at %p+%zu back from its "
            "memfd: %s", r->name, addr, len, g_strerror(-rc));
}

/*
 * Copies the remapped pages [from, to) into the memfd, under write
 * protection: their own content, or with src the content they are known
 * to have (src holds page from, then the next ones), for when they are no
 * longer mapped.  A zero page is punched, not trusted to be a hole
 * already: its merge may have left the old page there.
 */
static int
copy_back(PfAgent *a, Region *r, gsize from, gsize to, const guint8 *src)
{
    for (gsize v = from; v < to; v++) {
        const guint8 *page = src != NULL ? src + (v - from) * PF_PAGE_SIZE
                                         : r->host + v * PF_PAGE_SIZE;
        off_t off = (off_t)(r->offset + v * PF_PAGE_SIZE);

        if (memcmp(page, zero_page, PF_PAGE_SIZE) == 0 &&
            a->sys.fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                             off, PF_PAGE_SIZE) == 0) {
            continue;
        }
        errno = 0;
        if (a->sys.pwrite(r->fd, page, PF_PAGE_SIZE, off) != PF_PAGE_SIZE) {
            return errno ? -errno : -EIO;
        }
    }
    return 0;
}

/*
 * Maps the memfd again over the remapped pages of [first, first + n).
 * With copy, their content goes back into the memfd first, under write
 * protection so that no write falls between the copy and the mapping; a
 * run of remapped pages in DMA is not touched (the device's write would
 * land in the copy left behind), the others are, and -EBUSY says so.  Only
 * the merged pages count: QEMU keeps some guest RAM mapped for writing
 * for as long as a device runs (AHCI's receive areas, vhost's used
 * rings).  Without copy, the pages are about to be discarded and their
 * content does not matter (nor is any page busy).  Stops at the first
 * failure: pages before *stop are in the memfd, the others as they were
 * (remapped and valid).  Returns 0 or -errno; adds the pages folded back
 * to *folded, if given.  The caller holds a->dma.
 */
static int
fold_back_locked(PfAgent *a, Region *r, gsize first, gsize n, gboolean copy,
                 gsize *stop, gsize *folded)
{
    guint8 *hva = r->host + first * PF_PAGE_SIZE;
    gsize len = n * PF_PAGE_SIZE;
    gsize t = find_remapped(r, first, first + n, TRUE);
    gboolean busy = FALSE;
    int rc = 0;

    *stop = first;
    if (t == first + n) {
        *stop = first + n;
        return 0;
    }
    /* Remapped pages are VMAs of their own, not registered yet. */
    if (copy) {
        rc = uffd_register(a, hva, len);
        if (rc >= 0) {
            rc = uffd_protect(a, hva, len, TRUE);
        }
        if (rc < 0) {
            if (a->uffd >= 0) {
                uffd_release(a, hva, len);
            }
            return rc;
        }
    }
    while (t < first + n) {
        gsize u = find_remapped(r, t, first + n, FALSE);

        *stop = t;
        if (copy && in_dma(a, r->host + t * PF_PAGE_SIZE,
                           r->host + u * PF_PAGE_SIZE)) {
            /* Left as it is; the others are folded back all the same. */
            busy = TRUE;
            t = find_remapped(r, u, first + n, TRUE);
            continue;
        }
        if (copy) {
            rc = copy_back(a, r, t, u, NULL);
            if (rc < 0) {
                break;
            }
        }
        rc = map_memfd(a, r, t, u);
        if (rc < 0) {
            /*
             * Still remapped: its memfd pages are holes again, where
             * pagefoldd looks for copy-on-write (it looks among data too,
             * should this punch fail).
             */
            if (copy &&
                a->sys.fallocate(r->fd,
                                 FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                 (off_t)(r->offset + t * PF_PAGE_SIZE),
                                 (off_t)((u - t) * PF_PAGE_SIZE)) < 0) {
                g_warning("pagefold agent: cannot punch %s again: %s", r->name,
                          g_strerror(errno));
            }
            break;
        }
        u = MIN(u, first + n);
        if (folded != NULL) {
            *folded += mark_remapped(a, r, t, u, FALSE);
        } else {
            mark_remapped(a, r, t, u, FALSE);
        }
        t = find_remapped(r, u, first + n, TRUE);
    }
    if (rc == 0 && busy) {
        rc = -EBUSY;
    } else if (rc == 0) {
        *stop = first + n;
    }
    /*
     * Registered again, the range coalesces with its neighbours (if that
     * fails, the next fold-back registers it); lifting the protection
     * wakes any writer that blocked meanwhile.
     */
    (void)uffd_register(a, hva, len);
    if (copy) {
        uffd_release(a, hva, len);
    }
    return rc;
}

/* fold_back_locked(), for callers that do not hold a->dma. */
static int
fold_back(PfAgent *a, Region *r, gsize first, gsize n, gboolean copy,
          gsize *stop, gsize *folded)
{
    int rc;

    g_mutex_lock(&a->dma);
    rc = fold_back_locked(a, r, first, n, copy, stop, folded);
    g_mutex_unlock(&a->dma);
    return rc;
}

/* ---- what pagefoldd hears ---- */

static void
outgoing_free(gpointer p)
{
    Outgoing *o = p;

    if (o->fd >= 0) {
        close(o->fd);
    }
    g_free(o);
}

/*
 * Queues a message for pagefoldd; the agent thread sends it.  Called with
 * a->work held (or before the agent thread runs), so that pagefoldd hears
 * of things in the order they happened, and no thread of the VMM waits on
 * pagefoldd's socket.  fd, if not -1, is duplicated.  Nothing is queued
 * after an ERROR, nor once the link is gone.
 */
static void
post(PfAgent *a, PfMsgType type, guint32 seq, const void *payload, gsize length,
     int fd)
{
    Outgoing *o = g_malloc(sizeof(*o) + length);
    int e = 0;

    o->type = type;
    o->seq = seq;
    o->length = length;
    memcpy(o->payload, payload, length);
    o->fd = -1;
    if (fd >= 0) {
        o->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (o->fd < 0) {
            e = errno;
        }
    }
    g_mutex_lock(&a->out);
    if (!a->posting) {
        g_mutex_unlock(&a->out);
        outgoing_free(o);
        return;
    }
    if (e != 0) {
        /* The message cannot go, and what follows it would be wrong. */
        g_autofree char *text =
            g_strdup_printf("cannot duplicate a descriptor to send: %s",
                            g_strerror(e));

        g_warning("pagefold agent: %s; disconnecting", text);
        o = g_realloc(o, sizeof(*o) + strlen(text));
        o->type = type = PF_MSG_ERROR;
        o->length = strlen(text);
        memcpy(o->payload, text, o->length);
    }
    g_queue_push_tail(&a->outbox, o);
    if (type == PF_MSG_ERROR) {
        a->posting = FALSE;
        a->hangup = TRUE;
    }
    g_mutex_unlock(&a->out);
    /* A full pipe is readable already. */
    (void)!write(a->wake[1], "x", 1);
}

static void
post_error(PfAgent *a, const char *text)
{
    post(a, PF_MSG_ERROR, 0, text, MIN(strlen(text), 1024), -1);
}

#define FOLD_CHUNK HUGE_PAGES /* pages folded back per hold of the locks */

/*
 * Tells pagefoldd (DISCARD) which pages of region i in [from, from + n)
 * are back in their memfd: those remapped in was (bit k: page from + k)
 * and not any more.  One DISCARD a span between pages still remapped
 * (pagefoldd passes over the pages of a span that were never merged).
 * Called with work held.
 */
static void
tell_folded(PfAgent *a, guint i, gsize from, gsize n, const guint64 *was)
{
    const Region *r = &g_array_index(a->regions, Region, i);
    gsize k = 0;

    while (k < n) {
        PfWireRange wr = { i, 0, from + k, 0 };
        gboolean back = FALSE;
        gsize run = k;

        while (run < n && !is_remapped(r, from + run)) {
            back |= (was[run / 64] >> (run % 64)) & 1;
            run++;
        }
        if (back) {
            wr.n_pages = run - k;
            post(a, PF_MSG_DISCARD, 0, &wr, sizeof(wr), -1);
        }
        k = run + 1;
    }
}

/*
 * Folds back the remapped pages of region i (with copy, their content
 * too) a chunk at a time, holding work and dma, and write-protecting, one
 * chunk only: the guest writes elsewhere, and the VMM's DMA and discards
 * go on, meanwhile.  pagefoldd is told of every page back in its memfd.
 * The caller has made sure nothing merges there meanwhile (advise mode, a
 * region leaving).  Runs in DMA are left and -EBUSY returned at the end;
 * any other failure stops at once.  Called without work.
 */
static int
fold_back_region(PfAgent *a, guint i, gboolean copy)
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
        first = r->gone ? r->n_pages : find_remapped(r, at, r->n_pages, TRUE);
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
            was[k / 64] |= (guint64)is_remapped(r, first + k) << (k % 64);
        }
        if (copy && a->uffd < 0) {
            rc = -EBADF; /* no safe way to fold back any more */
        } else {
            rc = fold_back(a, r, first, n, copy, &stop, NULL);
        }
        tell_folded(a, i, first, n, was);
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

/* ---- items ---- */

static gboolean
item_valid(PfAgent *a, const PfWireItem *it)
{
    const Region *r;

    if (it->region >= a->regions->len) {
        return FALSE;
    }
    r = &g_array_index(a->regions, Region, it->region);
    /*
     * A region gone has no pages; one refused is not write-protected, one
     * leaving takes no new merge (an unmerge finds nothing remapped there,
     * or folds its page back, and says so).
     */
    if (r->gone ||
        ((r->refused != NULL || r->leaving) && it->kind != PF_ITEM_UNMERGE) ||
        it->page >= r->n_pages) {
        return FALSE;
    }
    if (it->kind == PF_ITEM_COLLAPSE) {
        return it->page % HUGE_PAGES == 0 &&
               it->page + HUGE_PAGES <= r->n_pages &&
               (guintptr)(r->host + it->page * PF_PAGE_SIZE) %
               (HUGE_PAGES * PF_PAGE_SIZE) == 0;
    }
    if (it->kind == PF_ITEM_MERGE || it->kind == PF_ITEM_ZERO) {
        const Chunk *c = it->chunk < a->chunks->len
                         ? g_ptr_array_index(a->chunks, it->chunk) : NULL;

        return c != NULL && it->slot < c->n_slots;
    }
    return TRUE;
}

/* Does item b continue the run that item a..prev forms? */
static gboolean
continues(const PfWireItem *first, guint32 k, const PfWireItem *it)
{
    return it->kind == first->kind &&
           (it->kind == PF_ITEM_MERGE || it->kind == PF_ITEM_ZERO) &&
           it->region == first->region && it->page == first->page + k &&
           it->chunk == first->chunk && it->slot == first->slot + k;
}

#define WINDOW_PAGES 4096u /* 16 MiB */

static guint64
extent_of_page(const Region *r, guint64 page)
{
    return ((guintptr)r->host + page * PF_PAGE_SIZE) /
           (HUGE_PAGES * PF_PAGE_SIZE);
}

/*
 * Does it join the window of first, which spans pages [lo, hi)?  Within
 * WINDOW_PAGES, and never across a 2 MiB extent with no item in it:
 * protecting a page splits its huge mapping, which merging does anyway
 * where it merges, but must not do where it does not.
 */
static gboolean
is_window_item(PfAgent *a, const PfWireItem *first, const PfWireItem *it,
               guint64 lo, guint64 hi)
{
    const Region *r;
    guint64 e;

    if ((it->kind != PF_ITEM_MERGE && it->kind != PF_ITEM_ZERO) ||
        it->region != first->region || !item_valid(a, it) ||
        MAX(hi, it->page + 1) - MIN(lo, it->page) > WINDOW_PAGES) {
        return FALSE;
    }
    r = &g_array_index(a->regions, Region, it->region);
    e = extent_of_page(r, it->page);
    return e + 1 >= extent_of_page(r, lo) && e <= extent_of_page(r, hi - 1) + 1;
}

static void
set_result(PfWireResult *res, PfResultStatus status, int err)
{
    memset(res, 0, sizeof(*res));
    res->status = (guint8)status;
    res->err = err;
}

/*
 * The MAP_FIXED of pool slots over pages [from, to) of r failed after the
 * kernel unmapped the old pages.  Each page's content is known: it
 * compared equal to its slot, under write protection.  A page that was in
 * the memfd still is (nothing was punched), but one remapped already (a
 * move from another slot) has a hole there, which the guest would read as
 * zeros: its slot's content goes into the memfd first.  Then the memfd is
 * mapped over the run.  Guest RAM cannot be left a hole nor lose content:
 * if the copy fails, the process ends, as map_memfd() does (and as the
 * guest's next access there would).
 */
static void
restore_unmapped(PfAgent *a, Region *r, gsize from, gsize to, const Chunk *c,
                 guint32 slot)
{
    for (gsize t = find_remapped(r, from, to, TRUE); t < to;) {
        gsize u = find_remapped(r, t, to, FALSE);
        int rc = copy_back(a, r, t, u,
                           c->map + (gsize)(slot + (t - from)) * PF_PAGE_SIZE);

        if (rc < 0) {
            g_error("pagefold agent: cannot write merged pages of guest RAM "
                    "%s at %p+%zu into its memfd, after mapping them from the "
                    "pool failed: %s", r->name, r->host + t * PF_PAGE_SIZE,
                    (u - t) * PF_PAGE_SIZE, g_strerror(-rc));
        }
        t = find_remapped(r, u, to, TRUE);
    }
    /*
     * The old pages are gone, so this maps the memfd (or ends the
     * process): a failure that leaves the range mapped cannot happen.
     */
    if (map_memfd(a, r, from, to) == 0) {
        mark_remapped(a, r, from, to, FALSE);
    }
}

/*
 * Maps pool slots over pages [from, to) of r, which are write-protected
 * and equal to them, then punches the pages out of the memfd.  Pages
 * remapped already are moved: pagefoldd maps them from another slot of
 * the same content, and their memfd pages are holes already (the punch
 * changes nothing there).  If the advice or the punch fails, the merge is
 * undone the safe way, by folding back (a write that came since went to
 * the new private copy; a moved page goes into the memfd with what it
 * holds).  Returns 0, or -errno with each page as before (its memfd, or
 * its old slot) or, where the old mapping could not be kept, back in the
 * memfd with its content.  The caller holds a->dma.
 */
static int
remap_run(PfAgent *a, Region *r, gsize from, gsize to, const Chunk *c,
          guint32 slot)
{
    guint8 *addr = r->host + from * PF_PAGE_SIZE;
    gsize len = (to - from) * PF_PAGE_SIZE, stop;
    const char *what;
    int rc;

    if (a->sys.mmap(addr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED,
                    c->fd, (off_t)slot * PF_PAGE_SIZE) == MAP_FAILED) {
        rc = -errno;
        /*
         * Still mapped, the pages are as they were: the memfd, or their
         * old slots (whose memfd pages are holes: mapping the memfd over
         * them would lose them).
         */
        if (!range_mapped(addr, len)) {
            restore_unmapped(a, r, from, to, c, slot);
        }
        return rc;
    }
    mark_remapped(a, r, from, to, TRUE);
    /* Only now is the old page unreachable: drop it from the memfd. */
    rc = readvise(a, r, addr, len);
    if (rc < 0) {
        what = "advice";
    } else if (a->sys.fallocate(r->fd,
                                FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                (off_t)(r->offset + from * PF_PAGE_SIZE),
                                (off_t)len) < 0) {
        rc = -errno;
        what = "punch";
    } else {
        return 0;
    }
    g_warning("pagefold agent: %s after merging %s at %p+%zu: %s; "
              "folding it back", what, r->name, addr, len, g_strerror(-rc));
    if (fold_back_locked(a, r, from, to - from, TRUE, &stop, NULL) < 0) {
        /* Still merged, and valid: that is what pagefoldd must hear. */
        return 0;
    }
    return rc;
}

/*
 * k consecutive pages to k consecutive pool slots: the slots' content
 * (merge), or zero slots when the pages are zero (zero).  The pages are
 * write-protected already (exec_window): what is compared is what stays.
 * A page in DMA is refused: a device may write it behind the protection.
 * moved[t] says whether page t, if done, came from another slot.
 */
static void
exec_run(PfAgent *a, const PfWireItem *first, guint32 k, PfWireResult *res,
         gboolean *moved)
{
    Region *r = &g_array_index(a->regions, Region, first->region);
    const Chunk *c = g_ptr_array_index(a->chunks, first->chunk);
    gboolean zero = first->kind == PF_ITEM_ZERO;
    guint8 *hva = r->host + first->page * PF_PAGE_SIZE;
    gboolean done[MAX_RUN] = { FALSE };

    for (guint32 t = 0; t < k; t++) {
        const guint8 *slot = c->map + (gsize)(first->slot + t) * PF_PAGE_SIZE;
        guint8 *page = hva + (gsize)t * PF_PAGE_SIZE;

        if (in_dma(a, page, page + PF_PAGE_SIZE)) {
            set_result(&res[t], PF_RESULT_ERROR, EBUSY);
            continue;
        }
        /* A zero page maps a zero slot: both must be zero. */
        done[t] = memcmp(page, slot, PF_PAGE_SIZE) == 0 &&
                  (!zero || memcmp(slot, zero_page, PF_PAGE_SIZE) == 0);
        moved[t] = done[t] && is_remapped(r, first->page + t);
        set_result(&res[t], done[t] ? PF_RESULT_DONE : PF_RESULT_CHANGED, 0);
    }
    for (guint32 t = 0; t < k;) {
        guint32 u = t;
        int rc;

        if (!done[t]) {
            t++;
            continue;
        }
        while (u < k && done[u]) {
            u++;
        }
        rc = remap_run(a, r, first->page + t, first->page + u, c,
                       first->slot + t);
        for (guint32 v = t; rc < 0 && v < u; v++) {
            set_result(&res[v], PF_RESULT_ERROR, -rc);
        }
        t = u;
    }
}

/*
 * Merge and zero items of one region within WINDOW_PAGES of each other
 * share their system calls: one write protection of the window, runs
 * remapped, then the window registered again (the new mappings are not),
 * unprotected (which wakes every writer that blocked meanwhile; they retry
 * on whatever the page is now).  Each of those calls flushes TLBs or walks
 * mappings: per window, not per run.  A DMA mapping of these pages waits
 * until the window is done.
 */
static void
exec_window(PfAgent *a, const PfWireItem *items, guint32 n, guint64 lo,
            guint64 hi, PfWireResult *res, gboolean *moved)
{
    Region *r = &g_array_index(a->regions, Region, items[0].region);
    guint8 *hva = r->host + lo * PF_PAGE_SIZE;
    gsize len = (hi - lo) * PF_PAGE_SIZE;
    int rc;

    g_mutex_lock(&a->dma);
    rc = uffd_register(a, hva, len);
    if (rc >= 0) {
        rc = uffd_protect(a, hva, len, TRUE);
    }
    if (rc < 0) {
        for (guint32 t = 0; t < n; t++) {
            set_result(&res[t], PF_RESULT_ERROR, -rc);
        }
        if (a->uffd >= 0) {
            uffd_release(a, hva, len); /* pieces of it may be protected */
        }
        g_mutex_unlock(&a->dma);
        return;
    }
    for (guint32 i = 0; i < n;) {
        guint32 k = 1;

        while (i + k < n && k < MAX_RUN &&
               continues(&items[i], k, &items[i + k])) {
            k++;
        }
        exec_run(a, &items[i], k, &res[i], &moved[i]);
        i += k;
    }
    /* If this fails, the next fold-back registers the new mappings. */
    (void)uffd_register(a, hva, len);
    uffd_release(a, hva, len);
    g_mutex_unlock(&a->dma);
}

/* Folds one page back: its content into the memfd, the memfd mapped again. */
static void
exec_unmerge(PfAgent *a, const PfWireItem *it, PfWireResult *res)
{
    gsize stop;
    int rc = fold_back(a, &g_array_index(a->regions, Region, it->region),
                       it->page, 1, TRUE, &stop, NULL);

    set_result(res, rc < 0 ? PF_RESULT_ERROR : PF_RESULT_DONE, -rc);
}

/*
 * Back to a huge page, once every page of the extent is unmerged.  The
 * kernel will not collapse a range registered for write protection, so it
 * is unregistered for the collapse: no page of it is protected then.
 */
static void
exec_collapse(PfAgent *a, const PfWireItem *it, PfWireResult *res)
{
    Region *r = &g_array_index(a->regions, Region, it->region);
    guint8 *hva = r->host + it->page * PF_PAGE_SIZE;
    gsize len = (gsize)HUGE_PAGES * PF_PAGE_SIZE;
    struct uffdio_range range = { (guint64)(guintptr)hva, len };
    int err = 0, rc;

    rc = uffd_ioctl(a, UFFDIO_UNREGISTER, &range);
    if (rc < 0) {
        set_result(res, PF_RESULT_ERROR, -rc);
        return;
    }
    if (a->sys.madvise(hva, len, MADV_COLLAPSE) < 0) {
        err = errno;
    }
    rc = uffd_register(a, hva, len);
    if (rc < 0) {
        /*
         * Unregistered, these pages cannot be merged: say so, it is
         * tried again at the next merge there.
         */
        err = -rc;
    }
    set_result(res, err ? PF_RESULT_ERROR : PF_RESULT_DONE, err);
}

/*
 * A merge or zero item done on a page that was remapped already moved it
 * from one slot to another: counted apart, so that merged and zeroed stay
 * pages that left the memfd.
 */
static void
count_results(PfAgent *a, const PfWireItem *items, const PfWireResult *res,
              const gboolean *moved, guint32 n)
{
    g_mutex_lock(&a->lock);
    a->stats.requests++;
    for (guint32 i = 0; i < n; i++) {
        if (res[i].status == PF_RESULT_CHANGED) {
            a->stats.changed++;
        } else if (res[i].status == PF_RESULT_ERROR) {
            a->stats.errors++;
        } else if (moved[i]) {
            a->stats.moved++;
        } else if (items[i].kind == PF_ITEM_MERGE) {
            a->stats.merged++;
        } else if (items[i].kind == PF_ITEM_ZERO) {
            a->stats.zeroed++;
        } else if (items[i].kind == PF_ITEM_UNMERGE) {
            a->stats.unmerged++;
        }
    }
    g_mutex_unlock(&a->lock);
}

static gboolean
handle_request(PfAgent *a, const PfMsg *msg, GError **error)
{
    guint32 n;
    const PfWireItem *items = pf_msg_items(msg, &n);
    g_autofree PfWireResult *res = g_new0(PfWireResult, n);
    g_autofree gboolean *moved = g_new0(gboolean, n);

    for (guint32 i = 0; i < n;) {
        guint32 k = 1;

        if (!item_valid(a, &items[i])) {
            /* Out of range: refused, nothing touched. */
            set_result(&res[i], PF_RESULT_ERROR, EINVAL);
        } else if (items[i].kind == PF_ITEM_UNMERGE) {
            /*
             * After a step back to advise mode nothing is remapped: an
             * unmerge finds its page in the memfd already and says so.
             */
            exec_unmerge(a, &items[i], &res[i]);
        } else if (a->mode != PF_MODE_MERGE) {
            set_result(&res[i], PF_RESULT_ERROR, EPERM);
        } else if (items[i].kind == PF_ITEM_COLLAPSE) {
            exec_collapse(a, &items[i], &res[i]);
        } else {
            guint64 lo = items[i].page, hi = lo + 1;

            while (i + k < n &&
                   is_window_item(a, &items[i], &items[i + k], lo, hi)) {
                lo = MIN(lo, items[i + k].page);
                hi = MAX(hi, items[i + k].page + 1);
                k++;
            }
            exec_window(a, &items[i], k, lo, hi, &res[i], &moved[i]);
        }
        i += k;
    }
    count_results(a, items, res, moved, n);
    post(a, PF_MSG_RESULT, msg->header.seq, res, n * sizeof(*res), -1);
    if (a->uffd_lost) {
        /* Merged pages stay valid; pagefoldd keeps their slots taken. */
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "the userfaultfd had to be closed: this VM cannot merge "
                    "any more");
        return FALSE;
    }
    return TRUE;
}

/* ---- pool chunks ---- */

/* The chunk of this id that pagefoldd sent and has not dropped, or NULL. */
static Chunk *
held_chunk(PfAgent *a, guint32 id)
{
    return id < a->chunks->len ? g_ptr_array_index(a->chunks, id) : NULL;
}

static gboolean
take_chunk(PfAgent *a, PfMsg *msg, GError **error)
{
    const PfWirePool *p = pf_msg_pool(msg);
    int fd = msg->fds[0];
    int seals = fcntl(fd, F_GET_SEALS);
    struct stat st;
    Chunk *c;
    void *map;

    msg->n_fds = 0; /* ours now */
    if (seals < 0 || (seals & POOL_SEALS) != POOL_SEALS) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pool chunk %u is not sealed against writing and resizing "
                    "(seals 0x%x)", p->chunk, seals < 0 ? 0 : seals);
        return FALSE;
    }
    /*
     * pf_proto_recv() refused larger ids already: the array of chunks
     * stays within what the protocol allows.
     */
    if (p->chunk >= PF_PROTO_MAX_CHUNKS || held_chunk(a, p->chunk) != NULL) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pool chunk %u is out of range, or sent again without a "
                    "DROP", p->chunk);
        return FALSE;
    }
    if (fstat(fd, &st) < 0 ||
        (guint64)st.st_size < (guint64)p->n_slots * PF_PAGE_SIZE) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "pool chunk %u is smaller than its %u slots", p->chunk,
                    p->n_slots);
        return FALSE;
    }
    map = mmap(NULL, (gsize)p->n_slots * PF_PAGE_SIZE, PROT_READ, MAP_SHARED,
               fd, 0);
    if (map == MAP_FAILED) {
        int e = errno;

        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot map pool chunk %u: %s", p->chunk, g_strerror(e));
        return FALSE;
    }
    c = g_new0(Chunk, 1);
    c->fd = fd;
    c->map = map;
    c->n_slots = p->n_slots;
    if (p->chunk >= a->chunks->len) {
        g_ptr_array_set_size(a->chunks, (gint)p->chunk + 1);
    }
    g_ptr_array_index(a->chunks, p->chunk) = c;
    return TRUE;
}

static void
chunk_free(gpointer p)
{
    Chunk *c = p;

    if (c == NULL) {
        return;
    }
    /*
     * Merged pages keep their own references to the memory.  Neither
     * call can fail on what take_chunk() made; if one did, the chunk's
     * memory would only stay taken.
     */
    if (munmap((void *)c->map, (gsize)c->n_slots * PF_PAGE_SIZE) < 0) {
        g_warning("pagefold agent: cannot unmap a pool chunk: %s",
                  g_strerror(errno));
    }
    if (close(c->fd) < 0) {
        g_warning("pagefold agent: cannot close a pool chunk: %s",
                  g_strerror(errno));
    }
    g_free(c);
}

/*
 * No page of this VM maps the chunk any more, says pagefoldd: its fd and
 * its compare mapping go, and its id may come again in a later POOL (with
 * other memory).  Only a chunk held, of the size it was sent with: any
 * other DROP means pagefoldd's idea of this VM is wrong, and the link is
 * given up.  A page that still mapped it (pagefoldd being wrong after
 * all) would stay valid: its mapping holds the memory.
 */
static gboolean
drop_chunk(PfAgent *a, const PfMsg *msg, GError **error)
{
    const PfWirePool *p = pf_msg_pool(msg);
    Chunk *c = held_chunk(a, p->chunk);

    if (c == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "DROP of pool chunk %u, which this agent does not hold",
                    p->chunk);
        return FALSE;
    }
    if (c->n_slots != p->n_slots) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "DROP of pool chunk %u of %u slots, which this agent "
                    "holds with %u", p->chunk, p->n_slots, c->n_slots);
        return FALSE;
    }
    g_ptr_array_index(a->chunks, p->chunk) = NULL;
    chunk_free(c);
    return TRUE;
}

/* ---- the connection ---- */

static void
set_connected(PfAgent *a, gboolean connected)
{
    g_mutex_lock(&a->lock);
    a->connected = connected;
    g_mutex_unlock(&a->lock);
}

/* Mode and reason change under work and lock: readers take either. */
static void
set_mode(PfAgent *a, PfMode mode, const char *reason)
{
    g_mutex_lock(&a->lock);
    a->mode = mode;
    g_free(a->reason);
    a->reason = g_strdup(reason);
    g_mutex_unlock(&a->lock);
}

/*
 * Sends what was queued, on the agent thread.  FALSE when the link is to
 * end: a send failed (error set), or an ERROR went out (error unset).
 */
static gboolean
flush(PfAgent *a, GError **error)
{
    for (;;) {
        Outgoing *o;
        gboolean ok, hangup;

        g_mutex_lock(&a->out);
        o = g_queue_pop_head(&a->outbox);
        hangup = a->hangup;
        g_mutex_unlock(&a->out);
        if (o == NULL) {
            return !hangup;
        }
        if (o->type == PF_MSG_RESULT) {
            ok = pf_proto_send_results(
                a->sock, o->seq, (const PfWireResult *)o->payload,
                (guint32)(o->length / sizeof(PfWireResult)), error);
        } else {
            ok = pf_proto_send(a->sock, o->type, o->seq, o->payload,
                               o->length, &o->fd, o->fd >= 0 ? 1 : 0, error);
        }
        outgoing_free(o);
        if (!ok) {
            return FALSE;
        }
    }
}

/*
 * Tells pagefoldd of region i, write-protected first (protect) when this
 * VM merges.  Every region is told, refused ones too: pagefoldd counts
 * indexes.
 */
static void
region_join(PfAgent *a, guint i, gboolean protect)
{
    Region *r = &g_array_index(a->regions, Region, i);
    PfWireRegion wr = { 0 };

    if (protect && a->mode == PF_MODE_MERGE && !r->gone) {
        region_protect(a, r);
        if (r->refused != NULL) {
            say_refused(a, r);
        }
    }
    wr.index = i;
    wr.page_size = PF_PAGE_SIZE;
    wr.host_addr = (guint64)(guintptr)r->host;
    wr.size = r->size;
    wr.offset = r->offset;
    pf_wire_set_string(wr.name, sizeof(wr.name), r->name);
    if (!r->gone) {
        post(a, PF_MSG_REGION, 0, &wr, sizeof(wr), r->fd);
    }
    a->announced = MAX(a->announced, i + 1);
}

static gboolean
recv_expect(int sock, PfMsg *msg, PfMsgType type, GError **error)
{
    if (!pf_proto_recv(sock, msg, error)) {
        return FALSE;
    }
    if (msg->header.type == PF_MSG_ERROR) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pagefoldd refused: %.*s",
                    (int)msg->header.length, (const char *)msg->payload);
        return FALSE;
    }
    if (msg->header.type != type) {
        pf_msg_close_fds(msg);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "expected message type %u, got %u", type, msg->header.type);
        return FALSE;
    }
    return TRUE;
}

/*
 * Chooses the mode and says it; regions plugged in meanwhile follow.
 * Called with work held.
 */
static void
settle_mode(PfAgent *a, const PfWireMode *welcome, int dev_fd)
{
    PfWireMode ready = { 0 };
    g_autofree char *why = NULL;
    guint told = a->announced;
    PfMode mode = PF_MODE_ADVISE;

    if (a->advise_reason != NULL) {
        why = g_strdup(a->advise_reason);
    } else if (welcome->mode != PF_MODE_MERGE) {
        why = g_strdup(welcome->reason);
    } else if (uffd_setup(a, dev_fd, &why)) {
        mode = PF_MODE_MERGE;
    }
    set_mode(a, mode, why ? why : "");
    ready.version = PF_PROTO_VERSION;
    ready.mode = mode;
    pf_wire_set_string(ready.reason, sizeof(ready.reason), a->reason);
    post(a, PF_MSG_READY, 0, &ready, sizeof(ready), -1);
    /* uffd_setup() protected them with the others. */
    for (guint i = told; i < a->regions->len; i++) {
        region_join(a, i, FALSE);
    }
    /* Told in HELLO's wake, gone since: pagefoldd hears it now. */
    for (guint i = 0; i < told; i++) {
        Region *r = &g_array_index(a->regions, Region, i);

        if (r->gone_untold) {
            PfWireRange gone = { i, 0, 0, r->n_pages };

            post(a, PF_MSG_GONE, 0, &gone, sizeof(gone), -1);
            r->gone_untold = FALSE;
        }
    }
    a->ready = TRUE;
    if (mode != PF_MODE_MERGE) {
        g_message("pagefold agent: VM %s stays in advise mode: %s", a->name,
                  a->reason);
    } else {
        g_message("pagefold agent: VM %s merges", a->name);
    }
}

/*
 * Waits until the socket has something to read, the agent is stopped, or
 * timeout_ms pass (-1: no limit).  The VMM's threads never wait here.
 */
static gboolean
wait_readable(PfAgent *a, int timeout_ms, GError **error)
{
    /* Within timeout_ms in all, however often something is queued. */
    gint64 end = g_get_monotonic_time() + (gint64)timeout_ms * 1000;

    for (;;) {
        struct pollfd pfd[3] = { { a->sock, POLLIN, 0 },
                                 { a->stop[0], POLLIN, 0 },
                                 { a->wake[0], POLLIN, 0 } };
        gint64 left = (end - g_get_monotonic_time() + 999) / 1000;
        int n = poll(pfd, 3, timeout_ms < 0 ? -1 : (int)MAX(left, 0));

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "poll: %s",
                        g_strerror(errno));
            return FALSE;
        }
        if (n == 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                        "pagefoldd did not answer within %d s",
                        timeout_ms / 1000);
            return FALSE;
        }
        if (pfd[1].revents) {
            g_set_error(error, PF_ERROR, PF_ERROR_CLOSED,
                        "the agent is stopping");
            return FALSE;
        }
        if (pfd[2].revents) {
            char buf[64];
            ssize_t got;

            do {
                got = read(a->wake[0], buf, sizeof(buf));
            } while (got > 0);

            if (!flush(a, error)) {
                if (error != NULL && *error == NULL) {
                    g_set_error(error, PF_ERROR, PF_ERROR_CLOSED,
                                "the link was given up");
                }
                return FALSE;
            }
        }
        if (pfd[0].revents) {
            return TRUE;
        }
    }
}

#define HANDSHAKE_MS 10000

/*
 * Announces the VM and its regions and settles the mode.  Only the agent
 * thread waits for pagefoldd meanwhile.
 */
static gboolean
handshake(PfAgent *a, GError **error)
{
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);
    PfWireHello hello = { 0 };
    int dev_fd = -1;

    g_mutex_lock(&a->work);
    hello.version = PF_PROTO_VERSION;
    hello.pid = (guint32)getpid();
    memcpy(hello.uuid, a->uuid, 16);
    pf_wire_set_string(hello.name, sizeof(hello.name), a->name);
    hello.n_regions = a->regions->len;
    post(a, PF_MSG_HELLO, 0, &hello, sizeof(hello), -1);
    for (guint i = 0; i < hello.n_regions; i++) {
        region_join(a, i, FALSE);
    }
    g_mutex_unlock(&a->work);
    if (!flush(a, error) || !wait_readable(a, HANDSHAKE_MS, error) ||
        !recv_expect(a->sock, msg, PF_MSG_WELCOME, error)) {
        return FALSE;
    }
    if (msg->n_fds == 1) {
        dev_fd = msg->fds[0];
        msg->n_fds = 0;
    }
    g_mutex_lock(&a->work);
    settle_mode(a, pf_msg_mode(msg), dev_fd);
    g_mutex_unlock(&a->work);
    if (dev_fd >= 0) {
        close(dev_fd);
    }
    if (!flush(a, error)) {
        return FALSE;
    }
    set_connected(a, TRUE);
    return TRUE;
}

/* Serves requests until the link ends or the agent stops. */
/* pf_agent_free() stops the agent: a send it cut short is no news. */
static gboolean
stopping(PfAgent *a)
{
    struct pollfd p = { a->stop[0], POLLIN, 0 };

    return poll(&p, 1, 0) == 1;
}

static void
serve(PfAgent *a)
{
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);

    for (;;) {
        g_autoptr(GError) error = NULL;
        gboolean ok = TRUE;

        if (!wait_readable(a, -1, &error)) {
            if (!g_error_matches(error, PF_ERROR, PF_ERROR_CLOSED) &&
                !stopping(a)) {
                g_warning("pagefold agent: %s; disconnecting", error->message);
            }
            return;
        }
        if (!pf_proto_recv(a->sock, msg, &error)) {
            if (!g_error_matches(error, PF_ERROR, PF_ERROR_CLOSED)) {
                g_warning("pagefold agent: %s; disconnecting", error->message);
                g_mutex_lock(&a->work);
                post_error(a, error->message);
                g_mutex_unlock(&a->work);
                (void)flush(a, NULL);
            }
            return;
        }
        g_mutex_lock(&a->work);
        switch (msg->header.type) {
        case PF_MSG_POOL:
            ok = take_chunk(a, msg, &error);
            break;
        case PF_MSG_DROP:
            ok = drop_chunk(a, msg, &error);
            break;
        case PF_MSG_REQUEST:
            ok = handle_request(a, msg, &error);
            break;
        case PF_MSG_ERROR:
            g_warning("pagefold agent: pagefoldd says: %.*s",
                      (int)msg->header.length, (const char *)msg->payload);
            ok = FALSE;
            break;
        default:
            g_set_error(&error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "unexpected message type %u", msg->header.type);
            ok = FALSE;
        }
        pf_msg_close_fds(msg);
        if (!ok && error != NULL) {
            g_warning("pagefold agent: %s; disconnecting", error->message);
            post_error(a, error->message);
        }
        if (!ok) {
            /* Under the work lock: nothing is queued after the ERROR. */
            set_connected(a, FALSE);
        }
        g_mutex_unlock(&a->work);
        g_clear_error(&error);
        if (!flush(a, &error) || !ok) {
            if (error != NULL && !stopping(a)) {
                g_warning("pagefold agent: %s; disconnecting", error->message);
            }
            return;
        }
    }
}

static gpointer
agent_thread(gpointer data)
{
    PfAgent *a = data;
    g_autoptr(GError) error = NULL;
    gboolean ok = handshake(a, &error);

    if (!ok) {
        g_autofree char *why = g_strdup_printf("not attached to pagefoldd: %s",
                                               error->message);

        g_warning("pagefold agent: VM %s runs unmerged: %s", a->name,
                  error->message);
        g_mutex_lock(&a->work);
        set_mode(a, PF_MODE_ADVISE, why);
        if (a->uffd >= 0) {
            /* Nothing was remapped: guest RAM is left unregistered. */
            close(a->uffd);
            a->uffd = -1;
        }
        g_mutex_unlock(&a->work);
    }
    g_mutex_lock(&a->lock);
    a->settled = TRUE;
    a->start_error = ok ? NULL : g_strdup(error->message);
    g_cond_broadcast(&a->settled_cond);
    g_mutex_unlock(&a->lock);
    if (ok) {
        serve(a);
    }
    /* Under the work lock: nothing is queued once it ends. */
    g_mutex_lock(&a->work);
    g_mutex_lock(&a->out);
    a->posting = FALSE;
    g_mutex_unlock(&a->out);
    set_connected(a, FALSE);
    g_mutex_unlock(&a->work);
    if (a->sock >= 0) {
        shutdown(a->sock, SHUT_RDWR);
    }
    return NULL;
}

gboolean
pf_agent_start(PfAgent *a, const char *socket_path, GError **error)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    /*
     * A pagefoldd that stops reading must not stall the agent thread for
     * good: after this, the link is given up.
     */
    struct timeval tv = { .tv_sec = 5 };
    /*
     * pagefoldd sends requests only while their answers fit in this (a
     * window of a few batches, each answered in 16 KiB), so the agent
     * thread never waits here on a pagefoldd busy elsewhere; said rather
     * than left to net.core.wmem_default.
     */
    int sndbuf = 256 << 10;
    g_autoptr(GError) err = NULL;
    int e;

    g_return_val_if_fail(a->sock < 0, FALSE);
    if (strlen(socket_path) >= sizeof(addr.sun_path)) {
        g_set_error(&err, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "socket path too long: %s", socket_path);
        goto fail;
    }
    strcpy(addr.sun_path, socket_path);
    /* Every pool chunk this VM comes to share is a descriptor of ours. */
    pf_raise_nofile_limit();
    /*
     * Not blocking: a pagefoldd that accepts nobody (its queue full) is
     * said at once, not waited for.
     */
    a->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (a->sock < 0 ||
        connect(a->sock, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
        e = errno;
        g_set_error(&err, PF_ERROR, PF_ERROR_FAILED,
                    "cannot connect to pagefoldd at %s: %s%s",
                    socket_path, g_strerror(e),
                    e == EAGAIN ? " (it accepts no connection: stuck, or "
                                  "overloaded)" : "");
        goto fail;
    }
    if (fcntl(a->sock, F_SETFL, 0) < 0 ||
        setsockopt(a->sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0 ||
        setsockopt(a->sock, SOL_SOCKET, SO_SNDBUF, &sndbuf,
                   sizeof(sndbuf)) < 0 ||
        pipe2(a->stop, O_CLOEXEC) < 0 ||
        pipe2(a->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        g_set_error(&err, PF_ERROR, PF_ERROR_FAILED,
                    "cannot set up the link: %s", g_strerror(errno));
        goto fail;
    }
    g_mutex_lock(&a->out);
    a->posting = TRUE;
    g_mutex_unlock(&a->out);
    a->thread = a->threads.create(agent_thread, a, a->threads.opaque);
    return TRUE;

fail:
    for (int i = 0; i < 2; i++) {
        if (a->stop[i] >= 0) {
            close(a->stop[i]);
        }
        if (a->wake[i] >= 0) {
            close(a->wake[i]);
        }
        a->stop[i] = a->wake[i] = -1;
    }
    if (a->sock >= 0) {
        close(a->sock);
        a->sock = -1;
    }
    {
        g_autofree char *why = g_strdup_printf("not attached to pagefoldd: %s",
                                               err->message);

        g_mutex_lock(&a->work);
        set_mode(a, PF_MODE_ADVISE, why);
        g_mutex_unlock(&a->work);
    }
    g_propagate_error(error, g_steal_pointer(&err));
    return FALSE;
}

gboolean
pf_agent_wait_settled(PfAgent *a, GError **error)
{
    gboolean ok;

    g_mutex_lock(&a->lock);
    while (a->thread != NULL && !a->settled) {
        g_cond_wait(&a->settled_cond, &a->lock);
    }
    ok = a->thread != NULL && a->start_error == NULL;
    if (!ok) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "%s",
                    a->start_error ? a->start_error
                                   : "the agent was not started");
    }
    g_mutex_unlock(&a->lock);
    return ok;
}

PfAgent *
pf_agent_new(const char *vm_name, const guint8 *uuid)
{
    PfAgent *a = g_new0(PfAgent, 1);

    /* A label: pagefoldd tells VMs apart by their pids. */
    a->name = g_strdup(vm_name != NULL && *vm_name ? vm_name : "qemu");
    if (uuid != NULL) {
        memcpy(a->uuid, uuid, 16);
    }
    a->regions = g_array_new(FALSE, TRUE, sizeof(Region));
    a->chunks = g_ptr_array_new_with_free_func(chunk_free);
    a->dma_ranges = g_array_new(FALSE, FALSE, sizeof(DmaRange));
    a->sys = real_syscalls;
    a->threads = gthreads;
    a->sock = a->uffd = -1;
    a->stop[0] = a->stop[1] = a->wake[0] = a->wake[1] = -1;
    a->mode = PF_MODE_ADVISE;
    g_mutex_init(&a->lock);
    g_mutex_init(&a->work);
    g_mutex_init(&a->dma);
    g_mutex_init(&a->out);
    g_cond_init(&a->settled_cond);
    g_queue_init(&a->outbox);
    return a;
}

static void
region_clear(Region *r)
{
    g_free(r->name);
    g_free(r->remapped);
    g_free(r->refused);
    if (r->fd >= 0) {
        close(r->fd);
    }
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
        region_join(a, a->regions->len - 1, TRUE);
    }
    g_mutex_unlock(&a->work);
    return TRUE;
}

gboolean
pf_agent_remove_region(PfAgent *a, void *host, gboolean keep, GError **error)
{
    PfWireRange gone = { 0 };
    Region *r = NULL;
    guint i;
    int rc;

    g_mutex_lock(&a->work);
    for (i = 0; i < a->regions->len; i++) {
        r = &g_array_index(a->regions, Region, i);
        if (!r->gone && !r->leaving && r->host == host) {
            break;
        }
    }
    if (i == a->regions->len) {
        g_mutex_unlock(&a->work);
        return TRUE;
    }
    if (i >= a->announced) {
        /*
         * pagefoldd never heard of it (so nothing of it is merged): its
         * index is nobody's yet, and goes with it.
         */
        region_clear(r);
        g_array_remove_index(a->regions, i);
        g_mutex_unlock(&a->work);
        return TRUE;
    }
    r->leaving = TRUE;
    g_mutex_unlock(&a->work);

    /*
     * Kept, its content stays its own: the memfd may be used again (the
     * backend plugged in elsewhere, merge=on).  Else the memory is being
     * freed, and only its pool slots matter.
     */
    rc = fold_back_region(a, i, keep);

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
        post_error(a, text);
        set_connected(a, FALSE);
        mark_remapped(a, r, 0, r->n_pages, FALSE);
    }
    if (a->uffd >= 0 && r->refused == NULL) {
        struct uffdio_range range = { (guint64)(guintptr)r->host, r->size };

        /*
         * Left registered, it would refuse the next userfaultfd
         * (postcopy) there; nothing there is protected any more.
         */
        rc = uffd_ioctl(a, UFFDIO_UNREGISTER, &range);
        if (rc < 0) {
            g_warning("pagefold agent: cannot unregister %s: %s", r->name,
                      g_strerror(-rc));
        }
    }
    gone.region = i;
    gone.n_pages = r->n_pages;
    if (a->ready) {
        post(a, PF_MSG_GONE, 0, &gone, sizeof(gone), -1);
    } else {
        r->gone_untold = TRUE;
    }
    close(r->fd);
    r->fd = -1;
    g_clear_pointer(&r->remapped, g_free);
    r->gone = TRUE;
    r->leaving = FALSE;
    g_mutex_unlock(&a->work);
    return TRUE;
}

static gboolean
step_back(PfAgent *a, const char *reason, gboolean final, GError **error)
{
    g_autofree char *failed = NULL;
    guint n;
    int rc = 0;

    g_mutex_lock(&a->work);
    if (a->advise_reason == NULL) {
        a->advise_reason = g_strdup(reason);
    }
    if (a->mode == PF_MODE_MERGE) {
        g_message("pagefold agent: VM %s steps back to advise mode: %s",
                  a->name, reason);
        set_mode(a, PF_MODE_ADVISE, reason);
        a->advise_untold = TRUE;
    }
    n = a->regions->len;
    g_mutex_unlock(&a->work);

    /*
     * Nothing merges any more (advise mode); what is remapped is folded
     * back a chunk at a time, again after a failure too.  Pages in DMA
     * are left, and the other regions folded back all the same.
     */
    for (guint i = 0; i < n; i++) {
        int rc1 = fold_back_region(a, i, TRUE);

        if (rc1 < 0 && rc == 0) {
            rc = rc1;
            g_mutex_lock(&a->work);
            failed = g_strdup(i < a->regions->len
                              ? g_array_index(a->regions, Region, i).name
                              : "a region");
            g_mutex_unlock(&a->work);
        }
        if (rc1 < 0 && rc1 != -EBUSY) {
            break;
        }
    }

    g_mutex_lock(&a->work);
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
        post_error(a, text);
        set_connected(a, FALSE);
        a->advise_untold = FALSE;
    }
    if (rc == 0) {
        PfWireMode m = { PF_PROTO_VERSION, PF_MODE_ADVISE, "" };

        if (a->uffd >= 0) {
            /*
             * Nothing of this VM is remapped any more; closing the
             * userfaultfd unregisters guest RAM, for whoever needs it
             * next.
             */
            close(a->uffd);
            a->uffd = -1;
        }
        if (a->advise_untold) {
            pf_wire_set_string(m.reason, sizeof(m.reason), a->reason);
            post(a, PF_MSG_ADVISE, 0, &m, sizeof(m), -1);
            a->advise_untold = FALSE;
        }
    }
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
        if (find_remapped(r, first, end, TRUE) == end) {
            continue;
        }
        rc = fold_back(a, r, first, end - first, FALSE, &stop, &folded);
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
        if (wr.n_pages > 0) {
            post(a, PF_MSG_DISCARD, 0, &wr, sizeof(wr), -1);
        }
    }
    g_mutex_unlock(&a->work);
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

void
pf_agent_free(PfAgent *a)
{
    if (a == NULL) {
        return;
    }
    if (a->thread != NULL) {
        (void)!write(a->stop[1], "x", 1);
        /* A send blocked on a stuck pagefoldd ends now, not in 5 s. */
        shutdown(a->sock, SHUT_RDWR);
        a->threads.join(a->thread, a->threads.opaque);
    }
    for (int i = 0; i < 2; i++) {
        if (a->stop[i] >= 0) {
            close(a->stop[i]);
        }
        if (a->wake[i] >= 0) {
            close(a->wake[i]);
        }
    }
    if (a->sock >= 0) {
        close(a->sock);
    }
    if (a->uffd >= 0) {
        close(a->uffd);
    }
    for (guint i = 0; i < a->regions->len; i++) {
        region_clear(&g_array_index(a->regions, Region, i));
    }
    g_queue_clear_full(&a->outbox, outgoing_free);
    g_array_unref(a->regions);
    g_ptr_array_unref(a->chunks);
    g_array_unref(a->dma_ranges);
    g_mutex_clear(&a->lock);
    g_mutex_clear(&a->work);
    g_mutex_clear(&a->dma);
    g_mutex_clear(&a->out);
    g_cond_clear(&a->settled_cond);
    g_free(a->start_error);
    g_free(a->advise_reason);
    g_free(a->reason);
    g_free(a->name);
    g_free(a);
}

PfMode
pf_agent_get_mode(PfAgent *a)
{
    PfMode m;

    g_mutex_lock(&a->lock);
    m = a->mode;
    g_mutex_unlock(&a->lock);
    return m;
}

char *
pf_agent_dup_reason(PfAgent *a)
{
    char *r;

    g_mutex_lock(&a->lock);
    r = g_strdup(a->reason ? a->reason : "");
    g_mutex_unlock(&a->lock);
    return r;
}

gboolean
pf_agent_is_connected(PfAgent *a)
{
    gboolean c;

    g_mutex_lock(&a->lock);
    c = a->connected;
    g_mutex_unlock(&a->lock);
    return c;
}

void
pf_agent_get_stats(PfAgent *a, PfAgentStats *stats)
{
    g_mutex_lock(&a->lock);
    *stats = a->stats;
    g_mutex_unlock(&a->lock);
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
