/*
 * link-test.c - pagefoldd's end of the agent protocol, fed bad input by a
 * hand-made agent: each bad conversation gets an ERROR saying why and is
 * closed; pagefoldd, its control socket and a real VM attached alongside
 * carry on untouched.  The peer is believed only as far as its process
 * shows: a REGION must be a sealed memfd the peer maps at that address, a
 * READY in merge mode must be backed by write protection it registered, and
 * peers that stall (idle handshakes, a full socket) cost nobody else.
 *
 * The hand-made agent is this test process: it maps its guest RAM itself,
 * so what it announces can be made true or false at will.
 */
#include <errno.h>
#include <fcntl.h>
#include <gio/gio.h>
#include <glib.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

/* What pagefoldd must never take longer than to give up an idle
 * handshake (link.c says 5 s; this leaves slack on a loaded machine). */
#define HANDSHAKE_GIVE_UP_S 12

static int
connect_agent(PfTestDaemon *d)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    /* pagefoldd that never answers must fail the test, not hang it. */
    struct timeval tv = { .tv_sec = 20 };

    g_strlcpy(addr.sun_path, d->agent_sock, sizeof(addr.sun_path));
    g_assert_cmpint(connect(fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    g_assert_cmpint(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), ==, 0);
    return fd;
}

static void
send_hello_version(int fd, guint32 pid, guint32 n_regions, guint32 version)
{
    PfWireHello h = { 0 };

    h.version = version;
    h.pid = pid;
    h.n_regions = n_regions;
    pf_wire_set_string(h.name, sizeof(h.name), "fake");
    g_assert_true(pf_proto_send(fd, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0, NULL));
}

static void
send_hello(int fd, guint32 pid, guint32 n_regions)
{
    send_hello_version(fd, pid, n_regions, PF_PROTO_VERSION);
}

/* A new connection that has said HELLO as this process, announcing
 * n_regions regions. */
static int
connect_hello(PfTestDaemon *d, guint32 n_regions)
{
    int fd = connect_agent(d);

    send_hello(fd, (guint32)getpid(), n_regions);
    return fd;
}

static void
send_region_full(int fd, guint32 index, int memfd, const void *host, guint64 offset,
                 guint64 size)
{
    PfWireRegion r = { 0 };

    r.index = index;
    r.page_size = PF_PAGE_SIZE;
    r.host_addr = (guint64)(guintptr)host;
    r.offset = offset;
    r.size = size;
    pf_wire_set_string(r.name, sizeof(r.name), "pc.ram");
    g_assert_true(pf_proto_send(fd, PF_MSG_REGION, 0, &r, sizeof(r), &memfd, 1, NULL));
}

static void
send_region(int fd, const PfGuest *g)
{
    send_region_full(fd, 0, g->fd, g->mem, 0, g->n_pages * PF_PAGE_SIZE);
}

/* Sealed as QEMU seals memory-backend-memfd RAM. */
static void
seal(int memfd)
{
    g_assert_cmpint(fcntl(memfd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), ==, 0);
}

static PfGuest *
sealed_guest(gsize pages, gsize zero)
{
    PfLayout l = { .identical = pages - zero, .zero = zero };
    PfGuest *g = pf_guest_new("memory-backend-memfd", &l, 1);

    seal(g->fd);
    return g;
}

/* The ERROR in m, pagefoldd's last word on fd, says want; nothing follows
 * it.  Closes fd. */
static void
refusal_said(int fd, PfMsg *m, const char *want)
{
    g_autoptr(GError) error = NULL;

    if (g_strstr_len((const char *)m->payload, m->header.length, want) == NULL) {
        g_error("refusal '%.*s' does not say '%s'", (int)m->header.length,
                (const char *)m->payload, want);
    }
    g_test_message("refused: %.*s", (int)m->header.length, (const char *)m->payload);
    g_assert_false(pf_proto_recv(fd, m, &error));
    close(fd);
}

/* pagefoldd must answer with an ERROR containing want, then hang up.  The
 * ERROR is read after the hang-up: it must still be there to read, not
 * lost to a reset. */
static void
expect_refusal(int fd, const char *want)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    g_autoptr(GError) error = NULL;
    struct pollfd hup = { fd, 0, 0 };

    g_assert_cmpint(poll(&hup, 1, 20000), ==, 1);
    g_assert_true(hup.revents & POLLHUP);
    if (!pf_proto_recv(fd, m, &error)) {
        g_error("expected a refusal saying '%s', got: %s", want, error->message);
    }
    if (m->header.type != PF_MSG_ERROR) {
        g_error("expected a refusal saying '%s', got message type %u with %u fd(s)", want,
                m->header.type, m->n_fds);
    }
    refusal_said(fd, m, want);
}

/* The WELCOME that must follow HELLO and every REGION; its fds stay in m. */
static void
expect_welcome(int fd, PfMsg *m)
{
    g_autoptr(GError) error = NULL;

    if (!pf_proto_recv(fd, m, &error)) {
        g_error("expected WELCOME: %s", error->message);
    }
    if (m->header.type == PF_MSG_ERROR) {
        g_error("expected WELCOME, got ERROR '%.*s'", (int)m->header.length,
                (const char *)m->payload);
    }
    g_assert_cmpuint(m->header.type, ==, PF_MSG_WELCOME);
}

