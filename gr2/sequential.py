"""A sequential recommender (SASRec: a causal transformer over item ids) fitted on the training sequences.

The evidence features read the history as pairs: transitions from the last or recent items, co-occurrence counts.
A next-item model reads it as a sequence and learns an embedding per item, so it sees what no count of pairs
shows. With the profile's `sequence.folds` >= 2 its score is the evidence feature `sequence` (gr2/evidence.py,
`SequenceFeature`), which ltr, the teacher and the generative models all read; `analysis.feature_rankers` also scores
a run's lists with it alone and blended with the feature rankers (docs/RESULTS.md, 'Beyond the GBDT (issue #40)').

Training (Kang & McAuley, 2018, with a full softmax in place of sampled negatives): windows of `max_len + 1`
training items, left-padded; each position predicts the next item over the whole catalogue, the output layer tied
to the input embeddings. Scoring: the hidden state after a list's history, dotted with each
candidate's embedding. An empty history still reads the position embeddings (a popularity-like score); an item
the training sequences never had scores 0.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from gr2.config import SequenceConfig

log = logging.getLogger(__name__)


class SASRec(nn.Module):
    def __init__(self, n_items: int, config: SequenceConfig):
        super().__init__()
        d, L = config.d_model, config.max_len
        self.emb = nn.Embedding(n_items + 1, d, padding_idx=0)  # row 0: padding and unknown items
        self.pos = nn.Embedding(L, d)
        layer = nn.TransformerEncoderLayer(
            d, config.n_heads, 2 * d, dropout=config.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(config.dropout)
        # Small initial embeddings: the tied output layer starts near a uniform softmax (N(0, 1) rows started
        # the loss at 21 nats against log(12k) = 9.4, and it did not learn).
        nn.init.normal_(self.emb.weight, std=0.05)
        nn.init.normal_(self.pos.weight, std=0.05)
        with torch.no_grad():
            self.emb.weight[0].zero_()  # padding (and unknown items) stay the zero vector: never trained
        self.register_buffer("causal", torch.triu(torch.ones(L, L, dtype=torch.bool), 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L] left-padded item rows -> [B, L, d] hidden states. No key-padding mask: a padding row that
        sees only padding would be all-masked and its NaN would reach the real rows through the next layer."""
        h = self.drop(self.emb(ids) + self.pos.weight[None])
        return self.norm(self.encoder(h, mask=self.causal))


class SequenceModel:
    """A fitted SASRec and its item index; `scores` ranks candidates after a history."""

    def __init__(self, index: Mapping[str, int], model: SASRec, config: SequenceConfig):
        self.index = index  # item -> embedding row (0: padding and unknown items)
        # Scored in float64: a list's score then depends on its batch mates only below 1e-15 (float32: 1e-8), so
        # the evidence buckets of a served request never depend on which other requests share its batch.
        self.model = model.double().eval()
        self.config = config

    def save(self, path: str | Path) -> None:
        items = sorted(self.index, key=self.index.__getitem__)
        # trained in float32, so saved in it: exact, and half the size
        weights = {k: v.float() for k, v in self.model.state_dict().items()}
        state = {"config": dataclasses.asdict(self.config), "items": items, "state": weights}
        torch.save(state, path)

    @classmethod
    def load(cls, path: str | Path) -> SequenceModel:
        saved = torch.load(path, weights_only=True)
        config = SequenceConfig(**saved["config"])
        model = SASRec(len(saved["items"]), config)
        model.load_state_dict(saved["state"])
        return cls({x: i + 1 for i, x in enumerate(saved["items"])}, model, config)

    def _rows(self, histories: Sequence[Sequence[str]]) -> torch.Tensor:
        L = self.config.max_len
        rows = np.zeros((len(histories), L), np.int64)
        for r, h in enumerate(histories):
            ids = [self.index.get(x, 0) for x in list(h)[-L:]]
            rows[r, L - len(ids) :] = ids
        return torch.from_numpy(rows)

    @torch.inference_mode()
    def scores(
        self, histories: Sequence[Sequence[str]], candidates: Sequence[Sequence[str]], batch_size: int = 512
    ) -> np.ndarray:
        """[B, N] dot products of the state after each history with its candidates' embeddings (lists of equal
        length N)."""
        out = []
        for i in range(0, len(histories), batch_size):
            state = self.model(self._rows(histories[i : i + batch_size]))[:, -1]
            cand = torch.tensor([[self.index.get(x, 0) for x in c] for c in candidates[i : i + batch_size]])
            out.append(torch.einsum("bd,bnd->bn", state, self.model.emb(cand)).numpy())
        return np.concatenate(out) if out else np.zeros((0, 0))


