"""Multi-turn chat on kept state. The conversation is rendered with the model's chat template (from
tokenizer_config.json `chat_template` or chat_template.jinja, through a sandboxed jinja2 as Hugging Face
renders it); a fallback template is used for base models that ship none. Each turn feeds the model only
what is new since the state it keeps: the new rendering must extend the text the state already holds
(the previous prompt and the reply as generated), and then only the remainder is tokenized and
prefilled. When it does not (a stop string cut the reply, the history was edited), the state is rebuilt
from the whole conversation and the turn says so."""

from __future__ import annotations

import functools
import json
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, InputError
from .formats.checkpoint import read_json
from .generate import GenerationStats, Model, TextStream
from .models.base import State
from .sampling import GREEDY, SamplingParams
from .tokenizer import Tokenizer, check_text, decode_utf8, regular_file

if TYPE_CHECKING:
    from jinja2 import nodes

# For models without a template: Kimi K3's message tokens when the tokenizer has them, else plain text.
K3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|open|>{{ m['role'] }}<|sep|>{{ m['content'] }}<|end_of_msg|>"
    "{% endfor %}{% if add_generation_prompt %}<|open|>assistant<|sep|>{% endif %}"
)
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
ROLES = ("system", "user", "assistant")
# transformers fills each of these from the first one a message carries (templates read different names)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
RESET_LINE = {"reset": True}  # the history line /reset writes: a resumed chat starts after the last one

# Bounds on rendering a template (a template is code from the model directory, run on user messages):
# real chat templates render in milliseconds into a few times the conversation's size.
RENDER_SECONDS = 5.0
MAX_RENDERED_CHARS = 1 << 24  # the rendered text, and any string or list the template builds
MAX_RANGE = 100_000  # items of one range()
MAX_COUNT = 1 << 20  # a width, count or indent given to a filter or string method
MAX_POWER_BITS = 1 << 16  # the size of an integer a ** may build


class TemplateLimit(Exception):
    """Rendering went beyond a bound (time, size, range)."""


class TemplateBoundError(InputError):
    """A rendering stopped by a bound: the template loops, recurses or grows without end."""


class _Budget(threading.local):
    """The running render's deadline, per thread (the server renders from several)."""

    deadline = float("inf")
    seconds = RENDER_SECONDS


_budget = _Budget()


def _tick() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateLimit(f"rendering takes over {_budget.seconds:g} s (a loop too long?)")


def _check_size(value: Any) -> Any:
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_RENDERED_CHARS:
        raise TemplateLimit(f"a value of {len(value)} items, over the {MAX_RENDERED_CHARS} allowed")
    return value


def _check_count(n: Any) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_COUNT:
        raise TemplateLimit(f"a width or count of {n}, over the {MAX_COUNT} allowed")


def _check_format(fmt: Any) -> None:
    """A format string's widths and precisions (in %-style and str.format) within MAX_COUNT."""
    if isinstance(fmt, str):
        for digits in re.findall(r"\d{7,}", fmt):
            _check_count(int(digits))


def _size_of_join(sep: Any, items: Any) -> int:
    strs = [x for x in items if isinstance(x, str)] if isinstance(items, list | tuple) else []
    return len(sep) * max(len(strs) - 1, 0) + sum(map(len, strs)) if isinstance(sep, str) else 0


