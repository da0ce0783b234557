/*
 * hook-pagefoldd-test.c - the libvirt qemu hook (libvirt-hooks/hook.c)
 * and pagefoldd's control socket, run as libvirtd runs it
 * (hook-fixture.c) with no pagefoldd of the fixture's: prepare starts one
 * where none answers (detached, confined as the unit would confine it),
 * and every request the hook sends, and what it makes of each answer,
 * refusals and silence included, seen by a stand-in pagefoldd.
 *
 * The stand-in is a thread here that records each request and answers
 * what the path says; and one path has the hook start this very program
 * as its "pagefoldd" (HOOK_TEST_RECORD set), which writes down the
 * arguments and descriptors it was started with.
 *
 * Owns those paths.  What a real pagefoldd does with the hook's requests
 * through a domain's life is hook-test.c's.  Must never let a pagefoldd
 * the hook started outlive its path.
 */
#include <glib.h>
#include <grp.h>
#include <json-glib/json-glib.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook-fixture.h"
#include "testproc.h"
#include "util.h"

/* ---- a stand-in pagefoldd behind the control socket ---- */

typedef struct {
    int listen_fd;
    GThread *thread;
    gint stop;
    GMutex lock;
    GPtrArray *requests; /* request lines, in order */
    GHashTable *replies; /* command -> reply line; "" never answers */
} Fake;

static char *
fake_read_line(int fd)
{
    g_autoptr(GString) s = g_string_new(NULL);
    char c;

    for (;;) {
        struct pollfd p = { .fd = fd, .events = POLLIN };

        if (poll(&p, 1, 5000) != 1 || read(fd, &c, 1) != 1) {
            return NULL;
        }
        if (c == '\n') {
            return g_string_free(g_steal_pointer(&s), FALSE);
        }
        g_string_append_c(s, c);
    }
}

