"""`starqa eval --edit` (issue #14): edited haystacks, and each method answering from an
incremental re-ingest (the very functions `ingest` runs) against a full one. Tiny random
Llama in fp32."""

import json

import pytest
import torch
from typer.testing import CliRunner

from starqa.cli import app
from starqa.core.errors import StarqaError
from starqa.measure.evals import edit, generators, runner


@pytest.mark.parametrize("task", generators.EDIT)
def test_an_edit_changes_one_file_and_moves_the_later_ones(tok, task):
    sample = generators.generate(task, 500, 3, tok)
    before, meta = sample.before, sample.meta["edit"]
    assert before is not None and before.question == sample.question
    old = {f.path: f for f in before.files}
    new = {f.path: f for f in sample.files}
    assert list(old) == list(new) and meta["file"] in new
    paths = list(new)
    edited = paths.index(meta["file"])
    assert 0 < edited < len(paths) - 1  # not the first file, and a file after it moves
    delta = len(sample.context_ids) - len(before.context_ids)
    assert delta > 0
    for i, path in enumerate(paths):
        shift = delta if i > edited else 0
        assert (new[path].token_start, new[path].token_end - (delta if i >= edited else 0)) \
            == (old[path].token_start + shift, old[path].token_end)
    [value] = sample.answers
    gold = sample.meta["source"]["file"]
    assert value in sample.context_text
    if task == "edit_changed":  # the needle's value is what changed
        assert gold == meta["file"] and meta["old_value"] in before.context_text
        assert value not in before.context_text and meta["old_value"] not in sample.context_text
    else:  # the needle sits, unchanged, in a file after the edit
        assert paths.index(gold) > edited and value in before.context_text


def test_edit_tasks_run_only_with_edit_and_edit_only_them():
    assert generators.resolve_tasks(None, edit=True) == list(generators.EDIT)
    assert not set(generators.resolve_tasks(None)) & set(generators.EDIT)
    with pytest.raises(StarqaError, match="only run with --edit") as e:
        generators.resolve_tasks("edit_changed")
    assert "starqa eval --edit --tasks edit_changed" in e.value.hint
    with pytest.raises(StarqaError, match="--edit runs only the edit tasks, not vt"):
        generators.resolve_tasks("edit,vt", edit=True)


def test_edit_with_topk_is_a_clear_error(home, tiny_model):
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model), "--edit",
                                      "--attention", "topk"])
    assert isinstance(result.exception, StarqaError), result.output
    assert "--attention topk does not apply" in str(result.exception)


def test_edit_mode_runs_and_dense_prefix_reuse_gives_the_full_encodings_tokens(
        home, tiny_model, tmp_path):
    out = tmp_path / "edit.json"
    # dense named: 500 tokens and the reserve are past the tiny model's window
    opts = runner.EvalOptions(model=str(tiny_model), methods="dense,star,ring", tasks="edit",
                              lengths="500", samples=1, dtype="fp32", json_path=str(out),
                              block_size=128, edit=True)
    plan = runner.plan(opts)
    assert plan.labels == ["dense", "dense incr", "star", "star incr", "ring", "ring incr"]
    results = runner.run(plan)
    saved = json.loads(out.read_text())
    assert results["status"] == saved["status"] == "complete" and saved["runs_done"] == 12
    assert saved["settings"]["edit"]["retention"].startswith("<method> incr")
    rotated = 0
    for s in saved["samples"]:
        r = s["results"]
        for m in ("dense", "star", "ring"):
            reuse = r[edit.label(m)]["reuse"]
            assert reuse["blocks"] == reuse["reused"] + reuse["rotated"] + reuse["encoded"]
            assert reuse["reused"] >= 1 and reuse["encoded"] >= 1  # block 0 kept, the edit not
        # exact prefix reuse: token for token what a full re-ingest answers
        assert r["dense incr"]["same_tokens"] and r["ring incr"]["same_tokens"]
        assert r["dense incr"]["token_ids"] == r["dense"]["token_ids"]
        assert "reuse" not in r["dense"]  # the full re-ingest reuses nothing
        rotated += r["star incr"]["reuse"]["rotated"]
    assert rotated >= 1  # star re-rotated a block that only moved
    row = saved["summary"][-1]["methods"]
    assert row["dense incr"]["same_tokens"] == 1.0
    # retention of an incremental run is against the same method's full one, not dense
    for m in ("star", "ring"):
        full, incr = row[m]["accuracy"], row[edit.label(m)]["accuracy"]
        assert row[edit.label(m)]["retention"] == (round(incr / full, 4) if full else None)


def test_dense_incremental_kv_is_bit_identical_to_the_full_reingest(home, tiny_model, tok):
    plan = runner.plan(runner.EvalOptions(model=str(tiny_model), methods="dense,star",
                                          tasks="edit_unchanged", lengths="500", samples=1,
                                          dtype="fp32", block_size=128, edit=True))
    evaluator = runner.Evaluator(plan)
    sample = generators.generate("edit_unchanged", 500, 0, evaluator.tokenizer)
    full, incremental, stats = edit.encode_both(evaluator, sample, "dense")
    assert stats["reused"] >= 1 and stats["encoded"] >= 1
    assert len(full.parts) == len(incremental.parts) == stats["blocks"]
    for (fk, fv), (ik, iv) in zip(full.parts, incremental.parts):
        assert torch.equal(fk, ik) and torch.equal(fv, iv)
    # star: the kept block 0 is the very same KV, a re-rotated one only close to it
    full, incremental, stats = edit.encode_both(evaluator, sample, "star")
    assert torch.equal(full.parts[0][0], incremental.parts[0][0])
