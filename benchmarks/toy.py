"""What every benchmark's `--smoke` runs on: a toy model and a toy corpus in a scratch
$STARQA_HOME, so that a benchmark goes through its real code path end to end in seconds on
any CPU and prints its numbers (which mean nothing at this size: the run is the point).

- `model`: the tiny random Llama of tests/tiny.py (2 layers, hidden 64, a 512-token window,
  a word-level tokenizer), its vocabulary padded to 16 so that int4 weights take it;
- `corpus`: a few files of that vocabulary, a few hundred tokens in all;
- `scratch`: a temporary folder made $STARQA_HOME for this process and every command it
  starts (the user's cache is never touched), removed at exit.

Not a benchmark itself: `.ci/benchmarks` runs the benchmarks that import it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/tiny.py: the tiny models of the unit tests

from tiny import WORDS, make_tiny_model  # noqa: E402

TOKENS = 200  # words in a smoke run's corpus: about 300 tokens packed, in a 512-token window


def scratch(prefix: str) -> Path:
    """A fresh temporary folder, its `home` made $STARQA_HOME; removed when Python exits."""
    folder = Path(tempfile.mkdtemp(prefix=f"starqa-smoke-{prefix}-"))
    os.environ["STARQA_HOME"] = str(folder / "home")
    os.environ.pop("STARQA_MODEL", None)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def model(folder: Path, **options) -> Path:
    """The tiny random Llama of tests/tiny.py in `folder/tiny-llama` (options: those of
    `make_tiny_model`, e.g. never_stops)."""
    return make_tiny_model(folder / "tiny-llama", vocab_multiple=16, **options)


def corpus(folder: Path, tokens: int = TOKENS, files: int = 6) -> Path:
    """`files` text files of the tiny model's words, about `tokens` tokens in all."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = max(tokens // files, 8)
    for i in range(files):
        words = [WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(per_file)]
        lines = [" ".join(words[k:k + 12]) for k in range(0, len(words), 12)]
        (folder / f"doc{i}.md").write_text("\n".join(lines) + "\n")
    return folder


def banner(name: str) -> None:
    """The line that says a run is a smoke run, so its numbers are read as such."""
    print(f"{name} --smoke: a toy model and context; the numbers below only show the run "
          "went through", flush=True)
