"""Decode speed under transformers: its DynamicCache (sdpa) against our caches in its model.

    python -m studies.hf_speed --prompt-len 2048 --batch 8 --new-tokens 32 --runs 3 \
        --out results/hf/speed_2kx8

Tokens/s of every sequence, from the first new token to the last, the median of `--runs`, each
row's runs in turn: transformers' `model.generate` timed by a stopping criterion that sees each
token come, ours by generation.generate's decode timer. Prompts: Python's pydoc topics.
"""
import argparse
import statistics
import sys
import time

import pydoc_data.topics
import torch
from transformers import StoppingCriteria

import hf
from convert_gguf import checkpoint_folder
from generation import CacheOptions, flags_of, generate, load
from studies.bench import machine_info


class Stamps(StoppingCriteria):
    """Stops nothing: notes when each new token came."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(time.perf_counter())
        return torch.zeros(len(input_ids), dtype=torch.bool)


def hf_decode(model, ids, new: int) -> float:
    clock = Stamps()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new + 1,
                   min_new_tokens=new + 1, do_sample=False, stopping_criteria=[clock])
    return len(ids) * new / (clock.seen[-1] - clock.seen[0])


def ours_decode(model, prompts, new: int, cache: CacheOptions, flags, compile=False) -> float:
    """Compiled, one step more: the first step, which compiles, is timed apart."""
    gen = generate(model, prompts, new + 1 + compile, cache=cache, token_flags=flags,
                   compile=compile)
    return len(prompts) * gen.decode_steps / gen.decode_s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--compile", action="store_true",
                   help="our caches' rows compiled (transformers' own cache not run)")
    p.add_argument("--out", help="write OUT.md")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ours, tok = load(None)
    theirs, _ = hf.load(str(checkpoint_folder(None)))  # the default model's folder
    text = tok.encode("\n".join(pydoc_data.topics.topics.values()))
    prompts = [text[i * a.prompt_len:(i + 1) * a.prompt_len] for i in range(a.batch)]
    flags, new = flags_of(ours, tok), a.new_tokens
    rows = {} if a.compile else {"transformers, DynamicCache (sdpa)": lambda: hf_decode(
        theirs.hf, torch.tensor(prompts), new)}
    for model, who in ((theirs, "transformers"), (ours, "our Llama")):
        for cache, what in ((CacheOptions("full"), "our full cache"), (CacheOptions(
                "fastgen", kv_budget=a.budget), f"FastGen at {a.budget}")):
            rows[f"{who}, {what}"] = lambda m=model, c=cache: ours_decode(m, prompts, new, c, flags,
                                                                          a.compile)
    speeds = {name: [] for name in rows}
    for r in range(a.runs):
        for name, run in rows.items():
            theirs.hf.set_attn_implementation("sdpa" if "DynamicCache" in name else hf.ATTENTION)
            speeds[name].append(run())
            print(f"run {r + 1}: {name}: {speeds[name][-1]:.1f} tokens/s", flush=True)
    base = statistics.median(next(iter(speeds.values())))
    lines = [f"`python -m studies.hf_speed {' '.join(sys.argv[1:])}`: decode, "
             f"{'compiled' if a.compile else 'eager'}, median of {a.runs} runs. "
             f"{machine_info(a.threads)}.", "",
             "| model, cache | tokens/s | runs | against the first row |", "| --- " * 4 + "|"]
    for name, s in speeds.items():
        m = statistics.median(s)
        lines.append(f"| {name} | {m:.1f} | {', '.join(f'{x:.1f}' for x in s)} | {m / base:.2f}x |")
    print("\n".join(lines))
    if a.out:
        open(a.out + ".md", "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
