/*
 * link-server.c - the agent socket (link-server.h): taking connections
 * in, the handshake places they wait in, the scanner's listener that ends
 * links and sends chunks, and the server's life.  A connection that
 * passes the checks of accept (a process id, a peer that may be an agent,
 * pinned) becomes a link (link.c), which runs the protocol from there.
 *
 * Owns the server (its socket, settings and listener) and decides which
 * handshake gives way; the lists of links are link.c's.  Must never let
 * one uid's connections take the places of another's, nor any peer's the
 * places of a VM root vouched for, and never waits for a peer.
 */
#include "link-server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <glib-unix.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "libvirt-status.h"
#include "link-records.h"
#include "peer-log.h"
#include "util.h"

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

/* Refuses a connection that never became a link; uid: its peer's, or
 * (uid_t)-1 when unknown; seq: PF_ERROR_TRY_AGAIN where its agent may
 * connect again (no room for it now), else PF_ERROR_FOR_GOOD. */
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
    link_drain_socket(sock);
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

        link_refuse_for_now(evicted,
                            "too many agent handshakes in progress (%u%s): the oldest of the "
                            "%s holding the most gives way",
                            vouched ? MAX_VOUCHED_HANDSHAKES : MAX_HANDSHAKES,
                            vouched ? " of processes root vouched for" : "",
                            vouched ? "process" : "uid");
    }
    /* Enough for a few batches; more waits in the link's queue.  Without
     * it, the kernel's default: the link's queue holds more. */
    if (setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf)) < 0) {
        g_debug("agent socket of process %d: SO_SNDBUF: %s", cred.pid, g_strerror(errno));
    }
    link_new(srv, sock, &cred, pidfd, proc_dir, vouched);
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

/* While the scanner sleeps between batches its agents' answers wait in
 * their sockets, and wake pagefoldd only with it: most would each wake it
 * once more.  A peer that sends while it rests is read then; one that
 * hangs up is seen then too. */
static void
srv_resting(PfScanner *s, gboolean resting, gpointer user)
{
    PfLinkServer *srv = user;
    GHashTableIter it;
    gpointer link;

    srv->quiet = resting;
    g_hash_table_iter_init(&it, srv->running);
    while (g_hash_table_iter_next(&it, NULL, &link)) {
        link_resume(link);
    }
}

static const PfScanEvents srv_events = {
    .vm_gone = srv_vm_gone,
    .chunk = srv_chunk,
    .resting = srv_resting,
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
    srv->watch = pf_fd_add(srv->fd, G_IO_IN, listen_cb, srv);
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
