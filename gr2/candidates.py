"""Attach the retriever's natural top-N to every target and keep the retrieval-hit examples.

The list is never edited: the target is not inserted when the retriever missed it (an inserted item is
identifiable by position and features: docs/CONTRACTS.md, Candidates). Training examples are scored with their own target
interaction subtracted, and every example excludes everything the user consumed before the target.
"""

from __future__ import annotations

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
