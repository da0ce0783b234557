/*
 * hook-test.c - the libvirt qemu hook (libvirt-hooks/hook.c) run as
 * libvirtd runs it: NAME OP SUBOP EXTRA, the domain XML on stdin, the
 * pid file in a run folder, against a real pagefoldd on sockets of the
 * test's own and stand-in QEMUs (standin-guest: shared memfd RAM and no
 * agent, so pagefoldd attaches them by pid, in advise mode).  Whatever it
 * is given, the hook exits 0, writes nothing on stdout and says what it
 * did, or why not, on stderr and in the domain's log.
 *
 * Some cases put a stand-in pagefoldd behind the control socket instead
 * (a thread here that records each request and answers what the case
 * says), to see the exact requests; and one has the hook start this very
 * program as its "pagefoldd" (HOOK_TEST_RECORD set), which writes down
 * the arguments and descriptors it was started with.
 */
#include <errno.h>
#include <fcntl.h>
#include <gio/gio.h>
#include <glib-unix.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <grp.h>
#include <json-glib/json-glib.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "testproc.h"
#include "util.h"

#define UUID_GIVEN "6F9619FF-8B86-D011-B42D-00C04FC964FF"
#define UUID_CANON "6f9619ff-8b86-d011-b42d-00c04fc964ff"
#define MEMFD_SHARED "<memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>"

typedef struct {
    PfTestDaemon *d; /* NULL in cases that start none */
    char *dir;
    char *run_dir;
    char *log_dir;
    char *sock;      /* the control socket the hook is pointed at */
    GPtrArray *guests;
    int spawned;     /* a pagefoldd the hook started, not our child */
} Fixture;

typedef struct {
    gboolean exited;
    int status;
    char *out;
    char *err;
} Run;

static void
run_clear(Run *r)
{
    g_free(r->out);
    g_free(r->err);
    memset(r, 0, sizeof(*r));
}

G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Run, run_clear)

/* ---- the hook ---- */

static char *
bytes_text(GBytes *b)
{
    gsize size = 0;
    const char *data = b ? g_bytes_get_data(b, &size) : NULL;

    return size > 0 ? g_strndup(data, size) : g_strdup("");
}

/* The domain XML, written to the hook's stdin from a thread of its own. */
typedef struct {
    int fd;
    const char *data;
    gsize len;
    int error; /* errno of a write that failed, or 0 */
} Feed;

static gpointer
feed_thread(gpointer data)
{
    Feed *f = data;
    const char *p = f->data;
    gsize left = f->len;

    while (left > 0) {
        ssize_t n = write(f->fd, p, left);

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            f->error = errno;
            break;
        }
        p += n;
        left -= (gsize)n;
    }
    close(f->fd);
    return NULL;
}

/* Runs the hook with exactly these arguments and xml on stdin.
 *
 * The hook may exit without reading stdin (bad arguments, a bad name), so
 * writing the XML can fail with EPIPE.  g_subprocess_communicate() cannot
 * feed stdin for us then: such a write fails the whole call, and it drops
 * the stdout and stderr it has read (stderr came back empty whenever the
 * hook was gone before the XML was written).  So stdin is a pipe of ours,
 * written by a thread (the XML may be larger than a pipe holds, while
 * stdout and stderr must be drained), and communicate() reads only stdout
 * and stderr, to EOF. */
