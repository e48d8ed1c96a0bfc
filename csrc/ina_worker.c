/* hostlib/worker.py's _allreduce_flat in C, branch for branch (tests/test_fastpath.py checks that both
 * give the same bytes). Packet q of the call goes on lane q mod W (slot (first_slot + lane) mod W, packet id
 * slot_uses[slot] + q div W: worker.CallSlots); it carries block q - D and this worker's exponent of block q;
 * q is sent once q - W and q - D are done, each lane on its own (a completion frees q + W and q + D, so a
 * lane waiting for a loss holds back only itself); results are matched by packet id; a packet with no result by
 * its deadline is resent from the copy kept in its window entry (the Python loop rebuilds the same bytes
 * from the counter-based RNG). New packets go out in sendmmsg batches, results come in recvmmsg batches;
 * runs of same-size packets in a batch go as UDP GSO sends and results are received with UDP_GRO where the
 * kernel has them (ina_gso.h), which leaves the datagrams on the wire as they were.
 * Protocol v3: every packet carries the call's identity (call_kind, call, call_len) and the join_ack's boot;
 * a result of another call is stale; an error of this generation ends the call with the datagram for the
 * caller (INA_WK_SWITCH_ERROR) as worker.py's _results says (on_error), but for ERR_DROPPED, which is only
 * counted (on_dropped); one of another session is stale; a switch port that keeps refusing (UDP) or a
 * shared-memory switch that is gone ends it as INA_WK_REFUSED instead of waiting for the timeout.
 * The congestion window (ina_cc.h, hostlib/cc.py's twin) limits the bytes in flight of a dense call (send_ready),
 * a result's FLAG_CONGESTED and a CE mark on it step it (answered, ce_marked), and a gap resends at once (gap). */
#define _GNU_SOURCE
#include "ina_worker.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ina_gso.h"
#include "ina_wait.h"
#include "ina_kernels_ops.h" /* ina_scalar_int32_unwire: a result's sums in native order */
#include "ina_kernels.h"
#include "ina_packet.h"
#include "ina_shm.h"

#define SCAN_EVERY 0.002 /* seconds between retransmission scans, as in the Python loop */
#define GONE_EVERY 0.1   /* seconds between checks that a shared-memory switch is still there */
#define RTT_BATCH 16     /* RTT samples per estimator update (their minimum), as in the Python loop */
#define INT32_MAX_ 2147483647
#define START_RTO (INA_START_RTO_MS * 1e-3) /* inaproto/timers.py's START_RTO */
#define INA_TOS_CMSG_SPACE CMSG_SPACE(sizeof(int)) /* IP_TOS of a received datagram (IP_RECVTOS, channel.py) */

typedef struct {
    uint32_t q, tries, len;
    int busy, fast; /* fast: resent early, at a gap or a tail probe (once; then the timer: resend_early) */
    uint64_t seq;   /* its send number (ina_cc.sent) */
    uint32_t k;     /* dense: its place in the call's send order (priv_t.order) */
    double first_sent, last_sent, deadline, rto;
} entry;

typedef struct {
    entry *win;      /* window entries, indexed by q mod W */
    uint8_t *pkts;   /* the packet of each entry, pkt_max bytes apart */
    size_t pkt_max, esize;
    uint32_t next_q;    /* sparse: 1 once the announcements went out */
    uint32_t *cand;     /* dense: packets a completion may have made sendable, those the window holds back first */
    uint32_t n_cand;
    uint8_t *sent;      /* dense: per packet */
    uint32_t una;       /* dense: the first packet not done */
    uint32_t *order;    /* dense: the packets in the order they were first sent (a lane held back by a loss sends
                         * its next packet late: packet numbers are not the send order) */
    uint32_t n_sent, hi_sent; /* dense: packets sent; the last send whose result came (+1) */
    uint32_t gap_scan;  /* dense: the sends below it were looked at for a gap */
    uint64_t inflight;  /* dense: bytes of the packets sent and not done: the congestion window counts packets
                         * of pkt_max bytes, so the exponent-only packets of a call's start count for little */
    double first_result; /* when the call's first result came (0: none yet): the peers are in the call */
    double rx_time;      /* when the receive being handled returned: its results' arrival, one clock read a batch */
    double next_scan;
    double rtt_min;     /* the smallest RTT sample of the current batch */
    uint32_t rtt_n;
    int32_t *sums;      /* fixed with out: one result's sums, native */
    uint8_t *rbuf;
    size_t rlen;        /* receive buffer per message: one result, or a coalesced run with UDP_GRO */
    int gro_on;         /* this call turned UDP_GRO on (and turns it off in ina_wk_finish) */
    int yields;         /* ina_wait_yield: this wait's yields so far */
    double refused_since; /* the first ECONNREFUSED since the last datagram received; 0: none */
    double next_gone;   /* shm: when to check next whether the switch is gone */
    struct mmsghdr rmsg[INA_WK_BATCH];
    struct iovec riov[INA_WK_BATCH], siov[INA_WK_BATCH], jiov[INA_WK_BATCH]; /* jiov: siov's GSO runs joined */
    char rctrl[INA_WK_BATCH][INA_GRO_CMSG_SPACE + INA_TOS_CMSG_SPACE];
    int n_send;
    /* the send batch as messages: one per GSO run or single packet, its first packet and packet count */
    struct mmsghdr gmsg[INA_WK_BATCH];
    char gctrl[INA_WK_BATCH][INA_GSO_CMSG_SPACE];
    uint32_t slen[INA_WK_BATCH];
    int gfirst[INA_WK_BATCH], gcount[INA_WK_BATCH];
    /* sparse: per stream */
    uint32_t *pos;      /* this worker's next non-zero block not yet sent (NONE: none left) */
    uint32_t *target;   /* the block the current round is about (ANNOUNCE: round 0; NONE: padding) */
    uint32_t *round;
    int8_t *exp_target; /* the agreed exponent of target */
} priv_t;

#define ANNOUNCE (INA_BLOCK_NONE - 1)

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}


static uint32_t held_from(const ina_wk *w, uint64_t from);

