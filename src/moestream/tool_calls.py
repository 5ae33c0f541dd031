"""Tool calls in a model's output: the formats of the families moestream runs, parsed whole or as the text
streams in, into OpenAI's `tool_calls`; and the JSON schema that enforces `tool_choice` "required" or a named
function, with the parse of what it produced.

Formats (chosen by what the chat template writes for an assistant's tool calls, see `detect`):

- Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>  (the id is the model's own, which the template writes back)
- Kimi K3: <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|> then either
  <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>... or <|open|>json type="object"<|sep|>
  {...}<|close|>json<|sep|>, then <|close|>call<|sep|>...<|close|>tools<|sep|>
- DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
- DeepSeek-V3.1: the same markers, <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
- Qwen3 / Hermes: <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>, any number, text between
- Qwen3-Coder (and later Qwen): <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>

Every parse is one function, `scan(text, final)`: the content so far (the text outside tool calls) and the
calls so far (name, arguments as far as they are known). With final=False it holds back what more text
could still change (the start of a marker, trailing whitespace), so each scan extends the last one; the
streaming parser sends the difference as deltas, and the whole-text parse is the final scan: the two agree
by construction. A marker is never content: text that might begin one waits until it is known not to.

Arguments are the model's text (stripped of whitespace and, for DeepSeek-V3, the ```json fence) for the
formats that write JSON, and JSON built from the parts for those that do not (Hermes' "arguments" object,
K3's typed arguments). A Hermes block that is not a JSON object with a name is left as content."""

from __future__ import annotations

import html
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError

WHITESPACE = " \t\r\n"


