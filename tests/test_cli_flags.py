"""The flags a newcomer types from other tools, through the real command line: -m/--model beside the
positional source, --max-tokens as --gen, run -c/--ctx, --version, --prompt-file - (stdin), escapes in
--stop and --system, /reset recorded in chat --history, bench --plot refused before any run when
matplotlib is missing."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

import moestream
from moestream.chat import ChatSession
from moestream.cli import _merge_model, build_parser, unescape
from moestream.default_model import default_model_path
from moestream.errors import InputError
from moestream.formats.packed import pack
from test_cli import ENV, assert_user_error, cli

PROMPT = "import os\n"
DEMO = str(default_model_path())


def run_json(*args: str, input_text: str | None = None) -> dict:
    """The JSON `run` prints, without its timings."""
    p = cli("run", "--json", *args, input_text=input_text)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    del out["stats"]
    return out


@pytest.fixture(scope="module")
def greedy() -> dict:
    """The demo's greedy reply to PROMPT: 24 tokens."""
    return run_json("--prompt", PROMPT, "--gen", "24")


# ---- -m/--model ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, dest",
    [
        (["run"], "model"),
        (["chat"], "model"),
        (["serve"], "model"),
        (["doctor"], "model"),
        (["bench", "--ram", "1G"], "model"),
        (["inspect"], "model"),
        (["pack", "DST"], "src"),
        (["pack", "--experts", "keep", "DST"], "src"),
    ],
)
def test_model_flag_on_every_command_that_takes_a_model(argv, dest):
    parser = build_parser()
    for form in (["-m", "X"], ["--model", "X"], ["X"], ["X", "-m", "X"]):
        args, extra = parser.parse_known_args([argv[0], *form, *argv[1:]])
        _merge_model(args, extra)
        assert str(getattr(args, dest)) == "X"
        assert argv[0] != "pack" or str(args.dst) == "DST"
    args, extra = parser.parse_known_args([argv[0], "X", "-m", "Y", *argv[1:]])
    with pytest.raises(InputError, match=r"^two models given: X and -m/--model Y \(give one\)$"):
        _merge_model(args, extra)


def test_model_flag_runs_the_same_model(greedy):
    for form in (["-m", DEMO], ["--model", DEMO], [DEMO, "--model", DEMO]):
        assert run_json(*form, "--prompt", PROMPT, "--gen", "24") == greedy


def test_two_different_models_are_one_line(small_case):
    assert_user_error(
        cli("run", DEMO, "-m", str(small_case.path), "--prompt", "x"),
        f"two models given: {DEMO} and -m/--model {small_case.path} (give one)",
    )


def test_inspect_and_pack_take_model_flag(small_case, tmp_path):
    a, b = cli("inspect", str(small_case.path)), cli("inspect", "-m", str(small_case.path))
    assert a.returncode == 0 and a.stdout == b.stdout and "architecture: qwen3_moe" in a.stdout
    out = tmp_path / "packed"
    p = cli("pack", "-m", str(small_case.path), str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out) and (out / "config.json").exists()


def test_commands_that_need_a_model_say_so():
    assert_user_error(cli("bench", "--ram", "1G"), "bench: no model given (give MODEL or -m/--model)")
    assert_user_error(cli("inspect"), "inspect: no model given (give MODEL or -m/--model)")
    assert_user_error(cli("pack", "DST"), "pack: give SRC and DST (or -m SRC DST)")
    assert_user_error(cli("pack", "A", "B", "C"), "pack: unexpected argument C (give SRC and DST)")
    assert_user_error(cli("run", "--bogus"), "unrecognized arguments: --bogus")


# ---- --max-tokens, -c/--ctx, --version, --prompt-file - ------------------------------------------


def test_max_tokens_is_gen(greedy):
    assert run_json("--prompt", PROMPT, "--max-tokens", "24") == greedy
    short = run_json("--prompt", PROMPT, "--max-tokens", "5")
    assert short["generated_ids"] == greedy["generated_ids"][:5]


