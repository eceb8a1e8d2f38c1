"""The `starqa` command line: thin commands over the Python API (`starqa.api`), drawn with
rich; `eval` and `bench` run the measurement tools beside it (`starqa.measure`).

The API, and the heavy imports (torch, transformers) inside the engine beneath it, are
imported inside the commands, so `--help` is instant. Every option can also come from a
`STARQA_*` environment variable; the options several commands share are defined once, in
`starqa.cli.options`.

The commands live by what they do: `contexts` (ingest, list, info, rm, cache, index),
`asking` (ask, chat), `serving` (serve, mcp, ps, stop), `measuring` (bench, eval);
`commands.py` registers them, in the order `--help` lists them, and runs the app (`main`):
errors reported as the CLI reports them, with --json as a JSON object too.
"""

from starqa.cli.app import app
from starqa.cli.commands import main, run

__all__ = ["app", "main", "run"]
