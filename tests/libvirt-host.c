/*
 * libvirt-host.c - the host's libvirt, borrowed by the libvirt test
 * (libvirt-host.h): its libvirtd started again with the test's hook in
 * /etc/libvirt/hooks/qemu.d, which starts pagefoldd on the default
 * sockets; domains defined from the XML a user would write, started, and
 * watched on their consoles and in their logs and pagefoldd's list; and
 * all of it given back as it was found.
 *
 * With PAGEFOLD_TEST_INSTALLED set (debian/tests/libvirt), it borrows the
 * pagefold that the packages installed instead: their hook (the link in
 * /etc/libvirt/hooks/qemu.d), their pagefoldd (systemd's, or the one that
 * hook starts), at the test's pace while it runs (knobs set through the
 * control socket, given back at the end).
 *
 * Owns everything it installs, starts and defines.  Must never leave a
 * domain, the hook or a daemon of its own behind, nor leave stopped a
 * libvirtd or virtlogd it found running, nor stop an installed pagefoldd.
 */
#include "libvirt-host.h"

#include <glib/gstdio.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "testguest.h"
#include "util.h"

/* The pace of the test's pagefoldd, whichever started it. */
static const struct {
    const char *name, *value;
} test_knobs[] = {
    { "pages_to_scan", "4000" },
    { "sleep_millisecs", "10" },
    { "libvirt_metadata_millisecs", "1000" },
};

static struct {
    char *dir;          /* 0755: libvirt-qemu reads the kernel there */
    char *kernel, *initrd;
    PfTestDaemon ctl;   /* only its sock: pagefoldd is the hook's */
    gboolean libvirtd_was_running;
    gboolean virtlogd_was_running;
    /* made by the test (the hook's fallback makes the log's): removed */
    gboolean made_hooks_dir, made_hook_dir, made_log_dir;
    GPtrArray *domains; /* names defined, undefined at the end */
    gboolean installed; /* PAGEFOLD_TEST_INSTALLED: the packages' pagefold */
    /* installed: the knobs as found (set back at the end), -1 unread */
    gint64 found_knobs[G_N_ELEMENTS(test_knobs)];
} lv;

gboolean
installed_mode(void)
{
    return lv.installed;
}

const char *
hook_file(void)
{
    return lv.installed ? PACKAGE_HOOK : HOOK_FILE;
}

void
dom_free(Dom *d)
{
    g_free(d->name);
    g_free(d->uuid);
    g_free(d->console);
    g_free(d);
}

/* Runs argv; its stdout, or NULL with *err filled if it failed. */
static char *
run(char **err, const char *const *argv)
{
    g_autofree char *out = NULL, *e = NULL;
    g_autoptr(GError) error = NULL;
    gint status = 0;

    if (!g_spawn_sync(NULL, (char **)argv, NULL, G_SPAWN_SEARCH_PATH, NULL, NULL, &out, &e,
                      &status, &error)) {
        if (err) {
            *err = g_strdup(error->message);
        }
        return NULL;
    }
    if (!g_spawn_check_wait_status(status, NULL)) {
        if (err) {
            *err = g_steal_pointer(&e);
        }
        return NULL;
    }
    return g_steal_pointer(&out);
}

static char *
virsh_try(char **err, const char *a1, const char *a2, const char *a3, const char *a4)
{
    const char *argv[] = { "virsh", "-q", "-c", "qemu:///system", a1, a2, a3, a4, NULL };

    return run(err, argv);
}

/* virsh with up to three arguments, which must succeed. */
char *
virsh(const char *a1, const char *a2, const char *a3)
{
    g_autofree char *err = NULL;
    char *out = virsh_try(&err, a1, a2, a3, NULL);

    if (out == NULL) {
        g_error("virsh %s %s %s: %s", a1, a2 ? a2 : "", a3 ? a3 : "", err);
    }
    return out;
}

static int
pid_from_file(const char *path)
{
    g_autofree char *text = NULL;

    if (!g_file_get_contents(path, &text, NULL, NULL)) {
        return 0;
    }
    return atoi(text);
}

