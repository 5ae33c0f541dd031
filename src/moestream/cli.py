"""The moestream command line: run, synth. Every user error is one line on stderr and a non-zero exit
code (2 for bad input, 1 for runtime failures, 4 for data integrity); never a traceback."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .generate import GenerationStats
    from .generation_config import GenerationDefaults

from .atomic import atomic_write
from .config import MAX_VOCAB
from .console import LiveStatus
from .errors import InputError, MoeStreamError
from .sampling import SEED_MAX
from .speculative import Speculation


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (and exit code 2), like every other user error."""

    def error(self, message: str) -> Any:
        self.exit(2, f"moestream: error: {message} (see `{self.prog} --help`)\n")


# Bounds for numbers on the command line: far above any real use, low enough that nothing downstream
# overflows or allocates for them.
MAX_TOKENS = 1 << 24  # --gen, --ctx, --max-tokens, --repeat-last-n, --prompt-tokens
MAX_THREADS = 4096
MAX_RAM = 1 << 50  # 1 PiB
MAX_NUMBER_TEXT = 64  # characters: what a number on the command line may be written in


def _number_text(s: str) -> str:
    if len(s) > MAX_NUMBER_TEXT:
        raise argparse.ArgumentTypeError(f"not a number: {s[:20]!r}... ({len(s)} characters)")
    return s


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(s: str) -> int:
        try:
            v = int(_number_text(s))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        if v > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {v}")
        return v

    return parse


def _int_at_least(low: int, high: int = MAX_TOKENS) -> Callable[[str], int]:
    return _int_in(low, high)


def _parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise InputError(f"--ids expects comma-separated integers, got {s[:100]!r}") from None


def _float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (NaN is in no range)."""

    def parse(s: str) -> float:
        try:
            v = float(_number_text(s))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {v}")
        return v

    return parse


def _ram_size(s: str) -> str:
    """An argparse type for --ram: a size (8G, 512M, 1.5GiB) between 1 byte and MAX_RAM; kept as text
    for planner.resolve_budget, which parses it again."""
    from .runtime.planner import parse_size

    try:
        size = parse_size(_number_text(s))
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--ram: ")) from None
    if not 0 < size <= MAX_RAM:
        raise argparse.ArgumentTypeError(f"must be between 1 byte and {MAX_RAM >> 50} PiB, got {s!r}")
    return s


def _ram_sizes(s: str) -> str:
    """An argparse type for bench's --ram: comma-separated sizes or max."""
    for budget in s.split(","):
        if budget.strip() not in ("", "max"):
            _ram_size(budget.strip())
    return s


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
ESCAPES_HELP = "escapes: \\n \\t \\r \\\\ \\\" \\' \\uXXXX \\UXXXXXXXX"


def unescape(s: str) -> str:
    """s with its backslash escapes read (ESCAPES, \\uXXXX, \\UXXXXXXXX; a surrogate pair of \\u escapes is
    one character), so that `--stop "\\n\\n"` means two newlines, which a shell cannot easily type.
    Anything else after a backslash, a lone surrogate or a code point beyond U+10FFFF is an InputError."""
    out: list[str] = []
    i = 0
    while i < len(s):
        if s[i] != "\\":
            out.append(s[i])
            i += 1
            continue
        e = s[i + 1 : i + 2]
        if e in ESCAPES:
            out.append(ESCAPES[e])
            i += 2
            continue
        if e not in ("u", "U"):
            what = f"\\{e}" if e else "a backslash at the end"
            raise InputError(f"bad escape {what} at character {i} (write \\\\ for a backslash; {ESCAPES_HELP})")
        width = 4 if e == "u" else 8
        code = _hex(s[i + 2 : i + 2 + width], width)
        if code is None:
            raise InputError(f"bad escape at character {i}: want \\{e} and {width} hex digits")
        i += 2 + width
        low = _hex(s[i + 2 : i + 6], 4) if s[i : i + 2] == "\\u" else None
        if 0xD800 <= code < 0xDC00 and low is not None and 0xDC00 <= low < 0xE000:  # a surrogate pair
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
            i += 6
        if 0xD800 <= code < 0xE000 or code > 0x10FFFF:
            raise InputError(f"bad escape at character {i - 2 - width}: U+{code:04X} is not a character")
        out.append(chr(code))
    return "".join(out)


def _hex(digits: str, width: int) -> int | None:
    """The number written by `width` hex digits, or None."""
    if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
        return None
    return int(digits, 16)


