#define _GNU_SOURCE
#include "ina_udp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "ina_rng.h"

#define RX_BUF 65536
#define IDLE_MS 10
#define RUN_BATCHES 256 /* then return, so the caller sees signals and its stop flag */

typedef struct {
    uint8_t *buf;
    uint32_t len;
    uint64_t src;
    int full;
} held_pkt;

struct ina_udp {
    ina_switch *sw;
    int fd;
    volatile int stop;
    double loss, dup, reorder;
    uint64_t rng_key, rng_ctr;
    ina_udp_counters c;
    /* receive batch */
    struct mmsghdr rmsg[INA_UDP_BATCH];
    struct iovec riov[INA_UDP_BATCH];
    struct sockaddr_in raddr[INA_UDP_BATCH];
    uint8_t *rbuf;
    /* send batch */
    struct mmsghdr smsg[INA_UDP_BATCH];
    struct iovec siov[INA_UDP_BATCH][2];
    struct sockaddr_in saddr[INA_UDP_BATCH];
    uint8_t shdr[INA_UDP_BATCH][INA_HEADER_SIZE];
    uint8_t sctrl[INA_UDP_BATCH][INA_CTRL_PAYLOAD];
    int n_send;
    ina_out out[INA_MAX_OUT];
    held_pkt held[2]; /* [0] a received packet held back, [1] a packet to send held back */
    /* control-plane packets for the caller */
    uint8_t punt[INA_UDP_MAX_PUNT][2048];
    uint32_t punt_len[INA_UDP_MAX_PUNT];
    struct sockaddr_in punt_src[INA_UDP_MAX_PUNT];
    int n_punt;
};

static double uniform(ina_udp *u) { return (double)(ina_rng_word(u->rng_key, u->rng_ctr++) >> 11) * 0x1p-53; }

ina_udp *ina_udp_new(ina_switch *sw, int fd, double loss, double dup, double reorder, uint64_t seed)
{
    if (loss < 0 || loss >= 1 || dup < 0 || dup >= 1 || reorder < 0 || reorder >= 1)
        return NULL;
    ina_udp *u = calloc(1, sizeof *u);
    if (!u)
        return NULL;
    u->rbuf = malloc((size_t)INA_UDP_BATCH * RX_BUF);
    u->held[0].buf = malloc(RX_BUF);
    u->held[1].buf = malloc(RX_BUF + INA_HEADER_SIZE);
    if (!u->rbuf || !u->held[0].buf || !u->held[1].buf) {
        ina_udp_free(u);
        return NULL;
    }
    u->sw = sw;
    u->fd = fd;
    u->loss = loss;
    u->dup = dup;
    u->reorder = reorder;
    u->rng_key = ina_rng_key(seed);
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
    free(u->held[0].buf);
    free(u->held[1].buf);
    free(u);
}

void ina_udp_stop(ina_udp *u) { u->stop = 1; }
const ina_udp_counters *ina_udp_counters_of(const ina_udp *u) { return &u->c; }
void ina_udp_punt_clear(ina_udp *u) { u->n_punt = 0; }

const uint8_t *ina_udp_punt(const ina_udp *u, int i, uint32_t *len, uint32_t *ip, uint16_t *port)
{
    *len = u->punt_len[i];
    *ip = ntohl(u->punt_src[i].sin_addr.s_addr);
    *port = ntohs(u->punt_src[i].sin_port);
    return u->punt[i];
}

static inline uint64_t addr_id(const struct sockaddr_in *a)
{
    return (uint64_t)ntohl(a->sin_addr.s_addr) << 16 | ntohs(a->sin_port);
}

/* ------------------------------------------------------------------ sending */
static void flush(ina_udp *u)
{
    int done = 0;
    while (done < u->n_send) {
        int r = sendmmsg(u->fd, u->smsg + done, (unsigned)(u->n_send - done), 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            u->c.send_errors++; /* e.g. a worker that went away; never fatal to the switch */
            done++;
            continue;
        }
        for (int i = done; i < done + r; i++)
            u->c.bytes_out += u->smsg[i].msg_len;
        done += r;
    }
    u->n_send = 0;
}

static void queue(ina_udp *u, uint64_t dst, const uint8_t *hdr, const uint8_t *payload, uint32_t len, int copy)
{
    int i = u->n_send;
    memcpy(u->shdr[i], hdr, INA_HEADER_SIZE);
    if (copy && len <= INA_CTRL_PAYLOAD) {
        memcpy(u->sctrl[i], payload, len);
        payload = u->sctrl[i];
        copy = 0;
    }
    struct sockaddr_in *a = &u->saddr[i];
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl((uint32_t)(dst >> 16));
    a->sin_port = htons((uint16_t)dst);
    u->siov[i][0] = (struct iovec){u->shdr[i], INA_HEADER_SIZE};
    u->siov[i][1] = (struct iovec){(void *)payload, len};
    memset(&u->smsg[i], 0, sizeof u->smsg[i]);
    u->smsg[i].msg_hdr.msg_name = a;
    u->smsg[i].msg_hdr.msg_namelen = sizeof *a;
    u->smsg[i].msg_hdr.msg_iov = u->siov[i];
    u->smsg[i].msg_hdr.msg_iovlen = 2;
    u->n_send++;
    /* a payload we could not copy (a held-back result) must leave before its buffer is reused */
    if (copy || u->n_send == INA_UDP_BATCH)
        flush(u);
}

static void release_tx(ina_udp *u)
{
    held_pkt *h = &u->held[1];
    if (!h->full)
        return;
    h->full = 0;
    queue(u, h->src, h->buf, h->buf + INA_HEADER_SIZE, h->len, 1);
}

