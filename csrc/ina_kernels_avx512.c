/* AVX-512 (F, BW, DQ, VL) twins of the scalar kernels in ina_kernels_ops.h, bit for bit (tests/test_simd.py).
 * Philox runs on 8 counters per zmm in 64-bit lanes (vpmuludq takes the low 32 bits, so the high halves can
 * carry junk), two zmm at a time for the latency; one draw of 16 counters feeds 64 elements (NC: 256, a byte
 * each). Stream blocks start at positions that are multiples of 4 (NC: 16); the unaligned head and the short
 * tail run the scalar loops.
 * The target pragma compiles this file for AVX-512 whatever INA_CFLAGS says; ina_simd_set only picks it
 * where the CPU has it. */
#pragma GCC target("avx2,avx512f,avx512bw,avx512dq,avx512vl")
#include <immintrin.h>

#include "ina_kernels_ops.h"

#define BLOCK 64 /* elements per double Philox draw */
#define PREFETCH 1024 /* elements ahead (4 KiB) */
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* round keys, and the first two rounds' lane-independent parts for sub-streams 0 and 1 at one q >> 32 */
typedef struct {
    __m512i k0[INA_PHILOX_ROUNDS], k1[INA_PHILOX_ROUNDS];
    __m512i c1k[2], hk[2], lo[2]; /* per sub-stream: lo(s M1) ^ k0_1, hi(c0 M0) ^ k1_1, lo(c0 M0) */
    uint64_t qhi;
    uint32_t a, b;
} keys_t;

static void keys_at(keys_t *k, uint64_t qhi)
{
    k->qhi = qhi;
    for (uint32_t s = 0; s < 2; s++) {
        uint64_t p1 = (uint64_t)INA_PHILOX_M1 * s;
        uint32_t c0 = (uint32_t)(p1 >> 32) ^ (uint32_t)qhi ^ k->a, c1 = (uint32_t)p1;
        uint64_t p0 = (uint64_t)INA_PHILOX_M0 * c0;
        k->c1k[s] = _mm512_set1_epi64(c1 ^ (k->a + INA_PHILOX_W0));
        k->hk[s] = _mm512_set1_epi64((uint32_t)(p0 >> 32) ^ (k->b + INA_PHILOX_W1));
        k->lo[s] = _mm512_set1_epi64((uint32_t)p0);
    }
}

static void keys_init(keys_t *k, uint64_t seed)
{
    uint32_t a = (uint32_t)seed, b = (uint32_t)(seed >> 32);
    k->a = a, k->b = b;
    for (int r = 0; r < INA_PHILOX_ROUNDS; r++, a += INA_PHILOX_W0, b += INA_PHILOX_W1) {
        k->k0[r] = _mm512_set1_epi64(a);
        k->k1[r] = _mm512_set1_epi64(b);
    }
    keys_at(k, 0);
}

/* a product's high word into the low half of its lane: a swap of the halves (vpshufd runs on the shuffle
 * port, beside the multiplies; a shift would queue behind them) - the high half's junk is never read */
#define HI32(p) _mm512_shuffle_epi32(p, _MM_PERM_CDAB)
#define ROUND(x0, x1, x2, x3, r)                                                                                  \
    do {                                                                                                          \
        __m512i p0_ = _mm512_mul_epu32(x0, m0), p1_ = _mm512_mul_epu32(x2, m1);                                   \
        x0 = _mm512_ternarylogic_epi64(HI32(p1_), x1, k->k0[r], 0x96); /* three-way xor */                         \
        x2 = _mm512_ternarylogic_epi64(HI32(p0_), x3, k->k1[r], 0x96);                                             \
        x1 = p1_, x3 = p0_;                                                                                       \
    } while (0)

/* (x0, x1) and (x2, x3) of each counter into one 64-bit lane each, then the counters interleaved: 16 words
 * in element order per vector */
static inline void interleave(__m512i x0, __m512i x1, __m512i x2, __m512i x3, __m512i *w)
{
    const __m512i lo = _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0), hi = _mm512_set_epi64(15, 7, 14, 6, 13, 5, 12, 4);
    __m512i a = _mm512_mask_shuffle_epi32(x0, 0xAAAA, x1, _MM_PERM_CDAB);
    __m512i b = _mm512_mask_shuffle_epi32(x2, 0xAAAA, x3, _MM_PERM_CDAB);
    w[0] = _mm512_permutex2var_epi64(a, lo, b);
    w[1] = _mm512_permutex2var_epi64(a, hi, b);
}

