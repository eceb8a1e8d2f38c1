"""`starqa bench` and its instruments: bytes counted by dist's collectives, FLOPs counted by
the worker, a whole bench through torchrun on the tiny model, and every input error."""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from starqa.cli.options import TopKChoice, compared, one_topk
from starqa.measure import bench, lengths
from starqa.measure.evals import runner
from starqa.runtime import dist
from starqa import engine, phase1
from starqa.phase1 import hooks
from starqa.core.errors import StarqaError
from starqa.cache.manifest import read_manifest
from starqa.methods import METHODS
from starqa.models import load_model
from starqa.workers.worker import flop_counter
from fakes import starqa
from tiny import make_tiny_model

# --------------------------------------------------------------------------- dist: bytes


def test_world_of_one_moves_nothing():
    info = dist.DistInfo(0, 0, 1, torch.device("cpu"), None)
    x = torch.arange(6.0).view(2, 3)
    assert dist.all_gather(info, x).shape == (1, 2, 3)
    dist.broadcast(info, x, src=0)
    dist.ring_shift(info, x)
    assert dist.gather_object(info, {"a": 1}, dst=0) == [{"a": 1}]
    assert dist.broadcast_object(info, "hello", src=0) == "hello"
    assert info.traffic.as_dict() == {"sent_bytes": 0, "received_bytes": 0, "by_op": {}}


_TWO_RANKS = textwrap.dedent("""
    import json, os, torch
    from starqa.runtime import dist
    info = dist.init("cpu")
    r = info.rank
    dist.all_gather(info, torch.zeros(3, 4))                     # 48 bytes each way
    dist.broadcast(info, torch.zeros(5, dtype=torch.int64), 1)   # 40 bytes from rank 1
    dist.ring_shift(info, torch.zeros(2, 5, dtype=torch.bfloat16))  # 20 bytes each way
    dist.gather_object(info, {"rank": r}, dst=1)
    dist.broadcast_object(info, ["from", "rank", 0], src=0)
    # One file per rank: two ranks printing to one pipe can interleave their lines.
    with open(os.environ["TRAFFIC_PREFIX"] + str(r), "w") as fh:
        json.dump(info.traffic.as_dict(), fh)
    dist.barrier(info)
    os._exit(0)  # as worker.main: no gloo teardown, which now and then aborts the process
""")


