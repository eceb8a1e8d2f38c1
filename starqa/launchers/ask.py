"""Phase 2's launcher, `starqa ask`: a cached context and a question → an `Answer` from its
warm group (`starqa.workers.client.ask_warm`, the one warm-ask loop), or cold: the question
made a `Query` (`starqa.launchers.query`) and answered in this process (a world of one, when
model and shards fit in memory: `starqa.launchers.local`) or by a torchrun group. Every
cold path answers through `starqa.phase2.answerer.Answerer`; `serve` (a group kept warm
for later questions) is `starqa.launchers.serve`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from starqa.cache import hosts, store
from starqa.cache.context import Context
from starqa.cache.manifest import Manifest
from starqa.core import paths
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.launchers.local import LocalAnswerer
from starqa.launchers.query import Query, answered, checked_model, question_ids, with_indexes
from starqa.phase2.answer import Answer, Question, Timings
from starqa.phase2.placement import phase2_workers
from starqa.runtime.launch import Launch, PerRank, launch_of, run_workers
from starqa.runtime.protocol import Done, Event, ThenServe, Token
from starqa.topk.indexes import TopK


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
    if manifest.past_window:  # built to extrapolate (ingest --beyond-window): asked so too
        opts = replace(opts, beyond_window=True)
    if opts.warm and opts.nnodes == 1:
        from starqa.workers import client

        group, why_not = client.group_for(manifest, opts.model, opts.weights,
                                          opts.topk.as_dict() if opts.topk else None)
        if why_not:
            ui.note(f"Answering cold: {why_not}.")
        if group is not None:
            head = _let_go(head)  # the group answers: no torch in this command
            try:
                return client.ask_warm(group, _question_of(opts), Context.of(manifest),
                                       ui.token, ui.stop_wanted, started)
            except client.Unreachable:  # it died without cleaning up: answer cold
                client.forget(group)
            except client.GroupLeft:  # it was exiting (stopped, idle) as it was asked
                pass
    query, workers, why = _query(opts, manifest, ui, started)
    if not (workers == 1 and opts.nnodes == 1):
        head = _let_go(head)  # a torchrun group answers
    keep = opts.keepalive != 0 and opts.warm and opts.nnodes == 1  # leave a warm group
    if head is not None:  # a world of one forked as the command started (coldstart.headstart)
        ui.waiting(f"Loading model and shards ({why})")
        then = ThenServe(opts.keepalive, opts.workers, opts.weights,
                         opts.topk.as_dict() if opts.topk else None) if keep else None
        answer = _answer(query, launch_of(opts, 1), ui, head=head, then_serve=then)
    elif workers == 1 and opts.nnodes == 1:
        answer = _answer_here(query, opts.device, why, ui)
    else:
        answer = _answer(query, launch_of(opts, workers), ui)
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
    beyond = opts.beyond_window or manifest.past_window
    if beyond and opts.max_new_tokens > manifest.model.window:
        # without --beyond-window the room check says it; the answer's buffers are this long
        raise StarqaError(f"--max-new-tokens {opts.max_new_tokens:,} is longer than the model's "
                          f"whole window ({manifest.model.window:,} tokens).",
                          hint=f"ask with --max-new-tokens {manifest.model.window} or lower")
    return manifest


def _question_of(opts: AskOptions) -> Question:
    """The question `opts` asks, as a warm group takes it."""
    return Question(opts.question, opts.context, max_new_tokens=opts.max_new_tokens,
                    beyond_window=opts.beyond_window)


def _let_go(head) -> None:
    """Let go of the head start (its child exits): someone else answers."""
    if head is not None:
        head.close()


def _query(opts: AskOptions, manifest: Manifest, ui: UI,
           started: float) -> tuple[Query, int, str]:
    """The question made ready to answer cold, the workers per machine that answer it and
    why."""
    from starqa import models

    with ui.status("Checking model and shards"):
        model_path = checked_model(manifest, opts.model, ui)
        tokenizer, query_ids = question_ids(manifest, model_path, opts.question)
    if opts.nnodes == 1:  # no group to fetch blocks kept on other machines from
        _check_here(manifest)
    manifest = with_indexes(manifest, opts.topk, ui)
    n, m, window = manifest.query_position, len(query_ids), manifest.model.window
    if not opts.beyond_window and (error := prompt.room_error(n, m, opts.max_new_tokens, window)):
        raise error
    workers, why = phase2_workers(manifest, model_path, opts.workers, opts.nnodes, opts.device,
                                  opts.topk)
    weights = models.phase2_weights(opts.weights, manifest.model.spec, opts.device)
    stops = frozenset(models.stop_ids(tokenizer, model_path))
    return (Query(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens, stops,
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
    n, m, window = manifest.query_position, len(query_ids), manifest.model.window
    if not opts.allow_over_window and (
            error := prompt.room_error(n, m, opts.max_new_tokens, window)):
        raise error
    manifest = with_indexes(manifest, opts.topk, ui)
    workers = phase2_workers(manifest, model_path, opts.workers, 1, opts.device, opts.topk)[0]
    stops = frozenset(models.stop_ids(tokenizer, model_path) if opts.stop else ())
    weights = models.phase2_weights(opts.weights, manifest.model.spec, opts.device)
    query = Query(manifest, model_path, tokenizer, list(query_ids), opts.max_new_tokens,
                  stops, weights, opts.topk, started, opts.measure)
    return _answer(query, Launch(workers, device=opts.device), ui)


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


def _answer(query: Query, launch: Launch, ui: UI, head=None,
            then_serve: ThenServe | None = None) -> Answer:
    """Run Phase 2 on a torchrun group, or on the head start (`head`: a world of one forked
    as the command started; with `then_serve`, the warm group's settings, it goes on as
    that group once it has answered), streaming tokens to `ui`."""
    workers = launch.workers
    heard = _Heard(query.tokenizer, ui)
    job = query.job(launch.device, then_serve)
    if head is not None:
        head.run(job, heard.on_event)
    else:
        ui.waiting(f"Starting {workers} worker{'s' * (workers > 1)} (loading model and shards)")
        run_workers(job, launch, heard.on_event)
    store.touch(query.manifest)
    if piece := heard.stream.finish():
        ui.token(piece)
    done = heard.done
    end = heard.end if heard.end is not None else time.perf_counter()
    timings = Timings.since(query.started, heard.first, end, done.prefill_s if done else None,
                            done.decode_s if done else 0.0,
                            before_torch=done.before_torch if done else False)
    return answered(query, heard.stream.text, heard.stream.ids, timings,
                    done.sources if done else (), workers * launch.nnodes,
                    query_host=launch.node_rank == launch.nnodes - 1,
                    peak_bytes=tuple(heard.ranks.peak_bytes()),
                    measures=tuple(heard.ranks.measure_rows()))


def _answer_here(query: Query, device: str, why: str, ui: UI) -> Answer:
    """Phase 2 as a world of one in this process: no torchrun, no second Python start."""
    ui.waiting(f"Loading model and shards ({why})")
    local = LocalAnswerer(query.manifest, query.model_path, query.weights, query.topk, device)
    return local.answer(query, ui)
