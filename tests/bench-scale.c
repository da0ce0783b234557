/*
 * bench-scale.c - the scale benchmark: how pagefoldd (the real daemon, in
 * merge mode) behaves as guest RAM grows, over a matrix of total RAM
 * (1, 4, 16 GiB; BENCH_SCALE_MAX_GIB allows more) split over 1, 4 and 16
 * VMs (no VM under 64 MiB).
 *
 * The VMs are STAND-IN VMMs, not QEMU: tests/standin-vmm maps its guest RAM
 * exactly as QEMU's memory-backend-memfd,share=on does and links the real
 * agent library, as the patched QEMU does; it is this benchmark's stand-in
 * for QEMU (no guest runs, no vCPU, no TCG), so every figure here is
 * pagefoldd's and the agent's, none a guest's.
 *
 * Workloads:
 *   zero    every page of guest RAM written, all zeros (a Windows guest
 *           after boot): all of it can go
 *   mixed   standin-vmm's usual mix: 50% identical across VMs, 20% zero,
 *           30% unique
 *   reboot  the mixed VMs, once merged, all rewrite all their RAM (new
 *           content, then their first content again: standin-vmm's
 *           "rewrite same"); how pagefoldd catches up (copies on write
 *           found, pages folded back, merged again).  It continues the
 *           mixed case in the same processes.
 * Each case starts a fresh pagefoldd with run=0, sets its knobs over the
 * control socket (BENCH_SCALE_KNOBS, default KNOBS_DEFAULT below: chosen
 * for speed), starts the stand-ins, measures a baseline, sets run=1 and
 * samples until merging is complete (counters unchanged over two full
 * passes, nothing pending) or the phase's deadline.  At the end every
 * stand-in verifies all its RAM against its shadow.
 *
 * One JSON line per case, then a markdown table, "growth" lines (each
 * quantity against RAM: linear or not), and a data file and gnuplot script
 * (scale.dat, scale.gp; scale.png if gnuplot is installed) in
 * BENCH_SCALE_OUT (default: the build directory).  Per case:
 *   pass time     full passes over time (mean_pass_s), last_pass_ms from
 *                 stats; cpu_s_per_gib: pagefoldd's utime+stime over the
 *                 GiB of page visits (pages_scanned)
 *   metadata      metadata_bytes / pages_tracked, in total and per VM;
 *                 pagefoldd's RssAnon (its own memory: metadata, trees),
 *                 VmRSS and VmHWM (those include the guest RAM and pool it
 *                 maps, so they are not its own)
 *   memory freed  the stand-ins' memory, counted as the kernel holds it:
 *                 their anonymous Pss (private copies of merged pages,
 *                 their heap) plus the blocks of their guest memfds plus
 *                 the blocks of every pool chunk (pagefoldd's or theirs,
 *                 each counted once).  Not Pss alone: pagefoldd maps guest
 *                 RAM too, and a folded-back page in the memfd need not be
 *                 mapped; not KSM-style counters (docs/DESIGN.md,
 *                 invariant 4).  t90: time until 90% of the final saving.
 *   stall         a thread of its own sends "knobs" on a connection of its
 *                 own every 20 ms and times each answer: max and p99;
 *                 control_ok is false if any took over 100 ms
 *   attached      every VM still in stats/list, and each stand-in's verify
 * Cases that would not fit in MemAvailable are skipped with a line saying
 * why.  Every wait has a deadline (BENCH_SCALE_PHASE_S per phase, default
 * 120 s + 60 s per GiB): a hung daemon or stand-in is reported, not waited
 * for.  Exit status 1 if any case failed: a verify failure, a stand-in or
 * pagefoldd that died or hung, a VM that was detached.  A slow control
 * socket or an incomplete merge is reported, not failed.
 *
 * Environment: BENCH_SCALE_GIB (list, default 1,4,16), BENCH_SCALE_VMS
 * (1,4,16), BENCH_SCALE_WORKLOADS (zero,mixed,reboot), BENCH_SCALE_MAX_GIB
 * (16), BENCH_SCALE_KNOBS (k=v,...), BENCH_SCALE_PHASE_S,
 * BENCH_SCALE_RESERVE_MIB (memory left to the rest of the host, 1024),
 * BENCH_SCALE_OUT.
 *
 * This file drives the cases: it starts pagefoldd and the stand-ins,
 * runs each phase until merging settles or its deadline, and asks the
 * stand-ins for their counters and their verify at the end;
 * bench-scale-measure.c measures (the control socket, the stall probe,
 * /proc) and bench-scale-report.c writes out (bench-scale.h).  It owns
 * the cases and their verdicts.  It must never leave a stand-in or
 * pagefoldd running past its case, nor wait on either without a deadline.
 */
