"""Stand-ins that tests share: the `docs` corpus, a committed context written straight into
a cache (no model, no torchrun), a cache copied from one made once per session, the real
`starqa` entry point in a subprocess, and an `engine.ask` that streams given pieces."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from starqa.cache import shards
from starqa.cache.manifest import (IngestRun, Manifest, ModelIdentity, Skipped, PackedFile,
    block_file, read_manifest, write_manifest)
from starqa.methods import MethodConfig


QUESTION = "who approved the travel budget"  # what `write_docs`' corpus is asked
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def write_docs(folder: Path) -> Path:
    """A small corpus in the tiny tokenizer's vocabulary (~200 tokens packed), its files of
    one mtime, so that they are packed in path order (starqa.reingest.packorder)."""
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "travel.md").write_text(
        "the travel budget was approved by the office . " * 6)
    (folder / "policy" / "leave.md").write_text("leave policy is a long document . " * 5)
    (folder / "code.py").write_text("retry limit default is seven \n" * 6)
    for path in folder.rglob("*.*"):
        os.utime(path, (1_700_000_000, 1_700_000_000))
    return folder


def install_home(template: Path, home: Path) -> Manifest:
    """A copy of the cache `template` (a $STARQA_HOME holding one context) made `home`:
    modes, times and the hard links between a context's shards and the block store kept
    (`cp -a`), so the copy is what the ingest left. Returns the context's manifest."""
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", f"{template}/.", str(home)], check=True)
    [folder] = [f for f in (home / "contexts").iterdir() if not f.name.startswith(".")]
    return read_manifest(folder)


def make_context(home: Path, name: str, key: str, used: float, block_bytes=(1000, 600),
                 method: str = "star") -> Path:
    """A committed context with len(block_bytes) blocks of 100 tokens, last used at `used`."""
    folder = home / "contexts" / key
    folder.mkdir(parents=True)
    for i, size in enumerate(block_bytes):
        (folder / block_file(i)).write_bytes(b"\0" * size)
    n = 100 * len(block_bytes)
    write_manifest(folder, Manifest(
        key=key, name=name, created=used - 3600, sources=(f"/data/{name}",),
        command=f"starqa ingest /data/{name}",
        model=ModelIdentity(path="/models/tiny-llama", spec="tiny-llama", window=8192,
                            name="tiny-llama", config_sha256="c" * 64, weights_sha256="e" * 64,
                            tokenizer_sha256="f" * 64, digest="ab" * 32),
        dtype="bfloat16", method=MethodConfig(method, 100, 100 if method == "star" else 0),
        content_sha256="cd" * 32, n_tokens=n, query_position=n,
        blocks=shards.hash_blocks(folder, [(100 * i, 100 * (i + 1))
                                           for i in range(len(block_bytes))]),
        files=(PackedFile(path="a.md", token_start=0, token_end=n - 30, lines=12, bytes=400,
                          line_tokens=tuple(range(0, n - 30, 20))),
               PackedFile(path="b.py", token_start=n - 30, token_end=n, lines=3, bytes=90,
                          line_tokens=(n - 30, n - 20, n - 10))),
        skipped=(Skipped(path="logo.png", reason="binary"),),
        ingest=IngestRun(workers=2, encode_seconds=1.5, tokens_per_second=n / 1.5)))
    (folder / ".last_used").write_text(str(used))
    os.utime(folder / ".last_used", (used, used))
    return folder


def starqa(*args: str, home: Path | None = None, env: dict | None = None,
           input: str | None = None, timeout: float = 300,
           columns: int = 200) -> subprocess.CompletedProcess:
    """`python -m starqa *args`, the real entry point (StarqaError → `error: ...`, exit 1),
    in a subprocess: its output captured as text, its exit status left to the test (never
    raised), stdin empty unless `input` is given. It runs in this process's environment
    (the test's $STARQA_HOME, `conftest.home`) with `env` added, $STARQA_HOME set to `home`
    if given, and $COLUMNS to `columns` (the width its lines are laid out for)."""
    env = {**os.environ, "COLUMNS": str(columns),
           **({"STARQA_HOME": str(home)} if home is not None else {}), **(env or {})}
    return subprocess.run([sys.executable, "-m", "starqa", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL)


def stub_ask(pieces, monkeypatch=None):
    """engine.ask replaced by one that streams `pieces` as the model's tokens (its sources
    line names a file with an escape sequence in its name); returned, and set on `engine`
    with `monkeypatch`."""
    from starqa import engine
    from starqa.cache import store
    from starqa.cache.context import Context
    from starqa.core import paths
    from starqa.phase2.answer import Answer, Source, Timings

    def ask(opts, ui, head=None):
        manifest = store.find_context(paths.contexts_dir(), opts.context)
        for piece in pieces:
            ui.token(piece)
        return Answer(text="".join(pieces), context=Context.of(manifest),
                      token_ids=tuple(range(len(pieces))), question_tokens=3,
                      sources=(Source("src\x1b[2J.py", 0.5, (1, 2)),),
                      timings=Timings(total_s=0.1, first_token_s=0.05, prefill_s=0.05,
                                      decode_s=0.05),
                      finish="stop", warm=False, workers=1)
    if monkeypatch is not None:
        monkeypatch.setattr(engine, "ask", ask)
    return ask
