/*
 * hook-test.c - the libvirt qemu hook (libvirt-hooks/hook.c) through a
 * domain's life, run as libvirtd runs it (hook-fixture.c) against a real
 * pagefoldd on sockets of the test's own and stand-in QEMUs
 * (standin-guest: shared memfd RAM and no agent, so pagefoldd attaches
 * them by pid, in advise mode): started, reconnect and attach attach the
 * domain's QEMU, into its merge domain; stopped and release detach it,
 * with its last figures; domains whose RAM is not pagefold's are left to
 * kernel KSM; input libvirt would never pass does nothing.  Whatever it
 * is given, the hook exits 0, writes nothing on stdout and says what it
 * did, or why not, on stderr and in the domain's log.
 *
 * Owns the paths that meet the fixture's pagefoldd.  How the hook starts
 * a pagefoldd, and the exact requests it sends, are
 * hook-pagefoldd-test.c's.  Must never hand the hook a domain's QEMU pid
 * other than in libvirt's root-owned status file (write_pid() fills the
 * pid file with another's): that file is all the hook may believe.
 */
#include <glib.h>
#include <glib/gstdio.h>
#include <json-glib/json-glib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "hook-fixture.h"
#include "testproc.h"

static JsonArray *
list_vms(Fixture *f)
{
    g_autoptr(JsonNode) n = pf_test_ctl_json(f->d, "list", NULL);

    return json_array_ref(json_node_get_array(n));
}

static guint
n_attached(Fixture *f)
{
    g_autoptr(JsonArray) vms = list_vms(f);

    return json_array_get_length(vms);
}

/* ---- started, reconnect, attach ---- */

/* Which process a domain's QEMU is comes from libvirt's status file only:
 * one that is not root's alone (here: group-writable), or a symbolic
 * link, names nobody; its pid file is never read. */
static void
test_started_status_file(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *status = g_build_filename(f->run_dir, "web1.xml", NULL);
    g_autofree char *moved = g_build_filename(f->run_dir, "other.xml", NULL);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    g_assert_cmpint(g_chmod(status, 0620), ==, 0);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "is not libvirt's status file");
    g_assert_cmpuint(n_attached(f), ==, 0);

    g_assert_cmpint(g_chmod(status, 0600), ==, 0);
    g_assert_cmpint(g_rename(status, moved), ==, 0);
    g_assert_cmpint(symlink(moved, status), ==, 0);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "cannot read");
    g_assert_cmpuint(n_attached(f), ==, 0);
}

static void
test_started_attaches(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *want = g_strdup_printf("pagefold-hook: web1 started begin: attached pid %d "
                                            "as VM 'web1' (uuid " UUID_CANON ") in mode advise",
                                            pid);
    g_autoptr(JsonArray) vms = NULL;
    g_auto(Run) r = { 0 };
    JsonObject *vm;

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", want);
    vms = list_vms(f);
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    vm = pf_test_find_vm_pid(vms, pid);
    g_assert_nonnull(vm);
    g_assert_cmpstr(json_object_get_string_member(vm, "name"), ==, "web1");
    /* The guest has no -uuid: this one is the XML's, by the hook. */
    g_assert_cmpstr(json_object_get_string_member(vm, "uuid"), ==, UUID_CANON);
    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");

    /* Again, and as libvirtd does when it restarts: attached already is
     * fine, and nothing changes. */
    for (guint i = 0; i < 2; i++) {
        const char *op = i == 0 ? "started" : "reconnect";
        g_autofree char *again = g_strdup_printf(
            "web1 %s begin: pid %d is attached already, as VM 'web1' (uuid " UUID_CANON
            ") in mode advise", op, pid);

        hook(f, &r, xml, "web1", op, "begin", "-", NULL);
        assert_said(f, &r, "web1", again);
        g_assert_cmpuint(n_attached(f), ==, 1);
    }
}

/* Its agent (here: pagefoldctl) was first: the hook says so and leaves
 * the VM as it is. */
static void
test_started_attached_already(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *pidarg = g_strdup_printf("%d", pid);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *want = g_strdup_printf("pid %d is attached already, as VM 'other' "
                                            "(uuid none) in mode advise", pid);
    g_autoptr(JsonNode) a = pf_test_ctl_json(f->d, "attach", pidarg, "--name", "other", NULL);
    g_autoptr(JsonArray) vms = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "attach", "begin", "-", NULL);
    assert_said(f, &r, "web1", want);
    vms = list_vms(f);
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpstr(json_object_get_string_member(pf_test_find_vm_pid(vms, pid), "name"), ==,
                    "other");
}

