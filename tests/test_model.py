"""The Llama against HF transformers, and cached decoding against a full forward."""
import pytest
import torch

from model import Cache, KVCache, ModelArgs, Transformer, load_model, reserve

CONFIGS = {
    "multi-head": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True),
    "llama3-rope": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64),
                        rope_theta=500000.0),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(tiny_hf, name):
    from transformers import LlamaForCausalLM
    path = tiny_hf(**CONFIGS[name])
    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours(tokens, torch.arange(40).expand(2, 40))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def attach_dense(model, batch, max_len):
    a = model.args
    model.setup_caches([KVCache(batch, a.n_kv_heads, max_len, a.head_dim) for _ in model.layers])


def test_cached_decode_equals_full_forward():
    """The dense cache, reserved before each step as every cache is (`reserve`,
    which it needs not: it was sized up front)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny()).eval()
    tokens = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        full = model(tokens, torch.arange(24)[None])
        attach_dense(model, 1, 32)
        assert all(isinstance(c, Cache) for c in model.caches())
        steps = [model(tokens[:, :10], torch.arange(10)[None])]
        for t in range(10, 24):
            reserve(model.caches())
            steps.append(model(tokens[:, t:t + 1], torch.tensor([[t]])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_logits_at_projects_only_the_rows_asked_for():
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny()).eval()
    tokens = torch.randint(0, 256, (3, 12))
    at = torch.tensor([11, 4, 7])
    with torch.no_grad():
        full = model(tokens, torch.arange(12).expand(3, 12))
        some = model(tokens, torch.arange(12).expand(3, 12), logits_at=at)
    assert some.shape == (3, 1, full.shape[-1])
    torch.testing.assert_close(some[:, 0], full[torch.arange(3), at], atol=1e-5, rtol=1e-5)


def test_batch_of_different_lengths_equals_each_alone():
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny()).eval()
    lens = [5, 12, 9]
    prompts = [torch.randint(0, 256, (n,)) for n in lens]
    nxt = torch.randint(0, 256, (3, 4))
    T = max(lens)
    padded = torch.zeros(3, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    with torch.no_grad():
        refs = [model(torch.cat([p, nxt[b]])[None], torch.arange(len(p) + 4)[None])[0]
                for b, p in enumerate(prompts)]
        attach_dense(model, 3, T + 4)
        out = model(padded, torch.arange(T).expand(3, T))
        pos = torch.tensor(lens)[:, None]
        dec = [model(nxt[:, i:i + 1], pos + i)[:, 0] for i in range(4)]
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b, n - 1], refs[b][n - 1], atol=1e-5, rtol=1e-5)
        for i in range(4):
            torch.testing.assert_close(dec[i][b], refs[b][n + i], atol=1e-5, rtol=1e-5)


def test_chunks_on_top_of_the_cache_equal_one_forward():
    """A chat's next turn: chunks of several tokens (and single ones) written on top of what the
    cache holds, each sequence of the batch at its own positions."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.tiny()).eval()
    tokens = torch.randint(0, 256, (2, 70))
    with torch.no_grad():
        full = model(tokens, torch.arange(70).expand(2, 70))
        attach_dense(model, 2, 100)
        parts = [model(tokens[:, a:b], torch.arange(a, b).expand(2, b - a))
                 for a, b in [(0, 30), (30, 31), (31, 64), (64, 70)]]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_no_top_level_module_shadows_a_package_transformers_imports():
    """Run from the project's root, as users do, transformers' Llama still imports: no top-level
    module takes the name of a package the ecosystem imports (`kernels`, `profile`, ...)."""
    import pathlib
    import subprocess
    import sys
    pytest.importorskip("transformers")
    root = pathlib.Path(__file__).resolve().parent.parent
    shadows = {"kernels", "profile", "tokenizers", "safetensors", "accelerate", "gguf"}
    assert not shadows & {p.stem for p in root.glob("*.py")}
    run = subprocess.run([sys.executable, "-c", "from transformers import LlamaForCausalLM"],
                         cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
