/*
 * link.c - pagefoldd's end of the agent protocol (link.h): the agent
 * socket and its handshake places, each link's life, its messages in
 * protocol order, its timers, and the scanner's listener that ends links
 * and sends chunks.  The checks a peer must pass are handshake.c's, the
 * sending channel.c's, the log limit peer-log.c's.  Owns every PfLink and
 * every descriptor a peer passed; must never decide a merge, believe what
 * a peer has not shown, or wait for one on the main loop.
 *
 * A connection goes HELLO -> REGION x n -> WELCOME -> READY, then carries
 * REQUESTs and RESULTs, and REGION (RAM plugged in) and GONE (RAM that
 * left) whenever the VM's RAM changes.  An agent names regions by index,
 * in the order announced, never reused: a region refused, or gone, keeps
 * its index as a placeholder (vm.h).  The peer is trusted with nothing it
 * has not shown:
 *  - its process is pinned at accept: a pidfd (SO_PEERPIDFD where the
 *    kernel has it, else pidfd_open() of SO_PEERCRED's pid) and its
 *    /proc/PID, opened while that pidfd showed it alive, through which
 *    every later look at its mappings goes (invariant 8, docs/DESIGN.md);
 *  - the pid HELLO announces must be that process's, and each REGION must
 *    be what that process really maps (vm.c), within a cap, before
 *    anything is allocated for it; one that is not is refused alone (a
 *    placeholder), the link and the VM's other regions stay;
 *  - a REGION after READY passes the same checks, and in a merging VM
 *    must already be write-protected, as READY's regions were;
 *  - WELCOME comes only after the last REGION was checked, and carries
 *    /dev/userfaultfd only to a peer with a region to merge that root
 *    vouched for (root's or pagefoldd's own process, or the QEMU libvirt's
 *    status file names: handshake.c): with /dev/userfaultfd an
 *    unprivileged process can trap faults the kernel takes for it, which
 *    vm.unprivileged_userfaultfd=0 exists to forbid, and a memfd it maps
 *    proves nothing;
 *  - READY may say merge only where WELCOME offered it, and only if the
 *    regions are registered for userfaultfd write protection;
 *  - a result must answer a request in flight, item for item.
 * Never waits for a peer on the main loop: a handshake has
 * HANDSHAKE_TIMEOUT_MS and one of a bounded number of places, a send that
 * the socket cannot take waits in the link's queue, a peer that takes
 * nothing for SEND_STALL_MS is given up, and one that answers none of its
 * requests for the answer timeout too.  Flow control is the outbox's
 * window (outbox.h): neither end ever blocks on the other however many
 * requests the scanner decides at once.  A refused peer leaves nothing
 * behind: its link owns every descriptor it passed or was given.
 */
#include "link.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <gio/gio.h>
#include <glib-unix.h>
#include <glib/gstdio.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "channel.h"
#include "libvirt-status.h"
#include "link-records.h"
#include "peer-log.h"
#include "escape.h"
#include "util.h"

/* A handshake is a few messages the agent sends at once: an agent that
 * has not finished in this long is not going to. */
#define HANDSHAKE_TIMEOUT_MS 5000
/* Handshakes in progress: of peers root vouched for at connect, of the
 * others, and per process.  Per process, not per uid: under libvirt every
 * QEMU runs as the same user, and one of them must not be able to take
 * the others' places; nor can a flood of processes root vouched for none
 * of take a place of one it did (the QEMUs libvirt started). */
#define MAX_HANDSHAKES 64
#define MAX_VOUCHED_HANDSHAKES 64
#define MAX_HANDSHAKES_PER_PROCESS 4
/* What the kernel may hold for a peer; the rest waits in the link. */
#define SOCKET_SNDBUF (256 << 10)
/* An agent with requests to answer that answered nothing for this long is
 * not going to: pf_link_server_set_answer_timeout(). */
#define DEFAULT_ANSWER_TIMEOUT_MS 30000
/*
 * Drops what the peer sent that will never be read: closing a socket with
 * unread data resets the connection, and the peer's next read returns
 * ECONNRESET instead of the ERROR queued for it (an agent sends all its
 * REGIONs at once; the first may be refused).  Bounded: a peer that keeps
 * sending gets the reset.
 */
static void
drain_socket(int sock)
{
    g_autofree PfMsg *msg = g_new(PfMsg, 1);

    for (int i = 0; i < 1024; i++) {
        g_autoptr(GError) error = NULL;

        if (pf_proto_recv(sock, msg, &error)) {
            pf_msg_close_fds(msg);
        } else if (!g_error_matches(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT)) {
            return; /* empty, closed, or failing: nothing more to drop */
        }
    }
}

/* Best effort, never waiting: the link is closed right after.  Once: the
 * first says why.  seq: whether its agent may connect again
 * (PF_ERROR_TRY_AGAIN: pagefoldd had no room or no time for it) or not
 * (PF_ERROR_FOR_GOOD: it broke the protocol, may not be an agent, or its
 * VM was let go). */
static void
link_send_error_seq(PfLink *l, guint32 seq, const char *text)
{
    if (!l->error_sent) {
        l->error_sent = TRUE;
        pf_proto_send(l->sock, PF_MSG_ERROR, seq, text, MIN(strlen(text), 1024), NULL, 0,
                      NULL);
    }
}

static void
link_send_error(PfLink *l, const char *text)
{
    link_send_error_seq(l, PF_ERROR_FOR_GOOD, text);
}

