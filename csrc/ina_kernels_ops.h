/* Internal to the codec kernels: one table of range functions per instruction set (scalar, AVX2, AVX-512),
 * and the scalar range loops, which are the C reference every SIMD path must match bit for bit and which the
 * SIMD files also run on their unaligned heads and short tails. Not part of the cffi interface. */
#ifndef INA_KERNELS_OPS_H
#define INA_KERNELS_OPS_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ina_ncmath.h"

typedef struct {
    const char *name;
    /* NC codes of float32 x, stream positions offset.., floor clamped; returns INA_NC_FLAG_* bits */
    uint32_t (*nc_encode)(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int det,
                          int floor);
    /* float32 values of NC codes; returns nonzero if any code is 0x80 */
    uint32_t (*nc_decode)(const uint8_t *codes, size_t n, float *out);
    /* big-endian int32 of fixed point, to nearest (seed unused) or stochastic */
    void (*fixed_nearest)(const float *x, size_t n, double scale, double lim, uint8_t *out_be);
    void (*fixed_sr)(const float *x, size_t n, double scale, double lim, uint64_t seed, uint64_t offset,
                     uint8_t *out_be);
    /* float32 of int32 sums at one scale (a run within one block) */
    void (*fixed_value)(const int32_t *sums, size_t n, double scale, float *out);
    /* dithering level codes of float32 x (sign at bit 7 / bit 15) */
    void (*dither_natural)(const float *x, size_t n, double norm, int s, uint64_t seed, uint64_t offset,
                           uint8_t *codes);
    void (*dither_standard)(const float *x, size_t n, double norm, int s, uint64_t seed, uint64_t offset,
                            uint16_t *codes);
    /* the stream's words alone (tests, and the benchmark's cost of the draws) */
    void (*philox_fill)(uint64_t seed, uint64_t offset, size_t n, uint32_t s, uint32_t *out);
    /* nc_decode for outputs larger than the caches: no read for ownership of out's lines (streaming stores) */
    uint32_t (*nc_decode_nt)(const uint8_t *codes, size_t n, float *out);
    /* native int32 of big-endian int32 (a result's sums), by streaming stores where out is 4-byte aligned */
    void (*int32_unwire_nt)(const uint8_t *be, size_t n, int32_t *out);
} ina_kernel_ops;

extern const ina_kernel_ops ina_ops_scalar, ina_ops_avx2, ina_ops_avx512;

/* The SIMD NC encoders' queue of elements whose code waits for their word1 (ties, nonzero values below the
 * floor) or whose flags are wanted (NaN/Inf, overflow): their codes are written eight at a time, the eight
 * word1s from one Philox pass over arbitrary positions (each file's philox_at8). */
typedef struct {
    uint64_t pos[8];
    uint8_t *code[8];
    uint32_t bits[8], h[8];
    int n;
} nc_pending;

/* queue element e of a group at stream position pos0 (its bits, its byte); 1 when the queue is full */
static inline int ina_nc_pending_add(nc_pending *p, const float *x, uint8_t *codes, uint64_t pos0, unsigned e,
                                     uint32_t h)
{
    p->pos[p->n] = pos0 + e, p->code[p->n] = codes + e;
    memcpy(&p->bits[p->n], x + e, 4);
    p->h[p->n] = h;
    return ++p->n == 8;
}

/* the queued elements' codes from their word1s (w1[l]: 0 where deterministic); the queue is empty after */
static inline void ina_nc_pending_write(nc_pending *p, const uint32_t w1[8], int floor, int det, uint32_t *err)
{
    for (int l = 0; l < p->n; l++)
        *p->code[l] = (uint8_t)ina_nc_code_f32(p->bits[l], p->h[l], w1[l], floor, det, err);
    p->n = 0;
}

static inline uint32_t ina_load_u32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline void ina_store_be32(uint8_t *p, int32_t q)
{
    uint32_t v = __builtin_bswap32((uint32_t)q);
    memcpy(p, &v, 4);
}

