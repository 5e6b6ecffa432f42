"""FastGen inside HF transformers: a Llama, Qwen2 or Mistral model of transformers, its KV cache
kept by our caches, each head's evicted tokens freed.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    import hf
    from generation import CacheOptions
    model, tok = AutoModelForCausalLM.from_pretrained(DIR), AutoTokenizer.from_pretrained(DIR)
    out = model.generate(ids, max_new_tokens=64, custom_generate=hf.generate,
                         kv=CacheOptions("fastgen", kv_budget=0.5), token_flags=hf.flags(tok))

How. transformers calls the attention function its config names (`AttentionInterface`). Ours,
`attention`, hands each layer's queries, keys and values, RoPE applied, to that layer's cache
(model.KVCache or cache.FastGenCache), which holds what it keeps and attends over it. No mask
function is registered under its name, so transformers builds no mask: the caches know every
sequence's positions. `HFModel` gives the model model.Transformer's interface, so generation.py's
loop (prefill in chunks, reading again, decoding) runs over it unchanged, and `generate` is that
loop in the place of `model.generate`'s sampling, the model attending by `attention` meanwhile.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

try:
    from transformers import AttentionInterface
except ImportError:
    raise ImportError("hf.py runs models of transformers, which is not installed: "
                      "pip install -r requirements-hf.txt") from None

import generation
from model import ModelArgs, causal_attention
from policies import token_flags
from tokenizer import _is_punctuation

ATTENTION = "fastgen"  # the attn_implementation that hands attention to our caches
FAMILIES = ("llama", "qwen2", "mistral")


class UnsupportedModel(ValueError):
    """A model this bridge cannot run; the message says why."""


def attention(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function: q (B, H, T, D), k, v (B, K, T, D) of layer
    `module.layer_idx` to its cache, which `HFModel.forward` passes as `fastgen`. Returns
    (B, T, H, D), as transformers' own do, and no weights."""
    if "fastgen" not in kwargs:
        raise RuntimeError(f"attn_implementation {ATTENTION!r} runs under hf.generate or "
                           "hf.HFModel, which hand it the caches")
    caches, tokens = kwargs["fastgen"]
    cache = caches[module.layer_idx]
    if cache is None:
        y = causal_attention(q, k, v)
    else:
        y = cache(q, k, v, kwargs["position_ids"], tokens)
    return y.transpose(1, 2), None


AttentionInterface.register(ATTENTION, attention)


def check(config) -> None:
    """Raise UnsupportedModel unless every layer attends as our caches do: causal softmax
    attention over all it holds, scaled by 1 / sqrt(head_dim)."""
    kind = config.model_type
    if kind not in FAMILIES:
        raise UnsupportedModel(f"model_type {kind!r} is not supported: FastGen runs Llama, Qwen2 "
                               "and Mistral models of transformers")
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    if (sliding or kind == "mistral") and window and window < config.max_position_embeddings:
        raise UnsupportedModel(f"this {kind} model attends over a sliding window of {window} "
                               "tokens, which FastGen's caches do not implement")


class HFModel(nn.Module):
    """A causal LM of transformers with model.Transformer's interface: `forward(tokens,
    input_pos, logits_at)`, one cache per layer (`setup_caches`, `caches`), `args`, `layers`
    and `tok_embeddings`. It shares the model's weights."""

    def __init__(self, model):
        super().__init__()
        c = model.config
        check(c)
        self.hf = model
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.args = ModelArgs(dim=c.hidden_size, n_layers=c.num_hidden_layers,
                              n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                              head_dim=head_dim, vocab_size=c.vocab_size,
                              ffn_dim=c.intermediate_size, max_seq_len=c.max_position_embeddings)
        self.layers = model.model.layers
        self.tok_embeddings = model.get_input_embeddings()
        self._caches = [None] * len(self.layers)

    def setup_caches(self, caches):
        self._caches = [None] * len(self.layers) if caches is None else list(caches)

    def caches(self):
        return self._caches

    def forward(self, tokens, input_pos, logits_at=None):
        """As model.Transformer.forward: logits (B, T, V) in float32, or (B, 1, V) at
        `logits_at`."""
        if self.hf.config._attn_implementation != ATTENTION:
            raise RuntimeError(f"the model attends by {self.hf.config._attn_implementation!r}: "
                               f"load it with attn_implementation=hf.ATTENTION, or generate "
                               "with hf.generate")
        x = self.hf.model(input_ids=tokens, position_ids=input_pos, use_cache=False,
                          fastgen=(self._caches, tokens)).last_hidden_state
        if logits_at is not None:
            x = x[torch.arange(len(x), device=x.device), logits_at][:, None]
        return self.hf.lm_head(x).float()


