/*
 * view.h - PfView: what the control socket's read commands (stats, knobs,
 * list) tell, copied out of the scanner on the main loop, so that a thread
 * that is not the main loop can answer from it.
 *
 * A view owns its copies, is never changed once made, and is refcounted
 * atomically: any thread may hold one.  Must never point into the
 * scanner, its VMs or their regions, which change and go on the main
 * loop, and is made only there.
 */
#pragma once

#include <glib.h>

#include "scan.h"

typedef struct {
    char *name;
    guint64 host_addr;
    guint64 size;
    char *refused; /* a placeholder: why it was refused; else NULL */
    gboolean gone; /* a placeholder: it left the VM */
} PfViewRegion;

typedef struct {
    char *name;
    int pid;
    guint8 uuid[16];
    char *merge_domain;
    const char *mode;  /* pf_vm_mode_name() */
    char *mode_reason; /* or NULL */
    guint64 pages;
    PfViewRegion *regions;
    guint n_regions;
    PfCounters counters;
} PfViewVm;

typedef struct {
    gint64 counted_usec; /* monotonic: when the counters were taken */
    const char *hash;
    PfKnobs knobs;
    PfScanInfo info;     /* as made */
    PfCounters total;    /* as counted */
    PfViewVm *vms;
    guint n_vms;
} PfView;

/* The scanner as it is now, its counters too (pf_scanner_collect(): a
 * few figures per VM, each kept up to date by the scanner). */
PfView *pf_view_new(PfScanner *s);
PfView *pf_view_ref(PfView *v);
void pf_view_unref(PfView *v);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfView, pf_view_unref)

/* A VM of the view by pid, UUID or name, as pf_scanner_lookup_vm() finds
 * one in the scanner. */
const PfViewVm *pf_view_lookup_vm(const PfView *v, const char *key, GError **error);
/* The VM of that pid in the view, or NULL. */
const PfViewVm *pf_view_vm_of_pid(const PfView *v, int pid);
