"""Speed and memory as the prompt and the batch grow: FastGen, the full cache, transformers.

    python scaling.py                       # SmolLM2-135M, ~35 min on 2 cores
    python scaling.py --quick --ckpt TINY   # a smoke test, seconds

Two sweeps, eager, greedy, prompts of real text (`textdata`, no padding):
the prompt grows (512, 1k, 2k, 4k tokens at batch 1) and the batch grows
(1, 4, 8 at a 2k prompt). In each cell, round-robin over the implementations,
`--runs` times: HF `generate` (its DynamicCache), our full cache and our
FastGen cache at `--recovery`; prefill and decode tokens/s (median) and the KV
bytes each cache really allocated. The speed measurement is bench.py's (see
there). Then the profiling share: FastGen's profiling and compression time
over its whole generation (prefill + decode) at 128 and 512 new tokens.

Writes `--out`.md, .json and .png (default results/scaling).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import machine_info, time_hf, time_ours, wait_until_idle, weight_bytes
from generate import dense_kv_bytes

IMPLS = ("transformers", "full", "fastgen", "fastgen-paper")
FASTGENS = ("fastgen", "fastgen-paper")


def cells(args) -> list[tuple[int, int]]:
    """(prompt length, batch) of both sweeps, each once."""
    grid = [(n, 1) for n in args.lengths] + [(args.batch_len, b) for b in args.batches]
    return list(dict.fromkeys(grid))


def measure(args) -> dict:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from model import load_model
    from policies import token_flags
    from textdata import prompts as text_prompts
    from tokenizer import Tokenizer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model = load_model(args.ckpt)
    hf = LlamaForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
    tok = Tokenizer(args.ckpt)
    V = model.args.vocab_size
    flags = token_flags(V, [i for i in tok.special_ids if i < V],
                        [i for i in tok.punctuation_ids() if i < V])

    def run(impl, prompts, new_tokens):
        if impl == "transformers":
            return time_hf(hf, prompts, new_tokens)
        return time_ours(model, prompts, new_tokens, impl.split("-")[0], False, flags,
                         recovery=args.recovery, paper=impl == "fastgen-paper")

    grid = cells(args)
    reuse = (args.batch_len, 1) in grid and args.new_tokens in args.profile_tokens
    long = [n for n in args.profile_tokens if not (reuse and n == args.new_tokens)]
    bar = tqdm(total=args.runs * (len(grid) * len(IMPLS) + len(long) * len(FASTGENS)),
               desc="scaling", unit="run")
    for impl in IMPLS:  # warm-up
        run(impl, [list(range(100, 108))], 2)
    rows = []
    for n, B in grid:
        prompts = text_prompts(tok, B, n, n, seed=args.seed)
        got = {impl: [] for impl in IMPLS}
        for _ in range(args.runs):
            for impl in IMPLS:
                bar.set_postfix_str(f"prompt {n}, batch {B}: {impl}")
                wait_until_idle(args.idle_wait)
                got[impl].append(run(impl, prompts, args.new_tokens))
                bar.update()
        for impl, ts in got.items():
            rows.append(dict(prompt=n, batch=B, impl=impl, new_tokens=args.new_tokens,
                             **{k: statistics.median(t[k] for t in ts)
                                for k in ("prefill", "decode", "cpu", "profile_share")},
                             kv=ts[-1]["kv"], full_kv=ts[-1]["full_kv"], runs=ts))
    profile = [r for r in rows if reuse and r["impl"] in FASTGENS
               and (r["prompt"], r["batch"]) == (args.batch_len, 1)]
    prompts = text_prompts(tok, 1, args.batch_len, args.batch_len, seed=args.seed)
    for n_new in long:
        for impl in FASTGENS:
            ts = []
            for _ in range(args.runs):
                bar.set_postfix_str(f"profiling share, {impl}, {n_new} new tokens")
                wait_until_idle(args.idle_wait)
                ts.append(run(impl, prompts, n_new))
                bar.update()
            profile.append(dict(prompt=args.batch_len, batch=1, impl=impl, new_tokens=n_new,
                                profile_share=statistics.median(t["profile_share"] for t in ts),
                                runs=ts))
    bar.close()
    return dict(rows=rows, profile=sorted(profile, key=lambda r: (r["impl"], r["new_tokens"])),
                weight_bytes=weight_bytes(model), kv_token_bytes=dense_kv_bytes(model, 1, 1),
                batch_len=args.batch_len,
                machine=machine_info(args.threads), date=time.strftime("%Y-%m-%d %H:%M"),
                command="python scaling.py " + " ".join(args.argv), ckpt=str(args.ckpt),
                runs=args.runs, new_tokens=args.new_tokens, recovery=args.recovery)


def report(res: dict) -> str:
    by = {(r["prompt"], r["batch"], r["impl"]): r for r in res["rows"]}
    lines = [
        "# Speed and memory as the prompt and the batch grow",
        "",
        f"Machine: {res['machine']}; {res['date']}. Checkpoint `{Path(res['ckpt']).name}`, "
        f"float32, eager, greedy, {res['new_tokens']} new tokens, prompts of real text "
        f"(`textdata`); median of {res['runs']} run(s), round-robin. FastGen at T = "
        f"{res['recovery']}, with its defaults and as the paper states it (`--paper`: "
        f"profiling over every prompt row). Runtime {res['runtime_s'] / 60:.1f} min.",
        "",
        f"    {res['command']}",
        "",
        "KV/weights: bytes the full cache holds at the end / weight bytes a decode step "
        f"reads ({res['weight_bytes'] / 1e6:.0f} MB); above 1 the cache, not the weights, "
        "dominates the memory traffic of a step.",
        "",
        "| prompt | batch | KV/weights | decode tok/s: HF | full | FastGen | paper "
        "| FastGen vs full | paper vs full | prefill tok/s: HF | full | FastGen | paper "
        "| KV MiB: HF | full | FastGen | paper | CPU share |",
        "|" + "---:|" * 18,
    ]
    for n, B in dict.fromkeys((r["prompt"], r["batch"]) for r in res["rows"]):
        h, f, g, p = (by[n, B, i] for i in IMPLS)
        ratio = B * (n + res["new_tokens"]) * res["kv_token_bytes"] / res["weight_bytes"]
        lines.append(
            f"| {n} | {B} | {ratio:.2f} | {h['decode']:.2f} | {f['decode']:.2f} | "
            f"{g['decode']:.2f} | {p['decode']:.2f} | {g['decode'] / f['decode']:.2f}x | "
            f"{p['decode'] / f['decode']:.2f}x | {h['prefill']:.0f} | {f['prefill']:.0f} | "
            f"{g['prefill']:.0f} | {p['prefill']:.0f} | {h['kv'] / 2**20:.1f} | "
            f"{f['kv'] / 2**20:.1f} | {g['kv'] / 2**20:.1f} ({g['kv'] / g['full_kv']:.0%}) | "
            f"{p['kv'] / 2**20:.1f} ({p['kv'] / p['full_kv']:.0%}) | "
            f"{min(x['cpu'] for x in (h, f, g, p)):.0%} |")
    lines += [
        "",
        "KV MiB: bytes allocated at the end of generation (HF: its DynamicCache tensors; ours: "
        "`nbytes()`, K, V and every index and score tensor; FastGen: % of our full cache). "
        "CPU share: the lowest of the row's medians of CPU time / (wall x threads); well "
        "under 100% means other processes took the cores.",
        "",
        "## Profiling share",
        "",
        "FastGen's profiling and compression (in prefill, every layer) / its whole generation "
        "time (prefill + decode), batch 1:",
        "",
        "| FastGen | prompt | new tokens | profiling share |",
        "|---|---:|---:|---:|",
        *(f"| {r['impl']} | {r['prompt']} | {r['new_tokens']} | {r['profile_share']:.1%} |"
          for r in res["profile"]),
        "",
        f"![decode speed and KV memory]({Path(res['png']).name})",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, n = res["rows"], res["batch_len"]
    by = {(r["prompt"], r["batch"], r["impl"]): r for r in rows}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex="col")
    for col, (xs, cell, label) in enumerate([  # every cell of both sweeps was measured
            (sorted({r["prompt"] for r in rows if r["batch"] == 1}), lambda x: (x, 1),
             "prompt tokens (batch 1)"),
            (sorted({r["batch"] for r in rows if r["prompt"] == n}), lambda x: (n, x),
             f"batch ({n}-token prompts)")]):
        for impl, style in zip(IMPLS, ("s:", "o--", "^-", "v-.")):
            pts = [by[(*cell(x), impl)] for x in xs]
            axes[0, col].plot(xs, [p["decode"] for p in pts], style, label=impl)
            axes[1, col].plot(xs, [p["kv"] / 2**20 for p in pts], style, label=impl)
        axes[0, col].set_ylabel("decode tok/s (all sequences)")
        axes[1, col].set_ylabel("KV cache allocated, MiB")
        axes[1, col].set_xlabel(label)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.set_xticks(xs)
    axes[0, 0].legend()
    fig.suptitle(f"{Path(res['ckpt']).name}, eager, {res['new_tokens']} new tokens, "
                 f"FastGen T={res['recovery']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Decode speed and KV memory of FastGen, our full "
                                "cache and HF transformers as the prompt and the batch grow, "
                                "and FastGen's profiling share. Writes a markdown table, JSON "
                                "and a PNG.")
    p.add_argument("--ckpt", help="HF-format checkpoint folder or Llama GGUF file "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="prompt lengths of the first sweep, batch 1 (default 512 1024 2048 4096)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8],
                   help="batch sizes of the second sweep (default 1 4 8)")
    p.add_argument("--batch-len", type=int, default=2048,
                   help="prompt length of the batch sweep and the profiling share (default 2048)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated (default 128)")
    p.add_argument("--profile-tokens", type=int, nargs="+", default=[128, 512],
                   help="new-token counts of the profiling share (default 128 512)")
    p.add_argument("--recovery", type=float, default=0.95, help="FastGen T (default 0.95)")
    p.add_argument("--runs", type=int, default=3, help="runs per cell (default 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"torch threads (default {torch.get_num_threads()}, all cores)")
    p.add_argument("--seed", type=int, default=0, help="text seed (default 0)")
    p.add_argument("--idle-wait", type=float, default=300, help="before each run, wait up to "
                   "this many seconds for other processes to leave the CPUs (default 300)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: prompts 16 and 32, batch 1 and 2, 4 new tokens, one run")
    p.add_argument("--out", default="results/scaling",
                   help="output path without suffix (default results/scaling)")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.quick:
        args.lengths, args.batches, args.batch_len = [16, 32], [1, 2], 32
        args.new_tokens, args.profile_tokens, args.runs, args.idle_wait = 4, [4, 8], 1, 0
    if (args.new_tokens < 2 or min(args.profile_tokens) < 2 or args.runs < 1
            or min(args.lengths + args.batches + [args.batch_len, args.threads]) < 1):
        p.error("need --new-tokens and --profile-tokens >= 2, --runs >= 1, positive sizes "
                "and threads")
    from convert_gguf import checkpoint_folder
    args.ckpt = checkpoint_folder(args.ckpt)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # before the hour of measuring, not after
    t0 = time.perf_counter()
    res = measure(args)
    res["runtime_s"], res["png"] = time.perf_counter() - t0, str(out.with_suffix(".png"))
    plot(res, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    text = report(res)
    out.with_suffix(".md").write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    from generate import exit_on_user_error
    with exit_on_user_error():
        main()