/* the receive buffers; with UDP_GRO each must hold a coalesced run (up to 64 KiB), else one result (or one
 * error, up to INA_WK_ERROR_MAX bytes: whichever is larger) and a byte more, so an oversized datagram shows
 * as a length mismatch. The socket is the caller's and its
 * Python loop reads one datagram per recv, so GRO is on only while this call runs. */
static int rx_init(ina_wk *w, priv_t *p)
{
    if (w->shm) {
        w->gso = w->gro = 0; /* rings carry datagrams as they are */
        w->group_fd = -1;
    }
    /* a call of a few packets has nothing to coalesce: it skips the four setsockopt calls (a 1 KiB call's
     * microseconds) */
    int want = w->gro && (w->sparse || (w->n + w->k - 1) / w->k >= INA_WK_GRO_MIN);
    p->gro_on = want && ina_gro_set(w->fd, 1) == 0 && (w->group_fd <= 0 || ina_gro_set(w->group_fd, 1) == 0);
    if (want && !p->gro_on) {
        w->gro = 0;
        ina_gro_set(w->fd, 0);
    }
    p->rlen = p->gro_on ? INA_GRO_BUF : (p->pkt_max > INA_WK_ERROR_MAX ? p->pkt_max : INA_WK_ERROR_MAX) + 1;
    p->rbuf = malloc((size_t)INA_WK_BATCH * p->rlen);
    if (!p->rbuf)
        return -1;
    for (int i = 0; i < INA_WK_BATCH; i++) {
        p->riov[i].iov_base = p->rbuf + (size_t)i * p->rlen;
        p->riov[i].iov_len = p->rlen;
    }
    return 0;
}

int ina_wk_start(ina_wk *w)
{
    if (!w->window || !w->k || w->k > INA_MAX_ELEMENTS || !w->world || w->world > INA_MAX_WORKERS ||
        w->kind < INA_WK_INT32 || w->kind > INA_WK_NC || (w->kind != INA_WK_INT32 && !w->exps))
        return INA_WK_BAD_PARAMETERS;
    priv_t *p = calloc(1, sizeof *p);
    if (!p)
        return INA_WK_NO_MEMORY;
    p->esize = w->kind == INA_WK_NC ? 1 : 4;
    p->pkt_max = INA_HEADER_SIZE + (w->sparse ? INA_BLOCK_EXT_SIZE : 0) + (size_t)w->k * p->esize;
    p->win = calloc(w->window, sizeof *p->win);
    p->pkts = malloc((size_t)w->window * p->pkt_max);
    p->sums = malloc((size_t)w->k * sizeof *p->sums);
    if (!p->win || !p->pkts || !p->sums || rx_init(w, p)) {
        w->priv = p;
        ina_wk_finish(w);
        return INA_WK_NO_MEMORY;
    }
    uint64_t nb = (w->n + w->k - 1) / w->k;
    if (nb >= ANNOUNCE || (w->sparse && !w->held) || (w->keep && (!w->out || w->sparse || w->keep_from > w->n))) {
        w->priv = p;
        ina_wk_finish(w);
        return INA_WK_BAD_PARAMETERS;
    }
    if (w->first_slot >= w->window || !w->slot_uses || !w->stream_rounds) {
        w->priv = p;
        ina_wk_finish(w);
        return INA_WK_BAD_PARAMETERS;
    }
    w->nb = (uint32_t)nb;
    w->D = w->kind == INA_WK_INT32 || w->sparse ? 0 : (w->window < w->nb ? w->window : w->nb);
    w->total = w->nb + w->D;
    w->ndone = 0;
    w->error_len = 0;
    w->dropped_len = 0;
    w->priv = p;
    if (!w->sparse) {
        /* a packet is a candidate once at the start (the first window) and at most twice after (its lane's
         * previous packet and its block's exponent done): the list never holds more, waiting or not */
        p->cand = malloc((2 * (size_t)w->total + w->window + 1) * sizeof *p->cand);
        p->sent = calloc(w->total, 1);
        p->order = malloc(w->total * sizeof *p->order);
        if (!p->cand || !p->sent || !p->order) {
            ina_wk_finish(w);
            return INA_WK_NO_MEMORY;
        }
        for (uint32_t q = 0; q < w->window && q < w->total; q++)
            p->cand[p->n_cand++] = q;
    }
    if (w->sparse) {
        uint32_t S = w->streams = w->window < w->nb ? w->window : w->nb;
        w->streams_done = 0;
        p->pos = malloc(S * sizeof *p->pos);
        p->target = malloc(S * sizeof *p->target);
        p->round = calloc(S, sizeof *p->round);
        p->exp_target = malloc(S);
        if (!p->pos || !p->target || !p->round || !p->exp_target) {
            ina_wk_finish(w);
            return INA_WK_NO_MEMORY;
        }
        for (uint32_t s = 0; s < S; s++) {
            p->target[s] = ANNOUNCE;
            p->exp_target[s] = INA_EXP_NONE;
            p->pos[s] = held_from(w, s);
        }
    }
    return 0;
}

/* this worker's first non-zero block of the stream of `from`, at or after it (sparse) */
static uint32_t held_from(const ina_wk *w, uint64_t from)
{
    while (from < w->nb && !w->held[from])
        from += w->streams;
    return from < w->nb ? (uint32_t)from : INA_BLOCK_NONE;
}

void ina_wk_finish(ina_wk *w)
{
    priv_t *p = w->priv;
    if (!p)
        return;
    if (p->gro_on) { /* results still queued stay coalesced; they are late duplicates */
        ina_gro_set(w->fd, 0);
        if (w->group_fd > 0)
            ina_gro_set(w->group_fd, 0);
    }
    free(p->win);
    free(p->pkts);
    free(p->sums);
    free(p->rbuf);
    free(p->pos);
    free(p->target);
    free(p->round);
    free(p->exp_target);
    free(p->cand);
    free(p->order);
    free(p->sent);
    free(p);
    w->priv = NULL;
}

