/*
 * link-peers-test.c - pagefoldd's agent socket among many peers and
 * strangers, played by a hand-made agent (link-agent.c) and by forked
 * children of other uids: peers that stall (idle handshakes, a socket not
 * read, answers that trickle) or flood cost nobody else; who may be an
 * agent at all, what RAM a uid root vouched for none of may announce, and
 * who gets /dev/userfaultfd; and a peer's words reach pagefoldd's log and
 * pagefoldctl escaped, its floods of them bounded.
 *
 * Owns the checks of what a peer may cost the others, and of who it is.
 * What one peer says at its handshake and after is link-test.c's.  Must
 * never leave a child behind a path: each forked peer dies with the test
 * or is reaped by it.
 */
#include <errno.h>
#include <fcntl.h>
#include <gio/gio.h>
#include <glib.h>
#include <grp.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guestmem.h"
#include "link-agent.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

/* ---- peers that stall or flood ---- */

/* What pagefoldd must never take longer than to give up an idle
 * handshake (link.c says 5 s; this leaves slack on a loaded machine). */
#define HANDSHAKE_GIVE_UP_S 12

/*
 * A handshake has a few seconds to finish: a peer that connects and says
 * nothing, or stops halfway, is told so and closed.
 */
static void
test_handshake_timeout(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    gint64 t0 = g_get_monotonic_time();
    int silent = connect_agent(d);
    int halfway = connect_hello(d, 2);
    double s;

    send_region(halfway, g);
    expect_refusal(silent, "handshake");
    expect_refusal(halfway, "handshake");
    s = (g_get_monotonic_time() - t0) / 1e6;
    g_test_message("idle handshakes given up after %.1f s", s);
    g_assert_cmpfloat(s, >=, 2.0);
    g_assert_cmpfloat(s, <, HANDSHAKE_GIVE_UP_S);
}

/* A stand-in VMM with the real agent; NULL if it could not attach. */
static PfTestVmm *
vmm_start(PfTestDaemon *d, const char *name, const char *mib)
{
    g_autofree char *guest = g_strdup_printf("guest=%s", name);
    const char *argv[] = { pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket",
                           d->agent_sock, "--mib", mib, NULL };
    PfTestVmm *v = pf_test_vmm_spawn(argv);

    if (v != NULL) {
        pf_test_daemon_wait_vmm(d, v);
    }
    return v;
}

/* A child that holds n idle connections to the agent socket until the
 * test ends. */
static int
idle_holder(PfTestDaemon *d, int n)
{
    int ready[2];
    int pid;
    char c = 0;

    g_assert_cmpint(pipe(ready), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(ready[0]);
        for (int i = 0; i < n; i++) {
            (void)connect_agent(d);
        }
        (void)!write(ready[1], &c, 1);
        for (;;) {
            pause();
        }
    }
    close(ready[1]);
    g_assert_cmpint(read(ready[0], &c, 1), ==, 1);
    close(ready[0]);
    return pid;
}

/*
 * Idle connections, from one process or from many, do not lock the agents
 * out: a process gets a few handshakes at a time (more are refused at
 * once), and when too many processes hold one, the oldest gives way.  A
 * real agent connecting after them attaches at once, long before any
 * timeout frees a place.
 */
static void
test_many_idle(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfTestVmm) v = NULL;
    int mine[8], holders[20];
    guint refused = 0;
    gint64 t0;
    double s;

    for (guint i = 0; i < G_N_ELEMENTS(mine); i++) {
        mine[i] = connect_agent(d);
    }
    for (guint i = 0; i < G_N_ELEMENTS(holders); i++) {
        holders[i] = idle_holder(d, 4);
    }
    t0 = g_get_monotonic_time();
    v = vmm_start(d, "good", "4");
    s = (g_get_monotonic_time() - t0) / 1e6;
    g_assert_nonnull(v);
    g_test_message("a real agent attached in %.2f s past 88 idle connections", s);
    g_assert_cmpstr(v->mode, ==, "merge");
    g_assert_cmpfloat(s, <, 4.0);
    wait_listed(d, "good", TRUE);
    /* This process asked for more handshakes at once than one gets: the
     * extra ones were refused (or gave way to the others) at once. */
    for (guint i = 0; i < G_N_ELEMENTS(mine); i++) {
        struct pollfd p = { mine[i], POLLIN, 0 };

        if (poll(&p, 1, 0) == 1) {
            expect_refusal(mine[i], "handshakes");
            mine[i] = -1;
            refused++;
        }
    }
    g_assert_cmpuint(refused, >=, 4);
    for (guint i = 0; i < G_N_ELEMENTS(holders); i++) {
        pf_guest_release(holders[i]);
    }
    for (guint i = 0; i < G_N_ELEMENTS(mine); i++) {
        if (mine[i] >= 0) {
            close(mine[i]);
        }
    }
}

