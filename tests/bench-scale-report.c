/*
 * bench-scale-report.c - what the scale benchmark writes out
 * (bench-scale.h): one JSON line per case, its figures from a phase's
 * samples, then a markdown table of every case, a "growth" line per
 * series (each quantity against RAM: linear or not), and a data file and
 * gnuplot script (scale.png where gnuplot is installed).
 *
 * Owns the output's form.  Must never drive pagefoldd or the stand-ins
 * (it sends them nothing), nor judge a case: whether one failed is for
 * the case to say (bench-scale.c), and what is printed is what was
 * measured.
 */
#include "bench-scale.h"

#include <math.h>
#include <stdio.h>

#define GIB_F (1024.0 * 1024.0 * 1024.0)

/* ---- JSON lines ---- */

void
add_double(JsonBuilder *b, const char *name, double v)
{
    json_builder_set_member_name(b, name);
    if (isfinite(v)) {
        json_builder_add_double_value(b, round(v * 1000) / 1000);
    } else {
        json_builder_add_null_value(b);
    }
}

void
add_int(JsonBuilder *b, const char *name, gint64 v)
{
    json_builder_set_member_name(b, name);
    json_builder_add_int_value(b, v);
}

void
add_bool(JsonBuilder *b, const char *name, gboolean v)
{
    json_builder_set_member_name(b, name);
    json_builder_add_boolean_value(b, v);
}

void
add_str(JsonBuilder *b, const char *name, const char *v)
{
    json_builder_set_member_name(b, name);
    if (v != NULL) {
        json_builder_add_string_value(b, v);
    } else {
        json_builder_add_null_value(b);
    }
}

