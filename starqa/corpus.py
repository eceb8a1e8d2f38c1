"""Corpus selection and packing.

`collect` chooses which files under the user's paths become the context (git's view of a
work tree, `.gitignore`s elsewhere, no hidden, lock, binary, oversized or non-UTF-8 files)
and says why each other file was skipped. `pack` lays the chosen files out as one text, each
inside a `<document path="...">` block, and returns every file's character span so that
answers can point back to files and lines. No model code here.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pathspec

from starqa.errors import StarqaError

STARQAIGNORE = ".starqaignore"  # per-folder ignore file, gitignore syntax, top level only
LOCK_FILES = frozenset({
    "package-lock.json", "yarn.lock", "pnpm-lock.yaml", "poetry.lock", "Cargo.lock", "uv.lock",
    "Pipfile.lock", "composer.lock", "Gemfile.lock", "go.sum",
})
SNIFF_BYTES = 8192  # a NUL byte in this prefix marks a file as binary (git's own heuristic)
_CLOSE = "\n</document>"


@dataclass(frozen=True)
class SourceFile:
    path: str  # display path, forward slashes
    text: str  # UTF-8 text, LF line ends, no BOM
    size: int  # bytes on disk
    # When it last changed, seconds since the epoch: in a git work tree, the last commit
    # that touched a file left as committed (0: before the history read); else its mtime.
    # What `packorder` lays the files out by.
    changed: int = 0


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True)
class Corpus:
    roots: tuple[str, ...]
    files: tuple[SourceFile, ...]  # sorted by path (`packorder` lays them out for packing)
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True)
class FileSpan:
    path: str
    char_start: int  # [char_start, char_end): the whole block, header and closing tag included
    char_end: int
    text_start: int  # where the file's own text begins
    lines: int


# ---------------------------------------------------------------- selection


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


# A folder's own git config is not the user's: a tarball or shared folder can carry a
# `.git/config` that names programs. Of the keys that run programs, `ls-files`,
# `check-ignore` and `rev-parse` reach only core.fsmonitor (verified on git 2.39: filters,
# textconv, diff.external, credential and ssh helpers are not used by them), `log` also
# gpg's programs (log.showSignature), `diff` diff.external; the others are pinned too, so
# that a later git, or a later command here, stays safe. Command-line `-c` outranks every
# config file (includes and worktree config too).
_GIT_SAFE = ("--no-pager", "--no-optional-locks", "-c", "core.fsmonitor=false",
             "-c", "core.hooksPath=/dev/null", "-c", "core.pager=cat",
             "-c", "core.untrackedCache=false", "-c", "diff.external=",
             "-c", "credential.helper=", "-c", "core.sshCommand=false",
             "-c", "protocol.allow=never", "-c", "log.showSignature=false",
             "-c", "gpg.program=false", "-c", "gpg.ssh.program=false",
             "-c", "gpg.x509.program=false")
# The user's environment may point git at another repository or index; starqa means the
# folder's own. GIT_PAGER etc. are neutralised; system and global config stay (they are the
# user's own, and carry the core.excludesFile that --exclude-standard honours).
_GIT_ENV_DROP = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR",
                 "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG",
                 "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT", "GIT_EXTERNAL_DIFF")


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _GIT_ENV_DROP and not k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))}
    env.update(GIT_PAGER="cat", PAGER="cat", GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0",
               GIT_ASKPASS="false", SSH_ASKPASS="false")
    return env


def _run_git(folder: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    """Run a read-only git query in `folder` without running anything its config names."""
    try:
        return subprocess.run(["git", *_GIT_SAFE, *args], cwd=folder, env=_git_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, check=False)
    except OSError:  # git is not installed
        return None


def _use_git(folder: Path) -> bool:
    """Inside a git work tree, and not in a folder that the repository itself ignores."""
    top = _run_git(folder, "rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0:
        return False
    ignored = _run_git(folder, "check-ignore", "-q", ".")
    return ignored is None or ignored.returncode != 0


GIT_HISTORY = 2000  # commits read for the files' last change times


def _git_times(folder: Path) -> dict[str, int]:
    """{path under `folder`: when the last commit that touched it was made} for the files
    tracked and left as committed (0 for one older than the last GIT_HISTORY commits);
    files changed since, or untracked, are left out (their mtime says when). {} when git
    cannot tell (no commit yet)."""
    tracked = _run_git(folder, "ls-files", "-z")
    dirty = _run_git(folder, "diff", "--name-only", "-z", "--no-ext-diff", "--no-textconv",
                     "--no-renames", "--relative", "HEAD", "--", ".")
    log = _run_git(folder, "log", f"-n{GIT_HISTORY}", "--format=%x01%ct", "--name-only", "-z",
                   "--no-renames", "--no-show-signature", "--relative", "--", ".")
    if any(out is None or out.returncode != 0 for out in (tracked, dirty, log)):
        return {}
    times: dict[str, int] = {}
    when = 0
    for item in log.stdout.split(b"\0"):  # "\x01<time>", "\n<path>", "<path>", ...
        item = item.lstrip(b"\n")
        if item.startswith(b"\x01"):
            when = int(item[1:])
        elif item:
            times.setdefault(os.fsdecode(item), when)  # newest first: the first is the last
    changed = {os.fsdecode(p) for p in dirty.stdout.split(b"\0") if p}
    return {rel: times.get(rel, 0) for rel in (os.fsdecode(p) for p in tracked.stdout.split(b"\0")
                                               if p) if rel not in changed}


def _git_ls(folder: Path, *args: str) -> list[str]:
    out = _run_git(folder, "ls-files", "-z", "--others", "--exclude-standard", *args)
    if out is None or out.returncode != 0:
        hint = out.stderr.decode(errors="replace").strip() if out else None
        raise StarqaError(f"git ls-files failed in {folder}", hint=hint)
    return sorted({os.fsdecode(p).rstrip("/") for p in out.stdout.split(b"\0") if p})


def _hidden_prefix(rel: str) -> str | None:
    parts = rel.split("/")
    for i, part in enumerate(parts):
        if part.startswith("."):
            return "/".join(parts[: i + 1])
    return None


def _walk_git(folder: Path) -> Iterator[tuple[str, Path] | Skipped]:
    """What git tracks or would track under `folder`; ignored entries reported once each."""
    reported: set[str] = set()
    listed = [(r, "ignored by .gitignore") for r in _git_ls(folder, "--ignored", "--directory")]
    listed += [(r, "") for r in _git_ls(folder, "--cached")]
    for rel, reason in listed:
        hidden = _hidden_prefix(rel)
        if hidden is not None:
            if hidden not in reported and hidden.rsplit("/", 1)[-1] != ".git":
                reported.add(hidden)
                yield Skipped(hidden, "hidden")
        elif reason:
            yield Skipped(rel, reason)
        elif _leaves(folder, folder / rel):
            yield Skipped(rel, OUTSIDE)
        elif (kind := _git_entry_kind(folder / rel)) == "file":
            yield rel, folder / rel
        elif kind:
            yield Skipped(rel, kind)


# A symlink whose target lies outside the folder being ingested is not followed: a
# downloaded repository could otherwise pull ~/.ssh or /etc into the context (and into
# answers and sources). A user who wants the target ingests it as a path of its own.
OUTSIDE = "symlink to outside the folder (not followed; pass its target to ingest it)"


def _leaves(root: Path, path: Path) -> bool:
    """Whether `path`, a symlink or below one, resolves outside `root`."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep)


