"""The C boundary has one source of truth, starqa/native/_kernels.h: every struct and
prototype mirrored by starqa.native.kernels field by field (names, order, C types) and laid
out alike (the compiler's offsets against ctypes'), every symbol the library exports
declared there; STARQA_SIMD reaches every build the kernels dispatch to, the baseline
included; and a missing or stale library is a warning with the fix to paste, an error under
STARQA_REQUIRE_KERNELS=1."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from starqa.core.errors import StarqaError
from starqa.native import build, kernels

HEADER = Path(kernels.__file__).with_name("_kernels.h")
BASES = {"int": ctypes.c_int, "float": ctypes.c_float, "int64_t": ctypes.c_int64,
         "int32_t": ctypes.c_int32, "uint16_t": ctypes.c_uint16, "uint8_t": ctypes.c_uint8,
         "char": ctypes.c_char}


# ---------------------------------------------------------------------------------------
# the header, read


def _declared(text: str) -> tuple[str, tuple[str, int]]:
    """`const float *q` → ("q", ("float", 1)): a name and its C type (base, pointer depth),
    qualifiers dropped."""
    words = re.sub(r"\bconst\b", " ", text).replace("*", " * ").split()
    return words[-1], (" ".join(w for w in words[:-1] if w != "*"), words.count("*"))


def read_header(text: str) -> tuple[dict, dict, dict]:
    """_kernels.h's structs {name: [(field, type)]}, prototypes {name: (return type,
    [parameter types])} and integer #defines, as `_declared` spells types."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    defines = {name: int(value) for name, value in
               re.findall(r"^\s*#define\s+(STARQA_\w+)\s+(-?\d+)\s*$", text, re.M)}
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        for statement in filter(str.strip, body.split(";")):
            first, *more = statement.split(",")
            field, (base, depth) = _declared(first)
            fields.append((field, (base, depth)))
            for other in more:  # `int64_t a, *b;`
                fields.append((other.strip(" *"), (base, other.count("*"))))
        structs[name] = fields
    prototypes = {}
    for returned, name, params in re.findall(
            r"STARQA_API\s+([\w\s*]+?)\s*\b(starqa_\w+)\s*\(([^)]*)\)\s*;", text):
        _, result = _declared(returned + " " + name)
        listed = [] if params.strip() == "void" else [_declared(p)[1] for p in params.split(",")]
        prototypes[name] = (result, listed)
    return structs, prototypes, defines


STRUCTS, PROTOTYPES, DEFINES = read_header(HEADER.read_text())


def as_ctypes(c_type: tuple[str, int], returned: bool = False):
    """The ctypes type that mirrors a C type: a base type as itself, a struct as its
    Structure, a pointer to a struct as POINTER(it), `const char *` returned as c_char_p,
    any other pointer as c_void_p; void as None."""
    base, depth = c_type
    if depth == 0:
        return None if base == "void" else BASES.get(base) or getattr(kernels, base)
    if depth == 1 and base in STRUCTS:
        return ctypes.POINTER(getattr(kernels, base))
    return ctypes.c_char_p if returned and base == "char" else ctypes.c_void_p


def test_the_reader_reads_the_grammar_the_header_keeps():
    structs, prototypes, defines = read_header("""
        /* a comment; with int x; inside */
        #define STARQA_ONE 1
        typedef struct { const float *q; int64_t a, *b; starqa_x inner; } starqa_y;
        STARQA_API int starqa_f(const starqa_y *args);
        STARQA_API const char *starqa_g(void);""")
    assert structs == {"starqa_y": [("q", ("float", 1)), ("a", ("int64_t", 0)),
                                    ("b", ("int64_t", 1)), ("inner", ("starqa_x", 0))]}
    assert prototypes == {"starqa_f": (("int", 0), [("starqa_y", 1)]),
                          "starqa_g": (("char", 1), [])}
    assert defines == {"STARQA_ONE": 1}


# ---------------------------------------------------------------------------------------
# the mirror against the header


def test_every_struct_is_mirrored_field_by_field():
    assert len(STRUCTS) >= 15
    mirrored = {name for name, value in vars(kernels).items()
                if isinstance(value, type) and issubclass(value, ctypes.Structure)}
    assert mirrored == set(STRUCTS), "kernels.py's Structures against _kernels.h's structs"
    for name, fields in STRUCTS.items():
        mirror = getattr(kernels, name)
        assert [field for field, _ in mirror._fields_] == [field for field, _ in fields], name
        for (field, c_type), (_, kind) in zip(fields, mirror._fields_):
            assert kind is as_ctypes(c_type), f"{name}.{field}: {kind} for {c_type}"


