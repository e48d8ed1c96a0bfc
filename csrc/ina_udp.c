#define _GNU_SOURCE
#include "ina_udp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "ina_gso.h"
#include "ina_wait.h"
#include "ina_loop.h"

#define RX_BUF 65536
#define CTRL_COPY 1024 /* transient payloads copied into the send batch up to this size */
#define IDLE_MS 10
#define RUN_BATCHES 256 /* then return, so the caller sees signals and its stop flag */
/* packets queued before a flush: a result goes to every worker of its job, so a batch of 256 gives each
 * of 4 workers GSO runs of up to 64 results */
#define SEND_BATCH 256
/* a receive asks for as many messages as hold about RX_BATCH_BYTES at the last receive's mean size (UDP_GRO's
 * runs of up to 64 KiB: 8; single datagrams: INA_UDP_BATCH), so the sums read the datagrams while the kernel's copy
 * of them is still in this core's cache (docs/performance.md, "The switch's receive") */
#define RX_BATCH_BYTES (256u << 10)
#define RX_BATCH_MIN 8
/* a receive's cmsgs: UDP_GRO's segment size and the IP header's TOS byte (IP_RECVTOS: its ECN field) */
#define RX_CMSG_SPACE (INA_GRO_CMSG_SPACE + CMSG_SPACE(sizeof(int)))
/* a send's cmsgs: UDP_SEGMENT for a GSO run, IP_TOS for a data packet's ECN field (ECT(0)) */
#define TX_CMSG_SPACE (INA_GSO_CMSG_SPACE + CMSG_SPACE(sizeof(int)))

struct ina_udp {
    ina_loop loop; /* core, impairments, punt queue */
    ina_capture cap;
    int fd;
    volatile int stop;
    ina_udp_counters c;
    /* receive batch */
    struct mmsghdr rmsg[INA_UDP_BATCH];
    struct iovec riov[INA_UDP_BATCH];
    struct sockaddr_in raddr[INA_UDP_BATCH];
    char rctrl[INA_UDP_BATCH][RX_CMSG_SPACE];
    uint8_t *rbuf;
    int gro; /* UDP_GRO is on: a receive may hold a run of datagrams */
    int rx_vlen; /* messages the next receive asks for (RX_BATCH_BYTES) */
    /* send batch: per queued packet its header, payload, destination */
    struct iovec siov[SEND_BATCH][2];
    struct sockaddr_in saddr[SEND_BATCH];
    uint64_t sdst[SEND_BATCH];
    uint8_t shdr[SEND_BATCH][INA_HEADER_SIZE];
    uint8_t sctrl[SEND_BATCH][CTRL_COPY];
    int n_send;
    /* ... and as sent: packets grouped by destination (giov, glen in that order), one message per GSO run
     * or single packet, with its first position in giov and its packet count */
    int gso; /* INA_UDP_GSO_*; OFF once the kernel refused UDP_SEGMENT */
    struct iovec giov[SEND_BATCH][2];
    uint32_t glen[SEND_BATCH];
    int gpkt[SEND_BATCH];
    struct mmsghdr gmsg[SEND_BATCH];
    char gctrl[SEND_BATCH][TX_CMSG_SPACE];
    int gfirst[SEND_BATCH], gcount[SEND_BATCH];
};

static void send_sink(void *ctx, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                      uint32_t len, int transient);

ina_udp *ina_udp_new(ina_switch *sw, int fd, double loss, double dup, double reorder, uint64_t seed)
{
    if (loss < 0 || loss >= 1 || dup < 0 || dup >= 1 || reorder < 0 || reorder >= 1)
        return NULL;
    ina_udp *u = calloc(1, sizeof *u);
    if (!u)
        return NULL;
    u->rbuf = malloc((size_t)INA_UDP_BATCH * RX_BUF);
    int bad = !u->rbuf;
    bad |= ina_loop_init(&u->loop, sw, loss, dup, reorder, seed, RX_BUF + INA_HEADER_SIZE, send_sink, u);
    if (bad) {
        ina_udp_free(u);
        return NULL;
    }
    u->fd = fd;
    u->gso = INA_UDP_GSO_LOOPBACK;
    u->rx_vlen = INA_UDP_BATCH;
    u->gro = ina_gro_set(fd, 1) == 0; /* RX_BUF already holds the largest coalesced receive */
    int on = 1; /* each receive's TOS byte: CE marks its packets congested (docs/protocol.md, "Congestion") */
    setsockopt(fd, IPPROTO_IP, IP_RECVTOS, &on, sizeof on);
    int ect0 = INA_ECT0; /* the socket's own ECN field is the results' (the bulk): only an answer carries a cmsg */
    setsockopt(fd, IPPROTO_IP, IP_TOS, &ect0, sizeof ect0);
    for (int i = 0; i < INA_UDP_BATCH; i++) {
        u->riov[i].iov_base = u->rbuf + (size_t)i * RX_BUF;
        u->riov[i].iov_len = RX_BUF;
    }
    return u;
}

