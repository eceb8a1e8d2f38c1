"""A folder's git, read without running anything its config names (the comment above
`_GIT_SAFE` says why only these reads): the repository a folder is in (`use_git`), what git
tracks or would track under it (`walk`), and each tracked file's blob id and last commit time
(`commit_times`)."""

from __future__ import annotations

import errno
import hashlib
import os
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from starqa.core.errors import StarqaError
from starqa.corpus.sources import OUTSIDE, Skipped, leaves


# A folder's own git config is not the user's: a tarball or shared folder can carry a
# `.git/config` (or a `gitdir:` file pointing at one elsewhere) that names programs in
# filter, diff and merge drivers, hooks, fsmonitor, pagers, editors, credential, ssh, gpg
# and protocol helpers. Git runs a filter driver whenever it hashes work-tree content
# (any command that refreshes the index: `diff`, `status`, `add`...), and the drivers'
# names are the repository's own, so no `-c` can pin them all. starqa therefore never asks
# git about the work tree's content: it reads only the index, the objects and the refs
# (`_GIT_READS`: which files are tracked, their blob ids at HEAD, the log), and tells an
# edited file from a committed one by hashing the bytes itself (`blob_id`). The `-c` pins
# below cover every fixed key that names a program, should a later git reach one from these
# reads; command-line `-c` outranks every config file (includes and worktree config too).
# (uploadpack.packObjectsHook, core.alternateRefsCommand and core.gitProxy are only used
# by upload-pack, push and git:// fetches, which starqa never runs and `git_env` forbids;
# git ignores the first in a repository's config.)
_GIT_SAFE = ("--no-pager", "--no-optional-locks", "-c", "core.fsmonitor=false",
             "-c", "core.hooksPath=/dev/null", "-c", "core.pager=cat",
             "-c", "core.untrackedCache=false", "-c", "diff.external=",
             "-c", "credential.helper=", "-c", "core.sshCommand=false",
             "-c", "core.askPass=false", "-c", "core.editor=false",
             "-c", "sequence.editor=false",
             "-c", "protocol.allow=never", "-c", "protocol.ext.allow=never",
             "-c", "log.showSignature=false", "-c", "gpg.program=false",
             "-c", "gpg.openpgp.program=false", "-c", "gpg.ssh.program=false",
             "-c", "gpg.x509.program=false", "-c", "fetch.recurseSubmodules=false")


# The only git commands starqa runs, and why none converts work-tree content: `rev-parse`
# and `check-ignore` read paths and config, `ls-files` (never -m/-d, which compare the work
# tree) the index and directory names, `ls-tree` and `log --name-only` objects only.
_GIT_READS = frozenset({"rev-parse", "check-ignore", "ls-files", "ls-tree", "log"})


_GIT_REFUSED = frozenset({"-m", "--modified", "-d", "--deleted", "-k", "--killed", "-p",
                          "--patch", "--stat", "--textconv", "--ext-diff", "--recurse-submodules"})


# The user's environment may point git at another repository or index; starqa means the
# folder's own. GIT_PAGER etc. are neutralised; system and global config stay (they are the
# user's own, and carry the core.excludesFile that --exclude-standard honours). A partial
# clone would fetch a missing object from its promisor remote, whose URL the repository
# names (an `ext::` URL is a program): no protocol is allowed, no lazy fetch made.
_GIT_ENV_DROP = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR",
                 "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG",
                 "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT", "GIT_EXTERNAL_DIFF",
                 "GIT_NAMESPACE", "GIT_SSH", "GIT_SSH_COMMAND", "GIT_PROXY_COMMAND")


def git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _GIT_ENV_DROP and not k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))}
    env.update(GIT_PAGER="cat", PAGER="cat", GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0",
               GIT_ASKPASS="false", SSH_ASKPASS="false", GIT_EDITOR="false",
               GIT_ALLOW_PROTOCOL="none", GIT_PROTOCOL_FROM_USER="0", GIT_NO_LAZY_FETCH="1",
               GIT_NO_REPLACE_OBJECTS="1")
    return env


