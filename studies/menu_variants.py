"""Why the budget mode loses to h2o on some texts: its menu and its profiling, varied one at a time.

FastGen's budget mode and the fixed `h2o` differ in three ways: the menu (the
paper's shortlist and five families of shapes at seven sizes, against h2o's
one shape), the profile (heavy-hitter scores and recoveries from the last 32
prompt rows with a span of 16, against every row with a span of 1), and the
allocation (a knapsack over heads, against the same share for every head).
Each variant here changes some of them, on the windows and the scoring of
`studies.evaluate` (KL and top-1 against the full cache, teacher-forced):

    python -m studies.menu_variants --text usenet --variants default h2o h2o:w=0/score=sum/span=1

A variant is MENU[:OPTIONS]: MENU one of `default` (the budget mode's menu),
`no-local` (without the Local and Sink shapes), `h2o` (h2o's shape at the
menu's seven sizes), `h2o-floor` and `default-floor` (sizes of 0.2 and up
only); OPTIONS `/`-separated `w=ROWS` (0: every row), `score=mean|sum`,
`span=N`, `v=0|1` (attention weighed by value norms, `--weigh-values`), and a
profile of the study's own: `mix=ROWS` (with w=0) mixes every row's profile
with the last ROWS rows' (`mixed_profile`, attention alone). Prints a
line per variant and budget and writes OUT.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch

import cache as fastgen_cache
import generation
import policies
from profiling import Profile, attention_sums, carried, weigh
from studies import evaluate
from studies.evaluate import Config

FLOOR = (0.2, 0.3, 0.45, 0.6, 0.8)


def menu_of(name: str):
    """A stand-in for policies.menu with the same parameters."""
    def menu(r_local=0.3, r_frequent=0.3, by="mean", ratios=policies.RATIOS):
        sizes = FLOOR if name.endswith("-floor") else ratios
        if name in ("default", "default-floor"):
            return policies.menu(r_local, r_frequent, by, sizes)
        if name == "no-local":
            shapes = [policies.baseline(k, r, by) for k in ("h2o", "tova", "snapkv") for r in sizes]
            return list(dict.fromkeys(policies.shortlist(r_local, r_frequent, by)[:-1] + shapes))
        if name in ("h2o", "h2o-floor"):
            return [policies.baseline("h2o", r, by) for r in sizes]
        raise ValueError(f"unknown menu {name!r}: default, default-floor, no-local, h2o, h2o-floor")
    return menu


def options(spec: str) -> dict:
    """`w=0/score=sum/span=1` -> CacheOptions fields."""
    out = {}
    for item in filter(None, spec.split("/")):
        key, _, value = item.partition("=")
        field = dict(w="obs_window", score="hh_score", span="span", v="weigh_values",
                     mix="mix").get(key)
        ok = (value in ("mean", "sum") if field == "hh_score" else value in ("0", "1")
              if field == "weigh_values" else value.isdigit())
        if field is None or not ok:
            raise ValueError(f"bad option {item!r}: w=ROWS (0: every row), score=mean|sum, "
                             "span=N, v=0|1, mix=ROWS, N a whole number")
        out[field] = (value if field == "hh_score" else bool(int(value)) if field == "weigh_values"
                      else int(value))
    return out


@dataclass
class Mixed(Profile):
    score: torch.Tensor | None = None  # (S, T) the slots' scores, when not the column sums


@contextmanager
def mixed_profile(rows: int, span: int = generation.SPAN):
    """While it lasts, a cache that profiles every row (w=0) profiles twice and
    mixes: half of every row's attention, half of the last `rows` rows' scaled
    to as many rows, its scores carried `span` tokens on (profiling.carried)."""
    decide, slots = fastgen_cache.decide, fastgen_cache.prompt_slots

    def mixed(caches):
        inner = fastgen_cache.profile_layers
        first = caches[0]

        def both(cs):
            a = inner(cs)
            q, k = (torch.cat([c.held[i] for c in cs]) for i in (0, 1))
            w = attention_sums(q, k, first.prompt_lens.repeat(len(cs)),
                               fastgen_cache.banded(first.policies), rows)
            f = (a.rows / w.rows)[:, None]
            mix = lambda x, y: 0.5 * (x + f * y)  # noqa: E731
            return Mixed(mix(a.colsum, w.colsum), {r: mix(b, w.bands[r]) for r, b in
                                                   a.bands.items()}, a.rows, a.last,
                         mix(a.colsum, carried(w.colsum, span)))
        with mock.patch.object(fastgen_cache, "profile_layers", both):
            decide(caches)

    def scored(sums, *a, **kw):
        s = slots(sums, *a, **kw)
        return replace(s, score=sums.score) if isinstance(sums, Mixed) else s
    with mock.patch.object(fastgen_cache, "decide", mixed), \
            mock.patch.object(fastgen_cache, "prompt_slots", scored):
        yield


@torch.no_grad()
def value_norms(model, texts, rows: int = 32) -> dict:
    """Why weighing attention by value norms changes the choice: per layer, the
    first token's value norm over the mean of the others' (the median over
    layers), and its share of the last `rows` rows' attention, plain and
    weighed (profiling.weigh), averaged over layers, windows and KV heads."""
    rec = evaluate.record(model, texts)
    recorders, lens = rec[0], rec[3]
    ratio, plain, weighed = [], [], []
    for r in recorders:
        q, k, v = r.qkv
        sums = attention_sums(q, k, lens, (), rows)
        norms = v.float().norm(dim=-1)  # (B, K, T)
        ratio.append(float((norms[..., 0] / norms[..., 1:].mean(-1)).mean()))
        for got, into in ((sums, plain), (weigh(sums, v), weighed)):
            into.append(float((got.colsum[:, 0] / got.colsum.sum(1)).mean()))
    return dict(first_norm_ratio_by_layer=[round(x, 3) for x in ratio],
                first_norm_ratio_median=round(statistics.median(ratio), 3),
                first_share_plain=round(sum(plain) / len(plain), 3),
                first_share_weighed=round(sum(weighed) / len(weighed), 3))


def main(*, text="usenet", variants=("default",), budgets=(0.25, 0.5), windows=12,
         prompt_len=768, new_tokens=64, threads=1, out="results/evaluate/menu_variants",
         ckpt=None, norms: bool = False) -> dict:
    from generation import flags_of, load
    from studies.textdata import prompts
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, tok = load(ckpt)
    flags = flags_of(model, tok)
    texts = prompts(tok, windows, prompt_len + new_tokens, prompt_len + new_tokens, 0, text)
    if norms:
        got = value_norms(model, [t[:prompt_len] for t in texts])
        print(json.dumps(got))
        return got
    rows = {}
    fixed = [Config("full", "full", {})] + [Config(f"h2o b={b:g}", "h2o", {"kv_budget": b})
                                            for b in budgets]
    rows |= evaluate.text_quality(model, texts, new_tokens, fixed, flags, windows, 0.3, 0.3)
    menu = generation.menu
    try:
        for v in variants:
            name, _, spec = v.partition(":")
            generation.menu = menu_of(name)  # what make_caches builds the budget mode from
            opts = options(spec)
            mix = opts.pop("mix", 0)
            if mix:  # of attention alone: profiling.weigh would drop its scores
                opts["weigh_values"] = False
            cfgs = [Config("full", "full", {})] + [
                Config(f"fastgen[{v}] b={b:g}", "fastgen", {"kv_budget": b, **opts})
                for b in budgets]
            with mixed_profile(mix) if mix else nullcontext():
                got = evaluate.text_quality(model, texts, new_tokens, cfgs, flags, windows,
                                            0.3, 0.3)
            rows |= {n: r for n, r in got.items() if n != "full"}
    finally:
        generation.menu = menu
    for n, r in rows.items():
        print(f"{text} {n:40s} share {r['share']:.3f}  KL {r['kl']:.4f}  top-1 {r['top1']:.3f}")
    meta = dict(text=text, windows=windows, prompt_len=prompt_len, new_tokens=new_tokens,
                machine=evaluate.machine(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), runtime_s=round(time.perf_counter() - t0))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m studies.menu_variants", description=__doc__.split(
        "\n")[0], epilog="Variants: MENU[:OPTIONS], see the module's docstring.")
    p.add_argument("--ckpt", help="checkpoint folder (default SmolLM2-135M-Instruct)")
    p.add_argument("--text", default="usenet", choices=evaluate.SOURCES, help="real text (usenet)")
    p.add_argument("--variants", nargs="+", default=["default"], help="MENU[:w=ROWS/score=mean|"
                   "sum/span=N/v=0|1/mix=ROWS]; MENU: default, default-floor, no-local, h2o, "
                   "h2o-floor")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5], help="(0.25 0.5)")
    p.add_argument("--windows", type=int, default=12, help="text windows (12)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--out", default="results/evaluate/menu_variants", help="OUT.json")
    p.add_argument("--norms", action="store_true", help="instead, print how the first token's "
                   "value norm compares with the others' and its share of the attention, plain "
                   "and weighed by value norms, per layer (`value_norms`)")
    a = p.parse_args(argv)
    for v in a.variants:  # a bad variant is a usage error, not a traceback an hour later
        name, _, spec = v.partition(":")
        try:
            menu_of(name)()
            options(spec)
        except ValueError as e:
            p.error(str(e))
    return a


if __name__ == "__main__":
    main(**vars(parse_args()))