static gboolean
alive(int pid)
{
    return pid > 0 && kill(pid, 0) == 0;
}

void
wait_gone(int pid)
{
    for (int i = 0; i < 300 && alive(pid); i++) {
        g_usleep(100000);
    }
    g_assert_false(alive(pid));
}

void
libvirtd_start(void)
{
    const char *virtlogd[] = { "/usr/sbin/virtlogd", "-d", NULL };
    const char *libvirtd[] = { "/usr/sbin/libvirtd", "-d", NULL };
    g_autofree char *err = NULL;
    g_autofree char *out = NULL;

    if (!alive(pid_from_file(VIRTLOGD_PID))) {
        g_free(run(NULL, virtlogd));
    }
    g_assert_nonnull(run(NULL, libvirtd));
    for (int i = 0; i < 300 && out == NULL; i++) {
        g_clear_pointer(&err, g_free);
        out = virsh_try(&err, "list", "--all", NULL, NULL);
        if (out == NULL) {
            g_usleep(100000);
        }
    }
    if (out == NULL) {
        g_error("libvirtd does not answer: %s", err);
    }
}

void
libvirtd_stop(int sig)
{
    int pid = pid_from_file(LIBVIRTD_PID);

    if (alive(pid)) {
        kill(pid, sig);
        wait_gone(pid);
    }
    if (sig == SIGKILL) {
        g_unlink(LIBVIRTD_PID);
    }
}

/* pagefoldd's process, found by its control socket's peer. */
int
pagefoldd_pid(void)
{
    return pf_test_listener_pid(PF_DEFAULT_SOCKET);
}

void
pagefoldd_stop(void)
{
    int pid = pagefoldd_pid();

    if (pid > 0) {
        kill(pid, SIGTERM);
        wait_gone(pid);
    }
}

PfTestDaemon *
pagefoldd_ctl(void)
{
    return &lv.ctl;
}

/* Value of a knob of the running pagefoldd, from `pagefoldctl knobs`. */
static gint64
knob_of(const char *name)
{
    g_autoptr(JsonNode) knobs = pf_test_ctl_json(&lv.ctl, "knobs", NULL);
    JsonObject *o = json_node_get_object(knobs);

    g_assert_true(json_object_has_member(o, name));
    return json_object_get_int_member(o, name);
}

void
pagefoldd_test_pace(void)
{
    if (!lv.installed || pagefoldd_pid() <= 0) {
        return;
    }
    for (gsize i = 0; i < G_N_ELEMENTS(test_knobs); i++) {
        if (lv.found_knobs[i] < 0) {
            lv.found_knobs[i] = knob_of(test_knobs[i].name);
        }
        json_node_unref(
            pf_test_ctl_json(&lv.ctl, "set", test_knobs[i].name, test_knobs[i].value, NULL));
    }
}

/* The hook libvirt runs: the one built here, with pagefoldd built here.
 * pagefoldd_path NULL: one that is not there. */
void
install_hook(const char *pagefoldd_path)
{
    /* Not the host's configuration file: an empty one of the test's. */
    g_autofree char *config = g_build_filename(lv.dir, "pagefoldd.conf", NULL);
    g_autofree char *script = g_strdup_printf(
        "#!/bin/sh\n# Installed by pagefold's libvirt-test; removed when it ends.\n"
        "exec '%s' --pagefoldd '%s' --pagefoldd-arg=--config --pagefoldd-arg='%s' "
        "--pagefoldd-arg=--set --pagefoldd-arg=pages_to_scan=4000 "
        "--pagefoldd-arg=--set --pagefoldd-arg=sleep_millisecs=10 "
        "--pagefoldd-arg=--set --pagefoldd-arg=libvirt_metadata_millisecs=1000 \"$@\"\n",
        pf_test_bin("PAGEFOLD_HOOK"),
        pagefoldd_path ? pagefoldd_path : "/nonexistent/pagefoldd", config);
    g_autoptr(GError) error = NULL;

    g_assert_true(g_file_set_contents(config, "", 0, NULL));

    g_assert_cmpint(g_mkdir_with_parents(HOOK_DIR, 0755), ==, 0);
    g_file_set_contents(HOOK_FILE, script, -1, &error);
    g_assert_no_error(error);
    g_assert_cmpint(g_chmod(HOOK_FILE, 0755), ==, 0);
}

