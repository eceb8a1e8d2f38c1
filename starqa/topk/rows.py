"""Where a top-k shard's rows lie, and what every index kind holds besides its keys.

A row store is one tensor of the worker's blocks ("k" or "v", by shard row): in memory per
layer (`ResidentRows`), or memory-mapped per block from the shard files with --kv-on-disk
(`MappedRows`). Both answer the same calls: the rows an index selected (`gather`), the
buffers the compiled kernel reads (`buffers`), and the mapped files whose pages a layer
releases (`files`). `Held` is a shard's data shared by every kind: its settings, budgets,
values, sink and blocks (`loading` builds it, `shard.TopKShard` takes it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from starqa.attention import topk
from starqa.core import tensorfile
from starqa.topk.indexes import TopK


class ResidentRows:
    """Rows in memory: per layer [Hkv, N, D] (the compute dtype, on the blocks' device)."""

    def __init__(self, layers: Sequence[torch.Tensor]):
        self.layers = list(layers)

    @property
    def heads(self) -> int:
        """Hkv, the KV heads."""
        return self.layers[0].shape[0]

    def gather(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the rows idx [Hkv, r, k] selects in `layer` (-1: row 0's)."""
        return topk.gather_rows(self.layers[layer], idx)

    def buffers(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        """`layer`'s rows as the compiled kernel takes them: [(first row, [Hkv, N, D])]."""
        return [(0, self.layers[layer])]

    def files(self) -> list[tensorfile.MappedTensor]:
        """The memory-mapped files holding these rows: none."""
        return []


class MappedRows:
    """Rows memory-mapped from the block files (--kv-on-disk): per block (its first row in
    the shard, the tensor's `tensorfile.MappedTensor` [L, Hkv, T, D]). Nothing is read
    until used, and a layer's pages are released once it is."""

    def __init__(self, blocks: Sequence[tuple[int, tensorfile.MappedTensor]]):
        self.blocks = list(blocks)

    @property
    def heads(self) -> int:
        """Hkv, the KV heads."""
        return self.blocks[0][1].tensor.shape[1]

    def gather(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: rows idx [Hkv, r, k] (-1: zeros) of the files in `layer`: only
        those rows of the files are read, and each file's layer is released after."""
        first = self.blocks[0][1].tensor
        out = torch.zeros(*idx.shape, first.shape[-1], dtype=first.dtype)
        idx = idx.cpu()
        heads = torch.arange(idx.shape[0])[:, None, None].expand_as(idx)
        for start, mapped in self.blocks:
            rows = mapped.tensor
            inside = (idx >= start) & (idx < start + rows.shape[2])
            if inside.any():
                out[inside] = rows[layer][heads[inside], idx[inside] - start]
                mapped.release(layer)
        return out

    def buffers(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        """`layer`'s rows as the compiled kernel takes them: [(first row, [Hkv, T, D])] a
        block each, mapped."""
        return [(start, mapped.tensor[layer]) for start, mapped in self.blocks]

    def files(self) -> list[tensorfile.MappedTensor]:
        """The memory-mapped files holding these rows, a block each, in order."""
        return [mapped for _, mapped in self.blocks]


Rows = ResidentRows | MappedRows


@dataclass(frozen=True)
class Held:
    """What a top-k shard of any index kind holds besides its keys.

    budgets: keys per row in each layer (`topk.layer_budgets`); n_keys: N, the worker's
    rows; values: by shard row; sinks: per layer (keys, values) [1, Hkv, S, D] fp32, the
    context's first S tokens, on the worker that holds them, else None; blocks: per block
    in order (k, v [L, Hkv, T, D], in memory or memory-mapped, and a function that releases
    a layer's pages, or None), read by the question's exact forward only."""

    settings: TopK
    budgets: Sequence[int]
    n_keys: int
    values: Rows
    sinks: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    blocks: Sequence[tuple] = ()
