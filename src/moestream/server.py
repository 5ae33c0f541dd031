"""`moestream serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

/v1/models, /v1/completions and /v1/chat/completions, streaming (server-sent events) or not, with
`usage` counts; /health, with the number of jobs queued and running. /metrics, /tokenize, /detokenize, the
API key, CORS and the access log are server_ops.py's.

The engine never waits on a client. One engine thread owns the model and runs up to --max-batch jobs
together, one forward pass a step (batch.py), the others waiting in arrival order; each job sends its
events (text pieces with their logprobs, then the end or an error) to its request's asyncio queue with
loop.call_soon_threadsafe. The HTTP side is async throughout, so a waiting request holds no thread and
no lock, and /health answers at all times. A client that goes away (closes its stream, or drops a
non-streaming request) cancels its job: the engine checks between text pieces and drops it, and skips
a queued job whose client has left.

Connections: a request must arrive whole (headers and body) within --header-timeout seconds of the
connection being ready for it, or the connection is closed (uvicorn has no such timeout of its own);
an idle keep-alive connection is closed after --keep-alive-timeout seconds (or --header-timeout, if
that is shorter).

Errors are always JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: a 4xx for
what the client can fix (malformed JSON, an unknown model or route, a wrong method, a negative seed, a
lone surrogate in text, a prompt beyond the context, too many tokens, any InputError from the model or
tokenizer), a 500 `server_error` otherwise (an IntegrityError says so; anything unexpected is logged
and answered without its traceback). An error after a stream has begun ends it with one
`data: {"error": {...}}` event and no [DONE].

SIGTERM or SIGINT: the server stops accepting connections and ends every job at once, queued or
running: a stream gets an error event with code `server_shutting_down` and is closed, a non-streaming
request gets a 503 with that code (a cut-short text is never passed off as a whole answer); then the
process exits with code 0. /docs, /redoc and /openapi.json exist only with --docs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request  # at module level: FastAPI resolves the routes' annotations here

from .batch import LogitsConstraint, Sequence, TokenLogprobs, step
from .chat import ChatTemplate, load_template
from .errors import InputError, IntegrityError, MoeStreamError
from .generate import PREFILL_CHUNK, GenerationStats, Model, TextTail
from .generation_config import GenerationDefaults
from .sampling import SEED_MAX, SamplingParams
from .tool_calls import ToolCallParser, arguments_for_template, parser_for, tool_schema, wants_mapping_arguments

if TYPE_CHECKING:
    from .server_ops import OpsOptions

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_BATCH = 8
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
SHUTTING_DOWN = "server_shutting_down"
# Once the jobs are ended, responses finish at once; this bounds only clients too slow to read them.
GRACEFUL_SHUTDOWN_SECONDS = 5
# A running job stops before its next text piece; a long prefill cannot be interrupted.
ENGINE_STOP_SECONDS = 30

log = logging.getLogger("moestream.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status >= 500:
            return "server_error"
        return {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code=SHUTTING_DOWN)


def as_api_error(e: BaseException) -> ApiError:
    """What the client is told about an exception: its own fault (400), failed data (500, saying so), or an
    unexpected error (500, logged here with its traceback, which the client never sees)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InputError):
        return ApiError(400, str(e))
    if isinstance(e, IntegrityError):
        return ApiError(500, f"integrity check failed: {e}", code="integrity_error")
    if isinstance(e, MoeStreamError):
        return ApiError(500, str(e))
    log.error("unexpected error while serving a request", exc_info=e)
    return ApiError(500, f"the server had an error while processing the request ({type(e).__name__})")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string, or one inside lists and dicts, holds a lone surrogate: JSON can carry one
    ("\\ud800") but it is not text, and UTF-8 cannot encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list | tuple):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


