import json
import math
from pathlib import Path

import pytest
import torch

from generation import CacheOptions, score
from model import load_model
from policies import token_flags
from studies import evaluate, output
from tokenizer import Tokenizer


def test_quick_run_writes_sane_outputs(tiny_ckpt, tmp_path):
    rows = evaluate.main(ckpt=str(tiny_ckpt), out=str(tmp_path / "quality"), quick=True)
    for suffix in (".md", ".json", ".png"):
        assert (tmp_path / f"quality{suffix}").stat().st_size > 0
    saved = json.loads((tmp_path / "quality.json").read_text())["rows"]
    assert saved.keys() == rows.keys()
    full = rows["full"]
    # The full cache against itself: no divergence, full agreement.
    assert full["kl"] == 0 and full["top1"] == 1 and full["share"] == 1
    # The paper's FastGen at T = 1 keeps every token (Full() everywhere): the same predictions.
    paper = rows["fastgen-paper T=1"]
    assert paper["kl"] < 1e-6 and paper["top1"] == 1
    for name, r in rows.items():
        # Never negative, but float32 sums over two equal distributions may round
        # below 0 (-2.4e-8 for FastGen at T = 1 on one machine).
        assert r["kl"] >= -1e-6, name
        assert 0 <= r["top1"] <= 1 and 0 <= r["pk_acc"] <= 1, name
        # Prompts of a few dozen tokens: a compressed head's round of free slots
        # (evict_every) and its index tensors weigh more than at real sizes.
        assert 0 < r["share"] <= 1.25 and 0 < r["pk_share"] <= 1.25, name
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1, name
    assert rows["local b=0.3"]["share"] < rows["local b=0.6"]["share"] < 1
    md = (tmp_path / "quality.md").read_text()
    assert "| fastgen-paper T=0.9 |" in md and "Headline" in md


def test_out_keeps_the_dots_of_its_name(tmp_path):
    # Two runs that differ after a dot write two files, not the same x_0.md.
    assert output(tmp_path / "x_0.25", ".md") == tmp_path / "x_0.25.md"
    assert output(tmp_path / "x_0.5", ".json") == tmp_path / "x_0.5.json"
    assert output(tmp_path / "x.md", ".json") == tmp_path / "x.json"
    assert output("results/q", ".png") == Path("results/q.png")


@pytest.mark.parametrize("kv, options", [("fastgen", {"recovery": 0.9, "paper": True}),
                                         ("fastgen", {"kv_budget": 0.4}),
                                         ("fastgen", {"kv_budget": 0.4, "kv_bits": (16, 8, 4)}),
                                         ("fastgen", {"kv_budget": 0.4, "ask_after": True}),
                                         ("h2o", {"kv_budget": 0.4, "ask_after": True}),
                                         ("h2o", {"kv_budget": 0.4}), ("snapkv", {"kv_budget": 0.5}),
                                         ("tova", {"kv_budget": 0.3}), ("full", {})])
def test_replay_equals_score(tiny_ckpt, kv, options):
    """Building the caches from a recorded prefill, with profiling shared,
    decodes exactly what generation.score decodes, again from the same record."""
    model, tok = load_model(tiny_ckpt), Tokenizer(tiny_ckpt)
    flags = token_flags(model.args.vocab_size, tok.special_ids, tok.punctuation_ids())
    torch.manual_seed(0)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (40, 33, 40)]
    follow = torch.randint(3, 300, (3, 6))
    want = score(model, prompts, follow.tolist(), cache=CacheOptions(kv, **options),
                 token_flags=flags)
    rec = evaluate.record(model, prompts)
    got, nbytes, kept = evaluate.replay(model, rec, evaluate.Config(kv, kv, options), 6, follow, flags)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert nbytes > 0 and 0 < kept <= 1
    again = evaluate.replay(model, rec, evaluate.Config(kv, kv, options), 6, follow, flags)[0]
    assert torch.equal(again, got)


def test_text_quality_halves(tiny_ckpt):
    """The KL of the first and second half of the new tokens average to the
    KL (the halves are equal), and the full cache has none in either."""
    model, tok = load_model(tiny_ckpt), Tokenizer(tiny_ckpt)
    flags = token_flags(model.args.vocab_size, tok.special_ids, tok.punctuation_ids())
    torch.manual_seed(0)
    windows = [torch.randint(3, 300, (46,)).tolist() for _ in range(3)]
    cfgs = [evaluate.Config("full", "full", {}), evaluate.Config("h2o", "h2o", {"kv_budget": 0.3})]
    rows = evaluate.text_quality(model, windows, 6, cfgs, flags, 3)
    assert rows["full"]["kl_halves"] == [0.0, 0.0]
    first, second = rows["h2o"]["kl_halves"]
    assert first > 0 and second > 0
    assert math.isclose((first + second) / 2, rows["h2o"]["kl"], rel_tol=1e-6)


def test_interpolate():
    pts = [(0.2, 1.0), (0.6, 3.0), (0.4, 2.0)]
    assert evaluate.interpolate(pts, 0.5) == pytest.approx(2.5)
    assert evaluate.interpolate(pts, 0.2) == 1.0
    assert evaluate.interpolate(pts, 0.7) is None and evaluate.interpolate(pts, 0.1) is None


def test_passkey_prompts_hide_the_key(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    cases = evaluate.passkey_cases(tok, 5, 1, seed=1)
    assert all(key in tok.decode(ids) and len(key) == 5 for ids, key in cases)
    key = cases[0][1]
    assert evaluate.answer_ok(tok, tok.encode(f" {key}. Remember"), key)
    assert not evaluate.answer_ok(tok, tok.encode(" 1234"), key)


def test_peer_failure_is_reported(tiny_ckpt):
    """Without kvpress (this environment) the peer says why instead of failing the run."""
    import importlib.util
    import sys
    if importlib.util.find_spec("kvpress") is not None:
        pytest.skip("kvpress is installed here")
    got = evaluate.run_peer(sys.executable, tiny_ckpt, [[1, 2, 3, 4]], 2, [([1, 2, 3], "12345")],
                            2, [0.5], batch=1, threads=1)
    assert "kvpress" in got["error"]
    assert "cannot start" in evaluate.run_peer("/nonexistent/python", tiny_ckpt, [], 2, [], 2,
                                               [0.5], batch=1, threads=1)["error"]


def test_peer_presses_choose_the_peer_s_rows(monkeypatch):
    """--peer-presses: the presses the peer runs, alone and on HF's quantized cache; none leaves
    the quantized cache alone."""
    jobs = []
    monkeypatch.setattr(evaluate, "run_peer_job", lambda python, job: jobs.append(job) or {})
    run = lambda presses: evaluate.run_peer("py", "ckpt", [], 2, [], 2, [0.25], 1, 1,  # noqa: E731
                                            precision=True, presses=presses)
    run(evaluate.PRESSES)
    run(["SnapKVPress"])
    run([])
    assert [j["presses"] for j in jobs] == [list(evaluate.PRESSES), ["SnapKVPress"], []]
    assert [j["quant_presses"] for j in jobs] == [list(evaluate.QUANT_PRESSES), ["SnapKVPress"], []]
    assert all(j["quant_bits"] == evaluate.QUANT_BITS for j in jobs)
    assert evaluate.parse_args(["--peer-presses"]).peer_presses == []
