"""Questions with exact answers about a real Python package's own source: the data of
`starqa eval --tasks repo_qa` (generators lays its samples out).

The package is any installed one, named by `STARQA_EVAL_PACKAGE` (an importable package's
name, or a path to a folder of .py files); the default, `typer`, is installed wherever
starqa is (its CLI is built on it), and its source fills every length up to 32K (typer
0.28: ~117K SmolLM2 tokens). Its .py files are read as `ingest` reads them
(`corpus.collect`, paths relative to the package's folder) and parsed; the questions come
from the AST, so each answer is exact and its file and (1-based) line are known:

- constant: a module-level `NAME = <int or short string>` -> the value as written;
- method: a method whose name is defined once in the whole package -> its class;
- default: a literal default (int or short string) of a parameter of a function whose name
  is defined once -> the default as written;
- raises: a function, its name defined once, whose every `raise` names the same exception
  class -> that class.

A question names no file (its name is defined once, so it points at one place), and a
question is left out when it could be right by luck: an answer of one character, an answer
inside its own question (`BLACK = "black"`), a constant's or a default's value written
more than once in its own file (whole words, any case: the file is in every sample, so the
value must point at one place there), a class or exception name inside another class or
exception name of the package (a substring match would score the other). How often the
value occurs in the sample's other files is recorded with the sample
(meta["answer_elsewhere"], `mentions`). Pure Python, no model code.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import itertools
import os
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from starqa.corpus import TextFile, collect, content_hash
from starqa.core.errors import StarqaError

PACKAGE_VARIABLE = "STARQA_EVAL_PACKAGE"
DEFAULT_PACKAGE = "typer"
KINDS = ("constant", "method", "default", "raises")
MAX_VALUE_CHARS = 40  # a string value longer than this is not a short answer
# A question's file goes into its sample whole, so it must fit the length: at most this
# many characters per token of the length (BPE tokenizers take 3-4 characters of Python a
# token, so the file takes at most ~0.8 of the budget).
FILE_CHARS_PER_TOKEN = 2.5

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_CONSTANT = re.compile(r"_*[A-Z][A-Z0-9_]*")
_CLASS_NAME = re.compile(r"_*[A-Z]\w*")


@dataclass(frozen=True)
class Fact:
    kind: str  # one of KINDS
    text: str  # the question as asked
    answer: str
    file: str  # path relative to the package's folder
    line: int  # 1-based: where the answer is written


@dataclass(frozen=True)
class Package:
    name: str
    version: str | None  # its distribution's, where one is installed under that name
    folder: str
    files: tuple[TextFile, ...]  # its .py files, sorted by path
    questions: tuple[Fact, ...]
    digest: str  # corpus.content_hash of `files`: which source the questions are about

    def file(self, path: str) -> TextFile:
        return next(f for f in self.files if f.path == path)

    @property
    def about(self) -> dict:
        """What a sample records of the package (meta["package"])."""
        return {"name": self.name, "version": self.version, "files": len(self.files),
                "questions": len(self.questions), "sha256": self.digest}


# ---------------------------------------------------------------------------------------
# the package


def package_spec() -> str:
    """The package `repo_qa` asks about: $STARQA_EVAL_PACKAGE, else the default."""
    return os.environ.get(PACKAGE_VARIABLE, "").strip() or DEFAULT_PACKAGE


def _is_folder(spec: str) -> bool:
    return "/" in spec or spec.startswith("~")


def locate(spec: str) -> tuple[str, Path]:
    """(name, folder) of the package `spec` names: a folder (a spec with a "/") or an
    installed package (found, not imported; a dotted name's parents are)."""
    if _is_folder(spec):
        folder = Path(spec).expanduser().resolve()
        if not folder.is_dir():
            raise StarqaError(f"repo_qa: {spec} is not a folder.",
                              hint=f"set {PACKAGE_VARIABLE} to a folder of .py files or to an "
                                   "installed package's name")
        return folder.name, folder
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise StarqaError(f"repo_qa asks about a Python package's source, and {spec!r} is not "
                          "an installed package.",
                          hint=f"set {PACKAGE_VARIABLE} to an installed package's name (e.g. "
                               f"{DEFAULT_PACKAGE}, rich, click) or to a folder of .py files")
    return spec, Path(next(iter(found.submodule_search_locations)))


@lru_cache(maxsize=4)
def load(spec: str) -> Package:
    """The package `spec` names (see `locate`), read and its questions derived."""
    name, folder = locate(spec)
    corpus = collect([folder], include=["*.py"])
    # Change times dropped: installed copies differ in them, and the sample lays the files
    # out in path order (how `packorder` orders files of one age).
    files = tuple(TextFile(f.path, f.text, f.size) for f in corpus.files)
    questions = derive(files)
    if not questions:
        raise StarqaError(f"repo_qa found no question with one exact answer in {name}'s "
                          "source.", hint=f"set {PACKAGE_VARIABLE} to a larger package")
    version = None if _is_folder(spec) else _version(name)  # a folder may be any checkout
    return Package(name, version, str(folder), files, questions, content_hash(files))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name.split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def choose(package: Package, rng: random.Random, length: int) -> Fact:
    """A seeded question whose file fits `length` tokens whole: a kind first (each kind
    alike, among those with such a question), then one of that kind's questions."""
    limit = length * FILE_CHARS_PER_TOKEN
    sizes = {f.path: len(f.text) for f in package.files}
    fitting = [q for q in package.questions if sizes[q.file] <= limit]
    if not fitting:
        smallest = min(sizes[q.file] for q in package.questions)
        raise StarqaError(f"{length:,} tokens is too short for repo_qa over {package.name}: "
                          f"the smallest file holding a question has {smallest:,} characters.",
                          hint="choose longer lengths")
    return _by_kind(fitting, rng)


def in_turn(package: Package, rng: random.Random, paths: set[str]) -> list[Fact]:
    """The questions about the files `paths`, in a seeded order that takes each kind in
    turn (the kinds in a seeded order, each kind's questions shuffled), so the first
    questions of a one-context sample set are distinct and each kind comes alike."""
    kinds = [k for k in KINDS if any(q.kind == k and q.file in paths
                                     for q in package.questions)]
    rng.shuffle(kinds)
    lines = {k: [q for q in package.questions if q.kind == k and q.file in paths]
             for k in kinds}
    for line in lines.values():
        rng.shuffle(line)
    return [q for turn in itertools.zip_longest(*lines.values()) for q in turn if q]


def _by_kind(questions: list[Fact], rng: random.Random) -> Fact:
    kind = rng.choice([k for k in KINDS if any(q.kind == k for q in questions)])
    return rng.choice([q for q in questions if q.kind == kind])


# ---------------------------------------------------------------------------------------
# the questions


@dataclass(frozen=True)
class _Index:
    """Names across the whole package."""

    bound: Counter  # name -> how often it is bound (assigned anywhere, def, class)
    defs: Counter  # function and method name -> how many defs
    classes: frozenset[str]
    raised: frozenset[str]  # every exception class named by a `raise`

    @classmethod
    def of(cls, trees: dict[str, tuple[str, ast.Module]]) -> _Index:
        bound, defs, classes, raised = Counter(), Counter(), set(), set()
        for _, tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    bound[node.id] += 1
                elif isinstance(node, _FUNCTIONS):
                    bound[node.name] += 1
                    defs[node.name] += 1
                elif isinstance(node, ast.ClassDef):
                    bound[node.name] += 1
                    classes.add(node.name)
                elif isinstance(node, ast.Raise) and (name := _exception(node)):
                    raised.add(name)
        return cls(bound, defs, frozenset(classes), frozenset(raised))


def derive(files: Sequence[TextFile]) -> tuple[Fact, ...]:
    """Every question about `files` (a package's .py files) with one exact answer, by kind,
    then file (a stable order); a file Python cannot parse asks nothing."""
    trees = {}
    for f in files:
        try:
            trees[f.path] = (f.text, ast.parse(f.text))
        except (SyntaxError, ValueError):
            continue
    index = _Index.of(trees)
    found = [*_constants(trees, index), *_methods(trees, index), *_defaults(trees, index),
             *_raises(trees, index)]
    return tuple(q for q in found if _unambiguous(q, index, trees[q.file][0]))


def mentions(answer: str, text: str) -> int:
    """How often `answer` occurs in `text` as a whole word (no letter, digit or _ either
    side), in any case."""
    return len(re.findall(rf"(?<!\w){re.escape(answer)}(?!\w)", text, re.IGNORECASE))


def _unambiguous(q: Fact, index: _Index, own: str) -> bool:
    """Whether `q` has one answer that no luck gives (module docstring); `own`: the text
    of its file."""
    answer = q.answer.lower()
    if len(answer) < 2 or answer in q.text.lower():
        return False
    if q.kind in ("constant", "default"):
        return mentions(q.answer, own) == 1
    names = index.classes | index.raised if q.kind == "raises" else index.classes
    return not any(answer in other.lower() for other in names if other != q.answer)


def _literal(node: ast.AST | None, text: str) -> str | None:
    """A simple literal's answer: an int written in decimal, or a one-line string of 1 to
    MAX_VALUE_CHARS printable characters written without escapes; else None."""
    if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
        return None
    written = ast.get_source_segment(text, node)
    value = node.value
    if isinstance(value, int):
        return written if written == str(value) else None
    if isinstance(value, str) and 0 < len(value) <= MAX_VALUE_CHARS and \
            value.isprintable() and value.strip() == value and \
            written in (f'"{value}"', f"'{value}'"):
        return value
    return None


def _constants(trees: dict[str, tuple[str, ast.Module]], index: _Index) -> Iterator[Fact]:
    for path, (text, tree) in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            elif isinstance(node, ast.AnnAssign):
                target = node.target
            else:
                continue
            if not isinstance(target, ast.Name) or not _CONSTANT.fullmatch(target.id) or \
                    index.bound[target.id] != 1:
                continue
            if (value := _literal(node.value, text)) is not None:
                yield Fact("constant", f"What is the value of the module constant "
                               f"`{target.id}`? Answer with the value only.", value, path,
                               node.value.lineno)


def _methods(trees: dict[str, tuple[str, ast.Module]], index: _Index) -> Iterator[Fact]:
    for path, (_, tree) in trees.items():
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if isinstance(node, _FUNCTIONS) and index.defs[node.name] == 1 and \
                        not (node.name.startswith("__") and node.name.endswith("__")):
                    yield Fact("method", f"Which class defines the method `{node.name}`? "
                                   "Answer with the class name only.", cls.name, path,
                                   node.lineno)


def _unique_functions(trees: dict[str, tuple[str, ast.Module]], index: _Index
                      ) -> Iterator[tuple[str, str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(path, text, def) of every function or method whose name is defined once."""
    for path, (text, tree) in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, _FUNCTIONS) and index.defs[node.name] == 1:
                yield path, text, node


def _defaults(trees: dict[str, tuple[str, ast.Module]], index: _Index) -> Iterator[Fact]:
    for path, text, fn in _unique_functions(trees, index):
        args = fn.args
        positional = [*args.posonlyargs, *args.args]
        pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                 *zip(args.kwonlyargs, args.kw_defaults)]
        for arg, default in pairs:
            if (value := _literal(default, text)) is not None:
                yield Fact("default", f"What is the default value of the `{arg.arg}` "
                               f"parameter of `{fn.name}`? Answer with the value only.",
                               value, path, default.lineno)


def _raises(trees: dict[str, tuple[str, ast.Module]], index: _Index) -> Iterator[Fact]:
    for path, _, fn in _unique_functions(trees, index):
        raises = [n for n in _own_nodes(fn) if isinstance(n, ast.Raise)]
        names = {_exception(r) for r in raises}
        if len(names) == 1 and None not in names:  # a bare `raise` or `raise err`: unknown
            [name] = names
            yield Fact("raises", f"Which exception does `{fn.name}` raise? Answer with "
                           "the exception's name only.", name, path, raises[0].lineno)


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's own code: not those of the functions, lambdas and classes
    defined inside it."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (*_FUNCTIONS, ast.Lambda, ast.ClassDef)):
            yield child
            yield from _own_nodes(child)


def _exception(node: ast.Raise) -> str | None:
    """The class a `raise` names (`raise E`, `raise E(...)`, `raise mod.E(...)`); None
    when it names none (a bare `raise`, `raise err`, `raise make_error()`)."""
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    name = exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(
        exc, ast.Attribute) else None
    return name if name and _CLASS_NAME.fullmatch(name) else None
