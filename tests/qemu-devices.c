/*
 * qemu-devices.c - the patched QEMU's devices and configurations that
 * reach guest RAM other than through QEMU's page tables, each in a tiny
 * TCG guest against the real pagefoldd (part of the qemu-test program;
 * qemu-test.c runs it).  Where remapping is unsafe (vhost-user, migrations
 * that need plain memfd mappings, private RAM, virtio-gpu blobs, nested
 * virtualization under KVM) the VM stays in or steps back to advise mode
 * and says why; where it is made safe, it merges: a balloon's discards,
 * ivshmem's shared memory left alone, O_DIRECT reads into merged pages.
 *
 * Owns those paths, the stand-ins they need (a vhost-user backend that
 * offers no feature, an O_DIRECT disk image) and Debian's virtiofsd where
 * they run it.  Must never take advise mode for a pass without
 * its reason: each step back is matched to the words pagefoldd and the
 * agent give for it, and no page of it may stay remapped.
 */
#include <errno.h>
#include <fcntl.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <glib-unix.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "guestmem.h"
#include "qemu-common.h"
#include "testguest.h"
#include "testproc.h"
#include "util.h"

/* ---- configurations where remapping is unsafe ---- */

/*
 * The VM is attached in advise mode and says why, both in pagefoldd and in
 * QEMU; no page of it is remapped: guest RAM is one mapping of its memfd.
 */
static void
assert_advise(PfTestDaemon *d, Guest *g, const char *why)
{
    JsonNode *list = pf_test_ctl_json(d, "list", NULL);
    JsonObject *vm = attached_vm(json_node_get_array(list), g->name);
    JsonArray *regions;
    g_autoptr(JsonObject) agent = pf_test_guest_agent_info(g);

    /* The agent's ADVISE reaches pagefoldd on its own time. */
    for (int i = 0; i < 100 && g_str_equal(json_object_get_string_member(vm, "mode"), "merge");
         i++) {
        g_usleep(100000);
        json_node_unref(list);
        list = pf_test_ctl_json(d, "list", NULL);
        vm = attached_vm(json_node_get_array(list), g->name);
    }
    regions = json_object_get_array_member(vm, "regions");

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

/*
 * A guest name (its seconds, more of its command line) with a
 * vhost-user-fs device (tag) on the back-end socket sock, once it is
 * READY and three passes saw its zero pages (merged or not, they count).
 */
static Guest *
vhost_user_fs_guest(PfTestDaemon *d, const char *name, const char *sock, const char *tag,
                    int seconds, const char *cmdline)
{
    g_autofree char *chardev = g_strdup_printf("socket,id=c0,path=%s", sock);
    g_autofree char *device = g_strdup_printf("vhost-user-fs-pci,chardev=c0,tag=%s", tag);
    const char *extra[] = { "-chardev", chardev, "-device", device, NULL };
    PfGuestSpec spec = { name, d->agent_sock, 256, FILL_MIB, 1, seconds, 4, FALSE, FALSE,
                         extra, cmdline };
    Guest *g = pf_test_guest_start(&spec);
    JsonNode *s;

    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "zero_pages"), >=, FILL_PAGES / 5 * 9 / 10);
    json_node_unref(s);
    return g;
}

/* A vhost-user device (virtiofs) from the start: advise mode from the
 * start (advise mode still says what merging would save). */
static void
test_advise_vhost_user(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *dir = NULL;
    FakeVhostUser *f;
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    dir = g_dir_make_tmp("pagefold-vhost-XXXXXX", NULL);
    f = fake_vhost_user_new(dir);
    g = vhost_user_fs_guest(d, "vhost0", f->path, "fs0", 20, NULL);
    assert_advise(d, g, "vhost-user");
    g_free(pf_test_guest_expect_pass(g, 120));
    pf_test_guest_free(g);
    fake_vhost_user_free(f);
    g_rmdir(dir);
}

/* Tells the guest to stop, and returns the last line starting with prefix
 * (its counts) before its PASS; fails on a FAIL line or if there is none. */
static char *
last_counts(Guest *g, const char *prefix, guint seconds)
{
    char *counts = NULL;

    pf_test_guest_tell_stop(g);
    for (;;) {
        char *line = pf_test_guest_expect(g, "PFGUEST", seconds);

        if (g_str_has_prefix(line, prefix)) {
            g_free(counts);
            counts = line;
        } else if (g_str_has_prefix(line, "PFGUEST PASS")) {
            g_free(line);
            break;
        } else {
            g_free(line);
        }
    }
    g_assert_nonnull(counts);
    return counts;
}

/* Debian 12's virtiofsd (qemu-system-common), from the QEMU 7.2 tree this
 * project patches: the real backend a virtiofs guest has. */
#define VIRTIOFSD "/usr/lib/qemu/virtiofsd"
/* Pages of each file the guest writes and reads through the share, and
 * the files it writes by turns (pfguest.c's VFS_FILES). */
#define VIRTIOFS_BUFS 64
#define VIRTIOFS_FILES 8

/* binary serving a new empty folder (NULL, the path skipped, where it is
 * not installed or cannot run). */
static PfVirtiofsd *
virtiofsd_start(const char *binary)
{
    if (!g_file_test(binary, G_FILE_TEST_IS_EXECUTABLE)) {
        g_test_skip("no virtiofsd here (Debian 12's qemu-system-common, or scripts/build-qemu's)");
        return NULL;
    }
    /* It would take QEMU's connection, then fail to chroot and exit. */
    if (geteuid() != 0) {
        g_test_skip("virtiofsd's chroot sandbox needs root");
        return NULL;
    }
    return pf_virtiofsd_start(binary);
}

/* Every file the guest wrote through the share holds, byte for byte, its
 * last write (tests/guest/pfguest.c: write w fills file w % VIRTIOFS_FILES
 * with pfguest's pages of kind 7); returns the pages checked. */
static gsize
virtiofs_files_check(const PfVirtiofsd *v, gulong writes)
{
    guint8 want[PF_PAGE_SIZE];
    gsize pages = 0;

    for (gulong k = 0; k < MIN(writes, VIRTIOFS_FILES); k++) {
        /* the last w < writes of file k */
        gulong w = (writes - 1 - k) / VIRTIOFS_FILES * VIRTIOFS_FILES + k;
        g_autofree char *path = NULL;
        g_autofree char *data = NULL;
        gsize len = 0;

        path = g_strdup_printf("%s/f%lu", v->files, k);
        g_assert_true(g_file_get_contents(path, &data, &len, NULL));
        g_assert_cmpuint(len, ==, VIRTIOFS_BUFS * PF_PAGE_SIZE);
        for (gsize j = 0; j < VIRTIOFS_BUFS; j++) {
            pf_fill_page(want, pf_page_seed(7, 0, j, w));
            if (memcmp(data + j * PF_PAGE_SIZE, want, PF_PAGE_SIZE) != 0) {
                g_error("%s: page %zu is not that of write %lu", path, j, w);
            }
            pages++;
        }
    }
    return pages;
}

