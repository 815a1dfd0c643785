"""The reasoning teacher: a scorer over the evidence features, verbalised into short traces for SFT.

GR2 used a 32B LLM with rejection sampling; we have none, so the teacher is a conditional-logit (listwise
softmax) model over the evidence features (transition from the last/recent items, co-occurrence with the
history, popularity, category overlap, title similarity, retriever rank), their squares and pairwise products, fit on TRAINING
lists and checked on validation. Its scores define a Plackett-Luce distribution over rankings; rejection
sampling keeps the first sampled ranking that puts the held-out item first (else the example is dropped).
The trace cites the top-k candidates of that ranking with the evidence that most raised each one's score
(DESIGN.md: the teacher's top-3 labels with their evidence before the answer lifted R@1 0.393 -> 0.414).
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
from gr2.prompt import (
    COLON,
    NO_SIGNAL,
    SEMI,
    STEP,
    TOP,
    bucket_token,
    encode_example,
    feature_aliases,
    feature_phrase,
    label_token,
)
from gr2.sid import SemanticIds

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the scorer


def _expand(x: np.ndarray) -> np.ndarray:
    """[..., F] -> [..., E]: features, their squares and pairwise products (curvature and interactions for a
    linear listwise model; on Beauty the products lift validation R@1 0.389 -> 0.398)."""
    f = x.shape[-1]
    prods = [x[..., i : i + 1] * x[..., j : j + 1] for i in range(f) for j in range(i + 1, f)]
    return np.concatenate([x, x * x, *prods], axis=-1)


def _attribution(f: int) -> np.ndarray:
    """[E, F]: which raw features each expanded column belongs to (products split half-half)."""
    m = [np.eye(f), np.eye(f)]
    for i in range(f):
        for j in range(i + 1, f):
            row = np.zeros((1, f))
            row[0, i] = row[0, j] = 0.5
            m.append(row)
    return np.concatenate(m, axis=0)


@dataclass
class Teacher:
    """Listwise softmax scorer s(c) = w . standardise([x_c, x_c^2, x_ci * x_cj])."""

    weights: np.ndarray  # [E]
    mean: np.ndarray  # [E]
    std: np.ndarray  # [E]
    feature_names: tuple[str, ...]

    @classmethod
    def fit(
        cls, features: np.ndarray, labels: np.ndarray, feature_names: Sequence[str], l2: float = 1e-3
    ) -> Teacher:
        """Maximise mean log softmax(score)[label] over training lists [L, N, F] (L-BFGS, ridge l2)."""
        z = _expand(np.asarray(features, dtype=np.float64))
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
        return cls(weights=res.x, mean=mean, std=std, feature_names=tuple(feature_names))

    def _z(self, features: np.ndarray) -> np.ndarray:
        return (_expand(np.asarray(features, dtype=np.float64)) - self.mean) / self.std

    def scores(self, features: np.ndarray) -> np.ndarray:
        """[..., N, F] -> [..., N] (higher = better)."""
        return self._z(features) @ self.weights

    def contributions(self, features: np.ndarray) -> np.ndarray:
        """[..., N, F]: how much each raw feature (its linear, square and half of its product terms) raises a candidate's score above the
        list average: the teacher's own reasons, used to choose what the trace cites."""
        per = (self._z(features) * self.weights) @ _attribution(len(self.feature_names))
        return per - per.mean(axis=-2, keepdims=True)

    def rank(self, features: np.ndarray) -> np.ndarray:
        """[..., N] candidate indices, best first (stable: ties keep retriever order)."""
        return np.argsort(-self.scores(features), axis=-1, kind="stable")

    def recall_at(self, features: np.ndarray, labels: np.ndarray, k: int = 1) -> float:
        r = self.rank(features)[:, :k]
        return float((r == np.asarray(labels)[:, None]).any(1).mean())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps(
                {
                    "weights": self.weights.tolist(),
                    "mean": self.mean.tolist(),
                    "std": self.std.tolist(),
                    "feature_names": list(self.feature_names),
                }
            )
        )

    @classmethod
    def load(cls, path: str | Path) -> Teacher:
        raw = json.loads(Path(path).read_text())
        return cls(
            weights=np.asarray(raw["weights"]),
            mean=np.asarray(raw["mean"]),
            std=np.asarray(raw["std"]),
            feature_names=tuple(raw["feature_names"]),
        )


# ----------------------------------------------------------------------------- sampling and traces


def sample_ranking(scores: np.ndarray, rng: np.random.Generator, temperature: float = 1.0) -> np.ndarray:
    """One Plackett-Luce sample = Gumbel-top-k over scores / temperature."""
    g = rng.gumbel(size=len(scores))
    return np.argsort(-(np.asarray(scores) / max(temperature, 1e-6) + g), kind="stable")


