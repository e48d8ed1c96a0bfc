/* hostlib/worker.py's _allreduce_flat in C, branch for branch (tests/test_fastpath.py checks that both
 * give the same bytes). Packet q of the stream carries block q - D and this worker's exponent of block q;
 * q is sent once q - W and q - D are done; results are matched by packet id; a packet with no result by
 * its deadline is resent from the copy kept in its window entry (the Python loop rebuilds the same bytes
 * from the counter-based RNG). New packets go out in sendmmsg batches, results come in recvmmsg batches. */
#define _GNU_SOURCE
#include "ina_worker.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "ina_kernels.h"
#include "ina_packet.h"

#define SCAN_EVERY 0.002 /* seconds between retransmission scans, as in the Python loop */
#define INT32_MAX_ 2147483647

typedef struct {
    uint32_t q, tries, len;
    int busy;
    double first_sent, deadline, rto;
} entry;

typedef struct {
    entry *win;      /* window entries, indexed by q mod W */
    uint8_t *pkts;   /* the packet of each entry, pkt_max bytes apart */
    size_t pkt_max, esize;
    uint32_t next_q;
    double next_scan;
    uint8_t *rbuf;
    struct mmsghdr rmsg[INA_WK_BATCH], smsg[INA_WK_BATCH];
    struct iovec riov[INA_WK_BATCH], siov[INA_WK_BATCH];
    int n_send;
} priv_t;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static double fixed_scale(int exp, int world)
{
    return (double)(INT32_MAX_ / world) / ldexp(1.0, exp == INA_EXP_NONE ? 0 : exp);
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
    p->pkt_max = INA_HEADER_SIZE + (size_t)w->k * p->esize;
    p->win = calloc(w->window, sizeof *p->win);
    p->pkts = malloc((size_t)w->window * p->pkt_max);
    /* one byte more than the largest result, so an oversized datagram shows as a length mismatch */
    p->rbuf = malloc((size_t)INA_WK_BATCH * (p->pkt_max + 1));
    if (!p->win || !p->pkts || !p->rbuf) {
        w->priv = p;
        ina_wk_finish(w);
        return INA_WK_NO_MEMORY;
    }
    for (int i = 0; i < INA_WK_BATCH; i++) {
        p->riov[i].iov_base = p->rbuf + (size_t)i * (p->pkt_max + 1);
        p->riov[i].iov_len = p->pkt_max + 1;
    }
    w->nb = (uint32_t)((w->n + w->k - 1) / w->k);
    w->D = w->kind == INA_WK_INT32 ? 0 : (w->window < w->nb ? w->window : w->nb);
    w->total = w->nb + w->D;
    w->ndone = 0;
    w->priv = p;
    return 0;
}

void ina_wk_finish(ina_wk *w)
{
    priv_t *p = w->priv;
    if (!p)
        return;
    free(p->win);
    free(p->pkts);
    free(p->rbuf);
    free(p);
    w->priv = NULL;
}

/* the update packet for q into buf (worker.py build()); its length, or -1 if a kernel failed */
static long build(ina_wk *w, priv_t *p, uint32_t q, uint8_t *buf)
{
    uint64_t pid = (uint64_t)w->base_pid + q;
    int8_t exp_next = w->exps && q < w->nb ? w->exps[q] : INA_EXP_NONE;
    int8_t exp_cur = 0;
    uint32_t count = 0;
    uint8_t *pl = buf + INA_HEADER_SIZE;
    if (q >= w->D) {
        uint64_t lo = (uint64_t)(q - w->D) * w->k;
        count = (uint32_t)(w->n - lo < w->k ? w->n - lo : w->k);
        if (w->kind == INA_WK_INT32) {
            const int32_t *s = (const int32_t *)w->src + lo;
            for (uint32_t i = 0; i < count; i++)
                wr32(pl + 4 * i, (uint32_t)s[i]);
        } else {
            exp_cur = w->agreed[q - w->D];
            const float *s = (const float *)w->src + lo;
            if (exp_cur == INA_EXP_NONFINITE) {
                memset(pl, 0, count * p->esize); /* every worker raises at the end */
            } else if (w->kind == INA_WK_FIXED) {
                ina_fixed_quantize(s, count, fixed_scale(exp_cur, w->world), INT32_MAX_ / w->world, pl);
            } else {
                int floor = exp_cur == INA_EXP_NONE ? INA_NC_LEVEL_MIN : nc_floor(exp_cur);
                int rc = ina_nc_encode(s, count, pl, w->seed, lo, w->deterministic, floor);
                if (rc) {
                    w->sys_errno = rc;
                    return -1;
                }
            }
        }
    }
    put_header(buf, INA_MSG_UPDATE, w->job, w->rank, (uint32_t)pid, (uint16_t)(pid % w->window),
               (uint8_t)((pid / w->window) & 1), (uint16_t)count,
               w->kind == INA_WK_NC ? INA_CODEC_NC8 : INA_CODEC_INT32, exp_cur, exp_next, 0);
    return INA_HEADER_SIZE + (long)count * (long)p->esize;
}

