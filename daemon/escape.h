/*
 * escape.h - how text pagefoldd did not write itself is shown to people:
 * a peer's words (an agent's VM and region names, the reasons in its
 * READY and ADVISE, its ERROR text), a QEMU's command line and memfd
 * names, as they reach pagefoldd's log, pagefoldctl's tables and the
 * libvirt hook's lines.
 *
 * Owns nothing: a pure function of its argument.  Must never let through
 * a byte a terminal or a log reader could take for anything but a
 * printable character (a line break that forges a line, an escape
 * sequence, a NUL that cuts it short, bytes that are not UTF-8), and
 * never drop what it was given: every byte is shown, escaped if need be.
 *
 * A backslash is left as it is, so that escaping is idempotent: text is
 * escaped where it enters pagefoldd (so its replies and JSON hold it
 * escaped too) and again where it is shown (the log, pagefoldctl, the
 * hook), and shows the same.  The price: text that holds "\x1b" itself
 * reads like an escaped ESC; a reader cannot tell them apart, and neither
 * forges a line or works a terminal.
 */
#pragma once

#include <glib.h>

/*
 * text (len bytes, or up to its NUL when len is -1) as printable UTF-8:
 * printable ASCII and printable, valid UTF-8 as they are (the backslash
 * too); newline, carriage return and tab as \n, \r, \t; any other byte
 * below 0x20, DEL, and each byte of what is not valid UTF-8 as \xNN; a valid
 * character that is not printable (C1 controls, format characters such as
 * bidirectional overrides, line and paragraph separators) as \uNNNN or
 * \UNNNNNNNN.  NULL is shown as "(null)".  What it returns it returns
 * unchanged.  Free with g_free().
 */
char *pf_escape_text(const char *text, gssize len);