@dataclass(frozen=True)
class Repo:
    """A work tree found as git finds it: `dot_git` is the `.git` folder or `gitdir:` file
    in `top` (git resolves the file). Every command gets both explicitly, so a
    `core.worktree` in the config cannot move the work tree away from the user's folder."""

    dot_git: Path
    top: Path


def find_repo(folder: Path) -> Repo | None:
    """The nearest `.git` folder (with a HEAD) or `gitdir:` file at or above `folder`, as git
    looks (not above GIT_CEILING_DIRECTORIES, nor across file systems unless
    GIT_DISCOVERY_ACROSS_FILESYSTEM); None outside git and inside a `.git` folder itself."""
    here = Path(os.path.realpath(folder))
    ceilings = {os.path.realpath(c) for c in os.environ.get("GIT_CEILING_DIRECTORIES",
                                                           "").split(os.pathsep) if c}
    across = os.environ.get("GIT_DISCOVERY_ACROSS_FILESYSTEM", "").lower() in (
        "1", "true", "yes", "on")
    device = here.stat().st_dev
    for d in (here, *here.parents):
        dot_git = d / ".git"
        try:
            if d != here and (str(d) in ceilings or not across and d.stat().st_dev != device):
                return None
            if dot_git.is_dir():
                found = (dot_git / "HEAD").is_file()
            elif dot_git.is_file():  # a `gitdir:` file (a FIFO would wait: never opened)
                with open(dot_git, "rb") as fh:
                    found = fh.read(8) == b"gitdir: "
            else:
                found = False
        except OSError:  # a folder above we may not look into: git stops there too
            return None
        if found:
            inside = here.relative_to(d).parts
            return None if inside[:1] == (".git",) else Repo(dot_git, d)
    return None


