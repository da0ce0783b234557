/*
 * testproc.c - the project's programs run from tests: stand-in VMMs and
 * their command pipes, pagefoldd on the test's own sockets, pagefoldctl's
 * answers as JSON, a pagefoldd peer for an agent in the test's process,
 * and what /proc says of a process's mappings.  Every child it starts dies
 * with the test (an orphan would hold meson's output pipe open).
 */
#include "testproc.h"

#include <errno.h>
#include <gio/gunixinputstream.h>
#include <grp.h>
#include <glib/gstdio.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <signal.h>
#include <string.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <unistd.h>

static void
die_with_parent(gpointer user)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
}

/*
 * And sees an empty /run/pagefold: the patched QEMU makes an agent of its
 * own accord where a pagefoldd of the host's listens there, which a test's
 * VM must not meet.  Only root may; elsewhere no pagefoldd of the host can
 * be written to by the test either.
 */
static void
die_with_parent_apart(gpointer user)
{
    die_with_parent(user);
    if (access("/run/pagefold", F_OK) == 0 && unshare(CLONE_NEWNS) == 0 &&
        mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0) {
        (void)mount("pagefold-test", "/run/pagefold", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                    "mode=0755,size=64k");
    }
}

/*
 * And has a tmpfs on the folder user of its own (a mount namespace of its
 * own, made after the fork, where the child is single-threaded): it goes
 * with the process, however the test ends.  Where no tmpfs can be made,
 * the folder is what it was.
 */
static void
die_with_parent_tmpfs(gpointer user)
{
    die_with_parent(user);
    if (unshare(CLONE_NEWNS) == 0 && mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0) {
        (void)mount("pagefold-test", user, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=256m");
    }
}

/* pf_test_spawnv(), its stderr into the file stderr_path where not NULL,
 * with setup(user) in the child. */
static GSubprocess *
spawnv_to(GSubprocessFlags flags, const char *stderr_path, GSpawnChildSetupFunc setup,
          gpointer user, const char *const *argv, GError **error)
{
    g_autoptr(GSubprocessLauncher) l = g_subprocess_launcher_new(flags);

    g_subprocess_launcher_set_child_setup(l, setup, user, NULL);
    if (stderr_path != NULL) {
        g_subprocess_launcher_set_stderr_file_path(l, stderr_path);
    }
    return g_subprocess_launcher_spawnv(l, argv, error);
}

gboolean
pf_test_probe_kvm(const char *kernel, const char *initrd, char **why)
{
    g_autofree char *probe = g_build_filename(g_getenv("PAGEFOLD_SOURCE_DIR"), "scripts",
                                              "probe-kvm", NULL);
    const char *argv[] = { probe, g_getenv("QEMU_BINARY"), kernel, initrd, NULL };
    /* A guest under KVM prints its banner within a second. */
    g_auto(GStrv) env = g_environ_setenv(g_get_environ(), "PROBE_S", "10", TRUE);
    g_autofree char *out = NULL;
    g_autoptr(GError) error = NULL;
    gint status = 0;

    if (g_spawn_sync(NULL, (char **)argv, env, G_SPAWN_DEFAULT, NULL, NULL, &out, NULL,
                     &status, &error) &&
        g_spawn_check_wait_status(status, NULL)) {
        return TRUE;
    }
    *why = error != NULL ? g_strdup(error->message) : g_strdup(g_strstrip(out));
    return FALSE;
}

GSubprocess *
pf_test_spawnv(GSubprocessFlags flags, const char *const *argv, GError **error)
{
    return spawnv_to(flags, NULL, die_with_parent, NULL, argv, error);
}

GSubprocess *
pf_test_spawnv_apart(GSubprocessFlags flags, const char *const *argv, GError **error)
{
    return spawnv_to(flags, NULL, die_with_parent_apart, NULL, argv, error);
}

GSubprocess *
pf_test_spawnv_tmpfs(GSubprocessFlags flags, const char *dir, const char *const *argv,
                     GError **error)
{
    return spawnv_to(flags, NULL, die_with_parent_tmpfs, (gpointer)dir, argv, error);
}

static gboolean take_ready(PfTestVmm *v, const char *line, GError **error);

PfTestVmm *
pf_test_vmm_spawn(const char *const *argv)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *line = NULL;
    PfTestVmm *v = pf_test_vmm_launch(argv, &error);

    g_assert_no_error(error);
    line = g_data_input_stream_read_line(v->out, NULL, NULL, NULL);
    if (line == NULL) {
        pf_test_vmm_free(v);
        return NULL;
    }
    g_assert_true(take_ready(v, line, &error));
    return v;
}

