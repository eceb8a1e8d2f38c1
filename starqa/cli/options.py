"""The options more than one `starqa` command takes, each defined once, and the one way the
seven top-k options become `TopK` settings.

An option here is an `Annotated` type: a command names it as a parameter's type and gives
its default (`model: Model = None`). Nothing here imports torch, so `--help` stays instant.

The top-k options (`--attention`, `--top-k`, `--top-k-schedule`, `--index`,
`--kv-on-disk`, `--top-k-prefill`, `--top-k-tail`) have one grammar in every command:
`--top-k`, `--index`, `--top-k-prefill` and `--top-k-tail` take comma-separated values, and
every combination is a setting (`topk_runs`; a tail goes with ivf's runs only, the other
kinds have no lists). `ask`, `chat` and `serve` answer with one setting (`one_topk`);
`eval` runs each; `bench` runs each beside exact (`compared`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from starqa.core.errors import StarqaError
from starqa.measure import lengths

if TYPE_CHECKING:
    from starqa.api import TopK


def _seconds(value: float) -> float:
    """--keep-alive's check: NaN compares as neither positive nor negative, and left a
    warm group that never exits, listed as "never"."""
    if value != value:
        raise typer.BadParameter("nan is not a number of seconds (a negative value: never)")
    return value


# ---------------------------------------------------------------------------------------
# the model, the workers and where they run

Model = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="STARQA_MODEL",
    help="Embedded model name (qwen2.5-coder-1.5b, the default; qwen2.5-coder-0.5b, "
    "smollm2-135m), a GGUF file (./model.gguf), a model in ollama's store (ollama:NAME[:TAG]), "
    "a local Hugging Face folder, or a hub id; any of them with +yarnN is that model with "
    "YaRN at factor N, a window N times its own (qwen2.5-coder-1.5b+yarn4: 131,072 tokens).")]
Workers = Annotated[Optional[int], typer.Option(
    "--workers", "-w", envvar="STARQA_WORKERS", min=1,
    help="Workers (ingest: all GPUs, else on a CPU one with every core for star and "
         "dense, all the cores for the others; ask, serve: one with every core when model "
         "and shards fit in memory, else one per GPU, or per core).")]
Nnodes = Annotated[int, typer.Option("--nnodes", envvar="STARQA_NNODES", min=1,
                                     help="torchrun: number of machines.")]
NodeRank = Annotated[int, typer.Option("--node-rank", envvar="STARQA_NODE_RANK", min=0,
                                       help="torchrun: this machine's rank.")]
Rdzv = Annotated[Optional[str], typer.Option(
    "--rdzv-endpoint", envvar="STARQA_RDZV_ENDPOINT",
    help="torchrun: HOST:PORT of node 0, for runs across machines.")]
Device = Annotated[str, typer.Option("--device", envvar="STARQA_DEVICE",
                                     help="auto, cpu or cuda.")]
Dtype = Annotated[Optional[str], typer.Option(
    envvar="STARQA_DTYPE",
    help="The cache's dtype: bf16 (default), fp16, fp32 (a bf16 cache is computed in fp32 "
         "on CPUs without bf16 matrix instructions).")]
Weights = Annotated[Optional[str], typer.Option(
    "--weights", envvar="STARQA_WEIGHTS",
    help="Phase 2 weights: dense (the cache's dtype), int8 or int4 (weight-only, CPU) "
         "(default: int4 for the embedded models on CPU, else dense).")]
KeepAlive = Annotated[float, typer.Option(
    "--keep-alive", envvar="STARQA_KEEP_ALIVE", callback=_seconds,
    help="Seconds without a question before warm workers exit; a negative value: never "
         "(until `starqa stop`). ask: 0 leaves no warm group; chat: 0 stops it when the chat "
         "ends; serve: 0, never.")]
HttpAddress = Annotated[Optional[str], typer.Option(
    "--http", envvar="STARQA_HTTP", metavar="[HOST:]PORT",
    help="Serve the OpenAI chat API on [HOST:]PORT (host 127.0.0.1 unless given) instead: "
         "every context is a model, answered by a warm group of its own (started on its "
         "first request, kept for --keep-alive seconds after its last).")]
ApiKey = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="STARQA_API_KEY",
    help="With --http: the key clients must send (Authorization: Bearer KEY); needed to "
         "listen on any address but loopback.")]
AllowOrigin = Annotated[Optional[str], typer.Option(
    "--allow-origin", envvar="STARQA_ALLOWED_ORIGINS", metavar="ORIGINS",
    help="With --http: the web pages whose requests are let in, with CORS headers "
         "(comma-separated origins, e.g. https://app.example.org; * for every page); "
         "pages served from this machine's loopback addresses always are.")]

# ---------------------------------------------------------------------------------------
# contexts and answers

ContextArg = Annotated[Optional[str], typer.Argument(
    envvar="STARQA_CONTEXT", help="Context name or key (default: the one used last).")]
MaxNewTokens = Annotated[int, typer.Option(envvar="STARQA_MAX_NEW_TOKENS", min=1,
                                           help="Longest answer in tokens.")]
BeyondWindow = Annotated[bool, typer.Option(
    "--beyond-window", envvar="STARQA_BEYOND_WINDOW",
    help="Go on even when the context is longer than the model's trained window (a "
         "context ingested with it is asked with it).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
EvalLengths = Annotated[Optional[str], typer.Option(
    "--lengths", envvar="STARQA_EVAL_LENGTHS",
    help=f"{lengths.HELP}: each sample's context + question + answer (default: 1k doubling "
         "up to the model's window).")]
BenchLengths = Annotated[str, typer.Option(
    "--lengths", envvar="STARQA_BENCH_LENGTHS",
    help=f"{lengths.HELP}: each synthetic context; may pass the model's window (timing "
         "only).")]

# ---------------------------------------------------------------------------------------
# method settings (ingest, eval)

BlockSize = Annotated[Optional[int], typer.Option(
    envvar="STARQA_BLOCK_SIZE", help="Tokens per block (default: a quarter of the context).")]
AnchorSize = Annotated[Optional[int], typer.Option(
    envvar="STARQA_ANCHOR_SIZE",
    help="star, apb: anchor tokens (default: the block size for star, a quarter of it for apb).")]
SinkSize = Annotated[Optional[int], typer.Option(
    envvar="STARQA_SINK_SIZE", help="pulsar: tokens of the sink (default 64).")]
Heuristic = Annotated[Optional[str], typer.Option(
    envvar="STARQA_HEURISTIC",
    help="pulsar: chunk scoring, max-idf (default), tfidf, bm25, entropy or even.")]
SummaryBudget = Annotated[Optional[float], typer.Option(
    envvar="STARQA_SUMMARY_BUDGET",
    help="pulsar: summary size as a fraction of the block (default 0.125).")]
ChunkSize = Annotated[Optional[int], typer.Option(
    envvar="STARQA_CHUNK_SIZE", help="pulsar: tokens per scored chunk (default 32).")]
Positions = Annotated[Optional[str], typer.Option(
    envvar="STARQA_POSITIONS",
    help="star, pulsar: sparse (original positions; star's default within the window) or "
         "contiguous (each block's positions after its anchor or sink, within the window; "
         "star's default past the window).")]
PassingSize = Annotated[Optional[int], typer.Option(
    envvar="STARQA_PASSING_SIZE",
    help="apb: compressed tokens each block passes on, per layer and KV head "
         "(default: an eighth of the block).")]
ProbeWindow = Annotated[Optional[int], typer.Option(
    envvar="STARQA_PROBE_WINDOW",
    help="apb: the block's last tokens whose queries score what to pass (default 64).")]


def method_params(sink_size: int | None, heuristic: str | None, summary_budget: float | None,
                  chunk_size: int | None, positions: str | None, passing_size: int | None,
                  probe_window: int | None) -> dict:
    """The method settings' options by their registry names (`methods.OPTIONS`); None:
    not given."""
    return {"sink": sink_size, "heuristic": heuristic, "budget_frac": summary_budget,
            "chunk": chunk_size, "positions": positions, "passing": passing_size,
            "window": probe_window}


# ---------------------------------------------------------------------------------------
# top-k attention (ask, chat, serve, eval, bench)

_EACH = "; eval, bench: comma-separated, each runs"
Attention = Annotated[str, typer.Option(
    envvar="STARQA_ATTENTION",
    help="Phase 2 attention: exact (every key) or topk (each query row attends to its k "
         "keys with the largest inner product, from a vector index; no sources).")]
TopKOpt = Annotated[Optional[str], typer.Option(
    "--top-k", envvar="STARQA_TOP_K",
    help="topk: keys per query row and worker, a count (512) or a percentage of the "
         f"context (1%, the default){_EACH} (0.5%,1%,2%); bench runs top-k, beside exact, "
         "only with it.")]
TopKSchedule = Annotated[Optional[str], typer.Option(
    "--top-k-schedule", envvar="STARQA_TOP_K_SCHEDULE",
    help="topk: uniform (k in every layer, the default) or linear (k grows with depth, "
         "the same total).")]
IndexKind = Annotated[Optional[str], typer.Option(
    "--index", envvar="STARQA_INDEX",
    help="topk: flat (exact matmul + top-k over the keys in memory, the default; bench: "
         "every kind), ivf or hnsw (faiss indexes next to the shards, built on first use)"
         f"{_EACH}.")]
TopKPrefill = Annotated[Optional[str], typer.Option(
    "--top-k-prefill", envvar="STARQA_TOP_K_PREFILL",
    help="topk: how the question's own forward attends: exact (every key, as the paper "
         "does; the default) or topk (its k keys per row, like the answer's tokens: a "
         f"sooner first token on a huge context){_EACH}.")]
TopKTail = Annotated[Optional[str], typer.Option(
    "--top-k-tail", envvar="STARQA_TOP_K_TAIL",
    help="topk with --index ivf: lists (the default) counts the keys a row did not retrieve "
         "by their lists' centres and mean values, so the softmax misses no list's weight; "
         f"none drops them (the paper's top-k){_EACH} (with ivf's).")]
KvOnDisk = Annotated[bool, typer.Option(
    "--kv-on-disk", envvar="STARQA_KV_ON_DISK",
    help="topk: keep values (and ivf/hnsw keys) memory-mapped from the cache and read only "
         "the rows selected (bench: each run also so, after its run in memory).")]


@dataclass(frozen=True)
class TopKChoice:
    """The seven top-k options as given (text; None: not given)."""

    attention: str = "exact"
    top_k: str | None = None
    schedule: str | None = None
    index: str | None = None
    kv_on_disk: bool = False
    prefill: str | None = None
    tail: str | None = None

    def given(self) -> list[str]:
        """The options given besides --attention, as the command line spells them."""
        return [name for name, value in (
            ("--top-k", self.top_k), ("--top-k-schedule", self.schedule),
            ("--index", self.index), ("--kv-on-disk", self.kv_on_disk),
            ("--top-k-prefill", self.prefill), ("--top-k-tail", self.tail)) if value]


def _values(text: str | None, option: str, example: str) -> list[str | None]:
    """An option's comma-separated values, each once; [None] when it is not given."""
    if text is None:
        return [None]
    found = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not found:
        raise StarqaError(f"{option} {text!r} names no value.", hint=f"{option} {example}")
    return found