/* pfguest's virtiofs counts (all four read) and the host's check of the
 * files; returns the pages the host checked. */
static gsize
virtiofs_guest_check(Guest *g, const PfVirtiofsd *v, guint seconds)
{
    g_autofree char *counts = last_counts(g, "PFGUEST VIRTIOFS", seconds);
    gulong writes = 0, reads = 0, pages = 0, bad = 1;
    gsize checked;

    g_assert_cmpint(sscanf(counts, "PFGUEST VIRTIOFS writes=%lu reads=%lu pages=%lu bad=%lu",
                           &writes, &reads, &pages, &bad), ==, 4);
    g_assert_cmpuint(bad, ==, 0);
    g_assert_cmpuint(writes, >=, 2 * VIRTIOFS_FILES);
    g_assert_cmpuint(reads, ==, writes);
    g_assert_cmpuint(pages, ==, writes * VIRTIOFS_BUFS);
    checked = virtiofs_files_check(v, writes);
    g_test_message("%s: %lu writes and reads of %u pages through virtiofs, %zu pages of the "
                   "files checked on the host", g->name, writes, VIRTIOFS_BUFS, checked);
    return checked;
}

/* pagefoldd lists VM name in merge mode (within 10 s). */
static void
listed_merging(PfTestDaemon *d, const char *name)
{
    const char *mode = NULL;

    for (int i = 0; i < 100; i++) {
        g_autoptr(JsonNode) list = pf_test_ctl_json(d, "list", NULL);
        JsonObject *vm = pf_test_find_vm(json_node_get_array(list), name);

        g_free((char *)mode);
        mode = vm != NULL ? g_strdup(json_object_get_string_member(vm, "mode")) : NULL;
        if (g_strcmp0(mode, "merge") == 0) {
            break;
        }
        g_usleep(100000);
    }
    g_assert_cmpstr(mode, ==, "merge");
    g_free((char *)mode);
}

/*
 * A virtiofs guest with Debian's own virtiofsd: the backend maps guest
 * RAM from the memfd, so the VM is in advise mode from the start and says
 * why.  Its guest writes files through the share and reads them back,
 * through its page cache and with O_DIRECT from its buffers (virtiofsd
 * reads and writes guest RAM for both), and checks every page; the host
 * then checks the files byte for byte.
 */
static void
test_advise_virtiofs(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    PfVirtiofsd *v;
    Guest *g;

    if (!have_qemu() || (v = virtiofsd_start(VIRTIOFSD)) == NULL) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    g = vhost_user_fs_guest(d, "virtiofs0", v->sock, "pf", 20,
                            "pfguest.virtiofs=" G_STRINGIFY(VIRTIOFS_BUFS));
    /* Debian's virtiofsd is built from the unpatched tree. */
    assert_advise(d, g, "lacks VHOST_USER_PROTOCOL_F_MEM_FAULTS");
    virtiofs_guest_check(g, v, 120);
    pf_test_guest_free(g);
    pf_virtiofsd_free(v);
}

#define VIRTIOFS_MERGE_SECONDS 60

/* Waits until the agent's counter member of g passes above. */
static gint64
agent_stat_above(Guest *g, const char *member, gint64 above, guint seconds)
{
    gint64 now = pf_test_guest_agent_stat(g, member);

    for (guint i = 0; i < seconds * 10 && now <= above; i++) {
        g_usleep(100000);
        now = pf_test_guest_agent_stat(g, member);
    }
    g_test_message("%s: %s %" G_GINT64_FORMAT, g->name, member, now);
    g_assert_cmpint(now, >, above);
    return now;
}

/*
 * A virtiofs guest with the patched virtiofsd (VHOST_USER_PROTOCOL_F_MEM_FAULTS)
 * merges: virtiofsd hands QEMU's agent the faults on its mappings of guest
 * RAM.  While pagefoldd merges continuously (killed with -9 and started
 * again partway), the guest writes files through the share and reads them
 * back, through its page cache and with O_DIRECT from its buffers, and
 * rewrites and checks its other pages; virtiofsd reads and writes guest
 * RAM for every request.  Between writes the guest pauses: its buffers,
 * read back identical to what it wrote, are merged, and the next write and
 * read land in merged pages, folded back as virtiofsd touches them.  The
 * guest checks every page it reads, and the host the files byte for byte.
 */
static void
test_merge_virtiofs(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *binary = NULL;
    PfVirtiofsd *v;
    Guest *g;
    gint64 merged, fold_backs;

    if (!have_qemu()) {
        return;
    }
    binary = pf_test_qemu_tool("virtiofsd");
    if ((v = virtiofsd_start(binary)) == NULL) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", "--set", "target_pass_millisecs=500", NULL);
    g = vhost_user_fs_guest(d, "vfs-merge0", v->sock, "pf", VIRTIOFS_MERGE_SECONDS,
                            "pfguest.virtiofs=" G_STRINGIFY(VIRTIOFS_BUFS)
                            " pfguest.virtiofs_pause_ms=1500");
    listed_merging(d, g->name);
    g_assert_cmpint(pf_test_guest_agent_stat(g, "remapped"), >=, FILL_PAGES / 5 * 9 / 10);

    /* Merging all the while, pagefoldd killed once. */
    json_node_unref(pf_test_ctl_json(d, "set", "run", "1", NULL));
    g_usleep(G_USEC_PER_SEC * g_test_rand_int_range(5, 15));
    pf_test_daemon_kill(d);
    pf_test_daemon_restart(d, "--set", "run=1", "--set", "target_pass_millisecs=500", NULL);
    listed_merging(d, g->name);
    /* Its guest's page cache and buffers come from merged free pages. */
    fold_backs = agent_stat_above(g, "backend-fold-backs", 0, 30);
    merged = pf_test_guest_agent_stat(g, "merged");
    g_test_message("%s: merged %" G_GINT64_FORMAT ", folded back for virtiofsd %"
                   G_GINT64_FORMAT ", remapped now %" G_GINT64_FORMAT, g->name, merged,
                   fold_backs, pf_test_guest_agent_stat(g, "remapped"));
    listed_merging(d, g->name);
    virtiofs_guest_check(g, v, VIRTIOFS_MERGE_SECONDS + 120);
    pf_test_guest_free(g);
    pf_virtiofsd_free(v);
}

