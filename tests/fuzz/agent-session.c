/*
 * agent-session.c - fuzzes whole agent sessions against the real pagefoldd
 * core: a PfScanner and its link server on a real socket, with three VMs
 * whose agents the fuzzer plays, honestly or not.  Each VM is a child
 * process that holds its guest RAM (a sealed memfd, mapped shared and
 * registered for userfaultfd write protection, as QEMU's) and connects the
 * sessions, so that pagefoldd sees three processes; the fuzzer writes
 * their guest pages, runs scans, and speaks for their agents: handshakes,
 * answers true or false, out of order or malformed, DISCARD, GONE, ADVISE,
 * RAM plugged in after READY, garbage, hang-ups and reconnections.
 *
 * Input: a list of operations, one byte each plus its arguments (see
 * step()); the seed corpus is tests/fuzz/corpus/agent-session/.
 *
 * Checks, beyond ASan/UBSan and the daemon's own assertions, after every
 * operation, from what each agent was sent:
 *   - who holds which chunk: a POOL names a chunk its VM does not hold, a
 *     DROP one it does, and a REQUEST names only chunks it holds and pages
 *     of regions it announced;
 *   - who may read which slot: every page of every chunk a VM holds is
 *     zero or a content that VM's own guest RAM held at some time (a chunk
 *     reaching a VM with another VM's page in it is finding 1 of issue 20:
 *     ids reused); all start with content 1, and 7 more are written;
 * and, at the end of each input, no descriptor leaked.
 */
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <linux/falloc.h>
#include <linux/userfaultfd.h>

#include "fuzz-common.h"
#include "link-server.h"
#include "pool.h"
#include "proto.h"
#include "scan-helpers.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define N_PEERS 3
#define GUEST_PAGES 32 /* two regions of 16 */
#define REGION_PAGES 16
#define N_CONTENTS 8   /* 0 is the zero page */

typedef struct {
    guint32 seq;
    guint32 n;
    PfWireItem *items;
} Due;

typedef struct {
    int child;        /* its process: holds the RAM, connects */
    int ctl;          /* to the child */
    int memfd;
    guint8 *mem;      /* mapped at the same address in the child */
    /* per input */
    int fd;           /* the session, or -1 */
    gboolean welcomed;
    guint32 version;  /* the protocol its HELLO said */
    guint n_regions;  /* announced */
    guint32 ever_had; /* contents its RAM held: bit c */
    GHashTable *held; /* chunk id -> Held* */
    GQueue due;       /* Due*, requests not answered, oldest first */
} Peer;

typedef struct {
    int fd;
    guint32 n_slots;
} Held;

static char *sock_path;
static Peer peers[N_PEERS];
static PfScanner *scanner;
static PfLinkServer *server;
static PfMsg *msg;

static void
fail(const char *what, const Peer *p)
{
    fprintf(stderr, "fuzz: VM %d: %s\n", p != NULL ? (int)(p - peers) : -1, what);
    abort();
}

static void
content(guint8 *page, guint c)
{
    memset(page, c == 0 ? 0 : (int)(c * 37 + 1), PF_PAGE_SIZE);
}

/* The content id of a page, or -1 if it is none of them. */
static int
content_of(const guint8 *page)
{
    static guint8 want[N_CONTENTS][PF_PAGE_SIZE];
    static gboolean made;

    if (!made) {
        for (guint c = 0; c < N_CONTENTS; c++) {
            content(want[c], c);
        }
        made = TRUE;
    }
    for (guint c = 0; c < N_CONTENTS; c++) {
        if (page[0] == want[c][0] && memcmp(page, want[c], PF_PAGE_SIZE) == 0) {
            return (int)c;
        }
    }
    return -1;
}

/* ---- the children: a VMM's process, as pagefoldd sees it ---- */

