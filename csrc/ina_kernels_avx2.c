/* AVX2 twins of the scalar kernels in ina_kernels_ops.h, bit for bit (tests/test_simd.py). Philox runs on 4
 * counters per ymm in 64-bit lanes (vpmuludq takes the low 32 bits, so the high halves can carry junk), two
 * ymm at a time for the latency; one draw of 8 counters feeds 32 elements (NC: 128, a byte each). Stream
 * blocks start at positions that are multiples of 4 (NC: 16); the unaligned head and the short tail run the
 * scalar loops. The target pragma compiles this file for AVX2 whatever INA_CFLAGS says; ina_simd_set only
 * picks it where the CPU has it. */
#pragma GCC target("avx2")
#include <immintrin.h>

#include "ina_kernels_ops.h"

#define BLOCK 32 /* elements per double Philox draw */
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

typedef struct {
    __m256i k0[INA_PHILOX_ROUNDS], k1[INA_PHILOX_ROUNDS];
} keys_t;

static void keys_init(keys_t *k, uint64_t seed)
{
    uint32_t a = (uint32_t)seed, b = (uint32_t)(seed >> 32);
    for (int r = 0; r < INA_PHILOX_ROUNDS; r++, a += INA_PHILOX_W0, b += INA_PHILOX_W1) {
        k->k0[r] = _mm256_set1_epi64x(a);
        k->k1[r] = _mm256_set1_epi64x(b);
    }
}

#define XOR3(a, b, c) _mm256_xor_si256(_mm256_xor_si256(a, b), c)
#define ROUND(x0, x1, x2, x3, r)                                                                                  \
    do {                                                                                                          \
        __m256i p0_ = _mm256_mul_epu32(x0, m0), p1_ = _mm256_mul_epu32(x2, m1);                                   \
        x0 = XOR3(_mm256_srli_epi64(p1_, 32), x1, k->k0[r]);                                                      \
        x2 = XOR3(_mm256_srli_epi64(p0_, 32), x3, k->k1[r]);                                                      \
        x1 = p1_, x3 = p0_;                                                                                       \
    } while (0)

/* (x0, x1) and (x2, x3) of each of 4 counters into one 64-bit lane each, then the counters in order: 8
 * words in element order per vector */
static inline void interleave(__m256i x0, __m256i x1, __m256i x2, __m256i x3, __m256i *w)
{
    __m256i a = _mm256_blend_epi32(x0, _mm256_shuffle_epi32(x1, 0xB1), 0xAA);
    __m256i b = _mm256_blend_epi32(x2, _mm256_shuffle_epi32(x3, 0xB1), 0xAA);
    __m256i lo = _mm256_unpacklo_epi64(a, b), hi = _mm256_unpackhi_epi64(a, b); /* counters 0, 2 | 1, 3 */
    w[0] = _mm256_permute2x128_si256(lo, hi, 0x20);
    w[1] = _mm256_permute2x128_si256(lo, hi, 0x31);
}

/* words at positions 4 q .. 4 q + 16 nch - 1 of sub-stream s, in order, 8 per vector, from nch chains of 4
 * counters (independent chains hide the multiplies' latency) */
static inline __attribute__((always_inline)) void philox_chains(const keys_t *k, uint64_t q, uint32_t s, __m256i *w,
                                                                const int nch)
{
    const __m256i m0 = _mm256_set1_epi64x(INA_PHILOX_M0), m1 = _mm256_set1_epi64x(INA_PHILOX_M1);
    __m256i x0[4], x1[4], x2[4], x3[4];
    for (int c = 0; c < nch; c++) {
        x0[c] = _mm256_add_epi64(_mm256_set1_epi64x((long long)(q + 4 * (uint64_t)c)), _mm256_set_epi64x(3, 2, 1, 0));
        x1[c] = _mm256_srli_epi64(x0[c], 32), x2[c] = _mm256_set1_epi64x(s), x3[c] = _mm256_setzero_si256();
    }
    for (int r = 0; r < INA_PHILOX_ROUNDS; r++)
        for (int c = 0; c < nch; c++)
            ROUND(x0[c], x1[c], x2[c], x3[c], r);
    for (int c = 0; c < nch; c++)
        interleave(x0[c], x1[c], x2[c], x3[c], w + 2 * c);
}

/* words of the 32 elements 4 q .. 4 q + 31 of sub-stream s, in element order, 8 per vector */
static inline void philox32(const keys_t *k, uint64_t q, uint32_t s, __m256i w[4]) { philox_chains(k, q, s, w, 2); }

