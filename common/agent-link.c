/*
 * agent-link.c - the connection to pagefoldd and the agent's one thread:
 * connecting, the handshake (HELLO, WELCOME, READY) that settles the
 * mode, then serving POOL, DROP and REQUEST until the link ends or the
 * agent stops.  Never makes a VMM thread wait for pagefoldd:
 * pf_agent_start() only connects, and all the waiting is done on the
 * agent thread.  When the handshake or the link fails, the VM runs on,
 * unmerged, in advise mode, and its merged pages stay valid.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include "agent-records.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define HANDSHAKE_MS 10000

static gboolean
recv_expect(PfAgent *a, PfMsg *msg, PfMsgType type, GError **error)
{
    if (!pf_proto_recv(a->sock, msg, error)) {
        return FALSE;
    }
    if (msg->header.type == PF_MSG_ERROR) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pagefoldd refused: %.*s",
                    (int)msg->header.length, (const char *)msg->payload);
        g_mutex_lock(&a->work);
        a->parted = msg->header.seq != PF_ERROR_TRY_AGAIN;
        g_mutex_unlock(&a->work);
        return FALSE;
    }
    if (msg->header.type != type) {
        pf_msg_close_fds(msg);
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "expected message type %u, got %u", type, msg->header.type);
        return FALSE;
    }
    return TRUE;
}

/*
 * Chooses the mode and says it; regions plugged in meanwhile follow.
 * Called with work held.
 */
static void
settle_mode(PfAgent *a, const PfWireMode *welcome, int dev_fd)
{
    PfWireMode ready = { 0 };
    g_autofree char *why = NULL;
    guint told = a->announced;
    PfMode mode = PF_MODE_ADVISE;

    if (a->advise_reason != NULL) {
        why = g_strdup(a->advise_reason);
    } else if (welcome->mode != PF_MODE_MERGE) {
        why = g_strdup(welcome->reason);
    } else if (a->uffd >= 0 ? pfa_uffd_resume(a, &why)
                            : pfa_uffd_setup(a, dev_fd, &why)) {
        mode = PF_MODE_MERGE;
    }
    pfa_set_mode(a, mode, why ? why : "");
    a->version = welcome->version;
    ready.version = a->version;
    ready.mode = mode;
    pf_wire_set_string(ready.reason, sizeof(ready.reason), a->reason);
    pfa_post(a, PF_MSG_READY, 0, &ready, sizeof(ready), -1);
    /* pfa_uffd_setup() protected them with the others. */
    for (guint i = told; i < a->regions->len; i++) {
        pfa_region_join(a, i, FALSE);
    }
    /* Told in HELLO's wake, gone since: pagefoldd hears it now. */
    for (guint i = 0; i < told; i++) {
        Region *r = &g_array_index(a->regions, Region, i);

        if (r->gone_untold) {
            PfWireRange gone = { i, 0, 0, r->n_pages };

            pfa_post(a, PF_MSG_GONE, 0, &gone, sizeof(gone), -1);
            r->gone_untold = FALSE;
        }
    }
    a->ready = TRUE;
    a->linking = FALSE;
    if (mode != PF_MODE_MERGE) {
        g_message("pagefold agent: VM %s stays in advise mode: %s", a->name,
                  a->reason);
    } else {
        g_message("pagefold agent: VM %s merges", a->name);
    }
}

/*
 * Waits until the socket has something to read, the agent is stopped, or
 * timeout_ms pass (-1: no limit).  The VMM's threads never wait here.
 */
static gboolean
wait_readable(PfAgent *a, int timeout_ms, GError **error)
{
    /* Within timeout_ms in all, however often something is queued. */
    gint64 end = g_get_monotonic_time() + (gint64)timeout_ms * 1000;

    for (;;) {
        struct pollfd pfd[3] = { { a->sock, POLLIN, 0 },
                                 { a->stop[0], POLLIN, 0 },
                                 { a->wake[0], POLLIN, 0 } };
        gint64 left = (end - g_get_monotonic_time() + 999) / 1000;
        int n = poll(pfd, 3, timeout_ms < 0 ? -1 : (int)MAX(left, 0));

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "poll: %s",
                        g_strerror(errno));
            return FALSE;
        }
        if (n == 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                        "pagefoldd did not answer within %d s",
                        timeout_ms / 1000);
            return FALSE;
        }
        if (pfd[1].revents) {
            g_set_error(error, PF_ERROR, PF_ERROR_CLOSED,
                        "the agent is stopping");
            return FALSE;
        }
        if (pfd[2].revents) {
            char buf[64];
            ssize_t got;

            do {
                got = read(a->wake[0], buf, sizeof(buf));
            } while (got > 0);

            pfa_post_written(a);
            if (!pfa_flush(a, error)) {
                if (error != NULL && *error == NULL) {
                    g_set_error(error, PF_ERROR, PF_ERROR_CLOSED,
                                "the link was given up");
                }
                return FALSE;
            }
        }
        if (pfd[0].revents) {
            return TRUE;
        }
    }
}

