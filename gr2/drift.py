"""Drift, tonight against production: pure logic over a night's data profile and two models' rankings.

A night's data profile (`data_profile`) holds what a later night compares against when this night's model is in
production: its users and items (those with events), and a seeded sample of each distribution
  history_len        each user's newest event: how many items of history it has (up to H)
  item_popularity    each user's newest event: log1p of its item's event count that night
  <evidence feature> each candidate of each test list: the feature the models read (gr2/evidence.py)
Data drift (`data_drift`): the share of tonight's users and items production's data did not have, and the
population stability index of each distribution, on production's deciles (PSI = sum (c - r) ln(c / r) over
the bins' shares r of production and c of tonight). Prediction drift (`prediction_drift`): on tonight's test
lists, the share whose top-1 is the same for production and the candidate, and the mean Spearman correlation
of the two rankings. `warnings` names every figure past its threshold (gr2.config.DriftConfig).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gr2.config import DriftConfig

PSI_FLOOR = 1e-4  # a bin's share is at least this, so an empty bin counts as rare, not as log(0)


@dataclass
class DataProfile:
    snapshot_date: str
    users: np.ndarray
    items: np.ndarray
    values: dict[str, np.ndarray]  # distribution -> sampled values

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        ids = pd.DataFrame(
            {
                "kind": ["user"] * len(self.users) + ["item"] * len(self.items),
                "id": [*map(str, self.users), *map(str, self.items)],
            }
        )
        ids.to_parquet(out / "ids.parquet", index=False)
        vals = pd.concat(
            [pd.DataFrame({"name": k, "value": v.astype(np.float64)}) for k, v in self.values.items()],
            ignore_index=True,
        )
        vals.to_parquet(out / "values.parquet", index=False)
        meta = {"snapshot_date": self.snapshot_date, "names": list(self.values)}
        (out / "profile.json").write_text(json.dumps(meta, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> DataProfile:
        p = Path(path)
        meta = json.loads((p / "profile.json").read_text())
        ids = pd.read_parquet(p / "ids.parquet")
        vals = pd.read_parquet(p / "values.parquet")
        return cls(
            snapshot_date=meta["snapshot_date"],
            users=ids.loc[ids["kind"] == "user", "id"].to_numpy(),
            items=ids.loc[ids["kind"] == "item", "id"].to_numpy(),
            values={n: vals.loc[vals["name"] == n, "value"].to_numpy() for n in meta["names"]},
        )


def _sample(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x if len(x) <= n else rng.choice(x, size=n, replace=False)


def data_profile(
    interactions: pd.DataFrame,
    test_features: np.ndarray,
    feature_names: Sequence[str],
    history_len: int,
    snapshot_date: str,
    cfg: DriftConfig,
    seed: int = 0,
) -> DataProfile:
    """A night's profile from its interactions (sorted by user then seq_idx) and the evidence features of its
    test lists ([lists, N, F], `feature_names` the F)."""
    rng = np.random.default_rng(seed)
    newest = interactions.groupby("user_id", sort=False).tail(1)
    counts = interactions["item_id"].value_counts()
    values = {
        "history_len": np.minimum(newest["seq_idx"].to_numpy(), history_len),
        "item_popularity": np.log1p(newest["item_id"].map(counts).to_numpy(np.float64)),
    }
    flat = np.asarray(test_features, dtype=np.float64).reshape(-1, len(feature_names))
    for j, name in enumerate(feature_names):
        values[name] = flat[:, j]
    return DataProfile(
        snapshot_date=snapshot_date,
        users=interactions["user_id"].unique(),
        items=counts.index.to_numpy(),
        values={k: _sample(v, cfg.max_values, rng) for k, v in values.items()},
    )


def psi(reference: np.ndarray, current: np.ndarray, bins: int = 10) -> float:
    """Population stability index of `current` against `reference`, on the reference's quantile bins (ties
    merged: a feature with few values gets one bin per value)."""
    reference, current = np.asarray(reference, np.float64), np.asarray(current, np.float64)
    if len(reference) == 0 or len(current) == 0:
        return float("nan")
    inner = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]))
    # bin i = (inner[i-1], inner[i]]: right-closed, so a value equal to an edge joins the bin below
    r = np.bincount(np.searchsorted(inner, reference, side="left"), minlength=len(inner) + 1) / len(reference)
    c = np.bincount(np.searchsorted(inner, current, side="left"), minlength=len(inner) + 1) / len(current)
    r, c = np.maximum(r, PSI_FLOOR), np.maximum(c, PSI_FLOOR)
    return float(np.sum((c - r) * np.log(c / r)))


def data_drift(reference: DataProfile, current: DataProfile, cfg: DriftConfig) -> dict[str, Any]:
    """Tonight (`current`) against production's night (`reference`)."""
    new_users = float(np.mean(~np.isin(current.users, reference.users))) if len(current.users) else 0.0
    new_items = float(np.mean(~np.isin(current.items, reference.items))) if len(current.items) else 0.0
    shared = [k for k in current.values if k in reference.values]
    return {
        "reference_snapshot_date": reference.snapshot_date,
        "new_users": new_users,
        "new_items": new_items,
        "psi": {k: psi(reference.values[k], current.values[k], cfg.bins) for k in shared},
    }


