/*
 * agent-backend.c - the other processes that map guest RAM from its memfds
 * (vhost-user back-ends) and join the merge: each hands over a
 * userfaultfd made in its own process and registered for missing pages
 * and write protection over its mappings of guest RAM, and says where
 * those mappings are.  Around every window of merges the back-ends'
 * mappings of it are write-protected too, since a back-end's store
 * between the compare and the punch would land in a page about to be
 * punched.  After the punch, a back-end's touch of a merged page is a
 * missing fault: the fault thread folds the page back (what the guest sees
 * there now goes into the memfd, which the VMM maps again) and wakes it.
 * A touch of a hole never merged is filled with zeros, as the kernel
 * would have filled it.
 *
 * Owns: the back-ends' records and descriptors, and the fault thread,
 * which serves back-ends whatever the link to pagefoldd is doing (merged
 * pages outlive it).  Never: merges a window that a back-end maps without
 * its protection there (what it told is all it maps; while it is expected
 * or changing its mappings, or gone without unmapping them, nothing
 * merges), waits for a back-end (only the kernel is called, on the
 * back-end's userfaultfd), or leaves a back-end's page protected past its
 * window.  A back-end may lie about
 * its mappings: that spoils its own VM, whose RAM it can write anyway.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

/* Faults a back-end may leave waiting on the agent (one a blocked thread). */
#define MAX_PENDING 4096u
#define RETRY_MS 10

/* The ioctls the agent uses on a back-end's userfaultfd, per range. */
#define BACKEND_IOCTLS ((1ull << _UFFDIO_WAKE) | (1ull << _UFFDIO_WRITEPROTECT) | \
                        (1ull << _UFFDIO_ZEROPAGE))

typedef struct {
    guint8 *host;    /* the VMM's address */
    gsize len;
    guint64 remote;  /* the back-end's address of host */
} BackendRange;

struct _PfBackend {
    char *name;
    int uffd;
    GArray *ranges;  /* BackendRange */
    GArray *pending; /* guint64: back-end addresses of faults still to resolve */
    /* its process is gone (ESRCH): it maps nothing any more */
    gboolean dead;
    /*
     * a protection could not be lifted, or its userfaultfd cannot be polled
     * (unpolled): no merge while it is attached
     */
    gboolean broken;
    gboolean unpolled;
    /*
     * its mappings are changing (a new memory table, not yet told), or it
     * is expected and has told nothing: no merge until it tells
     */
    gboolean unsettled;
    /*
     * disconnected while still mapping guest RAM: no merge until none of
     * its ranges is registered any more (leaving_gone())
     */
    gboolean leaving;
    /*
     * let go after the VM stepped back, nothing remapped: its ranges
     * unregistered, and a fault still taken (a mapping made since, not
     * told) finds the page as the kernel fills it
     */
    gboolean let_go;
};

static void fault_thread_wake(PfAgent *a);

static PfBackend *
backend_new(const char *name, int uffd)
{
    PfBackend *b = g_new0(PfBackend, 1);

    b->name = g_strdup(name);
    b->uffd = uffd;
    b->ranges = g_array_new(FALSE, FALSE, sizeof(BackendRange));
    b->pending = g_array_new(FALSE, FALSE, sizeof(guint64));
    return b;
}

static void
backend_free(gpointer p)
{
    PfBackend *b = p;

    if (b->uffd >= 0) {
        close(b->uffd);
    }
    g_array_unref(b->ranges);
    g_array_unref(b->pending);
    g_free(b->name);
    g_free(b);
}

/* ---- where a back-end maps what ---- */

/* The VMM's address of the back-end's address at, or NULL if untold. */
static guint8 *
host_of(const PfBackend *b, guint64 at)
{
    for (guint i = 0; i < b->ranges->len; i++) {
        const BackendRange *br = &g_array_index(b->ranges, BackendRange, i);

        if (at >= br->remote && at - br->remote < br->len) {
            return br->host + (at - br->remote);
        }
    }
    return NULL;
}

/*
 * rc, an ioctl's on b's userfaultfd: ESRCH says its process is gone, and
 * with it every mapping to protect or fill.
 */
