/*
 * uffd-backend-test.c - the kernel mechanisms a vhost-user backend's part
 * in the merge would rest on, on the kernel the tests run on (the host's;
 * Debian 12's 6.1 in the kernel suite).  A "backend" process maps a memfd
 * MAP_SHARED, as virtiofsd maps guest RAM, makes a userfaultfd over that
 * mapping for missing pages and write protection, and hands it over; the
 * other process (the agent's part, in QEMU) then:
 *  - write-protects a page in the backend's mapping: the backend's write
 *    waits, the memfd page stays as it was, and goes on once lifted;
 *  - punches the page out of the memfd (a merge), and resolves the
 *    backend's next touch with UFFDIO_COPY (a fold-back), which fills the
 *    memfd's page cache for every mapping of it;
 *  - sees the backend's system calls into a punched or write-protected
 *    page (a pread() into a guest buffer, as virtiofsd does): a userfaultfd
 *    made with UFFD_USER_MODE_ONLY does not take the kernel's faults and
 *    the call fails with EFAULT, while a whole one (as /dev/userfaultfd
 *    gives an unprivileged process; root's here) takes them to resolve;
 *  - finds that the backend unmapped the memfd: lifting write protection
 *    there fails with ENOENT.
 * No pagefold code is under test here: what is, is the kernel.
 *
 * Owns its memfd, its backend child and the descriptors it took from it;
 * must never leave the child blocked in a fault (every fault it causes is
 * resolved or the child is killed).
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testproc.h"

#define PAGE 4096u
#define PAGES 8u

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

/* One request to the backend, and its answer. */
typedef struct {
    char op;      /* 'w' write the page (fill), 'r' read it, 'p' pread() into it,
                   * 'u' unmap the memfd, 'q' */
    guint32 page;
    guint8 fill;
} Req;

typedef struct {
    int err;      /* 0, or the errno of the access */
    guint8 first; /* 'r', 'p': the page's first byte as the backend saw it */
} Ans;

typedef struct {
    pid_t pid;
    int sock;      /* requests and answers */
    int uffd;      /* the backend's userfaultfd, taken from it */
    guint8 *base;  /* the memfd in the backend's address space */
    int memfd;
    guint8 *view;  /* the memfd in this process: a third mapping */
    gboolean user_mode_only;
} Backend;

/* What the backend says as it starts, with its userfaultfd (SCM_RIGHTS,
 * as vhost-user would pass it). */
typedef struct {
    guint64 base;
    int err;          /* making it failed: errno */
    char step[24];    /* at which step */
    gboolean no_wp;   /* the kernel offers no write protection of shmem */
} Hello;

static void
send_hello(int sock, const Hello *hello, int fd)
{
    if (!pf_test_send_fd(sock, hello, sizeof(*hello), fd)) {
        _exit(1);
    }
}

/* The backend's hello, and its descriptor (or -1). */
static int
recv_hello(int sock, Hello *hello)
{
    int fd;

    g_assert_cmpint(pf_test_recv_fd(sock, hello, sizeof(*hello), &fd), ==, sizeof(*hello));
    return fd;
}

