/*
 * standin-backend.c - a STAND-IN vhost-user back-end for the agent tests
 * (the real ones, virtiofsd and vhost-user-blk, run in the qemu suite).
 * It maps guest RAM from its VMM's memfd, as libvhost-user maps the
 * memory table's regions (MAP_SHARED, from offset 0), makes a userfaultfd
 * in its own process for missing pages and write protection over that
 * mapping, and hands it to the VMM with where the mapping is: what the
 * patched libvhost-user does.  Once the VMM says yes, it serves the VMM's
 * requests as a device serves its queue, reading and writing pages of
 * guest RAM through its mapping, with the CPU or with a system call
 * (pread()/pwrite() of a scratch file, as virtiofsd moves file data), so
 * that the kernel's faults are taken too.  If the VMM says no, it closes
 * the userfaultfd and serves on plain memory, as a VM that stepped back.
 *
 *   standin-backend MEMFD SOCKET [DEV] [--lie=notuffd|range]
 *
 * MEMFD and SOCKET (SOCK_SEQPACKET, standin-backend.h) are descriptors it
 * inherits; DEV, /dev/userfaultfd's, to make a userfaultfd that takes the
 * kernel's faults without root (-1: none).  --lie hands over a pipe
 * instead of the userfaultfd, or says the mapping is where nothing is
 * mapped.  It exits when the socket closes, or with its VMM.
 *
 * Owns: its mapping and its userfaultfd.  Must never resolve a fault
 * itself: the agent does.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <linux/userfaultfd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "guestmem.h"
#include "standin-backend.h"
#include "testproc.h"

#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif

static G_NORETURN void
die(const char *what)
{
    fprintf(stderr, "standin-backend: %s: %s\n", what, g_strerror(errno));
    exit(1);
}

static int
make_uffd(int dev)
{
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM };
    int uffd = dev >= 0 ? ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK)
                        : (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);

    if (uffd < 0) {
        die("userfaultfd");
    }
    if (ioctl(uffd, UFFDIO_API, &api) < 0) {
        die("UFFDIO_API");
    }
    return uffd;
}

/* A device's access to one page, through the CPU or a system call. */
static int
serve(const PfBeReq *rq, guint8 *page, int scratch, PfBeAns *ans)
{
    ans->err = 0;
    if (rq->op == 'w') {
        guint8 content[PF_PAGE_SIZE];

        pf_fill_page(content, rq->seed);
        if (!rq->syscall) {
            memcpy(page, content, PF_PAGE_SIZE);
        } else if (pwrite(scratch, content, PF_PAGE_SIZE, 0) != PF_PAGE_SIZE ||
                   pread(scratch, page, PF_PAGE_SIZE, 0) != PF_PAGE_SIZE) {
            ans->err = errno ? errno : EIO;
        }
    } else if (!rq->syscall) {
        memcpy(ans->data, page, PF_PAGE_SIZE);
    } else if (pwrite(scratch, page, PF_PAGE_SIZE, 0) != PF_PAGE_SIZE ||
               pread(scratch, ans->data, PF_PAGE_SIZE, 0) != PF_PAGE_SIZE) {
        ans->err = errno ? errno : EIO;
    }
    return ans->err;
}

int
main(int argc, char **argv)
{
    int memfd, sock, dev = -1, uffd, handed, scratch, fd;
    const char *lie = "";
    g_autofree PfBeAns *ans = g_new0(PfBeAns, 1);
    PfBeHello hello = { 0 };
    PfBeAck ack = { 0 };
    struct stat st;
    guint8 *base;
    PfBeReq rq;

    if (argc < 3) {
        fprintf(stderr, "usage: standin-backend MEMFD SOCKET [DEV] [--lie=notuffd|range]\n");
        return 2;
    }
    memfd = atoi(argv[1]);
    sock = atoi(argv[2]);
    if (argc > 3 && !g_str_has_prefix(argv[3], "--")) {
        dev = atoi(argv[3]);
    }
    if (g_str_has_prefix(argv[argc - 1], "--lie=")) {
        lie = argv[argc - 1] + strlen("--lie=");
    }
    /* A back-end blocked in a fault must not outlive its VMM. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() == 1) {
        return 1;
    }
    if (fstat(memfd, &st) < 0) {
        die("fstat");
    }
    base = mmap(NULL, (gsize)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (base == MAP_FAILED) {
        die("mmap");
    }
    /* Only 4 KiB pages here: the agent merges (and punches) 4 KiB pages. */
    if (madvise(base, (gsize)st.st_size, MADV_NOHUGEPAGE) < 0) {
        die("madvise");
    }
    uffd = make_uffd(dev);
    {
        struct uffdio_register reg = {
            .range = { (guint64)(guintptr)base, (guint64)st.st_size },
            .mode = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP,
        };

        if (ioctl(uffd, UFFDIO_REGISTER, &reg) < 0) {
            die("UFFDIO_REGISTER");
        }
    }
    /* Below vm.mmap_min_addr: nothing is ever mapped there. */
    hello.base = g_str_equal(lie, "range") ? PF_PAGE_SIZE : (guint64)(guintptr)base;
    hello.size = (guint64)st.st_size;
    handed = uffd;
    if (g_str_equal(lie, "notuffd")) {
        int p[2];

        if (pipe2(p, O_CLOEXEC) < 0) {
            die("pipe2");
        }
        handed = p[0];
    }
    if (!pf_test_send_fd(sock, &hello, sizeof(hello), handed)) {
        die("send");
    }
    if (pf_test_recv_fd(sock, &ack, sizeof(ack), &fd) != sizeof(ack)) {
        die("the VMM's answer");
    }
    if (ack.status != 0) {
        /* Its registration goes with the last descriptor: plain memory again. */
        close(uffd);
    }
    scratch = memfd_create("standin-backend-scratch", MFD_CLOEXEC);
    if (scratch < 0) {
        die("memfd_create");
    }
    for (;;) {
        gssize n = pf_test_recv_fd(sock, &rq, sizeof(rq), &fd);

        if (n == 0) {
            return 0;
        }
        if (n != sizeof(rq) || rq.page >= (guint64)st.st_size / PF_PAGE_SIZE) {
            fprintf(stderr, "standin-backend: a request that makes no sense\n");
            return 1;
        }
        serve(&rq, base + rq.page * PF_PAGE_SIZE, scratch, ans);
        if (!pf_test_send_fd(sock, ans, sizeof(*ans), -1)) {
            return 0;
        }
    }
}
