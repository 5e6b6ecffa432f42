"""KV cache policies: which tokens an attention head keeps.

A policy is a pure function from the tokens a group of heads holds to a
keep-mask. Policies combine with `|`; a union keeps a token when any member
keeps it, so a token leaves a head's cache only when no member wants it.

    Special() | Punct() | Frequent(0.3) | Local(0.3)

The same `keep` runs on the prompt at the end of prefill (to compress it) and
on the cache after every decode step (to evict), so the two can never drift.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Bits of a token's flags, looked up from its id (see `token_flags`).
SPECIAL = 1
PUNCT = 2


@dataclass
class Slots:
    """The tokens held by N cache segments (one segment = one sequence x KV head),
    padded to a common width C. Every tensor is (N, C) or (N, 1)."""
    pos: torch.Tensor         # (N, C) position of the token in its sequence; -1 = empty slot
    score: torch.Tensor       # (N, C) cumulative attention the token has received
    flags: torch.Tensor       # (N, C) SPECIAL / PUNCT bits
    seen: torch.Tensor        # (N, 1) tokens the sequence has seen so far, prompt included
    prompt_len: torch.Tensor  # (N, 1)

    @property
    def valid(self) -> torch.Tensor:
        return self.pos >= 0

    def __getitem__(self, rows) -> Slots:
        """The same slots for a subset of segments."""
        return Slots(self.pos[rows], self.score[rows], self.flags[rows],
                     self.seen[rows], self.prompt_len[rows])


def share(r: float, n: torch.Tensor) -> torch.Tensor:
    """ceil(r * n), in float64 so that ceil(0.3 * 10) is 3, not 4."""
    return torch.ceil(n.double() * r - 1e-9).long()


class Policy:
    """Base class. Subclasses implement `keep` and `bound`."""

    def keep(self, s: Slots) -> torch.Tensor:
        """Bool (N, C): which of the held tokens this policy keeps."""
        raise NotImplementedError

    def bound(self, prompt: Slots, max_seen: torch.Tensor) -> torch.Tensor:
        """(N,) upper bound on the tokens kept at any point while a sequence
        grows to `max_seen` tokens; the cache reserves this much up front."""
        raise NotImplementedError

    def members(self) -> tuple[Policy, ...]:
        return (self,)

    def __or__(self, other: Policy) -> Policy:
        return Union(*self.members(), *other.members())

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))

    def __repr__(self):
        args = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in vars(self).values())
        return f"{type(self).__name__}({args})" if args else type(self).__name__


class Special(Policy):
    """Special tokens (BOS, `<|im_start|>`, ...) and the sequence's first token,
    which serves as the attention sink in models that add no BOS."""

    def keep(self, s):
        return s.valid & (((s.flags & SPECIAL) != 0) | (s.pos == 0))

    def bound(self, prompt, max_seen):
        return self.keep(prompt).sum(-1) + (max_seen - prompt.prompt_len[:, 0])


class Punct(Policy):
    """Tokens whose text is only punctuation."""

    def keep(self, s):
        return s.valid & ((s.flags & PUNCT) != 0)

    def bound(self, prompt, max_seen):
        return self.keep(prompt).sum(-1) + (max_seen - prompt.prompt_len[:, 0])


class Local(Policy):
    """The most recent ceil(r * prompt_len) tokens: a window that slides."""

    def __init__(self, r: float):
        self.r = r

    def window(self, s: Slots) -> torch.Tensor:
        return share(self.r, s.prompt_len)

    def keep(self, s):
        return s.valid & (s.pos >= s.seen - self.window(s))

    def bound(self, prompt, max_seen):
        return self.window(prompt)[:, 0]


class Frequent(Policy):
    """Heavy hitters: the ceil(r * seen) tokens with the most cumulative attention."""

    def __init__(self, r: float):
        self.r = r

    def keep(self, s):
        score = s.score.masked_fill(~s.valid, -float("inf"))
        order = score.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
        return s.valid & (rank < share(self.r, s.seen))

    def bound(self, prompt, max_seen):
        return share(self.r, max_seen)


class Sink(Policy):
    """The first n tokens of the sequence (StreamingLLM's attention sinks)."""

    def __init__(self, n: int = 4):
        self.n = n

    def keep(self, s):
        return s.valid & (s.pos < self.n)

    def bound(self, prompt, max_seen):
        return torch.full_like(max_seen, self.n)


class Full(Policy):
    """Everything: the head is not compressed."""

    def keep(self, s):
        return s.valid

    def bound(self, prompt, max_seen):
        return max_seen


class Union(Policy):
    """Keeps a token when any member keeps it. Build it with `|`."""

    def __init__(self, *members: Policy):
        self._members = tuple(dict.fromkeys(members))  # drop repeats, keep order

    def members(self):
        return self._members

    def keep(self, s):
        kept = self._members[0].keep(s)
        for m in self._members[1:]:
            kept = kept | m.keep(s)
        return kept

    def bound(self, prompt, max_seen):
        total = sum(m.bound(prompt, max_seen) for m in self._members)
        return torch.minimum(total, max_seen)

    def __eq__(self, other):
        return isinstance(other, Union) and self._members == other._members

    def __hash__(self):
        return hash(self._members)

    def __repr__(self):
        return " | ".join(map(repr, self._members))


def shortlist(r_local: float = 0.3, r_frequent: float = 0.3) -> list[Policy]:
    """The paper's greedy shortlist, cheapest first; profiling picks the first
    one whose attention recovery reaches the threshold."""
    s, p, f, l = Special(), Punct(), Frequent(r_frequent), Local(r_local)
    return [s, s | p, s | p | f, s | p | f | l, Full()]


def baseline(kind: str, budget: float) -> Policy:
    """A fixed policy for every head, keeping about `budget` of the prompt."""
    if kind == "full":
        return Full()
    if kind == "local":
        return Local(budget)
    if kind == "sink":  # StreamingLLM: attention sinks + window
        return Sink(4) | Local(budget)
    if kind == "h2o":  # heavy hitters + window, half the budget each
        return Frequent(budget / 2) | Local(budget / 2)
    raise ValueError(f"unknown baseline {kind!r}")


def token_flags(vocab_size: int, special_ids, punct_ids) -> torch.Tensor:
    """(V,) uint8 table of SPECIAL / PUNCT bits, indexed by token id."""
    flags = torch.zeros(vocab_size, dtype=torch.uint8)
    flags[list(punct_ids)] |= PUNCT
    flags[list(special_ids)] |= SPECIAL
    return flags
