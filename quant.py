"""Keys and values stored in fewer bits: what a head's precision costs and keeps.

A token's key (or value) of D numbers is cut into groups of GROUP numbers
(fewer where GROUP does not divide D);
each group is stored as unsigned `bits`-bit codes with its own float16 scale
and minimum (asymmetric min-max rounding), several codes packed per byte:

    x ~ low + scale * code,   code in 0 .. 2**bits - 1,   scale = (max - min) / (2**bits - 1)

so every number is off by at most half its group's scale. Per token, so that
a token is quantized once, as it enters the cache, and leaves alone: KIVI's
keys per channel lose less at 4 bits, but tie a group of tokens to one scale,
which a head that evicts one token at a time cannot keep.

Keys first have each channel divided by a factor of its head's, the square
root of the channel's largest magnitude over the prompt (`channel_factors`):
a few key channels are far larger than the rest, and would otherwise set the
scale of every group they fall in. The factors, one float32 per channel and
head, are kept at full precision. Then keys and values are rotated by the
Hadamard matrix (`hadamard`), as QuaRot and other rotation methods do: what
is left of an outlier spreads over every number of the vector, and the rounding
error over all. The rotation is orthonormal and its own inverse, so a pool
never turns its stored keys and values back: it rotates each query (times the
factors) and each output instead, one (D, D) product a query (pool.py).

A head that rounds to 4 or 2 bits also keeps its newest WINDOW tokens to
about 8 bits (WINDOW_BITS; pool.py's window), as KIVI and HF transformers'
quantized cache keep theirs in 16: the newest tokens draw the most attention,
and a token written leaves the window when WINDOW newer ones came. The window
holds what a token's codes miss (`quantize_residual`): at most half a step of
its group, rounded in 8 - bits bits (4, or 8 after 2-bit codes) on that step,
with no scale of its own: fewer bytes than 8-bit codes, read back about as
faithfully. Its bytes are counted and priced (`window_bytes`); under a budget
its width follows the budget (cache.budget_window).

16 bits is no quantization: the numbers stored as float16 (or in the model's
own dtype, if that has 16 bits), cast back on read.
"""
from __future__ import annotations

import functools
import math

import torch

# Numbers per scale (per token), and the precisions a head may take. The
# constants of this file were chosen by measurement (studies/README.md, quant_grouping).
GROUP = 32
BITS = (16, 8, 4, 2)
# Newest tokens a rounding head also keeps to about WINDOW_BITS bits (pool.window), codes and
# what they miss together; a method may take another width (cache.Method.window).
WINDOW = 32
WINDOW_BITS = 8


