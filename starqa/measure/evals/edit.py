"""`starqa eval --edit`: what an incremental re-ingest costs in accuracy, per method.

An edit task's sample (generators: `edit_changed`, `edit_unchanged`) is a haystack of
files as first ingested (`Sample.before`) and the same haystack after one file changed
(the sample). For each method, in a store of block files of its own (a temporary folder):

1. the old haystack is ingested: every block encoded and put into the store;
2. the new one is re-ingested incrementally: `reuse.plan` decides what the store still
   holds, `incremental.keep` links it in and re-rotates moved star blocks, the rest is
   encoded after them (`encoding.encode_blocks`, which continues dense and ring from the
   kept prefix's KV), exactly the functions `ingest` runs;
3. the new one is encoded in full (what `ingest --force` does).

Blocks follow the files as `ingest` cuts them (`plan_file_blocks`). Both encodings are then
answered the same way (runner.Evaluator.answer); the incremental one's label is
`"<method> incr"` and its retention is against the full one of the same method.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from starqa import methods as methods_mod
from starqa.reingest import reuse
from starqa.measure.evals.encoded import Encoded
from starqa.measure.evals.generators import Sample
from starqa.reingest.incremental import adopt, keep, rope
from starqa.cache.manifest import block_file

SUFFIX = " incr"


def label(method: str) -> str:
    """The incremental run's label (a column of the results)."""
    return method + SUFFIX


def reference(label_: str) -> str | None:
    """What a label's retention compares with: an incremental run, the full one."""
    return label_.removesuffix(SUFFIX) if label_.endswith(SUFFIX) else None


def encode_both(evaluator, sample: Sample, method: str):
    """(full, incremental, stats) encodings (`Encoded`) of the edited sample with
    `method`; stats: what the incremental re-ingest reused, re-rotated and encoded."""
    with tempfile.TemporaryDirectory(prefix="starqa-eval-edit-") as tmp:
        store = Path(tmp) / "blocks"
        before, _ = _ingest(evaluator, sample.before, method, store, Path(tmp) / "before")
        incremental, plan = _ingest(evaluator, sample, method, store, Path(tmp) / "after",
                                    previous_block=before.config.block_size)
        full, _ = _ingest(evaluator, sample, method, store, Path(tmp) / "full", force=True)
    stats = {"blocks": len(plan.stems), "reused": len(plan.reused),
             "rotated": len(plan.rotated), "encoded": len(plan.todo)}
    return full, incremental, stats


def _ingest(evaluator, sample: Sample, method: str, store: Path, folder: Path,
            force: bool = False, previous_block: int | None = None):
    """Phase 1 of `sample` as `ingest` runs it into `folder` against the block store
    (`force`: every block encoded, nothing adopted; `previous_block`: the block size of the
    version before, kept as `ingest` keeps it); returns (Encoded, reuse.Plan)."""
    import torch
    from safetensors.torch import load_file

    from starqa.workers.encoding import BlockSink, EncodeTask, encode_blocks

    ids = sample.context_ids
    n = len(ids)
    options = dict(evaluator.options[method])
    if options.get("block_size") is None and previous_block is not None:
        options["block_size"] = reuse.kept_block_size(previous_block, n)
    config = methods_mod.method_config(method, n, **options)
    encoder = methods_mod.get(method)
    blocks = methods_mod.plan_file_blocks(
        n, config.block_size, [(f.path, f.token_start, f.token_end) for f in sample.files])
    folder.mkdir(parents=True)
    started = time.perf_counter()
    prepared = encoder.prepare(ids, config, blocks)
    freqs = rope(evaluator.model_path) if encoder.rotatable(config) and not force else None
    target = reuse.BlockStore(store, evaluator.model_digest,
                              str(evaluator.dtype).removeprefix("torch."))
    plan = reuse.plan(config, ids, blocks, prepared, target, force=force,
                      rotate=freqs is not None)
    keep(plan, store, folder, blocks, freqs, method)
    encode_blocks(evaluator.model, torch.tensor(ids),
                  EncodeTask(config, blocks, list(plan.todo), prepared), evaluator.info,
                  BlockSink(folder, dtype=str(evaluator.dtype).removeprefix("torch.")))
    if not force:
        adopt(plan, store, folder, blocks)
    parts = [(t["k"], t["v"]) for t in (load_file(str(folder / block_file(i)),
                                                  device=str(evaluator.device))
                                        for i in range(len(blocks)))]
    start = encoder.query_position(ids, config, blocks, prepared)
    return Encoded(config, len(blocks), parts, start, time.perf_counter() - started), plan
