"""Chat on kept state and state files: a second turn gives the tokens a fresh run over the whole
conversation gives while prefilling only the new turn; the model's own chat template is used when it
ships one; saved states continue exactly where they stopped and are refused by any other model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import moestream
from moestream.chat import ChatSession, load_template
from moestream.default_model import default_model_path
from moestream.errors import InputError
from moestream.state_file import load_state, save_state
from test_cli import assert_user_error, cli


@pytest.fixture(scope="module")
def demo():
    return moestream.load()


def test_second_turn_continues_the_state_and_matches_a_fresh_run(demo):
    chat = ChatSession(demo, system="You write Python.", max_new_tokens=20)
    turns = []
    for user in ("def add(a, b):", "Now subtract.", "And multiply?"):
        stream, turn = chat.send(user)
        text = "".join(stream)
        chat.finish()
        turns.append((stream.tokens, turn, text))
        # a fresh run over the whole conversation as fed (kept ids + the new turn's ids)
        fed = chat.state.ids[: turn.kept_tokens + turn.prefilled_tokens]
        fresh = list(demo.generate(fed, 20))
        assert fresh == stream.tokens, user
    first, second, third = (t[1] for t in turns)
    assert first.kept_tokens == 0 and not first.rebuilt
    for t in (second, third):
        assert not t.rebuilt and t.kept_tokens > 0
        assert t.generation.prompt_tokens == t.prefilled_tokens  # only the new turn was prefilled
    # the rendered conversation, tokenized from scratch, is what the state was fed
    text = chat.template.render(chat.messages[:-1], add_generation_prompt=True)
    full = demo.tokenize(text, add_bos=False)
    assert chat.state.ids[: len(full)] == full
    assert third.prefilled_tokens < len(full) / 3


def test_reset_and_a_changed_history_rebuild_the_state(demo):
    chat = ChatSession(demo, max_new_tokens=8)
    s, _ = chat.send("hello")
    s.run()
    chat.finish()
    chat.messages[-1]["content"] = "edited reply"  # the history no longer extends what the state holds
    _, turn = chat.send("again")
    chat.finish()
    assert turn.rebuilt and turn.kept_tokens == 0
    chat.reset()
    assert chat.messages == [] and chat.state.ids == []


def test_the_models_own_chat_template_is_used(tmp_path, demo):
    d = tmp_path / "demo-chat"
    shutil.copytree(default_model_path(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<|open|>{{ m['role'] }}: {{ m['content'] }}<|sep|>{% endfor %}"
        "{% if add_generation_prompt %}<|open|>bot:{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    m = moestream.load(d)
    tpl = load_template(m)
    assert tpl.name == "tokenizer_config.json"
    assert tpl.render([{"role": "user", "content": "hi"}]) == "<|open|>user: hi<|sep|><|open|>bot:"
    assert load_template(demo).name == "fallback"
    assert load_template(demo).render([{"role": "user", "content": "x"}]).startswith("[BOS]<|open|>user<|sep|>x")


def test_chat_command_keeps_state_between_turns(tmp_path):
    hist = tmp_path / "history.jsonl"
    p = cli("chat", "--gen", "12", "-v", "--history", str(hist), input_text="def f(x):\nand g?\n/exit\n")
    assert p.returncode == 0, p.stderr
    stats = [line for line in p.stderr.splitlines() if line.startswith("[prefilled")]
    assert len(stats) == 2 and "(0 kept)" in stats[0] and "(0 kept)" not in stats[1]
    msgs = [json.loads(line) for line in hist.read_text().splitlines()]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == "def f(x):"
    # resuming from the history file rebuilds the conversation, then keeps state again
    p = cli("chat", "--gen", "12", "-v", "--history", str(hist), input_text="one more\n")
    assert p.returncode == 0, p.stderr
    assert len(hist.read_text().splitlines()) == 6


def test_state_file_round_trips_every_cache(demo, tmp_path):
    st = demo.new_state()
    ids = demo.tokenize("class Stack:\n    def __init__(self):")
    demo.decoder.forward(ids, st, demo.ctx)
    path = tmp_path / "s.npz"
    save_state(path, demo, st, [5])
    back, pending = load_state(path, demo)
    assert pending == [5] and back.ids == st.ids
    for a, b in zip(st.caches, back.caches, strict=True):
        assert type(a) is type(b)
        for k, v in vars(a).items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(v, getattr(b, k))
            else:
                assert v == getattr(b, k)
    x = demo.decoder.forward([7], st, demo.ctx)
    y = demo.decoder.forward([7], back, demo.ctx)
    assert np.array_equal(x, y)


def test_saved_state_continues_generation_exactly(tmp_path):
    s = tmp_path / "state.npz"
    a = cli("run", "--prompt", "def fib(n):", "--gen", "12", "--json", "--save-state", str(s))
    assert a.returncode == 0, a.stderr
    b = cli("run", "--load-state", str(s), "--gen", "12", "--json")
    assert b.returncode == 0, b.stderr
    whole = cli("run", "--prompt", "def fib(n):", "--gen", "24", "--json")
    ja, jb, jw = (json.loads(x.stdout) for x in (a, b, whole))
    assert ja["generated_ids"] + jb["generated_ids"] == jw["generated_ids"]
    assert jb["stats"]["prompt_tokens"] == 1  # only the pending token was fed


def test_states_from_other_models_and_damaged_files_are_refused(tmp_path, demo):
    s = tmp_path / "state.npz"
    assert cli("run", "--prompt", "x = 1", "--gen", "2", "--json", "--save-state", str(s)).returncode == 0
    packed = tmp_path / "q8"
    assert cli("pack", str(default_model_path()), str(packed), "--experts", "q8_0").returncode == 0
    assert_user_error(cli("run", str(packed), "--load-state", str(s), "--gen", "2"), "another model")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    assert_user_error(cli("run", "--load-state", str(bad), "--gen", "2"), "not a moestream state file")
    assert_user_error(cli("run", "--load-state", str(tmp_path / "missing.npz")), "does not exist")
    assert_user_error(cli("run", "--prompt", "x", "--save-state", str(tmp_path / "no" / "s.npz")), "--save-state")
    with pytest.raises(InputError, match="another model"):
        other = moestream.load(packed)
        load_state(s, other)


def test_a_turn_beyond_the_context_is_refused_and_chat_goes_on(demo):
    chat = ChatSession(demo, max_new_tokens=8, max_context=40)
    stream, _ = chat.send("hi")
    stream.run()
    chat.finish()
    with pytest.raises(InputError, match="over the context of 40"):
        chat.send("a much longer question that cannot fit " * 3)
    p = cli("chat", "--ctx", "48", "--gen", "8", "-v", input_text="hi\n" + "long words here " * 10 + "\nok\n")
    assert p.returncode == 0
    assert p.stderr.count("over the context of 48") == 1 and "Traceback" not in p.stderr
    assert p.stderr.count("[prefilled") == 2  # the turns before and after the refused one ran
