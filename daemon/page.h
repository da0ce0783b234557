/*
 * page.h - the record pagefoldd keeps for every page of guest RAM it tracks,
 * the user-space counterpart of KSM's rmap_item (64 bytes there, 16 here).
 *
 * A record is owned by its region (vm.c allocates an array per region) and
 * changed only by the scanner and the stable tree.  A page id is a 32-bit
 * number in one space shared by all VMs: region->base + index in region.
 */
#pragma once

#include <glib.h>

typedef enum {
    PF_PAGE_ABSENT = 0, /* not visited yet, or a hole in the memfd */
    PF_PAGE_VOLATILE,   /* checksum changed at its last visit */
    PF_PAGE_UNSHARED,   /* put in the unstable tree at its last visit */
    PF_PAGE_SHARED,     /* a member of a stable node */
    PF_PAGE_ZERO,       /* all zero at its last two visits */
    PF_PAGE_PENDING,    /* an agent is merging or unmerging it */
    PF_PAGE_N_STATES
} PfPageState;

typedef struct {
    guint64 checksum; /* at the last visit */
    guint32 node;     /* stable node id while SHARED */
    guint16 slot;     /* index in that node's member array */
    guint8 state : 3; /* PfPageState */
    guint8 seen : 5;  /* smart scan: the pass of its last visit, modulo 32 */
    guint8 age;       /* smart scan: passes without merging, saturating */
} PfPage;

G_STATIC_ASSERT(sizeof(PfPage) == 16);

#define PF_PAGE_ID_NONE 0u
