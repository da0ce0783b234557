/*
 * libvirt-metadata-test.c - each VM's figures in its libvirt domain's live
 * metadata, in process, against libvirt's test driver: test:///default
 * keeps one state per process, with a running domain named "test", which
 * the publisher's connection and the test's own both see.  VMs are
 * synthetic guests held by child processes, attached by pid, given the
 * domain's UUID (or none, or one libvirt does not know).  The test driver
 * keeps no QEMU pid files: the test writes the domain's, test.pid, in a
 * folder of its own, naming the domain VM's process (or another one).
 *
 * Built without libvirt, only the knob's refusal is tested; the rest is
 * skipped, saying so.
 */
#include <glib.h>
#include <glib/gstdio.h>
#include <string.h>

#include "guestmem.h"
#include "pf-config.h"
#include "jobs.h"
#include "scan.h"
#include "util.h"
#include "testproc.h"

static void
test_knob(void)
{
    PfKnobs k;
    g_autoptr(GError) error = NULL;

    pf_knobs_init_default(&k);
    g_assert_true(pf_knobs_set(&k, "libvirt_metadata_millisecs", 0, &error));
    g_assert_no_error(error);
#if PF_HAVE_LIBVIRT
    pf_knobs_init_default(&k);
    g_assert_cmpuint(k.libvirt_metadata_millisecs, ==, 10000);
    /* Not more than once a second: each refresh makes libvirtd write. */
    g_assert_false(pf_knobs_set(&k, "libvirt_metadata_millisecs", 500, &error));
    g_assert_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT);
    g_assert_nonnull(strstr(error->message, "at least 1000"));
    g_clear_error(&error);
    g_assert_true(pf_knobs_set(&k, "libvirt_metadata_millisecs", 1000, &error));
    g_assert_cmpuint(k.libvirt_metadata_millisecs, ==, 1000);
#else
    g_assert_cmpuint(k.libvirt_metadata_millisecs, ==, 0);
    g_assert_false(pf_knobs_set(&k, "libvirt_metadata_millisecs", 10000, &error));
    g_assert_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT);
    g_assert_nonnull(strstr(error->message, "built without libvirt"));
    g_assert_cmpuint(k.libvirt_metadata_millisecs, ==, 0);
#endif
}

#if PF_HAVE_LIBVIRT

#include <dlfcn.h>
#include <errno.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "libvirt-metadata.h"

#define TEST_URI "test:///default"
#define UNKNOWN_UUID "00000000-1111-2222-3333-444444444444"

/* 1 MiB, the least a region may be.  Two guests share their identical
 * pages; each has one duplicated content and zero pages of its own. */
static const PfLayout layout = {
    .identical = 120, .duplicate = 60, .unique = 20, .zero = 40, .volatile_ = 16,
};

enum { VM_DOMAIN, VM_NO_UUID, VM_UNKNOWN, N_VMS };
/* await_element(): the domain has no element. */
#define NO_VM (-1)

typedef struct {
    PfGuest *guest[N_VMS];
    int pid[N_VMS];
    PfVm *vm[N_VMS];
    PfScanner *scanner;
    virConnectPtr conn;  /* the test's own */
    virDomainPtr dom;    /* "test" */
    char uuid[VIR_UUID_STRING_BUFLEN];
    char *pid_dir;       /* the domain's pid file, test.pid, is there */
} Fixture;

static void
quiet_error(void *user, virErrorPtr err)
{
}

/* What the worker said of VMs whose domain's QEMU is not their process
 * (it says it from its own thread). */
static gint told_other;   /* atomic: "is another process" */
static gint told_unknown; /* atomic: "is not known" */

static void
count_told(const char *domain, GLogLevelFlags level, const char *message, gpointer user)
{
    if (strstr(message, "not putting VM pid") != NULL) {
        if (strstr(message, "its QEMU is another process") != NULL) {
            g_atomic_int_inc(&told_other);
        } else if (strstr(message, "which process is its QEMU is not known") != NULL) {
            g_atomic_int_inc(&told_unknown);
        }
    }
    g_log_default_handler(domain, level, message, user);
}

