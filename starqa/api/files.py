"""A context's files as it holds them: read a file's lines (`read`) and search them (`search`),
what an agent does next with an answer's sources (`path:line`), through the MCP door.

A file's text is the one ingested: the file on disk where its text is still the one whose
hash the manifest keeps, else the context's own tokens for it decoded (the shards keep
every token id), so a file changed or removed since the ingest reads as the model saw it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from starqa.api.catalog import find
from starqa.cache.context import Context
from starqa.cache.manifest import Manifest, PackedFile
from starqa.core.errors import StarqaError

MAX_MATCHES = 50
MAX_READ_LINES = 2000


@dataclass(frozen=True)
class Match:
    """A line of a context's file that matched a search: where (1-based), and the lines
    around it (`before` and `after`, in order)."""

    path: str
    line: int
    text: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "text": self.text,
                "before": list(self.before), "after": list(self.after)}


def read(context: Context | str | None, path: str, start: int = 1,
         end: int | None = None) -> dict:
    """Lines `start`..`end` (1-based, inclusive; default: to the end, at most
    MAX_READ_LINES) of the context's file `path`: {"path", "start", "end", "lines",
    "total_lines"}."""
    manifest = find(context)
    lines = _lines(manifest, _file(manifest, path))
    if start < 1 or (end is not None and end < start):
        raise StarqaError(f"Lines {start} to {end} are not a range of {path}'s lines.",
                          hint=f"give 1 <= start <= end <= {len(lines)}")
    if start > max(len(lines), 1):
        raise StarqaError(f"{path} has {len(lines)} lines; line {start} is past its end.",
                          hint=f"read lines 1 to {len(lines)}")
    last = min(len(lines), end if end is not None else len(lines), start + MAX_READ_LINES - 1)
    return {"path": path, "start": start, "end": last, "lines": lines[start - 1:last],
            "total_lines": len(lines)}


def search(context: Context | str | None, pattern: str, regex: bool = False,
           around: int = 2, limit: int = MAX_MATCHES, case_sensitive: bool = True,
           paths: str | None = None) -> list[Match]:
    """The lines of the context's files where `pattern` appears (a string; `regex`: a
    Python regular expression), each with `around` lines before and after, in file and
    line order, at most `limit`; `paths`: only files whose path matches this glob."""
    manifest = find(context)
    flags = 0 if case_sensitive else re.IGNORECASE
    try:
        found = re.compile(pattern if regex else re.escape(pattern), flags)
    except re.error as error:
        raise StarqaError(f"{pattern!r} is not a regular expression ({error}).",
                          hint="fix it, or search for the text as it is (regex false)") \
            from None
    if not pattern:
        raise StarqaError("The search pattern is empty.", hint="give the text to find")
    matches: list[Match] = []
    for file in manifest.files:
        if paths and not Path(file.path).match(paths) and not re.fullmatch(
                _glob(paths), file.path):
            continue
        lines = _lines(manifest, file)
        for number, text in enumerate(lines, 1):
            if found.search(text):
                matches.append(Match(file.path, number, text,
                                     tuple(lines[max(0, number - 1 - around):number - 1]),
                                     tuple(lines[number:number + around])))
                if len(matches) >= limit:
                    return matches
    return matches


def _glob(pattern: str) -> str:
    """A glob (`*` within a folder, `**` across) as a regular expression over a path."""
    out = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
    return out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")


def _file(manifest: Manifest, path: str) -> PackedFile:
    for file in manifest.files:
        if file.path == path:
            return file
    close = [f.path for f in manifest.files if Path(f.path).name == Path(path).name][:3]
    raise StarqaError(f"{manifest.name} holds no file {path!r}.",
                      hint=f"did you mean {' or '.join(close)}?" if close else
                      f"starqa info {manifest.name} lists its files")


def _lines(manifest: Manifest, file: PackedFile) -> list[str]:
    """The file's lines as the context holds them (see the module docstring)."""
    text = _on_disk(manifest, file)
    if text is None:
        text = _decoded(manifest, file)
    return text.rstrip().split("\n") if text.strip() else []


def _on_disk(manifest: Manifest, file: PackedFile) -> str | None:
    """The file's text from disk, where it is still the text ingested (its hash)."""
    roots = [Path(s) for s in manifest.sources]
    candidates = []
    for root in roots:
        if root.is_file():
            candidates.append(root)
        else:
            candidates.append(root / file.path)
            head, _, rest = file.path.partition("/")  # several roots: "label/path"
            if rest and head == root.name:
                candidates.append(root / rest)
    for candidate in candidates:
        try:
            text = candidate.read_text(encoding="utf-8", errors="surrogateescape")
        except (OSError, ValueError):
            continue
        if file.sha256 is None or hashlib.sha256(text.encode()).hexdigest() == file.sha256:
            return text
    return None


def _decoded(manifest: Manifest, file: PackedFile) -> str:
    """The file's text decoded from the context's token ids (the shards keep them): its
    `<document ...>` header line and closing tag taken off."""
    from safetensors import safe_open

    from starqa import engine
    from starqa.models import load_tokenizer

    ids: list[int] = []
    for block in manifest.blocks:
        a, b = max(block.start, file.token_start), min(block.end, file.token_end)
        if a >= b:
            continue
        try:
            with safe_open(str(manifest.folder / block.file), "pt") as shard:
                held = shard.get_tensor("ids")
        except (OSError, KeyError, ValueError) as error:
            raise StarqaError(f"{file.path} changed on disk since the ingest, and the shard "
                              f"{block.file} that holds its tokens cannot be read ({error}).",
                              hint=f"starqa ingest {' '.join(manifest.sources)} again") \
                from None
        ids += held[a - block.start:b - block.start].tolist()
    tokenizer = load_tokenizer(engine.manifest_model(manifest, None))
    text = tokenizer.decode(ids)
    body = text.split("\n", 1)[1] if text.startswith("<document") and "\n" in text else text
    return body.removesuffix("\n</document>").removesuffix("</document>")
