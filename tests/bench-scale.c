/*
 * bench-scale.c - the scale benchmark: how pagefoldd (the real daemon, in
 * merge mode) behaves as guest RAM grows, over a matrix of total RAM
 * (1, 4, 16 GiB; BENCH_SCALE_MAX_GIB allows more) split over 1, 4 and 16
 * VMs (no VM under 64 MiB).
 *
 * The VMs are STAND-IN VMMs, not QEMU: tests/standin-vmm maps its guest RAM
 * exactly as QEMU's memory-backend-memfd,share=on does and links the real
 * agent library, as the patched QEMU does; it is this benchmark's stand-in
 * for QEMU (no guest runs, no vCPU, no TCG), so every figure here is
 * pagefoldd's and the agent's, none a guest's.
 *
 * Workloads:
 *   zero    every page of guest RAM written, all zeros (a Windows guest
 *           after boot): all of it can go
 *   mixed   standin-vmm's usual mix: 50% identical across VMs, 20% zero,
 *           30% unique
 *   reboot  the mixed VMs, once merged, all rewrite all their RAM (new
 *           content, then their first content again: standin-vmm's
 *           "rewrite same"); how pagefoldd catches up (copies on write
 *           found, pages folded back, merged again).  It continues the
 *           mixed case in the same processes.
 * Each case starts a fresh pagefoldd with run=0, sets its knobs over the
 * control socket (BENCH_SCALE_KNOBS, default KNOBS_DEFAULT below: chosen
 * for speed), starts the stand-ins, measures a baseline, sets run=1 and
 * samples until merging is complete (counters unchanged over two full
 * passes, nothing pending) or the phase's deadline.  At the end every
 * stand-in verifies all its RAM against its shadow.
 *
 * One JSON line per case, then a markdown table, "growth" lines (each
 * quantity against RAM: linear or not), and a data file and gnuplot script
 * (scale.dat, scale.gp; scale.png if gnuplot is installed) in
 * BENCH_SCALE_OUT (default: the build directory).  Per case:
 *   pass time     full passes over time (mean_pass_s), last_pass_ms from
 *                 stats; cpu_s_per_gib: pagefoldd's utime+stime over the
 *                 GiB of page visits (pages_scanned)
 *   metadata      metadata_bytes / pages_tracked, in total and per VM;
 *                 pagefoldd's RssAnon (its own memory: metadata, trees),
 *                 VmRSS and VmHWM (those include the guest RAM and pool it
 *                 maps, so they are not its own)
 *   memory freed  the stand-ins' memory, counted as the kernel holds it:
 *                 their anonymous Pss (private copies of merged pages,
 *                 their heap) plus the blocks of their guest memfds plus
 *                 the blocks of every pool chunk (pagefoldd's or theirs,
 *                 each counted once).  Not Pss alone: pagefoldd maps guest
 *                 RAM too, and a folded-back page in the memfd need not be
 *                 mapped; not KSM-style counters (docs/DESIGN.md,
 *                 invariant 4).  t90: time until 90% of the final saving.
 *   stall         a thread of its own sends "knobs" on a connection of its
 *                 own every 20 ms and times each answer: max and p99;
 *                 control_ok is false if any took over 100 ms
 *   attached      every VM still in stats/list, and each stand-in's verify
 * Cases that would not fit in MemAvailable are skipped with a line saying
 * why.  Every wait has a deadline (BENCH_SCALE_PHASE_S per phase, default
 * 120 s + 60 s per GiB): a hung daemon or stand-in is reported, not waited
 * for.  Exit status 1 if any case failed: a verify failure, a stand-in or
 * pagefoldd that died or hung, a VM that was detached.  A slow control
 * socket or an incomplete merge is reported, not failed.
 *
 * Environment: BENCH_SCALE_GIB (list, default 1,4,16), BENCH_SCALE_VMS
 * (1,4,16), BENCH_SCALE_WORKLOADS (zero,mixed,reboot), BENCH_SCALE_MAX_GIB
 * (16), BENCH_SCALE_KNOBS (k=v,...), BENCH_SCALE_PHASE_S,
 * BENCH_SCALE_RESERVE_MIB (memory left to the rest of the host, 1024),
 * BENCH_SCALE_OUT.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "bench-common.h"
#include "testproc.h"

#define KNOBS_DEFAULT "pages_to_scan=16384,sleep_millisecs=2"
#define MIN_VM_MIB 64
#define PROBE_PERIOD_MS 20
#define STALL_LIMIT_MS 100.0
#define CTL_TIMEOUT_S 30.0
#define MIB_F (1024.0 * 1024.0)
#define GIB_F (1024.0 * 1024.0 * 1024.0)

/* ---- the control socket, with deadlines ---- */

/* One connection; a call that times out drops it (its answer would come
 * later, out of turn) and the next call connects again. */
typedef struct {
    char *path;
    int fd;
    GString *in;
} Ctl;

static void
ctl_close(Ctl *c)
{
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    g_string_truncate(c->in, 0);
}

static void
ctl_free(Ctl *c)
{
    ctl_close(c);
    g_string_free(c->in, TRUE);
    g_free(c->path);
    g_free(c);
}
G_DEFINE_AUTOPTR_CLEANUP_FUNC(Ctl, ctl_free)

static Ctl *
ctl_new(const char *path)
{
    Ctl *c = g_new0(Ctl, 1);

    c->path = g_strdup(path);
    c->fd = -1;
    c->in = g_string_new(NULL);
    return c;
}

static char *
ctl_read_line(Ctl *c, gint64 deadline, GError **error)
{
    for (;;) {
        char *nl = memchr(c->in->str, '\n', c->in->len);
        gint64 left = deadline - g_get_monotonic_time();
        struct pollfd p = { c->fd, POLLIN, 0 };
        char buf[65536];
        ssize_t n;
        int r;

        if (nl != NULL) {
            char *line = g_strndup(c->in->str, (gsize)(nl - c->in->str));

            g_string_erase(c->in, 0, nl - c->in->str + 1);
            return line;
        }
        if (left <= 0) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT, "pagefoldd did not answer");
            return NULL;
        }
        r = poll(&p, 1, (int)MAX(1, MIN(left / 1000, 1000)));
        if (r <= 0) {
            continue;
        }
        n = recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
            continue;
        }
        if (n <= 0) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_CLOSED, "pagefoldd closed the connection%s%s",
                        n < 0 ? ": " : "", n < 0 ? g_strerror(errno) : "");
            return NULL;
        }
        g_string_append_len(c->in, buf, n);
    }
}

static gboolean
ctl_connect(Ctl *c, gint64 deadline, GError **error)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    g_autofree char *greeting = NULL;

    g_strlcpy(addr.sun_path, c->path, sizeof(addr.sun_path));
    /* Non-blocking: a daemon that does not accept fills its backlog and a
     * blocking connect() would wait without end. */
    for (;;) {
        c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (connect(c->fd, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
            break;
        }
        ctl_close(c);
        if ((errno != EAGAIN && errno != EINTR) || g_get_monotonic_time() > deadline) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_FAILED, "cannot connect to %s: %s",
                        c->path, g_strerror(errno));
            return FALSE;
        }
        g_usleep(10000);
    }
    greeting = ctl_read_line(c, deadline, error);
    if (greeting == NULL) {
        ctl_close(c);
        return FALSE;
    }
    return TRUE;
}

static gboolean
ctl_send_all(Ctl *c, const char *text, gint64 deadline, GError **error)
{
    gsize off = 0, len = strlen(text);

    while (off < len) {
        ssize_t n = send(c->fd, text + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        struct pollfd p = { c->fd, POLLOUT, 0 };

        if (n >= 0) {
            off += (gsize)n;
        } else if (errno == EAGAIN || errno == EINTR) {
            if (g_get_monotonic_time() > deadline) {
                g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT, "pagefoldd reads nothing");
                return FALSE;
            }
            (void)poll(&p, 1, 100);
        } else {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_CLOSED, "send: %s", g_strerror(errno));
            return FALSE;
        }
    }
    return TRUE;
}

/* Runs one command (args: a JSON object's text, or NULL) and returns its
 * "return" member. */
