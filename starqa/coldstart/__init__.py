"""A cold `ask`'s head start: the worker forked the moment the command starts, and the first
token computed before torch is imported."""
