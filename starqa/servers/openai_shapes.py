"""The shapes of OpenAI's API that starqa's HTTP door speaks (`starqa.servers.http` routes
them): each request checked into a `Call`, and each answer written as that API writes it,
whole or as server-sent events (`Shape`).

    POST /v1/chat/completions  `messages`: the last user message is the question, the turns
                               before it its history; `max_tokens` / `max_completion_tokens`
    POST /v1/completions       `prompt`: the question (a string, or a list of one);
                               `max_tokens`
    POST /v1/responses         `input`: the question (a string), or messages as chat's;
                               `max_output_tokens`; `instructions` accepted and unused

Each takes `model` (the context), `stream`, `stop` (chat and completions). An answer's
sources and timings ride in a `starqa` field next to OpenAI's (the completion's or
response's, or the stream's last chunk's or `response.completed` event's). A streamed chat or
completion that asks for it (`"return_progress": true`, as llama.cpp's server takes it)
gets the question's prefill as it goes, chunks with no choice and a `prompt_progress`
object: `total` (the prompt's tokens, context included), `cache` (the context's, cached),
`processed` (of the total, so far) and `time_ms`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from starqa import api

MAX_STOPS = 4  # as OpenAI's API
UNUSED_TOOLS = ("tools", "functions")


class ApiError(Exception):
    """An OpenAI-style error answer: its status and `{"error": {...}}`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param,
                               "code": code}}

    def response(self):
        from starlette.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# ------------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class Call:
    """A request, checked: which API (`chat`, `completion`, `response`), the context it
    names, the question for it, whether it streams, and what its stream adds (the usage at
    the end, the prefill's progress)."""

    kind: str
    model: str
    question: api.Question
    stream: bool
    include_usage: bool = False
    progress: bool = False


def parse_chat(body) -> Call:
    """A chat completion's fields, checked (raises ApiError 400 naming the field at fault)."""
    model, stream, usage, progress = _common(body)
    text, history = conversation(body.get("messages"))
    return Call("chat", model, _question(text, model, history, body, "messages"), stream,
                usage, progress)


def parse_completion(body) -> Call:
    """A (legacy) completion's fields: its `prompt` is the question."""
    model, stream, usage, progress = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("`prompt` must be the question, a string (or a list of one string).",
                      "prompt")
    if body.get("echo"):
        raise invalid("`echo` is not supported: the prompt is a question about a context, "
                      "not text to continue.", "echo")
    return Call("completion", model, _question(prompt, model, (), body, "prompt"), stream,
                usage, progress)


def parse_response(body) -> Call:
    """A response's fields: its `input` is the question (a string) or messages as chat's;
    it is stored nowhere, so `previous_response_id` names nothing here."""
    model, stream, _, _ = _common(body)
    if body.get("previous_response_id"):
        raise invalid("`previous_response_id` is not supported: starqa stores no responses; "
                      "send the earlier turns in `input` as messages.", "previous_response_id")
    given = body.get("input")
    if isinstance(given, str):
        text, history = given, ()
    else:
        text, history = conversation(given, "input")
    return Call("response", model, _question(text, model, history, body, "input"), stream)


