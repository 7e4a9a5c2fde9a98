"""The HTTP side of `capt serve`: FastAPI routes over one `Engine`.

Handlers never touch the model: they validate, put a job in the engine's bounded queue (429 when full) and await
what the worker thread emits, through an asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import AfterValidator, BaseModel, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import prompt_ids as chat_prompt_ids
from ..chat import request_prompt_ids
from ..formats import encode_prompt
from ..tasks import builtin_tasks
from .engine import BASE_MODEL, Classification, Completion, Engine, QueueFull


def _encodable(text: str) -> str:
    """Text the tokenizer can take. JSON may carry a lone surrogate ("\\udfff"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {err.start}") from None
    return text


# OpenAI's API is strict where this service is: a string is a string (not a number), a count an integer (not
# `true` or 2.0), a flag a boolean. Floats take integers, as JSON does not tell 1 from 1.0.
Text = Annotated[str, Field(strict=True), AfterValidator(_encodable)]
Count = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Flag = Annotated[bool, Field(strict=True)]

# What torch.Generator.manual_seed takes: a seed outside it would fail inside the decode batch.
SEED_RANGE = (-(2**63), 2**64 - 1)


class SamplingFields(BaseModel):
    """The sampling fields every generating route honours, each refused (422, naming it) outside what the sampler
    can use. `CompletionBody` (and a chat body) subclass it.

    Example:
        >>> SamplingFields(max_tokens=4, temperature=0.5, stop="\\n").stop
        '\\n'
    """

    model_config = {"extra": "forbid"}

    model: Text
    stream: Flag = False
    user: Text | None = None  # accepted and ignored, as the OpenAI client may send it
    max_tokens: Count = Field(16, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)  # 0: greedy; any value above 0 samples (see engine._choose)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    seed: Count | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Text | list[Text] | None = None

    @field_validator("stop")
    @classmethod
    def _up_to_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("up to 4 non-empty strings")
        return stop

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(SamplingFields):
    """The OpenAI completions fields that `capt serve` honours (others are refused with 422)."""

    prompt: Text


class ChatMessage(BaseModel):
    model_config = {"extra": "forbid"}

    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionBody(SamplingFields):
    """The OpenAI chat completions request: `messages`, written with the tokenizer's chat template. Without
    `max_tokens` (or OpenAI's newer `max_completion_tokens`) an answer may take up to the server's --max-tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = Field(None, ge=1)
    max_completion_tokens: Count | None = Field(None, ge=1)


class ClassifyBody(BaseModel):
    model_config = {"extra": "forbid"}

    records: list[dict[str, Any]] = Field(min_length=1)

    @field_validator("records")
    @classmethod
    def _records_encodable(cls, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for number, record in enumerate(records):
            _check_encodable(record, f"records[{number}]")
        return records


def _check_encodable(value: Any, where: str) -> None:
    """Raise ValueError naming the first string (key or value) under `value` that no tokenizer can take."""
    if isinstance(value, str):
        try:
            _encodable(value)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key, f"{where} (a key)")
            _check_encodable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for number, item in enumerate(value):
            _check_encodable(item, f"{where}[{number}]")


class AdapterBody(BaseModel):
    model_config = {"extra": "forbid"}

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", strict=True)
    path: Text


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
        # A message may quote the request (a key, a model name) and so a lone surrogate, which UTF-8 cannot carry.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, err: HTTPError):
        return error(err.status, err.message, err.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, err: StarletteHTTPException):  # no such route, method not allowed
        return error(err.status_code, f"{request.method} {request.url.path}: {err.detail}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
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
        response = await call_next(request)
        requests.labels(route, response.status_code).inc()
        latency.labels(route).observe(time.perf_counter() - started)
        return response

    # Added before the guard, so inside it: the guard counts its 413s.
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes, refuse=error)

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
        return {
            "status": "ok",
            "adapters": len(engine.adapters),
            "queue_depth": engine.queue.qsize(),
            "decoding": engine.decoding,
        }

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
    async def completions(body: CompletionBody, request: Request):
        check_model(body, body.max_tokens)
        # As the adapter's run encoded its prompts (a BOS where the tokenizer adds one, or as its run recorded); in a
        # thread: a long prompt takes a while to tokenise, and the event loop serves every other client.
        if engine.generates(body.model):  # a generate-trained adapter: its prompt as its training rows wrote it
            encode = partial(request_prompt_ids, engine.tokenizer, {"prompt": body.prompt}, "prompt")
        else:
            encode = partial(encode_prompt, engine.tokenizer, body.prompt, engine.prompt_bos(body.model))
        try:
            prompt_ids = await asyncio.to_thread(encode)
        except ValueError as err:
            raise HTTPError(400, str(err)) from err
        check_prompt(prompt_ids)
        stop = body.stops
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
            return stream_response(job, events, deadline, chunk)
        text, event = await collect_answer(request, job, events, deadline)
        return {**chunk(text, event["done"]), "usage": usage(prompt_ids, event)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody, request: Request):
        max_tokens = body.max_completion_tokens or body.max_tokens or limits.max_tokens
        check_model(body, max_tokens)
        messages = [message.model_dump() for message in body.messages]
        try:  # the prompt as training wrote it: the chat template with its generation prompt (in a thread, as above)
            prompt_ids = await asyncio.to_thread(chat_prompt_ids, engine.tokenizer, messages)
        except ValueError as err:  # a tokenizer without a chat template
            raise HTTPError(400, f"messages: {err}") from err
        check_prompt(prompt_ids)
        stop = body.stops
        job, events = submit(
            lambda emit: Completion(
                body.model, prompt_ids, max_tokens, body.temperature, body.top_p, body.seed, stop, emit
            )
        )
        created, ident = int(time.time()), f"chatcmpl-{id(job):x}"
        deadline = time.monotonic() + limits.timeout_s

        def chunk(delta: dict[str, str], finish: str | None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [choice]}  # fmt: skip

        if body.stream:  # OpenAI's chat stream opens with the role, then sends the text as content deltas
            opening = chunk({"role": "assistant", "content": ""}, None)
            delta = lambda text, finish: chunk({"content": text} if finish is None else {}, finish)  # noqa: E731
            return stream_response(job, events, deadline, delta, opening)
        text, event = await collect_answer(request, job, events, deadline)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": event["done"],
        }
        return {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [choice],
            "usage": usage(prompt_ids, event),
        }

    def stream_response(job, events, deadline, chunk, opening: dict | None = None) -> StreamingResponse:
        """A completion as server-sent events: `chunk(text, finish_reason)` shapes each one (the finish with no
        text); the row leaves the batch however the stream ends (done, error, or a client that went away)."""

        async def stream() -> AsyncIterator[str]:
            try:
                if opening is not None:
                    yield f"data: {json.dumps(opening)}\n\n"
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
            finally:
                job.cancelled.set()

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def collect_answer(request: Request, job: Completion, events, deadline: float) -> tuple[str, dict]:
        """A non-streamed completion's whole text and its final event; a client that hangs up frees the row."""
        parts = []
        watcher = asyncio.create_task(_watch_hang_up(request, job, events))
        try:
            while "done" not in (event := await next_event(events, deadline)):
                parts.append(event["text"])
        finally:
            watcher.cancel()
            job.cancelled.set()
        return "".join(parts), event

    def check_model(body: SamplingFields, max_tokens: int) -> None:
        """Refuse a generation request the server cannot run (HTTPError), before its prompt is tokenised."""
        if engine.family != "decoder":
            raise HTTPError(400, f"completions need a decoder-only backbone; this one is {engine.family}")
        if body.model != BASE_MODEL and body.model not in engine.adapters:
            raise HTTPError(404, f"model {body.model!r} is neither {BASE_MODEL!r} nor a loaded adapter", "not_found")
        if max_tokens > limits.max_tokens:
            raise HTTPError(400, f"max_tokens: at most {limits.max_tokens}, got {max_tokens}")

    def check_prompt(prompt_ids: list[int]) -> None:
        if not prompt_ids or len(prompt_ids) > limits.max_prompt_tokens:
            raise HTTPError(400, f"prompt: 1 to {limits.max_prompt_tokens} tokens, got {len(prompt_ids)}")

    return app


async def _watch_hang_up(request: Request, job: Completion, events: asyncio.Queue) -> None:
    """Free a non-streamed completion's row when its client hangs up (streams are freed by their generator)."""
    # The body has been read: the next message the server gives is the hang-up (this task is cancelled first
    # when the answer is complete).
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # no other message is expected once the body is read: never spin on one
    job.cancelled.set()
    events.put_nowait({"error": "the client went away"})


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413, counted on the bytes received, so a chunked body
    (no Content-Length) or one longer than its header says is cut off at the limit, never read whole."""

    def __init__(self, app, limit: int, refuse: Callable[[int, str], JSONResponse]):
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = self.refuse(413, f"request body over {self.limit} bytes")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await too_big(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:  # the body once, then what the client does (a hang-up)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


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


def usage(prompt_ids: list[int], event: dict[str, Any]) -> dict[str, int]:
    """OpenAI's token counts of a finished completion."""
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": event["tokens"],
        "total_tokens": len(prompt_ids) + event["tokens"],
    }
