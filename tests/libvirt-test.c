/*
 * libvirt-test.c - pagefold under a real libvirtd (Debian 12's 9.0): the
 * patched QEMU as the domains' <emulator>, run by libvirt as libvirt-qemu
 * under TCG, the hook in /etc/libvirt/hooks/qemu.d, pagefoldd started by
 * that hook on the default sockets (libvirt-host.c sets all that up and
 * takes it down).  Domains are defined from the XML a user would write
 * (memfd shared RAM, nothing else), and every guest checks every byte it
 * wrote while pages merge.
 *
 * It needs root, libvirt's daemons installed (not running: it starts its
 * own libvirtd, which reads hooks only when it starts) and no pagefoldd on
 * the default sockets; otherwise it skips and says why.  It leaves no
 * domain, hook or daemon behind.  meson runs it alone (is_parallel false):
 * a patched QEMU of another suite would join its pagefoldd of its own
 * accord.
 *
 * Stand-ins, named as such: the tiny guest (tests/guest/pfguest.c) cannot
 * answer ACPI, so `virsh shutdown` and `virsh reboot` are played by the
 * guest powering itself off and rebooting itself (which is what those
 * commands ask a guest to do); `virsh destroy` is the real thing.
 *
 * With PAGEFOLD_TEST_INSTALLED set it runs against the installed packages
 * (debian/tests/libvirt): their hook and pagefoldd, and, given
 * PAGEFOLD_TEST_UPGRADE_DEB (a later build of the package pagefold), an
 * upgrade and a removal of that package while domains merge.
 *
 * Owns the paths and the program's main.  Must never end, by a failed
 * assertion or a signal, without libvirt-host.c's teardown.
 */
#include <gio/gio.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <pwd.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "libvirt-host.h"
#include "testproc.h"
#include "util.h"

static guint
uid_of(int pid)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/status", pid);
    g_autofree char *text = NULL;
    char *uid;

    g_assert_true(g_file_get_contents(path, &text, NULL, NULL));
    uid = strstr(text, "\nUid:");
    g_assert_nonnull(uid);
    return (guint)strtoul(uid + 5, NULL, 10);
}

/* Two domains with nothing but memfd shared RAM in their XML: the patched
 * QEMU makes its agent, pagefoldd (started by the hook) knows them by
 * libvirt's names and UUIDs, their pages merge while both guests check
 * theirs; destroyed, they leave nothing attached and no pool page taken. */
static void
test_merge(void)
{
    DomSpec s1 = { .name = "pf-test-1", .memfd = TRUE, .seed = 1 };
    DomSpec s2 = { .name = "pf-test-2", .memfd = TRUE, .seed = 2 };
    g_autoptr(Dom) d1 = dom_start(&s1);
    g_autoptr(Dom) d2 = dom_start(&s2);
    struct passwd *qemu_user = getpwnam("libvirt-qemu");
    g_autofree char *log = NULL;

    for (Dom **d = (Dom *[]){ d1, d2, NULL }; *d != NULL; d++) {
        g_autoptr(JsonObject) vm = wait_listed(*d, "merge");

        g_assert_cmpstr(json_object_get_string_member(vm, "uuid"), ==, (*d)->uuid);
        g_assert_cmpint(json_object_get_int_member(vm, "pid"), ==, dom_pid(*d));
        if (qemu_user != NULL) {
            g_assert_cmpuint(uid_of(dom_pid(*d)), ==, qemu_user->pw_uid);
        }
        dom_expect(*d, "PFGUEST READY");
    }
    /* Half of each guest's 64 MiB fill is the same in both. */
    wait_sharing(NULL, 4096);
    dom_expect(d1, "PFGUEST CHECK ok");
    dom_expect(d2, "PFGUEST CHECK ok");
    dom_expect(d1, "PFGUEST CHECK ok");
    dom_expect(d2, "PFGUEST CHECK ok");
    log = dom_log(d1);
    g_assert_nonnull(strstr(log, "pagefold-hook: "));
    g_assert_nonnull(strstr(log, "x-pagefold-agent: created for shared memfd guest RAM"));
    dom_destroy(d1);
    dom_destroy(d2);
    wait_unlisted(d1);
    wait_unlisted(d2);
    g_assert_cmpint(stat_of(NULL, "pool_slots"), ==, 0);
}

