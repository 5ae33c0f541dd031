"""`moestream serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

/v1/models, /v1/completions and /v1/chat/completions, streaming (server-sent events) or not, with
`usage` counts; /health. One model, one request computing at a time: concurrent requests wait their
turn in arrival order (a fair lock), and a request that fails leaves the server as it was. Errors have
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status for anything the
client can fix (malformed JSON, unknown model, a prompt beyond the context, too many tokens)."""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatTemplate, load_template
from .errors import InputError, MoeStreamError
from .generate import GenerationStats, Model
from .sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # llama.cpp / vLLM extensions
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None

    def sampling(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise ApiError(400, "at most 4 stop sequences are allowed", "stop")
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams


class Engine:
    """The model behind a fair lock: one generation at a time, in the order requests arrived."""

    def __init__(self, model: Model, name: str, ctx: int, max_tokens: int):
        self.model, self.name, self.ctx, self.max_tokens = model, name, ctx, max_tokens
        self.template: ChatTemplate = load_template(model)
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)
        self._next_ticket = 0
        self._serving = 0
        self.created = int(time.time())

    # ---- requests into jobs ----------------------------------------------------------------------

    def _check_common(self, req: _Sampling) -> SamplingParams:
        if req.model != self.name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.name}'",
                "model",
                "model_not_found",
            )
        if req.n != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        try:
            return req.sampling()
        except InputError as e:
            raise ApiError(400, str(e)) from None

    def _job(
        self, prompt: list[int], max_tokens: int | None, sampling: SamplingParams, default: int | None, param: str
    ) -> Job:
        """default: max_tokens when the request gives none (None: as many as the context and limit allow)."""
        if not prompt:
            raise ApiError(400, "the prompt is empty", param)
        if max_tokens is None:
            max_tokens = default if default is not None else max(1, min(self.max_tokens, self.ctx - len(prompt)))
        n = max_tokens
        if n > self.max_tokens:
            raise ApiError(400, f"max_tokens is {n}; this server allows at most {self.max_tokens}", "max_tokens")
        if len(prompt) + n > self.ctx:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.ctx} tokens. However, you requested "
                f"{len(prompt) + n} tokens ({len(prompt)} in the prompt, {n} for the completion).",
                param,
                "context_length_exceeded",
            )
        try:
            self.model.check_ids(prompt)
        except InputError as e:
            raise ApiError(400, str(e), param) from None
        return Job(prompt, n, sampling)

    def completion_job(self, req: CompletionRequest) -> Job:
        sampling = self._check_common(req)
        if req.echo or req.logprobs or req.suffix:
            raise ApiError(400, "echo, logprobs and suffix are not supported", "echo")
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            ids = [int(x) for x in p]
        else:
            if isinstance(p, list) and len(p) != 1:
                raise ApiError(400, "a batch of prompts is not supported; send one prompt", "prompt")
            ids = self.model.tokenize(str(p[0] if isinstance(p, list) else p))
        return self._job(ids, req.max_tokens, sampling, DEFAULT_MAX_TOKENS, "prompt")

    def chat_job(self, req: ChatRequest) -> Job:
        sampling = self._check_common(req)
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", "logprobs")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: text only
                texts = [c.get("text") for c in content if c.get("type") == "text"]
                if len(texts) != len(content):
                    raise ApiError(400, "only text content parts are supported", "messages")
                content = "".join(str(t) for t in texts)
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content or ""})
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except InputError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = self.model._need_tokenizer().encode(text, add_bos=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return self._job(ids, max_tokens, sampling, None, "messages")

    # ---- running ---------------------------------------------------------------------------------

    def _acquire(self) -> None:
        with self._turn:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._turn.wait()

    def _release(self) -> None:
        with self._turn:
            self._serving += 1
            self._turn.notify_all()

    def run(self, job: Job) -> Iterator[tuple[str, GenerationStats, str | None]]:
        """(text piece, stats, finish_reason once known) as they come; waits for its turn first."""
        self._acquire()
        try:
            stats = GenerationStats()
            stream = self.model.complete(job.prompt, job.max_tokens, sampling=job.sampling, stats=stats)
            for piece in stream:
                yield piece, stats, None
            yield "", stats, stream.finish_reason
        finally:
            self._release()


def _usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def create_app(engine: Engine) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="moestream", version="0.1.0")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        else:
            msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(ApiError(400, msg, ".".join(loc) or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(MoeStreamError)
    async def engine_error(_: Request, e: MoeStreamError) -> JSONResponse:
        status = 400 if isinstance(e, InputError) else 500
        body = ApiError(status, str(e)).body()
        if status == 500:
            body["error"]["type"] = "server_error"
        return JSONResponse(body, status_code=status)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": engine.name}

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(engine)]}

    @app.get("/v1/models/{model_id}")
    def get_model(model_id: str) -> dict[str, Any]:
        if model_id != engine.name:
            raise ApiError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return _model_card(engine)

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> Any:
        job = engine.completion_job(req)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": engine.name}
        if req.stream:
            usage_wanted = bool((req.stream_options or {}).get("include_usage"))

            def events() -> Iterator[str]:
                stats = GenerationStats()
                for piece, st, finish in engine.run(job):
                    stats = st
                    if piece or finish:
                        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
                        yield _sse({**base, "choices": [choice]})
                if usage_wanted:
                    yield _sse({**base, "choices": [], "usage": _usage(stats)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text, stats, finish = _collect(engine.run(job))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice], "usage": _usage(stats)}

    @app.post("/v1/chat/completions", response_model=None)
    def chat_completions(req: ChatRequest) -> Any:
        job = engine.chat_job(req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if req.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.name}
            usage_wanted = bool((req.stream_options or {}).get("include_usage"))

            def events() -> Iterator[str]:
                stats = GenerationStats()
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield _sse({**base, "choices": [first]})
                for piece, st, finish in engine.run(job):
                    stats = st
                    if piece:
                        yield _sse(
                            {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                        )
                    if finish:
                        yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                if usage_wanted:
                    yield _sse({**base, "choices": [], "usage": _usage(stats)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text, stats, finish = _collect(engine.run(job))
        message = {"role": "assistant", "content": text}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": engine.name,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(stats),
        }

    return app


def _model_card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.name, "object": "model", "created": engine.created, "owned_by": "moestream"}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _collect(events: Iterator[tuple[str, GenerationStats, str | None]]) -> tuple[str, GenerationStats, str | None]:
    text, stats, finish = "", GenerationStats(), None
    for piece, st, f in events:
        text, stats, finish = text + piece, st, f or finish
    return text, stats, finish


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .cli import load_for_serving

    model, streaming = load_for_serving(args)
    name = args.model_name or model.path.name
    engine = Engine(model, name, args.ctx, args.max_tokens)
    app = create_app(engine)
    print(f"moestream: serving {name} ({model.path}) on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if streaming is not None:
            streaming.close()
    return 0