#include "bench-scale.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#define KNOBS_DEFAULT "pages_to_scan=16384,sleep_millisecs=2"
#define MIN_VM_MIB 64

/* ---- one case ---- */

/* Counters unchanged over two full passes with nothing in flight: KSM's
 * "merging is done". */
typedef struct {
    gint64 sig[4];
    gint64 scans_at_change;
    gint64 scans_at_start;
} Settle;

static void
settle_init(Settle *z, const Sample *s)
{
    memset(z, 0, sizeof(*z));
    z->sig[0] = -1;
    z->scans_at_start = s->full_scans;
    z->scans_at_change = s->full_scans;
}

static gboolean
settled(Settle *z, const Sample *s)
{
    gint64 sig[4] = { s->shared, s->sharing, s->zero, s->pending };

    if (memcmp(sig, z->sig, sizeof(sig)) != 0) {
        memcpy(z->sig, sig, sizeof(sig));
        z->scans_at_change = s->full_scans;
    }
    return s->pending == 0 && s->full_scans >= z->scans_at_start + 2 &&
           s->full_scans >= z->scans_at_change + 2;
}

/* Sampling, paced so that reading /proc (page tables of many GiB) takes
 * no more than a quarter of the time. */
static void
pace(double cost_s)
{
    g_usleep((gulong)(MAX(0.25, 3 * cost_s) * G_USEC_PER_SEC));
}

/* The time of the first sample from t_from on that has 90% of the
 * saving (counted from base_mib; target_mib <= 0: the last sample's), or
 * -1. */
static double
t90(Phase *ph, double base_mib, double target_mib, double t_from)
{
    Sample *last = &g_array_index(ph->samples, Sample, ph->samples->len - 1);
    double goal = 0.9 * (target_mib > 0 ? target_mib : base_mib - last->footprint_mib);

    for (guint i = 0; goal > 0 && i < ph->samples->len; i++) {
        Sample *x = &g_array_index(ph->samples, Sample, i);

        if (x->t >= t_from && base_mib - x->footprint_mib >= goal) {
            return x->t;
        }
    }
    return -1;
}

/* Samples until merging settles, or the deadline, or there is nothing
 * left to watch.  base_mib: the footprint the saving is counted from;
 * target_mib: the saving t90 is counted against (<= 0: the phase's own
 * final saving). */
static void
run_phase(Case *c, Phase *ph, double t0, double base_mib, double target_mib,
          gboolean (*busy)(Case *c, gpointer user), gpointer user)
{
    Settle z;
    Sample s;
    gboolean first = TRUE;

    ph->samples = g_array_new(FALSE, FALSE, sizeof(Sample));
    ph->complete = FALSE;
    ph->end = "deadline";
    for (;;) {
        double before = bench_now();
        gboolean still_busy = busy != NULL && busy(c, user);

        if (!take_sample(c, t0, &s)) {
            /* The counters stay as last seen: the figures end there. */
            if (ph->samples->len > 0) {
                Sample *l = &g_array_index(ph->samples, Sample, ph->samples->len - 1);
                Sample keep = *l;

                keep.t = s.t;
                keep.cpu_s = s.cpu_s;
                keep.anon_mib = s.anon_mib;
                keep.footprint_mib = s.footprint_mib;
                s = keep;
            }
            g_array_append_val(ph->samples, s);
            ph->end = "control socket silent";
            break;
        }
        g_array_append_val(ph->samples, s);
        if (first || still_busy) {
            settle_init(&z, &s);
            first = FALSE;
        } else if (settled(&z, &s)) {
            ph->complete = TRUE;
            ph->end = "settled";
            break;
        }
        if (s.attached == 0) {
            ph->end = "no VM attached";
            break;
        }
        if (!proc_alive(c->daemon_pid)) {
            ph->end = "pagefoldd exited";
            break;
        }
        if (bench_now() - t0 > c->phase_s) {
            break;
        }
        pace(bench_now() - before);
    }
    ph->t90_s = t90(ph, base_mib, target_mib, 0);
}

