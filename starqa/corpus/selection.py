"""Which files under the user's paths become the context (`collect`; `candidates` for
`ingest --watch`): git's view of a work tree (`corpus.git`), `.gitignore`s elsewhere, no
hidden, lock, binary, oversized or non-UTF-8 files; and why each other file was skipped."""

from __future__ import annotations

import errno
import fnmatch
import os
import shlex
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import pathspec

from starqa.core.errors import StarqaError
import starqa.corpus.git as git
from starqa.corpus.git import BARE
from starqa.corpus.sources import OUTSIDE, Corpus, Skipped, TextFile, leaves


STARQAIGNORE = ".starqaignore"  # per-folder ignore file, gitignore syntax, top level only


LOCK_FILES = frozenset({
    "package-lock.json", "yarn.lock", "pnpm-lock.yaml", "poetry.lock", "Cargo.lock", "uv.lock",
    "Pipfile.lock", "composer.lock", "Gemfile.lock", "go.sum",
})


SNIFF_BYTES = 8192  # a NUL byte in this prefix marks a file as binary (git's own heuristic)


class _Globs:
    """Glob patterns matched gitignore-style (`**`, dir names) and fnmatch-style (path, name)."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        self.spec = pathspec.GitIgnoreSpec.from_lines(self.patterns)

    def match(self, *paths: str, is_dir: bool = False) -> bool:
        for p in paths:
            name = p.rsplit("/", 1)[-1]
            if self.spec.match_file(p + "/" if is_dir else p):
                return True
            if any(fnmatch.fnmatch(p, g) or fnmatch.fnmatch(name, g) for g in self.patterns):
                return True
        return False


def _ignored(specs: list[tuple[str, pathspec.GitIgnoreSpec]], rel: str, is_dir: bool) -> bool:
    # Each .gitignore speaks for paths below its folder; the deepest one with a verdict wins.
    verdict = None
    for base, spec in specs:
        sub = rel[len(base) + 1:] if base else rel
        include = spec.check_file(sub + "/" if is_dir else sub).include
        verdict = verdict if include is None else include
    return bool(verdict)


def _kind(entry: os.DirEntry[str]) -> str:
    """'dir' or 'file' (following symlinks), or why the entry is neither."""
    try:
        if entry.is_dir():
            return "dir"
        if entry.is_file():
            return "file"
    except OSError as e:  # a symlink to itself raises ELOOP
        return "symlink loop" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
    return "broken symlink" if entry.is_symlink() else "not a regular file"


def _with_gitignore(specs: list[tuple[str, pathspec.GitIgnoreSpec]], d: Path,
                    rel: str) -> list[tuple[str, pathspec.GitIgnoreSpec]]:
    """`specs` plus the rules of `d/.gitignore` if there is one; OSError if `d` or its
    .gitignore cannot be read (its rules unknown, nothing in `d` may be taken)."""
    gitignore = d / ".gitignore"
    if not gitignore.is_file():
        return specs
    lines = gitignore.read_text(encoding="utf-8", errors="replace").splitlines()
    return [*specs, (rel, pathspec.GitIgnoreSpec.from_lines(lines))]


# starqa's own cache (models, manifests, shards) is never part of a context, wherever
# STARQA_HOME points: ingesting it would grow it, and each run would read its previous one.
CACHE = "starqa's own cache folder (never ingested)"


def _cache_folder() -> str | None:
    """The real path of starqa's cache folder (`paths.home`), None if it cannot be one."""
    from starqa.core import paths

    try:
        return os.path.realpath(paths.home())
    except StarqaError:
        return None


def _within(real: str, folder: str | None) -> bool:
    """Whether the real path `real` is `folder` or below it."""
    return folder is not None and (real == folder or
                                   real.startswith(folder.rstrip(os.sep) + os.sep))


@dataclass
class _Dir:
    """A folder `_walk_plain` is in: its entries still to visit and the rules over them."""

    rel: str
    real: str
    specs: list[tuple[str, pathspec.GitIgnoreSpec]]
    entries: Iterator[os.DirEntry[str]]


