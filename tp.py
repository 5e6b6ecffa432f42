"""Tensor parallel: one model across N processes started by `torchrun`.

    torchrun --nproc-per-node 2 generate.py --prompt "..." --kv fastgen

Megatron-style sharding. Rank r of N holds:

- query/key/value projections: its n_kv_heads/N KV heads and their query
  heads (rows of wq, wk, wv), so attention runs on local heads only;
- the output projection wo and the MLP down projection w2 by input columns:
  each rank computes a partial sum and one all-reduce adds them (one after
  attention, one after the MLP);
- the MLP gate and up projections w1, w3 by output rows (ffn_dim/N each);
- a 1/N slice of the vocabulary in the embedding (one more all-reduce) and
  the output head (its logits are all-gathered). At N = 3 on the default
  model this keeps a third of the 113 MB embedding per rank instead of all
  of it (README, Tensor parallel).

So each rank's model is an ordinary `Transformer` whose `ModelArgs` counts
only its own heads and MLP columns, with four layers swapped for the ones
below; `load_model` builds it through the plain loader (model.py knows
nothing of ranks) and reads only the rank's slices of the weights. The KV
cache of each layer sees only the rank's heads: every rank profiles,
compresses and holds its own heads, and nothing in cache.py knows about
ranks: in budget mode the cache is handed a `Heads`, which gathers every
head's recoveries and costs so that the budget spans every rank's heads. Plain
`torch.distributed` collectives are used: they are the simplest readable
option and `torch.compile(fullgraph=True)` traces them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import CheckpointError, ModelArgs, Transformer
from model import load_model as load_whole

# How long a collective may wait for the other ranks before it fails: long
# enough for one rank to load or compile a few minutes after another, short
# enough that a stuck rank does not hold the others for the default 30 min.
# (A rank that exits is noticed at once: torchrun then ends the others.)
TIMEOUT = timedelta(minutes=5)

# The dimension along which each weight is split (our names, less `layers.N.`);
# weights not listed (the RMSNorms) are held whole by every rank.
SPLIT_DIM = {
    "tok_embeddings.weight": 0, "output.weight": 0,
    "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
    "attention.wq.bias": 0, "attention.wk.bias": 0, "attention.wv.bias": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1,
}


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def init(device: str) -> str:
    """Under torchrun (WORLD_SIZE > 1), join the process group; return this rank's
    device (`cuda` means the rank's own GPU, cuda:LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    if cuda:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # NCCL moves the GPU tensors; gloo the few Python objects the ranks
        # exchange (error flags, the cache statistics), which live on the CPU.
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=TIMEOUT)
    return device


def shutdown(wait: bool = True):
    """Leave the process group. With `wait`, the ranks first wait for each other:
    a rank that leaves while a peer still reads what it sent can abort in gloo
    ("terminate called without an active exception": twice in this project's
    test runs, on a loaded 2-core machine). Not after an interruption, when a
    rank may be stuck in a collective that its peers will no longer join."""
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def same_outcome():
    """Run a block on every rank; if it fails on any rank, it fails on all.

    The lowest failing rank raises its own error, so the user reads one
    message; the other ranks exit with status 1 (SystemExit) instead of
    going on to wait in a collective for a rank that has given up. Wrap in
    it whatever may fail on one rank only (reading the checkpoint, checking
    the arguments) before the ranks start working together.
    """
    if world() == 1:
        yield
        return
    failure = None
    try:
        yield
    except Exception as e:
        failure = e
    failed = [None] * world()
    dist.all_gather_object(failed, failure is not None)
    if True in failed:
        if failed.index(True) == rank():
            raise failure
        raise SystemExit(1)


