/*
 * agent-proto-test.c - the agent library against a hand-driven daemon end
 * of the protocol, on the real kernel mechanisms (userfaultfd, MAP_FIXED
 * over guest RAM, punch): merging, zero pages, unmerging and collapsing,
 * pages in DMA and what devices wrote, pool chunks dropped and pages moved
 * between them; and every kind of bad input pagefoldd could send.  This
 * test process is the VMM: it maps guest RAM like QEMU and links the agent
 * library (the fixture: agent-proto-helpers.h).
 *
 * Its siblings on the same fixture: agent-proto-fault-test (the agent's
 * system calls failing) and agent-proto-life-test (the link around the
 * requests: the handshake's mode, RAM plugged and unplugged, a pagefoldd
 * that does not answer or stops reading).
 *
 * Owns: nothing past a test; each has a fixture of its own.  It must never
 * make the agent's calls fail: agent-proto-fault-test does that.
 */
#include <errno.h>
#include <glib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent-proto-helpers.h"
#include "agent.h"
#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

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
 * Unmerge items near each other (no more than WINDOW_GAP pages between
 * them, agent-items.c) fold back under one write protection, in
 * runs of consecutive pages, each with its own result: a run with a page
 * in DMA folds back all but that page; a page never merged, or named
 * twice, is in the memfd already.  Every byte reaches the memfd.
 */
static void
test_unmerge_window(Fixture *f, gconstpointer data)
{
    static const guint64 pages[] = { 9, 1, 2, 3, 20, 3, 12 };
    PfWireItem items[G_N_ELEMENTS(pages)];
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *back = g_malloc(PAGES * PF_PAGE_SIZE);
    const PfWireResult *res;

    send_identical_pool(f);
    res = merge_pages(f, 0, 16, 1);
    for (guint i = 0; i < 16; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    for (guint i = 0; i < G_N_ELEMENTS(pages); i++) {
        mem[pages[i] * PF_PAGE_SIZE + i] ^= 0x3c;
        items[i] = (PfWireItem){ .kind = PF_ITEM_UNMERGE, .region = 0, .page = pages[i] };
    }
    pf_agent_dma_map(f->agent, mem + 2 * PF_PAGE_SIZE, PF_PAGE_SIZE);
    res = request(f, items, G_N_ELEMENTS(items), 2);
    for (guint i = 0; i < G_N_ELEMENTS(pages); i++) {
        g_assert_cmpuint(res[i].status, ==, pages[i] == 2 ? PF_RESULT_ERROR : PF_RESULT_DONE);
        g_assert_cmpint(res[i].err, ==, pages[i] == 2 ? EBUSY : 0);
        g_assert_true(maps_memfd(f, pages[i]) == (pages[i] != 2));
    }
    g_assert_cmpuint(remapped(f), ==, 16 - 4);
    pf_agent_dma_unmap(f->agent, mem + 2 * PF_PAGE_SIZE, PF_PAGE_SIZE, 0);
    res = unmerge_page(f, 2, 3);
    g_assert_cmpuint(res[0].status, ==, PF_RESULT_DONE);
    for (guint i = 0; i < 16; i++) {
        if (maps_memfd(f, i)) {
            g_assert_cmpint(pread(f->guest->fd, back + i * PF_PAGE_SIZE, PF_PAGE_SIZE,
                                  (off_t)(i * PF_PAGE_SIZE)), ==, PF_PAGE_SIZE);
            g_assert_cmpint(memcmp(back + i * PF_PAGE_SIZE, mem + i * PF_PAGE_SIZE,
                                   PF_PAGE_SIZE), ==, 0);
        }
    }
    g_assert_cmpuint(remapped(f), ==, 16 - 5);
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
    g_test_add("/agent-proto/dma", Fixture, NULL, setup, test_dma, teardown);
    g_test_add("/agent-proto/unmerge-window", Fixture, NULL, setup, test_unmerge_window,
               teardown);
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
    return g_test_run();
}