/* The figures of one phase: passes, CPU, metadata, memory, stalls. */
void
phase_to_json(Case *c, Phase *ph, double base_mib, JsonBuilder *b, Row *row)
{
    GArray *v = ph->samples;
    Sample *f = &g_array_index(v, Sample, 0), *l = &g_array_index(v, Sample, v->len - 1);
    double t_first_inc = -1, t_last_inc = -1, peak_anon = 0, peak_fp = 0;
    gint64 scans_first_inc = 0, scans_last_inc = 0, max_pass_usec = 0, vmas_max = 0;
    double gib_scanned = (double)(l->pages_scanned - f->pages_scanned) * 4096.0 / GIB_F;
    double cpu = l->cpu_s - f->cpu_s;
    Stall stall = probe_take(c->probe);
    JsonArray *vms = c->last_stats ? json_object_get_array_member(c->last_stats, "vms") : NULL;
    double mean_pass;

    for (guint i = 1; i < v->len; i++) {
        Sample *x = &g_array_index(v, Sample, i), *p = &g_array_index(v, Sample, i - 1);

        if (x->full_scans > p->full_scans) {
            if (t_first_inc < 0) {
                t_first_inc = x->t;
                scans_first_inc = x->full_scans;
            }
            t_last_inc = x->t;
            scans_last_inc = x->full_scans;
        }
    }
    for (guint i = 0; i < v->len; i++) {
        Sample *x = &g_array_index(v, Sample, i);

        max_pass_usec = MAX(max_pass_usec, x->last_pass_usec);
        peak_anon = MAX(peak_anon, x->anon_mib);
        peak_fp = MAX(peak_fp, x->footprint_mib);
        vmas_max = MAX(vmas_max, x->vmas_max);
    }
    mean_pass = scans_last_inc > scans_first_inc
                    ? (t_last_inc - t_first_inc) / (double)(scans_last_inc - scans_first_inc)
                    : NAN;
    add_bool(b, "complete", ph->complete);
    add_str(b, "ended", ph->end);
    add_double(b, "elapsed_s", l->t);
    add_int(b, "passes", l->full_scans - f->full_scans);
    add_double(b, "first_pass_s", t_first_inc);
    add_double(b, "mean_pass_s", mean_pass);
    add_double(b, "last_pass_ms", (double)l->last_pass_usec / 1000.0);
    add_double(b, "max_pass_ms", (double)max_pass_usec / 1000.0);
    add_double(b, "cpu_s", cpu);
    add_double(b, "gib_scanned", gib_scanned);
    add_double(b, "cpu_s_per_gib", gib_scanned > 0 ? cpu / gib_scanned : NAN);
    add_int(b, "pages_tracked", l->tracked);
    add_int(b, "metadata_bytes", l->metadata);
    add_double(b, "metadata_per_page", l->tracked > 0 ? (double)l->metadata / l->tracked : NAN);
    json_builder_set_member_name(b, "metadata_per_page_vm");
    json_builder_begin_array(b);
    for (int i = 0; i < c->n_vms; i++) {
        JsonObject *vm = vm_by_pid(vms, c->vmm[i]->pid);
        gint64 tr = member(vm, "pages_tracked");

        if (vm != NULL && tr > 0) {
            json_builder_add_double_value(
                b, round((double)member(vm, "metadata_bytes") / tr * 100) / 100);
        } else {
            json_builder_add_null_value(b);
        }
    }
    json_builder_end_array(b);
    add_int(b, "vmas_max", vmas_max);
    add_double(b, "pagefoldd_rss_anon_mib", l->anon_mib);
    add_double(b, "pagefoldd_rss_anon_peak_mib", peak_anon);
    add_double(b, "pagefoldd_vmrss_mib",
               (double)proc_kib(c->daemon_pid, "status", "VmRSS") / 1024.0);
    add_double(b, "pagefoldd_vmhwm_mib",
               (double)proc_kib(c->daemon_pid, "status", "VmHWM") / 1024.0);
    add_double(b, "footprint_before_mib", base_mib);
    add_double(b, "footprint_peak_mib", peak_fp);
    add_double(b, "footprint_after_mib", l->footprint_mib);
    add_double(b, "freed_mib", base_mib - l->footprint_mib);
    add_double(b, "freed_net_mib", base_mib - l->footprint_mib - (l->anon_mib - f->anon_mib));
    add_double(b, "t90_s", ph->t90_s);
    add_int(b, "pages_shared", l->shared);
    add_int(b, "pages_sharing", l->sharing);
    add_int(b, "zero_pages", l->zero);
    add_int(b, "pages_unshared", l->unshared);
    add_int(b, "pages_pending", l->pending);
    add_int(b, "cow", l->cow - f->cow);
    add_double(b, "stall_max_ms", stall.max_ms);
    add_double(b, "stall_p99_ms", stall.p99_ms);
    add_int(b, "stall_samples", stall.n);
    add_int(b, "stall_over_100ms", stall.over);
    add_bool(b, "stall_unanswered", stall.unanswered);
    add_str(b, "stall_probe_error", stall.error);
    add_bool(b, "control_ok", stall.over == 0 && stall.error == NULL && !c->control_lost);

    row->complete = ph->complete;
    row->passes = l->full_scans - f->full_scans;
    /* The longest pass, not the last: once merged, a pass steps over
     * holes and says little about scanning RAM. */
    row->pass_ms = (double)max_pass_usec / 1000.0;
    row->cpu_per_gib = gib_scanned > 0 ? cpu / gib_scanned : NAN;
    row->meta_per_page = l->tracked > 0 ? (double)l->metadata / l->tracked : NAN;
    row->pfd_anon_mib = l->anon_mib;
    row->stall_max_ms = stall.max_ms;
    row->stall_p99_ms = stall.p99_ms;
    row->freed_mib = base_mib - l->footprint_mib;
    row->t90_s = ph->t90_s;
    row->control_ok = stall.over == 0 && stall.error == NULL && !c->control_lost;
    g_free(stall.error);
}

/* json-glib writes doubles with 17 digits: 5.1799999999999997. */
static gboolean
shorten_number(const GMatchInfo *m, GString *out, gpointer user)
{
    g_autofree char *num = g_match_info_fetch(m, 0);
    char buf[G_ASCII_DTOSTR_BUF_SIZE];

    g_string_append(out, g_ascii_formatd(buf, sizeof(buf), "%.6g", g_ascii_strtod(num, NULL)));
    return FALSE;
}

void
print_builder(JsonBuilder *b)
{
    g_autoptr(JsonNode) root = json_builder_get_root(b);
    g_autofree char *text = json_to_string(root, FALSE);
    g_autoptr(GRegex) re = g_regex_new("(?<![\\w.])-?[0-9]+\\.[0-9]{7,}(e[-+]?[0-9]+)?", 0, 0,
                                       NULL);
    g_autofree char *shorter = g_regex_replace_eval(re, text, -1, 0, 0, shorten_number, NULL, NULL);

    printf("%s\n", shorter != NULL ? shorter : text);
    fflush(stdout);
}

