/*
 * hook.c - pagefold-libvirt-hook, the libvirt qemu hook: libvirtd runs it
 * (as /etc/libvirt/hooks/qemu.d/pagefold) as
 *
 *   pagefold-libvirt-hook [OPTIONS] NAME OP SUBOP EXTRA   < domain XML
 *
 * and it makes sure pagefoldd runs before a VM with shared memfd RAM
 * starts (prepare, start), attaches the VM by QEMU's pid once it runs
 * (started, reconnect, attach) and detaches it when it stops (stopped,
 * release), saying what it did on stderr and in libvirt's log of the
 * domain.
 *
 * Owns nothing that outlives it but a pagefoldd it started.  Must never
 * exit other than 0 (a failing hook refuses a VM's start, and one at
 * reconnect kills the VM), never wait long (libvirtd waits for it: every
 * wait is bounded by one deadline), never call into libvirt (libvirtd
 * waits for it: deadlock), never write to stdout (for migrate and restore
 * libvirt takes it as the domain XML, empty meaning unchanged), and never
 * leave a process holding its stdout or stderr (libvirtd reads them to
 * EOF).
 */
#include <errno.h>
#include <fcntl.h>
#include <gio/gio.h>
#include <glib-unix.h>
#include <glib.h>
#include <grp.h>
#include <json-glib/json-glib.h>
#include <linux/close_range.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client.h"
#include "hook-config.h"
#include "util.h"
#include "vm.h"

/* All the hook may take, from start to exit: libvirtd waits for it. */
#define HOOK_DEADLINE_MS 1500
/* The longest wait for one control call, within that. */
#define CALL_TIMEOUT_MS 1000
/* How long a pagefoldd it started may take to answer, within that. */
#define READY_WAIT_MS 1000
#define READY_POLL_MS 50
/* Domain XML beyond this is not read: libvirt's are a few KiB. */
#define MAX_XML_BYTES (16u << 20)
/* A merge domain is a label, as a VM's name is. */
#define MAX_MERGE_DOMAIN_LEN 128

#define PAGEFOLD_NS "urn:pagefold:domain:1"
#define DEFAULT_RUN_DIR "/run/libvirt/qemu"
#define DEFAULT_LOG_DIR "/var/log/libvirt/qemu"
#define DEFAULT_PAGEFOLDD_LOG "/var/log/pagefold/pagefoldd.log"
#define DEFAULT_AGENT_GROUP "libvirt-qemu"
#define SYSTEMD_UNIT "pagefoldd.service"

static const char usage_text[] =
    "usage: pagefold-libvirt-hook [OPTION...] NAME OP SUBOP EXTRA  < domain XML\n"
    "libvirt's qemu hook for pagefold; options come before libvirt's four arguments:\n"
    "  --socket PATH          pagefoldd's control socket (" PF_DEFAULT_SOCKET ")\n"
    "  --pagefoldd PATH       pagefoldd to start, rather than systemd's " SYSTEMD_UNIT "\n"
    "                         (" PF_INSTALLED_PAGEFOLDD ")\n"
    "  --pagefoldd-arg ARG    one more argument for a pagefoldd it starts (repeatable)\n"
    "  --pagefoldd-log FILE   where a pagefoldd it starts writes (" DEFAULT_PAGEFOLDD_LOG ")\n"
    "  --agent-group GROUP    the agent socket's group, if it exists (" DEFAULT_AGENT_GROUP
    "; '' none)\n"
    "  --run-dir DIR          where libvirt keeps NAME.pid (" DEFAULT_RUN_DIR ")\n"
    "  --log-dir DIR          libvirt's per-domain logs (" DEFAULT_LOG_DIR ")\n";

typedef struct {
    /* Options. */
    const char *socket_path;
    const char *pagefoldd;
    gboolean pagefoldd_given;
    GPtrArray *pagefoldd_args;
    const char *pagefoldd_log;
    const char *agent_group;
    const char *run_dir;
    const char *log_dir;
    /* libvirt's arguments. */
    const char *name;
    const char *op;
    const char *subop;
    int log_fd;     /* libvirt's log of the domain, or -1 */
    gint64 deadline; /* monotonic µs */
} Hook;

/* What the hook needs of the domain XML. */
typedef struct {
    char *name;
    char *uuid; /* canonical: lowercase, dashed */
    gboolean memfd;          /* <memoryBacking><source type='memfd'/> */
    gboolean access_shared;  /* <memoryBacking><access mode='shared'/> */
    gboolean numa_shared;    /* a <cpu><numa><cell memAccess='shared'/> */
    gboolean nosharepages;   /* <memoryBacking><nosharepages/> */
    char *merge_domain;      /* <metadata><pf:config merge-domain=.../>, or NULL */
    gboolean has_config;
} Domain;

static void
domain_clear(Domain *d)
{
    g_free(d->name);
    g_free(d->uuid);
    g_free(d->merge_domain);
}

G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Domain, domain_clear)

/* pagefoldd's own refusals ({"error": ...} replies), apart from failing
 * to reach it. */
#define HOOK_DAEMON_ERROR (hook_daemon_error_quark())
static GQuark hook_daemon_error_quark(void);
G_DEFINE_QUARK(pagefold-hook-daemon-error, hook_daemon_error)

/* ---- saying what it does ---- */

static int
ms_left(const Hook *h)
{
    gint64 left = h->deadline - g_get_monotonic_time();

    return left <= 0 ? 0 : (int)((left + 999) / 1000);
}

/*
 * One line, "pagefold-hook: NAME OP SUBOP: what", on stderr and appended
 * to libvirt's log of the domain.  Control characters (from XML or
 * pagefoldd's answers) become '?': a line is a line.
 */
static void G_GNUC_PRINTF(2, 3)
say(Hook *h, const char *fmt, ...)
{
    g_autofree char *msg = NULL;
    g_autoptr(GString) line = g_string_new("pagefold-hook: ");
    va_list ap;

    va_start(ap, fmt);
    msg = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    if (h->name != NULL) {
        g_string_append_printf(line, "%s %s %s: ", h->name, h->op, h->subop);
    }
    g_string_append(line, msg);
    for (gsize i = 0; i < line->len; i++) {
        if (g_ascii_iscntrl(line->str[i])) {
            line->str[i] = '?';
        }
    }
    g_string_append_c(line, '\n');
    /* One write each: O_APPEND keeps a line whole among QEMU's. */
    (void)!write(STDERR_FILENO, line->str, line->len);
    if (h->log_fd >= 0) {
        (void)!write(h->log_fd, line->str, line->len);
    }
}