static JsonNode *
ctl_call(Ctl *c, const char *execute, const char *args, double timeout_s, GError **error)
{
    gint64 deadline = g_get_monotonic_time() + (gint64)(timeout_s * G_USEC_PER_SEC);
    g_autofree char *req = args ? g_strdup_printf("{\"execute\":\"%s\",\"arguments\":%s}\n",
                                                  execute, args)
                                : g_strdup_printf("{\"execute\":\"%s\"}\n", execute);
    g_autofree char *line = NULL;
    g_autoptr(JsonParser) parser = json_parser_new();
    JsonObject *o;

    if (c->fd < 0 && !ctl_connect(c, deadline, error)) {
        return NULL;
    }
    if (!ctl_send_all(c, req, deadline, error) ||
        (line = ctl_read_line(c, deadline, error)) == NULL) {
        ctl_close(c);
        return NULL;
    }
    if (!json_parser_load_from_data(parser, line, -1, error)) {
        ctl_close(c);
        return NULL;
    }
    o = json_node_get_object(json_parser_get_root(parser));
    if (json_object_has_member(o, "error")) {
        JsonObject *e = json_object_get_object_member(o, "error");

        g_set_error(error, G_IO_ERROR, G_IO_ERROR_FAILED, "%s: %s", execute,
                    json_object_get_string_member_with_default(e, "desc", "?"));
        return NULL;
    }
    return json_node_copy(json_object_get_member(o, "return"));
}

/* ---- the stall probe ---- */

/* Measures how long pagefoldd's main loop leaves a cheap command
 * unanswered, from a thread of its own so that the benchmark's own pauses
 * (sampling /proc) do not count. */
typedef struct {
    char *sock;
    GThread *thread;
    gint stop;
    GMutex lock;
    GArray *lat_ms;      /* every answer's round trip */
    guint from;          /* first entry of the current phase */
    gint64 inflight;     /* when the unanswered request was sent, or 0 */
    char *error;         /* why it stopped probing, if it did */
} Probe;

static gpointer
probe_main(gpointer data)
{
    Probe *p = data;
    g_autoptr(Ctl) c = ctl_new(p->sock);
    g_autoptr(GError) error = NULL;

    if (!ctl_connect(c, g_get_monotonic_time() + 10 * G_USEC_PER_SEC, &error)) {
        goto fail;
    }
    while (!g_atomic_int_get(&p->stop)) {
        gint64 t0 = g_get_monotonic_time();
        g_autofree char *line = NULL;
        double ms;

        g_mutex_lock(&p->lock);
        p->inflight = t0;
        g_mutex_unlock(&p->lock);
        if (!ctl_send_all(c, "{\"execute\":\"knobs\"}\n", G_MAXINT64, &error)) {
            goto fail;
        }
        /* Short slices: a daemon that never answers must not keep the
         * benchmark from ending. */
        while (line == NULL && !g_atomic_int_get(&p->stop)) {
            g_clear_error(&error);
            line = ctl_read_line(c, g_get_monotonic_time() + 50000, &error);
            if (line == NULL && !g_error_matches(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT)) {
                goto fail;
            }
        }
        if (line == NULL) {
            break; /* stopped: probe_take() counts the wait so far */
        }
        ms = (double)(g_get_monotonic_time() - t0) / 1000.0;
        g_mutex_lock(&p->lock);
        p->inflight = 0;
        g_array_append_val(p->lat_ms, ms);
        g_mutex_unlock(&p->lock);
        if (ms < PROBE_PERIOD_MS) {
            g_usleep((gulong)((PROBE_PERIOD_MS - ms) * 1000));
        }
    }
    return NULL;
fail:
    g_mutex_lock(&p->lock);
    p->error = g_strdup(error ? error->message : "?");
    g_mutex_unlock(&p->lock);
    return NULL;
}

static Probe *
probe_start(const char *sock)
{
    Probe *p = g_new0(Probe, 1);

    p->sock = g_strdup(sock);
    p->lat_ms = g_array_new(FALSE, FALSE, sizeof(double));
    g_mutex_init(&p->lock);
    p->thread = g_thread_new("stall-probe", probe_main, p);
    return p;
}

static void
probe_free(Probe *p)
{
    g_atomic_int_set(&p->stop, 1);
    g_thread_join(p->thread);
    g_array_unref(p->lat_ms);
    g_mutex_clear(&p->lock);
    g_free(p->error);
    g_free(p->sock);
    g_free(p);
}
G_DEFINE_AUTOPTR_CLEANUP_FUNC(Probe, probe_free)

typedef struct {
    guint n;
    guint over;         /* answers over STALL_LIMIT_MS */
    double max_ms, p99_ms;
    gboolean unanswered; /* a request still waiting (counted in max_ms) */
    char *error;
} Stall;

/* The round trips since the last call; one still waiting counts with the
 * time it has waited so far. */
static Stall
probe_take(Probe *p)
{
    Stall s = { 0 };
    g_autoptr(GArray) v = g_array_new(FALSE, FALSE, sizeof(double));

    g_mutex_lock(&p->lock);
    g_array_append_vals(v, p->lat_ms->data + p->from * sizeof(double), p->lat_ms->len - p->from);
    p->from = p->lat_ms->len;
    if (p->inflight != 0) {
        double ms = (double)(g_get_monotonic_time() - p->inflight) / 1000.0;

        if (ms > PROBE_PERIOD_MS) {
            g_array_append_val(v, ms);
            s.unanswered = ms > STALL_LIMIT_MS;
        }
    }
    s.error = g_strdup(p->error);
    g_mutex_unlock(&p->lock);
    g_array_sort(v, bench_cmp_double);
    s.n = v->len;
    for (guint i = 0; i < v->len; i++) {
        s.over += g_array_index(v, double, i) > STALL_LIMIT_MS;
    }
    if (v->len > 0) {
        s.max_ms = g_array_index(v, double, v->len - 1);
        s.p99_ms = g_array_index(v, double, MIN(v->len - 1, (guint)ceil(0.99 * v->len) - 1));
    }
    return s;
}

/* ---- /proc ---- */

static double
proc_cpu_s(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/stat", pid);
    g_autofree char *text = NULL;
    unsigned long long ut = 0, st = 0;
    const char *p;

    if (!g_file_get_contents(path, &text, NULL, NULL) || (p = strrchr(text, ')')) == NULL) {
        return NAN;
    }
    /* After "(comm)": state is field 3, utime 14, stime 15. */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) {
        return NAN;
    }
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Alive and not a zombie. */
static gboolean
proc_alive(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/stat", pid);
    g_autofree char *text = NULL;
    const char *p;

    return g_file_get_contents(path, &text, NULL, NULL) && (p = strrchr(text, ')')) != NULL &&
           p[1] == ' ' && p[2] != 'Z' && p[2] != 'X';
}

/* A "Key:   N kB" field of /proc/PID/status or smaps_rollup, in KiB; -1 if
 * absent. */
static gint64
proc_kib(int pid, const char *file, const char *key)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/%s", pid, file);
    g_autofree char *text = NULL;
    g_autofree char *k = g_strdup_printf("\n%s:", key);
    const char *p;

    if (!g_file_get_contents(path, &text, NULL, NULL) || (p = strstr(text, k)) == NULL) {
        return -1;
    }
    return g_ascii_strtoll(p + strlen(k), NULL, 10);
}

static gboolean
is_pool_name(const char *s)
{
    return strstr(s, "/memfd:pagefold-pool-") != NULL;
}

/* Adds the blocks of each pool chunk the process holds by descriptor or
 * mapping, once per inode over all calls with the same seen set. */
