/*
 * stats.c - KSM's counters attributed and shown (stats.h).  This file
 * formats and apportions; it never walks the trees itself (scan.c collects
 * the raw figures).
 */
#include "stats.h"

#include <math.h>
#include <stddef.h>

#include "escape.h"
#include "util.h"

typedef struct {
    const char *name;
    gsize offset;
    gboolean cumulative; /* a Prometheus counter (name gets _total) */
    gboolean is_signed;
    const char *help;
} CounterInfo;

#define C(field, cum, sig, help) \
    { #field, offsetof(PfCounters, field), cum, sig, help }

static const CounterInfo counters[] = {
    C(pages_shared, FALSE, FALSE, "Canonical pages in use"),
    C(pages_sharing, FALSE, FALSE, "Guest pages sharing a canonical page, beyond it: pages saved"),
    C(pages_unshared, FALSE, FALSE, "Unique pages repeatedly checked for merging"),
    C(pages_volatile, FALSE, FALSE, "Pages changing too fast to be placed in a tree"),
    C(pages_skipped, TRUE, FALSE, "Page visits skipped by smart scan"),
    C(pages_scanned, TRUE, FALSE, "Page visits"),
    C(full_scans, TRUE, FALSE, "Completed passes over all guest RAM"),
    C(zero_pages, FALSE, FALSE, "All-zero guest pages"),
    C(pages_pending, FALSE, FALSE, "Pages an agent is merging or unmerging"),
    C(cow, TRUE, FALSE, "Merged pages written by the guest (copy-on-write)"),
    C(backend_fold_backs, TRUE, FALSE,
      "Merged pages folded back because a vhost-user back-end touched them"),
    C(vmas, FALSE, FALSE, "Mappings of the VM process"),
    C(pages_hinted, TRUE, FALSE, "Page visits made first, as a device had just written the page"),
    C(hints_dropped, TRUE, FALSE, "Pages a device wrote not visited first: more than pagefoldd keeps for a VM"),
    C(pages_tracked, FALSE, FALSE, "Guest pages with a scan record"),
    C(metadata_bytes, FALSE, FALSE, "Bytes of pagefold metadata"),
    C(general_profit, FALSE, TRUE, "Bytes saved minus metadata bytes"),
};

#undef C

const char *const *
pf_counter_names(void)
{
    static const char *n[G_N_ELEMENTS(counters) + 1];

    if (n[0] == NULL) {
        for (gsize i = 0; i < G_N_ELEMENTS(counters); i++) {
            n[i] = counters[i].name;
        }
    }
    return n;
}

typedef struct {
    double remainder;
    gsize index;
} Remainder;

static gint
remainder_cmp(gconstpointer a, gconstpointer b)
{
    const Remainder *ra = a, *rb = b;

    if (ra->remainder != rb->remainder) {
        return ra->remainder > rb->remainder ? -1 : 1;
    }
    return ra->index < rb->index ? -1 : (ra->index > rb->index);
}

void
pf_apportion(guint64 total, const double *shares, gsize n, guint64 *parts)
{
    g_autofree Remainder *rem = g_new0(Remainder, MAX(n, 1));
    double sum = 0;
    guint64 given = 0;

    for (gsize i = 0; i < n; i++) {
        sum += shares[i];
    }
    for (gsize i = 0; i < n; i++) {
        double exact = sum > 0 ? shares[i] * (double)total / sum : 0;
        double fl = floor(exact);

        parts[i] = (guint64)fl;
        given += parts[i];
        rem[i].remainder = exact - fl;
        rem[i].index = i;
    }
    if (n == 0) {
        return;
    }
    /* The floors leave at most n units to hand out, largest remainder
     * first; floating error can also leave one unit too many. */
    qsort(rem, n, sizeof(Remainder), remainder_cmp);
    for (gsize k = 0; given < total; k = (k + 1) % n) {
        parts[rem[k].index]++;
        given++;
    }
    for (gsize k = n; given > total; k = k == 1 ? n : k - 1) {
        gsize i = rem[k - 1].index;

        if (parts[i] > 0) {
            parts[i]--;
            given--;
        }
    }
}

static guint64 *
field_u(PfCounters *c, const CounterInfo *ci)
{
    return (guint64 *)((char *)c + ci->offset);
}

void
pf_counters_add(PfCounters *sum, const PfCounters *c)
{
    for (gsize i = 0; i < G_N_ELEMENTS(counters); i++) {
        if (counters[i].is_signed) {
            *(gint64 *)((char *)sum + counters[i].offset) +=
                *(const gint64 *)((const char *)c + counters[i].offset);
        } else {
            *field_u(sum, &counters[i]) += *field_u((PfCounters *)c, &counters[i]);
        }
    }
}

guint64
pf_counters_saved_bytes(const PfCounters *c)
{
    return (c->pages_sharing + c->zero_pages) * PF_PAGE_SIZE;
}

void
pf_counters_to_json(const PfCounters *c, JsonBuilder *b)
{
    for (gsize i = 0; i < G_N_ELEMENTS(counters); i++) {
        const char *p = (const char *)c + counters[i].offset;

        json_builder_set_member_name(b, counters[i].name);
        if (counters[i].is_signed) {
            json_builder_add_int_value(b, *(const gint64 *)p);
        } else {
            json_builder_add_int_value(b, (gint64) * (const guint64 *)p);
        }
    }
}

static gint64
member_int(JsonObject *o, const char *name)
{
    return o && json_object_has_member(o, name)
               ? json_object_get_int_member(o, name) : 0;
}

static const char *
member_str(JsonObject *o, const char *name)
{
    return o && json_object_has_member(o, name)
               ? json_object_get_string_member(o, name) : "";
}

static double
saved_mib(JsonObject *o)
{
    PfCounters c = {
        .pages_sharing = (guint64)member_int(o, "pages_sharing"),
        .zero_pages = (guint64)member_int(o, "zero_pages"),
    };

    return (double)pf_counters_saved_bytes(&c) / (1024.0 * 1024.0);
}

static void
table_row(GString *out, const char *name, const char *pid, const char *mode,
          JsonObject *o)
{
    /* A table is for a terminal: a VM's name may be an agent's words. */
    g_autofree char *shown_name = pf_escape_text(name, -1);
    g_autofree char *shown_mode = pf_escape_text(mode, -1);

    g_string_append_printf(out,
        "%-20s %7s %-7s %10" G_GINT64_FORMAT " %10" G_GINT64_FORMAT
        " %10" G_GINT64_FORMAT " %10" G_GINT64_FORMAT " %10" G_GINT64_FORMAT
        " %6" G_GINT64_FORMAT " %10.1f\n",
        shown_name, pid, shown_mode, member_int(o, "pages_shared"),
        member_int(o, "pages_sharing"), member_int(o, "pages_unshared"),
        member_int(o, "pages_volatile"), member_int(o, "zero_pages"),
        member_int(o, "full_scans"), saved_mib(o));
}

char *
pf_stats_format_table(JsonObject *stats, gboolean with_total)
{
    GString *out = g_string_new(NULL);
    JsonArray *vms = json_object_get_array_member(stats, "vms");
    JsonObject *total = json_object_get_object_member(stats, "total");
    const char *mode = member_str(stats, "mode");

    g_string_append_printf(out, "pagefold mode: %s   hash: %s   copy-on-write seen by: %s   "
                           "pool: %" G_GINT64_FORMAT " slots, %.1f MiB in %" G_GINT64_FORMAT
                           " chunks\n", mode,
                           member_str(stats, "hash"), member_str(stats, "cow_detection"),
                           member_int(stats, "pool_slots"),
                           (double)member_int(stats, "pool_bytes") / 1048576.0,
                           member_int(stats, "pool_chunks"));
    g_string_append_printf(out, "%-20s %7s %-7s %10s %10s %10s %10s %10s %6s %10s\n",
                           "VM", "PID", "MODE", "SHARED", "SHARING", "UNSHARED",
                           "VOLATILE", "ZERO", "SCANS", "SAVED_MIB");
    for (guint i = 0; vms != NULL && i < json_array_get_length(vms); i++) {
        JsonObject *vm = json_array_get_object_element(vms, i);
        g_autofree char *pid = g_strdup_printf("%" G_GINT64_FORMAT,
                                               member_int(vm, "pid"));

        table_row(out, member_str(vm, "name"), pid, member_str(vm, "mode"), vm);
    }
    if (with_total) {
        table_row(out, "TOTAL", "-", mode, total);
    }
    return g_string_free(out, FALSE);
}

static void
prom_escape(GString *out, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\' || *s == '"') {
            g_string_append_c(out, '\\');
            g_string_append_c(out, *s);
        } else if (*s == '\n') {
            g_string_append(out, "\\n");
        } else {
            g_string_append_c(out, *s);
        }
    }
}