def rejection_sample(
    scores: np.ndarray,
    label: int,
    rng: np.random.Generator,
    cfg: TeacherConfig = TeacherConfig(),
) -> tuple[np.ndarray | None, int]:
    """(ranking with `label` first, tries used) or (None, tries) when no try put the held-out item first.

    The first try is the teacher's own ranking when cfg.greedy_first (its belief, not a lucky sample).
    """
    for t in range(cfg.max_tries):
        if t == 0 and cfg.greedy_first:
            r = np.argsort(-np.asarray(scores), kind="stable")
        else:
            r = sample_ranking(scores, rng, cfg.temperature)
        if r[0] == label:
            return r, t + 1
    return None, cfg.max_tries


def answer_order(ranking: Sequence[int], top_k: int, tail_order: str = "retriever") -> np.ndarray:
    """The answer's permutation: the top_k of `ranking` (what the trace argues for), then the rest either in
    retriever order ("retriever": ascending index, a pattern a small model learns exactly) or as sampled."""
    r = [int(i) for i in ranking]
    if tail_order == "sampled":
        return np.asarray(r)
    if tail_order != "retriever":
        raise ValueError(f"tail_order must be 'retriever' or 'sampled', got {tail_order!r}")
    head = r[:top_k]
    return np.asarray(head + sorted(i for i in r if i not in head))


def make_trace(
    evidence_buckets: np.ndarray,
    scores: np.ndarray,
    ranking: Sequence[int] | None = None,
    feature_names: Sequence[str] | None = None,
    contributions: np.ndarray | None = None,
    top_k: int = 3,
    reasons_per_item: int = 2,
) -> str:
    """Structured steps citing the top_k candidates of `ranking` with their strongest evidence, then the top list:

        step 1 : [C] follows-last-item <trans_3> co-occurs-with-history <co_2> ; step 2 : ... ; top [C] [A] [F]

    A feature is cited for a candidate when its bucket is > 0 and it raised that candidate's score
    (contributions [N, F], e.g. Teacher.contributions; default: the buckets themselves), strongest first.
    `ranking` is the (rejection-sampled) ranking the answer will state; None = the teacher's order by `scores`.

    Three other traces were trained and measured on Beauty (bench profile, same pipeline, tau 0.9) and dropped.
    The first two lost on speed, the third on accuracy:
    - each cited candidate's whole evidence row: the diffusion model committed evidence that is likely for any
      strong candidate one token per round, ahead of the label it describes (2.09 tokens per forward after CFT,
      against 2.47 for this trace);
    - each cited candidate's semantic ID: it copied each code token only after the one before it (2.39);
    - the shortlist alone ("[C] [A] [F]"): 3.28 tokens per forward after CFT and 4.05 after RL. But the AR
      teacher's validation R@1 fell from 0.375 to 0.325, the student's to 0.285, and CFT's validity to 0.575.
    """
    b = np.asarray(evidence_buckets, dtype=np.int64)
    contrib = b.astype(np.float64) if contributions is None else np.asarray(contributions, dtype=np.float64)
    aliases = feature_aliases(feature_names, b.shape[1])
    if ranking is None:
        ranking = np.argsort(-np.asarray(scores), kind="stable")
    steps = []
    top = [int(i) for i in ranking[:top_k]]
    for k, i in enumerate(top):
        order = np.argsort(-contrib[i], kind="stable")
        cited = [f for f in order if b[i, f] > 0 and contrib[i, f] > 0][:reasons_per_item]
        reasons = [f"{feature_phrase(aliases[f])} {bucket_token(aliases[f], b[i, f])}" for f in cited]
        steps.append(
            f"{STEP} {k + 1} {COLON} {label_token(i)} {' '.join(reasons) if reasons else NO_SIGNAL} {SEMI}"
        )
    return " ".join([*steps, TOP, *(label_token(i) for i in top)])


# ----------------------------------------------------------------------------- SFT records


class SFTRecord(NamedTuple):
    prompt_ids: list[int]
    response_ids: list[int]
    response_weights: list[float]


def evidence_features(examples: pd.DataFrame, evidence: Any) -> np.ndarray:
    """Features [L, N, F] from a fitted gr2.evidence.Evidence. Training examples subtract their own target
    interaction (own_target), as the retriever does, so training and test features match in distribution."""
    own = [t if s == "train" else None for t, s in zip(examples["target"], examples["split"], strict=True)]
    return evidence.features_batch(examples["history"].tolist(), examples["candidates"].tolist(), own)


