/*
 * escape-test.c - pf_escape_text(): what a peer wrote comes out as
 * printable UTF-8, all of it, and escaping twice changes nothing.
 */
#include <glib.h>
#include <string.h>

#include "escape.h"

static void
check(const char *text, gssize len, const char *want)
{
    g_autofree char *got = pf_escape_text(text, len);
    g_autofree char *again = pf_escape_text(got, -1);

    g_assert_cmpstr(got, ==, want);
    /* Idempotent: text escaped where it enters pagefoldd shows the same
     * where it is shown (escaped again). */
    g_assert_cmpstr(again, ==, got);
    g_assert_true(g_utf8_validate(got, -1, NULL));
}

static void
test_escape(void)
{
    static const char nul[] = "a\0b";

    check("pc.ram", -1, "pc.ram");
    check("", -1, "");
    check(NULL, -1, "(null)");
    /* Printable UTF-8 and the backslash stay. */
    check("Grüße \\ 仮想機械 🙂", -1, "Grüße \\ 仮想機械 🙂");
    /* A forged line, a colour, a title, a bell, DEL. */
    check("x\n** Message: forged", -1, "x\\n** Message: forged");
    check("\r\t\x1b[31m\x1b]0;t\x07\x7f", -1, "\\r\\t\\x1b[31m\\x1b]0;t\\x07\\x7f");
    /* A NUL inside len is shown, and what follows it. */
    check(nul, sizeof(nul) - 1, "a\\x00b");
    /* Not UTF-8: each byte alone; a character cut short by len too. */
    check("\xff\xfe" "ok\xc3", -1, "\\xff\\xfeok\\xc3");
    check("\xc3\xa9", 1, "\\xc3");
    check("\xc0\x80", -1, "\\xc0\\x80"); /* overlong NUL */
    check("\xed\xa0\x80", -1, "\\xed\\xa0\\x80"); /* a surrogate */
    /* Valid, but not to be shown as is: CSI (C1), a bidi override, the
     * line separator, a format character beyond the BMP (a tag). */
    check("\xc2\x9b" "2J", -1, "\\u009b2J");
    check("\xe2\x80\xae" "txt", -1, "\\u202etxt");
    check("\xe2\x80\xa8", -1, "\\u2028");
    check("\xf3\xa0\x80\x81", -1, "\\U000e0001");
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/escape/text", test_escape);
    return g_test_run();
}
