/*
 * control.c - the socket side of pagefoldd's control socket (control.h):
 * listening, accepting, and each client's framing, one request per line in
 * and one reply per line out, in the order asked, a client's next lines
 * held back while one of its commands is answered.
 *
 * The socket is served by a thread of its own.  Every command runs on the
 * main loop, as the scanner's state is the main loop's, and its reply
 * comes back to the thread; but a read (stats, knobs, list) that the main
 * loop has not answered within FALLBACK_MS is answered on the thread, from
 * the view (view.h) the main loop last published: the main loop scans, and
 * on a host whose cores are all busy it waits for one, while the thread,
 * mostly asleep, is scheduled at once.  The main loop publishes a view
 * after every command, before its reply, and every COUNT_PERIOD_MS, its
 * counters with it; a reply that tells them (stats) waits
 * COUNTERS_FALLBACK_MS for the main loop before it is answered from a
 * view, and then only from one younger than COUNTERS_MAX_AGE_MS.  So a
 * client reads its own writes, never an older view than the main loop
 * answered it from, and counters a second or two old only when the main
 * loop is that late.
 *
 * Owns the thread and its context, the listening socket, each client's
 * descriptor, buffers and sources, each call (a request on its way through
 * the main loop), and the views published.  Must never parse a request or
 * know a command (control-commands.c does), never touch the scanner or run
 * a command off the main loop (only pf_control_command_answer() on a
 * view), never block on a client (one that does not read its replies is
 * closed), and never let a client's input, however long or malformed,
 * reach another client.
 */
#include "control.h"

#include <errno.h>
#include <glib-unix.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control-commands.h"
#include "cpu-use.h"
#include "pf-config.h"
#include "util.h"

#define MAX_CLIENTS 64
#define MAX_PENDING_OUTPUT (16u << 20)
#define FALLBACK_MS 20
#define COUNTERS_FALLBACK_MS 500
#define COUNTERS_MAX_AGE_MS 2000
#define COUNT_PERIOD_MS 1000

struct _PfControl {
    PfScanner *scanner;  /* the main loop's */
    PfControlReload reload; /* the embedder's `reload`, or none */
    char *path;
    int listen_fd;
    GMainContext *context; /* the thread's */
    GThread *thread;
    GSource *listen_source;
    GPtrArray *clients;  /* the thread's */
    GPtrArray *laters;   /* the main loop's: calls waiting for a job */
    guint count_timer;   /* the main loop's */
    gint stopped;        /* atomic: pf_control_free() has begun */
    GMutex lock;
    PfView *published;   /* under lock */
};

typedef struct _Call Call;

typedef struct {
    PfControl *ctl;
    int fd;
    GSource *watch;
    GSource *out_watch;
    GByteArray *in;
    GByteArray *out;
    gboolean discarding; /* inside an over-long line: drop to its end */
    gboolean eof;        /* it sent all it will: it goes once answered */
    Call *call;          /* the request it waits for: its next lines wait
                          * too, as QMP answers in order */
} Client;

/* Whether the main loop is to run a call: QUEUED until it starts it
 * (RUNNING), or the thread takes it (TAKEN: answered from a view, or its
 * client gone) before. */
enum { CALL_QUEUED, CALL_RUNNING, CALL_TAKEN };

/* One request, from the thread to the main loop and its reply back;
 * refcounted, as both hold it. */
struct _Call {
    PfControl *ctl;
    Client *client;      /* the thread's: NULL once answered or gone */
    char *line;
    gsize len;
    gint state;          /* atomic: CALL_* */
    gint64 start_usec;
    GSource *run;        /* call_run() on the main loop's context */
    GSource *fallback;   /* the thread's */
    PfControlLater *later; /* the main loop's */
};

static void client_process(Client *cl);
static gboolean client_flush(Client *cl);
static void client_send(Client *cl, const char *text);
static gboolean client_in_cb(gint fd, GIOCondition cond, gpointer user);

/* ---- the views ---- */

/* On the main loop; takes v. */
static void
publish(PfControl *c, PfView *v)
{
    PfView *old;

    g_mutex_lock(&c->lock);
    old = c->published;
    c->published = v;
    g_mutex_unlock(&c->lock);
    if (old != NULL) {
        pf_view_unref(old);
    }
}

