/*
 * agent-proto-fault-test.c - the agent library when the kernel refuses its
 * calls (faultsys.h fails them on a test's word): merges, moves,
 * fold-backs, discards, a step back, lifting write protection and an
 * unplug whose mmap(), fallocate(), pwrite(), madvise() or userfaultfd
 * ioctl fails, early or late.  Guest RAM stays as the guest wrote it and
 * pagefoldd's answer is true; where neither can be had, the process ends
 * saying so.  On the agent-proto fixture (agent-proto-helpers.h).
 *
 * Owns: the faults its tests set.  It must never leave a call failing past
 * the test that asked for it (setup() clears them before each test).
 */
#include <errno.h>
#include <glib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "agent-proto-helpers.h"
#include "agent.h"
#include "faultsys.h"
#include "guestmem.h"
#include "proto.h"
#include "testproc.h"
#include "util.h"

static const guint8 zero_page_of_test[PF_PAGE_SIZE];

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
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING,
                          "*after merging pc.ram*folding it back*");
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

/* Pages 0-7 merged, as the unmerge windows below begin. */
static void
merge_eight(Fixture *f)
{
    send_identical_pool(f);
    (void)merge_pages(f, 0, 8, 1);
    g_assert_cmpuint(remapped(f), ==, 8);
}

/* Unmerges of one window, a copy into the memfd failing twice: the run it
 * failed in is tried again page by page, so that only the page that
 * failed again stays merged, its write in place, and says so. */
static void
test_fault_unmerge_window(Fixture *f, gconstpointer data)
{
    static const guint64 pages[] = { 2, 3, 4, 6 };
    PfWireItem items[G_N_ELEMENTS(pages)];
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *want = NULL;
    const PfWireResult *res;

    merge_eight(f);
    for (guint i = 0; i < G_N_ELEMENTS(pages); i++) {
        mem[pages[i] * PF_PAGE_SIZE + 99] ^= 0x3c;
        items[i] = (PfWireItem){ .kind = PF_ITEM_UNMERGE, .region = 0, .page = pages[i] };
    }
    want = g_memdup2(mem, 8 * PF_PAGE_SIZE);
    /* The run 2-4 fails at page 3, then page 2 alone fails. */
    pf_test_fault_set("pwrite", 1, 2, ENOSPC, FALSE);
    res = request(f, items, G_N_ELEMENTS(items), 2);
    g_assert_cmpint(pf_test_fault_hits(), ==, 2);
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    for (guint i = 0; i < G_N_ELEMENTS(pages); i++) {
        g_assert_cmpuint(res[i].status, ==, i == 0 ? PF_RESULT_ERROR : PF_RESULT_DONE);
        g_assert_cmpint(res[i].err, ==, i == 0 ? ENOSPC : 0);
        if (i > 0) {
            assert_memfd_page(f, (guint)pages[i], want + pages[i] * PF_PAGE_SIZE);
        }
    }
    g_assert_cmpuint(remapped(f), ==, 5);
    g_assert_false(maps_memfd(f, 2));
    g_assert_cmpint(memcmp(mem, want, 8 * PF_PAGE_SIZE), ==, 0);
}

/* Three items requested while the first write protection fails: the first
 * failing of them, which share it, say ENOMEM; the others are done (in the
 * memfd already, or in a window of their own). */
