"""Multi-turn chat on kept state. The conversation is rendered with the model's chat template (from
tokenizer_config.json `chat_template` or chat_template.jinja, through a sandboxed jinja2 as Hugging Face
renders it); a fallback template is used for base models that ship none. Each turn feeds the model only
what is new since the state it keeps: the new rendering must extend the text the state already holds
(the previous prompt and the reply as generated), and then only the remainder is tokenized and
prefilled. When it does not (a stop string cut the reply, the history was edited), the state is rebuilt
from the whole conversation and the turn says so."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InputError
from .formats.checkpoint import read_json
from .generate import GenerationStats, Model, TextStream
from .models.base import State
from .sampling import GREEDY, SamplingParams

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


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "model"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise CheckpointError(f"chat template ({name}) does not compile: {e}") from None
        self.source, self.bos_token, self.eos_token, self.name = source, bos_token, eos_token, name

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise InputError(f"chat template ({self.name}): {e}") from None


def _token_text(cfg: dict[str, Any], key: str) -> str:
    v = cfg.get(key)
    if isinstance(v, dict):  # {"content": "...", ...} as older tokenizer_config.json files write it
        v = v.get("content")
    return v if isinstance(v, str) else ""


def load_template(model: Model) -> ChatTemplate:
    """The model's own chat template, or the fallback for its tokenizer."""
    path = model.path
    cfg_path = path / "tokenizer_config.json"
    cfg = read_json(cfg_path, "tokenizer_config.json") if cfg_path.exists() else {}
    cfg = cfg if isinstance(cfg, dict) else {}
    bos, eos = _token_text(cfg, "bos_token"), _token_text(cfg, "eos_token")
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not source and (path / "chat_template.jinja").exists():
        source = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(source, str) and source:
        return ChatTemplate(source, bos, eos, name=f"{cfg_path.name}")
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
    ):
        self.model = model
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
        text = self.template.render([*self.messages, {"role": "user", "content": user}], True)
        held = self.state.ids + self.tail
        if held and text.startswith(self.text):
            return held + tok.encode(text[len(self.text) :], add_bos=False), len(self.state.ids), False, text
        return tok.encode(text, add_bos=False), 0, bool(held), text

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

    # ---- history file: one JSON message per line ---------------------------------------------------

    def load_history(self, path: Path) -> None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            msgs = [json.loads(line) for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"history file {path}: {e}") from None
        for m in msgs:
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise InputError(f"history file {path}: each line must be {{'role': ..., 'content': ...}}")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in msgs]

    def append_history(self, path: Path, messages: list[dict[str, str]]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            for m in messages:
                f.write(json.dumps(m, ensure_ascii=False) + "\n")