def _common(body) -> tuple[str, bool, bool, bool]:
    """(model, stream, include the usage, return the progress), checked."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid("`model` must name a context (GET /v1/models lists them).", "model")
    for name in UNUSED_TOOLS:
        if body.get(name):
            raise invalid(f"`{name}` is not supported: starqa answers from a context and "
                          "calls no tools.", name)
    if body.get("n", 1) not in (1, None):
        raise invalid("`n` must be 1: answers are greedy, so every choice would be the "
                      "same.", "n")
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    progress = body.get("return_progress") or False
    if not isinstance(stream, bool) or not isinstance(options, dict) or \
            not isinstance(progress, bool):
        raise invalid("`stream` and `return_progress` must be true or false, "
                      "`stream_options` an object.", "stream")
    return model, stream, bool(options.get("include_usage")), progress


def _question(text: str, model: str, history, body: dict, param: str) -> api.Question:
    try:
        return api.Question(text, model, history, _max_tokens(body), _stops(body))
    except api.StarqaError as error:
        raise invalid(str(error), param) from None


def conversation(messages, param: str = "messages"
                 ) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(the question, the (question, answer) turns before it) from OpenAI's messages: the
    last must be the user's; messages of one role in a row are joined; system and
    developer messages are left out, as is an assistant's greeting before any question."""
    if not isinstance(messages, list) or not messages:
        raise invalid(f"`{param}` must be a non-empty list.", param)
    turns: list[list[str]] = []  # [role, text], alternating
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            continue
        if role not in ("user", "assistant"):
            raise invalid(f"{param}[{i}]: the role must be user, assistant or system "
                          f"(got {role!r}).", param)
        text = _text(message.get("content"), i, param)
        if turns and turns[-1][0] == role:
            turns[-1][1] += "\n\n" + text
        elif turns or role == "user":
            turns.append([role, text])
    if not turns or turns[-1][0] != "user":
        raise invalid("The last message must be the user's question.", param)
    history = tuple((turns[i][1], turns[i + 1][1]) for i in range(0, len(turns) - 1, 2))
    return turns[-1][1], history


TEXT_PARTS = ("text", "input_text", "output_text")  # chat's, and the responses API's


def _text(content, i: int, param: str) -> str:
    """A message's text: a string, or a list of text parts (other parts are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"{param}[{i}]: the content must be text (a string or text parts).", param)


def _max_tokens(body: dict) -> int:
    name = next((n for n in ("max_completion_tokens", "max_output_tokens")
                 if body.get(n) is not None), "max_tokens")
    value = body.get(name)
    if value is None:
        return api.DEFAULT_MAX_NEW_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise invalid(f"`{name}` must be a whole number of tokens, at least 1.", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stops):
        raise invalid(f"`stop` must be a string or a list of up to {MAX_STOPS} non-empty "
                      "strings.", "stop")
    return tuple(stops)


# ------------------------------------------------------------------------------- answers

def extension(answer: api.Answer) -> dict:
    """The `starqa` field: the answer's record without its text (sources, timings, ...)."""
    record = answer.as_dict()
    del record["answer"]
    return record


def usage(answer: api.Answer) -> dict:
    """OpenAI's usage: the prompt is the context (cached) and the question."""
    prompt = answer.context.tokens + answer.question_tokens
    return {"prompt_tokens": prompt, "completion_tokens": answer.answer_tokens,
            "total_tokens": prompt + answer.answer_tokens,
            "prompt_tokens_details": {"cached_tokens": answer.context.tokens}}


