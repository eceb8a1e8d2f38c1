"""Phase 2: encode the question on every worker against its shards and generate, merging
partial attentions exactly across workers (one all-gather per layer per step).

Every worker runs all layers on the same query tokens. In each layer worker h computes
(A_h, lse_h) over its own shard, with no mask (the shard lies wholly before the query). The
query host (the worker holding the last block) also attends, causally, to the KV of the
query and the tokens generated so far, which only it keeps. The all-gathered partials are
merged by LSE, so every worker continues with the same, exact attention output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from starqa import dist
from starqa.attention import attend, key_mass, merge


class ShardAttention:
    """AttentionHook for Phase 2 on one worker.

    shard: per layer (k, v) [1, Hkv, N_h, D] of this worker's blocks, or None for no blocks.
    While `track` is set, `key_mass` [N_h] accumulates the attention probability each shard
    key receives from the last query row of every forward (the row that picks the next
    token), summed over layers and heads: the basis of source attribution.
    """

    def __init__(self, info: dist.DistInfo, shard: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 query_host: bool):
        self.info = info
        self.shard = shard
        self.query_host = query_host
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.track = False
        n_keys = shard[0][0].shape[2] if shard else 0
        self.key_mass = torch.zeros(n_keys, dtype=torch.float64)

    def attention(self, layer, query, key, value, scale):
        outs, lses = [], []
        if self.shard is not None:
            out, lse = attend(query, *self.shard[layer], scale)
            outs.append(out), lses.append(lse)
        if self.query_host:
            if layer in self.own:
                key = torch.cat([self.own[layer][0], key], dim=2)
                value = torch.cat([self.own[layer][1], value], dim=2)
            self.own[layer] = (key, value)
            out, lse = attend(query, key, value, scale, causal=True)
            outs.append(out), lses.append(lse)
        if not outs:  # no blocks and not the query host: contribute nothing
            out, lse = attend(query, key[:, :, :0], value[:, :, :0], scale)
        else:
            out, lse = merge(outs, lses)
        # One collective: [out ‖ lse] as [B, Hq, M, D + 1], gathered to [W, B, Hq, M, D + 1].
        gathered = dist.all_gather(self.info, torch.cat([out, lse.unsqueeze(-1)], dim=-1))
        out, total = merge(gathered[..., :-1], gathered[..., -1])
        if self.track and self.shard is not None:
            mass = key_mass(query[:, :, -1:], self.shard[layer][0], scale, total[..., -1:])
            self.key_mass += mass.double().cpu()
        return out

    def reset(self) -> None:
        """Forget the question's KV (the cache stays the document's) and the tracked mass."""
        self.own.clear()
        self.key_mass.zero_()


@torch.inference_mode()
def generate(model, info: dist.DistInfo, hook: ShardAttention, query_ids: Sequence[int],
             start_position: int, max_new_tokens: int, stop_ids: set[int],
             on_token: Callable[[int], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> list[int]:
    """Greedy generation of up to `max_new_tokens` after `query_ids` (at positions from
    `start_position`). The query host picks each token and broadcasts it; it broadcasts -1
    instead when `should_stop()` (evaluated there only) asks to stop early."""
    device = info.device
    src = info.world_size - 1
    ids = torch.tensor(query_ids, device=device)
    positions = torch.arange(start_position, start_position + len(query_ids), device=device)
    generated: list[int] = []
    hook.reset()
    hook.track = True
    try:
        for _ in range(max_new_tokens):
            hidden = model.model(input_ids=ids[None], position_ids=positions[None], starqa=hook,
                                 use_cache=False).last_hidden_state
            choice = torch.zeros(1, dtype=torch.long, device=device)
            if hook.query_host:
                stop = should_stop is not None and should_stop()
                choice[0] = -1 if stop else model.lm_head(hidden[:, -1]).argmax(dim=-1)[0]
            token = int(dist.broadcast(info, choice, src=src)[0])
            if token < 0 or token in stop_ids:
                break
            generated.append(token)
            if on_token is not None:
                on_token(token)
            ids = choice.view(1).to(device)
            positions = positions[-1:] + 1
    finally:
        hook.track = False
        hook.own.clear()  # only the query host ever held the question's KV; drop it now
    return generated
