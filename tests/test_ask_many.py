"""`starqa ask --questions FILE`: several questions answered together by the context's warm
group, each the answer it gets alone, printed in order with its sources."""

import json

import pytest

from fakes import starqa

QUESTIONS = ["who approved the travel budget", "what is the retry limit", "leave policy ?"]


def test_questions_of_a_file_are_answered_together_as_alone(docs_context, tmp_path):
    (tmp_path / "questions.txt").write_text("\n".join(QUESTIONS) + "\n\n")
    together = starqa("ask", "--questions", str(tmp_path / "questions.txt"), "--json",
                      "--max-new-tokens", "6", "--keep-alive", "0")
    assert together.returncode == 0, together.stderr
    records = [json.loads(line) for line in together.stdout.splitlines()]
    assert [r["question"] for r in records] == QUESTIONS and all(r["warm"] for r in records)
    for record in records:
        alone = starqa("ask", record["question"], "--json", "--max-new-tokens", "6")
        assert alone.returncode == 0, alone.stderr
        assert json.loads(alone.stdout)["answer"] == record["answer"]
    plain = starqa("ask", "-q", "-", "--max-new-tokens", "4", "--keep-alive", "0",
                   input=QUESTIONS[0] + "\n")
    assert plain.returncode == 0 and "1. who approved the travel budget" in plain.stderr
    assert starqa("ps").stdout.count("docs") == 0  # --keep-alive 0 left no group


def test_a_question_and_a_file_of_them_are_refused_together(docs_context, tmp_path):
    both = starqa("ask", "why", "--questions", str(tmp_path / "q.txt"))
    assert both.returncode == 2 and "not both" in both.stderr
    neither = starqa("ask")
    assert neither.returncode == 2 and "--questions FILE" in neither.stderr
    (tmp_path / "empty.txt").write_text("\n \n")
    empty = starqa("ask", "--questions", str(tmp_path / "empty.txt"))
    assert empty.returncode == 1 and "holds no question" in empty.stderr


@pytest.mark.slow
@pytest.mark.parametrize("attention", [None, "ivf"])
def test_two_workers_answer_questions_together_as_alone(home, docs, tiny_model, attention):
    """`api.ask_all` on a group of two workers, exact and top-k: every question gets the
    tokens it gets asked alone on the same group."""
    from starqa import api

    ctx = api.ingest(docs, model=str(tiny_model),
                     options=api.IngestSettings(dtype="fp32", block_size=50,
                                                index=attention))
    topk = api.TopK(count=4, index=attention) if attention else None
    asking = dict(max_new_tokens=8, attention=topk, workers=2, keepalive=120)
    try:
        alone = [api.ask_all([q], ctx, **asking)[0].result() for q in QUESTIONS]
        together = [s.result() for s in api.ask_all(QUESTIONS, ctx, **asking)]
    finally:
        api.stop(ctx)
    assert all(a.workers == 2 and a.warm for a in together)
    assert [a.token_ids for a in together] == [a.token_ids for a in alone]
    assert all(a.token_ids for a in alone)


def test_questions_together_meet_the_attention_the_group_has():
    """A group serving the context with other attention than asked for is an error naming
    the fix, for `ask_all` as for a chat; the same attention, or no group, passes."""
    from types import SimpleNamespace

    from starqa import api
    from starqa.api.asking import check_attention

    ctx = SimpleNamespace(name="docs", key="abc123")
    exact, topk = SimpleNamespace(topk=None), api.TopK(count=4)
    with pytest.raises(api.StarqaError, match="already serves docs with exact") as error:
        check_attention(exact, ctx, topk, "ask")
    assert error.value.hint == ("stop it first (starqa stop abc123), or ask with the "
                                "attention it has")
    with pytest.raises(api.StarqaError, match="with top-k attention"):
        check_attention(SimpleNamespace(topk=topk.as_dict()), ctx, None, "chat")
    check_attention(exact, ctx, None, "ask")
    check_attention(SimpleNamespace(topk=topk.as_dict()), ctx, topk, "ask")
    check_attention(None, ctx, topk, "ask")
