"""The torchrun worker and its warm group: the worker's entry point, Phase 1's block loop, the
query host's socket server, and the client the API talks to a group with."""
