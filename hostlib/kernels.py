"""The C codec kernels (csrc/ina_kernels.c), used by hostlib.codecs when built; numpy otherwise.

Set INA_KERNELS=numpy to force the numpy reference (benchmarks compare the two).
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


def enabled() -> bool:
    return lib is not None and os.environ.get("INA_KERNELS", "native") != "numpy"


def nc_encode(x: np.ndarray, seed: int, offset: int, deterministic: bool, floor: int):
    """(codes, status) for contiguous float32 or float64 x; status is 0, NONFINITE or OVERFLOW."""
    codes = np.empty(x.size, dtype=np.uint8)
    if x.dtype == np.float64:
        fn, buf = lib.ina_nc_encode_f64, ffi.from_buffer("double[]", x)
    else:
        fn, buf = lib.ina_nc_encode, ffi.from_buffer("float[]", x)
    rc = fn(buf, x.size, ffi.from_buffer("uint8_t[]", codes), seed & MASK64, offset & MASK64, int(deterministic),
            floor)
    return codes, rc


def nc_decode(codes: np.ndarray):
    """(float32 values, status) for contiguous uint8 codes; status is 0 or BAD_CODE."""
    out = np.empty(codes.size, dtype=np.float32)
    rc = lib.ina_nc_decode(ffi.from_buffer("uint8_t[]", codes), codes.size, ffi.from_buffer("float[]", out))
    return out, rc


def fixed_quantize(x32: np.ndarray, scale: float, limit: int) -> np.ndarray:
    """Big-endian int32 (as a '>i4' array) of clip(rint(x * scale), -limit, limit) for contiguous float32 x32."""
    out = np.empty(x32.size, dtype=">i4")
    lib.ina_fixed_quantize(ffi.from_buffer("float[]", x32), x32.size, float(scale), int(limit),
                           ffi.from_buffer("uint8_t[]", out))
    return out


def fixed_quantize_sr(x32: np.ndarray, scale: float, limit: int, seed: int, offset: int) -> np.ndarray:
    """fixed_quantize with stochastic rounding from the stream (seed, offset): codecs/fixed.py's reference."""
    out = np.empty(x32.size, dtype=">i4")
    lib.ina_fixed_quantize_sr(ffi.from_buffer("float[]", x32), x32.size, float(scale), int(limit), seed & MASK64,
                              offset & MASK64, ffi.from_buffer("uint8_t[]", out))
    return out


def block_exponents(x32: np.ndarray, k: int):
    """(int8 exponent per block of k, status) for contiguous float32 x32; status is 0 or OVERFLOW."""
    out = np.empty(-(-x32.size // k), dtype=np.int8)
    rc = lib.ina_block_exponents(ffi.from_buffer("float[]", x32), x32.size, k, ffi.from_buffer("int8_t[]", out))
    return out, rc


def fixed_dequantize(sums: np.ndarray, exps: np.ndarray, world_size: int, k: int) -> np.ndarray:
    """float32 of native int32 sums / scale of each block's agreed exponent (codecs/fixed.py decode)."""
    out = np.empty(sums.size, dtype=np.float32)
    lib.ina_fixed_dequantize(ffi.from_buffer("int32_t[]", sums), sums.size, k, ffi.from_buffer("int8_t[]", exps),
                             world_size, ffi.from_buffer("float[]", out))
    return out
