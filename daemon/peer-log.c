/*
 * peer-log.c - the per-uid limit on the log lines agents' connections
 * cause (peer-log.h): a window of PEER_LOG_WINDOW_S per uid, opened by its
 * first line.
 */
#include "peer-log.h"

#define PEER_LOG_LINES 20
#define PEER_LOG_WINDOW_S 10

struct _PfPeerLog {
    GHashTable *budgets; /* uid -> its Budget, this window */
};

/* A uid's lines in the window that its first line opened. */
typedef struct {
    PfPeerLog *log;
    uid_t uid;
    guint lines;
    guint suppressed;
    guint timer;
} Budget;

static void
budget_free(gpointer p)
{
    Budget *b = p;

    g_clear_handle_id(&b->timer, g_source_remove);
    g_free(b);
}

PfPeerLog *
pf_peer_log_new(void)
{
    PfPeerLog *log = g_new0(PfPeerLog, 1);

    log->budgets = g_hash_table_new_full(NULL, NULL, NULL, budget_free);
    return log;
}

void
pf_peer_log_free(PfPeerLog *log)
{
    if (log != NULL) {
        g_hash_table_unref(log->budgets);
        g_free(log);
    }
}

/* The window is over: what was held back is said, and the uid starts
 * afresh with its next line. */
static gboolean
window_end_cb(gpointer user)
{
    Budget *b = user;

    b->timer = 0;
    if (b->suppressed > 0) {
        g_message("agent connections of uid %u: %u more line(s) suppressed in %d s",
                  (guint)b->uid, b->suppressed, PEER_LOG_WINDOW_S);
    }
    g_hash_table_remove(b->log->budgets, GUINT_TO_POINTER(b->uid));
    return G_SOURCE_REMOVE;
}

void
pf_peer_log(PfPeerLog *log, uid_t uid, const char *fmt, ...)
{
    Budget *b = g_hash_table_lookup(log->budgets, GUINT_TO_POINTER(uid));
    g_autofree char *text = NULL;
    va_list ap;

    if (b == NULL) {
        b = g_new0(Budget, 1);
        b->log = log;
        b->uid = uid;
        b->timer = g_timeout_add_seconds(PEER_LOG_WINDOW_S, window_end_cb, b);
        g_hash_table_insert(log->budgets, GUINT_TO_POINTER(uid), b);
    }
    if (b->lines >= PEER_LOG_LINES) {
        b->suppressed++;
        return;
    }
    b->lines++;
    va_start(ap, fmt);
    text = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    g_message("%s", text);
}
