/*
 * libvirt-metadata.c - VMs' figures in their libvirt domains' live
 * metadata (libvirt-metadata.h), owning the worker thread, libvirt's
 * library (loaded by the worker when first needed) and the connection.
 * The main loop's side (the timer, the snapshots) never calls
 * libvirt; the worker's side calls nothing of the scanner's: a snapshot is
 * all they share.
 */
#include "libvirt-metadata.h"

#include <dlfcn.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <string.h>

#include "libvirt-status.h"
#include "pf-config.h"
#include "util.h"

/* How often the timer looks at the knob when it has nothing due sooner. */
#define KNOB_POLL_MS 1000

typedef struct {
    char uuid[37];
    int pid;         /* the VM's process: the domain's QEMU must be it */
    char *element;
} Entry;

typedef struct {
    guint64 gen;
    GArray *entries; /* Entry */
} Snapshot;

/* Tells the worker to stop; never freed. */
static Snapshot stop_marker;
#define STOP (&stop_marker)

/* What the main loop and the worker share; freed by whichever lets go
 * last (the worker may outlive pf_libvirt_metadata_free()). */
typedef struct {
    char *uri;
    char *pid_dir;        /* lock */
    GAsyncQueue *queue;   /* Snapshot*, at most one, or STOP */
    gint stopping;        /* atomic: stop between calls */
    GMutex lock;
    GCond cond;           /* done_gen or finished changed */
    guint64 posted_gen;   /* lock: the last snapshot handed over */
    guint64 done_gen;     /* lock: the last one dealt with (or dropped) */
    gboolean finished;    /* lock: the worker is done with libvirt */
    PfLibvirtMetadataCounts counts; /* lock */
} Shared;

struct _PfLibvirtMetadata {
    PfScanner *scanner;
    Shared *sh;
    GThread *thread;
    guint timer;
    gint64 last_usec;     /* monotonic time of the last snapshot */
};

static gint workers_running;

static void
entry_clear(gpointer data)
{
    g_free(((Entry *)data)->element);
}

static void
snapshot_free(gpointer data)
{
    Snapshot *snap = data;

    if (snap == NULL || snap == STOP) {
        return;
    }
    g_array_unref(snap->entries);
    g_free(snap);
}

static void
shared_clear(gpointer data)
{
    Shared *sh = data;

    g_free(sh->uri);
    g_free(sh->pid_dir);
    g_async_queue_unref(sh->queue);
    g_mutex_clear(&sh->lock);
    g_cond_clear(&sh->cond);
}

static void
shared_unref(Shared *sh)
{
    g_atomic_rc_box_release_full(sh, shared_clear);
}

/* ---- the element ---- */

/* Text as XML character data: valid UTF-8, no control characters (XML 1.0
 * has no way to write most of them), markup escaped.  mode_reason may come
 * from an agent: it is whatever the agent said. */
static void
append_text(GString *out, const char *text)
{
    g_autofree char *valid = g_utf8_make_valid(text, -1);
    g_autofree char *escaped = NULL;

    for (char *p = valid; *p; p++) {
        if (g_ascii_iscntrl(*p)) {
            *p = ' ';
        }
    }
    escaped = g_markup_escape_text(valid, -1);
    g_string_append(out, escaped);
}

static void
append_figure(GString *out, const char *name, guint64 value)
{
    g_string_append_printf(out, "<%s>%" G_GUINT64_FORMAT "</%s>", name, value, name);
}

char *
pf_libvirt_metadata_element(const PfVm *vm, const PfCounters *c, GDateTime *when)
{
    GString *out = g_string_new(NULL);
    g_autoptr(GDateTime) utc = g_date_time_to_utc(when);
    g_autofree char *updated = g_date_time_format(utc, "%Y-%m-%dT%H:%M:%SZ");

    /* Child elements rather than attributes: `virsh metadata` prints one
     * figure a line.  The names are the JSON's (pagefoldctl stats). */
    g_string_append_printf(out, "<stats pid=\"%d\" updated=\"%s\">", vm->pid, updated);
    g_string_append(out, "<mode>");
    append_text(out, pf_vm_mode_name(vm));
    g_string_append(out, "</mode>");
    if (vm->mode_reason != NULL) {
        g_string_append(out, "<mode_reason>");
        append_text(out, vm->mode_reason);
        g_string_append(out, "</mode_reason>");
    }
    append_figure(out, "pages_shared", c->pages_shared);
    append_figure(out, "pages_sharing", c->pages_sharing);
    append_figure(out, "zero_pages", c->zero_pages);
    append_figure(out, "cow", c->cow);
    append_figure(out, "backend_fold_backs", c->backend_fold_backs);
    append_figure(out, "saved_bytes", pf_counters_saved_bytes(c));
    g_string_append(out, "</stats>");
    return g_string_free(out, FALSE);
}