/* Makes the domain's pid file name pid, as libvirt's qemu driver writes it
 * for the domain's QEMU; 0: no pid file. */
static void
write_pid_file(Fixture *f, int pid)
{
    g_autofree char *text = g_strdup_printf("%d", pid);

    pf_test_write_libvirt_status(f->pid_dir, "test", pid == 0 ? NULL : text);
}

/* A publisher that reads the domain's pid file where the test keeps it. */
static PfLibvirtMetadata *
publisher_new(Fixture *f, const char *uri)
{
    g_autoptr(GError) error = NULL;
    PfLibvirtMetadata *m = pf_libvirt_metadata_new(f->scanner, uri, &error);

    g_assert_no_error(error);
    pf_libvirt_metadata_set_pid_dir(m, f->pid_dir);
    return m;
}

static void
fixture_setup(Fixture *f, gconstpointer data)
{
    static const char *const names[N_VMS] = { "test", "no-uuid", "unknown" };

    g_autoptr(GError) dir_error = NULL;

    virSetErrorFunc(NULL, quiet_error);
    g_atomic_int_set(&told_other, 0);
    g_atomic_int_set(&told_unknown, 0);
    f->pid_dir = g_dir_make_tmp("pf-libvirt-run-XXXXXX", &dir_error);
    g_assert_no_error(dir_error);
    f->conn = virConnectOpen(TEST_URI);
    g_assert_nonnull(f->conn);
    f->dom = virDomainLookupByName(f->conn, "test");
    g_assert_nonnull(f->dom);
    g_assert_cmpint(virDomainIsActive(f->dom), ==, 1);
    g_assert_cmpint(virDomainGetUUIDString(f->dom, f->uuid), ==, 0);
    /* What an earlier case left: the state is the process's. */
    virDomainSetMetadata(f->dom, VIR_DOMAIN_METADATA_ELEMENT, NULL, NULL,
                         PF_LIBVIRT_METADATA_NS, VIR_DOMAIN_AFFECT_LIVE);

    f->scanner = pf_scanner_new(NULL);
    pf_scanner_get_knobs(f->scanner)->smart_scan = FALSE;
    for (int i = 0; i < N_VMS; i++) {
        g_autoptr(GError) error = NULL;

        f->guest[i] = pf_guest_new("memory-backend-memfd", &layout, (guint32)i + 1);
        f->pid[i] = pf_guest_hold(f->guest[i]);
        f->vm[i] = pf_vm_attach(f->pid[i], names[i], &error);
        g_assert_no_error(error);
        /* QEMU's -uuid, as libvirt gives it. */
        g_assert_true(pf_uuid_parse(i == VM_DOMAIN ? f->uuid : UNKNOWN_UUID,
                                    f->vm[i]->uuid));
        if (i == VM_NO_UUID) {
            memset(f->vm[i]->uuid, 0, sizeof(f->vm[i]->uuid));
        }
        pf_scanner_add_vm(f->scanner, f->vm[i]);
    }
    /* The domain's QEMU is the domain VM's process. */
    write_pid_file(f, f->pid[VM_DOMAIN]);
    pf_scanner_get_knobs(f->scanner)->libvirt_metadata_millisecs = 1000;
}

static void
fixture_teardown(Fixture *f, gconstpointer data)
{
    pf_scanner_free(f->scanner);
    for (int i = 0; i < N_VMS; i++) {
        pf_guest_release(f->pid[i]);
        pf_guest_free(f->guest[i]);
    }
    virDomainFree(f->dom);
    virConnectClose(f->conn);
    write_pid_file(f, 0);
    g_assert_cmpint(g_rmdir(f->pid_dir), ==, 0);
    g_free(f->pid_dir);
    /* Every worker joined, none left behind. */
    g_assert_cmpuint(pf_libvirt_metadata_workers(), ==, 0);
}

/* The element libvirt holds now, or NULL. */
static char *
element_now(Fixture *f)
{
    char *xml = virDomainGetMetadata(f->dom, VIR_DOMAIN_METADATA_ELEMENT,
                                     PF_LIBVIRT_METADATA_NS, VIR_DOMAIN_AFFECT_LIVE);

    if (xml == NULL) {
        g_assert_cmpint(virGetLastErrorCode(), ==, VIR_ERR_NO_DOMAIN_METADATA);
    }
    return xml;
}

