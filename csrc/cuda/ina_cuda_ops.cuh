/* The per-thread work of the CUDA codec kernels (ina_codecs.cu), as __host__ __device__ code: the kernels run
 * it on the GPU, and a build with -DINA_CUDA_EMULATE runs the very same bodies on the CPU (tests/test_cuda.py
 * checks them there against the CPU codecs, on machines without a GPU).
 *
 * An op maps N consecutive elements in registers: group4() takes 4 elements at stream positions pos0..pos0+3
 * with pos0 % 4 == 0, so one Philox-4x32-10 draw (ina_philox.h) feeds all 4 (NC: one word of it, a byte
 * each; ina_ncmath.h); one() takes a single element
 * at any position (misaligned data and tails). Element arithmetic is ina_ncmath.h's, shared with the CPU
 * kernels, so the codes are bit-identical to theirs. */
#ifndef INA_CUDA_OPS_CUH
#define INA_CUDA_OPS_CUH
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <string.h>

#include "ina_cuda.h"
#include "ina_ncmath.h"

/* unroll hints for the device pass only (the host compiler of the same code knows no such pragma) */
#ifdef __CUDA_ARCH__
#define INA_UNROLL _Pragma("unroll")
#define INA_UNROLL4 _Pragma("unroll 4")
#else
#define INA_UNROLL
#define INA_UNROLL4
#endif

namespace ina_cuda {

/* intrinsics with a host twin, so the bodies also run on the CPU */
INA_HD uint32_t bits_of(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
#endif
}
INA_HD float div_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b); /* IEEE division, whatever fast-math flags say */
#else
    return a / b;
#endif
}
INA_HD uint32_t byte_swap(uint32_t v)
{
#ifdef __CUDA_ARCH__
    return __byte_perm(v, 0, 0x0123);
#else
    return __builtin_bswap32(v);
#endif
}
INA_HD int leading_zeros(uint32_t v)
{
#ifdef __CUDA_ARCH__
    return __clz((int)v);
#else
    return v ? __builtin_clz(v) : 32;
#endif
}

/* element formats: raw storage type, the float32 bits of a raw element (exact widening), raw of a float
 * (round to nearest even, as torch's .to(dtype)) */
