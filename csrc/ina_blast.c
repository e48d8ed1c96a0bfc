#define _GNU_SOURCE
#include "ina_blast.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define BLAST_BATCH 64 /* datagrams per sendmmsg / recvmmsg */
#define BLAST_MAX_FDS 64
#define BLAST_RX_BUF 2048

static double clock_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    struct mmsghdr *msg; /* [nfds][BLAST_BATCH]: send batches, one a socket */
    struct iovec *iov;
    struct mmsghdr rmsg[BLAST_BATCH];
    struct iovec riov[BLAST_BATCH];
    uint8_t *rbuf;
} blast_bufs;

/* Read every datagram waiting on every socket; errors (an ICMP port unreachable on a connected socket:
 * ECONNREFUSED) are consumed and ignored. Returns the datagrams read. */
static uint64_t drain(const int *fds, uint32_t nfds, blast_bufs *b, ina_blast_result *out) {
    uint64_t got = 0;
    for (uint32_t s = 0; s < nfds; s++) {
        for (int tries = 0; tries < 64; tries++) {
            for (int k = 0; k < BLAST_BATCH; k++) {
                b->riov[k].iov_base = b->rbuf + (size_t)k * BLAST_RX_BUF;
                b->riov[k].iov_len = BLAST_RX_BUF;
                memset(&b->rmsg[k].msg_hdr, 0, sizeof b->rmsg[k].msg_hdr);
                b->rmsg[k].msg_hdr.msg_iov = &b->riov[k];
                b->rmsg[k].msg_hdr.msg_iovlen = 1;
            }
            int r = recvmmsg(fds[s], b->rmsg, BLAST_BATCH, MSG_DONTWAIT, NULL);
            if (r < 0) {
                if (errno == EINTR || errno == ECONNREFUSED)
                    continue;
                break; /* EAGAIN: nothing more on this socket */
            }
            for (int k = 0; k < r; k++)
                out->bytes_received += b->rmsg[k].msg_len;
            got += (uint64_t)r;
            if (r < BLAST_BATCH)
                break;
        }
    }
    out->received += got;
    return got;
}

/* Send packets [i, limit) (at most BLAST_BATCH), grouped by socket: one sendmmsg a socket. */
static void send_range(const int *fds, uint32_t nfds, const uint8_t *blob, const uint32_t *lens,
                       const uint8_t *sock, uint64_t i, uint64_t limit, size_t *off, blast_bufs *b,
                       ina_blast_result *out) {
    unsigned cnt[BLAST_MAX_FDS] = {0};
    for (uint64_t k = i; k < limit; k++) {
        uint32_t s = sock[k];
        unsigned c = cnt[s]++;
        struct iovec *v = &b->iov[(size_t)s * BLAST_BATCH + c];
        struct mmsghdr *m = &b->msg[(size_t)s * BLAST_BATCH + c];
        v->iov_base = (void *)(blob + *off);
        v->iov_len = lens[k];
        memset(&m->msg_hdr, 0, sizeof m->msg_hdr);
        m->msg_hdr.msg_iov = v;
        m->msg_hdr.msg_iovlen = 1;
        *off += lens[k];
    }
    for (uint32_t s = 0; s < nfds; s++) {
        unsigned done = 0;
        while (done < cnt[s]) {
            int r = sendmmsg(fds[s], &b->msg[(size_t)s * BLAST_BATCH + done], cnt[s] - done, MSG_DONTWAIT);
            if (r < 0) {
                if (errno == EINTR || errno == ECONNREFUSED)
                    continue; /* a pending ICMP error is reported once: the send itself did not happen */
                out->send_errors += cnt[s] - done; /* a full send buffer: these are not sent */
                break;
            }
            done += (unsigned)r;
        }
        out->sent += done;
    }
}

