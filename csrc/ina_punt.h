/* The queue of control requests (join, leave, abort, heartbeat, stats) a C loop hands up to the control
 * plane (switchsim/control.py). Members first, as control.py: a member's request (its rank, from the address
 * it joined from) is queued before any budget, and half the queue is kept for members; everyone else's
 * goes through a token bucket of its source address (a small table, hashed) and one shared by all
 * strangers, on the monotonic clock: a stranger's flood is dropped here, in C, at the cost of any small
 * datagram, and never crowds out a member's heartbeat. Every request it drops is counted in the core's drops
 * (rate_limited, oversized, punt_overflow), so the switch's packets_in stays the sum of its outcomes.
 * INA_CONTROL_RATE/BURST and INA_SOURCE_RATE/BURST come from inaproto/timers.py (ina_wire.h, generated).
 * Header-only, shared by the UDP, shared-memory and DPDK loops. */
#ifndef INA_PUNT_H
#define INA_PUNT_H
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "ina_core.h"

#define INA_SOURCE_BUCKETS 4096 /* per-source budgets, by hash (a collision shares one: never a member's) */
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
    ina_bucket rate; /* every stranger together */
    ina_bucket source[INA_SOURCE_BUCKETS];
    uint64_t source_id[INA_SOURCE_BUCKETS]; /* the address a bucket was last used for */
    uint8_t buf[INA_PUNT_QUEUE][INA_PUNT_MAX_LEN];
    uint32_t len[INA_PUNT_QUEUE];
    uint64_t src[INA_PUNT_QUEUE]; /* address ids: IPv4 << 16 | port */
    int n;
    uint64_t dropped; /* queue full or too long (also in the core's drops: punt_overflow, oversized) */
} ina_punt_queue;

static inline void ina_punt_init(ina_punt_queue *q)
{
    ina_bucket_init(&q->rate, INA_CONTROL_RATE, INA_CONTROL_BURST);
    memset(q->source_id, 0, sizeof q->source_id);
    for (int i = 0; i < INA_SOURCE_BUCKETS; i++)
        ina_bucket_init(&q->source[i], INA_SOURCE_RATE, INA_SOURCE_BURST);
    q->n = 0;
}

/* a stranger's budget: its address's bucket (a fresh one where the slot held another address) */
static inline ina_bucket *ina_punt_source(ina_punt_queue *q, uint64_t src)
{
    uint64_t h = src * 0x9E3779B97F4A7C15ull;
    uint32_t i = (uint32_t)(h >> 52) & (INA_SOURCE_BUCKETS - 1);
    if (q->source_id[i] != src) {
        q->source_id[i] = src;
        ina_bucket_init(&q->source[i], INA_SOURCE_RATE, INA_SOURCE_BURST);
    }
    return &q->source[i];
}

/* a request the core answered INA_PUNT for, from address id src */
static inline void ina_punt_push(ina_punt_queue *q, ina_switch *sw, const uint8_t *pkt, uint32_t len, uint64_t src)
{
    int member = ina_switch_is_member(sw, pkt, len, src);
    if (!member && !(ina_bucket_take(ina_punt_source(q, src)) && ina_bucket_take(&q->rate))) {
        ina_switch_count_drop(sw, INA_DROP_RATE_LIMITED);
        return;
    }
    if (len > INA_PUNT_MAX_LEN || q->n == INA_PUNT_QUEUE || (!member && q->n >= INA_PUNT_QUEUE / 2)) {
        ina_switch_count_drop(sw, len > INA_PUNT_MAX_LEN ? INA_DROP_OVERSIZED : INA_DROP_PUNT_OVERFLOW);
        q->dropped++;
        return;
    }
    memcpy(q->buf[q->n], pkt, len);
    q->len[q->n] = len;
    q->src[q->n++] = src;
}
#endif