static char *
domain_xml(const DomSpec *s, const char *uuid, const char *console)
{
    g_autoptr(GString) x = g_string_new(NULL);
    g_autofree char *fs = NULL;
    g_autofree char *virtiofsd = pf_test_qemu_tool("virtiofsd");

    g_string_append_printf(x, "<domain type='qemu'>\n  <name>%s</name>\n  <uuid>%s</uuid>\n",
                           s->name, uuid);
    g_string_append(x, "  <memory unit='MiB'>192</memory>\n  <vcpu>1</vcpu>\n");
    if (s->merge_domain != NULL) {
        g_string_append_printf(x,
                               "  <metadata><pagefold:config "
                               "xmlns:pagefold='urn:pagefold:domain:1' "
                               "merge-domain='%s'/></metadata>\n",
                               s->merge_domain);
    }
    if (s->memfd || s->nosharepages) {
        g_string_append_printf(x, "  <memoryBacking>%s%s</memoryBacking>\n",
                               s->nosharepages ? "<nosharepages/>" : "",
                               s->memfd ? "<source type='memfd'/><access mode='shared'/>" : "");
    }
    /*
     * As a user writes it for virtiofs, the binary the patched one (built
     * next to QEMU): libvirt starts it and hands QEMU its socket.  chroot:
     * no namespaces needed where the tests run.
     */
    fs = s->virtiofs_dir == NULL
             ? g_strdup("")
             : g_strdup_printf("    <filesystem type='mount' accessmode='passthrough'>\n"
                               "      <driver type='virtiofs'/>\n"
                               "      <binary path='%s'><sandbox mode='chroot'/>"
                               "</binary>\n"
                               "      <source dir='%s'/><target dir='pf'/>\n"
                               "    </filesystem>\n",
                               virtiofsd, s->virtiofs_dir);
    g_string_append_printf(
        x,
        "  <os><type arch='x86_64' machine='pc'>hvm</type>\n"
        "    <kernel>%s</kernel><initrd>%s</initrd>\n"
        "    <cmdline>console=ttyS0 no_timer_check quiet pfguest.mib=64 pfguest.seed=%d "
        "pfguest.seconds=%d pfguest.check_s=3 pfguest.reboot=%d%s</cmdline>\n  </os>\n"
        /* Without ACPI (libvirt's default) a guest's power-off only halts. */
        "  <features><acpi/></features>\n"
        "  <on_poweroff>destroy</on_poweroff><on_reboot>restart</on_reboot>\n"
        "  <devices>\n    <emulator>%s</emulator>\n"
        "    <serial type='file'><source path='%s'/></serial>\n%s"
        "    <memballoon model='none'/>\n  </devices>\n</domain>\n",
        lv.kernel, lv.initrd, s->seed, s->seconds, s->reboot,
        s->virtiofs_dir != NULL ? " pfguest.virtiofs=16 pfguest.virtiofs_pause_ms=1000" : "",
        s->emulator ? s->emulator : pf_test_bin("QEMU_BINARY"), console, fs);
    return g_string_free(g_steal_pointer(&x), FALSE);
}

Dom *
dom_start(const DomSpec *s)
{
    Dom *d = g_new0(Dom, 1);
    g_autofree char *xml_path = g_strdup_printf("%s/%s.xml", lv.dir, s->name);
    g_autofree char *xml = NULL;
    g_autoptr(GError) error = NULL;

    d->name = g_strdup(s->name);
    d->uuid = g_uuid_string_random();
    d->console = g_strdup_printf("%s/%s.console", lv.dir, s->name);
    g_unlink(d->console);
    xml = domain_xml(s, d->uuid, d->console);
    g_file_set_contents(xml_path, xml, -1, &error);
    g_assert_no_error(error);
    g_free(virsh("define", xml_path, NULL));
    if (!g_ptr_array_find_with_equal_func(lv.domains, s->name, g_str_equal, NULL)) {
        g_ptr_array_add(lv.domains, g_strdup(s->name));
    }
    g_free(virsh("start", s->name, NULL));
    /* The hook started a pagefoldd for it if none ran. */
    pagefoldd_test_pace();
    return d;
}

