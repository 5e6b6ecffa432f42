"""The byte-budget selection: an exact knapsack, one menu item per segment."""
import itertools
import math

import pytest
import torch

from profiling import fit_budget, fit_budgets, squared_losses


@pytest.mark.parametrize("seed", range(40))
def test_budget_choice_equals_brute_force_and_fits(seed):
    g = torch.Generator().manual_seed(seed)
    S = int(torch.randint(1, 5, (1,), generator=g))
    M = int(torch.randint(1, 5, (1,), generator=g))
    costs = torch.randint(0, 12, (S, M), generator=g)
    values = torch.rand(S, M, generator=g)
    budget = int(torch.randint(0, 12 * S, (1,), generator=g))
    choice = fit_budget(values, costs, budget)
    rows = torch.arange(S)
    feasible = [c for c in itertools.product(range(M), repeat=S)
                if sum(int(costs[s, m]) for s, m in enumerate(c)) <= budget]
    if not feasible:  # nothing fits: the cheapest everywhere
        assert torch.equal(costs[rows, choice], costs.min(1).values)
        return
    assert int(costs[rows, choice].sum()) <= budget
    best = max(sum(float(values[s, m]) for s, m in enumerate(c)) for c in feasible)
    assert float(values[rows, choice].sum()) == pytest.approx(best, abs=1e-6)


def test_layers_side_by_side_as_each_alone():
    """`fit_budgets` runs the layers' programs together, each under its own
    budget (one above `resolution`, one where nothing fits): each layer's
    choice is `fit_budget`'s alone."""
    g = torch.Generator().manual_seed(0)
    L, S, M = 5, 6, 7
    costs = torch.randint(0, 40, (L, S, M), generator=g)
    values = torch.rand(L, S, M, generator=g)
    values[1, :, 2] = values[1, :, 3]  # ties
    budgets = [60, 9000, 0, 120, 35]
    costs[1] *= 100
    together = fit_budgets(values, costs, budgets, resolution=512)
    for i in range(L):
        assert torch.equal(together[i], fit_budget(values[i], costs[i], budgets[i], resolution=512))


def test_squared_losses_spread_what_a_sum_of_recoveries_concentrates():
    """Two heads, a cheap, a middle and a whole policy each: the sum of
    recoveries takes the cheap one for one head and the whole for the other
    (0.8 + 1.0 > 0.89 + 0.89); the squared losses take the middle for both
    (0.04 > 2 * 0.0121)."""
    recovery = torch.tensor([[0.8, 0.89, 1.0]] * 2)
    costs = torch.tensor([[1, 2, 3]] * 2)
    assert fit_budget(recovery, costs, 4).sort().values.tolist() == [0, 2]
    assert fit_budget(squared_losses(recovery), costs, 4).tolist() == [1, 1]
    # Never worth -inf more (a policy the segment may not take) and never above 0.
    r = torch.tensor([-math.inf, -1.0, 0.0, 0.5, 1.0, 1.2])
    assert squared_losses(r).tolist() == [-math.inf, -4.0, -1.0, -0.25, 0.0, 0.0]


@torch.no_grad()
def test_the_cache_s_knapsack_minimizes_squared_losses(monkeypatch):
    """A FastGen cache under a budget hands the knapsack the squared losses
    of the recoveries it measured (profiling.squared_losses), every head of
    the layers deciding together in one knapsack per sequence."""
    import cache as cache_module
    from test_cache import greedy, prompts_of, random_flags, tiny_model
    from test_quant import MENU
    seen = []
    real = cache_module.fit_budgets

    def spy(values, costs, budgets, *args):
        seen.append(values.clone())
        return real(values, costs, budgets, *args)

    monkeypatch.setattr(cache_module, "fit_budgets", spy)
    model, lens = tiny_model(), [30, 22]
    method = cache_module.Method(MENU, kv_budget=0.4)
    caches = cache_module.fastgen_caches(model, method, lens, 4, random_flags(256, 2))
    greedy(model, prompts_of(lens, seed=5), caches, 4)
    L, B, K, M = len(caches), len(lens), model.args.n_kv_heads, len(MENU)
    assert len(seen) == 1 and seen[0].shape == (B, L * K, M)  # the model's 2 layers: one knapsack
    # (B, L * K, M), each sequence's heads layer after layer, as the layers' (L * B * K, M).
    values = seen[0].view(B, L, K, M).transpose(0, 1).reshape(L * B * K, M)
    recovery = torch.cat([c.recovery for c in caches])
    assert not torch.allclose(values, recovery)
    torch.testing.assert_close(values, squared_losses(recovery))


def test_a_budget_too_small_takes_the_cheapest_item_a_segment_may_take():
    """Under a budget that even the cheapest items pass, each segment takes its
    cheapest item worth more than -inf: never one it may not take (a policy at
    another precision than its tokens are stored at), however cheap."""
    values = torch.tensor([[-math.inf, -0.5, 0.0], [-0.1, -math.inf, 0.0]])
    costs = torch.tensor([[1, 5, 9], [4, 2, 9]])
    assert fit_budget(values, costs, 3).tolist() == [1, 0]
