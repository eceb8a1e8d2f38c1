"""Re-rotating stored keys to new positions: a star block that moved (an edit before it
changed its offset) keeps its KV instead of being encoded again (issue #14).

RoPE rotates each key pair (x_j, x_{j+D/2}) by the angle position · inv_freq_j, and
rotations compose, so a key stored at position p becomes the key at p + δ by one more
rotation by δ · inv_freq. That part is exact. What is not: in every layer above the first,
a block token's hidden state was computed attending to the anchor at a distance that has
now changed by δ; the values and the keys' unrotated parts keep that old distance. This
approximation is measured in `benchmarks/rerotate_error.py` (docs/results.md).

    k: [L, Hkv, T, D] with RoPE applied (the shard layout); transformers' rotate_half
    convention (first half, second half).

A scaled RoPE (starqa.models.rope) rotates by position · inv_freq with its own inv_freq, and
multiplies cos and sin by an attention factor a (yarn, longrope): a stored key is
a · R(p) k, and R(δ) a · R(p) k = a · R(p + δ) k, so the same rotation by δ with the
scaled inv_freq moves it, the factor kept. The kinds whose frequencies depend on the
context's length (dynamic, longrope) are never re-rotated: a moved block is encoded again.
"""

from __future__ import annotations

from pathlib import Path

import torch


def inv_freq(model_path: Path) -> torch.Tensor | None:
    """The model's RoPE frequencies [D/2] in fp32, as transformers computes them (a scaled
    RoPE's: starqa.models.rope.frequencies); None for a model Phase 2 does not run or whose
    frequencies depend on the context's length (its blocks are encoded again, never
    re-rotated)."""
    from starqa.models.prepared import DecoderConfig
    from starqa.models.rope import VARYING
    from starqa.core.errors import StarqaError

    try:
        config = DecoderConfig.read(model_path)
    except (StarqaError, KeyError, OSError, ValueError):
        return None
    if config.rope.kind in VARYING:
        return None
    if config.rope.kind != "default":
        from transformers import AutoConfig

        from starqa.models.conversion import quiet_transformers
        from starqa.models.rope import frequencies

        with quiet_transformers():
            return frequencies(AutoConfig.from_pretrained(model_path))[0]
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def rerotate(k: torch.Tensor, delta: int, freqs: torch.Tensor) -> torch.Tensor:
    """Keys k [L, Hkv, T, D] rotated by `delta` more positions (computed in fp32, returned
    in k's dtype)."""
    angles = float(delta) * freqs.double()  # [D/2]; float64: delta · f for large deltas
    emb = torch.cat([angles, angles]).float()  # [D]
    cos, sin = emb.cos(), emb.sin()
    x = k.float()
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated_half * sin).to(k.dtype)


def rerotate_file(source: Path, target: Path, delta: int, freqs: torch.Tensor,
                  metadata: dict[str, str]) -> None:
    """Block file `source` written to `target` with its keys moved by `delta` positions
    (values and any other tensors as they are; int8 keys requantised), atomically."""
    import os

    from safetensors.torch import load_file, save_file

    from starqa.cache.shards import SCALES, dequantized, quantized

    tensors = load_file(str(source))
    if SCALES["k"] in tensors:  # int8 KV: keys dequantised, rotated, quantised again
        tensors.update(quantized({"k": rerotate(dequantized(tensors)["k"], delta, freqs)},
                                 names=("k",)))
    else:
        tensors["k"] = rerotate(tensors["k"], delta, freqs).contiguous()
    tmp = target.with_name(target.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
    except Exception as err:  # a full disk, said in words (shards.write_error)
        from starqa.cache.shards import write_error

        tmp.unlink(missing_ok=True)
        raise write_error(err, tmp) from err
    os.replace(tmp, target)
