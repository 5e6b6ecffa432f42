"""studies.scaling runs end to end in --quick mode on a tiny checkpoint, so it cannot rot."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generate import UsageError
from studies import scaling

ROOT = Path(__file__).resolve().parents[2]


def test_scaling_quick_eager_and_compiled(tiny_ckpt, tmp_path):
    # aot_eager compiles in seconds; inductor would take minutes here.
    res = scaling.main(["--quick", "--ckpt", str(tiny_ckpt), "--threads", "1", "--compile", "both",
                        "--compile-backend", "aot_eager", "--out", str(tmp_path / "s")])
    cells = {(r["prompt"], r["batch"]) for r in res["rows"]}
    assert cells == {(16, 1), (32, 1), (32, 2)}
    for cell in cells:
        assert [(r["impl"], r["compiled"]) for r in res["rows"] if (r["prompt"], r["batch"]) == cell] == [
            ("transformers", False), ("full", False), ("fastgen", False), ("fastgen-paper", False),
            ("full", True), ("fastgen", True)]
    for r in res["rows"]:
        assert r["decode"] > 0 and r["prefill"] > 0 and r["kv"] > 0
        assert r["rss_peak"] >= r["rss_start"] > 0 and r["gpu_peak"] is None
        assert (0 < r["profile_prefill"] < 1) == r["impl"].startswith("fastgen")
        assert (r["compile_s"] > 0) == r["compiled"]
    full = {(r["prompt"], r["batch"], r["compiled"]): r["kv"] for r in res["rows"]
            if r["impl"] == "full"}
    assert full[32, 2, False] == 2 * full[32, 1, False] > full[16, 1, False]  # per sequence
    assert full[32, 2, True] == full[32, 2, False]  # compiling changes no byte
    assert [(p["impl"], p["compiled"], p["new_tokens"]) for p in res["profile"]] == [
        ("fastgen", False, 4), ("fastgen", False, 8), ("fastgen", True, 4), ("fastgen", True, 8),
        ("fastgen-paper", False, 4), ("fastgen-paper", False, 8)]
    assert all(0 < p["profile_share"] < 1 for p in res["profile"])
    md = (tmp_path / "s.md").read_text()
    assert "| 32 | 2 | 0.11 | transformers |" in md and "| 32 | 2 |  | fastgen compiled |" in md
    assert "peak RSS MiB" in md and "% of roofline" in md and "profiling share" in md
    assert json.loads((tmp_path / "s.json").read_text())["rows"]
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_scaling_cuts_a_prompt_to_the_context(tiny_ckpt, tmp_path):
    # The tiny model's context is 256 tokens: 300 + 4 new tokens does not fit, 252 + 4 does.
    small = ["--ckpt", str(tiny_ckpt), "--batches", "1", "--batch-len", "16", "--new-tokens", "4",
             "--runs", "1", "--threads", "1", "--idle-wait", "0", "--compile", "none",
             "--bw-gib", "0.01", "--out", str(tmp_path / "s")]
    res = scaling.main(small + ["--lengths", "16", "300", "--profile-tokens", "4"])
    assert {r["prompt"] for r in res["rows"]} == {16, 252}
    note = "prompt 300 cut to 252 tokens: with 4 new tokens it must fit the model's context of 256"
    assert res["notes"] == [note] and note in (tmp_path / "s.md").read_text()
    with pytest.raises(UsageError, match="no room for a prompt in the model's context of 256"):
        scaling.main(small + ["--lengths", "16", "--profile-tokens", "300"])


def test_scaling_without_the_papers_fastgen(tiny_ckpt, tmp_path):
    res = scaling.main(["--quick", "--ckpt", str(tiny_ckpt), "--threads", "1", "--no-paper",
                        "--out", str(tmp_path / "s")])
    assert {r["impl"] for r in res["rows"]} == {"transformers", "full", "fastgen"}
    assert {p["impl"] for p in res["profile"]} == {"fastgen"}
    assert "the paper's FastGen left out: --no-paper" in (tmp_path / "s.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_scaling_cuda_without_gpu_is_one_line(tiny_ckpt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "studies.scaling", "--quick", "--ckpt",
                        str(tiny_ckpt), "--device", "cuda", "--out", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: --device cuda asked for, but this machine has no CUDA GPU; use --device cpu")
