/*
 * config.c - pagefoldd's configuration file (config.h): read with GKeyFile,
 * every group and key known, every value checked, before anything of it is
 * given out.
 */
#include "config.h"

#include <errno.h>

#include "hash.h"
#include "util.h"

static void
knob_clear(gpointer p)
{
    g_free(((PfConfigKnob *)p)->name);
}

void
pf_config_free(PfConfig *c)
{
    if (c == NULL) {
        return;
    }
    g_free(c->socket);
    g_free(c->agent_socket);
    g_free(c->agent_group);
    g_free(c->hash);
    g_free(c->libvirt_uri);
    g_free(c->libvirt_run_dir);
    g_array_unref(c->knobs);
    g_free(c);
}

static PfConfig *
config_new(void)
{
    PfConfig *c = g_new0(PfConfig, 1);

    c->knobs = g_array_new(FALSE, TRUE, sizeof(PfConfigKnob));
    g_array_set_clear_func(c->knobs, knob_clear);
    return c;
}

/* [pagefoldd]: the command line's options, by their long names. */
static gboolean
read_options(GKeyFile *kf, const char *path, PfConfig *c, GError **error)
{
    struct {
        const char *key;
        char **value;
    } strings[] = {
        { "socket", &c->socket },
        { "agent-socket", &c->agent_socket },
        { "agent-group", &c->agent_group },
        { "hash", &c->hash },
        { "libvirt-uri", &c->libvirt_uri },
        { "libvirt-run-dir", &c->libvirt_run_dir },
    };
    g_auto(GStrv) keys = g_key_file_get_keys(kf, "pagefoldd", NULL, NULL);

    for (char **k = keys; k != NULL && *k != NULL; k++) {
        g_autofree char *text = g_key_file_get_string(kf, "pagefoldd", *k, NULL);
        gboolean known = FALSE;
        guint64 v;

        for (gsize i = 0; i < G_N_ELEMENTS(strings); i++) {
            if (g_str_equal(*k, strings[i].key)) {
                g_free(*strings[i].value);
                *strings[i].value = g_steal_pointer(&text);
                known = TRUE;
            }
        }
        if (g_str_equal(*k, "agent-timeout")) {
            if (!pf_parse_u64(text, 1, 3600, &v, NULL)) {
                g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                            "%s: [pagefoldd] agent-timeout: '%s' is not a number of seconds "
                            "from 1 to 3600", path, text);
                return FALSE;
            }
            c->agent_timeout = (gint)v;
            known = TRUE;
        }
        if (!known) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s: [pagefoldd] %s: no such option (socket, agent-socket, "
                        "agent-group, agent-timeout, hash, libvirt-uri, libvirt-run-dir)",
                        path, *k);
            return FALSE;
        }
    }
    if (c->hash != NULL && pf_hash_lookup(c->hash) == NULL) {
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                    "%s: [pagefoldd] hash: unknown '%s' (xxh3, xxh64, crc32c, jhash2)", path,
                    c->hash);
        return FALSE;
    }
    return TRUE;
}

/* [knobs]: each set on a scratch copy, so that the knobs' own bounds say
 * what is wrong. */
static gboolean
read_knobs(GKeyFile *kf, const char *path, PfConfig *c, GError **error)
{
    g_auto(GStrv) keys = g_key_file_get_keys(kf, "knobs", NULL, NULL);
    PfKnobs scratch;

    pf_knobs_init_default(&scratch);
    for (char **k = keys; k != NULL && *k != NULL; k++) {
        g_autofree char *text = g_key_file_get_string(kf, "knobs", *k, NULL);
        g_autoptr(GError) why = NULL;
        PfConfigKnob knob = { NULL, 0 };

        if (!pf_parse_u64(text, 0, G_MAXUINT32, &knob.value, &why) ||
            !pf_knobs_set(&scratch, *k, knob.value, &why)) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "%s: [knobs] %s: %s", path,
                        *k, why->message);
            return FALSE;
        }
        /* As KSM's: 2 unmerges everything, a command rather than a
         * setting to come back to. */
        if (g_str_equal(*k, "run") && knob.value == 2) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s: [knobs] run: 0 or 1 here (2 unmerges every VM: pagefoldctl set "
                        "run 2)", path);
            return FALSE;
        }
        knob.name = g_strdup(*k);
        g_array_append_val(c->knobs, knob);
    }
    return TRUE;
}

PfConfig *
pf_config_load(const char *path, gboolean must_exist, GError **error)
{
    g_autoptr(GKeyFile) kf = g_key_file_new();
    g_autoptr(PfConfig) c = config_new();
    g_autoptr(GError) local = NULL;
    g_auto(GStrv) groups = NULL;

    if (!g_key_file_load_from_file(kf, path, G_KEY_FILE_NONE, &local)) {
        if (!must_exist && g_error_matches(local, G_FILE_ERROR, G_FILE_ERROR_NOENT)) {
            return g_steal_pointer(&c);
        }
        g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT, "%s: %s", path,
                    local->message);
        return NULL;
    }
    groups = g_key_file_get_groups(kf, NULL);
    for (char **g = groups; *g != NULL; g++) {
        if (!g_str_equal(*g, "pagefoldd") && !g_str_equal(*g, "knobs")) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s: [%s]: no such group ([pagefoldd] and [knobs])", path, *g);
            return NULL;
        }
    }
    if (!read_options(kf, path, c, error) || !read_knobs(kf, path, c, error)) {
        return NULL;
    }
    return g_steal_pointer(&c);
}

gboolean
pf_config_set_knobs(const PfConfig *c, PfKnobs *k, GError **error)
{
    PfKnobs next = *k;

    for (guint i = 0; i < c->knobs->len; i++) {
        const PfConfigKnob *knob = &g_array_index(c->knobs, PfConfigKnob, i);

        if (!pf_knobs_set(&next, knob->name, knob->value, error)) {
            return FALSE;
        }
    }
    *k = next;
    return TRUE;
}