/* Sends cmd to every stand-in, then collects their answers. */
static void
vmm_all(Case *c, const char *cmd, double timeout_s, char **answers)
{
    gint64 deadline = g_get_monotonic_time() + (gint64)(timeout_s * G_USEC_PER_SEC);

    for (int i = 0; i < c->n_vms; i++) {
        g_autoptr(GError) error = NULL;

        answers[i] = NULL;
        if (!pf_test_vmm_send(c->vmm[i], cmd, &error)) {
            answers[i] = g_strdup_printf("error %s", error->message);
        }
    }
    for (int i = 0; i < c->n_vms; i++) {
        g_autoptr(GError) error = NULL;

        if (answers[i] == NULL) {
            double left = (double)(deadline - g_get_monotonic_time()) / G_USEC_PER_SEC;

            answers[i] = pf_test_vmm_read_line(c->vmm[i], MAX(left, 0), &error);
            if (answers[i] == NULL) {
                answers[i] = g_strdup_printf("error %s", error->message);
            }
        }
    }
}

/* The number after key in a stand-in's "stats ..." answer, or -1. */
static gint64
word_after(const char *line, const char *key)
{
    g_auto(GStrv) w = g_strsplit(line, " ", -1);

    for (guint i = 0; w[i] != NULL && w[i + 1] != NULL; i++) {
        if (g_str_equal(w[i], key)) {
            return g_ascii_strtoll(w[i + 1], NULL, 10);
        }
    }
    return -1;
}

/* The agents' counters, summed, and how many say they are connected. */
static void
agents_to_json(Case *c, JsonBuilder *b, const char *name, double timeout_s)
{
    g_autofree char **a = g_new0(char *, c->n_vms);
    gint64 merged = 0, unmerged = 0, zeroed = 0, errors = 0, connected = 0;

    vmm_all(c, "stats", timeout_s, a);
    for (int i = 0; i < c->n_vms; i++) {
        merged += MAX(word_after(a[i], "merged"), 0);
        unmerged += MAX(word_after(a[i], "unmerged"), 0);
        zeroed += MAX(word_after(a[i], "zeroed"), 0);
        errors += MAX(word_after(a[i], "errors"), 0);
        connected += word_after(a[i], "connected") == 1;
        g_free(a[i]);
    }
    json_builder_set_member_name(b, name);
    json_builder_begin_object(b);
    add_int(b, "merged", merged);
    add_int(b, "zeroed", zeroed);
    add_int(b, "unmerged", unmerged);
    add_int(b, "errors", errors);
    add_int(b, "connected", connected);
    json_builder_end_object(b);
}

