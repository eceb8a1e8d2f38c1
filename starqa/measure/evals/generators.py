"""Long-context tasks in the manner of RULER (Hsieh et al., 2024), generated offline from a
seed: needle in a haystack (single, multi-key, multi-value, multi-query; haystacks of
noise sentences, of prose, or of other needles; values as numbers, words or UUIDs),
variable tracking, common-word and frequent-word extraction, question answering over the
repository's `samples/`, and questions about a real Python package's code (repo_qa, its
questions derived by repo_qa.py). Where the answer's place is known (a needle in one of
several look-alike files, qa's gold file, repo_qa's answer) the sample records it in
`meta["source"]` (file and 1-based line), which `starqa eval` scores the named sources
against.

`generate(task, length, seed, tokenizer, index)` is pure: everything random comes from a
`random.Random` seeded from (seed, task, length, index), so keys, values and depths do not
depend on the tokenizer; the tokenizer only decides how much haystack fits. A sample is laid
out as starqa lays out real contexts (prompt.py): the haystack is the packed documents of
the context part (Phase 1), the question goes into the query part (Phase 2), and

    context tokens + query tokens + max_new_tokens  <=  length

filled to within one haystack unit (a sentence, a needle, a list item, a line).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from starqa.cache import manifest
from starqa.corpus import prompt
from starqa.corpus import TextFile, pack
from starqa.core.errors import StarqaError
from starqa.measure.evals import prose, repo_qa, words

SAMPLES_DIR = Path(__file__).resolve().parents[3] / "samples"


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the token budget it was generated for
    seed: int
    index: int
    context_text: str  # the packed documents: what `ingest` would encode (Phase 1)
    question: str  # goes into the query part (Phase 2), never into the context
    answers: list[str]
    match: str  # "all": every answer must appear in the prediction; "any": alternatives
    max_new_tokens: int
    context_ids: list[int] = field(repr=False)  # the context part, tokenised
    query_ids: list[int] = field(repr=False)
    meta: dict = field(default_factory=dict)  # depths, keys, the gold file, ...
    # The documents as a manifest lists them: what source attribution maps key mass through.
    files: list[manifest.PackedFile] = field(default_factory=list, repr=False)
    # Edit tasks (`eval --edit`): the haystack as first ingested, before one file changed
    # into the documents above, tokenised and listed the same way; None for other tasks.
    before: Sample | None = field(default=None, repr=False)

    @property
    def tokens(self) -> int:
        """The budget this sample uses: context + query + answer tokens."""
        return len(self.context_ids) + len(self.query_ids) + self.max_new_tokens


@dataclass
class _Draft:
    """A task's sample with `n` haystack units, before tokenisation."""

    files: list[TextFile]
    question: str
    answers: list[str]
    meta: dict
    # Exact occurrences (case-insensitive) of each answer in the documents; None: at least
    # one answer occurs (alternatives, qa).
    counts: dict[str, int] | None
    before: list[TextFile] | None = None  # edit tasks: the documents before the edit
    # The question the fit budgets for, when not `question`: a one-context task's longest,
    # so every sample of a seed and length gets the same context whatever it asks.
    fit_question: str | None = None


# (rng, length) -> draft(n units); a one-context task's: (length, context rng, index)
Builder = Callable[..., Callable[[int], "_Draft | None"]]


@dataclass(frozen=True)
class Task:
    name: str
    build: Builder  # draft(n) returns None when n is impossible
    max_new_tokens: int
    match: str = "all"
    about: str = ""
    # Every sample of a seed and length asks about one context, as a user asks many
    # questions of one ingested repository: `build` takes (length, the context's rng, the
    # sample's index) and the runner encodes that context once a method.
    one_context: bool = False


# ---------------------------------------------------------------------------------------
# haystacks: sequences of units (separator before it, text)

Unit = tuple[str, str]


class _Stream:
    """An endless seeded sequence drawn on demand: take(n) is always a prefix of take(n + 1)."""

    def __init__(self, items: Iterator):
        self._source = items
        self._items: list = []

    def take(self, n: int) -> list:
        while len(self._items) < n:
            self._items.append(next(self._source))
        return self._items[:n]


