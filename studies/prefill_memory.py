"""Peak memory of prefill: one-shot against chunked (`--prefill-chunk`), and the
longest prompt that fits under a memory limit.

    python -m studies.prefill_memory                      # 2k, 4k, 8k tokens: minutes on 2 cores
    python -m studies.prefill_memory --cap-mib 1400       # and the longest prompt under that limit
    python -m studies.prefill_memory --quick --ckpt TINY  # a smoke test, seconds

Every run is a fresh process (`--child`), so that its resident high-water mark
is its own: it loads the model, reads one prompt of real text (`textdata`)
and generates 4 tokens, for each cache (the full cache, FastGen's budget mode
at `--budgets`) read in one call and in chunks of `--chunk` tokens. Per run:

- `peak_rss`: the process's resident high-water mark (VmHWM), and above what it
  held once the model was loaded and had run once (`own`; the weights are
  mapped from disk and read in by the first call);
- `cache_peak`: the most that the caches held at once during the run, sampled
  after every layer's call: every layer's cache (its pools, or the dense
  buffers), the prompt keys, values and queries waiting to be profiled, and
  the keys and values of the call itself;
- `kv_end`: what the caches hold at the end, against the full cache's bytes.

With `--cap-mib`, each cache and prefill is run again under a data-segment
limit of that many MiB (RLIMIT_DATA: what the kernel lets the process map for
its heap; a run past it fails to allocate), at `--cap-lengths` from the
shortest up, and the longest that completes is reported.

Writes `--out`.md, .json and .png (default results/prefill_memory/prefill_memory).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from studies import output

NEW_TOKENS = 4


def status() -> dict:
    """VmHWM, VmRSS and VmData of this process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                  if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS", "VmData")}


def child(job: dict) -> dict:
    """One run, in this process: see the module's docstring."""
    import torch

    from cache import FastGenCache
    from generation import CacheOptions, dense_kv_bytes, flags_of, generate, load
    from studies.textdata import prompts

    torch.set_num_threads(job["threads"])
    model, tok = load(job["ckpt"])
    length = min(job["length"], model.args.max_seq_len - NEW_TOKENS)
    ids = prompts(tok, 1, length, length, source="pydoc")[0]
    with torch.no_grad():  # the weights are mapped from disk: a first call reads them in
        model(torch.tensor([ids[:4]]), torch.arange(4)[None])
    loaded = status()
    peak = {"cache": 0, "data": loaded["VmData"]}

    def held(c) -> int:
        if isinstance(c, FastGenCache) and c.held is not None:
            return sum(t.nbytes for t in c.held[:3])
        return 0

    def measure(module, args, output):
        caches = model.caches()
        if module in caches:
            k, v = args[1], args[2]
            now = sum(c.nbytes() + held(c) for c in caches) + k.nbytes + v.nbytes
            peak["cache"] = max(peak["cache"], now)
            peak["data"] = max(peak["data"], status()["VmData"])

    hook = torch.nn.modules.module.register_module_forward_hook(measure)
    options = CacheOptions(job["kv"], kv_budget=job["budget"], prefill_chunk=job["chunk"],
                           ask_after=job.get("ask", False) and job["kv"] != "full")
    t0 = time.perf_counter()
    gen = generate(model, [ids], NEW_TOKENS, cache=options, token_flags=flags_of(model, tok))
    hook.remove()
    end = status()
    return dict(job, length=length, fits=True, seconds=time.perf_counter() - t0,
                prefill_s=gen.prefill_s, rss_loaded=loaded["VmRSS"], peak_rss=end["VmHWM"],
                data_loaded=loaded["VmData"], peak_data=peak["data"], cache_peak=peak["cache"],
                kv_end=gen.kv_bytes, full_kv=dense_kv_bytes(model, 1, length + NEW_TOKENS),
                kept=gen.kept_tokens / gen.seen_tokens if gen.seen_tokens else 1.0)


def run(job: dict, cap_mib: int | None = None) -> dict:
    """`child(job)` in a fresh process, under a data limit of cap_mib MiB if given."""
    def limit():
        if cap_mib:
            resource.setrlimit(resource.RLIMIT_DATA, (cap_mib << 20, cap_mib << 20))
    proc = subprocess.run([sys.executable, "-m", "studies.prefill_memory", "--child",
                           json.dumps(job)], capture_output=True, text=True, preexec_fn=limit,
                          env=dict(os.environ, OMP_NUM_THREADS=str(job["threads"])))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    if cap_mib:  # out of memory, however it showed
        return dict(job, fits=False, error=(proc.stderr.strip().splitlines() or ["killed"])[-1])
    raise RuntimeError(f"run {job} failed:\n{proc.stderr[-2000:]}")


def longest(job: dict, cap_mib: int, lengths: list[int]) -> dict:
    """The longest of `lengths` (tried shortest first, until one fails) that `job`
    reads under a data limit of cap_mib MiB, and the first that failed."""
    fit = failed = None
    for n in sorted(lengths):
        r = run(dict(job, length=n), cap_mib)
        if not r["fits"]:
            failed = f"{n:,} ({r['error'][:60]})"
            break
        fit = r["length"]
    return dict(job, longest=fit, failed=failed)


def kind(row: dict) -> str:
    scope = f", scope {row['scope']}" if row.get("scope") else ""
    ask = " --ask-after" if row.get("ask") else ""
    return "full" if row["kv"] == "full" else f"fastgen {row['budget']:g}{scope}{ask}"


def name(row: dict) -> str:
    return f"{kind(row)}, " + (f"chunks of {row['chunk']}" if row["chunk"] else "one call")