/* At the end of a case: still attached (list), and every byte right. */
static void
final_checks(Case *c, JsonBuilder *b, Row *row)
{
    g_autoptr(GError) error = NULL;
    g_autoptr(JsonNode) list = ctl_call(c->ctl, "list", NULL, CTL_TIMEOUT_S, &error);
    g_autofree char **answers = g_new0(char *, c->n_vms);
    gboolean all_attached = TRUE, all_ok = TRUE;

    json_builder_set_member_name(b, "attached");
    json_builder_begin_array(b);
    for (int i = 0; i < c->n_vms; i++) {
        JsonObject *vm = list ? vm_by_pid(json_node_get_array(list), c->vmm[i]->pid) : NULL;
        gboolean ok = vm != NULL && g_str_equal(json_object_get_string_member(vm, "mode"), "merge");

        json_builder_begin_object(b);
        add_bool(b, "in_list", vm != NULL);
        add_str(b, "mode", vm ? json_object_get_string_member(vm, "mode") : NULL);
        add_double(b, "detached_at_s", c->detached_at[i] >= 0 ? c->detached_at[i] : NAN);
        json_builder_end_object(b);
        all_attached &= ok && c->detached_at[i] < 0;
    }
    json_builder_end_array(b);
    add_bool(b, "all_attached", all_attached);
    add_str(b, "list_error", list == NULL ? error->message : NULL);
    /* Reading a few GiB of RAM back and regenerating it: ~1 s per GiB. */
    vmm_all(c, "verify", 60 + 30.0 * c->vm_mib / 1024, answers);
    json_builder_set_member_name(b, "verify");
    json_builder_begin_array(b);
    for (int i = 0; i < c->n_vms; i++) {
        json_builder_add_string_value(b, answers[i]);
        all_ok &= g_str_has_prefix(answers[i], "verify ok");
        g_free(answers[i]);
    }
    json_builder_end_array(b);
    add_bool(b, "verify_ok", all_ok);
    row->attached = all_attached;
    row->verify_ok = all_ok;
}

typedef struct {
    gboolean *done;
    char **answers;
    double t0;
    double done_s; /* when the last answer was seen, since t0; -1 before */
} Rewrite;

/* While the stand-ins rewrite their RAM: TRUE until all have answered. */
static gboolean
rewrite_busy(Case *c, gpointer user)
{
    Rewrite *r = user;
    gboolean busy = FALSE;

    for (int i = 0; i < c->n_vms; i++) {
        g_autoptr(GError) error = NULL;

        if (!r->done[i]) {
            r->answers[i] = pf_test_vmm_read_line(c->vmm[i], 0, &error);
            if (r->answers[i] == NULL &&
                !g_error_matches(error, G_IO_ERROR, G_IO_ERROR_TIMED_OUT)) {
                r->answers[i] = g_strdup_printf("error %s", error->message);
            }
            r->done[i] = r->answers[i] != NULL;
            busy |= !r->done[i];
        }
    }
    if (!busy && r->done_s < 0) {
        r->done_s = bench_now() - r->t0;
    }
    return busy;
}

static double
mem_available_mib(void)
{
    g_autofree char *text = NULL;
    const char *p;

    if (!g_file_get_contents("/proc/meminfo", &text, NULL, NULL) ||
        (p = strstr(text, "MemAvailable:")) == NULL) {
        return 0;
    }
    return (double)g_ascii_strtoll(p + strlen("MemAvailable:"), NULL, 10) / 1024.0;
}

/* The saving the layout allows, in MiB: every zero page, and all but one
 * copy of each identical page. */
static double
expected_mib(const char *layout, int n, int vm_mib)
{
    return g_str_equal(layout, "zero") ? (double)n * vm_mib
                                       : n * 0.2 * vm_mib + (n - 1) * 0.5 * vm_mib;
}

static gboolean
has_word(const char *list, const char *word)
{
    g_auto(GStrv) w = g_strsplit(list, ",", -1);

    return g_strv_contains((const char *const *)w, word);
}

/* Sets the knobs over the control socket; returns them as pagefoldd has
 * them. */
