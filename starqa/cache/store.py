"""The contexts folder's housekeeping: commit, lock, find by name, list, rename, remove, sizes.

Layout under `$STARQA_HOME/contexts/`:

    <key>/                          a context: manifest.json (starqa.cache.manifest) and its
                                    shards (starqa.cache.shards)
    .staging-<key>-[n<node>-]<host>.<pid>/  a context being written (never read); n<node>:
                                    a machine of a multi-machine ingest; <host>: a hash of
                                    the writer's host name (a cache may be shared)
    .old-<key>-<host>.<pid>/, .trash-<key>-<host>.<pid>/   a context being replaced or removed
    .<key>.lock                     flock held while the context is checked, built, committed
    .blocks/                        content-addressed block files, hard-linked into the
                                    contexts that use them (starqa.cache.blockstore)

A context is written into a staging folder and renamed into place only when every shard
is there and hashed, so a crash or Ctrl-C mid-ingest leaves the previous cache intact.
A folder whose manifest cannot be read is `Damaged`: listed by key, never used, removable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from starqa.cache import blockstore
from starqa.core.errors import ContextNotFound, ShardError, StarqaError
from starqa.cache.manifest import MANIFEST, Manifest, read_manifest, write_manifest
from starqa.cache.shards import verify_checksums


def rename_context(manifest: Manifest, name: str) -> Manifest:
    """The context under a new name (its manifest rewritten atomically); returns it."""
    return write_manifest(manifest.folder, replace(manifest, name=name))


HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # in leftovers' names
FOREIGN_STALE_S = 24 * 3600  # another machine's leftover, unchanged this long, is stale


def owner() -> str:
    """This process, as the suffix of a folder it may leave behind: <host>.<pid>."""
    return f"{HOST}.{os.getpid()}"


def staging_dir(root: Path, key: str, node: int | None = None) -> Path:
    """A fresh folder for this process's ingest; `node`: a machine of a multi-machine ingest,
    named apart so that machines sharing one cache never write into each other's."""
    tag = "" if node is None else f"n{node}-"
    path = root / f".staging-{key}-{tag}{owner()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@contextlib.contextmanager