/* Waits for the migration to reach status want ("completed"). */
static void
wait_migration(Guest *g, const char *want)
{
    for (int i = 0; i < 1200; i++) {
        JsonNode *n = pf_test_guest_qmp(g, "query-migrate", NULL);
        JsonObject *o = json_node_get_object(n);
        g_autofree char *status = g_strdup(json_object_has_member(o, "status")
                                               ? json_object_get_string_member(o, "status")
                                               : "none");

        json_node_unref(n);
        if (g_str_equal(status, want)) {
            return;
        }
        if (g_str_equal(status, "failed") || g_str_equal(status, "cancelled")) {
            g_error("%s: migration %s", g->name, status);
        }
        g_usleep(100000);
    }
    g_error("%s: migration not %s within 2 minutes", g->name, want);
}

static void
set_capability(Guest *g, const char *cap, gboolean on)
{
    g_autofree char *args = g_strdup_printf(
        "{\"capabilities\": [{\"capability\": \"%s\", \"state\": %s}]}", cap,
        on ? "true" : "false");

    json_node_unref(pf_test_guest_qmp(g, "migrate-set-capabilities", args));
}

/* Merging, with most of its fill remapped. */
static void
assert_merging(Guest *g)
{
    g_autoptr(JsonObject) agent = pf_test_guest_agent_info(g);

    g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "merge");
    g_assert_cmpint(json_object_get_int_member(agent, "remapped"), >, FILL_PAGES / 2);
}

/*
 * Migrations that need guest RAM to be plain memfd mappings: a background
 * snapshot (its own userfaultfd write-protects guest RAM) and x-ignore-shared
 * (the destination takes guest RAM from the memfd).  Setting the capability
 * changes nothing, nor does a combination QEMU refuses, nor postcopy-ram (the
 * source needs nothing of it); the migration's start makes the agent fold
 * every page back (in the migration thread, the guest running) and step
 * back, and the migration completes.  The agent cannot be deleted meanwhile
 * (nobody would be left to fold its pages back).  Each guest checks every
 * byte it wrote.
 */
static void
test_advise_migration(void)
{
    static const char *const caps[] = { "background-snapshot", "x-ignore-shared" };
    static const char *const why[] = { "background snapshot", "x-ignore-shared" };
    g_autoptr(PfTestDaemon) d = NULL;
    Guest *g[2];
    JsonNode *s;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("mig%d", i);

        g[i] = guest_start(d->agent_sock, name, i + 1, 50, FALSE);
    }
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 180));
    }
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(total(s, "pages_sharing"), >=, FILL_PAGES * 9 / 10 / 2);
    json_node_unref(s);
    for (int i = 0; i < 2; i++) {
        g_autofree char *err = NULL;

        assert_merging(g[i]);
        err = pf_test_guest_qmp_error(g[i], "object-del", "{\"id\": \"pf0\"}");
        g_test_message("%s: object-del pf0: %s", g[i]->name, err);
        g_assert_nonnull(strstr(err, "pf0"));
        g_clear_pointer(&err, g_free);
        err = pf_test_guest_qmp_error(
            g[i], "migrate-set-capabilities",
            "{\"capabilities\": [{\"capability\": \"postcopy-ram\", \"state\": true},"
            " {\"capability\": \"background-snapshot\", \"state\": true}]}");
        g_test_message("%s: refused: %s", g[i]->name, err);
        assert_merging(g[i]);
        set_capability(g[i], "postcopy-ram", TRUE);
        assert_merging(g[i]);
        set_capability(g[i], "postcopy-ram", FALSE);
        set_capability(g[i], caps[i], TRUE);
        assert_merging(g[i]);

        json_node_unref(pf_test_guest_qmp(g[i], "migrate",
                                          "{\"uri\": \"exec:cat > /dev/null\"}"));
        wait_migration(g[i], "completed");
        if (g_str_equal(caps[i], "x-ignore-shared")) {
            /* A migration that completed leaves the source paused. */
            json_node_unref(pf_test_guest_qmp(g[i], "cont", NULL));
        }
        s = pf_test_ctl_json(d, "scan-now", "1", NULL);
        json_node_unref(s);
        assert_advise(d, g[i], why[i]);
        g_assert_cmpint(pf_test_guest_agent_stat(g[i], "connected"), ==, 1);
        /* Nothing is registered for userfaultfd any more: postcopy on a
         * destination, or another snapshot, may have it. */
        g_assert_cmpint(pf_test_count_vmas_flag(g[i]->pid, 0, 0, "uw"), ==, 0);
    }
    /* The pool keeps only what no guest maps any more: nothing. */
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    g_assert_cmpint(json_object_get_int_member(json_node_get_object(s), "pool_slots"), ==, 0);
    json_node_unref(s);
    for (int i = 0; i < 2; i++) {
        guest_passes(g[i]);
    }
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
        discarded = pf_test_guest_agent_stat(g, "discarded");
    }
    g_test_message("balloon0: %" G_GINT64_FORMAT " merged pages discarded", discarded);
    /* Seen: about half the balloon is scratch the guest freed. */
    g_assert_cmpint(discarded, >=, 1000);
    s = pf_test_ctl_json(d, "scan-now", "1", NULL);
    g_assert_cmpint(vm_counter(s, "balloon0", "zero_pages") +
                        vm_counter(s, "balloon0", "pages_sharing"),
                    <=, merged_before - discarded);
    json_node_unref(s);
    guest_passes(g);
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
    g = daemon_and_guest(&d, &spec);
    assert_advise(d, g, "not shared memfd RAM");
    g_free(pf_test_guest_expect_pass(g, 120));
    pf_test_guest_free(g);
}

/*
 * virtio-gpu with blob resources makes udmabufs of guest RAM's memfd:
 * merged pages would be holes there, so the VM steps back.  It needs
 * /dev/udmabuf on the host (Debian's kernels are built without it).
 */
static void
test_advise_virtio_gpu_blob(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    const char *extra[] = { "-device", "virtio-gpu-pci,blob=true", NULL };
    PfGuestSpec spec = { "gpu0", NULL, 256, FILL_MIB, 1, 10, 4, FALSE, FALSE, extra };
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    if (!g_file_test("/dev/udmabuf", G_FILE_TEST_EXISTS)) {
        g_test_skip("no /dev/udmabuf on this host: QEMU refuses virtio-gpu blob=true");
        return;
    }
    g = daemon_and_guest(&d, &spec);
    assert_advise(d, g, "virtio-gpu blob");
    g_free(pf_test_guest_expect_pass(g, 120));
    pf_test_guest_free(g);
}

/* Whether the guest's first vCPU exposes feature (a QOM property of x86
 * CPUs: "vmx", "svm"). */