/* The figure <name>N</name> of an element; -1 if it has none. */
static gint64
figure(const char *xml, const char *name)
{
    g_autofree char *open = g_strdup_printf("<%s>", name);
    const char *p = strstr(xml, open);

    return p != NULL ? g_ascii_strtoll(p + strlen(open), NULL, 10) : -1;
}

/* VM which's figures, as `pagefoldctl stats` has them. */
static PfCounters
vm_counters(Fixture *f, int which)
{
    GPtrArray *vms = pf_scanner_get_vms(f->scanner);
    g_autofree PfCounters *per_vm = g_new0(PfCounters, vms->len);
    PfCounters total;
    guint idx;

    g_assert_true(g_ptr_array_find(vms, f->vm[which], &idx));
    pf_scanner_collect(f->scanner, &total, per_vm);
    return per_vm[idx];
}

static PfCounters
domain_counters(Fixture *f)
{
    return vm_counters(f, VM_DOMAIN);
}

/* Whether the element shows exactly VM which's figures now. */
static gboolean
element_matches(Fixture *f, int which, const char *xml)
{
    PfCounters c = vm_counters(f, which);
    g_autofree char *pid = g_strdup_printf("pid=\"%d\"", f->pid[which]);

    return xml != NULL && strstr(xml, pid) != NULL &&
           figure(xml, "pages_shared") == (gint64)c.pages_shared &&
           figure(xml, "pages_sharing") == (gint64)c.pages_sharing &&
           figure(xml, "zero_pages") == (gint64)c.zero_pages &&
           figure(xml, "cow") == (gint64)c.cow &&
           figure(xml, "saved_bytes") == (gint64)pf_counters_saved_bytes(&c);
}

/* Runs the main loop until the domain's element shows VM which's figures
 * now (or, NO_VM, it has none), at most timeout_ms. */
static char *
await_element(Fixture *f, int which, guint timeout_ms)
{
    gint64 deadline = g_get_monotonic_time() + (gint64)timeout_ms * 1000;

    for (;;) {
        char *xml = element_now(f);

        if (which == NO_VM ? xml == NULL : element_matches(f, which, xml)) {
            return xml;
        }
        free(xml);
        if (g_get_monotonic_time() > deadline) {
            return NULL;
        }
        while (g_main_context_iteration(NULL, FALSE)) {
        }
        g_usleep(10000);
    }
}

/* Runs the main loop for ms, and returns the longest it went without
 * coming back to the test: what a call into libvirt on it would show. */
static gint64
run_loop_for(guint ms)
{
    gint64 end = g_get_monotonic_time() + (gint64)ms * 1000;
    gint64 last = g_get_monotonic_time(), longest = 0;

    while (g_get_monotonic_time() < end) {
        gint64 now;

        g_main_context_iteration(NULL, FALSE);
        g_usleep(5000);
        now = g_get_monotonic_time();
        longest = MAX(longest, now - last);
        last = now;
    }
    return longest / 1000;
}

static void
test_element(void)
{
    PfVm vm = {
        .pid = 4242,
        .mode = PF_MODE_ADVISE,
        .mode_reason = (char *)"a <vhost-user> & \"friends\"\x01!",
    };
    PfCounters c = {
        .pages_shared = 4002, .pages_sharing = 4498, .zero_pages = 3000, .cow = 7,
        .pages_unshared = 99,
    };
    g_autoptr(GDateTime) when = g_date_time_new_utc(2026, 12, 1, 10, 0, 0);
    g_autofree char *xml = pf_libvirt_metadata_element(&vm, &c, when);

    g_assert_cmpstr(xml, ==,
        "<stats pid=\"4242\" updated=\"2026-12-01T10:00:00Z\"><mode>advise</mode>"
        "<mode_reason>a &lt;vhost-user&gt; &amp; &quot;friends&quot; !</mode_reason>"
        "<pages_shared>4002</pages_shared><pages_sharing>4498</pages_sharing>"
        "<zero_pages>3000</zero_pages><cow>7</cow><backend_fold_backs>0</backend_fold_backs>"
                    "<saved_bytes>30711808</saved_bytes>"
        "</stats>");
    g_assert_cmpuint(pf_counters_saved_bytes(&c), ==, (4498 + 3000) * 4096);
    vm.mode = PF_MODE_MERGE;
    vm.mode_reason = NULL;
    g_clear_pointer(&xml, g_free);
    xml = pf_libvirt_metadata_element(&vm, &c, when);
    g_assert_nonnull(strstr(xml, "<mode>merge</mode><pages_shared>"));
}

