/* The switch's lane arithmetic (ina_core_lanes.h) three times: portable C, AVX2 and AVX-512. The SIMD
 * functions carry their own target attribute, so the file builds with INA_CFLAGS=-O3 (no -march) and
 * ina_lanes_pick() chooses at run time with __builtin_cpu_supports; each gives the scalar path's bytes.
 *
 * NC sums -> codes needs floor(log2 |s|) exactly and SplitMix64 words (ina_rng.h) per lane: AVX-512 has
 * vplzcntq (CD) and vpmullq (DQ); AVX2 takes the exponent of an exact double (|s| >> 12 or |s| itself,
 * both below 2^52) and builds the 64-bit multiply from three 32x32 ones. Narrow rounds (sums within 2^30,
 * ina_core.c values()) have int32 twins: scalar, AVX2 (8 lanes, log2 from a float) and AVX-512 (16 lanes,
 * vplzcntd). */
#include <stdlib.h>
#include <string.h>

#include "ina_core_lanes.h"

/* ------------------------------------------------------------------ scalar */
/* portable C; add and write are separate loops because gcc -O3 -march=native vectorises those (not a
 * conditional load) */
static void int32_values_scalar(const uint8_t *p, uint32_t n, int64_t *v, int add)
{
    if (add)
        for (uint32_t i = 0; i < n; i++)
            v[i] += (int32_t)rd32(p + 4 * i);
    else
        for (uint32_t i = 0; i < n; i++)
            v[i] = (int32_t)rd32(p + 4 * i);
}

static int int32_finish_scalar(const int64_t *acc, uint32_t n, uint8_t *res)
{
    int over = 0;
    for (uint32_t i = 0; i < n; i++) {
        over |= acc[i] < INT32_MIN || acc[i] > INT32_MAX;
        wr32(res + 4 * i, (uint32_t)acc[i]); /* wraps like the hardware; the flag says so */
    }
    return over;
}

/* a signed add wrapped iff both terms' signs differ from the sum's: bit 31 of (a ^ s) & (b ^ s) */
static int int32_values32_scalar(const uint8_t *p, uint32_t n, int32_t *v, int add)
{
    uint32_t wrap = 0;
    if (add) {
        for (uint32_t i = 0; i < n; i++) {
            uint32_t a = (uint32_t)v[i], b = rd32(p + 4 * i), s = a + b;
            wrap |= (a ^ s) & (b ^ s);
            v[i] = (int32_t)s;
        }
    } else {
        for (uint32_t i = 0; i < n; i++)
            v[i] = (int32_t)rd32(p + 4 * i);
    }
    return (int)(wrap >> 31);
}

static void int32_finish32_scalar(const int32_t *acc, uint32_t n, uint8_t *res)
{
    for (uint32_t i = 0; i < n; i++)
        wr32(res + 4 * i, (uint32_t)acc[i]);
}

static int int32_add_finish32_scalar(const uint8_t *p, const int32_t *acc, uint32_t n, uint8_t *res)
{
    uint32_t wrap = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t a = (uint32_t)acc[i], b = rd32(p + 4 * i), s = a + b;
        wrap |= (a ^ s) & (b ^ s);
        wr32(res + 4 * i, s);
    }
    return (int)(wrap >> 31);
}

static int nc_valid_scalar(const uint8_t *p, uint32_t n, int floor, int top)
{
    for (uint32_t i = 0; i < n; i++)
        if (!ina_nc_code_valid(p[i], floor, top))
            return 0;
    return 1;
}

static void nc_values_scalar(const uint8_t *p, uint32_t n, int floor, int64_t *v, int add)
{
    if (add)
        for (uint32_t i = 0; i < n; i++)
            v[i] += ina_nc_code_int(p[i], floor);
    else
        for (uint32_t i = 0; i < n; i++)
            v[i] = ina_nc_code_int(p[i], floor);
}

static int nc_finish_scalar(const int64_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                            uint8_t *res)
{
    uint32_t over = 0;
    for (uint32_t i = 0; i < n; i++)
        res[i] = ina_nc_sum_code(acc[i], floor, det, key, base + i, &over);
    return (int)over;
}

/* narrow rounds: codes within 2^30 of the round's narrow floor, so every int32 sum is exact */
static void nc_values32_scalar(const uint8_t *p, uint32_t n, int floor, int32_t *v, int add)
{
    if (add)
        for (uint32_t i = 0; i < n; i++)
            v[i] += (int32_t)ina_nc_code_int(p[i], floor);
    else
        for (uint32_t i = 0; i < n; i++)
            v[i] = (int32_t)ina_nc_code_int(p[i], floor);
}

static int nc_finish32_scalar(const int32_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                              uint8_t *res)
{
    uint32_t over = 0;
    for (uint32_t i = 0; i < n; i++)
        res[i] = ina_nc_sum_code(acc[i], floor, det, key, base + i, &over);
    return (int)over;
}

static int nc_add_finish32_scalar(const uint8_t *p, const int32_t *acc, uint32_t n, int floor, int det,
                                  uint64_t key, uint64_t base, uint8_t *res)
{
    uint32_t over = 0;
    for (uint32_t i = 0; i < n; i++)
        res[i] = ina_nc_sum_code(acc[i] + ina_nc_code_int(p[i], floor), floor, det, key, base + i, &over);
    return (int)over;
}

const ina_lane_ops ina_lanes_scalar = {"scalar", int32_values_scalar, int32_finish_scalar, nc_valid_scalar,
                                       nc_values_scalar, nc_finish_scalar, NULL, nc_values32_scalar,
                                       nc_finish32_scalar, nc_add_finish32_scalar, int32_values32_scalar,
                                       int32_finish32_scalar, int32_add_finish32_scalar};

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx2")))