void
begin_line(JsonBuilder *b, const char *workload, int gib, int vms, int vm_mib)
{
    json_builder_begin_object(b);
    add_str(b, "bench", "scale");
    add_str(b, "vmm", "standin-vmm (stand-in for QEMU)");
    add_str(b, "workload", workload);
    add_int(b, "total_gib", gib);
    add_int(b, "vms", vms);
    add_int(b, "vm_mib", vm_mib);
}

Row *
row_new(GPtrArray *rows, const char *workload, int gib, int vms)
{
    Row *r = g_new0(Row, 1);

    r->workload = g_strdup(workload);
    r->gib = gib;
    r->vms = vms;
    r->t90_s = -1;
    g_ptr_array_add(rows, r);
    return r;
}

void
row_free(gpointer p)
{
    Row *r = p;

    g_free(r->workload);
    g_free(r->why);
    g_free(r);
}

/* The line of a case that did not run: "skipped" (it would not fit) or
 * "failed" (it could not be set up), and why. */
void
status_line(GPtrArray *rows, const char *workload, int gib, int vms, int vm_mib,
            const char *status, const char *why)
{
    g_autoptr(JsonBuilder) b = json_builder_new();
    Row *r = row_new(rows, workload, gib, vms);

    r->skipped = g_str_equal(status, "skipped");
    r->failed = !r->skipped;
    r->why = g_strdup(why);
    begin_line(b, workload, gib, vms, vm_mib);
    add_bool(b, status, TRUE);
    add_str(b, "why", why);
    json_builder_end_object(b);
    print_builder(b);
}

/* ---- summary: table, growth, plot ---- */

static const char *
fmt(char *buf, gsize len, double v, int decimals)
{
    if (!isfinite(v) || v < 0) {
        return "-";
    }
    g_snprintf(buf, len, "%.*f", decimals, v);
    return buf;
}

void
print_table(GPtrArray *rows)
{
    printf("\n| workload | GiB | VMs | status | passes | longest pass ms | CPU s/GiB "
           "| metadata B/page | pagefoldd anon MiB | freed MiB (%% of expected) | t90 s "
           "| stall max / p99 ms | control_ok | attached | verify |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (guint i = 0; i < rows->len; i++) {
        Row *r = g_ptr_array_index(rows, i);
        char a[32], b[32], c[32], d[32], e[32], f[32], g[32], h[32];

        if (r->skipped || (r->failed && r->passes == 0 && r->why != NULL)) {
            printf("| %s | %d | %d | %s: %s | | | | | | | | | | | |\n", r->workload, r->gib,
                   r->vms, r->skipped ? "skipped" : "FAILED", r->why);
            continue;
        }
        printf("| %s | %d | %d | %s | %" G_GINT64_FORMAT " | %s | %s | %s | %s | %.0f (%s%%) | %s "
               "| %s / %s | %s | %s | %s |\n",
               r->workload, r->gib, r->vms,
               r->failed ? "FAILED" : r->complete ? "ok" : "incomplete", r->passes,
               fmt(a, sizeof(a), r->pass_ms, 0), fmt(b, sizeof(b), r->cpu_per_gib, 2),
               fmt(c, sizeof(c), r->meta_per_page, 1),
               fmt(d, sizeof(d), r->pfd_anon_mib, 1), r->freed_mib,
               fmt(e, sizeof(e), r->expected_mib > 0 ? 100 * r->freed_mib / r->expected_mib : NAN,
                   0),
               fmt(f, sizeof(f), r->t90_s, 1), fmt(g, sizeof(g), r->stall_max_ms, 0),
               fmt(h, sizeof(h), r->stall_p99_ms, 0), r->control_ok ? "yes" : "**no**",
               r->attached ? "yes" : "**no**", r->verify_ok ? "ok" : "**FAIL**");
    }
}

/* How q grew against RAM (ram_x times more): per_unit quantities are per
 * GiB or per page, so their total is q times RAM. */
static const char *
growth_kind(double q_x, double ram_x, gboolean per_unit)
{
    double total_x = per_unit ? q_x * ram_x : q_x;

    if (!isfinite(total_x) || total_x <= 0) {
        return "unknown";
    }
    if (!per_unit && total_x <= 1.5) {
        return "flat";
    }
    if (total_x > 1.5 * ram_x) {
        return "superlinear";
    }
    if (total_x < ram_x / 1.5) {
        return "sublinear";
    }
    return "linear";
}