static int
backend_result(PfAgent *a, PfBackend *b, int rc)
{
    if (rc == -ESRCH && !b->dead) {
        g_message("pagefold agent: VM %s: back-end %s is gone", a->name, b->name);
        b->dead = TRUE;
    }
    return rc;
}

static int
backend_ioctl(PfAgent *a, PfBackend *b, unsigned long request, void *arg)
{
    return backend_result(a, b, a->sys.ioctl(b->uffd, request, arg) < 0 ? -errno : 0);
}

/*
 * Protects (on) or lifts b's mappings of [lo, hi); a back-end whose
 * process is gone is marked dead, which is success: it maps nothing.
 */
static int
protect(PfAgent *a, PfBackend *b, const guint8 *lo, const guint8 *hi,
        gboolean on)
{
    int rc = 0;

    for (guint i = 0; i < b->ranges->len && !b->dead && !b->let_go; i++) {
        const BackendRange *br = &g_array_index(b->ranges, BackendRange, i);
        const guint8 *from = MAX(lo, br->host);
        const guint8 *to = MIN(hi, br->host + br->len);
        int rc1;

        if (from >= to) {
            continue;
        }
        rc1 = backend_result(a, b, pfa_uffd_protect(a, b->uffd,
                                                    br->remote + (guint64)(from - br->host),
                                                    (gsize)(to - from), on));
        if (rc == 0) {
            rc = rc1;
        }
    }
    return b->dead ? 0 : rc;
}

/* ---- around a window of merges ---- */

/* Lifts the protection of the first n records' mappings of the range. */
static void
release_first(PfAgent *a, guint n, const guint8 *addr, gsize len)
{
    for (guint i = 0; i < n; i++) {
        PfBackend *b = g_ptr_array_index(a->backends, i);
        int rc = protect(a, b, addr, addr + len, FALSE);

        if (rc < 0 && !b->broken) {
            /*
             * Its writers there wait; each of their faults is met by
             * lifting that page again (resolve()).  No merge meanwhile.
             */
            g_warning("pagefold agent: VM %s: cannot lift write protection of "
                      "back-end %s at %p+%zu: %s; no merging while it is "
                      "attached", a->name, b->name, addr, len, g_strerror(-rc));
            b->broken = TRUE;
        }
    }
}

void
pfa_backends_release(PfAgent *a, const guint8 *addr, gsize len)
{
    release_first(a, a->backends->len, addr, len);
}

/*
 * Has b, disconnected, let go of guest RAM?  Lifting write protection is
 * the one ioctl that changes nothing here and fails where no mapping is
 * registered with its userfaultfd (ENOENT; ESRCH once its process is
 * gone).  Asked of a range's first and last page, since before Linux 6.4
 * one call must stay within one mapping.
 */
static gboolean
leaving_gone(PfAgent *a, PfBackend *b)
{
    for (guint i = 0; i < b->ranges->len * 2 && !b->dead; i++) {
        const BackendRange *br = &g_array_index(b->ranges, BackendRange, i / 2);
        struct uffdio_writeprotect wp = {
            .range = { i % 2 ? br->remote + br->len - PF_PAGE_SIZE : br->remote,
                       PF_PAGE_SIZE },
        };

        if (backend_ioctl(a, b, UFFDIO_WRITEPROTECT, &wp) != -ENOENT && !b->dead) {
            return FALSE;
        }
    }
    return TRUE;
}

int
pfa_backends_hold(PfAgent *a, const guint8 *addr, gsize len)
{
    gboolean dropped = FALSE;
    int rc = 0;
    guint i;

    for (i = 0; i < a->backends->len && rc == 0; i++) {
        PfBackend *b = g_ptr_array_index(a->backends, i);

        if (b->leaving && leaving_gone(a, b)) {
            g_message("pagefold agent: VM %s: back-end %s let go of guest RAM", a->name,
                      b->name);
            g_ptr_array_add(a->backends_gone, g_ptr_array_steal_index(a->backends, i--));
            dropped = TRUE;
        } else if (b->broken) {
            rc = -EIO;
        } else if (b->unsettled || b->leaving) {
            rc = -EINPROGRESS;
        }
    }
    if (dropped) {
        fault_thread_wake(a); /* which closes its descriptor */
    }
    /* Nothing protected yet: a record changing or leaving has stale ranges. */
    if (rc < 0) {
        return rc;
    }
    for (i = 0; i < a->backends->len && rc == 0; i++) {
        rc = protect(a, g_ptr_array_index(a->backends, i), addr, addr + len, TRUE);
    }
    if (rc < 0) {
        release_first(a, i, addr, len);
    }
    return rc;
}

