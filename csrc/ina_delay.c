#define _GNU_SOURCE
#include "ina_delay.h"

#include <errno.h>
#include <linux/if_packet.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23 /* Linux 4.20; older kernels refuse it and the pkttype check does the work */
#endif

/* A direction's ring starts this small and doubles when it fills, up to the limit: preallocating the
 * default limit (100 000 frames of INA_DELAY_SLOT bytes, 200 MB a direction) would be absurd, while the
 * depth a link needs (its rate times the delay) is reached in a few doublings, after which nothing is
 * allocated again. Fixed-size slots rather than a byte ring: recvmmsg can then read straight into the
 * next free slots and sendmmsg send from them, with no copy and no wrap inside a frame. */
#define DELAY_FIRST_SLOTS 256u
#define DELAY_RECV_ROUNDS 16 /* batches read from one socket per wake-up: then the others get their turn */

typedef struct {
    uint8_t *buf;    /* cap slots of INA_DELAY_SLOT bytes */
    int64_t *due;    /* per slot: when it leaves (CLOCK_MONOTONIC ns) */
    uint32_t *len;   /* per slot: its bytes */
    uint32_t cap, head, count, max;
    int blocked;     /* the last send found the far socket's buffer full: wait for POLLOUT, not the clock */
    int64_t free_at; /* link mode: when the serializer has sent the last frame queued (ns) */
} delay_queue;

struct ina_delay {
    int nfds;
    int64_t delay_ns;
    uint32_t limit;
    double ns_per_byte;               /* link mode: 8e9 / rate; 0: no serialization */
    uint32_t ecn_bytes, limit_bytes;  /* link mode: the marking threshold and the queue's size */
    int *fds;
    struct pollfd *pfd;
    delay_queue *q; /* q[i]: frames that came in on fds[i], bound for fds[i ^ 1] */
    ina_delay_counters c;
    struct mmsghdr msg[INA_DELAY_BATCH];
    struct iovec iov[INA_DELAY_BATCH];
    struct sockaddr_ll addr[INA_DELAY_BATCH];
    uint8_t scratch[INA_DELAY_BATCH][INA_DELAY_SLOT]; /* frames read only to be dropped (a direction at its limit) */
};

static int64_t clock_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint32_t slot_index(const delay_queue *q, uint32_t k) { /* the k-th frame from the head */
    uint32_t i = q->head + k;
    return i >= q->cap ? i - q->cap : i;
}

static uint8_t *slot(const delay_queue *q, uint32_t k) {
    return q->buf + (size_t)slot_index(q, k) * INA_DELAY_SLOT;
}

static void queue_free(delay_queue *q) {
    free(q->buf), free(q->due), free(q->len);
    q->buf = NULL, q->due = NULL, q->len = NULL;
}

/* Give q room for cap frames, the waiting ones moved to the front in order. 0, or -1 (no memory: q unchanged). */
static int queue_resize(delay_queue *q, uint32_t cap) {
    delay_queue n = *q;
    n.buf = malloc((size_t)cap * INA_DELAY_SLOT);
    n.due = malloc((size_t)cap * sizeof *n.due);
    n.len = malloc((size_t)cap * sizeof *n.len);
    if (!n.buf || !n.due || !n.len) {
        queue_free(&n);
        return -1;
    }
    for (uint32_t k = 0; k < q->count; k++) { /* only on growth: a few times in a run */
        uint32_t i = slot_index(q, k);
        memcpy(n.buf + (size_t)k * INA_DELAY_SLOT, q->buf + (size_t)i * INA_DELAY_SLOT, q->len[i]);
        n.due[k] = q->due[i], n.len[k] = q->len[i];
    }
    n.cap = cap, n.head = 0;
    queue_free(q);
    *q = n;
    return 0;
}

/* Frames the next read may keep in q: a batch's worth if the limit allows, growing the ring for it. If the
 * ring cannot grow (no memory), what does not fit is dropped as if the limit were reached. */
static uint32_t queue_room(ina_delay *d, delay_queue *q) {
    uint32_t allowed = d->limit - q->count;
    if (allowed > INA_DELAY_BATCH)
        allowed = INA_DELAY_BATCH;
    if (q->cap - q->count < allowed) {
        uint64_t cap = (uint64_t)q->cap * 2;
        if (cap < q->count + allowed)
            cap = q->count + allowed;
        if (cap > d->limit)
            cap = d->limit;
        queue_resize(q, (uint32_t)cap);
    }
    return q->cap - q->count < allowed ? q->cap - q->count : allowed;
}

/* Point the batch's messages at the next `room` free slots of q, the rest at scratch (frames to drop). */
static void recv_batch(ina_delay *d, const delay_queue *q, uint32_t room) {
    for (uint32_t k = 0; k < INA_DELAY_BATCH; k++) {
        d->iov[k].iov_base = k < room ? slot(q, q->count + k) : d->scratch[k];
        d->iov[k].iov_len = INA_DELAY_SLOT;
        memset(&d->msg[k].msg_hdr, 0, sizeof d->msg[k].msg_hdr);
        d->msg[k].msg_hdr.msg_name = &d->addr[k];
        d->msg[k].msg_hdr.msg_namelen = sizeof d->addr[k];
        d->msg[k].msg_hdr.msg_iov = &d->iov[k];
        d->msg[k].msg_hdr.msg_iovlen = 1;
    }
}