static PfView *
get_published(PfControl *c)
{
    PfView *v;

    g_mutex_lock(&c->lock);
    v = c->published != NULL ? pf_view_ref(c->published) : NULL;
    g_mutex_unlock(&c->lock);
    return v;
}

/* On the main loop: the scanner as it is now, or as the reply just made
 * was built from (made on the main loop just now too), if given. */
static void
publish_now(PfControl *c, PfView *made)
{
    publish(c, made != NULL ? made : pf_view_new(c->scanner));
}

static gboolean
count_cb(gpointer user)
{
    pf_cpu_enter(PF_CPU_CONTROL);
    publish_now(user, NULL);
    pf_cpu_leave();
    return G_SOURCE_CONTINUE;
}

/* ---- sources ---- */

/* func(data) on context, soon: never within this call, whoever owns it.
 * Its source goes to *keep if keep is given, else it is not kept. */
static void
post(GMainContext *context, GSourceFunc func, gpointer data, GDestroyNotify destroy,
     GSource **keep)
{
    GSource *src = g_idle_source_new();

    g_source_set_priority(src, G_PRIORITY_DEFAULT);
    g_source_set_callback(src, func, data, destroy);
    g_source_attach(src, context);
    if (keep != NULL) {
        *keep = src;
    } else {
        g_source_unref(src);
    }
}

static GSource *
watch_fd(PfControl *c, int fd, GIOCondition cond, GUnixFDSourceFunc func, gpointer data)
{
    GSource *src = pf_fd_source_new(fd, cond, func, data);

    g_source_attach(src, c->context);
    return src;
}

static void
unwatch(GSource **src)
{
    if (*src != NULL) {
        g_source_destroy(*src);
        g_clear_pointer(src, g_source_unref);
    }
}

/* ---- calls ---- */

static Call *
call_ref(Call *call)
{
    return g_atomic_rc_box_acquire(call);
}

static void control_unref(PfControl *c);

static void
call_clear(gpointer data)
{
    Call *call = data;

    g_assert(call->later == NULL && call->fallback == NULL);
    g_clear_pointer(&call->run, g_source_unref);
    g_free(call->line);
    control_unref(call->ctl);
}

/* On the thread: no main loop is to run the call.  FALSE if it runs it
 * already. */
static gboolean
call_take(Call *call)
{
    if (!g_atomic_int_compare_and_exchange(&call->state, CALL_QUEUED, CALL_TAKEN)) {
        return FALSE;
    }
    /* Thread-safe: the main loop drops it unrun, the line with it. */
    g_source_destroy(call->run);
    return TRUE;
}

static void
call_unref(gpointer call)
{
    g_atomic_rc_box_release_full(call, call_clear);
}

/* On the thread: the reply goes to the call's client, if it still waits
 * for one; then its next lines. */
static void
call_deliver(Call *call, const char *reply)
{
    Client *cl = call->client;

    if (cl == NULL) {
        return;
    }
    call->client = NULL;
    unwatch(&call->fallback);
    cl->call = NULL;
    call_unref(call);
    client_send(cl, reply);
    if (cl->watch == NULL && !cl->eof) {
        cl->watch = watch_fd(cl->ctl, cl->fd, G_IO_IN | G_IO_HUP | G_IO_ERR, client_in_cb, cl);
    }
    client_process(cl);
    client_flush(cl);
}

typedef struct {
    Call *call;
    char *reply;
} Reply;

static void
reply_free(gpointer data)
{
    Reply *r = data;

    call_unref(r->call);
    g_free(r->reply);
    g_free(r);
}

static gboolean
reply_cb(gpointer data)
{
    Reply *r = data;

    if (!g_atomic_int_get(&r->call->ctl->stopped)) {
        call_deliver(r->call, r->reply);
    }
    return G_SOURCE_REMOVE;
}

/* On the main loop: the reply to the thread; takes reply. */
static void
call_reply(Call *call, char *reply)
{
    Reply *r = g_new0(Reply, 1);

    r->call = call_ref(call);
    r->reply = reply;
    post(call->ctl->context, reply_cb, r, reply_free, NULL);
}

