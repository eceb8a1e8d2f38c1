"""The manifest's one writer and one reader: a round trip changes nothing, and every kind of
damage is refused with a message naming the file and a hint that rebuilds the context."""

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from starqa.core.errors import ShardError
from starqa.cache.manifest import (MANIFEST, Block, Manifest, block_file, read_manifest,
    write_manifest)
from starqa.methods import MethodConfig
from fakes import make_context

KEY = "d0c5" + "0" * 12


@pytest.fixture
def folder(home) -> Path:
    return make_context(home, "docs", KEY, 1_700_000_000.0)


def test_round_trip_is_equal_and_byte_identical(folder, tmp_path):
    manifest = replace(read_manifest(folder), reserve=128,
                       query_template={"prefix": "<q>", "suffix": "</q>"},
                       method=MethodConfig("pulsar", 100, 0, {"sink": 4, "budget_frac": 0.25}))
    other = tmp_path / KEY
    other.mkdir()
    written = write_manifest(other, manifest)
    assert written.folder == other and written == manifest
    again = read_manifest(other)
    assert again == manifest and again.folder == other
    assert isinstance(again.blocks[0], Block) and again.files[0].line_tokens[:2] == (0, 20)
    first = (other / MANIFEST).read_bytes()
    write_manifest(other, again)
    assert (other / MANIFEST).read_bytes() == first
    data = json.loads(first)
    assert list(data)[:3] == ["format", "key", "name"] and data["reserve"] == 128
    assert data["method"] == {"name": "pulsar", "block_size": 100, "anchor_size": 0,
                              "params": {"sink": 4, "budget_frac": 0.25}}


def test_an_older_format_3_manifest_reads_and_rewrites_unchanged(folder):
    """Format-3 manifests written before `reserve` and `query_template` existed lack them:
    they read (as None) and a rewrite, such as a rename, adds nothing."""
    data = json.loads((folder / MANIFEST).read_text())
    del data["reserve"], data["query_template"]
    (folder / MANIFEST).write_text(json.dumps(data, indent=1))
    manifest = read_manifest(folder)
    assert manifest.reserve is None and manifest.query_template is None
    write_manifest(folder, replace(manifest, name="renamed"))
    assert json.loads((folder / MANIFEST).read_text()) == {**data, "name": "renamed"}


def _without(path: str):
    """Damage: the field at `path` ("blocks.1.sha256") removed."""
    def damage(data: dict) -> None:
        *parents, last = path.split(".")
        for part in parents:
            data = data[int(part)] if isinstance(data, list) else data[part]
        del data[last]
    return damage


def _set(path: str, value):
    def damage(data: dict) -> None:
        *parents, last = path.split(".")
        for part in parents:
            data = data[int(part)] if isinstance(data, list) else data[part]
        data[int(last) if isinstance(data, list) else last] = value
    return damage


# damage → what the message says (after the file's path); the sources are recorded in each
DAMAGED_FIELDS = {
    "no key": (_without("key"), "is damaged: key is missing or not a str"),
    "no n_tokens": (_without("n_tokens"), "is damaged: n_tokens is missing or not a int"),
    "model without digest": (_without("model.digest"),
                             "is damaged: model.digest is missing or not a str"),
    "method without name": (_without("method.name"),
                            "is damaged: method.name is missing or not a str"),
    "block without sha256": (_without("blocks.1.sha256"),
                             "is damaged: blocks[1].sha256 is missing or not a str"),
    "block not an object": (_set("blocks.0", 7), "is damaged: blocks[0] is not an object"),
    "a line start that is text": (_set("files.1.line_tokens.2", "x"),
                                  "is damaged: files[1].line_tokens[2] is not a int"),
    "created as text": (_set("created", "yesterday"),
                        "is damaged: created is missing or not a number"),
    "a bool for a number": (_set("n_tokens", True), "n_tokens is missing or not a int"),
    "skipped not a list": (_set("skipped", {}), "is damaged: skipped is missing or not a list"),
    "another folder's key": (_set("key", "f" * 16), "is damaged: its key 'ffffffffffffffff' "
                                                    "is not its folder's name"),
    "a shard elsewhere": (_set("blocks.0.file", "../../x"),
                          f"is damaged: blocks[0] names '../../x', not '{block_file(0)}'"),
    "format 3": (_set("format", 3), "was written by an incompatible starqa (format 3, "
                                    "expected 4)"),
    "no format": (_without("format"), "incompatible starqa (format None, expected 4)"),
}


@pytest.mark.parametrize("damage", DAMAGED_FIELDS)
def test_a_damaged_field_is_named_with_the_command_that_rebuilds(folder, damage):
    change, message = DAMAGED_FIELDS[damage]
    data = json.loads((folder / MANIFEST).read_text())
    change(data)
    (folder / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ShardError) as error:
        read_manifest(folder)
    assert str(error.value).startswith(f"{folder / MANIFEST} ")
    assert message in str(error.value)
    # pasteable: remove the damaged folder, then the recorded command
    assert error.value.hint.endswith(f"starqa rm {KEY} && starqa ingest /data/docs")


def test_without_a_recorded_command_the_hint_ingests_the_recorded_sources(folder):
    data = json.loads((folder / MANIFEST).read_text())
    del data["command"]
    data["sources"] = ["/data/my docs", "/data/b.md"]
    (folder / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ShardError, match="command is missing") as error:
        read_manifest(folder)
    hint = error.value.hint
    assert hint.endswith(f"starqa rm {KEY} && starqa ingest '/data/my docs' /data/b.md")
    assert shlex.split(hint.split(" && ")[1])[2:] == ["/data/my docs", "/data/b.md"]


UNREADABLE = {"missing": None, "empty": b"", "truncated": b'{"format": 4, "ke',
              "not JSON": b"{not json", "not UTF-8": b"\xff\xfe{", "a list": b"[]",
              "null": b"null"}
UNREADABLE_SAYS = {"missing": "is missing", "empty": "is not valid JSON",
                   "truncated": "is not valid JSON", "not JSON": "is not valid JSON",
                   "not UTF-8": "is not valid JSON", "a list": "is not a JSON object (it is list)",
                   "null": "is not a JSON object (it is NoneType)"}


@pytest.mark.parametrize("damage", UNREADABLE)
def test_an_unreadable_manifest_is_named_with_the_remove_command(folder, damage):
    if UNREADABLE[damage] is None:
        (folder / MANIFEST).unlink()
    else:
        (folder / MANIFEST).write_bytes(UNREADABLE[damage])
    with pytest.raises(ShardError) as error:
        read_manifest(folder)
    assert str(error.value).startswith(f"{folder / MANIFEST} {UNREADABLE_SAYS[damage]}")
    assert f"starqa rm {KEY}" in error.value.hint and "starqa ingest" in error.value.hint


def test_the_writer_refuses_what_the_reader_would(folder, tmp_path):
    manifest = read_manifest(folder)
    bad = replace(manifest, blocks=(replace(manifest.blocks[0], file="../x"),
                                    *manifest.blocks[1:]))
    with pytest.raises(ValueError, match="blocks\\[0\\] names '../x'"):
        write_manifest(tmp_path, bad)
    assert not (tmp_path / MANIFEST).exists()
    assert isinstance(manifest, Manifest) and manifest.folder == folder
