/*
 * hook-domain-xml.c - fuzzes domain_xml_parse(), the libvirt hook reading
 * the domain XML libvirtd writes on its stdin, and domain_status_parse(),
 * pagefoldd reading the same XML in libvirt's status file as an agent
 * connects.  Both run as root and the XML holds what a domain's owner
 * wrote (its name, its metadata).
 *
 * Input: the domain's name (libvirt's first argument) up to the first
 * newline, then the XML, parsed both ways.
 *
 * Checks, beyond ASan/UBSan: a domain parsed has the name it was asked
 * for and a canonical UUID (36 characters, lowercase and dashed), and a
 * merge domain, when there is one, is valid UTF-8; a status file parsed
 * names a pid; a refusal says why.
 */
#include <stdint.h>

#include "domain-xml.h"
#include "fuzz-common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void
check(const char *name, gboolean ok, const Domain *dom, const GError *error)
{
    if (ok) {
        if (dom->name == NULL || !g_str_equal(dom->name, name) || dom->uuid == NULL ||
            strlen(dom->uuid) != 36 || strspn(dom->uuid, "0123456789abcdef-") != 36 ||
            (dom->merge_domain != NULL && !g_utf8_validate(dom->merge_domain, -1, NULL))) {
            fprintf(stderr, "fuzz: parsed a domain without its name or a canonical UUID\n");
            abort();
        }
        (void)domain_is_ours(dom);
    } else if (error == NULL) {
        fprintf(stderr, "fuzz: refused without saying why\n");
        abort();
    }
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const guint8 *nl = memchr(data, '\n', size);
    g_autofree char *name = NULL;
    g_autoptr(GString) xml = NULL;
    g_autoptr(GError) error = NULL;
    g_auto(Domain) dom = { 0 };
    static gboolean quiet;

    if (!quiet) {
        fuzz_quiet_logs();
        quiet = TRUE;
    }
    if (nl == NULL) {
        return 0;
    }
    /* argv strings end at a NUL: so does the name. */
    name = g_strndup((const char *)data, (gsize)(nl - data));
    xml = g_string_new_len((const char *)nl + 1, (gssize)(size - (gsize)(nl - data) - 1));
    check(name, domain_xml_parse(name, xml, &dom, &error), &dom, error);
    {
        g_auto(Domain) st = { 0 };
        g_autoptr(GError) st_error = NULL;
        int pid = -1;
        gboolean ok = domain_status_parse(name, xml, &st, &pid, &st_error);

        check(name, ok, &st, st_error);
        if (ok && pid <= 0) {
            fprintf(stderr, "fuzz: parsed a status file that names no pid\n");
            abort();
        }
    }
    return 0;
}
