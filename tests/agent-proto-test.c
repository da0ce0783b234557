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
#include <poll.h>
#include <string.h>
#include <linux/mempolicy.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "agent.h"
#include "faultsys.h"
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

static const guint8 zero_page_of_test[PF_PAGE_SIZE];

static void
expect_msg(Fixture *f, PfMsgType type)
{
    g_autoptr(GError) error = NULL;

    g_assert_true(pf_proto_recv(f->conn, &f->msg, &error));
    g_assert_no_error(error);
    g_assert_cmpuint(f->msg.header.type, ==, type);
}

/* A fixture's data that has its peer answer in protocol 1 (other tests'
 * data is theirs). */
static const char protocol_1[] = "protocol 1";

/* The fixture with guest RAM of n_pages (the pool has PAGES slots). */
static void
setup_pages(Fixture *f, gconstpointer data, guint n_pages)
{
    PfLayout l = { .identical = n_pages / 2, .unique = n_pages / 4, .zero = n_pages / 4 };
    PfAgentRegion r;

    memset(f, 0, sizeof(*f));
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    f->peer = pf_test_peer_new();
    if (data == protocol_1) {
        f->peer->version = 1; /* a pagefoldd before hints */
    }
    f->guest = pf_guest_new_aligned("memory-backend-memfd", &l, 1);
    f->agent = pf_agent_new("vm-test", NULL);
    r = (PfAgentRegion){ "pc.ram", f->guest->mem, n_pages * PF_PAGE_SIZE, f->guest->fd, 0,
                         { MADV_DONTFORK } };
    g_assert_true(pf_agent_add_region(f->agent, &r, NULL));
    /* The fault tests' calls fail only when a test says so. */
    pf_agent_set_syscalls(f->agent, &pf_test_faulty_syscalls);
    g_assert_cmpint(pf_test_peer_accept(f->peer, f->agent), ==, PF_MODE_MERGE);
    f->conn = f->peer->conn;
    f->pool_fd = make_pool(PAGES, TRUE, &f->pool_map);
}

static void
setup(Fixture *f, gconstpointer data)
{
    setup_pages(f, data, PAGES);
}

/* Guest RAM of a 2 MiB extent, which COLLAPSE may name. */
static void
setup_extent(Fixture *f, gconstpointer data)
{
    setup_pages(f, data, 512);
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

/* Every one of n results is an ERROR with errno err. */
static void
assert_all_failed(const PfWireResult *res, guint n, int err)
{
    for (guint i = 0; i < n; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_ERROR);
        g_assert_cmpint(res[i].err, ==, err);
    }
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

/*
 * COLLAPSE lifts the write protection of its whole extent: refused (EBUSY)
 * while a page of it is still mapped from the pool, whatever pagefoldd
 * believes, and the page stays merged and protected; once it is folded
 * back, the extent may collapse.
 */
static void
test_collapse_merged(Fixture *f, gconstpointer data)
{
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *before = g_memdup2(mem, 512 * PF_PAGE_SIZE);
    PfWireItem merge = { .kind = PF_ITEM_MERGE, .region = 0, .page = 7, .chunk = 0,
                         .slot = 0 };
    PfWireItem collapse = { .kind = PF_ITEM_COLLAPSE, .region = 0, .page = 0 };
    PfWireItem unmerge = { .kind = PF_ITEM_UNMERGE, .region = 0, .page = 7 };
    guint64 start = (guint64)(guintptr)mem, size = 512 * PF_PAGE_SIZE;
    const PfWireResult *res;

    memcpy(f->pool_map, mem + 7 * PF_PAGE_SIZE, PF_PAGE_SIZE);
    send_pool(f, f->pool_fd, 0, PAGES);
    res = request(f, &merge, 1, 1);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    res = request(f, &collapse, 1, 2);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_ERROR);
    g_assert_cmpint(res[0].err, ==, EBUSY);
    /* Still the pool's page (read, so that it is mapped), and every
     * mapping of the extent registered. */
    g_assert_cmpint(memcmp(mem, before, 512 * PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(pagemap_entry(mem + 7 * PF_PAGE_SIZE) & ((1ull << 55) - 1), ==,
                     pagemap_entry(f->pool_map) & ((1ull << 55) - 1));
    g_assert_cmpint(pf_test_count_vmas_flag(getpid(), start, size, "uw"), ==,
                    pf_test_count_vmas(getpid(), start, size));
    mem[7 * PF_PAGE_SIZE + 3] ^= 0xff;
    before[7 * PF_PAGE_SIZE + 3] ^= 0xff;
    res = request(f, &unmerge, 1, 3);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    /* The kernel may not collapse shmem here; the agent no longer refuses. */
    res = request(f, &collapse, 1, 4);
    g_assert_true(res[0].status == PF_RESULT_DONE || res[0].err != EBUSY);
    g_assert_cmpint(memcmp(mem, before, 512 * PF_PAGE_SIZE), ==, 0);
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
    assert_all_failed(res, G_N_ELEMENTS(items), EINVAL);
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
        guint32 list_n; /* a list's count of entries */
    } cases[] = {
        { "short header", 8, 0, 0 },
        { "length mismatch", 16, PF_MSG_REQUEST, 100 },
        { "unknown type", 16, 77, 0 },
        { "empty request", 16 + 8, PF_MSG_REQUEST, 8 },
        { "empty hint", 16 + 8, PF_MSG_HINT, 8 },
        /* One range of no page. */
        { "empty range", 16 + 8 + 24, PF_MSG_HINT, 8 + 24, 1 },
    };

    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        int sv[2];
        guint8 buf[64] = { 0 };
        PfMsgHeader h = { PF_PROTO_MAGIC, cases[i].type, 0, cases[i].length, 0 };
        g_autoptr(GError) error = NULL;
        g_autofree PfMsg *m = g_new0(PfMsg, 1);

        g_assert_cmpint(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), ==, 0);
        memcpy(buf, &h, sizeof(h));
        memcpy(buf + sizeof(h), &cases[i].list_n, sizeof(cases[i].list_n));
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

/* ---- failures: guest RAM stays as the guest wrote it, the answer true ---- */

/* Slots 0..PAGES/2-1 hold the guest's identical pages. */
static void
send_identical_pool(Fixture *f)
{
    memcpy(f->pool_map, f->guest->mem, (PAGES / 2) * PF_PAGE_SIZE);
    send_pool(f, f->pool_fd, 0, PAGES);
}

/* Merges pages [first, first + n) with the slots of the same index. */
static const PfWireResult *
merge_pages(Fixture *f, guint first, guint n, guint32 seq)
{
    PfWireItem items[PAGES];

    for (guint i = 0; i < n; i++) {
        items[i] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0, .page = first + i,
                                 .chunk = 0, .slot = first + i };
    }
    return request(f, items, n, seq);
}

static const PfWireResult *
unmerge_page(Fixture *f, guint page, guint32 seq)
{
    PfWireItem it = { .kind = PF_ITEM_UNMERGE, .region = 0, .page = page };

    return request(f, &it, 1, seq);
}

static guint64
remapped(Fixture *f)
{
    PfAgentStats st;

    pf_agent_get_stats(f->agent, &st);
    return st.remapped;
}

/* Does page i of guest RAM map the memfd?  A byte written through the
 * mapping must be read back from the memfd. */
static gboolean
maps_memfd(Fixture *f, guint i)
{
    guint8 *b = f->guest->mem + (gsize)i * PF_PAGE_SIZE + 7;
    guint8 old = *b, got = 0;
    gboolean yes;

    *b = (guint8)(old ^ 0xa5);
    yes = pread(f->guest->fd, &got, 1, (off_t)((gsize)i * PF_PAGE_SIZE + 7)) == 1 &&
          got == (guint8)(old ^ 0xa5);
    *b = old;
    return yes;
}

static void
assert_memfd_page(Fixture *f, guint i, const guint8 *want)
{
    guint8 back[PF_PAGE_SIZE];

    g_assert_cmpint(pread(f->guest->fd, back, PF_PAGE_SIZE, (off_t)i * PF_PAGE_SIZE), ==,
                    PF_PAGE_SIZE);
    g_assert_cmpint(memcmp(back, want, PF_PAGE_SIZE), ==, 0);
}

/*
 * A MAP_FIXED of pool slots that fails: early (the mapping limit), or late,
 * after the kernel unmapped the old pages (commit accounting with
 * vm.overcommit_memory=2).  The merge is refused, the memfd is mapped
 * there as before, and nothing was punched.
 */