class _Body(BaseModel):
    """A request body: every field one this server acts on (any other, such as tools or response_format,
    is a 400 naming it: a client must not believe it got what it asked for), numbers finite, strings
    valid Unicode (else a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON as Python reads it allows NaN

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _has_lone_surrogate(value):
            raise ValueError("the text holds a lone surrogate (such as \\ud800), which is not valid Unicode")
        return value


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # llama.cpp / vLLM extensions
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None  # the end user's id, for the client's own records: nothing to act on
    # structured output (structured.py): json_object, json_schema, and the regex and grammar extensions
    response_format: dict[str, Any] | None = None

    def sampling(self, generation: GenerationDefaults | None = None) -> SamplingParams:
        """The request's sampling; a field the request leaves out takes the model's generation_config.json
        value (generation), else the field's default above."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise ApiError(400, "at most 4 stop sequences are allowed", "stop")
        model = generation.sampling_fields() if generation is not None else {}
        given = self.model_fields_set

        def pick(field: str) -> Any:
            return model[field] if field in model and field not in given else getattr(self, field)

        return SamplingParams(
            temperature=pick("temperature"),
            top_k=pick("top_k"),
            top_p=pick("top_p"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or ids; a list of one (as harnesses send)
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object's text, as the model wrote it


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # given to the chat template, which may write it
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# ---- what the engine sends a request ---------------------------------------------------------------


@dataclass
class Piece:
    text: str
    # the tokens whose text this piece completes (when the request asked for logprobs)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt: bool = False  # the prompt itself, scored (echo), before any generated text


@dataclass
class Finished:
    stats: GenerationStats
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # tokens whose text came with no piece


@dataclass
class Failed:
    error: ApiError


Event = Piece | Finished | Failed


def _nowhere(_: Event) -> None:
    pass


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    # where the engine's thread sends this job's events (given by Engine.submit)
    sink: Callable[[Event], object] = _nowhere
    # set when nobody wants the events any more: the client left, or the server is stopping
    cancelled: threading.Event = field(default_factory=threading.Event)
    logprobs: int | None = None  # the chosen tokens' logprobs with the top k alternatives
    echo: str | None = None  # the prompt's text, to be sent scored first (completions' echo)
    constraint: LogitsConstraint | None = None
    # a chat reply's tool calls are parsed out of its text by this (tools, tool_choice), else None
    tool_parser: ToolCallParser | None = None

    def emit(self, event: Event) -> None:
        try:
            self.sink(event)
        except RuntimeError:  # the request's event loop is closed: nobody is listening
            self.cancelled.set()


@dataclass
class _Active:
    """A job in the running batch: its sequence, and its text so far."""

    job: Job
    seq: Sequence
    text: TextTail
    stats: GenerationStats
    unsent: list[TokenLogprobs] = field(default_factory=list)  # logprobs of tokens whose text is held back
    echoed: bool = False


class Engine:
    """The model and the one thread that runs its jobs, each feeding its own sink, so the engine never waits
    on a client. Up to max_batch jobs run at once (continuous batching, batch.py): each step is one forward
    pass for all of them, so a routed expert is read and multiplied once for every sequence that chose it;
    a job that arrives joins at the next step, its prompt fed in chunks beside the others' tokens. Each job
    gets exactly what it would get alone. Jobs beyond max_batch wait in arrival order."""

    def __init__(self, model: Model, name: str, ctx: int, max_tokens: int, max_batch: int = DEFAULT_MAX_BATCH):
        if max_batch < 1:
            raise InputError(f"--max-batch must be at least 1, got {max_batch}")
        self.model, self.name, self.ctx, self.max_tokens = model, name, ctx, max_tokens
        self.max_batch = max_batch
        self._token_bytes: dict[int, bytes] = {}
        self.template: ChatTemplate = load_template(model)
        self.created = int(time.time())
        self._changed = threading.Condition()  # guards the three below
        self._queue: deque[Job] = deque()
        self._active: list[_Active] = []
        self._stopping = False
        # called on the engine's thread with each job's stats when it ends, however it ends (/metrics)
        self.job_ended: list[Callable[[GenerationStats], object]] = []
        self._thread = threading.Thread(target=self._work, name="moestream-engine", daemon=True)
        self._thread.start()

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (a byte-level token may hold part of a character); remembered, as logprobs ask for
        the same ids again and again."""
        got = self._token_bytes.get(token)
        if got is None:
            tok = self.model._need_tokenizer()
            decode_bytes = getattr(tok, "decode_bytes", None)
            got = decode_bytes([token]) if decode_bytes is not None else tok.decode([token]).encode()
            self._token_bytes[token] = got
        return got

    def token_text(self, token: int) -> str:
        """A token as text: its bytes as UTF-8, an incomplete character as U+FFFD."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

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
            return req.sampling(self.model.generation)
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

    def _constrain(self, job: Job, req: _Sampling) -> Job:
        """The job's output constraint from the request's response_format (a 400 naming what is wrong)."""
        if req.response_format is None:
            return job
        from .structured import from_response_format

        model = self.model
        try:
            job.constraint = from_response_format(
                req.response_format, model._need_tokenizer(), model.vocab_size, eos_ids=model.eos_ids
            )
        except InputError as e:
            raise ApiError(400, str(e), "response_format") from None
        return job

    def completion_job(self, req: CompletionRequest) -> Job:
        sampling = self._check_common(req)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens may be 0 only with echo (to score the prompt)", "max_tokens")
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
            p = p[0]  # one prompt of ids in a list, as evaluation harnesses send it
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            raise ApiError(400, "a batch of prompts is not supported; send one prompt", "prompt")
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            ids = [x for x in p if isinstance(x, int)]
        else:
            if isinstance(p, list) and len(p) != 1:
                raise ApiError(400, "a batch of prompts is not supported; send one prompt", "prompt")
            try:
                ids = self.model.tokenize(str(p[0] if isinstance(p, list) else p))
            except InputError as e:
                raise ApiError(400, str(e), "prompt") from None
        job = self._constrain(self._job(ids, req.max_tokens, sampling, DEFAULT_MAX_TOKENS, "prompt"), req)
        job.logprobs = req.logprobs
        if req.echo:  # the prompt as the client sent it (a BOS the tokenizer adds is in the logprobs' tokens)
            job.echo = (
                self.model.detokenize(ids)
                if isinstance(p, list) and isinstance(p[0], int)
                else str(p[0] if isinstance(p, list) else p)
            )
        return job

    def chat_job(self, req: ChatRequest) -> Job:
        sampling = self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        source = (self.template.tool_use if tools and self.template.tool_use else self.template).source
        as_mapping = wants_mapping_arguments(source)
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: text only
                texts = [c.get("text") for c in content if c.get("type") == "text"]
                if len(texts) != len(content):
                    raise ApiError(400, "only text content parts are supported", "messages")
                content = "".join(str(t) for t in texts)
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content or ""} | _tool_fields(m, as_mapping))
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
        if choice is not None and not tools:  # as OpenAI's API answers it
            raise ApiError(400, "tool_choice: not supported without tools", "tool_choice")
        try:
            parser = parser_for(tools, choice, source)
            schema = tool_schema(tools, choice, req.parallel_tool_calls is not False)
        except InputError as e:
            raise ApiError(400, str(e), "tools" if choice in (None, "auto") else "tool_choice") from None
        # the template gets tools as transformers passes them, and tool_choice (Kimi K3's says what it asks)
        extra: dict[str, Any] = {"tool_choice": choice} if tools and choice is not None else {}
        try:  # message content is encoded as text: only the template writes special tokens
            tok = self.model._need_tokenizer()
            ids = self.template.encode(messages, tok, add_generation_prompt=True, tools=tools, **extra)
        except InputError as e:
            raise ApiError(400, str(e), "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self._constrain(self._job(ids, max_tokens, sampling, None, "messages"), req)
        if req.logprobs:
            job.logprobs = req.top_logprobs or 0
        job.tool_parser = parser
        if parser is not None and req.parallel_tool_calls is False:
            parser.limit = 1
        if schema is not None:
            if job.constraint is not None:
                raise ApiError(400, "response_format cannot be combined with a forced tool_choice", "response_format")
            job.constraint = self._tool_constraint(schema)
        return job

    def _tool_constraint(self, schema: dict[str, Any]) -> LogitsConstraint:
        """The constraint that makes the reply follow a forced tool call's schema (tool_schema)."""
        try:
            from .structured import OutputConstraint  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise ApiError(
                400, "tool_choice 'required' or a named function needs structured output", "tool_choice"
            ) from None
        try:
            constraint: LogitsConstraint = OutputConstraint.json_schema(
                schema, self.model._need_tokenizer(), self.model.vocab_size, eos_ids=self.model.eos_ids, what="tools"
            )
        except InputError as e:
            raise ApiError(400, str(e), "tools") from None
        return constraint

    # ---- the queue -------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Jobs waiting whose clients are still there."""
        with self._changed:
            return sum(not job.cancelled.is_set() for job in self._queue)

    @property
    def running(self) -> int:
        """Jobs in the running batch."""
        with self._changed:
            return len(self._active)

    def submit(self, job: Job, sink: Callable[[Event], object]) -> None:
        """Queues the job; its events go to sink, called from the engine's thread."""
        with self._changed:
            if self._stopping:
                raise _shutting_down()
            job.sink = sink
            self._queue.append(job)
            self._changed.notify()

    def stop(self) -> None:
        """Refuses new jobs and ends every queued and running one now, from the caller's thread: their
        clients are told at once, without waiting for the running step to end."""
        with self._changed:
            self._stopping = True
            ending = [*self._queue, *(a.job for a in self._active)]
            self._queue.clear()
            self._changed.notify()
        for job in ending:
            job.cancelled.set()
            job.emit(Failed(_shutting_down()))

    def join(self, timeout: float) -> bool:
        """Whether the engine's thread ended (after stop) within timeout seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the engine's thread ---------------------------------------------------------------------

    def _work(self) -> None:
        while self._admit():
            active = self._active  # only this thread changes the list's contents
            for a in [a for a in active if a.job.cancelled.is_set()]:
                self._end(a, None)
            if not active:
                continue
            took = {id(s) for s in step(self.model, [a.seq for a in active], PREFILL_CHUNK, PREFILL_CHUNK)}
            for a in [a for a in active if id(a.seq) in took]:
                try:  # a job that fails ends alone; the others in its step go on
                    if a.seq.error is not None:
                        raise a.seq.error
                    self._advance(a)
                except Exception as e:
                    if a in self._active:
                        self._end(a, Failed(as_api_error(e)))

    def _admit(self) -> bool:
        """Moves waiting jobs into the batch while it has room; waits while there is nothing to do. False
        once stopping."""
        with self._changed:
            while not self._stopping:
                while self._queue and len(self._active) < self.max_batch:
                    job = self._queue.popleft()
                    if job.cancelled.is_set():
                        continue
                    try:
                        self._active.append(self._start(job))
                    except Exception as e:  # this job cannot start; the engine goes on
                        job.emit(Failed(as_api_error(e)))
                if self._active:
                    return True
                self._changed.wait()
            for a in self._active:
                self._ended(a)
            self._active.clear()
            return False

    def _start(self, job: Job) -> _Active:
        model = self.model
        stats = GenerationStats(prompt_tokens=len(job.prompt))
        seq = Sequence(
            job.prompt,
            job.max_tokens,
            job.sampling,
            model.new_state(),
            frozenset(model.eos_ids),
            logprobs=job.logprobs,
            prompt_logprobs=job.logprobs if job.echo is not None else None,
            constraint=job.constraint,
            stats=stats,
            speculation=model.speculation,
        )
        text = TextTail(model._need_tokenizer(), job.sampling.stop, frozenset(model.eos_ids))
        return _Active(job, seq, text, stats)

    def _advance(self, a: _Active) -> None:
        """After a step the job took part in: sends what it completed; ends it when it is done."""
        seq, job = a.seq, a.job
        if job.echo is not None and not seq.prefilling and not a.echoed:  # the prompt, scored, comes first
            job.emit(Piece(job.echo, seq.prompt_scores if job.logprobs is not None else [], prompt=True))
            a.echoed = True
        for i, token in enumerate(seq.new):  # one token, or several when drafts were accepted
            if seq.new_logprobs and token not in a.text.eos:
                a.unsent.append(seq.new_logprobs[i])
            piece = a.text.feed(token)
            if piece:
                job.emit(Piece(piece, a.unsent))
                a.unsent = []
            if a.text.done:  # tokens drafted past a stop string were never sent: they do not count
                a.stats.generated_tokens -= len(seq.new) - 1 - i
                break
        if seq.done and job.constraint is not None and job.constraint.finished:
            a.text.finish_reason = "stop"  # the output is whole: the grammar allows nothing more
        if a.text.done or seq.done:
            seq.done = True
            tail = a.text.flush()
            if tail:
                job.emit(Piece(tail, a.unsent))
                a.unsent = []
            self._end(a, Finished(a.stats, a.text.finish_reason, a.unsent))

    def _end(self, a: _Active, end: Finished | Failed | None) -> None:
        """Takes the job out of the batch; tells its client how it ended (None: nobody to tell)."""
        with self._changed:
            self._active.remove(a)
        self._ended(a)
        if end is not None:
            a.job.emit(end)

    def _ended(self, a: _Active) -> None:
        self.model.speculation_stats.add(a.seq.spec_stats)
        for listener in self.job_ended:  # before the end is sent: a client that then reads /metrics sees its job
            try:
                listener(a.stats)
            except Exception:  # the job's client is told how it ended all the same
                log.exception("a job_ended listener failed")


def _tool_fields(m: ChatMessage, as_mapping: bool) -> dict[str, Any]:
    """A message's fields beside role and content, as the chat template reads them: name, an assistant's
    tool_calls (their arguments parsed when as_mapping: tool_calls.wants_mapping_arguments), a tool result's
    tool_call_id; each only where OpenAI's API allows it."""
    if m.tool_calls is not None and m.role != "assistant":
        raise ApiError(400, f"tool_calls are for assistant messages, not {m.role!r}", "messages")
    if m.role == "tool" and not m.tool_call_id:
        raise ApiError(400, "a tool message needs tool_call_id (the call it answers)", "messages")
    if m.tool_call_id is not None and m.role != "tool":
        raise ApiError(400, f"tool_call_id is for tool messages, not {m.role!r}", "messages")
    out: dict[str, Any] = {"name": m.name} if m.name else {}
    if m.tool_calls:
        out["tool_calls"] = [arguments_for_template(c.model_dump(), as_mapping) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


# ---- the HTTP side ---------------------------------------------------------------------------------


class _Listener:
    """One job's events, carried from the engine's thread into this request's event loop. Once nobody
    holds the listener (a response dropped before it began), its job is cancelled."""

    def __init__(self, engine: Engine, job: Job):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.job, self._events = job, events
        engine.submit(job, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        weakref.finalize(self, job.cancelled.set)

    async def events(self) -> AsyncIterator[Event]:
        """The job's events up to and including the last (Finished or Failed)."""
        while True:
            event = await self._events.get()
            yield event
            if not isinstance(event, Piece):
                return

    def cancel(self) -> None:
        self.job.cancelled.set()


async def _prepare(make_job: Callable[[Any], Job], req: _Sampling) -> Job:
    """The request's job, made in a worker thread (rendering and tokenizing a long prompt is time the event
    loop must not lose); any failure becomes an ApiError."""
    from starlette.concurrency import run_in_threadpool

    try:
        return await run_in_threadpool(make_job, req)
    except Exception as e:
        raise as_api_error(e) from None


async def _sse_stream(
    listener: _Listener,
    chunks: Callable[[Piece | Finished], list[dict[str, Any]]],
    usage: Callable[[GenerationStats], dict[str, Any]] | None,
    opening: list[dict[str, Any]],
) -> AsyncIterator[str]:
    """The job's events as server-sent events; an error ends the stream with an error event and no
    [DONE]. Starlette cancels this generator when the client leaves, and the job with it."""
    try:
        for chunk in opening:
            yield _sse(chunk)
        async for event in listener.events():
            if isinstance(event, Failed):
                yield _sse(event.error.body())
                return
            for chunk in chunks(event):
                yield _sse(chunk)
            if isinstance(event, Finished) and usage is not None:
                yield _sse(usage(event.stats))
        yield "data: [DONE]\n\n"
    finally:
        listener.cancel()


async def _whole(request: Request, listener: _Listener) -> tuple[list[Piece], Finished]:
    """The job's pieces and its end; raises its error. A client that leaves first cancels the job."""
    collecting = asyncio.ensure_future(_collect(listener))
    leaving = asyncio.ensure_future(_client_left(request))
    try:
        done, _ = await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        leaving.cancel()
        if not collecting.done():
            collecting.cancel()
    if collecting in done:
        return collecting.result()
    raise ApiError(499, "the client closed the request")  # nginx's code; no one is there to read it


async def _collect(listener: _Listener) -> tuple[list[Piece], Finished]:
    pieces: list[Piece] = []
    async for event in listener.events():
        if isinstance(event, Piece):
            pieces.append(event)
        elif isinstance(event, Finished):
            return pieces, event
        else:
            raise event.error
    raise AssertionError("a job's events end with Finished or Failed")


class _Logprobs:
    """Token logprobs in the two shapes of OpenAI's API, with each token's text and bytes."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.offset = 0  # the completions shape's text_offset: where the next token's text begins

    def completion(self, entries: list[TokenLogprobs], text: str) -> dict[str, Any]:
        """The completions API's shape for the tokens that gave `text` (the next part of the choice's text):
        parallel lists (a prompt's first token has None); each token's alternatives with the token itself
        among them, as the API defines them; text_offset where each token's text begins in the choice's
        text (a token with no text of its own there, such as a BOS or part of a character, at the point
        reached)."""
        token_text = self.engine.token_text
        tokens = [token_text(e.token) for e in entries]
        offsets = []
        start, at = self.offset, 0
        for t in tokens:
            found = text.find(t, at) if t else -1
            if found >= 0 and "\ufffd" not in t:
                offsets.append(start + found)
                at = found + len(t)
            else:
                offsets.append(start + at)
        self.offset = start + len(text)

        def top(e: TokenLogprobs) -> dict[str, float] | None:
            if e.logprob is None:
                return None
            return {token_text(e.token): e.logprob} | {token_text(i): lp for i, lp in e.top if i != e.token}

        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries],
            "text_offset": offsets,
        }

    def chat(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        """The chat API's shape: one object per token, with its top alternatives."""
        engine = self.engine

        def one(token: int, logprob: float | None) -> dict[str, Any]:
            return {"token": engine.token_text(token), "logprob": logprob, "bytes": list(engine.token_bytes(token))}

        content = [one(e.token, e.logprob) | {"top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}


async def _client_left(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: Engine, docs: bool = False) -> Any:
    """The FastAPI app; /docs, /redoc and /openapi.json only if docs."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    class ErrorResponse(JSONResponse):
        """An error as JSON, escaped to ASCII: a message may quote what the client sent."""

        def render(self, content: Any) -> bytes:
            return json.dumps(content, separators=(",", ":")).encode("ascii")

    def respond(e: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return ErrorResponse(e.body(), status_code=e.status, headers=headers)

    app = FastAPI(
        title="moestream",
        version="0.1.0",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return respond(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        extra = [".".join(str(x) for x in err.get("loc", []) if x != "body") for err in errs]
        extra = [name for name, err in zip(extra, errs, strict=True) if err.get("type") == "extra_forbidden"]
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        elif extra:  # name every field this server would otherwise have to ignore
            msg = f"{', '.join(extra)}: not supported by this server (it would have to ignore it)"
            loc = extra[0].split(".")
        else:
            msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return respond(ApiError(400, msg, ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return respond(ApiError(e.status_code, str(e.detail)), e.headers)  # 405 keeps its Allow header

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return respond(as_api_error(e))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": engine.name,
            "queued": engine.queued,
            "running": engine.running,
            "max_batch": engine.max_batch,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(engine)]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != engine.name:
            raise ApiError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return _model_card(engine)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        job = await _prepare(engine.completion_job, req)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": engine.name}
        scores = _Logprobs(engine) if req.logprobs is not None else None

        def logprobs(entries: list[TokenLogprobs], text: str) -> dict[str, Any] | None:
            return scores.completion(entries, text) if scores is not None else None

        listener = _Listener(engine, job)
        if req.stream:

            def chunks(event: Piece | Finished) -> list[dict[str, Any]]:
                text, finish = (event.text, None) if isinstance(event, Piece) else ("", event.finish_reason)
                choice = {"index": 0, "text": text, "logprobs": logprobs(event.logprobs, text), "finish_reason": finish}
                return [{**base, "choices": [choice]}]

            events = _sse_stream(listener, chunks, _usage_chunk(base, req), [])
            return StreamingResponse(events, media_type="text/event-stream")
        pieces, end = await _whole(request, listener)
        text = "".join(p.text for p in pieces)
        entries = [e for p in pieces for e in p.logprobs] + end.logprobs
        choice = {"index": 0, "text": text, "logprobs": logprobs(entries, text), "finish_reason": end.finish_reason}
        return {**base, "choices": [choice], "usage": _usage(end.stats)}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        job = await _prepare(engine.chat_job, req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        scores = _Logprobs(engine) if req.logprobs else None

        def logprobs(entries: list[TokenLogprobs]) -> dict[str, Any] | None:
            return scores.chat(entries) if scores is not None else None

        listener = _Listener(engine, job)
        if req.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.name}

            parser = job.tool_parser

            def chunks(event: Piece | Finished) -> list[dict[str, Any]]:
                reason = None
                if parser is None:
                    deltas = [{"content": event.text}] if isinstance(event, Piece) else []
                else:  # tool calls parsed out of the text as it comes
                    deltas = parser.feed(event.text) if isinstance(event, Piece) else parser.flush()
                if isinstance(event, Finished):
                    reason = parser.finish_reason(event.finish_reason) if parser else event.finish_reason
                    deltas.append({})
                elif not deltas:
                    if scores is None:
                        return []
                    deltas = [{}]  # held back (a marker may be starting): the tokens' logprobs still go out
                out = []
                for i, delta in enumerate(deltas):
                    last = isinstance(event, Finished) and i == len(deltas) - 1
                    choice = {"index": 0, "delta": delta, "finish_reason": reason if last else None}
                    if scores is not None:
                        choice["logprobs"] = logprobs(event.logprobs if i == 0 else [])
                    out.append({**base, "choices": [choice]})
                return out

            opening = {
                **base,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
            events = _sse_stream(listener, chunks, _usage_chunk(base, req), [opening])
            return StreamingResponse(events, media_type="text/event-stream")
        pieces, end = await _whole(request, listener)
        text = "".join(p.text for p in pieces)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = end.finish_reason
        if job.tool_parser is not None:
            message = {"role": "assistant", **job.tool_parser.message(text)}
            finish = job.tool_parser.finish_reason(finish)
        entries = [e for p in pieces for e in p.logprobs] + end.logprobs
        choice = {"index": 0, "message": message, "logprobs": logprobs(entries), "finish_reason": finish}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": engine.name,
            "choices": [choice],
            "usage": _usage(end.stats),
        }

    return app


def _usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def _usage_chunk(base: dict[str, Any], req: _Sampling) -> Callable[[GenerationStats], dict[str, Any]] | None:
    """The stream's last chunk before [DONE] when the client asked for usage (stream_options)."""
    if not (req.stream_options or {}).get("include_usage"):
        return None
    return lambda stats: {**base, "choices": [], "usage": _usage(stats)}


def _model_card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.name, "object": "model", "created": engine.created, "owned_by": "moestream"}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- connections and the process -------------------------------------------------------------------


def _h11_with_request_timeout(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the timeout it lacks: its keep-alive timer runs only between requests
    and stops at the first byte, so a connection that sends nothing, or part of a request, stays open for
    good. This one closes a connection whose request has not arrived whole (headers and body) within
    `seconds` of the connection being ready for it: from connecting, or from the end of its last response."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class RequestTimeoutH11(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _await_request(self) -> None:
            self._stop_timer()
            if not self.transport.is_closing():
                self._request_timer = self.loop.call_later(seconds, self._request_overdue)

        def _stop_timer(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _request_overdue(self) -> None:
            self._request_timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

    return RequestTimeoutH11


def make_server(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    docs: bool = False,
    header_timeout: float = 10.0,
    keep_alive_timeout: float = 5.0,
    ops: OpsOptions | None = None,
) -> Any:
    """The uvicorn server for the engine. As soon as it begins to shut down (a signal, or should_exit) it
    ends the engine's jobs, so no open response keeps it waiting. ops: metrics, API key, CORS and log level
    (server_ops.py)."""
    import uvicorn

    from .server_ops import OpsOptions, install

    ops = ops or OpsOptions()
    app = create_app(engine, docs=docs)
    install(app, engine, ops)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            engine.stop()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=ops.log_level,
        access_log=False,  # server_ops writes its own, with the seconds each request took
        http=_h11_with_request_timeout(header_timeout),
        timeout_keep_alive=math.ceil(keep_alive_timeout),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    return Server(config)


@contextlib.contextmanager
def _signals_exit_cleanly() -> Iterator[None]:
    """uvicorn catches SIGTERM and SIGINT to shut down, then restores the handlers it found and raises the
    signal again, which by default would kill the process (SIGTERM) or interrupt it (SIGINT) after a clean
    shutdown. The handlers it finds are set to ignore that second signal, so the drain ends in exit 0."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound here rather than by uvicorn so that a taken port or an unknown host is
    one line and exit 2 (uvicorn would log it and exit 3), and so that --port 0 can say which port it got.
    Not listening yet: uvicorn listens once it is ready to answer."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {port}")

    def cannot_listen(e: OSError) -> InputError:
        return InputError(f"cannot listen on {host}:{port}: {e.strerror or e}")

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise cannot_listen(e) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise cannot_listen(e) from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    from .generate import load_from_args
    from .runtime import planner
    from .server_ops import configure_logging, options_from_args

    if args.list_presets:
        planner.print_presets()
        return 0
    ops = options_from_args(args.api_key, args.cors_origin, args.log_level)  # checked before the model loads
    configure_logging(ops.log_level)
    model = load_from_args(args, chat=True)
    try:
        sock = _bind(args.host, args.port)
    except InputError:
        model.close()
        raise
    name = args.model_name or model.name
    engine = Engine(model, name, args.ctx, args.max_tokens, args.max_batch)
    server = make_server(
        engine,
        args.host,
        args.port,
        docs=args.docs,
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        ops=ops,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address in a URL
    print(f"moestream: serving {name} ({model.path}) on http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        with _signals_exit_cleanly():
            server.run(sockets=[sock])
    finally:
        engine.stop()
        # a job still in its prefill may be reading through the streaming store: close it only after
        if engine.join(ENGINE_STOP_SECONDS):
            model.close()
    return 0