/*
 * A domain with a virtiofs filesystem, as a user writes it (memfd shared
 * RAM, <filesystem> with the patched virtiofsd as its binary): libvirt
 * starts virtiofsd, which hands QEMU's agent its faults, and the domain
 * merges rather than stepping back; its guest writes and reads files
 * through the share and checks every page, as it does the rest.
 */
static void
test_virtiofs(void)
{
    g_autofree char *dir = g_dir_make_tmp("pagefold-libvirt-fs-XXXXXX", NULL);
    DomSpec s = { .name = "pf-test-fs", .memfd = TRUE, .seed = 3, .seconds = 40,
                  .virtiofs_dir = dir };
    g_autoptr(Dom) d = NULL;
    g_autoptr(GDir) gd = NULL;
    const char *name;

    g_assert_nonnull(dir);
    d = dom_start(&s);
    json_object_unref(wait_listed(d, "merge"));
    dom_expect(d, "PFGUEST READY");
    dom_expect(d, "PFGUEST VIRTIOFS");
    dom_expect(d, "PFGUEST CHECK ok");
    dom_expect(d, "PFGUEST VIRTIOFS");
    /* Still merging once virtiofsd has mapped guest RAM and served it. */
    json_object_unref(wait_listed(d, "merge"));
    g_assert_cmpint(stat_of(d->name, "pages_sharing") + stat_of(d->name, "zero_pages"), >, 0);
    dom_destroy(d);
    wait_unlisted(d);
    gd = g_dir_open(dir, 0, NULL);
    while (gd != NULL && (name = g_dir_read_name(gd)) != NULL) {
        g_autofree char *path = g_build_filename(dir, name, NULL);

        g_unlink(path);
    }
    g_rmdir(dir);
}

/* A merge domain from each domain's <metadata>: the two of tenant-a share
 * pages, the one of tenant-b shares none with them, however equal. */
static void
test_merge_domains(void)
{
    DomSpec sa1 = { .name = "pf-test-a1", .memfd = TRUE, .seed = 12, .merge_domain = "tenant-a" };
    DomSpec sb = { .name = "pf-test-b", .memfd = TRUE, .seed = 13, .merge_domain = "tenant-b" };
    DomSpec sa2 = { .name = "pf-test-a2", .memfd = TRUE, .seed = 14, .merge_domain = "tenant-a" };
    g_autoptr(Dom) a1 = dom_start(&sa1);
    g_autoptr(Dom) b = dom_start(&sb);
    g_autoptr(Dom) a2 = dom_start(&sa2);
    Dom *all[] = { a1, b, a2 };
    const DomSpec *specs[] = { &sa1, &sb, &sa2 };

    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        g_autoptr(JsonObject) vm = wait_listed(all[i], "merge");

        for (int t = 0; t < 50 && !g_str_equal(json_object_get_string_member(vm, "merge_domain"),
                                                specs[i]->merge_domain); t++) {
            g_usleep(100000);
            json_object_unref(vm);
            vm = pf_test_listed_vm(pagefoldd_ctl(), all[i]->name);
        }
        g_assert_cmpstr(json_object_get_string_member(vm, "merge_domain"), ==,
                        specs[i]->merge_domain);
        dom_expect(all[i], "PFGUEST READY");
    }
    /* Half of each guest's 64 MiB fill (8192 pages) is the same in all
     * three: a1 and a2 share most of it. */
    wait_sharing(a1->name, 3072);
    wait_sharing(a2->name, 3072);
    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        dom_expect(all[i], "PFGUEST CHECK ok");
    }
    /* b shares none of it: what it shares is its own guest's duplicates
     * (about a thousand here), as a1 and a2 share theirs besides (zero
     * pages are every VM's, counted apart). */
    g_test_message("pages_sharing: a1 %" G_GINT64_FORMAT ", a2 %" G_GINT64_FORMAT
                   ", b %" G_GINT64_FORMAT, stat_of(a1->name, "pages_sharing"),
                   stat_of(a2->name, "pages_sharing"), stat_of(b->name, "pages_sharing"));
    for (int i = 0; i < BOOT_S && stat_of(b->name, "pages_sharing") + 3072 >=
                                      MIN(stat_of(a1->name, "pages_sharing"),
                                          stat_of(a2->name, "pages_sharing"));
         i++) {
        g_usleep(G_USEC_PER_SEC);
    }
    g_assert_cmpint(stat_of(b->name, "pages_sharing") + 3072, <,
                    MIN(stat_of(a1->name, "pages_sharing"), stat_of(a2->name, "pages_sharing")));
    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        dom_destroy(all[i]);
        wait_unlisted(all[i]);
    }
}

