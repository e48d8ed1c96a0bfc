"""The GPU codecs: csrc/cuda's fused kernels (hostlib/_ina_cuda.so, built with nvcc at install) through ctypes,
on torch CUDA tensors, and the GPU half of Communicator.allreduce for CUDA tensors.

Kernels (csrc/cuda/ina_cuda.h): NC encode (float32/float16/bfloat16 -> codes, stochastic or to nearest, a
floor per call or per block, so also natural dithering), NC decode, raising the floor of codes, block
exponents, fixed-point quantize/dequantize. Each is one pass with 16-byte loads and Philox in registers; codes
are bit-identical to hostlib.codecs.natural.encode (the CPU) for the same seed and offset.

allreduce of a CUDA tensor with codec "nc" or "dither": each block's exponent and this worker's codes are
made on the GPU (the floor from the worker's own block exponent), only the codes (1 byte per element) go
to the host; when a packet's agreed exponent is higher than this worker's, `raise_floor_host` lifts the
codes below the agreed floor (2^l -> 2^f with probability 2^(l-f), else 0: the same law as encoding with
the agreed floor), and the result codes go back to the GPU once and are decoded there.

`available()` says whether this runs here, and if not, precisely why.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil

import numpy as np

from . import rng, wire
from .codecs import base as codec_base, natural

LIB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ina_cuda.so")
FLAG_NONFINITE, FLAG_OVERFLOW, FLAG_BAD_CODE = 1, 2, 4  # csrc/cuda/ina_cuda.h INA_CUDA_FLAG_*
_DTYPE_CODES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}  # INA_CUDA_F32/F16/BF16
_ERROR_HINTS = {35: "the driver is too old for the CUDA 13 runtime, or there is none",
                100: "no CUDA-capable device is visible (CUDA_VISIBLE_DEVICES?)"}


class CudaError(RuntimeError):
    """A CUDA runtime error from a launcher, with the runtime's name for it."""


_P, _I, _U64, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
# argument lists of the launchers (ina_cuda.h); the last argument of each is the stream
_SIGNATURES = {
    "nc_encode": [_P, _I, _SZ, _P, _U64, _U64, _I, _P, _SZ, _I, _I, _P, _SZ],
    "nc_decode": [_P, _SZ, _P, _I, ctypes.c_float, _P, _SZ],
    "nc_raise_floor": [_P, _SZ, _U64, _U64, _I, _P, _SZ, _I, _I, _P, _SZ],
    "block_exponents": [_P, _I, _SZ, _SZ, _P, _P, _SZ],
    "fixed_quantize": [_P, _I, _SZ, _P, _I, _P, _SZ, _I, _I, _U64, _U64, _I, _P, _SZ],
    "fixed_dequantize": [_P, _SZ, _P, _I, _I, _P, _SZ, _I, _SZ],
}


def declare(lib: ctypes.CDLL, prefix: str = "ina_cuda_") -> dict:
    """The launchers of a loaded library with their argument types: {name: function}. prefix "ina_emu_"
    gives the CPU twins of an emulation build (tests)."""
    fns = {}
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, prefix + name)
        fn.argtypes, fn.restype = args, ctypes.c_int
        fns[name] = fn
    return fns


@functools.lru_cache(maxsize=None)
def _load():
    """(library, launchers, None) or (None, None, why not)."""
    if not os.path.exists(LIB_PATH):
        nvcc = shutil.which("nvcc")
        why = (f"nvcc is at {nvcc}: run `make cuda` or reinstall" if nvcc else "nvcc not found at install")
        return None, None, f"hostlib/_ina_cuda.so not built ({why})"
    try:
        lib = ctypes.CDLL(LIB_PATH)
    except OSError as e:
        return None, None, f"hostlib/_ina_cuda.so does not load: {e}"
    for name in ("error_name", "error_string"):
        getattr(lib, f"ina_cuda_{name}").restype = ctypes.c_char_p
    lib.ina_cuda_device_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
    return lib, declare(lib), None