/* ---- the worker (libvirt only here) ---- */

/*
 * libvirt is loaded by a worker the first time a VM has a domain to
 * publish to, not when pagefoldd starts: with its dependencies it is about
 * fifty libraries (TLS, XML, SSH, Kerberos, ICU...), most of what
 * pagefoldd would map, and a host that runs QEMU without libvirt never
 * needs any of it.  A load that failed (libvirt installed since, no
 * descriptor or memory to spare, an upgraded libvirt that needs newer
 * libraries than pagefoldd has mapped) is tried again at the next
 * connection.  Never unloaded once loaded.  LIBVIRT_API lists the
 * functions called, each by its field in LibvirtApi.
 */
#define LIBVIRT_API(X)                                                    \
    X(connect_open, virConnectOpen)                                       \
    X(connect_close, virConnectClose)                                     \
    X(connect_is_alive, virConnectIsAlive)                                \
    X(domain_lookup_by_uuid_string, virDomainLookupByUUIDString)          \
    X(domain_get_name, virDomainGetName)                                  \
    X(domain_is_active, virDomainIsActive)                                \
    X(domain_set_metadata, virDomainSetMetadata)                          \
    X(domain_free, virDomainFree)                                         \
    X(get_last_error_code, virGetLastErrorCode)                           \
    X(get_last_error_message, virGetLastErrorMessage)                     \
    X(set_error_func, virSetErrorFunc)

typedef struct {
#define FIELD(field, name) __typeof__(name) *field;
    LIBVIRT_API(FIELD)
#undef FIELD
} LibvirtApi;

static GMutex lv_lock;
static gboolean lv_loaded;                        /* lv_lock */
static const char *lv_soname = PF_LIBVIRT_SONAME; /* lv_lock */
/* Written under lv_lock before lv_loaded is set, never changed after but
 * by a load of the same functions (tests): read without the lock by a
 * worker that was told it is loaded. */
static LibvirtApi lv;

/* libvirt prints every error on stderr unless told otherwise; the worker
 * says what matters itself, once. */
static void
quiet_error(void *user, virErrorPtr err)
{
}

/* Loads libvirt into lv, with lv_lock held; *why (owned) not. */
static gboolean
load_libvirt_locked(char **why)
{
    LibvirtApi api = { 0 };
    const struct {
        const char *name;
        void **at;
    } syms[] = {
#define SYM(field, name) { #name, (void **)&api.field },
        LIBVIRT_API(SYM)
#undef SYM
    };
    void *h;

    if ((h = dlopen(lv_soname, RTLD_NOW | RTLD_LOCAL)) == NULL) {
        *why = g_strdup(dlerror());
        return FALSE;
    }
    for (gsize i = 0; i < G_N_ELEMENTS(syms); i++) {
        if ((*syms[i].at = dlsym(h, syms[i].name)) == NULL) {
            *why = g_strdup_printf("%s has no %s", lv_soname, syms[i].name);
            dlclose(h);
            return FALSE;
        }
    }
    lv = api;
    /* Process-wide, and pagefoldd is libvirt's only user in it. */
    lv.set_error_func(NULL, quiet_error);
    lv_loaded = TRUE;
    return TRUE;
}

/* Whether libvirt is loaded, loading it if not; *why (owned) not. */
static gboolean
load_libvirt(char **why)
{
    gboolean loaded;

    g_mutex_lock(&lv_lock);
    loaded = lv_loaded || load_libvirt_locked(why);
    g_mutex_unlock(&lv_lock);
    return loaded;
}

/* What the worker said last of libvirt as a whole: said again only when
 * it changes (a library loaded since, but no libvirtd to reach, is news). */
