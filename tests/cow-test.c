/*
 * cow-test.c - cow.c against this process's own page tables: a file
 * mapped MAP_PRIVATE as the agent maps pool slots, its pages untouched,
 * read, written, and write-protected by userfaultfd as the agent does
 * around a merge.  Only a page written is reported, by either method.
 * (Swapped-out copies and host KSM's merges are in agent-cow-test: they
 * need the host's swap and KSM.)
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <linux/userfaultfd.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cow.h"
#include "util.h"

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

#define N 8

typedef struct {
    gboolean seen[N];
    gboolean zero_pfn[N];
    guint calls;
} Found;

static void
on_found(gsize page, gboolean zero_pfn, gpointer user)
{
    Found *f = user;

    g_assert_cmpuint(page, <, N);
    f->seen[page] = TRUE;
    f->zero_pfn[page] = zero_pfn;
    f->calls++;
}

static PfCow *
cow_new(const char *method)
{
    PfCow *c;

    if (g_str_equal(method, "pagemap")) {
        g_setenv("PAGEFOLD_NO_PAGEMAP_SCAN", "1", TRUE);
    }
    c = pf_cow_new();
    g_unsetenv("PAGEFOLD_NO_PAGEMAP_SCAN");
    return c;
}

static void
find(PfCow *c, const guint8 *map, Found *f)
{
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);

    g_assert_cmpint(fd, >=, 0);
    memset(f, 0, sizeof(*f));
    g_assert_true(pf_cow_find(c, fd, (guint64)(guintptr)map, 0, N, on_found, f));
    close(fd);
}

/* A file of N pages of content, mapped MAP_PRIVATE like a pool slot. */
static guint8 *
map_private(int *fd)
{
    guint8 *w, *map;

    *fd = memfd_create("cow-test", MFD_CLOEXEC);
    g_assert_cmpint(*fd, >=, 0);
    g_assert_cmpint(ftruncate(*fd, N * PF_PAGE_SIZE), ==, 0);
    w = mmap(NULL, N * PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    g_assert_true(w != MAP_FAILED);
    memset(w, 0x5a, N * PF_PAGE_SIZE);
    munmap(w, N * PF_PAGE_SIZE);
    map = mmap(NULL, N * PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE, *fd, 0);
    g_assert_true(map != MAP_FAILED);
    return map;
}

/* Page 0 untouched, 1 read, 2 written, 3 written with zeros. */
static void
test_basic(gconstpointer data)
{
    g_autoptr(PfCow) c = cow_new(data);
    Found f;
    int fd;
    guint8 *map = map_private(&fd);

    if (!g_str_equal(pf_cow_method(c), data)) {
        g_test_skip("this kernel has no PAGEMAP_SCAN");
        return;
    }
    g_assert_cmpint(((volatile guint8 *)map)[PF_PAGE_SIZE], ==, 0x5a);
    map[2 * PF_PAGE_SIZE] = 1;
    memset(map + 3 * PF_PAGE_SIZE, 0, PF_PAGE_SIZE);
    find(c, map, &f);
    g_assert_cmpuint(f.calls, ==, 2);
    g_assert_true(f.seen[2] && f.seen[3]);
    /* Copies of their own, not the zero page (a private copy of zeros is
     * a page like any other until KSM merges it). */
    g_assert_false(f.zero_pfn[2]);
    g_assert_false(f.zero_pfn[3]);
    munmap(map, N * PF_PAGE_SIZE);
    close(fd);
}

/*
 * The agent write-protects a window of guest RAM around a merge, pool
 * mappings in it included: the kernel leaves a uffd-wp marker in each
 * entry that was none, which reads as swapped out.  Not a copy: never
 * reported, while protected or after.
 */
static void
test_uffd_marker(gconstpointer data)
{
    g_autoptr(PfCow) c = cow_new(data);
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM };
    struct uffdio_register reg = { .mode = UFFDIO_REGISTER_MODE_WP };
    struct uffdio_writeprotect wp = { .mode = UFFDIO_WRITEPROTECT_MODE_WP };
    Found f;
    int fd, uffd;
    guint8 *map = map_private(&fd);

    if (!g_str_equal(pf_cow_method(c), data)) {
        g_test_skip("this kernel has no PAGEMAP_SCAN");
        return;
    }
    uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) < 0) {
        g_test_skip_printf("no userfaultfd write protection of shmem: %s", g_strerror(errno));
        if (uffd >= 0) {
            close(uffd);
        }
        return;
    }
    /* Registered first, as the agent's pool mappings are: a read fault
     * then maps no neighbours (fault-around is off under userfaultfd). */
    reg.range.start = wp.range.start = (guint64)(guintptr)map;
    reg.range.len = wp.range.len = N * PF_PAGE_SIZE;
    g_assert_cmpint(ioctl(uffd, UFFDIO_REGISTER, &reg), ==, 0);
    g_assert_cmpint(((volatile guint8 *)map)[PF_PAGE_SIZE], ==, 0x5a);
    map[2 * PF_PAGE_SIZE] = 1;
    g_assert_cmpint(ioctl(uffd, UFFDIO_WRITEPROTECT, &wp), ==, 0);
    /* Pages 0 and 3..7 now hold markers; 1 and 2 are protected. */
    find(c, map, &f);
    g_assert_cmpuint(f.calls, ==, 1);
    g_assert_true(f.seen[2]);
    wp.mode = 0;
    g_assert_cmpint(ioctl(uffd, UFFDIO_WRITEPROTECT, &wp), ==, 0);
    find(c, map, &f);
    g_assert_cmpuint(f.calls, ==, 1);
    g_assert_true(f.seen[2]);
    close(uffd);
    munmap(map, N * PF_PAGE_SIZE);
    close(fd);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_data_func("/cow/basic/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_basic);
    g_test_add_data_func("/cow/basic/pagemap", "pagemap", test_basic);
    g_test_add_data_func("/cow/uffd-marker/PAGEMAP_SCAN", "PAGEMAP_SCAN", test_uffd_marker);
    g_test_add_data_func("/cow/uffd-marker/pagemap", "pagemap", test_uffd_marker);
    return g_test_run();
}
