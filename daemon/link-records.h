/*
 * link-records.h - the agent link's records, shared by link-server.c (the
 * agent socket and its places, the scanner's listener), link.c (each
 * link's life and messages) and handshake.c (the checks a peer must pass
 * before it is believed), each calling only those after it.  Nothing else
 * includes it.
 */
#pragma once

#include <sys/socket.h>

#include "attached.h"
#include "channel.h"
#include "libvirt-status.h"
#include "peer-log.h"
#include "scan.h"

/* link-server.h's, named here too: link.c and handshake.c use the server's
 * record, not its functions. */
typedef struct _PfLinkServer PfLinkServer;

/* Where a link is in the protocol: HELLO, REGIONs, READY, then running. */
typedef enum { LINK_HELLO, LINK_REGIONS, LINK_READY, LINK_RUNNING } LinkState;

/* Made, set and freed by link-server.c; the lists of links (handshakes,
 * running, ended, reap) are changed by link.c alone, as links are made,
 * become READY and end. */
struct _PfLinkServer {
    PfScanner *scanner; /* NULL once freed: it went first */
    char *path;
    int fd;
    guint watch;
    int uffd_dev; /* /dev/userfaultfd, for agents root vouched for */
    char *libvirt_run_dir; /* libvirt's status files (libvirt-status.h) */
    PfLibvirtPids *libvirt_pids; /* the pids they name, as last read */
    PfAttached *kept;      /* agents' VMs' merge domains kept by the
                            * pagefoldd before (main.c's), or NULL */
    GPtrArray *handshakes; /* PfLink* not yet READY, oldest first */
    GHashTable *running;   /* PfVm* -> its PfLink*, READY */
    GPtrArray *ended;      /* PfLink* closed, freed from the main loop */
    guint reap;
    guint answer_timeout_ms;
    gboolean quiet;        /* the scanner rests: running links unwatched */
    gboolean group_allowed; /* besides root and pagefoldd's own user */
    gid_t group;
    PfPeerLog *peer_log;   /* what peers' uids may still say in the log */
};

typedef struct _PfLink PfLink;
typedef struct _HandshakeCheck HandshakeCheck;

/* What libvirt's status file says of the domain whose QEMU an agent's
 * process is (handshake.c): root's word, not the peer's. */
typedef struct {
    guint8 uuid[16];
    char *merge_domain;   /* from its <metadata>; "default" without one */
    char *why_unlabelled; /* or why the one it names cannot be */
} PfLibvirtDomain;

void pf_libvirt_domain_free(PfLibvirtDomain *d);

struct _PfLink {
    PfLinkServer *srv;
    int sock;
    guint watch;
    LinkState state;
    pid_t peer_pid;
    uid_t peer_uid;       /* at connect (SO_PEERCRED) */
    gboolean vouched_place; /* it took one of the places of peers root
                             * vouched for (handshake_vouched_at_accept()) */
    int pidfd;            /* the peer's process, from accept on */
    int proc_dir;         /* its /proc/PID */
    guint handshake_timer;
    gboolean offered_merge; /* WELCOME said merge */
    char *no_uffd_why; /* merge offered without /dev/userfaultfd: why */
    gboolean vouched;  /* root vouched for it (handshake_vouch()), from HELLO */
    char *vouch_why;   /* why not */
    guint64 announced_bytes; /* of its live regions */
    guint n_refused;         /* regions refused (placeholders) */
    PfWireHello hello;
    GPtrArray *regions; /* PfRegion*, during the handshake */
    PfVm *vm;           /* once READY: the scanner's, until it goes */
    guint answer_timer; /* while requests are sent and not answered */
    PfChannel *ch;         /* what it sends, and what waits to be sent */
    char *broken_why;      /* it broke: closed from the main loop, why */
    guint close_idle;
    PfLibvirtDomain *libvirt; /* READY: the libvirt domain it runs, or NULL */
    HandshakeCheck *check; /* its process's mappings being read: the link
                            * reads nothing from its peer meanwhile */
    gboolean ended;
    gboolean error_sent; /* ERROR went: the peer knows why it ends */
};

