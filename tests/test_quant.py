"""Keys and values in fewer bits: rounding within its bound, bytes held as
reported, every precision's cache against the rounded reference, and the
budget's choice of precision."""
import itertools
import math
from dataclasses import replace

import pytest
import torch

import cache as cache_module
import pool
import profiling
import quant
from cache import Method, fastgen_caches, token_costs
from generation import CacheOptions, generate, make_caches
from model import reserve
from policies import Frequent, Full, Local, Special, baseline
from profiling import fit_budget, precision_errors
from quant import GROUP, channel_factors, dequantize, pack, quantize, token_bytes, unpack
from reference import one_thread, rotation_of_fixed_bits  # noqa: F401  (autouse fixtures)
from reference import drive
from test_cache import greedy, prompts_of, random_flags, tiny_model


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_rounding_is_within_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-2, 2, 64)  # channels of all sizes
    codes, scale, low = quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (5, 3, 64 * bits // 8)
    assert scale.shape == low.shape == (5, 3, 64 // GROUP) and scale.dtype == torch.float16
    y = dequantize(codes, scale, low, bits)
    step = scale.float().repeat_interleave(GROUP, -1)
    # Half a step, and the float16 rounding of the minimum and of the step times the code.
    bound = step / 2 + low.float().abs().repeat_interleave(GROUP, -1) * 2 ** -10 + \
        x.abs() * 2 ** -9
    assert ((x - y).abs() <= bound).all()
    # Each group's largest number is kept, up to float16 rounding of its minimum and scale.
    grouped = x.view(5, 3, -1, GROUP)
    top = y.view(5, 3, -1, GROUP).amax(-1)
    torch.testing.assert_close(top, grouped.amax(-1), atol=0, rtol=4e-3)


@pytest.mark.parametrize("bits, levels", [(4, 14), (2, 254)])
def test_a_window_reads_what_the_codes_miss(bits, levels):
    """quant.quantize_residual: the codes plus what they miss, each number within half a
    residual step (the codes' step over `levels`), about 8 bits' rounding; a number between two
    codes reads the same from either (a rounding boundary moves no window)."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-2, 2, 64)
    codes, scale, low = quantize(x, bits)
    assert quant.residual_bits(bits) == {4: 4, 2: 8}[bits]
    residue = quant.quantize_residual(x, codes, scale, low, bits)
    assert residue.shape == (5, 3, 64 * quant.residual_bits(bits) // 8)
    y = dequantize(codes, scale, low, bits) + quant.dequantize_residual(residue, scale, bits)
    torch.testing.assert_close(y, quant.read_back(x, bits, window=True), atol=0, rtol=0)
    step = scale.float().repeat_interleave(GROUP, -1)
    bound = step / levels / 2 + low.float().abs().repeat_interleave(GROUP, -1) * 2 ** -10 + \
        x.abs() * 2 ** -9
    assert ((x - y).abs() <= bound).all()
    eight = dequantize(*quantize(x, 8), 8)
    assert (x - y).abs().mean() < 1.3 * (x - eight).abs().mean()  # about as close as 8 bits
    # A number halfway between codes 2 and 3 of its group, read from either.
    c, s, lo = codes[:1, :1], scale[:1, :1], low[:1, :1]
    half = x[:1, :1].clone()
    half[..., 1] = lo[..., 0].float() + 2.5 * s[..., 0].float()
    reads = [dequantize(c2, s, lo, bits) + quant.dequantize_residual(
        quant.quantize_residual(half, c2, s, lo, bits), s, bits)
        for c2 in (_with_code(c, 1, 2, bits), _with_code(c, 1, 3, bits))]
    torch.testing.assert_close(reads[0][..., 1], reads[1][..., 1], atol=1e-6 * float(s[..., 0]),
                               rtol=0)


def _with_code(packed, j, code, bits):
    c = unpack(packed, bits).clone()
    c[..., j] = code
    return pack(c, bits)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packing_is_undone_exactly(bits):
    codes = torch.randint(0, 1 << bits, (7, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (7, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [4, 2])
def test_codes_are_packed_in_planes(bits):
    # Byte j holds codes j, j + D / per, ...: each plane a contiguous run, the first lowest.
    per, D = 8 // bits, 64
    codes = torch.randint(0, 1 << bits, (3, D), dtype=torch.uint8)
    packed = pack(codes, bits)
    for i in range(per):
        plane = codes[:, i * D // per:(i + 1) * D // per]
        assert torch.equal(packed >> (i * bits) & ((1 << bits) - 1), plane)


def test_compiled_unpacking_equals_eager():
    # Compiled, 4 bits unpack by another route (quant.unpack): the same codes.
    packed = torch.randint(0, 256, (3, 5, 32), dtype=torch.uint8)
    compiled = torch.compile(unpack, backend="eager", fullgraph=True)
    for bits in (8, 4, 2):
        assert torch.equal(compiled(packed, bits), unpack(packed, bits))


def test_a_constant_group_rounds_to_itself():
    x = torch.full((2, 64), 3.25)
    assert torch.equal(dequantize(*quantize(x, 4), 4), x)


def sylvester(D: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix by its definition: H[i, j] = (-1)^(the bits i and j share)."""
    i = torch.arange(D)
    shared = torch.tensor([[bin(a & b).count("1") for b in i.tolist()] for a in i.tolist()])
    return (1 - 2 * (shared % 2)).float() / math.sqrt(D)


@pytest.mark.parametrize("D", [64, 128, 80])
def test_the_rotation_is_sylvesters_and_its_own_inverse(D):
    h = quant.hadamard(D)
    n = D & -D  # 80: five blocks of 16
    assert torch.equal(h, torch.block_diag(*[sylvester(n)] * (D // n)))
    x = torch.randn(5, D)
    assert torch.allclose(quant.rotate(quant.rotate(x)), x, atol=1e-5)


def test_rotation_spreads_an_outlier_channel_and_rounds_closer():
    """One channel far larger than the rest sets its group's scale, and the
    others round to a few levels; rotated, every number carries a share of it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, 5] *= 30
    plain = dequantize(*quantize(x, 4), 4)
    turned = quant.rotate(dequantize(*quantize(quant.rotate(x), 4), 4))
    assert (turned - x).norm() < 0.5 * (plain - x).norm()


def test_precision_errors_equal_brute_force():
    g = torch.Generator().manual_seed(0)
    B, K, G, T, D, rows = 2, 2, 3, 20, 64, 6
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (K * G, K, K))
    lens = torch.tensor([20, 13])
    got = precision_errors(q, k, v, lens, [16, 8, 4], rows, window=4)
    assert (got[:, 0] == 0).all() and (got[:, 1] < got[:, 2]).all()
    for b, L in enumerate(lens.tolist()):
        for h in range(K):
            f = k[b, h, :L].abs().amax(0).sqrt()  # each key channel's factor
            R = sylvester(D)  # rounded rotated, read back rotated back
            kbs = {bits: dequantize(*quantize(k[b, h, :L] / f @ R, bits), bits) @ R * f
                   for bits in (8, 4)}
            vbs = {bits: dequantize(*quantize(v[b, h, :L] @ R, bits), bits) @ R
                   for bits in (8, 4)}

            def window(x):  # 4-bit codes and what they miss, to a 14th of their step, +-7 steps
                scale, y = quantize(x, 4)[1], dequantize(*quantize(x, 4), 4)
                step = scale.float().repeat_interleave(D // scale.shape[-1], -1) / 14
                return y + ((x - y) / step).round().clamp(-7, 7) * step

            for j, bits in enumerate([8, 4]):
                kb, vb = kbs[bits].clone(), vbs[bits].clone()
                if bits == 4:  # the window (quant.windowed: none at 8 bits)
                    kb[L - 4:] = window(k[b, h, L - 4:L] / f[None] @ R) @ R * f
                    vb[L - 4:] = window(v[b, h, L - 4:L] @ R) @ R
                total = 0.0
                for i in range(L - rows, L):
                    for head in range(h * G, (h + 1) * G):
                        a = (q[b, head, i] @ k[b, h, :i + 1].T / math.sqrt(D)).softmax(-1)
                        ab = (q[b, head, i] @ kb[:i + 1].T / math.sqrt(D)).softmax(-1)
                        y = a @ v[b, h, :i + 1]
                        total += float((a - ab).abs().sum() / 2)
                        total += float((a @ (vb[:i + 1] - v[b, h, :i + 1])).norm() / y.norm())
                assert got[b * K + h, j + 1].item() == pytest.approx(total / (rows * G), rel=1e-4)


# --- The cache at every precision, against the rounded reference ------------------

MENU = [Special() | Local(0.2), Frequent(0.2) | Local(0.2), baseline("tova", 0.3), Full()]
BITS_CASES = {
    "menu 16/8/4": Method([p for _ in range(3) for p in MENU],
                          [b for b in (16, 8, 4) for _ in MENU], kv_budget=0.3),
    "h2o at 4": Method([baseline("h2o", 0.4)], [4]),
    "full at 8": Method([Full()], [8]),
    "full at 16": Method([Full()], [16]),
    "local at 2": Method([Local(0.3)], [2]),
}


@pytest.fixture
def window(monkeypatch):
    """A window of newest tokens (pool.WINDOW) narrower than the
    small tests' segments, so that their tokens are read rounded as well, and
    priced so that a budget still takes fewer bits."""
    for module in (pool, profiling, quant):
        monkeypatch.setattr(module, "WINDOW", 5)


@pytest.mark.parametrize("name", BITS_CASES)
@pytest.mark.parametrize("lens, n_heads, n_kv_heads", [([12, 20], 6, 2), ([20, 13, 15], 4, 1)])
def test_cache_at_every_precision_equals_the_rounded_reference(name, lens, n_heads, n_kv_heads,
                                                                window):
    """Every step's output equals the reference's, which rounds each segment's
    keys and values at its policy's precision, and holds the same tokens."""
    method = BITS_CASES[name]
    seed = len(lens) * 10 + n_kv_heads
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, 32, (len(lens), max(lens) + 30), generator=g)
    flags = random_flags(32, seed, special=0.1, punct=0.25)
    checked = drive(method, stream, lens, n_heads, n_kv_heads, 31, flags, seed=seed, head_dim=64)
    assert checked.steps == 30
    cache = checked.cache
    if len(set(method.kv_bits)) > 1 and n_kv_heads > 1:  # (a sequence's one head takes one)
        assert len(cache.pool.parts) > 1  # the budget took several precisions
    for g in cache.pool.groups:
        assert all(cache.bits[i] == g.bits for i in cache.choice[g.seg].tolist())


@pytest.mark.parametrize("chunks, chose", [([[1, 1], [5, 3], [1, 1], [4, 4], [1, 1]], 1),
                                           ([[3, 3]] * 5 + [[1, 1]], 5)])
def test_chunks_choose_again_within_the_stored_precision(chunks, chose, window):
    """Every chunk that all sequences take whole chooses again (against the
    reference; a chunk with padding does not): a segment's new policy is one
    at the precision it holds."""
    method = replace(BITS_CASES["menu 16/8/4"], rows=4, kv_budget=0.25)  # tight: the plan moves
    stream = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(5))
    checked = drive(method, stream, [12, 20], 6, 2, 20, random_flags(32, 1), seed=5,
                    head_dim=64, chunks=chunks)
    cache = checked.cache
    assert checked.ref.rechosen == chose
    assert cache.choice.tolist() != checked.ref.prompt_choice  # the plan moved
    for g in cache.pool.groups:  # a segment's new policy is one at the precision it holds
        assert all(cache.bits[i] == g.bits for i in cache.choice[g.seg].tolist())


def test_a_chunk_never_chooses_what_the_pool_cannot_run(window):
    """A tight budget, a pool laid out without the latest attention (no TOVA
    at the prompt): a chunk must not move a segment to TOVA, which would then
    evict by a `last` the pool does not hold (the reference asserts that each
    new policy was offered)."""
    method = Method([p for _ in range(2) for p in MENU], [16] * 4 + [4] * 4, kv_budget=0.2,
                    rows=4)
    stream = torch.randint(0, 32, (2, 80), generator=torch.Generator().manual_seed(3))
    checked = drive(method, stream, [12, 20], 4, 2, 20, random_flags(32, 3), seed=3,
                    head_dim=64, chunks=[[1, 1], [8, 8], [1, 1], [12, 12], [1, 1]])
    assert not checked.ref.has_last and checked.ref.rechosen == 2


def test_full_at_16_bits_matches_the_dense_cache_in_16_bits():
    """FastGen's Full at 16 bits against the dense cache stored in float16
    (`--kv full --kv-bits 16`), under a float32 model: the same greedy tokens,
    logits equal up to float32 rounding."""
    model = tiny_model()
    lens, max_new = [9, 16], 12
    prompts = prompts_of(lens, seed=3)
    dense = make_caches(model, CacheOptions("full", kv_bits=(16,)), lens, max_new)
    assert all(c.k.dtype == c.v.dtype == torch.float16 for c in dense)
    full = fastgen_caches(model, Method([Full()], [16]), lens, max_new, random_flags(256, 0))
    expected = greedy(model, prompts, dense, max_new)
    got = greedy(model, prompts, full, max_new)
    # The prompt attends at full precision in both; each decode step reads float16.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert all(c.pool.parts[0].k.dtype == c.pool.parts[0].v.dtype == torch.float16 for c in full)
    exact = greedy(model, prompts, make_caches(model, CacheOptions("full"), lens, max_new),
                   max_new)
    assert not torch.equal(got, exact)  # float16 is not float32


@torch.no_grad()
@pytest.mark.parametrize("width", [None, 3])
def test_bytes_held_are_those_reported_and_priced(width, window):
    """A precision menu under a budget: nbytes counts every tensor the cache
    holds, and each part's K and V take token_bytes a slot, the price the
    budget pays; a 4-bit head's window is the method's (None: WINDOW) wide."""
    model = tiny_model(head_dim=64, dim=128, n_heads=2, n_kv_heads=2)
    lens = [60, 45]
    method = Method([p for _ in range(3) for p in MENU], [16] * 4 + [8] * 4 + [4] * 4,
                    kv_budget=0.3, window=width)
    caches = fastgen_caches(model, method, lens, 8, random_flags(256, 2))
    greedy(model, prompts_of(lens, seed=2), caches, 8)
    seen = set()
    for c in caches:
        held = {name: t for name, t in c.named_buffers() if name not in ("prompt_lens",
                                                                         "token_flags")}
        assert c.nbytes() == sum(t.nbytes for t in held.values())
        p = c.pool
        for part in p.parts:
            seen.add(part.bits)
            kv = sum(t.nbytes for t in part.tensors())
            assert kv == part.pages * p.page * token_bytes(part.bits, 64)
            # A window of newest tokens (in 8 bits) at 4 bits, none at 8 or 16.
            assert part.windowed == (part.bits == 4)
            if part.windowed:  # priced as held (quant.window_bytes)
                held = part.window()
                segments = len(p.rows_of(part)[0])
                assert held[0].shape[1] == (width or 5)  # the fixture's WINDOW
                assert sum(t.nbytes for t in held) == segments * quant.window_bytes(4, 64, width)
            else:
                assert not hasattr(part, "window_k")
    assert len(seen) > 1


@torch.no_grad()
def test_rounding_errors_weigh_what_the_weight_says(monkeypatch):
    """The knapsack sees each policy's recovery less ROUNDING_WEIGHT times its
    rounding error (none at 16 bits); with no weight at all, every head takes
    a policy at the fewest bits that its bytes allow, here 4 or 8."""
    model = tiny_model(head_dim=64, dim=128, n_heads=2, n_kv_heads=2, max_seq_len=512)
    lens = [300, 260]
    method = Method([p for _ in range(3) for p in MENU], [16] * 4 + [8] * 4 + [4] * 4,
                    kv_budget=0.3)
    errors, bits = {}, {}
    for w in (0.0, 0.25, 1.0):
        monkeypatch.setattr(cache_module, "ROUNDING_WEIGHT", w)
        caches = fastgen_caches(model, method, lens, 8, random_flags(256, 2))
        greedy(model, prompts_of(lens, seed=2), caches, 1)
        errors[w] = torch.stack([c.errors for c in caches])
        bits[w] = {g.bits for c in caches for g in c.pool.groups}
    assert (errors[0.0] == 0).all() and (errors[1.0][..., :4] == 0).all()
    assert (errors[1.0][..., 4:] > 0).all()
    torch.testing.assert_close(errors[0.25] * 4, errors[1.0])
    assert 16 not in bits[0.0]


@torch.no_grad()
def test_a_cache_that_keeps_all_keeps_no_score_or_flags():
    """The full cache in 4 bits ranks nothing: a slot holds its K, V codes and
    position only, besides each head's window, and the budget prices that."""
    model = tiny_model(head_dim=64, dim=128, n_heads=2, n_kv_heads=2)
    lens = [60, 45]
    caches = make_caches(model, CacheOptions("full", kv_bits=(4,)), lens, 8)
    greedy(model, prompts_of(lens, seed=2), caches, 8)
    for c in caches:
        p = c.pool
        assert set(p.fields) == {"pos"} and [part.bits for part in p.parts] == [4]
        held = sum(t.nbytes for t in (p.pos, *p.parts[0].tensors()))
        assert held == p.size * (token_bytes(4, 64) + pool.slot_bytes(False, ranks=False))
        assert token_costs(c)[0].tolist() == [token_bytes(4, 64) + 4]  # what the budget pays


def test_full_share_is_counted_against_16_bits():
    model = tiny_model()
    # A prompt longer than the window of newest tokens that stay in 8 bits.
    gen = generate(model, prompts_of([200], seed=1), 4, cache=CacheOptions("full", kv_bits=(4,)))
    dense = generate(model, prompts_of([200], seed=1), 4)
    assert gen.full_kv_bytes * 2 == dense.full_kv_bytes  # float32 model, 16-bit reference
    assert gen.kv_bytes < gen.full_kv_bytes
    assert "in 16 bits" in gen.summary()


@pytest.mark.parametrize("seed", range(6))
def test_a_budget_over_precisions_equals_brute_force(seed):
    """Menus of policies at several precisions, costs in bytes: the knapsack's
    choice is the best that fits, found by trying every combination."""
    g = torch.Generator().manual_seed(seed)
    S, policies = 4, 3
    tokens = torch.randint(1, 30, (S, policies), generator=g)
    recovered = torch.rand(S, policies, generator=g)
    units = [token_bytes(b, 64) for b in (16, 8, 4)]
    costs = torch.cat([tokens * u for u in units], 1)  # (S, 3 * policies) bytes
    values = torch.cat([recovered - e for e in (0.0, 0.01, 0.1)], 1)
    budget = int(costs.float().mean(1).sum() * 0.6)
    choice = fit_budget(values, costs, budget, resolution=1 << 20)
    assert int(costs[torch.arange(S), choice].sum()) <= budget
    best = max((sum(values[s, c].item() for s, c in enumerate(combo)), combo)
               for combo in itertools.product(range(costs.shape[1]), repeat=S)
               if sum(costs[s, c].item() for s, c in enumerate(combo)) <= budget)
    got = sum(values[s, c].item() for s, c in enumerate(choice.tolist()))
    assert got == pytest.approx(best[0], abs=1e-9)


# --- A budget shared by the heads of cache.SCOPE layers -------------------------------

def spy_knapsacks(monkeypatch):
    """The (values shape, budgets) of every call to the cache's knapsack."""
    calls = []
    real = cache_module.fit_budgets
    monkeypatch.setattr(cache_module, "fit_budgets", lambda v, c, b, *a: calls.append(
        (tuple(v.shape), list(b))) or real(v, c, b, *a))
    return calls


@torch.no_grad()
def test_a_small_model_s_budget_is_one_knapsack_per_sequence_over_every_layer(monkeypatch):
    """A model of no more than cache.SCOPE layers decides at once, in one
    knapsack per sequence whose budget is the sum of what each layer deciding
    alone gets; the layers' shares then differ, and average within the budget."""
    calls = spy_knapsacks(monkeypatch)
    model = tiny_model()
    lens = [30, 22]
    method = Method([p for _ in range(2) for p in MENU], [16] * 4 + [4] * 4, kv_budget=0.4)
    caches = fastgen_caches(model, method, lens, 8, random_flags(256, 2))
    greedy(model, prompts_of(lens, seed=5), caches, 8)
    L, B, K = model.args.n_layers, len(lens), model.args.n_kv_heads
    assert L <= cache_module.SCOPE
    assert len(calls) == 1  # one knapsack per sequence, over every layer's heads
    (shape, budgets), = calls
    assert shape == (B, L * K, len(method.policies))
    shares = torch.stack([c.share for c in caches])  # (L, B): what each layer took
    assert len(set(shares.flatten().tolist())) > 1
    assert (shares.mean(0) <= 0.4 + 1e-9).all()
    alone = fastgen_caches(model, method, lens, 8, random_flags(256, 2))
    for c in alone:  # each layer decides alone, on its own share
        c.pending = cache_module.Pending(1)
    calls.clear()
    greedy(model, prompts_of(lens, seed=5), alone, 8)
    assert [shape for shape, _ in calls] == [(B, K, len(method.policies))] * L
    assert [sum(b) for b in zip(*(b for _, b in calls))] == budgets
    assert all((c.share <= 0.4 + 1e-9).all() for c in alone)


@torch.no_grad()
def test_a_budget_is_shared_by_every_scope_layers(monkeypatch):
    """A deeper model decides every cache.SCOPE layers (the last group what
    is left), one knapsack per sequence over each group's heads, each group
    within the budget."""
    calls = spy_knapsacks(monkeypatch)
    N = cache_module.SCOPE
    model, lens = tiny_model(n_layers=N + 2), [30, 22]
    caches = fastgen_caches(model, Method(MENU, kv_budget=0.4), lens, 8, random_flags(256, 2))
    greedy(model, prompts_of(lens, seed=5), caches, 8)
    B, K, M = len(lens), model.args.n_kv_heads, len(MENU)
    assert [shape for shape, _ in calls] == [(B, N * K, M), (B, 2 * K, M)]
    # Each group's budget: its layers' share of each sequence's full cache.
    assert calls[0][1] == [b * N // 2 for b in calls[1][1]]
    spent = torch.stack([c.share for c in caches])  # (L, B)
    assert (spent[:N].mean(0) <= 0.4 + 1e-9).all() and (spent[N:].mean(0) <= 0.4 + 1e-9).all()
    assert len(set(spent[:N].flatten().tolist())) > 1


@pytest.mark.parametrize("n_layers", [2, cache_module.SCOPE + 1])
@torch.no_grad()
def test_a_sequence_gets_the_same_plan_alone_and_in_a_batch(n_layers):
    """The budget is each sequence's own: a prompt's plan and logits do not
    depend on the prompts batched with it, whether the model's layers make
    one group or more."""
    model = tiny_model(n_layers=n_layers)
    lens, flags = [30, 22, 26], random_flags(256, 2)
    prompts, K = prompts_of(lens, seed=5), model.args.n_kv_heads
    method = Method(MENU, kv_budget=0.4)
    batch = fastgen_caches(model, method, lens, 8, flags)
    together = greedy(model, prompts, batch, 8)
    for b, p in enumerate(prompts):
        alone = fastgen_caches(model, method, [lens[b]], 8, flags)
        logits = greedy(model, [p], alone, 8)
        assert [c.choice[b * K:(b + 1) * K].tolist() for c in batch] == [
            c.choice.tolist() for c in alone]
        torch.testing.assert_close(logits[0], together[b], atol=1e-4, rtol=1e-4)


def test_channel_factors_keep_a_large_channel_from_setting_every_scale():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 50, 64, generator=g)
    k[..., 5] *= 40  # an outlier channel, as keys have
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, 40:] = False
    k[1, 40:] = 1e4  # padding: must not count
    f = channel_factors(k, valid)
    assert f.shape == (2, 64) and f[1].max() < 100
    plain = (dequantize(*quantize(k[:, :40], 4), 4) - k[:, :40]).norm()
    scaled = (dequantize(*quantize(k[:, :40] / f[:, None], 4), 4) * f[:, None] - k[:, :40]).norm()
    assert scaled < plain / 2


def test_parts_of_several_precisions_grow_and_compile_once(window):
    """A pool with a 16-bit and a 4-bit part, growing as Full heads fill: the
    compiled step compiles once, growths included, and equals eager decoding."""
    import torch._dynamo
    from test_cache import first_token, fresh_compile
    model = tiny_model(seed=1)
    lens, max_new = [9, 14], 30
    prompts = prompts_of(lens, seed=7)
    method = Method([Full(), Full()], [16, 4], kv_budget=0.85, evict_every=3)

    def caches():
        return fastgen_caches(model, method, lens, max_new, page=4)

    eager = caches()
    expected = greedy(model, prompts, eager, max_new).argmax(-1)
    assert any(len(c.pool.parts) == 2 for c in eager)
    step, counters = fresh_compile()
    compiled = caches()
    with torch.no_grad():
        model.setup_caches(compiled)
        cur, lens_t = first_token(model, prompts)
        out = [cur]
        for i in range(max_new - 1):
            reserve(compiled)
            cur = step(model, cur, lens_t[:, None] + i)
            out.append(cur)
        model.setup_caches(None)
    assert torch.equal(torch.cat(out, 1), expected)
    assert sum(c.growths() for c in compiled) >= 2
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()
