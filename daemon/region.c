/*
 * region.c - a region of guest RAM (region.h): its memfd mapped read-only,
 * its page records made and freed a 2 MiB extent at a time, and the checks
 * that a region an agent announces is what its process maps, sealed, and
 * write-protected.  Owns the mapping, the memfd and the records; never
 * maps guest RAM writable, never touches a page, and allocates nothing for
 * a region before it passed its checks.
 *
 * An agent's /proc/PID files are read through a directory fd opened while
 * its pidfd showed it alive, never by pid again, so a reused pid cannot
 * swap in another process's mappings.
 */
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "pool.h"
#include "util.h"

PfRegion *
pf_region_new(const char *name, int fd, guint64 host_addr, guint64 offset, gsize size,
              GError **error)
{
    g_autoptr(PfRegion) r = g_new0(PfRegion, 1);
    struct stat st;
    void *map;

    r->fd = fd;
    r->name = g_strdup(name);
    /* offset + size must not wrap around to look small. */
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || size == 0 || size % PF_PAGE_SIZE ||
        offset % PF_PAGE_SIZE || offset > (guint64)st.st_size ||
        size > (guint64)st.st_size - offset) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND,
                    "region %s: not a memfd of at least %zu bytes at offset %" G_GUINT64_FORMAT,
                    name, size, offset);
        return NULL;
    }
    map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, (off_t)offset);
    if (map == MAP_FAILED) {
        int e = errno;

        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot map region %s: %s", name,
                    g_strerror(e));
        return NULL;
    }
    r->host_addr = host_addr;
    r->file_offset = offset;
    r->size = size;
    r->n_pages = size / PF_PAGE_SIZE;
    r->dev = st.st_dev;
    r->ino = st.st_ino;
    r->map = map;
    /* Records are made as pages are seen; what a region costs up front is
     * a pointer per 2 MiB, still a large allocation for a large region:
     * if it cannot be had, the region is refused, and pagefoldd runs on. */
    r->n_extents = (r->n_pages + PF_EXTENT_PAGES - 1) / PF_EXTENT_PAGES;
    r->extents = g_try_new0(PfPage *, MAX(r->n_extents, 1));
    r->huge_seen = g_try_new0(guint8, (size >> 21) / 8 + 2);
    r->huge_was = g_try_new0(guint8, (size >> 21) / 8 + 2);
    if (r->extents == NULL || r->huge_seen == NULL || r->huge_was == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "region %s: no memory for the records of its %zu pages", name, r->n_pages);
        return NULL;
    }
    return g_steal_pointer(&r);
}

typedef struct {
    guint64 start, end, offset, ino;
    guint major, minor;
    char perms[8];
    gboolean uffd_wp; /* "uw" in smaps' VmFlags */
} Vma;

/* The mappings that overlap [lo, hi), in address order, from the process's
 * "maps" or "smaps" (which adds VmFlags), read as a stream: a process may
 * have tens of thousands of mappings, so the read may take long, and stops
 * at the next line once cancelled. */
