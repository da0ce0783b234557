/*
 * client.c - the control socket's client end (client.h): one request and
 * its reply per call, owning the connection for that call only.
 * Non-blocking throughout, each wait a poll() bounded by the deadline: a
 * blocking connect() waits while the listen backlog is full, and a
 * blocking read() for a reply that never comes.
 */
#include "client.h"

#include <errno.h>
#include <gio/gio.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "util.h"

/* Pause between connect() attempts while the backlog is full. */
#define CONNECT_RETRY_MS 10

typedef struct {
    gint64 deadline; /* monotonic µs; G_MAXINT64: none */
    int timeout_ms;  /* as given, for messages */
} Deadline;

/* Milliseconds left for poll(): -1 without a deadline, 0 once past it. */
static int
ms_left(const Deadline *d)
{
    gint64 left;

    if (d->deadline == G_MAXINT64) {
        return -1;
    }
    left = d->deadline - g_get_monotonic_time();
    return left <= 0 ? 0 : (int)MIN((left + 999) / 1000, G_MAXINT);
}

static void
set_timed_out(const Deadline *d, const char *what, GError **error)
{
    g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT,
                "pagefoldd did not %s within %d ms", what, d->timeout_ms);
}

/* Waits until fd is ready for events; FALSE once the deadline passed. */
static gboolean
wait_fd(int fd, short events, const Deadline *d, const char *what, GError **error)
{
    for (;;) {
        struct pollfd p = { .fd = fd, .events = events };
        int r = poll(&p, 1, ms_left(d));

        if (r > 0) {
            return TRUE;
        }
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "poll: %s", g_strerror(errno));
            return FALSE;
        }
        set_timed_out(d, what, error);
        return FALSE;
    }
}

static int
connect_socket(const char *path, const Deadline *d, GError **error)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int fd;

    if (strlen(path) >= sizeof(addr.sun_path)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "socket path too long");
        return -1;
    }
    strcpy(addr.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                    "cannot connect to %s: %s (is pagefoldd running?)", path,
                    g_strerror(errno));
        return -1;
    }
    for (;;) {
        int e;

        if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
            return fd;
        }
        e = errno;
        if (e == EINTR) {
            continue;
        }
        /* A UNIX socket says EAGAIN, not EINPROGRESS, while the listener's
         * backlog is full: where a blocking connect() would wait, retry. */
        if (e == EAGAIN) {
            int left = ms_left(d);

            if (left == 0) {
                set_timed_out(d, "accept the connection", error);
                close(fd);
                return -1;
            }
            g_usleep(1000 * (left < 0 ? CONNECT_RETRY_MS : MIN(left, CONNECT_RETRY_MS)));
            continue;
        }
        g_set_error(error, PF_ERROR,
                    e == ENOENT || e == ECONNREFUSED ? PF_ERROR_NOT_FOUND : PF_ERROR_FAILED,
                    "cannot connect to %s: %s (%s)", path, g_strerror(e),
                    e == EACCES || e == EPERM
                        ? "pagefoldd's control socket is root's alone: run this as root"
                        : "is pagefoldd running? systemctl status pagefoldd");
        close(fd);
        return -1;
    }
}

static gboolean
send_all(int fd, const char *text, gsize len, const Deadline *d, GError **error)
{
    gsize off = 0;

    while (off < len) {
        ssize_t n = send(fd, text + off, len - off, MSG_NOSIGNAL);

        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN) {
                if (!wait_fd(fd, POLLOUT, d, "take the request", error)) {
                    return FALSE;
                }
                continue;
            }
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "send: %s", g_strerror(errno));
            return FALSE;
        }
        off += (gsize)n;
    }
    return TRUE;
}

static gboolean
read_line(int fd, GString *buf, char **line, const Deadline *d, GError **error)
{
    for (;;) {
        char *nl = memchr(buf->str, '\n', buf->len);
        char chunk[65536];
        ssize_t n;

        if (nl != NULL) {
            *line = g_strndup(buf->str, (gsize)(nl - buf->str));
            g_string_erase(buf, 0, nl - buf->str + 1);
            return TRUE;
        }
        n = read(fd, chunk, sizeof(chunk));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0 && errno == EAGAIN) {
            if (!wait_fd(fd, POLLIN, d, "answer", error)) {
                return FALSE;
            }
            continue;
        }
        if (n <= 0) {
            g_set_error(error, PF_ERROR, PF_ERROR_FAILED,
                        "pagefoldd closed the connection%s%s",
                        n < 0 ? ": " : "", n < 0 ? g_strerror(errno) : "");
            return FALSE;
        }
        g_string_append_len(buf, chunk, n);
    }
}

JsonNode *
pf_client_call(const char *socket_path, JsonNode *request, int timeout_ms, GError **error)
{
    Deadline d = {
        .deadline = timeout_ms < 0 ? G_MAXINT64
                                   : g_get_monotonic_time() + (gint64)timeout_ms * 1000,
        .timeout_ms = timeout_ms,
    };
    g_autoptr(GString) buf = g_string_new(NULL);
    g_autofree char *greeting = NULL;
    g_autofree char *reply = NULL;
    g_autofree char *json = json_to_string(request, FALSE);
    g_autofree char *text = g_strconcat(json, "\n", NULL);
    g_autoptr(JsonParser) parser = json_parser_new();
    gboolean ok;
    int fd = connect_socket(socket_path, &d, error);

    if (fd < 0) {
        return NULL;
    }
    /* The request goes out at once; the greeting is read after it. */
    ok = send_all(fd, text, strlen(text), &d, error) &&
         read_line(fd, buf, &greeting, &d, error) && read_line(fd, buf, &reply, &d, error);
    close(fd);
    if (!ok || !json_parser_load_from_data(parser, reply, -1, error)) {
        return NULL;
    }
    if (json_parser_get_root(parser) == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pagefoldd sent an empty reply");
        return NULL;
    }
    return json_node_copy(json_parser_get_root(parser));
}

G_DEFINE_QUARK(pagefold-client-error-quark, pf_client_error)

JsonNode *
pf_client_execute(const char *socket_path, JsonNode *request, int timeout_ms, GError **error)
{
    g_autoptr(JsonNode) reply = pf_client_call(socket_path, request, timeout_ms, error);
    JsonObject *o;

    if (reply == NULL) {
        return NULL;
    }
    o = JSON_NODE_HOLDS_OBJECT(reply) ? json_node_get_object(reply) : NULL;
    if (o != NULL && json_object_has_member(o, "error")) {
        JsonNode *e = json_object_get_member(o, "error");
        const char *desc = JSON_NODE_HOLDS_OBJECT(e)
            ? json_object_get_string_member_with_default(json_node_get_object(e), "desc", NULL)
            : NULL;

        g_set_error(error, PF_CLIENT_ERROR, PF_CLIENT_ERROR_REFUSED, "%s",
                    desc ? desc : "(no description)");
        return NULL;
    }
    if (o == NULL || !json_object_has_member(o, "return")) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pagefoldd sent a reply without 'return'");
        return NULL;
    }
    return json_node_copy(json_object_get_member(o, "return"));
}
