"""The page pool a FastGen cache stands on: where each head's kept tokens live.

cache.py is the method, this the storage beneath it. A *segment*
is one (sequence, KV head) pair. A layer's pool is N pages of P slots: V as (N, P, D), and per
slot a position (-1: empty), a heavy-hitter score, token flags and the latest query's attention.
Segments that share a policy and hold about as many tokens form a `Group`, an (n, C) block of
pages that the policy reads as the padded rows it ranks: a head that keeps a twentieth of the
prompt allocates about a twentieth of a full head's bytes.

Each group stores K and V at its policy's precision (quant.py); the groups of one precision form
a *part*, with K and V in tensors of its own (model dtype, float16, or codes with scales and
minima). A rounding part stores keys over their channel factors and both K and V rotated
(quant.py), and reads them so: `Rotation` turns a query to them and the output back.
A part at 4 or 2 bits also keeps each segment's newest tokens to about 8 bits (its *window*, as
wide as the method says, quant.WINDOW if it does not): what their codes miss, added as they are
read. K is kept as pages (N, D, P), and a decode step pieces each segment's softmax together
from its pages (`paged_attention`). The interface the cache uses (`Storage` declares a layer's):

    build(...)          lay a pool out for what each segment keeps of its prompt
    fill_from_prompt    fill the pools of several layers from their prompts
    Pool.write          each segment's new token, into the slot handed out for it
    Pool.attend         one query per segment over the slots it holds
    Pool.add_scores     the attention each slot just got, added to its score
    Pool.attend_chunk   a chunk's queries over the slots, scored unless a reading will score it
    evict               each policy's rows of several layers; frees what it drops
    hand_out            every segment's next free slots; groups that run short grow
"""
from __future__ import annotations

import abc
import itertools
import math
from dataclasses import dataclass, replace

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

from quant import (WINDOW, channel_factors, dequantize, dequantize_residual, hadamard, quantize,
                   quantize_residual, residual_bits, rotate, rounds, storage_dtype, windowed)

# Letters in shape comments: S segments, G query heads per KV head, n segments in a group,
# N pages, P slots per page, C slots per segment in a group, D head dimension.

# Slots per page: a segment wastes at most a page minus one slot to rounding, and
# a page is one small matrix product per step, so pages grow with the prompt.
MIN_PAGE, MAX_PAGE = 4, 128
# Segments share a group while the largest holds at most this much more than the smallest
# (plus a page): the rest of a group's width is padding.
SPREAD = 1.05
# Queries of a chunk scored at once: their scores against a few thousand slots stay a few MB.
CHUNK_ROWS = 128
# The pool's per-slot tensors and what an empty slot holds.
SLOT_FIELDS = {"pos": -1, "score": 0, "last": 0, "flags": 0}


def slot_bytes(reads_last: bool, ranks: bool = True, measures: int = 0) -> int:
    """Bytes a slot holds besides K and V: position and, where a policy ranks by them, score and
    flags, `last` if read, and the float32 fields policies declare (`measures` of them)."""
    return 4 + (4 + 1) * ranks + 4 * reads_last + 4 * measures


@dataclass
class Group:
    """Segments holding about as many tokens, at one precision, stored as an (n, C) block:
    pages first .. first + n * pages. At first, and after a chunk, of one policy."""
    rows: list[int]  # the n segment ids
    growth: float  # the largest share of new tokens a segment's policy holds (Policy.growth)
    bits: int | None = None  # the precision its K and V are stored at (`stored`)
    first: int = 0
    pages: int = 1

    @property
    def seg(self) -> torch.Tensor:
        return torch.tensor(self.rows)

    def block(self, t: torch.Tensor, base: int = 0) -> torch.Tensor:
        """Its part of a pool tensor (N, P, ...) whose first page is `base`, as (n, C, ...)."""
        n = len(self.rows)
        part = t[self.first - base:self.first - base + n * self.pages]
        return part.reshape(n, self.pages * part.shape[1], *part.shape[2:])


@dataclass
class Cursor:
    """The column of `free` that the next step writes to: a plain object, as
    an nn.Module's attribute writes run through Python checks (about 4 us)."""
    at: int = 0