static gint64
pool_kib(int pid, GHashTable *seen)
{
    g_autofree char *fddir = g_strdup_printf("/proc/%d/fd", pid);
    g_autofree char *maps_path = g_strdup_printf("/proc/%d/maps", pid);
    g_autofree char *maps = NULL;
    g_autoptr(GDir) d = g_dir_open(fddir, 0, NULL);
    gint64 kib = 0;
    const char *e;

    while (d != NULL && (e = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_build_filename(fddir, e, NULL);
        g_autofree char *target = g_file_read_link(path, NULL);
        struct stat st;

        if (target != NULL && is_pool_name(target) && stat(path, &st) == 0 &&
            g_hash_table_add(seen, GSIZE_TO_POINTER(st.st_ino))) {
            kib += st.st_blocks / 2;
        }
    }
    if (g_file_get_contents(maps_path, &maps, NULL, NULL)) {
        g_auto(GStrv) lines = g_strsplit(maps, "\n", -1);

        for (guint i = 0; lines[i] != NULL; i++) {
            char range[64];
            unsigned long long ino;
            struct stat st;

            /* The inode is in the line: stat only chunks not seen yet
             * (a merged VM maps one chunk in thousands of pieces). */
            if (!is_pool_name(lines[i]) ||
                sscanf(lines[i], "%63s %*s %*s %*s %llu", range, &ino) != 2 ||
                g_hash_table_contains(seen, GSIZE_TO_POINTER((gsize)ino))) {
                continue;
            }
            g_autofree char *path = g_strdup_printf("/proc/%d/map_files/%s", pid, range);

            if (stat(path, &st) == 0 && g_hash_table_add(seen, GSIZE_TO_POINTER(st.st_ino))) {
                kib += st.st_blocks / 2;
            }
        }
    }
    return kib;
}

/* ---- one case ---- */

typedef struct {
    double t;                 /* s since the phase began */
    gint64 full_scans, pages_scanned, last_pass_usec;
    gint64 shared, sharing, zero, unshared, pending, cow, tracked, metadata, vmas_max;
    double cpu_s;             /* pagefoldd's */
    double footprint_mib;     /* the stand-ins' memory (see the top) */
    double anon_mib;          /* pagefoldd's RssAnon */
    guint attached;
} Sample;

typedef struct {
    /* set up */
    const char *layout;       /* "zero" or "mixed" */
    int gib, n_vms, vm_mib;
    double phase_s;
    JsonObject *knobs;
    /* run */
    PfTestDaemon *d;
    int daemon_pid;
    PfTestVmm **vmm;
    Ctl *ctl;
    Probe *probe;
    double *detached_at;      /* per VM: s since the case began, or -1 */
    double t_case;
    gboolean control_lost;    /* a stats call timed out or the daemon went */
    char *control_error;
    JsonObject *last_stats;
} Case;

/* What the table, the growth lines and the plot need of a result line. */
typedef struct {
    char *workload;
    int gib, vms;
    gboolean skipped, failed, complete, control_ok, attached, verify_ok;
    double pass_ms, cpu_per_gib, meta_per_page, pfd_anon_mib, stall_max_ms, stall_p99_ms;
    double freed_mib, expected_mib, t90_s;
    gint64 passes;
    char *why;
} Row;

static gint64
member(JsonObject *o, const char *name)
{
    return o != NULL ? json_object_get_int_member_with_default(o, name, 0) : 0;
}

/* The VM of that pid in an array of VM objects, or NULL. */
static JsonObject *
vm_by_pid(JsonArray *vms, int pid)
{
    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *o = json_array_get_object_element(vms, i);

        if (member(o, "pid") == pid) {
            return o;
        }
    }
    return NULL;
}

static double
footprint_mib(Case *c)
{
    g_autoptr(GHashTable) seen = g_hash_table_new(NULL, NULL);
    gint64 kib = pool_kib(c->daemon_pid, seen);

    for (int i = 0; i < c->n_vms; i++) {
        gint64 anon = proc_kib(c->vmm[i]->pid, "smaps_rollup", "Pss_Anon");
        gint64 memfd = pf_test_memfd_kib(c->vmm[i]->pid);

        kib += MAX(anon, 0) + MAX(memfd, 0) + pool_kib(c->vmm[i]->pid, seen);
    }
    return (double)kib / 1024.0;
}

/* One look at everything; FALSE if pagefoldd did not answer. */
static gboolean
take_sample(Case *c, double t_phase0, Sample *s)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonNode) st = NULL;
    JsonObject *o, *total;
    JsonArray *vms;

    memset(s, 0, sizeof(*s));
    s->t = bench_now() - t_phase0;
    s->cpu_s = proc_cpu_s(c->daemon_pid);
    s->anon_mib = (double)proc_kib(c->daemon_pid, "status", "RssAnon") / 1024.0;
    s->footprint_mib = footprint_mib(c);
    st = ctl_call(c->ctl, "stats", NULL, CTL_TIMEOUT_S, &error);
    if (st == NULL) {
        c->control_lost = TRUE;
        g_free(c->control_error);
        c->control_error = g_strdup_printf("stats: %s", error->message);
        return FALSE;
    }
    o = json_node_get_object(st);
    total = json_object_get_object_member(o, "total");
    vms = json_object_get_array_member(o, "vms");
    s->full_scans = member(total, "full_scans");
    s->pages_scanned = member(total, "pages_scanned");
    s->last_pass_usec = member(o, "last_pass_usec");
    s->shared = member(total, "pages_shared");
    s->sharing = member(total, "pages_sharing");
    s->zero = member(total, "zero_pages");
    s->unshared = member(total, "pages_unshared");
    s->pending = member(total, "pages_pending");
    s->cow = member(total, "cow");
    s->tracked = member(total, "pages_tracked");
    s->metadata = member(total, "metadata_bytes");
    for (int i = 0; i < c->n_vms; i++) {
        JsonObject *vm = vm_by_pid(vms, c->vmm[i]->pid);

        if (vm != NULL) {
            s->attached++;
            s->vmas_max = MAX(s->vmas_max, member(vm, "vmas"));
        } else if (c->detached_at[i] < 0) {
            c->detached_at[i] = bench_now() - c->t_case;
            g_printerr("bench-scale: VM %d (pid %d) is no longer attached after %.1f s\n", i,
                       c->vmm[i]->pid, c->detached_at[i]);
        }
    }
    if (c->last_stats != NULL) {
        json_object_unref(c->last_stats);
    }
    c->last_stats = json_object_ref(o);
    return TRUE;
}

/* Counters unchanged over two full passes with nothing in flight: KSM's
 * "merging is done". */
typedef struct {
    gint64 sig[4];
    gint64 scans_at_change;
    gint64 scans_at_start;
} Settle;

static void
settle_init(Settle *z, const Sample *s)
{
    memset(z, 0, sizeof(*z));
    z->sig[0] = -1;
    z->scans_at_start = s->full_scans;
    z->scans_at_change = s->full_scans;
}

static gboolean
settled(Settle *z, const Sample *s)
{
    gint64 sig[4] = { s->shared, s->sharing, s->zero, s->pending };

    if (memcmp(sig, z->sig, sizeof(sig)) != 0) {
        memcpy(z->sig, sig, sizeof(sig));
        z->scans_at_change = s->full_scans;
    }
    return s->pending == 0 && s->full_scans >= z->scans_at_start + 2 &&
           s->full_scans >= z->scans_at_change + 2;
}

/* Sampling, paced so that reading /proc (page tables of many GiB) takes
 * no more than a quarter of the time. */
static void
pace(double cost_s)
{
    g_usleep((gulong)(MAX(0.25, 3 * cost_s) * G_USEC_PER_SEC));
}

typedef struct {
    GArray *samples;
    gboolean complete;
    const char *end;          /* why sampling ended */
    double t90_s;             /* since the phase began; -1 if never */
} Phase;

/* The time of the first sample from t_from on that has 90% of the
 * saving (counted from base_mib; target_mib <= 0: the last sample's), or
 * -1. */
static double
t90(Phase *ph, double base_mib, double target_mib, double t_from)
{
    Sample *last = &g_array_index(ph->samples, Sample, ph->samples->len - 1);
    double goal = 0.9 * (target_mib > 0 ? target_mib : base_mib - last->footprint_mib);

    for (guint i = 0; goal > 0 && i < ph->samples->len; i++) {
        Sample *x = &g_array_index(ph->samples, Sample, i);

        if (x->t >= t_from && base_mib - x->footprint_mib >= goal) {
            return x->t;
        }
    }
    return -1;
}

/* Samples until merging settles, or the deadline, or there is nothing
 * left to watch.  base_mib: the footprint the saving is counted from;
 * target_mib: the saving t90 is counted against (<= 0: the phase's own
 * final saving). */
static void
run_phase(Case *c, Phase *ph, double t0, double base_mib, double target_mib,
          gboolean (*busy)(Case *c, gpointer user), gpointer user)
{
    Settle z;
    Sample s;
    gboolean first = TRUE;

    ph->samples = g_array_new(FALSE, FALSE, sizeof(Sample));
    ph->complete = FALSE;
    ph->end = "deadline";
    for (;;) {
        double before = bench_now();
        gboolean still_busy = busy != NULL && busy(c, user);

        if (!take_sample(c, t0, &s)) {
            /* The counters stay as last seen: the figures end there. */
            if (ph->samples->len > 0) {
                Sample *l = &g_array_index(ph->samples, Sample, ph->samples->len - 1);
                Sample keep = *l;

                keep.t = s.t;
                keep.cpu_s = s.cpu_s;
                keep.anon_mib = s.anon_mib;
                keep.footprint_mib = s.footprint_mib;
                s = keep;
            }
            g_array_append_val(ph->samples, s);
            ph->end = "control socket silent";
            break;
        }
        g_array_append_val(ph->samples, s);
        if (first || still_busy) {
            settle_init(&z, &s);
            first = FALSE;
        } else if (settled(&z, &s)) {
            ph->complete = TRUE;
            ph->end = "settled";
            break;
        }
        if (s.attached == 0) {
            ph->end = "no VM attached";
            break;
        }
        if (!proc_alive(c->daemon_pid)) {
            ph->end = "pagefoldd exited";
            break;
        }
        if (bench_now() - t0 > c->phase_s) {
            break;
        }
        pace(bench_now() - before);
    }
    ph->t90_s = t90(ph, base_mib, target_mib, 0);
}
static void
add_double(JsonBuilder *b, const char *name, double v)
{
    json_builder_set_member_name(b, name);
    if (isfinite(v)) {
        json_builder_add_double_value(b, round(v * 1000) / 1000);
    } else {
        json_builder_add_null_value(b);
    }
}

