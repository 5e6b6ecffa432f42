"""studies.attention_study in quick mode on a tiny random checkpoint: it writes its
report and pictures, its numbers are shares, and the bytes it derives for
every threshold are the bytes the real cache allocates."""
import json

from studies import attention_study


def test_quick_study(tiny_ckpt, tmp_path):
    res = attention_study.main(tiny_ckpt, tmp_path, quick=True)
    for name in ("attention_study.md", "attention_study.json", "policy_mix.png",
                 "policy_mix_all_T.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert res["checks"] and res["checks_ok"], res["checks"]
    for t, s in res["summary"].items():
        assert 0 <= s["recovery_min"] <= s["recovery_mean"] <= 1
        assert s["recovery_min"] >= t or s["mix"][:, -1].sum() > 0  # below T only where Full
        assert 0 <= s["compression_mean"] <= 1 and 0 <= s["kept_share"] <= 1
        assert abs(float(s["mix"].sum(1).mean()) - 1) < 1e-6
    assert ((res["per_step"] >= 0) & (res["per_step"] <= 1 + 1e-5)).all()
    assert ((res["prompt_rec"] >= 0) & (res["prompt_rec"] <= 1 + 1e-5)).all()
    assert "Which profiling predicts decoding" in (tmp_path / "attention_study.md").read_text()
    data = json.loads((tmp_path / "attention_study.json").read_text())
    assert data["checks_ok"] and len(data["prompt_lens"]) == 3


def test_decode_check_full_cache_recovers_everything(tiny_ckpt):
    """At T = 1 every head is Full, so the held tokens carry all the dense attention."""
    import torch
    from model import load_model
    model = load_model(tiny_ckpt)
    rec, prompt_rec, variants, choice = attention_study.decode_check(model, list(range(3, 40)),
                                                                      None, 1.0, (1, 4))
    # With and without the sink's mass, at both steps.
    assert rec.shape == (2, 2, model.args.n_layers, model.args.n_kv_heads)
    assert torch.allclose(rec, torch.ones_like(rec), atol=1e-5)
    # Every profiling variant says Full recovers everything.
    assert variants.shape == (len(attention_study.VARIANTS), *choice.shape)
    assert torch.allclose(variants, torch.ones_like(variants), atol=1e-5)
    assert (choice == len(attention_study.shortlist()) - 1).all()