def context_lock(root: Path, key: str, on_wait: Callable[[], None] | None = None):
    """Hold the lock of context `key`: an exclusive `fcntl.flock` on `<root>/.<key>.lock`
    (issue #11, item 9). Commits hold it around their two renames, which are not atomic
    together; `engine.ingest` holds it from its cache check through the commit, so a second
    ingest of the same input waits and is then a cache hit. Not re-entrant (each call opens
    the file anew). `on_wait` is called once if another process holds it. The lock file
    stays (removing it would let a third process lock a fresh file beside a held one)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def commit(staging: Path, final: Path, manifest: Manifest, *, replace_existing: bool = False,
           held: bool = False) -> None:
    """Write the manifest (its blocks hashed: `shards.hash_blocks`) into `staging` and swap
    `staging` into `final`, under the context's lock (`held`: the caller holds it already).

    A complete context already at `final` (its manifest reads and its shards match their
    checksums) is kept and `staging` discarded, unless `replace_existing`: it is the same
    key, so the same content, model, method and dtype, committed by a concurrent ingest."""
    write_manifest(staging, manifest)
    lock = contextlib.nullcontext() if held else context_lock(final.parent, final.name)
    with lock:
        if not replace_existing and _complete(final):
            shutil.rmtree(staging, ignore_errors=True)
            return
        old = None
        if final.exists():
            old = final.with_name(f".old-{final.name}-{owner()}")
            os.replace(final, old)
        os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _complete(folder: Path) -> bool:
    """A committed context whose manifest reads and whose shards match their checksums."""
    if not folder.is_dir():
        return False
    try:
        verify_checksums(read_manifest(folder))
    except StarqaError:
        return False
    return True


@dataclass(frozen=True)
class Damaged:
    """A context folder whose manifest cannot be used: shown by `list`, named by `ask`,
    removable by `rm KEY` and `cache --clean`."""

    path: Path
    problem: str
    last_used: float
    hint: str  # the reader's: how to remove and rebuild it

    @property
    def key(self) -> str:
        return self.path.name


def scan_contexts(root: Path) -> tuple[list[Manifest], list[Damaged]]:
    """Every context folder under `root`, read once: the usable ones (manifests) and the
    damaged ones, each newest first (by last use, then creation)."""
    good, damaged = [], []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            good.append(read_manifest(folder))
        except ShardError as error:
            damaged.append(Damaged(folder, str(error), _last_used(folder), error.hint))
    good.sort(key=last_used, reverse=True)
    damaged.sort(key=lambda d: d.last_used, reverse=True)
    return good, damaged


def list_contexts(root: Path) -> list[Manifest]:
    """Every usable context, newest first (by last use, then creation)."""
    return scan_contexts(root)[0]


def latest_of(root: Path, paths_: tuple[str, ...], method: str | None = None,
              model_digest: str | None = None, dtype: str | None = None) -> Manifest | None:
    """The most recently used context of the same sources, and of the same method, model
    and dtype where given: what a re-ingest reports its changes against (all three), and
    lays its files out like (none)."""
    sources = tuple(str(Path(p).resolve()) for p in paths_)
    for manifest in list_contexts(root):
        if manifest.sources == sources and method in (None, manifest.method.name) and \
                model_digest in (None, manifest.model.digest) and dtype in (None, manifest.dtype):
            return manifest
    return None


def match_context(root: Path, name: str | None) -> Manifest | Damaged:
    """The one context `name` means, damaged or not: a full key, else a context's exact
    name (of re-ingests of the same sources and settings, the newest), else a key prefix;
    `None` means the latest used. An empty name, an ambiguous one or one that matches
    nothing is an error that lists what there is; never a guess."""
    good, damaged = scan_contexts(root)
    if not good and not damaged:
        raise ContextNotFound("No ingested context yet.", hint="run: starqa ingest PATH")
    if name is None:
        return max([*good, *damaged], key=lambda c: c.last_used if isinstance(c, Damaged)
                   else last_used(c))
    if not name.strip():
        raise StarqaError("The context name is empty.",
                          hint="give a context name or key prefix; `starqa list` shows them")
    every = [*good, *damaged]
    named = [m for m in good if m.name == name]
    if len(named) > 1 and len({(m.sources, m.method.name, m.model.digest, m.dtype)
                               for m in named}) == 1:
        # re-ingests of the same sources with the same method, model and dtype (issue
        # #14): the name means the newest; the earlier versions stay reachable by key
        named = [max(named, key=lambda m: m.created)]
    matches = ([c for c in every if c.key == name] or named
               or [c for c in every if c.key.startswith(name)])
    if len(matches) == 1:
        return matches[0]
    if not matches:
        known = ", ".join(sorted({m.name for m in good} | {d.key for d in damaged}))
        raise ContextNotFound(f"No context named {name!r}.", hint=f"known contexts: {known}")
    listed = "; ".join(_label(c) for c in matches)
    raise StarqaError(f"{name!r} matches {len(matches)} contexts: {listed}. Nothing was done.",
                      hint="name one by a longer key prefix (`starqa list` shows the keys)")


def find_context(root: Path, name: str | None) -> Manifest:
    """The usable context `name` means (see `match_context`); a damaged one, or a damaged
    latest one when no name is given, is an error that names it: never another context."""
    found = match_context(root, name)
    if isinstance(found, Damaged):
        which = "The most recently used context" if name is None else f"Context {name!r}"
        raise ShardError(f"{which} ({found.key}) is damaged: {found.problem}",
                         hint=f"{found.hint} (`starqa cache --clean` removes every damaged "
                              "context); `starqa list` shows the others (`starqa ask "
                              "--context NAME`)")
    return found


def _label(context: Manifest | Damaged) -> str:
    if isinstance(context, Damaged):
        return f"{context.key} (damaged)"
    return f"{context.name} ({context.key}, {context.method.name})"


def touch(manifest: Manifest) -> None:
    """Mark a context as used now, so `ask` without --context picks it next time (not on a
    read-only cache, which answers all the same)."""
    with contextlib.suppress(OSError):
        (manifest.folder / ".last_used").write_text(str(time.time()))


def last_used(manifest: Manifest) -> float:
    """When the context was last used (or created), as a Unix time."""
    return _last_used(manifest.folder)


def dir_size(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it does not exist); symlinks not followed,
    a file linked under several names (a block shared by contexts) counted once."""
    total, seen = 0, set()
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(parent, name))
            except FileNotFoundError:  # removed while we walk
                continue
            if st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def context_size(manifest: Manifest) -> int:
    """Bytes the context takes on disk: its shards, manifest and stamps."""
    return dir_size(manifest.folder)