static double
row_value(Row *r, int k)
{
    switch (k) {
    case 0: return r->pass_ms;
    case 1: return r->cpu_per_gib;
    case 2: return r->meta_per_page;
    case 3: return r->pfd_anon_mib;
    case 4: return r->stall_max_ms;
    default: return r->stall_p99_ms;
    }
}

static const struct {
    const char *name, *label;
    gboolean per_unit;
} quantities[] = {
    { "max_pass_ms", "longest full pass (ms)", FALSE },
    { "cpu_s_per_gib", "pagefoldd CPU s per GiB scanned", TRUE },
    { "metadata_per_page", "metadata bytes per tracked page", TRUE },
    { "pagefoldd_rss_anon_mib", "pagefoldd RssAnon (MiB)", FALSE },
    { "stall_max_ms", "longest control round trip (ms)", FALSE },
    { "stall_p99_ms", "p99 control round trip (ms)", FALSE },
};

/* Rows of one series (workload, VM count) that ran, by RAM. */
static GPtrArray *
series(GPtrArray *rows, const char *workload, int vms)
{
    GPtrArray *s = g_ptr_array_new();

    for (guint i = 0; i < rows->len; i++) {
        Row *r = g_ptr_array_index(rows, i);

        if (!r->skipped && r->passes > 0 && r->vms == vms && g_str_equal(r->workload, workload)) {
            g_ptr_array_add(s, r);
        }
    }
    return s;
}

void
print_growth(GPtrArray *rows, const char *const *workloads, const int *vm_counts, guint n_vc)
{
    printf("\n");
    for (guint w = 0; workloads[w] != NULL; w++) {
        for (guint v = 0; v < n_vc; v++) {
            g_autoptr(GPtrArray) s = series(rows, workloads[w], vm_counts[v]);
            g_autoptr(JsonBuilder) b = json_builder_new();
            g_autoptr(GString) text = g_string_new(NULL);
            Row *lo, *hi;
            double ram_x;

            if (s->len < 2) {
                continue;
            }
            lo = g_ptr_array_index(s, 0);
            hi = g_ptr_array_index(s, s->len - 1);
            ram_x = (double)hi->gib / lo->gib;
            json_builder_begin_object(b);
            add_str(b, "bench", "scale");
            add_str(b, "growth", workloads[w]);
            add_int(b, "vms", vm_counts[v]);
            add_int(b, "from_gib", lo->gib);
            add_int(b, "to_gib", hi->gib);
            g_string_printf(text, "growth %s, %d VM(s), %d -> %d GiB (x%.0f):", workloads[w],
                            vm_counts[v], lo->gib, hi->gib, ram_x);
            for (gsize k = 0; k < G_N_ELEMENTS(quantities); k++) {
                double x = row_value(hi, (int)k) / row_value(lo, (int)k);
                const char *kind = growth_kind(x, ram_x, quantities[k].per_unit);

                json_builder_set_member_name(b, quantities[k].name);
                json_builder_begin_object(b);
                add_double(b, "ratio", x);
                add_str(b, "kind", kind);
                json_builder_end_object(b);
                g_string_append_printf(text, " %s x%.2f (%s%s);", quantities[k].name, x, kind,
                                       quantities[k].per_unit ? " in total" : "");
            }
            json_builder_end_object(b);
            print_builder(b);
            printf("%s\n", text->str);
        }
    }
}

/* scale.dat (one block per workload and VM count), scale.gp, and
 * scale.png when gnuplot is there. */
