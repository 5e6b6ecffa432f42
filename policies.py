"""KV cache policies: which tokens an attention head keeps.

A policy is a pure function from the tokens a group of heads holds to a keep-mask. Policies
combine with `|`; a union keeps a token when any member keeps it, so a token leaves a head's
cache only when no member wants it:

    Special() | Punct() | Frequent(0.3) | Local(0.3)

Each class's `keep` states its rule; the cache asks `Slots.keeps`, which remembers each member's
answer and each ranking (`Slots.top`), so that a menu of many policies sorts each ranking once.
One rule compresses the prompt at prefill and evicts while decoding, so the two cannot drift.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SPECIAL = 1  # bits of a token's flags, looked up from its id (see `token_flags`)
PUNCT = 2


@dataclass
class Slots:
    """The tokens held by N cache segments (one = a sequence x KV head), padded to width C."""
    pos: torch.Tensor         # (N, C) position of the token in its sequence; -1 = empty slot
    score: torch.Tensor       # (N, C) attention the token has received, summed over queries
    flags: torch.Tensor       # (N, C) SPECIAL / PUNCT bits
    seen: torch.Tensor        # (N, 1) tokens the sequence has seen so far, prompt included
    prompt_len: torch.Tensor  # (N, 1)
    # (N, 1) first query `score` counts: 0, or prompt_len - n for a window of n prompt rows
    first_query: torch.Tensor | None = None
    last: torch.Tensor | None = None  # (N, C) attention from the latest query alone
    # (N, C) each per-token field a policy declares (`Policy.token_fields`), by name
    fields: dict = field(default_factory=dict)
    # What policies computed here, so a menu computes each once; the tensors must not change.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def once(self, key, compute):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    @property
    def valid(self) -> torch.Tensor:
        return self.once("valid", lambda: self.pos >= 0)

    def keeps(self, policy: Policy) -> torch.Tensor:
        """Bool (N, C): `policy.keep(self)`, each member asked once."""
        kept = self.memo.get(policy)
        if kept is None:
            for m in policy.members():
                if m not in self.memo:
                    self.memo[m] = m.keep(self)
                kept = self.memo[m] if kept is None else kept | self.memo[m]
            self.memo[policy] = kept
        return kept

    def top(self, key, values, k: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Bool (N, C): the k (N, 1) valid slots (or of `valid`) with the largest `values()`, ties
        leftmost; the ranking sorted once per `key`, which names both."""
        valid = self.valid if valid is None else valid
        return valid & (self.once(key, lambda: ranks(values(), valid)) < k)

    @property
    def mean_score(self) -> torch.Tensor:
        """Attention per query that saw the token, so a token is not outranked for arriving late."""
        first = self.pos if self.first_query is None else torch.maximum(self.pos, self.first_query)
        return self.score / (self.seen - first).clamp(min=1)

    @staticmethod
    def cat(parts: list[Slots]) -> Slots:
        """The rows of several, each padded with empty slots to the widest."""
        C = max(s.pos.shape[1] for s in parts)

        def wide(ts, fill=0):  # (N, C) fields, padded
            return torch.cat([torch.nn.functional.pad(t, (0, C - t.shape[1]), value=fill)
                              for t in ts])

        def column(ts):  # (N, 1), or None
            return None if ts[0] is None else torch.cat(ts)
        return Slots(wide([s.pos for s in parts], -1), wide([s.score for s in parts]),
                     wide([s.flags for s in parts]), column([s.seen for s in parts]),
                     column([s.prompt_len for s in parts]), column([s.first_query for s in parts]),
                     None if parts[0].last is None else wide([s.last for s in parts]),
                     {name: wide([s.fields[name] for s in parts]) for name in parts[0].fields})

    def __getitem__(self, rows) -> Slots:
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return Slots(self.pos[rows], self.score[rows], self.flags[rows], self.seen[rows],
                     self.prompt_len[rows], pick(self.first_query), pick(self.last),
                     {name: t[rows] for name, t in self.fields.items()})


def share(r: float, n: torch.Tensor) -> torch.Tensor:
    """ceil(r * n), in float64 so that ceil(0.3 * 10) is 3, not 4."""
    return torch.ceil(n.double() * r - 1e-9).long()


def shares(rs, n: torch.Tensor) -> torch.Tensor:
    if len(rs) == 1:  # one policy (a cache evicting): no tensor of ratios to build
        return share(rs[0], n)[None]
    r = torch.tensor(rs, dtype=torch.float64, device=n.device).view(-1, *[1] * n.dim())
    return torch.ceil(n.double() * r - 1e-9).long()


def ranks(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N, C) each slot's rank by value: largest first, invalid last, leftmost first if equal."""
    order = values.masked_fill(~valid, -float("inf")).argsort(dim=-1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))


