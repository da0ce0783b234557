/*
 * util.c - the small pieces pagefoldd, pagefoldctl and the agent share:
 * the error domain, strict number parsing, a Unix socket to listen on, the
 * descriptor limit.  Holds no state, and never depends on daemon code
 * (QEMU links it).  Parsing here is strict on purpose: a knob or a pid given as
 * "12abc", " 12" or "-1" is an error, never a silent 12 or 0.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
/*
 * The library's messages, in the VMM's log too (QEMU routes this domain to
 * its own).
 */
#ifndef G_LOG_DOMAIN
#define G_LOG_DOMAIN "pagefold"
#endif

#include "util.h"

#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

GQuark
pf_error_quark(void)
{
    static GQuark q;

    if (G_UNLIKELY(q == 0)) {
        q = g_quark_from_static_string("pagefold-error-quark");
    }
    return q;
}

gboolean
pf_parse_u64(const char *text, guint64 min, guint64 max, guint64 *out,
             GError **error)
{
    char *end = NULL;
    guint64 v;

    if (text == NULL || !g_ascii_isdigit(text[0])) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "'%s' is not a non-negative whole number",
                    text ? text : "");
        return FALSE;
    }
    errno = 0;
    v = g_ascii_strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0') {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "'%s' is not a non-negative whole number", text);
        return FALSE;
    }
    if (v < min || v > max) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%s is out of range [%" G_GUINT64_FORMAT
                    ", %" G_GUINT64_FORMAT "]",
                    text, min, max);
        return FALSE;
    }
    *out = v;
    return TRUE;
}

int
pf_unix_listen(const char *path, int type, GError **error)
{
    g_autofree char *dir = g_path_get_dirname(path);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    /*
     * Bound and listening under a name of its own, then renamed into
     * place: a client that finds the socket at path can connect.  Bound
     * at path itself, it would be refused between bind() and listen(),
     * and a hook would take pagefoldd for absent and start another.  The
     * longer name bounds both.
     */
    g_autofree char *tmp = g_strdup_printf("%s.%d", path, (int)getpid());
    mode_t old_umask;
    int fd, probe, rc;

    if (strlen(tmp) >= sizeof(addr.sun_path)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "socket path too long: %s", path);
        return -1;
    }
    strcpy(addr.sun_path, path);
    /* Traversable: an unprivileged QEMU reaches the agent socket in it. */
    if (g_mkdir_with_parents(dir, 0755) < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot create %s: %s",
                    dir, g_strerror(e));
        return -1;
    }
    probe = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    if (probe >= 0 &&
        connect(probe, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
        close(probe);
        g_set_error(error, PF_ERROR, PF_ERROR_EXISTS,
                    "another pagefoldd is listening on %s", path);
        return -1;
    }
    if (probe >= 0) {
        close(probe);
    }
    strcpy(addr.sun_path, tmp);
    unlink(tmp);
    fd = socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "socket: %s",
                    g_strerror(e));
        return -1;
    }
    /*
     * Bind under umask 077: the socket is never reachable by others, not
     * even between bind() and chmod().
     */
    old_umask = umask(077);
    rc = bind(fd, (struct sockaddr *)&addr, sizeof(addr));
    umask(old_umask);
    /*
     * The kernel's own cap (somaxconn): connections wait there, not in
     * connect(), while pagefoldd accepts all that wait at each wake-up.
     */
    if (rc < 0 || chmod(tmp, 0600) < 0 || listen(fd, SOMAXCONN) < 0 ||
        rename(tmp, path) < 0) {
        int e = errno;

        close(fd);
        if (rc == 0) {
            unlink(tmp);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot listen on %s: %s", path, g_strerror(e));

        return -1;
    }
    return fd;
}

guint64
pf_raise_nofile_limit(void)
{
    struct rlimit rl;

    if (getrlimit(RLIMIT_NOFILE, &rl) < 0) {
        return 0;
    }
    if (rl.rlim_cur < rl.rlim_max) {
        struct rlimit want = { rl.rlim_max, rl.rlim_max };

        if (setrlimit(RLIMIT_NOFILE, &want) == 0) {
            rl = want;
        }
    }
    return rl.rlim_cur;
}

GSource *
pf_fd_source_new(int fd, GIOCondition cond, GUnixFDSourceFunc func, gpointer data)
{
    GSource *src = g_unix_fd_source_new(fd, cond);

    g_source_set_callback(src, G_SOURCE_FUNC(func), data, NULL);
    g_source_set_can_recurse(src, TRUE);
    return src;
}

guint
pf_fd_add(int fd, GIOCondition cond, GUnixFDSourceFunc func, gpointer data)
{
    GSource *src = pf_fd_source_new(fd, cond, func, data);
    guint id = g_source_attach(src, NULL);

    g_source_unref(src);
    return id;
}
