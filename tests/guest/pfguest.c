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
 * pfguest.until_told=1: it runs on past pfguest.seconds until its console
 * says "pfguest-stop" (the host test sends it when it is done with the
 * guest): a run's end is then the test's to decide, not a race between
 * the guest's clock and a host that may be slow.
 * pfguest.late_mib= (0): once the guest has that much more RAM than at
 * the start (memory plugged in and onlined), fill that much more the same
 * way as scratch, keep it and check it with the rest: it lands in the new
 * memory (ZONE_MOVABLE, memhp_default_state=online_movable), and moves
 * back when that memory is unplugged.
 * pfguest.odirect= (0) buffer pages: instead of sleeping between rewrites
 * of the volatile pages, read /dev/vda with O_DIRECT into those buffers,
 * up to 16 pages a read, at random, and check each page read; a buffer
 * keeps what it read until the next read into it, so that the buffers of
 * guests reading the same disk hold identical pages for the host to
 * merge, and later reads land in merged pages.  Block i of the disk holds
 * fill(mix(5, 0, i, 0)) (the host test writes it: pf_fill_page() of
 * pf_page_seed(5, 0, i, 0) is the same page).  pfguest.odirect_pause_us=
 * (0) sleeps between reads.  The host pins a page for such a read and the
 * device writes it behind the page tables: a page the host remaps
 * meanwhile shows up here as stale data.  pfguest.odirect_write=1: half
 * the operations, at random, write a run of buffers back with O_DIRECT,
 * one page a write, each to the block it holds (checked first): the
 * device reads guest RAM for it, and a page it read wrong (a hole's
 * zeros, another page) lands on the disk, where the next reads and the
 * host's check of the image find it.
 * pfguest.odirect_late=1: /dev/vda is plugged in later; the reads start
 * once it is there.
 * pfguest.virtiofs= (0) buffer pages: instead of sleeping, write files
 * through the virtiofs share tagged "pf" (mounted on /mnt) from buffers of
 * that many pages, read each back into other buffers, and check every
 * page: write w fills file w % VFS_FILES with pages fill(mix(7, 0, j, w))
 * (identical in every guest: pages a merge would take), alternately
 * through the page cache and with O_DIRECT from the buffers (where the
 * share's cache mode lets the page cache be used); the backend reads and
 * writes guest RAM for them, behind the page tables.  The last line says writes=W: the
 * host then finds in file k the pages of the last w < W with w % VFS_FILES
 * == k.  pfguest.virtiofs_pause_ms= (0) sleeps between writes: the
 * buffers, read back identical to what was written, stay long enough to
 * be merged, and the next write and read land in merged pages.
 * It prints on the console, one line each: "PFGUEST READY", "PFGUEST
 * SCRATCH filled|freed", "PFGUEST LATE filled", "PFGUEST CHECK
 * ok|FAIL ...", "PFGUEST ODIRECT reads=... pages=... bad=... writes=..."
 * (reads made, pages read, bad pages, pages written), "PFGUEST
 * VIRTIOFS writes=... reads=... pages=... bad=..." with each
 * check (a bad page also prints "PFGUEST ODIRECT|VIRTIOFS FAIL ..." at once), and
 * at the end "PFGUEST PASS" or "PFGUEST FAIL", then powers the guest off.
 * It never trusts the host: everything is recomputed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
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

/* ---- O_DIRECT reads into buffers the host may merge ---- */

#define ODIRECT_RUN 16 /* pages per read, at most */

typedef struct {
    int fd;
    size_t n_bufs;      /* buffer pages */
    size_t n_blocks;    /* 4 KiB blocks of /dev/vda */
    uint8_t *bufs;
    size_t *held;       /* the block each buffer holds, n_blocks if none */
    unsigned long pause_us;
    int write;          /* pfguest.odirect_write */
    uint64_t rng;
    unsigned long reads, writes, pages, bad;
} Odirect;

static uint64_t
next_rand(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* 0 if the page of buffer i holds block b; else 1, and the console says so. */
static int
odirect_page_bad(Odirect *o, size_t i, size_t b, const char *when)
{
    uint8_t want[PAGE];
    const uint8_t *page = o->bufs + i * PAGE;

    fill(want, mix(5, 0, b, 0));
    if (memcmp(page, want, PAGE) == 0) {
        return 0;
    }
    for (unsigned k = 0; k < PAGE; k++) {
        if (page[k] != want[k]) {
            printf("PFGUEST ODIRECT FAIL %s: buffer %zu, block %zu: byte %u is %02x, "
                   "not %02x\n", when, i, b, k, page[k], want[k]);
            break;
        }
    }
    fflush(stdout);
    return 1;
}

static int
odirect_open(Odirect *o, unsigned long n_bufs, unsigned long pause_us, int write,
             unsigned long seed)
{
    uint64_t size = 0;

    /* The disk appears when virtio_blk's probe is done: wait a little. */
    for (int i = 0; i < 100; i++) {
        o->fd = open("/dev/vda", (write ? O_RDWR : O_RDONLY) | O_DIRECT);
        if (o->fd >= 0 || errno != ENOENT) {
            break;
        }
        usleep(100000);
    }
    if (o->fd < 0 || ioctl(o->fd, BLKGETSIZE64, &size) < 0 || size < ODIRECT_RUN * PAGE) {
        printf("PFGUEST FAIL cannot read /dev/vda with O_DIRECT: %s, %llu bytes\n",
               strerror(errno), (unsigned long long)size);
        return -1;
    }
    o->n_bufs = n_bufs < ODIRECT_RUN ? ODIRECT_RUN : n_bufs;
    o->n_blocks = size / PAGE;
    o->bufs = mmap(NULL, o->n_bufs * PAGE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    o->held = malloc(o->n_bufs * sizeof(*o->held));
    if (o->bufs == MAP_FAILED || o->held == NULL) {
        printf("PFGUEST FAIL cannot allocate %zu O_DIRECT buffers\n", o->n_bufs);
        return -1;
    }
    for (size_t i = 0; i < o->n_bufs; i++) {
        o->held[i] = o->n_blocks;
    }
    o->pause_us = pause_us;
    o->write = write;
    o->rng = seed * 0x9E3779B97F4A7C15ull | 1;
    return 0;
}

/* One read of up to ODIRECT_RUN blocks into as many buffers, checked. */
static void
odirect_read(Odirect *o)
{
    size_t k = 1 + next_rand(&o->rng) % ODIRECT_RUN;
    size_t i = next_rand(&o->rng) % (o->n_bufs - k + 1);
    size_t b = next_rand(&o->rng) % (o->n_blocks - k + 1);
    ssize_t n = pread(o->fd, o->bufs + i * PAGE, k * PAGE, (off_t)b * PAGE);

    if (n != (ssize_t)(k * PAGE)) {
        printf("PFGUEST ODIRECT FAIL read of %zu blocks at %zu: %zd, %s\n", k, b, n,
               strerror(errno));
        fflush(stdout);
        o->bad++;
        /* What they hold now is unknown: not checked again. */
        for (size_t t = 0; t < k; t++) {
            o->held[i + t] = o->n_blocks;
        }
        return;
    }
    o->reads++;
    for (size_t t = 0; t < k; t++) {
        o->held[i + t] = b + t;
        o->pages++;
        o->bad += odirect_page_bad(o, i + t, b + t, "just read");
    }
}

/* odirect_open() with the settings of the kernel command line. */
static int
odirect_open_with(Odirect *o, const char *cmdline, unsigned long seed)
{
    return odirect_open(o, param(cmdline, "pfguest.odirect=", 0),
                        param(cmdline, "pfguest.odirect_pause_us=", 0),
                        (int)param(cmdline, "pfguest.odirect_write=", 0), seed);
}

/* Up to ODIRECT_RUN buffers from a random one written back, one page a
 * write, each to the block it holds, once checked. */
static void
odirect_write(Odirect *o)
{
    size_t k = 1 + next_rand(&o->rng) % ODIRECT_RUN;
    size_t i = next_rand(&o->rng) % (o->n_bufs - k + 1);

    for (size_t t = i; t < i + k; t++) {
        size_t b = o->held[t];
        ssize_t n;

        if (b == o->n_blocks) {
            continue;
        }
        if (odirect_page_bad(o, t, b, "before writing")) {
            o->bad++;
            continue;
        }
        n = pwrite(o->fd, o->bufs + t * PAGE, PAGE, (off_t)b * PAGE);
        if (n != PAGE) {
            printf("PFGUEST ODIRECT FAIL write of block %zu: %zd, %s\n", b, n,
                   strerror(errno));
            fflush(stdout);
            o->bad++;
            continue;
        }
        o->writes++;
    }
}

/* Whether the console said "pfguest-stop" (non-blocking; the terminal
 * hands over whole lines). */
static int
told_to_stop(void)
{
    static char seen[256];
    static size_t len;
    struct pollfd p = { 0, POLLIN, 0 };
    ssize_t got;

    while (poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) {
        if (len == sizeof(seen) - 1) {
            len = 0;
        }
        got = read(0, seen + len, sizeof(seen) - 1 - len);
        if (got <= 0) {
            return 0;
        }
        len += (size_t)got;
        seen[len] = 0;
        if (strstr(seen, "pfguest-stop") != NULL) {
            return 1;
        }
        if (memchr(seen, '\n', len) != NULL) {
            len = 0;
        }
    }
    return 0;
}

/* Reads for ms milliseconds. */
static void
odirect_for(Odirect *o, unsigned long ms)
{
    double end = now() + ms * 1e-3;

    do {
        if (o->write && next_rand(&o->rng) % 2) {
            odirect_write(o);
        } else {
            odirect_read(o);
        }
        if (o->pause_us) {
            usleep(o->pause_us);
        }
    } while (now() < end);
}

/* Every buffer still holds what was read into it. */
static size_t
odirect_check(Odirect *o)
{
    size_t bad = 0;

    for (size_t i = 0; i < o->n_bufs; i++) {
        if (o->held[i] < o->n_blocks) {
            bad += odirect_page_bad(o, i, o->held[i], "kept");
        }
    }
    o->bad += bad;
    printf("PFGUEST ODIRECT reads=%lu pages=%lu bad=%lu writes=%lu\n", o->reads, o->pages,
           o->bad, o->writes);
    fflush(stdout);
    return bad;
}

/* ---- files written and read through virtiofs ---- */

#define VFS_FILES 8

typedef struct {
    size_t n_bufs;       /* pages of a file, and of each buffer */
    unsigned long pause_ms;
    uint8_t *wbuf, *rbuf;
    unsigned long writes, reads, pages, bad;
} Vfs;

/* 0 if page j of buf is page j of write w; else 1, and the console says so. */
static int
vfs_page_bad(const uint8_t *buf, size_t j, unsigned long w, const char *when)
{
    uint8_t want[PAGE];
    const uint8_t *page = buf + j * PAGE;

    fill(want, mix(7, 0, j, w));
    if (memcmp(page, want, PAGE) == 0) {
        return 0;
    }
    for (unsigned k = 0; k < PAGE; k++) {
        if (page[k] != want[k]) {
            printf("PFGUEST VIRTIOFS FAIL %s: write %lu, page %zu: byte %u is %02x, not %02x\n",
                   when, w, j, k, page[k], want[k]);
            break;
        }
    }
    fflush(stdout);
    return 1;
}

static int
vfs_open(Vfs *v, unsigned long n_bufs, unsigned long pause_ms)
{
    int rc = -1;

    if (mkdir("/mnt", 0755) < 0 && errno != EEXIST) {
        printf("PFGUEST FAIL cannot make /mnt: %s\n", strerror(errno));
        return -1;
    }
    /* The device appears when virtio's probe is done: wait a little. */
    for (int i = 0; i < 100 && (rc = mount("pf", "/mnt", "virtiofs", 0, NULL)) < 0; i++) {
        usleep(100000);
    }
    if (rc < 0) {
        printf("PFGUEST FAIL cannot mount the virtiofs share \"pf\": %s\n", strerror(errno));
        return -1;
    }
    v->n_bufs = n_bufs;
    v->pause_ms = pause_ms;
    v->wbuf = mmap(NULL, 2 * n_bufs * PAGE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (v->wbuf == MAP_FAILED) {
        printf("PFGUEST FAIL cannot allocate %lu virtiofs buffer pages\n", 2 * n_bufs);
        return -1;
    }
    v->rbuf = v->wbuf + n_bufs * PAGE;
    return 0;
}

/* Write w: its file written whole from wbuf, then read back into rbuf;
 * both checked. */
static void
vfs_write_read(Vfs *v)
{
    unsigned long w = v->writes;
    int direct = w % 2 ? O_DIRECT : 0;
    char path[32];
    size_t len = v->n_bufs * PAGE;
    ssize_t n = -1;
    int fd;

    snprintf(path, sizeof(path), "/mnt/f%lu", w % VFS_FILES);
    for (size_t j = 0; j < v->n_bufs; j++) {
        fill(v->wbuf + j * PAGE, mix(7, 0, j, w));
    }
    errno = 0; /* a short write sets none */
    fd = open(path, O_RDWR | O_CREAT | direct, 0644);
    if (fd < 0 || (n = pwrite(fd, v->wbuf, len, 0)) != (ssize_t)len || fsync(fd) < 0) {
        printf("PFGUEST VIRTIOFS FAIL write %lu of %s%s: %zd, %s\n", w, path,
               direct ? " (O_DIRECT)" : "", n, errno ? strerror(errno) : "short");
        fflush(stdout);
        v->bad++;
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    v->writes++;
    errno = 0;
    n = pread(fd, v->rbuf, len, 0);
    close(fd);
    if (n != (ssize_t)len) {
        printf("PFGUEST VIRTIOFS FAIL read of %s: %zd, %s\n", path, n,
               errno ? strerror(errno) : "short");
        fflush(stdout);
        v->bad++;
        return;
    }
    v->reads++;
    for (size_t j = 0; j < v->n_bufs; j++) {
        v->pages++;
        v->bad += vfs_page_bad(v->wbuf, j, w, "written from");
        v->bad += vfs_page_bad(v->rbuf, j, w, "read back");
    }
}

/* Writes and reads for ms milliseconds. */
static void
vfs_for(Vfs *v, unsigned long ms)
{
    double end = now() + ms * 1e-3;

    do {
        vfs_write_read(v);
        if (v->pause_ms > 0) {
            usleep(v->pause_ms * 1000);
        }
    } while (now() < end);
}

static void
vfs_report(Vfs *v)
{
    printf("PFGUEST VIRTIOFS writes=%lu reads=%lu pages=%lu bad=%lu\n", v->writes, v->reads,
           v->pages, v->bad);
    fflush(stdout);
}

/* RAM the guest kernel has now, in bytes. */
static unsigned long long
total_ram(void)
{
    struct sysinfo si;

    return sysinfo(&si) == 0 ? (unsigned long long)si.totalram * si.mem_unit : 0;
}

/* Late memory: zero pages and pages identical in every guest, by turns. */
static void
late_page(uint8_t *p, size_t i)
{
    if (i % 2) {
        fill(p, mix(6, 0, i, 0));
    } else {
        memset(p, 0, PAGE);
    }
}

int
main(void)
{
    char cmdline[4096] = "";
    FILE *f;
    unsigned long mib, seed, vol_pct, period_ms, check_s, seconds, reboot_after;
    unsigned long scratch_mib, scratch_s, odirect_bufs, late_mib, until_told, vfs_bufs;
    unsigned long odirect_late;
    int told = 0;
    uint8_t *scratch = NULL, *late = NULL;
    unsigned long long ram_at_start = 0;
    Odirect od = { .fd = -1 };
    Vfs vfs = { 0 };
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
    odirect_bufs = param(cmdline, "pfguest.odirect=", 0);
    odirect_late = param(cmdline, "pfguest.odirect_late=", 0);
    late_mib = param(cmdline, "pfguest.late_mib=", 0);
    until_told = param(cmdline, "pfguest.until_told=", 0);
    vfs_bufs = param(cmdline, "pfguest.virtiofs=", 0);
    ram_at_start = total_ram();

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
    if (odirect_bufs > 0 && !odirect_late && odirect_open_with(&od, cmdline, seed) < 0) {
        return 1;
    }
    if (vfs_bufs > 0 && odirect_bufs > 0) {
        printf("PFGUEST FAIL pfguest.virtiofs and pfguest.odirect take turns with the same "
               "time: one at a time\n");
        return 1;
    }
    if (vfs_bufs > 0 &&
        vfs_open(&vfs, vfs_bufs, param(cmdline, "pfguest.virtiofs_pause_ms=", 0)) < 0) {
        return 1;
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
    while (seconds == 0 || now() - start < seconds || (until_told && !told)) {
        size_t bad = 0;
        double t0;

        told = told || (until_told && told_to_stop());
        if (scratch != NULL && now() - start >= scratch_s) {
            /* Back to the guest kernel's free pages, merged as they are. */
            munmap(scratch, scratch_mib << 20);
            scratch = NULL;
            printf("PFGUEST SCRATCH freed\n");
            fflush(stdout);
        }

        if (late_mib > 0 && late == NULL && total_ram() >= ram_at_start + (late_mib << 20)) {
            late = mmap(NULL, late_mib << 20, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (late == MAP_FAILED) {
                printf("PFGUEST FAIL cannot allocate %lu MiB late\n", late_mib);
                return 1;
            }
            for (size_t i = 0; i < late_mib * 256; i++) {
                late_page(late + i * PAGE, i);
            }
            printf("PFGUEST LATE filled %lu MiB\n", late_mib);
            fflush(stdout);
        }

        if (odirect_bufs > 0 && od.fd < 0 && access("/dev/vda", F_OK) == 0 &&
            odirect_open_with(&od, cmdline, seed) < 0) {
            return 1;
        }

        /* The guest keeps writing: volatile pages get new content. */
        for (size_t k = 0; k < vol; k++) {
            size_t i = identical + zero + unique + k;

            gen[k]++;
            fill(mem + i * PAGE, mix(3, seed, i, gen[k]));
        }
        if (od.fd >= 0) {
            odirect_for(&od, period_ms);
        } else if (vfs.n_bufs > 0) {
            vfs_for(&vfs, period_ms);
        } else {
            usleep(period_ms * 1000);
        }
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
        for (size_t i = 0; late != NULL && i < late_mib * 256; i++) {
            late_page(want, i);
            bad += memcmp(late + i * PAGE, want, PAGE) != 0;
        }
        /* How long the check took: the guest's view of any slowdown. */
        printf("PFGUEST CHECK %s %zu pages, %zu differ, %.0f ms\n", bad ? "FAIL" : "ok", pages,
               bad, (now() - t0) * 1e3);
        fflush(stdout);
        ok &= bad == 0;
        if (od.fd >= 0) {
            odirect_check(&od);
        }
        if (vfs.n_bufs > 0) {
            vfs_report(&vfs);
        }
    }
    if (od.fd >= 0) {
        /* The counts, and the buffers checked once more; any bad page
         * read or kept fails the run. */
        odirect_check(&od);
        ok &= od.bad == 0;
    }
    if (vfs.n_bufs > 0) {
        /* The count the host checks the files by: nothing is written
         * after it. */
        vfs_report(&vfs);
        ok &= vfs.bad == 0 && vfs.writes > 0;
    }
    printf("PFGUEST %s\n", ok ? "PASS" : "FAIL");
    fflush(stdout);
    sync();
    reboot(reboot_after ? RB_AUTOBOOT : RB_POWER_OFF);
    return ok ? 0 : 1;
}
