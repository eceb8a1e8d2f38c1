"""The one compiled part of starqa: its CPU kernels (starqa/native/: _attend.c, exact
attention; _topk_*.c, top-k attention; _int4.c, int4 weights; _rows.c, RMSNorm and RoPE;
_layer.c and _step.c, a decoder layer's steps around its attention), loaded by
starqa.native.kernels through ctypes. Sources, flags and the sources' hash come from
starqa/native/build.py. Optional: without a C compiler starqa installs all the same and
attends with torch's and numpy's code (`starqa.native.ops.available()` says which, and
starqa warns); STARQA_REQUIRE_KERNELS=1 makes the build required and its warnings errors."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location(
    "starqa_native_build", Path(__file__).parent / "starqa" / "native" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

setup(ext_modules=[Extension("starqa.native._attend", **build.extension_args())])
