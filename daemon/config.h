/*
 * config.h - pagefoldd's configuration file, /etc/pagefold/pagefoldd.conf
 * by default: a GKeyFile whose [pagefoldd] group holds the command line's
 * options by their long names and whose [knobs] group holds knobs by their
 * KSM names, e.g.
 *
 *   [pagefoldd]
 *   agent-group=libvirt-qemu
 *   agent-timeout=30
 *
 *   [knobs]
 *   pages_to_scan=1000
 *   sleep_millisecs=20
 *
 * Owns what it read: every value checked (a knob by the knobs' own
 * bounds) before any is given out, so a file with one mistake is refused
 * whole, with the line's group and key.  Never applies anything itself:
 * main.c does, at start (the command line wins over the file) and when
 * told to read it again (SIGHUP, `pagefoldctl reload`).
 */
#pragma once

#include <glib.h>

#include "knobs.h"

#define PF_DEFAULT_CONFIG "/etc/pagefold/pagefoldd.conf"

typedef struct {
    char *name;
    guint64 value;
} PfConfigKnob;

typedef struct {
    char *socket;
    char *agent_socket;
    char *agent_group;
    char *hash;
    char *libvirt_uri;
    char *libvirt_run_dir;
    gint agent_timeout; /* 0: not said */
    GArray *knobs;      /* PfConfigKnob, in the file's order */
} PfConfig;

/* The file at path, read and checked; an empty PfConfig where it does not
 * exist and may not (must_exist FALSE: the default file); NULL and error
 * otherwise, saying where. */
PfConfig *pf_config_load(const char *path, gboolean must_exist, GError **error);
/* Its knobs set in k, in order (k is not touched on error). */
gboolean pf_config_set_knobs(const PfConfig *c, PfKnobs *k, GError **error);
void pf_config_free(PfConfig *c);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfConfig, pf_config_free)
