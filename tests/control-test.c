/*
 * control-test.c - the control socket, over a real UNIX socket, with every
 * kind of bad input: each gets a clear error and the daemon, the connection
 * and the attached VMs carry on.
 */
#include <errno.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <json-glib/json-glib.h>
#include <poll.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "control.h"
#include "cpu-use.h"
#include "guestmem.h"
#include "util.h"

typedef struct {
    char *dir;
    char *path;
    PfScanner *scanner;
    PfControl *control;
    PfGuest *guest[2];
    int pid[2];
    int fd;
    GString *in;
} Fixture;

static int
client_connect(const char *path)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

    g_strlcpy(addr.sun_path, path, sizeof(addr.sun_path));
    g_assert_cmpint(connect(fd, (struct sockaddr *)&addr, sizeof(addr)), ==, 0);
    return fd;
}

/* Whether the test leaves the main loop alone (it is "busy"); else the
 * server's commands run on this thread's main context, spun while
 * waiting. */
static gboolean main_busy;

static void
send_all(int fd, const char *buf, gsize len)
{
    gsize off = 0;

    while (off < len) {
        ssize_t n = send(fd, buf + off, len - off, MSG_DONTWAIT | MSG_NOSIGNAL);

        if (n > 0) {
            off += (gsize)n;
        } else {
            g_assert_cmpint(errno, ==, EAGAIN);
            if (main_busy || !g_main_context_iteration(NULL, FALSE)) {
                g_usleep(500);
            }
        }
    }
}

static char *
recv_line(int fd, GString *in)
{
    gint64 start = g_get_monotonic_time();

    for (;;) {
        char *nl = memchr(in->str, '\n', in->len);
        char buf[4096];
        ssize_t n;

        if (nl != NULL) {
            char *line = g_strndup(in->str, (gsize)(nl - in->str));

            g_string_erase(in, 0, nl - in->str + 1);
            return line;
        }
        n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0) {
            g_string_append_len(in, buf, n);
        } else if (n == 0) {
            return NULL;
        } else {
            g_assert_cmpint(errno, ==, EAGAIN);
            /* Long enough for any answer: only a hang waits that long. */
            g_assert_cmpint(g_get_monotonic_time() - start, <, 60 * G_USEC_PER_SEC);
            if (main_busy || !g_main_context_iteration(NULL, FALSE)) {
                g_usleep(500);
            }
        }
    }
}

static JsonObject *
parse_object(const char *line)
{
    g_autoptr(JsonParser) p = json_parser_new();
    g_autoptr(GError) error = NULL;

    g_assert_nonnull(line);
    json_parser_load_from_data(p, line, -1, &error);
    g_assert_no_error(error);
    g_assert_true(JSON_NODE_HOLDS_OBJECT(json_parser_get_root(p)));
    return json_object_ref(json_node_get_object(json_parser_get_root(p)));
}

/* Sends raw text (a newline is added) and returns the parsed reply. */
static JsonObject *
raw(Fixture *f, const char *text)
{
    g_autofree char *line = g_strconcat(text, "\n", NULL);
    g_autofree char *reply = NULL;

    send_all(f->fd, line, strlen(line));
    reply = recv_line(f->fd, f->in);
    return parse_object(reply);
}

static JsonObject *
ok(Fixture *f, const char *text)
{
    g_autoptr(JsonObject) r = raw(f, text);

    if (!json_object_has_member(r, "return")) {
        g_autoptr(JsonNode) n = json_node_init_object(json_node_alloc(), r);
        g_autofree char *s = json_to_string(n, FALSE);

        g_error("expected success for %s, got %s", text, s);
    }
    return json_object_ref(r);
}

/* Expects an error of this class whose text contains want. */
static void
fails(Fixture *f, const char *text, const char *klass, const char *want)
{
    g_autoptr(JsonObject) r = raw(f, text);
    JsonObject *e;

    g_assert_true(json_object_has_member(r, "error"));
    e = json_object_get_object_member(r, "error");
    g_assert_cmpstr(json_object_get_string_member(e, "class"), ==, klass);
    if (strstr(json_object_get_string_member(e, "desc"), want) == NULL) {
        g_error("error for %s is '%s', wanted '%s' in it", text,
                json_object_get_string_member(e, "desc"), want);
    }
}