def test_every_prototype_has_its_signature():
    assert set(kernels.SIGNATURES) == set(PROTOTYPES)
    for name, (returned, params) in PROTOTYPES.items():
        restype, argtypes = kernels.SIGNATURES[name]
        assert restype is as_ctypes(returned, returned=True), name
        assert argtypes == [as_ctypes(p) for p in params], name


def test_the_constants_are_the_headers():
    assert DEFINES.keys() >= {"STARQA_STEP_EXACT", "STARQA_STEP_TOPK", "STARQA_DROP_KEYS"}
    for name, value in DEFINES.items():
        assert getattr(kernels, name.removeprefix("STARQA_")) == value, name


def test_the_compiler_lays_every_struct_out_as_ctypes_does(tmp_path):
    """The same field types give the same layout by the platform's rules; the compiler's
    own offsets and sizes, printed by a program that includes the header, say so."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler here")
    lines = [f'printf("{name} %zu\\n", sizeof({name}));' for name in STRUCTS]
    lines += [f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));'
              for name, fields in STRUCTS.items() for field, _ in fields]
    program = tmp_path / "layout.c"
    program.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"_kernels.h\"\n"
                       "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    subprocess.run([cc, "-I", str(HEADER.parent), str(program), "-o", str(tmp_path / "layout")],
                   check=True)
    printed = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                             check=True).stdout
    compiled = dict(line.split() for line in printed.splitlines())
    for name, fields in STRUCTS.items():
        mirror = getattr(kernels, name)
        assert int(compiled[name]) == ctypes.sizeof(mirror), name
        for field, _ in fields:
            assert int(compiled[f"{name}.{field}"]) == getattr(mirror, field).offset, field


def test_the_library_exports_exactly_the_declared_entry_points():
    found = kernels.status()
    if not found.ok:
        pytest.skip(f"no current library here ({found.state})")
    if shutil.which("nm") is None:
        pytest.skip("no nm here")
    listed = subprocess.run(["nm", "-D", "--defined-only", str(found.path)], check=True,
                            capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in listed.splitlines() if line.strip()}
    assert {name for name in exported if name.startswith("starqa_")} == set(PROTOTYPES)
    assert kernels.library() is not None  # every declared one found, its signature set


# ---------------------------------------------------------------------------------------
# STARQA_SIMD reaches every build


def paths_under(cap: str) -> dict:
    """The library's report of its SIMD paths in a process under STARQA_SIMD=cap, after
    a kernel built for each level (SiLU·mul, _rows.c) ran."""
    code = ("import json, torch; from starqa.native import kernels, ops; "
            "ops.silu_mul(torch.randn(3, 64)); "
            "print(json.dumps(kernels.simd_paths().__dict__, default=sorted))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "STARQA_SIMD": cap}, check=True)
    return json.loads(run.stdout)


@pytest.mark.skipif(not kernels.status().ok, reason="starqa's kernels not built")
def test_every_simd_cap_reaches_its_build_the_baseline_included():
    """The builds of the multi-versioned loops (x86-64-v4, v3, the baseline) are chosen by
    STARQA_SIMD as well as the CPU: under `none` the baseline runs, as the hand-written
    paths give way to the portable C."""
    widest = paths_under("")
    assert widest["cap"] == 2
    if widest["cloned"] == -1:
        pytest.skip("this compiler builds the loops once")
    for cap, level in (("", 2), ("avx512", 2), ("avx2", 1), ("none", 0)):
        found = widest if cap == "" else paths_under(cap)
        assert found["cap"] == level
        assert found["cloned"] == min(level, widest["cloned"])
        assert found["taken"] == [found["cloned"]]  # the one build that ran
        assert found["written"] <= min(level, widest["written"])
    assert paths_under("none")["written"] == 0


# ---------------------------------------------------------------------------------------
# a missing or stale library


@pytest.fixture
def fresh(monkeypatch):
    """kernels' loaded library forgotten before and after (each test loads its own), and
    not required (CI requires it: .ci/kernels)."""
    from starqa.cli import ui

    monkeypatch.delenv("STARQA_REQUIRE_KERNELS", raising=False)
    for cached in (kernels._loaded, kernels.library, ui.kernels_warning):
        cached.cache_clear()
    yield
    for cached in (kernels._loaded, kernels.library, ui.kernels_warning):
        cached.cache_clear()


def test_the_library_is_current_where_a_compiler_is(fresh):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here")
    found = kernels.status()
    assert found.ok, found.message()
    assert kernels.library().starqa_source_hash().decode() == build.source_hash()


def test_a_stale_library_is_refused_with_the_fix(fresh, monkeypatch):
    if kernels._library_path() is None:
        pytest.skip("starqa's kernels not built")
    monkeypatch.setattr(build, "source_hash", lambda folder=build.FOLDER: "0" * 16)
    found = kernels.status()
    assert found.state == "stale" and kernels.library() is None  # torch's paths then
    assert "stale" in found.message() and "slower" in found.message()
    assert "-m starqa.native.build" in found.hint() and str(found.path) in found.hint()
    monkeypatch.setenv("STARQA_REQUIRE_KERNELS", "1")
    kernels.library.cache_clear()
    with pytest.raises(StarqaError, match="kernels are stale") as raised:
        kernels.library()
    assert "starqa.native.build" in raised.value.hint


def test_a_missing_library_is_refused_with_the_fix(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.PATH_VARIABLE, str(tmp_path / "_attend.so"))
    found = kernels.status()
    assert found.state == "missing" and kernels.library() is None
    monkeypatch.setenv("STARQA_REQUIRE_KERNELS", "1")
    with pytest.raises(StarqaError, match="kernels are missing"):
        kernels.require()


def test_the_commands_warn_of_a_stale_library(fresh, monkeypatch, home, capsys):
    """`cache` shows it in its table (and --json), every command drawing progress (ask,
    ingest) warns once before it starts; STARQA_REQUIRE_KERNELS=1: the error instead."""
    from starqa.cli import app, ui

    stale = kernels.KernelStatus("stale", Path("/x/_attend.so"), "built from other sources")
    monkeypatch.setattr(kernels, "status", lambda: stale)
    runner = CliRunner()
    shown = runner.invoke(app, ["cache"])
    assert shown.exit_code == 0
    assert "kernels" in shown.output and "stale" in shown.output
    assert "warning: starqa's compiled CPU kernels are stale" in " ".join(shown.output.split())
    ui.kernels_warning.cache_clear()
    listed = json.loads(runner.invoke(app, ["cache", "--json"]).stdout)
    assert listed["kernels"]["state"] == "stale"
    ui.kernels_warning.cache_clear()
    for _ in range(2):
        with ui.RichUI(stream=False):
            pass
    warned = capsys.readouterr().err
    assert warned.count("kernels are stale") == 1 and "hint:" in warned
    monkeypatch.setenv("STARQA_REQUIRE_KERNELS", "1")
    ui.kernels_warning.cache_clear()
    failed = runner.invoke(app, ["cache"])
    assert failed.exit_code != 0 and isinstance(failed.exception, StarqaError)
    with pytest.raises(StarqaError, match="stale"):
        ui.RichUI().__enter__()


def test_a_required_build_fails_on_a_warning(monkeypatch):
    """setup.py's extension: optional and lenient for users, required and -Werror under
    STARQA_REQUIRE_KERNELS=1 (CI)."""
    monkeypatch.delenv("STARQA_REQUIRE_KERNELS", raising=False)
    lenient = build.extension_args()
    assert lenient["optional"] and "-Werror" not in lenient["extra_compile_args"]
    assert {"-Wall", "-Wextra"} <= set(lenient["extra_compile_args"])
    monkeypatch.setenv("STARQA_REQUIRE_KERNELS", "1")
    strict = build.extension_args()
    assert not strict["optional"] and "-Werror" in strict["extra_compile_args"]
    assert sorted(Path(s).name for s in strict["sources"]) == \
        sorted(p.name for p in HEADER.parent.glob("*.c"))  # every C file is built


def test_the_sources_hash_changes_with_any_source(tmp_path):
    for name in build.SOURCES + build.HEADERS:
        shutil.copy(HEADER.parent / name, tmp_path / name)
    before = build.source_hash(tmp_path)
    assert before == build.source_hash()
    with open(tmp_path / "_topk_best.c", "a") as fh:
        fh.write("\n")
    assert build.source_hash(tmp_path) != before
    (tmp_path / "_simd.h").unlink()
    assert build.source_hash(tmp_path) is None  # an install without its sources
