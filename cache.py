"""The FastGen KV cache: every attention head keeps only what its policy needs.

A cache *segment* is one (sequence, KV head) pair; a layer of batch B with K
KV heads has B*K of them. At the end of prefill each segment gets a policy
(by profiling, or a fixed one for the baselines) and keeps only the prompt
tokens that policy keeps; a few layers at a time decide together (`Pending`,
`decide`), their segments profiled, ranked and scored as one batch.

Storage is one pool of pages per layer: N pages of P slots, V as (N, P, D)
and K transposed, (N, D, P), so that scoring a page is a plain (G, D) x (D, P)
product (on CPU, markedly faster than against (P, D) pages), and every slot
has a position (-1: empty), a heavy-hitter score, token flags and the
attention the latest query gave it. Each segment owns a run of
pages. Segments that share a policy and hold about as many tokens form a
`Group`, whose pages sit together in the pool as an (n, C) block, C slots per
segment, so that a policy reads them as the padded `Slots` it ranks. A head
that keeps 5% of the prompt therefore allocates about 5% of a full head's
bytes, rounded up to a page.

A decode step does the same few operations whatever the policies: write each
segment's new token into a free slot chosen in advance, attend over every page
of the layer at once (a softmax per segment across its pages; eager, with few
segments and short prompts, every query over every slot, kept to its own by a
bias, K then held as one (D, N * P)), and add the attention each token got to
its score. Eviction is the policies' work, and it runs between steps
(`reserve`), for every layer at once, every `evict_every` steps: each segment's
slots become one padded row, the rows of all the layers sorted by policy, each
policy keeps from its own rows (a top-k, not a sort), what is no longer kept is
freed, and every segment is handed its next free slots; a group that runs short
grows by a page or more (each group starts with room for what the budget
planned, so that is rare). Done a layer at a time, the same work was a few
hundred small operations per layer. So the step compiles once, its pool's size
dynamic, and the ranking that eviction needs is paid once per `evict_every`
tokens. With `evict_every=1` the cache evicts after every token, as the paper
describes.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn as nn

from model import causal_attention
from policies import Policy, Slots
from profiling import Profile, attention_sums, choose, fit_budgets, local_ratios, recoveries

# Letters in shape comments: B batch, K KV heads, H query heads, G = H // K,
# S = B*K segments, n segments in a group, T prompt tokens, N pages, P slots
# per page, C = slots per segment in a group, D head dimension, E evict_every.

# Slots per page: a segment wastes at most a page minus one slot to rounding, and
# a page is one small matrix product per step, so pages grow with the prompt.
MIN_PAGE, MAX_PAGE = 4, 128
# Tokens between evictions (each segment holds at most this many extra): half a
# page, at least EVICT_EVERY, so that a long prompt's costlier ranking is paid
# as often per token as a short one's, for the same slack relative to its size.
EVICT_EVERY = 8
# Segments share a group while the largest holds at most this much more than
# the smallest (plus a page): the rest of a group's width is padding.
SPREAD = 1.05
# An eager step attends with `masked_attention` while a layer's scores (every
# query against every slot of the pool) are at most this many floats, else with
# `paged_attention`: batch 1 up to about 2k tokens and batch 2 at 512 on
# SmolLM2. Compiled, where the pages' softmax fuses, every layer attends with
# `paged_attention` (FastGenCache's `eager`): it was the faster at every size
# measured.
MASKED_SCORES = 1 << 15
# Prompt keys, values and profiled queries that layers waiting to decide
# together may hold (`Pending`), besides one layer's: about 19 layers of a
# 512-token prompt at batch 1, 5 at 2k, 2 at 4k; one at a time from 2k x 4 up,
# where a layer's own operations outweigh their fixed cost. More held no
# faster and raised the prefill's peak memory.
HELD_BYTES = 16 << 20

# The pool's per-slot tensors and what an empty slot holds.
SLOT_FIELDS = {"k": 0, "v": 0, "pos": -1, "score": 0, "last": 0, "flags": 0}


@dataclass
class Group:
    """Segments of one layer that follow the same policy, stored as an (n, C)
    block of the pool: pages first .. first + n * pages, `pages` per segment."""
    policy: Policy
    rows: list[int]  # the n segment ids
    growth: float  # the largest share of new tokens a segment's policy holds (Policy.growth)
    first: int = 0
    pages: int = 1

    @property
    def seg(self) -> torch.Tensor:
        return torch.tensor(self.rows)

    def block(self, t: torch.Tensor) -> torch.Tensor:
        """The group's part of a pool tensor (N, P, ...) as (n, C, ...): a view."""
        n = len(self.rows)
        part = t[self.first:self.first + n * self.pages]
        return part.reshape(n, self.pages * part.shape[1], *part.shape[2:])


