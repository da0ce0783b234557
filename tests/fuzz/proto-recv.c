/*
 * proto-recv.c - fuzzes pf_proto_recv(), the agent protocol as pagefoldd
 * reads it from a QEMU it does not trust: one SOCK_SEQPACKET datagram of
 * any bytes, with up to 7 descriptors (memfds, sealed or not, pipes,
 * /dev/null) passed by SCM_RIGHTS.
 *
 * Input: byte 0 & 7 descriptors, byte 1 their kinds (2 bits each,
 * fuzz_make_fd()), then the datagram.
 *
 * Checks, beyond ASan/UBSan: a message accepted is of a known type, its
 * length the datagram's less the header, its descriptor count within what
 * the protocol allows, and its typed view (pf_msg_*()) reads only inside
 * the payload; a message refused leaves no descriptor behind; and no
 * input leaks a descriptor either way (counted in /proc/self/fd).
 */
#include <stdint.h>

#include "fuzz-common.h"
#include "proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int sv[2] = { -1, -1 };
static PfMsg *msg;

/*
 * Reads what the typed view of an accepted message exposes.  PfMsg's
 * payload is 64 KiB whatever was received, so ASan cannot see a view
 * reach past the datagram: the sizes are checked against its length, the
 * lists' as their 8-byte header (proto.c's ListHeader) and n entries.
 */
static void
within(const PfMsg *m, gsize view)
{
    if (view > m->header.length) {
        fprintf(stderr, "fuzz: type %u's view of %zu bytes in a payload of %u\n",
                m->header.type, view, m->header.length);
        abort();
    }
}

/* A wire string that pagefoldd will print or copy ends in its field. */
static gsize
terminated(const char *field, gsize size)
{
    gsize len = strnlen(field, size);

    if (len == size) {
        fprintf(stderr, "fuzz: accepted a string field without its NUL\n");
        abort();
    }
    return len;
}

static guint64
touch(const PfMsg *m)
{
    guint64 sum = 0;
    guint32 n;

    switch (m->header.type) {
    case PF_MSG_HELLO:
        within(m, sizeof(PfWireHello));
        sum += pf_msg_hello(m)->n_regions + terminated(pf_msg_hello(m)->name, PF_PROTO_NAME_LEN);
        break;
    case PF_MSG_REGION:
        within(m, sizeof(PfWireRegion));
        sum += pf_msg_region(m)->size + terminated(pf_msg_region(m)->name, PF_PROTO_NAME_LEN);
        break;
    case PF_MSG_WELCOME:
    case PF_MSG_READY:
    case PF_MSG_ADVISE:
        within(m, sizeof(PfWireMode));
        sum += pf_msg_mode(m)->mode + terminated(pf_msg_mode(m)->reason, PF_PROTO_REASON_LEN);
        break;
    case PF_MSG_POOL:
    case PF_MSG_DROP:
        within(m, sizeof(PfWirePool));
        sum += pf_msg_pool(m)->n_slots;
        break;
    case PF_MSG_REQUEST: {
        const PfWireItem *items = pf_msg_items(m, &n);

        within(m, 8 + (gsize)n * sizeof(*items));

        for (guint32 i = 0; i < n; i++) {
            sum += items[i].kind + items[i].page + items[i].slot;
        }
        break;
    }
    case PF_MSG_RESULT: {
        const PfWireResult *res = pf_msg_results(m, &n);

        within(m, 8 + (gsize)n * sizeof(*res));

        for (guint32 i = 0; i < n; i++) {
            sum += res[i].status + (guint32)res[i].err;
        }
        break;
    }
    case PF_MSG_DISCARD:
    case PF_MSG_GONE:
        within(m, sizeof(PfWireRange));
        sum += pf_msg_range(m)->n_pages;
        break;
    case PF_MSG_HINT: {
        const PfWireRange *hints = pf_msg_hints(m, &n);

        within(m, 8 + (gsize)n * sizeof(*hints));
        for (guint32 i = 0; i < n; i++) {
            sum += hints[i].page + hints[i].n_pages;
        }
        break;
    }
    case PF_MSG_ERROR:
        break;
    default:
        fprintf(stderr, "fuzz: accepted a message of type %u\n", m->header.type);
        abort();
    }
    return sum;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    g_autoptr(GError) error = NULL;
    guint n_fds, kinds;
    int before;
    volatile guint64 sink;

    if (size < 2) {
        return 0;
    }
    if (sv[0] < 0) {
        fuzz_quiet_logs();
        fuzz_socketpair(sv);
        /* fuzz_send() must fail, not wait: this thread is its only reader. */
        if (fcntl(sv[0], F_SETFL, O_NONBLOCK) < 0) {
            abort();
        }
        msg = g_new0(PfMsg, 1);
    }
    n_fds = data[0] & 7;
    kinds = data[1] | (guint)data[1] << 8;
    data += 2;
    size -= 2;

    before = fuzz_count_fds();
    if (!fuzz_send(sv[0], data, size, n_fds, kinds, 1)) {
        fuzz_check_fds(before, "a datagram the kernel refused");
        return 0;
    }
    /* Stale bytes of an earlier input must not make a short one look whole. */
    memset(msg, 0xa5, sizeof(*msg));
    if (pf_proto_recv(sv[1], msg, &error)) {
        if (size < sizeof(PfMsgHeader) || msg->header.length != size - sizeof(PfMsgHeader) ||
            msg->n_fds > PF_PROTO_MAX_FDS || msg->n_fds > n_fds) {
            fprintf(stderr, "fuzz: accepted %zu bytes as a message of %u bytes, %u fds\n",
                    size, msg->header.length, msg->n_fds);
            abort();
        }
        sink = touch(msg);
        (void)sink;
        for (guint i = 0; i < msg->n_fds; i++) {
            if (fcntl(msg->fds[i], F_GETFD) < 0) {
                fprintf(stderr, "fuzz: accepted a message with a closed fd\n");
                abort();
            }
        }
        pf_msg_close_fds(msg);
    } else if (error == NULL || msg->n_fds != 0) {
        fprintf(stderr, "fuzz: refused a message without an error, or kept its fds\n");
        abort();
    }
    fuzz_check_fds(before, "pf_proto_recv()");
    return 0;
}
