/*
 * handshake.c - what an agent must show before pagefoldd believes it
 * (link.c runs the handshake; this file checks it): that its process is
 * the one pinned at accept and may be an agent, that every region it
 * announces is what that process maps, that it may merge only what it
 * write-protected, and what WELCOME offers it: /dev/userfaultfd only to
 * a process root vouched for (handshake_vouched()).  Never sends, never
 * frees a link, and never believes a field the peer's process does not
 * show.
 */
#include "link-records.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "escape.h"
#include "label.h"
#include "libvirt-status.h"
#include "peer-log.h"
#include "util.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif

/* How often a check that failed is made again, and how long apart. */
#define CHECK_TRIES 3
#define CHECK_RETRY_USEC 20000

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

/* ---- what the peer's process maps, read off the main loop ----
 *
 * A peer decides how large and slow its /proc files are to read: with
 * 30,000 mappings one read of smaps takes about half a second.  So the
 * reads run on a thread of GLib's pool, on descriptors of their own, while
 * the link reads nothing more from its peer; the link goes on from the
 * main loop when they are done.  A link that ends meanwhile cancels them:
 * the thread stops at its next line, and its result goes nowhere.
 */
struct _HandshakeCheck {
    PfLink *l;            /* main loop only; NULL once the link ended */
    GCancellable *cancel;
    int proc_dir, fd;     /* the thread's own copies */
    PfMsg *msg;           /* the message checked, its descriptors with it */
    char *name;           /* a REGION's name, the peer's: escaped before
                           * anything says or keeps it */
    gboolean protect;     /* a REGION that must be write-protected too */
    PfRegionSpan *spans;  /* the live regions whose protection is looked at */
    guint *index;         /* ... and their indexes among the link's */
    guint n_spans;
    char **why;           /* per span: why it is not protected */
    char *status_dir;     /* READY: libvirt's status files, where the */
    char *domain_name;    /* domain the peer named in HELLO is looked up, */
    pid_t peer_pid;       /* which this process must run */
    PfLibvirtDomain *libvirt; /* ... and what its status file says, or NULL */
    gboolean adopt;       /* a REGION of the handshake: its pages may be
                           * mapped from pool chunks (an agent whose
                           * pagefoldd went); not RAM plugged in later */
    PfPoolMapped *pooled; /* ... which they are */
    PfChunkHolder holder; /* ... for whom their descriptors are held */
    GError *error;        /* the REGION refused, or smaps unreadable */
    HandshakeDone done;
};

static void
check_free(HandshakeCheck *c)
{
    g_clear_object(&c->cancel);
    if (c->proc_dir >= 0) {
        close(c->proc_dir);
    }
    if (c->fd >= 0) {
        close(c->fd);
    }
    if (c->msg != NULL) {
        pf_msg_close_fds(c->msg);
        g_free(c->msg);
    }
    for (guint i = 0; i < c->n_spans; i++) {
        g_free(c->spans[i].name);
        g_free(c->why[i]);
    }
    g_free(c->name);
    g_free(c->spans);
    g_free(c->index);
    g_free(c->why);
    pf_pool_mapped_free(c->pooled);
    g_free(c->status_dir);
    g_free(c->domain_name);
    pf_libvirt_domain_free(c->libvirt);
    g_clear_error(&c->error);
    g_free(c);
}

void
pf_libvirt_domain_free(PfLibvirtDomain *d)
{
    if (d != NULL) {
        g_free(d->merge_domain);
        g_free(d->why_unlabelled);
        g_free(d);
    }
}

/* READY: the libvirt domain the peer named, if its status file says this
 * process runs it (c->libvirt). */
static void
check_libvirt(HandshakeCheck *c, GCancellable *cancel)
{
    g_auto(Domain) dom = { 0 };
    g_autoptr(GError) error = NULL;
    guint8 uuid[16];
    const char *why = NULL;

    /* The head first (its pid): a peer may name any domain, and only its
     * own is worth reading whole. */
    if (g_cancellable_is_cancelled(cancel) ||
        pf_libvirt_domain_pid(c->status_dir, c->domain_name, NULL) != c->peer_pid ||
        pf_libvirt_domain_status(c->status_dir, c->domain_name, &dom, &error) != c->peer_pid ||
        !pf_uuid_parse(dom.uuid, uuid)) {
        return;
    }
    c->libvirt = g_new0(PfLibvirtDomain, 1);
    memcpy(c->libvirt->uuid, uuid, sizeof(uuid));
    /* Where the hook would attach nothing, the VM shares with nobody. */
    if (dom.has_config && dom.merge_domain == NULL) {
        why = "its <pagefold:config> names no merge-domain";
    } else if (dom.nosharepages) {
        why = "its XML says <nosharepages/>";
    } else if (!domain_is_ours(&dom)) {
        why = "its XML gives it no shared memfd RAM";
    } else if (dom.merge_domain != NULL &&
               !pf_label_is_valid("a merge domain", dom.merge_domain, &error)) {
        why = error->message;
    }
    if (why != NULL) {
        c->libvirt->why_unlabelled = g_strdup(why);
    } else {
        c->libvirt->merge_domain = g_strdup(dom.merge_domain ? dom.merge_domain : "default");
    }
}

