"""The FastGen KV cache: every attention head keeps only what its policy needs.

A *segment* is one (sequence, KV head) pair. A `Method` names the policies a segment may take
and how it chooses: the default (`default_method`), the paper's (`paper_method`), or one fixed
policy for every head (`fixed_method`). The method, in the order it runs:

1. Prefill, `FastGenCache.prefill`: attend over the prompt; hold its K, V and the queries
   profiling reads. Layers wait in `Pending` and decide together (`decide`).
2. Profile, `profile_layers`: how much of each segment's prompt attention each policy recovers
   (profiling.py).
3. Choose, `choose_policies`: under a threshold, the paper's rule, the shortlist's first policy
   to reach it; under a byte budget, one knapsack per sequence over the heads of SCOPE layers
   (read again, of every layer).
   A head that copies (`copy_heads`) keeps every token where that is affordable.
4. Compress, `compress`: keep what each policy keeps of the prompt in a pool sized to it
   (pool.py).
5. Decode, `FastGenCache.decode`: write the token to a free slot of its segment, attend to what
   the segment holds, add each held token's attention to its score.
6. Evict, `evict`, run by `reserve` before a step: every `evict_every` tokens, free what each
   policy lets go; then hand each segment its next free slots.
7. Chunk, `FastGenCache.chunk`: T tokens at once, a chat's next turn or a prompt in pieces, as
   T decode steps; its last rows choose the policies again (`choose_again`).

With `Method.ask_after` (`--ask-after`), deciding waits until the prompt is read again
(generation.read_again, `cache.read_again`). A prompt token's score is then the most
attention that reading gives it, times READ_WEIGHT, or what the prompt's last rows gave it,
where more; the knapsack keeps the most score over the heads, as KVzip does. A chunk read again
chooses again, every layer at once (`reading_profiles`, `choose_again`), by what its reading
gave each held token, its own rows adding nothing; read by its lower layers alone (a chat's later
turns), the layers above take each token's most from below (`read_piece`).
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass

import torch

import pool
from model import Cache, causal_attention
from policies import Full, Policy, Slots, baseline, menu, shortlist
from profiling import (COPY_SHARE, Profile, attention_sums, choose, fit_budgets, held_profile,
                       induction_scores, local_ratios, precision_errors, prompt_slots, recoveries,
                       read_again_profile, read_again_sums, squared_losses, weigh)
from quant import rounds, token_bytes, window_bytes

# Letters in shape comments: B batch, K KV heads, H query heads, G = H // K,
# S = B*K segments, T prompt tokens, L layers, M policies, D head dimension.

# The constants below were chosen by measurement; studies/README.md gives each its study.
EVICT_EVERY = 8  # tokens between evictions, at least; a segment holds at most this many extra
# Prompt K, V, queries that layers in `Pending` may hold (threshold mode), besides one layer's.
HELD_BYTES = 16 << 20
# The default's profile: the last ROWS prompt rows, each token scored over SPAN tokens; its
# budget shared by the heads of SCOPE layers.
ROWS, SPAN, SCOPE = 32, 16, 6
# A piece read again attends to the prompt's first READ_SINKS tokens and to its tokens from
# READ_BEFORE before the part it repeats to that part's end.
READ_SINKS, READ_BEFORE = 4, 1024
# What reading the prompt again gives a token weighs this much against the attention its last
# ROWS rows gave it. A chunk read again is scored by its reading alone, not weighed: its rows add
# nothing (`FastGenCache.chunk`).
READ_WEIGHT = 0.25
# Random tokens said twice (COPY_PROBE of them) find the heads that copy (`copy_heads`). They
# keep every token, at COPY_BITS or more (fewer garble the numbers they copy), where a head kept
# so costs at most COPY_COST times a head's share of the budget.
COPY_PROBE, COPY_COST, COPY_BITS = 96, 2, 8
# What a rounding error (profiling.precision_errors) weighs against the attention a policy
# evicts: a rounded token changes the output less than an evicted one.
ROUNDING_WEIGHT = 0.25

UNRESERVED = ("a compressed cache's decode step ran without its reservation: call "
              "reserve(model.caches()) before each compiled step (it evicts and hands "
              "out the slots the step writes to)")
UNREAD = ("a cache that chooses for questions asked after the prompt (ask_after) decides once "
          "the prompt is read again: call generation.read_again(model, tokens, prompt_lens) "
          "after the prefill, as generation.prefill does")


class ReadEnough(Exception):
    """Raised by the last layer a reading again reads (`read_piece`): the forward stops."""


def budget_window(kv_budget: float) -> int:
    """The newest tokens a 4- or 2-bit head keeps to about 8 bits under the default's budget: 256
    times the budget, from 32 to 128, about a tenth of a head's bytes at every budget."""
    return min(128, max(32, round(256 * kv_budget)))


@dataclass(frozen=True)
class Method:
    """What a FastGen cache runs: the policies a segment may take and how it chooses.

    policies : tuple of Policy
        one for every segment, the paper's shortlist, or the default's menu
    kv_bits : tuple of int, optional
        each policy's precision (quant.py); None: the model's dtype
    recovery : float, default 1.0
        threshold mode (the paper's): take the first policy recovering this share; 1 keeps all
    kv_budget : float, optional
        budget mode: SCOPE layers (read again, every layer) share this much of a full cache's
        tokens (kv_bits: 16-bit bytes)
    rows : int, optional
        the last prompt rows profiling reads; None: every row
    span : int, default 1
        a prompt token scores the most attention of the span tokens up to it
    weigh_values : bool, default False
        a prompt token's attention counts times its value's norm
    evict_every : int, optional
        tokens between evictions; None: half a page, at least EVICT_EVERY
    ask_after : bool, default False
        profile by the context read again (generation.read_again), for questions asked after
        it, and by its last rows: each head is worth the score it keeps, not its squared loss
    window : int, optional
        newest tokens a 4- or 2-bit head also keeps to about 8 bits (pool.py); None: quant.WINDOW
    copies : bool, default False
        a KV head that copies (`copy_heads`) takes only a policy keeping every token, at COPY_BITS
        or more (`copying`)
    """
    policies: tuple[Policy, ...]
    kv_bits: tuple[int, ...] | None = None
    recovery: float = 1.0
    kv_budget: float | None = None
    rows: int | None = None
    span: int = 1
    weigh_values: bool = False
    evict_every: int | None = None
    ask_after: bool = False
    window: int | None = None
    copies: bool = False

    def __post_init__(self):
        object.__setattr__(self, "policies", tuple(self.policies))
        if self.kv_bits is not None:
            object.__setattr__(self, "kv_bits", tuple(self.kv_bits))
            if len(self.kv_bits) != len(self.policies):
                raise ValueError(f"kv_bits: one precision per policy (got {len(self.kv_bits)} "
                                 f"for {len(self.policies)})")
        if self.evict_every is not None and self.evict_every < 1:
            raise ValueError(f"evict_every must be at least 1 (got {self.evict_every})")


