/*
 * scan-vms.c - VMs and their regions coming into the scanner and leaving
 * it, and what a VM leaves behind: pool slots its process may still map,
 * held until it exits.
 *
 * Owns every VM added, and frees it as it leaves, after telling the
 * listeners (scan_emit_vm_gone()).  A region leaves the page space and the
 * trees before its records go; a request for it is settled first.  Never
 * frees a pool slot a live process may still map.
 */
#include "scan-core.h"

#include <glib-unix.h>
#include <unistd.h>

#include "guard.h"

gboolean
vms_place_region(PfScanner *s, PfRegion *r)
{
    if (!pf_page_space_place(&s->space, r)) {
        return FALSE;
    }
    r->vm->scan->count[PF_PAGE_ABSENT] += r->n_pages;
    return TRUE;
}

/* Candidates of this pass may point into the region: the unstable tree
 * is emptied, which costs at most a pass of merges. */
void
vms_release_region(PfScanner *s, PfRegion *r, GArray *keep)
{
    for (gsize i = pf_region_next_recorded(r, 0, r->n_pages); i < r->n_pages;
         i = pf_region_next_recorded(r, i + 1, r->n_pages)) {
        if (pf_region_page_state(r, i) != PF_PAGE_ABSENT) {
            ledger_forget_page(s, r, i, keep);
        }
    }
    r->vm->scan->count[PF_PAGE_ABSENT] -= r->n_pages;
    reads_forget_windows(r->vm);
    pf_table_clear(&s->unstable.table);
    moves_forget_joins(s, NULL);
    pf_page_space_remove(&s->space, r);
}

void
vms_drop_region(PfScanner *s, PfRegion *r)
{
    PfVm *vm = r->vm;
    guint k = r->index;

    if (pf_region_live(r)) {
        /* Requests for it are settled now, as for a region gone: their
         * answers, when they come, change nothing. */
        requests_settle_region(s, r);
        vms_release_region(s, r, NULL);
    }
    if (vm->kind == PF_VM_AGENT) {
        /* The agent names regions by index: n_pages 0 now, the cursor
         * steps over it. */
        pf_region_refuse(r, "it faulted when read (truncated under us?)");
        return;
    }
    cursor_region_changed(s, vm, k, TRUE);
    pf_region_free(pf_vm_steal_region(vm, k));
}

void
vms_faulted(PfScanner *s)
{
    PfRegion *bad = pf_page_space_at_address(&s->space, pf_guard_addr);

    if (bad == NULL) {
        g_error("SIGBUS at %p outside guest RAM", pf_guard_addr);
    }
    g_warning("VM %s: region %s faulted at %p (truncated under us?); dropping it", bad->vm->name,
              bad->name, pf_guard_addr);
    if (pf_vm_merges(bad->vm)) {
        pf_scanner_detach(s, bad->vm, "its RAM faulted (truncated under us?)");
    } else {
        vms_drop_region(s, bad);
    }
}

/* Whose pidfd a watch is on: the VM's and the scanner's (a VM knows no
 * scanner).  Freed with the watch, which goes with the VM. */
typedef struct {
    PfScanner *s;
    PfVm *vm;
} ExitWatch;

static gboolean
vm_exited_cb(gint fd, GIOCondition cond, gpointer user)
{
    ExitWatch *w = user;

    w->vm->scan->watch_id = 0;
    pf_scanner_detach(w->s, w->vm, "its process exited");
    return G_SOURCE_REMOVE;
}