def _git_entry_kind(path: Path) -> str:
    """'file', '' for what git lists that is not a file (deleted files, submodules), or why
    it cannot be looked at (a tracked file in a folder we may not enter)."""
    try:
        return "file" if path.is_file() else ""
    except OSError as e:
        return f"unreadable ({e.strerror})"


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


def _walk_plain(folder: Path, exclude: _Globs) -> Iterator[tuple[str, Path] | Skipped]:
    """Walk a folder outside git, honouring `.gitignore`s and following symlinks without looping."""
    seen: set[str] = set()

    def visit(d: Path, rel: str, specs: list[tuple[str, pathspec.GitIgnoreSpec]],
              chain: frozenset[str]) -> Iterator[tuple[str, Path] | Skipped]:
        try:  # a folder we may not enter is skipped like an unreadable file, not a crash
            specs = _with_gitignore(specs, d, rel)
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            yield Skipped(rel or ".", f"unreadable ({e.strerror})")
            return
        for entry in entries:
            child = f"{rel}/{entry.name}" if rel else entry.name
            kind = _kind(entry)
            if entry.name == ".git":
                continue
            if entry.name.startswith("."):
                yield Skipped(child, "hidden")
            elif kind not in ("dir", "file"):
                yield Skipped(child, kind)
            elif entry.is_symlink() and _leaves(folder, Path(entry.path)):
                yield Skipped(child, OUTSIDE)
            elif _ignored(specs, child, kind == "dir"):
                yield Skipped(child, "ignored by .gitignore")
            elif kind == "file":
                yield child, Path(entry.path)
            elif exclude.match(child, is_dir=True):
                yield Skipped(child, "excluded by --exclude")
            elif (real := os.path.realpath(entry.path)) in chain:
                yield Skipped(child, "symlink loop")
            elif real not in seen:  # a second link to a folder already walked adds nothing
                seen.add(real)
                yield from visit(Path(entry.path), child, specs, chain | {real})

    seen.add(os.path.realpath(folder))
    yield from visit(folder, "", [], frozenset(seen))


def _human(n: int) -> str:
    for unit, scale in (("MB", 1_000_000), ("KB", 1_000)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _read(path: Path, display: str, max_bytes: int) -> SourceFile | str:
    """The file's text, or the reason it cannot be used. Oversized files are never read."""
    try:
        stat = path.stat()
        size = stat.st_size
        if size > max_bytes:
            return f"too large ({_human(size)} > {_human(max_bytes)} cap)"
        data = path.read_bytes()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if b"\0" in data[:SNIFF_BYTES]:
        return "binary (NUL byte)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")
    return SourceFile(display, text, len(data), int(stat.st_mtime)) if text.strip() else "empty"


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


