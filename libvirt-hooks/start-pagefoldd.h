/*
 * start-pagefoldd.h - starting pagefoldd for the hook where it does not
 * answer: through systemd where systemd is PID 1, else the hook runs it
 * itself, fully detached (forked twice, a session of its own, stdin
 * /dev/null, output appended to its log), one hook at a time (a lock on
 * that log), and waits a bounded while for it to answer.
 *
 * Owns nothing once it returns but the pagefoldd it started.  Must never
 * leave a process holding the hook's stdout or stderr (libvirtd reads them
 * to EOF), never hand pagefoldd a descriptor of the hook's, and never
 * wait past the hook's deadline.
 */
#pragma once

#include "hook-common.h"

/* What systemd starts pagefoldd as. */
#define SYSTEMD_UNIT "pagefoldd.service"

/*
 * Where systemd is PID 1 and the hook was not told which pagefoldd to
 * run, systemd starts its unit (which says how, and restarts it);
 * otherwise the hook starts it itself.  Whether it answers within
 * h->ready_wait_ms (said either way).
 */
gboolean hook_start_pagefoldd(Hook *h);