static void
test_fault_merge_mmap(Fixture *f, gconstpointer late)
{
    g_autofree guint8 *before = g_memdup2(f->guest->mem, PAGES * PF_PAGE_SIZE);
    blkcnt_t blocks = memfd_blocks(f->guest->fd);
    const PfWireResult *res;

    send_identical_pool(f);
    pf_test_fault_set("mmap-private", 0, -1, ENOMEM, late != NULL);
    res = merge_pages(f, 0, 64, 1);
    assert_all_failed(res, 64, ENOMEM);
    g_assert_cmpint(pf_test_fault_hits(), >, 0);
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(remapped(f), ==, 0);
    g_assert_cmpint(memfd_blocks(f->guest->fd), ==, blocks);
    for (guint i = 0; i < 64; i += 9) {
        g_assert_true(maps_memfd(f, i));
    }
    /* And once the kernel agrees, the same merge works. */
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    res = merge_pages(f, 0, 64, 2);
    for (guint i = 0; i < 64; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    g_assert_cmpuint(remapped(f), ==, 64);
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
}

/* The punch, or the advice, fails after the pool slot is mapped: the
 * merge is undone by folding back, and reported as not done. */
static void
test_fault_merge_punch(Fixture *f, gconstpointer call)
{
    g_autofree guint8 *before = g_memdup2(f->guest->mem, PAGES * PF_PAGE_SIZE);
    const PfWireResult *res;

    send_identical_pool(f);
    pf_test_fault_set(call, 0, 1, EPERM, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*after merging pc.ram*folding it back*");
    res = merge_pages(f, 0, 16, 1);
    g_test_assert_expected_messages();
    assert_all_failed(res, 16, EPERM);
    g_assert_cmpuint(remapped(f), ==, 0);
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    for (guint i = 0; i < 16; i++) {
        g_assert_true(maps_memfd(f, i));
        assert_memfd_page(f, i, before + (gsize)i * PF_PAGE_SIZE);
    }
}

/* Folding a written page back, when mapping the memfd fails: late (the
 * old mapping gone: mapped again at once, nothing lost), or early (the
 * page stays merged, its write in place, and the unmerge says it failed). */
static void
test_fault_unmerge_mmap(Fixture *f, gconstpointer late)
{
    guint8 *page = f->guest->mem + 3 * PF_PAGE_SIZE;
    g_autofree guint8 *want = NULL;
    const PfWireResult *res;

    send_identical_pool(f);
    res = merge_pages(f, 0, 8, 1);
    g_assert_cmpuint(res[3].status, ==, PF_RESULT_DONE);
    page[10] ^= 0x55; /* copied on write */
    want = g_memdup2(page, PF_PAGE_SIZE);

    pf_test_fault_set("mmap-shared", 0, late ? 1 : -1, ENOMEM, late != NULL);
    res = unmerge_page(f, 3, 2);
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    g_assert_cmpint(memcmp(page, want, PF_PAGE_SIZE), ==, 0);
    if (late) {
        g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
        g_assert_cmpuint(remapped(f), ==, 7);
        g_assert_true(maps_memfd(f, 3));
        assert_memfd_page(f, 3, want);
        return;
    }
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_ERROR);
    g_assert_cmpint(res[0].err, ==, ENOMEM);
    g_assert_cmpuint(remapped(f), ==, 8);
    g_assert_false(maps_memfd(f, 3));
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    res = unmerge_page(f, 3, 3);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    assert_memfd_page(f, 3, want);
    g_assert_cmpint(memcmp(page, want, PF_PAGE_SIZE), ==, 0);
}

/* Folding a written page back when copying it into the memfd fails
 * (ENOSPC: a memfd on a full tmpfs): the page stays merged, its write in
 * place, and the unmerge says it failed; later it works. */
static void
test_fault_unmerge_copy(Fixture *f, gconstpointer data)
{
    guint8 *page = f->guest->mem + 2 * PF_PAGE_SIZE;
    g_autofree guint8 *want = NULL;
    const PfWireResult *res;

    send_identical_pool(f);
    res = merge_pages(f, 0, 4, 1);
    g_assert_cmpuint(res[2].status, ==, PF_RESULT_DONE);
    page[99] ^= 0x3c;
    want = g_memdup2(page, PF_PAGE_SIZE);
    pf_test_fault_set("pwrite", 0, -1, ENOSPC, FALSE);
    res = unmerge_page(f, 2, 2);
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_ERROR);
    g_assert_cmpint(res[0].err, ==, ENOSPC);
    g_assert_cmpuint(remapped(f), ==, 4);
    g_assert_false(maps_memfd(f, 2));
    g_assert_cmpint(memcmp(page, want, PF_PAGE_SIZE), ==, 0);
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    res = unmerge_page(f, 2, 3);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    assert_memfd_page(f, 2, want);
    g_assert_true(maps_memfd(f, 2));
}

/* A copy into the memfd that fails partway through a run (ENOSPC: a full
 * tmpfs), stepping back: the run stays merged, the guest's writes in
 * place, and the pages copied before the failure are punched again, not
 * left allocated where nobody maps them, on a tmpfs that is full. */
static void
test_fault_fold_copy_run(Fixture *f, gconstpointer data)
{
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *want = NULL;
    const PfWireResult *res;
    blkcnt_t blocks;

    send_identical_pool(f);
    res = merge_pages(f, 0, 4, 1);
    for (guint i = 0; i < 4; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
        mem[(gsize)i * PF_PAGE_SIZE + 99] ^= 0x3c;
    }
    want = g_memdup2(mem, 4 * PF_PAGE_SIZE);
    blocks = memfd_blocks(f->guest->fd);
    pf_test_fault_set("pwrite", 2, -1, ENOSPC, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_MESSAGE, "*steps back to advise mode*");
    g_assert_false(pf_agent_step_back_try(f->agent, "a test"));
    g_test_assert_expected_messages();
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    g_assert_cmpint(memfd_blocks(f->guest->fd), ==, blocks);
    g_assert_cmpuint(remapped(f), ==, 4);
    g_assert_cmpint(memcmp(mem, want, 4 * PF_PAGE_SIZE), ==, 0);
    for (guint i = 0; i < 4; i++) {
        g_assert_false(maps_memfd(f, i));
    }
    /* Room again: the step back goes through. */
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    g_assert_true(pf_agent_step_back_try(f->agent, "a test"));
    g_assert_cmpuint(remapped(f), ==, 0);
    for (guint i = 0; i < 4; i++) {
        assert_memfd_page(f, i, want + (gsize)i * PF_PAGE_SIZE);
    }
}

/* A merge whose punch did not happen leaves the old page in the memfd; a
 * guest that then zeroes the page must see zeros after the fold-back,
 * not the old page: a zero page is not trusted to be a hole. */
static void
test_fault_fold_zero(Fixture *f, gconstpointer data)
{
    guint8 *page = f->guest->mem;
    const PfWireResult *res;

    send_identical_pool(f);
    pf_test_fault_set("fallocate", 0, 1, 0, FALSE); /* says it punched, did not */
    res = merge_pages(f, 0, 1, 1);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    memset(page, 0, PF_PAGE_SIZE);
    res = unmerge_page(f, 0, 2);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpint(memcmp(page, zero_page_of_test, PF_PAGE_SIZE), ==, 0);
    assert_memfd_page(f, 0, zero_page_of_test);
}

/* A discard whose fold-back stops halfway tells pagefoldd only of the
 * pages that are back in the memfd: the others keep their slots. */
static void
test_fault_discard_partial(Fixture *f, gconstpointer data)
{
    PfWireItem items[16];
    const PfWireResult *res;
    const PfWireRange *wr;

    send_identical_pool(f);
    for (guint i = 0; i < 16; i++) {
        guint page = i < 8 ? i : 8 + i; /* two runs: 0..7 and 16..23 */

        items[i] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0, .page = page, .chunk = 0,
                                 .slot = page };
    }
    res = request(f, items, 16, 1);
    for (guint i = 0; i < 16; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    pf_test_fault_set("mmap-shared", 1, -1, ENOMEM, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*before a discard*");
    pf_agent_discard(f->agent, f->guest->mem, 32 * PF_PAGE_SIZE);
    g_test_assert_expected_messages();
    expect_msg(f, PF_MSG_DISCARD);
    wr = pf_msg_range(&f->msg);
    g_assert_cmpuint(wr->page, ==, 0);
    g_assert_cmpuint(wr->n_pages, ==, 16);
    g_assert_cmpuint(remapped(f), ==, 8);
}

/*
 * Reads DISCARDs until a message of type then (DISCARD: until none comes
 * for a moment), and marks the pages of region they cover in covered
 * (PAGES of them).  A DISCARD may span pages that were never merged.
 */
static void
read_discards(Fixture *f, guint32 region, PfMsgType then, gboolean *covered)
{
    for (;;) {
        const PfWireRange *wr;
        struct pollfd p = { f->conn, POLLIN, 0 };

        if (then == PF_MSG_DISCARD && poll(&p, 1, 200) != 1) {
            return;
        }
        g_assert_true(pf_proto_recv(f->conn, &f->msg, NULL));
        if (f->msg.header.type != PF_MSG_DISCARD) {
            g_assert_cmpuint(f->msg.header.type, ==, then);
            return;
        }
        wr = pf_msg_range(&f->msg);
        g_assert_cmpuint(wr->region, ==, region);
        g_assert_cmpuint(wr->page + wr->n_pages, <=, PAGES);
        for (guint64 k = 0; k < wr->n_pages; k++) {
            covered[wr->page + k] = TRUE;
        }
    }
}

/* Pages [lo, hi) are all covered (want) or none is. */
static void
assert_covered(const gboolean *covered, guint lo, guint hi, gboolean want)
{
    for (guint k = lo; k < hi; k++) {
        g_assert_cmpint(covered[k], ==, want);
    }
}

/* A step back that cannot fold every page back says so: the caller must
 * not hand guest RAM on.  pagefoldd is told to let go; what stays merged
 * stays valid, and a later call finishes the job. */
static void
test_fault_step_back(Fixture *f, gconstpointer data)
{
    g_autofree guint8 *before = g_memdup2(f->guest->mem, PAGES * PF_PAGE_SIZE);
    g_autoptr(GError) error = NULL;

    send_identical_pool(f);
    merge_pages(f, 0, 8, 1);
    pf_test_fault_set("mmap-shared", 0, -1, ENOMEM, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_MESSAGE, "*steps back to advise mode*");
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*pages still merged*");
    g_assert_false(pf_agent_step_back(f->agent, "a test", &error));
    g_test_assert_expected_messages();
    g_assert_error(error, PF_ERROR, PF_ERROR_FAILED);
    g_assert_nonnull(strstr(error->message, "cannot fold merged pages"));
    g_clear_error(&error);
    /* Nothing came back: pagefoldd is told to let go. */
    expect_msg(f, PF_MSG_ERROR);
    g_assert_false(pf_agent_is_connected(f->agent));
    g_assert_cmpuint(remapped(f), ==, 8);
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);

    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    g_assert_true(pf_agent_step_back(f->agent, "a test", &error));
    g_assert_no_error(error);
    g_assert_cmpuint(remapped(f), ==, 0);
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_true(maps_memfd(f, 0));
}