/* The peer's mappings as REGION or READY says they are. */
static void
check_mappings(HandshakeCheck *c, GCancellable *cancel)
{
    if (c->msg->header.type == PF_MSG_REGION) {
        const PfWireRegion *wr = pf_msg_region(c->msg);

        if (!pf_region_check_mapping(c->proc_dir, c->fd, c->name, wr->host_addr, wr->offset,
                                     wr->size, &c->holder, c->adopt ? &c->pooled : NULL,
                                     cancel, &c->error) ||
            !c->protect) {
            return;
        }
    }
    if (c->n_spans > 0 &&
        !pf_region_spans_protected(c->proc_dir, c->spans, c->n_spans, c->why, cancel,
                                   &c->error)) {
        return;
    }
    if (c->n_spans == 1 && c->why[0] != NULL && c->msg->header.type == PF_MSG_REGION) {
        g_set_error_literal(&c->error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, c->why[0]);
    }
}

/*
 * Did check_mappings() find what a mapping changing under its read may
 * show (a map_files entry gone: PF_ERROR_FAILED; a span unprotected)?
 * A refusal of what the peer says (PF_ERROR_INVALID_ARGUMENT) stays one.
 */
static gboolean
check_may_pass_again(const HandshakeCheck *c)
{
    gboolean failed = g_error_matches(c->error, PF_ERROR, PF_ERROR_FAILED);

    for (guint i = 0; i < c->n_spans; i++) {
        failed |= c->why[i] != NULL;
    }
    return failed;
}

/* Forgets what check_mappings() found, to look again. */
static void
check_forget(HandshakeCheck *c)
{
    for (guint i = 0; i < c->n_spans; i++) {
        g_clear_pointer(&c->why[i], g_free);
    }
    g_clear_error(&c->error);
    g_clear_pointer(&c->pooled, pf_pool_mapped_free);
}

/*
 * What it found is in c (c->error, c->why): the task itself only says
 * that it is done.  The agent's fault thread folds merged pages back for a
 * vhost-user back-end at any time but between HELLO and READY: READY's
 * check, or a region plugged in later, may read a remapped run between its
 * mmap() and its registration, or find a mapping in maps gone by the time
 * map_files is looked at.  So such a failure is looked at again, twice:
 * an honest agent's mappings settle within milliseconds, a peer whose
 * never do is refused as before.
 */
static void
check_run(HandshakeCheck *c, GCancellable *cancel)
{
    if (c->msg->header.type == PF_MSG_READY && c->domain_name != NULL) {
        check_libvirt(c, cancel);
    }
    for (int attempt = 1;; attempt++) {
        check_mappings(c, cancel);
        if (!check_may_pass_again(c) || attempt == CHECK_TRIES ||
            g_cancellable_is_cancelled(cancel)) {
            break;
        }
        check_forget(c);
        g_usleep(CHECK_RETRY_USEC);
    }
}

static void
check_thread(GTask *task, gpointer source, gpointer data, GCancellable *cancel)
{
    check_run(data, cancel);
    g_task_return_boolean(task, TRUE);
}

static void check_done(GObject *source, GAsyncResult *res, gpointer user);

/* Takes msg: the link reads no more until done(l, msg) was called, from
 * the main loop, or the link ended. */