/*
 * A flood of connections from one uid (32 processes of nobody, in the
 * agent socket's group, reconnecting in a loop for 10 s) keeps no VM of
 * another uid out: each VM started meanwhile attaches, merging.  pagefoldd
 * takes every connection waiting at each wake-up, and when all handshake
 * places are taken, the uid holding the most gives one up; an agent that
 * finds the listen queue full (it is the kernel's, shared by all, and a
 * flood on a slow host keeps it full) tries again until it gets in, at the
 * latest once the flood is over.
 */
static void
test_flood(void)
{
    g_autoptr(PfTestDaemon) d =
        pf_test_daemon_start_logged("--set", "run=0", "--agent-group", "nogroup", NULL);
    g_autofree char *log = NULL;
    int flooders[32];

    /* The flooders reach the agent socket: nobody may search its folder. */
    g_assert_cmpint(chmod(d->dir, 0755), ==, 0);
    for (guint i = 0; i < G_N_ELEMENTS(flooders); i++) {
        flooders[i] = pf_test_flooder(d, 10);
    }
    g_usleep(G_USEC_PER_SEC); /* the flood under way */
    for (int i = 0; i < 3; i++) {
        g_autofree char *name = g_strdup_printf("vm%d", i);
        g_autoptr(PfTestVmm) v = vmm_start(d, name, "4");

        g_assert_nonnull(v);
        g_test_message("%s: mode %s", name, v->mode);
        g_assert_cmpstr(v->mode, ==, "merge");
    }
    for (guint i = 0; i < G_N_ELEMENTS(flooders); i++) {
        pf_guest_release(flooders[i]);
    }
    /* pagefoldd saw the flood (its lines of it are limited): connections
     * refused, or closed during their handshake. */
    log = pf_test_daemon_log(d);
    g_assert_nonnull(strstr(log, "agent connection"));
}

/*
 * A merging peer that stops reading its socket is given up without
 * pagefoldd ever waiting on it: the control socket keeps answering at once
 * meanwhile, the peer is detached and its socket closed (it answers none
 * of the requests it was sent: --agent-timeout), and the VM next to it is
 * scanned and merged on.
 */
static void
test_not_reading(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start(
        "--set", "pages_to_scan=200000", "--set", "sleep_millisecs=50", "--agent-timeout", "5",
        NULL);
    /* Enough zero pages that the requests for them overflow any socket
     * buffer pagefoldd may have. */
    g_autoptr(PfGuest) g = sealed_guest(64 * 1024, 64 * 1024);
    g_autoptr(PfTestVmm) v = vmm_start(d, "served", "8");
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    int uffd = register_wp(g);
    int fd = handshake(d, g, PF_MODE_MERGE, "");
    double worst = 0;
    gint64 t0 = g_get_monotonic_time(), gone = 0, scanned;

    g_assert_nonnull(v);
    wait_listed(d, "fake", TRUE);
    /* From here on this peer reads nothing. */
    while (g_get_monotonic_time() - t0 < 20 * G_USEC_PER_SEC) {
        gint64 c0 = g_get_monotonic_time();
        JsonObject *o = pf_test_listed_vm(d, "fake");
        double lat = (g_get_monotonic_time() - c0) / 1e6;

        worst = MAX(worst, lat);
        if (o == NULL) {
            gone = g_get_monotonic_time();
            break;
        }
        json_object_unref(o);
        g_usleep(100000);
    }
    g_test_message("the silent peer was given up after %.1f s; the slowest control answer "
                   "meanwhile took %.2f s",
                   (gone - t0) / 1e6, worst);
    g_assert_cmpint(gone, !=, 0);
    /* A pass and a pagefoldctl run, even under TCG, but never the 5 s a
     * send once waited for a full socket. */
    g_assert_cmpfloat(worst, <, 4.0);

    /* Its socket was closed: behind what pagefoldd had sent is the end. */
    {
        g_autoptr(GError) error = NULL;

        while (pf_proto_recv(fd, m, &error)) {
            pf_msg_close_fds(m);
        }
        g_assert_error(error, PF_ERROR, PF_ERROR_CLOSED);
    }
    close(fd);
    close(uffd);

    /* The other VM is still served. */
    scanned = pf_test_vm_counter(d, "served", "pages_scanned");
    g_assert_cmpint(scanned, >=, 0);
    for (int i = 0; i < 500 && pf_test_vm_counter(d, "served", "pages_scanned") <= scanned; i++) {
        g_usleep(10000);
    }
    g_assert_cmpint(pf_test_vm_counter(d, "served", "pages_scanned"), >, scanned);
}

