"""The 4-bit formats studies/quant_grouping.py compares with the pool's (`--formats`)."""
import torch

from quant import dequantize, quantize
from studies.quant_grouping import as_pool, codebook, lloyd, symmetric, unit_values


def test_symmetric_rounds_within_half_a_step():
    x = torch.randn(5, 7, 64)
    y = symmetric(x, 4, 32)
    step = x.view(5, 7, 2, 32).abs().amax(-1, keepdim=True) / 7.5
    assert ((y - x).view(5, 7, 2, 32).abs() <= step * 0.5 + 1e-3).all()
    assert not torch.equal(y, x)


def test_an_even_codebook_is_min_max_rounding():
    x = torch.randn(3, 10, 64)
    even = codebook(x, 32, torch.linspace(0, 1, 16))
    pooled = dequantize(*quantize(x, 4, 32), 4)
    # The same levels; a number on a boundary may round either way (the scale's float16).
    assert ((even - pooled).abs() < 1e-2).float().mean() > 0.97
    assert abs((even - x).abs().mean() / (pooled - x).abs().mean() - 1) < 0.02


def test_lloyd_keeps_its_ends_and_follows_the_values():
    u = unit_values(torch.randn(2000, 64), 32)
    book = lloyd(u)
    assert book[0] == 0 and book[-1] == 1 and (book.diff() > 0).all()
    # Rotated numbers are bell-shaped inside their groups: the inner levels crowd the middle.
    assert book[8] - book[7] < 1 / 15
    x = torch.randn(500, 64)
    fitted, even = (codebook(x, 32, b) - x for b in (book, torch.linspace(0, 1, 16)))
    assert fitted.pow(2).mean() < even.pow(2).mean()


def test_the_pools_rounding_is_its_own_inverse_up_to_rounding():
    keys, values = as_pool(lambda x, b, g: x)  # no rounding: the rotation and scaling undone
    x = torch.randn(2, 3, 40, 64)
    assert torch.allclose(keys(x, 4, 32), x, atol=1e-5)
    assert torch.allclose(values(x, 4, 32), x, atol=1e-5)
