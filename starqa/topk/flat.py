"""flat: exact top-k over the keys themselves, per layer [Hkv, N, D] in the compute dtype
(`FlatShard`); with --kv-on-disk none are held: each block's keys are memory-mapped,
scanned a layer at a time and that layer's pages released (`MappedFlatShard`; every key is
still read, from the page cache). Scores are exact fp32 inner products
(`topk.select_exact`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from starqa.attention import topk
from starqa.native import ops as native
from starqa.topk.loading import BlockFiles, Blocks, MeanQueries, per_layer, read_per_layer
from starqa.topk.rows import Held, MappedRows, ResidentRows, Rows
from starqa.topk.scanned import KernelKeys, ScannedShard


class FlatShard(ScannedShard):
    """flat with its keys in memory: keys, a `ResidentRows` by shard row (a `MappedRows`
    in `MappedFlatShard`)."""

    def __init__(self, held: Held, keys: Rows):
        super().__init__(held)
        self.keys = keys

    @classmethod
    def of_parts(cls, held: Held, parts: Blocks, dtype: torch.dtype | None,
                 toward: Sequence[torch.Tensor] | None) -> FlatShard:
        """The blocks' keys, one copy per layer in `dtype` on the blocks' device."""
        return cls(held, ResidentRows(per_layer([k for k, _ in parts], dtype,
                                                parts[0][0].device)))

    @classmethod
    def of_cache(cls, held: Held, files: BlockFiles, mean_queries: MeanQueries | None
                 ) -> FlatShard:
        """The block files' keys read a layer at a time, or with --kv-on-disk mapped
        (`MappedFlatShard`)."""
        if held.settings.kv_on_disk:
            return MappedFlatShard(held, MappedRows(files.mapped("k")))
        return cls(held, ResidentRows(read_per_layer(files.paths, "k", files.layers,
                                                     files.dtype, files.device)))

    @property
    def heads(self) -> int:
        """Hkv, the KV heads of the keys."""
        return self.keys.heads

    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best keys past the sink, exactly (`topk.select_exact`)."""
        return topk.select_exact(q, self.keys.layers[layer], k, self.n_sink)

    def key_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the keys at the shard rows idx [Hkv, r, k] (-1: row 0's)."""
        return self.keys.gather(layer, idx)

    def _kernel_keys(self, layer: int, k: int) -> KernelKeys:
        """The layer's keys, one buffer, every key scanned."""
        return KernelKeys(self.keys.buffers(layer))


class MappedFlatShard(FlatShard):
    """flat with --kv-on-disk: keys, a `MappedRows` per block; the kernel drops their pages
    as its scan passes them (native.DROP_KEYS), and torch's code scans a block at a time."""

    keys: MappedRows

    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best keys past the sink: in the compiled kernel, on the CPU
        whatever q's device (the keys stay on disk), else block by block (`_select_blocks`);
        the layer's pages released after."""
        table = self._kernel_table(layer, k)
        if table is None:
            return self._select_blocks(layer, q, k)
        scores, rows = table.select(q, k, self.n_sink)
        for mapped in self.keys.files():
            mapped.release(layer)
        return scores, rows

    def _select_blocks(self, layer: int, q: torch.Tensor, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` without the kernel: each block's k best of its mapped keys in this layer
        (past the sink), then the k best of those; the layer's pages are released block by
        block. On the CPU, whatever q's device: the keys stay on disk."""
        q = q.cpu()
        scores, idx = [], []
        for start, mapped in self.keys.blocks:
            key = mapped.tensor[layer]  # [Hkv, T, D]
            skip = min(max(self.n_sink - start, 0), key.shape[1])
            if key.shape[1] > skip:
                found, rows = topk.select_exact(q, key, k, skip)
                scores.append(found)
                idx.append(rows + start)
            mapped.release(layer)
        return topk.top_candidates(torch.cat(scores, -1), torch.cat(idx, -1), k)

    def _kernel_keys(self, layer: int, k: int) -> KernelKeys:
        """The layer's keys, a mapped buffer per block, dropped as they are scanned."""
        return KernelKeys(self.keys.buffers(layer), drop=native.DROP_KEYS)

    def _mapped_files(self) -> list:
        """The keys' files, then the values'."""
        return self.keys.files() + self.values.files()
