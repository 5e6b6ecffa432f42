"""A slow model of the FastGen cache, written apart from it, to test the real one against.

Each segment (sequence, KV head) of `Reference` is a Python set of kept
positions and a dict of their heavy-hitter scores; attention is dense, in
float64, over every key the sequence has ever seen, masked to the kept set;
profiling builds the whole attention matrix and sums it row by row, and a
chunk's choosing again reads the attention its last rows gave what each
segment holds. Policies are read only through their classes and parameters
(`policy.members()`, `r`, `n`): what they keep and what they cost of the new
tokens are re-implemented here on sets, from the design notes. A threshold
takes the first policy reaching it; a budget takes, per sequence, the
assignment of menu items to its heads of most value within the budget,
found by brute force over every assignment (`knapsack`; by dynamic
programming over the total cost past BRUTE_FORCE assignments).

What it does not re-derive, it takes from the cache under test, and says so:
- near-ties: which of tokens scored within TIE a policy keeps is the cache's
  choice (its ranking: `cache.scored_prompt` over `profiling.attention_sums`,
  `profiling.local_ratios` and `profiling.weigh` at prefill, the cache's
  `Slots.keeps` when a chunk chooses again);
  so is a policy whose recovery is within rounding of the threshold, and an
  assignment whose value ties the optimum within VALUE_TIE a head;
- what a precision costs: `cache.errors` (profiling.precision_errors) off the
  recoveries, and the bytes a token and a window take (`cache.token_costs`);
  both are tested apart (test_quant.py);
- each rounding segment's window width, the default eviction period, and
  rounding itself (quant.py), tested apart.
profiling.rotate and pool.rotate are patched (`rotation_of_fixed_bits`), not used.

`CheckedCache` runs a `FastGenCache` and the reference side by side and
asserts after every call that both hold the same tokens with the same scores,
measure the same recoveries, choose the same policies (or, under a budget, an
assignment of equal value) and return the same attention output (`drive`
builds the cache).
"""
from __future__ import annotations

import itertools
import math
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

import pool
import profiling
import quant
from cache import COPY_BITS, FastGenCache, scored_prompt, token_costs
from model import Cache
from policies import (PUNCT, SPECIAL, TOVA, Frequent, Full, Local, Punct, Sink, SnapKV, Special,
                      Union)
from profiling import attention_sums, local_ratios, weigh
from quant import channel_factors, read_back, rotate, rounds, windowed

# Scores accumulate float32 roundoff in the cache; two tokens whose scores are
# closer than this are a tie, which the reference breaks the way the cache did.
TIE = 1e-4
# The cache's recoveries are float32, within 1e-4 of the reference's: a head's
# knapsack value -(1 - r)^2 moves by up to 2e-4 with them, so the cache's optimum
# and the reference's may differ by twice that a head, and are then a tie.
VALUE_TIE = 4e-4
# A budget's choice is checked by brute force over every assignment of menu
# items to a sequence's heads up to this many; past it by dynamic programming
# over the total cost (exact as well, only faster).
BRUTE_FORCE = 200_000
# A knapsack counts costs exactly up to this many units of its budget
# (profiling.fit_budget's rule); above, in units of ceil(budget / RESOLUTION).
RESOLUTION = 4096
f32 = np.float32


def ceil_share(r: float, n: int) -> int:
    """ceil(r * n), exactly, for r as typed in decimal."""
    return math.ceil(Fraction(str(r)) * n)


def top(held, score, budget, prefer=()):
    """The `budget` held tokens with the largest scores. Scores within TIE of the
    last one taken are ties; among ties, tokens in `prefer` go first."""
    if budget <= 0:
        return set()
    if budget >= len(held):
        return set(held)
    ranked = sorted(held, key=lambda j: -score[j])
    last = score[ranked[budget - 1]]
    sure = {j for j in held if score[j] > last + TIE}
    ties = [j for j in ranked if score[j] == last or abs(score[j] - last) <= TIE]
    # Then the earlier position, as the cache's stable sort does on a prompt in order.
    ties.sort(key=lambda j: (next((i for i, p in enumerate(prefer) if j in p), len(prefer)), j))
    return sure | set(ties[:budget - len(sure)])