/* the next block's elements into the caches while this one encodes, where the kernels are AVX2 or scalar:
 * between two packets the loop sends and receives, and the hardware prefetcher loses the tensor's stream. Their
 * encode is compute-bound, so the prefetches land under its arithmetic (64 MiB NC calls on a Xeon's AVX2 paths:
 * 5-7 % faster, and 3.5 % more since NC's go a quarter block at a time); AVX-512's runs at memory speed, and they
 * only competed with its loads (2-4 % slower). docs/performance.md, "Both SIMD paths on an Intel Xeon". */
static void prefetch(const ina_wk *w, uint64_t lo, uint32_t count)
{
    const char *next = (const char *)w->src + 4 * lo, *end = (const char *)w->src + 4 * w->n;
    for (const char *c = next; c < next + 4 * (size_t)count && c < end; c += 64)
        __builtin_prefetch(c);
}

static void prefetch_next(const ina_wk *w, uint64_t lo, uint32_t count)
{
    if (ina_simd_get() != INA_SIMD_AVX512)
        prefetch(w, lo + count, count);
}

/* NC encode in quarters of 1 KiB of elements, each after the prefetch of the next block's same quarter: 16
 * lines, fewer than a core's fill buffers, so the prefetches do not stall the loop as a whole block's 64 did */
#define NC_PREFETCH_CHUNK 256u

static int nc_encode_prefetching(ina_wk *w, const float *s, uint64_t lo, uint32_t count, uint8_t *pl, int floor)
{
    for (uint32_t at = 0; at < count; at += NC_PREFETCH_CHUNK) {
        uint32_t m = count - at < NC_PREFETCH_CHUNK ? count - at : NC_PREFETCH_CHUNK;
        prefetch(w, lo + count + at, m);
        int rc = ina_nc_encode(s + at, m, pl + at, w->seed, lo + at, w->deterministic, floor);
        if (rc)
            return rc;
    }
    return 0;
}

/* count elements from lo, encoded with the agreed exponent exp_cur, into pl; 0, or -1 if a kernel failed */
static int encode_elements(ina_wk *w, priv_t *p, uint64_t lo, uint32_t count, int8_t exp_cur, uint8_t *pl)
{
    if (w->kind != INA_WK_NC)
        prefetch_next(w, lo, count); /* int32 and float32: 4 bytes an element */
    if (w->kind == INA_WK_INT32) {
        const int32_t *s = (const int32_t *)w->src + lo;
        for (uint32_t i = 0; i < count; i++) { /* bswap + memcpy: the compiler vectorises it, wr32 it does not */
            uint32_t be = __builtin_bswap32((uint32_t)s[i]);
            memcpy(pl + 4 * (size_t)i, &be, 4);
        }
        return 0;
    }
    const float *s = (const float *)w->src + lo;
    if (exp_cur == INA_EXP_NONFINITE) {
        memset(pl, 0, count * p->esize); /* every worker raises at the end */
    } else if (w->kind == INA_WK_FIXED) {
        ina_fixed_quantize(s, count, ina_fixed_scale(exp_cur, w->world), INT32_MAX_ / w->world, pl);
    } else {
        int floor = exp_cur == INA_EXP_NONE ? INA_NC_LEVEL_MIN : nc_floor(exp_cur);
        int rc = ina_simd_get() == INA_SIMD_AVX512 ? ina_nc_encode(s, count, pl, w->seed, lo, w->deterministic, floor)
                                                   : nc_encode_prefetching(w, s, lo, count, pl, floor);
        if (rc) {
            w->sys_errno = rc;
            return -1;
        }
    }
    return 0;
}

static uint32_t block_count(const ina_wk *w, uint64_t block)
{
    uint64_t lo = block * w->k;
    return (uint32_t)(w->n - lo < w->k ? w->n - lo : w->k);
}

static uint8_t wire_codec(const ina_wk *w) { return w->kind == INA_WK_NC ? INA_CODEC_NC8 : INA_CODEC_INT32; }

/* CallSlots.slot / pid: lane j's slot, and its packet id at index i */
static inline uint32_t lane_slot(const ina_wk *w, uint32_t j) { return (w->first_slot + j) % w->window; }
static inline uint32_t lane_pid(const ina_wk *w, uint32_t j, uint32_t i) { return w->slot_uses[lane_slot(w, j)] + i; }

/* CallSlots.locate: a result's lane (window for a slot not ours) and index */
static inline void locate(const ina_wk *w, const header *h, uint32_t *j, uint32_t *i)
{
    if (h->slot >= w->window) {
        *j = w->window;
        *i = 0;
        return;
    }
    *j = (h->slot + w->window - w->first_slot) % w->window;
    *i = h->packet_id - w->slot_uses[h->slot];
}

/* the update packet for q into buf (worker.py build()); its length, or -1 if a kernel failed */
static long build(ina_wk *w, priv_t *p, uint32_t q, uint8_t *buf)
{
    uint32_t pid = lane_pid(w, q % w->window, q / w->window);
    int8_t exp_next = w->exps && q < w->nb ? w->exps[q] : INA_EXP_NONE;
    int8_t exp_cur = 0;
    uint32_t count = 0;
    if (q >= w->D) {
        count = block_count(w, q - w->D);
        if (w->kind != INA_WK_INT32)
            exp_cur = w->agreed[q - w->D];
        if (encode_elements(w, p, (uint64_t)(q - w->D) * w->k, count, exp_cur, buf + INA_HEADER_SIZE))
            return -1;
    }
    put_header(buf, INA_MSG_UPDATE, w->job, w->rank, pid, (uint16_t)lane_slot(w, q % w->window), (uint8_t)(pid & 1),
               (uint16_t)count, wire_codec(w), exp_cur, exp_next, (uint8_t)ina_cc_echo(&w->cc), w->session);
    put_call(buf, w->call_kind, w->call, w->call_len);
    put_boot(buf, w->boot);
    return INA_HEADER_SIZE + (long)count * (long)p->esize;
}