static void
send_ready(int fd, PfMode mode, const char *reason)
{
    PfWireMode r = { PF_PROTO_VERSION, mode, "" };

    pf_wire_set_string(r.reason, sizeof(r.reason), reason);
    g_assert_true(pf_proto_send(fd, PF_MSG_READY, 0, &r, sizeof(r), NULL, 0, NULL));
}

/* HELLO, the n guests as regions 0 to n - 1, WELCOME, READY. */
static int
handshake_regions(PfTestDaemon *d, const PfGuest *const *gs, guint32 n, PfMode mode,
                  const char *reason)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    int fd = connect_hello(d, n);

    for (guint32 i = 0; i < n; i++) {
        send_region_full(fd, i, gs[i]->fd, gs[i]->mem, 0, gs[i]->n_pages * PF_PAGE_SIZE);
    }
    expect_welcome(fd, m);
    pf_msg_close_fds(m);
    send_ready(fd, mode, reason);
    return fd;
}

/* HELLO, the guest as its one region (or none), WELCOME, READY. */
static int
handshake(PfTestDaemon *d, const PfGuest *g, PfMode mode, const char *reason)
{
    return handshake_regions(d, &g, g != NULL ? 1 : 0, mode, reason);
}

static void
send_discard(int fd, guint32 region, guint64 page, guint64 n)
{
    PfWireRange r = { region, 0, page, n };

    g_assert_true(pf_proto_send(fd, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0, NULL));
}

static void
send_hint(int fd, guint32 region, guint64 page, guint64 n)
{
    PfWireRange r = { region, 0, page, n };

    g_assert_true(pf_proto_send_hints(fd, &r, 1, NULL));
}

static guint
count_fds(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/fd", pid);
    g_autoptr(GDir) dir = g_dir_open(path, 0, NULL);
    guint n = 0;

    g_assert_nonnull(dir);
    while (g_dir_read_name(dir) != NULL) {
        n++;
    }
    return n;
}

/* pagefoldd's descriptors come back to want (it may still be closing the
 * last refused link's when the test sees the hang-up). */
static void
assert_fds_back_to(PfTestDaemon *d, guint want)
{
    guint n = 0;

    for (int i = 0; i < 100 && (n = count_fds(pf_test_daemon_pid(d))) != want; i++) {
        g_usleep(20000);
    }
    g_assert_cmpuint(n, ==, want);
}

static guint
count_vms(PfTestDaemon *d)
{
    JsonNode *n = pf_test_ctl_json(d, "list", NULL);
    guint len = json_array_get_length(json_node_get_array(n));

    json_node_unref(n);
    return len;
}

/* Waits until the VM of that name is listed (or no longer is). */
static void
wait_listed(PfTestDaemon *d, const char *name, gboolean listed)
{
    for (int i = 0; i < 500; i++) {
        JsonObject *o = pf_test_listed_vm(d, name);

        if (o != NULL) {
            json_object_unref(o);
        }
        if ((o != NULL) == listed) {
            return;
        }
        g_usleep(10000);
    }
    g_error("VM %s is %slisted", name, listed ? "not " : "still ");
}

/* Registers the guest for userfaultfd write protection, as the agent does
 * before it says merge; returns the userfaultfd. */
static int
register_wp(const PfGuest *g)
{
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM };
    struct uffdio_register reg = {
        .range = { (guint64)(guintptr)g->mem, g->n_pages * PF_PAGE_SIZE },
        .mode = UFFDIO_REGISTER_MODE_WP,
    };
    int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);

    g_assert_cmpint(uffd, >=, 0);
    g_assert_cmpint(ioctl(uffd, UFFDIO_API, &api), ==, 0);
    g_assert_cmpint(ioctl(uffd, UFFDIO_REGISTER, &reg), ==, 0);
    return uffd;
}