def _walk_plain(folder: Path, exclude: _Globs,
                cache: str | None = None) -> Iterator[tuple[str, Path] | Skipped]:
    """Walk a folder outside git, honouring `.gitignore`s and following symlinks without
    looping; depth-first with a stack of its own, so any depth of folders walks."""
    top = os.path.realpath(folder)
    seen: set[str] = {top}

    def enter(d: str, rel: str, real: str, specs) -> _Dir | Skipped:
        try:  # a folder we may not enter is skipped like an unreadable file, not a crash
            specs = _with_gitignore(specs, Path(d), rel)
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            return Skipped(rel or ".", f"unreadable ({e.strerror})")
        return _Dir(rel, real, specs, iter(entries))

    first = enter(str(folder), "", top, [])
    if isinstance(first, Skipped):
        yield first
        return
    stack = [first]
    while stack:
        here = stack[-1]
        entry = next(here.entries, None)
        if entry is None:
            stack.pop()
            continue
        child = f"{here.rel}/{entry.name}" if here.rel else entry.name
        kind = _kind(entry)
        link = entry.is_symlink()
        if entry.name == ".git":
            continue
        if entry.name.startswith("."):
            yield Skipped(child, "hidden")
        elif kind not in ("dir", "file"):
            yield Skipped(child, kind)
        elif link and leaves(folder, Path(entry.path)):
            yield Skipped(child, OUTSIDE)
        elif _ignored(here.specs, child, kind == "dir"):
            yield Skipped(child, "ignored by .gitignore")
        elif kind == "file":
            yield child, Path(entry.path)
        elif exclude.match(child, is_dir=True):
            yield Skipped(child, "excluded by --exclude")
        elif _within(real := os.path.realpath(entry.path) if link else
                     os.path.join(here.real, entry.name), cache):
            yield Skipped(child, CACHE)
        elif real in seen and any(d.real == real for d in stack):  # a link back up
            yield Skipped(child, "symlink loop")
        elif real not in seen:  # a second link to a folder already walked adds nothing
            seen.add(real)
            got = enter(entry.path, child, real, here.specs)
            if isinstance(got, Skipped):
                yield got
            else:
                stack.append(got)


def _human(n: int) -> str:
    for unit, scale in (("MB", 1_000_000), ("KB", 1_000)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _read(path: Path, display: str, max_bytes: int,
          committed: tuple[str, int] | None = None) -> TextFile | str:
    """The file's text, or the reason it cannot be used. Oversized files are never read, and
    a file that grows while it is read is read only to the cap. `committed`: the file's blob
    id at HEAD and that commit's time, taken as its change time if its bytes are those."""
    try:
        stat = path.stat()
        if stat.st_size > max_bytes:
            return f"too large ({_human(stat.st_size)} > {_human(max_bytes)} cap)"
        # non-blocking: a FIFO put in the file's place would otherwise wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as fh:
            stat = os.fstat(fd)
            if not S_ISREG(stat.st_mode):
                return "not a regular file"
            if stat.st_size > max_bytes:
                return f"too large ({_human(stat.st_size)} > {_human(max_bytes)} cap)"
            data = fh.read(max_bytes + 1)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if len(data) > max_bytes:
        return f"too large (over {_human(max_bytes)} cap while read)"
    if b"\0" in data[:SNIFF_BYTES]:
        return "binary (NUL byte)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")
    if not text.strip():
        return "empty"
    changed = int(stat.st_mtime)
    if committed is not None:
        blob, when = committed  # sha1 ids are 40 hex digits, sha256 ones 64
        if git.blob_id(data, "sha1" if len(blob) == 40 else "sha256") == blob:
            changed = when
    return TextFile(display, text, len(data), changed)