int
dom_pid(const Dom *d)
{
    g_autofree char *path = g_strdup_printf("/run/libvirt/qemu/%s.pid", d->name);

    return pid_from_file(path);
}

void
dom_destroy(const Dom *d)
{
    int pid = dom_pid(d);

    g_free(virsh("destroy", d->name, NULL));
    wait_gone(pid);
}

/* The domain's console from where the last call stopped, until a line that
 * starts with want; a FAIL line fails the test. */
void
dom_expect(Dom *d, const char *want)
{
    gint64 end = g_get_monotonic_time() + BOOT_S * G_USEC_PER_SEC;

    while (g_get_monotonic_time() < end) {
        g_autofree char *text = NULL;
        gsize len = 0;
        char *line, *nl;

        if (g_file_get_contents(d->console, &text, &len, NULL)) {
            for (line = text + d->console_seen; (nl = strchr(line, '\n')) != NULL;
                 line = nl + 1) {
                *nl = '\0';
                d->console_seen = (gsize)(nl + 1 - text);
                if (strstr(line, "FAIL") != NULL) {
                    g_error("%s: %s", d->name, line);
                }
                if (g_str_has_prefix(line, want)) {
                    g_test_message("%s: %s", d->name, line);
                    return;
                }
            }
        }
        g_usleep(200000);
    }
    g_error("%s: no '%s' on its console within %d s", d->name, want, BOOT_S);
}

/* The domain's own log: libvirt's, with the hook's lines in it. */
char *
dom_log(const Dom *d)
{
    g_autofree char *path = g_strdup_printf("%s/%s.log", DOMAIN_LOG_DIR, d->name);
    char *text = NULL;

    g_file_get_contents(path, &text, NULL, NULL);
    return text ? text : g_strdup("");
}

/* Waits until the domain's log holds want: libvirtd runs its hooks as it
 * reconnects to running domains, after it answers its clients. */
void
wait_log(const Dom *d, const char *want)
{
    for (int i = 0; i < BOOT_S * 5; i++) {
        g_autofree char *log = dom_log(d);

        if (strstr(log, want) != NULL) {
            return;
        }
        g_usleep(200000);
    }
    g_error("%s: no '%s' in its log within %d s", d->name, want, BOOT_S);
}

/* Waits for the VM to be listed with mode; returns its entry. */
JsonObject *
wait_listed(const Dom *d, const char *mode)
{
    for (int i = 0; i < BOOT_S * 5; i++) {
        g_autoptr(JsonObject) vm =
            pagefoldd_pid() > 0 ? pf_test_listed_vm(&lv.ctl, d->name) : NULL;

        if (vm != NULL && g_str_equal(json_object_get_string_member(vm, "mode"), mode)) {
            return g_steal_pointer(&vm);
        }
        g_usleep(200000);
    }
    g_error("%s: not listed by pagefoldd in mode %s", d->name, mode);
}

void
wait_unlisted(const Dom *d)
{
    for (int i = 0; i < 300; i++) {
        g_autoptr(JsonObject) vm = pf_test_listed_vm(&lv.ctl, d->name);

        if (vm == NULL) {
            return;
        }
        g_usleep(100000);
    }
    g_error("%s: still listed by pagefoldd", d->name);
}

gint64
stat_of(const char *vm_name, const char *counter)
{
    g_autoptr(JsonNode) st = NULL;
    JsonObject *o;

    if (vm_name != NULL) {
        return pf_test_vm_counter(&lv.ctl, vm_name, counter);
    }
    st = pf_test_ctl_json(&lv.ctl, "stats", NULL);
    o = json_node_get_object(st);
    return json_object_has_member(o, counter)
               ? json_object_get_int_member(o, counter)
               : json_object_get_int_member(json_object_get_object_member(o, "total"), counter);
}