struct F32 {
    using Raw = uint32_t;
    INA_HD static uint32_t bits(Raw r) { return r; }
    INA_HD static Raw from(float f) { return bits_of(f); }
};
struct F16 {
    using Raw = uint16_t;
    INA_HD static uint32_t bits(Raw r) { return bits_of(__half2float(__ushort_as_half(r))); }
    INA_HD static Raw from(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct BF16 {
    using Raw = uint16_t;
    INA_HD static uint32_t bits(Raw r) { return (uint32_t)r << 16; } /* bfloat16 is float32's top half */
    INA_HD static Raw from(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

/* the widest memory word (at most 16 bytes) that moves `bytes` */
template <int B> struct WordOf {
    using type = uint4;
};
template <> struct WordOf<8> {
    using type = uint2;
};
template <> struct WordOf<4> {
    using type = uint32_t;
};

/* N elements at p (aligned to the word) into registers, in words of up to 16 bytes */
template <int N, typename E> INA_HD void load_vec(const E *p, E (&v)[N])
{
    constexpr int BYTES = N * (int)sizeof(E);
    using W = typename WordOf<(BYTES < 16 ? BYTES : 16)>::type;
    constexpr int PER = (int)(sizeof(W) / sizeof(E));
    union U {
        W w;
        E e[PER];
    };
    INA_UNROLL
    for (int c = 0; c < N / PER; c++) {
        U u;
        u.w = reinterpret_cast<const W *>(p)[c];
        INA_UNROLL
        for (int j = 0; j < PER; j++)
            v[c * PER + j] = u.e[j];
    }
}

template <int N, typename E> INA_HD void store_vec(E *p, const E (&v)[N])
{
    constexpr int BYTES = N * (int)sizeof(E);
    using W = typename WordOf<(BYTES < 16 ? BYTES : 16)>::type;
    constexpr int PER = (int)(sizeof(W) / sizeof(E));
    union U {
        W w;
        E e[PER];
    };
    INA_UNROLL
    for (int c = 0; c < N / PER; c++) {
        U u;
        INA_UNROLL
        for (int j = 0; j < PER; j++)
            u.e[j] = v[c * PER + j];
        reinterpret_cast<W *>(p)[c] = u.w;
    }
}

/* the floor of an NC block with agreed exponent e and `span` levels (ina_cuda.h; wire.nc_floor and
 * codecs/ditherswitch.py dither_floor) */
INA_HD int floor_of_exp(int e, int span)
{
    if (e == INA_EXP_NONE)
        return INA_NC_LEVEL_MIN;
    int nc = e - INA_NC_SPAN + 1 > INA_NC_LEVEL_MIN ? e - INA_NC_SPAN + 1 : INA_NC_LEVEL_MIN;
    return e - span + 1 > nc ? e - span + 1 : nc;
}

/* a per-element parameter: one value per call, or one per block of k elements (ina_cuda.h) */
struct PerBlock {
    const int8_t *p; /* NULL: `scalar` everywhere */
    int scalar;
    size_t k;
    int shift;   /* log2(k) when k is a power of two (a shift, not a 64-bit division), else -1 */
    int span;    /* > 0: p holds block exponents and floor() derives the floor */
    size_t base; /* index of this launch's element 0 in the caller's array (tail launches start later) */

    INA_HD int raw(size_t j) const
    {
        if (!p)
            return scalar;
        size_t i = j + base;
        return p[shift >= 0 ? i >> shift : i / k];
    }
    INA_HD int floor(size_t j) const
    {
        int v = raw(j);
        return ina_nc_clamp_floor(span > 0 && p ? floor_of_exp(v, span) : v);
    }
};

inline PerBlock make_per_block(int scalar, const int8_t *p, size_t k, int span)
{
    int shift = -1;
    for (int s = 0; s < 63 && p; s++)
        if (((size_t)1 << s) == k)
            shift = s;
    return PerBlock{p, scalar, k, shift, span, 0};
}

/* NC encode: the 4 elements of group4 take the 4 bytes of one word of the main stream (ina_nc_byte); the
 * second uniform is drawn only where an element needs it (a non-zero element below its floor, or a tie:
 * ina_nc_needs_w1_f32) */
template <class D> struct NcEncode {
    using In = typename D::Raw;
    using Out = uint8_t;
    static constexpr bool PHASED = true; /* the vectorised path needs offset % 4 == 0 */
    uint64_t seed;
    PerBlock floors;
    int det;

    INA_HD void group4(const In *x, Out *y, size_t j0, uint64_t pos0, uint32_t *err) const
    {
        uint32_t b[4], h[4] = {0, 0, 0, 0}, w1[4] = {0, 0, 0, 0};
        int f[4], need = 0;
        uint32_t w0 = det ? 0u : ina_philox_word(seed, pos0 >> 2, INA_SUB_MAIN);
        INA_UNROLL
        for (int j = 0; j < 4; j++) {
            b[j] = D::bits(x[j]);
            f[j] = floors.floor(j0 + j);
            h[j] = (w0 >> (8 * j)) & 0xFFu;
            need |= ina_nc_needs_w1_f32(b[j], h[j], f[j], det);
        }
        if (need)
            ina_philox_draw(seed, pos0 >> 2, INA_SUB_EXTRA, w1);
        INA_UNROLL
        for (int j = 0; j < 4; j++)
            y[j] = (Out)ina_nc_code_f32(b[j], h[j], w1[j], f[j], det, err);
    }
    INA_HD void one(In x, Out *y, size_t j, uint64_t pos, uint32_t *err) const
    {
        uint32_t h = det ? 0u : ina_nc_byte(ina_philox_word(seed, pos >> 2, INA_SUB_MAIN), pos);
        *y = (Out)ina_nc_code_f32_lazy(D::bits(x), h, seed, pos, floors.floor(j), det, err);
    }
    void rebase(size_t d) { floors.base += d; }
};

/* NC decode, each value divided by `divisor` in float32 (the DDP mean) before the conversion to the output
 * format: one rounding, as on the CPU */
template <class D> struct NcDecode {
    using In = uint8_t;
    using Out = typename D::Raw;
    static constexpr bool PHASED = false;
    float divisor;

    INA_HD void one(In c, Out *y, size_t, uint64_t, uint32_t *err) const
    {
        *err |= c == 0x80u ? INA_CUDA_FLAG_BAD_CODE : 0u;
        float v = ina_f32_of_bits(ina_nc_decode_bits(c));
        *y = D::from(divisor == 1.0f ? v : div_rn(v, divisor));
    }
    INA_HD void group4(const In *x, Out *y, size_t j0, uint64_t pos0, uint32_t *err) const
    {
        INA_UNROLL
        for (int j = 0; j < 4; j++)
            one(x[j], y + j, j0 + j, pos0 + j, err);
    }
    void rebase(size_t) {}
};

/* P = 2^-d from sub-stream INA_SUB_RAISE: the top d bits of the element's 128-bit uniform are zero; counter
 * word 3 numbers its 32-bit pieces (d <= 126 for codes in [2^-63, 2^63]; pieces drawn only while needed).
 * Not inlined: few codes lie below the floor, and 64 inlined copies per thread would spill registers. */
__host__ __device__ __noinline__ int raise_draw(uint64_t seed, uint64_t pos, int d)
{
    for (uint32_t piece = 0; d > 0; piece++, d -= 32) {
        uint32_t w[4] = {(uint32_t)(pos >> 2), (uint32_t)(pos >> 34), INA_SUB_RAISE, piece};
        ina_philox4x32_10(w, (uint32_t)seed, (uint32_t)(seed >> 32));
        uint32_t lane = (uint32_t)pos & 3u;
        uint32_t word = lane == 0 ? w[0] : lane == 1 ? w[1] : lane == 2 ? w[2] : w[3];
        if (d < 32)
            return (word >> (32 - d)) == 0;
        if (word)
            return 0;
    }
    return 1;
}

/* a code 2^l below the floor 2^f goes to 2^f with probability 2^(l - f), else 0 (sign kept): unbiased, and
 * the result has exactly the law of NC with floor f applied to x (both are {0, 2^f} with mean |x|).
 * Deterministic: 2^(f-1), halfway between 0 and 2^f, goes up (as |x| >= 2^(f-1) does), lower codes to 0. */
INA_HD uint32_t raise_code(uint32_t c, int f, uint64_t seed, uint64_t pos, int det, uint32_t *err)
{
    int m = (int)(c & 0x7Fu), d = f - (m - INA_NC_BIAS);
    if (m == 0 || d <= 0)
        return c;
    if (!(det ? d == 1 : raise_draw(seed, pos, d)))
        return 0;
    if (f > INA_NC_LEVEL_MAX) {
        *err |= INA_CUDA_FLAG_OVERFLOW;
        return c;
    }
    return (c & 0x80u) | (uint32_t)(f + INA_NC_BIAS);
}

struct NcRaise {
    using In = uint8_t;
    using Out = uint8_t;
    static constexpr bool PHASED = false; /* draws per element, and only for codes below the floor */
    uint64_t seed;
    PerBlock floors;
    int det;

    INA_HD void one(In c, Out *y, size_t j, uint64_t pos, uint32_t *err) const
    {
        *y = (Out)raise_code(c, floors.floor(j), seed, pos, det, err);
    }
    INA_HD void group4(const In *x, Out *y, size_t j0, uint64_t pos0, uint32_t *err) const
    {
        INA_UNROLL
        for (int j = 0; j < 4; j++)
            one(x[j], y + j, j0 + j, pos0 + j, err);
    }
    void rebase(size_t d) { floors.base += d; }
};

/* codecs/fixed.py scale_for: floor(INT32_MAX / world) / 2^e, EXP_NONE counting as 0 */
INA_HD double fixed_scale(int e, int world)
{
    return (double)(2147483647 / world) / ina_pow2(e == INA_EXP_NONE ? 0 : e);
}

/* the scale of element j: the double division only where the exponent differs from element j0's */
INA_HD double scale_at(const PerBlock &exps, size_t j, int e0, double s0, int world)
{
    int e = exps.raw(j);
    return e == e0 ? s0 : fixed_scale(e, world);
}

template <class D> struct FixedQuantize {
    using In = typename D::Raw;
    using Out = uint32_t;
    static constexpr bool PHASED = true;
    uint64_t seed;
    PerBlock exps;
    int world, stochastic, big_endian;

    INA_HD Out quant(In x, double scale, uint32_t w0, uint32_t *err) const
    {
        uint32_t b = D::bits(x);
        *err |= (b & 0x7FFFFFFFu) >= 0x7F800000u ? INA_CUDA_FLAG_NONFINITE : 0u;
        double lim = (double)(2147483647 / world);
        float f = ina_f32_of_bits(b);
        uint32_t q = (uint32_t)(stochastic ? ina_fixed_sr(f, scale, lim, w0) : ina_fixed_nearest(f, scale, lim));
        return big_endian ? byte_swap(q) : q;
    }
    INA_HD void group4(const In *x, Out *y, size_t j0, uint64_t pos0, uint32_t *err) const
    {
        uint32_t w[4] = {0, 0, 0, 0};
        if (stochastic)
            ina_philox_draw(seed, pos0 >> 2, INA_SUB_MAIN, w);
        int e0 = exps.raw(j0);
        double s0 = fixed_scale(e0, world);
        INA_UNROLL
        for (int j = 0; j < 4; j++)
            y[j] = quant(x[j], scale_at(exps, j0 + j, e0, s0, world), w[j], err);
    }
    INA_HD void one(In x, Out *y, size_t j, uint64_t pos, uint32_t *err) const
    {
        uint32_t w0 = stochastic ? ina_philox_word(seed, pos, INA_SUB_MAIN) : 0u;
        *y = quant(x, fixed_scale(exps.raw(j), world), w0, err);
    }
    void rebase(size_t d) { exps.base += d; }
};

template <class D> struct FixedDequantize {
    using In = uint32_t;
    using Out = typename D::Raw;
    static constexpr bool PHASED = false;
    PerBlock exps;
    int world;

    INA_HD void one(In s, Out *y, size_t j, uint64_t, uint32_t *) const
    {
        *y = D::from(ina_fixed_value((int32_t)s, fixed_scale(exps.raw(j), world)));
    }
    INA_HD void group4(const In *x, Out *y, size_t j0, uint64_t, uint32_t *) const
    {
        int e0 = exps.raw(j0);
        double s0 = fixed_scale(e0, world);
        INA_UNROLL
        for (int j = 0; j < 4; j++)
            y[j] = D::from(ina_fixed_value((int32_t)x[j], scale_at(exps, j0 + j, e0, s0, world)));
    }
    void rebase(size_t d) { exps.base += d; }
};

/* elements per vector: the wider side (input or output) moves 16 bytes, the other 4 or 8, so each load and
 * store instruction of a warp covers one contiguous stretch; a multiple of 4 (one Philox draw) */
template <class Op> __host__ __device__ constexpr int vec_elems()
{
    return 16 / (int)(sizeof(typename Op::In) > sizeof(typename Op::Out) ? sizeof(typename Op::In)
                                                                          : sizeof(typename Op::Out));
}
constexpr int UNROLL = 4; /* independent vectors per thread and step: loads in flight before any use */

/* thread t of `threads`: vectors t, t + threads, ... of N elements (pos = offset + index), UNROLL at a
 * time with their loads issued first; returns the error flags seen */
template <class Op>
INA_HD uint32_t map_vec_body(const typename Op::In *x, typename Op::Out *y, size_t nvec, uint64_t offset,
                             const Op &op, size_t t, size_t threads)
{
    constexpr int N = vec_elems<Op>();
    uint32_t err = 0;
    for (size_t v0 = t; v0 < nvec; v0 += UNROLL * threads) {
        typename Op::In in[UNROLL][N];
        INA_UNROLL
        for (int u = 0; u < UNROLL; u++)
            if (v0 + u * threads < nvec)
                load_vec<N>(x + (v0 + u * threads) * N, in[u]);
        INA_UNROLL
        for (int u = 0; u < UNROLL; u++) {
            size_t v = v0 + u * threads;
            if (v >= nvec)
                break;
            typename Op::Out out[N];
            INA_UNROLL
            for (int g = 0; g < N; g += 4)
                op.group4(in[u] + g, out + g, v * N + g, offset + v * N + g, &err);
            store_vec<N>(y + v * N, out);
        }
    }
    return err;
}

/* one element per step: misaligned pointers or offsets, and the tail of a vectorised launch */
template <class Op>
INA_HD uint32_t map_one_body(const typename Op::In *x, typename Op::Out *y, size_t n, uint64_t offset, const Op &op,
                             size_t t, size_t threads)
{
    uint32_t err = 0;
    for (size_t j = t; j < n; j += threads)
        op.one(x[j], y + j, j, offset + j, &err);
    return err;
}

/* block exponents (codecs/base.py block_exponents, csrc/ina_kernels.c) from the largest |x| bits m */
INA_HD int exponent_of(uint32_t m, uint32_t *err)
{
    if (m >= 0x7F800000u)
        return INA_EXP_NONFINITE;
    if (m == 0)
        return INA_EXP_NONE;
    int e = (m >> 23) ? (int)(m >> 23) - 126 : (32 - leading_zeros(m)) - 149; /* frexp: |x| < 2^e */
    if (e > INA_EXP_MAX) {
        *err |= INA_CUDA_FLAG_OVERFLOW;
        e = INA_EXP_MAX;
    }
    return e < INA_EXP_MIN ? INA_EXP_MIN : e;
}

/* lane `lane` of 32's max of |x| bits over [lo, hi): 16-byte loads where blocks start aligned (vec) */
template <class D>
INA_HD uint32_t lane_max(const typename D::Raw *x, size_t lo, size_t hi, int vec, unsigned lane)
{
    constexpr int N = 16 / (int)sizeof(typename D::Raw);
    uint32_t m = 0;
    size_t i = lo;
    if (vec) {
        INA_UNROLL4
        for (size_t v = lo / N + lane; v < hi / N; v += 32) {
            typename D::Raw e[N];
            load_vec<N>(x + v * N, e);
            INA_UNROLL
            for (int j = 0; j < N; j++) {
                uint32_t a = D::bits(e[j]) & 0x7FFFFFFFu;
                m = a > m ? a : m;
            }
        }
        i = hi / N * N;
    }
    for (size_t j = i + lane; j < hi; j += 32) {
        uint32_t a = D::bits(x[j]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

} // namespace ina_cuda
#endif