int ina_blast(const int *fds, uint32_t nfds, const uint8_t *blob, const uint32_t *lens, const uint8_t *sock,
              uint64_t n, double rate, uint32_t window, double seconds, double quiet, uint64_t expect,
              ina_blast_result *out) {
    if (!fds || !out || nfds == 0 || nfds > BLAST_MAX_FDS || (n && (!blob || !lens || !sock)) || !(seconds >= 0)
        || !(quiet >= 0) || !(rate >= 0)) {
        errno = EINVAL;
        return -1;
    }
    for (uint64_t k = 0; k < n; k++)
        if (sock[k] >= nfds) {
            errno = EINVAL;
            return -1;
        }
    memset(out, 0, sizeof *out);
    blast_bufs b;
    b.msg = calloc((size_t)nfds * BLAST_BATCH, sizeof *b.msg);
    b.iov = calloc((size_t)nfds * BLAST_BATCH, sizeof *b.iov);
    b.rbuf = malloc((size_t)BLAST_BATCH * BLAST_RX_BUF);
    struct pollfd pfd[BLAST_MAX_FDS];
    if (!b.msg || !b.iov || !b.rbuf) {
        free(b.msg), free(b.iov), free(b.rbuf);
        errno = ENOMEM;
        return -1;
    }
    for (uint32_t s = 0; s < nfds; s++)
        pfd[s] = (struct pollfd){.fd = fds[s], .events = POLLIN};

    const double t0 = clock_s(), hard_stop = seconds + 4 * quiet;
    uint64_t i = 0, forgiven = 0; /* next packet; packets given up as lost by a stalled window */
    size_t off = 0;
    int rc = 0;
    for (;;) {
        double now = clock_s() - t0;
        if (drain(fds, nfds, &b, out))
            out->last_receive = now = clock_s() - t0;
        int64_t inflight = (int64_t)out->sent - (int64_t)out->received - (int64_t)forgiven;
        if (inflight < 0)
            inflight = 0;
        int sending = i < n && now < seconds;
        double wait_until;
        if (sending) {
            uint64_t limit = n - i < BLAST_BATCH ? n : i + BLAST_BATCH;
            if (rate > 0) {
                double due = now * rate + 1; /* packet k is due at k / rate */
                if (due < (double)limit)
                    limit = (uint64_t)due;
            }
            if (window) {
                uint64_t room = inflight >= (int64_t)window ? 0 : window - (uint64_t)inflight;
                if (limit > i + room)
                    limit = i + room;
            }
            if (limit > i) {
                if (out->sent + out->send_errors == 0)
                    out->first_send = now;
                send_range(fds, nfds, blob, lens, sock, i, limit, &off, &b, out);
                i = limit;
                out->last_send = clock_s() - t0;
                continue; /* more may be due at once; the next turn reads what came back */
            }
            /* nothing may go now: wait for the next due packet, an answer, or a stalled window */
            wait_until = seconds;
            if (rate > 0 && (double)i / rate < wait_until)
                wait_until = (double)i / rate;
            if (window && inflight >= (int64_t)window) {
                double idle_from = out->last_receive > out->last_send ? out->last_receive : out->last_send;
                if (now - idle_from >= quiet) { /* lost: forget them so the stream goes on */
                    forgiven += (uint64_t)inflight;
                    out->stalls++;
                    continue;
                }
                if (idle_from + quiet < wait_until)
                    wait_until = idle_from + quiet;
            }
        } else {
            if (expect && out->received >= expect)
                break;
            double idle_from = out->last_receive > out->last_send ? out->last_receive : out->last_send;
            if (now - idle_from >= quiet || now >= hard_stop)
                break;
            wait_until = idle_from + quiet < hard_stop ? idle_from + quiet : hard_stop;
        }
        double wait = wait_until - now;
        if (wait < 0)
            wait = 0;
        struct timespec ts = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (double)(time_t)wait) * 1e9)};
        if (ppoll(pfd, nfds, &ts, NULL) < 0 && errno != EINTR) {
            rc = -1;
            break;
        }
    }
    out->elapsed = clock_s() - t0;
    int saved = errno;
    free(b.msg), free(b.iov), free(b.rbuf);
    errno = saved;
    return rc;
}
