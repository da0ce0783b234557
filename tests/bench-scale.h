/*
 * bench-scale.h - what the scale benchmark's files share: bench-scale.c
 * drives the cases (pagefoldd, the stand-ins, the phases),
 * bench-scale-measure.c takes pagefoldd's and the stand-ins' measures
 * (the control socket, the stall probe, /proc), bench-scale-report.c
 * writes them out (the JSON lines, the table, the growth lines, the
 * plot).  The benchmark itself is described at the top of bench-scale.c.
 *
 * Owns the records of a case and of its results.  Must never be included
 * by anything but those three: they are one program, split for reading.
 */
#pragma once

#include <glib.h>

#include "bench-common.h"
#include "testproc.h"

/* Every control call's deadline: a daemon silent for this long is lost. */
#define CTL_TIMEOUT_S 30.0
/* A control round trip longer than this is a stall, which the case's
 * control_ok reports. */
#define STALL_LIMIT_MS 100.0

/* A control connection with deadlines.  One connection; a call that times
 * out drops it (its answer would come later, out of turn) and the next
 * call connects again. */
typedef struct _Ctl Ctl;
/* The stall probe: how long pagefoldd's main loop leaves a cheap command
 * unanswered, timed from a thread of its own. */
typedef struct _Probe Probe;

/* The probe's round trips since it was last taken. */
typedef struct {
    guint n;
    guint over;         /* answers over STALL_LIMIT_MS */
    double max_ms, p99_ms;
    gboolean unanswered; /* a request still waiting (counted in max_ms) */
    char *error;
} Stall;

/* One look at pagefoldd and the stand-ins. */
typedef struct {
    double t;                 /* s since the phase began */
    gint64 full_scans, pages_scanned, last_pass_usec;
    gint64 shared, sharing, zero, unshared, pending, cow, tracked, metadata, vmas_max;
    double cpu_s;             /* pagefoldd's */
    double footprint_mib;     /* the stand-ins' memory (bench-scale.c's top) */
    double anon_mib;          /* pagefoldd's RssAnon */
    guint attached;
} Sample;

/* One case: what it was set up with, and what runs in it. */
typedef struct {
    /* set up */
    const char *layout;       /* "zero" or "mixed" */
    int gib, n_vms, vm_mib;
    double phase_s;
    JsonObject *knobs;
    /* run */
    PfTestDaemon *d;
    int daemon_pid;
    PfTestVmm **vmm;
    Ctl *ctl;
    Probe *probe;
    double *detached_at;      /* per VM: s since the case began, or -1 */
    double t_case;
    gboolean control_lost;    /* a stats call timed out or the daemon went */
    char *control_error;
    JsonObject *last_stats;
} Case;

/* What the table, the growth lines and the plot need of a result line. */
typedef struct {
    char *workload;
    int gib, vms;
    gboolean skipped, failed, complete, control_ok, attached, verify_ok;
    double pass_ms, cpu_per_gib, meta_per_page, pfd_anon_mib, stall_max_ms, stall_p99_ms;
    double freed_mib, expected_mib, t90_s;
    gint64 passes;
    char *why;
} Row;

/* A phase of a case: its samples, sampled until it settled or could not. */
typedef struct {
    GArray *samples;
    gboolean complete;
    const char *end;          /* why sampling ended */
    double t90_s;             /* since the phase began; -1 if never */
} Phase;

/* ---- bench-scale-measure.c: the control socket ---- */

Ctl *ctl_new(const char *path);
void ctl_free(Ctl *c);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(Ctl, ctl_free)
/* Runs one command (args: a JSON object's text, or NULL) and returns its
 * "return" member; NULL and error when it failed or timed out. */
JsonNode *ctl_call(Ctl *c, const char *execute, const char *args, double timeout_s,
                   GError **error);

/* ---- bench-scale-measure.c: the stall probe ---- */

/* Starts probing the control socket at sock, every 20 ms. */
Probe *probe_start(const char *sock);
/* Stops the probe's thread and frees it. */
void probe_free(Probe *p);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(Probe, probe_free)
/* The round trips since the last call; one still waiting counts with the
 * time it has waited so far. */
Stall probe_take(Probe *p);

/* ---- bench-scale-measure.c: /proc, pagefoldd's stats ---- */

/* Alive and not a zombie. */
gboolean proc_alive(int pid);
/* A "Key:   N kB" field of /proc/PID/status or smaps_rollup, in KiB; -1
 * if absent. */
gint64 proc_kib(int pid, const char *file, const char *key);
/* An integer member of a stats object, 0 if absent (or o NULL). */
gint64 member(JsonObject *o, const char *name);
/* The VM of that pid in an array of VM objects, or NULL. */
JsonObject *vm_by_pid(JsonArray *vms, int pid);
/* The stand-ins' memory as the kernel holds it (see bench-scale.c's top). */
double footprint_mib(Case *c);
/* One look at everything; FALSE if pagefoldd did not answer. */
gboolean take_sample(Case *c, double t_phase0, Sample *s);

/* ---- bench-scale-report.c: the JSON lines ---- */

/* Members of the object b is building; a double not finite is null. */
void add_double(JsonBuilder *b, const char *name, double v);
void add_int(JsonBuilder *b, const char *name, gint64 v);
void add_bool(JsonBuilder *b, const char *name, gboolean v);
void add_str(JsonBuilder *b, const char *name, const char *v);
/* Opens a case's line: the members every line of a case has. */
void begin_line(JsonBuilder *b, const char *workload, int gib, int vms, int vm_mib);
/* Prints b's object on one line of stdout, its doubles shortened. */
void print_builder(JsonBuilder *b);
/* The figures of one phase, into its line and its row. */
void phase_to_json(Case *c, Phase *ph, double base_mib, JsonBuilder *b, Row *row);

/* ---- bench-scale-report.c: the rows and the summary ---- */

/* A new row, in rows (which frees it with row_free). */
Row *row_new(GPtrArray *rows, const char *workload, int gib, int vms);
void row_free(gpointer p);
/* The line and row of a case that did not run: "skipped" (it would not
 * fit) or "failed" (it could not be set up), and why. */
void status_line(GPtrArray *rows, const char *workload, int gib, int vms, int vm_mib,
                 const char *status, const char *why);
/* The markdown table of every row. */
void print_table(GPtrArray *rows);
/* How each quantity grew with RAM, per workload and VM count. */
void print_growth(GPtrArray *rows, const char *const *workloads, const int *vm_counts,
                  guint n_vc);
/* scale.dat, scale.gp, and scale.png when gnuplot is there. */
void write_plot(GPtrArray *rows, const char *const *workloads, const int *vm_counts, guint n_vc,
                const char *knob_spec);
