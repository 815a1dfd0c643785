"""A real generative bundle for the serving tests and the hostile probe (serving tests serve a trained model, not a
stand-in): the pipeline's own stages (prepare -> AR SFT -> conversion -> CFT) on the ml-latest-small slice whose
users and items the serving fixtures' Feast repo holds (tests/serving/support.py), with a tiny model and few
steps (about 30 s on 2 idle cores). Its bundle carries the AR model as its verifier (as OPD's does), so every
decoder serves, and the cold-start ranker. It is trained on every list length 2..10, as the pipeline's models
are, but a 14k-parameter model on 600 lists does not rank every length validly (10 candidates: mostly valid):
the serving tests check what serving promises whatever the model writes (each request answered with a
permutation of its own candidates, the fallback when invalid); the pipeline's report measures validity by
length.

    python -m tests.serving.toy_model --out /tmp/toy   -> /tmp/toy/bundle
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from gr2.candidates import attach_candidates
from gr2.config import load_profile
from gr2.data import load_dataset
from gr2.data.dataset import data_root
from gr2.data.split import build_targets, train_sequences
from gr2.generative import load_bundle, save_bundle
from gr2.retriever import CoocRetriever
from gr2.stages.prepare import prepare_sft
from gr2.stages.train_stages import convert, train_ar_teacher, train_cft

OVERRIDES = {
    # Half the lists cut shorter (the pipeline cuts a quarter of many more): the toy learns every length too.
    "data": {"history_len": 20, "n_candidates": 10, "max_train_examples": 1200, "short_list_share": 0.5},
    "sid.content_weight": 0.0,  # content-free semantic IDs: no sentence-embedding model to load
    "sid.kmeans_iters": 5,
    "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64, "max_len": 320},
    "sft": {
        "lr": 0.01,
        "batch_size": 16,
        "max_steps": 300,
        "epochs": 20,
        "warmup": 10,
        "checkpoint_every": 1000,
    },
    "cft": {
        "lr": 0.01,
        "batch_size": 16,
        "max_steps": 250,
        "epochs": 20,
        "warmup": 10,
        "checkpoint_every": 1000,
    },
    "diffusion": {"block_size": 4, "taus": [0.5], "eval_tau": 0.5, "spec_tau": 0.5, "cft_targets": "sft"},
}
TRAIN_TARGETS = 5000  # training targets offered to the retriever (its hits become the training lists)


def train_toy_bundle(out: str | Path, users: set[str]) -> Path:
    """Train the toy on the interactions of `users` and write its bundle to out/bundle."""
    out = Path(out)
    torch.set_num_threads(1)
    ds = load_dataset(data_root() / "ml-latest-small")
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    ds.items = ds.items[ds.items["item_id"].isin(ds.interactions["item_id"])].reset_index(drop=True)
    prof = load_profile("smoke", OVERRIDES)
    seqs = train_sequences(ds)
    retriever = CoocRetriever(prof.retriever).fit(seqs, ds.items["item_id"].tolist())
    targets = build_targets(ds, prof.data.history_len)
    train = targets.index[targets["split"] == "train"]
    drop = train.to_series().sample(n=max(len(train) - TRAIN_TARGETS, 0), random_state=0)
    examples, _ = attach_candidates(
        targets.drop(drop.index).reset_index(drop=True), retriever, prof.data.n_candidates
    )
    data = prepare_sft(examples, ds, prof)
    ar = train_ar_teacher(data, prof, out / "ar")
    dc = prof.diffusion
    naive = convert(ar, dc, out / "naive")
    cft = train_cft(naive, data, prof, out / "cft")
    student = load_bundle(cft)
    toy = replace(student, config=replace(student.config, name="toy"), verifier=load_bundle(ar).model)
    return save_bundle(out / "bundle", toy)


def main() -> None:
    from tests.serving.support import load_ml_slice

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    print(train_toy_bundle(a.out, set(load_ml_slice()["history"])))


if __name__ == "__main__":
    main()