/* What each merge domain's VMs save, in bytes: where one tenant's VMs
 * are a merge domain, what merging is worth to that tenant. */
static void
prom_domains(GString *out, JsonArray *vms)
{
    g_autoptr(GHashTable) saved = g_hash_table_new_full(g_str_hash, g_str_equal, NULL, g_free);
    g_autoptr(GList) names = NULL;

    g_string_append(out, "# HELP pagefold_merge_domain_saved_bytes Bytes the VMs of a merge "
                         "domain save (pages_sharing and zero_pages)\n"
                         "# TYPE pagefold_merge_domain_saved_bytes gauge\n");
    for (guint v = 0; vms != NULL && v < json_array_get_length(vms); v++) {
        JsonObject *vm = json_array_get_object_element(vms, v);
        const char *domain = member_str(vm, "merge_domain");
        PfCounters c = {
            .pages_sharing = (guint64)member_int(vm, "pages_sharing"),
            .zero_pages = (guint64)member_int(vm, "zero_pages"),
        };
        guint64 *sum;

        if (domain == NULL) {
            continue;
        }
        if ((sum = g_hash_table_lookup(saved, domain)) == NULL) {
            sum = g_new0(guint64, 1);
            g_hash_table_insert(saved, (gpointer)domain, sum);
        }
        *sum += pf_counters_saved_bytes(&c);
    }
    names = g_list_sort(g_hash_table_get_keys(saved), (GCompareFunc)strcmp);
    for (GList *e = names; e != NULL; e = e->next) {
        g_string_append(out, "pagefold_merge_domain_saved_bytes{merge_domain=\"");
        prom_escape(out, e->data);
        g_string_append_printf(out, "\"} %" G_GUINT64_FORMAT "\n",
                               *(guint64 *)g_hash_table_lookup(saved, e->data));
    }
}

