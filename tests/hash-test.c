/*
 * hash-test.c - every checksum is deterministic, sees every byte of the
 * page, and keeps its reference definition.
 */
#include <glib.h>
#include <string.h>
#include <xxhash.h>

#include "guestmem.h"
#include "hash.h"
#include "util.h"

static void
test_every_byte_counts(void)
{
    gsize n;
    const PfHashAlgo *algos = pf_hash_all(&n);
    g_autofree guint8 *page = g_malloc(PF_PAGE_SIZE);

    g_assert_cmpuint(n, ==, 4);
    pf_fill_page(page, 12345);
    for (gsize a = 0; a < n; a++) {
        guint64 base = algos[a].func(page);

        g_assert_cmpuint(algos[a].func(page), ==, base);
        for (gsize off = 0; off < PF_PAGE_SIZE; off += 509) {
            page[off] ^= 0x10;
            g_assert_cmpuint(algos[a].func(page), !=, base);
            page[off] ^= 0x10;
        }
    }
}

static void
test_reference_values(void)
{
    g_autofree guint8 *page = g_malloc0(PF_PAGE_SIZE);

    pf_fill_page(page, 777);
    g_assert_cmpuint(pf_hash_lookup("xxh3")->func(page), ==, XXH3_64bits(page, PF_PAGE_SIZE));
    g_assert_cmpuint(pf_hash_lookup("xxh64")->func(page), ==, XXH64(page, PF_PAGE_SIZE, 0));
    /* jhash2 is 32 bits, like the kernel's. */
    g_assert_cmpuint(pf_hash_lookup("jhash2")->func(page) >> 32, ==, 0);
    g_assert_true(pf_hash_default() == pf_hash_lookup("xxh3"));
    g_assert_null(pf_hash_lookup("md5"));
}

static void
test_is_zero(void)
{
    g_autofree guint8 *page = g_malloc0(PF_PAGE_SIZE);

    g_assert_true(pf_page_is_zero(page));
    for (gsize off = 0; off < PF_PAGE_SIZE; off += 1021) {
        page[off] = 1;
        g_assert_false(pf_page_is_zero(page));
        page[off] = 0;
    }
    page[PF_PAGE_SIZE - 1] = 0x80;
    g_assert_false(pf_page_is_zero(page));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/hash/every-byte-counts", test_every_byte_counts);
    g_test_add_func("/hash/reference-values", test_reference_values);
    g_test_add_func("/hash/is-zero", test_is_zero);
    return g_test_run();
}