/*
 * Connects where pagefoldd's queue was full at pf_agent_start(): again
 * after 10 ms, doubling up to 5 s, for as long as the VM runs (the agent
 * stopping ends it).  FALSE with error when pagefoldd went, or stopping.
 */
static gboolean
connect_later(PfAgent *a, GError **error)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int wait_ms = 10;

    strcpy(addr.sun_path, a->connect_to);
    for (;;) {
        struct pollfd p = { a->stop[0], POLLIN, 0 };
        int n = poll(&p, 1, wait_ms), e;

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n != 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_CLOSED,
                        "the agent is stopping");
            return FALSE;
        }
        if (connect(a->sock, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
            break;
        }
        e = errno;
        if (e != EAGAIN) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                        "cannot connect to pagefoldd at %s: %s",
                        a->connect_to, g_strerror(e));
            return FALSE;
        }
        wait_ms = MIN(wait_ms * 2, 5000);
    }
    g_clear_pointer(&a->connect_to, g_free);
    if (fcntl(a->sock, F_SETFL, 0) < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot set up the link: %s", g_strerror(errno));
        return FALSE;
    }
    return TRUE;
}

/*
 * Pages merged under an earlier link, with advise mode to come: folded
 * back before READY, since no pagefoldd will count them.  Its DISCARDs
 * would come before READY, out of turn: the pagefoldd that answers reads
 * the memfds as they are.  What cannot come back (in DMA) stays merged and
 * valid, uncounted, and the userfaultfd with it.
 */
static void
fold_back_untracked(PfAgent *a)
{
    g_autofree char *failed = NULL;
    gboolean any = FALSE;
    guint n;
    int rc;

    g_mutex_lock(&a->work);
    n = a->regions->len;
    for (guint i = 0; i < n && !any; i++) {
        const Region *r = &g_array_index(a->regions, Region, i);

        any = !r->gone &&
              pfa_find_remapped(r, 0, r->n_pages, TRUE) < r->n_pages;
    }
    g_mutex_unlock(&a->work);
    if (!any) {
        return;
    }
    g_mutex_lock(&a->out);
    a->posting = FALSE;
    g_mutex_unlock(&a->out);
    rc = pfa_fold_back_regions(a, n, &failed);
    g_mutex_lock(&a->out);
    a->posting = TRUE;
    g_mutex_unlock(&a->out);
    if (rc < 0) {
        g_warning("pagefold agent: VM %s: cannot fold every merged page of "
                  "%s back (%s): they stay merged, uncounted", a->name, failed,
                  g_strerror(-rc));
        return;
    }
    g_mutex_lock(&a->work);
    if (a->uffd >= 0) {
        close(a->uffd);
        a->uffd = -1;
    }
    g_mutex_unlock(&a->work);
}

/*
 * Announces the VM and its regions and settles the mode.  Only the agent
 * thread waits for pagefoldd meanwhile.
 */
static gboolean
handshake_run(PfAgent *a, GError **error)
{
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);
    PfWireHello hello = { 0 };
    gboolean stepped_back;
    int dev_fd = -1;

    g_mutex_lock(&a->work);
    hello.version = PF_PROTO_VERSION;
    hello.pid = (guint32)getpid();
    memcpy(hello.uuid, a->uuid, 16);
    pf_wire_set_string(hello.name, sizeof(hello.name), a->name);
    hello.n_regions = a->regions->len;
    pfa_post(a, PF_MSG_HELLO, 0, &hello, sizeof(hello), -1);
    a->linking = TRUE;
    for (guint i = 0; i < hello.n_regions; i++) {
        pfa_region_join(a, i, FALSE);
    }
    g_mutex_unlock(&a->work);
    if (!pfa_flush(a, error) || !wait_readable(a, HANDSHAKE_MS, error) ||
        !recv_expect(a, msg, PF_MSG_WELCOME, error)) {
        return FALSE;
    }
    if (msg->n_fds == 1) {
        dev_fd = msg->fds[0];
        msg->n_fds = 0;
    }
    g_mutex_lock(&a->work);
    stepped_back = a->advise_reason != NULL;
    g_mutex_unlock(&a->work);
    if (pf_msg_mode(msg)->mode != PF_MODE_MERGE || stepped_back) {
        fold_back_untracked(a);
    }
    g_mutex_lock(&a->work);
    settle_mode(a, pf_msg_mode(msg), dev_fd);
    if (dev_fd >= 0) {
        /* Kept for back-ends that need a userfaultfd of their own. */
        if (a->uffd_dev >= 0) {
            close(a->uffd_dev);
        }
        a->uffd_dev = dev_fd;
    }
    g_mutex_unlock(&a->work);
    if (!pfa_flush(a, error)) {
        return FALSE;
    }
    pfa_set_connected(a, TRUE);
    return TRUE;
}

