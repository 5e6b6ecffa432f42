"""Where the needles were found: a `studies.longctx` run's needle cases by their needle's depth.

With the context compressed before the question (`agnostic`), nothing tells
the cache which needle a question will ask for. Splitting the cases by where
their needle sits (the share of the context before it) shows what each
method kept: a window finds the needles inside it and none before it.

    python -m studies.needle_depth results/longctx/scope_2k.json results/longctx/fixed_2k.json \\
        --rows full "fastgen/6 b=0.125" "sink b=0.125"

The cases are rebuilt from each run's recorded seed, text and format (the
same for the same seed); their answers must match the recorded ones, and
runs read together must hold the same cases.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

EDGES = (0.5, 0.75, 0.875)  # depth bands: before half, to three quarters, to 7/8, the last 1/8


def depths(tok, meta: dict, length: int) -> list[tuple[str, list[str], float]]:
    """(task, answers, depth) of every case a run with `meta` made at `length`,
    in the run's order; depth: the share of the context before the first answer."""
    from studies.longctx import Haystack, make_cases
    hay = Haystack(tok, meta["text"])
    out = []
    for task in meta["tasks"]:
        for c in make_cases(tok, hay, task, length, meta["cases"], meta["seed"],
                            meta["format"] == "ChatML"):
            text = tok.decode(c.context)
            out.append((task, c.answers, max(text.find(c.answers[0]), 0) / len(text)))
    return out


def by_band(cases: list[dict], made, edges=EDGES) -> tuple[list[int], list[float]]:
    """The needle cases per depth band and the sum of their scores per band;
    `made` the rebuilt cases (`depths`) the recorded `cases` must match."""
    if [c["required"] for c in cases] != [m[1] for m in made]:
        raise ValueError("the recorded answers are not those of the rebuilt cases "
                         "(another seed, text or version)")
    counts, found = [0] * (len(edges) + 1), [0.0] * (len(edges) + 1)
    for c, (task, _, depth) in zip(cases, made):
        if task.startswith("niah"):
            b = bisect.bisect(edges, depth)
            counts[b] += 1
            found[b] += c["score"]
    return counts, found


def by_depth(runs: list[dict], tok, rows=None, edges=EDGES) -> dict:
    """{length: {reading: {"cases": per band, "rows": {method: found per band}}}}
    over the needle tasks; found: the sum of the cases' scores."""
    out = {}
    for run in runs:
        for length, by_reading in run["cases"].items():
            made = depths(tok, run["meta"], int(length))
            for reading, methods in by_reading.items():
                slot = out.setdefault(length, {}).setdefault(reading, {"rows": {}})
                for name in [n for n in methods if not rows or n in rows]:
                    try:
                        counts, slot["rows"][name] = by_band(methods[name], made, edges)
                    except ValueError as e:
                        raise ValueError(f"{name} at {length}: {e}") from None
                    if slot.setdefault("cases", counts) != counts:
                        raise ValueError(f"{name} at {length}: the runs hold different cases")
    return out


def report(got: dict, edges=EDGES) -> str:
    cuts = ("0",) + tuple(f"{e:g}" for e in edges) + ("1",)
    head = [f"{a}-{b}" for a, b in zip(cuts, cuts[1:])]
    lines = []
    for length, by_reading in got.items():
        for reading, s in by_reading.items():
            n = s.get("cases", [0] * len(head))
            lines += [f"## {length} tokens, {reading}: needles found by depth", "",
                      "| method | " + " | ".join(f"{h} ({k})" for h, k in zip(head, n))
                      + f" | all ({sum(n)}) |", "|---" * (len(head) + 2) + "|"]
            lines += [f"| {name} | " + " | ".join(f"{v:g}" for v in found) + f" | {sum(found):g} |"
                      for name, found in s["rows"].items()]
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m studies.needle_depth",
                                description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="OUT.json files of `studies.longctx` runs")
    p.add_argument("--rows", nargs="+", help="the methods to show, as the runs name them "
                   "(default all)")
    p.add_argument("--ckpt", help="the runs' checkpoint, for its tokenizer "
                   "(default SmolLM2-135M-Instruct)")
    a = p.parse_args(argv)
    runs = []
    for f in a.runs:
        try:
            runs.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as e:
            p.error(f"cannot read {f}: {e}")
        if "cases" not in runs[-1]:
            p.error(f"{f} is not a studies.longctx result (no cases)")
    from convert_gguf import checkpoint_folder
    from tokenizer import Tokenizer
    tok = Tokenizer(checkpoint_folder(a.ckpt))  # the tokenizer alone, not the weights
    try:
        got = by_depth(runs, tok, a.rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(report(got))
    return got


if __name__ == "__main__":
    main()
