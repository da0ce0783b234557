/*
 * stats-test.c - attribution adds up exactly, and the output formats keep
 * KSM's names.
 */
#include <glib.h>
#include <string.h>

#include "stats.h"

static void
test_apportion_exact(void)
{
    /* Three VMs sharing 10 canonical pages as thirds. */
    double thirds[] = { 10.0 / 3, 10.0 / 3, 10.0 / 3 };
    double skewed[] = { 0.953125, 0, 2.046875, 0.5, 0.5 };
    guint64 parts[5];

    pf_apportion(10, thirds, 3, parts);
    g_assert_cmpuint(parts[0] + parts[1] + parts[2], ==, 10);
    g_assert_cmpuint(parts[0], ==, 4); /* ties go to the first */
    g_assert_cmpuint(parts[1], ==, 3);

    pf_apportion(4, skewed, 5, parts);
    g_assert_cmpuint(parts[0], ==, 1);
    g_assert_cmpuint(parts[1], ==, 0);
    g_assert_cmpuint(parts[2], ==, 2);
    g_assert_cmpuint(parts[3] + parts[4], ==, 1);

    for (int round = 0; round < 1000; round++) {
        double s[7];
        guint64 p[7], sum = 0, total = g_random_int_range(0, 100000);

        for (int i = 0; i < 7; i++) {
            s[i] = g_random_double() * 1000;
        }
        pf_apportion(total, s, 7, p);
        for (int i = 0; i < 7; i++) {
            sum += p[i];
        }
        g_assert_cmpuint(sum, ==, total);
    }
}

static JsonObject *
sample(void)
{
    static const char text[] =
        "{\"mode\":\"advise\",\"hash\":\"xxh3\",\"total\":{\"pages_shared\":3,"
        "\"pages_sharing\":5,\"zero_pages\":2,\"full_scans\":7,\"pages_scanned\":99},"
        "\"vms\":[{\"name\":\"a \\\"q\\\"\",\"pid\":10,\"mode\":\"advise\",\"merge_domain\":\"red\","
        "\"pages_shared\":2,"
        "\"pages_sharing\":1,\"zero_pages\":2,\"full_scans\":7,\"pages_scanned\":50},"
        "{\"name\":\"b\",\"pid\":11,\"uuid\":\"c7a5fdbd-cdaf-9455-926a-d65c16db1809\","
        "\"merge_domain\":\"default\","
        "\"mode\":\"advise\",\"pages_shared\":1,\"pages_sharing\":4,"
        "\"full_scans\":7,\"pages_scanned\":49}]}";
    g_autoptr(JsonParser) p = json_parser_new();

    g_assert_true(json_parser_load_from_data(p, text, -1, NULL));
    return json_object_ref(json_node_get_object(json_parser_get_root(p)));
}

static void
test_prometheus(void)
{
    g_autoptr(JsonObject) o = sample();
    g_autofree char *text = pf_stats_format_prometheus(o);

    g_assert_nonnull(strstr(text, "pagefold_info{mode=\"advise\",hash=\"xxh3\"} 1\n"));
    g_assert_nonnull(strstr(text, "# TYPE pagefold_pages_sharing gauge\n"));
    g_assert_nonnull(strstr(text, "pagefold_pages_sharing{vm=\"a \\\"q\\\"\",pid=\"10\",mode=\"advise\"} 1\n"));
    /* A VM with a UUID (libvirt's) has it as a label too. */
    g_assert_nonnull(strstr(text, "pagefold_pages_sharing{vm=\"b\",pid=\"11\","
                                  "uuid=\"c7a5fdbd-cdaf-9455-926a-d65c16db1809\","
                                  "mode=\"advise\"} 4\n"));
    g_assert_nonnull(strstr(text, "pagefold_pages_sharing 5\n"));
    g_assert_nonnull(strstr(text, "# TYPE pagefold_full_scans_total counter\n"));
    g_assert_nonnull(strstr(text, "pagefold_pages_scanned_total{vm=\"b\",pid=\"11\","
                                  "uuid=\"c7a5fdbd-cdaf-9455-926a-d65c16db1809\","
                                  "mode=\"advise\"} 49\n"));
    g_assert_null(strstr(text, "pagefold_pages_shared_total"));
    /* Per merge domain: a's 1 page sharing and 2 zero pages, b's 4. */
    g_assert_nonnull(strstr(text, "# TYPE pagefold_merge_domain_saved_bytes gauge\n"));
    g_assert_nonnull(strstr(text, "pagefold_merge_domain_saved_bytes{merge_domain=\"default\"} "
                                  "16384\n"));
    g_assert_nonnull(strstr(text, "pagefold_merge_domain_saved_bytes{merge_domain=\"red\"} "
                                  "12288\n"));
}

static void
test_table(void)
{
    g_autoptr(JsonObject) o = sample();
    g_autofree char *text = pf_stats_format_table(o, TRUE);

    g_assert_true(g_str_has_prefix(text, "pagefold mode: advise"));
    g_assert_nonnull(strstr(text, "SHARING"));
    g_assert_nonnull(strstr(text, "TOTAL"));
    g_clear_pointer(&text, g_free);
    /* One VM asked for: its row, not the host's. */
    text = pf_stats_format_table(o, FALSE);
    g_assert_null(strstr(text, "TOTAL"));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/stats/apportion-exact", test_apportion_exact);
    g_test_add_func("/stats/prometheus", test_prometheus);
    g_test_add_func("/stats/table", test_table);
    return g_test_run();
}