#define TENANT(d) "<metadata><pagefold:config xmlns:pagefold='urn:pagefold:domain:1' " \
                  "merge-domain='" d "'/></metadata>"

static const char *
merge_domain_of(Fixture *f, int pid)
{
    static char buf[256];
    g_autoptr(JsonArray) vms = list_vms(f);
    JsonObject *vm = pf_test_find_vm_pid(vms, pid);

    g_assert_nonnull(vm);
    g_strlcpy(buf, json_object_get_string_member(vm, "merge_domain"), sizeof(buf));
    return buf;
}

/*
 * The XML's merge domain: the hook attaches the VM into it; a VM its
 * agent attached first (in the default one) is moved into it; one that
 * shares pages there already is detached rather than left sharing across
 * the boundary.
 */
static void
test_started_merge_domain(Fixture *f, gconstpointer data)
{
    int pid1 = start_guest(f, "web1", NULL);
    int pid2 = start_guest(f, "web2", NULL);
    int pid3 = start_guest(f, "web3", NULL);
    g_autofree char *arg2 = g_strdup_printf("%d", pid2);
    g_autofree char *arg3 = g_strdup_printf("%d", pid3);
    g_autofree char *xml1 = domain_xml("web1", UUID_GIVEN, TENANT("tenant-a") MEMFD_SHARED);
    g_autofree char *xml2 = domain_xml("web2", "00000000-0000-0000-0000-000000000002",
                                       TENANT("tenant-b") MEMFD_SHARED);
    g_autofree char *xml3 = domain_xml("web3", "00000000-0000-0000-0000-000000000003",
                                       TENANT("tenant-b") MEMFD_SHARED);
    g_autofree char *moved = g_strdup_printf("web2 started begin: pid %d moved from merge domain "
                                             "'default' to 'tenant-b'", pid2);
    g_autofree char *refused = g_strdup_printf("web3 started begin: pagefoldd did not put pid %d "
                                               "in merge domain 'tenant-b': VM web3 (pid %d) "
                                               "shares", pid3, pid3);
    g_autofree char *detached = g_strdup_printf("detached pid %d rather than let it share pages "
                                                "outside merge domain 'tenant-b'", pid3);
    g_autoptr(JsonNode) a2 = NULL;
    g_autoptr(JsonNode) scan = NULL;
    g_autoptr(JsonArray) vms = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid1);
    hook(f, &r, xml1, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "(uuid " UUID_CANON ", merge domain tenant-a) in mode advise");
    g_assert_cmpstr(merge_domain_of(f, pid1), ==, "tenant-a");

    /* Attached first, sharing nothing yet: moved. */
    a2 = pf_test_ctl_json(f->d, "attach", arg2, NULL);
    g_assert_cmpstr(merge_domain_of(f, pid2), ==, "default");
    write_pid(f, "web2", pid2);
    hook(f, &r, xml2, "web2", "started", "begin", "-", NULL);
    assert_said(f, &r, "web2", moved);
    g_assert_cmpstr(merge_domain_of(f, pid2), ==, "tenant-b");
    /* Said again (libvirtd restarted): in it already, nothing to do. */
    hook(f, &r, xml2, "web2", "reconnect", "begin", "-", NULL);
    g_assert_null(strstr(r.err, "moved"));
    g_assert_cmpstr(merge_domain_of(f, pid2), ==, "tenant-b");

    /* Attached first and sharing pages in the default domain by now
     * (with web3's twin below): refused, so detached. */
    {
        g_autoptr(JsonNode) a3 = pf_test_ctl_json(f->d, "attach", arg3, NULL);
        int twin = start_guest(f, "twin", NULL);
        g_autofree char *argt = g_strdup_printf("%d", twin);
        g_autoptr(JsonNode) at = pf_test_ctl_json(f->d, "attach", argt, NULL);

        scan = pf_test_ctl_json(f->d, "scan-now", "2", NULL);
    }
    write_pid(f, "web3", pid3);
    hook(f, &r, xml3, "web3", "started", "begin", "-", NULL);
    assert_said(f, &r, "web3", refused);
    assert_said(f, &r, "web3", detached);
    vms = list_vms(f);
    g_assert_null(pf_test_find_vm_pid(vms, pid3));
    g_assert_cmpuint(json_array_get_length(vms), ==, 3);
}

