"""On a CUDA GPU the answers are the CPU's: the golden greedy output, both caches, the
compiled decode step (also replayed as a CUDA graph), and bfloat16 runs. Skipped without
a GPU; studies/gpu_check.sh runs it."""
import pytest
import torch

from generate import main
from generation import CacheOptions, flags_of, generate, load
from test_generate import GOLDEN

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda"
PROMPTS = ["Hello, world", "The quick brown fox jumps over the lazy dog."]


def test_golden_greedy_output(tiny_ckpt):
    gen = main("Hello, world", ckpt=str(tiny_ckpt), max_new_tokens=12, device=DEVICE)
    assert gen.tokens == [GOLDEN]


@pytest.mark.parametrize("kv", ["full", "fastgen"])
def test_same_tokens_plan_and_bytes_as_the_cpu(tiny_ckpt, kv):
    # float32 on both: the few-ulp differences of the GPU's kernels do not flip a greedy
    # token or a policy choice of this model (were one to, the tokens would say where).
    kw = dict(ckpt=str(tiny_ckpt), max_new_tokens=8, cache=CacheOptions(kv))
    cpu, gpu = main(PROMPTS, **kw), main(PROMPTS, device=DEVICE, **kw)
    assert (gpu.tokens, gpu.plan, gpu.kv_bytes) == (cpu.tokens, cpu.plan, cpu.kv_bytes)


@pytest.mark.parametrize("kv, mode", [("full", None), ("fastgen", None),
                                      ("full", "reduce-overhead")])
def test_compiled_decode_equals_eager(tiny_ckpt, kv, mode):
    model, tok = load(str(tiny_ckpt), device=DEVICE)
    prompts, flags = [tok.encode(p) for p in PROMPTS], flags_of(model, tok)
    cache = CacheOptions(kv)
    eager = generate(model, prompts, 8, cache=cache, token_flags=flags)
    compiled = generate(model, prompts, 8, cache=cache, token_flags=flags, compile=True,
                        compile_options=dict(mode=mode))
    assert compiled.tokens == eager.tokens and compiled.compile_s > 0


@pytest.mark.parametrize("kv", ["full", "fastgen"])
def test_bfloat16_runs(tiny_ckpt, kv):
    gen = main(PROMPTS, ckpt=str(tiny_ckpt), max_new_tokens=8, cache=CacheOptions(kv),
               device=DEVICE, dtype="bfloat16")
    assert all(1 <= len(t) <= 8 for t in gen.tokens) and gen.kv_bytes > 0
