"""cffi (API mode) builders for the native parts; setup.py runs them at install time.

switchsim._native  the aggregator core, its recvmmsg/sendmmsg UDP loop and its shared-memory loop; the
                   benchmarks' packet blaster (ina_blast); the link delay stage's forwarding loop (ina_delay)
hostlib._kernels   NC / fixed-point codec kernels, the worker protocol loop (sendmmsg/recvmmsg or shared-memory
                   rings), the worker's end of the shared-memory transport and its heartbeat thread
switchsim._dpdk    the core behind a DPDK poll loop (only where pkg-config finds libdpdk)

INA_CFLAGS replaces the optimisation flags (default -O3 -march=native: the build runs on the machine
that runs it; set INA_CFLAGS=-O3 for a portable build).
"""
import os
import re
import shlex
import subprocess

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.relpath(HERE, os.getcwd()) if os.path.isabs(HERE) else HERE
# -falign-functions=64: a kernel's loops then sit at the same offsets within the front end's 64-byte windows
# whatever code is added before it (a new function elsewhere in the file moved NC's unchanged AVX2 encode from
# 1.01x to 0.91x np.copyto on a Xeon, 7 alternating runs; aligned, 1.00x; docs/performance.md)
CFLAGS = shlex.split(os.environ.get("INA_CFLAGS", "-O3 -march=native")) + ["-std=gnu11", "-Wall", "-fno-math-errno",
                                                                          "-falign-functions=64"]


def _src(*names):
    return [os.path.join(SRC, n) for n in names]


def cdef_from(*headers) -> str:
    """The headers' declarations for cffi, so each is written once: integer macros keep their literal
    value (cffi needs it for array sizes) or become `#define NAME ...` (the compiler supplies it); string
    and initializer macros (a table of names) are C's alone; include guards and #include lines go."""
    out = []
    for h in headers:
        with open(os.path.join(HERE, h)) as f:
            for line in f:
                literal = re.match(r"#define (INA_\w+)\s+\(?(-?(?:0x[0-9A-Fa-f]+|\d+))\)?\s*(/\*.*)?$", line)
                other = re.match(r"#define (INA_\w+)\s+\S", line)
                if re.match(r"#define INA_\w+\s+[\"{]", line):
                    continue
                if literal:
                    out.append(f"#define {literal[1]} {literal[2]}")
                elif other:
                    out.append(f"#define {other[1]} ...")
                elif not line.startswith("#"):
                    out.append(line.rstrip("\n"))
    return "\n".join(out)


def _ffi(name, header_includes, sources, **kw):
    header_includes = ["ina_wire.h", *header_includes]  # every module exposes the wire constants
    ffi = FFI()
    ffi.cdef(cdef_from(*header_includes))
    ffi.set_source(name, "\n".join(f'#include "{h}"' for h in header_includes), sources=sources,
                   include_dirs=[SRC], extra_compile_args=CFLAGS + kw.pop("cflags", []), **kw)
    return ffi


core_ffi = _ffi("switchsim._native", ["ina_core.h", "ina_udp.h", "ina_shm_switch.h", "ina_blast.h", "ina_delay.h"],
                _src("ina_core.c", "ina_core_simd.c", "ina_udp.c", "ina_shm_switch.c", "ina_blast.c", "ina_delay.c"))
kernels_ffi = _ffi("hostlib._kernels", ["ina_kernels.h", "ina_bloom.h", "ina_shm.h", "ina_cc.h", "ina_worker.h",
                                             "ina_beat.h"],
                   _src("ina_kernels.c", "ina_kernels_avx2.c", "ina_kernels_avx512.c", "ina_bloom.c", "ina_shm.c",
                        "ina_cc.c", "ina_worker.c", "ina_beat.c"),
                   libraries=["m", "pthread"], cflags=["-ffp-contract=off"])  # SIMD files set their own target; no FMA


def dpdk_available() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "libdpdk"], check=False).returncode == 0
    except OSError:
        return False


def _pkg_config(*args):
    return shlex.split(subprocess.run(["pkg-config", *args, "libdpdk"], check=True, capture_output=True,
                                      text=True).stdout)


if dpdk_available():
    dpdk_ffi = _ffi("switchsim._dpdk", ["ina_core.h", "ina_dpdk.h"],
                    _src("ina_core.c", "ina_core_simd.c", "ina_dpdk.c"), cflags=_pkg_config("--cflags"),
                    extra_link_args=_pkg_config("--libs"))
