"""Loading a top-k shard, the part every index kind shares (`retrieval`'s factory, then the
kind's `of_parts` or `of_cache` for its keys or index): the values, the sink, the budgets
and the blocks (`Held`), from blocks in memory or from a cached context's block files
(`BlockFiles`, checksum-verified), and the faiss indexes ivf and hnsw start from (built
here, or read from the context's verified index files)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from starqa.attention import topk
from starqa.cache.manifest import Manifest, block_file
from starqa.core import tensorfile
from starqa.core.errors import StarqaError
from starqa.topk import indexes, probing
from starqa.topk.indexes import TopK
from starqa.topk.rows import Held, MappedRows, ResidentRows

# blocks' (k, v), each [L, Hkv, T, D], in order
Blocks = Sequence[tuple[torch.Tensor, torch.Tensor]]
# given token ids, per layer [Hkv, D]: what ivf lays its lists out by (`listlayout`)
MeanQueries = Callable[[torch.Tensor], Sequence[torch.Tensor] | None]
# index_of(block, layer, head): a faiss index of one block's keys in a layer and KV head
IndexOf = Callable[[int, int, int], object]


def held_of_parts(parts: Blocks, settings: TopK,
                  n_tokens: int, dtype: torch.dtype | None, first: bool) -> Held:
    """What every kind holds of blocks' (k, v) [L, Hkv, T, D] in memory: the values (one
    copy per layer in `dtype`) and the sink (first: the blocks begin with the context's
    first) on the blocks' device; n_tokens: the context's, for the budgets."""
    layers = parts[0][0].shape[0]
    device = parts[0][0].device
    n = sum(k.shape[2] for k, _ in parts)
    budgets = topk.layer_budgets(settings.keys(n_tokens), layers, settings.schedule)
    return Held(settings, budgets, n, ResidentRows(per_layer([v for _, v in parts], dtype, device)),
                sinks=sinks_of(*parts[0], settings.sink, device) if first else None,
                blocks=[(k, v, None) for k, v in parts])


def built_index(parts: Blocks, kind: str) -> IndexOf:
    """index_of for blocks in memory: each block's index of `kind` built when asked."""
    def index_of(block: int, layer: int, head: int):
        return indexes.build(kind, parts[block][0][layer, head].float().cpu().numpy())

    return index_of


