/*
 * scan-events.c - what the scanner core tells the layers above it: the
 * listeners they register (scan.h's PfScanEvents) and the calls to them.
 * The bottom of the core: every core file may tell, none is called back.
 */
#include "scan-core.h"

void
pf_scanner_add_listener(PfScanner *s, const PfScanEvents *events, gpointer user,
                        GDestroyNotify destroy)
{
    Listener l = { events, user, destroy };

    g_array_append_val(s->listeners, l);
}

void
pf_scanner_remove_listener(PfScanner *s, const PfScanEvents *events, gpointer user)
{
    for (guint i = 0; i < s->listeners->len; i++) {
        Listener *l = &g_array_index(s->listeners, Listener, i);

        if (l->events == events && l->user == user) {
            g_array_remove_index(s->listeners, i);
            return;
        }
    }
}

gpointer
pf_scanner_find_listener(PfScanner *s, const PfScanEvents *events)
{
    for (guint i = 0; i < s->listeners->len; i++) {
        Listener *l = &g_array_index(s->listeners, Listener, i);

        if (l->events == events) {
            return l->user;
        }
    }
    return NULL;
}

void
scan_emit_vm_gone(PfScanner *s, PfVm *vm, const char *why)
{
    for (guint i = 0; i < s->listeners->len; i++) {
        Listener *l = &g_array_index(s->listeners, Listener, i);

        if (l->events->vm_gone != NULL) {
            l->events->vm_gone(s, vm, why, l->user);
        }
    }
}

void
scan_emit_passed_over(PfScanner *s, PfVm *vm)
{
    for (guint i = 0; i < s->listeners->len; i++) {
        Listener *l = &g_array_index(s->listeners, Listener, i);

        if (l->events->passed_over != NULL) {
            l->events->passed_over(s, vm, l->user);
        }
    }
}

void
scan_emit_chunk(PfScanner *s, PfVm *vm, const PfPoolChunk *chunk, gboolean drop)
{
    for (guint i = 0; i < s->listeners->len; i++) {
        Listener *l = &g_array_index(s->listeners, Listener, i);

        if (l->events->chunk != NULL) {
            l->events->chunk(s, vm, chunk, drop, l->user);
        }
    }
}

void
scan_emit_domain(PfScanner *s, PfVm *vm)
{
    for (guint i = 0; i < s->listeners->len; i++) {
        Listener *l = &g_array_index(s->listeners, Listener, i);

        if (l->events->domain != NULL) {
            l->events->domain(s, vm, l->user);
        }
    }
}
