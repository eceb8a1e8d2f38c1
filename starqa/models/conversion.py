"""GGUF → Hugging Face folder, and installing a converted folder into the model cache.

The one conversion every GGUF goes through (the embedded models' and any local or ollama
GGUF): transformers' GGUF loader dequantises to bf16, `save_pretrained` writes safetensors,
the tokenizer and its chat template. A converted folder is built in a hidden staging folder
and renamed into place whole (`install`), so the cache never holds half a model.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import warnings
from collections.abc import Iterator
from pathlib import Path

from starqa.core.errors import StarqaError

MODEL_INFO = "starqa-model.json"  # written into converted folders: where the weights came from


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """Convert `gguf_dir / gguf_file` (a name ending .gguf: transformers goes by it) into a
    Hugging Face folder `out`: bf16 safetensors, config, tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The GGUF loader draws its own tqdm bar on stderr; swallow it with transformers' chatter.
    with quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        # dequantize=True yields plain bf16 tensors, which save_pretrained accepts.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_file, dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf_file, dequantize=True),
        )
        model.save_pretrained(out)
        tok.save_pretrained(out)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars, log warnings and Python warnings; restore afterwards."""
    from transformers.utils import logging as tlog

    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def readable_by_all(folder: Path) -> None:
    """Files as the umask allows (safetensors writes 0600): a shared cache serves every user."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def install(out: Path, final: Path) -> None:
    """Rename the complete folder `out` to `final`. Another process that converted the same
    model and renamed first wins (its folder is the same model); a stray `final` without a
    config.json is an error naming it."""
    try:
        os.rename(out, final)
    except OSError:
        if not (final / "config.json").is_file():  # not a concurrent converter: a stray folder
            raise StarqaError(f"Cannot install the model into {final}",
                              hint=f"remove that folder (rm -r {shlex.quote(str(final))}) and try "
                                   "again") from None