/* Set CE in an ECN-capable IPv4 frame (ECT(0) or ECT(1); Ethernet, at most one VLAN tag), the header
 * checksum updated incrementally (RFC 1624: HC' = ~(~HC + ~m + m')); 1 if marked. */
static int mark_ce(uint8_t *f, uint32_t len) {
    uint32_t off = 14;
    uint16_t type = (uint16_t)(f[12] << 8 | f[13]);
    if (type == 0x8100 && len >= 18)
        type = (uint16_t)(f[16] << 8 | f[17]), off = 18;
    if (type != 0x0800 || len < off + 20 || (f[off] >> 4) != 4)
        return 0;
    uint8_t tos = f[off + 1];
    if ((tos & 3) == 0 || (tos & 3) == 3)
        return 0; /* not ECN-capable (a mark would not be read), or marked already */
    uint32_t old = (uint32_t)f[off] << 8 | tos, new = old | 3;
    uint32_t sum = (uint16_t)~((uint32_t)f[off + 10] << 8 | f[off + 11]) + (uint16_t)~old + new;
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    f[off + 1] = (uint8_t)(tos | 3);
    f[off + 10] = (uint8_t)(~sum >> 8), f[off + 11] = (uint8_t)~sum;
    return 1;
}

/* When a frame of len bytes arriving now leaves q, in link mode: after the serializer has sent what waits
 * (marking it above the ECN threshold), then the delay; -1: the queue is full, drop it. */
static int64_t link_due(ina_delay *d, delay_queue *q, uint8_t *f, uint32_t len, int64_t now) {
    int64_t start = q->free_at > now ? q->free_at : now;
    double waiting = (double)(start - now) / d->ns_per_byte; /* bytes ahead of this frame */
    if (d->limit_bytes && waiting + len > d->limit_bytes)
        return -1;
    if (d->ecn_bytes && waiting > d->ecn_bytes)
        d->c.marked += (uint64_t)mark_ce(f, len);
    q->free_at = start + (int64_t)(len * d->ns_per_byte);
    d->c.queue_ns += (uint64_t)(start - now);
    return q->free_at + d->delay_ns;
}

/* Take in r frames just read: each kept one becomes the next waiting frame of q, due at now + delay (moved
 * down a slot only when one before it in the batch was not kept, or it was read into scratch); in link mode
 * due when the serializer has sent it, plus the delay. */
static void keep_batch(ina_delay *d, delay_queue *q, int r, uint32_t room, int64_t now) {
    uint32_t kept = 0;
    for (int k = 0; k < r; k++) {
        if (d->addr[k].sll_pkttype == PACKET_OUTGOING)
            continue; /* what this host sent out of the interface: not ours to forward */
        d->c.received++;
        if (d->msg[k].msg_hdr.msg_flags & MSG_TRUNC) {
            d->c.oversized++;
            continue;
        }
        if (kept >= room) {
            d->c.dropped++;
            continue;
        }
        uint8_t *dst = slot(q, q->count + kept);
        if (d->iov[k].iov_base != dst)
            memcpy(dst, d->iov[k].iov_base, d->msg[k].msg_len);
        int64_t due = d->ns_per_byte ? link_due(d, q, dst, d->msg[k].msg_len, now) : now + d->delay_ns;
        if (due < 0) {
            d->c.dropped++;
            continue;
        }
        uint32_t i = slot_index(q, q->count + kept);
        q->len[i] = d->msg[k].msg_len;
        q->due[i] = due;
        kept++;
    }
    q->count += kept;
    if (q->count > q->max)
        q->max = q->count;
}

/* Read what waits on fds[i] (a bounded number of batches). One arrival time per batch, taken as it is read:
 * the wait wakes on the first frame, so a batch is frames that came within the last few microseconds unless
 * the machine is loaded (then the frame waits its delay from when the stage could see it). */
static void receive(ina_delay *d, int i) {
    delay_queue *q = &d->q[i];
    for (int round = 0; round < DELAY_RECV_ROUNDS; round++) {
        uint32_t room = queue_room(d, q);
        recv_batch(d, q, room);
        int r = recvmmsg(d->fds[i], d->msg, INA_DELAY_BATCH, MSG_DONTWAIT, NULL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return; /* EAGAIN: drained; or an error (the interface went down), which the read has cleared */
        }
        keep_batch(d, q, r, room, clock_ns());
        if (r < INA_DELAY_BATCH)
            return;
    }
}

/* Send q's due frames out of its partner socket, straight from their slots; on EAGAIN the frame stays at
 * the head and the direction waits for POLLOUT. Other errors lose the frame (counted), as a wire would. */