static gboolean
cpu_has(Guest *g, const char *feature)
{
    JsonNode *cpus = pf_test_guest_qmp(g, "query-cpus-fast", NULL);
    JsonObject *cpu0 = json_array_get_object_element(json_node_get_array(cpus), 0);
    g_autofree char *args = g_strdup_printf("{\"path\": \"%s\", \"property\": \"%s\"}",
                                            json_object_get_string_member(cpu0, "qom-path"),
                                            feature);
    JsonNode *v = pf_test_guest_qmp(g, "qom-get", args);
    gboolean has = json_node_get_boolean(v);

    json_node_unref(v);
    json_node_unref(cpus);
    return has;
}

/* Whether QEMU really runs a guest under KVM here; says why not. */
static gboolean
kvm_usable(void)
{
    g_autofree char *why = NULL;

    if (pf_test_probe_kvm(g_getenv("GUEST_KERNEL"), g_getenv("GUEST_INITRD"), &why)) {
        return TRUE;
    }
    g_test_message("no guest under KVM here: %s", why);
    return FALSE;
}

/*
 * Under KVM, a VM whose vCPUs expose nested virtualization (VMX or SVM)
 * stays in advise mode: KVM writes its nested guests' state to guest RAM
 * outside QEMU's page tables.  Under TCG (`-cpu max` exposes SVM) it
 * merges: QEMU emulates nested virtualization through its own mappings of
 * guest RAM.  The KVM half runs where QEMU really runs a guest under KVM.
 */
static void
test_nested(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    const char *extra[] = { "-cpu", "max", NULL };
    PfGuestSpec spec = { "nested0", NULL, 256, FILL_MIB, 1, 10, 4, FALSE, FALSE, extra };
    g_autoptr(JsonObject) agent = NULL;
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    g = daemon_and_guest(&d, &spec);
    g_assert_true(cpu_has(g, "svm"));
    wait_live_regions(d, g->name, 1, NULL, NULL);
    json_node_unref(pf_test_ctl_json(d, "scan-now", "2", NULL));
    agent = pf_test_guest_agent_info(g);
    g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "merge");
    g_assert_cmpint(json_object_get_int_member(agent, "remapped"), >, 0);
    g_free(pf_test_guest_expect_pass(g, 120));
    pf_test_guest_free(g);

    if (!kvm_usable()) {
        g_test_message("the KVM half is not run");
        return;
    }
    extra[1] = "host";
    spec.name = "nested1";
    spec.accel = "kvm";
    g = pf_test_guest_start(&spec);
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    if (cpu_has(g, "vmx") || cpu_has(g, "svm")) {
        assert_advise(d, g, "nested virtualization under KVM");
    } else {
        g_test_message("this host's KVM offers guests no nested virtualization");
    }
    g_free(pf_test_guest_expect_pass(g, 120));
    pf_test_guest_free(g);
}

/* ---- shared RAM that is not guest RAM ---- */

/*
 * ivshmem-plain's memory (memdev=, a shared memfd like guest RAM) is
 * mapped by other processes too: merged pages would be holes there.  The
 * agent is handed guest RAM only, QEMU says which block it left alone,
 * and the VM merges its own RAM all the same.
 */
static void
test_ivshmem(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    const char *extra[] = { "-object", "memory-backend-memfd,id=shm,size=4M,share=on",
                            "-device", "ivshmem-plain,memdev=shm", NULL };
    PfGuestSpec spec = { "ivshmem0", NULL, 128, 16, 1, 12, 4, FALSE, FALSE, extra };
    g_autoptr(JsonObject) agent = NULL;
    g_autofree char *skipped = NULL;
    JsonNode *list, *s;
    JsonArray *regions;
    Guest *g;

    if (!have_qemu()) {
        return;
    }
    d = pf_test_daemon_start("--set", "run=0", NULL);
    spec.agent_sock = d->agent_sock;
    g = pf_test_guest_start(&spec);
    skipped = pf_test_guest_expect_text(g, "is not guest RAM", 60);
    g_assert_nonnull(strstr(skipped, "shm"));
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));

    /* One region, guest RAM, in pagefoldd and in the agent. */
    list = pf_test_ctl_json(d, "list", NULL);
    regions = json_object_get_array_member(attached_vm(json_node_get_array(list), g->name),
                                           "regions");
    g_assert_cmpint(json_array_get_length(regions), ==, 1);
    g_assert_cmpint(json_object_get_int_member(json_array_get_object_element(regions, 0), "size"),
                    ==, 128 << 20);
    json_node_unref(list);
    agent = pf_test_guest_agent_info(g);
    g_assert_cmpint(json_array_get_length(json_object_get_array_member(agent, "regions")), ==, 1);
    g_assert_cmpstr(json_object_get_string_member(agent, "mode"), ==, "merge");

    /* Guest RAM merges: its zero pages, at the least. */
    s = pf_test_ctl_json(d, "scan-now", "3", NULL);
    g_assert_cmpint(vm_counter(s, g->name, "zero_pages"), >=, 16 * 256 / 5 * 9 / 10);
    json_node_unref(s);
    g_assert_cmpint(pf_test_guest_agent_stat(g, "zeroed"), >=, 16 * 256 / 5 * 9 / 10);
    guest_passes(g);
}

/* ---- device writes behind the page tables ---- */

#define ODIRECT_BLOCKS 512 /* the disk: 2 MiB */
#define ODIRECT_BUFS 1024  /* each guest's buffer pages: every block in about 4 */
#define ODIRECT_SECONDS 20 /* each guest reads this long */

/*
 * A disk image on a file system with O_DIRECT (/var/tmp: tmpfs has none
 * before Linux 6.6), block i as pfguest computes it: pf_fill_page() of
 * pf_page_seed(5, 0, i, 0) is pfguest's fill(mix(5, 0, i, 0)).  NULL, the
 * path skipped, if O_DIRECT is refused there.
 */
static char *
odirect_image(void)
{
    g_autofree char *dir = g_strdup("/var/tmp/pagefold-odirect-XXXXXX");
    g_autofree guint8 *data = g_malloc(ODIRECT_BLOCKS * PF_PAGE_SIZE);
    g_autoptr(GError) error = NULL;
    char *path;
    int fd;

    g_assert_nonnull(g_mkdtemp(dir));
    path = g_build_filename(dir, "disk.img", NULL);
    for (guint i = 0; i < ODIRECT_BLOCKS; i++) {
        pf_fill_page(data + (gsize)i * PF_PAGE_SIZE, pf_page_seed(5, 0, i, 0));
    }
    g_assert_true(g_file_set_contents(path, (const char *)data,
                                      ODIRECT_BLOCKS * PF_PAGE_SIZE, &error));
    g_assert_no_error(error);
    fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
        g_test_skip("/var/tmp has no O_DIRECT");
        g_test_message("%s: no O_DIRECT: %s", path, g_strerror(errno));
        unlink(path);
        g_rmdir(dir);
        g_free(path);
        return NULL;
    }
    close(fd);
    return path;
}

