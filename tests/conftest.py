"""The fixtures tests share: the tiny models (`tiny.py`), the `docs` corpus and its contexts
(ingested once per session and copied into each test's own $STARQA_HOME), fake contexts and
fake workers (`fakes.py`), and the environment every test runs in (no warm group left
behind, sources shown on random models). Plain helpers, such as `fakes.starqa` (the
`starqa` command in a subprocess), are imported from `fakes.py` and `tiny.py`."""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py

from fakes import install_home, make_context, write_docs  # noqa: E402
from tiny import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random Llama of `tiny.py` (a 512-token window), made once per session."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    """The tiny random Qwen2 of `tiny.py` (byte-level BPE, Qwen2.5's template), made once."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen", arch="qwen2")


@pytest.fixture(scope="session")
def long_tiny_model(tmp_path_factory) -> Path:
    """A tiny Llama with an 8K window whose answers never end by themselves (its end-of-turn
    logit pinned): an answer runs for thousands of tokens (seconds) and can be stopped."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "long-tiny", window=8192,
                           never_stops=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    """The tiny Llama loaded in fp32 with starqa's attention hooks, as Phase 1 runs it."""
    import torch

    from starqa.models import load_model
    from starqa.phase1 import hooks

    return load_model(tiny_model, dtype=torch.float32, attn_implementation=hooks.register())


@pytest.fixture(scope="module")
def tok(tiny_model):
    """The tiny Llama's tokenizer."""
    from starqa.models import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture
def docs(tmp_path) -> Path:
    """A small corpus in the tiny tokenizer's vocabulary (~200 tokens packed)."""
    return write_docs(tmp_path / "docs")


@pytest.fixture
def repo(tmp_path) -> Path:
    """Nine files in the tiny vocabulary, 13-60 tokens each (about ten blocks of 40), of one
    mtime (packed in path order): the source tree of the re-ingest and watch tests."""
    folder = tmp_path / "repo"
    folder.mkdir()
    words = "the star attention block query answer long context budget travel".split()
    for i in range(9):
        n = 10 + (i * 7) % 45
        (folder / f"f{i}.md").write_text(" ".join(words[(i + j) % len(words)] for j in range(n)))
        os.utime(folder / f"f{i}.md", (1_700_000_000, 1_700_000_000))
    return folder


@pytest.fixture(scope="session")
def ingested(tmp_path_factory):
    """`docs` ingested once per session for each model and options: a function
    (model, **IngestOptions fields) -> a $STARQA_HOME holding that context (dtype fp32
    unless given, blocks encoded in this process), to be copied into a test's own home
    (`fakes.install_home`). For tests that read, serve or damage a context, never for
    tests of how one is encoded."""
    made: dict = {}

    def once(model: Path, **options) -> Path:
        options = {"dtype": "fp32", **options}
        key = (str(model), tuple(sorted(options.items())))
        if key not in made:
            from starqa import engine

            base = tmp_path_factory.mktemp("ingested")
            docs = write_docs(base / "docs")
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("STARQA_HOME", str(base / "home"))
                patch.delenv("STARQA_MODEL", raising=False)
                engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model),
                                                   encode_in="process", **options))
            made[key] = base / "home"
        return made[key]

    return once


@pytest.fixture
def docs_context(home, docs, tiny_model, ingested):
    """`docs` in this test's home as `ingest(docs, dtype="fp32", block_size=60)` leaves it
    on the tiny model (star, blocks of 60 tokens): a copy of one ingest per session.
    Its manifest."""
    return install_home(ingested(tiny_model, block_size=60), home)


@pytest.fixture(autouse=True)
def no_warm_groups_left(monkeypatch):
    """`starqa ask` run by a test leaves no warm group behind (tests that want one ask for it)."""
    monkeypatch.setenv("STARQA_KEEP_ALIVE", "0")


@pytest.fixture(autouse=True)
def sources_from_random_models(request, monkeypatch):
    """Tiny random models copy too little for a source to stand out (sources.MIN_COPIED);
    tests on them still see sources flow through every path. Tests marked `model` (the
    embedded model) keep the real threshold."""
    if request.node.get_closest_marker("model") is None:
        monkeypatch.setenv("STARQA_MIN_COPIED", "0")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $STARQA_HOME; any warm group a test leaves in it (a failed one too) is
    stopped afterwards, never left running."""
    monkeypatch.setenv("STARQA_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STARQA_MODEL", raising=False)
    yield tmp_path / "home"
    from starqa.workers import client

    for group in client.running():
        if group.socket:
            with contextlib.suppress(Exception):
                client.stop_group(group.key)


# The embedded model the tests run: the smallest (the default, a 1.5B, is for users).
TEST_MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The real embedded test model, fetched and converted once into the user's cache (not
    the per-test STARQA_HOME, so it is converted once per machine, not once per test)."""
    from starqa import models

    return models.resolve_model(TEST_MODEL)


@pytest.fixture
def fake_workers(monkeypatch) -> list[dict]:
    """torchrun replaced by a stand-in that writes each block's shard as a worker would;
    returns the jobs it ran (one per encoding), each with the token ids it was given
    (`job["ids"]`)."""
    import torch
    from safetensors.torch import load_file

    from starqa.launchers.ingest import steps
    from starqa.cache import shards
    from starqa.runtime import protocol

    jobs = []

    def run_workers(job, launch, on_event):
        job = json.loads(protocol.encode_job(job))  # the job as a worker reads it
        ids = load_file(job["tokens_file"])["ids"].tolist() if job.get("tokens_file") else None
        jobs.append({**job, "ids": ids})
        on_event(protocol.Ready(rank=0))
        for i, (start, end) in enumerate(job["blocks"]):
            if i not in job.get("todo", range(len(job["blocks"]))):
                continue  # an incremental ingest's reused block, linked in already
            kv = torch.arange(start, end, dtype=torch.float32).reshape(1, 1, -1, 1)
            shards.save_block(Path(job["staging"]), i, kv, kv + 1, range(start, end), {})
            on_event(protocol.Block(rank=0, index=i, tokens=end - start))

    monkeypatch.setattr(steps, "run_workers", run_workers)
    # A group of one worker on the CPU encodes in the launcher's process instead
    # (`steps._in_process`); tests with the stand-in want the group: it is asked as if for
    # two, so that only a re-ingest's own rule (its few blocks in this process) still holds.
    in_process = steps._in_process
    monkeypatch.setattr(steps, "_in_process",
                        lambda opts, encoder, plan, mode, workers:
                        in_process(opts, encoder, plan, mode, max(workers, 2)))
    return jobs


@pytest.fixture
def contexts(home) -> dict[str, Path]:
    """Three fake contexts (`fakes.make_context`): `docs` used a minute ago, `repo` an
    hour ago, `old` two days ago."""
    now = time.time()
    return {"docs": make_context(home, "docs", "d0c5" + "0" * 12, now - 60),
            "repo": make_context(home, "repo", "4e90" + "0" * 12, now - 3600, (500,), "dense"),
            "old": make_context(home, "old", "01d0" + "0" * 12, now - 2 * 86400)}
