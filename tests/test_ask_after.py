"""Compress once, ask after: the prompt read again (KVzip's reconstruction)
against brute force, and what the cache does with it."""
import math

import pytest
import torch

import cache
import generation
from generation import CacheOptions, generate, read_again
from model import ModelArgs, Transformer, reserve
from profiling import READ_NORM, read_again_profile, read_again_sums
from reference import one_thread, rotation_of_fixed_bits  # noqa: F401  (autouse fixtures)
from studies.evaluate import Recorder


def norm_of_rows(p, G):
    """(K, T) from the attention (H, R, T) that R rows gave T tokens: the
    READ_NORM-norm over the rows, the most of the G query heads of a KV head."""
    norms = p.pow(READ_NORM).sum(1).pow(1 / READ_NORM)
    return norms.view(-1, G, p.shape[-1]).amax(1)


def brute_read_again(q, k, v, held_k, held_v, lens, counts):
    """Each row read again, one at a time: softmax over the context's keys and
    the rows up to its own; the output and each context token's score, the
    READ_NORM-norm over the rows of its attention, the most of the G query
    heads of its KV head."""
    B, H, R, D = q.shape
    K, T = held_k.shape[1:3]
    G = H // K
    y = torch.zeros_like(q)
    score = torch.zeros(B, K, T)
    for b in range(B):
        probs = torch.zeros(H, R, T)
        for h in range(H):
            keys = torch.cat([held_k[b, h // G, :lens[b]], k[b, h // G]])
            values = torch.cat([held_v[b, h // G, :lens[b]], v[b, h // G]])
            for i in range(int(counts[b])):
                n = int(lens[b]) + i + 1
                p = (keys[:n] @ q[b, h, i] / math.sqrt(D)).softmax(0)
                y[b, h, i] = p @ values[:n]
                probs[h, i, :lens[b]] = p[:lens[b]]
        score[b] = norm_of_rows(probs, G)
    return y, score.flatten(0, 1)


@pytest.mark.parametrize("flash", [True, False])
def test_read_again_sums_are_the_attention_of_the_context_read_again(flash, monkeypatch):
    """With torch's CPU flash kernel and with the plain softmax that stands in for it elsewhere."""
    if not flash:
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None,
                            raising=False)
    g = torch.Generator().manual_seed(1)
    B, H, K, R, T, D = 2, 6, 2, 9, 11, 8
    q, k, v = (torch.randn(B, n, R, D, generator=g) * 2 for n in (H, K, K))
    held_k, held_v = (torch.randn(B, K, T, D, generator=g) * 2 for _ in range(2))
    lens, counts = torch.tensor([11, 6]), torch.tensor([9, 4])
    held_k[1, :, 6:] = 100  # padding: junk that must not count
    want_y, want = brute_read_again(q, k, v, held_k, held_v, lens, counts)
    held = torch.arange(T) < lens[:, None]
    y, colsum = read_again_sums(q, k, v, held_k, held_v, held, counts)
    torch.testing.assert_close(colsum, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[0], want_y[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[1, :, :4], want_y[1, :, :4], atol=1e-5, rtol=1e-5)


def test_read_again_profile_is_the_scores_and_local_their_end():
    score = torch.tensor([[4.0, 1, 1, 2, 2, 0], [1, 1, 2, 0, 0, 0]])
    lens = torch.tensor([[6], [3]])
    prof = read_again_profile(score, torch.arange(6).expand(2, 6), lens, lens, [0.5])
    torch.testing.assert_close(prof.colsum, score)  # not shares: heads compare by score
    # Local(0.5) keeps the last ceil(0.5 * len) tokens: 3 of 6, 2 of 3.
    torch.testing.assert_close(prof.bands[0.5], torch.tensor(
        [[0, 0, 0, 2.0, 2, 0], [0, 1, 2, 0, 0, 0]]))
    assert prof.rows.tolist() == [1.0, 1.0]


class Masked(Recorder):
    """A layer's q, k, v from a forward whose rows see what `sees` (N, N) allows."""

    def __init__(self, sees):
        super().__init__(None)
        self.sees = sees

    def forward(self, q, k, v, input_pos, tokens):
        self.qkv = (q, k, v)
        G = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=self.sees)


def sees_part(T, s, R, n):
    """(T + R, T + R): the prompt's T rows causal; the R rows of the part from s read
    again see the first READ_SINKS of the prompt, its tokens from READ_BEFORE before s
    to s + R, and causally themselves; n of them are real, so the others see nothing but
    themselves."""
    sees = torch.ones(T + R, T + R).tril().bool()
    cols = torch.arange(T)
    sees[T:, :T] = (cols < cache.READ_SINKS) | ((cols >= s - cache.READ_BEFORE) & (cols < s + R))
    sees[T + n:, :T] = False
    return sees


@pytest.mark.parametrize("piece", [5, 16])
def test_read_again_is_the_prompt_followed_by_its_pieces(monkeypatch, piece):
    """What each layer profiles is the score that the prompt's pieces, each fed
    right after the whole prompt, give it (the most over the pieces): recorded
    from a forward of the prompt then the piece, the piece's rows seeing the
    prompt's first READ_SINKS tokens and their own part of it with the 3 before,
    times READ_WEIGHT; or, where more, the attention the prompt's last rows (all 12) gave it, summed
    over the rows, the mean of the G query heads of its KV head."""
    monkeypatch.setattr(cache, "READ_BEFORE", 3)
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny(n_layers=2)).eval()
    ids = torch.randint(1, model.args.vocab_size, (1, 12))
    T = ids.shape[1]
    got = []
    monkeypatch.setattr(cache, "read_again_profile",
                        lambda colsum, *a: got.append(colsum) or read_again_profile(colsum, *a))
    generate(model, ids.tolist(), 1, cache=CacheOptions("fastgen", ask_after=True),
             token_flags=None) if piece == 16 else None
    if piece != 16:  # the driver alone, in pieces
        caches = cache.fastgen_caches(model, cache.default_method(0.5, ask_after=True), [T], 2)
        model.setup_caches(caches)
        model(ids, torch.arange(T)[None])
        read_again(model, ids, torch.tensor([T]), piece=piece)
    want = torch.zeros(2 * model.args.n_kv_heads, T)  # (layers * K, T)
    for s in range(0, T, piece):
        part = ids[:, s:s + piece]
        R = part.shape[1]
        sees = sees_part(T, s, R, R)
        recorders = [Masked(sees) for _ in model.layers]
        model.setup_caches(recorders)
        model(torch.cat([ids, part], 1), torch.arange(T + R)[None])
        for layer, r in enumerate(recorders):
            q, k, _ = r.qkv
            G = q.shape[1] // k.shape[1]
            scores = q[0, :, T:] @ k[0].repeat_interleave(G, 0).transpose(1, 2) / math.sqrt(
                q.shape[-1])
            p = scores.masked_fill(~sees[T:], -math.inf).softmax(-1)[..., :T]  # (H, R, T)
            rows = slice(layer * k.shape[1], (layer + 1) * k.shape[1])
            want[rows] = torch.maximum(want[rows], norm_of_rows(p, G) * cache.READ_WEIGHT)
            if s == 0:  # the prompt's own rows, causal
                p = (q[0, :, :T] @ k[0, :, :T].repeat_interleave(G, 0).transpose(1, 2)
                     / math.sqrt(q.shape[-1])).masked_fill(~sees[:T, :T], -math.inf).softmax(-1)
                want[rows] = torch.maximum(want[rows], p.sum(1).view(-1, G, T).mean(1))
    model.setup_caches(None)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-4)
    assert (torch.cat(got) > 1).any()  # the last rows' sums outweigh a reading's somewhere


def test_ask_after_leaves_the_prompts_logits_and_the_policies():
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny(n_layers=2)).eval()
    prompts = [torch.randint(1, 200, (40,)).tolist(), torch.randint(1, 200, (25,)).tolist()]
    runs = {a: generate(model, prompts, 1, cache=CacheOptions("h2o", kv_budget=0.3, ask_after=a))
            for a in (False, True)}
    full = generate(model, prompts, 1)
    assert runs[True].tokens == runs[False].tokens == full.tokens  # sampled before compression
    assert runs[True].plan == runs[False].plan  # one fixed policy: what it ranks by differs


@pytest.mark.parametrize("step", ["reserve", "eager decode"])
def test_a_prompt_not_read_again_fails_loudly_before_decoding(step):
    """Decoding a cache that asks after, when the prompt was never read again, raises one
    error naming the step that was skipped, not an AttributeError deep in the pool."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny(n_layers=2)).eval()
    tokens = torch.randint(1, 200, (1, 30))
    caches = generation.make_caches(model, CacheOptions("fastgen", kv_budget=0.5, ask_after=True),
                                    [30], 4)
    model.setup_caches(caches)
    model(tokens, torch.arange(30)[None])  # a plain prefill, no read_again
    with pytest.raises(RuntimeError, match="read_again"):
        if step == "reserve":
            reserve(model.caches())
        model(tokens[:, :1], torch.tensor([[30]]))


@pytest.mark.parametrize("options, message", [
    (dict(kv="full", ask_after=True), "--ask-after"),
    (dict(kv="fastgen", paper=True, ask_after=True), "--ask-after"),
])
def test_ask_after_refuses_what_it_cannot_do(options, message):
    with pytest.raises(ValueError, match=message):
        CacheOptions(**options).check()


@pytest.mark.parametrize("bits", [None, 8])
def test_a_chunk_read_again_is_the_attention_over_the_pool(monkeypatch, bits):
    """A prompt read in two chunks: the second, read again, attends over the
    pool (which here keeps every token) as a forward of the prompt and the
    chunk again computes it, the chunk seeing the prompt's first READ_SINKS
    tokens and its own part with the 3 before. In 8 bits, the pool's keys and
    values are rotated and rounded: the same within rounding."""
    monkeypatch.setattr(cache, "READ_BEFORE", 3)
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny(n_layers=2)).eval()
    ids = torch.randint(1, model.args.vocab_size, (1, 20))
    got = []
    real = cache.reading_profiles

    def spy(self):  # what the second chunk, read again, gave each slot, laid out by position
        held = []
        for g, col in zip(self.pool.groups, self.read_scores):
            pos = g.block(self.pool.pos).long()
            got.append(torch.zeros(len(col), 20).scatter_add_(1, pos.clamp(min=0), col * (pos >= 0)))
            held.append((g.block(self.pool.score).clone(), col))
        profiles = real(self)
        for g, (score, col) in zip(self.pool.groups, held):  # the score: not weighed, where more
            torch.testing.assert_close(g.block(self.pool.score), torch.maximum(score, col))
        return profiles

    monkeypatch.setattr(cache, "reading_profiles", spy)
    generate(model, ids.tolist(), 1, cache=CacheOptions(
        "local", kv_budget=1.0, ask_after=True, prefill_chunk=12, kv_bits=bits and (bits,)))
    sees = sees_part(20, 12, 8, 8)
    recorders = [Masked(sees) for _ in model.layers]
    model.setup_caches(recorders)
    model(torch.cat([ids, ids[:, 12:]], 1), torch.arange(28)[None])
    model.setup_caches(None)
    for layer, r in enumerate(recorders):
        q, k, _ = r.qkv
        G = q.shape[1] // k.shape[1]
        scores = q[0, :, 20:] @ k[0].repeat_interleave(G, 0).transpose(1, 2) / math.sqrt(
            q.shape[-1])
        p = scores.masked_fill(~sees[20:], -math.inf).softmax(-1)
        want = norm_of_rows(p[..., :20], G)  # (K, 20)
        torch.testing.assert_close(got[layer], want, atol=1e-5 if bits is None else 3e-3,
                                   rtol=1e-4 if bits is None else 1e-2)


def test_after_reading_again_decoding_evicts_as_the_default_does():
    """A cache that read the prompt again evicts while decoding, by each head's policy, and its
    budget prices the policies' growth: a long answer fits the budget, as without the reading."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny(n_layers=2)).eval()
    prompt = torch.randint(1, 200, (1, 64))
    kept = {}
    for ask_after in (False, True):
        caches = cache.fastgen_caches(model, cache.default_method(0.25, ask_after=ask_after), [64], 40)
        model.setup_caches(caches)
        model(prompt, torch.arange(64)[None])
        if ask_after:
            read_again(model, prompt, torch.tensor([64]))
        growth = cache.growths(caches[0].policies, caches[0].slots(caches[0].pool.groups[0]))
        assert bool((growth < 1).any())
        before = [c.kept() for c in caches]
        for i in range(32):
            reserve(model.caches())
            model(torch.randint(1, 200, (1, 1)), torch.tensor([[64 + i]]))
        kept[ask_after] = [c.kept() - b for c, b in zip(caches, before)]
        model.setup_caches(None)
    S = model.args.n_kv_heads
    for ask_after in (False, True):
        assert any(k < 32 * S for k in kept[ask_after])


def test_read_again_every_layer_shares_one_knapsack(monkeypatch):
    """Read again, the heads of every layer share one knapsack, as KVzip ranks
    every head's tokens together; without the reading, those of cache.SCOPE
    layers."""
    torch.manual_seed(0)
    L = cache.SCOPE + 2
    model = Transformer(ModelArgs.tiny(n_layers=L)).eval()
    ids = torch.randint(1, model.args.vocab_size, (1, 24)).tolist()
    sizes = []
    monkeypatch.setattr(cache, "decide", lambda cs, decide=cache.decide: (
        sizes.append(len(cs)), decide(cs))[1])
    for ask_after, want in ((True, [L]), (False, [cache.SCOPE, 2])):
        sizes.clear()
        generate(model, ids, 1, cache=CacheOptions("fastgen", ask_after=ask_after),
                 token_flags=None)
        assert sizes == want


def test_a_chunk_read_by_its_lower_layers_stops_there_and_lends_the_layers_above_its_most(
        monkeypatch):
    """A chunk read again with `layers`: only those layers run the reading (the forward stops
    after the last one's attention), and each layer above scores a held token by the most any
    lower head gave that token, as a chat's later turns are read (chat.READ_LAYERS)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny(n_layers=4)).eval()
    ids = torch.randint(1, model.args.vocab_size, (1, 40))
    caches = cache.fastgen_caches(model, cache.fixed_method("local", 1.0, ask_after=True), [24], 16)
    model.setup_caches(caches)
    model(ids[:, :24], torch.arange(24)[None])
    read_again(model, ids[:, :24], torch.tensor([24]))
    reserve(caches, torch.tensor([16]))
    model(ids[:, 24:], torch.arange(24, 40)[None])
    read, ran, got = [], [], {}
    for i, layer in enumerate(model.layers):
        layer.attention.register_forward_pre_hook(lambda *_, i=i: read.append(i))
        layer.feed_forward.register_forward_hook(lambda *_, i=i: ran.append(i))
    real = cache.reading_profiles

    def spy(self):  # each layer's scores, laid out by position: (K, 40)
        by_pos = [torch.zeros(len(col), 40).scatter_add_(1, g.block(self.pool.pos).long().clamp(
            min=0), col * (g.block(self.pool.pos) >= 0)) for g, col in zip(self.pool.groups,
                                                                           self.read_scores)]
        got[caches.index(self)] = torch.cat(by_pos)
        return real(self)
    monkeypatch.setattr(cache, "reading_profiles", spy)
    read_again(model, ids[:, 24:], torch.tensor([16]), start=torch.tensor([40]), layers=2)
    assert read == [0, 1] and ran == [0]
    most = torch.maximum(got[0].amax(0), got[1].amax(0))
    assert bool((most[24:] > 0).all())
    for above in (2, 3):
        torch.testing.assert_close(got[above], most.expand_as(got[above]))
    assert not any(c.reads_next or c.reads_above or c.reads_last for c in caches)
