/*
 * hook-args.c - see hook-args.h.
 */
#include "hook-args.h"

#include <string.h>

#include "libvirt-status.h"
#include "util.h"

/* libvirt's rule again, and no control character either: the hook makes
 * paths of the name as root, and says it in logs. */
gboolean
hook_name_is_file_name(const char *name)
{
    if (!pf_libvirt_name_is_file_name(name)) {
        return FALSE;
    }
    for (const char *p = name; *p; p++) {
        if (g_ascii_iscntrl(*p)) {
            return FALSE;
        }
    }
    return TRUE;
}

gboolean
hook_parse_args(Hook *h, int argc, char **argv, GError **error)
{
    static const char *const known[] = {
        "socket", "pagefoldd", "pagefoldd-arg", "pagefoldd-log", "agent-group", "run-dir",
        "log-dir", NULL
    };
    /* libvirt's EXTRA, the last, is never that. */
    gboolean start_only = argc >= 2 && g_str_equal(argv[argc - 1], "--start-pagefoldd");
    int n_opts = start_only ? argc - 2 : argc - 1 - 4;

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
    if (start_only) {
        h->start_only = TRUE;
        return TRUE;
    }
    h->name = argv[argc - 4];
    h->op = argv[argc - 3];
    h->subop = argv[argc - 2];
    return TRUE;
}
