/* Worker-side codec kernels, bit-identical to the numpy references in hostlib/codecs/ for the same seed
 * and offset (tests/test_native.py checks every code). The main loops are branch-free so the compiler
 * can vectorise them; rare cases (values below the floor level) get a second pass. */
#include "ina_kernels.h"

#include <math.h>
#include <string.h>

#include "ina_rng.h"
#include "ina_wire.h"

/* Second pass over the elements below the floor (|x| < 2^floor): 0 or 2^floor, up with probability
 * |x| / 2^floor, exact in double for float and double inputs. Returns 1 where 2^floor is above the top level. */
static int nc_below_floor(const float *x32, const double *x64, size_t n, uint8_t *codes, uint64_t key,
                          uint64_t offset, int deterministic, int floor)
{
    const double scale = ldexp(1.0, 53 - floor);
    int over = 0;
    for (size_t i = 0; i < n; i++) {
        double v = x32 ? (double)x32[i] : x64[i];
        int a;
        frexp(v, &a); /* v = 0.5..1 * 2^a: 2^(a-1) <= |v| */
        if (v != 0.0 && a - 1 >= floor)
            continue;
        double p = fabs(v) * scale;
        int up = deterministic ? p >= 0x1p52 : (double)(ina_rng_word(key, offset + i) >> 11) < p;
        over |= up && floor > INA_NC_LEVEL_MAX;
        codes[i] = up ? (uint8_t)((uint32_t)(floor + INA_NC_BIAS) | (uint32_t)(signbit(v) != 0) << 7) : 0;
    }
    return over;
}

static int nc_status(int bad, int over) { return bad ? INA_KERNEL_NONFINITE : over ? INA_KERNEL_OVERFLOW : 0; }

int ina_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                  int floor)
{
    const uint32_t *bits = (const uint32_t *)x;
    const uint64_t key = ina_rng_key(seed);
    uint32_t bad = 0, below = 0, over = 0;
    floor = floor < INA_NC_LEVEL_MIN ? INA_NC_LEVEL_MIN : floor; /* no code below 2^NC_LEVEL_MIN */
    for (size_t i = 0; i < n; i++) {
        uint32_t b = bits[i];
        uint32_t e = (b >> 23) & 0xFF, mant = b & 0x7FFFFF;
        int a = (int)e - 127;
        uint32_t up = deterministic ? mant >= (1u << 22)
                                    : (uint32_t)(ina_rng_word(key, offset + i) >> 41) < mant;
        bad |= e == 0xFF;
        below |= a < floor;
        over |= a >= INA_NC_LEVEL_MAX; /* |x| >= 2^63, whichever way it would round */
        codes[i] = (uint8_t)((uint32_t)(a + (int)up + INA_NC_BIAS) | (b >> 31) << 7);
    }
    if (!bad && below)
        over |= nc_below_floor(x, NULL, n, codes, key, offset, deterministic, floor);
    return nc_status(bad, over);
}

int ina_nc_encode_f64(const double *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                      int floor)
{
    const uint64_t *bits = (const uint64_t *)x;
    const uint64_t key = ina_rng_key(seed);
    uint32_t bad = 0, below = 0, over = 0;
    floor = floor < INA_NC_LEVEL_MIN ? INA_NC_LEVEL_MIN : floor; /* no code below 2^NC_LEVEL_MIN */
    for (size_t i = 0; i < n; i++) {
        uint64_t b = bits[i];
        uint64_t e = (b >> 52) & 0x7FF, mant = b & 0xFFFFFFFFFFFFFull;
        int a = (int)e - 1023;
        uint32_t up = deterministic ? mant >= (1ull << 51) : (ina_rng_word(key, offset + i) >> 12) < mant;
        bad |= e == 0x7FF;
        below |= a < floor;
        over |= a >= INA_NC_LEVEL_MAX;
        codes[i] = (uint8_t)((uint32_t)(a + (int)up + INA_NC_BIAS) | (uint32_t)(b >> 63) << 7);
    }
    if (!bad && below)
        over |= nc_below_floor(NULL, x, n, codes, key, offset, deterministic, floor);
    return nc_status(bad, over);
}