def page_size(prompt_len: int) -> int:
    """About a 64th of the prompt, a power of two between MIN_PAGE and MAX_PAGE."""
    return min(MAX_PAGE, max(MIN_PAGE, 1 << max(0, prompt_len // 64 - 1).bit_length()))


def group_pages(sizes: list[int], room: int, page: int) -> list[tuple[slice, int]]:
    """Sorted sizes split into runs within SPREAD; pages for each run's largest plus `room`."""
    runs, start = [], 0
    for i, size in enumerate(sizes):
        if size > sizes[start] * SPREAD + page:
            runs.append(slice(start, i))
            start = i
    runs.append(slice(start, len(sizes)))
    return [(r, max(1, -(-(sizes[r.stop - 1] + room) // page))) for r in runs if sizes[r]]


def build(choice: list[int], kept: list[int], growth: list[float], reads_last: bool, *,
          page: int, evict_every: int, new: int, device,
          bits: list | None = None, ranks: bool = True, window: int | None = None,
          measures: dict | None = None) -> Pool:
    """A pool laid out on the host from each segment's policy index, kept tokens and `growth`;
    `bits`: each policy's precision (None: the model's dtype); `ranks`: whether any policy may
    rank its slots (else no score and no flags are kept: a cache that keeps all, in fewer bits);
    `window`: the newest tokens a 4- or 2-bit part also keeps in 16 bits (None: WINDOW);
    `measures`: the per-token fields policies declare (policies.Policy.token_fields).
    A group gets room for the tokens until the first eviction, plus what the budget charged its
    policy for the `new` tokens (a quarter of its width at most, as in `grow`): a group of heads
    that keep all never grows."""
    room = min(evict_every, new)
    new = max(new - room, 0)
    groups = []
    for i in sorted(set(choice)):
        seg = sorted((s for s in range(len(choice)) if choice[s] == i), key=kept.__getitem__)
        sizes = [kept[s] for s in seg]
        for g, pages in group_pages(sizes, room, page):
            group = Group(seg[g], max(growth[s] for s in seg[g]), bits and bits[i])
            planned = min(math.ceil(group.growth * new), pages * page // 4)
            group.pages = max(1, -(-(sizes[g.stop - 1] + room + planned) // page))
            groups.append(group)
    # The parts, most bits first: each part's pages follow the one before.
    precisions = sorted({g.bits for g in groups}, key=lambda b: -(b or 99))
    groups.sort(key=lambda g: precisions.index(g.bits))  # stable: policy order within a part
    # Per slot its position; its score and flags where a policy ranks by them; the latest
    # query's attention (4 bytes a slot) only for a policy that reads it.
    wanted = {"pos", *(("score", "flags") if ranks else ()), *(("last",) if reads_last else ())}
    fields = {n: e for n, e in SLOT_FIELDS.items() if n in wanted}
    fields.update({n: 0.0 for n in measures or {}})
    return Pool(groups, page, evict_every, fields, len(choice), device,
                WINDOW if window is None else window, measures or {})


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
    # Each segment's maximum over its pages: one fused reduction compiled (a scatter_reduce
    # would stay an op of its own).
    top = scores.amax(-1).expand(S, N, G).masked_fill(~mine[..., None], -math.inf).amax(1)
    e = (scores - top.index_select(0, owner)[..., None]).exp()
    total = scores.new_zeros(S, G).index_add_(0, owner, e.sum(-1))
    probs = e / total.index_select(0, owner)[..., None]
    y = (mine.float() @ (probs.to(v.dtype) @ v).float().view(N, G * D)).view(S, G, D)
    if window is not None:
        got = probs[page[:, None], heads, col[:, None]]  # (E, G)
        y = y.index_add(0, seg, got[..., None] * rv[:, None].float())
    return y.to(v.dtype), probs.mean(1)


def chunk_attention(q, k, v, pos, at, valid, latest, observe: int = 0, padded: bool = True):
    """T queries a segment over the slots it holds, each up to its own position, CHUNK_ROWS
    rows at a time (a chunk's scores would outweigh the cache).

    q: (n, G, T, D) at positions at (n, T); k, v: (n, C, D) and pos (n, C) a group's slots;
    valid (n, T): the queries that are not padding (`padded`: whether any is); latest (n, T):
    each segment's last valid one. Returns the output (n, G, T, D) and, averaged over the G query
    heads, the attention each slot got from the valid queries and from the latest, (n, C) each,
    and from the last `observe` rows, (n, observe, C)."""
    n, G, T, D = q.shape
    C = k.shape[1]
    y, got, seen = torch.empty_like(q), 0, []
    keys = k.transpose(1, 2) / math.sqrt(D)  # (n, D, C), scaled once
    # What a row's attention counts for, each query head's 1 / G: [valid, latest], (n, 2, T).
    weights = torch.stack([valid, latest], 1).float() / G
    for rows in torch.arange(T, device=q.device).split(CHUNK_ROWS):
        t = len(rows)
        sees = (pos[:, None] >= 0) & (pos[:, None] <= at[:, rows, None])  # (n, t, C)
        # The G heads' rows as one matrix, (n, G * t, D), against the segment's keys.
        scores = (q[:, :, rows].reshape(n, G * t, D) @ keys).view(n, G, t, C).float()
        probs = scores.masked_fill_(~sees[:, None], -math.inf).softmax(-1)
        if padded:  # a padding query may see no slot: its softmax is NaN
            probs.nan_to_num_(0.0)
        flat = probs.view(n, G * t, C)
        y[:, :, rows] = (flat.to(v.dtype) @ v).view(n, G, t, D)
        got = got + weights[:, :, None, rows].expand(n, 2, G, t).reshape(n, 2, G * t) @ flat
        if observe and rows[-1] >= T - observe:
            seen.append(probs.mean(1)[:, (rows >= T - observe).nonzero()[:, 0]])
    got, last = got.unbind(1)
    return y, got, last, torch.cat(seen, 1) if observe else None


def chunk_output(q, k, v, pos, at):
    """`chunk_attention`'s output alone, by torch's fused kernel (about half its time on CPU):
    for a chunk read again, whose reading scores what each segment holds."""
    G = q.shape[1]
    sees = (pos[:, None] >= 0) & (pos[:, None] <= at[..., None])  # (n, T, C)
    k, v = (t[:, None].expand(-1, G, -1, -1) for t in (k, v))
    # A padding query may see no slot: its output is NaN.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees[:, None]).nan_to_num_(0.0)


class Storage(nn.Module, abc.ABC):
    """What the method asks of the storage beneath it, one layer's (cache.py calls nothing
    else of it, besides the module's functions over several layers: `fill_from_prompt`, `evict`,
    `hand_out`). `Pool` is the implementation, on index tensors, which compiles."""

    @abc.abstractmethod
    def fill(self, k, v, rows, fields: dict, source, valid):
        """Hold what each segment keeps of its prompt, with its per-token fields."""

    @abc.abstractmethod
    def write(self, k, v, pos, flags, slot=None, per: int = 1):
        """Append each segment's new token (or a chunk's `per`) with its fields."""

    @abc.abstractmethod
    def attend(self, q):
        """One query per segment over what it holds: the output and each slot's attention."""

    @abc.abstractmethod
    def attend_chunk(self, q, at, valid, observe: int = 0, sums: bool = True):
        """A chunk's queries over what each segment holds, its scores updated if `sums`."""

    @abc.abstractmethod
    def add_scores(self, last):
        """Add a step's attention to each held token's score: the field decoding updates."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes really held: K, V, every per-token field and index."""


class Part(nn.Module):
    """The groups stored at one precision, `bits`: their K and V, as pages of their own. In the
    model's dtype or 16 bits, K as (n, D, P), so that scoring a page is a plain (G, D) x (D, P)
    product, and V as (n, P, D); in 8, 4 or 2 bits, each as codes with a scale and a minimum per
    group of numbers (quant.py), (n, P, ...). At 4 or 2 bits also each segment's window: what the
    codes of its newest tokens miss, with their positions and slots."""

    def __init__(self, bits: int | None):
        super().__init__()
        self.bits = bits
        self.rounds, self.windowed = rounds(bits), windowed(bits)
        self.names = ["k", "v"] if not self.rounds else [
            f"{x}{part}" for x in "kv" for part in ("", "_scale", "_low")]
        self.first = self.pages = 0  # its first page in the pool, and how many
        self.rows: list[int] = []  # its segments, in order

    def encode(self, k, v, dtype) -> list[torch.Tensor]:
        """Rows of k, v (m, D) as stored, in the order of `names` (a rounding part's `prepare`d)."""
        if not self.rounds:  # the model's dtype (a no-op) or 16 bits
            dtype = dtype if self.bits is None else storage_dtype(self.bits, dtype)
            return [k.to(dtype), v.to(dtype)]
        return [*quantize(k, self.bits), *quantize(v, self.bits)]

    def store(self, encoded: list[torch.Tensor], P: int):
        for name, t in zip(self.names, encoded):
            if name == "k" and not self.rounds:
                t = t.view(-1, P, t.shape[-1]).transpose(1, 2).contiguous()  # (n, D, P)
            else:
                t = t.view(-1, P, *t.shape[1:])
            self.register_buffer(name, t, persistent=False)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.names]

    def write(self, at, encoded: list[torch.Tensor]):
        """Encoded rows into the part's slots `at` (m,)."""
        for name, t in zip(self.names, encoded):
            if name == "k" and not self.rounds:
                # K's pages are (D, P): the new key's D values lie P apart. One flat
                # index_copy_, which compiled ran faster than writing k[page, :, slot].
                P, (m, D) = self.k.shape[-1], t.shape
                flat = (at // P * (D * P) + at % P)[:, None] + P * torch.arange(D, device=at.device)
                self.k.view(-1).index_copy_(0, flat.view(-1), t.reshape(m * D))
            else:
                dest = getattr(self, name)
                dest.view(-1, dest.shape[-1]).index_copy_(0, at, t.view(-1, dest.shape[-1]))

    def read(self, dtype, pos=None, P: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K (n, D, P) and V (n, P, D) in `dtype`; given the pool's positions pos (N * P,) and
        page size P, with the window's residues added."""
        if not self.rounds:
            return self.k.to(dtype), self.v.to(dtype)
        codes = self.tensors()
        k = dequantize(*codes[:3], self.bits, dtype)
        v = dequantize(*codes[3:], self.bits, dtype)
        if pos is not None and self.windowed:
            at, *residues = self.residues(pos, self.first * P, dtype)
            for x, r in zip((k, v), residues):
                x.view(-1, x.shape[-1]).index_add_(0, at, r)
        return k.transpose(1, 2), v

    # --- The window: what each segment's newest tokens' codes miss ---------------------
    def open_window(self, n: int, width: int, D: int, device):
        """An empty window of `width` entries for each of n segments: residues of K and V
        (n, width, D * residual_bits // 8), positions (-1: none) and slots."""
        residue = torch.zeros(n, width, D * residual_bits(self.bits) // 8, dtype=torch.uint8,
                              device=device)
        self.register_buffer("window_k", residue, persistent=False)
        self.register_buffer("window_v", residue.clone(), persistent=False)
        self.register_buffer("window_pos", torch.full((n, width), -1, dtype=torch.int32,
                                                      device=device), persistent=False)
        self.register_buffer("window_slot", torch.zeros(n, width, dtype=torch.long,
                                                        device=device), persistent=False)

    def start_window(self, segs, slots, pos, k, v, width: int, P: int):
        """The window at prefill, of the newest tokens kept of the prompt: segments segs (n,)
        hold slots (n, C), -1 none; pos (N * P,) the pool's positions; k, v the part's rows,
        `prepare`d; at most `width` entries, no wider than a segment's row."""
        self.open_window(len(segs), min(width, slots.shape[1]), k.shape[-1], k.device)
        at = slots.clamp(min=0)
        mine = (at - self.first * P).clamp(min=0)  # the part's own slots
        codes = [t.flatten(0, 1)[mine] for t in self.tensors()]
        self.remember(k[mine], v[mine], pos[at].masked_fill(slots < 0, -1), at, codes)

    def window(self) -> list[torch.Tensor]:
        return [self.window_k, self.window_v, self.window_pos, self.window_slot]

    def remember(self, k, v, pos, slot, codes):
        """Its segments wrote k, v (n, c, D), `prepare`d, at pos, slot (n, c), stored as `codes`
        (the part's six tensors, (n, c, ...)): each window keeps what the newest miss."""
        new = (quantize_residual(k, *codes[:3], self.bits),
               quantize_residual(v, *codes[3:], self.bits), pos.to(torch.int32), slot)
        held = self.window()
        if pos.shape[1] == 1:
            # One token: it takes the oldest entry's place if newer (a padded one, -1, is not),
            # as the merge below would, without the merge's cat, top-k and gather each step.
            col = held[-2].argmin(1, keepdim=True)  # (n, 1)
            newer = pos.to(held[-2].dtype) > held[-2].gather(1, col)
            for t, x in zip(held, new):
                shape = (-1, 1) + (1,) * (t.dim() - 2)  # (n, 1) against t's (n, width, ...)
                at = col.view(shape).expand_as(x)
                t.scatter_(1, at, torch.where(newer.view(shape), x.to(t.dtype), t.gather(1, at)))
            return
        both = [torch.cat([t, x.to(t.dtype)], 1) for t, x in zip(held, new)]
        top = both[-2].topk(held[-2].shape[1], dim=1).indices  # (n, width)
        for t, b in zip(held, both):
            at = top.view(*top.shape, *[1] * (b.dim() - 2)).expand(*top.shape, *b.shape[2:])
            t.copy_(b.gather(1, at))

    def residues(self, pos, first, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each window entry's slot in the part (E,), and what the codes miss of its key and value
        (E, D) in `dtype`; 0 for an entry whose token was evicted, or whose slot another took.
        pos: the pool's positions, flat; first: the part's first slot."""
        *residues, wpos, slot = self.window()
        held = ((pos[slot] == wpos) & (wpos >= 0)).view(-1, 1)  # (E, 1)
        at = torch.where(held[:, 0], slot.view(-1) - first, 0)
        scales = (t.flatten(0, 1).index_select(0, at) for t in (self.k_scale, self.v_scale))
        return at, *(dequantize_residual(r.flatten(0, 1), scale, self.bits, dtype).masked_fill_(
            ~held, 0) for r, scale in zip(residues, scales))


class Rotation(nn.Module):
    """How rounding parts hold keys and values: keys over their channel factors, both rotated
    (quant.py), for the segments of a part that rounds; the others' factors are 1, unrotated.
    A query turned to the keys' power scores them as it would the keys,
    q . k = (q f) R . (k / f) R, and an output over stored values turns back."""

    def __init__(self, k, valid, exact: list[int]):
        """k (S, T, D) the prompt's keys, valid (S, T) those that set the factors; `exact`: the
        segments of parts that do not round."""
        super().__init__()
        factors = channel_factors(k, valid)
        factors[exact] = 1.0
        rotated = torch.ones(len(k), dtype=torch.bool, device=k.device)
        rotated[exact] = False
        self.register_buffer("key_factors", factors, persistent=False)
        self.register_buffer("rotated", rotated, persistent=False)
        self.matrix = hadamard(k.shape[-1], k.device)  # one per process, shared (16 KB at D = 64)

    def prepare(self, k, v, seg=None):
        """Rows of k, v (..., D) as a rounding part rounds them: keys over their factors, both
        rotated. seg: their segments, as many consecutive rows each (None: every segment, in
        order)."""
        f = self.key_factors if seg is None else self.key_factors.index_select(0, seg)
        k = (k.reshape(len(f), -1, k.shape[-1]) / f[:, None]).view_as(k)
        return self.turn(k), self.turn(v)

    def turned(self, x, power: int = 0):
        """x (S, ..., D) times the segments' key factors to `power`, rotated where they round."""
        y = x
        if power:
            f = self.key_factors.view(len(self.rotated), *[1] * (x.dim() - 2), -1).to(x.dtype)
            y = x * f if power > 0 else x / f
        return torch.where(self.rotated.view(-1, *[1] * (x.dim() - 1)), self.turn(y), x)

    def turn(self, x):
        return rotate(x, self.matrix)  # the matrix at hand: no cache lookup in a compiled step


class Pool(Storage):
    """One layer's pool of pages: each slot's fields as (N, P), and K and V in its `parts`, one
    per precision, each part's pages following the one before."""

    def __init__(self, groups: list[Group], page: int, evict_every: int, fields: dict,
                 segments: int, device, window: int, measures: dict):
        super().__init__()
        self.groups, self.page, self.fields = groups, page, fields
        self.evict_every = evict_every
        self.measures = measures  # a declared field's name -> its function of a token's k and v
        self.window_size = window  # a 4- or 2-bit part's newest tokens, to about 8 bits
        self.n_growths = 0
        self.cursor = Cursor()
        # The slot each segment writes its next token to, and its next free slots.
        self.register_buffer("dest", torch.zeros(segments, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("free", self.dest.new_zeros(segments, 0), persistent=False)
        self.parts = nn.ModuleList(Part(b) for b in dict.fromkeys(g.bits for g in groups))
        self.place()

    def place(self):
        """Lay the groups out: first pages, page owners, segments' first slots, widths, parts."""
        first, owner, S = 0, [], len(self.dest)
        start, width = [0] * S, [0] * S
        for part in self.parts:
            part.first, part.pages, part.rows = first, 0, []
            for g in (g for g in self.groups if g.bits == part.bits):
                g.first = first
                part.pages += len(g.rows) * g.pages
                part.rows += g.rows
                for j, s in enumerate(g.rows):
                    start[s], width[s] = (first + g.pages * j) * self.page, g.pages * self.page
                    owner += [s] * g.pages
                first += len(g.rows) * g.pages
        self.size = first * self.page
        device = self.dest.device
        for name, t in dict(owner=owner, start=start, width=width).items():
            self.register_buffer(name, torch.tensor(t, device=device), persistent=False)
        # Where there are several parts, each part's segments and first slot, for its writes
        # (compiled steps read them as tensors: growth moves them).
        if len(self.parts) > 1:
            for part in self.parts:
                part.register_buffer("segs", torch.tensor(sorted(part.rows), device=device),
                                     persistent=False)
                part.register_buffer("first_slot", torch.tensor(part.first * self.page,
                                                                 device=device), persistent=False)

    def fill(self, k, v, rows, fields: dict, source, valid):
        """Slot i takes row rows[i] of k and v (B, K, T, D) as (B * T * K, D) and element
        source[i] of each flat field (an empty slot's K and V are another token's, never
        attended). valid (S, T): the prompt tokens that set a rounding part's key factors."""
        P, (B, K, T, D) = self.page, k.shape
        self.dtype = k.dtype  # what K and V are read back as
        for name in self.fields:
            self.register_buffer(name, fields[name].index_select(0, source).view(-1, P),
                                 persistent=False)
        self.rotation = None
        if any(part.rounds for part in self.parts):
            exact = [s for part in self.parts if not part.rounds for s in part.rows]
            self.rotation = Rotation(k.reshape(B * K, T, D), valid, exact)
        slot_seg = self.owner.repeat_interleave(P)
        k, v = ((t.transpose(1, 2).reshape(-1, D).index_select(0, rows)) for t in (k, v))
        for part in self.parts:
            at = slice(part.first * P, (part.first + part.pages) * P)
            ks, vs = k[at], v[at]
            if part.rounds:
                ks, vs = self.rotation.prepare(ks, vs, slot_seg[at])
            part.store(part.encode(ks, vs, self.dtype), P)
            if part.windowed:
                part.start_window(*self.rows_of(part), self.pos.view(-1), ks, vs,
                                  self.window_size, P)
        self.mark_dynamic()

    def kv_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K (N, D, P) and V (N, P, D) of every part, in the model's dtype, as stored (a rounding
        part's read by queries, and giving outputs, `turned`), its window's residues added."""
        ks, vs = zip(*(part.read(self.dtype, self.pos.view(-1), self.page) for part in self.parts))
        return (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))

    def turned(self, x, power: int = 0):
        """x as the segments hold it (`Rotation.turned`): a query (1), a key (-1), a value or
        an output (0)."""
        return x if self.rotation is None else self.rotation.turned(x, power)

    # --- A decode step -----------------------------------------------------------
    def write(self, k, v, pos, flags, slot=None, per: int = 1):
        """Each segment's new token, k, v (S, D), pos, flags (S,), to `dest`, or `per` to `slot`."""
        slot = self.dest if slot is None else slot
        self.pos.view(-1).index_copy_(0, slot, pos.to(self.pos.dtype))
        if "flags" in self.fields:
            self.flags.view(-1).index_copy_(0, slot, flags)
        for name, measure in self.measures.items():
            getattr(self, name).view(-1).index_copy_(0, slot, measure(k, v).float())
        for part in self.parts:
            if len(self.parts) == 1:  # every segment's rows, in order
                segs, rows, at = None, None, slot
            else:
                segs = part.segs
                rows = segs if per == 1 else (
                    segs[:, None] * per + torch.arange(per, device=segs.device)).view(-1)
                at = slot.index_select(0, rows) - part.first_slot
            ks, vs = (t if rows is None else t.index_select(0, rows) for t in (k, v))
            if part.rounds:  # once, for the codes and for the window's residues
                ks, vs = self.rotation.prepare(ks, vs, segs)
            encoded = part.encode(ks, vs, self.dtype)
            part.write(at, encoded)
            if part.windowed:
                segs = torch.arange(len(self.dest), device=slot.device) if segs is None else segs
                n, D = len(segs), k.shape[-1]
                ps = pos if rows is None else pos.index_select(0, rows)
                slots = slot if rows is None else slot.index_select(0, rows)
                part.remember(ks.view(n, per, D), vs.view(n, per, D), ps.view(n, per),
                              slots.view(n, per), [t.view(n, per, *t.shape[1:]) for t in encoded])

    def attend(self, q):
        # Part by part: a segment's pages are all in its part, so each part's output is whole
        # for its segments and zero for the rest. Joining the parts' K and V first would copy
        # them all again each step.
        q, y, last, empty, first = self.turned(q, 1), 0, [], self.pos < 0, 0
        for part in self.parts:
            # A window's residues corrected in the scores and outputs: added to K and V, they
            # would make the step copy both.
            k, v = part.read(self.dtype)
            at = slice(first, first + len(v))  # sizes from the tensors: growth needs no new graph
            window = part.residues(self.pos.view(-1), first * self.page,
                                   self.dtype) if part.windowed else None
            y_part, last_part = paged_attention(q, k, v, empty[at], self.owner[at], window)
            y, last, first = y + y_part, last + [last_part], first + len(v)
        return self.turned(y), last[0] if len(last) == 1 else torch.cat(last)

    def add_scores(self, last):
        """The attention each slot got from the latest query, (N, P)."""
        if "last" in self.fields:
            self.last.copy_(last)
        if "score" in self.fields:
            self.score += last

    def attend_chunk(self, q, at, valid, observe: int = 0, sums: bool = True):
        """T queries a segment, q (S, G, T, D) at positions at (S, T), each over its segment's
        slots up to its position (the chunk's keys are written already): the output
        (S, G, T, D), a group at a time (`chunk_attention`). Scores gain the valid queries'
        attention, `last` the latest's. `self.observed`: each group's last `observe` rows.
        Without `sums` (a chunk its reading will score), the output alone (`chunk_output`)."""
        q, y, self.observed = self.turned(q, 1), q.new_empty(q.shape), []
        keys, values = self.kv_pages()
        keys = keys.transpose(1, 2)  # (N, P, D)
        latest = (valid.cumsum(1) == valid.sum(1, keepdim=True)) & valid  # (S, T)
        padded = sums and not bool(valid.all())  # a host sync, only where sums are taken
        for g in self.groups:
            seg = g.seg.to(q.device)
            if not sums:
                y[seg] = chunk_output(q[seg], g.block(keys), g.block(values), g.block(self.pos),
                                      at[seg])
                continue
            y[seg], got, last, seen = chunk_attention(
                q[seg], g.block(keys), g.block(values), g.block(self.pos), at[seg], valid[seg],
                latest[seg], observe, padded)
            if observe:
                self.observed.append(seen)
            if "score" in self.fields:
                g.block(self.score).add_(got)
            if "last" in self.fields:
                block = g.block(self.last)
                block.copy_(torch.where(valid[seg].any(1, keepdim=True), last, block))
        return self.turned(y)

    def rows_of(self, part: Part) -> tuple[torch.Tensor, torch.Tensor]:
        """A part's segments (n,) and their slots (n, C), padded with -1."""
        segs = (part.segs if len(self.parts) > 1
                else torch.arange(len(self.dest), device=self.dest.device))
        start, width = self.start.index_select(0, segs), self.width.index_select(0, segs)
        cols = torch.arange(int(width.max()), device=segs.device)
        return segs, (start[:, None] + cols).masked_fill_(cols >= width[:, None], -1)

    # --- Between steps -----------------------------------------------------------
    def next_slot(self, n: int = 1):
        """Point a step at each segment's next free slot (`dest`), or a chunk at n (`taken`)."""
        if n == 1:
            self.dest.copy_(self.free[:, self.cursor.at])
        self.cursor.at += n

    def taken(self, n: int) -> torch.Tensor:
        """(S, n): the slots `next_slot(n)` pointed a chunk at."""
        return self.free[:, self.cursor.at - n:self.cursor.at]

    def left(self) -> int:
        """Free slots handed out that no step has taken yet, per segment."""
        return self.free.shape[1] - self.cursor.at

    # --- What the pool holds -----------------------------------------------------
    STATE = ("owner", "start", "width", "dest", "free")

    def nbytes(self) -> int:
        own = [getattr(self, name) for name in (*self.fields, *self.STATE)]
        if self.rotation is not None:
            own += [self.rotation.key_factors, self.rotation.rotated]
        return sum(t.nbytes for t in own) + sum(t.nbytes for t in self.parts.buffers())

    def kept(self) -> int:
        return int((self.pos >= 0).sum())

    def mark_dynamic(self):
        """The page count is dynamic from the first step: a growth needs no new graph."""
        for t in (*(getattr(self, name) for name in self.fields), self.owner,
                  *(t for part in self.parts for t in part.tensors())):
            torch._dynamo.maybe_mark_dynamic(t, 0)


# --- Several layers at once -------------------------------------------------------
# A layer at a time, these were a few hundred small operations per layer; here, once for all.

def ends(pools: list[Pool]) -> tuple[list[int], list[int], torch.Tensor]:
    """The pools end to end: their slots, first slots and every segment's, (sum of S,)."""
    sizes = [p.size for p in pools]
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    return sizes, offsets, torch.cat([p.start + offset for p, offset in zip(pools, offsets)])


def fill_from_prompt(pools: list[Pool], fields: dict, keep, kvs: list[tuple]):
    """Fill the layers' pools. fields: (L * S, T) pos, score, last, flags and those policies
    declare; keep (L * S, T): what
    each segment's policy keeps; kvs: each layer's prompt k and v, (B, K, T, D)."""
    sizes, _, start = ends(pools)
    # Kept tokens first, in position order: slot start + n of a segment holds its n-th kept token.
    LS, T = keep.shape
    token = torch.arange(LS * T, device=keep.device).view(LS, T)
    # An empty slot reads one past the prompt's tokens, where each field holds its empty value.
    source = torch.full((sum(sizes),), LS * T, dtype=torch.long, device=keep.device)
    source[(start[:, None] + keep.cumsum(1) - 1)[keep]] = token[keep]
    fields = {name: torch.cat([t.reshape(-1), t.new_full((1,), SLOT_FIELDS.get(name, 0))])
              for name, t in fields.items() if t is not None}
    # Each slot's row of its layer's k and v, as the model lays them out (B, T, K).
    K = kvs[0][0].shape[1]
    S = LS // len(pools)
    seg, at = source % (S * T) // T, source % T
    rows = ((seg // K * T + at) * K + seg % K).split(sizes)
    valid = (fields["pos"][:LS * T] >= 0).view(len(pools), S, T)
    for p, (k, v), rows_i, source_i, valid_i in zip(pools, kvs, rows, source.split(sizes), valid):
        p.fill(k, v, rows_i, fields, source_i, valid_i)


def evict(pools: list[Pool], by, M: int, names: list[str], columns: dict, keeps):
    """Free what each policy no longer keeps. Each segment's slots are a padded row, ordered by
    policy (by (sum of S,): its index among M, -1 if it never evicts); `keeps(i, rows, columns)`
    says which slots policy i keeps of its rows: the fields `names` (R, W), padded with empty
    values, and `columns` (sum of S, 1) as (R, 1). No segment is ranked by another's policy."""
    sizes, _, start = ends(pools)
    flat = {name: torch.cat([getattr(p, name).view(-1) if name in p.fields
                             else p.score.new_zeros(size) for p, size in zip(pools, sizes)])
            for name in names}
    width = torch.cat([p.width for p in pools])
    # How many rows each policy has, and its widest, in one host sync.
    order = by.argsort(stable=True)
    counts = torch.bincount(by + 1, minlength=M + 1)
    widest = counts.new_zeros(M + 1).scatter_reduce_(0, by + 1, width, "amax")
    counts, widest = torch.stack([counts, widest]).tolist()
    order = order[counts[0]:]  # those that never evict left out
    cols = torch.arange(max(widest[1:]), device=start.device)
    pad = cols >= width[order, None]
    index = (start[order, None] + cols).masked_fill_(pad, 0)  # (R, W) flat slots
    rows = {name: flat[name][index].masked_fill_(pad, SLOT_FIELDS.get(name, 0)) for name in names}
    columns = {name: t[order] for name, t in columns.items()}
    freed, a = [], 0
    for i, (n, w) in enumerate(zip(counts[1:], widest[1:])):
        if n:
            part = {name: t[a:a + n, :w] for name, t in rows.items()}
            kept = keeps(i, part, {name: t[a:a + n] for name, t in columns.items()})
            freed.append(index[a:a + n, :w][(part["pos"] >= 0) & ~kept])
            a += n
    freed = torch.cat(freed)
    flat["pos"][freed] = -1
    flat["score"][freed] = 0  # the token written there next starts from nothing
    for name in ("pos", "score"):
        for p, t in zip(pools, flat[name].split(sizes)):
            getattr(p, name).view(-1).copy_(t)


# --- Growth: a pool remade group by group ---------------------------------------

def grow(p: Pool, counts: list[int], need: int, remaining: int) -> bool:
    """Widen the groups where a segment has fewer than `need` free slots (`counts`),
    `remaining` tokens before the planned end; whether any grew."""
    E, P = p.evict_every, p.page
    extra = {}
    for i, g in enumerate(p.groups):
        least = min(counts[s] for s in g.rows)
        if least < need:
            # What the budget charged the policy for the rest (a quarter more at most)
            # and a round more: a group of Full heads grows once, not every other round.
            planned = min(math.ceil(g.growth * max(remaining, 0)), g.pages * P // 4)
            extra[i] = -(-(max(need, planned) + E - least) // P)
    if extra:
        widen(p, extra)
    return bool(extra)


def relay(p: Pool, groups: list[Group], orders: list[torch.Tensor]):
    """Lay the pool out again as `groups`, which hold the same segments as p.groups: a new
    slot of a segment takes its old slots in the old group's `orders` (n, C), then empty ones."""
    P, old = p.page, p.groups
    slots = {}  # each segment's old slots, in the order it takes them
    for g, order in zip(old, orders):
        rows = torch.arange(len(g.rows), device=order.device)[:, None]
        slots.update(zip(g.rows, (g.first + rows * g.pages) * P + order))

    # Part by part, as `place` lays them out: the old slot each new slot takes, -1 none.
    per_part = [[g for g in groups if g.bits == part.bits] for part in p.parts]
    ats = [torch.cat([torch.cat([slots[s][:g.pages * P], slots[s].new_full(
        (max(0, g.pages * P - len(slots[s])),), -1)]) for g in gs for s in g.rows])
        for gs in per_part]
    for name, empty in p.fields.items():
        setattr(p, name, moved(getattr(p, name), torch.cat(ats), empty))
    for part, at in zip(p.parts, ats):
        at = torch.where(at >= 0, at - part.first * P, -1)  # the part's own slots
        for name, t in zip(part.names, part.tensors()):
            setattr(part, name, moved(t, at, 0, keys=name == "k" and not part.rounds))
    p.groups = [g for gs in per_part for g in gs]
    p.place()
    relink(p)
    p.mark_dynamic()


def moved(t, at, empty, keys: bool = False) -> torch.Tensor:
    """A pool tensor's slots (N, P, ...), or K as (N, D, P) with `keys`, as the slots `at` name
    (-1: `empty`), in pages of P."""
    x = t.transpose(1, 2) if keys else t
    out = x.reshape(-1, *x.shape[2:])[at.clamp(min=0)]
    out[at < 0] = empty
    out = out.view(-1, x.shape[1], *x.shape[2:])
    return out.transpose(1, 2).contiguous() if keys else out


def relink(p: Pool):
    """After slots moved: each window entry pointed at its token's new slot or, if gone, at
    its row's first slot, which cannot hold its position, so the entry reads nothing."""
    for part in (p for p in p.parts if p.windowed):
        _, slots = p.rows_of(part)
        held = p.pos.view(-1)[slots.clamp(min=0)].masked_fill(slots < 0, -1)  # (n, C)
        pos = part.window_pos
        match = (held[:, None] == pos[..., None]) & (pos[..., None] >= 0)  # (n, WINDOW, C)
        part.window_slot.copy_(slots.gather(1, match.int().argmax(-1)))  # slot 0 if none


def widen(p: Pool, extra: dict[int, int]):
    """Add `extra[i]` empty pages to each segment of group i."""
    P, device = p.page, p.pos.device
    orders = [torch.arange(g.pages * P, device=device).expand(len(g.rows), -1) for g in p.groups]
    p.n_growths += len(extra)
    relay(p, [replace(g, pages=g.pages + extra.get(i, 0))
              for i, g in enumerate(p.groups)], orders)


def compact(p: Pool, room: int):
    """After a chunk's eviction: each segment's tokens to its row's front, and the segments of
    each part grouped again by what they hold (`group_pages`, as `build` does), each group cut
    to its fullest segment plus `room`. What the chunk took and its policies let go is given
    back, and so is what a segment no longer needs when a chunk's choice changed its policy."""
    P, old = p.page, p.groups
    held = [g.block(p.pos) >= 0 for g in old]  # (n, C) each
    counts = torch.cat([h.sum(1) for h in held]).tolist()  # one host sync
    count = dict(zip((s for g in old for s in g.rows), counts))
    growth = {s: g.growth for g in old for s in g.rows}
    groups = []
    for part in p.parts:
        segs = sorted(part.rows, key=count.__getitem__)
        for run, pages in group_pages([count[s] for s in segs], room, P):
            groups.append(Group(segs[run], max(growth[s] for s in segs[run]), part.bits,
                                pages=pages))
    if [(g.rows, g.pages) for g in groups] == [(g.rows, g.pages) for g in old]:
        return
    relay(p, groups, [(~h).byte().argsort(dim=1, stable=True) for h in held])  # held first


def hand_out(pools: list[Pool], needs: list[int], remaining: list[int]):
    """Give each segment its pool's `needs` next free slots; groups with fewer grow
    (`remaining`: tokens before each pool's planned end). One host sync per need."""
    by_need = {}
    for p, need, left in zip(pools, needs, remaining):
        by_need.setdefault(need, []).append((p, left))
    for need, some in by_need.items():
        _hand_out([p for p, _ in some], need, [left for _, left in some])


def _hand_out(pools: list[Pool], need: int, remaining: list[int]):
    def running_free():
        """Running free-slot count, its value before each segment, starts, offsets."""
        _, offsets, start = ends(pools)
        free = torch.cat([p.pos.view(-1) for p in pools]).lt(0).long()
        running = free.cumsum(0)
        return running, (running - free)[start], start, offsets

    segments = [len(p.dest) for p in pools]
    running, before, start, offsets = running_free()
    width = torch.cat([p.width for p in pools])
    counts = (running[start + width - 1] - before).tolist()
    bounds = list(itertools.accumulate(segments, initial=0))
    if any([grow(p, counts[i:j], need, left)
            for p, i, j, left in zip(pools, bounds, bounds[1:], remaining)]):
        running, before, start, offsets = running_free()  # the grown pools moved
    # Segment s's j-th free slot is where the running count reaches its count before, plus j + 1.
    wanted = before[:, None] + torch.arange(1, need + 1, device=running.device)
    slots = torch.searchsorted(running, wanted)  # (sum of S, need)
    for p, part, offset in zip(pools, slots.split(segments), offsets):
        p.free = part - offset
        p.cursor.at = 0
