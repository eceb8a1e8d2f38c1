"""A Phase 2 decoder loaded from a model folder (`load_decoder`), and its prepared weights:
the quantised layers built once, written beside the model (`prepare_weights`, which
`ingest` runs as it ends) and mapped by every later load (`starqa.models.prepared` says
what they hold, without torch)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from starqa.native import ops as native
from starqa.core.errors import StarqaError
from starqa.models.devices import WEIGHT_FORMATS
from starqa.models.identity import weight_files
from starqa.models.prepared import DecoderConfig, prepared_file, prepared_stamp
from starqa.models.decoder import Decoder, Layer
from starqa.models.linear import Linear


def load_decoder(folder: Path, dtype: torch.dtype, weights: str = "dense",
                 device: torch.device | str = "cpu", length: int | None = None) -> Decoder:
    """The model in `folder` for Phase 2, with its linear layers in `weights` format, its
    RoPE that of a context of `length` positions (the position its question starts at;
    None: as the config gives it at load), by starqa.models.rope's rule.

    Quantised weights are prepared once and kept next to the model, in
    `.starqa-phase2-<weights>-<dtype>.safetensors` (keyed by the weights' hash, the torch
    version, whose packed int4 layout may change, and for int4 whose layout it holds), so
    later loads only map them; `ingest` prepares them as it ends (`prepare_weights`), so the
    first `ask` finds them. A load that finds none builds them (waiting for a process that
    is building them already); a folder starqa may not write to is quantised at every load
    instead."""
    _check_format(weights)
    config = DecoderConfig.read(folder)
    decoder = _load(folder, config, dtype, weights, device)
    if length is not None and config.rope.key(length) is not None:
        decoder.set_rope(*_frequencies(folder, length))
    return decoder


def _load(folder: Path, config: DecoderConfig, dtype: torch.dtype, weights: str,
          device: torch.device | str) -> Decoder:
    if weights == "dense" or torch.device(device).type != "cpu":
        return _build(folder, config, dtype, weights, device)
    target = _Prepared.of(folder, weights, dtype)
    if (decoder := target.load(config, dtype, weights)) is not None:
        return decoder
    with target.lock():
        if (decoder := target.load(config, dtype, weights)) is not None:
            return decoder  # another process built it while this one waited
        decoder = _build(folder, config, dtype, weights, device)
        target.save(decoder)
    return decoder


def _frequencies(folder: Path, length: int | None) -> tuple[torch.Tensor, float]:
    """The RoPE frequencies and attention factor of the model in `folder` for a context of
    `length` positions (starqa.models.rope.frequencies, over transformers' own config)."""
    from transformers import AutoConfig

    from starqa.models.conversion import quiet_transformers
    from starqa.models.rope import frequencies

    with quiet_transformers():
        return frequencies(AutoConfig.from_pretrained(folder), length)


def prepare_weights(folder: Path, dtype: torch.dtype, weights: str,
                    on_build: Callable[[], contextlib.AbstractContextManager] | None = None
                    ) -> bool:
    """Write the model's prepared weights for `weights` and `dtype` beside it, unless
    current ones are there already: what `ingest` runs as it ends, so that the first `ask`
    maps them instead of building them before its answer. `on_build()`: a context shown
    while they are built (the caller's progress status). Returns whether they were built.
    Dense weights (nothing to prepare) and an architecture Phase 2 does not run return
    False (ask says why); a folder starqa may not write to, False too (ask quantises)."""
    _check_format(weights)
    if weights == "dense":
        return False
    try:
        config = DecoderConfig.read(folder)
    except StarqaError:
        return False
    target = _Prepared.of(folder, weights, dtype)
    if target.load(config, dtype, weights) is not None:
        return False
    with target.lock():
        if target.load(config, dtype, weights) is not None:
            return False  # a concurrent ingest or ask built them while this one waited
        with on_build() if on_build is not None else contextlib.nullcontext():
            return target.save(_build(folder, config, dtype, weights, "cpu"))


def _check_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise StarqaError(f"Unknown weight format {weights!r}.",
                          hint=f"choose one of: {', '.join(WEIGHT_FORMATS)}")


@dataclass(frozen=True)
class _Prepared:
    """One prepared weights file: where it lives and the stamp its metadata must carry.

    Written whole or not at all: into a staging file beside it (`<name>.<random>.tmp`),
    then renamed over it, so a reader maps the old file or the whole new one, and a crash
    leaves only a staging file, never used, removed by the next build. Builders take the
    file's lock (`<name>.lock`, an exclusive `flock`), so two processes that find none
    build it once: the second waits, then maps the first one's."""

    path: Path
    stamp: dict

    @classmethod
    def of(cls, folder: Path, weights: str, dtype: torch.dtype) -> _Prepared:
        return cls(prepared_file(folder, weights, str(dtype).removeprefix("torch.")),
                   prepared_stamp(folder, weights, torch.__version__, native.int4_fast()))

    def load(self, config: DecoderConfig, dtype: torch.dtype, weights: str) -> Decoder | None:
        """The decoder of the file when it is there, whole and current; else None."""
        from starqa.core import tensorfile
        from starqa.core.errors import ShardError

        try:
            # Memory-mapped, not read: the file keeps every tensor 64-byte aligned (what the
            # packed kernels want), so nothing is copied, a page is read only when used (a
            # question's prefill reads the int8 copies, decode the int4 weights) and every
            # process on the machine shares one copy in the page cache. Reading Qwen2.5-
            # Coder-1.5B's 2.7 GB took 2 s of a cold ask; mapping it takes milliseconds.
            if tensorfile.header(self.path)[1].get("__metadata__") == self.stamp:
                tensors, _, mapped = tensorfile.map_file(self.path)
                return Decoder.from_tensors(config, tensors, dtype, weights, mapped.release)
        except (OSError, ValueError, KeyError, RuntimeError, ShardError):  # absent, damaged
            pass
        return None

    @contextlib.contextmanager
    def lock(self):
        """Hold the builders' lock (none where the folder is read-only: nothing is written
        there, so there is nothing to race on); staging files a crash left are removed."""
        try:
            handle = open(self.path.with_suffix(".lock"), "a")
        except OSError:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                for leftover in self.path.parent.glob(f"{self.path.stem}.*.tmp"):
                    leftover.unlink(missing_ok=True)
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def save(self, decoder: Decoder) -> bool:
        """Write `decoder`'s tensors as this file (staged, then renamed in). Returns whether
        it was written (False: a folder starqa may not write to)."""
        from starqa.core import tensorfile

        try:
            fd, tmp = tempfile.mkstemp(prefix=f"{self.path.stem}.", suffix=".tmp",
                                       dir=self.path.parent)
        except OSError:  # read-only model folder: quantise again next time
            return False
        os.close(fd)
        try:
            tensorfile.save_aligned(decoder.tensors(), Path(tmp), self.stamp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except OSError:  # a full disk: the next load builds again
            return False
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True


def _build(folder: Path, config: DecoderConfig, dtype: torch.dtype, weights: str,
           device: torch.device | str) -> Decoder:
    """The decoder from the model's own safetensors, quantising as `weights` says."""
    from safetensors import safe_open


    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise StarqaError(f"{folder} has no weight {name}.", hint="is it a complete model?")
        return tensors.pop(name).to(device)

    def maybe(name: str) -> torch.Tensor | None:
        return tensors.pop(name).to(device) if name in tensors else None

    def linear(names: list[str]) -> Linear:
        weight = torch.cat([get(n + ".weight") for n in names])
        biases = [maybe(n + ".bias") for n in names]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return Linear.quantize(weight, bias, weights, dtype)

    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        layers.append(Layer(
            attn_norm=get(p + "input_layernorm.weight").to(dtype),
            qkv=linear([p + f"self_attn.{x}_proj" for x in "qkv"]),
            out=linear([p + "self_attn.o_proj"]),
            mlp_norm=get(p + "post_attention_layernorm.weight").to(dtype),
            gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"]),
            down=linear([p + "mlp.down_proj"])))
    embed = get("model.embed_tokens.weight").to(dtype)
    head = embed if config.tied else get("lm_head.weight")
    # plain RoPE is the decoder's own; a scaled one's as the config gives it at load
    rope = None if config.rope.kind == "default" else _frequencies(folder, None)
    return Decoder(config, embed, layers, get("model.norm.weight").to(dtype),
                   Linear.quantize(head, None, weights, dtype, rows=False), dtype, weights,
                   rope)