static const PfWireResult *
request_protect_failing(Fixture *f, const PfWireItem *items, guint failing, guint32 seq)
{
    const PfWireResult *res;

    pf_test_fault_set("wp-on", 0, 1, ENOMEM, FALSE);
    res = request(f, items, 3, seq);
    g_assert_cmpint(pf_test_fault_hits(), ==, 1);
    pf_test_fault_set(NULL, 0, 0, 0, FALSE);
    assert_all_failed(res, failing, ENOMEM);
    for (guint i = failing; i < 3; i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    return res;
}

/* Unmerges of one window whose write protection fails: each page still
 * merged says so, its write in place, and nothing changed; a page in the
 * memfd already is done; the next try folds them back. */
static void
test_fault_unmerge_window_protect(Fixture *f, gconstpointer data)
{
    PfWireItem items[3] = {
        { .kind = PF_ITEM_UNMERGE, .region = 0, .page = 2 },
        { .kind = PF_ITEM_UNMERGE, .region = 0, .page = 3 },
        { .kind = PF_ITEM_UNMERGE, .region = 0, .page = 12 },
    };
    guint8 *mem = f->guest->mem;
    g_autofree guint8 *want = NULL;
    const PfWireResult *res;

    merge_eight(f);
    mem[2 * PF_PAGE_SIZE + 5] ^= 0x3c;
    want = g_memdup2(mem, 8 * PF_PAGE_SIZE);
    res = request_protect_failing(f, items, 2, 2);
    g_assert_cmpuint(remapped(f), ==, 8);
    g_assert_cmpint(memcmp(mem, want, 8 * PF_PAGE_SIZE), ==, 0);
    res = request(f, items, G_N_ELEMENTS(items), 3);
    for (guint i = 0; i < G_N_ELEMENTS(items); i++) {
        g_assert_cmpuint(res[i].status, ==, PF_RESULT_DONE);
    }
    g_assert_cmpuint(remapped(f), ==, 6);
    assert_memfd_page(f, 2, want + 2 * PF_PAGE_SIZE);
    g_assert_cmpint(memcmp(mem, want, 8 * PF_PAGE_SIZE), ==, 0);
}

/* Merges of one request far apart are protected apart: with the first
 * window's protection failing, an item with WINDOW_GAP (16) pages between
 * it and the window, above or below, shares the failure; one with 17
 * between, in a window of its own, merges. */
static void
test_fault_window_gap(Fixture *f, gconstpointer data)
{
    static const struct {
        guint64 pages[3];
        gboolean joins;
    } cases[] = {
        { { 0, 1, 18 }, TRUE },
        { { 0, 1, 19 }, FALSE },
        { { 60, 59, 42 }, TRUE },
        { { 60, 59, 41 }, FALSE },
    };
    guint32 seq = 1;

    send_identical_pool(f);
    for (guint c = 0; c < G_N_ELEMENTS(cases); c++) {
        PfWireItem items[3];

        for (guint i = 0; i < 3; i++) {
            items[i] = (PfWireItem){ .kind = PF_ITEM_MERGE, .region = 0,
                                     .page = cases[c].pages[i],
                                     .chunk = 0, .slot = (guint32)cases[c].pages[i] };
        }
        (void)request_protect_failing(f, items, cases[c].joins ? 3 : 2, seq++);
        for (guint i = 0; i < 3; i++) {
            g_assert_true(maps_memfd(f, (guint)cases[c].pages[i]) ==
                          (i < 2 || cases[c].joins));
        }
    }
    g_assert_cmpuint(remapped(f), ==, 2);
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
    g_test_expect_message("pagefold", G_LOG_LEVEL_WARNING,
                          "*after merging pc.ram*folding it back*");
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

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add("/agent-proto/fault/merge-map-early", Fixture, NULL, setup, test_fault_merge_mmap,
               teardown);
    g_test_add("/agent-proto/fault/merge-map-late", Fixture, "late", setup,
               test_fault_merge_mmap, teardown);
    g_test_add("/agent-proto/fault/merge-punch", Fixture, "fallocate", setup,
               test_fault_merge_punch, teardown);
    g_test_add("/agent-proto/fault/merge-advice", Fixture, "madvise", setup,
               test_fault_merge_punch, teardown);
    g_test_add("/agent-proto/fault/unmerge-window", Fixture, NULL, setup,
               test_fault_unmerge_window, teardown);
    g_test_add("/agent-proto/fault/unmerge-window-protect", Fixture, NULL, setup,
               test_fault_unmerge_window_protect, teardown);
    g_test_add("/agent-proto/fault/window-gap", Fixture, NULL, setup, test_fault_window_gap,
               teardown);
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
    g_test_add("/agent-proto/move-fails", Fixture, NULL, setup, test_move_fails, teardown);
    g_test_add("/agent-proto/move-fails-copy", Fixture, NULL, setup, test_move_fails_copy,
               teardown);
    g_test_add("/agent-proto/fault/unplug", Fixture, NULL, setup, test_unplug_fails, teardown);
    return g_test_run();
}