def _size_of_replace(s: Any, old: Any, new: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = s.count(old) if old else len(s) + 1
    return len(s) + hits * (len(new) - len(old))


def _size_of_indent(s: Any, width: Any) -> int:
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(s) + (s.count("\n") + 1) * pad if isinstance(s, str) else 0


def _check_result_size(n: int) -> None:
    if n > MAX_RENDERED_CHARS:
        raise TemplateLimit(f"a string of {n} characters, over the {MAX_RENDERED_CHARS} allowed")


def _bounded_range(*args: Any) -> range:
    rng = range(*args)
    try:
        n = len(rng)
    except OverflowError:  # more items than an index can count
        raise TemplateLimit(f"range() of over {sys.maxsize} items, over the {MAX_RANGE} allowed") from None
    if n > MAX_RANGE:
        raise TemplateLimit(f"range() of {n} items, over the {MAX_RANGE} allowed")
    return rng


def _bounded_iter(iterable: Any) -> Any:
    """Every loop of the template iterates through this: the deadline is checked once an item."""
    for item in iterable:
        _tick()
        yield item


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """f checking the deadline, widths and counts it is given, the size it is about to build (replace,
    indent, join, format) and the size it built."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # the context, then the value

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        value, rest = (args[skip - 1] if len(args) >= skip else None), args[skip:]
        for a in (*rest, *kwargs.values()):
            _check_count(a)
        if name == "replace" and len(rest) >= 2:
            _check_result_size(_size_of_replace(value, rest[0], rest[1]))
        elif name == "indent":
            _check_result_size(_size_of_indent(value, rest[0] if rest else kwargs.get("width", 4)))
        elif name == "join":
            _check_result_size(_size_of_join(rest[0] if rest else kwargs.get("d", ""), value))
        elif name == "format":
            _check_format(value)
        return _check_size(f(*args, **kwargs))

    return bounded


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # as transformers renders it: not HTML-escaped, with its options; an indent of a few spaces at most
    if (isinstance(indent, int) and not 0 <= indent <= 64) or (isinstance(indent, str) and len(indent) > 64):
        raise TemplateLimit(f"tojson indent {indent!r} is over 64")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _bounded_environment() -> Any:
    """A sandboxed jinja2 environment as transformers builds one (immutable sandbox, trim_blocks,
    lstrip_blocks, loop controls, raise_exception, strftime_now, tojson), with every loop, call,
    attribute and item access checking the render's deadline and every operation that can build a large
    value checking its size first."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class GenerationTag(Extension):
        # transformers' {% generation %} marks the assistant's tokens for training; rendering keeps the body
        tags = {"generation"}  # noqa: RUF012 (the type jinja declares)

        def parse(self, parser: Any) -> Any:
            from jinja2 import nodes as n

            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return n.Scope(body, lineno=lineno)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(n, int):
                        _check_result_size(len(seq) * n)
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise TemplateLimit(f"{left} ** {right} is too large")
            elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                _check_result_size(len(left) + len(right))
            elif operator == "%" and isinstance(left, str):
                _check_format(left)
                for a in right if isinstance(right, tuple) else (right,):
                    _check_count(a)
            return _check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _tick()
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
            if isinstance(owner, str):
                for a in (*args, *kwargs.values()):
                    _check_count(a)
                if name == "replace" and len(args) >= 2:
                    _check_result_size(_size_of_replace(owner, args[0], args[1]))
                elif name == "join" and args:
                    _check_result_size(_size_of_join(owner, list(args[0]) if isinstance(args[0], tuple) else args[0]))
                elif name in ("format", "format_map"):
                    _check_format(owner)
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj: Any, attribute: str) -> Any:
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _tick()
            return super().getitem(obj, argument)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    class TemplateNamespace(Namespace):
        # as transformers' namespace: no underscore names, which would reach CPython internals
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                TemplateNamespace._check(key)
            Namespace.__init__(self, attrs)

        def __setitem__(self, key: str, value: Any) -> None:
            TemplateNamespace._check(key)
            Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise SecurityError(f"a namespace attribute may not begin with an underscore: {key!r}")

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag])
    env.globals.pop("lipsum", None)  # builds text of any length in one call
    env.globals.update(range=_bounded_range, raise_exception=raise_exception, strftime_now=_strftime_now)
    env.globals["namespace"] = TemplateNamespace
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    return env