static const PfLayout layout = { .identical = 300, .unique = 100, .zero = 112, .holes = 0 };

static void
setup(Fixture *f, gconstpointer data)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *greeting = NULL;
    g_autoptr(JsonObject) g = NULL;

    f->dir = g_dir_make_tmp("pagefold-control-XXXXXX", &error);
    g_assert_no_error(error);
    f->path = g_build_filename(f->dir, "sub", "pagefoldd.sock", NULL);
    f->scanner = pf_scanner_new(NULL);
    pf_scanner_get_knobs(f->scanner)->run = FALSE;
    f->control = pf_control_new(f->scanner, f->path, &error);
    g_assert_no_error(error);
    pf_control_start(f->control);
    for (int i = 0; i < 2; i++) {
        f->guest[i] = pf_guest_new("memory-backend-memfd", &layout, (guint32)i + 1);
        f->pid[i] = pf_guest_hold(f->guest[i]);
    }
    f->in = g_string_new(NULL);
    f->fd = client_connect(f->path);
    greeting = recv_line(f->fd, f->in);
    g = parse_object(greeting);
    g_assert_true(json_object_has_member(g, "QMP"));
}

static void
teardown(Fixture *f, gconstpointer data)
{
    close(f->fd);
    g_string_free(f->in, TRUE);
    pf_control_free(f->control);
    g_assert_false(g_file_test(f->path, G_FILE_TEST_EXISTS));
    pf_scanner_free(f->scanner);
    for (int i = 0; i < 2; i++) {
        pf_guest_release(f->pid[i]);
        pf_guest_free(f->guest[i]);
    }
    {
        g_autofree char *sub = g_path_get_dirname(f->path);

        g_rmdir(sub);
    }
    g_rmdir(f->dir);
    g_free(f->path);
    g_free(f->dir);
}

static void
test_socket_mode(Fixture *f, gconstpointer data)
{
    struct stat st;
    g_autoptr(GError) error = NULL;
    PfControl *second;

    g_assert_cmpint(stat(f->path, &st), ==, 0);
    g_assert_cmpint(st.st_mode & 0777, ==, 0600);
    /* A second daemon on the same socket is refused, the first untouched. */
    second = pf_control_new(f->scanner, f->path, &error);
    g_assert_null(second);
    g_assert_error(error, PF_ERROR, PF_ERROR_EXISTS);
    g_autoptr(JsonObject) r = ok(f, "{\"execute\": \"qmp_capabilities\"}");
}