def at_bits(policies: list[Policy], kv_bits) -> tuple[list[Policy], list[int] | None]:
    """Each policy's precision: one for all, or every policy at each, plus Full below 16 bits."""
    if not kv_bits:
        return policies, None
    if len(kv_bits) == 1:
        return policies, list(kv_bits) * len(policies)
    items = [(p, b) for b in kv_bits for p in policies + [Full()] * (b < 16)]
    return [p for p, _ in items], [b for _, b in items]


def default_method(kv_budget: float = 0.5, kv_bits=None, ask_after: bool = False) -> Method:
    """FastGen's default: the menu under a byte budget, heavy hitters by mean attention; the heads
    that copy keep every token where that costs at most COPY_COST times a head's share."""
    policies, bits = at_bits(menu(by="mean"), kv_bits)
    # A head kept whole costs COPY_BITS / 16 of a 16-bit one where the menu has Full at COPY_BITS
    # or more; in the model's dtype all of it, and Full joins the menu for them alone.
    whole = 1 if bits is None else COPY_BITS / 16 if any(copying(policies, bits)) else math.inf
    # Read again too: the reading alone keeps a needle's later digits in few heads.
    copies = whole <= COPY_COST * kv_budget
    if copies and whole == 1:
        policies = policies + [Full()]
    # Read again, a 4- or 2-bit head's window stays quant.WINDOW.
    return Method(policies, bits, kv_budget=kv_budget, rows=ROWS, span=1 if ask_after else SPAN,
                  weigh_values=not ask_after, ask_after=ask_after,
                  window=None if ask_after else budget_window(kv_budget), copies=copies)


def paper_method(recovery: float = 0.95, kv_bits=None) -> Method:
    """The paper's method: its shortlist (heavy hitters by summed attention) under a threshold."""
    policies, bits = at_bits(shortlist(), kv_bits)
    return Method(policies, bits, recovery=recovery, rows=None, evict_every=1)


def fixed_method(kind: str, kv_budget: float = 0.5, kv_bits=None,
                 ask_after: bool = False) -> Method:
    """One policy (policies.baseline) for all, profiled on the rows its ranking reads."""
    policy = baseline(kind, kv_budget)
    policies, bits = at_bits([policy], kv_bits)
    return Method(policies, bits, rows=policy.rows, ask_after=ask_after)


@dataclass
class Clock:
    """Where decoding stands: a plain object, as nn.Module attribute writes run Python checks."""
    steps: int = 0  # decode steps reserved so far
    since: int = 0  # tokens taken since the last eviction: decode steps and chunks
    read: bool = False  # a chunk was read since the last eviction
    ready: int = 0  # tokens per sequence the next step's slots are handed out for (`reserve`)
    chunk: bool = False  # the next step is a chunk (`reserve` had counts, or more than one)