def test_short_and_long_spellings_parse_alike():
    parser = build_parser()
    for argv, dest, value in [
        (["chat", "-c", "100"], "ctx", 100),
        (["serve", "-c", "100"], "ctx", 100),
        (["run", "-c", "100"], "ctx", 100),
        (["chat", "--max-tokens", "7"], "gen", 7),
        (["bench", "x", "--ram", "1G", "--max-tokens", "7"], "gen", 7),
        (["serve", "--max-tokens", "7"], "max_tokens", 7),  # serve's own: the most a request may ask for
    ]:
        assert getattr(parser.parse_args(argv), dest) == value, argv
    assert parser.parse_args(["run"]).ctx is None


def test_ctx_bounds_prompt_plus_generated(greedy):
    n = len(greedy["prompt_ids"])
    out = run_json("--prompt", PROMPT, "--gen", "24", "-c", str(n + 7))
    assert out["generated_ids"] == greedy["generated_ids"][:7] and out["finish_reason"] == "length"
    assert run_json("--prompt", PROMPT, "--gen", "24", "--ctx", str(n + 24))["generated_ids"] == greedy["generated_ids"]
    for ctx in (n, n - 1):
        assert_user_error(
            cli("run", "--prompt", PROMPT, "-c", str(ctx)),
            f"the prompt is {n} tokens, which leaves no room to generate within --ctx {ctx} "
            "(raise --ctx or shorten the prompt)",
        )
    assert_user_error(cli("run", "--prompt", PROMPT, "-c", "0"), "argument --ctx/-c: must be at least 1, got 0")


def test_version():
    p = cli("--version")
    assert p.returncode == 0 and p.stdout == f"moestream {version('moestream')}\n" and p.stderr == ""
    assert version("moestream") == moestream.__version__


def test_prompt_file_dash_reads_stdin(greedy, tmp_path):
    assert run_json("--prompt-file", "-", "--gen", "24", input_text=PROMPT) == greedy
    f = tmp_path / "-"  # a file named "-" is still reachable by a longer path
    f.write_text(PROMPT)
    assert run_json("--prompt-file", str(f), "--gen", "24") == greedy
    assert_user_error(cli("run", "--prompt-file", "-", "--no-bos", input_text=""), "the prompt is empty")


def test_prompt_file_dash_refuses_bad_utf8():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "moestream.cli", "run", "--prompt-file", "-"],
        input=b"ab\xffc",
        capture_output=True,
        env=ENV,
        timeout=300,
    )
    assert p.returncode == 2 and p.stdout == b""
    assert p.stderr.decode() == "moestream: error: the prompt on stdin is not valid UTF-8 (byte 0xff at offset 2)\n"


# ---- escapes in --stop and --system --------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        (r"\n\n", "\n\n"),
        (r"a\tb\rc", "a\tb\rc"),
        (r"\\n", "\\n"),
        (r"say \"hi\" \'x\'", "say \"hi\" 'x'"),
        (r"\u00e9\u4e2d", "é中"),
        (r"\ud83d\ude42!", "🙂!"),
        (r"\U0001F642", "🙂"),
        ("plain: ünï 🙂", "plain: ünï 🙂"),
        ("", ""),
    ],
)
def test_unescape(text, want):
    assert unescape(text) == want


@pytest.mark.parametrize(
    "text, message",
    [
        (r"\q", r"bad escape \q at character 0 (write \\ for a backslash; escapes:"),
        ("ab\\", r"bad escape a backslash at the end at character 2"),
        (r"x\u12", r"bad escape at character 1: want \u and 4 hex digits"),
        (r"\u12zz", r"bad escape at character 0: want \u and 4 hex digits"),
        (r"\U0011FFFF", r"bad escape at character 0: U+11FFFF is not a character"),
        (r"\ud800", r"bad escape at character 0: U+D800 is not a character"),
        (r"a\ude42", r"bad escape at character 1: U+DE42 is not a character"),
    ],
)
def test_bad_escapes(text, message):
    with pytest.raises(InputError) as e:
        unescape(text)
    assert str(e.value).startswith(message), str(e.value)


