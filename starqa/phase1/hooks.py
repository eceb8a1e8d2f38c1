"""The bridge into transformers: one attention function and its mask function, registered
under the name "starqa" in transformers' public attention registries.

A model loaded with `attn_implementation="starqa"` calls `starqa_attention` in every layer.
The phase that is running passes its state object through the forward keyword argument
`starqa=`; transformers forwards unknown kwargs down to the attention function. The object
implements the `AttentionHook` protocol below and decides what each layer attends to.
Without one, the function is plain causal attention, so the model still works as usual.
Phase 1 encodes through this bridge; Phase 2 runs `starqa.models.decoder` (a lean forward with no
per-module overhead), whose attention callback is the same kind of hook object.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from starqa.attention import causal_attention

NAME = "starqa"


class AttentionHook(Protocol):
    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """query [B, Hq, M, D], key/value [B, Hkv, M, D] of the tokens in this forward, RoPE
        applied. Returns the attention output [B, Hq, M, D]."""
        ...


def starqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     starqa: AttentionHook | None = None, **kwargs):
    # The registered mask function returns None, so `attention_mask` is always None here:
    # every phase builds its own masks (shard: none; own tokens: causal, bottom-right).
    if starqa is None:
        out = causal_attention(query, key, value, scaling)
    else:
        out = starqa.attention(module.layer_idx, query, key, value, scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None  # [B, M, Hq, D]


def no_mask(*args, **kwargs):
    """Mask function paired with `starqa_attention`: masks are the phases' business."""
    return None


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the implementation name."""
    AttentionInterface.register(NAME, starqa_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME
