/*
 * agent-helpers.c - the stand-in VMMs and pagefoldctl answers that the
 * agent suite's stand-in programs share (see agent-helpers.h).
 *
 * Owns: nothing past a call: every stand-in and pagefoldd is the calling
 * test's.  It must never hide a failure from the test (it asserts where
 * the test would), nor grow what testproc.c already offers.
 */
#include "agent-helpers.h"

#include <glib.h>

Vmm *
vmm_start(PfTestDaemon *d, const char *name, int seed, int writers, gboolean as_nobody)
{
    return vmm_start_full(d, name, seed, writers, as_nobody, NULL);
}

Vmm *
vmm_start_full(PfTestDaemon *d, const char *name, int seed, int writers, gboolean as_nobody,
               const char *extra)
{
    g_autofree char *guest = g_strdup_printf("guest=%s", name);
    g_autofree char *seedarg = g_strdup_printf("%d", seed);
    g_autofree char *wr = g_strdup_printf("%d", writers);
    g_autofree char *mib = g_strdup_printf("%d", MIB);
    g_auto(GStrv) extras = g_strsplit(extra != NULL ? extra : "", " ", 0);
    const char *argv[] = {
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket", d->agent_sock,
        "--mib", mib, "--seed", seedarg, "--writers", wr, "--writes-per-sec", "2000",
        extras[0], extras[0] != NULL ? extras[1] : NULL, NULL
    };
    Vmm *v;

    g_assert_true(extras[0] == NULL || extras[1] == NULL || extras[2] == NULL);
    v = pf_test_vmm_spawn(as_nobody ? argv : argv + 4);

    g_assert_nonnull(v);
    pf_test_daemon_wait_vmm(d, v);
    return v;
}

/* The agent sees its connection closed once it is done with the batch it
 * was serving (a full one takes a while under load), and the test may ask
 * before it has read the close. */
void
wait_disconnected(Vmm *v)
{
    for (int k = 0; k < 200 && pf_test_vmm_stat(v, "connected") != 0; k++) {
        g_usleep(50000);
    }
    g_assert_cmpint(pf_test_vmm_stat(v, "connected"), ==, 0);
}

JsonObject *
stats(PfTestDaemon *d, const char *cmd, const char *arg)
{
    JsonNode *n = pf_test_ctl_json(d, cmd, arg, NULL);
    JsonObject *o = json_object_ref(json_node_get_object(n));

    json_node_unref(n);
    return o;
}

gint64
total(JsonObject *s, const char *name)
{
    return json_object_get_int_member(json_object_get_object_member(s, "total"), name);
}

JsonObject *
vm_of(JsonObject *s, const char *name)
{
    return pf_test_find_vm(json_object_get_array_member(s, "vms"), name);
}

guint64
guest_addr(PfTestDaemon *d, const char *vm)
{
    JsonNode *n = pf_test_ctl_json(d, "list", NULL);
    JsonArray *a = json_node_get_array(n);
    guint64 addr = 0;

    for (guint i = 0; i < json_array_get_length(a); i++) {
        JsonObject *o = json_array_get_object_element(a, i);

        if (g_str_equal(json_object_get_string_member(o, "name"), vm)) {
            JsonArray *regions = json_object_get_array_member(o, "regions");

            addr = (guint64)json_object_get_int_member(json_array_get_object_element(regions, 0),
                                                       "host_addr");
        }
    }
    json_node_unref(n);
    return addr;
}

void
wait_merging(PfTestDaemon *d, const char *name)
{
    for (int i = 0; i < 600; i++) {
        g_autoptr(JsonObject) vm = pf_test_listed_vm(d, name);

        if (vm != NULL && g_str_equal(json_object_get_string_member(vm, "mode"), "merge")) {
            return;
        }
        g_usleep(50000);
    }
    g_error("VM %s is not back in merge mode within 30 s", name);
}

char *
listed_domain(PfTestDaemon *d, const char *name)
{
    g_autoptr(JsonObject) vm = pf_test_listed_vm(d, name);

    g_assert_nonnull(vm);
    return g_strdup(json_object_get_string_member(vm, "merge_domain"));
}

void
assert_back_in(PfTestDaemon *d, const char *name, const char *want)
{
    g_autofree char *domain = NULL;

    wait_merging(d, name);
    domain = listed_domain(d, name);
    g_test_message("%s: merge domain %s", name, domain);
    g_assert_cmpstr(domain, ==, want);
}

