"""Property tests: on random token streams, policy mixes, batch shapes and GQA
ratios, the FastGen cache holds exactly what the slow reference holds and
returns the same attention, at every step."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import Method, fastgen_caches
from model import ModelArgs, Transformer
from policies import (PUNCT, SPECIAL, TOVA, Frequent, Full, Local, Punct, Sink, SnapKV, Special,
                      shortlist, token_flags)
from reference import one_thread, rotation_of_fixed_bits  # noqa: F401  (autouse fixtures)
from reference import CheckedCache, drive

# Token ids 0-7: four plain, one special, two punctuation, one both.
FLAGS = token_flags(8, special_ids=[4, 7], punct_ids=[5, 6, 7])
assert FLAGS.tolist() == [0, 0, 0, 0, SPECIAL, PUNCT, PUNCT, SPECIAL | PUNCT]

# The same examples on every run, so that a result does not depend on the draw; to explore
# further, raise max_examples and drop derandomize locally (600 + 200 examples passed).
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def policy_lists(draw):
    """A shortlist, a single fixed policy (the baselines), or a random mix, under
    a threshold or a budget; profiling over all rows or a window, each token
    scored on its own or over a span, attention counted alone or times the
    values' norms; eviction every step or every few, pages of one slot or
    many. Returns (a cache.Method, the page for FastGenCache)."""
    r_local = draw(st.sampled_from([0.1, 0.15, 0.2, 0.3, 0.5]))
    r_frequent = draw(st.sampled_from([0.1, 0.2, 0.3, 0.5]))
    by = draw(st.sampled_from(["sum", "mean"]))
    sink = draw(st.integers(1, 4))
    pool = [Special(), Punct(), Local(r_local), Frequent(r_frequent, by), Sink(sink), Full(),
            Sink(sink) | Local(r_local), Frequent(r_frequent, by) | Local(r_local),
            TOVA(r_frequent), SnapKV(round(r_local + 0.2, 2), window=sink, kernel=3), Local(r_frequent),
            *shortlist(r_local, r_frequent, by)[1:4]]
    options = dict(rows=draw(st.sampled_from([None, 1, 3, 8])),
                   span=draw(st.sampled_from([1, 1, 2, 5])), weigh_values=draw(st.booleans()),
                   evict_every=draw(st.sampled_from([1, 2, 5, 8, None])))
    page = draw(st.sampled_from([1, 3, 16]))
    kind = draw(st.sampled_from(["shortlist", "fixed", "mix"]))
    if kind == "shortlist":
        policies = shortlist(r_local, r_frequent, by)
    elif kind == "fixed":
        return Method([draw(st.sampled_from(pool))], **options), page
    else:
        policies = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5, unique=True))
    if draw(st.booleans()):
        options["kv_budget"] = draw(st.sampled_from([0.1, 0.3, 0.5, 0.8]))
    else:
        options["recovery"] = draw(st.sampled_from([0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0]))
    return Method(policies, **options), page


@st.composite
def runs(draw):
    B = draw(st.integers(1, 3))
    n_kv_heads = draw(st.integers(1, 3))
    n_heads = n_kv_heads * draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(1, 20), min_size=B, max_size=B))
    max_new_tokens = draw(st.integers(1, 40))
    width = max(lens) + max_new_tokens - 1
    # Mostly plain tokens, so that Special and Punct keep a minority.
    token = st.sampled_from([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7])
    stream = torch.tensor(draw(st.lists(st.lists(token, min_size=width, max_size=width),
                                        min_size=B, max_size=B)))
    method, page = draw(policy_lists())
    return dict(method=method, page=page, stream=stream, lens=lens,
                n_heads=n_heads, n_kv_heads=n_kv_heads, max_new_tokens=max_new_tokens,
                seed=draw(st.integers(0, 2**16)), scale=draw(st.sampled_from([0.5, 1.5, 3.0])))


@SETTINGS
@given(runs())
def test_cache_agrees_with_reference_at_every_step(run):
    checked = drive(run["method"], run["stream"], run["lens"], run["n_heads"], run["n_kv_heads"],
                    run["max_new_tokens"], FLAGS, seed=run["seed"], scale=run["scale"],
                    page=run["page"])
    assert checked.steps == run["max_new_tokens"] - 1
    cache = checked.cache
    assert cache.kept() == sum(map(len, checked.ref.kept.values()))
    assert cache.nbytes() == sum(t.nbytes for name, t in cache.named_buffers()
                                 if name not in ("prompt_lens", "token_flags"))


@settings(SETTINGS, max_examples=15)
@given(n_kv_heads=st.sampled_from([1, 2, 4]), lens=st.lists(st.integers(2, 16), min_size=1,
                                                          max_size=3),
       max_new_tokens=st.integers(2, 24), policies=policy_lists(), seed=st.integers(0, 2**16))
def test_model_caches_agree_with_reference(n_kv_heads, lens, max_new_tokens, policies, seed):
    """Through the tiny model: real projections, positions and token ids."""
    method, page = policies
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.tiny(n_kv_heads=n_kv_heads, vocab_size=8)).eval()
    caches = [CheckedCache(c) for c in fastgen_caches(model, method, lens, max_new_tokens, FLAGS,
                                                       page=page)]
    model.setup_caches(caches)
    B, T = len(lens), max(lens)
    tokens = torch.randint(0, 8, (B, T))
    lens_t = torch.tensor(lens)
    with torch.no_grad():
        logits = model(tokens, torch.arange(T).expand(B, T))[torch.arange(B), lens_t - 1]
        cur = logits.argmax(-1)[:, None]
        for i in range(max_new_tokens - 1):
            cur = model(cur, lens_t[:, None] + i)[:, -1].argmax(-1)[:, None]
    model.setup_caches(None)
    assert all(c.steps == max_new_tokens - 1 for c in caches)


@settings(SETTINGS, max_examples=40)
@given(runs(), st.data())
def test_chunks_agree_with_reference(run, data):
    """Chunks of several tokens between decode steps, some sequences taking
    fewer than others (the rest padding): the cache holds what the reference
    holds having taken the tokens one by one with eviction deferred to the
    chunk's end, with the same scores and outputs, at every step."""
    B = len(run["lens"])
    sizes = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    ragged = data.draw(st.booleans())
    chunks = [[n] + [data.draw(st.integers(0, n)) if ragged else n for _ in range(B - 1)]
              for n in sizes]
    chunks.append([1] * B)  # a decode step: the last chunk's eviction checked too
    width = max(run["lens"]) + sum(map(max, chunks))
    stream = torch.randint(0, 8, (B, width), generator=torch.Generator().manual_seed(run["seed"]))
    checked = drive(run["method"], stream, run["lens"], run["n_heads"], run["n_kv_heads"],
                    run["max_new_tokens"], FLAGS, seed=run["seed"], scale=run["scale"],
                    chunks=chunks, page=run["page"])
    read = [n + sum(c[b] for c in chunks[:-1] if c != [1] * B) for b, n in enumerate(run["lens"])]
    assert checked.cache.seg_prompt_len.tolist() == [n for n in read
                                                     for _ in range(run["n_kv_heads"])]
    assert checked.cache.kept() == sum(map(len, checked.ref.kept.values()))