class Policy:
    """Base class: `keep` is the rule; the attributes say what a cache must keep for it."""

    # What a cache asks of a policy, so that it never asks for its class:
    never_evicts = False  # keeps every new token: decoding never asks `keep`
    keeps_all = False     # keeps everything, a chunk read included: never asked at all
    reads_last = False    # `keep` reads `Slots.last`, which the cache then keeps up to date
    rows = 1              # the last prompt rows its ranking reads (None: every row)
    band = None           # a window of this share of the prompt: profiling sums its band
    # Per-token fields it reads besides position, flags and scores: name -> a function of the
    # token's key and value, (..., D) each, to (...) float32. The cache stores each one for
    # every token it holds, measured as the token is written, and hands it to `keep` as
    # `Slots.fields[name]`.
    token_fields: dict = {}

    def keep(self, s: Slots) -> torch.Tensor:
        raise NotImplementedError

    def growth(self, prompt: Slots) -> torch.Tensor:
        """(N,) share of new tokens it holds, its budget cost, from the prompt if text-dependent."""
        return prompt.pos.new_zeros(prompt.pos.shape[0], dtype=torch.float32)

    def members(self) -> tuple[Policy, ...]:
        return (self,)

    def __or__(self, other: Policy) -> Policy:
        return Union(*self.members(), *other.members())

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):  # memo keys: hashed hundreds of times a layer
        return hash((type(self), *vars(self).values()))

    def __repr__(self):
        args = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in vars(self).values())
        return f"{type(self).__name__}({args})" if args else type(self).__name__


class Special(Policy):
    """Special tokens (BOS, `<|im_start|>`, ...) and the first token, the sink if there's no BOS."""

    def keep(self, s):
        return s.valid & (((s.flags & SPECIAL) != 0) | (s.pos == 0))

    def growth(self, prompt):
        return (prompt.valid & ((prompt.flags & SPECIAL) != 0)).sum(1) / prompt.prompt_len[:, 0]


class Punct(Policy):
    """Tokens whose text is only punctuation."""

    def keep(self, s):
        return s.valid & ((s.flags & PUNCT) != 0)

    def growth(self, prompt):
        return self.keep(prompt).sum(1) / prompt.prompt_len[:, 0]


class Local(Policy):
    """The most recent ceil(r * prompt_len) tokens: a window that slides."""

    def __init__(self, r: float):
        self.r = r

    @property
    def band(self):
        return self.r

    def window(self, s: Slots) -> torch.Tensor:
        return share(self.r, s.prompt_len)

    def keep(self, s):
        return s.valid & (s.pos >= s.seen - self.window(s))

class Frequent(Policy):
    """Heavy hitters: the ceil(r * seen) most attended tokens. `by="sum"` sums over queries (the
    paper, H2O), so a new token, at 0 against prompt tokens hundreds of queries scored, rarely gets
    in; `by="mean"` averages over the queries that saw it, and the newest enters (ScissorHands,
    cold-compress's FastGen)."""

    rows = None  # every prompt row's attention (the cache may read fewer: `Method.rows`)

    def __init__(self, r: float, by: str = "sum"):
        if by not in ("sum", "mean"):
            raise ValueError(f"Frequent ranks by 'sum' or 'mean', not {by!r}")
        self.r, self.by = r, by

    def keep(self, s):
        key = "score" if self.by == "sum" else "mean score"
        return s.top(key, lambda: self.values(self.by, s), share(self.r, s.seen))

    @staticmethod
    def values(by, s):
        if by == "sum":
            return s.score
        return s.mean_score.masked_fill(s.pos == s.seen - 1, float("inf"))

    def growth(self, prompt):
        return prompt.pos.new_full((prompt.pos.shape[0],), self.r, dtype=torch.float32)

    def __repr__(self):
        return f"Frequent({self.r:g})" if self.by == "sum" else f"Frequent({self.r:g}, mean)"


class Sink(Policy):
    """The first n tokens of the sequence (StreamingLLM's attention sinks)."""

    def __init__(self, n: int = 4):
        self.n = n

    def keep(self, s):
        return s.valid & (s.pos < self.n)


class Full(Policy):
    """Everything: the head is not compressed."""

    never_evicts = keeps_all = True

    def keep(self, s):
        return s.valid

    def growth(self, prompt):
        return prompt.pos.new_ones(prompt.pos.shape[0], dtype=torch.float32)


class TOVA(Policy):
    """The ceil(r * prompt_len) tokens the latest query attends to most (Oren et al., 2024): a
    fixed-size cache that evicts the least attended token each step."""

    reads_last = True

    def __init__(self, r: float):
        self.r = r

    def keep(self, s):
        return s.top("last", lambda: s.last, share(self.r, s.prompt_len))

