"""A warm group that closes its socket while it is asked: before the first token it was
exiting (`starqa stop`, its keep-alive ending) and the question is answered elsewhere; after
it, the answer is lost and the error says so, without a traceback."""

from types import SimpleNamespace

import pytest

from starqa.core.errors import StarqaError
from starqa.launchers import ask as ask_mod
from starqa.workers import client, messages


class _Resetting:
    """A client whose group sends `tokens` tokens, then resets the connection."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def __call__(self, group):
        return self

    def ask(self, *args):
        for i in range(self.tokens):
            yield messages.Piece(f"t{i}")
        raise ConnectionResetError(104, "Connection reset by peer")

    def close(self):
        pass


def _ask_warm(monkeypatch, tokens: int):
    from starqa.phase2.answer import Question

    monkeypatch.setattr(client, "Client", _Resetting(tokens))
    context = SimpleNamespace(name="docs")
    group = SimpleNamespace(name="docs", workers=1, topk=None, weights=None)
    return client.ask_warm(group, Question("q"), context, lambda piece: None)


def test_a_group_gone_before_its_first_token_sends_the_question_elsewhere(monkeypatch):
    with pytest.raises(client.GroupLeft):
        _ask_warm(monkeypatch, tokens=0)


def test_a_group_gone_mid_answer_is_an_error_that_says_so(monkeypatch):
    with pytest.raises(StarqaError, match="ended in the middle of the answer") as caught:
        _ask_warm(monkeypatch, tokens=2)
    assert "ask again" in caught.value.hint
    assert not isinstance(caught.value, client.GroupLeft)


def test_ask_answers_cold_when_the_group_left(monkeypatch):
    """`ask` takes the cold path (here a sentinel) instead of raising the reset."""
    manifest = SimpleNamespace(name="docs", key="k" * 16, past_window=False)
    monkeypatch.setattr(ask_mod, "_checked_request", lambda opts: manifest)
    monkeypatch.setattr(client, "group_for", lambda *a: (SimpleNamespace(name="docs"), None))
    monkeypatch.setattr(ask_mod.Context, "of", lambda m: m)
    monkeypatch.setattr(client, "ask_warm", lambda *a: (_ for _ in ()).throw(
        client.GroupLeft("exiting")))

    class Cold(Exception):
        pass

    monkeypatch.setattr(ask_mod, "_query", lambda *a: (_ for _ in ()).throw(Cold()))
    with pytest.raises(Cold):
        ask_mod.ask(ask_mod.AskOptions(question="q"))