static void
test_attach_stats_detach(Fixture *f, gconstpointer data)
{
    g_autofree char *a = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"name\": \"vm-a\"}, \"id\": 7}",
        f->pid[0]);
    g_autofree char *b = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d}}", f->pid[1]);
    g_autoptr(JsonObject) r = ok(f, a);
    g_autoptr(JsonObject) r2 = NULL;
    g_autoptr(JsonObject) s = NULL;
    JsonObject *total, *ret, *cpu_use;
    JsonArray *vms;

    g_assert_cmpint(json_object_get_int_member(r, "id"), ==, 7);
    ret = json_object_get_object_member(r, "return");
    g_assert_cmpstr(json_object_get_string_member(ret, "name"), ==, "vm-a");
    g_assert_cmpstr(json_object_get_string_member(ret, "mode"), ==, "advise");
    r2 = ok(f, b);

    s = ok(f, "{\"execute\": \"scan-now\", \"arguments\": {\"passes\": 2}}");
    ret = json_object_get_object_member(s, "return");
    g_assert_cmpstr(json_object_get_string_member(ret, "mode"), ==, "advise");
    total = json_object_get_object_member(ret, "total");
    g_assert_cmpint(json_object_get_int_member(total, "pages_shared"), ==, 300);
    g_assert_cmpint(json_object_get_int_member(total, "pages_sharing"), ==, 300);
    g_assert_cmpint(json_object_get_int_member(total, "pages_unshared"), ==, 200);
    g_assert_cmpint(json_object_get_int_member(total, "zero_pages"), ==, 224);
    g_assert_cmpint(json_object_get_int_member(total, "full_scans"), ==, 2);
    for (const char *const *n = pf_counter_names(); *n; n++) {
        g_assert_true(json_object_has_member(total, *n));
    }
    /* Where the main thread's CPU went, by what it was doing. */
    cpu_use = json_object_get_object_member(ret, "cpu_use");
    for (guint i = 0; i < PF_CPU_N; i++) {
        JsonObject *use = json_object_get_object_member(cpu_use, pf_cpu_use_name(i));

        g_assert_cmpint(json_object_get_int_member(use, "usec"), >=, 0);
        g_assert_cmpint(json_object_get_int_member(use, "minflt"), >=, 0);
        g_assert_cmpint(json_object_get_int_member(use, "spans"), >=, 0);
    }
    vms = json_object_get_array_member(ret, "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 2);

    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"stats\", \"arguments\": {\"vm\": \"vm-a\"}}");
    vms = json_object_get_array_member(json_object_get_object_member(s, "return"), "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpint(json_object_get_int_member(json_array_get_object_element(vms, 0),
                                               "pages_sharing"), ==, 150);

    /* The same process twice is refused. */
    fails(f, a, "GenericError", "already attached");
    fails(f, "{\"execute\": \"detach\", \"arguments\": {\"vm\": \"nope\"}}",
          "DeviceNotFound", "no VM 'nope'");
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"detach\", \"arguments\": {\"vm\": \"vm-a\"}}");
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"list\"}");
    g_assert_cmpuint(json_array_get_length(json_object_get_array_member(s, "return")), ==, 1);
}

/*
 * A name is a label: two VMs may have one (every QEMU started without
 * -name is "qemu").  Both attach; the name then names neither, with an
 * error that lists their pids; the pid names each.  Once it was refused:
 * "a VM named '...' is already attached".
 */
static void
test_same_name(Fixture *f, gconstpointer data)
{
    g_autofree char *a = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"name\": \"qemu\"}}",
        f->pid[0]);
    /* This test process maps both guests' RAM: a VM too. */
    g_autofree char *b = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"name\": \"qemu\"}}",
        getpid());
    g_autofree char *want = g_strdup_printf("2 VMs have the name 'qemu' (pids %d, %d)",
                                            f->pid[0], getpid());
    g_autofree char *by_pid = g_strdup_printf(
        "{\"execute\": \"stats\", \"arguments\": {\"vm\": \"%d\"}}", getpid());
    g_autofree char *detach = g_strdup_printf(
        "{\"execute\": \"detach\", \"arguments\": {\"vm\": \"%d\"}}", f->pid[0]);
    g_autoptr(JsonObject) r = ok(f, a);
    g_autoptr(JsonObject) r2 = ok(f, b);
    g_autoptr(JsonObject) s = NULL;
    JsonArray *vms;
    JsonObject *vm;

    s = ok(f, "{\"execute\": \"list\"}");
    vms = json_object_get_array_member(s, "return");
    g_assert_cmpuint(json_array_get_length(vms), ==, 2);
    for (guint i = 0; i < 2; i++) {
        vm = json_array_get_object_element(vms, i);
        g_assert_cmpstr(json_object_get_string_member(vm, "name"), ==, "qemu");
        /* No -uuid on their command lines: known to have none. */
        g_assert_true(json_object_has_member(vm, "uuid"));
        g_assert_true(json_node_is_null(json_object_get_member(vm, "uuid")));
    }
    fails(f, "{\"execute\": \"stats\", \"arguments\": {\"vm\": \"qemu\"}}",
          "GenericError", want);
    fails(f, "{\"execute\": \"detach\", \"arguments\": {\"vm\": \"qemu\"}}",
          "GenericError", "name one by its pid");
    fails(f, "{\"execute\": \"unmerge\", \"arguments\": {\"vm\": \"qemu\"}}",
          "GenericError", want);
    fails(f, "{\"execute\": \"stats\", \"arguments\": {\"vm\": \"2147483646\"}}",
          "DeviceNotFound", "no VM of pid 2147483646");

    g_clear_pointer(&s, json_object_unref);
    s = ok(f, by_pid);
    vms = json_object_get_array_member(json_object_get_object_member(s, "return"), "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpint(json_object_get_int_member(json_array_get_object_element(vms, 0), "pid"),
                    ==, getpid());
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, detach);
    /* One left: the name names it again. */
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"stats\", \"arguments\": {\"vm\": \"qemu\"}}");
    vms = json_object_get_array_member(json_object_get_object_member(s, "return"), "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpint(json_object_get_int_member(json_array_get_object_element(vms, 0), "pid"),
                    ==, getpid());
}