static void
run_argv(const char *const *args, const char *xml, const char *record, Run *r)
{
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    g_autoptr(GSubprocessLauncher) l = g_subprocess_launcher_new(
        G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_PIPE);
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    g_autoptr(GBytes) out = NULL, err = NULL;
    Feed feed = { .data = xml, .len = strlen(xml) };
    GThread *feeder;
    int in[2];

    run_clear(r);
    g_ptr_array_add(argv, (char *)pf_test_bin("PAGEFOLD_HOOK"));
    for (const char *const *a = args; *a; a++) {
        g_ptr_array_add(argv, (char *)*a);
    }
    g_ptr_array_add(argv, NULL);
    if (record != NULL) {
        g_subprocess_launcher_setenv(l, "HOOK_TEST_RECORD", record, TRUE);
    }
    g_unix_open_pipe(in, FD_CLOEXEC, &error);
    g_assert_no_error(error);
    g_subprocess_launcher_take_stdin_fd(l, in[0]);
    p = g_subprocess_launcher_spawnv(l, (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    /* Our copy of the read end goes now: with the hook gone, the writer
     * must meet EPIPE, not a full pipe that nobody reads. */
    g_subprocess_launcher_close(l);
    feed.fd = in[1];
    feeder = g_thread_new("hook-stdin", feed_thread, &feed);
    g_subprocess_communicate(p, NULL, NULL, &out, &err, &error);
    g_thread_join(feeder);
    g_assert_no_error(error);
    if (feed.error != 0 && feed.error != EPIPE) {
        g_error("writing the domain XML to the hook: %s", g_strerror(feed.error));
    }
    r->exited = g_subprocess_get_if_exited(p);
    r->status = r->exited ? g_subprocess_get_exit_status(p) : -1;
    r->out = bytes_text(out);
    r->err = bytes_text(err);
    /* What every run must be, whatever it was given. */
    if (!r->exited || r->status != 0 || r->out[0] != '\0') {
        g_error("hook %s: exited %d status %d, stdout '%s', stderr '%s'",
                args[0] ? args[0] : "", r->exited, r->status, r->out, r->err);
    }
}

/* Runs the hook with the fixture's socket, run and log folders, then
 * the NULL-terminated arguments (more options, libvirt's four). */
static void G_GNUC_NULL_TERMINATED
hook(Fixture *f, Run *r, const char *xml, ...)
{
    g_autoptr(GPtrArray) args = g_ptr_array_new();
    const char *a;
    va_list ap;

    g_ptr_array_add(args, (char *)"--socket");
    g_ptr_array_add(args, f->sock);
    g_ptr_array_add(args, (char *)"--run-dir");
    g_ptr_array_add(args, f->run_dir);
    g_ptr_array_add(args, (char *)"--log-dir");
    g_ptr_array_add(args, f->log_dir);
    va_start(ap, xml);
    while ((a = va_arg(ap, const char *)) != NULL) {
        g_ptr_array_add(args, (char *)a);
    }
    va_end(ap);
    g_ptr_array_add(args, NULL);
    run_argv((const char *const *)args->pdata, xml, NULL, r);
}

static char *
domain_xml(const char *name, const char *uuid, const char *more)
{
    g_autofree char *uuid_el = uuid ? g_strdup_printf("  <uuid>%s</uuid>\n", uuid) : g_strdup("");

    return g_strdup_printf("<domain type='kvm' id='3' "
                           "xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>\n"
                           "  <name>%s</name>\n%s"
                           "  <memory unit='KiB'>16384</memory>\n"
                           "  <vcpu placement='static'>1</vcpu>\n"
                           "  <os><type arch='x86_64' machine='pc'>hvm</type></os>\n"
                           "%s\n"
                           "  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices>\n"
                           "</domain>\n",
                           name, uuid_el, more ? more : "");
}

static char *
domain_log(Fixture *f, const char *name)
{
    g_autofree char *base = g_strconcat(name, ".log", NULL);
    g_autofree char *path = g_build_filename(f->log_dir, base, NULL);
    char *text = NULL;

    if (!g_file_get_contents(path, &text, NULL, NULL)) {
        return g_strdup("");
    }
    return text;
}

/* The line is in the domain's log and was said on stderr. */
static void
assert_said(Fixture *f, const Run *r, const char *name, const char *want)
{
    g_autofree char *log = domain_log(f, name);

    if (strstr(r->err, want) == NULL) {
        g_error("wanted '%s' on the hook's stderr, got '%s'", want, r->err);
    }
    if (strstr(log, want) == NULL) {
        g_error("wanted '%s' in the log of %s, got '%s'", want, name, log);
    }
    g_assert_nonnull(strstr(log, "pagefold-hook: "));
}

/* ---- guests, pid files, pagefoldd ---- */

static int
start_guest(Fixture *f, const char *name, const char *uuid)
{
    int pid;

    g_ptr_array_add(f->guests, pf_test_standin_guest(name, uuid, (int)f->guests->len + 1, &pid));
    return pid;
}

/* libvirt's record of the domain's QEMU: its status file.  Its pid file
 * is written too, naming another process: the QEMU holds that one open
 * for writing, so a compromised one can make it say anything, and the
 * hook must not read it. */
static void
write_pid(Fixture *f, const char *name, int pid)
{
    g_autofree char *base = g_strconcat(name, ".pid", NULL);
    g_autofree char *path = g_build_filename(f->run_dir, base, NULL);
    g_autofree char *text = g_strdup_printf("%d", pid);
    g_autoptr(GError) error = NULL;

    pf_test_write_libvirt_status(f->run_dir, name, text);
    g_file_set_contents(path, "1\n", -1, &error);
    g_assert_no_error(error);
}

static void
remove_pid(Fixture *f, const char *name)
{
    g_autofree char *base = g_strconcat(name, ".pid", NULL);
    g_autofree char *path = g_build_filename(f->run_dir, base, NULL);

    g_unlink(path);
    pf_test_write_libvirt_status(f->run_dir, name, NULL);
}

static JsonArray *
list_vms(Fixture *f)
{
    g_autoptr(JsonNode) n = pf_test_ctl_json(f->d, "list", NULL);

    return json_array_ref(json_node_get_array(n));
}

static guint
n_attached(Fixture *f)
{
    g_autoptr(JsonArray) vms = list_vms(f);

    return json_array_get_length(vms);
}

/* Ends a process that is not our child and waits until it is gone. */
static void
kill_and_wait(int pid)
{
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    struct pollfd p = { .fd = pidfd, .events = POLLIN };

    g_assert_cmpint(pidfd, >=, 0);
    kill(pid, SIGTERM);
    if (poll(&p, 1, 10000) != 1) {
        kill(pid, SIGKILL);
        g_assert_cmpint(poll(&p, 1, 10000), ==, 1);
    }
    close(pidfd);
}

static void
fixture_init(Fixture *f, gboolean with_daemon)
{
    g_autoptr(GError) error = NULL;

    f->dir = g_dir_make_tmp("pagefold-hook-XXXXXX", &error);
    g_assert_no_error(error);
    f->run_dir = g_build_filename(f->dir, "run", NULL);
    f->log_dir = g_build_filename(f->dir, "log", NULL);
    g_assert_cmpint(g_mkdir(f->run_dir, 0700), ==, 0);
    g_assert_cmpint(g_mkdir(f->log_dir, 0700), ==, 0);
    f->guests = g_ptr_array_new();
    if (with_daemon) {
        /* Nothing of the host's libvirt touched. */
        f->d = pf_test_daemon_start("--set", "run=0", "--set", "libvirt_metadata_millisecs=0",
                                    NULL);
        f->sock = g_strdup(f->d->sock);
    } else {
        f->sock = g_build_filename(f->dir, "pagefoldd.sock", NULL);
    }
}

static void
setup(Fixture *f, gconstpointer data)
{
    fixture_init(f, TRUE);
}

static void
setup_bare(Fixture *f, gconstpointer data)
{
    fixture_init(f, FALSE);
}

static void
teardown(Fixture *f, gconstpointer data)
{
    g_autofree char *rm = g_strdup_printf("rm -rf '%s'", f->dir);

    for (guint i = 0; i < f->guests->len; i++) {
        GSubprocess *p = g_ptr_array_index(f->guests, i);

        g_subprocess_force_exit(p);
        g_subprocess_wait(p, NULL, NULL);
        g_object_unref(p);
    }
    g_ptr_array_unref(f->guests);
    if (f->spawned != 0) {
        kill_and_wait(f->spawned);
    }
    if (f->d != NULL) {
        pf_test_daemon_free(f->d);
    }
    g_assert_cmpint(system(rm), ==, 0);
    g_free(f->sock);
    g_free(f->run_dir);
    g_free(f->log_dir);
    g_free(f->dir);
}

/* ---- a stand-in pagefoldd behind the control socket ---- */

typedef struct {
    int listen_fd;
    GThread *thread;
    gint stop;
    GMutex lock;
    GPtrArray *requests; /* request lines, in order */
    GHashTable *replies; /* command -> reply line; "" never answers */
} Fake;

static char *
fake_read_line(int fd)
{
    g_autoptr(GString) s = g_string_new(NULL);
    char c;

    for (;;) {
        struct pollfd p = { .fd = fd, .events = POLLIN };

        if (poll(&p, 1, 5000) != 1 || read(fd, &c, 1) != 1) {
            return NULL;
        }
        if (c == '\n') {
            return g_string_free(g_steal_pointer(&s), FALSE);
        }
        g_string_append_c(s, c);
    }
}

static gpointer
fake_thread(gpointer data)
{
    static const char greeting[] =
        "{\"QMP\": {\"version\": {\"pagefold\": \"fake\"}, \"capabilities\": []}}\n";
    Fake *fk = data;

    while (!g_atomic_int_get(&fk->stop)) {
        struct pollfd p = { .fd = fk->listen_fd, .events = POLLIN };
        g_autofree char *line = NULL;
        g_autoptr(JsonParser) parser = json_parser_new();
        const char *cmd = "";
        const char *reply;
        int fd;

        if (poll(&p, 1, 20) != 1 || (fd = accept4(fk->listen_fd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
            continue;
        }
        (void)!write(fd, greeting, strlen(greeting));
        line = fake_read_line(fd);
        if (line != NULL && json_parser_load_from_data(parser, line, -1, NULL) &&
            JSON_NODE_HOLDS_OBJECT(json_parser_get_root(parser))) {
            cmd = json_object_get_string_member_with_default(
                json_node_get_object(json_parser_get_root(parser)), "execute", "");
        }
        g_mutex_lock(&fk->lock);
        g_ptr_array_add(fk->requests, g_strdup(line ? line : ""));
        reply = g_hash_table_lookup(fk->replies, cmd);
        g_mutex_unlock(&fk->lock);
        if (reply == NULL) {
            reply = "{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"not in the fake\"}}";
        }
        if (*reply == '\0') {
            /* Silent until the client gives up. */
            g_free(fake_read_line(fd));
        } else {
            g_autofree char *l = g_strconcat(reply, "\n", NULL);

            (void)!write(fd, l, strlen(l));
        }
        close(fd);
    }
    return NULL;
}

static Fake *
fake_start(Fixture *f)
{
    Fake *fk = g_new0(Fake, 1);
    g_autoptr(GError) error = NULL;

    fk->listen_fd = pf_unix_listen(f->sock, SOCK_STREAM, &error);
    g_assert_no_error(error);
    g_mutex_init(&fk->lock);
    fk->requests = g_ptr_array_new_with_free_func(g_free);
    fk->replies = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, g_free);
    fk->thread = g_thread_new("fake-pagefoldd", fake_thread, fk);
    return fk;
}

static void
fake_reply(Fake *fk, const char *cmd, const char *reply)
{
    g_mutex_lock(&fk->lock);
    g_hash_table_replace(fk->replies, g_strdup(cmd), g_strdup(reply));
    g_mutex_unlock(&fk->lock);
}

/* The requests so far (JSON text), and forgets them. */
static GPtrArray *
fake_take(Fake *fk)
{
    GPtrArray *r;

    g_mutex_lock(&fk->lock);
    r = g_steal_pointer(&fk->requests);
    fk->requests = g_ptr_array_new_with_free_func(g_free);
    g_mutex_unlock(&fk->lock);
    return r;
}

static void
fake_stop(Fake *fk)
{
    g_atomic_int_set(&fk->stop, 1);
    g_thread_join(fk->thread);
    close(fk->listen_fd);
    g_ptr_array_unref(fk->requests);
    g_hash_table_unref(fk->replies);
    g_mutex_clear(&fk->lock);
    g_free(fk);
}

G_DEFINE_AUTOPTR_CLEANUP_FUNC(Fake, fake_stop)

/* Asserts the one request was attach with exactly these arguments
 * (merge_domain NULL: none). */
static void
assert_attach_request(const char *line, int pid, const char *name, const char *uuid,
                      const char *merge_domain)
{
    g_autoptr(JsonParser) p = json_parser_new();
    g_autoptr(GError) error = NULL;
    JsonObject *req, *args;

    json_parser_load_from_data(p, line, -1, &error);
    g_assert_no_error(error);
    req = json_node_get_object(json_parser_get_root(p));
    g_assert_cmpuint(json_object_get_size(req), ==, 2);
    g_assert_cmpstr(json_object_get_string_member(req, "execute"), ==, "attach");
    args = json_object_get_object_member(req, "arguments");
    g_assert_cmpuint(json_object_get_size(args), ==, merge_domain ? 4 : 3);
    g_assert_cmpint(json_object_get_int_member(args, "pid"), ==, pid);
    g_assert_cmpstr(json_object_get_string_member(args, "name"), ==, name);
    g_assert_cmpstr(json_object_get_string_member(args, "uuid"), ==, uuid);
    if (merge_domain != NULL) {
        g_assert_cmpstr(json_object_get_string_member(args, "merge-domain"), ==, merge_domain);
    }
}

/* ---- started, reconnect, attach ---- */

/* Which process a domain's QEMU is comes from libvirt's status file only:
 * one that is not root's alone (here: group-writable), or a symbolic
 * link, names nobody; its pid file is never read. */
static void
test_started_status_file(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *status = g_build_filename(f->run_dir, "web1.xml", NULL);
    g_autofree char *moved = g_build_filename(f->run_dir, "other.xml", NULL);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    g_assert_cmpint(g_chmod(status, 0620), ==, 0);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "is not libvirt's status file");
    g_assert_cmpuint(n_attached(f), ==, 0);

    g_assert_cmpint(g_chmod(status, 0600), ==, 0);
    g_assert_cmpint(g_rename(status, moved), ==, 0);
    g_assert_cmpint(symlink(moved, status), ==, 0);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "cannot read");
    g_assert_cmpuint(n_attached(f), ==, 0);
}

static void
test_started_attaches(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *want = g_strdup_printf("pagefold-hook: web1 started begin: attached pid %d "
                                            "as VM 'web1' (uuid " UUID_CANON ") in mode advise",
                                            pid);
    g_autoptr(JsonArray) vms = NULL;
    g_auto(Run) r = { 0 };
    JsonObject *vm;

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", want);
    vms = list_vms(f);
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    vm = pf_test_find_vm_pid(vms, pid);
    g_assert_nonnull(vm);
    g_assert_cmpstr(json_object_get_string_member(vm, "name"), ==, "web1");
    /* The guest has no -uuid: this one is the XML's, by the hook. */
    g_assert_cmpstr(json_object_get_string_member(vm, "uuid"), ==, UUID_CANON);
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");

    /* Again, and as libvirtd does when it restarts: attached already is
     * fine, and nothing changes. */
    for (guint i = 0; i < 2; i++) {
        const char *op = i == 0 ? "started" : "reconnect";
        g_autofree char *again = g_strdup_printf(
            "web1 %s begin: pid %d is attached already, as VM 'web1' (uuid " UUID_CANON
            ") in mode advise", op, pid);

        hook(f, &r, xml, "web1", op, "begin", "-", NULL);
        assert_said(f, &r, "web1", again);
        g_assert_cmpuint(n_attached(f), ==, 1);
    }
}

/* Its agent (here: pagefoldctl) was first: the hook says so and leaves
 * the VM as it is. */
static void
test_started_attached_already(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *pidarg = g_strdup_printf("%d", pid);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *want = g_strdup_printf("pid %d is attached already, as VM 'other' "
                                            "(uuid none) in mode advise", pid);
    g_autoptr(JsonNode) a = pf_test_ctl_json(f->d, "attach", pidarg, "--name", "other", NULL);
    g_autoptr(JsonArray) vms = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "attach", "begin", "-", NULL);
    assert_said(f, &r, "web1", want);
    vms = list_vms(f);
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpstr(json_object_get_string_member(pf_test_find_vm_pid(vms, pid), "name"), ==, "other");
}

