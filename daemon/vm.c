/*
 * vm.c - one attached VM (vm.h): its process pinned by a pidfd, its RAM
 * found in /proc/PID/maps (attached by pid) or taken from its agent, the
 * pool chunks it holds, its mappings counted.  Owns the VM record and its
 * regions; must never map guest RAM writable nor touch a page.
 *
 * The memfd is opened through /proc/PID/map_files/START-END, which names
 * exactly the file behind the mapping (QEMU may have several memfds) and
 * gives a read-only file description of our own.  That needs CAP_SYS_ADMIN,
 * which pagefoldd has as root.  An agent's memfds are checked the same way:
 * the file behind each of its mappings must be the one it passed.  Its
 * /proc/PID files are read through a directory fd opened while its pidfd
 * showed it alive, never by pid again, so a reused pid cannot swap in
 * another process's mappings.
 */
#include "vm.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "escape.h"
#include "extents.h"
#include "util.h"

typedef struct {
    guint64 start, end, offset;
    guint64 ino;
    char *name;
} MapsRange;

static void
maps_range_clear(gpointer p)
{
    g_free(((MapsRange *)p)->name);
}

/* The shared memfd mappings of a process's maps (text), adjacent pieces of
 * one file joined (QEMU's own madvise() calls can split one RAM block's
 * VMA). */
static GArray *
memfd_ranges(const char *text)
{
    g_auto(GStrv) lines = g_strsplit(text, "\n", -1);
    g_autoptr(GArray) out = g_array_new(FALSE, TRUE, sizeof(MapsRange));

    g_array_set_clear_func(out, maps_range_clear);
    for (char **l = lines; *l != NULL; l++) {
        guint64 start, end, offset, ino;
        char perms[8];
        int name_at = 0;
        const char *name;

        if (sscanf(*l, "%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x %7s %"
                   G_GINT64_MODIFIER "x %*s %" G_GINT64_MODIFIER "u %n",
                   &start, &end, perms, &offset, &ino, &name_at) != 5 ||
            name_at == 0) {
            continue;
        }
        name = *l + name_at;
        if (!g_str_has_prefix(name, "/memfd:") || strlen(perms) != 4 ||
            perms[0] != 'r' || perms[1] != 'w' || perms[3] != 's') {
            continue;
        }
        if (out->len > 0) {
            MapsRange *prev = &g_array_index(out, MapsRange, out->len - 1);

            if (prev->ino == ino && prev->end == start &&
                prev->offset + (prev->end - prev->start) == offset) {
                prev->end = end;
                continue;
            }
        }
        {
            MapsRange r = { start, end, offset, ino, NULL };
            const char *n = name + strlen("/memfd:");
            const char *del = g_strrstr(n, " (deleted)");

            g_autofree char *raw = del ? g_strndup(n, del - n) : g_strdup(n);

            /* Whoever made the memfd named it: escaped like an agent's. */
            r.name = pf_escape_text(raw, -1);
            g_array_append_val(out, r);
        }
    }
    return g_steal_pointer(&out);
}

static PfRegion *
region_open(PfVm *vm, const MapsRange *m, GError **error)
{
    g_autofree char *path = g_strdup_printf(
        "/proc/%d/map_files/%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x",
        vm->pid, m->start, m->end);
    struct stat st;
    PfRegion *r;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR,
                    e == ENOENT ? PF_ERROR_NOT_FOUND : PF_ERROR_FAILED,
                    "cannot open %s: %s%s", path, g_strerror(e),
                    e == EPERM ? " (pagefoldd needs CAP_SYS_ADMIN)" : "");
        return NULL;
    }
    if (fstat(fd, &st) < 0 || (guint64)st.st_ino != m->ino) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND,
                    "region %s of process %d changed while being attached",
                    m->name, vm->pid);
        close(fd);
        return NULL;
    }
    r = pf_region_new(m->name, fd, m->start, m->offset, m->end - m->start, error);
    if (r != NULL) {
        r->vm = vm;
    }
    return r;
}

static gboolean
region_matches(const PfRegion *r, const MapsRange *m)
{
    return r->ino == m->ino && r->host_addr == m->start &&
           r->size == m->end - m->start && r->file_offset == m->offset;
}

struct _PfVmLook {
    GError *error;    /* maps could not be read */
    GArray *ranges;   /* MapsRange, with PF_VM_LOOK_RANGES */
    GHashTable *held; /* guint64* inodes */
    guint64 vmas;
};