typedef enum {
    TROUBLE_NONE,
    TROUBLE_NOT_LOADED,
    TROUBLE_UNREACHABLE,
    TROUBLE_LOST,  /* the connection went; "cannot be reached" then is not news */
} Trouble;

typedef struct {
    Shared *sh;
    virConnectPtr conn;
    Trouble trouble;        /* what was said of libvirt last */
    GHashTable *published;  /* UUIDs whose element is set */
    GHashTable *told;       /* UUID -> the failure last said for it */
    GHashTable *foreign;    /* "UUID pid": said that the domain's QEMU is
                             * not that VM's process; only pairs of the
                             * last snapshot */
    char *pid_dir;          /* the snapshot's */
} Worker;

static void
count(Shared *sh, guint64 *field)
{
    g_mutex_lock(&sh->lock);
    (*field)++;
    g_mutex_unlock(&sh->lock);
}

static void
set_connected(Shared *sh, gboolean connected)
{
    g_mutex_lock(&sh->lock);
    sh->counts.connected = connected;
    g_mutex_unlock(&sh->lock);
}

static gboolean
stopping(Shared *sh)
{
    return g_atomic_int_get(&sh->stopping);
}

static gboolean
connect_libvirt(Worker *w)
{
    Shared *sh = w->sh;
    g_autofree char *why = NULL;

    if (w->conn != NULL) {
        return TRUE;
    }
    if (!load_libvirt(&why)) {
        if (w->trouble != TROUBLE_NOT_LOADED && !stopping(sh)) {
            g_message("libvirt cannot be loaded (%s): VMs' figures are not in their "
                      "domains' metadata; trying again every interval", why);
            w->trouble = TROUBLE_NOT_LOADED;
        }
        count(sh, &sh->counts.load_failures);
        return FALSE;
    }
    w->conn = lv.connect_open(sh->uri);
    if (w->conn == NULL) {
        /* Not after shutdown: a worker left to end on its own ends
         * quietly. */
        if (w->trouble != TROUBLE_UNREACHABLE && w->trouble != TROUBLE_LOST && !stopping(sh)) {
            g_message("libvirt at %s cannot be reached (%s): VMs' figures are not in "
                      "their domains' metadata; trying again every interval",
                      sh->uri, lv.get_last_error_message());
            w->trouble = TROUBLE_UNREACHABLE;
        }
        count(sh, &sh->counts.connect_failures);
        return FALSE;
    }
    if (w->trouble != TROUBLE_NONE) {
        g_message("libvirt at %s reached: VMs' figures go into their domains' metadata",
                  sh->uri);
        w->trouble = TROUBLE_NONE;
    }
    set_connected(sh, TRUE);
    return TRUE;
}

static void
disconnect_libvirt(Worker *w)
{
    if (w->conn != NULL) {
        lv.connect_close(w->conn);
        w->conn = NULL;
        set_connected(w->sh, FALSE);
    }
}

/* What became of a call about one domain. */
typedef enum {
    CALL_DONE,    /* done, or nothing to do: not a running libvirt domain */
    CALL_FAILED,  /* the domain's failure: tried again with the next snapshot */
    CALL_LOST,    /* the connection is gone */
    CALL_NOT_ITS, /* not done: the domain's QEMU is not the VM's process */
} CallOutcome;

/*
 * After a call failed with message: CALL_LOST when the connection is gone
 * (said once; dropped, to be made again with the next snapshot), else the
 * failure is the domain's, said once for it until it changes.
 */
static CallOutcome
call_failed(Worker *w, const char *uuid, const char *what, const char *message)
{
    Shared *sh = w->sh;

    if (lv.connect_is_alive(w->conn) != 1) {
        if (w->trouble == TROUBLE_NONE) {
            g_message("lost the connection to libvirt at %s (%s): trying again every "
                      "interval", sh->uri, message);
            w->trouble = TROUBLE_LOST;
        }
        disconnect_libvirt(w);
        return CALL_LOST;
    }
    count(sh, &sh->counts.failed);
    if (g_strcmp0(g_hash_table_lookup(w->told, uuid), message) != 0) {
        g_message("libvirt domain %s: cannot %s pagefold's metadata: %s", uuid, what,
                  message);
        g_hash_table_insert(w->told, g_strdup(uuid), g_strdup(message));
    }
    return CALL_FAILED;
}

