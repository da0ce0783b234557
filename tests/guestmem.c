/*
 * guestmem.c - synthetic guest RAM: memfds mapped shared and filled with
 * guestmem.h's page kinds, each page's content a function of its kind,
 * guest, index and generation, and the child processes that hold one
 * guest's mapping as a VMM would.  Never writes a page that its layout
 * says is a hole, and a holder never outlives the test.
 */
#include "guestmem.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util.h"

/* Every live guest, so a holder can unmap the others after fork(). */
static GPtrArray *live_guests;

enum { KIND_IDENTICAL = 1, KIND_DUPLICATE, KIND_UNIQUE, KIND_VOLATILE };

gsize
pf_layout_pages(const PfLayout *l)
{
    return l->identical + l->duplicate + l->unique + l->zero + l->volatile_ + l->holes;
}

guint64
pf_page_seed(int kind, guint32 guest, guint64 index, guint64 gen)
{
    guint64 h = 0x9E3779B97F4A7C15ull * (guint64)kind;

    h ^= (guint64)guest * 0xC2B2AE3D27D4EB4Full + index * 0x165667B19E3779F9ull;
    h ^= gen * 0xD6E8FEB86659FD93ull;
    h ^= h >> 31;
    return h | 1; /* never 0: 0 means a zero page */
}

void
pf_fill_page(guint8 *page, guint64 seed)
{
    guint64 x = seed;

    if (seed == 0) {
        memset(page, 0, PF_PAGE_SIZE);
        return;
    }
    for (gsize i = 0; i < PF_PAGE_SIZE; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(page + i, &x, 8);
    }
}

static void
fill_volatile(PfGuest *g)
{
    gsize first = g->layout.identical + g->layout.duplicate + g->layout.unique + g->layout.zero;

    for (gsize i = 0; i < g->layout.volatile_; i++) {
        /* No guest seed: the same generation is the same in every guest,
         * so only volatility keeps these pages apart. */
        pf_fill_page(g->mem + (first + i) * PF_PAGE_SIZE,
                     pf_page_seed(KIND_VOLATILE, 0, i, g->generation));
    }
}

PfGuest *
pf_guest_new(const char *name, const PfLayout *l, guint32 seed)
{
    return pf_guest_new_full(name, l, seed, FALSE);
}

/* RAM aligned to 2 MiB; with huge, advised MADV_HUGEPAGE before the
 * guest touches it, as QEMU with transparent huge pages maps it. */
static guint8 *
map_aligned(int fd, gsize size, gboolean huge_advice)
{
    gsize huge = 2u << 20;
    guint8 *area = mmap(NULL, size + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    guint8 *mem;

    g_assert(area != MAP_FAILED);
    mem = (guint8 *)(((guintptr)area + huge - 1) & ~(guintptr)(huge - 1));
    g_assert(mmap(mem, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == mem);
    if (huge_advice) {
        madvise(mem, size, MADV_HUGEPAGE);
    }
    return mem;
}

static PfGuest *guest_new(const char *name, const PfLayout *l, guint32 seed, gboolean aligned,
                          gboolean huge);

PfGuest *
pf_guest_new_full(const char *name, const PfLayout *l, guint32 seed, gboolean huge)
{
    return guest_new(name, l, seed, huge, huge);
}

PfGuest *
pf_guest_new_aligned(const char *name, const PfLayout *l, guint32 seed)
{
    return guest_new(name, l, seed, TRUE, FALSE);
}

static PfGuest *
guest_new(const char *name, const PfLayout *l, guint32 seed, gboolean aligned, gboolean huge)
{
    g_autoptr(PfGuest) g = g_new0(PfGuest, 1);
    gsize idx = 0;

    g->layout = *l;
    g->seed = seed;
    g->n_pages = pf_layout_pages(l);
    g->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    g_assert_cmpint(g->fd, >=, 0);
    g_assert_cmpint(ftruncate(g->fd, (off_t)(g->n_pages * PF_PAGE_SIZE)), ==, 0);
    g->mem = aligned ? map_aligned(g->fd, g->n_pages * PF_PAGE_SIZE, huge)
                     : mmap(NULL, g->n_pages * PF_PAGE_SIZE, PROT_READ | PROT_WRITE,
                            MAP_SHARED, g->fd, 0);
    g_assert(g->mem != MAP_FAILED);

    for (gsize i = 0; i < l->identical; i++, idx++) {
        pf_fill_page(g->mem + idx * PF_PAGE_SIZE, pf_page_seed(KIND_IDENTICAL, 0, i, 0));
    }
    for (gsize i = 0; i < l->duplicate; i++, idx++) {
        pf_fill_page(g->mem + idx * PF_PAGE_SIZE, pf_page_seed(KIND_DUPLICATE, 0, 0, 0));
    }
    for (gsize i = 0; i < l->unique; i++, idx++) {
        pf_fill_page(g->mem + idx * PF_PAGE_SIZE, pf_page_seed(KIND_UNIQUE, seed, i, 0));
    }
    for (gsize i = 0; i < l->zero; i++, idx++) {
        /* A written zero: the memfd page is allocated, as a guest's is. */
        g->mem[idx * PF_PAGE_SIZE] = 1;
        g->mem[idx * PF_PAGE_SIZE] = 0;
    }
    fill_volatile(g);
    if (live_guests == NULL) {
        live_guests = g_ptr_array_new();
    }
    g_ptr_array_add(live_guests, g);
    return g_steal_pointer(&g);
}

void
pf_guest_churn(PfGuest *g)
{
    g->generation++;
    fill_volatile(g);
}

void
pf_guest_free(PfGuest *g)
{
    if (g == NULL) {
        return;
    }
    if (live_guests != NULL) {
        g_ptr_array_remove(live_guests, g);
    }
    if (g->mem != NULL && g->mem != MAP_FAILED) {
        munmap(g->mem, g->n_pages * PF_PAGE_SIZE);
    }
    if (g->fd >= 0) {
        close(g->fd);
    }
    g_free(g);
}

int
pf_guest_hold(PfGuest *g)
{
    int parent = getpid();
    int ready[2];
    int pid;
    char c = 0;

    g_assert_cmpint(pipe(ready), ==, 0);
    pid = fork();
    g_assert_cmpint(pid, >=, 0);
    if (pid == 0) {
        close(ready[0]);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) {
            _exit(0);
        }
        for (guint i = 0; live_guests && i < live_guests->len; i++) {
            PfGuest *o = g_ptr_array_index(live_guests, i);

            if (o != g) {
                munmap(o->mem, o->n_pages * PF_PAGE_SIZE);
            }
        }
        /* Nor does it keep the descriptors of the test's process (pool
         * chunks among them, when the test runs pagefoldd's code). */
        if (dup2(ready[1], 3) < 0 || close_range(4, ~0u, 0) < 0) {
            _exit(1);
        }
        /* Only now does its memory look like one VM's. */
        (void)!write(3, &c, 1);
        close(3);
        for (;;) {
            pause();
        }
    }
    close(ready[1]);
    g_assert_cmpint(read(ready[0], &c, 1), ==, 1);
    close(ready[0]);
    return pid;
}

void
pf_guest_release(int pid)
{
    int status;

    kill(pid, SIGKILL);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
}
