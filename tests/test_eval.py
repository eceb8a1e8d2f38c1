"""`starqa eval`: generated samples, scoring, the runner on the tiny random model, CLI errors.

Generators are checked with the tiny word-level tokenizer (every word and punctuation mark
a token, unknown words one <unk> each), so lengths are measured without any real model.
"""

import dataclasses
import itertools
import json
import re
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from starqa.corpus import prompt
from starqa.cli import app
from starqa.cli.options import TopKChoice, topk_runs
from starqa.core.errors import StarqaError
from starqa.measure.evals import generators, prose, runner, scoring, words
from starqa.topk.indexes import TopK
from starqa.models import load_model, load_tokenizer

SYNTHETIC = [t for t in generators.TASKS if t != "qa"]


def same(a: generators.Sample, b: generators.Sample) -> bool:
    return (a.context_text, a.question, a.answers, a.context_ids, a.query_ids, a.meta) == \
           (b.context_text, b.question, b.answers, b.context_ids, b.query_ids, b.meta)


# ---------------------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("task", list(generators.TASKS))
def test_same_seed_same_sample_other_seed_or_index_another(tok, task):
    a = generators.generate(task, 1200, 7, tok)
    assert same(a, generators.generate(task, 1200, 7, tok))
    assert not same(a, generators.generate(task, 1200, 8, tok))
    assert not same(a, generators.generate(task, 1200, 7, tok, index=1))


def test_content_does_not_depend_on_the_tokenizer_only_the_amount(tok):
    """Keys, values and depths come from the seed alone; a tokenizer only sizes the haystack."""

    class Halved:  # the same tokenizer, but the context counts double
        chat_template = tok.chat_template

        def apply_chat_template(self, *a, **kw):
            return tok.apply_chat_template(*a, **kw)

    class Doubled(prompt.Encoder):  # how starqa tokenises for it: every token twice
        def encode(self, pieces):
            ids, ends = super().encode(pieces)
            return [i for i in ids for _ in "ab"], [e for e in ends for _ in "ab"]

    halved = Halved()
    prompt._ENCODERS[halved] = Doubled(tok.backend_tokenizer)
    a = generators.generate("niah_multikey_1", 1200, 3, tok)
    b = generators.generate("niah_multikey_1", 1200, 3, halved)
    assert a.answers == b.answers and a.question == b.question
    assert a.meta["needles"] == b.meta["needles"]
    assert b.meta["units"] < a.meta["units"]