/* Not a libvirt domain of a running VM: no such UUID, or not running. */
static gboolean
not_ours(int code)
{
    return code == VIR_ERR_NO_DOMAIN || code == VIR_ERR_OPERATION_INVALID;
}

static char *
foreign_key(const Entry *e)
{
    return g_strdup_printf("%s %d", e->uuid, e->pid);
}

/* The pid of the running domain name's QEMU (libvirt-status.h); 0, saying
 * why, when it cannot be told. */
static int
domain_qemu_pid(const char *dir, const char *name, char **why)
{
    g_autoptr(GError) error = NULL;
    int pid = pf_libvirt_domain_pid(dir, name, &error);

    if (pid == 0) {
        *why = g_strdup(error->message);
    }
    return pid;
}

/*
 * Whether dom's QEMU is e's VM's process: a VM's UUID is only what its QEMU
 * claims (see libvirt-metadata.h).  When it is not, or which it is cannot
 * be told, says so once for this UUID and pid: a VM that claims a UUID not
 * its own would otherwise say it at every interval.
 */
static gboolean
is_its_process(Worker *w, virDomainPtr dom, const Entry *e)
{
    const char *name = lv.domain_get_name(dom);
    g_autofree char *why = NULL;
    g_autofree char *key = NULL;
    int pid = 0;

    if (name == NULL) {
        why = g_strdup_printf("its name cannot be had: %s", lv.get_last_error_message());
    } else {
        pid = domain_qemu_pid(w->pid_dir, name, &why);
    }
    if (pid == e->pid) {
        return TRUE;
    }
    count(w->sh, &w->sh->counts.other_process);
    key = foreign_key(e);
    if (g_hash_table_contains(w->foreign, key)) {
        return FALSE;
    }
    if (pid != 0) {
        g_message("libvirt domain %s (%s): not putting VM pid %d's figures in its "
                  "metadata, though that VM claims its UUID: its QEMU is another "
                  "process (pid %d)", name, e->uuid, e->pid, pid);
    } else {
        g_message("libvirt domain %s (%s): not putting VM pid %d's figures in its "
                  "metadata, though that VM claims its UUID: which process is its "
                  "QEMU is not known (%s)", name != NULL ? name : "?", e->uuid, e->pid,
                  why);
    }
    g_hash_table_add(w->foreign, g_steal_pointer(&key));
    return FALSE;
}

/* Sets e's element in the domain of uuid (e->uuid), where the domain's
 * QEMU is e's VM's process, or removes the element (e NULL). */
static CallOutcome
set_one(Worker *w, const char *uuid, const Entry *e)
{
    Shared *sh = w->sh;
    const char *what = e != NULL ? "set" : "remove";
    virDomainPtr dom = lv.domain_lookup_by_uuid_string(w->conn, uuid);
    g_autofree char *message = NULL;
    int code, rc;

    if (dom == NULL) {
        code = lv.get_last_error_code();
        message = g_strdup(lv.get_last_error_message());
    } else if (e != NULL && (rc = lv.domain_is_active(dom)) != 1) {
        /* A domain that is defined but not running has no QEMU to ask
         * about: skipped quietly, as setting its live metadata would. */
        code = rc == 0 ? VIR_ERR_OPERATION_INVALID : lv.get_last_error_code();
        message = g_strdup(rc == 0 ? "domain is not running" : lv.get_last_error_message());
        lv.domain_free(dom);
    } else if (e != NULL && !is_its_process(w, dom, e)) {
        lv.domain_free(dom);
        return CALL_NOT_ITS;
    } else {
        /* Removing needs no such check: the element is pagefold's own,
         * set only where the check held, and it only goes. */
        rc = lv.domain_set_metadata(dom, VIR_DOMAIN_METADATA_ELEMENT,
                                  e != NULL ? e->element : NULL,
                                  e != NULL ? PF_LIBVIRT_METADATA_PREFIX : NULL,
                                  PF_LIBVIRT_METADATA_NS, VIR_DOMAIN_AFFECT_LIVE);
        code = rc < 0 ? lv.get_last_error_code() : VIR_ERR_OK;
        message = rc < 0 ? g_strdup(lv.get_last_error_message()) : NULL;
        lv.domain_free(dom);
    }
    if (code == VIR_ERR_OK) {
        if (e != NULL) {
            g_hash_table_add(w->published, g_strdup(uuid));
            count(sh, &sh->counts.published);
        } else {
            count(sh, &sh->counts.removed);
        }
        g_hash_table_remove(w->told, uuid);
        return CALL_DONE;
    }
    if (not_ours(code)) {
        g_debug("libvirt domain %s: %s (skipped)", uuid, message);
        if (e != NULL) {
            count(sh, &sh->counts.skipped);
        }
        return CALL_DONE;
    }
    return call_failed(w, uuid, what, message);
}

