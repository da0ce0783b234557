/*
 * guard.c - the SIGBUS handler of guard.h: jumps back to the guarded read
 * that faulted.  Never handles a fault it did not guard.
 */
#include "guard.h"

#include <errno.h>
#include <glib.h>
#include <signal.h>

__thread sigjmp_buf *pf_guard_env;
__thread void *pf_guard_addr;

static void
sigbus_handler(int sig, siginfo_t *si, void *uc)
{
    if (pf_guard_env != NULL) {
        pf_guard_addr = si->si_addr;
        siglongjmp(*pf_guard_env, 1);
    }
    /* Not ours: let the default action happen on return. */
    signal(SIGBUS, SIG_DFL);
}

void
pf_guard_install(void)
{
    static gsize done;

    if (g_once_init_enter(&done)) {
        struct sigaction sa = { 0 };

        sa.sa_sigaction = sigbus_handler;
        /* NODEFER: we leave the handler by siglongjmp without restoring
         * the mask, and a second fault must not find SIGBUS blocked. */
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        /* Without it a memfd truncated under a read would kill pagefoldd:
         * it must not run so. */
        if (sigaction(SIGBUS, &sa, NULL) < 0) {
            g_error("cannot install the SIGBUS handler: %s", g_strerror(errno));
        }
        g_once_init_leave(&done, 1);
    }
}