void ina_udp_free(ina_udp *u)
{
    if (!u)
        return;
    free(u->rbuf);
    ina_capture_close(&u->cap);
    ina_loop_free(&u->loop);
    free(u);
}

void ina_udp_stop(ina_udp *u) { u->stop = 1; }
void ina_udp_set_gso(ina_udp *u, int mode) { u->gso = mode; }
const ina_udp_counters *ina_udp_counters_of(const ina_udp *u)
{
    ina_udp_counters *c = (ina_udp_counters *)&u->c;
    ina_loop_counters(&u->loop, c->dropped, c->duplicated, c->reordered, &c->punts_dropped);
    c->captured = u->cap.packets, c->capture_skipped = u->cap.skipped;
    return c;
}

int ina_udp_capture(ina_udp *u, const char *path, uint64_t max_bytes, uint64_t self_id)
{
    if (ina_capture_open(&u->cap, path, max_bytes, self_id)) {
        ina_capture_close(&u->cap);
        return -1;
    }
    u->loop.cap = &u->cap;
    return 0;
}

void ina_udp_capture_close(ina_udp *u)
{
    u->loop.cap = NULL;
    ina_capture_close(&u->cap);
}
void ina_udp_punt_clear(ina_udp *u) { u->loop.punt.n = 0; }

const uint8_t *ina_udp_punt(const ina_udp *u, int i, uint32_t *len, uint64_t *src)
{
    return ina_loop_punt(&u->loop, i, len, src);
}

static inline uint64_t addr_id(const struct sockaddr_in *a)
{
    return (uint64_t)ntohl(a->sin_addr.s_addr) << 16 | ntohs(a->sin_port);
}

/* ------------------------------------------------------------------ sending */
/* a destination on this host: 127/8, or a job's results group (239.255/16, inaproto/net.py GROUP_NET), which
 * the control plane names only for a switch bound on loopback and which leaves by lo with TTL 0 */
static inline int on_loopback(uint64_t dst) { return dst >> 40 == 127 || dst >> 32 == 0xEFFF; }

/* the send batch into giov/glen/gpkt, grouped by destination in queue order within each (each worker
 * sees its results in the order the core emitted them; the order across workers is nobody's concern) */
static void group_by_destination(ina_udp *u)
{
    uint8_t taken[SEND_BATCH] = {0};
    int m = 0;
    for (int i = 0; i < u->n_send; i++) {
        if (taken[i])
            continue;
        for (int j = i; j < u->n_send; j++)
            if (!taken[j] && u->sdst[j] == u->sdst[i]) {
                taken[j] = 1;
                u->giov[m][0] = u->siov[j][0];
                u->giov[m][1] = u->siov[j][1];
                u->glen[m] = (uint32_t)(u->siov[j][0].iov_len + u->siov[j][1].iov_len);
                u->gpkt[m++] = j;
            }
    }
}

/* message h's cmsgs in ctrl (TX_CMSG_SPACE bytes): UDP_SEGMENT of seg bytes for a GSO run (run > 1), and the
 * IP_TOS of its packets' ECN field (ina_ecn_out) unless it is ECT(0) (the socket's own: ina_udp_new) */
static void send_cmsgs(struct msghdr *h, char *ctrl, int run, uint16_t seg, int ecn)
{
    int tos = ecn != INA_ECT0;
    size_t len = (run > 1 ? CMSG_SPACE(sizeof seg) : 0) + (tos ? CMSG_SPACE(sizeof ecn) : 0);
    if (!len)
        return;
    memset(ctrl, 0, TX_CMSG_SPACE);
    h->msg_control = ctrl;
    h->msg_controllen = len;
    struct cmsghdr *c = CMSG_FIRSTHDR(h);
    if (run > 1) {
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof seg);
        memcpy(CMSG_DATA(c), &seg, sizeof seg);
        c = CMSG_NXTHDR(h, c);
    }
    if (tos && c) {
        c->cmsg_level = IPPROTO_IP;
        c->cmsg_type = IP_TOS;
        c->cmsg_len = CMSG_LEN(sizeof ecn);
        memcpy(CMSG_DATA(c), &ecn, sizeof ecn);
    }
}

