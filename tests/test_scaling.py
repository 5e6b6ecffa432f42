"""scaling.py runs end to end in --quick mode on a tiny checkpoint, so it cannot rot."""
import json

import scaling


def test_scaling_quick(tiny_ckpt, tmp_path):
    res = scaling.main(["--quick", "--ckpt", str(tiny_ckpt), "--out", str(tmp_path / "s")])
    cells = {(r["prompt"], r["batch"]) for r in res["rows"]}
    assert cells == {(16, 1), (32, 1), (32, 2)}
    for r in res["rows"]:
        assert r["decode"] > 0 and r["prefill"] > 0 and r["kv"] > 0
    full = {(r["prompt"], r["batch"]): r["kv"] for r in res["rows"] if r["impl"] == "full"}
    assert full[32, 2] == 2 * full[32, 1] > full[16, 1]  # allocated bytes, per sequence
    assert [(p["impl"], p["new_tokens"]) for p in res["profile"]] == [
        ("fastgen", 4), ("fastgen", 8), ("fastgen-paper", 4), ("fastgen-paper", 8)]
    assert all(0 < p["profile_share"] < 1 for p in res["profile"])
    md = (tmp_path / "s.md").read_text()
    assert "| 32 | 2 |" in md and "profiling share" in md
    assert json.loads((tmp_path / "s.json").read_text())["rows"]
    assert (tmp_path / "s.png").stat().st_size > 1000