static void
publish(Worker *w, const Snapshot *snap)
{
    g_autoptr(GHashTable) now = g_hash_table_new(g_str_hash, g_str_equal);
    g_autoptr(GHashTable) claims = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, NULL);
    g_autoptr(GPtrArray) gone = g_ptr_array_new_with_free_func(g_free);
    GHashTableIter it;
    gpointer uuid, key;

    /* No VM to publish nor element to remove: no connection needed, and
     * pagefoldd on a host without libvirt stays quiet. */
    if (snap->entries->len == 0 && g_hash_table_size(w->published) == 0) {
        return;
    }
    if (!connect_libvirt(w)) {
        return;
    }
    g_mutex_lock(&w->sh->lock);
    g_free(w->pid_dir);
    w->pid_dir = g_strdup(w->sh->pid_dir);
    g_mutex_unlock(&w->sh->lock);
    for (guint i = 0; i < snap->entries->len; i++) {
        const Entry *e = &g_array_index(snap->entries, Entry, i);
        CallOutcome out;

        g_hash_table_add(claims, foreign_key(e));
        if (stopping(w->sh) || (out = set_one(w, e->uuid, e)) == CALL_LOST) {
            return;
        }
        /* The element stays where it was set unless the domain's QEMU
         * is not this VM's: of VMs that claim one UUID, only the
         * domain's own keeps it (all do when libvirt could not be
         * asked: kept till it can). */
        if (out != CALL_NOT_ITS) {
            g_hash_table_add(now, (gpointer)e->uuid);
        }
    }
    /* That a VM claims another's UUID is said again only if it claims it
     * anew: the table stays as small as the snapshot. */
    g_hash_table_iter_init(&it, w->foreign);
    while (g_hash_table_iter_next(&it, &key, NULL)) {
        if (!g_hash_table_contains(claims, key)) {
            g_hash_table_iter_remove(&it);
        }
    }
    /* Elements of VMs no longer attached would show figures that are not
     * kept any more, and those of a VM whose domain's QEMU is another
     * process now are not that domain's figures.  A domain that stopped
     * took its live metadata along: removing finds it not running, which
     * is as good. */
    g_hash_table_iter_init(&it, w->published);
    while (g_hash_table_iter_next(&it, &uuid, NULL)) {
        if (!g_hash_table_contains(now, uuid)) {
            g_ptr_array_add(gone, g_strdup(uuid));
        }
    }
    for (guint i = 0; i < gone->len; i++) {
        const char *u = g_ptr_array_index(gone, i);
        CallOutcome out;

        if (stopping(w->sh) || (out = set_one(w, u, NULL)) == CALL_LOST) {
            return;
        }
        if (out == CALL_DONE) {
            g_hash_table_remove(w->published, u);
        }
    }
}

static void
mark_done(Shared *sh, guint64 gen)
{
    g_mutex_lock(&sh->lock);
    sh->done_gen = MAX(sh->done_gen, gen);
    g_cond_broadcast(&sh->cond);
    g_mutex_unlock(&sh->lock);
}

