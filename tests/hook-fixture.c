/*
 * hook-fixture.c - what the hook tests (hook-test, hook-pagefoldd-test)
 * share (hook-fixture.h): the libvirt qemu hook (libvirt-hooks/hook.c)
 * run as libvirtd runs it, NAME OP SUBOP EXTRA with the domain XML on
 * stdin, and the fixture it runs in: a folder with libvirt's run and log
 * folders, stand-in QEMUs (standin-guest) with their status and pid
 * files, and pagefoldd on sockets of the test's own where a path wants
 * one.
 *
 * Owns the fixture's folder, guests and daemons, and everything a path
 * leaves there.  Must never let a run of the hook pass that exited other
 * than 0 or wrote on stdout: whatever it is given, the hook does neither.
 */
#include "hook-fixture.h"

#include <errno.h>
#include <fcntl.h>
#include <glib-unix.h>
#include <glib/gstdio.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

void
run_clear(Run *r)
{
    g_free(r->out);
    g_free(r->err);
    memset(r, 0, sizeof(*r));
}

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
void
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
    /* What every run must be, whatever it was given (libvirt's exit 0;
     * --start-pagefoldd, the package's, 1 where pagefoldd does not answer). */
    if (!r->exited || r->out[0] != '\0' ||
        (r->status != 0 && !(r->status == 1 && argv->len >= 2 &&
                             g_str_equal(g_ptr_array_index(argv, argv->len - 2),
                                         "--start-pagefoldd")))) {
        g_error("hook %s: exited %d status %d, stdout '%s', stderr '%s'",
                args[0] ? args[0] : "", r->exited, r->status, r->out, r->err);
    }
}

/* Runs the hook with the fixture's socket, run and log folders, then
 * the NULL-terminated arguments (more options, libvirt's four). */
void G_GNUC_NULL_TERMINATED
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

char *
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

char *
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
void
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

int
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
void
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

void
remove_pid(Fixture *f, const char *name)
{
    g_autofree char *base = g_strconcat(name, ".pid", NULL);
    g_autofree char *path = g_build_filename(f->run_dir, base, NULL);

    g_unlink(path);
    pf_test_write_libvirt_status(f->run_dir, name, NULL);
}

/* Ends a process that is not our child and waits until it is gone. */
void
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

void
setup(Fixture *f, gconstpointer data)
{
    fixture_init(f, TRUE);
}

void
setup_bare(Fixture *f, gconstpointer data)
{
    fixture_init(f, FALSE);
}

void
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