#define TENANT(d) "<metadata><pagefold:config xmlns:pagefold='urn:pagefold:domain:1' " \
                  "merge-domain='" d "'/></metadata>"

static const char *
merge_domain_of(Fixture *f, int pid)
{
    static char buf[256];
    g_autoptr(JsonArray) vms = list_vms(f);
    JsonObject *vm = pf_test_find_vm_pid(vms, pid);

    g_assert_nonnull(vm);
    g_strlcpy(buf, json_object_get_string_member(vm, "merge_domain"), sizeof(buf));
    return buf;
}

/*
 * The XML's merge domain: the hook attaches the VM into it; a VM its
 * agent attached first (in the default one) is moved into it; one that
 * shares pages there already is detached rather than left sharing across
 * the boundary.
 */
static void
test_started_merge_domain(Fixture *f, gconstpointer data)
{
    int pid1 = start_guest(f, "web1", NULL);
    int pid2 = start_guest(f, "web2", NULL);
    int pid3 = start_guest(f, "web3", NULL);
    g_autofree char *arg2 = g_strdup_printf("%d", pid2);
    g_autofree char *arg3 = g_strdup_printf("%d", pid3);
    g_autofree char *xml1 = domain_xml("web1", UUID_GIVEN, TENANT("tenant-a") MEMFD_SHARED);
    g_autofree char *xml2 = domain_xml("web2", "00000000-0000-0000-0000-000000000002",
                                       TENANT("tenant-b") MEMFD_SHARED);
    g_autofree char *xml3 = domain_xml("web3", "00000000-0000-0000-0000-000000000003",
                                       TENANT("tenant-b") MEMFD_SHARED);
    g_autofree char *moved = g_strdup_printf("web2 started begin: pid %d moved from merge domain "
                                             "'default' to 'tenant-b'", pid2);
    g_autofree char *refused = g_strdup_printf("web3 started begin: pagefoldd did not put pid %d "
                                               "in merge domain 'tenant-b': VM web3 (pid %d) "
                                               "shares", pid3, pid3);
    g_autofree char *detached = g_strdup_printf("detached pid %d rather than let it share pages "
                                                "outside merge domain 'tenant-b'", pid3);
    g_autoptr(JsonNode) a2 = NULL;
    g_autoptr(JsonNode) scan = NULL;
    g_autoptr(JsonArray) vms = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid1);
    hook(f, &r, xml1, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "(uuid " UUID_CANON ", merge domain tenant-a) in mode advise");
    g_assert_cmpstr(merge_domain_of(f, pid1), ==, "tenant-a");

    /* Attached first, sharing nothing yet: moved. */
    a2 = pf_test_ctl_json(f->d, "attach", arg2, NULL);
    g_assert_cmpstr(merge_domain_of(f, pid2), ==, "default");
    write_pid(f, "web2", pid2);
    hook(f, &r, xml2, "web2", "started", "begin", "-", NULL);
    assert_said(f, &r, "web2", moved);
    g_assert_cmpstr(merge_domain_of(f, pid2), ==, "tenant-b");
    /* Said again (libvirtd restarted): in it already, nothing to do. */
    hook(f, &r, xml2, "web2", "reconnect", "begin", "-", NULL);
    g_assert_null(strstr(r.err, "moved"));
    g_assert_cmpstr(merge_domain_of(f, pid2), ==, "tenant-b");

    /* Attached first and sharing pages in the default domain by now
     * (with web3's twin below): refused, so detached. */
    {
        g_autoptr(JsonNode) a3 = pf_test_ctl_json(f->d, "attach", arg3, NULL);
        int twin = start_guest(f, "twin", NULL);
        g_autofree char *argt = g_strdup_printf("%d", twin);
        g_autoptr(JsonNode) at = pf_test_ctl_json(f->d, "attach", argt, NULL);

        scan = pf_test_ctl_json(f->d, "scan-now", "2", NULL);
    }
    write_pid(f, "web3", pid3);
    hook(f, &r, xml3, "web3", "started", "begin", "-", NULL);
    assert_said(f, &r, "web3", refused);
    assert_said(f, &r, "web3", detached);
    vms = list_vms(f);
    g_assert_null(pf_test_find_vm_pid(vms, pid3));
    g_assert_cmpuint(json_array_get_length(vms), ==, 3);
}

