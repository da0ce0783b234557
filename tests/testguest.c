/*
 * testguest.c - tiny guests in QEMU for the qemu suite and the benchmarks:
 * the QEMU command line a PfGuestSpec asks for, pfguest's console lines
 * read on a thread of their own, QMP commands on connections of their
 * own.  A FAIL line from the guest, or its console ending, fails the test
 * rather than being waited past.
 */
#include "testguest.h"

#include <gio/gunixsocketaddress.h>
#include <glib/gstdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testproc.h"

static gpointer
read_console(gpointer data)
{
    Guest *g = data;
    g_autoptr(GDataInputStream) in =
        g_data_input_stream_new(g_subprocess_get_stdout_pipe(g->proc));
    char *line;

    while ((line = g_data_input_stream_read_line(in, NULL, NULL, NULL)) != NULL) {
        /* The firmware's escape sequences may precede a line. */
        const char *at = strstr(line, "PFGUEST");

        g_mutex_lock(&g->tail_lock);
        g_queue_push_tail(&g->tail, g_strdup(line));
        if (g_queue_get_length(&g->tail) > 40) {
            g_free(g_queue_pop_head(&g->tail));
        }
        g_mutex_unlock(&g->tail_lock);
        if (at != NULL) {
            g_async_queue_push(g->lines, g_strdup(at));
        } else if (strstr(line, "pagefold") != NULL) {
            g_async_queue_push(g->lines, g_strdup(line));
        }
        g_free(line);
    }
    g_async_queue_push(g->lines, g_strdup("EOF"));
    return NULL;
}

/* A QEMU that ended while a test still needed it: how, and its last words. */
static void G_GNUC_NORETURN
guest_gone(Guest *g, const char *command)
{
    g_autoptr(GString) said = g_string_new(NULL);

    g_subprocess_wait(g->proc, NULL, NULL);
    g_mutex_lock(&g->tail_lock);
    for (GList *l = g->tail.head; l != NULL; l = l->next) {
        g_string_append_printf(said, "\n  %s", (const char *)l->data);
    }
    g_mutex_unlock(&g->tail_lock);
    g_error("guest %s: QEMU ended (%s %d) while waiting for %s; its console ended with:%s", g->name,
            g_subprocess_get_if_signaled(g->proc) ? "signal" : "exit status",
            g_subprocess_get_if_signaled(g->proc) ? g_subprocess_get_term_sig(g->proc)
                                                  : g_subprocess_get_exit_status(g->proc),
            command, said->str);
}

gboolean
pf_guest_available(void)
{
    return g_getenv("QEMU_BINARY") && g_getenv("GUEST_KERNEL") && g_getenv("GUEST_INITRD");
}

