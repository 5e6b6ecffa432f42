"""Prompt-time profiling: how much of each head's attention a policy recovers.

A policy's recovery is the share of the prompt's attention on the tokens it keeps, averaged over
the rows read (all, as the paper does, or an observation window of the last, more like decoding's
queries) and the query heads of a KV head. Column sums suffice; the matrix is never held whole:

    colsum[j] = sum_i A[i, j]                   attention token j received
    band_W[j] = sum_i A[i, j] [i - W < j <= i]  the part from the W queries right after it

A policy keeping one set K for every row recovers sum_{j in K} colsum[j]; Local keeps each row's
W newest tokens, so a union with it adds sum_{j not in K} band_W[j].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from policies import Policy, Slots, Union, shares
from quant import WINDOW, channel_factors, read_back, rotate, rounds, windowed

# Prompt rows that measure a precision's cost when profiling reads every row.
ERROR_ROWS = 32
# Bytes of attention probabilities materialised at once.
CHUNK_BYTES = 64 << 20
# Most rows per chunk when bands are summed: the band strip gathers c * R * c values per head.
BAND_ROWS = 128
# Fewest rows per chunk where the batch can split: each chunk rereads all its sequences' keys.
MIN_ROWS = 64
# A token's score when the context is read again: the p-norm of the attention its rows gave it,
# p = READ_NORM, a smooth max (KVzip scores by the max) that flash attention computes as a
# log-sum-exp (`read_again_sums`).
READ_NORM = 16
# A KV head copies when, over random tokens said twice, its query heads give on the mean at least
# this much attention to the token after each one's earlier occurrence (an induction head,
# Olsson et al. 2022). It reads whatever a text repeats, which no profile of the prompt's last
# rows foresees.
COPY_SHARE = 0.3


@dataclass
class Profile:
    """What profiling read of one layer's prompt attention, per segment (S of them)."""
    colsum: torch.Tensor              # (S, T) attention each prompt token received
    bands: dict[float, torch.Tensor]  # Local ratio -> (S, T) its band sum
    rows: torch.Tensor                # (S,) query rows read
    last: torch.Tensor                # (S, T) attention from the last prompt row alone

    @staticmethod
    def cat(parts: list["Profile"]) -> "Profile":
        """The segments of several, each padded with tokens no row read to the widest."""
        T = max(p.colsum.shape[1] for p in parts)
        cat = lambda ts: torch.cat([F.pad(t, (0, T - t.shape[1])) for t in ts])  # noqa: E731
        return Profile(cat([p.colsum for p in parts]),
                       {r: cat([p.bands[r] for p in parts]) for r in parts[0].bands},
                       torch.cat([p.rows for p in parts]), cat([p.last for p in parts]))