/* ---- stopped, release ---- */

static void
test_stopped_detaches(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *pidarg = g_strdup_printf("%d", pid);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autoptr(JsonNode) scan = NULL;
    g_autoptr(JsonNode) stats = NULL;
    g_autofree char *want = NULL;
    g_auto(Run) r = { 0 };
    JsonObject *vm;

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_assert_cmpuint(n_attached(f), ==, 1);
    /* Figures to report: run=0, so they stay as two passes left them. */
    scan = pf_test_ctl_json(f->d, "scan-now", "2", NULL);
    stats = pf_test_ctl_json(f->d, "stats", pidarg, NULL);
    vm = json_array_get_object_element(
        json_object_get_array_member(json_node_get_object(stats), "vms"), 0);
    g_assert_cmpint(json_object_get_int_member(vm, "zero_pages"), >, 0);
    want = g_strdup_printf("web1 stopped end: detached VM 'web1' (pid %d); final figures: "
                           "pages_shared=%" G_GINT64_FORMAT " pages_sharing=%" G_GINT64_FORMAT
                           " zero_pages=%" G_GINT64_FORMAT " cow=%" G_GINT64_FORMAT
                           " mode=advise", pid,
                           json_object_get_int_member(vm, "pages_shared"),
                           json_object_get_int_member(vm, "pages_sharing"),
                           json_object_get_int_member(vm, "zero_pages"),
                           json_object_get_int_member(vm, "cow"));

    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1", want);
    g_assert_cmpuint(n_attached(f), ==, 0);

    /* release comes after libvirt removed the pid file. */
    remove_pid(f, "web1");
    hook(f, &r, xml, "web1", "release", "end", "-", NULL);
    assert_said(f, &r, "web1", "web1 release end: not attached (detached at stopped");
}

/* QEMU exited before stopped (as it does): pagefoldd dropped it. */
static void
test_stopped_exited(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    GSubprocess *g;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_assert_cmpuint(n_attached(f), ==, 1);
    g = g_ptr_array_index(f->guests, 0);
    g_subprocess_force_exit(g);
    g_subprocess_wait(g, NULL, NULL);
    for (int i = 0; i < 1000 && n_attached(f) > 0; i++) {
        g_usleep(10000);
    }
    g_assert_cmpuint(n_attached(f), ==, 0);
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1",
                "web1 stopped end: not attached: pagefoldd already dropped it (QEMU exited)");
}

/* A pid file names a pid that is attached as another VM (a stale pid
 * file, the pid reused): the hook leaves that VM alone. */
static void
test_stopped_other_uuid(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", "00112233-4455-6677-8899-aabbccddeeff");
    g_autofree char *pidarg = g_strdup_printf("%d", pid);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *want = g_strdup_printf("pid %d is attached as another VM ('web1', uuid "
                                            "00112233-4455-6677-8899-aabbccddeeff): left alone",
                                            pid);
    g_autoptr(JsonNode) a = pf_test_ctl_json(f->d, "attach", pidarg, NULL);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1", want);
    g_assert_cmpuint(n_attached(f), ==, 1);
}

/* ---- domains that are not pagefold's ---- */

static void
test_not_memfd(Fixture *f, gconstpointer data)
{
    static const char *const memories[] = {
        "", /* anonymous private RAM, libvirt's default */
        "<memoryBacking><source type='memfd'/></memoryBacking>",
        "<memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>",
    };
    int pid = start_guest(f, "web1", NULL);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(memories); i++) {
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, memories[i]);
        g_autofree char *before = NULL;
        g_autofree char *after = NULL;

        hook(f, &r, xml, "web1", "prepare", "begin", "-", NULL);
        assert_said(f, &r, "web1", "not pagefold's; kernel KSM is what merges private RAM");
        before = domain_log(f, "web1");
        for (guint k = 0; k < 3; k++) {
            static const char *const ops[][2] = {
                { "start", "begin" }, { "started", "begin" }, { "stopped", "end" }
            };

            hook(f, &r, xml, "web1", ops[k][0], ops[k][1], "-", NULL);
            g_assert_cmpuint(n_attached(f), ==, 0);
        }
        /* Said once, at prepare. */
        after = domain_log(f, "web1");
        g_assert_cmpstr(before, ==, after);
        hook(f, &r, xml, "web1", "reconnect", "begin", "-", NULL);
        assert_said(f, &r, "web1", "web1 reconnect begin: RAM not shared memfd");
        g_assert_cmpuint(n_attached(f), ==, 0);
    }
}

/* RAM shared through its NUMA cells is pagefold's too. */
static void
test_numa_shared(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml(
        "web1", UUID_GIVEN,
        "<memoryBacking><source type='memfd'/></memoryBacking>\n"
        "<cpu><numa><cell id='0' cpus='0' memory='16384' unit='KiB' memAccess='shared'/>"
        "</numa></cpu>");
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "attached pid");
    g_assert_cmpuint(n_attached(f), ==, 1);
}

