"""What every part of starqa stands on: its errors, its folders, the progress protocol,
the block plan, safetensors files read by hand, a paused garbage collector; and the one
default the command line's options, the Python API and the warm groups share."""

# Seconds a warm group waits for the next question before it exits (as ollama): `serve`'s and
# the CLI's default, and what a group restarted after a re-ingest keeps when its run file
# does not say. Here, below everything, so that the CLI can show it in --help without
# importing the API. The Python API's `AskOptions` leaves no group by default (keep-alive 0).
DEFAULT_KEEPALIVE = 300.0

# The most tokens Phase 2 drafts per forward that a setting (STARQA_DRAFT_TOKENS) or a warm
# group's request may ask for (`phase2.decode.generate`); here so the socket protocol checks
# requests without importing torch.
MAX_DRAFT_TOKENS = 16