@pytest.mark.parametrize("task", list(generators.TASKS))
@pytest.mark.parametrize("length", [600, 1500, 4000])
def test_lengths_fill_the_budget_and_are_measured_as_laid_out(tok, task, length):
    s = generators.generate(task, length, 1, tok)
    assert length - max(64, length // 20) <= s.tokens <= length
    # The budget is the layout starqa uses: the context part around the packed documents,
    # the question in the query part, then the answer.
    ctx = prompt.tokenize_context(tok, s.context_text, []).ids
    assert ctx == s.context_ids
    assert prompt.tokenize_query(tok, s.question) == s.query_ids
    assert s.question not in prompt.context_text(tok, s.context_text)[0]


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("length", [1024, 8192])
def test_lengths_with_the_embedded_models_tokenizer(embedded_model, length):
    tok = load_tokenizer(embedded_model)  # BPE: digits, UUIDs and pseudo-words cost more
    for task in generators.TASKS:
        s = generators.generate(task, length, 0, tok)
        assert length - max(64, length // 20) <= s.tokens <= length


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("task", [t for t in SYNTHETIC if t.startswith("niah")])
def test_needles_map_each_key_to_its_values_exactly_once(tok, task, seed):
    s = generators.generate(task, 2000, seed, tok)
    text = s.context_text.lower()
    needles = s.meta["needles"]
    for a in s.answers:
        assert text.count(a.lower()) == 1
        assert a.lower() not in s.question.lower()
    for n in needles:  # every placed needle says exactly its key -> value, once
        line = f"for {n['key']} is: {n['value']}.".lower()
        assert text.count(line) == 1
        assert 0 <= n["depth"] <= 1
    asked = [n for n in needles
             if re.search(rf"(?<![\w-]){re.escape(n['key'])}(?![\w-])", s.question)]
    assert sorted(s.answers) == sorted(n["value"] for n in asked)
    expected = {"niah_multikey_1": (4, 1), "niah_multivalue": (4, 4), "niah_multiquery": (4, 4)}
    placed, n_answers = expected.get(task, (1, 1))
    assert len(needles) == placed and len(s.answers) == n_answers
    if task in ("niah_multikey_2", "niah_multikey_3"):  # the haystack is other keys' needles
        keys = re.findall(r"for (\S+) is:", s.context_text)
        assert len(keys) == len(set(keys)) > 10
    if task == "niah_multivalue":
        assert len({n["key"] for n in needles}) == 1
        assert all(v in words.VALUE_WORDS for v in s.answers)
    if task == "niah_single_3":
        assert re.fullmatch(r"[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", s.answers[0])
    if task in ("niah_single_1", "niah_single_2", "niah_multikey_1"):
        assert re.fullmatch(r"\d{7}", s.answers[0])


def test_needle_depth_varies_by_seed_and_sets_the_place(tok):
    depths = []
    for seed in range(8):
        s = generators.generate("niah_single_2", 3000, seed, tok)
        depth = s.meta["needles"][0]["depth"]
        depths.append(depth)
        where = s.context_text.index(s.answers[0]) / len(s.context_text)
        assert abs(where - depth) < 0.1
    assert max(depths) - min(depths) > 0.4


@pytest.mark.parametrize("seed", range(4))
def test_variable_tracking_chain(tok, seed):
    s = generators.generate("vt", 2000, seed, tok)
    lines = [x for x in s.context_text.splitlines() if x.startswith("VAR ")]
    assert len(lines) == 10  # two chains of 4 hops: 5 assignments each
    value = int(re.search(r"value (\d+)", s.question)[1])
    holds = {}
    for line in lines:  # follow the assignments in the order they appear
        name, rhs = re.fullmatch(r"VAR (\w+) = (.+)", line).groups()
        holds[name] = int(rhs) if rhs.isdigit() else holds[rhs.removeprefix("VAR ")]
    assert sorted(n for n, v in holds.items() if v == value) == sorted(s.answers)
    assert len(s.answers) == 5


@pytest.mark.parametrize("length", [700, 3000])
def test_common_words_are_the_most_common(tok, length):
    s = generators.generate("cwe", length, 2, tok)
    items = re.findall(r"^\d+\. (\S+)$", s.context_text, flags=re.M)
    counts = Counter(items)
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(s.answers) and len(s.answers) == 10
    rare = max(c for w, c in counts.items() if w not in top)
    assert min(counts[w] for w in s.answers) > rare


def test_frequent_words_are_the_most_frequent(tok):
    s = generators.generate("fwe", 2000, 4, tok)
    body = s.context_text.split("\n", 1)[1].rsplit("\n", 1)[0]  # inside <document ...>
    counts = Counter(body.split())
    ranked = [w for w, _ in counts.most_common(4)]
    assert ranked[:3] == s.answers
    assert counts[ranked[2]] > counts[ranked[3]]


@pytest.mark.parametrize("seed", range(5))
def test_qa_holds_its_gold_file_and_answer(tok, seed):
    s = generators.generate("qa", 2500, seed, tok)
    assert s.match == "any"
    assert f'<document path="{s.meta["file"]}">' in s.context_text
    assert any(a.lower() in s.context_text.lower() for a in s.answers)
    assert "questions.jsonl" not in s.context_text and s.question not in s.context_text
    gold = (generators.SAMPLES_DIR / s.meta["file"]).read_text().rstrip()
    assert gold in s.context_text


@pytest.mark.parametrize("task", ["niah_files_1", "niah_files_2"])
def test_look_alike_files_record_the_needles_file_and_line(tok, task):
    golds = set()
    for seed in range(6):
        s = generators.generate(task, 3000, seed, tok)
        where = s.meta["source"]
        paths = [f.path for f in s.files]
        assert len(paths) == s.meta["files"] == 5 and len(set(paths)) == 5
        stem = {p.rsplit("_", 1)[0] for p in paths}
        assert len(stem) == 1  # files of one kind, named alike
        golds.add(where["file"])
        needle = f"for {s.meta['needles'][0]['key']} is: {s.answers[0]}."
        body = s.context_text.split(f'<document path="{where["file"]}">\n')[1]
        assert needle in body.splitlines()[where["line"] - 1]
        # The manifest-shaped files map that line to the tokens where the needle starts.
        gold = s.files[paths.index(where["file"])]
        assert gold.token_start < gold.line_tokens[where["line"] - 1] < gold.token_end
        assert len(gold.line_tokens) == gold.lines
        starts = [f.token_start for f in s.files]
        assert starts == sorted(starts) and s.files[-1].token_end <= len(s.context_ids)
    assert len(golds) > 2  # the needle's file varies by seed


@pytest.mark.parametrize("seed", range(3))
def test_qa_records_the_answers_line_in_its_gold_file(tok, seed):
    s = generators.generate("qa", 2500, seed, tok)
    where = s.meta["source"]
    assert where["file"] == s.meta["file"]
    line = (generators.SAMPLES_DIR / where["file"]).read_text().splitlines()[where["line"] - 1]
    assert any(a.lower() in line.lower() for a in s.answers)


def test_prose_has_no_digits_hyphens_or_needle_words():
    text = " ".join(prose.PARAGRAPHS)
    assert not re.search(r"[\d-]", text)
    assert "magic" not in text.lower()
    assert len(text.split()) > 4500
    assert not [w for w in words.VALUE_WORDS if w in text.lower()]
    assert not set(words.VALUE_WORDS) & (set(words.ADJECTIVES) | set(words.NOUNS))


def test_too_short_and_unknown_tasks_are_clear_errors(tok):
    with pytest.raises(StarqaError, match="too short for niah_single_3"):
        generators.generate("niah_single_3", 40, 0, tok)
    with pytest.raises(StarqaError, match="Unknown task 'nah'"):
        generators.resolve_tasks("niah_single_1,nah")
    assert generators.resolve_tasks("niah,vt")[-1] == "vt"
    assert len(generators.resolve_tasks("niah")) == 10
    assert generators.resolve_tasks(None) == [t for t in generators.TASKS
                                              if t not in generators.EDIT]


# ---------------------------------------------------------------------------------------
# scoring


def test_scoring_is_case_insensitive_substring_of_every_answer():
    assert scoring.is_correct("The number is 1234567.", ["1234567"])
    assert scoring.is_correct("ABC-def", ["abc-DEF"])
    assert not scoring.is_correct("123456", ["1234567"])
    assert not scoring.is_correct("baboon and pelican", ["baboon", "pelican", "wombat"])
    assert scoring.is_correct("Pelican, WOMBAT, baboon", ["baboon", "pelican", "wombat"])
    assert scoring.found("baboon", ["baboon", "wombat"]) == [True, False]
    assert scoring.is_correct("It is 184000 euros", ["184,000", "184000"], match="any")
    assert not scoring.is_correct("anything", [])



def test_a_number_is_not_found_inside_a_longer_number():
    """repo_qa's values ("45") and RULER's needles: a longer number that contains the
    answer is another number; words still match inside words."""
    assert not scoring.is_correct("MAX_RETRIES = 450", ["45"])
    assert not scoring.is_correct("it is 1450", ["45"])
    assert not scoring.is_correct("12345678", ["1234567"])
    assert not scoring.is_correct("1.75", ["7"])
    assert scoring.is_correct("MAX_RETRIES = 45.", ["45"])
    assert scoring.is_correct("timeout=45s", ["45"])
    assert scoring.is_correct("v2 and 'x45'", ["x45"])  # a letter before: not a number's edge
    assert scoring.is_correct("'utf-8'", ["utf-8"])
    assert scoring.found("the needles", ["needle"]) == [True]


def test_an_answer_is_settled_once_no_later_text_can_undo_it():
    """eval stops decoding once the answers are in: a number at the very end may still
    grow ("45" → "450"), so it is not settled until a non-digit follows."""
    assert scoring.is_correct("MAX = 45", ["45"]) and not scoring.settled("MAX = 45", ["45"])
    assert scoring.settled("MAX = 45.", ["45"])
    assert scoring.settled("the needle", ["needle"])  # a word stays found
    assert not scoring.settled("4", ["45"])
    # "any": one answer found now and after whatever follows, not one now and another later
    assert not scoring.settled("45", ["45", "450"], match="any")
    assert scoring.settled("45 and", ["45", "450"], match="any")
    # every text of up to 5 characters over "450 .": settled means correct whatever follows
    texts = ["".join(chars) for n in range(6) for chars in itertools.product("450 .", repeat=n)]
    answers = (["45"], ["450", "45"], ["0"], ["4.5"])
    seen = 0
    for text in texts:
        for ans in answers:
            for match in ("all", "any"):
                if scoring.settled(text, ans, match):
                    seen += 1
                    for tail in ("0", "5", "4", ".", " ", "x", "05"):
                        assert scoring.is_correct(text + tail, ans, match), (text, tail, ans)
    assert seen > 100

def test_retention_and_summary():
    assert scoring.retention(0.5, 1.0) == 0.5
    assert scoring.retention(1.0, 0.5) == 2.0
    assert scoring.retention(0.0, 0.0) is None and scoring.retention(0.5, 0.0) is None

    def sample(task, length, dense, star):
        results = {"dense": {"correct": dense}}
        if star is not None:
            results["star"] = {"correct": star}
        return {"task": task, "length": length, "results": results}

    rows = scoring.summarize([
        sample("a", 1024, True, True), sample("a", 1024, True, False),
        sample("b", 1024, False, True), sample("b", 1024, False, False),
        sample("a", 2048, True, True),
        sample("a", 2048, True, None),  # interrupted before star: left out of both
    ], ["dense", "star"])
    by = {(r["task"], r["length"]): r for r in rows}
    assert [(r["task"], r["length"]) for r in rows] == [("a", 1024), ("b", 1024), ("all", 1024),
                                                        ("a", 2048)]
    assert by["a", 1024]["methods"]["star"] == {"correct": 1, "accuracy": 0.5, "retention": 0.5,
                                                 "sources": None}
    assert by["b", 1024]["methods"]["star"]["retention"] is None  # dense 0: n/a
    assert by["all", 1024]["methods"]["dense"]["accuracy"] == 0.5
    assert by["all", 1024]["methods"]["star"] == {"correct": 2, "accuracy": 0.5,
                                                   "retention": 1.0, "sources": None}
    assert by["a", 2048]["n"] == 1 and by["a", 2048]["methods"]["dense"]["retention"] is None


def test_source_score_and_its_summary():
    truth = {"file": "b.md", "line": 9}
    named = [{"path": "b.md", "share": 0.5, "lines": [4, 6]},
             {"path": "a.md", "share": 0.3, "lines": [1, 1]}]
    assert scoring.source_score(named, truth) == {"top1": True, "top3": True, "line_distance": 3}
    assert scoring.source_score(named, {"file": "b.md", "line": 5})["line_distance"] == 0
    assert scoring.source_score(named[::-1], truth) == {"top1": False, "top3": True,
                                                        "line_distance": None}
    assert scoring.source_score([], truth) == {"top1": False, "top3": False,
                                               "line_distance": None}
    assert scoring.source_score(named, {"file": "b.md", "line": None})["line_distance"] is None

    def result(correct, top1, top3, distance):
        return {"correct": correct, "source_score": {"top1": top1, "top3": top3,
                                                     "line_distance": distance}}

    summary = scoring.sources_summary([
        result(True, True, True, 0), result(True, False, True, None),
        result(True, True, True, 4), result(False, True, True, 0),  # wrong answer: left out
        {"correct": True}])  # no known place: left out
    assert summary == {"n": 3, "top1": 0.6667, "top3": 1.0, "line_distance": 2.0}
    assert scoring.sources_summary([result(False, True, True, 0), {"correct": True}]) is None
    rows = scoring.summarize([{"task": "a", "length": 1, "results": {
        "dense": result(True, True, True, 1)}}], ["dense"])
    assert rows[0]["methods"]["dense"]["sources"]["top1"] == 1.0


# ---------------------------------------------------------------------------------------
# options and CLI errors


def test_lengths_parse_and_fit_the_window():
    assert runner.parse_lengths("2k, 1k,1500,1.5k") == (1024, 1500, 1536, 2048)
    assert runner.parse_lengths(None) is None and runner.parse_lengths(" ") is None
    for bad in ("1x", "k", "1k,,2k", "0", "-1k", "1.1", "1.1k", "0.0001k"):
        with pytest.raises(StarqaError, match="Bad --lengths") as err:
            runner.parse_lengths(bad)
        assert err.value.hint.startswith("--lengths 1k,2k,4k  # ")  # pasted, it works
    assert runner.fit_window(None, 8192) == ([1024, 2048, 4096, 8192], [])
    assert runner.fit_window(None, 512) == ([512], [])
    lengths, [note] = runner.fit_window([1024, 16384], 8192)  # past the window: said
    assert lengths == [1024, 16384] and note.startswith("16k past the 8,192-token window")


def test_top_k_lists_run_every_combination():
    """eval's --top-k, --top-k-prefill and --top-k-tail lists: each combination once, in
    the order given (starqa.cli.options, the grammar of every command)."""
    found = topk_runs(TopKChoice("topk", "0.5%,1%,0.5%", index="ivf", prefill="exact,topk",
                                 tail="lists,none"))
    assert [(t.label, t.prefill, t.tail) for t in found] == [
        (b, p, t) for b in ("0.5%", "1%") for p in ("exact", "topk") for t in ("lists", "none")]
    assert topk_runs(TopKChoice()) == ()
    with pytest.raises(StarqaError, match="--top-k only apply to --attention topk"):
        topk_runs(TopKChoice(top_k="1%,2%"))


def test_methods_dense_first():
    assert runner.parse_methods("star,ring") == (["dense", "star", "ring"], True)
    assert runner.parse_methods("star,dense") == (["dense", "star"], False)
    assert set(runner.parse_methods(None)[0]) == set(runner.methods_mod.METHODS)
    with pytest.raises(StarqaError, match="Unknown method 'flash'"):
        runner.parse_methods("star,flash")


def test_dense_is_left_out_where_it_would_only_extrapolate():
    """Every length past the window: dense, added but not asked for, is left out (and the
    note says so); one length within the window, or dense named, keeps it."""
    methods, added = runner.parse_methods("star")
    assert runner.reference(methods, added, [65_536], 32_768) == (
        ["star"], "dense left out: every length is past the 32,768-token window, where it "
                  "would extrapolate (name it in --methods to run it)")
    assert runner.reference(methods, added, [16_384, 65_536], 32_768) == (
        methods, "dense runs too: it is the reference of retention")
    named = runner.parse_methods("star,dense")
    assert runner.reference(*named, [65_536], 32_768) == (["dense", "star"], None)


@pytest.mark.parametrize("args, message", [
    (["--tasks", "niah_single_1,bogus"], "Unknown task 'bogus'"),
    (["--lengths", "1k,2q"], "Bad --lengths '1k,2q': '2q' is not a length"),
    (["--methods", "dense,warp"], "Unknown method 'warp'"),
    (["--methods", "dense", "--anchor-size", "8"], "--anchor-size only applies to star"),
    (["--heuristic", "nope"], "Unknown --heuristic 'nope'"),
])
def test_cli_errors_are_clear(home, tiny_model, args, message):
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model), *args])
    assert isinstance(result.exception, StarqaError), result.output
    assert message in str(result.exception)
    assert not (home / "evals").exists()  # nothing was run or written


