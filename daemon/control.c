/*
 * control.c - the socket side of pagefoldd's control socket (control.h):
 * listening, accepting, and each client's framing, one request per line in
 * and one reply per line out, in the order asked, a client's next lines
 * held back while one of its commands waits for its job.
 *
 * Owns the listening socket and each client's descriptor, buffers,
 * watches and waiting command (freed with the client).  Must never parse
 * a request or know a command (control-commands.c does), never block on a
 * client (one that does not read its replies is closed), and never let a
 * client's input, however long or malformed, reach another client.
 */
#include "control.h"

#include <errno.h>
#include <glib-unix.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control-commands.h"
#include "pf-config.h"
#include "util.h"

#define MAX_CLIENTS 64
#define MAX_PENDING_OUTPUT (16u << 20)

struct _PfControl {
    PfScanner *scanner;
    char *path;
    int listen_fd;
    guint listen_watch;
    GPtrArray *clients;
};

typedef struct {
    PfControl *ctl;
    int fd;
    guint watch;
    guint out_watch;
    GByteArray *in;
    GByteArray *out;
    gboolean discarding; /* inside an over-long line: drop to its end */
    PfControlLater *later; /* the command it waits for: its next lines wait
                            * too, as QMP answers in order */
} Client;

static void client_process(Client *cl);
static gboolean client_flush(Client *cl);
static void client_send(Client *cl, const char *text);
static gboolean client_in_cb(gint fd, GIOCondition cond, gpointer user);

/* ---- commands that reply when their job is done ---- */

/* A command of the client's got its reply: sent, then the lines that
 * waited behind it. */
static void
client_later_done(PfControlLater *l, gpointer user)
{
    Client *cl = user;
    g_autofree char *reply = pf_control_later_steal_reply(l);

    client_send(cl, reply);
    cl->later = NULL;
    pf_control_later_free(l);
    if (cl->watch == 0) {
        cl->watch = g_unix_fd_add(cl->fd, G_IO_IN | G_IO_HUP | G_IO_ERR, client_in_cb, cl);
    }
    client_process(cl);
    client_flush(cl);
}

char *
pf_control_execute(PfControl *c, const char *line, gsize len)
{
    PfControlLater *l = NULL;
    char *reply = pf_control_command_execute(c->scanner, line, len, &l);

    if (reply != NULL) {
        return reply;
    }
    while ((reply = pf_control_later_steal_reply(l)) == NULL) {
        g_main_context_iteration(NULL, TRUE);
    }
    pf_control_later_free(l);
    return reply;
}

/* ---- the socket ---- */

static void
client_close(Client *cl)
{
    g_ptr_array_remove(cl->ctl->clients, cl);
}

static gboolean client_out_cb(gint fd, GIOCondition cond, gpointer user);

/* Returns FALSE when it had to close the client (cl is then freed). */
static gboolean
client_flush(Client *cl)
{
    while (cl->out->len > 0) {
        ssize_t n = send(cl->fd, cl->out->data, cl->out->len, MSG_NOSIGNAL);

        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN) {
                break;
            }
            client_close(cl);
            return FALSE;
        }
        g_byte_array_remove_range(cl->out, 0, (guint)n);
    }
    if (cl->out->len > MAX_PENDING_OUTPUT) {
        g_message("control: closing a client that does not read its replies");
        client_close(cl);
        return FALSE;
    }
    if (cl->out->len > 0 && cl->out_watch == 0) {
        cl->out_watch = g_unix_fd_add(cl->fd, G_IO_OUT, client_out_cb, cl);
    }
    return TRUE;
}

static gboolean
client_out_cb(gint fd, GIOCondition cond, gpointer user)
{
    Client *cl = user;

    cl->out_watch = 0;
    client_flush(cl);
    return G_SOURCE_REMOVE;
}

static void
client_send(Client *cl, const char *text)
{
    g_byte_array_append(cl->out, (const guint8 *)text, (guint)strlen(text));
    g_byte_array_append(cl->out, (const guint8 *)"\n", 1);
}