def _labels(paths: list[Path]) -> list[str]:
    """Shortest unique trailing path parts, used to prefix display paths when several roots."""
    for k in range(1, max(len(p.parts) for p in paths) + 1):
        labels = ["/".join(p.parts[-k:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [p.as_posix() for p in paths]


def _starqaignore(root: Path) -> pathspec.GitIgnoreSpec | None:
    """`.starqaignore` at a folder's top: gitignore patterns for files starqa should not
    ingest even though git tracks them (e.g. the answer key next to sample documents)."""
    path = root / STARQAIGNORE
    if not path.is_file():
        return None
    return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())


# A name that is not UTF-8 cannot be a document's path (nor go into the manifest); it is
# shown with its odd bytes as \xNN.
NOT_UTF8_NAME = "name not UTF-8 (rename it to ingest it)"


def _printable(name: str) -> str:
    """`name` (from the file system: odd bytes as surrogates) with odd bytes as \\xNN."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


NOT_INCLUDED = "not matched by --include"  # left out of the report, counted when nothing is left


_ASK = object()  # `_candidates`' repo: not known yet, ask `git.use_git`


def _candidates(root: Path, label: str, include: _Globs, exclude: _Globs, repo=_ASK,
                cache: str | None = None) -> Iterator[tuple[str, Path] | Skipped]:
    """(display path, path on disk) of files to read under one root, or Skipped entries
    (NOT_INCLUDED ones are for counting, not reporting). repo: the `git.Repo` `root` is read
    through, or None (`git.use_git`, asked here when not given); cache: starqa's cache folder,
    never taken."""
    if root.is_file():  # named explicitly: no hidden, ignore, lock or glob rules
        display = label or root.name
        ok = _printable(display) == display
        yield (display, root) if ok else Skipped(_printable(display), NOT_UTF8_NAME)
        return
    repo = git.use_git(root) if repo is _ASK else repo
    if repo is None and git.bare(root):
        yield Skipped(_printable(label or "."), BARE)
        return
    walk = git.walk(repo, root) if repo is not None else _walk_plain(root, exclude, cache)
    prefix = f"{label}/" if label else ""
    own_ignore = _starqaignore(root)
    real_root = os.path.realpath(root)
    cache_rel = os.path.relpath(cache, real_root) if cache and _within(cache, real_root) else None
    for item in walk:
        if isinstance(item, Skipped):
            yield Skipped(_printable(prefix + item.path), item.reason)
            continue
        rel, path = item
        if _printable(prefix + rel) != prefix + rel:
            yield Skipped(_printable(prefix + rel), NOT_UTF8_NAME)
        elif cache is not None and _within(os.path.realpath(path), cache):
            under = cache_rel if cache_rel and (rel + "/").startswith(cache_rel + "/") else rel
            yield Skipped(prefix + under, CACHE)  # git's files there: one line for them all
        elif own_ignore is not None and own_ignore.match_file(rel):
            yield Skipped(prefix + rel, f"ignored by {STARQAIGNORE}")
        elif exclude.match(rel, prefix + rel):
            yield Skipped(prefix + rel, "excluded by --exclude")
        elif include.patterns and not include.match(rel, prefix + rel):
            yield Skipped(prefix + rel, NOT_INCLUDED)
        elif path.name in LOCK_FILES:
            yield Skipped(prefix + rel, "lock file")
        else:
            yield prefix + rel, path


def _skip_summary(skipped: Iterable[Skipped]) -> str:
    counts = Counter(s.reason.split(" (")[0].removesuffix(" by .gitignore").removesuffix(
        " by --exclude") for s in skipped)
    return "skipped: " + ", ".join(f"{n} {why}" for why, n in counts.most_common())


def _include_matched_nothing(include: Sequence[str], left_out: list[str],
                             where: str) -> StarqaError:
    """Files were found, and --include took none of them: say so, and what would."""
    suffixes = Counter(Path(p).suffix.lower() or Path(p).name for p in left_out)
    found = ", ".join(f"{n} {s}" for s, n in suffixes.most_common(4))
    lower = [g.lower() for g in include]  # '*.MD' for '*.md': globs match case-sensitively
    if lower != list(include) and any(_Globs(lower).match(p) for p in left_out):
        fix = " ".join(f"--include {shlex.quote(g)}" for g in lower)
    else:
        common = suffixes.most_common(1)[0][0]
        fix = f"--include {shlex.quote('*' + common if common.startswith('.') else common)}"
    asked = " ".join(f"--include {shlex.quote(g)}" for g in include)
    return StarqaError(f"Nothing to ingest: {len(left_out)} file(s) found under {where} "
                       f"({found}), but {asked} matched none of them.",
                       hint=f"{fix} (or leave out --include to take them all)")


def candidates(paths: Sequence[str | Path], *, include: Sequence[str] = (),
               exclude: Sequence[str] = ()) -> set[str]:
    """The real paths of the files `collect` would read under `paths` (the same selection:
    git or .gitignores, .starqaignore, --include, --exclude, lock files), unread: what
    `ingest --watch` compares changed paths with. Missing paths are skipped."""
    roots = [Path(os.path.abspath(p)) for p in paths if os.path.exists(p)]
    labels = _labels(roots) if len(roots) > 1 else [""] * len(roots)
    inc, exc = _Globs(include), _Globs(exclude)
    cache = _cache_folder()
    return {os.path.realpath(item[1]) for root, label in zip(roots, labels)
            for item in _candidates(root, label, inc, exc, cache=cache)
            if not isinstance(item, Skipped)}


def collect(paths: Sequence[str | Path], *, max_file_bytes: int = 1_000_000,
            include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Corpus:
    """Choose the readable text files under `paths`, sorted by display path."""
    given: dict[str, Path] = {}  # real path -> path as given, first wins
    for p in paths:
        if not os.path.exists(p):
            raise StarqaError(f"No such file or directory: {p}")
        given.setdefault(str(Path(p).resolve()), Path(os.path.abspath(p)))
    roots = list(given.values())
    labels = _labels(roots) if len(roots) > 1 else [""]
    inc, exc = _Globs(include), _Globs(exclude)
    cache = _cache_folder()
    files: dict[str, TextFile] = {}  # real path -> file
    skipped: list[Skipped] = []
    left_out: list[str] = []  # found, but not matched by --include
    for root, label in zip(roots, labels):
        repo = git.use_git(root) if root.is_dir() else None
        committed = git.commit_times(repo, root) if repo is not None else {}
        prefix = f"{label}/" if label else ""
        for item in _candidates(root, label, inc, exc, repo, cache):
            if isinstance(item, Skipped):
                if item.reason == NOT_INCLUDED:
                    left_out.append(item.path)
                else:
                    skipped.append(item)
                continue
            display, path = item
            real = os.path.realpath(path)
            if real in files:
                continue
            got = _read(path, display, max_file_bytes, committed.get(display.removeprefix(prefix)))
            if isinstance(got, str):
                skipped.append(Skipped(display, got))
            else:
                files[real] = got
    if not files:
        where = ", ".join(str(p) for p in paths)
        if left_out:
            raise _include_matched_nothing(include, left_out, where)
        bare = [s.path for s in skipped if s.reason == BARE]
        if bare and len(bare) == len(skipped):
            clone = f"{Path(paths[0]).resolve().name.removesuffix('.git')}-files"
            raise StarqaError(f"Nothing to ingest: {where} is a bare git repository (its "
                              "history, no files to read).",
                              hint=f"git clone {shlex.quote(str(paths[0]))} {clone} && "
                                   f"starqa ingest {clone}")
        hint = _skip_summary(skipped) if skipped else "no files found"
        raise StarqaError(f"Nothing to ingest: no readable text files under {where}", hint=hint)
    return Corpus(
        roots=tuple(given),
        files=tuple(sorted(files.values(), key=lambda f: f.path)),
        skipped=tuple(sorted(set(skipped), key=lambda s: s.path)),
    )
