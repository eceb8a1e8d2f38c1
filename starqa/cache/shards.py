"""The shard files: one safetensors file per block, written, hashed, verified and loaded.

    <context>/block_00000.safetensors   k, v: [L, Hkv, T, D] contiguous, RoPE applied;
                                        ids: [T] int32, the block's token ids (sources);
                                        int8 KV (`Manifest.kv`): k, v int8 and their rows'
                                        scales k_scale, v_scale: [L, Hkv, T] fp32
    <context>/.verified.json            {file: [size, mtime_ns, ctime_ns, sha256(, "finite")]}

A block's size and sha256 are recorded in the manifest (`starqa.cache.manifest.Block`); every
load checks them. `.verified.json` remembers the hashes by stat, so a repeated check of an
unchanged shard costs one stat instead of a hash. Where contexts live and how they are
committed, found and removed is `starqa.cache.store`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

from starqa.core.hashing import sha256_file  # noqa: F401 (shards.sha256_file for callers)
from starqa.core.errors import ShardError
from starqa.cache.manifest import Block, Manifest, block_file, write_json_atomic

SCALES = {"k": "k_scale", "v": "v_scale"}  # int8 KV: each int8 tensor's row scales

VERIFIED = ".verified.json"  # per context: {file: [size, mtime_ns, ctime_ns, sha256(, FINITE)]}
FINITE = "finite"  # after a remembered hash: its keys and values were found free of Inf/NaN


def save_block(folder: Path, index: int, k, v, ids, metadata: dict[str, str],
               kv: str = "float") -> Path:
    """Write one block's KV ([L, Hkv, T, D] each) and token ids ([T]) as safetensors, the
    KV as it is (kv "float") or as int8 rows with their scales (kv "int8",
    `attention.kvint8.quantize_rows`); returns the file."""
    import torch
    from safetensors.torch import save_file

    from starqa.core.tensorfile import tensor_finite

    if not (tensor_finite(k) and tensor_finite(v)):  # fp16 past 65,504, damaged weights
        raise ShardError(
            f"Block {index} came out of the model with Inf or NaN keys or values ({k.dtype}); "
            "nothing was cached.",
            hint="ingest again with --dtype fp32 (fp16 overflows past 65,504); if fp32 does "
                 "it too, the model's weights are damaged: fetch or convert the model again")
    path = folder / block_file(index)
    tmp = path.with_name(path.name + ".tmp")
    tensors = {"k": k.contiguous(), "v": v.contiguous()}
    if kv == "int8":
        tensors = quantized(tensors)
    try:
        save_file({**tensors, "ids": torch.as_tensor(ids, dtype=torch.int32).contiguous()},
                  str(tmp), metadata=metadata)
    except Exception as err:  # safetensors says a failed write in words (SafetensorError)
        tmp.unlink(missing_ok=True)
        raise write_error(err, tmp) from err
    os.replace(tmp, path)
    return path


def quantized(tensors: dict, names=("k", "v")) -> dict:
    """A block's float `names` ("k", "v": [L, Hkv, T, D]) as int8 rows and their scales
    [L, Hkv, T] fp32 (`SCALES`), the other tensors as they are."""
    from starqa.attention.kvint8 import quantize_rows

    out = dict(tensors)
    for name in names:
        rows = quantize_rows(tensors[name])
        out[name], out[SCALES[name]] = rows.data.contiguous(), rows.scale.contiguous()
    return out


def dequantized(tensors: dict, dtype=None) -> dict:
    """A block's tensors (as loaded) with int8 "k" and "v" turned back into floats of
    `dtype` (default fp32) and their scales dropped; a float block's as they are."""
    from starqa.attention.kvint8 import Int8Rows

    if SCALES["k"] not in tensors:
        return tensors
    import torch

    out = {name: t for name, t in tensors.items() if name not in SCALES.values()}
    for name, scale in SCALES.items():
        out[name] = Int8Rows(tensors[name], tensors[scale]).to(dtype or torch.float32)
    return out