def run_git(repo: Repo, folder: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    """Run a read-only git query in `folder` of `repo` without running anything its config
    names."""
    if args[0] not in _GIT_READS or _GIT_REFUSED & set(args):  # a bug here, never input
        raise ValueError(f"git {' '.join(args)} may read the work tree through its filters")
    cmd = ["git", f"--git-dir={repo.dot_git}", f"--work-tree={repo.top}", *_GIT_SAFE, *args]
    try:
        return subprocess.run(cmd, cwd=os.path.realpath(folder), env=git_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, check=False)
    except OSError:  # git is not installed
        return None


def use_git(folder: Path) -> Repo | None:
    """The repository whose work tree `folder` is in, unless the repository itself ignores
    `folder` (or git cannot read it: then the folder is walked like any other)."""
    repo = find_repo(folder)
    if repo is None:
        return None
    ok = run_git(repo, folder, "rev-parse", "--git-dir")
    if ok is None or ok.returncode != 0:
        return None
    ignored = run_git(repo, folder, "check-ignore", "-q", ".")
    return repo if ignored is None or ignored.returncode != 0 else None


GIT_HISTORY = 2000  # commits read for the files' last change times


def blob_id(data: bytes, algorithm: str) -> str:
    """The object id git gives a file of these bytes stored as they are (no filters)."""
    h = hashlib.new(algorithm, b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def commit_times(repo: Repo, folder: Path) -> dict[str, tuple[str, int]]:
    """{path under `folder`: (its blob id at HEAD, when the last commit that touched it was
    made)} (the time 0 for a file older than the last GIT_HISTORY commits); a file whose
    bytes hash to that id is as committed. {} when git cannot tell (no commit yet)."""
    tree = run_git(repo, folder, "ls-tree", "-r", "-z", "HEAD")
    log = run_git(repo, folder, "log", f"-n{GIT_HISTORY}", "--format=%x01%ct", "--name-only",
                   "-z", "--no-renames", "--no-show-signature", "--no-ext-diff", "--no-textconv",
                   "--relative", "--", ".")
    if any(out is None or out.returncode != 0 for out in (tree, log)):
        return {}
    times: dict[str, int] = {}
    when = 0
    for item in log.stdout.split(b"\0"):  # "\x01<time>", "\n<path>", "<path>", ...
        item = item.lstrip(b"\n")
        if item.startswith(b"\x01"):
            when = int(item[1:])
        elif item:
            times.setdefault(os.fsdecode(item), when)  # newest first: the first is the last
    blobs: dict[str, tuple[str, int]] = {}
    for entry in tree.stdout.split(b"\0"):  # "<mode> blob <id>\t<path>"
        meta, _, path = entry.partition(b"\t")
        parts = meta.split(b" ")
        if len(parts) == 3 and parts[1] == b"blob":
            rel = os.fsdecode(path)
            blobs[rel] = (parts[2].decode(), times.get(rel, 0))
    return blobs


def ls_files(repo: Repo, folder: Path, *args: str) -> list[bytes]:
    out = run_git(repo, folder, "ls-files", "-z", *args)
    if out is None or out.returncode != 0:
        why = out.stderr.decode(errors="replace").strip() if out else "git is gone"
        raise StarqaError(f"git cannot list the files of {repo.top} ({why}), so starqa "
                          "cannot tell which of them git tracks.",
                          hint="if the index is damaged, rebuild it from the last commit "
                               f"(running none of the repository's programs): git -C "
                               f"{shlex.quote(str(repo.top))} -c core.hooksPath=/dev/null -c "
                               "core.fsmonitor=false -c protocol.ext.allow=never read-tree "
                               "HEAD")
    return [p for p in out.stdout.split(b"\0") if p]


SUBMODULE = "git submodule (ingest it as a path of its own)"


NESTED = "nested git repository (ingest it as a path of its own)"

def _hidden_prefix(rel: str) -> str | None:
    parts = rel.split("/")
    for i, part in enumerate(parts):
        if part.startswith("."):
            return "/".join(parts[: i + 1])
    return None



def walk(repo: Repo, folder: Path) -> Iterator[tuple[str, Path] | Skipped]:
    """What git tracks or would track under `folder`, as far as it is on disk; ignored
    entries, submodules and nested repositories reported once each."""
    reported: set[str] = set()
    listed = [(os.fsdecode(p).rstrip("/"), "ignored by .gitignore")
              for p in ls_files(repo, folder, "--others", "--exclude-standard", "--ignored",
                               "--directory")]
    for entry in ls_files(repo, folder, "--stage"):  # "<mode> <id> <stage>\t<path>"
        meta, _, path = entry.partition(b"\t")
        listed.append((os.fsdecode(path), SUBMODULE if meta.startswith(b"160000 ") else ""))
    for p in ls_files(repo, folder, "--others", "--exclude-standard"):
        rel = os.fsdecode(p)  # a folder ("sub/") here is a repository of its own
        listed.append((rel.rstrip("/"), NESTED if rel.endswith("/") else ""))
    for rel, reason in sorted(set(listed)):
        if not os.path.lexists(folder / rel):  # in the index only (deleted, another work tree)
            continue
        hidden = _hidden_prefix(rel)
        if hidden is not None:
            if hidden not in reported and hidden.rsplit("/", 1)[-1] != ".git":
                reported.add(hidden)
                yield Skipped(hidden, "hidden")
        elif reason:
            yield Skipped(rel, reason)
        elif leaves(folder, folder / rel):
            yield Skipped(rel, OUTSIDE)
        elif (kind := entry_kind(folder / rel)) == "file":
            yield rel, folder / rel
        elif kind:
            yield Skipped(rel, kind)


def entry_kind(path: Path) -> str:
    """'file', '' for what git lists that is not a file (a folder), or why it cannot be
    read (a symlink loop, a broken symlink, a tracked file in a folder we may not enter)."""
    try:
        if path.is_file():
            return "file"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if os.path.islink(path):  # is_file says False for these too
        try:
            os.stat(path)
        except OSError as e:
            return "symlink loop" if e.errno == errno.ELOOP else "broken symlink"
    return ""


BARE = "bare git repository (no work tree: clone it, and ingest the clone)"


def bare(folder: Path) -> bool:
    """Whether `folder` looks like a bare repository (HEAD, objects/, refs/, no work tree)."""
    return all(os.path.exists(folder / name) for name in ("HEAD", "objects", "refs", "config"))
