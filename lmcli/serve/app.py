"""The web side: a Starlette app whose endpoints hand requests to the ``Scheduler``.

Endpoints: ``GET /`` (the chat page), ``GET /health``, ``GET /v1/models``, ``POST
/v1/completions``, ``POST /v1/chat/completions``. Every error is an OpenAI-style JSON body
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx/5xx status; a bug in a handler
still answers (500, one line), it never drops the connection.

The scheduler runs in its own thread and calls a request's ``deliver`` with each step's events;
``deliver`` moves them onto the event loop (``call_soon_threadsafe``) into the request's queue,
which the handler reads: all at once (a JSON response) or as server-sent events.

The event loop only moves bytes: a request's JSON is parsed, its chat template rendered (by the
``Renderer``'s worker processes) and its prompt tokenized in a thread of ``Api.pool``, so a
large or hostile request never holds ``/health`` or another request. A POST must say its body
is JSON (``Content-Type: application/json``): a web page can send a form or plain text to any
address without asking, but not JSON. The bodies being read hold at most ``body_budget``
bytes together; beyond it a request gets 503 ``overloaded``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lmcli.config.commands import ServeConfig
from lmcli.serve import protocol
from lmcli.serve.protocol import ApiError, Choices, Model
from lmcli.serve.scheduler import Done, Event, Failed, QueueFull, Scheduler, Update
from lmcli.text.chat_template import Renderer

OPEN_PATHS = ("/", "/health")  # the page is static and holds nothing; its API calls need the key
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
DRAIN_FACTOR = 16  # an oversized body is read (and dropped) up to this many times the limit
BODY_BUDGET = 64 << 20  # bytes of request bodies held at once (or 8 bodies of --max-body, if more)
PARSERS = 4  # threads that parse, render and tokenize requests
JSON_TYPES = ("application/json",)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ApiKey:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every path but ``OPEN_PATHS``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = ApiError(
                    401,
                    "missing or wrong API key (Authorization: Bearer KEY)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CatchAll:
    """ASGI middleware: an exception a handler did not expect still gets a JSON 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started or scope["type"] != "http":
                raise
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
            await error_response(err)(scope, receive, send)