def kv_rows(tensors: dict, dtype):
    """A loaded block's (k, v): float tensors as they are, int8 ones as `Int8Rows` standing
    for `dtype` (what Phase 2 reads in place)."""
    from starqa.attention.kvint8 import Int8Rows

    if SCALES["k"] not in tensors:
        return tensors["k"], tensors["v"]
    return tuple(Int8Rows(tensors[name], tensors[scale], dtype)
                 for name, scale in SCALES.items())


def read_keys(path: Path):
    """A block file's keys [L, Hkv, T, D] as floats (int8 keys dequantised, fp32): what top-k's
    indexes are built from."""
    import torch

    from starqa.attention.kvint8 import Int8Rows
    from starqa.core import tensorfile

    k = tensorfile.read_tensor(path, "k")
    if k.dtype != torch.int8:
        return k
    return Int8Rows(k, tensorfile.read_tensor(path, SCALES["k"])).float()


def write_error(err: Exception, path: Path) -> Exception:
    """A library's failed write (safetensors', faiss': text that names the OS's error, its
    errno lost) as the OSError it was where the disk or the quota is full, so it is
    reported as such (`errors.disk_full`) instead of as a traceback; else `err` itself."""
    import errno

    if not isinstance(err, OSError):
        for code in (errno.ENOSPC, errno.EDQUOT):
            if os.strerror(code) in str(err):
                return OSError(code, os.strerror(code), str(path))
    return err


def read_blocks(folder: Path, indices, device="cpu"):
    """The KV of blocks `indices` in `folder` (a staging folder: what an incremental ingest
    linked in from the store) per layer (k, v), each [1, Hkv, N, D] (what Phase 1 continues
    from), not verified: they were checked when committed, and the result is hashed again
    at this commit."""
    from safetensors.torch import load_file

    k, v = _concatenated([(t["k"], t["v"]) for t in (
        dequantized(load_file(str(folder / block_file(i)), device=str(device)))
        for i in indices)])
    return [(k[layer][None], v[layer][None]) for layer in range(k.shape[0])]


def hash_blocks(folder: Path, ranges: Iterable[tuple[int, int]],
                known: dict[int, str] | None = None) -> tuple[Block, ...]:
    """The manifest entries of the blocks [start, end) the workers wrote into `folder`, each
    file sized and hashed (and remembered in `.verified.json`, so the next cache hit need
    not hash again); ShardError if a worker did not write one. known: checksums of blocks
    linked in already checked (an incremental ingest's reused blocks), not hashed again."""
    blocks, verified = [], {}
    known = known or {}
    for index, (start, end) in enumerate(ranges):
        path = folder / block_file(index)
        if not path.exists():
            raise ShardError(f"worker did not write {path.name}; nothing was cached")
        st = path.stat()
        sha = known[index] if index in known else sha256_file(path)
        blocks.append(Block(index=index, start=start, end=end, file=path.name,
                            bytes=st.st_size, sha256=sha))
        # read whole just now: checked for Inf/NaN too, so the first load need not read it
        finite = index not in known and _finite_file(path)
        verified[path.name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha] + \
            [FINITE] * finite
    write_json_atomic(folder / VERIFIED, verified)
    return tuple(blocks)


def listed_blocks(folder: Path, ranges, sums: dict, held) -> tuple[Block, ...]:
    """The manifest entries of every block of a context kept across machines: sizes and
    checksums as the machines that keep them reported (`sums`: per block [bytes, sha256]);
    the blocks `held` here are remembered in `.verified.json` (hashed just now)."""
    blocks = tuple(Block(index=i, start=start, end=end, file=block_file(i),
                         bytes=sums[i][0], sha256=sums[i][1])
                   for i, (start, end) in enumerate(ranges))
    verified = {}
    for i in held:
        st = (folder / block_file(i)).stat()
        verified[block_file(i)] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, sums[i][1]]
    write_json_atomic(folder / VERIFIED, verified)
    return blocks