/* ------------------------------------------------------------------ AVX2 */
/* big-endian int32 in each dword <-> native: reverse the bytes of every 4 */
#define BSWAP32_LANES(set) set(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3)

AVX2 static void int32_values_avx2(const uint8_t *p, uint32_t n, int64_t *v, int add)
{
    const __m128i bswap = BSWAP32_LANES(_mm_set_epi8);
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128i be = _mm_loadu_si128((const __m128i *)(p + 4 * i));
        __m256i x = _mm256_cvtepi32_epi64(_mm_shuffle_epi8(be, bswap));
        if (add)
            x = _mm256_add_epi64(x, _mm256_loadu_si256((const __m256i *)(v + i)));
        _mm256_storeu_si256((__m256i *)(v + i), x);
    }
    int32_values_scalar(p + 4 * i, n - i, v + i, add);
}

AVX2 static int int32_finish_avx2(const int64_t *acc, uint32_t n, uint8_t *res)
{
    const __m128i bswap = BSWAP32_LANES(_mm_set_epi8);
    const __m256i hi = _mm256_set1_epi64x(INT32_MAX), lo = _mm256_set1_epi64x(INT32_MIN);
    const __m256i low_dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256i over = _mm256_setzero_si256();
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256i s = _mm256_loadu_si256((const __m256i *)(acc + i));
        over = _mm256_or_si256(over, _mm256_or_si256(_mm256_cmpgt_epi64(s, hi), _mm256_cmpgt_epi64(lo, s)));
        __m128i w = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(s, low_dwords));
        _mm_storeu_si128((__m128i *)(res + 4 * i), _mm_shuffle_epi8(w, bswap));
    }
    return (!_mm256_testz_si256(over, over)) | int32_finish_scalar(acc + i, n - i, res + 4 * i);
}

AVX2 static int nc_valid_avx2(const uint8_t *p, uint32_t n, int floor, int top)
{
    if (top < floor) /* no level fits: only zeros pass (and span below would wrap) */
        return nc_valid_scalar(p, n, floor, top);
    uint8_t lo, span;
    ina_nc_code_range(floor, top, &lo, &span);
    const __m256i vlo = _mm256_set1_epi8((char)lo), vspan = _mm256_set1_epi8((char)span);
    const __m256i low7 = _mm256_set1_epi8(0x7F), zero = _mm256_setzero_si256();
    __m256i ok = _mm256_set1_epi8(-1);
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i d = _mm256_sub_epi8(_mm256_and_si256(c, low7), vlo); /* m - lo <= span, unsigned */
        __m256i in = _mm256_cmpeq_epi8(_mm256_max_epu8(d, vspan), vspan);
        ok = _mm256_and_si256(ok, _mm256_or_si256(in, _mm256_cmpeq_epi8(c, zero)));
    }
    return _mm256_movemask_epi8(ok) == -1 && nc_valid_scalar(p + i, n - i, floor, top);
}

/* 4 codes -> 4 int64: 2^(m - lo) (0 for m = 0: the shift count wraps past 63), negated where bit 7 */
AVX2 static inline __m256i nc_int4_avx2(const uint8_t *p, __m256i vlo)
{
    int32_t four;
    memcpy(&four, p, 4); /* p may sit anywhere (a round's codes from its second) */
    __m128i b = _mm_cvtsi32_si128(four);
    __m256i m = _mm256_and_si256(_mm256_cvtepu8_epi64(b), _mm256_set1_epi64x(0x7F));
    __m256i x = _mm256_sllv_epi64(_mm256_set1_epi64x(1), _mm256_sub_epi64(m, vlo));
    __m256i neg = _mm256_cmpgt_epi64(_mm256_setzero_si256(), _mm256_cvtepi8_epi64(b));
    return _mm256_sub_epi64(_mm256_xor_si256(x, neg), neg);
}

AVX2 static void nc_values_avx2(const uint8_t *p, uint32_t n, int floor, int64_t *v, int add)
{
    const __m256i vlo = _mm256_set1_epi64x(floor + INA_NC_BIAS);
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256i x = nc_int4_avx2(p + i, vlo);
        if (add)
            x = _mm256_add_epi64(x, _mm256_loadu_si256((const __m256i *)(v + i)));
        _mm256_storeu_si256((__m256i *)(v + i), x);
    }
    nc_values_scalar(p + i, n - i, floor, v + i, add);
}

/* low 64 bits of a * c, from 32x32->64 products: lo*lo + ((hi*lo + lo*hi) << 32) */
AVX2 static inline __m256i mul64c_avx2(__m256i a, uint64_t c)
{
    const __m256i clo = _mm256_set1_epi64x((int64_t)(c & 0xFFFFFFFFu)), chi = _mm256_set1_epi64x((int64_t)(c >> 32));
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), clo), _mm256_mul_epu32(a, chi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, clo), _mm256_slli_epi64(cross, 32));
}

AVX2 static inline __m256i mix_avx2(__m256i z) /* ina_rng_mix */
{
    z = mul64c_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xBF58476D1CE4E5B9ULL);
    z = mul64c_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94D049BB133111EBULL);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

/* floor(log2 (mag | 1)), exact: x = mag >> 12 (or mag | 1 when that is 0) is below 2^52, so 2^52 + x is
 * an exact double and x's exponent comes from subtracting 2^52 */
