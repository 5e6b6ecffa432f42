"""Does a change of the core keep its behaviour? Record, then compare, on 15 configurations.

    python -m studies.same record before.pt          # at the commit before the change
    python -m studies.same record after.pt           # at the commit after it
    python -m studies.same compare before.pt after.pt
    python -m studies.same time                      # prefill and eager decode, at each commit

`record` runs 4 prompts cut from `--text` for 32 greedy tokens, and 2 teacher-forced for 16,
through each of CONFIGS, and keeps tokens, plans, kept tokens, bytes and logits; `compare`
tabulates two records. `time`: prefill seconds at 1k and 4k tokens and eager decode tokens/s at
2k x 8, medians of `--runs`, one thread.
"""
from __future__ import annotations

import argparse
import sys

import torch

from generation import CacheOptions, flags_of, generate, load, score

C = CacheOptions
CONFIGS = {
    "default 0.5": C("fastgen", kv_budget=0.5), "default 0.25": C("fastgen", kv_budget=0.25),
    "paper 0.95": C("fastgen", paper=True, recovery=0.95),
    "paper 0.9": C("fastgen", paper=True, recovery=0.9),
    "16/8/4 0.25": C("fastgen", kv_budget=0.25, kv_bits=(16, 8, 4)),
    "default, chunks of 128": C("fastgen", kv_budget=0.5, prefill_chunk=128),
    "paper, chunks of 128": C("fastgen", paper=True, prefill_chunk=128),
    "full": C("full"), "full@4": C("full", kv_bits=(4,)),
    **{f"{k} 0.5": C(k, kv_budget=0.5) for k in ("local", "sink", "h2o", "tova", "snapkv")},
    "ask-after 0.25": C("fastgen", kv_budget=0.25, ask_after=True),
}


def record(out: str, text: str, ckpt: str | None = None, new: int = 32,
           scale: float = 1.0) -> dict:
    """Run every configuration; save and return what each did (`scale`: of the prompts)."""
    torch.set_num_threads(1)
    model, tok = load(ckpt)
    flags = flags_of(model, tok)
    text = open(text).read()
    at = lambda n: int(n * scale)  # noqa: E731
    prompts = [tok.encode(text[at(i):at(i + n)]) for i, n in ((0, 1500), (3000, 2400),
                                                              (6000, 900), (9000, 2000))]
    follow = [tok.encode(text[at(12000 + 700 * i):at(12200 + 700 * i)])[:16] for i in range(2)]
    runs = {}
    for name, options in CONFIGS.items():
        g = generate(model, prompts, new, cache=options, token_flags=flags)
        logits = score(model, prompts[:2], follow, cache=options, token_flags=flags)
        runs[name] = dict(tokens=g.tokens, plan=g.plan, kept=g.kept_tokens, kv=g.kv_bytes,
                          logits=logits)
        print(f"{name}: kept {g.kept_tokens}, {g.kv_bytes} bytes", file=sys.stderr, flush=True)
    torch.save(runs, out)
    return runs


def timings(text: str, ckpt: str | None = None, runs: int = 3, compiled: bool = False,
            threads: int = 1):
    torch.set_num_threads(threads)
    model, tok = load(ckpt)
    flags = flags_of(model, tok)
    ids = tok.encode(open(text).read()[:30000]) * 4
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    prefill = dict(full=C("full"), default=CONFIGS["default 0.5"],
                   ask_after=C("fastgen", kv_budget=0.25, ask_after=True), h2o=CONFIGS["h2o 0.5"])
    for n in (1024, 4096):
        for name, options in prefill.items():
            s = median([generate(model, [ids[:n]], 1, cache=options, token_flags=flags).prefill_s
                        for _ in range(runs)])
            print(f"prefill {n} {name}: {s:.2f} s", flush=True)
    prompts = [ids[300 * b:300 * b + 2048] for b in range(8)]
    decode = dict(full=prefill["full"], default=prefill["default"]) if not compiled else {
        "full@16": C("full", kv_bits=(16,)), "16/8/4 0.25": CONFIGS["16/8/4 0.25"]}
    for name, options in decode.items():  # compiled: a first run compiles
        run = lambda: generate(model, prompts, 48, cache=options, token_flags=flags,  # noqa: E731
                               compile=compiled).speeds()[1]
        rate = median([run() for _ in range(runs + compiled)][compiled:])
        print(f"{'compiled' if compiled else 'eager'} decode 2k x 8 {name}: {rate:.1f} tok/s")


def compare(before: dict, after: dict) -> str:
    rows = ["| configuration | tokens | plans | kept tokens | KV bytes, before / after | "
            "logits, largest difference |", "| --- | --- | --- | --- | --- | --- |"]
    for name, a in before.items():
        b = after[name]
        same = lambda key: "same" if a[key] == b[key] else "DIFFER"  # noqa: E731
        diff = (a["logits"] - b["logits"]).abs().max().item()
        rows.append(f"| {name} | {same('tokens')} | {same('plan')} | {same('kept')} | "
                    f"{a['kv']} / {b['kv']} | {diff:.1e} |")
    return "\n".join(rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="run the configurations and save what they did")
    r.add_argument("out", help="the file to write (torch.save)")
    r.add_argument("--text", default="README.md", help="the text the prompts are sliced from; "
                   "give both runs the same file (default README.md)")
    r.add_argument("--ckpt", help="checkpoint folder or GGUF (default: the default model)")
    c = sub.add_parser("compare", help="a table of two records")
    c.add_argument("before")
    c.add_argument("after")
    t = sub.add_parser("time", help="prefill and eager decode speeds")
    t.add_argument("--text", default="README.md", help="the text the prompts are cut from")
    t.add_argument("--runs", type=int, default=3, help="runs per row, their median (default 3)")
    t.add_argument("--compile", action="store_true", help="decode compiled: the full cache in 16 "
                   "bits and 16/8/4 at 0.25, after a run that compiles (prefill as without)")
    t.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    a = p.parse_args()
    if a.command == "record":
        record(a.out, a.text, a.ckpt)
    elif a.command == "time":
        timings(a.text, runs=a.runs, compiled=a.compile, threads=a.threads)
    else:
        print(compare(torch.load(a.before), torch.load(a.after)))