static void
test_bad_agents(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    int fd;

    /* Garbage. */
    fd = connect_agent(d);
    g_assert_cmpint(send(fd, "hello there", 11, 0), ==, 11);
    expect_refusal(fd, "without a valid header");

    /* A pid that is not the caller's. */
    fd = connect_agent(d);
    send_hello(fd, 1, 1);
    expect_refusal(fd, "HELLO says pid 1");

    /* Out of order. */
    fd = connect_agent(d);
    send_region(fd, g);
    expect_refusal(fd, "expected HELLO");

    /* READY before all regions. */
    fd = connect_hello(d, 2);
    send_region(fd, g);
    send_ready(fd, PF_MODE_MERGE, "");
    expect_refusal(fd, "expected REGION");

    /* A result for no request, after a proper handshake. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireResult res = { 0 };

        g_assert_true(pf_proto_send_results(fd, 99, &res, 1, NULL));
    }
    expect_refusal(fd, "answers no request");

    /* Merge mode with nothing to merge. */
    fd = handshake(d, NULL, PF_MODE_MERGE, "");
    expect_refusal(fd, "without a region");

    /* A discard of pages the region does not have, or of none. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_discard(fd, 0, 250, 7);
    expect_refusal(fd, "no such pages");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_discard(fd, 1, 0, 1);
    expect_refusal(fd, "no such pages");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_discard(fd, 0, 0, 0);
    expect_refusal(fd, "DISCARD of");
    /* Hints of pages the VM does not have. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_hint(fd, 0, 0, 256);
    send_hint(fd, 0, 200, 57);
    expect_refusal(fd, "HINT of pages 200+57 of region 0: no such pages");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_hint(fd, 3, 0, 1);
    expect_refusal(fd, "no such pages");
    /* Reserved fields set, which a later version may give a meaning. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireRange r = { 0, 1, 0, 1 };

        g_assert_true(pf_proto_send(fd, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "DISCARD of 24 bytes, of an empty or impossible range, or with reserved set");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireRange r[2] = { { 0, 0, 0, 1 }, { 0, 7, 1, 1 } };

        g_assert_true(pf_proto_send_hints(fd, r, 2, NULL));
    }
    expect_refusal(fd, "HINT range 1 is empty or impossible, or has reserved set");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        struct {
            guint32 n, reserved;
            PfWireRange r;
        } list = { 1, 1, { 0, 0, 0, 1 } };

        g_assert_true(pf_proto_send(fd, PF_MSG_HINT, 0, &list, sizeof(list), NULL, 0, NULL));
    }
    expect_refusal(fd, "HINT with reserved set");

    /* Stepping back to advise mode: only from merge mode, with a reason,
     * and to advise mode. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_ADVISE, "vhost-user" };

        g_assert_true(pf_proto_send(fd, PF_MSG_ADVISE, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "not merging");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_ADVISE, "" };

        g_assert_true(pf_proto_send(fd, PF_MSG_ADVISE, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "ADVISE reason is empty");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_MERGE, "merge again" };

        g_assert_true(pf_proto_send(fd, PF_MSG_ADVISE, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "ADVISE of mode 1");

    /* Through all that, pagefoldd kept answering, and forgot the fakes. */
    wait_listed(d, "fake", FALSE);
    g_assert_cmpuint(count_vms(d), ==, 0);
}

/* A memfd of size bytes, sealed or not, never written (a sparse file). */
static int
sparse_memfd(guint64 size, gboolean sealed)
{
    int fd = memfd_create("memory-backend-memfd", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    g_assert_cmpint(fd, >=, 0);
    g_assert_cmpint(ftruncate(fd, (off_t)size), ==, 0);
    if (sealed) {
        seal(fd);
    }
    return fd;
}

/* The regions of the VM of that name in `list`, as a new reference. */
static JsonArray *
listed_regions(PfTestDaemon *d, const char *name)
{
    g_autoptr(JsonObject) vm = pf_test_listed_vm(d, name);

    g_assert_nonnull(vm);
    return json_array_ref(json_object_get_array_member(vm, "regions"));
}

/* Region index of the VM "fake" in `list`: refused, saying want, or (want
 * NULL) not refused. */
static void
assert_region_refused(PfTestDaemon *d, guint index, const char *want)
{
    g_autoptr(JsonArray) regions = listed_regions(d, "fake");
    JsonObject *r;
    const char *why;

    g_assert_cmpuint(index, <, json_array_get_length(regions));
    r = json_array_get_object_element(regions, index);
    why = json_object_get_string_member_with_default(r, "refused", NULL);
    if (want == NULL) {
        g_assert_null(why);
        return;
    }
    if (why == NULL || strstr(why, want) == NULL) {
        g_error("region %u refused because '%s', wanted '%s'", index, why ? why : "(not refused)",
                want);
    }
    g_test_message("region %u refused: %s", index, why);
}

/*
 * A handshake whose regions are all refused (one, or n): the peer is
 * offered advise mode, no userfaultfd, with a reason that says so and
 * quotes the first; it attaches all the same, `list` shows region 0 refused
 * saying want; then the peer goes.  Once, a bad region refused the whole
 * link.
 */
static void
expect_all_refused(PfTestDaemon *d, int fd, const char *want)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    const char *reason;

    expect_welcome(fd, m);
    reason = pf_msg_mode(m)->reason;
    g_assert_cmpuint(pf_msg_mode(m)->mode, ==, PF_MODE_ADVISE);
    g_assert_cmpuint(m->n_fds, ==, 0);
    g_assert_true(g_str_has_prefix(reason, "every region was refused; the first: "));
    pf_msg_close_fds(m);
    send_ready(fd, PF_MODE_ADVISE, reason);
    wait_listed(d, "fake", TRUE);
    assert_region_refused(d, 0, want);
    close(fd);
    wait_listed(d, "fake", FALSE);
}

/* As expect_all_refused(), where of two regions the one at index refused
 * is refused and the other passes: merge is offered for the one that
 * passed. */
static void
expect_one_refused(PfTestDaemon *d, int fd, guint refused, const char *want)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);

    expect_welcome(fd, m);
    g_assert_cmpuint(pf_msg_mode(m)->mode, ==, PF_MODE_MERGE);
    pf_msg_close_fds(m);
    send_ready(fd, PF_MODE_ADVISE, "just looking");
    wait_listed(d, "fake", TRUE);
    for (guint i = 0; i < 2; i++) {
        assert_region_refused(d, i, i == refused ? want : NULL);
    }
    close(fd);
    wait_listed(d, "fake", FALSE);
}

/*
 * Every REGION is checked against what the peer's process maps before
 * anything is allocated for it: the memfd it passes must be the file it
 * maps shared at that address, at that offset, all the way, sealed against
 * shrinking, and not too large.  A region that fails is refused, with the
 * reason, and costs pagefoldd nothing: its memfd is closed at once, it
 * stays a placeholder at its index (shown refused in `list`), and the
 * others of its VM are kept.  pagefoldd is alive after, with every
 * descriptor the peers passed closed.
 */
