"""studies/chunked_prefill.py on the tiny checkpoint."""
import json

from studies import chunked_prefill


def test_quick_run_compares_chunks_one_call_and_sink(tiny_ckpt, tmp_path):
    out = tmp_path / "chunked"
    chunked_prefill.main(["--quick", "--ckpt", str(tiny_ckpt), "--out", str(out),
                          "--budgets", "0.5", "--text", "pydoc", "--threads", "1"])
    res = json.loads(out.with_suffix(".json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["full", "fastgen 0.5, one call", "fastgen 0.5, chunks",
                          "sink at fastgen 0.5's share, chunks"]
    assert rows["full"]["kl"] < 1e-9 and rows["full"]["top1"] == 1 and rows["full"]["share"] == 1
    chunks, sink = rows["fastgen 0.5, chunks"], rows["sink at fastgen 0.5's share, chunks"]
    assert chunks["options"]["prefill_chunk"] == 32
    assert sink["options"]["kv_budget"] == round(chunks["share"], 3)  # the share it was given
    assert all(0 < r["share"] < 1 for name, r in rows.items() if name != "full")
    # The tiny model's context (256 tokens) holds no pass-key prompt: the column says so.
    assert all(r["passkey_acc"] is None for r in rows.values())
    assert "## 96 tokens" in out.with_suffix(".md").read_text()