/* ---- a back-end's faults ---- */

/* The region and page of host, or FALSE where no region is. */
static gboolean
page_of(PfAgent *a, const guint8 *host, guint *index, gsize *page)
{
    for (guint i = 0; i < a->regions->len; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone && host >= r->host && host < r->host + r->size) {
            *index = i;
            *page = (gsize)(host - r->host) / PF_PAGE_SIZE;
            return TRUE;
        }
    }
    return FALSE;
}

/* Does [lo, hi) meet a region? */
static gboolean
meets_region(PfAgent *a, const guint8 *lo, const guint8 *hi)
{
    for (guint i = 0; i < a->regions->len; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone && lo < r->host + r->size && r->host < hi) {
            return TRUE;
        }
    }
    return FALSE;
}

/*
 * One fault of b at back-end address at: TRUE once its thread can go on,
 * FALSE to try again later (an address not told of yet, a page in DMA
 * that cannot be folded back now).  With work held.
 */
static gboolean
resolve(PfAgent *a, PfBackend *b, guint64 at, gboolean wp)
{
    struct uffdio_range range = { at, PF_PAGE_SIZE };
    struct uffdio_zeropage zero = { range, 0, 0 };
    guint8 *host = host_of(b, at);
    guint i;
    gsize page;

    if (b->dead) {
        return TRUE;
    }
    if (b->let_go) {
        /* Nothing is remapped: every hole is one the kernel fills. */
        if (backend_ioctl(a, b, UFFDIO_ZEROPAGE, &zero) < 0) {
            (void)backend_ioctl(a, b, UFFDIO_WAKE, &range);
        }
        return TRUE;
    }
    if (host == NULL) {
        return FALSE;
    }
    if (wp) {
        /*
         * Windows lift what they protect before the fault thread can take
         * work: this protection is one whose lift failed.
         */
        (void)protect(a, b, host, host + PF_PAGE_SIZE, FALSE);
        return TRUE;
    }
    if (page_of(a, host, &i, &page) &&
        pfa_is_remapped(&g_array_index(a->regions, Region, i), page)) {
        guint64 was = 1;
        gsize stop, folded = 0;
        int rc;

        /*
         * pagefoldd is reading the mappings (a handshake, 10 s at most):
         * they hold still, and the page is folded back once it is over.
         */
        if (a->linking) {
            return FALSE;
        }
        rc = pfa_fold_back(a, &g_array_index(a->regions, Region, i), page, 1, TRUE, &stop,
                           &folded);
        if (rc < 0) {
            return FALSE;
        }
        pfa_tell_folded(a, i, page, 1, &was, TRUE);
        g_mutex_lock(&a->lock);
        a->stats.backend_fold_backs += folded;
        g_mutex_unlock(&a->lock);
        (void)backend_ioctl(a, b, UFFDIO_WAKE, &range);
        return TRUE;
    }
    /*
     * A hole never merged reads zeros in the VMM too.  The page may be
     * there by now (the guest wrote it): EEXIST, and a wake finds it.
     */
    if (backend_ioctl(a, b, UFFDIO_ZEROPAGE, &zero) < 0) {
        (void)backend_ioctl(a, b, UFFDIO_WAKE, &range);
    }
    return TRUE;
}

