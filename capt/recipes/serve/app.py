"""The HTTP side of `capt serve`: FastAPI routes over one `Engine`.

Handlers never touch the model: they validate, put a job in the engine's bounded queue (429 when full) and await
what the worker thread emits, through an asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from ..formats import encode_prompt
from ..tasks import builtin_tasks
from .engine import BASE_MODEL, Classification, Completion, Engine, QueueFull


class CompletionBody(BaseModel):
    """The OpenAI completions fields that `capt serve` honours (others are refused with 422)."""

    model_config = {"extra": "forbid"}

    model: str
    prompt: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None  # accepted and ignored, as the OpenAI client may send it


class ClassifyBody(BaseModel):
    model_config = {"extra": "forbid"}

    records: list[dict[str, Any]] = Field(min_length=1)


class AdapterBody(BaseModel):
    model_config = {"extra": "forbid"}

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    path: str


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; every route but /health needs `Authorization: Bearer <api_key>` if set.

    Example:
        >>> app = create_app(engine, api_key="secret")  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    app = FastAPI(title="capt serve", docs_url=None, redoc_url=None, openapi_url=None)
    limits = engine.limits
    registry = CollectorRegistry()
    requests = Counter("capt_requests", "HTTP requests", ["route", "status"], registry=registry)
    latency = Histogram("capt_request_latency_seconds", "time to the full answer", ["route"], registry=registry)
    batch_rows = Histogram(
        "capt_batch_rows", "rows per model batch", ["kind"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry
    )
    depth = Gauge("capt_queue_depth", "jobs waiting for the worker", registry=registry)
    depth.set_function(engine.queue.qsize)
    engine.observe = lambda kind, rows: batch_rows.labels(kind).observe(rows)
    registry.register(_EngineCounters(engine))

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, err: HTTPError):
        return error(err.status, err.message, err.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        status = 400 if any(e["type"] == "json_invalid" for e in err.errors()) else 422
        return error(status, problems)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        started = time.perf_counter()
        route = request.url.path if request.url.path.startswith(("/v1/models", "/health", "/metrics")) else None
        route = route or request.url.path.split("/v1/adapters/")[0]
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                requests.labels(route, 401).inc()
                return error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limits.max_body_bytes):
            requests.labels(route, 413).inc()
            return error(413, f"request body over {limits.max_body_bytes} bytes")
        response = await call_next(request)
        requests.labels(route, response.status_code).inc()
        latency.labels(route).observe(time.perf_counter() - started)
        return response

    def submit(job_factory) -> tuple[Completion | Classification, asyncio.Queue]:
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job = job_factory(lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            engine.submit(job)
        except QueueFull as err:
            raise HTTPError(429, str(err), "rate_limit_error") from err
        return job, events

    async def next_event(events: asyncio.Queue, deadline: float) -> dict[str, Any]:
        try:
            event = await asyncio.wait_for(events.get(), timeout=max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError as err:
            raise HTTPError(504, f"no answer within {limits.timeout_s:g} s", "timeout") from err
        if "error" in event:
            raise HTTPError(500, event["error"], "server_error")
        return event

    @app.get("/health")
    async def health():
        return {"status": "ok", "adapters": len(engine.adapters), "queue_depth": engine.queue.qsize()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        names = [BASE_MODEL, *engine.adapters]
        data = [{"id": n, "object": "model", "owned_by": "capt", "task": _task(engine, n)} for n in names]
        return {"object": "list", "data": data}

    @app.post("/v1/adapters", status_code=201)
    async def load_adapter(body: AdapterBody):
        try:
            info = await asyncio.to_thread(engine.load, body.name, body.path)
        except KeyError as err:
            raise HTTPError(409, err.args[0]) from err
        except (ValueError, OSError, RuntimeError) as err:  # wrong model, bad shapes, corrupt or pickle-only file
            raise HTTPError(400, f"adapter {body.name!r} not loaded: {err}") from err
        return {"id": body.name, "object": "model", "task": info.task, "path": info.path}

    @app.delete("/v1/adapters/{name}")
    async def unload_adapter(name: str):
        try:
            await asyncio.to_thread(engine.unload, name)
        except LookupError as err:
            raise HTTPError(404, str(err), "not_found_error") from err
        except ValueError as err:
            raise HTTPError(409, str(err)) from err
        return {"id": name, "deleted": True}

    @app.post("/v1/classify")
    async def classify(body: ClassifyBody):
        if len(body.records) > limits.max_records:
            raise HTTPError(400, f"records: at most {limits.max_records} per request, got {len(body.records)}")
        try:
            items = engine.classification_items(body.records)
        except LookupError as err:
            raise HTTPError(404, str(err), "not_found_error") from err
        except ValueError as err:
            raise HTTPError(422, str(err)) from err
        job, events = submit(lambda emit: Classification(items, emit))
        try:
            event = await next_event(events, time.monotonic() + limits.timeout_s)
        finally:
            job.cancelled.set()
        results = [
            {"task": record["task"], "predictions": [vars(s) for s in scored]}
            for record, scored in zip(body.records, event["results"], strict=True)
        ]
        return {"object": "classification", "results": results}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        if engine.family != "decoder":
            raise HTTPError(400, f"completions need a decoder-only backbone; this one is {engine.family}")
        if body.model != BASE_MODEL and body.model not in engine.adapters:
            raise HTTPError(404, f"model {body.model!r} is neither {BASE_MODEL!r} nor a loaded adapter", "not_found")
        if body.max_tokens > limits.max_tokens:
            raise HTTPError(400, f"max_tokens: at most {limits.max_tokens}, got {body.max_tokens}")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise HTTPError(400, "stop: up to 4 non-empty strings")
        # As the adapter's run encoded its prompts (a BOS where the tokenizer adds one, or as its run recorded).
        prompt_ids = encode_prompt(engine.tokenizer, body.prompt, engine.prompt_bos(body.model))
        if not prompt_ids or len(prompt_ids) > limits.max_prompt_tokens:
            raise HTTPError(400, f"prompt: 1 to {limits.max_prompt_tokens} tokens, got {len(prompt_ids)}")
        job, events = submit(
            lambda emit: Completion(
                body.model, prompt_ids, body.max_tokens, body.temperature, body.top_p, body.seed, stop, emit
            )
        )
        created, ident = int(time.time()), f"cmpl-{id(job):x}"
        deadline = time.monotonic() + limits.timeout_s

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": ident, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [choice]}  # fmt: skip

        if body.stream:

            async def stream() -> AsyncIterator[str]:
                try:
                    while True:
                        try:
                            event = await next_event(events, deadline)
                        except HTTPError as err:
                            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.kind}})}\n\n"
                            return
                        if "text" in event:
                            yield f"data: {json.dumps(chunk(event['text'], None))}\n\n"
                        else:
                            yield f"data: {json.dumps(chunk('', event['done']))}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                finally:  # normal end, error, or a client that went away: the row leaves the batch
                    job.cancelled.set()

            return StreamingResponse(stream(), media_type="text/event-stream")

        parts = []
        try:
            while "done" not in (event := await next_event(events, deadline)):
                parts.append(event["text"])
        finally:
            job.cancelled.set()
        answer = chunk("".join(parts), event["done"])
        answer["usage"] = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": event["tokens"],
            "total_tokens": len(prompt_ids) + event["tokens"],
        }
        return answer

    return app


def _task(engine: Engine, name: str) -> str | None:
    """The task an adapter answers in /v1/classify (None: completions only)."""
    info = engine.adapters.get(name)
    return None if info is None else info.task or (name if name in builtin_tasks() else None)


class _EngineCounters:
    """The counters the worker keeps itself (plain ints, no lock on its hot path), read at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        help_text = "completions that joined a generation batch while it was decoding (continuous batching)"
        yield CounterMetricFamily("capt_batch_joins", help_text, value=self.engine.joins)
        busy = CounterMetricFamily("capt_worker_seconds", "worker time per kind of forward", labels=["kind"])
        for kind, seconds in self.engine.busy.items():
            busy.add_metric([kind], seconds)
        yield busy
