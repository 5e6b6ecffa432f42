"""The FastGen KV cache: every attention head keeps only what its policy needs.

A cache *segment* is one (sequence, KV head) pair; a layer of batch B with K
KV heads has B*K of them. At the end of prefill each segment gets a policy
(by profiling, or a fixed one for the baselines) and keeps only the prompt
tokens that policy keeps. Segments of a layer that share a policy are stored
together in a `Bucket`: dense (n, C, D) tensors whose width C is what that
policy can ever need, reserved up front for the whole generation. A head that
keeps 5% of the prompt therefore allocates about 5% of a full head's bytes,
and the decode step works on fixed shapes, so it compiles once.

Each decode step, per bucket: write the new token into the segment's first
free slot, attend over the slots in use, add the attention each token got to
its heavy-hitter score, and free the slots the policy no longer keeps.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from model import attend, causal_attention
from policies import Policy, Slots
from profiling import attention_sums, choose, local_ratio, recovery, window_sizes

# Letters in shape comments: B batch, K KV heads, H query heads, G = H // K,
# S = B*K segments, n segments in a bucket, T prompt tokens, C bucket width,
# D head dimension.


class Bucket(nn.Module):
    """The segments of one layer that follow the same policy."""

    def __init__(self, policy: Policy, seg, prompt: Slots, k, v, capacity: int):
        """seg: (n,) segment ids; prompt: their prompt tokens, (n, T);
        k, v: (n, T, D) their uncompressed prompt keys and values."""
        super().__init__()
        self.policy = policy
        n, T, D = k.shape
        keep = policy.keep(prompt)
        # Kept tokens first, in position order; they fill columns 0..kept-1.
        order = (~keep).int().argsort(dim=1, stable=True)[:, :min(T, capacity)]
        held = torch.arange(order.shape[1], device=k.device) < keep.sum(1, keepdim=True)  # (n, w)

        def fill(shape, src, empty, dtype):
            out = torch.full(shape, empty, dtype=dtype, device=src.device)
            w = order.shape[1]
            taken = src.gather(1, order if src.dim() == 2 else order[..., None].expand(n, w, D))
            mask = held if src.dim() == 2 else held[..., None]
            out[:, :w] = torch.where(mask, taken.to(dtype), torch.tensor(empty, dtype=dtype))
            return out

        self.register_buffer("k", fill((n, capacity, D), k, 0, k.dtype), persistent=False)
        self.register_buffer("v", fill((n, capacity, D), v, 0, v.dtype), persistent=False)
        self.register_buffer("pos", fill((n, capacity), prompt.pos, -1, torch.int32), persistent=False)
        self.register_buffer("score", fill((n, capacity), prompt.score, 0, torch.float32),
                             persistent=False)
        self.register_buffer("flags", fill((n, capacity), prompt.flags, 0, torch.uint8),
                             persistent=False)
        self.register_buffer("seg", seg, persistent=False)
        self.register_buffer("prompt_len", prompt.prompt_len, persistent=False)

    def step(self, q, k, v, pos, flags):
        """One decode step. q: (n, G, D); k, v: (n, D); pos, flags: (n,)."""
        rows = torch.arange(k.shape[0], device=k.device)
        # The width leaves one slot free beyond the most the policy keeps, so
        # every segment has room for its new token before eviction.
        col = (self.pos < 0).int().argmax(dim=1)
        self.k[rows, col] = k
        self.v[rows, col] = v
        self.pos[rows, col] = pos.to(self.pos.dtype)
        self.flags[rows, col] = flags
        self.score[rows, col] = 0.0
        y, probs = attend(q, self.k, self.v, (self.pos >= 0)[:, None, :])
        self.score += probs.mean(dim=1)  # (n, C), averaged over the G query heads
        slots = Slots(self.pos, self.score, self.flags, pos[:, None] + 1, self.prompt_len)
        self.pos.masked_fill_(~self.policy.keep(slots), -1)
        return y

    def kept(self) -> int:
        return int((self.pos >= 0).sum())


def _clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class FastGenCache(nn.Module):
    """One layer's compressed cache.

    `policies` is either the profiling shortlist (each segment takes the first
    whose recovery reaches `threshold`) or a single policy for every segment.
    The buckets are built at the end of prefill, when profiling has said how
    much each head keeps; that is the one allocation this cache makes.
    """

    def __init__(self, policies: list[Policy], threshold: float, prompt_lens, max_new_tokens: int,
                 n_kv_heads: int, token_flags):
        super().__init__()
        self.policies = list(policies)
        self.threshold = threshold
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

    def prefill(self, q, k, v, tokens):
        y = causal_attention(q, k, v)
        t0 = _clock(q.device)
        B, K, T, D = k.shape
        lens = self.prompt_lens
        windows = window_sizes(local_ratio(self.policies), lens)
        colsum, bandsum = attention_sums(q, k, lens, windows)  # (B, K, T) each
        per_seg = lambda t: t.repeat_interleave(K, dim=0)  # (B, ...) -> (S, ...)
        positions = torch.arange(T, device=k.device)
        prompt = Slots(
            pos=per_seg(torch.where(positions < lens[:, None], positions, -1)),
            score=colsum.reshape(B * K, T),
            flags=per_seg(self.token_flags[tokens]),
            seen=per_seg(lens[:, None]), prompt_len=per_seg(lens[:, None]))
        band = bandsum.reshape(B * K, T)
        self.recovery = torch.stack([recovery(p, prompt, prompt.score, band)
                                     for p in self.policies], dim=1)  # (S, n_policies)
        self.choice = choose(self.recovery, self.threshold) if len(self.policies) > 1 \
            else torch.zeros(B * K, dtype=torch.long)
        max_seen = prompt.prompt_len[:, 0] + max(self.max_new_tokens - 1, 0)
        keys, values = k.reshape(B * K, T, D), v.reshape(B * K, T, D)
        buckets = []
        for i, policy in enumerate(self.policies):
            seg = (self.choice == i).nonzero()[:, 0]
            if len(seg):
                # A step adds at most one token, so a head never holds more than
                # it kept of the prompt plus the tokens still to come, nor more
                # than its policy's own bound; one more slot takes the new token
                # before eviction.
                kept = policy.keep(prompt[seg]).sum(1)
                bound = torch.minimum(policy.bound(prompt[seg], max_seen[seg]),
                                      kept + max_seen[seg] - prompt.prompt_len[seg, 0])
                capacity = int(bound.max()) + 1
                buckets.append(Bucket(policy, seg, prompt[seg], keys[seg], values[seg], capacity))
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

    def nbytes(self) -> int:
        """Bytes the cache really holds: K, V and every index and score tensor."""
        return sum(t.nbytes for b in self.buckets or [] for t in b.buffers())

    def kept(self) -> int:
        return sum(b.kept() for b in self.buckets or [])

    def plan(self) -> list[Policy]:
        """The policy of each segment (sequence-major, then KV head)."""
        return [self.policies[i] for i in self.choice.tolist()]


def fastgen_caches(model, policies, threshold, prompt_lens, max_new_tokens, token_flags):
    """One FastGenCache per layer of `model`."""
    device = model.tok_embeddings.weight.device
    lens = torch.as_tensor(prompt_lens, device=device)
    if token_flags is None:  # no tokenizer at hand: Special then keeps only the first token
        token_flags = torch.zeros(model.args.vocab_size, dtype=torch.uint8)
    flags = token_flags.to(device)
    return [FastGenCache(policies, threshold, lens, max_new_tokens, model.args.n_kv_heads, flags)
            for _ in model.layers]