/* queued packet i's ECN field (its class: a run never mixes two) */
static inline int ecn_of(const ina_udp *u, int i) { return ina_ecn_out(u->shdr[i]); }

/* messages for the grouped packets from position `from` on: a run of same-size packets to one destination,
 * of one ECN class, becomes one GSO message (the kernel cuts it into the datagrams sendmmsg would have sent) */
static int pack(ina_udp *u, int from)
{
    int m = 0;
    for (int k = from; k < u->n_send; m++) {
        int same = 1, ecn = ecn_of(u, u->gpkt[k]);
        while (k + same < u->n_send && u->sdst[u->gpkt[k + same]] == u->sdst[u->gpkt[k]] &&
               ecn_of(u, u->gpkt[k + same]) == ecn)
            same++;
        uint64_t dst = u->sdst[u->gpkt[k]];
        int gso = u->gso == INA_UDP_GSO_ALL || (u->gso == INA_UDP_GSO_LOOPBACK && on_loopback(dst));
        int run = gso ? ina_gso_run(u->glen + k, same) : 1;
        struct msghdr *h = &u->gmsg[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &u->saddr[u->gpkt[k]];
        h->msg_namelen = sizeof u->saddr[0];
        h->msg_iov = u->giov[k];
        h->msg_iovlen = 2 * (size_t)run; /* header and payload per packet, one after the other */
        send_cmsgs(h, u->gctrl[m], run, (uint16_t)u->glen[k], ecn);
        u->gfirst[m] = k;
        u->gcount[m] = run;
        k += run;
    }
    return m;
}

/* send the grouped packets from position `from` on; where to go on from after a GSO message the kernel
 * refused (GSO is off from then on), else n_send */
static int send_from(ina_udp *u, int from)
{
    int m = pack(u, from), done = 0;
    while (done < m) {
        int r = sendmmsg(u->fd, u->gmsg + done, (unsigned)(m - done), 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (u->gcount[done] > 1 && ina_gso_refused(errno)) {
                u->gso = INA_UDP_GSO_OFF;
                return u->gfirst[done];
            }
            u->c.send_errors += (uint64_t)u->gcount[done]; /* e.g. a worker that went away; never fatal */
            done++;
            continue;
        }
        for (int i = done; i < done + r; i++) {
            u->c.bytes_out += u->gmsg[i].msg_len;
            u->c.gso_sends += u->gcount[i] > 1;
        }
        done += r;
    }
    return u->n_send;
}

static void flush(ina_udp *u)
{
    group_by_destination(u);
    for (int from = 0; from < u->n_send;)
        from = send_from(u, from);
    u->n_send = 0;
}

static void queue(ina_udp *u, uint64_t dst, const uint8_t *hdr, const uint8_t *payload, uint32_t len, int copy)
{
    int i = u->n_send;
    memcpy(u->shdr[i], hdr, INA_HEADER_SIZE);
    if (copy && len <= CTRL_COPY) {
        memcpy(u->sctrl[i], payload, len);
        payload = u->sctrl[i];
        copy = 0;
    }
    struct sockaddr_in *a = &u->saddr[i];
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl((uint32_t)(dst >> 16));
    a->sin_port = htons((uint16_t)dst);
    u->sdst[i] = dst;
    u->siov[i][0] = (struct iovec){u->shdr[i], INA_HEADER_SIZE};
    u->siov[i][1] = (struct iovec){(void *)payload, len};
    u->n_send++;
    /* a payload we could not copy (a held-back result) must leave before its buffer is reused */
    if (copy || u->n_send == SEND_BATCH)
        flush(u);
}

static void send_sink(void *ctx, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                      uint32_t len, int transient)
{
    (void)hlen;
    queue(ctx, dst, hdr, payload, len, transient);
}

void ina_udp_send(ina_udp *u, uint64_t dst, const uint8_t *pkt, uint32_t len)
{
    if (len < INA_HEADER_SIZE)
        return;
    ina_loop_send(&u->loop, dst, pkt, INA_HEADER_SIZE, pkt + INA_HEADER_SIZE, len - INA_HEADER_SIZE, 1);
    flush(u);
}

static void release_held(ina_udp *u)
{
    ina_loop_release_held(&u->loop);
    flush(u);
}

/* ------------------------------------------------------------------ receiving */
static int receive_batch(ina_udp *u)
{
    for (int i = 0; i < u->rx_vlen; i++) {
        struct msghdr *h = &u->rmsg[i].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_iov = &u->riov[i];
        h->msg_iovlen = 1;
        h->msg_name = &u->raddr[i];
        h->msg_namelen = sizeof u->raddr[i];
        h->msg_control = u->rctrl[i]; /* UDP_GRO's segment size, the TOS byte */
        h->msg_controllen = sizeof u->rctrl[i];
    }
    return recvmmsg(u->fd, u->rmsg, (unsigned)u->rx_vlen, MSG_DONTWAIT, NULL);
}

/* whether a received message's IP header had ECN CE (its IP_TOS cmsg; one header for a whole UDP_GRO run) */
static int ce_marked(struct msghdr *m)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c))
        if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS && c->cmsg_len >= CMSG_LEN(1))
            return (*CMSG_DATA(c) & 3) == INA_CE;
    return 0;
}