/*
 * attach's "uuid" (the libvirt hook sends the domain's): the VM takes it,
 * in place of anything QEMU's -uuid says; a malformed one is refused and
 * nothing is attached.
 */
static void
test_attach_uuid(Fixture *f, gconstpointer data)
{
    g_autofree char *bad = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"uuid\": \"12345\"}}",
        f->pid[0]);
    g_autofree char *wrong_type = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"uuid\": 7}}", f->pid[0]);
    g_autofree char *a = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"name\": \"vm-a\", "
        "\"uuid\": \"0B1C2D3E-4F50-6172-8394-A5B6C7D8E9F0\"}}", f->pid[0]);
    g_autofree char *b = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, "
        "\"uuid\": \"00112233445566778899aabbccddeeff\"}}", f->pid[1]);
    g_autoptr(JsonObject) r = NULL;
    g_autoptr(JsonObject) r2 = NULL;
    g_autoptr(JsonObject) s = NULL;
    JsonArray *vms;

    fails(f, bad, "GenericError", "uuid must be 32 hex digits");
    fails(f, wrong_type, "GenericError", "parameter 'uuid' must be a string");
    s = ok(f, "{\"execute\": \"list\"}");
    g_assert_cmpuint(json_array_get_length(json_object_get_array_member(s, "return")), ==, 0);

    r = ok(f, a);
    g_assert_cmpstr(json_object_get_string_member(json_object_get_object_member(r, "return"),
                                                  "uuid"),
                    ==, "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0");
    r2 = ok(f, b);
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"list\"}");
    vms = json_object_get_array_member(s, "return");
    g_assert_cmpuint(json_array_get_length(vms), ==, 2);
    g_assert_cmpstr(json_object_get_string_member(json_array_get_object_element(vms, 1), "uuid"),
                    ==, "00112233-4455-6677-8899-aabbccddeeff");
    /* And names it, as a UUID from QEMU's -uuid does. */
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"stats\", \"arguments\": "
              "{\"vm\": \"0b1c2d3e4f5061728394a5b6c7d8e9f0\"}}");
    vms = json_object_get_array_member(json_object_get_object_member(s, "return"), "vms");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpstr(json_object_get_string_member(json_array_get_object_element(vms, 0), "name"),
                    ==, "vm-a");
}

/*
 * attach's "merge-domain" (the libvirt hook sends the domain XML's): the
 * VM is in it from the start, before any page of it is seen; a malformed
 * one is refused and nothing is attached.
 */
