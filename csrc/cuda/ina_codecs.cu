/* Fused CUDA codec kernels: NC encode (float32/float16/bfloat16 -> 8-bit codes, stochastic or to nearest, a
 * floor per call or per block, which is also natural dithering), NC decode, raising the floor of existing
 * codes, block exponents, fixed-point quantize/dequantize. C ABI and conventions: ina_cuda.h; the per-thread
 * work: ina_cuda_ops.cuh.
 *
 * Each kernel is one pass over memory: a thread loads vectors of N consecutive elements (the wider of input
 * and output moves 16 bytes per access, the narrower 4 or 8, a warp's access one contiguous stretch), four
 * vectors' loads in flight at once, draws Philox in registers (one 128-bit draw per 4 elements; NC reads a
 * byte per element, so 4 elements take one word of a draw, ina_ncmath.h), computes
 * with the CPU kernels' element functions and stores; grid-stride loops; no random-number tensor; data
 * errors go to a flag word in device memory (one atomicOr per thread that saw one), so nothing waits for
 * the host. Pointers not aligned to a vector, or a stream offset that is not a multiple of 4 (a draw feeds
 * 4 aligned positions), take the one-element-per-thread kernel; the tail of a vectorised launch does too.
 *
 * Built with -DINA_CUDA_EMULATE, the library also exports ina_emu_* twins of the launchers (same arguments,
 * host pointers, the stream ignored) that run the same thread bodies on the CPU: the tests compare them with
 * the CPU codecs where no GPU is. */
#include <cuda_runtime.h>

#include "ina_cuda_ops.cuh"

