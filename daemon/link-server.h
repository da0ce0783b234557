/*
 * link-server.h - pagefoldd's end of the agent protocol (link-server.c,
 * link.c, handshake.c): the agent socket, and one PfLink per agent
 * connected, from its handshake to its end (its
 * requests wait in its VM's outbox, outbox.h).
 *
 * Owns the agent connections.  A peer is believed only as far as its
 * process shows: its regions must be what that process maps, merge mode
 * must be backed by write protection, and /dev/userfaultfd goes only to a
 * peer with a region that passed and that root vouched for (root's own
 * process, or the QEMU libvirt's root-owned status file names).  A region that fails those checks, at the
 * handshake or plugged in later, costs its VM that region only: it stays a
 * refused placeholder at its index, never scanned.  A link that misbehaves
 * (bad message, wrong pid, a region index out of turn, GONE or DISCARD of
 * a region that is not live, a result for no request, a handshake it does
 * not finish, a socket it does not read, requests it does not answer) is
 * told why and closed, with
 * every descriptor it passed, and its VM is detached; the daemon and the
 * other VMs carry on.  Never waits for a peer on the main loop, and never
 * decides a merge: it drains the requests the scanner leaves in each VM's
 * outbox, hands the agents' answers to the scanner, and passes on the
 * chunks the scanner's listener call tells it of.
 *
 * Sits above the scanner: calls it, and hears from it only as its
 * listener.  The server creates every link and frees it, never from inside
 * the link's own callbacks (a link that ends is closed at once and freed
 * from the main loop).
 */
#pragma once

#include <glib.h>

#include "attached.h"
#include "pool.h"
#include "scan.h"

typedef struct _PfLinkServer PfLinkServer;

PfLinkServer *pf_link_server_new(PfScanner *s, const char *path, GError **error);
void pf_link_server_free(PfLinkServer *srv);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfLinkServer, pf_link_server_free)

/* Opens the agent socket to one group besides root (mode 0660), so that an
 * unprivileged QEMU of that group (libvirt's libvirt-qemu) can connect; a
 * peer is then checked by its credentials at connect (SO_PEERCRED,
 * SO_PEERGROUPS) as well as by the socket's mode. */
gboolean pf_link_server_allow_group(PfLinkServer *srv, const char *group, GError **error);

/* Where libvirt keeps its domains' status files (default
 * PF_LIBVIRT_QEMU_RUN_DIR): a peer that is not root's gets /dev/userfaultfd
 * only if the status file of the domain it names says it is that domain's
 * QEMU. */
void pf_link_server_set_libvirt_run_dir(PfLinkServer *srv, const char *dir);

/* What the pagefoldd before kept of agents' VMs (their merge domains),
 * looked at as each VM is made; kept must outlive the server. */
void pf_link_server_set_kept(PfLinkServer *srv, PfAttached *kept);

/* An agent that has requests to answer and answers none for this long is
 * given up, its VM detached (default 30 s). */
void pf_link_server_set_answer_timeout(PfLinkServer *srv, guint ms);