/* <nosharepages/>: QEMU's mem-merge=off, which the agent honours as kernel
 * KSM does: advise mode with that reason, no page remapped. */
static void
test_nosharepages(void)
{
    DomSpec s = { .name = "pf-test-noshare", .memfd = TRUE, .nosharepages = TRUE, .seed = 3 };
    g_autoptr(Dom) d = dom_start(&s);
    g_autoptr(JsonObject) vm = wait_listed(d, "advise");
    g_autofree char *q = NULL;

    g_assert_nonnull(strstr(json_object_get_string_member(vm, "mode_reason"), "mem-merge=off"));
    dom_expect(d, "PFGUEST READY");
    dom_expect(d, "PFGUEST CHECK ok");
    q = virsh("qemu-monitor-command", d->name, "{\"execute\":\"x-query-pagefold\"}");
    g_test_message("%s", q);
    g_assert_nonnull(strstr(q, "\"mode\":\"advise\""));
    g_assert_nonnull(strstr(q, "\"merged\":0,"));
    g_assert_nonnull(strstr(q, "\"remapped\":0,"));
    dom_destroy(d);
    wait_unlisted(d);
}

/* Debian's own QEMU, no agent: the hook attaches it by pid, advise mode. */
static void
test_stock_qemu(void)
{
    DomSpec s = { .name = "pf-test-stock", .emulator = STOCK_QEMU, .memfd = TRUE, .seed = 4 };
    g_autoptr(Dom) d = NULL;
    g_autoptr(JsonObject) vm = NULL;

    if (!g_file_test(STOCK_QEMU, G_FILE_TEST_IS_EXECUTABLE)) {
        g_test_skip("no " STOCK_QEMU " (Debian's qemu-system-x86)");
        return;
    }
    d = dom_start(&s);
    vm = wait_listed(d, "advise");
    g_assert_cmpstr(json_object_get_string_member(vm, "uuid"), ==, d->uuid);
    g_assert_cmpint(json_object_get_int_member(vm, "pid"), ==, dom_pid(d));
    dom_expect(d, "PFGUEST READY");
    dom_destroy(d);
    wait_unlisted(d);
}

/* The guest reboots itself (what `virsh reboot` asks of it): the same QEMU
 * goes on, attached, merging what the new boot writes.  The other powers
 * itself off (`virsh shutdown`): libvirt stops it, pagefoldd lets it go. */
static void
test_reboot_shutdown(void)
{
    DomSpec sr = { .name = "pf-test-reboot", .memfd = TRUE, .seed = 5, .seconds = 20, .reboot = 1 };
    DomSpec so = { .name = "pf-test-off", .memfd = TRUE, .seed = 6, .seconds = 20 };
    g_autoptr(Dom) r = dom_start(&sr);
    g_autoptr(Dom) o = dom_start(&so);
    int rpid, opid;

    json_object_unref(wait_listed(r, "merge"));
    json_object_unref(wait_listed(o, "merge"));
    rpid = dom_pid(r);
    opid = dom_pid(o);
    dom_expect(r, "PFGUEST READY");
    dom_expect(o, "PFGUEST READY");
    wait_sharing(NULL, 2048);
    /* Each ends its run with a last check of every page. */
    dom_expect(o, "PFGUEST PASS");
    wait_gone(opid);
    wait_unlisted(o);
    dom_expect(r, "PFGUEST PASS");
    dom_expect(r, "PFGUEST READY");
    g_assert_cmpint(dom_pid(r), ==, rpid);
    json_object_unref(wait_listed(r, "merge"));
    dom_expect(r, "PFGUEST CHECK ok");
    dom_destroy(r);
    wait_unlisted(r);
    g_assert_cmpint(stat_of(NULL, "pool_slots"), ==, 0);
}

