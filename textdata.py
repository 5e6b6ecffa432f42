"""Real English text that ships offline with Python, for benchmarks and studies.

The text is the Python documentation's topic pages that `pydoc` shows for
`help("if")` and friends: the `pydoc_data.topics.topics` dict of the standard
library (about 80 topics, ~460k characters). It is part of the Python
documentation, Copyright (c) Python Software Foundation, distributed under
the PSF License Agreement (https://docs.python.org/3/license.html).

    from textdata import prompts
    ids = prompts(tok, n=30, min_tokens=512, max_tokens=2048, seed=0)
"""
from __future__ import annotations

import random


def documents(min_chars: int = 1000) -> list[tuple[str, str]]:
    """(name, text) of every topic with at least `min_chars` characters, sorted by name."""
    from pydoc_data.topics import topics
    return sorted((name, text.strip()) for name, text in topics.items()
                  if len(text.strip()) >= min_chars)


def prompts(tok, n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of token ids, their lengths spread evenly from `min_tokens` to
    `max_tokens`, cut from the topics in an order shuffled by `seed`.

    Each prompt takes topics one after the other (joined by a blank line) until
    it is long enough, and the next prompt starts at the next unused topic, so
    prompts share no text while the corpus lasts; then it starts over. The
    tokenizer's BOS, if it adds one, comes first. Same arguments, same ids.
    """
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens (got {min_tokens}, {max_tokens})")
    docs = [text for _, text in documents()]
    random.Random(seed).shuffle(docs)
    bos = tok.encode("", special=True)
    sep = tok.encode("\n\n", special=False)
    encoded: dict[int, list[int]] = {}
    step = (max_tokens - min_tokens) / max(n - 1, 1)
    out, next_doc = [], 0
    for i in range(n):
        length = round(min_tokens + i * step)
        ids = list(bos)
        while len(ids) < length:
            d = next_doc % len(docs)
            if d not in encoded:
                encoded[d] = tok.encode(docs[d], special=False)
            ids += (sep if len(ids) > len(bos) else []) + encoded[d]
            next_doc += 1
        out.append(ids[:length])
    return out