static void
link_free(PfLink *l)
{
    g_free(l->broken_why);
    g_free(l->no_uffd_why);
    g_free(l->vouch_why);
    pf_libvirt_domain_free(l->libvirt);
    g_free(l);
}

static gboolean
reap_cb(gpointer user)
{
    PfLinkServer *srv = user;

    srv->reap = 0;
    g_ptr_array_set_size(srv->ended, 0);
    return G_SOURCE_REMOVE;
}

/*
 * The link is over: every source, descriptor and queued message goes now,
 * the socket last (when the peer sees the hang-up, all it passed is
 * closed); the record itself goes from the main loop, since this may run
 * inside one of the link's own callbacks.
 */
static void
link_end(PfLink *l)
{
    PfLinkServer *srv = l->srv;

    l->ended = TRUE;
    handshake_cancel_check(l);
    g_clear_handle_id(&l->watch, g_source_remove);
    g_clear_handle_id(&l->answer_timer, g_source_remove);
    g_clear_handle_id(&l->handshake_timer, g_source_remove);
    g_clear_handle_id(&l->close_idle, g_source_remove);
    g_clear_pointer(&l->ch, pf_channel_free);
    if (l->vm != NULL) {
        pf_outbox_set_drain(l->vm->outbox, NULL, NULL);
        g_hash_table_remove(srv->running, l->vm);
        l->vm = NULL;
    } else {
        g_ptr_array_remove(srv->handshakes, l);
    }
    g_clear_pointer(&l->regions, g_ptr_array_unref);
    if (l->pidfd >= 0) {
        close(l->pidfd);
    }
    if (l->proc_dir >= 0) {
        close(l->proc_dir);
    }
    drain_socket(l->sock);
    close(l->sock);
    g_ptr_array_add(srv->ended, l);
    if (srv->reap == 0) {
        srv->reap = g_idle_add(reap_cb, srv);
    }
}

/* Ends a link: its VM (if any) is detached, and the link with it (the
 * scanner's vm_gone). */
static void
link_close(PfLink *l, const char *why)
{
    if (l->vm != NULL) {
        pf_scanner_detach(l->srv->scanner, l->vm, why);
        return;
    }
    pf_peer_log(l->srv->peer_log, l->peer_uid,
                      "agent connection of process %d closed during its handshake: %s",
                      l->peer_pid, why);
    link_end(l);
}

static gboolean
link_refuse_seq(PfLink *l, guint32 seq, const char *fmt, va_list ap) G_GNUC_PRINTF(3, 0);

static gboolean
link_refuse_seq(PfLink *l, guint32 seq, const char *fmt, va_list ap)
{
    g_autofree char *text = g_strdup_vprintf(fmt, ap);

    link_send_error_seq(l, seq, text);
    link_close(l, text);
    return FALSE;
}

/* Refused for good: what it sent is not what an agent sends. */
static gboolean
link_refuse(PfLink *l, const char *fmt, ...) G_GNUC_PRINTF(2, 3);

static gboolean
link_refuse(PfLink *l, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    link_refuse_seq(l, PF_ERROR_FOR_GOOD, fmt, ap);
    va_end(ap);
    return FALSE;
}

/* Refused for now, for want of room or time: its agent connects again. */
static gboolean
link_refuse_for_now(PfLink *l, const char *fmt, ...) G_GNUC_PRINTF(2, 3);

static gboolean
link_refuse_for_now(PfLink *l, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    link_refuse_seq(l, PF_ERROR_TRY_AGAIN, fmt, ap);
    va_end(ap);
    return FALSE;
}

static gboolean
close_idle_cb(gpointer user)
{
    PfLink *l = user;
    g_autofree char *why = g_steal_pointer(&l->broken_why);

    l->close_idle = 0;
    link_close(l, why);
    return G_SOURCE_REMOVE;
}

/* Nothing more can be sent.  The link is closed from the main loop, not
 * here: the scanner may be in the middle of this VM's pages. */
static void
link_broken_cb(const char *why, gpointer user)
{
    PfLink *l = user;
    g_autofree char *name = pf_escape_text(l->vm ? l->vm->name : l->hello.name, -1);

    g_message("agent of %s (process %d): %s", name, l->peer_pid, why);
    l->broken_why = g_strdup_printf("cannot send to its agent: %s", why);
    l->close_idle = g_idle_add_full(G_PRIORITY_DEFAULT, close_idle_cb, l, NULL);
}

static void
link_send(PfLink *l, PfMsgType type, guint32 seq, gconstpointer data, gsize len, int fd)
{
    pf_channel_send(l->ch, type, seq, data, len, fd);
}

static gboolean answer_timeout_cb(gpointer user);

/* The scanner's requests, as the outbox's window lets them go. */
static void
link_drain_cb(PfOutbox *ob, gpointer user)
{
    PfLink *l = user;
    const PfOutBatch *b;

    while (!pf_channel_broken(l->ch) && (b = pf_outbox_take(ob)) != NULL) {
        link_send(l, PF_MSG_REQUEST, b->seq, b->items->data,
                  b->items->len * sizeof(PfWireItem), -1);
        if (l->answer_timer == 0) {
            l->answer_timer = g_timeout_add(l->srv->answer_timeout_ms, answer_timeout_cb, l);
        }
    }
}

/* ---- messages ---- */

