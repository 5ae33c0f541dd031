"""What `moestream serve` offers whoever runs it: /metrics, an API key, CORS origins, an access log, and
/tokenize and /detokenize.

/metrics is Prometheus' text format, from a registry of the server's own (never the process-wide default,
so that several servers can live in one process, as the tests start them): requests by route and status
and their durations, requests in flight, jobs queued and running, prompt and generated tokens with the
seconds spent on them (rate() of the two gives tokens/s) and the last job's decode rate, the expert cache
and bytes read when the model streams, and the process' own figures (resident memory, CPU seconds).

With an API key (--api-key or MOESTREAM_API_KEY) every route but /health needs `Authorization: Bearer
KEY`, /metrics included (usage figures are the operator's business); /health stays open for load
balancers and probes. A missing or wrong key is a 401 in OpenAI's shape. CORS preflights are answered
before the key is checked (a browser never sends a key with one).

The access log is one line per request on the `moestream.access` logger at INFO, written once the
response has ended (a stream: after its last event), with the status and the seconds it took.

/tokenize and /detokenize take and give what vLLM's do: {"prompt", "add_special_tokens"} ->
{"tokens", "count", "max_model_len"}, and {"tokens"} -> {"prompt"}."""

from __future__ import annotations

import hmac
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, StrictInt

from .errors import InputError
from .generate import GenerationStats
from .server import ApiError, Engine, _Body, as_api_error

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "MOESTREAM_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
# LLM requests last from milliseconds (/tokenize) to minutes (a long generation)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

