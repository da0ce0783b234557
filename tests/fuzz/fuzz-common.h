/*
 * fuzz-common.h - what the libFuzzer targets of tests/fuzz share: counting
 * this process's descriptors (a target aborts if an input leaked one),
 * making the descriptors a hostile peer could pass (memfds, sealed or not,
 * pipes, /dev/null), and sending one datagram with them over a
 * SOCK_SEQPACKET pair through the framing's own sendmsg()
 * (pf_proto_send_raw()), as a real peer would.
 *
 * Header-only and static: each target is one program of one .c file.
 */
#pragma once

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "proto.h"
#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

/* Open descriptors, from /proc/self/fd (its own directory's counted in
 * every call alike). */
static inline int
fuzz_count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;

    if (d == NULL) {
        abort();
    }
    while (readdir(d) != NULL) {
        n++;
    }
    closedir(d);
    return n;
}

/* Aborts (a finding) if the count is not what it was before the input. */
static inline void
fuzz_check_fds(int before, const char *what)
{
    int after = fuzz_count_fds();

    if (after != before) {
        DIR *d = opendir("/proc/self/fd");
        struct dirent *e;

        fprintf(stderr, "fuzz: %s leaked %d descriptor(s); open now:\n", what, after - before);
        while (d != NULL && (e = readdir(d)) != NULL) {
            char path[300], target[256];
            ssize_t n;

            snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
            n = readlink(path, target, sizeof(target) - 1);
            if (n > 0) {
                target[n] = '\0';
                fprintf(stderr, "  %s -> %s\n", e->d_name, target);
            }
        }
        abort();
    }
}

/*
 * Page p of a test pattern: zero every 8th page, else one of 4 fillings.
 * Guest pages and pool slots use the same, so that a merge of page p with
 * slot s finds them equal exactly when p and s are of one class.
 */
static inline void
fuzz_fill_page(guint8 *page, guint64 p)
{
    memset(page, p % 8 == 7 ? 0 : (int)(p % 4) + 1, PF_PAGE_SIZE);
}

static inline gboolean
fuzz_page_is(const guint8 *page, guint64 p)
{
    /* memcmp(): a byte loop, instrumented, would be most of an input's
     * time. */
    static guint8 want[5][PF_PAGE_SIZE];
    guint k = p % 8 == 7 ? 0 : (guint)(p % 4) + 1;

    if (want[1][0] == 0) {
        for (guint i = 1; i < 5; i++) {
            memset(want[i], (int)i, PF_PAGE_SIZE);
        }
    }
    return memcmp(page, want[k], PF_PAGE_SIZE) == 0;
}

static inline GLogWriterOutput
fuzz_log_writer(GLogLevelFlags level, const GLogField *fields, gsize n_fields, gpointer user)
{
    if (level & (G_LOG_LEVEL_CRITICAL | G_LOG_LEVEL_ERROR)) {
        g_log_writer_standard_streams(level, fields, n_fields, user);
        abort();
    }
    return G_LOG_WRITER_HANDLED;
}

/*
 * Messages and warnings are what a refused input is meant to cause, and
 * would flood the fuzzer's output: dropped.  A critical is a broken
 * contract (a g_return_if_fail() met): a finding.
 */
static inline void
fuzz_quiet_logs(void)
{
    g_log_set_writer_func(fuzz_log_writer, NULL, NULL);
}

enum { FUZZ_FD_SEALED_MEMFD, FUZZ_FD_MEMFD, FUZZ_FD_PIPE, FUZZ_FD_NULL };

/* One descriptor of a kind (spec & 3), memfds of n_pages pages of the
 * pattern; the caller closes it. */
static inline int
fuzz_make_fd(guint spec, guint n_pages)
{
    int fd, p[2];

    switch (spec & 3) {
    case FUZZ_FD_SEALED_MEMFD:
    case FUZZ_FD_MEMFD:
        fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, (off_t)n_pages * PF_PAGE_SIZE) < 0) {
            abort();
        }
        for (guint i = 0; i < n_pages; i++) {
            guint8 page[PF_PAGE_SIZE];

            fuzz_fill_page(page, i);
            if (pwrite(fd, page, sizeof(page), (off_t)i * PF_PAGE_SIZE) != sizeof(page)) {
                abort();
            }
        }
        if ((spec & 3) == FUZZ_FD_SEALED_MEMFD &&
            fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_GROW | F_SEAL_SHRINK) < 0) {
            abort();
        }
        return fd;
    case FUZZ_FD_PIPE:
        if (pipe2(p, O_CLOEXEC) < 0) {
            abort();
        }
        close(p[1]);
        return p[0];
    default:
        fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            abort();
        }
        return fd;
    }
}

/* A SOCK_SEQPACKET pair, as pagefoldd and an agent have; big buffers so
 * that any datagram a fuzzer makes goes in one send. */
static inline void
fuzz_socketpair(int sv[2])
{
    int size = 1 << 20;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        abort();
    }
    for (int i = 0; i < 2; i++) {
        (void)setsockopt(sv[i], SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
        (void)setsockopt(sv[i], SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
    }
}

/*
 * Sends data as one datagram on sock, which must not block (the input's
 * reader is this thread), with n_fds descriptors made by
 * fuzz_make_fd(kinds >> 2 * i, n_pages) (the kernel passes copies: ours
 * are closed here).  FALSE when the kernel refused it (too large).
 */
static inline gboolean
fuzz_send(int sock, const guint8 *data, gsize len, guint n_fds, guint kinds, guint n_pages)
{
    int fds[PF_PROTO_RAW_MAX_FDS];
    gboolean sent;

    g_assert(n_fds <= G_N_ELEMENTS(fds));
    for (guint i = 0; i < n_fds; i++) {
        fds[i] = fuzz_make_fd(kinds >> (2 * i), n_pages);
    }
    sent = pf_proto_send_raw(sock, data, len, fds, n_fds, NULL);
    for (guint i = 0; i < n_fds; i++) {
        close(fds[i]);
    }
    return sent;
}