typedef struct {
    guint8 *byte;
    gint stop;
    gint writes;
} Writer;

static gpointer
writer_thread(gpointer data)
{
    Writer *w = data;

    while (!g_atomic_int_get(&w->stop)) {
        (*(volatile guint8 *)w->byte)++;
        g_atomic_int_inc(&w->writes);
        g_usleep(100);
    }
    return NULL;
}

/* Has the writer written since, within 5 s? */
static gboolean
writer_runs(Writer *w)
{
    gint n = g_atomic_int_get(&w->writes);

    for (int i = 0; i < 500; i++) {
        if (g_atomic_int_get(&w->writes) > n + 10) {
            return TRUE;
        }
        g_usleep(10000);
    }
    return FALSE;
}

/*
 * Lifting write protection fails: the range is unregistered instead, and
 * if that fails too the userfaultfd is closed (the agent then gives up
 * its link).  Either way no writer stays blocked.
 */
static void
test_fault_unprotect(Fixture *f, gconstpointer calls)
{
    Writer w = { f->guest->mem + 5 * PF_PAGE_SIZE + 100, 0, 0 };
    GThread *t;

    send_identical_pool(f);
    t = g_thread_new("writer", writer_thread, &w);
    g_assert_true(writer_runs(&w));
    pf_test_fault_set(calls, 0, -1, EINVAL, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*cannot lift write protection*");
    if (strchr(calls, ',') != NULL) {
        g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*closing the userfaultfd*");
        g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*cannot merge any more*");
    }
    merge_pages(f, 0, 32, 1);
    g_assert_true(writer_runs(&w));
    if (strchr(calls, ',') != NULL) {
        expect_msg(f, PF_MSG_ERROR);
        for (int i = 0; i < 200 && pf_agent_is_connected(f->agent); i++) {
            g_usleep(10000);
        }
        g_assert_false(pf_agent_is_connected(f->agent));
    }
    g_test_assert_expected_messages();
    g_atomic_int_set(&w.stop, 1);
    g_thread_join(t);
    g_assert_true(maps_memfd(f, 5));
}

/* Pages in DMA (a device writes them behind the page tables) are neither
 * merged nor folded back until the VMM says the DMA is over. */
static void
test_dma(Fixture *f, gconstpointer data)
{
    gboolean covered[PAGES] = { FALSE };
    guint8 *mem = f->guest->mem;
    const PfWireResult *res;

    send_identical_pool(f);
    pf_agent_dma_map(f->agent, mem + 4 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE);
    res = merge_pages(f, 0, 8, 1);
    for (guint i = 0; i < 8; i++) {
        g_assert_cmpuint(res[i].status, ==, i == 4 || i == 5 ? PF_RESULT_ERROR : PF_RESULT_DONE);
        g_assert_cmpint(res[i].err, ==, i == 4 || i == 5 ? EBUSY : 0);
    }
    g_assert_true(maps_memfd(f, 4));
    mem[10] ^= 1;
    pf_agent_dma_map(f->agent, mem, PF_PAGE_SIZE);
    res = unmerge_page(f, 0, 2);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_ERROR);
    g_assert_cmpint(res[0].err, ==, EBUSY);
    pf_agent_dma_unmap(f->agent, mem, PF_PAGE_SIZE, 0);
    res = unmerge_page(f, 0, 3);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    pf_agent_dma_unmap(f->agent, mem + 4 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE, 0);
    res = merge_pages(f, 4, 2, 4);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpuint(res[1].status, ==, PF_RESULT_DONE);

    /* A step back folds back every merged run not in DMA, and leaves the
     * one that is (pages 1..7, as page 0 was folded back above); once the
     * DMA is over, it finishes.  DMA over pages that are not
     * merged (QEMU keeps some mapped while a device runs) is no matter. */
    res = merge_pages(f, 16, 4, 5);
    g_assert_cmpuint(remapped(f), ==, 11);
    pf_agent_dma_map(f->agent, mem + 6 * PF_PAGE_SIZE, PF_PAGE_SIZE);
    pf_agent_dma_map(f->agent, mem + 40 * PF_PAGE_SIZE, 8 * PF_PAGE_SIZE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_MESSAGE, "*steps back to advise mode*");
    /* The try leaves the run in DMA, and pagefoldd attached. */
    g_assert_false(pf_agent_step_back_try(f->agent, "a test"));
    g_test_assert_expected_messages();
    g_assert_cmpuint(remapped(f), ==, 7);
    /* pagefoldd hears of the pages that came back, and stays. */
    read_discards(f, 0, PF_MSG_DISCARD, covered);
    assert_covered(covered, 16, 20, TRUE);
    assert_covered(covered, 1, 8, FALSE);
    g_assert_true(pf_agent_is_connected(f->agent));
    pf_agent_dma_unmap(f->agent, mem + 6 * PF_PAGE_SIZE, PF_PAGE_SIZE, 0);
    g_assert_true(pf_agent_step_back(f->agent, "a test", NULL));
    g_assert_cmpuint(remapped(f), ==, 0);
    memset(covered, 0, sizeof(covered));
    read_discards(f, 0, PF_MSG_ADVISE, covered);
    assert_covered(covered, 1, 8, TRUE);
    pf_agent_dma_unmap(f->agent, mem + 40 * PF_PAGE_SIZE, 8 * PF_PAGE_SIZE, 0);
}

/*
 * What a device wrote (a disk read: the VMM's unmap says how much) is told
 * to pagefoldd as HINTs of the whole pages it wrote, reads one after
 * another as one range; part of a page (a request's status byte), a write
 * to the disk, an unmap of no mapping and RAM outside the regions tell
 * nothing.  Hints come before the RESULT of a request sent after them.  To
 * a pagefoldd of protocol 1, nothing is told; the pages are counted.
 */