access_log = logging.getLogger("moestream.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class OpsOptions:
    """How the operator set up the server: api_key None means open to all; cors_origins empty means no CORS
    headers at all; log_level is one of LOG_LEVELS."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    log_level: str = "warning"


_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")


def options_from_args(api_key: str | None, cors_origins: list[str] | None, log_level: str) -> OpsOptions:
    """The serve command's flags checked (one line, exit 2, for a bad one); the key falls back to
    MOESTREAM_API_KEY when the flag is not given (an empty variable counts as unset)."""
    import os

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    elif not api_key.strip():
        raise InputError("--api-key is empty")
    origins = tuple(cors_origins or ())
    for origin in origins:
        if origin != "*" and not _ORIGIN.match(origin):
            raise InputError(
                f"--cors-origin {origin!r} is not an origin such as https://example.com or http://host:8080"
            )
    if log_level not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    return OpsOptions(api_key, origins, log_level)


def configure_logging(level: str) -> None:
    """moestream's loggers (the access log among them) to stderr at this level: for the serve process only,
    so an embedding program or a test keeps its own logging."""
    logger = logging.getLogger("moestream")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


# ---- metrics ---------------------------------------------------------------------------------------


class ServerMetrics:
    """The server's Prometheus registry and the metrics in it."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.requests = Counter(
            "moestream_requests", "HTTP requests answered, by route and status", ["endpoint", "status"], registry=reg
        )
        self.duration = Histogram(
            "moestream_request_duration_seconds",
            "Seconds from a request's arrival to the end of its response (a stream: its last event)",
            ["endpoint"],
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.in_flight = Gauge("moestream_requests_in_flight", "HTTP requests being answered", registry=reg)
        queued = Gauge("moestream_queue_depth", "Jobs waiting for the engine", registry=reg)
        queued.set_function(lambda: engine.queued)
        batch = Gauge("moestream_batch_size", "Jobs the engine is running now", registry=reg)
        batch.set_function(lambda: engine.running)
        self.prompt_tokens = Counter("moestream_prompt_tokens", "Prompt tokens prefilled", registry=reg)
        self.generated_tokens = Counter("moestream_generated_tokens", "Tokens generated", registry=reg)
        self.prefill_seconds = Counter("moestream_prefill_seconds", "Seconds spent in prefill", registry=reg)
        # decode_seconds times the tokens after the first; rate(generated - jobs) / rate(this) is tokens/s
        self.decode_seconds = Counter("moestream_decode_seconds", "Seconds spent decoding", registry=reg)
        self.jobs = Counter("moestream_jobs", "Generation jobs ended (finished, failed or cancelled)", registry=reg)
        self.decode_rate = Gauge(
            "moestream_decode_tokens_per_second", "Decode rate of the last job that decoded", registry=reg
        )
        self.prefill_rate = Gauge(
            "moestream_prefill_tokens_per_second", "Prefill rate of the last job that prefilled", registry=reg
        )
        reg.register(_StreamingCollector(engine))
        reg.register(_SpeculationCollector(engine))
        engine.job_ended.append(self.job_ended)

    def job_ended(self, stats: GenerationStats) -> None:
        """Counts a job's work, whether it finished, failed or was cancelled: the model did it all the same.
        Called on the engine's thread."""
        self.jobs.inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.prefill_seconds.inc(stats.prefill_seconds)
        self.decode_seconds.inc(stats.decode_seconds)
        if stats.decode_tokens_per_second > 0:
            self.decode_rate.set(stats.decode_tokens_per_second)
        if stats.prefill_tokens_per_second > 0:
            self.prefill_rate.set(stats.prefill_tokens_per_second)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _SpeculationCollector:
    """Speculative decoding over the jobs that ended (speculative.py), read at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        st = self.engine.model.speculation_stats
        yield CounterMetricFamily("moestream_decode_passes", "Decoding passes (1+ tokens each)", st.passes)
        yield CounterMetricFamily("moestream_draft_tokens", "Draft tokens proposed for verification", st.proposed)
        yield CounterMetricFamily("moestream_draft_tokens_accepted", "Draft tokens the model accepted", st.accepted)


class _StreamingCollector:
    """The expert cache and the reader, read at each scrape; nothing when the model is resident."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Any]:
        return []  # the families exist only while the model streams: nothing to reserve at registration

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        streaming = self.engine.model.streaming
        if streaming is None:
            return
        st = streaming.stats()  # plain numbers the engine's thread updates; a scrape may see one step early
        requests = st["expert_requests"]
        yield CounterMetricFamily("moestream_expert_cache_requests", "Experts asked of the cache", requests)
        yield CounterMetricFamily("moestream_expert_cache_hits", "Experts found in the cache", st["expert_hits"])
        yield GaugeMetricFamily("moestream_expert_cache_hit_rate", "Hits over requests since start", st["hit_rate"])
        yield CounterMetricFamily("moestream_expert_reads", "Expert reads from disk", st["expert_reads"])
        yield CounterMetricFamily("moestream_read_bytes", "Bytes of experts read from disk", st["bytes_read"])
        yield CounterMetricFamily("moestream_read_seconds", "Seconds the reader spent reading", st["read_seconds"])
        yield CounterMetricFamily(
            "moestream_read_wait_seconds", "Seconds compute waited for expert reads", st["wait_seconds"]
        )


# ---- middleware ------------------------------------------------------------------------------------


def _route_of(scope: Scope, routes: list[Any]) -> str:
    """The route's path template (/v1/models/{model_id}), never the raw path: a label per raw path would
    let any client grow the registry without bound. A request refused before routing (a 401) is matched
    here, so that its route is still named; no route at all is "unmatched"."""
    from starlette.routing import Match

    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class _Observed:
    """Counts and times every HTTP request, and writes its access-log line, once its response has ended."""

    def __init__(self, app: Asgi, metrics: ServerMetrics, routes: list[Any]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # if the app fails before it answers, the outermost handler answers 500
        recorded = False

        def record() -> None:
            nonlocal recorded
            recorded = True
            self._record(scope, status, time.perf_counter() - start)

        async def observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record()  # before the last bytes go: a client that has its answer finds it counted
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, observe)
        finally:
            self.metrics.in_flight.dec()
            if not recorded:  # the app failed, or the client left before the end
                record()

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        endpoint = _route_of(scope, self.routes)
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.duration.labels(endpoint).observe(seconds)
        if access_log.isEnabledFor(logging.INFO):
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            query = scope.get("query_string", b"").decode("latin-1")
            target = scope["path"] + (f"?{query}" if query else "")
            version = scope.get("http_version", "1.1")
            access_log.info('%s "%s %s HTTP/%s" %d %.3fs', who, scope["method"], target, version, status, seconds)


class _ApiKey:
    """Refuses every request but those to OPEN_PATHS that lacks `Authorization: Bearer <key>`."""

    def __init__(self, app: Asgi, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        err = ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
        response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = bytes(value).partition(b" ")
                # compare_digest: the time taken says nothing of how much of the key was right
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)
        return False


# ---- /tokenize, /detokenize ------------------------------------------------------------------------


class TokenizeRequest(_Body):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(_Body):
    tokens: list[Annotated[StrictInt, Field()]]
    model: str | None = None


def _check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.name:
        raise ApiError(
            404, f"The model '{model}' does not exist; this server serves '{engine.name}'", "model", "model_not_found"
        )


def tokenize(engine: Engine, req: TokenizeRequest) -> dict[str, Any]:
    """add_special_tokens false: the text's tokens alone; true: with what the tokenizer adds (a BOS)."""
    _check_model(engine, req.model)
    try:
        ids = engine.model.tokenize(req.prompt, add_bos=None if req.add_special_tokens else False)
    except InputError as e:
        raise ApiError(400, str(e), "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.ctx}


def detokenize(engine: Engine, req: DetokenizeRequest) -> dict[str, Any]:
    _check_model(engine, req.model)
    try:
        if req.tokens:  # check_ids refuses an empty list (an empty prompt); its text is ""
            engine.model.check_ids(req.tokens)
        return {"prompt": engine.model.detokenize(req.tokens)}
    except InputError as e:
        raise ApiError(400, str(e), "tokens") from None


# ---- putting it on the app -------------------------------------------------------------------------


def install(app: Any, engine: Engine, options: OpsOptions) -> ServerMetrics:
    """Adds /metrics, /tokenize and /detokenize, and the middleware (outermost first: metrics and access
    log, so that refusals are counted too; CORS, so that preflights and refusals carry its headers; the API
    key) to the app create_app made."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import Response

    metrics = ServerMetrics(engine)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def in_thread(fn: Callable[..., dict[str, Any]], req: Any) -> dict[str, Any]:
        try:  # a long prompt takes time the event loop must not lose
            return await run_in_threadpool(fn, engine, req)
        except Exception as e:
            raise as_api_error(e) from None

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest) -> dict[str, Any]:
        return await in_thread(tokenize, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest) -> dict[str, Any]:
        return await in_thread(detokenize, req)

    # add_middleware puts each one outside those added before it
    if options.api_key is not None:
        app.add_middleware(_ApiKey, key=options.api_key)
    if options.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    app.add_middleware(_Observed, metrics=metrics, routes=app.router.routes)
    return metrics
