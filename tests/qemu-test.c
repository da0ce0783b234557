/*
 * qemu-test.c - the patched QEMU booting tiny Linux guests under TCG, with
 * memfd shared RAM and the pagefold agent, against the real pagefoldd.
 * Each guest runs pfguest (tests/guest/): it fills memory as real guests
 * do, keeps writing, checks every byte, and prints PASS or FAIL.
 *
 * The binaries come from scripts/build-qemu and scripts/build-guest
 * (scripts/run-tests exports QEMU_BINARY, GUEST_KERNEL, GUEST_INITRD).
 * TCG stands in for KVM, which this machine lacks.
 *
 * Owns the program's main and the paths of guests merging through their
 * whole life: merged, written, rebooted, shut down, pagefoldd killed and
 * restarted under them, RAM plugged and unplugged, RAM of every kind, the
 * agent silent or added late.  Devices and configurations that make
 * remapping unsafe, or safe only with care, are qemu-devices.c's.  Must
 * never depend on TCG: KVM follows remapped host pages through its MMU
 * notifier, and what passes here must pass there.
 */
#include <glib.h>
#include <glib/gstdio.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "qemu-common.h"
#include "testguest.h"
#include "testproc.h"
#include "util.h"

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
        g_free(pf_test_guest_expect_pass(g[i], 120));
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
    /* After 16 s, once told: rb0 reboots, rb1 powers off. */
    g[0] = guest_start(d->agent_sock, "rb0", 1, 16, TRUE);
    g[1] = guest_start(d->agent_sock, "rb1", 2, 16, FALSE);
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
    }
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    json_node_unref(s);

    /* rb0 reboots: the same RAM, rewritten by a fresh kernel and pfguest. */
    g_free(pf_test_guest_expect_pass(g[0], 120));
    g_free(pf_test_guest_expect(g[0], "PFGUEST READY", 120));
    s = pf_test_ctl_json(d, "scan-now", "2", NULL);
    json_node_unref(s);
    g_free(pf_test_guest_expect(g[0], "PFGUEST CHECK ok", 60));

    /* rb1 powers off while merged: its slots go with it. */
    g_free(pf_test_guest_expect_pass(g[1], 120));
    g_subprocess_wait(g[1]->proc, NULL, NULL);
    for (int i = 0; i < 1200; i++) {
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
    pf_test_daemon_kill(d);
    pf_test_daemon_restart(d, "--set", "run=0", NULL);
    g_free(pf_test_guest_expect(g[0], "PFGUEST CHECK ok", 60));
    g_free(pf_test_guest_expect_pass(g[0], 120));
    for (int i = 0; i < 2; i++) {
        pf_test_guest_free(g[i]);
    }
}

/* Whether pagefoldd lists every one of names in merge mode. */
static gboolean
all_merging(PfTestDaemon *d, const char *const *names, guint n)
{
    g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);
    JsonArray *vms = json_node_get_array(list);

    for (guint i = 0; i < n; i++) {
        JsonObject *vm = pf_test_find_vm(vms, names[i]);

        if (vm == NULL || !g_str_equal(json_object_get_string_member(vm, "mode"), "merge")) {
            return FALSE;
        }
    }
    return TRUE;
}

#define GUEST_RESTARTS 5

/*
 * Real guests writing and checking every byte all the while; pagefoldd
 * killed with -9 at random points of its passes, GUEST_RESTARTS times,
 * and started again: both VMs come back merging, what they had merged
 * taken back (it does not scan before they are back, so nothing is merged
 * again), and no guest check fails; an unmerge at the end gives every
 * page back.
 */
