/*
 * bench-census.c - the limit of merging, measured: what the memfd guest
 * RAM of a set of QEMU processes holds, for the kernel-build benchmark's
 * "ideal" (scripts/bench-kernel-build).
 *
 *   bench-census PID...    then, on stdin, a line per census: one JSON
 *                          line on stdout for each (a process that maps no
 *                          RAM yet counts nothing, and is looked at again)
 *
 * A census counts every page a guest holds: pages of its RAM's memfd, and
 * pages its process maps over that RAM from elsewhere (pagefold's merged
 * pages, mapped from the pool).  RAM never touched is not counted.  Of
 * those it reports how many are zero, how many distinct contents the rest
 * have, and the same for the pages unchanged since the last census: the
 * saving no merger can beat is the pages present less their distinct
 * non-zero contents (zero pages merge into none, as KSM's use_zero_pages
 * does).  Pages are told apart by XXH3-64: among a few million pages the
 * odds that two differ and count as one are below one in a million.
 *
 * What it must never do: change what it counts.  It reads with pread(),
 * which allocates nothing where it finds a hole, and maps nothing of the
 * guests' (a page mapped here too would halve the QEMU's Pss): the
 * memfd's pages where mincore() on a mapping of its own, never read, says
 * they are in memory; pages mapped from elsewhere through /proc/PID/mem
 * where pagemap says they are present, else from the file they map.
 * Needs root (map_files).
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hash.h"
#include "page.h"
#include "util.h"

/* Below this a shared memfd mapping is not guest RAM (QEMU's other
 * memfds are small). */
#define MIN_RAM_BYTES (64u << 20)
#define RUN_PAGES 512u

typedef struct {
    guint64 base;      /* where the process maps page 0 of the memfd */
    guint64 n_pages;
    int fd;            /* the memfd, read with pread() */
    const guint8 *map; /* the memfd, PROT_READ, MAP_SHARED, for mincore()
                        * alone: a page read through it would be mapped
                        * here too, halving the QEMU's Pss */
    guint64 *last;     /* each page's checksum at the last census, 0: none */
} Ram;

typedef struct {
    int pid;
    int mem_fd, pagemap_fd;
    GArray *rams; /* Ram */
} Proc;

typedef struct {
    guint64 present, zero, distinct;
    guint64 stable, stable_zero, stable_distinct;
    GHashTable *seen, *stable_seen; /* checksum -> itself, non-zero ones */
} Census;

static gboolean
ram_known(const Proc *p, guint64 base)
{
    for (guint i = 0; i < p->rams->len; i++) {
        if (g_array_index(p->rams, Ram, i).base == base) {
            return TRUE;
        }
    }
    return FALSE;
}

/* The shared memfd mappings of at least MIN_RAM_BYTES: guest RAM. */
static gboolean
find_rams(Proc *p, GStrv lines, GError **error)
{
    for (guint i = 0; lines[i] != NULL; i++) {
        guint64 start, end, offset;
        char perms[8], file[64];
        g_autofree char *mf = NULL;
        struct stat st;
        Ram ram = { 0 };
        void *map;
        int fd;

        if (sscanf(lines[i], "%" SCNx64 "-%" SCNx64 " %7s %" SCNx64 " %*s %*s %63s", &start,
                   &end, perms, &offset, file) != 5 ||
            perms[3] != 's' || !g_str_has_prefix(file, "/memfd:") ||
            end - start < MIN_RAM_BYTES || ram_known(p, start - offset)) {
            continue;
        }
        mf = g_strdup_printf("/proc/%d/map_files/%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER
                             "x", p->pid, start, end);
        fd = open(mf, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &st) < 0) {
            g_set_error(error, G_FILE_ERROR, g_file_error_from_errno(errno), "%s: %s", mf,
                        g_strerror(errno));
            if (fd >= 0) {
                close(fd);
            }
            return FALSE;
        }
        map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) {
            g_set_error(error, G_FILE_ERROR, g_file_error_from_errno(errno), "mmap %s: %s",
                        mf, g_strerror(errno));
            close(fd);
            return FALSE;
        }
        ram.fd = fd;
        ram.base = start - offset;
        ram.n_pages = (guint64)st.st_size / PF_PAGE_SIZE;
        ram.map = map;
        ram.last = g_new0(guint64, ram.n_pages);
        g_array_append_val(p->rams, ram);
    }
    if (p->rams->len == 0) {
        g_set_error(error, G_FILE_ERROR, G_FILE_ERROR_NOENT,
                    "process %d maps no shared memfd of %u MiB or more", p->pid,
                    MIN_RAM_BYTES >> 20);
        return FALSE;
    }
    return TRUE;
}