def _escaped(s: str) -> str:
    """An argparse type: text with backslash escapes (unescape)."""
    try:
        return unescape(s)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_arg(p: argparse.ArgumentParser, help: str, dest: str = "model", path: bool = False) -> None:
    """The model as a positional argument or as -m/--model (as other tools spell it); main() merges
    the two into args.<dest>."""
    kind: Any = Path if path else str
    p.add_argument(dest, nargs="?", type=kind, help=help)
    p.add_argument("-m", "--model", dest="model_flag", type=kind, metavar="MODEL", help=f"the same as {dest.upper()}")


def _merge_model(args: argparse.Namespace, extra: list[str] | None = None) -> None:
    """args.model set from -m/--model; both given and different is an InputError, and the commands that
    need a model refuse to run without one. pack: see _pack_paths."""
    if args.command == "pack":
        return _pack_paths(args, extra or [])
    if not hasattr(args, "model_flag"):
        return None
    given, flag = args.model, args.model_flag
    if given is not None and flag is not None and str(given) != str(flag):
        raise InputError(f"two models given: {given} and -m/--model {flag} (give one)")
    if given is None:
        args.model = flag
    if args.model is None and args.command in ("bench", "inspect"):
        raise InputError(f"{args.command}: no model given (give MODEL or -m/--model)")
    return None


def _pack_paths(args: argparse.Namespace, extra: list[str]) -> None:
    """pack's SRC and DST, with -m/--model standing for SRC. Both positionals are optional (so that
    `pack -m SRC DST` parses), and argparse then fills them from the first run of plain arguments only:
    in `pack SRC --experts q4_k DST`, DST is left among the unparsed arguments (extra) and taken here."""
    paths = [p for p in (args.src, args.dst) if p is not None] + [Path(e) for e in extra]
    flag = args.model_flag
    if flag is not None:
        if len(paths) == 2 and str(paths[0]) != str(flag):
            raise InputError(f"two models given: {paths[0]} and -m/--model {flag} (give one)")
        paths = [flag, *paths[-1:]]
    if len(paths) < 2:
        raise InputError("pack: give SRC and DST (or -m SRC DST)")
    if len(paths) > 2:
        raise InputError(f"pack: unexpected argument {paths[2]} (give SRC and DST)")
    args.src, args.dst = paths


def add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    """The sampling flags. The ones generation_config.json can set default to None: sampling_from_args
    fills them from the model's file, else from these defaults."""
    g = p.add_argument_group("sampling (greedy unless --temperature > 0)")
    model = "default: the model's generation_config.json, else"
    g.add_argument("--temperature", "--temp", type=_float_in(0, 100), default=None, help=f"{model} {temperature}")
    g.add_argument(
        "--top-k",
        type=_int_at_least(0, MAX_VOCAB),
        default=None,
        help=f"keep the k most likely tokens (0: all; {model} 0)",
    )
    g.add_argument(
        "--top-p", type=_float_in(1e-9, 1), default=None, help=f"keep the smallest set reaching p ({model} 1)"
    )
    g.add_argument(
        "--min-p", type=_float_in(0, 1), default=None, help=f"drop tokens below min-p x the top prob ({model} 0)"
    )
    g.add_argument("--repeat-penalty", type=_float_in(1e-6, 100), default=None, help=f"llama.cpp's (1: off; {model} 1)")
    g.add_argument("--presence-penalty", type=_float_in(-2, 2), default=0.0, help="OpenAI's (0: off)")
    g.add_argument("--frequency-penalty", type=_float_in(-2, 2), default=0.0, help="OpenAI's (0: off)")
    g.add_argument("--repeat-last-n", type=_int_at_least(-1), default=64, help="tokens the penalties look at (-1: all)")
    g.add_argument(
        "--seed", type=_int_in(0, SEED_MAX), default=None, help="random seed: the same seed gives the same text"
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        type=_escaped,
        metavar="TEXT",
        help=f"stop before this text (repeatable; {ESCAPES_HELP})",
    )
    p.set_defaults(default_temperature=temperature)


def sampling_from_args(args: argparse.Namespace, generation: GenerationDefaults | None = None) -> Any:
    """The flags as SamplingParams; a flag not given takes the model's generation_config.json value
    (generation), else the flag's own default."""
    from .sampling import SamplingParams

    model = generation.sampling_fields() if generation is not None else {}

    def pick(flag: float | int | None, field: str, default: float | int) -> Any:
        return flag if flag is not None else model.get(field, default)

    return SamplingParams(
        temperature=pick(args.temperature, "temperature", args.default_temperature),
        top_k=pick(args.top_k, "top_k", 0),
        top_p=pick(args.top_p, "top_p", 1.0),
        min_p=pick(args.min_p, "min_p", 0.0),
        repetition_penalty=pick(args.repeat_penalty, "repetition_penalty", 1.0),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        penalty_last_n=args.repeat_last_n,
        seed=args.seed,
        stop=tuple(args.stop),
    )


