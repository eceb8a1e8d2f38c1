"""The torchrun worker and its warm group: the worker's entry point, Phase 1's block loop, the
query host's socket server, and the client the CLI talks to a group with."""

# Seconds a warm group waits for the next question before it exits (as ollama): `serve`'s and
# the CLI's default, and what a group restarted after a re-ingest keeps when its run file
# does not say. The Python API's `AskOptions` leaves no group by default (keep-alive 0).
DEFAULT_KEEPALIVE = 300.0