/* The domain's name as a file name: libvirt refuses '/' in names, but the
 * hook makes paths of it as root, so it checks again. */
static gboolean
name_is_file_name(const char *name)
{
    if (*name == '\0' || strchr(name, '/') != NULL || g_str_equal(name, ".") ||
        g_str_equal(name, "..")) {
        return FALSE;
    }
    for (const char *p = name; *p; p++) {
        if (g_ascii_iscntrl(*p)) {
            return FALSE;
        }
    }
    return TRUE;
}

static void
open_domain_log(Hook *h)
{
    g_autofree char *base = g_strconcat(h->name, ".log", NULL);
    g_autofree char *path = g_build_filename(h->log_dir, base, NULL);

    /* Not there before the first start: made as libvirt makes it.  A
     * link is not followed: the hook runs as root. */
    h->log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY,
                     0600);
}

/* ---- arguments ---- */

static gboolean
parse_args(Hook *h, int argc, char **argv, GError **error)
{
    static const char *const known[] = {
        "socket", "pagefoldd", "pagefoldd-arg", "pagefoldd-log", "agent-group", "run-dir",
        "log-dir", NULL
    };
    int n_opts = argc - 1 - 4;

    /* libvirt's four come last, whatever they look like (a domain may be
     * called "--socket"): what is before them must be options. */
    if (n_opts < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%d argument(s) where libvirt passes 4: NAME OP SUBOP EXTRA", argc - 1);
        return FALSE;
    }
    for (int i = 1; i <= n_opts; i++) {
        const char *a = argv[i], *eq, *value;
        g_autofree char *opt = NULL;

        if (!g_str_has_prefix(a, "--")) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "unexpected argument '%s': libvirt passes 4, NAME OP SUBOP EXTRA, "
                        "after the options", a);
            return FALSE;
        }
        eq = strchr(a, '=');
        opt = eq ? g_strndup(a + 2, (gsize)(eq - a - 2)) : g_strdup(a + 2);
        if (!g_strv_contains(known, opt)) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "unknown option '%s'", a);
            return FALSE;
        }
        if (eq != NULL) {
            value = eq + 1;
        } else if (i < n_opts) {
            value = argv[++i];
        } else {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "option '%s' wants a value", a);
            return FALSE;
        }
        if (g_str_equal(opt, "socket")) {
            h->socket_path = value;
        } else if (g_str_equal(opt, "pagefoldd")) {
            h->pagefoldd = value;
            h->pagefoldd_given = TRUE;
        } else if (g_str_equal(opt, "pagefoldd-arg")) {
            g_ptr_array_add(h->pagefoldd_args, (char *)value);
        } else if (g_str_equal(opt, "pagefoldd-log")) {
            h->pagefoldd_log = value;
        } else if (g_str_equal(opt, "agent-group")) {
            h->agent_group = value;
        } else if (g_str_equal(opt, "run-dir")) {
            h->run_dir = value;
        } else {
            h->log_dir = value;
        }
    }
    h->name = argv[argc - 4];
    h->op = argv[argc - 3];
    h->subop = argv[argc - 2];
    return TRUE;
}

/* ---- the domain XML ---- */

/* All of stdin, within the deadline; NULL (and the rest drained) if it is
 * too big.  libvirt writes the XML and closes the pipe. */
static GString *
read_stdin(Hook *h, GError **error)
{
    g_autoptr(GString) xml = g_string_new(NULL);
    gboolean too_big = FALSE;
    char buf[65536];

    for (;;) {
        struct pollfd p = { .fd = STDIN_FILENO, .events = POLLIN };
        int r = poll(&p, 1, ms_left(h));
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

typedef struct {
    char *prefix; /* NULL: the default namespace */
    char *uri;    /* NULL or "": none */
} NsDecl;

typedef struct {
    char *local;
    const char *ns;   /* resolved; NULL: none (points into a NsDecl) */
    GArray *decls;    /* NsDecl made on this element, or NULL */
    GString *text;    /* collected for <name> and <uuid> */
} Frame;

typedef struct {
    GPtrArray *stack; /* Frame */
    guint n_roots;
    guint n_name, n_uuid, n_source, n_access;
    Domain *dom;
} Parse;

static void
ns_decl_clear(NsDecl *d)
{
    g_free(d->prefix);
    g_free(d->uri);
}

static void
frame_free(Frame *f)
{
    g_free(f->local);
    if (f->decls != NULL) {
        g_array_unref(f->decls);
    }
    if (f->text != NULL) {
        g_string_free(f->text, TRUE);
    }
    g_free(f);
}

/* What prefix (NULL: the default) stands for, innermost declaration
 * first; FALSE if it was never declared. */
static gboolean
resolve(Parse *p, Frame *self, const char *prefix, const char **uri)
{
    if (g_strcmp0(prefix, "xml") == 0) {
        *uri = "http://www.w3.org/XML/1998/namespace";
        return TRUE;
    }
    for (guint k = p->stack->len + 1; k-- > 0;) {
        Frame *f = k == p->stack->len ? self : g_ptr_array_index(p->stack, k);

        for (guint i = 0; f->decls != NULL && i < f->decls->len; i++) {
            NsDecl *d = &g_array_index(f->decls, NsDecl, i);

            if (g_strcmp0(d->prefix, prefix) == 0) {
                *uri = d->uri != NULL && *d->uri != '\0' ? d->uri : NULL;
                return TRUE;
            }
        }
    }
    *uri = NULL;
    return prefix == NULL;
}

static gboolean
split_qname(const char *qname, char **prefix, const char **local, GError **error)
{
    const char *colon = strchr(qname, ':');

    if (colon == NULL) {
        *prefix = NULL;
        *local = qname;
        return TRUE;
    }
    if (colon == qname || colon[1] == '\0' || strchr(colon + 1, ':') != NULL) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "'%s' is not a valid qualified name", qname);
        return FALSE;
    }
    *prefix = g_strndup(qname, (gsize)(colon - qname));
    *local = colon + 1;
    return TRUE;
}

/* The frame of the element depth levels up from the one being opened (0:
 * its parent), or NULL. */
static Frame *
ancestor(Parse *p, guint up)
{
    return up < p->stack->len ? g_ptr_array_index(p->stack, p->stack->len - 1 - up) : NULL;
}

