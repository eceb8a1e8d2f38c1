"""safetensors files read by hand: a header, one tensor or one layer of it with a positioned
read, a tensor memory-mapped with its layers' pages released on demand, or a whole file
written with its tensors aligned and mapped in place. What the safetensors library does not
offer: reading part of a tensor, control over which pages stay resident, and alignment.

The format: 8 bytes (little-endian header size), a JSON header {name: {dtype, shape,
data_offsets [begin, end)}, "__metadata__": {...}}, then the data, offsets relative to its
start. torch is imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from starqa.core.errors import ShardError

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


ALIGN = 64  # bytes: where `save_aligned` starts every tensor's data in the file
PAD = "__pad__."  # names of the padding tensors that keep the file valid safetensors
_CODES = {v: k for k, v in _DTYPES.items()}


def save_aligned(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """Write `tensors` as a safetensors file whose every tensor starts at a multiple of
    ALIGN bytes from the file's start, so `map_all` maps them in place as aligned tensors
    (what the packed CPU kernels want). The gaps are uint8 tensors named PAD + a number,
    so the file stays valid for any safetensors reader."""
    import torch

    entries, parts, offset = {}, [], 0
    # The header's size is not known before its offsets; they are relative to the data, so
    # the data starts at a multiple of ALIGN (the header padded with spaces) and offsets
    # aligned in the data are aligned in the file.
    for name, tensor in tensors.items():
        if gap := -offset % ALIGN:
            entries[f"{PAD}{len(entries)}"] = {"dtype": "U8", "shape": [gap],
                                               "data_offsets": [offset, offset + gap]}
            parts.append(bytes(gap))
            offset += gap
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        entries[name] = {"dtype": _CODES[str(tensor.dtype).removeprefix("torch.")],
                         "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + data.nbytes]}
        parts.append(data)
        offset += data.nbytes
    text = json.dumps({"__metadata__": metadata, **entries}).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for part in parts:
            fh.write(part)


def map_all(path: Path) -> tuple[dict, dict]:
    """Every tensor of a file, memory-mapped in place (nothing read until used; pages
    shared with the page cache and with other processes mapping the file), and the
    header's metadata. A private mapping: writing to a tensor never reaches the file. A
    tensor that does not start at a multiple of ALIGN bytes (a file `save_aligned` did not
    write) is still mapped, unaligned."""
    tensors, metadata, _ = map_file(path)
    return tensors, metadata


def map_file(path: Path) -> tuple[dict, dict, FileMap]:
    """`map_all`, and the mapping, whose `release` drops a tensor's pages on demand."""
    start, found = header(path)
    metadata = found.pop("__metadata__", None) or {}
    mapped = FileMap(path)
    tensors = {name: _mapped_view(mapped.map, start, entry, path, name)
               for name, entry in found.items() if not name.startswith(PAD)}
    return tensors, metadata, mapped


class FileMap:
    """A file mapped privately (`_map`), with its tensors' pages released on demand."""

    def __init__(self, path: Path):
        import numpy as np

        self.map = _map(path)
        self._address = np.frombuffer(self.map, dtype=np.uint8).ctypes.data if len(self.map) \
            else 0

    def release(self, tensor) -> None:
        """Drop the pages that lie wholly within `tensor`'s bytes from this process's
        resident memory: they stay in the page cache, and a later read maps them again.
        Nothing here writes to its tensors, so no page holds anything the file does not. A
        tensor that is not a view of this map is left alone."""
        import mmap

        pages = self.pages(tensor)
        if pages is not None:
            self.map.madvise(mmap.MADV_DONTNEED, pages[0] - self._address, pages[1])

    def pages(self, tensor) -> tuple[int, int] | None:
        """(address, length) of the pages that lie wholly within `tensor`'s bytes, those
        `release` drops; None where there are none or the tensor is not a view of this map."""
        import mmap

        first = tensor.data_ptr() - self._address
        end = first + tensor.numel() * tensor.element_size()
        if first < 0 or end > len(self.map):
            return None
        start = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = end - end % mmap.PAGESIZE
        return (self._address + start, stop - start) if stop > start else None