namespace ina_cuda {
namespace {

constexpr int THREADS = 256;
constexpr int BLOCKS_PER_SM = 16; /* grid-stride: enough resident warps to keep loads in flight */

template <class Op>
__global__ void __launch_bounds__(THREADS)
    map_vec(const typename Op::In *x, typename Op::Out *y, size_t nvec, uint64_t offset, Op op, uint32_t *flags)
{
    uint32_t err = map_vec_body(x, y, nvec, offset, op, blockIdx.x * (size_t)blockDim.x + threadIdx.x,
                                   (size_t)gridDim.x * blockDim.x);
    if (err && flags)
        atomicOr(flags, err);
}

template <class Op>
__global__ void __launch_bounds__(THREADS)
    map_one(const typename Op::In *x, typename Op::Out *y, size_t n, uint64_t offset, Op op, uint32_t *flags)
{
    uint32_t err = map_one_body(x, y, n, offset, op, blockIdx.x * (size_t)blockDim.x + threadIdx.x,
                                (size_t)gridDim.x * blockDim.x);
    if (err && flags)
        atomicOr(flags, err);
}

/* one warp per block of k elements (grid-stride over blocks) */
template <class D>
__global__ void __launch_bounds__(THREADS)
    block_exponents(const typename D::Raw *x, size_t n, size_t k, int vec, int8_t *out, uint32_t *flags)
{
    const unsigned lane = threadIdx.x & 31;
    const size_t nb = (n + k - 1) / k, nwarps = ((size_t)gridDim.x * blockDim.x) >> 5;
    uint32_t err = 0;
    for (size_t b = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5; b < nb; b += nwarps) {
        size_t lo = b * k, hi = lo + k < n ? lo + k : n;
        uint32_t m = __reduce_max_sync(0xFFFFFFFFu, lane_max<D>(x, lo, hi, vec, lane));
        if (lane == 0)
            out[b] = (int8_t)exponent_of(m, &err);
    }
    if (err && flags)
        atomicOr(flags, err);
}

/* blocks for `items` thread-steps: at most BLOCKS_PER_SM per multiprocessor of the current device */
unsigned grid_for(size_t items)
{
    static int sms[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        dev = 0;
    if (!sms[dev]) {
        int c = 0;
        cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
        sms[dev] = c > 0 ? c : 132;
    }
    size_t want = (items + THREADS - 1) / THREADS, cap = (size_t)sms[dev] * BLOCKS_PER_SM;
    return (unsigned)(want < cap ? want : cap);
}

/* how launches run: kernels on a stream */
struct GpuExec {
    cudaStream_t stream;

    template <class Op>
    void vec(const typename Op::In *x, typename Op::Out *y, size_t nvec, uint64_t offset, const Op &op,
             uint32_t *flags) const
    {
        map_vec<Op><<<grid_for((nvec + UNROLL - 1) / UNROLL), THREADS, 0, stream>>>(x, y, nvec, offset, op, flags);
    }
    template <class Op>
    void one(const typename Op::In *x, typename Op::Out *y, size_t n, uint64_t offset, const Op &op,
             uint32_t *flags) const
    {
        map_one<Op><<<grid_for(n), THREADS, 0, stream>>>(x, y, n, offset, op, flags);
    }
    template <class D>
    void exponents(const typename D::Raw *x, size_t n, size_t k, int vec, int8_t *out, uint32_t *flags) const
    {
        size_t nb = (n + k - 1) / k;
        block_exponents<D><<<grid_for(nb * 32), THREADS, 0, stream>>>(x, n, k, vec, out, flags);
    }
    cudaError_t status() const { return cudaGetLastError(); }
};

#ifdef INA_CUDA_EMULATE
/* the same thread bodies on the CPU, with a few "threads" (any count gives the same result: grid-stride) */
struct HostExec {
    static constexpr size_t THREADS_EMU = 7;

    template <class Op>
    void vec(const typename Op::In *x, typename Op::Out *y, size_t nvec, uint64_t offset, const Op &op,
             uint32_t *flags) const
    {
        uint32_t none = 0;
        for (size_t t = 0; t < THREADS_EMU; t++)
            *(flags ? flags : &none) |= map_vec_body(x, y, nvec, offset, op, t, THREADS_EMU);
    }
    template <class Op>
    void one(const typename Op::In *x, typename Op::Out *y, size_t n, uint64_t offset, const Op &op,
             uint32_t *flags) const
    {
        uint32_t none = 0;
        for (size_t t = 0; t < THREADS_EMU; t++)
            *(flags ? flags : &none) |= map_one_body(x, y, n, offset, op, t, THREADS_EMU);
    }
    template <class D>
    void exponents(const typename D::Raw *x, size_t n, size_t k, int vec, int8_t *out, uint32_t *flags) const
    {
        uint32_t none = 0;
        flags = flags ? flags : &none;
        for (size_t b = 0, nb = (n + k - 1) / k; b < nb; b++) {
            size_t lo = b * k, hi = lo + k < n ? lo + k : n;
            uint32_t m = 0;
            for (unsigned lane = 0; lane < 32; lane++) {
                uint32_t a = lane_max<D>(x, lo, hi, vec, lane);
                m = a > m ? a : m;
            }
            uint32_t err = 0;
            out[b] = (int8_t)exponent_of(m, &err);
            *flags |= err;
        }
    }
    cudaError_t status() const { return cudaSuccess; }
};
#endif

bool aligned(const void *p, size_t bytes) { return ((uintptr_t)p % bytes) == 0; }

/* the vectorised body over the aligned whole vectors, the one-element body over the rest */
template <class Op, class Exec>
cudaError_t run_map(const typename Op::In *x, typename Op::Out *y, size_t n, uint64_t offset, Op op,
                    uint32_t *flags, const Exec &ex)
{
    constexpr size_t N = vec_elems<Op>();
    bool vec = aligned(x, N * sizeof(*x)) && aligned(y, N * sizeof(*y)) && (!Op::PHASED || offset % 4 == 0);
    size_t nvec = vec ? n / N : 0, done = nvec * N;
    if (nvec)
        ex.vec(x, y, nvec, offset, op, flags);
    if (done < n) {
        op.rebase(done);
        ex.one(x + done, y + done, n - done, offset + done, op, flags);
    }
    return ex.status();
}

/* calls f with the format tag of dtype */
template <class F> cudaError_t by_dtype(int dtype, F &&f)
{
    switch (dtype) {
    case INA_CUDA_F32:
        return f(F32{});
    case INA_CUDA_F16:
        return f(F16{});
    case INA_CUDA_BF16:
        return f(BF16{});
    default:
        return cudaErrorInvalidValue;
    }
}

template <class Exec>
cudaError_t nc_encode(const void *x, int dtype, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int floor,
                      const int8_t *per_block, size_t k, int span, int det, uint32_t *flags, const Exec &ex)
{
    if (per_block && !k)
        return cudaErrorInvalidValue;
    PerBlock floors = make_per_block(floor, per_block, k, span);
    return by_dtype(dtype, [&](auto d) {
        using D = decltype(d);
        NcEncode<D> op{seed, floors, det};
        return run_map(static_cast<const typename D::Raw *>(x), codes, n, offset, op, flags, ex);
    });
}

template <class Exec>
cudaError_t nc_decode(const uint8_t *codes, size_t n, void *out, int dtype, float divisor, uint32_t *flags,
                      const Exec &ex)
{
    return by_dtype(dtype, [&](auto d) {
        using D = decltype(d);
        return run_map(codes, static_cast<typename D::Raw *>(out), n, 0, NcDecode<D>{divisor}, flags, ex);
    });
}

template <class Exec>
cudaError_t nc_raise_floor(uint8_t *codes, size_t n, uint64_t seed, uint64_t offset, int floor,
                           const int8_t *per_block, size_t k, int span, int det, uint32_t *flags, const Exec &ex)
{
    if (per_block && !k)
        return cudaErrorInvalidValue;
    NcRaise op{seed, make_per_block(floor, per_block, k, span), det};
    return run_map(codes, codes, n, offset, op, flags, ex);
}

template <class Exec>
cudaError_t block_exps(const void *x, int dtype, size_t n, size_t k, int8_t *out, uint32_t *flags, const Exec &ex)
{
    if (!k)
        return cudaErrorInvalidValue;
    return by_dtype(dtype, [&](auto d) {
        using D = decltype(d);
        constexpr size_t N = 16 / sizeof(typename D::Raw);
        if (n)
            ex.template exponents<D>(static_cast<const typename D::Raw *>(x), n, k, aligned(x, 16) && k % N == 0,
                                     out, flags);
        return ex.status();
    });
}

template <class Exec>
cudaError_t fixed_quantize(const void *x, int dtype, size_t n, int32_t *out, int exp, const int8_t *per_block,
                           size_t k, int world, int stochastic, uint64_t seed, uint64_t offset, int big_endian,
                           uint32_t *flags, const Exec &ex)
{
    if ((per_block && !k) || world < 1)
        return cudaErrorInvalidValue;
    PerBlock exps = make_per_block(exp, per_block, k, 0);
    return by_dtype(dtype, [&](auto d) {
        using D = decltype(d);
        FixedQuantize<D> op{seed, exps, world, stochastic, big_endian};
        return run_map(static_cast<const typename D::Raw *>(x), reinterpret_cast<uint32_t *>(out), n, offset, op,
                          flags, ex);
    });
}

template <class Exec>
cudaError_t fixed_dequantize(const int32_t *sums, size_t n, void *out, int dtype, int exp, const int8_t *per_block,
                             size_t k, int world, const Exec &ex)
{
    if ((per_block && !k) || world < 1)
        return cudaErrorInvalidValue;
    PerBlock exps = make_per_block(exp, per_block, k, 0);
    return by_dtype(dtype, [&](auto d) {
        using D = decltype(d);
        FixedDequantize<D> op{exps, world};
        return run_map(reinterpret_cast<const uint32_t *>(sums), static_cast<typename D::Raw *>(out), n, 0, op,
                          (uint32_t *)nullptr, ex);
    });
}

} // namespace
} // namespace ina_cuda

using namespace ina_cuda;

/* the exported launchers (PREFIX ina_cuda_, on the GPU) and, in an emulation build, their CPU twins
 * (PREFIX ina_emu_): one definition of each argument list */
#define INA_CUDA_ENTRY_POINTS(PREFIX, EXEC)                                                                     \
    int PREFIX##nc_encode(const void *x, int dtype, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, \
                          int floor, const int8_t *per_block, size_t k, int span, int det, uint32_t *flags,   \
                          uintptr_t stream)                                                                   \
    {                                                                                                         \
        return (int)nc_encode(x, dtype, n, codes, seed, offset, floor, per_block, k, span, det, flags, EXEC); \
    }                                                                                                         \
    int PREFIX##nc_decode(const uint8_t *codes, size_t n, void *out, int dtype, float divisor,                \
                          uint32_t *flags, uintptr_t stream)                                                  \
    {                                                                                                         \
        return (int)nc_decode(codes, n, out, dtype, divisor, flags, EXEC);                                    \
    }                                                                                                         \
    int PREFIX##nc_raise_floor(uint8_t *codes, size_t n, uint64_t seed, uint64_t offset, int floor,           \
                               const int8_t *per_block, size_t k, int span, int det, uint32_t *flags,         \
                               uintptr_t stream)                                                              \
    {                                                                                                         \
        return (int)nc_raise_floor(codes, n, seed, offset, floor, per_block, k, span, det, flags, EXEC);      \
    }                                                                                                         \
    int PREFIX##block_exponents(const void *x, int dtype, size_t n, size_t k, int8_t *out, uint32_t *flags,   \
                                uintptr_t stream)                                                             \
    {                                                                                                         \
        return (int)block_exps(x, dtype, n, k, out, flags, EXEC);                                             \
    }                                                                                                         \
    int PREFIX##fixed_quantize(const void *x, int dtype, size_t n, int32_t *out, int exp,                     \
                               const int8_t *per_block, size_t k, int world, int stochastic, uint64_t seed,   \
                               uint64_t offset, int big_endian, uint32_t *flags, uintptr_t stream)            \
    {                                                                                                         \
        return (int)fixed_quantize(x, dtype, n, out, exp, per_block, k, world, stochastic, seed, offset,      \
                                   big_endian, flags, EXEC);                                                  \
    }                                                                                                         \
    int PREFIX##fixed_dequantize(const int32_t *sums, size_t n, void *out, int dtype, int exp,                \
                                 const int8_t *per_block, size_t k, int world, uintptr_t stream)              \
    {                                                                                                         \
        return (int)fixed_dequantize(sums, n, out, dtype, exp, per_block, k, world, EXEC);                    \
    }

extern "C" {

int ina_cuda_device_count(int *count) { return (int)cudaGetDeviceCount(count); }
const char *ina_cuda_error_name(int err) { return cudaGetErrorName((cudaError_t)err); }
const char *ina_cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
int ina_cuda_set_device(int device) { return (int)cudaSetDevice(device); }

INA_CUDA_ENTRY_POINTS(ina_cuda_, GpuExec{(cudaStream_t)stream})

#ifdef INA_CUDA_EMULATE
INA_CUDA_ENTRY_POINTS(ina_emu_, ((void)stream, HostExec{}))
#endif

} // extern "C"