/* words of the 32 nch elements 4 q .. of sub-stream s, in element order, 16 per vector, from nch chains of 8
 * counters (independent chains hide the multiplies' latency). Where q >> 32 is the same for every counter
 * (and s is 0 or 1), rounds 1 and 2 skip their lane-independent products (the counter's words 1..3 are the
 * same in every lane). */
static inline __attribute__((always_inline)) void philox_chains(keys_t *k, uint64_t q, uint32_t s, __m512i *w,
                                                                const int nch)
{
    const __m512i m0 = _mm512_set1_epi64(INA_PHILOX_M0), m1 = _mm512_set1_epi64(INA_PHILOX_M1);
    __m512i x0[4], x1[4], x2[4], x3[4];
    int r = 0;
    const int fast = s < 2 && q >> 32 == (q + 8 * (uint64_t)nch - 1) >> 32;
    if (fast && k->qhi != q >> 32)
        keys_at(k, q >> 32);
    for (int c = 0; c < nch; c++) {
        __m512i qc = _mm512_add_epi64(_mm512_set1_epi64((long long)(q + 8 * (uint64_t)c)),
                                      _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
        if (fast) {
            __m512i p = _mm512_mul_epu32(qc, m0); /* round 1 */
            __m512i t = _mm512_xor_si512(HI32(p), k->k1[0]);
            x1[c] = _mm512_mul_epu32(t, m1); /* round 2 */
            x0[c] = _mm512_xor_si512(HI32(x1[c]), k->c1k[s]);
            x2[c] = _mm512_xor_si512(p, k->hk[s]);
            x3[c] = k->lo[s];
        } else {
            x0[c] = qc, x1[c] = _mm512_srli_epi64(qc, 32), x2[c] = _mm512_set1_epi64(s), x3[c] = _mm512_setzero_si512();
        }
    }
    for (r = fast ? 2 : 0; r < INA_PHILOX_ROUNDS; r++)
        for (int c = 0; c < nch; c++)
            ROUND(x0[c], x1[c], x2[c], x3[c], r);
    for (int c = 0; c < nch; c++)
        interleave(x0[c], x1[c], x2[c], x3[c], w + 2 * c);
}

static inline void philox64(keys_t *k, uint64_t q, uint32_t s, __m512i w[4]) { philox_chains(k, q, s, w, 2); }

/* elements before the first position that is a multiple of 4 (at most 3, and at most n) */
static inline size_t head_len(uint64_t offset, size_t n)
{
    size_t h = (size_t)((4 - (offset & 3)) & 3);
    return h < n ? h : n;
}

static inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
static inline __m512d hi_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)); }
static inline __m512d lo_u32_pd(__m512i w) { return _mm512_cvtepu32_pd(_mm512_castsi512_si256(w)); }
static inline __m512d hi_u32_pd(__m512i w) { return _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(w, 1)); }

/* elements before the first position that is a multiple of 16 (NC: one draw's 16 bytes), at most n */
static inline size_t head16(uint64_t offset, size_t n)
{
    size_t h = (size_t)((16 - (offset & 15)) & 15);
    return h < n ? h : n;
}

/* word of sub-stream s at each of 8 positions (any), as Philox on 8 counters */
static void philox_at8(const keys_t *k, const uint64_t pos[8], uint32_t s, uint32_t out[8])
{
    const __m512i m0 = _mm512_set1_epi64(INA_PHILOX_M0), m1 = _mm512_set1_epi64(INA_PHILOX_M1);
    __m512i p = _mm512_loadu_si512(pos);
    __m512i x0 = _mm512_srli_epi64(p, 2), x1 = _mm512_srli_epi64(p, 34), x2 = _mm512_set1_epi64(s);
    __m512i x3 = _mm512_setzero_si512();
    for (int r = 0; r < INA_PHILOX_ROUNDS; r++)
        ROUND(x0, x1, x2, x3, r);
    __m512i sel = _mm512_and_si512(p, _mm512_set1_epi64(3));
    __m512i w = _mm512_mask_mov_epi64(x0, _mm512_cmpeq_epi64_mask(sel, _mm512_set1_epi64(1)), x1);
    w = _mm512_mask_mov_epi64(w, _mm512_cmpeq_epi64_mask(sel, _mm512_set1_epi64(2)), x2);
    w = _mm512_mask_mov_epi64(w, _mm512_cmpeq_epi64_mask(sel, _mm512_set1_epi64(3)), x3);
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi64_epi32(w));
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
                           keys_t *k, int floor, int det, uint32_t *err)
{
    if (ina_nc_pending_add(p, x, codes, pos0, e, h))
        nc_flush(p, k, floor, det, err);
}