static GArray *
read_vmas(int proc_dir, const char *file, guint64 lo, guint64 hi, GCancellable *cancel,
          GError **error)
{
    g_autoptr(GArray) out = g_array_new(FALSE, TRUE, sizeof(Vma));
    g_autofree char *line = NULL;
    size_t cap = 0;
    Vma *cur = NULL;
    int fd = openat(proc_dir, file, O_RDONLY | O_CLOEXEC);
    FILE *f;
    gboolean failed;
    int e;

    if (fd < 0 || (f = fdopen(fd, "re")) == NULL) {
        e = errno;
        if (fd >= 0) {
            close(fd);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot read the process's %s: %s", file,
                    g_strerror(e));
        return NULL;
    }
    while (getline(&line, &cap, f) > 0) {
        Vma v = { 0 };

        if (g_cancellable_set_error_if_cancelled(cancel, error)) {
            fclose(f);
            return NULL;
        }
        if (sscanf(line,
                   "%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x %7s %" G_GINT64_MODIFIER
                   "x %x:%x %" G_GINT64_MODIFIER "u",
                   &v.start, &v.end, v.perms, &v.offset, &v.major, &v.minor, &v.ino) == 7) {
            cur = NULL;
            if (v.end > lo && v.start < hi) {
                g_array_append_val(out, v);
                cur = &g_array_index(out, Vma, out->len - 1);
            }
        } else if (cur != NULL && g_str_has_prefix(line, "VmFlags:")) {
            /* Every flag is two letters, each after a space. */
            cur->uffd_wp = strstr(line, " uw") != NULL;
        }
    }
    failed = ferror(f);
    e = errno;
    fclose(f);
    if (failed) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot read the process's %s: %s", file,
                    g_strerror(e));
        return NULL;
    }
    return g_steal_pointer(&out);
}

static gboolean
refuse_region(GError **error, const char *fmt, ...) G_GNUC_PRINTF(2, 3);

static gboolean
refuse_region(GError **error, const char *fmt, ...)
{
    va_list ap;

    if (error != NULL) {
        va_start(ap, fmt);
        *error = g_error_new_valist(PF_ERROR, PF_ERROR_INVALID_ARGUMENT, fmt, ap);
        va_end(ap);
    }
    return FALSE;
}

/* The memfd itself: shmem of 4 KiB pages, sealed against shrinking, and
 * long enough for the range announced.  *st: its stat. */
static gboolean
check_memfd(int fd, const char *name, guint64 offset, guint64 size, struct stat *st,
            GError **error)
{
    struct statfs sfs;
    int seals;

    if (fstat(fd, st) < 0 || !S_ISREG(st->st_mode) || fstatfs(fd, &sfs) < 0 ||
        (sfs.f_type != TMPFS_MAGIC && sfs.f_type != HUGETLBFS_MAGIC)) {
        return refuse_region(error, "region %s: not a memfd", name);
    }
    if (sfs.f_type == HUGETLBFS_MAGIC) {
        return refuse_region(error, "region %s: a memfd of huge pages (pagefold merges 4 KiB "
                             "pages)", name);
    }
    /* Seals only ever get added: once seen, it stays. */
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        return refuse_region(error, "region %s: its memfd is not sealed against shrinking "
                             "(F_SEAL_SHRINK, as QEMU's memory-backend-memfd seals it): a "
                             "truncation would fault pagefoldd's reads", name);
    }
    if (offset > (guint64)st->st_size || size > (guint64)st->st_size - offset) {
        return refuse_region(error,
                             "region %s: %" G_GUINT64_FORMAT " bytes at offset %"
                             G_GUINT64_FORMAT " go beyond the end of its memfd (%"
                             G_GINT64_FORMAT " bytes)",
                             name, size, offset, (gint64)st->st_size);
    }
    return TRUE;
}

/* One mapping of the process, v, covering address at: shared, of the
 * memfd st, at the offset announced. */
