/*
 * agent-proto-life-test.c - the agent's link around its requests, against
 * a hand-driven daemon end of the protocol: the mode its handshake settles
 * on (advise, with the reason, where merging would not be safe), RAM
 * plugged in and unplugged, regions that come and go while the handshake
 * waits, a pagefoldd that never answers and one that stops reading.  On
 * the agent-proto fixture (agent-proto-helpers.h), but for the tests that
 * need a handshake of their own.
 *
 * Owns: the memory lock and NUMA policy its advise tests set, on guest RAM
 * of their own.  It must never leave this process locked (mlockall) past
 * the test that locked it.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <linux/mempolicy.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "agent-proto-helpers.h"
#include "agent.h"
#include "faultsys.h"
#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

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
    g_test_add_data_func("/agent-proto/advise/setup-fails", GINT_TO_POINTER(UNSAFE_SETUP_FAILS),
                         test_unsafe);
    g_test_add_data_func("/agent-proto/advise/locked", GINT_TO_POINTER(UNSAFE_LOCKED),
                         test_unsafe);
    g_test_add_data_func("/agent-proto/advise/numa", GINT_TO_POINTER(UNSAFE_NUMA), test_unsafe);
    g_test_add("/agent-proto/plug-unplug", Fixture, NULL, setup, test_plug_unplug, teardown);
    g_test_add_func("/agent-proto/silent-daemon", test_silent_daemon);
    g_test_add_func("/agent-proto/handshake-window", test_handshake_window);
    g_test_add("/agent-proto/discard-stalled", Fixture, NULL, setup, test_discard_stalled,
               teardown);
    return g_test_run();
}
