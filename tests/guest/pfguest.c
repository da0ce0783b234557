/*
 * pfguest - the program inside the tiny test guests (static, no library
 * beyond libc).  It makes memory the way real guests do, keeps writing,
 * and checks every byte it wrote:
 *
 *   half of the filled pages identical in every guest (content of the
 *   page's index alone), a fifth zero, a few "volatile" pages rewritten
 *   every period, the rest unique to this guest (content of seed and index).
 *
 * Settings come from the kernel command line: pfguest.mib= (fill, 64),
 * pfguest.seed= (1), pfguest.volatile= (percent, 1), pfguest.period_ms=
 * (500), pfguest.check_s= (5), pfguest.seconds= (0: until powered off),
 * pfguest.reboot=1 (reboot instead of powering off at the end),
 * pfguest.scratch_mib= (0) and pfguest.scratch_s= (10): memory filled
 * right after READY (half zero, half one content repeated) and given back
 * to the guest kernel after scratch_s seconds, for a balloon to take.
 * It prints on the console, one line each: "PFGUEST READY", "PFGUEST
 * SCRATCH filled|freed", "PFGUEST CHECK
 * ok|FAIL ...", and at the end "PFGUEST PASS" or "PFGUEST FAIL", then powers
 * the guest off.  It never trusts the host: everything is recomputed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096u

static unsigned long
param(const char *cmdline, const char *name, unsigned long dflt)
{
    const char *p = strstr(cmdline, name);

    return p ? strtoul(p + strlen(name), NULL, 10) : dflt;
}

static void
fill(uint8_t *page, uint64_t seed)
{
    uint64_t x = seed | 1;

    for (unsigned i = 0; i < PAGE; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(page + i, &x, 8);
    }
}

static uint64_t
mix(uint64_t kind, uint64_t seed, uint64_t index, uint64_t gen)
{
    uint64_t h = kind * 0x9E3779B97F4A7C15ull ^ seed * 0xC2B2AE3D27D4EB4Full ^
                 index * 0x165667B19E3779F9ull ^ gen * 0xD6E8FEB86659FD93ull;

    return h ^ (h >> 31);
}

static double
now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int
main(void)
{
    char cmdline[4096] = "";
    FILE *f;
    unsigned long mib, seed, vol_pct, period_ms, check_s, seconds, reboot_after;
    unsigned long scratch_mib, scratch_s;
    uint8_t *scratch = NULL;
    size_t pages, identical, zero, vol, unique;
    uint8_t *mem, want[PAGE];
    uint32_t *gen;
    double start, last_check;
    int ok = 1;

    mount("proc", "/proc", "proc", 0, NULL);
    if ((f = fopen("/proc/cmdline", "r")) != NULL) {
        if (!fgets(cmdline, sizeof(cmdline), f)) {
            cmdline[0] = 0;
        }
        fclose(f);
    }
    mib = param(cmdline, "pfguest.mib=", 64);
    seed = param(cmdline, "pfguest.seed=", 1);
    vol_pct = param(cmdline, "pfguest.volatile=", 1);
    period_ms = param(cmdline, "pfguest.period_ms=", 500);
    check_s = param(cmdline, "pfguest.check_s=", 5);
    seconds = param(cmdline, "pfguest.seconds=", 0);
    reboot_after = param(cmdline, "pfguest.reboot=", 0);
    scratch_mib = param(cmdline, "pfguest.scratch_mib=", 0);
    scratch_s = param(cmdline, "pfguest.scratch_s=", 10);

    pages = mib * 256;
    identical = pages / 2;
    zero = pages / 5;
    vol = pages * vol_pct / 100;
    unique = pages - identical - zero - vol;
    mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    gen = calloc(vol ? vol : 1, sizeof(*gen));
    if (mem == MAP_FAILED || gen == NULL) {
        printf("PFGUEST FAIL cannot allocate %lu MiB\n", mib);
        return 1;
    }
    for (size_t i = 0; i < pages; i++) {
        uint8_t *p = mem + i * PAGE;

        if (i < identical) {
            fill(p, mix(1, 0, i, 0));
        } else if (i < identical + zero) {
            memset(p, 0, PAGE); /* touched: a real, allocated zero page */
        } else if (i < identical + zero + unique) {
            fill(p, mix(2, seed, i, 0));
        } else {
            fill(p, mix(3, seed, i, 0));
        }
    }
    printf("PFGUEST READY pages=%zu identical=%zu zero=%zu unique=%zu volatile=%zu\n", pages,
           identical, zero, unique, vol);
    fflush(stdout);

    if (scratch_mib > 0) {
        scratch = mmap(NULL, scratch_mib << 20, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (scratch == MAP_FAILED) {
            printf("PFGUEST FAIL cannot allocate %lu MiB of scratch\n", scratch_mib);
            return 1;
        }
        for (size_t i = 0; i < scratch_mib * 256; i++) {
            if (i % 2) {
                fill(scratch + i * PAGE, mix(4, 0, 0, 0));
            } else {
                memset(scratch + i * PAGE, 0, PAGE);
            }
        }
        printf("PFGUEST SCRATCH filled %lu MiB\n", scratch_mib);
        fflush(stdout);
    }

    start = last_check = now();
    while (seconds == 0 || now() - start < seconds) {
        size_t bad = 0;
        double t0;

        if (scratch != NULL && now() - start >= scratch_s) {
            /* Back to the guest kernel's free pages, merged as they are. */
            munmap(scratch, scratch_mib << 20);
            scratch = NULL;
            printf("PFGUEST SCRATCH freed\n");
            fflush(stdout);
        }

        /* The guest keeps writing: volatile pages get new content. */
        for (size_t k = 0; k < vol; k++) {
            size_t i = identical + zero + unique + k;

            gen[k]++;
            fill(mem + i * PAGE, mix(3, seed, i, gen[k]));
        }
        usleep(period_ms * 1000);
        if (now() - last_check < check_s) {
            continue;
        }
        last_check = t0 = now();
        for (size_t i = 0; i < pages; i++) {
            if (i < identical) {
                fill(want, mix(1, 0, i, 0));
            } else if (i < identical + zero) {
                memset(want, 0, PAGE);
            } else if (i < identical + zero + unique) {
                fill(want, mix(2, seed, i, 0));
            } else {
                fill(want, mix(3, seed, i, gen[i - identical - zero - unique]));
            }
            bad += memcmp(mem + i * PAGE, want, PAGE) != 0;
        }
        /* How long the check took: the guest's view of any slowdown. */
        printf("PFGUEST CHECK %s %zu pages, %zu differ, %.0f ms\n", bad ? "FAIL" : "ok", pages,
               bad, (now() - t0) * 1e3);
        fflush(stdout);
        ok &= bad == 0;
    }
    printf("PFGUEST %s\n", ok ? "PASS" : "FAIL");
    fflush(stdout);
    sync();
    reboot(reboot_after ? RB_AUTOBOOT : RB_POWER_OFF);
    return ok ? 0 : 1;
}
