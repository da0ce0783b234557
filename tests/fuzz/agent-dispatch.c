/*
 * agent-dispatch.c - fuzzes the agent's end of the protocol: what a QEMU
 * linking the agent library does with pagefoldd's messages (POOL, DROP,
 * REQUEST, ERROR, anything else), each read by pf_proto_recv() and done
 * by pfa_dispatch(), as the agent thread's serve() does.  A pagefoldd may
 * be wrong or compromised; the guest must not notice.
 *
 * Each input is a fresh agent in merge mode (a real userfaultfd, write
 * protection registered; advise mode where the kernel refuses it) with
 * one 4 MiB memfd region of a known pattern (restore_guest()),
 * 2 MiB-aligned so that COLLAPSE may run, and a sequence of records, each
 * one datagram:
 *   byte 0: bits 0-1 descriptors (0-3), bits 2-3 their kind
 *           (fuzz_make_fd()), bits 4-7 the memfds' size (x 4 pages, 0: 1)
 *   bytes 1-2: its length (little-endian), then that many bytes.
 * Until a message ends the link (dispatch FALSE), as the real agent does.
 *
 * Checks, beyond ASan/UBSan: guest RAM reads exactly as before after every
 * message, however merged (merges only map equal pages); whatever the
 * agent sends back is a valid message (pf_proto_recv() accepts it); and no
 * input leaks a descriptor.
 */
#include <stdint.h>

#include "agent-records.h"
#include "fuzz-common.h"
#include "proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define GUEST_PAGES 1024u
#define HUGE_SIZE (2u << 20)

static PfMsg *msg;

static void
check_guest(const guint8 *host, const char *after)
{
    for (guint64 p = 0; p < GUEST_PAGES; p++) {
        if (!fuzz_page_is(host + p * PF_PAGE_SIZE, p)) {
            fprintf(stderr, "fuzz: guest page %" G_GUINT64_FORMAT " changed after %s\n", p,
                    after);
            abort();
        }
    }
}

/* What the agent sent back: only valid messages, none left unread. */
static void
drain_replies(int sock)
{
    for (;;) {
        g_autoptr(GError) error = NULL;

        if (!pf_proto_recv(sock, msg, &error)) {
            if (!g_error_matches(error, PF_ERROR, PF_ERROR_WOULD_BLOCK)) {
                fprintf(stderr, "fuzz: the agent sent a bad message: %s\n", error->message);
                abort();
            }
            return;
        }
        pf_msg_close_fds(msg);
    }
}

/*
 * The guest's memfd, made once: allocating and zeroing 4 MiB of shmem per
 * input was most of an input's time.  Merges punch the pages they remap
 * out of it (their content is in the pool): put back, from the pattern,
 * before the next input, so that each starts from the same RAM.
 */
static int guest_fd = -1;

static void
write_guest_pages(gsize from, gsize to)
{
    for (gsize p = from; p < to; p++) {
        guint8 page[PF_PAGE_SIZE];

        fuzz_fill_page(page, p);
        if (pwrite(guest_fd, page, sizeof(page), (off_t)(p * PF_PAGE_SIZE)) != sizeof(page)) {
            abort();
        }
    }
}

static void
restore_guest(void)
{
    off_t end = (off_t)GUEST_PAGES * PF_PAGE_SIZE, hole = 0;

    if (guest_fd < 0) {
        guest_fd = memfd_create("guest", MFD_CLOEXEC);
        if (guest_fd < 0 || ftruncate(guest_fd, end) < 0) {
            abort();
        }
        write_guest_pages(0, GUEST_PAGES);
        return;
    }
    while ((hole = lseek(guest_fd, hole, SEEK_HOLE)) >= 0 && hole < end) {
        off_t data = lseek(guest_fd, hole, SEEK_DATA);

        if (data < 0) {
            data = end;
        }
        write_guest_pages((gsize)hole / PF_PAGE_SIZE, (gsize)data / PF_PAGE_SIZE);
        hole = data;
    }
}

