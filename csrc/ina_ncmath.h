/* Per-element codec arithmetic shared by the scalar C kernels, their AVX2/AVX-512 twins (which must match
 * them bit for bit), the CUDA kernels and (as a definition) the numpy references in hostlib/codecs/. Each
 * function takes the element's random words (ina_philox.h), so the callers only differ in how they draw
 * and store. Compiles as C (gnu11) and as CUDA C++ (host and device): integer and IEEE double arithmetic
 * only, every product rounded on its own (INA_DMUL: no fused multiply-add may change a result).
 *
 * NC codes (docs/protocol.md): bit 7 the sign, bits 6..0 m = level + INA_NC_BIAS, 0 for zero. */
#ifndef INA_NCMATH_H
#define INA_NCMATH_H
#include <stdint.h>
#ifndef __CUDA_ARCH__
#include <math.h>
#include <string.h>
#endif

#include "ina_philox.h"
#include "ina_wire.h"

#ifdef __CUDA_ARCH__
#define INA_DMUL(a, b) __dmul_rn((a), (b))
#else
#define INA_DMUL(a, b) ((a) * (b))
#endif

/* error flags the per-element functions OR into *err; ina_nc_status turns them into INA_KERNEL_* */
#define INA_NC_FLAG_NONFINITE 1u /* NaN or Inf */
#define INA_NC_FLAG_OVERFLOW 2u  /* |x| >= 2^INA_NC_LEVEL_MAX, or a level above it */

INA_HD int ina_nc_status(uint32_t flags)
{
    return (flags & INA_NC_FLAG_NONFINITE) ? 1 : (flags & INA_NC_FLAG_OVERFLOW) ? 2 : 0;
}

INA_HD float ina_f32_of_bits(uint32_t b)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

INA_HD double ina_f64_of_bits(uint64_t b)
{
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)b);
#else
    double d;
    memcpy(&d, &b, 8);
    return d;
#endif
}

/* 2^e as a double, exact for -1022 <= e <= 1023 */
INA_HD double ina_pow2(int e) { return ina_f64_of_bits((uint64_t)(e + 1023) << 52); }

/* no code below 2^INA_NC_LEVEL_MIN: every kernel clamps the caller's floor first */
INA_HD int ina_nc_clamp_floor(int floor) { return floor < INA_NC_LEVEL_MIN ? INA_NC_LEVEL_MIN : floor; }

/* whether float32 bits lie below the floor 2^floor (zero and subnormals always do): those read word1 */
INA_HD int ina_nc_below_f32(uint32_t bits, int floor) { return (int)((bits >> 23) & 0xFF) - 127 < floor; }
INA_HD int ina_nc_below_f64(uint64_t bits, int floor) { return (int)((bits >> 52) & 0x7FF) - 1023 < floor; }

/* |x| < 2^floor (|x| as an exact double): 2^floor with probability |x| / 2^floor, else 0. up iff word1 <
 * |x| 2^(32 - floor), exact in double (a power-of-two scaling), so P(up) = ceil(|x| 2^(32-floor)) / 2^32:
 * at most 2^-32 floor units above |x|. Deterministic: up iff |x| >= 2^(floor - 1). */
INA_HD uint32_t ina_nc_below_code(double ax, uint32_t sign, uint32_t w1, int floor, int det, uint32_t *err)
{
    double t = INA_DMUL(ax, ina_pow2(32 - floor));
    int up = det ? t >= 2147483648.0 : (double)w1 < t;
    *err |= (up && floor > INA_NC_LEVEL_MAX) ? INA_NC_FLAG_OVERFLOW : 0u;
    return up ? ((uint32_t)(floor + INA_NC_BIAS) | sign << 7) : 0u;
}

/* NC's uniform. Element i's is a binary fraction whose first 8 bits are its byte h: byte i & 3 (little-endian)
 * of sub-stream 0's word at position i >> 2, so one Philox draw feeds 16 elements; then the 32 bits of word1
 * (sub-stream 1, position i), then those of word3 (sub-stream 3, position i). A float32 adds the top 23 bits,
 * h << 15 | word1 >> 17, to its mantissa bits (a float64 the top 52); the carry into the exponent, the
 * round-up, has probability mantissa / 2^23 exactly. The byte alone decides the carry unless the mantissa's
 * top 8 bits plus h are exactly 0xFF (probability 2^-8 for any value): only then is word1 drawn. */
