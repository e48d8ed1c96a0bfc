"""The C codec kernels (csrc/ina_kernels.c), used by hostlib.codecs when built; numpy otherwise.

Set INA_KERNELS=numpy to force the numpy reference (benchmarks compare the two). Each kernel has a scalar,
an AVX2 and an AVX-512 path, bit-identical; the best the CPU runs is used unless INA_SIMD=scalar|avx2|avx512
forces one (`simd_path` says which is active, `set_simd` switches, for tests and benchmarks). Kernels take
an optional `out=` buffer so a training loop can reuse its arrays.
"""
from __future__ import annotations

import os

import numpy as np

try:
    from ._kernels import ffi, lib
except ImportError:  # not built: the numpy reference serves
    ffi = lib = None

MASK64 = (1 << 64) - 1
# status codes of the kernels (csrc/ina_kernels.h)
NONFINITE, OVERFLOW, BAD_CODE = ((lib.INA_KERNEL_NONFINITE, lib.INA_KERNEL_OVERFLOW, lib.INA_KERNEL_BAD_CODE)
                                 if lib is not None else (1, 2, 3))
SIMD_PATHS = ("scalar", "avx2", "avx512")  # index = INA_SIMD_* in csrc/ina_kernels.h


def enabled() -> bool:
    return lib is not None and os.environ.get("INA_KERNELS", "native") != "numpy"


def simd_supported() -> list[str]:
    """The paths this CPU runs (empty where the kernels are not built)."""
    return [p for i, p in enumerate(SIMD_PATHS) if lib is not None and lib.ina_simd_supported(i)]


def set_simd(path: str | None = None) -> str:
    """Use one path for every kernel (None: the best the CPU has); returns the path now in use.

    Raises:
        ValueError: an unknown path, or one this CPU cannot run.
        RuntimeError: the kernels are not built.
    """
    if lib is None:
        raise RuntimeError("the C kernels are not built (pip install -e .)")
    if path is not None and path not in SIMD_PATHS:
        raise ValueError(f"INA_SIMD: unknown path {path!r}; choose one of {SIMD_PATHS}")
    if lib.ina_simd_set(-1 if path is None else SIMD_PATHS.index(path)) != 0:
        raise ValueError(f"INA_SIMD={path}: this CPU cannot run it (it runs {simd_supported()})")
    return simd_path()


def simd_path() -> str:
    """The path the C kernels use now: "scalar", "avx2" or "avx512" ("numpy" where they are off)."""
    return SIMD_PATHS[lib.ina_simd_get()] if enabled() else "numpy"


if lib is not None:
    set_simd(os.environ.get("INA_SIMD") or None)


def _out(out, size, dtype):
    """out checked (contiguous, dtype, size) or a new array: a wrong buffer would be written out of bounds."""
    if out is None:
        return np.empty(size, dtype=dtype)
    if out.dtype != np.dtype(dtype) or out.size != size or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous {np.dtype(dtype)} array of {size} elements, "
                         f"not {out.dtype} {out.shape}")
    return out


def nc_encode(x: np.ndarray, seed: int, offset: int, deterministic: bool, floor: int, out=None):
    """(codes, status) for contiguous float32 or float64 x; status is 0, NONFINITE or OVERFLOW."""
    codes = _out(out, x.size, np.uint8)
    if x.dtype == np.float64:
        fn, buf = lib.ina_nc_encode_f64, ffi.from_buffer("double[]", x)
    else:
        fn, buf = lib.ina_nc_encode, ffi.from_buffer("float[]", x)
    rc = fn(buf, x.size, ffi.from_buffer("uint8_t[]", codes, require_writable=True), seed & MASK64,
            offset & MASK64, int(deterministic), floor)
    return codes, rc


def nc_decode(codes: np.ndarray, out=None, nt: bool = False):
    """(float32 values, status) for contiguous uint8 codes; status is 0 or BAD_CODE. nt: non-temporal
    stores (the C worker loop's for large outputs)."""
    values = _out(out, codes.size, np.float32)
    rc = (lib.ina_nc_decode_nt if nt else lib.ina_nc_decode)(ffi.from_buffer("uint8_t[]", codes), codes.size,
                           ffi.from_buffer("float[]", values, require_writable=True))
    return values, rc


