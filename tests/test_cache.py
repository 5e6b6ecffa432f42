"""The FastGen cache against brute force: profiling, kept tokens, attention
output, bit-exactness of Full(), reported bytes, and the compiled decode step."""
from dataclasses import replace

import pytest
import torch

import cache
import pool
from cache import FastGenCache, Method, fastgen_caches, scored_prompt
from generation import (CacheOptions, decode_one_token, dense_kv_bytes, generate, make_caches,
                        read_again)
from model import KVCache, ModelArgs, Transformer, reserve
from policies import (TOVA, Frequent, Full, Local, Punct, Sink, Slots, SnapKV, Special, baseline,
                      menu, shortlist, token_flags)
from profiling import (CHUNK_BYTES, Profile, attention_sums, carried, local_ratios, prompt_slots,
                       recovery, weigh)
from reference import one_thread, rotation_of_fixed_bits  # noqa: F401  (autouse fixtures)
from reference import CheckedCache, brute_recovery, drive, prompt_attention


def random_flags(vocab, seed, special=0.1, punct=0.2):
    """A token-flags table with about `special` and `punct` of the vocabulary flagged."""
    u = torch.rand(2, vocab, generator=torch.Generator().manual_seed(seed))
    ids = torch.arange(vocab)
    return token_flags(vocab, ids[u[0] < special].tolist(), ids[u[1] < punct].tolist())


# --- Profiling ----------------------------------------------------------------

PROFILED = [*shortlist(0.3, 0.3), *shortlist(0.2, 0.4, "mean")[2:4], baseline("local", 0.4),
            baseline("sink", 0.2), baseline("h2o", 0.5), Special() | Local(0.2),
            Sink(2) | Frequent(0.25), TOVA(0.4), SnapKV(0.5, window=3, kernel=3),
            Local(0.1) | Local(0.3)]


@pytest.mark.parametrize("chunk_rows", [1, 3, 5, None])
@pytest.mark.parametrize("rows", [None, 4, 5])
def test_chunked_recovery_equals_brute_force(chunk_rows, rows):
    g = torch.Generator().manual_seed(chunk_rows or 0)
    B, H, K, D, lens = 2, 6, 2, 8, [13, 7]
    G, T, S = H // K, max(lens), B * K
    q = torch.randn(B, H, T, D, generator=g) * 2
    k = torch.randn(B, K, T, D, generator=g) * 2
    q[1, :, 7:], k[1, :, 7:] = 100, -100  # padding: junk that must not count
    flags = torch.randint(0, 4, (B, T), generator=g, dtype=torch.uint8)
    lens_t = torch.tensor(lens)
    chunk_bytes = chunk_rows * B * H * T * 4 if chunk_rows else CHUNK_BYTES
    positions = torch.arange(T)
    per_seg = lambda t: t.repeat_interleave(K, dim=0)  # noqa: E731  (B, ...) -> (S, ...)
    ratios = local_ratios(PROFILED)
    prof = attention_sums(q, k, lens_t, ratios, rows, chunk_bytes)
    whole = attention_sums(q, k, lens_t, ratios, rows, chunk_bytes=1 << 40)
    torch.testing.assert_close(prof.colsum, whole.colsum, atol=1e-6, rtol=0)
    for r in ratios:
        torch.testing.assert_close(prof.bands[r], whole.bands[r], atol=1e-6, rtol=0)
    prompt = Slots(pos=per_seg(torch.where(positions < lens_t[:, None], positions, -1)),
                   score=prof.colsum, flags=per_seg(flags), seen=per_seg(lens_t[:, None]),
                   prompt_len=per_seg(lens_t[:, None]),
                   first_query=per_seg(lens_t[:, None]) - prof.rows.long()[:, None],
                   last=prof.last)
    # Brute force: the whole (G, L, L) attention matrix of each segment.
    A = {(b, h): prompt_attention(q[b, h * G:(h + 1) * G, :L], k[b, h, :L])
         for b, L in enumerate(lens) for h in range(K)}
    for policy in PROFILED:
        got = recovery(policy, prompt, prof)
        for b, L in enumerate(lens):
            for h in range(K):
                s, a = b * K + h, A[b, h]
                first = L - min(rows or L, L)
                expected_colsum = a[:, first:].sum(1).mean(0)
                torch.testing.assert_close(prof.colsum[s, :L].double(), expected_colsum,
                                           atol=1e-5, rtol=0)
                torch.testing.assert_close(prof.last[s, :L].double(), a[:, -1].mean(0),
                                           atol=1e-5, rtol=0)
                assert (prof.colsum[s, L:] == 0).all() and (prof.last[s, L:] == 0).all()
                assert prof.rows[s] == L - first
                expected = brute_recovery(policy, a, L, flags[b, :L].tolist(),
                                          expected_colsum.tolist(), rows,
                                          a[:, -1].mean(0).tolist())
                assert abs(float(got[s]) - expected) < 1e-5, (policy, b, h)
    # Full recovers everything, up to rounding.
    assert torch.allclose(got.new_ones(S), recovery(Full(), prompt, prof), atol=1e-5)


# --- The compressed cache against the masked dense reference -------------------

