"""Each policy's rule, `keep`, against what the cache asks: `Slots.keeps`, with a menu's
rankings shared (prefill) or one policy at a time (eviction)."""
import pytest
import torch

from policies import TOVA, Frequent, Local, Sink, Slots, SnapKV, Special, menu, shortlist


def random_slots(seed: int, layout: str, N: int = 6, C: int = 40):
    """A function that builds the same N random segments of C slots afresh
    (nothing remembered). Scores and latest attention hold many ties, every
    row has its own seen, prompt_len and first query (every prompt row read,
    or an observation window). "cache": positions out of order with empty
    slots, the newest token often held, as eviction sees them; "prompt": the
    prompt in position order, padded with empty slots, as prefill sees it."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, C + 10, (N, 1), generator=g)
    pos = torch.full((N, C), -1)
    if layout == "prompt":
        seen = prompt_len
        cols = torch.arange(C)
        pos = torch.where(cols < prompt_len, cols, -1)
    else:
        seen = prompt_len + torch.randint(0, 20, (N, 1), generator=g)
        for i, n in enumerate(seen[:, 0].tolist()):
            held = torch.cat([torch.tensor([n - 1]), torch.randperm(n - 1, generator=g)])[:C]
            pos[i, torch.randperm(C, generator=g)[:len(held)]] = held
        pos[torch.rand(N, C, generator=g) < 0.2] = -1
    score = torch.randint(0, 4, (N, C), generator=g).float()
    last = torch.randint(0, 3, (N, C), generator=g).float()
    flags = torch.randint(0, 4, (N, C), generator=g, dtype=torch.uint8)
    window = (prompt_len - torch.randint(1, 33, (N, 1), generator=g)).clamp(min=0)
    first = torch.where(torch.rand(N, 1, generator=g) < 0.5, 0, window)
    return lambda: Slots(pos, score, flags, seen, prompt_len, first, last)


def policies(by: str):
    """The menu and the shortlist, and the edges of their ratios and windows."""
    extra = [Frequent(1.0, by), Frequent(0.01, by), Local(1.0), TOVA(1.0), Sink(1),
             SnapKV(0.3, window=4, kernel=3), SnapKV(0.02), SnapKV(1.0)]
    return list(dict.fromkeys(menu(by=by) + shortlist(by=by) + extra))


@pytest.mark.parametrize("layout", ["cache", "prompt"])
@pytest.mark.parametrize("by", ["sum", "mean"])
@pytest.mark.parametrize("seed", range(5))
def test_keeps_is_the_rule_alone_and_in_a_menu(seed, by, layout):
    fresh = random_slots(seed, layout)
    ps = policies(by)
    rule = {p: p.keep(fresh()) for p in ps}
    for p in ps:  # a union keeps what any member keeps
        members = torch.stack([m.keep(fresh()) for m in p.members()])
        assert torch.equal(rule[p], members.any(0)), p
    # Slots.keeps of a whole menu on one Slots, its rankings shared, as at prefill.
    s = fresh()
    for p in ps:
        assert torch.equal(s.keeps(p), rule[p]), p
    # Slots.keeps of one policy on its own slots, as eviction asks.
    for p in ps:
        assert torch.equal(fresh().keeps(p), rule[p]), p


def test_keeps_remembers_each_policy_and_its_members():
    fresh = random_slots(0, "cache")
    s = fresh()
    union = Special() | Frequent(0.3) | Local(0.3)
    kept = s.keeps(union)
    assert s.keeps(union) is kept
    for m in union.members():
        assert m in s.memo and torch.equal(s.memo[m], m.keep(fresh()))
