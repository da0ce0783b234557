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
#include <glib/gstdio.h>
#include <glib-unix.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

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

/* ---- configurations where remapping is unsafe ---- */

static JsonObject *
attached_vm(JsonArray *vms, const char *name)
{
    JsonObject *vm = pf_test_find_vm(vms, name);

    if (vm == NULL) {
        g_error("VM %s is not attached", name);
    }
    return vm;
}

/* x-query-pagefold: the guest's one agent. */
static JsonObject *
agent_info(Guest *g)
{
    JsonNode *n = pf_test_guest_qmp(g, "x-query-pagefold", NULL);
    JsonObject *o = json_object_ref(json_array_get_object_element(json_node_get_array(n), 0));

    json_node_unref(n);
    return o;
}

static gint64
agent_stat(Guest *g, const char *member)
{
    g_autoptr(JsonObject) o = agent_info(g);

    return json_object_get_int_member(o, member);
}

/*
 * The VM is attached in advise mode and says why, both in pagefoldd and in
 * QEMU; no page of it is remapped: guest RAM is one mapping of its memfd.
 */
static void
assert_advise(PfTestDaemon *d, Guest *g, const char *why)
{
    JsonNode *list = pf_test_ctl_json(d, "list", NULL);
    JsonObject *vm = attached_vm(json_node_get_array(list), g->name);
    JsonArray *regions = json_object_get_array_member(vm, "regions");
    g_autoptr(JsonObject) agent = agent_info(g);

    g_assert_cmpstr(json_object_get_string_member(vm, "mode"), ==, "advise");
    if (strstr(json_object_get_string_member(vm, "mode_reason"), why) == NULL) {
        g_error("%s: reason '%s' does not say '%s'", g->name,
                json_object_get_string_member(vm, "mode_reason"), why);
    }
    g_assert_cmpint(json_object_get_int_member(agent, "remapped"), ==, 0);
    g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "advise");
    for (guint i = 0; i < json_array_get_length(regions); i++) {
        JsonObject *r = json_array_get_object_element(regions, i);

        g_assert_cmpint(pf_test_count_vmas(g->pid, json_object_get_int_member(r, "host_addr"),
                                           json_object_get_int_member(r, "size")),
                        ==, 1);
    }
    json_node_unref(list);
}

/*
 * A vhost-user backend, just enough for QEMU to realize a vhost-user-fs
 * device: it offers virtio 1.0 and protocol features (none of them), and
 * ignores everything else.  A STAND-IN for virtiofsd, which would map
 * guest RAM from the memfd: what must never see merged pages.
 */
typedef struct {
    char *path;
    int listen_fd;
    GThread *thread;
} FakeVhostUser;

static gpointer
fake_vhost_user_serve(gpointer data)
{
    FakeVhostUser *f = data;
    int fd = accept(f->listen_fd, NULL, NULL);
    struct {
        guint32 request, flags, size;
        guint8 payload[4096];
    } msg;

    while (fd >= 0) {
        char control[CMSG_SPACE(8 * sizeof(int))];
        struct iovec iov = { &msg, 12 };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof(control) };
        ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);

        if (n != 12 || msg.size > sizeof(msg.payload) ||
            (msg.size > 0 && recv(fd, msg.payload, msg.size, MSG_WAITALL) != (ssize_t)msg.size)) {
            break;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
            int *fds = (int *)CMSG_DATA(c);

            for (gsize k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
                close(fds[k]);
            }
        }
        /* GET_FEATURES, GET_PROTOCOL_FEATURES, or a reply asked for. */
        if (msg.request == 1 || msg.request == 15 || (msg.flags & (1u << 3))) {
            /* VIRTIO_F_VERSION_1, VHOST_USER_F_PROTOCOL_FEATURES */
            guint64 value = msg.request == 1 ? (1ull << 32) | (1ull << 30) : 0;

            msg.flags = 0x1 | 0x4; /* version 1, reply */
            msg.size = 8;
            memcpy(msg.payload, &value, 8);
            if (send(fd, &msg, 12 + 8, MSG_NOSIGNAL) != 20) {
                break;
            }
        }
    }
    if (fd >= 0) {
        close(fd);
    }
    return NULL;
}