static float nc_value_f32(uint8_t c)
{
    int m = c & 0x7F;
    float v = m ? ldexpf(1.0f, m - INA_NC_BIAS) : 0.0f;
    return (c & 0x80) ? -v : v;
}

int ina_nc_decode(const uint8_t *codes, size_t n, float *out)
{
    float table[256];
    for (int c = 0; c < 256; c++)
        table[c] = nc_value_f32((uint8_t)c);
    uint8_t invalid = 0;
    for (size_t i = 0; i < n; i++) {
        invalid |= codes[i] == 0x80;
        out[i] = table[codes[i]];
    }
    return invalid ? INA_KERNEL_BAD_CODE : 0;
}

void ina_fixed_quantize(const float *x, size_t n, double scale, int32_t limit, uint8_t *out_be)
{
    const double lim = (double)limit;
    for (size_t i = 0; i < n; i++) {
        double q = rint((double)x[i] * scale); /* round half to even (default mode), as np.rint */
        q = q > lim ? lim : q < -lim ? -lim : q;
        uint32_t v = __builtin_bswap32((uint32_t)(int32_t)q);
        memcpy(out_be + 4 * i, &v, 4);
    }
}

void ina_fixed_quantize_sr(const float *x, size_t n, double scale, int32_t limit, uint64_t seed, uint64_t offset,
                           uint8_t *out_be)
{
    const uint64_t key = ina_rng_key(seed);
    const double lim = (double)limit;
    for (size_t i = 0; i < n; i++) {
        double t = (double)x[i] * scale;
        double lo = floor(t);
        double frac = t - lo; /* exact: t and lo share t's ulp */
        double q = lo + (double)((double)(ina_rng_word(key, offset + i) >> 11) < frac * 0x1p53);
        q = q > lim ? lim : q < -lim ? -lim : q;
        uint32_t v = __builtin_bswap32((uint32_t)(int32_t)q);
        memcpy(out_be + 4 * i, &v, 4);
    }
}

double ina_fixed_scale(int exp, int world)
{
    return (double)(2147483647 / world) / ldexp(1.0, exp == INA_EXP_NONE ? 0 : exp);
}

int ina_block_exponents(const float *x, size_t n, size_t k, int8_t *out)
{
    const uint32_t *bits = (const uint32_t *)x;
    int status = 0;
    for (size_t lo = 0, b = 0; lo < n; lo += k, b++) {
        size_t hi = n - lo < k ? n : lo + k;
        uint32_t m = 0;
        for (size_t i = lo; i < hi; i++) {
            uint32_t a = bits[i] & 0x7FFFFFFFu; /* |x| orders like its bits; NaN and Inf sort last */
            m = a > m ? a : m;
        }
        int e;
        if (m >= 0x7F800000u) {
            out[b] = INA_EXP_NONFINITE;
            continue;
        }
        if (m == 0) {
            out[b] = INA_EXP_NONE;
            continue;
        }
        if (m >> 23)
            e = (int)(m >> 23) - 126; /* frexp: |x| = 0.5..1 * 2^e */
        else
            e = (32 - __builtin_clz(m)) - 149; /* denormal: mant * 2^-149 */
        if (e > INA_EXP_MAX) {
            status = INA_KERNEL_OVERFLOW;
            e = INA_EXP_MAX;
        }
        out[b] = (int8_t)(e < INA_EXP_MIN ? INA_EXP_MIN : e);
    }
    return status;
}

void ina_fixed_dequantize(const int32_t *sums, size_t n, size_t k, const int8_t *exps, int world, float *out)
{
    for (size_t lo = 0, b = 0; lo < n; lo += k, b++) {
        size_t hi = n - lo < k ? n : lo + k;
        double scale = ina_fixed_scale(exps[b], world);
        for (size_t i = lo; i < hi; i++)
            out[i] = (float)((double)sums[i] / scale);
    }
}