/* A libvirt element (no namespace) of this name. */
static gboolean
is_plain(Frame *f, const char *local)
{
    return f != NULL && f->ns == NULL && g_str_equal(f->local, local);
}

static gboolean
set_once(guint *count, const char *what, GError **error)
{
    if (++*count > 1) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "more than one %s", what);
        return FALSE;
    }
    return TRUE;
}

static const char *
attr(const char **names, const char **values, const char *want)
{
    for (guint i = 0; names[i] != NULL; i++) {
        if (g_str_equal(names[i], want)) {
            return values[i];
        }
    }
    return NULL;
}

static void
on_start(GMarkupParseContext *ctx, const char *element, const char **names,
         const char **values, gpointer user, GError **error)
{
    Parse *p = user;
    Frame *f = g_new0(Frame, 1);
    g_autofree char *prefix = NULL;
    const char *local;
    guint depth = p->stack->len;
    Frame *parent = ancestor(p, 0), *grandparent = ancestor(p, 1);

    /* Namespace declarations first: they hold for the element itself. */
    for (guint i = 0; names[i] != NULL; i++) {
        NsDecl d = { NULL, NULL };

        for (guint j = 0; j < i; j++) {
            if (g_str_equal(names[i], names[j])) {
                g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                            "attribute '%s' twice on <%s>", names[i], element);
                frame_free(f);
                return;
            }
        }
        if (g_str_equal(names[i], "xmlns")) {
            d.uri = g_strdup(values[i]);
        } else if (g_str_has_prefix(names[i], "xmlns:")) {
            if (names[i][6] == '\0' || *values[i] == '\0') {
                g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                            "bad namespace declaration '%s' on <%s>", names[i], element);
                frame_free(f);
                return;
            }
            d.prefix = g_strdup(names[i] + 6);
            d.uri = g_strdup(values[i]);
        } else {
            continue;
        }
        if (f->decls == NULL) {
            f->decls = g_array_new(FALSE, FALSE, sizeof(NsDecl));
            g_array_set_clear_func(f->decls, (GDestroyNotify)ns_decl_clear);
        }
        g_array_append_val(f->decls, d);
    }
    if (!split_qname(element, &prefix, &local, error)) {
        frame_free(f);
        return;
    }
    f->local = g_strdup(local);
    if (!resolve(p, f, prefix, &f->ns)) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "namespace prefix '%s' of <%s> is not declared", prefix, element);
        frame_free(f);
        return;
    }
    /* Prefixed attributes must be declared too; their values are not
     * looked at. */
    for (guint i = 0; names[i] != NULL; i++) {
        g_autofree char *ap = NULL;
        const char *al, *uri;

        if (g_str_equal(names[i], "xmlns") || g_str_has_prefix(names[i], "xmlns:")) {
            continue;
        }
        if (!split_qname(names[i], &ap, &al, error)) {
            frame_free(f);
            return;
        }
        if (ap != NULL && !resolve(p, f, ap, &uri)) {
            g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                        "namespace prefix '%s' of attribute '%s' is not declared", ap,
                        names[i]);
            frame_free(f);
            return;
        }
    }
    g_ptr_array_add(p->stack, f);

    if (depth == 0) {
        if (++p->n_roots > 1) {
            g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                        "more than one root element");
            return;
        }
        if (!is_plain(f, "domain")) {
            g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                        "the root element is <%s>%s%s, not libvirt's <domain>", element,
                        f->ns ? " of namespace " : "", f->ns ? f->ns : "");
        }
        return;
    }
    if (depth == 1) {
        if (is_plain(f, "name")) {
            if (set_once(&p->n_name, "<name>", error)) {
                f->text = g_string_new(NULL);
            }
        } else if (is_plain(f, "uuid")) {
            if (set_once(&p->n_uuid, "<uuid>", error)) {
                f->text = g_string_new(NULL);
            }
        }
        return;
    }
    if (depth == 2 && is_plain(parent, "memoryBacking")) {
        if (is_plain(f, "source") && set_once(&p->n_source, "<memoryBacking><source>", error)) {
            p->dom->memfd = g_strcmp0(attr(names, values, "type"), "memfd") == 0;
        } else if (is_plain(f, "access") &&
                   set_once(&p->n_access, "<memoryBacking><access>", error)) {
            p->dom->access_shared = g_strcmp0(attr(names, values, "mode"), "shared") == 0;
        } else if (is_plain(f, "nosharepages")) {
            p->dom->nosharepages = TRUE;
        }
        return;
    }
    if (depth == 2 && is_plain(parent, "metadata") && g_strcmp0(f->ns, PAGEFOLD_NS) == 0 &&
        g_str_equal(f->local, "config")) {
        const char *md = attr(names, values, "merge-domain");

        /* libvirt keeps one element per namespace in <metadata>. */
        if (p->dom->has_config) {
            g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                        "more than one <config> of namespace " PAGEFOLD_NS);
            return;
        }
        p->dom->has_config = TRUE;
        p->dom->merge_domain = g_strdup(md);
        return;
    }
    if (depth == 3 && is_plain(f, "cell") && is_plain(parent, "numa") &&
        is_plain(grandparent, "cpu")) {
        if (g_strcmp0(attr(names, values, "memAccess"), "shared") == 0) {
            p->dom->numa_shared = TRUE;
        }
        return;
    }
}

static void
on_end(GMarkupParseContext *ctx, const char *element, gpointer user, GError **error)
{
    Parse *p = user;
    Frame *f = g_ptr_array_steal_index(p->stack, p->stack->len - 1);

    if (f->text != NULL && p->stack->len == 1) {
        if (g_str_equal(f->local, "name")) {
            p->dom->name = g_strdup(f->text->str);
        } else {
            p->dom->uuid = g_strdup(f->text->str);
        }
    }
    frame_free(f);
}

static void
on_text(GMarkupParseContext *ctx, const char *text, gsize len, gpointer user, GError **error)
{
    Parse *p = user;
    Frame *f = p->stack->len > 0 ? g_ptr_array_index(p->stack, p->stack->len - 1) : NULL;

    if (f != NULL && f->text != NULL) {
        g_string_append_len(f->text, text, (gssize)len);
    }
}

/*
 * The domain XML, strictly: well-formed, namespaces declared, root
 * libvirt's <domain>, one <name> that is argv's NAME and one valid
 * <uuid>.  GMarkup expands no external entities and reads no DTD.
 */
