/*
 * hook-args.h - the hook's command line: its options, then libvirt's four
 * arguments (NAME OP SUBOP EXTRA) or --start-pagefoldd, into a Hook; and
 * whether the domain's name may name a file.
 *
 * Apart from hook.c (which has main()) so that the fuzzer
 * (tests/fuzz/hook-args.c) can call it.  Owns nothing: the Hook points
 * into argv.  Must never take a value it did not check for a file name,
 * and never guess at an unknown option.
 */
#pragma once

#include <glib.h>

#include "hook-common.h"

/* Fills h's options and libvirt's arguments from argv; FALSE with error
 * for anything libvirt and the options do not allow.  Options then
 * --start-pagefoldd (the package's postinst) set start_only instead of
 * libvirt's arguments. */
gboolean hook_parse_args(Hook *h, int argc, char **argv, GError **error);

/* The domain's name as a file name: libvirt refuses '/' in names, but the
 * hook makes paths of it as root, so it checks again. */
gboolean hook_name_is_file_name(const char *name);