DEMO_DEFAULT = "; omitted: demo"
SOURCE_HELP = (
    "the model: a checkpoint directory, a packed store, a .gguf file (the first part of a split one), a "
    "Hugging Face id org/name[@revision] (fetched into the hub cache), or demo (the embedded model)" + DEMO_DEFAULT
)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", "-t", type=_int_at_least(1, MAX_THREADS), default=None, help="kernel threads (default: all cores)"
    )


def add_speculate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculate",
        default="auto",
        metavar="auto|off|K",
        help="verify tokens drafted from the prompt and output so far, several per pass: auto (default) chooses "
        "the draft length from the acceptance so far, K drafts up to K tokens; greedy output is the same",
    )
    p.add_argument(
        "--draft", metavar="MODEL", help="a smaller model with the same tokenizer that drafts (instead of the lookup)"
    )


def add_memory_args(p: argparse.ArgumentParser) -> None:
    from .runtime.policies import DEFAULT_POLICY, POLICIES

    mem = p.add_argument_group("memory budget (any model: experts are read from its own files)")
    mem.add_argument(
        "--ram", metavar="SIZE", type=_ram_size, help="RAM budget, e.g. 8G or 512M: experts and trunk stream from disk"
    )
    mem.add_argument("--preset", help="a named budget (laptop, desktop, workstation, server, max, auto)")
    mem.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    mem.add_argument(
        "--cache-policy", default=DEFAULT_POLICY, choices=sorted(POLICIES), help="expert cache replacement"
    )
    mem.add_argument("--no-prefetch", action="store_true", help="do not read the next layer's experts ahead")