static void
check_start(PfLink *l, PfMsg *msg, gboolean protect, HandshakeDone done)
{
    HandshakeCheck *c = g_new0(HandshakeCheck, 1);
    g_autoptr(GTask) task = NULL;
    GPtrArray *regions = l->vm != NULL ? l->vm->regions : l->regions;

    c->l = l;
    c->cancel = g_cancellable_new();
    c->proc_dir = fcntl(l->proc_dir, F_DUPFD_CLOEXEC, 3);
    c->fd = msg->n_fds > 0 ? fcntl(msg->fds[0], F_DUPFD_CLOEXEC, 3) : -1;
    c->msg = msg;
    c->protect = protect;
    c->adopt = l->vm == NULL;
    c->holder = (PfChunkHolder){ l->peer_pid, l->peer_uid, l->vouched };
    c->done = done;
    c->spans = g_new0(PfRegionSpan, MAX(regions->len, 1));
    c->index = g_new0(guint, MAX(regions->len, 1));
    c->why = g_new0(char *, MAX(regions->len, 1));
    if (msg->header.type == PF_MSG_REGION) {
        const PfWireRegion *wr = pf_msg_region(msg);

        c->name = pf_escape_text(wr->name, -1);
        if (protect) {
            c->spans[0] = (PfRegionSpan){ g_strdup(c->name), wr->host_addr, wr->size };
            c->n_spans = 1;
        }
    }
    if (msg->header.type == PF_MSG_READY && pf_libvirt_name_is_file_name(l->hello.name)) {
        c->status_dir = g_strdup(l->srv->libvirt_run_dir);
        c->domain_name = g_strdup(l->hello.name);
        c->peer_pid = l->peer_pid;
    }
    for (guint i = 0; msg->header.type == PF_MSG_READY && protect && i < regions->len; i++) {
        const PfRegion *r = g_ptr_array_index(regions, i);

        if (pf_region_live(r)) {
            c->index[c->n_spans] = i;
            c->spans[c->n_spans++] = (PfRegionSpan){ g_strdup(r->name), r->host_addr,
                                                    r->size };
        }
    }
    l->check = c;
    if (c->proc_dir < 0 || (msg->n_fds > 0 && c->fd < 0)) {
        int e = errno;

        /* Out of descriptors: the check fails, the link goes on. */
        g_set_error(&c->error, PF_ERROR, PF_ERROR_FAILED, "cannot check the region: %s",
                    g_strerror(e));
        task = g_task_new(NULL, NULL, check_done, c);
        g_task_return_boolean(task, TRUE);
        return;
    }
    task = g_task_new(NULL, c->cancel, check_done, c);
    g_task_set_task_data(task, c, NULL);
    g_task_set_return_on_cancel(task, FALSE);
    g_task_run_in_thread(task, check_thread);
}

void
handshake_cancel_check(PfLink *l)
{
    if (l->check != NULL) {
        g_cancellable_cancel(l->check->cancel);
        l->check->l = NULL;
        l->check = NULL;
    }
}

/* Guest RAM the live links root vouched for none of announce, in all
 * (handshakes and running VMs): those of uid alone, and of every uid. */
static void
unvouched_bytes(PfLinkServer *srv, uid_t uid, guint64 *of_uid, guint64 *of_all)
{
    GHashTableIter it;
    gpointer value;

    *of_uid = *of_all = 0;
    for (guint i = 0; i < srv->handshakes->len; i++) {
        PfLink *l = g_ptr_array_index(srv->handshakes, i);

        *of_uid += l->peer_uid == uid && !l->vouched ? l->announced_bytes : 0;
        *of_all += !l->vouched ? l->announced_bytes : 0;
    }
    g_hash_table_iter_init(&it, srv->running);
    while (g_hash_table_iter_next(&it, NULL, &value)) {
        PfLink *l = value;

        *of_uid += l->peer_uid == uid && !l->vouched ? l->announced_bytes : 0;
        *of_all += !l->vouched ? l->announced_bytes : 0;
    }
}

/* A REGION whose mapping passed: it must overlap no live region of the VM
 * (regions: those announced before) and keep the VM within its cap, and
 * the VMs of its uid within theirs where root vouched for none of them:
 * page ids are 32-bit and given for all RAM announced, sparse or not, so
 * without it a few processes of any uid in the agent group could take
 * every id and leave later VMs unmerged. */
static gboolean
region_fits(PfLink *l, GPtrArray *regions, const PfWireRegion *wr, const char *name,
            GError **error)
{
    guint64 of_uid, of_all;

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
    if (l->vouched) {
        return TRUE;
    }
    unvouched_bytes(l->srv, l->peer_uid, &of_uid, &of_all);
    if (wr->size > PF_MAX_UNVOUCHED_UID_BYTES - MIN(of_uid, PF_MAX_UNVOUCHED_UID_BYTES)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "region %s: the VMs of uid %u, none of them vouched for by root, would "
                    "announce more than %" G_GUINT64_FORMAT " GiB in all (page ids are kept "
                    "for the others)",
                    name, (guint)l->peer_uid, PF_MAX_UNVOUCHED_UID_BYTES >> 30);
        return FALSE;
    }
    if (wr->size > PF_MAX_UNVOUCHED_BYTES - MIN(of_all, PF_MAX_UNVOUCHED_BYTES)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "region %s: VMs root vouched for none of would announce more than %"
                    G_GUINT64_FORMAT " GiB in all (page ids are kept for the others)",
                    name, PF_MAX_UNVOUCHED_BYTES >> 30);
        return FALSE;
    }
    return TRUE;
}

