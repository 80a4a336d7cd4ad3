"""Builds megazero's optional C++ extensions: `megazero._C` (csrc/cpu_adam*.cpp: the fused CPU Adam)
and `megazero._quant` (csrc/quantize*.cpp: block int8/int4 quantization for ZeRO++).

Package metadata lives in pyproject.toml; this file only adds the extension. The extension is
optional: without a C++ compiler, pybind11 or OpenMP, `pip install .` still succeeds and
megazero.ops.adam falls back to the torch reference. Build choices:

- `-ffp-contract=off` is required, not a tuning knob: the kernel is bitwise equal to torch only if
  the compiler fuses no multiply-add that torch does not (see the comment atop cpu_adam.cpp).
- No `-march` flag: the cluster image is built once and runs on many CPU models, so the build
  targets baseline x86-64; the AVX2 and AVX-512 copies of the loop carry their own per-function
  target attributes and the kernel picks one at run time from what the CPU reports.
- OpenMP is tried first; if the compiler lacks it the extension is built single-threaded.
"""

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.errors import CCompilerError, CompileError, LinkError, PlatformError
except ImportError:  # setuptools < 59 only has the distutils spellings
    from distutils.errors import CCompilerError, CompileError, LinkError, DistutilsPlatformError as PlatformError

BUILD_ERRORS = (CCompilerError, CompileError, LinkError, PlatformError, OSError)

BASE_FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"]
OPENMP_FLAGS = ["-fopenmp"]


def _warn(message: str) -> None:
    print(f"megazero setup: WARNING: {message}", file=sys.stderr)


def _extensions() -> list:
    try:
        import pybind11
    except ImportError:
        _warn("pybind11 is not importable; building without the C++ extension megazero._C")
        return []
    from setuptools import Extension

    sources = ["csrc/cpu_adam.cpp", "csrc/cpu_adam_avx2.cpp", "csrc/cpu_adam_avx512.cpp"]
    quant_sources = [
        "csrc/quantize.cpp",
        "csrc/quantize_scalar.cpp",
        "csrc/quantize_avx2.cpp",
        "csrc/quantize_avx512.cpp",
    ]
    return [
        Extension(
            "megazero._C",
            sources=sources,
            depends=["csrc/cpu_adam.h", "csrc/cpu_dispatch.h", "csrc/dtype_helpers.h"],
            include_dirs=[pybind11.get_include()],
            language="c++",
        ),
        Extension(
            "megazero._quant",
            sources=quant_sources,
            depends=["csrc/quantize.h", "csrc/quantize_kernels.h", "csrc/cpu_dispatch.h", "csrc/dtype_helpers.h"],
            include_dirs=[pybind11.get_include()],
            language="c++",
        ),
    ]


class OptionalBuildExt(build_ext):
    """build_ext that tries OpenMP, then no OpenMP, then gives up on the extension with a warning."""

    def run(self):
        try:
            super().run()
        except BUILD_ERRORS as error:  # e.g. no compiler installed at all
            _warn(f"C++ extensions not built ({error}); megazero will use the torch reference")

    def build_extension(self, ext):
        if self.compiler.compiler_type == "msvc":
            attempts = [(["/O2", "/std:c++17", "/fp:precise", "/openmp"], []), (["/O2", "/std:c++17"], [])]
        else:
            attempts = [(BASE_FLAGS + OPENMP_FLAGS, OPENMP_FLAGS), (BASE_FLAGS, [])]
        for compile_args, link_args in attempts:
            ext.extra_compile_args, ext.extra_link_args = compile_args, link_args
            try:
                super().build_extension(ext)
                return
            except BUILD_ERRORS as error:
                _warn(f"building {ext.name} with {' '.join(compile_args)} failed: {error}")
        _warn(f"{ext.name} not built; megazero will use the torch reference")


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
