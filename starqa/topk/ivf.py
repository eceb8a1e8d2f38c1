"""ivf: per layer every KV head's IVF lists over all the worker's blocks (`IvfLayer`: taken
from the blocks' own index files, which list each key went to; the keys kept list by list
in the cache's dtype, each list's centre its mean key, the lists laid out by a mean query,
`listlayout`), scanned by `IvfShard`. A row ranks its KV head's C centres, picks its
nearest lists (`probing.row_probes`: about IVF_ROW_SCAN * k keys, at least IVF_MIN_PROBES
lists) and keeps the k best of their keys: the compiled kernel (`native.topk_attend`, one
call per layer; on a GPU the same selection, `native.TopKTable.select`, on the host), or
numpy's `_select_ivf` where no kernel was built. Its selections' ids are head * N + row.

The tail (`TopK.tail` "lists", the default; `attention.topk`'s docstring): the keys outside
a position's union count in its softmax by their lists, each list's as many copies of its
centre holding its mean value (`IvfLayer.tail`), so no list's weight is missing. In the
compiled kernel, or `topk.tail_part` beside the selected rows' attention (`_with_tail`)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from starqa.attention import merge, topk
from starqa.core import tensorfile
from starqa.topk import probing
from starqa.topk.listlayout import list_order
from starqa.topk.loading import BlockFiles, Blocks, MeanQueries, built_index
from starqa.topk.rows import Held
from starqa.topk.scanned import KernelKeys, ScannedShard

SCAN_STEP = 512  # ivf scans a multiple of this many keys per KV head (see _scanned)


class IvfLayer:
    """One layer's ivf on a worker, every KV head's lists over all of the worker's blocks:

        centroids [Hkv, C, D] numpy fp32   each head's lists' centres (the blocks' IVF
                                           lists, C = the lists of every block, side by
                                           side or laid out by a mean query:
                                           `listlayout`), each list's mean key
                                           (`_list_means`), rounded to bf16 (the kernel
                                           reads them so: half the bytes of a decode's
                                           list choice)
        offsets   [Hkv, C + 1] numpy int64 list c of head h is keys[h][offsets[h, c]:
                                           offsets[h, c + 1]]
        rows      [Hkv, N] numpy int64     each listed key's row in the shard
        keys      [Hkv, N, D] torch        the keys in list order, in the cache's dtype
        at        [Hkv, N] numpy int32     each shard row's position in keys (the inverse
                                           of rows: GQA sharing scores a key by its row)
        tail      [Hkv, C, D] torch bf16   each list's mean value, for the tail
                                           (`topk.tail_part`; TopK.tail), or None

    The lists are the blocks' own (their IVF files: which list each key went to); the
    keys are the cache's, so scores are exact. In memory: the keys (2 bytes a dimension in
    bf16), an int64 row and an int32 position each, the centroids, and with the tail each
    list's mean value (as much again as the centroids in bf16)."""

    def __init__(self, centroids, offsets, rows, keys, tail=None):
        import numpy as np

        self.centroids, self.offsets, self.rows, self.keys = centroids, offsets, rows, keys
        self.tail = tail
        self.at = np.empty(rows.shape, np.int32)
        np.put_along_axis(self.at, rows, np.arange(rows.shape[1], dtype=np.int32)[None], axis=1)

    @cached_property
    def list_of(self) -> torch.Tensor:
        """[Hkv, N] int32: each shard row's list (the tail's counts, `topk.lists_left`)."""
        import numpy as np

        sizes = np.diff(self.offsets, axis=1)
        out = np.empty(self.rows.shape, np.int32)
        for head in range(len(sizes)):
            out[head, self.rows[head]] = np.repeat(np.arange(sizes.shape[1], dtype=np.int32),
                                                   sizes[head])
        return torch.from_numpy(out)

    @classmethod
    def of(cls, keys: Sequence[torch.Tensor], index_of, layer: int,
           dtype: torch.dtype | None = None, toward: torch.Tensor | None = None,
           values: Sequence[torch.Tensor] | None = None) -> IvfLayer:
        """From the blocks' keys of this layer (each [Hkv, T, D]) and their IVF indexes
        index_of(block, layer, head); toward [Hkv, D]: each head's lists laid out by it
        (`listlayout.list_order`), else as built; values (the blocks' values of the layer,
        as keys): each list's mean value kept, for the tail."""
        import faiss
        import numpy as np

        heads = keys[0].shape[0]
        centroids, offsets, rows, ordered, means = [], [], [], [], []
        for head in range(heads):
            cents, lists, first = [], [], 0
            for block in range(len(keys)):
                owner = index_of(block, layer, head)  # alive while its IVF view is used
                index = faiss.extract_index_ivf(owner)
                cents.append(index.quantizer.reconstruct_n(0, index.nlist))
                index.make_direct_map()  # key -> (list << 32 | offset in list)
                lists.append((faiss.vector_to_array(index.direct_map.array) >> 32) + first)
                first += index.nlist
            assigned = np.concatenate(lists)
            whole = torch.cat([k[head] for k in keys]) if len(keys) > 1 else keys[0][head]
            whole = whole.to(dtype or whole.dtype)
            counts = np.bincount(assigned, minlength=first)  # keys a list
            cents = _list_means(whole, assigned, counts, np.concatenate(cents))
            if values is not None:  # an empty list's mean value: 0 (it has no key to stand for)
                mean = _list_means(torch.cat([v[head] for v in values]), assigned, counts,
                                   np.zeros_like(cents))
            laid = list_order(cents, None if toward is None else toward[head])
            if laid is not None:  # list laid[i] becomes list i
                place = np.empty_like(laid)
                place[laid] = np.arange(len(laid))
                assigned, cents, counts = place[assigned], cents[laid], counts[laid]
                if values is not None:
                    mean = mean[laid]
            if values is not None:
                means.append(mean)
            order = np.argsort(assigned, kind="stable")  # the head's keys, list by list
            centroids.append(cents)
            offsets.append(np.concatenate([[0], np.cumsum(counts)]))
            rows.append(order)
            ordered.append(whole.index_select(0, torch.from_numpy(order)))
        rounded = torch.from_numpy(np.stack(centroids).astype(np.float32)).bfloat16().float()
        tail = torch.from_numpy(np.stack(means)).bfloat16() if means else None
        return cls(np.ascontiguousarray(rounded.numpy()),
                   np.stack(offsets), np.stack(rows), torch.stack(ordered), tail)


