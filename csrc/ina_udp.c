#define _GNU_SOURCE
#include "ina_udp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "ina_loop.h"

#define RX_BUF 65536
#define CTRL_COPY 1024 /* transient payloads copied into the send batch up to this size */
#define IDLE_MS 10
#define RUN_BATCHES 256 /* then return, so the caller sees signals and its stop flag */

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
    uint8_t *rbuf;
    /* send batch */
    struct mmsghdr smsg[INA_UDP_BATCH];
    struct iovec siov[INA_UDP_BATCH][2];
    struct sockaddr_in saddr[INA_UDP_BATCH];
    uint8_t shdr[INA_UDP_BATCH][INA_HEADER_SIZE];
    uint8_t sctrl[INA_UDP_BATCH][CTRL_COPY];
    int n_send;
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

int ina_udp_run(ina_udp *u)
{
    struct pollfd pfd = {.fd = u->fd, .events = POLLIN};
    for (int batches = 0; !u->stop && batches < RUN_BATCHES; batches++) {
        int r = poll(&pfd, 1, IDLE_MS);
        if (r < 0)
            return errno == EINTR ? 0 : -1; /* a signal: let the caller's handlers run */
        if (r == 0) { /* idle: let any packet held back for reordering go, and return to the caller */
            release_held(u);
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
            if (u->rmsg[i].msg_hdr.msg_flags & MSG_TRUNC)
                len = 0; /* larger than any valid packet: the core counts it as malformed */
            ina_loop_receive(&u->loop, addr_id(&u->raddr[i]), pkt, len);
        }
        flush(u);
        if (u->loop.punt.n)
            return u->loop.punt.n;
    }
    if (u->stop)
        release_held(u);
    return 0;
}