static void
test_nosharepages(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml(
        "web1", UUID_GIVEN,
        "<memoryBacking><nosharepages/><source type='memfd'/><access mode='shared'/>"
        "</memoryBacking>");
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", "pagefoldd answers on");
    /* Not read either, as kernel KSM never scans it: a QEMU without the
     * agent (the stand-in) is not attached. */
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "<nosharepages/>: never merged; not attached");
    g_assert_cmpuint(n_attached(f), ==, 0);
}

/* ---- what libvirt would never pass, or not yet ---- */

static void
test_bad_argv(Fixture *f, gconstpointer data)
{
    const char *const none[] = { NULL };
    const char *const three[] = { "web1", "started", "begin", NULL };
    const char *const five[] = { "web1", "started", "begin", "-", "more", NULL };
    const char *const unknown[] = { "--frob", "x", "web1", "started", "begin", "-", NULL };
    const char *const no_value[] = { "--socket", "web1", "started", "begin", "-", NULL };
    const struct {
        const char *const *argv;
        const char *want;
    } cases[] = {
        { none, "0 argument(s) where libvirt passes 4" },
        { three, "3 argument(s) where libvirt passes 4" },
        { five, "unexpected argument 'web1'" },
        { unknown, "unknown option '--frob'" },
        { no_value, "option '--socket' wants a value" },
    };
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *log = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        run_argv(cases[i].argv, xml, NULL, &r);
        g_assert_nonnull(strstr(r.err, cases[i].want));
        g_assert_nonnull(strstr(r.err, "nothing done"));
        g_assert_nonnull(strstr(r.err, "usage: pagefold-libvirt-hook"));
        g_assert_cmpuint(n_attached(f), ==, 0);
    }
    /* A name that cannot be a file name makes no path. */
    hook(f, &r, xml, "../web1", "started", "begin", "-", NULL);
    g_assert_nonnull(strstr(r.err, "domain name '../web1' cannot name a file: nothing done"));
    g_assert_cmpuint(n_attached(f), ==, 0);
    log = domain_log(f, "web1");
    g_assert_cmpstr(log, ==, "");
}

static void
test_bad_xml(Fixture *f, gconstpointer data)
{
    g_autofree char *good = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *truncated = g_strndup(good, strlen(good) - 4);
    g_autofree char *other_name = domain_xml("web2", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *no_uuid = domain_xml("web1", NULL, MEMFD_SHARED);
    g_autofree char *bad_uuid = domain_xml("web1", "6F9619FF-8B86-D011-B42D", MEMFD_SHARED);
    g_autofree char *two_names = domain_xml("web1", UUID_GIVEN,
                                            "<name>web1</name>" MEMFD_SHARED);
    g_autofree char *undeclared = domain_xml("web1", UUID_GIVEN,
                                             "<metadata><pf:config merge-domain='a'/></metadata>"
                                             MEMFD_SHARED);
    g_autofree char *huge = NULL;
    g_autoptr(GString) big = g_string_new("<domain><!-- ");
    const struct {
        const char *xml;
        const char *want;
    } cases[] = {
        { "", "malformed domain XML" },
        { truncated, "malformed domain XML" },
        { "<domain><name>web1</name><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED "</domian>",
          "malformed domain XML" },
        { "<!DOCTYPE domain [<!ENTITY e SYSTEM 'file:///etc/passwd'>]>"
          "<domain><name>&e;</name><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED "</domain>",
          "malformed domain XML" },
        { "<network><name>web1</name><uuid>" UUID_GIVEN "</uuid></network>",
          "the root element is <network>, not libvirt's <domain>" },
        { "<domain xmlns='urn:elsewhere'><name>web1</name><uuid>" UUID_GIVEN "</uuid>"
          MEMFD_SHARED "</domain>",
          "the root element is <domain> of namespace urn:elsewhere, not libvirt's <domain>" },
        { "<domain><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED "</domain>",
          "the domain XML has no <name>" },
        { other_name, "the domain XML is of 'web2', not of 'web1'" },
        { no_uuid, "the domain XML has no <uuid>" },
        { bad_uuid, "<uuid> '6F9619FF-8B86-D011-B42D' is not a UUID" },
        { two_names, "more than one <name>" },
        { undeclared, "namespace prefix 'pf' of <pf:config> is not declared" },
        { NULL, "the domain XML is larger than 16 MiB" },
    };
    int pid = start_guest(f, "web1", NULL);
    g_auto(Run) r = { 0 };

    while (big->len <= (16u << 20)) {
        g_string_append(big, "padding padding padding padding padding padding padding\n");
    }
    g_string_append(big, " --><name>web1</name><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED
                         "</domain>");
    huge = g_string_free(g_steal_pointer(&big), FALSE);
    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        g_autofree char *want = g_strdup_printf("%s", cases[i].want);

        hook(f, &r, cases[i].xml ? cases[i].xml : huge, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
        assert_said(f, &r, "web1", ": nothing done");
        g_assert_cmpuint(n_attached(f), ==, 0);
    }
    /* And the good one does attach. */
    hook(f, &r, good, "web1", "started", "begin", "-", NULL);
    g_assert_cmpuint(n_attached(f), ==, 1);
}

static void
test_unknown_op(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "frobnicate", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 frobnicate begin: nothing to do for operation "
                               "'frobnicate begin'");
    hook(f, &r, xml, "web1", "started", "end", "-", NULL);
    assert_said(f, &r, "web1", "nothing to do for operation 'started end'");
    hook(f, &r, "not even XML", "web1", "define", "-", "-", NULL);
    assert_said(f, &r, "web1", "nothing to do for operation 'define -'");
    g_assert_cmpuint(n_attached(f), ==, 0);
}

/* migrate, restore (and save, should libvirt call it): libvirt reads
 * stdout as the XML to go on with, empty meaning unchanged. */
