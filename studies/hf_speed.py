"""Decode speed under transformers: its DynamicCache (sdpa) against our caches in its model.

    python -m studies.hf_speed --prompt-len 2048 --batch 8 --new-tokens 32 --runs 3 \
        --out results/hf/speed_2kx8

Decode tokens/s of every sequence, the median of `--runs`, each row's runs in turn. transformers'
own rows time `model.generate` with 1 new token and with N + 1 and take the difference; ours read
generation.generate's decode timer. Prompts are windows of Python's pydoc topics.
"""
import argparse
import statistics
import time

import pydoc_data.topics
import torch

import hf
from convert_gguf import checkpoint_folder
from generation import CacheOptions, flags_of, generate, load


def hf_decode(model, ids, new: int) -> float:
    """Decode tokens/s of model.generate with transformers' DynamicCache."""
    def timed(n):
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0
    return len(ids) * new / (timed(new + 1) - timed(1))


def ours_decode(model, prompts, new: int, cache: CacheOptions, flags) -> float:
    gen = generate(model, prompts, new + 1, cache=cache, token_flags=flags)
    return len(prompts) * gen.decode_steps / gen.decode_s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", help="write OUT.md")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ours, tok = load(None)
    theirs, _ = hf.load(str(checkpoint_folder(None)))  # the default model's folder
    text = tok.encode("\n".join(pydoc_data.topics.topics.values()))
    prompts = [text[i * a.prompt_len:(i + 1) * a.prompt_len] for i in range(a.batch)]
    ids = torch.tensor(prompts)
    flags = flags_of(ours, tok)
    rows = {"transformers, DynamicCache (sdpa)": lambda: hf_decode(theirs.hf, ids, a.new_tokens)}
    for model, who in ((theirs, "transformers"), (ours, "our Llama")):
        for cache, what in ((CacheOptions("full"), "our full cache"), (CacheOptions(
                "fastgen", kv_budget=a.budget), f"FastGen at {a.budget}")):
            rows[f"{who}, {what}"] = lambda m=model, c=cache: ours_decode(m, prompts, a.new_tokens,
                                                                          c, flags)
    speeds = {name: [] for name in rows}
    for r in range(a.runs):
        for name, run in rows.items():
            if name.startswith("transformers, DynamicCache"):
                theirs.hf.set_attn_implementation("sdpa")
            speeds[name].append(run())
            theirs.hf.set_attn_implementation(hf.ATTENTION)
            print(f"run {r + 1}: {name}: {speeds[name][-1]:.1f} tokens/s", flush=True)
    base = statistics.median(speeds["transformers, DynamicCache (sdpa)"])
    lines = [f"Decode, {a.batch} x {a.prompt_len} tokens, {a.new_tokens} new, eager, "
             f"{a.threads} threads; median of {a.runs} runs.", "",
             "| model, cache | tokens/s | runs | against DynamicCache |",
             "| --- | --- | --- | --- |"]
    for name, s in speeds.items():
        m = statistics.median(s)
        lines.append(f"| {name} | {m:.1f} | {', '.join(f'{x:.1f}' for x in s)} | {m / base:.2f}x |")
    print("\n".join(lines))
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
