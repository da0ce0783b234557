/*
 * qemu-common.h - what the two parts of the qemu-test program, qemu-test.c
 * (guests through their life) and qemu-devices.c (devices and
 * configurations), share (qemu-common.c).
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

#include "testguest.h"
#include "testproc.h"

/* What pfguest fills of a guest_start() guest, and in pages. */
#define FILL_MIB 64
#define FILL_PAGES (FILL_MIB * 256)

/* A pagefoldctl answer's member of "total". */
gint64 total(JsonNode *n, const char *name);
/* Whether there is a QEMU and a guest to boot; skips the path, saying
 * why, if not. */
gboolean have_qemu(void);
/* pfguest in 256 MiB of memfd shared RAM with the agent on agent_sock,
 * filling FILL_MIB; it runs seconds, then reboots or powers off. */
Guest *guest_start(const char *agent_sock, const char *name, int seed, int seconds,
                   gboolean reboot);
/* pagefoldd (scanning only when told) in *d, and the guest of spec with
 * its agent, booted as far as pfguest's READY. */
Guest *daemon_and_guest(PfTestDaemon **d, PfGuestSpec *spec);
/* The guest's next check passes, then its whole run; frees it. */
void guest_passes(Guest *g);
/* The VM of that name in an array of VM objects; fails if there is
 * none. */
JsonObject *attached_vm(JsonArray *vms, const char *name);
/* One counter of the attached VM vm in a pagefoldctl stats answer. */
gint64 vm_counter(JsonNode *stats, const char *vm, const char *name);
/* The live regions pagefoldd lists for VM name (refused and gone ones
 * aside), G_MAXUINT while it is not attached; *addr_of gets the address
 * of the one named region (NULL: none asked). */
guint live_regions_if_attached(PfTestDaemon *d, const char *name, guint64 *addr_of,
                               const char *region);
/* Waits up to 60 s until pagefoldd lists want live regions for VM name. */
void wait_live_regions(PfTestDaemon *d, const char *name, guint want, guint64 *addr_of,
                       const char *region);

/* g_test_add_data_func() and g_test_add_func(), but in an ASan build a
 * path not under_asan is registered to skip, saying why. */
void add_data_func(const char *path, gconstpointer data, GTestDataFunc func,
                   gboolean under_asan);
void add_func(const char *path, GTestFunc func, gboolean under_asan);

/* Registers qemu-devices.c's paths. */
void qemu_devices_add_tests(void);
