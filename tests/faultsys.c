/*
 * faultsys.c - the agent's system calls, each one able to fail on a test's
 * word (pf_test_faulty_syscalls): one fault setting for the process, under
 * a lock, since the agent's thread makes the calls.  A call no test asked
 * to fail goes straight to the real one, unchanged.
 */
#include "faultsys.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

static struct {
    char *calls; /* ",a,b," */
    gint skip;
    gint times;
    int err;
    gboolean unmap;
} fault;
static GMutex fault_lock;
static gint hits;

void
pf_test_fault_set(const char *calls, int skip, int times, int err, gboolean unmap)
{
    g_mutex_lock(&fault_lock);
    g_free(fault.calls);
    fault.calls = calls != NULL ? g_strconcat(",", calls, ",", NULL) : NULL;
    fault.skip = skip;
    fault.times = times;
    fault.err = err;
    fault.unmap = unmap;
    hits = 0;
    g_mutex_unlock(&fault_lock);
}

int
pf_test_fault_hits(void)
{
    return g_atomic_int_get(&hits);
}

/* Should this call fail now?  Sets errno if so. */
static gboolean
fault_now(const char *call)
{
    g_autofree char *one = g_strconcat(",", call, ",", NULL);
    gboolean now = FALSE;

    g_mutex_lock(&fault_lock);
    if (fault.calls != NULL && strstr(fault.calls, one) != NULL && fault.times != 0 &&
        fault.skip-- <= 0) {
        if (fault.times > 0) {
            fault.times--;
        }
        hits++;
        now = TRUE;
    }
    g_mutex_unlock(&fault_lock);
    errno = now ? fault.err : errno;
    return now;
}

static void *
faulty_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    if ((flags & MAP_FIXED) &&
        fault_now((flags & MAP_SHARED) ? "mmap-shared" : "mmap-private")) {
        int e = errno;

        if (fault.unmap) {
            g_assert_cmpint(munmap(addr, len), ==, 0);
        }
        errno = e;
        return MAP_FAILED;
    }
    return mmap(addr, len, prot, flags, fd, off);
}

static int
faulty_fallocate(int fd, int mode, off_t off, off_t len)
{
    if (fault_now("fallocate")) {
        return errno ? -1 : 0;
    }
    return fallocate(fd, mode, off, len);
}

static ssize_t
faulty_pwrite(int fd, const void *buf, size_t n, off_t off)
{
    return fault_now("pwrite") ? -1 : pwrite(fd, buf, n, off);
}

static int
faulty_ioctl(int fd, unsigned long req, void *arg)
{
    gboolean wp = req == UFFDIO_WRITEPROTECT &&
                  (((struct uffdio_writeprotect *)arg)->mode & UFFDIO_WRITEPROTECT_MODE_WP);

    if ((req == UFFDIO_REGISTER && fault_now("register")) ||
        (req == UFFDIO_UNREGISTER && fault_now("unregister")) ||
        (req == UFFDIO_WRITEPROTECT && !wp && fault_now("wp-off")) ||
        (wp && fault_now("wp-on"))) {
        return -1;
    }
    return ioctl(fd, req, arg);
}

static int
faulty_madvise(void *addr, size_t len, int advice)
{
    return fault_now("madvise") ? -1 : madvise(addr, len, advice);
}

const PfAgentSyscalls pf_test_faulty_syscalls = {
    faulty_mmap, faulty_fallocate, faulty_pwrite, faulty_ioctl, faulty_madvise,
};
