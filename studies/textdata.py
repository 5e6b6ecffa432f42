"""Real English text that ships offline, for benchmarks and studies.

`pydoc` (the default): the Python documentation's topic pages that `pydoc`
shows for `help("if")` and friends, the `pydoc_data.topics.topics` dict of the
standard library (about 80 topics, ~460k characters). Part of the Python
documentation, Copyright (c) Python Software Foundation, PSF License Agreement.

`news`: prose of another kind, 300 news articles of the Lee background corpus
(Lee, Pincombe and Welsh, 2005; ~360k characters), which gensim ships as test
data (`pip install --no-deps gensim==4.4.0`; gensim itself is never imported).

`usenet`: informal discussion, 200 Usenet posts of 1993 from alt.atheism and
sci.space (a sample of the 20 Newsgroups collection, ~370k characters without
their headers), replies quoting the post they answer; gensim's test data too.

    from studies.textdata import prompts
    ids = prompts(tok, n=30, min_tokens=512, max_tokens=2048, seed=0, source="news")
"""
from __future__ import annotations

import random


SOURCES = ("pydoc", "news", "usenet")


def documents(min_chars: int = 1000, source: str = "pydoc") -> list[tuple[str, str]]:
    """(name, text) of every document with at least `min_chars` characters, sorted by name."""
    if source == "news":
        lines = gensim_data("lee_background.cor").read_text(encoding="utf-8").splitlines()
        texts = {f"lee-{i:03d}": line.strip() for i, line in enumerate(lines)}
    elif source == "usenet":
        texts = {f"usenet-{i:03d}": post for i, post in enumerate(usenet_posts())}
    elif source == "pydoc":
        from pydoc_data.topics import topics as texts
    else:
        raise ValueError(f"unknown text source {source!r}; one of {', '.join(SOURCES)}")
    return sorted((name, text.strip()) for name, text in texts.items()
                  if len(text.strip()) >= min_chars)


def gensim_data(name: str):
    """The path of a file of gensim's test data, without importing gensim."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("gensim")
    path = spec and Path(spec.submodule_search_locations[0], "test", "test_data", name)
    if not path or not path.is_file():
        raise FileNotFoundError("the news and usenet texts ship in gensim's test data; install "
                                "it with pip install --no-deps gensim==4.4.0")
    return path


def usenet_posts() -> list[str]:
    """The bodies of the posts in gensim's `mini_newsgroup`, a zlib-compressed
    pickle of scikit-learn's 20 Newsgroups loader, read by `plain_unpickle`."""
    import zlib
    posts = plain_unpickle(zlib.decompress(gensim_data("mini_newsgroup").read_bytes()))["data"]
    # A post is its headers (From:, Subject:, Path: ...), a blank line, the body.
    return [post.split("\n\n", 1)[-1].strip() for post in posts]


def plain_unpickle(raw: bytes):
    """Unpickle data made of dicts, lists and strings, with neither
    scikit-learn nor numpy: their objects become plain dicts (a numpy array
    an empty one), and any other class is refused, so the data runs no code."""
    import copyreg
    import io
    import pickle

    class Plain(dict):
        def __setstate__(self, state):
            self.update(state if isinstance(state, dict) else {})

    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in (("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor")):
                return copyreg._reconstructor
            if module in ("__builtin__", "builtins") and name in ("dict", "object"):
                return dict if name == "dict" else object
            if name == "Bunch" or module.startswith("numpy"):
                return Plain if name == "Bunch" else (lambda *args: Plain())
            raise pickle.UnpicklingError(f"refused to load {module}.{name}")

    return Reader(io.BytesIO(raw), encoding="latin1").load()


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