class Api:
    """The endpoints, bound to one model, one scheduler and the server's limits."""

    def __init__(self, model: Model, scheduler: Scheduler, cfg: ServeConfig) -> None:
        self.model, self.scheduler, self.cfg = model, scheduler, cfg
        self.page = resources.files("lmcli.serve").joinpath("page.html").read_text(encoding="utf-8")
        self.renderer = Renderer(workers=2) if model.template is not None else None
        self.pool = ThreadPoolExecutor(PARSERS, thread_name_prefix="lmcli-parse")
        self.body_budget = max(BODY_BUDGET, 8 * cfg.max_body)
        self.buffered = 0  # bytes of the bodies being read now
        self.closing = False

    def close(self) -> None:
        """The server stops: no more templates are rendered (a render in progress ends)."""
        self.closing = True
        if self.renderer is not None:
            self.renderer.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def index(self, request: HttpRequest) -> Response:
        return HTMLResponse(self.page, headers={"Cache-Control": "no-store"})

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "model": self.model.name, **self.scheduler.stats()})

    async def models(self, request: HttpRequest) -> Response:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": self.model.created,
            "owned_by": "lmcli",
            "context_length": self.model.block_size,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate("completion", request)

    async def chat(self, request: HttpRequest) -> Response:
        return await self._generate("chat", request)

    async def _body(self, request: HttpRequest) -> bytes:
        """The body: JSON by its content type (415 else), within ``max_body`` bytes (413 beyond,
        after reading it away) and the server's ``body_budget`` (503 beyond)."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media not in JSON_TYPES and not media.endswith("+json"):
            raise ApiError(
                415,
                "send the body as JSON, with Content-Type: application/json",
                code="unsupported_media_type",
            )
        limit = self.cfg.max_body
        declared = request.headers.get("content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > limit
        chunks, size, held = [], 0, 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    too_big = True
                if size > limit * DRAIN_FACTOR:
                    break
                if not too_big:
                    if self.buffered + len(chunk) > self.body_budget:
                        raise ApiError(
                            503,
                            "the server holds too many request bodies; retry shortly",
                            type="server_error",
                            code="overloaded",
                            headers={"Retry-After": "1"},
                        )
                    chunks.append(chunk)
                    held += len(chunk)
                    self.buffered += len(chunk)
        finally:
            self.buffered -= held
        if too_big:
            raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        return b"".join(chunks)

    def _parse(self, kind: str, data: bytes) -> protocol.Request:
        """The request in ``data`` (JSON) parsed, rendered and tokenized: the work of a thread."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise ApiError(400, f"the body is not valid JSON: {reason}", code="invalid_json") from None
        return protocol.parse(
            kind,
            body,
            self.model,
            max_tokens=self.cfg.max_tokens,
            max_batch=self.cfg.max_batch,
            timeout=self.cfg.timeout,
            renderer=self.renderer,
        )

    async def _generate(self, kind: str, request: HttpRequest) -> Response:
        try:
            data = await self._body(request)
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(self.pool, self._parse, kind, data)
            queue: asyncio.Queue[list[Event]] = asyncio.Queue()

            def deliver(events: list[Event]) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, events)

            try:
                handle = self.scheduler.submit(req.job, deliver)
            except QueueFull as exc:
                raise ApiError(
                    503,
                    f"the server is busy ({exc}); retry shortly",
                    type="server_error",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                ) from None
        except ApiError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=499)  # the client left (or was closed: too slow)
        except RuntimeError:  # the parse pool shut down: the server is stopping
            return error_response(ApiError(503, "the server is shutting down", type="server_error"))
        choices = Choices(req, self.model.tokenizer)
        if req.stream:
            return StreamingResponse(
                self._stream(req, choices, queue, handle),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._whole(request, choices, queue, handle)

    async def _whole(
        self, request: HttpRequest, choices: Choices, queue: asyncio.Queue, handle: Any
    ) -> Response:
        """Wait for the end of the request (or of the client) and answer with one JSON body."""
        gone = asyncio.create_task(_disconnected(request))
        try:
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    handle.cancel()
                    return Response(status_code=499)  # nobody is there to read it
                for event in getter.result():
                    if isinstance(event, Update):
                        choices.add(event)
                    elif isinstance(event, Done):
                        return JSONResponse(
                            choices.response(
                                self.model.name,
                                protocol.usage(
                                    event.prompt_tokens, event.completion_tokens, event.cached_tokens
                                ),
                            )
                        )
                    elif isinstance(event, Failed):
                        return error_response(_failure(event))
        except asyncio.CancelledError:
            handle.cancel()
            raise
        finally:
            gone.cancel()

    async def _stream(
        self, req: protocol.Request, choices: Choices, queue: asyncio.Queue, handle: Any
    ) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per update (updates waiting together are merged), then
        an optional usage chunk, then ``data: [DONE]``. A client that leaves cancels the request."""
        name = self.model.name
        try:
            if req.echo:
                for i in range(choices.count):
                    yield _sse(choices.chunk(name, echo_index=i))
            while True:
                events = await queue.get()
                while not queue.empty():  # the client fell behind: send what waits in one go
                    events += queue.get_nowait()
                merged = _merge([e for e in events if isinstance(e, Update)])
                out = []
                for u in merged:
                    choices.add(u)
                    out.append(_sse(choices.chunk(name, u)))
                end = next((e for e in events if not isinstance(e, Update)), None)
                if isinstance(end, Failed):
                    out.append(_sse(_failure(end).body()))
                elif isinstance(end, Done) and req.include_usage:
                    out.append(
                        _sse(
                            choices.usage_chunk(
                                name,
                                protocol.usage(end.prompt_tokens, end.completion_tokens, end.cached_tokens),
                            )
                        )
                    )
                if end is not None:
                    out.append(b"data: [DONE]\n\n")
                if out:
                    yield b"".join(out)
                if end is not None:
                    return
        finally:
            if not handle.ended:
                handle.cancel()


def _merge(updates: list[Update]) -> list[Update]:
    """Consecutive updates of one choice joined into one (text and log-probs appended)."""
    out: dict[int, Update] = {}
    texts: dict[int, list[str]] = {}
    for u in updates:
        m = out.get(u.index)
        if m is None:
            out[u.index] = Update(u.index, "", list(u.logprobs), u.finish_reason)
            texts[u.index] = [u.text]
        else:
            texts[u.index].append(u.text)
            m.logprobs += u.logprobs
            m.finish_reason = u.finish_reason or m.finish_reason
    for i, m in out.items():
        m.text = "".join(texts[i])
    return list(out.values())


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def _failure(f: Failed) -> ApiError:
    if f.kind == "timeout":
        return ApiError(504, f.message, type="timeout_error", code="timeout")
    if f.kind == "shutdown":
        return ApiError(503, f.message, type="server_error", code="shutting_down")
    return ApiError(500, f.message, type="server_error")


async def _disconnected(request: HttpRequest) -> None:
    """Return once the client has gone (the body has been read: only a disconnect can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    message = "no such endpoint" if status == 404 else f"{request.method} is not allowed here"
    return error_response(ApiError(status, f"{message}: {request.method} {request.url.path}"))


def create_app(model: Model, scheduler: Scheduler, cfg: ServeConfig) -> Starlette:
    """The ASGI app (the scheduler must be started by the caller)."""
    api = Api(model, scheduler, cfg)
    routes = [
        Route("/", api.index, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
    ]
    middleware = [Middleware(CatchAll)]
    if cfg.host in LOOPBACK:  # only loopback names: a page elsewhere cannot rebind a DNS name to us
        middleware.append(
            Middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "[::1]", "::1"])
        )
    if cfg.api_key:
        middleware.append(Middleware(ApiKey, key=cfg.api_key))
    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers={404: _not_found, 405: _not_found}
    )
    app.state.api = api  # the server closes it when it stops
    return app
