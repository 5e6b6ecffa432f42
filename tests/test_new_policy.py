"""A new policy is one class: defined here alone, it runs through profiling, the menu and the
knapsack, compression, eviction while decoding, and `--kv`, with no core file changed.

The example is kvpress's KnormPress (Devoto et al., 2024): keep the tokens whose keys have
the smallest norm. It reads a per-token field no core policy reads, the key's norm."""
import math

import pytest
import torch

import policies
from cache import Method, default_method, fastgen_caches
from generation import CacheOptions, generate
from model import ModelArgs, Transformer, reserve
from policies import Local, Policy, Special, share


class KeyNorm(Policy):
    """The ceil(r * seen) tokens whose keys have the smallest L2 norm."""

    token_fields = {"key_norm": lambda k, v: k.float().norm(dim=-1)}

    def __init__(self, r: float):
        self.r = r

    def keep(self, s):
        return s.top(("key_norm",), lambda: -s.fields["key_norm"], share(self.r, s.seen))

    def growth(self, prompt):
        return prompt.pos.new_full((prompt.pos.shape[0],), self.r, dtype=torch.float32)


def tiny(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelArgs.tiny(n_layers=2, n_heads=4, n_kv_heads=2)).eval()


class Keys(torch.nn.Module):
    """Wraps a layer's cache and notes every key it is handed, (B, K, T, D) a call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, q, k, v, input_pos, tokens):
        self.seen.append(k.clone())
        return self.inner(q, k, v, input_pos, tokens)


@torch.no_grad()
def test_a_new_policy_evicts_by_its_own_field_while_decoding():
    """Evicting every step, each head holds exactly the ceil(r * seen) smallest-norm keys of
    those it held and the newest: the rule replayed here on the keys the cache was handed."""
    model = tiny()
    r, n_prompt, new = 0.3, 20, 12
    method = Method([KeyNorm(r)], evict_every=1)
    caches = fastgen_caches(model, method, [n_prompt], new + 1)
    watched = [Keys(c) for c in caches]
    for layer, w in zip(model.layers, watched):
        layer.attention.kv_cache = w
    tokens = torch.randint(1, 200, (1, n_prompt + new))
    model(tokens[:, :n_prompt], torch.arange(n_prompt)[None])
    for i in range(new):
        reserve(caches)
        model(tokens[:, n_prompt + i:n_prompt + i + 1], torch.tensor([[n_prompt + i]]))
    reserve(caches)  # the last step's eviction
    seen = n_prompt + new
    for c, w in zip(caches, watched):
        norms = torch.cat([k.float().norm(dim=-1) for k in w.seen], 2)[0]  # (K, seen)
        for head in range(norms.shape[0]):
            held = set(range(n_prompt))
            held = set(sorted(held, key=lambda j: (norms[head, j], j))[:share(r, torch.tensor(
                n_prompt)).item()])
            for t in range(n_prompt, seen):
                held.add(t)
                held = set(sorted(held, key=lambda j: (norms[head, j], j))[:math.ceil(
                    r * (t + 1) - 1e-9)])
            g = next(g for g in c.pool.groups if head in g.rows)
            row = g.rows.index(head)
            pos = g.block(c.pool.pos)[row]
            assert set(pos[pos >= 0].tolist()) == held
            stored = g.block(c.pool.key_norm)[row][pos >= 0]
            torch.testing.assert_close(stored, norms[head, pos[pos >= 0]])


@torch.no_grad()
def test_a_new_policy_joins_the_menu_the_knapsack_and_the_command_line(monkeypatch):
    """Registered by name, it is a `--kv` choice and on the default's menu; offered against a
    cheap rival, the knapsack gives it heads; the cache's bytes count its field."""
    monkeypatch.setitem(policies.FIXED, "knorm", lambda budget, by: KeyNorm(budget))
    assert KeyNorm(0.3) in policies.menu() and KeyNorm(0.05) in policies.menu()
    model = tiny(1)
    prompts = [torch.randint(1, 200, (40,)).tolist(), torch.randint(1, 200, (31,)).tolist()]
    CacheOptions("knorm", kv_budget=0.4).check()
    fixed = generate(model, prompts, 10, cache=CacheOptions("knorm", kv_budget=0.4))
    assert {name for layer in fixed.plan for name in layer} == {"KeyNorm(0.4)"}
    assert 0 < fixed.kept_tokens < fixed.seen_tokens
    default = generate(model, prompts, 10, cache=CacheOptions("fastgen", kv_budget=0.5))
    offered = default_method(0.5).policies
    assert KeyNorm(0.3) in offered and len(default.recovery[0][0]) == len(offered)  # profiled

    # The knapsack: KeyNorm at two sizes against Special alone, under half the bytes.
    method = Method([Special(), KeyNorm(0.3), KeyNorm(0.6)], kv_budget=0.5, rows=8)
    caches = fastgen_caches(model, method, [len(p) for p in prompts], 10)
    model.setup_caches(caches)
    tokens = torch.zeros(2, 40, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    model(tokens, torch.arange(40).expand(2, 40))
    chosen = {repr(p) for c in caches for p in c.plan()}
    assert chosen & {"KeyNorm(0.3)", "KeyNorm(0.6)"}
    for c in caches:  # every kept token's norm was stored beside it
        assert "key_norm" in c.pool.fields
        pos = c.pool.pos
        assert (c.pool.key_norm[pos >= 0] > 0).all()
    model.setup_caches(None)


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_new_policy_under_local_windows_and_chunks(chunk):
    """In a union with a core policy, read in chunks: the union keeps what either member keeps."""
    model = tiny(2)
    prompts = [torch.randint(1, 200, (50,)).tolist()]
    method = Method([KeyNorm(0.2) | Local(0.1), KeyNorm(0.4)], kv_budget=0.5, rows=8)
    gen = generate(model, prompts, 8, cache=CacheOptions("full"))  # the dense reference runs
    assert gen.tokens
    caches = fastgen_caches(model, method, [chunk or 50], 8)
    model.setup_caches(caches)
    tokens = torch.tensor(prompts)
    if chunk:
        model(tokens[:, :chunk], torch.arange(chunk)[None])
        for s in range(chunk, 50, chunk):
            reserve(model.caches(), min(chunk, 50 - s))
            model(tokens[:, s:s + chunk], torch.arange(s, min(s + chunk, 50))[None])
    else:
        model(tokens, torch.arange(50)[None])
    for _ in range(3):
        reserve(model.caches())
        model(tokens[:, -1:], torch.tensor([[50 + _]]))
    for c in caches:
        assert c.kept() > 0
        assert "key_norm" in c.pool.fields
    model.setup_caches(None)