AVX2 static inline __m256i log2_avx2(__m256i mag)
{
    const __m256i magic = _mm256_set1_epi64x(0x4330000000000000LL);
    __m256i big = _mm256_srli_epi64(mag, 12);
    __m256i small = _mm256_cmpeq_epi64(big, _mm256_setzero_si256());
    __m256i x = _mm256_blendv_epi8(big, _mm256_or_si256(mag, _mm256_set1_epi64x(1)), small);
    __m256d d = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(x, magic)), _mm256_castsi256_pd(magic));
    __m256i e = _mm256_sub_epi64(_mm256_srli_epi64(_mm256_castpd_si256(d), 52), _mm256_set1_epi64x(1023));
    return _mm256_add_epi64(e, _mm256_andnot_si256(small, _mm256_set1_epi64x(12)));
}

/* 4 sums -> 4 codes in int64 lanes (ina_nc_sum_code); u: the lanes' uniforms (pairs_avx2). Compares are
 * signed: u >> (64 - a) and rem are both below 2^63. */
AVX2 static inline __m256i nc_code4_avx2(__m256i s, __m256i vfloor, int det, __m256i u, __m256i *over)
{
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi64x(1), max = _mm256_set1_epi64x(INA_NC_LEVEL_MAX);
    __m256i neg = _mm256_cmpgt_epi64(zero, s);
    __m256i mag = _mm256_sub_epi64(_mm256_xor_si256(s, neg), neg);
    __m256i a = log2_avx2(mag);
    __m256i up; /* 0 or 1; a = 0 gives 0 either way (shift counts past 63 give 0, rem is 0 or mag is 0) */
    if (det) {
        up = _mm256_and_si256(_mm256_srlv_epi64(mag, _mm256_sub_epi64(a, one)), one); /* bit a-1 = rem >= half */
    } else {
        __m256i rem = _mm256_xor_si256(mag, _mm256_sllv_epi64(one, a));
        __m256i w = _mm256_srlv_epi64(u, _mm256_sub_epi64(_mm256_set1_epi64x(64), a));
        up = _mm256_and_si256(_mm256_cmpgt_epi64(rem, w), _mm256_cmpeq_epi64(_mm256_cmpeq_epi64(mag, zero), zero));
        up = _mm256_and_si256(up, one);
    }
    __m256i level = _mm256_add_epi64(_mm256_add_epi64(vfloor, a), up);
    __m256i high = _mm256_cmpgt_epi64(level, max), nz = _mm256_xor_si256(_mm256_cmpeq_epi64(mag, zero), _mm256_set1_epi64x(-1));
    *over = _mm256_or_si256(*over, _mm256_and_si256(high, nz));
    level = _mm256_blendv_epi8(level, max, high);
    __m256i code = _mm256_or_si256(_mm256_add_epi64(level, _mm256_set1_epi64x(INA_NC_BIAS)),
                                   _mm256_and_si256(neg, _mm256_set1_epi64x(0x80)));
    return _mm256_and_si256(code, nz);
}

/* the keyed counters of words j .. j + 3 (ina_rng_word's before the mix) */
AVX2 static inline __m256i counters4_avx2(uint64_t key, uint64_t j)
{
    return _mm256_setr_epi64x((int64_t)(key + j * INA_RNG_GAMMA), (int64_t)(key + (j + 1) * INA_RNG_GAMMA),
                              (int64_t)(key + (j + 2) * INA_RNG_GAMMA), (int64_t)(key + (j + 3) * INA_RNG_GAMMA));
}

/* the uniforms of 4 elements from words w (ina_rng_pair_word): words 0, 0, 1, 1 (hi: 2, 2, 3, 3), the even
 * elements' with their halves swapped */
AVX2 static inline __m256i pairs_avx2(__m256i w, int hi)
{
    __m256i x = hi ? _mm256_permute4x64_epi64(w, 0xFA) : _mm256_permute4x64_epi64(w, 0x50);
    return _mm256_blend_epi32(x, _mm256_shuffle_epi32(x, 0xB1), 0x33);
}

/* base even (nc_finish_round): element base + 2 j's word is base / 2 + j */
AVX2 static int nc_finish_avx2(const int64_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                               uint8_t *res)
{
    const __m256i vfloor = _mm256_set1_epi64x(floor), low_dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i step = _mm256_set1_epi64x((int64_t)(4 * INA_RNG_GAMMA));
    __m256i z = counters4_avx2(key, base >> 1), over = _mm256_setzero_si256();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8, z = _mm256_add_epi64(z, step)) {
        __m256i w = det ? _mm256_setzero_si256() : mix_avx2(z); /* det: no draws */
        __m256i c0 = nc_code4_avx2(_mm256_loadu_si256((const __m256i *)(acc + i)), vfloor, det, pairs_avx2(w, 0), &over);
        __m256i c1 = nc_code4_avx2(_mm256_loadu_si256((const __m256i *)(acc + i + 4)), vfloor, det, pairs_avx2(w, 1),
                                   &over);
        __m128i d0 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c0, low_dwords));
        __m128i d1 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c1, low_dwords));
        __m128i p = _mm_packus_epi32(d0, d1); /* codes < 256: the packs never saturate */
        _mm_storel_epi64((__m128i *)(res + i), _mm_packus_epi16(p, p));
    }
    return (!_mm256_testz_si256(over, over)) | nc_finish_scalar(acc + i, n - i, floor, det, key, base + i, res + i);
}

/* narrow rounds, 8 int32 lanes */
/* 8 codes -> 8 int32: 2^(m - lo) (0 for m = 0: the shift count wraps past 31), negated where bit 7 */
AVX2 static inline __m256i nc_int8_avx2(const uint8_t *p, __m256i vlo)
{
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i x = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_sub_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), vlo));
    return _mm256_sign_epi32(x, _mm256_slli_epi32(c, 24)); /* -x where bit 7 (x is 0 where c is) */
}

