/*
 * testproc.h - running the project's programs from tests: children that
 * die with the test, the binaries meson built, pagefoldd on sockets of the
 * test's own, and pagefoldctl answers as JSON.
 */
#pragma once

#include <gio/gio.h>
#include <json-glib/json-glib.h>
#include <stdarg.h>

/* A program meson built, from the environment meson test sets. */
const char *pf_test_bin(const char *var);
/* Whether QEMU_BINARY really runs a guest (kernel, initrd or NULL) under
 * KVM here (scripts/probe-kvm: /dev/kvm can exist where QEMU 7.2 cannot
 * use it); *why says why not. */
gboolean pf_test_probe_kvm(const char *kernel, const char *initrd, char **why);
/* Spawns a child that is killed if the test dies (an orphan daemon would
 * hold meson's output pipe open). */
GSubprocess *pf_test_spawnv(GSubprocessFlags flags, const char *const *argv, GError **error);
/* The same, for a VMM that must not see the host's pagefoldd: it gets an
 * empty /run/pagefold of its own (as root). */
GSubprocess *pf_test_spawnv_apart(GSubprocessFlags flags, const char *const *argv,
                                  GError **error);
/* The same, for one that gets a tmpfs of its own on dir (as root), which
 * goes with it: others see the folder as it was. */
GSubprocess *pf_test_spawnv_tmpfs(GSubprocessFlags flags, const char *dir,
                                  const char *const *argv, GError **error);
/* A stand-in VMM (tests/standin-vmm) and its command pipes. */
typedef struct {
    GSubprocess *proc;
    GDataInputStream *out;
    GOutputStream *in;
    int pid;
    char *mode; /* "merge" or "advise": what its agent settled on */
} PfTestVmm;

/* Runs argv (standin-vmm and its options, maybe behind setpriv) and waits
 * for its "ready PID MODE"; NULL if it exits before saying so. */
PfTestVmm *pf_test_vmm_spawn(const char *const *argv);
/* Kills and reaps it. */
void pf_test_vmm_free(PfTestVmm *v);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfTestVmm, pf_test_vmm_free)

/* Sends one command line to it and returns its one-line answer. */
char *pf_test_vmm_cmd(PfTestVmm *v, const char *cmd);
char *pf_test_vmm_cmdf(PfTestVmm *v, const char *fmt, ...) G_GNUC_PRINTF(2, 3);
/* Asserts that every byte of its RAM is what it wrote. */
void pf_test_vmm_verify(PfTestVmm *v);
/* The number after the word key in the answer to cmd ("stats merged M
 * zeroed Z ...", "nonzero N"). */
gint64 pf_test_vmm_number(PfTestVmm *v, const char *cmd, const char *key);
/* One of the agent's counters, or the writers'. */
gint64 pf_test_vmm_stat(PfTestVmm *v, const char *name);
/* Pages its agent merged or zeroed so far, from one "stats". */
gint64 pf_test_vmm_merged(PfTestVmm *v);
/* Stops it (it checks all its RAM one last time), asserts a clean exit,
 * and frees it. */
void pf_test_vmm_quit(PfTestVmm *v);
/* The same with deadlines, for benchmarks that must report a stand-in that
 * hangs rather than hang with it.  Launching and waiting are apart so that
 * many stand-ins can fill their RAM at once. */
PfTestVmm *pf_test_vmm_launch(const char *const *argv, GError **error);
/* Waits for "ready PID MODE"; FALSE (G_IO_ERROR_TIMED_OUT, or it exited)
 * if it does not come within timeout_s. */
gboolean pf_test_vmm_wait_ready(PfTestVmm *v, double timeout_s, GError **error);
/* Sends one command line. */
gboolean pf_test_vmm_send(PfTestVmm *v, const char *cmd, GError **error);
/* Its next line of output, or NULL (G_IO_ERROR_TIMED_OUT, or it closed its
 * output) if none comes within timeout_s; 0 only looks. */
char *pf_test_vmm_read_line(PfTestVmm *v, double timeout_s, GError **error);

/* prog [--socket sock] then the NULL-terminated arguments, as an argv. */
GPtrArray *pf_test_argv_new(const char *prog, const char *sock, va_list ap);

typedef struct {
    char *dir;
    char *sock;       /* control */
    char *agent_sock; /* agents */
    char *log;        /* its stderr, when started logged; else NULL (the test's) */
    GSubprocess *proc;
} PfTestDaemon;

/* Starts pagefoldd with the extra NULL-terminated arguments, waits for its
 * sockets. */
PfTestDaemon *pf_test_daemon_start(const char *first_arg, ...) G_GNUC_NULL_TERMINATED;
/* The same with its stderr (its log) in a file of the test's, d->log. */
PfTestDaemon *pf_test_daemon_start_logged(const char *first_arg, ...) G_GNUC_NULL_TERMINATED;
/* All it has logged so far (started logged). */
char *pf_test_daemon_log(PfTestDaemon *d);
/* Kills it with -9, as a crash would, and waits until it is gone. */
void pf_test_daemon_kill(PfTestDaemon *d);
/* Starts it again on the same sockets (after a kill). */
void pf_test_daemon_restart(PfTestDaemon *d, const char *first_arg, ...) G_GNUC_NULL_TERMINATED;
void pf_test_daemon_free(PfTestDaemon *d);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfTestDaemon, pf_test_daemon_free)