static void
test_filters(Fixture *f, gconstpointer data)
{
    static const char *const ops[] = { "migrate", "restore", "save" };
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(ops); i++) {
        g_autofree char *want = g_strdup_printf("web1 %s begin: domain XML passed through "
                                                "unchanged", ops[i]);

        /* run_argv() asserts the empty stdout. */
        hook(f, &r, xml, "web1", ops[i], "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
        hook(f, &r, "<domain", "web1", ops[i], "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
    }
    g_assert_cmpuint(n_attached(f), ==, 0);
}

/* ---- prepare: pagefoldd runs ---- */

static gboolean
pagefoldd_knows_agent_group(void)
{
    const char *argv[] = { pf_test_bin("PAGEFOLDD"), "--help", NULL };
    g_autofree char *out = NULL;

    g_assert_true(g_spawn_sync(NULL, (char **)argv, NULL, G_SPAWN_STDERR_TO_DEV_NULL, NULL, NULL,
                               &out, NULL, NULL, NULL));
    return strstr(out, "--agent-group") != NULL;
}

/* The pid in "started pagefoldd (pid N)". */
static int
started_pid(const Run *r)
{
    const char *p = strstr(r->err, "started pagefoldd (pid ");

    g_assert_nonnull(p);
    return atoi(p + strlen("started pagefoldd (pid "));
}

static void
test_prepare_starts_pagefoldd(Fixture *f, gconstpointer data)
{
    g_autofree char *agent_sock = g_build_filename(f->dir, "agent.sock", NULL);
    g_autofree char *agent_arg = g_strconcat("--pagefoldd-arg=", agent_sock, NULL);
    g_autofree char *pflog = g_build_filename(f->dir, "pagefold", "pagefoldd.log", NULL);
    g_autofree char *pfdir = g_path_get_dirname(pflog);
    /* Not the host's configuration file. */
    g_autofree char *config = g_build_filename(f->dir, "pagefoldd.conf", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *answers = g_strdup_printf("web1 prepare begin: pagefoldd answers on %s",
                                               f->sock);
    g_autofree char *text = NULL;
    g_autofree char *header = g_strdup_printf("pagefold-hook: for domain web1: %s --socket %s",
                                              pf_test_bin("PAGEFOLDD"), f->sock);
    /* Until pagefoldd has --agent-group, the hook is told to pass none. */
    const char *group = pagefoldd_knows_agent_group() ? "libvirt-qemu" : "";
    PfTestDaemon d = { .sock = f->sock };
    g_autoptr(JsonNode) list = NULL;
    g_auto(Run) r = { 0 };
    struct stat st;
    int listener = 0;

    g_assert_true(g_file_set_contents(config, "", 0, NULL));
    hook(f, &r, xml, "--pagefoldd", pf_test_bin("PAGEFOLDD"), "--pagefoldd-arg",
         "--agent-socket", agent_arg, "--pagefoldd-arg", "--config", "--pagefoldd-arg", config,
         "--pagefoldd-arg", "--set", "--pagefoldd-arg", "run=0",
         "--pagefoldd-arg", "--set", "--pagefoldd-arg", "libvirt_metadata_millisecs=0",
         "--pagefoldd-log", pflog, "--agent-group", group, "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 prepare begin: pagefoldd does not answer (");
    assert_said(f, &r, "web1", "started pagefoldd (pid ");
    f->spawned = started_pid(&r);
    /* It answers (by the hook's deadline or a little after: its own
     * log said which). */
    for (int i = 0; i < 1000 && ((listener = pf_test_listener_pid(f->sock)) == 0 ||
                                 !g_file_test(agent_sock, G_FILE_TEST_EXISTS)); i++) {
        g_usleep(10000);
    }
    g_assert_cmpint(listener, ==, f->spawned);
    {
        /* What the unit would take away that a process can: every
         * capability but CHOWN, DAC_READ_SEARCH, SYS_PTRACE and
         * SYS_ADMIN, and new privileges. */
        g_autofree char *status_path = g_strdup_printf("/proc/%d/status", f->spawned);
        g_autofree char *status = NULL;

        g_assert_true(g_file_get_contents(status_path, &status, NULL, NULL));
        g_assert_nonnull(strstr(status, "\nNoNewPrivs:\t1\n"));
        g_assert_nonnull(strstr(status, "\nCapBnd:\t0000000000280005\n"));
        g_assert_nonnull(strstr(status, "\nCapPrm:\t0000000000280005\n"));
        g_assert_nonnull(strstr(status, "\nCapEff:\t0000000000280005\n"));
        g_assert_nonnull(strstr(status, "\nCapInh:\t0000000000000000\n"));
        g_assert_nonnull(strstr(status, "\nCapAmb:\t0000000000000000\n"));
    }
    list = pf_test_ctl_json(&d, "list", NULL);
    g_assert_cmpuint(json_array_get_length(json_node_get_array(list)), ==, 0);
    g_assert_true(g_file_test(agent_sock, G_FILE_TEST_EXISTS));
    /* Its log: made with its folder, 0750, headed by the hook. */
    g_assert_cmpint(stat(pfdir, &st), ==, 0);
    g_assert_cmpint(st.st_mode & 07777, ==, 0750);
    g_assert_true(g_file_get_contents(pflog, &text, NULL, NULL));
    g_assert_nonnull(strstr(text, header));

    /* Running: nothing more to do. */
    hook(f, &r, xml, "--pagefoldd", pf_test_bin("PAGEFOLDD"), "--pagefoldd-log", pflog,
         "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", answers);
    g_assert_null(strstr(r.err, "started pagefoldd"));
    g_assert_cmpint(pf_test_listener_pid(f->sock), ==, f->spawned);
    kill_and_wait(f->spawned);
    f->spawned = 0;
}

/*
 * The pagefoldd the hook starts is this program (HOOK_TEST_RECORD): it
 * writes down how it was started.  Detached: stdin /dev/null, stdout and
 * stderr the pagefoldd log, nothing else of the hook's (libvirtd reads
 * the hook's pipes to EOF), a session of its own that it does not lead.
 */
static void
test_prepare_detached(Fixture *f, gconstpointer data)
{
    g_autofree char *exe = g_file_read_link("/proc/self/exe", NULL);
    g_autofree char *rec = g_build_filename(f->dir, "record", NULL);
    g_autofree char *pflog = g_build_filename(f->dir, "pagefoldd.log", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *text = NULL;
    g_autofree char *logtext = NULL;
    g_autofree char *no_answer = g_strdup_printf("pagefoldd does not answer on %s yet", f->sock);
    g_autoptr(GPtrArray) want_args = g_ptr_array_new();
    g_autoptr(GPtrArray) args = g_ptr_array_new_with_free_func(g_free);
    g_auto(GStrv) lines = NULL;
    const char *hook_args[] = {
        "--socket", f->sock, "--run-dir", f->run_dir, "--log-dir", f->log_dir,
        "--pagefoldd", exe, "--pagefoldd-arg", "--agent-socket", "--pagefoldd-arg",
        "/nonexistent/agent.sock", "--pagefoldd-log", pflog,
        "web1", "prepare", "begin", "-", NULL
    };
    g_auto(Run) r = { 0 };
    guint n_fds = 0;
    int pid = 0, sid = 0;

    run_argv(hook_args, xml, rec, &r);
    assert_said(f, &r, "web1", "started pagefoldd (pid ");
    assert_said(f, &r, "web1", no_answer);
    for (int i = 0; i < 1000 && !g_file_test(rec, G_FILE_TEST_EXISTS); i++) {
        g_usleep(10000);
    }
    g_assert_true(g_file_get_contents(rec, &text, NULL, NULL));
    lines = g_strsplit(text, "\n", -1);
    for (char **l = lines; *l; l++) {
        int fd;
        char target[4096];

        if (g_str_has_prefix(*l, "arg ")) {
            g_ptr_array_add(args, g_strdup(*l + 4));
        } else if (sscanf(*l, "fd %d %4095s", &fd, target) == 2) {
            n_fds++;
            if (fd == 0) {
                g_assert_cmpstr(target, ==, "/dev/null");
            } else if (fd == 1 || fd == 2) {
                g_assert_cmpstr(target, ==, pflog);
            } else {
                g_error("the started pagefoldd has fd %d (%s) of the hook's", fd, target);
            }
        } else if (g_str_has_prefix(*l, "pid ")) {
            pid = atoi(*l + 4);
        } else if (g_str_has_prefix(*l, "sid ")) {
            sid = atoi(*l + 4);
        }
    }
    g_assert_cmpuint(n_fds, ==, 3);
    g_assert_cmpint(pid, ==, started_pid(&r));
    g_assert_cmpint(sid, !=, getsid(0));
    g_assert_cmpint(sid, !=, pid);
    g_assert_cmpint(sid, >, 0);

    g_ptr_array_add(want_args, (char *)"--socket");
    g_ptr_array_add(want_args, f->sock);
    if (getgrnam("libvirt-qemu") != NULL) {
        g_ptr_array_add(want_args, (char *)"--agent-group");
        g_ptr_array_add(want_args, (char *)"libvirt-qemu");
    }
    g_ptr_array_add(want_args, (char *)"--agent-socket");
    g_ptr_array_add(want_args, (char *)"/nonexistent/agent.sock");
    g_assert_cmpuint(args->len, ==, want_args->len);
    for (guint i = 0; i < args->len; i++) {
        g_assert_cmpstr(g_ptr_array_index(args, i), ==, g_ptr_array_index(want_args, i));
    }
    /* What it printed went to the log, not to the hook's stdout. */
    for (int i = 0; i < 1000; i++) {
        g_clear_pointer(&logtext, g_free);
        g_assert_true(g_file_get_contents(pflog, &logtext, NULL, NULL));
        if (strstr(logtext, "recording pagefoldd was here") != NULL) {
            break;
        }
        g_usleep(10000);
    }
    g_assert_nonnull(strstr(logtext, "recording pagefoldd was here"));
    g_assert_nonnull(strstr(logtext, "pagefold-hook: for domain web1: "));
}

/* Run as the hook's pagefoldd: writes down argv, open descriptors, pid
 * and session, then says hello on stdout. */
static int
record_start(const char *path, int argc, char **argv)
{
    g_autoptr(GString) s = g_string_new(NULL);
    g_autofree char *tmp = g_strconcat(path, ".tmp", NULL);
    g_autoptr(GDir) dir = g_dir_open("/proc/self/fd", 0, NULL);
    const char *e;

    for (int i = 1; i < argc; i++) {
        g_string_append_printf(s, "arg %s\n", argv[i]);
    }
    /* GDir's own descriptor reads as the folder itself. */
    while (dir != NULL && (e = g_dir_read_name(dir)) != NULL) {
        g_autofree char *link = g_build_filename("/proc/self/fd", e, NULL);
        g_autofree char *target = g_file_read_link(link, NULL);

        if (target != NULL && !g_str_has_prefix(target, "/proc/")) {
            g_string_append_printf(s, "fd %s %s\n", e, target);
        }
    }
    g_string_append_printf(s, "pid %d\nsid %d\n", (int)getpid(), (int)getsid(0));
    if (!g_file_set_contents(tmp, s->str, -1, NULL) || rename(tmp, path) < 0) {
        return 1;
    }
    printf("the recording pagefoldd was here\n");
    return 0;
}

/* ---- the requests, with a stand-in pagefoldd ---- */

#define ATTACHED_REPLY "{\"return\": {\"name\": \"web1\", \"pid\": %d, \"uuid\": \"" UUID_CANON \
                       "\", \"mode\": \"advise\", \"pages\": 4096, \"regions\": [{}]}}"

static void
test_attach_requests(Fixture *f, gconstpointer data)
{
    static const struct {
        const char *metadata;
        const char *merge_domain;
    } cases[] = {
        { "", NULL },
        { "<metadata><tenancy:config xmlns:tenancy='urn:pagefold:domain:1' "
          "merge-domain='tenant-a'/></metadata>", "tenant-a" },
        { "<metadata xmlns:pf='urn:pagefold:domain:1'><pf:config merge-domain='tenant b'/>"
          "</metadata>", "tenant b" },
        { "<metadata><config xmlns='urn:pagefold:domain:1' merge-domain='c&amp;d'/></metadata>",
          "c&d" },
        /* Other namespaces' elements are not pagefold's. */
        { "<metadata><app:config xmlns:app='urn:example:other' merge-domain='x'/>"
          "<libosinfo:libosinfo xmlns:libosinfo='http://libosinfo.org/xmlns/libvirt/domain/1.0'>"
          "<libosinfo:os id='http://debian.org/debian/12'/></libosinfo:libosinfo></metadata>",
          NULL },
        /* The innermost declaration of a prefix counts. */
        { "<metadata xmlns:pf='urn:pagefold:domain:1'><pf:config xmlns:pf='urn:other' "
          "merge-domain='x'/></metadata>", NULL },
        /* Not in <metadata>: not libvirt's place for it. */
        { "<devices><pf:config xmlns:pf='urn:pagefold:domain:1' merge-domain='x'/></devices>",
          NULL },
    };
    g_autoptr(Fake) fk = fake_start(f);
    int pid = getpid(); /* the stand-in pagefoldd does not look */
    g_autofree char *reply = g_strdup_printf(ATTACHED_REPLY, pid);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    fake_reply(fk, "attach", reply);
    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        g_autofree char *more = g_strconcat(cases[i].metadata, MEMFD_SHARED, NULL);
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, more);
        g_autofree char *want = g_strdup_printf(
            "attached pid %d as VM 'web1' (uuid " UUID_CANON "%s%s) in mode advise: 1 region(s), "
            "16.0 MiB", pid, cases[i].merge_domain ? ", merge domain " : "",
            cases[i].merge_domain ? cases[i].merge_domain : "");
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 1);
        assert_attach_request(g_ptr_array_index(reqs, 0), pid, "web1", UUID_CANON,
                              cases[i].merge_domain);
    }
    /* reconnect and attach ask the same. */
    for (guint i = 0; i < 2; i++) {
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", i ? "attach" : "reconnect", "begin", "-", NULL);
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 1);
        assert_attach_request(g_ptr_array_index(reqs, 0), pid, "web1", UUID_CANON, NULL);
    }
    /* A merge domain not understood: better no merging than merging with
     * VMs it must not share with. */
    for (guint i = 0; i < 3; i++) {
        static const char *const bad[] = {
            "<metadata><pf:config xmlns:pf='urn:pagefold:domain:1'/></metadata>",
            "<metadata><pf:config xmlns:pf='urn:pagefold:domain:1' merge-domain=''/></metadata>",
            "<metadata><pf:config xmlns:pf='urn:pagefold:domain:1' merge-domain='a&#10;b'/>"
            "</metadata>",
        };
        g_autofree char *more = g_strconcat(bad[i], MEMFD_SHARED, NULL);
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, more);
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", "wants merge-domain=\"NAME\"");
        assert_said(f, &r, "web1", "not attaching it");
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 0);
    }
    /* Two configs: malformed. */
    {
        g_autofree char *xml = domain_xml(
            "web1", UUID_GIVEN,
            "<metadata xmlns:pf='urn:pagefold:domain:1'><pf:config merge-domain='a'/>"
            "<pf:config merge-domain='b'/></metadata>" MEMFD_SHARED);
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", "more than one <config> of namespace urn:pagefold:domain:1");
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 0);
    }
}