/* Reads b's new faults and resolves them and those pending.  With work. */
static void
serve_backend(PfAgent *a, PfBackend *b)
{
    struct uffd_msg msgs[32];
    ssize_t n;
    guint kept = 0;

    for (guint k = 0; k < b->pending->len; k++) {
        guint64 at = g_array_index(b->pending, guint64, k);

        if (!resolve(a, b, at, FALSE)) {
            g_array_index(b->pending, guint64, kept++) = at;
        }
    }
    g_array_set_size(b->pending, kept);
    while (!b->dead && (n = read(b->uffd, msgs, sizeof(msgs))) > 0) {
        for (gsize k = 0; k < (gsize)n / sizeof(msgs[0]); k++) {
            guint64 at = msgs[k].arg.pagefault.address & ~(guint64)(PF_PAGE_SIZE - 1);

            /*
             * No events were asked for (features_refused()); should one
             * come all the same, a fork's descriptor is not kept.
             */
            if (msgs[k].event == UFFD_EVENT_FORK) {
                close((int)msgs[k].arg.fork.ufd);
            }
            if (msgs[k].event != UFFD_EVENT_PAGEFAULT ||
                resolve(a, b, at, msgs[k].arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WP)) {
                continue;
            }
            if (b->pending->len < MAX_PENDING) {
                g_array_append_val(b->pending, at);
            } else {
                /* Beyond what threads of a back-end can wait: it faults again. */
                struct uffdio_range range = { at, PF_PAGE_SIZE };

                (void)backend_ioctl(a, b, UFFDIO_WAKE, &range);
            }
        }
    }
}

static gpointer
fault_thread(gpointer data)
{
    PfAgent *a = data;
    g_autoptr(GArray) fds = g_array_new(FALSE, FALSE, sizeof(struct pollfd));
    g_autoptr(GPtrArray) served = g_ptr_array_new();

    if (prctl(PR_SET_NAME, "pagefold-fault", 0, 0, 0) < 0) {
        g_debug("pagefold agent: the fault thread keeps its name: %s", g_strerror(errno));
    }
    for (;;) {
        struct pollfd wake = { a->fault_wake[0], POLLIN, 0 };
        gboolean pending = FALSE;
        char buf[64];

        g_mutex_lock(&a->work);
        if (a->fault_stop) {
            g_mutex_unlock(&a->work);
            break;
        }
        /* Only this thread polls their descriptors: it closes them. */
        g_ptr_array_set_size(a->backends_gone, 0);
        g_array_set_size(fds, 0);
        g_ptr_array_set_size(served, 0);
        g_array_append_val(fds, wake);
        for (guint i = 0; i < a->backends->len; i++) {
            PfBackend *b = g_ptr_array_index(a->backends, i);
            struct pollfd p = { b->uffd, POLLIN, 0 };

            if (b->uffd >= 0 && !b->dead && !b->unpolled) {
                g_array_append_val(fds, p);
                g_ptr_array_add(served, b);
                pending |= b->pending->len > 0;
            }
        }
        g_mutex_unlock(&a->work);

        if (poll((struct pollfd *)(void *)fds->data, fds->len, pending ? RETRY_MS : -1) < 0 &&
            errno != EINTR) {
            g_warning("pagefold agent: the fault thread cannot poll: %s", g_strerror(errno));
            g_usleep(RETRY_MS * 1000);
        }
        while (read(a->fault_wake[0], buf, sizeof(buf)) > 0) {
        }
        g_mutex_lock(&a->work);
        for (guint i = 0; i < served->len; i++) {
            PfBackend *b = g_ptr_array_index(served, i);
            short ev = g_array_index(fds, struct pollfd, i + 1).revents;

            /* One removed meanwhile waits, unserved, to be closed. */
            if (!g_ptr_array_find(a->backends, b, NULL)) {
                continue;
            }
            if (ev & (POLLERR | POLLNVAL)) {
                /*
                 * Made blocking by its other holder, or not enabled: it
                 * cannot be served, so nothing merges while it is attached.
                 */
                if (!b->broken) {
                    g_warning("pagefold agent: VM %s: back-end %s: its userfaultfd cannot "
                              "be polled; no merging while it is attached", a->name, b->name);
                }
                b->broken = TRUE;
                b->unpolled = TRUE;
            } else if ((ev & POLLIN) || b->pending->len > 0) {
                serve_backend(a, b);
            }
        }
        g_mutex_unlock(&a->work);
    }
    return NULL;
}

static void
fault_thread_wake(PfAgent *a)
{
    if (a->fault_wake[1] >= 0) {
        (void)!write(a->fault_wake[1], "x", 1);
    }
}