static void
test_publish(Fixture *f, gconstpointer data)
{
    g_autoptr(PfLibvirtMetadata) m = NULL;
    PfLibvirtMetadataCounts n;
    PfCounters before;
    char *xml;

    pf_scan_job_run_passes_wait(f->scanner, 1);
    m = publisher_new(f, TEST_URI);

    /* The first snapshot comes at the first tick. */
    xml = await_element(f, VM_DOMAIN, 5000);
    g_assert_nonnull(xml);
    g_test_message("virsh metadata test %s:\n%s", PF_LIBVIRT_METADATA_NS, xml);
    g_assert_nonnull(strstr(xml, "<mode>advise</mode>"));
    g_assert_nonnull(strstr(xml, "<mode_reason>attached by pid"));
    g_assert_nonnull(strstr(xml, "updated=\""));
    free(xml);

    /* The VM without a UUID is not looked up at all; the one libvirt does
     * not know is skipped, quietly: each snapshot sets one element and
     * skips one, and nothing failed. */
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_true(n.connected);
    g_assert_cmpuint(n.published, >=, 1);
    g_assert_cmpuint(n.skipped, ==, n.published);
    g_assert_cmpuint(n.other_process, ==, 0);
    g_assert_cmpuint(n.failed, ==, 0);
    g_assert_cmpuint(n.connect_failures, ==, 0);

    /* Refreshed, at the interval, when the figures change: the second
     * pass merges. */
    before = domain_counters(f);
    pf_scan_job_run_passes_wait(f->scanner, 2);
    g_assert_cmpuint(domain_counters(f).pages_sharing, >, before.pages_sharing);
    g_assert_cmpuint(domain_counters(f).zero_pages, >, before.zero_pages);
    xml = await_element(f, VM_DOMAIN, 5000);
    g_assert_nonnull(xml);
    g_test_message("after 3 passes:\n%s", xml);
    free(xml);

    /* A UUID two attached VMs claim: the one that is the domain's QEMU
     * (its pid file says which) is published, the other is skipped, said
     * once however many snapshots come. */
    memcpy(f->vm[VM_UNKNOWN]->uuid, f->vm[VM_DOMAIN]->uuid, 16);
    for (int i = 0; i < 3; i++) {
        pf_libvirt_metadata_refresh(m);
        g_assert_true(pf_libvirt_metadata_wait(m, 5000));
        xml = element_now(f);
        g_assert_true(element_matches(f, VM_DOMAIN, xml));
        free(xml);
    }
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.other_process, ==, 3);
    g_assert_cmpuint(n.removed, ==, 0);
    g_assert_cmpint(g_atomic_int_get(&told_other), ==, 1);
    /* The other VM's QEMU is the domain's now: its figures replace the
     * first one's, which is skipped in turn. */
    write_pid_file(f, f->pid[VM_UNKNOWN]);
    xml = await_element(f, VM_UNKNOWN, 5000);
    g_assert_nonnull(xml);
    free(xml);
    g_assert_cmpint(g_atomic_int_get(&told_other), ==, 2);
    /* Neither: the element goes. */
    write_pid_file(f, f->pid[VM_NO_UUID]);
    xml = await_element(f, NO_VM, 5000);
    g_assert_null(xml);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.removed, ==, 1);
    write_pid_file(f, f->pid[VM_DOMAIN]);
    g_assert_true(pf_uuid_parse(UNKNOWN_UUID, f->vm[VM_UNKNOWN]->uuid));
    xml = await_element(f, VM_DOMAIN, 5000);
    g_assert_nonnull(xml);
    free(xml);

    /* refresh() does not wait for the interval. */
    pf_scanner_get_knobs(f->scanner)->libvirt_metadata_millisecs = 3600000;
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    pf_scan_job_run_passes_wait(f->scanner, 1);
    pf_guest_churn(f->guest[VM_DOMAIN]);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    pf_libvirt_metadata_refresh(m);
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    xml = element_now(f);
    g_assert_true(element_matches(f, VM_DOMAIN, xml));
    free(xml);

    /* A VM that detaches takes its element along. */
    pf_scanner_remove_vm(f->scanner, f->vm[VM_DOMAIN]);
    f->vm[VM_DOMAIN] = NULL;
    pf_libvirt_metadata_refresh(m);
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    xml = element_now(f);
    g_assert_null(xml);
}

