import json
import math

import pytest
import torch

from generation import CacheOptions, score
from model import load_model
from policies import token_flags
from studies import evaluate
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
    # FastGen at T = 1 keeps every token (Full() everywhere): the same predictions.
    assert rows["fastgen T=1"]["kl"] < 1e-6 and rows["fastgen T=1"]["top1"] == 1
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
    assert "| fastgen T=0.9 |" in md and "Headline" in md


@pytest.mark.parametrize("kv, options", [("fastgen", {"recovery": 0.9}),
                                         ("fastgen", {"recovery": 0.9, "paper": True}),
                                         ("fastgen", {"kv_budget": 0.4}),
                                         ("fastgen", {"kv_budget": 0.4, "hh_rows": "both"}),
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
    rows = evaluate.text_quality(model, windows, 6, cfgs, flags, 3, 0.3, 0.3)
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


def test_menu_variants_run(tiny_ckpt, tmp_path):
    """studies/menu_variants.py: a row per variant and budget beside h2o's, and
    the budget mode's own menu back in place afterwards."""
    from studies import menu_variants
    rows = menu_variants.main(ckpt=str(tiny_ckpt), text="pydoc", budgets=(0.5,), windows=2,
                              prompt_len=40, new_tokens=4, out=str(tmp_path / "mv"),
                              variants=["default", "h2o:w=0/span=1", "default:v=1",
                                        "default:w=0/score=sum/span=1/mix=8"])
    assert list(rows) == ["full", "h2o b=0.5", "fastgen[default] b=0.5",
                          "fastgen[h2o:w=0/span=1] b=0.5", "fastgen[default:v=1] b=0.5",
                          "fastgen[default:w=0/score=sum/span=1/mix=8] b=0.5"]
    assert rows["full"]["kl"] == 0 and all(r["kl"] >= 0 for r in rows.values())
    assert (tmp_path / "mv.json").is_file()
    alone = menu_variants.main(ckpt=str(tiny_ckpt), text="pydoc", budgets=(0.5,), windows=2,
                               prompt_len=40, new_tokens=4, out=str(tmp_path / "mv"),
                               variants=["default"], h2o=False)
    assert list(alone) == ["full", "fastgen[default] b=0.5"]  # --no-h2o
    assert alone["fastgen[default] b=0.5"] == rows["fastgen[default] b=0.5"]
    assert not menu_variants.parse_args(["--no-h2o"]).h2o
    import generation
    from policies import menu
    assert generation.menu is menu  # restored
    assert [type(p).__name__ for p in menu_variants.menu_of("h2o")()] == ["Union"] * 7
    import cache
    assert cache.decide.__module__ == "cache" and cache.prompt_slots.__module__ == "profiling"
    got = menu_variants.main(ckpt=str(tiny_ckpt), text="pydoc", windows=2, prompt_len=40,
                             new_tokens=4, norms=True)
    assert len(got["first_norm_ratio_by_layer"]) == 2  # the tiny model's layers
    assert 0 < got["first_share_weighed"] <= 1 and 0 < got["first_share_plain"] <= 1


def test_menu_variants_estimates_and_hindsight(tiny_ckpt, tmp_path):
    """The study's own estimates run and leave the cache as it was; --heads
    gives, per budget, each plan's decode recovery and output error, the
    hindsight plan recovering at least what the linear plan does (the same
    menu, costs and knapsack, told the decode recoveries)."""
    import cache
    import profiling
    from studies import menu_variants
    kw = dict(ckpt=str(tiny_ckpt), text="pydoc", budgets=(0.5,), windows=2, prompt_len=40,
              new_tokens=4)
    rows = menu_variants.main(out=str(tmp_path / "mv"), evict_every=2, variants=[
        "default:obj=linear", "no-tova", "default:center=1", "default:scale=1",
        "default:both=min", "default:local=2", "default:rank=every",
        "default:rank=every/stride=4", "default:rank=max"], **kw)
    assert len(rows) == 11 and all(r["kl"] >= 0 for r in rows.values())
    for name in ("weigh", "recoveries", "fit_budgets", "compress", "decide", "profile_layers"):
        assert getattr(cache, name).__module__ in ("cache", "profiling"), name
    assert cache.weigh is profiling.weigh and cache.recoveries is profiling.recoveries
    got = menu_variants.main(heads=True, out=str(tmp_path / "hs"), **kw)["b=0.5"]
    assert set(got) == {"linear", "squared", "h2o", "hindsight", "window_errors", "backtest",
                        "backtest_min", "backtest_mean", "hindsight_half",
                        "hindsight_half_squared"}
    assert all(r["error"] >= 0 and 0 <= r["decode"] <= 1 + 1e-6 for r in got.values())
    assert got["hindsight"]["decode"] >= got["linear"]["decode"] - 1e-6
    assert sum(f["heads"] for f in got["linear"]["by_family"].values()) == 2 * 2 * 2
    with pytest.raises(ValueError, match="obj=squared"):
        menu_variants.options("obj=cubic")
    with pytest.raises(ValueError, match="local=F"):
        menu_variants.options("local=x")
    each = menu_variants.main(out=str(tmp_path / "pw"), per_window=True, evict_every=2,
                              variants=["default", "default:span=1"], **kw)
    a, b = (each[f"fastgen[{v}] b=0.5"]["kl_by_window"] for v in ("default", "default:span=1"))
    assert len(a) == 2 and each["best variant per window b=0.5"]["kl"] == pytest.approx(
        (min(a[0], b[0]) + min(a[1], b[1])) / 2)
    tokens = menu_variants.main(out=str(tmp_path / "tk"), token_window=1,
                                variants=["default", "default:hh=every"], **kw)
    *tokens, mean = tokens  # every token of the 4 (at most 10 listed), then the means
    assert len(tokens) == 4 and all(r["h2o"] >= 0 and r["default"] >= 0 for r in tokens)
    assert [r["default"] - r["h2o"] for r in tokens] == sorted(
        (r["default"] - r["h2o"] for r in tokens), reverse=True)
    assert mean["token"] == "(mean)" and all(mean[k] == pytest.approx(
        sum(r[k] for r in tokens) / 4) for k in ("h2o", "default", "default:hh=every"))
    # Windows scored apart average to the KL of windows scored together.
    assert each["h2o b=0.5"]["kl"] == pytest.approx(rows["h2o b=0.5"]["kl"], rel=1e-3)

