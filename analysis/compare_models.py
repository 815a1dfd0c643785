"""Paired comparison of two models of a finished run on one split: A - B per metric, with the paired bootstrap CI.

The stage table gives each model's CI on its own; whether two close rows really differ needs the paired CI
(the same lists resampled for both). This uses the report's machinery (`gr2.metrics.evaluate`, the same seed and
bootstrap samples as the profile), with B in the place of the floor:

    python -m analysis.compare_models --run runs/latest --a ar --b ar_sft --split test
    python -m analysis.compare_models --run runs/latest --a ar --b ltr --split test
    python -m analysis.compare_models --run runs/latest --a ar --b ltr --split val --length 5   (lists cut to 5)

A or B may also be a bundle folder (one with reranker.json: a model trained outside the DAG on the run's
sft_data, e.g. `gr2 train-ar --sft-data <run>/kfp/*/prepare-sft/sft_data --profile <variant>`), so that a recipe
tried by hand is judged on the run's lists as the run's own models are:

    python -m analysis.compare_models --run runs/latest --a <model>/bundle --b ltr --split val --limit 600

A bundle name or folder may end in `:bfloat16` to decode it in bf16 as `serving --dtype bfloat16` does, so a
dtype is judged on the lists it would serve (`--a rl:bfloat16 --b rl`: the same bundle in both dtypes),
or A or B is one of the run's feature-only rankers: `ltr` (the GBDT the evaluate-floor step fitted and
saved) or `teacher` (the reasoning teacher prepare-sft fitted, the trace's source), scored on the evidence
prepare-sft saved (the features every model saw).

prints (and with --out writes) JSON: the split, n lists, per metric A, B, A - B and its 95% CI, and `top1`: where
the two top-1 choices differ, split by whether the held-out item was the upstream (retriever) order's first, and
how often each model puts that first item on top (RL on GR2's reward can learn that position bias). Diffusion
models decode at --tau (default each model's operating tau, its bundle's); AR models with the AR decoder. Same decoding as the
evaluation step, so A and B match their rows of report.json on the test split.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.output import emit
from analysis.speed_check import load_models, split_lists
from components._lib.paths import repo_relative
from components._lib.steps import LTR_DIR
from gr2.candidates import cut_lists
from gr2.evidence import Evidence
from gr2.ltr import LTRModel
from gr2.metrics import evaluate
from gr2.stages.evaluate import rankings
from gr2.stages.prepare import list_features
from gr2.teacher import Teacher


def top1_breakdown(
    rank_a: list[list[int]], rank_b: list[list[int]], labels: list[int], a: str, b: str
) -> dict:
    """Top-1 wins of A over B (A right, B wrong) and of B over A, for lists whose label is the upstream first
    candidate (index 0) and for the rest; plus the share of lists where each model's top-1 is that candidate."""
    out: dict = {"label_first": {"lists": 0, f"{a}_wins": 0, f"{b}_wins": 0}}
    out["label_not_first"] = dict.fromkeys(out["label_first"], 0)
    for ra, rb, y in zip(rank_a, rank_b, labels, strict=True):
        cell = out["label_first" if y == 0 else "label_not_first"]
        cell["lists"] += 1
        cell[f"{a}_wins"] += int(ra[0] == y and rb[0] != y)
        cell[f"{b}_wins"] += int(rb[0] == y and ra[0] != y)
    n = max(1, len(labels))
    out["top1_is_first"] = {a: sum(r[0] == 0 for r in rank_a) / n, b: sum(r[0] == 0 for r in rank_b) / n}
    return out


FEATURE_RANKERS = ("ltr", "teacher")


def run_folder(run: Path, pattern: str) -> Path:
    """The (newest) folder of a run matching `pattern`."""
    found = sorted(run.glob(pattern))
    if not found:
        raise SystemExit(f"no {pattern} under {run}: a run from before it was saved? rerun it")
    return found[-1]


def feature_rankings(run: Path, name: str, df: pd.DataFrame) -> list[list[int]]:
    """A feature-only ranker's rankings of df's lists (`FEATURE_RANKERS`)."""
    sft = run_folder(run, "kfp/*/prepare-sft/sft_data")
    x = list_features(Evidence.load(sft / "evidence"), df)
    if name == "teacher":
        return Teacher.load(sft / "teacher.json").rank(x).tolist()
    return LTRModel.load(run_folder(run, f"kfp/*/evaluate-floor/report/{LTR_DIR}")).rank(x)


def compare(
    run: Path, a: str, b: str, split: str, tau: float | None = None, limit: int = 0, length: int = 0
) -> dict:
    profile, df = split_lists(run, split, limit)
    # --length: the lists cut as the report's by-length table cuts them (gr2/stages/evaluate.py `length_rows`)
    if length:
        df = cut_lists(df, [length] * len(df), profile.seed)
    models = load_models(run, [n for n in (a, b) if n not in FEATURE_RANKERS])
    taus = {name: getattr(m, "tau", None) if tau is None else tau for name, m in models.items()}
    ranks = {name: rankings(m, df, taus[name], profile)[0] for name, m in models.items()}
    ranks |= {name: feature_rankings(run, name, df) for name in (a, b) if name in FEATURE_RANKERS}
    n_boot, seed = profile.bootstrap_samples, profile.seed
    row_a = evaluate(df, ranks[a], floor_rankings=ranks[b], n_boot=n_boot, seed=seed)
    row_b = evaluate(df, ranks[b], n_boot=n_boot, seed=seed)
    metrics = {
        m: {
            a: row_a[m],
            b: row_b[m],
            "delta": row_a["delta_vs_floor_mean"][m],
            "ci95": row_a["delta_vs_floor"][m],
        }
        for m in row_a["delta_vs_floor"]
    }
    top1 = top1_breakdown(ranks[a], ranks[b], [int(y) for y in df["label"]], a, b)
    return {
        "run": repo_relative(str(Path(run).resolve())),
        "a": a,
        "b": b,
        "split": split,
        "length": length or None,
        "tau": taus.get(a),
        "n": len(df),
        "metrics": metrics,
        "top1": top1,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument(
        "--a", required=True, help="bundle name (e.g. ar, rl:bfloat16) or bundle folder; or ltr / teacher"
    )
    ap.add_argument("--b", required=True, help="bundle name (e.g. ar_sft) or bundle folder; or ltr / teacher")
    ap.add_argument("--split", default="test", choices=["train", "val", "test"])
    ap.add_argument(
        "--tau", type=float, help="diffusion commit threshold (default: each model's operating tau)"
    )
    ap.add_argument("--limit", type=int, default=0, help="only the split's first N lists (0: all)")
    ap.add_argument(
        "--length",
        type=int,
        default=0,
        help="each list cut to this many candidates, the held-out item kept (0: as they are)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    result = compare(Path(args.run).resolve(), args.a, args.b, args.split, args.tau, args.limit, args.length)
    return emit("analysis.compare_models", argv, result, args.out)


if __name__ == "__main__":
    main()
