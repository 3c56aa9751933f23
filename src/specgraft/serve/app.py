"""The FastAPI app: OpenAI's endpoints on the engine thread (runner.py), metrics, the playground.

``create_app(server)`` builds the routes; they find the :class:`Server` through ``app.state.server`` (or, in a
Ray Serve replica, the process's server set by :func:`set_server`), so the same app runs under uvicorn and as a
Ray Serve ingress (ray.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine, RequestOutput
from ..errors import SpecgraftError
from ..registry import DEFAULTS, method_options
from .metrics import Metrics
from .options import ClientPolicy
from .policy import BatchBudget
from .protocol import APIError, ChatRequest, CompletionRequest, Job, to_job, validation_error
from .runner import EngineDead, QueueFull, Runner, Ticket, scrub

log = logging.getLogger("specgraft.serve")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_BODY_BYTES = 4 << 20  # a request body beyond it is refused (413) before it is parsed
API_KEY_ENV = "SPECGRAFT_API_KEY"


@dataclass
class Server:
    """What the routes need: the engine thread, metrics, the served name and the default method."""

    engine: Engine
    runner: Runner
    metrics: Metrics
    name: str
    method: str = "ar"
    options: dict = field(default_factory=dict)
    budget: int | str | None = None
    max_tokens: int = 256
    auto: dict | None = None  # how --method auto chose, for /v1/models and the playground
    replica: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")  # which process served
    policy: ClientPolicy = field(default_factory=ClientPolicy)  # what a client may choose (options.py)
    api_key: str | None = None  # clients send "Authorization: Bearer KEY" to /v1/*
    max_body_bytes: int = MAX_BODY_BYTES
    engine_policy: object = None  # the engine's own budget policy before start put the server's on it

    @classmethod
    def start(cls, engine: Engine, name: str | None = None, method: str = "ar", options: dict | None = None,
              budget=None, max_num_seqs: int = 8, max_queue: int = 128, timeout_s: float | None = 600.0,
              max_tokens: int = 256, auto: dict | None = None, warm: bool = True,
              batch_budget: bool = True, policy: ClientPolicy | None = None, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> "Server":
        """``policy``: what clients may choose (default: every servable method whose drafter builds here, the
        others left out and logged; a strict policy's methods must all build). ``api_key=None`` reads ``$SPECGRAFT_API_KEY`` ("" = none)."""
        name = name or engine.model_name
        metrics = Metrics(name)
        if warm:  # load the drafter (and resolve budget auto) now, not inside the first request
            engine.generate("Hello", method, max_new_tokens=2, budget=budget, **(options or {}))
        policy = _build_drafters(engine, method, options or {}, policy)
        engine_policy = engine.budget_policy
        if batch_budget:  # smaller trees as the batch grows (policy.py); measured on the idle engine
            engine.budget_policy = BatchBudget(engine)
        api_key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        runner = Runner(engine, metrics, max_num_seqs, max_queue, timeout_s).start()
        return cls(engine, runner, metrics, name, method, dict(options or {}), budget, max_tokens, auto,
                   policy=policy, api_key=api_key or None, max_body_bytes=max_body_bytes,
                   engine_policy=engine_policy)

    def stop(self) -> None:
        """End the engine loop, abort what is still in the engine and give the engine back as start found it (its
        own budget policy): an engine outlives its server where tools and tests start several on one engine."""
        self.runner.stop()
        if self.runner.thread.is_alive():  # still inside a step longer than stop's wait: the loop owns the engine
            return
        for r in list(self.engine.active):
            self.engine.abort(r.id)
        self.engine.step()  # aborted requests release their caches and drafters' rows here
        self.engine.budget_policy = self.engine_policy

    def speculation_test(self, job: Job):
        """For a request that named no method on a ``--method auto`` server: ``pays(batch)``, whether the budget
        policy gives its method a tree at all in a step of ``batch`` requests (else it is admitted as AR, runner.py).
        None where the request keeps its method whatever the load: an explicit ``--method``, no budget policy,
        AR already, sampling (a seeded request's text must not depend on its neighbours, as for the policy), a
        budget still to be resolved ("auto"), or budget 0 (AR's work already)."""
        budget_for = getattr(self.engine.budget_policy, "budget_for", None)  # BatchBudget's (policy.py)
        if (self.auto is None or budget_for is None or job.method == "ar" or not job.sampling.greedy
                or not isinstance(job.budget, int) or job.budget < 1):
            return None
        config = {**method_options(job.method, job.options), "method": job.method}
        return lambda batch: budget_for(config, job.budget, batch) > 0

    def tokenize(self, job: Job) -> list[int]:
        """Prompt ids, with the context-length check (in a worker thread: a 1 MB prompt takes a while)."""
        if isinstance(job.prompt, list) and all(isinstance(t, int) for t in job.prompt):
            ids = list(job.prompt)
            if any(t < 0 or t >= self.engine.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.engine.vocab_size})", param="prompt")
        else:
            try:
                ids = self.engine.encode(job.prompt, job.chat)
            except SpecgraftError as err:
                raise APIError(400, scrub(str(err)), param="messages" if job.chat else "prompt") from None
        budget = job.budget if isinstance(job.budget, int) else DEFAULTS.get(job.method, {}).get("budget", 0)
        limit = self.engine.backend.max_positions
        room = limit - len(ids) - budget - 1  # completion tokens that fit beside the prompt and the widest tree
        if job.max_tokens is None and room >= 1:  # no max_tokens: the server's default, clamped to what fits
            job.max_tokens = min(self.max_tokens, room)
        asked = job.max_tokens or self.max_tokens
        if asked > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(ids) + asked} tokens ({len(ids)} in the prompt, {asked} for "
                                f"the completion) plus {budget + 1} tree slots. Please reduce the length of the "
                                f"prompt or max_tokens.", param="messages" if job.chat else "prompt",
                           code="context_length_exceeded")
        return ids


