"""Long context at equal KV bytes: RULER-style tasks, generated offline from real text.

    python -m studies.longctx              # SmolLM2-135M, 2k and 4k, 20 cases: ~3 h on 1 busy core
    python -m studies.longctx --quick      # a smoke test: 1 case per task, 512 tokens, < 1 min
    python -m studies.longctx --lengths 2048 --cases 5 --budgets 0.25 \\
        --methods full h2o tova sink local fastgen-paper --kl-lengths   # the costly baselines

Five tasks (after RULER, Hsieh et al. 2024), each case a prompt of exactly
`--lengths` tokens (clipped to the model's context less the answer):

- `niah_single`: one needle, "One of the special magic numbers for {key} is:
  {7 digits}.", hidden at a random depth in real prose; asked for the number.
- `niah_multikey`: four needles with four keys; asked for one key's number.
- `niah_multivalue`: four needles with one key and four numbers; asked for all.
- `vt`: variable tracking, a chain "VAR ABCDE = 12345." then "VAR FGHIJ =
  ABCDE." ... (five variables) spread through the prose; asked for every
  variable that holds the value.
- `cwe`: common words, a numbered list of words of the real text in which
  five words come 30 times and the others 3 times; asked for the five.

The haystack is real text that ships with Python (`textdata`: pydoc, or
`--text news`); needles go in after a sentence's end. A case's score is the
share of its required strings (numbers, variables, words) found, case
insensitive, in the greedy answer up to the first end-of-turn token
(RULER's string match).

Two readings of the question:

- `question_last`: context and question in one prompt, compressed after the
  prefill, as every method usually runs.
- `agnostic`: the context alone is prefilled and compressed, then the
  question and the answer are fed on top of the compressed cache as decode
  steps: compression cannot see the question (as when one cache serves many
  questions).

Both readings come from one exact prefill per batch of cases (evaluate's
`record`): causal attention makes the context's q, k, v the first rows of
the whole prompt's, so `agnostic` builds its caches from a slice of the same
record. Every method is one configuration replayed from it.

Then the teacher-forced KL and top-1 agreement against the full cache on
windows of real text at `--kl-lengths` (evaluate's `text_quality`).

Methods at equal budgets: the default FastGen (`fastgen`), the paper's
method at recovery `--thresholds` (its share as it comes), `local`, `sink`,
`h2o`, `tova`, `snapkv`, and the full cache. The x-axis is the KV bytes the
caches really allocated over a full cache's for the same work. A task on
which the full cache scores below 0.3 (at that length and reading) is shown
but left out of the average. By default run full, fastgen and snapkv (see
`DEFAULTS`): the cache profiles every prompt row for `h2o` and the paper's
method, and each more method's replays cost as much as these three's.

Writes OUT.json, OUT.md (per length and reading, methods against tasks) and
OUT.png (average score against KV share, one panel per length and reading).
"""
from __future__ import annotations

import datetime
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cache import asks_after
from model import reserve
from generation import CacheOptions, dense_kv_bytes, make_caches
from studies import evaluate
from studies import output
from studies.evaluate import Config
from studies.textdata import SOURCES, documents, prompts

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
READINGS = ("question_last", "agnostic")
FIXED = ("local", "sink", "h2o", "tova", "snapkv")
# h2o and snapkv also with keys and values in 8 or 4 bits (their budget a share of the tokens).
FEWER_BITS = tuple(f"{m}@{b}" for m in ("h2o", "snapkv") for b in (8, 4))
METHODS = ("full", "fastgen", "fastgen-ask", "fastgen-paper", *FIXED, "full@4", "fastgen@16/8/4",
           "fastgen-ask@16/8/4", *FEWER_BITS)
# FastGen's methods under a budget, with their options (with kv_bits, the budget is a share of a
# 16-bit cache's bytes, not of the tokens).
FASTGEN = {"fastgen": {}, "fastgen-ask": {"ask_after": True},
           "fastgen@16/8/4": {"kv_bits": (16, 8, 4)},
           "fastgen-ask@16/8/4": {"kv_bits": (16, 8, 4), "ask_after": True}}
FLOOR = 0.3  # a task the full cache scores below this is left out of the averages

# Greedy tokens per answer: 7 digits (one token each with SmolLM2's tokenizer)
# and some room; four numbers; five variables of 5 letters; five words.
NEW_TOKENS = dict(niah_single=12, niah_multikey=12, niah_multivalue=40, vt=30, cwe=30)

INTRO = dict(
    niah="Some special magic numbers are hidden within the following text. Make sure to "
         "memorize them. I will quiz you about the numbers afterwards.",
    vt="Memorize and track the chain of variable assignments hidden in the following text.",
    cwe="Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.")
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy",
              "jolly", "keen", "lively", "misty", "noble", "odd", "proud", "quiet", "rapid",
              "silent", "tidy", "upper", "vivid", "wary", "young")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor",
         "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
         "quarry", "river", "saddle", "tunnel", "violin", "walnut", "yacht", "zipper")
COMMON, COMMON_FREQ, RARE_FREQ = 5, 30, 3  # cwe: five words 30 times, the others 3