PfTestVmm *
pf_test_vmm_launch(const char *const *argv, GError **error)
{
    PfTestVmm *v = g_new0(PfTestVmm, 1);

    v->proc = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDIN_PIPE | G_SUBPROCESS_FLAGS_STDOUT_PIPE,
                             argv, error);
    if (v->proc == NULL) {
        g_free(v);
        return NULL;
    }
    v->out = g_data_input_stream_new(g_subprocess_get_stdout_pipe(v->proc));
    v->in = g_subprocess_get_stdin_pipe(v->proc);
    return v;
}

/* Takes "ready PID MODE", the stand-in's first line. */
static gboolean
take_ready(PfTestVmm *v, const char *line, GError **error)
{
    g_auto(GStrv) words = g_strsplit(line, " ", 3);

    if (g_strv_length(words) != 3 || !g_str_equal(words[0], "ready")) {
        g_set_error(error, G_IO_ERROR, G_IO_ERROR_INVALID_DATA,
                    "stand-in said '%s' instead of ready", line);
        return FALSE;
    }
    v->pid = atoi(words[1]);
    g_free(v->mode);
    v->mode = g_strdup(words[2]);
    return TRUE;
}

gboolean
pf_test_vmm_wait_ready(PfTestVmm *v, double timeout_s, GError **error)
{
    g_autofree char *line = pf_test_vmm_read_line(v, timeout_s, error);

    return line != NULL && take_ready(v, line, error);
}

gboolean
pf_test_vmm_send(PfTestVmm *v, const char *cmd, GError **error)
{
    g_autofree char *line = g_strconcat(cmd, "\n", NULL);

    return g_output_stream_write_all(v->in, line, strlen(line), NULL, NULL, error) &&
           g_output_stream_flush(v->in, NULL, error);
}

char *
pf_test_vmm_read_line(PfTestVmm *v, double timeout_s, GError **error)
{
    GBufferedInputStream *b = G_BUFFERED_INPUT_STREAM(v->out);
    int fd = g_unix_input_stream_get_fd(
        G_UNIX_INPUT_STREAM(g_subprocess_get_stdout_pipe(v->proc)));
    gint64 deadline = g_get_monotonic_time() + (gint64)(timeout_s * G_USEC_PER_SEC);

    /* Only ever read what poll() says is there: a read of the buffered
     * stream would block past the deadline. */
    for (;;) {
        gsize avail;
        const char *buf = g_buffered_input_stream_peek_buffer(b, &avail);
        gint64 left = deadline - g_get_monotonic_time();
        struct pollfd p = { fd, POLLIN, 0 };
        gssize n;
        int r;

        if (memchr(buf, '\n', avail) != NULL) {
            return g_data_input_stream_read_line(v->out, NULL, NULL, error);
        }
        r = poll(&p, 1, (int)CLAMP(left / 1000, 0, 1000));
        if (r < 0 && errno != EINTR) {
            g_set_error(error, G_IO_ERROR, g_io_error_from_errno(errno), "poll: %s",
                        g_strerror(errno));
            return NULL;
        }
        if (r <= 0) {
            if (left <= 0) {
                g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT,
                            "no answer from stand-in %d within %.0f s", v->pid, timeout_s);
                return NULL;
            }
            continue;
        }
        if (avail == g_buffered_input_stream_get_buffer_size(b)) {
            g_buffered_input_stream_set_buffer_size(b, 2 * avail);
        }
        n = g_buffered_input_stream_fill(b, -1, NULL, error);
        if (n < 0) {
            return NULL;
        }
        if (n == 0) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_CLOSED,
                        "stand-in %d closed its output", v->pid);
            return NULL;
        }
    }
}

void
pf_test_vmm_free(PfTestVmm *v)
{
    g_subprocess_force_exit(v->proc);
    g_subprocess_wait(v->proc, NULL, NULL);
    g_object_unref(v->out);
    g_object_unref(v->proc);
    g_free(v->mode);
    g_free(v);
}