/* ---- stopped, release ---- */

static void
test_stopped_detaches(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *pidarg = g_strdup_printf("%d", pid);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autoptr(JsonNode) scan = NULL;
    g_autoptr(JsonNode) stats = NULL;
    g_autofree char *want = NULL;
    g_auto(Run) r = { 0 };
    JsonObject *vm;

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_assert_cmpuint(n_attached(f), ==, 1);
    /* Figures to report: run=0, so they stay as two passes left them. */
    scan = pf_test_ctl_json(f->d, "scan-now", "2", NULL);
    stats = pf_test_ctl_json(f->d, "stats", pidarg, NULL);
    vm = json_array_get_object_element(
        json_object_get_array_member(json_node_get_object(stats), "vms"), 0);
    g_assert_cmpint(json_object_get_int_member(vm, "zero_pages"), >, 0);
    want = g_strdup_printf("web1 stopped end: detached VM 'web1' (pid %d); final figures: "
                           "pages_shared=%" G_GINT64_FORMAT " pages_sharing=%" G_GINT64_FORMAT
                           " zero_pages=%" G_GINT64_FORMAT " cow=%" G_GINT64_FORMAT
                           " mode=advise", pid,
                           json_object_get_int_member(vm, "pages_shared"),
                           json_object_get_int_member(vm, "pages_sharing"),
                           json_object_get_int_member(vm, "zero_pages"),
                           json_object_get_int_member(vm, "cow"));

    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1", want);
    g_assert_cmpuint(n_attached(f), ==, 0);

    /* release comes after libvirt removed the pid file. */
    remove_pid(f, "web1");
    hook(f, &r, xml, "web1", "release", "end", "-", NULL);
    assert_said(f, &r, "web1", "web1 release end: not attached (detached at stopped");
}

/* QEMU exited before stopped (as it does): pagefoldd dropped it. */
static void
test_stopped_exited(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    GSubprocess *g;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_assert_cmpuint(n_attached(f), ==, 1);
    g = g_ptr_array_index(f->guests, 0);
    g_subprocess_force_exit(g);
    g_subprocess_wait(g, NULL, NULL);
    for (int i = 0; i < 1000 && n_attached(f) > 0; i++) {
        g_usleep(10000);
    }
    g_assert_cmpuint(n_attached(f), ==, 0);
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1",
                "web1 stopped end: not attached: pagefoldd already dropped it (QEMU exited)");
}

/* A pid file names a pid that is attached as another VM (a stale pid
 * file, the pid reused): the hook leaves that VM alone. */
static void
test_stopped_other_uuid(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", "00112233-4455-6677-8899-aabbccddeeff");
    g_autofree char *pidarg = g_strdup_printf("%d", pid);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *want = g_strdup_printf("pid %d is attached as another VM ('web1', uuid "
                                            "00112233-4455-6677-8899-aabbccddeeff): left alone",
                                            pid);
    g_autoptr(JsonNode) a = pf_test_ctl_json(f->d, "attach", pidarg, NULL);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1", want);
    g_assert_cmpuint(n_attached(f), ==, 1);
}

/* ---- domains that are not pagefold's ---- */

static void
test_not_memfd(Fixture *f, gconstpointer data)
{
    static const char *const memories[] = {
        "", /* anonymous private RAM, libvirt's default */
        "<memoryBacking><source type='memfd'/></memoryBacking>",
        "<memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>",
    };
    int pid = start_guest(f, "web1", NULL);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(memories); i++) {
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, memories[i]);
        g_autofree char *before = NULL;
        g_autofree char *after = NULL;

        hook(f, &r, xml, "web1", "prepare", "begin", "-", NULL);
        assert_said(f, &r, "web1", "not pagefold's; kernel KSM is what merges private RAM");
        before = domain_log(f, "web1");
        for (guint k = 0; k < 3; k++) {
            static const char *const ops[][2] = {
                { "start", "begin" }, { "started", "begin" }, { "stopped", "end" }
            };

            hook(f, &r, xml, "web1", ops[k][0], ops[k][1], "-", NULL);
            g_assert_cmpuint(n_attached(f), ==, 0);
        }
        /* Said once, at prepare. */
        after = domain_log(f, "web1");
        g_assert_cmpstr(before, ==, after);
        hook(f, &r, xml, "web1", "reconnect", "begin", "-", NULL);
        assert_said(f, &r, "web1", "web1 reconnect begin: RAM not shared memfd");
        g_assert_cmpuint(n_attached(f), ==, 0);
    }
}

