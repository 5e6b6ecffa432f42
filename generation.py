"""The decode loop and its Python API: load a checkpoint, generate, score.

    from generation import CacheOptions, flags_of, generate, load
    model, tok = load(None)  # the default model; or a checkpoint folder, or a GGUF file
    gen = generate(model, [tok.encode("Once upon a time")], 64, eos_ids=tok.eos_ids,
                   cache=CacheOptions("fastgen", kv_budget=0.5), token_flags=flags_of(model, tok))

`generate` runs a batch of prompts through one prefill and a decode loop of
free functions (`prefill`, `decode_one_token`, `decode`), with the cache that
`CacheOptions` describes; `score` returns teacher-forced logits through the
same cache. generate.py is the command line on top, chat.py a conversation.
"""
from __future__ import annotations

import time
from dataclasses import KW_ONLY, asdict, dataclass, field

import torch

import tp
import cache as fastgen_cache
from cache import (FastGenCache, asks_after, default_method, fastgen_caches, fixed_method,
                   paper_method)
from model import KVCache, Transformer, reserve
from pool import page_size
from policies import FIXED, token_flags
from quant import BITS, storage_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --- Sampling ---------------------------------------------------------------

def sample(logits, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0):
    """(B, V) logits -> (B,) token ids. Temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = logits.softmax(dim=-1)
    if top_p < 1.0:
        # Keep the smallest set of tokens whose probability reaches top_p.
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    # Sampling by the exponential race: no host sync, compiles cleanly.
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


# --- The decode loop ---------------------------------------------------------

def prefill(model: Transformer, tokens, prompt_lens, chunk: int | None = None, **sampling):
    """Run the padded prompts (B, T); return the first generated token (B, 1)."""
    return sample(prefill_logits(model, tokens, prompt_lens, chunk), **sampling)[:, None]


def prefill_logits(model: Transformer, tokens, prompt_lens, chunk: int | None = None):
    """Run the padded prompts (B, T); the logits after each one's last token, (B, V).
    With `chunk`, in pieces of that many tokens: a compressed cache profiles
    and compresses the first, and keeps what its policies keep of each next
    one (FastGenCache.chunk), so that the prompt's keys and values never all
    exist at once, nor its activations."""
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    chunk = chunk or T
    last = None
    for s in range(0, T, chunk):
        if s:  # each sequence's tokens in this piece; the rest is padding
            reserve(model.caches(), (prompt_lens - s).clamp(0, chunk))
        at = (prompt_lens - 1 - s).clamp(0, min(chunk, T - s) - 1)
        logits = model(tokens[:, s:s + chunk], positions[:, s:s + chunk], logits_at=at)[:, 0]
        read = (prompt_lens - s).clamp(0, chunk)
        if asks_after(model.caches()) and bool((read > 0).all()):
            read_again(model, tokens[:, s:s + chunk], read, start=s + read)
        ends_here = ((prompt_lens - 1) // chunk == s // chunk)[:, None]
        last = logits if last is None else torch.where(ends_here, logits, last)
    return last


# Tokens of a prompt read again at once (`read_again`).
READ_AGAIN = 1024


def read_again(model: Transformer, tokens, counts, start=None, piece: int = READ_AGAIN,
               decide: bool = True, layers: int | None = None):
    """Read again what the caches read last, tokens (B, T) of which counts (B,)
    each sequence's, in pieces of `piece` tokens, for caches that choose what
    to keep by the attention it gives (cache.Method.ask_after): KVzip's context
    reconstruction in chunks, each piece attending to the first tokens, its
    own part of what is held and the part before it, and causally to itself
    (cache.read_again). Nothing of it is kept. A piece is placed at
    `start` (B,), the position after what was read (default: counts, a whole
    prompt), or earlier where it would run past the model's context. With
    `layers`, a chunk on top of what is held is read by the first that many
    layers alone; the forward stops there (cache.read_piece). With
    `decide` False the caches hold what it gave until
    cache.read_piece(caches)."""
    caches, B = model.caches(), len(tokens)
    start = counts if start is None else start
    for s in range(0, tokens.shape[1], piece):
        part = tokens[:, s:s + piece]
        at = start.clamp(max=model.args.max_seq_len - part.shape[1])
        fastgen_cache.read_piece(caches, (counts - s).clamp(0, piece), start - counts + s, layers)
        try:
            model(part, at[:, None] + torch.arange(part.shape[1], device=part.device),
                  logits_at=torch.zeros(B, dtype=torch.long, device=part.device))
        except fastgen_cache.ReadEnough:  # the layers above `layers` do not read it
            pass
    if decide:
        fastgen_cache.read_piece(caches)


def decode_one_token(model: Transformer, token, input_pos, **sampling):
    """token, input_pos: (B, 1) -> next token (B, 1)."""
    return sample(model(token, input_pos)[:, -1], **sampling)[:, None]


_compiled_decode: dict = {}


def compiled_decode(mode: str | None = None, backend: str = "inductor"):
    """`decode_one_token` under torch.compile, built once per (mode, backend). Mode
    "reduce-overhead" replays the step as a CUDA graph; backend "aot_eager" traces
    without generating kernels, which tests use because it compiles in seconds."""
    if (mode, backend) not in _compiled_decode:
        # Each batch size and cache kind is one more compiled graph; a benchmark
        # sweeping them needs more than dynamo's default of 8.
        torch._dynamo.config.recompile_limit = 64
        # A compressed cache's page pool grows between steps, and marks its size
        # dynamic; dynamo ignores that for module buffers unless told otherwise.
        torch._dynamo.config.force_parameter_static_shapes = False
        _compiled_decode[mode, backend] = torch.compile(decode_one_token, fullgraph=True,
                                                        mode=mode, backend=backend)
    return _compiled_decode[mode, backend]


def decode(model: Transformer, cur, input_pos, max_steps: int, emit, compile: bool = False,
           compile_options: dict | None = None, **sampling):
    """Decode from `cur` (B, 1) at `input_pos` (B, 1), advanced in place, until `emit(cur)`
    says every sequence is done or `max_steps` steps are taken. With `compile`, the step
    is `compiled_decode(**compile_options)`.

    Returns (steps, decode_s, compile_s, interrupted). A Ctrl-C stops decoding and keeps what
    was made; a caller that must keep its cache consistent stops through `emit` instead,
    between steps (see chat.py).
    """
    device = model.tok_embeddings.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = compiled_decode(**(compile_options or {})) if compile else decode_one_token
    decode_s = compile_s = 0.0
    steps = 0
    try:
        finished = False
        while not finished and steps < max_steps:
            t0 = time.perf_counter()
            reserve(model.caches())
            cur = step(model, cur, input_pos, **sampling)
            sync()
            elapsed = time.perf_counter() - t0
            if compile and steps == 0:
                compile_s = elapsed  # the first call compiles; it is not a decode speed
            else:
                decode_s += elapsed
            steps += 1
            input_pos += 1
            finished = emit(cur)
    except KeyboardInterrupt:
        if tp.world() > 1:
            raise  # the ranks may have stopped at different steps: no more collectives
        return steps, decode_s, compile_s, True  # keep what was generated so far
    return steps, decode_s, compile_s, False


# --- Caches -----------------------------------------------------------------

@dataclass(frozen=True)
class CacheOptions:
    """Which cache to decode with: the command line's cache flags, built once and
    passed down (generate.py --help says what each accepts).

    kv : str, default "full"
        full, fastgen, or a fixed policy for every head (policies.FIXED)
    kv_budget : float, optional
        fastgen: the share of a full cache's bytes all heads share (default 0.5);
        a fixed policy: the share of the prompt each head keeps (default 0.5)
    paper : bool, default False
        fastgen: the paper's method (threshold mode) instead of the default
    recovery : float, optional
        the paper's threshold T (default 0.95)
    kv_bits : tuple of int, optional
        the precisions keys and values are stored at; several: fastgen's menu
        at each (its budget a share of a 16-bit cache's bytes)
    prefill_chunk : int, optional
        read prompts in pieces of this many tokens
    ask_after : bool, optional
        compressed caches: choose what to keep for questions asked after the
        prompt, by reading it again (cache.Method.ask_after), not by its last rows;
        None: a chat's do (chat.Chat: later turns ask about earlier ones), a prompt's not
    """
    kv: str = "full"
    _: KW_ONLY
    kv_budget: float | None = None
    paper: bool = False
    recovery: float | None = None
    kv_bits: tuple[int, ...] | None = None
    prefill_chunk: int | None = None
    ask_after: bool | None = None

    def check(self):
        """Raise ValueError, naming the flag and what it accepts, for an option out of range."""
        def need(ok, message):
            if not ok:
                raise ValueError(message)
        kinds = ("full", "fastgen", *FIXED)
        need(self.kv in kinds, f"--kv must be one of {', '.join(kinds)} (got {self.kv!r})")
        need(self.recovery is None or 0 < self.recovery <= 1,
             f"--recovery must be in (0, 1] (got {self.recovery})")
        need(self.kv_budget is None or 0 < self.kv_budget <= 1,
             f"--kv-budget must be in (0, 1] (got {self.kv_budget})")
        need(self.prefill_chunk is None or self.prefill_chunk >= 1,
             f"--prefill-chunk must be 1 token or more (got {self.prefill_chunk})")
        bits = self.kv_bits or ()
        need(all(b in BITS for b in bits) and len(set(bits)) == len(bits),
             f"--kv-bits takes distinct precisions among {', '.join(map(str, BITS))} "
             f"(got {','.join(map(str, bits))})")
        need(len(bits) <= 1 or self.kv == "fastgen" and not self.paper,
             "several --kv-bits make a menu of precisions, which only FastGen's default "
             "chooses from: give one precision, or --kv fastgen without --paper")
        need(self.kv == "fastgen" or not (self.paper or self.recovery is not None),
             "--paper and --recovery choose the paper's FastGen: add --kv fastgen")
        need(self.recovery is None or self.paper,
             "--recovery is the paper's threshold: add --paper (the default FastGen takes "
             "--kv-budget)")
        need(not self.ask_after or (self.kv != "full" and not self.paper),
             "--ask-after chooses what a compressed cache keeps: add --kv fastgen (not --paper) "
             "or a fixed policy")
        need(not (self.paper and self.kv_budget is not None),
             "--kv-budget is the default FastGen's; the paper's method takes --recovery")


def make_caches(model: Transformer, options: CacheOptions, prompt_lens: list[int],
                max_new_tokens: int, token_flags=None):
    """One cache per layer: dense for `full`, else compressed, running the method
    the options name (cache.default_method, paper_method, fixed_method): `full`
    in fewer than 16 bits is a compressed cache whose every head keeps all."""
    a, w, o = model.args, model.tok_embeddings.weight, options
    budget = 0.5 if o.kv_budget is None else o.kv_budget
    if o.kv == "full" and o.kv_bits in (None, (16,)):
        max_len = max(prompt_lens) + max_new_tokens
        dtype = storage_dtype(16, w.dtype) if o.kv_bits else w.dtype
        return [KVCache(len(prompt_lens), a.n_kv_heads, max_len, a.head_dim, dtype, w.device)
                for _ in model.layers]
    if o.kv == "fastgen" and o.paper:
        method = paper_method(0.95 if o.recovery is None else o.recovery, o.kv_bits)
    elif o.kv == "fastgen":
        method = default_method(budget, o.kv_bits, ask_after=bool(o.ask_after))
    else:
        method = fixed_method(o.kv, budget, o.kv_bits, ask_after=bool(o.ask_after))
    # Tensor parallel: a budget spans every rank's heads, which share their tables.
    heads = tp.Heads(len(prompt_lens)) if tp.world() > 1 and method.kv_budget else None
    page = None
    if o.prefill_chunk:  # read in pieces: profiled on the first, paged for the whole
        page = page_size(max(prompt_lens))
        prompt_lens = [min(n, o.prefill_chunk) for n in prompt_lens]
    return fastgen_caches(model, method, prompt_lens, max_new_tokens, token_flags, page=page,
                          heads=heads)


def dense_kv_bytes(model: Transformer, batch: int, max_len: int, bits: int | None = None) -> int:
    """Bytes the full cache allocates for this batch: K and V, every layer, in
    the model's dtype or, with `bits`, in that many bits a number."""
    a = model.args
    elem = model.tok_embeddings.weight.element_size() if bits is None else bits / 8
    return int(2 * a.n_layers * batch * a.n_kv_heads * max_len * a.head_dim * elem)


# --- Generation and scoring ------------------------------------------------

@dataclass
class Generation:
    """What `generate` returns: tokens, timings and what the cache held."""
    tokens: list[list[int]]             # generated ids per prompt (EOS included if produced)
    prompt_lens: list[int]
    prefill_s: float
    decode_s: float
    decode_steps: int
    compile_s: float = 0.0              # the first compiled step, excluded from decode_s
    kv_bytes: int = 0                   # allocated by the cache at the end
    full_kv_bytes: int = 0              # the full cache for the same work
    full_kv_bits: int | None = None     # ... with K and V in this many bits (None: the model's)
    kv_bytes_per_rank: list[int] = field(default_factory=list)  # tensor parallel: each rank's
    kept_tokens: int = 0                # (sequence, KV head, layer) triples held at the end
    seen_tokens: int = 0                # the same count for a full cache
    profile_s: float = 0.0              # FastGen profiling + compression, part of prefill_s
    growths: int = 0                    # times a compressed cache grew while decoding
    kv_budget: float | None = None      # budget mode: the share of a full cache's bytes asked
    planned_share: float = 0.0          # ... and the most a sequence's plan took (cheapest: more)
    plan: list[list[str]] = field(default_factory=list)  # per layer, per segment
    recovery: list[list[list[float]]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    interrupted: bool = False           # Ctrl-C stopped decoding; tokens hold what came before

    def speeds(self) -> tuple[float, float]:
        """Prefill and decode tokens/s (decode over every sequence of the batch)."""
        return (sum(self.prompt_lens) / max(self.prefill_s, 1e-9),
                len(self.tokens) * self.decode_steps / max(self.decode_s, 1e-9))

    def as_dict(self) -> dict:
        """Every field, plus the two speeds, as JSON types: what `--json` prints."""
        prefill_tok_s, decode_tok_s = self.speeds()
        return asdict(self) | {"prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s}

    def summary(self) -> str:
        n_prompt, n_gen = sum(self.prompt_lens), sum(len(t) for t in self.tokens)
        prefill_tok_s, decode_tok_s = self.speeds()
        lines = [
            f"prompt tokens {n_prompt}, generated tokens {n_gen}, batch {len(self.tokens)}",
            f"prefill {prefill_tok_s:.1f} tok/s ({self.prefill_s:.2f} s), decode "
            f"{decode_tok_s:.1f} tok/s "
            f"({self.decode_steps} steps, {self.decode_s:.2f} s)"
            + (f", compile {self.compile_s:.1f} s" if self.compile_s else ""),
            f"KV cache allocated {self.kv_bytes / 2**20:.2f} MiB"
            + (f" vs full {self.full_kv_bytes / 2**20:.2f} MiB"
               + (f" in {self.full_kv_bits} bits" if self.full_kv_bits else "") + " "
               f"({self.kv_bytes / self.full_kv_bytes:.1%}); kept {self.kept_tokens} of "
               f"{self.seen_tokens} tokens ({self.kept_tokens / self.seen_tokens:.1%}); "
               f"{self.growths} growths" if self.plan else "")
            + (", per rank " + ", ".join(f"{b / 2**20:.2f}" for b in self.kv_bytes_per_rank)
               + " MiB" if len(self.kv_bytes_per_rank) > 1 else ""),
        ]
        if self.profile_s:
            total = self.prefill_s + self.decode_s
            share = self.profile_s / total
            lines.insert(2, f"profiling and compression {self.profile_s:.2f} s ({share:.1%} of "
                            f"the {total:.2f} s of prefill + decode)")
        if self.kv_budget is not None and self.planned_share > self.kv_budget * 1.01:
            lines.append(
                f"note: the plan took {self.planned_share:.2g} of a full cache's bytes, over "
                f"--kv-budget {self.kv_budget:g}: every head took its cheapest policy; raise "
                "--kv-budget or lower --max-new-tokens")
        if self.plan:
            names = list(dict.fromkeys(p for layer in self.plan for p in layer))
            lines.append("policy count per layer (segments = sequences x KV heads):")
            for i, name in enumerate(names):
                lines.append(f"  [{i}] {name}")
            for l, layer in enumerate(self.plan):
                counts = "  ".join(f"[{i}] {layer.count(n):2d}" for i, n in enumerate(names))
                lines.append(f"  layer {l:2d}: {counts}")
        return "\n".join(lines)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *,
             cache: CacheOptions = CacheOptions(), eos_ids=(), compile: bool = False,
             compile_options=None, on_token=None, token_flags=None, temperature=0.0,
             top_k=None, top_p=1.0) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (token ids), as one batch.

    Prompts are right-padded; each sequence keeps its own positions, so a
    short prompt never sees padding. `on_token(b, id)` is called for each new
    token of sequence b as it is produced. `cache` and `token_flags` go to
    `make_caches`; `compile_options` (mode, backend) to `compiled_decode`.
    """
    device = model.tok_embeddings.weight.device
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    B, lens = len(prompts), [len(p) for p in prompts]
    T = max(lens)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, device=device)
    prompt_lens = torch.tensor(lens, device=device)
    model.setup_caches(make_caches(model, cache, lens, max_new_tokens, token_flags))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B

    def emit(cur):
        for b, t in enumerate(cur[:, 0].tolist()):
            if not done[b]:
                out[b].append(t)
                if on_token:
                    on_token(b, t)
                done[b] = t in eos_ids
        return all(done)

    t0 = time.perf_counter()
    cur = prefill(model, tokens, prompt_lens, cache.prefill_chunk, **sampling)
    sync()
    prefill_s = time.perf_counter() - t0
    steps, decode_s, compile_s, interrupted = 0, 0.0, 0.0, False
    if not emit(cur):
        steps, decode_s, compile_s, interrupted = decode(
            model, cur, prompt_lens[:, None].clone(), max_new_tokens - 1, emit, compile,
            compile_options, **sampling)
    caches = model.caches()
    gen = Generation(out, lens, prefill_s, decode_s, steps - (1 if compile and steps else 0),
                     compile_s, sum(c.nbytes() for c in caches),
                     dense_kv_bytes(model, B, T + max_new_tokens, 16 if cache.kv_bits else None),
                     full_kv_bits=16 if cache.kv_bits else None)
    gen.interrupted = interrupted
    if isinstance(caches[0], FastGenCache):  # a compressed cache (a full one in 8 bits too)
        K = model.args.n_kv_heads
        gen.plan = [c.plan_names() for c in caches]
        gen.kept_tokens = sum(c.kept() for c in caches)
        gen.seen_tokens = model.args.n_layers * K * sum(l + steps for l in lens)
        gen.profile_s = sum(c.profile_s for c in caches)
        gen.recovery = [c.recovery.tolist() for c in caches if c.recovery is not None]
        gen.growths = sum(c.growths() for c in caches)
        gen.kv_budget = caches[0].method.kv_budget
        if gen.kv_budget is not None:
            # Layers share the budget (cache.SCOPE): one may take more, the whole plan not.
            shares = torch.stack([torch.as_tensor(c.share, dtype=torch.float32) for c in caches])
            gen.planned_share = float(shares.mean(0).max())
    model.setup_caches(None)
    return tp.gather_stats(gen, B) if tp.world() > 1 else gen


@torch.no_grad()
def score(model: Transformer, prompts: list[list[int]], continuations: list[list[int]], *,
          cache: CacheOptions = CacheOptions(), token_flags=None) -> torch.Tensor:
    """Teacher-forced logits (B, N, V): for each continuation token, the model's
    prediction given the prompt and the continuation before it, decoded
    step by step through the chosen cache. Continuations share one length N."""
    device = model.tok_embeddings.weight.device
    B, lens, N = len(prompts), [len(p) for p in prompts], len(continuations[0])
    tokens = torch.zeros(B, max(lens), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, device=device)
    follow = torch.tensor(continuations, device=device)  # (B, N)
    prompt_lens = torch.tensor(lens, device=device)
    model.setup_caches(make_caches(model, cache, lens, N, token_flags))
    out = [prefill_logits(model, tokens, prompt_lens, cache.prefill_chunk)]
    for i in range(N - 1):
        reserve(model.caches())
        out.append(model(follow[:, i:i + 1], (prompt_lens + i)[:, None])[:, 0])
    model.setup_caches(None)
    return torch.stack(out, dim=1)


# --- Loading ------------------------------------------------------------------

def load(ckpt: str | None, dtype: str = "float32", device: str = "cpu", allow_pickle: bool = False):
    """The model and tokenizer of `ckpt`: a checkpoint folder, a GGUF file (converted once into
    the cache folder) or None for the default model. Under torchrun, this rank's share."""
    from convert_gguf import checkpoint_folder
    from tokenizer import Tokenizer

    with tp.same_outcome():  # a GGUF is converted by rank 0 alone, while the others wait
        folder = checkpoint_folder(ckpt) if tp.rank() == 0 else None
    with tp.same_outcome():
        folder = folder or checkpoint_folder(ckpt)
        model = tp.load_model(folder, DTYPES[dtype], device, allow_pickle)
        return model, Tokenizer(folder)


def flags_of(model: Transformer, tok):
    """Per-token flags for the Special and Punct policies, from the tokenizer."""
    V = model.args.vocab_size
    return token_flags(V, [i for i in tok.special_ids if i < V],
                       [i for i in tok.punctuation_ids() if i < V])

