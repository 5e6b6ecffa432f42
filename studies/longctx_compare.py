"""Rows of several `studies.longctx` runs side by side, on the cases they share.

    python -m studies.longctx_compare results/longctx/ask_4k.json results/longctx/suite.json \\
        --length 4096 --cases 10 --tasks niah_single niah_multikey

Runs of the same length and seed hold the same cases in the same order (a
run of n cases per task holds the first n of a longer one), so the first
`--cases` of each task compare case for case. Prints, per reading, each
method's average score over those cases of `--tasks` and its KV share (as
the run measured it over all of its cases).
"""
from __future__ import annotations

import argparse
import json


def rows(path: str, length: str, reading: str, tasks, cases: int) -> dict[str, float]:
    """{method: average score} over the first `cases` cases of each task."""
    run = json.load(open(path))
    by_method = run["cases"].get(length, {}).get(reading, {})
    out = {}
    for method, results in by_method.items():
        scores = [r["score"] for t in tasks for r in [r for r in results if r["task"] == t][:cases]]
        if len(scores) == cases * len(tasks):
            out[method] = sum(scores) / len(scores)
    return out


def shares(path: str, length: str, reading: str) -> dict[str, float]:
    table = json.load(open(path))["results"].get(length, {}).get(reading, {}).get("rows", {})
    return {m: r.get("share") for m, r in table.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="longctx JSON files")
    p.add_argument("--length", required=True)
    p.add_argument("--cases", type=int, default=20, help="first cases of each task (default 20)")
    p.add_argument("--tasks", nargs="+", default=["niah_single", "niah_multikey"])
    a = p.parse_args(argv)
    for reading in ("question_last", "agnostic"):
        print(f"\n{a.length} tokens, {reading}, first {a.cases} cases of {', '.join(a.tasks)}\n")
        print("| method | KV share | average | run |\n|---|---|---|---|")
        for path in a.runs:
            share = shares(path, a.length, reading)
            for method, score in rows(path, a.length, reading, a.tasks, a.cases).items():
                s = share.get(method)
                print(f"| {method} | {'' if s is None else f'{s:.3f}'} | {score:.3f} | {path} |")


if __name__ == "__main__":
    main()