static void
test_dma_written(Fixture *f, gconstpointer data)
{
    gboolean covered[PAGES] = { FALSE };
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *outside = g_malloc(2 * PF_PAGE_SIZE);
    PfAgentStats st;
    guint hints = 0;

    pf_agent_dma_map(f->agent, mem + 8 * PF_PAGE_SIZE, 4 * PF_PAGE_SIZE);
    pf_agent_dma_unmap(f->agent, mem + 8 * PF_PAGE_SIZE, 4 * PF_PAGE_SIZE,
                       2 * PF_PAGE_SIZE + 100);
    pf_agent_dma_map(f->agent, mem + 20 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE);
    pf_agent_dma_map(f->agent, mem + 22 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE);
    pf_agent_dma_unmap(f->agent, mem + 20 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE);
    pf_agent_dma_unmap(f->agent, mem + 22 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE);
    pf_agent_dma_map(f->agent, mem + 30 * PF_PAGE_SIZE, PF_PAGE_SIZE);
    pf_agent_dma_unmap(f->agent, mem + 30 * PF_PAGE_SIZE, PF_PAGE_SIZE, 0);
    pf_agent_dma_map(f->agent, mem + 32 * PF_PAGE_SIZE + 4000, 1);
    pf_agent_dma_unmap(f->agent, mem + 32 * PF_PAGE_SIZE + 4000, 1, 1);
    pf_agent_dma_unmap(f->agent, mem + 40 * PF_PAGE_SIZE, PF_PAGE_SIZE, PF_PAGE_SIZE);
    pf_agent_dma_map(f->agent, outside, 2 * PF_PAGE_SIZE);
    pf_agent_dma_unmap(f->agent, outside, 2 * PF_PAGE_SIZE, 2 * PF_PAGE_SIZE);

    g_assert_true(pf_proto_send_items(f->conn, 9, &(PfWireItem){ .kind = PF_ITEM_UNMERGE,
                                                                  .page = 50 },
                                      1, NULL));
    for (;;) {
        guint32 n;
        const PfWireRange *wr;

        g_assert_true(pf_proto_recv(f->conn, &f->msg, NULL));
        if (f->msg.header.type == PF_MSG_RESULT) {
            break;
        }
        g_assert_cmpuint(f->msg.header.type, ==, PF_MSG_HINT);
        wr = pf_msg_hints(&f->msg, &n);
        for (guint32 i = 0; i < n; i++, hints++) {
            g_assert_cmpuint(wr[i].region, ==, 0);
            for (guint64 k = 0; k < wr[i].n_pages; k++) {
                covered[wr[i].page + k] = TRUE;
            }
            g_test_message("HINT %" G_GUINT64_FORMAT "+%" G_GUINT64_FORMAT, wr[i].page,
                           wr[i].n_pages);
        }
    }
    assert_covered(covered, 0, 8, FALSE);
    assert_covered(covered, 10, 20, FALSE);
    assert_covered(covered, 24, PAGES, FALSE);
    /* Two, or three when the reads were told apart. */
    g_assert_cmpuint(hints, <=, 3);
    pf_agent_get_stats(f->agent, &st);
    if (data == protocol_1) {
        /* Nothing told: not a message protocol 1 has. */
        g_assert_cmpuint(hints, ==, 0);
        g_assert_cmpuint(st.hinted, ==, 0);
        g_assert_cmpuint(st.hints_dropped, ==, 2 + 4);
        return;
    }
    assert_covered(covered, 8, 10, TRUE);
    assert_covered(covered, 20, 24, TRUE);
    g_assert_cmpuint(st.hinted, ==, 2 + 4);
    g_assert_cmpuint(st.hints_dropped, ==, 0);
}

/* ---- pool chunks dropped and ids reused; pages moved between chunks ---- */

static void
send_drop(Fixture *f, guint32 chunk, guint32 n_slots)
{
    PfWirePool p = { chunk, n_slots };

    g_assert_true(pf_proto_send(f->conn, PF_MSG_DROP, 0, &p, sizeof(p), NULL, 0, NULL));
}

/* Merges pages [first, first + n) with slots slot.. of chunk. */
static const PfWireResult *
merge_from(Fixture *f, guint first, guint n, guint32 chunk, guint32 slot, guint32 seq)
{
    PfWireItem items[PAGES];

    for (guint i = 0; i < n; i++) {
        items[i] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0, .page = first + i,
                                 .chunk = chunk, .slot = slot + i };
    }
    return request(f, items, n, seq);
}

/* The agent serves messages in order: once this answer is in, every
 * message sent before it (a DROP has no answer) has been dealt with.  An
 * unmerge of a page never merged changes nothing. */
static void
barrier(Fixture *f, guint32 seq)
{
    g_assert_cmpuint(unmerge_page(f, PAGES - 1, seq)[0].status, ==, PF_RESULT_DONE);
}

/* The mappings of this process (the agent's, the test's, the guest's) of
 * the file open as fd, with permissions perms ("r--s": the agent's compare
 * mapping of a chunk; "rw-p": guest pages mapped from it). */
static guint
maps_of(int fd, const char *perms)
{
    g_autofree char *maps = NULL;
    g_auto(GStrv) lines = NULL;
    struct stat st;
    guint n = 0;

    g_assert_cmpint(fstat(fd, &st), ==, 0);
    g_assert_true(g_file_get_contents("/proc/self/maps", &maps, NULL, NULL));
    lines = g_strsplit(maps, "\n", -1);
    for (guint i = 0; lines[i] != NULL; i++) {
        char p[5];
        unsigned int maj, min;
        guint64 ino;

        if (sscanf(lines[i], "%*x-%*x %4s %*x %x:%x %" G_GUINT64_FORMAT, p, &maj, &min, &ino) ==
                4 &&
            ino == (guint64)st.st_ino && maj == major(st.st_dev) && min == minor(st.st_dev) &&
            g_str_equal(p, perms)) {
            n++;
        }
    }
    return n;
}

/* The descriptors of this process open on the file open as fd. */
static guint
fds_of(int fd)
{
    g_autoptr(GDir) dir = g_dir_open("/proc/self/fd", 0, NULL);
    struct stat st, other;
    const char *name;
    guint n = 0;

    g_assert_nonnull(dir);
    g_assert_cmpint(fstat(fd, &st), ==, 0);
    while ((name = g_dir_read_name(dir)) != NULL) {
        g_autofree char *path = g_build_filename("/proc/self/fd", name, NULL);

        if (stat(path, &other) == 0 && other.st_dev == st.st_dev && other.st_ino == st.st_ino) {
            n++;
        }
    }
    return n;
}

/* The page frame that backs addr, read first so that it is mapped in (the
 * test runs as root: pagemap shows frames). */
static guint64
pfn_of(const void *addr)
{
    guint64 e;

    (void)*(const volatile guint8 *)addr;
    e = pagemap_entry(addr);

    g_assert_true(e & (1ull << 63)); /* present */
    return e & ((1ull << 55) - 1);
}

static PfAgentStats
stats_of(Fixture *f)
{
    PfAgentStats st;

    pf_agent_get_stats(f->agent, &st);
    return st;
}

/*
 * Once no page maps a chunk, pagefoldd drops it: the agent closes it and
 * unmaps its compare mapping (the chunk's memory is freed once nobody
 * maps it), and the same id may come again, with other memory.
 */
static void
test_drop(Fixture *f, gconstpointer data)
{
    guint8 *mem = f->guest->mem, *map2;
    g_autofree guint8 *before = g_memdup2(mem, PAGES * PF_PAGE_SIZE);
    const PfWireResult *res;
    int fd2;

    send_identical_pool(f);
    res = merge_pages(f, 0, 8, 1);
    for (guint i = 0; i < 8; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    /* Held: the test's fd and the agent's, its compare mapping, pages. */
    g_assert_cmpuint(fds_of(f->pool_fd), ==, 2);
    g_assert_cmpuint(maps_of(f->pool_fd, "r--s"), ==, 1);
    g_assert_cmpuint(maps_of(f->pool_fd, "rw-p"), >, 0);
    for (guint i = 0; i < 8; i++) {
        g_assert_cmpuint(unmerge_page(f, i, 2 + i)[0].status, ==, PF_RESULT_DONE);
    }
    g_assert_cmpuint(maps_of(f->pool_fd, "rw-p"), ==, 0);

    send_drop(f, 0, PAGES);
    barrier(f, 10);
    g_assert_cmpuint(fds_of(f->pool_fd), ==, 1);
    g_assert_cmpuint(maps_of(f->pool_fd, "r--s"), ==, 0);
    /* Dropped, it is unknown: an item of it is refused. */
    res = merge_pages(f, 0, 1, 11);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_ERROR);
    g_assert_cmpint(res[0].err, ==, EINVAL);

    /* The same id, other memory: slots 5..8 hold pages 0..3 now. */
    fd2 = make_pool(64, TRUE, &map2);
    memcpy(map2 + 5 * PF_PAGE_SIZE, mem, 4 * PF_PAGE_SIZE);
    send_pool(f, fd2, 0, 64);
    res = merge_from(f, 0, 4, 0, 5, 12);
    for (guint i = 0; i < 4; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
        g_assert_cmpuint(pfn_of(mem + i * PF_PAGE_SIZE), ==,
                         pfn_of(map2 + (5 + i) * PF_PAGE_SIZE));
    }
    g_assert_cmpuint(fds_of(fd2), ==, 2);
    g_assert_cmpuint(maps_of(fd2, "r--s"), ==, 1);
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_true(pf_agent_is_connected(f->agent));
    munmap(map2, 64 * PF_PAGE_SIZE);
    close(fd2);
}

typedef enum { DROP_NEVER_SENT, DROP_TWICE, DROP_WRONG_SIZE } BadDrop;

/*
 * A DROP of a chunk the agent does not hold (never sent, dropped already)
 * or of another size: pagefoldd's idea of this VM is wrong.  The agent
 * says why and disconnects; merged pages stay valid.
 */
