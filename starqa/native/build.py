"""How starqa's kernels are built, in one place: their C sources, the compiler's flags, and
the hash of the sources that the library carries (`starqa_source_hash`). setup.py builds
the package's library from it (`pip install`), `.ci/kernels` builds a second one with
sanitizers, and starqa.native.kernels compares the library's hash with that of the sources
beside it (a stale build is refused, with a warning). Standard library only: setup.py loads
this file before starqa is installed.

    python -m starqa.native.build OUT.so [--cc gcc] [--sanitize] [--no-werror]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

FOLDER = Path(__file__).parent
# every source of the library, one translation unit each, and the headers they include
SOURCES = ("_attend.c", "_topk_scratch.c", "_topk_score.c", "_topk_lists.c", "_topk_best.c",
           "_topk_pick.c", "_topk_values.c", "_topk_tail.c", "_topk_attend.c", "_int4.c",
           "_rows.c", "_layer.c", "_step.c", "_simd.c")
HEADERS = ("_kernels.h", "_simd.h", "_topk.h")
# OpenMP: loaded after torch, the kernels share torch's libgomp and its threads. Only the
# entry points that _kernels.h marks STARQA_API are exported.
COMPILE = ("-O3", "-fopenmp", "-fno-math-errno", "-std=gnu11", "-fvisibility=hidden")
WARNINGS = ("-Wall", "-Wextra")
LINK = ("-fopenmp", "-lm")
# a second build for CI: any undefined behaviour aborts the test that met it (clang links
# its sanitizers' runtime into a shared library only when asked: -shared-libasan)
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer")
CLANG_SANITIZE = ("-shared-libasan",)
# STARQA_REQUIRE_KERNELS=1: a warning fails the build, a failed build fails the install,
# and a missing or stale library is an error, not the slow path (CI sets it)
REQUIRE = "STARQA_REQUIRE_KERNELS"
HASH_MACRO = "STARQA_SOURCE_HASH"


def required() -> bool:
    """Whether STARQA_REQUIRE_KERNELS=1 is set."""
    return os.environ.get(REQUIRE, "").strip() == "1"


def source_hash(folder: Path = FOLDER) -> str | None:
    """The sources' hash (sha256 of each file's name and bytes, in SOURCES then HEADERS
    order; 16 hex digits), or None where any is missing (an install without the sources:
    nothing to compare)."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        try:
            data = (folder / name).read_bytes()
        except OSError:
            return None
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


def flags(werror: bool = False) -> list[str]:
    """The compiler's flags for the library's sources, the sources' hash defined."""
    return [*COMPILE, *WARNINGS, *(["-Werror"] if werror else []),
            f'-D{HASH_MACRO}="{source_hash()}"']


def extension_args(root: str = "starqa/native/") -> dict:
    """setup.py's `Extension` arguments (paths relative to the project's root): optional,
    as a machine without a C compiler installs starqa all the same, unless
    STARQA_REQUIRE_KERNELS=1, which also turns warnings into errors."""
    strict = required()
    return {"sources": [root + name for name in SOURCES],
            "depends": [root + name for name in HEADERS],
            "extra_compile_args": flags(werror=strict), "extra_link_args": list(LINK),
            "optional": not strict}


def command(out: Path, cc: str = "cc", sanitize: bool = False, werror: bool = True
            ) -> list[str]:
    """The one compiler call that builds the library at `out` (as setup.py's flags, and
    sanitizers where asked for)."""
    sanitizers = (*SANITIZE, *(CLANG_SANITIZE if "clang" in Path(cc).name else ())) \
        if sanitize else ()
    return [cc, "-shared", "-fPIC", *flags(werror), *sanitizers,
            *(str(FOLDER / name) for name in SOURCES), "-o", str(out), *LINK]


def main(argv: list[str] | None = None) -> int:
    """Build the library at OUT (`python -m starqa.native.build --help`)."""
    parser = argparse.ArgumentParser(description="Build starqa's kernels into one library.")
    parser.add_argument("out", type=Path, help="the library to write (.so)")
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"), help="the C compiler")
    parser.add_argument("--sanitize", action="store_true",
                        help="with AddressSanitizer and UndefinedBehaviorSanitizer")
    parser.add_argument("--no-werror", dest="werror", action="store_false",
                        help="let warnings pass")
    args = parser.parse_args(argv)
    return subprocess.run(command(args.out, args.cc, args.sanitize, args.werror)).returncode


if __name__ == "__main__":
    sys.exit(main())
