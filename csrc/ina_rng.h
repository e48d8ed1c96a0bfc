/* Counter-based random bits, the same stream as hostlib/rng.py: word i of stream (seed, offset) is
 * mix(key(seed) + (offset + i) * GAMMA), SplitMix64's finaliser. No state, so any element of a packet can
 * be rebuilt alone (retransmission) and a vector loop computes lanes independently. */
#ifndef INA_RNG_H
#define INA_RNG_H
#include <stdint.h>

#define INA_RNG_GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t ina_rng_mix(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

static inline uint64_t ina_rng_key(uint64_t seed)
{
    return ina_rng_mix(seed * INA_RNG_GAMMA + 0x632BE59BD9B4E019ULL);
}

/* word for absolute counter c of a stream whose key is k */
static inline uint64_t ina_rng_word(uint64_t k, uint64_t c)
{
    return ina_rng_mix(k + c * INA_RNG_GAMMA);
}

/* the 64-bit uniform of element c of a paired stream (the switch's NC rounding): two elements a word, element
 * 2j gets word j with its halves swapped, 2j + 1 word j, so a rounding that reads at most 32 top bits (every
 * narrow round) reads a half of its own, and a vector of 4 words holds 8 elements' halves in order */
static inline uint64_t ina_rng_pair_word(uint64_t k, uint64_t c)
{
    uint64_t w = ina_rng_word(k, c >> 1);
    return (c & 1) ? w : (w << 32 | w >> 32);
}
#endif
