/*
 * start-pagefoldd.c - starting pagefoldd where it does not answer (see
 * start-pagefoldd.h): systemctl, bounded and killed at the deadline,
 * where systemd is PID 1; else pagefoldd itself, forked twice into a
 * session of its own with nothing of the hook's but its log, one hook at
 * a time (a lock on that log); then a bounded wait for it to answer.
 *
 * Owns, while it runs, the lock on pagefoldd's log and the pipes to what
 * it spawns; nothing once it returns but the pagefoldd it started.  Must
 * never leave a process holding the hook's stdout or stderr (libvirtd
 * reads them to EOF), never hand pagefoldd a descriptor of the hook's,
 * never wait past the hook's deadline, and never call into hook.c or
 * domain-xml.c: it says what it does, and asks whether pagefoldd answers,
 * through hook-common.c.
 */
#include "start-pagefoldd.h"

#include <errno.h>
#include <fcntl.h>
#include <glib-unix.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/close_range.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util.h"

#define READY_POLL_MS 50

/* Runs a short program (systemctl), its output into the log, within the
 * deadline; killed if it takes longer. */
static void
run_bounded(Hook *h, const char *const *argv)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GString) out = g_string_new(NULL);
    g_autofree char *cmd = g_strjoinv(" ", (char **)argv);
    int fds[2];
    GPid pid;
    int status = 0;
    gboolean done = FALSE;

    if (!g_unix_open_pipe(fds, FD_CLOEXEC, &error)) {
        hook_say(h, "cannot run %s: %s", cmd, error->message);
        return;
    }
    if (!g_spawn_async_with_pipes_and_fds(NULL, argv, NULL,
                                         G_SPAWN_DO_NOT_REAP_CHILD | G_SPAWN_SEARCH_PATH |
                                             G_SPAWN_STDIN_FROM_DEV_NULL,
                                         NULL, NULL, -1, fds[1], fds[1], NULL, NULL, 0, &pid,
                                         NULL, NULL, NULL, &error)) {
        close(fds[0]);
        close(fds[1]);
        hook_say(h, "cannot run %s: %s", cmd, error->message);
        return;
    }
    close(fds[1]);
    for (;;) {
        struct pollfd p = { .fd = fds[0], .events = POLLIN };
        char buf[4096];
        int r = poll(&p, 1, hook_ms_left(h->deadline));
        ssize_t n;

        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break;
        }
        n = read(fds[0], buf, sizeof(buf));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            done = TRUE;
            break;
        }
        if (out->len < 4096) {
            g_string_append_len(out, buf, n);
        }
    }
    close(fds[0]);
    while (done && waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!done) {
        kill(pid, SIGKILL);
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        hook_say(h, "%s did not finish within the hook's deadline: killed", cmd);
        return;
    }
    g_strstrip(out->str);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        hook_say(h, "asked systemd to start pagefoldd (%s)%s%s", cmd, out->str[0] ? ": " : "",
            out->str);
    } else {
        hook_say(h, "%s failed (status %d)%s%s", cmd, status, out->str[0] ? ": " : "", out->str);
    }
}

typedef struct {
    int kind;  /* 0: the pid of pagefoldd; 1: exec failed, errno */
    int value;
} SpawnNote;

/* Marks every descriptor from 3 on close-on-exec: pagefoldd takes nothing
 * of the hook's, libvirt's pipes least of all.  0, or the errno of one
 * that stays open across exec. */
static int
cloexec_from_3(void)
{
    long max;

    if (syscall(SYS_close_range, 3u, ~0u, CLOSE_RANGE_CLOEXEC) == 0) {
        return 0;
    }
    max = sysconf(_SC_OPEN_MAX);
    /* Most are not open: EBADF is the answer for those, and no harm. */
    for (long fd = 3; fd < MIN(max < 0 ? 65536 : max, 1 << 20); fd++) {
        if (fcntl((int)fd, F_SETFD, FD_CLOEXEC) < 0 && errno != EBADF) {
            return errno;
        }
    }
    return 0;
}

/* Tells the hook, on the note pipe, how the spawning went, and exits: a
 * copy of the hook makes no call but system calls. */
