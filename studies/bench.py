"""Decode and prefill speed of our Llama against HF transformers, and the roofline.

    python -m studies.bench                        # SmolLM2-135M, batch 1 and 8, ~40 min on 2 cores
    python -m studies.bench --compile none --runs 5 --out results/bench/bench.md
    python -m studies.bench --device cuda --dtype bfloat16 --compile-mode reduce-overhead
    python -m studies.bench --quick --ckpt TINY_CHECKPOINT # a smoke test, seconds
    python -m studies.bench --kv full@16 fastgen@16/8/4:0.25   # keys and values in fewer bits

On the same checkpoint, in one process, with the same torch threads, it times
HF `generate` (greedy, never stopping early, its DynamicCache) and our
`generate` with the full (dense) cache and with the FastGen cache, eager and
compiled. The prompts are random token ids from a fixed seed (or slices of
`--prompt-file`), all the same length, so there is no padding. Runs go
round-robin over the implementations, each after waiting (`--idle-wait`) for
other processes to leave the cores; the CPU share column says how much of
the cores each row really got.

  prefill tok/s  prompt tokens / time to the first new token
  decode tok/s   tokens after the first / their time. HF: generate(N tokens)
                 - generate(1 token); ours: `Generation.decode_s`, which leaves
                 out the first compiled step
  compile s      the first step of an untimed compiled run made before the
                 timed ones (compiling the decode step)
  roofline       a decode step must read every weight once (a tied embedding
                 once: the output projection reads it whole) and the KV of the
                 tokens seen; tok/s = batch x bandwidth / bytes per step
  KV MiB         what the cache holds at the end (FastGen: % of the full cache)
  peak MiB       the most memory the run held: on CPU the process's resident set
                 (the kernel's high-water mark VmHWM, reset before each run, so one
                 long-lived process still measures each run alone; it includes both
                 models' weights), on CUDA torch's peak allocation on the GPU

On CUDA (`--device cuda`, best with `--dtype bfloat16`) every timing waits for
the GPU (`torch.cuda.synchronize`), and `--compile-mode reduce-overhead` replays
the compiled decode step as a CUDA graph. A prompt plus its new tokens longer
than the model's context is an error.

Each number is the median (or with `--stat best` the fastest) of `--runs`
runs, after a short warm-up; every run is also logged on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import generate as gen
from generation import DTYPES, CacheOptions, dense_kv_bytes, generate


def machine_info(threads: int, device: str = "cpu") -> str:
    cpu = "unknown CPU"
    if Path("/proc/cpuinfo").is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), cpu)
    gpu = f"{torch.cuda.get_device_name(device)}, " if device.startswith("cuda") else ""
    return (f"{gpu}{cpu}, {os.cpu_count()} cores, {threads} threads, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}")


def synchronize(device) -> None:
    """Wait for the device: CUDA runs ahead of Python, so a timing must wait for it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_gbs(gib: float, reps: int = 5, device="cpu") -> float:
    """Copy bandwidth in GB/s (1e9 bytes), counting read + write: 2 x size per copy."""
    src = torch.ones(int(gib * 2**30) // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):  # the first copy also faults the pages in
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / statistics.median(times[1:]) / 1e9


def matmul_floor(model, reps: int = 5) -> float:
    """Decode steps/s at batch 1 if a step did nothing but the model's weight matmuls
    (one token through every linear layer, each weight read once, no attention): what
    torch's own kernels reach on these weights here, a practical ceiling."""
    weights = list({p.data_ptr(): p for n, p in model.named_parameters()
                    if p.dim() == 2 and not n.startswith("tok_embeddings")}.values())
    if model.output.weight.data_ptr() not in {w.data_ptr() for w in weights}:
        weights.append(model.output.weight)
    w0 = weights[0]
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w0.dtype, device=w0.device) for w in weights}
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            synchronize(w0.device)
            t0 = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            synchronize(w0.device)
            times.append(time.perf_counter() - t0)
    return 1 / statistics.median(times[1:])


def weight_bytes(model) -> int:
    """Weight bytes a decode step reads: each distinct tensor once, but of an untied
    input embedding only the row of the token."""
    total = sum(p.nbytes for p in {p.data_ptr(): p for p in model.parameters()}.values())
    emb = model.tok_embeddings.weight
    if emb.data_ptr() != model.output.weight.data_ptr():
        total -= emb.nbytes - emb[0].nbytes
    return total