def test_two_ranks_count_each_collective(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(_TWO_RANKS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1",
           "TRAFFIC_PREFIX": str(tmp_path / "traffic-")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r0, r1 = (json.loads((tmp_path / f"traffic-{r}").read_text()) for r in (0, 1))
    def payload(obj):  # objects cross as compact UTF-8 JSON (dist._to_json), not pickles
        return len(json.dumps(obj, separators=(",", ":")).encode())

    obj0, obj1 = payload({"rank": 0}), payload({"rank": 1})
    listed = payload(["from", "rank", 0])
    assert r0["by_op"] == {
        "all_gather": {"calls": 1, "sent": 48, "received": 48},
        "broadcast": {"calls": 1, "sent": 0, "received": 40},
        "ring_shift": {"calls": 1, "sent": 20, "received": 20},
        "gather_object": {"calls": 1, "sent": obj0, "received": 0},
        "broadcast_object": {"calls": 1, "sent": listed, "received": 0}}
    assert r1["by_op"] == {
        "all_gather": {"calls": 1, "sent": 48, "received": 48},
        "broadcast": {"calls": 1, "sent": 40, "received": 0},
        "ring_shift": {"calls": 1, "sent": 20, "received": 20},
        "gather_object": {"calls": 1, "sent": 0, "received": obj0},
        "broadcast_object": {"calls": 1, "sent": 0, "received": listed}}
    assert obj1 > 0  # rank 1's own object stays where it is: never counted
    assert r0["sent_bytes"] + r1["sent_bytes"] == r0["received_bytes"] + r1["received_bytes"]


# --------------------------------------------------------------------------- FLOPs


def test_flop_counter_counts_every_linear_and_the_cpu_attention_kernel(tiny_model):
    """One causal forward of T tokens on the tiny Llama (hidden 64, MLP 128, 4 query heads
    and 2 KV heads of 16, 2 layers): torch alone would miss the attention entirely."""
    model = load_model(tiny_model, dtype=torch.float32, attn_implementation=hooks.register())
    t = 40
    with flop_counter() as counter:
        list(phase1.encode_star(model, torch.arange(t) % 30 + 11, [(0, t)], [0], 0))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    per_token_layer = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q k v o mlp
    assert counts["aten.mm"] == 2 * t * per_token_layer
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu"] == 2 * 4 * 4 * t * t * 16
    assert counter.get_total_flops() == sum(counts.values())


def test_flop_counter_counts_each_cuda_sdpa_kernel_with_gqa():
    """The CUDA kernels' counts, on shapes alone (meta tensors; no GPU): torch 2.11's own
    formula raises on fewer KV heads than query heads (2.13's does not), which stopped
    `bench --device cuda` in Phase 1 on an H100; starqa's counts 4·B·Hq·M·N·D on any torch,
    as for the CPU kernel."""
    counter = flop_counter()
    q = torch.empty(1, 9, 5, 64, device="meta")
    k = v = torch.empty(1, 3, 7, 64, device="meta")
    aten = torch.ops.aten
    kernels = [aten._scaled_dot_product_flash_attention_for_cpu,
               aten._scaled_dot_product_flash_attention,
               aten._scaled_dot_product_efficient_attention]
    kernels += [aten._scaled_dot_product_cudnn_attention] * hasattr(
        aten, "_scaled_dot_product_cudnn_attention")
    for op in kernels:
        assert counter.flop_registry[op](q, k, v, out_val=None) == 4 * 9 * 5 * 7 * 64, op


# --------------------------------------------------------------------------- bench end to end


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
def test_worker_peak_memory_is_its_own_not_its_starters():
    """A worker started by a big process (torchrun's agent) reports its own peak: getrusage's
    ru_maxrss carries the starter's resident set across the exec, which hid a small
    worker's own."""
    held = bytearray(256 << 20)
    held[::4096] = b"\x01" * len(held[::4096])  # resident: every page touched
    probe = textwrap.dedent("""
        import resource
        from starqa.workers.worker import own_peak_rss
        print(own_peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    own, inherited = int(out[0]), int(out[1])
    assert 0 < own < 128 << 20  # a small Python's own, not the 256 MiB its starter holds
    assert inherited >= len(held)  # what the old measure gave (Linux keeps it across exec)
    del held


@pytest.mark.slow
def test_bench_on_the_tiny_model(tiny_model, tmp_path):
    """star and dense, 600 tokens (past the tiny model's 512-token window), workers 1 and 2,
    through torchrun: every number is there and sane."""
    opts = bench.options("star,dense", "600", "1,2", model=str(tiny_model), dtype="fp32",
                         new_tokens=3)
    plan = bench.make_plan(opts)
    assert [(r.method, r.workers, r.requested) for r in plan.runs] == [
        ("star", 1, (1,)), ("star", 2, (2,)), ("dense", 1, (1, 2))]
    assert any("contexts of 600 tokens, with the question and answer, go past the model's "
               "512-token window" in n for n in plan.notes)
    assert any("dense encodes on one worker" in n for n in plan.notes)
    contexts = tmp_path / "contexts"
    result = bench.run(plan, contexts_dir=contexts, json_path=tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(result))
    rows = {(r["method"], r["workers"]): r for r in result["rows"]}
    assert set(rows) == {("star", 1), ("star", 2), ("dense", 1)}
    for row in rows.values():
        p1, p2 = row["phase1"], row["phase2"]
        assert row["tokens"] == 600 and row["blocks"] == 4
        assert len(p1["per_worker"]) == row["workers"] == p2["workers"]
        assert sum(w["tokens"] for w in p1["per_worker"]) == 600
        assert p1["seconds"] > 0 and p1["tokens_per_second"] > 0
        assert 0 < p1["critical_path_flops"] <= p1["total_flops"]
        assert all(w["flops"] > 0 and w["peak_bytes"] > 2**20 for w in p1["per_worker"])
        assert p1["sent_bytes"] == 0  # star and dense encode without communicating
        assert p2["new_tokens"] == 3 and p2["query_tokens"] > 0
        assert p2["first_token_seconds"] > 0 and p2["seconds_per_token"] > 0
        assert p2["peak_bytes"] > 2**20
        manifest = read_manifest(contexts / row["context_key"])
        on_disk = sum((manifest.folder / b.file).stat().st_size for b in manifest.blocks)
        assert row["shard_bytes"] == on_disk == sum(b.bytes for b in manifest.blocks)
        kv = 2 * 2 * 2 * 600 * 16 * 4  # k and v, 2 layers, 2 KV heads, 600 tokens, D 16, fp32
        assert kv < row["shard_bytes"] < kv + 4 * 1024  # plus 4 small safetensors headers
    star1, star2, dense = rows["star", 1], rows["star", 2], rows["dense", 1]
    # One worker does all the work. Each worker encodes the anchor once for its blocks, so
    # two encode it twice: more work in all than one, the critical path a part of it.
    assert star1["phase1"]["critical_path_flops"] == star1["phase1"]["total_flops"]
    assert star2["phase1"]["total_flops"] > star1["phase1"]["total_flops"]
    assert star2["phase1"]["critical_path_flops"] < star2["phase1"]["total_flops"]
    # Star's token-forwards are dense's (the anchor's KV is reused, not encoded again per
    # block), and its blocks attend over at most two blocks, never the whole context.
    assert star1["phase1"]["total_flops"] < dense["phase1"]["total_flops"]
    assert star2["phase1"]["critical_path_flops"] < dense["phase1"]["total_flops"]
    # Phase 2 merges partial attentions: two workers talk, one does not.
    assert star1["phase2"]["sent_bytes"] == dense["phase2"]["sent_bytes"] == 0
    two = star2["phase2"]["per_worker"]
    assert all(w["by_op"]["all_gather"]["calls"] == 2 * 3 for w in two)  # layers × forwards
    assert sum(w["sent_bytes"] for w in two) == sum(w["received_bytes"] for w in two) > 0
    by_workers = {r["workers"]: r for r in result["ratios"] if r["tokens"] == 600}
    assert by_workers[2]["dense/star"] == pytest.approx(
        dense["phase1"]["total_flops"] / star2["phase1"]["critical_path_flops"])
    assert by_workers[2]["dense/star"] > 1


@pytest.mark.slow
def test_bench_top_k_against_exact_on_the_same_context(tiny_model, tmp_path):
    """--top-k 100%: each index kind (and flat with values on disk) runs Phase 2 after exact
    on the same context, with every key: the same tokens; ivf's files are sized and timed."""
    opts = bench.options("star", "600", "1", model=str(tiny_model), dtype="fp32",
                         new_tokens=3, topk=compared(TopKChoice(top_k="100%", index="flat,ivf",
                                                                kv_on_disk=True)))
    assert [(t.index, t.kv_on_disk) for t in opts.topk] == [
        ("flat", False), ("flat", True), ("ivf", False), ("ivf", True)]
    result = bench.run(bench.make_plan(opts), contexts_dir=tmp_path / "contexts")
    assert result["environment"]["cpu"]["model"]
    (row,) = result["rows"]
    runs = row["topk"]
    assert [r["settings"]["index"] for r in runs] == ["flat", "flat", "ivf", "ivf"]
    for r in runs:
        assert r["k"] == 600 and r["same_tokens_as_exact"]
        assert r["seconds_per_token"] > 0 and r["decode_vs_exact"] > 0 and r["peak_bytes"] > 0
    assert runs[0]["index_bytes"] == 0  # flat searches the keys themselves
    assert runs[2]["index_bytes"] > 600 * 16 * 4 * 2 * 2  # every key in fp32, 2 layers × 2 heads
    assert runs[2]["index_build_seconds"] > 0


def test_phase2_rounds_alternate_and_report_each_kinds_median_run(monkeypatch):
    """--rounds 3: exact, flat, ivf, exact, flat, ivf, ...; each kind reported by its run of
    median decode time (a machine's drift between runs lands on every kind alike)."""
    from types import SimpleNamespace

    opts = bench.options("star", "1k", "1", topk=compared(TopKChoice(top_k="1%", index="flat,ivf")),
                         rounds=3)
    calls, context = [], SimpleNamespace(n_tokens=1000)
    # decode seconds per run, in call order: exact 9, 3, 6; flat 2, 8, 5; ivf 7, 1, 4
    seconds = iter([9, 2, 7, 3, 8, 1, 6, 5, 4])

    def ask_tokens(manifest, query_ids, opts, **_):
        calls.append(opts.topk.index if opts.topk else "exact")
        return SimpleNamespace(token_ids=[1, 2, 3],
                               timings=SimpleNamespace(decode_s=next(seconds), prefill_s=0.5),
                               peak_bytes=[len(calls)], context=SimpleNamespace(folder=context))

    monkeypatch.setattr(bench.engine, "ask_tokens", ask_tokens)
    monkeypatch.setattr(bench, "find_set", lambda manifest, kind: None)
    monkeypatch.setattr(bench, "read_manifest", lambda folder: folder)
    exact, rows, _ = bench.phase2(context, [1], 1, opts, lambda: contextlib.nullcontext(None),
                                  lambda line: None)
    assert calls == ["exact", "flat", "ivf"] * 3
    assert exact.timings.decode_s == 6  # the median of 9, 3, 6
    assert [r["seconds_per_token"] * 2 for r in rows] == [5, 4]  # medians of 2, 8, 5 and 7, 1, 4
    assert [r["peak_bytes"] for r in rows] == [8, 9]  # the numbers of those same runs
    assert rows[0]["decode_vs_exact"] == 5 / 6


@pytest.mark.slow
def test_ring_phase1_bytes_are_the_kv_going_round(tiny_model, tmp_path):
    """Ring on 2 workers: each layer, each worker sends its chunk's K and V (fp32, padded to
    the longest chunk) once to the other, under the FLOP counter."""
    ids = list(range(11, 11 + 30)) * 20  # 600 tokens, 4 blocks: 160, 160, 160, 120
    result = engine.ingest_tokens(ids, tmp_path, engine.TokenIngestOptions(
        model=str(tiny_model), method="ring", workers=2, dtype="fp32", measure=True,
        allow_over_window=True))
    assert [b.end - b.start for b in result.manifest.blocks] == [160, 160, 160, 120]
    per_step = 2 * 2 * 320 * 16 * 4  # [K|V, Hkv, 320 tokens (the longer chunk), D] fp32
    for m in result.measures:
        assert m["by_op"] == {"ring_shift": {"calls": 2, "sent": 2 * per_step,
                                             "received": 2 * per_step}}
        assert m["flops"] > 0 and m["seconds"] > 0


# --------------------------------------------------------------------------- the window


def test_over_window_refused_by_ingest_and_unless_allowed(home, docs, tmp_path):
    small = make_tiny_model(tmp_path / "small", window=64)
    with pytest.raises(StarqaError, match=r"tokens > 64 the model was trained on"):
        engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(small)))
    with pytest.raises(StarqaError, match=r"100 tokens > 64 the model was trained on"):
        engine.ingest_tokens([11] * 100, tmp_path / "contexts",
                             engine.TokenIngestOptions(model=str(small)))
    assert not (tmp_path / "contexts").exists()  # refused before any worker started


# --------------------------------------------------------------------------- input errors


def test_ivf_runs_once_per_tail_and_the_other_kinds_once():
    opts = bench.options("star", "1k", "1", topk=compared(TopKChoice(
        top_k="1%", index="flat,ivf", tail="lists,none", kv_on_disk=True)))
    assert [(t.index, t.tail, t.tails, t.kv_on_disk) for t in opts.topk] == [
        ("flat", "lists", False, False), ("flat", "lists", False, True),
        ("ivf", "lists", True, False), ("ivf", "lists", True, True),
        ("ivf", "none", False, False), ("ivf", "none", False, True)]
    assert len({t.describe() for t in opts.topk}) == 6  # each its own row in the table


def test_parsing():
    assert bench.parse_lengths("8k, 2K,8k,3000") == (2048, 3000, 8192)
    # eval's and bench's --lengths: one parser, one grammar
    assert bench.parse_lengths is runner.parse_lengths is lengths.parse_lengths
    assert bench.bench_lengths("1.5k,2k") == (1536, 2048)
    assert bench.bench_lengths(None) == bench.bench_lengths(" ") == (2048, 4096, 8192, 16384,
                                                                       32768)
    assert bench.parse_workers("4,1,2,1") == (1, 2, 4)
    assert bench.parse_methods(None) == METHODS
    assert bench.parse_methods("pulsar, star,pulsar") == ("pulsar", "star")


@pytest.mark.parametrize("kwargs, message", [
    ({"methods": "star,nope"}, "Unknown method 'nope'"),
    ({"methods": " , "}, "names no method"),
    ({"lengths": "2k,abc"}, "'abc' is not a length in tokens"),
    ({"lengths": "2k,,4k"}, "'' is not a length in tokens"),
    ({"lengths": "1.1k"}, "'1.1k' is not a length in tokens"),
    ({"lengths": "10"}, "10 tokens is too short"),
    ({"workers": "0,2"}, "--workers must be at least 1"),
    ({"workers": "-1"}, "--workers must be at least 1"),
    ({"workers": "two"}, "'two' is not a whole number"),
    ({"new_tokens": 1}, "--new-tokens must be at least 2"),
    ({"rounds": 0}, "--rounds must be at least 1"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(StarqaError, match=message):
        bench.options(**kwargs)


@pytest.mark.parametrize("choice, message", [
    ({"tail": "none"}, "apply to top-k runs"),
    ({"kv_on_disk": True, "index": "ivf"}, "--index, --kv-on-disk apply to top-k runs"),
    ({"top_k": "1%", "index": "flat", "tail": "none"}, "applies to ivf's runs only"),
    ({"top_k": "1%", "index": "ivf", "tail": "lists,most"}, "Unknown --top-k-tail 'most'"),
    ({"top_k": "1%", "index": " , "}, "--index ' , ' names no value"),
])
def test_bad_top_k_options(choice, message):
    with pytest.raises(StarqaError, match=message):
        compared(TopKChoice(**choice))


def test_one_grammar_of_top_k_options_for_every_command():
    """ask's one setting, eval's every combination, bench's beside exact: one expansion."""
    assert compared(TopKChoice()) == () and one_topk(TopKChoice()) is None
    assert [t.index for t in compared(TopKChoice(top_k="2"))] == ["flat", "ivf", "hnsw"]
    asked = one_topk(TopKChoice("topk", "2", index="ivf", tail="none"))
    assert (asked.count, asked.index, asked.tail) == (2, "ivf", "none")
    with pytest.raises(StarqaError, match="name 2 settings; a question is answered with one"):
        one_topk(TopKChoice("topk", "1%,2%"))


def test_cli_errors_are_messages_not_tracebacks(home):
    for args, message in ((["--methods", "nope"], "Unknown method 'nope'"),
                          (["--workers", "0"], "--workers must be at least 1"),
                          (["--lengths", "2k;4k"], "Bad --lengths"),
                          (["--rounds", "0"], "--rounds must be at least 1")):
        proc = starqa("bench", *args)
        assert proc.returncode == 1, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
