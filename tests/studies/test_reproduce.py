"""studies.reproduce runs every study in --quick mode on a tiny checkpoint."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reproduce_quick(tiny_ckpt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "studies.reproduce", "--quick", "--ckpt",
                        str(tiny_ckpt), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("attention_study/attention_study.md", "evaluate/quality.md", "bench/bench.md",
                 "scaling/scaling.md", "scaling/scaling.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "[4/4] speed and memory scaling: done" in r.stderr