/* Blocks of the image that no longer hold what odirect_image() wrote
 * (the test's messages say which). */
static guint
odirect_image_bad(const char *path)
{
    g_autofree char *data = NULL;
    g_autoptr(GError) error = NULL;
    guint8 want[PF_PAGE_SIZE];
    gsize len = 0;
    guint bad = 0;

    g_assert_true(g_file_get_contents(path, &data, &len, &error));
    g_assert_no_error(error);
    g_assert_cmpuint(len, ==, ODIRECT_BLOCKS * PF_PAGE_SIZE);
    for (guint i = 0; i < ODIRECT_BLOCKS; i++) {
        pf_fill_page(want, pf_page_seed(5, 0, i, 0));
        if (memcmp(data + (gsize)i * PF_PAGE_SIZE, want, PF_PAGE_SIZE) != 0) {
            g_test_message("%s: block %u differs", path, i);
            bad++;
        }
    }
    return bad;
}

static void
odirect_image_free(char *path)
{
    g_autofree char *dir = g_path_get_dirname(path);

    unlink(path);
    g_rmdir(dir);
    g_free(path);
}

/*
 * Two guests read one disk with O_DIRECT (QEMU: cache=none, aio=native or
 * io_uring) into buffers they keep: the host kernel pins each buffer page
 * while the device writes it, behind QEMU's page tables and the agent's
 * write protection.  Buffers of both guests hold the same blocks, so
 * pagefoldd merges them while reads go on: reads land in merged pages
 * (copied on write, then folded back), and pages the agent was asked to
 * merge or fold back while a read was in flight are refused (QEMU tells it
 * what address_space_map() handed out).  A page merged or folded back
 * under a read would hold stale data: each guest checks every page it
 * reads, and all its buffers again every few seconds.  Then one guest
 * steps back to advise mode in the middle of its reads.  The pages each
 * read wrote are hinted to pagefoldd, which visits them first and merges
 * them at once (no second visit): more merges under reads.
 */
static void
test_odirect(gconstpointer data)
{
    const char *aio = data;
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *image = NULL;
    g_autofree char *drive = NULL;
    Guest *g[2];
    gint64 merged[2] = { 0 }, errors[2] = { 0 }, unmerged[2] = { 0 }, cow[2] = { 0 };
    gint64 hinted[2] = { 0 };
    gint64 start, end;
    gboolean enough = FALSE;

    if (!have_qemu()) {
        return;
    }
    if ((image = odirect_image()) == NULL) {
        return;
    }
    drive = g_strdup_printf("file=%s,format=raw,if=none,id=disk0,cache=none,aio=%s,"
                            "snapshot=off,readonly=on", image, aio);
    /* Fast passes: a buffer left alone for a second or so merges. */
    d = pf_test_daemon_start("--set", "target_pass_millisecs=200", "--set", "sleep_millisecs=5",
                             NULL);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("od-%s%d", aio, i);
        const char *extra[] = { "-drive", drive, "-device", "virtio-blk-pci,drive=disk0", NULL };
        /* A read of up to 16 pages every 5 to 10 ms (TCG): each buffer
         * is rewritten every second or so, and often stays long enough
         * to merge (two passes). */
        PfGuestSpec spec = { name, d->agent_sock, 128, 1, i + 1, ODIRECT_SECONDS, 4, FALSE,
                             FALSE, extra,
                             "pfguest.odirect=" G_STRINGIFY(ODIRECT_BUFS)
                             " pfguest.odirect_pause_us=5000" };

        g[i] = pf_test_guest_start(&spec);
    }
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
    }
    /*
     * Until both guests had many merges (their identical kernels, then
     * their buffers), and the agent was asked to merge or fold back pages
     * a read was in flight to (which only an error says: the agent refuses
     * them with EBUSY, and pagefoldd logs it).  Reads that land in merged
     * buffers make most of the copies on write and fold-backs.
     */
    start = g_get_monotonic_time();
    end = start + (ODIRECT_SECONDS - 3) * G_USEC_PER_SEC;
    while (!enough && g_get_monotonic_time() < end) {
        JsonNode *s;

        g_usleep(G_USEC_PER_SEC);
        s = pf_test_ctl_json(d, "stats", NULL);
        for (int i = 0; i < 2; i++) {
            g_autoptr(JsonObject) a = pf_test_guest_agent_info(g[i]);

            merged[i] = json_object_get_int_member(a, "merged");
            errors[i] = json_object_get_int_member(a, "errors");
            unmerged[i] = json_object_get_int_member(a, "unmerged");
            cow[i] = vm_counter(s, g[i]->name, "cow");
            hinted[i] = vm_counter(s, g[i]->name, "pages_hinted");
        }
        json_node_unref(s);
        enough = merged[0] >= 1000 && merged[1] >= 1000 && unmerged[0] + unmerged[1] > 0 &&
                 errors[0] + errors[1] > 0 && hinted[0] > 0 && hinted[1] > 0;
    }
    g_test_message("after %.1f s of reads:", (g_get_monotonic_time() - start) / 1e6);
    for (int i = 0; i < 2; i++) {
        g_test_message("%s: merged %" G_GINT64_FORMAT ", refused (in DMA) %" G_GINT64_FORMAT
                       ", folded back %" G_GINT64_FORMAT ", copied on write %" G_GINT64_FORMAT
                       ", visited as read %" G_GINT64_FORMAT,
                       g[i]->name, merged[i], errors[i], unmerged[i], cow[i], hinted[i]);
        g_assert_cmpint(merged[i], >=, 1000);
        /* QEMU told its agent what the reads wrote, and pagefoldd heard. */
        g_assert_cmpint(hinted[i], >, 0);
        g_assert_cmpint(pf_test_guest_agent_stat(g[i], "hinted"), >=, hinted[i]);
    }
    g_assert_cmpint(unmerged[0] + unmerged[1], >, 0);
    g_assert_cmpint(errors[0] + errors[1], >, 0);
    /*
     * The first guest steps back while its reads go on, as an
     * x-ignore-shared migration starts: the migration thread folds back
     * what is not in DMA with the guest running, then QEMU drains block
     * I/O and the rest, buffers included, is folded back (one still in
     * DMA would fail the migration).
     */
    g_assert_cmpint(pf_test_guest_agent_stat(g[0], "remapped"), >, 0);
    set_capability(g[0], "x-ignore-shared", TRUE);
    json_node_unref(pf_test_guest_qmp(g[0], "migrate", "{\"uri\": \"exec:cat > /dev/null\"}"));
    wait_migration(g[0], "completed");
    json_node_unref(pf_test_guest_qmp(g[0], "cont", NULL));
    assert_advise(d, g[0], "x-ignore-shared");
    /* Every page each guest read was right, and so was every buffer. */
    for (int i = 0; i < 2; i++) {
        g_autofree char *counts = NULL;
        unsigned long reads = 0, pages = 0, bad = 1;

        counts = last_counts(g[i], "PFGUEST ODIRECT", ODIRECT_SECONDS + 60);
        g_assert_cmpint(sscanf(counts, "PFGUEST ODIRECT reads=%lu pages=%lu bad=%lu", &reads,
                               &pages, &bad), ==, 3);
        g_assert_cmpuint(bad, ==, 0);
        g_assert_cmpuint(reads, >=, 500);
        pf_test_guest_free(g[i]);
    }
    odirect_image_free(g_steal_pointer(&image));
}

