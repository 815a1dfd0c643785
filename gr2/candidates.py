"""Attach the retriever's natural top-N to every target and keep the retrieval-hit examples.

The list is never edited: the target is not inserted when the retriever missed it (an inserted item is
identifiable by position and features: docs/CONTRACTS.md, Candidates). Training examples are scored with their own target
interaction subtracted, and every example excludes everything the user consumed before the target.

Shorter lists (clients send any length 2..N) are subsets of these lists that keep the held-out item and the
retriever order (`cut_lists`, `shorten_some`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from gr2.retriever import CoocRetriever

EXAMPLE_COLUMNS = [
    "example_id",
    "user_id",
    "split",
    "target_pos",
    "event_ts",
    "history",
    "target",
    "candidates",
    "label",
    "retriever_scores",
]


def attach_candidates(targets: pd.DataFrame, retriever: CoocRetriever, n: int) -> tuple[pd.DataFrame, dict]:
    """targets (gr2.data.split.build_targets) -> (hit-only examples with EXAMPLE_COLUMNS, stats).

    stats: {"n": N, "retriever": name, "splits": {split: {"targets", "hits", "hit_rate"}}}.
    """
    histories = targets["history"].tolist()
    own = [t if s == "train" else None for t, s in zip(targets["target"], targets["split"], strict=True)]
    # Excluded: the history plus everything in the user's training sequence before the target.
    items, scores = retriever.topn_batch(
        histories,
        n,
        own_targets=own,
        users=targets["user_id"].tolist(),
        positions=targets["target_pos"].tolist(),
    )
    label = np.array([c.index(t) if t in c else -1 for t, c in zip(targets["target"], items, strict=True)])
    out = targets.copy()
    out["candidates"] = items
    out["label"] = label
    out["retriever_scores"] = [s.astype(np.float64).tolist() for s in scores]
    stats: dict = {"n": n, "retriever": retriever.name, "splits": {}}
    for split in ("train", "val", "test"):
        m = (out["split"] == split).to_numpy()
        hits = int((label[m] >= 0).sum())
        stats["splits"][split] = {
            "targets": int(m.sum()),
            "hits": hits,
            "hit_rate": hits / int(m.sum()) if m.any() else float("nan"),
        }
    out = out[out["label"] >= 0].reset_index(drop=True)
    out["label"] = out["label"].astype(np.int64)
    return out[EXAMPLE_COLUMNS], stats


def cut_lists(examples: pd.DataFrame, lengths: Sequence[int] | np.ndarray, seed: int) -> pd.DataFrame:
    """A copy of `examples` with list i cut to lengths[i] candidates (a list no longer than that is kept whole):
    the held-out item and a seeded random choice of the others, in retriever order (label and retriever scores
    follow). Clients send lists of any length 2..N; training and evaluation see them through this one cut."""
    rng = np.random.default_rng(seed)
    keeps = []
    for cs, y, n in zip(examples["candidates"], examples["label"], lengths, strict=True):
        keep = list(range(len(cs)))
        if n < len(cs):
            others = rng.choice([j for j in keep if j != y], size=int(n) - 1, replace=False)
            keep = sorted([int(y), *others.tolist()])
        keeps.append(keep)
    out = examples.copy()
    for col in ("candidates", "retriever_scores"):
        if col in out:
            out[col] = [[list(v)[j] for j in keep] for v, keep in zip(out[col], keeps, strict=True)]
    out["label"] = np.asarray(
        [k.index(int(y)) for k, y in zip(keeps, examples["label"], strict=True)], np.int64
    )
    return out


def shorten_some(examples: pd.DataFrame, share: float, seed: int) -> pd.DataFrame:
    """`cut_lists` with a seeded `share` of the lists cut to a uniform random length 2..N-1 (N = its length) and
    the rest kept whole: the training lists of every generative stage, so the model ranks every length a
    client may send (the serving schema accepts 2..N)."""
    rng = np.random.default_rng(seed)
    full = examples["candidates"].map(len).to_numpy()
    short = rng.random(len(full)) < share
    lengths = np.where(short, rng.integers(2, np.maximum(full, 3)), full)
    return cut_lists(examples, lengths, seed + 1)
