/*
 * hook-common.c - see hook-common.h.
 */
#include "hook-common.h"

#include <errno.h>
#include <gio/gio.h>
#include <poll.h>
#include <stdarg.h>
#include <unistd.h>

#include "client.h"
#include "escape.h"
#include "util.h"

/* The longest wait for one control call, within HOOK_DEADLINE_MS. */
#define CALL_TIMEOUT_MS 1000

int
hook_ms_left(gint64 deadline)
{
    gint64 left = deadline - g_get_monotonic_time();

    return left <= 0 ? 0 : (int)((left + 999) / 1000);
}

void
hook_say(Hook *h, const char *fmt, ...)
{
    g_autofree char *msg = NULL;
    g_autofree char *shown = NULL;
    g_autoptr(GString) line = g_string_new(NULL);
    va_list ap;

    va_start(ap, fmt);
    msg = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    if (h->name != NULL) {
        g_string_append_printf(line, "%s %s %s: ", h->name, h->op, h->subop);
    }
    g_string_append(line, msg);
    /* The domain's name and XML, and VMs' names from pagefoldd (an agent's
     * words), may hold anything: one line, printable, goes out. */
    shown = pf_escape_text(line->str, (gssize)line->len);
    g_string_printf(line, "pagefold-hook: %s\n", shown);
    /* One write each: O_APPEND keeps a line whole among QEMU's. */
    (void)!write(STDERR_FILENO, line->str, line->len);
    if (h->log_fd >= 0) {
        (void)!write(h->log_fd, line->str, line->len);
    }
}

JsonNode *
hook_request_new(const char *command, JsonBuilder *args)
{
    g_autoptr(JsonBuilder) b = json_builder_new();

    json_builder_begin_object(b);
    json_builder_set_member_name(b, "execute");
    json_builder_add_string_value(b, command);
    if (args != NULL) {
        json_builder_set_member_name(b, "arguments");
        json_builder_add_value(b, json_builder_get_root(args));
    }
    json_builder_end_object(b);
    return json_builder_get_root(b);
}

JsonNode *
hook_control(Hook *h, JsonNode *request, GError **error)
{
    int timeout = MIN(hook_ms_left(h->deadline), CALL_TIMEOUT_MS);

    if (timeout <= 0) {
        g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT,
                    "no time left to ask pagefoldd (the hook's deadline is %d ms)",
                    HOOK_DEADLINE_MS);
        return NULL;
    }
    return pf_client_execute(h->socket_path, request, timeout, error);
}

gboolean
hook_ping(Hook *h, GError **error)
{
    g_autoptr(JsonNode) req = hook_request_new("qmp_capabilities", NULL);
    g_autoptr(JsonNode) ret = hook_control(h, req, error);

    return ret != NULL;
}

/* Domain XML beyond this is not read: libvirt's are a few KiB. */
#define MAX_XML_BYTES (16u << 20)

GString *
domain_xml_read(gint64 deadline, GError **error)
{
    g_autoptr(GString) xml = g_string_new(NULL);
    gboolean too_big = FALSE;
    char buf[65536];

    for (;;) {
        struct pollfd p = { .fd = STDIN_FILENO, .events = POLLIN };
        int r = poll(&p, 1, hook_ms_left(deadline));
        ssize_t n;

        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r == 0) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT,
                        "the domain XML did not end within %d ms", HOOK_DEADLINE_MS);
            return NULL;
        }
        n = r < 0 ? -1 : read(STDIN_FILENO, buf, sizeof(buf));
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
            continue;
        }
        if (n < 0) {
            g_set_error(error, G_IO_ERROR, g_io_error_from_errno(errno),
                        "cannot read the domain XML: %s", g_strerror(errno));
            return NULL;
        }
        if (n == 0) {
            break;
        }
        if (!too_big && xml->len + (gsize)n > MAX_XML_BYTES) {
            too_big = TRUE;
            g_string_truncate(xml, 0);
        }
        if (!too_big) {
            g_string_append_len(xml, buf, n);
        }
    }
    if (too_big) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "the domain XML is larger than %u MiB", MAX_XML_BYTES >> 20);
        return NULL;
    }
    return g_steal_pointer(&xml);
}