def _cycled(rng: random.Random, items) -> Iterator:
    """`items` over and over, each round in a fresh seeded order."""
    while True:
        order = list(items)
        rng.shuffle(order)
        yield from order


def _unique(draw: Callable[[], str], taken: set[str], limit: int | None = None) -> Iterator[str]:
    """Draws never seen before (in `taken`, which it extends)."""
    while limit is None or len(taken) < limit:
        value = draw()
        if value not in taken:
            taken.add(value)
            yield value
    raise StarqaError("The context is too long for this task's supply of distinct keys.",
                      hint="choose a shorter length for this task")


def _join(units: list[Unit]) -> str:
    text = "".join(sep + body for sep, body in units)
    return text[len(units[0][0]):] if units else ""


def _insert(units: list[Unit], needles: list[tuple[float, Unit]]) -> list[Unit]:
    """`units` with each needle at its depth (0: before the first unit, 1: after the last);
    needles at the same place keep their order."""
    out = list(units)
    for depth, needle in reversed(sorted(needles, key=lambda x: x[0])):
        out.insert(round(depth * len(units)), needle)
    return out


def _sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph.strip())


def _prose_units(rng: random.Random) -> Iterator[Unit]:
    for paragraph in _cycled(rng, prose.PARAGRAPHS):
        for i, sentence in enumerate(_sentences(paragraph)):
            yield ("\n\n" if i == 0 else " ", sentence)


def _noise_units() -> Iterator[Unit]:
    while True:
        yield ("\n", prose.NOISE)


def _pieces(text: str) -> list[str]:
    """`text` cut after every newline and every sentence's full stop; joined, it is `text`."""
    return [p for line in re.split(r"(?<=\n)", text) for p in re.split(r"(?<=\. )", line) if p]


def _document(path: str, units: list[Unit]) -> list[TextFile]:
    text = _join(units)
    return [TextFile(path, text, len(text.encode()))]


# ---------------------------------------------------------------------------------------
# needles

_KINDS = {"numbers": "number", "words": "word", "uuids": "uuid"}


def _drawer(kind: str, rng: random.Random) -> Callable[[], str]:
    if kind == "numbers":
        return lambda: str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return lambda: str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return lambda: rng.choice(words.VALUE_WORDS)
    if kind == "keys":  # adjective-noun pairs
        return lambda: f"{rng.choice(words.ADJECTIVES)}-{rng.choice(words.NOUNS)}"
    raise ValueError(kind)


def _limit(kind: str) -> int | None:
    return {"words": len(words.VALUE_WORDS),
            "keys": len(words.ADJECTIVES) * len(words.NOUNS)}.get(kind)


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _niah(haystack: str, keys: str = "keys", values: str = "numbers", needles: int = 1,
          per_key: int = 1, queries: int = 1) -> Builder:
    """Needle in a haystack: `needles` keys, each with `per_key` values, of which the first
    `queries` keys are asked for; haystack "noise", "prose" or "needles" (other keys')."""

    def build(rng: random.Random, length: int):
        key_rng, value_rng, hay_rng = (random.Random(rng.getrandbits(64)) for _ in range(3))
        key_stream = _unique(_drawer(keys, key_rng), set(), _limit(keys))
        value_stream = _unique(_drawer(values, value_rng), set(), _limit(values))
        placed = [(next(key_stream), [next(value_stream) for _ in range(per_key)])
                  for _ in range(needles)]
        depths = [rng.random() for _ in range(needles * per_key)]
        if haystack == "prose":
            hay = _Stream(_prose_units(hay_rng))
        elif haystack == "noise":
            hay = _Stream(_noise_units())
        else:  # other keys' needles, drawn from the same streams: every key is distinct
            hay = _Stream(("\n", _needle(values, next(key_stream), next(value_stream)))
                          for _ in itertools.count())
        sep = " " if haystack == "prose" else "\n"
        pairs = [(k, v) for k, vs in placed for v in vs]
        needle_units = [(d, (sep, _needle(values, k, v))) for (k, v), d in zip(pairs, depths)]
        asked = [k for k, _ in placed[:queries]]
        answers = [v for k, vs in placed[:queries] for v in vs]
        kind = _KINDS[values]
        if len(asked) > 1:
            question = (f"What are all the special magic {values} for {', '.join(asked[:-1])} "
                        f"and {asked[-1]} mentioned in the documents? Answer with the {values} "
                        "only.")
        elif per_key > 1:
            question = (f"What are all the special magic {values} for {asked[0]} mentioned in "
                        f"the documents? Answer with the {values} only.")
        else:
            question = (f"What is the special magic {kind} for {asked[0]} mentioned in the "
                        f"documents? Answer with the {kind} only.")
        meta = {"haystack": haystack, "needles": [
            {"key": k, "value": v, "depth": round(d, 4)} for (k, v), d in zip(pairs, depths)]}

        def draft(n: int) -> _Draft:
            units = _insert(hay.take(n), needle_units)
            return _Draft(_document("document.txt", units), question, answers, meta,
                          {a: 1 for a in answers})

        return draft

    return build