static gboolean
on_result(PfLink *l, const PfMsg *msg)
{
    guint32 n;
    const PfWireResult *res = pf_msg_results(msg, &n);
    PfOutbox *ob = l->vm->outbox;

    if (!pf_outbox_answers(ob, msg->header.seq, n)) {
        return link_refuse(l, "RESULT %u with %u entries answers no request in flight",
                           msg->header.seq, n);
    }
    g_clear_handle_id(&l->answer_timer, g_source_remove);
    /* The answers may call for more, sent as the window opens again. */
    pf_scanner_answer(l->srv->scanner, l->vm, res, n);
    if (pf_outbox_n_sent(ob) > 0 && l->answer_timer == 0) {
        l->answer_timer = g_timeout_add(l->srv->answer_timeout_ms, answer_timeout_cb, l);
    }
    return TRUE;
}

/* Whether the VM came with pages merged under an earlier pagefoldd. */
static gboolean
merged_before(const PfVm *vm)
{
    for (guint i = 0; i < vm->regions->len; i++) {
        if (((const PfRegion *)g_ptr_array_index(vm->regions, i))->pooled != NULL) {
            return TRUE;
        }
    }
    return FALSE;
}

/*
 * A new VM's merge domain.  One this very process had before its agent
 * connected again (under the pagefoldd before, or this one: kept beside
 * the socket, attached.h) is root's latest word.  Otherwise, libvirt's
 * status file of the domain, where it names this process as its QEMU, is
 * root's word on which domain it is and what its XML says: its merge
 * domain then, however long libvirt's hook takes to say the same (or if
 * it never runs, as after a restart of pagefoldd).  A VM that merged
 * under an earlier pagefoldd whose domain that pagefoldd's file does not
 * say (lost, unreadable) is kept apart: default could join tenants root
 * had kept apart.  Otherwise any process of the socket's group may have
 * connected: a VM no root process vouched for shares with nobody until
 * one does.
 */
static void
on_ready_domain(PfLink *l, PfVm *vm)
{
    PfScanner *s = l->srv->scanner;
    g_autoptr(GError) error = NULL;
    gboolean unknown = FALSE;
    const char *kept =
        l->srv->kept != NULL ? pf_attached_agent_domain(l->srv->kept, vm, &unknown) : NULL;

    if (kept != NULL && !g_str_equal(kept, "unlabelled")) {
        if (pf_scanner_set_merge_domain(s, vm, kept, &error)) {
            g_message("VM %s (pid %d): merge domain '%s', as it was before its agent "
                      "connected again", vm->name, vm->pid, kept);
            return;
        }
        g_warning("VM %s (pid %d): %s", vm->name, vm->pid, error->message);
    } else if (kept != NULL) {
        /* It shared with no other VM before, nor does it now. */
    } else if (l->libvirt != NULL && l->libvirt->merge_domain != NULL) {
        if (pf_scanner_set_merge_domain(s, vm, l->libvirt->merge_domain, &error)) {
            return;
        }
        g_warning("VM %s (pid %d): %s", vm->name, vm->pid, error->message);
    } else if (unknown && merged_before(vm)) {
        pf_peer_log(l->srv->peer_log, l->peer_uid,
                    "VM %s (pid %d): its merge domain before pagefoldd started is not known; "
                    "it shares with no other VM until root says it", vm->name, vm->pid);
    } else if (l->libvirt != NULL) {
        g_message("VM %s (pid %d): libvirt's domain: %s; it shares with no other VM", vm->name,
                  vm->pid, l->libvirt->why_unlabelled);
    } else if (l->peer_uid == 0 || l->peer_uid == geteuid()) {
        return;
    }
    pf_scanner_set_unlabelled(s, vm);
}


/* READY: the VM is made (handshake_ready()) and given to the scanner; the
 * link sends its requests from now on. */
static gboolean
on_ready(PfLink *l, const PfMsg *msg)
{
    PfScanner *s = l->srv->scanner;
    g_autoptr(GError) error = NULL;
    PfVm *old = NULL, *vm = handshake_ready(l, msg, &old, &error);
    guint idx;

    if (vm == NULL) {
        return link_refuse(l, "%s", error->message);
    }
    l->vm = vm;
    g_hash_table_insert(l->srv->running, vm, l);
    pf_outbox_set_drain(vm->outbox, link_drain_cb, l);
    l->state = LINK_RUNNING;
    g_clear_handle_id(&l->handshake_timer, g_source_remove);
    if (g_ptr_array_find(l->srv->handshakes, l, &idx)) {
        g_ptr_array_remove_index(l->srv->handshakes, idx);
    }
    {
        g_autofree char *line = g_strdup_printf(
            "VM %s (pid %d) attached by its agent in mode %s%s%s: %u region(s) (%u refused), "
            "%zu pages", vm->name, vm->pid, pf_vm_mode_name(vm),
            vm->mode_reason ? " because " : "", vm->mode_reason ? vm->mode_reason : "",
            vm->regions->len, l->n_refused, pf_vm_n_pages(vm));

        /* A process root did not vouch for may attach in a loop: its
         * lines count against its uid's. */
        if (l->vouched) {
            g_message("%s", line);
        } else {
            pf_peer_log(l->srv->peer_log, l->peer_uid, "%s", line);
        }
    }
    if (old != NULL) {
        /* Whom it may share with was said of the process (libvirt's hook). */
        pf_scanner_replace_vm(s, old, vm);
    } else {
        pf_scanner_add_vm(s, vm);
        on_ready_domain(l, vm);
    }
    /* Kept before it can merge anything: a pagefoldd that dies right
     * after must find it. */
    if (l->srv->kept != NULL) {
        pf_attached_keep_domain(l->srv->kept, vm);
    }
    /* In its merge domain first: pages it shared across it stop. */
    pf_scanner_adopt(s, vm);
    return TRUE;
}

