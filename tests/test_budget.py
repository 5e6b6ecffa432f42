"""The byte-budget selection: an exact knapsack, one menu item per segment."""
import itertools

import pytest
import torch

from profiling import fit_budget, fit_budgets


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
