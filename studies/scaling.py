"""Speed and memory as the prompt and the batch grow: FastGen, the full cache, transformers.

    python -m studies.scaling                       # SmolLM2-135M, every cell below: hours on 2 cores
    python -m studies.scaling --compile none --runs 1 --idle-wait 0   # eager only, one run per cell
    python -m studies.scaling --device cuda --dtype bfloat16 --compile-mode reduce-overhead
    python -m studies.scaling --quick --ckpt TINY   # a smoke test, seconds

Two sweeps, greedy, prompts of real text (`textdata`, no padding): the prompt
grows (512, 2k, 4k, 8k tokens at batch 1) and the batch grows (1, 4, 8, 16 at
a 2k prompt). A prompt that does not fit the model's context with its new
tokens is cut to the longest that does, context - new tokens (SmolLM2's 8192
with 128 new tokens: the 8k cell is 8064 tokens), with a note on stderr and in
the report; asking for more new tokens than the context holds is an error.

In each cell, round-robin, `--runs` times: HF `generate` (its DynamicCache,
always eager), our full cache and our FastGen cache (the default, and the paper's method
at `--recovery`), eager, and with `--compile` both or only
our full and FastGen caches with the decode step compiled (the first,
compiling step left out of the decode time). Per row: decode and prefill
tokens/s (median), decode as a share of the bandwidth roofline, the KV bytes
the cache allocated, FastGen's profiling and compression time as a share of
its prefill, and the run's peak memory (process RSS, or the GPU's on CUDA).
The measurements are bench.py's (see there). Then the profiling share of the
whole generation (prefill + decode) at 128 and 512 new tokens.

Writes `--out`.md, .json and .png (default results/scaling/scaling).
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

from generate import UsageError
from generation import CacheOptions, dense_kv_bytes, flags_of
from studies import output
from studies.bench import (MEMORY_NOTE, add_device_args, bandwidth_gbs, check_device_args,
                           load_pair, machine_info, time_hf, time_ours, wait_until_idle,
                           weight_bytes)

EAGER = ("transformers", "full", "fastgen", "fastgen-paper")
COMPILED = ("full", "fastgen")  # transformers is measured eager only, as is the paper's FastGen


def variants(args) -> list[tuple[str, bool]]:
    """(implementation, compiled) of each row of a cell, in round-robin order."""
    eager = [(i, False) for i in EAGER if (args.compile != "only" or i == "transformers")
             and (args.paper or i != "fastgen-paper")]
    return eager + [(i, True) for i in COMPILED if args.compile != "none"]


def label(impl: str, compiled: bool) -> str:
    return impl + " compiled" * compiled


def fit(n: int, new_tokens: int, context: int, notes: list[str]) -> int:
    """Prompt length `n`, cut to the longest that leaves room for `new_tokens` in the context."""
    if n + new_tokens <= context:
        return n
    if new_tokens >= context:
        raise UsageError(f"{new_tokens} new tokens leave no room for a prompt in the model's "
                         f"context of {context} tokens; lower --new-tokens or --profile-tokens")
    notes.append(f"prompt {n} cut to {context - new_tokens} tokens: with {new_tokens} new "
                 f"tokens it must fit the model's context of {context}")
    return context - new_tokens


def cells(args) -> list[tuple[int, int]]:
    """(prompt length, batch) of both sweeps, each once."""
    grid = [(n, 1) for n in args.lengths] + [(args.batch_len, b) for b in args.batches]
    return list(dict.fromkeys(grid))


def summarize(ts: list[dict]) -> dict:
    """One row from its runs: the median speeds and shares, the highest peak memory, the
    bytes of the last run."""
    top = max(ts, key=lambda t: t["gpu_peak"] or t["rss_peak"] or 0)
    return ({k: statistics.median(t[k] for t in ts)
             for k in ("prefill", "decode", "cpu", "profile_share", "profile_prefill")}
            | {k: top[k] for k in ("rss_start", "rss_peak", "gpu_start", "gpu_peak")}
            | dict(kv=ts[-1]["kv"], full_kv=ts[-1]["full_kv"], runs=ts))


def measure(args) -> dict:
    from studies.textdata import prompts as text_prompts
    from tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model, hf = load_pair(args.ckpt, args.dtype, args.device)
    tok = Tokenizer(args.ckpt)
    flags = flags_of(model, tok)
    context, notes = model.args.max_seq_len, []
    lengths = [fit(n, args.new_tokens, context, notes) for n in args.lengths]
    batch_len = fit(args.batch_len, args.new_tokens, context, notes)
    profile_len = {n: fit(batch_len, n, context, notes) for n in args.profile_tokens}
    for note in dict.fromkeys(notes):
        print(f"note: {note}", file=sys.stderr)
    args.lengths, args.batch_len = lengths, batch_len

    impls = variants(args)
    compiling = any(c for _, c in impls)

    def run(impl, compiled, prompts, new_tokens):
        if impl == "transformers":
            return time_hf(hf, prompts, new_tokens)
        paper = impl == "fastgen-paper"
        cache = CacheOptions(impl.split("-")[0], paper=paper,
                             recovery=args.recovery if paper else None)
        return time_ours(model, prompts, new_tokens, cache, compiled, flags, args.compile_options)

    grid = cells(args)
    profilers = [v for v in impls if v[0] in ("fastgen", "fastgen-paper")]
    reuse = (batch_len, 1) in grid and args.new_tokens in args.profile_tokens
    long = [n for n in args.profile_tokens if not (reuse and n == args.new_tokens)]
    bar = tqdm(total=args.runs * (len(grid) * len(impls) + len(long) * len(profilers)),
               desc="scaling", unit="run")
    for impl in dict.fromkeys(i for i, _ in impls):  # warm-up, eager: compiling is timed apart
        run(impl, False, [list(range(100, 108))], 2)
    wait_until_idle(args.idle_wait)
    bw = bandwidth_gbs(args.bw_gib, device=args.device)
    rows = []
    for n, B in grid:
        prompts = text_prompts(tok, B, n, n, seed=args.seed)
        compile_s = {}
        if compiling:
            # Each cell gets graphs of its own, compiled here, in an untimed run
            # (FastGen's pool size is dynamic in its graph, so growing compiles nothing).
            torch._dynamo.reset()
            for v in impls:
                if v[1]:
                    compile_s[v] = run(*v, prompts, args.new_tokens)["compile_s"]
        got = {v: [] for v in impls}
        for _ in range(args.runs):
            for v in impls:
                bar.set_postfix_str(f"prompt {n}, batch {B}: {label(*v)}")
                wait_until_idle(args.idle_wait)
                got[v].append(run(*v, prompts, args.new_tokens))
                bar.update()
        for (impl, compiled), ts in got.items():
            rows.append(dict(prompt=n, batch=B, impl=impl, compiled=compiled,
                             new_tokens=args.new_tokens,
                             **summarize(ts), compile_s=compile_s.get((impl, compiled), 0.0)))
    profile = [r for r in rows if reuse and (r["impl"], r["compiled"]) in profilers
               and (r["prompt"], r["batch"]) == (batch_len, 1)]
    for n_new in long:
        prompts = text_prompts(tok, 1, profile_len[n_new], profile_len[n_new], seed=args.seed)
        if compiling:
            torch._dynamo.reset()
        for v in profilers:
            ts = []
            for _ in range(args.runs):
                bar.set_postfix_str(f"profiling share, {label(*v)}, {n_new} new tokens")
                wait_until_idle(args.idle_wait)
                ts.append(run(*v, prompts, n_new))
                bar.update()
            profile.append(dict(prompt=profile_len[n_new], batch=1, impl=v[0], compiled=v[1],
                                new_tokens=n_new, runs=ts,
                                profile_share=statistics.median(t["profile_share"] for t in ts)))
    bar.close()
    return dict(rows=rows, profile=sorted(profile, key=lambda r: (r["impl"], r["compiled"],
                                                                  r["new_tokens"])),
                weight_bytes=weight_bytes(model), kv_token_bytes=dense_kv_bytes(model, 1, 1),
                bandwidth_gbs=bw, batch_len=batch_len, context=context,
                notes=list(dict.fromkeys(notes)),
                machine=machine_info(args.threads, args.device),
                date=time.strftime("%Y-%m-%d %H:%M"),
                command="python -m studies.scaling " + " ".join(args.argv), ckpt=str(args.ckpt),
                device=args.device, dtype=args.dtype, compile=args.compile,
                compile_mode=args.compile_mode, compile_backend=args.compile_backend,
                runs=args.runs, new_tokens=args.new_tokens, recovery=args.recovery,
                paper=args.paper)


def mode(res: dict) -> str:
    return "in budget mode (0.5)" if res["recovery"] is None else f"at T = {res['recovery']}"


def roofline(res: dict, n: int, B: int) -> float:
    """Decode tok/s if a step only read the weights once and the full cache of B sequences
    (mean context over the steps), at the measured copy bandwidth (bench.py's roofline)."""
    context = n + res["new_tokens"] / 2
    return B * res["bandwidth_gbs"] * 1e9 / (res["weight_bytes"] + B * res["kv_token_bytes"] * context)


def report(res: dict) -> str:
    by = {(r["prompt"], r["batch"], r["impl"], r["compiled"]): r for r in res["rows"]}
    gpu = res["device"].startswith("cuda")
    compiled = (f"compiled rows: torch.compile of the decode step, backend "
                f"{res['compile_backend']}, mode {res['compile_mode']}"
                if res["compile"] != "none" else "eager only")
    lines = [
        "# Speed and memory as the prompt and the batch grow",
        "",
        f"Machine: {res['machine']}; {res['date']}. Checkpoint `{Path(res['ckpt']).name}`, "
        f"{res['dtype']} on {res['device']}, greedy, {res['new_tokens']} new tokens, prompts "
        f"of real text (`textdata`); median of {res['runs']} run(s), round-robin; {compiled}. "
        f"FastGen {mode(res)}, with its defaults"
        + (", and as the paper states it (`paper`: T = 0.95, profiling over every prompt row, "
           "eviction after every token). " if res["paper"] else " (the paper's FastGen left "
           "out: --no-paper). ")
        + f"Runtime {res['runtime_s'] / 60:.1f} min.",
        "",
        f"    {res['command']}",
        "",
        *(f"Note: {note}." for note in res["notes"]),
        *([""] if res["notes"] else []),
        "KV/weights: bytes the full cache holds at the end / weight bytes a decode step "
        f"reads ({res['weight_bytes'] / 1e6:.3g} MB); above 1 the cache, not the weights, "
        "dominates the memory traffic of a step.",
        "",
        "| prompt | batch | KV/weights | impl | decode tok/s | vs full eager | % of roofline "
        "| prefill tok/s | KV MiB | profiling / prefill "
        f"| peak {'GPU' if gpu else 'RSS'} MiB | run's own MiB | CPU share |",
        "|" + "---:|" * 3 + "---|" + "---:|" * 9,
    ]
    mib = lambda x: "n/a" if x is None else f"{x / 2**20:.0f}"
    for n, B in dict.fromkeys((r["prompt"], r["batch"]) for r in res["rows"]):
        ratio = B * (n + res["new_tokens"]) * res["kv_token_bytes"] / res["weight_bytes"]
        base = by.get((n, B, "full", False)) or by[n, B, "full", True]
        first = f"{ratio:.2f}"  # once per cell
        for r in (r for r in res["rows"] if (r["prompt"], r["batch"]) == (n, B)):
            start, peak = (r["gpu_start"], r["gpu_peak"]) if gpu else (r["rss_start"], r["rss_peak"])
            kv = f"{r['kv'] / 2**20:.4g}"
            if r["kv"] != r["full_kv"]:
                kv += f" ({r['kv'] / r['full_kv']:.0%})"
            profiling = f"{r['profile_prefill']:.1%}" if r["impl"].startswith("fastgen") else ""
            lines.append(
                f"| {n} | {B} | {first} | {label(r['impl'], r['compiled'])} "
                f"| {r['decode']:.2f} | {r['decode'] / base['decode']:.2f}x "
                f"| {r['decode'] / roofline(res, n, B):.1%} | {r['prefill']:.0f} | {kv} "
                f"| {profiling} | {mib(peak)} | {mib(None if peak is None else peak - start)} "
                f"| {r['cpu']:.0%} |")
            first = ""
    lines += [
        "",
        "vs full eager: decode tok/s / our full cache's, eager (compiled where only compiled "
        "was measured). % of roofline: decode tok/s / the bandwidth roofline of the cell, "
        f"batch x {res['bandwidth_gbs']:.1f} GB/s (copy bandwidth, measured) / (weight bytes + "
        "batch x the full cache's bytes at the mean context); FastGen is held to the full "
        "cache's roofline. KV MiB: bytes allocated at the end of generation (HF: its "
        "DynamicCache tensors; ours: `nbytes()`, K, V and every index and score tensor; "
        "FastGen: % of our full cache). Profiling / prefill: FastGen's profiling and "
        "compression time / its prefill time. "
        + MEMORY_NOTE[gpu] + " The highest of the runs (compiling happens in an untimed run "
        "before them); run's own: that peak less what was held when the run began. CPU share: "
        "the median of CPU time / (wall x threads); well under 100% means other processes "
        "took the cores.",
        "",
        "## Profiling share",
        "",
        "FastGen's profiling and compression (in prefill, every layer) / its whole generation "
        "time (prefill + decode), batch 1:",
        "",
        "| FastGen | prompt | new tokens | profiling share |",
        "|---|---:|---:|---:|",
        *(f"| {label(r['impl'], r['compiled'])} | {r['prompt']} | {r['new_tokens']} "
          f"| {r['profile_share']:.1%} |" for r in res["profile"]),
        "",
        f"![decode speed and KV memory]({Path(res['png']).name})",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, n = res["rows"], res["batch_len"]
    by = {(r["prompt"], r["batch"], r["impl"], r["compiled"]): r for r in rows}
    impls = list(dict.fromkeys((r["impl"], r["compiled"]) for r in rows))
    look = {"transformers": ("C0", "s"), "full": ("C1", "o"), "fastgen": ("C2", "^"),
            "fastgen-paper": ("C3", "v")}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex="col")
    for col, (xs, cell, xlabel) in enumerate([  # every cell of both sweeps was measured
            (sorted({r["prompt"] for r in rows if r["batch"] == 1}), lambda x: (x, 1),
             "prompt tokens (batch 1)"),
            (sorted({r["batch"] for r in rows if r["prompt"] == n}), lambda x: (n, x),
             f"batch ({n}-token prompts)")]):
        for impl, compiled in impls:
            color, marker = look[impl]
            pts = [by[(*cell(x), impl, compiled)] for x in xs]
            style = dict(color=color, marker=marker, linestyle="--" if compiled else "-",
                         label=label(impl, compiled))
            axes[0, col].plot(xs, [p["decode"] for p in pts], **style)
            # A compiled row allocates the cache its eager row does: one line for both.
            if not (compiled and (impl, False) in impls):
                axes[1, col].plot(xs, [p["kv"] / 2**20 for p in pts], **style)
        axes[0, col].set_ylabel("decode tok/s (all sequences)")
        axes[1, col].set_ylabel("KV cache allocated, MiB")
        axes[1, col].set_xlabel(xlabel)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{Path(res['ckpt']).name}, {res['dtype']} on {res['device']}, "
                 f"{res['new_tokens']} new tokens, FastGen {mode(res)}; "
                 "dashed: decode step compiled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m studies.scaling",
        description="Decode and prefill speed, KV bytes and peak memory of FastGen, our full "
                    "cache (eager and compiled) and HF transformers as the prompt and the batch "
                    "grow, and FastGen's profiling share. Writes a markdown table, JSON and a PNG.")
    p.add_argument("--ckpt", help="HF-format checkpoint folder or Llama GGUF file "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192],
                   help="prompt lengths of the first sweep, batch 1; one longer than the "
                        "model's context less the new tokens is cut to that (default 512 2048 "
                        "4096 8192)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="batch sizes of the second sweep (default 1 4 8 16)")
    p.add_argument("--batch-len", type=int, default=2048,
                   help="prompt length of the batch sweep and the profiling share (default 2048)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated (default 128)")
    p.add_argument("--profile-tokens", type=int, nargs="+", default=[128, 512],
                   help="new-token counts of the profiling share (default 128 512)")
    p.add_argument("--recovery", type=float, help="the paper's threshold T (default 0.95)")
    p.add_argument("--no-paper", dest="paper", action="store_false",
                   help="leave out FastGen as the paper states it (its every-row profiling and "
                        "per-token eviction take most of the sweep's time at 8k and batch 16)")
    p.add_argument("--runs", type=int, default=3, help="runs per cell (default 3)")
    add_device_args(p)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"torch threads (default {torch.get_num_threads()}, all cores)")
    p.add_argument("--seed", type=int, default=0, help="text seed (default 0)")
    p.add_argument("--bw-gib", type=float, default=1.0,
                   help="GiB copied to measure the bandwidth of the roofline (default 1)")
    p.add_argument("--idle-wait", type=float, default=300, help="before each run, wait up to "
                   "this many seconds for other processes to leave the CPUs (default 300)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: prompts 16 and 32, batch 1 and 2, 4 new tokens, one run, "
                        "no compiled rows unless --compile says")
    p.add_argument("--out", default="results/scaling/scaling",
                   help="output path without suffix (default results/scaling/scaling)")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.quick:
        args.lengths, args.batches, args.batch_len = [16, 32], [1, 2], 32
        args.new_tokens, args.profile_tokens, args.runs, args.idle_wait = 4, [4, 8], 1, 0
        args.bw_gib = 1 / 16
    if (args.new_tokens < 2 or min(args.profile_tokens) < 2 or args.runs < 1
            or min(args.lengths + args.batches + [args.batch_len, args.threads]) < 1):
        p.error("need --new-tokens and --profile-tokens >= 2, --runs >= 1, positive sizes "
                "and threads")
    check_device_args(args)
    from convert_gguf import checkpoint_folder
    args.ckpt = checkpoint_folder(args.ckpt)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # before the hours of measuring, not after
    t0 = time.perf_counter()
    res = measure(args)
    res["runtime_s"], res["png"] = time.perf_counter() - t0, str(output(out, ".png"))
    plot(res, output(out, ".png"))
    output(out, ".json").write_text(json.dumps(res, indent=1))
    text = report(res)
    output(out, ".md").write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    from generate import exit_on_user_error
    with exit_on_user_error():
        main()
