"""The long-context suite (studies/longctx.py): its cases, its answer check, the
agnostic reading against the plain decode loop, and a --quick run on a tiny
random model."""
import json
import re
from collections import Counter

import pytest
import torch
from conftest import save_tiny_hf, save_tiny_tokenizer

from generation import CacheOptions, score
from model import load_model
from policies import token_flags
from studies import evaluate, longctx
from tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Llama whose context holds the suite's shortest prompts."""
    path = tmp_path_factory.mktemp("longctx") / "ckpt"
    vocab = save_tiny_tokenizer(path)
    save_tiny_hf(path, vocab_size=vocab, eos_token_id=2, bos_token_id=1,
                 max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer(ckpt)


@pytest.fixture(scope="module")
def hay(tok):
    return longctx.Haystack(tok)


@pytest.mark.parametrize("task", longctx.TASKS)
def test_cases_are_deterministic_and_sized(tok, hay, task):
    a = longctx.make_cases(tok, hay, task, 700, 3, seed=1)
    assert a == longctx.make_cases(tok, hay, task, 700, 3, seed=1)
    assert a != longctx.make_cases(tok, hay, task, 700, 3, seed=2)
    for case in a:
        n = len(case.context) + len(case.question)
        assert n == 700 if task != "cwe" else 600 < n <= 700
        assert case.n_new == longctx.NEW_TOKENS[task] and case.answers


@pytest.mark.parametrize("task", [t for t in longctx.TASKS if t != "cwe"])
def test_needles_are_in_the_context(tok, hay, task):
    for case in longctx.make_cases(tok, hay, task, 700, 4, seed=0):
        context, question = tok.decode(case.context), tok.decode(case.question)
        for answer in case.answers:
            assert answer in context and answer not in question
        if task.startswith("niah"):
            asked = re.search(r"number(?:s)? for (\S+) mentioned", question).group(1)
            needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.",
                                 context)
            assert sorted(v for k, v in needles if k == asked) == sorted(case.answers)
            assert len(needles) == {"niah_single": 1}.get(task, 4)
        else:  # vt: a chain from the value to the last variable
            value = re.search(r"assigned the value (\d+) in", question).group(1)
            chain = dict(re.findall(r"VAR ([A-Z]{5}) = (\w+)\.", context))
            for name in case.answers:
                while name in chain:
                    name = chain[name]
                assert name == value


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey"])
def test_needles_sit_between_sentences(tok, hay, task):
    """After a sentence's end and before a spaced word (this tokenizer needs a
    few thousand tokens for text with several sentences)."""
    for case in longctx.make_cases(tok, hay, task, 3000, 3, seed=0):
        context = tok.decode(case.context)
        placed = re.findall(r"(?<=[.!?]) One of the special magic numbers for \S+ is: "
                            r"\d{7}\.(?=\s)", context)
        assert len(placed) == (1 if task == "niah_single" else 4)


def test_cwe_answers_are_the_most_common_words(tok, hay):
    for case in longctx.make_cases(tok, hay, "cwe", 900, 3, seed=0):
        listed = re.findall(r"\d+\. ([a-z]+)", tok.decode(case.context))
        counts = Counter(listed)
        top = [w for w, _ in counts.most_common(longctx.COMMON)]
        assert sorted(top) == sorted(case.answers)
        assert counts[top[-1]] > max(c for w, c in counts.items() if w not in top)


def test_too_short_a_length_is_an_error(tok, hay):
    with pytest.raises(ValueError, match="too few for niah_multikey"):
        longctx.make_cases(tok, hay, "niah_multikey", 100, 1)


def test_answer_check(tok):
    assert longctx.answer_score(" 1234567.", ["1234567"]) == 1
    assert longctx.answer_score("The numbers: 111, 222", ["111", "222", "333", "444"]) == 0.5
    assert longctx.answer_score("abcde and FGHIJ", ["ABCDE", "fghij"]) == 1
    assert longctx.answer_score("123456", ["1234567"]) == 0
    eos = tok.eos_ids[0]
    ids = tok.encode(" 42", special=False) + [eos] + tok.encode(" 1234567", special=False)
    assert longctx.answer_text(tok, ids) == " 42"  # what follows the end of the turn is ignored


