"""`starqa ask --questions FILE`: several questions answered together by the context's warm
group, each the answer it gets alone, printed in order with its sources."""

import json

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
