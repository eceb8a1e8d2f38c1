"""starqa's Python API (starqa.api): the streaming machinery with stand-in producers, the
cache functions on fake contexts, and docs/api.md's examples run end to end on the tiny
random model (answers are gibberish; the plumbing is real)."""

import re
import threading
import time
from pathlib import Path

import pytest

from starqa import api
from starqa.api.streams import Channel, StopScan, Stream
from starqa.api.groups import Turns

DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def fake_answer(text: str, finish: str = "stop") -> api.Answer:
    context = api.Context(name="docs", key="k" * 16, ref="docs", tokens=100, window=512,
                          model="tiny", method="star", sources=("/data",), files=("a.md",),
                          skipped=(), created=0.0, folder=Path("/tmp"))
    return api.Answer(text=text, context=context, question_tokens=5,
                      token_ids=tuple(range(len(text.split()))), sources=(), finish=finish, warm=True,
                      workers=1, timings=api.Timings(1.0, 0.1, 0.1, 0.9))


def producer(pieces, until_stopped: bool = False):
    """A stand-in for an answer: `pieces` into the channel, then (until_stopped) more until
    the reader asks it to stop, as a warm group does; records what it saw."""
    seen = {"sent": 0, "stopped": False}

    def produce(channel: Channel) -> api.Answer:
        for piece in pieces:
            channel.piece(piece)
            seen["sent"] += 1
        while until_stopped and not channel.stop_wanted:
            channel.piece(" more")
            seen["sent"] += 1
            time.sleep(0.01)
        seen["stopped"] = channel.stop_wanted
        return fake_answer("".join(pieces), "cancelled" if channel.stop_wanted else "stop")

    return produce, seen


def answer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "starqa-answer"]


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- streams

@pytest.mark.parametrize("pieces,stops,out,hit", [
    (["hello wor", "ld"], (), "hello world", False),
    (["the answer is 4", "2. Done"], ("Done",), "the answer is 42. ", True),
    (["ab", "c<", "/s", "> tail"], ("</s>",), "abc", True),  # split over three pieces
    (["a <", "b"], ("</s>",), "a <b", False),  # held back, then let go
    (["x", "STOP"], ("STO", "STOP"), "x", True),  # the first to appear wins
])
def test_stop_strings_are_found_across_pieces(pieces, stops, out, hit):
    scan = StopScan(stops)
    text = "".join(scan.feed(p) for p in pieces) + ("" if scan.hit else scan.flush())
    assert (text, scan.hit) == (out, hit)


def test_a_stream_hands_out_pieces_then_the_answer():
    produce, seen = producer(["who ", "approved ", "it"])
    got = []
    stream = Stream(produce, on_answer=got.append)
    assert list(stream) == ["who ", "approved ", "it"]
    answer = stream.result()
    assert answer.text == "who approved it" and got == [answer] and stream.text == answer.text
    assert not seen["stopped"]


def test_a_stop_string_ends_the_answer_and_keeps_its_record():
    produce, seen = producer(["the budget ", "was approved", " END of"], until_stopped=True)
    stream = Stream(produce, stop=["END"])
    assert "".join(stream) == "the budget was approved "
    answer = stream.result()
    assert seen["stopped"]  # the producer was asked to end, and did
    assert answer.text == "the budget was approved" and answer.finish == "stop"
    assert answer.sources == () and answer.timings.total_s == 1.0


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_leaving_a_stream_early_stops_its_producer(how):
    produce, seen = producer(["a", "b"], until_stopped=True)
    stream = Stream(produce)
    if how == "with":
        with stream as pieces:
            assert next(pieces) == "a"
    else:
        assert next(stream) == "a"
        if how == "close":
            stream.close()
        else:
            del stream
    wait_until(lambda: seen["stopped"] and not answer_threads())
    if how != "drop":
        with pytest.raises(api.Stopped):
            stream.result()


