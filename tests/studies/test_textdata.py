"""The real texts the studies read: offline, the same every time, and read safely.

news and usenet ship in gensim's test data: requirements-test.txt installs gensim, so these
tests run (and fail, not skip, where it is missing)."""
import os
import pickle

import pytest

from studies.textdata import documents, plain_unpickle, prompts


class Tok:
    """Characters as token ids, a BOS of 1."""
    def encode(self, text, special=True):
        return [1] if special and not text else [ord(c) for c in text]


def test_prompts_are_the_same_for_the_same_seed_and_share_no_text():
    a = prompts(Tok(), 3, 200, 400, seed=1)
    assert a == prompts(Tok(), 3, 200, 400, seed=1)
    assert [len(p) for p in a] == [200, 300, 400] and all(p[0] == 1 for p in a)
    assert a != prompts(Tok(), 3, 200, 400, seed=2)


def test_usenet_posts_are_bodies_without_headers():
    docs = documents(source="usenet")
    assert len(docs) > 100 and sum(len(t) for _, t in docs) > 300_000
    assert not any(t.startswith(("From:", "Path:", "Newsgroups:")) for _, t in docs)
    assert any(t.lstrip().startswith(">") or "\n>" in t for _, t in docs)  # replies quote


def test_news_articles_are_whole_lines_of_the_lee_corpus():
    docs = documents(source="news")
    assert len(docs) > 100 and sum(len(t) for _, t in docs) > 200_000
    assert all(name.startswith("lee-") and "\n" not in t for name, t in docs)
    assert len(documents(0, source="news")) == 300


@pytest.mark.parametrize("source", ["news", "usenet"])
def test_prompts_of_each_source_are_the_same_for_the_same_seed(source):
    a = prompts(Tok(), 3, 200, 400, seed=1, source=source)
    assert a == prompts(Tok(), 3, 200, 400, seed=1, source=source)
    assert [len(p) for p in a] == [200, 300, 400] and a != prompts(Tok(), 3, 200, 400, seed=1)


def test_the_unpickler_refuses_code():
    class Evil:
        def __reduce__(self):
            return os.system, ("echo never",)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system|nt.system"):
        plain_unpickle(pickle.dumps(Evil(), protocol=0))
    assert plain_unpickle(pickle.dumps({"data": ["a", "b"]}, protocol=0)) == {"data": ["a", "b"]}


def test_an_unknown_source_is_named():
    with pytest.raises(ValueError, match="usenet"):
        documents(source="poetry")
