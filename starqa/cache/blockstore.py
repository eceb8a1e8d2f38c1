"""Content-addressed block files, shared between contexts by hard links (issue #14).

    contexts/.blocks/<stem>.safetensors      one block's KV (and any file beside it)
    contexts/<key>/block_00003.safetensors   the same file (inode), linked into a context

A block's *stem* names everything its KV depends on (`starqa.reingest.reuse.address`: model
fingerprint, dtype, method and settings, the tokens the block was encoded after, its own
tokens, its position offset): `<address>-<offset>`, or `<address>-<offset>-r` for a star
block whose keys were re-rotated from another offset (an approximation, kept apart from the
exactly encoded ones). Every file of a block is named by its stem plus what follows the
block name in the context (`block_00003.ids.safetensors` ↔ `<stem>.ids.safetensors`), so
other per-block files are shared the same way.

A context holds hard links, never paths into the store: its manifest still names only its
own `block_NNNNN.safetensors`, so contexts written before this store keep working, and
removing a context (`rm`, a replaced commit) only drops its links. A file lives as long as
one link to it does; the store's own link is dropped once it is the only one left
(`collect_garbage`, run by `rm` and `cache --clean`), so no file a manifest names is ever
deleted, whatever runs at the same time. Where the file system refuses hard links, blocks
are copied (correct, not shared).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import shutil
from pathlib import Path

from starqa.core.errors import StarqaError
from starqa.cache.manifest import block_file, write_json_atomic

STORE = ".blocks"  # under the contexts root; a dot folder, so never listed as a context
SHA = ".sha256.json"  # beside a stored KV file: {"sha256", "stamp": [size, mtime_ns, ctime_ns]}


def store_dir(contexts_root: Path) -> Path:
    return contexts_root / STORE


def stem(address: str, offset: int, rotated: bool = False) -> str:
    return f"{address}-{offset}" + ("-r" * rotated)


def _prefix(index: int) -> str:
    return block_file(index).removesuffix(".safetensors")


def kv_file(store: Path, block_stem: str) -> Path:
    return store / f"{block_stem}.safetensors"


def has(store: Path, block_stem: str) -> bool:
    return kv_file(store, block_stem).is_file()


def offsets(store: Path, address: str) -> list[tuple[int, str]]:
    """(offset, stem) of the exactly encoded files of `address` in the store, at any offset
    (a star block that moved: its keys can be re-rotated)."""
    found = []
    for path in store.glob(f"{address}-*.safetensors"):
        tail = path.name.removesuffix(".safetensors")[len(address) + 1:]
        if tail.isdigit():
            found.append((int(tail), f"{address}-{tail}"))
    return sorted(found)


def _link(source: Path, target: Path) -> None:
    """Hard-link `source` as `target` (a copy where links are refused); an existing target
    is kept (an equal file, by its name)."""
    try:
        os.link(source, target)
    except FileExistsError:
        return
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP,
                             errno.EOPNOTSUPP):
            raise
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)


def link_in(store: Path, block_stem: str, folder: Path, index: int) -> None:
    """Every file of block `block_stem` linked into `folder` as block `index`'s files.
    FileNotFoundError when the store lost it meanwhile (`collect_garbage`): encode it."""
    files = [f for f in sorted(store.glob(f"{block_stem}.*"))
             if not f.name.endswith((".tmp", SHA))]
    kv = kv_file(store, block_stem)
    if kv not in files:
        raise FileNotFoundError(kv)
    for path in files:  # the KV file last: present means its siblings are too
        if path != kv:
            _link(path, folder / (_prefix(index) + path.name[len(block_stem):]))
    _link(kv, folder / block_file(index))


def adopt(store: Path, folder: Path, index: int, block_stem: str) -> None:
    """Put block `index`'s files in `folder` (just encoded) into the store under
    `block_stem`, so later ingests of any context find them."""
    ensure_dir(store)
    prefix = _prefix(index)
    kv = folder / block_file(index)
    for path in sorted(folder.glob(prefix + ".*")):
        if path != kv and not path.name.endswith((".tmp", SHA)):
            _link(path, store / (block_stem + path.name[len(prefix):]))
    _link(kv, kv_file(store, block_stem))


def ensure_dir(store: Path) -> None:
    """The store's folder, made if need be; something else in its place (a file named
    `.blocks`) is an error naming it, not a traceback."""
    try:
        store.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StarqaError(
            f"{store} is not a folder: starqa keeps the blocks that contexts share there.",
            hint=f"move it away or remove it (rm {shlex.quote(str(store))}), then run the "
                 "command again") from None


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def record(store: Path, block_stem: str, sha256: str) -> None:
    """Remember the checksum of a stored KV file (as hashed for the manifest that just
    named it), with its stat, so that reusing it later costs a stat, not a hash."""
    with contextlib.suppress(OSError):
        write_json_atomic(store / (block_stem + SHA),
                          {"sha256": sha256, "stamp": _stamp(kv_file(store, block_stem))})


def checked_sha(store: Path, block_stem: str) -> str | None:
    """The checksum of a stored KV file when it still matches the one recorded (hashing it
    only when its stat changed), else None: a damaged file (a flipped byte in any context
    that links it) loses its place in the store and is encoded again, never reused."""
    from starqa.cache.shards import sha256_file

    kv = kv_file(store, block_stem)
    try:
        known = json.loads((store / (block_stem + SHA)).read_text())
        if known["stamp"] == _stamp(kv):
            return known["sha256"]
        if sha256_file(kv) == known["sha256"]:
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with contextlib.suppress(OSError):
        kv.unlink()  # its contexts keep their links (and see the damage themselves)
    return None


def collect_garbage(store: Path) -> int:
    """Drop the store's link to every file no context links any more (its only link is the
    store's), and its recorded checksum; returns the bytes freed. A file a context links has
    two links or more, so it is never touched; one that an ingest links at this very moment
    keeps that link."""
    freed = 0
    for path in store.iterdir() if store.is_dir() else ():
        if path.name.endswith(SHA):
            continue
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            if st.st_nlink <= 1:
                path.unlink()
                freed += st.st_size
    for path in store.glob("*" + SHA) if store.is_dir() else ():
        if not kv_file(store, path.name.removesuffix(SHA)).exists():
            path.unlink(missing_ok=True)
    return freed


def unshared_bytes(folder: Path, store: Path) -> int:
    """Bytes that removing the context in `folder` frees: its files that no other context
    links (linked only from it, or from it and the store)."""
    stored = set()
    for path in store.iterdir() if store.is_dir() else ():
        with contextlib.suppress(OSError):
            st = path.stat()
            stored.add((st.st_dev, st.st_ino))
    total = 0
    for path in folder.iterdir() if folder.is_dir() else ():
        with contextlib.suppress(OSError):
            st = path.lstat()
            others = st.st_nlink - 1 - ((st.st_dev, st.st_ino) in stored)
            if path.is_file() and not path.is_symlink() and others <= 0:
                total += st.st_size
    return total
