"""Python's cyclic garbage collector, paused while a command starts.

Importing torch makes about a million Python objects. The collector runs every 700 new
objects and, every so often, walks all the older ones again, so on this project's 2-core
machine `import torch` takes ~0.75 s with it and ~0.64 s without; and the first full
collection after the import (whatever allocates next: a JSON header, a tokenizer) walks
them all once more, ~60 ms. A cold `ask` waits for both before its first token.

So `cli.run` pauses the collector (`pause`); once the model and the shards are loaded
(`Answerer.from_cache`, the eval runner), `settle` moves every object alive into the
permanent generation (`gc.freeze`: never walked again; those objects live as long as the
process anyway) and turns collection back on for what the process allocates from then on.
Whatever a command does, collection is back on after `BACKSTOP_S` seconds: a pause is for
starting, never for a long run (a warm group answering questions for hours, an ingest).
"""

from __future__ import annotations

import gc
import threading

BACKSTOP_S = 5.0  # collection is on again this long after `pause`, whatever happens

_lock = threading.Lock()
_timer: threading.Timer | None = None  # set while paused


def pause() -> None:
    """Turn the collector off for the start of a command (see the module's docstring);
    a no-op where it is off already (someone else's choice, left alone)."""
    global _timer
    with _lock:
        if _timer is not None or not gc.isenabled():
            return
        gc.disable()
        _timer = threading.Timer(BACKSTOP_S, settle)
        _timer.daemon = True  # never keeps the process alive
        _timer.start()


def settle() -> None:
    """The start is over: freeze what is alive and collect again from now on. Idempotent;
    a no-op where `pause` did not turn the collector off."""
    global _timer
    with _lock:
        if _timer is None:
            return
        _timer.cancel()
        _timer = None
        gc.freeze()
        gc.enable()
