"""`Client`: the user API's calls bound to one cache root (`Client(home=...)`), for a program
that keeps contexts apart from the user's own cache, or serves several roots."""

from __future__ import annotations

import functools
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import starqa.api.asking as asking
import starqa.api.catalog as catalog
import starqa.api.groups as groups
from starqa.core import paths


class Client:
    """starqa's calls (`ingest`, `ask`, `stream`, `chat`, `contexts`, `context`, `remove`,
    `warm`, `stop`) on the cache at `home` (None: $STARQA_HOME, else ~/.cache/starqa, as
    read at each call), the warm groups they start included. A chat it opens keeps that root
    for every turn.

        client = Client(home="/data/starqa")
        ctx = client.ingest("./docs")
        print(client.ask("who approved the budget?", ctx).text)
    """

    def __init__(self, home: str | os.PathLike | None = None):
        self.home = None if home is None else Path(home).expanduser().absolute()
        self.ingest = self._bound(catalog.ingest)
        self.contexts = self._bound(catalog.contexts)
        self.context = self._bound(catalog.context)
        self.remove = self._bound(catalog.remove)
        self.ask = self._bound(asking.ask)
        self.stream = self._bound(asking.stream)
        self.warm = self._bound(groups.warm)
        self.stop = self._bound(groups.stop)

    def chat(self, *args, **kwargs) -> _AtHome:
        """An `api.Chat` (the same arguments) on this client's cache root."""
        return _AtHome(self._bound(asking.Chat)(*args, **kwargs), self.home)

    def _bound(self, call: Callable) -> Callable:
        return _at_home(call, self.home)

    def __repr__(self) -> str:
        return f"Client(home={None if self.home is None else str(self.home)!r})"


def _at_home(call: Callable, home) -> Callable:
    @functools.wraps(call)
    def bound(*args, **kwargs):
        with paths.using_home(home) if home is not None else contextlib.nullcontext():
            return call(*args, **kwargs)
    return bound


class _AtHome:
    """An object whose methods run with the cache root `home` (a chat's turns, its stream's
    thread included)."""

    def __init__(self, target: Any, home):
        self._target, self._home = target, home

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        return _at_home(value, self._home) if callable(value) else value

    def __enter__(self) -> _AtHome:
        return self

    def __exit__(self, *exc) -> None:
        _at_home(self._target.close, self._home)()