static JsonObject *
set_knobs(Ctl *ctl, const char *spec, GError **error)
{
    g_auto(GStrv) kvs = g_strsplit(spec, ",", -1);
    g_autoptr(JsonNode) k = NULL;

    for (guint i = 0; kvs[i] != NULL; i++) {
        g_auto(GStrv) kv = g_strsplit(g_strstrip(kvs[i]), "=", 2);
        g_autofree char *args = NULL;
        g_autoptr(JsonNode) r = NULL;

        if (kv[0] == NULL || *kv[0] == '\0') {
            continue;
        }
        if (kv[1] == NULL || g_str_equal(kv[0], "run")) {
            g_set_error(error, G_IO_ERROR, G_IO_ERROR_INVALID_ARGUMENT,
                        "knob '%s': want NAME=VALUE, and not run", kvs[i]);
            return NULL;
        }
        args = g_strdup_printf("{\"knob\":\"%s\",\"value\":%s}", kv[0], kv[1]);
        if ((r = ctl_call(ctl, "set", args, CTL_TIMEOUT_S, error)) == NULL) {
            return NULL;
        }
    }
    k = ctl_call(ctl, "knobs", NULL, CTL_TIMEOUT_S, error);
    return k ? json_object_ref(json_node_get_object(k)) : NULL;
}

/* Runs one case: the zero layout, or the mixed one followed by a reboot
 * when asked.  Its rows say whether it failed. */
