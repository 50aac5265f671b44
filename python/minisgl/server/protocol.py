"""OpenAI's request and response shapes, and its error body (chapter 15)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minisgl.core import FinishReason, SamplingParams

INT64_MAX = 2**63 - 1  # every integer a request carries fits the messages between processes
TOKEN_ID_MAX = 2**31 - 1  # prompts travel as int32; the tokenizer checks the vocabulary


class APIError(Exception):
    """An error a client gets as OpenAI's JSON body, with an HTTP status (and headers such as
    Retry-After or Allow)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                      kind, code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer of this server (documented in /openapi.json)."""

    error: ErrorDetail


# Fields of OpenAI's API that this server does not implement: accepted only with the value
# that asks for nothing (so clients that send defaults work), refused by name otherwise.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "seed": (None,), "logprobs": (None, False),
    "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}

class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's; ignored: usage comes at the end


Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
Number = Annotated[float, Field(allow_inf_nan=False)]


class _Request(BaseModel):
    """Fields every generation endpoint takes. Strict: "0.5" is not a number, 1.5 not an int;
    `null` means the default, as in OpenAI's API. A field this server does not know is refused
    by name, and so is a known one asking for what it does not implement."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Number | None = Field(None, ge=0.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Literal[-1] | Count | None = Field(
        None, description="-1: no cut; at or above the vocabulary: no cut")
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, description=(
        "requests share cached prefixes only with requests of the same salt"))
    n: Any = None
    best_of: Any = None
    seed: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # these describe the caller or ask OpenAI to keep data: they change no answer, so they are
    # accepted and ignored
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    parallel_tool_calls: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop strings")
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("a stop string must not be empty")
        return v

    def refuse_unsupported(self) -> None:
        """400, naming the field, for each part of OpenAI's API this server does not do."""
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if not any(_same(value, v) for v in neutral):
                raise APIError(400, f"{name} is not supported by this server; leave it out "
                               f"(or send {_show(neutral[-1])})", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")

    def sampling(self, max_tokens: int | None, max_seq_len: int, temperature: float = 1.0
                 ) -> tuple[SamplingParams, list[str]]:
        """The scheduler's SamplingParams and the stop strings. Without max_tokens the request
        may fill the context: it is sent as max_seq_len, which the scheduler takes as "as many
        as fit". An explicit one must leave room for a prompt (the scheduler then checks that
        prompt + max_tokens fits)."""
        if max_tokens is not None and max_tokens >= max_seq_len:
            raise APIError(400, f"max_tokens is {max_tokens}, but this server's context is "
                           f"{max_seq_len} tokens, prompt included; ask for at most "
                           f"{max_seq_len - 1}", "max_tokens")
        params = SamplingParams(
            temperature=temperature if self.temperature is None else self.temperature,
            top_k=-1 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            ignore_eos=bool(self.ignore_eos), max_tokens=max_tokens or max_seq_len)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return params, stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _same(a: Any, b: Any) -> bool:
    """a == b, except that a bool equals only a bool (0 is not False, 1 is not True)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a is b if a is None or b is None else a == b


def _show(value: Any) -> str:
    return json.dumps(value)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # the parts of one message, as one text
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Request):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)] = Field(
        description="text, token ids, or a list of one text (one prompt per request)")

    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt  # type: ignore[return-value]


class GenerateRequest(CompletionRequest):
    """/generate: a prompt (text or token ids) in, text out; SSE when streaming. Greedy unless
    a temperature is given: a tool for checking outputs."""


def validation_error(e: ValidationError | list[Any]) -> APIError:
    """The 400 for a body that does not fit its model, naming the first bad field. Of a union's
    branches, a wrong value ("at least 1 item") says more than a wrong type ("a valid string")."""
    errors = e.errors() if isinstance(e, ValidationError) else e
    if any(err["type"] == "json_invalid" for err in errors):
        return APIError(400, "the body is not valid JSON")
    found = [(err["type"].endswith("_type"), [str(x) for x in err["loc"]
                                               if x != "body" and not _branch(x)], err)
             for err in errors]
    kind, loc, err = min(found, key=lambda f: (f[0], -len(f[1])))
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {param}: this server does not implement it", param)
    if err["type"] == "missing" and param is None:
        return APIError(400, "the body is empty: send a JSON object")
    said = dict.fromkeys(f[2]["msg"] for f in found if f[0] == kind and f[1] == loc)
    message = " or ".join(said)
    return APIError(400, f"{param}: {message}" if param else message, param)


def _branch(part: Any) -> bool:
    """A union branch pydantic names in an error's location ("str", "list[int]",
    "constrained-str", "literal[-1]"), not a field."""
    return isinstance(part, str) and (
        "[" in part or part.startswith(("constrained-", "function-")) or part in ("str", "int"))


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request in body, or an APIError naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


class Response:
    """The fields every response and chunk of one request shares."""

    def __init__(self, chat: bool, model: str) -> None:
        prefix = "chatcmpl" if chat else "cmpl"
        self.chat, self.id, self.model = chat, f"{prefix}-{uuid.uuid4().hex}", model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: FinishReason, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish_reason, "logprobs": None}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: FinishReason | None = None,
              role: bool = False, usage: dict[str, int] | None = None,
              with_usage: bool = False) -> dict[str, Any]:
        """One streamed chunk: new text, or the role (the first), or the finish reason (the
        last with choices), or the usage (no choices). With include_usage, every chunk carries
        a `usage` key, null but on the usage chunk, as OpenAI sends them."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": None}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason,
                      "logprobs": None}
            out = self._head("text_completion")
        out["choices"] = [] if usage is not None else [choice]
        if with_usage or usage is not None:
            out["usage"] = usage
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
