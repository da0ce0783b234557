/*
 * link-test.c - pagefoldd's end of the agent protocol, fed bad input by a
 * hand-made agent: each bad conversation gets an ERROR saying why and is
 * closed; pagefoldd, its control socket and a real VM attached alongside
 * carry on untouched.
 */
#include <glib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

static int
connect_agent(PfTestDaemon *d)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

    g_strlcpy(addr.sun_path, d->agent_sock, sizeof(addr.sun_path));
    g_assert_cmpint(connect(fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    return fd;
}

static void
send_hello(int fd, guint32 pid, guint32 n_regions)
{
    PfWireHello h = { 0 };

    h.version = PF_PROTO_VERSION;
    h.pid = pid;
    h.n_regions = n_regions;
    pf_wire_set_string(h.name, sizeof(h.name), "fake");
    g_assert_true(pf_proto_send(fd, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0, NULL));
}

static void
send_region(int fd, int memfd, gsize size)
{
    PfWireRegion r = { 0 };

    r.page_size = PF_PAGE_SIZE;
    r.host_addr = 0x10000000;
    r.size = size;
    pf_wire_set_string(r.name, sizeof(r.name), "pc.ram");
    g_assert_true(pf_proto_send(fd, PF_MSG_REGION, 0, &r, sizeof(r), &memfd, 1, NULL));
}

/* pagefoldd must answer with an ERROR containing want, then hang up. */
static void
expect_refusal(int fd, const char *want)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    g_autoptr(GError) error = NULL;

    g_assert_true(pf_proto_recv(fd, m, &error));
    g_assert_cmpuint(m->header.type, ==, PF_MSG_ERROR);
    if (g_strstr_len((const char *)m->payload, m->header.length, want) == NULL) {
        g_error("refusal '%.*s' does not say '%s'", (int)m->header.length,
                (const char *)m->payload, want);
    }
    g_assert_false(pf_proto_recv(fd, m, &error));
    close(fd);
}

/* HELLO, the regions (a memfd of 256 pages, or none), WELCOME, READY. */
static int
handshake(PfTestDaemon *d, int memfd, PfMode mode, const char *reason)
{
    g_autofree PfMsg *m = g_new0(PfMsg, 1);
    PfWireMode r = { PF_PROTO_VERSION, mode, "" };
    int fd = connect_agent(d);

    send_hello(fd, (guint32)getpid(), memfd >= 0 ? 1 : 0);
    if (memfd >= 0) {
        send_region(fd, memfd, 256 * PF_PAGE_SIZE);
    }
    g_assert_true(pf_proto_recv(fd, m, NULL));
    g_assert_cmpuint(m->header.type, ==, PF_MSG_WELCOME);
    pf_msg_close_fds(m);
    pf_wire_set_string(r.reason, sizeof(r.reason), reason);
    g_assert_true(pf_proto_send(fd, PF_MSG_READY, 0, &r, sizeof(r), NULL, 0, NULL));
    return fd;
}

static void
send_discard(int fd, guint32 region, guint64 page, guint64 n)
{
    PfWireRange r = { region, 0, page, n };

    g_assert_true(pf_proto_send(fd, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0, NULL));
}

static void
test_bad_agents(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    PfLayout l = { .identical = 256 };
    g_autoptr(PfGuest) g = pf_guest_new("memory-backend-memfd", &l, 1);
    int fd, pipefd[2];

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
    send_region(fd, g->fd, 256 * PF_PAGE_SIZE);
    expect_refusal(fd, "expected HELLO");

    /* A pipe where a memfd belongs. */
    g_assert_cmpint(pipe(pipefd), ==, 0);
    fd = connect_agent(d);
    send_hello(fd, (guint32)getpid(), 1);
    send_region(fd, pipefd[0], 256 * PF_PAGE_SIZE);
    expect_refusal(fd, "not a memfd");
    close(pipefd[0]);
    close(pipefd[1]);

    /* A region larger than its memfd. */
    fd = connect_agent(d);
    send_hello(fd, (guint32)getpid(), 1);
    send_region(fd, g->fd, 1024 * PF_PAGE_SIZE);
    expect_refusal(fd, "not a memfd of at least");

    /* READY before all regions. */
    fd = connect_agent(d);
    send_hello(fd, (guint32)getpid(), 2);
    send_region(fd, g->fd, 256 * PF_PAGE_SIZE);
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_MERGE, "" };

        g_assert_true(pf_proto_send(fd, PF_MSG_READY, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "expected REGION");

    /* A result for no request, after a proper handshake. */
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    {
        PfWireResult res = { 0 };

        g_assert_true(pf_proto_send_results(fd, 99, &res, 1, NULL));
    }
    expect_refusal(fd, "answers no request");

    /* Merge mode with nothing to merge. */
    fd = handshake(d, -1, PF_MODE_MERGE, "");
    expect_refusal(fd, "without a region");

    /* A discard of pages the region does not have, or of none. */
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    send_discard(fd, 0, 250, 7);
    expect_refusal(fd, "no such pages");
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    send_discard(fd, 1, 0, 1);
    expect_refusal(fd, "no such pages");
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    send_discard(fd, 0, 0, 0);
    expect_refusal(fd, "DISCARD of");

    /* Stepping back to advise mode: only from merge mode, with a reason,
     * and to advise mode. */
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_ADVISE, "vhost-user" };

        g_assert_true(pf_proto_send(fd, PF_MSG_ADVISE, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "not merging");
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_ADVISE, "" };

        g_assert_true(pf_proto_send(fd, PF_MSG_ADVISE, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "ADVISE reason is empty");
    fd = handshake(d, g->fd, PF_MODE_ADVISE, "just looking");
    {
        PfWireMode r = { PF_PROTO_VERSION, PF_MODE_MERGE, "merge again" };

        g_assert_true(pf_proto_send(fd, PF_MSG_ADVISE, 0, &r, sizeof(r), NULL, 0, NULL));
    }
    expect_refusal(fd, "ADVISE of mode 1");

    /* Through all that, pagefoldd kept answering, and forgot the fakes. */
    {
        JsonNode *n = pf_test_ctl_json(d, "list", NULL);

        g_assert_cmpuint(json_array_get_length(json_node_get_array(n)), ==, 0);
        json_node_unref(n);
    }
}

/* RAM that cannot be merged (private, not memfd): the VM is listed all
 * the same, in advise mode, with the reason, and no page. */
static void
test_no_region(void)
{
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", NULL);
    int fd = handshake(d, -1, PF_MODE_ADVISE, "RAM is private: kernel KSM merges it");
    JsonNode *n;
    JsonObject *vm;

    /* The daemon handles the READY before it answers the control socket. */
    for (int i = 0; i < 100; i++) {
        n = pf_test_ctl_json(d, "list", NULL);
        if (json_array_get_length(json_node_get_array(n)) == 1) {
            break;
        }
        json_node_unref(n);
        n = NULL;
        g_usleep(10000);
    }
    g_assert_nonnull(n);
    vm = json_array_get_object_element(json_node_get_array(n), 0);
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
    g_assert_cmpstr(json_object_get_string_member(vm, "mode_reason"), ==,
                    "RAM is private: kernel KSM merges it");
    g_assert_cmpuint(json_array_get_length(json_object_get_array_member(vm, "regions")), ==, 0);
    json_node_unref(n);
    close(fd);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/link/bad-agents", test_bad_agents);
    g_test_add_func("/link/no-region", test_no_region);
    return g_test_run();
}
