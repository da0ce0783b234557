/*
 * attached.h - what a pagefoldd started again (a restart, an upgrade, a
 * crash) would otherwise lose, kept in a file beside the control socket:
 * the VMs attached by pid (advise mode: no agent to come back by
 * themselves), with their names, UUIDs and merge domains, and the merge
 * domains of agents' VMs, which come back by themselves but would come
 * back to whatever domain their handshake gives (default, for root's),
 * silently opening sharing between tenants root had kept apart.
 *
 * Owns the file, a timer that writes it once a second when what it holds
 * changed, and the merge domains it read for agents' VMs that have not
 * come back yet.  It writes at once, before the change is answered, when
 * a VM's merge domain changes (the scanner's domain event): a pagefoldd
 * killed right after `pagefoldctl merge-domain` keeps it.  A process is
 * known by its pid and its start time (in /proc/PID/stat), so that a pid
 * reused since is not taken for it.  Never attaches a process the file
 * names unless that process started when the file says, and never trusts
 * the file more than root's own: it is pagefoldd's, 0600, in its run
 * directory.
 */
#pragma once

#include <glib.h>

#include "scan.h"

typedef struct _PfAttached PfAttached;

/* Reads path (once, at start): the VMs it names whose processes still
 * run are attached again (*n_restored says how many), and the merge
 * domains of agents' VMs are kept for pf_attached_agent_domain(); then
 * keeps path up to date with the scanner's VMs. */
PfAttached *pf_attached_new(PfScanner *scanner, const char *path, guint *n_restored);
void pf_attached_free(PfAttached *a);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfAttached, pf_attached_free)

/*
 * An agent's VM is made: the merge domain root gave this very process (its
 * start time), under the pagefoldd before or this one, if it is known
 * ("default", "unlabelled" or a name), or NULL.  *unknown: then whether its
 * domain is unknown, because the file could not be read (or was not
 * there), or did not name it where it names every agent's VM: its caller
 * keeps a VM that merged before apart rather than guess.
 */
const char *pf_attached_agent_domain(PfAttached *a, const PfVm *vm, gboolean *unknown);

/* An agent's VM was made and its domain decided: kept at once (the file
 * written), before it can merge anything.  Changes after come as the
 * scanner's domain event. */
void pf_attached_keep_domain(PfAttached *a, PfVm *vm);
