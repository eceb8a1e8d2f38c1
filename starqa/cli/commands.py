"""The command table (each command registered on `app.py`'s Typer app, in the order
`--help` lists them) and the `starqa` command's entry (`run`, `main`): errors reported as
the CLI reports them, with --json as a JSON object too."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import typer

import starqa.cli.asking as asking
import starqa.cli.contexts as contexts
import starqa.cli.measuring as measuring
import starqa.cli.serving as serving
from starqa.cli.app import app, sigterm_interrupts

app.command()(contexts.ingest)
app.command()(asking.ask)
app.command("list")(contexts.list_)
app.command()(contexts.info)
app.command()(contexts.rm)
app.command()(contexts.cache)
app.command()(serving.serve)
app.command("mcp")(serving.mcp_)
app.command()(serving.ps)
app.command()(serving.stop)
app.command()(asking.chat)
app.command("index")(contexts.index_)
app.command()(measuring.bench)
app.command("eval")(measuring.eval_)


def run() -> None:
    """The `starqa` command: `main`, then a quick exit. Once torch is imported, the
    interpreter's own teardown (freeing every module, torch's static state) takes another
    0.4-0.6 s after the answer is out. By the time `main` returns, every file starqa wrote
    is closed and renamed into place, so the exit runs the atexit hooks, flushes the
    streams and ends the process without the teardown. A non-daemon thread still running
    gets the ordinary exit, which waits for it."""
    import atexit
    import threading

    from starqa.core import gcpause

    gcpause.pause()  # until the model is loaded: a cold answer's first token sooner
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if "torch" not in sys.modules or others:
        sys.exit(code)
    if not isinstance(code, int):  # sys.exit("message") or sys.exit(None)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`starqa ask ... | head -1`)
            pass
    os._exit(code)


def main() -> None:
    """Runs the command line: its exit code, Ctrl-C and SIGTERM as 130, a `StarqaError` or a
    full or read-only disk as a message and a hint (a JSON object too under --json),
    anything else as an unexpected error."""
    from starqa.core.errors import StarqaError, disk_full

    as_json = wants_json(sys.argv[1:])
    try:
        # Without standalone mode, typer hands back typer.Exit's code, and Ctrl-C as 130,
        # instead of raising them.
        with sigterm_interrupts():
            code = app(standalone_mode=False)
    except StarqaError as err:
        _fail(err, 1, as_json)
    except KeyboardInterrupt:
        code = 130
    except OSError as err:
        from starqa.core.paths import read_only

        if (known := disk_full(err, "starqa") or read_only(err)) is None:
            _unexpected(err, as_json)
        _fail(known, 1, as_json)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as err:  # usage errors: bad option, missing argument
        err.show()
        if as_json:
            _json_error(err.format_message() if hasattr(err, "format_message") else str(err),
                        _help_command(sys.argv[1:]))
        sys.exit(err.exit_code)
    except Exception as err:
        _unexpected(err, as_json)
    if code == 130:
        print("\ninterrupted; nothing was changed on disk", file=sys.stderr)
        if as_json:
            _json_error("interrupted; nothing was changed on disk", None)
    if isinstance(code, int) and code:
        sys.exit(code)


# Commands whose --json makes their result one JSON object on stdout (bench's and eval's
# --json name a file to write instead).
JSON_COMMANDS = frozenset({"ask", "list", "info", "cache", "ps"})


def _options(args: list[str]) -> tuple[str | None, list[str]]:
    """(the command, the words before `--`) of a command line, before it is parsed."""
    words = args[:args.index("--")] if "--" in args else args
    return next((w for w in words if not w.startswith("-")), None), words


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON on stdout (`--json`, or STARQA_JSON for
    `ask`), read from the words before they are parsed, so that an option the parser
    refuses is still answered in JSON."""
    command, words = _options(args)
    if command not in JSON_COMMANDS:
        return False
    return "--json" in words or (command == "ask" and os.environ.get(
        "STARQA_JSON", "").strip().lower() in ("1", "true", "t", "yes", "y", "on"))


def _help_command(args: list[str]) -> str:
    """`starqa ask --help`: the help of the command a usage error is about."""
    command, _ = _options(args)
    return f"starqa {command} --help" if command in JSON_COMMANDS else "starqa --help"


def _json_error(message: str, hint: str | None) -> None:
    """`{"error": ..., "hint": ...}` on stdout: what a script reading --json output gets
    instead of a result (the human message stays on stderr)."""
    with contextlib.suppress(OSError, ValueError):  # stdout closed: stderr said it
        print(json.dumps({"error": message, "hint": hint}, indent=1), flush=True)


def _fail(error, code: int, as_json: bool):
    """A StarqaError reported (stderr; and stdout in JSON with --json), then exit `code`."""
    from starqa.cli.ui import print_error

    print_error(error)
    if as_json:
        _json_error(str(error), error.hint)
    sys.exit(code)


def _unexpected(error: BaseException, as_json: bool):
    """A fault of starqa's own: its traceback, as ever; with --json also a JSON error on
    stdout, so that a script never reads an empty result."""
    if not as_json:
        raise error
    import traceback

    traceback.print_exception(error, file=sys.stderr)
    _json_error(f"internal error: {type(error).__name__}: {error}", None)
    sys.exit(1)