def keep(policy, held, seen, prompt_len, flags, score, hint=frozenset(), first_query=0, last=None):
    """The positions of `held` that `policy` keeps, on plain sets.

    flags[j]: the token flags at position j; score[j]: the attention it received
    from the queries since `first_query`; last[j]: from the latest query alone;
    hint: the positions the cache under test kept, used only to break ties.
    """
    by_others = set()  # what the members other than the ranking ones keep
    ranked = []  # (ranking, budget)
    for m in policy.members():
        if isinstance(m, Special):
            by_others |= {j for j in held if flags[j] & SPECIAL or j == 0}
        elif isinstance(m, Punct):
            by_others |= {j for j in held if flags[j] & PUNCT}
        elif isinstance(m, Local):
            by_others |= {j for j in held if j >= seen - ceil_share(m.r, prompt_len)}
        elif isinstance(m, Sink):
            by_others |= {j for j in held if j < m.n}
        elif isinstance(m, Full):
            by_others |= set(held)
        elif isinstance(m, Frequent) and m.by == "sum":
            ranked.append((held, score, ceil_share(m.r, seen)))
        elif isinstance(m, Frequent):
            mean = {j: math.inf if j == seen - 1 else score[j] / max(seen - max(j, first_query), 1)
                    for j in held}
            ranked.append((held, mean, ceil_share(m.r, seen)))
        elif isinstance(m, TOVA):
            ranked.append((held, last, ceil_share(m.r, prompt_len)))
        elif isinstance(m, SnapKV):
            recent = {j for j in held if j >= prompt_len - m.window}
            by_others |= recent
            h = m.kernel // 2
            pooled = {j: max(score.get(i, 0.0) if isinstance(score, dict) else
                             (score[i] if 0 <= i < len(score) else 0.0)
                             for i in range(j - h, j + h + 1)) for j in held}
            ranked.append((set(held) - recent, pooled,
                           max(ceil_share(m.r, prompt_len) - m.window, 0)))
        else:
            raise TypeError(f"the reference does not know {m!r}")
    kept = set(by_others)
    for pool, values, budget in ranked:
        # A tie the cache resolved must be resolved the same way: prefer the tied
        # tokens the cache kept that no other member explains, then the others it kept.
        kept |= top(pool, values, budget, prefer=(set(hint) - by_others, set(hint)))
    return kept


def prompt_attention(q, k):
    """The causal attention matrix, (G, L, L) in float64, of queries q: (G, L, D)
    over keys k: (L, D)."""
    L, D = k.shape
    logits = q.double() @ k.double().T / math.sqrt(D)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).softmax(-1)


def brute_recovery(policy, A, prompt_len, flags, score, rows=None, last=None,
                   hint=frozenset()):
    """Share of attention `policy` recovers, from the whole attention matrix.

    A: (G, L, L) causal attention of the G query heads of one KV head (its
    columns weighed, where the cache weighs values). Row i keeps the policy's
    fixed set, ranked by `score` (and `last`), plus, when it has a Local
    member, its window {j : i - W < j <= i}; the mass on the kept set is
    averaged over the rows read (the last `rows`, or all) and the heads.
    `hint` breaks ties.
    """
    G, L, _ = A.shape
    first = L - min(rows or L, L)
    # The members other than Local at once, so that a tie is broken as for the union.
    others = [m for m in policy.members() if not isinstance(m, Local)]
    fixed = keep(Union(*others), set(range(L)), L, L, flags, score, hint, first, last) \
        if others else set()
    mask = torch.zeros(L, L, dtype=torch.bool)
    mask[:, sorted(fixed)] = True
    for m in policy.members():
        if isinstance(m, Local):
            W = ceil_share(m.r, prompt_len)
            for i in range(L):
                mask[i, max(0, i - W + 1):i + 1] = True
    A = A[:, first:]
    mask = mask[first:]
    return float((A * mask).sum() / (G * (L - first)))


def held_recovery(policy, rows, held, seen, prompt_len, flags, score, hint, first_query, last):
    """Share of attention `policy` recovers of what a segment holds, from the
    attention of some query rows: rows, a list of (position, attention) with
    attention[j] what the row gave position j (j held). As `brute_recovery`
    reads a prompt: the fixed set ranked on what is held, plus, for a Local
    member, each row's window."""
    others = [m for m in policy.members() if not isinstance(m, Local)]
    fixed = keep(Union(*others), held, seen, prompt_len, flags, score, hint, first_query, last) \
        if others else set()
    W = max((ceil_share(m.r, prompt_len) for m in policy.members() if isinstance(m, Local)),
            default=0)
    return sum(sum(a.get(j, 0.0) for j in held if j in fixed or j > p - W)
               for p, a in rows) / len(rows)


def carried(colsum, span):
    """Each token's score: the most attention any of the `span` tokens up to it received."""
    return [max(colsum[max(0, j - span + 1):j + 1]) for j in range(len(colsum))]


def growth(policy, held, flags, prompt_len):
    """The share of new tokens `policy` holds on to, what it costs of them under a
    budget: all for Full and SnapKV (they never evict a new token), r for heavy
    hitters, for Special and Punct the share of the `prompt_len` tokens read that
    are flagged so among those `held`, none for what keeps a fixed number (Local,
    Sink, TOVA); a union the sum, at most 1. In float32, as the cache prices it:
    in exact arithmetic ceil(r * n) could differ by a token."""
    def one(m):
        if isinstance(m, (Full, SnapKV)):
            return f32(1)
        if isinstance(m, Frequent):
            return f32(m.r)
        if isinstance(m, (Special, Punct)):
            bit = SPECIAL if isinstance(m, Special) else PUNCT
            return f32(sum(1 for j in held if flags[j] & bit)) / f32(prompt_len)
        if isinstance(m, (Local, Sink, TOVA)):
            return f32(0)
        raise TypeError(f"the reference does not know {m!r}")
    if not isinstance(policy, Union):
        return one(policy)
    total = f32(0)
    for m in policy.members():
        total = f32(total + one(m))
    return min(total, f32(1))


def item_cost(kept, grows, new, unit, window):
    """A menu item's cost: the tokens it keeps now plus ceil(growth * new) of the
    `new` tokens to come (float32, as the cache computes it), `unit` each, plus
    its `window` (bytes of a 4- or 2-bit head's newest tokens; 0 in tokens)."""
    return (kept + int(np.ceil(f32(grows) * f32(new)))) * unit + window


