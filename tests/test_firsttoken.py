"""A cold ask's first token before torch is imported (starqa.coldstart.firsttoken): the torch path's
very bits, taken over by it without a second forward of the question."""

import json
import math
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from starqa.runtime import dist
from starqa import engine, models
from starqa.coldstart import firsttoken
from starqa.native import kernels
from starqa.core import paths
from starqa.corpus import prompt
from starqa.cache import store
from starqa.cache.manifest import Manifest
from starqa.methods import ContextBias
from starqa.phase2.answerer import Answerer
from starqa.models.decoder_io import load_decoder
from starqa.core.errors import ShardError
from starqa.runtime.protocol import AskJob, Token
from tiny import make_tiny_model

pytestmark = pytest.mark.skipif(
    not kernels.int4_fast(), reason="no AVX-512 VNNI here: int4 weights keep torch's layout")
QUESTION = "who approved the travel budget"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def int4_model(request, tmp_path_factory):
    """A tiny model folder (Llama, then Qwen2) whose answers never stop, with its int4
    prepared weights written beside it: the file firsttoken maps."""
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param,
                             vocab_multiple=16, never_stops=True)
    load_decoder(folder, torch.bfloat16, "int4")  # writes the prepared file firsttoken maps
    return folder


@pytest.fixture
def context(home, docs, int4_model):
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(int4_model), dtype="bf16",
                                       block_size=60))
    return store.find_context(paths.contexts_dir(), None)


def job_for(manifest, model, question=QUESTION, **changes) -> AskJob:
    tokens = prompt.QueryTokens(manifest.query_template, model)
    return replace(AskJob(model_path=str(model), dtype=manifest.dtype,
                          context_dir=str(manifest.folder), query_ids=tuple(tokens.ids(question)),
                          weights="int4", max_new_tokens=8, device="cpu", topk=None,
                          stop_ids=tuple(sorted(models.stop_ids(tokens.tokenizer, model)))),
                   **changes)


def bits(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).view(torch.bfloat16)


@pytest.mark.slow
def test_first_token_and_kv_are_the_torch_paths_own(context, int4_model):
    """The forward without torch gives, bit for bit, the question's keys and values, the
    first token and the rows source attribution keeps that Phase 2's own forward gives;
    the torch path that adopts it answers the same tokens with the same sources, and does
    not stream the first token a second time."""
    job = job_for(context, int4_model)
    events = []
    early = firsttoken.prefill(job, events.append)
    assert early is not None and len(early.keys) == 2  # the tiny models' layers

    stops = set(job.stop_ids)
    reference = Answerer.from_cache(context, dist.local_world("cpu"), int4_model, "int4")
    streamed = []
    tokens, top = reference.answer(list(job.query_ids), 8, stops, streamed.append)
    assert len(tokens) == 8 and streamed == tokens  # never_stops: a full answer
    assert early.token == tokens[0] and events == [Token(id=tokens[0])]
    assert early.emitted == [tokens[0]]
    m = len(job.query_ids)
    for layer, (own_k, own_v) in enumerate(reference.hook.own.buffers):
        assert torch.equal(own_k[0, :, :m], bits(early.keys[layer]))
        assert torch.equal(own_v[0, :, :m], bits(early.values[layer]))

    adopted = Answerer.from_cache(context, dist.local_world("cpu"), int4_model, "int4")
    heard = []
    again, sources = adopted.answer(list(job.query_ids), 8, stops, heard.append,
                                    prefilled=early)
    assert again == tokens and heard == tokens[1:]
    assert sources == top
    torch.testing.assert_close(adopted.hook.key_mass(tokens), reference.hook.key_mass(tokens),
                               rtol=0, atol=0)


