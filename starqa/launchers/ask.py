"""Phase 2's launcher, `starqa ask`: a cached context and a question → query tokens → an
answer from a warm group (over its socket), from this process (a world of one, when model
and shards fit in memory) or from a torchrun group. Every path answers through
`starqa.phase2.answering.Answerer`; what they share is in `starqa.launchers.answer`, and
`serve` (a group kept warm for later questions) in `starqa.launchers.serve`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from starqa.cache import hosts, store
from starqa.cache.manifest import Manifest
from starqa.core import paths
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.launchers.answer import (Answer, LocalAnswerer, Question, checked_model,
    question_ids, with_indexes)
from starqa.phase2.placement import phase2_workers
from starqa.runtime.launch import Launch, PerRank, launch_of, run_workers
from starqa.runtime.protocol import Done, Event, ThenServe, Token
from starqa.topk.indexes import TopK
from starqa.workers.runfile import RunInfo


@dataclass(frozen=True)
class AskOptions:
    question: str
    context: str | None = None
    model: str | None = None
    workers: int | None = None
    max_new_tokens: int = 256
    beyond_window: bool = False
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    device: str = "auto"
    warm: bool = True  # use a running `starqa serve` group for the context when there is one
    weights: str | None = None  # Phase 2 weight format (models.WEIGHT_FORMATS); None: default
    keepalive: float = 0.0  # a cold ask leaves a warm group this long; 0: none; < 0: one
    # that never exits on its own (the CLI's default: starqa.core.DEFAULT_KEEPALIVE)
    topk: TopK | None = None  # top-k attention (starqa.topk.indexes.topk_settings); None: exact


@dataclass(frozen=True)
class TokenAskOptions:
    """`ask_tokens`' settings. stop=False generates exactly `max_new_tokens` (an
    end-of-turn token does not end it); measure: the workers report time and bytes
    communicated (Answer.measures); allow_over_window as in `ingest_tokens`."""

    workers: int | None = None
    max_new_tokens: int = 16
    stop: bool = True
    measure: bool = False
    allow_over_window: bool = False
    device: str = "auto"
    weights: str | None = None  # Phase 2 weight format; None: the default
    topk: TopK | None = None  # top-k attention; None: exact


def ask(opts: AskOptions, ui: UI = UI(), head=None) -> Answer:
    """Answer `opts.question` about a cached context: on its warm group if one runs, else
    on a world of one (`head`, a `starqa.coldstart.headstart.HeadStart`: the process the command
    forked as it started, when it has one; else this process) or on torchrun's workers.
    `head` is this call's to run or let go."""
    try:
        return _ask(opts, ui, head)
    finally:
        if head is not None:  # not taken (or done): its child exits, unless it serves on
            head.close()


def _ask(opts: AskOptions, ui: UI, head) -> Answer:
    started = time.perf_counter()
    manifest = _checked_request(opts)
    if (group := _warm_group(opts, manifest)) is not None:
        from starqa.workers import client

        head = _let_go(head)  # the group answers: no torch in this command
        try:
            return _ask_warm(opts, manifest, group, ui, started)
        except client.Unreachable:  # it died without cleaning up: answer cold
            client.forget(group)
        except _GroupLeft:  # it was exiting (stopped, idle) as it was asked: answer cold
            pass
    question, workers, why = _question(opts, manifest, ui, started)
    if not (workers == 1 and opts.nnodes == 1):
        head = _let_go(head)  # a torchrun group answers
    keep = opts.keepalive != 0 and opts.warm and opts.nnodes == 1  # leave a warm group
    if head is not None:  # a world of one forked as the command started (coldstart.headstart)
        ui.waiting(f"Loading model and shards ({why})")
        then = ThenServe(opts.keepalive, opts.workers, opts.weights,
                         opts.topk.as_dict() if opts.topk else None) if keep else None
        answer = _answer(question, launch_of(opts, 1), ui, head=head, then_serve=then)
    elif workers == 1 and opts.nnodes == 1:
        answer = _answer_here(question, opts.device, why, ui)
    else:
        answer = _answer(question, launch_of(opts, workers), ui)
    if keep and not (head is not None and head.serving):
        from starqa.workers import client

        # The next question finds this context warm: a group starts in the background
        # (a second one for the same context refuses to start, see `serve`); the head
        # start, where one answered, went on as that group itself.
        client.spawn(manifest.key, opts.workers, opts.keepalive, opts.weights,
                     opts.topk.cli_args() if opts.topk else ())
    return answer


