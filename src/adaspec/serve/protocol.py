"""OpenAI-compatible request and response shapes, and errors in OpenAI's error JSON.

Requests are validated strictly (wrong types are errors, not coerced); options the server
does not implement (``n`` > 1, logprobs, tools, penalties) are refused with a 400 that says
so rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


#: OpenAI's bounds on sampling parameters, which the server keeps (a client written against
#: OpenAI's API gets the same 400 here as there): temperature in [0, 2], at most 4 stop strings
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4


# -- requests ---------------------------------------------------------------------------------
class _Strict(BaseModel):
    """Strict types; unknown top-level keys are ignored as OpenAI clients send many."""

    model_config = ConfigDict(strict=True, extra="ignore")


class AdaspecOptions(BaseModel):
    """The optional ``adaspec`` request field: drafters from the loaded pool and the policies."""

    model_config = ConfigDict(strict=True, extra="forbid")
    drafters: list[str] | None = Field(None, min_length=1)
    selector: str | None = None
    length: str | int | None = None
    k: int | None = Field(None, ge=1, le=64)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class _Common(_Strict):
    """Parameters shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    adaspec: AdaspecOptions | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for options that are set but not implemented."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", f"n={self.n} is not supported: this server returns one choice per "
                              "request (n=1); send several requests instead"))
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported (penalties would change the target's "
                                  "distribution that speculative decoding reproduces): omit it or use 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported: omit it"))
        return out


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported by adaspec serve: omit logprobs "
                                    "and top_logprobs"))
        if self.tools:
            out.append(("tools", "tools (function calling) are not supported: omit tools"))
        return out


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported by adaspec serve: omit logprobs"))
        if self.echo:
            out.append(("echo", "echo is not supported: omit it"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported: omit it"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of > 1 is not supported: omit it"))
        return out


def _is_type_tag(part: str | int) -> bool:
    """Union members in pydantic error locations ('str', 'list[int]', 'TextPart'), not fields."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none", "dict"}
                                      or "[" in part or part[:1].isupper())


def parse_body(raw: bytes, model: type[_Common]) -> _Common:
    """Parse and validate a JSON body; every problem becomes a 400 naming the parameter."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
        msg = first["msg"]
        if first["type"] == "missing":
            msg = f"'{param}' is required"
        elif first["type"] == "too_short":
            msg = f"'{param}' must not be empty"
        elif first["type"] == "extra_forbidden":
            msg = f"unknown option '{param}'"
        raise bad_request(f"{msg} (parameter '{param}')", param=param,
                          code="invalid_value") from None
    problems = req.unsupported()
    if problems:
        param, msg = problems[0]
        raise bad_request(msg, param=param, code="unsupported_parameter")
    return req


# -- responses --------------------------------------------------------------------------------
def new_id(kind: Literal["chat", "text"]) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(kind: Literal["chat", "text"], rid: str, model: str, text: str,
                    finish_reason: str, use: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` or ``text_completion`` object."""
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": use,
            "adaspec": stats}


def chunk_body(kind: Literal["chat", "text"], rid: str, model: str, created: int, *,
               text: str | None = None, role: bool = False, finish_reason: str | None = None,
               use: dict[str, int] | None = None, stats: dict[str, Any] | None = None,
               choices: bool = True) -> dict[str, Any]:
    """One streamed chunk; ``choices=False`` is the final usage-only chunk (``include_usage``)."""
    out: dict[str, Any] = {"id": rid, "created": created, "model": model,
                           "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
    if not choices:
        out["choices"] = []
    elif kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": None,
                           "finish_reason": finish_reason}]
    if use is not None:
        out["usage"] = use
    if stats is not None:
        out["adaspec"] = stats
    return out


FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}