void
wait_sharing(const char *vm_name, gint64 at_least)
{
    for (int i = 0; i < BOOT_S * 2; i++) {
        if (stat_of(vm_name, "pages_sharing") >= at_least) {
            return;
        }
        g_usleep(500000);
    }
    g_error("%s: pages_sharing stayed below %" G_GINT64_FORMAT, vm_name ? vm_name : "total",
            at_least);
}

/* Whether pid runs the pagefoldd built here: one a crashed run left. */
static gboolean
ours(int pid)
{
    g_autofree char *link = g_strdup_printf("/proc/%d/exe", pid);
    g_autofree char *exe = g_file_read_link(link, NULL);
    g_autofree char *want = g_canonicalize_filename(pf_test_bin("PAGEFOLDD"), NULL);

    return exe != NULL && g_str_equal(exe, want);
}

/* Why the suite cannot run here, or NULL. */
const char *
cannot_run(void)
{
    if (geteuid() != 0) {
        return "needs root (libvirtd, its hooks, pagefoldd)";
    }
    if (!g_file_test("/usr/sbin/libvirtd", G_FILE_TEST_IS_EXECUTABLE) ||
        !g_file_test("/usr/bin/virsh", G_FILE_TEST_IS_EXECUTABLE)) {
        return "libvirt is not installed (libvirt-daemon-system, libvirt-clients)";
    }
    if (!g_getenv("QEMU_BINARY") || !g_getenv("GUEST_KERNEL") || !g_getenv("GUEST_INITRD")) {
        return "needs QEMU_BINARY, GUEST_KERNEL, GUEST_INITRD (scripts/build-qemu, "
               "scripts/build-guest)";
    }
    lv.installed = g_getenv("PAGEFOLD_TEST_INSTALLED") != NULL;
    if (lv.installed && !g_file_test(PACKAGE_HOOK, G_FILE_TEST_IS_EXECUTABLE)) {
        return "PAGEFOLD_TEST_INSTALLED, but no " PACKAGE_HOOK " (package pagefold)";
    }
    if (pagefoldd_pid() > 0 && !ours(pagefoldd_pid())) {
        return lv.installed ? "a pagefoldd other than PAGEFOLDD listens on " PF_DEFAULT_SOCKET
                            : "a pagefoldd already listens on " PF_DEFAULT_SOCKET
                              ": this suite runs its own there";
    }
    return NULL;
}

void
setup(void)
{
    g_autoptr(GError) error = NULL;
    const char *bins[] = { "GUEST_KERNEL", "GUEST_INITRD" };
    char **paths[] = { &lv.kernel, &lv.initrd };

    lv.dir = g_dir_make_tmp("pagefold-libvirt-XXXXXX", &error);
    g_assert_no_error(error);
    g_assert_cmpint(g_chmod(lv.dir, 0755), ==, 0);
    for (gsize i = 0; i < G_N_ELEMENTS(bins); i++) {
        g_autofree char *text = NULL;
        gsize len;

        g_assert_true(g_file_get_contents(pf_test_bin(bins[i]), &text, &len, NULL));
        *paths[i] = g_build_filename(lv.dir, i == 0 ? "vmlinuz" : "initrd", NULL);
        g_file_set_contents(*paths[i], text, (gssize)len, &error);
        g_assert_no_error(error);
        g_assert_cmpint(g_chmod(*paths[i], 0644), ==, 0);
    }
    lv.ctl.sock = g_strdup(PF_DEFAULT_SOCKET);
    lv.domains = g_ptr_array_new_with_free_func(g_free);
    lv.virtlogd_was_running = alive(pid_from_file(VIRTLOGD_PID));
    lv.made_hooks_dir = !g_file_test("/etc/libvirt/hooks", G_FILE_TEST_IS_DIR);
    lv.made_hook_dir = !g_file_test(HOOK_DIR, G_FILE_TEST_IS_DIR);
    lv.made_log_dir = !g_file_test(PAGEFOLDD_LOG_DIR, G_FILE_TEST_IS_DIR);
    for (gsize i = 0; i < G_N_ELEMENTS(lv.found_knobs); i++) {
        lv.found_knobs[i] = -1;
    }
    if (!lv.installed) {
        /* What a run that crashed may have left. */
        pagefoldd_stop();
        install_hook(pf_test_bin("PAGEFOLDD"));
    }
    lv.libvirtd_was_running = alive(pid_from_file(LIBVIRTD_PID));
    /* Hooks are read when libvirtd starts. */
    libvirtd_stop(SIGTERM);
    libvirtd_start();
    {
        g_autofree char *names = virsh("list", "--all", "--name");
        g_auto(GStrv) v = g_strsplit(names, "\n", -1);

        for (char **n = v; *n != NULL; n++) {
            if (g_str_has_prefix(*n, "pf-test-")) {
                g_free(virsh_try(NULL, "destroy", *n, NULL, NULL));
                g_free(virsh_try(NULL, "undefine", *n, NULL, NULL));
            }
        }
    }
}