static gboolean
parse_domain(const char *name, const GString *xml, Domain *dom, GError **error)
{
    static const GMarkupParser parser = { on_start, on_end, on_text, NULL, NULL };
    Parse p = { .stack = g_ptr_array_new_with_free_func((GDestroyNotify)frame_free), .dom = dom };
    g_autoptr(GPtrArray) stack = p.stack;
    g_autoptr(GMarkupParseContext) ctx =
        g_markup_parse_context_new(&parser, G_MARKUP_PREFIX_ERROR_POSITION, &p, NULL);
    g_autoptr(GError) local = NULL;
    guint8 uuid[16];

    if (!g_markup_parse_context_parse(ctx, xml->str, (gssize)xml->len, &local) ||
        !g_markup_parse_context_end_parse(ctx, &local)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "malformed domain XML: %s",
                    local->message);
        return FALSE;
    }
    if (p.n_roots == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "empty domain XML");
        return FALSE;
    }
    if (dom->name == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "the domain XML has no <name>");
        return FALSE;
    }
    if (!g_str_equal(dom->name, name)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "the domain XML is of '%s', not of '%s'", dom->name, name);
        return FALSE;
    }
    if (dom->uuid == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "the domain XML has no <uuid>");
        return FALSE;
    }
    g_strstrip(dom->uuid);
    if (!pf_uuid_parse(dom->uuid, uuid)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "the domain XML's <uuid> '%s' is not a UUID", dom->uuid);
        return FALSE;
    }
    g_free(dom->uuid);
    dom->uuid = g_strdup_printf("%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
                                "%02x%02x%02x%02x%02x%02x",
                                uuid[0], uuid[1], uuid[2], uuid[3], uuid[4], uuid[5], uuid[6],
                                uuid[7], uuid[8], uuid[9], uuid[10], uuid[11], uuid[12],
                                uuid[13], uuid[14], uuid[15]);
    return TRUE;
}

/* RAM pagefold can merge: memfd, shared (all of it, or some NUMA cells;
 * pagefoldd takes what it finds shared). */
static gboolean
domain_is_ours(const Domain *d)
{
    return d->memfd && (d->access_shared || d->numa_shared);
}

static gboolean
merge_domain_is_valid(const char *md)
{
    if (*md == '\0' || strlen(md) > MAX_MERGE_DOMAIN_LEN) {
        return FALSE;
    }
    for (const char *p = md; *p; p++) {
        if (g_ascii_iscntrl(*p)) {
            return FALSE;
        }
    }
    return TRUE;
}

/* ---- pagefoldd ---- */

static JsonNode *
request_new(const char *command, JsonBuilder *args)
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

/*
 * One control call within what is left of the deadline; returns a copy of
 * the reply's "return".  Errors: pagefoldd's own refusal is
 * HOOK_DAEMON_ERROR with its desc; not reaching it is pf_client_call()'s.
 */
static JsonNode *
control(Hook *h, JsonNode *request, GError **error)
{
    int timeout = MIN(ms_left(h), CALL_TIMEOUT_MS);
    g_autoptr(JsonNode) reply = NULL;
    JsonObject *o;

    if (timeout <= 0) {
        g_set_error(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT,
                    "no time left to ask pagefoldd (the hook's deadline is %d ms)",
                    HOOK_DEADLINE_MS);
        return NULL;
    }
    reply = pf_client_call(h->socket_path, request, timeout, error);
    if (reply == NULL) {
        return NULL;
    }
    o = JSON_NODE_HOLDS_OBJECT(reply) ? json_node_get_object(reply) : NULL;
    if (o != NULL && json_object_has_member(o, "error")) {
        JsonNode *e = json_object_get_member(o, "error");
        const char *desc = JSON_NODE_HOLDS_OBJECT(e)
            ? json_object_get_string_member_with_default(json_node_get_object(e), "desc", NULL)
            : NULL;

        g_set_error(error, HOOK_DAEMON_ERROR, 0, "%s", desc ? desc : "(no description)");
        return NULL;
    }
    if (o == NULL || !json_object_has_member(o, "return")) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "pagefoldd sent a reply without 'return'");
        return NULL;
    }
    return json_node_copy(json_object_get_member(o, "return"));
}

static gboolean
ping(Hook *h, GError **error)
{
    g_autoptr(JsonNode) req = request_new("qmp_capabilities", NULL);
    g_autoptr(JsonNode) ret = control(h, req, error);

    return ret != NULL;
}

/* ---- starting pagefoldd ---- */

/* Runs a short program (systemctl), its output into the log, within the
 * deadline; killed if it takes longer. */
static void
run_bounded(Hook *h, const char *const *argv)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GString) out = g_string_new(NULL);
    g_autofree char *cmd = g_strjoinv(" ", (char **)argv);
    int fds[2];
    GPid pid;
    int status = 0;
    gboolean done = FALSE;

    if (!g_unix_open_pipe(fds, FD_CLOEXEC, &error)) {
        say(h, "cannot run %s: %s", cmd, error->message);
        return;
    }
    if (!g_spawn_async_with_pipes_and_fds(NULL, argv, NULL,
                                         G_SPAWN_DO_NOT_REAP_CHILD | G_SPAWN_SEARCH_PATH |
                                             G_SPAWN_STDIN_FROM_DEV_NULL,
                                         NULL, NULL, -1, fds[1], fds[1], NULL, NULL, 0, &pid,
                                         NULL, NULL, NULL, &error)) {
        close(fds[0]);
        close(fds[1]);
        say(h, "cannot run %s: %s", cmd, error->message);
        return;
    }
    close(fds[1]);
    for (;;) {
        struct pollfd p = { .fd = fds[0], .events = POLLIN };
        char buf[4096];
        int r = poll(&p, 1, ms_left(h));
        ssize_t n;

        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break;
        }
        n = read(fds[0], buf, sizeof(buf));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            done = TRUE;
            break;
        }
        if (out->len < 4096) {
            g_string_append_len(out, buf, n);
        }
    }
    close(fds[0]);
    while (done && waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!done) {
        kill(pid, SIGKILL);
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        say(h, "%s did not finish within the hook's deadline: killed", cmd);
        return;
    }
    g_strstrip(out->str);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        say(h, "asked systemd to start pagefoldd (%s)%s%s", cmd, out->str[0] ? ": " : "",
            out->str);
    } else {
        say(h, "%s failed (status %d)%s%s", cmd, status, out->str[0] ? ": " : "", out->str);
    }
}

