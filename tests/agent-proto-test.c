/*
 * agent-proto-test.c - the agent library against a hand-driven daemon end
 * of the protocol: the real kernel mechanisms (userfaultfd, MAP_FIXED over
 * guest RAM, punch), and every kind of bad input pagefoldd could send.
 * This test process is the VMM: it maps guest RAM like QEMU and links the
 * agent library.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "agent.h"
#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

#define PAGES 256

typedef struct {
    PfTestPeer *peer;
    int conn;
    PfGuest *guest;
    PfAgent *agent;
    int pool_fd;
    guint8 *pool_map;
    PfMsg msg;
} Fixture;

#define make_pool pf_test_pool_chunk

static void
expect_msg(Fixture *f, PfMsgType type)
{
    g_autoptr(GError) error = NULL;

    g_assert_true(pf_proto_recv(f->conn, &f->msg, &error));
    g_assert_no_error(error);
    g_assert_cmpuint(f->msg.header.type, ==, type);
}

static void
setup(Fixture *f, gconstpointer data)
{
    PfLayout l = { .identical = PAGES / 2, .unique = PAGES / 4, .zero = PAGES / 4 };
    PfAgentRegion r;

    memset(f, 0, sizeof(*f));
    f->peer = pf_test_peer_new();
    f->guest = pf_guest_new("memory-backend-memfd", &l, 1);
    f->agent = pf_agent_new("vm-test", NULL);
    r = (PfAgentRegion){ "pc.ram", f->guest->mem, PAGES * PF_PAGE_SIZE, f->guest->fd, 0 };
    pf_agent_add_region(f->agent, &r);
    g_assert_cmpint(pf_test_peer_accept(f->peer, f->agent), ==, PF_MODE_MERGE);
    f->conn = f->peer->conn;
    f->pool_fd = make_pool(PAGES, TRUE, &f->pool_map);
}

static void
teardown(Fixture *f, gconstpointer data)
{
    pf_agent_free(f->agent);
    pf_test_peer_free(f->peer);
    munmap(f->pool_map, PAGES * PF_PAGE_SIZE);
    close(f->pool_fd);
    pf_guest_free(f->guest);
}

static void
send_pool(Fixture *f, int fd, guint32 chunk, guint32 n_slots)
{
    PfWirePool p = { chunk, n_slots };

    g_assert_true(pf_proto_send(f->conn, PF_MSG_POOL, 0, &p, sizeof(p), &fd, 1, NULL));
}

/* Sends items, returns the results (owned by f->msg). */
static const PfWireResult *
request(Fixture *f, const PfWireItem *items, guint32 n, guint32 seq)
{
    guint32 got;
    const PfWireResult *res;

    g_assert_true(pf_proto_send_items(f->conn, seq, items, n, NULL));
    expect_msg(f, PF_MSG_RESULT);
    g_assert_cmpuint(f->msg.header.seq, ==, seq);
    res = pf_msg_results(&f->msg, &got);
    g_assert_cmpuint(got, ==, n);
    return res;
}

static guint64
pagemap_entry(const void *addr)
{
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    guint64 e = 0;

    g_assert_cmpint(pread(fd, &e, 8, (off_t)((guintptr)addr / PF_PAGE_SIZE * 8)), ==, 8);
    close(fd);
    return e;
}

static blkcnt_t
memfd_blocks(int fd)
{
    struct stat st;

    fstat(fd, &st);
    return st.st_blocks;
}

