/* Worker-side codec kernels, bit-identical to the numpy references in hostlib/codecs/ for the same seed
 * and offset (tests/test_native.py checks every code). The main loops are branch-free so the compiler
 * can vectorise them; rare cases (values below the floor level) get a second pass. */
#include "ina_kernels.h"

#include <math.h>
#include <string.h>

#include "ina_rng.h"
#include "ina_wire.h"

int ina_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                  int floor)
{
    const uint32_t *bits = (const uint32_t *)x;
    const uint64_t key = ina_rng_key(seed);
    uint32_t bad = 0, below = 0, over = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = bits[i];
        uint32_t e = (b >> 23) & 0xFF, mant = b & 0x7FFFFF;
        int a = (int)e - 127;
        uint32_t up = deterministic ? mant >= (1u << 22)
                                    : (uint32_t)(ina_rng_word(key, offset + i) >> 41) < mant;
        int level = a + (int)up;
        bad |= e == 0xFF;
        below |= a < floor;
        over |= (a >= floor) & (level > INA_NC_LEVEL_MAX);
        codes[i] = (uint8_t)((uint32_t)(level + INA_NC_BIAS) | (b >> 31) << 7);
    }
    if (bad)
        return INA_KERNEL_NONFINITE;
    if (below) {
        /* |x| < 2^floor: 0 or 2^floor, up with probability |x| / 2^floor (exact in double) */
        const double scale = ldexp(1.0, 53 - floor);
        for (size_t i = 0; i < n; i++) {
            int a = (int)((bits[i] >> 23) & 0xFF) - 127;
            if (a >= floor)
                continue;
            double p = fabs((double)x[i]) * scale;
            int up = deterministic ? p >= 0x1p52
                                   : (double)(ina_rng_word(key, offset + i) >> 11) < p;
            over |= up && floor > INA_NC_LEVEL_MAX;
            codes[i] = up ? (uint8_t)((uint32_t)(floor + INA_NC_BIAS) | (bits[i] >> 31) << 7) : 0;
        }
    }
    return over ? INA_KERNEL_OVERFLOW : 0;
}

static inline uint64_t bloom_bit(uint64_t h1, uint64_t h2, uint32_t i, uint64_t m)
{
    return (((h1 + (uint64_t)i * h2) & 0xFFFFFFFFu) * m) >> 32;
}

void ina_bloom_insert(const int64_t *x, size_t n, uint32_t k, uint64_t m, uint64_t key, uint8_t *bits)
{
    for (size_t j = 0; j < n; j++) {
        uint64_t h = ina_rng_word(key, (uint64_t)x[j]);
        uint64_t h1 = h & 0xFFFFFFFFu, h2 = (h >> 32) | 1;
        for (uint32_t i = 0; i < k; i++) {
            uint64_t b = bloom_bit(h1, h2, i, m);
            bits[b >> 3] |= (uint8_t)(0x80 >> (b & 7)); /* np.packbits order: MSB first */
        }
    }
}

size_t ina_bloom_query(uint64_t size, const uint8_t *bits, uint32_t k, uint64_t m, uint64_t key, int64_t *out,
                       size_t cap)
{
    size_t found = 0;
    for (uint64_t x = 0; x < size; x++) {
        uint64_t h = ina_rng_word(key, x);
        uint64_t h1 = h & 0xFFFFFFFFu, h2 = (h >> 32) | 1;
        uint32_t i = 0;
        for (; i < k; i++) {
            uint64_t b = bloom_bit(h1, h2, i, m);
            if (!(bits[b >> 3] & (0x80 >> (b & 7))))
                break;
        }
        if (i == k) {
            if (found < cap)
                out[found] = (int64_t)x;
            found++;
        }
    }
    return found;
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
