"""--interactive: a chat whose cache lives across turns equals one generation over the whole
conversation; --json output; --prompt-file -."""
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import generate
import generation
from chat import Chat, ConversationFull
from generate import cli
from generation import CacheOptions, flags_of, load

ROOT = Path(__file__).resolve().parents[1]


def one_generation(tiny_ckpt, conversation, n):
    """The reference: the whole conversation as one prompt, with the full cache."""
    model, tok = load(str(tiny_ckpt))
    return generation.generate(model, [conversation], n, eos_ids=tok.eos_ids).tokens[0]


def test_two_turns_through_stdin_equal_one_generation(tiny_ckpt):
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny_ckpt),
                        "--interactive", "--json", "--max-new-tokens", "12"],
                       input="Hello, world\n\nHow are you?\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = map(json.loads, r.stdout.splitlines())  # the empty line is no turn
    # The last token of an answer is sampled, not fed: the next turn feeds it (or the template's
    # end of turn, when it was EOS).
    conversation = first["fed"] + first["tokens"][:-1] + second["fed"]
    assert second["cache_len"] == len(conversation) + len(second["tokens"]) - 1
    assert one_generation(tiny_ckpt, conversation, 12) == second["tokens"]
    assert second["kept_tokens"] == second["seen_tokens"] and second["kv_bytes"] >= second["full_kv_bytes"]


def chat(tiny_ckpt, kv, **options):
    model, tok = load(str(tiny_ckpt))
    return Chat(model, tok, cache=CacheOptions(kv, **options), max_new_tokens=10,
                token_flags=flags_of(model, tok))


def test_compressed_cache_keeping_everything_equals_the_full_cache(tiny_ckpt):
    """The paper's threshold at 1: every head Full, so a compressed cache taking each turn
    in chunks (each choosing again, Full again) must give what the full cache gives."""
    full, fast = chat(tiny_ckpt, "full"), chat(tiny_ckpt, "fastgen", paper=True, recovery=1.0)
    for text in ["Hello, world", "The quick brown fox", "def f(x): return x + 1"]:
        a, b = full.turn(text), fast.turn(text)
        assert a.fed == b.fed and a.tokens == b.tokens and b.kept_tokens == b.seen_tokens
    assert b.plan == [] and full.length == fast.length


def test_compressed_cache_holds_less_and_keeps_its_plan(tiny_ckpt):
    session = chat(tiny_ckpt, "h2o", kv_budget=0.5)
    first = session.turn("The quick brown fox jumps over the lazy dog. " * 3)
    second = session.turn("Hello, world")
    assert first.plan and second.plan == []  # profiled once, on the first turn
    assert second.kept_tokens < second.seen_tokens
    assert second.cache_len == len(first.fed) + len(first.tokens) - 1 + len(second.fed) + len(second.tokens) - 1


def test_stopped_answer_and_a_full_conversation(tiny_ckpt):
    session = chat(tiny_ckpt, "full")
    produced = []
    first = session.turn("Hello, world", on_token=lambda b, t: produced.append(t),
                         stop=lambda: len(produced) >= 3)
    assert first.interrupted and len(first.tokens) == 3 == len(produced)
    second = session.turn("How are you?")
    conversation = first.fed + first.tokens[:-1] + second.fed
    assert one_generation(tiny_ckpt, conversation, 10) == second.tokens
    length = session.length
    with pytest.raises(ConversationFull, match="does not fit"):
        session.turn("lorem ipsum dolor " * 200)  # the tiny model's context is 256 tokens
    assert session.length == length  # nothing was fed
    third = session.turn("Hi")  # the chat goes on after a turn that did not fit
    assert second.tokens[-1] in session.tok.eos_ids or third.fed[0] == second.tokens[-1]


def test_json_matches_the_generation(tiny_ckpt, capsys, monkeypatch):
    made = []

    def keep(*args, **kwargs):
        made.append(real_main(*args, **kwargs))
        return made[-1]

    real_main = generate.main
    monkeypatch.setattr(generate, "main", keep)
    assert cli(["--ckpt", str(tiny_ckpt), "--prompt", "Hello", "--prompt", "The fox", "--json",
                "--kv", "fastgen", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)  # stdout holds the JSON object and nothing else
    gen = made[0]
    assert result == json.loads(json.dumps(gen.as_dict()))
    assert result["tokens"] == gen.tokens and result["kv_bytes"] == gen.kv_bytes
    assert result["kept_tokens"] == gen.kept_tokens and len(result["plan"]) == 2
    assert result["decode_tok_s"] == gen.speeds()[1] and out.err == ""


def test_prompt_file_dash_reads_stdin(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello, world"))
    assert cli(["--ckpt", str(tiny_ckpt), "--prompt-file", "-", "--json", "--max-new-tokens", "12"]) == 0
    from test_generate import GOLDEN
    assert json.loads(capsys.readouterr().out)["tokens"] == [GOLDEN]


def test_a_long_later_turn_is_kept_at_the_policys_share(tiny_ckpt):
    """A short first turn, then a turn ten times longer: the compressed cache keeps
    about its share of the whole conversation (the policies' windows follow what
    was read), not the first turn's window, and allocates less than a full cache."""
    session = chat(tiny_ckpt, "local", kv_budget=0.5)
    session.turn("Hello")
    second = session.turn("The quick brown fox jumps over the lazy dog. " * 8)
    assert 0.4 < second.kept_tokens / second.seen_tokens < 0.6
    assert second.kv_bytes < second.full_kv_bytes