static gboolean link_in_cb(gint fd, GIOCondition cond, gpointer user);

/* A check is over: the link reads its peer again, unless it ended. */
static void
link_resume(PfLink *l)
{
    if (!l->ended && l->check == NULL && l->watch == 0) {
        l->watch = g_unix_fd_add(l->sock, G_IO_IN | G_IO_HUP | G_IO_ERR, link_in_cb, l);
    }
}

static void
ready_checked(PfLink *l, PfMsg *msg, PfRegion *unused)
{
    on_ready(l, msg);
    link_resume(l);
}

/* Every region is in and checked: WELCOME (handshake_welcome()). */
static gboolean
link_welcome(PfLink *l)
{
    PfWireMode w;
    int fd = handshake_welcome(l, &w);

    link_send(l, PF_MSG_WELCOME, 0, &w, sizeof(w), fd);
    if (pf_channel_broken(l->ch)) {
        g_autofree char *why = g_steal_pointer(&l->broken_why);

        link_close(l, why);
        return FALSE;
    }
    l->state = LINK_READY;
    return TRUE;
}

/* A REGION of the handshake checked: WELCOME after the last. */
static void
handshake_region_checked(PfLink *l, PfMsg *msg, PfRegion *r)
{
    g_ptr_array_add(l->regions, r);
    if (l->regions->len < l->hello.n_regions || link_welcome(l)) {
        link_resume(l);
    }
}

/* RAM plugged into a running VM, checked. */
static void
running_region_checked(PfLink *l, PfMsg *msg, PfRegion *r)
{
    const PfWireRegion *wr = pf_msg_region(msg);
    PfVm *vm = l->vm;

    if (!pf_region_live(r)) {
        pf_scanner_add_region(l->srv->scanner, vm, r);
    } else if (pf_scanner_add_region(l->srv->scanner, vm, r)) {
        g_message("VM %s (pid %d): region %u (%s, %zu pages) joined", vm->name, vm->pid,
                  wr->index, r->name, r->n_pages);
    } else {
        l->announced_bytes -= wr->size;
        l->n_refused++;
    }
    link_resume(l);
}

/* RAM plugged into a running VM: announced as at the handshake, with the
 * next index. */
static gboolean
on_region(PfLink *l, PfMsg *msg)
{
    const PfWireRegion *wr = pf_msg_region(msg);
    PfVm *vm = l->vm;

    if (wr->index != vm->regions->len) {
        return link_refuse(l, "REGION %u arrived as region %u", wr->index, vm->regions->len);
    }
    if (wr->index >= PF_MAX_VM_REGIONS) {
        return link_refuse(l, "REGION %u: a VM may announce %u regions in its life", wr->index,
                           PF_MAX_VM_REGIONS);
    }
    handshake_region(l, msg, TRUE, running_region_checked);
    return TRUE;
}

/* The region a DISCARD or GONE names, or NULL: a peer may name any. */
static const PfRegion *
range_region(PfLink *l, const PfWireRange *wr)
{
    return wr->region < l->vm->regions->len ? g_ptr_array_index(l->vm->regions, wr->region)
                                            : NULL;
}

/* RAM unplugged (or set merge=off): the agent mapped all of it from its
 * memfd again, so nothing of it maps the pool. */
static gboolean
on_gone(PfLink *l, const PfMsg *msg)
{
    const PfWireRange *wr = pf_msg_range(msg);
    const PfRegion *r = range_region(l, wr);

    /* The agent is not told which regions were refused: GONE of one is
     * its honest goodbye, and nothing is left to forget. */
    if (r != NULL && r->refused != NULL && !r->gone) {
        return TRUE;
    }
    if (r == NULL || !pf_region_live(r) || wr->n_pages != r->n_pages) {
        return link_refuse(l, "GONE of region %u (%" G_GUINT64_FORMAT " pages): %s",
                           wr->region, wr->n_pages,
                           r == NULL    ? "no such region"
                           : r->gone    ? "it is gone already"
                                        : "not all of its pages");
    }
    l->announced_bytes -= r->size;
    pf_scanner_region_gone(l->srv->scanner, l->vm, wr->region);
    return TRUE;
}

static gboolean
on_advise(PfLink *l, const PfMsg *msg)
{
    if (!pf_vm_merges(l->vm)) {
        return link_refuse(l, "ADVISE from an agent that is not merging");
    }
    g_autofree char *reason = pf_escape_text(pf_msg_mode(msg)->reason, -1);

    pf_scanner_step_back(l->srv->scanner, l->vm, reason);
    return TRUE;
}

static gboolean
on_discard(PfLink *l, const PfMsg *msg)
{
    const PfWireRange *wr = pf_msg_range(msg);
    const PfRegion *r = range_region(l, wr);

    if (r == NULL || !pf_region_live(r) || wr->page + wr->n_pages > r->n_pages) {
        return link_refuse(l, "DISCARD of pages %" G_GUINT64_FORMAT "+%" G_GUINT64_FORMAT
                              " of region %u: no such pages%s",
                           wr->page, wr->n_pages, wr->region,
                           r == NULL || pf_region_live(r) ? ""
                           : r->gone                      ? " (the region is gone)"
                                                          : " (the region was refused)");
    }
    pf_scanner_discarded(l->srv->scanner, l->vm, wr->region, wr->page, wr->n_pages);
    return TRUE;
}