static G_NORETURN void
note_and_exit(int note_fd, int kind, int value, int status)
{
    SpawnNote n = { kind, value };

    (void)!write(note_fd, &n, sizeof(n));
    _exit(status);
}

/*
 * What the systemd unit takes away, as far as a process can take it from
 * itself: every capability but the unit's (CapabilityBoundingSet=: root's
 * exec gets the bounding set, and the inheritable and ambient sets, which
 * are emptied too) and any new privilege (NoNewPrivileges=).  The rest of
 * the unit's sandbox (its own mounts, system call filter, device policy,
 * UMask=0077, which would make pagefoldd's /run/pagefold 0700 where no
 * tmpfiles.d makes it first) needs systemd.  Best effort: a pagefoldd that
 * keeps more still works.  Only system calls: a copy of the hook.
 */
static void
confine(void)
{
    static const int keep[] = { CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH, CAP_CHOWN };
    struct __user_cap_header_struct head = { _LINUX_CAPABILITY_VERSION_3, 0 };
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];

    /* Past CAP_LAST_CAP too: a newer kernel may know more. */
    for (int cap = 0; cap < 64; cap++) {
        gboolean kept = FALSE;

        for (gsize i = 0; i < G_N_ELEMENTS(keep); i++) {
            kept |= keep[i] == cap;
        }
        if (!kept) {
            (void)prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
    }
    if (syscall(SYS_capget, &head, data) == 0) {
        for (int i = 0; i < _LINUX_CAPABILITY_U32S_3; i++) {
            data[i].inheritable = 0;
        }
        (void)syscall(SYS_capset, &head, data);
    }
    (void)prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    (void)prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
}

/* In the middle process, a session leader of its own: forks pagefoldd,
 * which is not one (it can never take a terminal), and says its pid.
 * Only system calls from here: this is a copy of the hook. */
static G_NORETURN void
in_middle(char **argv, int null_fd, int out_fd, int note_fd)
{
    pid_t grand;
    sigset_t none;
    int err;

    /* A new session, so that pagefoldd never gets the hook's terminal. */
    if (setsid() < 0) {
        note_and_exit(note_fd, 1, errno, 127);
    }
    grand = fork();
    if (grand != 0) {
        note_and_exit(note_fd, grand < 0 ? 1 : 0, grand < 0 ? errno : grand, 0);
    }
    if (chdir("/") < 0 || dup2(null_fd, STDIN_FILENO) < 0 ||
        dup2(out_fd, STDOUT_FILENO) < 0 || dup2(out_fd, STDERR_FILENO) < 0) {
        note_and_exit(note_fd, 1, errno, 127);
    }
    /* dup2() onto itself would have kept close-on-exec; pagefoldd without
     * its stderr would say nothing of why it stops. */
    if (fcntl(STDIN_FILENO, F_SETFD, 0) < 0 || fcntl(STDOUT_FILENO, F_SETFD, 0) < 0 ||
        fcntl(STDERR_FILENO, F_SETFD, 0) < 0) {
        note_and_exit(note_fd, 1, errno, 127);
    }
    if ((err = cloexec_from_3()) != 0) {
        note_and_exit(note_fd, 1, err, 127); /* pagefoldd would inherit it */
    }
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL); /* the hook ignores it; exec keeps that */
    confine();
    execv(argv[0], argv);
    note_and_exit(note_fd, 1, errno, 127);
}

/* The pid, then EOF once exec closed the pipe, or why exec failed.
 * Returns pagefoldd's pid, or 0 with error. */
static pid_t
read_notes(Hook *h, int note_fd, const char *program, GError **error)
{
    pid_t daemon_pid = 0;

    for (;;) {
        struct pollfd p = { .fd = note_fd, .events = POLLIN };
        SpawnNote n;
        ssize_t got;
        int r = poll(&p, 1, hook_ms_left(h->deadline));

        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break; /* exec still not done: it will answer, or not */
        }
        got = read(note_fd, &n, sizeof(n));
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got != sizeof(n)) {
            break;
        }
        if (n.kind == 0) {
            daemon_pid = n.value;
            continue;
        }
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot run %s: %s", program,
                    g_strerror(n.value));
        return 0;
    }
    if (daemon_pid == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot start %s", program);
    }
    return daemon_pid;
}

