"""Copy heads: a KV head that copies (an induction head) keeps every token under the default."""
import math

import torch

import cache
from policies import Full
from generation import prefill
from model import reserve
from profiling import induction_scores
from reference import one_thread  # noqa: F401  (autouse fixture)
from test_cache import padded, prompts_of, random_flags, tiny_model


def test_induction_scores_measure_the_attention_on_the_token_after_the_earlier_occurrence():
    """Over n tokens said twice, row p of the repeat said what row p - n said: a head whose query
    at p matches only the key at p - n + 1 scores about 1, one that reads the first token 0, and
    a uniform one the mean of 1 / (p + 1); the KV head scores the most of its query heads."""
    n, D = 8, 64
    T = 2 * n
    k = torch.eye(T, D)[None, None] * 20  # (1, 1, T, D): key p points along axis p
    q = torch.zeros(1, 3, T, D)
    rows = torch.arange(n, T)
    q[0, 0, rows, rows - n + 1] = 20  # copies
    q[0, 1, :, 0] = 20  # reads the first token
    # head 2: zero queries, uniform over what a row sees
    got = induction_scores(q, k.expand(1, 1, T, D))
    assert got.shape == (1,) and got.item() > 0.99
    each = [induction_scores(q[:, h:h + 1], k).item() for h in range(3)]
    assert each[0] > 0.99 and each[1] < 1e-3
    assert math.isclose(each[2], sum(1 / (p + 1) for p in range(n, T)) / n, rel_tol=1e-5)


def test_copy_heads_probe_the_model_once_and_leave_its_caches_as_they_were():
    model = tiny_model(n_layers=2)
    held = [cache.CopyProbe() for _ in model.layers]
    model.setup_caches(held)
    flags = random_flags(256, 0)
    got = cache.copy_heads(model, flags)
    assert got.shape == (2, model.args.n_kv_heads) and got.dtype == torch.bool
    assert all(a is b for a, b in zip(model.caches(), held))
    assert cache.copy_heads(model, flags) is got  # found once per model


def plans(model, method, lens, flags, chunk=None):
    """Each layer's policies chosen for (sequence, KV head), after the prompt and 20 new tokens."""
    caches = cache.fastgen_caches(model, method, lens, 24, flags)
    model.setup_caches(caches)
    tokens, lens_ = padded(prompts_of(lens, seed=4))
    prefill(model, tokens, lens_, chunk=chunk)
    for i in range(20):
        reserve(caches)
        model(torch.randint(1, 256, (len(lens), 1)), lens_[:, None] + i)
    model.setup_caches(None)
    return [[(c.policies[i], c.bits[i] if c.bits else None) for i in c.choice.tolist()]
            for c in caches]


def test_a_head_that_copies_keeps_every_token_under_a_tight_budget():
    """Marked as copying, the second KV head of the first layer takes a policy keeping every
    token, at 8 bits or more, at a quarter of the bytes, in every sequence, also where chunks
    choose again and where the prompt is read again; unmarked, the same model's plan evicts
    there or rounds to 4 bits. Only the default in several precisions asks."""
    model, flags, lens = tiny_model(n_layers=2), random_flags(256, 1), [48, 40]
    K = model.args.n_kv_heads
    marked = torch.zeros(2, K, dtype=torch.bool)
    marked[0, 1] = True
    method = cache.default_method(0.25, kv_bits=(16, 8, 4))
    assert method.copies and not cache.paper_method((16, 8, 4)).copies
    # Not where a head kept whole would cost more than COPY_COST times a head's share (an eighth
    # at 8 bits, a quarter in the model's dtype), nor in one precision.
    assert not any(cache.default_method(b, bits).copies
                   for b, bits in ((0.125, (16, 8, 4)), (0.25, None), (0.5, (4,))))
    read = cache.default_method(0.25, (16, 8, 4), ask_after=True)
    for m in (method, read):
        cache._copies[model] = torch.zeros_like(marked)
        before = plans(model, m, lens, flags)
        assert not all(p.keeps_all and b >= 8 for p, b in before[0][1::K])  # the premise
        cache._copies[model] = marked
        for chunk in (None, 16):
            after = plans(model, m, lens, flags, chunk)
            assert all(p.keeps_all and b >= 8 for p, b in after[0][1::K])
            assert not all(p.keeps_all for layer in after for p, _ in layer)


def test_in_the_model_s_dtype_full_joins_the_menu_for_the_heads_that_copy_alone():
    """From a half in the model's dtype the menu gains Full: the marked head takes it in every
    sequence, and no other head does, even at a budget that would pay for it."""
    from policies import menu
    model, flags, lens = tiny_model(n_layers=2), random_flags(256, 1), [48, 40]
    K = model.args.n_kv_heads
    method = cache.default_method(0.9)
    assert method.copies and method.policies == (*menu(by="mean"), Full())
    marked = torch.zeros(2, K, dtype=torch.bool)
    marked[1, 0] = True
    cache._copies[model] = marked
    for chunk in (None, 16):
        after = plans(model, method, lens, flags, chunk)
        assert all(isinstance(p, Full) for p, _ in after[1][0::K])
        others = [p for l, layer in enumerate(after) for i, (p, _) in enumerate(layer)
                  if (l, i % K) != (1, 0)]
        assert others and not any(isinstance(p, Full) for p in others)