def channel_factors(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(S, D) each head's key channel factors from its prompt's keys k (S, T, D),
    valid (S, T) the real tokens: the square root of each channel's largest
    magnitude (a measured choice: README, "Precision")."""
    top = k.float().abs().masked_fill(~valid[..., None], 0).amax(1)
    return top.clamp(min=1e-6).sqrt()


@functools.lru_cache
def hadamard(D: int, device=None) -> torch.Tensor:
    """(D, D) float32, orthonormal and symmetric, so its own inverse: Sylvester's Hadamard
    matrix on blocks of the largest power of two dividing D (the whole of D = 64 or 128)."""
    n = D & -D
    h = torch.ones(1, 1)
    while len(h) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / math.sqrt(n)] * (D // n)).to(device)


def rotate(x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D) times `hadamard(D)` (or h, the same matrix at hand), in float32: rotated, or
    rotated back."""
    return (x.float() @ (hadamard(x.shape[-1], x.device) if h is None else h)).to(x.dtype)


def windowed(bits: int | None) -> bool:
    """Whether a precision keeps a window of newest tokens to about WINDOW_BITS: 4
    and 2 bits (8 bits loses too little to pay for one)."""
    return bits in (4, 2)


def rounds(bits: int | None) -> bool:
    """Whether a precision rounds to codes (8, 4, 2), rather than storing in
    16 bits or the model's dtype (None)."""
    return bits not in (None, 16)


def storage_dtype(bits: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype a 16-bit head stores in for a model computing in `dtype`."""
    return dtype if dtype.itemsize == 2 else torch.float16


def quantize(x: torch.Tensor, bits: int, group: int = GROUP):
    """x (..., D) as (codes (..., D * bits // 8) uint8, scale and low
    (..., D // group) float16)."""
    *lead, D = x.shape
    group = math.gcd(group, D)  # a head dimension of 80 takes groups of 16
    g = x.float().view(*lead, D // group, group)
    low, high = g.amin(-1), g.amax(-1)
    levels = (1 << bits) - 1
    # Rounded to float16 first, so that the codes are those of the stored scale.
    scale = ((high - low) / levels).half()
    low = low.half()
    step = scale.float().clamp(min=torch.finfo(torch.float16).tiny)[..., None]
    codes = ((g - low.float()[..., None]) / step).round_().clamp_(0, levels).to(torch.uint8)
    return pack(codes.view(*lead, D), bits), scale, low


def dequantize(codes, scale, low, bits: int, dtype=torch.float32) -> torch.Tensor:
    """`quantize`'s inverse, (..., D) in `dtype`."""
    c = unpack(codes, bits)
    *lead, D = c.shape
    groups = scale.shape[-1]
    g = c.view(*lead, groups, D // groups).to(dtype)
    return g.mul_(scale[..., None].to(dtype)).add_(low[..., None].to(dtype)).view(*lead, D)


def residual_bits(bits: int) -> int:
    """Bits a window rounds what `bits`-bit codes miss to: WINDOW_BITS - bits, or 8 where
    that does not pack (6, after 2-bit codes)."""
    rest = WINDOW_BITS - bits
    return rest if rest in (4, 8) else 8


def quantize_residual(x: torch.Tensor, codes, scale, low, bits: int) -> torch.Tensor:
    """What x (..., D) loses to its codes at `bits` (`quantize`'s, with their scale and low),
    as `residual_bits` codes (..., D * residual_bits // 8) on the codes' own step. It lies
    within half a step of 0: levels from -1/2 to 1/2 of it (2 ** residual_bits - 1, one code
    left unused) read a number between two codes the same from either, and have one at 0,
    where the group's least and largest numbers fall: neither turns on a rounding."""
    r = x.float() - dequantize(codes, scale, low, bits)
    half = (1 << residual_bits(bits)) // 2 - 1  # 7 levels each side of 0 at 4 bits
    *lead, D = x.shape
    step = scale.float().clamp(min=torch.finfo(torch.float16).tiny)[..., None] / (2 * half)
    g = r.view(*lead, scale.shape[-1], -1) / step
    rcodes = (g.round_().clamp_(-half, half) + half).to(torch.uint8)
    return pack(rcodes.view(*lead, D), residual_bits(bits))


def dequantize_residual(rcodes, scale, bits: int, dtype=torch.float32) -> torch.Tensor:
    """`quantize_residual`'s inverse: what to add to the codes' values, (..., D) in `dtype`."""
    rbits = residual_bits(bits)
    half = (1 << rbits) // 2 - 1
    c = unpack(rcodes, rbits)
    *lead, D = c.shape
    g = c.view(*lead, scale.shape[-1], -1).to(dtype).sub_(half).div_(2 * half)
    return g.mul_(scale[..., None].to(dtype)).view(*lead, D)


def read_back(x: torch.Tensor, bits: int, window: bool = False) -> torch.Tensor:
    """x (..., D) stored at `bits` and read back, in float32; `window`: as a window holds it,
    the codes and what they miss."""
    stored = quantize(x, bits)
    y = dequantize(*stored, bits)
    if window:
        y += dequantize_residual(quantize_residual(x, *stored, bits), stored[1], bits)
    return y


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) codes below 2**bits as (..., D * bits // 8) bytes, in planes: byte j holds
    codes j, j + D / per, j + 2 D / per, ... (per = 8 // bits), the first lowest. Read
    back, each plane is a contiguous run of codes, one shift and mask of every byte, which
    compiled code reads about as fast as 8-bit codes."""
    per = 8 // bits
    if per == 1:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]
    return (codes.view(*codes.shape[:-1], per, -1) << shifts).sum(-2, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    if bits == 4 and torch.compiler.is_compiling():
        # Compiled, the bytes repeated, each copy shifted by its plane's: one loop fused with
        # the dequantization. Not at 2 bits, whose planes split a group.
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
        return packed.repeat(*[1] * (packed.dim() - 1), 2) >> shifts.repeat_interleave(
            packed.shape[-1]) & mask
    return torch.stack([packed >> s & mask for s in range(0, 8, bits)], -2).flatten(-2)


def token_bytes(bits: int, head_dim: int, group: int = GROUP) -> int:
    """Bytes one token's key and value take in one head at `bits` (16: float16)."""
    if bits == 16:
        return 2 * 2 * head_dim
    return 2 * (head_dim * bits // 8 + 2 * 2 * (head_dim // math.gcd(group, head_dim)))


def window_bytes(bits: int, head_dim: int, window: int | None = None) -> int:
    """Bytes a head's window takes at `bits`: `window` (None: WINDOW) keys' and
    values' residues (`quantize_residual`), each entry's position (int32) and slot
    (int64); none where it keeps no window (`windowed`)."""
    width = WINDOW if window is None else window
    return width * (2 * head_dim * residual_bits(bits) // 8 + 4 + 8) if windowed(bits) else 0
