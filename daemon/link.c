/*
 * link.c - see link.h.
 *
 * A connection goes HELLO -> REGION x n -> (WELCOME) -> READY, then
 * carries REQUESTs and RESULTs.  Agents are trusted with nothing: the pid
 * they announce must be the socket peer's, their memfds are mapped
 * read-only and checked like any region, and a result must answer a
 * request in flight, item for item.
 */
#include "link.h"

#include <errno.h>
#include <fcntl.h>
#include <gio/gio.h>
#include <glib-unix.h>
#include <glib/gstdio.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "util.h"

enum { LINK_HELLO, LINK_REGIONS, LINK_READY, LINK_RUNNING };

struct _PfLinkServer {
    PfScanner *scanner;
    char *path;
    int fd;
    guint watch;
    int uffd_dev; /* /dev/userfaultfd, for agents that cannot make one */
    GPtrArray *handshakes; /* PfLink* not yet READY */
};

typedef struct {
    guint32 seq;
    GArray *pending; /* PfPending, one per item sent */
} Batch;

struct _PfLink {
    PfLinkServer *srv;
    int sock;
    guint watch;
    int state;
    pid_t peer_pid;
    PfWireHello hello;
    GPtrArray *regions; /* PfRegion*, during the handshake */
    PfVm *vm;
    guint32 next_seq;
    GArray *queue_items;   /* PfWireItem */
    GArray *queue_pending; /* PfPending */
    GQueue in_flight;      /* Batch*, oldest first */
    gsize n_in_flight;
    gboolean broken;
};

static void
batch_free(Batch *b)
{
    g_array_unref(b->pending);
    g_free(b);
}

static void
link_send_error(PfLink *l, const char *text)
{
    pf_proto_send(l->sock, PF_MSG_ERROR, 0, text, MIN(strlen(text), 1024), NULL, 0, NULL);
}

void
pf_link_free(PfLink *l, void (*func)(const PfPending *pd, gpointer user), gpointer user)
{
    Batch *b;

    if (l == NULL) {
        return;
    }
    while ((b = g_queue_pop_head(&l->in_flight)) != NULL) {
        for (guint i = 0; func != NULL && i < b->pending->len; i++) {
            func(&g_array_index(b->pending, PfPending, i), user);
        }
        batch_free(b);
    }
    for (guint i = 0; func != NULL && i < l->queue_pending->len; i++) {
        func(&g_array_index(l->queue_pending, PfPending, i), user);
    }
    if (l->watch != 0) {
        g_source_remove(l->watch);
    }
    close(l->sock);
    g_ptr_array_unref(l->regions);
    g_array_unref(l->queue_items);
    g_array_unref(l->queue_pending);
    g_free(l);
}

/* Ends a link: its VM (if any) is detached, which frees the link. */
static void
link_close(PfLink *l, const char *why)
{
    if (l->vm != NULL) {
        pf_scanner_detach(l->srv->scanner, l->vm, why);
        return;
    }
    g_message("agent connection closed during its handshake: %s", why);
    g_ptr_array_remove(l->srv->handshakes, l);
}

static gboolean
link_refuse(PfLink *l, const char *fmt, ...) G_GNUC_PRINTF(2, 3);

static gboolean
link_refuse(PfLink *l, const char *fmt, ...)
{
    va_list ap;
    g_autofree char *text = NULL;

    va_start(ap, fmt);
    text = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    link_send_error(l, text);
    link_close(l, text);
    return FALSE;
}

/* The socket is non-blocking, so a slow agent cannot stall the daemon
 * forever: a full socket gets SEND_PATIENCE_MS to drain, then the link is
 * given up. */
#define SEND_PATIENCE_MS 5000

typedef gboolean (*SendFunc)(PfLink *l, gconstpointer data, GError **error);