static void
test_regions(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    g_autoptr(PfGuest) other = sealed_guest(256, 0);
    PfLayout l = { .identical = 256 };
    g_autoptr(PfGuest) unsealed = pf_guest_new("memory-backend-memfd", &l, 2);
    gsize size = 256 * PF_PAGE_SIZE;
    guint fds_before;
    int fd, pipefd[2], big, tib;
    guint8 *map;

    /* One handshake first, so that whatever pagefoldd opens once (the
     * pidfd machinery, /dev/userfaultfd) is open when we count. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    wait_listed(d, "fake", TRUE);
    close(fd);
    wait_listed(d, "fake", FALSE);
    fds_before = count_fds(pf_test_daemon_pid(d));

    /* A pipe where a memfd belongs. */
    g_assert_cmpint(pipe(pipefd), ==, 0);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, pipefd[0], g->mem, 0, size);
    expect_all_refused(d, fd, "not a memfd");
    close(pipefd[0]);
    close(pipefd[1]);

    /* A region larger than its memfd. */
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, g->fd, g->mem, 0, 1024 * PF_PAGE_SIZE);
    expect_all_refused(d, fd, "beyond the end of its memfd");
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, g->fd, g->mem, G_MAXUINT64 - PF_PAGE_SIZE + 1, size);
    expect_all_refused(d, fd, "beyond the end of its memfd");

    /* A memfd that can shrink: a read of pagefoldd's would fault. */
    fd = connect_hello(d, 1);
    send_region(fd, unsealed);
    expect_all_refused(d, fd, "F_SEAL_SHRINK");
    /* The same as the first of two regions sent at once, as an agent
     * sends them (pagefoldd is stopped meanwhile, so that both are sent
     * before it reads the first): the second is kept. */
    g_assert_cmpint(kill(pf_test_daemon_pid(d), SIGSTOP), ==, 0);
    fd = connect_hello(d, 2);
    send_region(fd, unsealed);
    send_region_full(fd, 1, g->fd, g->mem, 0, size);
    g_assert_cmpint(kill(pf_test_daemon_pid(d), SIGCONT), ==, 0);
    expect_one_refused(d, fd, 0, "F_SEAL_SHRINK");

    /* A memfd the peer does not map at all. */
    big = sparse_memfd(size, TRUE);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, big, g->mem, 0, size);
    expect_all_refused(d, fd, "maps another file");

    /* Its memfd, at an address where the peer maps another one. */
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, g->fd, other->mem, 0, size);
    expect_all_refused(d, fd, "maps another file");

    /* At an address where nothing is mapped. */
    map = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    g_assert(map != MAP_FAILED);
    g_assert_cmpint(munmap(map, size), ==, 0);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, big, map, 0, size);
    expect_all_refused(d, fd, "not mapped");

    /* The right file, but not at the offset announced. */
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, g->fd, g->mem, PF_PAGE_SIZE, size - PF_PAGE_SIZE);
    expect_all_refused(d, fd, "offset");

    /* Mapped private: the peer's pages are not the memfd's. */
    map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, big, 0);
    g_assert(map != MAP_FAILED);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, big, map, 0, size);
    expect_all_refused(d, fd, "not shared");
    /* Shared, but one page in the middle is another file's. */
    g_assert(mmap(map, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, big, 0) == map);
    g_assert(mmap(map + 8 * PF_PAGE_SIZE, PF_PAGE_SIZE, PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_FIXED, other->fd, 0) == map + 8 * PF_PAGE_SIZE);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, big, map, 0, size);
    expect_all_refused(d, fd, "maps another file");
    /* ... or a hole in the middle. */
    g_assert_cmpint(munmap(map + 8 * PF_PAGE_SIZE, PF_PAGE_SIZE), ==, 0);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, big, map, 0, size);
    expect_all_refused(d, fd, "not mapped");
    g_assert_cmpint(munmap(map, size), ==, 0);
    close(big);

    /* Two regions over the same pages: the second is refused. */
    fd = connect_hello(d, 2);
    send_region(fd, g);
    send_region_full(fd, 1, g->fd, g->mem + PF_PAGE_SIZE, PF_PAGE_SIZE, PF_PAGE_SIZE);
    expect_one_refused(d, fd, 1, "overlaps");

    /* A region of 2^46 bytes, really mapped: once it aborted pagefoldd on
     * the allocation of its page records. */
    big = sparse_memfd(1ull << 46, TRUE);
    map = mmap(NULL, 1ull << 46, PROT_READ, MAP_SHARED | MAP_NORESERVE, big, 0);
    g_assert(map != MAP_FAILED);
    fd = connect_hello(d, 1);
    send_region_full(fd, 0, big, map, 0, 1ull << 46);
    expect_all_refused(d, fd, "larger than");
    g_assert_cmpint(munmap(map, 1ull << 46), ==, 0);
    close(big);

    /* Regions each within the cap, but too much RAM together. */
    tib = sparse_memfd(1ull << 40, TRUE);
    map = mmap(NULL, 1ull << 40, PROT_READ, MAP_SHARED | MAP_NORESERVE, tib, 0);
    g_assert(map != MAP_FAILED);
    fd = connect_hello(d, 2);
    send_region(fd, g);
    send_region_full(fd, 1, tib, map, 0, 1ull << 40);
    expect_one_refused(d, fd, 1, "more than");
    g_assert_cmpint(munmap(map, 1ull << 40), ==, 0);
    close(tib);

    /* Each refusal closed the descriptor that peer passed for it, and each
     * peer's going all the rest. */
    assert_fds_back_to(d, fds_before);
    g_assert_cmpuint(count_vms(d), ==, 0);
}