/* Guest RAM as QEMU maps it: a shared memfd mapping, here 2 MiB-aligned. */
static guint8 *
map_guest(int fd)
{
    gsize len = (gsize)GUEST_PAGES * PF_PAGE_SIZE;
    guint8 *area = mmap(NULL, len + HUGE_SIZE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    guint8 *host;

    if (area == MAP_FAILED) {
        abort();
    }
    host = (guint8 *)(((guintptr)area + HUGE_SIZE - 1) & ~(guintptr)(HUGE_SIZE - 1));
    if (mmap(host, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0) ==
        MAP_FAILED) {
        abort();
    }
    if (host > area) {
        munmap(area, (gsize)(host - area));
    }
    munmap(host + len, (gsize)(area + len + HUGE_SIZE - (host + len)));
    return host;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int before, sv[2], fd;
    guint8 *host;
    PfAgent *a;
    PfAgentRegion r;
    g_autofree char *why = NULL;
    gsize len = (gsize)GUEST_PAGES * PF_PAGE_SIZE;

    if (msg == NULL) {
        fuzz_quiet_logs();
        msg = g_new0(PfMsg, 1);
    }
    restore_guest();
    before = fuzz_count_fds();
    fd = guest_fd;
    host = map_guest(fd);
    check_guest(host, "the last input's end");
    a = pf_agent_new("fuzz", NULL);
    r = (PfAgentRegion){ "pc.ram", host, len, fd, 0, { MADV_DONTFORK } };
    if (!pf_agent_add_region(a, &r, NULL)) {
        abort();
    }
    /* What the handshake does once WELCOME offers merge (settle_mode()),
     * without pagefoldd: its messages come from the input. */
    fuzz_socketpair(sv);
    /* pagefoldd's end, drained without waiting (drain_replies()). */
    if (fcntl(sv[0], F_SETFL, O_NONBLOCK) < 0) {
        abort();
    }
    g_mutex_lock(&a->work);
    a->sock = sv[1];
    a->posting = TRUE;
    pfa_set_mode(a, pfa_uffd_setup(a, -1, &why) ? PF_MODE_MERGE : PF_MODE_ADVISE,
                 why ? why : "");
    a->ready = TRUE;
    g_mutex_unlock(&a->work);

    while (size >= 3) {
        guint spec = data[0], n = data[1] | (guint)data[2] << 8;
        g_autoptr(GError) error = NULL;
        gboolean ok;

        data += 3;
        size -= 3;
        n = MIN(n, size);
        if (!fuzz_send(sv[0], data, n, spec & 3, (spec >> 2 & 3) * 0x55,
                       (spec >> 4) ? (spec >> 4) * 4 : 1)) {
            break;
        }
        data += n;
        size -= n;
        if (!pf_proto_recv(a->sock, msg, &error)) {
            break; /* serve(): the link ends */
        }
        g_mutex_lock(&a->work);
        ok = pfa_dispatch(a, msg, &error);
        pf_msg_close_fds(msg);
        if (!ok && error != NULL) {
            pfa_post_error(a, error->message);
        }
        g_mutex_unlock(&a->work);
        g_clear_error(&error);
        ok = pfa_flush(a, &error) && ok;
        drain_replies(sv[0]);
        check_guest(host, "a message");
        if (!ok) {
            break;
        }
    }
    if (g_getenv("FUZZ_VERBOSE") != NULL) {
        /* To see that an input reaches what it was written for. */
        PfAgentStats st;

        pf_agent_get_stats(a, &st);
        fprintf(stderr, "fuzz: mode %s (%s): %" G_GUINT64_FORMAT " request(s), merged %"
                G_GUINT64_FORMAT ", zeroed %" G_GUINT64_FORMAT ", unmerged %" G_GUINT64_FORMAT
                ", changed %" G_GUINT64_FORMAT ", errors %" G_GUINT64_FORMAT "\n",
                a->mode == PF_MODE_MERGE ? "merge" : "advise", a->reason, st.requests, st.merged,
                st.zeroed, st.unmerged, st.changed, st.errors);
    }
    pf_agent_free(a); /* closes sv[1] */
    close(sv[0]);
    check_guest(host, "the agent's end");
    munmap(host, len);
    fuzz_check_fds(before, "the agent");
    return 0;
}
