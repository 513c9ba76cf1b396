"""Native extension build: one module, zero_offload._C, from csrc/*.cpp.

Runtime ISA dispatch: a source named ``*_avx512.cpp`` is compiled with AVX-512 flags and one named
``*_avx2.cpp`` with AVX2+FMA+F16C flags; everything else with the portable baseline. The code picks
the path at import from the CPU's flags (never -march=native: a wheel built on one machine must
run on another).
"""
import glob
import os

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ISA_FLAGS = {
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx2"],
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
}
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-pthread", "-fvisibility=hidden"]


def _isa_flags(path):
    for suffix, flags in ISA_FLAGS.items():
        if path.endswith(suffix):
            return flags
    return None


class IsaBuildExt(build_ext):
    """Compiles ISA-specific sources with their own flags, then links everything into one module."""

    def build_extension(self, ext):
        special = [s for s in ext.sources if _isa_flags(s)]
        ext.sources = [s for s in ext.sources if not _isa_flags(s)]
        objects = []
        for src in special:
            objects += self.compiler.compile(
                [src],
                output_dir=self.build_temp,
                include_dirs=ext.include_dirs,
                extra_postargs=ext.extra_compile_args + _isa_flags(src),
            )
        ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
ext = Pybind11Extension(
    "zero_offload._C",
    sources,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=BASE_FLAGS,
    extra_link_args=["-pthread"],
    # Headers and ISA sources: a change to any of them rebuilds the module.
    depends=sorted(glob.glob(os.path.join("csrc", "*.h"))) + sources,
)
setup(ext_modules=[ext], cmdclass={"build_ext": IsaBuildExt})