/* NC codes of 16 lanes below the floor (mask below): 2^floor iff word1 < |x| 2^(32 - floor), else 0 */
static inline __m512i nc_below16(__m512i code, __mmask16 below, __m512i xv, __m512i w1, int floor, int det,
                                 uint32_t *err)
{
    __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(xv, _mm512_set1_epi32(0x7FFFFFFF)));
    const __m512d scale = _mm512_set1_pd(ina_pow2(32 - floor)), half = _mm512_set1_pd(2147483648.0);
    __m512d tl = _mm512_mul_pd(lo_pd(ax), scale), th = _mm512_mul_pd(hi_pd(ax), scale);
    __mmask8 ul = det ? _mm512_cmp_pd_mask(tl, half, _CMP_GE_OQ) : _mm512_cmp_pd_mask(lo_u32_pd(w1), tl, _CMP_LT_OQ);
    __mmask8 uh = det ? _mm512_cmp_pd_mask(th, half, _CMP_GE_OQ) : _mm512_cmp_pd_mask(hi_u32_pd(w1), th, _CMP_LT_OQ);
    __mmask16 up = (__mmask16)(ul | (uh << 8)) & below;
    *err |= (up && floor > INA_NC_LEVEL_MAX) ? INA_NC_FLAG_OVERFLOW : 0u;
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(xv, 24), _mm512_set1_epi32(0x80));
    __m512i v = _mm512_maskz_or_epi32(up, _mm512_set1_epi32(floor + INA_NC_BIAS), sign);
    return _mm512_mask_mov_epi32(code, below, v);
}

/* 64 codes of a group with a lane outside [2^floor, 2^63) or a tie (the byte leaves the carry to word1), the
 * long way, in dword lanes from the bytes (element order in wj). Zeros are 0 whatever the draw. A few lanes
 * that need their word1 (ties, nonzero values below the floor) or their flags (NaN/Inf, overflow) are queued
 * for nc_flush; more (a run of small values) take the group's 64 word1s from one draw, every lane in vector
 * lanes (the uniform h << 15 | word1 >> 17 for all, nc_below16 below the floor). */
static __attribute__((noinline)) void nc_rare64(const float *x, __m512i wj, uint8_t *codes, uint64_t pos0,
                                                int floor, int det, nc_pending *p, keys_t *k, uint32_t *err)
{
    const __m512i low = _mm512_set1_epi32((floor + 127) << 23);
    const __m512i span = _mm512_sub_epi32(_mm512_set1_epi32((INA_NC_LEVEL_MAX + 127) << 23), low);
    const __m512i tiem = _mm512_set1_epi32(0x7F8000), bias = _mm512_set1_epi32(127 - INA_NC_BIAS);
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), c80 = _mm512_set1_epi32(0x80);
    const __m128i hq[4] = {_mm512_extracti32x4_epi32(wj, 0), _mm512_extracti32x4_epi32(wj, 1),
                           _mm512_extracti32x4_epi32(wj, 2), _mm512_extracti32x4_epi32(wj, 3)};
    __m512i c[4];
    __mmask16 need[4];
    int count = 0;
    for (int v = 0; v < 4; v++) {
        __m512i xv = _mm512_loadu_si512(x + 16 * v), b = _mm512_and_si512(xv, abs);
        __m512i u = det ? _mm512_set1_epi32(0x400000) : _mm512_slli_epi32(_mm512_cvtepu8_epi32(hq[v]), 15);
        __m512i t = _mm512_add_epi32(b, u);
        __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(t, 23), bias);
        code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(xv, 24), c80, 0xF8); /* | sign */
        __mmask16 out = _mm512_cmpge_epu32_mask(_mm512_sub_epi32(b, low), span);
        __mmask16 tie = det ? 0 : _mm512_cmpeq_epi32_mask(_mm512_and_si512(t, tiem), tiem);
        __mmask16 nz = _mm512_test_epi32_mask(b, b);
        c[v] = _mm512_maskz_mov_epi32(nz, code); /* 0 never rounds up */
        need[v] = (__mmask16)((out | tie) & nz);
        count += __builtin_popcount(need[v]);
    }
    if (!det && count <= 3) {
        for (int v = 0; v < 4; v++)
            _mm_storeu_si128((__m128i *)(codes + 16 * v), _mm512_cvtepi32_epi8(c[v]));
        uint8_t h[64];
        _mm512_storeu_si512(h, wj);
        for (int v = 0; v < 4; v++)
            for (unsigned m = need[v]; m; m &= m - 1) {
                unsigned e = 16 * (unsigned)v + (unsigned)__builtin_ctz(m);
                nc_push(p, x, codes, pos0, e, h[e], k, floor, det, err);
            }
        return;
    }
    __m512i w1[4] = {_mm512_setzero_si512()};
    if (!det)
        philox64(k, pos0 >> 2, INA_SUB_EXTRA, w1); /* positions pos0 .. pos0 + 63 (pos0 % 16 == 0) */
    for (int v = 0; v < 4; v++) {
        __m512i xv = _mm512_loadu_si512(x + 16 * v), b = _mm512_and_si512(xv, abs);
        __m512i u = det ? _mm512_set1_epi32(0x400000)
                        : _mm512_or_si512(_mm512_slli_epi32(_mm512_cvtepu8_epi32(hq[v]), 15),
                                          _mm512_srli_epi32(w1[v], 17));
        __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(b, u), 23), bias);
        code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(xv, 24), c80, 0xF8); /* | sign */
        *err |= (_mm512_cmpge_epu32_mask(b, _mm512_set1_epi32(0x7F800000)) ? INA_NC_FLAG_NONFINITE : 0u) |
                (_mm512_cmpge_epu32_mask(b, _mm512_set1_epi32((INA_NC_LEVEL_MAX + 127) << 23)) ? INA_NC_FLAG_OVERFLOW
                                                                                              : 0u);
        __mmask16 below = _mm512_cmplt_epu32_mask(b, low);
        __mmask16 nz = _mm512_mask_test_epi32_mask(below, b, b);
        code = _mm512_mask_mov_epi32(code, below, _mm512_setzero_si512()); /* zeros stay 0 */
        if (nz)
            code = nc_below16(code, nz, xv, w1[v], floor, det, err);
        _mm_storeu_si128((__m128i *)(codes + 16 * v), _mm512_cvtepi32_epi8(code));
    }
}