/* Pages a device just wrote: visited first (scan-hints.c).  The agent is
 * not told which regions were refused, so a hint there is honest, and
 * changes nothing; one of pages no region has is a lie. */
static gboolean
on_hint(PfLink *l, const PfMsg *msg)
{
    guint32 n;
    const PfWireRange *hints = pf_msg_hints(msg, &n);

    if (l->hello.version < PF_PROTO_VERSION_HINT) {
        return link_refuse(l, "HINT on a link of protocol version %u", l->hello.version);
    }
    for (guint32 i = 0; i < n; i++) {
        const PfWireRange *wr = &hints[i];
        const PfRegion *r = range_region(l, wr);

        if (r == NULL || r->gone || wr->page + wr->n_pages > r->n_pages) {
            if (r != NULL && r->refused != NULL && !r->gone) {
                continue;
            }
            return link_refuse(l, "HINT of pages %" G_GUINT64_FORMAT "+%" G_GUINT64_FORMAT
                                  " of region %u: no such pages%s",
                               wr->page, wr->n_pages, wr->region,
                               r != NULL && r->gone ? " (the region is gone)" : "");
        }
        if (pf_region_live(r)) {
            pf_scanner_hinted(l->srv->scanner, l->vm, wr->region, wr->page, wr->n_pages);
        }
    }
    return TRUE;
}

static gboolean
on_message(PfLink *l, PfMsg *msg)
{
    switch (l->state) {
    case LINK_HELLO: {
        const PfWireHello *h;

        if (msg->header.type != PF_MSG_HELLO) {
            return link_refuse(l, "expected HELLO, got message type %u", msg->header.type);
        }
        h = pf_msg_hello(msg);
        if ((pid_t)h->pid != l->peer_pid) {
            return link_refuse(l, "HELLO says pid %u, the socket says %d", h->pid, l->peer_pid);
        }
        l->hello = *h;
        handshake_vouch(l);
        l->state = LINK_REGIONS;
        return h->n_regions > 0 || link_welcome(l);
    }
    case LINK_REGIONS: {
        const PfWireRegion *wr;

        if (msg->header.type == PF_MSG_GONE) {
            /* An agent whose pagefoldd went announces again the regions
             * that left its VM since, which keep their indexes. */
            const PfWireRange *gone = pf_msg_range(msg);
            PfRegion *r;

            if (gone->region != l->regions->len) {
                return link_refuse(l, "GONE of region %u arrived as region %u", gone->region,
                                   l->regions->len);
            }
            r = pf_region_new_refused("(gone)", 0, 0, NULL);
            pf_region_retire(r);
            handshake_region_checked(l, msg, r);
            return !l->ended;
        }
        if (msg->header.type != PF_MSG_REGION) {
            return link_refuse(l, "expected REGION, got message type %u", msg->header.type);
        }
        wr = pf_msg_region(msg);
        if (wr->index != l->regions->len) {
            return link_refuse(l, "REGION %u arrived as region %u", wr->index, l->regions->len);
        }
        handshake_region(l, msg, FALSE, handshake_region_checked);
        return TRUE;
    }
    case LINK_READY:
        if (msg->header.type != PF_MSG_READY) {
            return link_refuse(l, "expected READY, got message type %u", msg->header.type);
        }
        handshake_check_ready(l, msg, ready_checked);
        return !l->ended;
    default:
        if (msg->header.type == PF_MSG_RESULT) {
            return on_result(l, msg);
        }
        if (msg->header.type == PF_MSG_ADVISE) {
            return on_advise(l, msg);
        }
        if (msg->header.type == PF_MSG_DISCARD) {
            return on_discard(l, msg);
        }
        if (msg->header.type == PF_MSG_HINT) {
            return on_hint(l, msg);
        }
        if (msg->header.type == PF_MSG_REGION) {
            return on_region(l, msg);
        }
        if (msg->header.type == PF_MSG_GONE) {
            return on_gone(l, msg);
        }
        if (msg->header.type == PF_MSG_ERROR) {
            /* Any bytes at all: escaped, all of them (a NUL cuts nothing
             * short). */
            g_autofree char *said = pf_escape_text((const char *)msg->payload,
                                                   msg->header.length);
            g_autofree char *text = g_strdup_printf("its agent gave up: %s", said);

            link_close(l, text);
            return FALSE;
        }
        return link_refuse(l, "unexpected message type %u", msg->header.type);
    }
}

/* Reads and handles one message; FALSE when the link is gone.  A message
 * being checked (l->check) is the check's, until it is done. */
static gboolean
link_read(PfLink *l)
{
    PfMsg *msg = g_new0(PfMsg, 1);
    g_autoptr(GError) error = NULL;
    gboolean ok;

    if (!pf_proto_recv(l->sock, msg, &error)) {
        g_free(msg);
        if (g_error_matches(error, PF_ERROR, PF_ERROR_WOULD_BLOCK)) {
            return TRUE;
        }
        if (!g_error_matches(error, PF_ERROR, PF_ERROR_CLOSED)) {
            link_send_error(l, error->message);
        }
        link_close(l, error->message);
        return FALSE;
    }
    ok = on_message(l, msg);
    if (l->check == NULL) {
        pf_msg_close_fds(msg);
        g_free(msg);
    }
    return ok;
}