/* Runs pagefoldctl --json with the arguments; asserts it succeeds. */
JsonNode *pf_test_ctl_json(PfTestDaemon *d, const char *first_arg, ...) G_GNUC_NULL_TERMINATED;
/* The VM of that name in an array of VM objects (list's, or stats' "vms"),
 * or NULL. */
JsonObject *pf_test_find_vm(JsonArray *vms, const char *name);
/* The same by pid. */
JsonObject *pf_test_find_vm_pid(JsonArray *vms, int pid);
/* The VM of that name in pagefoldctl list, as a new reference, or NULL. */
JsonObject *pf_test_listed_vm(PfTestDaemon *d, const char *name);
/* Waits until pagefoldd lists the stand-in's VM in the mode its agent
 * settled on: the agent's READY is checked off pagefoldd's main loop, so
 * "ready" from the stand-in comes before pagefoldd has made the VM. */
void pf_test_daemon_wait_vmm(PfTestDaemon *d, PfTestVmm *v);
/* The VM of that name in pagefoldctl stats, as a new reference, or NULL
 * when it is not attached. */
JsonObject *pf_test_vm_stats(PfTestDaemon *d, const char *name);
/* One of its counters in pagefoldctl stats; -1 when it is not attached, so
 * that a test may poll until it is. */
gint64 pf_test_vm_counter(PfTestDaemon *d, const char *name, const char *counter);
/* pagefoldd's pid (the test's child). */
int pf_test_daemon_pid(PfTestDaemon *d);
/* The pid of whoever listens on a UNIX stream socket (a pagefoldd that is
 * not the test's child), or 0. */
int pf_test_listener_pid(const char *path);

/* The daemon's end of the agent protocol, played by hand: for tests and
 * benchmarks of the agent library alone. */
typedef struct _PfAgent PfAgent;
typedef struct {
    char *dir;
    char *path;
    int listen_fd;
    int conn;
    guint32 version; /* WELCOME's: PF_PROTO_VERSION unless set before */
} PfTestPeer;

PfTestPeer *pf_test_peer_new(void);
/* Starts the agent against the peer and answers its handshake, offering
 * merge mode; returns the mode the agent chose. */
int pf_test_peer_accept(PfTestPeer *p, PfAgent *agent);
void pf_test_peer_free(PfTestPeer *p);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfTestPeer, pf_test_peer_free)
/* A pool chunk as pagefoldd makes it: sealed after its writable mapping. */
int pf_test_pool_chunk(guint32 n_slots, gboolean seal, guint8 **map);

/* A stand-in guest (tests/standin-guest: memfd RAM like QEMU's, no
 * agent) named name, with QEMU's -uuid uuid (NULL: none), 16 MiB of which
 * half are the same in every guest; its pid in *pid once it is ready. */
GSubprocess *pf_test_standin_guest(const char *name, const char *uuid, int seed, int *pid);

/* A child of uid nobody that connects to d's agent socket in a loop, as
 * fast as it can, for that many seconds (0: until it is killed, with
 * pf_guest_release()): it holds up to 4 connections, and drops the oldest
 * for a new one.  Its pid. */
int pf_test_flooder(PfTestDaemon *d, guint seconds);

/* Writes libvirt's status file for domain name in dir, NAME.xml, as
 * libvirt's qemu driver does for a running domain (<domstatus pid='PID'>,
 * root's, 0600), with pid as its text ("4242x": not a pid); NULL removes
 * it. */
void pf_test_write_libvirt_status(const char *dir, const char *name, const char *pid);

/* Writes a sysfs knob in place (g_file_set_contents would rename). */
gboolean pf_test_write_sysfs(const char *path, const char *value);

/* Mappings of a process that overlap [start, start + size); all of them
 * when size is 0. */
gint64 pf_test_count_vmas(int pid, guint64 start, guint64 size);
/* The sum of one smaps field ("Pss", "ShmemPmdMapped", ...) in KiB over the
 * mappings that overlap [start, start + size). */
gint64 pf_test_smaps_sum(int pid, guint64 start, guint64 size, const char *field);
/* How many mappings of the range (size 0: all) have flag in their VmFlags
 * ("uw": registered for userfaultfd write protection, "dd": not dumped). */
gint64 pf_test_count_vmas_flag(int pid, guint64 start, guint64 size, const char *flag);
/* One field of /proc/PID/smaps_rollup in KiB ("Pss", "Pss_Shmem", ...):
 * the whole process, far cheaper than summing smaps. */
gint64 pf_test_rollup_kib(int pid, const char *which);

/* KiB allocated in a process's guest RAM memfd (memory-backend-memfd),
 * from its st_blocks; -1 if it has none. */
gint64 pf_test_memfd_kib(int pid);
/* KiB allocated in the pool chunks a process holds a descriptor or a
 * mapping of, the zero chunk aside (reading it may allocate), each chunk
 * counted once; *n_chunks gets how many.  What its references keep from
 * being freed. */
gint64 pf_test_pool_kib(int pid, guint *n_chunks);

/* One packet of len bytes on sock, with descriptor fd (SCM_RIGHTS) unless
 * it is -1; FALSE with errno set if it did not go whole. */
gboolean pf_test_send_fd(int sock, const void *buf, gsize len, int fd);
/* One packet into buf (len bytes at most): its length, with *fd the
 * descriptor it carried or -1; 0 at EOF, -1 with errno on failure. */
gssize pf_test_recv_fd(int sock, void *buf, gsize len, int *fd);