# ---------------------------------------------------------------------------------------
# the runner on the tiny model


def test_eval_plans_past_the_window_as_ingest_does():
    """Past the window eval runs star with ingest's blocks and slots (its numbers are the
    default path's), sparse positions only when asked; within it, as given."""
    from starqa.launchers.ingest import IngestOptions, planner

    given = {"block_size": None, "anchor_size": None, "params": {}}
    fitted = runner.fitted_options("star", given, 65_437, 32_768)
    planned = planner.plan(IngestOptions(paths=("r",), reserve=512), 65_437, 32_768).opts
    assert fitted == {"block_size": planned.block_size, "anchor_size": planned.anchor_size,
                      "params": planned.method_params}
    assert fitted["params"] == {"positions": "contiguous", "slots": 6}
    sparse = {**given, "params": {"positions": "sparse"}}
    assert runner.fitted_options("star", sparse, 65_437, 32_768) == sparse
    assert runner.fitted_options("star", given, 16_000, 32_768) == given


def test_lengths_past_the_window_run_as_ingest_plans_them(home, tiny_model, tmp_path):
    """800 tokens on the 512-token window: star at contiguous positions, its blocks sized to
    the window (the question within it), dense extrapolating; a note says so."""
    opts = runner.EvalOptions(model=str(tiny_model), methods="dense,star", tasks="vt",
                              lengths="800", samples=1, dtype="fp32",
                              json_path=str(tmp_path / "eval.json"))
    plan = runner.plan(opts)
    assert any("800 past the 512-token window: star at contiguous positions" in note
               for note in plan.notes)
    [sample] = runner.run(plan)["samples"]
    star, dense = sample["results"]["star"], sample["results"]["dense"]
    assert star["method"]["params"] == {"positions": "contiguous"}
    assert star["method"]["block_size"] + star["method"]["anchor_size"] <= 512 - 128
    assert star["query_position"] + 128 <= 512 < dense["query_position"]


