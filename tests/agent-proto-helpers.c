/*
 * agent-proto-helpers.c - the agent-proto programs' fixture, and the
 * requests and reads they share (see agent-proto-helpers.h).
 *
 * Owns: the fixture, made and freed per test.  It must never send the
 * agent anything but what a test asked for.
 */
#include "agent-proto-helpers.h"

#include <fcntl.h>
#include <glib.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "faultsys.h"
#include "util.h"

void
expect_msg(Fixture *f, PfMsgType type)
{
    g_autoptr(GError) error = NULL;

    g_assert_true(pf_proto_recv(f->conn, &f->msg, &error));
    g_assert_no_error(error);
    g_assert_cmpuint(f->msg.header.type, ==, type);
}

const char protocol_1[] = "protocol 1";

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

void
setup(Fixture *f, gconstpointer data)
{
    setup_pages(f, data, PAGES);
}

void
setup_extent(Fixture *f, gconstpointer data)
{
    setup_pages(f, data, 512);
}

void
teardown(Fixture *f, gconstpointer data)
{
    pf_agent_free(f->agent);
    pf_test_peer_free(f->peer);
    munmap(f->pool_map, PAGES * PF_PAGE_SIZE);
    close(f->pool_fd);
    pf_guest_free(f->guest);
}

void
send_pool(Fixture *f, int fd, guint32 chunk, guint32 n_slots)
{
    PfWirePool p = { chunk, n_slots };

    g_assert_true(pf_proto_send(f->conn, PF_MSG_POOL, 0, &p, sizeof(p), &fd, 1, NULL));
}

void
assert_all_failed(const PfWireResult *res, guint n, int err)
{
    for (guint i = 0; i < n; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_ERROR);
        g_assert_cmpint(res[i].err, ==, err);
    }
}

const PfWireResult *
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

guint64
pagemap_entry(const void *addr)
{
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    guint64 e = 0;

    g_assert_cmpint(pread(fd, &e, 8, (off_t)((guintptr)addr / PF_PAGE_SIZE * 8)), ==, 8);
    close(fd);
    return e;
}

blkcnt_t
memfd_blocks(int fd)
{
    struct stat st;

    fstat(fd, &st);
    return st.st_blocks;
}

void
send_identical_pool(Fixture *f)
{
    memcpy(f->pool_map, f->guest->mem, (PAGES / 2) * PF_PAGE_SIZE);
    send_pool(f, f->pool_fd, 0, PAGES);
}

const PfWireResult *
merge_pages(Fixture *f, guint first, guint n, guint32 seq)
{
    PfWireItem items[PAGES];

    for (guint i = 0; i < n; i++) {
        items[i] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0, .page = first + i,
                                 .chunk = 0, .slot = first + i };
    }
    return request(f, items, n, seq);
}

const PfWireResult *
unmerge_page(Fixture *f, guint page, guint32 seq)
{
    PfWireItem it = { .kind = PF_ITEM_UNMERGE, .region = 0, .page = page };

    return request(f, &it, 1, seq);
}

guint64
remapped(Fixture *f)
{
    PfAgentStats st;

    pf_agent_get_stats(f->agent, &st);
    return st.remapped;
}

/* Does page i of guest RAM map the memfd?  A byte written through the
 * mapping must be read back from the memfd. */
gboolean
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

void
assert_memfd_page(Fixture *f, guint i, const guint8 *want)
{
    guint8 back[PF_PAGE_SIZE];

    g_assert_cmpint(pread(f->guest->fd, back, PF_PAGE_SIZE, (off_t)i * PF_PAGE_SIZE), ==,
                    PF_PAGE_SIZE);
    g_assert_cmpint(memcmp(back, want, PF_PAGE_SIZE), ==, 0);
}

/*
 * Reads DISCARDs until a message of type then (DISCARD: until none comes
 * for a moment), and marks the pages of region they cover in covered
 * (PAGES of them).  A DISCARD may span pages that were never merged.
 */
void
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

void
assert_covered(const gboolean *covered, guint lo, guint hi, gboolean want)
{
    for (guint k = lo; k < hi; k++) {
        g_assert_cmpint(covered[k], ==, want);
    }
}

const PfWireResult *
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
void
barrier(Fixture *f, guint32 seq)
{
    g_assert_cmpuint(unmerge_page(f, PAGES - 1, seq)[0].status, ==, PF_RESULT_DONE);
}

/* The mappings of this process (the agent's, the test's, the guest's) of
 * the file open as fd, with permissions perms ("r--s": the agent's compare
 * mapping of a chunk; "rw-p": guest pages mapped from it). */
guint
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
guint
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
guint64
pfn_of(const void *addr)
{
    guint64 e;

    (void)*(const volatile guint8 *)addr;
    e = pagemap_entry(addr);

    g_assert_true(e & (1ull << 63)); /* present */
    return e & ((1ull << 55) - 1);
}

PfAgentStats
stats_of(Fixture *f)
{
    PfAgentStats st;

    pf_agent_get_stats(f->agent, &st);
    return st;
}

int
send_chunk_b(Fixture *f, guint8 **map)
{
    int fd = make_pool(PAGES, TRUE, map);

    memcpy(*map + 10 * PF_PAGE_SIZE, f->guest->mem, 24 * PF_PAGE_SIZE);
    send_pool(f, fd, 1, PAGES);
    return fd;
}
