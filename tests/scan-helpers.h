/*
 * scan-helpers.h - what the tests that drive a PfScanner directly share:
 * scanning a number of pages as one call did before a pass looked at each
 * VM's process and memfds on threads, by running the main context while a
 * look or a read is under way.
 *
 * Header-only and static, like the tests that include it.
 */
#pragma once

#include <glib.h>

#include "scan.h"

/* pf_scanner_scan(), but a scan stopped for a VM's look (or a read of its
 * memfds) goes on once it is done: up to max_pages, the end of the pass,
 * or a full outbox. */
static inline gsize
pf_test_scan(PfScanner *s, gsize max_pages)
{
    gsize done = 0;

    for (;;) {
        gboolean progress;

        done += pf_scanner_scan(s, max_pages - done, &progress);
        if (done >= max_pages || !pf_scanner_looking(s)) {
            return done;
        }
        while (pf_scanner_looking(s)) {
            g_main_context_iteration(NULL, TRUE);
        }
    }
}