static void
test_interval_off(Fixture *f, gconstpointer data)
{
    g_autoptr(PfLibvirtMetadata) m = NULL;
    PfLibvirtMetadataCounts n;
    guint64 snapshots;
    char *xml;

    pf_scan_job_run_passes_wait(f->scanner, 2);
    m = publisher_new(f, TEST_URI);
    xml = await_element(f, VM_DOMAIN, 5000);
    g_assert_nonnull(xml);
    free(xml);

    /* 0: no snapshot is taken, nothing is set, even with the figures
     * changing; refresh() does nothing either. */
    pf_scanner_get_knobs(f->scanner)->libvirt_metadata_millisecs = 0;
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    pf_libvirt_metadata_get_counts(m, &n);
    snapshots = n.snapshots;
    virDomainSetMetadata(f->dom, VIR_DOMAIN_METADATA_ELEMENT, NULL, NULL,
                         PF_LIBVIRT_METADATA_NS, VIR_DOMAIN_AFFECT_LIVE);
    pf_guest_churn(f->guest[VM_DOMAIN]);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    pf_libvirt_metadata_refresh(m);
    run_loop_for(2500);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.snapshots, ==, snapshots);
    xml = element_now(f);
    g_assert_null(xml);

    /* Back on: within a second or so. */
    pf_scanner_get_knobs(f->scanner)->libvirt_metadata_millisecs = 1000;
    xml = await_element(f, VM_DOMAIN, 3000);
    g_assert_nonnull(xml);
    free(xml);
}

/* The domain's pid file names another process than the VM that claims
 * the domain's UUID (a compromised QEMU can claim any): nothing is
 * published, and that is said once. */
static void
test_other_process(Fixture *f, gconstpointer data)
{
    g_autoptr(PfLibvirtMetadata) m = NULL;
    PfLibvirtMetadataCounts n;
    char *xml;

    write_pid_file(f, f->pid[VM_NO_UUID]);
    pf_scan_job_run_passes_wait(f->scanner, 2);
    m = publisher_new(f, TEST_URI);
    for (int i = 0; i < 3; i++) {
        pf_libvirt_metadata_refresh(m);
        g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    }
    xml = element_now(f);
    g_assert_null(xml);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_true(n.connected);
    g_assert_cmpuint(n.published, ==, 0);
    g_assert_cmpuint(n.other_process, ==, 3);
    g_assert_cmpuint(n.skipped, ==, 3);  /* the UUID libvirt does not know */
    g_assert_cmpuint(n.failed, ==, 0);
    g_assert_cmpint(g_atomic_int_get(&told_other), ==, 1);
    g_assert_cmpint(g_atomic_int_get(&told_unknown), ==, 0);

    /* It is the pid file that held it back. */
    write_pid_file(f, f->pid[VM_DOMAIN]);
    pf_libvirt_metadata_refresh(m);
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    xml = element_now(f);
    g_assert_true(element_matches(f, VM_DOMAIN, xml));
    free(xml);

    /* The domain's QEMU is another process again (it was restarted, say):
     * the element set for the VM goes. */
    write_pid_file(f, f->pid[VM_UNKNOWN]);
    pf_libvirt_metadata_refresh(m);
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    xml = element_now(f);
    g_assert_null(xml);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.published, ==, 1);
    g_assert_cmpuint(n.removed, ==, 1);
    g_assert_cmpuint(n.other_process, ==, 4);
    /* Said once for this UUID and pid already. */
    g_assert_cmpint(g_atomic_int_get(&told_other), ==, 1);
}

