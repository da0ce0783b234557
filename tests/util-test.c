/*
 * util-test.c - the behaviour of common/util.c's pieces beyond their
 * callers' tests: a source pf_fd_add() makes is dispatched without waking
 * its main context, where one g_unix_fd_add() makes wakes it twice a
 * dispatch (GLib takes a dispatched source's descriptors out of the poll
 * set and puts them back, signalling the context's wake-up eventfd at each
 * step: one more iteration of pagefoldd's loop for every message).
 */
#include <glib.h>
#include <glib-unix.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util.h"

/* What the process's eventfds hold, summed: the default main context's
 * wake-up is one of them, the only one that counts up unread here. */
static guint64
eventfd_counts(void)
{
    g_autoptr(GDir) dir = g_dir_open("/proc/self/fd", 0, NULL);
    const char *name;
    guint64 sum = 0;

    g_assert_nonnull(dir);
    while ((name = g_dir_read_name(dir)) != NULL) {
        g_autofree char *fd_path = g_strdup_printf("/proc/self/fd/%s", name);
        g_autofree char *target = g_file_read_link(fd_path, NULL);
        g_autofree char *info_path = g_strdup_printf("/proc/self/fdinfo/%s", name);
        g_autofree char *info = NULL;
        const char *count;

        if (target == NULL || strcmp(target, "anon_inode:[eventfd]") != 0 ||
            !g_file_get_contents(info_path, &info, NULL, NULL)) {
            continue;
        }
        count = strstr(info, "eventfd-count:");
        g_assert_nonnull(count);
        sum += g_ascii_strtoull(count + strlen("eventfd-count:"), NULL, 16);
    }
    return sum;
}

static gboolean
read_one(gint fd, GIOCondition cond, gpointer user)
{
    char c;

    g_assert_cmpint(read(fd, &c, 1), ==, 1);
    (*(guint *)user)++;
    return G_SOURCE_CONTINUE;
}

/* One byte written, one iteration: the callback ran; returns what the
 * dispatch left on the context's wake-up. */
static guint64
dispatch_once(gboolean stays_polled)
{
    int sv[2];
    guint calls = 0, id;
    guint64 left;

    g_assert_cmpint(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), ==,
                    0);
    id = stays_polled ? pf_fd_add(sv[0], G_IO_IN, read_one, &calls)
                      : g_unix_fd_add(sv[0], G_IO_IN, read_one, &calls);
    g_assert_cmpint(write(sv[1], "x", 1), ==, 1);
    while (calls == 0) {
        g_main_context_iteration(NULL, TRUE);
    }
    left = eventfd_counts();
    g_source_remove(id);
    /* Whatever the removal signalled is read. */
    while (g_main_context_iteration(NULL, FALSE)) {
    }
    close(sv[0]);
    close(sv[1]);
    return left;
}

static void
test_fd_add(void)
{
    /* The test sees the wake-ups where GLib makes them... */
    g_assert_cmpuint(dispatch_once(FALSE), >, 0);
    /* ...and pf_fd_add()'s sources make none. */
    g_assert_cmpuint(dispatch_once(TRUE), ==, 0);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/util/fd-add", test_fd_add);
    return g_test_run();
}