CASES = {
    # name: (policies, threshold)
    "shortlist-0.9": (shortlist(0.2, 0.2), 0.9),
    "shortlist-0.7": (shortlist(0.2, 0.2), 0.7),
    "shortlist-0.4": (shortlist(0.2, 0.2), 0.4),
    "shortlist-T1": (shortlist(0.2, 0.2), 1.0),
    "frequent+local": ([Frequent(0.2) | Local(0.2)], 0.0),
    "special+punct+frequent": ([Special() | Punct() | Frequent(0.2)], 0.0),
    "frequent": ([Frequent(0.2)], 0.0),
    "local": ([Local(0.2)], 0.0),
    "sink+local": ([baseline("sink", 0.2)], 0.0),
    "full": ([Full()], 0.0),
}


def test_paged_attention_is_each_segments_softmax_over_its_pages():
    g = torch.Generator().manual_seed(0)
    S, G, D, N, P = 3, 2, 8, 7, 4
    q, k, v = (torch.randn(*shape, generator=g) for shape in [(S, G, D), (N, D, P), (N, P, D)])
    owner = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    held = torch.rand(N, P, generator=g) < 0.6
    held[:, 0] = True  # every segment holds something
    held[4] = False  # a page with nothing in it
    y, last = pool.paged_attention(q, k, v, ~held, owner)
    for s in range(S):  # each segment's softmax over the slots it holds, (K transposed in pages)
        mine = held & (owner == s)[:, None]
        keys, values = k.transpose(1, 2)[mine], v[mine]  # (n, D)
        p = (q[s] @ keys.T / D ** 0.5).softmax(-1)  # (G, n)
        torch.testing.assert_close(y[s], p @ values)
        torch.testing.assert_close(last[mine], p.mean(0))
    assert (last[~held] == 0).all()
    torch.testing.assert_close(last.new_zeros(S).index_add_(0, owner, last.sum(1)),
                               torch.ones(S))  # each segment's attention sums to one


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("lens, n_heads, n_kv_heads", [([12, 20], 6, 2), ([17], 4, 4),
                                                       ([20, 13, 15], 4, 1)])
def test_cache_equals_masked_dense_reference(name, lens, n_heads, n_kv_heads):
    policies, threshold = CASES[name]
    seed = len(lens) * 100 + n_heads * 10 + n_kv_heads
    g = torch.Generator().manual_seed(seed)
    flags = random_flags(32, seed, special=0.1, punct=0.25)
    stream = torch.randint(0, 32, (len(lens), max(lens) + 30), generator=g)
    checked = drive(Method(policies, recovery=threshold), stream, lens, n_heads, n_kv_heads, 31,
                    flags, seed=seed)
    assert checked.steps == 30
    if any(Local(0.2) in p.members() for p in checked.cache.plan()) or name == "frequent":
        assert checked.ref.dropped > 0  # windows slid or heavy hitters were let go


def test_heavy_hitters_are_evicted_when_overtaken():
    """Frequent alone: some tokens once among the heavy hitters are let go later."""
    flags = random_flags(32, 0)
    stream = torch.randint(0, 32, (2, 50), generator=torch.Generator().manual_seed(0))
    checked = drive(Method([Frequent(0.2)]), stream, [14, 20], 4, 2, 31, flags)
    assert checked.ref.dropped > 0


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return Transformer(ModelArgs.tiny(**overrides)).eval()


def padded(prompts):
    lens = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    return tokens, lens


@torch.no_grad()
def greedy(model, prompts, caches, max_new_tokens):
    """Prefill and greedy decode as `generate` does; the logits that chose each token."""
    model.setup_caches(caches)
    tokens, lens = padded(prompts)
    B, T = tokens.shape
    logits = model(tokens, torch.arange(T).expand(B, T))[torch.arange(B), lens - 1]
    out = [logits]
    cur = logits.argmax(-1)[:, None]
    for i in range(max_new_tokens - 1):
        reserve(caches)
        logits = model(cur, lens[:, None] + i)[:, -1]
        out.append(logits)
        cur = logits.argmax(-1)[:, None]
    model.setup_caches(None)
    return torch.stack(out, 1)  # (B, max_new_tokens, V)


