"""Processes: torchrun's environment and collectives (`dist`), spawning workers and following
them (`launch`)."""