/* libvirtd killed and started again while a domain runs: its `reconnect`
 * hook keeps the VM attached (the same process) and merging goes on. */
static void
test_libvirtd_restart(void)
{
    DomSpec s1 = { .name = "pf-test-r1", .memfd = TRUE, .seed = 7 };
    DomSpec s2 = { .name = "pf-test-r2", .memfd = TRUE, .seed = 8 };
    g_autoptr(Dom) d1 = dom_start(&s1);
    g_autoptr(Dom) d2 = dom_start(&s2);
    gint64 passes;
    int pid;

    json_object_unref(wait_listed(d1, "merge"));
    json_object_unref(wait_listed(d2, "merge"));
    dom_expect(d1, "PFGUEST READY");
    dom_expect(d2, "PFGUEST READY");
    pid = dom_pid(d1);
    libvirtd_stop(SIGKILL);
    libvirtd_start();
    g_assert_cmpint(dom_pid(d1), ==, pid);
    json_object_unref(wait_listed(d1, "merge"));
    wait_log(d1, "reconnect");
    /* Scanned on: passes over it, waited for.  Pages read are no measure
     * (a VM whose pages are merged, holes, or skipped by smart scan has
     * none to read for passes on end), and neither is a moment after the
     * checks below, which may all have been met already (seen: no change
     * between the two looks). */
    passes = stat_of(d1->name, "full_scans");
    wait_sharing(NULL, 4096);
    dom_expect(d1, "PFGUEST CHECK ok");
    dom_expect(d2, "PFGUEST CHECK ok");
    for (int i = 0; i < BOOT_S * 5 && stat_of(d1->name, "full_scans") <= passes; i++) {
        g_usleep(200000);
    }
    g_assert_cmpint(stat_of(d1->name, "full_scans"), >, passes);
    dom_destroy(d1);
    dom_destroy(d2);
    wait_unlisted(d1);
    wait_unlisted(d2);
}

/* pagefoldd down and not startable: the domain starts and runs all the
 * same, and libvirt's log for it says why it is not merged. */
static void
test_no_pagefoldd(void)
{
    DomSpec s = { .name = "pf-test-alone", .memfd = TRUE, .seed = 9 };
    g_autoptr(Dom) d = NULL;
    g_autofree char *log = NULL;

    if (installed_mode()) {
        g_test_skip("puts a hook of its own in the package's place");
        return;
    }
    pagefoldd_stop();
    install_hook(NULL);
    d = dom_start(&s);
    dom_expect(d, "PFGUEST READY");
    dom_expect(d, "PFGUEST CHECK ok");
    g_assert_cmpint(pagefoldd_pid(), ==, 0);
    log = dom_log(d);
    g_test_message("%s", log);
    g_assert_nonnull(strstr(log, "pagefold-hook: "));
    g_assert_nonnull(strstr(log, "cannot be reached"));
    dom_destroy(d);
    install_hook(pf_test_bin("PAGEFOLDD"));
}

/*
 * Runs the hook with xml on its stdin, from a file: a hook that refuses
 * its arguments exits before it reads, and a pipe would then break under
 * the writer (SIGPIPE, which killed this test now and then).  Its exit
 * status, and stdout and stderr where asked for.
 */
static int
run_hook(const char *const *argv, const char *xml, char **out, char **err)
{
    g_autoptr(GSubprocessLauncher) l = g_subprocess_launcher_new(
        (out != NULL ? G_SUBPROCESS_FLAGS_STDOUT_PIPE : 0) |
        (err != NULL ? G_SUBPROCESS_FLAGS_STDERR_PIPE : 0));
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    g_autofree char *path = NULL;
    int fd = g_file_open_tmp("pf-hook-xml-XXXXXX", &path, &error);

    g_assert_no_error(error);
    close(fd);
    g_assert_true(g_file_set_contents(path, xml, -1, &error));
    g_subprocess_launcher_set_stdin_file_path(l, path);
    p = g_subprocess_launcher_spawnv(l, argv, &error);
    g_assert_no_error(error);
    g_assert_true(g_subprocess_communicate_utf8(p, NULL, NULL, out, err, &error));
    g_assert_no_error(error);
    g_unlink(path);
    g_assert_true(g_subprocess_get_if_exited(p));
    return g_subprocess_get_exit_status(p);
}

