"""Pictures drawn from the studies' result files, without running anything.

    python -m studies.plots                     # results/scaling/scaling.json -> results/scaling/memory.png
    python -m studies.plots --scaling FILE.json --out FILE.png

Memory against prompt length (and batch), from a `studies.scaling` sweep: for
each cache, eager, the run's own peak memory (the process's resident high-water
mark above what it held when the run began, or torch's peak allocation on
CUDA), solid, beside the bytes the KV cache allocated at the end of the
generation, dotted. The gap between the two is what the run needed besides the
cache it kept: activations, the logits, and during prefill the prompt's keys
and values before compression; so the peak, not the cache, is what a machine
must hold.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

LOOK = {"transformers": ("C0", "s"), "full": ("C1", "o"), "fastgen": ("C2", "^"),
        "fastgen-paper": ("C3", "v")}


def peak(row: dict) -> float:
    """The run's own peak in MiB: GPU memory where it was measured, else RSS."""
    if row.get("gpu_peak") is not None:
        return (row["gpu_peak"] - row["gpu_start"]) / 2**20
    return (row["rss_peak"] - row["rss_start"]) / 2**20


def memory(res: dict, path: Path) -> None:
    """Peak memory and KV bytes against the prompt (batch 1) and the batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if not r["compiled"]]  # a compiled row holds the same cache
    n = res["batch_len"]
    by = {(r["prompt"], r["batch"], r["impl"]): r for r in rows}
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, xs, cell, xlabel in [
            (axes[0], sorted({r["prompt"] for r in rows if r["batch"] == 1}),
             lambda x: (x, 1), "prompt tokens (batch 1)"),
            (axes[1], sorted({r["batch"] for r in rows if r["prompt"] == n}),
             lambda x: (n, x), f"batch ({n}-token prompts)")]:
        for impl in impls:
            color, marker = LOOK.get(impl, ("C7", "x"))
            pts = [by[(*cell(x), impl)] for x in xs]
            ax.plot(xs, [peak(p) for p in pts], color=color, marker=marker,
                    label=f"{impl}: run's peak")
            ax.plot(xs, [p["kv"] / 2**20 for p in pts], color=color, marker=marker,
                    linestyle=":", markerfacecolor="none", label=f"{impl}: KV allocated")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{Path(res['ckpt']).name}, {res['dtype']} on {res['device']}, "
                 f"{res['new_tokens']} new tokens, eager: memory of one run ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(scaling: str = "results/scaling/scaling.json",
         out: str = "results/scaling/memory.png") -> Path:
    src, dst = Path(scaling), Path(out)
    if not src.is_file():
        raise SystemExit(f"error: {src} does not exist; run `python -m studies.scaling` "
                         "or pass --scaling FILE.json")
    if not dst.parent.is_dir():
        raise SystemExit(f"error: the folder {dst.parent} does not exist")
    memory(json.loads(src.read_text()), dst)
    return dst


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Draw pictures from the studies' result files.")
    p.add_argument("--scaling", default="results/scaling/scaling.json",
                   help="a studies.scaling JSON (default results/scaling/scaling.json)")
    p.add_argument("--out", default="results/scaling/memory.png",
                   help="the picture to write (default results/scaling/memory.png)")
    a = p.parse_args()
    print(main(a.scaling, a.out))
