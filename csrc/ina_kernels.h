/* Worker-side codec kernels (natural compression, fixed point) used by hostlib when built. */
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
/* big-endian int32 of rint(x * scale), clipped to +-limit */
void ina_fixed_quantize(const float *x, size_t n, double scale, int32_t limit, uint8_t *out_be);
/* Bloom filter of m bits (m < 2^32), k hashes: hash i of x is bit ((h1 + i*h2) mod 2^32) * m >> 32, with
 * h = mix(key + x * GAMMA), h1 = low 32 bits, h2 = high 32 bits | 1 (hostlib/sparse/index/bloom.py). */
void ina_bloom_insert(const int64_t *x, size_t n, uint32_t k, uint64_t m, uint64_t key, uint8_t *bits);
/* writes the x in [0, size) the filter answers yes for, ascending, up to cap of them; returns how many
 * there are (call again with a larger out when that exceeds cap) */
size_t ina_bloom_query(uint64_t size, const uint8_t *bits, uint32_t k, uint64_t m, uint64_t key, int64_t *out,
                       size_t cap);
#endif
