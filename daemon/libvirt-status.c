/*
 * libvirt-status.c - a running domain's QEMU pid from libvirt's root-owned
 * status file (libvirt-status.h): reads the file's head only, through no
 * link, from nobody but root, and believes nothing else.
 */
#include "libvirt-status.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

/* <domstatus ...> comes right after a comment of a few hundred bytes. */
#define HEAD_BYTES 8192

gboolean
pf_libvirt_name_is_file_name(const char *name)
{
    return *name != '\0' && strchr(name, '/') == NULL && !g_str_equal(name, ".") &&
           !g_str_equal(name, "..");
}

int
pf_libvirt_domain_pid(const char *run_dir, const char *name, GError **error)
{
    g_autofree char *base = NULL;
    g_autofree char *path = NULL;
    char head[HEAD_BYTES + 1];
    const char *tag, *end, *attr;
    struct stat st;
    guint64 pid;
    ssize_t n;
    int fd, e;

    /* libvirt refuses these in a domain's name; they would lead elsewhere. */
    if (!pf_libvirt_name_is_file_name(name)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "domain name '%s' is not a file name", name);
        return 0;
    }
    base = g_strconcat(name, ".xml", NULL);
    path = g_build_filename(run_dir, base, NULL);
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        e = errno;
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "cannot read %s: %s", path,
                    g_strerror(e));
        return 0;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != 0 ||
        (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "%s is not libvirt's status file (a regular file only root writes)",
                    path);
        return 0;
    }
    n = pread(fd, head, HEAD_BYTES, 0);
    e = errno;
    close(fd);
    if (n < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot read %s: %s", path,
                    g_strerror(e));
        return 0;
    }
    head[n] = '\0';
    tag = strstr(head, "<domstatus ");
    end = tag ? strchr(tag, '>') : NULL;
    attr = tag ? g_strstr_len(tag, end ? end - tag : -1, " pid=") : NULL;
    if (end == NULL || attr == NULL || (attr[5] != '\'' && attr[5] != '"')) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND,
                    "%s names no QEMU process (no <domstatus pid=...>)", path);
        return 0;
    }
    {
        const char *digits = attr + 6;
        const char *close_quote = strchr(digits, attr[5]);
        g_autofree char *text = close_quote ? g_strndup(digits, close_quote - digits) : NULL;

        if (text == NULL || !pf_parse_u64(text, 1, G_MAXINT, &pid, NULL)) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s: <domstatus pid=...> is no process id", path);
            return 0;
        }
    }
    return (int)pid;
}
