"""Quality of a prompt read in chunks (`--prefill-chunk`) against one call, at
the same allocated bytes, and against StreamingLLM (`sink`), the usual way to
stream a long prompt.

    python -m studies.chunked_prefill                       # 4k and 8k: about an hour on 2 cores
    python -m studies.chunked_prefill --lengths 4096 --windows 2 --passkeys 2
    python -m studies.chunked_prefill --quick --ckpt TINY   # a smoke test, seconds

For each prompt length: `--windows` windows of real text (`textdata`, news by
default) of that many tokens plus `--new` more, teacher-forced through each
cache (KL to the full cache's next-token distribution and top-1 agreement,
averaged over the new tokens), and `--passkeys` pass-key prompts of about that
length (evaluate.py's, greedy answer). Caches: the full cache; FastGen's budget
mode at each of `--budgets`, the prompt read in one call and in chunks of
`--chunk` tokens (each chunk choosing every head's policy again); and `sink`
read in the same chunks at the share of the bytes that chunked FastGen
allocated on the first window (so that the two compare at about equal
bytes; each row reports its own share). Every method reads the
prompt itself (a chunked prefill's later tokens attend to a compressed cache,
so no dense prefill can be shared).

Writes `--out`.md and .json (default results/chunked_prefill/chunked_prefill).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import reserve
from generation import CacheOptions, flags_of, generate, load, make_caches, prefill_logits
from studies import output
from studies.evaluate import answer_ok, machine, passkey_cases
from studies.textdata import SOURCES, prompts


@torch.no_grad()
def forced(model, window: list[int], n_new: int, options: CacheOptions, flags):
    """Teacher-forced log-probabilities (n_new, V) of the window's last n_new
    tokens, and the bytes the caches allocated at the end."""
    prompt, follow = window[:-n_new], torch.tensor([window[-n_new:]])
    lens = torch.tensor([len(prompt)])
    model.setup_caches(make_caches(model, options, [len(prompt)], n_new, flags))
    out = [prefill_logits(model, torch.tensor([prompt]), lens, options.prefill_chunk)]
    for i in range(n_new - 1):
        reserve(model.caches())
        out.append(model(follow[:, i:i + 1], (lens + i)[:, None])[:, 0])
    nbytes = sum(c.nbytes() for c in model.caches())
    model.setup_caches(None)
    return torch.cat(out).log_softmax(-1), nbytes


def configs(budgets, chunk) -> dict[str, CacheOptions]:
    """{name: options}, the full cache first; a sink row follows the chunked
    FastGen row whose share it will take (`sink_of`)."""
    rows = {"full": CacheOptions("full")}
    for b in budgets:
        rows[f"fastgen {b:g}, one call"] = CacheOptions("fastgen", kv_budget=b)
        rows[f"fastgen {b:g}, chunks"] = CacheOptions("fastgen", kv_budget=b, prefill_chunk=chunk)
        rows[sink_of(rows, b)] = CacheOptions("sink", kv_budget=b, prefill_chunk=chunk)
    return rows


def sink_of(rows, budget) -> str:
    return f"sink at fastgen {budget:g}'s share, chunks"


def at_length(model, tok, length, a, flags) -> list[dict]:
    """Every config's KL, top-1, allocated share and pass-key accuracy at one length."""
    windows = prompts(tok, a.windows, length + a.new, length + a.new, seed=a.seed,
                      source=a.text)
    cases = []
    if a.passkeys:  # about `length` tokens, within the context with the answer's
        filler = max(1, length // 42)  # evaluate.py's filler blocks are about 42 tokens
        while filler > 1 and len(passkey_cases(tok, 1, filler, a.seed)[0][0]) + 8 > min(
                length, model.args.max_seq_len - 8):
            filler -= 1
        cases = [(ids, key) for ids, key in passkey_cases(tok, a.passkeys, filler, a.seed)
                 if len(ids) + 8 <= model.args.max_seq_len]  # a tiny model's context is short
    cfgs = configs(a.budgets, a.chunk)
    rows = {name: dict(name=name, length=length, kl=0.0, top1=0.0, bytes=0, full_bytes=0,
                       passkey=[], passkey_share=0.0, seconds=0.0) for name in cfgs}
    for w, window in enumerate(tqdm(windows, desc=f"{length} windows", leave=False)):
        ref = None
        for name, options in tqdm(list(cfgs.items()), desc="caches", leave=False):
            t0 = time.perf_counter()
            options = cfgs[name]  # a sink row's, set on the first window
            logp, nbytes = forced(model, window, a.new, options, flags)
            r = rows[name]
            if ref is None:
                ref, full = logp, nbytes
            if w == 0 and options.kv == "fastgen" and options.prefill_chunk:
                cfgs[sink_of(cfgs, options.kv_budget)] = CacheOptions(
                    "sink", kv_budget=round(nbytes / full, 3), prefill_chunk=a.chunk)
            r["kl"] += F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1).mean().item()
            r["top1"] += (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
            r["bytes"] += nbytes
            r["full_bytes"] += full
            r["seconds"] += time.perf_counter() - t0
            r["options"] = {k: v for k, v in vars(options).items() if v is not None}
    for ids, key in tqdm(cases, desc=f"{length} passkeys", leave=False):
        full = None
        for name, options in cfgs.items():
            gen = generate(model, [ids], 8, cache=options, token_flags=flags)
            rows[name]["passkey"].append(answer_ok(tok, gen.tokens[0], key))
            full = gen.kv_bytes if full is None else full
            rows[name]["passkey_share"] += gen.kv_bytes / full / len(cases)
    for r in rows.values():
        n = len(windows)
        r.update(kl=r["kl"] / n, top1=r["top1"] / n, share=r["bytes"] / r["full_bytes"],
                 passkey_acc=sum(r["passkey"]) / len(r["passkey"]) if r["passkey"] else None)
    return list(rows.values())


def report(res: dict) -> str:
    a = res["args"]
    lines = ["# A prompt read in chunks against one call\n",
             f"{res['date']}, {res['machine']}; {res['runtime_s'] / 60:.0f} min. "
             f"Command: `{res['command']}`\n",
             f"Per length: {a['windows']} windows of {a['text']} text, teacher-forced over "
             f"{a['new']} tokens after the prompt (KL to the full cache, top-1 agreement, "
             f"averaged), and {a['passkeys']} pass-key prompts. *share*: bytes allocated at the "
             f"end against the full cache's. Chunks of {a['chunk']} tokens. The sink rows take "
             "the share that chunked FastGen allocated on the first window.\n"]
    for length in a["lengths"]:
        lines += [f"## {length:,} tokens\n",
                  "| cache | share | KL | top-1 | pass key | pass-key share | s per window |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            if r["length"] == length:
                key = "-" if r["passkey_acc"] is None else f"{r['passkey_acc']:.2f}"
                lines.append(f"| {r['name']} | {r['share']:.3f} | {r['kl']:.4f} | {r['top1']:.3f} "
                             f"| {key} | {r['passkey_share']:.3f} | "
                             f"{r['seconds'] / a['windows']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    model, tok = load(a.ckpt)
    flags = flags_of(model, tok)
    limit = model.args.max_seq_len - a.new - 8
    lengths = [min(n, limit) for n in a.lengths]
    rows = [r for n in tqdm(lengths, desc="lengths") for r in at_length(model, tok, n, a, flags)]
    res = dict(date=time.strftime("%Y-%m-%d"), machine=machine(),
               command="python -m studies.chunked_prefill " + " ".join(argv or sys.argv[1:]),
               args=dict(vars(a), lengths=lengths), rows=rows, runtime_s=time.time() - t0)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    output(out, ".json").write_text(json.dumps(res, indent=1))
    output(out, ".md").write_text(report(res))
    print(report(res))
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--ckpt", help="checkpoint folder or GGUF file (default: the default model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192],
                   help="prompt lengths in tokens, cut to the model's context (default 4096 8192)")
    p.add_argument("--windows", type=int, default=3, help="text windows per length (default 3)")
    p.add_argument("--passkeys", type=int, default=4, help="pass-key prompts per length "
                   "(default 4; 0: none)")
    p.add_argument("--new", type=int, default=64, help="teacher-forced tokens per window "
                   "(default 64)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5],
                   help="FastGen budgets (default 0.25 0.5)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--text", default="news", choices=SOURCES, help="text of the windows "
                   "(default news)")
    p.add_argument("--seed", type=int, default=0, help="windows and pass keys (default 0)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="one short window and pass key per "
                   "cache: a smoke test (with --ckpt of a tiny model, seconds)")
    p.add_argument("--out", default="results/chunked_prefill/chunked_prefill",
                   help="output path without suffix")
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.windows, a.passkeys, a.new, a.chunk = [96], 1, 1, 8, 32
    if min(a.lengths) < 2 or a.windows < 1 or a.passkeys < 0 or a.new < 2 or a.chunk < 1:
        p.error("need --lengths >= 2, --windows >= 1, --passkeys >= 0, --new >= 2, --chunk >= 1")
    if any(not 0 < b <= 1 for b in a.budgets):
        p.error(f"--budgets must be in (0, 1] (got {a.budgets})")
    return a


if __name__ == "__main__":
    main()