/* The patched vhost-user-blk serving image on sock, once its
 * socket is there; NULL (the path skipped) where it was not built. */
static GSubprocess *
vhost_user_blk_start(const char *image, const char *sock)
{
    g_autofree char *binary = pf_test_qemu_tool("vhost-user-blk");
    const char *argv[] = { binary, "-s", sock, "-b", image, NULL };
    g_autoptr(GError) error = NULL;
    GSubprocess *p;

    if (!g_file_test(binary, G_FILE_TEST_IS_EXECUTABLE)) {
        g_test_skip("scripts/build-qemu built no vhost-user-blk");
        return NULL;
    }
    /* A killed one's socket is left: the new one's is the one to wait for. */
    unlink(sock);
    p = pf_test_spawnv(G_SUBPROCESS_FLAGS_NONE, argv, &error);
    g_assert_no_error(error);
    for (int i = 0; i < 300 && !g_file_test(sock, G_FILE_TEST_EXISTS); i++) {
        g_usleep(100000);
    }
    if (!g_file_test(sock, G_FILE_TEST_EXISTS)) {
        g_error("%s made no socket in 30 s", binary);
    }
    return p;
}

/* The flags pid opened path with (its first descriptor of it), or -1. */
static long
open_flags(const char *pid, const char *path)
{
    g_autofree char *dir = g_strdup_printf("/proc/%s/fd", pid);
    g_autoptr(GDir) d = g_dir_open(dir, 0, NULL);
    const char *name;

    while (d != NULL && (name = g_dir_read_name(d)) != NULL) {
        g_autofree char *link = g_build_filename(dir, name, NULL);
        g_autofree char *target = g_file_read_link(link, NULL);
        g_autofree char *info_path = g_strdup_printf("/proc/%s/fdinfo/%s", pid, name);
        g_autofree char *info = NULL;
        const char *flags;

        if (g_strcmp0(target, path) == 0 &&
            g_file_get_contents(info_path, &info, NULL, NULL) &&
            (flags = strstr(info, "flags:")) != NULL) {
            return strtol(flags + 6, NULL, 8);
        }
    }
    return -1;
}

/*
 * Two guests read one disk served by the patched vhost-user-blk (each its
 * own, VHOST_USER_PROTOCOL_F_MEM_FAULTS) with O_DIRECT into buffers they
 * keep, and write buffers back to the blocks they hold: vhost-user-blk
 * moves the data through its own mapping of guest RAM (its image opened
 * O_DSYNC rather than O_DIRECT, so that it pins no guest RAM).  Buffers
 * of both guests hold the same blocks and merge; reads and writes land in
 * merged buffers, which are folded back as vhost-user-blk touches them,
 * and pagefoldd is killed with -9 and started again partway.  Each guest
 * checks every page it reads or writes, and all its buffers again every
 * few seconds; a page written wrong lands in the image, which the next
 * reads and the check at the end find.
 */
static void
test_merge_vhost_user_blk(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *image = NULL;
    g_autofree char *dir = NULL;
    GSubprocess *blk[2] = { NULL, NULL };
    Guest *g[2];
    gint64 merged[2] = { 0 }, fold_backs[2] = { 0 };

    if (!have_qemu()) {
        return;
    }
    if ((image = odirect_image()) == NULL) {
        return;
    }
    dir = g_path_get_dirname(image);
    d = pf_test_daemon_start("--set", "target_pass_millisecs=200", "--set", "sleep_millisecs=5",
                             NULL);
    for (int i = 0; i < 2; i++) {
        g_autofree char *name = g_strdup_printf("vublk%d", i);
        g_autofree char *sock = g_strdup_printf("%s/blk%d.sock", dir, i);
        g_autofree char *chardev = g_strdup_printf("socket,id=c0,path=%s", sock);
        const char *extra[] = { "-chardev", chardev, "-device",
                                "vhost-user-blk-pci,chardev=c0", NULL };
        PfGuestSpec spec = { name, d->agent_sock, 128, 1, i + 1, ODIRECT_SECONDS, 4, FALSE,
                             FALSE, extra,
                             "pfguest.odirect=" G_STRINGIFY(ODIRECT_BUFS)
                             " pfguest.odirect_write=1 pfguest.odirect_pause_us=5000" };

        blk[i] = vhost_user_blk_start(image, sock);
        if (blk[i] == NULL) {
            odirect_image_free(g_steal_pointer(&image));
            return;
        }
        g[i] = pf_test_guest_start(&spec);
    }
    for (int i = 0; i < 2; i++) {
        g_free(pf_test_guest_expect(g[i], "PFGUEST READY", 120));
    }
    g_usleep(G_USEC_PER_SEC * g_test_rand_int_range(3, 8));
    pf_test_daemon_kill(d);
    pf_test_daemon_restart(d, "--set", "target_pass_millisecs=200", "--set",
                           "sleep_millisecs=5", NULL);
    for (int t = 0; t < ODIRECT_SECONDS - 10 &&
                    (merged[0] < 1000 || merged[1] < 1000 || fold_backs[0] + fold_backs[1] == 0);
         t++) {
        g_usleep(G_USEC_PER_SEC);
        for (int i = 0; i < 2; i++) {
            merged[i] = pf_test_guest_agent_stat(g[i], "merged");
            fold_backs[i] = pf_test_guest_agent_stat(g[i], "backend-fold-backs");
        }
    }
    for (int i = 0; i < 2; i++) {
        g_test_message("%s: merged %" G_GINT64_FORMAT ", folded back for vhost-user-blk %"
                       G_GINT64_FORMAT, g[i]->name, merged[i], fold_backs[i]);
        listed_merging(d, g[i]->name);
        g_assert_cmpint(merged[i], >=, 1000);
    }
    g_assert_cmpint(fold_backs[0] + fold_backs[1], >, 0);
    /* Its image: no O_DIRECT into guest RAM, which would pin it. */
    for (int i = 0; i < 2; i++) {
        long flags = open_flags(g_subprocess_get_identifier(blk[i]), image);

        g_assert_cmpint(flags, >=, 0);
        g_assert_cmpint(flags & O_DIRECT, ==, 0);
    }
    for (int i = 0; i < 2; i++) {
        g_autofree char *counts = last_counts(g[i], "PFGUEST ODIRECT", ODIRECT_SECONDS + 60);
        unsigned long reads = 0, pages = 0, bad = 1, writes = 0;

        g_assert_cmpint(sscanf(counts, "PFGUEST ODIRECT reads=%lu pages=%lu bad=%lu writes=%lu",
                               &reads, &pages, &bad, &writes), ==, 4);
        g_test_message("%s: %lu reads, %lu pages written, %lu bad pages", g[i]->name, reads,
                       writes, bad);
        g_assert_cmpuint(bad, ==, 0);
        g_assert_cmpuint(reads, >=, 250);
        g_assert_cmpuint(writes, >=, 250);
        pf_test_guest_free(g[i]);
        g_subprocess_force_exit(blk[i]);
        g_assert_true(g_subprocess_wait(blk[i], NULL, NULL));
        g_object_unref(blk[i]);
    }
    for (int i = 0; i < 2; i++) {
        g_autofree char *sock = g_strdup_printf("%s/blk%d.sock", dir, i);

        unlink(sock);
    }
    g_assert_cmpuint(odirect_image_bad(image), ==, 0);
    odirect_image_free(g_steal_pointer(&image));
}