def test_bad_settings_name_the_flag():
    ok = dict(lengths=[2048], cases=1, tasks=["vt"], readings=["agnostic"], budgets=[0.5],
              methods=["full"], thresholds=[0.9], kl_lengths=[], kl_windows=1, kl_tokens=8,
              text="pydoc", batch_tokens=100)
    longctx.check(**ok)
    for change, flag in [(dict(methods=["fastgen", "kivi"]), "--methods"),
                         (dict(tasks=["qa"]), "--tasks"), (dict(budgets=[0]), "--budgets"),
                         (dict(lengths=[10]), "--lengths"), (dict(cases=0), "--cases"),
                         (dict(readings=["first"]), "--readings"), (dict(text="wiki"), "--text")]:
        with pytest.raises(ValueError, match=flag):
            longctx.check(**ok | change)
    for argv in (["--threads", "0"], ["--methods", "kivi"], ["--quick", "--budgets", "2"]):
        with pytest.raises(SystemExit):
            longctx.parse_args(argv)
    assert longctx.parse_args(["--quick", "--lengths", "256"]).lengths == [256]


def test_fixed_policies_in_fewer_bits():
    got = longctx.method_configs(["h2o@4", "snapkv@8"], [0.25, 0.5], [0.9])
    assert [(c.name, c.kv, c.options) for c in got[1:]] == [
        ("h2o@4 b=0.25", "h2o", {"kv_budget": 0.25, "kv_bits": (4,)}),
        ("h2o@4 b=0.5", "h2o", {"kv_budget": 0.5, "kv_bits": (4,)}),
        ("snapkv@8 b=0.25", "snapkv", {"kv_budget": 0.25, "kv_bits": (8,)}),
        ("snapkv@8 b=0.5", "snapkv", {"kv_budget": 0.5, "kv_bits": (8,)})]
    with pytest.raises(ValueError, match="h2o@2"):
        longctx.method_configs(["h2o@2"], [0.5], [0.9])


@pytest.mark.parametrize("kv, options", [("full", {}), ("fastgen", {"kv_budget": 0.3}),
                                         ("fastgen", {"recovery": 0.9, "paper": True}),
                                         ("h2o", {"kv_budget": 0.4}),
                                         ("snapkv", {"kv_budget": 0.5}),
                                         ("h2o", {"kv_budget": 0.4, "kv_bits": (4,)})])
def test_agnostic_replay_equals_the_decode_loop(ckpt, kv, options):
    """Caches built from a slice of the whole prompts' record, then the question
    fed step by step, answer as generation.score does on the contexts alone
    with the question and the answer teacher-forced."""
    model = load_model(ckpt)
    tok = Tokenizer(ckpt)
    flags = token_flags(model.args.vocab_size, tok.special_ids, tok.punctuation_ids())
    torch.manual_seed(0)
    contexts = [torch.randint(3, 300, (n,)).tolist() for n in (60, 47)]
    questions = [torch.randint(3, 300, (n,)).tolist() for n in (7, 4)]
    n = 5
    rec = evaluate.record(model, [c + q for c, q in zip(contexts, questions)])
    ctx = longctx.context_record(rec, [len(c) for c in contexts])
    config = evaluate.Config(kv, kv, options)
    ids, nbytes, full = longctx.replay_agnostic(model, ctx, config, questions, n, flags)
    assert ids.shape == (2, n) and 0 < nbytes <= 1.3 * full
    # The same work in one plain loop: every continuation as long as the longest
    # question and the answer (the shorter one padded at its end).
    Q = max(map(len, questions))
    follow = [q + a[:-1] + [3] * (Q - len(q) + 1) for q, a in zip(questions, ids.tolist())]
    logits = score(model, contexts, follow, cache=CacheOptions(kv, **options), token_flags=flags)
    for b, q in enumerate(questions):
        assert logits[b, len(q):len(q) + n].argmax(-1).tolist() == ids[b].tolist()


def test_agnostic_answers_at_the_context_edge_do_not_depend_on_the_batch(ckpt):
    """Prompts that fill the model's context less the answer, batched with a
    longer question: each answer is the one it gets alone (before, the shorter
    question's positions ran past the context and the batch failed)."""
    model = load_model(ckpt)
    flags = token_flags(model.args.vocab_size, [1, 2], [])
    torch.manual_seed(2)
    n, edge = 5, model.args.max_seq_len
    questions = [torch.randint(3, 300, (q,)).tolist() for q in (7, 2)]
    contexts = [torch.randint(3, 300, (edge - n - len(q),)).tolist() for q in questions]
    config = evaluate.Config("fastgen", "fastgen", {"kv_budget": 0.3})

    def answers(b):
        rec = evaluate.record(model, [contexts[i] + questions[i] for i in b])
        ctx = longctx.context_record(rec, [len(contexts[i]) for i in b])
        return longctx.replay_agnostic(model, ctx, config, [questions[i] for i in b], n,
                                       flags)[0].tolist()

    assert answers([0, 1]) == answers([0]) + answers([1])


