"""--interactive: a chat whose cache lives across turns equals one generation over the whole
conversation; --json output; --prompt-file -."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import generate
import generation
from cache import Method
from chat import Chat, ConversationFull
from generate import cli
from generation import CacheOptions, flags_of, load
from policies import Full

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


def chat(tiny_ckpt, kv, max_new_tokens=10, **options):
    model, tok = load(str(tiny_ckpt))
    return Chat(model, tok, cache=CacheOptions(kv, **options), max_new_tokens=max_new_tokens,
                token_flags=flags_of(model, tok))


def test_compressed_cache_keeping_everything_equals_the_full_cache(tiny_ckpt):
    """The paper's threshold at 1: every head Full, so a compressed cache taking each turn
    in chunks (each choosing again, Full again) must give what the full cache gives."""
    full, fast = chat(tiny_ckpt, "full"), chat(tiny_ckpt, "fastgen", paper=True, recovery=1.0)
    for text in ["Hello, world", "The quick brown fox", "def f(x): return x + 1"]:
        a, b = full.turn(text), fast.turn(text)
        assert a.fed == b.fed and a.tokens == b.tokens and b.kept_tokens == b.seen_tokens
    assert b.plan == [] and full.length == fast.length


def test_turns_read_again_hold_nothing_of_it(tiny_ckpt, monkeypatch):
    """--ask-after reads each chunk of a turn again; with Full on every head, the chat must
    still give what the full cache gives: nothing read again is held."""
    monkeypatch.setattr(generation, "fixed_method",
                        lambda *a, ask_after: Method((Full(),), ask_after=ask_after))
    monkeypatch.setattr("chat.CHUNK", 16)  # a turn in several chunks, each read again
    monkeypatch.setattr("chat.READ_AGAIN", 16)
    full, fast = chat(tiny_ckpt, "full"), chat(tiny_ckpt, "local", ask_after=True)
    for text in ["Hello, world", "The quick brown fox " * 12, "def f(x): return x + 1"]:
        a, b = full.turn(text), fast.turn(text)
        assert a.fed == b.fed and a.tokens == b.tokens and b.kept_tokens == b.seen_tokens


@pytest.mark.parametrize("kv, options, reads", [
    ("fastgen", {}, True), ("h2o", {}, True), ("fastgen", dict(ask_after=False), False),
    ("fastgen", dict(paper=True), False), ("full", {}, False)])
def test_a_chat_reads_its_turns_for_questions_asked_after_by_default(tiny_ckpt, kv, options,
                                                                      reads):
    """Later turns ask about earlier ones: a compressed chat reads each turn again unless told
    not to (--no-ask-after) or running the paper's method; a one-shot prompt does not."""
    session = chat(tiny_ckpt, kv, **options)
    session.turn("The quick brown fox jumps over the lazy dog. " * 3)
    caches = session.model.caches()
    assert bool(getattr(caches[0], "method", None) and caches[0].method.ask_after) == reads
    model, tok = load(str(tiny_ckpt))
    one_shot = generation.make_caches(model, CacheOptions(kv, **options), [20], 4)
    assert not getattr(one_shot[0], "method", None) or not one_shot[0].method.ask_after


def test_no_ask_after_flag_turns_the_chat_reading_off():
    assert generate.parse_args(["--interactive", "--no-ask-after"]).ask_after is False
    assert generate.parse_args(["--interactive"]).ask_after is None


@pytest.mark.parametrize("kv", ["full", "fastgen"])
def test_a_turn_records_no_autograd_graph(tiny_ckpt, kv):
    """The model's weights require grad; a turn must not build a graph, which the cache would hold
    with every activation of every turn."""
    session = chat(tiny_ckpt, kv)
    for text in ["Hello, world", "The quick brown fox " * 12]:
        session.turn(text)
    held = [t for c in session.model.caches() for t in [*c.buffers(), *vars(c).values()]
            if isinstance(t, torch.Tensor)]
    assert held and not any(t.requires_grad for t in held)


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


