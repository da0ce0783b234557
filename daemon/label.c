/*
 * label.c - see label.h.
 */
#include "label.h"

#include <string.h>

#include "util.h"

gboolean
pf_uuid_parse(const char *text, guint8 uuid[16])
{
    guint n = 0;

    for (const char *p = text; *p != '\0'; p++) {
        int hi, lo;

        if (*p == '-' && (n == 4 || n == 6 || n == 8 || n == 10) && p[1] != '-') {
            continue;
        }
        if (n == 16 || (hi = g_ascii_xdigit_value(p[0])) < 0 ||
            (lo = g_ascii_xdigit_value(p[1])) < 0) {
            return FALSE;
        }
        uuid[n++] = (guint8)(hi << 4 | lo);
        p++;
    }
    return n == 16;
}

const char *
pf_uuid_format(const guint8 uuid[16], char buf[37])
{
    const guint8 *u = uuid;

    g_snprintf(buf, 37,
               "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
               u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
               u[12], u[13], u[14], u[15]);
    return buf;
}

const char *
pf_uuid_text(const guint8 uuid[16], char buf[37])
{
    static const guint8 none[16];

    return memcmp(uuid, none, sizeof(none)) == 0 ? NULL : pf_uuid_format(uuid, buf);
}

gboolean
pf_label_is_valid(const char *what, const char *text, GError **error)
{
    if (*text == '\0' || strlen(text) > PF_MAX_LABEL_LEN || !g_utf8_validate(text, -1, NULL)) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%s must be 1 to %d bytes of UTF-8", what, PF_MAX_LABEL_LEN);
        return FALSE;
    }
    for (const char *p = text; *p; p++) {
        if (g_ascii_iscntrl(*p)) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s must not contain control characters", what);
            return FALSE;
        }
    }
    return TRUE;
}
