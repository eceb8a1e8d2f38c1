"""A cold `ask`'s worker, forked the moment the command starts.

A cold ask on one machine answers as a world of one. Most of its wait for the first token is
`import torch`: ~0.65 s of ~1 s on a 2-core CPU, which the command used to
start only after it had imported its own modules, parsed its arguments, read the manifest,
checked the model and tokenized the question (~0.2 s of Python, on one core). Now the entry
point (`starqa.__main__`) forks this process first, before anything but the standard library
is imported, when the command is an `ask` that no warm group will answer: the child imports
torch and Phase 2 on the other core while the parent does its part, then waits for its job.
`ask` takes it (`take`), hands it the job (`HeadStart.run`) and reads the event lines a
torchrun rank writes (`starqa.workers.worker.run_job`, the same Phase 2 path as every other way
in; the job and the events are `starqa.runtime.protocol`'s, the job one line on a pipe).
An ask that ends any other way (a warm group answered, more than one worker, an error,
`--help`) lets go of it (`discard`, also at exit): the child sees its job pipe close and
exits without a word.

Once it has answered an ask with a keep-alive, the child goes on as the context's warm group
(`_serve_on`: `starqa.launchers.serve.serve` with the model and shard it holds), in a session of its
own, instead of the command starting `starqa serve` to load them again. Until then it never
outlives the command: the kernel kills it when the parent dies (even by SIGKILL), and
Ctrl-C interrupts it as it does the command (what it prints goes to the pipe, which the
interrupted command no longer reads). Linux only (fork with a plain libc); elsewhere, and
with `STARQA_HEADSTART=0`, the ask answers in its own process as before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: this module loads before all but the standard library
    from starqa.runtime.protocol import AskJob, Event, ThenServe

_pending: HeadStart | None = None
GRACE_S = 5.0  # seconds an interrupted child has to finish its cleanup


class HeadStart:
    """The parent's handle on the forked child: its pid, the pipe that carries the job to it
    and the pipe its output (event lines, and anything it prints) comes back on."""

    def __init__(self, pid: int, job_fd: int, out_fd: int):
        self.pid = pid
        self._job = os.fdopen(job_fd, "w")
        self._out = os.fdopen(out_fd, "r", errors="replace")
        self.serving = False  # the child went on as the context's warm group

    def run(self, job: AskJob, on_event: Callable[[Event], None]) -> None:
        """Run `job` on the child: calls `on_event` for each event, in order; raises what the
        worker failed with. A job with `then_serve` (the ask's keep-alive, weights, workers
        and attention) has the child, once it has answered, go on as the context's warm
        group (`serving`), in its own session, with the model and shard it has loaded:
        nothing to start again."""
        import collections

        from starqa.runtime.launch import check_outcome, follow
        from starqa.runtime.protocol import Serving, encode_job

        tail: collections.deque[str] = collections.deque(maxlen=200)

        def seen(event: Event) -> None:
            if isinstance(event, Serving):
                self.serving = True
            else:
                on_event(event)

        try:
            self._job.write(encode_job(job) + "\n")
            self._job.close()
            errors = follow(self._out, seen, tail)
            # a child that serves on has let go of the pipe; it is no longer this command's
            status = 0 if self.serving and not errors else os.waitpid(self.pid, 0)[1]
            self.pid = 0
        except BaseException:  # Ctrl-C or a callback failure: the child goes too
            self.close()
            raise
        self._out.close()
        check_outcome(errors, os.waitstatus_to_exitcode(status), list(tail))

    def close(self) -> None:
        """End the child, if it still runs, and close the pipes. One that has its job is
        interrupted as Ctrl-C would (its `finally` blocks run: a weights file it was
        preparing is not left half written) and killed if it has not gone within
        `GRACE_S`; one without a job has nothing to finish and is killed at once."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGINT if self._job.closed else signal.SIGKILL)
                deadline = time.monotonic() + GRACE_S
                while not os.waitpid(self.pid, os.WNOHANG)[0]:
                    if time.monotonic() > deadline:
                        os.kill(self.pid, signal.SIGKILL)
                        os.waitpid(self.pid, 0)
                        break
                    time.sleep(0.01)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = 0
        for pipe in (self._job, self._out):
            try:
                pipe.close()
            except OSError:  # a broken pipe flushed at close
                pass


