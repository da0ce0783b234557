/*
 * escape.c - see escape.h.
 */
#include "escape.h"

#include <string.h>

/* Valid UTF-8 that still must not reach a terminal or a log as it is. */
static gboolean
char_shown_as_is(gunichar c)
{
    GUnicodeType t = g_unichar_type(c);

    /* g_unichar_isprint() leaves out controls, format characters (bidi
     * overrides among them), unassigned and private use, but counts the
     * line and paragraph separators printable: some viewers break lines
     * there. */
    return g_unichar_isprint(c) && t != G_UNICODE_LINE_SEPARATOR &&
           t != G_UNICODE_PARAGRAPH_SEPARATOR;
}

char *
pf_escape_text(const char *text, gssize len)
{
    GString *out;
    const char *p, *end;

    if (text == NULL) {
        return g_strdup("(null)");
    }
    end = text + (len < 0 ? strlen(text) : (gsize)len);
    out = g_string_sized_new((gsize)(end - text) + 1);
    for (p = text; p < end;) {
        guchar b = (guchar)*p;
        gunichar c;

        if (b == '\n') {
            g_string_append(out, "\\n");
        } else if (b == '\r') {
            g_string_append(out, "\\r");
        } else if (b == '\t') {
            g_string_append(out, "\\t");
        } else if (b < 0x20 || b == 0x7f) {
            g_string_append_printf(out, "\\x%02x", b);
        } else if (b < 0x80) {
            g_string_append_c(out, (char)b);
        } else if ((c = g_utf8_get_char_validated(p, end - p)) == (gunichar)-1 ||
                   c == (gunichar)-2) {
            /* Not UTF-8 (or cut short by len): this byte alone, and the
             * next is looked at afresh. */
            g_string_append_printf(out, "\\x%02x", b);
        } else {
            const char *next = g_utf8_next_char(p);

            if (char_shown_as_is(c)) {
                g_string_append_len(out, p, next - p);
            } else if (c <= 0xffff) {
                g_string_append_printf(out, "\\u%04x", c);
            } else {
                g_string_append_printf(out, "\\U%08x", c);
            }
            p = next;
            continue;
        }
        p++;
    }
    return g_string_free(out, FALSE);
}
