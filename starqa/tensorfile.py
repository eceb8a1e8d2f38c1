"""safetensors files read by hand: a header, one tensor or one layer of it with a positioned
read, a whole file into fresh aligned tensors, or a tensor memory-mapped with its layers'
pages released on demand. What the safetensors library does not offer: reading part of a
tensor, and control over which pages stay resident.

The format: 8 bytes (little-endian header size), a JSON header {name: {dtype, shape,
data_offsets [begin, end)}, "__metadata__": {...}}, then the data, offsets relative to its
start. torch is imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from starqa.errors import ShardError

_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
           "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
           "BOOL": "bool"}
MAX_HEADER = 100 << 20  # the safetensors library's own limit


def header(path: Path) -> tuple[int, dict]:
    """(the data's first byte in the file, the JSON header)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if size > MAX_HEADER:
            raise ValueError(f"{path}: a header of {size} bytes (not a safetensors file)")
        return 8 + size, json.loads(fh.read(size))


def block_shape(path: Path) -> list[int]:
    """The shape of a block file's keys, [L, Hkv, T, D], from its header (no data read)."""
    return header(path)[1]["k"]["shape"]


def _dtype(entry: dict):
    import torch

    return getattr(torch, _DTYPES[entry["dtype"]])


def _pread_into(fh, out, offset: int, path: Path, what: str) -> None:
    """Fill tensor `out` from the file at `offset` with one positioned read."""
    import torch

    size = out.numel() * out.element_size()
    if size and os.preadv(fh.fileno(), [out.view(torch.uint8).reshape(-1).numpy()],
                          offset) != size:
        raise ShardError(f"{path} ends early ({what} is short).")


def read_layer(path: Path, name: str, layer: int):
    """One layer [Hkv, T, D] of tensor `name` ("k" or "v", [L, Hkv, T, D]) of a block file,
    read with one positioned read (no memory map: only this layer is ever in memory)."""
    import torch

    start, found = header(path)
    entry = found[name]
    out = torch.empty(entry["shape"][1:], dtype=_dtype(entry))
    with open(path, "rb", buffering=0) as fh:
        _pread_into(fh, out, start + entry["data_offsets"][0] + layer * out.nbytes, path,
                    f"layer {layer} of {name!r}")
    return out


def read_all(path: Path) -> tuple[dict, dict]:
    """Every tensor of a file, each read by one positioned read into a fresh tensor (so
    64-byte aligned, as the packed CPU kernels want), and the header's metadata. Unlike a
    memory map, nothing of the file stays resident but the tensors themselves."""
    import torch

    start, found = header(path)
    metadata = found.pop("__metadata__", None) or {}
    tensors = {}
    with open(path, "rb", buffering=0) as fh:
        for name, entry in found.items():
            out = torch.empty(entry["shape"], dtype=_dtype(entry))
            _pread_into(fh, out, start + entry["data_offsets"][0], path, repr(name))
            tensors[name] = out
    return tensors, metadata


def read_tensor(path: Path, name: str, mapped: bool = False):
    """Tensor `name` ("k" or "v", [L, Hkv, T, D]) of a block file: read into memory, or
    (`mapped`) a memory map of the file, so indexing it reads only the rows it touches."""
    tensor = MappedTensor(path, name).tensor
    return tensor if mapped else tensor.clone()


class MappedTensor:
    """Tensor `name` ("k" or "v", [L, Hkv, T, D]) of a block file, memory-mapped: `tensor`
    reads only the pages it touches, and `release(layer)` drops that layer's pages from
    this process (they stay in the page cache), so reading a little of every layer for
    every token never makes the whole file resident. A private mapping: writing to the
    tensor would never reach the file."""

    def __init__(self, path: Path, name: str):
        import mmap

        import numpy as np
        import torch

        start, found = header(path)
        entry = found[name]
        begin, end = entry["data_offsets"]
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        self._first = start + begin  # the tensor's first byte in the file (and the map)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=end - begin, offset=self._first)
        self.tensor = torch.from_numpy(raw).view(_dtype(entry)).view(entry["shape"])
        self._layer_bytes = (end - begin) // max(entry["shape"][0], 1)

    def release(self, layer: int) -> None:
        """Drop the pages of `layer` from this process's resident memory."""
        import mmap

        first = self._first + layer * self._layer_bytes
        aligned = first - first % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, aligned, first + self._layer_bytes - aligned)