def context_summary(manifest: Manifest) -> dict:
    """The facts `starqa list` shows for one context (JSON-ready)."""
    return {"name": manifest.name, "key": manifest.key, "sources": list(manifest.sources),
            "n_tokens": manifest.n_tokens, "method": manifest.method.as_dict(),
            "model": manifest.model.name, "window": manifest.model.window,
            "past_window": manifest.past_window, "dtype": manifest.dtype,
            "bytes": context_size(manifest), "created": manifest.created,
            "last_used": last_used(manifest), "dir": str(manifest.folder)}


def damaged_summary(damaged: Damaged) -> dict:
    """What `starqa list` shows for a damaged context (JSON-ready): its key, folder, size
    and problem; `damaged` is absent from the summaries of usable contexts."""
    return {"name": None, "key": damaged.key, "damaged": damaged.problem,
            "bytes": dir_size(damaged.path), "last_used": damaged.last_used,
            "dir": str(damaged.path)}


def remove_context(context: Manifest | Damaged) -> int:
    """Delete a context (damaged or not) and return the bytes freed (0 if already gone):
    its own files; a block file another context links stays, with its other links.

    The folder is first renamed to a hidden `.trash-<key>-<pid>` (atomic), so a concurrent
    `list` or `ask` sees either the whole context or none of it, never half a folder. Then
    the block store drops the files no context links any more."""
    folder = context.path if isinstance(context, Damaged) else context.folder
    blocks = blockstore.store_dir(folder.parent)
    size = blockstore.unshared_bytes(folder, blocks)
    trash = folder.with_name(f".trash-{folder.name}-{owner()}")
    try:
        os.replace(folder, trash)
    except FileNotFoundError:
        return 0
    shutil.rmtree(trash, ignore_errors=True)
    blockstore.collect_garbage(blocks)
    return size


def _last_used(folder: Path) -> float:
    """The mtime of the last-use stamp, else of the manifest, else of the folder (a damaged
    context may have neither file); 0 when the folder is gone."""
    for path in (folder / ".last_used", folder / MANIFEST, folder):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


# ---------------------------------------------------------------------------------------
# leftovers of interrupted work and the cache's size

LEFTOVER_PREFIXES = (".staging-", ".trash-", ".old-")


@dataclass(frozen=True)
class Leftover:
    """A folder in the contexts root that is not a usable context: an ingest being staged,
    a context being replaced (`.old-`) or removed (`.trash-`), stale when the process that
    made it is gone; or a damaged context (a manifest this starqa cannot use)."""

    path: Path
    bytes: int
    pid: int | None  # None: another machine's, one whose owner is unknown, or damaged
    running: bool  # in use (its process alive here; another machine's, changed lately): kept
    state: str  # why it is here, for people


