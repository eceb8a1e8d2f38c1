"""Scoring of `starqa eval`: case-insensitive substring match, accuracy and retention.

A prediction is correct when every expected answer occurs in it (match "all": multi-key,
multi-value, variable tracking, word extraction) or, where the answers are alternative
spellings of one answer (match "any": qa), when one does. Retention compares a method with
dense on the very same samples: method accuracy / dense accuracy, None when dense got none.
"""

from __future__ import annotations

from collections.abc import Sequence

from starqa.methods import REFERENCE  # dense, the exact method: what retention compares with


def found(prediction: str, answers: Sequence[str]) -> list[bool]:
    """For each answer: does it occur in the prediction (case-insensitive)?"""
    text = prediction.lower()
    return [a.lower() in text for a in answers]


def is_correct(prediction: str, answers: Sequence[str], match: str = "all") -> bool:
    hits = found(prediction, answers)
    if match == "any":
        return any(hits)
    if match == "all":
        return bool(hits) and all(hits)
    raise ValueError(f"match must be 'all' or 'any', not {match!r}")


def retention(accuracy: float, reference: float) -> float | None:
    """accuracy / reference accuracy; None (n/a) when the reference is 0."""
    return accuracy / reference if reference > 0 else None


def summarize(samples: Sequence[dict], methods: Sequence[str]) -> list[dict]:
    """Accuracy per (task, length) and method, and retention vs dense, over the samples
    every method has answered (an interrupted run's last sample may lack some); then one
    row per length averaging the tasks (task "all").

    samples: records with "task", "length" and "results": {method: {"correct": bool}}.
    Returns rows {"task", "length", "n", "methods": {m: {"correct", "accuracy",
    "retention"}}} in the order the (task, length) pairs first appear.
    """
    groups: dict[tuple[str, int], list[dict]] = {}
    for s in samples:
        if all(m in s["results"] for m in methods):
            groups.setdefault((s["task"], s["length"]), []).append(s)
    rows = []
    for length in dict.fromkeys(length for _, length in groups):
        same = []
        for (task, at), group in groups.items():
            if at == length:
                correct = {m: sum(bool(s["results"][m]["correct"]) for s in group)
                           for m in methods}
                same.append(_row(task, length, len(group),
                                 {m: (correct[m], correct[m] / len(group)) for m in methods}))
        rows += same
        if len(same) > 1:  # the tasks' mean accuracy (each task weighs the same)
            mean = {m: (sum(r["methods"][m]["correct"] for r in same),
                        sum(r["methods"][m]["accuracy"] for r in same) / len(same))
                    for m in methods}
            rows.append(_row("all", length, sum(r["n"] for r in same), mean))
    return rows


def _row(task: str, length: int, n: int, scores: dict[str, tuple[int, float]]) -> dict:
    reference = scores.get(REFERENCE, (0, 0.0))[1]
    out = {}
    for m, (c, acc) in scores.items():
        kept = None if m == REFERENCE else retention(acc, reference)
        out[m] = {"correct": c, "accuracy": round(acc, 4),
                  "retention": None if kept is None else round(kept, 4)}
    return {"task": task, "length": length, "n": n, "methods": out}