static void
call_later_done(PfControlLater *l, gpointer user)
{
    Call *call = user;
    PfControl *c = call->ctl;
    char *reply = pf_control_later_steal_reply(l);

    publish_now(c, pf_control_later_steal_view(l));
    call->later = NULL;
    pf_control_later_free(l);
    call_reply(call, reply);
    g_ptr_array_remove_fast(c->laters, call);
}

/* On the main loop: the command runs. */
static gboolean
call_run(gpointer data)
{
    Call *call = data;
    PfControl *c = call->ctl;
    PfView *view = NULL;
    char *reply;

    if (g_atomic_int_get(&c->stopped) ||
        !g_atomic_int_compare_and_exchange(&call->state, CALL_QUEUED, CALL_RUNNING)) {
        return G_SOURCE_REMOVE;
    }
    pf_cpu_enter(PF_CPU_CONTROL);
    reply = pf_control_command_execute(c->scanner, call->line, call->len,
                                       c->reload.func != NULL ? &c->reload : NULL,
                                       &call->later, &view);
    if (reply != NULL) {
        publish_now(c, view);
        call_reply(call, reply);
    } else {
        g_clear_pointer(&view, pf_view_unref); /* the job's view comes at its end */
        publish_now(c, NULL);
        g_ptr_array_add(c->laters, call_ref(call));
        pf_control_later_watch(call->later, call_later_done, call);
    }
    pf_cpu_leave();
    return G_SOURCE_REMOVE;
}

/* On the main loop: the call's client went; so does its job's reply. */
static gboolean
call_forget(gpointer data)
{
    Call *call = data;

    if (call->later != NULL) {
        g_clear_pointer(&call->later, pf_control_later_free);
        g_ptr_array_remove_fast(call->ctl->laters, call);
    }
    return G_SOURCE_REMOVE;
}

static gboolean call_fallback(gpointer data);

/* On the thread: call_fallback() in ms. */
static void
fallback_in(Call *call, guint ms)
{
    call->fallback = g_timeout_source_new(ms);
    g_source_set_callback(call->fallback, call_fallback, call_ref(call), call_unref);
    g_source_attach(call->fallback, call->ctl->context);
}

/* On the thread: the main loop has not answered in time. */
static gboolean
call_fallback(gpointer data)
{
    Call *call = data;
    g_autoptr(PfView) view = get_published(call->ctl);
    g_autofree char *reply = NULL;
    gboolean counters_read = FALSE;
    gint64 now = g_get_monotonic_time();
    gint64 due = call->start_usec + COUNTERS_FALLBACK_MS * 1000;

    g_clear_pointer(&call->fallback, g_source_unref);
    if (view == NULL || call->client == NULL ||
        (reply = pf_control_command_answer(view, call->line, call->len, &counters_read)) ==
            NULL) {
        return G_SOURCE_REMOVE;
    }
    if (counters_read && now < due) {
        fallback_in(call, (guint)((due - now) / 1000 + 1));
        return G_SOURCE_REMOVE;
    }
    if (counters_read && now - view->counted_usec > COUNTERS_MAX_AGE_MS * 1000) {
        return G_SOURCE_REMOVE;
    }
    /* A read the main loop has begun, and been taken off its CPU in,
     * is answered here too: the view it will publish before its reply
     * is no older than this one, and its reply finds the call answered. */
    call_take(call);
    call_deliver(call, reply);
    return G_SOURCE_REMOVE;
}

/* On the thread: the client's request goes to the main loop. */
static void
call_start(Client *cl, const char *line, gsize len)
{
    Call *call = g_atomic_rc_box_new0(Call);

    call->ctl = g_atomic_rc_box_acquire(cl->ctl);
    call->client = cl;
    call->start_usec = g_get_monotonic_time();
    call->line = g_strndup(line, len);
    call->len = len;
    cl->call = call;
    post(NULL, call_run, call_ref(call), call_unref, &call->run);
    fallback_in(call, FALLBACK_MS);
}

/* ---- the socket ---- */

static void
client_close(Client *cl)
{
    g_ptr_array_remove(cl->ctl->clients, cl);
}

static gboolean client_out_cb(gint fd, GIOCondition cond, gpointer user);

/* Returns FALSE when it had to close the client (cl is then freed): it
 * failed, or it has sent all it will and has every reply. */