def now(device) -> float:
    """Seconds, for profile_s, once the device has finished what it was given."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class FastGenCache(Cache):
    """One layer's compressed cache.

    method : Method
        what it runs
    prompt_lens : (B,) tensor
        each sequence's prompt length (of its first chunk, when read in chunks)
    max_new_tokens : int
        tokens each sequence is planned to generate (the budget counts them)
    n_kv_heads : int
        KV heads of the layer (this rank's, under tensor parallel)
    token_flags : (V,) uint8 tensor
        SPECIAL / PUNCT bits of every token id (policies.token_flags)
    page : int, optional
        slots a page holds; None: by prompt length (pool.page_size)
    pending : Pending, optional
        the layers that decide together; None: this one alone
    copies : (n_kv_heads,) bool tensor, optional
        the KV heads that copy (`copy_heads`), where `method.copies`
    """

    def __init__(self, method: Method, prompt_lens, max_new_tokens: int, n_kv_heads: int,
                 token_flags, *, page: int | None = None, pending: Pending | None = None,
                 copies=None):
        super().__init__()
        if page is not None and page < 1:
            raise ValueError(f"page must be at least 1 (got {page})")
        self.method = method
        self.policies = list(method.policies)
        # The per-token fields the policies declare: name -> its function of a token's k and v.
        self.measures = {n: f for p in self.policies for n, f in p.token_fields.items()}
        self.bits = None if method.kv_bits is None else list(method.kv_bits)
        # Share of each sequence's bytes when choosing again: its part (`choose_policies`).
        self.share = method.kv_budget
        self.errors = None  # (S, len(policies)): what each policy's precision costs (`decide`)
        # Whether a head of this layer, on any rank, took a policy that reads the latest query's
        # attention: the pool then keeps it for every head, so choosing again may offer it to any.
        self.reads_last = False
        lens = prompt_lens  # (B,)
        self.page = page or pool.page_size(int(lens.max()))
        self.evict_every = method.evict_every or max(EVICT_EVERY, self.page // 2)
        self.max_new_tokens, self.n_kv_heads = max_new_tokens, n_kv_heads
        self.register_buffer("prompt_lens", prompt_lens, persistent=False)
        self.register_buffer("token_flags", token_flags, persistent=False)
        # (S,): the segments that may take only a policy keeping every token (`not_offered`).
        copies = torch.zeros(n_kv_heads, dtype=torch.bool) if copies is None else copies
        self.copies = copies.to(lens.device).repeat(len(lens))
        self.pool = None  # built by `compress`
        self.choice = self.recovery = None  # the plan, (S,) and (S, len(policies))
        self.profile_s = 0.0  # prefill time spent profiling, choosing and compressing
        self.clock = Clock()
        self.pending = Pending(1) if pending is None else pending
        self.held = None  # from prefill until `decide`: (q's rows read, k, v, tokens)
        self.all_rows = None  # every prompt row's Profile, prefill to `decide`, where it is read
        self.reads_next = False  # the next forward reads again (`read_piece`)
        self.reads_above = False  # ... or not: the layer is above those read (`read_piece`)
        self.reads_last = False  # ... and the forward stops after its reading (`ReadEnough`)
        self.read_scores = None  # what reading again gave what is held: (S, T), or (n, C) a group
        self.counts = None  # (B,) tokens of each sequence the next chunk or reading again takes
        self.read_from = None  # (B,) the prompt position where the part read again starts
        rows = method.rows
        self.first_row = 0 if rows is None else int((lens - lens.clamp(max=rows)).min())

    @property
    def ranks(self) -> bool:
        """Whether a policy may rank the held tokens (by score or flags): not where all keep all."""
        return self.method.ask_after or not all(p.keeps_all for p in self.policies)

    def forward(self, q, k, v, input_pos, tokens):
        if self.reads_next:
            y = read_again(self, q, k, v)
            if self.reads_last:  # no layer above needs its output
                raise ReadEnough
            return y
        if self.pool is None:
            if self.held is not None:  # the prompt waits for `decide`: only reading again does
                raise RuntimeError(UNREAD)
            return self.prefill(q, k, v, tokens)
        if q.shape[2] > 1 or self.clock.chunk:
            return self.chunk(q, k, v, input_pos, tokens)
        return self.decode(q, k, v, input_pos, tokens)

    def prefill(self, q, k, v, tokens):
        """Attend over the prompt; hold what `Pending` needs to decide (of q, the rows profiled)."""
        t0 = now(q.device)
        self.held = (q[:, :, self.first_row:].contiguous(), k, v, tokens)
        # Every row profiled and no band (h2o's): profile now, while q is whole.
        if self.method.rows is None and not banded(self.policies) and not self.method.ask_after:
            self.all_rows = attention_sums(q, k, self.prompt_lens)
        self.head_dim = k.shape[-1]
        self.profile_s = now(q.device) - t0
        self.pending.add(self)
        return causal_attention(q, k, v)

    def follow(self, choice: list[int]):
        """Each segment's policy as eviction asks it, -1 none: after a chunk, all but those that
        keep all (`drops_by`); while decoding, not those that never evict either (`evicts_by`)."""
        drops = [-1 if self.policies[i].keeps_all else i for i in choice]
        evicts = [-1 if i < 0 or self.policies[i].never_evicts else i for i in drops]
        self.drops_by.copy_(torch.tensor(drops))
        self.evicts_by.copy_(torch.tensor(evicts))
        self.drops, self.evicting = max(drops) >= 0, max(evicts) >= 0  # on the host

    def decode(self, q, k, v, input_pos, tokens):
        """One token per sequence, in the slot `reserve` handed out: attend, then score."""
        if self.clock.ready != 1:
            # Without its reservation the step would write over the last one's slot and never
            # evict: wrong logits, in silence.
            if torch.compiler.is_compiling():
                raise RuntimeError(UNRESERVED)
            reserve([self])
        self.clock.ready = 0
        B, H, _, D = q.shape
        K = self.n_kv_heads
        S = B * K
        pos = input_pos.expand(B, K).reshape(S)
        flags = self.token_flags[tokens].expand(B, K).reshape(S)
        self.pool.write(k.reshape(S, D), v.reshape(S, D), pos, flags)
        y, last = self.pool.attend(q.view(S, H // K, D))
        self.pool.add_scores(last)
        return y.view(B, H, 1, D)

    def chunk(self, q, k, v, input_pos, tokens):
        """T tokens per sequence, as T decode steps whose eviction waits for `reserve`. It counts
        as read, like the prompt (policies size windows by what was read). A sequence may take
        fewer than T (`reserve`'s counts); its other tokens are padding, never held."""
        B, H, T, D = q.shape
        K = self.n_kv_heads
        S = B * K
        if self.clock.ready != T:  # eager only: chunks are never compiled
            reserve([self], T)
        self.clock.ready, self.clock.chunk = 0, False
        counts = self.counts.repeat_interleave(K)  # (S,)
        valid = torch.arange(T, device=q.device) < counts[:, None]  # (S, T)
        at = input_pos[:, None].expand(B, K, T).reshape(S, T)
        flags = self.token_flags[tokens][:, None].expand(B, K, T).reshape(S, T)
        self.pool.write(k.reshape(S * T, D), v.reshape(S * T, D),
                        at.masked_fill(~valid, -1).view(-1), flags.reshape(-1),
                        self.pool.taken(T).reshape(-1), per=T)
        # The rows that choose again: the chunk's last, if every sequence has them.
        rechoose = len(self.policies) > 1 and bool(valid[:, -1].all()) and not self.method.ask_after
        R = min(self.method.rows or T, T) if rechoose else 0
        # A chunk read again is scored by its reading alone: its rows add nothing.
        y = self.pool.attend_chunk(q.reshape(S, H // K, T, D), at, valid, observe=R,
                                   sums=not self.method.ask_after)
        self.seg_prompt_len += counts
        if R:
            rows, ratios = at[:, T - R:], local_ratios(self.policies)
            profiles = [held_profile(seen, self.slots(g), rows[g.seg.to(rows.device)], ratios)
                        for g, seen in zip(self.pool.groups, self.pool.observed)]
            choose_again([self], [profiles])
        return y.view(B, H, T, D)

    # --- What the cache holds ------------------------------------------------------

    def seen(self) -> torch.Tensor:
        """(S,) tokens each segment's sequence has seen: the prompt, every chunk, and one per
        reserved step (between steps, every reserved step has run)."""
        return self.seg_prompt_len + self.steps

    @property
    def steps(self) -> int:
        return self.clock.steps

    def slots(self, g: pool.Group) -> Slots:
        """A group's slots as (n, C) views of the pool: writing to `pos` frees slots. A pool that
        ranks nothing (`ranks`) keeps no score or flags: zeros."""
        seg, p = g.seg, self.pool
        pos = g.block(p.pos)
        score, flags = ((g.block(p.score), g.block(p.flags)) if "score" in p.fields else
                        (pos.new_zeros(pos.shape, dtype=torch.float), torch.zeros_like(pos)))
        return Slots(pos, score, flags, self.seen()[seg, None],
                     self.seg_prompt_len[seg, None], self.seg_first_query[seg, None],
                     g.block(p.last) if "last" in p.fields else None,
                     {name: g.block(getattr(p, name)) for name in p.measures})

    def need(self) -> int:
        """Free slots each segment needs until the next eviction (past the tokens planned, as in
        a chat, a round's worth)."""
        E = self.evict_every
        remaining = self.max_new_tokens - 1 - self.steps
        return min(E - self.clock.since % E, remaining) if remaining > 0 else E

    @staticmethod
    def reserve(caches: list[FastGenCache], tokens=1):
        reserve(caches, tokens)

    def nbytes(self) -> int:
        if self.pool is None:
            return 0
        own = (self.seg_prompt_len, self.seg_first_query, self.evicts_by, self.drops_by)
        return self.pool.nbytes() + sum(t.nbytes for t in own)

    def kept(self) -> int:
        return self.pool.kept() if self.pool is not None else 0

    def growths(self) -> int:  # times a group widened (each a new shape for compiled code)
        return self.pool.n_growths if self.pool is not None else 0

    def plan(self) -> list[Policy]:
        """The policy of each segment (sequence-major, then KV head)."""
        return [self.policies[i] for i in self.choice.tolist()]

    def plan_names(self) -> list[str]:
        if self.bits is None:
            return [repr(p) for p in self.plan()]
        return [f"{self.policies[i]!r} @{self.bits[i]} bits" for i in self.choice.tolist()]


# --- 2. Decide: profile, choose, compress, several layers at once -----------------

class Pending:
    """Layers whose prompts wait to be profiled and compressed: they decide once the last layer
    has come, every `every` layers (whose heads share a budget), or once what they hold would
    pass `max_bytes`. `heads` (tp.Heads) spans the budget over every tensor-parallel rank."""

    def __init__(self, layers: int, max_bytes: int = HELD_BYTES, scope: int | None = None,
                 heads=None):
        self.layers, self.max_bytes, self.scope, self.heads = layers, max_bytes, scope, heads
        self.waiting: list[FastGenCache] = []
        self.profiled = 0

    def add(self, cache: FastGenCache):
        self.waiting.append(cache)
        self.profiled += 1
        if cache.method.ask_after:  # they decide once the context was read again
            return
        held = sum(t.nbytes for c in self.waiting for t in c.held[:3])
        # Decide now if one more layer like these would pass the limit.
        full = (len(self.waiting) == self.scope if self.scope
                else held + held // len(self.waiting) > self.max_bytes)
        if self.profiled >= self.layers or full:
            self.flush()

    def flush(self):
        scope = self.scope or max(len(self.waiting), 1)
        for i in range(0, len(self.waiting), scope):
            decide(self.waiting[i:i + scope])
        self.waiting = []


def decide(caches: list[FastGenCache]):
    """Profile, choose and compress several layers' prompts as one batch of sequences."""
    t0 = now(caches[0].prompt_lens.device)
    first = caches[0]
    if any((c.method, c.max_new_tokens) != (first.method, first.max_new_tokens) for c in caches):
        raise ValueError("decide: the layers' caches must share their method and max_new_tokens")
    sums = profile_layers(caches)
    kv = [torch.cat([c.held[i] for c in caches]) for i in (1, 2)] if first.measures else None
    prompt, recovery = scored_prompt(first, sums, first.held[3], layers=len(caches), kv=kv)
    if recovery is not None and first.bits is not None and any(map(rounds, first.bits)):
        # What each precision costs, as attention lost: 16 bits nothing.
        q, k, v = (torch.cat([c.held[i] for c in caches]) for i in range(3))
        kinds = sorted(set(first.bits))
        errors = precision_errors(q, k, v, first.prompt_lens.repeat(len(caches)), kinds,
                                  first.method.rows, first.method.window)
        errors = errors[:, [kinds.index(b) for b in first.bits]]  # (L * S, M)
        if first.method.ask_after:  # shares of the attention, as score: of all the head's
            errors = errors * sums.colsum.sum(1, keepdim=True)
        else:  # as attention evicted: a share of it changes the output more than rounding
            errors = errors * ROUNDING_WEIGHT
        recovery = recovery - errors
        for c, e in zip(caches, errors.view(len(caches), -1, errors.shape[1])):
            c.errors = e
    # The prompt's (L * S, T) slots and recoveries (L * S, M); keeps (M, L * S, T).
    keeps = torch.stack([prompt.keeps(p) for p in first.policies])
    growth = growths(first.policies, prompt)  # (L * S, M)
    choose_policies(caches, prompt, recovery, keeps, growth)
    compress(caches, prompt, keeps, growth)
    spent = (now(caches[0].prompt_lens.device) - t0) / len(caches)
    for c in caches:
        c.held = c.all_rows = c.read_scores = None
        c.profile_s += spent


def profile_layers(caches: list[FastGenCache]) -> Profile:
    """Profiling's sums of the layers in `decide`, as one batch, a pass per HELD_BYTES of them."""
    first, method = caches[0], caches[0].method
    per = max(1, HELD_BYTES // sum(t.nbytes for t in first.held[:3]))
    parts = []
    for i in range(0, len(caches), per):
        group = caches[i:i + per]
        q, k, v = (torch.cat([c.held[j] for c in group]) for j in range(3))
        lens = first.prompt_lens.repeat(len(group))
        if method.ask_after:
            # A token scores the more of what copying it took, weighed, and what the prompt's
            # last rows gave it, summed: continuing the prompt reads what they read (a chunk's
            # rows add theirs to the scores, as decoding does).
            last = attention_sums(q, k, lens, (), method.rows).colsum
            score = torch.maximum(torch.cat([c.read_scores[0] for c in group]) * READ_WEIGHT, last)
            lens = lens.repeat_interleave(first.n_kv_heads)[:, None]  # (S, 1)
            pos = torch.arange(k.shape[2], device=lens.device).expand(len(lens), -1)
            sums = read_again_profile(score, pos, lens, lens, banded(first.policies))
        elif first.all_rows is not None:  # at prefill
            sums = Profile.cat([c.all_rows for c in group])
        else:
            sums = attention_sums(q, k, lens, banded(first.policies), method.rows)
        parts.append(weigh(sums, v) if method.weigh_values else sums)
    return Profile.cat(parts)


def scored_prompt(cache: FastGenCache, sums: Profile, tokens, layers: int = 1,
                  kv=None) -> tuple[Slots, torch.Tensor]:
    """The prompt's slots scored by `sums` of `layers` stacked layers, (layers * S, T), and
    each policy's recovery, (layers * S, M); None for a single policy (nothing to choose).
    kv: the layers' prompt keys and values, (layers * B, K, T, D) each, which the fields
    policies declare are measured on."""
    prompt = prompt_slots(sums, cache.prompt_lens, cache.token_flags[tokens], cache.n_kv_heads,
                          layers, cache.method.span)
    if kv is not None:
        prompt.fields = {name: f(*(t.flatten(0, 1) for t in kv)).float()
                         for name, f in cache.measures.items()}
    if len(cache.policies) == 1:
        return prompt, None
    return prompt, recoveries(cache.policies, prompt, sums)


def token_costs(cache: FastGenCache) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per policy (M,), a kept token's cost and a segment's besides, and a full cache's token
    cost: with `bits`, bytes of key, value and slot, a 4- or 2-bit head's window
    (quant.window_bytes), and 16-bit K and V; else 1, 0 and 1 (a budget in tokens)."""
    M, device = len(cache.policies), cache.prompt_lens.device
    if cache.bits is None:
        return torch.ones(M, dtype=torch.long, device=device), torch.zeros(
            M, dtype=torch.long, device=device), 1
    D = cache.head_dim
    slot = pool.slot_bytes(any(p.reads_last for p in cache.policies), cache.ranks,
                           len(cache.measures))
    unit = torch.tensor([token_bytes(b, D) + slot for b in cache.bits], device=device)
    return unit, torch.tensor([window_bytes(b, D, cache.method.window) for b in cache.bits],
                              device=device), token_bytes(16, D)


def growths(policies: list[Policy], prompt: Slots) -> torch.Tensor:
    """(S, M) the share of new tokens each policy holds on to (Policy.growth)."""
    return torch.stack([p.growth(prompt) for p in policies], 1)


def banded(policies: list[Policy]) -> list[float]:
    """Local ratios to band-sum (a pass per ratio over every row read); none for one policy."""
    return local_ratios(policies) if len(policies) > 1 else []


def choose_policies(caches: list[FastGenCache], prompt: Slots, recovery, keeps, growth):
    """Each layer's `choice`, (S,): under a threshold, the shortlist's first policy to reach it;
    under a budget, the `knapsacks` minimizing the heads' squared losses, a policy costing the
    prompt tokens it keeps plus what it will keep of the new ones."""
    L, M = len(caches), len(caches[0].policies)
    if recovery is None:  # a single policy: every segment's
        for c in caches:
            c.recovery = None
            c.choice = prompt.pos.new_zeros(len(prompt.pos) // L, dtype=torch.long)
        return
    offered = recovery.masked_fill(not_offered(caches), -math.inf).view(L, -1, M)
    recovery = recovery.view(L, -1, M)  # (L, S, M)
    first, heads = caches[0], caches[0].pending.heads
    for c, r, o in zip(caches, recovery, offered):
        c.recovery = r
        c.choice = choose(o, c.method.recovery) if c.method.kv_budget is None else None
    if first.method.kv_budget is not None:
        new = first.max_new_tokens - 1
        unit, window, full_unit = token_costs(first)  # in tokens, or in bytes with `bits`
        costs = ((keeps.sum(2).T + torch.ceil(growth * new).long()) * unit + window).view(L, -1, M)
        picks, spent, budgets = within_budget(first, offered, costs, first.prompt_lens, new,
                                              first.method.kv_budget, full_unit)
        reads = torch.tensor([p.reads_last for p in first.policies], device=picks.device)
        reads = reads[picks].any(1).tolist()  # each layer's, every rank's heads
        # Each layer's share when choosing again, (B,): what it took of its budget or, where the
        # layers left some unspent (a short prompt before many new tokens), of what they spent on
        # average, so that together they may spend it all.
        base = torch.minimum(budgets, spent.float().mean(0)).clamp(min=1)
        shares = first.method.kv_budget * spent / base
        for c, pick, share, r in zip(caches, picks if heads is None else heads.mine(picks), shares,
                                     reads):
            c.choice, c.reads_last, c.share = pick, r, share


def choose_again(caches: list[FastGenCache], profiles: list[list[Profile]]):
    """Choose each segment's policy again, for several layers at once, from a Profile of what
    each of their groups holds now (under a budget, each layer within its share of what a full
    cache holds by the planned end); segments stay in their groups. A policy is offered only at
    the precision its segment is stored at, and only if the pool keeps what it reads. Every
    group of every layer is a block of one padded batch: each policy is asked once."""
    first = caches[0]
    P, device = first.policies, first.prompt_lens.device
    new = first.max_new_tokens - 1  # a chunk comes before an answer (a chat's: each turn's)
    L, S, M = len(caches), len(first.choice), len(P)
    blocks = [(i, g) for i, c in enumerate(caches) for g in c.pool.groups]
    held = Slots.cat([caches[i].slots(g) for i, g in blocks])
    prof = Profile.cat([p for group_profiles in profiles for p in group_profiles])
    held.last = prof.last
    value = recoveries(P, held, prof)
    if first.bits is not None:
        stored = torch.tensor([g.bits for _, g in blocks for _ in g.rows], device=device)
        value = value.masked_fill(torch.tensor(first.bits, device=device) != stored[:, None],
                                  -math.inf)
    cost = torch.stack([held.keeps(p) for p in P]).sum(2).T + torch.ceil(
        growths(P, held) * new).long()
    rows = torch.cat([g.seg + i * S for i, g in blocks]).to(device)  # (layer, segment) of each
    values, costs = value.new_empty(L * S, M), cost.new_empty(L * S, M)
    values[rows], costs[rows] = value, cost
    # Not offered: no policy may read what is not kept.
    lacks = torch.tensor(["last" not in c.pool.fields for c in caches], device=device)
    reads = torch.tensor([p.reads_last for p in P], device=device)
    values = values.masked_fill(lacks.repeat_interleave(S)[:, None] & reads, -math.inf)
    if first.errors is not None:
        values = values - torch.cat([c.errors for c in caches])
    unit, window, full_unit = token_costs(first)
    costs = (costs * unit + window).view(L, S, M)
    offered = values.masked_fill(not_offered(caches), -math.inf).view(L, S, M)
    heads, B = first.pending.heads, len(first.prompt_lens)
    for c, recovery, price, offer in zip(caches, values.view(L, S, M), costs, offered):
        c.recovery = recovery
        if c.method.kv_budget is None:
            choice = choose(offer, c.method.recovery)
        else:
            choice, _, _ = within_budget(c, offer[None], price[None], c.seen()[::S // B], new,
                                         c.share, full_unit)
            choice = (choice if heads is None else heads.mine(choice))[0]
        c.choice = choice
        c.follow(choice.tolist())


def not_offered(caches: list[FastGenCache]) -> torch.Tensor:
    """(L * S, M), where `Method.copies`, the policies not offered: to a segment that copies, any
    but those keeping every token (`copying`); to another, Full in the model's dtype (or at 16
    bits), on the menu for those that copy alone (`default_method`)."""
    first, device = caches[0], caches[0].copies.device
    whole = torch.tensor(copying(first.policies, first.bits), device=device)
    wide = torch.tensor(copying(first.policies, first.bits, 16), device=device)
    copies = torch.cat([c.copies for c in caches])[:, None]
    return torch.where(copies, ~whole, wide) & first.method.copies


def copying(policies: list[Policy], bits, fewest: int = COPY_BITS) -> list[bool]:
    """Which policies a head that copies may take: those keeping every token, at `fewest` bits
    or more."""
    return [p.keeps_all and (bits is None or b >= fewest)
            for p, b in zip(policies, bits or policies)]


def worth(method: Method, recovery) -> torch.Tensor:
    """Each head's knapsack value: after reading again, the score it keeps (heads compared, as
    KVzip ranks them); else -(1 - r)^2 of its share r recovered (`squared_losses`). Equal to six
    decimals is equal: sums taken in another order (tensor parallel's ranks, another CPU) differ
    in their last bits, and would otherwise break a tie (two policies keeping all) either way."""
    recovery = recovery.round(decimals=6)
    return recovery if method.ask_after else squared_losses(recovery)


def within_budget(cache: FastGenCache, recovery, costs, seen, new: int, share, full_unit: int):
    """`knapsacks` of n layers' heads (n, S, M), each sequence within `share` of its full cache
    of `seen` (B,) and `new` tokens; every rank solves for every head. Picks, spends, budgets."""
    values, heads = worth(cache.method, recovery), cache.pending.heads
    if heads is not None:
        values, costs = heads.gather(values), heads.gather(costs)
    B = len(seen)
    full = (seen.cpu() + new) * (costs.shape[1] // B * full_unit)  # (B,)
    budgets = (share * full).long().expand(len(values), B)
    picks, spent = knapsacks(values, costs, budgets)
    return picks, spent, budgets


def knapsacks(values, costs, budgets):
    """profiling.fit_budgets, one knapsack per sequence over the heads of n layers, so that a
    sequence's plan is the same alone or in any batch. values, costs (n, B * K, M); budgets
    (n, B), each layer's share. Returns picks (n, B * K) and each layer's spend (n, B)."""
    n, S, M = values.shape
    B = budgets.shape[1]
    rows = lambda t: t.reshape(n, B, S // B, M).transpose(0, 1).reshape(B, -1, M)  # noqa: E731
    picks = fit_budgets(rows(values), rows(costs), budgets.sum(0).tolist())
    picks = picks.view(B, n, -1).transpose(0, 1).reshape(n, S)
    spent = costs.gather(2, picks[..., None].to(costs.device)).view(n, B, -1).sum(2)
    return picks, spent.cpu()


def lay_out(cache: FastGenCache, prompt: Slots, choice: list[int], kept: list[int],
            growth: list[float]):
    """Lay out the pool for what each segment's policy keeps of its prompt (S, T): on the
    host, each segment's policy, its kept tokens and `growth`."""
    device = prompt.pos.device
    chosen = [cache.policies[i] for i in sorted(set(choice))]
    cache.pool = pool.build(choice, kept, growth,
                           cache.reads_last or any(p.reads_last for p in chosen),
                           page=cache.page, evict_every=cache.evict_every,
                           new=cache.max_new_tokens - 1,
                           device=device, bits=cache.bits,
                           ranks=cache.ranks, window=cache.method.window,
                           measures=cache.measures)
    by = torch.tensor(choice, device=device)
    for name, t in dict(seg_prompt_len=prompt.prompt_len[:, 0], drops_by=by, evicts_by=by,
                        seg_first_query=prompt.first_query[:, 0]).items():
        cache.register_buffer(name, t.clone(), persistent=False)
    cache.follow(choice)


def compress(caches: list[FastGenCache], prompt: Slots, keeps, growth):
    """Keep what each segment's policy keeps of its prompt: lay out pools on the host, fill them."""
    choice = torch.cat([c.choice for c in caches])
    segments = torch.arange(len(choice), device=choice.device)
    keep = keeps[choice, segments]  # (L * S, T)
    # Two host syncs: the integers, then the growths (floats).
    choices, kept = torch.stack([choice, keep.sum(1)]).tolist()
    grown = growth[segments, choice].tolist()
    S = len(choices) // len(caches)
    for i, c in enumerate(caches):
        rows = slice(i * S, (i + 1) * S)
        lay_out(c, prompt[rows], choices[rows], kept[rows], grown[rows])
    fields = dict(pos=prompt.pos.int(), score=prompt.score, last=prompt.last, flags=prompt.flags,
                  **prompt.fields)
    pool.fill_from_prompt([c.pool for c in caches], fields, keep, [c.held[1:3] for c in caches])


# --- 4. Between steps: evict, hand out slots ---------------------------------------

def reserve(caches: list[FastGenCache], tokens=1):
    """Before every step, outside compiled code: evict what is due (all due layers at once), hand
    out free slots when the last are used, point the step at its slots. `tokens` per sequence:
    1, a chunk's T, or (B,) counts (the rest padding)."""
    if any(c.pool is None for c in caches):
        raise RuntimeError(UNREAD)
    counts = None if isinstance(tokens, int) else torch.as_tensor(tokens)
    T = tokens if counts is None else int(counts.max())
    evicting = [c for c in caches if c.clock.since >= c.evict_every]
    due = evicting + [c for c in caches if c.clock.since < c.evict_every and c.pool.left() < T]
    read = [c for c in evicting if c.clock.read]
    evict(evicting)
    for c in read:  # the slots a chunk took and its policies let go, given back
        pool.compact(c.pool, c.evict_every)
    # Free slots for every step until the next eviction; groups that have fewer grow.
    pool.hand_out([c.pool for c in due], [max(c.need(), T) for c in due],
                  [c.max_new_tokens - 1 - c.steps for c in due])
    chunk = counts is not None or T > 1
    for c in caches:
        c.pool.next_slot(T)
        c.clock.ready, c.clock.chunk = T, chunk
        c.clock.since += T
        if not chunk:
            c.clock.steps += 1
        else:  # each sequence's tokens in the chunk
            c.clock.read = True
            c.counts = torch.full_like(c.prompt_lens, T) if counts is None else counts.to(
                c.prompt_lens.device)


def evict(caches: list[FastGenCache]):
    """Free what each segment's policy lets go, asking each policy once about its segments of
    all the layers (pool.evict pads them into rows): the layers must share one list of policies."""
    due = []
    for c in caches:
        by, asks = (c.drops_by, c.drops) if c.clock.read else (c.evicts_by, c.evicting)
        c.clock.since, c.clock.read = 0, False
        if asks:
            due.append((c, by))
    if not due:
        return
    caches, by = zip(*due)
    policies = caches[0].policies
    if any(c.policies != policies for c in caches):
        raise ValueError("evict: the layers' caches must share one list of policies")
    column = lambda t: torch.cat([t(c) for c in caches])[:, None]  # noqa: E731
    segments = dict(seen=column(FastGenCache.seen), prompt_len=column(lambda c: c.seg_prompt_len),
                    first_query=column(lambda c: c.seg_first_query))
    names = ["pos", "score", "flags"] + (["last"] if any(p.reads_last for p in policies) else [])
    measured = list(caches[0].measures)

    def keeps(i, rows, seg):
        fields = {name: rows.pop(name) for name in measured}
        return Slots(**rows, **seg, fields=fields).keeps(policies[i])
    pool.evict([c.pool for c in caches], torch.cat(by), len(policies), names + measured,
               segments, keeps)


def read_again(cache: FastGenCache, q, k, v):
    """Attend, causally, over these R tokens read again and, of what is held (the prompt
    before `decide`, else the pool), over the window READ_SINKS and READ_BEFORE give the
    R prompt tokens from `read_from` that they repeat; add what each held token got to
    `read_scores`, holding none of them. A token read again then costs a bounded amount, not
    all that is held."""
    t0 = now(q.device)
    B, H, R, D = q.shape
    if cache.pool is None:  # the prompt, as prefill held it: every sequence's part starts alike
        _, ck, cv, _ = cache.held
        T, s = ck.shape[2], int(cache.read_from[0])
        lo = max(0, s - READ_BEFORE)
        cols = torch.cat([torch.arange(min(READ_SINKS, lo)), torch.arange(lo, min(s + R, T))])
        cols = cols.to(q.device)
        y, col = read_again_sums(q, k, v, ck[:, :, cols], cv[:, :, cols],
                                 cols < cache.prompt_lens[:, None], cache.counts)
        got = [col.new_zeros(len(col), T).index_copy_(1, cols, col)]
    else:  # the pool: a group's segments at a time, each a sequence of one KV head
        K = cache.n_kv_heads
        q, k, v = q.reshape(B * K, H // K, R, D), k.reshape(B * K, 1, R, D), v.reshape(
            B * K, 1, R, D)
        counts, first = (t.repeat_interleave(K) for t in (cache.counts, cache.read_from))
        q, k, v = (cache.pool.turned(x, p) for x, p in ((q, 1), (k, -1), (v, 0)))  # as held
        keys, values = cache.pool.kv_pages()
        keys = keys.transpose(1, 2)  # (N, P, D)
        y, got = torch.empty_like(q), []
        for g in cache.pool.groups:
            seg = g.seg.to(q.device)
            pos, at = g.block(cache.pool.pos), first[seg][:, None]
            reads = (pos >= 0) & ((pos < READ_SINKS) | ((pos >= at - READ_BEFORE)
                                                        & (pos < at + R)))
            y[seg], col = read_again_sums(q[seg], k[seg], v[seg], g.block(keys)[:, None],
                                          g.block(values)[:, None], reads, counts[seg])
            got.append(col)
        y = cache.pool.turned(y).view(B, H, R, D)
    if cache.read_scores is not None:
        got = list(map(torch.maximum, cache.read_scores, got))
    cache.read_scores = got
    cache.profile_s += now(q.device) - t0
    return y


def read_piece(caches: list[FastGenCache], counts=None, first=None, layers=None):
    """Before each piece of a reading again (generation.read_again), its tokens (B,) per
    sequence and the prompt position `first` (B,) of the part it reads again; with `layers`, only
    the first that many layers read it (a chunk's, not a prompt's). No counts ends the reading:
    every layer profiles what it gave, those above what the ones below gave, and decides."""
    if counts is None:
        for c in caches:
            c.reads_next = c.reads_last = False
        if caches[0].pool is None:
            caches[0].pending.flush()
            return
        below = [c for c in caches if not c.reads_above]
        for c in caches[len(below):]:
            c.read_scores, c.reads_above = read_below(c, below), False
        profiles = [reading_profiles(c) for c in caches]
        if len(caches[0].policies) > 1:
            choose_again(caches, profiles)
        return
    for i, c in enumerate(caches):
        c.reads_next, c.reads_above = True, layers is not None and i >= layers
        c.reads_last = layers is not None and i == layers - 1
        c.counts = torch.as_tensor(counts, device=c.prompt_lens.device)
        c.read_from = torch.as_tensor(first, device=c.prompt_lens.device)


def read_below(cache: FastGenCache, below: list[FastGenCache]) -> list[torch.Tensor]:
    """For a layer above those read again, each held token's score, a group at a time: the most
    any head of the layers `below` gave the same token of the same sequence."""
    B, P = len(cache.prompt_lens), int(max(c.pool.pos.max() for c in below + [cache])) + 1
    most = torch.zeros(B * P, device=cache.pool.score.device)

    def at(c: FastGenCache, g: pool.Group):  # each slot's (sequence, position) in `most`
        pos = g.block(c.pool.pos).long()
        seq = g.seg.to(pos.device)[:, None] // c.n_kv_heads
        return seq * P + pos.clamp(min=0), pos >= 0
    for c in below:
        for g, got in zip(c.pool.groups, c.read_scores):
            i, held = at(c, g)
            most.scatter_reduce_(0, i[held], got[held].float(), "amax")
    return [most[i].to(cache.pool.score.dtype) * held for i, held in
            (at(cache, g) for g in cache.pool.groups)]


def reading_profiles(cache: FastGenCache) -> list[Profile]:
    """After a reading again: each held token's score is the most any reading gave it, not
    weighed (READ_WEIGHT), or what rows gave it while held, where more; each group's Profile
    of those scores, to choose again from."""
    groups, ratios = cache.pool.groups, local_ratios(cache.policies)
    profiles = []
    for g, got in zip(groups, cache.read_scores):
        score = g.block(cache.pool.score)
        score.copy_(torch.maximum(score, got))
        if "last" in cache.pool.fields:  # what TOVA ranks by when it next evicts
            g.block(cache.pool.last).copy_(score)
        s = cache.slots(g)
        profiles.append(read_again_profile(s.score * s.valid, s.pos, s.seen, s.prompt_len,
                                           ratios))
    cache.read_scores = None
    return profiles


def asks_after(caches: list) -> bool:
    """Whether a model's caches choose what to keep once the prompt is read again."""
    return isinstance(caches[0], FastGenCache) and caches[0].method.ask_after


def fastgen_caches(model, method: Method, prompt_lens, max_new_tokens: int, token_flags=None,
                   *, page: int | None = None, heads=None):
    """One FastGenCache per layer of `model`, deciding together (`Pending`); `heads`: tp.Heads."""
    device = model.tok_embeddings.weight.device
    lens = torch.as_tensor(prompt_lens, device=device)
    if token_flags is None:  # no tokenizer at hand: Special then keeps only the first token
        token_flags = torch.zeros(model.args.vocab_size, dtype=torch.uint8)
    flags = token_flags.to(device)
    L = len(model.layers)
    # Read again, one knapsack over every layer's heads, as KVzip ranks them all together.
    scope = L if method.ask_after else SCOPE
    pending = Pending(L, scope=scope if method.kv_budget is not None else None, heads=heads)
    copies = copy_heads(model, flags) if method.copies else [None] * L
    return [FastGenCache(method, lens, max_new_tokens, model.args.n_kv_heads, flags, page=page,
                         pending=pending, copies=c) for c in copies]


class CopyProbe(Cache):
    """A layer's stand-in cache over `copy_heads`' probe: it notes each KV head's induction
    score."""

    def forward(self, q, k, v, input_pos, tokens):
        self.scores = induction_scores(q, k)
        return causal_attention(q, k, v)

    def nbytes(self) -> int:
        return 0


_copies = weakref.WeakKeyDictionary()  # model -> its copy heads


@torch.no_grad()
def copy_heads(model, token_flags) -> torch.Tensor:
    """(layers, K) bool: the KV heads that copy (profiling.COPY_SHARE), probed once per model."""
    if model not in _copies:
        _copies[model] = induction_probe(model, token_flags) >= COPY_SHARE
    return _copies[model]


@torch.no_grad()
def induction_probe(model, token_flags, seed: int = 0) -> torch.Tensor:
    """(layers, K) each KV head's induction score over COPY_PROBE random tokens said twice, drawn
    (by `seed`) from those neither special nor punctuation; the model's caches are left as found."""
    plain = (token_flags == 0).nonzero()[:, 0].cpu()
    draw = torch.randint(len(plain), (COPY_PROBE,), generator=torch.Generator().manual_seed(seed))
    tokens = plain[draw].repeat(2)[None].to(token_flags.device)
    held, probes = model.caches(), [CopyProbe() for _ in model.layers]
    model.setup_caches(probes)
    try:
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        model(tokens, positions, logits_at=tokens.new_zeros(1))
    finally:
        model.setup_caches(held)
    return torch.stack([p.scores for p in probes])
