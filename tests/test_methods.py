"""The method registry (starqa.methods): what each method declares, without a model, and
pulsar's summaries computed once by the launcher equal the ones a worker computes."""

import subprocess
import sys

import pytest
import torch

from starqa import methods
from starqa.phase1 import pulsar
from starqa.core.errors import StarqaError
from starqa.methods import method_config, plan_blocks

BLOCKS = plan_blocks(100, 20)  # 5 blocks


def test_registry_lists_every_method_once():
    assert methods.METHODS == ("star", "dense", "ring", "pulsar", "apb")
    assert methods.DEFAULT == "star" and methods.REFERENCE == "dense"
    for name in methods.METHODS:
        entry = methods.get(name)
        assert entry.name == name and entry.help and name in methods.help_line()
    assert [m for m in methods.METHODS if methods.get(m).exact] == ["dense", "ring"]
    assert [m for m in methods.METHODS if methods.get(m).sequential] == ["dense"]
    with pytest.raises(StarqaError, match="Unknown method 'flash'"):
        methods.get("flash")


def test_settings_belong_to_their_methods():
    assert methods.owners("anchor") == ("star", "apb")
    assert methods.owners("sink") == ("pulsar",)
    assert methods.owners("positions") == ("star", "pulsar")
    # star records contiguous positions only: sparse contexts keep the keys they had
    assert method_config("star", 100, params={"positions": "sparse"}).params == {}
    assert method_config("star", 100, params={"positions": "contiguous"}).params == {
        "positions": "contiguous"}
    with pytest.raises(StarqaError, match="Unknown --positions 'middle' for star"):
        method_config("star", 100, params={"positions": "middle"})
    assert methods.owners("passing") == methods.owners("question") == ("apb",)
    assert methods.owners("nothing") == ()
    with pytest.raises(StarqaError, match="--probe-window only applies to --method apb"):
        method_config("pulsar", 100, params={"window": 8})


def test_assignment_and_workers():
    # contiguous groups (Phase 2 loads them), but round-robin for apb
    assert [methods.get("star").assignment(5, 2, r) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [methods.get("ring").assignment(5, 3, r) for r in range(3)] == [[0, 1], [2, 3], [4]]
    assert [methods.get("apb").assignment(5, 2, r) for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert methods.get("dense").max_workers(5) == 1
    assert methods.get("pulsar").max_workers(5) == 5


def test_importing_the_registry_loads_no_torch():
    """ui.py and cli.py use it: block assignment and --help must not pay for torch."""
    code = ("import sys; from starqa import methods; from starqa.cli import ui; "
            "methods.get('apb').assignment(9, 2, 1); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("edited, star, anchor_far, dense, pulsar_idf, pulsar_local", [
    (0, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]),
    (1, [1], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]),
    (3, [3], [3, 4], [3, 4], [1, 2, 3, 4], [3, 4]),
])
def test_what_an_edit_invalidates(edited, star, anchor_far, dense, pulsar_idf, pulsar_local):
    def stale(name, **kw):
        return methods.get(name).invalidated(method_config(name, 100, block_size=20, **kw),
                                             BLOCKS, edited)

    assert stale("star") == star  # anchor = block 0: everyone's
    assert stale("star", anchor_size=70) == anchor_far  # an anchor reaching into block 3
    assert stale("dense") == stale("ring") == stale("apb") == dense
    assert stale("pulsar") == pulsar_idf  # max-idf: the IDF table is the whole context's
    assert stale("pulsar", params={"heuristic": "entropy"}) == pulsar_local


@pytest.mark.parametrize("heuristic", ["max-idf", "bm25", "even"])
def test_pulsar_prepared_summaries_equal_the_workers_own(heuristic):
    """The launcher's summaries (IDF table up to the largest id present, through JSON)
    equal what a worker computes with the model's whole vocabulary."""
    ids = (torch.arange(300) * 7 % 53 + 2).tolist()
    blocks = plan_blocks(len(ids), 60)
    config = method_config("pulsar", len(ids), block_size=60,
                           params={"sink": 8, "chunk": 4, "heuristic": heuristic,
                                   "positions": "contiguous"})
    entry = methods.get("pulsar")
    prepared = entry.prepare(ids, config, blocks)
    worker = pulsar.all_summaries(torch.tensor(ids), blocks, 1000, sink=8, heuristic=heuristic,
                                  chunk=4)
    assert prepared["summaries"] == [s.tolist() for s in worker]
    assert any(prepared["summaries"])
    start = pulsar.query_start(len(ids), blocks, worker, sink=8, positions="contiguous")
    assert entry.query_position(ids, config, blocks, prepared) == start < len(ids)
    assert entry.query_position(ids, config, blocks) == start  # computed when not given
    sparse = method_config("pulsar", len(ids), block_size=60)
    assert entry.query_position(ids, sparse, blocks, prepared) == len(ids)
    assert methods.get("star").prepare(ids, config, blocks) == {}