static void
test_attach_merge_domain(Fixture *f, gconstpointer data)
{
    g_autofree char *empty = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"merge-domain\": \"\"}}",
        f->pid[0]);
    g_autofree char *ctrl = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"merge-domain\": \"a\\nb\"}}",
        f->pid[0]);
    g_autofree char *a = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"merge-domain\": "
        "\"tenant-a\"}}", f->pid[0]);
    g_autofree char *b = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d}}", f->pid[1]);
    g_autoptr(JsonObject) r = NULL;
    g_autoptr(JsonObject) r2 = NULL;
    g_autoptr(JsonObject) s = NULL;
    JsonArray *vms;

    fails(f, empty, "GenericError", "a merge domain must be 1 to");
    fails(f, ctrl, "GenericError", "a merge domain must not contain control characters");
    s = ok(f, "{\"execute\": \"list\"}");
    g_assert_cmpuint(json_array_get_length(json_object_get_array_member(s, "return")), ==, 0);

    r = ok(f, a);
    g_assert_cmpstr(json_object_get_string_member(json_object_get_object_member(r, "return"),
                                                  "merge_domain"), ==, "tenant-a");
    r2 = ok(f, b);
    g_clear_pointer(&s, json_object_unref);
    s = ok(f, "{\"execute\": \"list\"}");
    vms = json_object_get_array_member(s, "return");
    g_assert_cmpuint(json_array_get_length(vms), ==, 2);
    g_assert_cmpstr(json_object_get_string_member(json_array_get_object_element(vms, 0),
                                                  "merge_domain"), ==, "tenant-a");
    g_assert_cmpstr(json_object_get_string_member(json_array_get_object_element(vms, 1),
                                                  "merge_domain"), ==, "default");
}

static void
test_bad_requests(Fixture *f, gconstpointer data)
{
    g_autoptr(JsonObject) r = NULL;

    fails(f, "{\"execute\": ", "GenericError", "JSON parse error");
    fails(f, "not json at all", "GenericError", "JSON parse error");
    fails(f, "[1, 2, 3]", "GenericError", "must be a JSON object");
    fails(f, "42", "GenericError", "must be a JSON object");
    fails(f, "{}", "GenericError", "'execute' must be");
    fails(f, "{\"execute\": 5}", "GenericError", "'execute' must be");
    fails(f, "{\"execute\": \"list\", \"arguments\": [1]}", "GenericError",
          "'arguments' must be an object");
    fails(f, "{\"execute\": \"list\", \"bogus\": 1}", "GenericError", "'bogus' is unexpected");
    fails(f, "{\"execute\": \"format-disk\"}", "CommandNotFound", "'format-disk'");
    fails(f, "{\"execute\": \"attach\"}", "GenericError", "'pid' is missing");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": \"12\"}}", "GenericError",
          "'pid' must be an integer");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": 1.5}}", "GenericError",
          "'pid' must be an integer");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": -4}}", "GenericError",
          "positive process id");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": 99999999999}}", "GenericError",
          "positive process id");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": 2147483646}}", "DeviceNotFound",
          "no process");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": 1, \"name\": \"a\\nb\"}}",
          "GenericError", "control characters");
    fails(f, "{\"execute\": \"attach\", \"arguments\": {\"pid\": 1, \"extra\": true}}",
          "GenericError", "'extra' is unexpected");
    fails(f, "{\"execute\": \"list\", \"arguments\": {\"x\": null}}", "GenericError",
          "'x' is unexpected");
    fails(f, "{\"execute\": \"stats\", \"arguments\": {\"vm\": 3}}", "GenericError",
          "'vm' must be a string");
    fails(f, "{\"execute\": \"set\", \"arguments\": {\"knob\": \"nope\", \"value\": 1}}",
          "GenericError", "unknown knob 'nope'");
    fails(f, "{\"execute\": \"set\", \"arguments\": {\"knob\": \"cpu_percent\", \"value\": 0}}",
          "GenericError", "between 1 and 100");
    fails(f, "{\"execute\": \"set\", \"arguments\": {\"knob\": \"run\", \"value\": -1}}",
          "GenericError", "must not be negative");
    fails(f, "{\"execute\": \"set\", \"arguments\": {\"knob\": \"pages_to_scan\"}}",
          "GenericError", "'value' is missing");
    fails(f, "{\"execute\": \"scan-now\", \"arguments\": {\"passes\": 0}}", "GenericError",
          "between 1 and");
    fails(f, "\xff\xfe{}", "GenericError", "not valid UTF-8");
    /* json-glib quotes the bad token of a broken \u escape undecoded: the
     * reply is still JSON (tests/fuzz/control-command found it). */
    fails(f, "{\"exe\\udetst\"", "GenericError", "JSON parse error");

    /* The id comes back whatever its type, also with an error. */
    r = raw(f, "{\"execute\": \"nope\", \"id\": {\"tag\": [1, \"x\"]}}");
    g_assert_true(json_object_has_member(r, "id"));
    g_assert_cmpstr(json_object_get_string_member(
                        json_object_get_object_member(r, "error"), "class"), ==, "CommandNotFound");

    /* Knobs that were refused did not change; good ones do. */
    g_clear_pointer(&r, json_object_unref);
    r = ok(f, "{\"execute\": \"set\", \"arguments\": {\"knob\": \"pages_to_scan\", \"value\": 5000}}");
    g_assert_cmpint(json_object_get_int_member(json_object_get_object_member(r, "return"),
                                               "pages_to_scan"), ==, 5000);
    g_assert_cmpint(json_object_get_int_member(json_object_get_object_member(r, "return"),
                                               "cpu_percent"), ==, 100);
}