def prompts_of(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("kind", ["local", "sink", "tova"])
def test_a_policy_that_reads_no_sums_profiles_the_last_row_alone(kind):
    """A window, sinks and TOVA never read the attention summed over the prompt:
    their caches profile its last row, not every row, and decode the same."""
    model = tiny_model()
    lens, max_new = [30, 21], 8
    prompts, flags = prompts_of(lens, seed=3), random_flags(256, 0)
    caches = make_caches(model, CacheOptions(kind, kv_budget=0.3), lens, max_new, flags)
    assert all(c.method.rows == 1 for c in caches)
    every_row = fastgen_caches(model, Method([baseline(kind, 0.3)], rows=None), lens, max_new,
                               flags)
    with torch.no_grad():
        assert torch.equal(greedy(model, prompts, caches, max_new),
                           greedy(model, prompts, every_row, max_new))
    for kind in ("h2o", "snapkv"):
        assert make_caches(model, CacheOptions(kind), lens, max_new, flags)[0].method.rows != 1


@pytest.mark.parametrize("policies, threshold", [(shortlist(0.2, 0.2), 0.8),
                                                 ([baseline("h2o", 0.4)], 0.0),
                                                 ([Special() | Punct() | Local(0.2)], 0.0)],
                         ids=["shortlist", "h2o", "special+punct+local"])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_model_with_fastgen_caches_equals_reference(policies, threshold, n_kv_heads):
    """The same check through the model: every layer's cache, fed by real
    projections, positions and token ids, against its reference."""
    model = tiny_model(n_kv_heads=n_kv_heads)
    prompts, max_new = prompts_of([12, 19]), 31
    flags = random_flags(256, 1)
    caches = [CheckedCache(c) for c in fastgen_caches(model, Method(policies, recovery=threshold),
                                                       [12, 19], max_new, flags)]
    greedy(model, prompts, caches, max_new)
    assert all(c.steps == max_new - 1 for c in caches)
    assert sum(c.ref.dropped for c in caches) > 0


@pytest.mark.parametrize("evict_every", [None, 3])
@torch.no_grad()
def test_layers_reserve_together_as_each_alone(evict_every):
    """`cache.reserve` evicts and refills every layer at once (one ranking of all
    their segments, one count of free slots): step after step, the same slots,
    scores and model outputs as each layer's own `reserve`, with layers whose
    heads took different policies (TOVA's latest attention held in some)."""
    model = tiny_model(n_layers=4)
    prompts, lens, max_new = prompts_of([30, 21], seed=5), [30, 21], 40
    tokens, lens_t = padded(prompts)
    flags = random_flags(256, 2)
    policies = [TOVA(0.6), Sink(2) | Local(0.3), Frequent(0.4, "mean") | Local(0.2), Full()]

    def make():
        caches = fastgen_caches(model, Method(policies, evict_every=evict_every), lens, max_new,
                                flags)
        for c, threshold in zip(caches, (0.3, 0.6, 0.85, 0.9)):  # for plans that differ
            c.method = replace(c.method, recovery=threshold)
            c.pending = cache.Pending(1)  # each layer decides alone, under its own threshold
        return caches

    alone, together = make(), make()
    outs = []
    for caches in (alone, together):
        model.setup_caches(caches)
        outs.append(model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)))
    assert len({tuple(map(repr, c.plan())) for c in alone}) > 1  # the layers differ
    assert any("last" in c.pool.fields for c in alone)
    assert not all("last" in c.pool.fields for c in alone)
    follow = torch.randint(0, 256, (2, max_new), generator=torch.Generator().manual_seed(6))
    for i in range(max_new - 1):
        for c in alone:
            reserve([c])
        reserve(together)
        for a, b in zip(alone, together):
            for name in (*a.pool.fields, "dest", "owner"):
                assert torch.equal(getattr(a.pool, name), getattr(b.pool, name)), (i, name)
        steps = []
        for caches in (alone, together):
            model.setup_caches(caches)
            steps.append(model(follow[:, i:i + 1], lens_t[:, None] + i))
        assert torch.equal(steps[0], steps[1])
    assert sum(c.kept() for c in together) < sum(c.pool.pos.numel() for c in together)
    model.setup_caches(None)


@pytest.mark.parametrize("held", ["each alone", "two by two", "all at once"])
@torch.no_grad()
def test_layers_decide_together_as_each_alone(held, monkeypatch):
    """Under a threshold, layers that wait for each other (`Pending`) are
    profiled, ranked and scored as one batch: each layer gets the same
    recoveries, choice and pool as when it decides alone, and the model the
    same outputs."""
    model = tiny_model(n_layers=4)
    lens, max_new = [30, 21], 12
    prompts = prompts_of(lens, seed=7)
    flags = random_flags(256, 3)
    method = Method(shortlist(0.3, 0.3), recovery=0.8)  # the paper's: every row read
    sizes = []
    monkeypatch.setattr(cache, "decide", lambda cs, decide=cache.decide: (
        sizes.append(len(cs)), decide(cs))[1])

    def run(held):
        caches = fastgen_caches(model, method, lens, max_new, flags)
        if held == "each alone":
            for c in caches:
                c.pending = cache.Pending(1)
        elif held == "two by two":  # room for two layers' queries, keys and values, not three
            a, B, T = model.args, len(lens), max(lens)
            layer = B * a.head_dim * 4 * (2 * T * a.n_kv_heads
                                          + (T - caches[0].first_row) * a.n_heads)
            pending = cache.Pending(len(caches), max_bytes=layer * 5 // 2)
            for c in caches:
                c.pending = pending
        sizes.clear()
        return caches, greedy(model, prompts, caches, max_new), list(sizes)

    alone, logits, decided = run("each alone")
    assert decided == [1, 1, 1, 1]
    caches, got, decided = run(held)
    assert decided == {"each alone": [1, 1, 1, 1], "two by two": [2, 2],
                       "all at once": [4]}[held]
    assert len({repr(p) for c in alone for p in c.plan()}) > 1  # the heads differ
    for a, b in zip(alone, caches):
        assert torch.equal(a.choice, b.choice)
        torch.testing.assert_close(a.recovery, b.recovery, atol=1e-6, rtol=0)
        for name in (*a.pool.fields, "owner"):
            assert torch.equal(getattr(a.pool, name), getattr(b.pool, name)), name
    torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)
    model.setup_caches(None)