/* one datagram of a receive to the loop, as the core takes it (CE: INA_FLAG_CONGESTED set) */
static inline void receive_one(ina_udp *u, uint64_t src, uint8_t *pkt, uint32_t len, int ce)
{
    if (ce)
        ina_mark_congested(pkt, len);
    ina_loop_receive(&u->loop, src, pkt, len);
}

/* message i of a receive batch to the loop, a coalesced UDP_GRO run datagram by datagram (cut at the
 * cmsg's segment size, the last one shorter), so impairments and the capture see each as before */
static void deliver(ina_udp *u, int i)
{
    uint8_t *pkt = u->riov[i].iov_base;
    uint32_t len = u->rmsg[i].msg_len, seg = u->gro ? ina_gro_size(&u->rmsg[i].msg_hdr) : 0;
    uint64_t src = addr_id(&u->raddr[i]);
    int ce = ce_marked(&u->rmsg[i].msg_hdr);
    u->c.bytes_in += len;
    if (u->rmsg[i].msg_hdr.msg_flags & MSG_TRUNC)
        len = 0, seg = 0; /* larger than any valid packet: the core counts it as malformed */
    if (!seg || seg >= len) {
        receive_one(u, src, pkt, len, ce);
        return;
    }
    for (uint32_t off = 0; off < len; off += seg) {
        receive_one(u, src, pkt + off, len - off < seg ? len - off : seg, ce);
        u->c.gro_segments++;
    }
}

int ina_udp_run(ina_udp *u)
{
    struct pollfd pfd = {.fd = u->fd, .events = POLLIN};
    int yields = 0;
    for (int batches = 0; !u->stop && batches < RUN_BATCHES; batches++) {
        int n = receive_batch(u);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) { /* nothing to read: yield, then sleep */
            if (ina_wait_yield(&yields)) {
                batches--; /* not a batch: RUN_BATCHES counts receives and sleeps */
                continue;
            }
            int r = poll(&pfd, 1, IDLE_MS);
            if (r < 0)
                return errno == EINTR ? 0 : -1; /* a signal: let the caller's handlers run */
            if (r == 0) { /* idle: let any packet held back for reordering go, and return to the caller */
                release_held(u);
                return 0;
            }
            continue;
        }
        if (n < 0) {
            if (errno == EINTR || errno == ECONNREFUSED)
                continue;
            return -1;
        }
        yields = 0;
        u->c.recv_batches++;
        uint64_t bytes = 0;
        for (int i = 0; i < n; i++) {
            bytes += u->rmsg[i].msg_len;
            deliver(u, i);
        }
        uint64_t fit = n ? RX_BATCH_BYTES * (uint64_t)n / (bytes + 1) : INA_UDP_BATCH;
        u->rx_vlen = fit < RX_BATCH_MIN ? RX_BATCH_MIN : fit > INA_UDP_BATCH ? INA_UDP_BATCH : (int)fit;
        flush(u);
        if (u->loop.punt.n)
            return u->loop.punt.n;
    }
    if (u->stop)
        release_held(u);
    return 0;
}
