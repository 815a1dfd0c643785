"""How far the evidence features go on their own: the run's feature-only rankers, and blends of them, against `ltr`.

Issue 40 asks for a generative re-ranker that beats the best feature-only ranker. A blend of feature rankers that
beats `ltr` would raise that bar, so this measures the candidates on one split (validation: the choice is made
there, never on test):

    python -m analysis.feature_rankers --run runs/latest --split val --out benchmarks/<dataset>_feature_rankers_val.json

- `ltr`: the GBDT the evaluate-floor step fitted (raw evidence plus list context; its grid chosen on validation);
- `teacher`: the reasoning teacher prepare-sft fitted, the trace's source (a conditional logit on the prompt's
  evidence buckets);
- `teacher_raw`: the same conditional logit fitted here on the raw evidence of the run's training lists;
- `ltr+teacher`, `ltr+teacher_raw`: w * ltr + (1 - w) * the other, each score standardised within its list. w is
  chosen on one half of the lists and scored on the other (both ways), so the blend's figure is out of sample.
- with `--nn-seeds` > 0, networks trained on the training lists' held-out items (analysis/listwise_ranker.py, the
  mean of that many seeds' scores): `mlp`, each candidate from its own evidence and list context as `ltr`, and
  `listwise`, with attention across the list: how far the evidence alone goes, the list's share apart;
- with `--seq-epochs` > 0, the history as a sequence: `seq`, a SASRec fitted here on the run's training sequences
  (gr2/sequential.py; not a feature ranker: it reads item ids), and its blends `ltr+seq`, `teacher+seq`.

Each row: R@1 and NDCG@5, and its paired difference from `ltr` with the bootstrap CI of the run's profile
(`gr2.metrics.evaluate`, ltr in the place of the floor, as `analysis.compare_models` does). Prints (and with --out
writes) JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.compare_models import run_folder
from analysis.listwise_ranker import SHAPES, ListwiseConfig, fit_listwise
from analysis.output import emit
from components._lib.paths import repo_relative
from components._lib.sources import read_dataset
from components._lib.steps import LTR_DIR
from gr2.config import Profile, SequenceConfig
from gr2.data.split import train_sequences
from gr2.evidence import Evidence
from gr2.ltr import LTRModel, rankings_from_scores
from gr2.metrics import evaluate
from gr2.sequential import fit_sequence_model
from gr2.stages.prepare import list_features
from gr2.teacher import Teacher, fit_teacher
from pipelines.run_local import run_examples, run_profile

WEIGHTS = np.linspace(0.0, 1.0, 21)  # the blend weights tried on each half


def standardise(scores: np.ndarray) -> np.ndarray:
    """[L, N] scores -> each list's scores with mean 0 and std 1 (a constant list: all 0)."""
    centred = scores - scores.mean(axis=1, keepdims=True)
    std = scores.std(axis=1, keepdims=True)
    return np.divide(centred, std, out=np.zeros_like(centred), where=std > 0)


