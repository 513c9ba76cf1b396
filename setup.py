"""Native extension build: one module, zero_offload._C, from csrc/*.cpp.

Runtime ISA dispatch: a source named ``*_avx512.cpp`` is compiled with AVX-512 flags and one named
``*_avx2.cpp`` with AVX2+FMA+F16C flags; everything else with the portable baseline. The code picks
the path at import from the CPU's flags (never -march=native: a wheel built on one machine must
run on another).
"""
import glob
import os
from concurrent.futures import ThreadPoolExecutor

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
    """Compiles every source at once, one compiler process per core (each ISA-specific source
    with its own flags), then links everything into one module. Serial compilation took 83 s on
    2 cores; the largest translation unit bounds the parallel build."""

    def build_extension(self, ext):
        def compile_one(src):
            return self.compiler.compile(
                [src],
                output_dir=self.build_temp,
                include_dirs=ext.include_dirs,
                macros=ext.define_macros,
                extra_postargs=ext.extra_compile_args + (_isa_flags(src) or []),
                depends=ext.depends,
            )

        workers = max(1, min(len(ext.sources), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            objects = [obj for objs in pool.map(compile_one, ext.sources) for obj in objs]
        # Everything is compiled: link only (build_ext's own pass would compile again).
        ext.sources = []
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