/* The hook run as libvirt runs it for a domain about to start (name, shared
 * memfd RAM): it starts pagefoldd where none answers. */
static void
hook_prepare(const char *name)
{
    const char *argv[] = { hook_file(), name, "prepare", "begin", "-", NULL };
    g_autofree char *uuid = g_uuid_string_random();
    g_autofree char *xml = g_strdup_printf(
        "<domain type='qemu'><name>%s</name><uuid>%s</uuid><memoryBacking>"
        "<source type='memfd'/><access mode='shared'/></memoryBacking></domain>", name, uuid);

    g_assert_cmpint(run_hook(argv, xml, NULL, NULL), ==, 0);
}

/* Each domain listed by pagefoldd in merge mode, its guest ready. */
static void
wait_merging(Dom *const *all, gsize n)
{
    for (gsize i = 0; i < n; i++) {
        json_object_unref(wait_listed(all[i], "merge"));
        dom_expect(all[i], "PFGUEST READY");
    }
}

/* The sum of pages_shared and pages_sharing of each of n domains. */
static void
shared_of(Dom *const *all, gsize n, gint64 *out)
{
    for (gsize i = 0; i < n; i++) {
        out[i] = stat_of(all[i]->name, "pages_sharing") + stat_of(all[i]->name, "pages_shared");
    }
}

/* Each of n domains listed in merge mode, its guest ready, and sharing
 * 3072 pages at least; before[i]: what each shares by then. */
static void
wait_each_sharing(Dom *const *all, gsize n, gint64 *before)
{
    wait_merging(all, n);
    for (gsize i = 0; i < n; i++) {
        wait_sharing(all[i]->name, 3072);
    }
    shared_of(all, n, before);
}

/* After a new pagefoldd came (what: how), each of n domains listed in merge
 * mode again with at least half of the pages it shared before (before[i]):
 * taken back a slice at a time, within 10 s, before any pass could merge as
 * many again (the guests write some meanwhile). */
static void
wait_taken_back(Dom *const *all, gsize n, const gint64 *before, const char *what)
{
    g_autofree gint64 *taken = g_new0(gint64, n);
    gboolean all_back = FALSE;

    for (gsize i = 0; i < n; i++) {
        json_object_unref(wait_listed(all[i], "merge"));
    }
    for (int t = 0; t < 200 && !all_back; t++) {
        shared_of(all, n, taken);
        all_back = TRUE;
        for (gsize i = 0; i < n; i++) {
            all_back = all_back && taken[i] >= before[i] / 2;
        }
        g_usleep(50000);
    }
    for (gsize i = 0; i < n; i++) {
        g_test_message("%s: %" G_GINT64_FORMAT " pages shared before %s, %" G_GINT64_FORMAT
                       " after it", all[i]->name, before[i], what, taken[i]);
        g_assert_cmpint(taken[i], >=, before[i] / 2);
    }
}

/* The hook as libvirt would call it, with input it must refuse: a clear
 * message, exit 0, nothing changed. */
static void
test_hook_bad_input(void)
{
    const char *const bad[][6] = {
        { hook_file(), NULL },
        { hook_file(), "pf-x", "started", NULL },
        { hook_file(), "pf-x", "started", "begin", "-", "extra" },
        { hook_file(), "pf-x", "no-such-op", "begin", "-", NULL },
    };
    const char *const xmls[] = {
        "", "<domain", "<domain><name>other</name><uuid>x</uuid></domain>",
        "<notadomain/>",
    };
    g_autoptr(JsonNode) before = NULL;
    g_autoptr(JsonNode) after = NULL;
    g_autofree char *b = NULL, *a = NULL;

    /* pagefoldd runs, as the hook starts it for a domain to come. */
    hook_prepare("pf-test-x");
    g_assert_cmpint(pagefoldd_pid(), >, 0);
    before = pf_test_ctl_json(pagefoldd_ctl(), "list", NULL);
    for (gsize i = 0; i < G_N_ELEMENTS(bad); i++) {
        for (gsize j = 0; j < G_N_ELEMENTS(xmls); j++) {
            g_autofree char *out = NULL, *err = NULL;

            g_assert_cmpint(run_hook(bad[i], xmls[j], &out, &err), ==, 0);
            g_assert_cmpstr(out, ==, "");
            g_assert_cmpstr(err, !=, "");
        }
    }
    {
        /* started for a domain whose name is not the XML's. */
        const char *argv[] = { hook_file(), "pf-x", "started", "begin", "-", NULL };
        g_autofree char *err = NULL;

        g_assert_cmpint(run_hook(argv, "<domain type='qemu'><name>pf-y</name></domain>", NULL,
                                 &err), ==, 0);
        g_test_message("%s", err);
        g_assert_nonnull(strstr(err, "pf-y"));
    }
    after = pf_test_ctl_json(pagefoldd_ctl(), "list", NULL);
    b = json_to_string(before, FALSE);
    a = json_to_string(after, FALSE);
    g_assert_cmpstr(a, ==, b);
}

