"""Every measurement of the README's "Results", one command.

    python -m studies.reproduce         # light settings, about an hour on 2 cores (estimated)
    python -m studies.reproduce --full  # the README's settings (medians of 3, compiled rows), hours
    python -m studies.reproduce --quick --ckpt TINY_CHECKPOINT   # a smoke test, seconds

It runs, one after the other (never side by side: they time things):
attention_study.py (recovery vs compression, policy mix, decode-time
recovery), evaluate.py (quality and passkey at equal KV bytes), bench.py
(speed against transformers and the roofline) and scaling.py (speed and
memory as the prompt and the batch grow). The light settings keep every
study's size (30 prompts, 30 windows, 40 passkeys, every sweep cell) and
take one timed run per cell instead of three, with no compiled rows.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

# The studies run as modules of the `studies` package, so from the repository root.
ROOT = Path(__file__).resolve().parents[1]
# The kvpress rows of the README, measured once in kvpress's own environment and
# added to the quality run instead of running kvpress again (see --peer).
KVPRESS_ROWS = ROOT / "results/peer_kvpress/kvpress_2026-11-29.json"


def steps(args) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(name, study module and its arguments) of each study, and the arguments all take."""
    out = Path(args.out)
    common = (["--ckpt", args.ckpt] if args.ckpt else []) + (["--quick"] if args.quick else [])
    light = [] if args.full or args.quick else ["--runs", "1"]
    return [
        ("attention study", ["attention_study", "--out", str(out / "attention_study")]),
        ("quality and passkey", ["evaluate", "--out", str(out / "evaluate/quality")]
         + (["--peer", "kvpress", "--peer-python", args.peer_python] if args.peer else
            [] if args.quick else ["--peer-rows", str(KVPRESS_ROWS)])),
        *([] if args.quick else [("quality on news prose", [
            "evaluate", "--out", str(out / "evaluate/quality_news"), "--text", "news",
            "--passkeys", "0", "--paper-thresholds", "0.9", "0.98"])]),
        ("speed against transformers", ["bench", "--out", str(out / "bench/bench.md")]
         + (["--compile", "none"] if light else []) + light),
        ("speed and memory scaling", ["scaling", "--out", str(out / "scaling/scaling")]
         + (["--compile", "none"] if light else []) + light),
    ], common


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.reproduce",
        description="Run every study behind the README's results, one after the other, "
                    "writing into --out.")
    p.add_argument("--out", default="results", help="output folder; each study writes into "
                   "its own folder under it, as in results/ (default results/)")
    p.add_argument("--full", action="store_true", help="the README's settings: medians of 3 "
                   "runs and the compiled rows of bench.py and scaling.py (hours on 2 cores "
                   "instead of about one)")
    p.add_argument("--quick", action="store_true", help="every script in its --quick mode")
    p.add_argument("--ckpt", help="HF-format checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--peer", action="store_true", help="also run NVIDIA kvpress in evaluate.py "
                   "(needs its own environment, see evaluate.py)")
    p.add_argument("--peer-python", default="/tmp/kvp/bin/python",
                   help="python of the kvpress environment (default /tmp/kvp/bin/python)")
    args = p.parse_args(argv)
    try:
        # bench writes into an existing folder only; the other studies make theirs.
        (Path(args.out) / "bench").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror}")
    todo, common = steps(args)
    t_start = time.perf_counter()
    for i, (name, cmd) in enumerate(todo, 1):
        cmd = [sys.executable, "-m", f"studies.{cmd[0]}"] + cmd[1:] + common
        print(f"[{i}/{len(todo)}] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, cwd=ROOT)
        if done.returncode != 0:
            print(f"error: {name} failed (exit {done.returncode}); its output is above",
                  file=sys.stderr)
            return done.returncode
        print(f"[{i}/{len(todo)}] {name}: done in {(time.perf_counter() - t0) / 60:.1f} min",
              file=sys.stderr, flush=True)
    print(f"all done in {(time.perf_counter() - t_start) / 60:.1f} min; results in {args.out}/",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
