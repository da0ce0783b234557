/*
 * proto.c - the agent wire format's framing: sending a message with its
 * descriptors, and receiving one, refused whole unless its header, its
 * payload field by field and its descriptor count all fit its type.
 * Never hands a caller a message it has not checked, and never leaks a
 * descriptor that a refused message carried.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
/*
 * The library's messages, in the VMM's log too (QEMU routes this domain to
 * its own).
 */
#ifndef G_LOG_DOMAIN
#define G_LOG_DOMAIN "pagefold"
#endif

#include "proto.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util.h"

typedef struct {
    guint32 n;
    guint32 reserved; /* 0, checked */
} ListHeader;

static gboolean
fail(GError **error, const char *fmt, ...) G_GNUC_PRINTF(2, 3);

static gboolean
fail(GError **error, const char *fmt, ...)
{
    va_list ap;
    g_autofree char *text = NULL;

    va_start(ap, fmt);
    text = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                "bad agent message: %s", text);
    return FALSE;
}

void
pf_wire_set_string(char *field, gsize size, const char *text)
{
    memset(field, 0, size);
    if (text != NULL) {
        g_strlcpy(field, text, size);
    }
}

/*
 * One datagram of the n_iov pieces of iov, with n_fds descriptors: the
 * framing's sendmsg(), shared by pf_proto_send() (header and payload
 * apart, so that a payload is never copied) and pf_proto_send_raw().
 */
static gboolean
send_datagram(int sock, struct iovec *iov, gsize n_iov, const int *fds,
              guint n_fds, GError **error)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * PF_PROTO_RAW_MAX_FDS)];
        struct cmsghdr align;
    } control;
    struct msghdr mh = { .msg_iov = iov, .msg_iovlen = n_iov };
    ssize_t n;

    g_return_val_if_fail(n_fds <= PF_PROTO_RAW_MAX_FDS, FALSE);
    if (n_fds > 0) {
        struct cmsghdr *c;

        memset(&control, 0, sizeof(control));
        mh.msg_control = control.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * n_fds);
        c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * n_fds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * n_fds);
    }
    do {
        n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR,
                    e == EAGAIN ? PF_ERROR_WOULD_BLOCK : PF_ERROR_FAILED,
                    "send: %s", g_strerror(e));
        return FALSE;
    }
    return TRUE;
}

gboolean
pf_proto_send(int sock, PfMsgType type, guint32 seq, const void *payload,
              gsize length, const int *fds, guint n_fds, GError **error)
{
    PfMsgHeader h = { PF_PROTO_MAGIC, (guint16)type, 0, (guint32)length, seq };
    struct iovec iov[2] = {
        { &h, sizeof(h) },
        { (void *)payload, length },
    };

    g_return_val_if_fail(length <= PF_PROTO_MAX_PAYLOAD &&
                         n_fds <= PF_PROTO_MAX_FDS, FALSE);
    return send_datagram(sock, iov, length ? 2 : 1, fds, n_fds, error);
}

gboolean
pf_proto_send_raw(int sock, const void *data, gsize length, const int *fds,
                  guint n_fds, GError **error)
{
    struct iovec iov = { (void *)data, length };

    return send_datagram(sock, &iov, 1, fds, n_fds, error);
}

void
pf_msg_close_fds(PfMsg *msg)
{
    for (guint i = 0; i < msg->n_fds; i++) {
        if (msg->fds[i] >= 0) {
            close(msg->fds[i]);
        }
    }
    msg->n_fds = 0;
}

static gboolean
string_ok(const char *field, gsize size, gboolean may_be_empty)
{
    gsize len = strnlen(field, size);

    return len < size && (may_be_empty || len > 0) &&
           g_utf8_validate(field, (gssize)len, NULL);
}

/*
 * One check per message type, of its payload's size and fields; the
 * number of descriptors it may carry is the table's (validate()).
 */
typedef gboolean (*TypeCheck)(const PfMsg *msg, const char *what,
                              GError **error);

static gboolean
check_hello(const PfMsg *msg, const char *what, GError **error)
{
    const PfWireHello *p = (const void *)msg->payload;

    if (msg->header.length != sizeof(*p)) {
        return fail(error, "HELLO of %u bytes", msg->header.length);
    }
    if (p->version < PF_PROTO_VERSION_MIN) {
        return fail(error, "protocol version %u, this side speaks %u to %u",
                    p->version, PF_PROTO_VERSION_MIN, PF_PROTO_VERSION);
    }
    if (!string_ok(p->name, sizeof(p->name), FALSE)) {
        return fail(error, "HELLO name is not a terminated UTF-8 string");
    }
    /* No region: RAM that cannot be merged, attached to say why. */
    if (p->n_regions > 256) {
        return fail(error, "HELLO announces %u regions", p->n_regions);
    }
    return TRUE;
}