@pytest.mark.parametrize("weigh_values", [False, True])
@pytest.mark.parametrize("per", [1, 2, 4])
@torch.no_grad()
def test_a_budget_s_layers_are_profiled_as_each_alone(per, weigh_values, monkeypatch):
    """Under a budget the heads of every cache.SCOPE layers share one
    knapsack, decided once the last of them has come (the model's last layer
    closing a shorter group). Profiled in passes of `per` layers (as many as
    HELD_BYTES holds), every layer measures the recoveries it measures
    deciding alone, and the plan, pools and outputs are those of one pass."""
    L = cache.SCOPE + 2
    model = tiny_model(n_layers=L)
    lens, max_new = [30, 21], 12
    prompts = prompts_of(lens, seed=7)
    flags = random_flags(256, 3)
    method = Method(menu(), kv_budget=0.5, rows=5, weigh_values=weigh_values)
    sizes, passes = [], []
    monkeypatch.setattr(cache, "decide", lambda cs, decide=cache.decide: (
        sizes.append(len(cs)), decide(cs))[1])
    monkeypatch.setattr(cache, "attention_sums", lambda *a, f=cache.attention_sums: (
        passes.append(len(a[0])), f(*a))[1])

    def run(held_bytes=None, alone=False):
        caches = fastgen_caches(model, method, lens, max_new, flags)
        if alone:
            for c in caches:
                c.pending = cache.Pending(1)
        sizes.clear()
        passes.clear()
        if held_bytes is not None:
            a, B, T = model.args, len(lens), max(lens)
            layer = B * a.head_dim * 4 * (2 * T * a.n_kv_heads
                                          + (T - caches[0].first_row) * a.n_heads)
            monkeypatch.setattr(cache, "HELD_BYTES", layer * held_bytes)
        logits = greedy(model, prompts, caches, max_new)
        return caches, logits, list(sizes), list(passes)

    alone, _, decided, _ = run(alone=True)
    assert decided == [1] * L
    once, logits, decided, _ = run()
    assert decided == [cache.SCOPE, L - cache.SCOPE]
    caches, got, decided, profiled = run(held_bytes=per)
    assert decided == [cache.SCOPE, L - cache.SCOPE]
    B = len(lens)
    assert profiled == [B * min(per, n - i) for n in decided for i in range(0, n, per)]
    assert len({repr(p) for c in once for p in c.plan()}) > 1  # the heads differ
    for a, b, c in zip(alone, once, caches):
        torch.testing.assert_close(b.recovery, a.recovery, atol=1e-6, rtol=0)
        torch.testing.assert_close(c.recovery, b.recovery, atol=1e-6, rtol=0)
        assert torch.equal(b.choice, c.choice)
        for name in (*b.pool.fields, "owner"):
            assert torch.equal(getattr(b.pool, name), getattr(c.pool, name)), name
    torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)
    model.setup_caches(None)


# --- Full() is the dense cache ----------------------------------------------

def test_full_everywhere_matches_the_dense_cache():
    """Same greedy tokens; logits equal up to float32 rounding (the compressed
    cache sums its softmax page by page)."""
    model = tiny_model()
    a = model.args
    lens, max_new = [9, 16], 12
    prompts = prompts_of(lens, seed=3)
    dense = [KVCache(2, a.n_kv_heads, max(lens) + max_new, a.head_dim) for _ in model.layers]
    full = fastgen_caches(model, Method([Full()]), lens, max_new, random_flags(256, 0))
    expected = greedy(model, prompts, dense, max_new)
    got = greedy(model, prompts, full, max_new)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert all(c.kept() == a.n_kv_heads * sum(n + max_new - 1 for n in lens) for c in full)


def test_cache_options_run_the_core_s_methods():
    """make_caches: fastgen is the default method (the menu under a budget,
    the last 32 rows, a span of 16, values weighed), --paper the paper's
    (the shortlist under a threshold, every row, eviction after every
    token), any other kind one fixed policy; full in 16 bits or the model's
    dtype is the dense cache, in fewer bits a compressed one that keeps all."""
    model, lens = tiny_model(), [20, 12]
    caches = lambda options: make_caches(model, options, lens, 4)  # noqa: E731
    method = lambda options: caches(options)[0].method  # noqa: E731
    default = method(CacheOptions("fastgen"))
    assert default == cache.default_method(0.5)
    # Full at the end, for the heads that copy alone (tests/test_copy_heads.py).
    assert (default.policies, default.kv_budget, default.copies) == \
        ((*menu(by="mean"), Full()), 0.5, True)
    assert (default.rows, default.span, default.weigh_values) == (32, 16, True)
    # The window of newest tokens: 256 x the budget, from 32 to 128.
    assert [cache.default_method(b, (16, 8, 4)).window for b in (0.05, 0.125, 0.25, 0.5, 0.75)] \
        == [32, 32, 64, 128, 128]
    assert cache.default_method(0.125, (16, 8, 4), ask_after=True).window is None  # quant.WINDOW
    assert method(CacheOptions("fastgen", kv_budget=0.3, kv_bits=(16, 4))) == \
        cache.default_method(0.3, (16, 4))
    paper = caches(CacheOptions("fastgen", paper=True))
    assert paper[0].method == cache.paper_method(0.95) and paper[0].evict_every == 1
    assert (paper[0].policies, paper[0].method.rows) == (shortlist(), None)
    assert method(CacheOptions("fastgen", paper=True, recovery=0.8)).recovery == 0.8
    for kind in ("local", "h2o", "snapkv"):
        assert method(CacheOptions(kind, kv_budget=0.3)) == cache.fixed_method(kind, 0.3)
    assert method(CacheOptions("full", kv_bits=(4,))) == Method([Full()], [4], rows=1)
    assert isinstance(caches(CacheOptions("full", kv_bits=(16,)))[0], KVCache)
    with pytest.raises(ValueError, match="add --paper"):
        CacheOptions("fastgen", recovery=0.9).check()