static gboolean
check_vma(int proc_dir, const Vma *v, const struct stat *st, const char *name,
          guint64 host_addr, guint64 offset, guint64 at, GError **error)
{
    g_autofree char *entry = NULL;
    struct stat mst;

    if (v->perms[0] == '\0' || v->perms[3] != 's') {
        return refuse_region(error, "region %s: %#" G_GINT64_MODIFIER "x is mapped %s, "
                             "not shared", name, at, v->perms);
    }
    if (v->ino != (guint64)st->st_ino || makedev(v->major, v->minor) != st->st_dev) {
        return refuse_region(error, "region %s: the process maps another file at %#"
                             G_GINT64_MODIFIER "x", name, at);
    }
    if (v->offset + (at - v->start) != offset + (at - host_addr)) {
        return refuse_region(error, "region %s: the process maps its memfd at %#"
                             G_GINT64_MODIFIER "x from offset %" G_GUINT64_FORMAT
                             ", not %" G_GUINT64_FORMAT,
                             name, at, v->offset + (at - v->start),
                             offset + (at - host_addr));
    }
    /* The file itself, not only its numbers. */
    entry = g_strdup_printf("map_files/%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x",
                            v->start, v->end);
    if (fstatat(proc_dir, entry, &mst, 0) < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "region %s: cannot look at %s: %s%s",
                    name, entry, g_strerror(e),
                    e == EPERM ? " (pagefoldd needs CAP_SYS_ADMIN)" : "");
        return FALSE;
    }
    if (mst.st_dev != st->st_dev || mst.st_ino != st->st_ino) {
        return refuse_region(error, "region %s: the process maps another file at %#"
                             G_GINT64_MODIFIER "x", name, at);
    }
    return TRUE;
}

/*
 * Pool chunk descriptors the checks of all links hold, until their VMs
 * take their pages back or their links end: a peer whose process maps
 * thousands of chunks (or many such peers at once) must not take every
 * descriptor pagefoldd may have, nor those the checks of VMs root vouched
 * for need.  Checks run on threads of GLib's pool; descriptors are let go
 * of on the main loop.
 */
static GMutex held_lock;
static PfChunkCaps caps = PF_CHUNK_CAPS_DEFAULT;
static GHashTable *held_by_pid;  /* pid -> descriptors */
static GHashTable *held_by_uid;  /* uid -> descriptors, of unvouched peers */
static guint held_unvouched, held_all;

void
pf_region_set_chunk_caps(const PfChunkCaps *set)
{
    static const PfChunkCaps dflt = PF_CHUNK_CAPS_DEFAULT;

    g_mutex_lock(&held_lock);
    caps = set != NULL ? *set : dflt;
    g_mutex_unlock(&held_lock);
}

static guint
held_of(GHashTable *t, guint key)
{
    return t != NULL ? GPOINTER_TO_UINT(g_hash_table_lookup(t, GUINT_TO_POINTER(key))) : 0;
}

static void
held_add(GHashTable **t, guint key, gint n)
{
    guint now = held_of(*t, key) + (guint)n;

    if (*t == NULL) {
        *t = g_hash_table_new(NULL, NULL);
    }
    if (now == 0) {
        g_hash_table_remove(*t, GUINT_TO_POINTER(key));
    } else {
        g_hash_table_insert(*t, GUINT_TO_POINTER(key), GUINT_TO_POINTER(now));
    }
}

static void
held_count(const PfChunkHolder *h, gint n)
{
    held_all += (guint)n;
    held_add(&held_by_pid, (guint)h->pid, n);
    if (!h->vouched) {
        held_unvouched += (guint)n;
        held_add(&held_by_uid, (guint)h->uid, n);
    }
}

/* One more descriptor for h, where every cap allows; region_held: those
 * the region's check holds already. */
static gboolean
chunk_hold(const PfChunkHolder *h, guint region_held)
{
    gboolean ok;

    g_mutex_lock(&held_lock);
    ok = region_held < caps.region && held_all < caps.all &&
         held_of(held_by_pid, (guint)h->pid) < caps.peer &&
         (h->vouched || (held_unvouched < caps.unvouched &&
                         held_of(held_by_uid, (guint)h->uid) < caps.unvouched_uid));
    if (ok) {
        held_count(h, 1);
    }
    g_mutex_unlock(&held_lock);
    return ok;
}

static void
chunk_unhold(const PfChunkHolder *h, guint n)
{
    g_mutex_lock(&held_lock);
    held_count(h, -(gint)n);
    g_mutex_unlock(&held_lock);
}

void
pf_pool_mapped_free(PfPoolMapped *m)
{
    if (m == NULL) {
        return;
    }
    chunk_unhold(&m->holder, m->n_held);
    g_array_unref(m->runs);
    g_hash_table_unref(m->fds);
    g_free(m->back);
    g_free(m);
}