void
pf_vm_look_free(PfVmLook *look)
{
    if (look == NULL) {
        return;
    }
    g_clear_error(&look->error);
    g_clear_pointer(&look->ranges, g_array_unref);
    g_clear_pointer(&look->held, g_hash_table_unref);
    g_free(look);
}

/* The pool chunks a process maps (from its maps text) or holds a
 * descriptor of, into held. */
static void
held_pool(int pid, const char *text, GHashTable *held)
{
    static const char tag[] = "/memfd:pagefold-pool-";
    g_autofree char *fd_path = g_strdup_printf("/proc/%d/fd", pid);
    g_auto(GStrv) lines = g_strsplit(text, "\n", -1);
    g_autoptr(GDir) dir = NULL;
    const char *e;

    for (guint i = 0; lines[i] != NULL; i++) {
        guint64 ino;

        if (strstr(lines[i], tag) != NULL &&
            sscanf(lines[i], "%*s %*s %*s %*s %" G_GUINT64_FORMAT, &ino) == 1) {
            g_hash_table_add(held, g_memdup2(&ino, sizeof(ino)));
        }
    }
    dir = g_dir_open(fd_path, 0, NULL);
    while (dir != NULL && (e = g_dir_read_name(dir)) != NULL) {
        g_autofree char *path = g_build_filename(fd_path, e, NULL);
        g_autofree char *target = g_file_read_link(path, NULL);
        struct stat st;

        if (target != NULL && g_str_has_prefix(target, tag) && stat(path, &st) == 0) {
            guint64 ino = st.st_ino;

            g_hash_table_add(held, g_memdup2(&ino, sizeof(ino)));
        }
    }
}

static PfVmLook *
look_read(int pid, guint what)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/maps", pid);
    g_autofree char *text = NULL;
    PfVmLook *look = g_new0(PfVmLook, 1);
    gsize len = 0;

    look->held = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free, NULL);
    if (g_file_get_contents(path, &text, &len, &look->error)) {
        for (gsize i = 0; i < len; i++) {
            look->vmas += text[i] == '\n';
        }
        if (what & PF_VM_LOOK_RANGES) {
            look->ranges = memfd_ranges(text);
        }
        if (what & PF_VM_LOOK_HELD) {
            held_pool(pid, text, look->held);
        }
    }
    return look;
}

static void
look_thread(GTask *task, gpointer source, gpointer data, GCancellable *cancel)
{
    guint what = GPOINTER_TO_UINT(data) & 3;
    int pid = (int)(GPOINTER_TO_UINT(data) >> 2);

    g_task_return_pointer(task, look_read(pid, what), (GDestroyNotify)pf_vm_look_free);
}

void
pf_vm_look_async(const PfVm *vm, guint what, GCancellable *cancel, GAsyncReadyCallback callback,
                 gpointer user)
{
    g_autoptr(GTask) task = g_task_new(NULL, cancel, callback, user);

    /* Pids fit in 22 bits (PID_MAX_LIMIT). */
    g_task_set_task_data(task, GUINT_TO_POINTER((guint)vm->pid << 2 | (what & 3)), NULL);
    g_task_set_return_on_cancel(task, TRUE);
    g_task_run_in_thread(task, look_thread);
}

PfVmLook *
pf_vm_look_finish(GAsyncResult *res, GError **error)
{
    return g_task_propagate_pointer(G_TASK(res), error);
}

GHashTable *
pf_vm_look_held_pool(const PfVmLook *look)
{
    return look->held;
}

guint64
pf_vm_look_vmas(const PfVmLook *look)
{
    return look->vmas;
}

