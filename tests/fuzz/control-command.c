/*
 * control-command.c - fuzzes pf_control_command_execute(), what pagefoldd
 * does with one line of its control socket: JSON parsed, the request's
 * shape and each command's arguments checked, the command run against a
 * real PfScanner (with no VM) and answered; then
 * pf_control_command_answer(), the control thread's answer to the same
 * line from a view of that scanner.  The socket is root's, but a request
 * is still input: it must get a reply, never a crash.
 *
 * Input: the request line (no newline), any bytes.
 *
 * Checks, beyond ASan/UBSan: every request gets exactly one reply, now or
 * from its job (run on the main context here), and the reply is one line
 * of JSON holding "return" or "error"; the answer from a view, if the
 * command only reads (or the request is refused), is the same text; the scanner's knobs are put back
 * after each input, so that one input's "set" does not change the next.
 *
 * "attach" is the one command that reaches outside: by pid, to whatever
 * process that is (another test's QEMU, on CI).  An integer pid is made
 * one no process can have (above the kernel's pid_max limit, still a
 * valid int) before the line is run, so attach checks all its arguments
 * and then fails to find the process.
 */
#include <stdint.h>

#include <json-glib/json-glib.h>

#include "control-commands.h"
#include "fuzz-common.h"
#include "knobs.h"
#include "scan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* PID_MAX_LIMIT is 4194304 (2^22). */
#define NO_SUCH_PID (G_GINT64_CONSTANT(1) << 30)

static PfScanner *scanner;
static PfKnobs default_knobs;

static void
check_reply(const char *reply)
{
    g_autoptr(JsonParser) p = json_parser_new();
    JsonObject *o;

    if (strchr(reply, '\n') != NULL || !json_parser_load_from_data(p, reply, -1, NULL) ||
        !JSON_NODE_HOLDS_OBJECT(json_parser_get_root(p))) {
        fprintf(stderr, "fuzz: reply is not one line of a JSON object: %s\n", reply);
        abort();
    }
    o = json_node_get_object(json_parser_get_root(p));
    if (json_object_has_member(o, "return") == json_object_has_member(o, "error")) {
        fprintf(stderr, "fuzz: reply holds neither or both of return and error: %s\n", reply);
        abort();
    }
}

/* The line to run: data as is, unless it is an attach by an integer pid. */
static char *
defuse_attach(const char *line, gsize len, gsize *out_len)
{
    g_autoptr(JsonParser) p = json_parser_new();
    g_autoptr(JsonGenerator) g = NULL;
    JsonObject *req, *args;
    JsonNode *exec, *args_node, *pid;

    if (!g_utf8_validate(line, (gssize)len, NULL) ||
        !json_parser_load_from_data(p, line, (gssize)len, NULL) ||
        json_parser_get_root(p) == NULL || !JSON_NODE_HOLDS_OBJECT(json_parser_get_root(p))) {
        return NULL;
    }
    req = json_node_get_object(json_parser_get_root(p));
    exec = json_object_get_member(req, "execute");
    args_node = json_object_get_member(req, "arguments");
    if (exec == NULL || !JSON_NODE_HOLDS_VALUE(exec) ||
        json_node_get_value_type(exec) != G_TYPE_STRING ||
        g_strcmp0(json_node_get_string(exec), "attach") != 0 || args_node == NULL ||
        !JSON_NODE_HOLDS_OBJECT(args_node)) {
        return NULL;
    }
    args = json_node_get_object(args_node);
    pid = json_object_get_member(args, "pid");
    if (pid == NULL || !JSON_NODE_HOLDS_VALUE(pid) ||
        json_node_get_value_type(pid) != G_TYPE_INT64) {
        return NULL;
    }
    json_node_set_int(pid, NO_SUCH_PID);
    g = json_generator_new();
    json_generator_set_root(g, json_parser_get_root(p));
    return json_generator_to_data(g, out_len);
}

static void
got_later(PfControlLater *l, gpointer user)
{
    *(gboolean *)user = TRUE;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    g_autofree char *line = NULL;
    g_autofree char *defused = NULL;
    g_autofree char *reply = NULL;
    PfControlLater *later = NULL;
    g_autoptr(PfView) made = NULL;
    g_autoptr(PfView) view = NULL;
    g_autofree char *answer = NULL;
    gboolean counters_read = FALSE;
    gsize len = size, defused_len = 0;

    if (scanner == NULL) {
        fuzz_quiet_logs();
        scanner = pf_scanner_new(NULL);
        default_knobs = *pf_scanner_get_knobs(scanner);
    }
    /* The control socket hands over a line without its newline, NUL
     * bytes and all: a copy with one after it, as control.c's buffer. */
    line = g_malloc(size + 1);
    memcpy(line, data, size);
    line[size] = '\0';
    defused = defuse_attach(line, len, &defused_len);
    if (defused != NULL) {
        reply = pf_control_command_execute(scanner, defused, defused_len, NULL, &later, &made);
    } else {
        reply = pf_control_command_execute(scanner, line, len, NULL, &later, &made);
    }
    if (reply != NULL && later != NULL) {
        fprintf(stderr, "fuzz: a reply now and a job's too\n");
        abort();
    }
    if (later != NULL) {
        gboolean done = FALSE;

        pf_control_later_watch(later, got_later, &done);
        /* With no VM a job is a few passes over nothing. */
        for (int i = 0; i < 10000 && !done; i++) {
            g_main_context_iteration(NULL, FALSE);
        }
        if (!done) {
            fprintf(stderr, "fuzz: a job with no VM did not end\n");
            abort();
        }
        reply = pf_control_later_steal_reply(later);
        pf_control_later_free(later);
    }
    if (reply == NULL) {
        fprintf(stderr, "fuzz: no reply\n");
        abort();
    }
    check_reply(reply);
    /* The control thread's answer from a view, to a read (or a request
     * refused whatever the scanner holds). */
    view = pf_view_new(scanner);
    answer = pf_control_command_answer(view, defused != NULL ? defused : line,
                                       defused != NULL ? defused_len : len, &counters_read);
    /* Nothing ran between the two: the same words. */
    if (answer != NULL && strcmp(answer, reply) != 0) {
        fprintf(stderr, "fuzz: the main loop answered\n%s\nand a view\n%s\n", reply, answer);
        abort();
    }
    *pf_scanner_get_knobs(scanner) = default_knobs;
    return 0;
}
