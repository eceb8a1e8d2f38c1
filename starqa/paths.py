"""Where starqa keeps its cache: models it converted and the ingested contexts."""

import os
from pathlib import Path


def home() -> Path:
    """Cache root: `$STARQA_HOME`, else `$XDG_CACHE_HOME/starqa`, else `~/.cache/starqa`."""
    if env := os.environ.get("STARQA_HOME"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "starqa"


def models_dir() -> Path:
    return home() / "models"


def contexts_dir() -> Path:
    return home() / "contexts"