def prediction_drift(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Two models' rankings (permutations of candidate indices, best first) of the same lists."""
    ra, rb = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if ra.shape != rb.shape or ra.ndim != 2 or len(ra) == 0:
        return {"n_lists": len(ra), "top1_agreement": float("nan"), "rank_corr": float("nan")}
    n = ra.shape[1]
    pos_a, pos_b = np.argsort(ra, axis=1), np.argsort(rb, axis=1)  # each candidate's rank in each ranking
    d2 = ((pos_a - pos_b) ** 2).sum(axis=1)
    rho = 1 - 6 * d2 / (n * (n * n - 1)) if n > 1 else np.ones(len(ra))
    return {
        "n_lists": len(ra),
        "top1_agreement": float(np.mean(ra[:, 0] == rb[:, 0])),
        "rank_corr": float(np.mean(rho)),
    }


def warnings(drift: dict[str, Any], cfg: DriftConfig) -> list[str]:
    """One line per figure past its threshold; a figure that could not be computed is not a pass either."""
    out = []
    data, pred = drift.get("data"), drift.get("predictions")
    if data:
        for key, limit in (("new_users", cfg.max_new_users), ("new_items", cfg.max_new_items)):
            if data[key] > limit:
                out.append(f"data: {key.replace('_', ' ')} {data[key]:.3f} > {limit}")
        for name, value in data["psi"].items():
            if not value <= cfg.max_psi:  # NaN (nothing to compare) warns too
                out.append(f"data: PSI of {name} {value:.3f} > {cfg.max_psi}")
    if pred:
        for key, limit in (("top1_agreement", cfg.min_top1_agreement), ("rank_corr", cfg.min_rank_corr)):
            if not pred[key] >= limit:
                out.append(f"predictions: {key.replace('_', ' ')} {pred[key]:.3f} < {limit}")
    for part in ("data", "predictions"):
        if drift.get(f"{part}_error"):
            out.append(f"{part}: not measured ({drift[f'{part}_error']})")
    return out


def drift_markdown(drift: dict[str, Any], cfg: DriftConfig) -> str:
    """The drift section of the report and the KFP UI."""
    warn = drift.get("warnings", [])
    lines = [f"# Drift against production: {'WARNING' if warn else 'no warning'}", ""]
    if drift.get("production") is None:
        return "\n".join([*lines, "No model in production: nothing to compare against.", ""])
    p = drift["production"]
    lines += [f"Production: `{p.get('model')}` of run `{p.get('run_id')}` ({p.get('attempt', '')}).", ""]
    lines += [f"- WARNING {w}" for w in warn]
    data = drift.get("data")
    if data:
        lines += [
            "",
            f"## Data: tonight against production's night ({data['reference_snapshot_date']})",
            "",
            "| figure | value | threshold |",
            "|---|---|---|",
            f"| new users | {data['new_users']:.3f} | <= {cfg.max_new_users} |",
            f"| new items | {data['new_items']:.3f} | <= {cfg.max_new_items} |",
        ]
        lines += [f"| PSI {k} | {v:.3f} | <= {cfg.max_psi} |" for k, v in data["psi"].items()]
    pred = drift.get("predictions")
    if pred:
        lines += [
            "",
            f"## Predictions: production against the candidate on tonight's {pred['n_lists']} test lists",
            "",
            "| figure | value | threshold |",
            "|---|---|---|",
            f"| top-1 agreement | {pred['top1_agreement']:.3f} | >= {cfg.min_top1_agreement} |",
            f"| rank correlation (Spearman) | {pred['rank_corr']:.3f} | >= {cfg.min_rank_corr} |",
        ]
    return "\n".join(lines) + "\n"
