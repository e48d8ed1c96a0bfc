/* A token bucket on the monotonic clock, for the control requests a C loop hands to the control plane:
 * a flood of joins or stats requests is then dropped here, in C, at the cost of any small datagram.
 * INA_CONTROL_RATE/BURST equal switchsim/control.py's CONTROL_RATE (tests/test_native.py checks). */
#ifndef INA_BUCKET_H
#define INA_BUCKET_H
#include <time.h>

#define INA_CONTROL_RATE 2000.0
#define INA_CONTROL_BURST 200
#define INA_PUNT_MAX_LEN 512 /* longest control request: a join (INA_JOIN_SIZE) */

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
#endif