static gboolean
check_region(const PfMsg *msg, const char *what, GError **error)
{
    const PfWireRegion *p = (const void *)msg->payload;

    if (msg->header.length != sizeof(*p)) {
        return fail(error, "REGION of %u bytes", msg->header.length);
    }
    if (p->page_size != PF_PAGE_SIZE) {
        return fail(error, "REGION page size %u (only %u is supported)",
                    p->page_size, PF_PAGE_SIZE);
    }
    if (p->size == 0 || p->size % PF_PAGE_SIZE ||
        p->host_addr % PF_PAGE_SIZE || p->offset % PF_PAGE_SIZE ||
        p->size > (1ull << 46)) {
        return fail(error, "REGION size, address or offset not "
                    "page-aligned or too large");
    }
    if (!string_ok(p->name, sizeof(p->name), FALSE)) {
        return fail(error, "REGION name is not a terminated UTF-8 string");
    }
    return TRUE;
}

/* WELCOME, READY and ADVISE; only ADVISE must say why. */
static gboolean
check_mode(const PfMsg *msg, const char *what, GError **error)
{
    const PfWireMode *p = (const void *)msg->payload;
    gboolean advise = msg->header.type == PF_MSG_ADVISE;

    if (msg->header.length != sizeof(*p)) {
        return fail(error, "%s of %u bytes", what, msg->header.length);
    }
    if (p->version < PF_PROTO_VERSION_MIN || p->version > PF_PROTO_VERSION) {
        return fail(error, "%s of protocol version %u", what, p->version);
    }
    if (p->mode != PF_MODE_ADVISE && p->mode != PF_MODE_MERGE) {
        return fail(error, "%s mode %u", what, p->mode);
    }
    if (!string_ok(p->reason, sizeof(p->reason), !advise)) {
        return fail(error, "%s reason is %s", what,
                    advise ? "empty, or not a terminated UTF-8 string"
                           : "not a terminated UTF-8 string");
    }
    if (advise && p->mode != PF_MODE_ADVISE) {
        return fail(error, "ADVISE of mode %u", p->mode);
    }
    return TRUE;
}

/* POOL and DROP. */
static gboolean
check_pool(const PfMsg *msg, const char *what, GError **error)
{
    const PfWirePool *p = (const void *)msg->payload;
    guint32 length = msg->header.length;

    if (length != sizeof(*p) || p->n_slots == 0 ||
        p->n_slots > (1u << 24) || p->chunk >= PF_PROTO_MAX_CHUNKS) {
        return fail(error, "%s of %u bytes, or of chunk %u of %u slots",
                    what, length,
                    length == sizeof(*p) ? p->chunk : 0,
                    length == sizeof(*p) ? p->n_slots : 0);
    }
    return TRUE;
}

/* A range of a region's pages no region can hold, or with flags beyond
 * allowed (0 keeps the others for a later version). */
static gboolean
range_impossible(const PfWireRange *p, guint32 allowed)
{
    return (p->flags & ~allowed) != 0 || p->n_pages == 0 || p->page >= (1ull << 34) ||
           p->n_pages > (1ull << 34);
}

/* DISCARD and GONE; GONE is of a whole region, from page 0. */
static gboolean
check_range(const PfMsg *msg, const char *what, GError **error)
{
    const PfWireRange *p = (const void *)msg->payload;

    if (msg->header.length != sizeof(*p) ||
        range_impossible(p, msg->header.type == PF_MSG_DISCARD ? PF_RANGE_BACKEND : 0) ||
        (msg->header.type == PF_MSG_GONE && p->page != 0)) {
        return fail(error,
                    "%s of %u bytes, of an empty or impossible range, or "
                    "with unknown flags", what, msg->header.length);
    }
    return TRUE;
}

/* One entry of a list, the i-th. */
typedef gboolean (*EntryCheck)(const void *entry, guint32 i, GError **error);

static gboolean
item_ok(const void *entry, guint32 i, GError **error)
{
    const PfWireItem *item = entry;

    if (item->kind < PF_ITEM_MERGE || item->kind > PF_ITEM_COLLAPSE) {
        return fail(error, "REQUEST item %u has kind %u", i, item->kind);
    }
    return TRUE;
}

static gboolean
result_ok(const void *entry, guint32 i, GError **error)
{
    const PfWireResult *result = entry;

    if (result->status > PF_RESULT_ERROR) {
        return fail(error, "RESULT %u has status %u", i, result->status);
    }
    return TRUE;
}

