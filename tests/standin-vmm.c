/*
 * standin-vmm.c - a STAND-IN VMM for the agent tests: it maps guest RAM
 * exactly as QEMU's memory-backend-memfd,share=on does, links the agent
 * library as the patched QEMU will, and runs writer threads that play a
 * guest writing its memory while merges happen.  Every byte written is
 * remembered in a shadow and checked.  The shadow keeps, per page, the seed
 * its content was made from (pf_fill_page(); 0: zeros), and a private copy
 * only of a page no seed makes (one byte written into it): a byte-for-byte
 * copy of all RAM would double the stand-in's memory, and the scale
 * benchmark (bench-scale.c) runs stand-ins of many GiB on a host that has
 * little more than their RAM.
 *
 *   standin-vmm -name guest=NAME --agent-socket PATH [--mib N] [--identical PCT]
 *               [--zero PCT] [--seed N] [--writers N] [--writes-per-sec N]
 *               [--volatile PCT] [--interleave] [--huge] [--backend] [--device-writers N]
 *
 * Commands on stdin, one per line, each answered by one line:
 *   write PAGE      write new content into a page        -> "ok"
 *   restore PAGE    write the page's first content back  -> "ok"
 *   rewrite same|zero
 *                   what a rebooting guest does to its RAM: new content
 *                   into every page, then, once all are written, every
 *                   page's first content again ("same") or zeros ("zero");
 *                   the shadow follows               -> "ok N" (pages)
 *   verify          compare all RAM with the shadow      -> "verify ok N" / "verify FAIL ..."
 *   nonzero         pages whose content is not all zero  -> "nonzero N"
 *   stats           the agent's counters                 -> "stats merged M moved V ..."
 *   discard PAGE N  give N pages back as a balloon does: the agent first,
 *                   then punch and MADV_DONTNEED as QEMU's
 *                   ram_block_discard_range(); they read zero after -> "ok"
 *   step-back WHY   pf_agent_step_back(), as QEMU before a vhost-user
 *                   device or a migration that needs plain RAM  -> "ok MODE"
 *   fault CALLS SKIP TIMES ERRNO
 *                   make the agent's system calls fail (faultsys.h);
 *                   "fault none" stops it                     -> "ok"
 *   fault hits      failures injected since the last "fault"  -> "hits N"
 *   scribble PAGE N EVERY
 *                   write new content into pages PAGE..PAGE+N-1, but not
 *                   into every EVERY-th (0: into all)            -> "ok"
 *   pool-probe SEED N
 *                   what a compromised VMM could read of the pool: every
 *                   pool chunk it holds a descriptor or a mapping of, read
 *                   whole, searched for the first N unique pages of a
 *                   guest of seed SEED         -> "probe files F pages P found X"
 *   pool-find SEED  the same, searched for the content "fill PAGE SEED"
 *                   writes                     -> "probe files F pages P found X"
 *   hold-pool       keep a descriptor of every pool chunk the agent holds
 *                   now, as a misbehaving VMM could          -> "ok N"
 *   fill PAGE SEED  write pf_fill_page(SEED) content into a page (SEED 0:
 *                   zeros; pages filled with one seed are equal) -> "ok"
 *   pageout PAGE N  madvise(MADV_PAGEOUT) on N pages, as the host's memory
 *                   pressure would: a private copy goes to swap
 *                                                     -> "ok" / "error WHY"
 *   mergeable PAGE N
 *                   madvise(MADV_MERGEABLE) on N pages: host KSM may merge
 *                   their private copies, as it does in a QEMU whose new
 *                   mappings are all mergeable (PR_SET_MEMORY_MERGE,
 *                   systemd's MemoryKSM=)          -> "ok" / "error WHY"
 *   pin PAGE        vmsplice() the page into a pipe kept open: a reference
 *                   on its memfd page (and the huge page around it) that
 *                   no split can drop until "unpin"  -> "ok" / "error WHY"
 *   unpin           close those pipes                         -> "ok"
 *   data PAGE       is the page's memfd offset data (SEEK_DATA)? -> "data 0|1"
 *   backend start [notuffd|range]
 *                   start a stand-in vhost-user back-end (standin-backend.c,
 *                   lying as told) and attach it: pf_agent_set_backend(), or
 *                   the agent refuses and the VM steps back  -> "ok MODE" /
 *                                                             "error WHY"
 *   backend expect  pf_agent_expect_backend(): a back-end is about to map
 *                   guest RAM (as QEMU says before a memory table)
 *   backend detach  pf_agent_remove_backend(), the back-end left running
 *                   and mapping guest RAM (a disconnect it outlives)
 *   backend kill|stop|cont
 *                   SIGKILL (then pf_agent_remove_backend()), SIGSTOP or
 *                   SIGCONT the back-end                      -> "ok"
 *   backend verify  read every page through the back-end and compare with
 *                   the shadow          -> "verify ok N" / "verify FAIL ..."
 *   device          the device writers' counts -> "device reads R writes W bad B"
 *   quit            stop writers, verify, exit 0 or 1
 * EOF on stdin is quit.  Prints "ready PID MODE" first.
 *
 * Device writers (--device-writers) play a vhost-user device: each picks
 * a page, and has the back-end write new content into it or read it back
 * (checked against the shadow), through the CPU or a system call in turn.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent.h"
#include "faultsys.h"
#include "guestmem.h"
#include "standin-backend.h"
#include "testproc.h"
#include "util.h"

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

/* The stand-in back-end, as a vhost-user device's connection to it. */
typedef struct {
    GMutex lock;     /* one request at a time; and the fields */
    int sock;        /* -1: no back-end */
    GPid pid;
    guint64 reads, writes, bad;
    gsize first_bad;
} Device;