/* handshake_run(), and a back-end's fold-backs go on, whatever came of it. */
static gboolean
handshake(PfAgent *a, GError **error)
{
    gboolean ok = handshake_run(a, error);

    g_mutex_lock(&a->work);
    a->linking = FALSE;
    g_mutex_unlock(&a->work);
    return ok;
}

/*
 * The send side of a link's socket.  A pagefoldd that stops reading must
 * not stall the agent thread for good: after 5 s a send fails, and the
 * link is given up.  pagefoldd sends requests only while their answers fit
 * in the send buffer (a window of a few batches, each answered in 16 KiB),
 * so the agent thread never waits on a pagefoldd busy elsewhere; its size
 * is said rather than left to net.core.wmem_default.
 */
static int
link_sockopts(int sock)
{
    struct timeval tv = { .tv_sec = 5 };
    int sndbuf = 256 << 10;

    if (setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0 ||
        setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)) < 0) {
        return -1;
    }
    return 0;
}

/*
 * The link ended and the agent is not stopping: pagefoldd went (a restart,
 * an upgrade, a crash) or gave this VM up.  Merged pages stay as they are;
 * the agent lets go of its pool chunks (the mappings keep their memory:
 * the pagefoldd that answers finds them there and sends them again), and
 * connects again after 10 ms, twice as long at each try, up to 5 s, for as
 * long as the VM runs.  The socket's descriptor number stays a->sock's
 * (pf_agent_free() may shut it from another thread).  FALSE when the
 * agent is stopping.
 */
static gboolean
relink(PfAgent *a)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };

    g_mutex_lock(&a->work);
    pfa_outbox_discard(a);
    pfa_set_connected(a, FALSE);
    g_ptr_array_set_size(a->chunks, 0); /* pfa_chunk_free() */
    /*
     * a->announced stays: regions told before are pagefoldd's to hear of
     * as gone (a new HELLO announces them all again).
     */
    a->ready = FALSE;
    for (guint i = 0; i < a->regions->len; i++) {
        g_array_index(a->regions, Region, i).gone_untold = FALSE;
    }
    if (a->mode == PF_MODE_MERGE) {
        pfa_set_mode(a, PF_MODE_ADVISE,
                     "pagefoldd went away: connecting to it again");
    }
    g_mutex_unlock(&a->work);
    g_strlcpy(addr.sun_path, a->socket_path, sizeof(addr.sun_path));
    for (;;) {
        struct pollfd p = { a->stop[0], POLLIN, 0 };
        int sock, n;

        a->relink_ms = CLAMP(a->relink_ms * 2, 10, 5000);
        n = poll(&p, 1, a->relink_ms);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n != 0) {
            return FALSE;
        }
        sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK,
                      0);
        if (sock < 0) {
            continue;
        }
        /* Not blocking: a queue that is full is tried again later. */
        if (connect(sock, (struct sockaddr *)&addr, sizeof(addr)) == 0 &&
            fcntl(sock, F_SETFL, 0) == 0 && link_sockopts(sock) == 0 &&
            dup3(sock, a->sock, O_CLOEXEC) == a->sock) {
            close(sock);
            break;
        }
        close(sock);
    }
    g_mutex_lock(&a->out);
    a->posting = TRUE;
    g_mutex_unlock(&a->out);
    return TRUE;
}

/*
 * Either side said ERROR for good: pagefoldd let go of this VM (root
 * detached it, it answered too slowly, it kept dropped chunks), or the
 * agent gave up on pagefoldd.  It stays unattached.  A link that broke
 * (pagefoldd died, restarted, was upgraded) is made again, and so is a
 * handshake pagefoldd refused for now (PF_ERROR_TRY_AGAIN: too many at
 * once, a flood of other processes among them).
 */
static gboolean
parted(PfAgent *a)
{
    gboolean p;

    g_mutex_lock(&a->work);
    p = a->parted;
    g_mutex_unlock(&a->work);
    return p;
}