def int32_unwire_nt(be: np.ndarray, out=None) -> np.ndarray:
    """Native int32 of big-endian int32 (a '>i4' array, a result's sums) by streaming stores: the C worker
    loop's store of a large int32 output."""
    values = _out(out, be.size, np.int32)
    lib.ina_int32_unwire_nt(ffi.from_buffer("uint8_t[]", be.view(np.uint8)), be.size,
                            ffi.from_buffer("int32_t[]", values, require_writable=True))
    return values


def fixed_quantize(x32: np.ndarray, scale: float, limit: int, out=None) -> np.ndarray:
    """Big-endian int32 (as a '>i4' array) of clip(rint(x * scale), -limit, limit) for contiguous float32 x32."""
    q = _out(out, x32.size, ">i4")
    lib.ina_fixed_quantize(ffi.from_buffer("float[]", x32), x32.size, float(scale), int(limit),
                           ffi.from_buffer("uint8_t[]", q, require_writable=True))
    return q


def fixed_quantize_sr(x32: np.ndarray, scale: float, limit: int, seed: int, offset: int, out=None) -> np.ndarray:
    """fixed_quantize with stochastic rounding from the stream (seed, offset): codecs/fixed.py's reference."""
    q = _out(out, x32.size, ">i4")
    lib.ina_fixed_quantize_sr(ffi.from_buffer("float[]", x32), x32.size, float(scale), int(limit), seed & MASK64,
                              offset & MASK64, ffi.from_buffer("uint8_t[]", q, require_writable=True))
    return q


def dither_encode(x32: np.ndarray, norm: float, levels: int, standard: bool, seed: int, offset: int,
                  out=None) -> np.ndarray:
    """Dithering level codes of contiguous float32 x32 with the vector's norm (codecs/dithering.py's
    reference): uint8 for natural, uint16 for standard."""
    codes = _out(out, x32.size, np.uint16 if standard else np.uint8)
    lib.ina_dither_encode(ffi.from_buffer("float[]", x32), x32.size, float(norm), int(levels), int(standard),
                          seed & MASK64, offset & MASK64, ffi.from_buffer("char[]", codes, require_writable=True))
    return codes


def philox(seed: int, offset: int, n: int, substream: int = 0, out=None) -> np.ndarray:
    """n uint32 words of the worker codecs' stream on the active path (inaproto.rng.philox's twin)."""
    words = _out(out, n, np.uint32)
    lib.ina_philox_fill(seed & MASK64, offset & MASK64, n, substream & 0xFFFFFFFF,
                        ffi.from_buffer("uint32_t[]", words, require_writable=True))
    return words


def philox_raw(ctr, key) -> list[int]:
    """Random123's philox4x32_R(10, ctr, key) on one counter (4 words) and key (2 words), in C."""
    c = ffi.new("uint32_t[4]", [int(v) & 0xFFFFFFFF for v in ctr])
    lib.ina_philox_raw(c, int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF)
    return list(c)


def block_exponents(x32: np.ndarray, k: int):
    """(int8 exponent per block of k, status) for contiguous float32 x32; status is 0 or OVERFLOW."""
    out = np.empty(-(-x32.size // k), dtype=np.int8)
    rc = lib.ina_block_exponents(ffi.from_buffer("float[]", x32), x32.size, k, ffi.from_buffer("int8_t[]", out))
    return out, rc


def fixed_dequantize(sums: np.ndarray, exps: np.ndarray, world_size: int, k: int, out=None) -> np.ndarray:
    """float32 of native int32 sums / scale of each block's agreed exponent (codecs/fixed.py decode)."""
    values = _out(out, sums.size, np.float32)
    lib.ina_fixed_dequantize(ffi.from_buffer("int32_t[]", sums), sums.size, k, ffi.from_buffer("int8_t[]", exps),
                             world_size, ffi.from_buffer("float[]", values, require_writable=True))
    return values