/*
 * An agent that answers slowly, one batch at a time but often enough never
 * to look silent, holds up no other VM: the cursor leaves a VM whose
 * outbox is full for later in the pass, and the pass waits for it a
 * bounded while, then ends; its pages are visited on from where the cursor
 * left them.  (The cursor once waited at such a VM for as long as it kept
 * answering: here about 100 s a pass, with the other VM never scanned
 * again meanwhile.)
 */
static void
test_slow_answers(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start(
        "--set", "pages_to_scan=100", "--set", "sleep_millisecs=20", "--agent-timeout", "600",
        NULL);
    g_autoptr(PfTestVmm) v = vmm_start(d, "served", "8");
    /* Zero pages: each one visited is a request. */
    g_autoptr(PfGuest) g = sealed_guest(64 * 1024, 64 * 1024);
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    g_autoptr(GArray) due = g_array_new(FALSE, FALSE, sizeof(guint64));
    int uffd = register_wp(g);
    int fd;
    gint64 t0, next, look = 0, scans0, fake0 = -1;
    guint answered = 0;

    g_assert_nonnull(v);
    fd = handshake(d, g, PF_MODE_MERGE, "");
    wait_listed(d, "fake", TRUE);
    scans0 = pf_test_vm_counter(d, "served", "full_scans");
    t0 = next = g_get_monotonic_time();
    for (;;) {
        gint64 now = g_get_monotonic_time();

        if (now >= look) {
            gint64 scans = pf_test_vm_counter(d, "served", "full_scans");

            /* The fake's pages are visited on while it stays attached. */
            g_assert_cmpint(pf_test_vm_counter(d, "fake", "pages_scanned"), >=, fake0);
            if (fake0 < 0 && scans > scans0) {
                fake0 = pf_test_vm_counter(d, "fake", "pages_scanned");
            }
            if (scans >= scans0 + 4 &&
                pf_test_vm_counter(d, "fake", "pages_scanned") > fake0) {
                break;
            }
            if (now - t0 > 60 * G_USEC_PER_SEC) {
                g_error("the other VM made %" G_GINT64_FORMAT " passes in 60 s, answering "
                        "the slow one's %u batches",
                        scans - scans0, answered);
            }
            look = now + G_USEC_PER_SEC / 2;
        }
        if (now >= next && due->len > 0) {
            guint64 b = g_array_index(due, guint64, 0);

            answer_seq(fd, (guint32)(b >> 32), (guint32)b, PF_RESULT_CHANGED);
            g_array_remove_index(due, 0);
            answered++;
            next = now + 300 * 1000;
        }
        if (next_msg(fd, m, 50) && m->header.type == PF_MSG_REQUEST) {
            guint32 n;
            guint64 b;

            pf_msg_items(m, &n);
            b = (guint64)m->header.seq << 32 | n;
            g_array_append_val(due, b);
        }
    }
    g_test_message("the other VM made 4 passes in %.1f s, the slow one answering %u batches",
                   (g_get_monotonic_time() - t0) / 1e6, answered);
    wait_listed(d, "fake", TRUE);
    close(fd);
    close(uffd);
}

/* ---- who a peer is ---- */

/*
 * A forked child that takes on uid and gid (and supplementary group
 * extra, unless it is 0), keeping CAP_DAC_OVERRIDE if dac_override (so
 * that the socket's mode lets it through and only pagefoldd's own check
 * of its credentials is left), connects, says HELLO and reports what came
 * back: 0 WELCOME, 1 ERROR containing want, 2 connect() refused by the
 * socket's mode, 3 other.  The child makes only system calls (the test
 * has threads): its message buffer is static.
 */
