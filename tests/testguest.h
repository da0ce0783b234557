/*
 * testguest.h - tiny Linux guests in QEMU for the qemu suite and the
 * benchmarks: pfguest (tests/guest/) on the serial console, read line by
 * line on a thread of its own.
 */
#pragma once

#include <gio/gio.h>
#include <json-glib/json-glib.h>

typedef struct {
    const char *name;
    const char *agent_sock; /* memfd share=on RAM and the agent; NULL:
                             * QEMU's default anonymous RAM (kernel KSM's) */
    int ram_mib;
    int fill_mib;           /* what pfguest fills */
    int seed;
    int seconds;            /* pfguest runs at least this long, and until
                             * pf_test_guest_tell_stop(); then powers off */
    int check_s;            /* between its checks of all it wrote */
    gboolean reboot;        /* reboot instead of powering off */
    gboolean private_ram;   /* with the agent, memfd RAM without share=on */
    const char *const *extra; /* more QEMU arguments, NULL-terminated */
    const char *cmdline;    /* more of the guest kernel's command line */
    int maxmem_mib;         /* room for memory hotplug (2 slots), or 0 */
    gboolean own_ram;       /* guest RAM comes from extra (NUMA nodes);
                             * without agent_sock, no agent either */
    gboolean no_name;       /* no -name: QEMU's default */
    const char *accel;      /* QEMU's accelerator; NULL: tcg */
} PfGuestSpec;

typedef struct {
    GSubprocess *proc;
    GAsyncQueue *lines; /* char*, pfguest's lines from the serial console */
    GThread *reader;
    GMutex tail_lock;
    GQueue tail;    /* char*, the console's last lines, all of them */
    int pid;
    char *name;
    char *dir;      /* its QMP socket, and whatever a test puts there */
    char *qmp_path;
} Guest;

/* A program scripts/build-qemu builds next to QEMU_BINARY (virtiofsd,
 * vhost-user-blk: the patched vhost-user back-ends). */
char *pf_test_qemu_tool(const char *name);

/* A virtiofsd serving a new empty folder, share (a tmpfs of its own), on
 * sock. */
typedef struct {
    GSubprocess *proc;
    char *dir;    /* its socket, and share/ */
    char *share;
    char *sock;
    char *files;  /* the share as the test reads it: virtiofsd's root (its
                   * chroot), a tmpfs only it sees */
} PfVirtiofsd;

/* binary (needs root: its chroot sandbox), once its socket is there. */
PfVirtiofsd *pf_virtiofsd_start(const char *binary);
/* It ends with its VMM's connection; killed if it has not.  The share and
 * what the guest wrote there go too. */
void pf_virtiofsd_free(PfVirtiofsd *v);

/* QEMU_BINARY, GUEST_KERNEL and GUEST_INITRD are set. */
gboolean pf_guest_available(void);
Guest *pf_test_guest_start(const PfGuestSpec *spec);
/* Waits for a line starting with prefix; fails on a FAIL line or EOF. */
char *pf_test_guest_expect(Guest *g, const char *prefix, guint seconds);
/* The same for a line that contains text anywhere: QEMU's own lines
 * (those that say "pagefold") start with its program name. */
char *pf_test_guest_expect_text(Guest *g, const char *text, guint seconds);
/* The test is done with the guest: pfguest ends its run once its seconds
 * have passed (never before it is told: a slow host must not see a guest
 * end while the test still needs it). */
void pf_test_guest_tell_stop(Guest *g);
/* Tells it, and waits for its "PFGUEST PASS". */
char *pf_test_guest_expect_pass(Guest *g, guint seconds);
/* A whole check of all the guest wrote, begun after this call, passes
 * (lines queued before it are passed over, and fail on a FAIL). */
void pf_test_guest_check_now(Guest *g);
void pf_test_guest_free(Guest *g);
/* Runs one QMP command (arguments as a JSON object text, or NULL) on a
 * connection of its own; returns its "return", fails on an "error". */
JsonNode *pf_test_guest_qmp(Guest *g, const char *command, const char *arguments);
/* x-query-pagefold: the guest's one agent (a new reference), and one of
 * its numbers. */
JsonObject *pf_test_guest_agent_info(Guest *g);
gint64 pf_test_guest_agent_stat(Guest *g, const char *member);
/* Pages its agent merged or zeroed so far (its "merged" and "zeroed"). */
gint64 pf_test_guest_agent_merged(Guest *g);
/* The same as pf_test_guest_qmp(), for a command that must fail: returns
 * its error's text. */
char *pf_test_guest_qmp_error(Guest *g, const char *command, const char *arguments);
