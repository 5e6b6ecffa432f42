"""Policies keep exactly their sets; unions, flags, the shortlist and the menu."""
import math

import pytest
import torch

from policies import (PUNCT, SPECIAL, TOVA, Frequent, Full, Local, Punct, Sink, Slots, SnapKV,
                      Special, Union, baseline, menu, shortlist, token_flags)
from tokenizer import _is_punctuation


def slots(pos, flags=None, score=None, seen=None, prompt_len=None):
    """One segment's Slots from plain lists; pos -1 marks an empty slot."""
    pos = torch.tensor([pos])
    C = pos.shape[1]
    flags = torch.tensor([flags or [0] * C], dtype=torch.uint8)
    score = torch.tensor([score or [0.0] * C])
    held = pos[pos >= 0]
    seen = torch.tensor([[seen if seen is not None else int(held.max()) + 1]])
    prompt_len = torch.tensor([[prompt_len if prompt_len is not None else int(seen)]])
    return Slots(pos, score, flags, seen, prompt_len)


def kept(policy, s):
    """The positions a policy keeps in a one-segment Slots."""
    return set(s.pos[policy.keep(s)].tolist())


# Ten slots out of position order, two of them empty (with flags and scores that
# would be kept if the slot were not empty).
POS = [3, 0, 7, -1, 9, 1, 5, -1, 8, 2]
FLAGS = [PUNCT, 0, SPECIAL, SPECIAL, PUNCT | SPECIAL, 0, PUNCT, PUNCT, 0, SPECIAL]
SCORE = [0.5, 2.0, 0.1, 9.0, 0.3, 1.5, 0.7, 9.0, 0.2, 0.9]


def example(seen=10, prompt_len=10):
    return slots(POS, FLAGS, SCORE, seen, prompt_len)


def test_special_keeps_special_tokens_and_the_first_position():
    assert kept(Special(), example()) == {7, 9, 2, 0}


def test_punct_keeps_punctuation():
    assert kept(Punct(), example()) == {3, 9, 5}


def test_sink_keeps_the_first_positions():
    assert kept(Sink(4), example()) == {0, 1, 2, 3}
    assert kept(Sink(1), example()) == {0}


def test_full_keeps_every_held_token():
    assert kept(Full(), example()) == {0, 1, 2, 3, 5, 7, 8, 9}


@pytest.mark.parametrize("r, prompt_len, window", [(0.3, 10, 3), (0.2, 10, 2), (0.25, 10, 3),
                                                   (0.5, 7, 4), (0.1, 10, 1), (0.01, 10, 1),
                                                   (1.0, 10, 10), (0.7, 10, 7), (0.6, 5, 3)])
def test_local_window_is_ceil_of_r_times_prompt_len(r, prompt_len, window):
    # ceil(0.3 * 10) must be 3 although 0.3 * 10 is 3.0000000000000004 in floats.
    s = slots(list(range(prompt_len)), seen=prompt_len, prompt_len=prompt_len)
    assert kept(Local(r), s) == set(range(prompt_len - window, prompt_len))


def test_local_window_slides_with_generation():
    # Prompt of 10, window 3; after 4 generated tokens the sequence has seen 14.
    held = [13, 2, 11, 12, -1, 10, 9, 0]
    s = slots(held, seen=14, prompt_len=10)
    assert kept(Local(0.3), s) == {11, 12, 13}


@pytest.mark.parametrize("r, seen, budget", [(0.3, 10, 3), (0.5, 10, 5), (0.2, 9, 2),
                                             (0.3, 7, 3), (0.1, 10, 1), (1.0, 10, 10)])
def test_frequent_keeps_the_top_ceil_r_seen_by_score(r, seen, budget):
    s = example(seen=seen, prompt_len=10)
    by_score = sorted(((sc, p) for p, sc in zip(POS, SCORE) if p >= 0), reverse=True)
    assert kept(Frequent(r), s) == {p for _, p in by_score[:budget]}


def test_frequent_never_keeps_empty_slots():
    # The empty slots carry the largest scores; they must not count or be kept.
    assert kept(Frequent(0.2), example()) == {0, 1}


