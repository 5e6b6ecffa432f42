"""bench.py runs end to end in --quick mode on a tiny checkpoint, so it cannot rot."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick(tiny_ckpt, tmp_path):
    out = tmp_path / "bench.md"
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--quick", "--ckpt", str(tiny_ckpt),
                        "--idle-wait", "0", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    table = out.read_text()
    assert "transformers" in table and "fastgen" in table and "roofline" in table.lower()