static void
add_int(JsonBuilder *b, const char *name, gint64 v)
{
    json_builder_set_member_name(b, name);
    json_builder_add_int_value(b, v);
}

static void
add_bool(JsonBuilder *b, const char *name, gboolean v)
{
    json_builder_set_member_name(b, name);
    json_builder_add_boolean_value(b, v);
}

static void
add_str(JsonBuilder *b, const char *name, const char *v)
{
    json_builder_set_member_name(b, name);
    if (v != NULL) {
        json_builder_add_string_value(b, v);
    } else {
        json_builder_add_null_value(b);
    }
}

/* The figures of one phase: passes, CPU, metadata, memory, stalls. */
static void
phase_to_json(Case *c, Phase *ph, double base_mib, JsonBuilder *b, Row *row)
{
    GArray *v = ph->samples;
    Sample *f = &g_array_index(v, Sample, 0), *l = &g_array_index(v, Sample, v->len - 1);
    double t_first_inc = -1, t_last_inc = -1, peak_anon = 0, peak_fp = 0;
    gint64 scans_first_inc = 0, scans_last_inc = 0, max_pass_usec = 0, vmas_max = 0;
    double gib_scanned = (double)(l->pages_scanned - f->pages_scanned) * 4096.0 / GIB_F;
    double cpu = l->cpu_s - f->cpu_s;
    Stall stall = probe_take(c->probe);
    JsonArray *vms = c->last_stats ? json_object_get_array_member(c->last_stats, "vms") : NULL;
    double mean_pass;

    for (guint i = 1; i < v->len; i++) {
        Sample *x = &g_array_index(v, Sample, i), *p = &g_array_index(v, Sample, i - 1);

        if (x->full_scans > p->full_scans) {
            if (t_first_inc < 0) {
                t_first_inc = x->t;
                scans_first_inc = x->full_scans;
            }
            t_last_inc = x->t;
            scans_last_inc = x->full_scans;
        }
    }
    for (guint i = 0; i < v->len; i++) {
        Sample *x = &g_array_index(v, Sample, i);

        max_pass_usec = MAX(max_pass_usec, x->last_pass_usec);
        peak_anon = MAX(peak_anon, x->anon_mib);
        peak_fp = MAX(peak_fp, x->footprint_mib);
        vmas_max = MAX(vmas_max, x->vmas_max);
    }
    mean_pass = scans_last_inc > scans_first_inc
                    ? (t_last_inc - t_first_inc) / (double)(scans_last_inc - scans_first_inc)
                    : NAN;
    add_bool(b, "complete", ph->complete);
    add_str(b, "ended", ph->end);
    add_double(b, "elapsed_s", l->t);
    add_int(b, "passes", l->full_scans - f->full_scans);
    add_double(b, "first_pass_s", t_first_inc);
    add_double(b, "mean_pass_s", mean_pass);
    add_double(b, "last_pass_ms", (double)l->last_pass_usec / 1000.0);
    add_double(b, "max_pass_ms", (double)max_pass_usec / 1000.0);
    add_double(b, "cpu_s", cpu);
    add_double(b, "gib_scanned", gib_scanned);
    add_double(b, "cpu_s_per_gib", gib_scanned > 0 ? cpu / gib_scanned : NAN);
    add_int(b, "pages_tracked", l->tracked);
    add_int(b, "metadata_bytes", l->metadata);
    add_double(b, "metadata_per_page", l->tracked > 0 ? (double)l->metadata / l->tracked : NAN);
    json_builder_set_member_name(b, "metadata_per_page_vm");
    json_builder_begin_array(b);
    for (int i = 0; i < c->n_vms; i++) {
        JsonObject *vm = vm_by_pid(vms, c->vmm[i]->pid);
        gint64 tr = member(vm, "pages_tracked");

        if (vm != NULL && tr > 0) {
            json_builder_add_double_value(b, round((double)member(vm, "metadata_bytes") / tr * 100) / 100);
        } else {
            json_builder_add_null_value(b);
        }
    }
    json_builder_end_array(b);
    add_int(b, "vmas_max", vmas_max);
    add_double(b, "pagefoldd_rss_anon_mib", l->anon_mib);
    add_double(b, "pagefoldd_rss_anon_peak_mib", peak_anon);
    add_double(b, "pagefoldd_vmrss_mib", (double)proc_kib(c->daemon_pid, "status", "VmRSS") / 1024.0);
    add_double(b, "pagefoldd_vmhwm_mib", (double)proc_kib(c->daemon_pid, "status", "VmHWM") / 1024.0);
    add_double(b, "footprint_before_mib", base_mib);
    add_double(b, "footprint_peak_mib", peak_fp);
    add_double(b, "footprint_after_mib", l->footprint_mib);
    add_double(b, "freed_mib", base_mib - l->footprint_mib);
    add_double(b, "freed_net_mib", base_mib - l->footprint_mib - (l->anon_mib - f->anon_mib));
    add_double(b, "t90_s", ph->t90_s);
    add_int(b, "pages_shared", l->shared);
    add_int(b, "pages_sharing", l->sharing);
    add_int(b, "zero_pages", l->zero);
    add_int(b, "pages_unshared", l->unshared);
    add_int(b, "pages_pending", l->pending);
    add_int(b, "cow", l->cow - f->cow);
    add_double(b, "stall_max_ms", stall.max_ms);
    add_double(b, "stall_p99_ms", stall.p99_ms);
    add_int(b, "stall_samples", stall.n);
    add_int(b, "stall_over_100ms", stall.over);
    add_bool(b, "stall_unanswered", stall.unanswered);
    add_str(b, "stall_probe_error", stall.error);
    add_bool(b, "control_ok", stall.over == 0 && stall.error == NULL && !c->control_lost);

    row->complete = ph->complete;
    row->passes = l->full_scans - f->full_scans;
    /* The longest pass, not the last: once merged, a pass steps over
     * holes and says little about scanning RAM. */
    row->pass_ms = (double)max_pass_usec / 1000.0;
    row->cpu_per_gib = gib_scanned > 0 ? cpu / gib_scanned : NAN;
    row->meta_per_page = l->tracked > 0 ? (double)l->metadata / l->tracked : NAN;
    row->pfd_anon_mib = l->anon_mib;
    row->stall_max_ms = stall.max_ms;
    row->stall_p99_ms = stall.p99_ms;
    row->freed_mib = base_mib - l->footprint_mib;
    row->t90_s = ph->t90_s;
    row->control_ok = stall.over == 0 && stall.error == NULL && !c->control_lost;
    g_free(stall.error);
}

/* Sends cmd to every stand-in, then collects their answers. */
static void
vmm_all(Case *c, const char *cmd, double timeout_s, char **answers)
{
    gint64 deadline = g_get_monotonic_time() + (gint64)(timeout_s * G_USEC_PER_SEC);

    for (int i = 0; i < c->n_vms; i++) {
        g_autoptr(GError) error = NULL;

        answers[i] = NULL;
        if (!pf_test_vmm_send(c->vmm[i], cmd, &error)) {
            answers[i] = g_strdup_printf("error %s", error->message);
        }
    }
    for (int i = 0; i < c->n_vms; i++) {
        g_autoptr(GError) error = NULL;

        if (answers[i] == NULL) {
            double left = (double)(deadline - g_get_monotonic_time()) / G_USEC_PER_SEC;

            answers[i] = pf_test_vmm_read_line(c->vmm[i], MAX(left, 0), &error);
            if (answers[i] == NULL) {
                answers[i] = g_strdup_printf("error %s", error->message);
            }
        }
    }
}

/* The number after key in a stand-in's "stats ..." answer, or -1. */
static gint64
word_after(const char *line, const char *key)
{
    g_auto(GStrv) w = g_strsplit(line, " ", -1);

    for (guint i = 0; w[i] != NULL && w[i + 1] != NULL; i++) {
        if (g_str_equal(w[i], key)) {
            return g_ascii_strtoll(w[i + 1], NULL, 10);
        }
    }
    return -1;
}