/* 64 NC codes of x from their bytes wj (element order) in byte lanes: per element the mantissa's top 8 bits M
 * and the exponent E (bytes 2 and 3 of |x| << 1) and the sign, gathered 64 to a vector in the order of
 * packs (128-bit lane L, source vector v, element j at byte 16 L + 4 v + j: element 16 v + 4 L + j); M + h
 * carries (the round-up) iff the wrapped sum is below M. A group with a tie (M + h = 0xFF) or an exponent
 * outside [floor, 63) goes to nc_rare64. */
static inline __attribute__((always_inline)) void nc_encode64(const float *x, __m512i wj, uint8_t *codes,
                                                              uint64_t pos0, int floor, int det, nc_pending *p,
                                                              keys_t *k, uint32_t *err)
{
    const __m512i pick = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); /* its own inverse */
    __m512i xv[4], me[4];
    for (int v = 0; v < 4; v++) {
        xv[v] = _mm512_loadu_si512(x + 16 * v);
        me[v] = _mm512_shuffle_epi8(_mm512_slli_epi32(xv[v], 1), pick); /* dword 0: 4 M, dword 1: 4 E */
    }
    __m512i ab = _mm512_unpacklo_epi32(me[0], me[1]), cd = _mm512_unpacklo_epi32(me[2], me[3]);
    __m512i M = _mm512_unpacklo_epi64(ab, cd), E = _mm512_unpackhi_epi64(ab, cd);
    __m512i neg = _mm512_packs_epi16(_mm512_packs_epi32(xv[0], xv[1]), _mm512_packs_epi32(xv[2], xv[3]));
    __m512i h = det ? _mm512_set1_epi8((char)0x80) /* 2^22: round half up */ : _mm512_permutexvar_epi32(order, wj);
    __m512i sum = _mm512_add_epi8(M, h);
    __mmask64 carry = _mm512_cmplt_epu8_mask(sum, M);
    __m512i code = _mm512_add_epi8(E, _mm512_set1_epi8((char)-(127 - INA_NC_BIAS)));
    code = _mm512_mask_add_epi8(code, carry, code, _mm512_set1_epi8(1));
    code = _mm512_ternarylogic_epi32(code, neg, _mm512_set1_epi8((char)0x80), 0xF8); /* | sign */
    /* E - low as an unsigned byte is below span for every lane in range (a lower E wraps above it) */
    __mmask64 out = _mm512_cmpge_epu8_mask(_mm512_sub_epi8(E, _mm512_set1_epi8((char)(floor + 127))),
                                           _mm512_set1_epi8((char)(INA_NC_LEVEL_MAX - floor)));
    __mmask64 tie = det ? 0 : _mm512_cmpeq_epi8_mask(sum, _mm512_set1_epi8(-1));
    if (__builtin_expect(!(out | tie), 1)) {
        _mm512_storeu_si512(codes, _mm512_permutexvar_epi32(order, code));
    } else if (!out) { /* ties only (one group in 4.5): stored, then queued */
        _mm512_storeu_si512(codes, _mm512_permutexvar_epi32(order, code));
        uint8_t hb[64];
        _mm512_storeu_si512(hb, wj);
        for (uint64_t m = tie; m; m &= m - 1) {
            unsigned b = (unsigned)__builtin_ctzll(m); /* packed byte 16 L + 4 v + j: element 16 v + 4 L + j */
            unsigned e = 16 * ((b >> 2) & 3) + 4 * (b >> 4) + (b & 3);
            nc_push(p, x, codes, pos0, e, hb[e], k, floor, det, err);
        }
    } else {
        nc_rare64(x, wj, codes, pos0, floor, det, p, k, err);
    }
}