def _checked_request(opts: AskOptions) -> Manifest:
    """The context asked about, once the request is one that can be answered."""
    if not opts.question.strip():
        raise StarqaError("The question is empty.")
    if opts.max_new_tokens < 1:
        raise StarqaError(f"--max-new-tokens must be at least 1 (got {opts.max_new_tokens}).")
    manifest = store.find_context(paths.contexts_dir(), opts.context)
    if opts.beyond_window and opts.max_new_tokens > manifest.model.window:
        # without --beyond-window the room check says it; the answer's buffers are this long
        raise StarqaError(f"--max-new-tokens {opts.max_new_tokens:,} is longer than the model's "
                          f"whole window ({manifest.model.window:,} tokens).",
                          hint=f"ask with --max-new-tokens {manifest.model.window} or lower")
    return manifest


def _warm_group(opts: AskOptions, manifest: Manifest) -> RunInfo | None:
    """The run info of a warm group that answers this ask as asked, if one runs here."""
    if not (opts.warm and opts.nnodes == 1 and opts.model is None):
        return None
    from starqa.workers import client

    group = client.find(manifest.key)
    if group is not None and opts.weights in (None, group.weights) \
            and group.topk == (opts.topk.as_dict() if opts.topk else None):
        return group
    return None


def _let_go(head) -> None:
    """Let go of the head start (its child exits): someone else answers."""
    if head is not None:
        head.close()


def _question(opts: AskOptions, manifest: Manifest, ui: UI,
              started: float) -> tuple[Question, int, str]:
    """The question ready to answer cold, the workers per machine that answer it and why."""
    from starqa import models

    with ui.status("Checking model and shards"):
        model_path = checked_model(manifest, opts.model, ui)
        tokenizer, query_ids = question_ids(manifest, model_path, opts.question)
    if opts.nnodes == 1:  # no group to fetch blocks kept on other machines from
        _check_here(manifest)
    manifest = with_indexes(manifest, opts.topk, ui)
    n, m, window = manifest.n_tokens, len(query_ids), manifest.model.window
    if not opts.beyond_window and (error := prompt.room_error(n, m, opts.max_new_tokens, window)):
        raise error
    workers, why = phase2_workers(manifest, model_path, opts.workers, opts.nnodes, opts.device,
                                  opts.topk)
    weights = models.phase2_weights(opts.weights, manifest.model.spec, opts.device)
    stops = frozenset(models.stop_ids(tokenizer, model_path))
    return (Question(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens, stops,
                     weights, opts.topk, started), workers, why)


def _check_here(manifest: Manifest) -> None:
    """Every block is on this machine; else the error (naming the warm group elsewhere
    when this machine runs a part of one)."""
    try:
        hosts.check_here(manifest)
    except StarqaError:
        from starqa.workers import client

        if (group := client.part(manifest.key)) is not None:  # warm, on another machine
            raise client.elsewhere(group) from None
        raise


def ask_tokens(manifest: Manifest, query_ids: list[int],
               opts: TokenAskOptions = TokenAskOptions(), ui: UI = UI()) -> Answer:
    """Phase 2 for query token ids on a fresh torchrun group (never a warm one): the way in
    for `starqa bench`."""
    from starqa import models

    started = time.perf_counter()
    model_path = checked_model(manifest, None)
    tokenizer = models.load_tokenizer(model_path)
    n, m, window = manifest.n_tokens, len(query_ids), manifest.model.window
    if not opts.allow_over_window and (
            error := prompt.room_error(n, m, opts.max_new_tokens, window)):
        raise error
    manifest = with_indexes(manifest, opts.topk, ui)
    workers = phase2_workers(manifest, model_path, opts.workers, 1, opts.device, opts.topk)[0]
    stops = frozenset(models.stop_ids(tokenizer, model_path) if opts.stop else ())
    weights = models.phase2_weights(opts.weights, manifest.model.spec, opts.device)
    question = Question(manifest, model_path, tokenizer, list(query_ids), opts.max_new_tokens,
                        stops, weights, opts.topk, started, opts.measure)
    return _answer(question, Launch(workers, device=opts.device), ui)