/*
 * The peer is the process that connected, pinned at accept.  Here it
 * connects and exits (pagefoldd, stopped meanwhile, accepts only after),
 * and this process, which shares its socket, speaks in its name with RAM
 * of its own: pagefoldd refuses, and no WELCOME, let alone
 * /dev/userfaultfd, reaches the socket.
 */
static void
test_peer_gone(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    struct timeval tv = { .tv_sec = 20 };
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    int pid, status;

    g_strlcpy(addr.sun_path, d->agent_sock, sizeof(addr.sun_path));
    g_assert_cmpint(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), ==, 0);
    g_assert_cmpint(kill(pf_test_daemon_pid(d), SIGSTOP), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        _exit(connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0 ? 0 : 1);
    }
    g_assert_cmpint(waitpid(pid, &status, 0), ==, pid);
    g_assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    send_hello(fd, (guint32)pid, 1);
    send_region(fd, g);
    g_assert_cmpint(kill(pf_test_daemon_pid(d), SIGCONT), ==, 0);
    expect_refusal(fd, "process");
    g_assert_cmpuint(count_vms(d), ==, 0);
}

/*
 * WELCOME comes after the last REGION checked, and hands /dev/userfaultfd
 * only to a peer that has guest RAM to merge: a peer without a region is
 * offered advise mode, and no descriptor.
 */
static void
test_welcome(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    int fd;

    /* No region: nothing to merge, no userfaultfd. */
    fd = connect_hello(d, 0);
    expect_welcome(fd, m);
    g_assert_cmpuint(m->n_fds, ==, 0);
    g_assert_cmpuint(pf_msg_mode(m)->mode, ==, PF_MODE_ADVISE);
    pf_msg_close_fds(m);
    close(fd);

    /* A region the peer maps in pieces (its own madvise() calls split the
     * mapping, as QEMU's do), all of its memfd in order: merge is offered,
     * with /dev/userfaultfd when pagefoldd has one to give. */
    g_assert_cmpint(madvise(g->mem + 16 * PF_PAGE_SIZE, 16 * PF_PAGE_SIZE, MADV_DONTDUMP), ==,
                    0);
    g_assert_cmpint(pf_test_count_vmas(getpid(), (guint64)(guintptr)g->mem,
                                       g->n_pages * PF_PAGE_SIZE), ==, 3);
    fd = connect_hello(d, 1);
    send_region(fd, g);
    expect_welcome(fd, m);
    g_assert_cmpuint(pf_msg_mode(m)->mode, ==, PF_MODE_MERGE);
    g_assert_cmpuint(m->n_fds, ==, g_file_test("/dev/userfaultfd", G_FILE_TEST_EXISTS) ? 1 : 0);
    g_assert_cmpuint(pf_msg_mode(m)->version, ==, PF_PROTO_VERSION);
    pf_msg_close_fds(m);
    close(fd);
}

/*
 * An agent of protocol 1 (a QEMU started before pagefoldd was upgraded)
 * is answered in protocol 1 and attached; a HINT, which protocol 1 does
 * not have, is refused.  One of a newer protocol than pagefoldd's is
 * answered in pagefoldd's.
 */
/* HELLO of that version with g as its region: WELCOME's version. */
static guint32
welcome_version(int fd, const PfGuest *g, guint32 version)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);

    send_hello_version(fd, (guint32)getpid(), 1, version);
    send_region(fd, g);
    expect_welcome(fd, m);
    pf_msg_close_fds(m);
    return pf_msg_mode(m)->version;
}

static void
test_older_agent(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    int fd = connect_agent(d);
    PfWireMode ready = { 1, PF_MODE_ADVISE, "protocol 1" };

    g_assert_cmpuint(welcome_version(fd, g, 1), ==, 1);
    g_assert_true(pf_proto_send(fd, PF_MSG_READY, 0, &ready, sizeof(ready), NULL, 0, NULL));
    wait_listed(d, "fake", TRUE);
    send_hint(fd, 0, 0, 1);
    expect_refusal(fd, "HINT on a link of protocol version 1");

    fd = connect_agent(d);
    g_assert_cmpuint(welcome_version(fd, g, PF_PROTO_VERSION + 1), ==, PF_PROTO_VERSION);
    close(fd);
}

/*
 * READY's mode is checked: merge only where WELCOME offered it, and only
 * in the regions the peer registered for userfaultfd write protection
 * (VmFlags "uw"), which the agent does before it says merge: a region it
 * did not (it refused it) is refused alone, and never merged.
 */