def fork_for(argv: list[str]) -> None:
    """Fork the head start when `argv` (the command's arguments) is an ask that no running
    warm group will answer; else do nothing."""
    global _pending
    if _pending is not None or not _wanted(argv):
        return
    try:
        job_r, job_w = os.pipe()
        out_r, out_w = os.pipe()
    except OSError:  # out of file descriptors: the ask answers in its own process
        return
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:  # out of processes or memory: likewise
        for fd in (job_r, job_w, out_r, out_w):
            os.close(fd)
        return
    if pid == 0:  # the child: never returns
        os.close(job_w)
        os.close(out_r)
        _child(parent, job_r, out_w)
    os.close(job_r)
    os.close(out_w)
    _pending = HeadStart(pid, job_w, out_r)
    import atexit

    atexit.register(discard)


def take() -> HeadStart | None:
    """The head start, now the caller's to run (once); None when there is none."""
    global _pending
    head, _pending = _pending, None
    return head


def discard() -> None:
    """Let go of a head start nobody took: its child exits."""
    if (head := take()) is not None:
        head.close()


def _wanted(argv: list[str]) -> bool:
    if not argv or argv[0] != "ask" or any(a in ("--help", "-h") for a in argv):
        return False
    if not sys.platform.startswith("linux") or os.environ.get("STARQA_HEADSTART") == "0":
        return False
    # asked for more than a world of one here: torchrun answers
    for option, variable in (("--nnodes", "STARQA_NNODES"), ("--workers", "STARQA_WORKERS"),
                             ("-w", "STARQA_WORKERS")):
        if _option(argv, option, os.environ.get(variable, "1")).strip() != "1":
            return False
    cold = "--cold" in argv or os.environ.get("STARQA_COLD", "").lower() in ("1", "true")
    return cold or not _groups_running()


def _option(argv: list[str], name: str, default: str) -> str:
    """The value `argv` gives option `name` (`--name VALUE` or `--name=VALUE`), else
    `default`."""
    value = default
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _groups_running() -> bool:
    """Whether any warm group may be running on this machine (a run file whose launcher is
    alive): then the ask is likely warm, and a child importing torch would only slow the
    group down. Read by hand: `starqa.workers.client` imports more than this moment can afford."""
    from starqa.core import paths
    from starqa.core.errors import StarqaError

    try:
        files = [f for folder in paths.run_dirs() for f in folder.glob("*.json")]
    except (StarqaError, OSError):  # a bad cache root: the command will say so
        return True
    for file in files:
        try:
            os.kill(int(json.loads(file.read_text())["pid"]), 0)
            return True
        except PermissionError:  # alive, someone else's
            return True
        except (OSError, ValueError, KeyError, TypeError):  # gone, or not a run file
            continue
    return False


