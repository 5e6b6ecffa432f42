"""A Llama in plain PyTorch: RMSNorm, RoPE (with Llama-3 scaling), grouped-query
attention, SwiGLU. Weights load from any HF-format Llama checkpoint folder.

The model never owns a cache policy. Each attention layer hands its queries,
keys and values to a small cache module that returns the attention output;
`KVCache` below keeps every token (the exact reference), and `cache.FastGenCache`
keeps, per head, only what that head's policy needs.
"""
from __future__ import annotations

import abc
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# Letters used in shape comments:
#   B batch, T tokens in this call, C cache slots (of one head), V vocabulary,
#   H query heads, K key/value heads, G = H // K query heads per KV head,
#   D head dimension, E model dimension.


@dataclass
class ModelArgs:
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int = 49152
    ffn_dim: int = 1536
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        """Build the arguments from an HF `config.json` dict of a Llama-family model."""
        arch = config.get("model_type")
        if arch not in ("llama", "mistral"):
            raise ValueError(
                f"config.json has model_type {arch!r}; only Llama-family checkpoints "
                "(model_type 'llama') are supported")
        if config.get("mlp_bias"):
            raise ValueError("config.json sets mlp_bias, which this Llama does not implement")
        if config.get("sliding_window"):
            raise ValueError("config.json sets sliding_window, which this Llama does not implement")
        scaling = config.get("rope_scaling") or config.get("rope_parameters")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
        theta = config.get("rope_theta")
        if theta is None:
            theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            vocab_size=config["vocab_size"],
            ffn_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
        )

    @classmethod
    def tiny(cls, **overrides) -> "ModelArgs":
        """A few-kilobyte config for tests: GQA, two layers."""
        base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                    ffn_dim=96, max_seq_len=256, rope_theta=10000.0)
        return cls(**(base | overrides))


# --- RoPE -------------------------------------------------------------------