/* send the queued batch; like the Python loop, a refused or dropped send counts as sent and the
 * timeout recovers it */
static void flush(ina_wk *w, priv_t *p)
{
    int off = 0;
    while (off < p->n_send) {
        int r = sendmmsg(w->fd, p->smsg + off, (unsigned)(p->n_send - off), 0);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            break;
        }
        off += r;
    }
    p->n_send = 0;
}

static void queue(ina_wk *w, priv_t *p, entry *e)
{
    uint8_t *pkt = p->pkts + (size_t)(e - p->win) * p->pkt_max;
    p->siov[p->n_send] = (struct iovec){pkt, e->len};
    memset(&p->smsg[p->n_send], 0, sizeof p->smsg[0]);
    p->smsg[p->n_send].msg_hdr.msg_iov = &p->siov[p->n_send];
    p->smsg[p->n_send].msg_hdr.msg_iovlen = 1;
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

static void rtt_sample(ina_wk *w, double r)
{
    if (!w->have_srtt) {
        w->srtt = r;
        w->rttvar = r / 2;
        w->have_srtt = 1;
    } else {
        w->rttvar = 0.75 * w->rttvar + 0.25 * fabs(w->srtt - r);
        w->srtt = 0.875 * w->srtt + 0.125 * r;
    }
    double rto = w->srtt + 4 * w->rttvar;
    w->rto = fmin(fmax(rto, w->min_rto), w->max_rto);
}

/* one received datagram; INA_WK_AGAIN to go on, or INA_WK_SWITCH_ERROR */
static int on_result(ina_wk *w, priv_t *p, const uint8_t *d, size_t len)
{
    header h;
    w->packets_received++;
    w->bytes_received += len;
    if (parse(d, len, &h))
        return INA_WK_AGAIN;
    if (h.msg_type == INA_MSG_ERROR) {
        size_t t = len - INA_HEADER_SIZE < INA_WK_ERROR_TEXT - 1 ? len - INA_HEADER_SIZE : INA_WK_ERROR_TEXT - 1;
        memcpy(w->error, d + INA_HEADER_SIZE, t);
        w->error[t] = 0;
        return INA_WK_SWITCH_ERROR;
    }
    uint32_t q = h.packet_id - w->base_pid;
    if (h.msg_type != INA_MSG_RESULT || h.job != w->job || q >= w->total) {
        w->stale_results++;
        return INA_WK_AGAIN;
    }
    if (w->done[q]) {
        w->duplicate_results++;
        return INA_WK_AGAIN;
    }
    uint64_t lo = (uint64_t)(q - w->D) * w->k;
    uint32_t expect = q < w->D ? 0 : (uint32_t)(w->n - lo < w->k ? w->n - lo : w->k);
    if (h.count != expect || h.codec != (w->kind == INA_WK_NC ? INA_CODEC_NC8 : INA_CODEC_INT32)) {
        w->stale_results++;
        return INA_WK_AGAIN;
    }
    if (h.flags & INA_FLAG_OVERFLOW)
        w->overflow = 1;
    if (w->exps && q < w->nb)
        w->agreed[q] = h.exp_next;
    if (q >= w->D) {
        const uint8_t *pl = d + INA_HEADER_SIZE;
        if (w->kind == INA_WK_NC) {
            memcpy((uint8_t *)w->result + lo, pl, h.count);
        } else {
            int32_t *r = (int32_t *)w->result + lo;
            for (uint32_t i = 0; i < h.count; i++)
                r[i] = (int32_t)rd32(pl + 4 * i);
        }
    }
    w->done[q] = 1;
    w->ndone++;
    entry *e = &p->win[q % w->window];
    if (e->busy && e->q == q) {
        e->busy = 0;
        if (e->tries == 0)
            rtt_sample(w, now() - e->first_sent);
    }
    return INA_WK_AGAIN;
}

/* drain the socket in batches; the number of datagrams read, or -(result code) */
static int receive(ina_wk *w, priv_t *p)
{
    int got = 0;
    for (;;) {
        for (int i = 0; i < INA_WK_BATCH; i++) {
            memset(&p->rmsg[i].msg_hdr, 0, sizeof p->rmsg[i].msg_hdr);
            p->rmsg[i].msg_hdr.msg_iov = &p->riov[i];
            p->rmsg[i].msg_hdr.msg_iovlen = 1;
        }
        int r = recvmmsg(w->fd, p->rmsg, INA_WK_BATCH, MSG_DONTWAIT, NULL);
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return got;
            if (errno == ECONNREFUSED)
                continue; /* ICMP port unreachable: the switch is not there (yet); timeouts decide */
            w->sys_errno = errno;
            return -INA_WK_SYSTEM_ERROR;
        }
        for (int i = 0; i < r; i++) {
            size_t len = p->rmsg[i].msg_len;
            if (p->rmsg[i].msg_hdr.msg_flags & MSG_TRUNC)
                len = p->pkt_max + 1; /* oversized: fails the length check */
            int rc = on_result(w, p, p->riov[i].iov_base, len);
            if (rc != INA_WK_AGAIN)
                return -rc;
        }
        got += r;
        if (r < INA_WK_BATCH)
            return got;
    }
}