static gboolean
link_in_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfLink *l = user;

    if (!link_read(l)) {
        return G_SOURCE_REMOVE; /* the link is over */
    }
    if (l->check != NULL) {
        l->watch = 0; /* link_resume() watches again */
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

/* The peer took its requests and answers none: a stopped or wedged
 * process.  Its VM is detached (its merged pages stay valid in it) rather
 * than left holding up unmerge and scan-now for good. */
static gboolean
answer_timeout_cb(gpointer user)
{
    PfLink *l = user;
    g_autofree char *why = NULL;
    gint64 left;

    l->answer_timer = 0;
    if (l->vm == NULL || pf_outbox_n_sent(l->vm->outbox) == 0) {
        return G_SOURCE_REMOVE;
    }
    left = (gint64)l->srv->answer_timeout_ms * 1000 - pf_outbox_waiting_usec(l->vm->outbox);
    if (left > 0) {
        l->answer_timer = g_timeout_add((guint)(left / 1000) + 1, answer_timeout_cb, l);
        return G_SOURCE_REMOVE;
    }
    why = g_strdup_printf("its agent answered none of %zu request item(s) in %u s",
                          pf_outbox_n_sent(l->vm->outbox), l->srv->answer_timeout_ms / 1000);
    /* The agent hears why (srv_vm_gone()). */
    link_close(l, why);
    return G_SOURCE_REMOVE;
}

static gboolean
handshake_timeout_cb(gpointer user)
{
    PfLink *l = user;
    struct pollfd p = { l->sock, POLLIN, 0 };

    l->handshake_timer = 0;
    if (l->check != NULL) {
        /* Its process's mappings are what took so long. */
        link_refuse_for_now(l, "agent handshake not finished in %d ms: its process's "
                            "mappings took "
                    "longer to read", HANDSHAKE_TIMEOUT_MS);
        return G_SOURCE_REMOVE;
    }
    /* Messages waiting: the peer was on time and we were not (a long pass
     * held the loop).  Its watch reads them as soon as the loop is free,
     * so a peer that drips its handshake gets nothing from this. */
    if (poll(&p, 1, 0) == 1 && p.revents == POLLIN) {
        l->handshake_timer = g_timeout_add(HANDSHAKE_TIMEOUT_MS / 5, handshake_timeout_cb, l);
        return G_SOURCE_REMOVE;
    }
    link_refuse_for_now(l, "agent handshake not finished in %d ms", HANDSHAKE_TIMEOUT_MS);
    return G_SOURCE_REMOVE;
}

/* Refuses a connection that never became a link; uid: its peer's, or
 * (uid_t)-1 when unknown; seq: as link_send_error_seq() says. */
static void
refuse_socket(PfLinkServer *srv, int sock, uid_t uid, guint32 seq, const char *fmt, ...)
    G_GNUC_PRINTF(5, 6);

static void
refuse_socket(PfLinkServer *srv, int sock, uid_t uid, guint32 seq, const char *fmt, ...)
{
    va_list ap;
    g_autofree char *text = NULL;

    va_start(ap, fmt);
    text = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    pf_peer_log(srv->peer_log, uid, "agent connection refused: %s", text);
    pf_proto_send(sock, PF_MSG_ERROR, seq, text, MIN(strlen(text), 1024), NULL, 0, NULL);
    drain_socket(sock);
    close(sock);
}

static guint
handshakes_of(PfLinkServer *srv, pid_t pid)
{
    guint n = 0;

    for (guint i = 0; i < srv->handshakes->len; i++) {
        n += ((PfLink *)g_ptr_array_index(srv->handshakes, i))->peer_pid == pid;
    }
    return n;
}

static guint
places_taken(PfLinkServer *srv, gboolean vouched)
{
    guint n = 0;

    for (guint i = 0; i < srv->handshakes->len; i++) {
        n += ((PfLink *)g_ptr_array_index(srv->handshakes, i))->vouched_place == vouched;
    }
    return n;
}

/* Who holds a place, as the eviction counts them: processes among the
 * peers root vouched for (each one a VM), uids among the others. */
static guint
place_holder(const PfLink *l)
{
    return l->vouched_place ? (guint)l->peer_pid : (guint)l->peer_uid;
}

/*
 * The handshake that gives way when all places of the newcomer's kind
 * (vouched for or not) are taken: the oldest of the holder that holds the
 * most (the newcomer's own counted), so that a uid whose processes
 * connect in a loop takes places from itself, never from another uid's
 * VMs nor from any VM root vouched for.  Where no holder has more than
 * one, the oldest of that kind.
 */
static PfLink *
handshake_to_evict(PfLinkServer *srv, guint newcomer, gboolean vouched)
{
    g_autoptr(GHashTable) held = g_hash_table_new(NULL, NULL);
    guint most;
    guint top = newcomer;
    PfLink *oldest = NULL;

    g_hash_table_insert(held, GUINT_TO_POINTER(newcomer), GUINT_TO_POINTER(1));
    for (guint i = 0; i < srv->handshakes->len; i++) {
        PfLink *l = g_ptr_array_index(srv->handshakes, i);
        gpointer who = GUINT_TO_POINTER(place_holder(l));

        if (l->vouched_place == vouched) {
            g_hash_table_insert(held, who,
                                GUINT_TO_POINTER(GPOINTER_TO_UINT(g_hash_table_lookup(held, who)) +
                                                 1));
        }
    }
    /* A tie goes against the newcomer's own. */
    most = GPOINTER_TO_UINT(g_hash_table_lookup(held, GUINT_TO_POINTER(newcomer)));
    for (guint i = 0; i < srv->handshakes->len; i++) {
        PfLink *l = g_ptr_array_index(srv->handshakes, i);
        guint n = GPOINTER_TO_UINT(g_hash_table_lookup(held, GUINT_TO_POINTER(place_holder(l))));

        if (l->vouched_place == vouched && n > most) {
            most = n;
            top = place_holder(l);
        }
    }
    for (guint i = 0; i < srv->handshakes->len; i++) {
        PfLink *l = g_ptr_array_index(srv->handshakes, i);

        if (l->vouched_place != vouched) {
            continue;
        }
        if (oldest == NULL) {
            oldest = l;
        }
        if (place_holder(l) == top) {
            return l;
        }
    }
    return oldest;
}

static void accept_one(PfLinkServer *srv, int sock);

/* Every connection waiting is taken at once: one a wake-up would let a
 * peer that connects in a loop keep the queue full for everyone. */
static gboolean
listen_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfLinkServer *srv = user;

    for (guint i = 0; i < 4 * MAX_HANDSHAKES; i++) {
        int sock = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

        if (sock < 0) {
            break;
        }
        accept_one(srv, sock);
    }
    return G_SOURCE_CONTINUE;
}

