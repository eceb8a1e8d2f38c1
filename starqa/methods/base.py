"""`Method`: everything the rest of starqa may ask of a Phase 1 method, with the defaults
most methods share. One subclass per method (star.py, exact.py, pulsar.py, apb.py); the
registry (`starqa.methods`) holds one instance of each.

The attention math lives in the modules named in each subclass (starqa.phase1, .ring,
.pulsar, .apb) and is imported inside the methods that run it, so importing the registry
loads no torch. Phase 2 is the same for every method (docs/methods.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from starqa.core.errors import StarqaError
from starqa.core.blocks import digest, split_contiguous
from starqa.methods.config import MethodConfig

Blocks = Sequence[tuple[int, int]]
# (index, k, v) per block, k and v [L, Hkv, T, D] with RoPE applied at the block's positions
Encoded = Iterator[tuple[int, Any, Any]]


class Method:
    """One Phase 1 method. Class attributes describe it; methods compute what depends on it."""

    name: str = ""  # --method's value, recorded in every manifest
    help: str = ""  # one line for --method's help
    # The method-specific settings it owns: keys of method_config's `params`, and "anchor"
    # for --anchor-size. Giving one to a method that does not own it is an error.
    settings: tuple[str, ...] = ()
    exact: bool = False  # its blocks equal dense's (up to rounding)
    sequential: bool = False  # every block on one worker, in order
    # Incremental re-ingest (issue #14). reuse "block": a block's KV depends on its own
    # inputs only (`block_inputs`), so every block whose inputs are unchanged is kept;
    # "prefix": block i depends on every earlier block, so blocks before the first changed
    # one are kept and every later one is encoded again.
    reuse: str = "prefix"
    # encode_todo needs the stored KV of the blocks before the first one to encode (dense,
    # ring: exact causal attention continues from it).
    needs_past: bool = False
    # With contiguous positions (`--positions contiguous`) every position a block or the
    # question meets lies within a span the window holds: contexts longer than any window fit.
    fits_any_window: bool = False
    # Every block after the first attends to one shared prefix (star's anchor) that a worker
    # encodes once for all its blocks: on a CPU, one worker with every core encodes it once
    # where a worker per core encodes it once each, for the same cores.
    shares_prefix: bool = False

    # ------------------------------------------------------------------- settings

    def config(self, block_size: int, anchor_size: int | None, params: dict) -> MethodConfig:
        """The settings for blocks of `block_size`, with the papers' defaults for what was
        not given (None). `params` holds only settings this method owns."""
        return MethodConfig(self.name, block_size, 0)

    def check_usable(self, config: MethodConfig) -> None:
        """Refuse settings a user gave that this method's math cannot use (StarqaError with
        the numbers and the fix); `ingest` asks before anything runs. An anchor, where the
        method has one, must hold the context's first token: the attention sink every block
        needs (without it, blocks after the first answer garbage). Tests build any config
        through `method_config`."""
        if "anchor" in self.settings and config.anchor_size < 1:
            raise StarqaError(
                f"--anchor-size {config.anchor_size} leaves {self.name}'s blocks without an "
                "anchor: every block after the first needs at least the context's first "
                "token (the attention sink) before it.",
                hint=f"leave it out for the default (--anchor-size "
                     f"{self.config(config.block_size, None, {}).anchor_size} for blocks of "
                     f"{config.block_size:,}), or pass another number of 1 or more")

    # ------------------------------------------------------------------- launcher side

    def assignment(self, n_blocks: int, world: int, rank: int) -> list[int]:
        """The blocks worker `rank` of `world` encodes, in the order it encodes them. By
        default a contiguous group: what Phase 2 loads, so shards stay where they were made."""
        return list(split_contiguous(n_blocks, world, rank))

    def max_workers(self, n_blocks: int) -> int:
        """The most Phase 1 workers it can use: one per block, or one when sequential."""
        return 1 if self.sequential else n_blocks

    def prepare(self, ids: Sequence[int], config: MethodConfig, blocks: Blocks) -> dict:
        """What the launcher computes once, before the workers start, for every worker and
        for `query_position`: JSON-able (it travels in the job). Nothing by default."""
        return {}

    def rotatable(self, config: MethodConfig) -> bool:
        """Whether a block that only moved (same inputs, another position offset) may have
        its keys re-rotated to the new positions instead of being encoded (an
        approximation: star at sparse positions). No by default."""
        return False

    def shared_from(self, config: MethodConfig) -> int:
        """At contiguous positions, the first position the blocks share (what lies before
        it once: star's anchor, pulsar's sink); `context_bias` reads it. 0 by default."""
        return 0

    def position_free(self, config: MethodConfig) -> bool:
        """Whether a block's KV is the same wherever the block lies (its positions do not
        depend on its offset): a block that only moved is then reused as it is."""
        return False

    def query_position(self, ids: Sequence[int], config: MethodConfig, blocks: Blocks,
                       prepared: dict | None = None) -> int:
        """Where Phase 2's positions start: right after the context by default."""
        return len(ids)

    def query_bounds(self, config: MethodConfig, n_tokens: int, blocks: Blocks
                     ) -> tuple[int, int]:
        """The least and the most `query_position` can be for a context of `n_tokens` in
        `blocks` (what a manifest's reader checks its recorded one against): exactly
        `n_tokens` by default."""
        return n_tokens, n_tokens

    def invalidated(self, config: MethodConfig, blocks: Blocks, edited: int) -> list[int]:
        """The blocks whose stored KV is stale once the tokens of block `edited` change,
        every block keeping its token range (an edit that moves later tokens changes their
        positions, so every later block goes too). By default `edited` and every later
        block: their KV depends on everything before them."""
        return list(range(edited, len(blocks)))

    def block_inputs(self, ids: Sequence[int], config: MethodConfig, blocks: Blocks, index: int,
                     prepared: dict | None = None) -> dict:
        """Everything block `index`'s stored KV depends on besides the model, the dtype, the
        method's name and the block's position offset (its start, named apart so a
        `rotatable` method can find a block that moved): JSON-able, token ids as digests.
        Two blocks with equal inputs have equal KV, so they share one file (issue #14).
        By default (reuse "prefix") every token up to the block's end, where each block
        before it was cut, and the settings."""
        start, end = blocks[index]
        return {"prefix": digest(ids[:end]), "cuts": [s for s, _ in blocks[:index + 1]],
                "end": end, "anchor": config.anchor_size, "params": config.params}

    # ------------------------------------------------------------------- worker side

    def share(self, todo: Sequence[int], n_blocks: int, world: int, rank: int) -> list[int]:
        """The blocks of `todo` (every block, or those an incremental ingest encodes) that
        worker `rank` encodes: `assignment` for every block, else a contiguous share."""
        if list(todo) == list(range(n_blocks)):
            return self.assignment(n_blocks, world, rank)
        return [todo[i] for i in split_contiguous(len(todo), world, rank)]

    def encode_todo(self, model, ids, config: MethodConfig, blocks: Blocks, todo: Sequence[int],
                    info, prepared: dict | None = None, past=None) -> Encoded:
        """This worker's share of blocks `todo`: yields (index, k, v) for those blocks only.
        past (`needs_past`): per layer (k, v) [1, Hkv, P, D] of blocks 0..todo[0]-1, as
        stored; None when todo starts at block 0. Every worker calls it together."""
        mine = self.share(todo, len(blocks), info.world_size, info.rank)
        return self.encode(model, ids, config, blocks, mine, info, prepared)


    def encode(self, model, ids, config: MethodConfig, blocks: Blocks, indices: Sequence[int],
               info, prepared: dict | None = None) -> Encoded:
        """This worker's blocks `indices` (from `assignment`): yields (index, k, v) per block.
        ids: [n] int64 token ids; info: starqa.runtime.dist.DistInfo; prepared: `prepare`'s result
        (None: compute it here). Every worker of the group calls it together."""
        raise NotImplementedError

    def encode_local(self, model, ids, config: MethodConfig, blocks: Blocks,
                     prepared: dict | None = None) -> Encoded:
        """Phase 1 for every block in this one process (a world of one, in block order),
        equal to what the distributed workers store (tested). Used where many short
        contexts are encoded with one loaded model (`starqa eval`)."""
        from starqa.runtime import dist

        info = dist.local_world(next(model.parameters()).device)
        return self.encode(model, ids, config, blocks, range(len(blocks)), info, prepared)