static inline size_t head_len(uint64_t offset, size_t n)
{
    size_t h = (size_t)((4 - (offset & 3)) & 3);
    return h < n ? h : n;
}

/* uint32 lanes as exact doubles (AVX2 converts only signed: flip the top bit, add 2^31 back) */
static inline __m256d u32_pd(__m128i w)
{
    __m256d d = _mm256_cvtepi32_pd(_mm_xor_si128(w, _mm_set1_epi32((int)0x80000000u)));
    return _mm256_add_pd(d, _mm256_set1_pd(2147483648.0));
}

static inline __m128i lo128(__m256i v) { return _mm256_castsi256_si128(v); }
static inline __m128i hi128(__m256i v) { return _mm256_extracti128_si256(v, 1); }

/* 32 int32 codes (each 0..255) of 4 vectors to 32 bytes in order */
static inline void store_codes32(uint8_t *p, const __m256i c[4])
{
    __m256i a = _mm256_packus_epi32(c[0], c[1]), b = _mm256_packus_epi32(c[2], c[3]);
    __m256i v = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)p, v);
}

/* elements before the first position that is a multiple of 16 (NC: one draw's 16 bytes), at most n */
static inline size_t head16(uint64_t offset, size_t n)
{
    size_t h = (size_t)((16 - (offset & 15)) & 15);
    return h < n ? h : n;
}

/* the NC constants of one call */
typedef struct {
    __m256i abs, c80, bias, low, flip, lim, tiem; /* dword lanes (nc_rare32) */
    __m256i ebias, s80, elow, espan1;              /* byte lanes (nc_encode32) */
} nc_consts;

/* word of sub-stream s at each of 8 positions (pos[l], any), as Philox on 2 x 4 counters */
static void philox_at8(const keys_t *k, const uint64_t pos[8], uint32_t s, uint32_t out[8])
{
    const __m256i m0 = _mm256_set1_epi64x(INA_PHILOX_M0), m1 = _mm256_set1_epi64x(INA_PHILOX_M1);
    __m256i pa = _mm256_loadu_si256((const __m256i *)pos), pb = _mm256_loadu_si256((const __m256i *)(pos + 4));
    __m256i a0 = _mm256_srli_epi64(pa, 2), a1 = _mm256_srli_epi64(pa, 34), a2 = _mm256_set1_epi64x(s);
    __m256i a3 = _mm256_setzero_si256();
    __m256i b0 = _mm256_srli_epi64(pb, 2), b1 = _mm256_srli_epi64(pb, 34), b2 = a2, b3 = a3;
    for (int r = 0; r < INA_PHILOX_ROUNDS; r++) {
        ROUND(a0, a1, a2, a3, r);
        ROUND(b0, b1, b2, b3, r);
    }
    const __m256i three = _mm256_set1_epi64x(3), one = _mm256_set1_epi64x(1), two = _mm256_set1_epi64x(2);
    __m256i sa = _mm256_and_si256(pa, three), sb = _mm256_and_si256(pb, three);
    __m256i ra = _mm256_blendv_epi8(a0, a1, _mm256_cmpeq_epi64(sa, one));
    ra = _mm256_blendv_epi8(ra, a2, _mm256_cmpeq_epi64(sa, two));
    ra = _mm256_blendv_epi8(ra, a3, _mm256_cmpeq_epi64(sa, three));
    __m256i rb = _mm256_blendv_epi8(b0, b1, _mm256_cmpeq_epi64(sb, one));
    rb = _mm256_blendv_epi8(rb, b2, _mm256_cmpeq_epi64(sb, two));
    rb = _mm256_blendv_epi8(rb, b3, _mm256_cmpeq_epi64(sb, three));
    const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    _mm_storeu_si128((__m128i *)out, lo128(_mm256_permutevar8x32_epi32(ra, pick)));
    _mm_storeu_si128((__m128i *)(out + 4), lo128(_mm256_permutevar8x32_epi32(rb, pick)));
}

static __attribute__((noinline)) void nc_flush(nc_pending *p, const keys_t *k, int floor, int det, uint32_t *err)
{
    uint32_t w1[8] = {0};
    if (!p->n) /* the end of a call with nothing queued (most per-packet calls) */
        return;
    if (!det)
        philox_at8(k, p->pos, INA_SUB_EXTRA, w1);
    ina_nc_pending_write(p, w1, floor, det, err);
}

/* queue element e of a group at pos0 (its bits, its byte) for nc_flush, flushing a full queue */
static inline void nc_push(nc_pending *p, const float *x, uint8_t *codes, uint64_t pos0, unsigned e, uint32_t h,
                           const keys_t *k, int floor, int det, uint32_t *err)
{
    if (ina_nc_pending_add(p, x, codes, pos0, e, h))
        nc_flush(p, k, floor, det, err);
}

