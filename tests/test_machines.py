"""Across machines for real (issue #15): two network namespaces joined by a veth pair, each
a "machine" with its own address and its own `$STARQA_HOME` (no shared cache), torchrun's
rendezvous on node 0's address (never loopback) and gloo over the veth
(`GLOO_SOCKET_IFNAME`). Needs root and `ip`; skipped, saying why, elsewhere."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from starqa import engine
from starqa.cache import shards, store
from starqa.core.errors import StarqaError
from starqa.cache.manifest import block_file

pytestmark = pytest.mark.multihost

QUESTION = "who approved the travel budget"
REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds any one command may take here before the test fails


@dataclass
class Machine:
    ns: str
    address: str
    ifname: str
    home: Path

    def context(self, name: str = "docs"):
        return store.find_context(self.home / "contexts", name)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def machines(tmp_path):
    """Two namespaces, 10.77.0.1 and 10.77.0.2 on a veth pair, each with lo up; always
    removed (with anything still running in them) when the test ends."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: no network namespaces to test across")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add`); run the tests as root")
    tag = f"sq{os.getpid() % 100000}"
    names = [f"{tag}n0", f"{tag}n1"]
    made: list[str] = []
    try:
        for ns in names:
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as err:
                pytest.skip(f"`ip netns add` failed here ({err.stderr.strip()})")
            made.append(ns)
        _ip("link", "add", f"{tag}v0", "type", "veth", "peer", "name", f"{tag}v1")
        hosts = []
        for i, ns in enumerate(names):
            ifname = f"{tag}v{i}"
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            hosts.append(Machine(ns, f"10.77.0.{i + 1}", ifname, tmp_path / f"home{i}"))
        yield hosts
    finally:
        for ns in made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:  # only what this test started runs in its namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


_port = [29700]


def _start(machine: Machine, rank: int, nnodes: int, endpoint: str, *args: str,
           env: dict | None = None) -> subprocess.Popen:
    """`starqa ARGS --nnodes N --node-rank R --rdzv-endpoint E` inside `machine`."""
    environ = {k: v for k, v in os.environ.items() if k != "STARQA_FAULT"}
    environ |= {"PYTHONPATH": str(REPO), "STARQA_HOME": str(machine.home),
                "GLOO_SOCKET_IFNAME": machine.ifname, "STARQA_KEEP_ALIVE": "0", **(env or {})}
    return subprocess.Popen(
        ["ip", "netns", "exec", machine.ns, sys.executable, "-m", "starqa", *args,
         "--nnodes", str(nnodes), "--node-rank", str(rank), "--workers", "1",
         "--rdzv-endpoint", endpoint], env=environ, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)


def _together(machines: list[Machine], *args: str, order=(0, 1), env=None) -> list:
    """Run the same command on every machine (machine order[j] as node j), rendezvous on
    node 0's address; returns [(returncode, stdout, stderr, seconds)] by machine."""
    _port[0] += 1
    endpoint = f"{machines[order[0]].address}:{_port[0]}"
    started = time.monotonic()
    procs = {m: _start(machines[m], rank, len(order), endpoint, *args,
                       env=(env or {}).get(m)) for rank, m in enumerate(order)}
    results = {}
    for m, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                with_pg_killed(other)
            raise
        results[m] = (proc.returncode, out, err, time.monotonic() - started)
    return [results[m] for m in sorted(results)]


def with_pg_killed(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def _ingest_args(docs, model, method="ring"):
    return ("ingest", str(docs), "--model", str(model), "--dtype", "fp32",
            "--block-size", "50", "--method", method)


def _single_machine(docs, model, home: Path, monkeypatch, method: str, workers: int):
    """The same context on one machine (this one, no namespace): its answer's tokens."""
    monkeypatch.setenv("STARQA_HOME", str(home))
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                       block_size=50, method=method))
    return engine.ask(engine.AskOptions(QUESTION, max_new_tokens=6, workers=workers))


@pytest.mark.slow
def test_ingest_and_ask_across_two_machines_without_a_shared_cache(
        machines, docs, tiny_model, tmp_path, monkeypatch):
    a, b = machines
    # Phase 1 across the machines: ring (exact), each machine keeping its own blocks
    runs = _together(machines, *_ingest_args(docs, tiny_model))
    assert [r[0] for r in runs] == [0, 0], runs
    ma, mb = a.context(), b.context()
    assert ma.key == mb.key and ma.blocks == mb.blocks  # one plan, one set of checksums
    n = len(ma.blocks)
    assert n >= 3 and ma.placement.nodes == 2 and ma.ingest.workers == 2
    assert ma.placement.held == tuple(range((n + 1) // 2))
    assert mb.placement.held == tuple(range((n + 1) // 2, n))
    assert "10.77.0.2" in ma.placement.hosts[1] and ma.placement.homes == mb.placement.homes
    for mine, other in ((ma, mb), (mb, ma)):  # each keeps its own files, not the other's
        assert all((mine.folder / block_file(i)).exists() for i in mine.placement.held)
        assert not any((mine.folder / block_file(i)).exists() for i in other.placement.held)
        shards.verify_checksums(mine)  # what it holds matches the shared checksums

    # Phase 2 across them: the answer streams on the last node (b)
    runs = _together(machines, "ask", QUESTION, "--max-new-tokens", "6")
    assert [r[0] for r in runs] == [0, 0], runs
    assert runs[0][1] == "" and runs[1][1].strip()
    # equal to one machine with every block: dense, whose tokens are one plain forward's
    single = _single_machine(docs, tiny_model, tmp_path / "single", monkeypatch, "dense", 2)
    assert runs[1][1].strip() == single.text
    from tiny import reference_tokens

    from starqa.cache.manifest import read_manifest

    assert list(single.token_ids) == reference_tokens(
        tiny_model, read_manifest(single.context.folder), QUESTION, 6)

    # One machine alone cannot answer: the error names where the other blocks are
    monkeypatch.setenv("STARQA_HOME", str(b.home))
    with pytest.raises(StarqaError, match=r"blocks 0-\d+ on node 0 \(.*10\.77\.0\.1"):
        engine.ask(engine.AskOptions(QUESTION, max_new_tokens=6))

    # The machines swap node ranks: each now loads the other's blocks, fetched over gloo
    # (checksummed) and recorded in its own manifest; the answer (now on a) is the same
    runs = _together(machines, "ask", QUESTION, "--max-new-tokens", "6", order=(1, 0))
    assert [r[0] for r in runs] == [0, 0], runs
    assert runs[0][1].strip() == single.text and runs[1][1] == ""
    for machine in machines:
        manifest = machine.context()
        assert manifest.placement.held == tuple(range(n))  # its own and the fetched ones
        shards.verify_checksums(manifest)


@pytest.mark.slow
def test_a_machine_lost_mid_ingest_or_mid_answer(machines, docs, tiny_model):
    a, b = machines
    runs = _together(machines, *_ingest_args(docs, tiny_model, "star"))
    assert [r[0] for r in runs] == [0, 0], runs
    before = {m.ns: (m.context().to_json(), sorted(p.name for p in m.context().folder.iterdir()))
              for m in machines}

    # b's worker dies mid-ingest: a's launcher exits within seconds, naming b
    runs = _together(machines, *_ingest_args(docs, tiny_model, "star"), "--force",
                     env={1: {"STARQA_FAULT": "ingest:1"}})
    (code_a, _, err_a, t_a), (code_b, _, err_b, t_b) = runs
    assert code_b != 0 and "injected fault in ingest on rank 1" in err_b, err_b
    assert code_a != 0 and "Lost node 1" in err_a and "10.77.0.2" in err_a, err_a
    assert "Traceback" not in err_a.split("error:")[-1]
    assert abs(t_a - t_b) < 20

    # a's worker dies mid-answer: b (the query host) exits naming a
    runs = _together(machines, "ask", QUESTION, "--max-new-tokens", "6",
                     env={0: {"STARQA_FAULT": "ask:0"}})
    (code_a, _, err_a, t_a), (code_b, out_b, err_b, t_b) = runs
    assert code_a != 0 and "injected fault in ask on rank 0" in err_a, err_a
    assert code_b != 0 and "Lost node 0" in err_b and "10.77.0.1" in err_b, err_b
    assert abs(t_a - t_b) < 20

    # no machine keeps a half-written context; the previous one is intact on each
    for m in machines:
        root = m.home / "contexts"
        assert not [p for p in root.iterdir() if p.name.startswith((".staging", ".old"))]
        manifest = m.context()
        assert (manifest.to_json(), sorted(p.name for p in manifest.folder.iterdir())) \
            == before[m.ns]
        shards.verify_checksums(manifest)
    runs = _together(machines, "ask", QUESTION, "--max-new-tokens", "6", "--json")
    assert [r[0] for r in runs] == [0, 0], runs
    assert json.loads(runs[1][1])["tokens"]["answer"] > 0


def test_placement_rule_matches_phase2_loads():
    """What a machine keeps (`hosts.kept_by`) is the union of what its ranks load
    (`dist.split_by_host`), and on one machine that is plain `split_contiguous`."""
    import torch

    from starqa.runtime import dist
    from starqa.cache import hosts

    for n, nodes, per in ((7, 2, 1), (7, 2, 2), (9, 3, 2), (4, 2, 2), (5, 1, 3)):
        roster = tuple(dist.Peer(r // per, "h", "a") for r in range(nodes * per))
        for node in range(nodes):
            loaded = []
            for r in range(node * per, (node + 1) * per):
                info = dist.DistInfo(r, r % per, nodes * per, torch.device("cpu"), None,
                                     roster=roster)
                loaded += list(dist.split_by_host(n, info))
                if nodes == 1:
                    assert list(dist.split_by_host(n, info)) == \
                        list(dist.split_contiguous(n, per, r))
            assert loaded == hosts.kept_by(n, nodes, node)


def test_ask_alone_names_the_machines_that_keep_the_other_blocks():
    from starqa.cache import hosts
    from starqa.cache.manifest import Placement

    manifest = type("M", (), {})()  # only what check_here reads
    manifest.placement = Placement(nodes=2, node=1, held=(2, 3), homes=(0, 0, 1, 1),
                                   hosts=("a, 10.0.0.1", "b, 10.0.0.2"))
    manifest.local_blocks = (2, 3)
    manifest.blocks = (0, 1, 2, 3)
    manifest.name = "docs"
    manifest.rerun = "cd /x && starqa ingest docs"  # the command rebuilt from the manifest
    with pytest.raises(StarqaError, match=r"keeps 2 of the 4 blocks.*blocks 0-1 on node 0 "
                                          r"\(a, 10\.0\.0\.1\)") as err:
        hosts.check_here(manifest)
    assert "--nnodes 2" in err.value.hint and "cd /x && starqa ingest docs" in err.value.hint


def _workers_in(machine: Machine) -> list[int]:
    """The pids of starqa's torchrun workers running in `machine`'s namespace."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", machine.ns], capture_output=True,
                              text=True).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"starqa.workers.worker" in cmdline and b"torch.distributed.run" not in cmdline:
            found.append(int(pid))
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_for(files: list[Path], procs: list[subprocess.Popen], seconds: float = TIMEOUT):
    deadline = time.monotonic() + seconds
    while not all(f.exists() for f in files):
        for proc in procs:
            assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"never appeared: {files}"
        time.sleep(0.2)


def _freeze_and_expect_lost(pids: list[int], survivor: subprocess.Popen, lost: str,
                            address: str) -> None:
    """SIGSTOP `pids` (a machine's processes: no connection closes); `survivor` must exit
    within seconds with an error naming the lost node and its address."""
    _signal_all(pids, signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = survivor.communicate(timeout=30)
    took = time.monotonic() - stopped
    assert survivor.returncode != 0, err
    assert lost in err and address in err, err
    assert took < 10, (took, err)


@pytest.mark.slow
def test_a_frozen_machine_is_named_within_seconds(machines, docs, tiny_model, tmp_path):
    """SIGSTOP freezes b's worker mid-ingest and closes no connection: gloo alone would wait
    for its timeout (30 min). The heartbeat watchdog makes a exit within seconds, naming b."""
    a, b = machines
    _port[0] += 1
    endpoint = f"{a.address}:{_port[0]}"
    mark = tmp_path / "slow"
    env = {"STARQA_SLOW": "120", "STARQA_SLOW_MARK": str(mark)}
    procs = [_start(m, rank, 2, endpoint, *_ingest_args(docs, tiny_model, "star"), env=env)
             for rank, m in enumerate(machines)]
    frozen: list[int] = []
    try:
        _wait_for([Path(f"{mark}.0"), Path(f"{mark}.1")], procs)  # both past joining, waiting
        frozen = _workers_in(b)
        assert frozen
        _freeze_and_expect_lost(frozen, procs[0], "Lost node 1", b.address)
        assert not [p for p in (a.home / "contexts").iterdir() if p.name.startswith(".staging")]
    finally:
        _signal_all(frozen, signal.SIGKILL)
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    with_pg_killed(proc)
    assert procs[1].returncode != 0


def _in(machine: Machine, *args: str, python: tuple[str, ...] = ("-m", "starqa"),
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """One command on `machine` alone (no --nnodes): `starqa ARGS` by default."""
    environ = {k: v for k, v in os.environ.items() if k != "STARQA_FAULT"}
    environ |= {"PYTHONPATH": str(REPO), "STARQA_HOME": str(machine.home),
                "STARQA_KEEP_ALIVE": "0"}
    return subprocess.run(["ip", "netns", "exec", machine.ns, sys.executable, *python, *args],
                          env=environ, capture_output=True, text=True, timeout=timeout)


CHAT = """
import sys
from starqa.cli.repl import Repl
chat = Repl(None, None, 300, 6)
chat.ask(sys.argv[1])
print("ANSWER=" + chat.history[-1][1], file=sys.stderr)
"""


def _serving(machines: list[Machine], key: str, procs) -> None:
    """Until every machine's launcher has written its run file (its workers are ready)."""
    _wait_for([m.home / "run" / f"{key}.json" for m in machines], procs)


def _finish(procs: list[subprocess.Popen], seconds: float = TIMEOUT) -> list:
    out = []
    for proc in procs:
        try:
            out.append((proc.returncode if proc.poll() is not None else None,)
                       + proc.communicate(timeout=seconds))
        except subprocess.TimeoutExpired:
            with_pg_killed(proc)
            raise
        out[-1] = (proc.returncode,) + out[-1][1:]
    return out


@pytest.mark.slow
def test_a_warm_group_across_two_machines(machines, docs, tiny_model):
    """`serve` on both machines; the query host (b, the last node) serves the socket: `ask`
    and `chat` there answer as a cold ask across the machines does; `stop` there ends both;
    a machine lost (frozen, with node 0's torchrun agent and its store) ends the group with
    a message naming it on the query host."""
    a, b = machines
    runs = _together(machines, *_ingest_args(docs, tiny_model, "star"))
    assert [r[0] for r in runs] == [0, 0], runs
    runs = _together(machines, "ask", QUESTION, "--max-new-tokens", "6")
    assert [r[0] for r in runs] == [0, 0], runs
    cold = runs[1][1].strip()
    assert cold
    key = a.context().key

    _port[0] += 1
    endpoint = f"{a.address}:{_port[0]}"
    procs = [_start(m, rank, 2, endpoint, "serve", "--keep-alive", "0")
             for rank, m in enumerate(machines)]
    try:
        _serving(machines, key, procs)
        ps_a, ps_b = (json.loads(_in(m, "ps", "--json").stdout) for m in machines)
        assert [(g["key"], g["node"], g["socket"]) for g in ps_a] == [(key, 0, None)]
        assert "10.77.0.2" in ps_a[0]["query"] and ps_a[0]["workers"] == 2
        assert [(g["key"], g["node"], g["answered"]) for g in ps_b] == [(key, 1, 0)]

        warm = _in(b, "ask", QUESTION, "--max-new-tokens", "6", "--json")
        assert warm.returncode == 0, warm.stderr
        answer = json.loads(warm.stdout)
        assert answer["warm"] is True and answer["answer"].strip() == cold, answer
        chat = _in(b, QUESTION, python=("-c", CHAT))
        assert chat.returncode == 0, chat.stderr
        assert f"ANSWER={cold}\n" in chat.stderr, chat.stderr
        assert json.loads(_in(b, "ps", "--json").stdout)[0]["answered"] == 2

        # node 0 has no socket: asking or stopping there names the query host
        for args in (("ask", QUESTION, "--max-new-tokens", "6"), ("stop", "docs")):
            there = _in(a, *args)
            assert there.returncode != 0 and "query host" in there.stderr, there.stderr
            assert "10.77.0.2" in there.stderr, there.stderr

        stop = _in(b, "stop", "docs")
        assert stop.returncode == 0 and "on its 2 machines" in stop.stderr, stop.stderr
        results = _finish(procs, 60)
        assert [r[0] for r in results] == [0, 0], results
        assert json.loads(_in(a, "ps", "--json").stdout) == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                with_pg_killed(proc)

    # the group again; then node 0 freezes whole (launcher, torchrun's agent with the
    # group's store, its worker): the query host's serve exits within seconds naming it
    _port[0] += 1
    endpoint = f"{a.address}:{_port[0]}"
    procs = [_start(m, rank, 2, endpoint, "serve", "--keep-alive", "0")
             for rank, m in enumerate(machines)]
    frozen = []
    try:
        _serving(machines, key, procs)
        frozen = [int(p) for p in subprocess.run(["ip", "netns", "pids", a.ns],
                                                 capture_output=True, text=True).stdout.split()]
        _freeze_and_expect_lost(frozen, procs[1], "Lost node 0", a.address)
        assert json.loads(_in(b, "ps", "--json").stdout) == []
    finally:
        _signal_all(frozen, signal.SIGKILL)
        for proc in procs:
            if proc.poll() is None:
                with_pg_killed(proc)