def _serve_on(settings: ThenServe, job: AskJob) -> Callable:
    """What the child does once it has answered an ask whose keep-alive leaves a warm group:
    it becomes that group (`starqa.launchers.serve.serve`, with the Answerer it holds), as `starqa
    serve` would have been started to (`starqa.workers.client.spawn`, which loads the model and
    shard again: a second of CPU, during which the next question was cold). Once the group
    listens and its run file is written, it tells the command so (which then ends: the next
    ask finds the group) and leaves the command's session and output (its own go to the
    group's log, as a spawned group's do); it no longer dies with the command. Where a group
    runs or starts for the context already, it just exits."""

    def serve_on(answerer) -> None:
        from starqa.workers import client
        from starqa.launchers.serve import ServeOptions, serve
        from starqa.core.errors import StarqaError
        from starqa.runtime.launch import parent_death_signal
        from starqa.runtime.protocol import Serving, emit
        from starqa.topk.indexes import topk_of
        from starqa.cache.manifest import read_manifest

        key = read_manifest(Path(job.context_dir)).key
        try:
            held = client.claim(key)
            if held is None or client.find(key) is not None:  # one runs or starts already
                if held is not None:
                    held.close()
                return
            log = os.open(client.run_dir() / f"{key}.log",
                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except (StarqaError, OSError):  # nowhere to run a group from: the answer stands
            return

        detached = []

        def ready(info: dict) -> None:
            detached.append(True)
            emit(Serving(pid=os.getpid()))
            sys.stdout.flush()
            sys.stderr.flush()
            os.setsid()  # Ctrl-C at the terminal is the command's, no longer this group's
            parent_death_signal(0)()
            os.dup2(log, 1)  # the pipe closes: the command's `follow` ends
            os.dup2(log, 2)
            os.close(log)

        try:
            serve(ServeOptions(context=key, workers=settings.workers,
                               keepalive=settings.keepalive, device=job.device,
                               weights=settings.weights, topk=topk_of(settings.topk)),
                  on_ready=ready, answerer=answerer, claim=held)
        except Exception as err:
            if detached:
                raise  # the group's own failure: its log says it
            # the answer stands: the command ends without a group; the log says why (where
            # it can: a full disk that stopped the group's run file stops this line too)
            try:
                os.write(log, f"The cold ask's process could not go on as the group: {err}\n"
                         .encode())
            except OSError:
                pass
            os.close(log)

    return serve_on


def _import_torch():
    """Start importing torch on a thread of its own; returns the thread. The main thread
    meanwhile waits for the job and runs the question's forward without torch
    (starqa.coldstart.firsttoken): its kernels release the GIL, and the interpreter hands the GIL
    back every 0.1 ms instead of every 5 (each of the forward's ~300 kernel calls would
    otherwise wait up to 5 ms for the importing thread to let go of it)."""
    import threading

    def run() -> None:
        import torch  # noqa: F401

    sys.setswitchinterval(1e-4)
    thread = threading.Thread(target=run, name="import torch", daemon=True)
    thread.start()
    return thread


def _first_token(job: AskJob, firsttoken, emit, importing) -> object | None:
    """starqa.coldstart.firsttoken's `prefill` of the job (the first token, streamed before torch is
    there), or None where it does not apply or failed: the torch path then answers from the
    start (and reports any error in the context's files as it would have). While torch is
    still importing (`importing` alive, on a core of its own) the forward keeps to one
    thread: a second would share the importing core, and every kernel call would wait for
    it at its end (2-core Zen 5, SmolLM2, 16 tokens: 0.25 s on two threads, 0.12 s on one)."""
    from starqa.core.errors import StarqaError

    try:
        return firsttoken.prefill(job, emit, threads=1 if importing.is_alive() else None)
    except StarqaError:  # a damaged context: the torch path finds it and says so
        return None
    except Exception:  # the torch path is the reference: it answers, or says what is wrong
        import traceback

        traceback.print_exc()
        return None
    finally:
        sys.setswitchinterval(0.005)  # Python's default


def _child(parent: int, job_fd: int, out_fd: int) -> None:
    """The forked process: import, wait for the job, run it, exit. Its stdout and stderr
    are the output pipe (event lines, and whatever torch prints); stdin is /dev/null."""
    code = 1
    try:
        from starqa.core import gcpause
        from starqa.runtime.launch import parent_death_signal

        parent_death_signal(signal.SIGKILL)()
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        for fd in (null, out_fd):
            os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        gcpause.pause()  # Answerer.from_cache settles it
        # Everything this thread imports, imported before torch starts on another: two
        # threads importing modules that import each other can deadlock.
        from starqa.coldstart import firsttoken
        from starqa.runtime.protocol import decode_job, emit
        from starqa.workers import worker

        importing = _import_torch()  # the point: while the parent parses and tokenizes

        with os.fdopen(job_fd) as pipe:
            line = pipe.readline()
        if line:  # else the parent let go: nothing to do
            job = decode_job(line)
            early = _first_token(job, firsttoken, emit, importing)
            importing.join()
            from starqa.runtime import dist

            then = job.then_serve
            code = worker.run_job(job, dist.local_world(job.device),
                                  after=_serve_on(then, job) if then else None,
                                  prefilled=early)
        else:
            code = 0
    except BaseException:  # nothing may escape into the parent's code (a forked copy)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
