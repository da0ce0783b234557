/*
 * agent-trust-test.c - stand-in VMMs that are not root, as QEMU under
 * libvirt is not, against the real pagefoldd: one that libvirt's status
 * file names is vouched for (it gets /dev/userfaultfd and merges, its
 * merge domain read from the domain's XML there), any other process of
 * the agent socket's group shares with none but itself, and a flood of
 * those keeps no vouched VM out.
 *
 * Environment: PAGEFOLD_TEST_TCG_GUEST (set in the kernel suite's guest)
 * skips /agent/flood-same-uid: it tests pagefoldd's handshake places, no
 * kernel mechanism, and two emulated vCPUs cannot keep up with the flood.
 *
 * Owns: the libvirt status files it writes, in run directories of its own,
 * and vm.unprivileged_userfaultfd while /agent/not-vouched runs.  It must
 * never write into libvirt's real run directory, and puts the sysctl back.
 */
#include <glib.h>
#include <glib/gstdio.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "agent-helpers.h"
#include "guestmem.h"
#include "testproc.h"

/*
 * A stand-in as nobody that libvirt vouches for: root writes libvirt's
 * status file of domain name in run_dir, naming the process's pid, and
 * only then is it the stand-in (exec, as libvirtd lets the QEMU it forked
 * exec only after it wrote that file).
 */
static Vmm *
vmm_launch_vouched_in(PfTestDaemon *d, const char *run_dir, const char *name, int seed,
                      const char *extra, const char *domain_xml)
{
    g_autofree char *status = g_strdup_printf("%s/%s.xml", run_dir, name);
    g_autofree char *guest = g_strdup_printf("guest=%s", name);
    g_autofree char *seedarg = g_strdup_printf("%d", seed);
    g_autofree char *mib = g_strdup_printf("%d", MIB);
    /* By path: the shell may have a setpriv of its own (busybox's, in the
     * kernel suite's guest) that knows no --reuid. */
    g_autofree char *setpriv = g_find_program_in_path("setpriv");
    const char *argv[] = {
        "sh", "-c",
        "umask 022 && printf \"<domstatus state='running' reason='booted' pid='%s'>\\n%s"
        "</domstatus>\\n\" $$ \"$1\" >\"$0\" && shift && exec \"$@\"",
        status, domain_xml != NULL ? domain_xml : "",
        setpriv != NULL ? setpriv : "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket", d->agent_sock,
        "--mib", mib, "--seed", seedarg, "--writers", "1", extra, NULL
    };
    Vmm *v = pf_test_vmm_spawn(argv);

    g_assert_nonnull(v);
    return v;
}

static Vmm *
vmm_start_vouched_in(PfTestDaemon *d, const char *run_dir, const char *name, int seed,
                     const char *extra, const char *domain_xml)
{
    Vmm *v = vmm_launch_vouched_in(d, run_dir, name, seed, extra, domain_xml);

    pf_test_daemon_wait_vmm(d, v);
    return v;
}

static Vmm *
vmm_start_vouched(PfTestDaemon *d, const char *run_dir, const char *name, int seed,
                  const char *extra)
{
    return vmm_start_vouched_in(d, run_dir, name, seed, extra, NULL);
}

/* QEMU under libvirt is not root: the agent makes its userfaultfd from
 * the /dev/userfaultfd fd pagefoldd passes to the QEMU libvirt's status
 * file names (vmm_start_vouched()), and merging works.  Any
 * process of the agent socket's group may be such an agent (a compromised
 * QEMU reconnecting, or forking one, to leave its merge domain): each
 * shares pages with none but itself until root says its domain, as
 * libvirt's hook does. */