/* the sparse_update of stream s's current round into buf (worker.py _allreduce_sparse build()) */
static long build_sparse(ina_wk *w, priv_t *p, uint32_t s, uint8_t *buf)
{
    uint32_t pid = lane_pid(w, s, p->round[s]);
    uint32_t t = p->target[s], block = INA_BLOCK_NONE, count = 0, next;
    int8_t exp_cur = w->exps ? p->exp_target[s] : 0;
    if (t == INA_BLOCK_NONE) {
        next = INA_BLOCK_NONE;
    } else if (t != ANNOUNCE && p->pos[s] == t) {
        block = t;
        count = block_count(w, t);
        if (encode_elements(w, p, (uint64_t)t * w->k, count, exp_cur, buf + INA_HEADER_SIZE + INA_BLOCK_EXT_SIZE))
            return -1;
        next = held_from(w, (uint64_t)t + w->streams);
    } else {
        next = p->pos[s];
    }
    int8_t exp_next = w->exps && next != INA_BLOCK_NONE ? w->exps[next] : INA_EXP_NONE;
    put_header(buf, INA_MSG_SPARSE_UPDATE, w->job, w->rank, pid, (uint16_t)lane_slot(w, s), (uint8_t)(pid & 1),
               (uint16_t)count, wire_codec(w), exp_cur, exp_next, 0, w->session);
    put_call(buf, w->call_kind, w->call, w->call_len);
    put_boot(buf, w->boot);
    wr32(buf + INA_HEADER_SIZE, block);
    wr32(buf + INA_HEADER_SIZE + 4, next);
    return INA_HEADER_SIZE + INA_BLOCK_EXT_SIZE + (long)count * (long)p->esize;
}

/* the queued packets from `from` on as messages: a run of same-size packets becomes one GSO message */
static int pack(ina_wk *w, priv_t *p, int from)
{
    int m = 0;
    for (int i = from; i < p->n_send; m++) {
        int k = w->gso ? ina_gso_run(p->slen + i, p->n_send - i) : 1;
        struct msghdr *h = &p->gmsg[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_iov = &p->siov[i];
        h->msg_iovlen = (size_t)k;
        if (k > 1) {
            h->msg_iov = &p->jiov[i];
            h->msg_iovlen = ina_iov_join(&p->siov[i], (size_t)k, &p->jiov[i]);
            ina_gso_cmsg(h, p->gctrl[m], (uint16_t)p->slen[i]);
        }
        p->gfirst[m] = i;
        p->gcount[m] = k;
        i += k;
    }
    return m;
}

/* an ECONNREFUSED on the socket (ICMP port unreachable: nothing listens at the switch's address) */
static void refused(priv_t *p)
{
    if (p->refused_since == 0)
        p->refused_since = now();
}

/* send the queued batch; like the Python loop, a dropped send counts as sent and the timeout recovers it.
 * A refused send (the report of an earlier datagram's ICMP error) is noted (refused) and the batch goes on.
 * A GSO message the kernel refuses turns GSO off and goes again packet by packet. */
static void flush(ina_wk *w, priv_t *p)
{
    if (w->shm) { /* a full ring loses the packet, as a full socket buffer does */
        for (int i = 0; i < p->n_send; i++)
            ina_shm_queue(w->shm, p->siov[i].iov_base, p->slen[i]);
        if (p->n_send)
            ina_shm_flush(w->shm);
        p->n_send = 0;
        return;
    }
    int from = 0;
    while (from < p->n_send) {
        int m = pack(w, p, from), sent = 0;
        while (sent < m) {
            int r = sendmmsg(w->fd, p->gmsg + sent, (unsigned)(m - sent), 0);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0 && errno == ECONNREFUSED) { /* the error is consumed: the next try sends */
                refused(p);
                continue;
            }
            if (r <= 0)
                break;
            for (int i = sent; i < sent + r; i++)
                w->gso_sends += p->gcount[i] > 1;
            sent += r;
        }
        if (sent < m && p->gcount[sent] > 1 && ina_gso_refused(errno)) {
            w->gso = 0;
            from = p->gfirst[sent];
            continue;
        }
        break;
    }
    p->n_send = 0;
}

static void queue(ina_wk *w, priv_t *p, entry *e)
{
    uint8_t *pkt = p->pkts + (size_t)(e - p->win) * p->pkt_max;
    p->siov[p->n_send] = (struct iovec){pkt, e->len};
    p->slen[p->n_send] = e->len;
    p->n_send++;
    w->packets_sent++;
    w->bytes_sent += e->len;
    if (p->n_send == INA_WK_BATCH)
        flush(w, p);
}

static int sendable(const ina_wk *w, uint32_t q)
{
    return q < w->total && (q < w->window || w->done[q - w->window]) &&
           (w->D == 0 || q < w->D || w->done[q - w->D]);
}

/* the estimator takes the smallest of every RTT_BATCH samples: a result that waited for a peer's
 * retransmission is not a round trip, and under loss such samples would hold the timeout at max_rto */
/* a result for a resent packet that comes sooner than half a round trip after its last send answers an
 * earlier send: that resend was spurious (the packet or its result was late, not lost; worker.py
 * _answered counts the same) */
static void note_answer(ina_wk *w, const entry *e, double t)
{
    if (e->tries && w->have_srtt && t - e->last_sent < w->srtt / 2) {
        w->spurious_retransmissions++;
        /* the timer was short, or a gap's resend early: either way the floor goes up (under loss a higher floor
         * also spares the timer's resends of packets that wait for a peer's repair) */
        w->min_rto = ina_cc_spurious_floor(&w->cc, w->min_rto, fmin(START_RTO, w->max_rto));
    }
}

static void rtt_sample(ina_wk *w, double r)
{
    priv_t *p = w->priv;
    p->rtt_min = p->rtt_n++ ? fmin(p->rtt_min, r) : r;
    if (p->rtt_n < RTT_BATCH)
        return;
    r = p->rtt_min;
    p->rtt_n = 0;
    if (!w->have_srtt) {
        w->srtt = r;
        w->rttvar = r / 2;
        w->have_srtt = 1;
    } else {
        w->rttvar = 0.75 * w->rttvar + 0.25 * fabs(w->srtt - r);
        w->srtt = 0.875 * w->srtt + 0.125 * r;
    }
    double rto = w->srtt + 4 * w->rttvar;
    w->rto = fmin(fmax(rto, ina_cc_rto_floor(&w->cc, w->srtt, w->min_rto)), w->max_rto);
}

/* a dense packet's result: a round-trip sample, a spurious resend noted, the congestion window's step (a
 * round trip of the path only for a packet sent once, after the call's first result: ina_cc.h) */