void
pfa_backends_stop(PfAgent *a)
{
    if (a->fault_thread != NULL) {
        g_mutex_lock(&a->work);
        a->fault_stop = TRUE;
        g_mutex_unlock(&a->work);
        fault_thread_wake(a);
        a->threads.join(a->fault_thread, a->threads.opaque);
        a->fault_thread = NULL;
    }
    for (int i = 0; i < 2; i++) {
        if (a->fault_wake[i] >= 0) {
            close(a->fault_wake[i]);
            a->fault_wake[i] = -1;
        }
    }
    g_ptr_array_set_size(a->backends_gone, 0);
    g_ptr_array_set_size(a->backends, 0);
}

/* ---- back-ends coming and going ---- */

/* The attached record named name (not one leaving), or NULL. */
static PfBackend *
backend_find(PfAgent *a, const char *name)
{
    for (guint i = 0; i < a->backends->len; i++) {
        PfBackend *b = g_ptr_array_index(a->backends, i);

        if (!b->leaving && g_str_equal(b->name, name)) {
            return b;
        }
    }
    return NULL;
}

/* b, out of the list and into backends_gone, for the fault thread to free. */
static void
backend_drop(PfAgent *a, PfBackend *b)
{
    guint i;

    if (g_ptr_array_find(a->backends, b, &i)) {
        g_ptr_array_add(a->backends_gone, g_ptr_array_steal_index_fast(a->backends, i));
    }
}

/*
 * Lets b's mappings go: unregistered, they fault no more (and any thread
 * waiting there is woken, to find the page as the kernel fills it).  Only
 * once nothing of guest RAM is remapped.
 */
static void
backend_let_go(PfAgent *a, PfBackend *b)
{
    for (guint i = 0; i < b->ranges->len && !b->dead; i++) {
        const BackendRange *br = &g_array_index(b->ranges, BackendRange, i);
        struct uffdio_range range = { br->remote, br->len };
        int rc = backend_ioctl(a, b, UFFDIO_UNREGISTER, &range);

        if (rc < 0 && rc != -ESRCH) {
            g_warning("pagefold agent: VM %s: cannot unregister back-end %s at "
                      "0x%" G_GINT64_MODIFIER "x: %s", a->name, b->name, br->remote,
                      g_strerror(-rc));
        }
    }
}

void
pfa_backends_let_go(PfAgent *a)
{
    for (guint i = 0; i < a->backends->len; i++) {
        PfBackend *b = g_ptr_array_index(a->backends, i);

        if (b->uffd < 0 || b->dead) {
            g_ptr_array_add(a->backends_gone, g_ptr_array_steal_index(a->backends, i--));
        } else if (!b->let_go) {
            backend_let_go(a, b);
            b->let_go = TRUE;
        }
    }
    fault_thread_wake(a);
}

/* Is no page of guest RAM mapped from the pool? */
static gboolean
nothing_remapped(PfAgent *a)
{
    for (guint i = 0; i < a->regions->len; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);

        if (!r->gone && pfa_find_remapped(r, 0, r->n_pages, TRUE) < r->n_pages) {
            return FALSE;
        }
    }
    return TRUE;
}

/*
 * The features uffd was enabled with (its fdinfo's API line), or why
 * they will not do: an event would make the back-end's own mapping
 * changes wait on the agent (and a fork hand QEMU descriptors), an
 * asynchronous write protection or SIGBUS would let stores through.
 */
static char *
features_refused(int uffd)
{
    g_autofree char *path = g_strdup_printf("/proc/self/fdinfo/%d", uffd);
    g_autofree char *text = NULL;
    const char *api;
    guint64 features;
    const guint64 allowed = UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_MISSING_SHMEM |
                            UFFD_FEATURE_MISSING_HUGETLBFS | UFFD_FEATURE_THREAD_ID |
                            UFFD_FEATURE_EXACT_ADDRESS | UFFD_FEATURE_MINOR_SHMEM |
                            UFFD_FEATURE_MINOR_HUGETLBFS |
                            /* the kernel's own mark of an enabled one */
                            (1ull << 31);

    if (!g_file_get_contents(path, &text, NULL, NULL) ||
        (api = strstr(text, "API:\t")) == NULL ||
        sscanf(api + 5, "%*x:%" G_GINT64_MODIFIER "x", &features) != 1) {
        return g_strdup("its features cannot be read");
    }
    if (!(features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM)) {
        return g_strdup("it was not enabled with UFFD_FEATURE_WP_HUGETLBFS_SHMEM");
    }
    if (features & ~allowed) {
        return g_strdup_printf("it was enabled with features 0x%" G_GINT64_MODIFIER "x: "
                               "events, asynchronous write protection or SIGBUS are "
                               "not allowed", features & ~allowed);
    }
    return NULL;
}

