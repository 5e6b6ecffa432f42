"""The command line and Python API end to end on a tiny checkpoint, and both tokenizer kinds."""
import subprocess
import sys
from pathlib import Path

import pytest

from generate import cli, main
from generation import CacheOptions
from tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
# Greedy continuation of "Hello, world" by the tiny random checkpoint (seed 0).
GOLDEN = [22, 169, 61, 101, 101, 101, 101, 101, 101, 101, 236, 191]


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_golden_greedy_output(tiny_ckpt):
    gen = main("Hello, world", ckpt=str(tiny_ckpt), max_new_tokens=12)
    assert gen.tokens == [GOLDEN]
    # The full cache has no plan, keeps no count of tokens and says so.
    assert gen.plan == [] and gen.kept_tokens == gen.seen_tokens == 0
    assert "KV cache allocated" in gen.summary() and "policy count" not in gen.summary()


def test_cli_end_to_end(tiny_ckpt):
    r = run_cli("--ckpt", str(tiny_ckpt), "--prompt", "Hello, world", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == Tokenizer(tiny_ckpt).decode(GOLDEN) + "\n"
    assert "KV cache allocated" in r.stderr and "decode" in r.stderr


def test_cli_batch_and_fastgen(tiny_ckpt, tmp_path):
    plan = tmp_path / "plan.json"
    r = run_cli("--ckpt", str(tiny_ckpt), "--prompt", "Hello, world", "--prompt",
                "The quick brown fox jumps", "--max-new-tokens", "6", "--kv", "fastgen",
                "--chat", "--save-plan", str(plan))
    assert r.returncode == 0, r.stderr
    assert "--- [0] ---" in r.stdout and "--- [1] ---" in r.stdout
    assert "policy count per layer" in r.stderr
    assert plan.is_file()


def test_batch_equals_each_prompt_alone(tiny_ckpt):
    prompts = ["Hello, world", "The quick brown fox jumps over the lazy dog."]
    together = main(prompts, ckpt=str(tiny_ckpt), max_new_tokens=8).tokens
    alone = [main(p, ckpt=str(tiny_ckpt), max_new_tokens=8).tokens[0] for p in prompts]
    assert together == alone


def test_a_prompt_read_in_chunks(tiny_ckpt):
    """--prefill-chunk: the full cache gives the same tokens, prompts of
    different lengths in one batch; a compressed cache reads the prompt in
    pieces, each chunk choosing its heads' policies again, and holds about
    its share of it."""
    prompts = ["Hello, world", "The quick brown fox jumps over the lazy dog. " * 4]
    kw = dict(ckpt=str(tiny_ckpt), max_new_tokens=8)
    assert (main(prompts, cache=CacheOptions(prefill_chunk=7), **kw).tokens
            == main(prompts, **kw).tokens)
    gen = main(prompts, cache=CacheOptions("fastgen", kv_budget=0.5, prefill_chunk=16), **kw)
    assert 0.3 < gen.kept_tokens / gen.seen_tokens < 0.75
    assert gen.kv_bytes < gen.full_kv_bytes


def test_same_seed_same_sample(tiny_ckpt):
    kw = dict(ckpt=str(tiny_ckpt), max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.9)
    assert main("Hello", seed=3, **kw).tokens == main("Hello", seed=3, **kw).tokens


@pytest.mark.parametrize("args, status, words", [
    (["--prompt", ""], 2, "empty"),
    (["--prompt", "hi", "--top-p", "1.5"], 2, "--top-p"),
    (["--prompt", "hi", "--max-new-tokens", "0"], 2, "--max-new-tokens"),
    (["--prompt", "hi", "--recovery", "0"], 2, "--recovery"),
    (["--prompt", "hi", "--max-new-tokens", "100000"], 2, "context"),
    (["--prompt", "hi", "--device", "cuda"], 2, "--device"),
    (["--prompt", "hi", "--kv", "nope"], 2, "--kv"),
    (["--prompt", "hi", "--kv", "fastgen", "--recovery", "0.9"], 2, "add --paper"),
    (["--prompt", "hi", "--kv", "h2o", "--paper"], 2, "add --kv fastgen"),
    (["--prompt", "hi", "--kv", "fastgen", "--paper", "--recovery", "0.9", "--kv-budget", "0.5"],
     2, "--kv-budget is the default FastGen's"),
    (["--prompt", "hi", "--prefill-chunk", "0"], 2, "--prefill-chunk"),
    (["--prompt", "hi", "--kv", "h2o", "--kv-bits", "3"], 2, "--kv-bits"),
    (["--prompt", "hi", "--kv", "h2o", "--kv-bits", "16,8"], 2, "menu of precisions"),
    (["--prompt", "hi", "--kv", "fastgen", "--paper", "--kv-bits", "16,8"], 2,
     "menu of precisions"),
    (["--prompt", "hi", "--kv", "fastgen", "--kv-bits", "eight"], 2, "--kv-bits"),
])
def test_cli_usage_errors(tiny_ckpt, capsys, args, status, words):
    if "nope" in args or "eight" in args:  # argparse's own check
        with pytest.raises(SystemExit) as e:
            cli(["--ckpt", str(tiny_ckpt), *args])
        assert e.value.code == status
    else:
        assert cli(["--ckpt", str(tiny_ckpt), *args]) == status
    err = capsys.readouterr().err
    assert words in err and err.count("\n") <= 2


@pytest.mark.parametrize("flag", [
    ["--obs-window", "0"], ["--span", "1"], ["--hh-rows", "every"], ["--hh-score", "sum"],
    ["--sink-mass", "drop"], ["--weigh-values"], ["--no-weigh-values"], ["--rechoose"],
    ["--no-rechoose"], ["--budget-scope", "layer"], ["--objective", "linear"],
    ["--evict-every", "1"], ["--r-local", "0.3"], ["--r-frequent", "0.3"]])
def test_removed_cache_flags_are_refused(tiny_ckpt, capsys, flag):
    """The cache flags of the variants the core no longer runs are no flags:
    argparse refuses them in one line, before anything is loaded."""
    with pytest.raises(SystemExit) as e:
        cli(["--ckpt", str(tiny_ckpt), "--prompt", "hi", "--kv", "fastgen", *flag])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and flag[0] in err and err.count("\n") == 1


def test_cli_missing_checkpoint(tmp_path, capsys):
    assert cli(["--ckpt", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_tokenizer_json_round_trip(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    text = "Hello, world! Numbers: 12345."
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids
    assert tok.token_to_id("<|im_start|>") in tok.special_ids
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat("hi")
    assert tok.token_to_id(".") in tok.punctuation_ids()


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece as spm
    from conftest import CORPUS
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.Train(input=str(tmp_path / "corpus.txt"),
                                   model_prefix=str(tmp_path / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    tok = Tokenizer(tmp_path)
    ids = tok.encode("The lazy fox, 42!")
    assert ids[0] == 1  # sentencepiece Llamas add BOS
    assert tok.decode(ids) == "The lazy fox, 42!"
    assert {1, 2} <= set(tok.special_ids) and tok.eos_ids == [2]
    assert any(tok.decode([i]) == "," for i in tok.punctuation_ids())


def test_fastgen_modes(tiny_ckpt):
    """FastGen runs the budget mode over the menu (heavy hitters by mean
    attention); with --paper, the paper's shortlist under the threshold
    (heavy hitters by summed attention)."""
    from policies import menu, shortlist
    kw = dict(ckpt=str(tiny_ckpt), max_new_tokens=4)
    names = lambda g: {p for layer in g.plan for p in layer}  # noqa: E731
    assert names(main("Hello there", cache=CacheOptions("fastgen"), **kw)) <= {
        repr(p) for p in menu()}
    for recovery in (None, 0.9):
        paper = CacheOptions("fastgen", paper=True, recovery=recovery)
        assert names(main("Hello there", cache=paper, **kw)) <= {repr(p) for p in shortlist()}


def test_a_plan_over_the_budget_says_so(tiny_ckpt):
    """A budget below a head's cheapest policy leaves every head that one, over the budget,
    and the summary says so and what to change; within the budget it says nothing, a long
    answer with --ask-after included (decoding evicts by each head's policy)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    kw = dict(ckpt=str(tiny_ckpt))
    over = main(prompt, cache=CacheOptions("fastgen", kv_budget=0.005), max_new_tokens=64, **kw)
    assert over.planned_share > 0.005 * 1.01
    assert "over --kv-budget 0.005" in over.summary() and "--max-new-tokens" in over.summary()
    asked = main(prompt[:90], cache=CacheOptions("fastgen", kv_budget=0.5, ask_after=True),
                 max_new_tokens=128, **kw)  # 128 new tokens after 52
    assert asked.planned_share <= 0.5 * 1.01 and "over --kv-budget" not in asked.summary()
    within = main(prompt, cache=CacheOptions("fastgen", kv_budget=0.5), max_new_tokens=4, **kw)
    assert within.planned_share <= 0.5 * 1.01 and "over --kv-budget" not in within.summary()