def _bounded_ast(tree: nodes.Template) -> nodes.Template:
    """The template's syntax tree with every loop's iterable and every ~ concatenation passed through
    the bounds (loops check the deadline each item; a concatenation its size)."""
    from jinja2 import nodes as n

    def bounded(node: Any) -> Any:
        return n.Filter(node, "moestream_sized", [], [], None, None, lineno=node.lineno)

    for loop in list(tree.find_all(n.For)):
        loop.iter = n.Filter(loop.iter, "moestream_bounded_iter", [], [], None, None, lineno=loop.lineno)
    for parent in list(tree.find_all(n.Node)):  # the nodes as parsed, before any is wrapped
        for field, child in parent.iter_fields():
            if isinstance(child, n.Concat):
                setattr(parent, field, bounded(child))
            elif isinstance(child, list):
                child[:] = [bounded(c) if isinstance(c, n.Concat) else c for c in child]
    return tree


class ChatTemplate:
    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "model",
        time_limit: float = RENDER_SECONDS,
    ):
        env = _bounded_environment()
        env.filters["moestream_bounded_iter"] = _bounded_iter
        env.filters["moestream_sized"] = _check_size
        try:
            self.template = env.from_string(_bounded_ast(env.parse(source)))
        except Exception as e:  # a syntax error, or a template nested beyond what the compiler handles
            raise CheckpointError(f"chat template ({name}) does not compile: {_one_line(e)}") from None
        self.source, self.bos_token, self.eos_token, self.name = source, bos_token, eos_token, name
        self.time_limit = time_limit
        # the named template "tool_use", which transformers renders instead when the request has tools
        self.tool_use: ChatTemplate | None = None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The rendered conversation, within the time limit and MAX_RENDERED_CHARS; any failure of the
        template (its own raise_exception, a bound, an error in its code) is one InputError.

        As transformers' apply_chat_template(tokenize=False) renders it: the "tool_use" template when there
        are tools and the model names one; message keys whose value is None dropped; reasoning copied
        under each of its names; the template given messages, tools (None when there are none),
        documents=None, add_generation_prompt, bos_token, eos_token and any kwargs (such as tool_choice),
        which win over the tokens as they do there."""
        if tools is not None and self.tool_use is not None:
            return self.tool_use.render(messages, add_generation_prompt, tools, **kwargs)
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": _normalize_messages(messages),
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        chunks: list[str] = []
        size = 0
        _budget.deadline, _budget.seconds = time.monotonic() + self.time_limit, self.time_limit
        try:
            for chunk in self.template.generate(**variables):
                size += len(chunk)
                _check_result_size(size)
                chunks.append(chunk)
        except (TemplateLimit, RecursionError, MemoryError) as e:
            raise TemplateBoundError(f"chat template ({self.name}) refused: {_one_line(e)}") from None
        except Exception as e:  # the template is code from the model directory: all it raises is its fault
            raise InputError(f"chat template ({self.name}): {_one_line(e)}") from None
        finally:
            _budget.deadline = float("inf")
        return "".join(chunks)

    def probe(self) -> ChatTemplate:
        """self, after rendering a one-message conversation: a template that runs into a bound even
        there would on every conversation, so it is refused as the model's fault. Its other errors (its
        own raise_exception on an unexpected conversation) are left to the real conversations."""
        try:
            self.render([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
        except TemplateBoundError as e:
            raise CheckpointError(f"{e} (on a one-message conversation)") from None
        except InputError:
            pass
        return self

    def render_pieces(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        specials: Collection[str],
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[str, list[tuple[str, bool]]]:
        """The rendered conversation, and the same text as pieces (text, is_content) where a content
        piece is a message's content exactly as given.

        The template is rendered twice: with the messages, and with each content replaced by a unique
        sentinel. When putting the contents back in place of the sentinels gives the first rendering, the
        pieces are exact. When it does not (the template strips, rewrites or branches on content), the
        text is one template piece: exact too when no content holds a special-token string, and refused
        when one does, since no piece of the rendering can then be known to be that content.

        Tools, tool calls, names and ids are rendered by the template as its own text, so a special-token
        string in any of them is refused (it would be read as the token)."""
        _refuse_special_outside_content(messages, tools, specials)
        text = self.render(messages, add_generation_prompt, tools, **kwargs)
        contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
        if not any(isinstance(c, str) and c for c in contents):
            return text, [(text, False)]
        # private-use characters around a random number: in no template and in no content
        nonce = secrets.token_hex(8)
        sentinel = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        # an empty content stays as it is: it holds nothing to protect, and templates test it (an assistant's
        # "" beside tool calls renders unlike any text)
        content_of = {sentinel[i]: c for i, c in enumerate(contents) if isinstance(c, str) and c}
        marked = [{**m, "content": sentinel[i]} if sentinel[i] in content_of else m for i, m in enumerate(messages)]
        parts = re.split(f"(\ue000{nonce}:\\d+\ue001)", self.render(marked, add_generation_prompt, tools, **kwargs))
        pieces = [(content_of[p], True) if i % 2 else (p, False) for i, p in enumerate(parts) if p]
        if "".join(t for t, _ in pieces) == text:
            return text, [p for p in pieces if p[0]]
        for i, c in enumerate(contents):
            held = [s for s in specials if isinstance(c, str) and s and s in c]
            if held:
                raise InputError(
                    f"message {i} holds the special token {held[0]!r} and the chat template ({self.name}) rewrites "
                    "message content, so it cannot be kept as text; remove it or pass --allow-special-in-content"
                )
        return text, [(text, False)]

    def encode(
        self,
        messages: list[dict[str, Any]],
        tokenizer: Tokenizer,
        add_generation_prompt: bool = True,
        allow_special_in_content: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """The token ids of the rendered conversation: the template's own special tokens as special
        ids, every message's content as ordinary text (special-token strings in it included), unless
        allow_special_in_content, which encodes the rendered text whole as it reads. tools and kwargs are
        passed to the template (render)."""
        if allow_special_in_content:
            return tokenizer.encode(self.render(messages, add_generation_prompt, tools, **kwargs), add_bos=False)
        _, pieces = self.render_pieces(messages, add_generation_prompt, tokenizer.special_tokens, tools, **kwargs)
        return tokenizer.encode_pieces(pieces)


def _normalize_messages(messages: list[dict[str, Any]]) -> list[Any]:
    """The messages as transformers hands them to a template: keys whose value is None dropped (many
    templates test whether a key is there, and would render "None"), and reasoning copied under each of
    REASONING_FIELDS from the first one given."""
    out: list[Any] = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, dictionary keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _refuse_special_outside_content(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, specials: Collection[str]
) -> None:
    found = [s for s in specials if s]
    if not found:
        return
    places: list[tuple[str, Any]] = [("tools", tools)]
    places += [
        (f"message {i} field {k!r}", v)
        for i, m in enumerate(messages)
        if isinstance(m, dict)
        for k, v in m.items()
        if k not in ("content", "role")
    ]
    for where, value in places:
        for text in _strings(value):
            held = next((s for s in found if s in text), None)
            if held is not None:
                raise InputError(
                    f"{where} holds the special token {held!r}, which the chat template would write as that token"
                )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return (
        text
        if isinstance(e, TemplateLimit) or type(e).__module__.startswith("jinja2")
        else f"{type(e).__name__}: {text}"
    )


def pieces_after(pieces: list[tuple[str, bool]], offset: int) -> list[tuple[str, bool]]:
    """The pieces with their first `offset` characters dropped."""
    out = []
    for text, is_content in pieces:
        if offset >= len(text):
            offset -= len(text)
            continue
        out.append((text[offset:], is_content))
        offset = 0
    return out


def _token_text(cfg: dict[str, Any], key: str) -> str:
    v = cfg.get(key)
    if isinstance(v, dict):  # {"content": "...", ...} as older tokenizer_config.json files write it
        v = v.get("content")
    return v if isinstance(v, str) else ""


def _template_source(cfg: dict[str, Any], cfg_path: Path, model_dir: Path) -> str | None:
    """chat_template from tokenizer_config.json (a string, or named templates: "default" first), else
    chat_template.jinja; type-checked."""
    source = cfg.get("chat_template")
    if isinstance(source, list):
        source = _named_templates(source).get("default") or next(iter(_named_templates(source).values()), None)
    if source is not None and not isinstance(source, str):
        raise CheckpointError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}}")
    if not source and (model_dir / "chat_template.jinja").exists():
        path = regular_file(model_dir / "chat_template.jinja", "chat template")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read chat template ({e.strerror})") from None
        source = decode_utf8(data, str(path), CheckpointError)
    return source or None


def _named_templates(source: list[Any]) -> dict[str, Any]:
    return {t["name"]: t.get("template") for t in source if isinstance(t, dict) and isinstance(t.get("name"), str)}


def _tool_use_source(cfg: dict[str, Any], cfg_path: Path) -> str | None:
    """The template named "tool_use" in tokenizer_config.json's list of named templates, if any."""
    source = cfg.get("chat_template")
    tool_use = _named_templates(source).get("tool_use") if isinstance(source, list) else None
    if tool_use is not None and not isinstance(tool_use, str):
        raise CheckpointError(f"{cfg_path}: the chat template named tool_use must be a string")
    return tool_use or None


