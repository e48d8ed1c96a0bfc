/* AVX-512 (F, BW, DQ, VL) twins of the scalar kernels in ina_kernels_ops.h, bit for bit (tests/test_simd.py).
 * Philox runs on 8 counters per zmm in 64-bit lanes (vpmuludq takes the low 32 bits, so the high halves can
 * carry junk), two zmm at a time for the latency; one draw of 16 counters feeds 64 elements. Stream blocks
 * start at positions that are multiples of 4; the unaligned head and the short tail run the scalar loops.
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

/* 16 lanes with some |x| outside [2^floor, 2^63): the flags, and the codes of the lanes below the floor; the
 * block's sub-stream 1 words (w1) are drawn on the first need and kept for its other lanes */
static inline __m512i nc_rare16(__m512i code, __m512i xv, __m512i b, __m512i low, keys_t *k, uint64_t q,
                                __m512i *w1, int *have_w1, int j, int floor, int det, uint32_t *err)
{
    *err |= (_mm512_cmpge_epu32_mask(b, _mm512_set1_epi32(0x7F800000)) ? INA_NC_FLAG_NONFINITE : 0u) |
            (_mm512_cmpge_epu32_mask(b, _mm512_set1_epi32((INA_NC_LEVEL_MAX + 127) << 23)) ? INA_NC_FLAG_OVERFLOW : 0u);
    __mmask16 below = _mm512_cmplt_epu32_mask(b, low);
    __mmask16 nz = _mm512_mask_test_epi32_mask(below, b, b);
    code = _mm512_mask_mov_epi32(code, below, _mm512_setzero_si512()); /* 0 never rounds up */
    if (!nz)
        return code;
    if (!det && !*have_w1) {
        philox64(k, q, INA_SUB_EXTRA, w1);
        *have_w1 = 1;
    }
    return nc_below16(code, nz, xv, det ? _mm512_setzero_si512() : w1[j], floor, det, err);
}

/* one vector of 16 codes the long way (a block with a lane outside [2^floor, 2^63)): dword codes, the rare
 * lanes fixed, narrowed and stored */
static inline void nc_group16(__m512i xv, __m512i w, uint8_t *out, int floor, int det, uint32_t *err,
                              keys_t *k, uint64_t q, __m512i *w1, int *have_w1, int j)
{
    const __m512i low = _mm512_set1_epi32(floor + 127 >= 255 ? 0x7F800000 : (floor + 127) << 23);
    __m512i b = _mm512_and_si512(xv, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i u = det ? _mm512_set1_epi32(0x400000) : _mm512_srli_epi32(w, 9);
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(b, u), 23);
    code = _mm512_sub_epi32(code, _mm512_set1_epi32(127 - INA_NC_BIAS));
    code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(xv, 24), _mm512_set1_epi32(0x80), 0xF8); /* | sign */
    code = nc_rare16(code, xv, b, low, k, q, w1, have_w1, j, floor, det, err);
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(code));
}

/* 64 codes from their exponent fields after the carry (e, each 64..190) and signs: packed to bytes in order,
 * minus the bias, the sign added as bit 7 */
static inline void nc_pack64(const __m512i e[4], __mmask16 neg[4], uint8_t *out)
{
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i p = _mm512_packus_epi16(_mm512_packus_epi32(e[0], e[1]), _mm512_packus_epi32(e[2], e[3]));
    p = _mm512_sub_epi8(_mm512_permutexvar_epi32(order, p), _mm512_set1_epi8(127 - INA_NC_BIAS));
    __mmask64 m = _mm512_kunpackd(_mm512_kunpackw(neg[3], neg[2]), _mm512_kunpackw(neg[1], neg[0]));
    _mm512_storeu_si512(out, _mm512_mask_add_epi8(p, m, p, _mm512_set1_epi8((char)0x80)));
}

/* 64 codes from x with their words w (zero when det); lanes outside the fast range take nc_group16 */
static inline __attribute__((always_inline)) void nc_encode64(const float *x, const __m512i w[4], uint8_t *codes,
                                                              int floor, int det, uint32_t *err, keys_t *k,
                                                              uint64_t q, __m512i low, __m512i span)
{
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i xv[4], e[4];
    __mmask16 neg[4], out = 0;
    for (int j = 0; j < 4; j++) {
        xv[j] = _mm512_loadu_si512(x + 16 * j);
        __m512i b = _mm512_and_si512(xv[j], abs);
        __m512i u = det ? _mm512_set1_epi32(0x400000) : _mm512_srli_epi32(w[j], 9);
        e[j] = _mm512_srli_epi32(_mm512_add_epi32(b, u), 23); /* the mantissa add's carry is the round-up */
        neg[j] = _mm512_movepi32_mask(xv[j]);
        out |= _mm512_cmpge_epu32_mask(_mm512_sub_epi32(b, low), span);
    }
    if (!out) {
        nc_pack64(e, neg, codes);
        return;
    }
    __m512i w1[4];
    int have_w1 = 0;
    for (int j = 0; j < 4; j++)
        nc_group16(xv[j], w[j], codes + 16 * j, floor, det, err, k, q, w1, &have_w1, j);
}

static inline void prefetch(const float *x, int lines)
{
    for (int l = 0; l < lines; l++)
        _mm_prefetch((const char *)(x + PREFETCH + 16 * l), _MM_HINT_T0);
}

static uint32_t nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int det,
                          int floor)
{
    if (floor > INA_NC_LEVEL_MAX) /* every finite value is below the floor or overflows: the scalar loop */
        return ina_scalar_nc_encode(x, n, codes, seed, offset, det, floor);
    size_t i = head_len(offset, n);
    uint32_t err = ina_scalar_nc_encode(x, i, codes, seed, offset, det, floor);
    keys_t k;
    keys_init(&k, seed);
    const __m512i low = _mm512_set1_epi32(floor + 127 >= 255 ? 0x7F800000 : (floor + 127) << 23);
    /* one unsigned compare finds every lane outside [low, 2^63): b - low >= 2^63 - low */
    const __m512i span = _mm512_sub_epi32(_mm512_set1_epi32((INA_NC_LEVEL_MAX + 127) << 23), low);
    for (; n - i >= 2 * BLOCK; i += 2 * BLOCK) { /* four Philox chains at a time */
        __m512i w[8] = {_mm512_setzero_si512()};
        prefetch(x + i, 8);
        if (!det)
            philox_chains(&k, (offset + i) >> 2, INA_SUB_MAIN, w, 4);
        nc_encode64(x + i, w, codes + i, floor, det, &err, &k, (offset + i) >> 2, low, span);
        nc_encode64(x + i + BLOCK, w + 4, codes + i + BLOCK, floor, det, &err, &k, (offset + i + BLOCK) >> 2, low,
                    span);
    }
    for (; n - i >= BLOCK; i += BLOCK) {
        __m512i w[4] = {_mm512_setzero_si512()};
        if (!det)
            philox64(&k, (offset + i) >> 2, INA_SUB_MAIN, w);
        nc_encode64(x + i, w, codes + i, floor, det, &err, &k, (offset + i) >> 2, low, span);
    }
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

const ina_kernel_ops ina_ops_avx512 = {
    "avx512", nc_encode, nc_decode, fixed_nearest, fixed_sr, fixed_value, dither_natural, dither_standard,
    philox_fill, nc_decode_nt,
};
