"""Which heads copy, and are they the heads a text's far copies read?

`cache.copy_heads` marks a KV head as copying by a probe: random tokens said
twice, and the attention each row of the repeat gives the token after its own
earlier occurrence (an induction head). This prints every KV head's probe
score over three draws, then, for windows of real text continued by the full
cache, the attention the continuation's rows give the tokens that follow an
earlier occurrence of their last two tokens more than 64 tokens back: what a
far copy reads.

    python -m studies.copy_heads --text news --windows 30 --out results/copy_heads/news
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from profiling import COPY_SHARE, row_probs
from studies.attention_study import table

PROMPT, NEW, NEAR = 768, 64, 64  # text windows as studies.evaluate's; nearer repeats are local


def far_copy_mass(recorders, ids: list[int]) -> tuple[torch.Tensor, int]:
    """(layers, K) the attention the continuation's rows with a far repeat give the token after
    it, the mean over those rows, the most of a KV head's query heads; and how many rows."""
    T = len(ids)
    target = torch.zeros(NEW, T, dtype=torch.bool)
    for r in range(NEW):
        i = PROMPT + r
        for j in range(1, i - NEAR):
            if ids[j] == ids[i] and ids[j - 1] == ids[i - 1]:
                target[r, j + 1] = True
    rows = target.any(1)
    out = []
    for rec in recorders:
        q, k, _ = rec.qkv
        H, K = q.shape[1], k.shape[1]
        probs = row_probs(q, k, torch.arange(PROMPT, T))  # (H, NEW, T)
        mass = (probs * target).sum(-1)[:, rows].mean(1) if rows.any() else torch.zeros(H)
        out.append(mass.view(K, H // K).amax(1))
    return torch.stack(out), int(rows.sum())


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--text", default="news", choices=["pydoc", "news", "usenet"],
                   help="real text (studies/textdata.py; default news)")
    p.add_argument("--windows", type=int, default=30, help="text windows, as evaluate's (30)")
    p.add_argument("--show", type=int, default=10, help="heads listed, by score (10)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", help="also write OUT.md (default: print only)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import cache
    from generation import flags_of, load
    from studies.evaluate import machine, record
    from studies.textdata import prompts

    model, tok = load(args.ckpt)
    flags = flags_of(model, tok)
    probe = torch.stack([cache.induction_probe(model, flags, seed) for seed in range(3)])
    marked = cache.copy_heads(model, flags)
    L, K = marked.shape
    mass, n_rows = torch.zeros(L, K), 0
    for ids in prompts(tok, args.windows, PROMPT + NEW, PROMPT + NEW, 0, args.text):
        recorders, *_ = record(model, [ids])
        m, n = far_copy_mass(recorders, ids)
        mass, n_rows = mass + m * n, n_rows + n
    mass = mass / max(n_rows, 1)
    order = probe.mean(0).flatten().argsort(descending=True)[:args.show]
    rows = [(f"{int(h) // K}.{int(h) % K}",
             " / ".join(f"{float(d.flatten()[h]):.2f}" for d in probe),
             "yes" if bool(marked.flatten()[h]) else "",
             f"{float(mass.flatten()[h]):.3f}",
             int((mass.flatten() > mass.flatten()[h]).sum()) + 1) for h in order]
    text = (f"{int(marked.sum())} of {marked.numel()} KV heads copy (probe score at least "
            f"{COPY_SHARE}); {n_rows} continuation rows of {args.windows} {args.text} windows "
            "read a far repeat\n\n"
            + table(["layer.head", "probe score, three draws", "copies", "far-copy attention",
                     "its rank of all heads"], rows))
    print(text)
    if args.out:
        out = Path(args.out).with_suffix(".md")
        out.parent.mkdir(parents=True, exist_ok=True)
        when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        command = "python -m studies.copy_heads " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])
        out.write_text(f"# Copy heads\n\nMeasured on {machine()}, torch {torch.__version__}, "
                       f"{when}.\n\n    {command}\n\n{text}\n")


if __name__ == "__main__":
    sys.exit(main())