/* pf_agent_free() stops the agent: a send it cut short is no news. */
static gboolean
stopping(PfAgent *a)
{
    struct pollfd p = { a->stop[0], POLLIN, 0 };

    return poll(&p, 1, 0) == 1;
}

/*
 * Does what one message of pagefoldd asks; FALSE when the link is to end
 * (with error set, but for pagefoldd's own ERROR).  Called with work held.
 * Not static: tests/fuzz/agent-dispatch.c feeds it decoded messages.
 */
gboolean
pfa_dispatch(PfAgent *a, PfMsg *msg, GError **error)
{
    switch (msg->header.type) {
    case PF_MSG_POOL:
        return pfa_take_chunk(a, msg, error);
    case PF_MSG_DROP:
        return pfa_drop_chunk(a, msg, error);
    case PF_MSG_REQUEST:
        return pfa_handle_request(a, msg, error);
    case PF_MSG_ERROR:
        /* TRY_AGAIN: evicted, or out of time, while READY was checked. */
        g_warning("pagefold agent: pagefoldd says: %.*s",
                  (int)msg->header.length, (const char *)msg->payload);
        a->parted = msg->header.seq != PF_ERROR_TRY_AGAIN;
        return FALSE;
    default:
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "unexpected message type %u", msg->header.type);
        return FALSE;
    }
}

/* Serves requests until the link ends or the agent stops. */
static void
serve(PfAgent *a)
{
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);

    for (;;) {
        g_autoptr(GError) error = NULL;
        gboolean ok;

        if (!wait_readable(a, -1, &error)) {
            if (!g_error_matches(error, PF_ERROR, PF_ERROR_CLOSED) &&
                !stopping(a)) {
                g_warning("pagefold agent: %s; disconnecting", error->message);
            }
            return;
        }
        if (!pf_proto_recv(a->sock, msg, &error)) {
            /*
             * A message pagefoldd should never have sent: the agent gives
             * up on it.  The socket failing (pagefoldd died with data
             * unread: ECONNRESET) is a link that broke.
             */
            if (g_error_matches(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT)) {
                g_warning("pagefold agent: %s; disconnecting", error->message);
                g_mutex_lock(&a->work);
                pfa_post_error(a, error->message);
                g_mutex_unlock(&a->work);
                (void)pfa_flush(a, NULL);
            } else if (!g_error_matches(error, PF_ERROR, PF_ERROR_CLOSED)) {
                g_message("pagefold agent: %s; disconnecting", error->message);
            }
            return;
        }
        g_mutex_lock(&a->work);
        ok = pfa_dispatch(a, msg, &error);
        pf_msg_close_fds(msg);
        if (!ok && error != NULL) {
            g_warning("pagefold agent: %s; disconnecting", error->message);
            pfa_post_error(a, error->message);
        }
        if (!ok) {
            /* Under the work lock: nothing is queued after the ERROR. */
            pfa_set_connected(a, FALSE);
        }
        g_mutex_unlock(&a->work);
        g_clear_error(&error);
        if (!pfa_flush(a, &error) || !ok) {
            if (error != NULL && !stopping(a)) {
                g_warning("pagefold agent: %s; disconnecting", error->message);
            }
            return;
        }
    }
}

static gpointer
agent_thread(gpointer data)
{
    PfAgent *a = data;
    g_autoptr(GError) error = NULL;
    gboolean ok, said_failure;

    /*
     * The name by which top, perf and the benchmarks tell the agent's CPU
     * from the VMM's: QEMU names its threads only with debug-threads=on.
     * Nothing depends on it.
     */
    if (prctl(PR_SET_NAME, "pagefold-agent", 0, 0, 0) < 0) {
        g_debug("pagefold agent: the thread keeps its name: %s",
                g_strerror(errno));
    }
    ok = (a->connect_to == NULL || connect_later(a, &error)) &&
         handshake(a, &error);
    said_failure = !ok;

    if (!ok) {
        g_autofree char *why = g_strdup_printf("not attached to pagefoldd: %s",
                                               error->message);

        g_warning("pagefold agent: VM %s runs unmerged: %s", a->name,
                  error->message);
        g_mutex_lock(&a->work);
        pfa_set_mode(a, PF_MODE_ADVISE, why);
        if (a->uffd >= 0) {
            /* Nothing was remapped: guest RAM is left unregistered. */
            close(a->uffd);
            a->uffd = -1;
        }
        g_mutex_unlock(&a->work);
    }
    g_mutex_lock(&a->lock);
    a->settled = TRUE;
    a->start_error = ok ? NULL : g_strdup(error->message);
    g_cond_broadcast(&a->settled_cond);
    g_mutex_unlock(&a->lock);
    for (;;) {
        if (ok) {
            /* A pagefoldd that took the VM: the next try after 10 ms. */
            a->relink_ms = 0;
            serve(a);
        }
        g_clear_error(&error);
        if (stopping(a) || parted(a) || !relink(a)) {
            break;
        }
        ok = handshake(a, &error);
        if (ok) {
            g_message("pagefold agent: VM %s attached to pagefoldd again",
                      a->name);
            said_failure = FALSE;
        } else if (!stopping(a) && !said_failure) {
            /* Once until it works: it tries every 5 s for as long. */
            g_message("pagefold agent: VM %s: %s; trying again", a->name,
                      error->message);
            said_failure = TRUE;
        }
    }
    /* Under the work lock: nothing is queued once it ends. */
    g_mutex_lock(&a->work);
    pfa_outbox_discard(a);
    pfa_set_connected(a, FALSE);
    g_mutex_unlock(&a->work);
    if (a->sock >= 0) {
        shutdown(a->sock, SHUT_RDWR);
    }
    return NULL;
}

