/* The worker loop (ina_worker.c) against an echo switch on a datagram socketpair, for AddressSanitizer:
 * one worker of a one-worker job, so every result is the update sent back (an NC code re-compressed
 * alone is itself). The switch thread drops every 5th first copy and duplicates every 7th packet, so
 * retransmission, duplicate and stale paths run; it also sends results of another call and errors of another
 * session (stale), and checks that every packet carries the call's identity and the boot id (protocol v3).
 * Each codec runs dense and block-sparse (every third block zero; a one-worker sparse_result is the
 * sparse_update itself). Then the error rules (worker.py _results): a header-only error and an error that
 * answers a packet in flight end the call at once; a failure's multicast is pending and ends it before the
 * next first send, or leaves a completed call DONE with the error kept. Last, a UDP port nobody listens on:
 * INA_WK_REFUSED after INA_WK_REFUSED_AFTER_MS. Prints "ok" and exits 0 when every result is right. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../ina_kernels.h"
#include "../ina_worker.h"
#include "../ina_wire.h"

#define BOOT 0xB007B007u
#define SESSION 0x5E55100Du

enum { ECHO, NOT_MEMBER, REPLY, MULTICAST, MULTICAST_LAST };
#define ERROR_RUN_N (8000 - 10) /* error_run's elements: 124 blocks of 64 and a short one */

static volatile int stop;
/* set by run() before each call, read by the echo thread */
static volatile int mode;
static volatile unsigned call_now, kind_now, len_now, trigger_at;
static volatile unsigned long bad_fields, fired;
static uint8_t sent_error[INA_WK_ERROR_MAX];
static volatile unsigned sent_error_len;

static unsigned rd16_(const uint8_t *p) { return (unsigned)p[0] << 8 | p[1]; }
static unsigned rd32_(const uint8_t *p)
{
    return (unsigned)p[0] << 24 | (unsigned)p[1] << 16 | (unsigned)p[2] << 8 | p[3];
}

/* an error to the worker: header only (not a member), or code/rank/text; FLAG_REPLY echoes pkt's id and pool */
static void send_error(int fd, const uint8_t *pkt, int reply, int with_payload, uint32_t session)
{
    uint8_t e[INA_WK_ERROR_MAX] = {0};
    e[INA_OFF_VERSION] = INA_VERSION;
    e[INA_OFF_MSG_TYPE] = INA_MSG_ERROR;
    memcpy(e + INA_OFF_JOB, pkt + INA_OFF_JOB, 2);
    e[INA_OFF_RANK] = pkt[INA_OFF_RANK];
    e[INA_OFF_EXP_NEXT] = (uint8_t)INA_EXP_NONE;
    e[INA_OFF_SESSION] = (uint8_t)(session >> 24), e[INA_OFF_SESSION + 1] = (uint8_t)(session >> 16);
    e[INA_OFF_SESSION + 2] = (uint8_t)(session >> 8), e[INA_OFF_SESSION + 3] = (uint8_t)session;
    memcpy(e + INA_OFF_BOOT, pkt + INA_OFF_BOOT, 4);
    if (reply) {
        e[INA_OFF_FLAGS] = INA_FLAG_REPLY;
        memcpy(e + INA_OFF_PACKET_ID, pkt + INA_OFF_PACKET_ID, 4);
        memcpy(e + INA_OFF_POOL, pkt + INA_OFF_POOL, 2);
    }
    size_t len = INA_HEADER_SIZE;
    if (with_payload) {
        const char *text = "job 1: rank 0 aborted its call (worker_echo)";
        e[len++] = INA_ERR_ABORTED;
        e[len++] = 0;
        memcpy(e + len, text, strlen(text));
        len += strlen(text);
    }
    if (session == SESSION) {
        memcpy(sent_error, e, len);
        sent_error_len = (unsigned)len;
    }
    send(fd, e, len, 0);
}

