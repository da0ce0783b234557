/*
 * control-commands.h - what pagefoldd's control socket (control.h) does
 * with one request line: parsed, its arguments checked against the
 * command's, run against the scanner and answered in QMP's shape; or, for
 * a command that replies when its job is done (scan-now, unmerge, set run
 * 2), a PfControlLater that holds the reply once the job ends.
 *
 * Owns each PfControlLater until its caller frees it, and the JSON views
 * of VMs, counters and knobs in the replies.  Must never touch a socket or
 * a client (replies go back as text, and a later one is announced through
 * a callback), and never trust a request: whatever it holds gets an error
 * reply, never a crash, a stopped scanner or a disturbed VM.
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

#include "scan.h"
#include "view.h"

/* What `reload` does, given by the embedder (main.c: the configuration
 * file read again); FALSE with error when nothing of it was taken. */
typedef struct {
    gboolean (*func)(gpointer user, GError **error);
    gpointer user;
} PfControlReload;

/* A command's reply that comes when its job is done. */
typedef struct _PfControlLater PfControlLater;

/* The reply is there (pf_control_later_steal_reply()); the callback may
 * free l. */
typedef void (*PfControlLaterFunc)(PfControlLater *l, gpointer user);

/*
 * The reply to one request line (no newline), or NULL when a job will give
 * it: then *later is that job's, the caller's to free.  The job ends on
 * the default main context, never within this call.  On the main loop.
 * made, if not NULL: set to the view the command made, if it made one (a
 * read, attach, merge-domain; also a refused `stats VM`); else left alone.
 */
char *pf_control_command_execute(PfScanner *scanner, const char *line, gsize len,
                                 const PfControlReload *reload, PfControlLater **later,
                                 PfView **made);
/*
 * The reply to one request line from view, on any thread: for a command
 * that only reads (stats, knobs, list, qmp_capabilities) or a request that
 * is refused whatever the scanner holds; NULL for any other command.
 * *counters_read: whether the reply tells the view's counters.
 */
char *pf_control_command_answer(PfView *view, const char *line, gsize len,
                                gboolean *counters_read);

/* Calls func once the reply is there; unset, the reply waits for
 * pf_control_later_steal_reply(). */
void pf_control_later_watch(PfControlLater *l, PfControlLaterFunc func, gpointer user);
/* The reply (no newline) once the job is done, else NULL. */
char *pf_control_later_steal_reply(PfControlLater *l);
/* Once the job is done, the view its reply was built from, if it made
 * one: a scan-now or an unmerge that ended well; else NULL. */
PfView *pf_control_later_steal_view(PfControlLater *l);
/* Forgets the job if it is not done: its callback is never called. */
void pf_control_later_free(PfControlLater *l);

/* {"error": {"class": klass, "desc": desc}, "id": id}; id NULL for none. */
char *pf_control_reply_error(const char *klass, const char *desc, JsonNode *id);
