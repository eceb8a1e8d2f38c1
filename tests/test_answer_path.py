"""One answer path: `starqa ask --json` prints the API's own record (`Answer.as_dict()`),
and the warm group of a context answers whatever names its model (`--model` with the
context's own model as a path or a copy of it, `STARQA_MODEL` set in the shell), while a
group that cannot answer as asked is passed over with the reason said. On the tiny model of
`tiny.py`, through the real `starqa` command and a real warm group."""

import json
import shutil
from types import SimpleNamespace

import pytest

from fakes import starqa

QUESTION = "who approved the travel budget"


def ask_json(*args: str, env: dict | None = None) -> dict:
    out = starqa("ask", QUESTION, "--max-new-tokens", "4", "--json", *args, env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def served(docs_context, monkeypatch):
    """The docs context with a warm group of one worker; STARQA_MODEL unset."""
    from starqa.workers import client

    monkeypatch.delenv("STARQA_MODEL", raising=False)
    group = client.start(docs_context.key, None, keepalive=120)
    yield docs_context, group
    client.stop_group(docs_context.key)


@pytest.mark.slow
def test_ask_json_is_the_apis_record(served):
    """The same question through the command and through `api.ask`, both on the warm group:
    the same record, timings aside (they are the only thing that differs between two runs)."""
    from starqa import api

    manifest, _ = served
    printed = ask_json("--context", manifest.key)
    answer = api.ask(QUESTION, manifest.key, max_new_tokens=4)
    record = answer.as_dict()
    assert set(printed) == set(record) and printed["warm"] is True
    assert set(printed["timings"]) == set(record["timings"])
    for key in record.keys() - {"timings"}:
        assert printed[key] == record[key], key
    assert printed["tokens"]["answer"] == answer.answer_tokens > 0


@pytest.mark.slow
def test_ask_is_warm_whatever_names_the_contexts_model(served, tiny_model, tmp_path):
    """`--model` naming the context's own model, as the path it was ingested from, as
    another spelling of that path, as a copy elsewhere (same fingerprint); and the model set
    by `STARQA_MODEL` in the shell, as the docs invite: each is answered by the warm group."""
    manifest, group = served
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    spellings = [str(tiny_model), f"{tiny_model}/../{tiny_model.name}", str(copy)]
    for spec in spellings:
        record = ask_json("--context", manifest.key, "--model", spec)
        assert record["warm"] is True and record["workers"] == group.workers, spec
    assert ask_json("--context", manifest.key, env={"STARQA_MODEL": str(tiny_model)})["warm"]


@pytest.mark.slow
def test_a_group_with_other_weights_is_passed_over_saying_why(served):
    """A warm group answers with the weights it loaded: asked for others, the question is
    answered cold, and the command says why the group was not used."""
    manifest, group = served
    other = "int8" if group.weights != "int8" else "dense"
    out = starqa("ask", QUESTION, "--max-new-tokens", "2", "--json", "--context", manifest.key,
                 "--weights", other)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["warm"] is False
    assert f"Answering cold: its warm group answers with {group.weights} weights" in out.stderr


def _manifest(spec: str, path: str = "/nowhere/model", digest: str = "d" * 64):
    model = SimpleNamespace(spec=spec, path=path, digest=digest, name=spec)
    return SimpleNamespace(model=model, key="k" * 16, name="docs")


def test_an_embedded_model_is_named_by_its_name_or_alias_not_by_another():
    """No weights needed: the names of the embedded table."""
    from starqa import models
    from starqa.workers.client import names_model

    made = models.EMBEDDED[0]
    manifest = _manifest(made.name)
    assert names_model(manifest, None) and names_model(manifest, made.name)
    assert names_model(manifest, made.name.upper())
    assert all(names_model(manifest, alias) for alias in made.aliases)
    other = next(m for m in models.EMBEDDED if m.name != made.name)
    assert not names_model(manifest, other.name)
    assert not names_model(manifest, "/no/such/folder")


def test_the_group_is_chosen_in_one_place(monkeypatch):
    """`client.group_for`: the running group when it answers as asked; none, with the reason,
    when its weights or attention differ; none, silently, when the question names another
    model (the cold path refuses that with its own error)."""
    from starqa.workers import client

    group = SimpleNamespace(weights="int4", topk=None, workers=1)
    monkeypatch.setattr(client, "find", lambda key: group)
    manifest = _manifest("smollm2-135m")
    assert client.group_for(manifest) == (group, None)
    assert client.group_for(manifest, weights="int4") == (group, None)
    none, why = client.group_for(manifest, weights="int8")
    assert none is None and "int4 weights, not int8" in why
    none, why = client.group_for(manifest, topk={"count": 8})
    assert none is None and "exact attention" in why
    assert client.group_for(manifest, model="qwen2.5-coder-0.5b") == (None, None)
    monkeypatch.setattr(client, "find", lambda key: None)
    assert client.group_for(manifest) == (None, None)