def package_version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moestream")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="moestream",
        description="Run Mixture-of-Experts language models on a CPU, straight from their checkpoints.",
    )
    p.add_argument("--version", action="version", version=f"moestream {package_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser(
        "run",
        help="generate text from a prompt",
        description="Generation from a prompt (greedy unless --temperature is given).",
    )
    add_model_arg(r, SOURCE_HELP)
    src = r.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help="prompt text")
    src.add_argument("--prompt-file", "-f", type=Path, help="read the prompt text from this file (-: stdin)")
    src.add_argument("--ids", help="prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed)")
    r.add_argument(
        "--gen", "-n", "--max-tokens", type=_int_at_least(0), default=32, help="tokens to generate (default 32)"
    )
    r.add_argument(
        "--ctx",
        "-c",
        type=_int_at_least(1),
        default=None,
        help="the most tokens, prompt (and a loaded state) + generated: generation stops there, and a prompt "
        "that leaves no room is refused (default: no limit)",
    )
    add_threads_arg(r)
    add_speculate_arg(r)
    r.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token (checking)")
    r.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-text token")
    r.add_argument("--no-bos", action="store_true", help="do not add the BOS token to a text prompt")
    r.add_argument(
        "--no-preload",
        action="store_true",
        help="map weight pages on first use instead of reading them all at load (the default when they fit)",
    )
    r.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (prompt_ids, generated_ids, text, stats) instead of streaming text",
    )
    add_memory_args(r)
    add_sampling_args(r, temperature=0.0)
    r.add_argument(
        "--load-state", type=Path, metavar="FILE", help="continue from a saved state (the prompt follows it)"
    )
    r.add_argument("--save-state", type=Path, metavar="FILE", help="save the state at the end (continue it later)")
    r.add_argument("--report", type=Path, metavar="FILE.json", help="write the run report as JSON")
    r.add_argument("--trace", type=Path, metavar="FILE.jsonl", help="record the experts each MoE layer asks for")
    r.add_argument(
        "--dump-logits",
        type=Path,
        metavar="FILE.npy",
        help="save the logits each generated token was chosen from, float32 [gen, vocab]",
    )

    c = sub.add_parser(
        "chat",
        help="multi-turn chat on kept state",
        description="Chat with a model: the conversation is rendered with its chat template (a fallback for "
        "base models) and each turn prefills only what is new. Type /reset to start over, /exit to leave. "
        "When stdin is not a terminal each line is one user turn.",
    )
    add_model_arg(c, SOURCE_HELP)
    c.add_argument("--system", "-s", type=_escaped, help=f"system prompt ({ESCAPES_HELP})")
    c.add_argument(
        "--gen", "-n", "--max-tokens", type=_int_at_least(1), default=256, help="most tokens per reply (default 256)"
    )
    c.add_argument(
        "--history",
        type=Path,
        metavar="FILE.jsonl",
        help="resume from and append to this history (one message a line; /reset is recorded)",
    )
    c.add_argument(
        "--ctx", "-c", type=_int_at_least(1), default=4096, help="most tokens in the conversation (default 4096)"
    )
    add_threads_arg(c)
    add_speculate_arg(c)
    c.add_argument("--verbose", "-v", action="store_true", help="after each reply, the tokens prefilled and tok/s")
    c.add_argument(
        "--allow-special-in-content",
        action="store_true",
        help="read special-token strings in messages as special tokens (by default they are plain text, so a "
        "message cannot forge the template's role markers)",
    )
    add_memory_args(c)
    add_sampling_args(c, temperature=0.0)

    v = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve /v1/models, /v1/completions, /v1/chat/completions (streaming or not) and /health. "
        "Up to --max-batch requests are decoded together, one forward pass a step, each getting exactly what it "
        "would get alone; more wait in arrival order; a client that leaves is dropped. SIGTERM or "
        "SIGINT ends the requests in flight (with an error saying so) and exits 0. Also /metrics (Prometheus), "
        "/tokenize and /detokenize.",
    )
    add_model_arg(v, SOURCE_HELP)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=_int_in(0, 65535), default=8000, help="port (default 8000; 0: any free port)")
    v.add_argument("--model-name", help="the model id clients use (default: the directory name)")
    v.add_argument("--ctx", "-c", type=_int_at_least(1), default=4096, help="most tokens per request, prompt + reply")
    v.add_argument("--max-tokens", type=_int_at_least(1), default=1024, help="most tokens a request may generate")
    v.add_argument(
        "--max-batch",
        "--parallel",
        "-np",
        type=_int_in(1, 256),
        default=8,
        help="requests decoded together (default 8; 1: one at a time); under --ram the plan holds KV for each",
    )
    v.add_argument(
        "--header-timeout",
        type=_float_in(0.1, 3600),
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request (headers and body) has not arrived whole in this time (default 10)",
    )
    v.add_argument(
        "--keep-alive-timeout",
        type=_float_in(1, 3600),
        default=5.0,
        metavar="SECONDS",
        help="close a keep-alive connection idle this long (default 5)",
    )
    v.add_argument("--docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    v.add_argument(
        "--api-key",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health (default: $MOESTREAM_API_KEY, else none)",
    )
    v.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let browser pages from this origin (https://host[:port]) call the server; repeatable (default: none)",
    )
    v.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="log to stderr from this level; info adds an access log line per request (default warning)",
    )
    add_threads_arg(v)
    add_speculate_arg(v)
    add_memory_args(v)

    d = sub.add_parser(
        "doctor",
        help="what this machine can do: CPU, memory, disk bandwidth, the preset to use",
        description="CPU features and cores, RAM and the cgroup limit, the O_DIRECT read bandwidth of the "
        "model's disk, and the preset recommended for the model with its expected seconds per token.",
    )
    add_model_arg(d, SOURCE_HELP)
    d.add_argument(
        "--seconds", type=_float_in(0.01, 3600), default=2.0, help="how long to measure the disk (default 2)"
    )

    b = sub.add_parser(
        "bench",
        help="the memory ladder: speed and traffic at several RAM budgets",
        description="Runs the same prompt at each budget (each in its own process) and prints s/token, expert "
        "hit rate, GB read per token and peak RSS; --plot writes them as a PNG (needs matplotlib: "
        "pip install 'moestream[plot]').",
    )
    add_model_arg(b, SOURCE_HELP.removesuffix(DEMO_DEFAULT))
    b.add_argument(
        "--ram", required=True, type=_ram_sizes, help="budgets, comma-separated, e.g. 2G,4G,8G (max: everything)"
    )
    b.add_argument("--prompt-tokens", type=_int_at_least(1), default=32, help="prompt length (default 32)")
    b.add_argument(
        "--gen", "-n", "--max-tokens", type=_int_at_least(2), default=16, help="tokens to generate (default 16)"
    )
    add_threads_arg(b)
    b.add_argument("--plot", type=Path, metavar="FILE.png", help="write the ladder as a PNG")
    b.add_argument("--json", type=Path, metavar="FILE.json", help="write the rows as JSON")

    i = sub.add_parser(
        "inspect",
        help="describe a model: architecture, layers, parameters, bytes",
        description="Architecture, layer map, parameter counts (total and active per token) and the bytes of "
        "trunk and routed experts. Needs only config.json; with weights present the bytes are measured.",
    )
    add_model_arg(i, SOURCE_HELP.removesuffix(DEMO_DEFAULT) + ", or a config.json")

    k = sub.add_parser(
        "pack",
        help="rewrite a checkpoint or a GGUF as a packed store (optional: every model streams as it is)",
        description="Rewrite a checkpoint or a GGUF once into a packed store: a manifest, the trunk with each "
        "layer contiguous and 4096-aligned, and one aligned blob per (layer, expert). Matrices can be "
        "requantized; `keep` leaves them in the source's format (a GGUF's block formats included). Written "
        "atomically and verified.",
    )
    from .formats.packed import PACK_FORMATS

    add_model_arg(k, "checkpoint directory, or a .gguf file (the first part of a split one)", dest="src", path=True)
    k.add_argument("dst", type=Path, nargs="?", help="output directory")
    k.add_argument(
        "--experts",
        default="keep",
        choices=PACK_FORMATS,
        help="format of routed experts (q4_k_m: llama.cpp's Q4_K_M mix)",
    )
    k.add_argument("--trunk", default="keep", choices=PACK_FORMATS, help="format of the other matrices")
    k.add_argument("--force", action="store_true", help="replace DST if it exists")
    k.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="pack float tensors with NaN or Inf values as they are (refused by default; a run of such a "
        "model stops with exit 4 at the first non-finite logits)",
    )
    k.add_argument(
        "--threads",
        "-t",
        type=_int_at_least(1, MAX_THREADS),
        default=None,
        help="matrix row chunks converted at once (default: all cores); the store is the same for any count",
    )
    k.add_argument(
        "--report",
        action="store_true",
        help="print the relative RMS weight error per tensor class and the KL divergence of the output "
        "distribution against the source on a sample prompt",
    )

    s = sub.add_parser(
        "synth",
        help="write a random-weight checkpoint",
        description="Write a random-weight checkpoint of a supported architecture (tests, benchmarks).",
    )
    from .synth import ARCHS

    s.add_argument("--arch", required=True, choices=ARCHS, help="architecture (config.json model_type)")
    s.add_argument("out", type=Path, help="output directory (written atomically)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"], help="weight dtype (default bf16)")
    s.add_argument("--seed", type=_int_in(0, SEED_MAX), default=0, help="random seed (default 0)")
    s.add_argument(
        "--shard-size", type=_float_in(1e-9, 1e6), default=2.0, metavar="GB", help="max shard size in GB (default 2)"
    )
    s.add_argument("--force", action="store_true", help="replace OUT if it exists")
    s.add_argument(
        "--full",
        action="store_true",
        help="kimi_k3: start from the released K3 widths (--set then changes e.g. num_hidden_layers, num_experts)",
    )
    importlib.import_module(".hub", __package__).add_download_parser(sub)
    return p


