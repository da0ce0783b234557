/*
 * control.h - pagefoldd's control socket: newline-delimited JSON in QMP's
 * shape, {"execute": CMD, "arguments": {...}, "id": ANY} answered by
 * {"return": ...} or {"error": {"class": ..., "desc": ...}}.
 *
 * Owns the listening socket and its clients.  Must never let one client's
 * bad input (malformed, huge, wrong types, unknown commands, a VM that
 * vanished) stop the daemon or disturb another client or VM.
 */
#pragma once

#include <glib.h>

#include "scan.h"

/* Longest request line accepted, newline excluded. */
#define PF_CONTROL_MAX_LINE (64 * 1024)

typedef struct _PfControl PfControl;

/* Binds and listens; clients that connect wait in the backlog, ungreeted,
 * until pf_control_start(). */
PfControl *pf_control_new(PfScanner *scanner, const char *path, GError **error);
/* Serves the socket from now on: its greeting tells a client the daemon is
 * set up (main.c starts it last, beside systemd's READY=1). */
void pf_control_start(PfControl *c);
/* What `reload` does (on the main loop): main.c reads its configuration
 * file again.  Without it, `reload` is refused. */
void pf_control_set_reload(PfControl *c, gboolean (*func)(gpointer user, GError **error),
                           gpointer user);
void pf_control_free(PfControl *c);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfControl, pf_control_free)