typedef struct {
    PfGuest *g;
    PfAgent *agent;
    Device dev;
    guint n_device_writers;
    guint64 *seed;    /* per page: the pf_fill_page() seed of what it must
                       * hold (0: zeros) */
    guint8 **odd;     /* per page: what it must hold when no seed makes it
                       * (a byte written into it), else NULL */
    GMutex *locks;    /* one per 64 pages: writers and commands */
    gint stop;
    guint n_writers;
    guint rate;
    guint64 writes;
    gboolean interleave; /* odd pages of the identical block are unique */
    gsize volatile_pages; /* if not 0: writers rewrite only these, at the
                           * start of the unique block, with new content */
} Vmm;

static GMutex *
lock_of(Vmm *v, gsize page)
{
    return &v->locks[page / 64];
}

/* Writes guest RAM and the shadow together: the page made from seed, or
 * (partial) one byte of it.  The agent may be merging this very page: the
 * write blocks on write protection, or lands in a private copy; either way
 * it must be there when read back. */
static void
write_page(Vmm *v, gsize page, guint64 seed, gboolean partial)
{
    guint8 content[PF_PAGE_SIZE];
    guint8 *dst = v->g->mem + page * PF_PAGE_SIZE;

    pf_fill_page(content, seed);
    g_mutex_lock(lock_of(v, page));
    if (partial) {
        gsize off = g_random_int_range(0, PF_PAGE_SIZE);

        /* No seed makes this page any more: it gets a copy of its own. */
        if (v->odd[page] == NULL) {
            v->odd[page] = g_malloc(PF_PAGE_SIZE);
            pf_fill_page(v->odd[page], v->seed[page]);
        }
        dst[off] = content[off];
        v->odd[page][off] = content[off];
    } else {
        memcpy(dst, content, PF_PAGE_SIZE);
        v->seed[page] = seed;
        g_clear_pointer(&v->odd[page], g_free);
    }
    g_mutex_unlock(lock_of(v, page));
}

/* What a page must hold, from the shadow; the caller holds its lock. */
static void
expected_page(Vmm *v, gsize page, guint8 *out)
{
    if (v->odd[page] != NULL) {
        memcpy(out, v->odd[page], PF_PAGE_SIZE);
    } else {
        pf_fill_page(out, v->seed[page]);
    }
}

/* What QEMU's ram_block_discard_range() does to a shared memfd block,
 * after asking the agent: the pages read zero from then on. */
/* Reads a whole pool memfd once (by inode) and counts the secret pages in
 * it. */
static void
probe_file(int fd, GHashTable *seen, GHashTable *secret, gsize *files, gsize *pages,
           gsize *found)
{
    guint8 buf[PF_PAGE_SIZE];
    struct stat st;

    if (fstat(fd, &st) < 0 || g_hash_table_contains(seen, GSIZE_TO_POINTER(st.st_ino))) {
        return;
    }
    g_hash_table_add(seen, GSIZE_TO_POINTER(st.st_ino));
    (*files)++;
    for (off_t off = 0; off + PF_PAGE_SIZE <= st.st_size; off += PF_PAGE_SIZE) {
        guint64 key;
        const guint8 *want;

        if (pread(fd, buf, PF_PAGE_SIZE, off) != PF_PAGE_SIZE) {
            g_error("pool-probe: pread: %s", g_strerror(errno));
        }
        (*pages)++;
        memcpy(&key, buf, sizeof(key));
        want = g_hash_table_lookup(secret, &key);
        if (want != NULL && memcmp(want, buf, PF_PAGE_SIZE) == 0) {
            (*found)++;
        }
    }
}

/* The agent's view of the pool does not matter: a compromised VMM reads
 * every descriptor it holds and every file it maps (a mapping can be
 * grown with mremap, or opened through map_files), looking for pages
 * made from the given fill seeds. */
