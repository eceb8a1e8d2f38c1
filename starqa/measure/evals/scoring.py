"""Scoring of `starqa eval`: case-insensitive substring match, accuracy and retention.

An answer is found where it occurs in the prediction in any case, except inside a longer
number: an answer that begins (ends) with a digit must not follow (be followed by) another
digit, so "45" is not found in "450" nor "7" in "1.75" (a number inside another is another
number); words keep plain substring matching ("needle" is found in "needles").

A prediction is correct when every expected answer occurs in it (match "all": multi-key,
multi-value, variable tracking, word extraction) or, where the answers are alternative
spellings of one answer (match "any": qa), when one does. Retention compares a method with
dense on the very same samples: method accuracy / dense accuracy, None when dense got none.

Sources are scored where a sample knows its answer's place (meta["source"]: file, line)
and the method answered correctly (a wrong answer's sources say nothing of attribution):
is the top source that file (top-1), is it among the first three (top-3), and how many
lines lie between the truth and the top source's line range when its file is right.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

from starqa.methods import REFERENCE  # dense, the exact method: what retention compares with


def found(prediction: str, answers: Sequence[str]) -> list[bool]:
    """For each answer: does it occur in the prediction (case-insensitive; a number not
    inside a longer one, see the module docstring)?"""
    return [re.search(_pattern(a), prediction, re.IGNORECASE) is not None for a in answers]


def _pattern(answer: str) -> str:
    before = r"(?<!\d)" if answer[:1].isdigit() else ""
    after = r"(?!\d)" if answer[-1:].isdigit() else ""
    return before + re.escape(answer) + after


def is_correct(prediction: str, answers: Sequence[str], match: str = "all") -> bool:
    return _verdict(found(prediction, answers), match)


def settled(prediction: str, answers: Sequence[str], match: str = "all") -> bool:
    """Whether `prediction` is correct whatever text follows it: what lets `starqa eval`
    stop decoding early. A word found stays found; a number found at the very end may
    still grow into a longer one ("45" → "450"), so each answer must also be found with a
    digit appended (then its match ends before a non-digit: a digit-led answer cannot
    match across the appended one)."""
    hits = zip(found(prediction, answers), found(prediction + "0", answers))
    return _verdict([now and later for now, later in hits], match)


def _verdict(hits: list[bool], match: str) -> bool:
    if match == "any":
        return any(hits)
    if match == "all":
        return bool(hits) and all(hits)
    raise ValueError(f"match must be 'all' or 'any', not {match!r}")


def retention(accuracy: float, reference: float) -> float | None:
    """accuracy / reference accuracy; None (n/a) when the reference is 0."""
    return accuracy / reference if reference > 0 else None


def source_score(named: Sequence[dict], truth: dict) -> dict:
    """named: top sources ({"path", "share", "lines": [first, last]}, best first); truth:
    {"file", "line"} (line may be None). Returns {"top1", "top3": bool, "line_distance":
    int | None} (None: the top file is wrong or the line unknown)."""
    paths = [s["path"] for s in named]
    top1 = paths[:1] == [truth["file"]]
    distance = None
    if top1 and truth.get("line") is not None:
        first, last = named[0]["lines"]
        distance = max(first - truth["line"], truth["line"] - last, 0)
    return {"top1": top1, "top3": truth["file"] in paths[:3], "line_distance": distance}


def sources_summary(results: Sequence[dict]) -> dict | None:
    """The sources score over one method's results on a group of samples: fractions top-1
    and top-3 and the median line distance, over the results that answered correctly and
    carry a "source_score"; None when there are none."""
    scored = [r["source_score"] for r in results if r.get("correct") and r.get("source_score")]
    if not scored:
        return None
    distances = [s["line_distance"] for s in scored if s["line_distance"] is not None]
    return {"n": len(scored),
            "top1": round(sum(s["top1"] for s in scored) / len(scored), 4),
            "top3": round(sum(s["top3"] for s in scored) / len(scored), 4),
            "line_distance": statistics.median(distances) if distances else None}


def summarize(samples: Sequence[dict], methods: Sequence[str],
              references: dict[str, str] | None = None) -> list[dict]:
    """Accuracy per (task, length) and method, and retention vs dense (or, for a label
    `references` names, vs that label: `eval --edit`'s incremental runs against the full
    ones), over the samples every method has answered (an interrupted run's last sample may
    lack some); then one row per length averaging the tasks (task "all"). Results with a
    "same_tokens" flag also get its share ("same_tokens": fraction of the row's samples).

    samples: records with "task", "length" and "results": {method: {"correct": bool}}.
    Returns rows {"task", "length", "n", "methods": {m: {"correct", "accuracy",
    "retention", "sources"}}} in the order the (task, length) pairs first appear; "sources"
    is `sources_summary` over the row's samples (None where no place is known).
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
                                 {m: (correct[m], correct[m] / len(group)) for m in methods},
                                 {m: [s["results"][m] for s in group] for m in methods},
                                 references or {}))
        rows += same
        if len(same) > 1:  # the tasks' mean accuracy (each task weighs the same)
            mean = {m: (sum(r["methods"][m]["correct"] for r in same),
                        sum(r["methods"][m]["accuracy"] for r in same) / len(same))
                    for m in methods}
            every = [s for (_, at), group in groups.items() if at == length for s in group]
            rows.append(_row("all", length, sum(r["n"] for r in same), mean,
                             {m: [s["results"][m] for s in every] for m in methods},
                             references or {}))
    return rows


def _row(task: str, length: int, n: int, scores: dict[str, tuple[int, float]],
         results: dict[str, list[dict]], references: dict[str, str]) -> dict:
    out = {}
    for m, (c, acc) in scores.items():
        against = references.get(m, REFERENCE)
        kept = None if m == against else retention(acc, scores.get(against, (0, 0.0))[1])
        out[m] = {"correct": c, "accuracy": round(acc, 4),
                  "retention": None if kept is None else round(kept, 4),
                  "sources": sources_summary(results[m])}
        flags = [r["same_tokens"] for r in results[m] if "same_tokens" in r]
        if flags:
            out[m]["same_tokens"] = round(sum(flags) / len(flags), 4)
    return {"task": task, "length": length, "n": n, "methods": out}