AVX2 static void nc_values32_avx2(const uint8_t *p, uint32_t n, int floor, int32_t *v, int add)
{
    const __m256i vlo = _mm256_set1_epi32(floor + INA_NC_BIAS);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i x = nc_int8_avx2(p + i, vlo);
        if (add)
            x = _mm256_add_epi32(x, _mm256_loadu_si256((const __m256i *)(v + i)));
        _mm256_storeu_si256((__m256i *)(v + i), x);
    }
    nc_values32_scalar(p + i, n - i, floor, v + i, add);
}

/* 8 int32 sums (|s| <= 2^30) -> 8 codes in int32 lanes, as nc_code4_avx2: floor(log2) from the float of
 * |s| | 1, one less where that rounded up to the next power of two; w: the top halves of the lanes' uniforms
 * (a <= 30 bits of one are ever used: the top ones), 4 stream words as they are (ina_rng_pair_word) */
AVX2 static inline __m256i nc_code8_avx2(__m256i s, __m256i vfloor, int det, __m256i w, __m256i *over)
{
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1), max = _mm256_set1_epi32(INA_NC_LEVEL_MAX);
    __m256i neg = _mm256_cmpgt_epi32(zero, s);
    __m256i mag = _mm256_abs_epi32(s), m1 = _mm256_or_si256(mag, one);
    __m256i a = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(m1)), 23), _mm256_set1_epi32(127));
    a = _mm256_add_epi32(a, _mm256_cmpgt_epi32(_mm256_sllv_epi32(one, a), m1));
    __m256i up; /* 0 or 1; a = 0 gives 0 (shift counts past 31 give 0; rem is 0, or mag is 0 and masked) */
    if (det) {
        up = _mm256_and_si256(_mm256_srlv_epi32(mag, _mm256_sub_epi32(a, one)), one);
    } else {
        __m256i rem = _mm256_xor_si256(mag, _mm256_sllv_epi32(one, a));
        __m256i top = _mm256_srlv_epi32(w, _mm256_sub_epi32(_mm256_set1_epi32(32), a));
        up = _mm256_and_si256(_mm256_cmpgt_epi32(rem, top), one);
    }
    __m256i level = _mm256_add_epi32(_mm256_add_epi32(vfloor, a), up);
    __m256i high = _mm256_cmpgt_epi32(level, max), nz = _mm256_xor_si256(_mm256_cmpeq_epi32(mag, zero), _mm256_set1_epi32(-1));
    *over = _mm256_or_si256(*over, _mm256_and_si256(high, nz));
    level = _mm256_blendv_epi8(level, max, high);
    __m256i code = _mm256_or_si256(_mm256_add_epi32(level, _mm256_set1_epi32(INA_NC_BIAS)),
                                   _mm256_and_si256(neg, _mm256_set1_epi32(0x80)));
    return _mm256_and_si256(code, nz);
}

/* 8 int32 codes (0..255) to 8 bytes in order */
AVX2 static inline void store_codes8_avx2(uint8_t *res, __m256i c)
{
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c, c), c); /* per half: its 4 codes in bytes 0..3 */
    _mm_storel_epi64((__m128i *)res, _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* the narrow finish, with the round's last packet's codes added first when p is not NULL; base even
 * (nc_finish_round): 8 elements' uniforms are the top halves of 4 words, in order */
AVX2 static inline int nc_finish32_body(const uint8_t *p, const int32_t *acc, uint32_t n, int floor, int det,
                                        uint64_t key, uint64_t base, uint8_t *res, uint32_t *done)
{
    const __m256i vfloor = _mm256_set1_epi32(floor), vlo = _mm256_set1_epi32(floor + INA_NC_BIAS);
    const __m256i step = _mm256_set1_epi64x((int64_t)(4 * INA_RNG_GAMMA)), step2 = _mm256_set1_epi64x((int64_t)(8 * INA_RNG_GAMMA));
    __m256i z0 = counters4_avx2(key, base >> 1);
    __m256i over = _mm256_setzero_si256(), w = _mm256_setzero_si256(), w1 = w;
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16, z0 = _mm256_add_epi64(z0, step2)) { /* two groups: their mixes overlap */
        __m256i s0 = _mm256_loadu_si256((const __m256i *)(acc + i)), s1 = _mm256_loadu_si256((const __m256i *)(acc + i + 8));
        if (p) {
            s0 = _mm256_add_epi32(s0, nc_int8_avx2(p + i, vlo));
            s1 = _mm256_add_epi32(s1, nc_int8_avx2(p + i + 8, vlo));
        }
        if (!det) {
            w = mix_avx2(z0);
            w1 = mix_avx2(_mm256_add_epi64(z0, step));
        }
        store_codes8_avx2(res + i, nc_code8_avx2(s0, vfloor, det, w, &over));
        store_codes8_avx2(res + i + 8, nc_code8_avx2(s1, vfloor, det, w1, &over));
    }
    for (; i + 8 <= n; i += 8, z0 = _mm256_add_epi64(z0, step)) {
        __m256i s0 = _mm256_loadu_si256((const __m256i *)(acc + i));
        if (p)
            s0 = _mm256_add_epi32(s0, nc_int8_avx2(p + i, vlo));
        if (!det)
            w = mix_avx2(z0);
        store_codes8_avx2(res + i, nc_code8_avx2(s0, vfloor, det, w, &over));
    }
    *done = i;
    return !_mm256_testz_si256(over, over);
}