typedef struct {
    int kind;  /* 0: the pid of pagefoldd; 1: exec failed, errno */
    int value;
} SpawnNote;

/* Marks every descriptor from 3 on close-on-exec: pagefoldd takes nothing
 * of the hook's, libvirt's pipes least of all. */
static void
cloexec_from_3(void)
{
    long max;

    if (syscall(SYS_close_range, 3u, ~0u, CLOSE_RANGE_CLOEXEC) == 0) {
        return;
    }
    max = sysconf(_SC_OPEN_MAX);
    for (long fd = 3; fd < MIN(max < 0 ? 65536 : max, 1 << 20); fd++) {
        fcntl((int)fd, F_SETFD, FD_CLOEXEC);
    }
}

/*
 * Starts pagefoldd as a daemon of its own: forked twice, its own session
 * (no terminal, no process group of libvirtd's), stdin /dev/null, output
 * appended to out_fd, nothing else of the hook's.  Returns its pid, or 0
 * with error.
 */
static pid_t
spawn_detached(Hook *h, char **argv, int out_fd, GError **error)
{
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int note[2];
    pid_t mid;
    int status;
    pid_t daemon_pid = 0;

    if (null_fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "/dev/null: %s", g_strerror(errno));
        return 0;
    }
    if (!g_unix_open_pipe(note, FD_CLOEXEC, error)) {
        close(null_fd);
        return 0;
    }
    mid = fork();
    if (mid < 0) {
        int e = errno;

        close(null_fd);
        close(note[0]);
        close(note[1]);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "fork: %s", g_strerror(e));
        return 0;
    }
    if (mid == 0) {
        /* Only system calls from here: this is a copy of the hook. */
        pid_t grand;
        SpawnNote n = { 0, 0 };
        sigset_t none;

        setsid();
        grand = fork();
        if (grand != 0) {
            n.kind = grand < 0 ? 1 : 0;
            n.value = grand < 0 ? errno : grand;
            (void)!write(note[1], &n, sizeof(n));
            _exit(0);
        }
        /* Not a session leader: it can never take a terminal. */
        if (chdir("/") < 0 || dup2(null_fd, STDIN_FILENO) < 0 ||
            dup2(out_fd, STDOUT_FILENO) < 0 || dup2(out_fd, STDERR_FILENO) < 0) {
            n.kind = 1;
            n.value = errno;
            (void)!write(note[1], &n, sizeof(n));
            _exit(127);
        }
        /* dup2() onto itself would have kept close-on-exec. */
        fcntl(STDIN_FILENO, F_SETFD, 0);
        fcntl(STDOUT_FILENO, F_SETFD, 0);
        fcntl(STDERR_FILENO, F_SETFD, 0);
        cloexec_from_3();
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL); /* the hook ignores it; exec keeps that */
        execv(argv[0], argv);
        n.kind = 1;
        n.value = errno;
        (void)!write(note[1], &n, sizeof(n));
        _exit(127);
    }
    close(null_fd);
    close(note[1]);
    while (waitpid(mid, &status, 0) < 0 && errno == EINTR) {
    }
    /* The pid, then EOF once exec closed the pipe, or why exec failed. */
    for (;;) {
        struct pollfd p = { .fd = note[0], .events = POLLIN };
        SpawnNote n;
        ssize_t got;
        int r = poll(&p, 1, ms_left(h));

        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break; /* exec still not done: it will answer, or not */
        }
        got = read(note[0], &n, sizeof(n));
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got != sizeof(n)) {
            break;
        }
        if (n.kind == 0) {
            daemon_pid = n.value;
            continue;
        }
        close(note[0]);
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot run %s: %s", argv[0],
                    g_strerror(n.value));
        return 0;
    }
    close(note[0]);
    if (daemon_pid == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot start %s", argv[0]);
    }
    return daemon_pid;
}

/* Makes the folder of pagefoldd's log, 0750 as a log folder is; one
 * that exists is left as it is. */
static gboolean
make_log_folder(const char *file, GError **error)
{
    g_autofree char *dir = g_path_get_dirname(file);

    if (g_file_test(dir, G_FILE_TEST_IS_DIR)) {
        return TRUE;
    }
    if (g_mkdir_with_parents(dir, 0750) < 0 || chmod(dir, 0750) < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot make %s: %s", dir,
                    g_strerror(errno));
        return FALSE;
    }
    return TRUE;
}

/* Waits until pagefoldd answers, a READY_WAIT_MS at most. */
static gboolean
wait_ready(Hook *h)
{
    gint64 until = MIN(h->deadline, g_get_monotonic_time() + READY_WAIT_MS * 1000);

    for (;;) {
        g_autoptr(GError) error = NULL;
        Hook bounded = *h;

        bounded.deadline = until;
        if (ping(&bounded, &error)) {
            return TRUE;
        }
        if (g_get_monotonic_time() + READY_POLL_MS * 1000 >= until) {
            return FALSE;
        }
        g_usleep(READY_POLL_MS * 1000);
    }
}