static gboolean
client_flush(Client *cl)
{
    while (cl->out->len > 0) {
        ssize_t n = send(cl->fd, cl->out->data, cl->out->len, MSG_NOSIGNAL);

        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN) {
                break;
            }
            client_close(cl);
            return FALSE;
        }
        g_byte_array_remove_range(cl->out, 0, (guint)n);
    }
    if (cl->out->len > MAX_PENDING_OUTPUT) {
        g_message("control: closing a client that does not read its replies");
        client_close(cl);
        return FALSE;
    }
    if (cl->out->len > 0 && cl->out_watch == NULL) {
        cl->out_watch = watch_fd(cl->ctl, cl->fd, G_IO_OUT, client_out_cb, cl);
    }
    if (cl->eof && cl->call == NULL && cl->out->len == 0) {
        client_close(cl);
        return FALSE;
    }
    return TRUE;
}

static gboolean
client_out_cb(gint fd, GIOCondition cond, gpointer user)
{
    Client *cl = user;

    unwatch(&cl->out_watch);
    client_flush(cl);
    return G_SOURCE_REMOVE;
}

static void
client_send(Client *cl, const char *text)
{
    g_byte_array_append(cl->out, (const guint8 *)text, (guint)strlen(text));
    g_byte_array_append(cl->out, (const guint8 *)"\n", 1);
}

static void
client_process(Client *cl)
{
    guint8 *nl;

    while (cl->call == NULL && (nl = memchr(cl->in->data, '\n', cl->in->len)) != NULL) {
        gsize len = (gsize)(nl - cl->in->data);

        if (cl->discarding) {
            cl->discarding = FALSE;
        } else {
            gsize l = len;

            if (l > 0 && cl->in->data[l - 1] == '\r') {
                l--;
            }
            if (l > 0) {
                call_start(cl, (const char *)cl->in->data, l);
            }
        }
        g_byte_array_remove_range(cl->in, 0, (guint)len + 1);
    }
    if (cl->call == NULL && cl->in->len > PF_CONTROL_MAX_LINE) {
        if (!cl->discarding) {
            g_autofree char *desc = g_strdup_printf(
                "request longer than %d bytes; discarded up to the next newline",
                PF_CONTROL_MAX_LINE);
            g_autofree char *reply = pf_control_reply_error("GenericError", desc, NULL);

            client_send(cl, reply);
            cl->discarding = TRUE;
        }
        g_byte_array_set_size(cl->in, 0);
    }
}