static inline void prefetch(const float *x, int lines)
{
    for (int l = 0; l < lines; l++)
        _mm_prefetch((const char *)(x + PREFETCH + 16 * l), _MM_HINT_T0);
}

/* NC reads a byte of the main stream per element (ina_ncmath.h): four Philox chains (32 counters, 128 words)
 * feed 512 elements, from a position that is a multiple of 16 */
static uint32_t nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int det,
                          int floor)
{
    if (floor >= INA_NC_LEVEL_MAX) /* every finite value is at the top level, below the floor or overflows */
        return ina_scalar_nc_encode(x, n, codes, seed, offset, det, floor);
    size_t i = head16(offset, n);
    uint32_t err = ina_scalar_nc_encode(x, i, codes, seed, offset, det, floor);
    keys_t k;
    keys_init(&k, seed);
    nc_pending p;
    memset(&p, 0, sizeof p);
    for (; n - i >= 8 * BLOCK; i += 8 * BLOCK) {
        __m512i w[8] = {_mm512_setzero_si512()};
        if (!det)
            philox_chains(&k, (offset + i) >> 4, INA_SUB_MAIN, w, 4); /* words at positions (offset + i) / 4 .. */
        for (int j = 0; j < 8; j++) {
            if (!(j & 1))
                prefetch(x + i + 64 * j, 8);
            nc_encode64(x + i + 64 * j, w[j], codes + i + 64 * j, offset + i + 64 * j, floor, det, &p, &k, &err);
        }
    }
    for (; n - i >= 4 * BLOCK; i += 4 * BLOCK) {
        __m512i w[4] = {_mm512_setzero_si512()};
        if (!det)
            philox64(&k, (offset + i) >> 4, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++)
            nc_encode64(x + i + 64 * j, w[j], codes + i + 64 * j, offset + i + 64 * j, floor, det, &p, &k, &err);
    }
    nc_flush(&p, &k, floor, det, &err);
    return err | ina_scalar_nc_encode(x + i, n - i, codes + i, seed, offset + i, det, floor);
}

/* up to 16 codes (mask m) as float32 bits; *invalid gets the 0x80 codes */
static inline __m512i nc_decode16(const uint8_t *codes, __mmask16 m, __mmask16 *invalid)
{
    __m128i c8 = _mm_maskz_loadu_epi8(m, codes);
    *invalid |= _mm_mask_cmpeq_epi8_mask(m, c8, _mm_set1_epi8((char)0x80));
    __m512i c = _mm512_cvtepu8_epi32(c8);
    __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    __m512i e = _mm512_slli_epi32(
        _mm512_maskz_add_epi32(_mm512_test_epi32_mask(mag, mag), mag, _mm512_set1_epi32(127 - INA_NC_BIAS)), 23);
    return _mm512_or_si512(e, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24));
}

/* 64 codes' float32 bits into 4 vectors; nonzero if a code is 0x80 (invalid) */
static inline __mmask16 nc_decode64(const uint8_t *codes, __m512i v[4])
{
    __mmask16 invalid = 0;
    for (int j = 0; j < 4; j++)
        v[j] = nc_decode16(codes + 16 * j, 0xFFFF, &invalid);
    return invalid;
}

