/*
 * hook-args.c - fuzzes hook_parse_args() and hook_name_is_file_name(), the
 * libvirt hook's command line: its options, then libvirt's NAME OP SUBOP
 * EXTRA.  The hook runs as root and makes paths of the name.
 *
 * Input: the arguments after argv[0], separated by NUL bytes (as the
 * kernel lays out a process's arguments), at most 64.
 *
 * Checks, beyond ASan/UBSan: arguments parsed give libvirt's four from the
 * end of argv and every option's value from argv; a name accepted as a
 * file name has no '/', no control character and is not "." or "..".
 */
#include <stdint.h>

#include "fuzz-common.h"
#include "hook-args.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_ARGS 64

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    g_autofree char *buf = g_malloc(size + 1);
    g_autoptr(GPtrArray) extra = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    char *argv[MAX_ARGS + 2] = { "pagefold-libvirt-hook" };
    int argc = 1;
    Hook h = { .log_fd = -1, .pagefoldd_args = extra };
    static gboolean quiet;

    if (!quiet) {
        fuzz_quiet_logs();
        quiet = TRUE;
    }
    memcpy(buf, data, size);
    buf[size] = '\0';
    for (char *p = buf; p <= buf + size && argc <= MAX_ARGS; p += strlen(p) + 1) {
        argv[argc++] = p;
    }
    argv[argc] = NULL;
    if (!hook_parse_args(&h, argc, argv, &error)) {
        if (error == NULL) {
            abort();
        }
        return 0;
    }
    if (h.start_only) {
        /* Options, then --start-pagefoldd: no libvirt arguments. */
        if (h.name != NULL || !g_str_equal(argv[argc - 1], "--start-pagefoldd")) {
            abort();
        }
        return 0;
    }
    if (argc < 5 || h.name != argv[argc - 4] || h.op != argv[argc - 3] ||
        h.subop != argv[argc - 2]) {
        fprintf(stderr, "fuzz: libvirt's arguments taken from the wrong places\n");
        abort();
    }
    /* Every value points into argv, after the options' "--NAME=" or as
     * the next argument: none past the options. */
    for (guint i = 0; i < extra->len; i++) {
        const char *v = g_ptr_array_index(extra, i);

        if (v < buf || v > buf + size) {
            abort();
        }
    }
    if (hook_name_is_file_name(h.name)) {
        if (strchr(h.name, '/') != NULL || g_str_equal(h.name, ".") ||
            g_str_equal(h.name, "..") || *h.name == '\0') {
            fprintf(stderr, "fuzz: '%s' accepted as a file name\n", h.name);
            abort();
        }
        for (const char *p = h.name; *p; p++) {
            if (g_ascii_iscntrl(*p)) {
                abort();
            }
        }
    }
    return 0;
}