char *
pf_test_vmm_cmd(PfTestVmm *v, const char *cmd)
{
    g_autoptr(GError) error = NULL;
    char *reply;

    g_assert_true(pf_test_vmm_send(v, cmd, &error));
    reply = g_data_input_stream_read_line(v->out, NULL, NULL, &error);
    g_assert_no_error(error);
    g_assert_nonnull(reply);
    return reply;
}

char *
pf_test_vmm_cmdf(PfTestVmm *v, const char *fmt, ...)
{
    g_autofree char *cmd = NULL;
    va_list ap;

    va_start(ap, fmt);
    cmd = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    return pf_test_vmm_cmd(v, cmd);
}

void
pf_test_vmm_verify(PfTestVmm *v)
{
    g_autofree char *r = pf_test_vmm_cmd(v, "verify");

    if (!g_str_has_prefix(r, "verify ok")) {
        g_error("VMM %d: %s", v->pid, r);
    }
}

/* The number after the word key in r, a VMM's answer. */
static gint64
number_after(PfTestVmm *v, const char *r, const char *key)
{
    g_auto(GStrv) words = g_strsplit(r, " ", -1);

    for (guint i = 0; words[i] != NULL && words[i + 1] != NULL; i++) {
        if (g_str_equal(words[i], key)) {
            return g_ascii_strtoll(words[i + 1], NULL, 10);
        }
    }
    g_error("VMM %d: no %s in '%s'", v->pid, key, r);
}

gint64
pf_test_vmm_number(PfTestVmm *v, const char *cmd, const char *key)
{
    g_autofree char *r = pf_test_vmm_cmd(v, cmd);

    return number_after(v, r, key);
}

gint64
pf_test_vmm_merged(PfTestVmm *v)
{
    g_autofree char *r = pf_test_vmm_cmd(v, "stats");

    return number_after(v, r, "merged") + number_after(v, r, "zeroed");
}

gint64
pf_test_vmm_stat(PfTestVmm *v, const char *name)
{
    return pf_test_vmm_number(v, "stats", name);
}

void
pf_test_vmm_quit(PfTestVmm *v)
{
    g_autofree char *r = pf_test_vmm_cmd(v, "quit");

    if (!g_str_has_prefix(r, "verify ok")) {
        g_error("VMM %d at exit: %s", v->pid, r);
    }
    g_assert_true(g_subprocess_wait(v->proc, NULL, NULL));
    g_assert_cmpint(g_subprocess_get_exit_status(v->proc), ==, 0);
    pf_test_vmm_free(v);
}

const char *
pf_test_bin(const char *var)
{
    const char *p = g_getenv(var);

    if (p == NULL) {
        g_error("%s is not set (run through meson test)", var);
    }
    return p;
}

GPtrArray *
pf_test_argv_new(const char *prog, const char *sock, va_list ap)
{
    GPtrArray *argv = g_ptr_array_new();
    const char *a;

    g_ptr_array_add(argv, (char *)prog);
    if (sock != NULL) {
        g_ptr_array_add(argv, (char *)"--socket");
        g_ptr_array_add(argv, (char *)sock);
    }
    while ((a = va_arg(ap, const char *)) != NULL) {
        g_ptr_array_add(argv, (char *)a);
    }
    g_ptr_array_add(argv, NULL);
    return argv;
}