/* Over-long lines: one error, the rest of the line dropped, and the same
 * connection still works. */
static void
test_huge_request(Fixture *f, gconstpointer data)
{
    gsize len = 3 * PF_CONTROL_MAX_LINE;
    g_autofree char *huge = g_malloc(len + 1);
    g_autofree char *reply = NULL;
    g_autoptr(JsonObject) r = NULL;
    g_autoptr(JsonObject) r2 = NULL;

    memset(huge, ' ', len);
    memcpy(huge, "{\"execute\": \"list\", \"id\": \"", 28);
    huge[len - 1] = '\n';
    send_all(f->fd, huge, len);
    reply = recv_line(f->fd, f->in);
    r = parse_object(reply);
    g_assert_nonnull(strstr(json_object_get_string_member(
                                json_object_get_object_member(r, "error"), "desc"),
                            "longer than"));
    r2 = ok(f, "{\"execute\": \"list\"}");
}

/* Clients that go away mid-line, or pipeline many requests at once. */
static void
test_clients(Fixture *f, gconstpointer data)
{
    GString *in2 = g_string_new(NULL);
    int other = client_connect(f->path);
    g_autofree char *greet = recv_line(other, in2);
    GString *many = g_string_new(NULL);
    g_autoptr(JsonObject) r = NULL;

    send_all(other, "{\"execute\": \"li", 15);
    close(other);
    for (int i = 0; i < 50; i++) {
        g_string_append_printf(many, "{\"execute\": \"knobs\", \"id\": %d}\r\n", i);
    }
    send_all(f->fd, many->str, many->len);
    for (int i = 0; i < 50; i++) {
        g_autofree char *line = recv_line(f->fd, f->in);
        g_autoptr(JsonObject) o = parse_object(line);

        g_assert_cmpint(json_object_get_int_member(o, "id"), ==, i);
    }
    r = ok(f, "{\"execute\": \"stats\"}");
    g_string_free(many, TRUE);
    g_string_free(in2, TRUE);
}

/*
 * The main loop, busy scanning on a host whose cores are all taken, does
 * not run: reads are answered from the view it last published, and that
 * view has every change the client made; a command that acts waits for
 * the main loop, and its reply comes when it runs.  (stats, which tells
 * counters, waits longer, and is answered from a view only if its
 * counters are recent: a matter of time, not tested here.)
 */
