/*
 * agent-uffd.c - userfaultfd write protection of guest RAM: making the
 * userfaultfd, registering, protecting and lifting ranges, and which
 * regions can be protected, and so merged, at all.  Must never leave a
 * page protected past its item: a lift the kernel refuses unregisters the
 * range instead, and failing that the userfaultfd is closed, which lets
 * every writer go (and this VM merges nothing more).
 *
 * Shaped by what the kernel was measured to do:
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
 *    memfd or pwrite(): a vhost-user back-end's mappings are protected
 *    through its own userfaultfd (agent-backend.c), and a VM whose
 *    back-end offers none stays in advise mode.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif

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

int
pfa_uffd_ioctl(PfAgent *a, unsigned long request, void *arg)
{
    if (a->uffd < 0) {
        return -EBADF;
    }
    return a->sys.ioctl(a->uffd, request, arg) < 0 ? -errno : 0;
}

int
pfa_uffd_register(PfAgent *a, void *addr, gsize len)
{
    struct uffdio_register reg = {
        .range = { (guint64)(guintptr)addr, len },
        .mode = UFFDIO_REGISTER_MODE_WP,
    };

    return pfa_uffd_ioctl(a, UFFDIO_REGISTER, &reg);
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
int
pfa_uffd_protect(PfAgent *a, int fd, guint64 addr, gsize len, gboolean on)
{
    struct uffdio_writeprotect wp = {
        .range = { addr, len },
        .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0,
    };
    int rc;
    gsize half;

    if (fd < 0) {
        return -EBADF;
    }
    rc = a->sys.ioctl(fd, UFFDIO_WRITEPROTECT, &wp) < 0 ? -errno : 0;
    if (rc != -ENOENT) {
        return rc;
    }
    if (len <= PF_PAGE_SIZE) {
        return on ? rc : 0;
    }
    half = len / PF_PAGE_SIZE / 2 * PF_PAGE_SIZE;
    rc = pfa_uffd_protect(a, fd, addr, half, on);
    if (rc == 0 || !on) {
        int rc2 = pfa_uffd_protect(a, fd, addr + half, len - half, on);

        rc = rc < 0 ? rc : rc2;
    }
    return rc;
}

static int
uffd_protect(PfAgent *a, guint8 *addr, gsize len, gboolean on)
{
    return pfa_uffd_protect(a, a->uffd, (guint64)(guintptr)addr, len, on);
}

/*
 * Lifts the protection of [addr, addr + len).  It must not fail: a page
 * left protected blocks its writer (a vCPU, an I/O thread) for good.  If
 * the kernel refuses, the range is unregistered, which lifts it too
 * (Linux 6.0+), and its writers woken; if even that fails, the
 * userfaultfd is closed, which lets every writer go, and this VM merges
 * nothing more.
 */