static void answered(ina_wk *w, priv_t *p, entry *e, int congested)
{
    double t = p->rx_time;
    e->busy = 0;
    p->inflight -= e->len;
    if (p->first_result == 0)
        p->first_result = t;
    note_answer(w, e, t);
    if (e->tries && w->have_srtt) { /* a repair: its round trips, before this sample moves the estimate */
        double bin = 2 * (t - e->first_sent) / w->srtt;
        w->repairs[bin < INA_WK_REPAIR_BINS - 1 ? (int)bin : INA_WK_REPAIR_BINS - 1]++;
    }
    rtt_sample(w, t - e->first_sent); /* from the first send: RttEstimator says why */
    int path = e->tries == 0 && e->first_sent >= p->first_result;
    ina_cc_result(&w->cc, e->seq, path ? t - e->first_sent : -1, congested, w->window);
}

/* an early resend (a gap, a tail probe), once a send: should it be lost too, its timer fires INA_EARLY_RTO_RTTS
 * smoothed round trips later, not after the timeout's floor, which spurious resends (packets that waited for a
 * peer's repair) may have raised to START_RTO; a later timer backs off from the floor as before */
static void resend_early(ina_wk *w, priv_t *p, entry *e, double t)
{
    e->fast = 1;
    e->tries++;
    e->last_sent = t;
    e->deadline = t + (w->have_srtt ? fmin(e->rto, INA_EARLY_RTO_RTTS * w->srtt) : e->rto);
    w->retransmissions++;
    w->fast_retransmits++;
    queue(w, p, e);
}

/* a gap: results of packets sent INA_WK_DUPTHRESH later than one still out came back, so it (or its result) was
 * lost: resend it at once, once (TCP's fast retransmit, ATP's gap-triggered resend); each send is looked at
 * once, when the results pass it, in send order (RACK's): a packet sent late, its lane held back by a loss,
 * is not taken for lost. Not under INA_CC_NONE (SwitchML's timeout alone) nor block-sparse (one round per
 * stream). */
static void gap(ina_wk *w, priv_t *p, double t)
{
    if (w->cc.policy == INA_CC_NONE || w->sparse)
        return;
    uint32_t k = p->gap_scan;
    for (; k + INA_WK_DUPTHRESH < p->hi_sent; k++) {
        uint32_t q = p->order[k];
        entry *e = &p->win[q % w->window];
        if (w->done[q] || !e->busy || e->q != q || e->fast)
            continue;
        resend_early(w, p, e, t);
    }
    p->gap_scan = k;
}

#define NT_MIN_ELEMENTS (2u << 20) /* 8 MiB of float32: more than a core's share of the caches */

/* a result's elements of block b (from element lo) into the result buffer (native int32 sums, or NC codes),
 * or decoded into out where the caller gave one (int32 sums; float32 for fixed and nc), so no pass over the
 * whole tensor follows the last result; 0, or -1 for an NC code no encoder emits (a corrupt payload) */
static int store_elements(ina_wk *w, priv_t *p, uint64_t b, uint64_t lo, const uint8_t *pl, uint32_t count)
{
    if (w->out && w->kind == INA_WK_NC) /* a large output passes the caches by (docs/performance.md) */
        return (w->n >= NT_MIN_ELEMENTS ? ina_nc_decode_stream : ina_nc_decode)(pl, count, (float *)w->out + lo) ? -1 : 0;
    if (w->out && w->kind == INA_WK_FIXED) {
        ina_scalar_int32_unwire(pl, count, p->sums);
        ina_fixed_dequantize(p->sums, count, count, w->agreed + b, w->world, (float *)w->out + lo);
        return 0;
    }
    if (w->kind == INA_WK_NC) {
        memcpy((uint8_t *)w->result + lo, pl, count);
        return 0;
    }
    int32_t *to = (int32_t *)(w->out ? w->out : w->result) + lo;
    if (w->n >= NT_MIN_ELEMENTS) /* as NC's decode: the output is not read for ownership */
        ina_int32_unwire_stream(pl, count, to);
    else
        ina_scalar_int32_unwire(pl, count, to);
    return 0;
}

/* n bytes from src to dst by streaming stores where SSE2 has them (dst's lines are not read for ownership nor
 * kept in the caches: a copy that only a recovery reads); the loop's closing fence orders them */
static void copy_stream(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    head = head < n ? head : n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 16; n -= 16, dst += 16, src += 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
#endif
    memcpy(dst, src, n);
}

/* the elements lo..lo+count of out from keep_from on, copied into keep as well (w->keep: a dense call's) */
static void keep_elements(ina_wk *w, uint64_t lo, uint32_t count)
{
    uint64_t from = lo > w->keep_from ? lo : w->keep_from, end = lo + count;
    if (end > from)
        copy_stream((uint8_t *)w->keep + (from - w->keep_from) * 4, (const uint8_t *)w->out + from * 4,
                    (end - from) * 4);
}

/* a packet's first timeout: not less than START_RTO, SwitchML's constant, before the call's first result (the
 * peers may not have started the call: a rank's compute runs late) and in slow start (no estimate has seen
 * the queue a doubling window builds): a resend then would be spurious */
static double first_rto(const ina_wk *w, const priv_t *p)
{
    const ina_cc *c = &w->cc;
    int early = !p->first_result || c->cwnd < c->ssthresh;
    return c->policy == INA_CC_NONE || !early ? w->rto : fmax(w->rto, START_RTO);
}

/* build stream s's current round into its window entry and queue it; INA_WK_AGAIN, INA_WK_ENCODE_ERROR, or
 * INA_WK_SWITCH_ERROR with an error pending (the round cannot complete) */
static int start_round(ina_wk *w, priv_t *p, uint32_t s, double t)
{
    if (w->error_len)
        return INA_WK_SWITCH_ERROR;
    entry *e = &p->win[s];
    long len = build_sparse(w, p, s, p->pkts + (size_t)s * p->pkt_max);
    if (len < 0)
        return INA_WK_ENCODE_ERROR;
    *e = (entry){.q = p->round[s] * w->window + s, .len = (uint32_t)len, .busy = 1, .first_sent = t,
                 .last_sent = t, .deadline = t + first_rto(w, p), .rto = first_rto(w, p)};
    queue(w, p, e);
    return INA_WK_AGAIN;
}