/* No pid file (not the qemu driver, or not written yet), or one that names
 * no process: which process the domain's QEMU is is not known, so nothing
 * is published. */
static void
test_no_pid_file(Fixture *f, gconstpointer data)
{
    g_autoptr(PfLibvirtMetadata) m = NULL;
    PfLibvirtMetadataCounts n;
    g_autofree char *path = g_build_filename(f->pid_dir, "test.pid", NULL);
    g_autoptr(GError) error = NULL;
    char *xml;

    write_pid_file(f, 0);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    m = publisher_new(f, TEST_URI);
    for (int i = 0; i < 2; i++) {
        pf_libvirt_metadata_refresh(m);
        g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    }
    xml = element_now(f);
    g_assert_null(xml);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.published, ==, 0);
    g_assert_cmpuint(n.other_process, ==, 2);
    g_assert_cmpuint(n.failed, ==, 0);
    g_assert_cmpint(g_atomic_int_get(&told_unknown), ==, 1);

    /* Not a pid: not known either, and not said again for this VM. */
    pf_test_write_libvirt_status(f->pid_dir, "test", "4242x");
    pf_libvirt_metadata_refresh(m);
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    xml = element_now(f);
    g_assert_null(xml);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.published, ==, 0);
    g_assert_cmpuint(n.other_process, ==, 3);
    g_assert_cmpint(g_atomic_int_get(&told_unknown), ==, 1);
    g_assert_cmpint(g_atomic_int_get(&told_other), ==, 0);
}

static void
test_unreachable(Fixture *f, gconstpointer data)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *dir = g_dir_make_tmp("pf-libvirt-XXXXXX", &error);
    g_autofree char *uri = g_strdup_printf("qemu+unix:///system?socket=%s/none/libvirt-sock",
                                           dir);
    PfLibvirtMetadata *m;
    PfLibvirtMetadataCounts n;
    gint64 start;

    g_assert_no_error(error);
    m = publisher_new(f, uri);
    /* Tried at every interval, said once (on stderr), the main loop never
     * held up. */
    g_assert_cmpint(run_loop_for(3500), <, 500);
    g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.connect_failures, >=, 3);
    g_assert_false(n.connected);
    g_assert_cmpuint(n.published + n.skipped + n.failed, ==, 0);

    start = g_get_monotonic_time();
    pf_libvirt_metadata_free(m);
    g_assert_cmpint(g_get_monotonic_time() - start, <, 500 * 1000);
    g_assert_cmpint(g_rmdir(dir), ==, 0);
}

/* libvirt that cannot be loaded (not installed yet, or an upgrade's that
 * needs newer libraries than pagefoldd has mapped): nothing published,
 * nothing connected, and tried again at each snapshot, so that the
 * figures go in once it can be loaded. */
static void
test_not_loaded(Fixture *f, gconstpointer data)
{
    g_autoptr(PfLibvirtMetadata) m = NULL;
    g_autoptr(GError) error = NULL;
    g_autofree char *dir = g_dir_make_tmp("pf-libvirt-lib-XXXXXX", &error);
    g_autofree char *lib = g_build_filename(dir, "libvirt.so.0", NULL);
    PfLibvirtMetadataCounts n;
    Dl_info info;
    char *xml;

    g_assert_no_error(error);
    pf_scan_job_run_passes_wait(f->scanner, 1);
    pf_libvirt_metadata_set_library(lib);
    m = publisher_new(f, TEST_URI);
    for (int i = 0; i < 2; i++) {
        pf_libvirt_metadata_refresh(m);
        g_assert_true(pf_libvirt_metadata_wait(m, 5000));
    }
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_cmpuint(n.load_failures, >=, 2);
    g_assert_cmpuint(n.connect_failures, ==, 0);
    g_assert_false(n.connected);
    g_assert_cmpuint(n.published, ==, 0);
    g_assert_null(element_now(f));

    /* libvirt installed since, where pagefoldd looks: nothing else said. */
    g_assert_true(dladdr((void *)virConnectOpen, &info) != 0);
    g_assert_cmpint(symlink(info.dli_fname, lib), ==, 0);
    xml = await_element(f, VM_DOMAIN, 5000);
    g_assert_nonnull(xml);
    free(xml);
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_true(n.connected);

    pf_libvirt_metadata_set_library(NULL);
    g_assert_cmpint(g_unlink(lib), ==, 0);
    g_assert_cmpint(g_rmdir(dir), ==, 0);
}

