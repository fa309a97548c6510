"""OpenAI-compatible HTTP server over the AsyncEngine (FastAPI).

/v1/completions, /v1/chat/completions (tokenizer chat template), SSE streaming, usage with
prompt_tokens_details.cached_tokens (only prompt tokens whose KV was not computed for the request)
and its split in the extension ``prompt_tokens_details.tierkv`` (with ``pages``: each prompt page's
cache outcome, when a plug-in judged them), /v1/models, /health, /metrics. Errors are OpenAI-shaped
400s; a client that disconnects has its request aborted so its pages are freed.

Tenants (engine/tenancy.py): with ``api_keys`` every /v1/* call (every path but /health and
/metrics) needs ``Authorization: Bearer KEY`` (401 without a valid one) and runs in its key's tenant; else in
``tenant`` (the engine's one tenant, or none). The body's ``cache_salt`` only sub-divides that
tenant's namespace, so no request reaches another tenant's radix tree or daemon keys.

One client cannot stall the others (engine/limits.py): every bounded input is checked before any
work; prompts are tokenised (and chat templates rendered) on a small thread pool, never on the event
loop that answers /health; and past ``max_num_seqs + max_waiting`` requests in flight a completion
request is answered 429 (503 once the engine loop died) with ``Retry-After`` before its body is read.
A response that starts before its request's body was read closes the connection (``_CloseUnread``):
the server never reads a refused body to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import limits
from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError, InvalidRequestError, OverloadedError
from engine.hooks import DocumentPrompts
from engine.prompts import PromptBuilder
from engine.protocol import ChatRequest, CompletionRequest
from engine.request import HookState, RequestOutput
from engine.sampling import SamplingParams
from engine.tenancy import MISSING_KEY, OPEN_PATHS, ApiKeys, body_salt_error, scoped_salt

CHAT_DEFAULT_MAX = 1024
#: the most one request body may be: a larger one is answered 413 before it is read (Content-Length)
#: or as soon as it passes the bound (chunked), so no client makes the server hold or parse more.
#: The bound itself follows the model's context (engine/limits.py ``body_bytes_limit``).
MAX_BODY_BYTES = limits.MAX_BODY_BYTES
TOKENIZER_THREADS = 2  # prompts tokenised at once, off the event loop
RETRY_AFTER = {"Retry-After": "1"}  # on a 429 or 503: seconds
LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # the requests counted in flight
T = TypeVar("T")


def _error(status: int, message: str, etype: str = "invalid_request_error", param: str | None = None,
           headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": etype, "param": param, "code": None}})


class _ApiKeys:
    """ASGI middleware: every path but ``OPEN_PATHS`` (deny by default: /v1/*, and FastAPI's /docs
    too) needs ``Authorization: Bearer KEY`` of a known key, else 401 before anything else; the key's
    tenant goes into the request's state (``request.state.tenant``). Plain ASGI, not
    ``@app.middleware``: that one runs each request, and each streamed chunk, through extra tasks and
    queues on the event loop that also serves everyone else."""

    def __init__(self, app: ASGIApp, api_keys: ApiKeys) -> None:
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)
        found = self.api_keys.tenant(auth.decode("latin-1") if auth is not None else None)
        if found is None:
            resp = _error(401, MISSING_KEY,
                          etype="authentication_error", headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = found
        await self.app(scope, receive, send)


class _InFlightLimit:
    """ASGI middleware: a completion request holds a place among those in flight (``limits.InFlight``)
    from its first byte until its response has ended, streamed or not, or its client went away. Past
    the cap it is answered 429 at once, its body unread; past its tenant's share it waits at the door
    for one of its tenant's places (``limits.InFlight.admit``), 429 after ``door_wait_s``; once the
    engine loop died, 503."""

    def __init__(self, app: ASGIApp, aengine: AsyncEngine, in_flight: limits.InFlight, door_wait_s: float) -> None:
        self.app, self.aengine, self.in_flight, self.door_wait_s = app, aengine, in_flight, door_wait_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LIMITED_PATHS:
            return await self.app(scope, receive, send)
        try:
            if self.aengine.dead is not None:
                raise EngineDeadError(f"engine loop died: {self.aengine.dead!r}")
            slot = await self.in_flight.admit(scope.get("state", {}).get("tenant", ""), self.door_wait_s)
        except OverloadedError as e:
            self.aengine.metrics.api_overloaded.inc()
            return await _error(429, str(e), etype="rate_limit_error", headers=RETRY_AFTER)(scope, receive, send)
        except EngineDeadError as e:
            return await _error(503, str(e), etype="server_error", headers=RETRY_AFTER)(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            slot.release()


class _CloseUnread:
    """ASGI middleware, outside everything: a response that starts before its request's body was read
    to the end (a 413, a 401 or a 429 before the body, a handler that did not need it) says
    ``connection: close``, so the server closes the connection instead of reading the rest to find the
    next request; and a body whose Content-Length is past ``max_body`` is answered 413 here, before
    any other middleware or the routing spends time on it. Why both: the HTTP side shares one
    interpreter with the step loop, so the time it spends on refused requests is taken from decoding.
    uvicorn drained every refused body (16 MB bodies refused one after another had the engine read
    1.7 GB/s) and each refusal went through the whole stack first; bench.soak ``dos.stop_strings``
    measured a streaming client's inter-token gaps doubled."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length", b"").strip()
        if (size := limits.declared_past(declared, self.max_body)) is not None:
            resp = _error(413, limits.too_large(self.max_body, size), headers={"connection": "close"})
            return await resp(scope, receive, send)
        unread = [headers.get(b"transfer-encoding", b"").lower() == b"chunked" or declared not in (b"", b"0")]

        async def tracked() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                unread[0] = False
            return message

        async def closing(message: Any) -> None:
            if message["type"] == "http.response.start" and unread[0]:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked, closing)


class _App(FastAPI):
    """FastAPI with ``_CloseUnread`` outside everything, FastAPI's own body limit (chunked bodies'
    413) included."""

    def build_middleware_stack(self) -> ASGIApp:
        assert self.max_body_size is not None
        return _CloseUnread(super().build_middleware_stack(), self.max_body_size)


def _usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage, plus ``prompt_tokens_details.tierkv``: where each prompt token's KV came from
    (``cached`` parts sum to ``cached_tokens``, ``cached`` + ``computed`` to ``prompt_tokens``)."""
    details: dict[str, Any] = {"cached_tokens": out.cached_tokens}
    u = out.usage
    if u is not None:
        details["tierkv"] = {"cached": u.cached_by_source(), "computed": u.computed_by_source(),
                             "daemon_tier": u.loaded_tier}
        if u.pages:  # why each prompt page hit or missed, as the plug-in that judged them says
            details["tierkv"]["pages"] = {
                "page_size": u.page_size, "total": sum(p.pages for p in u.pages),
                "outcomes": [{"reason": p.reason, "tier": p.tier, "pages": p.pages} for p in u.pages]}
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens, "prompt_tokens_details": details}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _sse_response(gen: AsyncIterator[RequestOutput], head: list[dict[str, Any]],
                  chunks: Callable[[RequestOutput], list[dict[str, Any]]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            for h in head:
                yield _sse(h)
            async for out in gen:
                for c in chunks(out):
                    yield _sse(c)
            yield "data: [DONE]\n\n"
        finally:  # done, or the client went away: closing the generator aborts an unfinished request
            await gen.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(aengine: AsyncEngine, model_name: str, documents: DocumentPrompts | None = None,
               max_body_bytes: int | None = None, api_keys: ApiKeys | None = None, tenant: str = "",
               door_wait_s: float = limits.DOOR_WAIT_S) -> FastAPI:
    """documents: the request builders of the plug-in that serves `documents` and `blend_separator`
    requests (kvengine serve's: CacheBlend); None refuses them. ``api_keys`` / ``tenant``: whose
    namespace each request runs in (module notes). ``door_wait_s``: how long a request of a tenant at
    its share of the places in flight waits for one (engine/limits.py ``InFlight.admit``)."""
    if api_keys is not None and tenant:
        raise ValueError("a server with API keys takes each request's tenant from its key, not a fixed tenant")
    eng = aengine.engine
    cfg = eng.cfg
    prompts = PromptBuilder(eng.tokenizer, cfg, eng.max_model_len, model_name, documents)
    pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    body_bound = max_body_bytes if max_body_bytes is not None else limits.body_bytes_limit(cfg, eng.max_model_len)
    app = _App(title="tierkv engine", max_body_size=body_bound, lifespan=lifespan)
    in_flight = limits.InFlight(cfg.max_num_seqs + cfg.max_waiting, aengine.metrics.api_in_flight.set,
                                per_tenant=limits.tenant_in_flight(cfg, api_keys is not None))  # fmt: skip
    app.add_middleware(_InFlightLimit, aengine=aengine, in_flight=in_flight,  # type: ignore[arg-type]
                       door_wait_s=door_wait_s)
    if api_keys is not None:  # outside the in-flight limit: a request's share is its key's tenant's
        app.add_middleware(_ApiKeys, api_keys=api_keys)  # type: ignore[arg-type]
    created = int(time.time())

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (a chunked body past the limit, an unknown path or method) in the
        same OpenAI-style body as every other error, not FastAPI's ``{"detail": ...}``."""
        message = limits.too_large(body_bound) if exc.status_code == 413 else str(exc.detail)
        return _error(exc.status_code, message, etype="server_error" if exc.status_code >= 500 else
                      "invalid_request_error", headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"invalid request: {first.get('msg', 'malformed body')}", param=param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), param=exc.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), etype="server_error", headers=RETRY_AFTER)

    def _salt(http: Request, body_salt: str | None) -> str | None:
        """The request's scope: its tenant's (its key's, else the server's), sub-divided by the body's salt."""
        if (why := body_salt_error(body_salt)) is not None:
            raise InvalidRequestError(why, "cache_salt")
        return scoped_salt(getattr(http.state, "tenant", tenant), body_salt)

    @app.get("/health")
    async def health() -> Any:
        if aengine.dead is not None:
            return _error(503, "engine loop died", etype="server_error", headers=RETRY_AFTER)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(aengine.metrics.render().decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tierkv", "max_model_len": eng.max_model_len}]}

    def _check(body: CompletionRequest | ChatRequest) -> None:
        """What costs nothing to check, before any work (engine/limits.py)."""
        if body.model not in (None, "", model_name):
            raise InvalidRequestError(f"model {body.model!r} is not served here (serving {model_name!r})", "model")
        limits.check_salt(cfg, body.cache_salt)
        limits.check_stop(cfg, body.stop_strings(), body.stop_token_ids or ())

    async def _off_loop(fn: Callable[[], T]) -> T:
        """Tokenising a long prompt takes ~1 s per MiB: on the pool, so the event loop keeps serving."""
        aengine.metrics.api_tokenizing.inc()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        finally:
            aengine.metrics.api_tokenizing.dec()

    async def _collect(http: Request, gen: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput]:
        """Consume a request to the end, aborting it if the client goes away meanwhile."""
        text: list[str] = []
        last: list[RequestOutput] = []

        async def consume() -> None:
            async for out in gen:
                text.append(out.new_text)
                last[:] = [out]

        task = asyncio.create_task(consume())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await http.is_disconnected():
                task.cancel()  # the generator's finally aborts the request
                raise asyncio.CancelledError
        task.result()
        return "".join(text), last[0]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Any:
        _check(body)
        build = prompts.completion(body)
        params = body.sampling(default_max=16)
        rid = f"cmpl-{uuid.uuid4().hex}"

        def prepare() -> tuple[list[int], Mapping[str, HookState] | None]:
            ids, extras = build()
            aengine.validate(ids, params)
            return ids, extras

        ids, extras = await _off_loop(prepare)
        gen = aengine.generate(rid, ids, params, cache_salt=_salt(http, body.cache_salt), extras=extras)
        if body.stream:
            def chunks(out: RequestOutput) -> list[dict[str, Any]]:
                base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
                c = [{**base, "choices": [{"index": 0, "text": out.new_text, "finish_reason": out.finish_reason,
                                           "logprobs": None}]}]
                if out.finished and body.include_usage:
                    c.append({**base, "choices": [], "usage": _usage(out)})
                return c
            return _sse_response(gen, [], chunks)
        text, out = await _collect(http, gen)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": _usage(out)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request) -> Any:
        _check(body)
        build = prompts.chat(body)

        def prepare() -> tuple[list[int], SamplingParams, Mapping[str, HookState] | None]:
            ids, extras = build()
            room = min(eng.max_model_len, eng.scheduler.capacity_tokens()) - len(ids)
            params = body.sampling(default_max=max(1, min(CHAT_DEFAULT_MAX, room)))
            aengine.validate(ids, params)
            return ids, params, extras

        ids, params, extras = await _off_loop(prepare)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = aengine.generate(rid, ids, params, cache_salt=_salt(http, body.cache_salt), extras=extras)
        if body.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "model": model_name}
            head = [{**base, "created": int(time.time()),
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]

            def chunks(out: RequestOutput) -> list[dict[str, Any]]:
                delta = {"content": out.new_text} if out.new_text else {}
                c = [{**base, "created": int(time.time()),
                      "choices": [{"index": 0, "delta": delta, "finish_reason": out.finish_reason}]}]
                if out.finished and body.include_usage:
                    c.append({**base, "created": int(time.time()), "choices": [], "usage": _usage(out)})
                return c
            return _sse_response(gen, head, chunks)
        text, out = await _collect(http, gen)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": out.finish_reason}],
                "usage": _usage(out)}

    return app