_SERVER: Server | None = None


def set_server(server: Server) -> None:
    """The process's server (a Ray Serve replica sets it in its constructor)."""
    global _SERVER
    _SERVER = server


def get_server(request: Request) -> Server:
    server = getattr(request.app.state, "server", None) or _SERVER
    if server is None:
        raise APIError(503, "the server is starting", type="server_error")
    return server


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _build_drafters(engine: Engine, method: str, options: dict, policy: ClientPolicy | None) -> ClientPolicy:
    """Build every allowed method's drafter now, so that no request loads a model on the engine thread."""
    policy = policy or ClientPolicy()
    ok = []
    for m in dict.fromkeys((method, *policy.methods)):  # the default method first
        try:
            engine.drafter(m, **(options if m == method else {}))
            ok.append(m)
        except Exception as err:  # noqa: BLE001 -- e.g. no EAGLE head for this model
            if policy.strict or m == method:
                raise SpecgraftError(f"--methods: {m} cannot run on this model: {err}") from err
            log.info("method %s left out (its drafter does not build here: %s)", m, err)
    return ClientPolicy(tuple(ok), policy.max_budget, policy.option_keys, policy.strict)


class Guard:
    """ASGI middleware in front of every route: the API key on ``/v1/*`` (401), then the body size (413), so
    neither a stranger nor an oversized body reaches parsing or the engine."""

    def __init__(self, app, get):
        self.app, self.get = app, get  # get(): the Server (or None while starting)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv = self.get()
        if srv is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if srv.api_key and scope["path"].startswith("/v1/"):
            auth = headers.get("authorization", "")
            if not (auth.startswith("Bearer ") and secrets.compare_digest(auth[7:].encode(), srv.api_key.encode())):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                return await _error(err)(scope, receive, send)
        limit = srv.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await self._too_large(limit, scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:  # read it all here (chunked bodies declare no length), counting
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                return await self._too_large(limit, scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(limit: int, scope, receive, send):
        err = APIError(413, f"the request body exceeds this server's limit of {limit} bytes", code="body_too_large")
        return await _error(err)(scope, receive, send)


def create_app(server: Server | None = None) -> FastAPI:
    app = FastAPI(title="specgraft", description="OpenAI-compatible speculative decoding server")
    app.state.server = server
    app.add_middleware(Guard, get=lambda: app.state.server or _SERVER)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return _error(validation_error(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return _error(APIError(err.status_code, str(err.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception):
        log.exception("unhandled error")
        return _error(APIError(500, "internal server error; see the server log", type="server_error"))

    @app.get("/health")
    async def health(request: Request):
        srv = get_server(request)
        if not srv.runner.alive:
            raise APIError(503, f"engine loop stopped: {srv.runner.error}", type="server_error")
        return {"status": "ok", "running": len(srv.runner.running), "waiting": len(srv.runner.waiting)}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(generate_latest(get_server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        srv = get_server(request)
        return {"object": "list", "data": [{
            "id": srv.name, "object": "model", "created": 0, "owned_by": "specgraft",
            "max_model_len": srv.engine.backend.max_positions,
            "specgraft": {"method": srv.method, "budget": srv.budget, "options": srv.options,
                          "methods": list(srv.policy.methods),  # what clients may choose (options.py)
                          "max_budget": srv.policy.max_budget,
                          "budgets": {m: d["budget"] for m, d in DEFAULTS.items() if "budget" in d},
                          "dtype": srv.engine.dtype, "auto": srv.auto}}]}

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files("specgraft.serve").joinpath("static/playground.html").read_text())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _complete(request, body, "chat.completion")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(request, body, "text_completion")

    return app


async def _complete(request: Request, body, kind: str):
    srv = get_server(request)
    if body.model not in (None, srv.name):
        raise APIError(404, f"The model `{body.model}` does not exist (this server serves `{srv.name}`).",
                       param="model", code="model_not_found")
    job = to_job(body, srv.method, srv.options, srv.budget, srv.policy)
    ids = await run_in_threadpool(srv.tokenize, job)
    ticket = Ticket(job.engine_kwargs(), ids, asyncio.get_running_loop(), asyncio.Queue(), replica=srv.replica)
    if body.method is None:
        ticket.pays = srv.speculation_test(job)
        ticket.fallback = job.ar_kwargs() if ticket.pays is not None else None
    try:
        srv.runner.submit(ticket)
    except EngineDead:
        raise APIError(503, "the engine loop has stopped; the server must be restarted", type="server_error",
                       code="engine_stopped") from None
    except QueueFull:
        wait = srv.runner.retry_after_s()
        raise APIError(429, f"the server is at capacity ({srv.runner.max_num_seqs} running, {srv.runner.max_queue} "
                            f"waiting); retry in about {wait} s", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(wait)}) from None
    head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()), "model": srv.name}
    headers = {"X-Specgraft-Verify": job.verify, "X-Specgraft-Method": job.method, "X-Specgraft-Replica": srv.replica}
    if job.stream:
        return StreamingResponse(_stream(srv, ticket, job, kind, head), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    text, tokens, final = [], [], None
    try:
        while final is None:
            try:
                item = await asyncio.wait_for(ticket.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    srv.runner.cancel(ticket)
                    return Response(status_code=499)
                continue
            _raise_if_error(item, ticket)
            text.append(item.text)
            tokens.extend(item.token_ids)
            final = item if item.finished else None
    except BaseException:
        srv.runner.cancel(ticket)
        raise
    result = final.result
    choice = {"index": 0, "logprobs": None, "finish_reason": FINISH[result.finish_reason]}
    if kind == "chat.completion":
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = "".join(text)
    if job.return_token_ids:
        choice["token_ids"] = tokens
    return JSONResponse({**head, "object": kind, "choices": [choice], "usage": _usage(ticket, result, job),
                         "specgraft": _spec(result, job, ticket.replica)}, headers=headers)


def _raise_if_error(item, ticket: Ticket) -> None:
    if isinstance(item, tuple):
        _, status, message, type_ = item
        raise APIError(status, message, type=type_)
    if item.finished and item.result.finish_reason == "error":
        log.error("request %s failed: %s", item.request_id, item.error)
        raise APIError(500, "the request failed in its drafter; see the server log", type="server_error")
    if item.finished and item.result.finish_reason == "abort" and ticket.timed_out:
        raise APIError(504, "the request timed out", type="timeout")


def _spec(result, job: Job, replica: str) -> dict:
    s = result.stats
    ran = result.config.get("method", job.method)  # AR where a --method auto request was shed under load
    return {"method": ran, **({"shed_from": job.method} if ran != job.method else {}), "verify": job.verify,
            "lossy": job.verify != "lossless", "replica": replica,
            "budget": result.config.get("budget"), "steps": s.steps,
            "mean_accepted_tokens": None if s.steps == 0 else round(s.mat, 4),
            "tokens_per_s": round(s.tokens_per_s, 3), "tokens": len(result.token_ids),
            "finish_reason": result.finish_reason}


def _usage(ticket: Ticket, result, job: Job) -> dict:  # OpenAI's usage, plus our speculative stats
    n = len(result.token_ids)
    return {"prompt_tokens": ticket.prompt_tokens, "completion_tokens": n, "total_tokens": ticket.prompt_tokens + n,
            "specgraft": _spec(result, job, ticket.replica)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(srv: Server, ticket: Ticket, job: Job, kind: str, head: dict):
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    usage_null = {"usage": None} if job.include_usage else {}

    def chunk(delta: dict | str, finish: str | None = None, extra: dict | None = None, ids=None) -> str:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish}
        if job.return_token_ids:
            choice["token_ids"] = ids or []
        choice.update({"delta": delta} if kind == "chat.completion" else {"text": delta})
        return _sse({**head, "object": chunk_kind, "choices": [choice], **usage_null, **(extra or {})})

    done, steps, step_tokens, n = False, 0, 0, 0
    try:
        if kind == "chat.completion":
            yield chunk({"role": "assistant", "content": ""})
        while True:
            item: RequestOutput = await ticket.queue.get()
            try:
                _raise_if_error(item, ticket)
            except APIError as err:
                done = True
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            n += len(item.token_ids)
            if item.sources and item.sources[0] != "prefill":
                steps, step_tokens = steps + 1, step_tokens + len(item.token_ids)
            live = {"specgraft": {"segments": item.segments, "tokens": n, "steps": steps,
                                  "mean_accepted_tokens": round(step_tokens / steps, 4) if steps else None}}
            if item.text or (job.return_token_ids and item.token_ids):
                yield chunk({"content": item.text} if kind == "chat.completion" else item.text, extra=live,
                            ids=item.token_ids)
            if item.finished:
                done = True
                result = item.result
                yield chunk({} if kind == "chat.completion" else "", FINISH[result.finish_reason],
                            {"specgraft": _spec(result, job, ticket.replica)})
                if job.include_usage:
                    yield _sse({**head, "object": chunk_kind, "choices": [], "usage": _usage(ticket, result, job)})
                yield "data: [DONE]\n\n"
                return
    finally:
        if not done:  # the client went away (or the response was cancelled): free the batch row
            srv.runner.cancel(ticket)