gboolean
pf_vm_refresh(PfVm *vm, const PfVmLook *look, GPtrArray *gone, GPtrArray *added, GError **error)
{
    GArray *ranges = look->ranges;
    g_autoptr(GArray) seen = NULL;

    if (pf_vm_exited(vm)) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND,
                    "process %d has exited", vm->pid);
        return FALSE;
    }
    if (vm->kind == PF_VM_AGENT) {
        return TRUE; /* the agent says what its RAM is */
    }
    if (look->error != NULL) {
        g_propagate_error(error, g_error_copy(look->error));
        return FALSE;
    }
    g_return_val_if_fail(ranges != NULL, FALSE);
    seen = g_array_sized_new(FALSE, TRUE, sizeof(gboolean), ranges->len);
    g_array_set_size(seen, ranges->len);

    for (guint i = 0; i < vm->regions->len;) {
        PfRegion *r = g_ptr_array_index(vm->regions, i);
        gboolean found = FALSE;

        for (guint k = 0; k < ranges->len; k++) {
            if (region_matches(r, &g_array_index(ranges, MapsRange, k))) {
                g_array_index(seen, gboolean, k) = TRUE;
                found = TRUE;
                break;
            }
        }
        if (found) {
            i++;
        } else {
            g_ptr_array_add(gone, pf_vm_steal_region(vm, i));
        }
    }
    for (guint k = 0; k < ranges->len; k++) {
        const MapsRange *m = &g_array_index(ranges, MapsRange, k);
        g_autoptr(GError) local = NULL;
        PfRegion *r;

        if (g_array_index(seen, gboolean, k) ||
            m->end - m->start < PF_MIN_REGION_SIZE) {
            continue;
        }
        r = region_open(vm, m, &local);
        if (r == NULL) {
            /* A mapping that went away between maps and open is not an
             * error of the VM; anything else is. */
            if (g_error_matches(local, PF_ERROR, PF_ERROR_NOT_FOUND)) {
                continue;
            }
            g_propagate_error(error, g_steal_pointer(&local));
            return FALSE;
        }
        pf_vm_add_region(vm, r);
        g_ptr_array_add(added, r);
    }
    return TRUE;
}

const char *
pf_vm_uuid_string(const PfVm *vm, char buf[37])
{
    return pf_uuid_text(vm->uuid, buf);
}

/*
 * Names and UUIDs are labels (VMs started without -name are all "qemu",
 * and an agent may claim any UUID): a key that more than one VM answers to
 * names none of them.  Only the pid is an identity.  A key of digits is a
 * pid and a UUID-shaped one a UUID, never a name, so that no VM can name
 * itself after another's pid or UUID and be taken for it.
 */
gssize
pf_vm_key_find(const PfVmKey *keys, guint n, const char *key, GError **error)
{
    g_autoptr(GString) pids = g_string_new(NULL);
    gssize found = -1;
    guint n_found = 0;
    guint8 uuid[16];
    gboolean by_uuid;

    if (key == NULL || *key == '\0') {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "a VM is named by its pid, its UUID or its name");
        return -1;
    }
    if (strspn(key, "0123456789") == strlen(key)) {
        guint64 pid = 0;

        if (pf_parse_u64(key, 1, G_MAXINT, &pid, NULL)) {
            for (guint i = 0; i < n; i++) {
                if (keys[i].pid == (int)pid) {
                    return i;
                }
            }
        }
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "no VM of pid %s is attached", key);
        return -1;
    }
    by_uuid = pf_uuid_parse(key, uuid);
    for (guint i = 0; i < n; i++) {
        if (by_uuid ? memcmp(keys[i].uuid, uuid, sizeof(uuid)) == 0
                    : g_strcmp0(keys[i].name, key) == 0) {
            g_string_append_printf(pids, "%s%d", n_found ? ", " : "", keys[i].pid);
            found = i;
            n_found++;
        }
    }
    if (n_found == 1) {
        return found;
    }
    if (n_found == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "no VM '%s' is attached", key);
    } else {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%u VMs have the %s '%s' (pids %s): name one by its pid", n_found,
                    by_uuid ? "UUID" : "name", key, pids->str);
    }
    return -1;
}

/* The value of QEMU's option opt (e.g. "-name"), if the process has it. */
static char *
cmdline_option(int pid, const char *opt)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/cmdline", pid);
    g_autofree char *buf = NULL;
    gsize len = 0;

    if (!g_file_get_contents(path, &buf, &len, NULL)) {
        return NULL;
    }
    for (gsize off = 0; off < len;) {
        const char *arg = buf + off;
        gsize alen = strnlen(arg, len - off);
        gsize next = off + alen + 1;

        if (strcmp(arg, opt) == 0 && next < len) {
            return g_strndup(buf + next, strnlen(buf + next, len - next));
        }
        off = next;
    }
    return NULL;
}