@dataclass
class ToolCall:
    """One call as far as it is known: the name, and the arguments (a JSON object's text) so far."""

    name: str
    arguments: str = ""
    id: str | None = None  # the model's own id (Kimi K2); else one is given (ToolCallParser)
    closed: bool = False  # its end was seen

    def openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Scan:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of the markers (kept back while streaming)."""
    n = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), n, -1):
            if text.endswith(m[:k]):
                n = k
                break
    return n


def _stable(text: str, final: bool, markers: tuple[str, ...] = ()) -> str:
    """text without what more text could still change: the start of a marker (while streaming)."""
    if final:
        return text
    n = _held(text, markers)
    return text[: len(text) - n] if n else text


def _json_args(raw: str, final: bool, fence: bool = False) -> str:
    """A JSON arguments text as far as it is stable: surrounding whitespace (and a ```json fence) dropped;
    while streaming, trailing whitespace and backticks wait, since the end may strip them."""
    s = raw.lstrip(WHITESPACE)
    if fence:
        if not final and "```json".startswith(s):
            return ""
        if s.startswith("```json"):
            s = s[len("```json") :].lstrip(WHITESPACE)
    if not final:
        return s.rstrip(WHITESPACE + ("`" if fence else ""))
    s = s.rstrip(WHITESPACE)
    if fence and s.endswith("```"):
        s = s[:-3].rstrip(WHITESPACE)
    return s


class ToolFormat:
    """A family's tool-call format. Sections begin with `begin` and end with `end`; scan() splits a text into
    content and calls, and subclasses parse a section's body (section())."""

    name = ""
    begin = ""
    end = ""

    def section(self, body: str, closed: bool, final: bool) -> list[ToolCall] | None:
        """The calls in a section's body (closed: its end was seen); None when the body is no tool call
        after all (it is then content)."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            b = text.find(self.begin, pos)
            if b < 0:
                content.append(_stable(text[pos:], final, (self.begin,)))
                break
            content.append(text[pos:b])
            start = b + len(self.begin)
            e = text.find(self.end, start)
            body = text[start : e if e >= 0 else len(text)]
            found = self.section(body, e >= 0, final)
            if found is None:
                if e < 0 and not final:
                    break  # it may yet be a call: the rest waits
                content.append(text[b : e + len(self.end) if e >= 0 else len(text)])
            else:
                calls.extend(found)
            if e < 0:
                break
            pos = e + len(self.end)
        return Scan("".join(content), calls)


class _MarkedCalls(ToolFormat):
    """Calls each `call_begin` HEADER `header_end` ARGUMENTS `call_end` (Kimi K2, DeepSeek-V3 and V3.1)."""

    call_begin = call_end = header_end = ""
    fence = False

    def header(self, text: str) -> tuple[str, str | None] | None:
        """(name, the model's id) from a header, or None while it is incomplete."""
        raise NotImplementedError

    def section(self, body: str, closed: bool, final: bool) -> list[ToolCall] | None:
        calls = []
        pos = 0
        while True:
            i = body.find(self.call_begin, pos)
            if i < 0:
                break
            h = body.find(self.header_end, i + len(self.call_begin))
            if h < 0:
                if final:  # cut off inside a header: the name is the text there
                    named = self.header(body[i + len(self.call_begin) :] + self.header_end)
                    if named is not None and named[0]:
                        calls.append(ToolCall(named[0], "", named[1]))
                break
            named = self.header(body[i + len(self.call_begin) : h + len(self.header_end)])
            if named is None:
                break
            a = h + len(self.header_end)
            end = body.find(self.call_end, a)
            raw = body[a : end if end >= 0 else len(body)]
            if end < 0:
                raw = _stable(raw, final or closed, (self.call_end,))
            args = _json_args(raw, final or closed or end >= 0, self.fence)
            calls.append(ToolCall(named[0], args, named[1], end >= 0))
            if end < 0:
                break
            pos = end + len(self.call_end)
        return calls


class KimiK2(_MarkedCalls):
    name = "kimi_k2"
    begin, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, header_end, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

    def header(self, text: str) -> tuple[str, str | None] | None:
        call_id = text[: -len(self.header_end)].strip(WHITESPACE)
        name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id  # functions.NAME:INDEX
        return name.removeprefix("functions."), call_id or None


class DeepSeekV31(_MarkedCalls):
    name = "deepseek_v3_1"
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, header_end, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

    def header(self, text: str) -> tuple[str, str | None] | None:
        return text[: -len(self.header_end)].strip(WHITESPACE), None


class DeepSeekV3(DeepSeekV31):
    """function<｜tool▁sep｜>NAME, then the arguments on the next line in a ```json fence."""

    name = "deepseek_v3"
    header_end = "\n"
    fence = True

    def header(self, text: str) -> tuple[str, str | None] | None:
        _, sep, name = text[:-1].partition("<｜tool▁sep｜>")
        return (name.strip(WHITESPACE), None) if sep else None


class Hermes(ToolFormat):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>: one call a section, known when it closes."""

    name = "hermes"
    begin, end = "<tool_call>", "</tool_call>"

    def section(self, body: str, closed: bool, final: bool) -> list[ToolCall] | None:
        if not (closed or final):
            return []
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            text = args
        else:
            text = json.dumps(args, ensure_ascii=False)
        return [ToolCall(obj["name"], text, None, True)]


class KimiK3(ToolFormat):
    """K3's tag language: a call's arguments are sent whole when the call closes."""

    name = "kimi_k3"
    begin, end = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
    call_open, call_close = "<|open|>call", "<|close|>call<|sep|>"
    _attr = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')
    _argument = re.compile(r"<\|open\|>argument([^<]*)<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>", re.S)
    _json = re.compile(r"<\|open\|>json[^<]*<\|sep\|>(.*?)<\|close\|>json<\|sep\|>", re.S)

    def _attrs(self, text: str) -> dict[str, str]:
        return {k: html.unescape(v) for k, v in self._attr.findall(text)}

    def section(self, body: str, closed: bool, final: bool) -> list[ToolCall] | None:
        calls = []
        pos = 0
        while True:
            i = body.find(self.call_open, pos)
            if i < 0:
                break
            h = body.find("<|sep|>", i)
            if h < 0:
                break
            name = self._attrs(body[i + len(self.call_open) : h]).get("tool", "")
            end = body.find(self.call_close, h)
            inner = body[h + len("<|sep|>") : end if end >= 0 else len(body)]
            done = end >= 0
            calls.append(ToolCall(name, self._arguments(inner) if done or final else "", None, done))
            if not done:
                break
            pos = end + len(self.call_close)
        return calls

    def _arguments(self, inner: str) -> str:
        block = self._json.search(inner)
        if block is not None:
            return block.group(1).strip(WHITESPACE)
        args: dict[str, Any] = {}
        for attrs, value in self._argument.findall(inner):
            a = self._attrs(attrs)
            if a.get("type", "string") == "string":
                args[a.get("key", "")] = value
                continue
            try:
                args[a.get("key", "")] = json.loads(value)
            except (ValueError, RecursionError):
                args[a.get("key", "")] = value
        return json.dumps(args, ensure_ascii=False)


class QwenXml(ToolFormat):
    """<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
    (Qwen3-Coder and later Qwen templates): the name is sent once its tag is whole, the arguments when the
    call closes. A value is text where the tool's schema says string (or says nothing), else JSON when it
    reads as JSON."""

    name = "qwen3_xml"
    begin, end = "<tool_call>", "</tool_call>"
    _function = re.compile(r"<function=([^>\n]*)>")
    _parameter = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)

    def __init__(self, types: dict[str, dict[str, Any]] | None = None):
        self.types = types or {}  # function -> parameter -> its JSON schema type

    def section(self, body: str, closed: bool, final: bool) -> list[ToolCall] | None:
        head = self._function.search(body)
        if head is None:
            return [] if not (closed or final) else None
        name = head.group(1).strip(WHITESPACE)
        if not (closed or final):
            return [ToolCall(name)]
        types = self.types.get(name, {})
        args: dict[str, Any] = {}
        for key, value in self._parameter.findall(body[head.end() :]):
            kind = types.get(key)
            if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except (ValueError, RecursionError):
                args[key] = value
        return [ToolCall(name, json.dumps(args, ensure_ascii=False), None, True)]


class NamedArguments(ToolFormat):
    """tool_choice naming a function: the whole output is that function's arguments object."""

    def __init__(self, function: str):
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [ToolCall(self.function, _json_args(text, final), None, final)])


class RequiredCalls(ToolFormat):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} (tool_schema), parsed
    when it is whole."""

    def scan(self, text: str, final: bool) -> Scan:
        if not final:
            return Scan("")
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return Scan(text)  # not what the schema allows (cut short by max_tokens): the text as it is
        if not isinstance(items, list):
            return Scan(text)
        calls = [
            ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False), None, True)
            for c in items
            if isinstance(c, dict) and isinstance(c.get("name"), str)
        ]
        return Scan("", calls)


FORMATS: dict[str, Callable[[], ToolFormat]] = {
    f.name: f for f in (KimiK2, KimiK3, DeepSeekV3, DeepSeekV31, QwenXml, Hermes)
}


def detect(template_source: str) -> ToolFormat | None:
    """The format a chat template writes an assistant's tool calls in (the model was trained to answer in
    it), or None when it writes none moestream knows."""
    s = template_source
    if "<|tool_calls_section_begin|>" in s:
        return KimiK2()
    if "<|open|>" in s and "open_tag('call'" in s:
        return KimiK3()
    if "<｜tool▁calls▁begin｜>" in s:
        return DeepSeekV3() if "tool['type']" in s else DeepSeekV31()
    if "<tool_call>" in s and "<function=" in s:
        return QwenXml()
    if "<tool_call>" in s:
        return Hermes()
    return None


def wants_mapping_arguments(template_source: str) -> bool:
    """Whether the template writes an assistant's tool-call arguments from a mapping (Kimi K3's typed
    argument tags, Qwen's XML parameters) rather than from the JSON text OpenAI's messages carry: it is
    then given the arguments parsed, as vLLM gives them, and writes them in the form the model writes."""
    return any(p in template_source for p in ("arguments is mapping", "arguments|items", "arguments | items"))


def arguments_for_template(call: dict[str, Any], as_mapping: bool) -> dict[str, Any]:
    """An OpenAI tool call as the template gets it: its arguments a mapping when as_mapping and they are a
    JSON object's text (else unchanged)."""
    function = call.get("function")
    if not (as_mapping and isinstance(function, dict) and isinstance(function.get("arguments"), str)):
        return call
    try:
        args = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": args}} if isinstance(args, dict) else call