/*
 * A REGION checked: a region, or a refused placeholder: one odd region (a
 * memfd the VMM could not seal, RAM the process does not map as said)
 * costs its VM that region only.  Its memfd is taken either way (closed
 * when refused).
 */
static PfRegion *
region_checked(PfLink *l, HandshakeCheck *c)
{
    const PfWireRegion *wr = pf_msg_region(c->msg);
    GPtrArray *regions = l->vm != NULL ? l->vm->regions : l->regions;
    GError *error = g_steal_pointer(&c->error);
    PfRegion *r = NULL;

    if (error == NULL && region_fits(l, regions, wr, c->name, &error)) {
        r = pf_region_new(c->name, c->msg->fds[0], wr->host_addr, wr->offset, wr->size,
                          &error);
        c->msg->n_fds = 0; /* taken, or closed on error */
        if (r != NULL) {
            r->pooled = g_steal_pointer(&c->pooled);
        }
    }
    if (r == NULL) {
        pf_peer_log(l->srv->peer_log, l->peer_uid, "agent of process %d: region %u refused: %s",
                          l->peer_pid, wr->index, error->message);
        l->n_refused++;
        r = pf_region_new_refused(c->name, wr->host_addr, wr->size, error->message);
        g_error_free(error);
        return r;
    }
    l->announced_bytes += r->size;
    return r;
}

/* What READY's look at smaps found: a region not registered for write
 * protection (the agent refused it: a NUMA binding, a file system without
 * protection) is refused here, alone; refused regions are never merged,
 * so never checked. */
static void
ready_checked(PfLink *l, HandshakeCheck *c)
{
    l->libvirt = g_steal_pointer(&c->libvirt);
    for (guint k = 0; k < c->n_spans; k++) {
        PfRegion *r = g_ptr_array_index(l->regions, c->index[k]);
        const char *why = c->error != NULL ? c->error->message : c->why[k];

        if (why == NULL || !pf_region_live(r)) {
            continue;
        }
        pf_peer_log(l->srv->peer_log, l->peer_uid,
                          "agent of process %d: region %u refused at READY: %s", l->peer_pid,
                          c->index[k], why);
        l->announced_bytes -= r->size;
        pf_region_refuse(r, why);
        l->n_refused++;
    }
}

static void
check_done(GObject *source, GAsyncResult *res, gpointer user)
{
    HandshakeCheck *c = user;
    PfLink *l = c->l;

    if (l != NULL) {
        l->check = NULL;
        if (c->msg->header.type == PF_MSG_REGION) {
            PfRegion *r = region_checked(l, c);

            c->done(l, c->msg, r);
        } else {
            ready_checked(l, c);
            c->done(l, c->msg, NULL);
        }
    }
    check_free(c);
}

void
handshake_region(PfLink *l, PfMsg *msg, gboolean running, HandshakeDone done)
{
    check_start(l, msg, running && pf_vm_merges(l->vm), done);
}

void
handshake_check_ready(PfLink *l, PfMsg *msg, HandshakeDone done)
{
    check_start(l, msg, pf_msg_mode(msg)->mode == PF_MODE_MERGE, done);
}

/*
 * Whether root vouched for the peer as a VMM, so that it may have
 * /dev/userfaultfd: its process is root's or pagefoldd's own user's, or
 * it is the QEMU that libvirt's status file for the domain it names in
 * HELLO says runs that domain (libvirt-status.h: root's file, written by
 * libvirtd before it lets the QEMU it forked exec, so before the agent
 * connects).  Nothing a peer owns or maps vouches for it: any process of
 * the agent socket's group can make a sealed memfd and map it, and with
 * /dev/userfaultfd it could trap faults the kernel takes for it, which
 * vm.unprivileged_userfaultfd=0 exists to deny.  FALSE with *why saying
 * what was looked at.  The peer is pinned and alive, so a pid the status
 * file names is this process now (a status file left over by a libvirtd
 * that died, naming a pid since reused, is the one way to be wrong).
 */