/* RAM shared through its NUMA cells is pagefold's too. */
static void
test_numa_shared(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml(
        "web1", UUID_GIVEN,
        "<memoryBacking><source type='memfd'/></memoryBacking>\n"
        "<cpu><numa><cell id='0' cpus='0' memory='16384' unit='KiB' memAccess='shared'/>"
        "</numa></cpu>");
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "attached pid");
    g_assert_cmpuint(n_attached(f), ==, 1);
}

static void
test_nosharepages(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml(
        "web1", UUID_GIVEN,
        "<memoryBacking><nosharepages/><source type='memfd'/><access mode='shared'/>"
        "</memoryBacking>");
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", "pagefoldd answers on");
    /* Not read either, as kernel KSM never scans it: a QEMU without the
     * agent (the stand-in) is not attached. */
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    assert_said(f, &r, "web1", "<nosharepages/>: never merged; not attached");
    g_assert_cmpuint(n_attached(f), ==, 0);
}

/* ---- what libvirt would never pass, or not yet ---- */

static void
test_bad_argv(Fixture *f, gconstpointer data)
{
    const char *const none[] = { NULL };
    const char *const three[] = { "web1", "started", "begin", NULL };
    const char *const five[] = { "web1", "started", "begin", "-", "more", NULL };
    const char *const unknown[] = { "--frob", "x", "web1", "started", "begin", "-", NULL };
    const char *const no_value[] = { "--socket", "web1", "started", "begin", "-", NULL };
    const struct {
        const char *const *argv;
        const char *want;
    } cases[] = {
        { none, "0 argument(s) where libvirt passes 4" },
        { three, "3 argument(s) where libvirt passes 4" },
        { five, "unexpected argument 'web1'" },
        { unknown, "unknown option '--frob'" },
        { no_value, "option '--socket' wants a value" },
    };
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *log = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        run_argv(cases[i].argv, xml, NULL, &r);
        g_assert_nonnull(strstr(r.err, cases[i].want));
        g_assert_nonnull(strstr(r.err, "nothing done"));
        g_assert_nonnull(strstr(r.err, "usage: pagefold-libvirt-hook"));
        g_assert_cmpuint(n_attached(f), ==, 0);
    }
    /* A name that cannot be a file name makes no path. */
    hook(f, &r, xml, "../web1", "started", "begin", "-", NULL);
    g_assert_nonnull(strstr(r.err, "domain name '../web1' cannot name a file: nothing done"));
    g_assert_cmpuint(n_attached(f), ==, 0);
    log = domain_log(f, "web1");
    g_assert_cmpstr(log, ==, "");
}