static int
connect_as(PfTestDaemon *d, uid_t uid, gid_t gid, gid_t extra, gboolean dac_override,
           const char *want)
{
    static PfMsg msg;
    pid_t pid = fork();
    int status;

    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
        struct __user_cap_data_struct caps[2] = { { 0 } };
        struct sockaddr_un addr = { .sun_family = AF_UNIX };
        PfMsg *m = &msg;
        PfWireHello h = { 0 };
        int fd;

        if (prctl(PR_SET_KEEPCAPS, 1) < 0 || setgroups(extra != 0, &extra) < 0 ||
            setgid(gid) < 0 || setuid(uid) < 0) {
            _exit(3);
        }
        caps[0].effective = caps[0].permitted = 1u << CAP_DAC_OVERRIDE;
        if (dac_override && syscall(SYS_capset, &hdr, caps) < 0) {
            _exit(3);
        }
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        g_strlcpy(addr.sun_path, d->agent_sock, sizeof(addr.sun_path));
        if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
            _exit(errno == EACCES ? 2 : 3);
        }
        h.version = PF_PROTO_VERSION;
        h.pid = (guint32)getpid();
        pf_wire_set_string(h.name, sizeof(h.name), "unprivileged");
        /* A refused peer finds the socket closed under its HELLO: what
         * it is told waits to be read all the same. */
        pf_proto_send(fd, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0, NULL);
        if (!pf_proto_recv(fd, m, NULL)) {
            _exit(3);
        }
        if (m->header.type == PF_MSG_WELCOME) {
            _exit(0);
        }
        _exit(m->header.type == PF_MSG_ERROR &&
              g_strstr_len((const char *)m->payload, m->header.length, want) ? 1 : 3);
    }
    g_assert_cmpint(waitpid(pid, &status, 0), ==, pid);
    g_assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

/* --agent-group opens the agent socket to one group (libvirt's QEMU runs as
 * libvirt-qemu): its members connect, others are stopped by the socket's
 * mode and, should that be loosened, by pagefoldd's check of their
 * credentials; without it only root may be an agent. */
static void
test_agent_group(void)
{
    struct group *gr = getgrnam("nogroup");
    struct stat st;

    if (geteuid() != 0 || gr == NULL) {
        g_test_skip("needs root and a group 'nogroup'");
        return;
    }
    {
        g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--agent-group", "nogroup", NULL);

        /* The test's directory must let others reach the socket. */
        g_assert_cmpint(chmod(d->dir, 0755), ==, 0);
        g_assert_cmpint(stat(d->agent_sock, &st), ==, 0);
        g_assert_cmpuint(st.st_mode & 07777, ==, 0660);
        g_assert_cmpuint(st.st_gid, ==, gr->gr_gid);
        g_assert_cmpint(stat(d->sock, &st), ==, 0);
        g_assert_cmpuint(st.st_mode & 07777, ==, 0600);
        g_assert_cmpint(connect_as(d, 65534, gr->gr_gid, 0, FALSE, NULL), ==, 0);
        g_assert_cmpint(connect_as(d, 1, 1, 0, FALSE, NULL), ==, 2);
        g_assert_cmpint(connect_as(d, 1, 1, 0, TRUE, "may not be an agent"), ==, 1);
        /* The group as a supplementary one (SO_PEERGROUPS). */
        g_assert_cmpint(connect_as(d, 1, 1, gr->gr_gid, FALSE, NULL), ==, 0);
    }
    {
        g_autoptr(PfTestDaemon) d = pf_test_daemon_start(NULL, NULL);

        g_assert_cmpint(chmod(d->dir, 0755), ==, 0);
        g_assert_cmpint(connect_as(d, 65534, gr->gr_gid, 0, TRUE, "only root"), ==, 1);
    }
    {
        /* A group that does not exist: a clear error, no daemon. */
        g_autofree char *dir = g_dir_make_tmp("pagefold-test-XXXXXX", NULL);
        g_autofree char *ctl = g_build_filename(dir, "ctl.sock", NULL);
        g_autofree char *agent = g_build_filename(dir, "agent.sock", NULL);
        g_autoptr(GSubprocess) p = g_subprocess_new(
            G_SUBPROCESS_FLAGS_STDERR_PIPE, NULL, g_getenv("PAGEFOLDD"), "--socket", ctl,
            "--agent-socket", agent, "--agent-group", "no-such-group-pf", NULL);
        g_autofree char *err = NULL;

        g_assert_nonnull(p);
        g_assert_true(g_subprocess_communicate_utf8(p, NULL, NULL, NULL, &err, NULL));
        g_assert_false(g_subprocess_get_successful(p));
        g_assert_nonnull(strstr(err, "--agent-group"));
        g_assert_false(g_file_test(agent, G_FILE_TEST_EXISTS));
        rmdir(dir);
    }
}