static gboolean
handshake_vouched(PfLink *l, char **why)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *name = NULL;
    g_autofree char *reason = NULL;
    int pid;

    if (l->peer_uid == 0 || l->peer_uid == geteuid()) {
        return TRUE;
    }
    pid = pf_libvirt_domain_pid(l->srv->libvirt_run_dir, l->hello.name, &error);
    if (pid == l->peer_pid) {
        return TRUE;
    }
    /* Both hold the name the peer chose. */
    name = pf_escape_text(l->hello.name, -1);
    reason = pf_escape_text(error ? error->message : "it names another process", -1);
    *why = g_strdup_printf("uid %u is not root's, and libvirt's status file of domain '%s' "
                           "does not name process %d as its QEMU: %s",
                           (guint)l->peer_uid, name, l->peer_pid, reason);
    return FALSE;
}

/*
 * Before a handshake place is won: whether root vouches for the
 * connecting process by what costs no message of the peer's and no read
 * of its memory: its uid is root's or pagefoldd's, or one of libvirt's
 * status files names its pid as a domain's QEMU.  It decides only which
 * places it may take (link-server.c); HELLO decides again what it may have.
 */
gboolean
handshake_vouched_at_accept(PfLinkServer *srv, const struct ucred *cred)
{
    return cred->uid == 0 || cred->uid == geteuid() ||
           pf_libvirt_pids_has(srv->libvirt_pids, srv->libvirt_run_dir, cred->pid);
}

void
handshake_vouch(PfLink *l)
{
    l->vouched = handshake_vouched(l, &l->vouch_why);
}

int
handshake_welcome(PfLink *l, PfWireMode *w)
{
    int fd = l->srv->uffd_dev;

    /* The link's version: an older agent's. */
    *w = (PfWireMode){ MIN(l->hello.version, PF_PROTO_VERSION), PF_MODE_MERGE, "" };
    if (l->regions->len == 0) {
        w->mode = PF_MODE_ADVISE;
        pf_wire_set_string(w->reason, sizeof(w->reason), "no guest RAM to merge was announced");
        fd = -1;
    } else if (l->n_refused == l->regions->len) {
        g_autofree char *first = g_strdup_printf(
            "every region was refused; the first: %s",
            ((PfRegion *)g_ptr_array_index(l->regions, 0))->refused);

        w->mode = PF_MODE_ADVISE;
        pf_wire_set_string(w->reason, sizeof(w->reason), first);
        fd = -1;
    } else if (fd >= 0 && !l->vouched) {
        /* Merge is still offered: a VMM the kernel lets make a userfaultfd
         * of its own (vm.unprivileged_userfaultfd=1) needs nothing of
         * pagefoldd's.  One that cannot stays in advise mode, and READY's
         * reason is prefixed with this (handshake_ready()). */
        l->no_uffd_why = g_strdup_printf("not vouched for by root: no /dev/userfaultfd (%s)",
                                         l->vouch_why);
        pf_peer_log(l->srv->peer_log, l->peer_uid, "agent of process %d: %s", l->peer_pid,
                          l->no_uffd_why);
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
    g_autofree char *with_uffd = NULL;
    const char *reason;
    PfVm *old;

    if (m->mode == PF_MODE_MERGE && !l->offered_merge) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "READY in mode merge without a region to merge: WELCOME offered advise "
                    "mode");
        return NULL;
    }
    /* What an agent does before it says merge was checked
     * (handshake_check_ready()): what it does after is its own VM's
     * business. */
    if (!peer_alive(l)) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "process %d exited during its handshake",
                    l->peer_pid);
        return NULL;
    }
    /* A VM is its process: its name is a label that others may share.
     * The agent knows this VM better than /proc did: it replaces a VM
     * attached by pid. */
    old = pf_scanner_find_vm_by_pid(l->srv->scanner, l->peer_pid);
    if (old != NULL && old->kind == PF_VM_AGENT) {
        g_set_error(error, PF_ERROR, PF_ERROR_EXISTS, "process %d already has an agent connected",
                    l->peer_pid);
        return NULL;
    }
    *old_out = old;
    reason = m->reason[0] ? m->reason : "the agent chose advise mode";
    if (m->mode != PF_MODE_MERGE && l->no_uffd_why != NULL) {
        /* pagefoldd's part in it first: the agent may only say that it
         * could not make a userfaultfd. */
        reason = with_uffd = g_strdup_printf("%s; its agent: %s", l->no_uffd_why, reason);
    }
    /* libvirt's UUID where its status file names this process, not what
     * the peer claimed; the regions are the VM's from here on. */
    return pf_vm_new_from_agent(l->peer_pid, l->pidfd, l->proc_dir, l->hello.name,
                                l->libvirt != NULL ? l->libvirt->uuid : l->hello.uuid,
                                g_steal_pointer(&l->regions),
                                m->mode == PF_MODE_MERGE ? PF_MODE_MERGE : PF_MODE_ADVISE,
                                reason, error);
}