void
pf_scanner_add_vm(PfScanner *s, PfVm *vm)
{
    ExitWatch *w = g_new(ExitWatch, 1);

    *w = (ExitWatch){ s, vm };
    g_return_if_fail(vm->scan == NULL);
    vm->scan = g_new0(PfScanVm, 1);
    vm->scan->serial = ++s->vms.next_serial;
    for (guint k = 0; k < vm->regions->len;) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        if (!pf_region_live(r) || vms_place_region(s, r)) {
            k++;
            continue;
        }
        g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
        if (vm->kind == PF_VM_AGENT) {
            /* The agent names its regions by index: this one stays. */
            pf_region_refuse(r, "no page ids left for it");
            k++;
        } else {
            pf_region_free(pf_vm_steal_region(vm, k));
        }
    }
    vm->scan->watch_id = g_unix_fd_add_full(G_PRIORITY_DEFAULT, vm->pidfd, G_IO_IN,
                                            vm_exited_cb, w, g_free);
    if (pf_vm_merges(vm)) {
        const PfPoolChunk *zero = pf_pool_zero_chunk(pf_scanner_get_pool(s));

        /* The only chunk that is every VM's; the others it is sent as its
         * pages come to share them. */
        if (zero != NULL) {
            scan_emit_chunk(s, vm, zero, FALSE);
        }
        /* Its mappings are counted as the cursor first comes to it,
         * before any request for it. */
        vm->scan->vma_budget = vmas_allowed(s);
    }
    g_ptr_array_add(s->vms.list, vm);
}

void
pf_scanner_replace_vm(PfScanner *s, PfVm *old, PfVm *vm)
{
    gboolean unlabelled = old->scan->unlabelled;
    guint32 domain = old->scan->domain;

    pf_scanner_remove_vm(s, old);
    pf_scanner_add_vm(s, vm);
    vm->scan->domain = domain;
    if (unlabelled) {
        pf_scanner_set_unlabelled(s, vm);
    }
}

static gboolean
leftover_cb(gint fd, GIOCondition cond, gpointer user)
{
    Leftover *l = user;

    for (guint i = 0; i < l->refs->len; i++) {
        HeldRef *h = &g_array_index(l->refs, HeldRef, i);

        ledger_put(l->s, h->slot, h->node);
    }
    l->watch = 0;
    g_ptr_array_remove(l->s->vms.leftovers, l);
    return G_SOURCE_REMOVE;
}

static void
vms_leftover_free(gpointer data)
{
    Leftover *l = data;

    if (l->watch != 0) {
        g_source_remove(l->watch);
    }
    close(l->pidfd);
    g_array_unref(l->refs);
    g_free(l);
}

/* Pool slots a process may still map after its VM left: kept until it
 * exits, which the VM's own pidfd says (taken from it, as it is about to
 * be freed: no new descriptor, so nothing to fail). */
static void
vms_keep_leftovers(PfScanner *s, PfVm *vm, GArray *keep)
{
    Leftover *l = g_new0(Leftover, 1);

    l->s = s;
    l->pidfd = vm->pidfd;
    vm->pidfd = -1;
    l->refs = g_array_ref(keep);
    l->watch = g_unix_fd_add(l->pidfd, G_IO_IN, leftover_cb, l);
    g_ptr_array_add(s->vms.leftovers, l);
    g_message("VM %s: %u pool slot reference(s) kept until process %d exits", vm->name,
              l->refs->len, vm->pid);
}

/*
 * The VM leaves.  Its requests are let go first, while it is still one of
 * the scanner's: a chunk only they held goes, and its agent, still
 * connected, is told to drop it.  Then the listeners are told (why NULL:
 * only removed) and hear of it no more; what its pages hold is let go or,
 * where its live process may still map a slot, kept until it exits; and it
 * is freed.
 */
static void
vms_free_vm(PfVm *vm)
{
    PfScanVm *sv = vm->scan;

    if (sv != NULL) {
        if (sv->watch_id != 0) {
            g_source_remove(sv->watch_id);
        }
        reads_forget(vm);
        g_clear_pointer(&sv->dropped, g_array_unref);
        g_clear_pointer(&sv->hints, g_array_unref);
        g_clear_pointer(&vm->scan, g_free);
    }
    pf_vm_free(vm);
}