/* pagefoldd killed with -9 while two domains of one merge domain run and
 * share pages, and started again as the hook starts it where there is no
 * systemd (libvirt runs it as the next domain is prepared): both VMs come
 * back by themselves (their agents connect again; libvirt runs no hook for
 * them), in merge mode, in the merge domain of their XML, which pagefoldd
 * reads in libvirt's status files, with the pages they shared taken back;
 * the guests check every byte throughout. */
static void
test_pagefoldd_restart(void)
{
    DomSpec s1 = { .name = "pf-test-k1", .memfd = TRUE, .seed = 21, .merge_domain = "tenant-k" };
    DomSpec s2 = { .name = "pf-test-k2", .memfd = TRUE, .seed = 22, .merge_domain = "tenant-k" };
    g_autoptr(Dom) d1 = dom_start(&s1);
    g_autoptr(Dom) d2 = dom_start(&s2);
    Dom *all[] = { d1, d2 };
    gint64 before[2];
    int pid;

    wait_each_sharing(all, G_N_ELEMENTS(all), before);
    pid = pagefoldd_pid();
    g_assert_cmpint(pid, >, 0);
    kill(pid, SIGKILL);
    wait_gone(pid);
    hook_prepare("pf-test-k3");
    g_assert_cmpint(pagefoldd_pid(), >, 0);
    wait_taken_back(all, G_N_ELEMENTS(all), before, "the kill");
    pagefoldd_test_pace();
    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        g_autoptr(JsonObject) vm = wait_listed(all[i], "merge");

        g_assert_cmpstr(json_object_get_string_member(vm, "merge_domain"), ==, "tenant-k");
        dom_expect(all[i], "PFGUEST CHECK ok");
        dom_destroy(all[i]);
        wait_unlisted(all[i]);
    }
}

/* The number in <name>N</name> of libvirt's metadata element, or -1. */
static gint64
element_number(const char *xml, const char *name)
{
    g_autofree char *open = g_strdup_printf("<%s>", name);
    const char *p = strstr(xml, open);

    return p ? g_ascii_strtoll(p + strlen(open), NULL, 10) : -1;
}

/* Each running domain's figures in its live libvirt metadata, refreshed
 * by pagefoldd: what `virsh metadata` shows is what `pagefoldctl stats`
 * says (scanning stopped, so that neither moves between the two looks). */
static void
test_metadata(void)
{
    DomSpec s1 = { .name = "pf-test-m1", .memfd = TRUE, .seed = 10 };
    DomSpec s2 = { .name = "pf-test-m2", .memfd = TRUE, .seed = 11 };
    g_autoptr(Dom) d1 = dom_start(&s1);
    g_autoptr(Dom) d2 = dom_start(&s2);
    const char *counters[] = { "pages_shared", "pages_sharing", "zero_pages", "cow" };
    g_autofree char *xml = NULL;

    json_object_unref(wait_listed(d1, "merge"));
    json_object_unref(wait_listed(d2, "merge"));
    dom_expect(d1, "PFGUEST READY");
    dom_expect(d2, "PFGUEST READY");
    wait_sharing(NULL, 4096);
    json_node_unref(pf_test_ctl_json(pagefoldd_ctl(), "set", "run", "0", NULL));
    /* The publisher's next round, and the one after, see run=0's figures. */
    g_usleep(3 * G_USEC_PER_SEC);
    xml = virsh("metadata", d1->name, "urn:pagefold:stats:1");
    g_test_message("%s", xml);
    g_assert_nonnull(strstr(xml, "<mode>merge</mode>"));
    for (gsize i = 0; i < G_N_ELEMENTS(counters); i++) {
        g_assert_cmpint(element_number(xml, counters[i]), ==, stat_of(d1->name, counters[i]));
    }
    g_assert_cmpint(element_number(xml, "pages_sharing"), >, 0);
    g_assert_cmpint(element_number(xml, "saved_bytes"), ==,
                    (stat_of(d1->name, "pages_sharing") + stat_of(d1->name, "zero_pages")) *
                        PF_PAGE_SIZE);
    json_node_unref(pf_test_ctl_json(pagefoldd_ctl(), "set", "run", "1", NULL));
    dom_expect(d1, "PFGUEST CHECK ok");
    dom_destroy(d1);
    dom_destroy(d2);
    wait_unlisted(d1);
    wait_unlisted(d2);
}