def _read_prompt(args: argparse.Namespace, model: Any, allow_empty: bool = False) -> list[int]:
    """The prompt's ids. A text prompt is raw (no template): special-token strings in it are read as the
    special tokens, as llama.cpp reads raw prompts."""
    from .tokenizer import decode_utf8

    if allow_empty and args.ids is None and args.prompt_file is None and args.prompt is None:
        return []
    if args.ids is not None:
        ids = _parse_ids(args.ids)
    elif args.prompt_file is not None:
        try:
            data = sys.stdin.buffer.read() if str(args.prompt_file) == "-" else args.prompt_file.read_bytes()
        except FileNotFoundError:
            raise InputError(f"prompt file {args.prompt_file} does not exist") from None
        except OSError as e:
            raise InputError(f"cannot read prompt file {args.prompt_file}: {e}") from None
        what = "the prompt on stdin" if str(args.prompt_file) == "-" else f"prompt file {args.prompt_file}"
        text = decode_utf8(data, what)
        ids = model.tokenize(text, add_bos=False if (args.no_bos or allow_empty) else None)
    elif args.prompt is not None:
        ids = model.tokenize(args.prompt, add_bos=False if (args.no_bos or allow_empty) else None)
    else:
        raise InputError("no prompt: give --prompt TEXT, --prompt-file PATH or --ids 1,2,3")
    return list(model.check_ids(ids))


