"""Tensor parallel (tp.py): N gloo processes under torchrun give the single process's output.

The tests launch `torchrun` on generate.py or on this file (`worker`, at the
bottom), which runs the same work on every rank and has rank 0 save what it
got; the test then runs the work in one process and compares.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CORPUS, save_tiny_hf, save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello, world! How are you?", "The quick brown fox jumps over the lazy dog. Once"]
FOLLOW = [[5, 17, 42, 8, 99, 3], [7, 7, 1, 250, 64, 12]]  # teacher-forced continuations
NEW = 10
KINDS = ("full", "fastgen", "h2o", "snapkv")
# The budget mode, FastGen's default: the budget is shared by the heads of every
# cache.SCOPE layers (these models' two), every rank's.
BUDGETS = (0.5, 0.3)


def torchrun(n: int, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(n), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def split_into_shards(ckpt: Path):
    """Turn model.safetensors into two shards and an index, as large checkpoints come."""
    sd = load_file(ckpt / "model.safetensors")
    keys = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in halves.items():
        save_file({k: sd[k] for k in part}, ckpt / name, metadata={"format": "pt"})
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in halves.items() for k in part}}))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints with 8 query heads and 2 or 4 KV heads, or 6 and 3 (for 3 ranks);
    the second is sharded and its vocabulary (319) does not divide by 2 or 4."""
    out = {}
    for kv_heads, vocab in ((2, 320), (4, 319), (3, 320)):
        path = tmp_path_factory.mktemp(f"kv{kv_heads}") / "ckpt"
        vocab = save_tiny_tokenizer(path, vocab)
        shape = dict(num_attention_heads=6, hidden_size=96) if kv_heads == 3 else dict(
            num_attention_heads=8)
        save_tiny_hf(path, vocab_size=vocab, num_key_value_heads=kv_heads, eos_token_id=2,
                     bos_token_id=1, seed=kv_heads, **shape)
        if kv_heads == 4:
            split_into_shards(path)
        out[kv_heads] = path
    return out


def work(ckpt):
    """What every run computes: teacher-forced logits and greedy generations."""
    from generate import main
    from generation import CacheOptions, score
    from tokenizer import Tokenizer
    import tp

    model = tp.load_model(ckpt)  # this rank's share
    prompts = [Tokenizer(ckpt).encode(p) for p in PROMPTS]
    paper = CacheOptions("fastgen", paper=True, recovery=0.9)
    result = {"logits": score(model, prompts, FOLLOW),
              "logits_fastgen": score(model, prompts, FOLLOW, cache=paper),
              "logits_budget": score(model, prompts, FOLLOW,
                                     cache=CacheOptions("fastgen", kv_budget=0.4))}
    runs = {kv: paper if kv == "fastgen" else CacheOptions(kv) for kv in KINDS}
    runs |= {f"budget {b}": CacheOptions("fastgen", kv_budget=b) for b in BUDGETS}
    for name, options in runs.items():
        gen = main(PROMPTS, ckpt=str(ckpt), max_new_tokens=NEW, cache=options)
        result[name] = {k: getattr(gen, k) for k in
                        ("tokens", "plan", "recovery", "kv_bytes", "kv_bytes_per_rank",
                         "full_kv_bytes", "kept_tokens", "seen_tokens")}
    # Sampling: the ranks must draw the same tokens (gather_stats checks that they do).
    result["sampled"] = main(PROMPTS, ckpt=str(ckpt), max_new_tokens=NEW, temperature=1.0,
                             top_k=50, seed=1).tokens
    return result


