/*
 * standin-backend.h - what the stand-in VMM (standin-vmm.c) and its
 * stand-in vhost-user back-end (standin-backend.c) say to each other on
 * their socket (SOCK_SEQPACKET, one message a packet).
 *
 * Owns: those messages.  It must never say more than the vhost-user
 * messages it stands in for would: where the back-end maps guest RAM, its
 * userfaultfd, the front-end's yes or no, and device I/O.
 */
#pragma once

#include <glib.h>

#include "util.h"

/* back-end -> VMM, once, with its userfaultfd (SCM_RIGHTS) */
typedef struct {
    guint64 base; /* where it maps the memfd from offset 0 */
    guint64 size;
} PfBeHello;

/* VMM -> back-end, once: 0, or the errno of the agent's refusal */
typedef struct {
    gint32 status;
} PfBeAck;

/* VMM -> back-end: a device's access to one page of guest RAM */
typedef struct {
    char op;        /* 'w': write pf_fill_page(seed), 'r': read it back */
    guint8 syscall; /* through pwrite()/pread() of a scratch file, not the CPU */
    guint8 pad[6];
    guint64 page;
    guint64 seed;
} PfBeReq;

typedef struct {
    gint32 err;     /* 0, or the errno of the system call */
    guint8 pad[4];
    guint8 data[PF_PAGE_SIZE]; /* 'r': what the page held */
} PfBeAns;