static void
test_restarts(void)
{
    const char *names[2] = { "rs0", "rs1" };
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    JsonNode *s = NULL;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    for (int i = 0; i < 2; i++) {
        g[i] = guest_start(d->agent_sock, names[i], i + 1, 30, FALSE);
    }
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
    }
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    g_clear_pointer(&s, json_node_unref);
    for (int round = 0; round < GUEST_RESTARTS; round++) {
        gint64 start, taken;

        json_node_unref(pf_test_ctl_json(d, "set", "run", "1", NULL));
        g_usleep(g_random_int_range(100000, 1500000));
        pf_test_daemon_kill(d);
        start = g_get_monotonic_time();
        pf_test_daemon_restart(d, "--set", "run=0", NULL);
        for (int i = 0; i < 600 && !all_merging(d, names, 2); i++) {
            g_usleep(100000);
        }
        g_assert_true(all_merging(d, names, 2));
        /* Taken back a slice at a time, from the main loop. */
        for (int i = 0; i < 500; i++) {
            g_clear_pointer(&s, json_node_unref);
            s = pf_test_ctl_json(d, "stats", NULL);
            taken = total(s, "pages_shared") + total(s, "pages_sharing") +
                    total(s, "zero_pages");
            if (taken >= FILL_PAGES / 2 * 9 / 10) {
                break;
            }
            g_usleep(10000);
        }
        g_test_message("restart %d: %" G_GINT64_FORMAT " pages taken back, both merging "
                       "%.2f s after the start", round, taken,
                       (double)(g_get_monotonic_time() - start) / G_USEC_PER_SEC);
        g_assert_cmpint(taken, >=, FILL_PAGES / 2 * 9 / 10);
        g_assert_cmpint(total(s, "pages_pending"), ==, 0);
        g_clear_pointer(&s, json_node_unref);
        for (int i = 0; i < 2; i++) {
            g_free(pf_test_guest_expect(g[i], "PFGUEST CHECK ok", 60));
        }
    }
    s = pf_test_ctl_json(d, "scan-now", "2", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES / 2 * 9 / 10);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(s), "pool_slots"), ==,
                    total(s, "pages_shared"));
    g_clear_pointer(&s, json_node_unref);
    json_node_unref(pf_test_ctl_json(d, "set", "run", "2", NULL));
    s = pf_test_ctl_json(d, "stats", NULL);
    g_assert_cmpint(total(s, "pages_shared") + total(s, "pages_sharing") +
                        total(s, "zero_pages"), ==, 0);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(s), "pool_slots"), ==, 0);
    json_node_unref(s);
    for (int i = 0; i < 2; i++) {
        guest_passes(g[i]);
    }
}

/* ---- a VM's whole life ---- */

/* The same for a VM that must be attached. */
static guint
live_regions(PfTestDaemon *d, const char *name)
{
    guint n = live_regions_if_attached(d, name, NULL, NULL);

    if (n == G_MAXUINT) {
        g_error("VM %s is not attached", name);
    }
    return n;
}

/* The agent's view of one region: merging, or why not (NULL: absent). */
static JsonObject *
agent_region(Guest *g, const char *name)
{
    g_autoptr(JsonObject) agent = pf_test_guest_agent_info(g);
    JsonArray *regions = json_object_get_array_member(agent, "regions");

    for (guint i = 0; i < json_array_get_length(regions); i++) {
        JsonObject *r = json_array_get_object_element(regions, i);

        if (g_str_equal(json_object_get_string_member(r, "name"), name)) {
            return json_object_ref(r);
        }
    }
    return NULL;
}

static void
assert_region_refused(Guest *g, const char *name, const char *why)
{
    g_autoptr(JsonObject) r = agent_region(g, name);

    if (r == NULL) {
        g_error("%s: region %s is not listed", g->name, name);
    }
    g_assert_false(json_object_get_boolean_member(r, "merging"));
    if (strstr(json_object_get_string_member(r, "reason"), why) == NULL) {
        g_error("%s: region %s: reason '%s' does not say '%s'", g->name, name,
                json_object_get_string_member(r, "reason"), why);
    }
}

/* The inode of what pid maps at addr. */
static guint64
mapped_inode(int pid, guint64 addr)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/maps", pid);
    g_autofree char *text = NULL;
    g_auto(GStrv) lines = NULL;

    g_assert_true(g_file_get_contents(path, &text, NULL, NULL));
    lines = g_strsplit(text, "\n", -1);
    for (char **l = lines; *l && **l; l++) {
        guint64 lo, hi, ino;

        if (sscanf(*l,
                   "%" G_GINT64_MODIFIER "x-%" G_GINT64_MODIFIER "x %*s %*s %*s %"
                   G_GUINT64_FORMAT, &lo, &hi, &ino) == 3 && addr >= lo && addr < hi) {
            return ino;
        }
    }
    g_error("nothing mapped at 0x%" G_GINT64_MODIFIER "x in %d", addr, pid);
}