static void
test_main_loop_busy(Fixture *f, gconstpointer data)
{
    g_autofree char *a = g_strdup_printf(
        "{\"execute\": \"attach\", \"arguments\": {\"pid\": %d, \"name\": \"vm-a\"}}",
        f->pid[0]);
    static const char set[] =
        "{\"execute\": \"set\", \"arguments\": {\"knob\": \"pages_to_scan\", \"value\": 777}}";
    static const char list[] = "{\"execute\": \"list\", \"id\": 3}\n";
    static const char knobs[] = "{\"execute\": \"knobs\"}\n";
    static const char detach[] = "{\"execute\": \"detach\", \"arguments\": {\"vm\": \"vm-a\"}}\n";
    g_autoptr(JsonObject) r = ok(f, a);
    g_autoptr(JsonObject) k = NULL;
    g_autoptr(JsonObject) l = NULL;
    g_autoptr(JsonObject) done = NULL;
    g_autofree char *line = NULL;
    struct pollfd p = { .fd = f->fd, .events = POLLIN };
    JsonArray *vms;

    g_clear_pointer(&r, json_object_unref);
    r = ok(f, set);
    /* From here the main loop does not run until the end. */
    main_busy = TRUE;
    send_all(f->fd, list, strlen(list));
    line = recv_line(f->fd, f->in);
    l = parse_object(line);
    g_assert_cmpint(json_object_get_int_member(l, "id"), ==, 3);
    vms = json_object_get_array_member(l, "return");
    g_assert_cmpuint(json_array_get_length(vms), ==, 1);
    g_assert_cmpstr(json_object_get_string_member(json_array_get_object_element(vms, 0), "name"),
                    ==, "vm-a");
    g_clear_pointer(&line, g_free);
    send_all(f->fd, knobs, strlen(knobs));
    line = recv_line(f->fd, f->in);
    k = parse_object(line);
    g_assert_cmpint(json_object_get_int_member(json_object_get_object_member(k, "return"),
                                               "pages_to_scan"),
                    ==, 777);
    /* A detach acts: no reply while the main loop is busy (a reply is
     * never taken back, so one now would be there still). */
    send_all(f->fd, detach, strlen(detach));
    g_usleep(200 * 1000);
    g_assert_cmpint(poll(&p, 1, 0), ==, 0);
    main_busy = FALSE;
    g_clear_pointer(&line, g_free);
    line = recv_line(f->fd, f->in);
    done = parse_object(line);
    g_assert_true(json_object_has_member(done, "return"));
    g_assert_cmpuint(pf_scanner_get_vms(f->scanner)->len, ==, 0);
}

/* A client that shuts its side after its last line (socat, nc -N) gets
 * every reply, an acting command's too, and is closed after. */
static void
test_half_close(Fixture *f, gconstpointer data)
{
    static const char lines[] =
        "{\"execute\": \"knobs\", \"id\": 1}\n"
        "{\"execute\": \"set\", \"arguments\": {\"knob\": \"pages_to_scan\", \"value\": 555}, \"id\": 2}\n"
        "{\"execute\": \"list\", \"id\": 3}\n";
    g_autofree char *last = NULL;

    send_all(f->fd, lines, strlen(lines));
    g_assert_cmpint(shutdown(f->fd, SHUT_WR), ==, 0);
    for (int id = 1; id <= 3; id++) {
        g_autofree char *line = recv_line(f->fd, f->in);
        g_autoptr(JsonObject) r = parse_object(line);

        g_assert_cmpint(json_object_get_int_member(r, "id"), ==, id);
        g_assert_true(json_object_has_member(r, "return"));
    }
    g_assert_cmpuint(pf_scanner_get_knobs(f->scanner)->pages_to_scan, ==, 555);
    last = recv_line(f->fd, f->in);
    g_assert_null(last);
}

/* Freed as soon as made (pagefoldd failing to start after its control
 * socket): its thread, not yet waiting, is not waited for ever. */
static void
test_free_at_once(void)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *dir = g_dir_make_tmp("pagefold-control-XXXXXX", &error);
    g_autofree char *path = g_build_filename(dir, "s", NULL);
    g_autoptr(PfScanner) scanner = pf_scanner_new(NULL);

    for (int i = 0; i < 50; i++) {
        PfControl *c = pf_control_new(scanner, path, &error);

        g_assert_no_error(error);
        if (i % 2 == 0) {
            pf_control_start(c);
        }
        pf_control_free(c);
    }
    g_rmdir(dir);
}