def training_rows(
    seqs: Mapping[str, Sequence[str]], index: Mapping[str, int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next items) windows of max_len + 1 items, left-padded with 0: each sequence cut from its end into
    windows that overlap by one item, so every next item is a target once. A long history (MovieLens: about 100
    items) is all training data, not only its last window (ML-100K validation, the SASRec alone: 0.195 with the last
    window of each user, 0.225 with all). Sequences of fewer than 2 items teach nothing and are left out."""
    kept = []
    for s in seqs.values():
        ids = [index[x] for x in s]
        for end in range(len(ids), 1, -max_len):
            kept.append(ids[max(0, end - max_len - 1) : end])
    x = np.zeros((len(kept), max_len), np.int64)
    y = np.zeros((len(kept), max_len), np.int64)
    for r, ids in enumerate(kept):
        x[r, max_len - len(ids) + 1 :] = ids[:-1]
        y[r, max_len - len(ids) + 1 :] = ids[1:]
    return torch.from_numpy(x), torch.from_numpy(y)


def fit_sequence_model(
    train_seqs: Mapping[str, Sequence[str]],
    config: SequenceConfig | None = None,
    seed: int = 0,
    label: str = "sasrec",
) -> SequenceModel:
    """Train SASRec on the training sequences for config.epochs (full softmax over every training item)."""
    cfg = config or SequenceConfig()
    items = sorted({x for s in train_seqs.values() for x in s})
    index = {item: i + 1 for i, item in enumerate(items)}
    x, y = training_rows(train_seqs, index, cfg.max_len)
    if not len(x):
        raise ValueError("no training sequence has 2 items: nothing to learn a next item from")
    torch.manual_seed(seed)
    model = SASRec(len(items), cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    order = torch.Generator().manual_seed(seed)
    bar = tqdm(range(cfg.epochs), desc=label, disable=None)
    for epoch in bar:
        perm, total, n = torch.randperm(len(x), generator=order), 0.0, 0
        for i in range(0, len(x), cfg.batch_size):
            b = perm[i : i + cfg.batch_size]
            target = y[b]
            keep = target > 0  # the softmax only where there is a next item
            # over the items only: row 0 (padding, unknown items) is no class, so it stays zero
            logits = model(x[b])[keep] @ model.emb.weight[1:].T
            loss = F.cross_entropy(logits, target[keep] - 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            k = int(keep.sum())
            total, n = total + loss.item() * k, n + k
        bar.set_postfix(loss=f"{total / n:.3f}")
        log.info("%s epoch %d: loss %.3f over %d next items", label, epoch, total / n, n)
    return SequenceModel(index, model, cfg)


def fold_of(user: str, folds: int) -> int:
    """A user's fold (a stable hash: the same at every stage and on every machine)."""
    return zlib.crc32(str(user).encode()) % folds


class SequenceFeature:
    """The evidence feature `sequence`: the SASRec's score of each candidate after the history.

    A training list's own next item is in the training sequences, so the SASRec fitted on them has learned it: its
    score would leak the label into every training list (the count features subtract the list's own target for
    the same reason; a network cannot). So a training list is scored by the model fitted without its user's fold
    (out of fold, as in stacking), and every other list (validation, test, serving) by the model fitted on all
    training sequences, which never saw those lists' next items."""

    def __init__(self, full: SequenceModel, folds: Sequence[SequenceModel]):
        self.full = full
        self.folds = list(folds)  # folds[k]: fitted without the users of fold k

    def scores(
        self,
        histories: Sequence[Sequence[str]],
        candidates: Sequence[Sequence[str]],
        users: Sequence[str | None] | None = None,
    ) -> np.ndarray:
        """[B, N] scores (lists of equal length N). users[i]: the user of a training list (scored out of fold);
        None (or no users): a list whose next item no model saw (the full model)."""
        users = list(users) if users is not None else [None] * len(histories)
        groups: dict[int, list[int]] = {}
        for i, u in enumerate(users):
            groups.setdefault(-1 if u is None else fold_of(u, len(self.folds)), []).append(i)
        out = np.zeros((len(histories), len(candidates[0]) if len(candidates) else 0))
        for k, rows in groups.items():
            model = self.full if k < 0 else self.folds[k]
            out[rows] = model.scores([histories[i] for i in rows], [candidates[i] for i in rows])
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.full.save(path / "full.pt")
        for k, m in enumerate(self.folds):
            m.save(path / f"fold_{k}.pt")

    @classmethod
    def load(cls, path: str | Path) -> SequenceFeature | None:
        """The feature saved at `path`; None where none was saved (the profile's sequence.folds is 0)."""
        path = Path(path)
        if not (path / "full.pt").exists():
            return None
        n = len(list(path.glob("fold_*.pt")))
        return cls(
            SequenceModel.load(path / "full.pt"),
            [SequenceModel.load(path / f"fold_{k}.pt") for k in range(n)],
        )


def fit_sequence_feature(
    train_seqs: Mapping[str, Sequence[str]], config: SequenceConfig, seed: int = 0
) -> SequenceFeature:
    """One SASRec per fold of users (fitted without that fold) and one on all training sequences."""
    if config.folds < 2:
        raise ValueError(
            f"sequence.folds must be >= 2 to score training lists out of fold, got {config.folds}"
        )
    fold = {u: fold_of(u, config.folds) for u in train_seqs}
    folds = [
        fit_sequence_model(
            {u: s for u, s in train_seqs.items() if fold[u] != k},
            config,
            seed,
            f"sasrec fold {k + 1}/{config.folds}",
        )
        for k in range(config.folds)
    ]
    return SequenceFeature(fit_sequence_model(train_seqs, config, seed, "sasrec all"), folds)
