"""What every part of starqa stands on: its errors, its folders, the progress protocol,
the block plan, safetensors files read by hand, a paused garbage collector, huge pages
asked for before torch is imported (`hugepages.py`); and the defaults the command line's
options, the Python API and the warm groups share (`defaults.py`)."""

from starqa.core.defaults import DEFAULT_KEEPALIVE, MAX_BATCH, MAX_DRAFT_TOKENS

__all__ = ["DEFAULT_KEEPALIVE", "MAX_BATCH", "MAX_DRAFT_TOKENS"]
