"""`SPEC+yarnN`: the model SPEC names, with YaRN declared at factor N (Peng et al. 2023), a
window N times its own. starqa.models.rope's `yarn` writes the config; the folder holds
links to the model's files beside it, under $STARQA_HOME/models, made once and renamed in
whole. Every path then runs the scaled model as it runs any config that declares YaRN
(docs/models.md, "RoPE scaling"), and a context records the spec as given, so `ask` finds
(or makes again) the same folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from pathlib import Path

from starqa.core import paths
from starqa.core.errors import StarqaError
from starqa.models.conversion import MODEL_INFO, install
from starqa.models.identity import fingerprint

SUFFIX = re.compile(r"^(?P<base>.+)\+yarn(?P<factor>[0-9]+)$")
FACTORS = range(2, 33)  # a factor of 1 scales nothing; past 32, no model was measured


def split(spec: str) -> tuple[str, int | None]:
    """(the base spec, the YaRN factor) of `spec`: ("qwen2.5-coder-1.5b", 4) for
    "qwen2.5-coder-1.5b+yarn4"; (spec, None) where it names no factor, or names a file or
    folder that is there. A factor outside FACTORS is an error."""
    found = SUFFIX.match(spec)
    if not found or Path(spec).expanduser().exists():
        return spec, None
    base, factor = found["base"], int(found["factor"])
    if factor not in FACTORS:
        raise StarqaError(f"{spec!r} asks for YaRN factor {factor}; starqa scales by "
                          f"{FACTORS.start} to {FACTORS.stop - 1}.",
                          hint=f"--model {shlex.quote(base)}+yarn4 (a window 4 times its own)")
    return base, factor


def with_yarn(spec: str, factor: int) -> str:
    """The spec of `spec`'s model with YaRN at `factor`."""
    return f"{spec}+yarn{factor}"


def ensure(base: Path, factor: int) -> Path:
    """The folder of the model in `base` with YaRN at `factor`, made on first use: its
    config with YaRN declared, MODEL_INFO naming it after the model (`name+yarnN`), every
    other file of the model linked (hard links where the file system allows, else
    symbolic). starqa's own files beside the model (prepared weights) are left out: they
    hold the plain RoPE."""
    from starqa.models.rope import rope_parameters, yarn

    found = fingerprint(base)
    name = with_yarn(found["name"], factor)
    final = paths.models_dir() / "scaled" / f"{found['digest'][:16]}-yarn{factor}"
    if (final / "config.json").is_file() and _links_hold(final):
        return final
    config = json.loads((base / "config.json").read_text())
    text = config.get("text_config") or config
    declared = rope_parameters(text)["rope_type"]
    if declared != "default":
        raise StarqaError(f"{name} declares RoPE {declared!r} already: YaRN is for a model "
                          "with plain RoPE.",
                          hint=f"leave +yarn{factor} out: the model runs its own scaling")
    scaled = yarn(text, float(factor))
    config = {**config, "text_config": scaled} if "text_config" in config else scaled
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{final.name}-", dir=final.parent) as tmp:
        out = Path(tmp) / "model"
        out.mkdir()
        for file in sorted(base.iterdir()):
            if file.is_file() and not file.name.startswith(".") and \
                    file.name not in ("config.json", MODEL_INFO):
                _link(file.resolve(), out / file.name)
        info = json.loads((base / MODEL_INFO).read_text()) if (base / MODEL_INFO).is_file() \
            else {}
        (out / MODEL_INFO).write_text(json.dumps({**info, "name": name, "yarn": factor,
                                                  "base": str(base)}, indent=2) + "\n")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if final.exists():  # a link that no longer holds (the base was fetched again)
            _remove(final)
        install(out, final)
    return final


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        target.symlink_to(source)


def _links_hold(folder: Path) -> bool:
    """Whether every file of `folder` can be read (a symbolic link's model still there)."""
    return all(f.exists() for f in folder.iterdir())


def _remove(folder: Path) -> None:
    for file in folder.iterdir():
        file.unlink()
    folder.rmdir()