class _Heard:
    """What an answer's workers said: its tokens (streamed to `ui` as text), when the first
    came and when the query host was done, its `Done`, and each rank's own reports."""

    def __init__(self, tokenizer, ui: UI):
        self.stream = prompt.TextStream(tokenizer)
        self.ui = ui
        self.first: float | None = None
        self.end: float | None = None
        self.done: Done | None = None
        self.ranks = PerRank()

    def on_event(self, event: Event) -> None:
        if isinstance(event, Token):
            if self.first is None:
                self.first = time.perf_counter()
            if piece := self.stream.add(event.id):
                self.ui.token(piece)
        elif isinstance(event, Done):
            self.done = event
            self.end = time.perf_counter()  # (a head start may go on serving after)
        else:
            self.ranks.hear(event)


def _answer(question: Question, launch: Launch, ui: UI, head=None,
            then_serve: ThenServe | None = None) -> Answer:
    """Run Phase 2 on a torchrun group, or on the head start (`head`: a world of one forked
    as the command started; with `then_serve`, the warm group's settings, it goes on as
    that group once it has answered), streaming tokens to `ui`."""
    workers = launch.workers
    heard = _Heard(question.tokenizer, ui)
    job = question.job(launch.device, then_serve)
    if head is not None:
        head.run(job, heard.on_event)
    else:
        ui.waiting(f"Starting {workers} worker{'s' * (workers > 1)} (loading model and shards)")
        run_workers(job, launch, heard.on_event)
    store.touch(question.manifest)
    if piece := heard.stream.finish():
        ui.token(piece)
    done = heard.done
    return Answer.timed(
        heard.stream.text, question.started, heard.first,
        heard.end if heard.end is not None else time.perf_counter(), question.topk,
        token_ids=heard.stream.ids, context=question.manifest,
        query_tokens=len(question.query_ids), workers=workers * launch.nnodes,
        query_host=launch.node_rank == launch.nnodes - 1,
        decode_seconds=done.decode_s if done else 0.0,
        prefill_seconds=done.prefill_s if done else None,
        sources=list(done.sources or ()) if done else [],
        peak_bytes=heard.ranks.peak_bytes(), measures=heard.ranks.measure_rows(),
        weights=question.weights, before_torch=done.before_torch if done else False)


def _answer_here(question: Question, device: str, why: str, ui: UI) -> Answer:
    """Phase 2 as a world of one in this process: no torchrun, no second Python start."""
    ui.waiting(f"Loading model and shards ({why})")
    local = LocalAnswerer(question.manifest, question.model_path, question.weights,
                          question.topk, device)
    return local.answer(question, ui)


class _GroupLeft(Exception):
    """A warm group closed its socket before the first token: it was exiting as it was
    asked (`starqa stop`, its keep-alive ending), so the question goes elsewhere."""


def _ask_warm(opts: AskOptions, manifest: Manifest, group: RunInfo, ui: UI,
              started: float) -> Answer:
    """Ask a running worker group over its socket (no model load, no torch import here)."""
    from starqa.workers import messages
    from starqa.workers.client import Client

    conn = Client(group)
    first = None
    try:
        for event in conn.ask(opts.question, (), opts.max_new_tokens, opts.beyond_window):
            if isinstance(event, messages.Piece):
                first = first or time.perf_counter()
                ui.token(event.text)
            else:
                done = event
    except KeyboardInterrupt:  # stop the answer, leave the group warm
        with contextlib.suppress(OSError):
            conn.cancel()
        raise
    except (ConnectionResetError, BrokenPipeError) as err:
        if first is None:
            raise _GroupLeft from None
        raise StarqaError(f"The warm group of {manifest.name} ended in the middle of the answer "
                          f"({err}).", hint="ask again: a cold answer starts a new group; "
                          "starqa ps shows the running groups") from None
    finally:
        conn.close()
    return Answer.timed(done.text, started, first, time.perf_counter(), opts.topk,
                        token_ids=list(done.token_ids), context=manifest,
                        query_tokens=done.question_tokens, workers=group.workers,
                        decode_seconds=done.decode_s, prefill_seconds=done.first_token_s,
                        sources=list(done.sources or ()), warm=True,
                        weights=group.weights)