/*
 * Starts pagefoldd as a daemon of its own: forked twice, its own session
 * (no terminal, no process group of libvirtd's), stdin /dev/null, output
 * appended to out_fd, nothing else of the hook's.  Returns its pid, or 0
 * with error.
 */
static pid_t
spawn_detached(Hook *h, char **argv, int out_fd, GError **error)
{
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int note[2];
    pid_t mid, daemon_pid;
    int status;

    if (null_fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "/dev/null: %s", g_strerror(errno));
        return 0;
    }
    if (!g_unix_open_pipe(note, FD_CLOEXEC, error)) {
        close(null_fd);
        return 0;
    }
    mid = fork();
    if (mid < 0) {
        int e = errno;

        close(null_fd);
        close(note[0]);
        close(note[1]);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "fork: %s", g_strerror(e));
        return 0;
    }
    if (mid == 0) {
        in_middle(argv, null_fd, out_fd, note[1]);
    }
    close(null_fd);
    close(note[1]);
    while (waitpid(mid, &status, 0) < 0 && errno == EINTR) {
    }
    daemon_pid = read_notes(h, note[0], argv[0], error);
    close(note[0]);
    return daemon_pid;
}

/* Makes the folder of pagefoldd's log, 0750 as a log folder is; one
 * that exists is left as it is. */
static gboolean
make_log_folder(const char *file, GError **error)
{
    g_autofree char *dir = g_path_get_dirname(file);

    if (g_file_test(dir, G_FILE_TEST_IS_DIR)) {
        return TRUE;
    }
    if (g_mkdir_with_parents(dir, 0750) < 0 || chmod(dir, 0750) < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot make %s: %s", dir,
                    g_strerror(errno));
        return FALSE;
    }
    return TRUE;
}

/* Waits until pagefoldd answers, h->ready_wait_ms at most. */
static gboolean
wait_ready(Hook *h)
{
    gint64 until = MIN(h->deadline, g_get_monotonic_time() + h->ready_wait_ms * 1000);

    for (;;) {
        g_autoptr(GError) error = NULL;
        Hook bounded = *h;

        bounded.deadline = until;
        if (hook_ping(&bounded, &error)) {
            return TRUE;
        }
        if (g_get_monotonic_time() + READY_POLL_MS * 1000 >= until) {
            return FALSE;
        }
        g_usleep(READY_POLL_MS * 1000);
    }
}

/* Says whether pagefoldd answers after a wait_ready(), and returns it;
 * see: where to look if it does not. */
static gboolean
say_whether_ready(Hook *h, const char *see)
{
    if (wait_ready(h)) {
        hook_say(h, "pagefoldd answers on %s", h->socket_path);
        return TRUE;
    }
    hook_say(h, "pagefoldd does not answer on %s yet; the VM is attached if it does by the "
        "time QEMU runs (see %s)", h->socket_path, see);
    return FALSE;
}

/*
 * Hooks of VMs starting together take turns, so that one pagefoldd
 * starts, not two racing for the socket.  The lock is on a description
 * of the log of its own: pagefoldd's copy of the log must not hold it.
 * Returns that descriptor, to hold until pagefoldd answers (or the wait
 * ends), or -1 (said).
 */
static int
take_turn(Hook *h)
{
    int lock_fd = open(h->pagefoldd_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY,
                       0640);

    if (lock_fd < 0) {
        hook_say(h, "cannot start pagefoldd: %s: %s", h->pagefoldd_log, g_strerror(errno));
        return -1;
    }
    while (flock(lock_fd, LOCK_EX | LOCK_NB) < 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) {
            break; /* no locking there: start it all the same */
        }
        if (hook_ms_left(h->deadline) <= 0) {
            hook_say(h, "another hook is starting pagefoldd; it did not finish within the "
                     "deadline");
            close(lock_fd);
            return -1;
        }
        g_usleep(10 * 1000);
    }
    return lock_fd;
}

