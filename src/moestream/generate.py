"""The Python API: load a model, tokenize, compute logits, generate tokens.

import moestream
model = moestream.load("Qwen/Qwen3-30B-A3B", ram="8G", threads=2)
ids = model.tokenize("def fibonacci(n):")
for token in model.generate(ids, max_new_tokens=32):
    print(model.detokenize([token]), end="")
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import models
from .blas_threads import single_threaded_blas
from .config import ModelSpec
from .console import prefill_progress
from .errors import InputError
from .formats.checkpoint import Checkpoint
from .formats.packed import PackedStore, guard_map
from .generation_config import GenerationDefaults, read_generation_config
from .heap import reuse_freed_heap
from .models.base import Ctx, State
from .models.base import Model as Network
from .runtime.integrity import check_logits, install_resident_checks
from .runtime.planner import mem_available
from .runtime.streaming import Streaming
from .sampling import GREEDY, Sampler, SamplingParams, StopMatcher
from .sources import Source
from .speculative import AUTO, Speculation, SpeculationStats
from .tokenizer import Tokenizer, load_tokenizer

# Prompts are prefilled in chunks of this many tokens, at every budget and when resident, so that the
# activation scratch is bounded whatever the prompt length and results never depend on the budget.
PREFILL_CHUNK = 256


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # time for the tokens after the first

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "prefill_tokens_per_second": round(self.prefill_tokens_per_second, 3),
            "decode_seconds": round(self.decode_seconds, 6),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
        }


class Model:
    def __init__(self, path: Path, spec: ModelSpec, decoder: Network, tokenizer: Tokenizer | None, threads: int):
        self.path = path
        self.spec = spec
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.ctx = Ctx(threads=threads)
        single_threaded_blas()  # the kernels' threads own the cores (blas_threads.py)
        reuse_freed_heap()  # a layer's arrays reuse the last layer's pages (heap.py)
        self.store: Any = None  # the Checkpoint, PackedStore or GGUFStore the weights are mapped from
        self.source: Source | None = None
        self.streaming: Streaming | None = None  # the budget's expert cache and trunk streaming, if any
        self.generation: GenerationDefaults | None = None  # generation_config.json's defaults, if any
        self.speculation: Speculation = AUTO  # generate's and the server's default (speculative.py)
        self.speculation_stats = SpeculationStats()  # over every generation so far

    # ---- memory ----------------------------------------------------------------------------------

    def use_budget(
        self,
        ram: int | str,
        *,
        context: int = 4096,
        prompt_tokens: int | None = None,
        policy: str | None = None,
        prefetch: bool = True,
        sequences: int = 1,
    ) -> Streaming:
        """Runs the model within `ram` from now on (load(..., ram=) calls this): plans the budget for
        `sequences` concurrent sequences (a server's batch) of up to `context` tokens each (the longest
        prompt chunk: prompt_tokens, default the context),
        refusing with InputError a budget that cannot hold it; the experts and the trunk parts the plan
        does not pin are read from the model's files as they are needed. Outputs do not change."""
        from .runtime.policies import DEFAULT_POLICY
        from .runtime.streaming import attach

        if self.streaming is not None:
            raise InputError("the model already runs within a budget")
        budget = _budget(ram)
        assert budget is not None
        if not 0 < context <= 1 << 24:
            raise InputError(f"context must be between 1 and {1 << 24} tokens, got {context}")
        if not 0 < sequences <= 4096:
            raise InputError(f"sequences must be between 1 and 4096, got {sequences}")
        self.streaming = attach(
            self,
            self.store,
            budget,
            context=context,
            prompt_tokens=context if prompt_tokens is None else prompt_tokens,
            policy=policy or DEFAULT_POLICY,
            prefetch=prefetch,
            sequences=sequences,
        )
        return self.streaming

    def use_draft(self, source: str | os.PathLike[str] | Model) -> Model:
        """Speculation drafts with this smaller model (a source as load takes it, or a loaded Model) from now
        on, instead of the prompt lookup; it must share this model's tokenizer (InputError if not). It runs
        resident, with this model's threads. Returns it."""
        from .speculative import check_draft

        draft = source if isinstance(source, Model) else load(source, threads=self.threads, progress=False)
        check_draft(self, draft)
        self.speculation = self.speculation.with_draft(draft)
        return draft

    def report(self, stats: GenerationStats | None = None) -> dict[str, Any]:
        """The run report `--report` writes: tokens and times (of stats), and within a budget the expert
        traffic, the plan and peak RSS."""
        from .runtime.planner import peak_rss

        s = (stats or GenerationStats()).as_dict()
        gen = max(1, int(s["generated_tokens"]))
        rep: dict[str, Any] = {**s, "threads": self.threads, "peak_rss": peak_rss()}
        rep["decode_seconds_per_token"] = float(s["decode_seconds"]) / max(1, gen - 1)
        if self.streaming is not None:
            st = self.streaming.stats()
            tokens = int(s["prompt_tokens"]) + gen
            st["bytes_read_per_token"] = st["bytes_read"] / max(1, tokens)
            st["decode_bytes_read_per_token"] = (st["bytes_read"] - st["prefill_bytes_read"]) / max(1, gen - 1)
            st["read_mb_s"] = st["bytes_read"] / 1e6 / st["read_seconds"] if st["read_seconds"] else 0.0
            rep["streaming"] = st
            rep["plan"] = self.streaming.plan.as_dict()
        rep["speculation"] = {"mode": str(self.speculation), **self.speculation_stats.as_dict()}
        if self.streaming is not None:  # what speculation is for under a budget: bytes per generated token
            rep["speculation"]["bytes_read_per_generated_token"] = rep["streaming"]["decode_bytes_read_per_token"]
        return rep

    def close(self) -> None:
        """Ends streaming (waits for reads in flight, closes the files it reads); resident: nothing."""
        if self.streaming is not None:
            self.streaming.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def name(self) -> str:
        """The model's name for messages and the server: a hub id as given, else the file or directory name."""
        src = self.source
        return src.name if src is not None and src.remote else self.path.name

    @property
    def threads(self) -> int:
        return self.ctx.threads

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_ids)
        if self.generation is not None:
            ids.update(self.generation.eos_token_ids)
        return tuple(sorted(ids))

    # ---- text ------------------------------------------------------------------------------------

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError(f"{self.path}: the model has no tokenizer (tokenizer.json or tiktoken.model); use ids")
        return self.tokenizer

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self._need_tokenizer().encode(text, add_bos=add_bos)

    def detokenize(self, ids: list[int]) -> str:
        return self._need_tokenizer().decode(list(ids))

    def check_ids(self, ids: list[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise InputError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    # ---- compute ---------------------------------------------------------------------------------

    def new_state(self) -> State:
        return self.decoder.new_state()

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for every position, computed from scratch in one batch."""
        ids = self.check_ids(ids)
        return self.decoder.forward(ids, self.new_state(), self.ctx, all_logits=True)

    def generate(
        self,
        prompt: list[int] | str,
        max_new_tokens: int = 32,
        *,
        sampling: SamplingParams | None = None,
        use_cache: bool = True,
        stop_at_eos: bool = True,
        logits_out: list[np.ndarray] | None = None,
        state: State | None = None,
        stats: GenerationStats | None = None,
        progress: bool | None = False,
        speculate: str | int | Speculation | None = None,
    ) -> Generator[int, None, None]:
        """Generation, yielding token ids as they are chosen: greedy unless sampling says otherwise. With a
        state the prompt continues it (only the prompt is prefilled) and the state keeps everything fed
        (every token but the last yielded, also when the caller stops early). speculate: 'auto', 'off' or
        a draft length (None: the model's `speculation`, auto unless set); greedy output is the same either
        way (speculative.py). With use_cache=False every step recomputes the whole sequence (for checking).
        logits_out, if given, receives the logits [vocab] each token was chosen from; stats, if given, is
        filled in as generation goes; progress shows a bar over the layers for a long prefill (None: on a
        terminal)."""
        from .batch import Sequence, step

        ids = self.tokenize(prompt) if isinstance(prompt, str) else self.check_ids(prompt)
        if max_new_tokens <= 0:
            return
        eos = frozenset(self.eos_ids) if stop_at_eos else frozenset()
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(ids)
        if not use_cache:
            yield from self._generate_uncached(ids, max_new_tokens, sampling or GREEDY, eos, logits_out, stats)
            return
        spec = self.speculation
        if speculate is not None:  # another length or mode, with the model's draft model if it has one
            spec = Speculation.parse(speculate).with_draft(spec.draft)
        st = state if state is not None else self.new_state()
        seq = Sequence(
            ids, max_new_tokens, sampling or GREEDY, st, eos, stats=stats, logits_out=logits_out, speculation=spec
        )
        with prefill_progress(self.decoder, len(ids), progress, passes=-(-len(ids) // PREFILL_CHUNK)):
            while seq.prefilling:
                step(self, [seq], PREFILL_CHUNK, PREFILL_CHUNK)
                if seq.error is not None:
                    raise seq.error
        while True:
            new = list(seq.new)
            for i, token in enumerate(new):
                try:
                    yield token
                except GeneratorExit:  # the caller stops at this token: the state holds every one before it
                    st.rewind(len(seq.history) - len(new) + i, self.ctx)
                    stats.generated_tokens = len(seq.generated) - (len(new) - 1 - i)
                    self.speculation_stats.add(seq.spec_stats)
                    raise
            if seq.done:
                break
            step(self, [seq], PREFILL_CHUNK, PREFILL_CHUNK)
            if seq.error is not None:
                raise seq.error
        self.speculation_stats.add(seq.spec_stats)

    def _generate_uncached(
        self,
        ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        eos: frozenset[int],
        logits_out: list[np.ndarray] | None,
        stats: GenerationStats,
    ) -> Generator[int, None, None]:
        """generate(use_cache=False): every token from the whole sequence recomputed from scratch."""
        sampler = Sampler(sampling)
        seq = list(ids)
        t0 = time.perf_counter()
        logits = self.decoder.forward(seq, self.new_state(), self.ctx)[0]
        stats.prefill_seconds = time.perf_counter() - t0
        for n in range(max_new_tokens):
            check_logits(logits, len(seq) - 1)
            token = sampler.sample(logits, seq)
            if logits_out is not None:
                logits_out.append(logits)
            stats.generated_tokens = n + 1
            yield token
            seq.append(token)
            if token in eos or n == max_new_tokens - 1:
                return
            t1 = time.perf_counter()
            logits = self.decoder.forward(seq, self.new_state(), self.ctx)[0]
            stats.decode_seconds += time.perf_counter() - t1

    def generate_batch(
        self,
        prompts: list[list[int]] | list[str],
        max_new_tokens: int = 32,
        *,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        stop_at_eos: bool = True,
        max_batch: int = 8,
    ) -> list[list[int]]:
        """Each prompt's generated ids, as generate gives them for it alone (sampling: one for all, or one per
        prompt), computed up to max_batch prompts at a time in shared forward passes (batch.py): a routed
        expert is read once per step for every prompt that chose it."""
        from .batch import Sequence, step

        if max_batch < 1:
            raise InputError(f"max_batch must be at least 1, got {max_batch}")
        ids = [self.tokenize(p) if isinstance(p, str) else self.check_ids(p) for p in prompts]
        per = sampling if isinstance(sampling, list) else [sampling or GREEDY] * len(ids)
        if len(per) != len(ids):
            raise InputError(f"{len(per)} sampling settings for {len(ids)} prompts")
        eos = frozenset(self.eos_ids) if stop_at_eos else frozenset()
        seqs = [
            Sequence(p, max_new_tokens, s, self.new_state(), eos, speculation=self.speculation)
            for p, s in zip(ids, per, strict=True)
        ]
        if max_new_tokens <= 0:
            return [[] for _ in seqs]
        waiting = list(seqs)
        running: list[Sequence] = []
        while waiting or running:
            running = [s for s in running if not s.done]
            while waiting and len(running) < max_batch:
                running.append(waiting.pop(0))
            step(self, running, PREFILL_CHUNK, PREFILL_CHUNK)
        return [s.generated for s in seqs]

    def complete(
        self,
        prompt: list[int] | str,
        max_new_tokens: int = 32,
        *,
        sampling: SamplingParams | None = None,
        state: State | None = None,
        stop_at_eos: bool = True,
        stats: GenerationStats | None = None,
        progress: bool | None = False,
        **generate_kwargs: Any,
    ) -> TextStream:
        """Text as it is generated, with stop strings applied: iterate for the pieces; afterwards the
        stream holds tokens, text and finish_reason ("stop" for end of text or a stop string, "length")."""
        sampling = sampling or GREEDY
        return TextStream(self, prompt, max_new_tokens, sampling, state, stop_at_eos, stats, progress, generate_kwargs)


class TextTail:
    """Generated ids to text pieces: an end-of-text id ends the text (it is not part of it), a stop string
    cuts it short (finish_reason "stop"; else "length"). feed each id, then flush once at the end."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | list[str], eos: set[int] | frozenset[int]):
        self.decoder = tokenizer.stream()
        self.stops = StopMatcher(stop)
        self.eos = eos
        self.finish_reason = "length"
        self.done = False

    def feed(self, token: int) -> str:
        if token in self.eos:
            self.finish_reason, self.done = "stop", True
            return ""
        piece = self.stops.feed(self.decoder.feed(token))
        if self.stops.stopped:
            self.finish_reason, self.done = "stop", True
        return piece

    def flush(self) -> str:
        """What is held back (an unfinished character, text that might begin a stop string)."""
        if self.stops.stopped:
            return ""
        tail = self.stops.feed(self.decoder.flush()) + self.stops.flush()
        if self.stops.stopped:
            self.finish_reason = "stop"
        return tail


class TextStream:
    """Iterating yields text pieces; the end-of-text token is not part of the text."""

    def __init__(
        self,
        model: Model,
        prompt: list[int] | str,
        max_new_tokens: int,
        sampling: SamplingParams,
        state: State | None,
        stop_at_eos: bool,
        stats: GenerationStats | None,
        progress: bool | None,
        generate_kwargs: dict[str, Any] | None = None,  # passed on to Model.generate (logits_out, use_cache)
    ):
        self.model, self.prompt, self.max_new_tokens = model, prompt, max_new_tokens
        self.sampling, self.state, self.stop_at_eos, self.progress = sampling, state, stop_at_eos, progress
        self.stats = stats if stats is not None else GenerationStats()
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.generate_kwargs = generate_kwargs or {}

    def __iter__(self) -> Iterator[str]:
        model = self.model
        text = TextTail(model._need_tokenizer(), self.sampling.stop, set(model.eos_ids) if self.stop_at_eos else set())
        self.finish_reason = "length"
        gen = model.generate(
            self.prompt,
            self.max_new_tokens,
            sampling=self.sampling,
            state=self.state,
            stop_at_eos=self.stop_at_eos,
            stats=self.stats,
            progress=self.progress,
            **self.generate_kwargs,
        )
        for token in gen:
            self.tokens.append(token)
            piece = text.feed(token)
            if piece:
                self.text += piece
                yield piece
            if text.done:
                self.finish_reason = text.finish_reason
                gen.close()
                break
        tail = text.flush()
        self.finish_reason = text.finish_reason
        if tail:
            self.text += tail
            yield tail

    def run(self) -> TextStream:
        for _ in self:
            pass
        return self


def open_store(source: Source, preload: bool | None) -> Any:
    """The tensor store of a resolved source; preload None: when it takes under 3/4 of free memory."""
    cls: Any
    if source.kind == "gguf":
        from .formats.gguf import GGUFStore

        cls = GGUFStore
    else:
        cls = PackedStore if source.kind == "packed" else Checkpoint
    store = cls(source.path)
    if preload is None:
        preload = store.nbytes < 0.75 * mem_available()
    return cls(source.path, preload=True) if preload else store


def _tokenizer(source: Source, store: Any) -> Tokenizer | None:
    if source.kind == "gguf":
        from .gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(store)
    return load_tokenizer(source.path)


def load(
    source: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    preload: bool | None = None,
    *,
    ram: int | str | None = None,
    context: int = 4096,
    cache_policy: str | None = None,
    prefetch: bool = True,
    progress: bool = True,
    sequences: int = 1,
    speculate: str | int | Speculation | None = None,
    draft: str | os.PathLike[str] | Model | None = None,
) -> Model:
    """Opens a model: a checkpoint directory (config.json + safetensors + tokenizer), a packed store, a
    .gguf file (or the first part of a split one), a Hugging Face repo id (`org/name`, `org/name@rev`,
    `org/name:Q4_K_M`; fetched into the hub's cache) or "demo" (None: the embedded demo model).

    Weights are multiplied in their stored format from a memory map; nothing is converted. Without ram,
    preload=True reads every page at load time, False maps pages on first use, None (default) preloads when
    the model takes less than 3/4 of the available memory. With ram (bytes, or a size such as "8G", or a
    preset name such as "laptop"), the model runs within that budget for contexts of up to `context`
    tokens: the same planner, the same report and the same bytes out as `--ram` (model.streaming, and
    model.close() when done); `sequences`: how many sequences at once the budget must hold state for (a
    server's --max-batch); speculate: generation's default speculation (speculative.py: 'auto' unless
    given, 'off', or a draft length); draft: a smaller model with the same tokenizer that drafts instead of
    the prompt lookup (Model.use_draft)."""
    from .sources import resolve

    speculation = Speculation.parse(speculate)
    src = resolve(source, progress=progress)
    budget = _budget(ram)
    store = open_store(src, False if budget is not None else preload)
    spec = models.read_spec(store.config)
    decoder = models.build(store, spec)
    tok = _tokenizer(src, store)
    n = default_threads() if threads is None else int(threads)
    if n < 1:
        raise InputError(f"threads must be at least 1, got {n}")
    model = Model(src.path, spec, decoder, tok, n)
    model.store, model.source = store, src
    model.generation = read_generation_config(src.path)
    model.speculation = speculation
    if draft is not None:
        model.use_draft(draft)
    if isinstance(store, PackedStore):
        install_resident_checks(decoder, store)
    else:  # the packed store registers its own maps
        for path, arr in store.mapped_files():
            guard_map(arr, path)
    if budget is not None:
        model.use_budget(budget, context=context, policy=cache_policy, prefetch=prefetch, sequences=sequences)
    return model


def load_from_args(args: argparse.Namespace, *, chat: bool = False) -> Model:
    """The model a command's arguments name (args.model, --threads), within its --ram/--preset budget
    planned for --ctx tokens; chat: it must have a tokenizer. What `chat` and `serve` run."""
    from .runtime import planner

    model = load(
        args.model,
        threads=args.threads,
        ram=planner.resolve_budget(args.ram, args.preset),
        context=args.ctx,
        cache_policy=args.cache_policy,
        prefetch=not args.no_prefetch,
        sequences=getattr(args, "max_batch", 1),
        speculate=getattr(args, "speculate", None),
        draft=getattr(args, "draft", None),
    )
    if chat and model.tokenizer is None:
        model.close()
        raise InputError(f"{model.name}: the model has no tokenizer (tokenizer.json or tiktoken.model)")
    return model


def _budget(ram: int | str | None) -> int | None:
    """Bytes of a budget given as bytes, a size ("8G") or a preset name; None: no budget."""
    from .runtime import planner

    if ram is None or isinstance(ram, int):
        if isinstance(ram, int) and not 0 < ram <= planner.MAX_SIZE:
            raise InputError(f"ram: {ram} bytes is not a budget")
        return ram
    if ram in planner.PRESETS or ram in ("auto", "max"):
        return planner.resolve_budget(None, ram)
    return planner.resolve_budget(ram, None)
