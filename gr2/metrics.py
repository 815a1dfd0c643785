"""Ranking metrics with one relevant item per list, validity, and bootstrap confidence intervals.

A model's output on an examples table is `rankings` (a permutation of candidate indices, best first) and
`valid` flags; invalid outputs fall back to the identity (retriever order) before scoring and are counted
in the validity rate. With a single relevant item at 0-based rank r: recall@k = [r < k] and
ndcg@k = [r < k] / log2(r + 2) (IDCG = 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

METRICS = ("recall@1", "recall@3", "recall@5", "ndcg@3", "ndcg@5")


def target_ranks(rankings: Sequence[Sequence[int]], labels: Sequence[int]) -> np.ndarray:
    """0-based rank of each list's label in its ranking.

    >>> target_ranks([[2, 0, 1], [0, 1, 2]], [0, 2]).tolist()
    [1, 2]
    """
    return np.array([list(r).index(int(y)) for r, y in zip(rankings, labels, strict=True)], dtype=np.int64)


def recall_at_k(ranks: np.ndarray, k: int) -> np.ndarray:
    """Per-list recall@k for one relevant item.

    >>> recall_at_k(np.array([0, 1, 4]), 3).tolist()
    [1.0, 1.0, 0.0]
    """
    return (np.asarray(ranks) < k).astype(np.float64)


def ndcg_at_k(ranks: np.ndarray, k: int) -> np.ndarray:
    """Per-list NDCG@k for one relevant item: 1 / log2(rank + 2) inside the top k, else 0.

    >>> np.round(ndcg_at_k(np.array([0, 1, 2, 3]), 3), 4).tolist()
    [1.0, 0.6309, 0.5, 0.0]
    """
    ranks = np.asarray(ranks)
    return np.where(ranks < k, 1.0 / np.log2(ranks + 2.0), 0.0)


def per_list_metrics(ranks: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "recall@1": recall_at_k(ranks, 1),
        "recall@3": recall_at_k(ranks, 3),
        "recall@5": recall_at_k(ranks, 5),
        "ndcg@3": ndcg_at_k(ranks, 3),
        "ndcg@5": ndcg_at_k(ranks, 5),
    }


def identity_rankings(n_lists: int, n: int) -> list[list[int]]:
    """The pre-rank floor: every list in retriever order."""
    return [list(range(n)) for _ in range(n_lists)]


def check_permutation(ranking: Sequence[int], n: int) -> bool:
    """True if `ranking` is a permutation of 0..n-1.

    >>> check_permutation([1, 0, 2], 3), check_permutation([1, 1, 2], 3)
    (True, False)
    """
    return len(ranking) == n and sorted(int(x) for x in ranking) == list(range(n))


def bootstrap_ci(values: np.ndarray, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05) -> list[float]:
    """Percentile bootstrap CI of the mean over lists (resampling lists with replacement)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    step = max(1, 2_000_000 // len(values))  # bounded memory for the index matrix
    for lo in range(0, n_boot, step):
        hi = min(n_boot, lo + step)
        idx = rng.integers(0, len(values), size=(hi - lo, len(values)))
        means[lo:hi] = values[idx].mean(1)
    lo_q, hi_q = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return [float(lo_q), float(hi_q)]


def apply_fallback(
    rankings: Sequence[Sequence[int]], valid: Sequence[bool], n: int | Sequence[int]
) -> list[list[int]]:
    """Invalid rankings -> identity. A ranking flagged valid must be a permutation (a caller bug otherwise). `n`:
    the lists' length, or each list's own (lists of different lengths)."""
    lengths = [n] * len(valid) if isinstance(n, int) else list(n)
    out = []
    for i, (r, ok, length) in enumerate(zip(rankings, valid, lengths, strict=True)):
        if ok:
            if not check_permutation(r, length):
                raise ValueError(
                    f"ranking {i} is flagged valid but is not a permutation of 0..{length - 1}: {r}"
                )
            out.append([int(x) for x in r])
        else:
            out.append(list(range(length)))
    return out


def evaluate(
    examples: pd.DataFrame,
    rankings: Sequence[Sequence[int]],
    valid: Sequence[bool] | None = None,
    floor_rankings: Sequence[Sequence[int]] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    model: str = "",
    tau: float | None = None,
) -> dict:
    """Report-row fields (CONTRACTS.md): metrics, ci95, delta_vs_floor (paired bootstrap), validity, n_users.

    `delta_vs_floor[m]` = [lo, hi] of the paired bootstrap CI of mean(row - floor); the point estimate is
    in `delta_vs_floor_mean`. Without floor_rankings the floor is the identity (retriever order).
    """
    n_lists = len(examples)
    n = len(examples["candidates"].iat[0]) if n_lists else 0
    valid = [True] * n_lists if valid is None else list(valid)
    labels = examples["label"].to_numpy()
    ranks = target_ranks(apply_fallback(rankings, valid, n), labels)
    floor = floor_rankings if floor_rankings is not None else identity_rankings(n_lists, n)
    floor_ranks = target_ranks(apply_fallback(floor, [True] * n_lists, n), labels)
    per, per_floor = per_list_metrics(ranks), per_list_metrics(floor_ranks)
    row: dict = {"model": model, "tau": tau}
    row.update({m: float(v.mean()) if n_lists else float("nan") for m, v in per.items()})
    row["ci95"] = {m: bootstrap_ci(v, n_boot, seed) for m, v in per.items()}
    # Same seed -> same resampled lists for every metric and every row: a paired bootstrap.
    row["delta_vs_floor"] = {m: bootstrap_ci(per[m] - per_floor[m], n_boot, seed) for m in per}
    row["delta_vs_floor_mean"] = {m: float((per[m] - per_floor[m]).mean()) if n_lists else 0.0 for m in per}
    row["validity"] = float(np.mean(valid)) if n_lists else float("nan")
    row["n_users"] = int(examples["user_id"].nunique()) if n_lists else 0
    return row