def load_template(model: Model) -> ChatTemplate:
    """The model's own chat template, or the fallback for its tokenizer."""
    path = model.path
    gguf_template = getattr(model.store, "chat_template", None)  # a GGUF carries its template in its metadata
    if isinstance(gguf_template, str):
        tokens = model.store.metadata.get("tokenizer.ggml.tokens") or []
        tok = model._need_tokenizer()
        bos = tokens[tok.bos_id] if tok.bos_id is not None and tok.bos_id < len(tokens) else ""
        eos = tokens[tok.eos_ids[0]] if tok.eos_ids and tok.eos_ids[0] < len(tokens) else ""
        return ChatTemplate(gguf_template, bos, eos, name=f"{path.name} tokenizer.chat_template").probe()
    cfg_path = path / "tokenizer_config.json"
    cfg = (
        read_json(regular_file(cfg_path, "tokenizer_config.json"), "tokenizer_config.json") if cfg_path.exists() else {}
    )
    cfg = cfg if isinstance(cfg, dict) else {}
    bos, eos = _token_text(cfg, "bos_token"), _token_text(cfg, "eos_token")
    source = _template_source(cfg, cfg_path, path)
    if source is not None:
        template = ChatTemplate(source, bos, eos, name=f"{cfg_path.name}").probe()
        tool_use = _tool_use_source(cfg, cfg_path)
        if tool_use is not None:
            template.tool_use = ChatTemplate(tool_use, bos, eos, name=f"{cfg_path.name} tool_use")
        return template
    tok = model._need_tokenizer()
    has_k3 = all(len(tok.encode(s, add_bos=False)) == 1 for s in ("<|open|>", "<|sep|>", "<|end_of_msg|>"))
    return ChatTemplate(K3_TEMPLATE if has_k3 else PLAIN_TEMPLATE, bos, eos, name="fallback")