/*
 * The socket appears at its path already listening (pf_unix_listen():
 * bound under a name of its own, renamed into place), never bound and
 * not yet listening: a client that found it then was refused, as
 * /kernel/6.1/agent/restart's was, and a hook would start another
 * pagefoldd.  Its name comes by a rename, so a watcher never sees it
 * created.
 */
static void
test_socket_appears_listening(void)
{
    g_autofree char *dir = g_dir_make_tmp("pf-listen-XXXXXX", NULL);
    g_autofree char *path = g_build_filename(dir, "ctl.sock", NULL);
    g_autoptr(GError) error = NULL;
    gboolean created = FALSE, moved = FALSE;
    char buf[4096] __attribute__((aligned(8)));
    int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK), fd, client;
    ssize_t got;

    g_assert_cmpint(in, >=, 0);
    g_assert_cmpint(inotify_add_watch(in, dir, IN_CREATE | IN_MOVED_TO), >=, 0);
    fd = pf_unix_listen(path, SOCK_STREAM, &error);
    g_assert_no_error(error);
    while ((got = read(in, buf, sizeof(buf))) > 0) {
        for (char *p = buf; p < buf + got;) {
            const struct inotify_event *ev = (const struct inotify_event *)p;

            if (ev->len > 0 && g_str_equal(ev->name, "ctl.sock")) {
                created |= (ev->mask & IN_CREATE) != 0;
                moved |= (ev->mask & IN_MOVED_TO) != 0;
            }
            p += sizeof(*ev) + ev->len;
        }
    }
    g_assert_false(created);
    g_assert_true(moved);
    client = client_connect(path);
    close(client);
    close(fd);
    close(in);
    g_unlink(path);
    g_rmdir(dir);
}

/* A client that connects while pagefoldd is still setting up (the agent
 * socket's group, the VMs attached before a restart) waits, ungreeted: the
 * greeting says pagefoldd is ready.  The control thread greeted at once,
 * and /kernel/6.1/link/agent-group found the agent socket still 0600. */
static void
test_greets_once_started(void)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *dir = g_dir_make_tmp("pagefold-control-XXXXXX", &error);
    g_autofree char *path = g_build_filename(dir, "s", NULL);
    g_autoptr(PfScanner) scanner = pf_scanner_new(NULL);
    g_autoptr(PfControl) c = pf_control_new(scanner, path, &error);
    struct pollfd p = { .fd = -1, .events = POLLIN };

    g_assert_no_error(error);
    p.fd = client_connect(path);
    g_assert_cmpint(poll(&p, 1, 300), ==, 0);
    pf_control_start(c);
    g_assert_cmpint(poll(&p, 1, 20000), ==, 1);
    close(p.fd);
    g_clear_pointer(&c, pf_control_free);
    g_rmdir(dir);
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/control/greets-once-started", test_greets_once_started);
    g_test_add_func("/control/socket-appears-listening", test_socket_appears_listening);
    g_test_add("/control/socket-mode", Fixture, NULL, setup, test_socket_mode, teardown);
    g_test_add("/control/attach-stats-detach", Fixture, NULL, setup, test_attach_stats_detach,
               teardown);
    g_test_add("/control/same-name", Fixture, NULL, setup, test_same_name, teardown);
    g_test_add("/control/attach-uuid", Fixture, NULL, setup, test_attach_uuid, teardown);
    g_test_add("/control/attach-merge-domain", Fixture, NULL, setup, test_attach_merge_domain,
               teardown);
    g_test_add("/control/bad-requests", Fixture, NULL, setup, test_bad_requests, teardown);
    g_test_add("/control/huge-request", Fixture, NULL, setup, test_huge_request, teardown);
    g_test_add("/control/clients", Fixture, NULL, setup, test_clients, teardown);
    g_test_add("/control/main-loop-busy", Fixture, NULL, setup, test_main_loop_busy, teardown);
    g_test_add("/control/half-close", Fixture, NULL, setup, test_half_close, teardown);
    g_test_add_func("/control/free-at-once", test_free_at_once);
    return g_test_run();
}