def event(data: dict | str, name: str | None = None) -> str:
    """One server-sent event (named, for the responses API)."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _finish(answer: api.Answer) -> str:
    return "length" if answer.finish == "length" else "stop"


class Shape:
    """One answer as its API writes it: whole (`whole`), or as events (`start`, a `piece`
    at a time, `progress` where asked for, `end`, or `error`)."""

    PREFIX = {"chat": "chatcmpl", "completion": "cmpl", "response": "resp"}

    def __init__(self, call: Call, context: api.Context):
        self.call, self.model = call, context.ref
        self.ident = f"{self.PREFIX[call.kind]}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.item = f"msg_{uuid.uuid4().hex}"  # the responses API's output message
        self.sequence = 0  # the responses API numbers its events
        self.text: list[str] = []

    # -- whole

    def whole(self, answer: api.Answer) -> dict:
        kind = self.call.kind
        if kind == "response":
            return self._response(answer, "completed")
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": answer.text},
                      "logprobs": None, "finish_reason": _finish(answer)}
        else:
            choice = {"index": 0, "text": answer.text, "logprobs": None,
                      "finish_reason": _finish(answer)}
        return {"id": self.ident, "object": "chat.completion" if kind == "chat" else
                "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(answer), "starqa": extension(answer)}

    def _response(self, answer: api.Answer | None, status: str) -> dict:
        text = answer.text if answer is not None else ""
        done = answer is not None
        cut = done and answer.finish == "length"
        body = {"id": self.ident, "object": "response", "created_at": self.created,
                "status": "incomplete" if cut else status, "model": self.model,
                "output": [self._message(text, "completed" if done else "in_progress")]
                if done else [],
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "error": None, "instructions": None, "metadata": {},
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                "temperature": None, "top_p": None}
        if answer is not None:
            body["usage"] = {
                "input_tokens": answer.context.tokens + answer.question_tokens,
                "input_tokens_details": {"cached_tokens": answer.context.tokens},
                "output_tokens": answer.answer_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.context.tokens + answer.question_tokens +
                answer.answer_tokens}
            body["starqa"] = extension(answer)
        return body

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.item, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]
                if status == "completed" else []}

    # -- events

    def start(self) -> list[str]:
        """The events before the first piece."""
        if self.call.kind == "chat":
            return [event(self._chunk({"role": "assistant", "content": ""}))]
        if self.call.kind == "completion":
            return []
        return [self._named("response.created", response=self._response(None, "in_progress")),
                self._named("response.in_progress",
                            response=self._response(None, "in_progress")),
                self._named("response.output_item.added", output_index=0,
                            item=self._message("", "in_progress")),
                self._named("response.content_part.added", item_id=self.item,
                            output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def piece(self, text: str) -> str:
        self.text.append(text)
        if self.call.kind == "chat":
            return event(self._chunk({"content": text}))
        if self.call.kind == "completion":
            return event(self._chunk(text=text))
        return self._named("response.output_text.delta", item_id=self.item, output_index=0,
                           content_index=0, delta=text, logprobs=[])

    def progress(self, step: api.Progress) -> str | None:
        """The prefill's progress as llama.cpp's server sends it, where the call asked for
        it (chat and completions)."""
        if not self.call.progress or self.call.kind == "response":
            return None
        return event({"id": self.ident, "object": self._object(), "created": self.created,
                      "model": self.model, "choices": [],
                      "prompt_progress": {"total": step.total, "cache": step.cached,
                                          "processed": step.processed,
                                          "time_ms": round(step.elapsed_s * 1000)}})

    def end(self, answer: api.Answer) -> list[str]:
        """The events after the last piece: the end (with the `starqa` record), the usage
        where asked for, `[DONE]`; the responses API's closing events."""
        if self.call.kind == "response":
            part = {"type": "output_text", "text": answer.text, "annotations": []}
            return [self._named("response.output_text.done", item_id=self.item,
                                output_index=0, content_index=0, text=answer.text,
                                logprobs=[]),
                    self._named("response.content_part.done", item_id=self.item,
                                output_index=0, content_index=0, part=part),
                    self._named("response.output_item.done", output_index=0,
                                item=self._message(answer.text, "completed")),
                    self._named("response.incomplete" if answer.finish == "length" else
                                "response.completed",
                                response=self._response(answer, "completed"))]
        last = self._chunk({}, _finish(answer)) if self.call.kind == "chat" else \
            self._chunk(text="", finish=_finish(answer))
        events = [event({**last, "starqa": extension(answer)})]
        if self.call.include_usage:
            events.append(event({"id": self.ident, "object": self._object(),
                                 "created": self.created, "model": self.model,
                                 "choices": [], "usage": usage(answer)}))
        return events + [event("[DONE]")]

    def error(self, body: dict) -> str:
        """An error once the stream has begun: its last event."""
        if self.call.kind == "response":
            error = body["error"]
            return self._named("error", code=error.get("code"), message=error["message"],
                               param=error.get("param"))
        return event(body)

    def _object(self) -> str:
        return "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"

    def _chunk(self, delta: dict | None = None, finish: str | None = None,
               text: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta} if self.call.kind == "chat" else \
            {"index": 0, "text": text}
        return {"id": self.ident, "object": self._object(), "created": self.created,
                "model": self.model,
                "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}

    def _named(self, name: str, **fields) -> str:
        self.sequence += 1
        return event({"type": name, "sequence_number": self.sequence, **fields}, name)
