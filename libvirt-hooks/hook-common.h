/*
 * hook-common.h - what the files of the libvirt hook (pagefold-libvirt-hook;
 * see hook.c) share, beneath them all: the Hook, that is its options,
 * libvirt's arguments, the domain's log and the one deadline; saying what
 * it does; one control call to pagefoldd within the deadline, and asking
 * whether pagefoldd answers.
 *
 * Owns nothing at run time: main() fills the Hook once.  Must never call
 * into hook.c or start-pagefoldd.c (calls go one way: hook.c down into
 * those, and all of them down into this), and never grow into a
 * second home for what one file is about: only what more than one of them
 * needs.  Whatever uses it keeps the hook's rules (hook.c): every wait
 * bounded by the deadline, nothing on stdout.
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

/* All the hook may take, from start to exit: libvirtd waits for it. */
#define HOOK_DEADLINE_MS 1500
/* How long a pagefoldd the hook started may take to answer, within
 * HOOK_DEADLINE_MS; and for --start-pagefoldd, which no libvirtd waits
 * on, on a busy host. */
#define HOOK_READY_WAIT_MS 1000
#define HOOK_START_ONLY_WAIT_MS 10000

typedef struct {
    /* Options. */
    const char *socket_path;
    const char *pagefoldd;
    gboolean pagefoldd_given;
    GPtrArray *pagefoldd_args;
    const char *pagefoldd_log;
    const char *agent_group;
    const char *run_dir;
    const char *log_dir;
    /* --start-pagefoldd last, for the package's maintainer scripts: no
     * libvirt arguments (name, op and subop NULL). */
    gboolean start_only;
    /* libvirt's arguments. */
    const char *name;
    const char *op;
    const char *subop;
    int log_fd;     /* libvirt's log of the domain, or -1 */
    gint64 deadline; /* monotonic µs */
    int ready_wait_ms; /* a start's wait for pagefoldd, within deadline */
} Hook;

/* Milliseconds left until deadline (monotonic µs), rounded up; 0 once it
 * passed. */
int hook_ms_left(gint64 deadline);
/* All of stdin, within the deadline (monotonic µs): the domain XML
 * (domain-xml.h); NULL (and the rest drained) if it is too big.  libvirt
 * writes it and closes the pipe. */
GString *domain_xml_read(gint64 deadline, GError **error);
/*
 * One line, "pagefold-hook: NAME OP SUBOP: what", on stderr and appended
 * to libvirt's log of the domain.  Control characters (from XML or
 * pagefoldd's answers) become '?': a line is a line.
 */
void hook_say(Hook *h, const char *fmt, ...) G_GNUC_PRINTF(2, 3);
/* A control request: {"execute": command, "arguments": args' root}, args
 * NULL for none. */
JsonNode *hook_request_new(const char *command, JsonBuilder *args);
/*
 * One control call within what is left of h->deadline; returns a copy of
 * the reply's "return".  Errors: pagefoldd's own refusal is
 * PF_CLIENT_ERROR_REFUSED with its desc; not reaching it is
 * pf_client_call()'s (pf_client_execute()).
 */
JsonNode *hook_control(Hook *h, JsonNode *request, GError **error);
/* Whether pagefoldd answers on h->socket_path (qmp_capabilities) within
 * what is left of h->deadline.  Errors are those of a control call:
 * G_IO_ERROR_TIMED_OUT where something listens but does not answer. */
gboolean hook_ping(Hook *h, GError **error);