/* Connects to pagefoldd, and makes the pipes that wake and stop the thread. */
static gboolean
link_open(PfAgent *a, const char *socket_path, GError **error)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int e;

    if (strlen(socket_path) >= sizeof(addr.sun_path)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "socket path too long: %s", socket_path);
        return FALSE;
    }
    strcpy(addr.sun_path, socket_path);
    /* Every pool chunk this VM comes to share is a descriptor of ours. */
    pf_raise_nofile_limit();
    /*
     * Not blocking: a pagefoldd that accepts nobody (its queue full) is
     * said at once, not waited for.
     */
    a->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (a->sock < 0) {
        e = errno;
    } else {
        e = connect(a->sock, (struct sockaddr *)&addr, sizeof(addr)) < 0 ? errno
                                                                         : 0;
    }
    /*
     * EAGAIN: pagefoldd is there, its queue full (busy, or flooded by
     * other processes of the agent group): the agent thread tries again
     * (connect_later()).
     */
    if (e != 0 && !(a->sock >= 0 && e == EAGAIN)) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot connect to pagefoldd at %s: %s", socket_path,
                    g_strerror(e));
        return FALSE;
    }
    if (e == EAGAIN) {
        a->connect_to = g_strdup(socket_path);
    }
    a->socket_path = g_strdup(socket_path);
    if ((a->connect_to == NULL && fcntl(a->sock, F_SETFL, 0) < 0) ||
        link_sockopts(a->sock) < 0 || pipe2(a->stop, O_CLOEXEC) < 0 ||
        pipe2(a->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot set up the link: %s", g_strerror(errno));
        return FALSE;
    }
    return TRUE;
}

/*
 * Undoes what link_open() did, and leaves the VM in advise mode, saying
 * why.
 */
static void
link_give_up(PfAgent *a, const char *message)
{
    g_autofree char *why = g_strdup_printf("not attached to pagefoldd: %s",
                                           message);

    for (int i = 0; i < 2; i++) {
        if (a->stop[i] >= 0) {
            close(a->stop[i]);
        }
        if (a->wake[i] >= 0) {
            close(a->wake[i]);
        }
        a->stop[i] = a->wake[i] = -1;
    }
    if (a->sock >= 0) {
        close(a->sock);
        a->sock = -1;
    }
    g_mutex_lock(&a->work);
    pfa_set_mode(a, PF_MODE_ADVISE, why);
    g_mutex_unlock(&a->work);
}

gboolean
pf_agent_start(PfAgent *a, const char *socket_path, GError **error)
{
    g_autoptr(GError) err = NULL;

    g_return_val_if_fail(a->sock < 0, FALSE);
    if (!link_open(a, socket_path, &err)) {
        link_give_up(a, err->message);
        g_propagate_error(error, g_steal_pointer(&err));
        return FALSE;
    }
    g_mutex_lock(&a->out);
    a->posting = TRUE;
    g_mutex_unlock(&a->out);
    a->thread = a->threads.create(agent_thread, a, a->threads.opaque);
    return TRUE;
}

gboolean
pf_agent_wait_settled(PfAgent *a, GError **error)
{
    gboolean ok;

    g_mutex_lock(&a->lock);
    while (a->thread != NULL && !a->settled) {
        g_cond_wait(&a->settled_cond, &a->lock);
    }
    ok = a->thread != NULL && a->start_error == NULL;
    if (!ok) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "%s",
                    a->start_error ? a->start_error
                                   : "the agent was not started");
    }
    g_mutex_unlock(&a->lock);
    return ok;
}
