/* Worker-side codec kernels, bit-identical to the numpy references in hostlib/codecs/ for the same seed
 * and offset (tests/test_native.py, tests/test_simd.py). The per-element arithmetic is ina_ncmath.h's, shared
 * with the CUDA kernels; this file picks an instruction set at run time (ina_simd_set) and holds the scalar
 * path, which is the reference the AVX2 and AVX-512 paths (ina_kernels_avx2.c, ina_kernels_avx512.c) match. */
#include "ina_kernels.h"

#include <math.h>
#include <string.h>

#include "ina_kernels_ops.h"
#include "ina_wire.h"

const ina_kernel_ops ina_ops_scalar = {
    "scalar", ina_scalar_nc_encode, ina_scalar_nc_decode, ina_scalar_fixed_nearest, ina_scalar_fixed_sr,
    ina_scalar_fixed_value, ina_scalar_dither_natural, ina_scalar_dither_standard, ina_scalar_philox_fill,
    ina_scalar_nc_decode, ina_scalar_int32_unwire,
};

static const ina_kernel_ops *const OPS[] = {&ina_ops_scalar, &ina_ops_avx2, &ina_ops_avx512};
static int simd_level = -1; /* -1: not chosen yet (the best the CPU has, on first use) */

int ina_simd_supported(int level)
{
    __builtin_cpu_init();
    switch (level) {
    case INA_SIMD_SCALAR:
        return 1;
    case INA_SIMD_AVX2:
        return __builtin_cpu_supports("avx2");
    case INA_SIMD_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    default:
        return 0;
    }
}

int ina_simd_set(int level)
{
    if (level < 0)
        level = ina_simd_supported(INA_SIMD_AVX512) ? INA_SIMD_AVX512
                : ina_simd_supported(INA_SIMD_AVX2) ? INA_SIMD_AVX2 : INA_SIMD_SCALAR;
    if (!ina_simd_supported(level))
        return -1;
    simd_level = level;
    return 0;
}

int ina_simd_get(void)
{
    if (simd_level < 0)
        ina_simd_set(-1);
    return simd_level;
}

static const ina_kernel_ops *ops(void) { return OPS[ina_simd_get()]; }

int ina_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                  int floor)
{
    return ina_nc_status(ops()->nc_encode(x, n, codes, seed, offset, deterministic, ina_nc_clamp_floor(floor)));
}

int ina_nc_encode_f64(const double *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                      int floor)
{
    ina_stream s0 = {seed, 0, INA_SUB_MAIN, {0, 0, 0, 0}, 0}, s1 = {seed, 0, INA_SUB_EXTRA, {0, 0, 0, 0}, 0};
    ina_stream s3 = {seed, 0, INA_SUB_LOW, {0, 0, 0, 0}, 0};
    uint32_t err = 0;
    floor = ina_nc_clamp_floor(floor);
    for (size_t i = 0; i < n; i++) {
        uint64_t b, p = offset + i;
        memcpy(&b, x + i, 8);
        uint32_t h = deterministic ? 0 : ina_nc_byte(ina_stream_word(&s0, p >> 2), p);
        uint32_t w1 = deterministic ? 0 : ina_stream_word(&s1, p);
        uint32_t w3 = deterministic ? 0 : ina_stream_word(&s3, p);
        codes[i] = (uint8_t)ina_nc_code_f64(b, h, w1, w3, floor, deterministic, &err);
    }
    return ina_nc_status(err);
}

int ina_nc_decode(const uint8_t *codes, size_t n, float *out)
{
    return ops()->nc_decode(codes, n, out) ? INA_KERNEL_BAD_CODE : 0;
}

int ina_nc_decode_stream(const uint8_t *codes, size_t n, float *out)
{
    return ops()->nc_decode_nt(codes, n, out) ? INA_KERNEL_BAD_CODE : 0;
}

void ina_int32_unwire_stream(const uint8_t *be, size_t n, int32_t *out)
{
    ops()->int32_unwire_nt(be, n, out);
}

void ina_int32_unwire_nt(const uint8_t *be, size_t n, int32_t *out)
{
    ina_int32_unwire_stream(be, n, out);
    ina_store_fence();
}

void ina_store_fence(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

int ina_nc_decode_nt(const uint8_t *codes, size_t n, float *out)
{
    int rc = ina_nc_decode_stream(codes, n, out);
    ina_store_fence();
    return rc;
}

void ina_fixed_quantize(const float *x, size_t n, double scale, int32_t limit, uint8_t *out_be)
{
    ops()->fixed_nearest(x, n, scale, (double)limit, out_be);
}

void ina_fixed_quantize_sr(const float *x, size_t n, double scale, int32_t limit, uint64_t seed, uint64_t offset,
                           uint8_t *out_be)
{
    ops()->fixed_sr(x, n, scale, (double)limit, seed, offset, out_be);
}

void ina_dither_encode(const float *x, size_t n, double norm, int levels, int standard, uint64_t seed,
                       uint64_t offset, void *codes)
{
    if (standard)
        ops()->dither_standard(x, n, norm, levels, seed, offset, (uint16_t *)codes);
    else
        ops()->dither_natural(x, n, norm, levels, seed, offset, (uint8_t *)codes);
}

void ina_philox_fill(uint64_t seed, uint64_t offset, size_t n, uint32_t substream, uint32_t *out)
{
    ops()->philox_fill(seed, offset, n, substream, out);
}

void ina_philox_raw(uint32_t ctr[4], uint32_t k0, uint32_t k1) { ina_philox4x32_10(ctr, k0, k1); }

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
    const ina_kernel_ops *o = ops();
    for (size_t lo = 0, b = 0; lo < n; lo += k, b++) {
        size_t len = n - lo < k ? n - lo : k;
        o->fixed_value(sums + lo, len, ina_fixed_scale(exps[b], world), out + lo);
    }
}
