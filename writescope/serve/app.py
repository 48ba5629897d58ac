"""The FastAPI application: OpenAI-compatible routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent
events ending in ``data: [DONE]``, or not), ``GET /v1/models``, ``GET /health`` (503 while the
model loads, 200 when ready), ``GET /metrics`` (Prometheus text). With an API key, ``/v1/*``
needs ``Authorization: Bearer KEY`` (401 otherwise). Errors are OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad body (JSON, types, ranges, a
prompt beyond the limits, an unknown field, one of OpenAI's fields this server does not implement
at a value that would change the result: writescope/serve/protocol.py), 401, 404 for an unknown
model, 404 or 405 for a path or method that is no route (naming the routes), 503 with Retry-After
when the queue is full or the model is loading, 503 when the server stopped before the request
finished (the grace after a stop ran out: writescope/serve/server.py), 500 when the engine failed
on the request. A stream already started ends with an error event of that shape, then ``[DONE]``.

Sampling fields: OpenAI's ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``,
``top_p``, ``seed``, ``stop`` (up to 4 strings: the text ends before the first one generated,
finish_reason ``stop``; streamed text never shows a stop string's beginning before it is known not
to be one), ``n`` (1-16 independent choices, choice i sampled with seed + i; streamed chunks are
tagged with their choice's index, each choice gets its own final chunk, which carries its last
tokens with ``finish_reason``), ``logprobs`` (completions: 0-5 top tokens in the legacy shape;
chat: ``logprobs: true`` and ``top_logprobs`` 0-5; log_softmax of the raw logits, before
temperature, as vLLM gives by default: writescope/serve/logprobs.py),
completions' ``echo`` (the prompt's text before each choice's; ``max_tokens: 0`` gives the prompt
alone; not with ``logprobs``: writescope/serve/echo.py); vLLM's ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output`` and ``return_token_ids``. Each choice carries vLLM's ``stop_reason``
(the stop string or stop token id that ended it, else null). Shapes: writescope/serve/choices.py.

A client that disconnects cancels its request (all its choices): the engine frees their KV at its
next step; a choice that fails inside the engine cancels the others.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from writescope.engine.sampling import SamplingParams
from writescope.errors import ArgError, plural
from writescope.serve.async_engine import AsyncEngine, EngineDead, QueueFull
from writescope.serve.chat_template import ChatTemplate
from writescope.serve.choices import Choice, ResponseFormat, usage
from writescope.serve.echo import prompt_only, prompt_text
from writescope.serve.metrics import ServeMetrics
from writescope.serve.protocol import VALUE_WORDED, ChatCompletionRequest, CompletionRequest, json_value, plain_errors

RETRY_AFTER_S = 1  # what a 503 tells the client to wait (seconds)
log = logging.getLogger("uvicorn.error")  # the server's logger (its level is --log-level): a line per request at INFO
UNFINISHED = ("error", "abort")  # the engine's finish reasons of a request it ended unfinished: never an API finish_reason
MAX_BODY_BYTES = 16 * 2**20


@dataclass
class ServerState:
    """What the routes read. ``engine`` is None while the model loads (``load_error`` says why
    it never will)."""

    model_name: str
    api_key: str | None = None
    engine: AsyncEngine | None = None
    tokenizer: object = None
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    closing: bool = False  # the server is stopping (Ctrl-C, SIGTERM): a model that finishes loading is not served
    stopped: str | None = None  # set by stop(): why the requests still running are failed
    failed_at_stop: int = 0  # requests failed so (503), as their routes answered

    def ready(self, engine: AsyncEngine, tokenizer, chat_template: ChatTemplate | None = None) -> None:
        """The model is loaded: start serving (the engine's thread is started here)."""
        self.tokenizer = tokenizer
        if chat_template is not None:
            self.chat_template = chat_template
        if engine.metrics is None:
            engine.metrics = self.metrics
        engine.start()
        self.engine = engine
        if self.closing:  # a stop came as the engine started (it sets closing before it reads engine): stop it too
            engine.shutdown(timeout=0)

    def stop(self, why: str) -> None:
        """The grace after a stop is over (writescope/serve/server.py): the engine stops, and the
        requests still running are failed (503, or a streamed error event; ``why`` says why, in
        their answer); a model still loading is not served. Call on the event loop."""
        self.closing = True
        self.stopped = why
        if self.engine is not None:
            self.engine.shutdown(timeout=0)  # the engine thread ends the requests (finish_reason "abort")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, refused: bool = True):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers
        self.refused = refused  # False: the engine took the request and it ended unfinished (logged by _RequestLog)


MAX_LOGGED_CHARS = 300  # a refusal's message in the log is cut here (it may quote what the body sent)


def _error(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None, *,
           route: str | None = None, metrics: ServeMetrics | None = None) -> JSONResponse:
    """The error in OpenAI's shape. ``route`` (``"POST /v1/completions"``): a refused request,
    logged at INFO as a finished one is and counted in ``metrics`` (``request_refused_total``)."""
    if route is not None:
        said = message if len(message) <= MAX_LOGGED_CHARS else message[:MAX_LOGGED_CHARS] + "..."
        log.info("%s status=%d refused%s: %s", route, status, f" param={param}" if param else "", said)
        if metrics is not None:
            metrics.refused.labels(str(status)).inc()
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status, headers=headers)