def test_runner_writes_json_and_dense_equals_plain_generate(home, tiny_model, tmp_path):
    out = tmp_path / "eval.json"
    opts = runner.EvalOptions(model=str(tiny_model), methods="dense,star", tasks="niah_single_1,vt",
                              lengths="300,400", samples=1, dtype="fp32", json_path=str(out),
                              block_size=64)
    plan = runner.plan(opts)
    assert plan.n_runs == 8 and plan.methods == ["dense", "star"]
    results = runner.run(plan)
    assert results["status"] == "complete" and results["runs_done"] == 8
    saved = json.loads(out.read_text())
    assert saved["status"] == "complete" and saved["format"] == runner.FORMAT
    settings = saved["settings"]
    assert settings["model"]["digest"] and settings["model"]["window"] == 512
    assert settings["seed"] == 0 and settings["lengths"] == [300, 400]
    assert settings["methods"] == ["dense", "star"] and settings["dtype"] == "float32"
    assert settings["method_options"]["star"]["block_size"] == 64
    assert "sources_scoring" in settings
    assert set(settings["tasks"]) == {"niah_single_1", "vt"}
    assert [(s["task"], s["length"]) for s in saved["samples"]] == [
        ("niah_single_1", 300), ("vt", 300), ("niah_single_1", 400), ("vt", 400)]
    for s in saved["samples"]:
        assert s["tokens"]["context"] + s["tokens"]["query"] + s["tokens"]["max_new"] <= s["length"]
        assert len(s["context_sha256"]) == 64 and s["answers"]
        for m in ("dense", "star"):
            r = s["results"][m]
            assert isinstance(r["prediction"], str) and isinstance(r["correct"], bool)
            assert r["method"]["name"] == m and r["method"]["block_size"] == 64
            assert r["blocks"] == -(-s["tokens"]["context"] // 64)
            assert r["stop"] in ("answer", "end", "max_new_tokens")
    assert [(r["task"], r["length"]) for r in saved["summary"]] == [
        ("niah_single_1", 300), ("vt", 300), ("all", 300),
        ("niah_single_1", 400), ("vt", 400), ("all", 400)]
    assert set(saved["summary"][0]["methods"]) == {"dense", "star"}

    # Dense in the eval is exactly an ordinary greedy generate over the whole prompt.
    sample = generators.generate("vt", 400, 0, load_tokenizer(tiny_model))
    model = load_model(tiny_model, dtype=torch.float32)
    ids = sample.context_ids + sample.query_ids
    ref = model.generate(torch.tensor([ids]), max_new_tokens=sample.max_new_tokens,
                         do_sample=False, eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
    got = saved["samples"][3]["results"]["dense"]
    assert got["stop"] != "answer"  # a random model: the whole answer was generated
    assert got["token_ids"] == [t for t in ref if t != 2][:len(got["token_ids"])]
    assert len(got["token_ids"]) == len([t for t in ref if t != 2])


def test_interrupt_keeps_finished_samples(home, tiny_model, tmp_path):
    out = tmp_path / "partial.json"
    plan = runner.plan(runner.EvalOptions(model=str(tiny_model), methods="star",
                                          tasks="niah_single_1", lengths="300", samples=3,
                                          dtype="fp32", json_path=str(out)))

    class CtrlC(runner.Progress):
        runs = 0

        def run(self, task, length, index, method):
            if self.runs == 3:  # the second sample's star run
                raise KeyboardInterrupt
            self.runs += 1

    results = runner.run(plan, CtrlC())
    saved = json.loads(out.read_text())
    assert results["status"] == saved["status"] == "interrupted"
    assert saved["runs_done"] == 3 and len(saved["samples"]) == 2
    assert list(saved["samples"][1]["results"]) == ["dense"]
    assert saved["summary"][0]["n"] == 1  # only the sample both methods answered
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: no temp file left


def test_every_method_runs_generically_and_ring_is_dense(home, tiny_model, tmp_path):
    # dense named: 400 tokens and the reserve are past the tiny model's window
    opts = runner.EvalOptions(model=str(tiny_model), methods="dense,ring,pulsar",
                              tasks="niah_single_2",
                              lengths="400", samples=1, dtype="fp32", block_size=100,
                              method_params={"positions": "contiguous", "sink": 8},
                              json_path=str(tmp_path / "r.json"))
    results = runner.run(runner.plan(opts))
    [sample] = results["samples"]
    r = sample["results"]
    assert list(r) == ["dense", "ring", "pulsar"]
    assert r["ring"]["token_ids"] == r["dense"]["token_ids"]  # exact, like dense
    assert r["pulsar"]["method"]["params"]["positions"] == "contiguous"
    assert r["pulsar"]["query_position"] < sample["tokens"]["context"]  # shifted, see engine
    assert r["dense"]["query_position"] == sample["tokens"]["context"]


def test_runner_names_sources_and_scores_them(home, tiny_model, tmp_path, capsys):
    from starqa.cli import eval_report as report

    # dense named: 450 tokens and the reserve are past the tiny model's window
    opts = runner.EvalOptions(model=str(tiny_model), methods="dense,star", tasks="niah_files_1",
                              lengths="450", samples=1, dtype="fp32", block_size=128,
                              json_path=str(tmp_path / "s.json"))
    results = runner.run(runner.plan(opts))
    [sample] = results["samples"]
    paths = [f"notes/notes_{i:02d}.md" for i in (1, 2, 3)]
    for m in ("dense", "star"):
        r = sample["results"][m]
        assert r["sources"] and {s["path"] for s in r["sources"]} <= set(paths)
        shares = [s["share"] for s in r["sources"]]  # the files that stand out, best first
        assert sum(shares) <= 1.0 + 1e-9 and all(x >= shares[0] / 3 for x in shares)
        top1 = r["sources"][0]["path"] == sample["meta"]["source"]["file"]
        assert r["source_score"]["top1"] == top1
    # A random model answers nothing correctly: the sources score has no sample to count.
    assert results["summary"][0]["methods"]["star"]["sources"] is None
    # top-k attention names no sources: nothing to score (not "0 of n right")
    topk = runner.run(runner.plan(dataclasses.replace(opts, methods="dense", topk=(
        TopK(count=8),), json_path=str(tmp_path / "t.json"))))["samples"][0]["results"]
    assert "source_score" in topk["dense"] and "source_score" not in topk["dense topk 8"]
    row = results["summary"][0]
    row["methods"]["star"]["sources"] = {"n": 4, "top1": 0.75, "top3": 1.0, "line_distance": 1}
    report.results_table(results)
    assert "3/4 · 4/4 · ±1" in capsys.readouterr().out


def test_progress_is_a_line_per_run_where_stderr_is_no_terminal(capsys):
    """`starqa eval 2> log` (or CI) says what is done as it goes, not only at the end."""
    import types

    from starqa.cli import eval_report as report

    with report.RichProgress() as progress:
        progress.start(types.SimpleNamespace(n_runs=2))
        progress.run("repo_qa", 30000, 0, "dense")
        progress.done(12, True)
        progress.run("repo_qa", 30000, 0, "star")
        progress.done(9, False)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("repo_qa 30,000 #1 dense: correct in ")
    assert lines[0].endswith(" s · 1/2 runs, 100% correct")
    assert lines[1].startswith("repo_qa 30,000 #1 star: wrong in ") and "2/2 runs, 50%" in lines[1]


def test_the_table_is_whole_where_stdout_is_no_terminal(capsys):
    """`starqa eval > log`: every column at its full width, none cut to "…" at 80 columns."""
    from starqa.cli import eval_report as report

    methods = ["dense", "star", "pulsar", "apb"]
    score = {"correct": 3, "accuracy": 0.375, "retention": 1.0,
             "sources": {"n": 3, "top1": 1.0, "top3": 1.0, "line_distance": 0}}
    report.results_table({"settings": {"methods": methods}, "summary": [
        {"task": "repo_qa", "length": 30000, "n": 8,
         "methods": {m: {**score, "retention": None if m == "dense" else 1.0}
                     for m in methods}}]})
    lines = capsys.readouterr().out.splitlines()
    assert "…" not in "\n".join(lines)
    assert lines[0].split() == ["task", "length", "n", "dense", "dense", "src", "star", "star",
                                "ret", "star", "src", "pulsar", "pulsar", "ret", "pulsar",
                                "src", "apb", "apb", "ret", "apb", "src"]
    assert "repo_qa" in lines[1] and "30,000" in lines[1] and "3/3 · 3/3 · ±0" in lines[1]


@pytest.mark.parametrize("code, status, message", [(130, 130, "interrupted"), (1, 1, ""),
                                                   (0, None, ""), (None, None, "")])
def test_main_exits_with_the_code_typer_hands_back(monkeypatch, capsys, code, status, message):
    """typer without standalone mode returns typer.Exit's code, and Ctrl-C as 130."""
    from starqa.cli import commands as cli

    monkeypatch.setattr(cli, "app", lambda standalone_mode: code)
    if status is None:
        cli.main()
    else:
        with pytest.raises(SystemExit) as exit_:
            cli.main()
        assert exit_.value.code == status
    assert message in capsys.readouterr().err


def test_main_stops_on_sigterm_inside_and_leaves_the_callers_handler(monkeypatch):
    """While a command runs, SIGTERM stops it as Ctrl-C does (cleanup runs, exit 130);
    after `main` returns, the handler the process had before is back: an in-process
    caller (tests) and the processes it forks do not inherit starqa's."""
    import os
    import signal

    from starqa.cli import commands as cli

    def command(standalone_mode):
        os.kill(os.getpid(), signal.SIGTERM)  # raises KeyboardInterrupt here
        return 0

    mine = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        monkeypatch.setattr(cli, "app", command)
        with pytest.raises(SystemExit) as exit_:
            cli.main()
        assert exit_.value.code == 130
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, mine)


def test_kv_int8_runs_beside_float_with_retention_against_it(home, tiny_model, tmp_path):
    """--kv int8: each method also answers over its rows quantised as ingest stores them;
    its retention is against the same method over float KV, whose tokens it keeps here."""
    opts = runner.EvalOptions(model=str(tiny_model), methods="star", tasks="vt", lengths="300",
                              samples=1, dtype="fp32", json_path=str(tmp_path / "e.json"),
                              kv=("int8",))
    plan = runner.plan(opts)
    assert plan.labels == ["dense", "dense int8", "star", "star int8"]
    assert plan.references == {"dense int8": "dense", "star int8": "star"}
    results = runner.run(plan)
    [sample] = results["samples"]
    for m in ("dense", "star"):  # a random model's near-ties may flip: the first tokens agree
        assert sample["results"][f"{m} int8"]["token_ids"][:3] == \
            sample["results"][m]["token_ids"][:3]
    assert set(results["summary"][0]["methods"]) == set(plan.labels)
    with pytest.raises(StarqaError, match="Unknown --kv 'float'"):
        runner.plan(dataclasses.replace(opts, kv=("float",)))