/* The agents' counters, summed, and how many say they are connected. */
static void
agents_to_json(Case *c, JsonBuilder *b, const char *name, double timeout_s)
{
    g_autofree char **a = g_new0(char *, c->n_vms);
    gint64 merged = 0, unmerged = 0, zeroed = 0, errors = 0, connected = 0;

    vmm_all(c, "stats", timeout_s, a);
    for (int i = 0; i < c->n_vms; i++) {
        merged += MAX(word_after(a[i], "merged"), 0);
        unmerged += MAX(word_after(a[i], "unmerged"), 0);
        zeroed += MAX(word_after(a[i], "zeroed"), 0);
        errors += MAX(word_after(a[i], "errors"), 0);
        connected += word_after(a[i], "connected") == 1;
        g_free(a[i]);
    }
    json_builder_set_member_name(b, name);
    json_builder_begin_object(b);
    add_int(b, "merged", merged);
    add_int(b, "zeroed", zeroed);
    add_int(b, "unmerged", unmerged);
    add_int(b, "errors", errors);
    add_int(b, "connected", connected);
    json_builder_end_object(b);
}

/* At the end of a case: still attached (list), and every byte right. */
static void
final_checks(Case *c, JsonBuilder *b, Row *row)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonNode) list = ctl_call(c->ctl, "list", NULL, CTL_TIMEOUT_S, &error);
    g_autofree char **answers = g_new0(char *, c->n_vms);
    gboolean all_attached = TRUE, all_ok = TRUE;

    json_builder_set_member_name(b, "attached");
    json_builder_begin_array(b);
    for (int i = 0; i < c->n_vms; i++) {
        JsonObject *vm = list ? vm_by_pid(json_node_get_array(list), c->vmm[i]->pid) : NULL;
        gboolean ok = vm != NULL && g_str_equal(json_object_get_string_member(vm, "mode"), "merge");

        json_builder_begin_object(b);
        add_bool(b, "in_list", vm != NULL);
        add_str(b, "mode", vm ? json_object_get_string_member(vm, "mode") : NULL);
        add_double(b, "detached_at_s", c->detached_at[i] >= 0 ? c->detached_at[i] : NAN);
        json_builder_end_object(b);
        all_attached &= ok && c->detached_at[i] < 0;
    }
    json_builder_end_array(b);
    add_bool(b, "all_attached", all_attached);
    add_str(b, "list_error", list == NULL ? error->message : NULL);
    /* Reading a few GiB of RAM back and regenerating it: ~1 s per GiB. */
    vmm_all(c, "verify", 60 + 30.0 * c->vm_mib / 1024, answers);
    json_builder_set_member_name(b, "verify");
    json_builder_begin_array(b);
    for (int i = 0; i < c->n_vms; i++) {
        json_builder_add_string_value(b, answers[i]);
        all_ok &= g_str_has_prefix(answers[i], "verify ok");
        g_free(answers[i]);
    }
    json_builder_end_array(b);
    add_bool(b, "verify_ok", all_ok);
    row->attached = all_attached;
    row->verify_ok = all_ok;
}

typedef struct {
    gboolean *done;
    char **answers;
    double t0;
    double done_s; /* when the last answer was seen, since t0; -1 before */
} Rewrite;

/* While the stand-ins rewrite their RAM: TRUE until all have answered. */
static gboolean
rewrite_busy(Case *c, gpointer user)
{
    Rewrite *r = user;
    gboolean busy = FALSE;

    for (int i = 0; i < c->n_vms; i++) {
        g_autoptr(GError) error = NULL;

        if (!r->done[i]) {
            r->answers[i] = pf_test_vmm_read_line(c->vmm[i], 0, &error);
            if (r->answers[i] == NULL &&
                !g_error_matches(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT)) {
                r->answers[i] = g_strdup_printf("error %s", error->message);
            }
            r->done[i] = r->answers[i] != NULL;
            busy |= !r->done[i];
        }
    }
    if (!busy && r->done_s < 0) {
        r->done_s = bench_now() - r->t0;
    }
    return busy;
}

static double
mem_available_mib(void)
{
    g_autofree char *text = NULL;
    const char *p;

    if (!g_file_get_contents("/proc/meminfo", &text, NULL, NULL) ||
        (p = strstr(text, "MemAvailable:")) == NULL) {
        return 0;
    }
    return (double)g_ascii_strtoll(p + strlen("MemAvailable:"), NULL, 10) / 1024.0;
}

/* json-glib writes doubles with 17 digits: 5.1799999999999997. */
static gboolean
shorten_number(const GMatchInfo *m, GString *out, gpointer user)
{
    g_autofree char *num = g_match_info_fetch(m, 0);
    char buf[G_ASCII_DTOSTR_BUF_SIZE];

    g_string_append(out, g_ascii_formatd(buf, sizeof(buf), "%.6g", g_ascii_strtod(num, NULL)));
    return FALSE;
}

static void
print_builder(JsonBuilder *b)
{
    g_autoptr(JsonNode) root = json_builder_get_root(b);
    g_autofree char *text = json_to_string(root, FALSE);
    g_autoptr(GRegex) re = g_regex_new("(?<![\\w.])-?[0-9]+\\.[0-9]{7,}(e[-+]?[0-9]+)?", 0, 0, NULL);
    g_autofree char *shorter = g_regex_replace_eval(re, text, -1, 0, 0, shorten_number, NULL, NULL);

    printf("%s\n", shorter != NULL ? shorter : text);
    fflush(stdout);
}

static void
begin_line(JsonBuilder *b, const char *workload, int gib, int vms, int vm_mib)
{
    json_builder_begin_object(b);
    add_str(b, "bench", "scale");
    add_str(b, "vmm", "standin-vmm (stand-in for QEMU)");
    add_str(b, "workload", workload);
    add_int(b, "total_gib", gib);
    add_int(b, "vms", vms);
    add_int(b, "vm_mib", vm_mib);
}

/* The saving the layout allows, in MiB: every zero page, and all but one
 * copy of each identical page. */
static double
expected_mib(const char *layout, int n, int vm_mib)
{
    return g_str_equal(layout, "zero") ? (double)n * vm_mib
                                       : n * 0.2 * vm_mib + (n - 1) * 0.5 * vm_mib;
}

static Row *
row_new(GPtrArray *rows, const char *workload, int gib, int vms)
{
    Row *r = g_new0(Row, 1);

    r->workload = g_strdup(workload);
    r->gib = gib;
    r->vms = vms;
    r->t90_s = -1;
    g_ptr_array_add(rows, r);
    return r;
}

static void
row_free(gpointer p)
{
    Row *r = p;

    g_free(r->workload);
    g_free(r->why);
    g_free(r);
}

/* The line of a case that did not run: "skipped" (it would not fit) or
 * "failed" (it could not be set up), and why. */
static void
status_line(GPtrArray *rows, const char *workload, int gib, int vms, int vm_mib,
            const char *status, const char *why)
{
    g_autoptr(JsonBuilder) b = json_builder_new();
    Row *r = row_new(rows, workload, gib, vms);

    r->skipped = g_str_equal(status, "skipped");
    r->failed = !r->skipped;
    r->why = g_strdup(why);
    begin_line(b, workload, gib, vms, vm_mib);
    add_bool(b, status, TRUE);
    add_str(b, "why", why);
    json_builder_end_object(b);
    print_builder(b);
}

static gboolean
has_word(const char *list, const char *word)
{
    g_auto(GStrv) w = g_strsplit(list, ",", -1);

    return g_strv_contains((const char *const *)w, word);
}

/* Sets the knobs over the control socket; returns them as pagefoldd has
 * them. */
static JsonObject *
set_knobs(Ctl *ctl, const char *spec, GError **error)
{
    g_auto(GStrv) kvs = g_strsplit(spec, ",", -1);
    g_autoptr(JsonNode) k = NULL;

    for (guint i = 0; kvs[i] != NULL; i++) {
        g_auto(GStrv) kv = g_strsplit(g_strstrip(kvs[i]), "=", 2);
        g_autofree char *args = NULL;
        g_autoptr(JsonNode) r = NULL;

        if (kv[0] == NULL || *kv[0] == '\0') {
            continue;
        }
        if (kv[1] == NULL || g_str_equal(kv[0], "run")) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_INVALID_ARGUMENT,
                        "knob '%s': want NAME=VALUE, and not run", kvs[i]);
            return NULL;
        }
        args = g_strdup_printf("{\"knob\":\"%s\",\"value\":%s}", kv[0], kv[1]);
        if ((r = ctl_call(ctl, "set", args, CTL_TIMEOUT_S, error)) == NULL) {
            return NULL;
        }
    }
    k = ctl_call(ctl, "knobs", NULL, CTL_TIMEOUT_S, error);
    return k ? json_object_ref(json_node_get_object(k)) : NULL;
}

/* Runs one case: the zero layout, or the mixed one followed by a reboot
 * when asked.  Returns FALSE if it failed. */