def fit_teacher(
    features: np.ndarray, labels: np.ndarray, feature_names: Sequence[str], cfg: TeacherConfig, seed: int = 0
) -> Teacher:
    """Fit on (a seeded subsample of at most cfg.max_train_lists) training lists."""
    idx = np.arange(len(labels))
    if cfg.max_train_lists and len(idx) > cfg.max_train_lists:
        idx = np.sort(np.random.default_rng(seed).choice(idx, cfg.max_train_lists, replace=False))
    return Teacher.fit(features[idx], np.asarray(labels)[idx], feature_names, cfg.l2)


def build_sft_records_from_arrays(
    examples: pd.DataFrame,
    features: np.ndarray,
    buckets: np.ndarray,
    feature_names: Sequence[str],
    sids: SemanticIds,
    teacher: Teacher,
    tokenizer: Any,
    cfg: Profile,
    seed: int = 0,
    variant: str = "trace",
    stats: dict | None = None,
) -> list[SFTRecord]:
    """One record per kept example. variant "trace": trace + answer; "ar_no_trace": answer only, with the
    same rejection-sampled rankings (same seed), so the two variants differ only by the trace."""
    if variant not in ("trace", "ar_no_trace"):
        raise ValueError(f"variant must be 'trace' or 'ar_no_trace', got {variant!r}")
    tc = cfg.teacher
    rng = np.random.default_rng(seed)
    scores = teacher.scores(features)
    contrib = teacher.contributions(features)
    records: list[SFTRecord] = []
    tries, trace_len, answer_len, prompt_len, kept_rows = [], [], [], [], []
    labels = examples["label"].to_numpy()
    for r, (hist, cands) in enumerate(
        tqdm(
            zip(examples["history"], examples["candidates"], strict=True),
            total=len(examples),
            disable=None,
            desc=f"sft records ({variant})",
        )
    ):
        ranking, n_try = rejection_sample(scores[r], int(labels[r]), rng, tc)
        tries.append(n_try)
        if ranking is None:
            continue
        ranking = answer_order(ranking, tc.top_k, tc.tail_order)
        trace = None
        if variant == "trace":
            trace = make_trace(
                buckets[r], scores[r], ranking, feature_names, contrib[r], tc.top_k, tc.reasons_per_item
            )
        p, resp, w = encode_example(
            tokenizer,
            [sids.codes[i] for i in hist],
            [sids.codes[c] for c in cands],
            buckets[r],
            [int(i) for i in ranking],
            trace,
            feature_names,
            cfg.sft.answer_weight,
            cfg.sft.trace_weight,
        )
        records.append(SFTRecord(p, resp, w))
        kept_rows.append(r)
        n_trace = len(trace.split()) if trace else 0  # whitespace word-level: one token per word
        trace_len.append(n_trace)
        answer_len.append(len(resp) - n_trace)
        prompt_len.append(len(p))
        if r and r % 5000 == 0:
            log.info("sft records %s: %d/%d examples, kept %d", variant, r, len(examples), len(records))
    if stats is not None:
        stats.update(
            variant=variant,
            n_examples=len(examples),
            n_kept=len(records),
            kept_frac=len(records) / max(len(examples), 1),
            mean_tries=float(np.mean(tries)) if tries else 0.0,
            mean_prompt_tokens=float(np.mean(prompt_len)) if prompt_len else 0.0,
            max_prompt_tokens=int(max(prompt_len)) if prompt_len else 0,
            mean_trace_tokens=float(np.mean(trace_len)) if trace_len else 0.0,
            mean_answer_tokens=float(np.mean(answer_len)) if answer_len else 0.0,
            kept_rows=kept_rows,  # row of `examples` behind each record
        )
    return records


def build_sft_records(
    examples: pd.DataFrame,
    evidence: Any,
    sids: SemanticIds,
    teacher: Teacher,
    tokenizer: Any,
    cfg: Profile,
    seed: int = 0,
    variant: str = "trace",
    stats: dict | None = None,
) -> list[SFTRecord]:
    """SFT records (prompt_ids, response_ids, response_weights) for the training examples of `examples`,
    with evidence computed by a fitted gr2.evidence.Evidence (features_batch + buckets; bucket edges are fitted
    on these training lists when the Evidence has none yet)."""
    train = examples[examples["split"] == "train"].reset_index(drop=True)
    x = evidence_features(train, evidence)
    if getattr(evidence, "bucket_edges", None) is None:  # bucket edges come from training features only
        log.info("evidence buckets not fitted yet: fitting them on the %d training lists", len(train))
        evidence.fit_buckets(x)
    b = evidence.buckets(x)
    return build_sft_records_from_arrays(
        train, x, b, teacher.feature_names, sids, teacher, tokenizer, cfg, seed, variant, stats
    )