def topk_runs(choice: TopKChoice) -> tuple[TopK, ...]:
    """Every top-k setting `choice` names, each once, in the order of its values (--top-k,
    then --index, --top-k-prefill, --top-k-tail); () for exact attention. Each is checked by
    `starqa.api.topk_settings`: a bad value, or a top-k option with exact attention, is an
    error naming it."""
    from starqa.api import topk_settings

    kinds = _values(choice.index, "--index", "flat,ivf")
    tails = _values(choice.tail, "--top-k-tail", "lists")
    found = [topk_settings(choice.attention, top_k, choice.schedule, kind, choice.kv_on_disk,
                           prefill, tail)
             for top_k in _values(choice.top_k, "--top-k", "1%")
             for kind in kinds
             for prefill in _values(choice.prefill, "--top-k-prefill", "exact")
             for tail in (tails if kind == "ivf" or "ivf" not in kinds else [None])]
    if choice.attention == "topk" and choice.tail and "ivf" not in kinds:
        raise StarqaError(f"--top-k-tail applies to ivf's runs only: --index "
                          f"{choice.index or 'flat'} has none of ivf's lists.",
                          hint="add ivf to --index (e.g. --index ivf), or drop --top-k-tail")
    return tuple(dict.fromkeys(t for t in found if t is not None))


def one_topk(choice: TopKChoice) -> TopK | None:
    """The one top-k setting a question is answered with (ask, chat, serve); None: exact."""
    found = topk_runs(choice)
    if len(found) > 1:
        raise StarqaError(f"The top-k options name {len(found)} settings; a question is "
                          "answered with one.",
                          hint="give --top-k, --index, --top-k-prefill and --top-k-tail one "
                               "value each (starqa eval compares several)")
    return found[0] if found else None


def compared(choice: TopKChoice) -> tuple[TopK, ...]:
    """`starqa bench`'s top-k runs, each beside exact on the same context: --top-k turns
    them on (bench has no --attention), every index kind unless --index names some, and
    each --kv-on-disk run comes after the same run in memory."""
    from starqa.api.doors import INDEX_KINDS

    if choice.top_k is None:
        if given := choice.given():
            raise StarqaError(f"{', '.join(given)} apply to top-k runs, which --top-k asks "
                              "for.", hint="add --top-k 1%, or drop " + ", ".join(given))
        return ()
    runs = topk_runs(replace(choice, attention="topk",
                             index=choice.index or ",".join(INDEX_KINDS)))
    return tuple(dict.fromkeys(each for run in runs
                               for each in (replace(run, kv_on_disk=False), run)))