static void
daemon_spawn(PfTestDaemon *d, const char *first_arg, va_list ap)
{
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    gboolean own_config = FALSE;
    g_autofree char *config = NULL;
    const char *a;

    g_ptr_array_add(argv, (char *)pf_test_bin("PAGEFOLDD"));
    g_ptr_array_add(argv, (char *)"--socket");
    g_ptr_array_add(argv, d->sock);
    g_ptr_array_add(argv, (char *)"--agent-socket");
    g_ptr_array_add(argv, d->agent_sock);
    /* The host's libvirtd is none of a test's business (a test that wants
     * the publisher sets the knob after this). */
    g_ptr_array_add(argv, (char *)"--set");
    g_ptr_array_add(argv, (char *)"libvirt_metadata_millisecs=0");
    for (a = first_arg; a != NULL; a = va_arg(ap, const char *)) {
        g_ptr_array_add(argv, (char *)a);
        own_config |= g_str_equal(a, "--config");
    }
    /* The host's configuration file (an installed pagefold's) is none of
     * a test's business either: an empty one of the test's. */
    if (!own_config) {
        config = g_build_filename(d->dir, "empty.conf", NULL);
        g_assert_true(g_file_set_contents(config, "", 0, NULL));
        g_ptr_array_add(argv, (char *)"--config");
        g_ptr_array_add(argv, config);
    }
    g_ptr_array_add(argv, NULL);
    g_unlink(d->sock);
    d->proc = spawnv_to(G_SUBPROCESS_FLAGS_NONE, d->log, die_with_parent, NULL,
                        (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    for (int i = 0; i < 200 && !(g_file_test(d->sock, G_FILE_TEST_EXISTS) &&
                                 g_file_test(d->agent_sock, G_FILE_TEST_EXISTS)); i++) {
        g_usleep(25000);
    }
    g_assert_true(g_file_test(d->sock, G_FILE_TEST_EXISTS));
    {
        /* It greets once everything is set up (pf_control_start()): the
         * agent socket's group given, though the file exists, 0600, a
         * moment before. */
        struct sockaddr_un addr = { .sun_family = AF_UNIX };
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct pollfd p = { .fd = fd, .events = POLLIN };

        g_strlcpy(addr.sun_path, d->sock, sizeof(addr.sun_path));
        g_assert_cmpint(connect(fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
        g_assert_cmpint(poll(&p, 1, 20000), ==, 1);
        close(fd);
    }
}

static PfTestDaemon *
daemon_new(gboolean logged)
{
    PfTestDaemon *d = g_new0(PfTestDaemon, 1);
    g_autoptr(GError) error = NULL;

    d->dir = g_dir_make_tmp("pagefold-test-XXXXXX", &error);
    g_assert_no_error(error);
    d->sock = g_build_filename(d->dir, "pagefoldd.sock", NULL);
    d->agent_sock = g_build_filename(d->dir, "agent.sock", NULL);
    d->log = logged ? g_build_filename(d->dir, "pagefoldd.log", NULL) : NULL;
    return d;
}

PfTestDaemon *
pf_test_daemon_start(const char *first_arg, ...)
{
    PfTestDaemon *d = daemon_new(FALSE);
    va_list ap;

    va_start(ap, first_arg);
    daemon_spawn(d, first_arg, ap);
    va_end(ap);
    return d;
}

PfTestDaemon *
pf_test_daemon_start_logged(const char *first_arg, ...)
{
    PfTestDaemon *d = daemon_new(TRUE);
    va_list ap;

    va_start(ap, first_arg);
    daemon_spawn(d, first_arg, ap);
    va_end(ap);
    return d;
}

char *
pf_test_daemon_log(PfTestDaemon *d)
{
    char *text = NULL;

    g_assert_nonnull(d->log);
    g_assert_true(g_file_get_contents(d->log, &text, NULL, NULL));
    return text;
}

void
pf_test_daemon_kill(PfTestDaemon *d)
{
    g_subprocess_send_signal(d->proc, SIGKILL);
    g_subprocess_wait(d->proc, NULL, NULL);
}

void
pf_test_daemon_restart(PfTestDaemon *d, const char *first_arg, ...)
{
    va_list ap;

    g_clear_object(&d->proc);
    va_start(ap, first_arg);
    daemon_spawn(d, first_arg, ap);
    va_end(ap);
}

void
pf_test_daemon_free(PfTestDaemon *d)
{
    if (d->proc != NULL) {
        g_subprocess_force_exit(d->proc);
        g_subprocess_wait(d->proc, NULL, NULL);
        g_object_unref(d->proc);
    }
    g_unlink(d->sock);
    g_unlink(d->agent_sock);
    if (d->log != NULL) {
        g_unlink(d->log);
        g_free(d->log);
    }
    {
        g_autofree char *config = g_build_filename(d->dir, "empty.conf", NULL);
        g_autofree char *attached = g_strconcat(d->sock, ".attached", NULL);

        g_unlink(config);
        g_unlink(attached);
    }
    g_rmdir(d->dir);
    g_free(d->sock);
    g_free(d->agent_sock);
    g_free(d->dir);
    g_free(d);
}

JsonNode *
pf_test_ctl_json(PfTestDaemon *d, const char *first_arg, ...)
{
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonParser) parser = json_parser_new();
    g_autofree char *out = NULL, *err = NULL;
    const char *a;
    va_list ap;

    g_ptr_array_add(argv, (char *)pf_test_bin("PAGEFOLDCTL"));
    g_ptr_array_add(argv, (char *)"--socket");
    g_ptr_array_add(argv, d->sock);
    g_ptr_array_add(argv, (char *)"--json");
    va_start(ap, first_arg);
    for (a = first_arg; a != NULL; a = va_arg(ap, const char *)) {
        g_ptr_array_add(argv, (char *)a);
    }
    va_end(ap);
    g_ptr_array_add(argv, NULL);
    p = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_PIPE,
                       (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    g_subprocess_communicate_utf8(p, NULL, NULL, &out, &err, &error);
    g_assert_no_error(error);
    if (g_subprocess_get_exit_status(p) != 0) {
        g_error("pagefoldctl %s failed: %s", first_arg, err);
    }
    g_assert_true(json_parser_load_from_data(parser, out, -1, NULL));
    return json_node_copy(json_parser_get_root(parser));
}

#include <stdio.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "agent.h"
#include "proto.h"
#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

PfTestPeer *
pf_test_peer_new(void)
{
    PfTestPeer *p = g_new0(PfTestPeer, 1);
    g_autoptr(GError) error = NULL;
    struct sockaddr_un addr = { .sun_family = AF_UNIX };

    p->dir = g_dir_make_tmp("pagefold-peer-XXXXXX", &error);
    g_assert_no_error(error);
    p->path = g_build_filename(p->dir, "agent.sock", NULL);
    g_strlcpy(addr.sun_path, p->path, sizeof(addr.sun_path));
    p->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    g_assert_cmpint(bind(p->listen_fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    g_assert_cmpint(listen(p->listen_fd, 4), ==, 0);
    p->conn = -1;
    p->version = PF_PROTO_VERSION;
    return p;
}

typedef struct {
    PfAgent *agent;
    const char *path;
} StartArgs;

static gpointer
start_agent(gpointer data)
{
    StartArgs *a = data;
    g_autoptr(GError) error = NULL;
    gboolean ok = pf_agent_start(a->agent, a->path, &error) &&
                  pf_agent_wait_settled(a->agent, &error);

    g_assert_no_error(error);
    return GINT_TO_POINTER(ok);
}

int
pf_test_peer_accept(PfTestPeer *p, PfAgent *agent)
{
    StartArgs args = { agent, p->path };
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    PfWireMode welcome = { p->version, PF_MODE_MERGE, "" };
    GThread *t = g_thread_new("agent-start", start_agent, &args);
    int mode;

    p->conn = accept4(p->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    g_assert_true(pf_proto_recv(p->conn, m, NULL));
    g_assert_cmpuint(m->header.type, ==, PF_MSG_HELLO);
    for (guint32 i = 0; i < pf_msg_hello(m)->n_regions; i++) {
        g_autofree PfMsg *r = g_new0(PfMsg, 1);

        g_assert_true(pf_proto_recv(p->conn, r, NULL));
        g_assert_cmpuint(r->header.type, ==, PF_MSG_REGION);
        pf_msg_close_fds(r);
    }
    g_assert_true(pf_proto_send(p->conn, PF_MSG_WELCOME, 0, &welcome, sizeof(welcome), NULL, 0,
                                NULL));
    g_assert_true(pf_proto_recv(p->conn, m, NULL));
    g_assert_cmpuint(m->header.type, ==, PF_MSG_READY);
    g_assert_cmpuint(pf_msg_mode(m)->version, ==, p->version);
    mode = (int)pf_msg_mode(m)->mode;
    g_assert_true(g_thread_join(t));
    return mode;
}

void
pf_test_peer_free(PfTestPeer *p)
{
    if (p->conn >= 0) {
        close(p->conn);
    }
    close(p->listen_fd);
    g_unlink(p->path);
    g_rmdir(p->dir);
    g_free(p->path);
    g_free(p->dir);
    g_free(p);
}

int
pf_test_pool_chunk(guint32 n_slots, gboolean seal, guint8 **map)
{
    int fd = memfd_create("test-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    g_assert_cmpint(ftruncate(fd, (off_t)n_slots * PF_PAGE_SIZE), ==, 0);
    *map = mmap(NULL, (gsize)n_slots * PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    g_assert(*map != MAP_FAILED);
    if (seal) {
        g_assert_cmpint(fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_GROW |
                                                   F_SEAL_SHRINK | F_SEAL_SEAL), ==, 0);
    }
    return fd;
}

gboolean
pf_test_write_sysfs(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    gboolean ok;

    if (fd < 0) {
        return FALSE;
    }
    ok = write(fd, value, strlen(value)) == (ssize_t)strlen(value);
    close(fd);
    return ok;
}

/* Counts the mappings of /proc/PID/maps that overlap the range, or sums a
 * field of /proc/PID/smaps over them. */
static gint64
walk_mappings(int pid, const char *file, guint64 start, guint64 size, const char *field)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/%s", pid, file);
    g_autofree char *text = NULL;
    g_autofree char *key = field == NULL ? NULL
                           : g_str_has_prefix(field, "VmFlags ") ? g_strdup("VmFlags:")
                                                                  : g_strdup_printf("%s:", field);
    g_auto(GStrv) lines = NULL;
    gboolean inside = FALSE;
    gint64 sum = 0;

    g_assert_true(g_file_get_contents(path, &text, NULL, NULL));
    lines = g_strsplit(text, "\n", -1);
    for (char **l = lines; *l && **l; l++) {
        const char *dash = strchr(*l, '-');
        const char *space = strchr(*l, ' ');

        if (g_ascii_isxdigit(**l) && dash != NULL && space != NULL && space > dash) {
            guint64 a = g_ascii_strtoull(*l, NULL, 16);
            guint64 b = g_ascii_strtoull(dash + 1, NULL, 16);

            inside = size == 0 || (a < start + size && b > start);
            sum += key == NULL && inside;
        } else if (key != NULL && inside && g_str_has_prefix(*l, key) &&
                   g_str_equal(key, "VmFlags:")) {
            g_autofree char *want = g_strdup_printf(" %s", field + strlen("VmFlags "));

            sum += strstr(*l, want) != NULL;
        } else if (key != NULL && inside && g_str_has_prefix(*l, key)) {
            sum += g_ascii_strtoll(*l + strlen(key), NULL, 10);
        }
    }
    return sum;
}

gint64
pf_test_count_vmas(int pid, guint64 start, guint64 size)
{
    return walk_mappings(pid, "maps", start, size, NULL);
}

gint64
pf_test_smaps_sum(int pid, guint64 start, guint64 size, const char *field)
{
    return walk_mappings(pid, "smaps", start, size, field);
}

gint64
pf_test_count_vmas_flag(int pid, guint64 start, guint64 size, const char *flag)
{
    g_autofree char *field = g_strdup_printf("VmFlags %s", flag);

    return walk_mappings(pid, "smaps", start, size, field);
}

/* A proportional set size in KiB (each physical page split among the
 * processes that map it): "Pss" or one of its parts, "Pss_Shmem". */
gint64
pf_test_rollup_kib(int pid, const char *which)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/smaps_rollup", pid);
    g_autofree char *text = NULL;
    g_autofree char *key = g_strdup_printf("\n%s:", which);
    const char *p;

    g_assert_true(g_file_get_contents(path, &text, NULL, NULL));
    p = strstr(text, key);
    g_assert_nonnull(p);
    return g_ascii_strtoll(p + strlen(key), NULL, 10);
}

/* A pool chunk other than the zero chunk, by the name pagefoldd gives. */
static gboolean
is_pool_chunk(const char *what)
{
    const char *id = strstr(what, "/memfd:pagefold-pool-");

    return id != NULL && g_ascii_strtoull(id + strlen("/memfd:pagefold-pool-"), NULL, 10) != 0;
}

static void
count_pool_file(const char *path, GHashTable *seen, gint64 *kib)
{
    struct stat st;

    if (stat(path, &st) == 0 && !g_hash_table_contains(seen, GSIZE_TO_POINTER(st.st_ino))) {
        g_hash_table_add(seen, GSIZE_TO_POINTER(st.st_ino));
        *kib += st.st_blocks / 2;
    }
}

gint64
pf_test_pool_kib(int pid, guint *n_chunks)
{
    g_autofree char *dir = g_strdup_printf("/proc/%d/fd", pid);
    g_autofree char *maps_path = g_strdup_printf("/proc/%d/maps", pid);
    g_autofree char *maps = NULL;
    g_autoptr(GDir) d = g_dir_open(dir, 0, NULL);
    g_autoptr(GHashTable) seen = g_hash_table_new(NULL, NULL);
    g_auto(GStrv) lines = NULL;
    gint64 kib = 0;
    const char *e;

    g_assert_nonnull(d);
    while ((e = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_build_filename(dir, e, NULL);
        g_autofree char *target = g_file_read_link(path, NULL);

        if (target != NULL && is_pool_chunk(target)) {
            count_pool_file(path, seen, &kib);
        }
    }
    g_assert_true(g_file_get_contents(maps_path, &maps, NULL, NULL));
    lines = g_strsplit(maps, "\n", -1);
    for (guint i = 0; lines[i] != NULL; i++) {
        char range[64];

        if (is_pool_chunk(lines[i]) && sscanf(lines[i], "%63s", range) == 1) {
            g_autofree char *path = g_strdup_printf("/proc/%d/map_files/%s", pid, range);

            count_pool_file(path, seen, &kib);
        }
    }
    if (n_chunks != NULL) {
        *n_chunks = g_hash_table_size(seen);
    }
    return kib;
}

gint64
pf_test_memfd_kib(int pid)
{
    g_autofree char *dir = g_strdup_printf("/proc/%d/fd", pid);
    g_autoptr(GDir) d = g_dir_open(dir, 0, NULL);
    const char *e;

    while (d && (e = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_build_filename(dir, e, NULL);
        g_autofree char *target = g_file_read_link(path, NULL);
        struct stat st;

        if (target && g_str_has_prefix(target, "/memfd:memory-backend-memfd") &&
            stat(path, &st) == 0) {
            return st.st_blocks / 2;
        }
    }
    return -1;
}

int
pf_test_flooder(PfTestDaemon *d, guint seconds)
{
    gint64 end = seconds > 0 ? g_get_monotonic_time() + seconds * G_USEC_PER_SEC : G_MAXINT64;
    int pid = fork();

    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        struct sockaddr_un addr = { .sun_family = AF_UNIX };
        int held[4] = { -1, -1, -1, -1 };

        /* A change of credentials clears the parent-death signal: after. */
        if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0 ||
            prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) {
            _exit(1);
        }
        g_strlcpy(addr.sun_path, d->agent_sock, sizeof(addr.sun_path));
        for (guint i = 0; g_get_monotonic_time() < end; i++) {
            int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);

            if (held[i % 4] >= 0) {
                close(held[i % 4]);
            }
            held[i % 4] = connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0 ? fd : -1;
            if (held[i % 4] < 0) {
                /* The queue full: a moment for pagefoldd, not a spin that
                 * takes the test's cores. */
                close(fd);
                g_usleep(1000);
            }
        }
        _exit(0);
    }
    return pid;
}

void
pf_test_write_libvirt_status(const char *dir, const char *name, const char *pid)
{
    g_autofree char *base = g_strconcat(name, ".xml", NULL);
    g_autofree char *path = g_build_filename(dir, base, NULL);
    g_autofree char *text = NULL;
    g_autoptr(GError) error = NULL;

    if (pid == NULL) {
        g_assert_true(g_unlink(path) == 0 || errno == ENOENT);
        return;
    }
    text = g_strdup_printf("<!--\nWARNING: THIS IS AN AUTO-GENERATED FILE.\n-->\n\n"
                           "<domstatus state='running' reason='booted' pid='%s'>\n"
                           "  <domain type='qemu'><name>%s</name></domain>\n"
                           "</domstatus>\n", pid, name);
    g_file_set_contents_full(path, text, -1, G_FILE_SET_CONTENTS_CONSISTENT, 0600, &error);
    g_assert_no_error(error);
}

JsonObject *
pf_test_find_vm(JsonArray *vms, const char *name)
{
    for (guint i = 0; i < json_array_get_length(vms); i++) {
        JsonObject *o = json_array_get_object_element(vms, i);

        if (g_str_equal(json_object_get_string_member(o, "name"), name)) {
            return o;
        }
    }
    return NULL;
}

JsonObject *
pf_test_find_vm_pid(JsonArray *vms, int pid)
{
    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *vm = json_array_get_object_element(vms, i);

        if (json_object_get_int_member(vm, "pid") == pid) {
            return vm;
        }
    }
    return NULL;
}

JsonObject *
pf_test_listed_vm(PfTestDaemon *d, const char *name)
{
    g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);
    JsonObject *vm = pf_test_find_vm(json_node_get_array(list), name);

    return vm != NULL ? json_object_ref(vm) : NULL;
}

void
pf_test_daemon_wait_vmm(PfTestDaemon *d, PfTestVmm *v)
{
    gint64 deadline = g_get_monotonic_time() + 120 * G_USEC_PER_SEC;

    for (;;) {
        g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);
        JsonObject *vm = pf_test_find_vm_pid(json_node_get_array(list), v->pid);

        if (vm != NULL && g_str_equal(json_object_get_string_member(vm, "mode"), v->mode)) {
            return;
        }
        if (g_get_monotonic_time() > deadline) {
            g_error("pagefoldd did not list process %d in mode %s within 120 s", v->pid,
                    v->mode);
        }
        g_usleep(20000);
    }
}

JsonObject *
pf_test_vm_stats(PfTestDaemon *d, const char *name)
{
    g_autoptr(JsonNode) stats = pf_test_ctl_json(d, "stats", NULL);
    JsonObject *vm = pf_test_find_vm(
        json_object_get_array_member(json_node_get_object(stats), "vms"), name);

    return vm != NULL ? json_object_ref(vm) : NULL;
}

gint64
pf_test_vm_counter(PfTestDaemon *d, const char *name, const char *counter)
{
    g_autoptr(JsonObject) vm = pf_test_vm_stats(d, name);

    return vm != NULL ? json_object_get_int_member(vm, counter) : -1;
}

int
pf_test_daemon_pid(PfTestDaemon *d)
{
    return atoi(g_subprocess_get_identifier(d->proc));
}

int
pf_test_listener_pid(const char *path)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    struct ucred cred;
    socklen_t len = sizeof(cred);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int pid = 0;

    g_strlcpy(addr.sun_path, path, sizeof(addr.sun_path));
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0 &&
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        pid = cred.pid;
    }
    close(fd);
    return pid;
}