@dataclass(frozen=True)
class BlockFiles:
    """A worker's blocks of a cached context, their files checksum-verified: paths per
    block, starts (each block's first row in the shard, and the shard's length last),
    maps (per block its "k" and "v" `tensorfile.MappedTensor`: nothing is read until
    used), the blocks' shape (layers, heads), and what the shard loads them as."""

    manifest: Manifest
    blocks: tuple[int, ...]
    paths: tuple[Path, ...]
    starts: tuple[int, ...]
    maps: tuple[tuple[tensorfile.MappedTensor, tensorfile.MappedTensor], ...]
    layers: int
    heads: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, manifest: Manifest, blocks: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> BlockFiles:
        """`blocks`' files, every one checksum-verified first (as `load_shard` does)."""
        from starqa.cache.shards import verify_checksums

        verify_checksums(manifest, blocks, contents=True)
        paths = tuple(manifest.folder / block_file(b) for b in blocks)
        layers, heads = tensorfile.block_shape(paths[0])[:2]
        found = starts([tensorfile.block_shape(path)[2] for path in paths])
        maps = tuple(tuple(tensorfile.MappedTensor(p, name) for name in ("k", "v"))
                     for p in paths)
        return cls(manifest, tuple(blocks), paths, tuple(found), maps, layers, heads, dtype,
                   device)

    def mapped(self, name: str) -> list[tuple[int, tensorfile.MappedTensor]]:
        """Tensor `name` ("k" or "v") per block: (its first row in the shard, its map)."""
        which = ("k", "v").index(name)
        return [(start, pair[which]) for pair, start in zip(self.maps, self.starts)]

    def held(self, settings: TopK) -> Held:
        """What every kind holds of these blocks: the values read per layer (or mapped,
        with --kv-on-disk), the sink (on the worker holding the context's first block, its
        pages released layer by layer) and the blocks the question's forward reads."""
        if settings.kv_on_disk:
            values = MappedRows(self.mapped("v"))
        else:  # read first: ivf's tail takes its lists' mean values from these
            values = ResidentRows(read_per_layer(self.paths, "v", self.layers, self.dtype,
                                                 self.device))
        budgets = topk.layer_budgets(settings.keys(self.manifest.n_tokens), self.layers,
                                     settings.schedule)
        releases = [lambda layer, k=k, v=v: (k.release(layer), v.release(layer))
                    for k, v in self.maps]
        sinks = None
        if self.blocks[0] == 0:
            sinks = sinks_of(self.maps[0][0].tensor, self.maps[0][1].tensor, settings.sink,
                             self.device, releases[0])
        return Held(settings, budgets, self.starts[-1], values, sinks,
                    [(k.tensor, v.tensor, release) for (k, v), release in zip(self.maps, releases)])

    def index_reader(self, kind: str) -> Callable[[int, int, int, bool], object]:
        """read(block, layer, head, mapped): the faiss index of `kind` of this worker's
        block (its position in `blocks`), read from the context's index files, every one
        checksum-verified first; a StarqaError with the command that builds them where the
        context has none."""
        manifest = self.manifest
        found = indexes.find_set(manifest, kind)
        if found is None:
            raise StarqaError(f"Context {manifest.name!r} has no {kind} indexes.",
                              hint=f"build them: {indexes.rebuild_command(manifest, kind)}")
        files = {(e.block, e.layer, e.head): e.file for e in found.files}
        indexes.verify(manifest, found, self.blocks)
        where = manifest.folder / found.folder

        def read(block: int, layer: int, head: int, mapped: bool):
            return probing.read_index(where / files[(self.blocks[block], layer, head)], mapped)

        return read


def sinks_of(key: torch.Tensor, value: torch.Tensor, size: int, device="cpu", release=None):
    """The sink: per layer (keys, values) [1, Hkv, S, D] fp32 of the first S = min(size,
    T) rows of a block's key, value [L, Hkv, T, D]; None when size is 0. release(layer),
    when given, is called once a layer is copied (mapped files: a read touches whole
    page-cache folios, megabytes for a few rows)."""
    size = min(size, key.shape[2])
    if size < 1:
        return None
    sinks = []
    for layer, (k, v) in enumerate(zip(key, value)):
        sinks.append((k[None, :, :size].to(device, torch.float32),
                      v[None, :, :size].to(device, torch.float32)))
        if release is not None:
            release(layer)
    return sinks


def starts(lengths: Sequence[int]) -> list[int]:
    """Each block's first row in the shard, and the shard's length last."""
    found = [0]
    for n in lengths:
        found.append(found[-1] + n)
    return found


def read_per_layer(paths: Sequence, name: str, layers: int, dtype: torch.dtype,
                   device: torch.device | str) -> list[torch.Tensor]:
    """Tensor `name` of the block files, per layer [Hkv, N, D] in `dtype`: read a layer at
    a time, so loading holds one layer more than the result, never a second copy."""
    out = []
    for layer in range(layers):
        blocks = [tensorfile.read_layer(path, name, layer) for path in paths]
        whole = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        out.append(whole.to(device=device, dtype=dtype))
    return out


def per_layer(parts: Sequence[torch.Tensor], dtype: torch.dtype | None,
              device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Blocks' tensors [L, Hkv, T_i, D] → per layer [Hkv, N, D] (one copy, in `dtype`)."""
    whole = torch.cat(list(parts), dim=2) if len(parts) > 1 else parts[0]
    whole = whole.to(device=device, dtype=dtype or whole.dtype)
    return list(whole.unbind(0))
