"""A warm group's run file (`starqa.workers.runfile`): written whole, read back field by
field; a file this starqa did not write is refused, and an earlier starqa's is read."""

import json

import pytest

from starqa.runtime.protocol import ProtocolError
from starqa.workers import messages, runfile
from starqa.workers.runfile import RunInfo

ONE = RunInfo(key="k1", name="docs", pid=4242, workers=2, socket="/tmp/starqa-0/x.sock",
              started=1.7e9, keepalive=300.0, tokens=5000, weights="int4", method="star",
              requested_workers=None, attention_args=("--attention", "topk", "--top-k", "64"))
ACROSS = RunInfo(key="k2", name="repo", pid=7, workers=4, socket=None, started=1.7e9,
                 keepalive=-1.0, tokens=9000, weights="dense", method="star",
                 topk={"count": 64}, requested_workers=2, node=0, nodes=2,
                 query="node 1 (b, 10.0.0.2)")


@pytest.mark.parametrize("info", [ONE, ACROSS], ids=["one machine", "across machines"])
def test_a_run_file_survives_the_disk(tmp_path, info):
    path = tmp_path / f"{info.key}.json"
    runfile.write(path, info)
    assert runfile.read(path) == info
    on_disk = json.loads(path.read_text())
    assert ("nodes" in on_disk) is info.across  # one machine's file says nothing of nodes
    assert not list(tmp_path.glob("*.tmp*"))  # written whole: no temporary file left


def test_an_earlier_starqas_run_file_is_read(tmp_path):
    """Run files before tokens, weights and method were written: `ps` still lists them."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"key": "k", "name": "docs", "pid": 1, "workers": 1,
                                "socket": None, "started": 0, "keepalive": 300}))
    info = runfile.read(path)
    assert info.weights is None and info.keepalive == 300.0 and not info.across


@pytest.mark.parametrize("text, error", [
    ('{"key": "k", "pid": 1, "socket": null}', "lacks its field 'name'"),
    ('{"key": 1, "name": "x", "pid": "me", "workers": 1, "socket": null, "started": 0, '
     '"keepalive": 1}', "run file.key is 1, not str"),
    ('{"key": "k", "name": "x", "pid": true, "workers": 1, "socket": null, "started": 0, '
     '"keepalive": 1}', "run file.pid is True"),
    ('{"key": "k", "name": "x", "pid": 1, "workers": 1, "socket": null, "started": 0, '
     '"keepalive": 1, "colour": "red"}', "no field 'colour'"),
    ('[1, 2]', "not a JSON object"),
])
def test_a_file_starqa_did_not_write_is_refused(tmp_path, text, error):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(ProtocolError, match=error):
        runfile.read(path)


def test_a_group_across_machines_must_say_where(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({**ONE.as_dict(), "nodes": 2}))
    with pytest.raises(ValueError, match="without node, nodes, query"):
        runfile.read(path)


def test_ps_shows_the_run_file_and_what_the_group_says():
    status = messages.GroupStatus(context="docs", key="k1", workers=2, tokens=5000,
                                  method="star", answered=3, rss_bytes=1 << 30, pid=4242)
    row = runfile.with_status(ONE, status)
    assert row["answered"] == 3 and row["weights"] == "int4" and row["socket"] == ONE.socket
    assert runfile.with_status(ONE, None) == ONE.as_dict()
    json.dumps(row)  # JSON-ready: `ps --json` prints it
