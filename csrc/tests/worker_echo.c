/* The worker loop (ina_worker.c) against an echo switch on a datagram socketpair, for AddressSanitizer:
 * one worker of a one-worker job, so every result is the update sent back (an NC code re-compressed
 * alone is itself). The switch thread drops every 5th first copy and duplicates every 7th packet, so
 * retransmission, duplicate and stale paths run. Each codec runs dense and block-sparse (every third block
 * zero; a one-worker sparse_result is the sparse_update itself). Prints "ok" and exits 0 when every result
 * is right. */
#define _GNU_SOURCE
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../ina_kernels.h"
#include "../ina_worker.h"
#include "../ina_wire.h"

static volatile int stop;

static void *echo(void *arg)
{
    int fd = *(int *)arg;
    uint8_t buf[70000];
    unsigned long n = 0;
    while (!stop) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 5) <= 0)
            continue;
        ssize_t len = recv(fd, buf, sizeof buf, 0);
        if (len < INA_HEADER_SIZE)
            continue;
        n++;
        if (n % 5 == 0)
            continue; /* lost */
        buf[1] = buf[1] == INA_MSG_SPARSE_UPDATE ? INA_MSG_SPARSE_RESULT : INA_MSG_RESULT;
        /* exp_next of a result is the agreed exponent: with one worker, its own */
        send(fd, buf, (size_t)len, 0);
        if (n % 7 == 0)
            send(fd, buf, (size_t)len, 0); /* duplicated */
        if (n % 11 == 0) {
            buf[8] ^= 0x40; /* a packet id from elsewhere: stale */
            send(fd, buf, (size_t)len, 0);
        }
    }
    return NULL;
}

static int run(int fd, int kind, size_t n, uint32_t k, int sparse)
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
    ina_wk w = {.fd = fd, .job = 1, .rank = 0, .world = 1, .window = 8, .k = k, .session = 0x5E55100Du,
                .first_slot = 5, .slot_uses = uses, .stream_rounds = rounds, .kind = kind, .seed = 42, .src = kind == INA_WK_INT32 ? (void *)xi : (void *)xf, .n = n,
                .exps = kind == INA_WK_INT32 ? NULL : exps, .agreed = agreed, .result = result, .done = done,
                .rto = 0.002, .min_rto = 0.002, .max_rto = 0.01, .timeout = 20, .sparse = sparse, .held = held};
    memset(agreed, INA_EXP_NONE, nb);
    if (ina_wk_start(&w))
        return 2;
    int rc;
    while ((rc = ina_wk_run(&w, 50)) == INA_WK_AGAIN)
        ;
    ina_wk_finish(&w);
    int bad = rc != INA_WK_DONE || w.retransmissions == 0 || w.duplicate_results == 0 || w.stale_results == 0;
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
    fprintf(stderr, "kind %d sparse %d: rc %d sent %lu retransmissions %lu duplicates %lu stale %lu -> %s\n", kind, sparse, rc,
            (unsigned long)w.packets_sent, (unsigned long)w.retransmissions, (unsigned long)w.duplicate_results,
            (unsigned long)w.stale_results, bad ? "BAD" : "ok");
    free(xf); free(xi); free(exps); free(agreed); free(result); free(done); free(held);
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
    for (int sparse = 0; sparse < 2; sparse++)
        bad |= run(sv[0], INA_WK_INT32, 10007, 64, sparse) | run(sv[0], INA_WK_FIXED, 5003, 100, sparse) |
               run(sv[0], INA_WK_NC, 20011, 512, sparse);
    stop = 1;
    pthread_join(t, NULL);
    close(sv[0]);
    close(sv[1]);
    if (!bad)
        puts("ok");
    return bad;
}
