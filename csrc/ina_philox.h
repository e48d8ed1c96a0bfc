/* Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), exactly as
 * Random123's philox4x32_R(10, ctr, key): the worker codecs' random stream (docs/protocol.md, "Random
 * stream"). Counter-based, so any element is rebuilt alone (a retransmitted packet) and CPU, SIMD and
 * GPU kernels agree bit for bit for the same seed and offset. This header compiles as C (gnu11) and as
 * CUDA C++ (host and device); inaproto/rng.py `philox` is its numpy twin.
 *
 * Element at absolute stream position i, sub-stream s, of a codec seeded with the 64-bit seed:
 *   key  = (seed & 0xFFFFFFFF, seed >> 32)
 *   ctr  = (i >> 2, i >> 34, s, 0)          (each word its low 32 bits)
 *   word = philox4x32_10(ctr, key)[i & 3]    (one 128-bit draw feeds 4 consecutive elements)
 * Sub-streams: 0 the element's main uniform, 1 a second uniform where needed, 2 NC's floor raising (CUDA),
 * 3 the last bits of a float64's NC uniform. NC reads sub-stream 0 a byte per element (ina_ncmath.h,
 * ina_nc_byte: one draw feeds 16 elements); the other codecs a word per element. */
#ifndef INA_PHILOX_H
#define INA_PHILOX_H
#include <stdint.h>

#ifndef INA_HD
#ifdef __CUDACC__
#define INA_HD __host__ __device__ __forceinline__
#else
#define INA_HD static inline
#endif
#endif

#define INA_PHILOX_M0 0xD2511F53u
#define INA_PHILOX_M1 0xCD9E8D57u
#define INA_PHILOX_W0 0x9E3779B9u
#define INA_PHILOX_W1 0xBB67AE85u
#define INA_PHILOX_ROUNDS 10

#define INA_SUB_MAIN 0  /* the element's main uniform */
#define INA_SUB_EXTRA 1 /* a second uniform: NC below the floor, NC's uniform after its byte (bits 9..40) */
#define INA_SUB_RAISE 2 /* raising the floor of existing codes (the CUDA kernels' nc_raise_floor) */
#define INA_SUB_LOW 3   /* bits 41..52 of a float64's NC uniform (ina_nc_code_f64) */

/* one Philox round on x[0..3] with round key (k0, k1) */
INA_HD void ina_philox_round(uint32_t x[4], uint32_t k0, uint32_t k1)
{
    uint64_t p0 = (uint64_t)INA_PHILOX_M0 * x[0];
    uint64_t p1 = (uint64_t)INA_PHILOX_M1 * x[2];
    uint32_t y0 = (uint32_t)(p1 >> 32) ^ x[1] ^ k0;
    uint32_t y2 = (uint32_t)(p0 >> 32) ^ x[3] ^ k1;
    x[0] = y0;
    x[1] = (uint32_t)p1;
    x[2] = y2;
    x[3] = (uint32_t)p0;
}

/* x (the counter, in place) := philox4x32_10(x, (k0, k1)): round, then bump the key, as Random123 */
INA_HD void ina_philox4x32_10(uint32_t x[4], uint32_t k0, uint32_t k1)
{
    for (int r = 0; r < INA_PHILOX_ROUNDS; r++) {
        ina_philox_round(x, k0, k1);
        k0 += INA_PHILOX_W0;
        k1 += INA_PHILOX_W1;
    }
}

/* the 4 words of the draw that feeds elements 4q .. 4q+3 (q = i >> 2) of sub-stream s */
INA_HD void ina_philox_draw(uint64_t seed, uint64_t q, uint32_t s, uint32_t out[4])
{
    out[0] = (uint32_t)q;
    out[1] = (uint32_t)(q >> 32);
    out[2] = s;
    out[3] = 0;
    ina_philox4x32_10(out, (uint32_t)seed, (uint32_t)(seed >> 32));
}

/* the 32-bit word of element i (absolute stream position) of sub-stream s */
INA_HD uint32_t ina_philox_word(uint64_t seed, uint64_t i, uint32_t s)
{
    uint32_t w[4];
    ina_philox_draw(seed, i >> 2, s, w);
    return w[i & 3];
}
#endif
