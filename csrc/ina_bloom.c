/* hostlib/sparse/index/bloom.py's insert and query in C: the same bits as numpy for the same key. */
#include "ina_bloom.h"

#include "ina_rng.h"

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