static void
link_send(PfLink *l, SendFunc send_func, gconstpointer data)
{
    gint64 deadline = g_get_monotonic_time() + SEND_PATIENCE_MS * 1000;

    while (!l->broken) {
        g_autoptr(GError) error = NULL;
        struct pollfd p = { l->sock, POLLOUT, 0 };
        gint64 left;

        if (send_func(l, data, &error)) {
            return;
        }
        left = (deadline - g_get_monotonic_time()) / 1000;
        if (!g_error_matches(error, PF_ERROR, PF_ERROR_WOULD_BLOCK) || left <= 0) {
            g_message("agent of %s: %s", l->vm ? l->vm->name : "?",
                      left <= 0 ? "not reading its socket" : error->message);
            l->broken = TRUE;
            return;
        }
        poll(&p, 1, (int)left);
    }
}

static gboolean
send_chunk(PfLink *l, gconstpointer data, GError **error)
{
    const PfPoolChunk *chunk = data;
    PfWirePool p = { chunk->id, chunk->n_slots };

    return pf_proto_send(l->sock, PF_MSG_POOL, 0, &p, sizeof(p), &chunk->fd, 1, error);
}

void
pf_link_send_chunk(PfLink *l, const PfPoolChunk *chunk)
{
    link_send(l, send_chunk, chunk);
}

static gboolean
send_batch(PfLink *l, gconstpointer data, GError **error)
{
    const Batch *b = data;

    return pf_proto_send_items(l->sock, b->seq, (PfWireItem *)l->queue_items->data,
                               l->queue_items->len, error);
}

void
pf_link_queue(PfLink *l, const PfWireItem *item, const PfPending *pd)
{
    g_array_append_vals(l->queue_items, item, 1);
    g_array_append_vals(l->queue_pending, pd, 1);
    if (l->queue_items->len >= PF_PROTO_MAX_ITEMS) {
        pf_link_flush(l);
    }
}

void
pf_link_flush(PfLink *l)
{
    Batch *b;

    if (l->queue_items->len == 0) {
        return;
    }
    b = g_new0(Batch, 1);
    b->seq = ++l->next_seq;
    b->pending = l->queue_pending;
    l->queue_pending = g_array_new(FALSE, FALSE, sizeof(PfPending));
    g_queue_push_tail(&l->in_flight, b);
    l->n_in_flight += b->pending->len;
    link_send(l, send_batch, b);
    g_array_set_size(l->queue_items, 0);
}

gsize
pf_link_in_flight(PfLink *l)
{
    return l->n_in_flight;
}

/* ---- messages ---- */

static gboolean
on_result(PfLink *l, const PfMsg *msg)
{
    guint32 n;
    const PfWireResult *res = pf_msg_results(msg, &n);
    Batch *b = g_queue_peek_head(&l->in_flight);
    PfVm *vm = l->vm;
    PfScanner *s = l->srv->scanner;

    /* Agents answer in order, every item of every batch. */
    if (b == NULL || b->seq != msg->header.seq || b->pending->len != n) {
        return link_refuse(l, "RESULT %u with %u entries answers no request in flight",
                           msg->header.seq, n);
    }
    g_queue_pop_head(&l->in_flight);
    l->n_in_flight -= n;
    for (guint32 i = 0; i < n; i++) {
        pf_scanner_complete(s, vm, &g_array_index(b->pending, PfPending, i),
                            (PfResultStatus)res[i].status, res[i].err);
    }
    batch_free(b);
    /* Answers can call for more (a huge page to collapse): send them now. */
    pf_link_flush(l);
    return TRUE;
}

