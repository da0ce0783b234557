/*
 * handshake.c - what an agent must show before pagefoldd believes it
 * (link.c runs the handshake; this file checks it): that its process is
 * the one pinned at accept and may be an agent, that every region it
 * announces is what that process maps, that it may merge only what it
 * write-protected, and what WELCOME offers it.  Never sends, never frees
 * a link, and never believes a field the peer's process does not show.
 */
#include "link-internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "escape.h"
#include "util.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif

/*
 * The peer's process, pinned: a pidfd, and its /proc/PID opened while the
 * pidfd showed it alive (so that directory is that process's for good).
 * SO_PEERPIDFD names the very process that connected; before Linux 6.5 the
 * pid is looked up again, and a peer that died before accept() could have
 * its pid reused by then.
 */
gboolean
handshake_pin_peer(int sock, pid_t pid, int *pidfd_out, int *proc_dir_out, GError **error)
{
    g_autofree char *path = g_strdup_printf("/proc/%d", pid);
    socklen_t len = sizeof(int);
    int pidfd = -1, proc_dir, e;
    struct pollfd p;

    if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) < 0) {
        e = errno;
        pidfd = e == ENOPROTOOPT ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
        if (pidfd < 0) {
            e = e == ENOPROTOOPT ? errno : e;
            g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "no pidfd for process %d: %s", pid,
                        g_strerror(e));
            return FALSE;
        }
    }
    proc_dir = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    p = (struct pollfd){ pidfd, POLLIN, 0 };
    if (proc_dir < 0 || poll(&p, 1, 0) != 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "process %d exited", pid);
        if (proc_dir >= 0) {
            close(proc_dir);
        }
        close(pidfd);
        return FALSE;
    }
    *pidfd_out = pidfd;
    *proc_dir_out = proc_dir;
    return TRUE;
}

/* Whether the connecting process may be an agent: root, pagefoldd's own
 * user, or a member of the group the socket is opened to.  The socket's
 * mode says the same; this holds even where it was loosened by hand. */
gboolean
handshake_peer_permitted(PfLinkServer *srv, int sock, const struct ucred *cred)
{
    gid_t groups[256];
    socklen_t len = sizeof(groups);

    if (cred->uid == 0 || cred->uid == geteuid()) {
        return TRUE;
    }
    if (!srv->group_allowed) {
        return FALSE;
    }
    if (cred->gid == srv->group) {
        return TRUE;
    }
    /* More supplementary groups than that: the peer is refused. */
    if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
        return FALSE;
    }
    for (gsize i = 0; i < len / sizeof(gid_t); i++) {
        if (groups[i] == srv->group) {
            return TRUE;
        }
    }
    return FALSE;
}

/* A REGION passes if the peer's process maps it as announced (vm.c), it
 * overlaps no live region of the VM's (regions: those announced before),
 * and the VM stays within its cap. */
static gboolean
region_acceptable(PfLink *l, GPtrArray *regions, const PfWireRegion *wr, const char *name,
                  int fd, GError **error)
{
    if (!pf_region_check_mapping(l->proc_dir, fd, name, wr->host_addr, wr->offset,
                                 wr->size, error)) {
        return FALSE;
    }
    for (guint i = 0; i < regions->len; i++) {
        const PfRegion *r = g_ptr_array_index(regions, i);

        if (!pf_region_live(r)) {
            continue;
        }
        if (wr->host_addr < r->host_addr + r->size && r->host_addr < wr->host_addr + wr->size) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "region %s overlaps region %u (%s)", name, i, r->name);
            return FALSE;
        }
    }
    if (wr->size > PF_MAX_VM_BYTES - l->announced_bytes) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "region %s: regions of more than %" G_GUINT64_FORMAT " GiB in all",
                    name, PF_MAX_VM_BYTES >> 30);
        return FALSE;
    }
    return TRUE;
}

/*
 * Checks a REGION and makes it a region, or a refused placeholder: one odd
 * region (a memfd the VMM could not seal, RAM the process does not map as
 * said) costs its VM that region only.  Its memfd is taken either way
 * (closed when refused).  running: announced after READY, when a merging
 * VM's new region must be write-protected as READY's were.  The region's
 * name is the peer's: escaped before anything says or keeps it.
 */