INA_HD uint32_t ina_nc_byte(uint32_t word, uint64_t i) { return (word >> (8u * (uint32_t)(i & 3))) & 0xFFu; }

/* whether |bits| + (h << 15) leaves the carry to word1: bits 15..22 of the sum are all ones */
INA_HD int ina_nc_tie_f32(uint32_t bits, uint32_t h)
{
    return (((bits & 0x7FFFFFFFu) + (h << 15)) & 0x7F8000u) == 0x7F8000u;
}

/* whether the float32's code reads word1: below the floor and not zero, or a tie at or above it */
INA_HD int ina_nc_needs_w1_f32(uint32_t bits, uint32_t h, int floor, int det)
{
    if (det)
        return 0;
    return ina_nc_below_f32(bits, floor) ? (bits & 0x7FFFFFFFu) != 0 : ina_nc_tie_f32(bits, h);
}

/* NC code of the float32 with bits `bits` at or above the floor (mantissa add): u = h << 15 | word1 >> 17
 * (23 bits) added to |bits| carries into the exponent with probability mantissa / 2^23; deterministic adds
 * 2^22 (round half up). w1 matters only where ina_nc_tie_f32. Returns the code; NaN/Inf and |x| >= 2^63 set
 * *err (whatever the draw). */
INA_HD uint32_t ina_nc_main_code_f32(uint32_t bits, uint32_t h, uint32_t w1, int det, uint32_t *err)
{
    uint32_t b = bits & 0x7FFFFFFFu;
    uint32_t u = det ? 0x400000u : h << 15 | w1 >> 17;
    *err |= (b >= 0x7F800000u ? INA_NC_FLAG_NONFINITE : 0u) |
            (b >= (uint32_t)(INA_NC_LEVEL_MAX + 127) << 23 ? INA_NC_FLAG_OVERFLOW : 0u);
    return (((b + u) >> 23) - (127 - INA_NC_BIAS)) | (bits >> 31) << 7;
}

/* NC code of one float32 (its bits) with its byte h, floor already clamped; w1 is read only where
 * ina_nc_needs_w1_f32 */
INA_HD uint32_t ina_nc_code_f32(uint32_t bits, uint32_t h, uint32_t w1, int floor, int det, uint32_t *err)
{
    uint32_t code = ina_nc_main_code_f32(bits, h, w1, det, err);
    if (!ina_nc_below_f32(bits, floor) || (bits & 0x7FFFFFFFu) >= 0x7F800000u)
        return code;
    return ina_nc_below_code((double)ina_f32_of_bits(bits & 0x7FFFFFFFu), bits >> 31, w1, floor, det, err);
}

/* the same, drawing word1 (sub-stream 1 of element i) only where it is needed */
INA_HD uint32_t ina_nc_code_f32_lazy(uint32_t bits, uint32_t h, uint64_t seed, uint64_t i, int floor, int det,
                                     uint32_t *err)
{
    uint32_t w1 = ina_nc_needs_w1_f32(bits, h, floor, det) ? ina_philox_word(seed, i, INA_SUB_EXTRA) : 0u;
    return ina_nc_code_f32(bits, h, w1, floor, det, err);
}

/* NC code of one float64 (its bits), floor clamped: the mantissa add with the 52-bit uniform
 * u = h << 44 | word1 << 12 | word3 >> 20, whose top 23 bits are the float32's (so a double holding a float32
 * value gets the float's code); below the floor as float32, from word1. Deterministic adds 2^51. */
INA_HD uint32_t ina_nc_code_f64(uint64_t bits, uint32_t h, uint32_t w1, uint32_t w3, int floor, int det,
                                uint32_t *err)
{
    uint64_t b = bits & 0x7FFFFFFFFFFFFFFFull;
    uint32_t sign = (uint32_t)(bits >> 63);
    if (b >= 0x7FF0000000000000ull) {
        *err |= INA_NC_FLAG_NONFINITE;
        return 0;
    }
    *err |= b >= (uint64_t)(INA_NC_LEVEL_MAX + 1023) << 52 ? INA_NC_FLAG_OVERFLOW : 0u;
    if (ina_nc_below_f64(bits, floor))
        return ina_nc_below_code(ina_f64_of_bits(b), sign, w1, floor, det, err);
    uint64_t u = det ? 1ull << 51 : (uint64_t)h << 44 | (uint64_t)w1 << 12 | w3 >> 20;
    return (uint32_t)(((b + u) >> 52) - (1023 - INA_NC_BIAS)) | sign << 7;
}