static void *echo(void *arg)
{
    int fd = *(int *)arg;
    uint8_t buf[70000];
    unsigned long n = 0, seen = 0;
    unsigned seen_call = 0x10000;
    while (!stop) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 5) <= 0)
            continue;
        ssize_t len = recv(fd, buf, sizeof buf, 0);
        if (len < INA_HEADER_SIZE)
            continue;
        unsigned call = rd16_(buf + INA_OFF_CALL);
        if (rd32_(buf + INA_OFF_BOOT) != BOOT || rd32_(buf + INA_OFF_SESSION) != SESSION ||
            (call == call_now && (buf[INA_OFF_CALL_KIND] != kind_now || rd32_(buf + INA_OFF_CALL_LEN) != len_now)))
            bad_fields++;
        if (mode != ECHO) { /* the error runs: no loss; the trigger counts this call's packets */
            if (call != call_now)
                continue;
            if (seen_call != call) /* the trigger counts from this call's first packet */
                seen_call = call, seen = 0;
            if (fired && (mode == NOT_MEMBER || mode == REPLY))
                continue; /* the switch answers nothing more: only an immediate stop avoids a timeout */
            int last = mode == MULTICAST_LAST && rd16_(buf + INA_OFF_COUNT) == ERROR_RUN_N % 64; /* the short block */
            if (!fired && (++seen == trigger_at || last)) {
                fired = 1;
                send_error(fd, buf, mode == NOT_MEMBER || mode == REPLY, mode != NOT_MEMBER, SESSION);
                if (mode == NOT_MEMBER || mode == REPLY)
                    continue;
            }
            buf[1] = buf[1] == INA_MSG_SPARSE_UPDATE ? INA_MSG_SPARSE_RESULT : INA_MSG_RESULT;
            send(fd, buf, (size_t)len, 0);
            continue;
        }
        n++;
        if (n % 5 == 0)
            continue; /* lost */
        buf[1] = buf[1] == INA_MSG_SPARSE_UPDATE ? INA_MSG_SPARSE_RESULT : INA_MSG_RESULT;
        if (n % 9 == 0)
            buf[INA_OFF_FLAGS] |= INA_FLAG_CONGESTED; /* a congested round: the window shrinks */
        /* exp_next of a result is the agreed exponent: with one worker, its own */
        send(fd, buf, (size_t)len, 0);
        if (n % 7 == 0)
            send(fd, buf, (size_t)len, 0); /* duplicated */
        if (n % 11 == 0) {
            buf[8] ^= 0x40; /* a packet id from elsewhere: stale */
            send(fd, buf, (size_t)len, 0);
            buf[8] ^= 0x40;
        }
        if (n % 13 == 0) {
            buf[INA_OFF_CALL + 1] ^= 1; /* another call's result: stale */
            send(fd, buf, (size_t)len, 0);
            buf[INA_OFF_CALL + 1] ^= 1;
        }
        if (n % 17 == 0)
            send_error(fd, buf, 1, 1, SESSION ^ 1); /* an error of another generation: stale */
    }
    return NULL;
}

static unsigned calls;

static void begin(ina_wk *w, int m, unsigned trigger)
{
    w->call = (uint16_t)(0xFFFE + calls++); /* wraps past 2^16 */
    w->call_kind = (uint8_t)((w->kind + 1) | (w->sparse ? INA_CALL_SPARSE : 0));
    w->call_len = (uint32_t)w->n;
    w->boot = BOOT;
    call_now = w->call, kind_now = w->call_kind, len_now = w->call_len;
    fired = 0;
    trigger_at = trigger;
    mode = m;
}

