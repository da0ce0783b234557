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
/* A status file holds the domain's XML and QEMU's capabilities: some
 * hundred KiB. */
#define MAX_STATUS_BYTES (4u << 20)

gboolean
pf_libvirt_name_is_file_name(const char *name)
{
    return *name != '\0' && strchr(name, '/') == NULL && !g_str_equal(name, ".") &&
           !g_str_equal(name, "..");
}

/* The status file of domain name, opened: a regular file only root
 * writes, through no link; -1 and error otherwise.  *path_out: its path. */
static int
open_status(const char *run_dir, const char *name, char **path_out, GError **error)
{
    g_autofree char *base = NULL;
    g_autofree char *path = NULL;
    struct stat st;
    int fd, e;

    /* libvirt refuses these in a domain's name; they would lead elsewhere. */
    if (!pf_libvirt_name_is_file_name(name)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "domain name '%s' is not a file name", name);
        return -1;
    }
    base = g_strconcat(name, ".xml", NULL);
    path = g_build_filename(run_dir, base, NULL);
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        e = errno;
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "cannot read %s: %s", path,
                    g_strerror(e));
        return -1;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != 0 ||
        (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        close(fd);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "%s is not libvirt's status file (a regular file only root writes)",
                    path);
        return -1;
    }
    *path_out = g_steal_pointer(&path);
    return fd;
}

int
pf_libvirt_domain_pid(const char *run_dir, const char *name, GError **error)
{
    g_autofree char *path = NULL;
    char head[HEAD_BYTES + 1];
    const char *tag, *end, *attr;
    guint64 pid;
    ssize_t n;
    int fd = open_status(run_dir, name, &path, error), e;

    if (fd < 0) {
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

int
pf_libvirt_domain_status(const char *run_dir, const char *name, Domain *dom, GError **error)
{
    g_autofree char *path = NULL;
    g_autoptr(GString) xml = g_string_new(NULL);
    g_autoptr(GError) local = NULL;
    char buf[65536];
    int fd = open_status(run_dir, name, &path, error), pid = 0;
    ssize_t n;

    if (fd < 0) {
        return 0;
    }
    while ((n = read(fd, buf, sizeof(buf))) > 0 && xml->len <= MAX_STATUS_BYTES) {
        g_string_append_len(xml, buf, n);
    }
    close(fd);
    if (n < 0 || xml->len > MAX_STATUS_BYTES) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot read %s: %s", path,
                    n < 0 ? g_strerror(errno) : "larger than libvirt writes");
        return 0;
    }
    if (!domain_status_parse(name, xml, dom, &pid, &local)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "%s: %s", path,
                    local->message);
        return 0;
    }
    return pid;
}
