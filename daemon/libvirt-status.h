/*
 * libvirt-status.h - which process is a running libvirt domain's QEMU, as
 * libvirt's qemu driver records it in the domain's status file,
 * RUN_DIR/NAME.xml (<domstatus state='running' ... pid='N'>).
 *
 * Not RUN_DIR/NAME.pid: libvirt hands that file's descriptor, open for
 * writing, to the QEMU (which holds its lock), so a compromised QEMU can
 * make it name any process.  The status file is root's (0600), written by
 * libvirtd alone.  Used by the libvirt hook (which VM to attach), by
 * handshake.c (whether root vouches for an agent's process, and what
 * libvirt says its domain is) and by libvirt-metadata.c (which domain a
 * VM's figures may go to).
 *
 * Must never read more than the file's head where the pid is all that is
 * wanted, nor more than 4 MiB, follow a symbolic link, block on a FIFO, or
 * believe a file that anyone but root could have written.
 */
#pragma once

#include <glib.h>

#include "domain-xml.h"

#define PF_LIBVIRT_QEMU_RUN_DIR "/run/libvirt/qemu"

/* Whether a domain's name can name its files in RUN_DIR (libvirt refuses
 * '/' in a name; ".", ".." and "" would lead elsewhere). */
gboolean pf_libvirt_name_is_file_name(const char *name);

/* The pid of domain name's QEMU, or 0 with error saying why (no such
 * domain running, a name that is no file name, a file not libvirt's). */
int pf_libvirt_domain_pid(const char *run_dir, const char *name, GError **error);
/* The same, the whole file read (at most 4 MiB) and its <domain> parsed
 * into dom (domain-xml.h): what libvirt says the domain is, its merge
 * domain among it.  Reads a file of some hundred KiB: not on a main loop. */
int pf_libvirt_domain_status(const char *run_dir, const char *name, Domain *dom,
                             GError **error);

/*
 * The QEMU pids every status file of RUN_DIR names, kept so that asking
 * costs a stat() of the folder: the files are read again only when the
 * folder may have changed since they were last read (libvirt writes a
 * status file by renaming a new one into place).  At most
 * PF_LIBVIRT_MAX_DOMAINS files are read.
 */
#define PF_LIBVIRT_MAX_DOMAINS 4096
typedef struct _PfLibvirtPids PfLibvirtPids;

PfLibvirtPids *pf_libvirt_pids_new(void);
void pf_libvirt_pids_free(PfLibvirtPids *p);
G_DEFINE_AUTOPTR_CLEANUP_FUNC(PfLibvirtPids, pf_libvirt_pids_free)
/* Whether a status file of run_dir names pid as its domain's QEMU. */
gboolean pf_libvirt_pids_has(PfLibvirtPids *p, const char *run_dir, int pid);