/* QEMU's -name guest=NAME,... or -name NAME, if the process has one. */
static char *
name_from_cmdline(int pid)
{
    g_autofree char *value = cmdline_option(pid, "-name");
    g_auto(GStrv) parts = NULL;

    if (value == NULL) {
        return NULL;
    }
    parts = g_strsplit(value, ",", -1);
    for (char **p = parts; *p != NULL; p++) {
        if (g_str_has_prefix(*p, "guest=")) {
            return g_strdup(*p + strlen("guest="));
        }
        if (p == parts && strchr(*p, '=') == NULL && **p != '\0') {
            return g_strdup(*p);
        }
    }
    return NULL;
}

/* The process's owner chose its command line and its name: escaped
 * like an agent's. */
static char *
default_name(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/comm", pid);
    g_autofree char *comm = NULL;
    g_autofree char *name = name_from_cmdline(pid);

    if (name != NULL) {
        return pf_escape_text(name, -1);
    }
    if (g_file_get_contents(path, &comm, NULL, NULL)) {
        g_autofree char *shown = pf_escape_text(g_strstrip(comm), -1);

        return g_strdup_printf("%s-%d", shown, pid);
    }
    return g_strdup_printf("pid-%d", pid);
}

/* pidfd: the process's, to duplicate, or -1 to open one by pid. */
/* When the process of proc_dir (its /proc/PID, or AT_FDCWD with path
 * "/proc/PID/stat") started: field 22 of its stat, or 0. */
static guint64
read_start_time(int proc_dir, const char *path)
{
    char buf[1024];
    const char *after;
    g_auto(GStrv) fields = NULL;
    guint64 t = 0;
    ssize_t n;
    int fd = openat(proc_dir, path, O_RDONLY | O_CLOEXEC);

    if (fd < 0) {
        return 0;
    }
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) {
        return 0;
    }
    buf[n] = '\0';
    /* After the name (which may hold anything): state is field 3. */
    if ((after = strrchr(buf, ')')) == NULL || after[1] == '\0') {
        return 0;
    }
    fields = g_strsplit(after + 2, " ", 0);
    if (g_strv_length(fields) > 19) {
        (void)pf_parse_u64(fields[19], 1, G_MAXUINT64, &t, NULL);
    }
    return t;
}

guint64
pf_process_start_time(int pid)
{
    g_autofree char *stat = g_strdup_printf("/proc/%d/stat", pid);

    return read_start_time(AT_FDCWD, stat);
}

static PfVm *
vm_new(int pid, int pidfd, GError **error)
{
    g_autoptr(PfVm) vm = g_new0(PfVm, 1);

    vm->pid = pid;
    vm->pidfd = -1;
    vm->pagemap_fd = -1;
    vm->mode = PF_MODE_ADVISE;
    vm->mode_reason = g_strdup("attached by pid: no pagefold agent in this process");
    vm->regions = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    if (pid <= 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%d is not a process id", pid);
        return NULL;
    }
    /* The pidfd first: from here on a reused pid cannot fool us. */
    vm->pidfd = pidfd >= 0 ? fcntl(pidfd, F_DUPFD_CLOEXEC, 3)
                           : (int)syscall(SYS_pidfd_open, pid, 0);
    if (vm->pidfd < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR,
                    e == ESRCH ? PF_ERROR_NOT_FOUND : PF_ERROR_FAILED,
                    "no process %d: %s", pid, g_strerror(e));
        return NULL;
    }
    /* Read by pid: the process's own if its pidfd says it lives after
     * (an agent's VM reads it again through its pinned directory). */
    vm->start_time = pf_process_start_time(pid);
    if (pf_vm_exited(vm)) {
        vm->start_time = 0;
    }
    return g_steal_pointer(&vm);
}

