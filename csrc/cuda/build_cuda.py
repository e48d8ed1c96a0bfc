"""Builds the CUDA codec kernels (csrc/cuda/*.cu) into hostlib/_ina_cuda.so with nvcc, for hostlib.cuda (ctypes).

    python csrc/cuda/build_cuda.py [--out PATH]      (make cuda; setup.py runs it at install)

No nvcc (not on PATH, not in $CUDA_HOME/bin or /usr/local/cuda/bin): nothing is built, a message says so and
the exit status is 0, since the GPU path is optional; hostlib.cuda.available() then names the reason (an
install also goes on when nvcc fails; this script then exits 1). The
CUDA runtime is linked statically (-cudart static), so a machine running it needs only the driver. Device
code for sm_80 (A100) and sm_90 (H100/H200), plus compute_90 PTX that newer GPUs compile when loading it.
Every warning (nvcc's front end, ptxas, the host compiler) is an error.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.dirname(HERE)
ROOT = os.path.dirname(CSRC)
DEFAULT_OUT = os.path.join(ROOT, "hostlib", "_ina_cuda.so")

ARCHS = ["--generate-code", "arch=compute_80,code=sm_80",
         "--generate-code", "arch=compute_90,code=[sm_90,compute_90]"]
# -Werror all-warnings: nvcc's own, cicc's and ptxas's warnings; -Xcompiler ...: the host compiler's
WARNINGS = ["-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", *WARNINGS, "-I", CSRC]


def find_nvcc() -> str | None:
    """nvcc from $NVCC, $CUDA_HOME/bin, PATH or /usr/local/cuda/bin, or None."""
    candidates = [os.environ.get("NVCC"), os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc"),
                  shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def sources() -> list[str]:
    """Every .cu of csrc/cuda (each is compiled, so a test can check that each builds without warnings)."""
    return sorted(glob.glob(os.path.join(HERE, "*.cu")))


def compile_command(nvcc: str, srcs, out: str, archs=ARCHS) -> list[str]:
    """The nvcc command building srcs into the shared library out."""
    return [nvcc, *NVCC_FLAGS, *archs, "-shared", "-cudart", "static", "-o", out, *srcs]


def build(out: str = DEFAULT_OUT, nvcc: str | None = None, log: list | None = None) -> str:
    """Compile and link the library (into a temporary name first, so a failed build leaves no half file);
    nvcc's output is appended to log when one is given.

    Returns:
        out.

    Raises:
        FileNotFoundError: no nvcc.
        RuntimeError: nvcc failed (its output in the message).
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, $NVCC, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    run = subprocess.run(compile_command(nvcc, sources(), tmp), capture_output=True, text=True)
    if log is not None:
        log.append(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    os.replace(tmp, out)
    return out


def build_or_skip(out: str = DEFAULT_OUT, strict: bool = False) -> bool:
    """build(), or a message on stderr when there is no nvcc or it fails: the GPU path is optional, so an
    install goes on without it (hostlib.cuda.available() then says why); strict re-raises nvcc's failure.

    Returns:
        Whether the library was built.
    """
    try:
        build(out)
    except FileNotFoundError as e:
        print(f"ina-emulator: {e}; the CUDA kernels (hostlib/_ina_cuda.so) are not built", file=sys.stderr)
        return False
    except RuntimeError as e:
        print(f"ina-emulator: the CUDA kernels did not build, the GPU path stays off: {e}", file=sys.stderr)
        if strict:
            raise
        return False
    print(f"ina-emulator: built {out} with nvcc", file=sys.stderr)
    return True


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    try:
        build_or_skip(ap.parse_args().out, strict=True)
    except RuntimeError:
        sys.exit(1)
