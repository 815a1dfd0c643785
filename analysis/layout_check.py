"""A student against its AR teacher at every list length, with and without the layout's tokens committed first.

Greedy block diffusion commits the tokens the layout fixes (trace labels, the answer's head, separators, tail,
eos) before a block's first round (gr2/decode.py `layout_commits`). This measures what that changes: each list of
a split is cut to every length 2..N (seeded, the held-out item kept, as the report's table by list length), then
decoded by `ar` and by the student at each tau, once as the decoders do now and once with `layout_commits` a
no-op (the decoders before it):

    python -m analysis.layout_check --run runs/latest --model rl --split val --taus 0.4,0.9

Per length and tau: R@1 of each and its paired difference with `ar` (95% normal interval), and how far the
student's trace levels are from `ar`'s (mean |level difference| per candidate). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

import gr2.decode
from analysis.output import print_json, provenance
from analysis.speed_check import find_bundles, split_lists
from gr2.candidates import cut_lists
from gr2.prompt import parse_trace, response_trace
from gr2.stages.evaluate import decode_answers, load


def paired(a: np.ndarray, b: np.ndarray) -> dict:
    """Mean of b - a with a 95% normal interval (per-list hits or values)."""
    d = b.astype(float) - a.astype(float)
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return {"mean": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)]}


def trace_levels(reranker, responses: list[list[int]], n: int) -> np.ndarray:
    """[lists, n] the trace's level per candidate (-1 where a trace does not parse)."""
    out = np.full((len(responses), n), -1)
    for i, r in enumerate(responses):
        levels = parse_trace(response_trace(reranker.tokenizer.decode(r, skip_special_tokens=False)), n)
        if levels is not None:
            out[i] = levels
    return out


def check(run: Path, model: str, split: str, taus: list[float]) -> dict:
    profile, df = split_lists(run, split)
    ar, student = (load(p) for p in find_bundles(run, ["ar", model]).values())
    real = gr2.decode.layout_commits
    rows = []
    N = int(df["candidates"].map(len).max())
    for n in range(2, N + 1):
        lists = cut_lists(df, [n] * len(df), profile.seed)
        y = lists["label"].to_numpy()
        a, ra = decode_answers(ar, lists, "ar", None, profile)
        hit_ar = np.array([x.ranking[0] == t for x, t in zip(a, y, strict=True)])
        lev_ar = trace_levels(ar, ra, n)
        for tau in taus:
            for layout in (False, True):
                gr2.decode.layout_commits = real if layout else (lambda d, blk: None)
                try:
                    s, rs = decode_answers(student, lists, "diffusion", tau, profile)
                finally:
                    gr2.decode.layout_commits = real
                hit = np.array([x.ranking[0] == t for x, t in zip(s, y, strict=True)])
                lev = trace_levels(student, rs, n)
                both = (lev >= 0).all(1) & (lev_ar >= 0).all(1)
                rows.append(
                    {
                        "length": n,
                        "lists": len(lists),
                        "tau": tau,
                        "layout_commits": layout,
                        "ar_recall@1": float(hit_ar.mean()),
                        "recall@1": float(hit.mean()),
                        "minus_ar": paired(hit_ar, hit),
                        "validity": float(np.mean([x.valid for x in s])),
                        "level_gap": float(np.abs(lev - lev_ar)[both].mean()) if both.any() else None,
                    }
                )
                print(
                    f"n={n} tau={tau} layout={layout}: R@1 {hit.mean():.3f} (ar {hit_ar.mean():.3f}), "
                    f"level gap {rows[-1]['level_gap']}",
                    file=sys.stderr,
                    flush=True,
                )
    return {
        "run": run.name,
        "model": model,
        "split": split,
        "rows": rows,
    }


def markdown(res: dict) -> str:
    out = [
        f"# `{res['model']}` against `ar` by list length, with and without the layout's tokens first",
        "",
        f"- command: `{res['command']}`",
        f"- run `{res['run']}`, split `{res['split']}`, measured at `{res['git_sha']}`",
        f"- machine: {res['machine']['cpu']} x{res['machine']['cores']}, torch {res['machine']['torch']}",
        "",
        "| length | lists | tau | layout first | `ar` R@1 | R@1 | R@1 - `ar` [95% CI] | validity | level gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        d = r["minus_ar"]
        gap = "—" if r["level_gap"] is None else f"{r['level_gap']:.2f}"
        out.append(
            f"| {r['length']} | {r['lists']} | {r['tau']:.2f} | {'yes' if r['layout_commits'] else 'no'} | "
            f"{r['ar_recall@1']:.3f} | {r['recall@1']:.3f} | {d['mean']:+.3f} [{d['ci95'][0]:+.3f}, "
            f"{d['ci95'][1]:+.3f}] | {r['validity']:.3f} | {gap} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument("--model", default="rl", help="the diffusion bundle")
    ap.add_argument("--split", default="val", choices=["train", "val", "test"])
    ap.add_argument("--taus", default="0.4", help="comma-separated commit thresholds")
    ap.add_argument("--out", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    taus = [float(t) for t in args.taus.split(",") if t.strip()]
    res = provenance("analysis.layout_check", argv, machine=True) | check(
        Path(args.run).resolve(), args.model, args.split, taus
    )
    if args.out:
        Path(args.out).with_suffix(".md").write_text(markdown(res))
    print_json(res, args.out and str(Path(args.out).with_suffix(".json")))
    return res


if __name__ == "__main__":
    main()
