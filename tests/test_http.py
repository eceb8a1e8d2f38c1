"""The OpenAI-compatible HTTP server (starqa.servers.http), on loopback only: requests parsed
and refused without a model (raw HTTP, fake contexts), then the official `openai` client
against contexts of the tiny random model: streaming with usage, stop strings, eight
concurrent clients, an over-long prompt, and a client that disconnects mid-answer."""

import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from starqa import api
from starqa.api import doors
from starqa.servers import http as door
from starqa.servers import openai_shapes as shapes
from tiny import make_tiny_model

QUESTION = "who approved the travel budget"


def wait_until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextlib.contextmanager
def serving(service: doors.Service, api_key: str | None = None, origins: tuple[str, ...] = ()):
    """The server on 127.0.0.1 and a free port, in a thread, until the block ends."""
    server = door.HttpServer(door.HttpSettings("127.0.0.1", 0, api_key, origins), service)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 10)
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)


def request(server, method: str, path: str, body=None, headers=None):
    """(status, body (JSON's, parsed), headers) of one raw HTTP request."""
    host, port = server.sock.getsockname()[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    parsed = json.loads(payload) if payload and "json" in response.getheader(
        "content-type", "") else payload or None
    return response.status, parsed, dict(response.headers)


def error_of(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ------------------------------------------------------------------------ without a model

@pytest.mark.parametrize("address,host,port", [
    ("8080", "127.0.0.1", 8080), ("localhost:0", "localhost", 0),
    ("0.0.0.0:8081", "0.0.0.0", 8081), ("[::1]:9000", "::1", 9000),
])
def test_addresses_are_parsed(address, host, port):
    settings = door.HttpSettings.parse(address)
    assert (settings.host, settings.port, settings.api_key) == (host, port, None)


@pytest.mark.parametrize("address", ["", "host:", "8080:x", "1:99999"])
def test_a_bad_address_is_an_error(address):
    with pytest.raises(api.StarqaError, match="not an address"):
        door.HttpSettings.parse(address)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "::", "example.org"])
def test_listening_beyond_loopback_needs_a_key(host, monkeypatch):
    bound = []
    monkeypatch.setattr(door, "_listen", lambda *a: bound.append(a))  # never listens
    with pytest.raises(api.StarqaError, match="needs an API key") as raised:
        door.serve(f"[{host}]:0" if ":" in host else f"{host}:0")
    assert "--api-key" in raised.value.hint and "STARQA_API_KEY" in raised.value.hint
    assert bound == []
    door.HttpSettings(host, 0, "secret").check()  # with a key it may


def test_loopback_needs_no_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        door.HttpSettings(host, 0).check()


def test_messages_become_a_question_and_its_history():
    call = shapes.parse_chat({"model": "docs", "stream": True, "max_tokens": 9, "stop": "END",
                            "stream_options": {"include_usage": True}, "temperature": 0.3,
                            "messages": [
                                {"role": "system", "content": "be brief"},
                                {"role": "assistant", "content": "Hello! Ask me."},
                                {"role": "user", "content": "first"},
                                {"role": "assistant", "content": "one"},
                                {"role": "user", "content": [{"type": "text", "text": "sec"},
                                                             {"type": "text", "text": "ond"}]},
                                {"role": "user", "content": "more"}]})
    assert call.stream and call.include_usage and call.model == "docs"
    q = call.question
    assert (q.text, q.history, q.max_new_tokens, q.stop) == (
        "second\n\nmore", (("first", "one"),), 9, ("END",))