void
pfa_uffd_release(PfAgent *a, guint8 *addr, gsize len)
{
    struct uffdio_range range = { (guint64)(guintptr)addr, len };
    int rc = uffd_protect(a, addr, len, FALSE);

    if (rc == 0 || a->uffd < 0) {
        return;
    }
    g_warning("pagefold agent: cannot lift write protection at %p+%zu: %s; "
              "unregistering it", addr, len, g_strerror(-rc));
    /* Unregistering does not wake a writer blocked on protection. */
    rc = pfa_uffd_ioctl(a, UFFDIO_UNREGISTER, &range);
    if (rc == 0) {
        rc = pfa_uffd_ioctl(a, UFFDIO_WAKE, &range);
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

/*
 * Write-protects [addr, addr + len) before its mappings change.  The
 * range is registered first: remapped pages are VMAs of their own, not
 * registered yet.  On failure, what pieces of it were protected are
 * lifted again, and nothing is held.
 */
int
pfa_uffd_hold(PfAgent *a, guint8 *addr, gsize len)
{
    int rc = pfa_uffd_register(a, addr, len);

    if (rc >= 0) {
        rc = uffd_protect(a, addr, len, TRUE);
    }
    if (rc < 0 && a->uffd >= 0) {
        pfa_uffd_release(a, addr, len);
    }
    return rc;
}

/*
 * After the mappings of [addr, addr + len) changed: registered again, the
 * new mappings coalesce with their neighbours (if that fails, the next
 * fold-back registers them); with lift, the protection pfa_uffd_hold()
 * set is lifted, which wakes any writer that blocked meanwhile (it retries
 * on whatever the page is now).
 */
void
pfa_uffd_done(PfAgent *a, guint8 *addr, gsize len, gboolean lift)
{
    (void)pfa_uffd_register(a, addr, len);
    if (lift) {
        pfa_uffd_release(a, addr, len);
    }
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
    if (munmap(probe, PF_PAGE_SIZE) < 0) {
        /* A page of our own stays mapped: nothing else is at stake. */
        g_warning("pagefold agent: cannot unmap its probe page: %s", g_strerror(errno));
    }
    return locked;
}

/*
 * Write-protects r for merging, or says in r->refused why it is not
 * merged: one odd region (a memfd this process cannot punch, a NUMA
 * binding, a file system without write protection) costs no other.
 */
void
pfa_region_protect(PfAgent *a, Region *r)
{
    int rc;

    g_free(r->refused);
    r->refused = region_unsafe(r);
    if (r->refused == NULL) {
        rc = pfa_uffd_register(a, r->host, r->size);
        if (rc < 0) {
            r->refused = g_strdup_printf(
                "cannot write-protect region %s: %s%s", r->name,
                g_strerror(-rc),
                rc == -EBUSY ? " (postcopy or background snapshot already "
                               "uses userfaultfd)" : "");
        }
    }
}

void
pfa_say_refused(PfAgent *a, const Region *r)
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
 * Makes a->uffd, with write protection for shmem; or says why not, and
 * leaves a->uffd closed.
 */
static gboolean
uffd_open(PfAgent *a, int dev_fd, char **why)
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
        if (a->uffd >= 0) {
            close(a->uffd);
            a->uffd = -1;
        }
        return FALSE;
    }
    return TRUE;
}

/*
 * TRUE when a region merges, and then each one refused says why; else the
 * reason of the first region, since none can merge.
 */
static gboolean
any_region_merges(PfAgent *a, char **why)
{
    const char *first = NULL;

    for (guint i = 0; i < a->regions->len; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);

        if (region_merges(r)) {
            for (guint j = 0; j < a->regions->len; j++) {
                r = &g_array_index(a->regions, Region, j);
                if (!r->gone && r->refused != NULL) {
                    pfa_say_refused(a, r);
                }
            }
            return TRUE;
        }
        first = first != NULL || r->gone ? first : r->refused;
    }
    *why = g_strdup(first != NULL ? first : "no guest RAM left to merge");
    return FALSE;
}

gboolean
pfa_uffd_resume(PfAgent *a, char **why)
{
    for (guint i = 0; i < a->regions->len; i++) {
        Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone) {
            g_clear_pointer(&r->refused, g_free);
            pfa_region_protect(a, r);
        }
    }
    return any_region_merges(a, why);
}

/*
 * Makes the userfaultfd and registers guest RAM for write protection; on
 * failure says why the VM must stay in advise mode, and holds nothing
 * registered (postcopy or a background snapshot may want it later).
 */
gboolean
pfa_uffd_setup(PfAgent *a, int dev_fd, char **why)
{
    if (!uffd_open(a, dev_fd, why)) {
        return FALSE;
    }
    for (guint i = 0; i < a->regions->len; i++) {
        Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone) {
            pfa_region_protect(a, r);
        }
    }
    if (any_region_merges(a, why)) {
        return TRUE;
    }
    /* Closing it unregisters whatever was registered. */
    close(a->uffd);
    a->uffd = -1;
    return FALSE;
}
