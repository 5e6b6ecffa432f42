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
`no-local` (without the Local and Sink shapes), `no-sink` (without the
Sink shapes, StreamingLLM's), `no-tova` (without TOVA),
`h2o` (h2o's shape at the menu's seven sizes), `h2o-floor` and
`default-floor` (sizes of 0.2 and up only). OPTIONS, `/`-separated: the
cache's own `w=ROWS` (0: every row), `score=mean|sum`, `hh=window|every`
(`--hh-rows`), `span=N`, `v=0|1`
(attention weighed by value norms, `--weigh-values`),
`obj=squared|linear` (the knapsack's `--objective`), `scope=layer|model|N`
(`--budget-scope`); and the study's own
estimates: `mix=ROWS` (with w=0, every row's profile mixed with the last
ROWS rows', `mixed_profile`), `center=1` (weighed by |v - o|, `centered`),
`scale=1` (heads priced by their values' size, `head_scale`),
`both=min|mean|local` (recoveries from the last 32 rows' profile and every
row's, `every_row_recoveries`), `local=F` (the shapes with a Local window
promised F times their loss, `local_loss`), `rank=every` (heavy hitters
ranked by every row's attention, recoveries from the last 32 rows',
`every_row_ranks`; with `stride=N`, every N-th row's; `rank=max`, the
larger of every row's and the last rows' attention per query). Prints a line per variant and
budget and writes OUT.json. `--heads` compares, head by head, what the prompt's profile
promised with what decoding needed (`hindsight`). `--per-window` scores each
window apart and adds, per budget, the mean over windows of the best FastGen
variant's KL: an oracle, the most that choosing a variant per prompt could gain.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch
from tqdm import tqdm

import cache as fastgen_cache
import generation
import policies
from policies import Slots
from profiling import (Profile, attention_sums, carried, local_ratios, recoveries,
                       squared_losses, weigh)
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
        if name == "no-sink":  # without StreamingLLM's shape, Sink | Local
            return [p for p in policies.menu(r_local, r_frequent, by, sizes)
                    if {type(m) for m in p.members()} != {policies.Sink, policies.Local}]
        if name == "no-tova":
            return [p for p in policies.menu(r_local, r_frequent, by, sizes)
                    if not isinstance(p, policies.TOVA)]
        if name in ("h2o", "h2o-floor"):
            return [policies.baseline("h2o", r, by) for r in sizes]
        raise ValueError(f"unknown menu {name!r}: default, default-floor, no-local, no-sink, "
                         "no-tova, h2o, h2o-floor")
    return menu


def valid_scope(value: str) -> bool:
    try:
        generation.scope_of(value)
        return True
    except ValueError:
        return False


def options(spec: str) -> dict:
    """`w=0/score=sum/span=1` -> CacheOptions fields."""
    out = {}
    for item in filter(None, spec.split("/")):
        key, _, value = item.partition("=")
        field = dict(w="obs_window", score="hh_score", span="span", v="weigh_values",
                     mix="mix", obj="objective", center="center",
                     scale="scale", both="both", local="local_loss",
                     scope="budget_scope", rank="rank", stride="stride", hh="hh_rows").get(key)
        words = dict(hh_score=("mean", "sum"), both=("min", "mean", "local"),
                     budget_scope=("layer", "model"), rank=("every", "max"),
                     hh_rows=("window", "every", "both"),
                     objective=("linear", "squared"), weigh_values=("0", "1"))
        ok = (value in words[field] or field == "budget_scope" and valid_scope(value)
              if field in words
              else value.replace(".", "", 1).isdigit() if field == "local_loss"
              else value.isdigit())
        if field is None or not ok:
            raise ValueError(f"bad option {item!r}: w=ROWS (0: every row), score=mean|sum, "
                             "span=N, v=0|1, obj=squared|linear, mix=ROWS, center=0|1, "
                             "scale=0|1, both=min|mean|local, local=F, scope=layer|model|N, "
                             "rank=every|max, stride=N, hh=window|every|both, "
                             "N a whole number, F a number")
        out[field] = (bool(int(value)) if field == "weigh_values" else value if field in words
                      else float(value) if field == "local_loss" else int(value))
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


def off_mean(sums: Profile, v) -> torch.Tensor:
    """v (B, K, T, D) less each head's mean output over the rows read, o =
    sum_j colsum_j v_j / sum_j colsum_j."""
    w = sums.colsum.view(*v.shape[:3], 1)
    return v.float() - (w * v.float()).sum(2, keepdim=True) / w.sum(2, keepdim=True)


def centered(sums: Profile, v) -> Profile:
    """`profiling.weigh` by |v_j - o|, o the head's mean output over the rows
    read, rather than |v_j|: dropping token j moves the renormalized output by
    a_j (v_j - o) / recovered, so a token whose value is the output's own costs
    nothing, and the sink (a small value) costs its attention times |o|."""
    return weigh(sums, off_mean(sums, v))


@contextmanager
def head_scale(center: bool):
    """While it lasts, a head's recovery counts in the knapsack by what its
    output stands to lose: the attention lost is scaled by the head's mean
    weight |v_j| (|v_j - o| with `center`) over the attention read, relative
    to the mean over the heads of the layers deciding together, where
    `profiling.weigh` normalizes every head to the same mass."""
    def scaled_weigh(sums, v):
        w = (off_mean(sums, v) if center else v.float()).norm(dim=-1).flatten(0, 1)
        m = (sums.colsum * w).sum(1) / sums.colsum.sum(1).clamp(min=1e-12)
        got = (centered if center else weigh)(sums, v)
        got.scale = m / m.mean()
        return got

    def scaled_recoveries(policies_, prompt, prof, sink=True):
        r = recoveries(policies_, prompt, prof, sink)
        scale = getattr(prof, "scale", None)
        return r if scale is None else 1 - scale[:, None] * (1 - r)
    with mock.patch.object(fastgen_cache, "weigh", scaled_weigh), \
            mock.patch.object(fastgen_cache, "recoveries", scaled_recoveries):
        yield


def with_local(policies_, device=None) -> torch.Tensor:
    """(M,) which policies keep a Local window."""
    return torch.tensor([any(isinstance(m, policies.Local) for m in p.members())
                         for p in policies_], device=device)


@contextmanager
def local_loss(factor: float):
    """While it lasts, the shapes with a Local window are promised `factor`
    times the loss their recoveries say, 1 - factor (1 - r): a calibration for
    what the prompt's last rows promise them against what decoding gets
    (`hindsight`: they lose 2.1 to 3.1 times what they were promised where
    TOVA loses 1.3 to 1.8 times, on both texts)."""
    def rec(policies_, prompt, prof, sink=True):
        r = recoveries(policies_, prompt, prof, sink)
        return torch.where(with_local(policies_, r.device), 1 - factor * (1 - r), r)
    with mock.patch.object(fastgen_cache, "recoveries", rec):
        yield


def output_errors(model, recorders, keeps, P: int, rows: int | None = None,
                  skip: int = 0) -> torch.Tensor:
    """How far each keep of the prompt, keeps (M, L * S, P), moves the
    attention outputs of some query rows through the layer's output
    projection: the squared change summed over the rows and each segment's
    query heads, (M, L * S). The rows: every one after the prompt's P but the
    first `skip`, all new tokens kept (None), or the prompt's last `rows`,
    over the prompt."""
    out, L = [], len(recorders)
    for layer, r, kp in zip(model.layers, recorders, keeps.unflatten(1, (L, -1)).unbind(1)):
        q, k, v = (x.float() for x in r.qkv)
        end = q.shape[2] if rows is None else P
        first = P + skip if rows is None else P - rows
        B, H, _, D = q.shape
        K = k.shape[1]
        G = H // K
        k, v = k[:, :, :end], v[:, :, :end]
        a = (q[:, :, first:end].reshape(B, K, G, end - first, D)
             @ k.transpose(-1, -2)[:, :, None]) / math.sqrt(D)  # (B, K, G, N, end)
        causal = torch.arange(end)[None] <= torch.arange(first, end)[:, None]
        a = a.masked_fill(~causal, -math.inf).softmax(-1)
        wo = layer.attention.wo.weight.float().view(-1, K, G, D)  # (dim, K, G, D)
        errs = []
        for m in kp:  # (S, P): one keep per segment
            mask = torch.cat([m.view(B, K, P), m.new_ones(B, K, end - P)], -1)
            kept = a * mask[:, :, None, None]
            kept = kept / kept.sum(-1, keepdim=True).clamp(min=1e-12)
            diff = torch.einsum("bkgnd,ekgd->bkgne", (kept - a) @ v[:, :, None], wo)
            errs.append(diff.pow(2).sum((-1, -2, -3)).flatten())
        out.append(torch.stack(errs))
    return torch.cat(out, 1)


@contextmanager
def every_row_recoveries(how: str, rows: int = 32):
    """While it lasts, a cache that profiles every row (w=0) keeps the last
    `rows` rows' profile for its scores and keeps (as the default), and
    estimates each policy's recovery from both profiles, weighed: their `min`
    (a policy must serve the whole prompt's rows and the last ones), `mean`,
    or the min for the shapes with a Local window alone (`local`)."""
    stash = {}
    inner_profile, inner_rec = fastgen_cache.profile_layers, fastgen_cache.recoveries

    def profile(caches):
        every = inner_profile(caches)
        q, k, v = (torch.cat([c.held[i] for c in caches]) for i in range(3))
        first = caches[0]
        window = attention_sums(q, k, first.prompt_lens.repeat(len(caches)),
                                fastgen_cache.banded(first.policies), rows)
        stash["every"] = weigh(every, v) if first.weigh_values else every
        return window

    def rec(policies_, prompt, prof, sink=True):
        a = inner_rec(policies_, prompt, prof, sink)
        b = inner_rec(policies_, prompt, stash["every"], sink)
        if how == "local":  # the smaller only for the shapes with a Local window
            return torch.where(with_local(policies_, a.device), torch.minimum(a, b), a)
        return torch.minimum(a, b) if how == "min" else (a + b) / 2
    decide = fastgen_cache.decide

    def deciding(caches):  # inside evaluate's from_record, which patches profile_layers
        nonlocal inner_profile
        inner_profile = fastgen_cache.profile_layers
        with mock.patch.object(fastgen_cache, "profile_layers", profile):
            decide(caches)
    with mock.patch.object(fastgen_cache, "decide", deciding), \
            mock.patch.object(fastgen_cache, "recoveries", rec):
        yield


def strided_colsum(q, k, lens, stride: int) -> torch.Tensor:
    """(B * K, T) the attention every `stride`-th prompt row gave each token
    (the last row and every stride-th before it), averaged over each KV head's
    query heads: every row's sums, read on a sample. Dense: for short prompts."""
    B, H, T, D = q.shape
    K = k.shape[1]
    r = torch.arange(T, device=q.device)
    pick = ((lens[:, None] - 1 - r) % stride == 0) & (r < lens[:, None])  # (B, T) rows read
    kt = k.float().transpose(-1, -2)[:, :, None]  # (B, K, 1, D, T)
    a = (q.float().view(B, K, H // K, T, D) @ kt) / math.sqrt(D)
    a = a.masked_fill(r[None] > r[:, None], -math.inf).softmax(-1)  # (B, K, G, T, T)
    return (a * pick[:, None, None, :, None]).sum(3).mean(2).flatten(0, 1)


@contextmanager
def every_row_ranks(rows: int = 32, stride: int = 1, how: str = "every"):
    """While it lasts, a cache that profiles every row (w=0) ranks heavy hitters
    by every row's attention (per query since the token came, no span), as
    `h2o` ranks them, while the knapsack's recoveries come from the last `rows`
    rows, as the default's do. A continuation often names again what the
    prompt named hundreds of tokens before (a subject, a header's name), which
    every row attended to and the last rows did not. `stride` > 1: every
    stride-th row only (`strided_colsum`), a sample of every row's sums.
    `how="max"`: a token's attention per query is the larger of every row's
    and the last rows' (carried `span` tokens on, as the default ranks)."""
    decide, slots = fastgen_cache.decide, fastgen_cache.prompt_slots

    def deciding(caches):  # inside evaluate's from_record, which patches profile_layers
        inner, first = fastgen_cache.profile_layers, caches[0]

        def profile(cs):
            every = inner(cs)
            q, k, v = (torch.cat([c.held[i] for c in cs]) for i in range(3))
            w = attention_sums(q, k, first.prompt_lens.repeat(len(cs)),
                               fastgen_cache.banded(first.policies), rows)
            w = weigh(w, v) if first.weigh_values else w
            score = every.colsum
            if stride > 1:
                lens = first.prompt_lens.repeat(len(cs))
                sampled = Profile(strided_colsum(q, k, lens, stride), {}, w.rows, w.last)
                score = (weigh(sampled, v) if first.weigh_values else sampled).colsum
            if how == "max":  # per query since the token came, against the window's per row
                lens = first.prompt_lens.repeat(len(cs)).repeat_interleave(k.shape[1])[:, None]
                pos = torch.arange(score.shape[1], device=score.device)
                n_all = (lens - pos).clamp(min=1)
                n_win = (lens - torch.maximum(pos, lens - w.rows[:, None].long())).clamp(min=1)
                window = carried(w.colsum, first.span) / n_win
                score = torch.maximum(score / n_all, window) * n_all
            return Mixed(w.colsum, w.bands, w.rows, w.last, score)
        with mock.patch.object(fastgen_cache, "profile_layers", profile):
            decide(caches)

    def scored(sums, *a, **kw):
        s = slots(sums, *a, **kw)
        if isinstance(sums, Mixed):  # every row read: the mean per query since the token came
            s = replace(s, score=sums.score, first_query=torch.zeros_like(s.first_query))
        return s
    with mock.patch.object(fastgen_cache, "decide", deciding), \
            mock.patch.object(fastgen_cache, "prompt_slots", scored):
        yield


def plan_of(model, prompts, options, flags, new_tokens: int) -> dict:
    """How `options`' caches compress `prompts`, as `cache.decide` leaves it:
    the prompt's slots (L * S, P), each segment's policy, the recoveries the
    knapsack was given and its costs and budgets, every policy's keep."""
    seen = dict(prompt=[], choice=[], est=[], costs=[], budgets=[])
    inner_compress, inner_fit = fastgen_cache.compress, fastgen_cache.fit_budgets

    def compress(caches, prompt, keeps, growth):
        seen["prompt"].append(prompt)
        seen["choice"] += [c.choice for c in caches]
        seen["est"] += [c.recovery for c in caches if c.recovery is not None]
        seen["policies"] = caches[0].policies
        return inner_compress(caches, prompt, keeps, growth)

    def fit(values, costs, budgets, **kw):
        seen["costs"].append(costs)
        seen["budgets"] += budgets
        return inner_fit(values, costs, budgets, **kw)
    with mock.patch.object(fastgen_cache, "compress", compress), \
            mock.patch.object(fastgen_cache, "fit_budgets", fit):
        rec = evaluate.record(model, prompts)
        caches = generation.make_caches(model, options, rec[3].tolist(), new_tokens, flags)
        for c, r in zip(caches, rec[0]):
            c(*r.qkv, rec[2], rec[1])
    parts = seen["prompt"]
    seen["prompt"] = Slots(*[None if getattr(parts[0], n) is None else
                             torch.cat([getattr(x, n) for x in parts])
                             for n in ("pos", "score", "flags", "seen", "prompt_len",
                                       "first_query", "last")])
    for key in ("choice", "est", "costs"):
        seen[key] = torch.cat(seen[key]) if seen[key] else None
    seen["keeps"] = torch.stack([seen["prompt"].keeps(p) for p in seen["policies"]])
    return seen


BACK = 64  # the prompt rows a backtest reads
# The plans `hindsight` compares are each layer's knapsacks (one per layer and
# sequence), which it solves again with other values.
LAYER = dict(budget_scope="layer")


def later_rows(recorders, end: int, rows: int, upto: int, ratios) -> Profile:
    """What the `rows` rows before `end` read of the keys before `upto`, every
    layer's segments stacked, weighed by value norms as the cache weighs, and
    counted against that attention alone (what a keep made at `upto` could
    recover; the tokens after it are all kept)."""
    parts = []
    for r in recorders:
        q, k, v = (x[:, :, :end] for x in r.qkv)
        s = attention_sums(q, k, torch.full((q.shape[0],), end), ratios, rows)
        cut = weigh(Profile(s.colsum[:, :upto], {x: b[:, :upto] for x, b in s.bands.items()},
                            s.rows, s.last[:, :upto]), v[:, :, :upto])
        cut.rows = cut.colsum.sum(1)
        parts.append(cut)
    return Profile(torch.cat([d.colsum for d in parts]),
                   {x: torch.cat([d.bands[x] for d in parts]) for x in ratios},
                   torch.cat([d.rows for d in parts]), torch.cat([d.last for d in parts]))


@torch.no_grad()
def hindsight(model, texts, flags, new_tokens: int, budgets) -> dict:
    """What the prompt's profile promised against what decoding needed, head by
    head. For FastGen's plans (its knapsack's two objectives) and `h2o`'s, each
    segment's recovery of its policy's prompt keep as profiling estimated it
    and as the next `new_tokens` queries of the true text read the prompt
    (weighed by value norms as the cache weighs; Local windows moving with the
    rows), and what the keep moves the attention outputs of those queries by
    through the output projection (`output_errors`, every new token kept).
    Beside them, the plans the knapsack would pick from the linear plan's menu
    knowing the decode queries' recoveries (`hindsight`), knowing the first
    half of them only (`hindsight_half`, and with the squared losses), from
    each policy's output error on the prompt's last 32 rows (`window_errors`),
    or from a backtest: the recoveries of the keeps the prompt less its last
    BACK tokens would make, read by those BACK rows (`backtest`, its min and
    mean with the recoveries promised). Every plan's error is also taken over
    the second half of the decode rows alone (`late_error`), which the
    `hindsight_half` plan was not told. Per budget: means, sums and the
    families of policies chosen."""
    P = len(texts[0]) - new_tokens
    rec = evaluate.record(model, texts)
    recorders = rec[0]
    ratios = local_ratios(generation.menu() + [policies.baseline("h2o", b) for b in budgets])
    decode = later_rows(recorders, len(texts[0]), new_tokens, P, ratios)
    nb = min(BACK, P // 4)
    back = later_rows(recorders, P, nb, P - nb, ratios)  # the prompt's last nb rows
    half = new_tokens // 2  # told the first half of the decode rows, scored on the second
    early_decode = later_rows(recorders, P + half, half, P, ratios)
    prompts, out = [t[:P] for t in texts], {}
    for b in budgets:
        plans = {name: plan_of(model, prompts, generation.CacheOptions(kind, kv_budget=b, **kw),
                               flags, new_tokens)
                 for name, kind, kw in (("linear", "fastgen", dict(objective="linear", **LAYER)),
                                        ("squared", "fastgen", LAYER), ("h2o", "h2o", {}))}
        every = torch.arange(len(plans["h2o"]["choice"]))
        for p in plans.values():
            p["true"] = recoveries(p["policies"], p["prompt"], decode)  # (L * S, M)
            p["err"] = output_errors(model, recorders, p["keeps"][p["choice"], every][None],
                                     P)[0]
            p["late"] = output_errors(model, recorders, p["keeps"][p["choice"], every][None],
                                      P, skip=half)[0]
        row = {}
        for name, p in plans.items():
            true = p["true"][every, p["choice"]]
            row[name] = dict(decode=float(true.mean()), error=float(p["err"].sum()),
                             late_error=float(p["late"].sum()),
                             worst_tenth=float(true.sort().values[:len(true) // 10].mean()))
            if p["est"] is not None:
                est = p["est"][every, p["choice"]]
                row[name]["est"] = float(est.mean())
                families = {}
                for i, m in enumerate(p["choice"].tolist()):
                    kinds = "+".join(type(x).__name__ for x in p["policies"][m].members())
                    families.setdefault(kinds, []).append(i)
                row[name]["by_family"] = {
                    n: dict(heads=len(i), est=float(est[i].mean()),
                            decode=float(true[i].mean()), error=float(p["err"][i].sum()),
                            h2o_error=float(plans["h2o"]["err"][i].sum()),
                            late_error=float(p["late"][i].sum()),
                            h2o_late_error=float(plans["h2o"]["late"][i].sum()))
                    for n, i in sorted(families.items(), key=lambda x: -len(x[1]))}
        f = plans["linear"]
        window = output_errors(model, recorders, f["keeps"], P, rows=32).T  # (L * S, M)
        # Backtest: the plan the prompt less its last nb tokens would make, each
        # policy's keep there read by those nb rows, as decoding will read the keep.
        early = plan_of(model, [t[:P - nb] for t in texts],
                        generation.CacheOptions("fastgen", kv_budget=b, **LAYER), flags,
                        new_tokens + nb)
        tested = recoveries(early["policies"], early["prompt"], back)  # (L * S, M)
        promised = plans["squared"]["est"]
        told = recoveries(f["policies"], f["prompt"], early_decode)
        for name, values in (("hindsight", f["true"]), ("window_errors", -window),
                             ("hindsight_half", told),
                             ("hindsight_half_squared", squared_losses(told)),
                             ("backtest", squared_losses(tested)),
                             ("backtest_min", squared_losses(torch.minimum(tested, promised))),
                             ("backtest_mean", squared_losses((tested + promised) / 2))):
            pick = fastgen_cache.fit_budgets(values.view(f["costs"].shape), f["costs"],
                                             f["budgets"]).flatten()
            keep = f["keeps"][pick, every][None]
            err = output_errors(model, recorders, keep, P)[0]
            late = output_errors(model, recorders, keep, P, skip=half)[0]
            row[name] = dict(decode=float(f["true"][every, pick].mean()), error=float(err.sum()),
                             late_error=float(late.sum()))
        out[f"b={b:g}"] = row
    return out


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


def token_losses(model, tok, flags, text: list[int], prompt_len: int, budget: float,
                 variants, most: int = 10) -> list[dict]:
    """One window's continuation token by token: each token's KL under FastGen
    (each variant's cache options) and `h2o` at `budget`, the `most` tokens
    where the first variant loses most against `h2o`, and how far back the
    prompt last had that token; last, each one's mean over the continuation."""
    import torch.nn.functional as F
    prompt, follow = text[:prompt_len], torch.tensor([text[prompt_len:]])
    rec, n = evaluate.record(model, [prompt]), follow.shape[1]
    logp = {}
    for name, kv, opts in [("full", "full", {}), ("h2o", "h2o", {"kv_budget": budget})] + [
            (v, "fastgen", {"kv_budget": budget, **options(v.partition(":")[2])})
            for v in variants]:
        logits, _, _ = evaluate.replay(model, rec, Config(name, kv, opts), n, follow, flags)
        logp[name] = logits.log_softmax(-1)[0]
    kl = {k: F.kl_div(v, logp["full"], log_target=True, reduction="none").sum(-1)
          for k, v in logp.items() if k != "full"}
    first = variants[0]
    order = sorted(range(n), key=lambda i: -(kl[first][i] - kl["h2o"][i]).item())[:most]
    out = []
    for i in order:
        t = text[prompt_len + i]
        before = [j for j in range(prompt_len + i) if text[j] == t]
        out.append(dict(step=i, token=tok.decode([t]), back=prompt_len + i - before[-1]
                        if before else None, **{k: v[i].item() for k, v in kl.items()}))
    return out + [dict(step=None, token="(mean)", back=None,
                       **{k: v.mean().item() for k, v in kl.items()})]


def main(*, text="usenet", variants=("default",), budgets=(0.25, 0.5), windows=12,
         prompt_len=768, new_tokens=64, threads=1, out="results/evaluate/menu_variants",
         ckpt=None, norms: bool = False, heads: bool = False,
         evict_every: int | None = None, per_window: bool = False,
         token_window: int | None = None, h2o: bool = True) -> dict:
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
    if token_window is not None:
        got = token_losses(model, tok, flags, texts[token_window], prompt_len, budgets[0],
                           list(variants))
        for r in got:
            print(json.dumps(r))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).with_suffix(".json").write_text(json.dumps(got, indent=1))
        return got
    if heads:
        got = hindsight(model, texts, flags, new_tokens, budgets)
        print(json.dumps(got, indent=1))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).with_suffix(".json").write_text(json.dumps(got, indent=1))
        return got
    rows = {}
    every = {} if evict_every is None else {"evict_every": evict_every}
    fixed = [Config("full", "full", {})] + [Config(f"h2o b={b:g}", "h2o", {"kv_budget": b, **every})
                                            for b in budgets if h2o]
    def quality(cfgs):
        if not per_window:
            return evaluate.text_quality(model, texts, new_tokens, cfgs, flags, windows, 0.3, 0.3)
        each = [evaluate.text_quality(model, [t], new_tokens, cfgs, flags, 1, 0.3, 0.3)
                for t in tqdm(texts, desc="windows", leave=False)]
        return {c.name: dict({k: statistics.fmean(w[c.name][k] for w in each)
                              for k in ("kl", "top1", "share")},
                             kl_halves=[statistics.fmean(w[c.name]["kl_halves"][i] for w in each)
                                        for i in (0, 1)],
                             kl_by_window=[w[c.name]["kl"] for w in each]) for c in cfgs}
    rows |= quality(fixed)
    menu = generation.menu
    try:
        for v in variants:
            name, _, spec = v.partition(":")
            generation.menu = menu_of(name)  # what make_caches builds the budget mode from
            opts = options(spec)
            mix = opts.pop("mix", 0)
            center, scale = opts.pop("center", 0), opts.pop("scale", 0)
            both = opts.pop("both", None)
            factor = opts.pop("local_loss", None)
            rank, stride = opts.pop("rank", None), opts.pop("stride", 1)
            if both or rank:
                opts["obs_window"] = 0
            if mix:  # of attention alone: profiling.weigh would drop its scores
                opts["weigh_values"] = False
            cfgs = [Config("full", "full", {})] + [
                Config(f"fastgen[{v}] b={b:g}", "fastgen", {"kv_budget": b, **every, **opts})
                for b in budgets]
            with mixed_profile(mix) if mix else nullcontext(), \
                    head_scale(bool(center)) if scale else mock.patch.object(
                        fastgen_cache, "weigh", centered) if center else nullcontext(), \
                    every_row_recoveries(both) if both else nullcontext(), \
                    local_loss(factor) if factor is not None else nullcontext(), \
                    every_row_ranks(stride=stride, how=rank) if rank else nullcontext():
                got = quality(cfgs)
            rows |= {n: r for n, r in got.items() if n != "full"}
    finally:
        generation.menu = menu
    for n, r in rows.items():
        print(f"{text} {n:40s} share {r['share']:.3f}  KL {r['kl']:.4f} (halves "
              f"{r['kl_halves'][0]:.4f} / {r['kl_halves'][1]:.4f})  top-1 {r['top1']:.3f}")
    if per_window:  # each window's best FastGen variant, as if a prompt could pick its own
        for b in budgets:
            by = [r["kl_by_window"] for n, r in rows.items()
                  if n.startswith("fastgen[") and n.endswith(f" b={b:g}")]
            rows[f"best variant per window b={b:g}"] = best = dict(
                kl=statistics.fmean(map(min, zip(*by))))
            print(f"{text} {'best variant per window b=' + format(b, 'g'):40s} KL {best['kl']:.4f}")
    meta = dict(text=text, windows=windows, evict_every=evict_every, prompt_len=prompt_len,
                new_tokens=new_tokens, machine=evaluate.machine(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), runtime_s=round(time.perf_counter() - t0))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m studies.menu_variants", description=__doc__.split(
        "\n")[0], epilog="Variants: MENU[:OPTIONS], see the module's docstring.")
    p.add_argument("--ckpt", help="checkpoint folder (default SmolLM2-135M-Instruct)")
    p.add_argument("--text", default="usenet", choices=evaluate.SOURCES, help="real text (usenet)")
    p.add_argument("--variants", nargs="+", default=["default"], help="MENU[:OPTIONS], as the "
                   "module's docstring says; MENU: default, default-floor, no-local, no-sink, "
                   "no-tova, h2o, h2o-floor")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5], help="(0.25 0.5)")
    p.add_argument("--windows", type=int, default=12, help="text windows (12)")
    p.add_argument("--new-tokens", type=int, default=64, help="teacher-forced tokens after "
                   "each window's 768-token prompt (64)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--out", default="results/evaluate/menu_variants", help="OUT.json")
    p.add_argument("--norms", action="store_true", help="instead, print how the first token's "
                   "value norm compares with the others' and its share of the attention, plain "
                   "and weighed by value norms, per layer (`value_norms`)")
    p.add_argument("--per-window", action="store_true", help="score each window apart and "
                   "add each window's KL (kl_by_window) and, per budget, the mean of each "
                   "window's best FastGen variant: what choosing a variant per prompt could gain")
    p.add_argument("--no-h2o", dest="h2o", action="store_false", help="leave out the `h2o` "
                   "rows run beside the variants by default (about a third of a run's time)")
    p.add_argument("--evict-every", type=int, help="steps between evictions for every row, "
                   "h2o's included (default: the cache's; 1000: none in 64 steps)")
    p.add_argument("--heads", action="store_true", help="instead, compare each head's recovery "
                   "as the prompt's profile estimates it and as decoding needs it, for FastGen's "
                   "plan, h2o's and the plan chosen in hindsight (`hindsight`)")
    p.add_argument("--token-window", type=int, metavar="W", help="instead, window W's "
                   "continuation token by token at the first budget: the 10 tokens where the "
                   "first variant loses most KL against h2o, with each variant's and h2o's KL "
                   "and how many tokens back the prompt last had the token (`token_losses`)")
    a = p.parse_args(argv)
    if a.token_window is not None and not 0 <= a.token_window < a.windows:
        p.error(f"--token-window must be a window, 0 to {a.windows - 1} (got {a.token_window})")
    if a.new_tokens < 2:  # the KL is reported for each half of them
        p.error(f"--new-tokens must be at least 2 (got {a.new_tokens})")
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