static void
test_merge_zero_unmerge(Fixture *f, gconstpointer data)
{
    PfWireItem items[PAGES];
    const PfWireResult *res;
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *before = g_memdup2(mem, PAGES * PF_PAGE_SIZE);
    blkcnt_t blocks0 = memfd_blocks(f->guest->fd);
    guint n = 0;

    /* Slots 0..127 hold the identical pages; slot 200 holds something else. */
    memcpy(f->pool_map, mem, (PAGES / 2) * PF_PAGE_SIZE);
    pf_fill_page(f->pool_map + 200 * PF_PAGE_SIZE, 99);
    send_pool(f, f->pool_fd, 0, PAGES);

    for (guint i = 0; i < PAGES / 2; i++, n++) {
        items[n] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0, .page = i, .chunk = 0,
                                 .slot = i };
    }
    /* A unique page against a slot of other content: must stay. */
    items[n++] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0, .page = PAGES / 2,
                               .chunk = 0, .slot = 200 };
    /* Zero pages to zero slots 130..193 (never written). */
    for (guint i = 3 * PAGES / 4; i < PAGES; i++, n++) {
        items[n] = (PfWireItem){ .kind = PF_ITEM_ZERO, .region = 0, .page = i, .chunk = 0,
                                 .slot = 130 + i - 3 * PAGES / 4 };
    }
    /* A unique page as "zero": must stay. */
    items[n++] = (PfWireItem){ .kind = PF_ITEM_ZERO, .region = 0, .page = PAGES / 2 + 1,
                               .chunk = 0, .slot = 129 };
    res = request(f, items, n, 7);
    for (guint i = 0; i < PAGES / 2; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    g_assert_cmpuint(res[PAGES / 2].status, ==, PF_RESULT_CHANGED);
    for (guint i = PAGES / 2 + 1; i < n - 1; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    g_assert_cmpuint(res[n - 1].status, ==, PF_RESULT_CHANGED);

    /* Every byte as before; the memfd gave its pages back. */
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_cmpint(memfd_blocks(f->guest->fd), <, blocks0);
    /* The merged page is the pool's page: same PFN. */
    g_assert_cmpuint(pagemap_entry(mem) & ((1ull << 55) - 1), ==,
                     pagemap_entry(f->pool_map) & ((1ull << 55) - 1));
    g_assert_true(pagemap_entry(mem) & (1ull << 61)); /* a file page */

    /* A write copies on write: private to us, the pool unchanged. */
    mem[5] ^= 0xff;
    g_assert_false(pagemap_entry(mem) & (1ull << 61));
    g_assert_true(pagemap_entry(mem) & (1ull << 56));
    g_assert_cmpint(memcmp(f->pool_map + 6, before + 6, PF_PAGE_SIZE - 6), ==, 0);
    g_assert_cmpuint(f->pool_map[5], ==, before[5]);

    /* Unmerge folds the written page back into the memfd, intact. */
    items[0] = (PfWireItem){ .kind = PF_ITEM_UNMERGE, .region = 0, .page = 0 };
    items[1] = (PfWireItem){ .kind = PF_ITEM_UNMERGE, .region = 0, .page = PAGES - 1 };
    res = request(f, items, 2, 8);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpuint(res[1].status, ==, PF_RESULT_DONE);
    {
        guint8 back[PF_PAGE_SIZE];

        g_assert_cmpint(pread(f->guest->fd, back, PF_PAGE_SIZE, 0), ==, PF_PAGE_SIZE);
        g_assert_cmpuint(back[5], ==, (guint8)(before[5] ^ 0xff));
        g_assert_cmpint(memcmp(back + 6, before + 6, PF_PAGE_SIZE - 6), ==, 0);
    }
    /* Mapped shared again: a write reaches the memfd. */
    mem[9] = 0x5a;
    {
        guint8 b;

        g_assert_cmpint(pread(f->guest->fd, &b, 1, 9), ==, 1);
        g_assert_cmpuint(b, ==, 0x5a);
    }
}

/* Items pagefoldd must never send: each is refused, nothing changes. */
static void
test_bad_items(Fixture *f, gconstpointer data)
{
    g_autofree guint8 *before = g_memdup2(f->guest->mem, PAGES * PF_PAGE_SIZE);
    PfWireItem items[] = {
        { .kind = PF_ITEM_MERGE, .region = 1, .page = 0, .chunk = 0, .slot = 0 },
        { .kind = PF_ITEM_MERGE, .region = 0, .page = PAGES, .chunk = 0, .slot = 0 },
        { .kind = PF_ITEM_MERGE, .region = 0, .page = 0, .chunk = 5, .slot = 0 },
        { .kind = PF_ITEM_MERGE, .region = 0, .page = 0, .chunk = 0, .slot = PAGES },
        { .kind = PF_ITEM_ZERO, .region = 0, .page = G_MAXUINT64 },
        { .kind = PF_ITEM_ZERO, .region = 0, .page = 3, .chunk = 1, .slot = 0 },
        { .kind = PF_ITEM_UNMERGE, .region = 9, .page = 0 },
        { .kind = PF_ITEM_COLLAPSE, .region = 0, .page = 3 },
    };
    const PfWireResult *res;

    memcpy(f->pool_map, f->guest->mem, PF_PAGE_SIZE);
    send_pool(f, f->pool_fd, 0, PAGES);
    res = request(f, items, G_N_ELEMENTS(items), 1);
    for (guint i = 0; i < G_N_ELEMENTS(items); i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_ERROR);
        g_assert_cmpint(res[i].err, ==, EINVAL);
    }
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_true(pf_agent_is_connected(f->agent));
}

/* A pool chunk pagefoldd could still write is refused: the agent says
 * why and disconnects, and the VM's memory is untouched. */