/* Does pid hold inode (a shmem file) open or mapped? */
static gboolean
holds_inode(int pid, guint64 ino)
{
    g_autofree char *fds = g_strdup_printf("/proc/%d/fd", pid);
    g_autofree char *maps = g_strdup_printf("/proc/%d/maps", pid);
    g_autofree char *text = NULL;
    g_autofree char *needle = g_strdup_printf(" %" G_GUINT64_FORMAT " ", ino);
    g_autoptr(GDir) dir = g_dir_open(fds, 0, NULL);
    const char *e;

    while (dir != NULL && (e = g_dir_read_name(dir)) != NULL) {
        g_autofree char *fd = g_build_filename(fds, e, NULL);
        struct stat st;

        if (stat(fd, &st) == 0 && (guint64)st.st_ino == ino && S_ISREG(st.st_mode) &&
            st.st_nlink == 0) {
            return TRUE;
        }
    }
    g_assert_true(g_file_get_contents(maps, &text, NULL, NULL));
    return strstr(text, needle) != NULL;
}

/*
 * Memory hotplug: a memfd DIMM plugged into a merging VM is handed to the
 * agent and merges (the guest fills part of it, and checks it); unplugged
 * (the guest gives it back), its merged pages are folded back and
 * pagefoldd forgets it; its backend deleted, no process holds its memory
 * any more.  A spare backend (not plugged) is no guest RAM.
 */
static void
test_hotplug(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    PfGuestSpec spec = { "dimm0", NULL, 256, 16, 1, 150, 4, FALSE, FALSE, NULL,
                         "memhp_default_state=online_movable pfguest.late_mib=48", 1024 };
    guint64 dimm = 0, ino;
    gint64 zeroed;
    JsonNode *s, *n;
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    g = daemon_and_guest(&d, &spec);
    json_node_unref(pf_test_guest_qmp(g, "object-add",
                                      "{\"qom-type\": \"memory-backend-memfd\", \"id\": \"mem1\","
                                      " \"size\": 134217728, \"share\": true}"));
    wait_live_regions(d, g->name, 1, NULL, NULL);
    json_node_unref(pf_test_guest_qmp(g, "device_add",
                                      "{\"driver\": \"pc-dimm\", \"id\": \"dimm1\","
                                      " \"memdev\": \"mem1\"}"));
    g_free(pf_test_guest_expect(g, "PFGUEST LATE filled", 120));
    wait_live_regions(d, g->name, 2, &dimm, "mem1");
    g_assert_cmpuint(dimm, !=, 0);
    ino = mapped_inode(g->pid, dimm); /* its memfd, before any merge */

    /* Half the late memory is zero pages, in the DIMM. */
    zeroed = pf_test_guest_agent_stat(g, "zeroed");
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    json_node_unref(s);
    g_assert_cmpint(pf_test_guest_agent_stat(g, "zeroed") - zeroed, >=, 48 * 256 / 2 * 9 / 10);
    g_assert_cmpint(pf_test_count_vmas(g->pid, dimm, 128 << 20), >, 1);
    g_free(pf_test_guest_expect(g, "PFGUEST CHECK ok", 60));

    /* Unplugged: the guest moves its late memory out and gives it back. */
    json_node_unref(pf_test_guest_qmp(g, "device_del", "{\"id\": \"dimm1\"}"));
    for (int i = 0; i < 1200; i++) {
        n = pf_test_guest_qmp(g, "query-memory-devices", NULL);
        if (json_array_get_length(json_node_get_array(n)) == 0) {
            json_node_unref(n);
            break;
        }
        json_node_unref(n);
        g_assert_cmpint(i, <, 1199);
        g_usleep(100000);
    }
    g_assert_cmpuint(live_regions(d, g->name), ==, 1);
    json_node_unref(pf_test_guest_qmp(g, "object-del", "{\"id\": \"mem1\"}"));
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    json_node_unref(s);
    /* QEMU frees the RAM block after an RCU grace period. */
    for (int i = 0; i < 100 && holds_inode(g->pid, ino); i++) {
        g_usleep(100000);
    }
    g_assert_false(holds_inode(g->pid, ino));
    g_assert_false(holds_inode(pf_test_daemon_pid(d), ino));
    guest_passes(g);
}

/*
 * Guest RAM of every kind in one VM, one NUMA node each: a memfd with
 * dump=off (merged, and its remapped pages not dumped either), a file on a
 * disk file system (not a memfd: skipped), a preallocated memfd (kept
 * allocated by default), a memfd with merge=off, a memfd bound to a host
 * node (pool pages would not follow the binding: refused), and a spare
 * backend (no guest RAM).  The odd ones cost the first nothing.  Then
 * qom-set merge=off folds the first back and forgets it; dump=on and
 * merge=on hand it over again, its remapped pages dumped now.
 */