static void
run_case(GPtrArray *rows, const char *layout, gboolean want_mixed, gboolean want_reboot,
         int gib, int n, const char *knob_spec, double reserve_mib)
{
    int vm_mib = gib * 1024 / n;
    gboolean zero = g_str_equal(layout, "zero");
    /* Guest RAM is all allocated before anything merges; then the pool
     * (one copy of each identical page) grows before the memfds shrink,
     * and a reboot copies every merged page back: about RAM plus the
     * pool, plus pagefoldd's metadata and page tables (a few %). */
    double pool_mib = zero || n == 1 ? 0 : 0.5 * vm_mib;
    double need_mib = gib * 1024.0 * 1.06 + pool_mib + reserve_mib;
    double avail = mem_available_mib();
    g_autoptr(PfTestDaemon) d = NULL;
    g_autoptr(Ctl) ctl = NULL;
    g_autoptr(GError) error = NULL;
    g_autofree double *detached_at = g_new(double, n);
    g_autofree PfTestVmm **vmm = g_new0(PfTestVmm *, n);
    g_autofree char *vmm_mib = g_strdup_printf("%d", vm_mib);
    Case c = { 0 };
    double t_spawn, spawn_s, base_mib;
    Phase merge = { 0 }, reboot = { 0 };
    const char *first_name = zero ? "zero" : want_mixed ? "mixed" : "reboot";
    gboolean setup_ok = TRUE;
    g_autofree char *setup_why = NULL;

    if (need_mib > avail) {
        g_autofree char *why = g_strdup_printf(
            "needs about %.0f MiB (RAM, pool, metadata, %.0f MiB reserve), "
            "MemAvailable is %.0f MiB",
            need_mib, reserve_mib, avail);

        if (zero || want_mixed) {
            status_line(rows, first_name, gib, n, vm_mib, "skipped", why);
        }
        if (want_reboot) {
            status_line(rows, "reboot", gib, n, vm_mib, "skipped", why);
        }
        return;
    }
    g_printerr("bench-scale: %s%s %d GiB over %d VM(s) of %d MiB (MemAvailable %.0f MiB)\n",
               layout, want_reboot ? "+reboot" : "", gib, n, vm_mib, avail);
    for (int i = 0; i < n; i++) {
        detached_at[i] = -1;
    }
    c.layout = layout;
    c.gib = gib;
    c.n_vms = n;
    c.vm_mib = vm_mib;
    c.vmm = vmm;
    c.detached_at = detached_at;
    c.phase_s = g_getenv("BENCH_SCALE_PHASE_S")
                    ? g_ascii_strtod(g_getenv("BENCH_SCALE_PHASE_S"), NULL)
                    : 120 + 60.0 * gib;
    d = pf_test_daemon_start("--set", "run=0", NULL);
    c.d = d;
    c.daemon_pid = pf_test_daemon_pid(d);
    ctl = ctl_new(d->sock);
    c.ctl = ctl;
    c.knobs = set_knobs(ctl, knob_spec, &error);
    if (c.knobs == NULL) {
        g_error("bench-scale: cannot set knobs '%s': %s", knob_spec, error->message);
    }

    /* All stand-ins fill their RAM at once, as VMs booting together. */
    t_spawn = bench_now();
    for (int i = 0; i < n; i++) {
        g_autofree char *guest = g_strdup_printf("guest=scale-%s-%d", layout, i);
        g_autofree char *seed = g_strdup_printf("%d", i + 1);
        const char *argv[] = {
            pf_test_bin("STANDIN_VMM"), "-name", guest, "--agent-socket", d->agent_sock,
            "--mib", vmm_mib, "--identical", zero ? "0" : "50", "--zero", zero ? "100" : "20",
            "--seed", seed, "--writers", "0", NULL
        };

        vmm[i] = pf_test_vmm_launch(argv, &error);
        if (vmm[i] == NULL) {
            g_error("bench-scale: cannot start standin-vmm: %s", error->message);
        }
    }
    for (int i = 0; i < n && setup_ok; i++) {
        double left = 60 + 30.0 * gib - (bench_now() - t_spawn);

        if (!pf_test_vmm_wait_ready(vmm[i], MAX(left, 0), &error)) {
            setup_ok = FALSE;
            setup_why = g_strdup_printf("stand-in %d: %s", i, error->message);
        } else if (!g_str_equal(vmm[i]->mode, "merge")) {
            setup_ok = FALSE;
            setup_why = g_strdup_printf("stand-in %d settled in mode %s, not merge", i,
                                        vmm[i]->mode);
        }
    }
    for (int i = 0; i < n && setup_ok; i++) {
        pf_test_daemon_wait_vmm(d, vmm[i]);
    }
    spawn_s = bench_now() - t_spawn;
    if (!setup_ok) {
        status_line(rows, first_name, gib, n, vm_mib, "failed", setup_why);
        goto out;
    }

    c.probe = probe_start(d->sock);
    c.t_case = bench_now();
    base_mib = footprint_mib(&c);
    {
        g_autoptr(JsonNode) r = ctl_call(ctl, "set", "{\"knob\":\"run\",\"value\":1}",
                                         CTL_TIMEOUT_S, &error);

        if (r == NULL) {
            c.control_lost = TRUE;
            c.control_error = g_strdup_printf("set run 1: %s", error->message);
        }
    }
    (void)probe_take(c.probe); /* the stalls of merging only */
    run_phase(&c, &merge, c.t_case, base_mib, 0, NULL, NULL);

    if (zero || want_mixed) {
        g_autoptr(JsonBuilder) b = json_builder_new();
        Row *r = row_new(rows, first_name, gib, n);

        begin_line(b, first_name, gib, n, vm_mib);
        json_builder_set_member_name(b, "knobs");
        json_builder_add_value(b, json_node_init_object(json_node_alloc(), c.knobs));
        add_double(b, "spawn_s", spawn_s);
        phase_to_json(&c, &merge, base_mib, b, r);
        r->expected_mib = expected_mib(layout, n, vm_mib);
        add_double(b, "expected_freed_mib", r->expected_mib);
        agents_to_json(&c, b, "agents", 30);
        if (!want_reboot) {
            final_checks(&c, b, r);
        } else {
            /* The same processes go on to reboot: their checks come at
             * the end of it, and say for both. */
            r->attached = TRUE;
            r->verify_ok = TRUE;
            for (int i = 0; i < n; i++) {
                r->attached &= c.detached_at[i] < 0;
            }
            add_bool(b, "all_attached", r->attached);
            add_str(b, "verify", "at the end of the reboot case");
        }
        add_str(b, "control_error", c.control_error);
        r->failed = !r->attached || !r->verify_ok || c.control_lost;
        json_builder_end_object(b);
        print_builder(b);
    }

    if (want_reboot) {
        g_autoptr(JsonBuilder) b = json_builder_new();
        Row *r = row_new(rows, "reboot", gib, n);
        g_autofree gboolean *done = g_new0(gboolean, n);
        g_autofree char **answers = g_new0(char *, n);
        Rewrite rw = { done, answers, 0, -1 };
        Sample *pre = &g_array_index(merge.samples, Sample, merge.samples->len - 1);
        double pre_mib = pre->footprint_mib, t_reboot;
        gboolean rewrite_ok = TRUE;

        begin_line(b, "reboot", gib, n, vm_mib);
        json_builder_set_member_name(b, "knobs");
        json_builder_add_value(b, json_node_init_object(json_node_alloc(), c.knobs));
        add_bool(b, "premerge_complete", merge.complete);
        add_double(b, "premerge_s", pre->t);
        add_double(b, "premerge_freed_mib", base_mib - pre_mib);
        agents_to_json(&c, b, "agents_before", 30);
        (void)probe_take(c.probe);
        t_reboot = bench_now();
        rw.t0 = t_reboot;
        for (int i = 0; i < n; i++) {
            if (!pf_test_vmm_send(vmm[i], "rewrite same", &error)) {
                answers[i] = g_strdup_printf("error %s", error->message);
                done[i] = TRUE;
                g_clear_error(&error);
            }
        }
        /* Saving counted from the footprint before merging, and t90
         * against what the merge phase had freed: back to 90% of it. */
        run_phase(&c, &reboot, t_reboot, base_mib, base_mib - pre_mib, rewrite_busy, &rw);
        for (int i = 0; i < n; i++) {
            if (!done[i]) {
                answers[i] = g_strdup("error no answer to rewrite before the deadline");
            }
            rewrite_ok &= g_str_has_prefix(answers[i], "ok");
        }
        /* Catching up is judged once the rewrite is over: before, the
         * saving is what the merge left, not yet undone. */
        reboot.t90_s = rw.done_s >= 0 ? t90(&reboot, base_mib, base_mib - pre_mib, rw.done_s) : -1;
        add_double(b, "footprint_pre_reboot_mib", pre_mib);
        add_double(b, "rewrite_s", rw.done_s);
        add_double(b, "t90_after_rewrite_s", reboot.t90_s >= 0 ? reboot.t90_s - rw.done_s : NAN);
        add_bool(b, "rewrite_ok", rewrite_ok);
        json_builder_set_member_name(b, "rewrite");
        json_builder_begin_array(b);
        for (int i = 0; i < n; i++) {
            json_builder_add_string_value(b, answers[i]);
        }
        json_builder_end_array(b);
        phase_to_json(&c, &reboot, base_mib, b, r);
        r->expected_mib = base_mib - pre_mib;
        add_double(b, "resaved_pct", base_mib - pre_mib > 0
                                         ? 100.0 * r->freed_mib / (base_mib - pre_mib) : NAN);
        agents_to_json(&c, b, "agents", 30);
        final_checks(&c, b, r);
        add_str(b, "control_error", c.control_error);
        r->failed = !r->attached || !r->verify_ok || !rewrite_ok || c.control_lost;
        /* The mixed line's checks were these. */
        if (want_mixed && rows->len >= 2) {
            Row *m = g_ptr_array_index(rows, rows->len - 2);

            m->verify_ok = r->verify_ok;
            m->failed |= !r->verify_ok;
        }
        for (int i = 0; i < n; i++) {
            g_free(answers[i]);
        }
        json_builder_end_object(b);
        print_builder(b);
    }
out:
    if (c.probe != NULL) {
        probe_free(c.probe);
    }
    for (int i = 0; i < n; i++) {
        if (vmm[i] != NULL) {
            pf_test_vmm_free(vmm[i]);
        }
    }
    if (merge.samples != NULL) {
        g_array_unref(merge.samples);
    }
    if (reboot.samples != NULL) {
        g_array_unref(reboot.samples);
    }
    if (c.knobs != NULL) {
        json_object_unref(c.knobs);
    }
    if (c.last_stats != NULL) {
        json_object_unref(c.last_stats);
    }
    g_free(c.control_error);
}