static gboolean
hint_ok(const void *entry, guint32 i, GError **error)
{
    if (range_impossible(entry, 0)) {
        return fail(error, "HINT range %u is empty or impossible, or has "
                    "flags set", i);
    }
    return TRUE;
}

/*
 * REQUEST, RESULT and HINT: a list header (reserved 0), then exactly its n
 * entries of each bytes, at least one and at most PF_PROTO_MAX_ITEMS, each
 * of them right.
 */
static gboolean
check_list(const PfMsg *msg, const char *what, gsize each, EntryCheck ok,
           GError **error)
{
    const ListHeader *l = (const void *)msg->payload;
    guint32 length = msg->header.length;

    if (length < sizeof(*l) || (length - sizeof(*l)) % each != 0 ||
        l->n != (length - sizeof(*l)) / each || l->n == 0 ||
        l->n > PF_PROTO_MAX_ITEMS) {
        return fail(error, "%s of %u bytes does not hold its %u entries",
                    what, length, length >= sizeof(*l) ? l->n : 0);
    }
    if (l->reserved != 0) {
        return fail(error, "%s with reserved set", what);
    }
    for (guint32 i = 0; i < l->n; i++) {
        if (!ok(msg->payload + sizeof(*l) + i * each, i, error)) {
            return FALSE;
        }
    }
    return TRUE;
}

static gboolean
check_request(const PfMsg *msg, const char *what, GError **error)
{
    return check_list(msg, what, sizeof(PfWireItem), item_ok, error);
}

static gboolean
check_result(const PfMsg *msg, const char *what, GError **error)
{
    return check_list(msg, what, sizeof(PfWireResult), result_ok, error);
}

static gboolean
check_hint(const PfMsg *msg, const char *what, GError **error)
{
    return check_list(msg, what, sizeof(PfWireRange), hint_ok, error);
}

static gboolean
check_error(const PfMsg *msg, const char *what, GError **error)
{
    if (msg->header.length == 0 || msg->header.length > 1024) {
        return fail(error, "ERROR of %u bytes", msg->header.length);
    }
    return TRUE;
}

static const struct {
    const char *name;
    TypeCheck check;
    guint fds_min;
    guint fds_max;
} types[PF_MSG_LAST + 1] = {
    [PF_MSG_HELLO] = { "HELLO", check_hello, 0, 0 },
    [PF_MSG_REGION] = { "REGION", check_region, 1, 1 },
    /* Maybe a /dev/userfaultfd descriptor. */
    [PF_MSG_WELCOME] = { "WELCOME", check_mode, 0, 1 },
    [PF_MSG_READY] = { "READY", check_mode, 0, 0 },
    [PF_MSG_POOL] = { "POOL", check_pool, 1, 1 },
    [PF_MSG_REQUEST] = { "REQUEST", check_request, 0, 0 },
    [PF_MSG_RESULT] = { "RESULT", check_result, 0, 0 },
    [PF_MSG_ERROR] = { "ERROR", check_error, 0, 0 },
    [PF_MSG_ADVISE] = { "ADVISE", check_mode, 0, 0 },
    [PF_MSG_DISCARD] = { "DISCARD", check_range, 0, 0 },
    [PF_MSG_DROP] = { "DROP", check_pool, 0, 0 },
    [PF_MSG_GONE] = { "GONE", check_range, 0, 0 },
    [PF_MSG_HINT] = { "HINT", check_hint, 0, 0 },
};

static gboolean
validate(const PfMsg *msg, GError **error)
{
    const PfMsgHeader *h = &msg->header;

    if (h->type >= G_N_ELEMENTS(types) || types[h->type].check == NULL) {
        return fail(error, "unknown type %u", h->type);
    }
    if (!types[h->type].check(msg, types[h->type].name, error)) {
        return FALSE;
    }
    if (msg->n_fds < types[h->type].fds_min ||
        msg->n_fds > types[h->type].fds_max) {
        return fail(error, "type %u carries %u file descriptors", h->type,
                    msg->n_fds);
    }
    return TRUE;
}