@pytest.mark.parametrize("body,param", [
    ([1, 2], None),
    ({"messages": [{"role": "user", "content": "q"}]}, "model"),
    ({"model": "docs"}, "messages"),
    ({"model": "docs", "messages": []}, "messages"),
    ({"model": "docs", "messages": [{"role": "assistant", "content": "a"}]}, "messages"),
    ({"model": "docs", "messages": [{"role": "tool", "content": "a"}]}, "messages"),
    ({"model": "docs", "messages": [{"role": "user", "content": "  "}]}, "messages"),
    ({"model": "docs", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages"),
    ({"model": "docs", "messages": [{"role": "user", "content": "q"}], "max_tokens": 0},
     "max_tokens"),
    ({"model": "docs", "messages": [{"role": "user", "content": "q"}], "max_tokens": "9"},
     "max_tokens"),
    ({"model": "docs", "messages": [{"role": "user", "content": "q"}], "stop": ["a"] * 5},
     "stop"),
    ({"model": "docs", "messages": [{"role": "user", "content": "q"}], "n": 2}, "n"),
    ({"model": "docs", "messages": [{"role": "user", "content": "q"}], "tools": [{}]},
     "tools"),
])
def test_malformed_requests_are_400_naming_the_field(contexts, body, param):
    with serving(doors.Service()) as server:
        status, answer, _ = request(server, "POST", "/v1/chat/completions", body)
    assert status == 400
    error = error_of(answer)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_raw_http_errors_are_openai_error_objects(contexts, monkeypatch):
    monkeypatch.setattr(door, "MAX_BODY_BYTES", 1000)
    chat = "/v1/chat/completions"
    with serving(doors.Service()) as server:
        status, body, _ = request(server, "POST", chat, b'{"model": "docs", "messages": [')
        assert status == 400 and "could not parse the JSON" in error_of(body)["message"]
        status, body, _ = request(server, "POST", chat, b"\xff\xfe")
        assert status == 400 and error_of(body)["code"] is None
        status, body, _ = request(server, "POST", chat, {
            "model": "nope", "messages": [{"role": "user", "content": QUESTION}]})
        error = error_of(body)
        assert status == 404 and error["code"] == "model_not_found"
        assert error["param"] == "model" and "known contexts: docs, old, repo" in error["message"]
        status, body, _ = request(server, "POST", chat, b"x" * 1001)
        assert status == 413 and "over 1,000 bytes" in error_of(body)["message"]
        status, body, _ = request(server, "GET", chat)
        assert status == 405 and error_of(body)["code"] == "method_not_allowed"
        status, body, _ = request(server, "GET", "/v1/embeddings")
        assert status == 404 and error_of(body)["code"] == "not_found"
        status, body, _ = request(server, "GET", "/v1/models/nope")
        assert status == 404 and error_of(body)["code"] == "model_not_found"


def test_models_are_the_contexts(contexts):
    with serving(doors.Service()) as server:
        status, body, _ = request(server, "GET", "/v1/models")
        assert status == 200 and body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["docs", "repo", "old"]
        assert body["data"][1]["starqa"]["method"] == "dense"
        assert all(m["object"] == "model" and m["owned_by"] == "starqa" for m in body["data"])
        status, body, _ = request(server, "GET", "/v1/models/4e90")  # a key prefix
        assert status == 200 and body["id"] == "repo"
        status, body, _ = request(server, "GET", "/health")
        assert status == 200 and body == {"status": "ok", "waiting": 0, "answering": 0,
                                          "answered": 0, "cancelled": 0, "failed": 0}


def test_an_api_key_is_checked(contexts):
    with serving(doors.Service(), api_key="s3cret") as server:
        status, body, headers = request(server, "GET", "/v1/models")
        assert status == 401 and error_of(body)["code"] == "invalid_api_key"
        assert headers.get("www-authenticate") == "Bearer"
        status, body, _ = request(server, "GET", "/v1/models",
                                  headers={"Authorization": "Bearer wrong"})
        assert status == 401 and error_of(body)["message"] == "Incorrect API key provided."
        status, body, _ = request(server, "POST", "/v1/chat/completions", {"model": "docs"},
                                  headers={"Authorization": "Basic s3cret"})
        assert status == 401
        status, body, _ = request(server, "GET", "/v1/models",
                                  headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and len(body["data"]) == 3
        assert request(server, "GET", "/health")[0] == 200  # no key needed


def test_origins_are_checked():
    settings = door.HttpSettings.parse("8080", None,
                                       " https://app.example.org, http://[::1]:3000,null")
    assert settings.origins == ("https://app.example.org", "http://[::1]:3000", "null")
    assert door.HttpSettings.parse("8080", None, "*").origins == ("*",)
    for bad in ("app.example.org", "https://app.example.org/", "https://a.org/chat"):
        with pytest.raises(api.StarqaError, match="not a web page's origin") as raised:
            door.HttpSettings.parse("8080", None, bad)
        assert "--allow-origin https://" in raised.value.hint


@pytest.mark.parametrize("origin, allowed", [
    ("http://localhost:3000", True), ("http://127.0.0.1", True), ("https://[::1]:8443", True),
    ("http://localhost.evil.org", False), ("http://127.0.0.1.evil.org", False),
    ("https://evil.org", False), ("null", False), ("file://", False),
])
def test_pages_of_this_machine_are_let_in_and_no_others(origin, allowed):
    assert door.origin_allowed(origin, ()) is allowed
    assert door.origin_allowed(origin, ("*",))
    assert door.origin_allowed(origin, (origin,))


def test_a_web_page_cannot_use_the_server_unasked(contexts):
    """A page on another site (its requests carry its Origin), or one that made its own
    name resolve to 127.0.0.1 (DNS rebinding: its Host), is refused before any route."""
    with serving(doors.Service()) as server:
        status, body, headers = request(server, "GET", "/v1/models",
                                        headers={"Origin": "https://evil.org"})
        error = error_of(body)
        assert status == 403 and error["code"] == "forbidden_origin"
        assert "--allow-origin https://evil.org" in error["message"]
        assert "access-control-allow-origin" not in {h.lower() for h in headers}
        chat = {"model": "docs", "messages": [{"role": "user", "content": QUESTION}]}
        status, body, _ = request(server, "POST", "/v1/chat/completions", chat,
                                  headers={"Origin": "https://evil.org",
                                           "Content-Type": "text/plain"})
        assert status == 403 and error_of(body)["code"] == "forbidden_origin"
        port = server.sock.getsockname()[1]
        status, body, _ = request(server, "GET", "/v1/models",
                                  headers={"Host": f"evil.org:{port}"})
        assert status == 403 and error_of(body)["code"] == "forbidden_host"
        assert "127.0.0.1 or localhost" in error_of(body)["message"]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            assert request(server, "GET", "/v1/models", headers={"Host": host})[0] == 200
        # a page of this machine is let in, and may read the answer (CORS)
        status, body, headers = request(server, "GET", "/v1/models",
                                        headers={"Origin": "http://localhost:3000"})
        assert status == 200 and len(body["data"]) == 3
        assert headers["access-control-allow-origin"] == "http://localhost:3000"


def test_an_origin_let_in_gets_cors_and_a_key_answers_for_the_host(contexts):
    site = "https://app.example.org"
    with serving(doors.Service(), api_key="s3cret", origins=(site,)) as server:
        status, _, headers = request(server, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": site, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 200 and headers["access-control-allow-origin"] == site
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()
        key = {"Authorization": "Bearer s3cret"}
        status, body, headers = request(server, "GET", "/v1/models",
                                        headers={"Origin": site, **key})
        assert status == 200 and headers["access-control-allow-origin"] == site
        assert request(server, "GET", "/v1/models", headers={"Origin": "https://other.org",
                                                             **key})[0] == 403
        # with a key, the name it is reached by is the network's business
        assert request(server, "GET", "/v1/models", headers={"Host": "starqa.lan", **key})[0] \
            == 200


def test_a_busy_port_is_an_error():
    with serving(doors.Service()) as server:
        port = server.sock.getsockname()[1]
        with pytest.raises(api.StarqaError, match=f"Cannot listen on 127.0.0.1:{port}"):
            door.HttpServer(door.HttpSettings("127.0.0.1", port), doors.Service())


# ------------------------------------------------------------------- the openai client

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A context of a tiny model that never stops on its own (answers run to max_tokens)
    with a long window, and the server over it: (server, context, an openai client)."""
    from openai import OpenAI

    from starqa.workers import client

    root = tmp_path_factory.mktemp("http")
    docs = root / "docs"
    docs.mkdir()
    (docs / "travel.md").write_text("the travel budget was approved by the office . " * 6)
    (docs / "code.py").write_text("retry limit default is seven \n" * 6)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STARQA_HOME", str(root / "home"))
        env.setenv("STARQA_MIN_COPIED", "0")
        model = make_tiny_model(root / "never-stops", window=8192, never_stops=True)
        context = api.ingest(docs, name="handbook", model=str(model),
                             options=api.IngestSettings(dtype="fp32"))
        service = doors.Service(doors.GroupSettings(workers=1, keepalive=120))
        try:
            with serving(service) as server:
                yield server, context, OpenAI(base_url=server.url, api_key="none",
                                              max_retries=0, timeout=300)
        finally:
            for group in client.running():
                client.stop_group(group.key)


def health(server) -> dict:
    return request(server, "GET", "/health")[1]


def long_answer_begun(server) -> socket.socket:
    """A streamed answer of up to 7,000 tokens asked over a raw connection, once its first
    event has come: the connection's socket (shut it down to leave)."""
    host, port = server.sock.getsockname()[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "handbook", "stream": True, "max_tokens": 7000,
        "messages": [{"role": "user", "content": QUESTION}]}),
        {"Content-Type": "application/json"})
    sock, response = conn.sock, conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the answer has begun
    return sock


@pytest.mark.slow
def test_the_openai_client_streams_an_answer_and_its_usage(served):
    server, context, openai = served
    assert [m.id for m in openai.models.list()] == ["handbook"]
    chunks = list(openai.chat.completions.create(
        model="handbook", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    end, last = chunks[-2], chunks[-1]
    assert end.choices[0].finish_reason == "length"  # this model never stops by itself
    record = end.model_extra["starqa"]
    assert record["context"] == "handbook" and record["warm"] is True
    assert record["tokens"]["answer"] == 12 and record["timings"]["total_s"] > 0
    assert record["sources"] and record["sources"][0]["path"] in ("travel.md", "code.py")
    assert last.choices == [] and last.usage.completion_tokens == 12
    question = record["tokens"]["question"]
    assert last.usage.prompt_tokens == context.tokens + question
    assert last.usage.prompt_tokens_details.cached_tokens == context.tokens
    assert text.strip()
    whole = openai.chat.completions.create(
        model="handbook", messages=[{"role": "user", "content": QUESTION}], max_tokens=12)
    assert whole.choices[0].message.content == text.strip()  # greedy: the same answer
    assert whole.usage.total_tokens == context.tokens + question + 12
    assert whole.model_extra["starqa"]["sources"] == record["sources"]


@pytest.mark.slow
def test_a_stop_string_ends_the_answer(served):
    server, _, openai = served
    ask = dict(model="handbook", messages=[{"role": "user", "content": QUESTION}],
               max_tokens=12)
    full = openai.chat.completions.create(**ask).choices[0].message.content
    stop = full.split()[2]  # found as text, wherever it first appears
    cut = openai.chat.completions.create(**ask, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)].strip()
    chunks = openai.chat.completions.create(**ask, stop=stop, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.strip() == cut.choices[0].message.content


@pytest.mark.slow
def test_eight_concurrent_clients_all_get_answers(served):
    server, _, openai = served
    before = health(server)["answered"]

    def ask(i: int) -> str:
        return openai.chat.completions.create(
            model="handbook", max_tokens=6,
            messages=[{"role": "user", "content": QUESTION}]).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert len(answers) == 8 and all(answers) and len(set(answers)) == 1  # queued, greedy
    assert health(server)["answered"] == before + 8 and health(server)["failed"] == 0


@pytest.mark.slow
def test_an_over_long_prompt_is_context_length_exceeded(served):
    import openai as sdk

    _, context, openai = served
    for stream in (False, True):
        with pytest.raises(sdk.BadRequestError) as raised:
            openai.chat.completions.create(
                model="handbook", max_tokens=8192, stream=stream,
                messages=[{"role": "user", "content": QUESTION}])
        assert raised.value.code == "context_length_exceeded"
        assert "8,192 the model was trained on" in raised.value.message
    with pytest.raises(sdk.NotFoundError) as raised:
        openai.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": QUESTION}])
    assert raised.value.code == "model_not_found"


@pytest.mark.slow
def test_a_client_that_disconnects_cancels_its_answer(served):
    server, _, _ = served
    before = health(server)
    sock = long_answer_begun(server)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    # the group is told, stops within a token, and reports the answer cut short
    wait_until(lambda: health(server)["cancelled"] == before["cancelled"] + 1)
    assert health(server)["answering"] == 0
    assert health(server)["answered"] == before["answered"]



@pytest.mark.slow
def test_completions_and_responses_answer_as_chat_does(served):
    """/v1/completions and /v1/responses through the openai client, whole and streamed:
    the same greedy answer as the chat route's, with the `starqa` record."""
    _, context, openai = served
    chat = openai.chat.completions.create(
        model="handbook", messages=[{"role": "user", "content": QUESTION}], max_tokens=10)
    text = chat.choices[0].message.content
    whole = openai.completions.create(model="handbook", prompt=QUESTION, max_tokens=10)
    assert whole.object == "text_completion" and whole.choices[0].text == text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens_details.cached_tokens == context.tokens
    chunks = list(openai.completions.create(model="handbook", prompt=QUESTION, max_tokens=10,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip() == text
    assert chunks[-1].model_extra["starqa"]["tokens"]["answer"] == 10

    response = openai.responses.create(model="handbook", input=QUESTION,
                                       max_output_tokens=10)
    assert response.output_text == text and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 10
    assert response.model_extra["starqa"]["sources"] == chat.model_extra["starqa"]["sources"]
    turns = openai.responses.create(model="handbook", max_output_tokens=10, input=[
        {"role": "user", "content": QUESTION}])
    assert turns.output_text == text
    events = list(openai.responses.create(model="handbook", input=QUESTION,
                                          max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.strip() == text and events[-1].response.output_text == text


@pytest.mark.slow
def test_prefill_progress_comes_first_and_in_order(served):
    """`return_progress`: the question's prefill reported as llama.cpp's server reports it,
    before the answer's first piece, ending with every prompt token processed."""
    server, context, _ = served
    host, port = server.sock.getsockname()[:2]
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "handbook", "stream": True, "max_tokens": 4, "return_progress": True,
        "messages": [{"role": "user", "content": QUESTION}]}),
        {"Content-Type": "application/json"})
    lines = [line for line in conn.getresponse().read().decode().splitlines()
             if line.startswith("data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    steps = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    texts = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get(
        "content")]
    assert steps and all(s["cache"] == context.tokens for s in steps)
    assert [s["processed"] for s in steps] == sorted(s["processed"] for s in steps)
    assert steps[-1]["processed"] == steps[-1]["total"] > context.tokens
    last_step = max(i for i, c in enumerate(chunks) if "prompt_progress" in c)
    assert texts and last_step < texts[0]


@pytest.mark.slow
def test_a_client_leaving_mid_batch_cancels_only_its_own(served):
    """Two questions answered together: the one whose client leaves is cancelled, the other
    runs to its end with the answer it gets alone."""
    server, _, openai = served
    alone = openai.chat.completions.create(
        model="handbook", messages=[{"role": "user", "content": "and the retry limit?"}],
        max_tokens=40).choices[0].message.content
    before = health(server)
    sock = long_answer_begun(server)
    # answered while the long one streams: one at a time, it would wait for the long one,
    # which ends only when its client leaves below
    kept = openai.chat.completions.create(
        model="handbook", messages=[{"role": "user", "content": "and the retry limit?"}],
        max_tokens=40)
    assert health(server)["answering"] == 1 and health(server)["cancelled"] == before["cancelled"]
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    assert kept.choices[0].message.content == alone and kept.choices[0].finish_reason == "length"
    wait_until(lambda: health(server)["cancelled"] == before["cancelled"] + 1)
    assert health(server)["answered"] == before["answered"] + 1