def verify_block(manifest: Manifest, index: int, checksum: bool = True) -> Path:
    """Path of block `index` after checking it exists, has its size and (unless
    `checksum=False`, a quick look) matches its checksum."""
    block = manifest.blocks[index]
    path = manifest.folder / block.file
    if not path.exists():
        raise ShardError(f"Shard {path} is missing.", hint=_fix(manifest))
    if path.stat().st_size != block.bytes or (checksum and sha256_file(path) != block.sha256):
        raise ShardError(f"Shard {path} fails its checksum (corrupt or modified).",
                         hint=_fix(manifest))
    return path


def verify_checksums(manifest: Manifest, indices=None, contents: bool = False) -> None:
    """Every shard of the context (or of blocks `indices`) matches its recorded checksum:
    what a cache hit must know before it reuses them, and Phase 2 before it loads them
    (every shard: those this machine keeps, `Manifest.local_blocks`). A
    shard's hash is remembered in `.verified.json` with its size, mtime and ctime (a write
    changes them; ctime cannot be set back), so a repeated check costs one stat per shard
    and a damaged shard is still caught.

    contents (what loading them needs): also every shard's header against its block
    (`check_header`: a read of its first bytes, each time), and its keys and values free
    of Inf and NaN (`_check_finite`), once per version of the file: remembered beside its
    hash as FINITE (~8 ms for a 5K-token SmolLM2 context, where its hash takes ~75)."""
    remembered = read_verified(manifest.folder)
    verified = dict(remembered) if indices is not None else {}
    layout = None
    for index in manifest.local_blocks if indices is None else indices:
        block = manifest.blocks[index]
        path = verify_block(manifest, index, checksum=False)  # present, recorded size
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        entry = remembered.get(block.file)
        fresh = not (entry and entry[:3] == stamp)
        sha = sha256_file(path) if fresh else entry[3]
        if sha != block.sha256:
            raise ShardError(f"Shard {path} fails its checksum (corrupt or modified).",
                             hint=_fix(manifest))
        finite = not fresh and entry[4:5] == [FINITE]
        if contents:
            layout = check_header(manifest, index, layout)
            if not finite:  # once per version of the file: ~10% of its hash
                _check_finite(manifest, index)
                finite = True
        verified[block.file] = [*stamp, sha] + [FINITE] * finite
    if verified != remembered:
        with contextlib.suppress(OSError):  # a read-only cache is verified, just not remembered
            write_json_atomic(manifest.folder / VERIFIED, verified)


def read_verified(folder: Path, name: str = VERIFIED) -> dict:
    """The remembered hashes in `folder / name` (shards'; top-k indexes keep their own
    file), or {} when there are none or they cannot be read."""
    try:
        data = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def verify_present(manifest: Manifest) -> None:
    """Every shard of the context this machine keeps (all but for a context made across
    machines, `Manifest.local_blocks`) is there with its recorded size (a quick look: the
    workers verify checksums as they load)."""
    for index in manifest.local_blocks:
        verify_block(manifest, index, checksum=False)


def load_block(manifest: Manifest, index: int, device="cpu", verified: bool = False,
               dtype=None):
    """(k, v, ids) of block `index`: k, v [L, Hkv, T, D] on `device` (int8 KV: `Int8Rows`
    standing for `dtype`, default the manifest's), ids [T] int64 on the CPU,
    checksum-verified (unless `verified`: the caller just did, with `verify_checksums`)."""
    import torch
    from safetensors.torch import load_file

    path = verify_block(manifest, index, checksum=not verified)
    tensors = load_file(str(path), device=str(device))
    k, v = kv_rows(tensors, dtype or getattr(torch, manifest.dtype))
    return k, v, tensors["ids"].long().cpu()


