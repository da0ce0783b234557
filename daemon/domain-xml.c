/*
 * domain-xml.c - a libvirt domain's XML (see domain-xml.h), as the hook
 * reads it on its stdin or pagefoldd in libvirt's status file, parsed by
 * GMarkup, which leaves namespaces to its user, so this file resolves them
 * itself (a stack of frames, one per open element, with the declarations
 * made on it) and keeps only the few elements pagefold looks at.
 *
 * Owns the frames of one parse, and the strings of the Domain it fills
 * (domain_clear()).  Must never touch pagefoldd, a file or a descriptor
 * (its callers read the XML), never read a DTD or expand an external
 * entity.
 */
#include "domain-xml.h"

#include <string.h>

#include "label.h"
#include "util.h"

void
domain_clear(Domain *d)
{
    g_free(d->name);
    g_free(d->uuid);
    g_free(d->merge_domain);
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
    /* A status file: <domstatus pid='N'> holds the <domain>, one level
     * down; *pid from its attribute. */
    gboolean status;
    guint n_domains;
    int *pid;
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

/* The namespace declarations an element makes, into f: they hold for the
 * element itself.  An attribute given twice is refused here. */
static gboolean
take_ns_decls(Frame *f, const char *element, const char **names, const char **values,
              GError **error)
{
    for (guint i = 0; names[i] != NULL; i++) {
        NsDecl d = { NULL, NULL };

        for (guint j = 0; j < i; j++) {
            if (g_str_equal(names[i], names[j])) {
                g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                            "attribute '%s' twice on <%s>", names[i], element);
                return FALSE;
            }
        }
        if (g_str_equal(names[i], "xmlns")) {
            d.uri = g_strdup(values[i]);
        } else if (g_str_has_prefix(names[i], "xmlns:")) {
            if (names[i][6] == '\0' || *values[i] == '\0') {
                g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                            "bad namespace declaration '%s' on <%s>", names[i], element);
                return FALSE;
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
    return TRUE;
}

/* The element's own name into f, resolved; prefixed attributes must be
 * declared too, though their values are not looked at. */
static gboolean
resolve_names(Parse *p, Frame *f, const char *element, const char **names, GError **error)
{
    g_autofree char *prefix = NULL;
    const char *local;

    if (!split_qname(element, &prefix, &local, error)) {
        return FALSE;
    }
    f->local = g_strdup(local);
    if (!resolve(p, f, prefix, &f->ns)) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "namespace prefix '%s' of <%s> is not declared", prefix, element);
        return FALSE;
    }
    for (guint i = 0; names[i] != NULL; i++) {
        g_autofree char *ap = NULL;
        const char *al, *uri;

        if (g_str_equal(names[i], "xmlns") || g_str_has_prefix(names[i], "xmlns:")) {
            continue;
        }
        if (!split_qname(names[i], &ap, &al, error)) {
            return FALSE;
        }
        if (ap != NULL && !resolve(p, f, ap, &uri)) {
            g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                        "namespace prefix '%s' of attribute '%s' is not declared", ap,
                        names[i]);
            return FALSE;
        }
    }
    return TRUE;
}

/* The root: one, and libvirt's <domain>, or <domstatus> in a status
 * file, with the QEMU's pid. */
static void
note_root(Parse *p, Frame *f, const char *element, const char **names, const char **values,
          GError **error)
{
    const char *want = p->status ? "domstatus" : "domain";
    guint64 pid;

    if (++p->n_roots > 1) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "more than one root element");
        return;
    }
    if (!is_plain(f, want)) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "the root element is <%s>%s%s, not libvirt's <%s>", element,
                    f->ns ? " of namespace " : "", f->ns ? f->ns : "", want);
        return;
    }
    if (p->status) {
        const char *text = attr(names, values, "pid");

        if (text == NULL || !pf_parse_u64(text, 1, G_MAXINT, &pid, NULL)) {
            g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                        "<domstatus pid=...> is no process id");
            return;
        }
        *p->pid = (int)pid;
    }
}

/* <domain><name> and <domain><uuid>: their text is kept (on_end()). */
static void
note_name_or_uuid(Parse *p, Frame *f, GError **error)
{
    if (is_plain(f, "name")) {
        if (set_once(&p->n_name, "<name>", error)) {
            f->text = g_string_new(NULL);
        }
    } else if (is_plain(f, "uuid")) {
        if (set_once(&p->n_uuid, "<uuid>", error)) {
            f->text = g_string_new(NULL);
        }
    }
}

/* <memoryBacking>'s children: whether the RAM is a shared memfd, and
 * whether the domain wants it never merged. */
