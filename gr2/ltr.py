"""Classical learning-to-rank baseline over evidence features (the bar a generative re-ranker must beat).

Pointwise: every (list, candidate) is a row with label = [candidate is the target]; a classifier's
probability ranks the candidates of a list (ties keep retriever order). Hyper-parameters come from a small
grid scored by R@1 on the validation lists (NDCG@5 breaks ties); the test split is never looked at.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import joblib
import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from gr2.config import LTRConfig
from gr2.metrics import ndcg_at_k, recall_at_k

log = logging.getLogger(__name__)

GRIDS: dict[str, list[dict]] = {
    "gbdt": [
        # small on purpose: on Beauty (19k lists) larger/longer models did not help on validation
        {"learning_rate": lr, "max_leaf_nodes": leaves, "max_iter": 100}
        for lr, leaves in itertools.product([0.05, 0.1], [7, 15])
    ],
    "logreg": [{"C": c} for c in (0.01, 0.1, 1.0, 10.0)],
}


def list_features(X: np.ndarray) -> np.ndarray:
    """[B, N, F] -> [B, N, 2F]: raw features plus each one minus its list maximum (list context for a
    pointwise model: "the strongest transition in this list" matters more than its absolute count)."""
    return np.concatenate([X, X - X.max(axis=1, keepdims=True)], axis=-1)


def _make(kind: str, params: dict, seed: int):
    if kind == "gbdt":
        return HistGradientBoostingClassifier(early_stopping=False, random_state=seed, **params)
    if kind == "logreg":
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, **params))
    raise ValueError(f"unknown LTR model {kind!r}; expected one of {sorted(GRIDS)}")


def rankings_from_scores(scores: np.ndarray) -> list[list[int]]:
    """Best first; equal scores keep retriever order.

    >>> rankings_from_scores(np.array([[0.1, 0.5, 0.5]]))
    [[1, 2, 0]]
    """
    return np.argsort(-scores, axis=1, kind="stable").tolist()


class Classifier(Protocol):
    """What LTRModel needs of a fitted scikit-learn classifier."""

    def predict_proba(self, X: np.ndarray) -> np.ndarray: ...


@dataclass
class LTRModel:
    kind: str
    params: dict
    estimator: Classifier
    val: dict = field(default_factory=dict)  # validation R@1 / NDCG@5 of the chosen params
    grid: list[dict] = field(default_factory=list)  # every tried params with its validation scores

    def scores(self, X: np.ndarray, n_threads: int = 1) -> np.ndarray:
        B, N, _ = X.shape
        Z = list_features(X).reshape(B * N, -1)
        with threadpool_limits(limits=n_threads):
            return self.estimator.predict_proba(Z)[:, 1].reshape(B, N)

    def rank(self, X: np.ndarray) -> list[list[int]]:
        return rankings_from_scores(self.scores(X))

    def save(self, out: str | Path) -> Path:
        """ltr.json (kind, params, validation scores, the grid) and the fitted estimator (estimator.joblib: loads
        with the scikit-learn of the lock file, the one every image installs)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "params": self.params, "val": self.val, "grid": self.grid}
        (out / "ltr.json").write_text(json.dumps(meta, indent=2) + "\n")
        joblib.dump(self.estimator, out / "estimator.joblib")
        return out

    @classmethod
    def load(cls, path: str | Path) -> LTRModel:
        p = Path(path)
        meta = json.loads((p / "ltr.json").read_text())
        return cls(
            meta["kind"], meta["params"], joblib.load(p / "estimator.joblib"), meta["val"], meta["grid"]
        )


def _val_scores(model: LTRModel, X: np.ndarray, labels: np.ndarray) -> dict:
    s = model.scores(X)
    order = np.argsort(-s, axis=1, kind="stable")
    ranks = np.argmax(order == labels[:, None], axis=1)
    return {"recall@1": float(recall_at_k(ranks, 1).mean()), "ndcg@5": float(ndcg_at_k(ranks, 5).mean())}


def fit_ltr(
    train_X: np.ndarray,
    train_labels: np.ndarray,
    val_X: np.ndarray,
    val_labels: np.ndarray,
    config: LTRConfig | None = None,
    seed: int = 0,
) -> LTRModel:
    """Fit config.model over its grid on training lists; keep the params best on validation."""
    cfg = config or LTRConfig()
    rng = np.random.default_rng(seed)
    B, N, _ = train_X.shape
    keep = np.arange(B)
    if cfg.max_train_lists and B > cfg.max_train_lists:
        keep = np.sort(rng.choice(B, cfg.max_train_lists, replace=False))
    Z = list_features(train_X[keep]).reshape(len(keep) * N, -1)
    y = (np.arange(N)[None, :] == np.asarray(train_labels)[keep, None]).astype(np.int64).ravel()
    best: LTRModel | None = None
    tried = []
    for params in GRIDS[cfg.model]:
        with threadpool_limits(limits=cfg.n_threads):
            est = _make(cfg.model, params, seed).fit(Z, y)
            m = LTRModel(cfg.model, params, est)
            m.val = _val_scores(m, val_X, np.asarray(val_labels))
        tried.append({**params, **{f"val_{k}": v for k, v in m.val.items()}})
        log.info("ltr %s %s val %s", cfg.model, params, m.val)
        if best is None or (m.val["recall@1"], m.val["ndcg@5"]) > (best.val["recall@1"], best.val["ndcg@5"]):
            best = m
    assert best is not None
    best.grid = tried
    return best