static void
run_case(GPtrArray *rows, const char *layout, gboolean want_mixed, gboolean want_reboot,
         int gib, int n, const char *knob_spec, double reserve_mib)
{
    int vm_mib = gib * 1024 / n;
    gboolean zero = g_str_equal(layout, "zero");
    /* Guest RAM is all allocated before anything merges; then the pool
     * (one copy of each identical page) grows before the memfds shrink,
     * and a reboot copies every merged page back: about RAM plus the
     * pool, plus pagefoldd's metadata and page tables (a few %). */
    double pool_mib = zero || n == 1 ? 0 : 0.5 * vm_mib;
    double need_mib = gib * 1024.0 * 1.06 + pool_mib + reserve_mib;
    double avail = mem_available_mib();
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(Ctl) ctl = NULL;
    g_autoptr(GError) error = NULL;
    g_autofree double *detached_at = g_new(double, n);
    g_autofree PfTestVmm **vmm = g_new0(PfTestVmm *, n);
    g_autofree char *vmm_mib = g_strdup_printf("%d", vm_mib);
    Case c = { 0 };
    double t_spawn, spawn_s, base_mib;
    Phase merge = { 0 }, reboot = { 0 };
    const char *first_name = zero ? "zero" : want_mixed ? "mixed" : "reboot";
    gboolean setup_ok = TRUE;
    g_autofree char *setup_why = NULL;

    if (need_mib > avail) {
        g_autofree char *why = g_strdup_printf(
            "needs about %.0f MiB (RAM, pool, metadata, %.0f MiB reserve), MemAvailable is %.0f MiB",
            need_mib, reserve_mib, avail);

        if (zero || want_mixed) {
            status_line(rows, first_name, gib, n, vm_mib, "skipped", why);
        }
        if (want_reboot) {
            status_line(rows, "reboot", gib, n, vm_mib, "skipped", why);
        }
        return;
    }
    g_printerr("bench-scale: %s%s %d GiB over %d VM(s) of %d MiB (MemAvailable %.0f MiB)\n",
               layout, want_reboot ? "+reboot" : "", gib, n, vm_mib, avail);
    for (int i = 0; i < n; i++) {
        detached_at[i] = -1;
    }
    c.layout = layout;
    c.gib = gib;
    c.n_vms = n;
    c.vm_mib = vm_mib;
    c.vmm = vmm;
    c.detached_at = detached_at;
    c.phase_s = g_getenv("BENCH_SCALE_PHASE_S") ? g_ascii_strtod(g_getenv("BENCH_SCALE_PHASE_S"), NULL)
                                                : 120 + 60.0 * gib;
    d = pf_test_daemon_start("--set", "run=0", NULL);
    c.d = d;
    c.daemon_pid = pf_test_daemon_pid(d);
    ctl = ctl_new(d->sock);
    c.ctl = ctl;
    c.knobs = set_knobs(ctl, knob_spec, &error);
    if (c.knobs == NULL) {
        g_error("bench-scale: cannot set knobs '%s': %s", knob_spec, error->message);
    }

    /* All stand-ins fill their RAM at once, as VMs booting together. */
    t_spawn = bench_now();
    for (int i = 0; i < n; i++) {
        g_autofree char *guest = g_strdup_printf("guest=scale-%s-%d", layout, i);
        g_autofree char *seed = g_strdup_printf("%d", i + 1);
        const char *argv[] = {
            pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket", d->agent_sock,
            "--mib", vmm_mib, "--identical", zero ? "0" : "50", "--zero", zero ? "100" : "20",
            "--seed", seed, "--writers", "0", NULL
        };

        vmm[i] = pf_test_vmm_launch(argv, &error);
        if (vmm[i] == NULL) {
            g_error("bench-scale: cannot start standin-vmm: %s", error->message);
        }
    }
    for (int i = 0; i < n && setup_ok; i++) {
        double left = 60 + 30.0 * gib - (bench_now() - t_spawn);

        if (!pf_test_vmm_wait_ready(vmm[i], MAX(left, 0), &error)) {
            setup_ok = FALSE;
            setup_why = g_strdup_printf("stand-in %d: %s", i, error->message);
        } else if (!g_str_equal(vmm[i]->mode, "merge")) {
            setup_ok = FALSE;
            setup_why = g_strdup_printf("stand-in %d settled in mode %s, not merge", i,
                                        vmm[i]->mode);
        }
    }
    for (int i = 0; i < n && setup_ok; i++) {
        pf_test_daemon_wait_vmm(d, vmm[i]);
    }
    spawn_s = bench_now() - t_spawn;
    if (!setup_ok) {
        status_line(rows, first_name, gib, n, vm_mib, "failed", setup_why);
        goto out;
    }

    c.probe = probe_start(d->sock);
    c.t_case = bench_now();
    base_mib = footprint_mib(&c);
    {
        g_autoptr(JsonNode) r = ctl_call(ctl, "set", "{\"knob\":\"run\",\"value\":1}",
                                         CTL_TIMEOUT_S, &error);

        if (r == NULL) {
            c.control_lost = TRUE;
            c.control_error = g_strdup_printf("set run 1: %s", error->message);
        }
    }
    (void)probe_take(c.probe); /* the stalls of merging only */
    run_phase(&c, &merge, c.t_case, base_mib, 0, NULL, NULL);

    if (zero || want_mixed) {
        g_autoptr(JsonBuilder) b = json_builder_new();
        Row *r = row_new(rows, first_name, gib, n);

        begin_line(b, first_name, gib, n, vm_mib);
        json_builder_set_member_name(b, "knobs");
        json_builder_add_value(b, json_node_init_object(json_node_alloc(), c.knobs));
        add_double(b, "spawn_s", spawn_s);
        phase_to_json(&c, &merge, base_mib, b, r);
        r->expected_mib = expected_mib(layout, n, vm_mib);
        add_double(b, "expected_freed_mib", r->expected_mib);
        agents_to_json(&c, b, "agents", 30);
        if (!want_reboot) {
            final_checks(&c, b, r);
        } else {
            /* The same processes go on to reboot: their checks come at
             * the end of it, and say for both. */
            r->attached = TRUE;
            r->verify_ok = TRUE;
            for (int i = 0; i < n; i++) {
                r->attached &= c.detached_at[i] < 0;
            }
            add_bool(b, "all_attached", r->attached);
            add_str(b, "verify", "at the end of the reboot case");
        }
        add_str(b, "control_error", c.control_error);
        r->failed = !r->attached || !r->verify_ok || c.control_lost;
        json_builder_end_object(b);
        print_builder(b);
    }

    if (want_reboot) {
        g_autoptr(JsonBuilder) b = json_builder_new();
        Row *r = row_new(rows, "reboot", gib, n);
        g_autofree gboolean *done = g_new0(gboolean, n);
        g_autofree char **answers = g_new0(char *, n);
        Rewrite rw = { done, answers, 0, -1 };
        Sample *pre = &g_array_index(merge.samples, Sample, merge.samples->len - 1);
        double pre_mib = pre->footprint_mib, t_reboot;
        gboolean rewrite_ok = TRUE;

        begin_line(b, "reboot", gib, n, vm_mib);
        json_builder_set_member_name(b, "knobs");
        json_builder_add_value(b, json_node_init_object(json_node_alloc(), c.knobs));
        add_bool(b, "premerge_complete", merge.complete);
        add_double(b, "premerge_s", pre->t);
        add_double(b, "premerge_freed_mib", base_mib - pre_mib);
        agents_to_json(&c, b, "agents_before", 30);
        (void)probe_take(c.probe);
        t_reboot = bench_now();
        rw.t0 = t_reboot;
        for (int i = 0; i < n; i++) {
            if (!pf_test_vmm_send(vmm[i], "rewrite same", &error)) {
                answers[i] = g_strdup_printf("error %s", error->message);
                done[i] = TRUE;
                g_clear_error(&error);
            }
        }
        /* Saving counted from the footprint before merging, and t90
         * against what the merge phase had freed: back to 90% of it. */
        run_phase(&c, &reboot, t_reboot, base_mib, base_mib - pre_mib, rewrite_busy, &rw);
        for (int i = 0; i < n; i++) {
            if (!done[i]) {
                answers[i] = g_strdup("error no answer to rewrite before the deadline");
            }
            rewrite_ok &= g_str_has_prefix(answers[i], "ok");
        }
        /* Catching up is judged once the rewrite is over: before, the
         * saving is what the merge left, not yet undone. */
        reboot.t90_s = rw.done_s >= 0 ? t90(&reboot, base_mib, base_mib - pre_mib, rw.done_s) : -1;
        add_double(b, "footprint_pre_reboot_mib", pre_mib);
        add_double(b, "rewrite_s", rw.done_s);
        add_double(b, "t90_after_rewrite_s", reboot.t90_s >= 0 ? reboot.t90_s - rw.done_s : NAN);
        add_bool(b, "rewrite_ok", rewrite_ok);
        json_builder_set_member_name(b, "rewrite");
        json_builder_begin_array(b);
        for (int i = 0; i < n; i++) {
            json_builder_add_string_value(b, answers[i]);
        }
        json_builder_end_array(b);
        phase_to_json(&c, &reboot, base_mib, b, r);
        r->expected_mib = base_mib - pre_mib;
        add_double(b, "resaved_pct", base_mib - pre_mib > 0
                                         ? 100.0 * r->freed_mib / (base_mib - pre_mib) : NAN);
        agents_to_json(&c, b, "agents", 30);
        final_checks(&c, b, r);
        add_str(b, "control_error", c.control_error);
        r->failed = !r->attached || !r->verify_ok || !rewrite_ok || c.control_lost;
        /* The mixed line's checks were these. */
        if (want_mixed && rows->len >= 2) {
            Row *m = g_ptr_array_index(rows, rows->len - 2);

            m->verify_ok = r->verify_ok;
            m->failed |= !r->verify_ok;
        }
        for (int i = 0; i < n; i++) {
            g_free(answers[i]);
        }
        json_builder_end_object(b);
        print_builder(b);
    }
out:
    if (c.probe != NULL) {
        probe_free(c.probe);
    }
    for (int i = 0; i < n; i++) {
        if (vmm[i] != NULL) {
            pf_test_vmm_free(vmm[i]);
        }
    }
    if (merge.samples != NULL) {
        g_array_unref(merge.samples);
    }
    if (reboot.samples != NULL) {
        g_array_unref(reboot.samples);
    }
    if (c.knobs != NULL) {
        json_object_unref(c.knobs);
    }
    if (c.last_stats != NULL) {
        json_object_unref(c.last_stats);
    }
    g_free(c.control_error);
}