def top1_hits(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """[L] 1.0 where the best-scored candidate (ties: retriever order) is the held-out item."""
    return (np.argsort(-scores, axis=1, kind="stable")[:, 0] == labels).astype(float)


def cross_fitted_blend(
    a: np.ndarray, b: np.ndarray, labels: np.ndarray, seed: int
) -> tuple[np.ndarray, list[float]]:
    """Scores of w * a + (1 - w) * b (both standardised per list), where each half of the lists gets the w that
    scored best (R@1; ties: the w nearer 0.5) on the other half. Returns the scores and the two weights."""
    za, zb = standardise(a), standardise(b)
    half = np.random.default_rng(seed).permutation(len(labels)) < len(labels) // 2
    out, chosen = np.zeros_like(za), []
    for fit_on in (half, ~half):

        def score(w: float, rows: np.ndarray = fit_on) -> tuple[float, float]:
            return float(top1_hits(w * za[rows] + (1 - w) * zb[rows], labels[rows]).mean()), -abs(w - 0.5)

        w = float(max(WEIGHTS, key=score))
        chosen.append(round(w, 2))
        out[~fit_on] = w * za[~fit_on] + (1 - w) * zb[~fit_on]
    return out, chosen


def feature_scores(
    run: Path,
    profile: Profile,
    evidence: Evidence,
    x: np.ndarray,
    x_train: np.ndarray,
    train_labels: np.ndarray,
) -> dict[str, np.ndarray]:
    """[L, N] scores of each feature-only ranker on the lists of `x` (their evidence; module docstring); the
    raw-evidence logit is fitted on the training lists (`x_train`, `train_labels`)."""
    raw = fit_teacher(
        x_train,
        train_labels,
        evidence.feature_names,
        dataclasses.replace(profile.teacher, inputs="raw"),
        profile.prompt.score_levels,
        profile.seed,
    )
    ltr = LTRModel.load(run_folder(run, f"kfp/*/evaluate-floor/report/{LTR_DIR}"))
    teacher = Teacher.load(run_folder(run, "kfp/*/prepare-sft/sft_data") / "teacher.json")
    return {
        "ltr": np.log(
            np.clip(ltr.scores(x), 1e-12, 1.0)
        ),  # log: the probability's order, a scale to standardise
        "teacher": teacher.scores(x),
        "teacher_raw": raw.scores(x),
    }


def network_scores(
    x: np.ndarray,
    n: np.ndarray,
    x_train: np.ndarray,
    n_train: np.ndarray,
    train_labels: np.ndarray,
    seeds: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """[L, N] scores of the lists of `x` (lengths `n`) by each network shape (`analysis.listwise_ranker.SHAPES`),
    the mean of `seeds` fits on the training lists' raw evidence; a row past a list's end scores -inf."""
    out = {}
    for shape in SHAPES:
        fits = [
            fit_listwise(x_train, n_train, train_labels, ListwiseConfig(shape=shape), seed + k)
            for k in range(seeds)
        ]
        out[shape] = np.mean([f.scores(x, n) for f in fits], axis=0)
    return out


def sequence_scores(run: Path, profile: Profile, df: pd.DataFrame, epochs: int) -> np.ndarray:
    """[L, N] SASRec scores of df's lists, the model fitted on the training sequences the run's evidence was
    (gr2.data.split.train_sequences: no validation or test item)."""
    dataset = read_dataset(run_folder(run, "kfp/*/ingest/sources"), event_ts=False)
    seqs = train_sequences(dataset, profile.data.eval_positions)
    config = SequenceConfig(max_len=profile.data.history_len, epochs=epochs)
    model = fit_sequence_model(seqs, config, profile.seed)
    return model.scores(list(df["history"]), list(df["candidates"]))


def compare(run: Path, split: str, seq_epochs: int = 0, nn_seeds: int = 0) -> dict:
    profile, examples = run_profile(run), run_examples(run)
    df, train = (examples[examples["split"] == s].reset_index(drop=True) for s in (split, "train"))
    if df.empty or train.empty:
        raise SystemExit(f"no examples in split {split!r} or in train")
    labels = df["label"].to_numpy()
    evidence = Evidence.load(run_folder(run, "kfp/*/prepare-sft/sft_data") / "evidence")
    x, x_train = list_features(evidence, df), list_features(evidence, train)  # once: every ranker reads them
    train_labels = train["label"].to_numpy()
    scores = feature_scores(run, profile, evidence, x, x_train, train_labels)
    blends = [("ltr", "teacher"), ("ltr", "teacher_raw")]
    if nn_seeds > 0:
        n, n_train = (np.array([len(c) for c in d["candidates"]]) for d in (df, train))
        scores |= network_scores(x, n, x_train, n_train, train_labels, seeds=nn_seeds, seed=profile.seed)
    if seq_epochs > 0:
        scores["seq"] = sequence_scores(run, profile, df, seq_epochs)
        blends += [("ltr", "seq"), ("teacher", "seq")]
    weights = {}
    for a, b in blends:
        scores[f"{a}+{b}"], weights[f"{a}+{b}"] = cross_fitted_blend(
            scores[a], scores[b], labels, profile.seed
        )
    ltr = rankings_from_scores(scores["ltr"])
    rows = {}
    for name, s in scores.items():
        row = evaluate(
            df,
            rankings_from_scores(s),
            floor_rankings=ltr,
            n_boot=profile.bootstrap_samples,
            seed=profile.seed,
        )
        rows[name] = {
            m: {"value": row[m], "minus_ltr": row["delta_vs_floor_mean"][m], "ci95": row["delta_vs_floor"][m]}
            for m in ("recall@1", "ndcg@5")
        }
    return {
        "run": repo_relative(str(Path(run).resolve())),
        "split": split,
        "n": len(df),
        "seq_epochs": seq_epochs,
        "nn_seeds": nn_seeds,
        "blend_weights_of_first": weights,
        "rankers": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument("--split", default="val", choices=["val", "test"])
    ap.add_argument(
        "--seq-epochs", type=int, default=0, help="also fit a SASRec for this many epochs (0: no `seq` rows)"
    )
    ap.add_argument(
        "--nn-seeds",
        type=int,
        default=0,
        help="also fit the `mlp` and `listwise` networks, each this many seeds",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    result = compare(Path(args.run).resolve(), args.split, args.seq_epochs, args.nn_seeds)
    return emit("analysis.feature_rankers", argv, result, args.out)


if __name__ == "__main__":
    main()