static void
test_unsealed_pool(Fixture *f, gconstpointer data)
{
    guint8 *map;
    int fd = make_pool(16, FALSE, &map);

    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*pool chunk 0 is not sealed*");
    send_pool(f, fd, 0, 16);
    expect_msg(f, PF_MSG_ERROR);
    g_assert_nonnull(g_strstr_len((const char *)f->msg.payload, f->msg.header.length,
                                  "not sealed"));
    for (int i = 0; i < 200 && pf_agent_is_connected(f->agent); i++) {
        g_usleep(10000);
    }
    g_assert_false(pf_agent_is_connected(f->agent));
    g_test_assert_expected_messages();
    munmap(map, 16 * PF_PAGE_SIZE);
    close(fd);
}

/* Malformed datagrams: truncated, oversized, unknown, fds where none
 * belong.  Each is refused with an error message, and nothing leaks. */
static void
test_bad_messages(Fixture *f, gconstpointer data)
{
    static const struct {
        const char *what;
        gsize len;
        guint16 type;
        guint32 length;
    } cases[] = {
        { "short header", 8, 0, 0 },
        { "length mismatch", 16, PF_MSG_REQUEST, 100 },
        { "unknown type", 16, 77, 0 },
        { "empty request", 16 + 8, PF_MSG_REQUEST, 8 },
    };

    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        int sv[2];
        guint8 buf[64] = { 0 };
        PfMsgHeader h = { PF_PROTO_MAGIC, cases[i].type, 0, cases[i].length, 0 };
        g_autoptr(GError) error = NULL;
        g_autofree PfMsg *m = g_new0(PfMsg, 1);

        g_assert_cmpint(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), ==, 0);
        memcpy(buf, &h, sizeof(h));
        g_assert_cmpint(send(sv[0], buf, cases[i].len, 0), ==, (gssize)cases[i].len);
        g_assert_false(pf_proto_recv(sv[1], m, &error));
        g_assert_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT);
        g_assert_cmpuint(m->n_fds, ==, 0);
        close(sv[0]);
        close(sv[1]);
    }
    /* An oversized datagram. */
    {
        int sv[2];
        g_autofree guint8 *big = g_malloc0(PF_PROTO_MAX_PAYLOAD + 1000);
        PfMsgHeader h = { PF_PROTO_MAGIC, PF_MSG_ERROR, 0, PF_PROTO_MAX_PAYLOAD + 984, 0 };
        g_autoptr(GError) error = NULL;
        g_autofree PfMsg *m = g_new0(PfMsg, 1);
        int sz = 1 << 20;

        g_assert_cmpint(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), ==, 0);
        setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
        memcpy(big, &h, sizeof(h));
        g_assert_cmpint(send(sv[0], big, PF_PROTO_MAX_PAYLOAD + 1000, 0), >, 0);
        g_assert_false(pf_proto_recv(sv[1], m, &error));
        g_assert_nonnull(strstr(error->message, "larger than"));
        close(sv[0]);
        close(sv[1]);
    }
    /* A READY carrying a descriptor: refused, and the descriptor closed. */
    {
        int sv[2], probe[2];
        PfWireMode ready = { PF_PROTO_VERSION, PF_MODE_MERGE, "" };
        g_autoptr(GError) error = NULL;
        g_autofree PfMsg *m = g_new0(PfMsg, 1);
        char c;

        g_assert_cmpint(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), ==, 0);
        g_assert_cmpint(pipe(probe), ==, 0);
        g_assert_true(pf_proto_send(sv[0], PF_MSG_READY, 0, &ready, sizeof(ready), &probe[1], 1,
                                    NULL));
        close(probe[1]);
        g_assert_false(pf_proto_recv(sv[1], m, &error));
        g_assert_nonnull(strstr(error->message, "file descriptors"));
        /* Every write end is closed: the read end sees EOF. */
        g_assert_cmpint(read(probe[0], &c, 1), ==, 0);
        close(probe[0]);
        close(sv[0]);
        close(sv[1]);
    }
    /* And the agent, sent garbage, gives up cleanly. */
    {
        guint8 junk[40] = { 1, 2, 3 };

        g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*without a valid header*");
        g_assert_cmpint(send(f->conn, junk, sizeof(junk), 0), ==, sizeof(junk));
        expect_msg(f, PF_MSG_ERROR);
        for (int i = 0; i < 200 && pf_agent_is_connected(f->agent); i++) {
            g_usleep(10000);
        }
        g_assert_false(pf_agent_is_connected(f->agent));
        g_test_assert_expected_messages();
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add("/agent-proto/merge-zero-unmerge", Fixture, NULL, setup, test_merge_zero_unmerge,
               teardown);
    g_test_add("/agent-proto/bad-items", Fixture, NULL, setup, test_bad_items, teardown);
    g_test_add("/agent-proto/unsealed-pool", Fixture, NULL, setup, test_unsealed_pool, teardown);
    g_test_add("/agent-proto/bad-messages", Fixture, NULL, setup, test_bad_messages, teardown);
    return g_test_run();
}