/* The guest's reads and writes in a "PFGUEST ODIRECT" line printed after
 * this call (lines queued before it are passed over, and fail on a FAIL;
 * a bad page fails at once). */
static void
odirect_progress_now(Guest *g, unsigned long *reads, unsigned long *writes)
{
    unsigned long pages = 0, bad = 1;
    char *line;

    while ((line = g_async_queue_try_pop(g->lines)) != NULL) {
        g_test_message("%s: %s", g->name, line);
        g_assert_null(strstr(line, "FAIL"));
        g_free(line);
    }
    /* The first may have been on its way; the second was printed after. */
    for (int i = 0; i < 2; i++) {
        line = pf_test_guest_expect(g, "PFGUEST ODIRECT", 60);
        g_assert_cmpint(sscanf(line, "PFGUEST ODIRECT reads=%lu pages=%lu bad=%lu writes=%lu",
                               reads, &pages, &bad, writes), ==, 4);
        g_free(line);
        g_assert_cmpuint(bad, ==, 0);
    }
}

/* Everything of g unmerged now, then merged again: merges go on (when
 * says after what).  The guest itself may be waiting for its disk. */
static void
merges_again(PfTestDaemon *d, Guest *g, const char *when)
{
    gint64 merged;

    json_node_unref(pf_test_ctl_json(d, "unmerge", g->name, NULL));
    merged = pf_test_guest_agent_merged(g);
    for (int i = 0; i < 1200 && pf_test_guest_agent_merged(g) < merged + 1000; i++) {
        g_usleep(100000);
    }
    g_test_message("%s: merged %" G_GINT64_FORMAT " -> %" G_GINT64_FORMAT " %s", g->name,
                   merged, pf_test_guest_agent_merged(g), when);
    g_assert_cmpint(pf_test_guest_agent_merged(g), >=, merged + 1000);
}

/* A second DIMM plugged into g (its memory backend mem2 made before). */
static gpointer
plug_dimm(gpointer data)
{
    json_node_unref(pf_test_guest_qmp(data, "device_add",
                                      "{\"driver\": \"pc-dimm\", \"id\": \"dimm2\","
                                      " \"memdev\": \"mem2\"}"));
    return NULL;
}

/*
 * A real back-end's life beside a merging guest: vhost-user-blk plugged
 * in after the guest's pages merged (its first touches fold them back),
 * memory plugged in while it is attached (a new memory table for it),
 * the back-end killed with -9 amid merges and its own fold-backs, QEMU
 * reconnecting to a new one, the back-end stopped for a while, and memory
 * plugged in while it is stopped (QEMU waits for its answer; the VM's
 * merges wait, and pagefoldd says so).  After each event but the last,
 * everything is unmerged and must merge again.  The guest reads and
 * writes the disk with O_DIRECT all the while once it is there, checking
 * every page, and the image holds what it should at the end.
 */
