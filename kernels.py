"""Attention kernels beneath the cache, each a faster equivalent of a plain one.

The pool attends a decode step with `paged_attention` (each segment's softmax
pieced together from its pages) or, for a small pool attended eagerly,
`masked_attention` (every query over every slot, kept to its own by a bias).
Profiling reads the prompt's attention with `flash_sums` and
`flash_reread_sums`, two passes of torch's CPU flash attention each, where the
kernel exists; `profiling.attention_sums` and `profiling.reread_sums` are the
plain computations they equal (the tests compare them).
"""
from __future__ import annotations

import math

import torch

from profiling import READ_NORM, Profile, read_score

# Letters in shape comments: S segments, G query heads per KV head, N pages,
# P slots per page, M = N * P slots, B batch, H query heads, K KV heads,
# T prompt tokens, R rows read again, D head dimension.


# --- A decode step over the pool ------------------------------------------------

def paged_attention(q, k, v, empty, owner, window=None):
    """One query per segment over its pages.

    q: (S, G, D); k: (N, D, P) and v: (N, P, D) pages; empty: (N, P) bool, the
    slots that hold nothing; owner: (N,) the segment of each page; window: None
    or (at (E,), rk, rv (E, D)): what slots at lack of their keys and values,
    added to their scores and outputs. Returns the output (S, G, D) and the
    attention each slot got, (N, P) in float32, averaged over the G query heads.
    The softmax of a segment spans its pages: each page's maximum and sum are
    combined per segment, and the pages' outputs by a product with the (S, N)
    matrix of which page is whose: compiled, a scatter of the outputs adds
    atomically, which ran slower on CPU.
    """
    S, G, D = q.shape
    N, P = empty.shape
    scores = ((q.index_select(0, owner) @ k) / math.sqrt(D)).float()  # (N, G, P)
    if window is not None:
        at, rk, rv = window
        page, col = at // P, at % P
        seg = owner.index_select(0, page)
        heads = torch.arange(G, device=q.device)
        qs = q.index_select(0, seg)  # (E, G, D)
        extra = (qs @ rk[..., None]).squeeze(-1).float() / math.sqrt(D)  # (E, G)
        scores = scores.index_put((page[:, None], heads, col[:, None]), extra, accumulate=True)
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
    y = (mine.float() @ (probs.to(v.dtype) @ v).float().view(N, G * D)).view(S, G, D)
    if window is not None:
        got = probs[page[:, None], heads, col[:, None]]  # (E, G)
        y = y.index_add(0, seg, got[..., None] * rv[:, None].float())
    return y.to(v.dtype), probs.mean(1)


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


# --- The prompt's profile, from flash attention ------------------------------------

def with_coordinate(x, last) -> torch.Tensor:
    """x (B, H, N, D) in float32 with `last` (B, H, N) as an extra coordinate,
    then zeros to a multiple of 8 (the flash kernel's vector width): a key's
    1 against a row's -L_i adds the row's log-sum-exp to every score."""
    return torch.cat([x.float(), last[..., None], x.new_zeros(*x.shape[:3], 7,
                                                             dtype=torch.float32)], -1)


def flash_sums(q, k, v, lens) -> tuple[torch.Tensor, Profile] | None:
    """The prompt's causal attention (B, H, T, D), as the prefill's, and every
    row's `attention_sums(q, k, lens)` (colsum and last row), from two passes
    of torch's CPU flash attention, cheaper than a dense pass over the
    probabilities (studies/README.md); None where that kernel
    is missing (another device, another torch). The first pass attends and
    gives each row i its log-sum-exp L_i; token j's column sum is then
    sum_{i >= j} exp(q_i.k_j / sqrt(D) - L_i), a log-sum-exp of the second
    pass: the keys attend over the queries, in reverse order, with L_i folded
    into an extra coordinate (scale 1), padding rows' at -1e9."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or q.device.type != "cpu":
        return None
    B, H, T, D = q.shape
    K = k.shape[1]
    ke, ve = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
    out, lse = flash(q, ke, ve, 0.0, True)  # (B, H, T, D), (B, H, T) float32
    padding = torch.arange(T, device=q.device) >= lens[:, None, None]  # (B, 1, T)
    lse = lse.masked_fill(padding, 1e9)
    keys = with_coordinate(ke, torch.ones_like(lse)).flip(2)
    rows = with_coordinate(q / math.sqrt(D), -lse).flip(2)
    _, col = flash(keys, rows, rows, 0.0, True, scale=1.0)  # (B, H, T) reversed
    col = col.flip(2).exp().masked_fill(padding, 0)
    b = torch.arange(B, device=q.device)
    last_q = q[b, :, lens - 1].float()  # (B, H, D): each prompt's last row
    last = ((last_q[:, :, None] @ ke.float().transpose(-1, -2))[:, :, 0] / math.sqrt(D)
            - lse[b, :, lens - 1, None]).exp().masked_fill(padding, 0)  # (B, H, T)
    mean = lambda x: x.view(B, K, H // K, T).mean(2).flatten(0, 1)  # noqa: E731
    return out, Profile(mean(col), {}, lens.repeat_interleave(K).float(), mean(last))


def flash_reread_sums(q, k, v, held_k, held_v, held, counts):
    """`reread_sums` from torch's CPU flash attention, as `flash_sums` reads a
    prompt: the rows attend to the context and to themselves in two passes,
    joined by their log-sum-exps into each row's L_i; then the context's keys
    attend over the rows scaled by p = READ_NORM, p L_i folded into an extra
    coordinate, so that a key's log-sum-exp is p times the log of the p-norm of
    the attention it received. None where that kernel is missing."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or q.device.type != "cpu":
        return None
    B, H, R, D = q.shape
    K, T = held_k.shape[1:3]
    G = H // K
    ck, cv, k, v = (t.repeat_interleave(G, 1) for t in (held_k, held_v, k, v))
    padding = ~held  # (B, T)
    mask = q.new_zeros(B, 1, 1, T).masked_fill_(padding[:, None, None], -math.inf)
    on_context, lse_c = flash(q, ck, cv, 0.0, False, attn_mask=mask)
    on_rows, lse_r = flash(q, k, v, 0.0, True)
    lse = torch.logaddexp(lse_c, lse_r)  # (B, H, R)
    y = (on_context * (lse_c - lse).exp()[..., None].to(q.dtype)
         + on_rows * (lse_r - lse).exp()[..., None].to(q.dtype))
    read = torch.arange(R, device=q.device) < counts[:, None, None]  # (B, 1, R)
    p = READ_NORM
    rows = with_coordinate(p * q / math.sqrt(D), torch.where(read, -p * lse, -1e9))
    _, col = flash(with_coordinate(ck, torch.ones(B, H, T)), rows, rows, 0.0, False, scale=1.0)
    col = (col / p).masked_fill(padding[:, None], -math.inf)  # (B, H, T)
    return y, read_score(col.view(B, K, G, T))
