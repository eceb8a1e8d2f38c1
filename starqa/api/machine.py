"""What this machine brings to every answer besides the cache: starqa's compiled CPU kernels
(built and current, or missing, or stale: `kernels`) and the models, fetched and converted
on first use (`fetch_model`), so that a caller can show either before its own work."""

from __future__ import annotations

from pathlib import Path

from starqa.core.progress import UI
from starqa.native.kernels import KernelStatus


def kernels() -> KernelStatus:
    """Whether the compiled kernels are here and current (`starqa cache` shows it, the
    commands warn where not: the answers are right, only slower); with
    STARQA_REQUIRE_KERNELS=1, a StarqaError with the fix unless they are."""
    from starqa.native import kernels as native

    return native.require()


def fetch_model(spec: str | None, ui: UI = UI()) -> Path:
    """The local folder of model `spec` (`--model`; None: $STARQA_MODEL, else the default
    model), fetched or converted now where this is its first use, the download's progress
    on `ui`."""
    from starqa import models

    return models.resolve_model(spec, ui)
