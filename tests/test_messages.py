"""The warm group's socket protocol (`starqa.workers.messages`): every message survives its
line, and a request the group cannot take is a BadRequest that names what is wrong."""

import json
import subprocess
import sys

import pytest

from starqa.core import MAX_DRAFT_TOKENS
from starqa.runtime.protocol import ProtocolError
from starqa.workers import messages as m

REQUESTS = [m.Ask("who approved the budget?"),
            m.Ask("and then?", (("who?", "Ada"),), 32, beyond_window=True, draft_tokens=0),
            m.Cancel(), m.Ping(), m.Stop()]
EVENTS = [m.Piece("Ada ✓"),
          m.Finished(text="Ada", token_ids=(1, 2), question_tokens=9, turns_used=1,
                     sources=({"path": "a.md", "share": 0.5, "lines": [1, 3]},),
                     cancelled=False, first_token_s=0.25, decode_s=1.0, total_s=1.5,
                     rss_bytes=1 << 20),
          m.Finished(text="", token_ids=(), question_tokens=3, turns_used=0, sources=None,
                     cancelled=True, first_token_s=None, decode_s=0.0, total_s=0.1,
                     rss_bytes=1),
          m.Failed("The shard x was changed.", hint="ask again"), m.Failed("Bad request: x."),
          m.GroupStatus(context="docs", key="k", workers=2, tokens=100, method="star",
                        answered=3, rss_bytes=1 << 30, pid=42),
          m.Stopping()]


@pytest.mark.parametrize("request_", REQUESTS, ids=repr)
def test_a_request_survives_its_line(request_):
    line = m.request_line(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert m.read_request(line) == request_


@pytest.mark.parametrize("event", EVENTS, ids=repr)
def test_an_event_survives_its_line(event):
    line = m.event_line(event)
    assert line.count(b"\n") == 1 and m.read_event(line) == event


def test_the_wire_keeps_its_names():
    """Clients written against the JSON lines (the docstring's) keep working."""
    assert json.loads(m.request_line(m.Ask("q", max_new_tokens=4))) == {
        "op": "ask", "question": "q", "history": [], "max_new_tokens": 4,
        "beyond_window": False, "draft_tokens": None}
    assert json.loads(m.event_line(m.Piece("x"))) == {"event": "token", "text": "x"}
    assert m.read_request(b'{"op": "ask", "question": "q"}') == m.Ask("q")


@pytest.mark.parametrize("line, named", [
    (b"[]", "not a JSON object"), (b"null", "not a JSON object"),
    (b"not json", "not a JSON object"), (b"\xff\xfe", "not a JSON object"),
    (b'{"question": "q"}', "'op' is None: not one of ask, cancel, ping, stop"),
    (b'{"op": "dance"}', "'op' is 'dance'"),
    (b'{"op": "ask"}', "lacks its field 'question'"),
    (b'{"op": "ask", "question": 5}', "Ask.question is 5, not str"),
    (b'{"op": "ask", "question": "q", "max_new_tokens": "x"}', "Ask.max_new_tokens is 'x'"),
    (b'{"op": "ask", "question": "q", "max_new_tokens": true}', "Ask.max_new_tokens is True"),
    (b'{"op": "ask", "question": "q", "history": [[1]]}', "Ask.history[0] has 1 items"),
    (b'{"op": "ask", "question": "q", "history": [["a", 2]]}', "Ask.history[0][1] is 2"),
    (b'{"op": "ask", "question": "q", "colour": "red"}', "no field 'colour'"),
    (b'{"op": "ask", "question": "  "}', "the question is empty"),
    (b'{"op": "ask", "question": "q", "max_new_tokens": 0}', "a positive integer"),
    (b'{"op": "ask", "question": "q", "draft_tokens": -1}',
     f"from 0 to {MAX_DRAFT_TOKENS}"),
    (f'{{"op": "ask", "question": "q", "draft_tokens": {MAX_DRAFT_TOKENS + 1}}}'.encode(),
     f"from 0 to {MAX_DRAFT_TOKENS}"),
    (b'{"op": "ping", "now": 1}', "Ping has no field 'now'"),
])
def test_a_bad_request_names_what_is_wrong(line, named):
    with pytest.raises(m.BadRequest) as caught:
        m.read_request(line)
    assert named in str(caught.value)


def test_a_line_the_client_cannot_read_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not JSON"):
        m.read_event(b"<html>")
    with pytest.raises(ProtocolError, match="Finished lacks its field 'token_ids'"):
        m.read_event(b'{"event": "done", "text": "x"}')


def test_the_protocol_needs_no_torch():
    """`starqa ask` reads these messages before (or without) importing torch."""
    code = ("import sys, starqa.workers.messages, starqa.workers.client; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