static void
test_unprivileged(void)
{
    /* The stand-ins run as nobody:nogroup, as QEMU as libvirt-qemu. */
    g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-group",
                                                     "nogroup", "--libvirt-run-dir", run_dir,
                                                     NULL);
    Vmm *a, *b;
    g_autoptr(JsonObject) s = NULL;
    g_autoptr(JsonObject) vm = NULL;

    g_chmod(d->dir, 0755);
    /* One writer each, at a tenth of the others' pace: a pass of Debian
     * 12's 6.1 under TCG takes about a second, in which 2000 writes a
     * second left no page unchanged for two visits (seen: 6 pages sharing
     * after 40 passes, cow 9245), so sharing never came. */
    a = vmm_start_vouched(d, run_dir, "u0", 1, "--writes-per-sec=200");
    b = vmm_start_vouched(d, run_dir, "u1", 2, "--writes-per-sec=200");
    g_assert_cmpstr(a->mode, ==, "merge");
    g_assert_cmpstr(b->mode, ==, "merge");
    s = stats(d, "scan-now", "3");
    g_assert_cmpint(total(s, "pages_sharing"), <, IDENTICAL / 2);
    vm = json_object_ref(pf_test_find_vm(json_object_get_array_member(s, "vms"), "u0"));
    g_assert_cmpstr(json_object_get_string_member(vm, "merge_domain"), ==, "unlabelled");
    g_clear_pointer(&s, json_object_unref);
    json_node_unref(pf_test_ctl_json(d, "merge-domain", "u0", "default", NULL));
    json_node_unref(pf_test_ctl_json(d, "merge-domain", "u1", "default", NULL));
    /* Passes until they share: on Debian 12's 6.1 under TCG three were not
     * always enough (its writers, above). */
    for (int i = 0; i < 40 && (s == NULL || total(s, "pages_sharing") <= IDENTICAL / 2); i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "scan-now", "1");
    }
    g_assert_cmpint(total(s, "pages_sharing"), >, IDENTICAL / 2);
    pf_test_vmm_verify(a);
    pf_test_vmm_verify(b);
    pf_test_vmm_quit(a);
    pf_test_vmm_quit(b);
    pf_test_write_libvirt_status(run_dir, "u0", NULL);
    pf_test_write_libvirt_status(run_dir, "u1", NULL);
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
}

/*
 * libvirt's QEMU, not root, whose status file holds its domain's XML with
 * a merge domain in pagefold's <metadata>: its VM is in that domain from
 * the moment its agent connects, with no hook to say so, and merges with
 * the other VM of the domain.  A pagefoldd killed and started again finds
 * both there again, and takes back the pages they shared.
 */
static void
test_libvirt_domain(void)
{
    g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
    const char *args[] = { "--set", "run=0", "--agent-group", "nogroup", "--libvirt-run-dir",
                           run_dir, NULL };
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start(args[0], args[1], args[2], args[3],
                                                     args[4], args[5], NULL);
    const char *names[2] = { "blue0", "blue1" };
    const char *uuids[2] = { "4f0c6a4e-3a1b-4e8e-9a51-8f5a0c1d2e01",
                             "4f0c6a4e-3a1b-4e8e-9a51-8f5a0c1d2e02" };
    Vmm *v[2];
    g_autoptr(JsonObject) s = NULL;
    gint64 sharing;

    g_chmod(d->dir, 0755);
    for (int i = 0; i < 2; i++) {
        g_autofree char *xml = g_strdup_printf(
            "<domain type='kvm'><name>%s</name><uuid>%s</uuid><metadata>"
            "<pagefold:config xmlns:pagefold='urn:pagefold:domain:1' merge-domain='blue'/>"
            "</metadata><memoryBacking><source type='memfd'/><access mode='shared'/>"
            "</memoryBacking></domain>\n",
            names[i], uuids[i]);
        g_autofree char *domain = NULL;
        g_autoptr(JsonObject) vm = NULL;

        v[i] = vmm_start_vouched_in(d, run_dir, names[i], i + 1, "--writes-per-sec=200", xml);
        domain = listed_domain(d, names[i]);
        g_assert_cmpstr(domain, ==, "blue");
        vm = pf_test_listed_vm(d, names[i]);
        g_assert_cmpstr(json_object_get_string_member(vm, "uuid"), ==, uuids[i]);
    }
    {
        /* A mistake in the element (an attribute of another name): the
         * hook attaches nothing, and the VM shares with nobody. */
        Vmm *t = vmm_start_vouched_in(
            d, run_dir, "typo", 3, "--writes-per-sec=200",
            "<domain type='kvm'><name>typo</name><uuid>4f0c6a4e-3a1b-4e8e-9a51-8f5a0c1d2e03"
            "</uuid><metadata><pagefold:config xmlns:pagefold='urn:pagefold:domain:1' "
            "merge_domain='blue'/></metadata><memoryBacking><source type='memfd'/><access "
            "mode='shared'/></memoryBacking></domain>\n");
        g_autofree char *domain = listed_domain(d, "typo");

        g_assert_cmpstr(domain, ==, "unlabelled");
        pf_test_vmm_verify(t);
        pf_test_vmm_quit(t);
        pf_test_write_libvirt_status(run_dir, "typo", NULL);
    }
    for (int i = 0; i < 40 && (s == NULL || total(s, "pages_sharing") <= IDENTICAL / 2); i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "scan-now", "1");
    }
    sharing = total(s, "pages_sharing");
    g_assert_cmpint(sharing, >, IDENTICAL / 2);

    pf_test_daemon_kill(d);
    for (int i = 0; i < 2; i++) {
        wait_disconnected(v[i]);
    }
    pf_test_daemon_restart(d, args[0], args[1], args[2], args[3], args[4], args[5], NULL);
    g_chmod(d->dir, 0755);
    for (int i = 0; i < 2; i++) {
        assert_back_in(d, names[i], "blue");
    }
    /* Taken back, a slice at a time, not merged again (it does not scan):
     * the writers copied a few on write. */
    for (int i = 0; i < 500; i++) {
        g_clear_pointer(&s, json_object_unref);
        s = stats(d, "stats", NULL);
        if (total(s, "pages_sharing") > sharing * 9 / 10) {
            break;
        }
        g_usleep(10000);
    }
    g_assert_cmpint(total(s, "pages_sharing"), >, sharing * 9 / 10);
    g_assert_cmpint(total(s, "pages_pending"), ==, 0);
    for (int i = 0; i < 2; i++) {
        pf_test_vmm_verify(v[i]);
        pf_test_vmm_quit(v[i]);
        pf_test_write_libvirt_status(run_dir, names[i], NULL);
    }
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
}