/* dpkg with one option and one argument, which must succeed; what it said
 * on stdout and stderr. */
static char *
dpkg(const char *option, const char *arg)
{
    const char *argv[] = { "dpkg", option, arg, NULL };
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    g_autofree char *out = NULL;

    p = g_subprocess_newv(argv, G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_MERGE,
                          &error);
    g_assert_no_error(error);
    g_assert_true(g_subprocess_communicate_utf8(p, NULL, NULL, &out, NULL, &error));
    g_assert_no_error(error);
    g_test_message("dpkg %s %s:\n%s", option, arg, out);
    g_assert_true(g_subprocess_get_if_exited(p));
    g_assert_cmpint(g_subprocess_get_exit_status(p), ==, 0);
    return g_steal_pointer(&out);
}

/* Waits up to 30 s for a pagefoldd other than old_pid (0: any) to listen;
 * its pid. */
static int
wait_pagefoldd(int old_pid)
{
    for (int i = 0; i < 300; i++) {
        int pid = pagefoldd_pid();

        if (pid > 0 && pid != old_pid) {
            return pid;
        }
        g_usleep(100000);
    }
    g_error("no pagefoldd but %d listens after 30 s", old_pid);
}

/*
 * The package pagefold upgraded (dpkg -i of a later build) while two
 * domains share pages: the package restarts pagefoldd (systemd, or its
 * postinst where pagefoldd was the hook's), the new one takes both VMs
 * back in merge mode with most of what they shared, and the guests find
 * every byte they wrote throughout.
 */
static void
test_package_upgrade(gconstpointer deb)
{
    DomSpec s1 = { .name = "pf-test-u1", .memfd = TRUE, .seed = 31 };
    DomSpec s2 = { .name = "pf-test-u2", .memfd = TRUE, .seed = 32 };
    g_autoptr(Dom) d1 = dom_start(&s1);
    g_autoptr(Dom) d2 = dom_start(&s2);
    Dom *all[] = { d1, d2 };
    gint64 before[2];
    g_autofree char *out = NULL;
    int old_pid, pid;

    wait_each_sharing(all, G_N_ELEMENTS(all), before);
    old_pid = pagefoldd_pid();
    out = dpkg("-i", deb);
    pid = wait_pagefoldd(old_pid);
    g_test_message("pagefoldd %d replaced by %d", old_pid, pid);
    {
        /* Root's, confined as the unit or the hook confine it. */
        g_autofree char *path = g_strdup_printf("/proc/%d/status", pid);
        g_autofree char *status = NULL;

        g_assert_true(g_file_get_contents(path, &status, NULL, NULL));
        g_assert_cmpuint(uid_of(pid), ==, 0);
        g_assert_nonnull(strstr(status, "\nNoNewPrivs:\t1\n"));
    }
    wait_taken_back(all, G_N_ELEMENTS(all), before, "the upgrade");
    pagefoldd_test_pace();
    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        dom_expect(all[i], "PFGUEST CHECK ok");
        dom_expect(all[i], "PFGUEST CHECK ok");
        dom_destroy(all[i]);
        wait_unlisted(all[i]);
    }
}

/*
 * The package pagefold removed while two domains share pages: dpkg says
 * what the VMs keep, pagefoldd is gone, and the domains run on with their
 * merged pages valid, the guests finding every byte they wrote; installed
 * again (the same later build), it takes them back.
 */