def test_full_cache_agnostic_equals_question_last(ckpt):
    """What run_cases relies on to reuse the full cache's answers."""
    model = load_model(ckpt)
    torch.manual_seed(1)
    contexts = [torch.randint(3, 300, (n,)).tolist() for n in (50, 50)]
    questions = [torch.randint(3, 300, (n,)).tolist() for n in (6, 6)]
    rec = evaluate.record(model, [c + q for c, q in zip(contexts, questions)])
    ql, _, _ = evaluate.replay(model, rec, evaluate.Config("full", "full", {}), 4)
    ag, _, _ = longctx.replay_agnostic(model, longctx.context_record(rec, [50, 50]),
                                       evaluate.Config("full", "full", {}), questions, 4)
    assert ql.argmax(-1).tolist() == ag.tolist()


def test_quick_run_writes_sane_outputs(ckpt, tmp_path):
    threads = torch.get_num_threads()
    try:  # one thread: much faster on a busy machine; the other tests keep theirs
        got = longctx.main(ckpt=str(ckpt), out=str(tmp_path / "lc"), quick=True, threads=1,
                           methods=["full", "fastgen", "sink"])
    finally:
        torch.set_num_threads(threads)
    for suffix in (".md", ".json", ".png"):
        assert (tmp_path / f"lc{suffix}").stat().st_size > 0
    saved = json.loads((tmp_path / "lc.json").read_text())
    assert saved["results"] == json.loads(json.dumps(got["results"]))
    (length, by_reading), = got["results"].items()
    assert set(by_reading) == set(longctx.READINGS)
    for rd, s in by_reading.items():
        assert list(s["rows"]) == ["full", "fastgen b=0.25", "sink b=0.25"]
        assert s["rows"]["full"]["share"] == 1
        for name, r in s["rows"].items():
            assert set(r["scores"]) == set(longctx.TASKS)
            assert all(0 <= v <= 1 for v in r["scores"].values())
            assert 0 < r["share"] <= 1.3, (rd, name)
        # A random model finds nothing: every task under the floor, no average.
        assert s["excluded"] == list(longctx.TASKS) and s["rows"]["full"]["average"] is None
    assert got["text"]["512"]["full"]["kl"] == 0
    md = (tmp_path / "lc.md").read_text()
    assert f"## {length} tokens, agnostic" in md and "| niah_single * |" in md
    assert "python -m studies.longctx --quick" in md and "Teacher-forced" in md
    cases = saved["cases"][length]["agnostic"]["fastgen b=0.25"]
    assert len(cases) == len(longctx.TASKS) and {c["task"] for c in cases} == set(longctx.TASKS)

    # studies/needle_depth.py: the needle cases by depth, rebuilt from the run's seed.
    from generation import load
    from studies import needle_depth
    _, tok = load(str(ckpt))
    made = needle_depth.depths(tok, saved["meta"], int(length))
    assert [m[1] for m in made] == [c["required"] for c in cases]
    assert all(0 < m[2] < 1 for m in made if m[0].startswith("niah"))
    cases[0]["score"] = 1.0  # niah_single's case, found: counted in its needle's band
    band = sum(made[0][2] >= e for e in needle_depth.EDGES)
    got = needle_depth.by_depth([saved], tok, rows=["fastgen b=0.25"])[length]["agnostic"]
    assert sum(got["cases"]) == sum(t.startswith("niah") for t in longctx.TASKS)
    assert got["rows"]["fastgen b=0.25"] == [float(b == band) for b in range(4)]
    assert "| fastgen b=0.25 |" in needle_depth.report({length: {"agnostic": got}})
    cases[0]["required"] = ["not the answer"]
    with pytest.raises(ValueError, match="rebuilt cases"):
        needle_depth.by_depth([saved], tok, rows=["fastgen b=0.25"])
    with pytest.raises(SystemExit):  # a usage error, before any model loads
        needle_depth.main([str(tmp_path / "lc.md")])


def test_text_quality_alone(ckpt, tmp_path):
    """No --lengths: the text's KL alone, and a report without tasks or picture."""
    got = longctx.main(ckpt=str(ckpt), out=str(tmp_path / "kl"), quick=True, threads=1,
                       lengths=[], kl_lengths=[64], kl_windows=1, kl_tokens=4)
    assert got["results"] == {} and got["text"]["64"]["full"]["kl"] == 0
    md = (tmp_path / "kl.md").read_text()
    assert "Teacher-forced" in md and "tokens, agnostic" not in md
    assert not (tmp_path / "kl.png").exists()
    with pytest.raises(SystemExit):
        longctx.parse_args(["--lengths", "--kl-lengths"])