static FakeVhostUser *
fake_vhost_user_new(const char *dir)
{
    FakeVhostUser *f = g_new0(FakeVhostUser, 1);
    g_autoptr(GError) error = NULL;

    f->path = g_build_filename(dir, "vhost-user.sock", NULL);
    f->listen_fd = pf_unix_listen(f->path, SOCK_STREAM, &error);
    g_assert_no_error(error);
    /* Its thread waits in accept(). */
    g_assert_true(g_unix_set_fd_nonblocking(f->listen_fd, FALSE, NULL));
    f->thread = g_thread_new("vhost-user", fake_vhost_user_serve, f);
    return f;
}

static void
fake_vhost_user_free(FakeVhostUser *f)
{
    shutdown(f->listen_fd, SHUT_RDWR);
    close(f->listen_fd);
    g_thread_join(f->thread);
    unlink(f->path);
    g_free(f->path);
    g_free(f);
}

/* A vhost-user device (virtiofs) from the start: advise mode from the
 * start. */
static void
test_advise_vhost_user(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *dir = NULL;
    g_autofree char *chardev = NULL;
    FakeVhostUser *f;
    Guest *g;
    JsonNode *s;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    dir = g_dir_make_tmp("pagefold-vhost-XXXXXX", NULL);
    f = fake_vhost_user_new(dir);
    chardev = g_strdup_printf("socket,id=c0,path=%s", f->path);
    {
        const char *extra[] = { "-chardev", chardev, "-device",
                                "vhost-user-fs-pci,chardev=c0,tag=fs0", NULL };
        PfGuestSpec spec = { "vhost0", d->agent_sock, 256, FILL_MIB, 1, 20, 4, FALSE,
                             FALSE, extra };

        g = pf_test_guest_start(&spec);
    }
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    /* Advise mode still says what merging would save. */
    g_assert_cmpint(total(s, "zero_pages"), >=, FILL_PAGES / 5 * 9 / 10);
    json_node_unref(s);
    assert_advise(d, g, "vhost-user");
    g_free(pf_test_guest_expect(g, "PFGUEST PASS", 120));
    pf_test_guest_free(g);
    fake_vhost_user_free(f);
    g_rmdir(dir);
}

/* Merged guests, then a migration capability that needs plain RAM: each
 * guest steps back, every page folded back into its memfd, and checks
 * every byte it wrote. */
static void
test_advise_migration(void)
{
    static const char *const caps[] = { "postcopy-ram", "background-snapshot",
                                        "x-ignore-shared" };
    static const char *const why[] = { "postcopy", "background snapshot", "x-ignore-shared" };
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[3];
    JsonNode *s;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    for (int i = 0; i < 3; i++) {
        g_autofree char *name = g_strdup_printf("mig%d", i);

        g[i] = guest_start(d->agent_sock, name, i + 1, 40, FALSE);
    }
    for (int i = 0; i < 3; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 180));
    }
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES * 9 / 10);
    json_node_unref(s);
    for (int i = 0; i < 3; i++) {
        g_autofree char *args = g_strdup_printf(
            "{\"capabilities\": [{\"capability\": \"%s\", \"state\": true}]}", caps[i]);
        JsonNode *r;

        g_assert_cmpint(agent_stat(g[i], "remapped"), >, FILL_PAGES / 2);
        /* Background snapshot's own check registers guest RAM with a
         * userfaultfd of its own: it passes only if the agent let go. */
        r = pf_test_guest_qmp(g[i], "migrate-set-capabilities", args);
        json_node_unref(r);
        s = pf_test_ctl_json(d, "scan-now", "1", NULL);
        json_node_unref(s);
        assert_advise(d, g[i], why[i]);
        g_assert_cmpint(agent_stat(g[i], "connected"), ==, 1);
    }
    /* The pool keeps only what no guest maps any more: nothing. */
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(s), "pool_slots"), ==, 0);
    json_node_unref(s);
    for (int i = 0; i < 3; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST CHECK ok", 60));
        g_free(pf_test_guest_expect(g[i], "PFGUEST PASS", 120));
        pf_test_guest_free(g[i]);
    }
}