static void
pool_probe(const guint64 *seeds, gsize n)
{
    g_autoptr(GHashTable) secret = g_hash_table_new_full(g_int64_hash, g_int64_equal, NULL,
                                                          g_free);
    g_autoptr(GHashTable) seen = g_hash_table_new(NULL, NULL);
    g_autoptr(GDir) dir = g_dir_open("/proc/self/fd", 0, NULL);
    g_autofree char *maps = NULL;
    g_auto(GStrv) lines = NULL;
    gsize files = 0, pages = 0, found = 0;
    const char *e;

    for (gsize i = 0; i < n; i++) {
        guint8 *page = g_malloc(PF_PAGE_SIZE);

        pf_fill_page(page, seeds[i]);
        g_hash_table_insert(secret, page, page); /* keyed by its first 8 bytes */
    }
    while (dir != NULL && (e = g_dir_read_name(dir)) != NULL) {
        g_autofree char *path = g_strdup_printf("/proc/self/fd/%s", e);
        g_autofree char *target = g_file_read_link(path, NULL);
        int fd;

        if (target == NULL || !g_str_has_prefix(target, "/memfd:pagefold-pool") ||
            (fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
            continue;
        }
        probe_file(fd, seen, secret, &files, &pages, &found);
        close(fd);
    }
    if (!g_file_get_contents("/proc/self/maps", &maps, NULL, NULL)) {
        g_error("pool-probe: cannot read /proc/self/maps");
    }
    lines = g_strsplit(maps, "\n", -1);
    for (guint i = 0; lines[i] != NULL; i++) {
        g_autofree char *path = NULL;
        char range[64];
        int fd;

        if (strstr(lines[i], "pagefold-pool") == NULL || sscanf(lines[i], "%63s", range) != 1) {
            continue;
        }
        path = g_strdup_printf("/proc/self/map_files/%s", range);
        if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0 && errno == ENOENT) {
            continue; /* the agent unmapped it since (a DROP) */
        }
        if (fd < 0) {
            g_error("pool-probe: %s: %s (run as root)", path, g_strerror(errno));
        }
        probe_file(fd, seen, secret, &files, &pages, &found);
        close(fd);
    }
    printf("probe files %zu pages %zu found %zu\n", files, pages, found);
}

static void
discard(Vmm *v, PfAgent *agent, gsize page, gsize n)
{
    guint8 *hva = v->g->mem + page * PF_PAGE_SIZE;

    for (gsize l = page / 64; l <= (page + n - 1) / 64; l++) {
        g_mutex_lock(&v->locks[l]);
    }
    pf_agent_discard(agent, hva, n * PF_PAGE_SIZE);
    if (fallocate(v->g->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  (off_t)(page * PF_PAGE_SIZE), (off_t)(n * PF_PAGE_SIZE)) < 0 ||
        madvise(hva, n * PF_PAGE_SIZE, MADV_DONTNEED) < 0) {
        g_error("discard: %s", g_strerror(errno));
    }
    for (gsize p = page; p < page + n; p++) {
        v->seed[p] = 0;
        g_clear_pointer(&v->odd[p], g_free);
    }
    for (gsize l = page / 64; l <= (page + n - 1) / 64; l++) {
        g_mutex_unlock(&v->locks[l]);
    }
}

/* The seed of a page's first content (0: zeros), as pf_guest_new_full()
 * and --interleave lay it out. */
static guint64
first_seed(Vmm *v, gsize page)
{
    const PfLayout *l = &v->g->layout;

    if (page < l->identical && v->interleave && page % 2) {
        return pf_page_seed(4, v->g->seed, page, 0);
    } else if (page < l->identical) {
        return pf_page_seed(1, 0, page, 0);
    } else if (page < l->identical + l->unique) {
        return pf_page_seed(3, v->g->seed, page - l->identical, 0);
    }
    return 0;
}

/* Never 0, which means zeros. */
static guint64
random_seed(GRand *rnd)
{
    return ((guint64)g_rand_int(rnd) << 32 | g_rand_int(rnd)) | 1;
}

/* A rebooting guest: every page gets new content, and only once all have
 * does each get its first content again (or zeros), so that pagefoldd
 * sees a whole RAM of changed pages, as after a real reboot's firmware and
 * kernel have run over it. */
static gsize
rewrite(Vmm *v, gboolean zero)
{
    g_autoptr(GRand) rnd = g_rand_new();

    for (gsize p = 0; p < v->g->n_pages; p++) {
        write_page(v, p, random_seed(rnd), FALSE);
    }
    for (gsize p = 0; p < v->g->n_pages; p++) {
        write_page(v, p, zero ? 0 : first_seed(v, p), FALSE);
    }
    return v->g->n_pages;
}

static gpointer
writer(gpointer data)
{
    Vmm *v = data;
    GRand *rnd = g_rand_new();
    gint64 interval = v->rate ? G_USEC_PER_SEC / v->rate : 0;

    while (!g_atomic_int_get(&v->stop)) {
        gsize page = g_rand_int_range(rnd, 0, (gint32)v->g->n_pages);
        guint kind = g_rand_int_range(rnd, 0, 4);
        guint64 seed;

        if (v->volatile_pages > 0) {
            page = v->g->layout.identical + g_rand_int_range(rnd, 0, (gint32)v->volatile_pages);
            kind = 1;
        }
        /* Back to its first content (so it can merge again), something
         * new, one byte, or zeros. */
        seed = kind == 0 ? first_seed(v, page) : kind == 3 ? 0 : random_seed(rnd);
        write_page(v, page, seed, kind == 2);
        __atomic_add_fetch(&v->writes, 1, __ATOMIC_RELAXED);
        if (interval) {
            g_usleep(interval);
        }
    }
    g_rand_free(rnd);
    return NULL;
}