/* NC codes of 8 lanes below the floor (mask below, all ones per lane): 2^floor iff word1 < |x| 2^(32 - floor) */
static inline __m256i nc_below8(__m256i code, __m256i below, __m256i xv, __m256i w1, int floor, int det,
                                uint32_t *err)
{
    __m256 ax = _mm256_castsi256_ps(_mm256_and_si256(xv, _mm256_set1_epi32(0x7FFFFFFF)));
    const __m256d scale = _mm256_set1_pd(ina_pow2(32 - floor)), half = _mm256_set1_pd(2147483648.0);
    __m256d tl = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(ax)), scale);
    __m256d th = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(ax, 1)), scale);
    __m256d ul = det ? _mm256_cmp_pd(tl, half, _CMP_GE_OQ) : _mm256_cmp_pd(u32_pd(lo128(w1)), tl, _CMP_LT_OQ);
    __m256d uh = det ? _mm256_cmp_pd(th, half, _CMP_GE_OQ) : _mm256_cmp_pd(u32_pd(hi128(w1)), th, _CMP_LT_OQ);
    /* the 4 + 4 double masks as 8 dword masks */
    const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m128i l = lo128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(ul), pick));
    __m128i h = lo128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(uh), pick));
    __m256i up = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(l), h, 1), below);
    *err |= (!_mm256_testz_si256(up, up) && floor > INA_NC_LEVEL_MAX) ? INA_NC_FLAG_OVERFLOW : 0u;
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(xv, 24), _mm256_set1_epi32(0x80));
    __m256i v = _mm256_and_si256(_mm256_or_si256(_mm256_set1_epi32(floor + INA_NC_BIAS), sign), up);
    return _mm256_and_si256(_mm256_blendv_epi8(code, v, below), _mm256_set1_epi32(0xFF));
}

/* 32 codes of a group with a lane outside [2^floor, 2^63) or a tie (the byte leaves the carry to word1), the
 * long way, in dword lanes from the bytes (element order in wj). Zeros are 0 whatever the draw. A few lanes
 * that need their word1 (ties, nonzero values below the floor) or their flags (NaN/Inf, overflow) are queued
 * for nc_flush; more (a run of small values) take the group's 32 word1s from one draw, every lane in vector
 * lanes (the uniform h << 15 | word1 >> 17 for all, nc_below8 below the floor). */
static __attribute__((noinline)) void nc_rare32(const float *x, __m256i wj, uint8_t *codes, uint64_t pos0,
                                                int floor, int det, const nc_consts *K, nc_pending *p,
                                                const keys_t *k, uint32_t *err)
{
    __m128i lo = lo128(wj), hi = hi128(wj);
    const __m128i hq[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
    __m256i c[4];
    int need[4], count = 0;
    for (int v = 0; v < 4; v++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 8 * v)), b = _mm256_and_si256(xv, K->abs);
        __m256i u = det ? _mm256_set1_epi32(0x400000) : _mm256_slli_epi32(_mm256_cvtepu8_epi32(hq[v]), 15);
        __m256i t = _mm256_add_epi32(b, u);
        __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(t, 23), K->bias);
        c[v] = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(xv, 24), K->c80));
        /* unsigned b - low > span - 1, as a signed compare of both sides with the top bit flipped */
        __m256i out = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_sub_epi32(b, K->low), K->flip), K->lim);
        __m256i tie = det ? _mm256_setzero_si256() : _mm256_cmpeq_epi32(_mm256_and_si256(t, K->tiem), K->tiem);
        __m256i zero = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
        c[v] = _mm256_andnot_si256(zero, c[v]); /* 0 never rounds up */
        need[v] = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(zero, _mm256_or_si256(out, tie))));
        count += __builtin_popcount((unsigned)need[v]);
    }
    if (!det && count <= 3) {
        store_codes32(codes, c);
        uint8_t h[32];
        _mm256_storeu_si256((__m256i *)h, wj);
        for (int v = 0; v < 4; v++)
            for (int m = need[v]; m; m &= m - 1) {
                unsigned e = 8 * (unsigned)v + (unsigned)__builtin_ctz((unsigned)m);
                nc_push(p, x, codes, pos0, e, h[e], k, floor, det, err);
            }
        return;
    }
    __m256i w1[4] = {_mm256_setzero_si256()};
    if (!det)
        philox32(k, pos0 >> 2, INA_SUB_EXTRA, w1); /* positions pos0 .. pos0 + 31 (pos0 % 16 == 0) */
    for (int v = 0; v < 4; v++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 8 * v)), b = _mm256_and_si256(xv, K->abs);
        __m256i u = det ? _mm256_set1_epi32(0x400000)
                        : _mm256_or_si256(_mm256_slli_epi32(_mm256_cvtepu8_epi32(hq[v]), 15), _mm256_srli_epi32(w1[v], 17));
        __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(b, u), 23), K->bias);
        code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(xv, 24), K->c80));
        __m256i bad = _mm256_cmpgt_epi32(b, _mm256_set1_epi32(0x7F7FFFFF));
        __m256i over = _mm256_cmpgt_epi32(b, _mm256_set1_epi32(((INA_NC_LEVEL_MAX + 127) << 23) - 1));
        *err |= (_mm256_testz_si256(bad, bad) ? 0u : INA_NC_FLAG_NONFINITE) |
                (_mm256_testz_si256(over, over) ? 0u : INA_NC_FLAG_OVERFLOW);
        __m256i below = _mm256_cmpgt_epi32(K->low, b);
        __m256i nz = _mm256_andnot_si256(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()), below);
        code = _mm256_andnot_si256(below, code); /* zeros stay 0 */
        c[v] = _mm256_testz_si256(nz, nz) ? code : nc_below8(code, nz, xv, w1[v], floor, det, err);
    }
    store_codes32(codes, c);
}