/* vm.unprivileged_userfaultfd, set for a test and given back after it. */
#define UNPRIVILEGED_UFFD "/proc/sys/vm/unprivileged_userfaultfd"

static char *
unprivileged_uffd_set(const char *value)
{
    g_autofree char *old = NULL;

    if (!g_file_get_contents(UNPRIVILEGED_UFFD, &old, NULL, NULL) ||
        !pf_test_write_sysfs(UNPRIVILEGED_UFFD, value)) {
        return NULL;
    }
    return g_strstrip(g_steal_pointer(&old));
}

/* Polls pagefoldd's list until it has process pid; FALSE after
 * timeout_s. */
static gboolean
wait_listed_pid(PfTestDaemon *d, int pid, double timeout_s)
{
    gint64 end = g_get_monotonic_time() + (gint64)(timeout_s * G_USEC_PER_SEC);

    for (;;) {
        g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);

        if (pf_test_find_vm_pid(json_node_get_array(list), pid) != NULL) {
            return TRUE;
        }
        if (g_get_monotonic_time() > end) {
            return FALSE;
        }
        g_usleep(50000);
    }
}

/*
 * A flood of handshakes from the very uid libvirt runs every QEMU as (32
 * processes of nobody, as a compromised QEMU could make, reconnecting in
 * a loop) keeps no VM out: the three QEMUs libvirt's status files name
 * attach during the flood, in merge mode, on places the flood cannot
 * take; three stand-ins of that uid that root vouched for none of may
 * lose their handshakes to it, and attach once it is over, their agents
 * trying again as they were told to (PF_ERROR_TRY_AGAIN).
 */