def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (D/2,), with Llama-3 scaling when the config asks for it."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept,
    # and the band in between interpolated smoothly (same formula as HF).
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_table(args: ModelArgs, device=None) -> torch.Tensor:
    """cos and sin for every position, stacked: (2, max_seq_len, D), float32."""
    inv_freq = rope_frequencies(args).to(device)
    pos = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x: (B, H, T, D); cos, sin: (B, 1, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


# --- Layers -----------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as HF does, so that
        # bfloat16 runs match the reference.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def causal_attention(q, k, v) -> torch.Tensor:
    """Attention of a whole prompt over itself. q: (B, H, T, D); k, v: (B, K, T, D).

    Prompts in a batch are right-padded, so a real token never sees padding:
    padding always sits at later positions than every real token.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


def attend(q, k, v, visible):
    """Attention of one new query per head over a cache, with its probabilities.

    q: (N, G, D) queries grouped by the KV head they share; k: (N, D, C), the
    keys transposed, so that the scores are a plain (G, D) x (D, C) product
    (on CPU it reads the keys faster than against (C, D) rows);
    v: (N, C, D); visible: (N, 1, C) bool. Returns the output (N, G, D) and
    the attention probabilities (N, G, C) in float32.
    """
    scores = (q @ k) / math.sqrt(q.shape[-1])
    probs = scores.float().masked_fill(~visible, -float("inf")).softmax(-1)
    return probs.to(v.dtype) @ v, probs


# Queries of a chunk attended at once by `KVCache`: their masked scores over a
# long cache stay a few MB.
CHUNK_ROWS = 128


class Cache(nn.Module, abc.ABC):
    """What attention and the decode loop ask of a layer's KV cache. `KVCache`
    below keeps every token; `cache.FastGenCache` what each head's policy keeps."""

    @abc.abstractmethod
    def forward(self, q, k, v, input_pos, tokens) -> torch.Tensor:
        """Hold k, v (B, K, T, D) of `tokens` (B, T) at positions input_pos (B, T)
        and return the attention of q (B, H, T, D) over all that is held: T
        tokens of a prompt, of a chunk on top of what is held, or one."""

    @staticmethod
    def reserve(caches: list[Cache], tokens=1) -> None:
        """Before each step after the prompt, outside compiled code, every layer's
        cache at once: `tokens` per sequence, 1, a chunk's T or (B,) counts."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes the cache really holds."""



def reserve(caches: list[Cache], tokens=1) -> None:
    """`Cache.reserve` of the model's caches, whatever their kind."""
    type(caches[0]).reserve(caches, tokens)


class KVCache(Cache):
    """The dense cache: every token of every KV head, V as (B, K, C, D) and K
    transposed, (B, K, D, C) (see `attend`).

    The exact reference that the compressed cache is measured against. Its
    `dtype` may be narrower than the model's (float16 under a float32 model:
    a full cache in 16 bits); it is then read back in the queries' dtype.
    Sequences in a batch write at their own positions, so prompts of
    different lengths need no padding mask: slot j of a sequence holds its
    token at position j, and a query at position p sees slots 0..p.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3)
                             .contiguous(), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, q, k, v, input_pos, tokens) -> torch.Tensor:
        B, K, T, D = k.shape
        # Written by indexing, not scatter_: compiled code updates the buffer in
        # place only then (a scatter_ copied the whole cache every step).
        rows = torch.arange(B, device=k.device)[:, None]
        self.k[rows, :, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)  # (B, T, K, D) slots
        self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)
        if T > 1:
            # The one host sync of this class, on multi-token calls only (never
            # while decoding): how far the buffer is filled decides what to read.
            end = int(input_pos.max()) + 1
            if end == T:
                # A prompt starts an empty cache: attending over the fresh keys
                # is exact and cheaper than over the whole buffer.
                return causal_attention(q, k, v)
            # A chunk on top of the cache (a chat's next turn, a long prompt
            # in pieces): each query sees the slots up to its own position,
            # CHUNK_ROWS queries at a time (a masked attention holds its scores).
            visible = torch.arange(end, device=q.device) <= input_pos[..., None]  # (B, T, C)
            keys = self.k[..., :end].transpose(2, 3).to(q.dtype)
            values = self.v[:, :, :end].to(q.dtype)
            return torch.cat([F.scaled_dot_product_attention(
                q[:, :, i:i + CHUNK_ROWS], keys, values, enable_gqa=q.shape[1] != K,
                attn_mask=visible[:, None, i:i + CHUNK_ROWS]) for i in range(0, T, CHUNK_ROWS)], 2)
        slots = torch.arange(self.v.shape[2], device=q.device)
        visible = (slots[None, :] <= input_pos)[:, None, None, :]  # (B, 1, 1, C)
        k, v = self.k.to(q.dtype), self.v.to(q.dtype)  # a no-op unless stored narrower
        y, _ = attend(q.view(B, K, -1, D), k, v, visible)  # (B, K, G, D)
        return y.view(q.shape)

    def grow(self, max_len: int):
        """Room for max_len positions, keeping what is held: a chat's cache grows with the
        conversation instead of being sized for the whole context, because a decode step
        attends over every slot of the buffer."""
        extra = max_len - self.v.shape[2]
        if extra > 0:
            self.k = F.pad(self.k, (0, extra))
            self.v = F.pad(self.v, (0, 0, 0, extra))

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache: Cache | None = None

    def forward(self, x, cos, sin, input_pos, tokens) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is None:
            y = causal_attention(q, k, v)
        else:
            y = self.kv_cache(q, k, v, input_pos, tokens)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, input_pos, tokens):
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, tokens)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)

    def setup_caches(self, caches: list[Cache] | None):
        """Attach one cache module per layer (or detach all with None)."""
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = None if caches is None else caches[i]

    def caches(self) -> list[Cache]:
        return [layer.attention.kv_cache for layer in self.layers]

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, input_pos: (B, T) -> logits (B, T, V), float32; with
        `logits_at` (B,), only the logits at those indices, (B, 1, V).

        input_pos holds each token's position in its own sequence. Without a
        cache the call must cover whole sequences from position 0.
        """
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope[:, input_pos].to(x.dtype).unsqueeze(2)  # (B, 1, T, D) each
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, tokens)
        if logits_at is not None:  # prefill: the vocabulary projection of one row, not T
            x = x[torch.arange(len(x), device=x.device), logits_at][:, None]
        return self.output(self.norm(x)).float()


# --- Loading ----------------------------------------------------------------

class CheckpointError(Exception):
    """A checkpoint folder that cannot be loaded; the message says why and what to do."""


def hf_to_ours(key: str) -> str | None:
    """Map an HF Llama parameter name to ours; None for keys we deliberately drop."""
    if key.endswith("rotary_emb.inv_freq"):
        return None  # a cached table some old exports saved; we compute it
    renames = {
        "model.embed_tokens.": "tok_embeddings.",
        "model.norm.": "norm.",
        "lm_head.": "output.",
        "self_attn.q_proj.": "attention.wq.",
        "self_attn.k_proj.": "attention.wk.",
        "self_attn.v_proj.": "attention.wv.",
        "self_attn.o_proj.": "attention.wo.",
        "mlp.gate_proj.": "feed_forward.w1.",
        "mlp.up_proj.": "feed_forward.w3.",
        "mlp.down_proj.": "feed_forward.w2.",
        "input_layernorm.": "attention_norm.",
        "post_attention_layernorm.": "ffn_norm.",
    }
    if key.startswith("model.layers."):
        key = key[len("model."):]
    for old, new in renames.items():
        if old in key:
            return key.replace(old, new)
    return key


