"""Phase 1's block loop, shared by the torchrun workers (`starqa.workers.worker`) and the
launcher's in-process path (`starqa.launchers.ingest`: an incremental ingest with few blocks to
encode need not start a group). Encodes this rank's share of the blocks `todo`, after the
stored KV of the blocks before them where the method continues from it (dense, ring), and
saves each block into the staging folder as it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path


def encode_blocks(model, ids, method, blocks: Sequence[tuple[int, int]], todo: Sequence[int],
                  folder: Path, info, prepared: dict | None,
                  on_block: Callable[[int, int], None] = lambda index, tokens: None,
                  index: dict | None = None,
                  on_index: Callable[[float], None] = lambda seconds: None,
                  dtype: str | None = None) -> None:
    """ids: [n] int64; method: MethodConfig; info: dist.DistInfo (a world of one in
    process). on_block(index, tokens) after each block is written; with `index` ({"kind",
    "folder"}: top-k attention's indexes, starqa.topk.indexes), each block's indexes are built
    from its keys and written too, on_index(seconds) after each. dtype: the cache's (torch's
    name), where the model computes in another (`models.phase1_dtype`): each block's KV is
    rounded to it as it is saved, and stored blocks Phase 1 continues from are read back in
    the model's."""
    import torch

    from starqa import methods
    from starqa.cache import shards

    store = getattr(torch, dtype) if dtype else None
    compute = next(model.parameters()).dtype
    encoder = methods.get(method.name)
    past = None
    if encoder.needs_past and todo and todo[0] > 0:  # kept blocks, linked in already
        past = [(k.to(compute), v.to(compute))
                for k, v in shards.read_blocks(folder, range(todo[0]), device=info.device)]
    for i, k, v in encoder.encode_todo(model, ids, method, blocks, list(todo), info,
                                       prepared, past):
        if store is not None:
            k, v = k.to(store), v.to(store)
        start, end = blocks[i]
        shards.save_block(folder, i, k.cpu(), v.cpu(), ids[start:end], {
            "index": str(i), "start": str(start), "end": str(end), "method": method.name})
        if index is not None:
            from starqa.topk import indexes

            on_index(indexes.write_block(folder / index["folder"], index["kind"], i, k))
        on_block(i, end - start)


def encode_in_process(model_path, dtype: str, device: str, ids, method, blocks, todo,
                      folder: Path, prepared: dict | None, *,
                      on_ready: Callable[[], None] = lambda: None,
                      on_block: Callable[[int, int], None] = lambda index, tokens: None,
                      index: dict | None = None,
                      on_index: Callable[[float], None] = lambda seconds: None) -> None:
    """Blocks `todo` encoded in this process, a world of one: the model loaded here with
    the same attention hooks as a worker's, so the blocks are the ones a group writes."""
    import os
    import time

    import torch

    from starqa.runtime import dist
    from starqa.phase1 import hooks
    from starqa.models import load_model, phase1_dtype

    info = dist.local_world(device)
    model = load_model(str(model_path), device=info.device, attn_implementation=hooks.register(),
                       dtype=getattr(torch, phase1_dtype(dtype, info.device, model_path)))
    on_ready()
    if seconds := os.environ.get("STARQA_SLOW"):  # test-only, as in starqa.workers.worker
        time.sleep(float(seconds))
    encode_blocks(model, torch.as_tensor(ids, dtype=torch.long), method, blocks, todo, folder,
                  info, prepared, on_block, index, on_index, dtype)