static gboolean
client_in_cb(gint fd, GIOCondition cond, gpointer user)
{
    Client *cl = user;
    guint8 buf[16384];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);

    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        return G_SOURCE_CONTINUE;
    }
    if (n < 0) {
        unwatch(&cl->watch);
        client_close(cl);
        return G_SOURCE_REMOVE;
    }
    if (n == 0) {
        /* Shut for writing (socat, nc -N, a script's last line): its
         * lines are answered, then it goes. */
        unwatch(&cl->watch);
        cl->eof = TRUE;
        client_flush(cl);
        return G_SOURCE_REMOVE;
    }
    g_byte_array_append(cl->in, buf, (guint)n);
    client_process(cl);
    if (!client_flush(cl)) {
        return G_SOURCE_REMOVE;
    }
    if (cl->call != NULL && cl->in->len > PF_CONTROL_MAX_LINE) {
        /* Enough waiting behind the call: read on when it is answered. */
        unwatch(&cl->watch);
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

static void
client_free(Client *cl)
{
    Call *call = cl->call;

    if (call != NULL) {
        call->client = NULL;
        unwatch(&call->fallback);
        if (!call_take(call) && !g_atomic_int_get(&cl->ctl->stopped)) {
            post(NULL, call_forget, call_ref(call), call_unref, NULL);
        }
        call_unref(call);
    }
    unwatch(&cl->watch);
    unwatch(&cl->out_watch);
    close(cl->fd);
    g_byte_array_unref(cl->in);
    g_byte_array_unref(cl->out);
    g_free(cl);
}

static gboolean
listen_cb(gint fd, GIOCondition cond, gpointer user)
{
    PfControl *c = user;
    int cfd = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    Client *cl;
    g_autofree char *greeting = NULL;

    if (cfd < 0) {
        return G_SOURCE_CONTINUE;
    }
    if (c->clients->len >= MAX_CLIENTS) {
        static const char busy[] =
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"too many clients\"}}\n";

        (void)!send(cfd, busy, sizeof(busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        close(cfd);
        return G_SOURCE_CONTINUE;
    }
    cl = g_new0(Client, 1);
    cl->ctl = c;
    cl->fd = cfd;
    cl->in = g_byte_array_new();
    cl->out = g_byte_array_new();
    g_ptr_array_add(c->clients, cl);
    greeting = g_strdup_printf(
        "{\"QMP\": {\"version\": {\"pagefold\": \"%s\"}, \"capabilities\": []}}", PF_VERSION);
    client_send(cl, greeting);
    cl->watch = watch_fd(c, cfd, G_IO_IN | G_IO_HUP | G_IO_ERR, client_in_cb, cl);
    client_flush(cl);
    return G_SOURCE_CONTINUE;
}

static gpointer
control_thread(gpointer data)
{
    PfControl *c = data;

    g_main_context_push_thread_default(c->context);
    /* Not g_main_loop_run(): a quit before it ran would be lost. */
    while (!g_atomic_int_get(&c->stopped)) {
        g_main_context_iteration(c->context, TRUE);
    }
    g_main_context_pop_thread_default(c->context);
    return NULL;
}

/* ---- life ---- */

static void
control_clear(gpointer data)
{
    PfControl *c = data;

    g_clear_pointer(&c->published, pf_view_unref);
    g_mutex_clear(&c->lock);
    g_clear_pointer(&c->context, g_main_context_unref);
    g_free(c->path);
}

static void
control_unref(PfControl *c)
{
    g_atomic_rc_box_release_full(c, control_clear);
}

PfControl *
pf_control_new(PfScanner *scanner, const char *path, GError **error)
{
    PfControl *c = g_atomic_rc_box_new0(PfControl);

    c->scanner = scanner;
    g_mutex_init(&c->lock);
    c->clients = g_ptr_array_new_with_free_func((GDestroyNotify)client_free);
    c->laters = g_ptr_array_new_with_free_func(call_unref);
    c->listen_fd = pf_unix_listen(path, SOCK_STREAM, error);
    if (c->listen_fd < 0) {
        pf_control_free(c);
        return NULL;
    }
    c->path = g_strdup(path);
    c->context = g_main_context_new();
    c->listen_source = watch_fd(c, c->listen_fd, G_IO_IN, listen_cb, c);
    return c;
}

void
pf_control_start(PfControl *c)
{
    g_return_if_fail(c->thread == NULL);
    /* The first view, of pagefoldd set up (the VMs attached): a read the
     * thread answers before the main loop publishes again sees them. */
    publish(c, pf_view_new(c->scanner));
    c->count_timer = g_timeout_add(COUNT_PERIOD_MS, count_cb, c);
    c->thread = g_thread_new("pf-control", control_thread, c);
}

void
pf_control_free(PfControl *c)
{
    if (c == NULL) {
        return;
    }
    g_atomic_int_set(&c->stopped, 1);
    if (c->thread != NULL) {
        g_main_context_wakeup(c->context);
        g_thread_join(c->thread);
    }
    /* The thread is gone: what it held is this thread's now. */
    g_clear_pointer(&c->clients, g_ptr_array_unref);
    unwatch(&c->listen_source);
    while (c->context != NULL && g_main_context_iteration(c->context, FALSE)) {
        /* replies posted to the thread, dropped */
    }
    for (guint i = 0; c->laters != NULL && i < c->laters->len; i++) {
        Call *call = g_ptr_array_index(c->laters, i);

        g_clear_pointer(&call->later, pf_control_later_free);
    }
    g_clear_pointer(&c->laters, g_ptr_array_unref);
    g_clear_handle_id(&c->count_timer, g_source_remove);
    if (c->listen_fd >= 0) {
        close(c->listen_fd);
        if (c->path != NULL) {
            unlink(c->path);
        }
    }
    control_unref(c);
}

void
pf_control_set_reload(PfControl *c, gboolean (*func)(gpointer user, GError **error),
                      gpointer user)
{
    c->reload = (PfControlReload){ func, user };
}
