/* Worker-side codec kernels (natural compression, fixed point, block exponents) used by hostlib when built. */
#ifndef INA_KERNELS_H
#define INA_KERNELS_H
#include <stddef.h>
#include <stdint.h>

#define INA_KERNEL_NONFINITE 1 /* NaN or Inf in the input */
#define INA_KERNEL_OVERFLOW 2  /* a level above 2^63 */
#define INA_KERNEL_BAD_CODE 3  /* the invalid NC code 0x80 */

/* NC codes for float32 x, elements offset.. of the stream of seed; values below 2^floor go to 0 / 2^floor */
int ina_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                  int floor);
int ina_nc_decode(const uint8_t *codes, size_t n, float *out);
/* the fixed-point scale floor(INT32_MAX / world) / 2^exp of a block with agreed exponent exp (codecs/fixed.py) */
double ina_fixed_scale(int exp, int world);
/* big-endian int32 of rint(x * scale), clipped to +-limit */
void ina_fixed_quantize(const float *x, size_t n, double scale, int32_t limit, uint8_t *out_be);
/* block exponents of float32 x in blocks of k (the last one short): the rule of codecs/base.py
 * block_exponents. Returns 0, or INA_KERNEL_OVERFLOW if a finite block needs an exponent above EXP_MAX. */
int ina_block_exponents(const float *x, size_t n, size_t k, int8_t *out);
/* float32 of int32 sums / scale(exps[i / k]): codecs/fixed.py decode */
void ina_fixed_dequantize(const int32_t *sums, size_t n, size_t k, const int8_t *exps, int world, float *out);
#endif
