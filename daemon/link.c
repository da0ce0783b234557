/*
 * link.c - one agent link (link-records.h): its life from link_new() to
 * its record freed from the main loop, its messages in protocol order, its
 * timers.  The agent socket, its handshake places and the scanner's
 * listener are link-server.c's, which decides when a link is made or
 * ended; the checks a peer must pass are handshake.c's, the sending
 * channel.c's, the log limit peer-log.c's.  Owns every PfLink, every
 * descriptor a peer passed, and the server's lists of links (handshakes,
 * running, ended); must never decide a merge, believe what a peer has not
 * shown, or wait for one on the main loop.
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
#include "link-records.h"

#include <errno.h>
#include <glib-unix.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "channel.h"
#include "cpu-use.h"
#include "libvirt-status.h"
#include "peer-log.h"
#include "escape.h"
#include "util.h"

/* A handshake is a few messages the agent sends at once: an agent that
 * has not finished in this long is not going to. */
#define HANDSHAKE_TIMEOUT_MS 5000
/*
 * Drops what the peer sent that will never be read: closing a socket with
 * unread data resets the connection, and the peer's next read returns
 * ECONNRESET instead of the ERROR queued for it (an agent sends all its
 * REGIONs at once; the first may be refused).  Bounded: a peer that keeps
 * sending gets the reset.
 */
void
link_drain_socket(int sock)
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

void
link_send_error(PfLink *l, const char *text)
{
    link_send_error_seq(l, PF_ERROR_FOR_GOOD, text);
}

void
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
void
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
    link_drain_socket(l->sock);
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
gboolean
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

void
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

void
link_resume(PfLink *l)
{
    gboolean want = !l->ended && l->check == NULL &&
                    !(l->state == LINK_RUNNING && l->srv->quiet);

    if (want && l->watch == 0) {
        l->watch = pf_fd_add(l->sock, G_IO_IN | G_IO_HUP | G_IO_ERR, link_in_cb, l);
    } else if (!want && l->watch != 0) {
        g_clear_handle_id(&l->watch, g_source_remove);
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
    if ((wr->flags & PF_RANGE_BACKEND) && l->hello.version < PF_PROTO_VERSION_BACKEND) {
        return link_refuse(l, "DISCARD with flags on a link of protocol version %u",
                           l->hello.version);
    }
    pf_scanner_discarded(l->srv->scanner, l->vm, wr->region, wr->page, wr->n_pages,
                         wr->flags & PF_RANGE_BACKEND);
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
    gboolean open;

    pf_cpu_enter(PF_CPU_ANSWERS);
    open = link_read(l);
    pf_cpu_leave();
    if (!open) {
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
    /* The agent hears why (the listener's vm_gone, link-server.c). */
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

PfLink *
link_new(PfLinkServer *srv, int sock, const struct ucred *cred, int pidfd, int proc_dir,
         gboolean vouched_place)
{
    PfLink *l = g_new0(PfLink, 1);

    l->srv = srv;
    l->sock = sock;
    l->peer_pid = cred->pid;
    l->peer_uid = cred->uid;
    l->vouched_place = vouched_place;
    l->pidfd = pidfd;
    l->proc_dir = proc_dir;
    l->regions = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    l->ch = pf_channel_new(sock, link_broken_cb, l);
    l->watch = pf_fd_add(sock, G_IO_IN | G_IO_HUP | G_IO_ERR, link_in_cb, l);
    l->handshake_timer = g_timeout_add(HANDSHAKE_TIMEOUT_MS, handshake_timeout_cb, l);
    g_ptr_array_add(srv->handshakes, l);
    return l;
}
