"""A document pasted in one chat turn, a question about it in the next: is it answered?

    python -m studies.chat_recall                     # 10 cases at 1,500 tokens: ~10 min on 2 cores
    python -m studies.chat_recall --cases 2 --length 512   # a smoke test

Each case is a three-turn chat (chat.Chat, the cache kept across turns): a
greeting; then the user pastes a document of `--length` tokens of real text
with needles hidden in it (longctx's niah_single and niah_multikey, in turn);
then asks for one needle's number. The cache compresses each turn when it is
read, before the question exists. Caches: the full cache, FastGen at
`--budget` as a chat runs it (reading each turn again), and without that
reading. A case scores the share of the required strings in the third answer
(`answer_score`); the pasted turn's speed is the median over cases of its
tokens over its time, compressing included, and of its ratio to the first cache's on the same
case (the caches take each case in turn).

Writes `--out`.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import chat
from chat import Chat
from generation import CacheOptions, flags_of, load
from studies import output
from studies.evaluate import machine
from studies.longctx import Haystack, answer_score, make_cases

CACHES = {"full": dict(kv="full"), "fastgen": dict(kv="fastgen"),  # a chat reads again by default
          "fastgen --no-ask-after": dict(kv="fastgen", ask_after=False)}


@torch.no_grad()
def conversation(model, tok, flags, options: CacheOptions, case, new_tokens: int) -> dict:
    """The three turns of one case; the third answer, its score, and the bytes at the end."""
    chat = Chat(model, tok, cache=options, max_new_tokens=new_tokens, token_flags=flags)
    chat.turn("Hello! I will paste a document, then ask you about it.")
    pasted = chat.turn(tok.decode(case.context[1:]))  # the document, without BOS
    question = tok.decode(case.question).split("<|im_end|>")[0].strip()
    last = chat.turn(question)
    return dict(answer=last.text, score=answer_score(last.text, case.answers),
                kv_bytes=last.kv_bytes, full_kv_bytes=last.full_kv_bytes,
                paste_tokens=len(pasted.fed), paste_s=pasted.prefill_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="checkpoint (default SmolLM2-135M-Instruct)")
    p.add_argument("--cases", type=int, default=10, help="cases, half of each task (default 10)")
    p.add_argument("--length", type=int, default=1500, help="document tokens (default 1500)")
    p.add_argument("--budget", type=float, default=0.5, help="FastGen's --kv-budget (default 0.5)")
    p.add_argument("--new-tokens", type=int, default=24, help="answer tokens a turn (default 24)")
    p.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES),
                   help="caches to run (default all)")
    p.add_argument("--read-layers", type=float, default=chat.READ_LAYERS,
                   help="share of the layers that read a turn after the first again (default "
                        f"chat.READ_LAYERS, {chat.READ_LAYERS}; 1: all of them)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default="news", help="the haystack: news, usenet or pydoc")
    p.add_argument("--out", default="results/chat_recall/chat_recall")
    a = p.parse_args(argv)
    if not 0 < a.read_layers <= 1:
        p.error(f"--read-layers is a share of the layers, above 0 and at most 1 "
                f"(got {a.read_layers})")
    torch.set_num_threads(a.threads)
    chat.READ_LAYERS = a.read_layers
    model, tok = load(a.ckpt)
    flags = flags_of(model, tok)
    hay = Haystack(tok, a.text)
    cases = [c for i, task in enumerate(("niah_single", "niah_multikey"))
             for c in make_cases(tok, hay, task, a.length, (a.cases + 1 - i) // 2, a.seed)]
    random.Random(a.seed).shuffle(cases)
    rows = {}
    options = {name: CacheOptions(**CACHES[name], kv_budget=None if CACHES[name]["kv"] == "full"
                                  else a.budget) for name in a.caches}
    # Case by case, each cache in turn: the machine's drift falls on every cache alike.
    runs = {name: [] for name in a.caches}
    for c in tqdm(cases, desc="cases", leave=False):
        for name in a.caches:
            runs[name].append(conversation(model, tok, flags, options[name], c, a.new_tokens))
    first = a.caches[0]
    speeds = {name: [r["paste_tokens"] / r["paste_s"] for r in rs] for name, rs in runs.items()}
    for name, rs in runs.items():
        speed = speeds[name]
        against = [x / y for x, y in zip(speed, speeds[first])]
        rows[name] = dict(score=sum(r["score"] for r in rs) / len(rs),
                          share=sum(r["kv_bytes"] for r in rs) / sum(
                              r["full_kv_bytes"] for r in rs),
                          paste_tps=statistics.median(speed), against=statistics.median(against),
                          runs=rs)
        print(f"{name:22s} score {rows[name]['score']:.3f}  share {rows[name]['share']:.3f}  "
              f"pasted turn {rows[name]['paste_tps']:.0f} tokens/s, "
              f"{rows[name]['against']:.2f}x {first}'s", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    output(out, ".json").write_text(json.dumps(dict(
        command="python -m studies.chat_recall " + " ".join(sys.argv[1:] if argv is None else argv),
        machine=machine(), args=vars(a), rows=rows), indent=1))


if __name__ == "__main__":
    main()
