/*
 * cow.h - finding, from outside a VM's process, the merged guest pages
 * that were written since they were merged.
 *
 * A merged page maps a pool slot MAP_PRIVATE; a write to it copies on
 * write into an anonymous page of the process's own.  That copy is what
 * this module looks for, in the VM's /proc/PID/pagemap: the PAGEMAP_SCAN
 * ioctl on Linux 6.7 and later, pagemap entries (and /proc/kpageflags)
 * before.  The copy may since have been swapped out, merged by host KSM
 * with other anonymous pages, or replaced by the kernel's zero page (KSM
 * with use_zero_pages): all of these still mean "written".
 *
 * What this module owns: reading the pagemap of a VM's process and the
 * page flags of the frames it names.  What it must never do: read, write
 * or map guest RAM, or act on what it finds (the scanner decides, the
 * agent folds pages back).  It knows nothing of page states: it reports
 * what the page tables say, and the caller judges.
 */
#pragma once

#include <glib.h>

typedef struct _PfCow PfCow;

/* Probes the kernel once: PAGEMAP_SCAN unless it is missing or
 * PAGEFOLD_NO_PAGEMAP_SCAN is set in the environment. */
PfCow *pf_cow_new(void);
/* A reference for a thread (extents.c): pf_cow_find() only reads it. */
PfCow *pf_cow_ref(PfCow *c);
void pf_cow_free(PfCow *c);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfCow, pf_cow_free)

/* "PAGEMAP_SCAN" (6.7+), else "pagemap". */
const char *pf_cow_method(const PfCow *c);

/*
 * Page page (counted from host_addr) is no longer the file page it was
 * mapped from: an anonymous copy, present or swapped out.  zero_pfn: it
 * maps the kernel's zero page, so its content is all zero (or it may:
 * without CAP_SYS_ADMIN pagemap hides frame numbers, and a page mapped
 * more than once then cannot be told from the zero page).
 */
typedef void (*PfCowFunc)(gsize page, gboolean zero_pfn, gpointer user);

/*
 * Reports each page of [from, to) (pages of 4 KiB from host_addr) of the
 * process whose pagemap is open as pagemap_fd that maps anonymous memory
 * instead of the file it was mapped from.  Only for ranges mapped from a
 * file (a pool chunk MAP_PRIVATE, or guest RAM MAP_SHARED): in anonymous
 * memory every page would be reported.  FALSE if the pagemap could not be
 * read (the process is going).
 */
gboolean pf_cow_find(PfCow *c, int pagemap_fd, guint64 host_addr, gsize from, gsize to,
                     PfCowFunc found, gpointer user);