void
teardown(void)
{
    static gboolean done;

    if (done) {
        return;
    }
    done = TRUE;
    for (guint i = 0; i < lv.domains->len; i++) {
        const char *name = g_ptr_array_index(lv.domains, i);

        g_free(virsh_try(NULL, "destroy", name, NULL, NULL));
        g_free(virsh_try(NULL, "undefine", name, NULL, NULL));
    }
    if (lv.installed) {
        /* The packages' pagefoldd at the pace it had. */
        for (gsize i = 0; i < G_N_ELEMENTS(test_knobs) && pagefoldd_pid() > 0; i++) {
            g_autofree char *v = g_strdup_printf("%" G_GINT64_FORMAT, lv.found_knobs[i]);

            if (lv.found_knobs[i] >= 0) {
                json_node_unref(pf_test_ctl_json(&lv.ctl, "set", test_knobs[i].name, v, NULL));
            }
        }
    } else {
        g_unlink(HOOK_FILE);
    }
    if (lv.made_hook_dir) {
        g_rmdir(HOOK_DIR);
    }
    if (lv.made_hooks_dir) {
        g_rmdir("/etc/libvirt/hooks");
    }
    libvirtd_stop(SIGTERM);
    if (lv.libvirtd_was_running) {
        libvirtd_start();
    } else if (!lv.virtlogd_was_running) {
        /* libvirtd_start() started it for the test's libvirtd. */
        int pid = pid_from_file(VIRTLOGD_PID);

        if (pid > 0 && alive(pid)) {
            kill(pid, SIGTERM);
            wait_gone(pid);
        }
    }
    if (!lv.installed) {
        pagefoldd_stop();
        /* What it kept of VMs attached by pid, for a pagefoldd to come. */
        g_unlink(PF_DEFAULT_SOCKET ".attached");
    }
    if (g_file_test(PAGEFOLDD_LOG, G_FILE_TEST_EXISTS)) {
        g_autofree char *text = NULL;

        g_file_get_contents(PAGEFOLDD_LOG, &text, NULL, NULL);
        g_test_message("pagefoldd's log (%s), last part:\n%s", PAGEFOLDD_LOG,
                       text && strlen(text) > 4000 ? text + strlen(text) - 4000 : text);
        if (lv.made_log_dir && !lv.installed) {
            g_unlink(PAGEFOLDD_LOG);
            g_rmdir(PAGEFOLDD_LOG_DIR);
        }
    }
    for (gsize i = 0; i < 2; i++) {
        g_unlink(i == 0 ? lv.kernel : lv.initrd);
    }
    {
        g_autoptr(GDir) dir = g_dir_open(lv.dir, 0, NULL);
        const char *f;

        while (dir != NULL && (f = g_dir_read_name(dir)) != NULL) {
            g_autofree char *p = g_build_filename(lv.dir, f, NULL);

            g_unlink(p);
        }
    }
    g_rmdir(lv.dir);
}
