/*
 * util.h - small pieces that pagefoldd, pagefoldctl and (from the agent
 * issue on) the agent library inside QEMU all need: the page size pagefold
 * works in, the default socket paths, the error domain, strict number parsing.
 *
 * Owns nothing at run time.  Must never depend on daemon code: QEMU links it.
 *
 * Copyright (c) 2026 The pagefold authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#pragma once

#include <glib.h>
#include <glib-unix.h>

#define PF_PAGE_SHIFT 12
#define PF_PAGE_SIZE  (1u << PF_PAGE_SHIFT)

#define PF_DEFAULT_SOCKET "/run/pagefold/pagefoldd.sock"
#define PF_DEFAULT_AGENT_SOCKET "/run/pagefold/agent.sock"

#define PF_ERROR (pf_error_quark())

typedef enum {
    PF_ERROR_FAILED,           /* anything else */
    PF_ERROR_INVALID_ARGUMENT, /* the caller sent something malformed */
    PF_ERROR_NOT_FOUND,        /* no such VM, process or region */
    PF_ERROR_EXISTS,           /* already attached */
    PF_ERROR_NO_GUEST_RAM,     /* a process without shared memfd RAM */
    PF_ERROR_CLOSED,           /* the peer closed the connection */
    PF_ERROR_WOULD_BLOCK,      /* a non-blocking socket is full or empty */
} PfError;

GQuark pf_error_quark(void);

/*
 * Listens on a UNIX socket of this type (SOCK_STREAM, SOCK_SEQPACKET) at
 * path, mode 0600, its folder made if needed.  Refuses, with
 * PF_ERROR_EXISTS, when something already listens there; removes a stale
 * socket.  Returns a non-blocking fd, or -1.
 */
int pf_unix_listen(const char *path, int type, GError **error);
/*
 * Raises the soft limit on open descriptors to the hard one: every pool
 * chunk (2 MiB) is a descriptor, in pagefoldd and in each agent whose VM
 * shares its pages.  Returns the soft limit now in force.
 */
guint64 pf_raise_nofile_limit(void);
/*
 * A source watching fd, as g_unix_fd_source_new() makes, that stays polled
 * while func runs.  GLib takes a source's descriptors out of the poll set for
 * the call and puts them back after, and each step wakes the context: one
 * more iteration of the loop for every dispatch.  Only for a func that never
 * iterates its context itself.  pf_fd_add() attaches one to the default
 * context, as g_unix_fd_add() does.
 */
GSource *pf_fd_source_new(int fd, GIOCondition cond, GUnixFDSourceFunc func, gpointer data);
guint pf_fd_add(int fd, GIOCondition cond, GUnixFDSourceFunc func, gpointer data);

gboolean pf_parse_u64(const char *text, guint64 min, guint64 max,
                      guint64 *out, GError **error);
