"""The commands that answer: `ask` (one question) and `chat` (a conversation, drawn by
`starqa.cli.repl`)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from starqa.core import DEFAULT_KEEPALIVE  # a constant: nothing imported
from starqa.cli.options import (Attention, BeyondWindow, ContextArg, Device, IndexKind, KeepAlive,
    KvOnDisk, MaxNewTokens, Model, Nnodes, NodeRank, Rdzv, TopKChoice, TopKOpt, TopKPrefill,
    TopKSchedule, TopKTail, Weights, Workers, one_topk)


def ask(
    question: Annotated[Optional[str], typer.Argument(
        help="The question to answer from the context.")] = None,
    questions: Annotated[Optional[str], typer.Option(
        "--questions", "-q", metavar="FILE",
        help="Answer the questions of FILE, one a line (- reads them from standard input), "
             "together on the context's warm group, each printed with its sources.")] = None,
    context: Annotated[Optional[str], typer.Option(
        "--context", "-c", envvar="STARQA_CONTEXT",
        help="Context name or key (default: the one used last).")] = None,
    model: Model = None,
    workers: Workers = None,
    max_new_tokens: MaxNewTokens = 256,
    as_json: Annotated[bool, typer.Option(
        "--json", envvar="STARQA_JSON",
        help="Print the answer's record as one JSON object (the Python API's "
             "Answer.as_dict()).")] = False,
    cold: Annotated[bool, typer.Option(
        "--cold", envvar="STARQA_COLD",
        help="Start workers even when a warm group serves the context.")] = False,
    beyond_window: BeyondWindow = False,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    rdzv_endpoint: Rdzv = None,
    device: Device = "auto",
    weights: Weights = None,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    attention: Attention = "exact",
    top_k: TopKOpt = None,
    top_k_schedule: TopKSchedule = None,
    index: IndexKind = None,
    kv_on_disk: KvOnDisk = False,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
) -> None:
    """Answer a question from a cached context (Phase 2), streaming tokens.

    A cold ask answers as one worker when model and shards fit in memory (a process forked
    as the command started), which then stays for --keep-alive seconds as the context's
    warm group, so the next question needs no load. With --questions, the questions of a
    file are answered together by the context's warm group (one batch)."""
    from starqa.api import doors
    from starqa.cli.ui import RichUI, answer_stats, as_text

    if (question is None) == (questions is None):
        raise typer.BadParameter(
            "give one question, or --questions FILE (one a line), not both"
            if question is not None else "give the question to answer, or --questions FILE",
            param_hint="QUESTION")
    if questions is not None:
        topk = one_topk(TopKChoice(attention, top_k, top_k_schedule, index, kv_on_disk,
                                   top_k_prefill, top_k_tail))
        _ask_all(questions, context, max_new_tokens, workers, keepalive, topk, as_json)
        return

    opts = doors.AskOptions(question=as_text(question), context=context, model=model,
                          workers=workers,
                          max_new_tokens=max_new_tokens, beyond_window=beyond_window,
                          nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                          device=device, warm=not cold, weights=weights,
                          keepalive=keepalive,
                          topk=one_topk(TopKChoice(attention, top_k, top_k_schedule, index,
                                                   kv_on_disk, top_k_prefill, top_k_tail)))
    with RichUI(stream=not as_json) as ui:
        answer = doors.ask_with(opts, ui)
    if as_json:
        print(json.dumps(answer.as_dict(), indent=1))
    else:
        answer_stats(answer)


def _ask_all(source: str, context: str | None, max_new_tokens: int, workers: int | None,
             keepalive: float, topk, as_json: bool) -> None:
    """`ask --questions FILE`: every question of FILE asked at once, each answer printed
    in their order as it completes (one JSON object a line with --json)."""
    import sys
    from pathlib import Path

    from starqa import api
    from starqa.cli.ui import answer_stats, as_text, err, safe

    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise api.StarqaError(f"Cannot read the questions from {source} ({error}).",
                              hint="give a UTF-8 text file, one question a line") from None
    asked = [as_text(line.strip()) for line in text.splitlines() if line.strip()]
    if not asked:
        raise api.StarqaError(f"{source} holds no question.",
                              hint="write one question a line")
    streams = api.ask_all(asked, context, max_new_tokens=max_new_tokens, attention=topk,
                          workers=workers, keepalive=keepalive)
    try:
        for number, (question, stream) in enumerate(zip(asked, streams), 1):
            answer = stream.result()
            if as_json:
                print(json.dumps({"question": question, **answer.as_dict()}), flush=True)
                continue
            err.print(f"[bold]{number}. {safe(question)}[/]")
            print(answer.text, flush=True)
            answer_stats(answer)
    finally:
        if keepalive <= 0:  # --keep-alive 0: no group is left
            api.stop(context)


def chat(
    context: ContextArg = None,
    workers: Workers = None,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    max_new_tokens: MaxNewTokens = 256,
    attention: Attention = "exact",
    top_k: TopKOpt = None,
    top_k_schedule: TopKSchedule = None,
    index: IndexKind = None,
    kv_on_disk: KvOnDisk = False,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
) -> None:
    """Interactive questions over a cached context, with warm workers."""
    from starqa.cli.repl import Repl

    code = Repl(context, workers, keepalive, max_new_tokens,
                one_topk(TopKChoice(attention, top_k, top_k_schedule, index, kv_on_disk,
                                    top_k_prefill, top_k_tail))).run()
    if code:  # a question or command of a script failed (each said why as it did)
        raise typer.Exit(code)
