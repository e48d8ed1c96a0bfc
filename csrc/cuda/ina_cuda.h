/* C ABI of the CUDA codec kernels (ina_codecs.cu), loaded with ctypes by hostlib/cuda.py.
 *
 * Every launcher takes device pointers, enqueues its kernels on `stream` (a cudaStream_t as an integer; 0 is
 * the legacy default stream) and returns the cudaError_t of the launch: no launcher waits for the GPU. Data
 * errors (NaN/Inf, overflow, the invalid code 0x80) are OR-ed into *flags, a uint32 in device memory the
 * caller zeroes and reads when it wants to know (INA_CUDA_FLAG_*).
 *
 * Elements are float32, float16 or bfloat16 (dtype INA_CUDA_F32/F16/BF16); float16/bfloat16 widen to float32
 * exactly first, so their codes are those of the float32 value (docs/protocol.md). Random bits: element j
 * of a call is at absolute stream position offset + j of the Philox stream `seed` (ina_philox.h), so a
 * block encoded alone (a retransmission) gets the codes it gets inside the whole tensor, on the CPU too.
 *
 * Per-block parameters (floors, exponents): `per_block` NULL uses the scalar for every element; otherwise
 * element j uses per_block[j / k] (blocks of k elements from x[0]). With span > 0, per_block holds block
 * exponents and the floor of block b is the one of an NC block with agreed exponent e = per_block[b] and
 * span levels: max(e - span + 1, nc_floor(e)) (span INA_NC_SPAN: nc_floor(e); span s: natural dithering
 * with s levels); INA_EXP_NONE gives INA_NC_LEVEL_MIN. */
#ifndef INA_CUDA_H
#define INA_CUDA_H
#include <stddef.h>
#include <stdint.h>

#define INA_CUDA_F32 0
#define INA_CUDA_F16 1
#define INA_CUDA_BF16 2

#define INA_CUDA_FLAG_NONFINITE 1u /* NaN or Inf in the input */
#define INA_CUDA_FLAG_OVERFLOW 2u  /* |x| >= 2^63 (NC), or a block exponent above INA_EXP_MAX */
#define INA_CUDA_FLAG_BAD_CODE 4u  /* the invalid NC code 0x80 */

#ifdef __cplusplus
extern "C" {
#endif

/* cudaGetDeviceCount; the error's name and text (cudaGetErrorName / cudaGetErrorString) */
int ina_cuda_device_count(int *count);
const char *ina_cuda_error_name(int err);
const char *ina_cuda_error_string(int err);
/* cudaSetDevice: this library's runtime keeps its own current device per host thread */
int ina_cuda_set_device(int device);

/* NC codes of x (n elements) into codes; floor / floors as above; det: round to nearest */
int ina_cuda_nc_encode(const void *x, int dtype, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset,
                       int floor, const int8_t *per_block, size_t k, int span, int det, uint32_t *flags,
                       uintptr_t stream);
/* values of NC codes into out (dtype), each divided by divisor (1: the value itself), rounded once */
int ina_cuda_nc_decode(const uint8_t *codes, size_t n, void *out, int dtype, float divisor, uint32_t *flags,
                       uintptr_t stream);
/* raise the floor of existing codes (in place) to `floor` / per-block floors: a code 2^l below 2^f becomes
 * 2^f with probability 2^(l - f) (sub-stream INA_SUB_RAISE), else 0, keeping its sign; det: 2^(f-1) goes
 * up, lower levels to 0 */
int ina_cuda_nc_raise_floor(uint8_t *codes, size_t n, uint64_t seed, uint64_t offset, int floor,
                            const int8_t *per_block, size_t k, int span, int det, uint32_t *flags, uintptr_t stream);
/* per block of k elements: the smallest e with every |x| < 2^e (hostlib.codecs.base.block_exponents) */
int ina_cuda_block_exponents(const void *x, int dtype, size_t n, size_t k, int8_t *out, uint32_t *flags,
                             uintptr_t stream);
/* fixed point (codecs/fixed.py) with the scale of agreed exponent exp / per_block[j / k] for `world`
 * workers: int32 (big-endian for the wire with big_endian), to nearest or stochastically */
int ina_cuda_fixed_quantize(const void *x, int dtype, size_t n, int32_t *out, int exp, const int8_t *per_block,
                            size_t k, int world, int stochastic, uint64_t seed, uint64_t offset, int big_endian,
                            uint32_t *flags, uintptr_t stream);
/* native int32 sums back to values (dtype) at the same scales */
int ina_cuda_fixed_dequantize(const int32_t *sums, size_t n, void *out, int dtype, int exp, const int8_t *per_block,
                              size_t k, int world, uintptr_t stream);

#ifdef __cplusplus
}
#endif
#endif
