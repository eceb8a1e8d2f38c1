"""The one compiled part of starqa: its CPU kernels (starqa/_attend.c, exact attention;
starqa/_topk.c, top-k attention; starqa/_int4.c, int4 weights; starqa/_rows.c, RMSNorm and
RoPE; starqa/_layer.c, a decoder layer's steps around its attention), loaded by
starqa.native through ctypes. Optional: without a C compiler starqa installs all the same
and attends with torch's and numpy's code (`starqa.native.available()` says which)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "starqa._attend", ["starqa/_attend.c", "starqa/_topk.c", "starqa/_int4.c",
                     "starqa/_rows.c", "starqa/_layer.c", "starqa/_step.c"], optional=True,
    depends=["starqa/_simd.h", "starqa/_kernels.h"],
    # OpenMP: loaded after torch, the kernel shares torch's libgomp and its threads.
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-std=gnu11"],
    libraries=["m"],
    extra_link_args=["-fopenmp"])])