static gboolean
on_ready(PfLink *l, const PfMsg *msg)
{
    const PfWireMode *m = pf_msg_mode(msg);
    PfScanner *s = l->srv->scanner;
    g_autoptr(GError) error = NULL;
    g_autoptr(PfVm) vm = NULL;
    PfVm *old;
    g_autofree char *pidstr = g_strdup_printf("%d", l->peer_pid);

    if (pf_scanner_find_vm(s, l->hello.name) != NULL &&
        pf_scanner_find_vm(s, l->hello.name)->pid != l->peer_pid) {
        return link_refuse(l, "a VM named '%s' is already attached", l->hello.name);
    }
    /* The agent knows this VM better than /proc did: it replaces a VM
     * attached by pid. */
    old = pf_scanner_find_vm(s, pidstr);
    if (old != NULL && old->pid == l->peer_pid) {
        if (old->link != NULL) {
            return link_refuse(l, "process %d already has an agent connected", l->peer_pid);
        }
        pf_scanner_remove_vm(s, old);
    }
    vm = pf_vm_new_from_agent(l->peer_pid, l->hello.name, l->regions, &error);
    if (vm == NULL) {
        return link_refuse(l, "%s", error->message);
    }
    if (m->mode == PF_MODE_MERGE && vm->regions->len == 0) {
        return link_refuse(l, "mode merge without a region to merge");
    }
    if (m->mode == PF_MODE_MERGE) {
        vm->mode = "merge";
    } else {
        vm->mode_reason = g_strdup(m->reason[0] ? m->reason : "the agent chose advise mode");
    }
    vm->link = l;
    l->vm = vm;
    l->state = LINK_RUNNING;
    {
        guint idx;

        if (g_ptr_array_find(l->srv->handshakes, l, &idx)) {
            g_ptr_array_steal_index_fast(l->srv->handshakes, idx);
        }
    }
    g_message("VM %s (pid %d) attached by its agent in mode %s%s%s: %u region(s), %zu pages",
              vm->name, vm->pid, vm->mode, vm->mode_reason ? " because " : "",
              vm->mode_reason ? vm->mode_reason : "", vm->regions->len, pf_vm_n_pages(vm));
    pf_scanner_add_vm(s, g_steal_pointer(&vm));
    return TRUE;
}

/* All regions are in: the agent may merge, and may need a userfaultfd. */
static gboolean
link_welcome(PfLink *l)
{
    PfWireMode w = { PF_PROTO_VERSION, PF_MODE_MERGE, "" };
    g_autoptr(GError) error = NULL;
    int fd = l->srv->uffd_dev;

    if (!pf_proto_send(l->sock, PF_MSG_WELCOME, 0, &w, sizeof(w), &fd, fd >= 0 ? 1 : 0,
                       &error)) {
        link_close(l, error->message);
        return FALSE;
    }
    l->state = LINK_READY;
    return TRUE;
}

static gboolean
on_advise(PfLink *l, const PfMsg *msg)
{
    if (!pf_vm_merges(l->vm)) {
        return link_refuse(l, "ADVISE from an agent that is not merging");
    }
    pf_scanner_step_back(l->srv->scanner, l->vm, pf_msg_mode(msg)->reason);
    return TRUE;
}

static gboolean
on_discard(PfLink *l, const PfMsg *msg)
{
    const PfWireRange *wr = pf_msg_range(msg);
    const PfRegion *r = wr->region < l->vm->regions->len
                            ? g_ptr_array_index(l->vm->regions, wr->region)
                            : NULL;

    if (r == NULL || wr->page + wr->n_pages > r->n_pages) {
        return link_refuse(l, "DISCARD of pages %" G_GUINT64_FORMAT "+%" G_GUINT64_FORMAT
                              " of region %u: no such pages",
                           wr->page, wr->n_pages, wr->region);
    }
    pf_scanner_discarded(l->srv->scanner, l->vm, wr->region, wr->page, wr->n_pages);
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
        l->state = LINK_REGIONS;
        return h->n_regions > 0 || link_welcome(l);
    }
    case LINK_REGIONS: {
        const PfWireRegion *wr;
        g_autoptr(GError) error = NULL;
        PfRegion *r;

        if (msg->header.type != PF_MSG_REGION) {
            return link_refuse(l, "expected REGION, got message type %u", msg->header.type);
        }
        wr = pf_msg_region(msg);
        if (wr->index != l->regions->len) {
            return link_refuse(l, "REGION %u arrived as region %u", wr->index, l->regions->len);
        }
        r = pf_region_new(wr->name, msg->fds[0], wr->host_addr, wr->offset, wr->size, &error);
        msg->n_fds = 0; /* taken, or closed on error */
        if (r == NULL) {
            return link_refuse(l, "%s", error->message);
        }
        g_ptr_array_add(l->regions, r);
        return l->regions->len < l->hello.n_regions || link_welcome(l);
    }
    case LINK_READY:
        if (msg->header.type != PF_MSG_READY) {
            return link_refuse(l, "expected READY, got message type %u", msg->header.type);
        }
        return on_ready(l, msg);
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
        if (msg->header.type == PF_MSG_ERROR) {
            g_autofree char *text = g_strdup_printf("its agent gave up: %.*s",
                                                    (int)msg->header.length,
                                                    (const char *)msg->payload);

            link_close(l, text);
            return FALSE;
        }
        return link_refuse(l, "unexpected message type %u", msg->header.type);
    }
}