static void
child_main(int ctl, guint8 *mem)
{
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM };
    struct uffdio_register reg = {
        .range = { (guint64)(guintptr)mem, GUEST_PAGES * PF_PAGE_SIZE },
        .mode = UFFDIO_REGISTER_MODE_WP,
    };
    int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };

    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) < 0 || ioctl(uffd, UFFDIO_REGISTER, &reg) < 0) {
        _exit(1);
    }
    g_strlcpy(addr.sun_path, sock_path, sizeof(addr.sun_path));
    for (;;) {
        char ok = 0, buf[1];
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } control;
        struct iovec iov = { buf, 1 };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof(control.buf) };
        struct cmsghdr *c;
        int fd;

        if (recvmsg(ctl, &mh, 0) <= 0) {
            _exit(0);
        }
        c = CMSG_FIRSTHDR(&mh);
        if (c == NULL || c->cmsg_type != SCM_RIGHTS) {
            _exit(1);
        }
        memcpy(&fd, CMSG_DATA(c), sizeof(fd));
        ok = connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0;
        close(fd);
        if (write(ctl, &ok, 1) != 1) {
            _exit(1);
        }
    }
}

static void
peers_init(void)
{
    g_autofree char *dir = g_dir_make_tmp("pagefold-fuzz-XXXXXX", NULL);

    if (dir == NULL) {
        abort();
    }
    sock_path = g_build_filename(dir, "agent.sock", NULL);
    for (guint i = 0; i < N_PEERS; i++) {
        Peer *p = &peers[i];
        int sv[2];

        p->memfd = memfd_create("guest", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (p->memfd < 0 || ftruncate(p->memfd, GUEST_PAGES * PF_PAGE_SIZE) < 0 ||
            fcntl(p->memfd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0) {
            abort();
        }
        p->mem = mmap(NULL, GUEST_PAGES * PF_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED,
                      p->memfd, 0);
        if (p->mem == MAP_FAILED || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv)) {
            abort();
        }
        p->child = fork();
        if (p->child < 0) {
            abort();
        }
        if (p->child == 0) {
            close(sv[0]);
            child_main(sv[1], p->mem);
        }
        close(sv[1]);
        p->ctl = sv[0];
        p->fd = -1;
        p->held = g_hash_table_new(NULL, NULL);
        g_queue_init(&p->due);
    }
}

/* A socket connected to pagefoldd by p's child: pagefoldd sees its pid. */
static int
peer_connect(Peer *p)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    char b = 0;

    if (fd < 0 || !pf_proto_send_raw(p->ctl, &b, 1, &fd, 1, NULL)) {
        abort();
    }
    /* pagefoldd accepts on its main loop, which is ours. */
    for (;;) {
        struct pollfd pf = { p->ctl, POLLIN, 0 };

        g_main_context_iteration(NULL, FALSE);
        if (poll(&pf, 1, 1) == 1) {
            break;
        }
    }
    if (read(p->ctl, &b, 1) != 1) {
        abort();
    }
    if (!b) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- what pagefoldd sent, checked ---- */

static void
held_free(gpointer data)
{
    Held *h = data;

    if (h->fd >= 0) {
        close(h->fd);
    }
    g_free(h);
}

static void
due_free(gpointer data)
{
    Due *d = data;

    g_free(d->items);
    g_free(d);
}

static void
session_end(Peer *p)
{
    GHashTableIter it;
    gpointer v;

    if (p->fd >= 0) {
        close(p->fd);
        p->fd = -1;
    }
    g_hash_table_iter_init(&it, p->held);
    while (g_hash_table_iter_next(&it, NULL, &v)) {
        held_free(v);
    }
    g_hash_table_remove_all(p->held);
    g_queue_clear_full(&p->due, due_free);
    p->welcomed = FALSE;
    p->n_regions = 0;
}

/* Every page of every chunk p holds is zero or a content p's RAM had. */
static void
check_slots(Peer *p)
{
    GHashTableIter it;
    gpointer v;

    g_hash_table_iter_init(&it, p->held);
    while (g_hash_table_iter_next(&it, NULL, &v)) {
        Held *h = v;
        gsize len = (gsize)h->n_slots * PF_PAGE_SIZE;
        guint8 *map;

        if (h->fd < 0) {
            continue; /* let go of: it reads nothing of it now */
        }
        map = mmap(NULL, len, PROT_READ, MAP_SHARED, h->fd, 0);

        if (map == MAP_FAILED) {
            fail("a pool chunk it holds cannot be mapped", p);
        }
        for (guint32 k = 0; k < h->n_slots; k++) {
            int c = content_of(map + (gsize)k * PF_PAGE_SIZE);

            if (c < 0 || (c > 0 && !(p->ever_had & (1u << c)))) {
                fprintf(stderr, "fuzz: slot %u holds content %d, which its RAM never held\n",
                        k, c);
                fail("it can read a page that is not its own", p);
            }
        }
        munmap(map, len);
    }
}

static void
got_pool(Peer *p)
{
    const PfWirePool *w = pf_msg_pool(msg);
    Held *h;

    if (msg->n_fds != 1 || w->n_slots == 0 || w->n_slots > PF_POOL_CHUNK_SLOTS) {
        fail("a POOL without one chunk", p);
    }
    if (g_hash_table_contains(p->held, GUINT_TO_POINTER(w->chunk))) {
        fail("a POOL for a chunk it holds", p);
    }
    h = g_new0(Held, 1);
    h->fd = msg->fds[0];
    h->n_slots = w->n_slots;
    msg->n_fds = 0;
    g_hash_table_insert(p->held, GUINT_TO_POINTER(w->chunk), h);
}

static void
got_request(Peer *p)
{
    guint32 n;
    const PfWireItem *items = pf_msg_items(msg, &n);
    Due *d = g_new0(Due, 1);

    for (guint32 i = 0; i < n; i++) {
        const PfWireItem *it = &items[i];

        if (it->region >= p->n_regions || it->page >= REGION_PAGES) {
            fail("a request for a page it never announced", p);
        }
        if ((it->kind == PF_ITEM_MERGE || it->kind == PF_ITEM_ZERO ||
             it->kind == PF_ITEM_UNMERGE) &&
            !g_hash_table_contains(p->held, GUINT_TO_POINTER(it->chunk))) {
            fail("a request naming a chunk it does not hold", p);
        }
    }
    d->seq = msg->header.seq;
    d->n = n;
    d->items = g_memdup2(items, sizeof(*items) * n);
    g_queue_push_tail(&p->due, d);
}

/* Reads one message pagefoldd sent p, if one waits; FALSE if none. */
static gboolean
receive(Peer *p)
{
    struct pollfd pf = { p->fd, POLLIN, 0 };
    g_autoptr(GError) error = NULL;

    if (p->fd < 0 || poll(&pf, 1, 0) != 1) {
        return FALSE;
    }
    if (!pf_proto_recv(p->fd, msg, &error)) {
        session_end(p); /* pagefoldd hung up */
        return TRUE;
    }
    switch (msg->header.type) {
    case PF_MSG_WELCOME:
        if (pf_msg_mode(msg)->version > p->version) {
            fail("a WELCOME in a protocol newer than the agent's", p);
        }
        p->welcomed = TRUE;
        break;
    case PF_MSG_POOL:
        got_pool(p);
        break;
    case PF_MSG_DROP:
        if (!g_hash_table_contains(p->held, GUINT_TO_POINTER(pf_msg_pool(msg)->chunk))) {
            fail("a DROP for a chunk it does not hold", p);
        }
        held_free(g_hash_table_lookup(p->held, GUINT_TO_POINTER(pf_msg_pool(msg)->chunk)));
        g_hash_table_remove(p->held, GUINT_TO_POINTER(pf_msg_pool(msg)->chunk));
        break;
    case PF_MSG_REQUEST:
        got_request(p);
        break;
    case PF_MSG_ERROR:
        break; /* the hang-up follows */
    default:
        fail("a message pagefoldd never sends", p);
    }
    pf_msg_close_fds(msg);
    return TRUE;
}

/* Runs pagefoldd's main loop and reads what it sent until both are idle,
 * waiting up to ms for its threads (a handshake's /proc reads). */
static void
pump(int ms)
{
    gint64 end = g_get_monotonic_time() + ms * 1000;

    for (;;) {
        gboolean any = FALSE;

        while (g_main_context_iteration(NULL, FALSE)) {
            any = TRUE;
        }
        for (guint i = 0; i < N_PEERS; i++) {
            while (receive(&peers[i])) {
                any = TRUE;
            }
        }
        if (!any) {
            if (g_get_monotonic_time() >= end) {
                break;
            }
            g_usleep(200);
        }
    }
}

/* ---- the agents' side ---- */

static void
send_msg(Peer *p, PfMsgType type, guint32 seq, const void *payload, gsize len, const int *fds,
         guint n_fds)
{
    if (p->fd >= 0 && !pf_proto_send(p->fd, type, seq, payload, len, fds, n_fds, NULL)) {
        session_end(p);
    }
}

static void
send_region(Peer *p, guint index)
{
    PfWireRegion r = { 0 };

    r.index = index;
    r.page_size = PF_PAGE_SIZE;
    r.host_addr = (guint64)(guintptr)(p->mem + (gsize)index * REGION_PAGES * PF_PAGE_SIZE);
    r.offset = (guint64)index * REGION_PAGES * PF_PAGE_SIZE;
    r.size = REGION_PAGES * PF_PAGE_SIZE;
    pf_wire_set_string(r.name, sizeof(r.name), index == 0 ? "pc.ram" : "mem1");
    send_msg(p, PF_MSG_REGION, 0, &r, sizeof(r), &p->memfd, 1);
    p->n_regions = MAX(p->n_regions, index + 1);
}

/* Connects, says HELLO with one or two regions in this protocol or the
 * oldest pagefoldd speaks (whose links take no HINT), and READY in merge
 * mode or advise once WELCOME came. */
static void
handshake(Peer *p, guint8 how)
{
    PfWireHello h = { 0 };
    PfWireMode m = { 0, (how & 2) ? PF_MODE_ADVISE : PF_MODE_MERGE, "" };
    guint n = 1 + (how & 1);

    session_end(p);
    p->fd = peer_connect(p);
    if (p->fd < 0) {
        return;
    }
    h.version = m.version = p->version = (how & 4) ? PF_PROTO_VERSION_MIN : PF_PROTO_VERSION;
    h.pid = (guint32)p->child;
    h.n_regions = n;
    pf_wire_set_string(h.name, sizeof(h.name), "fuzz");
    send_msg(p, PF_MSG_HELLO, 0, &h, sizeof(h), NULL, 0);
    for (guint i = 0; i < n; i++) {
        send_region(p, i);
    }
    for (int i = 0; i < 5000 && p->fd >= 0 && !p->welcomed; i++) {
        pump(1);
    }
    if (p->welcomed) {
        send_msg(p, PF_MSG_READY, 0, &m, sizeof(m), NULL, 0);
    }
}

/* The agent's answer to its oldest request: honest (compared, punched),
 * or a lie of one kind or another. */
static void
answer(Peer *p, guint8 how)
{
    Due *d = g_queue_pop_head(&p->due);
    g_autofree PfWireResult *res = NULL;
    guint32 n;

    if (d == NULL) {
        return;
    }
    n = d->n;
    res = g_new0(PfWireResult, n + 1);
    for (guint32 i = 0; i < n; i++) {
        const PfWireItem *it = &d->items[i];
        guint8 *page = p->mem + ((gsize)it->region * REGION_PAGES + it->page) * PF_PAGE_SIZE;
        Held *h = g_hash_table_lookup(p->held, GUINT_TO_POINTER(it->chunk));
        gboolean equal = FALSE;

        if (h != NULL && h->fd >= 0 && it->slot < h->n_slots && it->kind != PF_ITEM_COLLAPSE) {
            guint8 slot[PF_PAGE_SIZE];

            equal = pread(h->fd, slot, sizeof(slot), (off_t)it->slot * PF_PAGE_SIZE) ==
                        sizeof(slot) &&
                    memcmp(slot, page, PF_PAGE_SIZE) == 0;
        }
        switch (how & 7) {
        case 0: /* honest */
            res[i].status = equal || it->kind == PF_ITEM_COLLAPSE ? PF_RESULT_DONE
                                                                 : PF_RESULT_CHANGED;
            if (equal && it->kind != PF_ITEM_UNMERGE &&
                fallocate(p->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                          (off_t)((gsize)page - (gsize)p->mem), PF_PAGE_SIZE) < 0) {
                abort();
            }
            break;
        case 1:
            res[i].status = PF_RESULT_CHANGED;
            break;
        case 2:
            res[i].status = PF_RESULT_DONE;
            break;
        case 3:
            res[i].status = PF_RESULT_ERROR;
            res[i].err = (how >> 3) - 16;
            break;
        default:
            res[i].status = (guint8)((how >> (i % 5)) % 4);
            break;
        }
    }
    if (p->fd >= 0) {
        /* A count or number that is not the oldest request's. */
        guint32 seq = d->seq + ((how & 0xf8) == 0xf8);
        guint32 count = n + ((how & 0xf8) == 0xf0);

        if (!pf_proto_send_results(p->fd, seq, res, count, NULL)) {
            session_end(p);
        }
    }
    due_free(d);
}

/* ---- one input ---- */

static void
write_page(Peer *p, guint page, guint c)
{
    guint8 buf[PF_PAGE_SIZE];

    content(buf, c);
    if (pwrite(p->memfd, buf, sizeof(buf), (off_t)page * PF_PAGE_SIZE) != sizeof(buf)) {
        abort();
    }
    p->ever_had |= 1u << c;
}

/* Reads one byte of the input; 0 past its end. */
static guint8
next(const uint8_t **data, size_t *size)
{
    guint8 b = 0;

    if (*size > 0) {
        b = **data;
        (*data)++;
        (*size)--;
    }
    return b;
}

static void
step(const uint8_t **data, size_t *size)
{
    guint8 op = next(data, size);
    Peer *p = &peers[(op >> 4) % N_PEERS];
    guint8 a = next(data, size);

    switch (op & 15) {
    case 0:
        handshake(p, a);
        break;
    case 1: /* the guest writes a page */
    case 2:
        write_page(p, a % GUEST_PAGES, (a >> 5) % N_CONTENTS);
        break;
    case 3: /* a scan, looks at the VMs' processes waited for */
        pf_test_scan(scanner, (gsize)a + 1);
        break;
    case 4: { /* one slice of the background scan, or of root's scan-now:
               * joins made a slice at a time, VMs left for later */
        gboolean progress;

        pf_scanner_scan_slice(scanner, (gsize)a * 4 + 1, 100 + (a & 0x70) * 20, a >> 7,
                              &progress);
        break;
    }
    case 5:
    case 6:
        answer(p, a);
        break;
    case 7: { /* DISCARD: the balloon took pages */
        PfWireRange r = { a & 1, 0, (a >> 1) % REGION_PAGES, next(data, size) % 20 };

        if (fallocate(p->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      (off_t)(((gsize)r.region * REGION_PAGES + r.page) * PF_PAGE_SIZE),
                      (off_t)(MIN(r.n_pages, REGION_PAGES - r.page) * PF_PAGE_SIZE)) < 0 &&
            r.n_pages > 0 && r.page < REGION_PAGES) {
            abort();
        }
        send_msg(p, PF_MSG_DISCARD, 0, &r, sizeof(r), NULL, 0);
        break;
    }
    case 8: { /* GONE: RAM unplugged */
        PfWireRange r = { a % 3, 0, 0, REGION_PAGES + (a >> 7) };

        send_msg(p, PF_MSG_GONE, 0, &r, sizeof(r), NULL, 0);
        break;
    }
    case 9: { /* ADVISE: the VM steps back */
        PfWireMode m = { p->version, PF_MODE_ADVISE, "fuzz" };

        send_msg(p, PF_MSG_ADVISE, 0, &m, sizeof(m), NULL, 0);
        break;
    }
    case 10: /* RAM plugged in after READY */
        if (p->fd >= 0) {
            send_region(p, 1 + (a & 1));
        }
        break;
    case 11: /* the agent hangs up */
        session_end(p);
        break;
    case 12: { /* any datagram */
        guint8 raw[64];
        gsize len = MIN((gsize)a % sizeof(raw), *size);

        memcpy(raw, *data, len);
        *data += len;
        *size -= len;
        if (p->fd >= 0 && send(p->fd, raw, len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            session_end(p);
        }
        break;
    }
    case 13: { /* the agent lets go of a chunk it was not told to: pagefoldd
                * still takes it as held, and may name it */
        GHashTableIter it;
        gpointer k, v;

        g_hash_table_iter_init(&it, p->held);
        if (g_hash_table_iter_next(&it, &k, &v) && (a & 1) && ((Held *)v)->fd >= 0) {
            close(((Held *)v)->fd);
            ((Held *)v)->fd = -1;
        }
        break;
    }
    case 14: { /* HINT: a disk read wrote pages (or the agent says so) */
        PfWireRange r = { a & 1, 0, (a >> 1) % (REGION_PAGES + 4), 1 + next(data, size) % 40 };

        if (p->fd >= 0 && !pf_proto_send_hints(p->fd, &r, 1, NULL)) {
            session_end(p);
        }
        break;
    }
    default:
        pump(a % 8);
        break;
    }
    pump(0);
    for (guint i = 0; i < N_PEERS; i++) {
        check_slots(&peers[i]);
    }
}

static int session(const uint8_t *data, size_t size, gboolean check);

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (msg == NULL) {
        fuzz_quiet_logs();
        msg = g_new0(PfMsg, 1);
        peers_init();
        /* What GLib opens once (the wake-ups of the main context and of
         * the worker that runs GTask's threads) is not a session's. */
        static const uint8_t warm_up[] = { 0x00, 0x00 };

        session(warm_up, sizeof(warm_up), FALSE);
    }
    return session(data, size, TRUE);
}

static int
session(const uint8_t *data, size_t size, gboolean check)
{
    g_autoptr(GError) error = NULL;
    int fds = fuzz_count_fds();

    scanner = pf_scanner_new(NULL);
    (void)unlink(sock_path);
    server = pf_link_server_new(scanner, sock_path, &error);
    if (server == NULL) {
        fprintf(stderr, "fuzz: %s\n", error->message);
        abort();
    }
    for (guint i = 0; i < N_PEERS; i++) {
        /* Every input starts from guest RAM of content 1. */
        peers[i].ever_had = 0;
        for (guint k = 0; k < GUEST_PAGES; k++) {
            write_page(&peers[i], k, 1);
        }
    }
    for (int ops = 0; size > 0 && ops < 400; ops++) {
        step(&data, &size);
    }
    if (g_getenv("FUZZ_SESSION_VERBOSE") != NULL) {
        /* To see how deep the corpus reaches: what the VMs hold at the end. */
        for (guint i = 0; i < N_PEERS; i++) {
            fprintf(stderr, "VM %u: %s, %u chunk(s) held, %u request(s) unanswered\n", i,
                    peers[i].fd >= 0 ? "connected" : "not connected",
                    g_hash_table_size(peers[i].held), g_queue_get_length(&peers[i].due));
        }
        PfCounters total;
        g_autofree PfCounters *per_vm = g_new0(PfCounters, N_PEERS + 1);

        pf_scanner_collect(scanner, &total, per_vm);
        fprintf(stderr, "pages_shared %" G_GUINT64_FORMAT ", pages_sharing %" G_GUINT64_FORMAT
                ", zero_pages %" G_GUINT64_FORMAT ", full_scans %" G_GUINT64_FORMAT "\n",
                total.pages_shared, total.pages_sharing, total.zero_pages, total.full_scans);
    }
    for (guint i = 0; i < N_PEERS; i++) {
        session_end(&peers[i]);
    }
    pump(5);
    g_clear_pointer(&server, pf_link_server_free);
    g_clear_pointer(&scanner, pf_scanner_free);
    /* A handshake's thread may still be closing what it opened. */
    for (int i = 0; i < 1000 && fuzz_count_fds() != fds; i++) {
        pump(1);
    }
    if (check) {
        fuzz_check_fds(fds, "the session");
    }
    return 0;
}