static void
test_flood_same_uid(void)
{
    g_autofree char *run_dir = g_dir_make_tmp("pagefold-run-XXXXXX", NULL);
    g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-group",
                                                     "nogroup", "--libvirt-run-dir", run_dir,
                                                     NULL);
    Vmm *vouched[3], *others[3];
    int flooders[32];
    gint64 t0;

    if (g_getenv("PAGEFOLD_TEST_TCG_GUEST") != NULL) {
        g_test_skip("32 flooding processes outpace pagefoldd on two emulated vCPUs: the "
                    "flood tests its handshake places, no kernel mechanism (host only)");
        g_rmdir(run_dir);
        return;
    }
    g_chmod(d->dir, 0755);
    for (guint i = 0; i < G_N_ELEMENTS(flooders); i++) {
        flooders[i] = pf_test_flooder(d, 0);
    }
    g_usleep(G_USEC_PER_SEC); /* the flood under way */
    /* Their first try may find the kernel's listen queue full, or a busy
     * machine may keep their handshake over its 5 s: they try again, as
     * QEMU does, and attach while the flood goes on. */
    for (guint i = 0; i < G_N_ELEMENTS(vouched); i++) {
        g_autofree char *name = g_strdup_printf("v%u", i);

        vouched[i] = vmm_launch_vouched_in(d, run_dir, name, (int)i + 1,
                                           "--run-unattached", NULL);
    }
    for (guint i = 0; i < G_N_ELEMENTS(others); i++) {
        g_autofree char *name = g_strdup_printf("o%u", i);
        g_autofree char *guest = g_strdup_printf("guest=%s", name);
        g_autofree char *seed = g_strdup_printf("%u", i + 10);
        const char *argv[] = { "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket",
                               d->agent_sock, "--mib", "4", "--seed", seed, "--writers", "1",
                               "--writes-per-sec", "200", "--run-unattached", NULL };

        others[i] = pf_test_vmm_spawn(argv);
        g_assert_nonnull(others[i]);
    }
    /* Still flooding: every vouched VM is pagefoldd's, merging. */
    for (guint i = 0; i < G_N_ELEMENTS(vouched); i++) {
        g_autoptr(JsonNode) list = NULL;
        JsonObject *vm;

        g_assert_true(wait_listed_pid(d, vouched[i]->pid, 120));
        list = pf_test_ctl_json(d, "list", NULL);
        vm = pf_test_find_vm_pid(json_node_get_array(list), vouched[i]->pid);
        g_test_message("v%u: mode %s (its agent's first try: %s)", i,
                       json_object_get_string_member(vm, "mode"), vouched[i]->mode);
        g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "merge");
    }
    for (guint i = 0; i < G_N_ELEMENTS(flooders); i++) {
        pf_guest_release(flooders[i]);
    }
    t0 = g_get_monotonic_time();
    /* An agent tries again at most 5 s apart; the bound is for a loaded
     * machine, the time it took is said. */
    for (guint i = 0; i < G_N_ELEMENTS(others); i++) {
        g_assert_true(wait_listed_pid(d, others[i]->pid, 60));
    }
    g_test_message("the unvouched VMs were all attached %.1f s after the flood",
                   (g_get_monotonic_time() - t0) / 1e6);
    for (guint i = 0; i < G_N_ELEMENTS(vouched); i++) {
        g_autofree char *name = g_strdup_printf("v%u", i);

        pf_test_vmm_verify(vouched[i]);
        pf_test_vmm_quit(vouched[i]);
        pf_test_vmm_verify(others[i]);
        pf_test_vmm_quit(others[i]);
        pf_test_write_libvirt_status(run_dir, name, NULL);
    }
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
}

/*
 * A process of the agent socket's group that root did not vouch for gets
 * no /dev/userfaultfd from pagefoldd, however proper the RAM it shows (a
 * sealed memfd mapped shared): with vm.unprivileged_userfaultfd=0 it can
 * make no userfaultfd that sees the kernel's faults, so it stays in advise
 * mode, and pagefoldd says why.
 */
static void
test_not_vouched(void)
{
    g_autofree char *old = NULL;
    Vmm *a;
    g_autoptr(JsonObject) vm = NULL;
    const char *why;

    if (geteuid() != 0 || !g_file_test("/dev/userfaultfd", G_FILE_TEST_EXISTS)) {
        g_test_skip("needs root and /dev/userfaultfd");
        return;
    }
    old = unprivileged_uffd_set("0");
    g_assert_nonnull(old);
    {
        g_autoptr(PfTestDaemon) d = pf_test_daemon_start("--set", "run=0", "--agent-group",
                                                         "nogroup", NULL);

        g_chmod(d->dir, 0755);
        a = vmm_start_full(d, "stranger", 1, 1, TRUE, "--writes-per-sec=200");
        /* Its READY may still be on its way to pagefoldd. */
        for (int i = 0; i < 500 && (vm = pf_test_listed_vm(d, "stranger")) == NULL; i++) {
            g_usleep(10000);
        }
        g_assert_nonnull(vm);
        why = json_object_get_string_member_with_default(vm, "mode_reason", "");
        g_test_message("mode %s (stand-in: %s), because %s",
                       json_object_get_string_member(vm, "mode"), a->mode, why);
        g_assert_cmpstr(a->mode, ==, "advise");
        g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
        g_assert_nonnull(strstr(why, "not vouched for by root: no /dev/userfaultfd"));
        pf_test_vmm_verify(a);
        pf_test_vmm_quit(a);
    }
    g_assert_true(pf_test_write_sysfs(UNPRIVILEGED_UFFD, old));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/agent/unprivileged", test_unprivileged);
    g_test_add_func("/agent/not-vouched", test_not_vouched);
    g_test_add_func("/agent/flood-same-uid", test_flood_same_uid);
    g_test_add_func("/agent/libvirt-domain", test_libvirt_domain);
    return g_test_run();
}