@dataclass
class Clock:
    """Where a cache's decoding stands: a plain object, as an nn.Module's
    attribute writes run through Python checks (about 4 us each, two a layer
    each step in `reserve`)."""
    steps: int = 0  # decode steps reserved so far
    cursor: int = 0  # the column of `free` that the next step writes to


def page_size(prompt_len: int) -> int:
    """About a 64th of the prompt, a power of two between MIN_PAGE and MAX_PAGE."""
    return min(MAX_PAGE, max(MIN_PAGE, 1 << max(0, prompt_len // 64 - 1).bit_length()))


def group_pages(sizes: list[int], room: int, page: int) -> list[tuple[slice, int]]:
    """Segments of one policy, their kept sizes sorted: runs within SPREAD (plus
    a page) of the first, each with the pages per segment that hold its largest
    size plus `room` new tokens."""
    runs, start = [], 0
    for i, size in enumerate(sizes):
        if size > sizes[start] * SPREAD + page:
            runs.append(slice(start, i))
            start = i
    runs.append(slice(start, len(sizes)))
    return [(r, max(1, -(-(sizes[r.stop - 1] + room) // page))) for r in runs if sizes[r]]


def paged_attention(q, k, v, empty, owner):
    """One query per segment over its pages.

    q: (S, G, D); k: (N, D, P) and v: (N, P, D) pages; empty: (N, P) bool, the
    slots that hold nothing; owner: (N,) the segment of each page. Returns the
    output (S, G, D) and the attention each slot got, (N, P) in float32,
    averaged over the G query heads. The softmax of a segment spans its pages:
    each page's maximum and sum are combined per segment, and the pages' outputs
    by a product with the (S, N) matrix of which page is whose: compiled, a
    scatter of the outputs adds atomically, which ran slower on CPU.
    """
    S, G, D = q.shape
    N, P = empty.shape
    scores = ((q.index_select(0, owner) @ k) / math.sqrt(D)).float()  # (N, G, P)
    scores = scores.masked_fill(empty[:, None], -math.inf)
    mine = owner == torch.arange(S, device=owner.device)[:, None]  # (S, N)
    page_top = scores.amax(-1)  # (N, G)
    if torch.compiler.is_compiling():
        # Compiled, one fused reduction over each segment's pages, where a
        # scatter_reduce stays an op of its own; eager, this would write out
        # an (S, N, G) tensor, and the scatter is the faster.
        top = page_top.expand(S, N, G).masked_fill(~mine[..., None], -math.inf).amax(1)
    else:
        top = page_top.new_full((S, G), -math.inf).scatter_reduce(
            0, owner[:, None].expand(N, G), page_top, "amax")
    e = (scores - top.index_select(0, owner)[..., None]).exp()
    total = scores.new_zeros(S, G).index_add_(0, owner, e.sum(-1))
    probs = e / total.index_select(0, owner)[..., None]
    y = mine.float() @ (probs.to(v.dtype) @ v).float().view(N, G * D)
    return y.view(S, G, D).to(v.dtype), probs.mean(1)


def masked_attention(q, k, v, bias):
    """`paged_attention`, computed as one attention of every query over every
    slot of the layer, kept from the others' slots by `bias`: S times the
    arithmetic on scores, in two plain matrix products instead of a softmax
    pieced together page by page, which wins while those scores are few
    (MASKED_SCORES).

    q: (S, G, D); k: (D, M) and v: (M, D), the pool's M slots (K transposed as
    a whole: a plain product, twice as fast as against (M, D)); bias: (S, 1, M),
    0 on the slots segment s holds, -inf elsewhere (`slot_bias`). Returns the
    output (S, G, D) and the attention each slot got, (M,) in float32,
    averaged over the G query heads."""
    S, G, D = q.shape
    scores = ((q / math.sqrt(D)).view(S * G, D) @ k).view(S, G, -1).float().add_(bias)
    probs = scores.softmax(-1).view(S * G, -1)
    y = probs.to(v.dtype) @ v
    return y.view(S, G, D), probs.sum(0).div_(G)


def attends_masked(segments: int, heads_per_kv: int, slots: int) -> bool:
    """Whether an eager step attends to a pool with `masked_attention`: while
    every query's scores over every slot are few (MASKED_SCORES)."""
    return segments * heads_per_kv * slots <= MASKED_SCORES


def slot_bias(empty, owner, S: int) -> torch.Tensor:
    """`masked_attention`'s bias, (S, 1, N * P), from the slots that hold nothing,
    empty: (N, P), and the segment of each page, owner: (N,). In bfloat16: it
    holds only 0 and -inf, and added to float32 scores it runs about as fast as
    a float32 bias (a masked_fill_ with a broadcast mask ran 6 to 20 times
    slower)."""
    mine = owner == torch.arange(S, device=owner.device)[:, None]  # (S, N)
    hidden = (~mine[:, :, None] | empty).view(S, 1, -1)
    return torch.zeros(hidden.shape, dtype=torch.bfloat16, device=owner.device).masked_fill_(
        hidden, -math.inf)


def _clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class FastGenCache(nn.Module):
    """One layer's compressed cache.

    `policies` is the candidates of each segment: one policy for every segment
    (the baselines), the paper's shortlist (each segment takes the first whose
    recovery reaches `threshold`), or a menu under `budget` (each segment takes
    the item that maximizes the layer's total recovery with the tokens its
    items will hold at most `budget` of what a full cache holds). Profiling
    reads the last `rows` prompt rows (None: all of them) and, unless `sink`,
    leaves the first token's attention out of the recovery. Eviction runs every
    `evict_every` decode steps (None: half a page, at least EVICT_EVERY); pages
    hold `page` slots (None: by prompt length). Layers that share `pending`
    choose their policies and compress together (`Pending`). With `eager`, the
    decode step runs eager, and a small pool is laid out for `masked_attention`
    (MASKED_SCORES); otherwise every pool is paged (either decodes correctly
    both ways).
    """

    def __init__(self, policies: list[Policy], prompt_lens, max_new_tokens: int, n_kv_heads: int,
                 token_flags, *, threshold: float = 1.0, budget: float | None = None,
                 rows: int | None = None, sink: bool = True, evict_every: int | None = None,
                 page: int | None = None, pending: Pending | None = None, eager: bool = True):
        super().__init__()
        if (evict_every is not None and evict_every < 1) or (page is not None and page < 1):
            raise ValueError(f"evict_every and page must be at least 1 (got {evict_every}, {page})")
        self.policies = list(policies)
        self.threshold, self.budget, self.rows, self.sink = threshold, budget, rows, sink
        self.evict_every, self.page, self.eager = evict_every, page, eager
        self.max_new_tokens = max_new_tokens
        self.n_kv_heads = n_kv_heads
        self.register_buffer("prompt_lens", prompt_lens, persistent=False)
        self.register_buffer("token_flags", token_flags, persistent=False)
        self.groups: list[Group] | None = None
        self.choice = self.recovery = None  # the plan, (S,) and (S, len(policies))
        self.profile_s = 0.0  # prefill time spent profiling and compressing, not attending
        self.clock = Clock()
        self.n_growths = 0
        self.masked = False  # attended by masked_attention (a small pool), decided by `layout`
        # The layers that decide together (`fastgen_caches` shares one); alone, this one.
        self.pending = Pending(1) if pending is None else pending
        self.held = None  # from prefill until `decide`: (q's rows read, k, v, tokens)
        lens = self.prompt_lens
        self.first_row = 0 if rows is None else int((lens - lens.clamp(max=rows)).min())

    def forward(self, q, k, v, input_pos, tokens):
        if self.groups is None:
            return self.prefill(q, k, v, tokens)
        return self.decode(q, k, v, input_pos, tokens)

    # --- Prefill: profile, choose, compress -----------------------------------

    def profile(self, q, k, tokens, rows=None, sink=True) -> tuple[Slots, torch.Tensor]:
        """The prompt's slots, (S, T), scored by the attention of the rows read,
        and the recovery of every policy, (S, n_policies)."""
        prof = attention_sums(q, k, self.prompt_lens, local_ratios(self.policies), rows)
        return self.from_sums(prof, tokens, sink)

    def from_sums(self, prof: Profile, tokens, sink: bool,
                  layers: int = 1) -> tuple[Slots, torch.Tensor]:
        """`profile` from profiling's sums, for `layers` layers' sums stacked:
        slots (layers * S, T) and recoveries (layers * S, n_policies)."""
        lens = self.prompt_lens
        T = tokens.shape[1]
        per_seg = lambda t: t.repeat_interleave(self.n_kv_heads, dim=0).repeat(  # noqa: E731
            layers, *[1] * (t.dim() - 1))  # (B, ...) -> (layers * S, ...)
        positions = torch.arange(T, device=lens.device)
        prompt = Slots(
            pos=per_seg(torch.where(positions < lens[:, None], positions, -1)),
            score=prof.colsum, flags=per_seg(self.token_flags[tokens]),
            seen=per_seg(lens[:, None]), prompt_len=per_seg(lens[:, None]),
            first_query=per_seg(lens[:, None]) - prof.rows.long()[:, None], last=prof.last)
        prompt.keeps_all(self.policies)
        return prompt, recoveries(self.policies, prompt, prof, sink)

    def prefill(self, q, k, v, tokens):
        """Profile the prompt; the choice of policies and the compression wait
        for the other layers' (`Pending`), at most until the model's last layer."""
        t0 = _clock(q.device)
        # The queries of the rows profiling reads, not the whole prompt's.
        self.held = (q[:, :, self.first_row:].contiguous(), k, v, tokens)
        self.profile_s = _clock(q.device) - t0
        self.pending.add(self)
        return causal_attention(q, k, v)

    def layout(self, prompt: Slots, choice: list[int], kept: list[int], growth: list[float],
               G: int) -> int:
        """Lay out the pool for what each segment's policy keeps of its prompt
        (`compress` fills it). prompt: the layer's (S, T) slots; on the host,
        each segment's policy, how many tokens that is, the policy's `growth`;
        G query heads per KV head. Returns the pool's number of slots."""
        S, device = len(choice), prompt.pos.device
        if self.page is None:
            self.page = page_size(int(self.prompt_lens.max()))
        P = self.page
        if self.evict_every is None:
            self.evict_every = max(EVICT_EVERY, P // 2)
        room = min(self.evict_every, self.max_new_tokens - 1)  # for the first new tokens
        chosen = sorted(set(choice))
        # The latest query's attention costs 4 bytes a slot: kept only for a policy that reads it.
        self.fields = {n: e for n, e in SLOT_FIELDS.items()
                       if n != "last" or any(self.policies[i].reads_last for i in chosen)}
        # Room from the start for what the budget charged each policy for the new
        # tokens after the first round (a quarter of the width at most, as `refill`
        # grows): a group of heads that keep them all never grows.
        new = max(self.max_new_tokens - 1 - room, 0)
        self.groups = []
        for i in chosen:
            seg = sorted((s for s in range(S) if choice[s] == i), key=kept.__getitem__)
            sizes = [kept[s] for s in seg]
            for g, pages in group_pages(sizes, room, P):
                group = Group(self.policies[i], seg[g], max(growth[s] for s in seg[g]))
                planned = min(math.ceil(group.growth * new), pages * P // 4)
                group.pages = -(-(sizes[g.stop - 1] + room + planned) // P)
                self.groups.append(group)
        self.register_buffer("seg_prompt_len", prompt.prompt_len[:, 0].clone(), persistent=False)
        self.register_buffer("seg_first_query", prompt.first_query[:, 0].clone(), persistent=False)
        self.register_buffer("dest", torch.zeros(S, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("free", self.dest.new_zeros(S, 0), persistent=False)
        # Each segment's policy if it may still evict, else -1.
        self.evicting = any(not self.policies[i].never_evicts for i in chosen)
        self.register_buffer("evicts_by", torch.tensor(
            [-1 if self.policies[i].never_evicts else i for i in choice], device=device),
            persistent=False)
        self._place()
        n_slots = sum(len(g.rows) * g.pages for g in self.groups) * P
        # A small pool is attended by `masked_attention` and keeps K as one (D, N * P).
        self.masked = self.eager and attends_masked(S, G, n_slots)
        return n_slots

    def fill(self, k, v, rows, fields: dict, source):
        """The pool's tensors, as `layout` laid it out: slot i holds row rows[i] of
        k and v (B, K, T, D), read as the model lays them out, (B * T * K, D),
        and element source[i] of each of `fields`, flat (an empty slot's keys
        and values are another token's, never attended to)."""
        P, D = self.page, k.shape[-1]
        for name in self.fields:
            if name in ("k", "v"):
                t = (k if name == "k" else v).transpose(1, 2).reshape(-1, D).index_select(0, rows)
                if name == "k":  # (D, N * P) or pages (N, D, P)
                    t = (t.T if self.masked else t.view(-1, P, D).transpose(1, 2)).contiguous()
                else:
                    t = t.view(-1, P, D)
            else:
                t = fields[name].index_select(0, source).view(-1, P)
            self.register_buffer(name, t, persistent=False)
        self._hide()
        self._mark_dynamic()

    def _place(self):
        """Page offsets of the groups, the owner of every page and each segment's
        slots, after a change."""
        first, owner, S = 0, [], len(self.dest)
        # Each segment's first slot (its slots run on from there, one group row) and their number.
        start, width = [0] * S, [0] * S
        for g in self.groups:
            g.first = first
            for j, s in enumerate(g.rows):
                start[s], width[s] = (first + g.pages * j) * self.page, g.pages * self.page
                owner += [s] * g.pages
            first += len(g.rows) * g.pages
        for name, t in dict(owner=owner, start=start, width=width).items():
            self.register_buffer(name, torch.tensor(t, device=self.dest.device), persistent=False)

    def _hide(self):
        """`masked_attention`'s bias, after the slots or their owners changed."""
        if self.masked:
            self.register_buffer("bias", slot_bias(self.pos < 0, self.owner, len(self.dest)),
                                 persistent=False)

    def _mark_dynamic(self):
        """Compiled code sees the pool's page count as dynamic from the first step:
        a growth, in whichever layer, then needs no new graph."""
        for name in (*self.fields, "owner"):
            torch._dynamo.maybe_mark_dynamic(getattr(self, name), int(self.masked and name == "k"))
        if self.masked:
            torch._dynamo.maybe_mark_dynamic(self.bias, 2)

    # --- Decode ------------------------------------------------------------------

    def decode(self, q, k, v, input_pos, tokens):
        """One token per sequence: written to the slot `reserve` chose, attended
        to with everything the segment holds, and scored."""
        B, H, _, D = q.shape
        K = self.n_kv_heads
        S = B * K
        pos = input_pos.expand(B, K).reshape(S)
        slot = self.dest
        P = self.page
        if self.masked:
            self.k.index_copy_(1, slot, k.reshape(S, D).T)
        else:
            # K's pages are (D, P): the new key's D values lie P apart. One flat
            # index_copy_, which compiled ran faster than writing k[page, :, slot].
            at = (slot // P * (D * P) + slot % P)[:, None] + P * torch.arange(D, device=slot.device)
            self.k.view(-1).index_copy_(0, at.view(-1), k.reshape(S * D))
        self.v.view(-1, D).index_copy_(0, slot, v.reshape(S, D))
        self.pos.view(-1).index_copy_(0, slot, pos.to(self.pos.dtype))
        self.flags.view(-1).index_copy_(0, slot, self.token_flags[tokens].expand(B, K).reshape(S))
        q = q.view(S, H // K, D)
        if self.masked:
            self.bias.view(S, -1).scatter_(1, slot[:, None], 0.0)  # the new token, seen
            y, last = masked_attention(q, self.k, self.v.view(-1, D), self.bias)
            last = last.view_as(self.score)
        else:
            y, last = paged_attention(q, self.k, self.v, self.pos < 0, self.owner)
        if "last" in self.fields:
            self.last.copy_(last)
        self.score += last
        return y.view(B, H, 1, D)

    def reserve(self):
        """Before every decode step, outside compiled code: `reserve` of this
        layer alone."""
        reserve([self])

    def seen(self) -> torch.Tensor:
        """(S,) tokens each segment's sequence has seen: its prompt and one per
        step reserved (between steps, every reserved step has run)."""
        return self.seg_prompt_len + self.steps

    @property
    def steps(self) -> int:
        """Decode steps reserved so far."""
        return self.clock.steps

    def slots(self, g: Group) -> Slots:
        """A group's slots as (n, C) views of the pool: writing to `pos` frees slots."""
        seg = g.seg
        return Slots(g.block(self.pos), g.block(self.score), g.block(self.flags),
                     self.seen()[seg, None], self.seg_prompt_len[seg, None],
                     self.seg_first_query[seg, None],
                     g.block(self.last) if "last" in self.fields else None)

    def evict(self):
        """Free what each segment's policy no longer keeps: `evict` of this layer alone."""
        evict([self])

    def refill(self):
        """Give every segment its next free slots: `refill` of this layer alone."""
        refill([self])

    def need(self) -> int:
        """Free slots each segment needs until the next eviction (or, past the
        tokens planned, as in a chat, a round's worth)."""
        E = self.evict_every
        remaining = self.max_new_tokens - 1 - self.steps
        return min(E - self.steps % E, remaining) if remaining > 0 else E

    def grow(self, counts: list[int], need: int) -> bool:
        """Widen the groups in which a segment has fewer than `need` free slots
        (counts: each segment's); whether any did."""
        E, P = self.evict_every, self.page
        remaining = self.max_new_tokens - 1 - self.steps
        grow = {}
        for i, g in enumerate(self.groups):
            least = min(counts[s] for s in g.rows)
            if least < need:
                # Grow to what the budget charged the policy for the rest of the
                # generation (a quarter more at most), and a round more: a group
                # of Full heads grows once, not every other round.
                planned = min(math.ceil(g.growth * max(remaining, 0)), g.pages * P // 4)
                grow[i] = -(-(max(need, planned) + E - least) // P)
        if grow:
            self.widen(grow)
        return bool(grow)

    def widen(self, grow: dict[int, int]):
        """Add `grow[i]` empty pages to each segment of group i; the pool is rebuilt."""
        parts = {name: [] for name in self.fields}
        D = self.v.shape[-1]
        pages = {name: getattr(self, name) for name in self.fields}
        if self.masked:
            pages["k"] = self.k.T.view(-1, self.page, D)  # (N, P, D)
        for i, g in enumerate(self.groups):
            extra = grow.get(i, 0)
            for name, empty in self.fields.items():
                t = pages[name][g.first:g.first + len(g.rows) * g.pages]
                t = t.reshape(len(g.rows), g.pages, *t.shape[1:])
                pad = t.new_full((len(g.rows), extra, *t.shape[2:]), empty)
                parts[name].append(torch.cat([t, pad], 1).flatten(0, 1))
            g.pages += extra
        for name, ts in parts.items():
            t = torch.cat(ts)
            setattr(self, name, t.view(-1, D).T.contiguous() if name == "k" and self.masked else t)
        self.n_growths += len(grow)
        self._place()
        self._hide()
        self._mark_dynamic()

    # --- What the cache holds ------------------------------------------------------

    STATE = ("owner", "start", "width", "seg_prompt_len", "seg_first_query", "evicts_by", "dest",
             "free")

    def nbytes(self) -> int:
        """Bytes the cache really holds: K, V and every index and score tensor."""
        if self.groups is None:
            return 0
        held = (*self.fields, *self.STATE, *(["bias"] if self.masked else []))
        return sum(getattr(self, name).nbytes for name in held)

    def kept(self) -> int:
        return int((self.pos >= 0).sum()) if self.groups is not None else 0

    def growths(self) -> int:
        """Times a group widened while decoding (each a new shape for compiled code)."""
        return self.n_growths

    def plan(self) -> list[Policy]:
        """The policy of each segment (sequence-major, then KV head)."""
        return [self.policies[i] for i in self.choice.tolist()]


class Pending:
    """The layers of a model whose prompts wait to be profiled and
    compressed: they choose their policies together (`decide`), once the last
    layer has come or once what they hold would pass `max_bytes`. Choosing
    among a menu's policies is a few hundred small operations whatever the
    number of segments: done a layer at a time, at short prompts, they cost
    as much as the profiling's arithmetic."""

    def __init__(self, layers: int, max_bytes: int = HELD_BYTES):
        self.layers, self.max_bytes = layers, max_bytes
        self.waiting: list[FastGenCache] = []
        self.profiled = 0

    def add(self, cache: FastGenCache):
        self.waiting.append(cache)
        self.profiled += 1
        held = sum(t.nbytes for c in self.waiting for t in c.held[:3])
        # Decide now if one more layer like these would pass the limit.
        if self.profiled >= self.layers or held + held // len(self.waiting) > self.max_bytes:
            self.flush()

    def flush(self):
        """Decide for every layer waiting, now."""
        if self.waiting:
            decide(self.waiting)
            self.waiting = []


def decide(caches: list[FastGenCache]):
    """Profile, choose and compress for several layers' prompts at once: the
    layers stacked as one batch of sequences, profiled, ranked and scored by
    every policy together; each layer then chooses (under its own threshold or
    budget) and builds its pool. The layers must share their policies and the
    rows profiling reads (`fastgen_caches` makes them so)."""
    t0 = _clock(caches[0].prompt_lens.device)
    first = caches[0]
    shared = lambda c: (c.policies, c.rows, c.sink, c.max_new_tokens)  # noqa: E731
    if any(shared(c) != shared(first) for c in caches):
        raise ValueError("decide: the layers' caches must share their policies, profiling "
                         "options and max_new_tokens")
    prompt, recovery = first.from_sums(profile_layers(caches), first.held[3], first.sink,
                                       layers=len(caches))  # (L * S, T), (L * S, M)
    keeps = torch.stack([prompt.keeps(p) for p in first.policies])  # (M, L * S, T)
    growth = torch.stack([p.growth(prompt) for p in first.policies], dim=1)  # (L * S, M)
    L, M = len(caches), len(first.policies)
    S = len(recovery) // L
    layers = [slice(i * S, (i + 1) * S) for i in range(L)]
    for c, rows in zip(caches, layers):
        c.recovery = recovery[rows]
        if M == 1:
            c.choice = torch.zeros(S, dtype=torch.long, device=recovery.device)
        elif c.budget is None:
            c.choice = choose(c.recovery, c.threshold)
    budgeted = [i for i, c in enumerate(caches) if c.budget is not None and M > 1]
    if budgeted:
        # A head's cost: the prompt tokens it keeps and what it will keep of the
        # new ones; a layer's budget: a share of what a full cache would hold.
        new = first.max_new_tokens - 1
        costs = (keeps.sum(2).T + torch.ceil(growth * new).long()).view(L, S, M)
        full = (prompt.prompt_len[layers[0]] + new).sum()
        allowed = [int(caches[i].budget * full) for i in budgeted]
        picks = fit_budgets(recovery.view(L, S, M)[budgeted], costs[budgeted], allowed)
        for i, pick in zip(budgeted, picks):
            caches[i].choice = pick
    # What each segment keeps, and on the host (one sync) what the pools are built by.
    choice = torch.cat([c.choice for c in caches])
    every = torch.arange(len(choice), device=choice.device)
    keep = keeps[choice, every]  # (L * S, T)
    choices, kept = torch.stack([choice, keep.sum(1)]).tolist()
    grown = growth[every, choice].tolist()
    compress(caches, prompt, keep, choices, kept, grown)
    for c in caches:
        c.held = None
    spent = (_clock(caches[0].prompt_lens.device) - t0) / len(caches)
    for c in caches:
        c.profile_s += spent


def compress(caches: list[FastGenCache], prompt: Slots, keep, choice: list[int],
             kept: list[int], growth: list[float]):
    """Build the layers' pools from what each segment's policy keeps of its
    prompt: each layer's laid out on the host (`FastGenCache.layout`), then
    where every slot's token comes from found for all the layers at once, the
    prompt's slot fields gathered at once, and each layer's keys and values
    gathered from its own prompt (`FastGenCache.fill`). prompt, keep: the
    layers' (L * S, T) slots and what each segment's policy keeps of them; on
    the host, each segment's policy, kept tokens and `growth`."""
    S = len(choice) // len(caches)
    layers = [slice(i * S, (i + 1) * S) for i in range(len(caches))]
    sizes = [c.layout(prompt[rows], choice[rows], kept[rows], growth[rows],
                      c.held[0].shape[1] // c.n_kv_heads) for c, rows in zip(caches, layers)]
    # The pools end to end. Kept tokens first, in position order, in each
    # segment's slots: slot start + n of a segment holds its n-th kept token.
    offsets = itertools.accumulate(sizes[:-1], initial=0)
    start = torch.cat([c.start + offset for c, offset in zip(caches, offsets)])  # (L * S,)
    LS, T = keep.shape
    token = torch.arange(LS * T, device=keep.device).view(LS, T)
    # An empty slot reads one past the prompt's tokens, where each field holds its empty value.
    source = torch.full((sum(sizes),), LS * T, dtype=torch.long, device=keep.device)
    source[(start[:, None] + keep.cumsum(1) - 1)[keep]] = token[keep]
    fields = dict(pos=prompt.pos.int(), score=prompt.score, last=prompt.last, flags=prompt.flags)
    fields = {name: torch.cat([t.reshape(-1), t.new_full((1,), SLOT_FIELDS[name])])
              for name, t in fields.items() if t is not None}
    # Each slot's row of its layer's k and v, as the model lays them out (B, T, K).
    K = caches[0].n_kv_heads
    seg, at = source % (S * T) // T, source % T
    rows = ((seg // K * T + at) * K + seg % K).split(sizes)
    for c, rows_i, source_i in zip(caches, rows, source.split(sizes)):
        _, k, v, _ = c.held
        c.fill(k, v, rows_i, fields, source_i)


def profile_layers(caches: list[FastGenCache]) -> Profile:
    """Profiling's sums for the layers waiting in `decide`: the layers as one
    batch of L * B sequences, one pass for all."""
    first = caches[0]
    q, k = (torch.cat([c.held[i] for c in caches]) for i in (0, 1))
    lens = first.prompt_lens.repeat(len(caches))
    return attention_sums(q, k, lens, local_ratios(first.policies), first.rows)


def reserve(caches: list[nn.Module]):
    """Before every decode step, outside compiled code, for every layer's cache:
    evict when due (all the layers due at once: `evict`), hand out free slots
    when the last ones are used, and point the step at its slots. Caches of
    other kinds `reserve` themselves."""
    fastgen = [c for c in caches if isinstance(c, FastGenCache)]
    for c in caches:
        if not isinstance(c, FastGenCache):
            c.reserve()
    clocks = [c.clock for c in fastgen]
    evict([c for c, t in zip(fastgen, clocks) if t.steps % c.evict_every == 0 and t.steps])
    refill([c for c, t in zip(fastgen, clocks)
            if t.steps % c.evict_every == 0 or t.cursor == c.free.shape[1]])
    for c, t in zip(fastgen, clocks):
        c.dest.copy_(c.free[:, t.cursor])
        t.cursor += 1
        t.steps += 1


def pools(caches: list[FastGenCache]) -> tuple[list[int], list[int], torch.Tensor]:
    """The layers' pools as if laid end to end: each one's slots and first slot
    there, and every segment's first slot, (sum of S,)."""
    sizes = [c.pos.numel() for c in caches]
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    return sizes, offsets, torch.cat([c.start + offset for c, offset in zip(caches, offsets)])


def refill(caches: list[FastGenCache]):
    """Give every segment of every layer its next free slots, as many as the
    steps until the next eviction, first in slot order; the groups that have
    fewer grow. One host sync for all the layers."""
    def running_free(layers):
        """Running count of free slots over the pools end to end, and its value
        before each segment's first slot; the layers' offsets."""
        sizes, offsets, start = pools(layers)
        free = torch.cat([c.pos.view(-1) for c in layers]).lt(0).long()
        running = free.cumsum(0)
        return running, (running - free)[start], start, offsets

    by_need = {}
    for c in caches:
        by_need.setdefault(c.need(), []).append(c)
    for need, layers in by_need.items():
        segments = [len(c.dest) for c in layers]
        running, before, start, offsets = running_free(layers)
        width = torch.cat([c.width for c in layers])
        counts = (running[start + width - 1] - before).tolist()
        bounds = list(itertools.accumulate(segments, initial=0))
        if any([c.grow(counts[i:j], need) for c, i, j in zip(layers, bounds, bounds[1:])]):
            running, before, start, offsets = running_free(layers)  # the grown pools moved
        # Segment s's j-th free slot is where the running count of free slots
        # reaches the count before its first slot, plus j + 1.
        wanted = before[:, None] + torch.arange(1, need + 1, device=running.device)
        slots = torch.searchsorted(running, wanted)  # (sum of S, need)
        for c, part, offset in zip(layers, slots.split(segments), offsets):
            c.free = part - offset
            c.clock.cursor = 0


def evict(caches: list[FastGenCache]):
    """Free what each segment's policy no longer keeps, in every layer given.

    Every segment's slots become one padded row, the rows of all the layers
    ordered by policy, and each policy ranks its own rows once: a few hundred
    small operations for the model, not for each layer, and no segment ranked
    by a policy that is not its own. The layers must share one list of policies
    (`fastgen_caches` makes them so)."""
    caches = [c for c in caches if c.evicting]
    if not caches:
        return
    policies = caches[0].policies
    if any(c.policies != policies for c in caches):
        raise ValueError("evict: the layers' caches must share one list of policies")
    # The layers' slot fields end to end, and each segment's run of slots in them.
    sizes, offsets, start = pools(caches)
    names = ["pos", "score", "flags"] + (["last"] if any(p.reads_last for p in policies) else [])
    flat = {name: torch.cat([getattr(c, name).view(-1) if name in c.fields
                             else c.score.new_zeros(size) for c, size in zip(caches, sizes)])
            for name in names}
    width = torch.cat([c.width for c in caches])
    by = torch.cat([c.evicts_by for c in caches])
    column = lambda t: torch.cat([t(c) for c in caches])[:, None]  # noqa: E731
    seen, prompt_len = column(FastGenCache.seen), column(lambda c: c.seg_prompt_len)
    first_query = column(lambda c: c.seg_first_query)
    # The rows by policy (those that never evict first, left out): how many rows
    # each policy has, and its widest, in one host sync.
    M = len(policies)
    order = by.argsort(stable=True)
    counts = torch.bincount(by + 1, minlength=M + 1)
    widest = counts.new_zeros(M + 1).scatter_reduce_(0, by + 1, width, "amax")
    counts, widest = torch.stack([counts, widest]).tolist()
    order = order[counts[0]:]
    cols = torch.arange(max(widest[1:]), device=start.device)
    pad = cols >= width[order, None]
    index = (start[order, None] + cols).masked_fill_(pad, 0)  # (R, W) flat slots
    rows = {name: flat[name][index].masked_fill_(pad, SLOT_FIELDS[name]) for name in names}
    seen, prompt_len, first_query = seen[order], prompt_len[order], first_query[order]
    freed, a = [], 0
    for policy, n, w in zip(policies, counts[1:], widest[1:]):
        if n == 0:
            continue
        part = lambda t: t[a:a + n, :w]  # noqa: E731
        s = Slots(part(rows["pos"]), part(rows["score"]), part(rows["flags"]), seen[a:a + n],
                  prompt_len[a:a + n], first_query[a:a + n],
                  part(rows["last"]) if "last" in rows else None)
        freed.append(part(index)[s.valid & ~policy.keep(s)])
        a += n
    freed = torch.cat(freed)
    flat["pos"][freed] = -1
    flat["score"][freed] = 0  # the token written there next starts from nothing
    for name in ("pos", "score"):
        for c, t in zip(caches, flat[name].split(sizes)):
            getattr(c, name).view(-1).copy_(t)
    for c in caches:
        if c.masked:  # what was freed, hidden from every segment
            c.bias.masked_fill_(c.pos.view(1, 1, -1) < 0, -math.inf)


def fastgen_caches(model, policies, prompt_lens, max_new_tokens, token_flags, **options):
    """One FastGenCache per layer of `model`; `options` as FastGenCache takes them."""
    device = model.tok_embeddings.weight.device
    lens = torch.as_tensor(prompt_lens, device=device)
    if token_flags is None:  # no tokenizer at hand: Special then keeps only the first token
        token_flags = torch.zeros(model.args.vocab_size, dtype=torch.uint8)
    flags = token_flags.to(device)
    pending = Pending(len(model.layers))
    return [FastGenCache(policies, lens, max_new_tokens, model.args.n_kv_heads, flags,
                         pending=pending, **options) for _ in model.layers]
