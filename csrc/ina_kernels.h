/* Worker-side codec kernels (natural compression, fixed point, dithering, block exponents) used by hostlib
 * when built. Stochastic rounding draws from the Philox stream of ina_philox.h (docs/protocol.md, "Random
 * stream"); each kernel has a scalar, an AVX2 and an AVX-512 path, bit-identical, chosen at run time. */
#ifndef INA_KERNELS_H
#define INA_KERNELS_H
#include <stddef.h>
#include <stdint.h>

#define INA_KERNEL_NONFINITE 1 /* NaN or Inf in the input */
#define INA_KERNEL_OVERFLOW 2  /* |x| >= 2^63, the top level (or a result level above it) */
#define INA_KERNEL_BAD_CODE 3  /* the invalid NC code 0x80 */

#define INA_SIMD_SCALAR 0
#define INA_SIMD_AVX2 1
#define INA_SIMD_AVX512 2

/* whether this CPU runs a path; choose one (-1: the best), 0 or -1 if unsupported; the one in use */
int ina_simd_supported(int level);
int ina_simd_set(int level);
int ina_simd_get(void);

/* n words of the worker codecs' Philox stream (seed, sub-stream) from position offset (ina_philox.h) */
void ina_philox_fill(uint64_t seed, uint64_t offset, size_t n, uint32_t substream, uint32_t *out);
/* ctr := philox4x32_10(ctr, (k0, k1)), for the known-answer tests */
void ina_philox_raw(uint32_t ctr[4], uint32_t k0, uint32_t k1);

/* NC codes for float32 x, elements offset.. of the stream of seed; values below 2^floor go to 0 / 2^floor.
 * Returns 0, INA_KERNEL_NONFINITE (NaN/Inf), or INA_KERNEL_OVERFLOW (some |x| >= 2^INA_NC_LEVEL_MAX). */
int ina_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                  int floor);
/* the same for float64 x, rounded from its 52 mantissa bits with the 52-bit uniform word0 << 20 | word1 >> 12:
 * a double that holds a float gets the float's codes (scalar only) */
int ina_nc_encode_f64(const double *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                      int floor);
int ina_nc_decode(const uint8_t *codes, size_t n, float *out);
/* the same for outputs larger than the caches: out's lines written without being read first (streaming
 * stores: 64 bytes on AVX-512, 32 on AVX2) */
int ina_nc_decode_nt(const uint8_t *codes, size_t n, float *out);
/* ina_nc_decode_nt without its closing fence, for a loop that decodes many packets: ina_store_fence() once
 * before anything else reads out (a fence per 4 KiB packet waits for the write-combining buffers each time) */
int ina_nc_decode_stream(const uint8_t *codes, size_t n, float *out);
/* native int32 of n big-endian int32 (a result's sums) by streaming stores (scalar: plain), fenced; the
 * _stream form unfenced, as ina_nc_decode_stream */
void ina_int32_unwire_nt(const uint8_t *be, size_t n, int32_t *out);
void ina_int32_unwire_stream(const uint8_t *be, size_t n, int32_t *out);
void ina_store_fence(void);
/* the fixed-point scale floor(INT32_MAX / world) / 2^exp of a block with agreed exponent exp (codecs/fixed.py) */
double ina_fixed_scale(int exp, int world);
/* big-endian int32 of rint(x * scale), clipped to +-limit */
void ina_fixed_quantize(const float *x, size_t n, double scale, int32_t limit, uint8_t *out_be);
/* the same with stochastic rounding: floor(x * scale) + 1 iff word0 2^-32 < frac(x * scale), word0 element i's
 * word of the stream (seed, offset + i): unbiased to 2^-32 of a step, and rebuilt bit for bit */
void ina_fixed_quantize_sr(const float *x, size_t n, double scale, int32_t limit, uint64_t seed, uint64_t offset,
                           uint8_t *out_be);
/* dithering level codes of float32 x with the vector's norm (codecs/dithering.py): natural (standard = 0)
 * writes uint8 codes (sign bit 7), standard uint16 (sign bit 15) */
void ina_dither_encode(const float *x, size_t n, double norm, int levels, int standard, uint64_t seed,
                       uint64_t offset, void *codes);
/* block exponents of float32 x in blocks of k (the last one short): the rule of codecs/base.py
 * block_exponents. Returns 0, or INA_KERNEL_OVERFLOW if a finite block needs an exponent above EXP_MAX. */
int ina_block_exponents(const float *x, size_t n, size_t k, int8_t *out);
/* float32 of int32 sums / scale(exps[i / k]): codecs/fixed.py decode */
void ina_fixed_dequantize(const int32_t *sums, size_t n, size_t k, const int8_t *exps, int world, float *out);
#endif
