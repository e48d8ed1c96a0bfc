"""Builds the native parts (csrc/, cffi API mode; csrc/cuda/ with nvcc where it exists) at install time;
everything else is in pyproject.toml."""
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "csrc"))
sys.path.insert(0, os.path.join(HERE, "csrc", "cuda"))
import build_cuda  # noqa: E402
import build_ffi  # noqa: E402


class BuildExtWithCuda(build_ext):
    """The cffi modules, then hostlib/_ina_cuda.so with nvcc (a message and no library without nvcc)."""

    def run(self):
        super().run()
        inplace = self.inplace or getattr(self, "editable_mode", False)
        pkg = self.get_finalized_command("build_py").get_package_dir("hostlib") if inplace else os.path.join(
            self.build_lib, "hostlib")
        build_cuda.build_or_skip(os.path.join(pkg, "_ina_cuda.so"))


modules = ["csrc/build_ffi.py:core_ffi", "csrc/build_ffi.py:kernels_ffi"]
if hasattr(build_ffi, "dpdk_ffi"):
    modules.append("csrc/build_ffi.py:dpdk_ffi")
else:
    print("ina-emulator: pkg-config finds no libdpdk; the DPDK backend is not built", file=sys.stderr)
setup(cffi_modules=modules, cmdclass={"build_ext": BuildExtWithCuda})
