/*
 * util.c - see util.h.  Parsing here is strict on purpose: a knob or a pid
 * given as "12abc", " 12" or "-1" is an error, never a silent 12 or 0.
 */
#include "util.h"

#include <errno.h>
#include <stdlib.h>

G_DEFINE_QUARK(pagefold-error-quark, pf_error)

gboolean
pf_parse_u64(const char *text, guint64 min, guint64 max, guint64 *out,
             GError **error)
{
    char *end = NULL;
    guint64 v;

    if (text == NULL || !g_ascii_isdigit(text[0])) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "'%s' is not a non-negative whole number", text ? text : "");
        return FALSE;
    }
    errno = 0;
    v = g_ascii_strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0') {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "'%s' is not a non-negative whole number", text);
        return FALSE;
    }
    if (v < min || v > max) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%s is out of range [%" G_GUINT64_FORMAT ", %" G_GUINT64_FORMAT "]",
                    text, min, max);
        return FALSE;
    }
    *out = v;
    return TRUE;
}