static int run(int fd, int kind, size_t n, uint32_t k, int sparse, int policy)
{
    float *xf = malloc(n * sizeof *xf);
    int32_t *xi = malloc(n * sizeof *xi);
    size_t nb = (n + k - 1) / k;
    uint8_t *held = malloc(nb);
    for (size_t b = 0; b < nb; b++)
        held[b] = !sparse || b % 3 != 1;
    for (size_t i = 0; i < n; i++) {
        xf[i] = held[i / k] ? (float)((double)((i * 2654435761u) % 20001) / 1000.0 - 10.0) : 0.0f;
        xi[i] = held[i / k] ? (int32_t)(i * 2654435761u) : 0;
    }
    int8_t *exps = malloc(nb), *agreed = malloc(nb);
    void *result = calloc(n, kind == INA_WK_NC ? 1 : 4);
    uint8_t *done = calloc(2 * nb, 1);
    if (kind != INA_WK_INT32 && ina_block_exponents(xf, n, k, exps))
        return 1;
    /* slot ids near the 32-bit wrap, and a call that starts mid-window */
    uint32_t uses[8] = {0xFFFFFFF0u, 0xFFFFFFFEu, 3, 0, 0xFFFFFFFFu, 7, 1, 2}, rounds[8] = {0};
    ina_wk w = {.fd = fd, .job = 1, .rank = 0, .world = 1, .window = 8, .k = k, .session = SESSION,
                .first_slot = 5, .slot_uses = uses, .stream_rounds = rounds, .kind = kind, .seed = 42, .src = kind == INA_WK_INT32 ? (void *)xi : (void *)xf, .n = n,
                .exps = kind == INA_WK_INT32 ? NULL : exps, .agreed = agreed, .result = result, .done = done,
                .rto = 0.002, .min_rto = 0.002, .max_rto = 0.01, .timeout = 20, .sparse = sparse, .held = held};
    memset(agreed, INA_EXP_NONE, nb);
    ina_cc_init(&w.cc, policy, w.window);
    begin(&w, ECHO, 0);
    if (ina_wk_start(&w))
        return 2;
    int rc;
    while ((rc = ina_wk_run(&w, 50)) == INA_WK_AGAIN)
        ;
    ina_wk_finish(&w);
    int bad = rc != INA_WK_DONE || w.retransmissions == 0 || w.duplicate_results == 0 || w.stale_results == 0 ||
              w.error_len != 0;
    if (kind == INA_WK_INT32) {
        bad |= memcmp(result, xi, n * 4) != 0;
    } else if (kind == INA_WK_FIXED) {
        float *y = malloc(n * sizeof *y);
        ina_fixed_dequantize(result, n, k, agreed, 1, y);
        for (size_t i = 0; i < n; i++)
            bad |= y[i] - xf[i] > 1e-5f || xf[i] - y[i] > 1e-5f;
        free(y);
    } else {
        float *y = malloc(n * sizeof *y);
        bad |= ina_nc_decode(result, n, y) != 0;
        for (size_t i = 0; i < n; i++) /* NC rounds to a neighbouring power of two */
            bad |= (xf[i] != 0 && (y[i] / xf[i] < 0.5f || y[i] / xf[i] > 2.0f)) || (xf[i] == 0 && y[i] != 0);
        free(y);
    }
    bad |= memcmp(agreed, exps, kind == INA_WK_INT32 ? 0 : nb) != 0;
    if (sparse)
        bad |= w.streams_done != w.streams || rounds[0] % 2 || w.ndone != nb - nb / 3 - (nb % 3 == 2);
    if (policy != INA_CC_NONE && !sparse) /* a gap resent at once; congested rounds cut the window */
        bad |= w.fast_retransmits == 0 || w.cc.reductions == 0 || w.cc.cwnd < 2 || w.cc.cwnd > w.window;
    fprintf(stderr, "kind %d sparse %d cc %d: rc %d sent %lu retransmissions %lu (fast %lu) duplicates %lu stale %lu "
            "cuts %lu -> %s\n", kind, sparse, policy, rc, (unsigned long)w.packets_sent,
            (unsigned long)w.retransmissions, (unsigned long)w.fast_retransmits, (unsigned long)w.duplicate_results,
            (unsigned long)w.stale_results, (unsigned long)w.cc.reductions, bad ? "BAD" : "ok");
    free(xf); free(xi); free(exps); free(agreed); free(result); free(done); free(held);
    return bad;
}

/* one int32 call of 7990 elements (125 blocks of 64, window 8; dense or block-sparse) in an error mode: the
 * result code and the error the loop kept */
static int error_run(int fd, int m, unsigned trigger, int want_rc, const char *name, int sparse)
{
    size_t n = ERROR_RUN_N; /* a short last block: MULTICAST_LAST fires on it */
    uint32_t k = 64;
    int32_t *x = calloc(n, 4), *result = calloc(n, 4);
    uint8_t *done = calloc(2 * n / k + 2, 1), *held = malloc(n / k + 1);
    memset(held, 1, n / k + 1);
    int8_t *agreed = malloc(n / k + 1); /* sparse: each block's, int32 too */
    uint32_t uses[8] = {0}, rounds[8] = {0};
    ina_wk w = {.fd = fd, .job = 1, .rank = 0, .world = 1, .window = 8, .k = k, .session = SESSION,
                .slot_uses = uses, .stream_rounds = rounds, .kind = INA_WK_INT32, .src = x, .n = n, .agreed = agreed,
                .result = result, .done = done, .rto = 0.005, .min_rto = 0.005, .max_rto = 0.02, .timeout = 2,
                .sparse = sparse, .held = held};
    begin(&w, m, trigger);
    if (ina_wk_start(&w))
        return 2;
    int rc;
    while ((rc = ina_wk_run(&w, 50)) == INA_WK_AGAIN)
        ;
    ina_wk_finish(&w);
    mode = ECHO;
    int bad = rc != want_rc || !fired || w.error_len != sent_error_len || memcmp(w.error, sent_error, w.error_len);
    if (m == MULTICAST_LAST)
        bad |= w.ndone != w.total; /* completed, the error kept */
    else
        bad |= w.ndone >= w.total;
    fprintf(stderr, "%s%s: rc %d error_len %u ndone %u/%u retransmissions %lu -> %s\n", name,
            sparse ? " (sparse)" : "", rc, w.error_len, w.ndone, w.total, (unsigned long)w.retransmissions,
            bad ? "BAD" : "ok");
    free(x); free(result); free(done); free(held); free(agreed);
    return bad;
}