static void send_due(ina_delay *d, int i, int64_t now) {
    delay_queue *q = &d->q[i];
    while (q->count) {
        uint32_t n = 0;
        for (; n < INA_DELAY_BATCH && n < q->count && q->due[slot_index(q, n)] <= now; n++) {
            d->iov[n].iov_base = slot(q, n);
            d->iov[n].iov_len = q->len[slot_index(q, n)];
            memset(&d->msg[n].msg_hdr, 0, sizeof d->msg[n].msg_hdr);
            d->msg[n].msg_hdr.msg_iov = &d->iov[n];
            d->msg[n].msg_hdr.msg_iovlen = 1;
        }
        if (!n)
            return;
        int r = sendmmsg(d->fds[i ^ 1], d->msg, n, MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                q->blocked = 1;
                d->c.send_blocked++;
                return;
            }
            d->c.send_errors++;
            r = 1; /* the frame at the head is the one refused; sendmmsg reports an error only when it sent none */
        } else {
            d->c.forwarded += (uint64_t)r;
        }
        q->head = slot_index(q, (uint32_t)r);
        q->count -= (uint32_t)r;
    }
}

ina_delay *ina_delay_new(const int *fds, int nfds, double delay_s, uint32_t limit) {
    if (!fds || nfds <= 0 || nfds % 2 || !(delay_s >= 0) || delay_s > 3600) {
        errno = EINVAL;
        return NULL;
    }
    ina_delay *d = calloc(1, sizeof *d);
    if (!d || !(d->fds = malloc(nfds * sizeof *d->fds)) || !(d->pfd = calloc(nfds, sizeof *d->pfd))
        || !(d->q = calloc(nfds, sizeof *d->q))) {
        ina_delay_free(d);
        errno = ENOMEM;
        return NULL;
    }
    d->nfds = nfds, d->delay_ns = (int64_t)(delay_s * 1e9), d->limit = limit;
    memcpy(d->fds, fds, nfds * sizeof *fds);
    int one = 1;
    for (int i = 0; i < nfds; i++) {
        /* the kernel never loops a socket's own sends back to it; this keeps out what other sockets of the
         * host send on the interface too, before it is queued (keep_batch still checks, for older kernels) */
        setsockopt(fds[i], SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one);
        uint32_t first = limit < DELAY_FIRST_SLOTS ? limit : DELAY_FIRST_SLOTS;
        if (first && queue_resize(&d->q[i], first) < 0) {
            ina_delay_free(d);
            errno = ENOMEM;
            return NULL;
        }
    }
    return d;
}

void ina_delay_link(ina_delay *d, double rate_bps, uint32_t ecn_bytes, uint32_t limit_bytes) {
    d->ns_per_byte = rate_bps > 0 ? 8e9 / rate_bps : 0;
    d->ecn_bytes = ecn_bytes, d->limit_bytes = limit_bytes;
}

void ina_delay_free(ina_delay *d) {
    if (!d)
        return;
    for (int i = 0; d->q && i < d->nfds; i++)
        queue_free(&d->q[i]);
    free(d->q), free(d->pfd), free(d->fds), free(d);
}

/* Send what is due in every direction; returns when the next frame of a direction not blocked is due
 * (`until` if none is sooner). */
static int64_t send_all(ina_delay *d, int64_t now, int64_t until) {
    for (int i = 0; i < d->nfds; i++) {
        delay_queue *q = &d->q[i];
        if (!q->blocked)
            send_due(d, i, now);
        if (!q->blocked && q->count && q->due[q->head] < until)
            until = q->due[q->head];
    }
    return until;
}

int ina_delay_run(ina_delay *d, int budget_ms) {
    /* per thread: a wait ends within microseconds of its due time, not up to the default 50 us later */
    prctl(PR_SET_TIMERSLACK, 1UL);
    const int64_t end = clock_ns() + (int64_t)budget_ms * 1000000;
    for (;;) {
        int64_t next = send_all(d, clock_ns(), end), now = clock_ns();
        if (now >= end)
            return 0;
        for (int i = 0; i < d->nfds; i++)
            d->pfd[i] = (struct pollfd){.fd = d->fds[i], .events = POLLIN | (d->q[i ^ 1].blocked ? POLLOUT : 0)};
        int64_t wait = next > now ? next - now : 0;
        struct timespec ts = {.tv_sec = wait / 1000000000, .tv_nsec = wait % 1000000000};
        if (ppoll(d->pfd, d->nfds, &ts, NULL) < 0)
            return errno == EINTR ? 0 : -1; /* a signal: the caller looks at it before the next call */
        for (int i = 0; i < d->nfds; i++) {
            if (d->pfd[i].revents & POLLOUT)
                d->q[i ^ 1].blocked = 0;
            if (d->pfd[i].revents & (POLLIN | POLLERR))
                receive(d, i);
        }
    }
}

const ina_delay_counters *ina_delay_counters_of(const ina_delay *d) { return &d->c; }

uint32_t ina_delay_queued(const ina_delay *d, int i) { return i >= 0 && i < d->nfds ? d->q[i].count : 0; }

uint32_t ina_delay_queue_max(const ina_delay *d, int i) { return i >= 0 && i < d->nfds ? d->q[i].max : 0; }