/*
 * In a forked child (system calls only: the test has threads): connects,
 * announces one region of name's guest RAM (size bytes at mem, from
 * memfd) and reads WELCOME into msg.  Returns the socket, or -1.
 */
static int
child_announce(PfTestDaemon *d, const char *name, const void *mem, guint64 size, int memfd,
               PfMsg *msg)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    PfWireHello h = { 0 };
    PfWireRegion r = { 0 };
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

    g_strlcpy(addr.sun_path, d->agent_sock, sizeof(addr.sun_path));
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
        return -1;
    }
    h.version = PF_PROTO_VERSION;
    h.pid = (guint32)getpid();
    h.n_regions = 1;
    pf_wire_set_string(h.name, sizeof(h.name), name);
    r.page_size = PF_PAGE_SIZE;
    r.host_addr = (guint64)(guintptr)mem;
    r.size = size;
    pf_wire_set_string(r.name, sizeof(r.name), "pc.ram");
    if (!pf_proto_send(fd, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0, NULL) ||
        !pf_proto_send(fd, PF_MSG_REGION, 0, &r, sizeof(r), &memfd, 1, NULL) ||
        !pf_proto_recv(fd, msg, NULL) || msg->header.type != PF_MSG_WELCOME) {
        return -1;
    }
    return fd;
}

/*
 * A forked child that takes on uid and gid (the agent socket's group),
 * waits for a byte on go (so that the test can vouch for its pid first),
 * connects and hands over guest RAM it maps shared from a memfd sealed
 * against shrinking, as QEMU's, and reports what WELCOME carried: 10 + its
 * number of descriptors when it offers merge, 3 anything else.  Only
 * system calls in the child (the test has threads).
 */
static int
welcome_fds_as(PfTestDaemon *d, uid_t uid, gid_t gid, const char *name, const PfGuest *g,
               int *pid_out, int *go_out)
{
    static PfMsg msg;
    int go[2];
    pid_t pid;

    g_assert_cmpint(pipe2(go, O_CLOEXEC), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        char c;

        close(go[1]);
        if (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(uid) < 0 ||
            read(go[0], &c, 1) != 1 ||
            child_announce(d, name, g->mem, g->n_pages * PF_PAGE_SIZE, g->fd, &msg) < 0 ||
            pf_msg_mode(&msg)->mode != PF_MODE_MERGE) {
            _exit(3);
        }
        _exit(10 + (int)msg.n_fds);
    }
    close(go[0]);
    *pid_out = pid;
    *go_out = go[1];
    return pid;
}

/*
 * A forked child of uid nobody (group gid) that announces one region of a
 * 1 TiB memfd it maps shared (sparse: it costs nothing), says on *said
 * whether WELCOME offered merge ('m') or not ('a': its region refused),
 * then says READY in advise mode and holds its VM until killed.
 */
static int
sparse_vm_as_nobody(PfTestDaemon *d, gid_t gid, char *said)
{
    static PfMsg msg;
    int report[2];
    pid_t pid;

    g_assert_cmpint(pipe2(report, O_CLOEXEC), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        const guint64 size = G_GUINT64_CONSTANT(1) << 40;
        PfWireMode ready = { PF_PROTO_VERSION, PF_MODE_ADVISE, "" };
        int fd, memfd;
        void *mem;
        char c;

        if (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(65534) < 0 ||
            prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) {
            _exit(3);
        }
        memfd = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (memfd < 0 || ftruncate(memfd, (off_t)size) < 0 ||
            fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
            _exit(3);
        }
        mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, memfd, 0);
        if (mem == MAP_FAILED || (fd = child_announce(d, "sparse", mem, size, memfd, &msg)) < 0) {
            _exit(3);
        }
        c = pf_msg_mode(&msg)->mode == PF_MODE_MERGE ? 'm' : 'a';
        if (write(report[1], &c, 1) != 1 ||
            !pf_proto_send(fd, PF_MSG_READY, 0, &ready, sizeof(ready), NULL, 0, NULL)) {
            _exit(3);
        }
        for (;;) {
            pause();
        }
    }
    close(report[1]);
    g_assert_cmpint(read(report[0], said, 1), ==, 1);
    close(report[0]);
    return pid;
}

/*
 * Page ids are 32-bit and given for all RAM announced, sparse or not: the
 * VMs of a uid root vouched for none of may announce a quarter of them
 * (4 TiB) in all.  Four sparse 1 TiB VMs of nobody take that; a fifth
 * region is refused, saying why, and a VM of root's attaches all the same.
 */
