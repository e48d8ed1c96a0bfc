/* LD_PRELOAD shim for tests/test_gso.py: a kernel (or a device without checksum offload) that refuses UDP
 * GSO. sendmsg/sendmmsg fail with EIO whenever the (first) message carries a UDP_SEGMENT cmsg, as such a
 * kernel does; everything else goes to libc. The C loops must then turn GSO off and resend the batch as
 * datagrams, with the same results. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

static int refused; /* reported at exit, so the test knows the refusal path ran */

__attribute__((destructor)) static void report(void) { fprintf(stderr, "refuse_gso: %d refused\n", refused); }

static int has_segment(const struct msghdr *m)
{
    if (!m->msg_control)
        return 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR((struct msghdr *)m); c; c = CMSG_NXTHDR((struct msghdr *)m, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_SEGMENT)
            return 1;
    return 0;
}

int sendmmsg(int fd, struct mmsghdr *v, unsigned int n, int flags)
{
    static int (*real)(int, struct mmsghdr *, unsigned int, int);
    if (!real)
        real = (int (*)(int, struct mmsghdr *, unsigned int, int))dlsym(RTLD_NEXT, "sendmmsg");
    unsigned int ok = 0;
    while (ok < n && !has_segment(&v[ok].msg_hdr))
        ok++;
    if (ok == 0 && n > 0) {
        __atomic_fetch_add(&refused, 1, __ATOMIC_RELAXED);
        errno = EIO;
        return -1;
    }
    return real(fd, v, ok, flags); /* the messages before the first GSO one, as a partial send */
}

ssize_t sendmsg(int fd, const struct msghdr *m, int flags)
{
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real)
        real = (ssize_t(*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    if (has_segment(m)) {
        __atomic_fetch_add(&refused, 1, __ATOMIC_RELAXED);
        errno = EIO;
        return -1;
    }
    return real(fd, m, flags);
}
