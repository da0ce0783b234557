/*
 * agent-proto-helpers.h - what the agent-proto programs (agent-proto-test,
 * agent-proto-fault-test, agent-proto-life-test) share: a fixture in which
 * this test process is the VMM (guest RAM mapped like QEMU's, the agent
 * library linked in, its system calls able to fail: faultsys.h) and plays
 * pagefoldd's end of the protocol by hand; the requests those tests send,
 * and what they read back from the agent and from /proc/self.
 *
 * Owns: the fixture's guest RAM, peer and pool chunk, made and freed per
 * test.  It must never send the agent anything a test did not ask for, nor
 * leave a call failing from one test into the next (setup() clears it).
 */
#pragma once

#include <glib.h>
#include <sys/types.h>

#include "agent.h"
#include "guestmem.h"
#include "proto.h"
#include "testproc.h"

/* Guest RAM's pages, and the slots of the fixture's pool chunk. */
#define PAGES 256

typedef struct {
    PfTestPeer *peer;
    int conn;
    PfGuest *guest;
    PfAgent *agent;
    int pool_fd;
    guint8 *pool_map;
    PfMsg msg;
} Fixture;

#define make_pool pf_test_pool_chunk

/* A fixture's data that has its peer answer in protocol 1 (other tests'
 * data is theirs): known by its address. */
extern const char protocol_1[];

/* Guest RAM of PAGES pages (half identical, a quarter unique, a quarter
 * zero) given to an agent that attached in merge mode, and a sealed pool
 * chunk of PAGES slots, not yet sent. */
void setup(Fixture *f, gconstpointer data);
/* The same with guest RAM of a 2 MiB extent, which COLLAPSE may name. */
void setup_extent(Fixture *f, gconstpointer data);
void teardown(Fixture *f, gconstpointer data);

/* The agent's next message, in f->msg; it must be of that type. */
void expect_msg(Fixture *f, PfMsgType type);
/* Sends pool chunk fd, as chunk id chunk of n_slots slots. */
void send_pool(Fixture *f, int fd, guint32 chunk, guint32 n_slots);
/* Slots 0..PAGES/2-1 of chunk 0, the fixture's, hold the guest's
 * identical pages; sent. */
void send_identical_pool(Fixture *f);
/* Chunk B (id 1) of the move tests: slots 10..33 hold pages 0..23 of
 * guest RAM, which chunk A (id 0) holds in slots 0..23.  Its fd. */
int send_chunk_b(Fixture *f, guint8 **map);

/* Every one of n results is an ERROR with errno err. */
void assert_all_failed(const PfWireResult *res, guint n, int err);
/* Sends items, returns the results (owned by f->msg). */
const PfWireResult *request(Fixture *f, const PfWireItem *items, guint32 n, guint32 seq);
/* Merges pages [first, first + n) with the slots of the same index. */
const PfWireResult *merge_pages(Fixture *f, guint first, guint n, guint32 seq);
/* Merges pages [first, first + n) with slots slot.. of chunk. */
const PfWireResult *merge_from(Fixture *f, guint first, guint n, guint32 chunk, guint32 slot,
                               guint32 seq);
const PfWireResult *unmerge_page(Fixture *f, guint page, guint32 seq);
/* Returns once every message sent before it has been dealt with. */
void barrier(Fixture *f, guint32 seq);
/* Reads DISCARDs until a message of type then, marking the pages they
 * cover in covered (PAGES of them). */
void read_discards(Fixture *f, guint32 region, PfMsgType then, gboolean *covered);
/* Pages [lo, hi) are all covered (want) or none is. */
void assert_covered(const gboolean *covered, guint lo, guint hi, gboolean want);

/* The agent's counters. */
PfAgentStats stats_of(Fixture *f);
/* Guest pages mapped from the pool. */
guint64 remapped(Fixture *f);
/* Does page i of guest RAM map the memfd? */
gboolean maps_memfd(Fixture *f, guint i);
/* Page i of the memfd holds want. */
void assert_memfd_page(Fixture *f, guint i, const guint8 *want);

/* This process's pagemap entry for addr. */
guint64 pagemap_entry(const void *addr);
/* The page frame behind addr. */
guint64 pfn_of(const void *addr);
/* The blocks allocated to a memfd. */
blkcnt_t memfd_blocks(int fd);
/* This process's mappings, with permissions perms, of the file open as fd. */
guint maps_of(int fd, const char *perms);
/* This process's descriptors open on the file open as fd. */
guint fds_of(int fd);
