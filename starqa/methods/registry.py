"""The registry of Phase 1 methods: each method by name (`get`), the defaults, and the
settings a method's options make (`method_config`). The only place a method's name is
spelled, with the methods' own modules (tests/test_layout.py checks). Pure Python; the
encoders import torch when they run."""

from __future__ import annotations

from starqa.core.errors import StarqaError
from starqa.methods.apb import Apb
from starqa.methods.base import Method
from starqa.methods.config import (OPTIONS, MethodConfig, check_sizes, default_block,
    given_settings)
from starqa.methods.exact import Dense, Ring
from starqa.methods.pulsar import Pulsar
from starqa.methods.star import Star

REGISTRY: dict[str, Method] = {m.name: m for m in (Star(), Dense(), Ring(), Pulsar(), Apb())}
METHODS = tuple(REGISTRY)  # --method's choices
DEFAULT = Star.name  # the paper's method: --method's default, and what bench compares with
REFERENCE = Dense.name  # the exact reference: accuracy ceiling (eval's retention) and oracle


def get(name: str) -> Method:
    """The registry entry of method `name`; an unknown name is the user's error."""
    if name not in REGISTRY:
        raise StarqaError(f"Unknown method {name!r}.", hint=f"choose one of: {', '.join(METHODS)}")
    return REGISTRY[name]


def owners(setting: str) -> tuple[str, ...]:
    """The methods a setting of `given_settings` applies to, in registry order."""
    return tuple(m.name for m in REGISTRY.values() if setting in m.settings)


def help_line() -> str:
    """--method's help: every method with its line."""
    return "; ".join(f"{m.name}{' (default)' * (m.name == DEFAULT)}: {m.help}"
                     for m in REGISTRY.values()) + "."


def method_config(name: str, n_tokens: int, block_size: int | None = None,
                  anchor_size: int | None = None, params: dict | None = None) -> MethodConfig:
    """Settings for `name` on a context of `n_tokens`, with the papers' defaults.

    block = a quarter of the context (capped at 32K) unless given; the rest is the
    method's own (`Method.config`). dense, ring: exact; blocks only split the cache into
    shards (one file per block), and ring's workers each hold a contiguous group of them.
    `params` holds the method-specific settings (`Method.settings`); None means not given.
    A setting given for another method is an error.
    """
    method = get(name)
    check_sizes(block_size, anchor_size)
    for key in given_settings(anchor_size, params):
        if name not in owners(key):
            raise StarqaError(f"{OPTIONS.get(key, key)} only applies to --method "
                              f"{' or '.join(owners(key))}.")
    return method.config(block_size or default_block(n_tokens), anchor_size, params or {})
