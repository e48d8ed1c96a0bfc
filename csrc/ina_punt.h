/* The queue of control requests (join, leave, abort, heartbeat, stats) a C loop hands up to the control
 * plane (switchsim/control.py), behind a token bucket on the monotonic clock: a flood of them is dropped
 * here, in C, at the cost of any small datagram. Every request it drops is counted in the core's drops
 * (rate_limited, oversized, punt_overflow), so the switch's packets_in stays the sum of its outcomes.
 * INA_CONTROL_RATE/BURST equal control.py's CONTROL_RATE (tests/test_native.py checks). Header-only,
 * shared by the UDP, shared-memory and DPDK loops. */
#ifndef INA_PUNT_H
#define INA_PUNT_H
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "ina_core.h"

#define INA_CONTROL_RATE 2000.0
#define INA_CONTROL_BURST 200
#define INA_PUNT_MAX_LEN 512 /* longest control request: a join (INA_JOIN_SIZE) */
#define INA_PUNT_QUEUE 64    /* requests held for the caller between two returns of a loop's run */

typedef struct {
    double rate, burst, tokens, at;
} ina_bucket;

static inline double ina_bucket_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void ina_bucket_init(ina_bucket *b, double rate, double burst)
{
    b->rate = rate;
    b->burst = b->tokens = burst;
    b->at = ina_bucket_now();
}

static inline int ina_bucket_take(ina_bucket *b)
{
    double now = ina_bucket_now(), t = b->tokens + (now - b->at) * b->rate;
    b->tokens = t < b->burst ? t : b->burst;
    b->at = now;
    if (b->tokens < 1)
        return 0;
    b->tokens -= 1;
    return 1;
}
typedef struct {
    ina_bucket rate;
    uint8_t buf[INA_PUNT_QUEUE][INA_PUNT_MAX_LEN];
    uint32_t len[INA_PUNT_QUEUE];
    uint64_t src[INA_PUNT_QUEUE]; /* address ids: IPv4 << 16 | port */
    int n;
    uint64_t dropped; /* queue full or too long (also in the core's drops: punt_overflow, oversized) */
} ina_punt_queue;

static inline void ina_punt_init(ina_punt_queue *q)
{
    ina_bucket_init(&q->rate, INA_CONTROL_RATE, INA_CONTROL_BURST);
    q->n = 0;
}

/* a request the core answered INA_PUNT for, from address id src */
static inline void ina_punt_push(ina_punt_queue *q, ina_switch *sw, const uint8_t *pkt, uint32_t len, uint64_t src)
{
    if (!ina_bucket_take(&q->rate)) {
        ina_switch_count_drop(sw, INA_DROP_RATE_LIMITED);
        return;
    }
    if (len > INA_PUNT_MAX_LEN || q->n == INA_PUNT_QUEUE) {
        ina_switch_count_drop(sw, len > INA_PUNT_MAX_LEN ? INA_DROP_OVERSIZED : INA_DROP_PUNT_OVERFLOW);
        q->dropped++;
        return;
    }
    memcpy(q->buf[q->n], pkt, len);
    q->len[q->n] = len;
    q->src[q->n++] = src;
}
#endif