@dataclass
class TurnStats:
    prefilled_tokens: int  # tokens fed before this turn's reply: only the new turn when the state was kept
    kept_tokens: int  # tokens of the conversation already in the state
    rebuilt: bool  # True when the state had to be rebuilt from the whole conversation
    generation: GenerationStats


class ChatSession:
    """A conversation with its state. send() returns a TextStream of the reply; iterate it to stream,
    then finish() records the reply in the history."""

    def __init__(
        self,
        model: Model,
        system: str | None = None,
        sampling: SamplingParams = GREEDY,
        template: ChatTemplate | None = None,
        max_new_tokens: int = 256,
        max_context: int | None = None,
        allow_special_in_content: bool = False,
    ):
        self.model = model
        # True: special-token strings in messages are read as special tokens (lets a user forge roles)
        self.allow_special_in_content = allow_special_in_content
        self.max_context = max_context  # the conversation may not grow beyond this many tokens
        self.template = template or load_template(model)
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.state: State = self.model.new_state()
        self.text = ""  # the text the state holds, plus the last reply's unfed tail
        self.tail: list[int] = []  # generated but not yet fed (the last token of the reply)
        self._open: tuple[TextStream, str, TurnStats] | None = None

    def conversation_ids(self, user: str) -> tuple[list[int], int, bool, str]:
        """All token ids of the conversation with `user` appended and the generation prompt; how many of
        them the state already holds; whether the state must be rebuilt; the rendered text."""
        tok = self.model._need_tokenizer()
        messages = [*self.messages, {"role": "user", "content": user}]
        if self.allow_special_in_content:
            text = self.template.render(messages, True)
            pieces = [(text, False)]
        else:
            text, pieces = self.template.render_pieces(messages, True, tok.special_tokens)
        held = self.state.ids + self.tail
        if held and text.startswith(self.text):
            return held + self._encode(tok, pieces_after(pieces, len(self.text))), len(self.state.ids), False, text
        return self._encode(tok, pieces), 0, bool(held), text

    def _encode(self, tok: Tokenizer, pieces: list[tuple[str, bool]]) -> list[int]:
        if self.allow_special_in_content:  # the text whole, as it reads
            return tok.encode("".join(t for t, _ in pieces), add_bos=False)
        return tok.encode_pieces(pieces)

    def send(self, user: str, max_new_tokens: int | None = None) -> tuple[TextStream, TurnStats]:
        if self._open is not None:
            self.finish()
        ids, kept, rebuilt, text = self.conversation_ids(user)
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.max_context is not None and len(ids) + n > self.max_context:
            raise InputError(
                f"the conversation would reach {len(ids) + n} tokens, over the context of {self.max_context} "
                "(/reset to start over)"
            )
        if rebuilt or kept == 0:
            self.state = self.model.new_state()
            kept = 0
        feed = ids[kept:]
        stats = GenerationStats()
        turn = TurnStats(len(feed), kept, rebuilt, stats)
        stream = self.model.complete(
            feed,
            n,
            sampling=self.sampling,
            state=self.state,
            stats=stats,
            progress=None,
        )
        self.messages.append({"role": "user", "content": user})
        self._open = (stream, text, turn)
        return stream, turn

    def finish(self) -> str:
        """Records the reply of the last send() (running it to the end if it was not iterated)."""
        if self._open is None:
            return ""
        stream, prompt_text, _ = self._open
        self._open = None
        if stream.finish_reason is None:
            stream.run()
        eos = set(self.model.eos_ids)
        gen = [t for t in stream.tokens if t not in eos]
        # the state holds the prompt and every generated token but the last; keep that one to feed next turn
        self.tail = gen[-1:] if stream.tokens and stream.tokens[-1] not in eos else []
        self.text = prompt_text + self.model.detokenize(gen)
        self.messages.append({"role": "assistant", "content": stream.text})
        return stream.text

    # ---- history file: one JSON message per line, and RESET_LINE where /reset was typed -------------

    def load_history(self, path: Path) -> None:
        try:
            lines = regular_file(path, "history file").read_text(encoding="utf-8").splitlines()
            msgs = [json.loads(line) for line in lines if line.strip()]
        except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, an int too long
            raise InputError(f"history file {path}: {e}") from None
        for n, m in enumerate(msgs, 1):
            if m == RESET_LINE:
                continue
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise InputError(
                    f"history file {path}: each line must be {{'role': ..., 'content': ...}} or {{'reset': true}}"
                )
            check_text(m["content"], f"history file {path}: message {n}")
        after = msgs[max((n + 1 for n, m in enumerate(msgs) if m == RESET_LINE), default=0) :]
        self.messages = [{"role": m["role"], "content": m["content"]} for m in after]
        if self.system and not (after and after[0]["role"] == "system"):  # the file holds no system prompt
            self.messages.insert(0, {"role": "system", "content": self.system})

    def append_history(self, path: Path, messages: list[dict[str, str]]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            for m in messages:
                f.write(json.dumps(m, ensure_ascii=False) + "\n")