static JsonObject *
parse_request(GPtrArray *reqs, guint i, const char *execute)
{
    g_autoptr(JsonParser) p = json_parser_new();
    JsonObject *o;

    g_assert_cmpuint(i, <, reqs->len);
    g_assert_true(json_parser_load_from_data(p, g_ptr_array_index(reqs, i), -1, NULL));
    o = json_node_get_object(json_parser_get_root(p));
    g_assert_cmpstr(json_object_get_string_member(o, "execute"), ==, execute);
    return json_object_ref(o);
}

/* What pagefoldd answers, refusals and silence included. */
static void
test_answers(Fixture *f, gconstpointer data)
{
    g_autoptr(Fake) fk = fake_start(f);
    int pid = getpid();
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *no_ram = g_strdup_printf(
        "{\"error\": {\"class\": \"GenericError\", \"desc\": \"process %d has no guest RAM "
        "pagefold can scan\"}}", pid);
    g_autofree char *exists = g_strdup_printf(
        "{\"error\": {\"class\": \"GenericError\", \"desc\": \"process %d is already attached "
        "as VM 'agent-named'\"}}", pid);
    g_autofree char *listed = g_strdup_printf(
        "{\"return\": [{\"name\": \"agent-named\", \"pid\": %d, \"uuid\": \"" UUID_CANON "\", "
        "\"mode\": \"merge\", \"pages\": 4096, \"regions\": []}]}", pid);
    g_autofree char *stats = g_strdup_printf(
        "{\"return\": {\"mode\": \"merge\", \"vms\": [{\"name\": \"agent-named\", \"pid\": %d, "
        "\"uuid\": \"" UUID_CANON "\", \"mode\": \"merge\", \"pages_shared\": 5, "
        "\"pages_sharing\": 7, \"zero_pages\": 3, \"cow\": 1}]}}", pid);
    g_autofree char *pidkey = g_strdup_printf("%d", pid);
    g_autofree char *want = NULL;
    g_autoptr(GPtrArray) reqs = NULL;
    g_autoptr(JsonObject) req = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    /* Refused, not attached. */
    fake_reply(fk, "attach", no_ram);
    fake_reply(fk, "list", "{\"return\": []}");
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    want = g_strdup_printf("pagefoldd did not attach pid %d: process %d has no guest RAM "
                           "pagefold can scan", pid, pid);
    assert_said(f, &r, "web1", want);
    reqs = fake_take(fk);
    g_assert_cmpuint(reqs->len, ==, 2);
    req = parse_request(reqs, 1, "list");
    /* Refused because attached already (by its agent). */
    fake_reply(fk, "attach", exists);
    fake_reply(fk, "list", listed);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_free(want);
    want = g_strdup_printf("pid %d is attached already, as VM 'agent-named' (uuid " UUID_CANON
                           ") in mode merge", pid);
    assert_said(f, &r, "web1", want);

    /* stopped: list, stats and detach by pid, the figures said. */
    fake_reply(fk, "stats", stats);
    fake_reply(fk, "detach", "{\"return\": {}}");
    g_ptr_array_unref(fake_take(fk));
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    g_free(want);
    want = g_strdup_printf("detached VM 'agent-named' (pid %d); final figures: pages_shared=5 "
                           "pages_sharing=7 zero_pages=3 cow=1 mode=merge", pid);
    assert_said(f, &r, "web1", want);
    g_clear_pointer(&reqs, g_ptr_array_unref);
    reqs = fake_take(fk);
    g_assert_cmpuint(reqs->len, ==, 3);
    g_clear_pointer(&req, json_object_unref);
    req = parse_request(reqs, 1, "stats");
    g_assert_cmpstr(json_object_get_string_member(json_object_get_object_member(req, "arguments"),
                                                  "vm"), ==, pidkey);
    g_clear_pointer(&req, json_object_unref);
    req = parse_request(reqs, 2, "detach");
    g_assert_cmpstr(json_object_get_string_member(json_object_get_object_member(req, "arguments"),
                                                  "vm"), ==, pidkey);
    /* Gone between stats and detach. */
    fake_reply(fk, "detach", "{\"error\": {\"class\": \"DeviceNotFound\", \"desc\": \"no VM of "
                             "pid\"}}");
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    g_free(want);
    want = g_strdup_printf("detach of pid %d: no VM of pid; last figures: pages_shared=5", pid);
    assert_said(f, &r, "web1", want);
    /* release: no pid file; by UUID. */
    remove_pid(f, "web1");
    fake_reply(fk, "detach", "{\"return\": {}}");
    hook(f, &r, xml, "web1", "release", "end", "-", NULL);
    g_free(want);
    want = g_strdup_printf("web1 release end: detached VM 'agent-named' (pid %d)", pid);
    assert_said(f, &r, "web1", want);
    write_pid(f, "web1", pid);

    /* prepare: it answers; or it is there and does not. */
    fake_reply(fk, "qmp_capabilities", "{\"return\": {}}");
    hook(f, &r, xml, "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 prepare begin: pagefoldd answers on");
    fake_reply(fk, "qmp_capabilities", "");
    hook(f, &r, xml, "web1", "start", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 start begin: pagefoldd is there but did not answer "
                               "(pagefoldd did not answer within");
    assert_said(f, &r, "web1", "not starting another");
    /* A pagefoldd that never answers costs a bounded wait, and the VM
     * runs on. */
    fake_reply(fk, "attach", "");
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_free(want);
    want = g_strdup_printf("cannot attach pid %d: pagefoldd did not answer within", pid);
    assert_said(f, &r, "web1", want);
    assert_said(f, &r, "web1", "the VM runs unmerged");
    fake_reply(fk, "list", "");
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1", "web1 stopped end: cannot ask pagefoldd (pagefoldd did not answer "
                               "within");
}