static void
accept_one(PfLinkServer *srv, int sock)
{
    g_autoptr(GError) error = NULL;
    struct ucred cred;
    socklen_t len = sizeof(cred);
    int pidfd, proc_dir, buf = SOCKET_SNDBUF;
    gboolean vouched;
    PfLink *l;

    /* pid 0: a process outside pagefoldd's pid namespace. */
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 || cred.pid <= 0) {
        refuse_socket(srv, sock, (uid_t)-1, PF_ERROR_FOR_GOOD,
                      "no process id for this connection");
        return;
    }
    if (!handshake_peer_permitted(srv, sock, &cred)) {
        refuse_socket(srv, sock, cred.uid, PF_ERROR_FOR_GOOD,
                      "process %d (uid %u, gid %u) may not be an agent: only root%s%s",
                      cred.pid, (guint)cred.uid, (guint)cred.gid,
                      srv->group_allowed ? " and the members of the agent socket's group" : "",
                      srv->group_allowed ? "" : " (pagefoldd --agent-group opens it to a group)");
        return;
    }
    /* A process that holds its places idle only loses its own time. */
    if (handshakes_of(srv, cred.pid) >= MAX_HANDSHAKES_PER_PROCESS) {
        refuse_socket(srv, sock, cred.uid, PF_ERROR_TRY_AGAIN,
                      "process %d already has %u agent handshakes in progress", cred.pid,
                      MAX_HANDSHAKES_PER_PROCESS);
        return;
    }
    if (!handshake_pin_peer(sock, cred.pid, &pidfd, &proc_dir, &error)) {
        refuse_socket(srv, sock, cred.uid, PF_ERROR_FOR_GOOD, "%s", error->message);
        return;
    }
    /* Many processes holding places idle: one gives way (an agent sends
     * its whole handshake at once, so that is rarely a real one), and
     * tries again later, as the agent of any refused handshake does. */
    vouched = handshake_vouched_at_accept(srv, &cred);
    if (places_taken(srv, vouched) >= (vouched ? MAX_VOUCHED_HANDSHAKES : MAX_HANDSHAKES)) {
        PfLink *evicted = handshake_to_evict(srv, vouched ? (guint)cred.pid : (guint)cred.uid,
                                             vouched);

        link_refuse_for_now(evicted, "too many agent handshakes in progress (%u%s): the oldest "
                            "of the "
                    "%s holding the most gives way",
                    vouched ? MAX_VOUCHED_HANDSHAKES : MAX_HANDSHAKES,
                    vouched ? " of processes root vouched for" : "",
                    vouched ? "process" : "uid");
    }
    /* Enough for a few batches; more waits in the link's queue. */
    setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    l = g_new0(PfLink, 1);
    l->srv = srv;
    l->sock = sock;
    l->peer_pid = cred.pid;
    l->peer_uid = cred.uid;
    l->vouched_place = vouched;
    l->pidfd = pidfd;
    l->proc_dir = proc_dir;
    l->regions = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    l->ch = pf_channel_new(sock, link_broken_cb, l);
    l->watch = g_unix_fd_add(sock, G_IO_IN | G_IO_HUP | G_IO_ERR, link_in_cb, l);
    l->handshake_timer = g_timeout_add(HANDSHAKE_TIMEOUT_MS, handshake_timeout_cb, l);
    g_ptr_array_add(srv->handshakes, l);
}

/* ---- the scanner's listener ---- */

/* The VM of a link goes (its process exited, root detached it, or the
 * link itself detached it): the link ends with it, saying why, so that
 * the agent does not connect again as it does when pagefoldd goes. */
static void
srv_vm_gone(PfScanner *s, PfVm *vm, const char *why, gpointer user)
{
    PfLinkServer *srv = user;
    PfLink *l = g_hash_table_lookup(srv->running, vm);

    if (l != NULL) {
        g_autofree char *text = g_strdup_printf("pagefoldd let go of this VM: %s", why);

        link_send_error(l, text);
        link_end(l);
    }
}