/* The backend: maps the memfd, registers it, says where, then serves. */
static G_NORETURN void
backend_main(int sock, int memfd, int file_fd, gboolean user_mode_only)
{
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM };
    struct uffdio_api offered = { .api = UFFD_API, .features = 0 };
    Hello hello = { 0 };
    guint8 *base;
    int uffd = -1, probe = -1;
    int flags = O_CLOEXEC | O_NONBLOCK | (user_mode_only ? UFFD_USER_MODE_ONLY : 0);
    struct uffdio_register reg;
    Req q;

    /* A child of a test that failed must not stay blocked in a fault. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() == 1) {
        _exit(1);
    }
    base = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    /* A huge folio the punch could not split would be zeroed, not punched. */
    if (base == MAP_FAILED || madvise(base, PAGES * PAGE, MADV_NOHUGEPAGE) < 0) {
        hello.err = errno;
        g_strlcpy(hello.step, "mmap", sizeof(hello.step));
    } else if ((probe = (int)syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY)) >= 0 &&
               ioctl(probe, UFFDIO_API, &offered) == 0 &&
               !(offered.features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM)) {
        hello.no_wp = TRUE;
    } else if ((uffd = (int)syscall(SYS_userfaultfd, flags)) < 0) {
        hello.err = errno;
        g_strlcpy(hello.step, "userfaultfd()", sizeof(hello.step));
    } else if (ioctl(uffd, UFFDIO_API, &api) < 0) {
        hello.err = errno;
        g_strlcpy(hello.step, "UFFDIO_API", sizeof(hello.step));
    } else {
        reg = (struct uffdio_register){ { (guint64)(guintptr)base, PAGES * PAGE },
                                        UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP,
                                        0 };
        if (ioctl(uffd, UFFDIO_REGISTER, &reg) < 0) {
            hello.err = errno;
            g_strlcpy(hello.step, "UFFDIO_REGISTER", sizeof(hello.step));
        }
    }
    if (probe >= 0) {
        close(probe);
    }
    hello.base = (guint64)(guintptr)base;
    send_hello(sock, &hello, hello.err == 0 && !hello.no_wp ? uffd : -1);
    if (hello.err != 0 || hello.no_wp) {
        _exit(0);
    }
    while (read(sock, &q, sizeof(q)) == sizeof(q) && q.op != 'q') {
        guint8 *page = base + (gsize)q.page * PAGE;
        Ans a = { 0, 0 };

        if (q.op == 'w') {
            memset(page, q.fill, PAGE);
        } else if (q.op == 'r') {
            a.first = *(volatile guint8 *)page;
        } else if (q.op == 'u') {
            if (munmap(base, PAGES * PAGE) < 0) {
                a.err = errno;
            }
        } else if (q.op == 'p') {
            /* The kernel writes the page, not this process. */
            if (pread(file_fd, page, PAGE, 0) != PAGE) {
                a.err = errno;
            } else {
                a.first = page[0];
            }
        }
        if (write(sock, &a, sizeof(a)) != sizeof(a)) {
            _exit(1);
        }
    }
    _exit(0);
}

/* A backend over a new memfd of PAGES pages, each filled with its index;
 * NULL (the path skipped) where the kernel cannot write-protect shmem. */
static Backend *
backend_start(gboolean user_mode_only)
{
    Backend *b = g_new0(Backend, 1);
    g_autofree char *file = NULL;
    int sv[2], file_fd;
    Hello hello;
    guint8 data[PAGE];

    if (getpagesize() != PAGE) {
        g_test_skip("pages of 4 KiB only");
        g_free(b);
        return NULL;
    }

    b->user_mode_only = user_mode_only;
    b->memfd = memfd_create("uffd-backend", MFD_CLOEXEC);
    g_assert_cmpint(b->memfd, >=, 0);
    g_assert_cmpint(ftruncate(b->memfd, PAGES * PAGE), ==, 0);
    b->view = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, b->memfd, 0);
    g_assert_true(b->view != MAP_FAILED);
    g_assert_cmpint(madvise(b->view, PAGES * PAGE, MADV_NOHUGEPAGE), ==, 0);
    for (guint i = 0; i < PAGES; i++) {
        memset(b->view + i * PAGE, (int)i, PAGE);
    }
    /* What the backend's pread() reads: a page of 0xf5. */
    file_fd = g_file_open_tmp("uffd-backend-XXXXXX", &file, NULL);
    g_assert_cmpint(file_fd, >=, 0);
    memset(data, 0xf5, PAGE);
    g_assert_cmpint(write(file_fd, data, PAGE), ==, PAGE);
    g_unlink(file);
    g_assert_cmpint(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), ==, 0);
    b->pid = fork();
    g_assert_cmpint(b->pid, >=, 0);
    if (b->pid == 0) {
        close(sv[0]);
        backend_main(sv[1], b->memfd, file_fd, user_mode_only);
    }
    close(sv[1]);
    close(file_fd);
    b->sock = sv[0];
    b->uffd = recv_hello(b->sock, &hello);
    if (hello.no_wp || (hello.err == EPERM && g_str_equal(hello.step, "userfaultfd()"))) {
        g_test_skip(hello.no_wp ? "this kernel cannot write-protect shmem with a userfaultfd"
                                : "this process may not make a userfaultfd that sees the "
                                  "kernel's faults (vm.unprivileged_userfaultfd=0)");
        g_assert_cmpint(waitpid(b->pid, NULL, 0), ==, b->pid);
        close(b->sock);
        munmap(b->view, PAGES * PAGE);
        close(b->memfd);
        g_free(b);
        return NULL;
    }
    if (hello.err != 0) {
        g_error("the backend's %s: %s", hello.step, g_strerror(hello.err));
    }
    g_assert_cmpint(b->uffd, >=, 0);
    b->base = (guint8 *)(guintptr)hello.base;
    return b;
}