static void
test_regions(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *dir = g_dir_make_tmp("pagefold-file-XXXXXX", NULL);
    g_autofree char *file = g_strdup_printf(
        "memory-backend-file,id=m1,size=32M,share=on,mem-path=%s/m1", dir);
    const char *extra[] = {
        "-object", "memory-backend-memfd,id=m0,size=192M,share=on,dump=off",
        "-object", file,
        "-object", "memory-backend-memfd,id=m2,size=32M,share=on,prealloc=on",
        "-object", "memory-backend-memfd,id=m3,size=32M,share=on,merge=off",
        "-object", "memory-backend-memfd,id=m4,size=32M,share=on,host-nodes=0,policy=bind",
        "-object", "memory-backend-memfd,id=spare,size=32M,share=on",
        "-numa", "node,nodeid=0,memdev=m0", "-numa", "node,nodeid=1,memdev=m1",
        "-numa", "node,nodeid=2,memdev=m2", "-numa", "node,nodeid=3,memdev=m3",
        "-numa", "node,nodeid=4,memdev=m4", NULL,
    };
    PfGuestSpec spec = { "kinds0", NULL, 320, 32, 1, 90, 4, FALSE, FALSE, extra, NULL, 0, TRUE };
    g_autoptr(JsonObject) m0 = NULL;
    guint64 m0_addr = 0;
    gint64 vmas;
    Guest *g;
    JsonNode *s;

    if (!have_qemu()) {
        return;
    }
    g = daemon_and_guest(&d, &spec);
    {
        g_autoptr(JsonObject) agent = pf_test_guest_agent_info(g);

        g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "merge");
        g_assert_false(json_object_get_boolean_member(agent, "merge-prealloc"));
    }
    m0 = agent_region(g, "m0");
    g_assert_nonnull(m0);
    g_assert_true(json_object_get_boolean_member(m0, "merging"));
    assert_region_refused(g, "m1", "not a memfd");
    assert_region_refused(g, "m2", "prealloc");
    assert_region_refused(g, "m3", "merge=off");
    assert_region_refused(g, "m4", "NUMA");
    g_assert_null(agent_region(g, "spare"));
    wait_live_regions(d, g->name, 1, &m0_addr, "m0");

    /* m0 merges; its remapped pages carry its dump=off, nothing else is
     * write-protected. */
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(vm_counter(s, g->name, "zero_pages"), >=, 32 * 256 / 5 * 9 / 10);
    json_node_unref(s);
    vmas = pf_test_count_vmas(g->pid, m0_addr, 192 << 20);
    g_assert_cmpint(vmas, >, 1);
    g_assert_cmpint(pf_test_count_vmas_flag(g->pid, m0_addr, 192 << 20, "dd"), ==, vmas);
    g_assert_cmpint(pf_test_count_vmas_flag(g->pid, 0, 0, "uw"), ==,
                    pf_test_count_vmas_flag(g->pid, m0_addr, 192 << 20, "uw"));
    g_free(pf_test_guest_expect(g, "PFGUEST CHECK ok", 60));

    /* merge=off: m0's pages come back, pagefoldd forgets it. */
    json_node_unref(pf_test_guest_qmp(g, "qom-set",
                                      "{\"path\": \"/objects/m0\", \"property\": \"merge\","
                                      " \"value\": false}"));
    g_assert_cmpint(pf_test_guest_agent_stat(g, "remapped"), ==, 0);
    g_assert_cmpint(pf_test_count_vmas(g->pid, m0_addr, 192 << 20), ==, 1);
    g_assert_cmpint(pf_test_count_vmas_flag(g->pid, 0, 0, "uw"), ==, 0);
    g_assert_cmpuint(live_regions(d, g->name), ==, 0);
    assert_region_refused(g, "m0", "merge=off");
    /* The guest reads every page it wrote: the zero pages folded back
     * (holes in the memfd) are allocated again, for the next merge. */
    pf_test_guest_check_now(g);

    /* dump=on, then merge=on: merged again, and dumped now. */
    json_node_unref(pf_test_guest_qmp(g, "qom-set",
                                      "{\"path\": \"/objects/m0\", \"property\": \"dump\","
                                      " \"value\": true}"));
    json_node_unref(pf_test_guest_qmp(g, "qom-set",
                                      "{\"path\": \"/objects/m0\", \"property\": \"merge\","
                                      " \"value\": true}"));
    wait_live_regions(d, g->name, 1, NULL, NULL);
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(vm_counter(s, g->name, "zero_pages"), >=, 32 * 256 / 5 * 9 / 10);
    json_node_unref(s);
    g_assert_cmpint(pf_test_count_vmas(g->pid, m0_addr, 192 << 20), >, 1);
    g_assert_cmpint(pf_test_count_vmas_flag(g->pid, m0_addr, 192 << 20, "dd"), ==, 0);
    guest_passes(g);
    {
        g_autofree char *m1 = g_build_filename(dir, "m1", NULL);

        g_unlink(m1);
        g_rmdir(dir);
    }
}