PfVm *
pf_vm_new_from_agent(int pid, int pidfd, int proc_dir, const char *name, const guint8 uuid[16],
                     GPtrArray *regions_in, PfMode mode, const char *reason, GError **error)
{
    g_autoptr(GPtrArray) regions = regions_in;
    g_autoptr(PfVm) vm = vm_new(pid, pidfd, error);
    g_autofree char *pagemap = g_strdup_printf("/proc/%d/pagemap", pid);

    if (vm == NULL) {
        return NULL;
    }
    for (guint i = 0; i < regions->len; i++) {
        pf_vm_add_region(vm, g_ptr_array_index(regions, i));
    }
    /* They are the VM's now, freed with it. */
    g_ptr_array_set_free_func(regions, NULL);
    vm->start_time = read_start_time(proc_dir, "stat");
    vm->pagemap_fd = openat(proc_dir, "pagemap", O_RDONLY | O_CLOEXEC);
    if (vm->pagemap_fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot open %s: %s", pagemap,
                    g_strerror(errno));
        return NULL;
    }
    /* The agent's words: escaped once, here, so that the log, replies
     * and JSON all show the one same printable text. */
    vm->name = pf_escape_text(name, -1);
    memcpy(vm->uuid, uuid, sizeof(vm->uuid));
    vm->mode = mode;
    g_free(vm->mode_reason);
    vm->mode_reason = mode == PF_MODE_MERGE ? NULL : pf_escape_text(reason, -1);
    vm->kind = PF_VM_AGENT;
    vm->outbox = pf_outbox_new();
    return g_steal_pointer(&vm);
}

const char *
pf_vm_mode_name(const PfVm *vm)
{
    return vm->mode == PF_MODE_MERGE ? "merge" : "advise";
}

void
pf_vm_add_region(PfVm *vm, PfRegion *r)
{
    r->vm = vm;
    r->index = vm->regions->len;
    g_ptr_array_add(vm->regions, r);
}

PfRegion *
pf_vm_steal_region(PfVm *vm, guint k)
{
    PfRegion *r;

    g_return_val_if_fail(vm->kind == PF_VM_BY_PID, NULL);
    r = g_ptr_array_steal_index(vm->regions, k);
    for (guint i = k; i < vm->regions->len; i++) {
        ((PfRegion *)g_ptr_array_index(vm->regions, i))->index = i;
    }
    return r;
}

gboolean
pf_vm_merges(const PfVm *vm)
{
    return vm->mode == PF_MODE_MERGE;
}

PfVm *
pf_vm_attach(int pid, const char *name, GError **error)
{
    g_autoptr(PfVm) vm = vm_new(pid, -1, error);
    g_autoptr(GPtrArray) gone = g_ptr_array_new();
    g_autoptr(GPtrArray) added = g_ptr_array_new();
    g_autoptr(PfVmLook) look = NULL;

    if (vm == NULL) {
        return NULL;
    }
    /* Root's command, once: its reads may wait here. */
    look = look_read(pid, PF_VM_LOOK_RANGES);
    if (!pf_vm_refresh(vm, look, gone, added, error)) {
        return NULL;
    }
    if (vm->regions->len == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_NO_GUEST_RAM,
                    "process %d has no guest RAM pagefold can scan: no shared "
                    "memfd mapping of at least %u KiB (is it a QEMU with "
                    "-object memory-backend-memfd,share=on?)",
                    pid, PF_MIN_REGION_SIZE / 1024);
        return NULL;
    }
    if (pf_vm_exited(vm)) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND,
                    "process %d exited while being attached", pid);
        return NULL;
    }
    vm->name = name && *name ? g_strdup(name) : default_name(pid);
    {
        g_autofree char *uuid = cmdline_option(pid, "-uuid");

        if (uuid == NULL || !pf_uuid_parse(uuid, vm->uuid)) {
            memset(vm->uuid, 0, sizeof(vm->uuid));
        }
    }
    return g_steal_pointer(&vm);
}

void
pf_vm_free(PfVm *vm)
{
    if (vm == NULL) {
        return;
    }
    /* The scanner's record of it went first (scan-vms.c). */
    g_warn_if_fail(vm->scan == NULL);
    g_clear_pointer(&vm->regions, g_ptr_array_unref);
    if (vm->pidfd >= 0) {
        close(vm->pidfd);
    }
    if (vm->pagemap_fd >= 0) {
        close(vm->pagemap_fd);
    }
    pf_outbox_free(vm->outbox);
    g_free(vm->mode_reason);
    g_free(vm->name);
    g_free(vm);
}

gboolean
pf_vm_exited(const PfVm *vm)
{
    struct pollfd pfd = { .fd = vm->pidfd, .events = POLLIN };

    /* A pidfd turns readable when its process exits. */
    return poll(&pfd, 1, 0) != 0;
}

gsize
pf_vm_n_pages(const PfVm *vm)
{
    gsize n = 0;

    for (guint i = 0; i < vm->regions->len; i++) {
        n += ((PfRegion *)g_ptr_array_index(vm->regions, i))->n_pages;
    }
    return n;
}