static gpointer
fake_thread(gpointer data)
{
    static const char greeting[] =
        "{\"QMP\": {\"version\": {\"pagefold\": \"fake\"}, \"capabilities\": []}}\n";
    Fake *fk = data;

    while (!g_atomic_int_get(&fk->stop)) {
        struct pollfd p = { .fd = fk->listen_fd, .events = POLLIN };
        g_autofree char *line = NULL;
        g_autoptr(JsonParser) parser = json_parser_new();
        const char *cmd = "";
        const char *reply;
        int fd;

        if (poll(&p, 1, 20) != 1 || (fd = accept4(fk->listen_fd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
            continue;
        }
        (void)!write(fd, greeting, strlen(greeting));
        line = fake_read_line(fd);
        if (line != NULL && json_parser_load_from_data(parser, line, -1, NULL) &&
            JSON_NODE_HOLDS_OBJECT(json_parser_get_root(parser))) {
            cmd = json_object_get_string_member_with_default(
                json_node_get_object(json_parser_get_root(parser)), "execute", "");
        }
        g_mutex_lock(&fk->lock);
        g_ptr_array_add(fk->requests, g_strdup(line ? line : ""));
        reply = g_hash_table_lookup(fk->replies, cmd);
        g_mutex_unlock(&fk->lock);
        if (reply == NULL) {
            reply = "{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"not in the fake\"}}";
        }
        if (*reply == '\0') {
            /* Silent until the client gives up. */
            g_free(fake_read_line(fd));
        } else {
            g_autofree char *l = g_strconcat(reply, "\n", NULL);

            (void)!write(fd, l, strlen(l));
        }
        close(fd);
    }
    return NULL;
}

static Fake *
fake_start(Fixture *f)
{
    Fake *fk = g_new0(Fake, 1);
    g_autoptr(GError) error = NULL;

    fk->listen_fd = pf_unix_listen(f->sock, SOCK_STREAM, &error);
    g_assert_no_error(error);
    g_mutex_init(&fk->lock);
    fk->requests = g_ptr_array_new_with_free_func(g_free);
    fk->replies = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, g_free);
    fk->thread = g_thread_new("fake-pagefoldd", fake_thread, fk);
    return fk;
}

static void
fake_reply(Fake *fk, const char *cmd, const char *reply)
{
    g_mutex_lock(&fk->lock);
    g_hash_table_replace(fk->replies, g_strdup(cmd), g_strdup(reply));
    g_mutex_unlock(&fk->lock);
}

/* The requests so far (JSON text), and forgets them. */
static GPtrArray *
fake_take(Fake *fk)
{
    GPtrArray *r;

    g_mutex_lock(&fk->lock);
    r = g_steal_pointer(&fk->requests);
    fk->requests = g_ptr_array_new_with_free_func(g_free);
    g_mutex_unlock(&fk->lock);
    return r;
}

static void
fake_stop(Fake *fk)
{
    g_atomic_int_set(&fk->stop, 1);
    g_thread_join(fk->thread);
    close(fk->listen_fd);
    g_ptr_array_unref(fk->requests);
    g_hash_table_unref(fk->replies);
    g_mutex_clear(&fk->lock);
    g_free(fk);
}

G_DEFINE_AUTOPTR_CLEANUP_FUNC(Fake, fake_stop)

/* Asserts the one request was attach with exactly these arguments
 * (merge_domain NULL: none). */
static void
assert_attach_request(const char *line, int pid, const char *name, const char *uuid,
                      const char *merge_domain)
{
    g_autoptr(JsonParser) p = json_parser_new();
    g_autoptr(GError) error = NULL;
    JsonObject *req, *args;

    json_parser_load_from_data(p, line, -1, &error);
    g_assert_no_error(error);
    req = json_node_get_object(json_parser_get_root(p));
    g_assert_cmpuint(json_object_get_size(req), ==, 2);
    g_assert_cmpstr(json_object_get_string_member(req, "execute"), ==, "attach");
    args = json_object_get_object_member(req, "arguments");
    g_assert_cmpuint(json_object_get_size(args), ==, merge_domain ? 4 : 3);
    g_assert_cmpint(json_object_get_int_member(args, "pid"), ==, pid);
    g_assert_cmpstr(json_object_get_string_member(args, "name"), ==, name);
    g_assert_cmpstr(json_object_get_string_member(args, "uuid"), ==, uuid);
    if (merge_domain != NULL) {
        g_assert_cmpstr(json_object_get_string_member(args, "merge-domain"), ==, merge_domain);
    }
}

/* ---- prepare: pagefoldd runs ---- */

static gboolean
pagefoldd_knows_agent_group(void)
{
    const char *argv[] = { pf_test_bin("PAGEFOLDD"), "--help", NULL };
    g_autofree char *out = NULL;

    g_assert_true(g_spawn_sync(NULL, (char **)argv, NULL, G_SPAWN_STDERR_TO_DEV_NULL, NULL, NULL,
                               &out, NULL, NULL, NULL));
    return strstr(out, "--agent-group") != NULL;
}

/* The pid in "started pagefoldd (pid N)". */
static int
started_pid(const Run *r)
{
    const char *p = strstr(r->err, "started pagefoldd (pid ");

    g_assert_nonnull(p);
    return atoi(p + strlen("started pagefoldd (pid "));
}

static void
test_prepare_starts_pagefoldd(Fixture *f, gconstpointer data)
{
    g_autofree char *agent_sock = g_build_filename(f->dir, "agent.sock", NULL);
    g_autofree char *agent_arg = g_strconcat("--pagefoldd-arg=", agent_sock, NULL);
    g_autofree char *pflog = g_build_filename(f->dir, "pagefold", "pagefoldd.log", NULL);
    g_autofree char *pfdir = g_path_get_dirname(pflog);
    /* Not the host's configuration file. */
    g_autofree char *config = g_build_filename(f->dir, "pagefoldd.conf", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *answers = g_strdup_printf("web1 prepare begin: pagefoldd answers on %s",
                                               f->sock);
    g_autofree char *text = NULL;
    g_autofree char *header = g_strdup_printf("pagefold-hook: for domain web1: %s --socket %s",
                                              pf_test_bin("PAGEFOLDD"), f->sock);
    /* Until pagefoldd has --agent-group, the hook is told to pass none. */
    const char *group = pagefoldd_knows_agent_group() ? "libvirt-qemu" : "";
    PfTestDaemon d = { .sock = f->sock };
    g_autoptr(JsonNode) list = NULL;
    g_auto(Run) r = { 0 };
    struct stat st;
    int listener = 0;

    g_assert_true(g_file_set_contents(config, "", 0, NULL));
    hook(f, &r, xml, "--pagefoldd", pf_test_bin("PAGEFOLDD"), "--pagefoldd-arg",
         "--agent-socket", agent_arg, "--pagefoldd-arg", "--config", "--pagefoldd-arg", config,
         "--pagefoldd-arg", "--set", "--pagefoldd-arg", "run=0",
         "--pagefoldd-arg", "--set", "--pagefoldd-arg", "libvirt_metadata_millisecs=0",
         "--pagefoldd-log", pflog, "--agent-group", group, "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 prepare begin: pagefoldd does not answer (");
    assert_said(f, &r, "web1", "started pagefoldd (pid ");
    f->spawned = started_pid(&r);
    /* It answers (by the hook's deadline or a little after: its own
     * log said which). */
    for (int i = 0; i < 1000 && ((listener = pf_test_listener_pid(f->sock)) == 0 ||
                                 !g_file_test(agent_sock, G_FILE_TEST_EXISTS)); i++) {
        g_usleep(10000);
    }
    g_assert_cmpint(listener, ==, f->spawned);
    {
        /* What the unit would take away that a process can: every
         * capability but CHOWN, DAC_READ_SEARCH, SYS_PTRACE and
         * SYS_ADMIN, and new privileges. */
        g_autofree char *status_path = g_strdup_printf("/proc/%d/status", f->spawned);
        g_autofree char *status = NULL;

        g_assert_true(g_file_get_contents(status_path, &status, NULL, NULL));
        g_assert_nonnull(strstr(status, "\nNoNewPrivs:\t1\n"));
        g_assert_nonnull(strstr(status, "\nCapBnd:\t0000000000280005\n"));
        g_assert_nonnull(strstr(status, "\nCapPrm:\t0000000000280005\n"));
        g_assert_nonnull(strstr(status, "\nCapEff:\t0000000000280005\n"));
        g_assert_nonnull(strstr(status, "\nCapInh:\t0000000000000000\n"));
        g_assert_nonnull(strstr(status, "\nCapAmb:\t0000000000000000\n"));
    }
    list = pf_test_ctl_json(&d, "list", NULL);
    g_assert_cmpuint(json_array_get_length(json_node_get_array(list)), ==, 0);
    g_assert_true(g_file_test(agent_sock, G_FILE_TEST_EXISTS));
    /* Its log: made with its folder, 0750, headed by the hook. */
    g_assert_cmpint(stat(pfdir, &st), ==, 0);
    g_assert_cmpint(st.st_mode & 07777, ==, 0750);
    g_assert_true(g_file_get_contents(pflog, &text, NULL, NULL));
    g_assert_nonnull(strstr(text, header));

    /* Running: nothing more to do. */
    hook(f, &r, xml, "--pagefoldd", pf_test_bin("PAGEFOLDD"), "--pagefoldd-log", pflog,
         "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", answers);
    g_assert_null(strstr(r.err, "started pagefoldd"));
    g_assert_cmpint(pf_test_listener_pid(f->sock), ==, f->spawned);
    kill_and_wait(f->spawned);
    f->spawned = 0;
}

/*
 * --start-pagefoldd, the package's postinst after it stopped the old
 * pagefoldd where systemd does not run: one started as prepare starts it,
 * exit 0 once it answers; 0 again, starting none, while it runs; 1 when
 * none can start.
 */
static void
test_start_only(Fixture *f, gconstpointer data)
{
    g_autofree char *agent_sock = g_build_filename(f->dir, "agent.sock", NULL);
    g_autofree char *agent_arg = g_strconcat("--pagefoldd-arg=", agent_sock, NULL);
    g_autofree char *pflog = g_build_filename(f->dir, "pagefold", "pagefoldd.log", NULL);
    g_autofree char *config = g_build_filename(f->dir, "pagefoldd.conf", NULL);
    g_auto(Run) r = { 0 };

    g_assert_true(g_file_set_contents(config, "", 0, NULL));
    hook(f, &r, "", "--pagefoldd", pf_test_bin("PAGEFOLDD"), "--pagefoldd-arg",
         "--agent-socket", agent_arg, "--pagefoldd-arg", "--config", "--pagefoldd-arg", config,
         "--pagefoldd-arg", "--set", "--pagefoldd-arg", "run=0", "--pagefoldd-log", pflog,
         "--agent-group", "", "--start-pagefoldd", NULL);
    g_test_message("%s", r.err);
    g_assert_cmpint(r.status, ==, 0);
    f->spawned = started_pid(&r);
    g_assert_cmpint(pf_test_listener_pid(f->sock), ==, f->spawned);

    hook(f, &r, "", "--pagefoldd", pf_test_bin("PAGEFOLDD"), "--pagefoldd-log", pflog,
         "--start-pagefoldd", NULL);
    g_assert_cmpint(r.status, ==, 0);
    g_assert_null(strstr(r.err, "started pagefoldd"));
    g_assert_cmpint(pf_test_listener_pid(f->sock), ==, f->spawned);
    kill_and_wait(f->spawned);
    f->spawned = 0;

    hook(f, &r, "", "--pagefoldd", "/nonexistent/pagefoldd", "--pagefoldd-log", pflog,
         "--start-pagefoldd", NULL);
    g_test_message("%s", r.err);
    g_assert_cmpint(r.status, ==, 1);
    g_assert_cmpint(pf_test_listener_pid(f->sock), ==, 0);
}

/*
 * The pagefoldd the hook starts is this program (HOOK_TEST_RECORD): it
 * writes down how it was started.  Detached: stdin /dev/null, stdout and
 * stderr the pagefoldd log, nothing else of the hook's (libvirtd reads
 * the hook's pipes to EOF), a session of its own that it does not lead.
 */
static void
test_prepare_detached(Fixture *f, gconstpointer data)
{
    g_autofree char *exe = g_file_read_link("/proc/self/exe", NULL);
    g_autofree char *rec = g_build_filename(f->dir, "record", NULL);
    g_autofree char *pflog = g_build_filename(f->dir, "pagefoldd.log", NULL);
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *text = NULL;
    g_autofree char *logtext = NULL;
    g_autofree char *no_answer = g_strdup_printf("pagefoldd does not answer on %s yet", f->sock);
    g_autoptr(GPtrArray) want_args = g_ptr_array_new();
    g_autoptr(GPtrArray) args = g_ptr_array_new_with_free_func(g_free);
    g_auto(GStrv) lines = NULL;
    const char *hook_args[] = {
        "--socket", f->sock, "--run-dir", f->run_dir, "--log-dir", f->log_dir,
        "--pagefoldd", exe, "--pagefoldd-arg", "--agent-socket", "--pagefoldd-arg",
        "/nonexistent/agent.sock", "--pagefoldd-log", pflog,
        "web1", "prepare", "begin", "-", NULL
    };
    g_auto(Run) r = { 0 };
    guint n_fds = 0;
    int pid = 0, sid = 0;

    run_argv(hook_args, xml, rec, &r);
    assert_said(f, &r, "web1", "started pagefoldd (pid ");
    assert_said(f, &r, "web1", no_answer);
    for (int i = 0; i < 1000 && !g_file_test(rec, G_FILE_TEST_EXISTS); i++) {
        g_usleep(10000);
    }
    g_assert_true(g_file_get_contents(rec, &text, NULL, NULL));
    lines = g_strsplit(text, "\n", -1);
    for (char **l = lines; *l; l++) {
        int fd;
        char target[4096];

        if (g_str_has_prefix(*l, "arg ")) {
            g_ptr_array_add(args, g_strdup(*l + 4));
        } else if (sscanf(*l, "fd %d %4095s", &fd, target) == 2) {
            n_fds++;
            if (fd == 0) {
                g_assert_cmpstr(target, ==, "/dev/null");
            } else if (fd == 1 || fd == 2) {
                g_assert_cmpstr(target, ==, pflog);
            } else {
                g_error("the started pagefoldd has fd %d (%s) of the hook's", fd, target);
            }
        } else if (g_str_has_prefix(*l, "pid ")) {
            pid = atoi(*l + 4);
        } else if (g_str_has_prefix(*l, "sid ")) {
            sid = atoi(*l + 4);
        }
    }
    g_assert_cmpuint(n_fds, ==, 3);
    g_assert_cmpint(pid, ==, started_pid(&r));
    g_assert_cmpint(sid, !=, getsid(0));
    g_assert_cmpint(sid, !=, pid);
    g_assert_cmpint(sid, >, 0);

    g_ptr_array_add(want_args, (char *)"--socket");
    g_ptr_array_add(want_args, f->sock);
    if (getgrnam("libvirt-qemu") != NULL) {
        g_ptr_array_add(want_args, (char *)"--agent-group");
        g_ptr_array_add(want_args, (char *)"libvirt-qemu");
    }
    g_ptr_array_add(want_args, (char *)"--agent-socket");
    g_ptr_array_add(want_args, (char *)"/nonexistent/agent.sock");
    g_assert_cmpuint(args->len, ==, want_args->len);
    for (guint i = 0; i < args->len; i++) {
        g_assert_cmpstr(g_ptr_array_index(args, i), ==, g_ptr_array_index(want_args, i));
    }
    /* What it printed went to the log, not to the hook's stdout. */
    for (int i = 0; i < 1000; i++) {
        g_clear_pointer(&logtext, g_free);
        g_assert_true(g_file_get_contents(pflog, &logtext, NULL, NULL));
        if (strstr(logtext, "recording pagefoldd was here") != NULL) {
            break;
        }
        g_usleep(10000);
    }
    g_assert_nonnull(strstr(logtext, "recording pagefoldd was here"));
    g_assert_nonnull(strstr(logtext, "pagefold-hook: for domain web1: "));
}

/* Run as the hook's pagefoldd: writes down argv, open descriptors, pid
 * and session, then says hello on stdout. */
static int
record_start(const char *path, int argc, char **argv)
{
    g_autoptr(GString) s = g_string_new(NULL);
    g_autofree char *tmp = g_strconcat(path, ".tmp", NULL);
    g_autoptr(GDir) dir = g_dir_open("/proc/self/fd", 0, NULL);
    const char *e;

    for (int i = 1; i < argc; i++) {
        g_string_append_printf(s, "arg %s\n", argv[i]);
    }
    /* GDir's own descriptor reads as the folder itself. */
    while (dir != NULL && (e = g_dir_read_name(dir)) != NULL) {
        g_autofree char *link = g_build_filename("/proc/self/fd", e, NULL);
        g_autofree char *target = g_file_read_link(link, NULL);

        if (target != NULL && !g_str_has_prefix(target, "/proc/")) {
            g_string_append_printf(s, "fd %s %s\n", e, target);
        }
    }
    g_string_append_printf(s, "pid %d\nsid %d\n", (int)getpid(), (int)getsid(0));
    if (!g_file_set_contents(tmp, s->str, -1, NULL) || rename(tmp, path) < 0) {
        return 1;
    }
    printf("the recording pagefoldd was here\n");
    return 0;
}

/* ---- the requests, with a stand-in pagefoldd ---- */

#define ATTACHED_REPLY "{\"return\": {\"name\": \"web1\", \"pid\": %d, \"uuid\": \"" UUID_CANON \
                       "\", \"mode\": \"advise\", \"pages\": 4096, \"regions\": [{}]}}"

static void
test_attach_requests(Fixture *f, gconstpointer data)
{
    static const struct {
        const char *metadata;
        const char *merge_domain;
    } cases[] = {
        { "", NULL },
        { "<metadata><tenancy:config xmlns:tenancy='urn:pagefold:domain:1' "
          "merge-domain='tenant-a'/></metadata>", "tenant-a" },
        { "<metadata xmlns:pf='urn:pagefold:domain:1'><pf:config merge-domain='tenant b'/>"
          "</metadata>", "tenant b" },
        { "<metadata><config xmlns='urn:pagefold:domain:1' merge-domain='c&amp;d'/></metadata>",
          "c&d" },
        /* Other namespaces' elements are not pagefold's. */
        { "<metadata><app:config xmlns:app='urn:example:other' merge-domain='x'/>"
          "<libosinfo:libosinfo xmlns:libosinfo='http://libosinfo.org/xmlns/libvirt/domain/1.0'>"
          "<libosinfo:os id='http://debian.org/debian/12'/></libosinfo:libosinfo></metadata>",
          NULL },
        /* The innermost declaration of a prefix counts. */
        { "<metadata xmlns:pf='urn:pagefold:domain:1'><pf:config xmlns:pf='urn:other' "
          "merge-domain='x'/></metadata>", NULL },
        /* Not in <metadata>: not libvirt's place for it. */
        { "<devices><pf:config xmlns:pf='urn:pagefold:domain:1' merge-domain='x'/></devices>",
          NULL },
    };
    g_autoptr(Fake) fk = fake_start(f);
    int pid = getpid(); /* the stand-in pagefoldd does not look */
    g_autofree char *reply = g_strdup_printf(ATTACHED_REPLY, pid);
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    fake_reply(fk, "attach", reply);
    for (guint i = 0; i < G_N_ELEMENTS(cases); i++) {
        g_autofree char *more = g_strconcat(cases[i].metadata, MEMFD_SHARED, NULL);
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, more);
        g_autofree char *want = g_strdup_printf(
            "attached pid %d as VM 'web1' (uuid " UUID_CANON "%s%s) in mode advise: 1 region(s), "
            "16.0 MiB", pid, cases[i].merge_domain ? ", merge domain " : "",
            cases[i].merge_domain ? cases[i].merge_domain : "");
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", want);
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 1);
        assert_attach_request(g_ptr_array_index(reqs, 0), pid, "web1", UUID_CANON,
                              cases[i].merge_domain);
    }
    /* reconnect and attach ask the same. */
    for (guint i = 0; i < 2; i++) {
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", i ? "attach" : "reconnect", "begin", "-", NULL);
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 1);
        assert_attach_request(g_ptr_array_index(reqs, 0), pid, "web1", UUID_CANON, NULL);
    }
    /* A merge domain not understood: better no merging than merging with
     * VMs it must not share with. */
    for (guint i = 0; i < 3; i++) {
        static const char *const bad[] = {
            "<metadata><pf:config xmlns:pf='urn:pagefold:domain:1'/></metadata>",
            "<metadata><pf:config xmlns:pf='urn:pagefold:domain:1' merge-domain=''/></metadata>",
            "<metadata><pf:config xmlns:pf='urn:pagefold:domain:1' merge-domain='a&#10;b'/>"
            "</metadata>",
        };
        g_autofree char *more = g_strconcat(bad[i], MEMFD_SHARED, NULL);
        g_autofree char *xml = domain_xml("web1", UUID_GIVEN, more);
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", "wants merge-domain=\"NAME\"");
        assert_said(f, &r, "web1", "not attaching it");
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 0);
    }
    /* Two configs: malformed. */
    {
        g_autofree char *xml = domain_xml(
            "web1", UUID_GIVEN,
            "<metadata xmlns:pf='urn:pagefold:domain:1'><pf:config merge-domain='a'/>"
            "<pf:config merge-domain='b'/></metadata>" MEMFD_SHARED);
        g_autoptr(GPtrArray) reqs = NULL;

        hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
        assert_said(f, &r, "web1", "more than one <config> of namespace urn:pagefold:domain:1");
        reqs = fake_take(fk);
        g_assert_cmpuint(reqs->len, ==, 0);
    }
}

