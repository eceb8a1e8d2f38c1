"""Stand-ins that tests share: a committed context written straight into a cache (no
model, no torchrun) and the real `starqa` entry point in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

from starqa.cache import shards
from starqa.cache.manifest import (IngestRun, Manifest, ModelIdentity, Skipped, SourceFile,
    block_file, write_manifest)
from starqa.methods import MethodConfig


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
        files=(SourceFile(path="a.md", token_start=0, token_end=n - 30, lines=12, bytes=400,
                          line_tokens=tuple(range(0, n - 30, 20))),
               SourceFile(path="b.py", token_start=n - 30, token_end=n, lines=3, bytes=90,
                          line_tokens=(n - 30, n - 20, n - 10))),
        skipped=(Skipped(path="logo.png", reason="binary"),),
        ingest=IngestRun(workers=2, encode_seconds=1.5, tokens_per_second=n / 1.5)))
    (folder / ".last_used").write_text(str(used))
    os.utime(folder / ".last_used", (used, used))
    return folder


def starqa(*args: str, home: Path) -> subprocess.CompletedProcess:
    """The real entry point (StarqaError → `error: ...`, exit 1) in a subprocess."""
    env = {**os.environ, "STARQA_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "starqa", *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