/*
 * pagefoldd accepts the connection and never answers: QEMU starts, QMP
 * answers, the guest runs and checks its memory, unmerged; the agent says
 * it is not connected, and why.  A second agent is refused, and the agent
 * cannot be deleted.
 */
static void
test_silent_pagefoldd(void)
{
    g_autofree char *dir = g_dir_make_tmp("pagefold-silent-XXXXXX", NULL);
    g_autofree char *path = g_build_filename(dir, "agent.sock", NULL);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    PfGuestSpec spec = { "silent0", path, 128, 16, 1, 30, 4, FALSE };
    g_autoptr(JsonObject) agent = NULL;
    g_autofree char *err = NULL;
    const char *reason = "";
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    g_strlcpy(addr.sun_path, path, sizeof(addr.sun_path));
    g_assert_cmpint(bind(listen_fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    g_assert_cmpint(listen(listen_fd, 4), ==, 0); /* and never accept */
    g = pf_test_guest_start(&spec);
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    for (int i = 0; i < 300; i++) {
        g_clear_pointer(&agent, json_object_unref);
        agent = pf_test_guest_agent_info(g);
        g_assert_false(json_object_get_boolean_member(agent, "connected"));
        g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "advise");
        reason = json_object_has_member(agent, "reason")
                     ? json_object_get_string_member(agent, "reason") : "";
        if (strstr(reason, "did not answer") != NULL) {
            break;
        }
        g_usleep(100000);
    }
    g_test_message("silent0: %s", reason);
    g_assert_nonnull(strstr(reason, "did not answer"));
    err = pf_test_guest_qmp_error(g, "object-add",
                                  "{\"qom-type\": \"x-pagefold-agent\", \"id\": \"pf1\","
                                  " \"socket\": \"/nonexistent\"}");
    g_test_message("silent0: second agent: %s", err);
    g_assert_nonnull(strstr(err, "one agent"));
    guest_passes(g);
    close(listen_fd);
    unlink(path);
    g_rmdir(dir);
}

/*
 * The agent created at run time (object-add): an unreachable socket is an
 * error, nothing created; with pagefoldd's socket the VM merges from then
 * on; a second agent is refused, and the socket cannot change.
 */
static void
test_object_add(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    const char *extra[] = { "-object", "memory-backend-memfd,id=ram,size=128M,share=on",
                            "-machine", "memory-backend=ram", NULL };
    PfGuestSpec spec = { "late0", NULL, 128, 16, 1, 40, 4, FALSE, FALSE, extra, NULL, 0,
                         TRUE };
    g_autofree char *err = NULL, *args = NULL, *json = NULL;
    g_autoptr(JsonObject) agent = NULL;
    JsonNode *s, *n;
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g = pf_test_guest_start(&spec);
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    n = pf_test_guest_qmp(g, "x-query-pagefold", NULL);
    g_assert_cmpuint(json_array_get_length(json_node_get_array(n)), ==, 0);
    json_node_unref(n);

    err = pf_test_guest_qmp_error(g, "object-add",
                                  "{\"qom-type\": \"x-pagefold-agent\", \"id\": \"pf0\","
                                  " \"socket\": \"/nonexistent/agent.sock\"}");
    g_test_message("late0: %s", err);
    g_assert_nonnull(strstr(err, "cannot connect"));
    n = pf_test_guest_qmp(g, "x-query-pagefold", NULL);
    g_assert_cmpuint(json_array_get_length(json_node_get_array(n)), ==, 0);
    json_node_unref(n);

    args = g_strdup_printf("{\"qom-type\": \"x-pagefold-agent\", \"id\": \"pf0\","
                           " \"socket\": \"%s\"}", d->agent_sock);
    json_node_unref(pf_test_guest_qmp(g, "object-add", args));
    for (int i = 0; i < 1200; i++) {
        g_clear_pointer(&agent, json_object_unref);
        agent = pf_test_guest_agent_info(g);
        if (json_object_get_boolean_member(agent, "connected")) {
            break;
        }
        g_usleep(100000);
    }
    g_assert_true(json_object_get_boolean_member(agent, "connected"));
    g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "merge");
    wait_live_regions(d, g->name, 1, NULL, NULL);
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(vm_counter(s, g->name, "zero_pages"), >=, 16 * 256 / 5 * 9 / 10);
    json_node_unref(s);

    g_clear_pointer(&err, g_free);
    err = pf_test_guest_qmp_error(g, "object-add",
                                  "{\"qom-type\": \"x-pagefold-agent\", \"id\": \"pf1\","
                                  " \"socket\": \"/nonexistent/agent.sock\"}");
    g_assert_nonnull(strstr(err, "one agent"));
    g_clear_pointer(&err, g_free);
    err = pf_test_guest_qmp_error(g, "qom-set",
                                  "{\"path\": \"/objects/pf0\", \"property\": \"socket\","
                                  " \"value\": \"/elsewhere\"}");
    g_assert_nonnull(strstr(err, "cannot change"));
    guest_passes(g);
}

