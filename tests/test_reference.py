"""The reference checks the default's choice under a budget by itself: its own recoveries, an
exact knapsack over its own menu (reference.knapsack), against the cache's plan."""
import math
import random

import pytest
import torch

import cache
import reference
from cache import default_method
from policies import token_flags
from reference import one_thread, rotation_of_fixed_bits  # noqa: F401  (autouse fixtures)
from reference import check_budget_choice, drive, knapsack

FLAGS = token_flags(32, special_ids=[0, 7], punct_ids=[3, 11, 19, 27])
CHUNKS = [[1, 1], [6, 6], [1, 1], [5, 5], [1, 1]]  # two chunks choose again


def test_the_knapsack_is_exact_by_brute_force_and_by_dynamic_programming(monkeypatch):
    # Two heads, three items: the best pair within 5 is (1, 1), worth -0.2.
    values = [[-1.0, -0.1, 0.0], [-0.5, -0.1, -math.inf]]
    costs = [[1, 2, 4], [1, 3, 1]]
    assert knapsack(values, costs, 5) == ([1, 1], pytest.approx(-0.2), 1)
    assert knapsack(values, costs, 1)[:2] == ([0, 0], None)  # nothing fits: the cheapest
    rng = random.Random(0)
    for _ in range(100):
        K, M = rng.randint(1, 4), rng.randint(1, 6)
        values = [[-rng.random() for _ in range(M)] for _ in range(K)]
        costs = [[rng.randint(1, 20) for _ in range(M)] for _ in range(K)]
        budget = rng.randint(0, 60) * rng.choice([1, 300])  # past RESOLUTION too
        brute = knapsack(values, costs, budget)
        monkeypatch.setattr(reference, "BRUTE_FORCE", 0)
        by_cost = knapsack(values, costs, budget)
        monkeypatch.undo()
        assert (brute[1] is None) == (by_cost[1] is None)
        assert brute[1] is None or brute[1] == pytest.approx(by_cost[1], abs=1e-12)
        check_budget_choice(by_cost[0], values, costs, budget, "by cost")


def counting(monkeypatch):
    """How often the reference checked a sequence's choice."""
    seen = {"checked": 0}

    def check(got, values, costs, budget, where, check=reference.check_budget_choice):
        seen["checked"] += 1
        check(got, values, costs, budget, where)
    monkeypatch.setattr(reference, "check_budget_choice", check)
    return seen


@pytest.mark.parametrize("budget", [0.1, 0.4, 0.6])
@pytest.mark.parametrize("bits", [None, (16, 8, 4)], ids=["dtype", "16-8-4"])
def test_the_default_s_choice_is_the_reference_s_optimum(budget, bits, monkeypatch):
    """The default's menu (at every precision) under a budget: at the prompt and at each chunk
    that chooses again, each sequence's plan is the reference's optimum, or ties it."""
    seen = counting(monkeypatch)
    stream = torch.randint(0, 32, (2, 60), generator=torch.Generator().manual_seed(21))
    checked = drive(default_method(budget, bits), stream, [12, 20], 6, 2, 8, FLAGS, seed=21,
                    head_dim=16, chunks=CHUNKS)
    assert checked.ref.rechosen == 2
    assert seen["checked"] == 2 * 3


def test_a_head_that_copies_takes_all_and_the_others_are_still_optimal(monkeypatch):
    """Where the default marks the heads that copy, one that copies keeps every token and the
    others share what is left, optimally."""
    seen = counting(monkeypatch)
    method = default_method(0.6)
    assert method.copies
    stream = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(5))
    checked = drive(method, stream, [12, 20], 6, 3, 8, FLAGS, seed=5, head_dim=16,
                    copies=torch.tensor([False, True, False]))
    assert seen["checked"] == 2
    assert [repr(checked.cache.plan()[s]) for s in (1, 4)] == ["Full"] * 2


def test_a_choice_worse_than_the_optimum_is_caught(monkeypatch):
    """The check is no formality: a cache whose knapsack gives its first head the cheapest
    item, not the best, fails it."""
    solve = cache.knapsacks

    def worse(values, costs, budgets):
        picks, _ = solve(values, costs, budgets)
        picks[0, 0] = costs[0, 0].masked_fill(values[0, 0] == -math.inf, 10**9).argmin()
        spent = costs.gather(2, picks[..., None]).view(len(picks), budgets.shape[1], -1).sum(2)
        return picks, spent
    monkeypatch.setattr(cache, "knapsacks", worse)
    stream = torch.randint(0, 32, (2, 60), generator=torch.Generator().manual_seed(21))
    with pytest.raises(AssertionError, match="the optimum is"):
        drive(default_method(0.4), stream, [12, 20], 6, 2, 8, FLAGS, seed=21, head_dim=16)