def value_of(r, ask_after=False):
    """A head's knapsack value: -(1 - r)^2 of the share r it recovers (r itself
    after reading again), r taken to six decimals; -inf where not offered."""
    if r == -math.inf:
        return -math.inf
    r = round(float(r), 6)
    return r if ask_after else -max(1 - r, 0.0) ** 2


def knapsack(values, costs, budget):
    """One sequence's heads' menu items of the most total value whose costs sum to
    at most `budget`: values, costs [head][item] (-inf: not offered). Costs count
    in units of ceil(budget / RESOLUTION), rounded up. Where even the cheapest
    offered items pass the budget, those (the first of equal cost).

    Returns (items, value, unit): items the optimum, by brute force over every
    assignment (by dynamic programming where there are more than BRUTE_FORCE),
    value its total, None where nothing fits; unit the cost unit."""
    offered = [[i for i, v in enumerate(row) if v > -math.inf] for row in values]
    assert all(offered), "a head is offered nothing"
    cheapest = [min(items, key=lambda i: c[i]) for items, c in zip(offered, costs)]
    if sum(c[i] for i, c in zip(cheapest, costs)) > budget:
        return cheapest, None, 1
    unit = -(-budget // RESOLUTION) if budget > 0 else 1
    left = budget // unit
    rounded = [[-(-x // unit) for x in row] for row in costs]
    if math.prod(map(len, offered)) <= BRUTE_FORCE:
        best, best_value = None, -math.inf
        for items in itertools.product(*offered):
            if sum(c[i] for i, c in zip(items, rounded)) <= left:
                total = sum(v[i] for i, v in zip(items, values))
                if total > best_value:
                    best, best_value = list(items), total
    else:  # the best value of each total cost, head by head
        states = {0: (0.0, [])}
        for items, v, c in zip(offered, values, rounded):
            after = {}
            for spent, (total, picks) in states.items():
                for i in items:
                    if spent + c[i] <= left and (spent + c[i] not in after
                                                 or total + v[i] > after[spent + c[i]][0]):
                        after[spent + c[i]] = (total + v[i], picks + [i])
            states = after
        best_value, best = max(states.values(), key=lambda t: t[0], default=(-math.inf, None))
    assert best is not None, (  # the cheapest fit the budget, not in rounded units
        f"no assignment fits {budget} in units of {unit}: {costs}")
    return best, best_value, unit


def check_budget_choice(got, values, costs, budget, where):
    """The cache's choice `got` for one sequence's heads against `knapsack`'s:
    the same, or another within the budget of the same value (a tie)."""
    best, best_value, unit = knapsack(values, costs, budget)
    spent = sum(c[i] for i, c in zip(got, costs))
    detail = (f"{where}: cache chose {got} (value {sum(v[i] for i, v in zip(got, values))}, "
              f"cost {spent}), the optimum is {best} (value {best_value}, cost "
              f"{sum(c[i] for i, c in zip(best, costs))}), budget {budget}")
    if best_value is None:  # nothing fits: the cheapest items
        assert all(c[i] == c[j] and v[i] > -math.inf
                   for i, j, c, v in zip(got, best, costs, values)), detail
        return
    assert all(v[i] > -math.inf for i, v in zip(got, values)), f"not offered: {detail}"
    assert sum(-(-c[i] // unit) for i, c in zip(got, costs)) <= budget // unit, \
        f"over the budget: {detail}"
    value = sum(v[i] for i, v in zip(got, values))
    assert got == best or value >= best_value - VALUE_TIE * len(got), detail


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: a thread pool only adds synchronisation, which
    on a busy machine costs more than the work. Modules import this fixture."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rotate_in_float64(x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """quant.rotate, the product taken in float64: its float32 result is the same whatever
    the batch's shape."""
    h = quant.hadamard(x.shape[-1], x.device) if h is None else h
    return (x.double() @ h.double()).float().to(x.dtype)


@pytest.fixture(autouse=True)
def rotation_of_fixed_bits(monkeypatch):
    """The pool rotates whole batches of keys and values before it rounds them, the reference
    one segment's: a float32 product's last bits depend on the batch's shape in some BLAS
    builds (MKL on Intel Xeon), and a number on a rounding boundary then takes the next code.
    The pool, profiling and the reference rotate in float64 here. Modules import this fixture."""
    for module in (pool, profiling, sys.modules[__name__]):
        monkeypatch.setattr(module, "rotate", rotate_in_float64)


class Reference:
    """The reference for one layer: B sequences, K KV heads, S = B*K segments.

    The options are a cache.Method's, read as plain values: `threshold` its
    recovery, `budget` its kv_budget; `span` carries a prompt token's score
    to the span - 1 tokens after it, and `weigh` counts a prompt token's
    attention times its value's norm (scaled so that a row still sums to one);
    `ask_after` values a head by the share it keeps, not its squared loss;
    `copies`, where the method marks the heads that copy, says for each
    segment whether it copies: it is offered only the policies keeping every
    token at COPY_BITS or more, and the others not those at 16 bits or more.
    `max_new_tokens` the tokens each sequence is planned to generate (what a
    budget counts)."""

    def __init__(self, policies, threshold, prompt_lens, n_kv_heads, token_flags, rows=None,
                 budget=None, evict_every=1, bits=None, units=None, span=1, weigh=False,
                 max_new_tokens=1, ask_after=False, copies=None):
        self.policies = list(policies)
        M = len(self.policies)
        # Each policy's precision (None: unrounded), and what a token costs under
        # it, what a segment's window costs, and what a token costs in a full cache:
        # in tokens, or in bytes with precisions (then the cache's, `token_bytes`).
        self.bits = bits
        self.units = units or ([1] * M, [0] * M, 1)
        self.evict_every = evict_every
        self.threshold, self.rows, self.budget = threshold, rows, budget
        self.span, self.weigh, self.ask_after = span, weigh, ask_after
        self.max_new_tokens, self.copies = max_new_tokens, copies
        self.lens = [int(n) for n in prompt_lens]
        self.K = n_kv_heads
        self.token_flags = token_flags.tolist()

    def seg(self, b, h):
        return b * self.K + h

    def prefill(self, q, k, v, tokens, state, errors=None):
        """q: (B, H, T, D), k, v: (B, K, T, D). `state` is the cache's, after its
        prefill (`State`): its ranking for ties, its plan to check; `errors`
        (S, M) what each policy's precision costs each segment, off its recovery
        (the cache's). Returns the output (B, H, T, D) on the real rows (padding
        rows are zero)."""
        B, H, T, D = q.shape
        K, G, M = self.K, H // self.K, len(self.policies)
        y = torch.zeros(B, H, T, D, dtype=torch.float64)
        self.flags = [[self.token_flags[t] for t in tokens[b, :L].tolist()]
                      for b, L in enumerate(self.lens)]
        self.k, self.v, self.score, self.kept, self.policy = {}, {}, {}, {}, {}
        self.first, self.prompt_keep, self.factors = {}, {}, {}
        # A rounding segment's newest WINDOW positions since compression, and every
        # token as a window holds it: those of the window that it still holds are read so.
        self.kw, self.vw, self.window, self.width = {}, {}, {}, {}
        self.recovery = torch.zeros(B * K, M, dtype=torch.float64)
        self.dropped = 0  # held tokens let go later, all segments together
        self.steps = 0  # decode steps so far
        self.since = 0  # tokens taken since the last eviction
        self.last = {}  # segment -> the latest query's attention, per position
        self.stored = {}  # segment -> the precision its tokens are stored at (its first policy's)
        self.rechosen = 0  # chunks that chose every policy again
        prompt_score = {}
        for b, L in enumerate(self.lens):  # profile: each policy's recovery, what it keeps
            for h in range(K):
                s, heads = self.seg(b, h), slice(h * G, (h + 1) * G)
                kk, vv = k[b, h, :L].double(), v[b, h, :L].double()
                A = prompt_attention(q[b, heads, :L], kk)  # (G, L, L)
                y[b, heads, :L] = A @ vv
                first = L - min(self.rows or L, L)
                if self.weigh:  # token j's attention times |v_j|, each row read still summing to 1
                    norm = v[b, h, :L].float().norm(dim=-1).double()
                    colsum = A[:, first:].sum(1).mean(0)
                    A = A * (norm * colsum.sum() / (colsum * norm).sum().clamp(min=1e-12))
                colsum = A[:, first:].sum(1).mean(0).tolist()  # (L,) attention each token received
                score = carried(colsum, self.span)  # what heavy hitters rank by
                last = A[:, -1].mean(0).tolist()  # from the last row alone
                self.last[s] = last
                self.first[s] = first
                prompt_score[s] = score
                self.recovery[s] = torch.tensor([
                    brute_recovery(p, A, L, self.flags[b], score, self.rows, last,
                                   state.prompt_kept[s][i])
                    for i, p in enumerate(self.policies)])
                for i, p in enumerate(self.policies):
                    self.prompt_keep[s, i] = keep(p, set(range(L)), L, L, self.flags[b], score,
                                                  state.prompt_kept[s][i], first, last)
        # What a policy is worth to a segment: its recovery less its precision's error.
        worth = self.recovery - (0 if errors is None else errors.double())
        worth = worth.masked_fill(~torch.tensor([[self.may_take(s, i) for i in range(M)]
                                                 for s in range(B * K)]), -math.inf)
        if self.budget is not None and M > 1:
            self.share = []  # each sequence's share of a full cache when choosing again
            new = self.max_new_tokens - 1
            unit, window, full = self.units
            for b, L in enumerate(self.lens):
                segs = range(b * K, (b + 1) * K)
                grows = [growth(p, range(L), self.flags[b], L) for p in self.policies]
                costs = [[item_cost(len(self.prompt_keep[s, i]), grows[i], new, unit[i], window[i])
                          for i in range(M)] for s in segs]
                # A share of what its full cache would hold, prompt and new tokens, in float32.
                budget = int(f32(self.budget) * f32((L + new) * K * full))
                got = [state.choice[s] for s in segs]
                check_budget_choice(got, [[value_of(r, self.ask_after) for r in worth[s].tolist()]
                                          for s in segs], costs, budget, f"sequence {b}")
                spent = sum(c[i] for c, i in zip(costs, got))
                # One layer: what it took over the budget, else all of the budget (float32).
                base = f32(max(min(budget, spent), 1))
                self.share.append(f32(f32(self.budget) * f32(spent)) / base)
            self.choice = list(state.choice)  # checked: the optimum, or a tie of it
        else:
            self.choice = [self.choose(worth[s], state.choice[s]) for s in range(B * K)]
        for b, L in enumerate(self.lens):  # compress: keep what the chosen policy keeps
            for h in range(K):
                s = self.seg(b, h)
                kk, vv = k[b, h, :L].double(), v[b, h, :L].double()
                every = torch.ones(1, L, dtype=torch.bool)
                self.factors[s] = channel_factors(k[b, h, None, :L], every)[0]
                self.stored[s] = None if self.bits is None else self.bits[self.choice[s]]
                self.k[s], self.v[s] = self.rounded(s, kk, key=True), self.rounded(s, vv)
                self.kw[s] = self.rounded(s, kk, key=True, window=True)
                self.vw[s] = self.rounded(s, vv, window=True)
                self.policy[s] = self.policies[self.choice[s]]
                self.kept[s] = self.prompt_keep[s, self.choice[s]]
                self.width[s] = state.window[s]
                newest = sorted(self.kept[s])[max(len(self.kept[s]) - self.width[s], 0):]
                self.window[s] = set(newest)
                self.score[s] = {j: prompt_score[s][j] for j in self.kept[s]}
        self.prompt_choice = list(self.choice)  # the plan of the prompt, before any chunk
        # The cache keeps the latest query's attention where a policy of its plan reads it.
        self.has_last = any(isinstance(m, TOVA) for p in self.policy.values() for m in p.members())
        return y

    def rounded(self, s, x, key=False, window=False):
        """x (n, D) as segment s's precision stores and reads it (or its window), in float64."""
        b = self.stored[s]
        if b is None:
            return x.double()
        if not rounds(b):
            return x.float().half().double()
        # A rounding segment: keys over their channel factors, then keys and values rotated,
        # rounded at its precision (with what the codes miss in its window); read back,
        # rotated back.
        f = self.factors[s] if key else 1.0
        y = read_back(rotate(x.float() / f), b, window)
        return (rotate(y) * f).double()

    def choose(self, recovery, cache_choice):
        """Under a threshold: the first policy reaching it (the last when none does,
        or the threshold is >= 1); a recovery within rounding of the threshold may go
        either way, as the cache chose. recovery: (M,), -inf where not offered."""
        n = len(self.policies)
        if n == 1 or self.threshold >= 1:
            return n - 1
        if any(abs(float(r) - self.threshold) < 1e-5 for r in recovery):
            return cache_choice
        return next((i for i, r in enumerate(recovery.tolist()) if r >= self.threshold), n - 1)

    def may_take(self, s, i) -> bool:
        """Whether segment s is offered policy i at all: where the method marks the
        heads that copy (`copies`), one that copies takes only a policy keeping
        every token at COPY_BITS or more, and another none keeping every token at
        16 bits or more (in the model's dtype: on the menu for those that copy)."""
        if self.copies is None:
            return True
        whole = any(isinstance(m, Full) for m in self.policies[i].members())
        bits = 16 if self.bits is None else self.bits[i]
        return whole and bits >= COPY_BITS if self.copies[s] else not (whole and bits >= 16)

    def evict(self, state):
        """Each segment lets go of what its policy no longer keeps, ranked by the
        scores so far and the latest query's attention; `state` is the cache's
        after its eviction (for ties)."""
        for s in self.kept:
            b = s // self.K
            held = self.kept[s]
            self.kept[s] = keep(self.policy[s], held, len(self.flags[b]), self.lens[b],
                                self.flags[b], self.score[s], state.kept[s], self.first[s],
                                self.last[s])
            self.dropped += len(held - self.kept[s])
        self.since = 0

    def take(self, b, q, k, v, p, token):
        """Sequence b's token at position p: q (H, D), k, v (K, D); appended,
        attended to over what each of its segments keeps, and scored. Returns
        the output (H, D)."""
        K, (H, D) = self.K, q.shape
        G = H // K
        assert p == len(self.flags[b]), "positions must advance one token at a time"
        self.flags[b].append(self.token_flags[int(token)])
        y = torch.zeros(H, D, dtype=torch.float64)
        for h in range(K):
            s, heads = self.seg(b, h), slice(h * G, (h + 1) * G)
            self.k[s] = torch.cat([self.k[s], self.rounded(s, k[h, None], key=True)])  # (p + 1, D)
            self.v[s] = torch.cat([self.v[s], self.rounded(s, v[h, None])])
            self.kw[s] = torch.cat([self.kw[s], self.rounded(s, k[h, None], True, True)])
            self.vw[s] = torch.cat([self.vw[s], self.rounded(s, v[h, None], window=True)])
            if self.width[s]:
                self.window[s] = set(sorted(self.window[s] | {p})[-self.width[s]:])
            self.kept[s] = self.kept[s] | {p}
            mask = torch.zeros(p + 1, dtype=torch.bool)
            mask[sorted(self.kept[s])] = True
            keys, values = self.k[s].clone(), self.v[s].clone()
            if windowed(self.stored[s]):
                at = sorted(j for j in self.window[s] if j <= p)
                keys[at], values[at] = self.kw[s][at], self.vw[s][at]
            logits = q[heads].double() @ keys.T / math.sqrt(D)  # (G, p + 1)
            probs = logits.masked_fill(~mask, -math.inf).softmax(-1)
            y[heads] = probs @ values
            self.last[s] = probs.mean(0).tolist()
            self.score[s] = {j: self.score[s].get(j, 0.0) + self.last[s][j] for j in self.kept[s]}
        return y

    def decode(self, q, k, v, input_pos, tokens, state):
        """One new token per sequence. q: (B, H, 1, D), k, v: (B, K, 1, D),
        input_pos, tokens: (B, 1). Once `evict_every` tokens were taken since
        the last eviction, the step first evicts (`evict`); `state` is the
        cache's after that eviction (for ties). Returns the output (B, H, 1, D)."""
        if self.since >= self.evict_every:
            self.evict(state)
        y = torch.stack([self.take(b, q[b, :, 0], k[b, :, 0], v[b, :, 0], int(input_pos[b, 0]),
                                   tokens[b, 0]) for b in range(len(q))])
        self.steps += 1
        self.since += 1
        return y[:, :, None]

    def chunk(self, q, k, v, input_pos, tokens, counts, state):
        """T tokens per sequence, of which sequence b takes the first counts[b]
        (the rest is padding): each taken as a decode step would take it, with
        eviction deferred until the chunk's end; the chunk then counts as read,
        like the prompt. q: (B, H, T, D), k, v: (B, K, T, D). Returns the output
        (B, H, T, D), zero on padding, and how many of the chunk's last rows
        choose every policy again (`choose_again`): the last `rows` (or all),
        when there is a choice and every sequence takes the whole chunk."""
        if self.since >= self.evict_every:
            self.evict(state)
        B, H, T, D = q.shape
        R = min(self.rows or T, T) if len(self.policies) > 1 and min(counts) == T else 0
        # Segment -> (position, the attention it gave each position) of the rows observed.
        self.observed = {s: [] for s in self.kept}
        y = torch.zeros(B, H, T, D, dtype=torch.float64)
        # The chunk is written at once: its queries read the window as the whole chunk left it.
        for s, width in self.width.items():
            b = s // self.K
            if width:
                new = input_pos[b, :int(counts[b])].tolist()
                self.window[s] = set(sorted(self.window[s] | set(new))[-width:])
        for b in range(B):
            for t in range(int(counts[b])):
                p = int(input_pos[b, t])
                y[b, :, t] = self.take(b, q[b, :, t], k[b, :, t], v[b, :, t], p, tokens[b, t])
                if t >= T - R:
                    for h in range(self.K):
                        s = self.seg(b, h)
                        self.observed[s].append((p, dict(enumerate(self.last[s]))))
            self.lens[b] += int(counts[b])
        self.since += T
        return y, R

    def offered(self, s, i) -> bool:
        """Whether segment s may take policy i when a chunk chooses again: its
        tokens stay at the precision they are stored at, and a policy that
        ranks by the latest attention needs a cache that keeps it (one whose
        prompt plan has such a policy)."""
        reads_last = lambda p: any(isinstance(m, TOVA) for m in p.members())  # noqa: E731
        return ((self.bits is None or self.bits[i] == self.stored[s])
                and (self.has_last or not reads_last(self.policies[i])))

    def choose_again(self, hint, cache_choice, errors):
        """After a chunk whose last rows were observed: each policy's recovery of
        what each segment holds, from those rows' attention (`held_recovery`),
        less what its precision costs (`errors`, the cache's, tested apart), and
        the threshold's choice or, under a budget, the knapsack's over what each
        policy keeps of what is held and of an answer's tokens, within the layer's
        share of a full cache. Returns the
        recoveries, (S, M), -inf where the policy is not offered (`offered`; as the
        cache's, not those `may_take` refuses, which neither can choose)."""
        S, M, K = len(self.kept), len(self.policies), self.K
        recovery = torch.full((S, M), -math.inf, dtype=torch.float64)
        for s in range(S):
            b = s // self.K
            for i, p in enumerate(self.policies):
                if self.offered(s, i):
                    recovery[s, i] = held_recovery(
                        p, self.observed[s], self.kept[s], len(self.flags[b]), self.lens[b],
                        self.flags[b], self.score[s], hint[s][i], self.first[s],
                        self.last[s]) - (0 if errors is None else float(errors[s, i]))
        worth = recovery.masked_fill(~torch.tensor([[self.may_take(s, i) for i in range(M)]
                                                    for s in range(S)]), -math.inf)
        if self.budget is not None:
            new = self.max_new_tokens - 1  # a chunk comes before an answer
            unit, window, full = self.units
            for b in range(S // K):
                segs = range(b * K, (b + 1) * K)
                seen, L = len(self.flags[b]), self.lens[b]
                costs = [[item_cost(len(keep(p, self.kept[s], seen, L, self.flags[b],
                                             self.score[s], hint[s][i], self.first[s],
                                             self.last[s])),
                                    growth(p, self.kept[s], self.flags[b], L), new, unit[i],
                                    window[i])
                          for i, p in enumerate(self.policies)] for s in segs]
                budget = int(f32(self.share[b] * f32((seen + new) * K * full)))
                got = [cache_choice[s] for s in segs]
                check_budget_choice(got, [[value_of(r, self.ask_after) for r in worth[s].tolist()]
                                          for s in segs], costs, budget,
                                    f"sequence {b}, chunk {self.rechosen + 1}")
            self.choice = list(cache_choice)  # checked: the optimum, or a tie of it
        else:
            self.choice = [self.choose(worth[s], cache_choice[s]) for s in range(S)]
        for s, c in enumerate(self.choice):
            assert self.offered(s, c) and self.may_take(s, c), \
                f"segment {s} took {self.policies[c]!r}, not offered"
            self.policy[s] = self.policies[c]
        self.rechosen += 1
        return recovery


class State:
    """What a FastGenCache holds, per segment: {position: score}, and its plan."""

    def __init__(self, cache):
        S = len(cache.choice)
        self.choice = cache.choice.tolist()
        self.max_new_tokens = cache.max_new_tokens
        self.kept: list[dict[int, float]] = [None] * S
        p = cache.pool
        for g in p.groups:
            # A cache whose policies all keep all keeps no score: none is compared (NaN).
            positions = g.block(p.pos)
            scores = (g.block(p.score) if "score" in p.fields
                      else torch.full(positions.shape, math.nan))
            for row, s in enumerate(g.seg.tolist()):
                pos, score = positions[row], scores[row]
                held = pos >= 0
                assert self.kept[s] is None, f"segment {s} is in two groups"
                self.kept[s] = dict(zip(pos[held].tolist(), score[held].tolist()))
                assert len(self.kept[s]) == int(held.sum()), f"segment {s} holds a position twice"
        assert all(kept is not None for kept in self.kept), "a segment is in no group"
        # The slot each segment's next token goes to, and whether it is free and its own.
        flat = cache.pool.pos.view(-1)
        owner = cache.pool.owner.repeat_interleave(cache.page)
        # Each segment's window entries (pool.window; 0 where its part does not round).
        self.window = [0] * S
        for part in (p for p in cache.pool.parts if p.windowed):
            segs, _ = cache.pool.rows_of(part)
            for s in segs.tolist():
                self.window[s] = part.window_pos.shape[1]
        self.dest_ok = [j < len(flat) and bool(flat[j] < 0 and owner[j] == s)
                        for s, j in enumerate(cache.pool.dest.tolist())]
        # A chunk's: every slot handed out for it free and its own, none twice.
        taking = cache.pool.taken(cache.clock.ready) if cache.clock.ready else None
        self.taking_ok = taking is None or all(
            len(set(row)) == len(row) and all(flat[j] < 0 and owner[j] == s for j in row)
            for s, row in enumerate(taking.tolist()))

    def held_keeps(self, cache):
        """What each policy keeps of what each segment holds, by the cache's own
        ranking, as a chunk's choosing again ranks it (the latest attention that
        of the chunk's last row): the reference breaks its near-ties the same way."""
        self.held_kept = [None] * len(self.kept)
        for g, seen in zip(cache.pool.groups, cache.pool.observed):
            slots = cache.slots(g)
            slots.last = seen[:, -1]
            keeps = [slots.keeps(p) for p in cache.policies]
            for row, s in enumerate(g.seg.tolist()):
                self.held_kept[s] = [set(slots.pos[row][keep[row]].tolist()) for keep in keeps]


def compare(ref: Reference, state: State):
    """The cache and the reference hold the same tokens with the same scores."""
    for s, held in enumerate(state.kept):
        assert set(held) == ref.kept[s], (
            f"segment {s} ({ref.policy[s]!r}): cache holds {sorted(held)}, "
            f"reference {sorted(ref.kept[s])}")
        for j, score in held.items():
            same = math.isclose(score, ref.score[s][j], rel_tol=1e-4, abs_tol=1e-5)
            assert math.isnan(score) or same, (
                f"segment {s}: score of position {j} is {score}, reference {ref.score[s][j]}")


class CheckedCache(Cache):
    """A FastGenCache checked against the reference on every call.

    Under a budget it decides alone (its prefill flushes its `Pending`): the
    reference checks the choice of one layer's heads by its own knapsack."""

    def __init__(self, cache, atol=1e-5):
        super().__init__()
        self.cache = cache
        m = cache.method
        self.ref = Reference(cache.policies, m.recovery, cache.prompt_lens.tolist(),
                             cache.n_kv_heads, cache.token_flags, m.rows, m.kv_budget,
                             cache.evict_every, cache.bits, span=m.span, weigh=m.weigh_values,
                             max_new_tokens=cache.max_new_tokens, ask_after=m.ask_after,
                             copies=cache.copies.tolist() if m.copies else None)
        self.atol = atol
        self.steps = 0
        self.tokens = 1

    def nbytes(self) -> int:
        return self.cache.nbytes()

    @staticmethod
    def reserve(caches, tokens=1):
        """`forward` reserves, and checks that it left room; a chunk's counts are
        given here (`cache.reserve`'s `tokens`)."""
        for c in caches:
            c.tokens = tokens

    def forward(self, q, k, v, input_pos, tokens):
        prefill = self.cache.pool is None
        if prefill:
            # What each policy keeps of the prompt by the cache's own ranking: the
            # reference breaks its near-ties (float32 against float64) the same way.
            c, m = self.cache, self.cache.method
            sums = attention_sums(q, k, c.prompt_lens, local_ratios(c.policies), m.rows)
            prompt, _ = scored_prompt(c, weigh(sums, v) if m.weigh_values else sums, tokens)
            keeps = [prompt.keeps(p) for p in c.policies]
            kept = [[set(prompt.pos[s][keep[s]].tolist()) for keep in keeps]
                    for s in range(len(prompt.pos))]
        else:
            T, tokens_taken, self.tokens = q.shape[2], self.tokens, 1
            chunk = T > 1 or not isinstance(tokens_taken, int)
            FastGenCache.reserve([self.cache], tokens_taken)
            before = State(self.cache)
            assert before.taking_ok if chunk else all(before.dest_ok), \
                "reserve pointed a segment at a slot not free or not its own"
        y = self.cache(q, k, v, input_pos, tokens)
        if prefill:
            self.cache.pending.flush()  # this layer's choice now, not with the others'
        state = State(self.cache)
        if prefill:
            self.ref.evict_every = self.cache.evict_every  # the default is set at prefill
            state.prompt_kept = kept
            if self.cache.bits is not None:  # bytes a token, a window, a full cache's token
                unit, window, full = token_costs(self.cache)
                self.ref.units = unit.tolist(), window.tolist(), full
            # A precision's error (profiling.precision_errors, tested apart) comes off the recovery.
            errors = 0 if self.cache.errors is None else self.cache.errors.double()
            expected = self.ref.prefill(q, k, v, tokens, state, self.cache.errors)
            if self.cache.recovery is None:  # a single policy measures none (cache.banded)
                assert len(self.cache.policies) == 1
            else:
                torch.testing.assert_close(self.cache.recovery.double(), self.ref.recovery - errors,
                                           atol=1e-4, rtol=0, msg=lambda m: f"{m}\n"
                                           f"{self.cache.recovery}\n{self.ref.recovery}\n{kept}")
            assert state.choice == self.ref.choice
            for b, L in enumerate(self.ref.lens):
                torch.testing.assert_close(y[b, :, :L].double(), expected[b, :, :L],
                                           atol=self.atol, rtol=0)
        elif not chunk:
            expected = self.ref.decode(q, k, v, input_pos, tokens, before)
            torch.testing.assert_close(y.double(), expected, atol=self.atol, rtol=0)
            self.steps += 1
        else:
            counts = [T] * len(q) if isinstance(tokens_taken, int) else list(tokens_taken)
            expected, rows = self.ref.chunk(q, k, v, input_pos, tokens, counts, before)
            for b, n in enumerate(counts):
                torch.testing.assert_close(y[b, :, :n].double(), expected[b, :, :n],
                                           atol=self.atol, rtol=0)
            if rows:  # the chunk chose every policy again
                state.held_keeps(self.cache)
                assert all(len(seen) == rows for seen in self.ref.observed.values())
                recovery = self.ref.choose_again(state.held_kept, state.choice, self.cache.errors)
                got = self.cache.recovery.double()
                offered = recovery > -math.inf
                torch.testing.assert_close(got[offered], recovery[offered], atol=1e-4, rtol=0,
                                           msg=lambda m: f"{m}\n{got}\n{recovery}")
                # A policy not offered is worth nothing a threshold or the knapsack would take.
                assert (got[~offered] <= -1).all(), got
                assert state.choice == self.ref.choice
        compare(self.ref, state)
        return y


def drive(method, stream, lens, n_heads, n_kv_heads, max_new_tokens, token_flags, *,
          head_dim=8, seed=0, scale=1.5, chunks=None, page=None, copies=None) -> CheckedCache:
    """Run a FastGenCache of `method` (cache.Method) and the reference on
    random queries, keys and values: a prefill of prompts `lens` long, then
    max_new_tokens - 1 decode steps, or the steps `chunks` lists: each a list
    of how many tokens each sequence takes (one for all: a decode step; more:
    a chunk, its width the most).

    stream: (B, width) token ids; sequence b's prompt is stream[b, :lens[b]]
    and its next tokens follow. `scale` sharpens attention so that heavy
    hitters stand out. `page` and `copies` (the KV heads that copy) go to FastGenCache.
    """
    g = torch.Generator().manual_seed(seed)
    B, T, D = len(lens), max(lens), head_dim
    randn = lambda *shape: torch.randn(*shape, generator=g)
    cache = FastGenCache(method, torch.tensor(lens), max_new_tokens, n_kv_heads, token_flags,
                         page=page, copies=copies)
    checked = CheckedCache(cache)
    with torch.no_grad():
        # Padding rows and columns hold junk that must not matter.
        checked(randn(B, n_heads, T, D) * scale, randn(B, n_kv_heads, T, D) * scale,
                randn(B, n_kv_heads, T, D), torch.arange(T).expand(B, T), stream[:, :T])
        pos = torch.tensor(lens)[:, None]
        for counts in chunks or [[1] * B] * (max_new_tokens - 1):
            n = max(counts)
            at = (pos + torch.arange(n)).clamp(max=stream.shape[1] - 1)
            if counts != [1] * B:
                CheckedCache.reserve([checked], counts)
            checked(randn(B, n_heads, n, D) * scale, randn(B, n_kv_heads, n, D) * scale,
                    randn(B, n_kv_heads, n, D), pos + torch.arange(n), stream.gather(1, at))
            pos = pos + torch.tensor(counts)[:, None]
    return checked