@pytest.mark.slow
def test_a_context_bias_goes_before_torch_too(context, int4_model, monkeypatch):
    """A context whose blocks share positions (`Manifest.context_bias`: its keys weigh e^b
    each but the first 37, before the shared positions; the question's 1) is prefilled
    before torch as well, with the bias in the shard's key tables (block 0 cut in two at
    key 37): the question's KV, the first token and the sources are the torch path's, bit
    for bit, and the bias weighs (the rows' LSEs are not the unbiased ones)."""
    job = job_for(context, int4_model)
    plain = firsttoken.prefill(job, lambda event: None)
    monkeypatch.setattr(Manifest, "context_bias",
                        property(lambda self: ContextBias(math.log(0.3), 37)))
    early = firsttoken.prefill(job, lambda event: None)
    assert early is not None and plain is not None
    assert not np.array_equal(early.lses[0], plain.lses[0])

    stops = set(job.stop_ids)
    reference = Answerer.from_cache(context, dist.local_world("cpu"), int4_model, "int4")
    assert reference.hook.view.bias == math.log(0.3)
    assert reference.hook.view.unbiased == 37 < context.blocks[0].end
    tokens, top = reference.answer(list(job.query_ids), 8, stops)
    assert early.token == tokens[0]
    m = len(job.query_ids)
    for layer, (own_k, own_v) in enumerate(reference.hook.own.buffers):
        assert torch.equal(own_k[0, :, :m], bits(early.keys[layer]))
        assert torch.equal(own_v[0, :, :m], bits(early.values[layer]))
    adopted = Answerer.from_cache(context, dist.local_world("cpu"), int4_model, "int4")
    again, sources = adopted.answer(list(job.query_ids), 8, stops, prefilled=early)
    assert again == tokens and sources == top
    torch.testing.assert_close(adopted.hook.key_mass(tokens), reference.hook.key_mass(tokens),
                               rtol=0, atol=0)


@pytest.mark.slow
def test_a_stop_token_first_is_not_streamed(context, int4_model):
    """A first token that ends the answer is not streamed (the torch path would not stream
    it either), and the answer is empty."""
    job = job_for(context, int4_model)
    early = firsttoken.prefill(job, lambda event: None)
    job = replace(job, stop_ids=(early.token,))
    events = []
    early = firsttoken.prefill(job, events.append)
    assert events == [] and early.emitted == []
    answerer = Answerer.from_cache(context, dist.local_world("cpu"), int4_model, "int4")
    heard = []
    tokens, _ = answerer.answer(list(job.query_ids), 8, set(job.stop_ids), heard.append,
                                prefilled=early)
    assert tokens == [] and heard == []


@pytest.mark.slow
def test_where_it_does_not_apply_nothing_is_emitted(context, int4_model, monkeypatch, tmp_path):
    """Other weights, dtypes, top-k, a long question, the switch off, or no prepared file
    of this layout: None, nothing streamed, and the torch path answers as before."""
    emitted = []

    def emit(event):
        emitted.append(event)

    cases = [job_for(context, int4_model, weights="dense"),
             job_for(context, int4_model, dtype="float32"),
             job_for(context, int4_model, topk={"k": 4}),
             job_for(context, int4_model, device="cuda"),
             job_for(context, int4_model, question=" ".join(["the budget"] * 40)),
             job_for(context, int4_model, query_ids=())]
    assert len(cases[4].query_ids) >= 64
    for job in cases:
        assert firsttoken.prefill(job, emit) is None
    monkeypatch.setenv("STARQA_FIRST_TOKEN", "0")
    assert firsttoken.prefill(job_for(context, int4_model), emit) is None
    monkeypatch.delenv("STARQA_FIRST_TOKEN")

    bare = tmp_path / "bare"  # the model without its prepared file
    shutil.copytree(int4_model, bare, ignore=shutil.ignore_patterns(".starqa-phase2-*"))
    assert firsttoken.prefill(job_for(context, bare), emit) is None
    prepared = next(int4_model.glob(".starqa-phase2-int4-bfloat16.safetensors"))
    stale = tmp_path / "stale"  # a prepared file of another layout
    shutil.copytree(int4_model, stale)
    target = stale / prepared.name
    size = int.from_bytes(target.read_bytes()[:8], "little")
    header = json.loads(target.read_bytes()[8:8 + size])
    header["__metadata__"]["layout"] = "3"
    text = json.dumps(header).encode().ljust(size)
    target.write_bytes(target.read_bytes()[:8] + text + target.read_bytes()[8 + size:])
    assert firsttoken.prefill(job_for(context, stale), emit) is None
    assert emitted == []
    assert firsttoken.prefill(job_for(context, int4_model), emit) is not None  # and here it does


@pytest.mark.slow
def test_a_corrupt_shard_is_the_same_error_as_on_the_torch_path(context, int4_model):
    first = context.folder / context.blocks[0].file
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="fails its checksum"):
        firsttoken.prefill(job_for(context, int4_model), lambda event: None)
