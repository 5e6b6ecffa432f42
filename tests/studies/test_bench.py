"""studies.bench runs end to end in --quick mode on a tiny checkpoint, so it cannot rot."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def bench(*args):
    return subprocess.run([sys.executable, "-m", "studies.bench", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_bench_quick_eager_and_compiled(tiny_ckpt, tmp_path):
    # aot_eager compiles in seconds; inductor would take a minute here.
    out = tmp_path / "bench.md"
    r = bench("--quick", "--ckpt", tiny_ckpt, "--threads", 1, "--compile", "both",
              "--compile-backend", "aot_eager", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    table = out.read_text()
    assert "roofline" in table.lower() and "VmHWM" in table
    header, _, *rows = [line for line in table.splitlines() if line.startswith("|")]
    rows = {tuple(c.strip() for c in row.strip("|").split("|")[:3]): row for row in rows}
    assert set(rows) == {("transformers", "1", "no"), ("ours full", "1", "no"),
                         ("ours fastgen", "1", "no"), ("ours full", "1", "yes"),
                         ("ours fastgen", "1", "yes")}
    col = [c.strip() for c in header.strip("|").split("|")].index("peak RSS MiB")
    for row in rows.values():
        assert float(row.strip("|").split("|")[col]) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_bench_cuda_without_gpu_is_one_line(tiny_ckpt):
    r = bench("--quick", "--ckpt", tiny_ckpt, "--device", "cuda")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: --device cuda asked for, but this machine has no CUDA GPU; use --device cpu")


def test_bench_prompt_longer_than_context(tiny_ckpt):
    # The tiny model's context is 256 tokens.
    r = bench("--ckpt", tiny_ckpt, "--prompt-len", 250, "--idle-wait", 0)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "exceeds the model's context of 256 tokens" in r.stderr.strip().splitlines()[-1]


def test_kv_specs_name_a_cache_or_fail_in_one_line(tiny_ckpt):
    from generation import CacheOptions
    from studies.bench import cache_options, kv_error
    assert cache_options("full@16") == CacheOptions("full", kv_bits=(16,))
    assert cache_options("fastgen@16/8/4:0.25") == CacheOptions("fastgen", kv_budget=0.25,
                                                                 kv_bits=(16, 8, 4))
    assert cache_options("h2o") == CacheOptions("h2o")
    assert "--kv must be one of" in kv_error(["fastgen+every"])
    r = bench("--ckpt", str(tiny_ckpt), "--quick", "--kv", "h2o@16/8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--kv h2o@16/8: several --kv-bits" in r.stderr.strip().splitlines()[-1]


def test_bench_without_hf_has_our_rows_only(tiny_ckpt, tmp_path):
    out = tmp_path / "bench.md"
    r = bench("--quick", "--ckpt", tiny_ckpt, "--threads", 1, "--no-hf", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in out.read_text().splitlines()
            if line.startswith("| ours")]
    assert [r[0].strip() for r in rows] == ["ours full", "ours fastgen"]
    assert all(c.strip() == "—" for r in rows for c in r[5:7])  # no HF to compare with
    assert "transformers" not in out.read_text().split("| impl")[1]
