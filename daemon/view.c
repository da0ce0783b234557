/*
 * view.c - the scanner copied for the control socket's readers (view.h).
 */
#include "view.h"

#include <string.h>

const PfViewVm *
pf_view_vm_of_pid(const PfView *v, int pid)
{
    for (guint i = 0; v != NULL && i < v->n_vms; i++) {
        if (v->vms[i].pid == pid) {
            return &v->vms[i];
        }
    }
    return NULL;
}

static void
copy_vm(PfScanner *s, PfVm *vm, PfViewVm *out)
{
    out->name = g_strdup(vm->name);
    out->pid = vm->pid;
    memcpy(out->uuid, vm->uuid, sizeof(out->uuid));
    out->merge_domain = g_strdup(pf_scanner_merge_domain(s, vm));
    out->mode = pf_vm_mode_name(vm);
    out->mode_reason = g_strdup(vm->mode_reason);
    out->pages = pf_vm_n_pages(vm);
    out->n_regions = vm->regions->len;
    out->regions = g_new0(PfViewRegion, MAX(out->n_regions, 1));
    for (guint k = 0; k < out->n_regions; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        out->regions[k] = (PfViewRegion){ g_strdup(r->name), r->host_addr, r->size,
                                          g_strdup(r->refused), r->gone };
    }
}

PfView *
pf_view_new(PfScanner *s)
{
    GPtrArray *vms = pf_scanner_get_vms(s);
    PfView *v = g_atomic_rc_box_new0(PfView);
    g_autofree PfCounters *per_vm = NULL;

    v->hash = pf_scanner_get_hash(s)->name;
    v->knobs = *pf_scanner_get_knobs(s);
    pf_scanner_get_info(s, &v->info);
    v->n_vms = vms->len;
    v->vms = g_new0(PfViewVm, MAX(v->n_vms, 1));
    for (guint i = 0; i < v->n_vms; i++) {
        copy_vm(s, g_ptr_array_index(vms, i), &v->vms[i]);
    }
    per_vm = g_new0(PfCounters, MAX(v->n_vms, 1));
    pf_scanner_collect(s, &v->total, per_vm);
    v->counted_usec = g_get_monotonic_time();
    for (guint i = 0; i < v->n_vms; i++) {
        v->vms[i].counters = per_vm[i];
    }
    return v;
}

PfView *
pf_view_ref(PfView *v)
{
    return g_atomic_rc_box_acquire(v);
}

static void
view_clear(gpointer data)
{
    PfView *v = data;

    for (guint i = 0; i < v->n_vms; i++) {
        PfViewVm *vm = &v->vms[i];

        for (guint k = 0; k < vm->n_regions; k++) {
            g_free(vm->regions[k].name);
            g_free(vm->regions[k].refused);
        }
        g_free(vm->regions);
        g_free(vm->name);
        g_free(vm->merge_domain);
        g_free(vm->mode_reason);
    }
    g_free(v->vms);
}

void
pf_view_unref(PfView *v)
{
    g_atomic_rc_box_release_full(v, view_clear);
}

const PfViewVm *
pf_view_lookup_vm(const PfView *v, const char *key, GError **error)
{
    g_autofree PfVmKey *keys = g_new(PfVmKey, MAX(v->n_vms, 1));
    gssize i;

    for (guint k = 0; k < v->n_vms; k++) {
        keys[k] = (PfVmKey){ v->vms[k].name, v->vms[k].pid, v->vms[k].uuid };
    }
    i = pf_vm_key_find(keys, v->n_vms, key, error);
    return i < 0 ? NULL : &v->vms[i];
}