AVX2 static int nc_finish32_avx2(const int32_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                                 uint8_t *res)
{
    uint32_t i;
    int over = nc_finish32_body(NULL, acc, n, floor, det, key, base, res, &i);
    return over | nc_finish32_scalar(acc + i, n - i, floor, det, key, base + i, res + i);
}

AVX2 static int nc_add_finish32_avx2(const uint8_t *p, const int32_t *acc, uint32_t n, int floor, int det,
                                     uint64_t key, uint64_t base, uint8_t *res)
{
    uint32_t i;
    int over = nc_finish32_body(p, acc, n, floor, det, key, base, res, &i);
    return over | nc_add_finish32_scalar(p + i, acc + i, n - i, floor, det, key, base + i, res + i);
}

/* narrow int32 rounds, 8 lanes: the wrap test of the scalar path on sign bits */
AVX2 static int int32_values32_avx2(const uint8_t *p, uint32_t n, int32_t *v, int add)
{
    const __m256i bswap = _mm256_broadcastsi128_si256(BSWAP32_LANES(_mm_set_epi8));
    __m256i wrap = _mm256_setzero_si256();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(p + 4 * i)), bswap);
        if (add) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(v + i)), s = _mm256_add_epi32(a, x);
            wrap = _mm256_or_si256(wrap, _mm256_and_si256(_mm256_xor_si256(a, s), _mm256_xor_si256(x, s)));
            x = s;
        }
        _mm256_storeu_si256((__m256i *)(v + i), x);
    }
    int wrapped = _mm256_movemask_ps(_mm256_castsi256_ps(wrap)) != 0;
    return wrapped | int32_values32_scalar(p + 4 * i, n - i, v + i, add);
}

AVX2 static void int32_finish32_avx2(const int32_t *acc, uint32_t n, uint8_t *res)
{
    const __m256i bswap = _mm256_broadcastsi128_si256(BSWAP32_LANES(_mm_set_epi8));
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(res + 4 * i),
                            _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(acc + i)), bswap));
    int32_finish32_scalar(acc + i, n - i, res + 4 * i);
}

/* the round's last packet added as its result is written: its sums never go back to acc */
AVX2 static int int32_add_finish32_avx2(const uint8_t *p, const int32_t *acc, uint32_t n, uint8_t *res)
{
    const __m256i bswap = _mm256_broadcastsi128_si256(BSWAP32_LANES(_mm_set_epi8));
    __m256i wrap = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(p + 4 * i)), bswap);
        __m256i a = _mm256_loadu_si256((const __m256i *)(acc + i)), s = _mm256_add_epi32(a, x);
        wrap = _mm256_or_si256(wrap, _mm256_and_si256(_mm256_xor_si256(a, s), _mm256_xor_si256(x, s)));
        _mm256_storeu_si256((__m256i *)(res + 4 * i), _mm256_shuffle_epi8(s, bswap));
    }
    int wrapped = _mm256_movemask_ps(_mm256_castsi256_ps(wrap)) != 0;
    return wrapped | int32_add_finish32_scalar(p + 4 * i, acc + i, n - (uint32_t)i, res + 4 * i);
}

const ina_lane_ops ina_lanes_avx2 = {"avx2", int32_values_avx2, int32_finish_avx2, nc_valid_avx2, nc_values_avx2,
                                     nc_finish_avx2, NULL, nc_values32_avx2, nc_finish32_avx2,
                                     nc_add_finish32_avx2, int32_values32_avx2, int32_finish32_avx2,
                                     int32_add_finish32_avx2};

/* ------------------------------------------------------------------ AVX-512 */
AVX512 static void int32_values_avx512(const uint8_t *p, uint32_t n, int64_t *v, int add)
{
    const __m256i bswap2 = _mm256_broadcastsi128_si256(BSWAP32_LANES(_mm_set_epi8));
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i be = _mm256_loadu_si256((const __m256i *)(p + 4 * i));
        __m512i x = _mm512_cvtepi32_epi64(_mm256_shuffle_epi8(be, bswap2));
        if (add)
            x = _mm512_add_epi64(x, _mm512_loadu_si512(v + i));
        _mm512_storeu_si512(v + i, x);
    }
    int32_values_scalar(p + 4 * i, n - i, v + i, add);
}

AVX512 static int int32_finish_avx512(const int64_t *acc, uint32_t n, uint8_t *res)
{
    const __m256i bswap2 = _mm256_broadcastsi128_si256(BSWAP32_LANES(_mm_set_epi8));
    const __m512i hi = _mm512_set1_epi64(INT32_MAX), lo = _mm512_set1_epi64(INT32_MIN);
    __mmask8 over = 0;
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512i s = _mm512_loadu_si512(acc + i);
        over |= _mm512_cmpgt_epi64_mask(s, hi) | _mm512_cmplt_epi64_mask(s, lo);
        __m256i w = _mm512_cvtepi64_epi32(s); /* truncates: wraps like the scalar path */
        _mm256_storeu_si256((__m256i *)(res + 4 * i), _mm256_shuffle_epi8(w, bswap2));
    }
    return (over != 0) | int32_finish_scalar(acc + i, n - i, res + 4 * i);
}