static void
srv_chunk(PfScanner *s, PfVm *vm, const PfPoolChunk *chunk, gboolean drop, gpointer user)
{
    PfLinkServer *srv = user;
    PfLink *l = g_hash_table_lookup(srv->running, vm);
    PfWirePool p = { chunk->id, chunk->n_slots };

    if (l == NULL) {
        return;
    }
    /* A DROP never names a chunk a request still queued names: the pool
     * drops a chunk only when no request holds a slot of it. */
    link_send(l, drop ? PF_MSG_DROP : PF_MSG_POOL, 0, &p, sizeof(p), drop ? -1 : chunk->fd);
}

/* The scanner went first: no handshake can end in a VM any more, and no
 * agent is taken in. */
static void
srv_scanner_gone(gpointer user)
{
    PfLinkServer *srv = user;

    srv->scanner = NULL;
    g_clear_handle_id(&srv->watch, g_source_remove);
    while (srv->handshakes->len > 0) {
        link_end(g_ptr_array_index(srv->handshakes, 0));
    }
}

static const PfScanEvents srv_events = {
    .vm_gone = srv_vm_gone,
    .chunk = srv_chunk,
};

PfLinkServer *
pf_link_server_new(PfScanner *s, const char *path, GError **error)
{
    g_autoptr(PfLinkServer) srv = g_new0(PfLinkServer, 1);

    srv->answer_timeout_ms = DEFAULT_ANSWER_TIMEOUT_MS;
    srv->handshakes = g_ptr_array_new();
    srv->running = g_hash_table_new(NULL, NULL);
    srv->ended = g_ptr_array_new_with_free_func((GDestroyNotify)link_free);
    srv->peer_log = pf_peer_log_new();
    srv->uffd_dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    srv->libvirt_run_dir = g_strdup(PF_LIBVIRT_QEMU_RUN_DIR);
    srv->libvirt_pids = pf_libvirt_pids_new();
    srv->fd = pf_unix_listen(path, SOCK_SEQPACKET, error);
    if (srv->fd < 0) {
        return NULL;
    }
    srv->scanner = s;
    pf_scanner_add_listener(s, &srv_events, srv, srv_scanner_gone);
    srv->path = g_strdup(path);
    srv->watch = g_unix_fd_add(srv->fd, G_IO_IN, listen_cb, srv);
    return g_steal_pointer(&srv);
}

gboolean
pf_link_server_allow_group(PfLinkServer *srv, const char *group, GError **error)
{
    struct group *gr = getgrnam(group);
    struct stat st;
    int e;

    if (gr == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "no group '%s'", group);
        return FALSE;
    }
    /* Mode 0600 until the group is right: never open to the wrong one.
     * The path is the socket just bound, not a link someone put there in
     * a directory others may write. */
    if (lstat(srv->path, &st) < 0 || !S_ISSOCK(st.st_mode)) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "%s is no longer pagefoldd's socket",
                    srv->path);
        return FALSE;
    }
    if (fchownat(AT_FDCWD, srv->path, (uid_t)-1, gr->gr_gid, AT_SYMLINK_NOFOLLOW) < 0 ||
        chmod(srv->path, 0660) < 0) {
        e = errno;
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot open %s to group %s: %s",
                    srv->path, group, g_strerror(e));
        return FALSE;
    }
    srv->group = gr->gr_gid;
    srv->group_allowed = TRUE;
    return TRUE;
}

void
pf_link_server_set_libvirt_run_dir(PfLinkServer *srv, const char *dir)
{
    g_free(srv->libvirt_run_dir);
    srv->libvirt_run_dir = g_strdup(dir);
}

void
pf_link_server_set_kept(PfLinkServer *srv, PfAttached *kept)
{
    srv->kept = kept;
}

void
pf_link_server_set_answer_timeout(PfLinkServer *srv, guint ms)
{
    srv->answer_timeout_ms = MAX(ms, 1);
}

void
pf_link_server_free(PfLinkServer *srv)
{
    if (srv == NULL) {
        return;
    }
    if (srv->watch != 0) {
        g_source_remove(srv->watch);
    }
    /* Their VMs stay the scanner's, without an agent to send to. */
    while (srv->handshakes->len > 0) {
        link_end(g_ptr_array_index(srv->handshakes, 0));
    }
    {
        g_autoptr(GList) running = g_hash_table_get_values(srv->running);

        for (GList *e = running; e != NULL; e = e->next) {
            link_end(e->data);
        }
    }
    if (srv->scanner != NULL) {
        pf_scanner_remove_listener(srv->scanner, &srv_events, srv);
    }
    g_clear_handle_id(&srv->reap, g_source_remove);
    g_ptr_array_unref(srv->ended);
    pf_peer_log_free(srv->peer_log);
    g_hash_table_unref(srv->running);
    g_ptr_array_unref(srv->handshakes);
    if (srv->fd >= 0) {
        close(srv->fd);
    }
    if (srv->uffd_dev >= 0) {
        close(srv->uffd_dev);
    }
    if (srv->path != NULL) {
        unlink(srv->path);
    }
    g_free(srv->path);
    g_free(srv->libvirt_run_dir);
    pf_libvirt_pids_free(srv->libvirt_pids);
    g_free(srv);
}