static uint32_t nc_decode(const uint8_t *codes, size_t n, float *out)
{
    size_t i = 0;
    __mmask16 invalid = 0;
    for (; n - i >= 64; i += 64) {
        __m512i v[4];
        invalid |= nc_decode64(codes + i, v);
        for (int j = 0; j < 4; j++)
            _mm512_storeu_si512(out + i + 16 * j, v[j]);
    }
    return (invalid != 0) | ina_scalar_nc_decode(codes + i, n - i, out + i);
}

/* the same with streaming stores on every whole 64-byte line of out (the lines are written without being
 * read first, and do not evict what the caller uses next); the partial lines at either end take masked stores */
static uint32_t nc_decode_nt(const uint8_t *codes, size_t n, float *out)
{
    if ((uintptr_t)out & 3)
        return nc_decode(codes, n, out);
    size_t i = (size_t)((64 - ((uintptr_t)out & 63)) & 63) / 4;
    i = i < n ? i : n;
    __mmask16 bad16 = 0, invalid = 0;
    if (i)
        _mm512_mask_storeu_epi32(out, (__mmask16)((1u << i) - 1), nc_decode16(codes, (__mmask16)((1u << i) - 1), &bad16));
    for (; n - i >= 64; i += 64) {
        __m512i v[4];
        invalid |= nc_decode64(codes + i, v);
        for (int j = 0; j < 4; j++)
            _mm512_stream_si512((void *)(out + i + 16 * j), v[j]);
    }
    for (; n - i >= 16; i += 16)
        _mm512_stream_si512((void *)(out + i), nc_decode16(codes + i, 0xFFFF, &bad16));
    if (n > i) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_epi32(out + i, m, nc_decode16(codes + i, m, &bad16));
    }
    return (invalid != 0) | (bad16 != 0); /* unfenced: ina_store_fence */
}

/* 16 int32 lanes, byte-swapped to big-endian, stored */
static inline void store_be16(uint8_t *p, __m256i lo, __m256i hi)
{
    const __m512i swap = _mm512_set4_epi32(0x0C0D0E0F, 0x08090A0B, 0x04050607, 0x00010203);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_storeu_si512(p, _mm512_shuffle_epi8(v, swap));
}

/* clip to +-lim as the scalar ternary does (a NaN stays NaN: min/max return their second operand on NaN) */
static inline __m256i clip_cvt(__m512d q, __m512d lim)
{
    q = _mm512_max_pd(_mm512_sub_pd(_mm512_setzero_pd(), lim), _mm512_min_pd(lim, q));
    return _mm512_cvtpd_epi32(q);
}

static void fixed_nearest(const float *x, size_t n, double scale, double lim, uint8_t *out_be)
{
    size_t i = 0;
    const __m512d sc = _mm512_set1_pd(scale), l = _mm512_set1_pd(lim);
    for (; n - i >= 16; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
        __m512d ql = _mm512_roundscale_pd(_mm512_mul_pd(lo_pd(xv), sc), NEAREST);
        __m512d qh = _mm512_roundscale_pd(_mm512_mul_pd(hi_pd(xv), sc), NEAREST);
        store_be16(out_be + 4 * i, clip_cvt(ql, l), clip_cvt(qh, l));
    }
    ina_scalar_fixed_nearest(x + i, n - i, scale, lim, out_be + 4 * i);
}

/* stochastic rounding of 8 lanes: floor(t) + 1 iff word < frac(t) 2^32 */
static inline __m256i sr8(__m512d t, __m512d w, __m512d lim)
{
    __m512d lo = _mm512_roundscale_pd(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512d thr = _mm512_mul_pd(_mm512_sub_pd(t, lo), _mm512_set1_pd(4294967296.0));
    __mmask8 up = _mm512_cmp_pd_mask(w, thr, _CMP_LT_OQ);
    return clip_cvt(_mm512_add_pd(lo, _mm512_maskz_mov_pd(up, _mm512_set1_pd(1.0))), lim);
}

static void fixed_sr(const float *x, size_t n, double scale, double lim, uint64_t seed, uint64_t offset,
                     uint8_t *out_be)
{
    size_t i = head_len(offset, n);
    ina_scalar_fixed_sr(x, i, scale, lim, seed, offset, out_be);
    keys_t k;
    keys_init(&k, seed);
    const __m512d sc = _mm512_set1_pd(scale), l = _mm512_set1_pd(lim);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m512i w[4];
        philox64(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++) {
            __m512 xv = _mm512_loadu_ps(x + i + 16 * j);
            __m256i ql = sr8(_mm512_mul_pd(lo_pd(xv), sc), lo_u32_pd(w[j]), l);
            __m256i qh = sr8(_mm512_mul_pd(hi_pd(xv), sc), hi_u32_pd(w[j]), l);
            store_be16(out_be + 4 * (i + 16 * j), ql, qh);
        }
    }
    ina_scalar_fixed_sr(x + i, n - i, scale, lim, seed, offset + i, out_be + 4 * i);
}

