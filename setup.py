"""Builds the native parts (csrc/, cffi API mode) at install time; everything else is in pyproject.toml."""
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
import build_ffi  # noqa: E402

modules = ["csrc/build_ffi.py:core_ffi", "csrc/build_ffi.py:kernels_ffi"]
if hasattr(build_ffi, "dpdk_ffi"):
    modules.append("csrc/build_ffi.py:dpdk_ffi")
else:
    print("ina-emulator: pkg-config finds no libdpdk; the DPDK backend is not built", file=sys.stderr)
setup(cffi_modules=modules)
