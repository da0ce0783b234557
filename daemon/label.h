/*
 * label.h - what a VM's labels are: its UUID as text (parsed and written
 * one way), and the one rule for a label (a VM's name, its merge domain).
 * pagefoldd's control socket and the libvirt hook both hold to these, so
 * that what the hook hands pagefoldd is what pagefoldd takes.
 *
 * Owns nothing: pure functions of their arguments.  Must never grow a
 * dependency on a VM, the scanner or any other state of pagefoldd's: the
 * hook links it without them.
 */
#pragma once

#include <glib.h>

/* Parses a UUID written as 32 hex digits, in 8-4-4-4-12 groups or not. */
gboolean pf_uuid_parse(const char *text, guint8 uuid[16]);
/* A UUID as text: 36 characters, lowercase 8-4-4-4-12, and a NUL into buf;
 * returns buf. */
const char *pf_uuid_format(const guint8 uuid[16], char buf[37]);
/* The same, or NULL for the all-zero UUID, which stands for none. */
const char *pf_uuid_text(const guint8 uuid[16], char buf[37]);
/* The longest label of a VM: its name, its merge domain. */
#define PF_MAX_LABEL_LEN 128
/*
 * Whether text may label a VM, as its name or its merge domain: 1 to
 * PF_MAX_LABEL_LEN bytes of UTF-8 without control characters.  what ("a
 * VM name", "a merge domain") begins the error's message.  The control
 * socket and the libvirt hook hold labels to this one rule.
 */
gboolean pf_label_is_valid(const char *what, const char *text, GError **error);
