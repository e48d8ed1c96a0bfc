/* The switch's per-lane arithmetic (model: inaproto/nc.py codes_to_int / int_to_codes, and int32 sums),
 * written once per element for the scalar path and the SIMD tails, and as a table of block functions so
 * ina_core.c picks scalar, AVX2 or AVX-512 once per switch (ina_core_simd.c; INA_SWITCH_SIMD forces one).
 * Every path must give the same bytes and flags as the scalar one: tests/test_native.py replays traffic
 * through each forced path against the model. */
#ifndef INA_CORE_LANES_H
#define INA_CORE_LANES_H
#include <stdint.h>

#include "ina_packet.h"
#include "ina_rng.h"

typedef struct {
    const char *name;
    /* v[i] (+)= big-endian int32 element i */
    void (*int32_values)(const uint8_t *p, uint32_t n, int64_t *v, int add);
    /* res = acc wrapped to big-endian int32; nonzero if any sum left int32's range */
    int (*int32_finish)(const int64_t *acc, uint32_t n, uint8_t *res);
    /* 0 if a code is outside [floor, top] (zero aside): the caller checks first, v untouched */
    int (*nc_valid)(const uint8_t *p, uint32_t n, int floor, int top);
    /* v[i] (+)= the code's integer 2^(level - floor) with its sign (codes already valid) */
    void (*nc_values)(const uint8_t *p, uint32_t n, int floor, int64_t *v, int add);
    /* sums -> codes with the switch's rounding (word base + i of the stream keyed key); nonzero on overflow */
    int (*nc_finish)(const int64_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                     uint8_t *res);
    /* nc_values (add) of the round's last packet and nc_finish in one pass, acc left as it was (the round's
     * sums are not stored: the result is); NULL: ina_core.c composes the two on chunks */
    int (*nc_add_finish)(const uint8_t *p, const int64_t *acc, uint32_t n, int floor, int det, uint64_t key,
                         uint64_t base, uint8_t *res);
    /* narrow NC rounds (ina_core.c): the same three on int32 sums counted from the round's narrow floor
     * (|sum| <= 2^30), twice the lanes per vector and half the memory; NULL: every round is wide */
    void (*nc_values32)(const uint8_t *p, uint32_t n, int floor, int32_t *v, int add);
    int (*nc_finish32)(const int32_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                       uint8_t *res);
    int (*nc_add_finish32)(const uint8_t *p, const int32_t *acc, uint32_t n, int floor, int det, uint64_t key,
                           uint64_t base, uint8_t *res);
    /* narrow int32 rounds (ina_core.c): v[i] (+)= element i in int32 lanes, wrapping; nonzero if an add
     * wrapped (the caller widens the round); res = acc as big-endian int32. NULL: every round is wide */
    int (*int32_values32)(const uint8_t *p, uint32_t n, int32_t *v, int add);
    void (*int32_finish32)(const int32_t *acc, uint32_t n, uint8_t *res);
    /* int32_values32 (add) of a narrow round's last packet and int32_finish32 in one pass, acc left as it was;
     * nonzero if an add wrapped (res is then not the round's: the caller adds, widens and finishes) */
    int (*int32_add_finish32)(const uint8_t *p, const int32_t *acc, uint32_t n, uint8_t *res);
} ina_lane_ops;

extern const ina_lane_ops ina_lanes_scalar, ina_lanes_avx2, ina_lanes_avx512;
/* the best path this CPU runs, or the one INA_SWITCH_SIMD names (ina_core_simd.c) */
const ina_lane_ops *ina_lanes_pick(void);

static inline int ina_nc_code_valid(uint8_t c, int floor, int top)
{
    int m = c & 0x7F;
    return m == 0 ? c == 0 : (m - INA_NC_BIAS >= floor && m - INA_NC_BIAS <= top);
}

static inline int64_t ina_nc_code_int(uint8_t c, int floor)
{
    int m = c & 0x7F;
    int64_t x = m ? (int64_t)1 << (m - INA_NC_BIAS - floor) : 0;
    return (c & 0x80) ? -x : x;
}

/* one sum s to its code: |s| = 2^a + rem rounds up with probability rem / 2^a (element ctr's uniform of the
 * paired stream, ina_rng_pair_word), or
 * deterministically when rem >= 2^(a-1); *over gets 1 if a nonzero sum's level passes INA_NC_LEVEL_MAX */
static inline uint8_t ina_nc_sum_code(int64_t s, int floor, int det, uint64_t key, uint64_t ctr, uint32_t *over)
{
    uint64_t mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    int a = 63 - __builtin_clzll(mag | 1);
    uint64_t rem = mag ^ ((uint64_t)1 << a); /* mag = 0 gives 1, harmless: a = 0 never rounds up */
    uint64_t half = (uint64_t)1 << (a > 0 ? a - 1 : 0);
    int shift = a > 0 ? 64 - a : 63;
    uint32_t up = det ? rem >= half : (ina_rng_pair_word(key, ctr) >> shift) < rem;
    up &= a > 0;
    int level = floor + a + (int)up;
    *over |= (mag != 0) & (level > INA_NC_LEVEL_MAX);
    level = level > INA_NC_LEVEL_MAX ? INA_NC_LEVEL_MAX : level;
    uint8_t code = (uint8_t)((level + INA_NC_BIAS) | (s < 0 ? 0x80 : 0));
    return mag ? code : 0;
}

/* the lowest code magnitude m valid in a block, and how many above it: m - lo <= span as unsigned bytes
 * (lo >= 1 since floor >= INA_NC_LEVEL_MIN, so m = 0 always falls outside and is checked apart) */
static inline void ina_nc_code_range(int floor, int top, uint8_t *lo, uint8_t *span)
{
    *lo = (uint8_t)(floor + INA_NC_BIAS);
    *span = (uint8_t)(top - floor);
}
#endif
