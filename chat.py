"""A chat whose KV cache lives across turns: `python generate.py --interactive`.

Each user turn is rendered with the checkpoint's chat template, and only the text the template
adds after what the cache already holds is encoded and fed, so a conversation is never encoded
twice. The full cache takes a turn in chunks of CHUNK tokens, a compressed one in chunks of
READ_AGAIN (what the reading reads at once), each attending over everything before it. A
compressed cache keeps of each chunk what its heads' policies keep
(FastGenCache.chunk): a turn counts as read, like the first, and each chunk chooses every
head's policy again, so the budget holds for the whole conversation. It chooses for questions
asked after (generation.read_again; after the first turn, by the lower READ_LAYERS of the
layers), as later turns ask about earlier ones, unless the options say `ask_after=False`
(`--no-ask-after`), or the cache runs the paper's method.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from cache import asks_after
from model import reserve
from generation import (READ_AGAIN, CacheOptions, decode, dense_kv_bytes, make_caches, read_again,
                        sample)
from tokenizer import TokenizerError, not_utf8_at

CHUNK = 512  # tokens per call when the full cache takes a turn; also the step by which it grows.
# A turn after the first is read again by this share of the layers, from the bottom: that share
# of a forward pass, not a whole one; the layers above take each token's most from below
# (cache.read_piece). Tuned on news; studies/README.md, chat_recall.
READ_LAYERS = 0.3


class ConversationFull(Exception):
    """A turn does not fit in what is left of the cache; the chat can go on with a shorter one."""


class NotText(Exception):
    """A turn that is not text (standard input's bytes that are not UTF-8, read as surrogate
    escapes); nothing of it was fed, and the chat can go on with the line retyped."""


@dataclass
class Turn:
    """One user turn, its answer, and what the cache holds afterwards."""
    fed: list[int]          # tokens this turn put into the cache: the end of the last answer, the user turn
    tokens: list[int]       # the answer's ids (EOS included if produced)
    text: str
    prefill_s: float        # feeding `fed`
    decode_s: float
    decode_steps: int
    cache_len: int          # conversation tokens the cache has seen
    kept_tokens: int        # (layer, KV head, token) triples the cache holds
    seen_tokens: int        # the same count for a full cache: layers x KV heads x cache_len
    kv_bytes: int           # allocated by the cache
    full_kv_bytes: int      # a full cache holding cache_len tokens
    compile_s: float = 0.0
    interrupted: bool = False  # Ctrl-C stopped the answer
    capped: bool = False       # the answer was cut short to stay within the cache's room
    plan: list[list[str]] = field(default_factory=list)  # first turn of a compressed cache only
    full_kv_bits: int | None = None  # full_kv_bytes with K and V in this many bits (None: the model's)

    def summary(self, number: int) -> str:
        rate = len(self.fed) / max(self.prefill_s, 1e-9)
        allocated = f"KV allocated {self.kv_bytes / 2**20:.2f} MiB"
        return (f"[turn {number}] fed {len(self.fed)} tokens in {self.prefill_s:.2f} s ({rate:.1f} "
                f"tok/s), answered {len(self.tokens)} in {self.decode_s:.2f} s"
                + (" (cut short: the cache is nearly full)" if self.capped else "")
                + f"; the cache has seen {self.cache_len} tokens and holds "
                f"{self.kept_tokens / self.seen_tokens:.1%} of them; {allocated} vs "
                f"{self.full_kv_bytes / 2**20:.2f} MiB for a full cache of {self.cache_len} tokens"
                + (" in 16 bits" if self.full_kv_bits else ""))


class Chat:
    """A conversation with one model and one cache, turn after turn (batch 1).

    The cache that `cache` describes is created by the first turn. The full cache grows with
    the conversation, in steps of CHUNK tokens, up to the model's context; a compressed cache's
    pools grow as its heads hold more.
    """

    def __init__(self, model, tok, *, cache: CacheOptions = CacheOptions(), max_new_tokens=128,
                 compile=False, token_flags=None, sampling=None):
        # The dense cache grows by CHUNK; a full cache in 8 bits or fewer is a compressed one's pool.
        self.full = cache.kv == "full" and cache.kv_bits in (None, (16,))
        if cache.ask_after is None:  # every turn asks after the ones before
            cache = replace(cache, ask_after=cache.kv != "full" and not cache.paper)
        self.model, self.tok, self.cache = model, tok, cache
        self.max_new_tokens, self.compile = max_new_tokens, compile
        self.token_flags, self.sampling = token_flags, sampling or {}
        self.device = model.tok_embeddings.weight.device
        self.messages: list[dict] = []
        self.rendered = ""   # the conversation as the template renders it, up to the last answer
        self.pending: list[int] = []  # the last answer's final token, sampled but not yet fed
        self.length = 0      # tokens in the cache, at positions 0 .. length-1
        self.limit = 0       # the most it can hold; set by the first turn

    @torch.no_grad()  # else every turn's activations stay alive, held by the cache's graph
    def turn(self, text: str, on_token=None, stop=lambda: False) -> Turn:
        """Feed a user turn on top of the cache and answer it. `stop()` is asked after each
        token; True ends the answer there, between two decode steps, so the cache stays whole."""
        at = not_utf8_at(text)
        if at is not None:  # before anything is fed: the conversation stays as it was
            raise NotText(f"this line is not UTF-8 text (byte {at}) and was not sent; set the "
                          "terminal to UTF-8 or convert the text (e.g. with iconv), and send it "
                          "again")
        messages = self.messages + [{"role": "user", "content": text}]
        rendered = self.tok.apply_chat(messages)
        if not rendered.startswith(self.rendered):
            raise TokenizerError("the chat template rewrites earlier turns when a new one is "
                                 "added, so the cache cannot be kept across turns")
        # BOS (if the tokenizer adds one) only at the start of the conversation.
        fed = self.pending + self.tok.encode(rendered[len(self.rendered):], special=not self.length)
        first = self.length == 0
        if first:
            self.start(len(fed))
        # An answer of n tokens adds n - 1 to the cache: the last one is sampled, not fed.
        room = self.limit - self.length - len(fed) + 1
        if room < 1:
            raise ConversationFull(
                f"this turn ({len(fed)} tokens) does not fit: the cache holds {self.length} of the "
                f"{self.limit} tokens it has room for; write less, or start a new chat")
        n_max = min(self.max_new_tokens, room)
        if self.full:
            need = -(-(self.length + len(fed) + n_max) // CHUNK) * CHUNK
            for cache in self.model.caches():
                cache.grow(min(need, self.limit))

        t0 = time.perf_counter()
        cur = self.feed(fed, first)
        prefill_s = time.perf_counter() - t0
        self.length += len(fed)
        out: list[int] = []
        eos = set(self.tok.eos_ids)

        def emit(c):
            out.append(int(c[0, 0]))
            if on_token:
                on_token(0, out[-1])
            return out[-1] in eos or stop()

        steps, decode_s, compile_s = 0, 0.0, 0.0
        if not emit(cur):
            pos = torch.tensor([[self.length]], device=self.device)
            steps, decode_s, compile_s, _ = decode(self.model, cur, pos, n_max - 1, emit,
                                                   self.compile, **self.sampling)
        self.length += steps
        self.pending = [] if out[-1] in eos else out[-1:]
        reply = self.tok.decode([t for t in out if t not in eos])
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.rendered = rendered + reply
        return self.stats(fed, out, reply, prefill_s, decode_s, steps, compile_s, first,
                          interrupted=stop() and out[-1] not in eos,
                          capped=len(out) == n_max < self.max_new_tokens and out[-1] not in eos)

    def start(self, first_len: int):
        """Create the caches for a conversation whose first turn has first_len tokens."""
        context = self.model.args.max_seq_len
        if first_len >= context:
            raise ConversationFull(f"the first turn ({first_len} tokens) fills the model's context "
                                   f"of {context} tokens; write less")
        # The full cache starts empty (grown before each turn); a compressed one is laid out
        # for the first answer, and grows past it.
        self.model.setup_caches(make_caches(self.model, self.cache, [first_len],
                                            1 - first_len if self.full else self.max_new_tokens,
                                            self.token_flags))
        self.limit = context  # positions 0 .. context - 1

    def feed(self, ids: list[int], first: bool):
        """Put ids into the cache after what it holds; returns the token sampled after them.
        In chunks; a compressed cache's first turn in one call, which profiles it, its later
        ones in chunks of READ_AGAIN: each pays a reading and a choosing, whatever its length."""
        model, start = self.model, self.length
        chunk = CHUNK if self.full else len(ids) if first else READ_AGAIN
        for i in range(0, len(ids), chunk):
            part = torch.tensor([ids[i:i + chunk]], device=self.device)
            n = part.shape[1]
            if not first or i:  # a chunk on top of the cache (a compressed one keeps its share)
                reserve(model.caches(), torch.tensor([n], device=self.device))
            pos = torch.arange(start + i, start + i + n, device=self.device)[None]
            logits = model(part, pos, logits_at=torch.tensor([n - 1], device=self.device))
            if asks_after(model.caches()):  # what it keeps of the chunk, chosen for later turns
                read_again(model, part, torch.tensor([n], device=self.device), start=pos[:, -1] + 1,
                           layers=None if first else math.ceil(READ_LAYERS * len(model.layers)))
        return sample(logits[:, 0], **self.sampling)[:, None]

    def stats(self, fed, out, reply, prefill_s, decode_s, steps, compile_s, first, **flags) -> Turn:
        caches, a = self.model.caches(), self.model.args
        seen = a.n_layers * a.n_kv_heads * self.length
        turn = Turn(fed, out, reply, prefill_s, decode_s, steps - (1 if self.compile and steps else 0),
                    self.length, seen if self.full else sum(c.kept() for c in caches), seen,
                    sum(c.nbytes() for c in caches),
                    dense_kv_bytes(self.model, 1, self.length, 16 if self.cache.kv_bits else None),
                    compile_s, full_kv_bits=16 if self.cache.kv_bits else None, **flags)
        if first and not self.full:
            turn.plan = [c.plan_names() for c in caches]
        return turn
