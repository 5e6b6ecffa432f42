"""Quality against KV memory: FastGen and fixed policies at equal KV budget.

    python -m studies.evaluate           # SmolLM2-135M; 30 windows, 40 passkeys; ~20 min on 2 cores
    python -m studies.evaluate --quick --ckpt TINY_CHECKPOINT    # a smoke test, seconds
    python -m studies.evaluate --peer kvpress   # also NVIDIA kvpress, run in its own venv:
        python -m venv /tmp/kvp && /tmp/kvp/bin/pip install torch==2.13.0 kvpress==0.5.5 optimum-quanto==0.2.7
    python -m studies.evaluate --passkey-chat --windows 2 --paper-thresholds --budgets \
        --out results/evaluate/passkey_chat   # the full cache on the ChatML form of the passkeys

Two tasks, each run through every configuration (the full cache; the paper's
FastGen at several recovery thresholds T; the default FastGen and the fixed
policies at several budgets):

1. Real text (`textdata`): windows of `--prompt-len` tokens followed by the
   next `--new-tokens` tokens of the same text, teacher-forced through the
   cache. Against the full cache: mean KL(full || compressed) per token, top-1
   agreement, and the perplexity of the true continuation.
2. Passkey retrieval: a 5-digit key hidden at a random depth in ~1k tokens of
   the usual filler, then greedy decoding; exact match of the digits.

The x-axis is the KV bytes the cache really allocated (`nbytes()` of the
caches of the run itself, index tensors included) as a share of the full
cache's bytes for the same work. Writes OUT.md (tables), OUT.json, OUT.png.

Every configuration compresses the same prompts after an exact prefill, so the
prefill runs once: each layer's q, k, v are recorded and every configuration's
cache is built from them (the same calls `generation.score` makes, minus the
model). Profiling is shared too; see `from_record`.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import cache as fastgen_cache
from generate import UsageError
import model as model_module
from cache import profile_layers
from generation import CacheOptions, make_caches, read_again
from model import causal_attention, reserve
from studies import output
from studies.textdata import SOURCES

BASELINES = ("local", "sink", "h2o", "tova", "snapkv")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("There is an important info hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.")


@dataclass
class Config:
    name: str
    kv: str
    options: dict


def configs(budgets, paper_thresholds=(), kinds=None, precision=False) -> list[Config]:
    """The full cache; FastGen as the paper states it (threshold T) and the
    default (a budget); the fixed policies at each budget; with `precision`,
    the default choosing among 16, 8 and 4 bits (or 16, 8, 4 and 2) and at
    16, 8 or 4 bits alone, the full cache at 8, 4 and 2 bits, and h2o and
    SnapKV at 16, 8 and 4 bits (a family per precision: `h2o@4`)."""
    out = [Config("full", "full", {})]
    out += [Config(f"fastgen-paper T={t:g}", "fastgen", {"recovery": t, "paper": True})
            for t in paper_thresholds]
    out += [Config(f"fastgen-budget b={b:g}", "fastgen", {"kv_budget": b}) for b in budgets]
    out += [Config(f"{kind} b={b:g}", kind, {"kv_budget": b}) for kind in BASELINES for b in budgets]
    if precision:
        out += [Config(f"fastgen-budget@{'/'.join(map(str, bits))} b={b:g}", "fastgen",
                       {"kv_budget": b, "kv_bits": bits})
                for bits in ((16, 8, 4), (16, 8, 4, 2), (16,), (8,), (4,)) for b in budgets]
        out += [Config(f"full@{q}", "full", {"kv_bits": (q,)}) for q in (8, 4, 2)]
        out += [Config(f"{kind}@{q} b={b:g}", kind, {"kv_budget": b, "kv_bits": (q,)})
                for kind in ("h2o", "snapkv") for q in (16, 8, 4) for b in budgets]
    unknown = set(kinds or ()) - {family(c.name) for c in out}
    if unknown:
        raise UsageError(f"--kinds: no family {', '.join(sorted(unknown))} here; these are: "
                         f"{' '.join(dict.fromkeys(family(c.name) for c in out))}"
                         + ("" if precision else " (and more with --precision)"))
    return [c for c in out if kinds is None or c.name == "full" or family(c.name) in kinds]


# --- Prefill once, replay every configuration --------------------------------

class Recorder(nn.Module):
    """A stand-in cache for one exact prefill: keeps the layer's q, k, v so that
    each configuration can build its own cache from them without running the
    model again, and the profiling sums each configuration asked for."""

    def __init__(self, lens):
        super().__init__()
        self.lens, self.sums = lens, {}

    def forward(self, q, k, v, input_pos, tokens):
        self.qkv = (q, k, v)
        return causal_attention(q, k, v)


@torch.no_grad()
def record(model, prompts):
    """Exact prefill of a batch: (recorders, tokens, input_pos, lens, last-token logits)."""
    B, lens = len(prompts), torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(B, int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    input_pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    recorders = [Recorder(lens) for _ in model.layers]
    model.setup_caches(recorders)
    # model.forward without the output projection of every prompt position
    # (B x T x V floats): only the last token's logits are needed.
    x = model.tok_embeddings(tokens)
    cos, sin = model.rope[:, input_pos].to(x.dtype).unsqueeze(2)
    for layer in model.layers:
        x = layer(x, cos, sin, input_pos, tokens)
    last = model.output(model.norm(x[torch.arange(B), lens - 1])).float()  # (B, V)
    model.setup_caches(None)
    return recorders, tokens, input_pos, lens, last


@contextmanager
def from_record(recorders):
    """While caches are built by calling them on recorded q, k, v (as the
    model's prefill calls them), take from the record what the prefill already
    computed instead of computing it again for every configuration: the
    attention output (which the build discards) and profiling's column sums,
    which depend only on the prompt, the rows read, the Local windows and
    whether values weigh them, and every row's sums, once per layer
    (tests/studies/test_evaluate.py compares the logits with `generation.score`)."""
    by_key = {id(r.qkv[1]): r for r in recorders}

    def sums(caches):
        layers = tuple(id(c.held[1]) for c in caches)  # the recorded keys, held as given
        memo = by_key[layers[0]].sums
        c = caches[0]
        key = (layers, tuple(fastgen_cache.banded(c.policies)), c.method.rows,
               c.method.weigh_values)
        if key not in memo:
            memo[key] = profile_layers(caches)
        return memo[key]

    dense = fastgen_cache.attention_sums

    def every_row(q, k, lens, *rest):  # the prefill's sums of every row, once a record
        if rest:
            return dense(q, k, lens, *rest)
        memo = by_key[id(k)].sums
        if "every" not in memo:
            memo["every"] = dense(q, k, lens)
        return memo["every"]

    skip = lambda q, k, v: None  # noqa: E731
    with mock.patch.object(fastgen_cache, "profile_layers", sums), \
            mock.patch.object(fastgen_cache, "attention_sums", every_row), \
            mock.patch.object(fastgen_cache, "causal_attention", skip), \
            mock.patch.object(model_module, "causal_attention", skip):
        yield


def read_again_once(model, recorders, tokens, lens):
    """generation.read_again for the model's caches, built from `recorders`:
    what it gives the prompt depends on the prompt alone, so a record's
    first configuration reads it again and the others reuse it."""
    caches, memo = model.caches(), recorders[0].sums
    if "ask_after" not in memo:
        read_again(model, tokens, lens, decide=False)
        memo["ask_after"] = [c.read_scores for c in caches]
    for c, got in zip(caches, memo["ask_after"]):
        c.read_scores = got
    fastgen_cache.read_piece(caches)


@torch.no_grad()
def replay(model, rec, config: Config, n: int, follow=None, flags=None):
    """Build `config`'s caches from a recorded prefill and decode n tokens:
    teacher-forced on `follow` (B, n) or greedy. Returns logits (B, n, V) and
    the bytes the caches allocated and the share of seen tokens they hold."""
    recorders, tokens, input_pos, lens, last = rec
    options = CacheOptions(config.kv, **config.options)
    caches = make_caches(model, options, lens.tolist(), n, flags)
    with from_record(recorders):
        for c, r in zip(caches, recorders):
            c(*r.qkv, input_pos, tokens)
    model.setup_caches(caches)
    if fastgen_cache.asks_after(caches):
        read_again_once(model, recorders, tokens, lens)
    out, pos = [last], lens[:, None]
    for i in range(n - 1):
        reserve(caches)
        token = follow[:, i:i + 1] if follow is not None else out[-1].argmax(-1, keepdim=True)
        out.append(model(token, pos + i)[:, 0])
    nbytes = sum(c.nbytes() for c in caches)
    # Tokens held at the end against tokens seen, beside the bytes allocated:
    # the gap is the room reserved up front for tokens a policy might keep.
    seen = model.args.n_layers * model.args.n_kv_heads * int((lens + n - 1).sum())
    kept = seen if config.kv == "full" else sum(c.kept() for c in caches)
    model.setup_caches(None)
    return torch.stack(out, dim=1), nbytes, kept / seen


# --- The two tasks ------------------------------------------------------------

def batches(items, most):
    """Consecutive batches of at most `most` items, as even as possible."""
    size = math.ceil(len(items) / math.ceil(len(items) / most))
    return [items[i:i + size] for i in range(0, len(items), size)]


def text_quality(model, windows, n_new, cfgs, flags, batch,
                 reference=1.0) -> dict:
    """Per config: KL, top-1 agreement, perplexity and bytes share over the
    windows; the share against the full cache's bytes times `reference`."""
    acc = {c.name: dict(kl=0.0, kl_first=0.0, top1=0.0, nll=0.0, bytes=0, full_bytes=0, kept=0.0)
           for c in cfgs}
    for chunk in tqdm(batches(windows, batch), desc="text batches", leave=False):
        follow = torch.tensor([w[-n_new:] for w in chunk])  # (B, N)
        rec = record(model, [w[:-n_new] for w in chunk])
        ref = None
        for c in tqdm(cfgs, desc="configurations", leave=False):
            logits, nbytes, kept = replay(model, rec, c, n_new, follow, flags)
            logp = logits.log_softmax(-1)
            if ref is None:  # the full cache comes first: the reference
                ref, full_bytes = logp, nbytes * reference
            a = acc[c.name]
            kl = F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1)  # (B, N)
            a["kl"] += kl.sum().item()
            a["kl_first"] += kl[:, :n_new // 2].sum().item()
            a["top1"] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            a["nll"] -= logp.gather(-1, follow[..., None]).sum().item()
            a["bytes"] += nbytes
            a["full_bytes"] += full_bytes
            a["kept"] += kept * len(chunk)
        del rec
    count, half = len(windows) * n_new, len(windows) * (n_new // 2)
    # kl_halves: the KL of the first and the second half of the new tokens
    # apart, how the loss falls on the tokens right after the prompt and later.
    return {name: dict(kl=a["kl"] / count,
                       kl_halves=[a["kl_first"] / max(half, 1),
                                  (a["kl"] - a["kl_first"]) / max(count - half, 1)],
                       top1=a["top1"] / count,
                       ppl=math.exp(a["nll"] / count), share=a["bytes"] / a["full_bytes"],
                       kept=a["kept"] / len(windows)) for name, a in acc.items()}


def passkey_cases(tok, n, n_filler, seed, chat=False):
    """n (token ids, key) pairs: a 5-digit key after a random number of the
    n_filler filler blocks. With a tokenizer that splits digits (SmolLM2) all
    prompts have the same length."""
    rng, cases = random.Random(seed), []
    for _ in range(n):
        key, depth = str(rng.randint(10000, 99999)), rng.randint(0, n_filler)
        needle = f" The pass key is {key}. Remember it. {key} is the pass key."
        body = INTRO + FILLER * depth + needle + FILLER * (n_filler - depth)
        text = (tok.apply_chat(body + "\nWhat is the pass key?") + "The pass key is" if chat
                else body + "\nWhat is the pass key? The pass key is")
        cases.append((tok.encode(text), key))
    return cases


def answer_ok(tok, ids, key) -> bool:
    digits = re.search(r"\d+", tok.decode(ids).replace(" ", ""))
    return digits is not None and digits.group() == key


def passkey(model, tok, cases, n_new, cfgs, flags, batch,
            reference=1.0) -> dict:
    """Per config: accuracy, bytes share and each case's answer."""
    res = {c.name: dict(correct=[], answers=[], bytes=0, full_bytes=0) for c in cfgs}
    for chunk in tqdm(batches(cases, batch), desc="passkey batches", leave=False):
        rec = record(model, [ids for ids, _ in chunk])
        for c in tqdm(cfgs, desc="configurations", leave=False):
            logits, nbytes, _ = replay(model, rec, c, n_new, None, flags)
            r = res[c.name]
            full_bytes = nbytes * reference if c.name == "full" else full_bytes
            for (_, key), ids in zip(chunk, logits.argmax(-1).tolist()):
                r["answers"].append(tok.decode(ids))
                r["correct"].append(answer_ok(tok, ids, key))
            r["bytes"] += nbytes
            r["full_bytes"] += full_bytes
        del rec
    return {name: dict(acc=sum(r["correct"]) / len(r["correct"]), share=r["bytes"] / r["full_bytes"],
                       correct=r["correct"], answers=r["answers"]) for name, r in res.items()}


# --- The peer: NVIDIA kvpress, in its own environment -------------------------

PRESSES = ("StreamingLLMPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress")
# With --precision: HF's quanto QuantizedCache at these bits, alone and under these presses
QUANT_BITS, QUANT_PRESSES = (4, 2), ("SnapKVPress", "ExpectedAttentionPress")


def run_peer(python, ckpt, windows, n_new, cases, passkey_tokens, budgets, batch, threads,
             precision=False, presses=PRESSES) -> dict:
    """Run peer_kvpress.py under `python` (a venv with kvpress) on the same
    windows and passkey cases; its rows, or {"error": why it could not run}.
    With `precision`, also HF's quantized cache (under those of `presses` in
    QUANT_PRESSES), and bytes as a 16-bit model's."""
    quant = dict(float_bits=16, quant_bits=QUANT_BITS,
                 quant_presses=[x for x in QUANT_PRESSES if x in presses])
    return run_peer_job(python, dict(
        ckpt=str(ckpt), windows=windows, new_tokens=n_new, passkey_tokens=passkey_tokens,
        cases=[[ids, key] for ids, key in cases], presses=list(presses), batch=batch,
        threads=threads,
        ratios=[round(1 - b, 6) for b in budgets], **(quant if precision else {})))


def run_peer_job(python, job: dict) -> dict:
    """Run peer_kvpress.py under `python` on `job`; what it wrote, or {"error": why}."""
    with tempfile.TemporaryDirectory() as tmp:
        path, result = Path(tmp, "job.json"), Path(tmp, "result.json")
        path.write_text(json.dumps(job))
        script = Path(__file__).with_name("peer_kvpress.py")
        try:  # its progress bars go to our stderr; it writes its own errors into `result`
            done = subprocess.run([python, str(script), str(path), str(result)])
        except OSError as e:
            return {"error": f"cannot start {python}: {e}"}
        if not result.is_file():
            return {"error": f"{python} {script.name} exited {done.returncode} without a result"}
        return json.loads(result.read_text())


# --- Report ---------------------------------------------------------------------

def interpolate(points, x):
    """The value a curve of (share, value) points takes at share x; None outside it."""
    pts = sorted(p for p in points if p[1] is not None)
    if not pts or not pts[0][0] <= x <= pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1]


def near(points, x, tol=0.03):
    """`interpolate`, or the value of the end point within `tol` of x."""
    v = interpolate(points, x)
    pts = sorted(p for p in points if p[1] is not None)
    if v is None and pts:
        end = min(pts, key=lambda p: abs(p[0] - x))
        v = end[1] if abs(end[0] - x) <= tol else None
    return v


# (key, title, x-axis key, which of two values is better)
METRICS = [("kl", "KL(full || compressed) per token, lower is better", "share", min),
           ("top1", "top-1 agreement with the full cache, higher is better", "share", max),
           ("ppl", "perplexity of the true continuation, lower is better", "share", min),
           ("pk_acc", "passkey accuracy, higher is better", "pk_share", max)]


SHARES = (0.25, 0.5, 0.75)


def family(name):
    return name.split(" ")[0]


def fmt(v, key):
    if v is None:
        return "—"
    return f"{v:.4f}" if key == "kl" else f"{v:.2f}" if key == "ppl" else f"{v:.3f}"


def report(rows, meta, peer_error) -> str:
    lines = ["# Quality against KV memory at equal budget\n",
             f"Measured on {meta['machine']}, torch {meta['torch']}, {meta['date']}; "
             f"{meta['runtime_s'] / 60:.1f} min"
             + (f" (+ {meta['peer_runtime_s'] / 60:.1f} min for the peer)" if meta["peer"] else "")
             + ".\n", f"    {meta['command']}\n",
             *([f"Rows this run did not measure come from `{meta['added_rows']}` (same windows "
                "and cases).\n"] if meta.get("added_rows") else []),
             f"Model: `{meta['model']}`. Text (`{meta.get('text', 'pydoc')}`): {meta['windows']} windows of {meta['prompt_len']} "
             f"prompt + {meta['new_tokens']} continuation tokens of real text (`textdata`, seed "
             f"{meta['seed']}), teacher-forced. Passkey: {meta['passkeys']} cases of "
             f"{meta['passkey_len']} tokens ({meta['passkey_format']} prompt), greedy "
             f"{meta['passkey_tokens']} tokens, exact match of the 5 digits. KV share = bytes the "
             "caches really allocated (K, V and index tensors) / bytes of the full cache"
             + (" with its keys and values in 16 bits" if meta.get("reference_bits") else "")
             + ", measured on each task's own run; `@B`: keys and values stored in B bits "
             "(`--kv-bits`); tokens held = (token, layer, KV head) entries in the cache "
             "at the end / entries of the full cache: the gap to the KV share is room reserved up "
             "front for what a policy might keep of the new tokens."
             + (" The passkey prompt is plain text ending in `The pass key is`: this instruct model "
                "solves the ChatML form less often with the full cache (`--passkey-chat`, "
                "results/evaluate/passkey_chat.md)." if meta["passkey_format"] == "plain" else "")
             + "\n",
             "| configuration | text KV share | tokens held | KL | top-1 | perplexity "
             "| passkey KV share | passkey |", "|---" * 8 + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['share']:.3f} | {fmt(r.get('kept'), 'x')} | {fmt(r['kl'], 'kl')} "
                     f"| {fmt(r['top1'], 'top1')} "
                     f"| {fmt(r['ppl'], 'ppl')} | {fmt(r.get('pk_share'), 'x')} "
                     f"| {fmt(r.get('pk_acc'), 'pk_acc')} |")
    ours = lambda f: f.startswith("fastgen")  # noqa: E731
    others = [f for f in dict.fromkeys(map(family, rows)) if f != "full" and not ours(f)]
    fastgen = {n: r for n, r in rows.items() if ours(family(n))}
    # Against a 16-bit full cache (--precision), the shares where fewer bits matter.
    shares = (0.125, 0.25, 0.5) if meta.get("reference_bits") else SHARES
    lines += ["\n## Every family at the same KV shares\n",
              f"Each family's points interpolated at allocated-byte shares "
              f"{', '.join(map(str, shares[:-1]))} and {shares[-1]}; "
              "a share up to 0.03 beyond a family's last point takes that point's value (a dash: "
              "further). Passkey at the passkey runs' shares.\n",
              "| family | " + " | ".join(f"{key} @{x}" for key, *_ in METRICS for x in shares) + " |",
              "|---" * (1 + len(METRICS) * len(shares)) + "|"]
    for f in dict.fromkeys(map(family, rows)):
        if f == "full":
            continue
        cells = [fmt(near([(r[share], r.get(key)) for n, r in rows.items()
                           if family(n) == f and r.get(share) is not None], x), key)
                 for key, _, share, _ in METRICS for x in shares]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    lines.append("\n## Equal memory: each fixed policy interpolated at FastGen's KV share\n")
    lines.append("A dash: that policy's points do not reach this share.\n")
    wins = {f: {key: [0, 0] for key, *_ in METRICS} for f in others}
    for key, title, share, better in METRICS:
        lines += [f"**{title}**\n", "| FastGen | KV share | FastGen | " + " | ".join(others) + " |",
                  "|---" * (3 + len(others)) + "|"]
        for name, r in fastgen.items():
            if r.get(key) is None:
                continue
            cells = []
            for f in others:
                v = interpolate([(o[share], o.get(key)) for n, o in rows.items()
                                 if family(n) == f and o.get(share) is not None], r[share])
                if v is not None:
                    wins[f][key][0] += better(v, r[key]) == r[key]
                    wins[f][key][1] += 1
                cells.append(fmt(v, key))
            lines.append(f"| {name} | {r[share]:.3f} | {fmt(r[key], key)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("**Headline**: at how many FastGen points FastGen is at least as good as the "
                 "policy at the same KV share (of the points the policy's curve reaches):\n")
    lines += [f"- {f}: " + ", ".join(f"{key} {w}/{n}" for key, (w, n) in ws.items())
              for f, ws in wins.items()]
    if meta.get("peer_info"):
        i = meta["peer_info"]
        lines += [f"\nPeer: kvpress {i['kvpress']} (transformers {i['transformers']}, torch "
                  f"{i['torch']}, its own venv) on the same prompts; `kvpress:X b=B` is press X at "
                  "compression_ratio 1 - B, prompt compressed once after prefill. `full (kvpress)` "
                  "is its uncompressed cache, its reference for KL and top-1."]
        if any(n.startswith("hf-quanto") or "+hf-quanto" in n for n in rows):
            lines += ["`hf-quanto@B` is HF transformers' `QuantizedCache` (quanto backend, B "
                      "bits, its defaults: groups of 64, keys and values grouped per token; the "
                      "prompt is quantized at prefill, new tokens stay unquantized until 128 have "
                      "gathered); `hf-quanto-kivi@B` groups keys per channel "
                      "over 64 tokens as KIVI does; `kvpress:X+hf-quanto@B` is press X on that "
                      "cache. The peer's model computes in float32; its bytes count every "
                      "floating tensor (keys, values, scales, shifts) at 16 bits, integer codes "
                      "as stored."]
        lines += [f"- {name} did not run: {why}" for name, why in i["failed"].items()]
        lines += [f"- {name} is not in this kvpress" for name in i["presses_missing"]]
    if peer_error:
        lines += ["\n## kvpress (peer)\n", "It could not run here:\n", "```", peer_error.strip(), "```"]
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    families = list(dict.fromkeys(map(family, rows)))
    palette = plt.get_cmap("tab20").colors
    colors = {f: palette[i % len(palette)] for i, f in enumerate(families)}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for ax, (key, title, share, _) in zip(axes.flat, METRICS):
        for f in families:
            pts = sorted((r[share], r[key]) for n, r in rows.items()
                         if family(n) == f and r.get(key) is not None and r.get(share) is not None)
            if pts and not (key == "kl" and f == "full"):  # KL 0 has no place on a log axis
                ax.plot(*zip(*pts), color=colors[f], label=f, marker="*" if f == "full" else "o",
                        ms=12 if f == "full" else 4, lw=2.5 if f.startswith("fastgen") else 1,
                        ls="--" if f.startswith(("kvpress", "hf-")) else "-")
        ax.set(title=title, xlabel="KV bytes allocated / full cache")
        ax.set_yscale("log" if key in ("kl", "ppl") else "linear")
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9)
    fig.tight_layout(rect=(0, 0.02 + 0.024 * -(-len(labels) // 5), 1, 1))  # room for the legend
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- Main -----------------------------------------------------------------------

def machine() -> str:
    cpu = "unknown CPU"
    if Path("/proc/cpuinfo").is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), cpu)
    return f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"


def main(*, ckpt: str | None = None, out: str = "results/evaluate/quality", quick: bool = False,
         windows: int = 30, prompt_len: int = 768, new_tokens: int = 64, passkeys: int = 40,
         filler: int = 40, passkey_tokens: int = 8, passkey_chat: bool = False,
         budgets=(0.25, 0.5, 0.75), paper_thresholds=(0.7, 0.9, 0.98),
         text: str = "pydoc", batch: int = 30, seed: int = 0, peer: str | None = None,
         peer_python: str = "/tmp/kvp/bin/python", peer_presses=PRESSES,
         peer_rows: str | None = None,
         kinds=None, add_rows: str | None = None, precision: bool = False,
         threads: int | None = None, command: str | None = None,
         window: int | None = None) -> dict:
    """Run both tasks over every configuration; write OUT.md, OUT.json, OUT.png
    and return the rows (configuration name -> metrics). `window`: the newest
    tokens a rounding head keeps in 16 bits, instead of quant.WINDOW and, under
    a budget, cache.budget_window's."""
    import time

    from model import load_model
    from policies import token_flags
    from studies.textdata import prompts
    from tokenizer import Tokenizer
    if quick:
        windows, prompt_len, new_tokens, passkeys, filler, passkey_tokens = 4, 40, 8, 4, 0, 4
        budgets, paper_thresholds, batch = (0.3, 0.6), (0.9, 1.0), 4
    if ckpt is None:
        from convert_gguf import default_checkpoint
        ckpt = default_checkpoint()
    if threads:
        torch.set_num_threads(threads)
    if window is not None:  # where the cache, its pricing and its errors read it
        import cache
        import pool
        import profiling
        import quant
        for module in (pool, profiling, quant):
            module.WINDOW = window
        cache.budget_window = lambda kv_budget: window
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model, tok = load_model(ckpt), Tokenizer(ckpt)
    V = model.args.vocab_size
    flags = token_flags(V, [i for i in tok.special_ids if i < V],
                        [i for i in tok.punctuation_ids() if i < V])
    texts = prompts(tok, windows, prompt_len + new_tokens, prompt_len + new_tokens, seed, text)
    cases = passkey_cases(tok, passkeys, filler, seed, passkey_chat)
    longest = max([len(c[0]) for c in cases], default=0) + passkey_tokens
    if max(prompt_len + new_tokens, longest) > model.args.max_seq_len:
        raise ValueError(f"{max(prompt_len + new_tokens, longest)} tokens exceed the model's "
                         f"context of {model.args.max_seq_len}")
    cfgs = configs(budgets, paper_thresholds, kinds, precision)
    # With precisions, shares are of a full cache in 16 bits, whatever the model computes in.
    reference = 16 / (8 * model.tok_embeddings.weight.element_size()) if precision else 1.0
    run = dict(flags=flags, batch=batch, reference=reference)
    rows = text_quality(model, texts, new_tokens, cfgs, **run)
    for name, r in (passkey(model, tok, cases, passkey_tokens, cfgs, **run) if cases else {}).items():
        rows[name].update(pk_acc=r["acc"], pk_share=r["share"], pk_answers=r["answers"])
    ours_s, peer_error = time.perf_counter() - t0, None
    if peer == "kvpress":
        got = run_peer(peer_python, ckpt, texts, new_tokens, cases, passkey_tokens, budgets, batch,
                       torch.get_num_threads(), precision, peer_presses)
        peer_error = got.get("error")
        for name, r in got.get("rows", {}).items():
            ids = r.pop("pk_tokens")
            if ids is not None:  # None: it could not run on the passkey prompts
                r.update(pk_acc=sum(answer_ok(tok, t, key) for t, (_, key) in zip(ids, cases))
                         / len(cases), pk_answers=[tok.decode(t) for t in ids])
            rows[name] = r
    if peer_rows:  # an earlier run's kvpress rows, on the same windows and cases
        earlier = json.loads(Path(peer_rows).read_text())
        got = dict(info=earlier["meta"].get("peer_info"))
        rows |= {f"{n} ({earlier['meta']['date']})": r for n, r in earlier["rows"].items()
                 if n.startswith("kvpress") or n == "full (kvpress)"}
    if add_rows:  # the rows of an earlier run on the same windows and cases that this one lacks
        earlier = json.loads(Path(add_rows).read_text())
        rows |= {n: r for n, r in earlier["rows"].items() if n not in rows}
    meta = dict(machine=machine(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                command=command or "python -m studies.evaluate" + (" --quick" if quick else ""),
                model=Path(ckpt).name, windows=windows, prompt_len=prompt_len,
                new_tokens=new_tokens, seed=seed, passkeys=passkeys,
                passkey_len=max([len(c[0]) for c in cases], default=0), passkey_tokens=passkey_tokens,
                passkey_format="ChatML" if passkey_chat else "plain", runtime_s=ours_s, peer_runtime_s=time.perf_counter() - t0 - ours_s,
                peer=peer or peer_rows, peer_info=got.get("info") if peer or peer_rows else None,
                text=text, added_rows=add_rows, reference_bits=16 if precision else None)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    output(out, ".md").write_text(report(rows, meta, peer_error))
    output(out, ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, output(out, ".png"))
    return rows


def render(out: str) -> dict:
    """Write OUT.md and OUT.png again from OUT.json (after a change to the report)."""
    out = Path(out)
    saved = json.loads(output(out, ".json").read_text())
    output(out, ".md").write_text(report(saved["rows"], saved["meta"], None))
    plot(saved["rows"], output(out, ".png"))
    return saved["rows"]


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m studies.evaluate",
        description="Quality (KL, top-1, perplexity, passkey) against the KV bytes really "
                    "allocated: FastGen vs fixed policies.")
    p.add_argument("--ckpt", help="HF-format checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="output path without suffix; writes .md, .json, "
                   ".png (default results/evaluate/quality, or results/evaluate/quality_quick "
                   "with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny settings: a smoke test in seconds")
    p.add_argument("--render", action="store_true", help="only write OUT.md and OUT.png again "
                   "from OUT.json (a saved run)")
    p.add_argument("--windows", type=int, default=30, help="text windows (default 30)")
    p.add_argument("--prompt-len", type=int, default=768, help="prompt tokens per window (768)")
    p.add_argument("--new-tokens", type=int, default=64, help="continuation tokens (64)")
    p.add_argument("--passkeys", type=int, default=40, help="passkey cases (default 40)")
    p.add_argument("--filler", type=int, default=40, help="filler blocks per passkey prompt "
                   "(40: about 1,000 tokens)")
    p.add_argument("--passkey-tokens", type=int, default=8, help="greedy tokens per answer (8)")
    p.add_argument("--passkey-chat", action="store_true", help="ChatML-wrap the passkey "
                   "question (default: a plain prompt, which this small model answers better)")
    p.add_argument("--text", default="pydoc", choices=SOURCES, help="real text: "
                   "Python's documentation (pydoc), news prose (news) or Usenet discussion "
                   "(usenet); news and usenet are gensim's test data: pip install --no-deps "
                   "gensim==4.4.0 (default pydoc)")
    p.add_argument("--paper-thresholds", type=float, nargs="*", default=[0.7, 0.9, 0.98],
                   help="thresholds T of the paper's literal FastGen (none: no rows)")
    p.add_argument("--peer-rows", help="add the kvpress rows of an earlier run's OUT.json "
                   "(same windows and cases), labelled with its date")
    p.add_argument("--kinds", nargs="+", help="run only these families (e.g. fastgen-budget "
                   "h2o); the full cache always runs")
    p.add_argument("--add-rows", help="add the rows of an earlier run's OUT.json (same "
                   "windows and cases) that this run does not have")
    p.add_argument("--budgets", type=float, nargs="*", default=[0.25, 0.5, 0.75],
                   help="FastGen budgets and fixed policies' budgets: share of the prompt kept per head (none: "
                        "no fixed-policy rows)")
    p.add_argument("--batch", type=int, default=30, help="most windows / cases per batch (30)")
    p.add_argument("--precision", action="store_true", help="also the rows of keys and values "
                   "in fewer bits (FastGen's budget mode choosing among 16, 8 and 4 bits, and at "
                   "16 alone; the full cache at 8, 4 and 2 bits; h2o and SnapKV at 16, 8 and 4), "
                   "and every share against a full cache stored in 16 bits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", choices=["kvpress"], help="also run NVIDIA kvpress presses at "
                   "compression ratio 1 - budget on the same windows and cases")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice). On a "
                   "machine shared with other jobs, 1 avoids threads waiting on each other: a "
                   "decode step is thousands of small ops")
    p.add_argument("--window", type=int, help="newest tokens a rounding head keeps to about 8 "
                   "bits (default: quant.WINDOW, 32, and under a budget cache.budget_window, 256 x "
                   "the budget from 32 to 128); 0 keeps none")
    p.add_argument("--peer-python", default="/tmp/kvp/bin/python",
                   help="python of a venv with kvpress installed (default /tmp/kvp/bin/python)")
    p.add_argument("--peer-presses", nargs="*", default=list(PRESSES), metavar="PRESS",
                   help="kvpress classes to run with --peer, alone and, with --precision, on HF's "
                        "quantized cache where " + " or ".join(QUANT_PRESSES) + "; none: with "
                        "--precision HF's quantized cache alone (default "
                        + " ".join(PRESSES) + ")")
    a = p.parse_args(argv)
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    if a.window is not None and a.window < 0:
        p.error("--window must be at least 0")
    return a


if __name__ == "__main__":
    from generate import exit_on_user_error
    with exit_on_user_error():
        a = parse_args()
        kwargs = {k: v for k, v in vars(a).items() if v is not None and k != "render"}
        kwargs["out"] = a.out or ("results/evaluate/quality_quick" if a.quick
                                  else "results/evaluate/quality")
        rows = render(kwargs["out"]) if a.render else \
            main(command=" ".join(["python -m studies.evaluate", *sys.argv[1:]]), **kwargs)
    for name, r in rows.items():
        print(f"{name:30s} share {r['share']:.3f}  KL {r['kl']:.4f}  top-1 {r['top1']:.3f}  "
              f"ppl {r['ppl']:.2f}  passkey {r.get('pk_acc', float('nan')):.2f}")