def test_frequent_with_fewer_held_than_budget_keeps_all():
    s = slots([4, -1, 1, -1], score=[0.1, 5.0, 0.2, 5.0], seen=20, prompt_len=10)
    assert kept(Frequent(0.5), s) == {1, 4}


def test_empty_slots_are_never_kept():
    s = slots([-1, -1, -1], flags=[SPECIAL, PUNCT, SPECIAL | PUNCT], score=[1.0, 2.0, 3.0],
              seen=3, prompt_len=3)
    for policy in [Special(), Punct(), Local(1.0), Frequent(1.0), Sink(4), Full(),
                   Special() | Punct() | Frequent(1.0) | Local(1.0)]:
        assert not policy.keep(s).any(), policy


def test_keep_works_segment_by_segment():
    # Two segments with different prompt lengths and seen counts in one Slots.
    a, b = example(seen=10, prompt_len=10), slots([0, 1, 2, 3, 4, 5, -1, -1, -1, -1],
                                                  seen=6, prompt_len=6)
    both = Slots(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in
                   ("pos", "score", "flags", "seen", "prompt_len")))
    for policy in [Local(0.5), Frequent(0.3), Special() | Punct()]:
        keep = policy.keep(both)
        assert torch.equal(keep[0], policy.keep(a)[0])
        assert torch.equal(keep[1], policy.keep(b)[0])
    assert torch.equal(both[1:].pos, b.pos)


# --- Unions -------------------------------------------------------------------

def test_union_flattens_dedups_and_prints():
    u = (Special() | Punct()) | (Punct() | Frequent(0.3)) | Special()
    assert isinstance(u, Union)
    assert u.members() == (Special(), Punct(), Frequent(0.3))
    assert repr(u) == "Special | Punct | Frequent(0.3)"
    assert repr(Sink(4) | Local(0.25)) == "Sink(4) | Local(0.25)"
    assert u == Special() | Punct() | Frequent(0.3)
    assert hash(u) == hash(Special() | Punct() | Frequent(0.3))
    assert u != Special() | Frequent(0.3) | Punct()  # order is part of the shortlist
    assert Local(0.3) == Local(0.3) and Local(0.3) != Local(0.2) and Local(0.3) != Frequent(0.3)
    assert len({Local(0.3), Local(0.3), Frequent(0.3)}) == 2


def test_union_keeps_what_any_member_keeps():
    s = example(seen=12, prompt_len=10)
    members = [Special(), Punct(), Frequent(0.3), Local(0.3), Sink(2)]
    for n in range(1, len(members) + 1):
        policy = members[0]
        for m in members[1:n]:
            policy = policy | m
        expected = torch.zeros_like(s.valid)
        for m in members[:n]:
            expected |= m.keep(s)
        assert torch.equal(policy.keep(s), expected), policy
        # A token is evicted only when no member keeps it.
        for j in range(len(POS)):
            if POS[j] >= 0 and not policy.keep(s)[0, j]:
                assert not any(m.keep(s)[0, j] for m in members[:n])


# --- Mean scores, TOVA, SnapKV ------------------------------------------------

def test_mean_score_divides_by_the_queries_that_saw_the_token():
    # seen 10: token 9 was seen by 1 query, token 0 by 10; with an observation
    # window from row 6, tokens before it were seen by 4.
    s = slots([0, 5, 8, 9], score=[4.0, 2.0, 1.0, 0.5], seen=10)
    assert s.mean_score[0].tolist() == pytest.approx([0.4, 0.4, 0.5, 0.5])
    s.first_query = torch.tensor([[6]])
    assert s.mean_score[0].tolist() == pytest.approx([1.0, 0.5, 0.5, 0.5])


