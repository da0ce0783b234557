/*
 * domain-xml.h - a libvirt domain's XML, parsed strictly with GMarkup,
 * namespaces resolved, into the little pagefold needs of it (a Domain):
 * its name and UUID, whether its RAM is shared memfd, whether it says
 * <nosharepages/>, and pagefold's element in its <metadata> with the
 * merge domain; and what those mean for pagefold.  The libvirt hook reads
 * the XML libvirt writes on its stdin; pagefoldd reads libvirt's status
 * file of a domain (libvirt-status.h), which holds the same <domain>.
 *
 * Owns the strings of the Domain it fills (domain_clear()).  Must never
 * touch pagefoldd, a file or a descriptor, and never read a DTD or expand
 * an external entity (GMarkup does neither).
 */
#pragma once

#include <glib.h>

/* pagefold's namespace in a domain's <metadata>. */
#define PAGEFOLD_NS "urn:pagefold:domain:1"

/* What the hook needs of the domain XML. */
typedef struct {
    char *name;
    char *uuid; /* canonical: lowercase, dashed */
    gboolean memfd;          /* <memoryBacking><source type='memfd'/> */
    gboolean access_shared;  /* <memoryBacking><access mode='shared'/> */
    gboolean numa_shared;    /* a <cpu><numa><cell memAccess='shared'/> */
    gboolean nosharepages;   /* <memoryBacking><nosharepages/> */
    char *merge_domain;      /* <metadata><pf:config merge-domain=.../>, or NULL */
    gboolean has_config;
} Domain;

void domain_clear(Domain *d);
G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC(Domain, domain_clear)

/*
 * The domain XML, strictly: well-formed, namespaces declared, root
 * libvirt's <domain>, one <name> that is argv's NAME and one valid
 * <uuid>.  GMarkup expands no external entities and reads no DTD.
 */
gboolean domain_xml_parse(const char *name, const GString *xml, Domain *dom, GError **error);
/* The same of a status file: <domstatus pid='N'> around the <domain>; *pid
 * is N. */
gboolean domain_status_parse(const char *name, const GString *xml, Domain *dom, int *pid,
                             GError **error);
/* RAM pagefold can merge: memfd, shared (all of it, or some NUMA cells;
 * pagefoldd takes what it finds shared). */
gboolean domain_is_ours(const Domain *d);
