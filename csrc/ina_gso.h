/* UDP GSO / GRO helpers shared by the worker loop (ina_worker.c) and the switch's UDP loop (ina_udp.c).
 *
 * Why: on loopback one datagram per send costs the kernel about as much as 63 segments of one GSO send
 * (issue 16: 0.23 M vs 5.7 M datagrams/s from one sender to one receiver). A GSO send (UDP_SEGMENT) is
 * cut by the kernel into ordinary datagrams of gso_size bytes (the last may be shorter), so a receiver
 * without UDP_GRO, and the switch core, see exactly the datagrams sendmmsg would have sent. A socket with
 * UDP_GRO may instead receive a run of them as one buffer, with the segment size in a cmsg; the loops
 * cut it back into datagrams before anything else looks at them. Header-only. */
#ifndef INA_GSO_H
#define INA_GSO_H
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

#define INA_GSO_MAX_SEGS 64     /* UDP_MAX_SEGMENTS of older kernels (newer ones allow 128) */
#define INA_GSO_MAX_BYTES 65507 /* one IPv4 datagram: 65535 less the IP and UDP headers */
#define INA_GSO_CMSG_SPACE CMSG_SPACE(sizeof(uint16_t))
#define INA_GRO_CMSG_SPACE CMSG_SPACE(sizeof(int))
#define INA_GRO_BUF 65536 /* a coalesced receive holds at most one IPv4 datagram's worth */

/* how many of the n packets with lengths len[0..n) can go as one GSO send: all but the last exactly len[0]
 * bytes, the last at most that, within the segment and byte limits; 1 means send it on its own */
static inline int ina_gso_run(const uint32_t *len, int n)
{
    uint32_t seg = len[0], total = seg;
    int k = 1;
    while (k < n && k < INA_GSO_MAX_SEGS && len[k] <= seg && total + len[k] <= INA_GSO_MAX_BYTES) {
        total += len[k++];
        if (len[k - 1] < seg)
            break; /* a shorter segment ends the send */
    }
    return k;
}

/* iov[0..n) into out with neighbours that are adjacent in memory joined (a GSO send's segments are cut at its
 * segment size, not at the iovecs: one copy of a run of packets laid out back to back); out's count */
static inline size_t ina_iov_join(const struct iovec *iov, size_t n, struct iovec *out)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (m && (const char *)out[m - 1].iov_base + out[m - 1].iov_len == (const char *)iov[i].iov_base)
            out[m - 1].iov_len += iov[i].iov_len;
        else
            out[m++] = iov[i];
    }
    return m;
}

/* make m a GSO send of seg-byte segments; ctrl: INA_GSO_CMSG_SPACE bytes that live until it is sent */
static inline void ina_gso_cmsg(struct msghdr *m, void *ctrl, uint16_t seg)
{
    memset(ctrl, 0, INA_GSO_CMSG_SPACE);
    m->msg_control = ctrl;
    m->msg_controllen = INA_GSO_CMSG_SPACE;
    struct cmsghdr *c = CMSG_FIRSTHDR(m);
    c->cmsg_level = SOL_UDP;
    c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    memcpy(CMSG_DATA(c), &seg, sizeof seg);
}

/* the errors with which a kernel (or a device without checksum offload) refuses UDP_SEGMENT: the loop
 * then sends one datagram per message from there on */
static inline int ina_gso_refused(int err) { return err == EINVAL || err == ENOPROTOOPT || err == EIO; }

/* UDP_GRO on (1) or off (0) for fd; 0 on success, -1 where the kernel has no UDP_GRO */
static inline int ina_gro_set(int fd, int on) { return setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof on); }

/* a received message's segment size from its UDP_GRO cmsg; 0 when it is one datagram */
static inline uint32_t ina_gro_size(struct msghdr *m)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            return size > 0 ? (uint32_t)size : 0;
        }
    return 0;
}
#endif
