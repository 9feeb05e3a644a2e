"""The HTTP layer: an OpenAI-compatible FastAPI app over a Scheduler (no Qt, no decoding here).

Routes: POST /v1/chat/completions, POST /v1/completions (server-sent events when `stream`), GET /v1/models,
GET /health, GET /metrics. Errors have OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.serve import protocol as wire
from app.serve.metrics import CONTENT_TYPE, ServeMetrics
from app.serve.stops import StopCutter
from engine.errors import GenerationError
from engine.serving.scheduler import ContextFullError, Scheduler, ServerBusyError, Ticket
from engine.types import Step, Summary

log = logging.getLogger(__name__)
Kind = Literal["chat", "text"]
DISCONNECT_POLL_S = 0.1  # how often a non-streamed answer checks that its client is still there


@dataclass(frozen=True)
class ServeConfig:
    """What the app serves and how it is guarded."""

    model: str  # the model name clients send (and /v1/models lists)
    defaults: wire.Defaults  # decoding where a request does not say
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set


class _Answer:
    """Carries a ticket's events from the scheduler's thread into the request's coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def __call__(self, kind: str, payload: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the server's loop is gone (shutdown): nobody is listening
            pass


def create_app(scheduler: Scheduler, config: ServeConfig) -> FastAPI:
    """The server's app; the caller runs it (uvicorn) and closes the scheduler afterwards."""
    app = FastAPI(title="SpecDec Studio", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServeMetrics(config.model, lambda: scheduler.running, lambda: scheduler.waiting)
    app.state.metrics = metrics

    def refuse(e: wire.ApiError) -> JSONResponse:
        metrics.rejected.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(wire.ApiError)
    async def _api_error(_request: Request, e: wire.ApiError) -> JSONResponse:
        return refuse(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        else:
            message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        return refuse(wire.ApiError(400, message, param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        return refuse(wire.ApiError(e.status_code, str(e.detail), code=str(e.status_code)))

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise wire.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                type_="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model, "object": "model", "created": 0,
                                            "owned_by": "specdec-studio", "max_model_len": scheduler.context}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: wire.ChatBody, request: Request) -> Response:
        return await answer("chat", body, request)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: wire.CompletionBody, request: Request) -> Response:
        return await answer("text", body, request)

    async def answer(kind: Kind, body: wire.ChatBody | wire.CompletionBody, request: Request) -> Response:
        if body.model is not None and body.model != config.model:
            raise wire.ApiError(404, f"the model '{body.model}' does not exist here; this server has "
                                     f"'{config.model}' (GET /v1/models)", code="model_not_found", param="model")
        engine_request = wire.to_request(body, config.defaults)
        events = _Answer(asyncio.get_running_loop())
        try:
            ticket = scheduler.submit(engine_request, events)
        except ServerBusyError as e:
            raise wire.ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
        except ContextFullError as e:
            raise wire.ApiError(400, str(e), code="context_length_exceeded", param="messages") from None
        except GenerationError as e:
            raise wire.ApiError(400, str(e)) from None
        stream = _Stream(kind, wire.new_id(kind), config.model, ticket, events, StopCutter(body.stops()), metrics)
        if body.stream:
            return EventSourceResponse(stream.sse(body.include_usage), ping=15)
        return await stream.whole(request)

    return app


class _Stream:
    """One answer's events turned into text pieces (stop strings cut) and metrics; streamed or whole."""

    def __init__(self, kind: Kind, rid: str, model: str, ticket: Ticket, events: _Answer, cutter: StopCutter,
                 metrics: ServeMetrics) -> None:
        self.kind, self.rid, self.model, self.ticket = kind, rid, model, ticket
        self.events, self.cutter, self.metrics = events, cutter, metrics
        self.created = int(time.time())
        self.first_token_s: float | None = None  # seconds from admission to the first text sent
        self.finished = False  # the terminal event arrived
        self.piece = ""  # the latest step's text after the stop cut

    async def pieces(self) -> AsyncIterator[tuple[str, Step | Summary | None]]:
        """("text", Step) per step with its cut text in self.piece; then ("done", Summary) once."""
        while True:
            kind, payload = await self.events.events.get()
            if kind == "error":
                self.finished = True
                raise GenerationError(str(payload))
            if kind == "done":
                self.finished = True
                yield "done", payload
                return
            step: Step = payload
            self.metrics.step(step)
            self.piece = self.cutter.feed(step.text)
            if self.cutter.stopped:
                self.ticket.cancel.set()  # the engine ends after this step; its summary follows
            if self.piece and self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.ticket.submitted
            yield "text", step

    def finish_reason(self, summary: Summary) -> str:
        return "stop" if self.cutter.stopped else wire.FINISH[summary.stop_reason]

    def record(self, summary: Summary, finish: str) -> None:
        started = self.ticket.started or self.ticket.submitted
        self.metrics.finished(summary, finish, queued_s=started - self.ticket.submitted, ttft_s=self.first_token_s,
                              e2e_s=time.perf_counter() - self.ticket.submitted)

    def left(self) -> None:
        """The client went away: stop its generation (between two steps)."""
        if not self.finished:
            self.ticket.cancel.set()
            self.metrics.cancelled.inc()
            log.info("client left: generation %d cancelled", self.ticket.request.request_id)

    async def sse(self, include_usage: bool) -> AsyncIterator[dict[str, str]]:
        def data(obj: dict[str, Any]) -> dict[str, str]:
            return {"data": json.dumps(obj, ensure_ascii=False)}

        try:
            if self.kind == "chat":
                yield data(wire.chunk("chat", self.rid, self.model, self.created, "", role=True))
            async for kind, payload in self.pieces():
                if kind == "text":
                    yield data(wire.chunk(self.kind, self.rid, self.model, self.created, self.piece,
                                          extra={"specdec": wire.step_tokens(payload)}))
                    continue
                summary: Summary = payload
                tail = self.cutter.flush()
                if tail:
                    yield data(wire.chunk(self.kind, self.rid, self.model, self.created, tail))
                finish = self.finish_reason(summary)
                self.record(summary, finish)
                tokens = summary.new_tokens
                yield data(wire.chunk(self.kind, self.rid, self.model, self.created, None, finish,
                                      extra={"timings": wire.timings(summary), "specdec": wire.speculative(summary),
                                             **({} if include_usage else
                                                {"usage": wire.usage(summary.prompt_tokens, tokens)})}))
                if include_usage:
                    yield data({"id": self.rid, "object": "chat.completion.chunk" if self.kind == "chat" else
                                "text_completion",
                                "created": self.created, "model": self.model, "choices": [],
                                "usage": wire.usage(summary.prompt_tokens, tokens)})
            yield {"data": "[DONE]"}
        except GenerationError as e:
            yield data(wire.ApiError(500, str(e), type_="server_error").body())
            yield {"data": "[DONE]"}
        finally:  # also when the client disconnects: sse-starlette cancels this generator
            self.left()

    async def whole(self, request: Request) -> Response:
        watch = asyncio.create_task(self._watch(request))
        text = []
        try:
            async for kind, payload in self.pieces():
                if kind == "text":
                    text.append(self.piece)
                    continue
                summary: Summary = payload
                text.append(self.cutter.flush())
                finish = self.finish_reason(summary)
                self.record(summary, finish)
                return JSONResponse(wire.full(self.kind, self.rid, self.model, "".join(text), finish,
                                              summary.prompt_tokens, summary.new_tokens, summary))
        except GenerationError as e:
            return JSONResponse(wire.ApiError(500, str(e), type_="server_error").body(), status_code=500)
        finally:
            watch.cancel()
            self.left()
        raise AssertionError("pieces() ends with a summary or an error")

    async def _watch(self, request: Request) -> None:
        while not self.finished:
            if await request.is_disconnected():
                self.left()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)
