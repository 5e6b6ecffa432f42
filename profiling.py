"""Prompt-time profiling: how much of each head's attention a policy recovers.

The recovery of a policy is the share of the prompt's attention mass that
falls on the tokens the policy keeps, averaged over all prompt query rows
(and over the query heads that share a KV head). Two column sums of the
attention matrix are all it needs, so the matrix is never held whole:

    colsum[j]  = sum_i A[i, j]                 attention token j received
    bandsum[j] = sum_i A[i, j] [i - W < j <= i] the part received from the
                                                W queries right after it

For a policy whose kept set K does not depend on the query row (Special,
Punct, Frequent, Full), the mass on K is sum_{j in K} colsum[j]. Local is the
one policy whose set moves with the query (row i keeps its W most recent
tokens), so a union with Local recovers, in addition, sum_{j not in K}
bandsum[j]. Both sums are accumulated over chunks of query rows.
"""
from __future__ import annotations

import math

import torch

from policies import Local, Policy, Slots, share

# Bytes of attention probabilities materialised at once while profiling.
CHUNK_BYTES = 64 << 20


def attention_sums(q, k, lens, windows, chunk_bytes: int = CHUNK_BYTES):
    """Column sums of the prompt's causal attention per KV head.

    q: (B, H, T, D), k: (B, K, T, D), lens: (B,) prompt lengths (rows at or
    past a sequence's length are padding and ignored), windows: (B,) Local
    window per sequence. Returns colsum, bandsum: (B, K, T), float32,
    averaged over the G query heads of each KV head.
    """
    B, H, T, D = q.shape
    K = k.shape[1]
    G = H // K
    kt = (k.float() / math.sqrt(D)).repeat_interleave(G, dim=1).transpose(-1, -2)  # (B, H, D, T)
    colsum = q.new_zeros(B, H, T, dtype=torch.float32)
    bandsum = torch.zeros_like(colsum)
    cols = torch.arange(T, device=q.device)
    rows_per_chunk = max(1, chunk_bytes // (B * H * T * 4))
    for i0 in range(0, T, rows_per_chunk):
        rows = cols[i0:i0 + rows_per_chunk]
        # In place where possible: these (B, H, c, T) tensors are the cost of profiling.
        scores = q[:, :, rows].float() @ kt  # (B, H, c, T)
        scores.masked_fill_(cols[None, :] > rows[:, None], -float("inf"))
        attn = scores.softmax(-1)
        attn.mul_((rows[None, :] < lens[:, None])[:, None, :, None])  # drop padding rows
        colsum += attn.sum(2)
        outside = cols[None, None, :] <= rows[None, :, None] - windows[:, None, None]  # (B, c, T)
        bandsum += attn.masked_fill_(outside[:, None], 0).sum(2)
    return colsum.view(B, K, G, T).mean(2), bandsum.view(B, K, G, T).mean(2)


def recovery(policy: Policy, prompt: Slots, colsum, bandsum) -> torch.Tensor:
    """(N,) share of attention recovered by `policy` on N segments.

    prompt: the segments' prompt tokens; colsum, bandsum: (N, T) from
    `attention_sums`, the band taken with this policy's Local window.
    """
    fixed = [m for m in policy.members() if not isinstance(m, Local)]
    kept = torch.zeros_like(prompt.valid)
    for m in fixed:
        kept |= m.keep(prompt)
    mass = (colsum * kept).sum(-1)
    if len(fixed) < len(policy.members()):
        mass = mass + (bandsum * ~kept).sum(-1)
    return mass / prompt.prompt_len[:, 0]


def local_ratio(policies: list[Policy]) -> float:
    """The Local ratio used by a list of policies (they must agree on one)."""
    ratios = {m.r for p in policies for m in p.members() if isinstance(m, Local)}
    if len(ratios) > 1:
        raise ValueError(f"policies disagree on the Local ratio: {sorted(ratios)}")
    return ratios.pop() if ratios else 0.0


def choose(recoveries: torch.Tensor, threshold: float) -> torch.Tensor:
    """(N,) index of the first policy of the shortlist whose recovery reaches
    the threshold; the last (Full) when none does. `threshold >= 1` means
    compress nothing, whatever rounding says."""
    n = recoveries.shape[1]
    if threshold >= 1:
        return torch.full(recoveries.shape[:1], n - 1, dtype=torch.long)
    ok = recoveries >= threshold
    ok[:, -1] = True
    return ok.int().argmax(dim=1)


def window_sizes(r_local: float, lens: torch.Tensor) -> torch.Tensor:
    return share(r_local, lens) if r_local > 0 else torch.zeros_like(lens)