def check_header(manifest: Manifest, index: int, layout: tuple | None = None) -> tuple:
    """Block `index`'s file holds what its manifest entry says, from its header alone (no
    data read): k and v of one float dtype (or int8, with their fp32 row scales [L, Hkv, T])
    and shape [L, Hkv, T, D], T the block's tokens, ids [T] of integers, every tensor's bytes inside the file; and (`layout`: the previous
    block's (L, Hkv, D, dtype)) the layout of the context's other blocks. Returns this
    block's layout; ShardError naming the shard as damaged otherwise (a header edited with
    its checksum updated would otherwise reach torch as a shape error, or answer garbage)."""
    path = manifest.folder / manifest.blocks[index].file
    problem, found = _header_problem(path, manifest.blocks[index])
    if problem is None and (found[3] == "I8") != (manifest.kv == "int8"):
        problem = f"its keys are {found[3]}, its manifest's KV {manifest.kv}"
    if problem is None and layout is not None and found != layout:
        problem = (f"its layout (layers, KV heads, head size, dtype) is {_layout(found)}, "
                   f"the other blocks' {_layout(layout)}")
    if problem is not None:
        raise ShardError(f"Shard {path} is damaged: {problem}.", hint=_fix(manifest))
    return found


def _layout(layout: tuple) -> str:
    return f"{list(layout[:3])} {layout[3]}"


def _header_problem(path: Path, block: Block) -> tuple[str | None, tuple]:
    """(what is wrong with the header of `block`'s file, or None; its (L, Hkv, D, dtype))."""
    from starqa.core import tensorfile

    try:
        start, found = tensorfile.header(path)
    except (OSError, ValueError) as err:  # ValueError: JSON, or a header size past the file
        return f"its header cannot be read ({err})", ()
    if not isinstance(found, dict) or not all(isinstance(found.get(n), dict)
                                              for n in ("k", "v", "ids")):
        return "its header does not name tensors k, v and ids", ()
    rows = block.end - block.start
    size = path.stat().st_size
    quantized = isinstance(found["k"], dict) and found["k"].get("dtype") == "I8"
    names = ("k", "v", "ids", *SCALES.values()) if quantized else ("k", "v", "ids")
    for name in names:
        entry = found.get(name)
        if not isinstance(entry, dict):
            return f"its int8 keys come without {name!r}", ()
        shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and dtype in tensorfile._DTYPES and isinstance(offsets, list)
                and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            return f"{name!r} has no valid shape, dtype and offsets", ()
        itemsize = int("".join(filter(str.isdigit, dtype)) or 8) // 8  # BF16: 2, BOOL: 1
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize or offsets[0] < 0 or \
                start + offsets[1] > size:
            return (f"{name!r} {shape} {dtype} does not fit its bytes {offsets} in a file of "
                    f"{size:,} bytes"), ()
    k, v, ids = found["k"], found["v"], found["ids"]
    if len(k["shape"]) != 4 or k["shape"][2] != rows or 0 in k["shape"]:
        return (f"its keys are {k['shape']}, not [layers, KV heads, {rows}, head size] "
                f"for the {rows} tokens {block.start}-{block.end} of block {block.index}"), ()
    if v["shape"] != k["shape"] or v["dtype"] != k["dtype"]:
        return f"its values are {v['shape']} {v['dtype']}, its keys {k['shape']} {k['dtype']}", ()
    if k["dtype"] not in ("BF16", "F16", "F32", "F64", "I8"):
        return f"its keys are {k['dtype']}, not floats or int8 rows", ()
    for name in SCALES.values() if quantized else ():
        if found[name]["shape"] != k["shape"][:3] or found[name]["dtype"] != "F32":
            return (f"its {name} is {found[name]['shape']} {found[name]['dtype']}, not "
                    f"{k['shape'][:3]} F32 (a scale per int8 row)"), ()
    if ids["shape"] != [rows] or ids["dtype"] not in ("I32", "I64"):
        return f"its token ids are {ids['shape']} {ids['dtype']}, not [{rows}] integers", ()
    return None, (k["shape"][0], k["shape"][1], k["shape"][3], k["dtype"])


def _finite_file(path: Path) -> bool:
    """A block file whose keys and values are all finite (False where it cannot tell)."""
    from starqa.core import tensorfile

    try:
        return not tensorfile.nonfinite(path)
    except (OSError, ValueError, KeyError, TypeError, ShardError):
        return False