def test_a_chat_holds_its_budget_at_every_turn(tiny_ckpt):
    """A short first turn before long answers: each later turn is planned with its answer still
    to come, and the layers together may spend the whole budget, not what the first turn took."""
    session = chat(tiny_ckpt, "fastgen", max_new_tokens=32, kv_budget=0.5)
    session.turn("Hi")
    for text in ["The quick brown fox jumps over the lazy dog. " * 2, "And then?"]:
        turn = session.turn(text)
        caches = session.model.caches()
        page = sum(c.pool.page for c in caches) * session.model.args.n_kv_heads
        assert 0.4 * turn.seen_tokens <= turn.kept_tokens <= 0.5 * turn.seen_tokens + page


def turns_and_errors(out: str, err: str, as_json: bool):
    """The turns --interactive answered (its JSON objects, or its turns' summaries) and its
    error lines (after the prompts "> " that stand before them)."""
    errors = [l[l.index("error:"):] for l in err.splitlines() if "error:" in l]
    if as_json:
        return [json.loads(l) for l in out.splitlines() if l.strip()], errors
    return [l for l in err.splitlines() if "[turn " in l], errors


# Lines of random bytes, of Latin-1 text, and of UTF-8 text, none holding a line break.
LINE = st.one_of(st.binary(max_size=12),
                 st.text(st.characters(max_codepoint=255), max_size=12).map(
                     lambda t: t.encode("latin-1")),
                 st.text(max_size=12).map(lambda t: t.encode("utf-8", "surrogatepass"))).map(
    lambda b: b.replace(b"\n", b"").replace(b"\r", b""))


@pytest.mark.parametrize("as_json", [False, True])
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(LINE, min_size=1, max_size=4),
       decoding=st.sampled_from(["strict", "surrogateescape"]))
def test_lines_that_are_not_utf8_are_refused_and_the_chat_goes_on(tiny_ckpt, capsys, monkeypatch,
                                                                   as_json, lines, decoding):
    """Whatever bytes a line holds, under a locale that decodes standard input strictly or
    with surrogate escapes: the chat never raises, each line is a turn or one error line,
    a line that is not UTF-8 is refused, and every turn builds on the one before."""
    capsys.readouterr()
    stdin = io.TextIOWrapper(io.BytesIO(b"\n".join(lines) + b"\n"), encoding="utf-8",
                             errors=decoding)
    monkeypatch.setattr(sys, "stdin", stdin)
    argv = ["--ckpt", str(tiny_ckpt), "--interactive", "--max-new-tokens", "2"]
    assert cli(argv + ["--json"] * as_json) == 0
    turns, errors = turns_and_errors(*capsys.readouterr(), as_json)
    read = [b.decode("utf-8", "surrogateescape") for b in lines]
    sent = [t for t in read if t.strip()]
    assert len(turns) + len(errors) == len(sent)
    not_text = [e for e in errors if "not UTF-8" in e]
    assert len(not_text) == sum(any("\udc80" <= c <= "\udcff" for c in t) for t in sent)
    if as_json:  # nothing of the conversation is lost: each turn adds to what the cache held
        held = 0
        for t in turns:
            held += len(t["fed"]) + len(t["tokens"]) - 1
            assert t["cache_len"] == held


@pytest.mark.parametrize("as_json", [False, True])
def test_a_latin1_line_on_stdin_is_refused_in_one_line(tiny_ckpt, as_json):
    """Through a real pipe, with standard input decoded strictly: the Latin-1 line is refused
    with one line on stderr, and the next turn goes on from the first."""
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny_ckpt),
                        "--interactive", "--max-new-tokens", "4", *["--json"] * as_json],
                       input="Hello\ncafé au lait\nHow are you?\n".encode("latin-1"),
                       capture_output=True, timeout=120,
                       env=os.environ | {"PYTHONIOENCODING": "utf-8:strict"})
    assert r.returncode == 0, r.stderr
    turns, errors = turns_and_errors(r.stdout.decode(), r.stderr.decode(), as_json)
    assert len(turns) == 2
    assert errors == ["error: this line is not UTF-8 text (byte 3) and was not sent; set the "
                      "terminal to UTF-8 or convert the text (e.g. with iconv), and send it again"]
    if as_json:
        first, second = turns
        assert second["cache_len"] == (first["cache_len"] + len(second["fed"])
                                       + len(second["tokens"]) - 1)
