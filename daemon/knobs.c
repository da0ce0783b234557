/*
 * knobs.c - the table of KSM's knobs and pagefold's own (knobs.h): names,
 * defaults, bounds and JSON.  Checks a value before it is set; never acts
 * on one (the scanner reads them as it runs).
 */
#include "knobs.h"

#include "pf-config.h"
#include "util.h"

typedef struct {
    const char *name;
    gsize offset;
    guint min, max;
    const char *help;
} KnobInfo;

#define K(field, lo, hi, help) { #field, G_STRUCT_OFFSET(PfKnobs, field), lo, hi, help }

static const KnobInfo knob_info[] = {
    K(pages_to_scan, 1, 1u << 30, "pages to scan per wake-up"),
    K(sleep_millisecs, 0, 3600000, "milliseconds to sleep between wake-ups"),
    K(cpu_percent, 1, 100, "cap on the scanner's CPU, percent of one core"),
    K(target_pass_millisecs, 0, 86400000,
      "if not 0, scan so that a full pass takes about this long"),
    K(max_page_sharing, 2, G_MAXUINT16, "guest pages per canonical page"),
    K(smart_scan, 0, 1, "skip pages that keep failing to merge"),
    K(use_zero_pages, 0, 1, "treat all-zero pages apart"),
    K(io_hints, 0, 1, "visit first the pages a device just wrote (disk reads)"),
    K(cpu_use, 0, 1, "count where the main thread's CPU goes (stats' cpu_use)"),
    K(run, 0, 2, "0: stop scanning, 1: scan, 2: unmerge all pages and stop"),
    K(max_vma_percent, 1, 90, "share of vm.max_map_count a VM may reach through merges"),
    /* Each refresh is a libvirt call per VM, each of which makes libvirtd
     * write the domain's status XML: not more than once a second. */
    K(libvirt_metadata_millisecs, 0, 86400000,
      "if not 0, how often each VM's figures go into its libvirt domain's live metadata"),
};

#undef K

void
pf_knobs_init_default(PfKnobs *k)
{
    /* KSM's defaults, so a KSM user finds the same pace. */
    k->pages_to_scan = 100;
    k->sleep_millisecs = 20;
    k->cpu_percent = 100;
    k->target_pass_millisecs = 0;
    k->max_page_sharing = 256;
    k->smart_scan = TRUE;
    k->use_zero_pages = TRUE;
    k->io_hints = TRUE;
    k->cpu_use = FALSE;
    k->run = TRUE;
    k->max_vma_percent = 50;
    k->libvirt_metadata_millisecs = PF_HAVE_LIBVIRT ? 10000 : 0;
}

static guint *
knob_field(PfKnobs *k, const KnobInfo *ki)
{
    /* gboolean and guint share a size and every knob is one of them. */
    G_STATIC_ASSERT(sizeof(gboolean) == sizeof(guint));
    return (guint *)((char *)k + ki->offset);
}

gboolean
pf_knobs_set(PfKnobs *k, const char *name, guint64 value, GError **error)
{
    for (gsize i = 0; i < G_N_ELEMENTS(knob_info); i++) {
        const KnobInfo *ki = &knob_info[i];

        if (g_strcmp0(ki->name, name) != 0) {
            continue;
        }
        if (value < ki->min || value > ki->max) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "%s must be between %u and %u, not %" G_GUINT64_FORMAT,
                        name, ki->min, ki->max, value);
            return FALSE;
        }
        if (g_str_equal(name, "target_pass_millisecs") && value != 0 && value < 10) {
            g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                        "target_pass_millisecs must be 0 (off) or at least 10");
            return FALSE;
        }
        if (g_str_equal(name, "libvirt_metadata_millisecs") && value != 0) {
            if (!PF_HAVE_LIBVIRT) {
                g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                            "libvirt_metadata_millisecs can only be 0: this pagefoldd "
                            "was built without libvirt (meson -Dlibvirt)");
                return FALSE;
            }
            if (value < 1000) {
                g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                            "libvirt_metadata_millisecs must be 0 (off) or at least 1000");
                return FALSE;
            }
        }
        *knob_field(k, ki) = (guint)value;
        return TRUE;
    }
    g_set_error(error, PF_ERROR, PF_ERROR_INVALID_ARGUMENT,
                "unknown knob '%s'", name ? name : "");
    return FALSE;
}

void
pf_knobs_to_json(const PfKnobs *k, JsonBuilder *b)
{
    for (gsize i = 0; i < G_N_ELEMENTS(knob_info); i++) {
        json_builder_set_member_name(b, knob_info[i].name);
        json_builder_add_int_value(b, *knob_field((PfKnobs *)k, &knob_info[i]));
    }
}

const char *const *
pf_knob_names(void)
{
    static const char *names[G_N_ELEMENTS(knob_info) + 1];

    if (names[0] == NULL) {
        for (gsize i = 0; i < G_N_ELEMENTS(knob_info); i++) {
            names[i] = knob_info[i].name;
        }
    }
    return names;
}