gboolean
pf_proto_recv(int sock, PfMsg *msg, GError **error)
{
    struct iovec iov[2] = {
        { &msg->header, sizeof(msg->header) },
        { msg->payload, sizeof(msg->payload) },
    };
    union {
        char buf[CMSG_SPACE(sizeof(int) * PF_PROTO_MAX_FDS)];
        struct cmsghdr align;
    } control;
    struct msghdr mh = {
        .msg_iov = iov, .msg_iovlen = 2,
        .msg_control = control.buf, .msg_controllen = sizeof(control.buf),
    };
    ssize_t n;

    msg->n_fds = 0;
    do {
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        int e = errno;

        g_set_error(error, PF_ERROR,
                    e == EAGAIN ? PF_ERROR_WOULD_BLOCK : PF_ERROR_FAILED,
                    "receive: %s", g_strerror(e));
        return FALSE;
    }
    /* Take every descriptor first, so a refused message leaks none. */
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL;
         c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            gsize k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

            for (gsize i = 0; i < k; i++) {
                int fd;

                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (msg->n_fds < PF_PROTO_MAX_FDS) {
                    msg->fds[msg->n_fds++] = fd;
                } else {
                    close(fd);
                }
            }
        }
    }
    if (n == 0) {
        pf_msg_close_fds(msg);
        g_set_error(error, PF_ERROR, PF_ERROR_CLOSED,
                    "peer closed the connection");
        return FALSE;
    }
    if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        pf_msg_close_fds(msg);
        return fail(error, "message larger than %zu bytes or with too many "
                    "descriptors", sizeof(msg->header) + sizeof(msg->payload));

    }
    if ((gsize)n < sizeof(msg->header) || msg->header.magic != PF_PROTO_MAGIC ||
        msg->header.flags != 0 ||
        msg->header.length != (gsize)n - sizeof(msg->header)) {
        pf_msg_close_fds(msg);
        return fail(error, "%zd bytes without a valid header", n);
    }
    if (!validate(msg, error)) {
        pf_msg_close_fds(msg);
        return FALSE;
    }
    return TRUE;
}

const PfWireHello *
pf_msg_hello(const PfMsg *msg)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_HELLO, NULL);
    return (const void *)msg->payload;
}

const PfWireRegion *
pf_msg_region(const PfMsg *msg)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_REGION, NULL);
    return (const void *)msg->payload;
}

const PfWireMode *
pf_msg_mode(const PfMsg *msg)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_WELCOME ||
                         msg->header.type == PF_MSG_READY ||
                         msg->header.type == PF_MSG_ADVISE, NULL);
    return (const void *)msg->payload;
}

const PfWireRange *
pf_msg_range(const PfMsg *msg)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_DISCARD ||
                         msg->header.type == PF_MSG_GONE, NULL);
    return (const void *)msg->payload;
}

const PfWirePool *
pf_msg_pool(const PfMsg *msg)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_POOL ||
                         msg->header.type == PF_MSG_DROP, NULL);
    return (const void *)msg->payload;
}

const PfWireItem *
pf_msg_items(const PfMsg *msg, guint32 *n_items)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_REQUEST, NULL);
    *n_items = ((const ListHeader *)msg->payload)->n;
    return (const void *)(msg->payload + sizeof(ListHeader));
}

const PfWireResult *
pf_msg_results(const PfMsg *msg, guint32 *n_results)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_RESULT, NULL);
    *n_results = ((const ListHeader *)msg->payload)->n;
    return (const void *)(msg->payload + sizeof(ListHeader));
}

const PfWireRange *
pf_msg_hints(const PfMsg *msg, guint32 *n_ranges)
{
    g_return_val_if_fail(msg->header.type == PF_MSG_HINT, NULL);
    *n_ranges = ((const ListHeader *)msg->payload)->n;
    return (const void *)(msg->payload + sizeof(ListHeader));
}

static gboolean
send_list(int sock, PfMsgType type, guint32 seq, const void *entries,
          gsize each, guint32 n, GError **error)
{
    g_autofree guint8 *buf = NULL;
    ListHeader l = { n, 0 };
    gsize len = sizeof(l) + each * n;

    g_return_val_if_fail(n > 0 && n <= PF_PROTO_MAX_ITEMS, FALSE);
    buf = g_malloc(len);
    memcpy(buf, &l, sizeof(l));
    memcpy(buf + sizeof(l), entries, each * n);
    return pf_proto_send(sock, type, seq, buf, len, NULL, 0, error);
}

gboolean
pf_proto_send_items(int sock, guint32 seq, const PfWireItem *items, guint32 n,
                    GError **error)
{
    return send_list(sock, PF_MSG_REQUEST, seq, items, sizeof(*items), n,
                     error);
}

gboolean
pf_proto_send_results(int sock, guint32 seq, const PfWireResult *results,
                      guint32 n, GError **error)
{
    return send_list(sock, PF_MSG_RESULT, seq, results, sizeof(*results), n,
                     error);
}

gboolean
pf_proto_send_hints(int sock, const PfWireRange *ranges, guint32 n,
                    GError **error)
{
    return send_list(sock, PF_MSG_HINT, 0, ranges, sizeof(*ranges), n, error);
}