AVX512 static int nc_valid_avx512(const uint8_t *p, uint32_t n, int floor, int top)
{
    if (top < floor) /* no level fits: only zeros pass (and span below would wrap) */
        return nc_valid_scalar(p, n, floor, top);
    uint8_t lo, span;
    ina_nc_code_range(floor, top, &lo, &span);
    const __m512i vlo = _mm512_set1_epi8((char)lo), vspan = _mm512_set1_epi8((char)span);
    const __m512i low7 = _mm512_set1_epi8(0x7F);
    __mmask64 bad = 0;
    uint32_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i c = _mm512_loadu_si512(p + i);
        __m512i d = _mm512_sub_epi8(_mm512_and_si512(c, low7), vlo); /* m - lo <= span, unsigned */
        bad |= _mm512_cmpgt_epu8_mask(d, vspan) & _mm512_test_epi8_mask(c, c);
    }
    return !bad && nc_valid_scalar(p + i, n - i, floor, top);
}

/* 8 codes' integers ±2^(m - lo), lo = floor + bias; m = 0 makes the count wrap past 63 and vpsllvq gives 0 */
AVX512 static inline __m512i nc_value8_avx512(const uint8_t *p, __m512i vlo)
{
    const __m512i one = _mm512_set1_epi64(1);
    __m512i c = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));
    __m512i x = _mm512_sllv_epi64(one, _mm512_sub_epi64(_mm512_and_si512(c, _mm512_set1_epi64(0x7F)), vlo));
    return _mm512_mask_sub_epi64(x, _mm512_test_epi64_mask(c, _mm512_set1_epi64(0x80)), _mm512_setzero_si512(), x);
}

AVX512 static void nc_values_avx512(const uint8_t *p, uint32_t n, int floor, int64_t *v, int add)
{
    const __m512i vlo = _mm512_set1_epi64(floor + INA_NC_BIAS);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512i x = nc_value8_avx512(p + i, vlo);
        if (add)
            x = _mm512_add_epi64(x, _mm512_loadu_si512(v + i));
        _mm512_storeu_si512(v + i, x);
    }
    nc_values_scalar(p + i, n - i, floor, v + i, add);
}

AVX512 static inline __m512i mix_avx512(__m512i z) /* ina_rng_mix, vpmullq */
{
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((int64_t)0xBF58476D1CE4E5B9ULL));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((int64_t)0x94D049BB133111EBULL));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* 8 sums -> 8 codes (ina_nc_sum_code), as bytes in the low 8 of the result; u: the lanes' uniforms
 * (pairs_avx512) */
AVX512 static inline __m128i nc_code8_avx512(__m512i s, __m512i vfloor, int det, __m512i u, __mmask8 *over)
{
    const __m512i one = _mm512_set1_epi64(1), max = _mm512_set1_epi64(INA_NC_LEVEL_MAX);
    __mmask8 neg = _mm512_movepi64_mask(s);
    __m512i mag = _mm512_abs_epi64(s); /* INT64_MIN stays 2^63 as unsigned, as in the scalar path */
    __mmask8 nz = _mm512_test_epi64_mask(mag, mag);
    __m512i a = _mm512_sub_epi64(_mm512_set1_epi64(63), _mm512_lzcnt_epi64(_mm512_or_si512(mag, one)));
    __mmask8 up; /* a = 0 gives 0 either way (shift counts past 63 give 0, rem is 0 or mag is 0) */
    if (det) {
        up = _mm512_test_epi64_mask(_mm512_srlv_epi64(mag, _mm512_sub_epi64(a, one)), one); /* rem >= half */
    } else {
        __m512i rem = _mm512_xor_si512(mag, _mm512_sllv_epi64(one, a));
        __m512i w = _mm512_srlv_epi64(u, _mm512_sub_epi64(_mm512_set1_epi64(64), a));
        up = _mm512_cmplt_epu64_mask(w, rem) & nz;
    }
    __m512i level = _mm512_mask_add_epi64(_mm512_add_epi64(vfloor, a), up, _mm512_add_epi64(vfloor, a), one);
    *over |= _mm512_cmpgt_epi64_mask(level, max) & nz;
    __m512i code = _mm512_add_epi64(_mm512_min_epi64(level, max), _mm512_set1_epi64(INA_NC_BIAS));
    code = _mm512_mask_or_epi64(code, neg, code, _mm512_set1_epi64(0x80));
    return _mm512_cvtepi64_epi8(_mm512_maskz_mov_epi64(nz, code));
}

/* the keyed counters of stream words base .. base + 7 (ina_rng_word's before the mix) */
AVX512 static inline __m512i counters8_avx512(uint64_t key, uint64_t base)
{
    return _mm512_add_epi64(_mm512_set1_epi64((int64_t)(key + base * INA_RNG_GAMMA)),
                            _mm512_mullo_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm512_set1_epi64((int64_t)INA_RNG_GAMMA)));
}

/* the uniforms of 8 elements from 8 words w (ina_rng_pair_word): words 0, 0, 1, 1, .. 3 (hi: 4 .. 7), the even
 * elements' with their halves swapped */
AVX512 static inline __m512i pairs_avx512(__m512i w, int hi)
{
    __m512i x = _mm512_permutexvar_epi64(hi ? _mm512_setr_epi64(4, 4, 5, 5, 6, 6, 7, 7) : _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3), w);
    return _mm512_mask_rol_epi64(x, 0x55, x, 32);
}

/* the wide finish, with the round's last packet's values added in registers when p is not NULL (its sums
 * never go back to memory); base even (nc_finish_round): element base + 2 j's word is base / 2 + j */