static void
test_life_vhost_user_blk(void)
{
    g_autoptr(PfTestDaemon) d = NULL;
    g_autofree char *binary = NULL;
    g_autofree char *image = NULL;
    g_autofree char *dir = NULL;
    g_autofree char *sock = NULL;
    g_autofree char *chardev = NULL;
    g_autofree char *counts = NULL;
    g_autofree char *log = NULL;
    g_autofree char *waits = NULL;
    PfGuestSpec spec = { "vublk-life", NULL, 256, 16, 1, 30, 4, FALSE, FALSE, NULL,
                         "memhp_default_state=online_movable pfguest.late_mib=48"
                         " pfguest.odirect=" G_STRINGIFY(ODIRECT_BUFS)
                         " pfguest.odirect_write=1 pfguest.odirect_late=1"
                         " pfguest.odirect_pause_us=5000", 1024 };
    unsigned long reads = 0, writes = 0, pages = 0, bad = 1, reads0, writes0;
    const char *last_wait = NULL, *go_on = NULL;
    gint64 fold_backs;
    GSubprocess *blk;
    GThread *plug;
    Guest *g;
    int pid;

    if (!have_qemu()) {
        return;
    }
    binary = pf_test_qemu_tool("vhost-user-blk");
    if (!g_file_test(binary, G_FILE_TEST_IS_EXECUTABLE)) {
        g_test_skip("scripts/build-qemu built no vhost-user-blk");
        return;
    }
    if ((image = odirect_image()) == NULL) {
        return;
    }
    dir = g_path_get_dirname(image);
    sock = g_build_filename(dir, "blk.sock", NULL);
    d = pf_test_daemon_start_logged("--set", "target_pass_millisecs=200", "--set",
                                    "sleep_millisecs=5", NULL);
    spec.agent_sock = d->agent_sock;
    g = pf_test_guest_start(&spec);
    g_free(pf_test_guest_expect(g, "PFGUEST READY", 120));
    agent_stat_above(g, "merged", 1000, 120);

    /* Plugged in: its buffers were merged zero pages. */
    blk = vhost_user_blk_start(image, sock);
    chardev = g_strdup_printf("{\"id\": \"c0\", \"backend\": {\"type\": \"socket\", \"data\":"
                              " {\"addr\": {\"type\": \"unix\", \"data\": {\"path\": \"%s\"}},"
                              " \"server\": false, \"reconnect\": 1}}}", sock);
    json_node_unref(pf_test_guest_qmp(g, "chardev-add", chardev));
    json_node_unref(pf_test_guest_qmp(g, "device_add",
                                      "{\"driver\": \"vhost-user-blk-pci\", \"id\": \"blk0\","
                                      " \"chardev\": \"c0\"}"));
    fold_backs = agent_stat_above(g, "backend-fold-backs", 0, 60);
    odirect_progress_now(g, &reads, &writes);
    listed_merging(d, g->name);

    /* Memory plugged in while it is attached: a new table for it. */
    json_node_unref(pf_test_guest_qmp(g, "object-add",
                                      "{\"qom-type\": \"memory-backend-memfd\", \"id\": \"mem1\","
                                      " \"size\": 134217728, \"share\": true}"));
    json_node_unref(pf_test_guest_qmp(g, "device_add",
                                      "{\"driver\": \"pc-dimm\", \"id\": \"dimm1\","
                                      " \"memdev\": \"mem1\"}"));
    g_free(pf_test_guest_expect(g, "PFGUEST LATE filled", 120));
    wait_live_regions(d, g->name, 2, NULL, NULL);
    merges_again(d, g, "after the memory table with the DIMM");
    listed_merging(d, g->name);

    /*
     * Killed amid merges and its own fold-backs; QEMU reconnects to the
     * next one on the socket, and the guest's requests in flight go on
     * there.
     */
    g_usleep(G_USEC_PER_SEC * g_test_rand_int_range(1, 4));
    g_subprocess_send_signal(blk, SIGKILL);
    g_subprocess_wait(blk, NULL, NULL);
    g_object_unref(blk);
    merges_again(d, g, "with the back-end killed");
    /* Its successor's fold-backs count from here. */
    fold_backs = pf_test_guest_agent_stat(g, "backend-fold-backs");
    blk = vhost_user_blk_start(image, sock);
    fold_backs = agent_stat_above(g, "backend-fold-backs", fold_backs, 60);
    reads0 = reads;
    writes0 = writes;
    odirect_progress_now(g, &reads, &writes);
    g_assert_cmpuint(reads, >, reads0);
    g_assert_cmpuint(writes, >, writes0);
    listed_merging(d, g->name);

    /* Stopped: the guest's I/O waits, its merges do not. */
    pid = atoi(g_subprocess_get_identifier(blk));
    g_assert_true(kill(pid, SIGSTOP) == 0);
    merges_again(d, g, "with the back-end stopped");
    waits = g_strdup_printf("VM %s: merges wait for", g->name);

    /*
     * Memory plugged in while it is stopped: QEMU waits for its answer to
     * the new table (holding the guest too), and nothing of this VM
     * merges meanwhile; pagefoldd says so, and answers all along.  Its
     * answer comes once it goes on, and so do the merges.
     */
    json_node_unref(pf_test_guest_qmp(g, "object-add",
                                      "{\"qom-type\": \"memory-backend-memfd\", \"id\": \"mem2\","
                                      " \"size\": 134217728, \"share\": true}"));
    json_node_unref(pf_test_ctl_json(d, "unmerge", g->name, NULL));
    plug = g_thread_new("plug", plug_dimm, g);
    /* Any wait before ended: merges went on since. */
    for (int i = 0; i < 600; i++) {
        g_free(log);
        log = pf_test_daemon_log(d);
        if ((last_wait = g_strrstr(log, waits)) != NULL &&
            strstr(last_wait, "merges go on") == NULL) {
            break;
        }
        g_usleep(100000);
    }
    g_assert_nonnull(last_wait);
    g_assert_null(strstr(last_wait, "merges go on"));
    g_test_message("pagefoldd: %.*s", (int)strcspn(last_wait, "\n"), last_wait);
    json_node_unref(pf_test_ctl_json(d, "stats", NULL));
    g_assert_true(kill(pid, SIGCONT) == 0);
    g_thread_join(plug);
    for (int i = 0; i < 600 && go_on == NULL; i++) {
        g_free(log);
        log = pf_test_daemon_log(d);
        go_on = strstr(g_strrstr(log, waits), "merges go on");
        g_usleep(100000);
    }
    g_assert_nonnull(go_on);
    g_test_message("pagefoldd: %.*s", (int)strcspn(go_on, "\n"), go_on);
    wait_live_regions(d, g->name, 3, NULL, NULL);
    listed_merging(d, g->name);
    g_test_message("%s: folded back for vhost-user-blk %" G_GINT64_FORMAT, g->name,
                   pf_test_guest_agent_stat(g, "backend-fold-backs"));

    counts = last_counts(g, "PFGUEST ODIRECT", 120);
    g_assert_cmpint(sscanf(counts, "PFGUEST ODIRECT reads=%lu pages=%lu bad=%lu writes=%lu",
                           &reads, &pages, &bad, &writes), ==, 4);
    g_test_message("%s: %lu reads, %lu pages written, %lu bad pages", g->name, reads, writes,
                   bad);
    g_assert_cmpuint(bad, ==, 0);
    pf_test_guest_free(g);
    g_subprocess_force_exit(blk);
    g_assert_true(g_subprocess_wait(blk, NULL, NULL));
    g_object_unref(blk);
    unlink(sock);
    g_assert_cmpuint(odirect_image_bad(image), ==, 0);
    odirect_image_free(g_steal_pointer(&image));
}

void
qemu_devices_add_tests(void)
{
    add_func("/qemu/advise/vhost-user", test_advise_vhost_user, FALSE);
    add_func("/qemu/advise/virtiofs", test_advise_virtiofs, FALSE);
    add_func("/qemu/merge/virtiofs", test_merge_virtiofs, FALSE);
    add_func("/qemu/merge/vhost-user-blk", test_merge_vhost_user_blk, FALSE);
    add_func("/qemu/life/vhost-user-blk", test_life_vhost_user_blk, FALSE);
    add_func("/qemu/advise/migration", test_advise_migration, FALSE);
    add_func("/qemu/advise/private-ram", test_advise_private_ram, FALSE);
    add_func("/qemu/balloon", test_balloon, FALSE);
    add_func("/qemu/ivshmem", test_ivshmem, FALSE);
    add_data_func("/qemu/odirect/native", "native", test_odirect, TRUE);
    add_data_func("/qemu/odirect/io_uring", "io_uring", test_odirect, FALSE);
    add_func("/qemu/advise/virtio-gpu-blob", test_advise_virtio_gpu_blob, FALSE);
    add_func("/qemu/advise/nested", test_nested, FALSE);
}
