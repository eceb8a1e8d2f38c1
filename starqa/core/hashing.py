"""A file's sha256, read in 4 MiB pieces: shard checksums, block ids, GGUF content keys."""

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at `path`."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