AVX512 static inline uint32_t nc_finish_body_avx512(const uint8_t *p, const int64_t *acc, uint32_t n, int floor,
                                                    int det, uint64_t key, uint64_t base, uint8_t *res,
                                                    __mmask8 *over)
{
    const __m512i vlo = _mm512_set1_epi64(floor + INA_NC_BIAS), vfloor = _mm512_set1_epi64(floor);
    const __m512i step = _mm512_set1_epi64((int64_t)(8 * INA_RNG_GAMMA));
    __m512i z = counters8_avx512(key, base >> 1), w = _mm512_setzero_si512();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (!det && !(i & 8)) { /* a mix of 8 words every 16 elements */
            w = mix_avx512(z);
            z = _mm512_add_epi64(z, step);
        }
        __m512i s = _mm512_loadu_si512(acc + i);
        if (p)
            s = _mm512_add_epi64(nc_value8_avx512(p + i, vlo), s);
        _mm_storel_epi64((__m128i *)(res + i), nc_code8_avx512(s, vfloor, det, pairs_avx512(w, (i & 8) != 0), over));
    }
    return i;
}

AVX512 static int nc_finish_avx512(const int64_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                                   uint8_t *res)
{
    __mmask8 over = 0;
    uint32_t i = nc_finish_body_avx512(NULL, acc, n, floor, det, key, base, res, &over);
    return (over != 0) | nc_finish_scalar(acc + i, n - i, floor, det, key, base + i, res + i);
}

AVX512 static int nc_add_finish_avx512(const uint8_t *p, const int64_t *acc, uint32_t n, int floor, int det,
                                       uint64_t key, uint64_t base, uint8_t *res)
{
    __mmask8 over = 0;
    uint32_t i = nc_finish_body_avx512(p, acc, n, floor, det, key, base, res, &over), bad = 0;
    for (; i < n; i++)
        res[i] = ina_nc_sum_code(acc[i] + ina_nc_code_int(p[i], floor), floor, det, key, base + i, &bad);
    return (over != 0) | (int)bad;
}

/* narrow rounds, 16 int32 lanes (as the AVX2 twins, with vplzcntd for floor(log2) and masks for signs) */
/* 16 codes -> 16 int32: 2^(m - lo) (0 for m = 0: the shift count wraps past 31), negated where bit 7 */
AVX512 static inline __m512i nc_int16_avx512(const uint8_t *p, __m512i vlo)
{
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i x = _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_sub_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), vlo));
    return _mm512_mask_sub_epi32(x, _mm512_test_epi32_mask(c, _mm512_set1_epi32(0x80)), _mm512_setzero_si512(), x);
}

AVX512 static void nc_values32_avx512(const uint8_t *p, uint32_t n, int floor, int32_t *v, int add)
{
    const __m512i vlo = _mm512_set1_epi32(floor + INA_NC_BIAS);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i x = nc_int16_avx512(p + i, vlo);
        if (add)
            x = _mm512_add_epi32(x, _mm512_loadu_si512(v + i));
        _mm512_storeu_si512(v + i, x);
    }
    nc_values32_scalar(p + i, n - i, floor, v + i, add);
}

/* 16 int32 sums (|s| <= 2^30) -> 16 codes as bytes; w: the top halves of the lanes' uniforms (a <= 30 bits
 * of one are ever used: the top ones), 8 stream words as they are (ina_rng_pair_word) */
AVX512 static inline __m128i nc_code16_avx512(__m512i s, __m512i vfloor, int det, __m512i w, __mmask16 *over)
{
    const __m512i one = _mm512_set1_epi32(1), max = _mm512_set1_epi32(INA_NC_LEVEL_MAX);
    __mmask16 neg = _mm512_movepi32_mask(s);
    __m512i mag = _mm512_abs_epi32(s);
    __mmask16 nz = _mm512_test_epi32_mask(mag, mag);
    __m512i a = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(_mm512_or_si512(mag, one)));
    __mmask16 up; /* a = 0 gives 0 either way (shift counts past 31 give 0; rem is 0, or mag is 0 and masked) */
    if (det) {
        up = _mm512_test_epi32_mask(_mm512_srlv_epi32(mag, _mm512_sub_epi32(a, one)), one); /* rem >= half */
    } else {
        __m512i rem = _mm512_xor_si512(mag, _mm512_sllv_epi32(one, a));
        up = _mm512_cmplt_epu32_mask(_mm512_srlv_epi32(w, _mm512_sub_epi32(_mm512_set1_epi32(32), a)), rem);
    }
    __m512i level = _mm512_add_epi32(vfloor, a);
    level = _mm512_mask_add_epi32(level, up, level, one);
    *over |= _mm512_cmpgt_epi32_mask(level, max) & nz;
    __m512i code = _mm512_add_epi32(_mm512_min_epi32(level, max), _mm512_set1_epi32(INA_NC_BIAS));
    code = _mm512_mask_or_epi32(code, neg, code, _mm512_set1_epi32(0x80));
    return _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(nz, code));
}

/* the narrow finish, with the round's last packet's codes added first when p is not NULL; base even
 * (nc_finish_round): 16 elements' uniforms are the top halves of 8 words, in order */
AVX512 static inline int nc_finish32_body_avx512(const uint8_t *p, const int32_t *acc, uint32_t n, int floor,
                                                 int det, uint64_t key, uint64_t base, uint8_t *res, uint32_t *done)
{
    const __m512i vfloor = _mm512_set1_epi32(floor), vlo = _mm512_set1_epi32(floor + INA_NC_BIAS);
    const __m512i step = _mm512_set1_epi64((int64_t)(8 * INA_RNG_GAMMA));
    __m512i z = counters8_avx512(key, base >> 1), w = _mm512_setzero_si512();
    __mmask16 over = 0;
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16, z = _mm512_add_epi64(z, step)) {
        __m512i s = _mm512_loadu_si512(acc + i);
        if (p)
            s = _mm512_add_epi32(s, nc_int16_avx512(p + i, vlo));
        if (!det)
            w = mix_avx512(z);
        _mm_storeu_si128((__m128i *)(res + i), nc_code16_avx512(s, vfloor, det, w, &over));
    }
    *done = i;
    return over != 0;
}