/* 32 NC codes of x from their bytes wj (element order) in byte lanes: per element the mantissa's top 8 bits M
 * and the exponent E (bytes 2 and 3 of |x| << 1) and the sign, gathered 32 to a vector in the order of
 * packs (128-bit lane L, source vector v, element j at byte 16 L + 4 v + j: element 8 v + 4 L + j); M + h
 * carries (the round-up) iff it saturates to another value than it wraps to. A group with a tie (M + h =
 * 0xFF) or an exponent outside [floor, 63) goes to nc_rare32. */
static inline __attribute__((always_inline)) void nc_encode32(const float *x, __m256i wj, uint8_t *codes,
                                                              uint64_t pos0, int floor, int det, const nc_consts *K,
                                                              nc_pending *p, const keys_t *k, uint32_t *err)
{
    const __m256i pick = _mm256_setr_epi8(2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                          2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i xv[4], me[4];
    for (int v = 0; v < 4; v++) {
        xv[v] = _mm256_loadu_si256((const __m256i *)(x + 8 * v));
        me[v] = _mm256_shuffle_epi8(_mm256_slli_epi32(xv[v], 1), pick); /* dword 0: 4 M, dword 1: 4 E */
    }
    __m256i ab = _mm256_unpacklo_epi32(me[0], me[1]), cd = _mm256_unpacklo_epi32(me[2], me[3]);
    __m256i M = _mm256_unpacklo_epi64(ab, cd), E = _mm256_unpackhi_epi64(ab, cd);
    __m256i neg = _mm256_packs_epi16(_mm256_packs_epi32(xv[0], xv[1]), _mm256_packs_epi32(xv[2], xv[3]));
    __m256i h = det ? _mm256_set1_epi8((char)0x80) /* 2^22: round half up */
                    : _mm256_permutevar8x32_epi32(wj, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    __m256i sum = _mm256_add_epi8(M, h);
    __m256i stay = _mm256_cmpeq_epi8(_mm256_adds_epu8(M, h), sum); /* -1 where no carry */
    __m256i code = _mm256_add_epi8(_mm256_add_epi8(E, stay), K->ebias);
    code = _mm256_or_si256(code, _mm256_and_si256(neg, K->s80));
    /* E - low as an unsigned byte is below span for every lane in range (a lower E wraps above it) */
    __m256i out = _mm256_subs_epu8(_mm256_sub_epi8(E, K->elow), K->espan1);
    __m256i tie = det ? _mm256_setzero_si256() : _mm256_cmpeq_epi8(sum, _mm256_set1_epi8(-1));
    __m256i rare = _mm256_or_si256(out, tie);
    if (__builtin_expect(_mm256_testz_si256(rare, rare), 1)) {
        _mm256_storeu_si256((__m256i *)codes,
                            _mm256_permutevar8x32_epi32(code, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    } else if (_mm256_testz_si256(out, out)) { /* ties only (one group in 8.5): stored, then queued */
        _mm256_storeu_si256((__m256i *)codes,
                            _mm256_permutevar8x32_epi32(code, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        uint8_t hb[32];
        _mm256_storeu_si256((__m256i *)hb, wj);
        for (unsigned m = (unsigned)_mm256_movemask_epi8(tie); m; m &= m - 1) {
            unsigned b = (unsigned)__builtin_ctz(m); /* packed byte 16 L + 4 v + j: element 8 v + 4 L + j */
            unsigned e = 8 * ((b >> 2) & 3) + 4 * (b >> 4) + (b & 3);
            nc_push(p, x, codes, pos0, e, hb[e], k, floor, det, err);
        }
    } else {
        nc_rare32(x, wj, codes, pos0, floor, det, K, p, k, err);
    }
}

/* NC reads a byte of the main stream per element (ina_ncmath.h): one double Philox draw (8 counters, 32 words)
 * feeds 128 elements, from a position that is a multiple of 16 */
static uint32_t nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int det,
                          int floor)
{
    if (floor >= INA_NC_LEVEL_MAX) /* every finite value is at the top level, below the floor or overflows */
        return ina_scalar_nc_encode(x, n, codes, seed, offset, det, floor);
    size_t i = head16(offset, n);
    uint32_t err = ina_scalar_nc_encode(x, i, codes, seed, offset, det, floor);
    keys_t k;
    keys_init(&k, seed);
    nc_consts K;
    K.abs = _mm256_set1_epi32(0x7FFFFFFF), K.c80 = _mm256_set1_epi32(0x80);
    K.bias = _mm256_set1_epi32(127 - INA_NC_BIAS), K.tiem = _mm256_set1_epi32(0x7F8000);
    K.low = _mm256_set1_epi32(floor + 127 >= 255 ? 0x7F800000 : (floor + 127) << 23);
    /* b - low as signed is in [0, 2^63 - low) for every normal lane: one signed compare finds the others */
    const __m256i span = _mm256_sub_epi32(_mm256_set1_epi32((INA_NC_LEVEL_MAX + 127) << 23), K.low);
    K.flip = _mm256_set1_epi32((int)0x80000000u);
    K.lim = _mm256_xor_si256(_mm256_sub_epi32(span, _mm256_set1_epi32(1)), K.flip);
    K.ebias = _mm256_set1_epi8((char)(1 - (127 - INA_NC_BIAS))), K.s80 = _mm256_set1_epi8((char)0x80);
    K.elow = _mm256_set1_epi8((char)(floor + 127));
    K.espan1 = _mm256_set1_epi8((char)(INA_NC_LEVEL_MAX + 127 - (floor + 127) - 1));
    nc_pending p;
    memset(&p, 0, sizeof p);
    for (; n - i >= 8 * BLOCK; i += 8 * BLOCK) { /* four Philox chains at a time */
        __m256i w[8] = {_mm256_setzero_si256()};
        if (!det)
            philox_chains(&k, (offset + i) >> 4, INA_SUB_MAIN, w, 4); /* words at positions (offset + i) / 4 .. */
        for (int j = 0; j < 8; j++)
            nc_encode32(x + i + 32 * j, w[j], codes + i + 32 * j, offset + i + 32 * j, floor, det, &K, &p, &k, &err);
    }
    for (; n - i >= 4 * BLOCK; i += 4 * BLOCK) {
        __m256i w[4] = {_mm256_setzero_si256()};
        if (!det)
            philox32(&k, (offset + i) >> 4, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++)
            nc_encode32(x + i + 32 * j, w[j], codes + i + 32 * j, offset + i + 32 * j, floor, det, &K, &p, &k, &err);
    }
    nc_flush(&p, &k, floor, det, &err);
    return err | ina_scalar_nc_encode(x + i, n - i, codes + i, seed, offset + i, det, floor);
}

/* NC decode of the whole 32-code groups of codes, stored plainly or (stream) by 32-byte streaming stores;
 * returns the groups' count of elements, sets *bad if one holds the invalid code */
static inline __attribute__((always_inline)) size_t nc_decode32s(const uint8_t *codes, size_t n, float *out,
                                                                  const int stream, uint32_t *bad)
{
    size_t i = 0;
    __m256i invalid = _mm256_setzero_si256();
    const __m256i m7f = _mm256_set1_epi32(0x7F), c80 = _mm256_set1_epi32(0x80);
    const __m256i e0 = _mm256_set1_epi32(127 - INA_NC_BIAS), s80 = _mm256_set1_epi8((char)0x80);
    for (; n - i >= 32; i += 32) {
        __m256i c8 = _mm256_loadu_si256((const __m256i *)(codes + i));
        invalid = _mm256_or_si256(invalid, _mm256_cmpeq_epi8(c8, s80));
        for (int j = 0; j < 4; j++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i + 8 * j)));
            __m256i m = _mm256_and_si256(c, m7f);
            __m256i nz = _mm256_cmpgt_epi32(m, _mm256_setzero_si256());
            __m256i e = _mm256_and_si256(_mm256_slli_epi32(_mm256_add_epi32(m, e0), 23), nz);
            __m256i v = _mm256_or_si256(e, _mm256_slli_epi32(_mm256_and_si256(c, c80), 24));
            if (stream)
                _mm256_stream_si256((__m256i *)(out + i + 8 * j), v);
            else
                _mm256_storeu_si256((__m256i *)(out + i + 8 * j), v);
        }
    }
    *bad |= (uint32_t)!_mm256_testz_si256(invalid, invalid);
    return i;
}

static uint32_t nc_decode(const uint8_t *codes, size_t n, float *out)
{
    uint32_t bad = 0;
    size_t i = nc_decode32s(codes, n, out, 0, &bad);
    return bad | ina_scalar_nc_decode(codes + i, n - i, out + i);
}

/* nc_decode for an output larger than the caches: 32-byte streaming stores, from a line's start, so that two
 * in a row fill the line in a write-combining buffer and the output is never read for ownership (4 KiB
 * packets into a 64 MiB output: 2.3x faster than plain stores on a Xeon) */
static uint32_t nc_decode_nt(const uint8_t *codes, size_t n, float *out)
{
    if ((uintptr_t)out & 3)
        return nc_decode(codes, n, out);
    size_t h = (size_t)((64 - ((uintptr_t)out & 63)) & 63) / 4;
    h = h < n ? h : n;
    uint32_t bad = nc_decode(codes, h, out);
    size_t i = h + nc_decode32s(codes + h, n - h, out + h, 1, &bad);
    return bad | nc_decode(codes + i, n - i, out + i); /* unfenced: ina_store_fence */
}

/* clip 4 doubles to +-lim as the scalar ternary does (a NaN stays NaN: min/max return the second operand
 * on NaN), as int32 */
static inline __m128i clip_cvt(__m256d q, __m256d lim)
{
    q = _mm256_max_pd(_mm256_sub_pd(_mm256_setzero_pd(), lim), _mm256_min_pd(lim, q));
    return _mm256_cvtpd_epi32(q);
}

static inline void store_be8(uint8_t *p, __m128i lo, __m128i hi)
{
    const __m256i swap = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
                                          3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    _mm256_storeu_si256((__m256i *)p, _mm256_shuffle_epi8(v, swap));
}

static inline __m256d lo_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
static inline __m256d hi_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }

static void fixed_nearest(const float *x, size_t n, double scale, double lim, uint8_t *out_be)
{
    size_t i = 0;
    const __m256d sc = _mm256_set1_pd(scale), l = _mm256_set1_pd(lim);
    for (; n - i >= 8; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        __m256d ql = _mm256_round_pd(_mm256_mul_pd(lo_pd(xv), sc), NEAREST);
        __m256d qh = _mm256_round_pd(_mm256_mul_pd(hi_pd(xv), sc), NEAREST);
        store_be8(out_be + 4 * i, clip_cvt(ql, l), clip_cvt(qh, l));
    }
    ina_scalar_fixed_nearest(x + i, n - i, scale, lim, out_be + 4 * i);
}

/* stochastic rounding of 4 lanes: floor(t) + 1 iff word < frac(t) 2^32 */
static inline __m128i sr4(__m256d t, __m256d w, __m256d lim)
{
    __m256d lo = _mm256_round_pd(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256d thr = _mm256_mul_pd(_mm256_sub_pd(t, lo), _mm256_set1_pd(4294967296.0));
    __m256d up = _mm256_and_pd(_mm256_cmp_pd(w, thr, _CMP_LT_OQ), _mm256_set1_pd(1.0));
    return clip_cvt(_mm256_add_pd(lo, up), lim);
}

static void fixed_sr(const float *x, size_t n, double scale, double lim, uint64_t seed, uint64_t offset,
                     uint8_t *out_be)
{
    size_t i = head_len(offset, n);
    ina_scalar_fixed_sr(x, i, scale, lim, seed, offset, out_be);
    keys_t k;
    keys_init(&k, seed);
    const __m256d sc = _mm256_set1_pd(scale), l = _mm256_set1_pd(lim);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m256i w[4];
        philox32(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++) {
            __m256 xv = _mm256_loadu_ps(x + i + 8 * j);
            __m128i ql = sr4(_mm256_mul_pd(lo_pd(xv), sc), u32_pd(lo128(w[j])), l);
            __m128i qh = sr4(_mm256_mul_pd(hi_pd(xv), sc), u32_pd(hi128(w[j])), l);
            store_be8(out_be + 4 * (i + 8 * j), ql, qh);
        }
    }
    ina_scalar_fixed_sr(x + i, n - i, scale, lim, seed, offset + i, out_be + 4 * i);
}

static void fixed_value(const int32_t *sums, size_t n, double scale, float *out)
{
    size_t i = 0;
    const __m256d sc = _mm256_set1_pd(scale);
    for (; n - i >= 8; i += 8) {
        __m256i s = _mm256_loadu_si256((const __m256i *)(sums + i));
        __m128 lo = _mm256_cvtpd_ps(_mm256_div_pd(_mm256_cvtepi32_pd(lo128(s)), sc));
        __m128 hi = _mm256_cvtpd_ps(_mm256_div_pd(_mm256_cvtepi32_pd(hi128(s)), sc));
        _mm256_storeu_ps(out + i, _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1));
    }
    ina_scalar_fixed_value(sums + i, n - i, scale, out + i);
}