def test_frequent_by_mean_ranks_late_tokens_fairly_and_admits_the_newest():
    # Budget ceil(0.3 * 10) = 3. By sum, the old tokens win; by mean, token 7
    # (2.4 over 3 queries) beats token 1 (2.7 over 9), and token 9, the newest, enters.
    s = slots([0, 1, 2, 7, 9], score=[5.0, 2.7, 2.5, 2.4, 0.01], seen=10)
    assert kept(Frequent(0.3), s) == {0, 1, 2}
    assert kept(Frequent(0.3, "mean"), s) == {0, 7, 9}
    assert repr(Frequent(0.3, "mean")) == "Frequent(0.3, mean)" and repr(Frequent(0.3)) == "Frequent(0.3)"
    with pytest.raises(ValueError, match="sum' or 'mean"):
        Frequent(0.3, "max")


def test_tova_keeps_what_the_latest_query_attends_to():
    # Budget ceil(0.3 * prompt_len 10) = 3, whatever has been seen since.
    s = slots([0, 1, 2, 7, 9, 12], score=[9.0] * 6, seen=13, prompt_len=10)
    s.last = torch.tensor([[0.3, 0.01, 0.2, 0.05, 0.04, 0.4]])
    assert kept(TOVA(0.3), s) == {0, 2, 12}


def test_snapkv_keeps_the_window_and_the_pooled_top_then_every_new_token():
    # Prompt of 12, window 3 (positions 9-11), budget ceil(0.5 * 12) - 3 = 3 of
    # positions 0-8 by the score max-pooled over 3 neighbours: 4 peaks, so 3, 4, 5
    # tie at 1.0 with 3 winning the tie by slot order, then 0 and 1 (0.6 from 0).
    score = [0.6, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1]
    s = slots(list(range(12)), score=score, seen=12)
    assert kept(SnapKV(0.5, window=3, kernel=3), s) == {3, 4, 5, 9, 10, 11}
    # While decoding nothing of the compressed prompt is let go and new tokens stay.
    later = slots([3, 4, 5, 9, 10, 11, 12, 13], score=[0.0] * 8, seen=14, prompt_len=12)
    assert kept(SnapKV(0.5, window=3, kernel=3), later) == {3, 4, 5, 9, 10, 11, 12, 13}


def test_menu_holds_the_shortlist_and_every_baseline_shape():
    m = menu(0.3, 0.3, "mean", ratios=(0.2, 0.5))
    assert m[:4] == shortlist(0.3, 0.3, "mean")[:4] and Full() not in m
    for kind in ("local", "sink"):
        assert baseline(kind, 0.2) in m and baseline(kind, 0.5) in m
    assert baseline("h2o", 0.5, "mean") in m
    assert len(m) == len(set(m))


def test_what_a_cache_asks_of_a_policy():
    """The attributes a cache reads instead of a policy's class, of a union
    from its members: whether it ever evicts, keeps everything, reads the
    latest attention, the prompt rows its ranking reads, its window's share."""
    tova, snap, heavy = TOVA(0.3), SnapKV(0.3, window=8), Frequent(0.3)
    assert Full().keeps_all and Full().never_evicts and (Special() | Full()).keeps_all
    assert snap.never_evicts and not snap.keeps_all and (Punct() | snap).never_evicts
    assert not any(p.keeps_all or p.never_evicts for p in shortlist()[:-1])
    assert tova.reads_last and (Special() | tova).reads_last and not heavy.reads_last
    assert [p.rows for p in (Special(), Local(0.3), Sink(4), tova, heavy, snap)] == [
        1, 1, 1, 1, None, 8]
    assert (Sink(4) | Local(0.3)).rows == 1 and (Local(0.3) | snap).rows == 8
    assert (snap | heavy).rows is None and baseline("h2o", 0.4).rows is None
    assert Local(0.3).band == 0.3 and [m.band for m in baseline("h2o", 0.4).members()] == [None, 0.2]
    assert all(p.band is None for p in (Special(), Punct(), Sink(4), tova, heavy, snap, Full()))


# --- Flags, shortlist, baselines ------------------------------------------------

def test_token_flags_table():
    flags = token_flags(10, special_ids=[1, 2], punct_ids=iter([2, 3, 9]))
    assert flags.dtype == torch.uint8 and flags.shape == (10,)
    assert flags.tolist() == [0, SPECIAL, SPECIAL | PUNCT, PUNCT, 0, 0, 0, 0, 0, PUNCT]
    assert token_flags(4, [], []).tolist() == [0, 0, 0, 0]