def test_a_producers_error_is_raised_to_the_reader():
    def produce(channel):
        channel.piece("partial")
        raise api.StarqaError("The worker group closed the connection.", hint="see its log")

    stream = Stream(produce)
    assert next(stream) == "partial"
    with pytest.raises(api.StarqaError, match="closed the connection") as raised:
        next(stream)
    assert raised.value.hint == "see its log"
    assert list(stream) == []
    with pytest.raises(api.StarqaError, match="closed the connection"):
        stream.result()


def test_turns_are_first_come_first_served_and_a_waiter_can_leave():
    """Past its limit of questions at once (those a group answers together), a context's
    questions wait in the order they came; one whose reader leaves leaves the line."""
    turns, order, gone = Turns(limit=1), [], Channel()
    inside, release = threading.Event(), threading.Event()

    def asker(name: str, channel: Channel):
        try:
            with turns.turn("ctx", channel):
                order.append(name)
                if name == "a":  # holds its turn until the others wait in line
                    inside.set()
                    release.wait(10)
        except api.Stopped:
            order.append(f"{name} left")

    threads = [threading.Thread(target=asker, args=("a", Channel()))]
    threads[0].start()
    inside.wait(5)
    assert turns.answering() == 1
    for name, channel in (("b", Channel()), ("c", gone), ("d", Channel())):
        threads.append(threading.Thread(target=asker, args=(name, channel)))
        threads[-1].start()
        wait_until(lambda: turns.waiting() == len(threads) - 1)
    gone.closed.set()
    wait_until(lambda: "c left" in order)
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["a", "c left", "b", "d"]
    assert turns.waiting() == 0 and turns.answering() == 0
    two, held = Turns(limit=2), threading.Event()

    def holder():
        with two.turn("ctx", Channel()):
            held.wait(10)

    inside = [threading.Thread(target=holder) for _ in range(2)]
    for thread in inside:
        thread.start()
    wait_until(lambda: two.answering() == 2)  # two at once, with no wait
    assert two.waiting() == 0
    held.set()
    for thread in inside:
        thread.join(10)


def test_a_question_is_checked():
    with pytest.raises(api.StarqaError, match="empty"):
        api.Question("  ")
    with pytest.raises(api.StarqaError, match="at least 1"):
        api.Question("who?", max_new_tokens=0)


# ---------------------------------------------------------------------------- contexts

def test_contexts_are_listed_found_and_removed(contexts):
    found = api.contexts()
    assert [c.ref for c in found] == ["docs", "repo", "old"]  # most recently used first
    assert found[0].key.startswith("d0c5") and found[0].files == ("a.md", "b.py")
    assert found[0].skipped == (("logo.png", "binary"),)
    assert api.context().name == "docs"  # the one used last
    assert api.context("4e90").name == "repo"  # a key prefix
    with pytest.raises(api.ContextNotFound, match="No context named 'nope'") as raised:
        api.context("nope")
    assert "docs" in raised.value.hint
    with pytest.raises(api.ContextNotFound):
        api.remove("old", "nope")  # a typo removes nothing
    assert len(api.contexts()) == 3
    assert api.remove("old", found[0]) >= 2 * 1600  # their shards, at least
    assert [c.ref for c in api.contexts()] == ["repo"]


def test_a_name_borne_twice_refers_to_the_newest_ingest(contexts):
    from fakes import make_context

    home = contexts["docs"].parent.parent
    make_context(home, "docs", "d0c7" + "0" * 12, time.time())  # re-ingested: same settings
    make_context(home, "repo", "4e91" + "0" * 12, time.time() - 30)  # star, not dense
    refs = {c.key[:4]: c.ref for c in api.contexts()}
    assert refs["d0c7"] == "docs" and refs["d0c5"] == "d0c5" + "0" * 12
    assert api.context("docs").key.startswith("d0c7")
    assert refs["4e90"].startswith("4e90") and refs["4e91"].startswith("4e91")
    with pytest.raises(api.StarqaError, match="matches 2 contexts"):
        api.context("repo")  # two methods: the name alone chooses neither


def test_an_ambiguous_name_is_not_a_missing_one(contexts):
    from fakes import make_context

    make_context(contexts["docs"].parent.parent, "docs2", "d0c6" + "0" * 12, time.time())
    with pytest.raises(api.StarqaError, match="matches 2 contexts") as raised:
        api.context("d0c")
    assert not isinstance(raised.value, api.ContextNotFound)