/* the sending side of the impaired network, as switchsim.server.Impairment.apply */
static void emit(ina_udp *u, const ina_out *o)
{
    if (u->loss && uniform(u) < u->loss) {
        u->c.dropped[1]++;
        return;
    }
    int twice = u->dup && uniform(u) < u->dup;
    if (twice)
        u->c.duplicated[1]++;
    if (u->held[1].full) {
        queue(u, o->dst, o->hdr, o->payload, o->len, !o->stable);
        if (twice)
            queue(u, o->dst, o->hdr, o->payload, o->len, !o->stable);
        release_tx(u);
    } else if (u->reorder && uniform(u) < u->reorder) {
        u->c.reordered[1]++;
        held_pkt *h = &u->held[1];
        memcpy(h->buf, o->hdr, INA_HEADER_SIZE);
        memcpy(h->buf + INA_HEADER_SIZE, o->payload, o->len);
        h->len = o->len;
        h->src = o->dst;
        h->full = 1;
        if (twice)
            queue(u, o->dst, o->hdr, o->payload, o->len, !o->stable);
    } else {
        queue(u, o->dst, o->hdr, o->payload, o->len, !o->stable);
        if (twice)
            queue(u, o->dst, o->hdr, o->payload, o->len, !o->stable);
    }
}

/* ------------------------------------------------------------------ receiving */
static void deliver(ina_udp *u, const uint8_t *pkt, uint32_t len, uint64_t src)
{
    int n = ina_switch_process(u->sw, pkt, len, src, u->out);
    int impaired = u->loss || u->dup || u->reorder;
    for (int i = 0; i < n; i++) {
        if (impaired)
            emit(u, &u->out[i]);
        else
            queue(u, u->out[i].dst, u->out[i].hdr, u->out[i].payload, u->out[i].len, !u->out[i].stable);
    }
}

static void release_rx(ina_udp *u)
{
    held_pkt *h = &u->held[0];
    if (!h->full)
        return;
    h->full = 0; /* the buffer is not reused before deliver returns: only a later packet can be held */
    deliver(u, h->buf, h->len, h->src);
}

static void receive(ina_udp *u, const uint8_t *pkt, uint32_t len, uint64_t src)
{
    if (u->loss && uniform(u) < u->loss) {
        u->c.dropped[0]++;
        return;
    }
    int twice = u->dup && uniform(u) < u->dup;
    if (twice)
        u->c.duplicated[0]++;
    if (u->held[0].full) {
        deliver(u, pkt, len, src);
        if (twice)
            deliver(u, pkt, len, src);
        release_rx(u);
    } else if (u->reorder && uniform(u) < u->reorder) {
        u->c.reordered[0]++;
        held_pkt *h = &u->held[0];
        memcpy(h->buf, pkt, len);
        h->len = len;
        h->src = src;
        h->full = 1;
        if (twice)
            deliver(u, pkt, len, src);
    } else {
        deliver(u, pkt, len, src);
        if (twice)
            deliver(u, pkt, len, src);
    }
}

int ina_udp_run(ina_udp *u)
{
    struct pollfd pfd = {.fd = u->fd, .events = POLLIN};
    for (int batches = 0; !u->stop && batches < RUN_BATCHES; batches++) {
        int r = poll(&pfd, 1, IDLE_MS);
        if (r < 0)
            return errno == EINTR ? 0 : -1; /* a signal: let the caller's handlers run */
        if (r == 0) { /* idle: let any packet held back for reordering go, and return to the caller */
            release_rx(u);
            release_tx(u);
            flush(u);
            return 0;
        }
        for (int i = 0; i < INA_UDP_BATCH; i++) {
            memset(&u->rmsg[i].msg_hdr, 0, sizeof u->rmsg[i].msg_hdr);
            u->rmsg[i].msg_hdr.msg_iov = &u->riov[i];
            u->rmsg[i].msg_hdr.msg_iovlen = 1;
            u->rmsg[i].msg_hdr.msg_name = &u->raddr[i];
            u->rmsg[i].msg_hdr.msg_namelen = sizeof u->raddr[i];
        }
        int n = recvmmsg(u->fd, u->rmsg, INA_UDP_BATCH, MSG_DONTWAIT, NULL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNREFUSED)
                continue;
            return -1;
        }
        u->c.recv_batches++;
        for (int i = 0; i < n; i++) {
            const uint8_t *pkt = u->riov[i].iov_base;
            uint32_t len = u->rmsg[i].msg_len;
            u->c.bytes_in += len;
            if (len >= INA_HEADER_SIZE && pkt[INA_OFF_TYPE] == INA_MSG_STATS_REQ) {
                if (u->n_punt == INA_UDP_MAX_PUNT || len > sizeof u->punt[0]) {
                    u->c.punts_dropped++;
                    continue;
                }
                memcpy(u->punt[u->n_punt], pkt, len);
                u->punt_len[u->n_punt] = len;
                u->punt_src[u->n_punt++] = u->raddr[i];
                continue;
            }
            if (u->rmsg[i].msg_hdr.msg_flags & MSG_TRUNC)
                len = 0; /* larger than any valid packet: the core counts it as malformed */
            receive(u, pkt, len, addr_id(&u->raddr[i]));
        }
        flush(u);
        if (u->n_punt)
            return u->n_punt;
    }
    if (u->stop) {
        release_rx(u);
        release_tx(u);
        flush(u);
    }
    return 0;
}