def _candidates(root: Path, label: str, include: _Globs, exclude: _Globs,
                git: bool | None = None) -> Iterator[tuple[str, Path] | Skipped]:
    """(display path, path on disk) of files to read under one root, or Skipped entries.
    git: whether `root` is read through git (`_use_git`, asked here when not given)."""
    if root.is_file():  # named explicitly: no hidden, ignore, lock or glob rules
        yield root.name if not label else label, root
        return
    walk = _walk_git(root) if (_use_git(root) if git is None else git) else \
        _walk_plain(root, exclude)
    prefix = f"{label}/" if label else ""
    own_ignore = _starqaignore(root)
    for item in walk:
        if isinstance(item, Skipped):
            yield Skipped(prefix + item.path, item.reason)
            continue
        rel, path = item
        if own_ignore is not None and own_ignore.match_file(rel):
            yield Skipped(prefix + rel, f"ignored by {STARQAIGNORE}")
        elif exclude.match(rel, prefix + rel):
            yield Skipped(prefix + rel, "excluded by --exclude")
        elif include.patterns and not include.match(rel, prefix + rel):
            continue  # not asked for: not worth a line in the report
        elif path.name in LOCK_FILES:
            yield Skipped(prefix + rel, "lock file")
        else:
            yield prefix + rel, path


def _skip_summary(skipped: Iterable[Skipped]) -> str:
    counts = Counter(s.reason.split(" (")[0].removesuffix(" by .gitignore").removesuffix(
        " by --exclude") for s in skipped)
    return "skipped: " + ", ".join(f"{n} {why}" for why, n in counts.most_common())


def candidates(paths: Sequence[str | Path], *, include: Sequence[str] = (),
               exclude: Sequence[str] = ()) -> set[str]:
    """The real paths of the files `collect` would read under `paths` (the same selection:
    git or .gitignores, .starqaignore, --include, --exclude, lock files), unread: what
    `ingest --watch` compares changed paths with. Missing paths are skipped."""
    roots = [Path(os.path.abspath(p)) for p in paths if os.path.exists(p)]
    labels = _labels(roots) if len(roots) > 1 else [""] * len(roots)
    inc, exc = _Globs(include), _Globs(exclude)
    return {os.path.realpath(item[1]) for root, label in zip(roots, labels)
            for item in _candidates(root, label, inc, exc) if not isinstance(item, Skipped)}


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
    files: dict[str, SourceFile] = {}  # real path -> file
    skipped: list[Skipped] = []
    for root, label in zip(roots, labels):
        git = root.is_dir() and _use_git(root)
        committed = _git_times(root) if git else {}
        prefix = f"{label}/" if label else ""
        for item in _candidates(root, label, inc, exc, git):
            if isinstance(item, Skipped):
                skipped.append(item)
                continue
            display, path = item
            real = os.path.realpath(path)
            if real in files:
                continue
            got = _read(path, display, max_file_bytes)
            if isinstance(got, str):
                skipped.append(Skipped(display, got))
            else:
                when = committed.get(display.removeprefix(prefix))
                files[real] = got if when is None else replace(got, changed=when)
    if not files:
        hint = _skip_summary(skipped) if skipped else "no files found"
        where = ", ".join(str(p) for p in paths)
        raise StarqaError(f"Nothing to ingest: no readable text files under {where}", hint=hint)
    return Corpus(
        roots=tuple(given),
        files=tuple(sorted(files.values(), key=lambda f: f.path)),
        skipped=tuple(sorted(set(skipped), key=lambda s: s.path)),
    )


# ---------------------------------------------------------------- packing


def pack(files: Sequence[SourceFile]) -> tuple[str, list[FileSpan]]:
    """Join files as `<document path="...">` blocks separated by a blank line, with their spans."""
    blocks: list[str] = []
    spans: list[FileSpan] = []
    pos = 0
    for f in files:
        header, body = f'<document path="{f.path}">\n', f.text.rstrip()
        block = f"{header}{body}{_CLOSE}"
        if blocks:
            pos += 2  # the "\n\n" between blocks
        lines = body.count("\n") + 1 if body else 0
        spans.append(FileSpan(f.path, pos, pos + len(block), pos + len(header), lines))
        blocks.append(block)
        pos += len(block)
    return "\n\n".join(blocks), spans


def line_of(span: FileSpan, packed: str, char_offset: int) -> int:
    """1-based line in the file at `char_offset` of `packed`; offsets outside the text clamp."""
    text_end = span.char_end - len(_CLOSE)
    offset = min(max(char_offset, span.text_start), text_end)
    return min(packed.count("\n", span.text_start, offset) + 1, max(span.lines, 1))


def content_hash(files: Iterable[SourceFile]) -> str:
    """sha256 hex over every file's path and text, in order; length-prefixed so unambiguous."""
    h = hashlib.sha256(b"starqa-corpus-v1\0")
    for f in files:
        for part in (f.path.encode(), f.text.encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()