def test_threshold_one_makes_every_head_full():
    model = tiny_model()
    prompts = prompts_of([9, 16], seed=4)
    flags = random_flags(256, 0)
    dense = generate(model, prompts, 12)
    gen = generate(model, prompts, 12, cache=CacheOptions("fastgen", paper=True, recovery=1.0),
                   token_flags=flags)
    assert all(p == "Full" for layer in gen.plan for p in layer)
    assert len(gen.plan) == model.args.n_layers
    assert all(len(layer) == 2 * model.args.n_kv_heads for layer in gen.plan)
    assert gen.tokens == dense.tokens


# --- Reported compression is what the tensors hold --------------------------------

def pool_bytes(cache):
    """Every tensor the cache holds, counted from the outside."""
    named = {"parts.0.k", "parts.0.v", "pos", "score", "last", "flags", "owner", "start", "width",
             "seg_prompt_len", "seg_first_query", "evicts_by", "drops_by", "dest", "free"}
    buffers = {name.removeprefix("pool."): t for name, t in cache.named_buffers()}
    if not any(p.reads_last for p in cache.plan()):
        named.remove("last")  # kept only for a policy that reads it (TOVA)
    assert set(buffers) == named | {"prompt_lens", "token_flags"}  # the last two: inputs
    assert not list(cache.parameters())
    return sum(buffers[n].nbytes for n in named)


@torch.no_grad()
def test_reported_compression_is_what_the_tensors_hold():
    model = tiny_model()
    lens, max_new = [30, 22], 16
    flags = random_flags(256, 2)
    caches = [CheckedCache(c) for c in fastgen_caches(model, Method(shortlist(), recovery=0.8),
                                                       lens, max_new, flags)]
    greedy(model, prompts_of(lens, seed=5), caches, max_new)
    for c in caches:
        assert c.cache.kept() == sum(map(len, c.ref.kept.values()))
        assert c.cache.nbytes() == pool_bytes(c.cache)
        p = c.cache.pool
        N, P, D = p.parts[0].v.shape
        assert p.parts[0].k.shape == (N, D, P)
        assert p.owner.shape == (N,)
        assert all(t.shape == (N, P) for t in (p.pos, p.score, p.flags))
        # Each group's block is as wide as its fullest segment plus one round of new
        # tokens, rounded up to a page.
        for g in c.cache.pool.groups:
            held = (c.cache.slots(g).pos >= 0).sum(1)
            assert g.pages * P - int(held.max()) < c.cache.evict_every + 2 * P
    total = sum(c.cache.nbytes() for c in caches)
    assert total < dense_kv_bytes(model, len(lens), max(lens) + max_new)


@torch.no_grad()
def test_bytes_shrink_as_the_threshold_goes_down():
    model = tiny_model()
    lens, max_new = [40], 10
    prompts = prompts_of(lens, seed=6)
    flags = random_flags(256, 3)
    dense = dense_kv_bytes(model, 1, lens[0] + max_new)
    sizes, kept = [], []
    for threshold in (1.0, 0.95, 0.8, 0.5):
        caches = fastgen_caches(model, Method(shortlist(), recovery=threshold), lens, max_new,
                                flags)
        greedy(model, prompts, caches, max_new)
        sizes.append(sum(c.nbytes() for c in caches))
        kept.append(sum(c.kept() for c in caches))
        assert sizes[-1] == sum(pool_bytes(c) for c in caches)
    assert all(a >= b for a, b in zip(sizes, sizes[1:])), sizes
    assert sizes[-1] < sizes[0] and sizes[-1] < dense, (sizes, dense)
    assert kept[-1] < kept[0]
    seen = model.args.n_layers * model.args.n_kv_heads * (lens[0] + max_new - 1)
    assert kept[0] == seen


# --- Compiled decode ------------------------------------------------------------

# Graph breaks and recompiles are decided by dynamo, before any backend runs;
# aot_eager adds functionalization of the in-place cache writes and compiles in
# about a second, where inductor takes ~20 s per cache kind on a CPU (it passes
# too: set BACKEND = "inductor" to check).
BACKEND = "aot_eager"


def fresh_compile():
    """The decode step compiled from scratch, and dynamo's counters, cleared."""
    import torch._dynamo
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch._dynamo.config.force_parameter_static_shapes = False  # as generate.compiled_decode
    return torch.compile(decode_one_token, fullgraph=True, backend=BACKEND), counters


def first_token(model, prompts):
    """Prefill through the attached caches: the greedy first token (B, 1) and the lengths."""
    tokens, lens = padded(prompts)
    B, T = tokens.shape
    logits = model(tokens, torch.arange(T).expand(B, T))[torch.arange(B), lens - 1]
    return logits.argmax(-1)[:, None], lens