/* Spawns pagefoldd itself, one hook at a time. */
static void
spawn_pagefoldd(Hook *h)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GPtrArray) argv = g_ptr_array_new_with_free_func(g_free);
    g_autofree char *cmd = NULL;
    g_autofree char *header = NULL;
    int lock_fd, out_fd;
    pid_t pid;

    if (!make_log_folder(h->pagefoldd_log, &error)) {
        say(h, "cannot start pagefoldd: %s", error->message);
        return;
    }
    /*
     * Hooks of VMs starting together take turns, so that one pagefoldd
     * starts, not two racing for the socket.  The lock is on a
     * description of the log of its own: pagefoldd's copy of the log
     * must not hold it.  Held until pagefoldd answers (or the wait ends).
     */
    lock_fd = open(h->pagefoldd_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, 0640);
    if (lock_fd < 0) {
        say(h, "cannot start pagefoldd: %s: %s", h->pagefoldd_log, g_strerror(errno));
        return;
    }
    while (flock(lock_fd, LOCK_EX | LOCK_NB) < 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) {
            break; /* no locking there: start it all the same */
        }
        if (ms_left(h) <= 0) {
            say(h, "another hook is starting pagefoldd; it did not finish within the deadline");
            close(lock_fd);
            return;
        }
        g_usleep(10 * 1000);
    }
    if (ping(h, NULL)) {
        say(h, "pagefoldd answers on %s (another hook started it)", h->socket_path);
        close(lock_fd);
        return;
    }
    g_ptr_array_add(argv, g_strdup(h->pagefoldd));
    g_ptr_array_add(argv, g_strdup("--socket"));
    g_ptr_array_add(argv, g_strdup(h->socket_path));
    /* libvirt's QEMUs run as libvirt-qemu: their agents need the agent
     * socket opened to that group. */
    if (*h->agent_group != '\0' && getgrnam(h->agent_group) != NULL) {
        g_ptr_array_add(argv, g_strdup("--agent-group"));
        g_ptr_array_add(argv, g_strdup(h->agent_group));
    }
    for (guint i = 0; i < h->pagefoldd_args->len; i++) {
        g_ptr_array_add(argv, g_strdup(g_ptr_array_index(h->pagefoldd_args, i)));
    }
    g_ptr_array_add(argv, NULL);
    cmd = g_strjoinv(" ", (char **)argv->pdata);
    out_fd = open(h->pagefoldd_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, 0640);
    if (out_fd < 0) {
        say(h, "cannot start pagefoldd: %s: %s", h->pagefoldd_log, g_strerror(errno));
        close(lock_fd);
        return;
    }
    header = g_strdup_printf("pagefold-hook: for domain %s: %s\n", h->name, cmd);
    (void)!write(out_fd, header, strlen(header));
    pid = spawn_detached(h, (char **)argv->pdata, out_fd, &error);
    close(out_fd);
    if (pid == 0) {
        say(h, "cannot start pagefoldd: %s", error->message);
        close(lock_fd);
        return;
    }
    say(h, "started pagefoldd (pid %d): %s; its log: %s", (int)pid, cmd, h->pagefoldd_log);
    if (wait_ready(h)) {
        say(h, "pagefoldd answers on %s", h->socket_path);
    } else {
        say(h, "pagefoldd does not answer on %s yet; the VM is attached if it does by the "
            "time QEMU runs (see %s)", h->socket_path, h->pagefoldd_log);
    }
    close(lock_fd);
}

/*
 * Where systemd is PID 1 and the hook was not told which pagefoldd to
 * run, systemd starts its unit (which says how, and restarts it);
 * otherwise the hook starts it itself.
 */
static void
start_pagefoldd(Hook *h)
{
    if (!h->pagefoldd_given && h->pagefoldd_args->len == 0 &&
        g_file_test("/run/systemd/system", G_FILE_TEST_IS_DIR)) {
        const char *const sc[] = { "systemctl", "start", "--no-block", SYSTEMD_UNIT, NULL };

        run_bounded(h, sc);
        if (wait_ready(h)) {
            say(h, "pagefoldd answers on %s", h->socket_path);
        } else {
            say(h, "pagefoldd does not answer on %s yet; the VM is attached if it does by "
                "the time QEMU runs (see journalctl -u " SYSTEMD_UNIT ")", h->socket_path);
        }
        return;
    }
    spawn_pagefoldd(h);
}

/* ---- the operations ---- */

/* prepare, start: pagefoldd runs before QEMU does (its agent connects at
 * once). */
static void
op_ensure_daemon(Hook *h, const Domain *dom)
{
    g_autoptr(GError) error = NULL;

    if (!domain_is_ours(dom)) {
        if (g_str_equal(h->op, "prepare")) {
            say(h, "RAM not shared memfd (<memoryBacking><source type='memfd'/><access "
                "mode='shared'/>): not pagefold's; kernel KSM is what merges private RAM");
        }
        return;
    }
    if (ping(h, &error)) {
        say(h, "pagefoldd answers on %s", h->socket_path);
        return;
    }
    if (g_error_matches(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT)) {
        say(h, "pagefoldd is there but did not answer (%s): not starting another",
            error->message);
        return;
    }
    say(h, "pagefoldd does not answer (%s): starting it", error->message);
    start_pagefoldd(h);
}

/* QEMU's pid, from libvirt's pid file. */
static int
read_pid(Hook *h, GError **error)
{
    g_autofree char *base = g_strconcat(h->name, ".pid", NULL);
    g_autofree char *path = g_build_filename(h->run_dir, base, NULL);
    char buf[32];
    ssize_t n;
    guint64 pid;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);

    if (fd < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_NOT_FOUND, "cannot read %s: %s", path,
                    g_strerror(errno));
        return 0;
    }
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n < 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_FAILED, "cannot read %s: %s", path,
                    g_strerror(errno));
        return 0;
    }
    buf[n] = '\0';
    g_strstrip(buf);
    if (!pf_parse_u64(buf, 1, G_MAXINT, &pid, NULL)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "%s holds no pid", path);
        return 0;
    }
    return (int)pid;
}

static const char *
member_str(JsonObject *o, const char *name)
{
    JsonNode *n = o ? json_object_get_member(o, name) : NULL;

    return n != NULL && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING
               ? json_node_get_string(n) : NULL;
}

static gint64
member_int(JsonObject *o, const char *name)
{
    JsonNode *n = o ? json_object_get_member(o, name) : NULL;

    return n != NULL && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_INT64
               ? json_node_get_int(n) : -1;
}

/* The VMs of a list reply (JSON objects), NULL if it is not one. */
static JsonArray *
as_array(JsonNode *n)
{
    return n != NULL && JSON_NODE_HOLDS_ARRAY(n) ? json_node_get_array(n) : NULL;
}

static JsonObject *
element_object(JsonArray *a, guint i)
{
    JsonNode *n = json_array_get_element(a, i);

    return JSON_NODE_HOLDS_OBJECT(n) ? json_node_get_object(n) : NULL;
}

static JsonObject *
find_by_pid(JsonArray *vms, int pid)
{
    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *vm = element_object(vms, i);

        if (member_int(vm, "pid") == pid) {
            return vm;
        }
    }
    return NULL;
}

static JsonNode *
request_vm(const char *command, const char *vm, const char *name)
{
    g_autoptr(JsonBuilder) args = json_builder_new();

    json_builder_begin_object(args);
    json_builder_set_member_name(args, "vm");
    json_builder_add_string_value(args, vm);
    if (name != NULL) {
        json_builder_set_member_name(args, "name");
        json_builder_add_string_value(args, name);
    }
    json_builder_end_object(args);
    return request_new(command, args);
}