/* A cursor over one sub-stream: the word of position pos, drawing once per 4 positions. */
typedef struct {
    uint64_t seed, q;
    uint32_t s, w[4];
    int valid;
} ina_stream;

static inline uint32_t ina_stream_word(ina_stream *st, uint64_t pos)
{
    if (!st->valid || st->q != pos >> 2) {
        st->q = pos >> 2;
        st->valid = 1;
        ina_philox_draw(st->seed, st->q, st->s, st->w);
    }
    return st->w[pos & 3];
}

static inline void ina_scalar_philox_fill(uint64_t seed, uint64_t offset, size_t n, uint32_t s, uint32_t *out)
{
    ina_stream st = {seed, 0, s, {0, 0, 0, 0}, 0};
    for (size_t i = 0; i < n; i++)
        out[i] = ina_stream_word(&st, offset + i);
}

static inline uint32_t ina_scalar_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed,
                                            uint64_t offset, int det, int floor)
{
    ina_stream st = {seed, 0, INA_SUB_MAIN, {0, 0, 0, 0}, 0};
    uint32_t err = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t p = offset + i;
        uint32_t h = det ? 0 : ina_nc_byte(ina_stream_word(&st, p >> 2), p); /* a byte per element */
        codes[i] = (uint8_t)ina_nc_code_f32_lazy(ina_load_u32(x + i), h, seed, p, floor, det, &err);
    }
    return err;
}

static inline uint32_t ina_scalar_nc_decode(const uint8_t *codes, size_t n, float *out)
{
    uint32_t invalid = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = ina_nc_decode_bits(codes[i]);
        invalid |= codes[i] == 0x80;
        memcpy(out + i, &b, 4);
    }
    return invalid;
}

static inline void ina_scalar_fixed_nearest(const float *x, size_t n, double scale, double lim, uint8_t *out_be)
{
    for (size_t i = 0; i < n; i++)
        ina_store_be32(out_be + 4 * i, ina_fixed_nearest(x[i], scale, lim));
}

static inline void ina_scalar_fixed_sr(const float *x, size_t n, double scale, double lim, uint64_t seed,
                                       uint64_t offset, uint8_t *out_be)
{
    ina_stream st = {seed, 0, INA_SUB_MAIN, {0, 0, 0, 0}, 0};
    for (size_t i = 0; i < n; i++)
        ina_store_be32(out_be + 4 * i, ina_fixed_sr(x[i], scale, lim, ina_stream_word(&st, offset + i)));
}

static inline void ina_scalar_int32_unwire(const uint8_t *be, size_t n, int32_t *out)
{
    for (size_t i = 0; i < n; i++) /* the compiler vectorises it */
        out[i] = (int32_t)__builtin_bswap32(ina_load_u32(be + 4 * i));
}

static inline void ina_scalar_fixed_value(const int32_t *sums, size_t n, double scale, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = ina_fixed_value(sums[i], scale);
}

static inline void ina_scalar_dither_natural(const float *x, size_t n, double norm, int s, uint64_t seed,
                                             uint64_t offset, uint8_t *codes)
{
    ina_stream st = {seed, 0, INA_SUB_MAIN, {0, 0, 0, 0}, 0};
    for (size_t i = 0; i < n; i++) {
        double v = (double)x[i];
        uint32_t j = ina_dither_natural(ina_dither_y(v, norm), s, ina_stream_word(&st, offset + i));
        codes[i] = (uint8_t)(j | (v < 0 ? 0x80u : 0u));
    }
}

static inline void ina_scalar_dither_standard(const float *x, size_t n, double norm, int s, uint64_t seed,
                                              uint64_t offset, uint16_t *codes)
{
    ina_stream st = {seed, 0, INA_SUB_MAIN, {0, 0, 0, 0}, 0};
    for (size_t i = 0; i < n; i++) {
        double v = (double)x[i];
        uint32_t j = ina_dither_standard(ina_dither_y(v, norm), s, ina_stream_word(&st, offset + i));
        codes[i] = (uint16_t)(j | (v < 0 ? 0x8000u : 0u));
    }
}
#endif
