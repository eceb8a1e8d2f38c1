"""The one compiled part of starqa: its CPU kernels (starqa/native/: _attend.c, exact
attention; _topk.c, top-k attention; _int4.c, int4 weights; _rows.c, RMSNorm and RoPE;
_layer.c and _step.c, a decoder layer's steps around its attention), loaded by
starqa.native.kernels through ctypes. Optional: without a C compiler starqa installs all the
same and attends with torch's and numpy's code (`starqa.native.ops.available()` says which)."""

from setuptools import Extension, setup

NATIVE = "starqa/native/"

setup(ext_modules=[Extension(
    "starqa.native._attend",
    [NATIVE + name for name in ("_attend.c", "_topk.c", "_int4.c", "_rows.c", "_layer.c",
                                "_step.c")], optional=True,
    depends=[NATIVE + "_simd.h", NATIVE + "_kernels.h"],
    # OpenMP: loaded after torch, the kernel shares torch's libgomp and its threads.
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-std=gnu11"],
    libraries=["m"],
    extra_link_args=["-fopenmp"])])
