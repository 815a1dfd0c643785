"""A sequential recommender (SASRec: a causal transformer over item ids) fitted on the training sequences.

The evidence features read the history as pairs: transitions from the last or recent items, co-occurrence counts.
A next-item model reads it as a sequence and learns an embedding per item, so it sees what no count of pairs
shows. Issue 40 asks whether the history as a sequence carries anything the features miss;
`analysis.feature_rankers` scores the run's lists with this model, alone and blended with the feature rankers.

Training (Kang & McAuley, 2018, with a full softmax in place of sampled negatives): windows of `max_len + 1`
training items, left-padded; each position predicts the next item over the whole catalogue, the output layer tied
to the input embeddings. Scoring: the hidden state after a list's history, dotted with each
candidate's embedding. An empty history still reads the position embeddings (a popularity-like score); an item
the training sequences never had scores 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

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
        self.model = model.eval()
        self.config = config

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
    train_seqs: Mapping[str, Sequence[str]], config: SequenceConfig | None = None, seed: int = 0
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
    bar = tqdm(range(cfg.epochs), desc="sasrec", disable=None)
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
        log.info("sasrec epoch %d: loss %.3f over %d next items", epoch, total / n, n)
    return SequenceModel(index, model, cfg)