GSubprocess *
pf_test_standin_guest(const char *name, const char *uuid, int seed, int *pid)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *guestarg = g_strdup_printf("guest=%s", name);
    g_autofree char *seedarg = g_strdup_printf("%d", seed);
    const char *argv[] = {
        pf_test_bin("STANDIN_GUEST"), "-name", guestarg, "--mib", "16", "--identical", "50",
        "--zero", "20", "--volatile", "0", "--churn-ms", "0", "--seed", seedarg, "--stdin",
        uuid != NULL ? "-uuid" : NULL, uuid, NULL
    };
    GSubprocess *p = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDIN_PIPE,
                                    argv, &error);
    g_autoptr(GDataInputStream) in = NULL;
    g_autofree char *line = NULL;

    g_assert_no_error(error);
    in = g_data_input_stream_new(g_subprocess_get_stdout_pipe(p));
    line = g_data_input_stream_read_line(in, NULL, NULL, &error);
    g_assert_no_error(error);
    g_assert_true(g_str_has_prefix(line, "ready "));
    *pid = atoi(line + 6);
    return p;
}

gboolean
pf_test_send_fd(int sock, const void *buf, gsize len, int fd)
{
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct iovec iov = { (void *)buf, len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

    if (fd >= 0) {
        struct cmsghdr *c;

        mh.msg_control = control.buf;
        mh.msg_controllen = sizeof(control.buf);
        c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    return sendmsg(sock, &mh, MSG_NOSIGNAL) == (gssize)len;
}

gssize
pf_test_recv_fd(int sock, void *buf, gsize len, int *fd)
{
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct iovec iov = { buf, len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof(control.buf) };
    struct cmsghdr *c;
    gssize n;

    *fd = -1;
    do {
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    c = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL;
    if (c != NULL && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        memcpy(fd, CMSG_DATA(c), sizeof(int));
    }
    return n;
}