static void
vm_leave(PfScanner *s, PfVm *vm, const char *why)
{
    g_autoptr(GArray) keep = NULL;
    PfVm *gone;
    guint idx;

    if (!g_ptr_array_find(s->vms.list, vm, &idx)) {
        return;
    }
    if (pf_vm_merges(vm) && !pf_vm_exited(vm)) {
        keep = g_array_new(FALSE, FALSE, sizeof(HeldRef));
    }
    requests_abandon(s, vm, keep);
    scan_emit_vm_gone(s, vm, why);
    g_ptr_array_find(s->vms.list, vm, &idx);
    gone = g_ptr_array_steal_index(s->vms.list, idx);
    cursor_vm_removed(s, idx);
    for (guint k = 0; k < vm->regions->len; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        if (pf_region_live(r)) {
            vms_release_region(s, r, keep);
        }
    }
    /* Its pages left their nodes with its regions, and their parts with
     * them (tree.h): one left over would skew the others' pages_shared. */
    g_warn_if_fail(vm->scan->share == 0);
    if (keep != NULL && keep->len > 0) {
        vms_keep_leftovers(s, vm, keep);
    }
    vms_free_vm(gone);
}

void
pf_scanner_remove_vm(PfScanner *s, PfVm *vm)
{
    vm_leave(s, vm, NULL);
}

void
pf_scanner_detach(PfScanner *s, PfVm *vm, const char *why)
{
    char uuid[37];
    g_autofree char *gone = vm->scan->gone_shared + vm->scan->gone_zero == 0
                                ? g_strdup("")
                                : g_strdup_printf("; in its RAM that left before: merged pages "
                                                  "%zu, zero pages %zu",
                                                  vm->scan->gone_shared, vm->scan->gone_zero);

    /* Its last figures, for whoever asks how much it saved (a VM that
     * stops is dropped by pagefoldd before libvirt's hook could ask): its
     * own counts, not KSM's attributed ones, which are apportioned over
     * every VM and so are not its own to say as it leaves. */
    g_message("VM %s (pid %d%s%s) detached: %s; mode %s, merged pages %zu, zero pages %zu, "
              "cow %" G_GUINT64_FORMAT "%s",
              vm->name, vm->pid, pf_vm_uuid_string(vm, uuid) ? ", uuid " : "",
              pf_vm_uuid_string(vm, uuid) ? uuid : "", why, pf_vm_mode_name(vm),
              vm->scan->count[PF_PAGE_SHARED], vm->scan->count[PF_PAGE_ZERO], vm->scan->cow, gone);
    vm_leave(s, vm, why);
}

gboolean
pf_scanner_add_region(PfScanner *s, PfVm *vm, PfRegion *r)
{
    pf_vm_add_region(vm, r);
    if (!pf_region_live(r)) {
        return FALSE;
    }
    if (!vms_place_region(s, r)) {
        g_warning("VM %s: no page ids left for region %s", vm->name, r->name);
        pf_region_refuse(r, "no page ids left for it");
        return FALSE;
    }
    return TRUE;
}

void
pf_scanner_region_gone(PfScanner *s, PfVm *vm, guint index)
{
    PfRegion *r = index < vm->regions->len ? g_ptr_array_index(vm->regions, index) : NULL;
    gsize shared, zero;

    g_return_if_fail(r != NULL && pf_region_live(r));
    requests_settle_region(s, r);
    shared = vm->scan->count[PF_PAGE_SHARED];
    zero = vm->scan->count[PF_PAGE_ZERO];
    /* Its merged pages' references go with their records: none maps its
     * slot any more. */
    vms_release_region(s, r, NULL);
    vm->scan->gone_shared += shared - vm->scan->count[PF_PAGE_SHARED];
    vm->scan->gone_zero += zero - vm->scan->count[PF_PAGE_ZERO];
    pf_region_retire(r);
    cursor_region_changed(s, vm, index, FALSE);
    g_message("VM %s (pid %d): region %u (%s) left the VM", vm->name, vm->pid, index, r->name);
}

