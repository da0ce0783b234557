/*
 * qemu-test.c - the patched QEMU booting tiny Linux guests under TCG, with
 * memfd shared RAM and the pagefold agent, against the real pagefoldd.
 * Each guest runs pfguest (tests/guest/): it fills memory as real guests
 * do, keeps writing, checks every byte, and prints PASS or FAIL.
 *
 * The binaries come from scripts/build-qemu and scripts/build-guest
 * (scripts/run-tests exports QEMU_BINARY, GUEST_KERNEL, GUEST_INITRD).
 * TCG stands in for KVM, which this machine lacks; nothing here depends on
 * TCG: KVM follows remapped host pages through its MMU notifier.
 */
#include <fcntl.h>
#include <signal.h>
#include <glib.h>
#include <string.h>
#include <sys/stat.h>

#include "testguest.h"
#include "testproc.h"
#include "util.h"

#define FILL_MIB 64
#define FILL_PAGES (FILL_MIB * 256)

static gint64
total(JsonNode *n, const char *name)
{
    return json_object_get_int_member(
        json_object_get_object_member(json_node_get_object(n), "total"), name);
}

static gboolean
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
static Guest *
guest_start(const char *agent_sock, const char *name, int seed, int seconds, gboolean reboot)
{
    PfGuestSpec spec = { name, agent_sock, 256, FILL_MIB, seed, seconds, 4, reboot };

    return pf_test_guest_start(&spec);
}

/* Two guests merge what pfguest makes identical and zero, guest memory
 * falls by that much, and both check every byte while merged, written
 * (copy-on-write) and merged again. */
static void
test_two_guests(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    gint64 before[2];
    JsonNode *s = NULL;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g[0] = guest_start(d->agent_sock, "tcg0", 1, 40, FALSE);
    g[1] = guest_start(d->agent_sock, "tcg1", 2, 40, FALSE);

    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
        before[i] = pf_test_memfd_kib(g[i]->pid);
    }
    /* Merge while the guests run and write; a few passes settle it. */
    for (int pass = 0; pass < 4; pass++) {
        g_clear_pointer(&s, json_node_unref);
        s = pf_test_ctl_json(d, "scan-now", "2", NULL);
    }
    g_assert_cmpstr(json_object_get_string_member(json_node_get_object(s), "mode"), ==,
                    "merge");
    /* pfguest's identical pages, at the least, are shared across the two. */
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    g_assert_cmpint(total(s, "zero_pages"), >=, 2 * FILL_PAGES / 5 * 9 / 10);
    for (int i = 0; i < 2; i++) {
        gint64 after = pf_test_memfd_kib(g[i]->pid);

        g_test_message("%s: memfd %" G_GINT64_FORMAT " KiB -> %" G_GINT64_FORMAT " KiB",
                       g[i]->name, before[i], after);
        /* Each guest's memfd lost at least its zero pages and its share of
         * the identical ones (the pool holds one copy for both). */
        g_assert_cmpint(before[i] - after, >=, (FILL_PAGES / 5 + FILL_PAGES / 4) * 4 * 9 / 10);
    }
    /* The guests check everything while merged, and at the end. */
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST CHECK ok", 60));
        g_free(pf_test_guest_expect(g[i], "PFGUEST PASS", 120));
    }
    json_node_unref(s);
    for (int i = 0; i < 2; i++) {
        pf_test_guest_free(g[i]);
    }
}

/* Merged, then: one guest reboots (its RAM is rewritten over merged
 * pages), pagefoldd is killed and started again, the other guest powers
 * off.  No guest fails its checks; the stopped VM's slots are freed. */
static void
test_reboot_restart_shutdown(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    JsonNode *s = NULL;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g[0] = guest_start(d->agent_sock, "rb0", 1, 16, TRUE);  /* reboots after 16 s */
    g[1] = guest_start(d->agent_sock, "rb1", 2, 16, FALSE); /* powers off after 16 s */
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
    }
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    json_node_unref(s);

    /* rb0 reboots: the same RAM, rewritten by a fresh kernel and pfguest. */
    g_free(pf_test_guest_expect(g[0], "PFGUEST PASS", 120));
    g_free(pf_test_guest_expect(g[0], "PFGUEST READY", 120));
    s = pf_test_ctl_json(d, "scan-now", "2", NULL);
    json_node_unref(s);
    g_free(pf_test_guest_expect(g[0], "PFGUEST CHECK ok", 60));

    /* rb1 powers off while merged: its slots go with it. */
    g_free(pf_test_guest_expect(g[1], "PFGUEST PASS", 120));
    g_subprocess_wait(g[1]->proc, NULL, NULL);
    for (int i = 0; i < 100; i++) {
        s = pf_test_ctl_json(d, "list", NULL);
        if (json_array_get_length(json_node_get_array(s)) == 1) {
            json_node_unref(s);
            break;
        }
        json_node_unref(s);
        g_usleep(100000);
    }
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(s), "pool_slots"), ==,
                    total(s, "pages_shared"));
    json_node_unref(s);

    /* pagefoldd killed and started again: rb0 runs on, merged pages valid. */
    g_subprocess_send_signal(d->proc, SIGKILL);
    g_subprocess_wait(d->proc, NULL, NULL);
    pf_test_daemon_restart(d, "--set", "run=0", NULL);
    g_free(pf_test_guest_expect(g[0], "PFGUEST CHECK ok", 60));
    g_free(pf_test_guest_expect(g[0], "PFGUEST PASS", 120));
    for (int i = 0; i < 2; i++) {
        pf_test_guest_free(g[i]);
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/qemu/two-guests", test_two_guests);
    g_test_add_func("/qemu/reboot-restart-shutdown", test_reboot_restart_shutdown);
    return g_test_run();
}