void
pf_pool_mapped_back(PfPoolMapped *m, gsize n_pages, gsize from, gsize to)
{
    if (m->back == NULL) {
        m->back = g_new0(guint8, (n_pages + 7) / 8);
    }
    for (gsize i = from; i < MIN(to, n_pages); i++) {
        m->back[i / 8] |= (guint8)(1u << (i % 8));
    }
}

gboolean
pf_pool_mapped_is_back(const PfPoolMapped *m, gsize idx)
{
    return m->back != NULL && (m->back[idx / 8] & (1u << (idx % 8))) != 0;
}

/* The device of every memfd, pool chunks among them; 0 if none can be
 * made. */
static dev_t
memfd_dev(void)
{
    static gsize dev;

    if (g_once_init_enter(&dev)) {
        struct stat st;
        int fd = memfd_create("pagefold-probe", MFD_CLOEXEC);
        gsize d = fd >= 0 && fstat(fd, &st) == 0 ? (gsize)st.st_dev + 1 : 1;

        if (fd >= 0) {
            close(fd);
        }
        g_once_init_leave(&dev, d);
    }
    return (dev_t)(dev - 1);
}

/* A descriptor as a table keeps it: plus one, so that none is NULL. */
#define FD_VALUE(fd) GINT_TO_POINTER((fd) + 1)

static void
close_fd(gpointer p)
{
    close(GPOINTER_TO_INT(p) - 1);
}

/*
 * One private mapping of the process, v, covering at: pages of the region
 * mapped from a pool chunk, as an agent maps merged pages.  The file is
 * opened through map_files (the kernel's word on what is mapped, not the
 * agent's) and must bear the pool's mark, which only root can set.
 */
static gboolean
check_pooled(int proc_dir, const Vma *v, const char *name, guint64 host_addr, guint64 at,
             guint64 end, const PfChunkHolder *holder, PfPoolMapped **pooled, GError **error)
{
    dev_t shm_dev = memfd_dev();
    g_autofree char *entry = g_strdup_printf("map_files/%" G_GINT64_MODIFIER "x-%"
                                             G_GINT64_MODIFIER "x", v->start, v->end);
    guint64 until = MIN(v->end, end), index = v->offset / PF_PAGE_SIZE +
                                              (at - v->start) / PF_PAGE_SIZE;
    PfPoolRun run = { (at - host_addr) / PF_PAGE_SIZE, (until - at) / PF_PAGE_SIZE, v->ino,
                      (guint32)index, FALSE };
    gpointer known = NULL;
    struct stat st;
    int fd = -1;

    if (*pooled != NULL) {
        known = g_hash_table_lookup((*pooled)->fds, &run.ino);
    }
    if (known == NULL) {
        /* Only a memfd is opened: not a device node, nor a file of a
         * file system that may block. */
        if (shm_dev == 0 || makedev(v->major, v->minor) != shm_dev || v->ino == 0) {
            return refuse_region(error, "region %s: the process maps another file at %#"
                                 G_GINT64_MODIFIER "x, privately", name, at);
        }
        if (!chunk_hold(holder, *pooled != NULL ? g_hash_table_size((*pooled)->fds) : 0)) {
            return refuse_region(error, "region %s: the process maps more pool chunks than "
                                 "pagefoldd takes back at a time, for it%s", name,
                                 holder->vouched ? "" : " and its uid's others");
        }
        fd = openat(proc_dir, entry, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
        if (fd < 0 || fstat(fd, &st) < 0 || st.st_ino != v->ino || st.st_dev != shm_dev ||
            !S_ISREG(st.st_mode) || !pf_pool_is_marked(fd, &run.zero)) {
            if (fd >= 0) {
                close(fd);
            }
            chunk_unhold(holder, 1);
            return refuse_region(error, "region %s: the process maps another file at %#"
                                 G_GINT64_MODIFIER "x, privately", name, at);
        }
    } else {
        fd = GPOINTER_TO_INT(known) - 1;
        (void)pf_pool_is_marked(fd, &run.zero); /* it was, and stays so */
    }
    if (v->offset % PF_PAGE_SIZE || index + run.n_pages > PF_POOL_CHUNK_SLOTS) {
        if (known == NULL) {
            close(fd);
            chunk_unhold(holder, 1);
        }
        return refuse_region(error, "region %s: the process maps a pool chunk at %#"
                             G_GINT64_MODIFIER "x beyond its end", name, at);
    }
    if (*pooled == NULL) {
        *pooled = g_new0(PfPoolMapped, 1);
        (*pooled)->holder = *holder;
        (*pooled)->runs = g_array_new(FALSE, FALSE, sizeof(PfPoolRun));
        (*pooled)->fds = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, close_fd);
    }
    if (known == NULL) {
        g_hash_table_insert((*pooled)->fds, g_memdup2(&run.ino, sizeof(run.ino)),
                            FD_VALUE(fd));
        (*pooled)->n_held++;
    }
    g_array_append_val((*pooled)->runs, run);
    return TRUE;
}