/*
 * A VM attached before the hook (by its agent, as QEMU started) is in
 * the default merge domain: moved into the XML's.  pagefoldd refuses
 * once it shares pages there; it is then detached, so that it shares no
 * more with VMs it must not (those it shares stay until QEMU exits).
 */
static void
set_merge_domain(Hook *h, int pid, JsonObject *vm, const char *domain)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *key = g_strdup_printf("%d", pid);
    g_autoptr(JsonNode) req = request_vm("merge-domain", key, domain);
    g_autoptr(JsonNode) ret = control(h, req, &error);
    g_autoptr(JsonNode) dreq = NULL;
    g_autoptr(JsonNode) done = NULL;

    if (ret != NULL) {
        say(h, "pid %d moved from merge domain '%s' to '%s'", pid,
            member_str(vm, "merge_domain") ? member_str(vm, "merge_domain") : "?", domain);
        return;
    }
    if (!g_error_matches(error, HOOK_DAEMON_ERROR, 0)) {
        say(h, "cannot put pid %d in merge domain '%s': %s", pid, domain, error->message);
        return;
    }
    say(h, "pagefoldd did not put pid %d in merge domain '%s': %s", pid, domain,
        error->message);
    g_clear_error(&error);
    dreq = request_vm("detach", key, NULL);
    done = control(h, dreq, &error);
    if (done != NULL) {
        say(h, "detached pid %d rather than let it share pages outside merge domain '%s'",
            pid, domain);
    } else {
        say(h, "detach of pid %d failed too: %s", pid, error->message);
    }
}

/* started, reconnect, attach: QEMU runs; attach it by pid. */
static void
op_attach(Hook *h, const Domain *dom)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonBuilder) args = json_builder_new();
    g_autoptr(JsonNode) req = NULL;
    g_autoptr(JsonNode) ret = NULL;
    JsonObject *vm;
    int pid;

    if (!domain_is_ours(dom)) {
        if (!g_str_equal(h->op, "started")) {
            say(h, "RAM not shared memfd (<memoryBacking><source type='memfd'/><access "
                "mode='shared'/>): not pagefold's; kernel KSM is what merges private RAM");
        }
        return;
    }
    /* Attached all the same, as kernel KSM lists what it will not merge:
     * QEMU's mem-merge=off keeps its agent in advise mode, saying why, and
     * a QEMU without one is attached in advise mode, which changes
     * nothing. */
    if (dom->nosharepages) {
        say(h, "<memoryBacking><nosharepages/>: advise mode, never merged");
    }
    /* A merge domain pagefoldd did not hear of would let the VM share
     * pages with VMs it must not: no merge rather than that. */
    if (dom->has_config &&
        (dom->merge_domain == NULL || !merge_domain_is_valid(dom->merge_domain))) {
        say(h, "<pagefold:config> (%s) wants merge-domain=\"NAME\" (1 to %d bytes, no control "
            "characters): not attaching it", PAGEFOLD_NS, MAX_MERGE_DOMAIN_LEN);
        return;
    }
    pid = read_pid(h, &error);
    if (pid == 0) {
        say(h, "no QEMU pid (%s): not attached", error->message);
        return;
    }
    json_builder_begin_object(args);
    json_builder_set_member_name(args, "pid");
    json_builder_add_int_value(args, pid);
    json_builder_set_member_name(args, "name");
    json_builder_add_string_value(args, dom->name);
    json_builder_set_member_name(args, "uuid");
    json_builder_add_string_value(args, dom->uuid);
    if (dom->merge_domain != NULL) {
        json_builder_set_member_name(args, "merge-domain");
        json_builder_add_string_value(args, dom->merge_domain);
    }
    json_builder_end_object(args);
    req = request_new("attach", args);
    ret = control(h, req, &error);
    if (ret != NULL) {
        JsonObject *o = JSON_NODE_HOLDS_OBJECT(ret) ? json_node_get_object(ret) : NULL;
        JsonNode *regions = o ? json_object_get_member(o, "regions") : NULL;
        gint64 pages = member_int(o, "pages");

        say(h, "attached pid %d as VM '%s' (uuid %s%s%s) in mode %s: %u region(s), %.1f MiB",
            pid, dom->name, dom->uuid, dom->merge_domain ? ", merge domain " : "",
            dom->merge_domain ? dom->merge_domain : "",
            member_str(o, "mode") ? member_str(o, "mode") : "?",
            regions && JSON_NODE_HOLDS_ARRAY(regions)
                ? json_array_get_length(json_node_get_array(regions)) : 0,
            pages > 0 ? (double)pages * PF_PAGE_SIZE / 1048576.0 : 0.0);
        return;
    }
    if (!g_error_matches(error, HOOK_DAEMON_ERROR, 0)) {
        say(h, "cannot attach pid %d: %s; the VM runs unmerged", pid, error->message);
        return;
    }
    /* Refused: already attached (its agent connected it as QEMU started),
     * or not attachable.  The list says which. */
    {
        g_autoptr(GError) lerr = NULL;
        g_autoptr(JsonNode) lreq = request_new("list", NULL);
        g_autoptr(JsonNode) list = control(h, lreq, &lerr);

        vm = find_by_pid(as_array(list), pid);
        if (vm != NULL) {
            say(h, "pid %d is attached already, as VM '%s' (uuid %s) in mode %s: its agent "
                "connected it, or an earlier hook", pid,
                member_str(vm, "name") ? member_str(vm, "name") : "?",
                member_str(vm, "uuid") ? member_str(vm, "uuid") : "none",
                member_str(vm, "mode") ? member_str(vm, "mode") : "?");
            if (dom->merge_domain != NULL &&
                g_strcmp0(member_str(vm, "merge_domain"), dom->merge_domain) != 0) {
                set_merge_domain(h, pid, vm, dom->merge_domain);
            }
            return;
        }
        say(h, "pagefoldd did not attach pid %d: %s", pid, error->message);
    }
}

/* stopped, release: detach the VM if pagefoldd still has it, with its
 * last figures. */