static void
test_ready(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    g_autoptr(JsonObject) vm = NULL;
    int fd, uffd;

    /* Merge mode claimed without write protection. */
    fd = handshake(d, g, PF_MODE_MERGE, "");
    wait_listed(d, "fake", TRUE);
    assert_region_refused(d, 0, "write protection");
    vm = pf_test_listed_vm(d, "fake");
    g_assert_cmpint(json_object_get_int_member(vm, "pages"), ==, 0);
    g_clear_pointer(&vm, json_object_unref);
    close(fd);
    wait_listed(d, "fake", FALSE);

    /* Merge mode where WELCOME offered advise. */
    fd = handshake(d, NULL, PF_MODE_MERGE, "");
    expect_refusal(fd, "without a region");

    /* The same claim, true this time. */
    uffd = register_wp(g);
    fd = handshake(d, g, PF_MODE_MERGE, "");
    wait_listed(d, "fake", TRUE);
    vm = pf_test_listed_vm(d, "fake");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
    close(fd);
    close(uffd);
}

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

/* ---- RAM that joins or leaves a running VM ---- */

/* As expect_refusal(), past what pagefoldd sent before the ERROR (pool
 * chunks, requests). */
static void
expect_refusal_later(int fd, const char *want)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    g_autoptr(GError) error = NULL;

    for (;;) {
        if (!pf_proto_recv(fd, m, &error)) {
            g_error("expected a refusal saying '%s', got: %s", want, error->message);
        }
        pf_msg_close_fds(m);
        if (m->header.type == PF_MSG_ERROR) {
            break;
        }
        g_assert_true(m->header.type == PF_MSG_POOL || m->header.type == PF_MSG_REQUEST ||
                      m->header.type == PF_MSG_DROP);
    }
    refusal_said(fd, m, want);
}

/* The regions named by a REQUEST's items, as a bit mask (regions < 32). */
static guint32
request_regions(const PfMsg *m)
{
    guint32 n, mask = 0;
    const PfWireItem *items = pf_msg_items(m, &n);

    for (guint32 i = 0; i < n; i++) {
        mask |= 1u << MIN(items[i].region, 31u);
    }
    return mask;
}

/* Answers the REQUEST numbered seq, of n items, with status for each. */
static void
answer_seq(int fd, guint32 seq, guint32 n, PfResultStatus status)
{
    g_autofree PfWireResult *res = g_new0(PfWireResult, MAX(n, 1));

    for (guint32 i = 0; i < n; i++) {
        res[i].status = (guint8)status;
    }
    g_assert_true(pf_proto_send_results(fd, seq, res, n, NULL));
}

static void
answer(int fd, const PfMsg *m, PfResultStatus status)
{
    guint32 n;

    pf_msg_items(m, &n);
    answer_seq(fd, m->header.seq, n, status);
}

/* The next message within ms (a pool chunk's descriptor closed); FALSE if
 * none came. */
static gboolean
next_msg(int fd, PfMsg *m, int ms)
{
    struct pollfd p = { fd, POLLIN, 0 };
    g_autoptr(GError) error = NULL;

    if (poll(&p, 1, ms) != 1) {
        return FALSE;
    }
    if (!pf_proto_recv(fd, m, &error)) {
        g_error("reading pagefoldd's messages: %s", error->message);
    }
    pf_msg_close_fds(m);
    if (m->header.type == PF_MSG_ERROR) {
        g_error("pagefoldd gave up the link: %.*s", (int)m->header.length,
                (const char *)m->payload);
    }
    return TRUE;
}

/* Serves requests for ms, answering each with status; returns the regions
 * they named (request_regions()). */
static guint32
serve(int fd, int ms, PfResultStatus status)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    gint64 end = g_get_monotonic_time() + ms * 1000;
    guint32 mask = 0;

    for (gint64 left; (left = end - g_get_monotonic_time()) > 0;) {
        if (next_msg(fd, m, (int)(left / 1000) + 1) && m->header.type == PF_MSG_REQUEST) {
            mask |= request_regions(m);
            answer(fd, m, status);
        }
    }
    return mask;
}

/* Waits for a REQUEST naming region, answering those before it (with
 * CHANGED: nothing done); that one is left in m, unanswered. */