def error_text(lib, rc: int) -> str:
    """'cudaErrorX: what it means' for a cudaError_t."""
    return f"{lib.ina_cuda_error_name(rc).decode()}: {lib.ina_cuda_error_string(rc).decode()}"


def _device_reason(lib) -> str | None:
    count = ctypes.c_int(0)
    rc = lib.ina_cuda_device_count(ctypes.byref(count))
    if rc:
        hint = f"; {_ERROR_HINTS[rc]}" if rc in _ERROR_HINTS else ""
        return f"no CUDA device: cudaGetDeviceCount returned {rc} ({error_text(lib, rc)}{hint})"
    return None if count.value else "no CUDA device: cudaGetDeviceCount found 0 devices"


def _torch_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch has no CUDA (CPU build: torch {torch.__version__})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    return None


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """Whether the GPU codecs run here: (True, "") or (False, every reason that holds, '; '-joined)."""
    lib, _, why = _load()
    reasons = [why] if lib is None else [_device_reason(lib)]
    reasons.append(_torch_reason())
    reasons = [r for r in reasons if r]
    return (not reasons, "; ".join(reasons))


def _launchers():
    ok, why = available()
    if not ok:
        raise RuntimeError(f"CUDA codecs unavailable: {why}")
    lib, fns, _ = _load()
    return lib, fns


def _launch(name: str, t, *args):
    """Run launcher `name` on t's device and current stream (args without the stream); errors name the CUDA error."""
    import torch

    lib, fns = _launchers()
    rc = lib.ina_cuda_set_device(t.device.index)
    if not rc:
        rc = fns[name](*args, torch.cuda.current_stream(t.device).cuda_stream)
    if rc:
        raise CudaError(f"{name}: {error_text(lib, rc)} (cudaError_t {rc})")


def _on_device(t) -> bool:
    """Whether t lives where the kernels run: a CUDA device (the tests' CPU emulation of the kernels says
    yes to CPU tensors)."""
    return bool(t.is_cuda)


def _dtype_code(t) -> int:
    code = _DTYPE_CODES.get(str(t.dtype))
    if code is None or not _on_device(t):
        raise TypeError(f"expected a CUDA float32/float16/bfloat16 tensor, got {t.dtype} on {t.device}")
    return code


def _flags(t):
    import torch

    return torch.zeros(1, dtype=torch.int32, device=t.device)


def _check_flags(flags):
    """Raise what the kernels flagged (waits for them: the caller asked for a check)."""
    f = int(flags.item())
    if f & FLAG_NONFINITE:
        raise ValueError(natural.NONFINITE_MESSAGE)
    if f & FLAG_BAD_CODE:
        raise ValueError(natural.BAD_CODE_MESSAGE)
    if f & FLAG_OVERFLOW:
        raise OverflowError(natural.OVERFLOW_MESSAGE)


def _per_block(value, k, span: int = 0):
    """(scalar, pointer, k, span) of a floor/exponent given as an int or an int8 CUDA tensor per block of k."""
    if isinstance(value, (int, np.integer)):
        return int(value), None, 0, 0
    if str(value.dtype) != "torch.int8" or not _on_device(value) or not value.is_contiguous() or not k or k < 1:
        raise TypeError("a per-block floor/exponent is a contiguous int8 CUDA tensor, with k (elements per block)")
    return 0, value.data_ptr(), int(k), int(span)


def _flat(t):
    return t.detach().reshape(-1).contiguous()