/* VMs without -name: QEMU calls them all "qemu"; both attach and merge,
 * told apart by their pids, and QMP says they are connected. */
static void
test_no_name(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    JsonNode *list;
    JsonArray *vms;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    for (int i = 0; i < 2; i++) {
        PfGuestSpec spec = { "noname", d->agent_sock, 128, 16, i + 1, 20, 4, FALSE, FALSE, NULL,
                             NULL, 0, FALSE, TRUE };

        g[i] = pf_test_guest_start(&spec);
    }
    for (int i = 0; i < 2; i++) {
        g_autoptr(JsonObject) agent = NULL;

        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
        for (int k = 0; k < 100; k++) {
            g_clear_pointer(&agent, json_object_unref);
            agent = pf_test_guest_agent_info(g[i]);
            if (json_object_get_boolean_member(agent, "connected")) {
                break;
            }
            g_usleep(100000);
        }
        g_assert_true(json_object_get_boolean_member(agent, "connected"));
        g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "merge");
    }
    list = pf_test_ctl_json(d, "list", NULL);
    vms = json_node_get_array(list);
    g_assert_cmpuint(json_array_get_length(vms), ==, 2);
    for (guint i = 0; i < 2; i++) {
        JsonObject *vm = json_array_get_object_element(vms, i);

        g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
    }
    json_node_unref(list);
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect_pass(g[i], 120));
        pf_test_guest_free(g[i]);
    }
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    /* Under ASan (TRUE), only what the agent suites' ASan runs with
     * stand-ins do not reach: real guests merging, pagefoldd killed and
     * taking real VMs back, pinned reads (odirect/native).  pagefoldd's
     * paths for a VM that exits or loses its RAM (/agent/kill-vmm,
     * /agent-proto/discard-stalled) and for hotplug
     * (/agent-proto/plug-unplug) run there already. */
    add_func("/qemu/two-guests", test_two_guests, TRUE);
    add_func("/qemu/reboot-restart-shutdown", test_reboot_restart_shutdown, FALSE);
    add_func("/qemu/restarts", test_restarts, TRUE);
    /* qemu-devices.c's paths, here where they were registered before the
     * file was split: gtest runs a suite's own paths first, then its
     * sub-suites in the order each was first named, so the run order is
     * unchanged (/qemu/balloon and /qemu/ivshmem with the first three,
     * /qemu/advise/ and /qemu/odirect/ before /qemu/life/). */
    qemu_devices_add_tests();
    add_func("/qemu/life/hotplug", test_hotplug, FALSE);
    add_func("/qemu/life/regions", test_regions, FALSE);
    add_func("/qemu/life/silent-pagefoldd", test_silent_pagefoldd, FALSE);
    add_func("/qemu/life/no-name", test_no_name, FALSE);
    add_func("/qemu/life/object-add", test_object_add, FALSE);
    return g_test_run();
}