static void
op_detach(Hook *h, const Domain *dom)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(GError) pid_error = NULL;
    g_autoptr(JsonNode) lreq = request_new("list", NULL);
    g_autoptr(JsonNode) list = NULL;
    g_autoptr(JsonNode) sreq = NULL;
    g_autoptr(JsonNode) dreq = NULL;
    g_autoptr(JsonNode) stats = NULL;
    g_autoptr(JsonNode) done = NULL;
    g_autoptr(GString) figures = g_string_new(NULL);
    g_autofree char *key = NULL;
    JsonArray *vms;
    JsonObject *mine = NULL;
    guint n_mine = 0;
    int pid;

    if (!domain_is_ours(dom)) {
        return;
    }
    /* Gone by release; there during stopped, though QEMU has exited. */
    pid = read_pid(h, &pid_error);
    list = control(h, lreq, &error);
    if (list == NULL) {
        say(h, "cannot ask pagefoldd (%s): nothing detached", error->message);
        return;
    }
    vms = as_array(list);
    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *vm = element_object(vms, i);
        const char *uuid = member_str(vm, "uuid");

        if (pid != 0 && member_int(vm, "pid") == pid) {
            /* A pid file may outlive its QEMU, and the pid be another's
             * by now: the UUID must agree where the VM has one. */
            if (uuid != NULL && !g_str_equal(uuid, dom->uuid)) {
                say(h, "pid %d is attached as another VM ('%s', uuid %s): left alone", pid,
                    member_str(vm, "name") ? member_str(vm, "name") : "?", uuid);
                return;
            }
            mine = vm;
            n_mine = 1;
            break;
        }
        if (pid == 0 && uuid != NULL && g_str_equal(uuid, dom->uuid)) {
            mine = vm;
            n_mine++;
        }
    }
    if (n_mine == 0) {
        say(h, "%s", g_str_equal(h->op, "stopped")
                   ? "not attached: pagefoldd already dropped it (QEMU exited)"
                   : "not attached (detached at stopped, or dropped as QEMU exited)");
        return;
    }
    if (n_mine > 1) {
        say(h, "%u VMs have uuid %s and there is no pid file (%s): none detached", n_mine,
            dom->uuid, pid_error->message);
        return;
    }
    pid = (int)member_int(mine, "pid");
    key = g_strdup_printf("%d", pid);

    sreq = request_vm("stats", key, NULL);
    stats = control(h, sreq, &error);
    if (stats != NULL && JSON_NODE_HOLDS_OBJECT(stats)) {
        JsonObject *vm = find_by_pid(
            as_array(json_object_get_member(json_node_get_object(stats), "vms")), pid);
        static const char *const shown[] = {
            "pages_shared", "pages_sharing", "zero_pages", "cow", NULL
        };

        for (const char *const *s = shown; vm != NULL && *s; s++) {
            g_string_append_printf(figures, "%s=%" G_GINT64_FORMAT " ", *s, member_int(vm, *s));
        }
        if (vm != NULL) {
            g_string_append_printf(figures, "mode=%s",
                                   member_str(vm, "mode") ? member_str(vm, "mode") : "?");
        }
    }
    if (figures->len == 0) {
        g_string_printf(figures, "none (%s)", error ? error->message : "not in stats");
    }
    g_clear_error(&error);

    dreq = request_vm("detach", key, NULL);
    done = control(h, dreq, &error);
    if (done != NULL) {
        say(h, "detached VM '%s' (pid %d); final figures: %s",
            member_str(mine, "name") ? member_str(mine, "name") : "?", pid, figures->str);
    } else {
        say(h, "detach of pid %d: %s; last figures: %s", pid, error->message, figures->str);
    }
}

int
main(int argc, char **argv)
{
    Hook h = {
        .socket_path = PF_DEFAULT_SOCKET,
        .pagefoldd = PF_INSTALLED_PAGEFOLDD,
        .pagefoldd_log = DEFAULT_PAGEFOLDD_LOG,
        .agent_group = DEFAULT_AGENT_GROUP,
        .run_dir = DEFAULT_RUN_DIR,
        .log_dir = DEFAULT_LOG_DIR,
        .log_fd = -1,
        .deadline = g_get_monotonic_time() + HOOK_DEADLINE_MS * 1000,
    };
    g_autoptr(GPtrArray) extra = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    g_autoptr(GString) xml = NULL;
    g_auto(Domain) dom = { 0 };
    gboolean ensure, attach, detach, filter;

    /* A reader gone (libvirtd's end of stderr) must not kill the hook: it
     * exits 0, whatever happens. */
    signal(SIGPIPE, SIG_IGN);
    h.pagefoldd_args = extra;
    if (!parse_args(&h, argc, argv, &error)) {
        say(&h, "%s; nothing done", error->message);
        (void)!write(STDERR_FILENO, usage_text, strlen(usage_text));
        return 0;
    }
    if (!name_is_file_name(h.name)) {
        h.name = NULL;
        say(&h, "domain name '%s' cannot name a file: nothing done", argv[argc - 4]);
        return 0;
    }
    open_domain_log(&h);

    ensure = (g_str_equal(h.op, "prepare") || g_str_equal(h.op, "start")) &&
             g_str_equal(h.subop, "begin");
    attach = (g_str_equal(h.op, "started") || g_str_equal(h.op, "reconnect") ||
              g_str_equal(h.op, "attach")) && g_str_equal(h.subop, "begin");
    detach = (g_str_equal(h.op, "stopped") || g_str_equal(h.op, "release")) &&
             g_str_equal(h.subop, "end");
    filter = g_str_equal(h.op, "migrate") || g_str_equal(h.op, "restore") ||
             g_str_equal(h.op, "save");

    /* libvirt writes the XML for every operation: read it all, so that it
     * never meets a closed pipe. */
    xml = read_stdin(&h, &error);
    if (filter) {
        /* libvirt reads stdout as the domain XML to go on with; empty is
         * "unchanged".  The VM is attached once QEMU runs (started). */
        say(&h, "domain XML passed through unchanged");
    } else if (!ensure && !attach && !detach) {
        say(&h, "nothing to do for operation '%s %s'", h.op, h.subop);
    } else if (xml == NULL) {
        say(&h, "%s: nothing done", error->message);
    } else if (!parse_domain(h.name, xml, &dom, &error)) {
        say(&h, "%s: nothing done", error->message);
    } else if (ensure) {
        op_ensure_daemon(&h, &dom);
    } else if (attach) {
        op_attach(&h, &dom);
    } else {
        op_detach(&h, &dom);
    }
    if (h.log_fd >= 0) {
        close(h.log_fd);
    }
    return 0;
}