def _list_means(keys: torch.Tensor, assigned, counts, centroids):
    """Each list's mean key [C, D] numpy fp32, from keys [N, D], each key's list `assigned`
    [N] and each list's keys `counts` [C] (numpy int64); an empty list keeps its index's
    centroid (centroids [C, D]). (Of values likewise: each list's mean value.)

    Phase 2 ranks lists by their centre's inner product with a row, and a list's mean is
    nearer its keys than the centroid its index trained (10 k-means iterations, after which
    every key went to its nearest centroid): on SmolLM2's decode queries
    (`benchmarks/dev/topk_recall.py`) the same lists probed found more of the exact top k,
    0.932 -> 0.955 at 8K (48 lists a row) and 0.922 -> 0.939 at 32K (68)."""
    import numpy as np

    owner, counts = torch.from_numpy(assigned), torch.from_numpy(counts)
    sums = torch.zeros(len(centroids), keys.shape[1]).index_add_(0, owner, keys.float())
    means = (sums / counts.clamp(min=1)[:, None]).numpy()
    return np.where((counts > 0).numpy()[:, None], means, centroids).astype(np.float32)


class IvfShard(ScannedShard):
    """ivf: per layer an `IvfLayer` (ivf[layer]); the values by shard row."""

    def __init__(self, held: Held, ivf: Sequence[IvfLayer]):
        super().__init__(held)
        self.ivf = list(ivf)

    @classmethod
    def of_parts(cls, held: Held, parts: Blocks, dtype: torch.dtype | None,
                 toward: Sequence[torch.Tensor] | None) -> IvfShard:
        """Each block's IVF indexes built here (faiss, on the CPU), their lists taken per
        layer, the keys in `dtype`; toward: per layer [Hkv, D], what the lists are laid out
        by (`listlayout.mean_queries`), else as built; with the tail, each list's mean
        value from the blocks' values."""
        index_of = built_index(parts, held.settings.index)
        tails = held.settings.tails
        return cls(held, [
            IvfLayer.of([k[layer].cpu() for k, _ in parts], index_of, layer, dtype,
                        None if toward is None else toward[layer],
                        [v[layer].cpu() for _, v in parts] if tails else None)
            for layer in range(parts[0][0].shape[0])])

    @classmethod
    def of_cache(cls, held: Held, files: BlockFiles, mean_queries: MeanQueries | None
                 ) -> IvfShard:
        """The blocks' IVF files read mapped (only their lists are used: which list each
        key went to), the keys one layer at a time; mean_queries: given token ids, per
        layer [Hkv, D] (`listlayout.mean_queries`): the lists laid out by those of the
        worker's first block's ids, else as built."""
        read = files.index_reader(held.settings.index)
        toward = None if mean_queries is None else mean_queries(
            tensorfile.read_tensor(files.paths[0], "ids", mapped=True))

        def values_of(layer: int):  # the tail's: the values in memory, once
            if not held.settings.tails:
                return None
            if not held.settings.kv_on_disk:
                return [held.values.layers[layer].cpu()]
            return [tensorfile.read_layer(p, "v", layer) for p in files.paths]

        return cls(held, [
            IvfLayer.of([tensorfile.read_layer(p, "k", layer) for p in files.paths],
                        lambda b, lay, h: read(b, lay, h, True), layer, files.dtype,
                        None if toward is None else toward[layer], values_of(layer))
            for layer in range(files.layers)])

    @property
    def heads(self) -> int:
        """Hkv, the KV heads of the lists."""
        return self.ivf[0].centroids.shape[0]

    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best keys of its own nearest lists, past the sink: in the compiled
        kernel on the CPU whatever q's device (on an H100's host numpy's ranking of the
        lists took ~74 ms a layer at 128K), as for `parts`; numpy's `_select_ivf` else."""
        table = self._kernel_table(layer, k)
        if table is not None:
            return table.select(q, k, self.n_sink)
        scores, ids = self._select_ivf(layer, q, k)
        return (torch.from_numpy(scores).view(*q.shape[:2], -1),
                torch.from_numpy(self._rows_of(ids, q.shape[1])).view(*q.shape[:2], -1))

    def key_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the keys at the shard rows idx [Hkv, r, k] (-1: row 0's), found
        in list order."""
        lay = self.ivf[layer]
        at = torch.from_numpy(lay.at).to(idx.device).long()  # [Hkv, N] row -> position
        where = at.gather(1, idx.clamp(min=0).reshape(idx.shape[0], -1)).view_as(idx)
        return topk.gather_rows(lay.keys, where)

    def _kernel_keys(self, layer: int, k: int) -> KernelKeys:
        """The layer's keys in list order with their rows, the lists a row scans (k sets
        how many), and the tail."""
        lay = self.ivf[layer]
        n_lists = lay.centroids.shape[1]
        lists = (torch.from_numpy(lay.centroids), torch.from_numpy(lay.offsets),
                 probing.row_probes(self.n_keys, n_lists, k))
        return KernelKeys([(0, lay.keys)], torch.from_numpy(lay.rows), lists,
                          torch.from_numpy(lay.at),
                          tail=None if lay.tail is None else (lay.tail, lay.list_of))

    def _with_tail(self, layer: int, q: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, bias: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """With the tail, its part (`topk.tail_part`, computed on the CPU where the lists
        are; its lse moved by `bias`) merged into the selected rows' (out, lse)."""
        lay = self.ivf[layer]
        if lay.tail is None:
            return out, lse
        import numpy as np

        left = topk.lists_left(idx.cpu(), lay.list_of, torch.from_numpy(np.diff(lay.offsets)),
                               self.n_sink)
        centre = torch.matmul(q.float().cpu(), torch.from_numpy(lay.centroids).transpose(1, 2))
        rest, rest_lse = topk.tail_part(centre, left, lay.tail, scale)
        return merge([out.float(), rest.to(out.device)], [lse, rest_lse.to(lse.device) + bias])

    def _select_ivf(self, layer: int, q: torch.Tensor, k: int):
        """The k best keys of each row among its own nearest lists: numpy (scores, ids)
        [Hkv * r, k], ids head * N + row (-1, score -inf: none); the same selection as the
        compiled kernel's (`native.topk_attend`), for a machine without it. Every row of a
        KV head (its G query heads, and a prefill's positions) picks its nearest lists;
        the head's keys in the union of them are ranked in one batched matmul in the keys'
        dtype, each row seeing only the keys of its own lists (so a row's keys never
        depend on the other rows of the forward), and each row's k best are scored again
        in fp32 (exact), as `topk.select_exact` does. Every KV head is done at once (a
        few array calls per layer, not per head): each call costs more here than its
        work."""
        import numpy as np

        lay = self.ivf[layer]
        heads, rows, dim = q.shape
        n = self.n_keys
        q = q.cpu()  # the lists and keys are on the CPU, whatever q's device
        x = q.float()
        width, where, valid, outside = _scanned(lay, x, n, k)
        flat = where + (np.arange(heads) * n)[:, None]  # [Hkv, W] rows of keys [Hkv * N]
        keys = lay.keys.view(-1, dim)
        scanned = keys.index_select(0, torch.from_numpy(flat.reshape(-1))).view(heads, width, dim)
        rank = torch.matmul(q.to(keys.dtype), scanned.transpose(1, 2)).float().numpy()
        found = np.take_along_axis(lay.rows, where, 1)  # [Hkv, W] rows in the shard
        # the padding, and the sink's rows (attended apart), are never picked
        np.putmask(rank, np.broadcast_to((~valid | (found < self.n_sink))[:, None], rank.shape)
                   | outside, -np.inf)
        take = min(k, width)
        best = np.argpartition(rank, width - take, axis=-1)[..., width - take:]  # [Hkv, r, take]
        picked = keys.index_select(0, torch.from_numpy(np.take_along_axis(
            np.broadcast_to(flat[:, None], rank.shape), best, -1).reshape(-1)))
        exact = torch.einsum("hrd,hrkd->hrk", x, picked.view(heads, rows, take, dim).float())
        exact = exact.numpy()
        missing = np.isneginf(np.take_along_axis(rank, best, -1))
        exact[missing] = -np.inf
        ids = np.take_along_axis(np.broadcast_to(found[:, None], rank.shape), best, -1)
        ids = np.where(missing, -1, ids + (np.arange(heads) * n)[:, None, None])
        if take < k:  # fewer keys than k in the shard
            exact = np.pad(exact, ((0, 0), (0, 0), (0, k - take)), constant_values=-np.inf)
            ids = np.pad(ids, ((0, 0), (0, 0), (0, k - take)), constant_values=-1)
        return exact.reshape(heads * rows, k), ids.reshape(heads * rows, k)

    def _rows_of(self, ids, rows: int):
        """ivf ids head * N + row [Hkv * r, k] → rows in the shard (-1 stays -1)."""
        import numpy as np

        first = np.repeat(np.arange(len(ids) // rows) * self.n_keys, rows)[:, None]
        return np.where(ids >= 0, ids - first, -1)


def _scanned(lay: IvfLayer, x: torch.Tensor, n: int, k: int):
    """What `_select_ivf`'s rows x [Hkv, r, D] fp32 scan in `lay` (N = n keys a head): the
    width W of each head's scan, where [Hkv, W] (positions in the head's list order),
    valid [Hkv, W] (not padding) and outside [Hkv, r, W] (a key not in the row's own
    nearest lists)."""
    import numpy as np

    heads, rows, _ = x.shape
    coarse = np.matmul(x.numpy(), lay.centroids.transpose(0, 2, 1))  # [Hkv, r, C]
    n_lists = coarse.shape[2]
    probes = probing.row_probes(n, n_lists, k)
    if probes >= n_lists:
        return (n, np.broadcast_to(np.arange(n), (heads, n)), np.ones((heads, n), bool),
                np.zeros((heads, rows, n), bool))
    chosen = np.argpartition(coarse, n_lists - probes, axis=-1)[..., n_lists - probes:]
    union = np.zeros((heads, n_lists), bool)
    union[np.arange(heads)[:, None, None], chosen] = True
    head_of, lists = np.nonzero(union)  # by head, then list
    begin, end = lay.offsets[head_of, lists], lay.offsets[head_of, lists + 1]
    per_head = np.bincount(head_of, weights=end - begin, minlength=heads).astype(np.int64)
    # padded to a multiple of SCAN_STEP keys (the padding is masked in `_select_ivf`): a
    # bf16 matmul of a shape oneDNN has not seen costs ~10x one it has
    width = -(-int(per_head.max()) // SCAN_STEP) * SCAN_STEP
    where = np.zeros((heads, width), np.int64)  # positions in the head's list order
    valid = np.arange(width) < per_head[:, None]
    where[valid] = _ranges(begin, end)  # row-major: head by head, in order
    list_of = np.zeros((heads, width), np.int64)  # each scanned key's list
    list_of[valid] = np.repeat(lists, end - begin)
    mine = np.zeros((heads, rows, n_lists), bool)  # the lists each row chose
    np.put_along_axis(mine, chosen, True, axis=-1)
    outside = ~np.take_along_axis(
        mine, np.broadcast_to(list_of[:, None], (heads, rows, width)), -1)
    return width, where, valid, outside


def _ranges(begin, end):
    """The positions of ranges [begin_i, end_i) one after the other, numpy int64."""
    import numpy as np

    lengths = end - begin
    before = np.cumsum(lengths) - lengths  # where range i starts in the result
    return np.arange(lengths.sum()) - np.repeat(before - begin, lengths)