static void
test_drop_bad(Fixture *f, gconstpointer data)
{
    BadDrop how = GPOINTER_TO_INT(data);
    g_autofree guint8 *before = g_memdup2(f->guest->mem, PAGES * PF_PAGE_SIZE);
    static const char *const want[] = {
        "DROP of pool chunk 7, which this agent does not hold",
        "DROP of pool chunk 0, which this agent does not hold",
        "DROP of pool chunk 0 of 16 slots, which this agent holds with 256",
    };
    g_autofree char *said = NULL;
    const PfWireResult *res;

    send_identical_pool(f);
    res = merge_pages(f, 0, 8, 1);
    g_assert_cmpuint(res[7].status, ==, PF_RESULT_DONE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*DROP of pool chunk*disconnecting");
    if (how == DROP_NEVER_SENT) {
        send_drop(f, 7, 16);
    } else if (how == DROP_TWICE) {
        send_drop(f, 0, PAGES);
        send_drop(f, 0, PAGES);
    } else {
        send_drop(f, 0, 16);
    }
    expect_msg(f, PF_MSG_ERROR);
    said = g_strndup((const char *)f->msg.payload, f->msg.header.length);
    g_assert_cmpstr(said, ==, want[how]);
    for (int i = 0; i < 200 && pf_agent_is_connected(f->agent); i++) {
        g_usleep(10000);
    }
    g_assert_false(pf_agent_is_connected(f->agent));
    g_test_assert_expected_messages();
    g_assert_cmpuint(remapped(f), ==, 8);
    g_assert_cmpint(memcmp(f->guest->mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
}

/* Chunk ids go up to the protocol's limit; an id held is not taken again
 * without a DROP first. */
static void
test_pool_ids(Fixture *f, gconstpointer data)
{
    guint8 *map2;
    int fd2 = make_pool(16, TRUE, &map2);
    const PfWireResult *res;

    memcpy(map2 + 3 * PF_PAGE_SIZE, f->guest->mem, PF_PAGE_SIZE);
    send_pool(f, fd2, PF_PROTO_MAX_CHUNKS - 1, 16);
    res = merge_from(f, 0, 1, PF_PROTO_MAX_CHUNKS - 1, 3, 1);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpuint(pfn_of(f->guest->mem), ==, pfn_of(map2 + 3 * PF_PAGE_SIZE));

    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*sent again without a DROP*");
    send_pool(f, fd2, PF_PROTO_MAX_CHUNKS - 1, 16);
    expect_msg(f, PF_MSG_ERROR);
    for (int i = 0; i < 200 && pf_agent_is_connected(f->agent); i++) {
        g_usleep(10000);
    }
    g_assert_false(pf_agent_is_connected(f->agent));
    g_test_assert_expected_messages();
    /* Refused, the second copy of the fd was closed. */
    g_assert_cmpuint(fds_of(fd2), ==, 2);
    munmap(map2, 16 * PF_PAGE_SIZE);
    close(fd2);
}

/* Chunk B (id 1) of the fixture's move tests: slots 10..33 hold pages
 * 0..23 of guest RAM, which chunk A (id 0) holds in slots 0..23. */
static int
send_chunk_b(Fixture *f, guint8 **map)
{
    int fd = make_pool(PAGES, TRUE, map);

    memcpy(*map + 10 * PF_PAGE_SIZE, f->guest->mem, 24 * PF_PAGE_SIZE);
    send_pool(f, fd, 1, PAGES);
    return fd;
}

/*
 * pagefoldd moves merged pages to another slot of the same content (to
 * empty a chunk it can then drop) with ordinary merge items: the pages
 * map the new slot, the old one is no longer mapped, and they behave as
 * any merged page after.  A run may mix moved pages and new merges.
 */
static void
test_move(Fixture *f, gconstpointer data)
{
    guint8 *mem = f->guest->mem, *map_b;
    g_autofree guint8 *before = g_memdup2(mem, PAGES * PF_PAGE_SIZE);
    g_autofree guint8 *want = NULL;
    const PfWireResult *res;
    PfAgentStats st;
    int fd_b;

    send_identical_pool(f);
    fd_b = send_chunk_b(f, &map_b);
    res = merge_pages(f, 0, 16, 1);
    for (guint i = 0; i < 16; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    /* Pages 0..15 move from A to B, 16..19 are merged from the memfd. */
    res = merge_from(f, 0, 20, 1, 10, 2);
    for (guint i = 0; i < 20; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
        g_assert_cmpuint(pfn_of(mem + i * PF_PAGE_SIZE), ==,
                         pfn_of(map_b + (10 + i) * PF_PAGE_SIZE));
    }
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(maps_of(f->pool_fd, "rw-p"), ==, 0);
    st = stats_of(f);
    g_assert_cmpuint(st.merged, ==, 20);
    g_assert_cmpuint(st.moved, ==, 16);
    g_assert_cmpuint(st.remapped, ==, 20);

    /* A write after the move copies on write: B's slot stays as it was. */
    mem[2 * PF_PAGE_SIZE + 5] ^= 0xff;
    g_assert_false(pagemap_entry(mem + 2 * PF_PAGE_SIZE) & (1ull << 61));
    g_assert_cmpuint(map_b[12 * PF_PAGE_SIZE + 5], ==, before[2 * PF_PAGE_SIZE + 5]);
    want = g_memdup2(mem + 2 * PF_PAGE_SIZE, PF_PAGE_SIZE);

    /* Folded back, each page has its content in the memfd. */
    g_assert_cmpuint(unmerge_page(f, 2, 3)[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpuint(unmerge_page(f, 7, 4)[0].status, ==, PF_RESULT_DONE);
    assert_memfd_page(f, 2, want);
    assert_memfd_page(f, 7, before + 7 * PF_PAGE_SIZE);
    g_assert_true(maps_memfd(f, 2));
    g_assert_true(maps_memfd(f, 7));
    g_assert_cmpuint(remapped(f), ==, 18);

    /* A is mapped by no page now: it can go. */
    send_drop(f, 0, PAGES);
    barrier(f, 5);
    g_assert_cmpuint(fds_of(f->pool_fd), ==, 1);
    g_assert_true(pf_agent_is_connected(f->agent));
    g_assert_cmpint(memcmp(mem + 3 * PF_PAGE_SIZE, before + 3 * PF_PAGE_SIZE,
                           (PAGES - 3) * PF_PAGE_SIZE), ==, 0);
    munmap(map_b, PAGES * PF_PAGE_SIZE);
    close(fd_b);
}

/*
 * A move whose MAP_FIXED fails.  The moved pages' memfd pages are holes:
 * mapping the memfd there would show the guest zeros.  Early (the old
 * mapping stays): nothing changes, the pages still map chunk A.  Late
 * (the kernel unmapped the old pages first): the known content goes into
 * the memfd, mapped again.  And when the advice fails after the move, the
 * pages are folded back with their content.  Each time the move is
 * reported as not done, and the guest's RAM is what it was.
 */
static void
test_move_fails(Fixture *f, gconstpointer data)
{
    guint8 *mem = f->guest->mem, *map_b;
    g_autofree guint8 *before = g_memdup2(mem, PAGES * PF_PAGE_SIZE);
    const PfWireResult *res;
    blkcnt_t blocks;
    PfAgentStats st;
    int fd_b;

    send_identical_pool(f);
    fd_b = send_chunk_b(f, &map_b);
    res = merge_pages(f, 0, 16, 1);
    g_assert_cmpuint(res[15].status, ==, PF_RESULT_DONE);
    blocks = memfd_blocks(f->guest->fd);

    /* Early: pages 0..15 still map A, 16..19 the memfd. */
    pf_test_fault_set("mmap-private", 0, 1, ENOMEM, FALSE);
    res = merge_from(f, 0, 20, 1, 10, 2);
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    assert_all_failed(res, 20, ENOMEM);
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    for (guint i = 0; i < 16; i++) {
        g_assert_cmpuint(pfn_of(mem + i * PF_PAGE_SIZE), ==,
                         pfn_of(f->pool_map + i * PF_PAGE_SIZE));
    }
    g_assert_cmpint(memfd_blocks(f->guest->fd), ==, blocks);
    g_assert_cmpuint(remapped(f), ==, 16);
    for (guint i = 16; i < 20; i++) {
        g_assert_true(maps_memfd(f, i));
    }

    /* Late: the content of all 20 pages is in the memfd, mapped again. */
    pf_test_fault_set("mmap-private", 0, 1, ENOMEM, TRUE);
    res = merge_from(f, 0, 20, 1, 10, 3);
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    assert_all_failed(res, 20, ENOMEM);
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    g_assert_cmpuint(remapped(f), ==, 0);
    for (guint i = 0; i < 20; i++) {
        assert_memfd_page(f, i, before + i * PF_PAGE_SIZE);
        g_assert_true(maps_memfd(f, i));
    }

    /* The advice after the move fails: folded back, content and all. */
    res = merge_pages(f, 0, 16, 4);
    g_assert_cmpuint(res[15].status, ==, PF_RESULT_DONE);
    pf_test_fault_set("madvise", 0, 1, EPERM, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*after merging pc.ram*folding it back*");
    res = merge_from(f, 0, 16, 1, 10, 5);
    g_test_assert_expected_messages();
    for (guint i = 0; i < 16; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_ERROR);
        g_assert_cmpint(res[i].err, ==, EPERM);
        assert_memfd_page(f, i, before + i * PF_PAGE_SIZE);
        g_assert_true(maps_memfd(f, i));
    }
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    st = stats_of(f);
    g_assert_cmpuint(st.remapped, ==, 0);
    g_assert_cmpuint(st.merged, ==, 32);
    g_assert_cmpuint(st.moved, ==, 0);
    g_assert_cmpuint(st.errors, ==, 56);

    /* And once the kernel agrees, the move works. */
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    g_assert_cmpuint(merge_pages(f, 0, 16, 6)[15].status, ==, PF_RESULT_DONE);
    res = merge_from(f, 0, 16, 1, 10, 7);
    for (guint i = 0; i < 16; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
        g_assert_cmpuint(pfn_of(mem + i * PF_PAGE_SIZE), ==,
                         pfn_of(map_b + (10 + i) * PF_PAGE_SIZE));
    }
    g_assert_cmpuint(stats_of(f).moved, ==, 16);
    g_assert_cmpint(memcmp(mem, before, PAGES * PF_PAGE_SIZE), ==, 0);
    munmap(map_b, PAGES * PF_PAGE_SIZE);
    close(fd_b);
}

/*
 * A move whose MAP_FIXED failed after unmapping the old pages, when the
 * moved pages' content cannot be written into the memfd either: guest RAM
 * would be lost, and the process ends saying so (as when the memfd cannot
 * be mapped back).  Run in a child process.
 */
static void
test_move_fails_copy(Fixture *f, gconstpointer data)
{
    guint8 *map_b;

    if (!g_test_subprocess()) {
        g_test_trap_subprocess(NULL, 0, G_TEST_SUBPROCESS_DEFAULT);
        g_test_trap_assert_failed();
        g_test_trap_assert_stderr("*cannot write merged pages of guest RAM pc.ram*into its "
                                  "memfd*No space left on device*");
        return;
    }
    send_identical_pool(f);
    send_chunk_b(f, &map_b);
    g_assert_cmpuint(merge_pages(f, 0, 4, 1)[3].status, ==, PF_RESULT_DONE);
    pf_test_fault_set("mmap-private,pwrite", 0, -1, ENOSPC, TRUE);
    merge_from(f, 0, 4, 1, 10, 2);
    g_assert_not_reached();
}

/* The VmFlags of the mapping at addr, from /proc/self/smaps. */
static char *
vma_flags(const void *addr)
{
    g_autofree char *smaps = NULL;
    g_auto(GStrv) lines = NULL;
    gboolean in = FALSE;

    g_assert_true(g_file_get_contents("/proc/self/smaps", &smaps, NULL, NULL));
    lines = g_strsplit(smaps, "\n", -1);
    for (guint i = 0; lines[i] != NULL; i++) {
        guint64 lo, hi;

        if (sscanf(lines[i], "%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x ", &lo, &hi) == 2 &&
            strchr(lines[i], ' ') == lines[i] + strcspn(lines[i], " ")) {
            in = (guintptr)addr >= lo && (guintptr)addr < hi;
        } else if (in && g_str_has_prefix(lines[i], "VmFlags:")) {
            return g_strdup(lines[i]);
        }
    }
    return g_strdup("");
}

typedef enum { UNSAFE_SETUP_FAILS, UNSAFE_LOCKED, UNSAFE_NUMA } Unsafe;

/*
 * The VM stays in advise mode, with the reason, and holds no userfaultfd
 * registration (postcopy or a background snapshot may want one later):
 * when guest memory is locked (every merge would be copied on write at
 * once), when all guest RAM has a NUMA policy (pool pages would not follow
 * it).  When only the second region cannot be write-protected, that region
 * alone is refused, unregistered, with the reason: the first merges.
 */
static void
test_unsafe(gconstpointer data)
{
    Unsafe how = GPOINTER_TO_INT(data);
    PfLayout l = { .identical = PAGES };
    g_autoptr(PfGuest) guest = pf_guest_new("memory-backend-memfd", &l, 1);
    g_autoptr(PfTestPeer) peer = pf_test_peer_new();
    g_autoptr(PfAgent) agent = pf_agent_new("vm-test", NULL);
    static const char *const why[] = { "cannot write-protect region ram1",
                                       "guest memory is locked", "NUMA memory policy" };
    g_autofree char *flags = NULL, *reason = NULL;

    for (guint i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("ram%u", i);
        PfAgentRegion r = { name, guest->mem + i * (PAGES / 2) * PF_PAGE_SIZE,
                            (PAGES / 2) * PF_PAGE_SIZE, guest->fd, i * (PAGES / 2) * PF_PAGE_SIZE };

        g_assert_true(pf_agent_add_region(agent, &r, NULL));
    }
    pf_agent_set_syscalls(agent, &pf_test_faulty_syscalls);
    pf_test_fault_set(how == UNSAFE_SETUP_FAILS ? "register" : NULL, 1, -1, EINVAL, FALSE);
#ifdef __SANITIZE_ADDRESS__
    if (how == UNSAFE_LOCKED) {
        /* ASan maps its own memory as it goes: locked, it fails. */
        g_test_skip("mlockall under AddressSanitizer");
        return;
    }
#endif
    if (how == UNSAFE_LOCKED) {
        /* Future mappings only: locking ASan's shadow would never end. */
        g_assert_cmpint(mlockall(MCL_FUTURE), ==, 0);
    } else if (how == UNSAFE_NUMA) {
        unsigned long node0 = 1;

        g_assert_cmpint(syscall(SYS_mbind, guest->mem, PAGES * PF_PAGE_SIZE, MPOL_BIND, &node0,
                                sizeof(node0) * 8, 0), ==, 0);
    }
    if (how == UNSAFE_SETUP_FAILS) {
        g_autoptr(GPtrArray) regions = NULL;
        PfAgentRegionInfo *r0, *r1;

        g_test_expect_message("pagefold", G_LOG_LEVEL_MESSAGE, "*ram1*its other RAM merges*");
        g_assert_cmpint(pf_test_peer_accept(peer, agent), ==, PF_MODE_MERGE);
        g_test_assert_expected_messages();
        regions = pf_agent_get_regions(agent);
        g_assert_cmpuint(regions->len, ==, 2);
        r0 = g_ptr_array_index(regions, 0);
        r1 = g_ptr_array_index(regions, 1);
        g_assert_null(r0->refused);
        g_assert_nonnull(strstr(r1->refused, why[how]));
        flags = vma_flags(guest->mem + (PAGES / 2) * PF_PAGE_SIZE);
        g_assert_null(strstr(flags, " uw"));
        pf_test_fault_set(NULL, 0, 0, 0, FALSE);
        return;
    }
    g_test_expect_message("pagefold", G_LOG_LEVEL_MESSAGE, "*stays in advise mode*");
    g_assert_cmpint(pf_test_peer_accept(peer, agent), ==, PF_MODE_ADVISE);
    g_test_assert_expected_messages();
    if (how == UNSAFE_LOCKED) {
        munlockall();
    }
    reason = pf_agent_dup_reason(agent);
    g_assert_nonnull(strstr(reason, why[how]));
    flags = vma_flags(guest->mem);
    g_assert_nonnull(strstr(flags, " sh"));
    g_assert_null(strstr(flags, " uw"));
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
}

/* ---- RAM that comes and goes, and a pagefoldd that does not answer ---- */

/*
 * A region plugged in while the VM merges is write-protected and told at
 * once, and merges; unplugged, its merged pages come back into its memfd,
 * its protection and the agent's dup of its memfd go, pagefoldd hears
 * GONE, and items for it are refused.
 */
static void
test_plug_unplug(Fixture *f, gconstpointer data)
{
    gboolean covered[PAGES] = { FALSE };
    PfLayout l = { .unique = PAGES };
    g_autoptr(PfGuest) dimm = pf_guest_new("memory-backend-memfd", &l, 7);
    PfAgentRegion r = { "dimm0", dimm->mem, PAGES * PF_PAGE_SIZE, dimm->fd, 0, { 0 } };
    g_autofree guint8 *before = g_memdup2(dimm->mem, 4 * PF_PAGE_SIZE);
    g_autofree char *flags = NULL;
    PfWireItem items[4];
    const PfWireResult *res;
    const PfWireRegion *wr;
    const PfWireRange *gone;

    g_assert_true(pf_agent_add_region(f->agent, &r, NULL));
    expect_msg(f, PF_MSG_REGION);
    wr = pf_msg_region(&f->msg);
    g_assert_cmpuint(wr->index, ==, 1);
    g_assert_cmpuint(wr->host_addr, ==, (guintptr)dimm->mem);
    g_assert_cmpuint(f->msg.n_fds, ==, 1);
    pf_msg_close_fds(&f->msg);
    flags = vma_flags(dimm->mem);
    g_assert_nonnull(strstr(flags, " uw"));
    g_clear_pointer(&flags, g_free);

    /* Its first four pages merge with slots that hold their content. */
    memcpy(f->pool_map + 100 * PF_PAGE_SIZE, dimm->mem, 4 * PF_PAGE_SIZE);
    send_pool(f, f->pool_fd, 0, PAGES);
    for (guint i = 0; i < 4; i++) {
        items[i] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 1, .page = i, .chunk = 0,
                                 .slot = 100 + i };
    }
    res = request(f, items, 4, 1);
    for (guint i = 0; i < 4; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    g_assert_cmpuint(remapped(f), ==, 4);
    g_assert_cmpuint(maps_of(f->pool_fd, "rw-p"), >=, 1);

    g_assert_true(pf_agent_remove_region(f->agent, dimm->mem, TRUE, NULL));
    read_discards(f, 1, PF_MSG_GONE, covered);
    assert_covered(covered, 0, 4, TRUE);
    gone = pf_msg_range(&f->msg);
    g_assert_cmpuint(gone->region, ==, 1);
    g_assert_cmpuint(gone->page, ==, 0);
    g_assert_cmpuint(gone->n_pages, ==, PAGES);
    g_assert_cmpuint(remapped(f), ==, 0);
    g_assert_cmpuint(maps_of(f->pool_fd, "rw-p"), ==, 0);
    for (guint i = 0; i < 4; i++) {
        guint8 back[PF_PAGE_SIZE];

        g_assert_cmpint(pread(dimm->fd, back, PF_PAGE_SIZE, (off_t)i * PF_PAGE_SIZE), ==,
                        PF_PAGE_SIZE);
        g_assert_cmpint(memcmp(back, before + i * PF_PAGE_SIZE, PF_PAGE_SIZE), ==, 0);
    }
    flags = vma_flags(dimm->mem);
    g_assert_null(strstr(flags, " uw"));
    g_assert_cmpuint(fds_of(dimm->fd), ==, 1); /* the test's own */

    /* Gone: pagefoldd's late items find nothing to act on. */
    res = request(f, items, 1, 2);
    assert_all_failed(res, 1, EINVAL);
    /* Unplugged twice: nothing more happens, nothing is said. */
    g_assert_true(pf_agent_remove_region(f->agent, dimm->mem, TRUE, NULL));
    barrier(f, 3);
}

/*
 * Unplugging fails when the memfd cannot be mapped back: kept (a DIMM's
 * backend lives on), the region stays as it was, merged and merging, and
 * a later call removes it; not kept (its memory is being freed), it goes
 * all the same, and pagefoldd is told to let go rather than free slots
 * still mapped.
 */
static void
test_unplug_fails(Fixture *f, gconstpointer data)
{
    PfLayout l = { .unique = PAGES };
    g_autoptr(PfGuest) dimm = pf_guest_new("memory-backend-memfd", &l, 7);
    PfAgentRegion r = { "dimm0", dimm->mem, PAGES * PF_PAGE_SIZE, dimm->fd, 0, { 0 } };
    g_autoptr(GError) error = NULL;
    PfWireItem it = { .kind = PF_ITEM_MERGE, .region = 1, .page = 0, .chunk = 0, .slot = 100 };

    g_assert_true(pf_agent_add_region(f->agent, &r, NULL));
    expect_msg(f, PF_MSG_REGION);
    pf_msg_close_fds(&f->msg);
    memcpy(f->pool_map + 100 * PF_PAGE_SIZE, dimm->mem, 2 * PF_PAGE_SIZE);
    send_pool(f, f->pool_fd, 0, PAGES);
    g_assert_cmpuint(request(f, &it, 1, 1)[0].status, ==, PF_RESULT_DONE);

    pf_test_fault_set("mmap-shared", 0, -1, ENOMEM, FALSE);
    g_assert_false(pf_agent_remove_region(f->agent, dimm->mem, TRUE, &error));
    g_assert_error(error, PF_ERROR, PF_ERROR_FAILED);
    g_assert_cmpuint(remapped(f), ==, 1);
    /* Still merging: its next page merges. */
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    it.page = 1;
    it.slot = 101;
    g_assert_cmpuint(request(f, &it, 1, 2)[0].status, ==, PF_RESULT_DONE);
    g_assert_cmpuint(remapped(f), ==, 2);

    pf_test_fault_set("mmap-shared", 0, -1, ENOMEM, FALSE);
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*still mapped from the pool*");
    g_assert_true(pf_agent_remove_region(f->agent, dimm->mem, FALSE, NULL));
    g_test_assert_expected_messages();
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    expect_msg(f, PF_MSG_ERROR);
    g_assert_false(pf_agent_is_connected(f->agent));
    g_assert_cmpuint(remapped(f), ==, 0);
    g_assert_cmpuint(fds_of(dimm->fd), ==, 1); /* the test's own */
}

/*
 * pagefoldd accepts the connection and never answers.  Starting the agent
 * returns at once, and so do the calls QEMU makes under its big lock (a
 * discard, a step back) while the handshake waits; after some seconds the
 * agent gives up, and the VM runs unmerged, saying why.
 */
static void
test_silent_daemon(void)
{
    PfLayout l = { .identical = PAGES };
    g_autoptr(PfGuest) guest = pf_guest_new("memory-backend-memfd", &l, 1);
    g_autoptr(PfTestPeer) peer = pf_test_peer_new();
    g_autoptr(PfAgent) agent = pf_agent_new("vm-silent", NULL);
    PfAgentRegion r = { "pc.ram", guest->mem, PAGES * PF_PAGE_SIZE, guest->fd, 0, { 0 } };
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);
    g_autoptr(GError) error = NULL;
    g_autofree char *reason = NULL;
    int conn;

    g_assert_true(pf_agent_add_region(agent, &r, NULL));
    /* Nobody has accepted yet: the listen queue holds the connection. */
    g_assert_true(pf_agent_start(agent, peer->path, &error));
    g_assert_no_error(error);
    conn = accept4(peer->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    g_assert_cmpint(conn, >=, 0);
    g_assert_true(pf_proto_recv(conn, msg, NULL));
    g_assert_cmpuint(msg->header.type, ==, PF_MSG_HELLO);
    pf_agent_discard(agent, guest->mem, PAGES * PF_PAGE_SIZE);
    g_assert_false(pf_agent_is_connected(agent));

    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING, "*runs unmerged*did not answer*");
    g_assert_false(pf_agent_wait_settled(agent, &error));
    g_test_assert_expected_messages();
    g_assert_nonnull(strstr(error->message, "did not answer"));
    g_assert_cmpint(pf_agent_get_mode(agent), ==, PF_MODE_ADVISE);
    reason = pf_agent_dup_reason(agent);
    g_assert_nonnull(strstr(reason, "not attached to pagefoldd"));
    g_assert_true(pf_agent_step_back(agent, "test", NULL));
    close(conn);
}

/*
 * RAM that comes and goes while the handshake waits for pagefoldd: a
 * region gone before it was told is never told (its index goes with it);
 * one told in HELLO's wake and gone before READY is told GONE after READY;
 * one plugged in meanwhile follows READY, with the next index.
 */
static void
test_handshake_window(void)
{
    PfLayout l = { .identical = PAGES };
    g_autoptr(PfGuest) g0 = pf_guest_new("memory-backend-memfd", &l, 1);
    g_autoptr(PfGuest) g1 = pf_guest_new("memory-backend-memfd", &l, 2);
    g_autoptr(PfGuest) g2 = pf_guest_new("memory-backend-memfd", &l, 3);
    g_autoptr(PfGuest) g3 = pf_guest_new("memory-backend-memfd", &l, 4);
    g_autoptr(PfTestPeer) peer = pf_test_peer_new();
    g_autoptr(PfAgent) agent = pf_agent_new("vm-window", NULL);
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);
    PfWireMode welcome = { PF_PROTO_VERSION, PF_MODE_MERGE, "" };
    PfAgentRegion r[4] = {
        { "r0", g0->mem, PAGES * PF_PAGE_SIZE, g0->fd, 0, { 0 } },
        { "r1", g1->mem, PAGES * PF_PAGE_SIZE, g1->fd, 0, { 0 } },
        { "r2", g2->mem, PAGES * PF_PAGE_SIZE, g2->fd, 0, { 0 } },
        { "r3", g3->mem, PAGES * PF_PAGE_SIZE, g3->fd, 0, { 0 } },
    };
    int conn;

    /* r1 comes and goes before the start: HELLO has r0 and r2. */
    for (guint i = 0; i < 3; i++) {
        g_assert_true(pf_agent_add_region(agent, &r[i], NULL));
    }
    g_assert_true(pf_agent_remove_region(agent, g1->mem, TRUE, NULL));
    g_assert_true(pf_agent_start(agent, peer->path, NULL));
    conn = accept4(peer->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    g_assert_true(pf_proto_recv(conn, msg, NULL));
    g_assert_cmpuint(msg->header.type, ==, PF_MSG_HELLO);
    g_assert_cmpuint(pf_msg_hello(msg)->n_regions, ==, 2);
    for (guint i = 0; i < 2; i++) {
        g_assert_true(pf_proto_recv(conn, msg, NULL));
        g_assert_cmpuint(msg->header.type, ==, PF_MSG_REGION);
        g_assert_cmpuint(pf_msg_region(msg)->index, ==, i);
        pf_msg_close_fds(msg);
    }
    /* While WELCOME is awaited: r2 (told) goes, r3 comes, r1 comes and
     * goes again before anyone hears of it. */
    g_assert_true(pf_agent_remove_region(agent, g2->mem, TRUE, NULL));
    g_assert_true(pf_agent_add_region(agent, &r[3], NULL));
    g_assert_true(pf_agent_add_region(agent, &r[1], NULL));
    g_assert_true(pf_agent_remove_region(agent, g1->mem, TRUE, NULL));
    g_assert_true(pf_proto_send(conn, PF_MSG_WELCOME, 0, &welcome, sizeof(welcome),
                                NULL, 0, NULL));
    g_assert_true(pf_proto_recv(conn, msg, NULL));
    g_assert_cmpuint(msg->header.type, ==, PF_MSG_READY);
    g_assert_cmpuint(pf_msg_mode(msg)->mode, ==, PF_MODE_MERGE);
    g_assert_true(pf_proto_recv(conn, msg, NULL));
    g_assert_cmpuint(msg->header.type, ==, PF_MSG_REGION);
    g_assert_cmpuint(pf_msg_region(msg)->index, ==, 2);
    g_assert_cmpuint(pf_msg_region(msg)->host_addr, ==, (guintptr)g3->mem);
    pf_msg_close_fds(msg);
    g_assert_true(pf_proto_recv(conn, msg, NULL));
    g_assert_cmpuint(msg->header.type, ==, PF_MSG_GONE);
    g_assert_cmpuint(pf_msg_range(msg)->region, ==, 1);
    g_assert_true(pf_agent_wait_settled(agent, NULL));
    g_clear_pointer(&agent, pf_agent_free);
    close(conn);
}

/*
 * pagefoldd stops reading: the agent's thread blocks on a full socket.  A
 * discard (QEMU calls it under its big lock) still folds merged pages back
 * and returns at once, the link stays up, and once pagefoldd reads again it
 * hears of the discard after every result that went before it.
 */
static void
test_discard_stalled(Fixture *f, gconstpointer data)
{
    g_autofree PfWireItem *items = g_new0(PfWireItem, PF_PROTO_MAX_ITEMS);
    PfAgentStats st;
    guint64 requests = 0;
    guint32 sent = 0, results = 0;
    const PfWireRange *wr;

    send_identical_pool(f);
    merge_pages(f, 0, 8, 1);
    g_assert_cmpuint(remapped(f), ==, 8);
    for (guint i = 0; i < PF_PROTO_MAX_ITEMS; i++) {
        items[i] = (PfWireItem){ .kind = PF_ITEM_UNMERGE, .region = 0, .page = PAGES - 1 };
    }
    /* Requests until the agent stops taking them: its answers fill the
     * socket, and its requests counter stands still. */
    g_assert_cmpint(fcntl(f->conn, F_SETFL, O_NONBLOCK), ==, 0);
    for (guint idle = 0; idle < 3 && sent < 10000;) {
        if (pf_proto_send_items(f->conn, 2 + sent, items, PF_PROTO_MAX_ITEMS, NULL)) {
            sent++;
            continue;
        }
        g_usleep(100000);
        pf_agent_get_stats(f->agent, &st);
        idle = st.requests == requests ? idle + 1 : 0;
        requests = st.requests;
    }
    g_assert_cmpuint(sent, <, 10000);
    g_assert_cmpuint(requests, <, sent + 1);

    pf_agent_discard(f->agent, f->guest->mem, 8 * PF_PAGE_SIZE);
    g_assert_cmpuint(remapped(f), ==, 0);
    g_assert_true(pf_agent_is_connected(f->agent));

    g_assert_cmpint(fcntl(f->conn, F_SETFL, 0), ==, 0);
    do {
        g_assert_true(pf_proto_recv(f->conn, &f->msg, NULL));
    } while (f->msg.header.type == PF_MSG_RESULT && ++results);
    g_assert_cmpuint(f->msg.header.type, ==, PF_MSG_DISCARD);
    /* Every request the agent had handled before the discard was
     * answered before it. */
    g_assert_cmpuint(results, >=, requests - 1);
    wr = pf_msg_range(&f->msg);
    g_assert_cmpuint(wr->page, ==, 0);
    g_assert_cmpuint(wr->n_pages, ==, 8);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add("/agent-proto/merge-zero-unmerge", Fixture, NULL, setup, test_merge_zero_unmerge,
               teardown);
    g_test_add("/agent-proto/bad-items", Fixture, NULL, setup, test_bad_items, teardown);
    g_test_add("/agent-proto/collapse-merged", Fixture, NULL, setup_extent,
               test_collapse_merged, teardown);
    g_test_add("/agent-proto/unsealed-pool", Fixture, NULL, setup, test_unsealed_pool, teardown);
    g_test_add("/agent-proto/bad-messages", Fixture, NULL, setup, test_bad_messages, teardown);
    g_test_add("/agent-proto/fault/merge-map-early", Fixture, NULL, setup, test_fault_merge_mmap,
               teardown);
    g_test_add("/agent-proto/fault/merge-map-late", Fixture, "late", setup,
               test_fault_merge_mmap, teardown);
    g_test_add("/agent-proto/fault/merge-punch", Fixture, "fallocate", setup,
               test_fault_merge_punch, teardown);
    g_test_add("/agent-proto/fault/merge-advice", Fixture, "madvise", setup,
               test_fault_merge_punch, teardown);
    g_test_add("/agent-proto/fault/unmerge-map-early", Fixture, NULL, setup,
               test_fault_unmerge_mmap, teardown);
    g_test_add("/agent-proto/fault/unmerge-map-late", Fixture, "late", setup,
               test_fault_unmerge_mmap, teardown);
    g_test_add("/agent-proto/fault/unmerge-copy", Fixture, NULL, setup, test_fault_unmerge_copy,
               teardown);
    g_test_add("/agent-proto/fault/fold-copy-run", Fixture, NULL, setup,
               test_fault_fold_copy_run, teardown);
    g_test_add("/agent-proto/fault/fold-zero", Fixture, NULL, setup, test_fault_fold_zero,
               teardown);
    g_test_add("/agent-proto/fault/discard-partial", Fixture, NULL, setup,
               test_fault_discard_partial, teardown);
    g_test_add("/agent-proto/fault/step-back", Fixture, NULL, setup, test_fault_step_back,
               teardown);
    g_test_add("/agent-proto/fault/unprotect", Fixture, "wp-off", setup, test_fault_unprotect,
               teardown);
    g_test_add("/agent-proto/fault/unprotect-unregister", Fixture, "wp-off,unregister", setup,
               test_fault_unprotect, teardown);
    g_test_add("/agent-proto/dma", Fixture, NULL, setup, test_dma, teardown);
    g_test_add("/agent-proto/dma-written", Fixture, NULL, setup, test_dma_written, teardown);
    g_test_add("/agent-proto/dma-written-protocol-1", Fixture, protocol_1, setup,
               test_dma_written, teardown);
    g_test_add("/agent-proto/drop", Fixture, NULL, setup, test_drop, teardown);
    g_test_add("/agent-proto/drop-unknown", Fixture, GINT_TO_POINTER(DROP_NEVER_SENT), setup,
               test_drop_bad, teardown);
    g_test_add("/agent-proto/drop-twice", Fixture, GINT_TO_POINTER(DROP_TWICE), setup,
               test_drop_bad, teardown);
    g_test_add("/agent-proto/drop-wrong-size", Fixture, GINT_TO_POINTER(DROP_WRONG_SIZE), setup,
               test_drop_bad, teardown);
    g_test_add("/agent-proto/pool-ids", Fixture, NULL, setup, test_pool_ids, teardown);
    g_test_add("/agent-proto/move", Fixture, NULL, setup, test_move, teardown);
    g_test_add("/agent-proto/move-fails", Fixture, NULL, setup, test_move_fails, teardown);
    g_test_add("/agent-proto/move-fails-copy", Fixture, NULL, setup, test_move_fails_copy,
               teardown);
    g_test_add_data_func("/agent-proto/advise/setup-fails", GINT_TO_POINTER(UNSAFE_SETUP_FAILS),
                         test_unsafe);
    g_test_add_data_func("/agent-proto/advise/locked", GINT_TO_POINTER(UNSAFE_LOCKED),
                         test_unsafe);
    g_test_add_data_func("/agent-proto/advise/numa", GINT_TO_POINTER(UNSAFE_NUMA), test_unsafe);
    g_test_add("/agent-proto/plug-unplug", Fixture, NULL, setup, test_plug_unplug, teardown);
    g_test_add("/agent-proto/fault/unplug", Fixture, NULL, setup, test_unplug_fails, teardown);
    g_test_add_func("/agent-proto/silent-daemon", test_silent_daemon);
    g_test_add_func("/agent-proto/handshake-window", test_handshake_window);
    g_test_add("/agent-proto/discard-stalled", Fixture, NULL, setup, test_discard_stalled,
               teardown);
    return g_test_run();
}
