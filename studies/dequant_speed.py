"""How fast a compiled decode step reads rounded keys and values back:
`quant.dequantize` against the 16-bit cache's cast, and the byte layouts and
unpacking it replaced (neighbouring codes sharing a byte, up to cd0a573; planes
unpacked by stacking them, up to b8fe648).

    python -m studies.dequant_speed                     # 1560 pages of 32 tokens, D = 64
    python -m studies.dequant_speed --pages 780 --threads 2

The shape is one layer's 4-bit part at 2k x 8 tokens (SmolLM2-135M, 3 KV heads):
every number a decode step attends is read back to float32 once per step.
Milliseconds per read of one tensor (K or V), the median of --reps. Compiled
only: eager, each read allocates a fresh 12.8 MB output, and its page faults
swung the same read from 3 to 20 ms between runs (the bench's eager rows
measure eager decode).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import quant


def neighbours_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The replaced layout: byte j holds codes j * per ... j * per + per - 1."""
    mask = (1 << bits) - 1
    return torch.stack([packed >> s & mask for s in range(0, 8, bits)], -1).flatten(-2)


def neighbours_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (codes.view(*codes.shape[:-1], -1, 8 // bits) << shifts).sum(-1, dtype=torch.uint8)


def planes_stacked(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Planes, unpacked by stacking each plane's shift and mask (up to b8fe648)."""
    mask = (1 << bits) - 1
    return torch.stack([packed >> s & mask for s in range(0, 8, bits)], -2).flatten(-2)


def dequantize_with(unpack, codes, scale, low, bits):
    c = unpack(codes, bits)
    *lead, D = c.shape
    g = c.view(*lead, scale.shape[-1], -1).float()
    return (g * scale[..., None].float() + low[..., None].float()).view(*lead, D)


def median_ms(f, reps: int) -> float:
    f(), f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=1560, help="pages of --page tokens (default 1560)")
    p.add_argument("--page", type=int, default=32, help="tokens a page (default 32)")
    p.add_argument("--head-dim", type=int, default=64, help="numbers a token (default 64)")
    p.add_argument("--reps", type=int, default=30, help="timed reads, the median reported (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    for name in ("pages", "page", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.head_dim < 8 or args.head_dim % 8:
        p.error(f"--head-dim must be a positive multiple of 8 (2-bit codes pack 4 a byte), "
                f"got {args.head_dim}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.pages, args.page, args.head_dim)
    half = x.half()
    rows = {"16 bits: float16 cast": lambda: half.float()}
    for bits in (8, 4, 2):
        codes, scale, low = quant.quantize(x, bits)
        rows[f"{bits} bits: planes (quant.dequantize)"] = (
            lambda c=codes, s=scale, m=low, b=bits: quant.dequantize(c, s, m, b))
        if bits < 8:
            c = neighbours_pack(quant.unpack(codes, bits), bits)
            assert torch.equal(dequantize_with(neighbours_unpack, c, scale, low, bits),
                               quant.dequantize(codes, scale, low, bits))
            rows[f"{bits} bits: planes, always stacked (b8fe648)"] = (
                lambda c=codes, s=scale, m=low, b=bits: dequantize_with(planes_stacked, c, s, m, b))
            rows[f"{bits} bits: neighbours (replaced)"] = (
                lambda c=c, s=scale, m=low, b=bits: dequantize_with(neighbours_unpack, c, s, m, b))
    print(f"{args.pages} x {args.page} tokens x {args.head_dim}, {args.threads} thread(s), "
          f"torch {torch.__version__}; ms a read, median of {args.reps}")
    print("| read | compiled |\n|---|---|")
    for name, f in rows.items():
        torch._dynamo.reset()  # each read compiled for its own shapes, as a decode step is
        compiled = torch.compile(f, fullgraph=True)
        print(f"| {name} | {median_ms(compiled, args.reps):.2f} |", flush=True)


if __name__ == "__main__":
    main()
