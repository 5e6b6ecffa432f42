"""The FastGen KV cache: every attention head keeps only what its policy needs.

A cache *segment* is one (sequence, KV head) pair; a layer of batch B with K
KV heads has B*K of them. At the end of prefill each segment gets a policy
(by profiling, or a fixed one for the baselines) and keeps only the prompt
tokens that policy keeps. Segments of a layer that share a policy and hold
about as many tokens are stored together in a `Bucket`: dense (n, C, D)
tensors, C slots per segment. A head that keeps 5% of the prompt therefore
allocates about 5% of a full head's bytes.

Each decode step, per bucket: write the new token into the segment's first
free slot, attend over the slots in use, add the attention each token got to
its score, and free the slots the policy no longer keeps. The shapes stay
fixed from step to step, so the step compiles once; when a segment runs out
of free slots the bucket grows by a few slots (`reserve`, called between
steps), so the bytes allocated follow the tokens held instead of a bound
reserved up front.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import attend, causal_attention
from policies import Policy, Slots
from profiling import attention_sums, choose, fit_budget, local_ratios, recovery

# Letters in shape comments: B batch, K KV heads, H query heads, G = H // K,
# S = B*K segments, n segments in a bucket, T prompt tokens, C bucket width,
# D head dimension.

# Free slots a bucket keeps ahead of its fullest segment, at least, once it
# grows: a step adds at most one token, so it is checked every GROW steps or so.
GROW = 8
# Segments share a bucket while the largest holds at most this much more than
# the smallest (plus GROW): the rest of a bucket's width is padding.
SPREAD = 1.05


def pad_slots(t: torch.Tensor, extra: int, empty) -> torch.Tensor:
    """`extra` more slots (dim 1) filled with `empty`; t is (n, C) or (n, C, D)."""
    return F.pad(t, (0, 0, 0, extra) if t.dim() == 3 else (0, extra), value=empty)


class Bucket(nn.Module):
    """Segments of one layer that follow the same policy."""

    def __init__(self, policy: Policy, seg, prompt: Slots, keep, k, v, room: int):
        """seg: (n,) segment ids; prompt: their prompt tokens, (n, T), and
        keep (n, T) the ones the policy keeps; k, v: (n, T, D) their
        uncompressed prompt keys and values; room: free slots to leave."""
        super().__init__()
        self.policy = policy
        n, T, D = k.shape
        width = int(keep.sum(1).max()) + room
        # Kept tokens first, in position order; they fill columns 0..kept-1.
        order = (~keep).int().argsort(dim=1, stable=True)[:, :min(T, width)]
        held = torch.arange(order.shape[1], device=k.device) < keep.sum(1, keepdim=True)  # (n, w)

        def fill(src, empty, dtype):
            w = order.shape[1]
            taken = src.gather(1, order if src.dim() == 2 else order[..., None].expand(n, w, D))
            taken = torch.where(held if src.dim() == 2 else held[..., None], taken.to(dtype),
                                torch.tensor(empty, dtype=dtype))
            return pad_slots(taken, width - w, empty)

        buffer = lambda name, t: self.register_buffer(name, t, persistent=False)  # noqa: E731
        buffer("k", fill(k, 0, k.dtype))
        buffer("v", fill(v, 0, v.dtype))
        buffer("pos", fill(prompt.pos, -1, torch.int32))
        buffer("score", fill(prompt.score, 0, torch.float32))
        buffer("flags", fill(prompt.flags, 0, torch.uint8))
        buffer("seg", seg)
        buffer("prompt_len", prompt.prompt_len)
        buffer("first_query", prompt.first_query)
        self.room = room  # steps that surely fit before the next look at `pos`
        self.growths = 0

    def step(self, q, k, v, pos, flags):
        """One decode step. q: (n, G, D); k, v: (n, D); pos, flags: (n,)."""
        rows = torch.arange(k.shape[0], device=k.device)
        col = (self.pos < 0).int().argmax(dim=1)  # the first free slot; `reserve` made one
        self.k[rows, col] = k
        self.v[rows, col] = v
        self.pos[rows, col] = pos.to(self.pos.dtype)
        self.flags[rows, col] = flags
        self.score[rows, col] = 0.0
        y, probs = attend(q, self.k, self.v, (self.pos >= 0)[:, None, :])
        last = probs.mean(dim=1)  # (n, C), averaged over the G query heads
        self.score += last
        slots = Slots(self.pos, self.score, self.flags, pos[:, None] + 1, self.prompt_len,
                      self.first_query, last)
        self.pos.masked_fill_(~self.policy.keep(slots), -1)
        return y

    def reserve(self):
        """Before a step: make sure every segment has a free slot. Looks at the
        tensors (a host sync) only every few steps, and grows by at least GROW
        slots, so compiled code sees a new shape rarely."""
        if self.room == 0:
            free = self.pos.shape[1] - int((self.pos >= 0).sum(1).max())
            if free < GROW:
                self.widen(2 * GROW - free)
                free = 2 * GROW
            self.room = free
        self.room -= 1

    def widen(self, extra: int):
        self.growths += 1
        for name, empty in (("k", 0), ("v", 0), ("pos", -1), ("score", 0), ("flags", 0)):
            setattr(self, name, pad_slots(getattr(self, name), extra, empty))

    def kept(self) -> int:
        return int((self.pos >= 0).sum())


def _clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def bucket_groups(sizes: list[int]) -> list[slice]:
    """Runs of sorted sizes, each within SPREAD (plus GROW) of its first."""
    out, start = [], 0
    for i, size in enumerate(sizes):
        if size > sizes[start] * SPREAD + GROW:
            out.append(slice(start, i))
            start = i
    return out + [slice(start, len(sizes))]


class FastGenCache(nn.Module):
    """One layer's compressed cache.

    `policies` is the candidates of each segment: one policy for every segment
    (the baselines), the paper's shortlist (each segment takes the first whose
    recovery reaches `threshold`), or a menu under `budget` (each segment takes
    the item that maximizes the layer's total recovery with the tokens its
    items will hold at most `budget` of what a full cache holds). Profiling reads the last `rows`
    prompt rows (None: all of them) and, unless `sink`, leaves the first
    token's attention out of the recovery.
    """

    def __init__(self, policies: list[Policy], prompt_lens, max_new_tokens: int, n_kv_heads: int,
                 token_flags, *, threshold: float = 1.0, budget: float | None = None,
                 rows: int | None = None, sink: bool = True):
        super().__init__()
        self.policies = list(policies)
        self.threshold, self.budget, self.rows, self.sink = threshold, budget, rows, sink
        self.max_new_tokens = max_new_tokens
        self.n_kv_heads = n_kv_heads
        self.register_buffer("prompt_lens", prompt_lens, persistent=False)
        self.register_buffer("token_flags", token_flags, persistent=False)
        self.buckets: nn.ModuleList | None = None
        self.choice = self.recovery = None  # the plan, (S,) and (S, len(policies))
        self.profile_s = 0.0  # prefill time spent profiling and compressing, not attending

    def forward(self, q, k, v, input_pos, tokens):
        if self.buckets is None:
            return self.prefill(q, k, v, tokens)
        return self.decode(q, k, v, input_pos, tokens)

    def profile(self, q, k, tokens, rows=None, sink=True) -> tuple[Slots, torch.Tensor]:
        """The prompt's slots, (S, T), scored by the attention of the rows read,
        and the recovery of every policy, (S, n_policies)."""
        B, K, T, D = k.shape
        lens = self.prompt_lens
        prof = attention_sums(q, k, lens, local_ratios(self.policies), rows)
        per_seg = lambda t: t.repeat_interleave(K, dim=0)  # (B, ...) -> (S, ...)  # noqa: E731
        positions = torch.arange(T, device=k.device)
        prompt = Slots(
            pos=per_seg(torch.where(positions < lens[:, None], positions, -1)),
            score=prof.colsum, flags=per_seg(self.token_flags[tokens]),
            seen=per_seg(lens[:, None]), prompt_len=per_seg(lens[:, None]),
            first_query=per_seg(lens[:, None]) - prof.rows.long()[:, None], last=prof.last)
        return prompt, torch.stack([recovery(p, prompt, prof, sink) for p in self.policies], dim=1)

    def prefill(self, q, k, v, tokens):
        y = causal_attention(q, k, v)
        t0 = _clock(q.device)
        B, K, T, D = k.shape
        prompt, self.recovery = self.profile(q, k, tokens, self.rows, self.sink)
        keeps = [p.keep(prompt) for p in self.policies]  # (S, T) each
        if len(self.policies) == 1:
            self.choice = torch.zeros(B * K, dtype=torch.long)
        elif self.budget is not None:
            # A head's cost: the prompt tokens it keeps and what it will keep of
            # the new ones; the budget: a share of what a full cache would hold.
            new = self.max_new_tokens - 1
            costs = torch.stack([keep.sum(1) + torch.ceil(p.growth(prompt) * new).long()
                                 for p, keep in zip(self.policies, keeps)], dim=1)  # (S, n_policies)
            allowed = int(self.budget * (prompt.prompt_len + new).sum())
            self.choice = fit_budget(self.recovery, costs, allowed)
        else:
            self.choice = choose(self.recovery, self.threshold)
        keys, values = k.reshape(B * K, T, D), v.reshape(B * K, T, D)
        room = min(2 * GROW, self.max_new_tokens - 1)
        buckets = []
        for i, policy in enumerate(self.policies):
            seg = (self.choice == i).nonzero()[:, 0]
            kept = keeps[i][seg].sum(1)
            seg = seg[kept.argsort(stable=True)]
            for g in bucket_groups(sorted(kept.tolist())) if len(seg) else []:
                s = seg[g]
                buckets.append(Bucket(policy, s, prompt[s], keeps[i][s], keys[s], values[s], room))
        self.buckets = nn.ModuleList(buckets)
        self.profile_s = _clock(q.device) - t0
        return y

    def decode(self, q, k, v, input_pos, tokens):
        B, H, _, D = q.shape
        K = self.n_kv_heads
        qs = q.view(B * K, H // K, D)  # (S, G, D)
        ks, vs = k.view(B * K, D), v.view(B * K, D)
        pos = input_pos.expand(B, K).reshape(B * K)
        flags = self.token_flags[tokens].expand(B, K).reshape(B * K)
        y = torch.empty_like(qs)
        for b in self.buckets:
            y[b.seg] = b.step(qs[b.seg], ks[b.seg], vs[b.seg], pos[b.seg], flags[b.seg])
        return y.view(B, H, 1, D)

    def reserve(self):
        """Call before every decode step, outside compiled code."""
        for b in self.buckets:
            b.reserve()

    def nbytes(self) -> int:
        """Bytes the cache really holds: K, V and every index and score tensor."""
        return sum(t.nbytes for b in self.buckets or [] for t in b.buffers())

    def kept(self) -> int:
        return sum(b.kept() for b in self.buckets or [])

    def growths(self) -> int:
        """Slots added while decoding, over all buckets (each a new shape)."""
        return sum(b.growths for b in self.buckets or [])

    def plan(self) -> list[Policy]:
        """The policy of each segment (sequence-major, then KV head)."""
        return [self.policies[i] for i in self.choice.tolist()]


def fastgen_caches(model, policies, prompt_lens, max_new_tokens, token_flags, **options):
    """One FastGenCache per layer of `model`; `options` as FastGenCache takes them."""
    device = model.tok_embeddings.weight.device
    lens = torch.as_tensor(prompt_lens, device=device)
    if token_flags is None:  # no tokenizer at hand: Special then keeps only the first token
        token_flags = torch.zeros(model.args.vocab_size, dtype=torch.uint8)
    flags = token_flags.to(device)
    return [FastGenCache(policies, lens, max_new_tokens, model.args.n_kv_heads, flags, **options)
            for _ in model.layers]
