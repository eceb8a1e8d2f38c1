"""A model folder loaded: the model (transformers), its tokenizer (fast, without
transformers where the folder allows), the tokens that end a turn and the trained window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TYPE_CHECKING

from starqa.core.errors import StarqaError
from starqa.models.conversion import quiet_transformers as _quiet_transformers

if TYPE_CHECKING:
    import torch


def load_tokenizer(path: Path) -> Any:
    """transformers' AutoTokenizer for the model folder `path` (its warnings quiet)."""
    from transformers import AutoTokenizer

    with _quiet_transformers():
        return AutoTokenizer.from_pretrained(path)


def load_model(path: Path, *, dtype: torch.dtype, device: Any = "cpu",
               attn_implementation: str = "sdpa", rope_length: int | None = None) -> Any:
    """Causal LM from `path` on `device`, in eval mode with gradients off. rope_length: the
    context's length (the position its question starts at), for a RoPE whose frequencies
    depend on it (dynamic, longrope): they are pinned to that length's, so every forward
    over part of the context rotates as one over the whole does (starqa.models.rope)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from starqa.models.rope import pin

    with _quiet_transformers():
        config = AutoConfig.from_pretrained(path) if rope_length is not None else None
        pinned = {"config": config} if config is not None and pin(config, rope_length) else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, **pinned
        )
    return model.to(device).eval().requires_grad_(False)


def stop_ids(tokenizer, model_path: Path) -> set[int]:
    """Token ids that end an answer: EOS of the tokenizer and of the generation config, and
    the end-of-turn tokens of common chat templates. `tokenizer` is a transformers one or a
    plain `tokenizers.Tokenizer` (`load_fast_tokenizer`); no transformers import here."""
    def token_id(name: str) -> int | None:
        if hasattr(tokenizer, "token_to_id"):
            return tokenizer.token_to_id(name)
        found = tokenizer.convert_tokens_to_ids(name)
        return found if isinstance(found, int) and found != tokenizer.unk_token_id else None

    stop = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None and (name := json_field(model_path / "tokenizer_config.json", "eos_token")):
        eos = token_id(name["content"] if isinstance(name, dict) else name)
    stop.update([eos] if eos is not None else [])
    generation = json_field(model_path / "generation_config.json", "eos_token_id")
    stop.update(generation if isinstance(generation, list) else
                [generation] if isinstance(generation, int) else [])
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"):
        if (token := token_id(name)) is not None:
            stop.add(token)
    return stop


def json_field(path: Path, field: str) -> Any:
    """`field` of the JSON object in `path`; None where the file is missing, not JSON or
    not an object."""
    try:
        return json.loads(Path(path).read_text()).get(field)
    except (OSError, ValueError, AttributeError):
        return None


def load_fast_tokenizer(path: Path) -> Any:
    """The model's `tokenizer.json` with the plain `tokenizers` library (a fraction of a
    second, against seconds for transformers' AutoTokenizer), wrapped to encode and decode
    as transformers does with add_special_tokens=False; None when the folder has none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return FastTokenizer(Tokenizer.from_file(str(file)))


class FastTokenizer:
    """A plain `tokenizers.Tokenizer` with the calls starqa makes of transformers' (encode
    without special tokens, decode, token_to_id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


def context_window(config: Any) -> int:
    """The window a model runs at: `max_position_embeddings` of its text config, or the
    window its RoPE scaling extends it to where the config declares one (yarn factor 4
    over 32768: 131072; starqa.models.rope.Rope.scaled_window); a config without one is
    an error."""
    from starqa.models.rope import Rope

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(window, int):
        raise StarqaError("The model config has no max_position_embeddings",
                          hint="starqa needs the model's context window to size blocks")
    try:
        return max(window, Rope.read(text_config.to_dict()).scaled_window)
    except (ValueError, TypeError, AttributeError):  # a RoPE starqa does not run: Phase 2 says
        return window
