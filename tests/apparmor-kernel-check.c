/*
 * apparmor-kernel-check.c - the program tests/apparmor-kernel-check
 * runs in a guest under AppArmor profiles: passes descriptors over
 * SCM_RIGHTS as pagefoldd does (a pool memfd, /dev/userfaultfd, and a plain
 * file as a control), receives them as the agent in QEMU does, connects to
 * a socket in the file system, opens, and executes.  Built static: the
 * guest is an initramfs with busybox.
 *
 *   send SOCK   listen on SOCK (SOCK_SEQPACKET), send the three descriptors
 *   recv SOCK   connect to SOCK, receive, use each descriptor received
 *   exec PATH   execute PATH (a copy of this program: it says "hook ran")
 *   open PATH   open PATH for reading
 * Each prints what happened, and the AppArmor label it ran under.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif

static void label(const char *who) {
    char buf[256] = "?"; int fd = open("/proc/self/attr/current", O_RDONLY);
    if (fd >= 0) { ssize_t n = read(fd, buf, sizeof buf - 1); if (n > 0) buf[n] = 0; close(fd); }
    buf[strcspn(buf, "\n")] = 0;
    printf("%s: label %s\n", who, buf);
}

static int sendfds(const char *path) {
    struct sockaddr_un a = { .sun_family = AF_UNIX };
    int l = socket(AF_UNIX, SOCK_SEQPACKET, 0), c, fds[3];
    strcpy(a.sun_path, path); unlink(path);
    label("send");
    if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) { printf("send: bind/listen: %s\n", strerror(errno)); return 1; }
    chmod(path, 0777);
    fds[0] = memfd_create("pagefold-pool-0", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (ftruncate(fds[0], 4096) || pwrite(fds[0], "POOLPAGE", 8, 0) != 8) printf("send: memfd: %s\n", strerror(errno));
    fcntl(fds[0], F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
    fds[1] = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    fds[2] = open("/tmp/secret", O_RDWR | O_CLOEXEC);
    printf("send: memfd %d uffd-dev %d (%s) secret %d (%s)\n", fds[0], fds[1], fds[1] < 0 ? strerror(errno) : "ok", fds[2], fds[2] < 0 ? strerror(errno) : "ok");
    fflush(stdout);
    c = accept(l, NULL, NULL);
    if (c < 0) { printf("send: accept: %s\n", strerror(errno)); return 1; }
    char cbuf[CMSG_SPACE(sizeof fds)] = { 0 }; char b = 'x';
    struct iovec iov = { &b, 1 };
    struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf };
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    h->cmsg_level = SOL_SOCKET; h->cmsg_type = SCM_RIGHTS; h->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(h), fds, sizeof fds);
    if (sendmsg(c, &m, 0) < 0) printf("send: sendmsg: %s\n", strerror(errno));
    char r; read(c, &r, 1);
    return 0;
}

static int recvfds(const char *path) {
    struct sockaddr_un a = { .sun_family = AF_UNIX };
    int s = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    label("recv");
    if (s < 0) { printf("recv: socket: %s\n", strerror(errno)); return 1; }
    strcpy(a.sun_path, path);
    if (connect(s, (void *)&a, sizeof a) < 0) { printf("recv: connect %s: %s\n", path, strerror(errno)); return 1; }
    printf("recv: connect %s: ok\n", path);
    char cbuf[CMSG_SPACE(3 * sizeof(int))] = { 0 }; char b;
    struct iovec iov = { &b, 1 };
    struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf };
    if (recvmsg(s, &m, 0) < 0) { printf("recv: recvmsg: %s\n", strerror(errno)); return 1; }
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    int n = h ? (int)((h->cmsg_len - CMSG_LEN(0)) / sizeof(int)) : 0, fds[3] = { -1, -1, -1 };
    if (h) memcpy(fds, CMSG_DATA(h), n * sizeof(int));
    printf("recv: %d fds, ctrunc %d, fds %d %d %d\n", n, !!(m.msg_flags & MSG_CTRUNC), fds[0], fds[1], fds[2]);
    /* AppArmor replaces a denied received file by nothing: check each. */
    for (int i = 0; i < 3; i++) {
        char lnk[64], tgt[256] = ""; snprintf(lnk, sizeof lnk, "/proc/self/fd/%d", fds[i]);
        ssize_t k = fds[i] >= 0 ? readlink(lnk, tgt, sizeof tgt - 1) : -1; if (k > 0) tgt[k] = 0;
        printf("recv: fd[%d] -> %s\n", i, fds[i] >= 0 ? tgt : "(none)");
    }
    if (fds[0] >= 0) {
        char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE, fds[0], 0);
        printf("recv: memfd mmap private: %s%s\n", p == MAP_FAILED ? strerror(errno) : "ok ", p == MAP_FAILED ? "" : (memcmp(p, "POOLPAGE", 8) ? "content wrong" : "content ok"));
    }
    if (fds[1] >= 0) {
        int u = ioctl(fds[1], USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
        printf("recv: USERFAULTFD_IOC_NEW: %s\n", u < 0 ? strerror(errno) : "ok");
    }
    if (fds[2] >= 0) {
        char x[8]; printf("recv: secret read: %s\n", read(fds[2], x, sizeof x) < 0 ? strerror(errno) : "ok");
    }
    write(s, "d", 1);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && !strcmp(argv[1], "send")) return sendfds(argv[2]);
    if (argc == 3 && !strcmp(argv[1], "recv")) return recvfds(argv[2]);
    if (argc == 3 && !strcmp(argv[1], "exec")) {
        label("exec");
        execl(argv[2], argv[2], "hook", NULL);
        printf("exec %s: %s\n", argv[2], strerror(errno));
        return 1;
    }
    if (argc == 3 && !strcmp(argv[1], "open")) {
        int fd = open(argv[2], O_RDONLY);
        printf("open %s: %s\n", argv[2], fd < 0 ? strerror(errno) : "ok");
        return fd < 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "hook")) { label("hook ran"); return 0; }
    fprintf(stderr, "usage\n");
    return 2;
}