def _gen_within_ctx(args: argparse.Namespace, held: int) -> int:
    """--gen, cut so that the `held` tokens (a loaded state and the prompt) and the generated ones fit in
    --ctx; a prompt that leaves no room for one token is an InputError."""
    if args.ctx is None:
        return int(args.gen)
    if held > args.ctx or (held == args.ctx and args.gen > 0):
        raise InputError(
            f"the prompt is {held} tokens, which leaves no room to generate within --ctx {args.ctx} "
            "(raise --ctx or shorten the prompt)"
        )
    return min(int(args.gen), args.ctx - held)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic_write(path) as f:
        np.save(f, arr)


def cmd_run(args: argparse.Namespace) -> int:
    from .generate import GenerationStats, load
    from .runtime import planner

    if args.list_presets:
        planner.print_presets()
        return 0
    budget = planner.resolve_budget(args.ram, args.preset)
    speculation = Speculation.parse(args.speculate)
    model = load(args.model, threads=args.threads, preload=False if (args.no_preload or budget is not None) else None)
    model.speculation = speculation
    if args.draft is not None:
        model.use_draft(args.draft)
    name = model.name
    sampling = sampling_from_args(args, model.generation)
    state = model.new_state()
    pending: list[int] = []
    if args.load_state is not None:
        from .state_file import load_state

        state, pending = load_state(args.load_state, model)
    prompt = pending + _read_prompt(args, model, allow_empty=bool(pending))
    args.gen = _gen_within_ctx(args, len(state.ids) + len(prompt))
    targets = [("--dump-logits", args.dump_logits), ("--report", args.report), ("--trace", args.trace)]
    for flag, target in [*targets, ("--save-state", args.save_state)]:
        if target is not None and not target.parent.is_dir():
            raise InputError(f"{flag}: directory {target.parent} does not exist")
    if not args.json and model.tokenizer is None:
        raise InputError(f"{name}: the model has no tokenizer; use --json to get the generated ids")
    if sampling.stop and model.tokenizer is None:
        raise InputError(f"{name}: --stop needs a tokenizer (the model has none)")
    if budget is not None:
        model.use_budget(
            budget,
            context=len(state.ids) + len(prompt) + args.gen,
            prompt_tokens=len(prompt),
            policy=args.cache_policy,
            prefetch=not args.no_prefetch,
        )
    streaming = model.streaming
    trace = None
    if args.trace is not None:
        from .runtime.streaming import record_trace

        trace = record_trace(model, streaming)
    logits: list[np.ndarray] = []
    stats = GenerationStats()
    generated: list[int] = []
    text_out = model.tokenizer is not None
    out = sys.stdout
    live = LiveStatus(out, enabled=None if not args.json else False)
    gen_kwargs: dict[str, Any] = {
        "use_cache": not args.no_cache,
        "logits_out": logits if args.dump_logits is not None else None,
    }
    try:
        if text_out:
            stream = model.complete(
                prompt,
                args.gen,
                sampling=sampling,
                state=state,
                stop_at_eos=not args.ignore_eos,
                stats=stats,
                progress=None,
                **gen_kwargs,
            )
            for piece in stream:
                if streaming is not None and len(stream.tokens) == 1:
                    streaming.mark_prefill_done()
                if not args.json:
                    out.write(piece)
                    out.flush()
                    live.update(_live_text(stats))
            generated = stream.tokens
            text, finish = stream.text, stream.finish_reason
        else:
            for token in model.generate(
                prompt,
                args.gen,
                sampling=sampling,
                state=state,
                stop_at_eos=not args.ignore_eos,
                stats=stats,
                **gen_kwargs,
            ):
                generated.append(token)
                if streaming is not None and len(generated) == 1:
                    streaming.mark_prefill_done()
            text, finish = None, ("stop" if generated and generated[-1] in model.eos_ids else "length")
    finally:
        live.close()
        model.close()
    if args.save_state is not None:
        from .state_file import save_state

        pending = generated[-1:] if generated and (args.ignore_eos or generated[-1] not in model.eos_ids) else []
        save_state(args.save_state, model, state, pending)
    if args.dump_logits is not None:
        arr = np.stack(logits).astype(np.float32) if logits else np.zeros((0, model.vocab_size), np.float32)
        _save_npy(args.dump_logits, arr)
    report = model.report(stats)
    if args.report is not None:
        _write_text(args.report, json.dumps(report, indent=2) + "\n")
    if trace is not None:
        _write_text(args.trace, "".join(json.dumps({"layer": la, "experts": ids}) + "\n" for la, ids in trace))
    if args.json:
        obj = {
            "model": str(model.path),
            "prompt_ids": prompt,
            "generated_ids": generated,
            "text": text,
            "finish_reason": finish,
            "stats": {**stats.as_dict(), "threads": model.threads},
        }
        out.write(json.dumps(obj) + "\n")
    else:
        out.write("\n")
        print(
            f"prompt: {stats.prompt_tokens} tokens in {stats.prefill_seconds:.3f} s "
            f"({stats.prefill_tokens_per_second:.1f} tok/s) | generated: {stats.generated_tokens} tokens, "
            f"decode {stats.decode_tokens_per_second:.2f} tok/s | threads {model.threads}",
            file=sys.stderr,
        )
        if streaming is not None:
            r = report["streaming"]
            print(
                f"memory: {streaming.plan.describe()}\n"
                f"experts: {r['expert_requests']} requests, hit rate {100 * r['hit_rate']:.1f}%, "
                f"{r['bytes_read_per_token'] / 1e6:.1f} MB read per token at {r['read_mb_s']:.0f} MB/s, "
                f"prefetch accuracy {100 * r['prefetch_accuracy']:.1f}%, {r['read_seconds_hidden']:.2f} s of "
                f"{r['read_seconds']:.2f} s reading hidden | peak RSS {report['peak_rss'] / 2**20:.1f} MB",
                file=sys.stderr,
            )
        sp = report["speculation"]
        if sp["drafts_proposed"]:
            print(
                f"speculation {sp['mode']}: {sp['drafts_accepted']} of {sp['drafts_proposed']} drafts accepted, "
                f"{sp['tokens_per_pass']:.2f} tokens per decoding pass",
                file=sys.stderr,
            )
    return 0