@dataclass(frozen=True)
class CacheUsage:
    models_bytes: int
    contexts_bytes: int  # everything under contexts/ except leftovers
    n_contexts: int
    leftovers: tuple[Leftover, ...]

    @property
    def total_bytes(self) -> int:
        return self.models_bytes + self.contexts_bytes + sum(x.bytes for x in self.leftovers)

    def as_dict(self) -> dict:
        return {"models_bytes": self.models_bytes, "contexts_bytes": self.contexts_bytes,
                "n_contexts": self.n_contexts, "total_bytes": self.total_bytes,
                "leftovers": [{"path": str(x.path), "bytes": x.bytes, "pid": x.pid,
                               "running": x.running, "state": x.state}
                              for x in self.leftovers]}


def stale_staging(root: Path, key: str) -> list[Path]:
    """The staging folders an ingest of context `key` on this machine left when its process
    died (one machine's ingest: not a node's of an ingest across machines)."""
    if not root.is_dir():
        return []
    found = [_leftover(path) for path in sorted(root.glob(f".staging-{key}-*"))
             if path.is_dir() and not path.name.startswith(f".staging-{key}-n")]
    return [x.path for x in found if x.pid is not None and not x.running]


def find_leftovers(root: Path) -> list[Leftover]:
    """The `.staging-*`, `.trash-*` and `.old-*` folders under the contexts `root`, and the
    contexts `list_contexts` skips because their manifest cannot be read."""
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if path.is_dir() and path.name.startswith(LEFTOVER_PREFIXES):
            found.append(_leftover(path))
    for damaged in scan_contexts(root)[1]:
        found.append(Leftover(damaged.path, dir_size(damaged.path), None, False,
                              f"damaged: {damaged.problem}"))
    return sorted(found, key=lambda x: x.path)


def _leftover(path: Path) -> Leftover:
    """A leftover folder and whether it may go: one of this machine's goes when the process
    that made it is gone; another machine's (a shared cache), or one whose owner its name
    does not say, once nothing in it has changed for FOREIGN_STALE_S."""
    size = dir_size(path)
    host, _, pid_text = path.name.rsplit("-", 1)[-1].rpartition(".")
    if pid_text.isdigit() and host in ("", HOST):  # "": named before hosts were
        pid = int(pid_text)
        if process_alive(pid):
            return Leftover(path, size, pid, True, f"in use by running process {pid}")
        return Leftover(path, size, pid, False, f"stale (process {pid} is gone)")
    idle = time.time() - _newest_mtime(path)
    where = "another machine's" if pid_text.isdigit() else "owner unknown"
    if idle < FOREIGN_STALE_S:
        return Leftover(path, size, None, True, f"{where}; changed {_ago(idle)} ago, kept until "
                        f"unchanged for {FOREIGN_STALE_S // 3600} h")
    return Leftover(path, size, None, False, f"stale ({where}; unchanged for {_ago(idle)})")


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0)
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def clean_leftovers(leftovers: Iterable[Leftover], root: Path | None = None) -> int:
    """Delete every leftover not in use (`Leftover.running`); returns the bytes freed.
    Damaged contexts go too (this starqa could never use them). Then (`root`: the
    contexts root) the block store drops every file no context links any more: never one
    a context (or a running ingest's staging folder) still links."""
    freed = 0
    for leftover in leftovers:
        if not leftover.running:
            shutil.rmtree(leftover.path, ignore_errors=True)
            freed += leftover.bytes
    if root is not None:
        freed += blockstore.collect_garbage(blockstore.store_dir(root))
    return freed


def cache_usage(models_root: Path, contexts_root: Path) -> CacheUsage:
    """Sizes of the converted models and the contexts, and the leftovers beside them."""
    leftovers = tuple(find_leftovers(contexts_root))
    contexts_bytes = dir_size(contexts_root) - sum(x.bytes for x in leftovers)
    return CacheUsage(dir_size(models_root), contexts_bytes, len(list_contexts(contexts_root)),
                      leftovers)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
