"""The dataset profile: what a dataset has and lacks, computed at ingest on the data the run uses.

A real catalog may lack titles, categories or timestamps, repeat items, or mix very long histories with
users at the minimum length. The profile names each, so a report on a degraded dataset says why some
features carry no signal. It goes into the ingest step's metadata and KFP metrics and into the run report.

Fields (all counts over the run's slice of users):
  users, items (catalog rows), interactions
  titles, categories   {items, share}: catalog items with a non-empty title / at least one category
  timestamps           {rows, share}: interactions with a timestamp (the rest are ordered by seq_idx only)
  repeats              {rows, share, users, test_targets, test_target_share}: interactions of an item the
                       user consumed before; test_targets counts held-out items that are repeats, which the
                       retriever never proposes (it excludes what the user consumed)
  history_length       {min, p25, median, p75, p90, p99, max, mean}: interactions per user
  users_by_length      users with 1 (no example), 2 (test only), 3 (test + validation), >= 4 interactions
  items_not_in_training catalog items never at a training position (positions 0..n-3)
  numeric_ids          {user_id, item_id}: every id is digits only
  has, lacks           the optional parts present / absent ("titles", "categories", "timestamps",
                       "repeats"); a part present for only some rows is listed under `partial` too
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gr2.data.dataset import Dataset

QUANTILES = {"p25": 0.25, "median": 0.5, "p75": 0.75, "p90": 0.9, "p99": 0.99}


def _share(k: int, n: int) -> float:
    return round(k / n, 4) if n else 0.0


def dataset_profile(ds: Dataset) -> dict[str, Any]:
    """The profile of `ds` (interactions sorted by user then seq_idx, as `load_dataset` returns them)."""
    inter, items = ds.interactions, ds.items
    n_items, n_rows = len(items), len(inter)
    lens = inter.groupby("user_id", sort=False).size()
    pos = inter["seq_idx"].to_numpy()
    n_user = inter.groupby("user_id", sort=False)["seq_idx"].transform("size").to_numpy()
    with_title = int((items["title"].str.len() > 0).sum())
    with_cats = int(sum(len(c) > 0 for c in items["categories"]))
    with_ts = int(inter["timestamp"].notna().sum())
    repeat = inter.duplicated(["user_id", "item_id"]).to_numpy()  # rows are in seq_idx order per user
    test = (pos == n_user - 1) & (pos >= 1)
    train_items = set(inter.loc[pos < n_user - 2, "item_id"])
    prof: dict[str, Any] = {
        "users": int(len(lens)),
        "items": n_items,
        "interactions": n_rows,
        "titles": {"items": with_title, "share": _share(with_title, n_items)},
        "categories": {"items": with_cats, "share": _share(with_cats, n_items)},
        "timestamps": {"rows": with_ts, "share": _share(with_ts, n_rows)},
        "repeats": {
            "rows": int(repeat.sum()),
            "share": _share(int(repeat.sum()), n_rows),
            "users": int(inter.loc[repeat, "user_id"].nunique()),
            "test_targets": int((repeat & test).sum()),
            "test_target_share": _share(int((repeat & test).sum()), int(test.sum())),
        },
        "history_length": {
            "min": int(lens.min()),
            **{k: float(np.quantile(lens, q)) for k, q in QUANTILES.items()},
            "max": int(lens.max()),
            "mean": round(float(lens.mean()), 2),
        },
        "users_by_length": {
            "1": int((lens == 1).sum()),
            "2": int((lens == 2).sum()),
            "3": int((lens == 3).sum()),
            ">=4": int((lens >= 4).sum()),
        },
        "items_not_in_training": int((~items["item_id"].isin(train_items)).sum()),
        "numeric_ids": {c: bool(inter[c].str.fullmatch(r"\d+").all()) for c in ("user_id", "item_id")},
    }
    parts = {
        "titles": prof["titles"]["share"],
        "categories": prof["categories"]["share"],
        "timestamps": prof["timestamps"]["share"],
    }
    prof["has"] = [k for k, s in parts.items() if s > 0] + (["repeats"] if repeat.any() else [])
    prof["lacks"] = [k for k, s in parts.items() if s == 0]
    prof["partial"] = [k for k, s in parts.items() if 0 < s < 1]
    return prof


def profile_metrics(prof: dict[str, Any]) -> dict[str, float]:
    """The profile's numbers as flat `profile/<name>` metrics (KFP UI: compare datasets across runs)."""
    out = {
        "profile/title_share": prof["titles"]["share"],
        "profile/category_share": prof["categories"]["share"],
        "profile/timestamp_share": prof["timestamps"]["share"],
        "profile/repeat_share": prof["repeats"]["share"],
        "profile/repeat_test_target_share": prof["repeats"]["test_target_share"],
        "profile/items_not_in_training": prof["items_not_in_training"],
    }
    out |= {f"profile/history_length_{k}": v for k, v in prof["history_length"].items()}
    out |= {f"profile/users_with_{k}_interactions": v for k, v in prof["users_by_length"].items()}
    return {k: float(v) for k, v in out.items()}


def profile_markdown(prof: dict[str, Any]) -> list[str]:
    """The profile as Markdown lines for the run report."""
    h, r, u = prof["history_length"], prof["repeats"], prof["users_by_length"]
    ids = ", ".join(f"{c} {'numeric' if v else 'text'}" for c, v in prof["numeric_ids"].items())
    return [
        f"- {prof['users']} users, {prof['items']} catalog items, {prof['interactions']} interactions; {ids}",
        f"- has: {', '.join(prof['has']) or 'none'}; lacks: {', '.join(prof['lacks']) or 'nothing'}"
        + (f"; partial: {', '.join(prof['partial'])}" if prof["partial"] else ""),
        f"- titles {prof['titles']['share']:.1%} of items, categories {prof['categories']['share']:.1%} of "
        f"items, timestamps {prof['timestamps']['share']:.1%} of interactions"
        + ("" if prof["timestamps"]["share"] == 1 else " (the rest ordered by seq_idx only)"),
        f"- repeats: {r['share']:.1%} of interactions ({r['users']} users); {r['test_target_share']:.1%} of "
        "test targets repeat an earlier item (never proposed: the retriever excludes consumed items)",
        f"- history length: min {h['min']}, median {h['median']:g}, p90 {h['p90']:g}, p99 {h['p99']:g}, "
        f"max {h['max']} (mean {h['mean']}); users with 1 / 2 / 3 / >= 4 interactions: "
        f"{u['1']} / {u['2']} / {u['3']} / {u['>=4']}",
        f"- catalog items never at a training position: {prof['items_not_in_training']}",
    ]