/* float32 bits of an NC code (0x80, invalid, gives -0: callers flag it) */
INA_HD uint32_t ina_nc_decode_bits(uint32_t code)
{
    uint32_t m = code & 0x7Fu;
    return m ? (m + (127 - INA_NC_BIAS)) << 23 | (code & 0x80u) << 24 : (code & 0x80u) << 24;
}

/* fixed point, rounded to nearest (ties to even, as np.rint): clip(rint(x scale), +-lim) */
INA_HD int32_t ina_fixed_nearest(float x, double scale, double lim)
{
    double q = rint(INA_DMUL((double)x, scale));
    q = q > lim ? lim : q < -lim ? -lim : q;
    return (int32_t)q;
}

/* fixed point, stochastic: t = x scale goes to floor(t) + 1 iff word0 2^-32 < t - floor(t) (exact), so
 * P(up) = ceil(frac 2^32) / 2^32: at most 2^-32 of a step above frac */
INA_HD int32_t ina_fixed_sr(float x, double scale, double lim, uint32_t w0)
{
    double t = INA_DMUL((double)x, scale);
    double lo = floor(t);
    double q = lo + (double)((double)w0 < INA_DMUL(t - lo, 4294967296.0));
    q = q > lim ? lim : q < -lim ? -lim : q;
    return (int32_t)q;
}

/* the float32 of an int32 sum at scale (codecs/fixed.py decode) */
INA_HD float ina_fixed_value(int32_t s, double scale) { return (float)((double)s / scale); }

/* dithering: y = min(|v| / norm, 1), v and norm as float64 (codecs/dithering.py) */
INA_HD double ina_dither_y(double v, double norm)
{
    double y = (v < 0 ? -v : v) / norm;
    return y < 1.0 ? y : 1.0;
}

/* natural dithering level index 0..s of y in [0, 1] (levels 2^(j-s), 0): above 2^(1-s), y = 2^E (1 + m/2^52)
 * goes up a level iff word0 2^-32 < m 2^-52 (exact); below it, to level 1 iff word0 < y 2^(s+31) */
INA_HD uint32_t ina_dither_natural(double y, int s, uint32_t w0)
{
    if (y < ina_pow2(1 - s))
        return (double)w0 < INA_DMUL(y, ina_pow2(s + 31)) ? 1u : 0u;
    uint64_t b;
#ifdef __CUDA_ARCH__
    b = (uint64_t)__double_as_longlong(y);
#else
    memcpy(&b, &y, 8);
#endif
    int e = (int)(b >> 52) - 1023;
    uint64_t m = b & 0xFFFFFFFFFFFFFull;
    return (uint32_t)(e + s) + (((uint64_t)w0 << 20) < m ? 1u : 0u);
}

/* standard dithering level index 0..s of y in [0, 1] (levels j/s): numpy's searchsorted for the level
 * above (table j/s in double), then up iff word0 2^-32 < (y - lo/s) / (hi/s - lo/s) */
INA_HD uint32_t ina_dither_standard(double y, int s, uint32_t w0)
{
    double ds = (double)s;
    int hi = (int)ceil(INA_DMUL(y, ds)); /* within one of the answer: fix it against the table */
    hi = hi < 1 ? 1 : hi > s ? s : hi;
    while (hi > 1 && (double)(hi - 1) / ds >= y)
        hi--;
    while (hi < s && (double)hi / ds < y)
        hi++;
    double tlo = (double)(hi - 1) / ds, thi = (double)hi / ds;
    double p = (y - tlo) / (thi - tlo);
    return (uint32_t)hi - (INA_DMUL((double)w0, 2.3283064365386963e-10) < p ? 0u : 1u);
}
#endif
