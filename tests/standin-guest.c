/*
 * standin-guest.c - a STAND-IN for a QEMU process, until real guests come:
 * it maps guest RAM exactly as QEMU's memory-backend-memfd,share=on does
 * (a memfd named "memory-backend-memfd", sealed against shrinking, mapped
 * MAP_SHARED read-write), fills it like a guest, and keeps rewriting its
 * volatile pages.  It carries "-name guest=NAME" on its command line, as
 * QEMU does, so pagefoldd names it the same way.
 *
 *   standin-guest -name guest=NAME [-uuid UUID] [--mib N] [--identical PCT] [--zero PCT]
 *                 [--volatile PCT] [--seed N] [--churn-ms MS]
 *
 * Prints "ready PID" once filled, runs until SIGTERM/SIGINT or stdin EOF
 * when --stdin is given.
 */
#include <fcntl.h>
#include <glib-unix.h>
#include <glib.h>
#include <stdio.h>
#include <unistd.h>

#include "guestmem.h"
#include "util.h"

static gboolean
on_churn(gpointer user)
{
    pf_guest_churn(user);
    return G_SOURCE_CONTINUE;
}

static gboolean
on_quit(gpointer user)
{
    g_main_loop_quit(user);
    return G_SOURCE_REMOVE;
}

static gboolean
on_stdin(gint fd, GIOCondition cond, gpointer user)
{
    char buf[64];

    if (read(fd, buf, sizeof(buf)) <= 0) {
        g_main_loop_quit(user);
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

int
main(int argc, char **argv)
{
    g_autofree char *name = NULL;
    g_autofree char *uuid = NULL;
    gint mib = 64, identical = 50, zero = 20, vol = 1, seed = 1, churn_ms = 500;
    gboolean use_stdin = FALSE;
    GOptionEntry entries[] = {
        { "name", 0, 0, G_OPTION_ARG_STRING, &name, "guest=NAME, as QEMU", "guest=NAME" },
        { "mib", 0, 0, G_OPTION_ARG_INT, &mib, "RAM size in MiB (64)", "N" },
        { "identical", 0, 0, G_OPTION_ARG_INT, &identical,
          "percent of pages identical across guests (50)", "PCT" },
        { "zero", 0, 0, G_OPTION_ARG_INT, &zero, "percent of zero pages (20)", "PCT" },
        { "volatile", 0, 0, G_OPTION_ARG_INT, &vol, "percent rewritten each churn (1)", "PCT" },
        { "seed", 0, 0, G_OPTION_ARG_INT, &seed, "seed of the unique pages (1)", "N" },
        { "churn-ms", 0, 0, G_OPTION_ARG_INT, &churn_ms,
          "milliseconds between rewrites, 0: never (500)", "MS" },
        { "stdin", 0, 0, G_OPTION_ARG_NONE, &use_stdin, "exit when stdin closes", NULL },
        /* Only read from /proc/PID/cmdline, by pagefoldd, as QEMU's. */
        { "uuid", 0, 0, G_OPTION_ARG_STRING, &uuid, "the VM's UUID, as QEMU's -uuid", "UUID" },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx = g_option_context_new("- stand-in QEMU process");
    g_autoptr(GError) error = NULL;
    g_autoptr(GMainLoop) loop = g_main_loop_new(NULL, FALSE);
    g_autoptr(PfGuest) g = NULL;
    PfLayout l = { 0 };
    gsize pages;

    /* QEMU spells them -name and -uuid; GOption wants --name. */
    for (int i = 1; i < argc; i++) {
        if (g_str_equal(argv[i], "-name")) {
            argv[i] = (char *)"--name";
        } else if (g_str_equal(argv[i], "-uuid")) {
            argv[i] = (char *)"--uuid";
        }
    }
    g_option_context_add_main_entries(ctx, entries, NULL);
    if (!g_option_context_parse(ctx, &argc, &argv, &error)) {
        g_printerr("standin-guest: %s\n", error->message);
        return 2;
    }
    if (mib < 1 || identical < 0 || zero < 0 || vol < 0 || identical + zero + vol > 100 ||
        churn_ms < 0) {
        g_printerr("standin-guest: bad sizes\n");
        return 2;
    }
    pages = (gsize)mib * 256;
    l.identical = pages * (gsize)identical / 100;
    l.zero = pages * (gsize)zero / 100;
    l.volatile_ = pages * (gsize)vol / 100;
    l.unique = pages - l.identical - l.zero - l.volatile_;
    g = pf_guest_new("memory-backend-memfd", &l, (guint32)seed);
    /* QEMU's seals on its RAM memfd. */
    fcntl(g->fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
    if (churn_ms > 0 && l.volatile_ > 0) {
        g_timeout_add((guint)churn_ms, on_churn, g);
    }
    g_unix_signal_add(SIGTERM, on_quit, loop);
    g_unix_signal_add(SIGINT, on_quit, loop);
    if (use_stdin) {
        g_unix_fd_add(0, G_IO_IN | G_IO_HUP, on_stdin, loop);
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    g_main_loop_run(loop);
    return 0;
}