static void
backend_free(Backend *b)
{
    Req q = { 'q', 0, 0 };
    int status;

    if (write(b->sock, &q, sizeof(q)) != sizeof(q)) {
        kill(b->pid, SIGKILL);
    }
    g_assert_cmpint(waitpid(b->pid, &status, 0), ==, b->pid);
    g_assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(b->sock);
    close(b->uffd);
    munmap(b->view, PAGES * PAGE);
    close(b->memfd);
    g_free(b);
}

static void
backend_ask(Backend *b, char op, guint32 page, guint8 fill)
{
    Req q = { op, page, fill };

    g_assert_cmpint(write(b->sock, &q, sizeof(q)), ==, sizeof(q));
}

/* The answer, if it comes within ms (FALSE: the backend is blocked). */
static gboolean
backend_answer(Backend *b, int ms, Ans *a)
{
    struct pollfd p = { b->sock, POLLIN, 0 };

    if (poll(&p, 1, ms) != 1) {
        return FALSE;
    }
    g_assert_cmpint(read(b->sock, a, sizeof(*a)), ==, sizeof(*a));
    return TRUE;
}

/* The backend's next fault, within 60 s (a slow machine), is at page, and
 * a write-protect fault or not (wp).  The userfaultfd is O_NONBLOCK:
 * poll() says POLLERR, always, on one that is not. */
static void
expect_fault(Backend *b, guint32 page, gboolean wp)
{
    struct pollfd p = { b->uffd, POLLIN, 0 };
    struct uffd_msg m;

    g_assert_cmpint(poll(&p, 1, 60000), ==, 1);
    g_assert_cmpint(p.revents, ==, POLLIN);
    g_assert_cmpint(read(b->uffd, &m, sizeof(m)), ==, sizeof(m));
    g_assert_cmpint(m.event, ==, UFFD_EVENT_PAGEFAULT);
    g_assert_cmpuint(m.arg.pagefault.address & ~(guint64)(PAGE - 1), ==,
                     (guint64)(guintptr)(b->base + (gsize)page * PAGE));
    g_assert_cmpint(!!(m.arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WP), ==, wp);
}

static void
protect(Backend *b, guint32 page, gboolean on)
{
    struct uffdio_writeprotect wp = {
        { (guint64)(guintptr)(b->base + (gsize)page * PAGE), PAGE },
        on ? UFFDIO_WRITEPROTECT_MODE_WP : 0,
    };

    g_assert_cmpint(ioctl(b->uffd, UFFDIO_WRITEPROTECT, &wp), ==, 0);
}

/* A merge's punch: the page leaves the memfd. */
static void
punch(Backend *b, guint32 page)
{
    g_assert_cmpint(fallocate(b->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              (off_t)page * PAGE, PAGE), ==, 0);
}