def _line_of(text: str, needle: str) -> int:
    """1-based line of `text` where `needle` (which occurs in it) starts."""
    return text[:text.index(needle)].count("\n") + 1


def _niah_files(haystack: str) -> Builder:
    """One needle in one of several files of the same kind: look-alike files, the hard case
    for sources. haystack "prose": notes, a sentence a line; "needles": records, other keys'
    needles a line. 3 to 10 files (one per 512 tokens of budget), the needle in a seeded
    file at a seeded depth; meta["source"] holds its file and line."""

    def build(rng: random.Random, length: int):
        key_rng, value_rng, hay_rng = (random.Random(rng.getrandbits(64)) for _ in range(3))
        key_stream = _unique(_drawer("keys", key_rng), set(), _limit("keys"))
        value_stream = _unique(_drawer("numbers", value_rng), set())
        key, value = next(key_stream), next(value_stream)
        n_files = max(3, min(10, length // 512))
        gold, depth = rng.randrange(n_files), rng.random()
        if haystack == "prose":
            hay = _Stream(("\n", sentence) for _, sentence in _prose_units(hay_rng))
            name = "notes/notes_{:02d}.md"
        else:
            hay = _Stream(("\n", _needle("numbers", next(key_stream), next(value_stream)))
                          for _ in itertools.count())
            name = "records/records_{:02d}.txt"
        needle = _needle("numbers", key, value)
        question = (f"What is the special magic number for {key} mentioned in the documents? "
                    "Answer with the number only.")

        def draft(n: int) -> _Draft:
            units = hay.take(n)
            files, source = [], {}
            for i in range(n_files):  # the units split evenly, in order, over the files
                part = units[i * n // n_files:(i + 1) * n // n_files]
                if i == gold:
                    part = _insert(part, [(depth, ("\n", needle))])
                text = _join(part)
                files.append(TextFile(name.format(i + 1), text, len(text.encode())))
                if i == gold:
                    source = {"file": files[-1].path, "line": _line_of(text, needle)}
            meta = {"haystack": haystack, "files": n_files,
                    "needles": [{"key": key, "value": value, "depth": round(depth, 4)}],
                    "source": source}
            return _Draft(files, question, [value], meta, {value: 1})

        return draft

    return build


def _edited_files(needle_in: str, inserted: int = 4) -> Builder:
    """A haystack of look-alike notes files (as niah_files_1) changed after it was first
    ingested: lines were inserted into the second-to-last file, so the last file moves by
    their tokens. needle_in "changed": the needle is in the edited file and the edit also
    gave it a new value (the old one was ingested first: an answer from stale KV says the
    old value); "unchanged": the needle is in the last file, which only moved. The sample
    is the new haystack; `_Draft.before` the old one."""

    def build(rng: random.Random, length: int):
        key_rng, value_rng, hay_rng, edit_rng = (random.Random(rng.getrandbits(64))
                                                 for _ in range(4))
        key = next(_unique(_drawer("keys", key_rng), set(), _limit("keys")))
        values = _unique(_drawer("numbers", value_rng), set())
        value, old_value = next(values), next(values)
        n_files = max(3, min(10, length // 512))
        edited = n_files - 2  # never block 0 (star's anchor) with the default block
        gold = edited if needle_in == "changed" else n_files - 1
        depth, edit_depth = rng.random(), rng.random()
        hay = _Stream(("\n", sentence) for _, sentence in _prose_units(hay_rng))
        lines = [("\n", s) for _, s in itertools.islice(_prose_units(edit_rng), inserted)]
        question = (f"What is the special magic number for {key} mentioned in the documents? "
                    "Answer with the number only.")

        def draft(n: int) -> _Draft:
            units = hay.take(n)
            files, before, source = [], [], {}
            for i in range(n_files):
                part = units[i * n // n_files:(i + 1) * n // n_files]
                old = new = part
                if i == gold:
                    new = _insert(part, [(depth, ("\n", _needle("numbers", key, value)))])
                    old = new if i != edited else _insert(
                        part, [(depth, ("\n", _needle("numbers", key, old_value)))])
                if i == edited:
                    new = _insert(new, [(edit_depth, line) for line in lines])
                path = f"notes/notes_{i + 1:02d}.md"
                for out, units_ in ((files, new), (before, old)):
                    text = _join(units_)
                    out.append(TextFile(path, text, len(text.encode())))
                if i == gold:
                    source = {"file": path, "line": _line_of(files[-1].text, _needle(
                        "numbers", key, value))}
            meta = {"haystack": "prose", "files": n_files,
                    "needles": [{"key": key, "value": value, "depth": round(depth, 4)}],
                    "edit": {"file": f"notes/notes_{edited + 1:02d}.md", "lines": inserted,
                             "depth": round(edit_depth, 4), "needle": needle_in,
                             **({"old_value": old_value} if gold == edited else {})},
                    "source": source}
            return _Draft(files, question, [value], meta, {value: 1}, before)

        return draft

    return build


# ---------------------------------------------------------------------------------------
# variable tracking, common words, frequent words


def _variable_tracking(chains: int = 2, hops: int = 4) -> Builder:
    """Chains of assignments (VAR A = 12345, VAR B = VAR A, ...) hidden in noise; which
    variables hold the first chain's value?"""

    def build(rng: random.Random, length: int):
        values = rng.sample(range(10_000, 100_000), chains)
        question = (f"Which variables are assigned the value {values[0]}, directly or through "
                    "other variables? Answer with the variable names only.")
        avoid = (prose.NOISE + question).lower()  # a name in either would count or score
        names: set[str] = set()
        while len(names) < chains * (hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name.lower() not in avoid:
                names.add(name)
        ordered = sorted(names)
        rng.shuffle(ordered)
        needle_units, meta = [], []
        for c in range(chains):
            chain = ordered[c * (hops + 1):(c + 1) * (hops + 1)]
            lines = [f"VAR {chain[0]} = {values[c]}"] + [
                f"VAR {b} = VAR {a}" for a, b in zip(chain, chain[1:])]
            depths = sorted(rng.random() for _ in lines)
            needle_units += [(d, ("\n", line)) for d, line in zip(depths, lines)]
            meta.append({"value": values[c], "variables": chain, "depths":
                         [round(d, 4) for d in depths]})
        answers = ordered[:hops + 1]
        counts = {a: 2 for a in answers[:-1]} | {answers[-1]: 1}  # assigned, then read
        hay = _Stream(_noise_units())

        def draft(n: int) -> _Draft:
            units = _insert(hay.take(n), needle_units)
            return _Draft(_document("document.txt", units), question, answers,
                          {"haystack": "noise", "chains": meta}, counts)

        return draft

    return build


@lru_cache(maxsize=1)
def _list_words() -> tuple[str, ...]:
    """Every listed word that no other contains, so counting one never counts another."""
    pool = sorted({*words.ADJECTIVES, *words.NOUNS, *words.VALUE_WORDS})
    return tuple(w for w in pool if not any(w != o and w in o for o in pool))


def _common_words(n_common: int = 10) -> Builder:
    """A numbered list of words: `n_common` of them appear `often` times each, every other
    word far fewer; which are the most common?"""

    def build(rng: random.Random, length: int):
        pool = _list_words()
        common = rng.sample(pool, n_common)
        rest = [w for w in pool if w not in common]
        often = min(30, max(4, length // 256))  # RULER's 30 where the length allows
        rare = _Stream(_cycled(random.Random(rng.getrandbits(64)), rest))
        shuffle_seed = rng.getrandbits(64)
        question = (f"What are the {n_common} most common words in the list? Answer with the "
                    "words only.")

        def draft(n: int) -> _Draft | None:
            if math.ceil(n / len(rest)) >= often:  # a rare word would tie with the common
                return None
            items = common * often + rare.take(n)
            random.Random(shuffle_seed).shuffle(items)
            text = "\n".join(f"{i}. {w}" for i, w in enumerate(items, 1))
            return _Draft([TextFile("words.txt", text, len(text))], question, list(common),
                          {"often": often, "rare_max": math.ceil(n / len(rest))},
                          {w: often for w in common})

        return draft

    return build


def _frequent_words(vocab: int = 100, alpha: float = 2.0, top: int = 3) -> Builder:
    """Coded text: pseudo-words drawn with Zipf frequencies (p_i ~ 1 / i^alpha); which are
    the `top` most frequent?"""

    def build(rng: random.Random, length: int):
        question = (f"What are the {top} most frequent words in the coded text? Answer with "
                    f"the {top} words only.")
        # Pseudo-words; none inside the question, so echoing it never scores.
        taken = {question[i:i + 5].lower() for i in range(len(question))}
        coded = _unique(lambda: "".join(rng.choices(string.ascii_lowercase, k=5)), taken)
        vocabulary = [next(coded) for _ in range(vocab)]
        weights = [1 / (i + 1) ** alpha for i in range(vocab)]
        total = sum(weights)
        shuffle_seed = rng.getrandbits(64)

        def draft(n: int) -> _Draft:
            counts = [math.floor(n * w / total) for w in weights]
            for i in reversed(range(top)):  # short texts: keep the top words apart anyway
                counts[i] = max(counts[i], counts[i + 1] + 1)
            items = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
            random.Random(shuffle_seed).shuffle(items)
            lines = [" ".join(items[i:i + 12]) for i in range(0, len(items), 12)]
            text = "\n".join(lines)
            return _Draft([TextFile("coded_text.txt", text, len(text))], question,
                          vocabulary[:top], {"counts": counts[:top + 1]},
                          dict(zip(vocabulary[:top], counts[:top])))

        return draft

    return build


# ---------------------------------------------------------------------------------------
# question answering over samples/


@lru_cache(maxsize=4)
def _samples(folder: Path) -> tuple[tuple[dict, ...], tuple[TextFile, ...]]:
    """The questions with their answers, and every document under `folder` (but the
    questions file itself), sorted by path."""
    questions_file = folder / "questions.jsonl"
    if not questions_file.is_file():
        raise StarqaError(f"The qa task needs {questions_file}, which is missing.",
                          hint="run from a starqa source checkout, or leave qa out of --tasks")
    questions = tuple(json.loads(line) for line in questions_file.read_text().splitlines()
                      if line.strip())
    docs = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and path != questions_file and not any(
                part.startswith(".") for part in path.relative_to(folder).parts):
            text = path.read_text()
            docs.append(TextFile(rel, text, len(text.encode())))
    return questions, tuple(docs)


def _qa(rng: random.Random, length: int):
    """A question from samples/questions.jsonl over its file, the other sample files in a
    seeded order and, beyond them, prose essays; the file's depth varies by seed."""
    questions, docs = _samples(SAMPLES_DIR)
    asked = rng.choice(questions)
    gold = next((d for d in docs if d.path == asked["file"]), None)
    if gold is None:
        raise StarqaError(f"samples/questions.jsonl names {asked['file']}, which is missing.")
    others = [d for d in docs if d.path != gold.path]
    rng.shuffle(others)
    depth = rng.random()
    essays_rng = random.Random(rng.getrandbits(64))
    # The answer's place: the gold file's first line holding one of the answers.
    lines = gold.text.lower().splitlines()
    line = next((i for i, text in enumerate(lines, 1)
                 if any(a.lower() in text for a in asked["answers"])), None)
    source = {"file": gold.path, "line": line}

    def distractors() -> Iterator[tuple[str, str]]:  # (path, piece)
        for d in others:
            for piece in _pieces(d.text.rstrip() + "\n"):
                yield (d.path, piece)
        for i, paragraph in enumerate(_cycled(essays_rng, prose.PARAGRAPHS)):
            for piece in _pieces(paragraph + "\n"):
                yield (f"notes/essay_{i + 1:03d}.md", piece)

    stream = _Stream(distractors())

    def draft(n: int) -> _Draft:
        files: list[TextFile] = []
        texts: dict[str, list[str]] = {}
        for path, piece in stream.take(n):
            texts.setdefault(path, []).append(piece)
        files = [TextFile(p, "".join(t).rstrip(), len("".join(t).encode()))
                 for p, t in texts.items()]
        files.insert(round(depth * len(files)), gold)
        return _Draft(files, asked["question"], list(asked["answers"]),
                      {"file": gold.path, "depth": round(depth, 4),
                       "files": [f.path for f in files], "source": source}, None)

    return draft


# ---------------------------------------------------------------------------------------
# questions about a real package's code


def _repo_qa(length: int, context_rng: random.Random, index: int):
    """A question about an installed package's code (repo_qa.py: $STARQA_EVAL_PACKAGE,
    default typer) over one context a seed and length: a file holding questions, whole, and
    the package's other files in a seeded order, a line a unit, so the last one taken is cut
    at a line; all in path order and packed as `ingest` packs the package. Sample `index`
    asks the index-th of the questions about the files the context holds whole, in a seeded
    order that takes each kind in turn (repo_qa.in_turn). Past the whole package: no draft
    (the sample holds it all)."""
    package = repo_qa.load(repo_qa.package_spec())
    gold = package.file(repo_qa.choose(package, context_rng, length).file)
    others = [f for f in package.files if f.path != gold.path]
    context_rng.shuffle(others)
    lines = [(f.path, line) for f in others for line in f.text.splitlines(keepends=True)]
    order = context_rng.random()  # of the questions, the same for every sample
    longest = max((q.text for q in package.questions), key=len)

    def draft(n: int) -> _Draft | None:
        if n > len(lines):
            return None
        texts: dict[str, list[str]] = {}
        for path, line in lines[:n]:
            texts.setdefault(path, []).append(line)
        taken = [TextFile(p, "".join(t), len("".join(t).encode())) for p, t in texts.items()]
        files = sorted([gold, *(f for f in taken if f.text.strip())], key=lambda f: f.path)
        last = lines[n - 1][0] if n else None  # cut when its next line is left out
        cut = last if n < len(lines) and lines[n][0] == last and last in texts else None
        held = repo_qa.in_turn(package, random.Random(order),
                               {f.path for f in files if f.path != cut})
        asked = held[index % len(held)]
        elsewhere = sum(repo_qa.mentions(asked.answer, f.text) for f in files
                        if f.path != asked.file)
        meta = {"package": package.about, "kind": asked.kind, "files": len(files),
                "cut": cut, "answer_elsewhere": elsewhere,
                "source": {"file": asked.file, "line": asked.line}}
        return _Draft(files, asked.text, [asked.answer], meta, None, fit_question=longest)

    return draft


# ---------------------------------------------------------------------------------------
# the tasks

# Answer budgets leave room for the preamble models put before the answer ("The special
# magic number for ... mentioned in the documents is ...": ~25 tokens for SmolLM2).
TASKS: dict[str, Task] = {t.name: t for t in (
    Task("niah_single_1", _niah("noise"), 48, about="one needle, noise haystack, number"),
    Task("niah_single_2", _niah("prose"), 48, about="one needle, prose haystack, number"),
    Task("niah_single_3", _niah("prose", values="uuids"), 64,
         about="one needle, prose haystack, UUID"),
    Task("niah_multikey_1", _niah("prose", needles=4), 48,
         about="one of 4 needles asked, prose haystack, numbers"),
    Task("niah_multikey_2", _niah("needles"), 48, about="a haystack of needles, numbers"),
    Task("niah_multikey_3", _niah("needles", keys="uuids", values="uuids"), 80,
         about="a haystack of needles, UUID keys and values"),
    Task("niah_multivalue", _niah("prose", values="words", per_key=4), 64,
         about="4 values for one key, prose haystack, words"),
    Task("niah_multiquery", _niah("prose", needles=4, queries=4), 96,
         about="4 keys asked, prose haystack, numbers"),
    Task("niah_files_1", _niah_files("prose"), 48,
         about="one needle in one of 3-10 look-alike notes files, number"),
    Task("niah_files_2", _niah_files("needles"), 48,
         about="one needle in one of 3-10 files of other keys' needles, number"),
    Task("edit_changed", _edited_files("changed"), 48,
         about="eval --edit: the needle in the file that changed after ingest, new value"),
    Task("edit_unchanged", _edited_files("unchanged"), 48,
         about="eval --edit: the needle in an unchanged file that moved after the edit"),
    Task("vt", _variable_tracking(), 64, about="variable tracking: 2 chains of 4 hops"),
    Task("cwe", _common_words(), 96, about="the 10 most common words of a list"),
    Task("fwe", _frequent_words(), 48, about="the 3 most frequent words of a coded text"),
    Task("qa", _qa, 48, match="any", about="samples/questions.jsonl over samples/"),
    Task("repo_qa", _repo_qa, 64, one_context=True,
         about="a question derived from a real package's code (a constant's value, a "
               "method's class, a default, a raised exception) over the package's files "
               f"(${repo_qa.PACKAGE_VARIABLE}, default {repo_qa.DEFAULT_PACKAGE})"),
)}
EDIT = tuple(n for n in TASKS if n.startswith("edit_"))  # `eval --edit`'s own tasks
GROUPS = {"niah": tuple(n for n in TASKS if n.startswith("niah")),
          "all": tuple(n for n in TASKS if n not in EDIT), "edit": EDIT}


def resolve_tasks(text: str | None, edit: bool = False) -> list[str]:
    """Task names from a comma-separated list of names and groups (niah, all, edit); None:
    all (with `edit`: the edit tasks, the only ones `eval --edit` runs, and only there)."""
    if text is None or not text.strip():
        return list(EDIT if edit else GROUPS["all"])
    chosen: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part in TASKS:
            chosen.append(part)
        elif part in GROUPS:
            chosen += GROUPS[part]
        else:
            raise StarqaError(f"Unknown task {part!r}.",
                              hint=f"choose from: {', '.join([*TASKS, *GROUPS])}")
    chosen = list(dict.fromkeys(chosen))
    if edit and (other := [t for t in chosen if t not in EDIT]):
        raise StarqaError(f"--edit runs only the edit tasks, not {', '.join(other)}.",
                          hint=f"pass --tasks {','.join(EDIT)}, or drop --edit")
    if not edit and (needs := [t for t in chosen if t in EDIT]):
        raise StarqaError(f"{', '.join(needs)} only run with --edit (an ingest, an edit, a "
                          "re-ingest).", hint=f"add --edit, e.g. starqa eval --edit --tasks "
                                              f"{','.join(needs)}")
    return chosen


def sample_seed(seed: int, task: str, length: int, index: int) -> int:
    """The seed of one sample, stable across Python runs and platforms."""
    digest = hashlib.sha256(f"starqa-eval\0{seed}\0{task}\0{length}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def generate(task: str, length: int, seed: int, tokenizer, index: int = 0) -> Sample:
    """Sample `index` of `task` for a budget of `length` tokens (context + query + answer)."""
    spec = TASKS[task]
    if spec.one_context:
        draft = spec.build(length, random.Random(sample_seed(seed, task, length, -1)), index)
    else:
        draft = spec.build(random.Random(sample_seed(seed, task, length, index)), length)
    n, chosen, context_ids, query_ids = _fit(draft, length, tokenizer, spec)
    _check_answers(spec, chosen)
    meta = {**chosen.meta, "units": n}
    before = None
    if chosen.before is not None:
        text, ids, files = _laid_out(chosen.before, tokenizer)
        before = Sample(task, length, seed, index, text, chosen.question, chosen.answers,
                        spec.match, spec.max_new_tokens, ids, query_ids, meta, files)
    context_text, _, files = _laid_out(chosen.files, tokenizer)
    return Sample(task, length, seed, index, context_text, chosen.question, chosen.answers,
                  spec.match, spec.max_new_tokens, context_ids, query_ids, meta, files, before)


def _laid_out(documents: list[TextFile], tokenizer
              ) -> tuple[str, list[int], list[manifest.PackedFile]]:
    """Documents packed and tokenised as `ingest` lays them out, with their manifest list."""
    context_text, spans = pack(documents)
    laid = prompt.tokenize_context(tokenizer, context_text, spans)
    files = [manifest.PackedFile(path=sp.path, token_start=a, token_end=b, lines=sp.lines,
                                 bytes=f.size, line_tokens=tuple(lines))
             for sp, (a, b), lines, f in zip(spans, laid.file_tokens, laid.line_tokens,
                                             documents)]
    return context_text, laid.ids, files


def _fit(draft, length: int, tokenizer, spec: Task):
    """The most haystack units whose sample fits `length` tokens: a guess from the cost of
    a few units, then bracketing and bisection on the real token count."""
    measured: dict[int, tuple[float, _Draft | None, list[int] | None]] = {}
    query_ids: dict[str, list[int]] = {}

    def asked(question: str) -> list[int]:
        if question not in query_ids:
            query_ids[question] = prompt.tokenize_query(tokenizer, question)
        return query_ids[question]

    def cost(n: int) -> float:
        if n not in measured:
            d = draft(n)
            if d is None:
                measured[n] = (math.inf, None, None)
            else:
                ids = prompt.tokenize_context(tokenizer, pack(d.files)[0], []).ids
                total = len(ids) + len(asked(d.fit_question or d.question)) + \
                    spec.max_new_tokens
                measured[n] = (total, d, ids)
        return measured[n][0]

    base = cost(0)
    if base > length:
        raise StarqaError(f"{length:,} tokens is too short for {spec.name}: its prompt and "
                          f"answer alone take {base:,.0f} tokens.", hint="choose longer lengths")
    probe = 8
    per_unit = max((cost(probe) - base) / probe, 0.25) if cost(probe) < math.inf else 1.0
    guess = max(int((length - base) / per_unit), 0)
    lo, hi = 0, None
    if cost(guess) <= length:
        lo, step = guess, max(1, guess // 32)
        while cost(lo + step) <= length:
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = guess, max(1, guess // 32)
        while hi - step > 0 and cost(hi - step) > length:
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= length:
            lo = mid
        else:
            hi = mid
    _, chosen, context_ids = measured[lo]
    return lo, chosen, context_ids, asked(chosen.question)


def _check_answers(spec: Task, d: _Draft) -> None:
    """Every answer occurs in the documents as often as the task meant (else: a bug here)."""
    text = "\n".join(f.text for f in d.files).lower()
    if d.counts is None:
        ok = any(a.lower() in text for a in d.answers)
    else:
        ok = all(text.count(a.lower()) == c for a, c in d.counts.items())
    if not ok or any(a.lower() in d.question.lower() for a in d.answers):
        raise RuntimeError(f"{spec.name}: the generated sample does not hold its answers "
                           f"{d.answers} as intended")
