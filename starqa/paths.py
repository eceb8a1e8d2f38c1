"""Where starqa keeps its cache: models it converted and the ingested contexts."""

import os
from pathlib import Path

from starqa.errors import StarqaError


def home() -> Path:
    """Cache root: `$STARQA_HOME`, else `$XDG_CACHE_HOME/starqa`, else `~/.cache/starqa`.
    A root that is a file (or lies below one) is an error that names the variable."""
    if env := os.environ.get("STARQA_HOME"):
        root, source = Path(env).expanduser(), "STARQA_HOME"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "starqa"
        source = "XDG_CACHE_HOME" if xdg else "the home folder's .cache"
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise StarqaError(f"starqa's cache folder {root} (from {source}) cannot be made: "
                          f"{blocker} is a file, not a folder.",
                          hint="point STARQA_HOME at a folder, e.g. export "
                               "STARQA_HOME=~/.cache/starqa")
    return root


def models_dir() -> Path:
    return home() / "models"


def contexts_dir() -> Path:
    return home() / "contexts"