static void
test_uid_page_ids(void)
{
    struct group *gr = getgrnam("nogroup");
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(PfTestVmm) v = NULL;
    int pids[5];

    if (geteuid() != 0 || gr == NULL) {
        g_test_skip("needs root and a group 'nogroup'");
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", "--agent-group", "nogroup", NULL);
    g_assert_cmpint(chmod(d->dir, 0755), ==, 0);
    for (guint i = 0; i < G_N_ELEMENTS(pids); i++) {
        char said = 0;

        pids[i] = sparse_vm_as_nobody(d, gr->gr_gid, &said);
        g_test_message("sparse VM %u: %s", i, said == 'm' ? "merge offered" : "refused");
        g_assert_cmpint(said, ==, i < 4 ? 'm' : 'a');
    }
    v = vmm_start(d, "good", "4");
    g_assert_nonnull(v);
    g_assert_cmpstr(v->mode, ==, "merge");
    for (guint i = 0; i < G_N_ELEMENTS(pids); i++) {
        pf_guest_release(pids[i]);
    }
}

/* The child's report, once it may go on. */
static int
welcome_fds_result(int pid, int go)
{
    int status;

    g_assert_cmpint(write(go, "g", 1), ==, 1);
    close(go);
    g_assert_cmpint(waitpid(pid, &status, 0), ==, pid);
    g_assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

/*
 * /dev/userfaultfd lets its holder make a userfaultfd that traps the
 * kernel's own faults, which vm.unprivileged_userfaultfd=0 denies
 * unprivileged processes.  What a peer owns (a sealed memfd it maps
 * shared) proves nothing, so a process of the agent socket's group that
 * root did not vouch for is offered merge (it may make a userfaultfd of
 * its own where the kernel lets it) without the descriptor; root's peer
 * gets it, and so does the process libvirt's root-owned status file names
 * as the QEMU of the domain it announces.
 */
static void
test_uffd_not_vouched(void)
{
    struct group *gr = getgrnam("nogroup");
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    int pid, go;

    if (geteuid() != 0 || gr == NULL || !g_file_test("/dev/userfaultfd", G_FILE_TEST_EXISTS)) {
        g_test_skip("needs root, a group 'nogroup' and /dev/userfaultfd");
        return;
    }
    {
        g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
        g_autoptr(PfTestDaemon) d =
            pf_test_daemon_start("--set", "run=0", "--agent-group", "nogroup",
                                 "--libvirt-run-dir", run_dir, NULL);
        g_autofree char *text = NULL;

        g_assert_cmpint(chmod(d->dir, 0755), ==, 0);
        welcome_fds_as(d, 65534, gr->gr_gid, "stranger", g, &pid, &go);
        g_assert_cmpint(welcome_fds_result(pid, go), ==, 10);
        /* Root's process, with the same RAM: the descriptor. */
        welcome_fds_as(d, 0, 0, "root", g, &pid, &go);
        g_assert_cmpint(welcome_fds_result(pid, go), ==, 11);
        /* libvirt's status file names it as the domain's QEMU (libvirtd
         * writes it before the QEMU it forked may exec): the descriptor. */
        welcome_fds_as(d, 65534, gr->gr_gid, "dom1", g, &pid, &go);
        text = g_strdup_printf("%d", pid);
        pf_test_write_libvirt_status(run_dir, "dom1", text);
        g_assert_cmpint(welcome_fds_result(pid, go), ==, 11);
        /* Claiming that domain's name does not make another process its
         * QEMU; nor does a status file anyone but root could write. */
        welcome_fds_as(d, 65534, gr->gr_gid, "dom1", g, &pid, &go);
        g_assert_cmpint(welcome_fds_result(pid, go), ==, 10);
        welcome_fds_as(d, 65534, gr->gr_gid, "dom2", g, &pid, &go);
        g_clear_pointer(&text, g_free);
        text = g_strdup_printf("%d", pid);
        pf_test_write_libvirt_status(run_dir, "dom2", text);
        {
            g_autofree char *path = g_build_filename(run_dir, "dom2.xml", NULL);

            g_assert_cmpint(chown(path, 65534, 65534), ==, 0);
        }
        g_assert_cmpint(welcome_fds_result(pid, go), ==, 10);
        pf_test_write_libvirt_status(run_dir, "dom1", NULL);
        pf_test_write_libvirt_status(run_dir, "dom2", NULL);
        g_assert_cmpint(rmdir(run_dir), ==, 0);
    }
}

/* ---- a peer's words in pagefoldd's log ---- */

/* What a peer may say to forge a line of pagefoldd's log, or to work a
 * terminal that shows it: a line break and a line of its own, a colour, a
 * window title, a C1 control (CSI), a bidi override; its ERROR may carry a
 * NUL and bytes that are not UTF-8. */
#define EVIL_NAME "vm\n** Message: FORGED-N\x1b[31m\xc2\x9b\xe2\x80\xae"
#define EVIL_REGION "ram\r\nFORGED-R\x1b]0;t\x07"
#define EVIL_REASON "no\nFORGED-A\x1b[2J\x7f"

/* No byte of text below 0x20 but line breaks, no DEL, nothing that is not
 * UTF-8, no C1 control or bidi override; no line that a peer began. */
static void
assert_no_peer_controls(const char *what, const char *text)
{
    g_auto(GStrv) lines = g_strsplit(text, "\n", -1);

    if (!g_utf8_validate(text, -1, NULL)) {
        g_error("%s is not UTF-8:\n%s", what, text);
    }
    for (const char *p = text; *p; p = g_utf8_next_char(p)) {
        gunichar c = g_utf8_get_char(p);

        if ((c < 0x20 && c != '\n') || (c >= 0x7f && c < 0xa0) || c == 0x202e) {
            g_error("%s has U+%04X at byte %td:\n%s", what, c, p - text, text);
        }
    }
    for (char **l = lines; *l != NULL; l++) {
        if (g_str_has_prefix(*l, "FORGED") || g_str_has_prefix(*l, "** Message: FORGED")) {
            g_error("%s has a line of the peer's: '%s'", what, *l);
        }
    }
}

/* pagefoldctl with args; its stdout. */
static char *
ctl_output(PfTestDaemon *d, const char *arg1, const char *arg2)
{
    const char *argv[] = { g_getenv("PAGEFOLDCTL"), "--socket", d->sock, arg1, arg2, NULL };
    g_autoptr(GError) error = NULL;
    g_autoptr(GSubprocess) p =
        pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE, argv, &error);
    char *out = NULL;

    g_assert_no_error(error);
    g_assert_true(g_subprocess_communicate_utf8(p, NULL, NULL, &out, NULL, &error));
    g_assert_no_error(error);
    g_assert_true(g_subprocess_get_successful(p));
    return out;
}

/* The VM of this process, as list has it (a new reference), once it is
 * (or is no longer: NULL) listed. */
static JsonObject *
wait_own_vm(PfTestDaemon *d, gboolean listed)
{
    for (int i = 0; i < 500; i++) {
        JsonNode *n = pf_test_ctl_json(d, "list", NULL);
        JsonObject *o = pf_test_find_vm_pid(json_node_get_array(n), getpid());

        o = o != NULL ? json_object_ref(o) : NULL;
        json_node_unref(n);
        if ((o != NULL) == listed) {
            return o;
        }
        g_clear_pointer(&o, json_object_unref);
        g_usleep(10000);
    }
    g_error("this process's VM is %slisted", listed ? "not " : "still ");
}

/* A peer's words reach pagefoldd's log and pagefoldctl's list escaped:
 * its VM's name (HELLO), a region's (REGION, refused), its reason (READY)
 * and its ERROR text, all of it (nothing cut at a NUL). */
static void
test_peer_text_escaped(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start_logged("--set", "run=0", NULL);
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    static const char error_text[] = "bye\nFORGED-E\x1b[1;1H\xff\xfe\0after NUL";
    g_autofree char *log = NULL;
    g_autofree char *list = NULL;
    g_autofree char *json = NULL;
    g_autoptr(JsonObject) vm = NULL;
    PfWireHello h = { PF_PROTO_VERSION, (guint32)getpid() };
    PfWireRegion r = { 0, PF_PAGE_SIZE, 16 * PF_PAGE_SIZE, PF_PAGE_SIZE, 0 };
    int fd = connect_agent(d);
    int notmemfd = open("/dev/null", O_RDWR | O_CLOEXEC);

    h.n_regions = 1;
    pf_wire_set_string(h.name, sizeof(h.name), EVIL_NAME);
    g_assert_true(pf_proto_send(fd, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0, NULL));
    /* Not a memfd: refused, and its name said in why. */
    pf_wire_set_string(r.name, sizeof(r.name), EVIL_REGION);
    g_assert_true(pf_proto_send(fd, PF_MSG_REGION, 0, &r, sizeof(r), &notmemfd, 1, NULL));
    close(notmemfd);
    expect_welcome(fd, m);
    pf_msg_close_fds(m);
    send_ready(fd, PF_MODE_ADVISE, EVIL_REASON);
    vm = wait_own_vm(d, TRUE);
    log = pf_test_daemon_log(d);
    g_test_message("pagefoldd's log:\n%s", log);
    assert_no_peer_controls("pagefoldd's log", log);
    g_assert_nonnull(strstr(log, "vm\\n** Message: FORGED-N\\x1b[31m\\u009b\\u202e"));
    g_assert_nonnull(strstr(log, "ram\\r\\nFORGED-R\\x1b]0;t\\x07"));
    g_assert_nonnull(strstr(log, "no\\nFORGED-A\\x1b[2J\\x7f"));
    /* pagefoldd holds them escaped: its JSON says what its log says. */
    g_assert_cmpstr(json_object_get_string_member(vm, "name"), ==,
                    "vm\\n** Message: FORGED-N\\x1b[31m\\u009b\\u202e");
    list = ctl_output(d, "list", NULL);
    g_test_message("pagefoldctl list:\n%s", list);
    assert_no_peer_controls("pagefoldctl list", list);
    g_assert_nonnull(strstr(list, "FORGED-R"));
    json = ctl_output(d, "--json", "list");
    assert_no_peer_controls("pagefoldctl --json list", json);
    g_assert_true(pf_proto_send(fd, PF_MSG_ERROR, 0, error_text, sizeof(error_text) - 1, NULL,
                                0, NULL));
    g_clear_pointer(&vm, json_object_unref);
    vm = wait_own_vm(d, FALSE);
    close(fd);
    /* The detach is logged before the VM leaves the list. */
    g_clear_pointer(&log, g_free);
    log = pf_test_daemon_log(d);
    g_test_message("pagefoldd's log:\n%s", log);
    assert_no_peer_controls("pagefoldd's log", log);
    g_assert_nonnull(strstr(log, "bye\\nFORGED-E\\x1b[1;1H\\xff\\xfe\\x00after NUL"));
}

static guint
count_lines_with(const char *text, const char *what)
{
    guint n = 0;

    for (const char *p = text; (p = strstr(p, what)) != NULL; p += strlen(what)) {
        n++;
    }
    return n;
}

/* A peer that connects in a loop and sends garbage: pagefoldd refuses
 * each, and logs a bounded number of lines about its uid's connections,
 * then one that says how many more it held back. */
static void
test_log_flood(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start_logged("--set", "run=0", NULL);
    g_autofree char *log = NULL;
    guint closed;

    for (int i = 0; i < 200; i++) {
        int fd = connect_agent(d);
        struct pollfd hup = { fd, 0, 0 };

        g_assert_cmpint(send(fd, "garbage", 7, 0), ==, 7);
        g_assert_cmpint(poll(&hup, 1, 20000), ==, 1);
        close(fd);
    }
    /* The window (10 s in peer-log.c) ends, and its summary is said. */
    for (int i = 0; i < 200; i++) {
        g_clear_pointer(&log, g_free);
        log = pf_test_daemon_log(d);
        if (strstr(log, "suppressed") != NULL) {
            break;
        }
        g_usleep(100000);
    }
    closed = count_lines_with(log, "closed during its handshake");
    g_test_message("%u of 200 refusals logged:\n%s", closed, log);
    g_assert_cmpuint(closed, >=, 1);
    g_assert_cmpuint(closed, <=, 40);
    g_assert_cmpuint(count_lines_with(log, "\n"), <=, 50);
    g_assert_nonnull(strstr(log, "agent connections of uid 0: "));
    g_assert_nonnull(strstr(log, " more line(s) suppressed"));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/link/handshake-timeout", test_handshake_timeout);
    g_test_add_func("/link/many-idle", test_many_idle);
    g_test_add_func("/link/flood", test_flood);
    g_test_add_func("/link/uid-page-ids", test_uid_page_ids);
    g_test_add_func("/link/not-reading", test_not_reading);
    g_test_add_func("/link/slow-answers", test_slow_answers);
    g_test_add_func("/link/agent-group", test_agent_group);
    g_test_add_func("/link/uffd-not-vouched", test_uffd_not_vouched);
    g_test_add_func("/link/peer-text-escaped", test_peer_text_escaped);
    g_test_add_func("/link/log-flood", test_log_flood);
    return g_test_run();
}