void
write_plot(GPtrArray *rows, const char *const *workloads, const int *vm_counts, guint n_vc,
           const char *knob_spec)
{
    const char *out = g_getenv("BENCH_SCALE_OUT");
    const char *build_dir = g_getenv("PAGEFOLD_BUILD_DIR");
    g_autofree char *dir = g_strdup(out ? out : build_dir ? build_dir : ".");
    g_autofree char *dat = g_build_filename(dir, "scale.dat", NULL);
    g_autofree char *gp = g_build_filename(dir, "scale.gp", NULL);
    g_autofree char *png = g_build_filename(dir, "scale.png", NULL);
    g_autofree char *gnuplot = g_find_program_in_path("gnuplot");
    g_autoptr(GString) data = g_string_new("# bench-scale: pagefoldd against standin-vmm "
                                           "(stand-in for QEMU); knobs ");
    g_autoptr(GString) script = g_string_new(NULL);
    g_autoptr(GPtrArray) titles = g_ptr_array_new_with_free_func(g_free);
    g_autoptr(GArray) colours = g_array_new(FALSE, FALSE, sizeof(int));
    g_autoptr(GArray) dashes = g_array_new(FALSE, FALSE, sizeof(int));
    g_autoptr(GError) error = NULL;

    g_string_append_printf(data, "%s\n# columns: total_gib max_pass_ms cpu_s_per_gib "
                           "metadata_per_page pagefoldd_rss_anon_mib stall_max_ms stall_p99_ms\n",
                           knob_spec);
    for (guint w = 0; workloads[w] != NULL; w++) {
        for (guint v = 0; v < n_vc; v++) {
            g_autoptr(GPtrArray) s = series(rows, workloads[w], vm_counts[v]);
            int colour = (int)v + 1, dash = (int)w + 1;

            if (s->len == 0) {
                continue;
            }
            g_string_append_printf(data, "# %s, %d VM(s)\n", workloads[w], vm_counts[v]);
            for (guint i = 0; i < s->len; i++) {
                Row *r = g_ptr_array_index(s, i);

                g_string_append_printf(data, "%d", r->gib);
                for (int k = 0; k < 6; k++) {
                    double x = row_value(r, k);

                    if (isfinite(x)) {
                        g_string_append_printf(data, " %.4g", x);
                    } else {
                        g_string_append(data, " NaN");
                    }
                }
                g_string_append_c(data, '\n');
            }
            g_string_append(data, "\n\n");
            g_ptr_array_add(titles, g_strdup_printf("%s, %d VM%s", workloads[w], vm_counts[v],
                                                    vm_counts[v] > 1 ? "s" : ""));
            g_array_append_val(colours, colour);
            g_array_append_val(dashes, dash);
        }
    }
    g_string_append_printf(script,
        "# bench-scale's plot: gnuplot %s\n"
        "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
        "    set terminal pngcairo size 1500,950 font ',9'\n"
        "} else {\n"
        "    set terminal png size 1500,950\n"
        "}\n"
        "set termoption noenhanced\n" /* knob names have underscores */
        "set output '%s'\n"
        "set multiplot layout 2,3 title 'pagefoldd at scale: stand-in VMMs (standin-vmm in place "
        "of QEMU), knobs %s'\n"
        "set logscale x 2\nset xlabel 'total guest RAM (GiB)'\nset key top left\nset grid\n",
        "scale.gp", "scale.png", knob_spec);
    for (int k = 0; k < 6; k++) {
        g_string_append_printf(script, "set title '%s'\nset ylabel '%s'\nplot ",
                               quantities[k].label, quantities[k].label);
        for (guint i = 0; i < titles->len; i++) {
            g_string_append_printf(script,
                                   "%s'scale.dat' index %u using 1:%d with linespoints lc %d dt %d "
                                   "pt %d title '%s'", i ? ", \\\n     " : "", i, k + 2,
                                   g_array_index(colours, int, i), g_array_index(dashes, int, i),
                                   g_array_index(dashes, int, i) + 4,
                                   (char *)g_ptr_array_index(titles, i));
        }
        if (titles->len == 0) {
            g_string_append(script, "NaN notitle");
        }
        g_string_append(script, "\n");
    }
    g_string_append(script, "unset multiplot\n");
    if (!g_file_set_contents(dat, data->str, -1, &error) ||
        !g_file_set_contents(gp, script->str, -1, &error)) {
        g_printerr("bench-scale: cannot write the plot files: %s\n", error->message);
        return;
    }
    printf("\nplot data: %s\nplot script: %s\n", dat, gp);
    if (gnuplot == NULL) {
        printf("gnuplot is not installed: no %s (apt-get install gnuplot-nox, then "
               "cd %s && gnuplot scale.gp)\n", png, dir);
    } else if (titles->len > 0) {
        /* gnuplot reads the files by their names: run it where they are. */
        const char *argv[] = { gnuplot, "scale.gp", NULL };
        g_autoptr(GSubprocessLauncher) l = g_subprocess_launcher_new(G_SUBPROCESS_FLAGS_NONE);
        g_autoptr(GSubprocess) p = NULL;

        g_subprocess_launcher_set_cwd(l, dir);
        p = g_subprocess_launcher_spawnv(l, argv, &error);
        if (p == NULL || !g_subprocess_wait_check(p, NULL, &error)) {
            printf("gnuplot failed: %s\n", error->message);
        } else {
            printf("plot: %s\n", png);
        }
    }
}