/* a parsed sparse_result (worker.py _allreduce_sparse's receive branch) */
static int on_sparse_result(ina_wk *w, priv_t *p, const header *h, const uint8_t *d)
{
    uint32_t s, r;
    locate(w, h, &s, &r);
    if (h->msg_type != INA_MSG_SPARSE_RESULT || s >= w->streams || r > p->round[s]) {
        w->stale_results++;
        return INA_WK_AGAIN;
    }
    entry *e = &p->win[s];
    if (r < p->round[s] || !e->busy) {
        w->duplicate_results++;
        return INA_WK_AGAIN;
    }
    uint32_t t = p->target[s], nx = h->next_block;
    int real = t != ANNOUNCE && t != INA_BLOCK_NONE;
    int next_ok = nx == INA_BLOCK_NONE || (nx % w->streams == s && nx < w->nb && (!real || nx > t));
    if (h->codec != wire_codec(w) || h->block != (real ? t : INA_BLOCK_NONE) ||
        h->count != (real ? block_count(w, t) : 0) || !next_ok) {
        w->stale_results++; /* not what this round can be: never accepted */
        return INA_WK_AGAIN;
    }
    if (h->flags & INA_FLAG_OVERFLOW)
        w->overflow = 1;
    if (real) {
        w->agreed[t] = h->exp_cur; /* before the store: fixed's decode into out scales by it */
        if (store_elements(w, p, t, (uint64_t)t * w->k, d + INA_HEADER_SIZE + INA_BLOCK_EXT_SIZE, h->count))
            return INA_WK_BAD_RESULT;
        w->ndone++;
        if (p->pos[s] == t)
            p->pos[s] = held_from(w, (uint64_t)t + w->streams);
    }
    e->busy = 0;
    double now_ = p->rx_time;
    if (p->first_result == 0)
        p->first_result = now_;
    note_answer(w, e, now_);
    rtt_sample(w, now_ - e->first_sent);
    p->round[s]++;
    p->target[s] = nx;
    p->exp_target[s] = h->exp_next;
    if (nx != INA_BLOCK_NONE || p->round[s] % 2)
        return start_round(w, p, s, now_);
    w->streams_done++;
    w->stream_rounds[s] = p->round[s];
    return INA_WK_AGAIN;
}

/* an error of this generation (worker.py _results): it ends the call at once when the switch no longer has
 * the generation (header only: not a member) or it answers a packet in flight (FLAG_REPLY with that packet's
 * slot and id: its round cannot complete); otherwise (the failure's multicast, or the answer to an older
 * packet) it is pending: the first one is kept in error, every packet in flight goes again at once (a round
 * that completed answers with its result), and the loop stops before it sends any packet for the first time
 * (INA_WK_SWITCH_ERROR); a call that completes returns INA_WK_DONE with error_len > 0 */
static int on_error(ina_wk *w, priv_t *p, const header *h, const uint8_t *d, size_t len)
{
    int stop = len == INA_HEADER_SIZE;
    if (!stop && (h->flags & INA_FLAG_REPLY)) {
        uint32_t j, i;
        locate(w, h, &j, &i);
        const entry *e = &p->win[j < w->window ? j : 0];
        stop = j < w->window && e->busy && e->q == (uint64_t)i * w->window + j;
    }
    if (stop || !w->error_len) {
        w->error_len = (uint32_t)(len < INA_WK_ERROR_MAX ? len : INA_WK_ERROR_MAX);
        memcpy(w->error, d, w->error_len);
    }
    if (stop)
        return INA_WK_SWITCH_ERROR;
    for (uint32_t k = 0; k < w->window; k++)
        if (p->win[k].busy)
            p->win[k].deadline = 0;
    p->next_scan = 0;
    return INA_WK_AGAIN;
}

/* an ERR_DROPPED of this generation (worker.py _dropped_note): the switch dropped a packet of ours for our
 * mistake and says why, once per reason; counted and kept, never an error of the call */
static int on_dropped(ina_wk *w, const uint8_t *d, size_t len)
{
    w->switch_drops++;
    w->dropped_len = (uint32_t)(len < INA_WK_ERROR_MAX ? len : INA_WK_ERROR_MAX);
    memcpy(w->dropped, d, w->dropped_len);
    return INA_WK_AGAIN;
}

/* one received datagram; INA_WK_AGAIN to go on, INA_WK_SWITCH_ERROR, INA_WK_BAD_RESULT (INA_WK_ENCODE_ERROR:
 * sparse) */