gboolean
pf_region_check_mapping(int proc_dir, int fd, const char *name, guint64 host_addr,
                        guint64 offset, guint64 size, const PfChunkHolder *holder,
                        PfPoolMapped **pooled, GCancellable *cancel, GError **error)
{
    g_autoptr(GArray) vmas = NULL;
    g_autoptr(PfPoolMapped) found = NULL;
    guint64 end = host_addr + size, at = host_addr;
    struct stat st;

    if (size == 0 || size % PF_PAGE_SIZE || host_addr % PF_PAGE_SIZE ||
        offset % PF_PAGE_SIZE || end < host_addr) {
        return refuse_region(error, "region %s: not page-aligned, or it wraps around", name);
    }
    if (size > PF_MAX_REGION_BYTES) {
        return refuse_region(error,
                             "region %s: %" G_GUINT64_FORMAT " bytes, larger than the %"
                             G_GUINT64_FORMAT " GiB a region may have",
                             name, size, PF_MAX_REGION_BYTES >> 30);
    }
    if (!check_memfd(fd, name, offset, size, &st, error)) {
        return FALSE;
    }
    vmas = read_vmas(proc_dir, "maps", host_addr, end, cancel, error);
    if (vmas == NULL) {
        g_prefix_error(error, "region %s: ", name);
        return FALSE;
    }
    for (guint i = 0; i < vmas->len && at < end; i++) {
        const Vma *v = &g_array_index(vmas, Vma, i);

        if (v->start > at) {
            break;
        }
        if (pooled != NULL && v->perms[0] != '\0' && v->perms[3] == 'p' &&
            (v->ino != (guint64)st.st_ino || makedev(v->major, v->minor) != st.st_dev)) {
            if (!check_pooled(proc_dir, v, name, host_addr, at, end, holder, &found, error)) {
                return FALSE;
            }
        } else if (!check_vma(proc_dir, v, &st, name, host_addr, offset, at, error)) {
            return FALSE;
        }
        at = v->end;
    }
    if (at < end) {
        return refuse_region(error, "region %s: %#" G_GINT64_MODIFIER "x is not mapped by the "
                             "process", name, at);
    }
    if (pooled != NULL) {
        *pooled = g_steal_pointer(&found);
    }
    return TRUE;
}

