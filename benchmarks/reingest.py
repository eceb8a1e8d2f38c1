"""Incremental re-ingest against a full ingest of the same new version (issue #14), side by
side in one run, each timed as the user waits for it: `python -m starqa ingest ...` as a
subprocess, so process start, imports, model load and (for a group) torchrun are included.

Scenarios:
  samples   samples/ ingested, then one file in the middle edited (a line appended)
  package   a real package nobody here wrote, two consecutive releases (sdists downloaded
            with pip, their files' mtimes as packed): release A ingested, the folder
            replaced by release B, re-ingested

For each: the incremental re-ingest of the new version (into the cache that holds the old
one) and a full ingest of the new version (a fresh cache), blocks reused / re-rotated /
encoded, the wall times and their ratio (target: ≤ 0.25 when one file of ~30 changed).

    python benchmarks/reingest.py [--model smollm2-135m] [--method star]
        [--block-size 2048] [--package cachetools==5.5.0,5.5.1 ...] [--workers N]
        [--exclude GLOB ...]
    python benchmarks/reingest.py --smoke   # toy model and corpus, no package download

Timing: run it on CPU cores nothing else uses (a full ingest's workers take every core;
the incremental one encodes its few blocks in the launcher, on the CPU). Contexts longer
than the model's window are ingested with --beyond-window (timing only; answers are not
looked at).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                  if line.startswith("Model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines()
                  if line.startswith("Flags")), [])
    has = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}; {os.cpu_count()} cores; " + (", ".join(has) or "no avx512_bf16/amx")


def ingest(home: Path, folder: Path, args) -> tuple[float, str]:
    """One `starqa ingest` as a user runs it: (wall seconds, its report)."""
    command = [sys.executable, "-m", "starqa", "ingest", str(folder), "--model", args.model,
               "--method", args.method, "--block-size", str(args.block_size),
               "--beyond-window", "--name", "bench"]
    if args.workers:
        command += ["--workers", str(args.workers)]
    for pattern in args.exclude:
        command += ["--exclude", pattern]
    env = {**os.environ, "STARQA_HOME": str(home), "STARQA_KEEP_ALIVE": "0",
           "COLUMNS": "200"}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"ingest failed:\n{done.stderr[-3000:]}")
    return seconds, done.stderr


def counts(report: str) -> str:
    flat = " ".join(report.split())
    found = re.search(r"Re-ingested \S+: (.*?) in [0-9.]+ s", flat)
    if found:
        return found.group(1)
    blocks = re.search(r"(\d+) blocks on", flat)
    return f"{blocks.group(1) if blocks else '?'} blocks, all encoded"


def tokens(report: str) -> str:
    found = re.search(r"([0-9,]+) tokens, \d+ blocks", " ".join(report.split()))
    return found.group(1) if found else "?"


def scenario(name: str, old: Path, new: Path, work: Path, args) -> dict:
    """Old version ingested; the same folder turned into the new one and re-ingested; the
    new one ingested in a fresh cache."""
    src = work / name / "src"  # the same path for both versions: a re-ingest of one folder
    shutil.rmtree(src.parent, ignore_errors=True)
    shutil.copytree(old, src)
    home = work / name / "home"
    first, _ = ingest(home, src, args)
    shutil.rmtree(src)
    shutil.copytree(new, src)
    incremental, report = ingest(home, src, args)
    full, full_report = ingest(work / name / "fresh-home", src, args)
    return {"scenario": name, "tokens": tokens(full_report), "first": first,
            "incremental": incremental, "full": full, "what": counts(report)}


def samples_edit(work: Path, source: Path = ROOT / "samples") -> tuple[Path, Path]:
    """A copy of `source` (samples/), and a second one with a line added to one file in the
    middle of the context."""
    old = work / "samples-old"
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(source, old, ignore=shutil.ignore_patterns("questions.jsonl"))
    new = work / "samples-new"
    shutil.rmtree(new, ignore_errors=True)
    shutil.copytree(old, new)
    files = sorted(p for p in new.rglob("*") if p.is_file())
    edited = files[len(files) // 2]  # one file in the middle of the context
    edited.write_text(edited.read_text() + "\n# edited: one more line for the benchmark\n")
    print(f"samples: {len(files)} files, edited {edited.relative_to(new)}")
    return old, new


def package(spec: str, work: Path) -> tuple[Path, Path]:
    name, versions = spec.split("==")
    folders = []
    for version in versions.split(","):
        dest = work / "sdists"
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"{name}=={version}", "-d", str(dest)],
                       check=True)
        archive = next(dest.glob(f"{name.replace('-', '?')}-{version}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        folders.append(dest / archive.name.removesuffix(".tar.gz"))
    old, new = folders
    changed = [p.relative_to(new) for p in sorted(new.rglob("*")) if p.is_file()
               and (not (old / p.relative_to(new)).exists()
                    or (old / p.relative_to(new)).read_bytes() != p.read_bytes())]
    total = sum(1 for p in new.rglob("*") if p.is_file())
    print(f"{name} {versions}: {total} files, {len(changed)} changed or added: "
          + ", ".join(map(str, changed)))
    return old, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="star")
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--package", action="append", default=None,
                        help="NAME==OLD,NEW, repeatable (default: cachetools==5.5.0,5.5.1; "
                             "'' for none)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="passed to every ingest (e.g. CHANGELOG.rst, PKG-INFO)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temp one)")
    parser.add_argument("--smoke", action="store_true",
                        help="a toy model and a few hundred tokens of toy files, no packages")
    args = parser.parse_args()
    source = ROOT / "samples"
    if args.smoke:
        import toy

        toy.banner("reingest")
        work = toy.scratch("reingest")
        args.model, args.block_size, args.package = str(toy.model(work)), 64, [""]
        source = toy.corpus(work / "toy")
    else:
        work = Path(args.work or tempfile.mkdtemp(prefix="starqa-reingest-"))
    print(f"CPU: {cpu()}")
    print(f"model {args.model}, method {args.method}, block {args.block_size}, "
          f"workers {args.workers or 'default'}; scratch {work}")
    rows = [scenario("samples", *samples_edit(work, source), work, args)]
    for spec in args.package or ["cachetools==5.5.0,5.5.1"]:
        if spec:
            name, versions = spec.split("==")
            label = f"{name}-{versions.split(',')[-1]}"  # the release re-ingested
            rows.append(scenario(label, *package(spec, work), work, args))
    print(f"\n{'scenario':<18} {'tokens':>8} {'first s':>8} {'incr. s':>8} {'full s':>8} "
          f"{'incr/full':>9}  blocks")
    for r in rows:
        print(f"{r['scenario']:<18} {r['tokens']:>8} {r['first']:>8.1f} {r['incremental']:>8.1f} "
              f"{r['full']:>8.1f} {r['incremental'] / r['full']:>9.2f}  {r['what']}")


if __name__ == "__main__":
    main()