@dataclass
class Case:
    """One prompt: `context` (instructions and haystack) then `question` (the
    question and the answer's first words), token ids; `answers`: the strings
    the answer must contain."""
    task: str
    context: list[int]
    question: list[int]
    answers: list[str]
    n_new: int


# --- Cases ------------------------------------------------------------------------

class Haystack:
    """Real text as token ids, cut at random places, and where sentences end."""

    def __init__(self, tok, source: str = "pydoc"):
        self.tok, self.docs = tok, [text for _, text in documents(source=source)]
        self.sep = tok.encode("\n\n", special=False)
        self.encoded: dict[int, list[int]] = {}
        texts = tok.token_texts()
        # A needle goes after a sentence's end, before a word that starts with a space.
        self.ends = [t.endswith((".", "!", "?")) for t in texts]
        self.spaced = [t.startswith(" ") for t in texts]
        words = set()
        for text in self.docs:
            words.update(re.findall(r"\b[a-z]{5,10}\b", text))
        self.words = sorted(words)  # cwe's pool

    def take(self, n: int, rng: random.Random) -> list[int]:
        """n tokens of documents in an order shuffled by rng, joined by blank lines."""
        order = list(range(len(self.docs)))
        rng.shuffle(order)
        ids: list[int] = []
        for d in order * (1 + n // 1000):  # a short corpus (tests) goes round again
            if d not in self.encoded:
                self.encoded[d] = self.tok.encode(self.docs[d], special=False)
            ids += (self.sep if ids else []) + self.encoded[d]
            if len(ids) >= n:
                break
        return ids[:n]

    def insert(self, hay: list[int], needles: list[list[int]], rng) -> list[int]:
        """hay with each needle after the sentence end nearest a random depth, in order
        (at the start or the end of a text without one)."""
        cuts = [i for i in range(1, len(hay)) if self.ends[hay[i - 1]] and self.spaced[hay[i]]]
        cuts = cuts or [0, len(hay)]
        depths = [rng.random() * len(hay) for _ in needles]
        at = sorted(min(cuts, key=lambda c: abs(c - d)) for d in depths)
        out, last = [], 0
        for cut, needle in zip(at, needles):
            out += hay[last:cut] + needle
            last = cut
        return out + hay[last:]


def key(rng) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def number(rng, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def variable(rng) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def needle_task(task: str, rng):
    """(needles, question, answer prefix, answers) of a haystack task."""
    magic = "One of the special magic numbers for {} is: {}."
    if task in ("niah_single", "niah_multikey"):
        keys = [key(rng)]
        while len(keys) < (1 if task == "niah_single" else 4):
            keys += [k for k in [key(rng)] if k not in keys]
        values = [number(rng, 7) for _ in keys]
        needles = [magic.format(k, v) for k, v in zip(keys, values)]
        asked = rng.randrange(len(keys))
        return (needles, f"What is the special magic number for {keys[asked]} mentioned in the "
                "provided text?", f"The special magic number for {keys[asked]} mentioned in "
                "the provided text is", [values[asked]])
    if task == "niah_multivalue":
        k, values = key(rng), []
        while len(values) < 4:
            values += [v for v in [number(rng, 7)] if v not in values]
        return ([magic.format(k, v) for v in values], f"What are all the special magic numbers "
                f"for {k} mentioned in the provided text?", f"The special magic numbers for {k} "
                "mentioned in the provided text are", values)
    if task == "vt":
        names, value = [], number(rng, 5)
        while len(names) < 5:
            names += [v for v in [variable(rng)] if v not in names]
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = {a}." for a, b in
                                                     zip(names, names[1:])]
        return (needles, f"Find all variables that are assigned the value {value} in the text "
                "above.", f"According to the chain of variable assignments in the text above, "
                f"5 variables are assigned the value {value}, they are:", names)
    raise ValueError(f"unknown task {task!r}")


def word_list(tok, hay: Haystack, n_tokens: int, rng) -> tuple[list[int], list[str]]:
    """cwe: a numbered list of words of at most n_tokens tokens, and its COMMON
    most frequent words. Common words come COMMON_FREQ times and the others
    RARE_FREQ (fewer of each in a list too short for that)."""
    pool = rng.sample(hay.words, min(len(hay.words), 2000))
    common, rare = pool[:COMMON], pool[COMMON:]
    items = max(n_tokens // 5, 2 * COMMON)  # about 5 tokens an item: " 12. word"
    for _ in range(8):  # shrink until it fits
        c = max(2, min(COMMON_FREQ, items // (2 * COMMON)))
        r = max(1, min(RARE_FREQ, c - 1))
        n_rare = min(len(rare), max(0, (items - c * COMMON) // r))
        words = common * c + rare[:n_rare] * r
        random.Random(rng.random()).shuffle(words)
        ids = tok.encode(" " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)),
                         special=False)
        if len(ids) <= n_tokens:
            return ids, common
        items = int(items * n_tokens / len(ids) * 0.98)
    raise ValueError(f"{n_tokens} tokens cannot hold a cwe word list; ask for longer prompts")


def frame(tok, intro: str, question: str, prefix: str, chat: bool) -> tuple[str, str]:
    """The text before the haystack and after it: plain, or the model's chat
    template with the answer's first words after the assistant's header."""
    if not chat:
        return intro + "\n\n", f"\n\n{question}\n{prefix}"
    mark = "\x00"
    head, tail = tok.apply_chat(mark).split(mark)
    return head + intro + "\n\n", f"\n\n{question}{tail}{prefix}"


def make_cases(tok, hay: Haystack, task: str, length: int, n: int, seed: int = 0,
               chat: bool = False) -> list[Case]:
    """n cases of `task`, each `length` tokens (cwe: at most), the same for the same seed."""
    rng = random.Random(f"{seed}/{task}/{length}")
    bos = tok.encode("", special=True)
    cases = []
    for _ in range(n):
        if task == "cwe":
            question = f"What are the {COMMON} most common words in the above list?"
            prefix = f"The top {COMMON} words that appear most often in the list are:"
            head, tail = frame(tok, INTRO["cwe"], question, prefix, chat)
            head, tail = bos + tok.encode(head, special=False), tok.encode(tail, special=False)
            body, answers = word_list(tok, hay, length - len(head) - len(tail), rng)
        else:
            needles, question, prefix, answers = needle_task(task, rng)
            head, tail = frame(tok, INTRO["vt" if task == "vt" else "niah"], question, prefix, chat)
            head, tail = bos + tok.encode(head, special=False), tok.encode(tail, special=False)
            needles = [tok.encode(" " + t, special=False) for t in needles]
            fill = length - len(head) - len(tail) - sum(map(len, needles))
            if fill < 16:
                raise ValueError(f"{length} tokens are too few for {task}: its instructions, "
                                 f"question and needles take {length - fill}")
            body = hay.insert(hay.take(fill, rng), needles, rng)
        cases.append(Case(task, head + body, tail, answers, NEW_TOKENS[task]))
    return cases


def answer_score(answer: str, required: list[str]) -> float:
    """Share of the required strings in the answer, case insensitive (RULER's string match)."""
    answer = answer.lower()
    return sum(r.lower() in answer for r in required) / len(required)


def answer_text(tok, ids: list[int]) -> str:
    """The greedy answer up to its first end-of-turn token."""
    stop = next((i for i, t in enumerate(ids) if t in tok.eos_ids), len(ids))
    return tok.decode(ids[:stop])


# --- Methods, replayed from one prefill --------------------------------------------

def method_configs(methods, budgets, thresholds) -> list[Config]:
    """The full cache first (the reference), then each method at each budget
    (the paper's FastGen at each threshold instead)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {', '.join(unknown)}; methods: {', '.join(METHODS)}")
    out = [Config("full", "full", {})]
    for m in methods:
        if m in FASTGEN:
            out += [Config(f"{m} b={b:g}", "fastgen", {"kv_budget": b, **FASTGEN[m]})
                    for b in budgets]
        elif m == "full@4":
            out += [Config("full@4", "full", {"kv_bits": (4,)})]
        elif m == "fastgen-paper":
            out += [Config(f"fastgen-paper T={t:g}", "fastgen", {"recovery": t, "paper": True})
                    for t in thresholds]
        elif m in FIXED or m in FEWER_BITS:
            kind, _, bits = m.partition("@")
            fewer = {"kv_bits": (int(bits),)} if bits else {}
            out += [Config(f"{m} b={b:g}", kind, {"kv_budget": b, **fewer}) for b in budgets]
    return out


def context_record(rec, context_lens):
    """The record of the contexts alone, cut from the record of whole prompts:
    causal attention makes a prefix's q, k, v the first rows of the prompt's."""
    recorders, tokens, input_pos, _, _ = rec
    lens = torch.tensor(context_lens)
    T = int(lens.max())
    cut = []
    for r in recorders:
        c = evaluate.Recorder(lens)
        c.qkv = tuple(t[:, :, :T] for t in r.qkv)  # (B, H or K, T, D)
        cut.append(c)
    return cut, tokens[:, :T], input_pos[:, :T], lens, None


@torch.no_grad()
def replay_agnostic(model, rec, config: Config, questions: list[list[int]], n: int, flags=None):
    """Build `config`'s caches from the contexts' record, feed each question
    token by token on top of them, then decode n greedy tokens. Returns the
    answers' token ids (B, n) and the bytes the caches allocated and a full
    cache would allocate for the same work. Mirrors evaluate.replay."""
    recorders, tokens, input_pos, lens, _ = rec
    B, Q = len(questions), max(map(len, questions))
    steps = Q + n - 1  # every question token, then n - 1 answer tokens fed back
    options = CacheOptions(config.kv, **config.options)
    caches = make_caches(model, options, lens.tolist(), steps + 1, flags)
    with evaluate.from_record(recorders):
        for c, r in zip(caches, recorders):
            c(*r.qkv, input_pos, tokens)
    model.setup_caches(caches)
    if asks_after(caches):
        evaluate.read_again_once(model, recorders, tokens, lens)
    fed = torch.zeros(B, steps, dtype=torch.long)
    teacher = torch.zeros(B, steps, dtype=torch.bool)
    for b, q in enumerate(questions):
        fed[b, :len(q)], teacher[b, :len(q)] = torch.tensor(q), True
    qlen = torch.tensor([len(q) for q in questions])
    answers = torch.zeros(B, steps + 1, dtype=torch.long)  # the prediction after each step
    # A sequence whose answer is complete idles at its last position: with a
    # shorter question than the batch's longest, its position would otherwise
    # run past the model's context on prompts that fill it.
    last = lens + qlen + n - 2
    for i in range(steps):
        reserve(caches)
        # Teacher-forced while a sequence's question lasts, then its own answer.
        token = torch.where(teacher[:, i], fed[:, i], answers[:, i])
        pos = torch.minimum(lens + i, last)
        answers[:, i + 1] = model(token[:, None], pos[:, None])[:, 0].argmax(-1)
    nbytes = sum(c.nbytes() for c in caches)
    model.setup_caches(None)
    # Sequence b's answer starts with the prediction after its last question token.
    idx = qlen[:, None] + torch.arange(n)  # (B, n)
    return answers.gather(1, idx), nbytes, dense_kv_bytes(model, B, int(lens.max()) + steps + 1)


def run_cases(model, tok, cases: list[Case], cfgs: list[Config], readings, flags, batch: int,
              desc: str = "") -> dict:
    """Per reading, per configuration: each case's score and answer, and bytes.

    A decode step costs about the same for one sequence as for several (it
    reads every weight), so cases go in batches as large as memory allows,
    sorted by answer length. The full cache's `agnostic` answers are its
    `question_last` ones: it keeps every token, so when the question comes
    changes nothing (tests/studies/test_longctx.py checks it)."""
    res = {rd: {c.name: dict(scores=[None] * len(cases), answers=[None] * len(cases), bytes=0,
                             full_bytes=0) for c in cfgs} for rd in readings}
    order = sorted(range(len(cases)), key=lambda i: cases[i].n_new)
    for idx in tqdm(evaluate.batches(order, batch), desc=desc or "batches", leave=False):
        chunk = [cases[i] for i in idx]
        n = max(c.n_new for c in chunk)
        rec = evaluate.record(model, [c.context + c.question for c in chunk])
        ctx = (context_record(rec, [len(c.context) for c in chunk])
               if "agnostic" in readings else None)
        for cfg in tqdm(cfgs, desc="methods", leave=False):
            for rd in readings:
                if rd == "question_last" or (cfg.kv == "full" and "question_last" in readings):
                    if rd == "question_last":
                        logits, nbytes, _ = evaluate.replay(model, rec, cfg, n, None, flags)
                        ids = logits.argmax(-1)
                        full = dense_kv_bytes(model, len(chunk), int(rec[3].max()) + n)
                else:
                    ids, nbytes, full = replay_agnostic(model, ctx, cfg,
                                                        [c.question for c in chunk], n, flags)
                r = res[rd][cfg.name]
                for i, case, answer in zip(idx, chunk, ids.tolist()):
                    r["answers"][i] = answer_text(tok, answer[:case.n_new])
                    r["scores"][i] = answer_score(r["answers"][i], case.answers)
                r["bytes"] += nbytes
                r["full_bytes"] += full
        del rec, ctx
    return res


# --- The peer: NVIDIA kvpress, in its own environment -----------------------------------

PEER_PRESSES = ("StreamingLLMPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress",
                "KeyDiffPress")  # the default; KVzipPress runs too, at about 3 prefills a case


def peer_cases(python, ckpt, tok, cases: list[Case], readings, budgets, batch: int,
               threads: int, presses=PEER_PRESSES) -> tuple[dict, dict]:
    """kvpress's presses at compression ratio 1 - budget on the same cases and
    readings (studies/peer_kvpress.py under `python`, a venv with kvpress):
    run_cases' results for its configurations, and what it says of itself
    ({"error": why} when it could not run)."""
    got = evaluate.run_peer_job(python, dict(
        ckpt=str(ckpt), presses=list(presses), ratios=[round(1 - b, 6) for b in budgets],
        batch=batch, threads=threads, readings=list(readings),
        longctx_cases=[dict(context=c.context, question=c.question, n=c.n_new) for c in cases]))
    if "error" in got:
        return {}, got
    res = {}
    for rd, by_name in got["cases"].items():
        for name, r in by_name.items():
            if any(a is None for a in r["answers"]):  # it failed on some batch: in info
                continue
            answers = [answer_text(tok, a[:c.n_new]) for a, c in zip(r["answers"], cases)]
            res.setdefault(rd, {})[name] = dict(
                answers=answers,
                scores=[answer_score(a, c.answers) for a, c in zip(answers, cases)],
                bytes=r["bytes"], full_bytes=r["full_bytes"])
    return res, got["info"]


# --- Report ---------------------------------------------------------------------------

def summarize(res: dict, cases: list[Case]) -> dict:
    """{reading: {"rows": {config: {"scores": {task: mean}, "average", "share"}},
    "excluded": tasks}} from run_cases' results on the cases of one length."""
    tasks = list(dict.fromkeys(c.task for c in cases))
    out = {}
    for rd, by_config in res.items():
        def per_task(scores):
            return {t: mean(s for s, c in zip(scores, cases) if c.task == t) for t in tasks}
        full = per_task(by_config["full"]["scores"])
        excluded = [t for t in tasks if full[t] < FLOOR]
        rows = {}
        for name, r in by_config.items():
            scores = per_task(r["scores"])
            kept = [scores[t] for t in tasks if t not in excluded]
            rows[name] = dict(scores=scores, average=mean(kept) if kept else None,
                              average_all=mean(scores.values()),
                              share=r["bytes"] / r["full_bytes"])
        out[rd] = dict(rows=rows, excluded=excluded)
    return out


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def duration(s: float) -> str:
    return f"{s:.0f} s" if s < 60 else f"{s / 60:.1f} min"


def fmt(v, digits=3):
    return "—" if v is None else f"{v:.{digits}f}"


def report(results: dict, kl: dict, meta: dict) -> str:
    m = meta
    lines = ["# Long context at equal KV bytes (RULER-style)\n",
             f"Measured on {m['machine']}, torch {m['torch']}, {m['date']}; "
             f"{duration(m['runtime_s'])} ("
             + ", ".join(f"{k}: {duration(v)}" for k, v in m["runtime_by_part_s"].items()) + ").\n",
             f"    {m['command']}\n",
             f"Model: `{m['model']}`. Haystack: `{m['text']}` (`textdata`), {m['format']} prompt; "
             f"cases per task and length: {m['cases']}, seed {m['seed']}; greedy answers. Score: "
             "share of the required strings (numbers, variables, words) in the answer, the mean "
             "over the cases. KV share: the bytes the caches really allocated (K, V and index "
             "tensors) over a full cache's for the same work, over every task of the length. "
             "`question_last`: context and question prefilled together, then compressed; "
             "`agnostic`: the context alone prefilled and compressed, the question fed on top as "
             f"decode steps. A task marked * has a full-cache score below {FLOOR} at that length "
             "and reading and is left out of the average.\n"]
    for length, by_reading in results.items():
        for rd, s in by_reading.items():
            tasks = list(next(iter(s["rows"].values()))["scores"])
            head = [t + (" *" if t in s["excluded"] else "") for t in tasks]
            lines += [f"## {length} tokens, {rd}\n",
                      "| method | KV share | " + " | ".join(head) + " | average |",
                      "|---" * (len(tasks) + 3) + "|"]
            for name, r in s["rows"].items():
                lines.append(f"| {name} | {r['share']:.3f} | "
                             + " | ".join(fmt(r["scores"][t]) for t in tasks)
                             + f" | {fmt(r['average'])} |")
            lines.append("")
    for length, info in (m.get("peer_info") or {}).items():
        if "error" in info:
            lines += [f"kvpress could not run at {length} tokens:\n", "```", info["error"].strip(),
                      "```\n"]
            continue
        lines += [f"Peer at {length} tokens: kvpress {info['kvpress']} (transformers "
                  f"{info['transformers']}, torch {info['torch']}, its own venv) on the same "
                  "cases and readings; `kvpress:X b=B` is press X at compression_ratio 1 - B, "
                  "the prompt (`agnostic`: the context) compressed once after its prefill; "
                  "`full (kvpress)` is its uncompressed cache."]
        lines += [f"- {name} did not run: {why}" for name, why in info["failed"].items()]
        lines += [f"- {name} is not in this kvpress" for name in info["presses_missing"]]
        lines.append("")
    if kl:
        lengths = list(kl)
        lines += ["## Teacher-forced text quality\n",
                  f"{m['kl_windows']} windows of real text (`{m['text']}`) per length, "
                  f"{m['kl_tokens']} continuation tokens teacher-forced through each cache: "
                  "KL(full || method) per token and top-1 agreement with the full cache "
                  "(evaluate's `text_quality`).\n",
                  "| method | "
                  + " | ".join(f"KV share @{n} | KL @{n} | top-1 @{n}" for n in lengths) + " |",
                  "|---" * (1 + 3 * len(lengths)) + "|"]
        for name in kl[lengths[0]]:
            lines.append(f"| {name} | " + " | ".join(
                f"{kl[n][name]['share']:.3f} | {kl[n][name]['kl']:.4f} | {kl[n][name]['top1']:.3f}"
                for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def family(name: str) -> str:
    return name.split(" ")[0]


def plot(results: dict, path: Path) -> str | None:
    """Average score against KV share, a line per method, a panel per length and
    reading; None, or why no picture was drawn."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no picture (pip install matplotlib)"
    if not results:
        return "no tasks were run (--lengths given none): no picture"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = list(results)
    readings = [rd for rd in READINGS if rd in results[lengths[0]]]
    fig, axes = plt.subplots(len(readings), len(lengths), squeeze=False,
                             figsize=(max(4.5 * len(lengths), 10), 3.8 * len(readings)))
    families = list(dict.fromkeys(family(n) for n in results[lengths[0]][readings[0]]["rows"]))
    palette = plt.get_cmap("tab20").colors
    colors = {f: palette[i % len(palette)] for i, f in enumerate(families)}
    for i, rd in enumerate(readings):
        for j, length in enumerate(lengths):
            ax, rows = axes[i, j], results[length][rd]["rows"]
            # With every task under the floor (a random model), the plain mean.
            key = "average" if rows["full"]["average"] is not None else "average_all"
            for f in families:
                pts = sorted((r["share"], r[key]) for n, r in rows.items() if family(n) == f)
                if pts:
                    ax.plot(*zip(*pts), color=colors[f], label=f,
                            marker="*" if f == "full" else "o", ms=12 if f == "full" else 4,
                            lw=2.5 if f.startswith("fastgen") else 1,
                            ls="--" if f.startswith("kvpress") else "-")
            ax.set(title=f"{length} tokens, {rd}" + ("" if key == "average" else
                                                             " (every task under the floor)"),
                   xlabel="KV bytes allocated / full cache",
                   ylabel="average score", ylim=(-0.03, 1.03))
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    ncol = min(len(labels), 4)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9)
    rows = -(-len(labels) // ncol)  # the legend's, below the panels
    fig.tight_layout(rect=(0, 0.02 + 0.035 * rows / len(readings), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --- Main -------------------------------------------------------------------------------

# The settings a run takes unless told otherwise, and those of --quick.
# The default methods are those whose profiling reads a window of prompt rows;
# h2o and fastgen-paper profile every row (as the cache builds them), local,
# sink and tova the last alone, but their 18 replays a prompt would double
# the run. The defaults take about 3 hours on one busy core (studies/README.md).
DEFAULTS = dict(lengths=(2048, 4096), cases=20, budgets=(0.125, 0.25, 0.5),
                methods=("full", "fastgen", "snapkv"),
                kl_lengths=(4096, 8192), kl_windows=10, kl_tokens=64)
QUICK = dict(lengths=(512,), cases=1, budgets=(0.25,), methods=("full", "fastgen"),
             kl_lengths=(512,), kl_windows=1, kl_tokens=16)


def main(*, ckpt: str | None = None, out: str = "results/longctx/longctx", quick: bool = False,
         lengths=None, cases=None, tasks=TASKS, readings=READINGS, budgets=None, methods=None,
         thresholds=(0.9,), kl_lengths=None, kl_windows=None, kl_tokens=None,
         text: str = "pydoc", chat: bool = False, batch_tokens: int = 32768, seed: int = 0,
         threads: int | None = None, peer: str | None = None,
         peer_python: str = "/tmp/kvp/bin/python", peer_presses=PEER_PRESSES,
         command: str | None = None) -> dict:
    """Run the tasks and the text quality; write OUT.json, OUT.md and OUT.png and
    return {"results": {length: {reading: {"rows", "excluded"}}}, "text", "meta"}.
    Settings left at None take DEFAULTS, or with `quick` QUICK."""
    from generation import flags_of, load
    given = dict(lengths=lengths, cases=cases, budgets=budgets, methods=methods,
                 kl_lengths=kl_lengths, kl_windows=kl_windows, kl_tokens=kl_tokens)
    s = {k: (QUICK if quick else DEFAULTS)[k] if v is None else v for k, v in given.items()}
    lengths, cases, budgets, methods = s["lengths"], s["cases"], s["budgets"], s["methods"]
    kl_lengths, kl_windows, kl_tokens = s["kl_lengths"], s["kl_windows"], s["kl_tokens"]
    check(lengths=lengths, cases=cases, tasks=tasks, readings=readings, budgets=budgets,
          methods=methods, thresholds=thresholds, kl_lengths=kl_lengths, kl_windows=kl_windows,
          kl_tokens=kl_tokens, text=text, batch_tokens=batch_tokens)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model, tok = load(ckpt)
    flags = flags_of(model, tok)
    hay = Haystack(tok, text)
    cfgs = method_configs(methods, budgets, thresholds)
    context = model.args.max_seq_len
    longest_answer = max(NEW_TOKENS[t] for t in tasks)
    notes, results, raw, parts, kl, peer_info = [], {}, {}, {}, {}, {}
    # What each part's save writes until the run ends (a long run's results so far).
    partial_meta = dict(command=(command or "python -m studies.longctx") + " (not finished)",
                        model=Path(ckpt).name if ckpt else "SmolLM2-135M-Instruct", text=text,
                        format="ChatML" if chat else "plain", cases=cases, seed=seed,
                        tasks=list(tasks), kl_windows=kl_windows, kl_tokens=kl_tokens,
                        notes=notes, peer_info=peer_info, complete=False)
    for length in tqdm(lengths, desc="lengths"):
        L = min(length, context - longest_answer)
        if L < length:
            notes.append(f"{length} tokens with a {longest_answer}-token answer exceed the model's "
                         f"context of {context}: prompts of {L} tokens")
        t = time.perf_counter()
        batch = max(1, batch_tokens // L)
        # Every task's cases in one list: a batch may mix tasks (their answers'
        # lengths differ; each is cut to its own).
        todo = [c for task in tasks for c in make_cases(tok, hay, task, L, cases, seed, chat)]
        res = run_cases(model, tok, todo, cfgs, readings, flags, batch,
                        desc=f"batches @{L}")
        if peer == "kvpress":
            if ckpt is None:
                from convert_gguf import default_checkpoint
                ckpt = default_checkpoint()
            got, peer_info[str(L)] = peer_cases(peer_python, ckpt, tok, todo, readings, budgets,
                                                batch, torch.get_num_threads(), peer_presses)
            for rd, rows in got.items():
                res[rd] |= rows
        results[str(L)] = summarize(res, todo)
        raw[str(L)] = {rd: {n: [dict(task=c.task, required=c.answers, answer=a, score=s)
                                for c, a, s in zip(todo, r["answers"], r["scores"])]
                            for n, r in by.items()} for rd, by in res.items()}
        parts[f"tasks @{L}"] = time.perf_counter() - t
        save(out, results, kl, raw, tok, hay, dict(partial_meta, runtime_s=time.perf_counter() - t0,
                                                   runtime_by_part_s=parts), chat)
    for length in kl_lengths:
        t, L = time.perf_counter(), min(length, context - kl_tokens)
        if L < length:
            notes.append(f"text windows of {length} + {kl_tokens} tokens exceed the model's "
                         f"context of {context}: {L} + {kl_tokens}")
        windows = prompts(tok, kl_windows, L + kl_tokens, L + kl_tokens, seed, text)
        kl[str(L)] = evaluate.text_quality(model, windows, kl_tokens, cfgs, flags,
                                           max(1, batch_tokens // L))
        parts[f"text @{L}"] = time.perf_counter() - t
        save(out, results, kl, raw, tok, hay, dict(partial_meta, runtime_s=time.perf_counter() - t0,
                                                   runtime_by_part_s=parts), chat)
    meta = save(out, results, kl, raw, tok, hay, dict(
        command=command or "python -m studies.longctx" + (" --quick" if quick else ""),
        model=Path(ckpt).name if ckpt else "SmolLM2-135M-Instruct", text=text,
        format="ChatML" if chat else "plain", cases=cases, seed=seed, tasks=list(tasks),
        budgets=list(budgets), thresholds=list(thresholds), kl_windows=kl_windows,
        kl_tokens=kl_tokens, runtime_s=time.perf_counter() - t0, runtime_by_part_s=parts,
        notes=notes,
        peer_info=peer_info, complete=True), chat)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    return dict(results=results, text=kl, meta=meta)


def save(out, results, kl, raw, tok, hay, meta, chat):
    """Write OUT.json, OUT.md and OUT.png of the results so far; return the meta written."""
    meta = dict(machine=evaluate.machine(), torch=torch.__version__,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), **meta)
    meta["examples"] = {L: [asdict(c) | dict(context=tok.decode(c.context)[-300:],
                                             question=tok.decode(c.question))
                            for c in make_cases(tok, hay, "niah_single", int(L), 1, meta["seed"],
                                                chat)] for L in results}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta["picture"] = plot(results, output(out, ".png")) or output(out, ".png").name
    output(out, ".md").write_text(report(results, kl, meta)
                                      + "".join(f"\nNote: {n}.\n" for n in meta["notes"]))
    output(out, ".json").write_text(json.dumps(dict(meta=meta, results=results, text=kl,
                                                        cases=raw), indent=1))
    return meta


def check(*, lengths, cases, tasks, readings, budgets, methods, thresholds, kl_lengths,
          kl_windows, kl_tokens, text, batch_tokens):
    """Raise ValueError, naming the flag, for input out of range."""
    def need(ok, message):
        if not ok:
            raise ValueError(message)
    need(all(n >= 64 for n in lengths),
         f"--lengths must be 64 tokens or more (got {list(lengths)})")
    need(lengths or kl_lengths, "nothing to run: give --lengths, --kl-lengths or both")
    need(cases >= 1, f"--cases must be at least 1 (got {cases})")
    need(all(0 < b <= 1 for b in budgets), f"--budgets must be in (0, 1] (got {list(budgets)})")
    need(all(0 < t <= 1 for t in thresholds),
         f"--thresholds must be in (0, 1] (got {list(thresholds)})")
    for flag, given, known in (("--tasks", tasks, TASKS), ("--readings", readings, READINGS),
                               ("--methods", methods, METHODS)):
        bad = [x for x in given if x not in known]
        need(given and not bad, f"{flag}: unknown {', '.join(bad) or 'empty list'}; "
                                f"one or more of {', '.join(known)}")
    need(all(n >= 16 for n in kl_lengths),
         f"--kl-lengths must be 16 tokens or more (got {list(kl_lengths)})")
    need(kl_windows >= 1 and kl_tokens >= 2, f"--kl-windows must be at least 1 and --kl-tokens "
                                             f"at least 2 (got {kl_windows}, {kl_tokens})")
    need(text in SOURCES, f"--text must be one of {', '.join(SOURCES)} (got {text!r})")
    need(batch_tokens >= 1, f"--batch-tokens must be at least 1 (got {batch_tokens})")


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m studies.longctx",
        description="RULER-style long-context tasks (needles, variable tracking, common words) "
                    "in real text and teacher-forced KL, for FastGen and fixed KV policies at "
                    "equal KV bytes. Writes OUT.json, OUT.md and OUT.png.")
    p.add_argument("--ckpt", help="checkpoint folder or GGUF file (default SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/longctx/longctx",
                   help="output path without suffix (default results/longctx/longctx)")
    p.add_argument("--quick", action="store_true", help="a smoke test in under a minute: 1 case "
                   "per task at 512 tokens, budget 0.25, methods full and fastgen, one text "
                   "window of 512 + 16 tokens (flags given as well take precedence)")
    p.add_argument("--lengths", type=int, nargs="*",
                   help="prompt lengths in tokens (default 2048 4096; 8192 is clipped to the "
                        "model's context less the longest answer: 8152 for SmolLM2); none: "
                        "the text's KL alone")
    p.add_argument("--cases", type=int, help="cases per task and length (default 20)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), metavar="TASK",
                   help=f"tasks to run (default all: {' '.join(TASKS)})")
    p.add_argument("--readings", nargs="+", default=list(READINGS), metavar="READING",
                   help="question_last: the question is prefilled with the context; agnostic: "
                        "the context is compressed before the question is fed (default both)")
    p.add_argument("--budgets", type=float, nargs="+",
                   help="KV budgets of fastgen and the fixed policies, the share of the prompt "
                        "kept (default 0.125 0.25 0.5)")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help=f"methods, of {' '.join(METHODS)} (default full fastgen snapkv; "
                        "fastgen-paper and h2o read every prompt row, which costs 4x per "
                        "doubling of the length); fastgen-paper runs at --thresholds; full@4, "
                        "fastgen@16/8/4, fastgen-ask@16/8/4, h2o@8/@4 and snapkv@8/@4 store keys "
                        "and values in fewer bits, the fastgen ones' budget a share of a 16-bit "
                        "cache's bytes, the others' a share of the tokens; the full cache "
                        "always runs (the reference)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.9],
                   help="recovery thresholds T of fastgen-paper (default 0.9)")
    p.add_argument("--kl-lengths", type=int, nargs="*",
                   help="lengths of the text windows for KL and top-1 (default 4096 8192; none: "
                        "no text quality)")
    p.add_argument("--kl-windows", type=int, help="text windows per length (default 10)")
    p.add_argument("--kl-tokens", type=int,
                   help="continuation tokens teacher-forced per window (default 64)")
    p.add_argument("--text", default="pydoc", choices=SOURCES, help="real text for haystacks, "
                   "words and windows: the Python documentation (pydoc) or news prose (news: pip "
                   "install --no-deps gensim==4.4.0) (default pydoc)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat "
                   "template (default: plain text ending in the answer's first words, which this "
                   "small model answers better, as in evaluate's passkeys)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="prompt tokens per batch: "
                   "cases per batch = this / length (default 32768: 16 at 2k, 4 at 8k; the "
                   "recorded prefill holds about 115 kB a token for SmolLM2, 3.8 GB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cases and windows (default 0)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 "
                   "leaves the other core to other work")
    p.add_argument("--peer", choices=["kvpress"], help="also NVIDIA kvpress's presses ("
                   + ", ".join(x[:-5] for x in PEER_PRESSES) + ") at compression ratio 1 - "
                   "budget on the same cases and readings, in their own venv (see --peer-python)")
    p.add_argument("--peer-presses", nargs="+", default=list(PEER_PRESSES), metavar="PRESS",
                   help="kvpress classes to run with --peer (default " + " ".join(PEER_PRESSES)
                   + "; KVzipPress also runs, one prompt at a time, with a second pass over "
                   "the context: about 3 prefills a case and budget)")
    p.add_argument("--peer-python", default="/tmp/kvp/bin/python",
                   help="python of a venv with kvpress: python -m venv /tmp/kvp && "
                        "/tmp/kvp/bin/pip install torch==2.13.0 kvpress==0.5.5 (default "
                        "/tmp/kvp/bin/python)")
    a = p.parse_args(argv)
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    given = {k: getattr(a, k) for k in DEFAULTS}
    try:
        check(**{k: (QUICK if a.quick else DEFAULTS)[k] if v is None else v
                 for k, v in given.items()}, tasks=a.tasks, readings=a.readings,
              thresholds=a.thresholds, text=a.text, batch_tokens=a.batch_tokens)
    except ValueError as e:
        p.error(str(e))
    return a


if __name__ == "__main__":
    from generate import exit_on_user_error
    with exit_on_user_error():
        args = parse_args()
        try:
            got = main(command=" ".join(["python -m studies.longctx", *sys.argv[1:]]),
                       **vars(args))
        except ValueError as e:  # a length too short for a task, a context too small
            sys.exit(f"error: {e}")
    for length, by_reading in got["results"].items():
        for rd, s in by_reading.items():
            for name, r in s["rows"].items():
                print(f"{length:>5} {rd:13s} {name:26s} share {r['share']:.3f}  "
                      f"average {fmt(r['average'])}")
