/*
 * testguest.h - tiny Linux guests in QEMU for the qemu suite and the
 * benchmarks: pfguest (tests/guest/) on the serial console, read line by
 * line on a thread of its own.
 */
#pragma once

#include <gio/gio.h>

typedef struct {
    const char *name;
    const char *agent_sock; /* memfd share=on RAM and the agent; NULL:
                             * QEMU's default anonymous RAM (kernel KSM's) */
    int ram_mib;
    int fill_mib;           /* what pfguest fills */
    int seed;
    int seconds;            /* pfguest runs this long, then powers off */
    int check_s;            /* between its checks of all it wrote */
    gboolean reboot;        /* reboot instead of powering off */
} PfGuestSpec;

typedef struct {
    GSubprocess *proc;
    GAsyncQueue *lines; /* char*, pfguest's lines from the serial console */
    GThread *reader;
    int pid;
    char *name;
} Guest;

/* QEMU_BINARY, GUEST_KERNEL and GUEST_INITRD are set. */
gboolean pf_guest_available(void);
Guest *pf_test_guest_start(const PfGuestSpec *spec);
/* Waits for a line starting with prefix; fails on a FAIL line or EOF. */
char *pf_test_guest_expect(Guest *g, const char *prefix, guint seconds);
void pf_test_guest_free(Guest *g);