Guest *
pf_test_guest_start(const PfGuestSpec *spec)
{
    Guest *g = g_new0(Guest, 1);
    g_autoptr(GError) error = NULL;
    g_autofree char *mem = g_strdup_printf("memory-backend-memfd,id=ram,size=%dM,share=%s",
                                           spec->ram_mib, spec->private_ram ? "off" : "on");
    g_autofree char *qmp = NULL;
    const char *accel = spec->accel != NULL ? spec->accel : "tcg";
    g_autofree char *machine = g_strdup_printf("pc,accel=%s", accel);
    g_autofree char *machine_ram = g_strdup_printf("pc,accel=%s,memory-backend=ram", accel);
    g_autofree char *agent = g_strdup_printf("x-pagefold-agent,id=pf0,socket=%s",
                                             spec->agent_sock);
    g_autofree char *append = g_strdup_printf(
        "console=ttyS0 no_timer_check quiet pfguest.mib=%d pfguest.seed=%d pfguest.seconds=%d "
        "pfguest.until_told=1 pfguest.check_s=%d pfguest.reboot=%d %s", spec->fill_mib,
        spec->seed, spec->seconds, spec->check_s, spec->reboot,
        spec->cmdline ? spec->cmdline : "");
    g_autofree char *guestname = g_strdup_printf("guest=%s", spec->name);
    g_autofree char *m = spec->maxmem_mib > 0
                             ? g_strdup_printf("%dM,slots=2,maxmem=%dM", spec->ram_mib,
                                               spec->maxmem_mib)
                             : g_strdup_printf("%dM", spec->ram_mib);
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    const char *args[] = {
        pf_test_bin("QEMU_BINARY"), "-m", m,
        "-kernel", pf_test_bin("GUEST_KERNEL"), "-initrd", pf_test_bin("GUEST_INITRD"),
        "-append", append, "-nographic", "-nic", "none",
        "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
    };

    for (gsize i = 0; i < G_N_ELEMENTS(args); i++) {
        g_ptr_array_add(argv, (char *)args[i]);
    }
    if (!spec->no_name) {
        g_ptr_array_add(argv, (char *)"-name");
        g_ptr_array_add(argv, guestname);
    }
    g->dir = g_dir_make_tmp("pagefold-guest-XXXXXX", &error);
    g_assert_no_error(error);
    g->qmp_path = g_build_filename(g->dir, "qmp.sock", NULL);
    qmp = g_strdup_printf("unix:%s,server=on,wait=off", g->qmp_path);
    g_ptr_array_add(argv, (char *)"-qmp");
    g_ptr_array_add(argv, qmp);
    for (gsize i = 0; spec->extra != NULL && spec->extra[i] != NULL; i++) {
        g_ptr_array_add(argv, (char *)spec->extra[i]);
    }
    if (spec->own_ram) {
        g_ptr_array_add(argv, (char *)"-machine");
        g_ptr_array_add(argv, machine);
        if (spec->agent_sock != NULL) {
            g_ptr_array_add(argv, (char *)"-object");
            g_ptr_array_add(argv, agent);
        }
    } else if (spec->agent_sock != NULL) {
        g_ptr_array_add(argv, (char *)"-machine");
        g_ptr_array_add(argv, machine_ram);
        g_ptr_array_add(argv, (char *)"-object");
        g_ptr_array_add(argv, mem);
        g_ptr_array_add(argv, (char *)"-object");
        g_ptr_array_add(argv, agent);
    } else {
        /* QEMU's default RAM: anonymous, MADV_MERGEABLE (mem-merge=on). */
        g_ptr_array_add(argv, (char *)"-machine");
        g_ptr_array_add(argv, machine);
    }
    if (!spec->reboot) {
        g_ptr_array_add(argv, (char *)"-no-reboot");
    }
    g_ptr_array_add(argv, NULL);
    g->name = g_strdup(spec->name);
    g->lines = g_async_queue_new_full(g_free);
    g_mutex_init(&g->tail_lock);
    g_queue_init(&g->tail);
    g->proc = pf_test_spawnv_apart(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_MERGE |
                             G_SUBPROCESS_FLAGS_STDIN_PIPE,
                             (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    g->pid = atoi(g_subprocess_get_identifier(g->proc));
    g->reader = g_thread_new("console", read_console, g);
    return g;
}

/* Waits for a console line with text at its start, or anywhere; fails on a
 * FAIL line (PFGUEST FAIL, or a check that failed) or EOF. */
static char *
expect_line(Guest *g, const char *text, gboolean anywhere, guint seconds)
{
    gint64 end = g_get_monotonic_time() + (gint64)seconds * G_USEC_PER_SEC;

    for (;;) {
        gint64 left = end - g_get_monotonic_time();
        char *line = left > 0 ? g_async_queue_timeout_pop(g->lines, (guint64)left) : NULL;

        if (line == NULL) {
            g_error("guest %s: no '%s' within %u s", g->name, text, seconds);
        }
        g_test_message("%s: %s", g->name, line);
        if (g_str_equal(line, "EOF")) {
            guest_gone(g, text);
        }
        if (strstr(line, "FAIL") != NULL) {
            g_error("guest %s: %s", g->name, line);
        }
        if (anywhere ? strstr(line, text) != NULL : g_str_has_prefix(line, text)) {
            return line;
        }
        g_free(line);
    }
}

char *
pf_test_guest_expect(Guest *g, const char *prefix, guint seconds)
{
    return expect_line(g, prefix, FALSE, seconds);
}

char *
pf_test_guest_expect_text(Guest *g, const char *text, guint seconds)
{
    return expect_line(g, text, TRUE, seconds);
}

void
pf_test_guest_tell_stop(Guest *g)
{
    static const char stop[] = "pfguest-stop\n";
    g_autoptr(GError) error = NULL;

    g_assert_true(g_output_stream_write_all(g_subprocess_get_stdin_pipe(g->proc), stop,
                                            strlen(stop), NULL, NULL, &error));
    g_assert_no_error(error);
}

char *
pf_test_guest_expect_pass(Guest *g, guint seconds)
{
    pf_test_guest_tell_stop(g);
    return expect_line(g, "PFGUEST PASS", FALSE, seconds);
}

void
pf_test_guest_check_now(Guest *g)
{
    char *line;

    while ((line = g_async_queue_try_pop(g->lines)) != NULL) {
        g_test_message("%s: %s", g->name, line);
        if (strstr(line, "FAIL") != NULL || g_str_equal(line, "EOF")) {
            g_error("guest %s: %s", g->name, line);
        }
        g_free(line);
    }
    /* The first may have begun before; the second began after. */
    g_free(expect_line(g, "PFGUEST CHECK ok", FALSE, 60));
    g_free(expect_line(g, "PFGUEST CHECK ok", FALSE, 60));
}

void
pf_test_guest_free(Guest *g)
{
    g_subprocess_force_exit(g->proc);
    g_subprocess_wait(g->proc, NULL, NULL);
    g_thread_join(g->reader);
    g_async_queue_unref(g->lines);
    g_queue_clear_full(&g->tail, g_free);
    g_mutex_clear(&g->tail_lock);
    g_object_unref(g->proc);
    unlink(g->qmp_path);
    g_rmdir(g->dir);
    g_free(g->qmp_path);
    g_free(g->dir);
    g_free(g->name);
    g_free(g);
}

/* The next reply on a QMP connection, events skipped: its "return", or
 * with error set, the text of its "error" (which fails the test else). */
static JsonNode *
qmp_reply(GDataInputStream *in, const char *command, char **error_text)
{
    for (;;) {
        g_autoptr(GError) error = NULL;
        g_autofree char *line = g_data_input_stream_read_line(in, NULL, NULL, &error);
        g_autoptr(JsonParser) p = json_parser_new();
        JsonObject *o;

        g_assert_no_error(error);
        if (line == NULL) {
            g_error("QMP %s: connection closed", command);
        }
        g_assert_true(json_parser_load_from_data(p, line, -1, &error));
        o = json_node_get_object(json_parser_get_root(p));
        if (json_object_has_member(o, "error") && error_text != NULL) {
            *error_text = g_strdup(json_object_get_string_member(
                json_object_get_object_member(o, "error"), "desc"));
            return NULL;
        }
        if (json_object_has_member(o, "error")) {
            g_error("QMP %s: %s", command, line);
        }
        if (json_object_has_member(o, "return") && error_text != NULL) {
            g_error("QMP %s did not fail: %s", command, line);
        }
        if (json_object_has_member(o, "return")) {
            return json_node_copy(json_object_get_member(o, "return"));
        }
    }
}

static JsonNode *
guest_qmp(Guest *g, const char *command, const char *arguments, char **error_text)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GSocketClient) client = g_socket_client_new();
    g_autoptr(GSocketAddress) addr = g_unix_socket_address_new(g->qmp_path);
    g_autoptr(GSocketConnection) conn = NULL;
    g_autoptr(GDataInputStream) in = NULL;
    g_autofree char *line = NULL, *greeting = NULL;
    GOutputStream *out;
    const char *caps = "{\"execute\": \"qmp_capabilities\"}\n";

    /* QEMU opens the socket early, but not at once: a QEMU still running
     * gets its boot's bound; one that is gone fails the test with what it
     * said last. */
    for (int i = 0; i < 1200 && conn == NULL; i++) {
        g_clear_error(&error);
        conn = g_socket_client_connect(client, G_SOCKET_CONNECTABLE(addr), NULL, &error);
        if (conn == NULL && g_subprocess_get_identifier(g->proc) == NULL) {
            guest_gone(g, "QMP");
        }
        if (conn == NULL) {
            g_usleep(100000);
        }
    }
    g_assert_no_error(error);
    in = g_data_input_stream_new(g_io_stream_get_input_stream(G_IO_STREAM(conn)));
    out = g_io_stream_get_output_stream(G_IO_STREAM(conn));
    greeting = g_data_input_stream_read_line(in, NULL, NULL, &error);
    g_assert_no_error(error);
    g_assert_nonnull(greeting);
    g_assert_true(g_output_stream_write_all(out, caps, strlen(caps), NULL, NULL, &error));
    json_node_unref(qmp_reply(in, "qmp_capabilities", NULL));
    line = g_strdup_printf("{\"execute\": \"%s\"%s%s}\n", command,
                           arguments ? ", \"arguments\": " : "", arguments ? arguments : "");
    g_assert_true(g_output_stream_write_all(out, line, strlen(line), NULL, NULL, &error));
    return qmp_reply(in, command, error_text);
}

