import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py

from fakes import make_context  # noqa: E402
from tiny import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def docs(tmp_path) -> Path:
    """A small corpus in the tiny tokenizer's vocabulary (~200 tokens packed)."""
    folder = tmp_path / "docs"
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "travel.md").write_text(
        "the travel budget was approved by the office . " * 6)
    (folder / "policy" / "leave.md").write_text("leave policy is a long document . " * 5)
    (folder / "code.py").write_text("retry limit default is seven \n" * 6)
    for path in folder.rglob("*.*"):  # one mtime: packed in path order (starqa.reingest.packorder)
        os.utime(path, (1_700_000_000, 1_700_000_000))
    return folder


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
        if group.get("socket"):
            with contextlib.suppress(Exception):
                client.stop_group(group["key"])


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The real embedded model, fetched and converted once into the user's cache (not the
    per-test STARQA_HOME, so it is converted once per machine, not once per test)."""
    from starqa import models

    return models.resolve_model(models.DEFAULT_MODEL)


@pytest.fixture
def fake_workers(monkeypatch) -> list[dict]:
    """torchrun replaced by a stand-in that writes each block's shard as a worker would;
    returns the jobs it ran (one per encoding), each with the token ids it was given
    (`job["ids"]`)."""
    import torch
    from safetensors.torch import load_file

    from starqa.launchers import ingest as ingest_mod
    from starqa.cache import shards

    jobs = []

    def run_workers(job, launch, on_event):
        ids = load_file(job["tokens_file"])["ids"].tolist() if job.get("tokens_file") else None
        jobs.append({**job, "ids": ids})
        on_event({"event": "ready", "rank": 0})
        for i, (start, end) in enumerate(job["blocks"]):
            if i not in job.get("todo", range(len(job["blocks"]))):
                continue  # an incremental ingest's reused block, linked in already
            kv = torch.arange(start, end, dtype=torch.float32).reshape(1, 1, -1, 1)
            shards.save_block(Path(job["staging"]), i, kv, kv + 1, range(start, end), {})
            on_event({"event": "block", "tokens": end - start})

    monkeypatch.setattr(ingest_mod, "run_workers", run_workers)
    return jobs


@pytest.fixture
def contexts(home) -> dict[str, Path]:
    """Three fake contexts (`fakes.make_context`): `docs` used a minute ago, `repo` an
    hour ago, `old` two days ago."""
    now = time.time()
    return {"docs": make_context(home, "docs", "d0c5" + "0" * 12, now - 60),
            "repo": make_context(home, "repo", "4e90" + "0" * 12, now - 3600, (500,), "dense"),
            "old": make_context(home, "old", "01d0" + "0" * 12, now - 2 * 86400)}