static void
note_memory_backing(Parse *p, Frame *f, const char **names, const char **values,
                    GError **error)
{
    if (is_plain(f, "source") && set_once(&p->n_source, "<memoryBacking><source>", error)) {
        p->dom->memfd = g_strcmp0(attr(names, values, "type"), "memfd") == 0;
    } else if (is_plain(f, "access") &&
               set_once(&p->n_access, "<memoryBacking><access>", error)) {
        p->dom->access_shared = g_strcmp0(attr(names, values, "mode"), "shared") == 0;
    } else if (is_plain(f, "nosharepages")) {
        p->dom->nosharepages = TRUE;
    }
}

/* <metadata><pagefold:config merge-domain='NAME'/>. */
static void
note_config(Parse *p, const char **names, const char **values, GError **error)
{
    const char *md = attr(names, values, "merge-domain");

    /* libvirt keeps one element per namespace in <metadata>. */
    if (p->dom->has_config) {
        g_set_error(error, G_MARKUP_ERROR, G_MARKUP_ERROR_INVALID_CONTENT,
                    "more than one <config> of namespace " PAGEFOLD_NS);
        return;
    }
    p->dom->has_config = TRUE;
    p->dom->merge_domain = g_strdup(md);
}

/* Of the element being opened (f, not on the stack yet), what the hook
 * looks at; everything else is only kept track of for its namespaces. */
static void
note_element(Parse *p, Frame *f, const char *element, const char **names,
             const char **values, GError **error)
{
    guint depth = p->stack->len;
    Frame *parent = ancestor(p, 0), *grandparent = ancestor(p, 1);

    if (depth == 0) {
        note_root(p, f, element, names, values, error);
        return;
    }
    if (p->status) {
        /* The status file's <domain>, once; only what is in it counts. */
        if (depth == 1 && is_plain(f, "domain")) {
            set_once(&p->n_domains, "<domstatus><domain>", error);
        }
        if (depth == 1 || p->stack->len < 2 ||
            !is_plain(g_ptr_array_index(p->stack, 1), "domain")) {
            return;
        }
        depth--;
    }
    if (depth == 1) {
        note_name_or_uuid(p, f, error);
    } else if (depth == 2 && is_plain(parent, "memoryBacking")) {
        note_memory_backing(p, f, names, values, error);
    } else if (depth == 2 && is_plain(parent, "metadata") &&
               g_strcmp0(f->ns, PAGEFOLD_NS) == 0 && g_str_equal(f->local, "config")) {
        note_config(p, names, values, error);
    } else if (depth == 3 && is_plain(f, "cell") && is_plain(parent, "numa") &&
               is_plain(grandparent, "cpu")) {
        if (g_strcmp0(attr(names, values, "memAccess"), "shared") == 0) {
            p->dom->numa_shared = TRUE;
        }
    }
}

static void
on_start(GMarkupParseContext *ctx, const char *element, const char **names,
         const char **values, gpointer user, GError **error)
{
    Parse *p = user;
    Frame *f = g_new0(Frame, 1);

    if (!take_ns_decls(f, element, names, values, error) ||
        !resolve_names(p, f, element, names, error)) {
        frame_free(f);
        return;
    }
    /* On the stack even when refused: the stack frees it. */
    note_element(p, f, element, names, values, error);
    g_ptr_array_add(p->stack, f);
}

static void
on_end(GMarkupParseContext *ctx, const char *element, gpointer user, GError **error)
{
    Parse *p = user;
    Frame *f = g_ptr_array_steal_index(p->stack, p->stack->len - 1);

    if (f->text != NULL && p->stack->len == (p->status ? 2u : 1u)) {
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

static gboolean
parse(const char *name, const GString *xml, Domain *dom, int *pid, GError **error)
{
    static const GMarkupParser parser = { on_start, on_end, on_text, NULL, NULL };
    g_autoptr(GPtrArray) stack = g_ptr_array_new_with_free_func((GDestroyNotify)frame_free);
    Parse p = { .stack = stack, .dom = dom, .status = pid != NULL, .pid = pid };
    g_autoptr(GMarkupParseContext) ctx =
        g_markup_parse_context_new(&parser, G_MARKUP_PREFIX_ERROR_POSITION, &p, NULL);
    g_autoptr(GError) local = NULL;
    guint8 uuid[16];
    char text[37];

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
    if (p.status && p.n_domains == 0) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "the status file holds no <domain>");
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
    dom->uuid = g_strdup(pf_uuid_format(uuid, text));
    return TRUE;
}

gboolean
domain_xml_parse(const char *name, const GString *xml, Domain *dom, GError **error)
{
    return parse(name, xml, dom, NULL, error);
}

gboolean
domain_status_parse(const char *name, const GString *xml, Domain *dom, int *pid,
                    GError **error)
{
    *pid = 0;
    return parse(name, xml, dom, pid, error);
}

gboolean
domain_is_ours(const Domain *d)
{
    return d->memfd && (d->access_shared || d->numa_shared);
}
