/*
 * agent-helpers.h - what the agent suite's stand-in programs (agent-test,
 * agent-cow-test, agent-restart-test, agent-trust-test) share: stand-in
 * VMMs of one guest layout, started against the test's pagefoldd, and
 * pagefoldctl's answers read as those tests read them.
 *
 * Owns: that layout.  It must never keep state between tests (each starts
 * its own pagefoldd and stand-ins), nor repeat what testproc.h offers.
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

#include "testproc.h"

/* Each stand-in's guest RAM (standin-vmm's layout): the identical block
 * (the same in every guest), then pages of its seed only, then zero pages. */
#define MIB 16
#define PAGES (MIB * 256)
#define IDENTICAL (PAGES / 2)
#define ZERO (PAGES * 20 / 100)
#define UNIQUE (PAGES - IDENTICAL - ZERO)

typedef PfTestVmm Vmm;

/* A stand-in VMM named name, filled from seed, with that many writer
 * threads (2000 writes a second), as nobody:nogroup or as root; returned
 * once pagefoldd lists it. */
Vmm *vmm_start(PfTestDaemon *d, const char *name, int seed, int writers, gboolean as_nobody);
/* The same, with one or two more standin-vmm options, apart by a space (or NULL). */
Vmm *vmm_start_full(PfTestDaemon *d, const char *name, int seed, int writers,
                    gboolean as_nobody, const char *extra);
/* Waits (10 s at most) until v's agent has seen its connection closed. */
void wait_disconnected(Vmm *v);
/* pagefoldctl --json cmd [arg]'s answer, a new reference. */
JsonObject *stats(PfTestDaemon *d, const char *cmd, const char *arg);
/* One of the answer's totals. */
gint64 total(JsonObject *s, const char *name);
/* VM name among the answer's "vms", or NULL. */
JsonObject *vm_of(JsonObject *s, const char *name);
/* Where VM vm's first region (a stand-in's guest RAM) is in its VMM; 0 if
 * it is not listed. */
guint64 guest_addr(PfTestDaemon *d, const char *vm);
/* Waits (30 s at most) until the pagefoldd running now lists VM name in
 * merge mode. */
void wait_merging(PfTestDaemon *d, const char *name);
/* The merge domain pagefoldd lists VM name in (it must be listed). */
char *listed_domain(PfTestDaemon *d, const char *name);
/* wait_merging(), then asserts that VM name is in merge domain want. */
void assert_back_in(PfTestDaemon *d, const char *name, const char *want);
