/*
 * link-agent.c - the hand-made agent of the link tests (link-agent.h):
 * this test process speaks pagefoldd's end of the agent protocol to it by
 * hand, over guest RAM it maps itself, so that what it announces can be
 * made true or false at will; and reads back what pagefoldd answers.
 *
 * Owns only the sockets, guests and messages it hands its callers.  Must
 * never use the real agent (common/agent*.c), whose words are always
 * true, and never wait on pagefoldd without a deadline: a pagefoldd that
 * never answers must fail the test, not hang it.
 */
#include "link-agent.h"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "util.h"

/* ---- what the agent says ---- */

int
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

void
send_hello_version(int fd, guint32 pid, guint32 n_regions, guint32 version)
{
    PfWireHello h = { 0 };

    h.version = version;
    h.pid = pid;
    h.n_regions = n_regions;
    pf_wire_set_string(h.name, sizeof(h.name), "fake");
    g_assert_true(pf_proto_send(fd, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0, NULL));
}

void
send_hello(int fd, guint32 pid, guint32 n_regions)
{
    send_hello_version(fd, pid, n_regions, PF_PROTO_VERSION);
}

/* A new connection that has said HELLO as this process, announcing
 * n_regions regions. */
int
connect_hello(PfTestDaemon *d, guint32 n_regions)
{
    int fd = connect_agent(d);

    send_hello(fd, (guint32)getpid(), n_regions);
    return fd;
}

void
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

void
send_region(int fd, const PfGuest *g)
{
    send_region_full(fd, 0, g->fd, g->mem, 0, g->n_pages * PF_PAGE_SIZE);
}

/* Sealed as QEMU seals memory-backend-memfd RAM. */
void
seal(int memfd)
{
    g_assert_cmpint(fcntl(memfd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), ==, 0);
}

PfGuest *
sealed_guest(gsize pages, gsize zero)
{
    PfLayout l = { .identical = pages - zero, .zero = zero };
    PfGuest *g = pf_guest_new("memory-backend-memfd", &l, 1);

    seal(g->fd);
    return g;
}

void
send_ready(int fd, PfMode mode, const char *reason)
{
    PfWireMode r = { PF_PROTO_VERSION, mode, "" };

    pf_wire_set_string(r.reason, sizeof(r.reason), reason);
    g_assert_true(pf_proto_send(fd, PF_MSG_READY, 0, &r, sizeof(r), NULL, 0, NULL));
}

/* HELLO, the n guests as regions 0 to n - 1, WELCOME, READY. */
int
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
int
handshake(PfTestDaemon *d, const PfGuest *g, PfMode mode, const char *reason)
{
    return handshake_regions(d, &g, g != NULL ? 1 : 0, mode, reason);
}

void
send_discard(int fd, guint32 region, guint64 page, guint64 n)
{
    PfWireRange r = { region, 0, page, n };

    g_assert_true(pf_proto_send(fd, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0, NULL));
}

void
send_hint(int fd, guint32 region, guint64 page, guint64 n)
{
    PfWireRange r = { region, 0, page, n };

    g_assert_true(pf_proto_send_hints(fd, &r, 1, NULL));
}

void
send_gone(int fd, guint32 region, guint64 n_pages)
{
    PfWireRange r = { region, 0, 0, n_pages };

    g_assert_true(pf_proto_send(fd, PF_MSG_GONE, 0, &r, sizeof(r), NULL, 0, NULL));
}

/* Registers the guest for userfaultfd write protection, as the agent does
 * before it says merge; returns the userfaultfd. */
int
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

/* ---- what pagefoldd answers ---- */

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
void
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

/* As expect_refusal(), past what pagefoldd sent before the ERROR (pool
 * chunks, requests). */
void
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

/* The WELCOME that must follow HELLO and every REGION; its fds stay in m. */
void
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

/* Waits until the VM of that name is listed (or no longer is). */
void
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

/* ---- its requests, served ---- */

/* The regions named by a REQUEST's items, as a bit mask (regions < 32). */
guint32
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
void
answer_seq(int fd, guint32 seq, guint32 n, PfResultStatus status)
{
    g_autofree PfWireResult *res = g_new0(PfWireResult, MAX(n, 1));

    for (guint32 i = 0; i < n; i++) {
        res[i].status = (guint8)status;
    }
    g_assert_true(pf_proto_send_results(fd, seq, res, n, NULL));
}

void
answer(int fd, const PfMsg *m, PfResultStatus status)
{
    guint32 n;

    pf_msg_items(m, &n);
    answer_seq(fd, m->header.seq, n, status);
}

/* The next message within ms (a pool chunk's descriptor closed); FALSE if
 * none came. */
gboolean
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
guint32
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
void
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