/* A fold-back: the page back in the memfd, filled, from the backend's
 * side; its fault (if any) goes on. */
static void
copy_in(Backend *b, guint32 page, guint8 fill)
{
    static guint8 src[PAGE];
    struct uffdio_copy c = { (guint64)(guintptr)(b->base + (gsize)page * PAGE),
                             (guint64)(guintptr)src, PAGE, 0, 0 };

    memset(src, fill, PAGE);
    g_assert_cmpint(ioctl(b->uffd, UFFDIO_COPY, &c), ==, 0);
    g_assert_cmpint(c.copy, ==, PAGE);
}

/* A page the backend maps, write-protected from here: its write waits
 * (and faults here), the memfd page is unchanged meanwhile, and the write
 * lands once protection is lifted. */
static void
test_write_protect(void)
{
    Backend *b = backend_start(TRUE);
    Ans a;

    if (b == NULL) {
        return;
    }
    backend_ask(b, 'r', 2, 0); /* mapped in the backend, as guest RAM in use is */
    g_assert_true(backend_answer(b, 60000, &a));
    g_assert_cmpint(a.first, ==, 2);
    protect(b, 2, TRUE);
    backend_ask(b, 'w', 2, 0xaa);
    expect_fault(b, 2, TRUE);
    g_assert_false(backend_answer(b, 200, &a));
    g_assert_cmpint(b->view[2 * PAGE], ==, 2);
    protect(b, 2, FALSE); /* wakes it */
    g_assert_true(backend_answer(b, 60000, &a));
    g_assert_cmpint(b->view[2 * PAGE], ==, 0xaa);
    g_assert_cmpint(b->view[3 * PAGE - 1], ==, 0xaa);
    backend_free(b);
}

/* A page punched from the memfd while the backend maps it: its next read
 * faults as missing (never a page of zeros), and UFFDIO_COPY from here
 * puts the page back where every mapping of the memfd sees it. */
static void
test_missing_after_punch(void)
{
    Backend *b = backend_start(TRUE);
    Ans a;

    if (b == NULL) {
        return;
    }
    backend_ask(b, 'r', 4, 0);
    g_assert_true(backend_answer(b, 60000, &a));
    g_assert_cmpint(a.first, ==, 4);
    punch(b, 4);
    backend_ask(b, 'r', 4, 0);
    expect_fault(b, 4, FALSE);
    g_assert_false(backend_answer(b, 200, &a));
    copy_in(b, 4, 0x44);
    g_assert_true(backend_answer(b, 60000, &a));
    g_assert_cmpint(a.first, ==, 0x44);
    g_assert_cmpint(b->view[4 * PAGE + 100], ==, 0x44);
    /* A write to it now is the memfd's, as before the merge. */
    backend_ask(b, 'w', 4, 0x45);
    g_assert_true(backend_answer(b, 60000, &a));
    g_assert_cmpint(b->view[4 * PAGE], ==, 0x45);
    backend_free(b);
}

/* The backend unmaps the memfd and lives on (a vhost-user back-end after a
 * disconnect): lifting write protection from here, harmless where the page
 * is registered, fails with ENOENT once it is not. */
static void
test_unmapped(void)
{
    Backend *b = backend_start(TRUE);
    struct uffdio_writeprotect wp;
    Ans a;

    if (b == NULL) {
        return;
    }
    protect(b, 1, FALSE);
    backend_ask(b, 'u', 0, 0);
    g_assert_true(backend_answer(b, 60000, &a));
    g_assert_cmpint(a.err, ==, 0);
    wp = (struct uffdio_writeprotect){ { (guint64)(guintptr)(b->base + PAGE), PAGE }, 0 };
    g_assert_cmpint(ioctl(b->uffd, UFFDIO_WRITEPROTECT, &wp), ==, -1);
    g_assert_cmpint(errno, ==, ENOENT);
    backend_free(b);
}

