/*
 * peer-log.h - lines of pagefoldd's log that agents' connections cause,
 * limited per uid: a process that connects in a loop (refused, or giving
 * up its handshake) would otherwise write a line or two a connection, as
 * fast as it connects.  Per uid, the one thing a peer cannot choose (under
 * libvirt every QEMU shares one: a window's lines are enough for many VMs
 * starting at once); the rest is counted and said in one line as the
 * window ends.  Used by link-server.c, link.c and
 * handshake.c; owns its windows' timers,
 * and never says a line past a uid's share.
 */
#pragma once

#include <glib.h>
#include <sys/types.h>

typedef struct _PfPeerLog PfPeerLog;

PfPeerLog *pf_peer_log_new(void);
void pf_peer_log_free(PfPeerLog *log);

/* g_message() of a line a peer of that uid caused, unless that uid has
 * had its share of lines for now. */
void pf_peer_log(PfPeerLog *log, uid_t uid, const char *fmt, ...) G_GNUC_PRINTF(3, 4);