/* Is fd a userfaultfd?  Its file is the kernel's anonymous inode of that name. */
static gboolean
is_userfaultfd(int fd)
{
    g_autofree char *link = g_strdup_printf("/proc/self/fd/%d", fd);
    g_autofree char *target = g_file_read_link(link, NULL);

    return target != NULL && g_str_equal(target, "anon_inode:[userfaultfd]");
}

/*
 * Checks each of b's ranges against the regions, and against the
 * back-end's own registration: registering a range again with the same
 * userfaultfd changes nothing where it is registered so, and fails where
 * no such mapping is, or it is another userfaultfd's.
 */
static gboolean
check_ranges(PfAgent *a, PfBackend *b, GError **error)
{
    for (guint i = 0; i < b->ranges->len; i++) {
        const BackendRange *br = &g_array_index(b->ranges, BackendRange, i);
        struct uffdio_register reg = {
            .range = { br->remote, br->len },
            .mode = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP,
        };
        guint index, index_last;
        gsize page, last;
        gboolean first_in, last_in;
        int rc;

        first_in = br->len > 0 && page_of(a, br->host, &index, &page);
        last_in = br->len > 0 && page_of(a, br->host + br->len - 1, &index_last, &last);
        /*
         * A range outside the guest RAM the agent merges is kept (memory
         * plugged later may be there); one that straddles it is a lie.
         */
        if (br->len == 0 || br->len % PF_PAGE_SIZE != 0 ||
            (guintptr)br->host % PF_PAGE_SIZE != 0 || br->remote % PF_PAGE_SIZE != 0 ||
            br->remote + br->len < br->remote ||
            (guintptr)br->host + br->len < (guintptr)br->host ||
            first_in != last_in || (first_in && index != index_last) ||
            (!first_in && meets_region(a, br->host, br->host + br->len))) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "back-end %s: range %u (%p+%zu at 0x%" G_GINT64_MODIFIER "x) is "
                        "not page-aligned, or straddles a region of guest RAM", b->name, i,
                        br->host, br->len, br->remote);
            return FALSE;
        }
        for (guint j = 0; j < i; j++) {
            const BackendRange *o = &g_array_index(b->ranges, BackendRange, j);

            if (br->remote < o->remote + o->len && o->remote < br->remote + br->len) {
                g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                            "back-end %s: ranges %u and %u overlap", b->name, j, i);
                return FALSE;
            }
        }
        rc = backend_ioctl(a, b, UFFDIO_REGISTER, &reg);
        if (rc < 0 || (reg.ioctls & BACKEND_IOCTLS) != BACKEND_IOCTLS) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "back-end %s: its userfaultfd cannot take missing-page faults and "
                        "write protection at 0x%" G_GINT64_MODIFIER "x+%zu: %s", b->name,
                        br->remote, br->len,
                        rc < 0 ? g_strerror(-rc) : "the kernel offers no UFFDIO_WRITEPROTECT "
                                                   "or UFFDIO_ZEROPAGE there");
            return FALSE;
        }
    }
    return TRUE;
}

static gboolean
fault_thread_start(PfAgent *a, GError **error)
{
    if (a->fault_thread != NULL) {
        return TRUE;
    }
    if (a->fault_wake[0] < 0 && pipe2(a->fault_wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot start the fault thread: %s",
                    g_strerror(errno));
        return FALSE;
    }
    a->fault_thread = a->threads.create(fault_thread, a, a->threads.opaque);
    if (a->fault_thread == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot start the fault thread: the VMM's thread function failed");
        return FALSE;
    }
    return TRUE;
}

