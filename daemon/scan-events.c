/*
 * scan-events.c - what the scanner core tells the layers above it: the
 * listeners they register (scan.h's PfScanEvents) and the calls to them.
 * The bottom of the core: every core file may tell, none is called back.
 */
#include "scan-core.h"

typedef struct {
    const PfScanEvents *events;
    gpointer user;
    GDestroyNotify destroy;
} Listener;

void
pf_scanner_add_listener(PfScanner *s, const PfScanEvents *events, gpointer user,
                        GDestroyNotify destroy)
{
    Listener l = { events, user, destroy };

    g_array_append_val(s->events.listeners, l);
}

void
pf_scanner_remove_listener(PfScanner *s, const PfScanEvents *events, gpointer user)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events == events && l->user == user) {
            g_array_remove_index(s->events.listeners, i);
            return;
        }
    }
}

gpointer
pf_scanner_find_listener(PfScanner *s, const PfScanEvents *events)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events == events) {
            return l->user;
        }
    }
    return NULL;
}

void
scan_emit_vm_gone(PfScanner *s, PfVm *vm, const char *why)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events->vm_gone != NULL) {
            l->events->vm_gone(s, vm, why, l->user);
        }
    }
}

void
scan_emit_passed_over(PfScanner *s, PfVm *vm)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events->passed_over != NULL) {
            l->events->passed_over(s, vm, l->user);
        }
    }
}

void
scan_emit_chunk(PfScanner *s, PfVm *vm, const PfPoolChunk *chunk, gboolean drop)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events->chunk != NULL) {
            l->events->chunk(s, vm, chunk, drop, l->user);
        }
    }
}

void
scan_emit_domain(PfScanner *s, PfVm *vm)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events->domain != NULL) {
            l->events->domain(s, vm, l->user);
        }
    }
}

void
scan_emit_resting(PfScanner *s, gboolean resting)
{
    for (guint i = 0; i < s->events.listeners->len; i++) {
        Listener *l = &g_array_index(s->events.listeners, Listener, i);

        if (l->events->resting != NULL) {
            l->events->resting(s, resting, l->user);
        }
    }
}

void
events_init(PfScanner *s)
{
    s->events.listeners = g_array_new(FALSE, FALSE, sizeof(Listener));
}

/* A listener's user data goes last: a job still running is told that
 * pagefoldd stops. */
void
events_clear(PfScanner *s)
{
    while (s->events.listeners->len > 0) {
        Listener l = g_array_index(s->events.listeners, Listener, s->events.listeners->len - 1);

        g_array_remove_index(s->events.listeners, s->events.listeners->len - 1);
        if (l.destroy != NULL) {
            l.destroy(l.user);
        }
    }
    g_array_unref(s->events.listeners);
}
