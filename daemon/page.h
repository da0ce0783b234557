/*
 * page.h - the record pagefoldd keeps for every page of guest RAM it tracks,
 * the user-space counterpart of KSM's rmap_item (64 bytes there, 8 here).
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

/*
 * A page's checksum is kept folded to 32 bits (pf_page_sum()), as KSM keeps
 * its 32-bit one: it only says whether the page changed since its last
 * visit and keys the unstable tree, where memcmp() decides.  A sharer needs
 * neither (its node holds the whole checksum), so its node id takes the
 * checksum's place: `node` while SHARED, `checksum` in every other state.
 * pf_stable_tree_add() and pf_stable_tree_remove() write `node`; whoever
 * takes a page out of a node and still wants its checksum sets it again.
 */
typedef struct {
    union {
        guint32 checksum; /* not SHARED: pf_page_sum() at the last visit */
        guint32 node;     /* SHARED: its stable node's id */
    };
    guint16 slot;     /* SHARED: index in its node's member array */
    guint8 state : 3; /* PfPageState */
    guint8 seen : 5;  /* the pass of its last visit, modulo 32 */
    guint8 age : 7;   /* smart scan: passes without merging, saturating */
    /* visited as a device wrote it (a hint), since the cursor last came */
    guint8 hinted : 1;
} PfPage;

#define PF_PAGE_AGE_MAX 127u

G_STATIC_ASSERT(sizeof(PfPage) == 8);

/* A checksum as a record keeps it: the high half of a multiply mixes all
 * 64 bits (a plain XOR of the halves would let crc32c's four lanes cancel
 * out), and 0 stays free for reset_page()'s "no checksum". */
static inline guint32
pf_page_sum(guint64 checksum)
{
    guint32 sum = (guint32)((checksum * 0x9E3779B97F4A7C15ull) >> 32);

    return sum != 0 ? sum : 1;
}

#define PF_PAGE_ID_NONE 0u
