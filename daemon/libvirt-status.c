/*
 * libvirt-status.c - a running domain's QEMU pid from libvirt's root-owned
 * status file (libvirt-status.h): reads the file's head only, through no
 * link, from nobody but root, and believes nothing else.
 */
#include "libvirt-status.h"

#include <dirent.h>
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

/*
 * A folder's mtime is the kernel's coarse clock (a tick of some ms): a
 * file renamed in within the tick of a read could leave the same mtime.
 * So the folder is listed again while its mtime is not older than the
 * last listing's start by more than any tick, but at most every
 * RELIST_USEC (a flood of connections must not make each one list a
 * folder libvirt is busy rewriting); a file whose inode and mtime did not
 * change is not read again (libvirt writes one by renaming a new one into
 * place).
 */
#define MTIME_SETTLED_USEC 100000
#define RELIST_USEC 10000

typedef struct {
    guint64 ino;
    gint64 mtime_nsec;
    int pid;
} StatusSeen;

struct _PfLibvirtPids {
    char *run_dir;      /* of the last listing; NULL: none yet */
    GHashTable *files;  /* file name -> StatusSeen, as the last listing saw */
    GHashTable *pids;   /* pid -> itself, of those files */
    gint64 mtime_usec;  /* the folder's, as that listing began */
    gint64 listed_usec; /* when it began (real time, as mtime is) */
    gint64 listed_mono; /* ... and on the monotonic clock */
};

PfLibvirtPids *
pf_libvirt_pids_new(void)
{
    PfLibvirtPids *p = g_new0(PfLibvirtPids, 1);

    p->files = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, g_free);
    p->pids = g_hash_table_new(NULL, NULL);
    return p;
}

void
pf_libvirt_pids_free(PfLibvirtPids *p)
{
    if (p != NULL) {
        g_hash_table_unref(p->files);
        g_hash_table_unref(p->pids);
        g_free(p->run_dir);
        g_free(p);
    }
}

static void
pids_list(PfLibvirtPids *p, const char *run_dir, gint64 mtime_usec)
{
    g_autoptr(GHashTable) files = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, g_free);
    DIR *dir;
    struct dirent *e;
    guint n = 0;

    if (g_strcmp0(p->run_dir, run_dir) != 0) {
        g_hash_table_remove_all(p->files);
        g_free(p->run_dir);
        p->run_dir = g_strdup(run_dir);
    }
    g_hash_table_remove_all(p->pids);
    p->mtime_usec = mtime_usec;
    p->listed_usec = g_get_real_time();
    p->listed_mono = g_get_monotonic_time();
    dir = opendir(run_dir);
    while (dir != NULL && (e = readdir(dir)) != NULL && n < PF_LIBVIRT_MAX_DOMAINS) {
        gsize len = strlen(e->d_name);
        StatusSeen *was, *seen;
        struct stat st;

        if (len <= 4 || !g_str_has_suffix(e->d_name, ".xml") ||
            fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            continue;
        }
        n++;
        seen = g_new0(StatusSeen, 1);
        seen->ino = st.st_ino;
        seen->mtime_nsec = (gint64)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
        was = g_hash_table_lookup(p->files, e->d_name);
        if (was != NULL && was->ino == seen->ino && was->mtime_nsec == seen->mtime_nsec) {
            seen->pid = was->pid;
        } else {
            g_autofree char *name = g_strndup(e->d_name, len - 4);

            seen->pid = pf_libvirt_domain_pid(run_dir, name, NULL);
        }
        if (seen->pid > 0) {
            g_hash_table_add(p->pids, GINT_TO_POINTER(seen->pid));
        }
        g_hash_table_insert(files, g_strdup(e->d_name), seen);
    }
    if (dir != NULL) {
        closedir(dir); /* none: no libvirt, nobody is vouched for so */
    }
    g_hash_table_unref(p->files);
    p->files = g_steal_pointer(&files);
}

gboolean
pf_libvirt_pids_has(PfLibvirtPids *p, const char *run_dir, int pid)
{
    struct stat st;
    gint64 mtime = 0;

    if (stat(run_dir, &st) == 0) {
        mtime = (gint64)st.st_mtim.tv_sec * G_USEC_PER_SEC + st.st_mtim.tv_nsec / 1000;
    }
    if (p->run_dir == NULL || !g_str_equal(p->run_dir, run_dir) ||
        ((mtime != p->mtime_usec || mtime > p->listed_usec - MTIME_SETTLED_USEC) &&
         g_get_monotonic_time() - p->listed_mono >= RELIST_USEC)) {
        pids_list(p, run_dir, mtime);
    }
    return g_hash_table_contains(p->pids, GINT_TO_POINTER(pid));
}