/*
 * Starts the stand-in back-end and attaches it (lie: how it lies, or "");
 * the agent refusing it steps the VM back, as QEMU would.  What to answer.
 */
static char *
device_start(Vmm *v, const char *lie)
{
    g_autofree char *self = g_file_read_link("/proc/self/exe", NULL);
    g_autofree char *dir = self != NULL ? g_path_get_dirname(self) : g_strdup(".");
    g_autofree char *prog = g_getenv("STANDIN_BACKEND") != NULL
                                ? g_strdup(g_getenv("STANDIN_BACKEND"))
                                : g_build_filename(dir, "standin-backend", NULL);
    g_autofree char *lie_arg = g_strdup_printf("--lie=%s", lie);
    g_autoptr(GError) error = NULL;
    int dev_fd = pf_agent_dup_userfaultfd_dev(v->agent);
    int sv[2], uffd;
    const char *argv[] = { prog, "3", "4", dev_fd >= 0 ? "5" : lie_arg, lie_arg, NULL };
    int source[3], target[3] = { 3, 4, 5 };
    PfBeHello hello;
    PfBeAck ack = { 0 };
    PfAgentBackendRange range;
    GPid pid;
    gboolean ok;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        return g_strdup_printf("error socketpair: %s", g_strerror(errno));
    }
    source[0] = v->g->fd;
    source[1] = sv[1];
    source[2] = dev_fd;
    if (*lie == '\0') {
        argv[dev_fd >= 0 ? 4 : 3] = NULL;
    }
    ok = g_spawn_async_with_pipes_and_fds(NULL, argv, NULL,
                                          G_SPAWN_DO_NOT_REAP_CHILD |
                                          G_SPAWN_STDOUT_TO_DEV_NULL,
                                          NULL, NULL, -1, -1, -1, source, target,
                                          dev_fd >= 0 ? 3 : 2, &pid, NULL, NULL, NULL,
                                          &error);
    close(sv[1]);
    if (dev_fd >= 0) {
        close(dev_fd);
    }
    if (!ok) {
        close(sv[0]);
        return g_strdup_printf("error %s", error->message);
    }
    if (pf_test_recv_fd(sv[0], &hello, sizeof(hello), &uffd) != sizeof(hello) || uffd < 0) {
        close(sv[0]);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return g_strdup("error the back-end did not start");
    }
    range = (PfAgentBackendRange){ v->g->mem, v->g->n_pages * PF_PAGE_SIZE, hello.base };
    if (!pf_agent_set_backend(v->agent, "backend0", uffd, &range, 1, &error)) {
        g_autoptr(GError) step_error = NULL;
        g_autofree char *why = g_strdup_printf("a vhost-user back-end the agent refused: %s",
                                               error->message);

        g_printerr("standin-vmm: %s\n", error->message);
        if (!pf_agent_step_back(v->agent, why, &step_error)) {
            g_printerr("standin-vmm: %s\n", step_error->message);
        }
        ack.status = EINVAL;
    }
    if (!pf_test_send_fd(sv[0], &ack, sizeof(ack), -1)) {
        g_printerr("standin-vmm: the back-end went: %s\n", g_strerror(errno));
    }
    g_mutex_lock(&v->dev.lock);
    v->dev.sock = sv[0];
    v->dev.pid = pid;
    g_mutex_unlock(&v->dev.lock);
    return g_strdup_printf("ok %s", pf_agent_get_mode(v->agent) == PF_MODE_MERGE ? "merge"
                                                                               : "advise");
}

/* The back-end gone (it died, or was killed): detached.  With dev.lock. */
static void
device_gone(Vmm *v)
{
    if (v->dev.sock < 0) {
        return;
    }
    close(v->dev.sock);
    v->dev.sock = -1;
    kill(v->dev.pid, SIGKILL);
    waitpid(v->dev.pid, NULL, 0);
    pf_agent_remove_backend(v->agent, "backend0");
}

/* One access of the device's; FALSE when no back-end answers. */
static gboolean
device_request(Vmm *v, const PfBeReq *rq, PfBeAns *ans)
{
    gboolean ok = FALSE;
    int fd;

    g_mutex_lock(&v->dev.lock);
    if (v->dev.sock >= 0) {
        ok = pf_test_send_fd(v->dev.sock, rq, sizeof(*rq), -1) &&
             pf_test_recv_fd(v->dev.sock, ans, sizeof(*ans), &fd) == sizeof(*ans);
        if (!ok) {
            device_gone(v);
        }
    }
    g_mutex_unlock(&v->dev.lock);
    return ok;
}

/* Reads page through the back-end and checks it; the caller holds its lock. */
static gboolean
device_check(Vmm *v, gsize page, gboolean syscall, PfBeAns *ans)
{
    PfBeReq rq = { 'r', syscall, { 0 }, page, 0 };
    guint8 want[PF_PAGE_SIZE];
    gboolean bad;

    if (!device_request(v, &rq, ans)) {
        return TRUE;
    }
    expected_page(v, page, want);
    bad = ans->err != 0 || memcmp(ans->data, want, PF_PAGE_SIZE) != 0;
    g_mutex_lock(&v->dev.lock);
    v->dev.reads++;
    if (bad && v->dev.bad++ == 0) {
        v->dev.first_bad = page;
    }
    g_mutex_unlock(&v->dev.lock);
    return !bad;
}