/* ---- link.c ---- */

/* A connection accepted, its process pinned (pidfd, proc_dir, which it
 * takes): a link in its handshake (among srv->handshakes), in one of the
 * places of peers root vouched for if vouched_place. */
PfLink *link_new(PfLinkServer *srv, int sock, const struct ucred *cred, int pidfd, int proc_dir,
                 gboolean vouched_place);
/* Best effort, never waiting, once: the first says why.  For good: its
 * agent does not connect again (PF_ERROR_FOR_GOOD). */
void link_send_error(PfLink *l, const char *text);
/* Refused for now, for want of room or time: its agent connects again. */
gboolean link_refuse_for_now(PfLink *l, const char *fmt, ...) G_GNUC_PRINTF(2, 3);
void link_send(PfLink *l, PfMsgType type, guint32 seq, gconstpointer data, gsize len, int fd);
/* The link reads its peer, or stops reading it, as its state says: not
 * while a check of what it said is under way (it resumes after), nor once
 * it ended, nor while it runs and srv->quiet. */
void link_resume(PfLink *l);
/* The link is over; its record is freed from the main loop (link_free()). */
void link_end(PfLink *l);
void link_free(PfLink *l);
/* Drops what a peer sent that will never be read, before its socket is
 * closed. */
void link_drain_socket(int sock);

/* ---- handshake.c ---- */

/* The peer's process, pinned: a pidfd, and its /proc/PID opened while the
 * pidfd showed it alive. */
gboolean handshake_pin_peer(int sock, pid_t pid, int *pidfd_out, int *proc_dir_out,
                            GError **error);
/* HELLO taken: whether root vouched for the peer as a VMM (l->vouched,
 * l->vouch_why), which decides what it may have: /dev/userfaultfd, and
 * page ids past its uid's share. */
void handshake_vouch(PfLink *l);
/* Whether root vouches for a connecting process by its credentials and
 * libvirt's status files alone: which handshake places it may take. */
gboolean handshake_vouched_at_accept(PfLinkServer *srv, const struct ucred *cred);
/* Whether the connecting process may be an agent. */
gboolean handshake_peer_permitted(PfLinkServer *srv, int sock, const struct ucred *cred);
/* Where a link goes on once a message was checked, from the main loop:
 * r is a REGION's region, or its refused placeholder (its memfd taken
 * either way); NULL for READY. */
typedef void (*HandshakeDone)(PfLink *l, PfMsg *msg, PfRegion *r);
/* Checks a REGION against what the peer's process maps, off the main
 * loop; takes msg, and l->check is set until done is called.  running:
 * announced after READY, when a merging VM's new region must be
 * write-protected as READY's were. */
void handshake_region(PfLink *l, PfMsg *msg, gboolean running, HandshakeDone done);
/* READY, off the main loop: in merge mode, whether each live region is
 * write-protected (one that is not is refused alone); and whether
 * libvirt's status file of the domain named in HELLO says this process
 * runs it (l->libvirt); then done, which takes msg. */
void handshake_check_ready(PfLink *l, PfMsg *msg, HandshakeDone done);
/* The link ends: a check in progress stops, its result goes nowhere. */
void handshake_cancel_check(PfLink *l);
/* What WELCOME says (*w), and the descriptor it carries (or -1): the
 * server's /dev/userfaultfd, only to a peer root vouched for. */
int handshake_welcome(PfLink *l, PfWireMode *w);
/* READY (its regions' protection checked), and the VM it makes (NULL:
 * refused, error says why); *old: the VM attached by pid it replaces, or
 * NULL. */
PfVm *handshake_ready(PfLink *l, const PfMsg *msg, PfVm **old, GError **error);