static GArray *
int_list(const char *env, const char *dflt)
{
    const char *s = g_getenv(env);
    g_auto(GStrv) w = g_strsplit(s ? s : dflt, ",", -1);
    GArray *a = g_array_new(FALSE, FALSE, sizeof(int));

    for (guint i = 0; w[i] != NULL; i++) {
        int v = atoi(w[i]);

        if (v > 0) {
            g_array_append_val(a, v);
        }
    }
    return a;
}

int
main(int argc, char **argv)
{
    g_autoptr(GArray) gibs = int_list("BENCH_SCALE_GIB", "1,4,16");
    g_autoptr(GArray) vms = int_list("BENCH_SCALE_VMS", "1,4,16");
    const char *workloads = g_getenv("BENCH_SCALE_WORKLOADS") ? g_getenv("BENCH_SCALE_WORKLOADS")
                                                              : "zero,mixed,reboot";
    const char *knobs = g_getenv("BENCH_SCALE_KNOBS") ? g_getenv("BENCH_SCALE_KNOBS")
                                                      : KNOBS_DEFAULT;
    int max_gib = g_getenv("BENCH_SCALE_MAX_GIB") ? atoi(g_getenv("BENCH_SCALE_MAX_GIB")) : 16;
    double reserve = g_getenv("BENCH_SCALE_RESERVE_MIB")
                         ? g_ascii_strtod(g_getenv("BENCH_SCALE_RESERVE_MIB"), NULL) : 1024;
    g_autoptr(GPtrArray) rows = g_ptr_array_new_with_free_func(row_free);
    const char *all_workloads[] = { "zero", "mixed", "reboot", NULL };
    const char *present[4] = { NULL };
    guint n_present = 0;
    gboolean failed = FALSE;

    /* A stand-in that dies must not take the benchmark with it. */
    signal(SIGPIPE, SIG_IGN);
    printf("{\"bench\":\"scale\",\"vmm\":\"standin-vmm\",\"note\":\"the VMs are stand-in VMMs "
           "(tests/standin-vmm: QEMU's memfd guest RAM and the real agent library, no guest), "
           "standing in for QEMU\",\"daemon\":\"pagefoldd, mode merge\",\"knobs\":\"%s\","
           "\"max_gib\":%d}\n", knobs, max_gib);
    fflush(stdout);
    for (guint w = 0; all_workloads[w] != NULL; w++) {
        if (has_word(workloads, all_workloads[w])) {
            present[n_present++] = all_workloads[w];
        }
    }
    for (guint g = 0; g < gibs->len; g++) {
        int gib = g_array_index(gibs, int, g);

        if (gib > max_gib) {
            continue;
        }
        for (guint v = 0; v < vms->len; v++) {
            int n = g_array_index(vms, int, v);

            if (gib * 1024 / n < MIN_VM_MIB) {
                continue; /* not a combination: a VM would be under 64 MiB */
            }
            if (has_word(workloads, "zero")) {
                run_case(rows, "zero", FALSE, FALSE, gib, n, knobs, reserve);
            }
            if (has_word(workloads, "mixed") || has_word(workloads, "reboot")) {
                run_case(rows, "mixed", has_word(workloads, "mixed"),
                         has_word(workloads, "reboot"), gib, n, knobs, reserve);
            }
        }
    }
    print_table(rows);
    print_growth(rows, present, (const int *)(void *)vms->data, vms->len);
    write_plot(rows, present, (const int *)(void *)vms->data, vms->len, knobs);
    for (guint i = 0; i < rows->len; i++) {
        Row *r = g_ptr_array_index(rows, i);

        failed |= r->failed;
    }
    printf("\nbench-scale: %s\n",
           failed ? "FAILED (see the lines above)" : "every case that ran passed its checks");
    return failed ? 1 : 0;
}