gboolean
pf_region_spans_protected(int proc_dir, const PfRegionSpan *spans, guint n, char **why,
                          GCancellable *cancel, GError **error)
{
    g_autoptr(GArray) vmas = NULL;
    guint64 lo = G_MAXUINT64, hi = 0;

    for (guint i = 0; i < n; i++) {
        why[i] = NULL;
        lo = MIN(lo, spans[i].host_addr);
        hi = MAX(hi, spans[i].host_addr + spans[i].size);
    }
    if (lo >= hi) {
        return TRUE; /* no span to look at */
    }
    vmas = read_vmas(proc_dir, "smaps", lo, hi, cancel, error);
    if (vmas == NULL) {
        return FALSE;
    }
    for (guint i = 0; i < n; i++) {
        guint64 at = spans[i].host_addr, end = spans[i].host_addr + spans[i].size;

        for (guint k = 0; k < vmas->len && at < end; k++) {
            const Vma *v = &g_array_index(vmas, Vma, k);

            if (v->end <= at) {
                continue;
            }
            if (v->start > at || !v->uffd_wp) {
                break;
            }
            at = v->end;
        }
        if (at < end) {
            why[i] = g_strdup_printf("region %s is not registered for userfaultfd write "
                                     "protection at %#" G_GINT64_MODIFIER "x, or not mapped",
                                     spans[i].name, at);
        }
    }
    return TRUE;
}

PfRegion *
pf_region_new_refused(const char *name, guint64 host_addr, guint64 size, const char *why)
{
    PfRegion *r = g_new0(PfRegion, 1);

    r->fd = -1;
    r->name = g_strdup(name);
    r->host_addr = host_addr;
    r->size = size;
    r->refused = g_strdup(why);
    return r;
}

/* What a region holds, freed; what it was announced as stays. */
static void
region_clear(PfRegion *r)
{
    if (r->map != NULL) {
        munmap((void *)r->map, r->size);
        r->map = NULL;
    }
    if (r->fd >= 0) {
        close(r->fd);
        r->fd = -1;
    }
    for (gsize e = 0; r->extents != NULL && e < r->n_extents; e++) {
        g_free(r->extents[e]);
    }
    g_clear_pointer(&r->extents, g_free);
    r->n_extents = r->extents_made = 0;
    g_clear_pointer(&r->huge_seen, g_free);
    g_clear_pointer(&r->huge_was, g_free);
    g_clear_pointer(&r->pooled, pf_pool_mapped_free);
    r->n_pages = 0;
}

PfPage *
pf_region_page_make(PfRegion *r, gsize idx)
{
    PfPage **e = &r->extents[idx / PF_EXTENT_PAGES];

    if (*e == NULL) {
        /* All zero: absent pages. */
        *e = g_try_new0(PfPage, PF_EXTENT_PAGES);
        if (*e == NULL) {
            return NULL;
        }
        r->extents_made++;
    }
    return &(*e)[idx % PF_EXTENT_PAGES];
}

void
pf_region_trim(PfRegion *r, gsize from, gsize to)
{
    for (gsize e = from / PF_EXTENT_PAGES; from < to && e <= (to - 1) / PF_EXTENT_PAGES; e++) {
        gsize i = 0;

        if (r->extents[e] == NULL) {
            continue;
        }
        while (i < PF_EXTENT_PAGES && r->extents[e][i].state == PF_PAGE_ABSENT) {
            i++;
        }
        if (i == PF_EXTENT_PAGES) {
            g_clear_pointer(&r->extents[e], g_free);
            r->extents_made--;
        }
    }
}

gsize
pf_region_record_bytes(const PfRegion *r)
{
    return r->extents_made * PF_EXTENT_PAGES * sizeof(PfPage) + r->n_extents * sizeof(PfPage *);
}

void
pf_region_retire(PfRegion *r)
{
    region_clear(r);
    r->gone = TRUE;
}

void
pf_region_refuse(PfRegion *r, const char *why)
{
    region_clear(r);
    g_free(r->refused);
    r->refused = g_strdup(why);
}

void
pf_region_free(PfRegion *r)
{
    if (r == NULL) {
        return;
    }
    region_clear(r);
    g_free(r->refused);
    g_free(r->name);
    g_free(r);
}