@pytest.mark.parametrize("kv", ["full", "fastgen"])
def test_decode_compiles_once_without_graph_breaks(kv):
    import torch._dynamo
    model = tiny_model()
    lens, max_new = [9, 14], 6
    prompts = prompts_of(lens, seed=7)
    flags = random_flags(256, 0)
    # The shortlist at 0.75, heavy hitters by mean attention on the last 32 rows:
    # each layer of this model has two groups, one with Local, both with Frequent.
    method = Method(shortlist(by="mean"), recovery=0.75, rows=32)

    def caches():
        if kv == "full":
            return make_caches(model, CacheOptions("full"), lens, max_new, flags)
        return fastgen_caches(model, method, lens, max_new, flags)

    eager = caches()
    expected = greedy(model, prompts, eager, max_new).argmax(-1)
    if kv == "fastgen":
        assert all(len(c.pool.groups) == 2 for c in eager)
    step, counters = fresh_compile()
    with torch.no_grad():
        model.setup_caches(caches())
        cur, lens_t = first_token(model, prompts)
        out = [cur]
        reserve(model.caches())
        cur = step(model, cur, lens_t[:, None])  # compiles
        out.append(cur)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(1, max_new - 1):
                reserve(model.caches())
                cur = step(model, cur, lens_t[:, None] + i)
                out.append(cur)
        model.setup_caches(None)
    assert torch.equal(torch.cat(out, 1), expected)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()


@torch.no_grad()
def test_a_plain_loop_without_reserve_is_still_right():
    """A caller's own decode loop that never calls `reserve`: eager, each layer
    reserves by itself and the logits equal `greedy`'s (which reserves); a
    compiled step raises an error that names the call to make, never wrong
    logits."""
    model = tiny_model()
    lens, max_new = [20, 13], 24  # several evictions, with the window and heavy hitters
    prompts = prompts_of(lens, seed=8)
    flags = random_flags(256, 4)

    def caches():
        return fastgen_caches(model, Method([baseline("h2o", 0.3)], evict_every=3), lens, max_new,
                              flags)

    expected = greedy(model, prompts, caches(), max_new)
    model.setup_caches(caches())
    tokens, lens_t = padded(prompts)
    B, T = tokens.shape
    logits = model(tokens, torch.arange(T).expand(B, T))[torch.arange(B), lens_t - 1]
    out = [logits]
    for i in range(max_new - 1):
        logits = model(logits.argmax(-1)[:, None], lens_t[:, None] + i)[:, -1]
        out.append(logits)
    assert torch.equal(torch.stack(out, 1), expected)
    assert all(c.steps == max_new - 1 for c in model.caches())

    step, _ = fresh_compile()
    model.setup_caches(caches())
    cur, lens_t = first_token(model, prompts)
    reserve(model.caches())
    cur = step(model, cur, lens_t[:, None])  # with its reservation: runs
    with pytest.raises(Exception, match=r"call reserve\(model\.caches\(\)\)"):
        step(model, cur, lens_t[:, None] + 1)
    model.setup_caches(None)
    torch._dynamo.reset()


def test_fastgen_without_token_flags_runs_or_says_why():
    """`generate(..., cache=CacheOptions("fastgen"))` without a token-flags table
    either runs (no token is special or punctuation; Special still keeps
    position 0) or raises an error that names the missing argument."""
    model = tiny_model()
    try:
        gen = generate(model, prompts_of([9]), 4, cache=CacheOptions("fastgen"))
    except (ValueError, TypeError) as e:
        assert "token_flags" in str(e)
    else:
        assert len(gen.tokens[0]) == 4


