"""APB's registry entry (the math: starqa.phase1.apb; docs/methods.md §4)."""

from __future__ import annotations

from starqa.core.errors import StarqaError
from starqa.methods.base import Encoded, Method
from starqa.core.blocks import round_robin
from starqa.methods.config import MethodConfig, chosen

# passing None: an eighth of the block; question None: unknown at encoding time (the engine
# adds its token ids as question_ids when given)
DEFAULTS = {"passing": None, "window": 64, "question": None}


class Apb(Method):
    """Block 0 alone; block i > 0 after a small anchor [question ‖ c[:l_a]], attending in
    every layer to the compressed KV every earlier block passes on."""

    name = "apb"
    help = "a small anchor, and compressed KV passed on between workers (APB)"
    settings = ("anchor", *DEFAULTS)

    def config(self, block_size: int, anchor_size: int | None, params: dict) -> MethodConfig:
        """anchor = block/4, passing = block/8 per KV head, probe window 64, unless given."""
        p = chosen(DEFAULTS, params)
        if p["passing"] is None:
            p["passing"] = max(1, block_size // 8)
        if p["question"] is not None and not p["question"].strip():
            raise StarqaError("--question is empty.")
        if p["passing"] < 0 or p["window"] < 1:
            raise StarqaError(f"--passing-size must be 0 or more and --probe-window at least 1 "
                              f"(got {p['passing']} and {p['window']}).")
        anchor = default_anchor(block_size) if anchor_size is None else anchor_size
        return MethodConfig(self.name, block_size, anchor, p)

    def check_usable(self, config: MethodConfig) -> None:
        """An anchor (Method's rule), and 1 to b keys passed on per block and KV head: with
        none APB is Star with a small anchor, and a block has no more than b keys to pass."""
        super().check_usable(config)
        passing, block = config.params["passing"], config.block_size
        if not 1 <= passing <= block:
            raise StarqaError(
                f"--passing-size {passing} is not between 1 and the block's {block:,} tokens: "
                "each block passes on that many of its keys to the blocks after it.",
                hint=f"leave it out for the default, an eighth of the block (--passing-size "
                     f"{max(1, block // 8)}), or pass another number from 1 to {block}")

    def assignment(self, n_blocks: int, world: int, rank: int) -> list[int]:
        """Round-robin: block i on worker i % world in round i // world, so each round's
        blocks find every earlier block already compressed."""
        return round_robin(n_blocks, world, rank)

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.apb import ApbSettings, encode_apb

        p = config.params
        return encode_apb(model, ids, blocks, indices, info, ApbSettings(
            anchor=config.anchor_size, passing=p["passing"], window=p["window"],
            question_ids=tuple(p.get("question_ids") or ())))

    def share(self, todo, n_blocks, world, rank) -> list[int]:
        """Every block, round-robin, whatever `todo` is: block i needs the KV every earlier
        block passes on, which is not stored, so the earlier blocks are run again."""
        return self.assignment(n_blocks, world, rank)

    def encode_todo(self, model, ids, config, blocks, todo, info, prepared=None,
                    past=None) -> Encoded:
        wanted = set(todo)
        for index, k, v in self.encode(model, ids, config, blocks,
                                       self.share(todo, len(blocks), info.world_size,
                                                  info.rank), info, prepared):
            if index in wanted:
                yield index, k, v

    # invalidated: the default, `edited` and every later block, since every later block
    # reads the KV block `edited` passes on (and its anchor, when the edit reaches into it).


def default_anchor(block_size: int) -> int:
    """l_a = b/4, the larger of the paper's two settings (b/4, b/8)."""
    return max(1, block_size // 4)