static void fixed_value(const int32_t *sums, size_t n, double scale, float *out)
{
    size_t i = 0;
    const __m512d sc = _mm512_set1_pd(scale);
    for (; n - i >= 16; i += 16) {
        __m512i s = _mm512_loadu_si512(sums + i);
        __m256 lo = _mm512_cvtpd_ps(_mm512_div_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(s)), sc));
        __m256 hi = _mm512_cvtpd_ps(_mm512_div_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(s, 1)), sc));
        _mm512_storeu_ps(out + i, _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1));
    }
    ina_scalar_fixed_value(sums + i, n - i, scale, out + i);
}

/* y = min(|v| / norm, 1) of 8 lanes */
static inline __m512d dither_y(__m512d v, __m512d norm)
{
    return _mm512_min_pd(_mm512_div_pd(_mm512_abs_pd(v), norm), _mm512_set1_pd(1.0));
}

/* natural dithering level of 8 lanes (ina_dither_natural) as int64, with the sign bit 0x80 */
static inline __m512i natural8(__m512d v, __m512d norm, __m512i w64, int s)
{
    __m512d y = dither_y(v, norm);
    __mmask8 small = _mm512_cmp_pd_mask(y, _mm512_set1_pd(ina_pow2(1 - s)), _CMP_LT_OQ);
    __mmask8 small_up = _mm512_cmp_pd_mask(_mm512_cvtepu64_pd(w64),
                                           _mm512_mul_pd(y, _mm512_set1_pd(ina_pow2(s + 31))), _CMP_LT_OQ);
    __m512i yb = _mm512_castpd_si512(y);
    __m512i m = _mm512_and_si512(yb, _mm512_set1_epi64(0xFFFFFFFFFFFFFll));
    __mmask8 up = _mm512_cmplt_epu64_mask(_mm512_slli_epi64(w64, 20), m);
    __m512i level = _mm512_add_epi64(_mm512_srli_epi64(yb, 52), _mm512_set1_epi64(s - 1023));
    level = _mm512_mask_add_epi64(level, up, level, _mm512_set1_epi64(1));
    level = _mm512_mask_mov_epi64(level, small, _mm512_maskz_mov_epi64(small_up, _mm512_set1_epi64(1)));
    __mmask8 neg = _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_LT_OQ);
    return _mm512_mask_or_epi64(level, neg, level, _mm512_set1_epi64(0x80));
}

/* standard dithering level of 8 lanes (ina_dither_standard) as int64, with the sign bit 0x8000 */
static inline __m512i standard8(__m512d v, __m512d norm, __m512i w64, int s)
{
    const __m512d ds = _mm512_set1_pd((double)s), one = _mm512_set1_pd(1.0);
    __m512d y = dither_y(v, norm);
    __m512d hi = _mm512_roundscale_pd(_mm512_mul_pd(y, ds), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    hi = _mm512_min_pd(_mm512_max_pd(hi, one), ds);
    __m512d lo = _mm512_sub_pd(hi, one); /* the answer is within one of hi (ina_ncmath.h) */
    __mmask8 down = _mm512_cmp_pd_mask(hi, one, _CMP_GT_OQ) &
                    _mm512_cmp_pd_mask(_mm512_div_pd(lo, ds), y, _CMP_GE_OQ);
    hi = _mm512_mask_sub_pd(hi, down, hi, one);
    __mmask8 upm = _mm512_cmp_pd_mask(hi, ds, _CMP_LT_OQ) & _mm512_cmp_pd_mask(_mm512_div_pd(hi, ds), y, _CMP_LT_OQ);
    hi = _mm512_mask_add_pd(hi, upm, hi, one);
    __m512d tlo = _mm512_div_pd(_mm512_sub_pd(hi, one), ds), thi = _mm512_div_pd(hi, ds);
    __m512d p = _mm512_div_pd(_mm512_sub_pd(y, tlo), _mm512_sub_pd(thi, tlo));
    __m512d u = _mm512_mul_pd(_mm512_cvtepu64_pd(w64), _mm512_set1_pd(2.3283064365386963e-10));
    __mmask8 stay = _mm512_cmp_pd_mask(u, p, _CMP_NLT_UQ);
    __m512i level = _mm512_cvtpd_epi64(_mm512_mask_sub_pd(hi, stay, hi, one));
    __mmask8 neg = _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_LT_OQ);
    return _mm512_mask_or_epi64(level, neg, level, _mm512_set1_epi64(0x8000));
}