/* a connected UDP socket to a loopback port nobody listens on: ICMP port unreachable, INA_WK_REFUSED */
static int refused_run(void)
{
    int probe = socket(AF_INET, SOCK_DGRAM, 0), fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (probe < 0 || fd < 0 || bind(probe, (struct sockaddr *)&a, sizeof a) ||
        getsockname(probe, (struct sockaddr *)&a, &al))
        return 4;
    close(probe); /* the port is free now: nothing listens */
    if (connect(fd, (struct sockaddr *)&a, sizeof a))
        return 4;
    size_t n = 1000;
    int32_t *x = calloc(n, 4), *result = calloc(n, 4);
    uint8_t done[64] = {0};
    int8_t agreed[1];
    uint32_t uses[8] = {0}, rounds[8] = {0};
    ina_wk w = {.fd = fd, .job = 1, .rank = 0, .world = 1, .window = 8, .k = 64, .session = SESSION,
                .slot_uses = uses, .stream_rounds = rounds, .kind = INA_WK_INT32, .src = x, .n = n, .agreed = agreed,
                .result = result, .done = done, .rto = 0.005, .min_rto = 0.005, .max_rto = 0.05, .timeout = 20};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (ina_wk_start(&w))
        return 2;
    int rc;
    while ((rc = ina_wk_run(&w, 50)) == INA_WK_AGAIN)
        ;
    ina_wk_finish(&w);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    int bad = rc != INA_WK_REFUSED || s < INA_WK_REFUSED_AFTER_MS * 1e-3 || s > 5;
    fprintf(stderr, "refused: rc %d after %.3f s -> %s\n", rc, s, bad ? "BAD" : "ok");
    close(fd);
    free(x); free(result);
    return bad;
}

int main(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK, 0, sv))
        return 3;
    pthread_t t;
    pthread_create(&t, NULL, echo, &sv[1]);
    int bad = 0;
    for (int policy = INA_CC_NONE; policy <= INA_CC_AIMD; policy += INA_CC_AIMD)
        for (int sparse = 0; sparse < 2; sparse++)
            bad |= run(sv[0], INA_WK_INT32, 10007, 64, sparse, policy) |
                   run(sv[0], INA_WK_FIXED, 5003, 100, sparse, policy) | run(sv[0], INA_WK_NC, 20011, 512, sparse, policy);
    if (bad_fields) {
        fprintf(stderr, "%lu packets without the call's identity or the boot id -> BAD\n", (unsigned long)bad_fields);
        bad = 1;
    }
    bad |= error_run(sv[0], NOT_MEMBER, 20, INA_WK_SWITCH_ERROR, "not a member", 0);
    bad |= error_run(sv[0], REPLY, 20, INA_WK_SWITCH_ERROR, "reply to a packet in flight", 0);
    bad |= error_run(sv[0], MULTICAST, 20, INA_WK_SWITCH_ERROR, "multicast, then a first send", 0);
    bad |= error_run(sv[0], MULTICAST_LAST, 0, INA_WK_DONE, "multicast after the last first send", 0);
    bad |= error_run(sv[0], REPLY, 20, INA_WK_SWITCH_ERROR, "reply to a packet in flight", 1);
    bad |= error_run(sv[0], MULTICAST, 20, INA_WK_SWITCH_ERROR, "multicast, then a first send", 1);
    bad |= refused_run();
    stop = 1;
    pthread_join(t, NULL);
    close(sv[0]);
    close(sv[1]);
    if (!bad)
        puts("ok");
    return bad;
}
