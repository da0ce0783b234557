/*
 * hook-fixture.h - what hook-test and hook-pagefoldd-test share
 * (hook-fixture.c): the libvirt qemu hook run as libvirtd runs it, and the
 * fixture each path runs it in.
 */
#pragma once

#include <gio/gio.h>
#include <glib.h>

#include "testproc.h"

#define UUID_GIVEN "6F9619FF-8B86-D011-B42D-00C04FC964FF"
#define UUID_CANON "6f9619ff-8b86-d011-b42d-00c04fc964ff"
#define MEMFD_SHARED "<memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>"

typedef struct {
    PfTestDaemon *d; /* NULL in cases that start none */
    char *dir;
    char *run_dir;
    char *log_dir;
    char *sock;      /* the control socket the hook is pointed at */
    GPtrArray *guests;
    int spawned;     /* a pagefoldd the hook started, not our child */
} Fixture;

/* One run of the hook: how it ended, its stdout and its stderr. */
typedef struct {
    gboolean exited;
    int status;
    char *out;
    char *err;
} Run;

void run_clear(Run *r);
G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Run, run_clear)

/* Runs the hook with exactly these arguments (NULL-terminated) and xml on
 * stdin, with HOOK_TEST_RECORD=record in its environment unless NULL;
 * fails the test unless it exits 0 (or 1, ending in --start-pagefoldd)
 * with nothing on stdout. */
void run_argv(const char *const *args, const char *xml, const char *record, Run *r);
/* The same with the fixture's socket, run and log folders, then the
 * NULL-terminated arguments (more options, libvirt's four). */
void hook(Fixture *f, Run *r, const char *xml, ...) G_GNUC_NULL_TERMINATED;
/* A domain's XML as libvirt hands it to the hook, uuid NULL: none; more
 * goes in <domain> as it is. */
char *domain_xml(const char *name, const char *uuid, const char *more);
/* What the hook wrote in the domain's log so far ("" for none). */
char *domain_log(Fixture *f, const char *name);
/* The line is in the domain's log and was said on stderr. */
void assert_said(Fixture *f, const Run *r, const char *name, const char *want);

/* A stand-in QEMU (standin-guest) of the fixture's, killed at teardown;
 * its pid. */
int start_guest(Fixture *f, const char *name, const char *uuid);
/* libvirt's record of the domain's QEMU: its root-owned status file says
 * pid; its pid file, which the QEMU could rewrite, says another. */
void write_pid(Fixture *f, const char *name, int pid);
void remove_pid(Fixture *f, const char *name);
/* Ends a process that is not our child and waits until it is gone. */
void kill_and_wait(int pid);
/* The fixture with a pagefoldd of its own (setup) or without, the hook
 * pointed at a socket nothing listens on yet (setup_bare); teardown ends
 * whatever either left, a pagefoldd the hook started included. */
void setup(Fixture *f, gconstpointer data);
void setup_bare(Fixture *f, gconstpointer data);
void teardown(Fixture *f, gconstpointer data);
