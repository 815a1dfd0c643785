"""The reasoning teacher: a listwise scorer over the evidence features that writes the SFT data.

GR2 distils the reasoning of a 32B LLM; we have none, so the teacher is a conditional-logit (listwise softmax)
model over the evidence features (transition from the last/recent items, co-occurrence with the history,
popularity, category overlap, title similarity, retriever rank), their squares and pairwise products, fit on
TRAINING lists. It writes every SFT target:

- the trace: its verdict on every candidate, a score level 0..L-1 in label order (gr2/prompt.py
  `render_trace`). The levels are quantiles of the training candidates' scores, finer at the top, where the
  answer's first label is decided;
- the answer (TeacherConfig.answer): "teacher", the teacher's own ranking: the answer orders the verdicts the
  trace has just written, a deterministic function of the prompt that a small model learns closely; or
  "label", the held-out item first and then the teacher's order, which also asks the answer to guess where
  the teacher is wrong (noisy on weak-signal data). The held-out items' reward comes in at RL.

The trace never depends on the held-out item: it carries what the evidence says. GR2's rejection sampling
(sample rankings until one puts the held-out item first, then explain that one) dropped the lists the teacher
gets wrong, and its trace named the answer before the answer did (docs/RESULTS.md, 'The SFT recipe', has the
measurements).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from scipy.optimize import minimize
from tqdm import tqdm

from gr2.config import Profile, TeacherConfig
from gr2.evidence import bucketize
from gr2.prompt import encode_example, render_trace
from gr2.sid import SemanticIds

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the scorer


def _expand(x: np.ndarray) -> np.ndarray:
    """[..., F] -> [..., E]: features, their squares and pairwise products (curvature and interactions for a
    linear listwise model)."""
    f = x.shape[-1]
    prods = [x[..., i : i + 1] * x[..., j : j + 1] for i in range(f) for j in range(i + 1, f)]
    return np.concatenate([x, x * x, *prods], axis=-1)


def score_quantiles(levels: int) -> np.ndarray:
    """Quantiles of the training candidates' scores that separate the trace's score levels: equal-count levels.
    Recall@1 is decided at every level, not only at the top: in lists with weak evidence every candidate scores
    low, and the best of them must still stand out from the rest (docs/RESULTS.md, 'Trace levels')."""
    return np.arange(1, max(levels, 1)) / max(levels, 1)


def bucket_means(features: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[F, n_buckets]: each feature's mean training value inside each of its prompt buckets (an empty bucket
    takes its lower edge), so a bucketed feature keeps the raw feature's scale."""
    x = features.reshape(-1, features.shape[-1])
    b = bucketize(x, edges)
    out = np.zeros((x.shape[1], edges.shape[1] + 1))
    for f in range(x.shape[1]):
        for k in range(out.shape[1]):
            inside = x[b[:, f] == k, f]
            out[f, k] = inside.mean() if len(inside) else edges[f, max(k - 1, 0)]
    return out


