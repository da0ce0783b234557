/*
 * proto.h - the wire format between pagefoldd and the agent inside each VM
 * process: one message per SOCK_SEQPACKET datagram, a fixed header, a
 * fixed-layout payload per type, file descriptors by SCM_RIGHTS.
 *
 * Owns framing and strict decoding only.  A message that is truncated,
 * oversized, of an unknown type, of the wrong size for its type, or that
 * carries the wrong number of descriptors is refused as a whole, and every
 * descriptor it carried is closed: nothing half-decoded ever reaches a
 * caller.  Both sides are on one host: integers are in host byte order.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#pragma once

#include <glib.h>

#define PF_PROTO_MAGIC 0x31474650u /* "PFG1" */
/*
 * Each side speaks every version from PF_PROTO_VERSION_MIN to
 * PF_PROTO_VERSION.  The agent's HELLO says its newest; pagefoldd's
 * WELCOME says the version of the link, the lower of the two, which READY
 * and ADVISE say again: a pagefoldd upgraded under running VMs keeps
 * their older agents.  2 added HINT, 3 DISCARD's PF_RANGE_BACKEND, 4 the
 * EINPROGRESS answer (below; an older pagefoldd gets EBUSY instead).
 */
#define PF_PROTO_VERSION 4u
#define PF_PROTO_VERSION_MIN 1u
#define PF_PROTO_VERSION_HINT 2u
#define PF_PROTO_VERSION_BACKEND 3u
#define PF_PROTO_VERSION_SETTLING 4u
#define PF_PROTO_MAX_PAYLOAD (64u * 1024u)
#define PF_PROTO_MAX_FDS 4u
#define PF_PROTO_NAME_LEN 64u
#define PF_PROTO_REASON_LEN 128u
#define PF_PROTO_MAX_ITEMS 2048u

typedef enum {
    PF_MSG_HELLO = 1,   /* agent -> daemon: who the VM is */
    /*
     * agent -> daemon: one RAM region + its memfd; after READY too: RAM
     * plugged in at run time (index = regions announced so far, never reused)
     */
    PF_MSG_REGION = 2,
    /*
     * daemon -> agent: the mode it may use, maybe a /dev/userfaultfd fd to
     * make a userfaultfd with
     */
    PF_MSG_WELCOME = 3,
    PF_MSG_READY = 4,   /* agent -> daemon: the mode it will use, and why */
    PF_MSG_POOL = 5,    /* daemon -> agent: a sealed pool chunk memfd */
    PF_MSG_REQUEST = 6, /* daemon -> agent: a batch of items */
    PF_MSG_RESULT = 7,  /* agent -> daemon: one result per item of a batch */
    /*
     * either way: why the sender gives up, then close.  From pagefoldd, seq
     * says whether the agent may connect again (PF_ERROR_TRY_AGAIN)
     */
    PF_MSG_ERROR = 8,
    /*
     * agent -> daemon: advise mode from now on, and why; every page it had
     * remapped is back in its memfd (a device or a migration needs plain RAM)
     */
    PF_MSG_ADVISE = 9,
    /*
     * agent -> daemon: a range of pages mapped from the memfd again because
     * the VMM discards it
     */
    PF_MSG_DISCARD = 10,
    /*
     * daemon -> agent: no page of this VM maps this pool chunk any more: let
     * it go (its memory returns once nobody maps it)
     */
    PF_MSG_DROP = 11,
    /*
     * agent -> daemon: this region left the VM (a DIMM unplugged, merge=off):
     * none of its pages is mapped from the pool any more, its memfd is about
     * to be freed; forget it.  In a handshake, in a REGION's place: region
     * index left before this link (its index stays taken)
     */
    PF_MSG_GONE = 12,
    /*
     * agent -> daemon: ranges of pages a device just wrote (a disk read
     * landed there), for pagefoldd to visit first: a hint, nothing more
     */
    PF_MSG_HINT = 13,
    PF_MSG_LAST = PF_MSG_HINT,
} PfMsgType;

/*
 * An ERROR's seq from pagefoldd.  TRY_AGAIN: a handshake refused for want
 * of room or time (too many at once, not finished in time); the agent
 * connects again after a while, as when pagefoldd went.  FOR_GOOD (what
 * an older pagefoldd always sends): it refused the peer for what it is or
 * sent, or let the VM go (root detached it, it answered too slowly), and
 * the VM stays unattached.
 */
#define PF_ERROR_FOR_GOOD 0u
#define PF_ERROR_TRY_AGAIN 1u

typedef struct {
    guint32 magic;
    guint16 type;
    guint16 flags;  /* 0 */
    guint32 length; /* payload bytes */
    guint32 seq;
} PfMsgHeader;

typedef struct {
    guint32 version;
    guint32 pid;
    guint8 uuid[16];
    char name[PF_PROTO_NAME_LEN];
    guint32 n_regions;
    guint32 reserved;
} PfWireHello;

typedef struct {
    guint32 index;
    guint32 page_size;
    guint64 host_addr;
    guint64 size;
    guint64 offset; /* of host_addr in the memfd */
    char name[PF_PROTO_NAME_LEN];
} PfWireRegion;

typedef enum { PF_MODE_ADVISE = 0, PF_MODE_MERGE = 1 } PfMode;