# ---- parsing -------------------------------------------------------------------------------------


class ToolCallParser:
    """Parses one reply: `parse(text)` whole, or `feed(piece)` as it streams then `flush()` at its end, each
    returning OpenAI chat deltas ({"content": ...} or {"tool_calls": [...]}). A call's first delta carries
    index, id, type and name; the next ones carry pieces of its arguments. Ids the model does not write are
    call_<random>_<index>, the same for parse and feed of one parser."""

    def __init__(self, fmt: ToolFormat, id_prefix: str | None = None):
        self.fmt = fmt
        self.prefix = id_prefix if id_prefix is not None else f"call_{secrets.token_hex(8)}_"
        self.limit: int | None = None  # at most this many calls are kept (parallel_tool_calls false: 1)
        self.text = ""
        self._content = 0  # characters of content sent
        self._sent: list[int] = []  # per call: characters of its arguments sent
        self.calls: list[ToolCall] = []

    def call_id(self, index: int, call: ToolCall) -> str:
        return call.id or f"{self.prefix}{index}"

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the calls (OpenAI's shape) of a whole reply."""
        scan = self.fmt.scan(text, True)
        self.calls = scan.calls[: self.limit]
        return scan.content, [c.openai(self.call_id(i, c)) for i, c in enumerate(self.calls)]

    def message(self, text: str) -> dict[str, Any]:
        """A whole reply as the fields of OpenAI's assistant message: content (None when it is only
        whitespace beside calls) and tool_calls (when there are any)."""
        content, calls = self.parse(text)
        if not calls:
            return {"content": content}
        return {"content": content if content.strip(WHITESPACE) else None, "tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish_reason: "tool_calls" when it ended by itself with calls, as OpenAI's does
        (a named tool_choice is answered with "stop" there too)."""
        if self.calls and reason == "stop" and not isinstance(self.fmt, NamedArguments):
            return "tool_calls"
        return reason

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._deltas(self.fmt.scan(self.text, False))

    def flush(self) -> list[dict[str, Any]]:
        return self._deltas(self.fmt.scan(self.text, True))

    def _deltas(self, scan: Scan) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if len(scan.content) > self._content:
            out.append({"content": scan.content[self._content :]})
            self._content = len(scan.content)
        self.calls = scan.calls[: self.limit]
        for i, call in enumerate(self.calls):
            if i == len(self._sent):
                self._sent.append(0)
                head = {"index": i, "id": self.call_id(i, call), "type": "function"}
                out.append({"tool_calls": [head | {"function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self._sent[i]:
                piece = call.arguments[self._sent[i] :]
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                self._sent[i] = len(call.arguments)
        return out


# ---- tool_choice ----------------------------------------------------------------------------------


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    f = tool.get("function")
    return f if isinstance(f, dict) else {}


def named_function(tools: list[dict[str, Any]] | None, tool_choice: Any) -> dict[str, Any] | None:
    """The tool a named tool_choice ({"type": "function", "function": {"name": ...}}) picks; None for the
    other choices. InputError when it names no tool of the request."""
    if not isinstance(tool_choice, dict):
        return None
    name = _function(tool_choice).get("name")
    for tool in tools or []:
        if _function(tool).get("name") == name:
            return _function(tool)
    raise InputError(f"tool_choice names the function {name!r}, which is not in tools")


def _property_types(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters -> the JSON schema type each declares (None where it declares none)."""
    props = _parameters(function).get("properties")
    return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)} if isinstance(props, dict) else {}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def tool_schema(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool = True
) -> dict[str, Any] | None:
    """The JSON schema the output must follow for a tool_choice that forces a call, as vLLM enforces it: a
    named function, its parameters (the output is the arguments object); "required", an array of at least
    one {"name", "parameters"} object, any of the tools (at most one when not parallel_tool_calls). None
    for "auto" and "none" (the model is free)."""
    named = named_function(tools, tool_choice)
    if named is not None:
        return _parameters(named)
    if tool_choice != "required":
        return None
    if not tools:
        raise InputError("tool_choice 'required' needs tools")
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [_function(t).get("name")]},
                "parameters": _parameters(_function(t)),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,  # else a constraint lets the model add keys of its own
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def parser_for(
    tools: list[dict[str, Any]] | None, tool_choice: Any, template_source: str | None
) -> ToolCallParser | None:
    """The parser of a reply to a chat request: None when its output is not parsed (no tools, or
    tool_choice "none"); for "auto" the template's format (InputError when the template writes none this
    server knows: the client would believe the model saw its tools); for a forced call the parse of the
    schema's output (tool_schema)."""
    if not tools or tool_choice == "none":
        return None
    named = named_function(tools, tool_choice)
    if named is not None:
        return ToolCallParser(NamedArguments(str(named.get("name"))))
    if tool_choice == "required":
        return ToolCallParser(RequiredCalls())
    fmt = detect(template_source or "")
    if isinstance(fmt, QwenXml):
        fmt.types = {str(_function(t).get("name")): _property_types(_function(t)) for t in tools}
    if fmt is None:
        raise InputError(
            "tools: not supported with this model's chat template, which writes no tool-call format this server "
            "parses (Kimi K2/K3, DeepSeek-V3/V3.1, Qwen3/Hermes); tool_choice 'required' or a named function works"
        )
    return ToolCallParser(fmt)
