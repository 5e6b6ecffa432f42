"""FastGen inside transformers (hf.py): tiny random Llama, Qwen2 and Mistral models of
transformers, against transformers' own DynamicCache and against our Llama."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf  # noqa: E402
from cache import fastgen_caches, fixed_method  # noqa: E402
from generation import CacheOptions, flags_of, generate, prefill_logits  # noqa: E402
from model import load_model, reserve  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny(family: str, seed: int = 0, **config):
    import transformers as t
    Config, Model = {"llama": (t.LlamaConfig, t.LlamaForCausalLM),
                     "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
                     "mistral": (t.MistralConfig, t.MistralForCausalLM)}[family]
    extra = {"mistral": dict(sliding_window=None)}.get(family, {})
    torch.manual_seed(seed)
    return Model(Config(**(TINY | extra | config))).eval()


def forced(model, caches, prompt, follow):
    """Teacher-forced logits (1, N, V) of an HFModel through `caches`, decoded step by step."""
    model.setup_caches(caches)
    lens = torch.tensor([len(prompt)])
    out = [prefill_logits(model, torch.tensor([prompt]), lens)]
    for i in range(len(follow) - 1):
        reserve(model.caches())
        out.append(model(torch.tensor([[follow[i]]]), (lens + i)[:, None])[:, 0])
    model.setup_caches(None)
    return torch.stack(out, 1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_full_on_every_head_matches_dynamic_cache(family, gqa):
    """Full() on every head, a FastGenCache, and the dense KVCache under transformers: the
    same greedy 64 tokens as transformers' generate (DynamicCache, sdpa), logits within 1e-4."""
    model = tiny(family, num_key_value_heads=4 // gqa, attention_bias=family == "qwen2")
    prompt = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    want = model.generate(prompt, max_new_tokens=64, do_sample=False, min_new_tokens=64)
    got = model.generate(prompt, max_new_tokens=64, do_sample=False, min_new_tokens=64,
                         custom_generate=hf.generate, kv=CacheOptions("full"))
    assert torch.equal(got, want)
    assert model.config._attn_implementation != hf.ATTENTION  # given back as it was
    reference = model(want).logits[:, prompt.shape[1] - 1:-1]  # teacher-forced, sdpa
    model.set_attn_implementation(hf.ATTENTION)
    m = hf.HFModel(model)
    follow = want[0, prompt.shape[1]:].tolist()
    full = fastgen_caches(m, fixed_method("full"), [prompt.shape[1]], len(follow))
    logits = forced(m, full, prompt[0].tolist(), follow)
    assert (logits - reference).abs().max() < 1e-4
    assert torch.equal(logits.argmax(-1)[0], want[0, prompt.shape[1]:])


def test_batches_of_mixed_lengths_pad_on_either_side():
    """A left-padded batch gives each prompt what it gives alone, compressed."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g) for n in (40, 25, 33)]
    kv = CacheOptions("fastgen", kv_budget=0.5)
    ids = torch.zeros(3, 40, dtype=torch.long)
    mask = torch.zeros(3, 40, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 40 - len(p):], mask[b, 40 - len(p):] = p, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                           custom_generate=hf.generate, kv=kv, pad_token_id=0)
    for b, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=12, do_sample=False,
                               custom_generate=hf.generate, kv=kv)
        assert batch[b, 40:].tolist() == alone[0, len(p):].tolist()


def test_transformers_prefill_chunk_size_reads_the_prompt_in_chunks():
    model = tiny("qwen2", attention_bias=True)
    prompt = torch.randint(3, 256, (1, 50), generator=torch.Generator().manual_seed(3))
    kv = CacheOptions("fastgen", kv_budget=0.5)
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, prefill_chunk_size=16,
                            custom_generate=hf.generate, kv=kv)
    ours = model.generate(prompt, max_new_tokens=12, do_sample=False, custom_generate=hf.generate,
                          kv=CacheOptions("fastgen", kv_budget=0.5, prefill_chunk=16))
    whole = model.generate(prompt, max_new_tokens=12, do_sample=False,
                           custom_generate=hf.generate, kv=kv)
    assert torch.equal(theirs, ours)
    assert not torch.equal(ours, whole)  # chunks choose again: not the whole prompt's plan


CONFIGS = {"full": CacheOptions("full"),
           "fastgen 0.5": CacheOptions("fastgen", kv_budget=0.5),
           "16/8/4 at 0.25": CacheOptions("fastgen", kv_budget=0.25, kv_bits=(16, 8, 4)),
           "ask-after 0.25": CacheOptions("fastgen", kv_budget=0.25, ask_after=True),
           "chunks of 16": CacheOptions("fastgen", kv_budget=0.5, prefill_chunk=16),
           "h2o": CacheOptions("h2o", kv_budget=0.5),
           "paper": CacheOptions("fastgen", paper=True)}


@pytest.mark.parametrize("name", CONFIGS)
def test_same_plan_tokens_and_bytes_as_our_llama(tiny_ckpt, name):
    """One checkpoint, run by our Llama and by transformers' under our caches: the same
    tokens, plans, kept tokens and bytes."""
    tok = Tokenizer(tiny_ckpt)
    ours = load_model(tiny_ckpt)
    theirs, _ = hf.load(str(tiny_ckpt))
    flags = flags_of(ours, tok)
    texts = ["The quick brown fox jumps over the lazy dog. " * 4, "Hello, world! " * 6,
             "Numbers: 12345, 3.14; and (parentheses). " * 3]
    prompts = [tok.encode(t) for t in texts]
    a = generate(ours, prompts, 16, cache=CONFIGS[name], token_flags=flags)
    b = generate(theirs, prompts, 16, cache=CONFIGS[name], token_flags=flags)
    assert a.tokens == b.tokens
    assert (a.plan, a.kept_tokens, a.kv_bytes) == (b.plan, b.kept_tokens, b.kv_bytes)


def test_flags_from_a_tokenizer_of_transformers(tiny_ckpt):
    from transformers import AutoTokenizer
    ours, theirs = Tokenizer(tiny_ckpt), AutoTokenizer.from_pretrained(tiny_ckpt)
    V = ours.vocab_size
    model = load_model(tiny_ckpt)
    assert torch.equal(hf.flags(theirs, V), flags_of(model, ours))


def test_models_it_cannot_run_say_why():
    import transformers as t
    gpt2 = t.GPT2LMHeadModel(t.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                          bos_token_id=0, eos_token_id=0))
    with pytest.raises(hf.UnsupportedModel, match="model_type 'gpt2' is not supported"):
        hf.HFModel(gpt2)
    sliding = tiny("mistral", sliding_window=16)
    with pytest.raises(hf.UnsupportedModel, match="sliding window of 16"):
        hf.HFModel(sliding)
    model = tiny("llama")
    with pytest.raises(RuntimeError, match="attn_implementation=hf.ATTENTION"):
        hf.HFModel(model)(torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None])


def test_without_transformers_one_line_says_how_to_install():
    code = "import sys; sys.modules['transformers'] = None; import hf"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert "pip install -r requirements-hf.txt" in run.stderr.splitlines()[-1]


def test_cli_runs_a_folder_through_transformers(tiny_ckpt):
    run = subprocess.run([sys.executable, "generate.py", "--hf", str(tiny_ckpt), "--prompt",
                          "Hello, world!", "--max-new-tokens", "8", "--kv", "fastgen"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ours = subprocess.run([sys.executable, "generate.py", "--ckpt", str(tiny_ckpt), "--prompt",
                           "Hello, world!", "--max-new-tokens", "8", "--kv", "fastgen"],
                          cwd=ROOT, capture_output=True, text=True)
    assert run.stdout.splitlines()[0] == ours.stdout.splitlines()[0]


def gpt2_folder(path):
    import transformers as t
    config = t.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0,
                          eos_token_id=0)
    t.GPT2LMHeadModel(config).save_pretrained(path)


@pytest.mark.parametrize("case, message", [
    ("sliding", "this mistral model attends over a sliding window of 16 tokens, which FastGen's "
                "caches do not implement"),
    ("gpt2", "model_type 'gpt2' is not supported: FastGen runs Llama, Qwen2 and Mistral models "
             "of transformers"),
    ("no transformers", "hf.py runs models of transformers, which is not installed: "
                        "pip install -r requirements-hf.txt")])
def test_cli_refuses_what_it_cannot_run_in_one_line(tmp_path, tiny_ckpt, case, message):
    folder = tiny_ckpt if case == "no transformers" else tmp_path
    if case == "sliding":
        tiny("mistral", sliding_window=16).save_pretrained(folder)
    elif case == "gpt2":
        gpt2_folder(folder)
    hide = "sys.modules['transformers'] = None; " if case == "no transformers" else ""
    code = f"import sys; {hide}import generate; sys.exit(generate.cli(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", code, "--hf", str(folder), "--prompt", "Hi"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [f"error: {message}"]