/* WELCOME, READY and ADVISE: a mode, and why not merge when it is advise. */
typedef struct {
    guint32 version;
    guint32 mode; /* PfMode */
    char reason[PF_PROTO_REASON_LEN];
} PfWireMode;

/* Chunk ids are reused once dropped: they stay below this. */
#define PF_PROTO_MAX_CHUNKS (1u << 20)

/* POOL (with the chunk's memfd) and DROP (without). */
typedef struct {
    guint32 chunk;
    guint32 n_slots;
} PfWirePool;

/*
 * DISCARD: pages [page, page + n_pages) of a region.  GONE: the region,
 * page 0 and n_pages all its pages.  HINT: a list of them.
 */
typedef struct {
    guint32 region;
    guint32 flags; /* DISCARD: PF_RANGE_BACKEND or 0; others 0; checked */
    guint64 page;
    guint64 n_pages;
} PfWireRange;

/* DISCARD (version 3): folded back because a vhost-user back-end touched
 * them (they were merged). */
#define PF_RANGE_BACKEND 1u

typedef enum {
    PF_ITEM_MERGE = 1,   /* map pool slot over the page if equal */
    PF_ITEM_ZERO = 2,    /* map a zero pool slot over it if it is zero */
    PF_ITEM_UNMERGE = 3, /* copy back into the memfd, map it shared again */
    PF_ITEM_COLLAPSE = 4, /* make the 2 MiB extent at page a huge page again */
} PfItemKind;

typedef struct {
    guint8 kind;
    guint8 reserved[3];
    guint32 region;
    guint64 page; /* index in the region */
    guint32 chunk;
    guint32 slot;
} PfWireItem;

typedef enum {
    PF_RESULT_DONE = 0,    /* merged, zeroed or unmerged */
    PF_RESULT_CHANGED = 1, /* the compare failed: nothing changed */
    PF_RESULT_ERROR = 2,   /* errno in err; the page is as before */
} PfResultStatus;

/* The errors an agent answers that say more than the call that failed:
 * EBUSY, the page is in DMA; EPERM, the agent is stepping back;
 * EINPROGRESS (version 4), a vhost-user back-end of the VM is mapping a
 * new memory table or letting go of guest RAM, and nothing merges until it
 * is done. */

typedef struct {
    guint8 status;
    guint8 reserved[3];
    gint32 err;
} PfWireResult;

G_STATIC_ASSERT(sizeof(PfMsgHeader) == 16);
G_STATIC_ASSERT(sizeof(PfWireHello) == 96);
G_STATIC_ASSERT(sizeof(PfWireRegion) == 96);
G_STATIC_ASSERT(sizeof(PfWireItem) == 24);
G_STATIC_ASSERT(sizeof(PfWireResult) == 8);
G_STATIC_ASSERT(sizeof(PfWireRange) == 24);

typedef struct {
    PfMsgHeader header;
    guint8 payload[PF_PROTO_MAX_PAYLOAD];
    int fds[PF_PROTO_MAX_FDS];
    guint n_fds;
} PfMsg;

gboolean pf_proto_send(int sock, PfMsgType type, guint32 seq,
                       const void *payload, gsize length, const int *fds,
                       guint n_fds, GError **error);

/*
 * Sends length bytes of data as one datagram, with n_fds descriptors (up
 * to PF_PROTO_RAW_MAX_FDS), as they are: no header, no check.  For tests
 * and fuzz targets playing a peer that sends what pf_proto_send() never
 * would (garbage, more descriptors than a message carries), so that
 * pf_proto_recv() meets it through the framing's own sendmsg().
 */
#define PF_PROTO_RAW_MAX_FDS (2u * PF_PROTO_MAX_FDS)
gboolean pf_proto_send_raw(int sock, const void *data, gsize length,
                           const int *fds, guint n_fds, GError **error);

/*
 * Receives and validates one message.  Returns FALSE with error on a bad
 * message (all its fds closed) or a closed socket (PF_ERROR_CLOSED);
 * the caller owns msg->fds of a good one (pf_msg_close_fds()).
 */
gboolean pf_proto_recv(int sock, PfMsg *msg, GError **error);
void pf_msg_close_fds(PfMsg *msg);

/* Typed views of a validated message's payload. */
const PfWireHello *pf_msg_hello(const PfMsg *msg);
const PfWireRegion *pf_msg_region(const PfMsg *msg);
const PfWireMode *pf_msg_mode(const PfMsg *msg);
/* POOL or DROP. */
const PfWirePool *pf_msg_pool(const PfMsg *msg);
const PfWireRange *pf_msg_range(const PfMsg *msg);
const PfWireItem *pf_msg_items(const PfMsg *msg, guint32 *n_items);
const PfWireResult *pf_msg_results(const PfMsg *msg, guint32 *n_results);
const PfWireRange *pf_msg_hints(const PfMsg *msg, guint32 *n_ranges);

/* REQUEST, RESULT and HINT: n entries after a small list header. */
gboolean pf_proto_send_items(int sock, guint32 seq, const PfWireItem *items,
                             guint32 n, GError **error);
gboolean pf_proto_send_results(int sock, guint32 seq,
                               const PfWireResult *results, guint32 n,
                               GError **error);
gboolean pf_proto_send_hints(int sock, const PfWireRange *ranges, guint32 n,
                             GError **error);


/* Copies text into a fixed wire field, NUL-padded and always terminated. */
void pf_wire_set_string(char *field, gsize size, const char *text);