PfRegion *
handshake_region(PfLink *l, GPtrArray *regions, const PfWireRegion *wr, PfMsg *msg,
                 gboolean running)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *name = pf_escape_text(wr->name, -1);
    PfRegion *r = NULL;

    if (region_acceptable(l, regions, wr, name, msg->fds[0], &error)) {
        r = pf_region_new(name, msg->fds[0], wr->host_addr, wr->offset, wr->size, &error);
        msg->n_fds = 0; /* taken, or closed on error */
    }
    if (r != NULL && running && pf_vm_merges(l->vm)) {
        g_autoptr(GPtrArray) one = g_ptr_array_new();

        g_ptr_array_add(one, r);
        if (!pf_regions_check_write_protected(l->proc_dir, one, &error)) {
            g_clear_pointer(&r, pf_region_free);
        }
    }
    if (r == NULL) {
        link_peer_message(l->srv, l->peer_uid, "agent of process %d: region %u refused: %s",
                          l->peer_pid, wr->index, error->message);
        l->n_refused++;
        return pf_region_new_refused(name, wr->host_addr, wr->size, error->message);
    }
    l->announced_bytes += r->size;
    return r;
}

int
handshake_welcome(PfLink *l, PfWireMode *w)
{
    int fd = l->srv->uffd_dev;

    *w = (PfWireMode){ PF_PROTO_VERSION, PF_MODE_MERGE, "" };
    if (l->regions->len == 0) {
        w->mode = PF_MODE_ADVISE;
        pf_wire_set_string(w->reason, sizeof(w->reason), "no guest RAM to merge was announced");
        fd = -1;
    } else if (l->n_refused == l->regions->len) {
        g_autofree char *why = g_strdup_printf(
            "every region was refused; the first: %s",
            ((PfRegion *)g_ptr_array_index(l->regions, 0))->refused);

        w->mode = PF_MODE_ADVISE;
        pf_wire_set_string(w->reason, sizeof(w->reason), why);
        fd = -1;
    }
    l->offered_merge = w->mode == PF_MODE_MERGE;
    return fd;
}

static gboolean
peer_alive(PfLink *l)
{
    struct pollfd p = { l->pidfd, POLLIN, 0 };

    /* A pidfd turns readable when its process exits. */
    return poll(&p, 1, 0) == 0;
}

PfVm *
handshake_ready(PfLink *l, const PfMsg *msg, PfVm **old_out, GError **error)
{
    const PfWireMode *m = pf_msg_mode(msg);
    g_autoptr(GError) local = NULL;
    PfVm *old;

    if (m->mode == PF_MODE_MERGE && !l->offered_merge) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "READY in mode merge without a region to merge: WELCOME offered advise "
                    "mode");
        return NULL;
    }
    /* What an agent does before it says merge, checked: what it does
     * after is its own VM's business.  A region it did not write-protect
     * (it refused it: a NUMA binding, a file system without protection)
     * is refused here too, alone; refused regions are never merged, so
     * never checked. */
    for (guint i = 0; m->mode == PF_MODE_MERGE && i < l->regions->len; i++) {
        PfRegion *r = g_ptr_array_index(l->regions, i);
        g_autoptr(GPtrArray) one = g_ptr_array_new();

        g_ptr_array_add(one, r);
        if (pf_region_live(r) &&
            !pf_regions_check_write_protected(l->proc_dir, one, &local)) {
            link_peer_message(l->srv, l->peer_uid,
                              "agent of process %d: region %u refused at READY: %s",
                              l->peer_pid, i, local->message);
            l->announced_bytes -= r->size;
            pf_region_refuse(r, local->message);
            l->n_refused++;
            g_clear_error(&local);
        }
    }
    if (!peer_alive(l)) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "process %d exited during its handshake",
                    l->peer_pid);
        return NULL;
    }
    /* A VM is its process: its name is a label that others may share.
     * The agent knows this VM better than /proc did: it replaces a VM
     * attached by pid. */
    old = pf_scanner_find_vm_by_pid(l->srv->scanner, l->peer_pid);
    if (old != NULL && old->outbox != NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_EXISTS, "process %d already has an agent connected",
                    l->peer_pid);
        return NULL;
    }
    *old_out = old;
    return pf_vm_new_from_agent(l->peer_pid, l->pidfd, l->proc_dir, l->hello.name,
                                l->hello.uuid,
                                l->regions, m->mode == PF_MODE_MERGE ? PF_MODE_MERGE
                                                                     : PF_MODE_ADVISE,
                                m->reason[0] ? m->reason : "the agent chose advise mode",
                                error);
}
