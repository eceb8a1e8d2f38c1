"""Phase 2's model: a lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2),
over weights read straight from the model folder's safetensors.

Why not transformers' module tree: a decode step is ~20 small kernels per layer, and at one
token the per-module Python work of `LlamaForCausalLM.forward` costs as much as the math.
Here q/k/v are one matmul and gate/up another, RoPE is two fused multiply-adds, and nothing
but tensors flows between layers. transformers stays the reference: `tests/test_decoder.py`
compares this forward with its logits, and Phase 1 still runs through its attention
registry (starqa.phase1.hooks). No transformers import here, so a cold `ask` does not pay for it.

Shapes (batch 1 throughout, dropped where it would only be noise):

    ids, positions: [M]       hidden: [M, H]        per layer, to `attention`:
    query [1, Hq, M, D]   key, value [1, Hkv, M, D] (RoPE applied)  →  out [1, Hq, M, D]

Its weights are `starqa.models.linear.Linear`s (dense, int8 or int4); a decoder is loaded
from a model folder, its prepared weights mapped, by `starqa.models.decoder_io`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from starqa.native import ops as native
from starqa.models.prepared import DecoderConfig
from starqa.models.linear import Linear


Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepPlan:
    """A forward's attention as starqa/native/_step.c takes it (`native.decode_layers`): words [L,
    A] int64, the own keys written `before` this forward's, and where each layer's folded
    query rows [L, Hkv, G * M, D] and their LSE [L, Hkv, G * M] (fp32) go."""
    words: torch.Tensor
    before: int
    q_rows: torch.Tensor
    lse: torch.Tensor


# (rows M, the model's dtype, query heads, KV heads, head size) → the attention's StepPlan
# for a forward of M rows, or None for the layer-by-layer loop
Compiled = Callable[[int, torch.dtype, int, int, int], "StepPlan | None"]


LINEARS = ("qkv", "out", "gate_up", "down")


@dataclass
class Layer:
    """One decoder layer's weights: RMSNorm scales, q/k/v fused, out, gate/up fused, down."""

    attn_norm: torch.Tensor
    qkv: Linear
    out: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class Decoder:
    """The model for Phase 2: `forward` runs every layer, calling `attention` for each."""

    def __init__(self, config: DecoderConfig, embed: torch.Tensor, layers: list[Layer],
                 norm: torch.Tensor, lm_head: Linear, dtype: torch.dtype, weights: str,
                 rope: tuple[torch.Tensor, float] | None = None):
        self.config, self.embed, self.layers = config, embed, layers
        self.norm, self.lm_head, self.dtype, self.weights = norm, lm_head, dtype, weights
        d = config.head_dim
        # transformers' RoPE: inv_freq in fp32, angles position · inv_freq in fp32, cos and
        # sin times the attention factor in fp32 (yarn's and longrope's; 1 for the other
        # kinds), then rounded to the dtype. Plain RoPE's inv_freq is computed here; a
        # scaled one is given with its factor (`rope`: starqa.models.rope.frequencies). Both
        # are kept in the prepared file, so starqa.coldstart.firsttoken has these very bits.
        inv_freq, rope_attention = rope if rope is not None else (None, 1.0)
        if inv_freq is None and config.rope.kind != "default":
            raise ValueError(f"RoPE {config.rope.kind}: its frequencies are given "
                             "(starqa.models.rope.frequencies)")
        self.inv_freq = (1.0 / (config.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d)) if inv_freq is None
                         else inv_freq.float()).to(embed.device)
        self.rope_attention = _fp32(rope_attention)
        self.scale = d ** -0.5
        self.native_rows = (native.rows_supported(embed.device, dtype) and d % 2 == 0
                            and d <= 512 and all(t.is_contiguous() for t in self._norms()))
        # each layer's steps around its attention in one compiled call each
        # (starqa/native/_layer.c): where every linear is starqa's int4 tiles; a forward of
        # `layer_rows` rows or more (not rowwise) takes the W8A8 copies instead
        linears = [lin for layer in layers for lin in (layer.qkv, layer.out, layer.gate_up,
                                                       layer.down)]
        self.layer_kernels = self.native_rows and all(
            lin.format == "int4" and lin.scale is None and lin.weight.is_contiguous()
            and (lin.bias is None or lin.bias.is_contiguous()) for lin in linears)
        self.layer_rows = min((lin.w8a8_rows for lin in linears
                               if lin.w8 is not None and lin.w8a8_rows is not None),
                              default=float("inf"))
        # every layer of a forward in one call where the attention offers its words
        # (`forward`'s `compiled`; starqa/native/_step.c): the layers' words, laid out once
        self.step_words = native.step_words([(
            dtype == torch.bfloat16, config.hidden, config.heads, config.kv_heads, d,
            layer.gate_up.weight.shape[0] * 8, float(config.eps), layer.attn_norm,
            layer.qkv.weight, layer.qkv.bias, layer.out.weight, layer.out.bias,
            layer.mlp_norm, layer.gate_up.weight, layer.gate_up.bias, layer.down.weight,
            layer.down.bias) for layer in layers]) if self.layer_kernels else None

    def _norms(self) -> list[torch.Tensor]:
        return [self.norm, *(w for layer in self.layers for w in (layer.attn_norm,
                                                                   layer.mlp_norm))]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def set_rope(self, inv_freq: torch.Tensor, rope_attention: float) -> None:
        """Rotate with these frequencies [D/2] and attention factor from now on: those of
        a context's length, for the RoPE kinds that depend on it (starqa.models.rope)."""
        self.inv_freq = inv_freq.float().to(self.device)
        self.rope_attention = _fp32(rope_attention)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [M, 1, D] in the compute dtype for `positions` [M], times the attention
        factor in fp32 before the rounding (transformers' order)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [M, D/2]
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]
        a = self.rope_attention
        return (emb.cos() * a).to(self.dtype), (emb.sin() * a).to(self.dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                rowwise: bool = False, compiled: Compiled | None = None) -> torch.Tensor:
        """Hidden states [M, H] after the final norm, for token `ids` [M] at `positions` [M].
        rowwise: each row's arithmetic is that of a one-token forward (see `Linear`): for
        checking drafted tokens (starqa.phase2.decode.Batch), not for a question's prefill.
        compiled: the attention as words of starqa/native/_step.c for a forward of M rows (a
        `StepPlan`; None where it has none: `decode.ShardAttention.compiled`): where each
        layer's steps run in one call, every layer of the forward is then one call, the
        same kernels in the same order (the same bits) without the ~20 tensor operations
        and ctypes calls a layer between them."""
        c = self.config
        m = ids.shape[0]
        q_size = c.heads * c.head_dim
        # on the CPU RMSNorm, RoPE and SiLU·mul are starqa's kernels (starqa/native/_rows.c: one
        # call each where torch runs several operators, transformers' roundings; the same
        # bits as starqa.coldstart.firsttoken's forward)
        if self.native_rows:
            norm, rotate, silu_mul = native.rms_norm, native.rope_, native.silu_mul
            cos, sin = native.rope_table(positions, self.inv_freq, self.dtype,
                                         self.rope_attention)
        else:
            norm, rotate, silu_mul = _rms_norm, _rotate, _silu_mul
            cos, sin = self.rope(positions)
        hidden = self.embed[ids]  # [M, H], this forward's own (updated in place when fused)
        fused = self.layer_kernels and (rowwise or m < self.layer_rows)
        plan = None if not fused or compiled is None or self.step_words is None else \
            compiled(m, self.dtype, c.heads, c.kv_heads, c.head_dim)
        if plan is not None:
            native.decode_layers(self.step_words, plan.words, hidden, cos, sin, plan.before,
                                 plan.q_rows, plan.lse)
            return norm(hidden, self.norm, c.eps)
        for index, layer in enumerate(self.layers):
            if fused:  # the same kernels in the same order, one call: the same bits
                qkv = qk = native.layer_before(hidden, layer.attn_norm, c.eps,
                                               (layer.qkv.weight, layer.qkv.bias),
                                               c.heads + c.kv_heads, c.head_dim, cos, sin)
            else:
                x = norm(hidden, layer.attn_norm, c.eps)
                qkv = layer.qkv(x, rowwise).view(m, c.heads + 2 * c.kv_heads, c.head_dim)
                qk = rotate(qkv, c.heads + c.kv_heads, cos, sin)  # RoPE on q and k at once
            q, k = qk[:, :c.heads], qk[:, c.heads:c.heads + c.kv_heads]
            v = qkv[:, c.heads + c.kv_heads:]
            out = attention(index, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                            v.transpose(0, 1)[None])  # [1, Hq, M, D]
            attended = out[0].transpose(0, 1).reshape(m, q_size).to(self.dtype)
            if fused:
                native.layer_after(hidden, attended.contiguous(), (layer.out.weight,
                                   layer.out.bias), layer.mlp_norm, c.eps,
                                   (layer.gate_up.weight, layer.gate_up.bias),
                                   (layer.down.weight, layer.down.bias))
                continue
            hidden = hidden + layer.out(attended, rowwise)
            x = norm(hidden, layer.mlp_norm, c.eps)
            hidden = hidden + layer.down(silu_mul(layer.gate_up(x, rowwise)), rowwise)
        return norm(hidden, self.norm, c.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, vocab] logits for hidden states [M, H]."""
        return self.lm_head(hidden)

    def nbytes(self) -> int:
        linears = [self.lm_head, *(lin for layer in self.layers
                                   for lin in (layer.qkv, layer.out, layer.gate_up, layer.down))]
        return self.embed.nbytes + sum(lin.nbytes() for lin in linears)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every prepared weight by name (what `prepared_cache` saves)."""
        out = {"embed": self.embed, "norm": self.norm, "inv_freq": self.inv_freq.cpu(),
               **self.lm_head.tensors("lm_head")}
        for i, layer in enumerate(self.layers):
            out[f"{i}.attn_norm"], out[f"{i}.mlp_norm"] = layer.attn_norm, layer.mlp_norm
            for name in LINEARS:
                out.update(getattr(layer, name).tensors(f"{i}.{name}"))
        if self.lm_head.weight is self.embed:  # tied and dense: one tensor, stored once
            del out["lm_head.weight"]
        if self.rope_attention != 1.0:  # yarn's and longrope's factor on cos and sin
            out["rope_attention"] = torch.tensor([self.rope_attention], dtype=torch.float32)
        return out

    @classmethod
    def from_tensors(cls, config: DecoderConfig, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype, weights: str,
                     release: Callable[[torch.Tensor], None] | None = None) -> Decoder:
        """The decoder of `Decoder.tensors`' tensors; release: where they are memory-mapped,
        what drops a tensor's pages (`Linear`)."""
        tensors.setdefault("lm_head.weight", tensors["embed"])
        layers = [Layer(attn_norm=tensors[f"{i}.attn_norm"], mlp_norm=tensors[f"{i}.mlp_norm"],
                        **{n: Linear.from_tensors(tensors, f"{i}.{n}", release)
                           for n in LINEARS})
                  for i in range(config.layers)]
        return cls(config, tensors["embed"], layers, tensors["norm"],
                   Linear.from_tensors(tensors, "lm_head"), dtype, weights,
                   (tensors.get("inv_freq"), float(tensors["rope_attention"][0])
                    if "rope_attention" in tensors else 1.0))


def _fp32(value: float) -> float:
    """`value` rounded to fp32: what the kernels take and the prepared file keeps, so a
    decoder built and one mapped from its file rotate alike."""
    return torch.tensor(float(value), dtype=torch.float32).item()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused kernel scales before rounding to the input dtype: bf16 results may
    # differ from transformers' LlamaRMSNorm (and starqa's CPU kernel) by one rounding.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on heads [0, heads) of x [M, H, D] (transformers' rotate_half convention),
    returned as [M, heads, D]: each product and the sum rounded to the dtype."""
    x = x[:, :heads]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
