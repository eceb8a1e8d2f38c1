"""RoPE scaling as a model's config declares it: which kind, the window it scales the model
to, and the one rule starqa applies to the kinds whose frequencies depend on the length.

The kinds (transformers' `rope_type`), each rotating a key pair j at position p by the
angle p · inv_freq_j, cos and sin then multiplied by an attention factor:

    default   inv_freq_j = theta^(-2j/D)
    linear    inv_freq / factor: position interpolation (Chen et al. 2023)
    dynamic   theta grown with the sequence's length past the window: NTK-aware scaling
              (bloc97 and emozilla, 2023)
    yarn      NTK-by-parts frequencies, and an attention factor (mscale) on cos and sin
              (YaRN: Peng et al. 2023)
    llama3    low frequencies divided by the factor, high ones kept, a ramp between
              (Llama 3.1's rope scaling, Meta 2024)
    longrope  a factor per frequency, a short set up to the original window and a long set
              past it, and an attention factor (LongRoPE: Ding et al. 2024)

The frequencies and the attention factor are transformers' own
(`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`), computed where torch is loaded
(`frequencies`); reading a config (`Rope.read`) needs neither, for the launcher and the
cold first token (starqa.coldstart.firsttoken).

The rule for the kinds whose frequencies depend on the length (dynamic, longrope):
transformers computes them from each forward's largest position, so blocks encoded one
forward each would be rotated with a set per block. starqa fixes one set per context: that
of transformers' forward over the whole context, whose length L is the position its
question starts at (`Manifest.query_position`). Phase 1's blocks, and Phase 2's question
and answer after them, are rotated with that one set. `Rope.pinned(L)` states the rule as
RoPE parameters that no longer depend on the length (dynamic: plain RoPE with the grown
theta; longrope: the chosen set as both), and every path computes from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
VARYING = ("dynamic", "longrope")  # the kinds whose frequencies depend on the length


def rope_parameters(config: dict) -> dict:
    """The RoPE parameters of a config.json's dict: `rope_parameters` (transformers 5) or
    `rope_scaling` (older configs), `rope_type` named (older configs say `type`) and
    `rope_theta` filled in from the config's own (default 10000)."""
    found = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = found.pop("type", None)
    found.setdefault("rope_type", kind or "default")
    found.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return found


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class Rope:
    """A model's RoPE: its kind, the window its config declares (`max_position_embeddings`),
    its head size and its parameters (sorted (name, value) pairs, lists as tuples)."""

    kind: str = "default"
    window: int = 0
    head_dim: int = 0
    items: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def read(cls, config: dict) -> Rope:
        """The RoPE of a config.json's dict (a text config: a multimodal model's
        `text_config`). A kind starqa does not know is a ValueError."""
        parameters = rope_parameters(config)
        kind = parameters["rope_type"]
        if kind not in KINDS:
            raise ValueError(f"RoPE {kind!r} (starqa knows {', '.join(KINDS)})")
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
        return cls(kind, int(config.get("max_position_embeddings") or 0), int(head_dim),
                   tuple(sorted((k, _frozen(v)) for k, v in parameters.items())))

    @classmethod
    def of(cls, folder: Any) -> Rope:
        """The RoPE of the model folder's config.json (its text config where it has one)."""
        import json
        from pathlib import Path

        config = json.loads((Path(folder) / "config.json").read_text())
        return cls.read(config.get("text_config") or config)

    @property
    def parameters(self) -> dict:
        """The parameters as the config names them (lists as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.items}

    @property
    def original(self) -> int:
        """The window the model was pretrained for: `original_max_position_embeddings`
        where declared, else the config's window."""
        return int(self.parameters.get("original_max_position_embeddings") or self.window)

    @property
    def scaled_window(self) -> int:
        """The window the scaling extends the model to: the original window times the
        factor (yarn factor 4 over 32768 → 131072), never less than the declared window
        (Llama 3.1 declares 131072 itself). linear and dynamic scale the declared window
        where no original one is given; a factor left out (yarn, longrope: the declared
        window over the original) leaves the declared window."""
        factor = self.parameters.get("factor")
        if self.kind == "default" or not factor:
            return self.window
        return max(self.window, int(round(self.original * float(factor))))

    def key(self, length: int) -> str | None:
        """What the frequencies depend on, besides the model, for a context of `length`
        positions: None where they are the ones the config gives at load (every kind but
        dynamic past its window and longrope past its original window), else a name for
        the set (dynamic: the length; longrope: "long")."""
        if self.kind == "dynamic" and length > self.window:
            return f"dynamic:{length}"
        if self.kind == "longrope" and length > self.original:
            return "longrope:long"
        return None

    def pinned(self, length: int | None = None) -> dict:
        """RoPE parameters whose frequencies no longer depend on the length, equal to these
        for a context of `length` positions (None: as at load), the module's rule:
        dynamic is plain RoPE with transformers' grown theta
        theta · (factor · L / window - (factor - 1))^(D / (D - 2)) for L past the window;
        longrope takes the short or the long set as both. Other kinds as they are."""
        parameters = self.parameters
        length = 0 if length is None else length
        if self.kind == "dynamic":
            theta, factor, d = parameters["rope_theta"], parameters["factor"], self.head_dim
            grown = max(length, self.window)
            theta = theta * ((factor * grown / self.window) - (factor - 1)) ** (d / (d - 2))
            return {"rope_type": "default", "rope_theta": theta}
        if self.kind == "longrope":
            chosen = parameters["long_factor" if length > self.original else "short_factor"]
            return {**parameters, "long_factor": list(chosen), "short_factor": list(chosen)}
        return parameters


def yarn(config: dict, factor: float, original: int | None = None) -> dict:
    """A config.json's dict with YaRN declared (Peng et al. 2023): `factor` times the
    original window (default: its declared window), the window declared as the scaled one.
    For a model whose config declares no scaling; transformers' defaults for the rest
    (beta_fast 32, beta_slow 1, attention factor 0.1 · ln(factor) + 1)."""
    current = rope_parameters(config)
    if current["rope_type"] != "default":
        raise ValueError(f"the config declares RoPE {current['rope_type']!r} already")
    original = int(original or config["max_position_embeddings"])
    scaled = {"rope_type": "yarn", "rope_theta": current["rope_theta"], "factor": float(factor),
              "original_max_position_embeddings": original}
    out = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
    return {**out, "rope_parameters": scaled,
            "max_position_embeddings": max(int(config["max_position_embeddings"]),
                                           int(round(original * float(factor))))}


def frequencies(config: Any, length: int | None = None) -> tuple[Any, float]:
    """inv_freq [D/2] (fp32 torch tensor) and the attention factor that multiplies cos and
    sin, for a transformers config (its text config taken) and a context of `length`
    positions (None: as at load), by the module's rule: transformers' own functions over
    the `pinned` parameters. Plain RoPE as transformers' Llama computes it."""
    import copy

    import torch

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = Rope.read(text.to_dict())
    parameters = rope.pinned(length)
    if parameters["rope_type"] == "default":
        d = rope.head_dim
        theta = parameters["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pinned = copy.deepcopy(text)
    pinned.rope_parameters = parameters
    inv_freq, attention = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](pinned, None)
    return inv_freq.float(), float(attention)


def pin(config: Any, length: int | None) -> bool:
    """Set a transformers config's RoPE to the `pinned` parameters for a context of
    `length` positions, so transformers' own forward over any part of the context rotates
    with the one set the rule gives (Phase 1's blocks). Returns whether it changed."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = Rope.read(text.to_dict())
    if rope.kind not in VARYING or length is None:
        return False
    text.rope_parameters = rope.pinned(length)
    return True

