/*
 * link-test.c - pagefoldd's end of the agent protocol, fed bad input by a
 * hand-made agent (link-agent.c): each bad conversation gets an ERROR
 * saying why and is closed; pagefoldd, its control socket and a real VM
 * attached alongside carry on untouched.  What a peer says is believed
 * only as far as its process shows: a REGION must be a sealed memfd the
 * peer maps at that address, a READY in merge mode must be backed by write
 * protection it registered, RAM plugged in or unplugged later is checked
 * as at the handshake.
 *
 * Owns the checks of what one peer says, at its handshake and after.  Who
 * may be a peer, and what peers that stall or flood cost the others, are
 * link-peers-test.c's.  Must never take a refusal for the one it provoked
 * without its reason: each bad input is matched to the words pagefoldd
 * gives for it.
 */
#include <fcntl.h>
#include <gio/gio.h>
#include <glib.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guestmem.h"
#include "link-agent.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

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
    /* Reserved fields and flags unknown set, which a later version may give
     * a meaning. */
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireRange r = { 0, 2, 0, 1 };

        g_assert_true(pf_proto_send(fd, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "DISCARD of 24 bytes, of an empty or impossible range, or with "
                       "unknown flags");
    fd = handshake(d, g, PF_MODE_ADVISE, "just looking");
    {
        PfWireRange r[2] = { { 0, 0, 0, 1 }, { 0, 7, 1, 1 } };

        g_assert_true(pf_proto_send_hints(fd, r, 2, NULL));
    }
    expect_refusal(fd, "HINT range 1 is empty or impossible, or has flags set");
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
 * not have, is refused, as is a DISCARD flagged PF_RANGE_BACKEND from one
 * of protocol 2.  One of a newer protocol than pagefoldd's is answered in
 * pagefoldd's.
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
    ready.version = 2;
    g_assert_cmpuint(welcome_version(fd, g, 2), ==, 2);
    g_assert_true(pf_proto_send(fd, PF_MSG_READY, 0, &ready, sizeof(ready), NULL, 0, NULL));
    wait_listed(d, "fake", TRUE);
    {
        PfWireRange r = { 0, PF_RANGE_BACKEND, 0, 1 };

        g_assert_true(pf_proto_send(fd, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "DISCARD with flags on a link of protocol version 2");

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

/* ---- RAM that joins or leaves a running VM ---- */

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
    g_test_add_func("/link/no-region", test_no_region);
    g_test_add_func("/link/bad-region-kept", test_bad_region_kept);
    g_test_add_func("/link/region-join", test_region_join);
    g_test_add_func("/link/region-gone", test_region_gone);
    return g_test_run();
}
