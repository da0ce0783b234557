/*
 * guard.h - reading memory that may fault.  A memfd truncated under a
 * reader raises SIGBUS; QEMU seals its RAM against shrinking, but
 * pagefoldd must survive any process it is pointed at, so guest RAM is
 * read under this guard, and a faulting region is dropped, never the
 * daemon.  Owns the SIGBUS handler; a SIGBUS outside a guarded read keeps
 * its default action.
 *
 *     sigjmp_buf env;
 *     if (sigsetjmp(env, 0) != 0) { pf_guard_env = NULL; ... pf_guard_addr ... }
 *     pf_guard_env = &env;  ... reads ...  pf_guard_env = NULL;
 */
#pragma once

#include <setjmp.h>

/* The guarded read's jump back, or NULL outside one; and, after a jump,
 * the address that faulted.  Per thread. */
extern __thread sigjmp_buf *pf_guard_env;
extern __thread void *pf_guard_addr;

/* Installs the handler, once per process. */
void pf_guard_install(void);