static void
test_bad_xml(Fixture *f, gconstpointer data)
{
    g_autofree char *good = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *truncated = g_strndup(good, strlen(good) - 4);
    g_autofree char *other_name = domain_xml("web2", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *no_uuid = domain_xml("web1", NULL, MEMFD_SHARED);
    g_autofree char *bad_uuid = domain_xml("web1", "6F9619FF-8B86-D011-B42D", MEMFD_SHARED);
    g_autofree char *two_names = domain_xml("web1", UUID_GIVEN,
                                            "<name>web1</name>" MEMFD_SHARED);
    g_autofree char *undeclared = domain_xml("web1", UUID_GIVEN,
                                             "<metadata><pf:config merge-domain='a'/></metadata>"
                                             MEMFD_SHARED);
    g_autofree char *huge = NULL;
    g_autoptr(GString) big = g_string_new("<domain><!-- ");
    const struct {
        const char *xml;
        const char *want;
    } cases[] = {
        { "", "malformed domain XML" },
        { truncated, "malformed domain XML" },
        { "<domain><name>web1</name><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED "</domian>",
          "malformed domain XML" },
        { "<!DOCTYPE domain [<!ENTITY e SYSTEM 'file:///etc/passwd'>]>"
          "<domain><name>&e;</name><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED "</domain>",
          "malformed domain XML" },
        { "<network><name>web1</name><uuid>" UUID_GIVEN "</uuid></network>",
          "the root element is <network>, not libvirt's <domain>" },
        { "<domain xmlns='urn:elsewhere'><name>web1</name><uuid>" UUID_GIVEN "</uuid>"
          MEMFD_SHARED "</domain>",
          "the root element is <domain> of namespace urn:elsewhere, not libvirt's <domain>" },
        { "<domain><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED "</domain>",
          "the domain XML has no <name>" },
        { other_name, "the domain XML is of 'web2', not of 'web1'" },
        { no_uuid, "the domain XML has no <uuid>" },
        { bad_uuid, "<uuid> '6F9619FF-8B86-D011-B42D' is not a UUID" },
        { two_names, "more than one <name>" },
        { undeclared, "namespace prefix 'pf' of <pf:config> is not declared" },
        { NULL, "the domain XML is larger than 16 MiB" },
    };
    int pid = start_guest(f, "web1", NULL);
    g_auto(Run) r = { 0 };

    while (big->len <= (16u << 20)) {
        g_string_append(big, "padding padding padding padding padding padding padding\n");
    }
    g_string_append(big, " --><name>web1</name><uuid>" UUID_GIVEN "</uuid>" MEMFD_SHARED
                         "</domain>");
    huge = g_string_free(g_steal_pointer(&big), FALSE);
    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        g_autofree char *want = g_strdup_printf("%s", cases[i].want);

        hook(f, &r, cases[i].xml ? cases[i].xml : huge, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
        assert_said(f, &r, "web1", ": nothing done");
        g_assert_cmpuint(n_attached(f), ==, 0);
    }
    /* And the good one does attach. */
    hook(f, &r, good, "web1", "started", "begin", "-", NULL);
    g_assert_cmpuint(n_attached(f), ==, 1);
}

static void
test_unknown_op(Fixture *f, gconstpointer data)
{
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    hook(f, &r, xml, "web1", "frobnicate", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 frobnicate begin: nothing to do for operation "
                               "'frobnicate begin'");
    hook(f, &r, xml, "web1", "started", "end", "-", NULL);
    assert_said(f, &r, "web1", "nothing to do for operation 'started end'");
    hook(f, &r, "not even XML", "web1", "define", "-", "-", NULL);
    assert_said(f, &r, "web1", "nothing to do for operation 'define -'");
    g_assert_cmpuint(n_attached(f), ==, 0);
}

/* migrate, restore (and save, should libvirt call it): libvirt reads
 * stdout as the XML to go on with, empty meaning unchanged. */
static void
test_filters(Fixture *f, gconstpointer data)
{
    static const char *const ops[] = { "migrate", "restore", "save" };
    int pid = start_guest(f, "web1", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    for (guint i = 0; i < G_N_ELEMENTS(ops); i++) {
        g_autofree char *want = g_strdup_printf("web1 %s begin: domain XML passed through "
                                                "unchanged", ops[i]);

        /* run_argv() asserts the empty stdout. */
        hook(f, &r, xml, "web1", ops[i], "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
        hook(f, &r, "<domain", "web1", ops[i], "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
    }
    g_assert_cmpuint(n_attached(f), ==, 0);
}

int
main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    g_test_init(&argc, &argv, NULL);
    g_test_add("/hook/started/attaches", Fixture, NULL, setup, test_started_attaches, teardown);
    g_test_add("/hook/started/status-file", Fixture, NULL, setup, test_started_status_file,
               teardown);
    g_test_add("/hook/started/attached-already", Fixture, NULL, setup,
               test_started_attached_already, teardown);
    g_test_add("/hook/started/merge-domain", Fixture, NULL, setup, test_started_merge_domain,
               teardown);
    g_test_add("/hook/stopped/detaches", Fixture, NULL, setup, test_stopped_detaches, teardown);
    g_test_add("/hook/stopped/exited", Fixture, NULL, setup, test_stopped_exited, teardown);
    g_test_add("/hook/stopped/other-uuid", Fixture, NULL, setup, test_stopped_other_uuid,
               teardown);
    g_test_add("/hook/not-memfd", Fixture, NULL, setup, test_not_memfd, teardown);
    g_test_add("/hook/numa-shared", Fixture, NULL, setup, test_numa_shared, teardown);
    g_test_add("/hook/nosharepages", Fixture, NULL, setup, test_nosharepages, teardown);
    g_test_add("/hook/bad-argv", Fixture, NULL, setup, test_bad_argv, teardown);
    g_test_add("/hook/bad-xml", Fixture, NULL, setup, test_bad_xml, teardown);
    g_test_add("/hook/unknown-op", Fixture, NULL, setup, test_unknown_op, teardown);
    g_test_add("/hook/filters", Fixture, NULL, setup, test_filters, teardown);
    return g_test_run();
}