def test_shortlist_order():
    s, p, f, l = Special(), Punct(), Frequent(0.3), Local(0.3)
    assert shortlist() == [s, s | p, s | p | f, s | p | f | l, Full()]
    assert [repr(x) for x in shortlist(0.2, 0.1)] == [
        "Special", "Special | Punct", "Special | Punct | Frequent(0.1)",
        "Special | Punct | Frequent(0.1) | Local(0.2)", "Full"]


def test_baselines():
    assert baseline("full", 0.5) == Full()
    assert baseline("local", 0.5) == Local(0.5)
    assert baseline("sink", 0.5) == Sink(4) | Local(0.5)
    assert baseline("h2o", 0.5) == Frequent(0.25) | Local(0.25)
    assert baseline("tova", 0.5) == TOVA(0.5)
    assert baseline("snapkv", 0.5) == SnapKV(0.5)
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline("pyramid", 0.5)


# --- Punctuation detection -------------------------------------------------------

@pytest.mark.parametrize("text, punct", [
    (".", True), (" ,", True), ("?!", True), ("...", True), (" .\n", True), ("\u3002", True),
    ("--", True), ("\u2014", True), ("\"", True), ("')", True),
    ("\n", False),    # newline-only: empty once whitespace is stripped
    ("\n\n", False), (" ", False), ("", False),
    ("a.", False), (".a", False), ("1", False), ("<0x2E>", False), ("$", False), ("+", False),
])
def test_is_punctuation(text, punct):
    assert _is_punctuation(text) is punct


def test_ceil_share_matches_exact_arithmetic():
    # Local and Frequent budgets are exact ceilings for the ratios people type.
    from fractions import Fraction
    from policies import share
    for r in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.45, 0.5, 0.7, 0.9, 1.0):
        n = torch.arange(0, 200)
        expected = [math.ceil(Fraction(str(r)) * int(i)) for i in n]
        assert share(r, n).tolist() == expected, r


def test_growth_is_the_share_of_new_tokens_held():
    # Prompt of 10: 2 special (position 0 is the sink, not counted), 3 punctuation.
    s = slots(list(range(10)), flags=[SPECIAL, 0, PUNCT, 0, PUNCT, SPECIAL, 0, PUNCT, 0, 0])
    assert Special().growth(s).tolist() == pytest.approx([0.2])
    assert Punct().growth(s).tolist() == pytest.approx([0.3])
    assert Frequent(0.25).growth(s).tolist() == [0.25]
    for fixed in (Local(0.5), Sink(4), TOVA(0.3)):
        assert fixed.growth(s).tolist() == [0.0]
    for every in (Full(), SnapKV(0.3), Frequent(0.9) | Punct() | Special()):
        assert every.growth(s).tolist() == [1.0]


@pytest.mark.parametrize("seed", range(4))
def test_top_keeps_the_largest_ties_leftmost(seed):
    """`Slots.top` against a plain sort, with many ties (the leftmost kept), empty slots, infinite
    values (the newest token's mean score), and counts from none to all; one ranking, sorted
    once, serves every count."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(100):
        N, C = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g))
        values = torch.randint(0, 4, (N, C), generator=g).float()
        if seed % 2:
            values = torch.randn(N, C, generator=g)
        values[torch.rand(N, C, generator=g) < 0.1] = math.inf
        pos = torch.arange(C).expand(N, C).masked_fill(torch.rand(N, C, generator=g) >= 0.8, -1)
        s = Slots(pos, values, torch.zeros(N, C, dtype=torch.uint8), torch.full((N, 1), C),
                  torch.full((N, 1), C))
        for k in torch.randint(0, C + 2, (3, N, 1), generator=g):
            want = torch.zeros(N, C, dtype=torch.bool)
            for n in range(N):
                held = [j for j in range(C) if pos[n, j] >= 0]
                order = sorted(held, key=lambda j: (-values[n, j].item(), j))
                want[n, order[:int(k[n])]] = True
            assert torch.equal(s.top("v", lambda: values, k), want)
        assert "v" in s.memo
