"""The defaults every layer shares, kept below everything so that any layer (the CLI's
--help among them) reads them without importing more."""

# Seconds a warm group waits for the next question before it exits (as ollama): `serve`'s and
# the CLI's default, and what a group restarted after a re-ingest keeps when its run file
# does not say. Here, below everything, so that the CLI can show it in --help without
# importing the API. The Python API's `AskOptions` leaves no group by default (keep-alive 0).
DEFAULT_KEEPALIVE = 300.0

# The most tokens Phase 2 drafts per forward that a setting (STARQA_DRAFT_TOKENS) or a warm
# group's request may ask for (`phase2.decode.Batch`); here so the socket protocol checks
# requests without importing torch.
MAX_DRAFT_TOKENS = 16

# Questions a warm group answers together over one context (`phase2.decode.Batch`); more wait
# their turn, first come first served (in the group, and in a door: `api.groups.Turns`).
MAX_BATCH = 16


def default_reserve(window: int) -> int:
    """Tokens `ingest` keeps free for a question and its answer: 512 (a question and a short
    answer), but never more than a quarter of a small window."""
    return min(512, window // 4)