# numpy's dtype for each safetensors dtype; bf16 (which numpy lacks) as its 16 bits
_NUMPY = {"BF16": "uint16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8",
          "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


def map_arrays(path: Path) -> tuple[dict, dict]:
    """`map_all` without torch: every tensor as a numpy array mapped in place (bf16 as
    uint16, its bits), and the header's metadata (starqa.coldstart.firsttoken)."""
    import numpy as np

    start, found = header(path)
    metadata = found.pop("__metadata__", None) or {}
    mapped = _map(path)
    arrays = {}
    for name, entry in found.items():
        if name.startswith(PAD):
            continue
        begin, end = entry["data_offsets"]
        if start + end > len(mapped):
            raise ShardError(f"{path} ends early ({name!r} is short).")
        dtype = np.dtype(_NUMPY[entry["dtype"]])
        arrays[name] = np.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                     offset=start + begin).reshape(entry["shape"])
    return arrays, metadata


# A float is an Inf or a NaN when every bit of its exponent is set: per safetensors dtype,
# the unsigned integer of its width and its exponent bits (what `finite` tests).
_EXPONENT = {"BF16": ("uint16", 0x7F80), "F16": ("uint16", 0x7C00),
             "F32": ("uint32", 0x7F800000), "F64": ("uint64", 0x7FF0000000000000)}
_CHUNK = 1 << 22  # values tested at a time: a bounded temporary


def finite(array, code: str) -> bool:
    """Whether every value of `array` (numpy, of safetensors dtype `code`; bf16 as its 16
    bits) is finite, from its exponent bits: ~8 ms for a 5K-token SmolLM2 context (118 MB
    of bf16 keys and values) where `torch.isfinite` takes ~300 ms. Non-float dtypes: True."""
    import numpy as np

    if code not in _EXPONENT:
        return True
    kind, exponent = _EXPONENT[code]
    bits = np.ascontiguousarray(array).reshape(-1).view(kind)
    magnitude = np.array(exponent | (exponent - 1) if code != "F64" else (1 << 63) - 1,
                         dtype=kind)  # every bit but the sign
    for at in range(0, bits.size, _CHUNK):
        if int(np.bitwise_and(bits[at:at + _CHUNK], magnitude).max()) >= exponent:
            return False
    return True


def tensor_finite(tensor) -> bool:
    """`finite` for a torch tensor (on another device: torch's own test, there)."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    code = _CODES.get(str(tensor.dtype).removeprefix("torch."))
    if tensor.device.type != "cpu" or code not in _EXPONENT:
        return bool(torch.isfinite(tensor).all())
    same_width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return finite(tensor.detach().contiguous().view(same_width).numpy(), code)


def nonfinite(path: Path) -> list[str]:
    """The float tensors of a file holding an Inf or a NaN (none: [])."""
    _, found = header(path)
    arrays, _ = map_arrays(path)
    return [name for name, array in arrays.items() if not finite(array, found[name]["dtype"])]


def _map(path: Path):
    """The whole file, memory-mapped privately (copy on write: nothing reaches the file)."""
    import mmap

    with open(path, "rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


def _mapped_view(mapped, start: int, entry: dict, path: Path, name: str):
    """Tensor `entry` of the header as a view of `mapped` (the file; data from `start`)."""
    import numpy as np
    import torch

    begin, end = entry["data_offsets"]
    if start + end > len(mapped):
        raise ShardError(f"{path} ends early ({name!r} is short).")
    raw = np.frombuffer(mapped, dtype=np.uint8, count=end - begin, offset=start + begin)
    return torch.from_numpy(raw).view(_dtype(entry)).view(entry["shape"])


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
        start, found = header(path)
        entry = found[name]
        self._file = FileMap(path)
        self.tensor = _mapped_view(self._file.map, start, entry, path, name)

    def release(self, layer: int) -> None:
        """Drop the pages of `layer` from this process's resident memory."""
        self._file.release(self.tensor[layer])

    def pages(self, layer: int) -> tuple[int, int] | None:
        """The (address, length) that `release(layer)` drops (`FileMap.pages`)."""
        return self._file.pages(self.tensor[layer])