@pytest.mark.parametrize("kv_heads, n", [(2, 2), (4, 2), (4, 4), (3, 3)])
def test_tensor_parallel_equals_one_process(ckpts, tmp_path, kv_heads, n, monkeypatch):
    out = tmp_path / "tp.pt"
    r = torchrun(n, __file__, "work", ckpts[kv_heads], out)
    assert r.returncode == 0, r.stderr
    got, want = torch.load(out), work(ckpts[kv_heads])
    for key in ("logits", "logits_fastgen", "logits_budget"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    for kv in (*KINDS, *(f"budget {b}" for b in BUDGETS)):
        g, w = got[kv], want[kv]
        assert g["tokens"] == w["tokens"], kv
        assert g["plan"] == w["plan"], kv
        torch.testing.assert_close(torch.tensor(g["recovery"]), torch.tensor(w["recovery"]))
        for key in ("full_kv_bytes", "kept_tokens", "seen_tokens"):
            assert g[key] == w[key], (kv, key)
        # A rank lays out its own pool: a group of heads with one policy is sized
        # by its largest, and a rank groups only its own heads, so the padding
        # (and the index tensors) may differ from one process's by a little.
        assert abs(g["kv_bytes"] - w["kv_bytes"]) <= 0.05 * w["kv_bytes"], kv
        assert len(g["kv_bytes_per_rank"]) == n and sum(g["kv_bytes_per_rank"]) == g["kv_bytes"]
    # FastGen compresses (with prompts this short, a head's round of free slots and
    # its index tensors can outweigh what it drops, so tokens are compared, not bytes).
    assert got["fastgen"]["kept_tokens"] < got["fastgen"]["seen_tokens"] and got["fastgen"]["plan"]
    assert len(got["sampled"]) == 2


# A prompt read in chunks, each chunk choosing every head's policy again: short
# chunks and the default method profiling a 4-row window, at which these random
# models' heads take TOVA often enough that choosing again offers it to heads of a
# rank none of whose heads took it at the first chunk (the pool must then hold
# what TOVA reads, as one process's does).
CHUNKED = [dict(kv="fastgen", kv_budget=b, prefill_chunk=16) for b in (0.5, 0.3)]


def chunked(ckpt):
    """What every run computes for CHUNKED: teacher-forced logits, greedy generations."""
    import cache
    import tp
    from generate import main
    from generation import CacheOptions, score
    from tokenizer import Tokenizer

    model, tok = tp.load_model(ckpt), Tokenizer(ckpt)
    ids = tok.encode(" ".join(CORPUS[:5]) * 4)
    prompts = [ids[:160], ids[7:167]]
    result, rows = {}, cache.ROWS
    cache.ROWS = 4
    try:
        for i, options in enumerate(CHUNKED):
            options = CacheOptions(**options)
            result[i, "logits"] = score(model, prompts, FOLLOW, cache=options)
            for batch in (prompts, prompts[:1]):
                gen = main([tok.decode(p) for p in batch], ckpt=str(ckpt), max_new_tokens=NEW,
                           cache=options)
                result[i, len(batch)] = {k: getattr(gen, k) for k in (
                    "tokens", "plan", "recovery", "kept_tokens", "seen_tokens")}
    finally:
        cache.ROWS = rows
    return result


@pytest.mark.parametrize("kv_heads, n", [(2, 2), (4, 2), (4, 4), (3, 3)])
def test_chunked_prefill_choosing_again_equals_one_process(ckpts, tmp_path, kv_heads, n,
                                                           monkeypatch):
    out = tmp_path / "tp.pt"
    r = torchrun(n, __file__, "chunked", ckpts[kv_heads], out)
    assert r.returncode == 0, r.stderr
    got, want = torch.load(out), chunked(ckpts[kv_heads])
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        if key[1] == "logits":
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            continue
        for field in ("tokens", "plan", "kept_tokens", "seen_tokens"):
            assert g[field] == w[field], (key, field)
        torch.testing.assert_close(torch.tensor(g["recovery"]), torch.tensor(w["recovery"]))


def test_cli_with_compile(ckpts, tmp_path):
    """The CLI under torchrun: --compile, only rank 0 prints, --save-plan counts every KV head."""
    from generate import main
    plan = tmp_path / "plan.json"
    r = torchrun(2, "generate.py", "--ckpt", ckpts[2], "--prompt", PROMPTS[0], "--max-new-tokens",
                 8, "--kv", "fastgen", "--save-plan", plan, "--compile")
    assert r.returncode == 0, r.stderr
    # The default, budget mode: one budget for every rank's heads, as in one process.
    from generation import CacheOptions
    alone = main(PROMPTS[0], ckpt=str(ckpts[2]), max_new_tokens=8, cache=CacheOptions("fastgen"))
    assert r.stdout == alone.texts[0] + "\n"
    assert json.loads(plan.read_text())["plan"] == alone.plan
    assert r.stderr.count("KV cache allocated") == 1 and "per rank" in r.stderr
    assert json.loads(plan.read_text())["n_kv_heads"] == 2


def test_n_that_does_not_divide_the_kv_heads_is_one_line(ckpts):
    r = torchrun(4, "generate.py", "--ckpt", ckpts[2], "--prompt", "hi", "--max-new-tokens", 2)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert lines == ["error: 4 processes cannot split this model's 2 KV heads and 96 MLP "
                     "columns evenly; run with --nproc-per-node 1 or 2"]


@pytest.mark.parametrize("where", ["load", "decode"])
def test_an_error_on_one_rank_ends_all_ranks(ckpts, where):
    """Rank 1 alone fails (a bad checkpoint while loading, or out of memory mid-generation):
    one message, a non-zero exit, no rank left waiting."""
    r = torchrun(2, __file__, f"fail_{where}", ckpts[2], timeout=60)
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: "), r.stderr


def test_ctrl_c_ends_all_ranks(ckpts):
    """Ctrl-C in a terminal signals torchrun and every rank (one process group)."""
    import signal
    import time
    p = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "generate.py", "--ckpt", str(ckpts[2]), "--prompt", "Hello", "--max-new-tokens", "240"],
        cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)  # rank 0 has started streaming
    os.killpg(p.pid, signal.SIGINT)
    t0 = time.perf_counter()
    p.communicate(timeout=60)
    assert p.returncode != 0 and time.perf_counter() - t0 < 30


def worker(task, ckpt, out=None):
    """Runs on each rank under torchrun."""
    import generate
    import generation
    import model
    import tp
    tp.init("cpu")
    if task in ("work", "chunked"):
        result = (work if task == "work" else chunked)(ckpt)
        if tp.rank() == 0:
            torch.save(result, out)
        tp.shutdown()
        return 0
    if tp.rank() == 1 and task == "fail_load":
        def broken(*args, **kwargs):
            raise model.CheckpointError("model-00002.safetensors is damaged (simulated)")
        tp.load_model = broken
    if tp.rank() == 1 and task == "fail_decode":
        def no_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("out of memory (simulated)")
        generation.decode_one_token = no_memory
    return generate.cli(["--ckpt", ckpt, "--prompt", "Hello", "--max-new-tokens", "5"])


if __name__ == "__main__":
    sys.exit(worker(*sys.argv[1:]))