static int on_result(ina_wk *w, priv_t *p, const uint8_t *d, size_t len)
{
    header h;
    p->refused_since = 0; /* something listens */
    int ok = parse(d, len, &h) == 0;
    int ours = ok && h.job == w->job && h.session == w->session; /* of this generation: the switch */
    w->switch_heard += (uint64_t)ours;
    if (ok && h.msg_type == INA_MSG_HEARTBEAT) {
        w->heartbeat_answers++; /* not a call's traffic (as heartbeats are not sent packets) */
        return INA_WK_AGAIN;
    }
    w->packets_received++;
    w->bytes_received += len;
    if (!ok)
        return INA_WK_AGAIN;
    if (!ours) {
        w->stale_results++; /* not of this job's generation (an error of another session too) */
        return INA_WK_AGAIN;
    }
    if (h.msg_type == INA_MSG_ERROR && len >= INA_HEADER_SIZE + INA_ERROR_PAYLOAD_SIZE &&
        d[INA_HEADER_SIZE] == INA_ERR_DROPPED)
        return on_dropped(w, d, len);
    if (h.msg_type == INA_MSG_ERROR)
        return on_error(w, p, &h, d, len);
    if (h.call != w->call) {
        w->stale_results++; /* a result of another call */
        return INA_WK_AGAIN;
    }
    if (w->sparse)
        return on_sparse_result(w, p, &h, d);
    uint32_t j, i;
    locate(w, &h, &j, &i);
    uint64_t q64 = (uint64_t)i * w->window + j;
    uint32_t q = (uint32_t)q64;
    if (h.msg_type != INA_MSG_RESULT || j >= w->window || q64 >= w->total) {
        w->stale_results++;
        return INA_WK_AGAIN;
    }
    if (w->done[q]) {
        w->duplicate_results++;
        return INA_WK_AGAIN;
    }
    uint64_t lo = (uint64_t)(q - w->D) * w->k;
    uint32_t expect = q < w->D ? 0 : block_count(w, q - w->D);
    if (h.count != expect || h.codec != wire_codec(w)) {
        w->stale_results++;
        return INA_WK_AGAIN;
    }
    if (h.flags & INA_FLAG_OVERFLOW)
        w->overflow = 1;
    if (w->exps && q < w->nb)
        w->agreed[q] = h.exp_next;
    if (q >= w->D && store_elements(w, p, q - w->D, lo, d + INA_HEADER_SIZE, h.count))
        return INA_WK_BAD_RESULT;
    if (q >= w->D && w->keep && w->out)
        keep_elements(w, lo, h.count);
    w->done[q] = 1;
    w->ndone++;
    p->cand[p->n_cand++] = q + w->window; /* its lane's next packet */
    if (w->D && w->D != w->window)
        p->cand[p->n_cand++] = q + w->D; /* the packet that carries its block */
    entry *e = &p->win[q % w->window];
    if (e->busy && e->q == q) {
        p->hi_sent = e->k + 1 > p->hi_sent ? e->k + 1 : p->hi_sent;
        answered(w, p, e, h.flags & INA_FLAG_CONGESTED);
    }
    while (p->una < w->total && w->done[p->una])
        p->una++;
    return INA_WK_AGAIN;
}

/* a received datagram's IP_TOS cmsg (the socket asks for it: channel.py's IP_RECVTOS) says CE: a queue on the
 * way marked it */
static int ce_marked(struct msghdr *m)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c))
        if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS)
            return (*(const uint8_t *)CMSG_DATA(c) & 3) == INA_CE;
    return 0;
}

/* message i of a receive batch: one datagram, or with UDP_GRO a run of them cut at the cmsg's segment
 * size; the number of datagrams, or -(result code) */
static int on_message(ina_wk *w, priv_t *p, int i)
{
    const uint8_t *d = p->riov[i].iov_base;
    size_t len = p->rmsg[i].msg_len;
    uint32_t seg = p->gro_on ? ina_gro_size(&p->rmsg[i].msg_hdr) : 0;
    if (p->rmsg[i].msg_hdr.msg_flags & MSG_TRUNC)
        len = p->pkt_max + 1, seg = 0; /* oversized: fails the length check */
    if (!w->shm && ce_marked(&p->rmsg[i].msg_hdr)) /* GRO coalesces only datagrams of one TOS */
        ina_cc_marked(&w->cc);
    if (!seg || seg >= len) {
        int rc = on_result(w, p, d, len);
        return rc == INA_WK_AGAIN ? 1 : -rc;
    }
    int n = 0;
    for (size_t off = 0; off < len; off += seg, n++) {
        int rc = on_result(w, p, d + off, len - off < seg ? len - off : seg);
        if (rc != INA_WK_AGAIN)
            return -rc;
    }
    w->gro_segments += (uint64_t)n;
    return n;
}

/* the down ring's results, in place; the number read, or -(result code) */
static int receive_shm(ina_wk *w, priv_t *p)
{
    int got = 0;
    uint32_t len;
    const uint8_t *d;
    p->rx_time = now();
    while ((d = ina_shm_peek(w->shm, &len))) {
        int rc = on_result(w, p, d, len);
        ina_shm_next(w->shm);
        if (rc != INA_WK_AGAIN)
            return -rc;
        got++;
    }
    return got;
}

/* drain socket fd in batches; the number of datagrams read, or -(result code) */
static int receive_from(ina_wk *w, priv_t *p, int fd)
{
    int got = 0;
    for (;;) {
        for (int i = 0; i < INA_WK_BATCH; i++) {
            struct msghdr *h = &p->rmsg[i].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_iov = &p->riov[i];
            h->msg_iovlen = 1;
            h->msg_control = p->rctrl[i], h->msg_controllen = sizeof p->rctrl[i]; /* GRO's size, the TOS */
        }
        int r = recvmmsg(fd, p->rmsg, INA_WK_BATCH, MSG_DONTWAIT, NULL);
        if (r > 0)
            p->rx_time = now();
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return got;
            if (errno == ECONNREFUSED) { /* ICMP port unreachable: the switch is not there (yet) */
                refused(p);
                continue;
            }
            w->sys_errno = errno;
            return -INA_WK_SYSTEM_ERROR;
        }
        for (int i = 0; i < r; i++) {
            int n = on_message(w, p, i);
            if (n < 0)
                return n;
            got += n;
        }
        if (r < INA_WK_BATCH)
            return got;
    }
}

/* what waits: the rings, or the socket and the job's group; the number of datagrams read, or -(result code) */
static int receive(ina_wk *w, priv_t *p)
{
    if (w->shm)
        return receive_shm(w, p);
    int got = receive_from(w, p, w->fd);
    if (got < 0 || w->group_fd <= 0)
        return got;
    int more = receive_from(w, p, w->group_fd);
    return more < 0 ? more : got + more;
}

/* a tail probe (RFC 8985's TLP): once a dense call has sent every packet there is no later send whose result
 * could show a loss as a gap, so a packet not answered INA_TAIL_PROBE_RTTS round trips after its last send is
 * resent once then, not at its timeout (whose floor spurious resends may have raised to START_RTO). Only after
 * the call's first result: before it the peers may not be in the call. Not under INA_CC_NONE. */
static int tail_probe(const ina_wk *w, const priv_t *p, const entry *e, double t)
{
    return !w->sparse && w->cc.policy != INA_CC_NONE && w->have_srtt && p->first_result && !e->fast &&
           p->n_sent == w->total && t - e->last_sent >= INA_TAIL_PROBE_RTTS * w->srtt;
}

/* resend every packet past its deadline (exponential backoff), and a tail's probes; INA_WK_TIMEOUT when one is
 * past timeout */