def local_args(args: ModelArgs, n: int) -> ModelArgs:
    """The arguments of one rank's share of the model: 1/n of the heads and MLP columns."""
    if args.n_kv_heads % n or args.ffn_dim % n:
        fits = [str(m) for m in range(1, args.n_kv_heads + 1)
                if args.n_kv_heads % m == 0 and args.ffn_dim % m == 0]
        raise CheckpointError(
            f"{n} processes cannot split this model's {args.n_kv_heads} KV heads and "
            f"{args.ffn_dim} MLP columns evenly; run with --nproc-per-node {' or '.join(fits)}")
    return dataclasses.replace(args, n_heads=args.n_heads // n, n_kv_heads=args.n_kv_heads // n,
                               ffn_dim=args.ffn_dim // n)


def part_size(size: int, n: int) -> int:
    """Rows (or columns) per rank when `size` of them are split n ways, rounded up:
    only the vocabulary may not divide, and its last part is padded with zero rows."""
    return -(-size // n)


def sharded_model(args: ModelArgs, r: int, n: int) -> Transformer:
    """Rank r's model (build it on the meta device; the loader fills it)."""
    model = Transformer(local_args(args, n))
    part = part_size(args.vocab_size, n)
    model.tok_embeddings = VocabShardedEmbedding(part, args.dim, start=r * part)
    model.output = VocabShardedOutput(args.dim, part, args.vocab_size)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    for layer in model.layers:
        layer.attention.wo = AllReduceLinear(*layer.attention.wo.weight.shape[::-1])
        layer.feed_forward.w2 = AllReduceLinear(*layer.feed_forward.w2.weight.shape[::-1])
    return model


def load_model(ckpt, dtype=torch.float32, device="cpu", allow_pickle: bool = False,
               r: int | None = None, n: int | None = None) -> Transformer:
    """`model.load_model` for rank r of n (default: this process, after `init`):
    rank r's share of the model, of which only its slices of the weights are read.
    With n = 1, the whole model."""
    r, n = rank() if r is None else r, world() if n is None else n
    if n == 1:
        return load_whole(ckpt, dtype, device, allow_pickle)
    return load_whole(ckpt, dtype, device, allow_pickle,
                      build=functools.partial(sharded_model, r=r, n=n),
                      take=functools.partial(shard, r=r, n=n))


def shard(key: str, tensor, r: int, n: int) -> torch.Tensor:
    """Rank r's part of the checkpoint tensor `key` (our name). `tensor` is a
    safetensors slice, of which only that part is read, or a tensor."""
    dim = SPLIT_DIM.get(re.sub(r"^layers\.\d+\.", "", key))
    if dim is None:
        return tensor[:].clone()
    shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
    part = part_size(shape[dim], n)
    lo, hi = min(r * part, shape[dim]), min((r + 1) * part, shape[dim])
    t = tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]
    if hi - lo < part:  # the vocabulary's last part
        t = torch.cat([t, t.new_zeros(part - (hi - lo), *t.shape[1:])])
    # A copy that owns its memory: safetensors returns a view into the mapped
    # file, which would keep every page of a column-split weight resident.
    return t.clone(memory_format=torch.contiguous_format)


class AllReduceLinear(nn.Linear):
    """wo and w2: this rank's input columns give a partial sum; one all-reduce adds them."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        y = super().forward(x)
        dist.all_reduce(y)
        return y


class VocabShardedEmbedding(nn.Embedding):
    """This rank's rows of the embedding; a token outside them contributes zeros,
    and the all-reduce leaves every rank with the one rank's row that holds it."""

    def __init__(self, part: int, dim: int, start: int):
        super().__init__(part, dim)
        self.start = start

    def forward(self, tokens):
        local = tokens - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        x = x.masked_fill(~mine[..., None], 0)
        dist.all_reduce(x)
        return x


class VocabShardedOutput(nn.Linear):
    """This rank's rows of the output head; the logits of all ranks are gathered
    so that every rank samples from the same full distribution."""

    def __init__(self, dim: int, part: int, vocab_size: int):
        super().__init__(dim, part, bias=False)
        self.vocab_size = vocab_size

    def forward(self, x):
        y = super().forward(x)  # (B, T, V/N)
        n, B = world(), y.shape[0]
        parts = y.new_empty(n * B, *y.shape[1:])
        dist.all_gather_single(parts, y.contiguous())  # ranks stacked along dim 0
        logits = parts.view(n, *y.shape).movedim(0, -2).flatten(-2)  # (B, T, N * V/N)
        return logits[..., :self.vocab_size]


@dataclasses.dataclass
class Heads:
    """How a compressed cache's tables of every head are shared among the ranks,
    so that the budget mode chooses for every rank's heads as one process
    would (cache.choose_policies): each rank holds, for each of `batch`
    sequences, its own KV heads, and one process lists them sequence by
    sequence, rank 0's heads first."""
    batch: int

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(L, B * k, ...) this rank's rows -> (L, B * n * k, ...) every rank's."""
        parts = [torch.empty_like(t) for _ in range(world())]
        dist.all_gather(parts, t.contiguous())
        L, B = t.shape[0], self.batch
        x = torch.stack(parts).view(world(), L, B, -1, *t.shape[2:])  # (n, L, B, k, ...)
        return x.movedim(0, 2).reshape(L, -1, *t.shape[2:])  # (L, B, n, k, ...) flattened

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """(L, B * n * k, ...) -> (L, B * k, ...) this rank's rows."""
        L, B = t.shape[0], self.batch
        return t.view(L, B, world(), -1, *t.shape[2:])[:, :, rank()].reshape(L, -1, *t.shape[2:])


def gather_stats(gen, batch: int):
    """Every rank's cache statistics in one `Generation`, as the whole model's.

    Bytes, kept and seen tokens are summed over ranks (their per-rank bytes
    are kept too); the plan lists segments as one process would: sequence
    by sequence, and within one, the KV heads of rank 0, then of rank 1, ...
    """
    parts = [None] * world()
    dist.all_gather_object(parts, gen)
    if any(p.tokens != gen.tokens for p in parts):
        raise RuntimeError("the ranks generated different tokens; this is a bug")
    gen.kv_bytes_per_rank = [p.kv_bytes for p in parts]
    gen.kv_bytes = sum(gen.kv_bytes_per_rank)
    gen.full_kv_bytes = sum(p.full_kv_bytes for p in parts)
    gen.kept_tokens = sum(p.kept_tokens for p in parts)
    gen.seen_tokens = sum(p.seen_tokens for p in parts)
    gen.profile_s = max(p.profile_s for p in parts)  # the ranks profile at the same time
    gen.growths = sum(p.growths for p in parts)

    def interleave(per_rank):  # per rank: B * K/N segments, sequence-major
        k = len(per_rank[0]) // batch
        return [x for b in range(batch) for rows in per_rank for x in rows[b * k:(b + 1) * k]]

    if gen.plan:
        gen.plan = [interleave([p.plan[l] for p in parts]) for l in range(len(gen.plan))]
        gen.recovery = [interleave([p.recovery[l] for p in parts])
                        for l in range(len(gen.recovery))]
    return gen
