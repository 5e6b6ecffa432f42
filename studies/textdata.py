"""Real English text that ships offline, for benchmarks and studies.

`pydoc` (the default): the Python documentation's topic pages that `pydoc`
shows for `help("if")` and friends, the `pydoc_data.topics.topics` dict of the
standard library (about 80 topics, ~460k characters). Part of the Python
documentation, Copyright (c) Python Software Foundation, PSF License Agreement.

`news`: prose of another kind, 300 news articles of the Lee background corpus
(Lee, Pincombe and Welsh, 2005; ~360k characters), which gensim ships as test
data (`pip install --no-deps gensim==4.4.0`; gensim itself is never imported).

    from studies.textdata import prompts
    ids = prompts(tok, n=30, min_tokens=512, max_tokens=2048, seed=0, source="news")
"""
from __future__ import annotations

import random


SOURCES = ("pydoc", "news")


def documents(min_chars: int = 1000, source: str = "pydoc") -> list[tuple[str, str]]:
    """(name, text) of every document with at least `min_chars` characters, sorted by name."""
    if source == "news":
        import importlib.util
        from pathlib import Path
        spec = importlib.util.find_spec("gensim")
        path = spec and Path(spec.submodule_search_locations[0], "test", "test_data",
                             "lee_background.cor")
        if not path or not path.is_file():
            raise FileNotFoundError("the news text ships in gensim's test data; install it with "
                                    "pip install --no-deps gensim==4.4.0")
        lines = path.read_text(encoding="utf-8").splitlines()
        texts = {f"lee-{i:03d}": line.strip() for i, line in enumerate(lines)}
    elif source == "pydoc":
        from pydoc_data.topics import topics as texts
    else:
        raise ValueError(f"unknown text source {source!r}; one of {', '.join(SOURCES)}")
    return sorted((name, text.strip()) for name, text in texts.items()
                  if len(text.strip()) >= min_chars)


def prompts(tok, n: int, min_tokens: int, max_tokens: int, seed: int = 0,
            source: str = "pydoc") -> list[list[int]]:
    """`n` prompts of token ids, their lengths spread evenly from `min_tokens` to
    `max_tokens`, cut from the topics in an order shuffled by `seed`.

    Each prompt takes topics one after the other (joined by a blank line) until
    it is long enough, and the next prompt starts at the next unused topic, so
    prompts share no text while the corpus lasts; then it starts over. The
    tokenizer's BOS, if it adds one, comes first. Same arguments, same ids.
    """
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens (got {min_tokens}, {max_tokens})")
    docs = [text for _, text in documents(source=source)]
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
