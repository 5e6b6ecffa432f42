"""Tensor parallel against one process: speed, and memory per rank.

    python -m studies.tp_bench --max-new-tokens 64
    torchrun --nproc-per-node 3 -m studies.tp_bench --max-new-tokens 64

Generates (greedy, default model unless --ckpt) after a prompt of real text
(`textdata.py`) and prints one row per rank: decode and prefill tok/s, the bytes of weights
the rank holds, its KV cache bytes, its peak resident memory (getrusage) and
what is resident at the end, its own and mapped from files; and under torchrun
the median time of the collectives a decode step makes, and of the output
head's matmul over the whole vocabulary and over the rank's part of it (what
sharding the vocabulary costs and saves).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

import tp
from generate import exit_on_user_error
from generation import CacheOptions, generate


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def resident_mib(kind: str) -> float:
    """Resident memory now, by kind: "Anon" (the process's own) or "File" (pages of
    mapped files: torch's libraries, which the ranks share, and a single
    process's weights, which safetensors maps from the checkpoint)."""
    for line in open("/proc/self/status"):
        if line.startswith(f"Rss{kind}:"):
            return int(line.split()[1]) / 1024


def collective_ms(fn, runs: int = 200) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench(ckpt, prompt_len: int, max_new_tokens: int, kv: str):
    from studies.textdata import documents
    from tokenizer import Tokenizer
    tp.init("cpu")
    if ckpt is None:
        from convert_gguf import default_checkpoint
        ckpt = default_checkpoint()  # run it once alone first: the ranks would all convert
    model = tp.load_model(ckpt)  # this rank's share
    tok = Tokenizer(ckpt)
    prompt = tok.encode(documents()[0][1])[:prompt_len]
    gen = generate(model, [prompt], max_new_tokens, cache=CacheOptions(kv))
    row = dict(rank=tp.rank(), decode=gen.decode_steps / gen.decode_s,
               prefill=len(prompt) / gen.prefill_s,
               weights=sum(p.nbytes for p in model.parameters()) / 2**20,  # tied: counted once
               peak=peak_rss_mib(), anon=resident_mib("Anon"), file=resident_mib("File"),
               kv=(gen.kv_bytes_per_rank or [gen.kv_bytes])[tp.rank()] / 2**20,
               prompt=len(prompt), steps=gen.decode_steps)
    if tp.world() > 1:
        C, V = model.args.dim, model.output.weight.shape[0]
        x, piece, parts = torch.zeros(1, 1, C), torch.zeros(1, 1, V), torch.zeros(tp.world(), 1, V)
        row["all_reduce"] = collective_ms(lambda: dist.all_reduce(x))
        row["all_gather"] = collective_ms(lambda: dist.all_gather_single(parts, piece))
        # What sharding the vocabulary saves: the output head's matmul, whole or one part.
        x, whole = torch.randn(1, C), torch.randn(model.args.vocab_size, C)
        row["head"] = collective_ms(lambda: x @ whole.T, runs=50)
        row["head_part"] = collective_ms(lambda: x @ model.output.weight.T, runs=50)
        rows = [None] * tp.world()
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if tp.rank() == 0:
        print(f"prompt {row['prompt']} tokens, {row['steps']} decode steps, kv {kv}, "
              f"{tp.world()} process(es), torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s) each")
        print("| rank | decode tok/s | prefill tok/s | weights MiB | KV MiB | peak RSS MiB | "
              "resident at the end: own / mapped files MiB | all-reduce (1, 1, C) ms | "
              "all-gather of logits ms | head matmul: all / own vocabulary ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['rank']} | {r['decode']:.1f} | {r['prefill']:.1f} | {r['weights']:.1f} | "
                  f"{r['kv']:.2f} | {r['peak']:.0f} | {r['anon']:.0f} / {r['file']:.0f} | "
                  + (f"{r['all_reduce']:.2f} | {r['all_gather']:.2f} | "
                     f"{r['head']:.2f} / {r['head_part']:.2f} |" if "head" in r else "| | |"))
    tp.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m studies.tp_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="checkpoint folder (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--kv", default="full", help="cache kind (default full)")
    a = p.parse_args()
    with exit_on_user_error():
        bench(a.ckpt, a.prompt_len, a.max_new_tokens, a.kv)