static void
count(Census *c, guint64 sum, gboolean zero, gboolean stable)
{
    c->present++;
    c->stable += stable;
    if (zero) {
        c->zero++;
        c->stable_zero += stable;
        return;
    }
    if (g_hash_table_add(c->seen, g_memdup2(&sum, sizeof(sum)))) {
        c->distinct++;
    }
    if (stable && g_hash_table_add(c->stable_seen, g_memdup2(&sum, sizeof(sum)))) {
        c->stable_distinct++;
    }
}

/* A page's checksum, never 0 (0 is "none" in Ram.last). */
static guint64
checksum(const guint8 *page, gboolean *zero)
{
    guint64 sum;

    *zero = pf_page_is_zero(page);
    sum = *zero ? 1 : pf_hash_default()->func(page);
    return sum != 0 ? sum : 2;
}

/* A mapping over part of a RAM that is not of its memfd: pagefold's
 * merged pages, mapped privately from a pool chunk. */
typedef struct {
    guint64 first, end; /* pages of the RAM */
    guint64 offset;     /* in the file, of page first */
    int fd;             /* the file, or -1 (anonymous, or unreadable) */
} Other;

static void
other_clear(gpointer data)
{
    Other *o = data;

    if (o->fd >= 0) {
        close(o->fd);
    }
}

static GArray *
others_over(const Proc *p, const Ram *ram, GStrv lines)
{
    GArray *others = g_array_new(FALSE, FALSE, sizeof(Other));
    guint64 end_addr = ram->base + ram->n_pages * PF_PAGE_SIZE;

    g_array_set_clear_func(others, other_clear);
    for (guint i = 0; lines[i] != NULL; i++) {
        guint64 start, end, offset, from;
        char perms[8], file[64] = "";
        Other o;

        if (sscanf(lines[i], "%" SCNx64 "-%" SCNx64 " %7s %" SCNx64 " %*s %*s %63s", &start,
                   &end, perms, &offset, file) < 4 ||
            end <= ram->base || start >= end_addr) {
            continue;
        }
        if (perms[3] == 's' && g_str_has_prefix(file, "/memfd:") &&
            start - offset == ram->base) {
            continue; /* the RAM's own */
        }
        from = MAX(start, ram->base);
        o.first = (from - ram->base) / PF_PAGE_SIZE;
        o.end = (MIN(end, end_addr) - ram->base) / PF_PAGE_SIZE;
        o.offset = offset + (from - start);
        o.fd = -1;
        if (file[0] == '/') {
            g_autofree char *mf = g_strdup_printf("/proc/%d/map_files/%" G_GINT64_MODIFIER
                                                  "x-%" G_GINT64_MODIFIER "x", p->pid, start,
                                                  end);

            o.fd = open(mf, O_RDONLY | O_CLOEXEC);
        }
        g_array_append_val(others, o);
    }
    return others;
}

static void
census_ram(Proc *p, Ram *ram, GStrv maps, Census *c)
{
    static guint8 buf[PF_PAGE_SIZE], run[RUN_PAGES * PF_PAGE_SIZE];
    g_autoptr(GArray) others = others_over(p, ram, maps);
    guint o = 0;

    for (guint64 first = 0; first < ram->n_pages; first += RUN_PAGES) {
        guint64 n = MIN(RUN_PAGES, ram->n_pages - first);
        guint8 resident[RUN_PAGES];
        guint64 pm[RUN_PAGES];
        gboolean have_pm;
        ssize_t got;

        /* Which pages the memfd holds; their content by pread(), which
         * reads a hole (one punched since) as zeros, allocating nothing. */
        if (mincore((void *)(ram->map + first * PF_PAGE_SIZE), n * PF_PAGE_SIZE, resident) < 0) {
            memset(resident, 0, sizeof(resident));
        }
        got = memchr(resident, 1, n) != NULL
                  ? pread(ram->fd, run, n * PF_PAGE_SIZE, (off_t)(first * PF_PAGE_SIZE))
                  : 0;
        if (got < 0) {
            got = 0;
        }
        have_pm = pread(p->pagemap_fd, pm, n * sizeof(guint64),
                        (off_t)((ram->base / PF_PAGE_SIZE + first) * sizeof(guint64))) ==
                  (ssize_t)(n * sizeof(guint64));
        for (guint64 i = 0; i < n; i++) {
            guint64 idx = first + i;
            const guint8 *page = NULL;
            gboolean zero, other;
            guint64 sum;

            while (o < others->len && g_array_index(others, Other, o).end <= idx) {
                o++;
            }
            other = o < others->len && g_array_index(others, Other, o).first <= idx;
            if (other) {
                const Other *ot = &g_array_index(others, Other, o);

                /*
                 * Mapped from elsewhere.  Present, the page the guest
                 * sees (its own copy, once written); not yet touched, the
                 * file's page (pread() of a hole allocates nothing).
                 */
                if (have_pm && (pm[i] >> 63 & 1)) {
                    if (pread(p->mem_fd, buf, PF_PAGE_SIZE,
                              (off_t)(ram->base + idx * PF_PAGE_SIZE)) == PF_PAGE_SIZE) {
                        page = buf;
                    }
                } else if (ot->fd >= 0 &&
                           pread(ot->fd, buf, PF_PAGE_SIZE,
                                 (off_t)(ot->offset + (idx - ot->first) * PF_PAGE_SIZE)) ==
                               PF_PAGE_SIZE) {
                    page = buf;
                }
            } else if ((resident[i] & 1) && (gsize)got >= (i + 1) * PF_PAGE_SIZE) {
                page = run + i * PF_PAGE_SIZE;
            }
            if (page == NULL) {
                ram->last[idx] = 0;
                continue;
            }
            sum = checksum(page, &zero);
            count(c, sum, zero, ram->last[idx] == sum);
            ram->last[idx] = sum;
        }
    }
}