/* Reads and handles one message; FALSE when the link is gone. */
static gboolean
link_read(PfLink *l)
{
    g_autofree PfMsg *msg = g_new0(PfMsg, 1);
    g_autoptr(GError) error = NULL;
    gboolean ok;

    if (!pf_proto_recv(l->sock, msg, &error)) {
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
    pf_msg_close_fds(msg);
    return ok;
}

static gboolean
link_in_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfLink *l = user;

    if (!link_read(l)) {
        return G_SOURCE_REMOVE; /* the link is freed, and its watch with it */
    }
    if (l->broken) {
        link_close(l, "cannot send to its agent");
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

void
pf_link_settle(PfLink *l, guint timeout_ms)
{
    gint64 deadline = g_get_monotonic_time() + (gint64)timeout_ms * 1000;

    while (l->n_in_flight > 0 && !l->broken) {
        struct pollfd p = { l->sock, POLLIN, 0 };
        gint64 left = (deadline - g_get_monotonic_time()) / 1000;

        if (left <= 0) {
            g_message("VM %s: its agent has not answered %zu item(s) in %u ms", l->vm->name,
                      l->n_in_flight, timeout_ms);
            return;
        }
        if (poll(&p, 1, (int)left) > 0 && !link_read(l)) {
            return; /* l is gone */
        }
    }
    if (l->broken) {
        link_close(l, "cannot send to its agent");
    }
}

static gboolean
listen_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfLinkServer *srv = user;
    struct ucred cred;
    socklen_t len = sizeof(cred);
    int sock = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    PfLink *l;

    if (sock < 0) {
        return G_SOURCE_CONTINUE;
    }
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 || srv->handshakes->len > 64) {
        close(sock);
        return G_SOURCE_CONTINUE;
    }
    {
        int buf = 4 << 20;

        setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    }
    l = g_new0(PfLink, 1);
    l->srv = srv;
    l->sock = sock;
    l->peer_pid = cred.pid;
    l->regions = g_ptr_array_new_with_free_func((GDestroyNotify)pf_region_free);
    l->queue_items = g_array_new(FALSE, FALSE, sizeof(PfWireItem));
    l->queue_pending = g_array_new(FALSE, FALSE, sizeof(PfPending));
    g_queue_init(&l->in_flight);
    l->watch = g_unix_fd_add(sock, G_IO_IN | G_IO_HUP | G_IO_ERR, link_in_cb, l);
    g_ptr_array_add(srv->handshakes, l);
    return G_SOURCE_CONTINUE;
}

static void
handshake_free(gpointer data)
{
    pf_link_free(data, NULL, NULL);
}

PfLinkServer *
pf_link_server_new(PfScanner *s, const char *path, GError **error)
{
    g_autoptr(PfLinkServer) srv = g_new0(PfLinkServer, 1);

    srv->scanner = s;
    srv->handshakes = g_ptr_array_new_with_free_func(handshake_free);
    srv->uffd_dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    srv->fd = pf_unix_listen(path, SOCK_SEQPACKET, error);
    if (srv->fd < 0) {
        return NULL;
    }
    srv->path = g_strdup(path);
    srv->watch = g_unix_fd_add(srv->fd, G_IO_IN, listen_cb, srv);
    return g_steal_pointer(&srv);
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
    g_free(srv);
}
