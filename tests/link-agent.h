/*
 * link-agent.h - the hand-made agent that link-test and link-peers-test
 * play pagefoldd's peer with (link-agent.c): this test process says HELLO,
 * REGION, READY and what follows over guest RAM it maps itself, and reads
 * back WELCOME, refusals and requests.  Every call asserts: a step that
 * fails fails the test.
 */
#pragma once

#include <glib.h>

#include "guestmem.h"
#include "proto.h"
#include "testproc.h"

/* A new connection to d's agent socket; a read from it gives up after
 * 20 s. */
int connect_agent(PfTestDaemon *d);
/* HELLO as process pid (named "fake"), announcing n_regions regions, in
 * protocol version; send_hello() in this build's. */
void send_hello_version(int fd, guint32 pid, guint32 n_regions, guint32 version);
void send_hello(int fd, guint32 pid, guint32 n_regions);
/* A new connection that has said HELLO as this process, announcing
 * n_regions regions. */
int connect_hello(PfTestDaemon *d, guint32 n_regions);
/* REGION index ("pc.ram"): size bytes at host, from offset of memfd,
 * which goes with it. */
void send_region_full(int fd, guint32 index, int memfd, const void *host, guint64 offset,
                      guint64 size);
/* The guest as region 0, all of it. */
void send_region(int fd, const PfGuest *g);
/* Seals memfd as QEMU seals memory-backend-memfd RAM. */
void seal(int memfd);
/* A guest of that many pages, the last zero of them zero, sealed. */
PfGuest *sealed_guest(gsize pages, gsize zero);
/* READY in mode, with reason. */
void send_ready(int fd, PfMode mode, const char *reason);
/* HELLO, the n guests as regions 0 to n - 1, WELCOME, READY; the
 * connection. */
int handshake_regions(PfTestDaemon *d, const PfGuest *const *gs, guint32 n, PfMode mode,
                      const char *reason);
/* The same with g as the one region (NULL: none). */
int handshake(PfTestDaemon *d, const PfGuest *g, PfMode mode, const char *reason);
/* DISCARD, HINT (one range) and GONE (from page 0) of a region's pages. */
void send_discard(int fd, guint32 region, guint64 page, guint64 n);
void send_hint(int fd, guint32 region, guint64 page, guint64 n);
void send_gone(int fd, guint32 region, guint64 n_pages);
/* Registers the guest for userfaultfd write protection, as the agent does
 * before it says merge; returns the userfaultfd. */
int register_wp(const PfGuest *g);

/* pagefoldd answers with an ERROR containing want and hangs up; the ERROR
 * is still there to read after the hang-up.  Closes fd. */
void expect_refusal(int fd, const char *want);
/* The same past what pagefoldd sent before the ERROR (pool chunks,
 * requests). */
void expect_refusal_later(int fd, const char *want);
/* The WELCOME that must follow HELLO and every REGION; its fds stay in
 * m. */
void expect_welcome(int fd, PfMsg *m);
/* Waits until pagefoldd lists the VM of that name (or no longer does). */
void wait_listed(PfTestDaemon *d, const char *name, gboolean listed);

/* The regions named by a REQUEST's items, as a bit mask (regions < 32). */
guint32 request_regions(const PfMsg *m);
/* Answers the REQUEST numbered seq, of n items, with status for each;
 * answer() the one in m. */
void answer_seq(int fd, guint32 seq, guint32 n, PfResultStatus status);
void answer(int fd, const PfMsg *m, PfResultStatus status);
/* The next message within ms (a pool chunk's descriptor closed); FALSE if
 * none came.  An ERROR fails the test. */
gboolean next_msg(int fd, PfMsg *m, int ms);
/* Serves requests for ms, answering each with status; the regions they
 * named (request_regions()). */
guint32 serve(int fd, int ms, PfResultStatus status);
/* Waits up to 20 s for a REQUEST naming region, answering those before it
 * with CHANGED (nothing done); that one is left in m, unanswered. */
void wait_request(int fd, PfMsg *m, guint32 region);