static void
client_process(Client *cl)
{
    guint8 *nl;

    while (cl->later == NULL && (nl = memchr(cl->in->data, '\n', cl->in->len)) != NULL) {
        gsize len = (gsize)(nl - cl->in->data);

        if (cl->discarding) {
            cl->discarding = FALSE;
        } else {
            gsize l = len;

            if (l > 0 && cl->in->data[l - 1] == '\r') {
                l--;
            }
            if (l > 0) {
                g_autofree char *reply = pf_control_command_execute(
                    cl->ctl->scanner, (const char *)cl->in->data, l, &cl->later);

                if (reply != NULL) {
                    client_send(cl, reply);
                } else {
                    pf_control_later_watch(cl->later, client_later_done, cl);
                }
            }
        }
        g_byte_array_remove_range(cl->in, 0, (guint)len + 1);
    }
    if (cl->later == NULL && cl->in->len > PF_CONTROL_MAX_LINE) {
        if (!cl->discarding) {
            g_autofree char *desc = g_strdup_printf(
                "request longer than %d bytes; discarded up to the next newline",
                PF_CONTROL_MAX_LINE);
            g_autofree char *reply = pf_control_reply_error("GenericError", desc, NULL);

            client_send(cl, reply);
            cl->discarding = TRUE;
        }
        g_byte_array_set_size(cl->in, 0);
    }
}

static gboolean
client_in_cb(gint fd, GIOCondition cond, gpointer user)
{
    Client *cl = user;
    guint8 buf[16384];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);

    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        return G_SOURCE_CONTINUE;
    }
    if (n <= 0) {
        cl->watch = 0;
        client_close(cl);
        return G_SOURCE_REMOVE;
    }
    g_byte_array_append(cl->in, buf, (guint)n);
    client_process(cl);
    if (!client_flush(cl)) {
        return G_SOURCE_REMOVE;
    }
    if (cl->later != NULL && cl->in->len > PF_CONTROL_MAX_LINE) {
        /* Enough waiting behind the job: read on when it is done. */
        cl->watch = 0;
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

static void
client_free(Client *cl)
{
    if (cl->later != NULL) {
        pf_control_later_free(cl->later);
    }
    if (cl->watch != 0) {
        g_source_remove(cl->watch);
    }
    if (cl->out_watch != 0) {
        g_source_remove(cl->out_watch);
    }
    close(cl->fd);
    g_byte_array_unref(cl->in);
    g_byte_array_unref(cl->out);
    g_free(cl);
}

static gboolean
listen_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfControl *c = user;
    int cfd = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    Client *cl;
    g_autofree char *greeting = NULL;

    if (cfd < 0) {
        return G_SOURCE_CONTINUE;
    }
    if (c->clients->len >= MAX_CLIENTS) {
        static const char busy[] =
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"too many clients\"}}\n";

        (void)!send(cfd, busy, sizeof(busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        close(cfd);
        return G_SOURCE_CONTINUE;
    }
    cl = g_new0(Client, 1);
    cl->ctl = c;
    cl->fd = cfd;
    cl->in = g_byte_array_new();
    cl->out = g_byte_array_new();
    g_ptr_array_add(c->clients, cl);
    greeting = g_strdup_printf(
        "{\"QMP\": {\"version\": {\"pagefold\": \"%s\"}, \"capabilities\": []}}", PF_VERSION);
    client_send(cl, greeting);
    cl->watch = g_unix_fd_add(cfd, G_IO_IN | G_IO_HUP | G_IO_ERR, client_in_cb, cl);
    client_flush(cl);
    return G_SOURCE_CONTINUE;
}

PfControl *
pf_control_new(PfScanner *scanner, const char *path, GError **error)
{
    g_autoptr(PfControl) c = g_new0(PfControl, 1);

    c->scanner = scanner;
    c->clients = g_ptr_array_new_with_free_func((GDestroyNotify)client_free);
    c->listen_fd = pf_unix_listen(path, SOCK_STREAM, error);
    if (c->listen_fd < 0) {
        return NULL;
    }
    c->path = g_strdup(path);
    c->listen_watch = g_unix_fd_add(c->listen_fd, G_IO_IN, listen_cb, c);
    return g_steal_pointer(&c);
}

void
pf_control_free(PfControl *c)
{
    if (c == NULL) {
        return;
    }
    if (c->listen_watch != 0) {
        g_source_remove(c->listen_watch);
    }
    g_clear_pointer(&c->clients, g_ptr_array_unref);
    if (c->listen_fd >= 0) {
        close(c->listen_fd);
    }
    if (c->path != NULL) {
        unlink(c->path);
    }
    g_free(c->path);
    g_free(c);
}
