/* Bloom filter kernels of the sparse path's index codecs (hostlib/sparse/index/bloom.py), bit for bit. */
#ifndef INA_BLOOM_H
#define INA_BLOOM_H
#include <stddef.h>
#include <stdint.h>

/* Bloom filter of m bits (m < 2^32), k hashes: hash i of x is bit ((h1 + i*h2) mod 2^32) * m >> 32, with
 * h = mix(key + x * GAMMA), h1 = low 32 bits, h2 = high 32 bits | 1 (hostlib/sparse/index/bloom.py). */
void ina_bloom_insert(const int64_t *x, size_t n, uint32_t k, uint64_t m, uint64_t key, uint8_t *bits);
/* writes the x in [0, size) the filter answers yes for, ascending, up to cap of them; returns how many
 * there are (call again with a larger out when that exceeds cap) */
size_t ina_bloom_query(uint64_t size, const uint8_t *bits, uint32_t k, uint64_t m, uint64_t key, int64_t *out,
                       size_t cap);
#endif