static gpointer
worker_main(gpointer data)
{
    Worker w = {
        .sh = data,
        .published = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, NULL),
        .told = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, g_free),
        .foreign = g_hash_table_new_full(g_str_hash, g_str_equal, g_free, NULL),
    };

    for (;;) {
        Snapshot *snap = g_async_queue_pop(w.sh->queue);

        if (snap == STOP) {
            break;
        }
        publish(&w, snap);
        mark_done(w.sh, snap->gen);
        snapshot_free(snap);
    }
    disconnect_libvirt(&w);
    g_hash_table_unref(w.published);
    g_hash_table_unref(w.told);
    g_hash_table_unref(w.foreign);
    g_free(w.pid_dir);
    g_mutex_lock(&w.sh->lock);
    w.sh->finished = TRUE;
    g_cond_broadcast(&w.sh->cond);
    g_mutex_unlock(&w.sh->lock);
    shared_unref(w.sh);
    g_atomic_int_add(&workers_running, -1);
    return NULL;
}

/* ---- the main loop's side (never libvirt) ---- */

/* Hands item over; the newest wins: one the worker has not taken yet is
 * dropped, so a worker stuck in libvirt holds one snapshot, not a queue
 * of them. */
static void
post(Shared *sh, Snapshot *item)
{
    Snapshot *old;
    guint64 dropped = 0;

    g_async_queue_lock(sh->queue);
    while ((old = g_async_queue_try_pop_unlocked(sh->queue)) != NULL) {
        if (old != STOP) {
            dropped = MAX(dropped, old->gen);
        }
        snapshot_free(old);
    }
    g_async_queue_push_unlocked(sh->queue, item);
    g_async_queue_unlock(sh->queue);
    if (dropped != 0) {
        mark_done(sh, dropped);
    }
}

static void
take_snapshot(PfLibvirtMetadata *m)
{
    GPtrArray *vms = pf_scanner_get_vms(m->scanner);
    g_autofree PfCounters *per_vm = g_new0(PfCounters, MAX(vms->len, 1));
    g_autoptr(GDateTime) when = g_date_time_new_now_utc();
    Snapshot *snap = g_new0(Snapshot, 1);
    PfCounters total;

    /* The figures `pagefoldctl stats` shows, from the same collection. */
    pf_scanner_collect(m->scanner, &total, per_vm);
    snap->entries = g_array_new(FALSE, TRUE, sizeof(Entry));
    g_array_set_clear_func(snap->entries, entry_clear);
    /* Every VM with a UUID, those that claim the same one too: the worker
     * publishes only where the domain's QEMU is the VM's process, which
     * is at most one of them. */
    for (guint i = 0; i < vms->len; i++) {
        PfVm *vm = g_ptr_array_index(vms, i);
        Entry e;

        if (pf_vm_uuid_string(vm, e.uuid) == NULL) {
            continue;
        }
        e.pid = vm->pid;
        e.element = pf_libvirt_metadata_element(vm, &per_vm[i], when);
        g_array_append_val(snap->entries, e);
    }
    g_mutex_lock(&m->sh->lock);
    snap->gen = ++m->sh->posted_gen;
    m->sh->counts.snapshots++;
    g_mutex_unlock(&m->sh->lock);
    m->last_usec = g_get_monotonic_time();
    post(m->sh, snap);
}

static guint
interval_ms(PfLibvirtMetadata *m)
{
    return pf_scanner_get_knobs(m->scanner)->libvirt_metadata_millisecs;
}

static gboolean on_tick(gpointer user);

/* Next tick: when a snapshot is due, or within KNOB_POLL_MS to see the
 * knob change (control.c sets it and tells only the scanner). */
static void
schedule(PfLibvirtMetadata *m)
{
    guint interval = interval_ms(m);
    gint64 wait_ms = KNOB_POLL_MS;

    if (interval != 0) {
        gint64 due = m->last_usec + (gint64)interval * 1000;

        wait_ms = CLAMP((due - g_get_monotonic_time() + 999) / 1000, 0, KNOB_POLL_MS);
    }
    m->timer = g_timeout_add((guint)wait_ms, on_tick, m);
}

static gboolean
on_tick(gpointer user)
{
    PfLibvirtMetadata *m = user;
    guint interval = interval_ms(m);

    m->timer = 0;
    if (interval != 0 &&
        g_get_monotonic_time() >= m->last_usec + (gint64)interval * 1000) {
        take_snapshot(m);
    }
    schedule(m);
    return G_SOURCE_REMOVE;
}

