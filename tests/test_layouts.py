"""studies.layouts: both layouts run, and they must generate the same tokens."""
import pool
from generation import flags_of, load
from studies.layouts import decode_speeds


def test_both_layouts_time_the_same_generation(tiny_ckpt, monkeypatch):
    model, tok = load(str(tiny_ckpt))
    built, build = [], pool.build

    def spy(*a, **k):
        p = build(*a, **k)
        built.append(type(p))
        return p

    monkeypatch.setattr(pool, "build", spy)
    speeds = decode_speeds(model, flags_of(model, tok), [list(range(3, 40))], 6, 1)
    assert [len(s) for s in speeds.values()] == [2, 2]
    assert all(s > 0 for runs in speeds.values() for s in runs)
    # The default lays this small pool out masked; the other runs had every pool paged.
    assert {pool.MaskedPool, pool.PagedPool} <= set(built)
    assert pool.attends_masked is not None and pool.attends_masked(1, 1, 1)  # restored
