"""Ingredients shared by every generative stage: evidence tables, semantic IDs, tokenizer, reasoning teacher and
the SFT records (prompt -> trace + answer). Built once from the training split and saved to a folder, so the
AR teacher, its no-trace ablation and CFT all train on exactly the same data.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from gr2.config import Profile
from gr2.data.dataset import Dataset
from gr2.data.split import train_sequences
from gr2.evidence import Evidence
from gr2.sid import SemanticIds, build_semantic_ids
from gr2.teacher import SFTRecord, Teacher, build_sft_records, fit_teacher
from gr2.tokenizer import load_tokenizer, tokenizer_for

log = logging.getLogger(__name__)


@dataclass
class SFTData:
    evidence: Evidence
    sids: SemanticIds
    tokenizer: Any
    teacher: Teacher
    records: dict[str, list[SFTRecord]]  # variant ("trace" | "ar_no_trace") -> one record per training list
    stats: dict

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.evidence.save(out / "evidence")
        self.sids.save(out / "sids.json")
        self.tokenizer.save_pretrained(str(out / "tokenizer"))
        self.teacher.save(out / "teacher.json")
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
        )


def list_features(evidence: Evidence, df: pd.DataFrame) -> np.ndarray:
    """[L, N, F] evidence features; training lists subtract their own target interaction (as the retriever)."""
    own = [t if s == "train" else None for t, s in zip(df["target"], df["split"], strict=True)]
    return evidence.features_batch(df["history"].tolist(), df["candidates"].tolist(), own)


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
        evidence = Evidence.fit(seqs, dataset.items, profile.evidence)
    train = _subsample(examples[examples["split"] == "train"], profile.data.max_train_examples, seed)
    train = train.reset_index(drop=True)
    x_train = list_features(evidence, train)
    evidence.fit_buckets(x_train, profile.prompt.n_buckets)
    b_train = evidence.buckets(x_train)
    sids = build_semantic_ids(dataset.name, dataset.items, seqs, profile.sid, seed)
    names = evidence.feature_names  # without the features the data cannot supply
    tokenizer = tokenizer_for(sids, names, profile.prompt)
    labels = train["label"].to_numpy()
    teacher = fit_teacher(
        x_train, labels, names, profile.teacher, profile.prompt.score_levels, seed, evidence.bucket_edges
    )
    stats: dict = {"sid": sids.stats, "n_train_lists": len(train), "vocab_size": len(tokenizer)}
    stats |= {"features": list(names), "dropped_features": dict(evidence.dropped_features)}
    val = examples[examples["split"] == "val"]  # the test row is the report's (gr2/stages/evaluate.py)
    if len(val):
        stats["teacher_recall@1_val"] = teacher.recall_at(
            list_features(evidence, val), val["label"].to_numpy()
        )
    records = {}
    for variant in ("trace", "ar_no_trace"):
        st: dict = {}
        records[variant] = build_sft_records(
            train, x_train, b_train, names, sids, teacher, tokenizer, profile, variant, st
        )
        stats[f"records_{variant}"] = st
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    log.info("prepare_sft: %s", {k: v for k, v in stats.items() if k != "sid"})
    return SFTData(evidence, sids, tokenizer, teacher, records, stats)