/*
 * The backend's pread() into a punched page: the kernel writes it, not the
 * backend.  With a user-mode-only userfaultfd (all an unprivileged process
 * can make with vm.unprivileged_userfaultfd=0) the fault is not the
 * handler's and the call fails with EFAULT: the guest's read would fail.
 * With a whole one, the kernel's fault waits to be resolved like any
 * other, and the read lands in the page folded back.
 */
static void
test_kernel_access(gconstpointer data)
{
    gboolean user_mode_only = GPOINTER_TO_INT(data);
    Backend *b;
    Ans a;

    if ((b = backend_start(user_mode_only)) == NULL) {
        return;
    }
    punch(b, 6);
    backend_ask(b, 'p', 6, 0);
    if (user_mode_only) {
        struct pollfd p = { b->uffd, POLLIN, 0 };

        g_assert_true(backend_answer(b, 60000, &a));
        g_assert_cmpint(a.err, ==, EFAULT);
        /* Nothing landed, and nothing was asked of this side. */
        g_assert_cmpint(lseek(b->memfd, 6 * PAGE, SEEK_DATA), ==, 7 * PAGE);
        g_assert_cmpint(poll(&p, 1, 0), ==, 0);
    } else {
        expect_fault(b, 6, FALSE);
        g_assert_false(backend_answer(b, 200, &a));
        copy_in(b, 6, 0x66);
        g_assert_true(backend_answer(b, 60000, &a));
        g_assert_cmpint(a.err, ==, 0);
        g_assert_cmpint(a.first, ==, 0xf5);
        g_assert_cmpint(b->view[6 * PAGE + PAGE - 1], ==, 0xf5);
    }
    backend_free(b);
}

/*
 * The backend's pread() into a write-protected page: the kernel's write
 * fault is refused by a user-mode-only userfaultfd (EFAULT, the page
 * unchanged), and waits with a whole one until protection is lifted.
 */
static void
test_kernel_write_protected(gconstpointer data)
{
    gboolean user_mode_only = GPOINTER_TO_INT(data);
    Backend *b;
    Ans a;

    if ((b = backend_start(user_mode_only)) == NULL) {
        return;
    }
    backend_ask(b, 'r', 5, 0);
    g_assert_true(backend_answer(b, 60000, &a));
    protect(b, 5, TRUE);
    backend_ask(b, 'p', 5, 0);
    if (user_mode_only) {
        g_assert_true(backend_answer(b, 60000, &a));
        g_assert_cmpint(a.err, ==, EFAULT);
        g_assert_cmpint(b->view[5 * PAGE], ==, 5);
    } else {
        expect_fault(b, 5, TRUE);
        g_assert_false(backend_answer(b, 200, &a));
        g_assert_cmpint(b->view[5 * PAGE], ==, 5);
        protect(b, 5, FALSE);
        g_assert_true(backend_answer(b, 60000, &a));
        g_assert_cmpint(a.err, ==, 0);
        g_assert_cmpint(b->view[5 * PAGE], ==, 0xf5);
    }
    backend_free(b);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/uffd-backend/write-protect", test_write_protect);
    g_test_add_func("/uffd-backend/missing-after-punch", test_missing_after_punch);
    g_test_add_func("/uffd-backend/unmapped", test_unmapped);
    g_test_add_data_func("/uffd-backend/kernel-access/user-mode-only", GINT_TO_POINTER(TRUE),
                         test_kernel_access);
    g_test_add_data_func("/uffd-backend/kernel-access/whole", GINT_TO_POINTER(FALSE),
                         test_kernel_access);
    g_test_add_data_func("/uffd-backend/kernel-write-protected/user-mode-only",
                         GINT_TO_POINTER(TRUE), test_kernel_write_protected);
    g_test_add_data_func("/uffd-backend/kernel-write-protected/whole", GINT_TO_POINTER(FALSE),
                         test_kernel_write_protected);
    return g_test_run();
}