/* ---- summary: table, growth, plot ---- */

static const char *
fmt(char *buf, gsize len, double v, int decimals)
{
    if (!isfinite(v) || v < 0) {
        return "-";
    }
    g_snprintf(buf, len, "%.*f", decimals, v);
    return buf;
}

static void
print_table(GPtrArray *rows)
{
    printf("\n| workload | GiB | VMs | status | passes | longest pass ms | CPU s/GiB | metadata B/page "
           "| pagefoldd anon MiB | freed MiB (%% of expected) | t90 s | stall max / p99 ms "
           "| control_ok | attached | verify |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (guint i = 0; i < rows->len; i++) {
        Row *r = g_ptr_array_index(rows, i);
        char a[32], b[32], c[32], d[32], e[32], f[32], g[32], h[32];

        if (r->skipped || (r->failed && r->passes == 0 && r->why != NULL)) {
            printf("| %s | %d | %d | %s: %s | | | | | | | | | | | |\n", r->workload, r->gib,
                   r->vms, r->skipped ? "skipped" : "FAILED", r->why);
            continue;
        }
        printf("| %s | %d | %d | %s | %" G_GINT64_FORMAT " | %s | %s | %s | %s | %.0f (%s%%) | %s "
               "| %s / %s | %s | %s | %s |\n",
               r->workload, r->gib, r->vms,
               r->failed ? "FAILED" : r->complete ? "ok" : "incomplete", r->passes,
               fmt(a, sizeof(a), r->pass_ms, 0), fmt(b, sizeof(b), r->cpu_per_gib, 2),
               fmt(c, sizeof(c), r->meta_per_page, 1),
               fmt(d, sizeof(d), r->pfd_anon_mib, 1), r->freed_mib,
               fmt(e, sizeof(e), r->expected_mib > 0 ? 100 * r->freed_mib / r->expected_mib : NAN,
                   0),
               fmt(f, sizeof(f), r->t90_s, 1), fmt(g, sizeof(g), r->stall_max_ms, 0),
               fmt(h, sizeof(h), r->stall_p99_ms, 0), r->control_ok ? "yes" : "**no**",
               r->attached ? "yes" : "**no**", r->verify_ok ? "ok" : "**FAIL**");
    }
}

/* How q grew against RAM (ram_x times more): per_unit quantities are per
 * GiB or per page, so their total is q times RAM. */
static const char *
growth_kind(double q_x, double ram_x, gboolean per_unit)
{
    double total_x = per_unit ? q_x * ram_x : q_x;

    if (!isfinite(total_x) || total_x <= 0) {
        return "unknown";
    }
    if (!per_unit && total_x <= 1.5) {
        return "flat";
    }
    if (total_x > 1.5 * ram_x) {
        return "superlinear";
    }
    if (total_x < ram_x / 1.5) {
        return "sublinear";
    }
    return "linear";
}

static double
row_value(Row *r, int k)
{
    switch (k) {
    case 0: return r->pass_ms;
    case 1: return r->cpu_per_gib;
    case 2: return r->meta_per_page;
    case 3: return r->pfd_anon_mib;
    case 4: return r->stall_max_ms;
    default: return r->stall_p99_ms;
    }
}

static const struct {
    const char *name, *label;
    gboolean per_unit;
} quantities[] = {
    { "max_pass_ms", "longest full pass (ms)", FALSE },
    { "cpu_s_per_gib", "pagefoldd CPU s per GiB scanned", TRUE },
    { "metadata_per_page", "metadata bytes per tracked page", TRUE },
    { "pagefoldd_rss_anon_mib", "pagefoldd RssAnon (MiB)", FALSE },
    { "stall_max_ms", "longest control round trip (ms)", FALSE },
    { "stall_p99_ms", "p99 control round trip (ms)", FALSE },
};

/* Rows of one series (workload, VM count) that ran, by RAM. */
static GPtrArray *
series(GPtrArray *rows, const char *workload, int vms)
{
    GPtrArray *s = g_ptr_array_new();

    for (guint i = 0; i < rows->len; i++) {
        Row *r = g_ptr_array_index(rows, i);

        if (!r->skipped && r->passes > 0 && r->vms == vms && g_str_equal(r->workload, workload)) {
            g_ptr_array_add(s, r);
        }
    }
    return s;
}

static void
print_growth(GPtrArray *rows, const char *const *workloads, const int *vm_counts, guint n_vc)
{
    printf("\n");
    for (guint w = 0; workloads[w] != NULL; w++) {
        for (guint v = 0; v < n_vc; v++) {
            g_autoptr(GPtrArray) s = series(rows, workloads[w], vm_counts[v]);
            g_autoptr(JsonBuilder) b = json_builder_new();
            g_autoptr(GString) text = g_string_new(NULL);
            Row *lo, *hi;
            double ram_x;

            if (s->len < 2) {
                continue;
            }
            lo = g_ptr_array_index(s, 0);
            hi = g_ptr_array_index(s, s->len - 1);
            ram_x = (double)hi->gib / lo->gib;
            json_builder_begin_object(b);
            add_str(b, "bench", "scale");
            add_str(b, "growth", workloads[w]);
            add_int(b, "vms", vm_counts[v]);
            add_int(b, "from_gib", lo->gib);
            add_int(b, "to_gib", hi->gib);
            g_string_printf(text, "growth %s, %d VM(s), %d -> %d GiB (x%.0f):", workloads[w],
                            vm_counts[v], lo->gib, hi->gib, ram_x);
            for (gsize k = 0; k < G_N_ELEMENTS(quantities); k++) {
                double x = row_value(hi, (int)k) / row_value(lo, (int)k);
                const char *kind = growth_kind(x, ram_x, quantities[k].per_unit);

                json_builder_set_member_name(b, quantities[k].name);
                json_builder_begin_object(b);
                add_double(b, "ratio", x);
                add_str(b, "kind", kind);
                json_builder_end_object(b);
                g_string_append_printf(text, " %s x%.2f (%s%s);", quantities[k].name, x, kind,
                                       quantities[k].per_unit ? " in total" : "");
            }
            json_builder_end_object(b);
            print_builder(b);
            printf("%s\n", text->str);
        }
    }
}

/* scale.dat (one block per workload and VM count), scale.gp, and
 * scale.png when gnuplot is there. */
