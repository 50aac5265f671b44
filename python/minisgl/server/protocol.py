"""OpenAI's request and response shapes, and its error body (chapter 15)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minisgl.core import SamplingParams


class APIError(Exception):
    """An error a client gets as OpenAI's JSON body, with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                      kind, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class _Request(BaseModel):
    """Fields every generation endpoint takes. Strict: "0.5" is not a number, 1.5 not an int.
    Fields we do not know are ignored, as OpenAI's own server does with most of them; those
    whose meaning we cannot honour are refused by name."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    logprobs: bool | int | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("must be -1 (no limit) or at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop strings")
        return v

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n must be 1: this server returns one choice per request", "n")
        if self.seed is not None:
            raise APIError(400, "seed is not supported: one random generator serves every "
                           "request; use temperature 0 for repeatable output", "seed")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")

    def sampling(self, max_tokens: int | None, limit: int) -> tuple[SamplingParams, list[str]]:
        """The scheduler's SamplingParams (no max_tokens: the context's room, which the
        scheduler clips to), and the stop strings."""
        params = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                ignore_eos=self.ignore_eos, max_tokens=max_tokens or limit)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return params, stop


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # the parts of one message, as one text
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream_options: StreamOptions | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    stream_options: StreamOptions | None = None

    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(400, "one prompt per request: send several requests instead",
                               "prompt")
            return str(self.prompt[0])
        if not self.prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        return self.prompt  # type: ignore[return-value]


class GenerateRequest(CompletionRequest):
    """/generate: a prompt (text or token ids) in, text out; SSE when streaming."""

    temperature: float = Field(0.0, ge=0.0)  # greedy unless asked: a tool for checking outputs


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request in body, or an APIError naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}") from None
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None


class Response:
    """The fields every response and chunk of one request shares."""

    def __init__(self, chat: bool, model: str) -> None:
        prefix = "chatcmpl" if chat else "cmpl"
        self.chat, self.id, self.model = chat, f"{prefix}-{uuid.uuid4().hex}", model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish_reason, "logprobs": None}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              usage: dict[str, int] | None = None, with_usage: bool = False) -> dict[str, Any]:
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
