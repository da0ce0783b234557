/*
 * qemu-common.c - what the paths of the qemu-test program (qemu-test.c,
 * qemu-devices.c) share (qemu-common.h): pfguest booted in the patched
 * QEMU with pagefoldd, what pagefoldd and the agent (x-query-pagefold) say
 * of it, and which paths an ASan build runs.
 *
 * Owns no guest or daemon beyond the call that hands it over.  Must never
 * wait without a deadline on a guest or on pagefoldd: a hung QEMU must
 * fail its path, not take the suite's 900 s.
 */
#include "qemu-common.h"

#include <string.h>

gint64
total(JsonNode *n, const char *name)
{
    return json_object_get_int_member(
        json_object_get_object_member(json_node_get_object(n), "total"), name);
}

gboolean
have_qemu(void)
{
    if (!pf_guest_available()) {
        g_test_skip("QEMU_BINARY and GUEST_KERNEL are not set: scripts/run-tests builds "
                    "QEMU and the guest and sets them");
        return FALSE;
    }
    return TRUE;
}

/* pfguest in 256 MiB of memfd shared RAM with the agent. */
Guest *
guest_start(const char *agent_sock, const char *name, int seed, int seconds, gboolean reboot)
{
    PfGuestSpec spec = { name, agent_sock, 256, FILL_MIB, seed, seconds, 4, reboot };

    return pf_test_guest_start(&spec);
}

/* pagefoldd (scanning only when told) and the guest of spec with its
 * agent, booted as far as pfguest's READY. */
Guest *
daemon_and_guest(PfTestDaemon **d, PfGuestSpec *spec)
{
    Guest *g;

    *d = pf_test_daemon_start("--set", "run=0", NULL);
    spec->agent_sock = (*d)->agent_sock;
    g = pf_test_guest_start(spec);
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    return g;
}

/* The guest's next check passes, then its whole run (told to end, it
 * powers off). */
void
guest_passes(Guest *g)
{
    g_free(pf_test_guest_expect(g, "PFGUEST CHECK ok", 60));
    g_free(pf_test_guest_expect_pass(g, 180));
    pf_test_guest_free(g);
}

JsonObject *
attached_vm(JsonArray *vms, const char *name)
{
    JsonObject *vm = pf_test_find_vm(vms, name);

    if (vm == NULL) {
        g_error("VM %s is not attached", name);
    }
    return vm;
}

gint64
vm_counter(JsonNode *stats, const char *vm, const char *name)
{
    JsonArray *vms = json_object_get_array_member(json_node_get_object(stats), "vms");

    return json_object_get_int_member(attached_vm(vms, vm), name);
}

/* The live regions pagefoldd lists for VM name (refused and gone ones
 * aside), G_MAXUINT while the VM is not attached (yet); *addr_of: the
 * address of the one named region. */
guint
live_regions_if_attached(PfTestDaemon *d, const char *name, guint64 *addr_of,
                         const char *region)
{
    g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);
    JsonObject *vm = pf_test_find_vm(json_node_get_array(list), name);
    JsonArray *regions;
    guint n = 0;

    if (vm == NULL) {
        return G_MAXUINT;
    }
    regions = json_object_get_array_member(vm, "regions");
    for (guint i = 0; i < json_array_get_length(regions); i++) {
        JsonObject *r = json_array_get_object_element(regions, i);

        if (json_object_has_member(r, "refused") || json_object_has_member(r, "gone")) {
            continue;
        }
        n++;
        if (region != NULL && g_str_equal(json_object_get_string_member(r, "name"), region)) {
            *addr_of = (guint64)json_object_get_int_member(r, "host_addr");
        }
    }
    return n;
}

/* Waits until pagefoldd lists want live regions for VM name: a region the
 * agent announces is checked off pagefoldd's main loop, so it is listed a
 * little after QEMU has done with it. */
void
wait_live_regions(PfTestDaemon *d, const char *name, guint want, guint64 *addr_of,
                  const char *region)
{
    for (int i = 0; live_regions_if_attached(d, name, addr_of, region) != want; i++) {
        if (i >= 3000) {
            g_error("VM %s: pagefoldd did not list %u live regions within 60 s", name, want);
        }
        g_usleep(20000);
    }
}

/*
 * Under ASan the suite runs the paths where pagefoldd meets real QEMUs
 * most: two guests merging, written and merged again; VMs rebooting,
 * restarting and shutting down, and pagefoldd restarting and adopting
 * them; memory plugged and unplugged; unmerges refused under DMA.  The
 * others boot guests to test QEMU and the agent, which no build here
 * instruments, with pagefoldd's paths those cover already: they say so
 * and skip, which keeps CI within its hour (with the whole suite under
 * ASan, CI took 62 minutes).
 */
#if defined(__SANITIZE_ADDRESS__)
#define SANITIZED TRUE
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SANITIZED TRUE
#endif
#endif
#ifndef SANITIZED
#define SANITIZED FALSE
#endif

static void
skip_sanitized(gconstpointer data)
{
    (void)data;
    g_test_skip("an ASan build runs only the paths where pagefoldd meets QEMU most");
}

void
add_data_func(const char *path, gconstpointer data, GTestDataFunc func, gboolean under_asan)
{
    g_test_add_data_func(path, data, SANITIZED && !under_asan ? skip_sanitized : func);
}

void
add_func(const char *path, GTestFunc func, gboolean under_asan)
{
    if (SANITIZED && !under_asan) {
        g_test_add_data_func(path, NULL, skip_sanitized);
    } else {
        g_test_add_func(path, func);
    }
}