/* y = min(|v| / norm, 1) of 4 lanes */
static inline __m256d dither_y(__m256d v, __m256d norm)
{
    __m256d a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), v);
    return _mm256_min_pd(_mm256_div_pd(a, norm), _mm256_set1_pd(1.0));
}

/* natural dithering level of 4 lanes (ina_dither_natural) as int64, with the sign bit 0x80 */
static inline __m256i natural4(__m256d v, __m256d norm, __m128i w, int s)
{
    __m256d y = dither_y(v, norm);
    __m256i small = _mm256_castpd_si256(_mm256_cmp_pd(y, _mm256_set1_pd(ina_pow2(1 - s)), _CMP_LT_OQ));
    __m256d t = _mm256_mul_pd(y, _mm256_set1_pd(ina_pow2(s + 31)));
    __m256i small_up = _mm256_castpd_si256(_mm256_cmp_pd(u32_pd(w), t, _CMP_LT_OQ));
    __m256i yb = _mm256_castpd_si256(y);
    __m256i m = _mm256_and_si256(yb, _mm256_set1_epi64x(0xFFFFFFFFFFFFFll));
    __m256i up = _mm256_cmpgt_epi64(m, _mm256_slli_epi64(_mm256_cvtepu32_epi64(w), 20)); /* both < 2^52 */
    __m256i level = _mm256_sub_epi64(_mm256_add_epi64(_mm256_srli_epi64(yb, 52), _mm256_set1_epi64x(s - 1023)), up);
    level = _mm256_blendv_epi8(level, _mm256_and_si256(small_up, _mm256_set1_epi64x(1)), small);
    __m256i neg = _mm256_castpd_si256(_mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_LT_OQ));
    return _mm256_or_si256(level, _mm256_and_si256(neg, _mm256_set1_epi64x(0x80)));
}

