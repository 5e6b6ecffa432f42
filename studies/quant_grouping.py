"""How to group the numbers that share a scale, measured on the model's own keys and values.

For windows of real text, the exact prefill's keys and values of every layer
are quantized each way, and the last `rows` queries of the prompt (what
profiling reads) attend over them. Reported per way, averaged over layers,
heads, rows and windows:

- key error: half the L1 distance between the attention rows with exact and
  quantized keys (the attention mass that moved, 0 to 1);
- value error: |A (V_q - V)| / |A V|, with the exact attention A;
- output error: the attention output with both quantized, relative to the exact one;
- bytes per token of one head's key and value, codes and scales.

Ways: per token, groups of 16, 32 or 64 numbers along the head dimension;
per channel, groups of 32 tokens for each channel, for keys and values or, as
KIVI does, for keys only (values per token); each key channel scaled before
rounding per token; every key and value rotated by a fixed orthonormal
matrix first (Hadamard or random, as rotation methods such as QuaRot spread
outlier channels); keys scaled, then rotated, with values rotated (what the
pool stores); and with the last 16 to 128 tokens of the window kept in
16 bits, as KIVI and HF transformers' quantized cache keep their newest
tokens (bytes then averaged over the window).

    python -m studies.quant_grouping --out results/quant/grouping
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from quant import dequantize, quantize
from studies import output


def per_token(x, bits, group):
    return dequantize(*quantize(x, bits, group), bits)


def factors(x, alpha=0.5):
    """Each channel's largest magnitude over the prompt to the power alpha: one factor per
    channel and head, kept at full precision."""
    return x.abs().amax(-2, keepdim=True).clamp(min=1e-6) ** alpha


def smoothed(x, bits, group, alpha=0.5):
    """Per token, after dividing each channel by its `factors`: keys have a few channels
    far larger than the rest."""
    c = factors(x, alpha)
    return per_token(x / c, bits, group) * c


def hadamard(D: int) -> torch.Tensor:
    """A (D, D) orthonormal Hadamard matrix (D a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(D)


def random_rotation(D: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(D, D, generator=g))[0]


def rotated(x, bits, group, rotation="hadamard"):
    """Per token, after rotating every vector by a fixed orthonormal matrix R
    (rounded x R, read back times R^T): outlier channels spread over all."""
    r = hadamard(x.shape[-1]) if rotation == "hadamard" else random_rotation(x.shape[-1])
    return per_token(x @ r, bits, group) @ r.T


def symmetric(x, bits, group):
    """Per token, a scale and no minimum: 2**bits levels, symmetric about zero (midrise)."""
    *lead, D = x.shape
    g = x.float().reshape(*lead, D // group, group)
    half = ((1 << bits) - 1) / 2
    scale = (g.abs().amax(-1, keepdim=True) / half).half().float().clamp(min=1e-8)
    return ((g / scale + half).round().clamp(0, 2 * half) - half).mul(scale).reshape(x.shape)


def lloyd(u, levels: int = 16, iters: int = 40) -> torch.Tensor:
    """A codebook for values in [0, 1], its ends fixed at 0 and 1 (a group's minimum and
    maximum), its inner levels moved to the mean of what they round (Lloyd's algorithm)."""
    c = torch.linspace(0, 1, levels)
    for _ in range(iters):
        at = torch.bucketize(u, (c[1:] + c[:-1]) / 2)
        sums = torch.zeros(levels).index_add_(0, at, u)
        n = torch.zeros(levels).index_add_(0, at, torch.ones_like(u))
        c[1:-1] = torch.where(n[1:-1] > 0, sums[1:-1] / n[1:-1].clamp(min=1), c[1:-1])
        c = c.sort().values
    return c


def codebook(x, group, book):
    """Per token, min-max groups whose codes index `book` (levels in [0, 1]), not even steps."""
    *lead, D = x.shape
    g = x.float().reshape(*lead, D // group, group)
    low = g.amin(-1, keepdim=True).half().float()
    span = (g.amax(-1, keepdim=True) - low).half().float().clamp(min=1e-8)
    at = torch.bucketize((g - low) / span, (book[1:] + book[:-1]) / 2)
    return (book[at] * span + low).reshape(x.shape)


def unit_values(x, group):
    """x's numbers as (x - min) / (max - min) of their groups, flat."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    low = g.amin(-1, keepdim=True)
    return ((g - low) / (g.amax(-1, keepdim=True) - low).clamp(min=1e-8)).flatten()


def as_pool(fn, signs=None):
    """(keys, values) rounding as the pool stores them (keys' channels scaled, both rotated),
    with fn rounding the rotated numbers; signs: random signs before the Hadamard matrix."""
    def turn(D):
        h = hadamard(D)
        return h if signs is None else signs[:, None] * h

    def keys(x, bits, g):
        c, r = factors(x), turn(x.shape[-1])
        return fn((x / c) @ r, bits, g) @ r.T * c

    def values(x, bits, g):
        r = turn(x.shape[-1])
        return fn(x @ r, bits, g) @ r.T
    return keys, values


def per_channel(x, bits, tokens):
    """Groups of `tokens` consecutive tokens for each channel: x (..., T, D)."""
    T = x.shape[-2]
    pad = -T % tokens
    y = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], -2) if pad else x
    y = y.transpose(-1, -2)  # (..., D, T)
    return per_token(y, bits, tokens).transpose(-1, -2)[..., :T, :]


def errors(q, k, v, kq, vq, rows: int):
    """Key, value and output errors of one layer, q (B, H, T, D), k v (B, K, T, D)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k, v, kq, vq = (t.repeat_interleave(G, 1) for t in (k, v, kq, vq))
    qr = q[:, :, T - rows:]
    future = torch.arange(T) > torch.arange(T - rows, T)[:, None]  # (rows, T)
    a = (qr @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(future, -math.inf).softmax(-1)
    aq = (qr @ kq.transpose(-1, -2) / math.sqrt(D)).masked_fill(future, -math.inf).softmax(-1)
    y = a @ v
    norm = y.norm(dim=-1)
    return dict(key=float((a - aq).abs().sum(-1).mean() / 2),
                value=float(((a @ vq - y).norm(dim=-1) / norm).mean()),
                output=float(((aq @ vq - y).norm(dim=-1) / norm).mean()))


# Formats at 4 bits, as the pool stores keys and values, with the newest 32 in 16 bits: the
# pool's (80 bytes a token and head, 84 with its position) against cheaper ones (72-76 bytes:
# 0.34 of a 16-bit cache's bytes at 832 tokens, HF's KIVI-style int4's).
FORMAT_BYTES = {"min-max, groups of 32 (the pool's)": 80, "min-max, groups of 64": 72,
                "symmetric (scale only), groups of 32": 72,
                "keys min-max, values symmetric, groups of 32": 76,
                "min-max, groups of 32, random signs before the rotation": 80,
                "min-max, groups of 32, a fitted codebook": 80,
                "min-max, groups of 64, a fitted codebook": 72}


def pool_formats(recorders, D: int) -> dict:
    """FORMAT_BYTES' ways; the codebooks fitted (Lloyd) on a sample of these windows' own
    rotated keys and values, so an optimistic bound."""
    gen = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(D, generator=gen) < 0.5, -1.0, 1.0)
    book = {}
    kv = [(r.qkv[1].float(), r.qkv[2].float()) for r in recorders[::3]]
    turned = [x @ hadamard(D) for k, v in kv for x in (k / factors(k), v)]  # as the pool rounds
    for g in (32, 64):
        u = torch.cat([unit_values(x, g) for x in turned])
        book[g] = lloyd(u[torch.randperm(len(u), generator=gen)[:2_000_000]])
    minmax, sym = as_pool(per_token), as_pool(symmetric)
    names = list(FORMAT_BYTES)
    return {names[0]: (*minmax, 32, 32), names[1]: (*minmax, 64, 32), names[2]: (*sym, 32, 32),
            names[3]: (minmax[0], sym[1], 32, 32),
            names[4]: (*as_pool(per_token, signs), 32, 32),
            names[5]: (*as_pool(lambda x, b, g: codebook(x, g, book[32])), 32, 32),
            names[6]: (*as_pool(lambda x, b, g: codebook(x, g, book[64])), 64, 32)}


def main(*, out: str = "results/quant/grouping", windows: int = 4, prompt_len: int = 768,
         rows: int = 32, text: str = "pydoc", quick: bool = False, formats: bool = False) -> dict:
    from convert_gguf import default_checkpoint
    from model import load_model
    from quant import token_bytes
    from studies.evaluate import machine, record
    from studies.textdata import prompts
    from tokenizer import Tokenizer
    t0 = time.perf_counter()
    ckpt = default_checkpoint()
    model, tok = load_model(ckpt), Tokenizer(ckpt)
    if quick:
        windows, prompt_len, rows = 1, 64, 8
    texts = prompts(tok, windows, prompt_len, prompt_len, 0, text)
    D = model.args.head_dim
    # name: (key rounding, value rounding, group, newest tokens kept in 16 bits)
    ways = {f"per token, groups of {g}": (per_token, per_token, g, 0) for g in (16, 32, 64)}
    ways["per channel, 32 tokens, keys and values"] = (per_channel, per_channel, 32, 0)
    ways["KIVI: keys per channel (32 tokens), values per token (32)"] = (
        per_channel, per_token, 32, 0)
    for alpha in (0.5, 1.0):
        ways[f"per token, groups of 32, channels scaled (alpha {alpha})"] = (
            lambda x, b, g, a=alpha: smoothed(x, b, g, a), per_token, 32, 0)
    ways["per token, groups of 32, channels scaled (alpha 0.5), newest 128 in 16 bits"] = (
        smoothed, per_token, 32, 128)
    ways["KIVI, newest 128 in 16 bits"] = (per_channel, per_token, 32, 128)
    for g in (32, 64):
        ways[f"rotated (Hadamard), keys and values, groups of {g}"] = (rotated, rotated, g, 0)
        ways[f"rotated (random), keys and values, groups of {g}"] = (
            lambda x, b, g: rotated(x, b, g, "random"),) * 2 + (g, 0)
    ways["rotated (Hadamard) keys, values per token, groups of 32"] = (rotated, per_token, 32, 0)
    for w in (16, 32, 64):
        ways[f"rotated (Hadamard), groups of 32, newest {w} in 16 bits"] = (rotated, rotated, 32, w)
        ways[f"per token, groups of 32, channels scaled (alpha 0.5), newest {w} in 16 bits"] = (
            smoothed, per_token, 32, w)
    for w in (0, 32):  # the pool's: keys scaled then rotated, values rotated
        ways["keys scaled then rotated, values rotated, groups of 32"
             + (f", newest {w} in 16 bits" if w else "")] = (*as_pool(per_token), 32, w)
    bits_list, sizes = (8, 4, 2), {}
    table = {}
    with torch.no_grad():
        recorders = record(model, texts)[0]
        if formats:
            ways, sizes, bits_list = pool_formats(recorders, D), FORMAT_BYTES, (4,)
        for name, (kfn, vfn, g, exact) in ways.items():
            exact = min(exact, prompt_len // 2)

            def kept(fn, x, bits):  # rounded, but for the newest `exact` tokens
                y = fn(x, bits, g)
                y[..., y.shape[-2] - exact:, :] = x[..., x.shape[-2] - exact:, :]
                return y
            for bits in bits_list:
                sums = dict(key=0.0, value=0.0, output=0.0)
                for r in recorders:
                    q, k, v = (t.float() for t in r.qkv)
                    e = errors(q, k, v, kept(kfn, k, bits), kept(vfn, v, bits), rows)
                    sums = {n: sums[n] + e[n] / len(recorders) for n in sums}
                per = sizes.get(name, token_bytes(bits, D, g))
                per = round((per * (prompt_len - exact) + token_bytes(16, D) * exact) / prompt_len)
                table[f"{name}, {bits} bits"] = dict(bytes=per, **sums)
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=machine(), windows=windows,
                prompt_len=prompt_len, rows=rows, text=text,
                runtime_s=round(time.perf_counter() - t0, 1))
    lines = [f"# Grouping of quantized keys and values ({meta['date']}, {meta['machine']})\n",
             f"{windows} windows of {prompt_len} tokens of {text}, the last {rows} queries; "
             f"runtime {meta['runtime_s']} s. `python -m studies.quant_grouping "
             f"{' '.join(sys.argv[1:])}`\n",
             f"Bytes: one token's key and value in one head (16 bits: {token_bytes(16, D)}).\n",
             "| grouping | bytes | key error | value error | output error |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {r['bytes']} | {r['key']:.4f} | {r['value']:.4f} | {r['output']:.4f} |"
              for n, r in table.items()]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    output(path, ".md").write_text("\n".join(lines) + "\n")
    output(path, ".json").write_text(json.dumps(dict(meta=meta, rows=table), indent=1))
    print("\n".join(lines))
    return table


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/quant/grouping", help="OUT.md and OUT.json")
    p.add_argument("--windows", type=int, default=4, help="windows of text")
    p.add_argument("--prompt-len", type=int, default=768, help="tokens per window")
    p.add_argument("--rows", type=int, default=32, help="last queries that attend")
    p.add_argument("--text", default="pydoc", help="pydoc, news or usenet")
    p.add_argument("--quick", action="store_true", help="one short window, for the tests")
    p.add_argument("--formats", action="store_true", help="4-bit formats at fewer bytes than "
                   "the pool's, stored as it stores them (FORMAT_BYTES), instead of the groupings")
    a = p.parse_args()
    main(out=a.out, windows=a.windows, prompt_len=a.prompt_len, rows=a.rows, text=a.text,
         quick=a.quick, formats=a.formats)
