"""The `starqa` command line: thin commands over `starqa.engine`, drawn with rich.

Heavy imports (torch, transformers) happen inside the engine, so `--help` is instant.
Every option can also come from a `STARQA_*` environment variable.
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Ask questions about documents and code too long for ordinary LLM "
                       "inference (Star Attention on torchrun workers).")

# ---------------------------------------------------------------------------------------
# shared options

Model = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="STARQA_MODEL",
    help="Embedded model name (smollm2-135m), a local Hugging Face folder, or a hub id.")]
Workers = Annotated[Optional[int], typer.Option(
    "--workers", "-w", envvar="STARQA_WORKERS", min=1,
    help="torchrun workers (default: all GPUs, else all CPU cores).")]
Nnodes = Annotated[int, typer.Option("--nnodes", envvar="STARQA_NNODES", min=1,
                                     help="torchrun: number of machines.")]
NodeRank = Annotated[int, typer.Option("--node-rank", envvar="STARQA_NODE_RANK", min=0,
                                       help="torchrun: this machine's rank.")]
Rdzv = Annotated[Optional[str], typer.Option(
    "--rdzv-endpoint", envvar="STARQA_RDZV_ENDPOINT",
    help="torchrun: HOST:PORT of node 0, for runs across machines.")]
Device = Annotated[str, typer.Option("--device", envvar="STARQA_DEVICE",
                                     help="auto, cpu or cuda.")]
BeyondWindow = Annotated[bool, typer.Option(
    "--beyond-window", envvar="STARQA_BEYOND_WINDOW",
    help="Go on even when the context is longer than the model's trained window.")]


@app.command()
def ingest(
    paths: Annotated[list[str], typer.Argument(help="Files and folders to pack into one context.")],
    model: Model = None,
    method: Annotated[str, typer.Option(envvar="STARQA_METHOD",
                                        help="star (default) or dense (exact reference).")] = "star",
    block_size: Annotated[Optional[int], typer.Option(
        envvar="STARQA_BLOCK_SIZE", help="Tokens per block (default: a quarter of the context).")] = None,
    anchor_size: Annotated[Optional[int], typer.Option(
        envvar="STARQA_ANCHOR_SIZE", help="star: anchor tokens (default: the block size).")] = None,
    workers: Workers = None,
    name: Annotated[Optional[str], typer.Option(
        envvar="STARQA_NAME", help="Context name (default: the first path's name).")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        envvar="STARQA_DTYPE", help="Compute dtype: bf16 (default), fp16, fp32.")] = None,
    max_file_size: Annotated[int, typer.Option(
        envvar="STARQA_MAX_FILE_SIZE", help="Skip files larger than this many bytes.")] = 1_000_000,
    include: Annotated[Optional[list[str]], typer.Option(
        "--include", "-i", help="Only files matching this glob (repeatable).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", "-x", help="Skip files matching this glob (repeatable).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Re-encode even on a cache hit.")] = False,
    beyond_window: BeyondWindow = False,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    rdzv_endpoint: Rdzv = None,
    device: Device = "auto",
) -> None:
    """Pack files into one context and encode it into cached KV shards (Phase 1)."""
    from starqa import engine
    from starqa.ui import RichUI, ingest_report

    opts = engine.IngestOptions(
        paths=tuple(paths), model=model, method=method, block_size=block_size,
        anchor_size=anchor_size, workers=workers, name=name, dtype=dtype,
        max_file_bytes=max_file_size, include=tuple(include or ()), exclude=tuple(exclude or ()),
        beyond_window=beyond_window, force=force, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint, device=device,
        command="starqa " + shlex.join(sys.argv[1:]))
    with RichUI() as ui:
        result = engine.ingest(opts, ui)
    ingest_report(result)


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question to answer from the context.")],
    context: Annotated[Optional[str], typer.Option(
        "--context", "-c", envvar="STARQA_CONTEXT",
        help="Context name or key (default: the one used last).")] = None,
    model: Model = None,
    workers: Workers = None,
    max_new_tokens: Annotated[int, typer.Option(envvar="STARQA_MAX_NEW_TOKENS",
                                                help="Longest answer in tokens.")] = 256,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    beyond_window: BeyondWindow = False,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    rdzv_endpoint: Rdzv = None,
    device: Device = "auto",
) -> None:
    """Answer a question from a cached context (Phase 2), streaming tokens."""
    from starqa import engine
    from starqa.ui import RichUI, answer_json, answer_stats

    opts = engine.AskOptions(question=question, context=context, model=model, workers=workers,
                             max_new_tokens=max_new_tokens, beyond_window=beyond_window,
                             nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                             device=device)
    with RichUI(stream=not as_json) as ui:
        answer = engine.ask(opts, ui)
    if as_json:
        print(json.dumps(answer_json(answer), indent=1))
    else:
        answer_stats(answer)


def main() -> None:
    from starqa.errors import StarqaError

    try:
        app(standalone_mode=False)
    except StarqaError as err:
        from starqa.ui import print_error

        print_error(err)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; nothing was changed on disk", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except Exception as err:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        if isinstance(err, click.exceptions.Abort):
            sys.exit(130)
        raise