static void
test_package_remove(gconstpointer deb)
{
    DomSpec s1 = { .name = "pf-test-rm1", .memfd = TRUE, .seed = 33 };
    DomSpec s2 = { .name = "pf-test-rm2", .memfd = TRUE, .seed = 34 };
    g_autoptr(Dom) d1 = dom_start(&s1);
    g_autoptr(Dom) d2 = dom_start(&s2);
    Dom *all[] = { d1, d2 };
    g_autofree char *removed = NULL, *installed = NULL;

    wait_merging(all, G_N_ELEMENTS(all));
    wait_sharing(NULL, 4096);
    removed = dpkg("-r", "pagefold");
    /* Its two and any other of the host's (installed mode). */
    g_assert_true(g_regex_match_simple("its [0-9]+ VMs keep running, with [0-9]+ pages merged",
                                       removed, 0, 0));
    g_assert_nonnull(strstr(removed, "they stay valid"));
    g_assert_cmpint(pagefoldd_pid(), ==, 0);
    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        dom_expect(all[i], "PFGUEST CHECK ok");
        dom_expect(all[i], "PFGUEST CHECK ok");
        g_assert_cmpint(dom_pid(all[i]), >, 0);
    }
    installed = dpkg("-i", deb);
    if (pagefoldd_pid() == 0) {
        /* No systemd to start it: the hook does, for the next domain. */
        hook_prepare("pf-test-rm3");
    }
    wait_pagefoldd(0);
    pagefoldd_test_pace();
    for (gsize i = 0; i < G_N_ELEMENTS(all); i++) {
        json_object_unref(wait_listed(all[i], "merge"));
        dom_expect(all[i], "PFGUEST CHECK ok");
        dom_destroy(all[i]);
        wait_unlisted(all[i]);
    }
}

static void
skip_all(gconstpointer why)
{
    g_test_skip(why);
}

/* A failed assertion aborts, and meson's timeout terminates: the domains,
 * the hook and the daemons must not outlive either (a libvirtd with a
 * test's hook would run it for good). */
static void
on_fatal(int sig)
{
    signal(sig, SIG_DFL);
    teardown();
    raise(sig);
}

int
main(int argc, char **argv)
{
    const char *why;
    int rc;

    g_test_init(&argc, &argv, NULL);
    why = cannot_run();
    if (why != NULL) {
        g_test_add_data_func("/libvirt/skipped", why, skip_all);
        return g_test_run();
    }
    signal(SIGABRT, on_fatal);
    /* g_error() ends the program with a breakpoint, not abort(). */
    signal(SIGTRAP, on_fatal);
    signal(SIGTERM, on_fatal);
    /* A reader gone mid-write is an error to report, not a silent death
     * that leaves libvirtd and pagefoldd running for the suites after. */
    signal(SIGPIPE, SIG_IGN);
    signal(SIGINT, on_fatal);
    setup();
    g_test_add_func("/libvirt/merge", test_merge);
    g_test_add_func("/libvirt/merge-domains", test_merge_domains);
    g_test_add_func("/libvirt/virtiofs", test_virtiofs);
    g_test_add_func("/libvirt/nosharepages", test_nosharepages);
    g_test_add_func("/libvirt/stock-qemu", test_stock_qemu);
    g_test_add_func("/libvirt/reboot-shutdown", test_reboot_shutdown);
    g_test_add_func("/libvirt/libvirtd-restart", test_libvirtd_restart);
    g_test_add_func("/libvirt/pagefoldd-restart", test_pagefoldd_restart);
    g_test_add_func("/libvirt/metadata", test_metadata);
    g_test_add_func("/libvirt/hook-bad-input", test_hook_bad_input);
    g_test_add_func("/libvirt/no-pagefoldd", test_no_pagefoldd);
    if (installed_mode() && g_getenv("PAGEFOLD_TEST_UPGRADE_DEB") != NULL) {
        const char *deb = g_getenv("PAGEFOLD_TEST_UPGRADE_DEB");

        g_test_add_data_func("/libvirt/package/upgrade", deb, test_package_upgrade);
        g_test_add_data_func("/libvirt/package/remove", deb, test_package_remove);
    }
    rc = g_test_run();
    teardown();
    return rc;
}