static void
wait_request(int fd, PfMsg *m, guint32 region)
{
    gint64 end = g_get_monotonic_time() + 20 * G_USEC_PER_SEC;

    while (g_get_monotonic_time() < end) {
        if (!next_msg(fd, m, 1000) || m->header.type != PF_MSG_REQUEST) {
            continue;
        }
        if (request_regions(m) & (1u << region)) {
            return;
        }
        answer(fd, m, PF_RESULT_CHANGED);
    }
    g_error("no request for region %u came", region);
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

static guint
n_listed_regions(PfTestDaemon *d)
{
    g_autoptr(JsonArray) regions = listed_regions(d, "fake");

    return json_array_get_length(regions);
}

/* Waits until the VM "fake" lists n regions. */
static void
wait_regions(PfTestDaemon *d, guint n)
{
    for (int i = 0; i < 500 && n_listed_regions(d) != n; i++) {
        g_usleep(10000);
    }
    g_assert_cmpuint(n_listed_regions(d), ==, n);
}

static gboolean
region_is_gone(PfTestDaemon *d, guint index)
{
    g_autoptr(JsonArray) regions = listed_regions(d, "fake");
    JsonObject *r = json_array_get_object_element(regions, index);

    return json_object_get_boolean_member_with_default(r, "gone", FALSE);
}

static void
send_gone(int fd, guint32 region, guint64 n_pages)
{
    PfWireRange r = { region, 0, 0, n_pages };

    g_assert_true(pf_proto_send(fd, PF_MSG_GONE, 0, &r, sizeof(r), NULL, 0, NULL));
}

/*
 * One bad region in a handshake costs that region only: here the first is
 * a memfd that can shrink.  The VM attaches in merge mode with the other,
 * which is scanned and merged (its zero pages requested, answered, counted),
 * and no request ever names the refused one.  When that region then
 * leaves and the VM goes, as QEMU's do when it exits, its last figures
 * are logged with what the region held.
 */
static void
test_bad_region_kept(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start_logged("--set", "pages_to_scan=100000",
                                                            NULL);
    PfLayout l = { .identical = 256 };
    g_autoptr(PfGuest) unsealed = pf_guest_new("memory-backend-memfd", &l, 2);
    g_autoptr(PfGuest) z = sealed_guest(256, 256);
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    g_autoptr(JsonObject) vm = NULL;
    int uffd = register_wp(z);
    int fd = connect_hello(d, 2);
    guint32 mask;

    send_region(fd, unsealed);
    send_region_full(fd, 1, z->fd, z->mem, 0, z->n_pages * PF_PAGE_SIZE);
    expect_welcome(fd, m);
    g_assert_cmpuint(pf_msg_mode(m)->mode, ==, PF_MODE_MERGE);
    pf_msg_close_fds(m);
    send_ready(fd, PF_MODE_MERGE, "");
    wait_listed(d, "fake", TRUE);
    vm = pf_test_listed_vm(d, "fake");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
    g_assert_cmpint(json_object_get_int_member(vm, "pages"), ==, 256);
    assert_region_refused(d, 0, "F_SEAL_SHRINK");
    assert_region_refused(d, 1, NULL);

    wait_request(fd, m, 1);
    mask = request_regions(m);
    answer(fd, m, PF_RESULT_DONE);
    mask |= serve(fd, 300, PF_RESULT_DONE);
    g_assert_cmpuint(mask, ==, 1u << 1);
    for (int i = 0; i < 200 && pf_test_vm_counter(d, "fake", "zero_pages") < 256; i++) {
        serve(fd, 20, PF_RESULT_DONE);
    }
    g_assert_cmpint(pf_test_vm_counter(d, "fake", "zero_pages"), ==, 256);
    send_gone(fd, 1, 256);
    while (!region_is_gone(d, 1)) {
        g_usleep(10000);
    }
    close(fd);
    wait_listed(d, "fake", FALSE);
    for (;;) {
        g_autofree char *log = pf_test_daemon_log(d);

        if (strstr(log, "merged pages 0, zero pages 0, cow 0; in its RAM that left before: "
                        "merged pages 0, zero pages 256") != NULL) {
            break;
        }
        g_usleep(10000);
    }
    close(uffd);
}

/*
 * RAM plugged into a running VM: a REGION after READY, with the next
 * index, checked as at the handshake and, the VM merging, write-protected
 * by its agent.  One that fails is a placeholder and the link stays; one
 * that passes is scanned (its zero pages are requested); an index out of
 * turn ends the link.
 */
static void
test_region_join(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "pages_to_scan=100000", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    g_autoptr(PfGuest) z = sealed_guest(256, 256);
    PfLayout l = { .identical = 256 };
    g_autoptr(PfGuest) unsealed = pf_guest_new("memory-backend-memfd", &l, 2);
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    gsize size = 256 * PF_PAGE_SIZE;
    g_autoptr(JsonObject) vm = NULL;
    int uffd = register_wp(g), uffd2, fd;

    fd = handshake(d, g, PF_MODE_MERGE, "");
    wait_listed(d, "fake", TRUE);

    /* Not write-protected, while the VM merges: refused. */
    send_region_full(fd, 1, z->fd, z->mem, 0, size);
    wait_regions(d, 2);
    assert_region_refused(d, 1, "write protection");
    /* Can shrink: refused. */
    send_region_full(fd, 2, unsealed->fd, unsealed->mem, 0, size);
    wait_regions(d, 3);
    assert_region_refused(d, 2, "F_SEAL_SHRINK");
    /* Over a live region: refused (a placeholder is no region to overlap). */
    send_region_full(fd, 3, g->fd, g->mem, 0, size);
    wait_regions(d, 4);
    assert_region_refused(d, 3, "overlaps");
    /* The same RAM as region 1, write-protected now: taken, and scanned. */
    uffd2 = register_wp(z);
    send_region_full(fd, 4, z->fd, z->mem, 0, size);
    wait_regions(d, 5);
    assert_region_refused(d, 4, NULL);
    vm = pf_test_listed_vm(d, "fake");
    g_assert_cmpint(json_object_get_int_member(vm, "pages"), ==, 512);
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
    wait_request(fd, m, 4);
    g_assert_cmpuint(request_regions(m), ==, 1u << 4);
    answer(fd, m, PF_RESULT_CHANGED);
    g_assert_cmpuint(serve(fd, 200, PF_RESULT_CHANGED) & ~(1u << 4), ==, 0);

    /* Out of turn. */
    send_region_full(fd, 7, z->fd, z->mem, 0, size);
    expect_refusal_later(fd, "REGION 7 arrived as region 5");
    wait_listed(d, "fake", FALSE);
    close(uffd);
    close(uffd2);
}

/*
 * RAM unplugged from a running VM: GONE of a live region, all its pages.
 * Here with requests for it in flight, answered after GONE (DONE, as if
 * the pages had been zeroed): pagefoldd counts nothing of them, the link
 * stays, and no request names the region again.  GONE of a region twice,
 * of part of one, or of none, and a DISCARD of a gone or refused one, end
 * the link; GONE of a refused one is taken (the agent cannot know).
 */
static void
test_region_gone(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "pages_to_scan=100000", NULL);
    g_autoptr(PfGuest) g = sealed_guest(256, 0);
    g_autoptr(PfGuest) z = sealed_guest(256, 256);
    PfLayout l = { .identical = 256 };
    g_autoptr(PfGuest) unsealed = pf_guest_new("memory-backend-memfd", &l, 2);
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    g_autoptr(JsonObject) vm = NULL;
    int uffd = register_wp(g), uffd2 = register_wp(z), fd;

    fd = handshake_regions(d, (const PfGuest *[]){ g, z }, 2, PF_MODE_MERGE, "");
    wait_listed(d, "fake", TRUE);

    wait_request(fd, m, 1);
    send_gone(fd, 1, 256);
    answer(fd, m, PF_RESULT_DONE);
    for (int i = 0; i < 500 && !region_is_gone(d, 1); i++) {
        serve(fd, 10, PF_RESULT_DONE);
    }
    g_assert_true(region_is_gone(d, 1));
    /* What was sent before pagefoldd read GONE may name it; nothing
     * after. */
    serve(fd, 100, PF_RESULT_DONE);
    g_assert_cmpuint(serve(fd, 500, PF_RESULT_DONE), ==, 0);
    vm = pf_test_listed_vm(d, "fake");
    g_assert_cmpint(json_object_get_int_member(vm, "pages"), ==, 256);
    g_assert_cmpint(pf_test_vm_counter(d, "fake", "zero_pages"), ==, 0);
    g_assert_cmpint(pf_test_vm_counter(d, "fake", "pages_pending"), ==, 0);
    /* Twice. */
    send_gone(fd, 1, 256);
    expect_refusal_later(fd, "gone already");
    wait_listed(d, "fake", FALSE);

    /* A DISCARD of a gone region. */
    fd = handshake_regions(d, (const PfGuest *[]){ g, z }, 2, PF_MODE_ADVISE, "just looking");
    send_gone(fd, 0, 256);
    send_discard(fd, 0, 0, 1);
    expect_refusal_later(fd, "the region is gone");

    /* Of a refused region. */
    fd = handshake_regions(d, (const PfGuest *[]){ unsealed, g }, 2, PF_MODE_ADVISE,
                           "just looking");
    /* The agent is not told a region was refused: its GONE is taken,
     * and the link stays (the DISCARD after it is what ends it). */
    send_gone(fd, 0, 256);
    send_discard(fd, 0, 0, 1);
    expect_refusal_later(fd, "the region was refused");

    /* Of part of a region, and of no region. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_gone(fd, 0, 255);
    expect_refusal_later(fd, "not all of its pages");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    send_gone(fd, 1, 256);
    expect_refusal_later(fd, "no such region");
    g_assert_cmpuint(count_vms(d), ==, 0);
    close(uffd);
    close(uffd2);
}

/* RAM that cannot be merged (private, not memfd): the VM is listed all
 * the same, in advise mode, with the reason, and no page. */
static void
test_no_region(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    int fd = handshake(d, NULL, PF_MODE_ADVISE, "RAM is private: kernel KSM merges it");
    g_autoptr(JsonObject) vm = NULL;

    /* The daemon handles the READY before it answers the control socket. */
    wait_listed(d, "fake", TRUE);
    vm = pf_test_listed_vm(d, "fake");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode_reason"), ==,
                    "RAM is private: kernel KSM merges it");
    g_assert_cmpuint(json_array_get_length(json_object_get_array_member(vm, "regions")), ==, 0);
    close(fd);
}

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
    /* The window (10 s in link.c) ends, and its summary is said. */
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
    g_test_add_func("/link/bad-agents", test_bad_agents);
    g_test_add_func("/link/regions", test_regions);
    g_test_add_func("/link/peer-gone", test_peer_gone);
    g_test_add_func("/link/welcome", test_welcome);
    g_test_add_func("/link/older-agent", test_older_agent);
    g_test_add_func("/link/ready", test_ready);
    g_test_add_func("/link/handshake-timeout", test_handshake_timeout);
    g_test_add_func("/link/many-idle", test_many_idle);
    g_test_add_func("/link/flood", test_flood);
    g_test_add_func("/link/uid-page-ids", test_uid_page_ids);
    g_test_add_func("/link/not-reading", test_not_reading);
    g_test_add_func("/link/slow-answers", test_slow_answers);
    g_test_add_func("/link/no-region", test_no_region);
    g_test_add_func("/link/bad-region-kept", test_bad_region_kept);
    g_test_add_func("/link/region-join", test_region_join);
    g_test_add_func("/link/region-gone", test_region_gone);
    g_test_add_func("/link/agent-group", test_agent_group);
    g_test_add_func("/link/uffd-not-vouched", test_uffd_not_vouched);
    g_test_add_func("/link/peer-text-escaped", test_peer_text_escaped);
    g_test_add_func("/link/log-flood", test_log_flood);
    return g_test_run();
}