def escaped(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def test_stop_with_an_escaped_newline(greedy):
    text = greedy["text"]
    at = text.index("\n")
    stop = text[at : at + 2]
    assert "\n" in stop and len(stop) == 2
    out = run_json("--prompt", PROMPT, "--gen", "24", "--stop", escaped(stop))
    assert out["text"] == text[: text.index(stop)] and out["finish_reason"] == "stop"
    # the backslash itself, escaped, is a stop string that never occurs: the whole reply
    assert run_json("--prompt", PROMPT, "--gen", "24", "--stop", r"\\n")["text"] == text


def test_bad_escape_in_stop_and_system_is_one_line():
    assert_user_error(cli("run", "--prompt", "x", "--stop", r"\x41"), r"argument --stop: bad escape \x at character 0")
    assert_user_error(cli("chat", "--system", "a\\"), "argument --system/-s: bad escape a backslash at the end")


def test_system_with_escapes():
    assert build_parser().parse_args(["chat", "--system", r"You write Python.\nBe brief."]).system == (
        "You write Python.\nBe brief."
    )
    a = cli("chat", "--gen", "12", "--system", r"You write Python.\nBe brief.", input_text="def f(x):\n")
    b = cli("chat", "--gen", "12", "--system", "You write Python.\nBe brief.", input_text="def f(x):\n")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


# ---- chat --history and /reset -------------------------------------------------------------------


def prefilled(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[prefilled")]


def test_reset_is_recorded_and_a_resumed_chat_starts_after_it(tmp_path):
    hist = tmp_path / "h.jsonl"
    p = cli("chat", "--gen", "8", "--history", str(hist), input_text="hello\n/reset\nsecond\n")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in hist.read_text().splitlines()]
    assert [m.get("role", m) for m in lines] == ["user", "assistant", {"reset": True}, "user", "assistant"]
    assert lines[3]["content"] == "second"

    # resumed: the conversation is the turn after the reset, so the prefill is that turn plus the new one
    demo = moestream.load()
    after = ChatSession(demo)
    after.messages = lines[3:5]
    want = len(after.conversation_ids("third")[0])
    everything = ChatSession(demo)
    everything.messages = [lines[0], lines[1], *lines[3:5]]
    assert len(everything.conversation_ids("third")[0]) != want
    p = cli("chat", "--gen", "8", "-v", "--history", str(hist), input_text="third\n")
    assert p.returncode == 0, p.stderr
    assert prefilled(p.stderr)[0].startswith(f"[prefilled {want} tokens (0 kept)")

    session = ChatSession(demo)
    session.load_history(hist)
    assert session.messages == lines[3:5] + [json.loads(line) for line in hist.read_text().splitlines()[5:]]


def test_history_ending_in_reset_resumes_empty_and_keeps_the_system_prompt(tmp_path):
    hist = tmp_path / "h.jsonl"
    hist.write_text('{"role": "user", "content": "a"}\n{"role": "assistant", "content": "b"}\n{"reset": true}\n')
    s = ChatSession(moestream.load(), system="sys")
    s.load_history(hist)
    assert s.messages == [{"role": "system", "content": "sys"}]
    hist.write_text('{"role": "user", "content": "a"}\n{"reset": false}\n')
    assert_user_error(
        cli("chat", "--history", str(hist), input_text=""),
        "each line must be {'role': ..., 'content': ...} or {'reset': true}",
    )


# ---- bench --plot without matplotlib -------------------------------------------------------------


def test_bench_plot_without_matplotlib_is_refused_before_any_run(small_case, tmp_path):
    packed = pack(small_case.path, tmp_path / "packed", experts="keep", trunk="keep", progress=False)
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    path = ENV.get("PYTHONPATH", "")
    env = {**ENV, "PYTHONPATH": f"{fake}:{path}" if path else str(fake)}
    png = tmp_path / "ladder.png"
    p = cli("bench", str(packed), "--ram", "max", "--gen", "2", "--plot", str(png), env=env)
    assert_user_error(p, "--plot needs matplotlib: pip install 'moestream[plot]'")  # one line: no "budget ..."
    assert not png.exists()


def test_readme_stop_example_parses():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert '--stop "\\n\\n"' in readme
    args = build_parser().parse_args(["run", "--stop", "\\n\\n", "--stop", "def "])
    assert args.stop == ["\n\n", "def "]