def _check_finite(manifest: Manifest, index: int) -> None:
    """Block `index`'s keys and values hold no Inf or NaN (ShardError naming it damaged)."""
    from starqa.core import tensorfile

    path = manifest.folder / manifest.blocks[index].file
    if bad := tensorfile.nonfinite(path):
        what = " and ".join({"k": "keys", "v": "values"}.get(name, name) for name in bad)
        raise ShardError(f"Shard {path} is damaged: its {what} hold Inf or NaN.",
                         hint=_fix(manifest))


def _fix(manifest: Manifest) -> str:
    """A re-ingest command that works when pasted in any folder: the recorded command (which
    `starqa ingest` prefixes with a `cd` to where it ran), else the absolute sources."""
    return f"re-ingest to rebuild it: {manifest.rerun}"


def load_shard(manifest: Manifest, indices, device="cpu", dtype=None):
    """The KV of blocks `indices` (contiguous, in order) as one shard (see `shard_of`) and
    their token ids ([N] int64, None for no blocks), checksum-verified (hashing only shards
    changed since they were last verified).

    On the CPU a piece per block, memory-mapped from its file and read in place: nothing
    is copied (a cold ask spent 0.03 s copying 4.7K tokens, 0.3 s at 32K, before its first
    token), the pages come from the page cache as attention first reads them, and every
    process on the machine shares them. Converted to another `dtype`, or on another device
    (one piece per layer there, what CUDA's fused kernel takes), they are copies. int8 KV
    (`Manifest.kv`) stays int8: each key and value is an `attention.kvint8.Int8Rows`
    standing for `dtype`, attended without a dequantised copy."""
    import torch

    from starqa.core import tensorfile

    verify_checksums(manifest, indices, contents=True)
    if not indices:
        return None, None
    if str(device) != "cpu":
        parts = [load_block(manifest, i, device=device, verified=True) for i in indices]
        return shard_of(parts, dtype), torch.cat([p[2] for p in parts])
    mapped = [tensorfile.map_all(manifest.folder / block_file(i))[0] for i in indices]
    if SCALES["k"] in mapped[0]:  # int8 rows, read where they lie
        blocks = [kv_rows(t, dtype or getattr(torch, manifest.dtype)) for t in mapped]
    else:
        dtype = dtype or mapped[0]["k"].dtype
        blocks = [(t["k"].to(dtype), t["v"].to(dtype)) for t in mapped]  # (no copy if its own)
    ids = torch.cat([t["ids"].long() for t in mapped])
    return [[(k[layer][None], v[layer][None]) for k, v in blocks]
            for layer in range(blocks[0][0].shape[0])], ids


def shard_of(parts, dtype=None):
    """Consecutive blocks' (k, v, ...), each [L, Hkv, T_i, D], as one Phase 2 shard: per
    layer its pieces, here one: [(k, v)], each [1, Hkv, N, D] contiguous, in `dtype`
    (default: as stored; Phase 2 attends in the cache's dtype, so nothing is converted per
    step). None when `parts` is empty. (`load_shard` keeps a piece per block on the CPU.)"""
    if not parts:
        return None
    k, v = _concatenated(parts, dtype)
    return [[(k[layer][None], v[layer][None])] for layer in range(k.shape[0])]


def _concatenated(parts, dtype=None):
    """Blocks' (k, v, ...), each [L, Hkv, T_i, D], as k, v [L, Hkv, N, D] in `dtype`;
    int8 rows (`Int8Rows`) stay int8, standing for `dtype`."""
    import torch

    from starqa.attention.kvint8 import Int8Rows, is_int8

    if is_int8(parts[0][0]):
        return tuple(Int8Rows(torch.cat([p[i].data for p in parts], dim=2),
                              torch.cat([p[i].scale for p in parts], dim=2),
                              dtype or parts[0][i].dtype) for i in (0, 1))
    k = torch.cat([p[0] for p in parts], dim=2)
    v = torch.cat([p[1] for p in parts], dim=2)
    return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))