static int scan(ina_wk *w, priv_t *p, double t)
{
    for (uint32_t i = 0; i < w->window; i++) {
        entry *e = &p->win[i];
        if (e->busy && t < e->deadline && tail_probe(w, p, e, t)) {
            resend_early(w, p, e, t);
            continue;
        }
        if (!e->busy || t < e->deadline)
            continue;
        if (t - e->first_sent > w->timeout) {
            uint32_t lane = e->q % w->window, index = e->q / w->window; /* sparse: q = round * W + stream */
            w->timeout_pid = lane_pid(w, lane, index);
            w->timeout_slot = lane_slot(w, lane);
            w->timeout_tries = e->tries;
            return INA_WK_TIMEOUT;
        }
        queue(w, p, e);
        w->retransmissions++;
        e->rto = fmin(e->rto * 2, w->max_rto);
        e->deadline = t + e->rto;
        e->last_sent = t;
        e->tries++;
    }
    flush(w, p);
    return INA_WK_AGAIN;
}

/* packet q built into its window entry and queued; INA_WK_AGAIN, or INA_WK_SWITCH_ERROR with an error pending
 * (this round cannot complete), INA_WK_ENCODE_ERROR */
static int send_new(ina_wk *w, priv_t *p, uint32_t q, double t)
{
    if (w->error_len)
        return INA_WK_SWITCH_ERROR;
    entry *e = &p->win[q % w->window];
    long len = build(w, p, q, p->pkts + (size_t)(e - p->win) * p->pkt_max);
    if (len < 0)
        return INA_WK_ENCODE_ERROR;
    *e = (entry){.q = q, .len = (uint32_t)len, .busy = 1, .seq = w->cc.sent++, .k = p->n_sent, .first_sent = t,
                 .last_sent = t, .deadline = t + first_rto(w, p), .rto = first_rto(w, p)};
    queue(w, p, e);
    p->sent[q] = 1;
    p->order[p->n_sent++] = q;
    p->inflight += e->len;
    return INA_WK_AGAIN;
}

static int window_full(const ina_wk *w, const priv_t *p)
{
    return p->inflight >= (uint64_t)ina_cc_allowed(&w->cc, w->window) * p->pkt_max;
}

/* the candidates that may go, as many as the congestion window allows; those past it wait in the list, in
 * order. The first packet not done goes whatever the window: ranks whose windows differ never wait on each
 * other's packets (each sends it, so it completes, and the next one is first) */
static int send_ready(ina_wk *w, priv_t *p, double t)
{
    uint32_t c = 0, u = p->una;
    if (u < w->total && !p->sent[u] && sendable(w, u) && window_full(w, p)) {
        int rc = send_new(w, p, u, t);
        if (rc != INA_WK_AGAIN)
            return rc;
    }
    for (; c < p->n_cand; c++) {
        uint32_t q = p->cand[c];
        if (q >= w->total || p->sent[q] || !sendable(w, q))
            continue;
        if (window_full(w, p))
            break;
        int rc = send_new(w, p, q, t);
        if (rc != INA_WK_AGAIN)
            return rc;
    }
    memmove(p->cand, p->cand + c, (p->n_cand - c) * sizeof *p->cand);
    p->n_cand -= c;
    return INA_WK_AGAIN;
}

static int finished(const ina_wk *w)
{
    return w->sparse ? w->streams_done == w->streams : w->ndone == w->total;
}

static int run(ina_wk *w, int budget_ms);

/* the loop, then one fence for the results it wrote with streaming stores (store_elements) */
int ina_wk_run(ina_wk *w, int budget_ms)
{
    int rc = run(w, budget_ms);
    ina_store_fence();
    return rc;
}

static int run(ina_wk *w, int budget_ms)
{
    priv_t *p = w->priv;
    double end = now() + budget_ms * 1e-3;
    if (w->sparse && p->next_q == 0) { /* round 0 of every stream: the announcements */
        p->next_q = 1;
        for (uint32_t s = 0; s < w->streams; s++) {
            int rc = start_round(w, p, s, now());
            if (rc != INA_WK_AGAIN) {
                flush(w, p);
                return rc;
            }
        }
    }
    while (!finished(w)) {
        double t = now();
        int rc = w->sparse ? INA_WK_AGAIN : send_ready(w, p, t);
        flush(w, p);
        if (rc != INA_WK_AGAIN)
            return rc;
        int got = receive(w, p);
        t = now();
        if (got > 0) {
            gap(w, p, t);
            p->yields = 0;
        }
        flush(w, p); /* sparse: the rounds the results started; the gaps' resends */
        if (got < 0)
            return -got;
        if (p->refused_since && t - p->refused_since >= INA_WK_REFUSED_AFTER_MS * 1e-3)
            return INA_WK_REFUSED;
        if (w->shm && got == 0 && t >= p->next_gone) {
            p->next_gone = t + GONE_EVERY;
            if (ina_shm_switch_gone(w->shm))
                return INA_WK_REFUSED;
        }
        if (t >= p->next_scan) {
            p->next_scan = t + SCAN_EVERY;
            int rc = scan(w, p, t);
            if (rc != INA_WK_AGAIN)
                return rc;
        }
        if (got == 0 && (w->sparse || !p->n_cand || window_full(w, p)) && !finished(w)) {
            if (t >= end)
                return INA_WK_AGAIN;
            double wait = fmin(p->next_scan, end) - t;
            if (w->shm) {
                ina_shm_wait(w->shm, fmax(wait, 0));
                continue;
            }
            if (ina_wait_yield(&p->yields))
                continue;
            struct timespec ts = {0, (long)(fmax(wait, 0) * 1e9)};
            struct pollfd pfd[2] = {{.fd = w->fd, .events = POLLIN}, {.fd = w->group_fd, .events = POLLIN}};
            if (ppoll(pfd, w->group_fd > 0 ? 2 : 1, &ts, NULL) < 0 && errno == EINTR)
                return INA_WK_AGAIN; /* let the caller handle the signal */
        } else if (t >= end) {
            return INA_WK_AGAIN;
        }
    }
    return INA_WK_DONE;
}