int
main(int argc, char **argv)
{
    if (g_getenv("HOOK_TEST_RECORD") != NULL) {
        return record_start(g_getenv("HOOK_TEST_RECORD"), argc, argv);
    }
    signal(SIGPIPE, SIG_IGN);
    g_test_init(&argc, &argv, NULL);
    g_test_add("/hook/started/attaches", Fixture, NULL, setup, test_started_attaches, teardown);
    g_test_add("/hook/started/status-file", Fixture, NULL, setup, test_started_status_file,
               teardown);
    g_test_add("/hook/started/attached-already", Fixture, NULL, setup,
               test_started_attached_already, teardown);
    g_test_add("/hook/started/merge-domain", Fixture, NULL, setup, test_started_merge_domain,
               teardown);
    g_test_add("/hook/stopped/detaches", Fixture, NULL, setup, test_stopped_detaches, teardown);
    g_test_add("/hook/stopped/exited", Fixture, NULL, setup, test_stopped_exited, teardown);
    g_test_add("/hook/stopped/other-uuid", Fixture, NULL, setup, test_stopped_other_uuid,
               teardown);
    g_test_add("/hook/not-memfd", Fixture, NULL, setup, test_not_memfd, teardown);
    g_test_add("/hook/numa-shared", Fixture, NULL, setup, test_numa_shared, teardown);
    g_test_add("/hook/nosharepages", Fixture, NULL, setup, test_nosharepages, teardown);
    g_test_add("/hook/bad-argv", Fixture, NULL, setup, test_bad_argv, teardown);
    g_test_add("/hook/bad-xml", Fixture, NULL, setup, test_bad_xml, teardown);
    g_test_add("/hook/unknown-op", Fixture, NULL, setup, test_unknown_op, teardown);
    g_test_add("/hook/filters", Fixture, NULL, setup, test_filters, teardown);
    g_test_add("/hook/prepare/starts-pagefoldd", Fixture, NULL, setup_bare,
               test_prepare_starts_pagefoldd, teardown);
    g_test_add("/hook/prepare/detached", Fixture, NULL, setup_bare, test_prepare_detached,
               teardown);
    g_test_add("/hook/requests/attach", Fixture, NULL, setup_bare, test_attach_requests,
               teardown);
    g_test_add("/hook/requests/answers", Fixture, NULL, setup_bare, test_answers, teardown);
    return g_test_run();
}