def _live_text(stats: GenerationStats) -> str:
    n = stats.generated_tokens
    rate = (n - 1) / stats.decode_seconds if n > 1 and stats.decode_seconds > 0 else 0.0
    return f"moestream | prompt {stats.prompt_tokens} tok | generated {n} tok | {rate:.1f} tok/s"


def _write_text(path: Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def _size(n: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat import ChatSession
    from .generate import load_from_args
    from .runtime import planner

    if args.list_presets:
        planner.print_presets()
        return 0
    model = load_from_args(args, chat=True)
    session = ChatSession(
        model,
        system=args.system,
        sampling=sampling_from_args(args, model.generation),
        max_new_tokens=args.gen,
        max_context=args.ctx,
        allow_special_in_content=args.allow_special_in_content,
    )
    if args.history is not None and args.history.exists():
        session.load_history(args.history)
    elif args.history is not None and not args.history.parent.is_dir():
        raise InputError(f"--history: directory {args.history.parent} does not exist")
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing for input())
        except ImportError:
            pass
        print(f"moestream chat: {model.path} ({session.template.name} template). /reset, /exit", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> " if tty else "")
            except EOFError:
                break
            cmd = line.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                if args.history is not None:  # a resumed chat starts after it, as this one does now
                    _append_reset(args.history)
                print("(conversation reset)", file=sys.stderr)
                continue
            if not cmd:
                continue
            n_before = len(session.messages)
            try:
                stream, turn = session.send(line)
            except InputError as e:  # this turn cannot run; the conversation goes on
                print(f"moestream: error: {e}", file=sys.stderr)
                continue
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            session.finish()
            sys.stdout.write("\n")
            sys.stdout.flush()
            if args.history is not None:
                session.append_history(args.history, session.messages[n_before:])
            if args.verbose:
                g = turn.generation
                how = "state rebuilt" if turn.rebuilt else f"{turn.kept_tokens} kept"
                print(
                    f"[prefilled {turn.prefilled_tokens} tokens ({how}) in {g.prefill_seconds:.3f} s | "
                    f"{g.generated_tokens} tokens, {g.decode_tokens_per_second:.1f} tok/s]",
                    file=sys.stderr,
                )
    finally:
        model.close()
    return 0


def _append_reset(path: Path) -> None:
    from .chat import RESET_LINE

    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(RESET_LINE) + "\n")


def cmd_inspect(args: argparse.Namespace) -> int:
    from .formats.checkpoint import read_json
    from .formats.packed import PackedStore
    from .generate import open_store
    from .models import read_spec
    from .models.inventory import inventory, is_routed_expert, layer_map
    from .sources import resolve

    name = str(args.model)
    store: Any = None
    if name.endswith(".json"):  # a config alone: the bytes as the released checkpoint stores them
        cfg_path = Path(name)
        if not cfg_path.exists():
            raise InputError(f"{cfg_path} does not exist")
        config = read_json(cfg_path, "config.json")
        if not isinstance(config, dict):
            raise InputError(f"{cfg_path}: corrupt config.json (not an object)")
    else:
        src = resolve(name, config_only=True)
        if src.kind == "checkpoint" and not any(src.path.glob("*.safetensors")):
            config = read_json(src.path / "config.json", "config.json") if (src.path / "config.json").exists() else None
            if not isinstance(config, dict):
                raise InputError(f"{src.path}: no config.json and no weights")
        else:
            store = open_store(src, preload=False)
            config = store.config
    spec = read_spec(config)
    inv = inventory(config)
    if isinstance(store, PackedStore):
        expert_b = int(store.maps["experts"].size)
        trunk_b = store.nbytes - expert_b
    elif store is not None:
        trunk_b = sum(i.nbytes for n, i in store.tensors.items() if not is_routed_expert(n))
        expert_b = sum(i.nbytes for n, i in store.tensors.items() if is_routed_expert(n))
    else:  # as stored by the released checkpoints: bf16 trunk; MXFP4 (K3) or bf16 experts
        trunk_b = 2 * inv.trunk_params
        expert_b = inv.expert_params * 17 // 32 if spec.model_type == "kimi_k3" else 2 * inv.expert_params
    how = (
        "measured"
        if store is not None
        else "as released (bf16 trunk" + (", MXFP4 experts)" if spec.model_type == "kimi_k3" else ")")
    )
    print(f"model: {name}")
    print(
        f"architecture: {spec.model_type}, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}"
    )
    print(f"layers: {layer_map(spec)}")
    print("        (K = KDA, M = MLA, G = GQA attention; lower case = dense FFN, upper case = MoE)")
    print(
        f"parameters: {_size(inv.total_params, '')} total, {_size(inv.active_params, '')} active per token "
        f"({inv.top_k} of {inv.n_experts // max(inv.moe_layers, 1)} experts in each of {inv.moe_layers} MoE layers)"
    )
    print(f"  trunk (everything but routed experts): {_size(inv.trunk_params, '')} parameters, {_size(trunk_b, 'B')}")
    per = expert_b / inv.n_experts if inv.n_experts else 0
    print(
        f"  routed experts: {_size(inv.expert_params, '')} parameters, {_size(expert_b, 'B')} "
        f"({inv.n_experts:,} experts of {_size(per, 'B')})"
    )
    print(f"bytes: {how}")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from .formats.packed import Report, pack

    report = Report({}, {}, {}) if args.report else None
    out = pack(
        args.src,
        args.dst,
        experts=args.experts,
        trunk=args.trunk,
        force=args.force,
        report=report,
        threads=args.threads,
        allow_nonfinite=args.allow_nonfinite,
    )
    print(out)
    if report is not None:
        from .generate import load
        from .quality import kl_divergence, sample_ids

        src, packed = load(args.src), load(out)
        ids = sample_ids(src)
        kl = kl_divergence(src.logits(ids), packed.logits(ids))
        print(f"{'tensor class':<22} {'format':<12} relative RMS error")
        for cls, fmt, err in report.rows():
            print(f"{cls:<22} {fmt:<12} {err:.4f}")
        print(f"KL(source || packed) over {len(ids)} positions: mean {kl.mean():.5f}, max {kl.max():.5f} nats")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from .synth import parse_set, synth

    if args.shard_size <= 0:
        raise InputError("--shard-size must be positive")
    overrides = parse_set(args.set)
    if args.full:
        if args.arch != "kimi_k3":
            raise InputError("--full is for --arch kimi_k3")
        from .synth import k3_full

        overrides = k3_full(overrides)
    out = synth(
        args.arch,
        args.out,
        overrides,
        dtype=args.dtype,
        seed=args.seed,
        shard_bytes=int(args.shard_size * 1e9),
        force=args.force,
    )
    print(out)
    return 0


# command -> (module, function); modules are imported only for the command that runs
COMMANDS = {
    "run": (".cli", "cmd_run"),
    "chat": (".cli", "cmd_chat"),
    "serve": (".server", "cmd_serve"),
    "doctor": (".doctor", "cmd_doctor"),
    "bench": (".ladder", "cmd_bench"),
    "inspect": (".cli", "cmd_inspect"),
    "pack": (".cli", "cmd_pack"),
    "synth": (".cli", "cmd_synth"),
    "download": (".hub", "cmd_download"),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "pack" or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _merge_model(args, extra)
        module, name = COMMANDS[args.command]
        return int(getattr(importlib.import_module(module, __package__), name)(args))
    except MoeStreamError as e:
        sys.stdout.flush()
        print(f"moestream: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