def bucket_inputs(features: np.ndarray, edges: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[..., F] raw evidence -> [..., F]: each value replaced by the value of its bucket (`bucket_means`)."""
    b = bucketize(features, edges).reshape(-1, features.shape[-1])
    return np.take_along_axis(values, b.T, axis=1).T.reshape(features.shape)


@dataclass
class Teacher:
    """Listwise softmax scorer s(c) = w . standardise([x_c, x_c^2, x_ci * x_cj]) with score-level edges.

    With `bucket_edges` (TeacherConfig.inputs "buckets") x_c is not the raw evidence but what the prompt shows of
    it: each feature's bucket, read as the bucket's mean training value. The trace's levels are then a function
    of the prompt's tokens alone, which a student can learn exactly (docs/RESULTS.md, 'A trace the student can
    compute')."""

    weights: np.ndarray  # [E]
    mean: np.ndarray  # [E]
    std: np.ndarray  # [E]
    feature_names: tuple[str, ...]
    score_edges: np.ndarray  # [L - 1] ascending: level = number of edges a score exceeds
    bucket_edges: np.ndarray | None = None  # [F, n_buckets - 1]: the prompt's evidence buckets (None = raw)
    bucket_values: np.ndarray | None = None  # [F, n_buckets]: the value each bucket stands for

    def inputs(self, features: np.ndarray) -> np.ndarray:
        """The evidence as the teacher reads it: raw, or each feature's bucket value."""
        x = np.asarray(features, dtype=np.float64)
        if self.bucket_edges is None or self.bucket_values is None:
            return x
        return bucket_inputs(x, self.bucket_edges, self.bucket_values)

    @classmethod
    def fit(
        cls,
        features: np.ndarray,
        labels: np.ndarray,
        feature_names: Sequence[str],
        l2: float = 1e-3,
        score_levels: int = 8,
        bucket_edges: np.ndarray | None = None,
    ) -> Teacher:
        """Maximise mean log softmax(score)[label] over training lists [L, N, F] (L-BFGS, ridge l2), then place the
        score-level edges at `score_quantiles` of the fitted scores of these lists. With `bucket_edges` the
        teacher reads each feature's prompt bucket instead of its raw value."""
        features = np.asarray(features, dtype=np.float64)
        values = None
        if bucket_edges is not None:
            values = bucket_means(features, bucket_edges)
            features = bucket_inputs(features, bucket_edges, values)
        z = _expand(features)
        mean = z.reshape(-1, z.shape[-1]).mean(0)
        std = z.reshape(-1, z.shape[-1]).std(0) + 1e-8
        z = (z - mean) / std
        labels = np.asarray(labels, dtype=np.int64)
        rows = np.arange(len(labels))

        def loss_grad(w: np.ndarray) -> tuple[float, np.ndarray]:
            s = z @ w  # [L, N]
            s = s - s.max(1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(1, keepdims=True)
            nll = -np.log(p[rows, labels] + 1e-300).mean() + l2 * w @ w
            # d/dw of -log p_label = sum_j p_j z_j - z_label
            g = np.einsum("ln,lnf->f", p, z) - z[rows, labels].sum(0)
            return float(nll), g / len(labels) + 2 * l2 * w

        res = minimize(
            loss_grad, np.zeros(z.shape[-1]), jac=True, method="L-BFGS-B", options={"maxiter": 500}
        )
        edges = np.quantile(z @ res.x, score_quantiles(score_levels)) if len(labels) else np.zeros(0)
        edges = np.asarray(edges, dtype=np.float64)
        return cls(res.x, mean, std, tuple(feature_names), edges, bucket_edges, values)

    def scores(self, features: np.ndarray) -> np.ndarray:
        """[..., N, F] raw evidence -> [..., N] (higher = better)."""
        return ((_expand(self.inputs(features)) - self.mean) / self.std) @ self.weights

    def levels(self, features: np.ndarray) -> np.ndarray:
        """[..., N, F] -> [..., N] integer score levels 0 .. len(score_edges) (the trace's tokens)."""
        return np.searchsorted(self.score_edges, self.scores(features), side="right")

    def rank(self, features: np.ndarray) -> np.ndarray:
        """[..., N] candidate indices, best first (stable: ties keep retriever order)."""
        return np.argsort(-self.scores(features), axis=-1, kind="stable")

    def recall_at(self, features: np.ndarray, labels: np.ndarray, k: int = 1) -> float:
        r = self.rank(features)[:, :k]
        return float((r == np.asarray(labels)[:, None]).any(1).mean())

    def to_dict(self) -> dict:
        raw = {
            "weights": self.weights.tolist(),
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "feature_names": list(self.feature_names),
            "score_edges": self.score_edges.tolist(),
        }
        if self.bucket_edges is not None and self.bucket_values is not None:
            raw |= {"bucket_edges": self.bucket_edges.tolist(), "bucket_values": self.bucket_values.tolist()}
        return raw

    @classmethod
    def from_dict(cls, raw: dict) -> Teacher:
        return cls(
            weights=np.asarray(raw["weights"]),
            mean=np.asarray(raw["mean"]),
            std=np.asarray(raw["std"]),
            feature_names=tuple(raw["feature_names"]),
            score_edges=np.asarray(raw["score_edges"], dtype=np.float64),
            bucket_edges=np.asarray(raw["bucket_edges"]) if "bucket_edges" in raw else None,
            bucket_values=np.asarray(raw["bucket_values"]) if "bucket_values" in raw else None,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Teacher:
        return cls.from_dict(json.loads(Path(path).read_text()))


def fit_teacher(
    features: np.ndarray,
    labels: np.ndarray,
    feature_names: Sequence[str],
    cfg: TeacherConfig,
    score_levels: int,
    seed: int = 0,
    bucket_edges: np.ndarray | None = None,
) -> Teacher:
    """Fit on (a seeded subsample of at most cfg.max_train_lists) training lists; on the prompt's buckets
    (`bucket_edges`, the evidence's) when cfg.inputs is "buckets"."""
    if cfg.inputs not in TEACHER_INPUTS:
        raise ValueError(f"teacher.inputs must be one of {TEACHER_INPUTS}, got {cfg.inputs!r}")
    if cfg.inputs == "buckets" and bucket_edges is None:
        raise ValueError('teacher.inputs "buckets" needs the evidence bucket edges')
    idx = np.arange(len(labels))
    if cfg.max_train_lists and len(idx) > cfg.max_train_lists:
        idx = np.sort(np.random.default_rng(seed).choice(idx, cfg.max_train_lists, replace=False))
    edges = bucket_edges if cfg.inputs == "buckets" else None
    return Teacher.fit(features[idx], np.asarray(labels)[idx], feature_names, cfg.l2, score_levels, edges)


TEACHER_INPUTS = ("raw", "buckets")


ANSWERS = ("teacher", "label", "levels")


def answer_ranking(
    scores: Sequence[float], label: int, answer: str = "teacher", levels: Sequence[int] | None = None
) -> list[int]:
    """The SFT answer: every candidate by descending teacher score (ties keep the retriever order); with
    answer "label" the held-out item is moved to the front; with "levels" the candidates by descending trace
    level (`levels`), ties in retriever order, so that the answer is a function of the trace alone."""
    if answer not in ANSWERS:
        raise ValueError(f"teacher.answer must be one of {ANSWERS}, got {answer!r}")
    if answer == "levels":
        if levels is None:
            raise ValueError('teacher.answer "levels" needs the trace\'s levels')
        return [int(i) for i in np.argsort(-np.asarray(levels), kind="stable")]
    order = [int(i) for i in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")]
    if answer == "teacher":
        return order
    return [int(label), *(i for i in order if i != label)]


# ----------------------------------------------------------------------------- SFT records


class SFTRecord(NamedTuple):
    prompt_ids: list[int]
    response_ids: list[int]
    response_weights: list[float]


def build_sft_records(
    examples: pd.DataFrame,
    features: np.ndarray,
    buckets: np.ndarray,
    feature_names: Sequence[str],
    sids: SemanticIds,
    teacher: Teacher,
    tokenizer: Any,
    cfg: Profile,
    *,
    variant: str = "trace",
    stats: dict | None = None,
) -> list[SFTRecord]:
    """One record per training list of `examples` (features [L, N, F] and their buckets in the same row order;
    a list shorter than N reads its own rows, as `Evidence.features_batch` pads it).

    variant "trace": trace + answer; "ar_no_trace": the same answer alone, so the two variants differ only by
    the trace."""
    if variant not in ("trace", "ar_no_trace"):
        raise ValueError(f"variant must be 'trace' or 'ar_no_trace', got {variant!r}")
    scores = teacher.scores(features)
    levels = teacher.levels(features)
    labels = examples["label"].to_numpy()
    item_tokens = cfg.prompt.item_tokens
    records: list[SFTRecord] = []
    trace_len, prompt_len = [], []
    rows = zip(examples["history"], examples["candidates"], strict=True)
    hits = []
    for r, (hist, cands) in enumerate(tqdm(rows, total=len(examples), disable=None, desc=f"sft ({variant})")):
        n = len(cands)
        trace = render_trace(levels[r, :n].tolist()) if variant == "trace" else None
        hits.append(int(np.argmax(scores[r, :n])) == labels[r])
        p, resp, w = encode_example(
            tokenizer,
            [sids.codes[i] for i in hist if i in sids.codes],
            [sids.codes[c] for c in cands],
            buckets[r, :n],
            answer_ranking(
                scores[r, :n].tolist(), int(labels[r]), cfg.teacher.answer, levels[r, :n].tolist()
            ),
            trace,
            feature_names,
            answer_weight=cfg.sft.answer_weight,
            trace_weight=cfg.sft.trace_weight,
            item_tokens=item_tokens,
            short_lists=cfg.prompt.short_lists,
            n_full=cfg.data.n_candidates,
        )
        records.append(SFTRecord(p, resp, w))
        trace_len.append(len(trace.split()) if trace else 0)  # whitespace word-level: one token per word
        prompt_len.append(len(p))
    if stats is not None:
        answer_len = [len(rec.response_ids) - t for rec, t in zip(records, trace_len, strict=True)]
        stats.update(
            variant=variant,
            n_records=len(records),
            mean_prompt_tokens=float(np.mean(prompt_len)) if prompt_len else 0.0,
            max_prompt_tokens=int(max(prompt_len)) if prompt_len else 0,
            mean_trace_tokens=float(np.mean(trace_len)) if trace_len else 0.0,
            mean_answer_tokens=float(np.mean(answer_len)) if answer_len else 0.0,
            # How often the teacher's own first choice is the held-out item on these training lists.
            teacher_recall_at_1=float(np.mean(hits)) if hits else 0.0,
        )
    return records
