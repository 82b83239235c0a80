"""The OpenAI request fields the server reads, checked: every bad value is an :class:`APIError`
(HTTP 400 with an OpenAI-style body naming the field), never a framework's 422 or a traceback."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from portable_llm.generation.batch import MAX_N
from portable_llm.ops.penalties import (
    FREQUENCY_PENALTY_RANGE,
    LOGIT_BIAS_RANGE,
    PRESENCE_PENALTY_RANGE,
)

__all__ = ["APIError", "Sampling", "error_body", "read_chat", "read_completion"]

#: The most stop strings and top log-probabilities a request may ask for.
MAX_STOP = 16
#: The longest stop string, in characters.
MAX_STOP_CHARS = 512
MAX_TOP_LOGPROBS = 20
#: The most ``logit_bias`` entries and ``stop_token_ids`` a request may send.
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64


class APIError(Exception):
    """An error answered with ``status`` and ``{"error": {"message", "type", "param",
    "code"}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code = param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: all four keys, ``param``/``code`` possibly ``None``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Sampling:
    """The generation options of one request (after the checks)."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: list[str]
    top_logprobs: int | None  # None: no log-probabilities
    stream: bool
    include_usage: bool
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension


def _bad(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(f"{param}: {message}", param=param, code=code)


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, int | float) else "null"
    )


def _int(body: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(key, f"expected an integer, got {_type_name(value)}", "invalid_type")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(key, f"must be {bound}, got {value}")
    return int(value)


def _float(
    body: Mapping[str, Any], key: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(key, f"expected a number, got {_type_name(value)}", "invalid_type")
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        left = "(" if low_open else "["
        raise _bad(key, f"must be in {left}{low}, {high}], got {value}")
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(key, f"expected a boolean, got {_type_name(value)}", "invalid_type")
    return value


def _unsupported(body: Mapping[str, Any], allowed: Mapping[str, Any]) -> None:
    """Fields the server does not implement: accepted only at their no-op value."""
    for key, default in allowed.items():
        value = body.get(key)
        if value is not None and value != default:
            raise _bad(key, f"is not supported by this server (only {default!r})", "unsupported")


def _common(body: Any, default_model: str) -> Sampling:
    if not isinstance(body, Mapping):
        raise APIError(f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise _bad("model", f"expected a string, got {_type_name(model)}", "invalid_type")
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _bad("stop", "expected a string or an array of strings", "invalid_type")
    if len(stops) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
    top_k = body.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k in (0, -1):
        top_k = None  # vLLM's "no top-k"
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "only with stream=true")
        if not isinstance(options, Mapping):
            raise _bad("stream_options", "expected an object", "invalid_type")
        include_usage = _bool(options, "include_usage")
    temperature = _float(body, "temperature", 0.0, 2.0)
    s = Sampling(
        model=model,
        max_tokens=None,
        temperature=1.0 if temperature is None else temperature,
        top_p=_float(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=_int({"top_k": top_k}, "top_k", 1),
        min_p=_float(body, "min_p", 0.0, 1.0),
        seed=_int(body, "seed", 0, 2**63 - 1),
        stop=stops,
        top_logprobs=None,
        stream=stream,
        include_usage=include_usage,
    )
    _penalties(body, s)
    return s


def _penalties(body: Mapping[str, Any], s: Sampling) -> None:
    """The sampling fields OpenAI and vLLM add: ``n``, the penalties, ``logit_bias``,
    ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` (each range as vLLM's; the token ids
    against the vocabulary later, where it is known)."""
    s.n = _int(body, "n", 1, MAX_N) or 1
    s.frequency_penalty = _float(body, "frequency_penalty", *FREQUENCY_PENALTY_RANGE) or 0.0
    s.presence_penalty = _float(body, "presence_penalty", *PRESENCE_PENALTY_RANGE) or 0.0
    repetition = body.get("repetition_penalty")
    if repetition is not None:
        if isinstance(repetition, bool) or not isinstance(repetition, int | float):
            raise _bad("repetition_penalty", f"expected a number, got {_type_name(repetition)}",
                       "invalid_type")  # fmt: skip
        if not (math.isfinite(repetition) and repetition > 0):
            raise _bad("repetition_penalty", f"must be a finite number > 0, got {repetition}")
        s.repetition_penalty = float(repetition)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise _bad("logit_bias", f"expected an object, got {_type_name(bias)}", "invalid_type")
        if len(bias) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for key in bias:
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
                raise _bad("logit_bias", f"keys must be token ids, got {str(key)[:40]!r}")
            value, (low, high) = bias[key], LOGIT_BIAS_RANGE
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad("logit_bias", f"[{key}]: expected a number, got {_type_name(value)}",
                           "invalid_type")  # fmt: skip
            if not low <= value <= high:  # NaN fails too
                raise _bad("logit_bias", f"[{key}]: must be in [{low}, {high}], got {value}")
            s.logit_bias[int(key)] = float(value)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not (
            isinstance(ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise _bad("stop_token_ids", "expected an array of token ids (ints >= 0)",
                       "invalid_type")  # fmt: skip
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        s.stop_token_ids = list(ids)
    s.ignore_eos = _bool(body, "ignore_eos")
    s.min_tokens = _int(body, "min_tokens", 0) or 0


def _max_tokens(body: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = _int(body, key, 1)
        if value is not None:
            return value
    return None


def read_chat(body: Any, default_model: str) -> tuple[Sampling, list[dict[str, Any]]]:
    """The options and messages of a ``/v1/chat/completions`` body."""
    s = _common(body, default_model)
    s.max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    if _bool(body, "logprobs"):
        s.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "needs logprobs=true")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty array of messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _bad(param, f"expected an object, got {_type_name(m)}", "invalid_type")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise _bad(f"{param}.role", "expected a non-empty string", "invalid_type")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text"):
                    raise _bad(f"{param}.content[{j}]", "only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{param}.content[{j}].text", "expected a string", "invalid_type")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise _bad(f"{param}.content", "expected a string or text parts", "invalid_type")
        tools = {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}
        out.append({"role": role, "content": content, **tools})  # serve.tools checks them
    return s, out


def read_completion(body: Any, default_model: str) -> tuple[Sampling, str | list[int]]:
    """The options and the prompt (text, or token ids) of a ``/v1/completions`` body."""
    s = _common(body, default_model)
    s.max_tokens = _max_tokens(body, "max_tokens")
    _unsupported(body, {"echo": False, "suffix": "", "best_of": 1})
    s.top_logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "is empty")
        return s, prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return s, [int(t) for t in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise _bad("prompt", "only one prompt per request is supported", "unsupported")
    raise _bad("prompt", "expected a string or an array of token ids", "invalid_type")