def _out(out, like_numel, dtype, device):
    import torch

    if out is None:
        return torch.empty(like_numel, dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() != like_numel or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous {dtype} tensor of {like_numel} elements on {device}")
    return out


def nc_encode(x, seed: int = 0, offset: int = 0, floor=wire.NC_LEVEL_MIN, deterministic: bool = False,
              k: int | None = None, span: int = 0, out=None, check: bool = True):
    """NC codes of a CUDA tensor, on its device and current stream: natural.encode's codes bit for bit.

    Args:
        x: float32/float16/bfloat16 CUDA tensor (any shape; read flat).
        seed, offset: the Philox stream and the position of x's first element in it.
        floor: the lowest level 2^floor (below it: 0 or 2^floor, unbiased), or an int8 CUDA tensor with one
            floor per block of k elements; with span > 0 that tensor holds block exponents and each block's
            floor is max(e - span + 1, nc_floor(e)) (span wire.NC_SPAN: NC; s: natural dithering, s levels).
        deterministic: round to nearest.
        out: a uint8 CUDA tensor of x's size to write into.
        check: wait for the kernel and raise what it flagged (False: no host sync; the codes of bad
            elements are then unspecified).

    Returns:
        uint8 codes, flat.

    Raises:
        ValueError: NaN/Inf; OverflowError: |x| >= 2^63 (with check); CudaError: the launch failed.
    """
    import torch

    xf, dt = _flat(x), _dtype_code(x)
    codes = _out(out, xf.numel(), torch.uint8, x.device)
    scalar, ptr, kk, sp = _per_block(floor, k, span)
    flags = _flags(x)
    _launch("nc_encode", x, xf.data_ptr(), dt, xf.numel(), codes.data_ptr(), seed & rng.MASK64, offset & rng.MASK64,
            scalar, ptr, kk, sp, int(deterministic), flags.data_ptr())
    if check:
        _check_flags(flags)
    return codes


def nc_decode(codes, dtype=None, divisor: float = 1.0, out=None, check: bool = True):
    """Values of NC codes (a uint8 CUDA tensor), each divided by divisor in float32 before rounding to dtype.

    Returns:
        A flat tensor of dtype (default float32) on the codes' device.

    Raises:
        ValueError: the invalid code 0x80 (with check); CudaError: the launch failed.
    """
    import torch

    dtype = dtype or torch.float32
    c = _flat(codes)
    if c.dtype != torch.uint8 or not _on_device(c):
        raise TypeError(f"codes must be a uint8 CUDA tensor, got {c.dtype} on {c.device}")
    values = _out(out, c.numel(), dtype, c.device)
    flags = _flags(c)
    _launch("nc_decode", c, c.data_ptr(), c.numel(), values.data_ptr(), _dtype_code(values), float(divisor),
            flags.data_ptr())
    if check:
        _check_flags(flags)
    return values


def raise_floor(codes, floor, seed: int = 0, offset: int = 0, deterministic: bool = False, k: int | None = None,
                span: int = 0, check: bool = True):
    """Raise the floor of NC codes in place on the GPU (raise_floor_host's twin, bit for bit).

    Args:
        codes: contiguous uint8 CUDA tensor.
        floor, k, span: the new floor, as in nc_encode.
        seed, offset, deterministic: as in nc_encode (sub-stream 2 of the same stream).

    Returns:
        codes.
    """
    import torch

    if codes.dtype != torch.uint8 or not _on_device(codes) or not codes.is_contiguous():
        raise TypeError("codes must be a contiguous uint8 CUDA tensor")
    scalar, ptr, kk, sp = _per_block(floor, k, span)
    flags = _flags(codes)
    _launch("nc_raise_floor", codes, codes.data_ptr(), codes.numel(), seed & rng.MASK64, offset & rng.MASK64, scalar,
            ptr, kk, sp, int(deterministic), flags.data_ptr())
    if check:
        _check_flags(flags)
    return codes


def block_exponents(x, k: int, check: bool = True):
    """Per block of k elements of x (flat), the smallest e with every |x| < 2^e, as int8 on x's device
    (codecs.base.block_exponents: EXP_NONE all zero, EXP_NONFINITE with NaN/Inf).

    Raises:
        OverflowError: a block needs e > EXP_MAX (with check).
    """
    import torch

    xf, dt = _flat(x), _dtype_code(x)
    out = torch.empty(-(-xf.numel() // k), dtype=torch.int8, device=x.device)
    flags = _flags(x)
    _launch("block_exponents", x, xf.data_ptr(), dt, xf.numel(), k, out.data_ptr(), flags.data_ptr())
    if check and int(flags.item()) & FLAG_OVERFLOW:
        raise OverflowError(codec_base.EXPONENT_OVERFLOW_MESSAGE)
    return out


def fixed_quantize(x, exp, world_size: int, k: int | None = None, stochastic: bool = False, seed: int = 0,
                   offset: int = 0, big_endian: bool = False, out=None, check: bool = True):
    """SwitchML fixed point on the GPU (codecs/fixed.py quantize_reference's values, bit for bit).

    Args:
        x: float CUDA tensor.
        exp: the agreed exponent, or an int8 CUDA tensor of them per block of k.
        world_size: workers summing (the clip leaves room for their sum).
        stochastic, seed, offset: stochastic rounding from the Philox stream.
        big_endian: the wire's byte order (else native int32).

    Returns:
        int32, flat.

    Raises:
        ValueError: NaN/Inf (with check).
    """
    import torch

    xf, dt = _flat(x), _dtype_code(x)
    q = _out(out, xf.numel(), torch.int32, x.device)
    scalar, ptr, kk, _ = _per_block(exp, k)
    flags = _flags(x)
    _launch("fixed_quantize", x, xf.data_ptr(), dt, xf.numel(), q.data_ptr(), scalar, ptr, kk, int(world_size),
            int(stochastic), seed & rng.MASK64, offset & rng.MASK64, int(big_endian), flags.data_ptr())
    if check:
        _check_flags(flags)
    return q


def fixed_dequantize(sums, exp, world_size: int, k: int | None = None, dtype=None, out=None):
    """Native int32 sums (a CUDA tensor) back to values at the scales of exp (as fixed_quantize)."""
    import torch

    s = _flat(sums)
    if s.dtype != torch.int32 or not _on_device(s):
        raise TypeError(f"sums must be an int32 CUDA tensor, got {s.dtype} on {s.device}")
    values = _out(out, s.numel(), dtype or torch.float32, s.device)
    scalar, ptr, kk, _ = _per_block(exp, k)
    _launch("fixed_dequantize", s, s.data_ptr(), s.numel(), values.data_ptr(), _dtype_code(values), scalar, ptr, kk,
            int(world_size))
    return values


# ---------------------------------------------------------------- raising the floor on the host

def floor_of_exp(exp: int, span: int) -> int:
    """The floor of a block with agreed exponent exp and span levels: max(exp - span + 1, nc_floor(exp));
    span NC_SPAN is NC's wire.nc_floor, span s natural dithering's dither_floor (csrc/cuda floor_of_exp)."""
    if exp == wire.EXP_NONE:
        return wire.NC_LEVEL_MIN
    return max(exp - span + 1, wire.nc_floor(exp))


def _raise_draws(seed: int, pos: np.ndarray, d: np.ndarray) -> np.ndarray:
    """True with probability 2^-d per element: the top d bits of its 128-bit uniform of sub-stream 2 are zero
    (counter (pos >> 2, pos >> 34, 2, piece), word pos & 3; piece j holds bits 32j..32j+31; csrc raise_draw)."""
    seed = int(seed) & rng.MASK64
    up, d = np.ones(pos.size, dtype=bool), d.copy()
    active, piece = np.arange(pos.size), 0
    while active.size:
        p, r = pos[active], d[active]
        q = p >> np.uint64(2)
        words = rng.philox4x32_10((q, q >> np.uint64(32), rng.SUB_RAISE, piece), (seed, seed >> 32))
        word = np.take_along_axis(words, (p & np.uint64(3)).astype(np.int64)[None], 0)[0]
        short = r < 32
        up[active[short]] = (word[short] >> (32 - r[short]).astype(np.uint64)) == 0
        up[active[~short & (word != 0)]] = False
        active = active[~short & (word == 0) & (r > 32)]
        d[active] -= 32
        piece += 1
    return up


def raise_floor_host(codes: np.ndarray, floor: int, seed: int, offset: int, deterministic: bool = False) -> np.ndarray:
    """NC codes with their floor raised to 2^floor (the kernel's twin): a code 2^l, l < floor, becomes 2^floor
    with probability 2^(l - floor), else 0, sign kept. Unbiased, and the law of the result is exactly that
    of encoding x with the higher floor (both are {0, 2^floor} with mean |x|), so E C^2 = 2^floor |x| either
    way. Deterministic: 2^(floor-1) goes up (as |x| >= 2^(floor-1) does), lower codes to 0. Random bits:
    sub-stream 2 of (seed, offset + index), so a retransmission rebuilds the same packet.

    Args:
        codes: uint8 codes (flat).
        floor: the new lowest level.
        seed, offset: the stream and the position of codes[0] in it.
        deterministic: as above.

    Returns:
        The raised codes: codes itself when none lies below the floor (the common case: only values 2^-55
        below the block's max do with NC).

    Raises:
        OverflowError: a code would go to a floor above 2^63.
    """
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    f = max(int(floor), wire.NC_LEVEL_MIN)
    m = (c & 0x7F).astype(np.int16)
    low = np.flatnonzero((m != 0) & (m < f + wire.NC_BIAS))
    if not low.size:
        return c
    d = f + wire.NC_BIAS - m[low].astype(np.int64)
    if deterministic:
        up = d == 1
    else:
        up = _raise_draws(seed, np.uint64(int(offset) & rng.MASK64) + low.astype(np.uint64), d)
    if f > wire.NC_LEVEL_MAX and up.any():
        raise OverflowError(natural.OVERFLOW_MESSAGE)
    out = c.copy()
    out[low] = np.where(up, (c[low] & 0x80) | (f + wire.NC_BIAS), 0)
    return out


# ---------------------------------------------------------------- allreduce of CUDA tensors

def span_of(codec) -> int:
    """Levels per block: a dither codec's s, NC's NC_SPAN."""
    return int(getattr(codec, "levels", wire.NC_SPAN))


def allreduce_applies(codec, x) -> bool:
    """Whether Communicator.allreduce takes the GPU path for x: a CUDA float32/float16/bfloat16 tensor, codec
    nc or dither, the kernels available, and $INA_CUDA not "0" (which keeps the host path, for comparisons)."""
    return (bool(getattr(x, "is_cuda", False)) and str(x.dtype) in _DTYPE_CODES
            and isinstance(codec, natural.NaturalCodec) and os.environ.get("INA_CUDA", "1") != "0"
            and available()[0])


class PrecodedNC:
    """The allreduce's codec when the codes were made on the GPU: a packet's payload is its block's codes
    (the stream's `flat` is the codes) with the floor raised to the agreed exponent's; everything else is
    the wrapped codec's."""

    def __init__(self, codec):
        self.codec, self.span = codec, span_of(codec)

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def encode(self, block, exp, world_size, seed, offset):
        f = floor_of_exp(int(exp), self.span)
        return raise_floor_host(block, f, seed, offset, self.codec.deterministic).tobytes()


def own_exponents(flat, k: int):
    """This worker's block exponents: (on the device, on the host as int8 numpy)."""
    e = block_exponents(flat, k, check=False)  # a block above EXP_MAX: codec.check_exponents refuses it
    return e, e.cpu().numpy()


def precode(flat, exps_dev, codec, k: int, seed: int) -> np.ndarray:
    """This worker's codes of the whole tensor (stream position = index), each block with the floor of its own
    exponent, copied to the host. Data errors are not raised here: the exponents already carry NaN/Inf to
    every worker (EXP_NONFINITE) and the codec refused overflow."""
    codes = nc_encode(flat, seed, 0, exps_dev, codec.deterministic, k=k, span=span_of(codec), check=False)
    return codes.cpu().numpy()


def decode_like(codes: np.ndarray, like):
    """The result codes decoded on like's device into like's dtype and shape."""
    import torch

    dev = torch.from_numpy(np.ascontiguousarray(codes)).to(like.device)
    return nc_decode(dev, like.dtype).view(like.shape)