static JsonObject *
parse_request(GPtrArray *reqs, guint i, const char *execute)
{
    g_autoptr(JsonParser) p = json_parser_new();
    JsonObject *o;

    g_assert_cmpuint(i, <, reqs->len);
    g_assert_true(json_parser_load_from_data(p, g_ptr_array_index(reqs, i), -1, NULL));
    o = json_node_get_object(json_parser_get_root(p));
    g_assert_cmpstr(json_object_get_string_member(o, "execute"), ==, execute);
    return json_object_ref(o);
}

/* What pagefoldd answers, refusals and silence included. */
static void
test_answers(Fixture *f, gconstpointer data)
{
    g_autoptr(Fake) fk = fake_start(f);
    int pid = getpid();
    g_autofree char *xml = domain_xml("web1", UUID_GIVEN, MEMFD_SHARED);
    g_autofree char *no_ram = g_strdup_printf(
        "{\"error\": {\"class\": \"GenericError\", \"desc\": \"process %d has no guest RAM "
        "pagefold can scan\"}}", pid);
    g_autofree char *exists = g_strdup_printf(
        "{\"error\": {\"class\": \"GenericError\", \"desc\": \"process %d is already attached "
        "as VM 'agent-named'\"}}", pid);
    g_autofree char *listed = g_strdup_printf(
        "{\"return\": [{\"name\": \"agent-named\", \"pid\": %d, \"uuid\": \"" UUID_CANON "\", "
        "\"mode\": \"merge\", \"pages\": 4096, \"regions\": []}]}", pid);
    g_autofree char *stats = g_strdup_printf(
        "{\"return\": {\"mode\": \"merge\", \"vms\": [{\"name\": \"agent-named\", \"pid\": %d, "
        "\"uuid\": \"" UUID_CANON "\", \"mode\": \"merge\", \"pages_shared\": 5, "
        "\"pages_sharing\": 7, \"zero_pages\": 3, \"cow\": 1}]}}", pid);
    g_autofree char *pidkey = g_strdup_printf("%d", pid);
    g_autofree char *want = NULL;
    g_autoptr(GPtrArray) reqs = NULL;
    g_autoptr(JsonObject) req = NULL;
    g_auto(Run) r = { 0 };

    write_pid(f, "web1", pid);
    /* Refused, not attached. */
    fake_reply(fk, "attach", no_ram);
    fake_reply(fk, "list", "{\"return\": []}");
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    want = g_strdup_printf("pagefoldd did not attach pid %d: process %d has no guest RAM "
                           "pagefold can scan", pid, pid);
    assert_said(f, &r, "web1", want);
    reqs = fake_take(fk);
    g_assert_cmpuint(reqs->len, ==, 2);
    req = parse_request(reqs, 1, "list");
    /* Refused because attached already (by its agent). */
    fake_reply(fk, "attach", exists);
    fake_reply(fk, "list", listed);
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_free(want);
    want = g_strdup_printf("pid %d is attached already, as VM 'agent-named' (uuid " UUID_CANON
                           ") in mode merge", pid);
    assert_said(f, &r, "web1", want);

    /* stopped: list, stats and detach by pid, the figures said. */
    fake_reply(fk, "stats", stats);
    fake_reply(fk, "detach", "{\"return\": {}}");
    g_ptr_array_unref(fake_take(fk));
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    g_free(want);
    want = g_strdup_printf("detached VM 'agent-named' (pid %d); final figures: pages_shared=5 "
                           "pages_sharing=7 zero_pages=3 cow=1 mode=merge", pid);
    assert_said(f, &r, "web1", want);
    g_clear_pointer(&reqs, g_ptr_array_unref);
    reqs = fake_take(fk);
    g_assert_cmpuint(reqs->len, ==, 3);
    g_clear_pointer(&req, json_object_unref);
    req = parse_request(reqs, 1, "stats");
    g_assert_cmpstr(json_object_get_string_member(json_object_get_object_member(req, "arguments"),
                                                  "vm"), ==, pidkey);
    g_clear_pointer(&req, json_object_unref);
    req = parse_request(reqs, 2, "detach");
    g_assert_cmpstr(json_object_get_string_member(json_object_get_object_member(req, "arguments"),
                                                  "vm"), ==, pidkey);
    /* Gone between stats and detach. */
    fake_reply(fk, "detach", "{\"error\": {\"class\": \"DeviceNotFound\", \"desc\": \"no VM of "
                             "pid\"}}");
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    g_free(want);
    want = g_strdup_printf("detach of pid %d: no VM of pid; last figures: pages_shared=5", pid);
    assert_said(f, &r, "web1", want);
    /* release: no pid file; by UUID. */
    remove_pid(f, "web1");
    fake_reply(fk, "detach", "{\"return\": {}}");
    hook(f, &r, xml, "web1", "release", "end", "-", NULL);
    g_free(want);
    want = g_strdup_printf("web1 release end: detached VM 'agent-named' (pid %d)", pid);
    assert_said(f, &r, "web1", want);
    write_pid(f, "web1", pid);

    /* prepare: it answers; or it is there and does not. */
    fake_reply(fk, "qmp_capabilities", "{\"return\": {}}");
    hook(f, &r, xml, "web1", "prepare", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 prepare begin: pagefoldd answers on");
    fake_reply(fk, "qmp_capabilities", "");
    hook(f, &r, xml, "web1", "start", "begin", "-", NULL);
    assert_said(f, &r, "web1", "web1 start begin: pagefoldd is there but did not answer "
                               "(pagefoldd did not answer within");
    assert_said(f, &r, "web1", "not starting another");
    /* A pagefoldd that never answers costs a bounded wait, and the VM
     * runs on. */
    fake_reply(fk, "attach", "");
    hook(f, &r, xml, "web1", "started", "begin", "-", NULL);
    g_free(want);
    want = g_strdup_printf("cannot attach pid %d: pagefoldd did not answer within", pid);
    assert_said(f, &r, "web1", want);
    assert_said(f, &r, "web1", "the VM runs unmerged");
    fake_reply(fk, "list", "");
    hook(f, &r, xml, "web1", "stopped", "end", "-", NULL);
    assert_said(f, &r, "web1", "web1 stopped end: cannot ask pagefoldd (pagefoldd did not answer "
                               "within");
}

int
main(int argc, char **argv)
{
    /* Started by the hook as its pagefoldd (/hook/prepare/detached): it
     * only writes down how. */
    if (g_getenv("HOOK_TEST_RECORD") != NULL) {
        return record_start(g_getenv("HOOK_TEST_RECORD"), argc, argv);
    }
    signal(SIGPIPE, SIG_IGN);
    g_test_init(&argc, &argv, NULL);
    g_test_add("/hook/prepare/starts-pagefoldd", Fixture, NULL, setup_bare,
               test_prepare_starts_pagefoldd, teardown);
    g_test_add("/hook/prepare/detached", Fixture, NULL, setup_bare, test_prepare_detached,
               teardown);
    g_test_add("/hook/start-pagefoldd", Fixture, NULL, setup_bare, test_start_only, teardown);
    g_test_add("/hook/requests/attach", Fixture, NULL, setup_bare, test_attach_requests,
               teardown);
    g_test_add("/hook/requests/answers", Fixture, NULL, setup_bare, test_answers, teardown);
    return g_test_run();
}
