"""Ingredients shared by every generative stage: evidence tables, semantic IDs, tokenizer, reasoning teacher and
the SFT records (prompt -> trace + answer). Built once from the training split and saved to a folder, so the
AR teacher, its no-trace ablation and CFT all train on exactly the same data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from gr2.candidates import shorten_some
from gr2.config import Profile
from gr2.data.dataset import Dataset
from gr2.data.split import train_sequences
from gr2.evidence import Evidence
from gr2.sid import SemanticIds, build_semantic_ids
from gr2.teacher import SFTRecord, Teacher, build_sft_records, fit_teacher
from gr2.tokenizer import load_tokenizer, tokenizer_for

log = logging.getLogger(__name__)
COLD_START_FILE = "cold_start.json"


@dataclass
class SFTData:
    evidence: Evidence
    sids: SemanticIds
    tokenizer: Any
    teacher: Teacher
    records: dict[str, list[SFTRecord]]  # variant ("trace" | "ar_no_trace") -> one record per training list
    stats: dict
    cold_start: Teacher | None = None  # the ranker of users without usable history (`fit_cold_start`)

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.evidence.save(out / "evidence")
        self.sids.save(out / "sids.json")
        self.tokenizer.save_pretrained(str(out / "tokenizer"))
        self.teacher.save(out / "teacher.json")
        if self.cold_start is not None:
            self.cold_start.save(out / COLD_START_FILE)
        torch.save(
            {k: [tuple(list(x) for x in r) for r in v] for k, v in self.records.items()}, out / "records.pt"
        )
        (out / "stats.json").write_text(json.dumps(self.stats, indent=2, default=float))
        return out

    @classmethod
    def load(cls, path: str | Path) -> SFTData:
        p = Path(path)
        return cls(
            evidence=Evidence.load(p / "evidence"),
            sids=SemanticIds.load(p / "sids.json"),
            tokenizer=load_tokenizer(p / "tokenizer"),
            teacher=Teacher.load(p / "teacher.json"),
            records={k: [SFTRecord(*r) for r in v] for k, v in torch.load(p / "records.pt").items()},
            stats=json.loads((p / "stats.json").read_text()),
            cold_start=Teacher.load(p / COLD_START_FILE) if (p / COLD_START_FILE).exists() else None,
        )


def list_features(evidence: Evidence, df: pd.DataFrame, cold: bool = False) -> np.ndarray:
    """[L, N, F] evidence features; training lists subtract their own target interaction (as the retriever) and
    read the `sequence` feature out of their user's fold. `cold`: as for a user without history (every history
    feature empty)."""
    own = [t if s == "train" else None for t, s in zip(df["target"], df["split"], strict=True)]
    histories = [[] for _ in range(len(df))] if cold else df["history"].tolist()
    return evidence.features_batch(histories, df["candidates"].tolist(), own, df["user_id"].tolist())


def fit_cold_start(evidence: Evidence, train: pd.DataFrame, profile: Profile) -> Teacher:
    """The cold-start ranker: the reasoning teacher's listwise model refit on the training lists with their
    histories removed, so it weighs what a user without history still has (popularity, retriever rank, ...).
    Serving routes a request with no known history id to it (gr2/generative.py): the generative model never saw
    an empty history. Chosen on validation lists with histories removed (docs/SERVING.md): the warm teacher
    falls far below the retriever order there, this one does not; raw evidence beat the prompt's buckets."""
    cfg = dataclasses.replace(profile.teacher, inputs="raw")
    x = list_features(evidence, train, cold=True)
    return fit_teacher(x, train["label"].to_numpy(), evidence.feature_names, cfg, profile.prompt.score_levels)


def _subsample(df: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    if n <= 0 or len(df) <= n:
        return df
    return df.sample(n=n, random_state=seed).sort_index()


def prepare_sft(
    examples: pd.DataFrame, dataset: Dataset, profile: Profile, evidence: Evidence | None = None
) -> SFTData:
    """Fit semantic IDs, tokenizer and the reasoning teacher on the training split; build the SFT records.

    `evidence`: the per-item tables the feature store serves (pipeline); fitted here from training sequences
    when None. Its bucket edges are fitted on the training lists' features here either way."""
    t0 = time.perf_counter()
    seed = profile.seed
    seqs = train_sequences(dataset, profile.data.eval_positions)
    if evidence is None:
        evidence = Evidence.fit(seqs, dataset.items, profile.evidence, profile.sequence, seed)
    train = _subsample(examples[examples["split"] == "train"], profile.data.max_train_examples, seed)
    train = train.reset_index(drop=True)
    x_train = list_features(evidence, train)
    evidence.fit_buckets(x_train, profile.prompt.n_buckets)
    sids = build_semantic_ids(dataset.name, dataset.items, seqs, profile.sid, seed)
    names = evidence.feature_names  # without the features the data cannot supply
    tokenizer = tokenizer_for(sids, names, profile.prompt)
    labels = train["label"].to_numpy()
    teacher = fit_teacher(
        x_train, labels, names, profile.teacher, profile.prompt.score_levels, seed, evidence.bucket_edges
    )
    cold_start = fit_cold_start(evidence, train, profile)
    stats: dict = {"sid": sids.stats, "n_train_lists": len(train), "vocab_size": len(tokenizer)}
    stats |= {"features": list(names), "dropped_features": dict(evidence.dropped_features)}
    val = examples[examples["split"] == "val"]  # the test row is the report's (gr2/stages/evaluate.py)
    if len(val):
        y_val = val["label"].to_numpy()
        stats["teacher_recall@1_val"] = teacher.recall_at(list_features(evidence, val), y_val)
        stats["cold_start_recall@1_val"] = cold_start.recall_at(
            list_features(evidence, val, cold=True), y_val
        )
        stats["floor_recall@1_val"] = float(np.mean(y_val == 0))
    # The records: a share of the lists cut shorter (every length 2..N is served), each with its own features
    # (retriever_rank is the position in the cut list); the rest reuse the full lists' features.
    lists = shorten_some(train, profile.data.short_list_share, seed)
    cut = (lists["candidates"].map(len) < train["candidates"].map(len)).to_numpy()
    x_lists = x_train.copy()
    if cut.any():
        x_cut = list_features(evidence, lists[cut])
        x_lists[cut] = 0.0
        x_lists[cut, : x_cut.shape[1]] = x_cut
    b_lists = evidence.buckets(x_lists)
    lengths = lists["candidates"].map(len).value_counts().sort_index()
    stats["list_lengths"] = {int(k): int(v) for k, v in lengths.items()}
    records = {}
    for variant in ("trace", "ar_no_trace"):
        st: dict = {}
        records[variant] = build_sft_records(
            lists, x_lists, b_lists, names, sids, teacher, tokenizer, profile, variant=variant, stats=st
        )
        stats[f"records_{variant}"] = st
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    log.info("prepare_sft: %s", {k: v for k, v in stats.items() if k != "sid"})
    return SFTData(evidence, sids, tokenizer, teacher, records, stats, cold_start)
