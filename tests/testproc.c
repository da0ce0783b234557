/*
 * testproc.c - see testproc.h.
 */
#include "testproc.h"

#include <glib/gstdio.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

static void
die_with_parent(gpointer user)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
}

GSubprocess *
pf_test_spawnv(GSubprocessFlags flags, const char *const *argv, GError **error)
{
    g_autoptr(GSubprocessLauncher) l = g_subprocess_launcher_new(flags);

    g_subprocess_launcher_set_child_setup(l, die_with_parent, NULL, NULL);
    return g_subprocess_launcher_spawnv(l, argv, error);
}

const char *
pf_test_bin(const char *var)
{
    const char *p = g_getenv(var);

    if (p == NULL) {
        g_error("%s is not set (run through meson test)", var);
    }
    return p;
}

GPtrArray *
pf_test_argv_new(const char *prog, const char *sock, va_list ap)
{
    GPtrArray *argv = g_ptr_array_new();
    const char *a;

    g_ptr_array_add(argv, (char *)prog);
    if (sock != NULL) {
        g_ptr_array_add(argv, (char *)"--socket");
        g_ptr_array_add(argv, (char *)sock);
    }
    while ((a = va_arg(ap, const char *)) != NULL) {
        g_ptr_array_add(argv, (char *)a);
    }
    g_ptr_array_add(argv, NULL);
    return argv;
}

static void
daemon_spawn(PfTestDaemon *d, const char *first_arg, va_list ap)
{
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    const char *a;

    g_ptr_array_add(argv, (char *)pf_test_bin("PAGEFOLDD"));
    g_ptr_array_add(argv, (char *)"--socket");
    g_ptr_array_add(argv, d->sock);
    g_ptr_array_add(argv, (char *)"--agent-socket");
    g_ptr_array_add(argv, d->agent_sock);
    for (a = first_arg; a != NULL; a = va_arg(ap, const char *)) {
        g_ptr_array_add(argv, (char *)a);
    }
    g_ptr_array_add(argv, NULL);
    g_unlink(d->sock);
    d->proc = pf_test_spawnv(G_SUBPROCESS_FLAGS_NONE, (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    for (int i = 0; i < 200 && !(g_file_test(d->sock, G_FILE_TEST_EXISTS) &&
                                 g_file_test(d->agent_sock, G_FILE_TEST_EXISTS)); i++) {
        g_usleep(25000);
    }
    g_assert_true(g_file_test(d->sock, G_FILE_TEST_EXISTS));
}

PfTestDaemon *
pf_test_daemon_start(const char *first_arg, ...)
{
    PfTestDaemon *d = g_new0(PfTestDaemon, 1);
    g_autoptr(GError) error = NULL;
    va_list ap;

    d->dir = g_dir_make_tmp("pagefold-test-XXXXXX", &error);
    g_assert_no_error(error);
    d->sock = g_build_filename(d->dir, "pagefoldd.sock", NULL);
    d->agent_sock = g_build_filename(d->dir, "agent.sock", NULL);
    va_start(ap, first_arg);
    daemon_spawn(d, first_arg, ap);
    va_end(ap);
    return d;
}

void
pf_test_daemon_restart(PfTestDaemon *d, const char *first_arg, ...)
{
    va_list ap;

    g_clear_object(&d->proc);
    va_start(ap, first_arg);
    daemon_spawn(d, first_arg, ap);
    va_end(ap);
}

void
pf_test_daemon_free(PfTestDaemon *d)
{
    if (d->proc != NULL) {
        g_subprocess_force_exit(d->proc);
        g_subprocess_wait(d->proc, NULL, NULL);
        g_object_unref(d->proc);
    }
    g_unlink(d->sock);
    g_unlink(d->agent_sock);
    g_rmdir(d->dir);
    g_free(d->sock);
    g_free(d->agent_sock);
    g_free(d->dir);
    g_free(d);
}

JsonNode *
pf_test_ctl_json(PfTestDaemon *d, const char *first_arg, ...)
{
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    g_autoptr(GSubprocess) p = NULL;
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonParser) parser = json_parser_new();
    g_autofree char *out = NULL, *err = NULL;
    const char *a;
    va_list ap;

    g_ptr_array_add(argv, (char *)pf_test_bin("PAGEFOLDCTL"));
    g_ptr_array_add(argv, (char *)"--socket");
    g_ptr_array_add(argv, d->sock);
    g_ptr_array_add(argv, (char *)"--json");
    va_start(ap, first_arg);
    for (a = first_arg; a != NULL; a = va_arg(ap, const char *)) {
        g_ptr_array_add(argv, (char *)a);
    }
    va_end(ap);
    g_ptr_array_add(argv, NULL);
    p = pf_test_spawnv(G_SUBPROCESS_FLAGS_STDOUT_PIPE | G_SUBPROCESS_FLAGS_STDERR_PIPE,
                       (const char *const *)argv->pdata, &error);
    g_assert_no_error(error);
    g_subprocess_communicate_utf8(p, NULL, NULL, &out, &err, &error);
    g_assert_no_error(error);
    if (g_subprocess_get_exit_status(p) != 0) {
        g_error("pagefoldctl %s failed: %s", first_arg, err);
    }
    g_assert_true(json_parser_load_from_data(parser, out, -1, NULL));
    return json_node_copy(json_parser_get_root(parser));
}