/* ---- merge domains ---- */

const char *
pf_scanner_merge_domain(PfScanner *s, const PfVm *vm)
{
    if (vm->scan->unlabelled) {
        return "unlabelled";
    }
    return vm->scan->domain == 0 ? "default"
                                 : g_ptr_array_index(s->vms.domains, vm->scan->domain - 1);
}

void
pf_scanner_set_unlabelled(PfScanner *s, PfVm *vm)
{
    if (!vm->scan->unlabelled) {
        vm->scan->unlabelled = TRUE;
        scan_emit_domain(s, vm);
    }
}

/* Its pages have other partners now: smart scan's back-off, earned failing
 * to merge in the old domain, starts over. */
static void
smart_scan_over(PfVm *vm)
{
    for (guint k = 0; k < vm->regions->len; k++) {
        PfRegion *r = g_ptr_array_index(vm->regions, k);

        for (gsize i = pf_region_live(r) ? pf_region_next_recorded(r, 0, r->n_pages)
                                          : r->n_pages;
             i < r->n_pages; i = pf_region_next_recorded(r, i + 1, r->n_pages)) {
            PfPage *p = pf_region_page(r, i);

            if (p != NULL) {
                p->age = 0;
            }
        }
    }
}

gboolean
pf_scanner_set_merge_domain(PfScanner *s, PfVm *vm, const char *domain, GError **error)
{
    gsize sharing = vm->scan->count[PF_PAGE_SHARED] + vm->scan->count[PF_PAGE_PENDING];
    guint id = 0;

    /* What VMs of no domain are listed as: no domain's name. */
    if (g_strcmp0(domain, "unlabelled") == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "'unlabelled' is no merge domain's name: it says a VM shares with nobody");
        return FALSE;
    }
    if (domain != NULL && *domain != '\0' && !g_str_equal(domain, "default")) {
        if (!g_ptr_array_find_with_equal_func(s->vms.domains, domain, g_str_equal, &id)) {
            g_ptr_array_add(s->vms.domains, g_strdup(domain));
            id = s->vms.domains->len - 1;
        }
        id++;
    }
    if (!vm->scan->unlabelled && id == vm->scan->domain) {
        return TRUE;
    }
    /* A page it shares now would stay shared across the new boundary;
     * zero pages are every VM's, in any domain.  Unlabelled, it shares
     * pages only with itself: they may stay so. */
    if (!vm->scan->unlabelled && sharing > 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_EXISTS,
                    "VM %s (pid %d) shares %zu page(s) in merge domain '%s' already: unmerge it "
                    "first (pagefoldctl unmerge %d)",
                    vm->name, vm->pid, sharing, pf_scanner_merge_domain(s, vm), vm->pid);
        return FALSE;
    }
    /* Pages found equal to content of the old domain, waiting to join
     * it, join nothing now. */
    moves_forget_joins(s, vm);
    smart_scan_over(vm);
    g_message("VM %s (pid %d): merge domain '%s' (was '%s')", vm->name, vm->pid,
              id == 0 ? "default" : (const char *)g_ptr_array_index(s->vms.domains, id - 1),
              pf_scanner_merge_domain(s, vm));
    vm->scan->unlabelled = FALSE;
    vm->scan->domain = id;
    scan_emit_domain(s, vm);
    return TRUE;
}

void
vms_init(PfScanner *s)
{
    s->vms.list = g_ptr_array_new_with_free_func((GDestroyNotify)vms_free_vm);
    s->vms.leftovers = g_ptr_array_new_with_free_func(vms_leftover_free);
    s->vms.domains = g_ptr_array_new_with_free_func(g_free);
}

void
vms_clear(PfScanner *s)
{
    g_ptr_array_unref(s->vms.list);
    g_ptr_array_unref(s->vms.domains);
    g_ptr_array_unref(s->vms.leftovers);
}
