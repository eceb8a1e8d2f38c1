"""Where starqa keeps its cache: models it converted and the ingested contexts."""

import contextlib
import contextvars
import errno
import hashlib
import os
import shlex
import stat
from pathlib import Path

from starqa.core.errors import StarqaError

# A cache root set for this thread's calls (`using_home`: the API's `Client(home=...)`),
# before $STARQA_HOME; a Stream's thread starts with its creator's.
_HOME: contextvars.ContextVar[Path | None] = contextvars.ContextVar("starqa_home", default=None)


@contextlib.contextmanager
def using_home(root: str | os.PathLike):
    """Within the block, `home()` is `root` for this thread (and the processes it starts:
    `child_env`), whatever $STARQA_HOME says."""
    token = _HOME.set(Path(root).expanduser().absolute())
    try:
        yield
    finally:
        _HOME.reset(token)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process starqa starts: this one's, with $STARQA_HOME naming the
    cache root in use where `using_home` set one, and `extra`."""
    root = _HOME.get()
    return {**os.environ, **({"STARQA_HOME": str(root)} if root is not None else {}), **extra}


def home() -> Path:
    """Cache root: `$STARQA_HOME`, else `$XDG_CACHE_HOME/starqa`, else `~/.cache/starqa`.
    A root that is a file (or lies below one) is an error that names the variable."""
    if (chosen := _HOME.get()) is not None:
        root, source = chosen, "Client(home=...)"
    elif env := os.environ.get("STARQA_HOME"):
        root, source = Path(env).expanduser(), "STARQA_HOME"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "starqa"
        source = "XDG_CACHE_HOME" if xdg else "the home folder's .cache"
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise StarqaError(f"starqa's cache folder {root} (from {source}) cannot be made: "
                          f"{blocker} is a file, not a folder.",
                          hint="point STARQA_HOME at a folder, e.g. export "
                               "STARQA_HOME=~/.cache/starqa")
    return root


def models_dir() -> Path:
    return home() / "models"


def contexts_dir() -> Path:
    return home() / "contexts"


# ---------------------------------------------------------------------------------------
# warm groups: run files, locks, logs (the run folder) and sockets (the socket folder)

SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX path on Linux (sun_path is 108, NUL included)


def home_id() -> str:
    """16 hex digits naming this cache root (its resolved path) in folders shared by roots."""
    return hashlib.sha256(str(home().resolve()).encode()).hexdigest()[:16]


def _socket_folder() -> Path:
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and os.path.isdir(runtime) \
            and len(os.fsencode(runtime)) <= SOCKET_PATH_MAX - 40:
        return Path(runtime) / "starqa"
    return Path("/tmp") / f"starqa-{uid}"


def socket_dir() -> Path:
    """A short folder only this user can enter, for warm groups' sockets: a socket path
    must fit AF_UNIX's 107 bytes whatever the length of $STARQA_HOME (issue 45, item 5).
    `$XDG_RUNTIME_DIR/starqa` where that is set and short, else `/tmp/starqa-<uid>`; made
    mode 0700, and refused unless it is a real folder (not a symlink) owned by this user
    (someone else may have made it first in /tmp); access for others is taken away."""
    uid = os.getuid()
    folder = _socket_folder()
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    problem = ("is a symlink" if stat.S_ISLNK(st.st_mode)
               else "is not a folder" if not stat.S_ISDIR(st.st_mode)
               else f"belongs to another user (uid {st.st_uid})" if st.st_uid != uid
               else None)
    if problem:
        raise StarqaError(
            f"The folder for warm groups' sockets, {folder}, {problem}: starqa will not put "
            "its sockets where another user could reach or replace them.",
            hint="use a private folder of your own for them: mkdir -m 700 -p ~/.starqa-run "
                 "&& export XDG_RUNTIME_DIR=~/.starqa-run")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(folder, 0o700)  # ours, made under another umask: others lose access
    return folder


def socket_path(key: str) -> Path:
    """Where the warm group of context `key` of this cache root listens: short and private
    (`socket_dir`), named by a hash of the root and the key (two roots never collide)."""
    name = hashlib.sha256(f"{home().resolve()}\0{key}".encode()).hexdigest()[:24]
    return socket_dir() / f"{name}.sock"


def run_dirs() -> list[Path]:
    """Where run files of this cache root's warm groups may be: `$STARQA_HOME/run`, and
    the fallback for a cache root this user cannot write (`run_dir`)."""
    return [home() / "run", _socket_folder() / f"run-{home_id()}"]


def run_dir() -> Path:
    """The folder (mode 0700) where this process writes warm groups' run files, locks and
    logs: `$STARQA_HOME/run`, else, when the cache root cannot be written (a read-only
    cache shared by a team, a read-only mount), a folder of this root in the socket folder,
    so a read-only cache still answers from warm groups."""
    folder = home() / "run"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if writable:
        _private(folder)
        return folder
    folder = socket_dir() / f"run-{home_id()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    _private(folder)
    return folder


def _private(folder: Path) -> None:
    """Mode 0700 for a run folder of ours (made under a loose umask); one that is not ours
    to change is left as it is."""
    try:
        if stat.S_IMODE(folder.stat().st_mode) != 0o700:
            os.chmod(folder, 0o700)
    except OSError:
        pass


def read_only(err: OSError) -> StarqaError | None:
    """A write into the cache root refused because it is read-only (a read-only mount, or
    no write permission), as an error a user can act on; None for any other OSError."""
    if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not err.filename:
        return None
    root = home()
    try:
        Path(os.fsdecode(err.filename)).resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return None
    how = "on a read-only file system" if err.errno == errno.EROFS else "not writable by you"
    return StarqaError(
        f"starqa's cache folder {root} is {how} ({err.filename}: {err.strerror}); this "
        "command needs to write there. Nothing was changed. (ask, chat, list, info, ps and "
        "stop work on a read-only cache.)",
        hint=f"make it writable (chmod -R u+w {shlex.quote(str(root))}), or use a cache you "
             "can write: export STARQA_HOME=~/.cache/starqa")