char *
pf_stats_format_prometheus(JsonObject *stats)
{
    GString *out = g_string_new(NULL);
    JsonArray *vms = json_object_get_array_member(stats, "vms");
    JsonObject *total = json_object_get_object_member(stats, "total");
    guint n_vms = vms ? json_array_get_length(vms) : 0;

    g_string_append(out, "# HELP pagefold_info pagefoldd's mode and checksum\n"
                         "# TYPE pagefold_info gauge\npagefold_info{mode=\"");
    prom_escape(out, member_str(stats, "mode"));
    g_string_append(out, "\",hash=\"");
    prom_escape(out, member_str(stats, "hash"));
    g_string_append(out, "\"} 1\n");
    for (gsize i = 0; i < G_N_ELEMENTS(counters); i++) {
        const CounterInfo *ci = &counters[i];
        g_autofree char *metric = g_strdup_printf(
            "pagefold_%s%s", ci->name, ci->cumulative ? "_total" : "");

        g_string_append_printf(out, "# HELP %s %s (unlabelled: all VMs)\n"
                               "# TYPE %s %s\n", metric, ci->help, metric,
                               ci->cumulative ? "counter" : "gauge");
        for (guint v = 0; v < n_vms; v++) {
            JsonObject *vm = json_array_get_object_element(vms, v);

            /* Names are labels two VMs may share: the pid tells them
             * apart.  The UUID (libvirt's, QEMU's -uuid), where the VM
             * has one, is what survives a restart of its QEMU. */
            g_string_append_printf(out, "%s{vm=\"", metric);
            prom_escape(out, member_str(vm, "name"));
            g_string_append_printf(out, "\",pid=\"%" G_GINT64_FORMAT "\",",
                                   member_int(vm, "pid"));
            if (member_str(vm, "uuid") != NULL && *member_str(vm, "uuid") != '\0') {
                g_string_append(out, "uuid=\"");
                prom_escape(out, member_str(vm, "uuid"));
                g_string_append(out, "\",");
            }
            g_string_append(out, "mode=\"");
            prom_escape(out, member_str(vm, "mode"));
            g_string_append_printf(out, "\"} %" G_GINT64_FORMAT "\n",
                                   member_int(vm, ci->name));
        }
        g_string_append_printf(out, "%s %" G_GINT64_FORMAT "\n", metric,
                               member_int(total, ci->name));
    }
    prom_domains(out, vms);
    return g_string_free(out, FALSE);
}