def read_config(ckpt: Path) -> dict:
    path = ckpt / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: --ckpt must be an HF-format checkpoint folder")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON ({e}); re-download the checkpoint")


def weight_files(ckpt: Path, allow_pickle: bool = False) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index} is damaged ({e!r}); re-download it")
        return [ckpt / s for s in shards]
    if (ckpt / "model.safetensors").is_file():
        return [ckpt / "model.safetensors"]
    pickles = sorted(ckpt.glob("*.bin")) + sorted(ckpt.glob("*.pth"))
    if pickles and allow_pickle:
        return pickles
    hint = (f" It holds pickle files ({', '.join(p.name for p in pickles[:3])}), which are not "
            "loaded by default because unpickling can run code; pass --allow-pickle to load "
            "them with torch.load(weights_only=True), or convert them to safetensors.") \
        if pickles else ""
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {ckpt}.{hint}")


def read_weights(f: Path, take) -> dict[str, torch.Tensor]:
    """One weight file, safetensors or (opted into) a pickle read with weights_only,
    under our names. `take(key, t)` returns what to keep of tensor `key`, given a
    safetensors slice (of which only that part is then read) or a tensor."""
    if not f.is_file():
        raise CheckpointError(f"{f} is missing (named in the index); re-download the checkpoint")
    import pickle

    from safetensors import SafetensorError, safe_open

    def ours(keys):
        return [(key, name) for key in keys if (name := hf_to_ours(key)) is not None]
    try:
        if f.suffix == ".safetensors":
            with safe_open(f, "pt") as st:
                return {name: take(name, st.get_slice(key)) for key, name in ours(st.keys())}
        sd = torch.load(f, map_location="cpu", weights_only=True)
        return {name: take(name, sd[key]) for key, name in ours(sd)}
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{f} holds objects other than tensors, which are refused "
                              f"even with --allow-pickle ({str(e).splitlines()[-1].strip()})")
    except (SafetensorError, OSError, ValueError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{f} is damaged or truncated ({str(e).splitlines()[0]}); "
                              "re-download it")


def load_state_dict(files: list[Path], dtype: torch.dtype, take) -> dict[str, torch.Tensor]:
    sd = {}
    for f in files:
        sd |= read_weights(f, lambda key, t: take(key, t).to(dtype))
    return sd


def whole(key: str, t) -> torch.Tensor:
    """All of checkpoint tensor `key`, read from a safetensors slice (or a tensor)."""
    return t[:]


def load_model(ckpt: str | Path, dtype=torch.float32, device="cpu", allow_pickle: bool = False,
               build=Transformer, take=whole) -> Transformer:
    """Load an HF-format Llama checkpoint folder (config.json + safetensors).

    Pickle weights (`*.bin`, `*.pth`) load only with `allow_pickle`, and then
    through `torch.load(weights_only=True)`, which refuses arbitrary objects.
    `build(args)` makes the (meta-device) model to fill, and `take(key, t)`
    what to keep of each checkpoint tensor (see `read_weights`): tp.py passes
    its own, to load one rank's share of a model without reading the rest."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint folder {ckpt} does not exist")
    try:
        args = ModelArgs.from_hf_config(read_config(ckpt))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'config.json'}: {e if not isinstance(e, KeyError) else f'missing field {e}'}")
    with torch.device("meta"):
        model = build(args)
    sd = load_state_dict(weight_files(ckpt, allow_pickle), dtype, take)
    if args.tie_embeddings:
        # Tied models share one matrix; some exports still save a copy as lm_head.
        sd["output.weight"] = sd.get("tok_embeddings.weight")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{ckpt} does not match its config.json: missing tensors {missing[:4]}, "
            f"unexpected tensors {extra[:4]}")
    for key, t in expected.items():
        if sd[key].shape != t.shape:
            raise CheckpointError(
                f"{ckpt}: tensor {key} has shape {tuple(sd[key].shape)}, "
                f"config.json implies {tuple(t.shape)}")
    model.load_state_dict(sd, strict=True, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope = rope_table(model.args)
    return model.to(device).eval()
