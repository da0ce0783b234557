/*
 * bench-scale-measure.c - the scale benchmark's instruments
 * (bench-scale.h): pagefoldd's control socket with a deadline on every
 * call, the stall probe that times its answers from a thread of its own,
 * and what /proc says of pagefoldd and the stand-ins: CPU, RssAnon, and
 * the stand-ins' footprint, counted as the kernel holds it (their
 * anonymous Pss, the blocks of their memfds and of every pool chunk, each
 * counted once).
 *
 * Owns the measuring.  Must never wait without a deadline (a hung
 * pagefoldd is to be reported, not waited for), nor change what it
 * measures: of its own it asks pagefoldd only "stats" and the probe's
 * "knobs", which change nothing, and it reads the stand-ins through /proc
 * alone (their pipes are bench-scale.c's).
 */
#include "bench-scale.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* The probe sends one request at a time, at most one every period. */
#define PROBE_PERIOD_MS 20

/* ---- the control socket, with deadlines ---- */

struct _Ctl {
    char *path;
    int fd;
    GString *in;
};

static void
ctl_close(Ctl *c)
{
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    g_string_truncate(c->in, 0);
}

void
ctl_free(Ctl *c)
{
    ctl_close(c);
    g_string_free(c->in, TRUE);
    g_free(c->path);
    g_free(c);
}

Ctl *
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
JsonNode *
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

struct _Probe {
    char *sock;
    GThread *thread;
    gint stop;
    GMutex lock;
    GArray *lat_ms;      /* every answer's round trip */
    guint from;          /* first entry of the current phase */
    gint64 inflight;     /* when the unanswered request was sent, or 0 */
    char *error;         /* why it stopped probing, if it did */
};

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

Probe *
probe_start(const char *sock)
{
    Probe *p = g_new0(Probe, 1);

    p->sock = g_strdup(sock);
    p->lat_ms = g_array_new(FALSE, FALSE, sizeof(double));
    g_mutex_init(&p->lock);
    p->thread = g_thread_new("stall-probe", probe_main, p);
    return p;
}

void
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

/* The round trips since the last call; one still waiting counts with the
 * time it has waited so far. */
Stall
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
gboolean
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
gint64
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

/* ---- one look at everything ---- */

gint64
member(JsonObject *o, const char *name)
{
    return o != NULL ? json_object_get_int_member_with_default(o, name, 0) : 0;
}

/* The VM of that pid in an array of VM objects, or NULL. */
JsonObject *
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

double
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
gboolean
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

