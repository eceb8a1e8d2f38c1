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
import re
import shlex
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import pathspec

from starqa.core.errors import StarqaError

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
# `.git/config` (or a `gitdir:` file pointing at one elsewhere) that names programs in
# filter, diff and merge drivers, hooks, fsmonitor, pagers, editors, credential, ssh, gpg
# and protocol helpers. Git runs a filter driver whenever it hashes work-tree content
# (any command that refreshes the index: `diff`, `status`, `add`...), and the drivers'
# names are the repository's own, so no `-c` can pin them all. starqa therefore never asks
# git about the work tree's content: it reads only the index, the objects and the refs
# (`_GIT_READS`: which files are tracked, their blob ids at HEAD, the log), and tells an
# edited file from a committed one by hashing the bytes itself (`_blob_id`). The `-c` pins
# below cover every fixed key that names a program, should a later git reach one from these
# reads; command-line `-c` outranks every config file (includes and worktree config too).
# (uploadpack.packObjectsHook, core.alternateRefsCommand and core.gitProxy are only used
# by upload-pack, push and git:// fetches, which starqa never runs and `_git_env` forbids;
# git ignores the first in a repository's config.)
_GIT_SAFE = ("--no-pager", "--no-optional-locks", "-c", "core.fsmonitor=false",
             "-c", "core.hooksPath=/dev/null", "-c", "core.pager=cat",
             "-c", "core.untrackedCache=false", "-c", "diff.external=",
             "-c", "credential.helper=", "-c", "core.sshCommand=false",
             "-c", "core.askPass=false", "-c", "core.editor=false",
             "-c", "sequence.editor=false",
             "-c", "protocol.allow=never", "-c", "protocol.ext.allow=never",
             "-c", "log.showSignature=false", "-c", "gpg.program=false",
             "-c", "gpg.openpgp.program=false", "-c", "gpg.ssh.program=false",
             "-c", "gpg.x509.program=false", "-c", "fetch.recurseSubmodules=false")
# The only git commands starqa runs, and why none converts work-tree content: `rev-parse`
# and `check-ignore` read paths and config, `ls-files` (never -m/-d, which compare the work
# tree) the index and directory names, `ls-tree` and `log --name-only` objects only.
_GIT_READS = frozenset({"rev-parse", "check-ignore", "ls-files", "ls-tree", "log"})
_GIT_REFUSED = frozenset({"-m", "--modified", "-d", "--deleted", "-k", "--killed", "-p",
                          "--patch", "--stat", "--textconv", "--ext-diff", "--recurse-submodules"})
# The user's environment may point git at another repository or index; starqa means the
# folder's own. GIT_PAGER etc. are neutralised; system and global config stay (they are the
# user's own, and carry the core.excludesFile that --exclude-standard honours). A partial
# clone would fetch a missing object from its promisor remote, whose URL the repository
# names (an `ext::` URL is a program): no protocol is allowed, no lazy fetch made.
_GIT_ENV_DROP = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR",
                 "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG",
                 "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT", "GIT_EXTERNAL_DIFF",
                 "GIT_NAMESPACE", "GIT_SSH", "GIT_SSH_COMMAND", "GIT_PROXY_COMMAND")


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _GIT_ENV_DROP and not k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))}
    env.update(GIT_PAGER="cat", PAGER="cat", GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0",
               GIT_ASKPASS="false", SSH_ASKPASS="false", GIT_EDITOR="false",
               GIT_ALLOW_PROTOCOL="none", GIT_PROTOCOL_FROM_USER="0", GIT_NO_LAZY_FETCH="1",
               GIT_NO_REPLACE_OBJECTS="1")
    return env


@dataclass(frozen=True)
class _Repo:
    """A work tree found as git finds it: `dot_git` is the `.git` folder or `gitdir:` file
    in `top` (git resolves the file). Every command gets both explicitly, so a
    `core.worktree` in the config cannot move the work tree away from the user's folder."""

    dot_git: Path
    top: Path


def _find_repo(folder: Path) -> _Repo | None:
    """The nearest `.git` folder (with a HEAD) or `gitdir:` file at or above `folder`, as git
    looks (not above GIT_CEILING_DIRECTORIES, nor across file systems unless
    GIT_DISCOVERY_ACROSS_FILESYSTEM); None outside git and inside a `.git` folder itself."""
    here = Path(os.path.realpath(folder))
    ceilings = {os.path.realpath(c) for c in os.environ.get("GIT_CEILING_DIRECTORIES",
                                                           "").split(os.pathsep) if c}
    across = os.environ.get("GIT_DISCOVERY_ACROSS_FILESYSTEM", "").lower() in (
        "1", "true", "yes", "on")
    device = here.stat().st_dev
    for d in (here, *here.parents):
        dot_git = d / ".git"
        try:
            if d != here and (str(d) in ceilings or not across and d.stat().st_dev != device):
                return None
            if dot_git.is_dir():
                found = (dot_git / "HEAD").is_file()
            elif dot_git.is_file():  # a `gitdir:` file (a FIFO would wait: never opened)
                with open(dot_git, "rb") as fh:
                    found = fh.read(8) == b"gitdir: "
            else:
                found = False
        except OSError:  # a folder above we may not look into: git stops there too
            return None
        if found:
            inside = here.relative_to(d).parts
            return None if inside[:1] == (".git",) else _Repo(dot_git, d)
    return None