/* the 16 words of w as two int64 vectors */
static inline void widen(__m512i w, __m512i *lo, __m512i *hi)
{
    *lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(w));
    *hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(w, 1));
}

static void dither_natural(const float *x, size_t n, double norm, int s, uint64_t seed, uint64_t offset,
                           uint8_t *codes)
{
    size_t i = head_len(offset, n);
    ina_scalar_dither_natural(x, i, norm, s, seed, offset, codes);
    keys_t k;
    keys_init(&k, seed);
    const __m512d nv = _mm512_set1_pd(norm);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m512i w[4], wl, wh;
        philox64(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++) {
            __m512 xv = _mm512_loadu_ps(x + i + 16 * j);
            widen(w[j], &wl, &wh);
            _mm_storel_epi64((__m128i *)(codes + i + 16 * j), _mm512_cvtepi64_epi8(natural8(lo_pd(xv), nv, wl, s)));
            _mm_storel_epi64((__m128i *)(codes + i + 16 * j + 8), _mm512_cvtepi64_epi8(natural8(hi_pd(xv), nv, wh, s)));
        }
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
    const __m512d nv = _mm512_set1_pd(norm);
    for (; n - i >= BLOCK; i += BLOCK) {
        __m512i w[4], wl, wh;
        philox64(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        for (int j = 0; j < 4; j++) {
            __m512 xv = _mm512_loadu_ps(x + i + 16 * j);
            widen(w[j], &wl, &wh);
            __m128i cl = _mm512_cvtepi64_epi16(standard8(lo_pd(xv), nv, wl, s));
            __m128i ch = _mm512_cvtepi64_epi16(standard8(hi_pd(xv), nv, wh, s));
            _mm_storeu_si128((__m128i *)(codes + i + 16 * j), cl);
            _mm_storeu_si128((__m128i *)(codes + i + 16 * j + 8), ch);
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
    for (; n - i >= 2 * BLOCK; i += 2 * BLOCK) {
        __m512i w[8];
        philox_chains(&k, (offset + i) >> 2, s, w, 4);
        for (int j = 0; j < 8; j++)
            _mm512_storeu_si512(out + i + 16 * j, w[j]);
    }
    for (; n - i >= BLOCK; i += BLOCK) {
        __m512i w[4];
        philox64(&k, (offset + i) >> 2, s, w);
        for (int j = 0; j < 4; j++)
            _mm512_storeu_si512(out + i + 16 * j, w[j]);
    }
    ina_scalar_philox_fill(seed, offset + i, n - i, s, out + i);
}

/* a result's big-endian sums into a large output: a streaming store per whole 64-byte line of out, masked
 * plain stores on the partial lines at either end (as nc_decode_nt) */
static void int32_unwire_nt(const uint8_t *be, size_t n, int32_t *out)
{
    if ((uintptr_t)out & 3) {
        ina_scalar_int32_unwire(be, n, out);
        return;
    }
    const __m512i swap = _mm512_set4_epi32(0x0C0D0E0F, 0x08090A0B, 0x04050607, 0x00010203);
    size_t i = (size_t)((64 - ((uintptr_t)out & 63)) & 63) / 4;
    i = i < n ? i : n;
    if (i) {
        __mmask16 m = (__mmask16)((1u << i) - 1);
        _mm512_mask_storeu_epi32(out, m, _mm512_shuffle_epi8(_mm512_maskz_loadu_epi32(m, be), swap));
    }
    for (; n - i >= 16; i += 16)
        _mm512_stream_si512((void *)(out + i), _mm512_shuffle_epi8(_mm512_loadu_si512(be + 4 * i), swap));
    if (n > i) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_epi32(out + i, m, _mm512_shuffle_epi8(_mm512_maskz_loadu_epi32(m, be + 4 * i), swap));
    } /* unfenced: ina_store_fence */
}

const ina_kernel_ops ina_ops_avx512 = {
    "avx512", nc_encode, nc_decode, fixed_nearest, fixed_sr, fixed_value, dither_natural, dither_standard,
    philox_fill, nc_decode_nt, int32_unwire_nt,
};
