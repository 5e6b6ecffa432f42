"""studies/prefill_memory.py on the tiny checkpoint: every run a fresh process."""
import json

from studies import prefill_memory


def test_quick_run_reports_every_cache_and_the_cap(tiny_ckpt, tmp_path):
    out = tmp_path / "mem"
    prefill_memory.main(["--quick", "--ckpt", str(tiny_ckpt), "--out", str(out),
                         "--budgets", "0.25"])
    res = json.loads(out.with_suffix(".json").read_text())
    rows = res["rows"]
    assert {(r["kv"], r["chunk"]) for r in rows} == {("full", None), ("full", 32),
                                                     ("fastgen", None), ("fastgen", 32)}
    for r in rows:
        assert r["peak_rss"] >= r["rss_loaded"] > 0 and r["cache_peak"] >= r["kv_end"] > 0
    chunked = {r["kv"]: r for r in rows if r["chunk"]}
    one_call = {r["kv"]: r for r in rows if not r["chunk"]}
    # Read in chunks, the compressed cache never holds the whole prompt's keys and values.
    assert chunked["fastgen"]["cache_peak"] < one_call["fastgen"]["cache_peak"]
    assert chunked["fastgen"]["cache_peak"] < one_call["full"]["full_kv"]
    assert "| 96 |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").is_file()


def test_the_longest_prompt_under_a_limit(tiny_ckpt):
    job = dict(ckpt=str(tiny_ckpt), kv="fastgen", budget=0.5, chunk=32, threads=1)
    assert prefill_memory.longest(job, 100_000, [64, 128])["longest"] == 128  # binds nothing
    small = prefill_memory.longest(job, 64, [64, 128])  # torch alone needs more
    assert small["longest"] is None and small["failed"].startswith("64 (")