def _validation_message(exc: RequestValidationError, content_type: str | None = None) -> tuple[str, str | None]:
    """The 400's message (up to 5 errors, each at its place) and ``param``: the first error's
    field. ``content_type``: the request's header, named where the body was not read as JSON
    (FastAPI reads it as JSON only under a JSON content type: ``curl -d`` sends a form's)."""
    parts, param = [], None
    for e in plain_errors(exc.errors())[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        worded = e.get("type") in ("missing", *VALUE_WORDED)  # the message says the value (or there is none)
        got = f" (got {json_value(e['input'])})" if "input" in e and not worded and loc else ""  # as the body had it
        if not loc and isinstance(e.get("input"), bytes):  # the body as bytes: not read as JSON
            sent = f"it came as Content-Type {content_type}" if content_type else "it came without a Content-Type"
            msg += (f" (the body was not read as JSON: {sent}): send the header 'Content-Type: application/json' "
                    "(curl: -H 'Content-Type: application/json', or --json)")
        parts.append(f"{where}: {msg}{got}")
    return "; ".join(parts), param


def _route(request: Request) -> str:
    return f"{request.method} {request.url.path}"


def _no_route(app: FastAPI, request: Request, exc: HTTPException, metrics: ServeMetrics | None = None) -> JSONResponse:
    """Starlette's own errors (404: no such path, 405: not that method) in OpenAI's shape, naming
    what exists; any other keeps its detail."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        msg = f"no route {method} {path}: " + (f"{' or '.join(allowed.split(', '))} it" if allowed else "no method is allowed")
    elif exc.status_code == 404:
        routes = sorted((r for r in app.routes if isinstance(r, APIRoute)), key=lambda r: not r.path.startswith("/v1"))
        named = ", ".join(f"{' or '.join(sorted(r.methods))} {r.path}" for r in routes)
        msg = f"unknown path {path}; the API: {named}"
    else:
        msg = str(exc.detail)
    api = request.url.path.startswith("/v1")  # a browser's /favicon.ico is no refused request
    return _error(exc.status_code, msg, "invalid_request_error", headers=exc.headers, route=_route(request) if api else None,
                  metrics=metrics)


def build_app(state: ServerState, on_shutdown=None) -> FastAPI:
    """The application over ``state`` (its engine may be set later, by :meth:`ServerState.ready`).
    ``on_shutdown``: called after the engine is shut down (the lifespan's end)."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        if state.engine is not None:  # the requests have ended (finished, or failed when the grace ran out: server.py)
            await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="writescope", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ws = state

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        msg, param = _validation_message(exc, request.headers.get("content-type"))
        return _error(400, msg, "invalid_request_error", param, route=_route(request), metrics=state.metrics)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        return _no_route(app, request, exc, state.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        route = _route(request) if exc.refused else None  # an engine failure is logged by _RequestLog, not as a refusal
        return _error(exc.status, exc.message, exc.type, exc.param, exc.headers, route=route, metrics=state.metrics)

    app.add_middleware(_Guard, state=state)

    @app.get("/health")
    async def health():
        if state.engine is None:
            why = state.load_error or "the model is loading"
            return JSONResponse({"status": "error" if state.load_error else "loading", "detail": why}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        if not state.engine.snapshot()["alive"]:
            return JSONResponse({"status": "error", "detail": state.engine.error or "the engine stopped"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "writescope"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.max_model_len
        return {"object": "list", "data": [card]}

    def _engine() -> AsyncEngine:
        if state.engine is None:
            raise APIError(503, state.load_error or "the model is loading: try again shortly", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        return state.engine

    def _params(body, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
                              seed=body.seed, ignore_eos=body.ignore_eos, stop_token_ids=tuple(body.stop_token_ids),
                              stop=body.stop_strings, logprobs=body.top_logprobs_count, n=body.n,
                              include_stop_str_in_output=body.include_stop_str_in_output)

    def _check_model(body) -> None:
        if body.model != state.model_name:
            raise APIError(404, f"model {body.model!r} is not served here: this server serves {state.model_name!r} "
                                "(GET /v1/models)", "invalid_request_error", "model")

    @contextmanager
    def _api_errors(engine: AsyncEngine, ids: list[int], prompt_field: str):
        """The engine's refusals as the API's errors, named with the body's fields."""
        try:
            yield
        except ArgError as e:
            param = e.names[0] if e.names else None
            raise APIError(400, e.worded({name: name for name in e.names}, requests=False), "invalid_request_error", param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except QueueFull as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDead as e:
            raise APIError(503, str(e), "service_unavailable") from None

    def _checked(engine: AsyncEngine, ids: list[int], max_tokens: int | None, body, prompt_field: str) -> SamplingParams | None:
        """The request's sampling parameters, the request checked as the engine would check it
        (in a worker thread: a long prompt's check takes time); None for ``echo`` alone
        (``max_tokens`` 0: nothing for the engine to do)."""
        limit, what = engine.max_model_len, ("the messages come to {} with the chat template" if prompt_field == "messages"
                                             else "the prompt has {}").format(plural(len(ids), "token"))
        if max_tokens == 0:  # echo alone: the prompt may take the whole context
            if len(ids) > limit:
                raise APIError(400, f"{what}, beyond this server's max_model_len of {plural(limit, 'token')}: shorten the prompt "
                                    f"to at most {limit:,} tokens", "invalid_request_error", prompt_field)
        elif len(ids) >= limit:  # no room to generate: said without a max_tokens the body may not have sent
            raise APIError(400, f"{what}, and this server's max_model_len is {plural(limit, 'token')}: nothing is left to "
                                f"generate; shorten the prompt to at most {limit - 1:,} tokens", "invalid_request_error", prompt_field)
        elif max_tokens is None:  # chat without a limit: the rest of the context
            max_tokens = limit - len(ids)
        elif len(ids) + max_tokens > limit:  # named as the body sent it (chat: max_completion_tokens or max_tokens)
            sent = _limit_sent(body)
            name = sent or "max_tokens"
            default = "" if sent else " (the default, max_tokens not sent)"
            raise APIError(400, f"{what} + {name} {max_tokens:,}{default} = {len(ids) + max_tokens:,}, beyond this server's "
                                f"max_model_len of {plural(limit, 'token')}: shorten the prompt or {'lower' if sent else 'send'} "
                                f"{name} to at most {limit - len(ids):,}", "invalid_request_error", name)
        with _api_errors(engine, ids, prompt_field):
            if max_tokens == 0:  # echo alone (the protocol allows 0 with echo only)
                engine.core.check(ids, 0)
                return None
            params = _params(body, max_tokens)
            engine.check(ids, params)
            return params

    def _limit_sent(body) -> str | None:
        """The name of the token limit the body sent (chat's newer ``max_completion_tokens`` first), or None."""
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(body, name, None) is not None and name in body.model_fields_set:
                return name
        return None

    def _submit(engine: AsyncEngine, ids: list[int], params: SamplingParams | None, body, prompt_field: str):
        """On the event loop, after :func:`_checked` (in a worker thread) passed."""
        with _api_errors(engine, ids, prompt_field):
            if params is None:
                return prompt_only(engine, ids, body.n, checked=True)
            return engine.submit(ids, params, checked=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        engine = _engine()
        _check_model(body)

        def prepare():  # off the event loop: tokenizing and checking a long prompt takes seconds
            ids = state.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
            params = _checked(engine, ids, body.max_tokens, body, "prompt")
            return ids, params, prompt_text(body.prompt, ids, state.tokenizer) if body.echo else None

        ids, params, echo = await asyncio.to_thread(prepare)
        stream = _submit(engine, ids, params, body, "prompt")
        return await _respond(request, engine, stream, body, False, t0, len(ids), echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        t0 = time.perf_counter()
        engine = _engine()
        _check_model(body)

        def prepare():  # off the event loop, as completions'
            try:
                text = state.chat_template.render([{"role": m.role, "content": m.text()} for m in body.messages])
            except ValueError as e:
                raise APIError(400, str(e), "invalid_request_error", "messages") from None
            ids = state.tokenizer.encode(text)
            return ids, _checked(engine, ids, body.max_new, body, "messages")

        ids, params = await asyncio.to_thread(prepare)
        stream = _submit(engine, ids, params, body, "messages")
        return await _respond(request, engine, stream, body, True, t0, len(ids))

    async def _respond(request: Request, engine: AsyncEngine, stream, body, chat: bool, t0: float, prompt_tokens: int,
                       echo: str | None = None):
        """The answer, whole or streamed; ``t0``: when the route began (``time.perf_counter()``)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        fmt = ResponseFormat(chat, rid, int(time.time()), state.model_name, state.tokenizer, body.return_token_ids,
                             body.top_logprobs_count is not None, echo)
        done = _RequestLog(rid, t0, stream, prompt_tokens)
        if body.stream:
            gen = _sse(engine, stream, body, fmt, done)
            return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = [Choice(i, state.tokenizer, streaming=False) for i in range(stream.n)]
        status = 499  # unless it ends otherwise: the client went away (or the route was cancelled)
        try:
            failed = await _collect(request, engine, stream, choices)
            if failed is _GONE:  # disconnected: nobody reads this
                return Response(status_code=499)
            if failed is not None:
                e = _failure(failed)
                status = e.status
                raise e
            status = 200
            return fmt.response(choices)
        finally:
            done(choices, status)

    def _failure(out) -> APIError:
        """The answer to a request the engine ended unfinished: finish_reason "error" (it failed
        inside the engine: 500) or "abort" (the engine's, not the API's: the engine stopped it; the
        routes' own cancels come when nobody reads): the server stopped and its grace ran out
        (503), or the engine thread failed (500)."""
        engine_error = state.engine.error if state.engine is not None else None
        if out.finish_reason == "error" or engine_error is not None:
            return APIError(500, f"the request failed inside the engine: {out.error or engine_error}", "server_error", refused=False)
        state.failed_at_stop += 1
        why = state.stopped or "the engine was shut down"
        return APIError(503, f"the server is shutting down: the request was cancelled before it finished ({why}): "
                             "send it again once the server is back", "service_unavailable", refused=False)

    async def _collect(request: Request, engine: AsyncEngine, stream, choices: list[Choice]):
        """Adds the outputs to ``choices`` until: all finished (returns None); one failed or was
        aborted by the engine (returns its output; the others are cancelled); the client went away
        (returns ``_GONE``)."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(stream.queue.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    engine.cancel(stream)
                    return _GONE
                index, out = get.result()
                choices[index].add([out])
                if out.finish_reason in UNFINISHED:
                    engine.cancel(stream)
                    return out
                if stream.seen(out):
                    return None
        except asyncio.CancelledError:
            engine.cancel(stream)
            raise
        finally:
            gone.cancel()

    async def _sse(engine: AsyncEngine, stream, body, fmt: ResponseFormat, done: _RequestLog):
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        choices = [Choice(i, state.tokenizer, streaming=True) for i in range(stream.n)]
        complete = False
        status = 499  # unless it ends otherwise: the client went away
        try:
            for event in fmt.opening(choices):  # chat's roles, or the echoed prompt
                yield event
            failed = None
            while failed is None and not complete:
                per_choice: dict[int, list] = {}
                for index, out in await stream.queued():  # a slow reader gets fewer, larger chunks
                    per_choice.setdefault(index, []).append(out)
                    complete = stream.seen(out) or complete
                for index, outs in per_choice.items():
                    if outs[-1].finish_reason in UNFINISHED:
                        failed = outs[-1]
                        choices[index].add(outs)  # for the log line's counts
                        break
                    c = choices[index]
                    delta = c.add(outs)
                    if c.finished:  # its last tokens go with finish_reason: their text may be empty (a stop string's end)
                        yield fmt.chunk(c, delta, finish=c.last.finish_reason)  # usage: once, in its own last event, if asked
                    elif fmt.worth_sending(delta):
                        yield fmt.chunk(c, delta)
            if failed is not None:
                engine.cancel(stream)  # the other choices, at once (before writing to a client that may be slow)
                complete = True  # nothing left to cancel
                e = _failure(failed)
                status = e.status
                err = {"message": e.message, "type": e.type, "param": e.param, "code": e.status}
                yield f"data: {json.dumps({'error': err})}\n\n"
            elif include_usage:
                yield fmt.usage_chunk(usage(choices))
            if failed is None:
                status = 200
            yield "data: [DONE]\n\n"
        finally:
            if not complete:  # the client went away (the generator was closed or cancelled)
                engine.cancel(stream)
            done(choices, status)

    return app


_GONE = object()  # _collect's answer when the client went away


class _RequestLog:
    """The INFO line of one request as it ends: its id, HTTP status (a stream's: its error
    event's code; 499: the client went away, which the line then says in words), tokens, finish reasons (one per choice; ``-``: it
    did not finish), the time to its first token and in all (from when its route began, the
    prompt's tokenizing included)."""

    def __init__(self, rid: str, t0: float, stream, prompt_tokens: int):
        self.rid, self.t0, self.stream, self.prompt_tokens = rid, t0, stream, prompt_tokens

    def __call__(self, choices: list[Choice], status: int) -> None:
        total_ms = (time.perf_counter() - self.t0) * 1e3
        firsts = [c.ttft_s for c in choices if c.ttft_s is not None]  # the engine's, from the request's arrival
        ttft = f"{(self.stream.arrival + min(firsts) - self.t0) * 1e3:.1f}" if firsts else "-"
        reasons = ",".join(c.last.finish_reason if c.last is not None else "-" for c in choices)
        log.info("%s status=%d prompt_tokens=%d completion_tokens=%d finish_reason=%s ttft_ms=%s total_ms=%.1f%s", self.rid,
                 status, self.prompt_tokens, sum(len(c.ids) for c in choices), reasons, ttft, total_ms,
                 " (the client disconnected: cancelled)" if status == 499 else "")


class _Guard:
    """Pure ASGI middleware (streams and disconnects pass through untouched): the API key and the
    body size of ``/v1/*`` requests."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refusal, route = None, f"{scope.get('method', '-')} {scope['path']}"
            if self.state.api_key is not None:
                scheme, _, key = headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.state.api_key.encode()):
                    refusal = _error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                     "authentication_error", route=route, metrics=self.state.metrics)
            size = headers.get("content-length", "")
            if refusal is None and size.isdigit() and int(size) > MAX_BODY_BYTES:
                refusal = _error(413, f"the body has {int(size):,} bytes, above this server's limit of {MAX_BODY_BYTES:,} "
                                      f"({MAX_BODY_BYTES / 2**20:g} MiB): send a shorter prompt",
                                 "invalid_request_error", route=route, metrics=self.state.metrics)
            if refusal is None and not size.isdigit():  # a chunked body: counted as it arrives, never buffered past the limit
                receive, too_big = await _read_capped(receive)
                if too_big:
                    refusal = _error(413, f"the body has more than {MAX_BODY_BYTES:,} bytes ({MAX_BODY_BYTES / 2**20:g} MiB), "
                                          "this server's limit: send a shorter prompt", "invalid_request_error", route=route,
                                     metrics=self.state.metrics)
            if refusal is not None:
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


async def _read_capped(receive):
    """Reads a request body of unknown length (no Content-Length: chunked) up to
    :data:`MAX_BODY_BYTES`. Returns ``(receive, too_big)``: ``receive`` gives the app the body
    read, then the connection's own messages (a disconnect); ``too_big``: the body passed the
    limit (reading stopped there, the rest is not held)."""
    chunks, n, more = [], 0, True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":  # the client left
            return _replay([msg], receive), False
        chunks.append(msg.get("body", b""))
        n += len(chunks[-1])
        more = msg.get("more_body", False)
        if n > MAX_BODY_BYTES:
            return receive, True
    return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), False


def _replay(messages: list, receive):
    """An ASGI ``receive`` that gives ``messages`` first, then ``receive``'s."""
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return