JsonNode *
pf_test_guest_qmp(Guest *g, const char *command, const char *arguments)
{
    return guest_qmp(g, command, arguments, NULL);
}

char *
pf_test_guest_qmp_error(Guest *g, const char *command, const char *arguments)
{
    char *text = NULL;

    guest_qmp(g, command, arguments, &text);
    return text;
}


char *
pf_test_qemu_tool(const char *name)
{
    /* /usr/bin/qemu-system-x86_64-pagefold links to where its tools are. */
    g_autofree char *real = realpath(pf_test_bin("QEMU_BINARY"), NULL);
    g_autofree char *dir = g_path_get_dirname(real ? real : pf_test_bin("QEMU_BINARY"));

    return g_build_filename(dir, name, NULL);
}

PfVirtiofsd *
pf_virtiofsd_start(const char *binary)
{
    PfVirtiofsd *v = g_new0(PfVirtiofsd, 1);
    g_autoptr(GError) error = NULL;
    g_autofree char *source = NULL;
    g_autofree char *socket_path = NULL;

    v->dir = g_dir_make_tmp("pagefold-virtiofs-XXXXXX", NULL);
    g_assert_nonnull(v->dir);
    v->share = g_build_filename(v->dir, "share", NULL);
    v->sock = g_build_filename(v->dir, "vfs.sock", NULL);
    g_assert_cmpint(g_mkdir(v->share, 0755), ==, 0);
    source = g_strdup_printf("source=%s", v->share);
    socket_path = g_strdup_printf("--socket-path=%s", v->sock);
    {
        /* cache=auto: the guest's plain reads and writes go through its
         * page cache, its O_DIRECT ones to and from its own buffers; either
         * way virtiofsd reads and writes guest RAM.  chroot: no namespaces
         * needed where the tests run.  Spawned to die with the test: until
         * QEMU connects it waits for ever. */
        const char *argv[] = { binary, socket_path, "-o", source, "-o", "cache=auto",
                               "-o", "sandbox=chroot", NULL };

        /* Its share in memory: the guests' fsync()s wait for no disk,
         * whose latency would be most of a file's time and vary from run
         * to run. */
        v->proc = pf_test_spawnv_tmpfs(G_SUBPROCESS_FLAGS_NONE, v->share, argv, &error);
    }
    g_assert_no_error(error);
    v->files = g_strdup_printf("/proc/%s/root", g_subprocess_get_identifier(v->proc));
    for (int i = 0; i < 300 && !g_file_test(v->sock, G_FILE_TEST_EXISTS); i++) {
        g_usleep(100000);
    }
    if (!g_file_test(v->sock, G_FILE_TEST_EXISTS)) {
        g_error("%s made no socket in 30 s", binary);
    }
    return v;
}

