"""Spawning torchrun workers and listening to them.

The launcher writes the job (`starqa.runtime.protocol`) as JSON, starts `python -m
torch.distributed.run ... -m starqa.workers.worker JOB`, turns the workers' event lines into
callbacks, keeps the tail of their stderr, and raises WorkerError (with that tail) if any of
them dies. Every process it starts, and the workers torchrun starts, die with their parent
(`parent_death_signal`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from starqa.core import paths
from starqa.core.errors import ShardError, StarqaError, WorkerError
from starqa.runtime.protocol import Error, Event, Job, Measure, Peak, encode_job, read_event


@dataclass(frozen=True)
class Launch:
    """How to start the worker group (torchrun's own multi-node options pass through)."""
    workers: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    device: str = "auto"


@dataclass
class PerRank:
    """What each rank reported of itself once its phase was done: its peak memory (`Peak`)
    and, in a bench, its numbers (`Measure`)."""

    peaks: dict[int, int] = field(default_factory=dict)
    measures: dict[int, dict] = field(default_factory=dict)

    def hear(self, event: Event) -> None:
        """Keep `event` if it is a rank's report."""
        if isinstance(event, Peak):
            self.peaks[event.rank] = event.bytes
        elif isinstance(event, Measure):
            self.measures[event.rank] = event.row()

    def peak_bytes(self) -> list[int]:
        """Per rank, in rank order."""
        return [self.peaks[r] for r in sorted(self.peaks)]

    def measure_rows(self) -> list[dict]:
        """Per rank, in rank order."""
        return [self.measures[r] for r in sorted(self.measures)]


def cpu_count() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_cores(workers: int, asked: str, override: str) -> None:
    """CPU workers each load their own copy of the model and run it: more than the cores
    only fight over them. `asked` says what was asked for (`--workers 64 (5 for 5
    blocks)`), `override` how to start them anyway (`add --oversubscribe`)."""
    if workers > (cores := cpu_count()):
        raise StarqaError(
            f"{asked} > {cores} CPU cores here: each worker loads its own copy of the model, "
            "and more workers than cores only fight over them.",
            hint=f"pass --workers {cores} or fewer (or leave it out: starqa chooses), or "
                 f"{override} to start {workers} anyway")


def oversubscribed() -> bool:
    """STARQA_OVERSUBSCRIBE=1: start the workers asked for even past the CPU's cores where no
    option says so (Phase 2's groups, `bench`'s simulated hosts). 1, true, yes or on turn it
    on; 0, false, no, off or nothing leave it off; anything else is an error."""
    raw = os.environ.get("STARQA_OVERSUBSCRIBE", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise StarqaError(f"STARQA_OVERSUBSCRIBE={raw!r} is neither on nor off.",
                      hint="export STARQA_OVERSUBSCRIBE=1   (or 0, or unset it)")


def default_workers(device: str = "auto") -> int:
    """All GPUs when there are any (and the device allows), else all cores."""
    if device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    return cpu_count()


def check_gpus(device: str, workers: int) -> None:
    """On CUDA each worker of a host takes a GPU of its own (nccl runs one rank per GPU):
    more workers than GPUs is an error that names the fix, before anything starts."""
    if device not in ("auto", "cuda") and not device.startswith("cuda"):
        return
    if device == "auto" and "torch" not in sys.modules and sys.platform == "linux" \
            and not os.path.exists("/dev/nvidiactl"):
        return  # no NVIDIA driver here: nothing to check, and no torch import to pay for
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 and device != "auto":
        raise StarqaError("--device cuda was asked for, but torch sees no CUDA GPU here.",
                          hint="run on the CPU: add --device cpu")
    if 0 < gpus < workers:
        raise StarqaError(f"{workers} workers on this host need {workers} GPUs (one each), "
                          f"and it has {gpus}.",
                          hint=f"use --workers {gpus}, or run on the CPU with --device cpu")


def torchrun_command(launch: Launch, job_file: str) -> list[str]:
    """The command line that starts `launch`'s workers on the job in `job_file`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={launch.workers}"]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}"]
        if launch.rdzv_endpoint:
            cmd.append(f"--rdzv-endpoint={launch.rdzv_endpoint}")
    return cmd + ["-m", "starqa.workers.worker", job_file]


def run_workers(job: Job, launch: Launch, on_event: Callable[[Event], None]) -> None:
    """Run the job on a torchrun group; calls `on_event` for each event line, in order."""
    check_gpus(launch.device, launch.workers)
    threads = max(1, cpu_count() // launch.workers)  # N workers on C cores: C/N threads each
    env = paths.child_env(OMP_NUM_THREADS=str(threads), STARQA_THREADS=str(threads),
                          PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                          TRANSFORMERS_VERBOSITY="error")
    # One temp folder per run holds the job file and is torchrun's TMPDIR (its
    # `torchelastic_*` folders land there): removed when the run ends, however it ends.
    run_tmp = tempfile.mkdtemp(prefix="starqa-run-")
    job_file = os.path.join(run_tmp, "job.json")
    with open(job_file, "w") as fh:
        fh.write(encode_job(dataclasses.replace(job, device=launch.device)))
    try:
        _run(torchrun_command(launch, job_file), {**env, "TMPDIR": run_tmp}, on_event)
    finally:
        shutil.rmtree(run_tmp, ignore_errors=True)


def _run(cmd: list[str], env: dict, on_event: Callable[[Event], None]) -> None:
    # torchrun runs in its own session (a Ctrl-C reaches it through _kill, once), and dies
    # with this process even when it is killed outright (parent-death signal).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True, bufsize=1, start_new_session=True,
                            preexec_fn=parent_death_signal())
    tail: collections.deque[str] = collections.deque(maxlen=200)
    reader = threading.Thread(target=lambda: tail.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        errors = follow(proc.stdout, on_event, tail)
        proc.wait()
    except BaseException:  # Ctrl-C or a callback failure: take the whole group down
        _kill(proc)
        raise
    finally:
        reader.join(timeout=5)
    check_outcome(errors, proc.returncode, list(tail))


def follow(lines: Iterable[str], on_event: Callable[[Event], None],
           tail: collections.deque[str]) -> list[Error]:
    """Read a worker's output to its end: events (`protocol.emit`) go to `on_event`, error
    events are returned, any other line joins `tail` (what it printed on its own)."""
    errors: list[Error] = []
    for line in lines:
        event = read_event(line)
        if event is None:
            tail.append(line)
        elif isinstance(event, Error):
            errors.append(event)
        else:
            on_event(event)
    return errors


def check_outcome(errors: list[Error], returncode: int, lines: list[str]) -> None:
    """Raise what a finished run of workers failed with, if it failed: a worker's own error
    event first, else how it died with its last lines."""
    if errors:  # a worker explained itself: that message beats any traceback
        # A worker's own failure first: the others then lose it ("Lost ...") as a result.
        first = min(errors, key=lambda e: e.lost)
        kind = {"ShardError": ShardError, "WorkerError": WorkerError}.get(
            first.kind, StarqaError)
        raise kind(first.message, hint=first.hint)
    if returncode != 0:
        raise WorkerError(
            f"A worker died ({_death(lines, returncode)}). Nothing of this run was kept; "
            "the cache is as it was before. The workers' last lines:\n"
            + worker_stderr_tail(lines),
            hint="run the command again; if a worker dies again, its lines above say why "
                 "(killed for memory: try fewer --workers, or a smaller --block-size)")


_TORCHRUN_SUMMARY = re.compile(r"torch[./]distributed[./]elastic|ChildFailedError")


def _death(lines: list[str], returncode: int) -> str:
    """How the first worker died, from torchrun's summary (`exitcode : -9` is a signal)."""
    codes = [int(m.group(1)) for line in lines
             if (m := re.search(r"exitcode\s*:\s*(-?\d+)", line))]
    code = codes[0] if codes else returncode
    if code == -signal.SIGKILL:
        return "killed by SIGKILL, most often the kernel's out-of-memory killer"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def worker_stderr_tail(lines: list[str], keep: int = 25) -> str:
    """The workers' own last stderr lines, before torchrun's failure summary."""
    cut = next((i for i, line in enumerate(lines) if _TORCHRUN_SUMMARY.search(line)), len(lines))
    useful = [ln.rstrip() for ln in lines[:cut] if ln.strip()] or \
             [ln.rstrip() for ln in lines if ln.strip()]
    return "\n".join(useful[-keep:])


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A function that asks the kernel to send `sig` to the calling process when its parent
    exits (Linux `prctl(PR_SET_PDEATHSIG)`; a no-op elsewhere), so a `kill -9` of the
    launcher takes torchrun down, and torchrun's death its workers (issue #11, item 4).
    libc is looked up here, so the returned function is safe as a `preexec_fn` (no dlopen
    between fork and exec). The setting survives exec."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1

    def set_it() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return set_it


def launch_of(opts, workers: int) -> Launch:
    """The `Launch` of an ingest, ask or serve request's options, with `workers` per machine."""
    return Launch(workers, opts.nnodes, opts.node_rank, opts.rdzv_endpoint, opts.device)