static gint64
vm_counter(JsonNode *stats, const char *vm, const char *name)
{
    JsonArray *vms = json_object_get_array_member(json_node_get_object(stats), "vms");

    return json_object_get_int_member(attached_vm(vms, vm), name);
}

/*
 * A balloon takes merged pages: pfguest merges scratch memory (zero pages
 * and one repeated page) and frees it; the balloon driver takes free
 * pages, and QEMU discards them.  The agent maps the memfd back under
 * them first, so the discard frees them and pagefoldd lets them go.
 */
static void
test_balloon(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    const char *extra[] = { "-device", "virtio-balloon-pci,id=balloon0", NULL };
    PfGuestSpec spec = { "balloon0", NULL, 256, 16, 1, 60, 4, FALSE, FALSE, extra,
                         "pfguest.scratch_mib=128 pfguest.scratch_s=20" };
    Guest *g;
    JsonNode *s;
    gint64 merged_before, discarded = 0;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    spec.agent_sock = d->agent_sock;
    g = pf_test_guest_start(&spec);
    g_free(pf_test_guest_expect(g, "PFGUEST SCRATCH filled", 120));
    /* Most of the scratch merges: zero pages, and pool pages of
     * max_page_sharing sharers each, which take a few passes to form. */
    for (int i = 0; i < 6; i++) {
        s = pf_test_ctl_json(d, "scan-now", "2", NULL);
        merged_before = vm_counter(s, "balloon0", "zero_pages") +
                        vm_counter(s, "balloon0", "pages_sharing");
        json_node_unref(s);
        if (merged_before >= 128 * 256 * 9 / 10) {
            break;
        }
    }
    g_assert_cmpint(merged_before, >=, 128 * 256 * 9 / 10);
    g_free(pf_test_guest_expect(g, "PFGUEST SCRATCH freed", 60));
    /* 100 MiB to the balloon: more than the guest has free without the
     * scratch it freed (which pages it takes is the guest's choice). */
    json_node_unref(pf_test_guest_qmp(g, "balloon", "{\"value\": 163577856}"));
    for (int i = 0; i < 300 && discarded < 100 * 256 / 4; i++) {
        g_usleep(100000);
        discarded = agent_stat(g, "discarded");
    }
    g_test_message("balloon0: %" G_GINT64_FORMAT " merged pages discarded", discarded);
    /* Seen: about half the balloon is scratch the guest freed. */
    g_assert_cmpint(discarded, >=, 1000);
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    g_assert_cmpint(vm_counter(s, "balloon0", "zero_pages") +
                        vm_counter(s, "balloon0", "pages_sharing"),
                    <=, merged_before - discarded);
    json_node_unref(s);
    g_free(pf_test_guest_expect(g, "PFGUEST CHECK ok", 60));
    g_free(pf_test_guest_expect(g, "PFGUEST PASS", 120));
    pf_test_guest_free(g);
}

/* RAM that is not a shared memfd: listed, in advise mode, saying why. */
static void
test_advise_private_ram(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    PfGuestSpec spec = { "private0", NULL, 256, FILL_MIB, 1, 8, 4, FALSE, TRUE, NULL };
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    spec.agent_sock = d->agent_sock;
    g = pf_test_guest_start(&spec);
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    assert_advise(d, g, "no shared memfd RAM");
    g_free(pf_test_guest_expect(g, "PFGUEST PASS", 120));
    pf_test_guest_free(g);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/qemu/two-guests", test_two_guests);
    g_test_add_func("/qemu/reboot-restart-shutdown", test_reboot_restart_shutdown);
    g_test_add_func("/qemu/advise/vhost-user", test_advise_vhost_user);
    g_test_add_func("/qemu/advise/migration", test_advise_migration);
    g_test_add_func("/qemu/advise/private-ram", test_advise_private_ram);
    g_test_add_func("/qemu/balloon", test_balloon);
    return g_test_run();
}