def wrapped(model) -> HFModel:
    """The model's HFModel, made once and kept in the model's own __dict__ (not a submodule):
    the heads that copy are probed once per model (cache.copy_heads), and the two are freed
    together."""
    if "_fastgen" not in model.__dict__:
        model.__dict__["_fastgen"] = HFModel(model)
    return model.__dict__["_fastgen"]


def flags(tokenizer, vocab_size: int | None = None) -> torch.Tensor:
    """(V,) SPECIAL / PUNCT bits of every token id (policies.token_flags) from a tokenizer of
    transformers, by tokenizer.Tokenizer's rule: special tokens (its added tokens marked special
    too), and tokens whose text is only punctuation."""
    V = vocab_size or len(tokenizer)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special |= set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(min(V, len(tokenizer)))])
    punct = [i for i, t in enumerate(texts) if i not in special and _is_punctuation(t)]
    return token_flags(V, [i for i in special if i < V], punct)


@torch.no_grad()
def generate(model, input_ids, generation_config=None,
             kv: generation.CacheOptions = generation.CacheOptions(), token_flags=None,
             **kwargs) -> torch.LongTensor:
    """`model.generate(..., custom_generate=hf.generate, kv=CacheOptions(...))`: our loop
    (generation.generate) over the model with the cache `kv` describes. input_ids (B, T),
    padded on either side (the `attention_mask` among kwargs); returns them with the new tokens
    after, (B, T + N), padded with the pad token after a sequence's end, as `model.generate`
    does. transformers' `prefill_chunk_size` reads the prompt in chunks, as `kv.prefill_chunk`."""
    cfg = generation_config or model.generation_config
    T = input_ids.shape[1]
    new = cfg.max_new_tokens or cfg.max_length - T
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, mask)]
    eos = cfg.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    sampling = dict(temperature=cfg.temperature or 1.0, top_k=cfg.top_k,
                    top_p=cfg.top_p or 1.0) if cfg.do_sample else {}
    chunk = getattr(cfg, "prefill_chunk_size", None)
    if chunk and kv.prefill_chunk is None:
        kv = dataclasses.replace(kv, prefill_chunk=chunk)
    kv.check()
    was = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        gen = generation.generate(wrapped(model), prompts, new, cache=kv, eos_ids=eos,
                                  token_flags=token_flags, **sampling)
    finally:
        model.set_attn_implementation(was)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos or [0])[0]
    out = input_ids.new_full((len(prompts), max(map(len, gen.tokens))), pad)
    for b, t in enumerate(gen.tokens):
        out[b, :len(t)] = torch.tensor(t)
    return torch.cat([input_ids, out], 1)


def load(folder: str, dtype: str = "float32", device: str = "cpu"):
    """An HFModel of the checkpoint folder `folder`, loaded by transformers, and our tokenizer
    of it (tokenizer.Tokenizer): `python generate.py --hf DIR`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenizer import Tokenizer
    check(AutoConfig.from_pretrained(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=generation.DTYPES[dtype],
                                                 attn_implementation=ATTENTION)
    return wrapped(model.to(device).eval()), Tokenizer(folder)
