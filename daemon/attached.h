/*
 * attached.h - the VMs attached by pid (advise mode: no agent), kept in a
 * file beside the control socket, so that a pagefoldd started again (a
 * restart, an upgrade, a crash) attaches them again, with their names,
 * UUIDs and merge domains: they have no agent to come back by themselves.
 *
 * Owns the file and a timer that writes it, once a second, when what it
 * holds changed.  A process is known by its pid and its start time (in
 * /proc/PID/stat), so that a pid reused since is not taken for it.  Never
 * attaches a process the file names unless that process started when the
 * file says, and never trusts the file more than root's own: it is
 * pagefoldd's, 0600, in its run directory.
 */
#pragma once

#include <glib.h>

#include "scan.h"

typedef struct _PfAttached PfAttached;

/* Keeps path up to date with the scanner's VMs attached by pid. */
PfAttached *pf_attached_new(PfScanner *scanner, const char *path);
void pf_attached_free(PfAttached *a);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfAttached, pf_attached_free)

/* The VMs path names whose processes still run, attached again (a missing
 * file: none); how many.  Once, before pf_attached_new(). */
guint pf_attached_restore(PfScanner *scanner, const char *path);