def _run_git(repo: _Repo, folder: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    """Run a read-only git query in `folder` of `repo` without running anything its config
    names."""
    if args[0] not in _GIT_READS or _GIT_REFUSED & set(args):  # a bug here, never input
        raise ValueError(f"git {' '.join(args)} may read the work tree through its filters")
    cmd = ["git", f"--git-dir={repo.dot_git}", f"--work-tree={repo.top}", *_GIT_SAFE, *args]
    try:
        return subprocess.run(cmd, cwd=os.path.realpath(folder), env=_git_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, check=False)
    except OSError:  # git is not installed
        return None


def _use_git(folder: Path) -> _Repo | None:
    """The repository whose work tree `folder` is in, unless the repository itself ignores
    `folder` (or git cannot read it: then the folder is walked like any other)."""
    repo = _find_repo(folder)
    if repo is None:
        return None
    ok = _run_git(repo, folder, "rev-parse", "--git-dir")
    if ok is None or ok.returncode != 0:
        return None
    ignored = _run_git(repo, folder, "check-ignore", "-q", ".")
    return repo if ignored is None or ignored.returncode != 0 else None


GIT_HISTORY = 2000  # commits read for the files' last change times


def _blob_id(data: bytes, algorithm: str) -> str:
    """The object id git gives a file of these bytes stored as they are (no filters)."""
    h = hashlib.new(algorithm, b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def _git_times(repo: _Repo, folder: Path) -> dict[str, tuple[str, int]]:
    """{path under `folder`: (its blob id at HEAD, when the last commit that touched it was
    made)} (the time 0 for a file older than the last GIT_HISTORY commits); a file whose
    bytes hash to that id is as committed. {} when git cannot tell (no commit yet)."""
    tree = _run_git(repo, folder, "ls-tree", "-r", "-z", "HEAD")
    log = _run_git(repo, folder, "log", f"-n{GIT_HISTORY}", "--format=%x01%ct", "--name-only",
                   "-z", "--no-renames", "--no-show-signature", "--no-ext-diff", "--no-textconv",
                   "--relative", "--", ".")
    if any(out is None or out.returncode != 0 for out in (tree, log)):
        return {}
    times: dict[str, int] = {}
    when = 0
    for item in log.stdout.split(b"\0"):  # "\x01<time>", "\n<path>", "<path>", ...
        item = item.lstrip(b"\n")
        if item.startswith(b"\x01"):
            when = int(item[1:])
        elif item:
            times.setdefault(os.fsdecode(item), when)  # newest first: the first is the last
    blobs: dict[str, tuple[str, int]] = {}
    for entry in tree.stdout.split(b"\0"):  # "<mode> blob <id>\t<path>"
        meta, _, path = entry.partition(b"\t")
        parts = meta.split(b" ")
        if len(parts) == 3 and parts[1] == b"blob":
            rel = os.fsdecode(path)
            blobs[rel] = (parts[2].decode(), times.get(rel, 0))
    return blobs


def _git_ls(repo: _Repo, folder: Path, *args: str) -> list[bytes]:
    out = _run_git(repo, folder, "ls-files", "-z", *args)
    if out is None or out.returncode != 0:
        why = out.stderr.decode(errors="replace").strip() if out else "git is gone"
        raise StarqaError(f"git cannot list the files of {repo.top} ({why}), so starqa "
                          "cannot tell which of them git tracks.",
                          hint="if the index is damaged, rebuild it from the last commit "
                               f"(running none of the repository's programs): git -C "
                               f"{shlex.quote(str(repo.top))} -c core.hooksPath=/dev/null -c "
                               "core.fsmonitor=false -c protocol.ext.allow=never read-tree "
                               "HEAD")
    return [p for p in out.stdout.split(b"\0") if p]


SUBMODULE = "git submodule (ingest it as a path of its own)"
NESTED = "nested git repository (ingest it as a path of its own)"


def _hidden_prefix(rel: str) -> str | None:
    parts = rel.split("/")
    for i, part in enumerate(parts):
        if part.startswith("."):
            return "/".join(parts[: i + 1])
    return None


def _walk_git(repo: _Repo, folder: Path) -> Iterator[tuple[str, Path] | Skipped]:
    """What git tracks or would track under `folder`, as far as it is on disk; ignored
    entries, submodules and nested repositories reported once each."""
    reported: set[str] = set()
    listed = [(os.fsdecode(p).rstrip("/"), "ignored by .gitignore")
              for p in _git_ls(repo, folder, "--others", "--exclude-standard", "--ignored",
                               "--directory")]
    for entry in _git_ls(repo, folder, "--stage"):  # "<mode> <id> <stage>\t<path>"
        meta, _, path = entry.partition(b"\t")
        listed.append((os.fsdecode(path), SUBMODULE if meta.startswith(b"160000 ") else ""))
    for p in _git_ls(repo, folder, "--others", "--exclude-standard"):
        rel = os.fsdecode(p)  # a folder ("sub/") here is a repository of its own
        listed.append((rel.rstrip("/"), NESTED if rel.endswith("/") else ""))
    for rel, reason in sorted(set(listed)):
        if not os.path.lexists(folder / rel):  # in the index only (deleted, another work tree)
            continue
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
    """'file', '' for what git lists that is not a file (a folder), or why it cannot be
    read (a symlink loop, a broken symlink, a tracked file in a folder we may not enter)."""
    try:
        if path.is_file():
            return "file"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if os.path.islink(path):  # is_file says False for these too
        try:
            os.stat(path)
        except OSError as e:
            return "symlink loop" if e.errno == errno.ELOOP else "broken symlink"
    return ""


BARE = "bare git repository (no work tree: clone it, and ingest the clone)"


def _bare(folder: Path) -> bool:
    """Whether `folder` looks like a bare repository (HEAD, objects/, refs/, no work tree)."""
    return all(os.path.exists(folder / name) for name in ("HEAD", "objects", "refs", "config"))


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
        elif link and _leaves(folder, Path(entry.path)):
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
          committed: tuple[str, int] | None = None) -> SourceFile | str:
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
        if _blob_id(data, "sha1" if len(blob) == 40 else "sha256") == blob:
            changed = when
    return SourceFile(display, text, len(data), changed)


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

_ASK = object()  # `_candidates`' repo: not known yet, ask `_use_git`


def _candidates(root: Path, label: str, include: _Globs, exclude: _Globs, repo=_ASK,
                cache: str | None = None) -> Iterator[tuple[str, Path] | Skipped]:
    """(display path, path on disk) of files to read under one root, or Skipped entries
    (NOT_INCLUDED ones are for counting, not reporting). repo: the `_Repo` `root` is read
    through, or None (`_use_git`, asked here when not given); cache: starqa's cache folder,
    never taken."""
    if root.is_file():  # named explicitly: no hidden, ignore, lock or glob rules
        display = label or root.name
        ok = _printable(display) == display
        yield (display, root) if ok else Skipped(_printable(display), NOT_UTF8_NAME)
        return
    repo = _use_git(root) if repo is _ASK else repo
    if repo is None and _bare(root):
        yield Skipped(_printable(label or "."), BARE)
        return
    walk = _walk_git(repo, root) if repo is not None else _walk_plain(root, exclude, cache)
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
    files: dict[str, SourceFile] = {}  # real path -> file
    skipped: list[Skipped] = []
    left_out: list[str] = []  # found, but not matched by --include
    for root, label in zip(roots, labels):
        repo = _use_git(root) if root.is_dir() else None
        committed = _git_times(repo, root) if repo is not None else {}
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


# ---------------------------------------------------------------- packing


# What the model reads has exactly the files `info` lists: a path is an escaped attribute
# value (a file named `q" trusted="yes.md` adds no attribute), and a body's own
# `<document`/`</document` tags (any case, spaced) are escaped as `&lt;`, so a file cannot
# close its block and forge another. Neither adds a line: sources keep their line numbers.
_TAG = re.compile(r"<(?=\s*/?\s*document)", re.IGNORECASE)
_ATTRIBUTE = str.maketrans({"&": "&amp;", '"': "&quot;", "<": "&lt;", ">": "&gt;",
                            **{chr(c): f"&#{c};" for c in (*range(32), 127)}})


def header(path: str) -> str:
    """The line that opens a file's block in the packed text."""
    return f'<document path="{valid_text(path).translate(_ATTRIBUTE)}">\n'


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, one for one (offsets into it stay
    right): Python keeps bytes that are not UTF-8 (a file name's, a typed or piped
    question's, a socket client's) as lone surrogates, which tokenizers refuse and terminals
    cannot print."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def escape_body(text: str) -> str:
    """A file's text as packed: its own document tags escaped (same lines, same length but
    for three characters a tag)."""
    return _TAG.sub("&lt;", text)


def pack(files: Sequence[SourceFile]) -> tuple[str, list[FileSpan]]:
    """Join files as `<document path="...">` blocks separated by a blank line, with their spans."""
    blocks: list[str] = []
    spans: list[FileSpan] = []
    pos = 0
    for f in files:
        header_line, body = header(f.path), escape_body(f.text.rstrip())
        block = f"{header_line}{body}{_CLOSE}"
        if blocks:
            pos += 2  # the "\n\n" between blocks
        lines = body.count("\n") + 1 if body else 0
        spans.append(FileSpan(f.path, pos, pos + len(block), pos + len(header_line), lines))
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