static gpointer
device_writer(gpointer data)
{
    Vmm *v = data;
    g_autoptr(GRand) rnd = g_rand_new();
    g_autofree PfBeAns *ans = g_new0(PfBeAns, 1);
    gint64 interval = v->rate ? G_USEC_PER_SEC / v->rate : 0;

    while (!g_atomic_int_get(&v->stop)) {
        gsize page = g_rand_int_range(rnd, 0, (gint32)v->g->n_pages);
        gboolean syscall = g_rand_boolean(rnd);

        g_mutex_lock(lock_of(v, page));
        if (g_rand_boolean(rnd)) {
            /* Back to its first content (it can merge again), or new. */
            guint64 seed = g_rand_boolean(rnd) ? first_seed(v, page) : random_seed(rnd);
            PfBeReq rq = { 'w', syscall, { 0 }, page, seed };
            /* FALSE: no back-end (none yet, or it was killed), no write. */
            gboolean answered = device_request(v, &rq, ans);

            g_mutex_lock(&v->dev.lock);
            if (answered && ans->err == 0) {
                v->seed[page] = seed;
                g_clear_pointer(&v->odd[page], g_free);
                v->dev.writes++;
            } else if (answered) {
                g_printerr("standin-vmm: the back-end's write: %s\n", g_strerror(ans->err));
                v->dev.bad++;
            }
            g_mutex_unlock(&v->dev.lock);
        } else {
            device_check(v, page, syscall, ans);
        }
        g_mutex_unlock(lock_of(v, page));
        if (interval) {
            g_usleep(interval);
        }
    }
    return NULL;
}

/* Every page read through the back-end (which folds back what it touches). */
static gboolean
device_verify(Vmm *v, GString *why)
{
    g_autofree PfBeAns *ans = g_new0(PfBeAns, 1);
    gsize bad = 0, first_bad = 0;

    for (gsize p = 0; p < v->g->n_pages; p++) {
        gboolean ok;

        g_mutex_lock(lock_of(v, p));
        ok = device_check(v, p, p % 2, ans);
        g_mutex_unlock(lock_of(v, p));
        if (!ok && bad++ == 0) {
            first_bad = p;
        }
    }
    if (bad > 0) {
        g_string_printf(why, "%zu page(s) read through the back-end differ from what was "
                        "written, first %zu", bad, first_bad);
    }
    return bad == 0;
}

static gboolean
verify(Vmm *v, GString *why)
{
    gsize bad = 0, first_bad = 0;
    guint8 want[PF_PAGE_SIZE];

    for (gsize p = 0; p < v->g->n_pages; p++) {
        gboolean ok;

        g_mutex_lock(lock_of(v, p));
        expected_page(v, p, want);
        ok = memcmp(v->g->mem + p * PF_PAGE_SIZE, want, PF_PAGE_SIZE) == 0;
        g_mutex_unlock(lock_of(v, p));
        if (!ok && bad++ == 0) {
            first_bad = p;
        }
    }
    if (bad > 0) {
        g_string_printf(why, "%zu page(s) differ from what was written, first %zu", bad, first_bad);
        return FALSE;
    }
    g_mutex_lock(&v->dev.lock);
    bad = v->dev.bad;
    first_bad = v->dev.first_bad;
    g_mutex_unlock(&v->dev.lock);
    if (bad > 0) {
        g_string_printf(why, "the device saw %zu bad page(s), first %zu", bad, first_bad);
    }
    return bad == 0;
}

