"""The HTTP front (chapter 15): OpenAI's chat and completion endpoints, /generate, /v1/models,
/health."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Send

from minisgl.core import FinishReason, SamplingParams
from minisgl.message import UserReply

from .frontend import FrontendManager
from .limits import Guard, Limits, send_error
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    usage,
    validation_error,
)
from .protocol import Response as Shape

T = TypeVar("T")
Batch = list[UserReply]  # the replies a stream's reader found waiting when it woke
logger = logging.getLogger(__name__)

# the answers every route may give besides 200, documented in /openapi.json
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in [
        (400, "the request is malformed or asks for what this server cannot do"),
        (401, "--api-key is set and the request has no valid key"),
        (408, "the body did not come in time"),
        (413, "the body is over --max-request-bytes"),
        (415, "the body is not JSON"),
        (429, "--max-queued-requests are waiting already"),
        (503, "the server is starting, shutting down, or one of its processes died")]}
_STREAM = {"content": {"text/event-stream": {}}, "description": "the answer, or its events"}


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def create_app(model_name: str, max_seq_len: int,
               manager: Callable[[], FrontendManager], limits: Limits | None = None) -> FastAPI:
    """The app. `manager()` gives the FrontendManager, made once the event loop runs."""
    limits = limits or Limits()
    app = FastAPI(title="minisgl", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, limits=limits, state=lambda: manager().state)
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind=kind).body(),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:  # never meant to happen
        logger.exception("internal error on %s %s", request.method, request.url.path)
        err = APIError(500, "internal error; the server log has the details", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 once the server can serve; 503 while it starts, drains or has failed."""
        state = manager().state
        return JSONResponse({"status": state}, status_code=200 if state == "ready" else 503)

    @app.get("/v1/models", responses=_ERRORS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": started, "owned_by": "minisgl",
                                            "max_model_len": max_seq_len}]}

    if limits.enable_debug:
        @app.get("/debug/scheduler", responses=_ERRORS)
        async def scheduler_stats() -> dict[str, Any]:
            """The scheduler's own count of its rows and pages, and when idle its integrity
            check: how the tests see that every client that went away gave its memory back."""
            reply = await manager().stats()
            if reply is None:
                raise APIError(503, f"the scheduler did not answer; the server is "
                               f"{manager().state}", kind="service_unavailable")
            return dataclasses.asdict(reply)

        @app.get("/debug/processes", responses=_ERRORS)
        async def processes() -> dict[str, int]:
            """Every process of the server, name -> pid."""
            return manager().processes

    @app.post("/v1/chat/completions", responses={200: _STREAM, **_ERRORS})
    async def chat(body: ChatRequest, request: Request) -> Response:
        body.refuse_unsupported()
        params, stop = body.sampling(body.max_completion_tokens or body.max_tokens, max_seq_len)
        prompt = [m.as_template_input() for m in body.messages]
        return await _answer(request, manager(), Shape(True, model_name), prompt, params=params,
                             stop=stop, stream=bool(body.stream),
                             include_usage=body.include_usage, cache_salt=body.cache_salt)

    @app.post("/v1/completions", responses={200: _STREAM, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        params, stop = body.sampling(body.max_tokens, max_seq_len)
        return await _answer(request, manager(), Shape(False, model_name), body.single_prompt(),
                             params=params, stop=stop, stream=bool(body.stream),
                             include_usage=body.include_usage, cache_salt=body.cache_salt)

    @app.post("/generate", responses={200: _STREAM, **_ERRORS})
    async def generate(body: GenerateRequest, request: Request) -> Response:
        body.refuse_unsupported()
        params, stop = body.sampling(body.max_tokens, max_seq_len, temperature=0.0)
        return await _answer(request, manager(), None, body.single_prompt(), params=params,
                             stop=stop, stream=bool(body.stream), include_usage=True,
                             cache_salt=body.cache_salt)

    schema = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, less the 422 it lists for every body: this server answers 400."""
        out = schema()
        for path in out["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        return out
    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _answer(request: Request, m: FrontendManager, shape: Shape | None,
                  prompt: str | list[dict[str, str]] | list[int], params: SamplingParams,
                  stop: list[str],
                  stream: bool, include_usage: bool, cache_salt: str | None) -> Response:
    """Submit; answer a stream at once (its status line waits for the first reply, so that an
    error is still a 4xx), a whole answer after it. A client that goes away aborts the request."""
    uid = await m.submit(prompt, params, stop, cache_salt or "")
    answers = m.batches(uid)
    if stream:
        return _HeldStream(answers, m, shape, include_usage)
    try:
        first = await _unless_gone(request, answers.__anext__())
    except ClientGone:
        await answers.aclose()
        return Response(status_code=499)  # nobody reads it; the request is aborted
    if first[0].finish_reason == "error":
        await answers.aclose()
        raise _error_of(first[0], m)
    async with aclosing(answers):
        try:
            last, text = await _unless_gone(request, _collect(first, answers))
        except ClientGone:
            return Response(status_code=499)
    if last.finish_reason == "error":
        raise _error_of(last, m)
    u = usage(last.prompt_tokens, last.completion_tokens)
    if shape is None:
        return JSONResponse({"text": text, "finish_reason": last.finish_reason, "usage": u})
    return JSONResponse(shape.full(text, _openai_reason(last), u))


class _HeldStream(StreamingResponse):
    """Server-sent events handed to Starlette at once, with the status line held until the
    first reply: an error is still a 4xx, and what Starlette does before a response's first
    byte (its task group, the listener for a disconnect) runs during the prefill, not after the
    first token. A client that goes away before it cancels the wait (Starlette's listener)."""

    def __init__(self, answers: AsyncGenerator[Batch, None], m: FrontendManager,
                 shape: Shape | None, include_usage: bool) -> None:
        super().__init__(_no_events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.answers, self.manager = answers, m
        self.shape, self.include_usage = shape, include_usage

    async def stream_response(self, send: Send) -> None:
        try:
            first = await self.answers.__anext__()
        except BaseException:  # cancelled: the client went away
            await self.answers.aclose()
            raise
        if first[0].finish_reason == "error":
            await self.answers.aclose()
            await send_error(send, _error_of(first[0], self.manager))
            return
        self.body_iterator = (
            _generate_events(first, self.answers) if self.shape is None
            else _openai_events(self.shape, first, self.answers, self.include_usage))
        await super().stream_response(send)


async def _no_events() -> AsyncIterator[bytes]:
    return
    yield  # an async generator that yields nothing: replaced once the first reply is here


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """work's result, or ClientGone (work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(first: Batch, batches: AsyncIterator[Batch]) -> tuple[UserReply, str]:
    text, last = [r.incremental_output for r in first], first[-1]
    async for batch in _rest(first, batches):
        text += [r.incremental_output for r in batch]
        last = batch[-1]
    return last, "".join(text)


def _error_of(reply: UserReply, m: FrontendManager) -> APIError:
    if m.state != "ready":  # a process died, or the server stopped the request on shutdown
        return APIError(503, reply.error or m.state, kind="service_unavailable")
    return APIError(400, reply.error or "the request failed")


def _openai_reason(reply: UserReply) -> FinishReason:
    return "length" if reply.finish_reason == "length" else "stop"


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _rest(first: Batch, batches: AsyncIterator[Batch]) -> AsyncIterator[Batch]:
    """The batches after the first, none if the first ended the request."""
    if not first[-1].finished:
        async for batch in batches:
            yield batch


async def _all(first: Batch, batches: AsyncIterator[Batch]) -> AsyncIterator[Batch]:
    yield first
    async for batch in _rest(first, batches):
        yield batch


async def _openai_events(shape: Shape, first: Batch, batches: AsyncGenerator[Batch, None],
                         include_usage: bool) -> AsyncIterator[bytes]:
    """role first, then the text as it comes, one chunk with the finish reason, with
    include_usage a last chunk with no choices and the usage, then [DONE]. The events of
    replies that came together go out in one write."""
    out: list[bytes] = []
    async with aclosing(batches):
        if shape.chat:
            out.append(_sse(shape.chunk(None, role=True, with_usage=include_usage)))
        async for batch in _all(first, batches):
            for reply in batch:
                if reply.finish_reason == "error":  # a process died mid-stream
                    out.append(_sse(APIError(503, reply.error or "",
                                             kind="service_unavailable").body()))
                    break
                if reply.incremental_output:
                    out.append(_sse(shape.chunk(reply.incremental_output,
                                                with_usage=include_usage)))
                if reply.finished:
                    out.append(_sse(shape.chunk(None, _openai_reason(reply),
                                                with_usage=include_usage)))
                    if include_usage:
                        out.append(_sse(shape.chunk(None, usage=usage(
                            reply.prompt_tokens, reply.completion_tokens))))
            if batch[-1].finished:  # an error ends its batch too
                break
            yield b"".join(out)
            out = []
    out.append(b"data: [DONE]\n\n")
    yield b"".join(out)


async def _generate_events(first: Batch, batches: AsyncGenerator[Batch, None]
                           ) -> AsyncIterator[bytes]:
    """/generate's events: {"text"} as it comes; the last adds finish_reason and usage."""
    out: list[bytes] = []
    async with aclosing(batches):
        async for batch in _all(first, batches):
            for reply in batch:
                event: dict[str, Any] = {"text": reply.incremental_output}
                if reply.finished:
                    event["finish_reason"] = reply.finish_reason
                    event["usage"] = usage(reply.prompt_tokens, reply.completion_tokens)
                    if reply.error:
                        event["error"] = reply.error
                out.append(_sse(event))
            if not batch[-1].finished:
                yield b"".join(out)
                out = []
    out.append(b"data: [DONE]\n\n")
    yield b"".join(out)