int
main(int argc, char **argv)
{
    g_autoptr(GPtrArray) procs = g_ptr_array_new();
    char line[256];

    if (argc < 2) {
        fprintf(stderr, "usage: bench-census PID...  (then a line on stdin per census)\n");
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        Proc *p = g_new0(Proc, 1);
        g_autofree char *mem = NULL, *pagemap = NULL;

        p->pid = atoi(argv[i]);
        p->rams = g_array_new(FALSE, FALSE, sizeof(Ram));
        mem = g_strdup_printf("/proc/%d/mem", p->pid);
        pagemap = g_strdup_printf("/proc/%d/pagemap", p->pid);
        p->mem_fd = open(mem, O_RDONLY | O_CLOEXEC);
        p->pagemap_fd = open(pagemap, O_RDONLY | O_CLOEXEC);
        if (p->pid <= 0 || p->mem_fd < 0 || p->pagemap_fd < 0) {
            fprintf(stderr, "bench-census: process %s: %s\n", argv[i],
                    p->pid <= 0 ? "not a pid" : g_strerror(errno));
            return 1;
        }
        g_ptr_array_add(procs, p);
    }
    while (fgets(line, sizeof(line), stdin) != NULL) {
        Census c = { 0 };
        double t0 = (double)g_get_monotonic_time() / G_USEC_PER_SEC;

        c.seen = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, NULL);
        c.stable_seen = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, NULL);
        for (guint i = 0; i < procs->len; i++) {
            Proc *p = g_ptr_array_index(procs, i);
            g_autofree char *path = g_strdup_printf("/proc/%d/maps", p->pid);
            g_autofree char *text = NULL;
            g_auto(GStrv) maps = NULL;
            g_autoptr(GError) error = NULL;

            if (!g_file_get_contents(path, &text, NULL, NULL)) {
                continue; /* gone: it holds nothing */
            }
            maps = g_strsplit(text, "\n", -1);
            if (p->rams->len == 0 && !find_rams(p, maps, &error)) {
                /* A QEMU that has not mapped its RAM yet holds nothing. */
                fprintf(stderr, "bench-census: process %d: %s\n", p->pid, error->message);
                g_clear_error(&error);
            }
            for (guint k = 0; k < p->rams->len; k++) {
                census_ram(p, &g_array_index(p->rams, Ram, k), maps, &c);
            }
        }
        /* ideal: the pages no merger can do without. */
        printf("{\"present\":%" G_GUINT64_FORMAT ",\"zero\":%" G_GUINT64_FORMAT
               ",\"distinct\":%" G_GUINT64_FORMAT ",\"ideal_saving_pages\":%" G_GUINT64_FORMAT
               ",\"stable\":%" G_GUINT64_FORMAT ",\"stable_zero\":%" G_GUINT64_FORMAT
               ",\"stable_distinct\":%" G_GUINT64_FORMAT
               ",\"stable_ideal_saving_pages\":%" G_GUINT64_FORMAT ",\"census_s\":%.2f}\n",
               c.present, c.zero, c.distinct, c.present - c.distinct, c.stable, c.stable_zero,
               c.stable_distinct, c.stable - c.stable_distinct,
               (double)g_get_monotonic_time() / G_USEC_PER_SEC - t0);
        fflush(stdout);
        g_hash_table_unref(c.seen);
        g_hash_table_unref(c.stable_seen);
    }
    return 0;
}