def make_prompts(args, vocab_size: int, tok) -> list[list[int]]:
    """Prompts for the largest batch; smaller batches take the first ones."""
    g = torch.Generator().manual_seed(args.seed)
    B, T = max(args.batch), args.prompt_len
    if args.prompt_file:
        if tok is None:
            raise SystemExit(f"--prompt-file needs a tokenizer in {args.ckpt}")
        text = tok.encode(gen.read_prompts(None, args.prompt_file)[0])
        ids = text * (2 * T // len(text) + 1)  # at least 2T tokens: repeated if short
        return [ids[s:s + T] for s in torch.randint(0, len(ids) - T, (B,), generator=g).tolist()]
    # Ids from 100 up: the first ones are control tokens in most vocabularies.
    return torch.randint(min(100, vocab_size // 2), vocab_size, (B, T), generator=g).tolist()


def others_busy(seconds: float = 1.0) -> float:
    """Share of all cores busy over `seconds` while this process idles (Linux; else 0)."""
    def sample():
        with open("/proc/stat") as f:
            t = [int(x) for x in f.readline().split()[1:]]
        return sum(t), t[3] + t[4]  # total, idle + iowait
    if not Path("/proc/stat").is_file():
        return 0.0
    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def wait_until_idle(max_wait: float, busy: float = 0.25) -> None:
    """Other processes on the cores make multithreaded runs crawl (every parallel op
    waits for a descheduled thread), so wait until they leave the cores, or give up."""
    end = time.monotonic() + max_wait
    while time.monotonic() < end and others_busy() > busy:
        time.sleep(4)


def with_cpu_share(fn):
    """fn() and the share of (wall time x threads) this process spent on a CPU."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return out, cpu / (wall * min(torch.get_num_threads(), os.cpu_count()))


def process_memory(field: str) -> int | None:
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process in bytes; None
    off Linux."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024  # kB


@contextlib.contextmanager
def peak_memory(device):
    """Yield a dict that holds, after the block, the memory in use at its start and the
    most it reached: `rss_start`, `rss_peak` (bytes; None where Linux's /proc is not
    there) and on CUDA `gpu_start`, `gpu_peak` (torch's allocations on the GPU).

    The high-water mark of the resident set only ever grows, so a long-lived process
    reads each run's peak by resetting it first: writing 5 to /proc/self/clear_refs
    sets VmHWM to the current VmRSS (Linux 4.0+). The kernel raises the mark when memory
    is unmapped, which is how torch's large CPU tensors are freed, and when it is read,
    so a tensor freed within the run still counts. Memory freed by the earlier runs is
    handed back to the system first (gc, then glibc's malloc_trim), so that it is not
    counted in this run's start."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    mem = dict(rss_start=process_memory("VmRSS"), rss_peak=None, gpu_start=None, gpu_peak=None)
    if cuda:
        mem["gpu_start"] = torch.cuda.memory_allocated(device)
    yield mem
    if reset:
        mem["rss_peak"] = process_memory("VmHWM")
    if cuda:
        mem["gpu_peak"] = torch.cuda.max_memory_allocated(device)


def cache_options(spec: str) -> CacheOptions:
    """--kv's KIND[@B[/B...]][:BUDGET][+ask], e.g. full@16, fastgen@16/8/4:0.25 or
    fastgen:0.25+ask (with --ask-after)."""
    spec, ask, _ = spec.partition("+ask")
    spec, _, budget = spec.partition(":")
    kind, _, bits = spec.partition("@")
    return CacheOptions(kind, kv_budget=float(budget) if budget else None,
                        kv_bits=tuple(int(b) for b in bits.split("/")) if bits else None,
                        ask_after=True if ask else None)


def time_ours(model, prompts, new_tokens, cache: CacheOptions, compile, flags,
              compile_options=None) -> dict:
    with peak_memory(model.tok_embeddings.weight.device) as mem:
        g, share = with_cpu_share(lambda: generate(
            model, prompts, new_tokens, cache=cache, compile=compile,
            compile_options=compile_options, token_flags=flags))
    B = len(prompts)
    return dict(prefill=B * len(prompts[0]) / g.prefill_s, decode=B * g.decode_steps / g.decode_s,
                cpu=share, compile_s=g.compile_s, kv=g.kv_bytes, full_kv=g.full_kv_bytes,
                profile_share=g.profile_s / (g.prefill_s + g.decode_s),
                profile_prefill=g.profile_s / g.prefill_s, **mem)


def time_hf(hf, prompts, new_tokens) -> dict:
    ids = torch.tensor(prompts, device=hf.device)
    B, T = ids.shape

    class Arrivals:  # a streamer that notes when the prompt and each new token come out
        def __init__(self):
            self.times = []

        def put(self, value):
            synchronize(hf.device)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run(n):
        synchronize(hf.device)
        t0, seen = time.perf_counter(), Arrivals()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, use_cache=True,
                          return_dict_in_generate=True, pad_token_id=0, streamer=seen)
        synchronize(hf.device)
        return time.perf_counter() - t0, seen.times, out

    run(1)  # the first call warms up
    t1 = min(run(1)[0] for _ in range(2))  # the prefill and first token
    with peak_memory(hf.device) as mem:
        (_, times, out), share = with_cpu_share(lambda: run(new_tokens))
    # The decode steps timed by themselves, from the first new token to the last: a
    # difference of two runs' times went negative on a busy machine.
    decode_s = times[-1] - times[1]
    kv = sum(t.nbytes for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    return dict(prefill=B * T / t1, decode=B * (new_tokens - 1) / decode_s, cpu=share,
                compile_s=0.0, kv=kv, full_kv=kv, profile_share=0.0, profile_prefill=0.0, **mem)


def peak_mib(t: dict) -> str:
    """The peak memory column: the GPU's on CUDA, else the resident set's ("n/a" off Linux)."""
    peak = t["gpu_peak"] if t["gpu_peak"] is not None else t["rss_peak"]
    return "n/a" if peak is None else f"{peak / 2**20:.0f}"


def load_pair(ckpt, dtype: str, device: str, hf: bool = True):
    """Our model and HF transformers' of the same checkpoint (None if not `hf`), in `dtype` on
    `device`."""
    from model import load_model
    model = load_model(ckpt, DTYPES[dtype], device)
    if not hf:
        return model, None
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return model, LlamaForCausalLM.from_pretrained(ckpt, dtype=DTYPES[dtype]).to(device).eval()


MEMORY_NOTE = {
    False: "Peak RSS: the high-water mark of this process's resident memory (VmHWM) in a "
           "run, reset before each run (5 to /proc/self/clear_refs); it includes both "
           "models' weights and everything loaded, not the compiler's worker processes.",
    True: "Peak GPU: the most memory torch had allocated on the GPU in a run "
          "(torch.cuda.max_memory_allocated, reset before each run); it includes both "
          "models' weights.",
}


def add_device_args(p) -> None:
    """--device, --dtype and the compile flags, the same in bench.py and scaling.py."""
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, for both "
                   "implementations; on CUDA every timing waits for the GPU and the peak "
                   "memory is the GPU's (default cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights and KV cache of both implementations (default float32)")
    p.add_argument("--compile", choices=["both", "only", "none"], help="our rows eager and "
                   "compiled (both), compiled only, or eager only; transformers is always "
                   "eager (default both; none with --quick)")
    p.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile mode of our decode step: reduce-overhead replays it as "
                        "a CUDA graph (CUDA only), max-autotune also tunes the kernels and "
                        "compiles for longer (default default)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager"],
                   help="torch.compile backend: inductor generates fused kernels; aot_eager "
                        "only traces, compiles in seconds and runs at eager speed, for tests "
                        "(default inductor)")


def check_device_args(args) -> None:
    """Settle the flags of `add_device_args`; UsageError (one line) for what cannot run here."""
    gen.check_device(args.device, args.dtype)
    if args.compile_mode != "default" and args.compile_backend != "inductor":
        raise gen.UsageError(f"--compile-mode {args.compile_mode} needs --compile-backend inductor")
    if args.compile_mode == "reduce-overhead" and not args.device.startswith("cuda"):
        raise gen.UsageError("--compile-mode reduce-overhead makes CUDA graphs; it needs "
                             "--device cuda")
    args.compile = args.compile or ("none" if args.quick else "both")
    args.compiled = {"both": [False, True], "only": [True], "none": [False]}[args.compile]
    args.compile_options = dict(mode=None if args.compile_mode == "default" else args.compile_mode,
                                backend=args.compile_backend)


def kv_error(specs) -> str | None:
    """What is wrong with the first --kv entry that names no cache, in one line."""
    for spec in specs:
        try:
            cache_options(spec).check()
        except ValueError as e:
            return (f"--kv {spec}: {e}; write KIND[@B[/B...]][:BUDGET], e.g. "
                    "fastgen@16/8/4:0.25")
    return None


def bench(args) -> str:
    """Run every measurement; return the markdown report."""
    from policies import token_flags
    from tokenizer import Tokenizer, TokenizerError

    torch.set_num_threads(args.threads)
    model, hf = load_pair(args.ckpt, args.dtype, args.device, args.hf)
    if args.prompt_len + args.new_tokens > model.args.max_seq_len:
        raise gen.UsageError(
            f"--prompt-len {args.prompt_len} plus --new-tokens {args.new_tokens} exceeds the "
            f"model's context of {model.args.max_seq_len} tokens; lower one of them")
    V = model.args.vocab_size
    try:
        tok = Tokenizer(args.ckpt)
        flags = token_flags(V, [i for i in tok.special_ids if i < V],
                            [i for i in tok.punctuation_ids() if i < V])
    except TokenizerError:  # a test checkpoint without a tokenizer: no special tokens
        tok, flags = None, token_flags(V, [], [])
    all_prompts = make_prompts(args, V, tok)

    wait_until_idle(args.idle_wait)
    bw = bandwidth_gbs(args.bw_gib, device=args.device)
    floor = matmul_floor(model)
    w_bytes = weight_bytes(model)
    kv_token = dense_kv_bytes(model, 1, 1)
    context = args.prompt_len + args.new_tokens / 2  # tokens attended, mean over the steps
    roofline = lambda B: B * bw * 1e9 / (w_bytes + B * kv_token * context)

    configs = [("transformers", "", False)] * args.hf + [
        ("ours", kv, comp) for comp in args.compiled for kv in args.kv]

    def run(impl, kv, comp, prompts, new_tokens):
        if impl == "transformers":
            return time_hf(hf, prompts, new_tokens)
        return time_ours(model, prompts, new_tokens, cache_options(kv), comp, flags,
                         args.compile_options)

    rows, hf_speed = [], None
    bar = tqdm(total=len(args.batch) * len(configs) * args.runs, desc="bench", unit="run")
    for B in args.batch:
        prompts = all_prompts[:B]
        for impl, kv, _ in configs:
            run(impl, kv, False, [p[:8] for p in prompts], 2)  # warm-up
        compile_s = {}
        if any(comp for *_, comp in configs):
            # Each batch size gets graphs of its own, compiled here, in an untimed run
            # (FastGen's pool size is dynamic in its graph, so growing compiles nothing).
            torch._dynamo.reset()
            for c in configs:
                if c[2]:
                    compile_s[c] = run(*c, prompts, args.new_tokens)["compile_s"]
        timings = {c: [] for c in configs}
        for _ in range(args.runs):
            for c in configs:
                bar.set_postfix_str(f"batch {B}: {c[0]} {c[1]}" + (" compiled" if c[2] else ""))
                wait_until_idle(args.idle_wait)
                t = run(*c, prompts, args.new_tokens)
                timings[c].append(t)
                bar.write(f"batch {B}, {c[0]} {c[1]}{' compiled' if c[2] else ''}: prefill "
                          f"{t['prefill']:.1f} tok/s, decode {t['decode']:.2f} tok/s, "
                          f"CPU share {t['cpu']:.0%}")
                bar.update()
        for (impl, kv, comp), ts in timings.items():
            m = {k: statistics.median(t[k] for t in ts) for k in ("prefill", "decode", "cpu")}
            if args.stat == "best":
                m |= {k: max(t[k] for t in ts) for k in ("prefill", "decode")}
            if impl == "transformers":  # the first config
                hf_speed = m
            kv_mib = f"{ts[-1]['kv'] / 2**20:.3g}"
            if ts[-1]["kv"] != ts[-1]["full_kv"]:
                kv_mib += f" ({ts[-1]['kv'] / ts[-1]['full_kv']:.0%})"
            rows.append([f"{impl} {kv}".strip(), B, "yes" if comp else "no",
                         f"{m['prefill']:.1f}", f"{m['decode']:.2f}",
                         *(f"{m[k] / hf_speed[k]:.2f}x" if hf_speed else "—"
                           for k in ("prefill", "decode")),
                         f"{m['decode'] / roofline(B):.1%}", kv_mib,
                         f"{compile_s[impl, kv, comp]:.1f}" if comp else "",
                         peak_mib(ts[-1]), f"{m['cpu']:.0%}"])
    bar.close()

    header = ["impl", "batch", "compile", "prefill tok/s", "decode tok/s", "prefill vs HF",
              "decode vs HF", "% of roofline", "KV MiB", "compile s",
              "peak GPU MiB" if args.device.startswith("cuda") else "peak RSS MiB", "CPU share"]
    prompt = f"slices of {args.prompt_file}" if args.prompt_file else f"random ids, seed {args.seed}"
    lines = [
        f"Machine: {machine_info(args.threads, args.device)}",
        f"Checkpoint: `{args.ckpt}`, {args.dtype} on {args.device}; prompt {args.prompt_len} "
        f"tokens ({prompt}), {args.new_tokens} new tokens, greedy; {args.stat} of {args.runs} "
        f"run(s); compiled rows: torch.compile backend {args.compile_backend}, mode "
        f"{args.compile_mode}",
        f"Command: `python -m studies.bench {' '.join(args.argv)}`",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
        *("| " + " | ".join(map(str, r)) + " |" for r in rows),
        "",
        f"Memory bandwidth: {bw:.1f} GB/s (copy of a {args.bw_gib:g} GiB tensor, median of 5, "
        "read + write counted: 2 x size per copy).",
        f"Bytes per decode step and sequence: weights {w_bytes / 1e6:.1f} MB (shared by the "
        f"batch) + KV {kv_token / 1e3:.1f} kB/token x {context:.0f} tokens (mean context) "
        f"= {kv_token * context / 1e6:.3g} MB.",
        "Roofline decode tok/s: " + ", ".join(f"batch {B}: {roofline(B):.1f}" for B in args.batch)
        + " (FastGen rows are compared with the full cache's roofline).",
        f"Weight matmuls alone (batch 1, every linear layer once, no attention, median of 5): "
        f"{floor:.1f} steps/s, {w_bytes * floor / 1e9:.1f} GB/s of weights: the ceiling "
        f"torch's kernels set for a batch-1 decode step here "
        f"({floor / roofline(1):.0%} of the roofline).",
        "CPU share: CPU time of this process / (wall time x threads), median of the runs; "
        "well under 100% means other processes took the cores (compiled rows include "
        "compiling, partly in worker processes).",
        MEMORY_NOTE[args.device.startswith("cuda")] + " Of the last run.",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m studies.bench",
        description="Prefill and decode tokens/s of our Llama (full and FastGen cache, eager "
                    "and compiled) against HF transformers generate, with the memory-bandwidth "
                    "roofline of decoding. Prints a markdown table.")
    p.add_argument("--ckpt", help="HF-format checkpoint folder or Llama GGUF file "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--prompt-file", help="prompts are slices of this text (repeated if short) "
                   "instead of random token ids")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated (default 128)")
    p.add_argument("--batch", type=int, nargs="+", action="extend",
                   help="batch sizes; list or repeat them (default 1 8)")
    p.add_argument("--runs", type=int, default=3, help="runs per row (default 3)")
    p.add_argument("--kv", nargs="+", default=["full", "fastgen"],
                   metavar="KIND[@B][:BUDGET][+ask]",
                   help="our caches to time: a --kv kind, with its --kv-bits after @ (slashes "
                   "between several), its --kv-budget after a colon and +ask for --ask-after, "
                   "e.g. full@16 fastgen@16/8/4:0.25 fastgen:0.25+ask (default: full fastgen)")
    p.add_argument("--stat", choices=["median", "best"], default="median",
                   help="report the median or the fastest of the runs; best suits a machine "
                        "that other processes share (default median)")
    add_device_args(p)
    p.add_argument("--no-compile", dest="compile", action="store_const", const="none",
                   help="same as --compile none")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"torch threads for both implementations (default {torch.get_num_threads()}, "
                        "all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--bw-gib", type=float, default=1.0,
                   help="GiB copied to measure the bandwidth (default 1)")
    p.add_argument("--idle-wait", type=float, default=300, help="before each run, wait up "
                   "to this many seconds for other processes to leave the CPUs (default 300)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF transformers "
                   "(its columns read —): at 2k x 8 its eager run takes most of a bench")
    p.add_argument("--quick", action="store_true", help="smoke test: prompt 32, 8 new tokens, "
                   "batch 1, 1 run, no compiled rows unless --compile says, 64 MiB bandwidth copy")
    p.add_argument("--out", help="also write the markdown report to this file")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.quick:
        args.prompt_len, args.new_tokens, args.batch, args.runs = 32, 8, [1], 1
        args.bw_gib, args.idle_wait = 1 / 16, 0
    args.batch = sorted(set(args.batch or [1, 8]))
    if (args.new_tokens < 2 or args.prompt_len < 8 or args.runs < 1 or min(args.batch) < 1
            or args.threads < 1):
        p.error("need --new-tokens >= 2, --prompt-len >= 8, --runs >= 1, --batch >= 1 "
                "and --threads >= 1")
    if args.out and not (Path(args.out).parent.is_dir() and not Path(args.out).is_dir()):
        p.error(f"--out {args.out}: give a file in an existing folder")
    if kv_error(args.kv):
        p.error(kv_error(args.kv))
    check_device_args(args)
    from convert_gguf import checkpoint_folder
    args.ckpt = checkpoint_folder(args.ckpt)
    return args


if __name__ == "__main__":
    with gen.exit_on_user_error():
        args = parse_args()
        report = bench(args)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