/* standard dithering level of 4 lanes (ina_dither_standard) as int64, with the sign bit 0x8000 */
static inline __m256i standard4(__m256d v, __m256d norm, __m128i w, int s)
{
    const __m256d ds = _mm256_set1_pd((double)s), one = _mm256_set1_pd(1.0);
    __m256d y = dither_y(v, norm);
    __m256d hi = _mm256_round_pd(_mm256_mul_pd(y, ds), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    hi = _mm256_min_pd(_mm256_max_pd(hi, one), ds);
    __m256d lo = _mm256_sub_pd(hi, one); /* the answer is within one of hi (ina_ncmath.h) */
    __m256d down = _mm256_and_pd(_mm256_cmp_pd(hi, one, _CMP_GT_OQ),
                                 _mm256_cmp_pd(_mm256_div_pd(lo, ds), y, _CMP_GE_OQ));
    hi = _mm256_sub_pd(hi, _mm256_and_pd(down, one));
    __m256d upm = _mm256_and_pd(_mm256_cmp_pd(hi, ds, _CMP_LT_OQ), _mm256_cmp_pd(_mm256_div_pd(hi, ds), y, _CMP_LT_OQ));
    hi = _mm256_add_pd(hi, _mm256_and_pd(upm, one));
    __m256d tlo = _mm256_div_pd(_mm256_sub_pd(hi, one), ds), thi = _mm256_div_pd(hi, ds);
    __m256d p = _mm256_div_pd(_mm256_sub_pd(y, tlo), _mm256_sub_pd(thi, tlo));
    __m256d u = _mm256_mul_pd(u32_pd(w), _mm256_set1_pd(2.3283064365386963e-10));
    __m256d stay = _mm256_cmp_pd(u, p, _CMP_NLT_UQ);
    __m128i level = _mm256_cvtpd_epi32(_mm256_sub_pd(hi, _mm256_and_pd(stay, one)));
    __m256i l64 = _mm256_cvtepi32_epi64(level);
    __m256i neg = _mm256_castpd_si256(_mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_LT_OQ));
    return _mm256_or_si256(l64, _mm256_and_si256(neg, _mm256_set1_epi64x(0x8000)));
}