def attention_sums(q, k, lens, ratios=(), rows: int | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> Profile:
    """Float32 column sums of the prompt's causal attention per KV head, mean of its G query heads.

    q : (B, H, T', D) the queries of the last T' rows (at least the rows read)
    k : (B, K, T, D) the keys
    lens : (B,) prompt lengths; rows at or past them are padding, ignored
    ratios : the Local windows whose band sums to take
    rows : the last rows of each prompt read; None: every row"""
    B, K, T, D = k.shape
    H = q.shape[1]
    per = max(1, chunk_bytes // (H * T * 4 * MIN_ROWS))  # sequences at a time
    if per < B:
        return Profile.cat([attention_sums(q[i:i + per], k[i:i + per], lens[i:i + per], ratios,
                                           rows, chunk_bytes) for i in range(0, B, per)])
    G = H // K
    kt = k.float().transpose(-1, -2)  # (B, K, D, T): the G query heads of a KV head share it
    qg = q.view(B, K, G, -1, D)
    offset = T - q.shape[2]  # the row of q's first query
    first = lens - (lens if rows is None else lens.clamp(max=rows))  # (B,) first row read
    start = int(first.min())
    if start < offset:
        raise ValueError(f"attention_sums: row {start} is read, but q starts at row {offset}")
    windows = shares(ratios, lens)  # (R, B)
    colsum = q.new_zeros(B, K, T, dtype=torch.float32)
    bands = q.new_zeros(len(ratios), B, K, T, dtype=torch.float32)
    last = q.new_zeros(B, K, T, dtype=torch.float32)
    cols, batch = torch.arange(T, device=q.device), torch.arange(B, device=q.device)
    step = chunk_rows(B * H, T, len(ratios), chunk_bytes)
    for i0 in range(start, T, step):
        r = cols[i0:i0 + step]
        c = len(r)
        read = (r >= first[:, None]) & (r < lens[:, None])  # (B, c) the rows read
        end = i0 + c  # no row of the chunk sees a key at or past it
        future = cols[i0 + 1:end] > r[:, None]  # (c, c - 1) the keys a row must not see
        rows_sum = head_sums(qg[:, :, :, r - offset], kt[..., :end], future, read)
        rows_sum = F.pad(rows_sum, (0, T - end))  # (B, K, c, T)
        chunk = rows_sum.sum(2)  # (B, K, T)
        colsum += chunk
        # The last row alone, in whichever chunk holds it: what TOVA ranks the prompt by.
        row = lens - 1 - i0  # (B,) the last row's place in this chunk
        here = (row >= 0) & (row < c)
        at_last = rows_sum[batch, :, row.clamp(0, c - 1)]  # (B, K, T)
        last = torch.where(here[:, None, None], at_last, last)
        if ratios:
            add_bands(bands, rows_sum, chunk, windows, cols, i0)
    bands = (bands / G).view(len(ratios), B * K, T)
    return Profile((colsum / G).view(B * K, T), dict(zip(ratios, bands)),
                   (lens - first).repeat_interleave(K).float(), (last / G).view(B * K, T))


def row_probs(q, k, rows) -> torch.Tensor:
    """(H, R, T) the causal attention of one sequence's rows `rows` (R,), q (1, H, T, D) and
    k (1, K, T, D), in float32."""
    H, K, T = q.shape[1], k.shape[1], k.shape[2]
    keys = k[0].float().repeat_interleave(H // K, 0).transpose(-1, -2)  # (H, D, T)
    scores = q[0, :, rows].float() @ keys / math.sqrt(q.shape[-1])  # (H, R, T)
    future = torch.arange(T, device=q.device) > rows[:, None]
    return scores.masked_fill(future, -math.inf).softmax(-1)


def induction_scores(q, k) -> torch.Tensor:
    """(K,) over random tokens said twice, q (1, H, 2n, D) and k (1, K, 2n, D): the attention each
    row of the repeat gives the token after its own earlier occurrence, the mean over the rows,
    the most of the G query heads of a KV head."""
    H, K, n = q.shape[1], k.shape[1], k.shape[2] // 2
    rows = torch.arange(n, 2 * n, device=q.device)  # the repeat; row p said what p - n said
    probs = row_probs(q, k, rows)  # (H, n, 2n)
    return probs[:, torch.arange(n), rows - n + 1].mean(1).view(K, H // K).amax(1)


def attention_lse(q, k, v, causal: bool = False, mask=None, scale: float | None = None):
    """Attention of q (B, H, R, D) over k, v (B, H, T, D), with each row's log-sum-exp (B, H, R)
    in float32: torch's CPU flash kernel where it exists, else the plain softmax."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None and q.device.type == "cpu":
        return flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                          -math.inf)
    if mask is not None:
        s = s + mask
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def with_coordinate(x, last) -> torch.Tensor:
    """x (B, H, N, D) in float32 with `last` (B, H, N) as an extra coordinate, then zeros to a
    multiple of 8 (the flash kernel's vector width): a key's 1 against a row's -L_i adds the
    row's log-sum-exp to every score."""
    return torch.cat([x.float(), last[..., None], x.new_zeros(*x.shape[:3], 7,
                                                             dtype=torch.float32)], -1)


def read_again_sums(q, k, v, held_k, held_v, held, counts) -> tuple[torch.Tensor, torch.Tensor]:
    """The context read again (KVzip's reconstruction), each row seeing it and the rows before.
    Returns the output (B, H, R, D) and each context token's score (B * K, T): the READ_NORM-norm
    over the rows of the attention they gave it, the most of its G query heads (`read_score`).

    q : (B, H, R, D) the queries of the tokens read again; k, v (B, K, R, D) theirs
    held_k, held_v : (B, K, T, D) the context's keys and values
    held : (B, T) bool, the context's keys that exist (the others are padding)
    counts : (B,) rows of each sequence read again; the others are padding

    Two attention passes, never the (R, T) probabilities: the rows attend to the context and to
    themselves, joined by their log-sum-exps into each row's L_i; then the context's keys attend
    over the rows scaled by p = READ_NORM, with -p L_i as an extra coordinate, so that a key's
    log-sum-exp is p times the log of the p-norm of the attention it received."""
    B, H, R, D = q.shape
    K, T = held_k.shape[1:3]
    G = H // K
    ck, cv, k, v = (t.repeat_interleave(G, 1) for t in (held_k, held_v, k, v))
    padding = ~held  # (B, T)
    mask = q.new_zeros(B, 1, 1, T).masked_fill_(padding[:, None, None], -math.inf)
    on_context, lse_c = attention_lse(q, ck, cv, mask=mask)
    on_rows, lse_r = attention_lse(q, k, v, causal=True)
    lse = torch.logaddexp(lse_c, lse_r)  # (B, H, R)
    y = (on_context * (lse_c - lse).exp()[..., None].to(q.dtype)
         + on_rows * (lse_r - lse).exp()[..., None].to(q.dtype))
    read = torch.arange(R, device=q.device) < counts[:, None, None]  # (B, 1, R)
    p = READ_NORM
    rows = with_coordinate(p * q / math.sqrt(D), torch.where(read, -p * lse, -1e9))
    keys = with_coordinate(ck, torch.ones(B, H, T, device=q.device))
    _, col = attention_lse(keys, rows, rows, scale=1.0)
    col = (col / p).masked_fill(padding[:, None], -math.inf)  # (B, H, T)
    return y, read_score(col.view(B, K, G, T))


def read_score(log_norms) -> torch.Tensor:
    """(B * K, T) from each query head's log READ_NORM-norm (B, K, G, T): the most of the G."""
    return log_norms.exp().amax(2).flatten(0, 1)


def read_again_profile(score, pos, seen, prompt_len, ratios) -> Profile:
    """A context read again as a one-row Profile of its scores (S, C), not shares: a policy
    recovers the score it keeps, which the knapsack compares across heads, as KVzip ranks every
    head's tokens together. Tokens at pos (S, C); a question follows the seen (S, 1): Local's band
    is the newest ceil(r * prompt_len)."""
    bands = {r: score * (pos >= seen - w) for r, w in zip(ratios, shares(ratios, prompt_len))}
    return Profile(score, bands, score.new_ones(len(score)), score)


def chunk_rows(heads: int, T: int, n_ratios: int, chunk_bytes: int) -> int:
    """Query rows per chunk: as many as `chunk_bytes` of float32 scores hold for `heads` heads."""
    rows = max(1, chunk_bytes // (heads * T * 4))
    if n_ratios:  # a chunk's band strip reads c * R * c of its c * T scores per head
        rows = min(rows, max(32, min(BAND_ROWS, T // (2 * n_ratios))))
    return rows


def head_sums(q, kt, future, read) -> torch.Tensor:
    """(B, K, c, T) causal attention of c query rows, summed over G heads, weighted by read (B, c);
    q (B, K, G, c, D), kt (B, K, D, T), future (c, F): the last F keys each row must not see."""
    B, K, G, c, D = q.shape
    T = kt.shape[-1]
    scores = (q.float() / math.sqrt(D)).reshape(B, K, G * c, D) @ kt
    # The (B, K, G, c, T) scores are profiling's cost: all passes run in place, G summed first.
    e = scores.view(B, K, G, c, T)
    e[..., T - future.shape[-1]:].masked_fill_(future, -float("inf"))  # causal
    e = e.sub_(e.amax(-1, keepdim=True)).exp_()
    p = e.mul_(read[:, None, None, :, None] / e.sum(-1, keepdim=True))  # probabilities
    return p.sum(2)


def add_bands(bands, rows_sum, chunk, windows, cols, i0: int) -> None:
    """Add to `bands` (R, B, K, T) the chunk's share (its rows from i0) of each window's band."""
    B, K, c, T = rows_sum.shape
    R = len(windows)
    # Token j's band (rows j .. j + W - 1) takes the chunk's whole column if j >= i0 + c - W, none
    # if j + W <= i0; the c - 1 tokens between, j = i0 - W + 1 + t, take its rows up to i0 + t.
    bands += chunk * (cols >= i0 + c - windows[..., None])[:, :, None]  # (R, B, K, T)
    strip = i0 - windows[..., None] + 1 + cols[:c - 1]  # (R, B, c - 1)
    at = strip.clamp(min=0).permute(1, 0, 2).reshape(B, 1, 1, -1)
    got = rows_sum.gather(3, at.expand(B, K, c, -1)).view(B, K, c, R, c - 1)
    upto = cols[:c, None] <= cols[:c - 1]  # (c, c - 1): row i counts for token t
    part = (got * upto[:, None]).sum(2).permute(2, 0, 1, 3)  # (R, B, K, c - 1)
    part = part * (strip >= 0)[:, :, None]
    bands.scatter_add_(3, strip.clamp(min=0)[:, :, None].expand_as(part), part)


def prompt_slots(sums: Profile, lens, flags, n_kv_heads: int, layers: int = 1,
                 span: int = 1) -> Slots:
    """The prompts as slots (layers * B * K, T), `layers` layers stacked: position (-1 past the
    end), score (the attention read, `carried` `span` tokens on), flags (B, T), first row read."""
    T = flags.shape[1]
    per_seg = lambda t: t.repeat_interleave(n_kv_heads, dim=0).repeat(  # noqa: E731
        layers, *[1] * (t.dim() - 1))  # (B, ...) -> (layers * B * K, ...)
    positions = torch.arange(T, device=lens.device)
    return Slots(pos=per_seg(torch.where(positions < lens[:, None], positions, -1)),
                 score=carried(sums.colsum, span), flags=per_seg(flags),
                 seen=per_seg(lens[:, None]), prompt_len=per_seg(lens[:, None]),
                 first_query=per_seg(lens[:, None]) - sums.rows.long()[:, None], last=sums.last)


def carried(colsum, span: int) -> torch.Tensor:
    """(S, T) the most attention any of the `span` tokens up to each received: an answer copying a
    name attends, token by token, past the last one copied, which the question barely saw."""
    if span <= 1:
        return colsum
    return F.max_pool1d(F.pad(colsum[:, None], (span - 1, 0)), span, 1)[:, 0]


def weigh(sums: Profile, v) -> Profile:
    """`sums` with token j's attention times its value's norm |v_j| (v: (B, K, T, D); not the
    paper's method): what the output loses without j. Scaled per segment so the rows read keep
    their mass (recoveries divide by it; decoding adds plain attention to the scores)."""
    w = v.float().norm(dim=-1).flatten(0, 1)  # (S, T)
    w = w * sums.colsum.sum(1, keepdim=True) / (sums.colsum * w).sum(1, keepdim=True).clamp(
        min=1e-12)
    return Profile(sums.colsum * w, {r: b * w for r, b in sums.bands.items()}, sums.rows,
                   sums.last * w)


def held_profile(probs, held: Slots, rows, ratios) -> Profile:
    """A Profile of held slots (any order) from R query rows at positions rows (S, R), probs
    (S, R, C), read as `attention_sums` reads a prompt: a band counts rows within its window."""
    windows = shares(ratios, held.prompt_len)  # (ratios, S, 1)
    bands = {r: (probs * (held.pos[:, None] > rows[..., None] - w[:, None])).sum(1)
             for r, w in zip(ratios, windows)}
    return Profile(probs.sum(1), bands, probs.new_full((len(probs),), rows.shape[1]),
                   probs[:, -1])


def precision_errors(q, k, v, lens, bits: list[int], rows: int | None = None,
                     window: int | None = None) -> torch.Tensor:
    """(B * K, len(bits)) what storing keys and values in each of `bits` costs the rows read: the
    attention mass rounded keys move (half the L1 distance) plus the share of the output rounded
    values change, |A (V_b - V)| / |A V|: the paper's |A - softmax(Q K_C^T)| <= 1 - T when rounding.

    q : (B, H, T', D) the queries of the last T' rows
    k, v : (B, K, T, D) the keys and values
    lens : (B,) prompt lengths
    bits : the precisions; 16 costs nothing
    rows : the last prompt rows read; None: ERROR_ROWS
    window : newest tokens a windowed precision keeps to about 8 bits (quant.windowed); None:
        WINDOW"""
    B, K, T, D = k.shape
    rows = rows or ERROR_ROWS
    q = q[:, :, -min(q.shape[2], T - int((lens - lens.clamp(max=rows)).min())):]
    H, R = q.shape[1], q.shape[2]
    G = H // K
    out = q.new_zeros(B * K, len(bits), dtype=torch.float32)
    at = torch.arange(T - R, T, device=q.device)  # each query's position
    read = (at < lens[:, None]) & (at >= lens[:, None] - rows)  # (B, R)
    sees = (torch.arange(T, device=q.device) <= at[:, None]) & (  # (B, R, T)
        torch.arange(T, device=q.device) < lens[:, None, None])
    q = q.float().reshape(B, K, G * R, D) / math.sqrt(D)
    k, v = k.float(), v.float()

    def attention(keys):  # (B, K, G, R, T)
        s = (q @ keys.transpose(-1, -2)).view(B, K, G, R, T)
        return s.masked_fill_(~sees[:, None, None], -math.inf).softmax(-1).nan_to_num_(0.0)

    a = attention(k)
    y = a @ v[:, :, None]  # (B, K, G, R, D)
    prompt = (torch.arange(T, device=k.device) < lens[:, None]).repeat_interleave(K, 0)
    factors = channel_factors(k.reshape(B * K, T, D), prompt).view(B, K, 1, D)
    weight = read[:, None, None].float()  # (B, 1, 1, R): the rows read
    newest = (torch.arange(T, device=k.device) >= lens[:, None] - (
        WINDOW if window is None else window))[:, None, :, None]  # (B, 1, T, 1)
    n = (read.sum(1).clamp(min=1) * G)[:, None]  # (B, 1)

    # k, v as the pool reads them at each precision that rounds, and in its windows.
    def read(b, window=False):
        return (rotate(read_back(rotate(k / factors), b, window)) * factors,
                rotate(read_back(rotate(v), b, window)))

    for i, b in enumerate(bits):
        if not rounds(b):
            continue
        kb, vb = read(b)
        if windowed(b):
            kw, vw = read(b, window=True)
            kb, vb = kb.where(~newest, kw), vb.where(~newest, vw)
        moved = (attention(kb) - a).abs().sum(-1) / 2  # (B, K, G, R)
        changed = (a @ (vb - v)[:, :, None]).norm(dim=-1) / y.norm(dim=-1).clamp(min=1e-6)
        out[:, i] = (((moved + changed) * weight).sum((2, 3)) / n).view(-1)
    return out


def local_ratios(policies: list[Policy]) -> list[float]:
    return sorted({m.band for p in policies for m in p.members() if m.band is not None})


def recovery(policy: Policy, prompt: Slots, prof: Profile) -> torch.Tensor:
    """(S,) share of the attention read that `policy` recovers on S segments."""
    return recoveries([policy], prompt, prof)[:, 0]


def recoveries(policies: list[Policy], prompt: Slots, prof: Profile) -> torch.Tensor:
    """(S, M) share of the attention read that each policy recovers; prompt: tokens by position."""
    ratios = list(prof.bands)
    fixed, band = [], []  # per policy: what it keeps whatever the row; its widest window's band
    nothing = torch.zeros_like(prompt.valid)
    for p in policies:
        others = [m for m in p.members() if m.band is None]
        fixed.append(prompt.keeps(Union(*others)) if others else nothing)
        local = [m.band for m in p.members() if m.band is not None]
        band.append(2 + ratios.index(max(local)) if local else 1)
    # sum_j F colsum + (1 - F) band, F the fixed masks, as one product with [colsum, 0, bands].
    sums = torch.stack([prof.colsum, torch.zeros_like(prof.colsum), *prof.bands.values()], 2)
    fixed = torch.stack(fixed, 1).float()  # (S, M, T)
    product = fixed @ sums  # (S, M, 2 + R)
    got = product[..., 0] + sums.sum(1)[:, band] - product[:, range(len(policies)), band]
    # A head that reads no row loses nothing, whatever it keeps.
    return torch.where((prof.rows > 0)[:, None], got / prof.rows[:, None], 1.0)


def choose(recoveries: torch.Tensor, threshold: float) -> torch.Tensor:
    """(S,) the first policy reaching `threshold`, else the last (Full), always if it is >= 1."""
    n = recoveries.shape[1]
    if threshold >= 1:
        return torch.full(recoveries.shape[:1], n - 1, dtype=torch.long)
    ok = recoveries >= threshold
    ok[:, -1] = True
    return ok.int().argmax(dim=1)


def fit_budget(values: torch.Tensor, costs: torch.Tensor, budget: int,
               resolution: int = 4096) -> torch.Tensor:
    """(S,) the menu item per segment maximizing the sum of `values` (S, M) with integer `costs`
    (S, M) summing to at most `budget`: a knapsack, exact up to `resolution` tokens; above, costs
    count in units of ceil(budget / resolution), rounded up to stay within budget. If nothing fits:
    the cheapest items worth more than -inf (items worth -inf are never taken)."""
    return fit_budgets(values[None], costs[None], [budget], resolution)[0]


def squared_losses(recoveries: torch.Tensor) -> torch.Tensor:
    """Knapsack value per head, -(1 - r)^2: output error grows with each head's loss squared (KL
    is quadratic in small logit changes), so small losses spread cost less."""
    return -(1 - recoveries).clamp(min=0).square()


def fit_budgets(values: torch.Tensor, costs: torch.Tensor, budgets: list[int],
                resolution: int = 4096) -> torch.Tensor:
    """`fit_budget` for L layers under their own budgets, side by side: (L, S, M) -> (L, S)."""
    L, S, M = values.shape
    device = costs.device
    costs, values = costs.cpu(), values.cpu().double()
    offered = costs.where(values > -math.inf, int(costs.max()) + 1)
    cheapest = offered.argmin(2)
    over = offered.min(2).values.sum(1) > torch.tensor(budgets)
    units = [-(-b // resolution) if b > 0 else 1 for b in budgets]
    costs = -(-costs // torch.tensor(units)[:, None, None])
    left = torch.tensor([b // u for b, u in zip(budgets, units)])
    # best[l, j]: layer l's best value costing at most j, after `pad` entries of
    # -inf for j < 0; row pad - c of `shifted[l]` is best[l, j - c] for every j.
    pad, width = int(costs.max()), int(left.max()) + 1
    best = torch.cat([torch.full((L, pad), -math.inf, dtype=torch.float64),
                      torch.zeros(L, width, dtype=torch.float64)], 1)
    shifted = best.unfold(1, width, 1)  # (L, pad + 1, width), a view
    # An item another beats (no dearer, no worse, better in one) is never needed: each segment's
    # program reads only the others, in menu order, padded to the most any keeps with -inf items.
    c, v = costs[..., :, None], values[..., :, None]  # item m against item m' (last dim)
    ct, vt = costs[..., None, :], values[..., None, :]
    beaten = ((ct <= c) & (vt >= v) & ((ct < c) | (vt > v))).any(3)  # (L, S, M)
    n = int((~beaten).sum(2).max())
    items = beaten.int().argsort(dim=2, stable=True)[..., :n]  # (L, S, n)
    item_costs = costs.gather(2, items)
    item_values = values.gather(2, items).masked_fill_(beaten.gather(2, items), -math.inf)
    layer = torch.arange(L)
    picks = []
    for s in range(S):
        options = shifted[layer[:, None], pad - item_costs[:, s]] + item_values[:, s, :, None]
        top, pick = options.max(1)  # (L, width)
        best[:, pad:] = top
        picks.append(pick)
    choice = torch.empty(L, S, dtype=torch.long)
    for s in reversed(range(S)):
        m = items[layer, s, picks[s][layer, left]]
        choice[:, s] = m
        left = (left - costs[layer, s, m]).clamp(min=0)  # below 0 only where nothing fits
    return torch.where(over[:, None], cheapest, choice).to(device)