/* Something listens where libvirtd would, and never answers: a hung
 * libvirtd.  The worker is stuck in libvirt; the main loop is not, and
 * shutdown waits for it no longer than it says. */
static void
test_hung(Fixture *f, gconstpointer data)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *dir = g_dir_make_tmp("pf-libvirt-XXXXXX", &error);
    g_autofree char *path = g_build_filename(dir, "libvirt-sock", NULL);
    g_autofree char *uri = g_strdup_printf("qemu+unix:///system?socket=%s", path);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    PfLibvirtMetadata *m;
    PfLibvirtMetadataCounts n;
    gint64 start, took, deadline;

    g_assert_no_error(error);
    g_assert_cmpint(fd, >=, 0);
    g_strlcpy(addr.sun_path, path, sizeof(addr.sun_path));
    g_assert_cmpint(bind(fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    g_assert_cmpint(listen(fd, 8), ==, 0);

    m = publisher_new(f, uri);
    g_assert_cmpint(run_loop_for(2500), <, 500);
    g_assert_false(pf_libvirt_metadata_wait(m, 100));
    pf_libvirt_metadata_get_counts(m, &n);
    g_assert_false(n.connected);
    g_assert_cmpuint(n.connect_failures, ==, 0);

    start = g_get_monotonic_time();
    pf_libvirt_metadata_free(m);
    took = (g_get_monotonic_time() - start) / 1000;
    g_assert_cmpint(took, >=, PF_LIBVIRT_METADATA_STOP_WAIT_MS - 50);
    g_assert_cmpint(took, <, PF_LIBVIRT_METADATA_STOP_WAIT_MS + 1000);
    g_assert_cmpuint(pf_libvirt_metadata_workers(), ==, 1);

    /* libvirtd goes: the worker's call fails, and it ends on its own. */
    close(fd);
    deadline = g_get_monotonic_time() + 10 * G_TIME_SPAN_SECOND;
    while (pf_libvirt_metadata_workers() != 0 && g_get_monotonic_time() < deadline) {
        g_usleep(10000);
    }
    g_assert_cmpuint(pf_libvirt_metadata_workers(), ==, 0);
    g_assert_cmpint(g_unlink(path), ==, 0);
    g_assert_cmpint(g_rmdir(dir), ==, 0);
}

#else /* !PF_HAVE_LIBVIRT */

static void
test_skipped(void)
{
    g_test_skip("pagefold was built without libvirt (libvirt-dev missing, or "
                "meson -Dlibvirt=disabled): nothing is published");
}

#endif /* PF_HAVE_LIBVIRT */

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/libvirt-metadata/knob", test_knob);
#if PF_HAVE_LIBVIRT
    g_log_set_handler(G_LOG_DOMAIN, G_LOG_LEVEL_MESSAGE, count_told, NULL);
    g_test_add_func("/libvirt-metadata/element", test_element);
#define T(path, func) \
    g_test_add("/libvirt-metadata/" path, Fixture, NULL, fixture_setup, func, fixture_teardown)
    T("publish", test_publish);
    T("interval-off", test_interval_off);
    T("other-process", test_other_process);
    T("no-pid-file", test_no_pid_file);
    T("unreachable", test_unreachable);
    T("not-loaded", test_not_loaded);
    T("hung", test_hung);
#undef T
#else
    g_test_add_func("/libvirt-metadata/publish", test_skipped);
#endif
    return g_test_run();
}