void
pf_virtiofsd_free(PfVirtiofsd *v)
{
    g_autoptr(GDir) d = NULL;
    const char *name;

    g_subprocess_force_exit(v->proc);
    g_assert_true(g_subprocess_wait(v->proc, NULL, NULL));
    g_object_unref(v->proc);
    d = g_dir_open(v->share, 0, NULL);
    while (d != NULL && (name = g_dir_read_name(d)) != NULL) {
        g_autofree char *path = g_build_filename(v->share, name, NULL);

        g_unlink(path);
    }
    g_rmdir(v->share);
    g_unlink(v->sock);
    g_rmdir(v->dir);
    g_free(v->share);
    g_free(v->files);
    g_free(v->sock);
    g_free(v->dir);
    g_free(v);
}

JsonObject *
pf_test_guest_agent_info(Guest *g)
{
    JsonNode *n = pf_test_guest_qmp(g, "x-query-pagefold", NULL);
    JsonObject *o = json_object_ref(json_array_get_object_element(json_node_get_array(n), 0));

    json_node_unref(n);
    return o;
}

gint64
pf_test_guest_agent_stat(Guest *g, const char *member)
{
    g_autoptr(JsonObject) o = pf_test_guest_agent_info(g);

    return json_object_get_int_member(o, member);
}

gint64
pf_test_guest_agent_merged(Guest *g)
{
    g_autoptr(JsonObject) o = pf_test_guest_agent_info(g);

    return json_object_get_int_member(o, "merged") + json_object_get_int_member(o, "zeroed");
}
