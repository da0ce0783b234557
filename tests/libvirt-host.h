/*
 * libvirt-host.h - the host's libvirt as the libvirt test borrows it
 * (libvirt-host.c): its daemons, the hook it runs, pagefoldd (the hook's,
 * on the default sockets) and the test's domains.  Every wait has a
 * deadline, and every call that fails fails the test.
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

#include "testproc.h"

#define HOOK_DIR "/etc/libvirt/hooks/qemu.d"
#define HOOK_FILE HOOK_DIR "/zz-pagefold-test"
/* The hook as the package pagefold installs it. */
#define PACKAGE_HOOK HOOK_DIR "/pagefold"
#define LIBVIRTD_PID "/run/libvirtd.pid"
#define STOCK_QEMU "/usr/bin/qemu-system-x86_64"
#define DOMAIN_LOG_DIR "/var/log/libvirt/qemu"
#define PAGEFOLDD_LOG_DIR "/var/log/pagefold"
#define PAGEFOLDD_LOG PAGEFOLDD_LOG_DIR "/pagefoldd.log"
#define VIRTLOGD_PID "/run/virtlogd.pid"
/* TCG boots and fills are slow on two loaded cores. */
#define BOOT_S 180

typedef struct {
    const char *name;
    const char *emulator;   /* NULL: the patched QEMU */
    gboolean memfd;         /* shared memfd RAM */
    gboolean nosharepages;
    int seconds, reboot;    /* pfguest.seconds, pfguest.reboot */
    int seed;
    const char *merge_domain; /* from <metadata>, or NULL */
    const char *virtiofs_dir; /* shared with the guest by the patched
                               * virtiofsd (tag "pf"), or NULL */
} DomSpec;

typedef struct {
    char *name;
    char *uuid;
    char *console;
    gsize console_seen; /* bytes of the console already looked at */
} Dom;

void dom_free(Dom *d);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(Dom, dom_free)

/* virsh with up to three arguments, which must succeed; its stdout. */
char *virsh(const char *a1, const char *a2, const char *a3);
/* Waits up to 30 s for process pid to be gone. */
void wait_gone(int pid);
/* libvirtd started (virtlogd first, where none runs), once it answers;
 * stopped with sig, and gone. */
void libvirtd_start(void);
void libvirtd_stop(int sig);
/* pagefoldd's process, found by its control socket's peer (0: none);
 * stopped (SIGTERM), and gone. */
int pagefoldd_pid(void);
void pagefoldd_stop(void);
/* pagefoldd's control socket, for pf_test_ctl_json() and the like (only
 * its sock: pagefoldd is the hook's). */
PfTestDaemon *pagefoldd_ctl(void);
/* The hook libvirt runs: the one built here, starting pagefoldd_path
 * (NULL: one that is not there).  Not in installed mode. */
void install_hook(const char *pagefoldd_path);
/* Whether the suite runs against the installed packages
 * (PAGEFOLD_TEST_INSTALLED), and the hook libvirt runs: the package's
 * there, else the test's. */
gboolean installed_mode(void);
const char *hook_file(void);
/* Installed mode: the running pagefoldd at the test's pace (the hook's
 * arguments set it otherwise); nothing where none runs. */
void pagefoldd_test_pace(void);

/* Defines the domain of s (undefined at teardown) and starts it. */
Dom *dom_start(const DomSpec *s);
/* Its QEMU's pid, from libvirt's pid file (0: none). */
int dom_pid(const Dom *d);
/* virsh destroy, and its QEMU gone. */
void dom_destroy(const Dom *d);
/* The domain's console from where the last call stopped, until a line
 * that starts with want; a FAIL line fails the test. */
void dom_expect(Dom *d, const char *want);
/* The domain's own log: libvirt's, with the hook's lines in it. */
char *dom_log(const Dom *d);
/* Waits until the domain's log holds want. */
void wait_log(const Dom *d, const char *want);
/* Waits for pagefoldd to list the domain's VM in mode; its entry. */
JsonObject *wait_listed(const Dom *d, const char *mode);
/* Waits for pagefoldd to list it no more. */
void wait_unlisted(const Dom *d);
/* A counter of the VM of that name in pagefoldctl stats, or (NULL) of
 * them all. */
gint64 stat_of(const char *vm_name, const char *counter);
/* Waits until pages_sharing of the VM of that name (NULL: of them all)
 * is at least at_least. */
void wait_sharing(const char *vm_name, gint64 at_least);

/* Why the test cannot run here, or NULL. */
const char *cannot_run(void);
/* Takes the host's libvirt for the test: the guest's kernel where
 * libvirt-qemu reads it, the hook installed, libvirtd started again to
 * read it, domains a crashed run left undefined.  teardown() gives it all
 * back (only once: a signal may call it again). */
void setup(void);
void teardown(void);
