"""One Phase 1 forward of a block's tokens through the model, recording the KV it keeps:
the primitive every Phase 1 method builds its blocks from (phase1 and pulsar use `Recorder`;
apb and ring have hooks of their own, and every method stacks its layers with `stack_layers`)."""

from __future__ import annotations

import torch

from starqa.attention import causal_attention


class Recorder:
    """AttentionHook for one forward: causal self-attention over the input (optionally after
    `past` KV from earlier blocks), keeping the KV of the last `keep` tokens per layer."""

    def __init__(self, keep: int, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.keep = keep
        self.past = past
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(self, layer, query, key, value, scale):
        # key, value: [1, Hkv, T, D] of this forward's tokens
        self.kept.append((key[:, :, -self.keep:], value[:, :, -self.keep:]))
        if self.past:
            key = torch.cat([self.past[layer][0], key], dim=2)
            value = torch.cat([self.past[layer][1], value], dim=2)
        return causal_attention(query, key, value, scale)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        return stack_layers(self.kept)  # [L, Hkv, keep, D] each


def stack_layers(kept: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer (k, v), each [1, Hkv, T, D], as one (k, v) pair [L, Hkv, T, D]: a shard's
    layout."""
    return torch.stack([k[0] for k, _ in kept]), torch.stack([v[0] for _, v in kept])


def forward(model, ids: torch.Tensor, positions: torch.Tensor, hook) -> None:
    # The base model only: Phase 1 needs the KV, not the logits.
    model.model(input_ids=ids[None], position_ids=positions[None], starqa=hook, use_cache=False)
