"""Phase 1's block loop, shared by the torchrun workers (`starqa.workers.worker`) and the
launcher's in-process path (`starqa.launchers.ingest`: an incremental ingest with few blocks to
encode need not start a group). Encodes this rank's share of the blocks `todo`, after the
stored KV of the blocks before them where the method continues from it (dense, ring), and
saves each block into the staging folder as it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from starqa.methods import MethodConfig
from starqa.runtime.protocol import IndexJob


@dataclass(frozen=True)
class EncodeTask:
    """The blocks Phase 1 encodes of one context: the method's settings, every block's
    [start, end) token range, the blocks `todo` (every block, or those an incremental ingest
    encodes) and the method's `prepare` result."""

    method: MethodConfig
    blocks: Sequence[tuple[int, int]]
    todo: Sequence[int]
    prepared: dict | None = None


@dataclass(frozen=True)
class BlockSink:
    """Where encoded blocks go: the staging `folder`, rounded to the cache's `dtype`
    (torch's name; None: as computed) as they are saved; with `index`, top-k attention's
    indexes of each block too (starqa.topk.indexes), built from the float keys; kv: the KV's
    precision as saved (starqa.cache.manifest.KV_KINDS). on_block(index, tokens) is called
    after each block is written, on_index(seconds) after each block's indexes."""

    folder: Path
    dtype: str | None = None
    index: IndexJob | None = None
    on_block: Callable[[int, int], None] = lambda index, tokens: None
    on_index: Callable[[float], None] = lambda seconds: None
    kv: str = "float"


def rope_length(model_path, ids, task: EncodeTask) -> int | None:
    """The context's length (the position its question starts at) where the model's RoPE
    depends on it (dynamic, longrope: `models.load_model`'s rope_length), else None."""
    from starqa import methods
    from starqa.models.rope import VARYING, Rope

    try:
        if Rope.of(model_path).kind not in VARYING:
            return None
    except (OSError, ValueError, KeyError):  # no config, or a RoPE left to transformers
        return None
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return methods.get(task.method.name).query_position(ids, task.method, task.blocks,
                                                        task.prepared)


def encode_blocks(model, ids, task: EncodeTask, info, sink: BlockSink) -> None:
    """ids: [n] int64; info: dist.DistInfo (a world of one in process). Where the model
    computes in another dtype than the sink's (`models.phase1_dtype`), each block's KV is
    rounded to the sink's as it is saved, and stored blocks Phase 1 continues from are read
    back in the model's."""
    import torch

    from starqa import methods
    from starqa.cache import shards

    store = getattr(torch, sink.dtype) if sink.dtype else None
    compute = next(model.parameters()).dtype
    method, blocks, todo = task.method, task.blocks, list(task.todo)
    encoder = methods.get(method.name)
    past = None
    if encoder.needs_past and todo and todo[0] > 0:  # kept blocks, linked in already
        past = [(k.to(compute), v.to(compute))
                for k, v in shards.read_blocks(sink.folder, range(todo[0]), device=info.device)]
    for i, k, v in encoder.encode_todo(model, ids, method, blocks, todo, info, task.prepared,
                                       past):
        if store is not None:
            k, v = k.to(store), v.to(store)
        start, end = blocks[i]
        shards.save_block(sink.folder, i, k.cpu(), v.cpu(), ids[start:end], {
            "index": str(i), "start": str(start), "end": str(end), "method": method.name},
            kv=sink.kv)
        if sink.index is not None:
            from starqa.topk import indexes

            sink.on_index(indexes.write_block(sink.folder / sink.index.folder, sink.index.kind,
                                              i, k))
        sink.on_block(i, end - start)


def encode_in_process(model_path, device: str, ids, task: EncodeTask, sink: BlockSink,
                      on_ready: Callable[[], None] = lambda: None) -> None:
    """Blocks `task.todo` encoded in this process, a world of one: the model loaded here
    with the same attention hooks as a worker's (computing in `models.phase1_dtype` of the
    sink's dtype), so the blocks are the ones a group writes; on_ready() once it is loaded."""
    import os
    import time

    import torch

    from starqa.runtime import dist
    from starqa.phase1 import hooks
    from starqa.models import load_model, phase1_dtype

    info = dist.local_world(device)
    model = load_model(str(model_path), device=info.device, attn_implementation=hooks.register(),
                       dtype=getattr(torch, phase1_dtype(sink.dtype, info.device, model_path)),
                       rope_length=rope_length(model_path, ids, task))
    on_ready()
    if seconds := os.environ.get("STARQA_SLOW"):  # test-only, as in starqa.workers.worker
        time.sleep(float(seconds))
    encode_blocks(model, torch.as_tensor(ids, dtype=torch.long), task, info, sink)