def test_groups_grow_with_what_they_hold_and_compile_once():
    """Full heads hold one more token per step: their groups grow by pages as
    they fill, never by more than the rest of the generation needs, and
    compiled decode compiles once, growths included."""
    import torch._dynamo
    model = tiny_model()
    lens, max_new = [9, 14], 60
    prompts = prompts_of(lens, seed=7)
    method = Method([Full()], evict_every=3)
    expected = greedy(model, prompts, fastgen_caches(model, method, lens, max_new, page=4),
                      max_new).argmax(-1)
    step, counters = fresh_compile()
    caches = fastgen_caches(model, method, lens, max_new, page=4)
    compiled_at, grew_at = [], []
    with torch.no_grad():
        model.setup_caches(caches)
        cur, lens_t = first_token(model, prompts)
        out = [cur]
        for i in range(max_new - 1):
            growths = sum(c.growths() for c in caches)
            reserve(caches)
            if sum(c.growths() for c in caches) > growths:
                grew_at.append(i)
            graphs = counters["stats"]["unique_graphs"]
            cur = step(model, cur, lens_t[:, None] + i)
            if counters["stats"]["unique_graphs"] > graphs:
                compiled_at.append(i)
            out.append(cur)
            for c in caches:
                for g in c.pool.groups:
                    # Free slots: at most what the rest of the generation needs (a
                    # quarter of the width at most) and a round, rounded to a page.
                    free = int((c.slots(g).pos < 0).sum(1).min())
                    width = g.pages * c.page
                    assert free <= max(min(max_new - 1 - i, width // 4), c.evict_every) \
                        + c.evict_every + c.page
        model.setup_caches(None)
    assert torch.equal(torch.cat(out, 1), expected)
    assert len(grew_at) >= 2 and not counters["graph_break"]
    assert compiled_at == [0], (compiled_at, grew_at)  # the pool's size is dynamic from the start


# --- Chunks on top of a compressed cache ---------------------------------------------

@pytest.mark.parametrize("chunk", [2, 5, 16])
@pytest.mark.parametrize("n_kv_heads", [1, 2])
@pytest.mark.parametrize("ask_after", [False, True])
@torch.no_grad()
def test_full_through_chunks_equals_the_dense_cache(chunk, n_kv_heads, ask_after, monkeypatch):
    """A prompt read as a first piece (profiled, compressed) and then chunks of
    `chunk` tokens, sequences of different lengths (the shorter ones padded in
    the later chunks), then decoding: with Full everywhere, the same logits as
    the dense cache fed the same way, at every prompt token and every step.
    (A chunk's queries are attended 3 at a time here, to cover the blocks.)
    Read again (`ask_after`), a chunk's output is the fused kernel's
    (pool.chunk_output), and its rows add nothing to the scores."""
    monkeypatch.setattr(pool, "CHUNK_ROWS", 3)
    monkeypatch.setattr("model.CHUNK_ROWS", 3)  # the dense cache's chunks too
    model = tiny_model(n_kv_heads=n_kv_heads)
    a = model.args
    lens, first, max_new = [23, 14, 9], 6, 8
    prompts = prompts_of(lens, seed=11)
    tokens, lens_t = padded(prompts)
    B, T = tokens.shape
    positions = torch.arange(T).expand(B, T)
    dense = [KVCache(B, a.n_kv_heads, T + max_new, a.head_dim) for _ in model.layers]
    full = fastgen_caches(model, Method([Full()], ask_after=ask_after), lens_t.clamp(max=first),
                          max_new)
    runs = []
    for caches in (dense, full):
        model.setup_caches(caches)
        out = [model(tokens[:, :first], positions[:, :first])]
        if caches is full and ask_after:
            read_again(model, tokens[:, :first], lens_t.clamp(max=first))
        for s in range(first, T, chunk):
            counts = (lens_t - s).clamp(0, chunk)
            reserve(caches, counts)
            held = [c.pool.score.sum() for c in caches] if caches is full and ask_after else None
            out.append(model(tokens[:, s:s + chunk], positions[:, s:s + chunk]))
            if held is not None:  # not read again here: the scores stay as the reading left them
                assert [c.pool.score.sum() for c in caches] == held
        logits = torch.cat(out, 1)
        step = [logits[torch.arange(B), lens_t - 1]]
        for i in range(max_new - 1):
            reserve(caches)
            step.append(model(step[-1].argmax(-1)[:, None], lens_t[:, None] + i)[:, 0])
        mask = torch.arange(T) < lens_t[:, None]  # padding's logits are nobody's
        runs.append((logits[mask], torch.stack(step, 1)))
    model.setup_caches(None)
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-5, rtol=1e-5)
    assert all(c.kept() == a.n_kv_heads * sum(n + max_new - 1 for n in lens) for c in full)


@pytest.mark.parametrize("rows", [4, 12])
@torch.no_grad()
def test_a_chunk_chooses_again_as_a_prompt_would(rows):
    """A chunk chooses every head's policy again from its last rows over what
    the head holds. A cache that held everything (Full, chosen
    at threshold 1 on the first piece) then chooses on a chunk as profiling
    the whole prompt in one call chooses: the same recoveries of the policies
    that rank no scores, and the same plan."""
    model = tiny_model(n_kv_heads=2, n_layers=2)
    lens, first = [21, 21], 9
    tokens, lens_t = padded(prompts_of(lens, seed=13))
    flags = random_flags(256, 4)
    policies = [Special(), Special() | Punct(), Special() | Punct() | Local(0.3), Local(0.5),
                Full()]
    method = Method(policies, recovery=0.58, rows=rows)
    one_call = fastgen_caches(model, method, lens, 4, flags)
    model.setup_caches(one_call)
    model(tokens, torch.arange(21).expand(2, 21))
    chunked = fastgen_caches(model, replace(method, recovery=1.0), [first] * 2, 4, flags)
    model.setup_caches(chunked)
    model(tokens[:, :first], torch.arange(first).expand(2, first))
    assert all(p == Full() for c in chunked for p in c.plan())
    for c in chunked:
        c.method = method
    reserve(chunked, 21 - first)
    model(tokens[:, first:], torch.arange(first, 21).expand(2, 21 - first))
    model.setup_caches(None)
    for a, b in zip(one_call, chunked):
        torch.testing.assert_close(b.recovery, a.recovery, atol=1e-5, rtol=0)
        assert torch.equal(a.choice, b.choice)
    assert any(p != Full() for c in chunked for p in c.plan())  # no longer Full everywhere
    reserve(chunked)  # the chunk's eviction follows the new plan
    for a, b in zip(one_call, chunked):
        assert a.kept() == b.kept()


@pytest.mark.parametrize("method", [
    Method(shortlist(0.2, 0.2), recovery=0.6),  # every row read
    Method(shortlist(0.2, 0.2), recovery=0.8, rows=4),
    Method(menu(), kv_budget=0.4, rows=6, span=4, weigh_values=True),  # the default's options
], ids=["threshold", "threshold-rows", "budget"])
def test_chunks_choose_again_as_the_reference_does(method):
    """Each chunk that every sequence takes whole (not the one with padding)
    chooses every head's policy again, from its last rows' attention over what
    the head holds: the same recoveries and plan as the reference's, which the
    next eviction then follows."""
    chunks = [[1, 1], [6, 6], [1, 1], [4, 2], [5, 5], [1, 1]]
    stream = torch.randint(0, 32, (2, 60), generator=torch.Generator().manual_seed(21))
    checked = drive(method, stream, [12, 20], 6, 2, 30, random_flags(32, 21), seed=21,
                    chunks=chunks)
    assert checked.ref.rechosen == 2
    assert checked.cache.choice.tolist() != checked.ref.prompt_choice  # the plan moved
    assert checked.ref.dropped > 0


def test_a_span_carries_a_score_to_the_tokens_after_it():
    colsum = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    assert carried(colsum, 1) is colsum
    assert carried(colsum, 3).tolist() == [[0, 5, 5, 5, 0, 1, 1, 1]]
    # Heavy hitters of 3 tokens: the spike and the two after it, not the spike
    # and the next highest.
    prof = Profile(colsum, {}, torch.tensor([2.0]), torch.zeros_like(colsum))
    lens, flags = torch.tensor([8]), torch.zeros(1, 8, dtype=torch.uint8)
    heavy = Frequent(3 / 8, "sum")
    for span, want in ((1, {1, 5}), (3, {1, 2, 3})):
        s = prompt_slots(prof, lens, flags, 1, span=span)
        kept = set(s.pos[s.keeps(heavy)].tolist())
        assert want <= kept and len(kept) == 3


def test_weigh_counts_attention_times_the_value_norm():
    """profiling.weigh: a token's attention times its value's norm, scaled so
    that a segment's mass is still its rows read."""
    colsum = torch.tensor([[2.0, 1.0, 1.0]])
    v = torch.tensor([1.0, 3.0, 0.0])[None, None, :, None].expand(1, 1, 3, 2)  # (B, K, T, D)
    got = weigh(Profile(colsum, {0.5: colsum / 2}, torch.tensor([4.0]), colsum), v)
    torch.testing.assert_close(got.colsum, torch.tensor([[1.6, 2.4, 0.0]]))  # 2, 3, 0 times 0.8
    torch.testing.assert_close(got.bands[0.5], got.colsum / 2)
    torch.testing.assert_close(got.last, got.colsum)


@pytest.mark.parametrize("same_norms", [True, False])
@torch.no_grad()
def test_a_cache_weighs_values_as_profiling_says(same_norms):
    """With `weigh_values`, a head's recoveries are those of the weighed
    profile; where every value has the same norm, weighing changes nothing."""
    g = torch.Generator().manual_seed(3)
    B, H, K, T, D = 2, 4, 2, 24, 8
    q, k, v = torch.randn(B, H, T, D, generator=g), *torch.randn(2, B, K, T, D, generator=g)
    if same_norms:
        v = v / v.norm(dim=-1, keepdim=True)
    lens, tokens = torch.tensor([T, T - 5]), torch.randint(0, 50, (B, T), generator=g)
    flags = random_flags(50, 1)

    def build(weigh_values):
        method = Method(menu(), kv_budget=0.5, rows=6, weigh_values=weigh_values)
        c = FastGenCache(method, lens, 4, K, flags)
        c(q, k, v, torch.arange(T).expand(B, T), tokens)
        return c
    plain, weighed = build(False), build(True)
    sums = attention_sums(q, k, lens, local_ratios(menu()), 6)
    _, want = scored_prompt(plain, weigh(sums, v), tokens)
    torch.testing.assert_close(weighed.recovery, want, atol=1e-5, rtol=0)
    if same_norms:
        torch.testing.assert_close(weighed.recovery, plain.recovery, atol=1e-5, rtol=0)
        assert torch.equal(weighed.choice, plain.choice)
    else:
        assert not torch.allclose(weighed.recovery, plain.recovery, atol=1e-3)


def held_tokens(p: pool.Pool) -> dict:
    """Each segment's held tokens, by position: (positions, K, V, score) as the pool reads them."""
    keys, values = p.kv_pages()
    keys = keys.transpose(1, 2)
    held = {}
    for g in p.groups:
        pos, k, v, score = (g.block(t) for t in (p.pos, keys, values, p.score))
        for i, s in enumerate(g.rows):
            order = pos[i].argsort()[(pos[i] < 0).sum():]  # held slots, by position
            held[s] = tuple(t[i][order] for t in (pos, k, v, score))
    return held


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_compact_groups_segments_again_by_what_they_hold(bits):
    """After a chunk, heads whose policies changed hold far fewer tokens than the others of
    their group: compact groups them again (pool.group_pages) and cuts each group to its
    fullest segment plus the room asked for, moving every held token with its key, value and
    score. Kept whole, the group would stay as wide as its fullest segment."""
    g = torch.Generator().manual_seed(5)
    K, T, D, P, room = 4, 24, 8, 4, 2
    p = pool.build([0] * K, [T] * K, [0.0] * K, False, page=P, evict_every=room, new=0,
                   device="cpu", bits=None if bits is None else [bits])
    prompt = torch.arange(T).expand(K, T)
    fields = dict(pos=prompt, score=torch.rand(K, T, generator=g), last=None,
                  flags=torch.zeros(K, T, dtype=torch.uint8))
    k, v = torch.randn(2, 1, K, T, D, generator=g)
    pool.fill_from_prompt([p], fields, torch.ones(K, T, dtype=torch.bool), [(k, v)])
    block = p.groups[0].block(p.pos)
    block[:2, 3:] = -1  # two heads let go of all but their first 3 tokens
    before = held_tokens(p)
    pool.compact(p, room)
    assert sorted(sorted(g.rows) for g in p.groups) == [[0, 1], [2, 3]]
    for grp in p.groups:
        most = int((grp.block(p.pos) >= 0).sum(1).max())
        assert grp.pages == -(-(most + room) // P)  # the fullest segment plus the room
    after = held_tokens(p)
    for s in range(K):
        for x, y in zip(before[s], after[s]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert p.size == P * sum(len(grp.rows) * grp.pages for grp in p.groups) < K * T
