/*
 * faultsys.h - the agent's system calls, made to fail when a test says so
 * (PfAgentSyscalls, see agent.h): which call, after how many good ones,
 * how often, with which errno.  Used by the tests that link the agent
 * (the agent-proto programs) and by the stand-in VMM (its "fault" command).
 * Never fails a call no test asked to fail.
 */
#pragma once

#include "agent.h"

/*
 * calls: comma-separated names of "mmap-private" and "mmap-shared" (a
 * MAP_FIXED of the pool or of the memfd), "fallocate", "pwrite",
 * "madvise", "register", "unregister", "wp-on" and "wp-off" (write
 * protection, and lifting it); NULL: none.  times: failures before the call works again,
 * -1 for good.  err: the errno; for fallocate 0 means "report success
 * without doing it".  unmap: a failing mmap unmaps the range first, as a
 * MAP_FIXED that fails on commit accounting does.
 */
void pf_test_fault_set(const char *calls, int skip, int times, int err, gboolean unmap);
/* Failures injected since the last pf_test_fault_set(). */
int pf_test_fault_hits(void);

extern const PfAgentSyscalls pf_test_faulty_syscalls;
