"""What the masked layout buys: eager decode with every pool paged against the default choice.

    python -m studies.layouts --threads 1 --out results/bench/layouts

An eager FastGen step attends a small pool with `kernels.masked_attention`
(pool.MaskedPool) and a larger one with `kernels.paged_attention`
(pool.attends_masked). This times the default FastGen's eager decode on the
default model both ways, the runs alternated A B B A, and reports the median
decode tokens/s of each and their ratio. Writes OUT.md.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

import pool
from generation import CacheOptions, flags_of, generate, load
from studies.textdata import documents


def decode_speeds(model, flags, prompts, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Decode tokens/s of the default FastGen, masked where small (the default) and paged always,
    2 * rounds runs each; raises if the two layouts generate different tokens."""
    chosen, speeds, tokens = pool.attends_masked, {"masked": [], "paged": []}, {}
    try:
        for _ in range(rounds):
            for name in ("masked", "paged", "paged", "masked"):
                pool.attends_masked = chosen if name == "masked" else (lambda *a: False)
                g = generate(model, prompts, new_tokens, cache=CacheOptions(kv="fastgen"),
                             token_flags=flags)
                speeds[name].append(g.speeds()[1])
                tokens[name] = g.tokens
    finally:
        pool.attends_masked = chosen
    if tokens["masked"] != tokens["paged"]:
        raise RuntimeError("the masked and paged layouts generated different tokens")
    return speeds


def main(sizes, new_tokens: int, rounds: int, out: str, threads: int | None):
    if threads:
        torch.set_num_threads(threads)
    model, tok = load(None)
    flags = flags_of(model, tok)
    ids = tok.encode("\n\n".join(text for _, text in documents(source="news")[:8]))
    rows = []
    for length, batch in sizes:
        prompts = [ids[i * 97:i * 97 + length] for i in range(batch)]
        s = decode_speeds(model, flags, prompts, new_tokens, rounds)
        m, p = statistics.median(s["masked"]), statistics.median(s["paged"])
        rows.append(f"| {length} x {batch} | {m:.1f} | {p:.1f} | {m / p:.2f}x |")
        print(rows[-1], flush=True)
    lines = [
        "# Eager decode: masked layout where small (the default) against every pool paged", "",
        f"`python -m studies.layouts {' '.join(sys.argv[1:])}`, {datetime.date.today()}, "
        f"{machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; default FastGen (budget 0.5), {new_tokens} new "
        f"tokens, median of {2 * rounds} runs a side, alternated A B B A.", "",
        "| prompt x batch | masked (default) tok/s | paged tok/s | ratio |",
        "| --- | ---: | ---: | ---: |", *rows, ""]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".md").write_text("\n".join(lines))


def machine() -> str:
    """The CPU's model name where Linux says it, else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def size(text: str) -> tuple[int, int]:
    length, _, batch = text.partition("x")
    return int(length), int(batch or 1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=size, nargs="+", default=[(200, 1), (500, 1), (300, 2)],
                   metavar="TxB", help="prompt tokens x batch (default 200x1 500x1 300x2)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="A B B A rounds (default 2)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="results/bench/layouts", help="output path without .md")
    a = p.parse_args()
    main(a.sizes, a.new_tokens, a.rounds, a.out, a.threads)
