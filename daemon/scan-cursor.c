/*
 * scan-cursor.c - the cursor: the next page the pass visits, and where it
 * left each VM it did not finish (PfScanVm.resume).  The pass moves it
 * (scan-pass.c); VMs and regions that go move it too (scan-vms.c), so that
 * it never names a VM, region or page that is not there, nor skips one
 * that is.
 *
 * Owns PfScanner.cursor and the VMs' resume points.  Must never decide
 * anything of a page: it only says where the pass is.
 */
#include "scan-core.h"

void
cursor_to_vm(PfScanner *s, guint i)
{
    s->cursor.vm = i;
    s->cursor.region = 0;
    s->cursor.page = 0;
    s->cursor.data_end = 0;
    if (i < vm_count(s)) {
        PfVm *vm = vm_at(s, i);

        if (vm->scan->resume) {
            vm->scan->resume = FALSE;
            s->cursor.region = vm->scan->resume_region;
            s->cursor.page = vm->scan->resume_page;
        }
    }
}

void
cursor_next_vm(PfScanner *s)
{
    cursor_to_vm(s, s->cursor.revisiting ? vm_count(s) : s->cursor.vm + 1);
}

void
cursor_revisit(PfScanner *s, gboolean revisiting)
{
    s->cursor.revisiting = revisiting;
}

void
cursor_leave_vm(PfScanner *s, PfVm *vm)
{
    vm->scan->resume = TRUE;
    vm->scan->resume_region = s->cursor.region;
    vm->scan->resume_page = s->cursor.page;
    cursor_next_vm(s);
}

void
cursor_forget_vm(PfVm *vm)
{
    vm->scan->resume = FALSE;
}

void
cursor_next_region(PfScanner *s)
{
    s->cursor.region++;
    s->cursor.page = 0;
    s->cursor.data_end = 0;
}

void
cursor_at_page(PfScanner *s, gsize page, gsize data_end)
{
    s->cursor.page = page;
    s->cursor.data_end = data_end;
}

void
cursor_to_page(PfScanner *s, gsize page)
{
    s->cursor.page = page;
}

void
cursor_vm_removed(PfScanner *s, guint idx)
{
    if (idx < s->cursor.vm) {
        s->cursor.vm--;
    } else if (idx == s->cursor.vm) {
        cursor_to_vm(s, s->cursor.revisiting ? vm_count(s) : idx);
    }
}

void
cursor_region_changed(PfScanner *s, PfVm *vm, guint k, gboolean removed)
{
    if (vm->scan->resume && removed && k < vm->scan->resume_region) {
        vm->scan->resume_region--;
    } else if (vm->scan->resume && k == vm->scan->resume_region) {
        vm->scan->resume_page = 0;
    }
    if (s->cursor.vm >= vm_count(s) || vm_at(s, s->cursor.vm) != vm) {
        return;
    }
    if (removed && k < s->cursor.region) {
        s->cursor.region--;
    } else if (k == s->cursor.region) {
        s->cursor.page = 0;
        s->cursor.data_end = 0;
    }
}