/* two vectors of 4 int64 (each 0..65535) as 8 int32 in order */
static inline __m256i narrow8(__m256i a, __m256i b)
{
    const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m128i l = lo128(_mm256_permutevar8x32_epi32(a, pick)), h = lo128(_mm256_permutevar8x32_epi32(b, pick));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(l), h, 1);
}

/* dithering codes of the 8 elements at x (words w): int32 lanes in order */
static inline __m256i dither8(const float *x, __m256d nv, __m256i w, int s, int standard)
{
    __m256 xv = _mm256_loadu_ps(x);
    if (standard)
        return narrow8(standard4(lo_pd(xv), nv, lo128(w), s), standard4(hi_pd(xv), nv, hi128(w), s));
    return narrow8(natural4(lo_pd(xv), nv, lo128(w), s), natural4(hi_pd(xv), nv, hi128(w), s));
}

static void dither_natural(const float *x, size_t n, double norm, int s, uint64_t seed, uint64_t offset,
                           uint8_t *codes)
{
    size_t i = head_len(offset, n);
    ina_scalar_dither_natural(x, i, norm, s, seed, offset, codes);
    keys_t k;
    keys_init(&k, seed);
    const __m256d nv = _mm256_set1_pd(norm);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m256i w[4], c[4];
        philox32(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++)
            c[j] = dither8(x + i + 8 * j, nv, w[j], s, 0);
        store_codes32(codes + i, c);
    }
    ina_scalar_dither_natural(x + i, n - i, norm, s, seed, offset + i, codes + i);
}