def report(res: dict) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    lines = ["# Peak memory of prefill, one call against chunks\n",
             f"{res['date']}, {res['machine']}, {res['threads']} torch thread(s); "
             f"{res['runtime_s'] / 60:.1f} min. Command: `{res['command']}`\n",
             "Each row is a fresh process reading one prompt of real text and generating "
             f"{NEW_TOKENS} tokens. MiB. *peak RSS*: the process's resident high-water mark; "
             "*own*: above what it held once the model was loaded and had run once; "
             "*cache peak*: the most the "
             "caches held at once (pools or dense buffers, the prompt keys, values and queries "
             "waiting to be profiled, and the keys and values of the call), sampled after every "
             "layer's call; *KV at end*: what they hold after the last token, against the full "
             "cache's.\n",
             "| prompt | cache | prefill | peak RSS | own | cache peak | KV at end | full KV | "
             "kept | prefill s |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['length']:,} | {kind(r)} | {r['chunk'] or 'one call'} | {mib(r['peak_rss'])} | "
            f"{mib(r['peak_rss'] - r['rss_loaded'])} | {mib(r['cache_peak'])} | "
            f"{mib(r['kv_end'])} | {mib(r['full_kv'])} | {r['kept']:.2f} | {r['prefill_s']:.1f} |")
    if res.get("cap"):
        cap = res["cap"]
        lines += ["", f"## The longest prompt under a data limit of {cap['mib']:,} MiB\n",
                  "RLIMIT_DATA, set in the child before it starts; lengths tried from the shortest "
                  f"up: {', '.join(f'{n:,}' for n in cap['lengths'])}. *none*: not even the "
                  "shortest.\n", "| cache | prefill | longest that fits | first that did not |",
                  "|---|---|---:|---|"]
        for r in cap["rows"]:
            lines.append(f"| {kind(r)}"
                         f" | {r['chunk'] or 'one call'} | {r['longest'] or 'none'} | "
                         f"{r['failed'] or '-'} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for r in res["rows"]:
        series.setdefault(name(r), []).append(r)
    for label, rows in series.items():
        rows.sort(key=lambda r: r["length"])
        style = "--" if rows[0]["chunk"] else "-"
        x = [r["length"] for r in rows]
        axes[0].plot(x, [(r["peak_rss"] - r["rss_loaded"]) / 2**20 for r in rows], style,
                     marker="o", label=label)
        axes[1].plot(x, [r["cache_peak"] / 2**20 for r in rows], style, marker="o", label=label)
    axes[0].set_title("process peak above the loaded model (MiB)")
    axes[1].set_title("the caches' peak during the run (MiB)")
    for ax in axes:
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Prefill memory, one call (solid) against chunks (dashed); {res['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    from tqdm import tqdm

    from studies.evaluate import machine
    t0 = time.time()
    kinds = [("full", None)] + [("fastgen", b) for b in a.budgets]
    chunks = (None, a.chunk) if a.chunk else (None,)
    jobs = [dict(ckpt=a.ckpt, kv=kv, budget=b, chunk=chunk, length=n, threads=a.threads,
                 ask=a.ask_after)
            for n in a.lengths for kv, b in kinds for chunk in chunks]
    rows = [run(job) for job in tqdm(jobs, desc="runs")]
    env = "".join(f"{k}={v} " for k, v in os.environ.items() if k.startswith("MALLOC_"))
    res = dict(date=time.strftime("%Y-%m-%d"), machine=machine(), threads=a.threads,
               command=env + "python -m studies.prefill_memory " + " ".join(argv or sys.argv[1:]),
               rows=rows)
    if a.cap_mib:
        cap_rows = [longest(dict(ckpt=a.ckpt, kv=kv, budget=b, chunk=chunk, threads=a.threads),
                            a.cap_mib, a.cap_lengths)
                    for kv, b in tqdm(kinds, desc="under the cap") for chunk in chunks]
        res["cap"] = dict(mib=a.cap_mib, lengths=sorted(a.cap_lengths), rows=cap_rows)
    res["runtime_s"] = time.time() - t0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    output(out, ".json").write_text(json.dumps(res, indent=1))
    output(out, ".md").write_text(report(res))
    plot(res, output(out, ".png"))
    print(report(res))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--ckpt", help="checkpoint folder or GGUF file (default: the default model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8188],
                   help="prompt lengths in tokens (default 2048 4096 8188: the default model's "
                   "context less the new tokens)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5],
                   help="FastGen budgets (default 0.25 0.5)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk (default 512; 0: "
                   "one call only)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--ask-after", action="store_true",
                   help="FastGen with --ask-after (the prompt read again)")
    p.add_argument("--cap-mib", type=int, help="also find the longest prompt that fits under "
                   "a data limit of this many MiB (RLIMIT_DATA)")
    p.add_argument("--cap-lengths", type=int, nargs="+",
                   default=[1024, 2048, 3072, 4096, 6144, 8188],
                   help="prompt lengths tried under the cap, shortest first")
    p.add_argument("--quick", action="store_true", help="one short prompt per cache: a smoke "
                   "test (with --ckpt of a tiny model, seconds)")
    p.add_argument("--out", default="results/prefill_memory/prefill_memory",
                   help="output path without suffix")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.chunk, a.cap_lengths = [96], 32, [64, 128]
    if min(a.lengths + a.cap_lengths) < 2 or a.chunk < 0 or a.threads < 1:
        p.error("--lengths and --cap-lengths need at least 2 tokens, --threads 1, and --chunk "
                "is 0 (none) or more")
    if any(not 0 < b <= 1 for b in a.budgets):
        p.error(f"--budgets must be in (0, 1] (got {a.budgets})")
    return a


if __name__ == "__main__":
    main()