/* pagefoldd's command line, NULL-terminated. */
static GPtrArray *
pagefoldd_argv(Hook *h)
{
    GPtrArray *argv = g_ptr_array_new_with_free_func(g_free);

    g_ptr_array_add(argv, g_strdup(h->pagefoldd));
    g_ptr_array_add(argv, g_strdup("--socket"));
    g_ptr_array_add(argv, g_strdup(h->socket_path));
    /* libvirt's QEMUs run as libvirt-qemu: their agents need the agent
     * socket opened to that group. */
    if (*h->agent_group != '\0' && getgrnam(h->agent_group) != NULL) {
        g_ptr_array_add(argv, g_strdup("--agent-group"));
        g_ptr_array_add(argv, g_strdup(h->agent_group));
    }
    for (guint i = 0; i < h->pagefoldd_args->len; i++) {
        g_ptr_array_add(argv, g_strdup(g_ptr_array_index(h->pagefoldd_args, i)));
    }
    g_ptr_array_add(argv, NULL);
    return argv;
}

/* Runs pagefoldd detached, a line in its log first to say who ran it how.
 * Returns its pid, or 0 with error. */
static pid_t
spawn_logged(Hook *h, char **argv, const char *cmd, GError **error)
{
    g_autofree char *header = NULL;
    int out_fd = open(h->pagefoldd_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY,
                      0640);
    pid_t pid;

    if (out_fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "%s: %s", h->pagefoldd_log,
                    g_strerror(errno));
        return 0;
    }
    header = g_strdup_printf("pagefold-hook: for domain %s: %s\n", h->name, cmd);
    (void)!write(out_fd, header, strlen(header));
    pid = spawn_detached(h, argv, out_fd, error);
    close(out_fd);
    return pid;
}

/* Spawns pagefoldd itself, one hook at a time; whether it answers. */
static gboolean
spawn_pagefoldd(Hook *h)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GError) ping_error = NULL;
    g_autoptr(GPtrArray) argv = NULL;
    g_autofree char *cmd = NULL;
    gboolean answers;
    int lock_fd;
    pid_t pid;

    if (!make_log_folder(h->pagefoldd_log, &error)) {
        hook_say(h, "cannot start pagefoldd: %s", error->message);
        return FALSE;
    }
    lock_fd = take_turn(h);
    if (lock_fd < 0) {
        return FALSE;
    }
    if (hook_ping(h, &ping_error)) {
        hook_say(h, "pagefoldd answers on %s (another hook started it)", h->socket_path);
        close(lock_fd);
        return TRUE;
    }
    /* One that took the connection but has not greeted is setting up (it
     * greets once ready): it is there, as in op_ensure_daemon(). */
    if (g_error_matches(ping_error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT)) {
        hook_say(h, "pagefoldd is there but did not answer (%s): not starting another",
                 ping_error->message);
        close(lock_fd);
        return FALSE;
    }
    argv = pagefoldd_argv(h);
    cmd = g_strjoinv(" ", (char **)argv->pdata);
    pid = spawn_logged(h, (char **)argv->pdata, cmd, &error);
    if (pid == 0) {
        hook_say(h, "cannot start pagefoldd: %s", error->message);
        close(lock_fd);
        return FALSE;
    }
    hook_say(h, "started pagefoldd (pid %d): %s; its log: %s", (int)pid, cmd, h->pagefoldd_log);
    answers = say_whether_ready(h, h->pagefoldd_log);
    close(lock_fd);
    return answers;
}

gboolean
hook_start_pagefoldd(Hook *h)
{
    if (!h->pagefoldd_given && h->pagefoldd_args->len == 0 &&
        g_file_test("/run/systemd/system", G_FILE_TEST_IS_DIR)) {
        const char *const sc[] = { "systemctl", "start", "--no-block", SYSTEMD_UNIT, NULL };

        run_bounded(h, sc);
        return say_whether_ready(h, "journalctl -u " SYSTEMD_UNIT);
    }
    return spawn_pagefoldd(h);
}