class SnapKV(Policy):
    """SnapKV (Li et al., 2024): the last `window` prompt tokens, the ceil(r * prompt_len) -
    window older ones that window attends to most (scores max-pooled over `kernel` so that a kept
    token brings its context) and every new token. The cache must score the prompt with the same
    observation window."""

    never_evicts = True  # the prompt is compressed once (see `keep`); new tokens stay

    def __init__(self, r: float, window: int = 32, kernel: int = 7):
        self.r, self.window, self.kernel = r, window, kernel

    @property
    def rows(self):
        return self.window

    def keep(self, s):
        older = s.valid & (s.pos < s.prompt_len - self.window)
        budget = (share(self.r, s.prompt_len) - self.window).clamp(min=0)
        pooled = s.top(("snapkv", self.window, self.kernel),
                       lambda: self.pooled(self.kernel, s), budget, older)
        return (s.valid & ~older) | pooled

    @staticmethod
    def pooled(kernel, s):
        """(N, C) scores max-pooled by position (slots are in order only at prefill), 0 if empty."""
        width = int(s.pos.max()) + 2  # every position, and one column for empty slots
        at = s.pos.masked_fill(~s.valid, width - 1).long()
        by_pos = s.score.new_zeros(len(at), width).scatter_(1, at, s.score.masked_fill(~s.valid, 0))
        by_pos = torch.nn.functional.max_pool1d(by_pos[:, None, :-1], kernel, 1, kernel // 2)[:, 0]
        return torch.nn.functional.pad(by_pos, (0, 1)).gather(1, at)

    def growth(self, prompt):
        return prompt.pos.new_ones(prompt.pos.shape[0], dtype=torch.float32)


class Union(Policy):
    """Keeps a token when any member keeps it. Build it with `|`."""

    def __init__(self, *members: Policy):
        self._members = tuple(dict.fromkeys(members))  # drop repeats, keep order
        self._hash = hash(self._members)

    def members(self):
        return self._members

    @property
    def never_evicts(self):
        return any(m.never_evicts for m in self._members)

    @property
    def reads_last(self):
        return any(m.reads_last for m in self._members)

    @property
    def token_fields(self):
        return {name: f for m in self._members for name, f in m.token_fields.items()}

    @property
    def keeps_all(self):
        return any(m.keeps_all for m in self._members)

    @property
    def rows(self):
        rows = [m.rows for m in self._members]
        return None if None in rows else max(rows)

    def keep(self, s):
        kept = self._members[0].keep(s)
        for m in self._members[1:]:
            kept = kept | m.keep(s)
        return kept

    def growth(self, prompt):
        return sum(prompt.once(("growth", m), lambda m=m: m.growth(prompt))
                   for m in self._members).clamp(max=1)

    def __eq__(self, other):
        return isinstance(other, Union) and self._members == other._members

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return " | ".join(map(repr, self._members))


def shortlist(r_local: float = 0.3, r_frequent: float = 0.3, by: str = "sum") -> list[Policy]:
    """The paper's greedy shortlist, cheapest first; profiling picks the first past threshold."""
    s, p, f, l = Special(), Punct(), Frequent(r_frequent, by), Local(r_local)
    return [s, s | p, s | p | f, s | p | f | l, Full()]


RATIOS = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)


def menu(r_local: float = 0.3, r_frequent: float = 0.3, by: str = "mean",
         ratios=RATIOS) -> list[Policy]:
    """What a head may take under a byte budget: the shortlist and every fixed baseline at several
    sizes. Not Full, which buys a head's last bit of recovery with all of it."""
    shapes = [[baseline(kind, r, by) for r in ratios] for kind in FIXED]
    return list(dict.fromkeys(shortlist(r_local, r_frequent, by)[:-1] + sum(shapes, [])))


# The fixed policies by name, each keeping about `budget` of the prompt (`by`: how heavy hitters
# rank): `--kv NAME` runs one on every head, and the default's menu offers each at every size
# of RATIOS. A policy registered here is offered everywhere.
FIXED = {
    "local": lambda budget, by: Local(budget),
    "sink": lambda budget, by: Sink(4) | Local(budget),  # StreamingLLM: sinks and a window
    "h2o": lambda budget, by: Frequent(budget / 2, by) | Local(budget / 2),
    "tova": lambda budget, by: TOVA(budget),
    "snapkv": lambda budget, by: SnapKV(budget),
}


def baseline(kind: str, budget: float, by: str = "sum") -> Policy:
    """A fixed policy for every head (`FIXED`, or Full), keeping about `budget` of the prompt."""
    if kind == "full":
        return Full()
    if kind not in FIXED:
        raise ValueError(f"unknown baseline {kind!r}")
    return FIXED[kind](budget, by)


def token_flags(vocab_size: int, special_ids, punct_ids) -> torch.Tensor:
    """(V,) uint8 table of SPECIAL / PUNCT bits, indexed by token id."""
    flags = torch.zeros(vocab_size, dtype=torch.uint8)
    flags[list(punct_ids)] |= PUNCT
    flags[list(special_ids)] |= SPECIAL
    return flags