PfLibvirtMetadata *
pf_libvirt_metadata_new(PfScanner *scanner, const char *uri, GError **error)
{
    g_autofree PfLibvirtMetadata *m = g_new0(PfLibvirtMetadata, 1);
    Shared *sh = g_atomic_rc_box_new0(Shared);

    sh->uri = g_strdup(uri != NULL ? uri : PF_DEFAULT_LIBVIRT_URI);
    sh->pid_dir = g_strdup(PF_LIBVIRT_QEMU_PID_DIR);
    sh->queue = g_async_queue_new_full(snapshot_free);
    g_mutex_init(&sh->lock);
    g_cond_init(&sh->cond);
    g_atomic_int_inc(&workers_running);
    m->thread = g_thread_try_new("pf-libvirt", worker_main, g_atomic_rc_box_acquire(sh),
                                 error);
    if (m->thread == NULL) {
        g_atomic_int_add(&workers_running, -1);
        shared_unref(sh);
        shared_unref(sh);
        g_prefix_error(error, "libvirt metadata: ");
        return NULL;
    }
    m->scanner = scanner;
    m->sh = sh;
    /* The first snapshot at the first tick. */
    m->last_usec = G_MININT64 / 2;
    schedule(m);
    return g_steal_pointer(&m);
}

void
pf_libvirt_metadata_refresh(PfLibvirtMetadata *m)
{
    if (interval_ms(m) == 0) {
        return;
    }
    take_snapshot(m);
    g_clear_handle_id(&m->timer, g_source_remove);
    schedule(m);
}

void
pf_libvirt_metadata_free(PfLibvirtMetadata *m)
{
    Shared *sh;
    gint64 deadline;
    gboolean finished;

    if (m == NULL) {
        return;
    }
    sh = m->sh;
    g_clear_handle_id(&m->timer, g_source_remove);
    g_atomic_int_set(&sh->stopping, TRUE);
    post(sh, STOP);
    deadline = g_get_monotonic_time() + PF_LIBVIRT_METADATA_STOP_WAIT_MS * G_TIME_SPAN_MILLISECOND;
    g_mutex_lock(&sh->lock);
    while (!sh->finished && g_cond_wait_until(&sh->cond, &sh->lock, deadline)) {
    }
    finished = sh->finished;
    g_mutex_unlock(&sh->lock);
    if (finished) {
        g_thread_join(m->thread);
    } else {
        g_message("libvirt at %s has not answered for %d ms: leaving its call to end "
                  "on its own", sh->uri, PF_LIBVIRT_METADATA_STOP_WAIT_MS);
        g_thread_unref(m->thread);
    }
    shared_unref(sh);
    g_free(m);
}

void
pf_libvirt_metadata_set_pid_dir(PfLibvirtMetadata *m, const char *dir)
{
    g_mutex_lock(&m->sh->lock);
    g_free(m->sh->pid_dir);
    m->sh->pid_dir = g_strdup(dir);
    g_mutex_unlock(&m->sh->lock);
}

void
pf_libvirt_metadata_get_counts(PfLibvirtMetadata *m, PfLibvirtMetadataCounts *counts)
{
    g_mutex_lock(&m->sh->lock);
    *counts = m->sh->counts;
    g_mutex_unlock(&m->sh->lock);
}

gboolean
pf_libvirt_metadata_wait(PfLibvirtMetadata *m, guint timeout_ms)
{
    Shared *sh = m->sh;
    gint64 deadline = g_get_monotonic_time() + (gint64)timeout_ms * G_TIME_SPAN_MILLISECOND;
    gboolean done;

    g_mutex_lock(&sh->lock);
    while (sh->done_gen < sh->posted_gen && !sh->finished &&
           g_cond_wait_until(&sh->cond, &sh->lock, deadline)) {
    }
    done = sh->done_gen >= sh->posted_gen;
    g_mutex_unlock(&sh->lock);
    return done;
}

guint
pf_libvirt_metadata_workers(void)
{
    return (guint)g_atomic_int_get(&workers_running);
}

void
pf_libvirt_metadata_set_library(const char *soname)
{
    g_mutex_lock(&lv_lock);
    lv_soname = soname != NULL ? soname : PF_LIBVIRT_SONAME;
    lv_loaded = FALSE;
    g_mutex_unlock(&lv_lock);
}