/* resend every packet past its deadline (exponential backoff); INA_WK_TIMEOUT when one is past timeout */
static int scan(ina_wk *w, priv_t *p, double t)
{
    for (uint32_t i = 0; i < w->window; i++) {
        entry *e = &p->win[i];
        if (!e->busy || t < e->deadline)
            continue;
        if (t - e->first_sent > w->timeout) {
            w->timeout_q = e->q;
            w->timeout_tries = e->tries;
            return INA_WK_TIMEOUT;
        }
        queue(w, p, e);
        w->retransmissions++;
        e->rto = fmin(e->rto * 2, w->max_rto);
        e->deadline = t + e->rto;
        e->tries++;
    }
    flush(w, p);
    return INA_WK_AGAIN;
}

int ina_wk_run(ina_wk *w, int budget_ms)
{
    priv_t *p = w->priv;
    double end = now() + budget_ms * 1e-3;
    while (w->ndone < w->total) {
        double t = now();
        while (sendable(w, p->next_q)) {
            uint32_t q = p->next_q;
            entry *e = &p->win[q % w->window];
            long len = build(w, p, q, p->pkts + (size_t)(e - p->win) * p->pkt_max);
            if (len < 0) {
                flush(w, p);
                return INA_WK_ENCODE_ERROR;
            }
            *e = (entry){.q = q, .len = (uint32_t)len, .busy = 1, .first_sent = t, .deadline = t + w->rto,
                         .rto = w->rto};
            queue(w, p, e);
            p->next_q++;
        }
        flush(w, p);
        int got = receive(w, p);
        if (got < 0)
            return -got;
        t = now();
        if (t >= p->next_scan) {
            p->next_scan = t + SCAN_EVERY;
            int rc = scan(w, p, t);
            if (rc != INA_WK_AGAIN)
                return rc;
        }
        if (got == 0 && !sendable(w, p->next_q) && w->ndone < w->total) {
            if (t >= end)
                return INA_WK_AGAIN;
            double wait = fmin(p->next_scan, end) - t;
            struct timespec ts = {0, (long)(fmax(wait, 0) * 1e9)};
            struct pollfd pfd = {.fd = w->fd, .events = POLLIN};
            if (ppoll(&pfd, 1, &ts, NULL) < 0 && errno == EINTR)
                return INA_WK_AGAIN; /* let the caller handle the signal */
        } else if (t >= end) {
            return INA_WK_AGAIN;
        }
    }
    return INA_WK_DONE;
}

int ina_block_exponents(const float *x, size_t n, size_t k, int8_t *out)
{
    const uint32_t *bits = (const uint32_t *)x;
    int status = 0;
    for (size_t lo = 0, b = 0; lo < n; lo += k, b++) {
        size_t hi = n - lo < k ? n : lo + k;
        uint32_t m = 0;
        for (size_t i = lo; i < hi; i++) {
            uint32_t a = bits[i] & 0x7FFFFFFFu; /* |x| orders like its bits; NaN and Inf sort last */
            m = a > m ? a : m;
        }
        int e;
        if (m >= 0x7F800000u) {
            out[b] = INA_EXP_NONFINITE;
            continue;
        }
        if (m == 0) {
            out[b] = INA_EXP_NONE;
            continue;
        }
        if (m >> 23)
            e = (int)(m >> 23) - 126; /* frexp: |x| = 0.5..1 * 2^e */
        else
            e = (32 - __builtin_clz(m)) - 149; /* denormal: mant * 2^-149 */
        if (e > INA_EXP_MAX) {
            status = INA_KERNEL_OVERFLOW;
            e = INA_EXP_MAX;
        }
        out[b] = (int8_t)(e < INA_EXP_MIN ? INA_EXP_MIN : e);
    }
    return status;
}

void ina_fixed_dequantize(const int32_t *sums, size_t n, size_t k, const int8_t *exps, int world, float *out)
{
    for (size_t lo = 0, b = 0; lo < n; lo += k, b++) {
        size_t hi = n - lo < k ? n : lo + k;
        double scale = fixed_scale(exps[b], world);
        for (size_t i = lo; i < hi; i++)
            out[i] = (float)((double)sums[i] / scale);
    }
}