AVX512 static int nc_finish32_avx512(const int32_t *acc, uint32_t n, int floor, int det, uint64_t key, uint64_t base,
                                     uint8_t *res)
{
    uint32_t i;
    int over = nc_finish32_body_avx512(NULL, acc, n, floor, det, key, base, res, &i);
    return over | nc_finish32_scalar(acc + i, n - i, floor, det, key, base + i, res + i);
}

AVX512 static int nc_add_finish32_avx512(const uint8_t *p, const int32_t *acc, uint32_t n, int floor, int det,
                                         uint64_t key, uint64_t base, uint8_t *res)
{
    uint32_t i;
    int over = nc_finish32_body_avx512(p, acc, n, floor, det, key, base, res, &i);
    return over | nc_add_finish32_scalar(p + i, acc + i, n - i, floor, det, key, base + i, res + i);
}

/* narrow int32 rounds, 16 lanes: (a ^ s) & (x ^ s) by one vpternlogd (0x42: A=a, B=x, C=s), its sign bits the wrap */
AVX512 static int int32_values32_avx512(const uint8_t *p, uint32_t n, int32_t *v, int add)
{
    const __m512i bswap = _mm512_broadcast_i32x4(BSWAP32_LANES(_mm_set_epi8));
    __m512i wrap = _mm512_setzero_si512();
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i x = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 4 * i), bswap);
        if (add) {
            __m512i a = _mm512_loadu_si512(v + i), s = _mm512_add_epi32(a, x);
            wrap = _mm512_or_si512(wrap, _mm512_ternarylogic_epi32(a, x, s, 0x42));
            x = s;
        }
        _mm512_storeu_si512(v + i, x);
    }
    int wrapped = _mm512_movepi32_mask(wrap) != 0;
    return wrapped | int32_values32_scalar(p + 4 * i, n - i, v + i, add);
}

AVX512 static void int32_finish32_avx512(const int32_t *acc, uint32_t n, uint8_t *res)
{
    const __m512i bswap = _mm512_broadcast_i32x4(BSWAP32_LANES(_mm_set_epi8));
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512(res + 4 * i, _mm512_shuffle_epi8(_mm512_loadu_si512(acc + i), bswap));
    int32_finish32_scalar(acc + i, n - i, res + 4 * i);
}

AVX512 static int int32_add_finish32_avx512(const uint8_t *p, const int32_t *acc, uint32_t n, uint8_t *res)
{
    const __m512i bswap = _mm512_broadcast_i32x4(BSWAP32_LANES(_mm_set_epi8));
    __m512i wrap = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i x = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 4 * i), bswap);
        __m512i a = _mm512_loadu_si512(acc + i), s = _mm512_add_epi32(a, x);
        wrap = _mm512_or_si512(wrap, _mm512_ternarylogic_epi32(a, x, s, 0x42));
        _mm512_storeu_si512(res + 4 * i, _mm512_shuffle_epi8(s, bswap));
    }
    int wrapped = _mm512_movepi32_mask(wrap) != 0;
    return wrapped | int32_add_finish32_scalar(p + 4 * i, acc + i, n - (uint32_t)i, res + 4 * i);
}

const ina_lane_ops ina_lanes_avx512 = {"avx512", int32_values_avx512, int32_finish_avx512, nc_valid_avx512,
                                       nc_values_avx512, nc_finish_avx512, nc_add_finish_avx512,
                                       nc_values32_avx512, nc_finish32_avx512, nc_add_finish32_avx512,
                                       int32_values32_avx512, int32_finish32_avx512, int32_add_finish32_avx512};

static const ina_lane_ops *best_supported(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd"))
        return &ina_lanes_avx512;
    return __builtin_cpu_supports("avx2") ? &ina_lanes_avx2 : &ina_lanes_scalar;
}
#else
const ina_lane_ops ina_lanes_avx2 = {"scalar", int32_values_scalar, int32_finish_scalar, nc_valid_scalar,
                                     nc_values_scalar, nc_finish_scalar, NULL, nc_values32_scalar,
                                     nc_finish32_scalar, nc_add_finish32_scalar, int32_values32_scalar,
                                     int32_finish32_scalar, int32_add_finish32_scalar};
const ina_lane_ops ina_lanes_avx512 = {"scalar", int32_values_scalar, int32_finish_scalar, nc_valid_scalar,
                                       nc_values_scalar, nc_finish_scalar, NULL, nc_values32_scalar,
                                       nc_finish32_scalar, nc_add_finish32_scalar, int32_values32_scalar,
                                       int32_finish32_scalar, int32_add_finish32_scalar};
static const ina_lane_ops *best_supported(void) { return &ina_lanes_scalar; }
#endif

/* INA_SWITCH_SIMD=scalar|avx2|avx512 asks for a path (tests, benchmarks); one the CPU lacks falls back to
 * the best it has below it, and the switch reports the name it took (ina_switch_lanes) */
const ina_lane_ops *ina_lanes_pick(void)
{
    const ina_lane_ops *best = best_supported();
    const char *want = getenv("INA_SWITCH_SIMD");
    if (!want || !*want || !strcmp(want, "avx512"))
        return best;
    if (!strcmp(want, "avx2"))
        return best == &ina_lanes_scalar ? best : &ina_lanes_avx2;
    return &ina_lanes_scalar;
}