static void
write_plot(GPtrArray *rows, const char *const *workloads, const int *vm_counts, guint n_vc,
           const char *knob_spec)
{
    const char *out = g_getenv("BENCH_SCALE_OUT");
    g_autofree char *dir = g_strdup(out ? out : g_getenv("PAGEFOLD_BUILD_DIR") ? g_getenv("PAGEFOLD_BUILD_DIR") : ".");
    g_autofree char *dat = g_build_filename(dir, "scale.dat", NULL);
    g_autofree char *gp = g_build_filename(dir, "scale.gp", NULL);
    g_autofree char *png = g_build_filename(dir, "scale.png", NULL);
    g_autofree char *gnuplot = g_find_program_in_path("gnuplot");
    g_autoptr(GString) data = g_string_new("# bench-scale: pagefoldd against standin-vmm "
                                           "(stand-in for QEMU); knobs ");
    g_autoptr(GString) script = g_string_new(NULL);
    g_autoptr(GPtrArray) titles = g_ptr_array_new_with_free_func(g_free);
    g_autoptr(GArray) colours = g_array_new(FALSE, FALSE, sizeof(int));
    g_autoptr(GArray) dashes = g_array_new(FALSE, FALSE, sizeof(int));
    g_autoptr(GError) error = NULL;

    g_string_append_printf(data, "%s\n# columns: total_gib max_pass_ms cpu_s_per_gib "
                           "metadata_per_page pagefoldd_rss_anon_mib stall_max_ms stall_p99_ms\n",
                           knob_spec);
    for (guint w = 0; workloads[w] != NULL; w++) {
        for (guint v = 0; v < n_vc; v++) {
            g_autoptr(GPtrArray) s = series(rows, workloads[w], vm_counts[v]);
            int colour = (int)v + 1, dash = (int)w + 1;

            if (s->len == 0) {
                continue;
            }
            g_string_append_printf(data, "# %s, %d VM(s)\n", workloads[w], vm_counts[v]);
            for (guint i = 0; i < s->len; i++) {
                Row *r = g_ptr_array_index(s, i);

                g_string_append_printf(data, "%d", r->gib);
                for (int k = 0; k < 6; k++) {
                    double x = row_value(r, k);

                    if (isfinite(x)) {
                        g_string_append_printf(data, " %.4g", x);
                    } else {
                        g_string_append(data, " NaN");
                    }
                }
                g_string_append_c(data, '\n');
            }
            g_string_append(data, "\n\n");
            g_ptr_array_add(titles, g_strdup_printf("%s, %d VM%s", workloads[w], vm_counts[v],
                                                    vm_counts[v] > 1 ? "s" : ""));
            g_array_append_val(colours, colour);
            g_array_append_val(dashes, dash);
        }
    }
    g_string_append_printf(script,
        "# bench-scale's plot: gnuplot %s\n"
        "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
        "    set terminal pngcairo size 1500,950 font ',9'\n"
        "} else {\n"
        "    set terminal png size 1500,950\n"
        "}\n"
        "set termoption noenhanced\n" /* knob names have underscores */
        "set output '%s'\n"
        "set multiplot layout 2,3 title 'pagefoldd at scale: stand-in VMMs (standin-vmm in place "
        "of QEMU), knobs %s'\n"
        "set logscale x 2\nset xlabel 'total guest RAM (GiB)'\nset key top left\nset grid\n",
        "scale.gp", "scale.png", knob_spec);
    for (int k = 0; k < 6; k++) {
        g_string_append_printf(script, "set title '%s'\nset ylabel '%s'\nplot ",
                               quantities[k].label, quantities[k].label);
        for (guint i = 0; i < titles->len; i++) {
            g_string_append_printf(script,
                                   "%s'scale.dat' index %u using 1:%d with linespoints lc %d dt %d "
                                   "pt %d title '%s'", i ? ", \\\n     " : "", i, k + 2,
                                   g_array_index(colours, int, i), g_array_index(dashes, int, i),
                                   g_array_index(dashes, int, i) + 4,
                                   (char *)g_ptr_array_index(titles, i));
        }
        if (titles->len == 0) {
            g_string_append(script, "NaN notitle");
        }
        g_string_append(script, "\n");
    }
    g_string_append(script, "unset multiplot\n");
    if (!g_file_set_contents(dat, data->str, -1, &error) ||
        !g_file_set_contents(gp, script->str, -1, &error)) {
        g_printerr("bench-scale: cannot write the plot files: %s\n", error->message);
        return;
    }
    printf("\nplot data: %s\nplot script: %s\n", dat, gp);
    if (gnuplot == NULL) {
        printf("gnuplot is not installed: no %s (apt-get install gnuplot-nox, then "
               "cd %s && gnuplot scale.gp)\n", png, dir);
    } else if (titles->len > 0) {
        /* gnuplot reads the files by their names: run it where they are. */
        const char *argv[] = { gnuplot, "scale.gp", NULL };
        g_autoptr(GSubprocessLauncher) l = g_subprocess_launcher_new(G_SUBPROCESS_FLAGS_NONE);
        g_autoptr(GSubprocess) p = NULL;

        g_subprocess_launcher_set_cwd(l, dir);
        p = g_subprocess_launcher_spawnv(l, argv, &error);
        if (p == NULL || !g_subprocess_wait_check(p, NULL, &error)) {
            printf("gnuplot failed: %s\n", error->message);
        } else {
            printf("plot: %s\n", png);
        }
    }
}

static GArray *
int_list(const char *env, const char *dflt)
{
    const char *s = g_getenv(env);
    g_auto(GStrv) w = g_strsplit(s ? s : dflt, ",", -1);
    GArray *a = g_array_new(FALSE, FALSE, sizeof(int));

    for (guint i = 0; w[i] != NULL; i++) {
        int v = atoi(w[i]);

        if (v > 0) {
            g_array_append_val(a, v);
        }
    }
    return a;
}

int
main(int argc, char **argv)
{
    g_autoptr(GArray) gibs = int_list("BENCH_SCALE_GIB", "1,4,16");
    g_autoptr(GArray) vms = int_list("BENCH_SCALE_VMS", "1,4,16");
    const char *workloads = g_getenv("BENCH_SCALE_WORKLOADS") ? g_getenv("BENCH_SCALE_WORKLOADS")
                                                              : "zero,mixed,reboot";
    const char *knobs = g_getenv("BENCH_SCALE_KNOBS") ? g_getenv("BENCH_SCALE_KNOBS") : KNOBS_DEFAULT;
    int max_gib = g_getenv("BENCH_SCALE_MAX_GIB") ? atoi(g_getenv("BENCH_SCALE_MAX_GIB")) : 16;
    double reserve = g_getenv("BENCH_SCALE_RESERVE_MIB")
                         ? g_ascii_strtod(g_getenv("BENCH_SCALE_RESERVE_MIB"), NULL) : 1024;
    g_autoptr(GPtrArray) rows = g_ptr_array_new_with_free_func(row_free);
    const char *all_workloads[] = { "zero", "mixed", "reboot", NULL };
    const char *present[4] = { NULL };
    guint n_present = 0;
    gboolean failed = FALSE;

    /* A stand-in that dies must not take the benchmark with it. */
    signal(SIGPIPE, SIG_IGN);
    printf("{\"bench\":\"scale\",\"vmm\":\"standin-vmm\",\"note\":\"the VMs are stand-in VMMs "
           "(tests/standin-vmm: QEMU's memfd guest RAM and the real agent library, no guest), "
           "standing in for QEMU\",\"daemon\":\"pagefoldd, mode merge\",\"knobs\":\"%s\","
           "\"max_gib\":%d}\n", knobs, max_gib);
    fflush(stdout);
    for (guint w = 0; all_workloads[w] != NULL; w++) {
        if (has_word(workloads, all_workloads[w])) {
            present[n_present++] = all_workloads[w];
        }
    }
    for (guint g = 0; g < gibs->len; g++) {
        int gib = g_array_index(gibs, int, g);

        if (gib > max_gib) {
            continue;
        }
        for (guint v = 0; v < vms->len; v++) {
            int n = g_array_index(vms, int, v);

            if (gib * 1024 / n < MIN_VM_MIB) {
                continue; /* not a combination: a VM would be under 64 MiB */
            }
            if (has_word(workloads, "zero")) {
                run_case(rows, "zero", FALSE, FALSE, gib, n, knobs, reserve);
            }
            if (has_word(workloads, "mixed") || has_word(workloads, "reboot")) {
                run_case(rows, "mixed", has_word(workloads, "mixed"),
                         has_word(workloads, "reboot"), gib, n, knobs, reserve);
            }
        }
    }
    print_table(rows);
    print_growth(rows, present, (const int *)(void *)vms->data, vms->len);
    write_plot(rows, present, (const int *)(void *)vms->data, vms->len, knobs);
    for (guint i = 0; i < rows->len; i++) {
        Row *r = g_ptr_array_index(rows, i);

        failed |= r->failed;
    }
    printf("\nbench-scale: %s\n", failed ? "FAILED (see the lines above)" : "every case that ran passed its checks");
    return failed ? 1 : 0;
}