int
main(int argc, char **argv)
{
    g_autofree char *name = NULL, *socket_path = NULL;
    gint mib = 32, identical = 50, zero = 20, seed = 1, writers = 0, rate = 1000;
    gboolean interleave = FALSE, huge = FALSE, unattached = FALSE, backend = FALSE;
    gint device_writers = 0;
    gint volatile_pct = 0;
    GOptionEntry entries[] = {
        { "name", 0, 0, G_OPTION_ARG_STRING, &name, "guest=NAME", "guest=NAME" },
        { "agent-socket", 0, 0, G_OPTION_ARG_FILENAME, &socket_path, "pagefoldd's agent socket", "PATH" },
        { "mib", 0, 0, G_OPTION_ARG_INT, &mib, "RAM in MiB (32)", "N" },
        { "identical", 0, 0, G_OPTION_ARG_INT, &identical, "percent identical across VMs (50)", "PCT" },
        { "zero", 0, 0, G_OPTION_ARG_INT, &zero, "percent zero (20)", "PCT" },
        { "seed", 0, 0, G_OPTION_ARG_INT, &seed, "seed of the unique pages", "N" },
        { "writers", 0, 0, G_OPTION_ARG_INT, &writers, "writer threads (0)", "N" },
        { "writes-per-sec", 0, 0, G_OPTION_ARG_INT, &rate, "per writer (1000)", "N" },
        { "volatile", 0, 0, G_OPTION_ARG_INT, &volatile_pct,
          "writers rewrite only this percent of pages (in the unique block), "
          "0: any page, sometimes back to its first content (0)", "PCT" },
        { "huge", 0, 0, G_OPTION_ARG_NONE, &huge,
          "RAM in transparent huge pages (MADV_HUGEPAGE), as QEMU can", NULL },
        { "interleave", 0, 0, G_OPTION_ARG_NONE, &interleave,
          "every other identical page unique instead: no two merges adjacent", NULL },
        { "backend", 0, 0, G_OPTION_ARG_NONE, &backend,
          "a stand-in vhost-user back-end attached at the start", NULL },
        { "device-writers", 0, 0, G_OPTION_ARG_INT, &device_writers,
          "threads that read and write pages through the back-end (0)", "N" },
        { "run-unattached", 0, 0, G_OPTION_ARG_NONE, &unattached,
          "run on unmerged when the first handshake fails, as QEMU does (its agent "
          "connects again when pagefoldd said it may)", NULL },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx = g_option_context_new("- stand-in VMM with the agent library");
    g_autoptr(GError) error = NULL;
    g_autoptr(PfAgent) agent = NULL;
    g_autoptr(GString) why = g_string_new(NULL);
    g_autoptr(GArray) pins = g_array_new(FALSE, FALSE, sizeof(int)); /* "pin" pipes */
    g_autoptr(GRand) rnd = NULL;
    GThread **threads;
    PfLayout l = { 0 };
    Vmm v = { 0 };
    PfAgentRegion r;
    char line[256];
    gsize pages;
    int rc = 0;

    for (int i = 1; i < argc; i++) {
        if (g_str_equal(argv[i], "-name")) {
            argv[i] = (char *)"--name";
        }
    }
    g_option_context_add_main_entries(ctx, entries, NULL);
    if (!g_option_context_parse(ctx, &argc, &argv, &error) || socket_path == NULL || name == NULL) {
        g_printerr("standin-vmm: %s\n", error ? error->message : "-name and --agent-socket are needed");
        return 2;
    }
    pages = (gsize)mib * 256;
    l.identical = pages * (gsize)identical / 100;
    l.zero = pages * (gsize)zero / 100;
    l.unique = pages - l.identical - l.zero;
    v.g = pf_guest_new_full("memory-backend-memfd", &l, (guint32)seed, huge);
    v.interleave = interleave;
    v.volatile_pages = MIN(l.unique, pages * (gsize)MAX(volatile_pct, 0) / 100);
    v.seed = g_new(guint64, pages);
    v.odd = g_new0(guint8 *, pages);
    for (gsize p = 0; p < pages; p++) {
        v.seed[p] = first_seed(&v, p);
    }
    for (gsize p = 1; interleave && p < l.identical; p += 2) {
        pf_fill_page(v.g->mem + p * PF_PAGE_SIZE, v.seed[p]);
    }
    fcntl(v.g->fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
    v.locks = g_new0(GMutex, pages / 64 + 1);
    v.n_writers = (guint)writers;
    v.n_device_writers = (guint)MAX(device_writers, 0);
    v.rate = (guint)rate;
    v.dev.sock = -1;
    g_mutex_init(&v.dev.lock);

    agent = pf_agent_new(g_str_has_prefix(name, "guest=") ? name + 6 : name, NULL);
    r = (PfAgentRegion){ "pc.ram", v.g->mem, pages * PF_PAGE_SIZE, v.g->fd, 0,
                         { huge ? MADV_HUGEPAGE : 0 } };
    if (!pf_agent_add_region(agent, &r, &error)) {
        g_printerr("standin-vmm: %s\n", error->message);
        return 1;
    }
    /* They fail only when told to ("fault"). */
    pf_agent_set_syscalls(agent, &pf_test_faulty_syscalls);
    if (!pf_agent_start(agent, socket_path, &error) ||
        (!pf_agent_wait_settled(agent, &error) && !unattached)) {
        g_printerr("standin-vmm: %s\n", error->message);
        return 1;
    }
    v.agent = agent;
    if (backend) {
        g_autofree char *said = device_start(&v, "");

        if (!g_str_has_prefix(said, "ok")) {
            g_printerr("standin-vmm: %s\n", said);
            return 1;
        }
    }
    threads = g_new0(GThread *, v.n_writers + v.n_device_writers + 1);
    for (guint i = 0; i < v.n_writers; i++) {
        threads[i] = g_thread_new("writer", writer, &v);
    }
    for (guint i = 0; i < v.n_device_writers; i++) {
        threads[v.n_writers + i] = g_thread_new("device", device_writer, &v);
    }
    printf("ready %d %s\n", (int)getpid(), pf_agent_get_mode(agent) == PF_MODE_MERGE ? "merge" : "advise");
    fflush(stdout);

    /* New content is of 64-bit seeds: with 32 bits, two VMMs' thousands
     * of "new" pages shared one in 200 runs, and merged. */
    rnd = g_rand_new();
    while (fgets(line, sizeof(line), stdin) != NULL) {
        guint64 page, n;
        char calls[64];
        int skip, times, errnum;

        g_strchomp(line);
        if (sscanf(line, "write %" G_GUINT64_FORMAT, &page) == 1 && page < pages) {
            write_page(&v, page, random_seed(rnd), FALSE);
            printf("ok\n");
        } else if (sscanf(line, "restore %" G_GUINT64_FORMAT, &page) == 1 && page < pages) {
            write_page(&v, page, first_seed(&v, page), FALSE);
            printf("ok\n");
        } else if (g_str_equal(line, "rewrite same") || g_str_equal(line, "rewrite zero")) {
            printf("ok %zu\n", rewrite(&v, g_str_equal(line, "rewrite zero")));
        } else if (sscanf(line, "discard %" G_GUINT64_FORMAT " %" G_GUINT64_FORMAT, &page, &n) ==
                       2 && page < pages && n > 0 && n <= pages - page) {
            discard(&v, agent, page, n);
            printf("ok\n");
        } else if (sscanf(line, "scribble %" G_GUINT64_FORMAT " %" G_GUINT64_FORMAT " %d",
                          &page, &n, &skip) == 3 &&
                   page < pages && n <= pages - page && skip >= 0) {
            for (gsize q = page; q < page + n; q++) {
                if (skip == 0 || q % (gsize)skip != 0) {
                    write_page(&v, q, random_seed(rnd), FALSE);
                }
            }
            printf("ok\n");
        } else if (sscanf(line, "pool-probe %d %" G_GUINT64_FORMAT, &skip, &n) == 2 &&
                   n <= pages) {
            g_autofree guint64 *seeds = g_new(guint64, MAX(n, 1));

            for (gsize i = 0; i < n; i++) {
                seeds[i] = pf_page_seed(3, (guint32)skip, i, 0);
            }
            pool_probe(seeds, n);
        } else if (sscanf(line, "pool-find %" G_GUINT64_FORMAT, &n) == 1) {
            pool_probe(&n, 1);
        } else if (g_str_equal(line, "hold-pool")) {
            g_autoptr(GDir) dir = g_dir_open("/proc/self/fd", 0, NULL);
            g_autoptr(GPtrArray) fds = g_ptr_array_new();
            const char *e;
            guint kept = 0;

            while (dir != NULL && (e = g_dir_read_name(dir)) != NULL) {
                g_autofree char *path = g_strdup_printf("/proc/self/fd/%s", e);
                g_autofree char *target = g_file_read_link(path, NULL);

                if (target != NULL && g_str_has_prefix(target, "/memfd:pagefold-pool-")) {
                    g_ptr_array_add(fds, GINT_TO_POINTER(atoi(e)));
                }
            }
            for (guint i = 0; i < fds->len; i++) {
                kept += fcntl(GPOINTER_TO_INT(g_ptr_array_index(fds, i)), F_DUPFD_CLOEXEC, 3) >= 0;
            }
            printf("ok %u\n", kept);
        } else if (sscanf(line, "fill %" G_GUINT64_FORMAT " %" G_GUINT64_FORMAT, &page, &n) ==
                       2 && page < pages) {
            write_page(&v, page, n, FALSE);
            printf("ok\n");
        } else if ((sscanf(line, "pageout %" G_GUINT64_FORMAT " %" G_GUINT64_FORMAT, &page,
                           &n) == 2 ||
                    sscanf(line, "mergeable %" G_GUINT64_FORMAT " %" G_GUINT64_FORMAT, &page,
                           &n) == 2) &&
                   page < pages && n > 0 && n <= pages - page) {
            int advice = line[0] == 'p' ? MADV_PAGEOUT : MADV_MERGEABLE;

            if (madvise(v.g->mem + page * PF_PAGE_SIZE, n * PF_PAGE_SIZE, advice) < 0) {
                printf("error %s\n", g_strerror(errno));
            } else {
                printf("ok\n");
            }
        } else if (sscanf(line, "pin %" G_GUINT64_FORMAT, &page) == 1 && page < pages) {
            struct iovec iov = { v.g->mem + page * PF_PAGE_SIZE, PF_PAGE_SIZE };
            int p[2];

            if (pipe2(p, O_CLOEXEC) < 0) {
                printf("error %s\n", g_strerror(errno));
            } else if (vmsplice(p[1], &iov, 1, 0) != (ssize_t)PF_PAGE_SIZE) {
                printf("error %s\n", g_strerror(errno));
                close(p[0]);
                close(p[1]);
            } else {
                g_array_append_vals(pins, p, 2);
                printf("ok\n");
            }
        } else if (g_str_equal(line, "unpin")) {
            for (guint i = 0; i < pins->len; i++) {
                close(g_array_index(pins, int, i));
            }
            g_array_set_size(pins, 0);
            printf("ok\n");
        } else if (sscanf(line, "data %" G_GUINT64_FORMAT, &page) == 1 && page < pages) {
            off_t at = (off_t)(page * PF_PAGE_SIZE);

            printf("data %d\n", lseek(v.g->fd, at, SEEK_DATA) == at);
        } else if (g_str_has_prefix(line, "backend start")) {
            g_autofree char *said = device_start(&v, g_strstrip(line + strlen("backend start")));

            printf("%s\n", said);
        } else if (g_str_equal(line, "backend expect")) {
            pf_agent_expect_backend(v.agent, "backend0");
            printf("ok\n");
        } else if (g_str_equal(line, "backend detach")) {
            pf_agent_remove_backend(v.agent, "backend0");
            printf("ok\n");
        } else if (g_str_equal(line, "backend kill")) {
            g_mutex_lock(&v.dev.lock);
            device_gone(&v);
            g_mutex_unlock(&v.dev.lock);
            printf("ok\n");
        } else if (g_str_equal(line, "backend stop") || g_str_equal(line, "backend cont")) {
            /* Not under dev.lock: a request may be waiting on it. */
            printf(v.dev.sock >= 0 && kill(v.dev.pid, line[8] == 's' ? SIGSTOP : SIGCONT) == 0
                   ? "ok\n" : "error no back-end\n");
        } else if (g_str_equal(line, "backend verify")) {
            if (device_verify(&v, why)) {
                printf("verify ok %zu\n", pages);
            } else {
                printf("verify FAIL %s\n", why->str);
            }
        } else if (g_str_equal(line, "device")) {
            g_mutex_lock(&v.dev.lock);
            printf("device reads %" G_GUINT64_FORMAT " writes %" G_GUINT64_FORMAT
                   " bad %" G_GUINT64_FORMAT "\n", v.dev.reads, v.dev.writes, v.dev.bad);
            g_mutex_unlock(&v.dev.lock);
        } else if (g_str_equal(line, "fault hits")) {
            printf("hits %d\n", pf_test_fault_hits());
        } else if (g_str_equal(line, "fault none")) {
            pf_test_fault_set(NULL, 0, 0, 0, FALSE);
            printf("ok\n");
        } else if (sscanf(line, "fault %63s %d %d %d", calls, &skip, &times, &errnum) == 4) {
            pf_test_fault_set(calls, skip, times, errnum, FALSE);
            printf("ok\n");
        } else if (g_str_has_prefix(line, "step-back ")) {
            g_autoptr(GError) err = NULL;

            if (!pf_agent_step_back(agent, line + strlen("step-back "), &err)) {
                g_printerr("standin-vmm: %s\n", err->message);
            }
            printf("ok %s\n", pf_agent_get_mode(agent) == PF_MODE_MERGE ? "merge" : "advise");
        } else if (g_str_equal(line, "nonzero")) {
            static const guint8 zero_page[PF_PAGE_SIZE];
            gsize nz = 0;

            for (gsize p = 0; p < pages; p++) {
                g_mutex_lock(lock_of(&v, p));
                nz += v.odd[p] != NULL ? memcmp(v.odd[p], zero_page, PF_PAGE_SIZE) != 0
                                       : v.seed[p] != 0;
                g_mutex_unlock(lock_of(&v, p));
            }
            printf("nonzero %zu\n", nz);
        } else if (g_str_equal(line, "verify")) {
            if (verify(&v, why)) {
                printf("verify ok %zu\n", pages);
            } else {
                printf("verify FAIL %s\n", why->str);
            }
        } else if (g_str_equal(line, "stats")) {
            PfAgentStats st;

            pf_agent_get_stats(agent, &st);
            printf("stats merged %" G_GUINT64_FORMAT " moved %" G_GUINT64_FORMAT
                   " zeroed %" G_GUINT64_FORMAT " unmerged %" G_GUINT64_FORMAT
                   " changed %" G_GUINT64_FORMAT " errors %" G_GUINT64_FORMAT
                   " remapped %" G_GUINT64_FORMAT " discarded %" G_GUINT64_FORMAT
                   " backend_fold_backs %" G_GUINT64_FORMAT
                   " writes %" G_GUINT64_FORMAT " connected %d\n",
                   st.merged, st.moved, st.zeroed, st.unmerged, st.changed, st.errors,
                   st.remapped, st.discarded, st.backend_fold_backs,
                   __atomic_load_n(&v.writes, __ATOMIC_RELAXED),
                   pf_agent_is_connected(agent));
        } else if (g_str_equal(line, "quit")) {
            break;
        } else {
            printf("error unknown command\n");
        }
        fflush(stdout);
    }
    g_atomic_int_set(&v.stop, 1);
    for (guint i = 0; i < v.n_writers + v.n_device_writers; i++) {
        g_thread_join(threads[i]);
    }
    if (verify(&v, why) && (v.dev.sock < 0 || device_verify(&v, why))) {
        printf("verify ok %zu\n", pages);
    } else {
        printf("verify FAIL %s\n", why->str);
        rc = 1;
    }
    fflush(stdout);
    g_free(threads);
    g_mutex_lock(&v.dev.lock);
    device_gone(&v);
    g_mutex_unlock(&v.dev.lock);
    /* The agent goes first: it maps guest RAM. */
    g_clear_pointer(&agent, pf_agent_free);
    g_free(v.locks);
    for (gsize p = 0; p < pages; p++) {
        g_free(v.odd[p]);
    }
    g_free(v.odd);
    g_free(v.seed);
    pf_guest_free(v.g);
    return rc;
}