def test_no_context_yet_is_not_found(home):
    with pytest.raises(api.ContextNotFound, match="No ingested context yet"):
        api.context()
    assert api.contexts() == []


# ---------------------------------------------------------------------------- the docs

def python_examples(page: str, section: str) -> list[str]:
    """The ```python blocks of one `## section` of a page, in order."""
    part = page.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", part, re.S)


@pytest.mark.slow
def test_the_documented_examples_run(home, docs, tiny_model, monkeypatch, capsys):
    """docs/api.md's Python examples, in order, on the tiny model: ingest, ask, stream,
    many questions at once, chat, contexts and warm groups, another cache root, errors and
    remove; then what they made is checked."""
    monkeypatch.setenv("STARQA_MODEL", str(tiny_model))
    monkeypatch.chdir(docs.parent)
    blocks = python_examples(DOCS_PAGE.read_text(), "Python API")
    assert len(blocks) == 8
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS_PAGE), "exec"), scope)
    out = capsys.readouterr().out
    ctx, answer, streamed = scope["ctx"], scope["answer"], scope["streamed"]
    assert ctx.ref == "handbook" and ctx.cache_hit is False and ctx.tokens > 100
    assert answer.text and answer.answer_tokens > 0 and answer.question_tokens > 0
    assert answer.sources and all(s.path in ctx.files for s in answer.sources)
    assert answer.timings.total_s > 0 and answer.finish in ("stop", "length")
    assert streamed.text and streamed.text in out  # printed piece by piece
    together = [s.result() for s in scope["streams"]]
    assert len(together) == 3 and all(a.warm and a.text in out for a in together)
    first, second = scope["first"], scope["second"]
    assert first.warm and second.warm and scope["chat"].history == ()  # cleared at the end
    assert scope["group"].workers >= 1
    assert scope["client"].contexts() == [] and "[]" in out  # another root: none there
    assert "No context named 'no-such-context'" in out and "known contexts: handbook" in out
    assert "the model was trained on" in out and "bytes freed" in out
    assert api.contexts() == []


@pytest.mark.slow
def test_a_client_keeps_to_its_own_cache_root(home, docs, tiny_model, tmp_path):
    """`Client(home=...)`: its ingest, listing, answer (a cold one in this process, its
    stream in a thread of its own) and removal all use its root; $STARQA_HOME's is untouched."""
    other = tmp_path / "other-root"
    client = api.Client(home=other)
    ctx = client.ingest(docs, model=str(tiny_model),
                        options=api.IngestSettings(dtype="fp32", block_size=60))
    assert ctx.folder.is_relative_to(other) and not ctx.cache_hit
    assert api.contexts() == [] and [c.key for c in client.contexts()] == [ctx.key]
    answer = client.ask("who approved the travel budget?", ctx,
                        max_new_tokens=3, options=api.AskSettings(keepalive=0))
    assert answer.context.key == ctx.key and answer.answer_tokens > 0
    with pytest.raises(api.ContextNotFound):
        api.context(ctx.key)  # not in $STARQA_HOME
    assert client.remove(ctx) > 0 and client.contexts() == []


@pytest.mark.slow
def test_a_stop_string_cuts_a_cold_answer(home, docs, tiny_model):
    """`stop` on a cold answer (no warm group): the answer is complete, cut where the stop
    string first appears, as a warm group's is."""
    api.ingest(docs, model=str(tiny_model), options=api.IngestSettings(dtype="fp32",
                                                                       block_size=60))
    cold = api.AskSettings(keepalive=0)
    whole = api.ask("who approved the travel budget?", max_new_tokens=8, options=cold)
    assert len(whole.text) > 4
    stop = whole.text[2:4]
    cut = api.ask("who approved the travel budget?", max_new_tokens=8, stop=[stop],
                  options=cold)
    assert not cut.warm and cut.finish == "stop"
    assert cut.text == whole.text[:whole.text.find(stop)].strip()