static void dither_standard(const float *x, size_t n, double norm, int s, uint64_t seed, uint64_t offset,
                            uint16_t *codes)
{
    size_t i = head_len(offset, n);
    ina_scalar_dither_standard(x, i, norm, s, seed, offset, codes);
    keys_t k;
    keys_init(&k, seed);
    const __m256d nv = _mm256_set1_pd(norm);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m256i w[4];
        philox32(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j += 2) {
            __m256i a = dither8(x + i + 8 * j, nv, w[j], s, 1), b = dither8(x + i + 8 * j + 8, nv, w[j + 1], s, 1);
            __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
            _mm256_storeu_si256((__m256i *)(codes + i + 8 * j), v);
        }
    }
    ina_scalar_dither_standard(x + i, n - i, norm, s, seed, offset + i, codes + i);
}

static void philox_fill(uint64_t seed, uint64_t offset, size_t n, uint32_t s, uint32_t *out)
{
    size_t i = head_len(offset, n);
    ina_scalar_philox_fill(seed, offset, i, s, out);
    keys_t k;
    keys_init(&k, seed);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m256i w[4];
        philox32(&k, (offset + i) >> 2, s, w);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(out + i + 8 * j), w[j]);
    }
    ina_scalar_philox_fill(seed, offset + i, n - i, s, out + i);
}

/* a result's big-endian sums into a large output: 32-byte streaming stores from out's first whole line, two a
 * line, so the output is never read for ownership (the int32 worker loop's, as nc_decode_nt is NC's) */
static void int32_unwire_nt(const uint8_t *be, size_t n, int32_t *out)
{
    const __m256i swap = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
                                          3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    size_t i = (uintptr_t)out & 3 ? n : (size_t)((64 - ((uintptr_t)out & 63)) & 63) / 4;
    i = i < n ? i : n;
    ina_scalar_int32_unwire(be, i, out);
    for (; n - i >= 16; i += 16) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(be + 4 * i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(be + 4 * i + 32));
        _mm256_stream_si256((__m256i *)(out + i), _mm256_shuffle_epi8(a, swap));
        _mm256_stream_si256((__m256i *)(out + i + 8), _mm256_shuffle_epi8(b, swap));
    }
    ina_scalar_int32_unwire(be + 4 * i, n - i, out + i); /* unfenced: ina_store_fence */
}

const ina_kernel_ops ina_ops_avx2 = {
    "avx2", nc_encode, nc_decode, fixed_nearest, fixed_sr, fixed_value, dither_natural, dither_standard,
    philox_fill, nc_decode_nt, int32_unwire_nt,
};