gboolean
pf_agent_set_backend(PfAgent *a, const char *name, int uffd,
                     const PfAgentBackendRange *ranges, guint n, GError **error)
{
    PfBackend *b = backend_new(name, uffd);
    PfBackend *old;
    int fl;

    for (guint i = 0; i < n; i++) {
        BackendRange br = { ranges[i].host, ranges[i].size, ranges[i].backend };

        g_array_append_val(b->ranges, br);
    }
    if (!is_userfaultfd(uffd)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "back-end %s: descriptor %d is not a userfaultfd", name, uffd);
        backend_free(b);
        return FALSE;
    }
    {
        g_autofree char *why = features_refused(uffd);

        if (why != NULL) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "back-end %s: its userfaultfd: %s", name, why);
            backend_free(b);
            return FALSE;
        }
    }
    /* Shared with the back-end's own descriptor: it is read only after poll(). */
    fl = fcntl(uffd, F_GETFL);
    if (fl < 0 || fcntl(uffd, F_SETFL, fl | O_NONBLOCK) < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "back-end %s: its userfaultfd: %s",
                    name, g_strerror(errno));
        backend_free(b);
        return FALSE;
    }
    g_mutex_lock(&a->work);
    if (!check_ranges(a, b, error) || !fault_thread_start(a, error)) {
        g_mutex_unlock(&a->work);
        backend_free(b);
        return FALSE;
    }
    old = backend_find(a, name);
    for (guint k = 0; old != NULL && k < old->pending->len; k++) {
        guint64 at = g_array_index(old->pending, guint64, k);
        struct uffdio_range range = { at, PF_PAGE_SIZE };

        /*
         * Its faults not yet resolved are the new record's; one where it
         * maps nothing now is woken, to fault again or find the mapping
         * gone.
         */
        if (host_of(b, at) != NULL) {
            g_array_append_val(b->pending, at);
        } else {
            (void)backend_ioctl(a, b, UFFDIO_WAKE, &range);
        }
    }
    if (old != NULL) {
        backend_drop(a, old);
    }
    g_ptr_array_add(a->backends, b);
    /*
     * A VM that stepped back has nothing remapped and merges no more: the
     * back-end maps plain memfd.
     */
    if (a->advise_reason != NULL && nothing_remapped(a)) {
        pfa_backends_let_go(a);
    }
    g_mutex_unlock(&a->work);
    fault_thread_wake(a);
    return TRUE;
}

void
pf_agent_expect_backend(PfAgent *a, const char *name)
{
    PfBackend *b;

    g_mutex_lock(&a->work);
    b = backend_find(a, name);
    if (b == NULL) {
        b = backend_new(name, -1);
        g_ptr_array_add(a->backends, b);
    }
    b->unsettled = TRUE;
    g_mutex_unlock(&a->work);
}

void
pf_agent_remove_backend(PfAgent *a, const char *name)
{
    PfBackend *b;

    g_mutex_lock(&a->work);
    b = backend_find(a, name);
    if (b != NULL && b->uffd >= 0 && !b->dead && !b->let_go && b->ranges->len > 0) {
        /*
         * Its process may still be unmapping guest RAM, or finishing a
         * request: its faults are served until it has let go.
         */
        b->leaving = TRUE;
    } else if (b != NULL) {
        backend_drop(a, b);
    }
    g_mutex_unlock(&a->work);
    fault_thread_wake(a);
}

int
pf_agent_dup_userfaultfd_dev(PfAgent *a)
{
    int fd;

    g_mutex_lock(&a->work);
    fd = a->uffd_dev >= 0 ? fcntl(a->uffd_dev, F_DUPFD_CLOEXEC, 3) : -1;
    g_mutex_unlock(&a->work);
    return fd;
}

void
pfa_backends_init(PfAgent *a)
{
    a->backends = g_ptr_array_new_with_free_func(backend_free);
    a->backends_gone = g_ptr_array_new_with_free_func(backend_free);
    a->fault_wake[0] = a->fault_wake[1] = -1;
}

void
pfa_backends_clear(PfAgent *a)
{
    pfa_backends_stop(a);
    g_ptr_array_unref(a->backends);
    g_ptr_array_unref(a->backends_gone);
}
