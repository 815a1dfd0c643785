"""A neural ranker on the evidence alone, trained on the held-out items: how far any model that reads only the
prompt's evidence can go (issue 40).

The generative re-ranker sees each candidate's evidence (bucketed) and the whole list; `ltr` sees the raw evidence
plus list context, one candidate at a time. If a network that reads the same raw evidence as `ltr`, attends across
the list, and is trained on the held-out items directly (list softmax, no trace to imitate) does not beat `ltr`,
the evidence itself is the ceiling, and a re-ranker that reads nothing else cannot pass it either.

Two shapes, so the list's share is measured apart: "mlp" scores each candidate from its own features (with the
list context `ltr` has: each feature minus its list maximum); "listwise" adds self-attention across the candidates.
Training lists only: a seeded tenth of them stops training (R@1), the split being judged is never seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

SHAPES = ("mlp", "listwise")


@dataclass(frozen=True)
class ListwiseConfig:
    shape: str = "listwise"  # SHAPES
    d_model: int = 64
    n_layer: int = 2  # attention layers ("listwise" only)
    n_head: int = 4
    lr: float = 2e-3
    batch_size: int = 256
    max_epochs: int = 60
    patience: int = 8  # epochs without a better held-out R@1 before stopping
    holdout: float = 0.1  # share of the training lists that decides when to stop


def list_inputs(x: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L, N, F] evidence, list lengths [L] -> ([L, N, 2F] the features and each minus its list's maximum, the
    list context `gr2.ltr.list_features` gives `ltr`, here over the list's own rows; the mask [L, N] of real
    rows). Rows past a list's end are zeros."""
    mask = np.arange(x.shape[1])[None, :] < np.asarray(n)[:, None]
    top = np.where(mask[..., None], x, -np.inf).max(axis=1, keepdims=True)
    out = np.concatenate([x, np.where(mask[..., None], x - top, 0.0)], axis=-1)
    return np.where(mask[..., None], out, 0.0).astype(np.float32), mask


def _standardised(z: np.ndarray, mask: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return np.where(mask[..., None], (z - mean) / std, 0.0).astype(np.float32)


class ListScorer(nn.Module):
    """Per-candidate embedding, optional self-attention across the list (no positions: the retriever rank is a
    feature), a score per candidate; rows past a list's end score -inf."""

    def __init__(self, n_features: int, cfg: ListwiseConfig):
        super().__init__()
        if cfg.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {cfg.shape!r}")
        d = cfg.d_model
        self.embed = nn.Sequential(nn.Linear(n_features, d), nn.GELU(), nn.Linear(d, d))
        self.attend = nn.ModuleList(
            nn.TransformerEncoderLayer(d, cfg.n_head, 2 * d, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(cfg.n_layer if cfg.shape == "listwise" else 0)
        )
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.attend:
            h = layer(h, src_key_padding_mask=~mask)
        return self.head(h).squeeze(-1).masked_fill(~mask, float("-inf"))


@dataclass
class ListwiseRanker:
    """A fitted ListScorer and the training inputs' standardisation."""

    net: ListScorer
    mean: np.ndarray
    std: np.ndarray
    holdout_recall: float  # R@1 on the training lists held out to stop
    epochs: int  # epochs trained to the kept weights

    def scores(self, x: np.ndarray, n: np.ndarray) -> np.ndarray:
        """[L, N] log-softmax scores of each list's candidates (-inf past its end)."""
        z, mask = list_inputs(x, n)
        z = _standardised(z, mask, self.mean, self.std)
        self.net.eval()
        with torch.no_grad():
            return self.net(torch.from_numpy(z), torch.from_numpy(mask)).log_softmax(-1).numpy()


def fit_listwise(
    x: np.ndarray, n: np.ndarray, labels: np.ndarray, cfg: ListwiseConfig, seed: int = 0
) -> ListwiseRanker:
    """Fit on training lists ([L, N, F] evidence, lengths, held-out item indices) with the list softmax loss;
    keep the epoch whose weights score best on the held-out share."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    z, mask = list_inputs(x, n)
    mean, std = z[mask].mean(axis=0), z[mask].std(axis=0) + 1e-6
    z = _standardised(z, mask, mean, std)
    order = rng.permutation(len(labels))
    held, fit_rows = order[: int(len(order) * cfg.holdout)], order[int(len(order) * cfg.holdout) :]
    zt, mt, yt = torch.from_numpy(z), torch.from_numpy(mask), torch.as_tensor(labels, dtype=torch.long)
    net = ListScorer(z.shape[-1], cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=1e-4)
    best, best_state, best_epoch = -1.0, None, 0
    for epoch in range(1, cfg.max_epochs + 1):
        net.train()
        rng.shuffle(fit_rows)
        for b in range(0, len(fit_rows), cfg.batch_size):
            rows = torch.from_numpy(fit_rows[b : b + cfg.batch_size])
            loss = nn.functional.cross_entropy(net(zt[rows], mt[rows]), yt[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            hit = (net(zt[held], mt[held]).argmax(-1) == yt[held]).float().mean().item()
        if hit > best:
            best, best_epoch = hit, epoch
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
        elif epoch - best_epoch >= cfg.patience:
            break
    assert best_state is not None
    net.load_state_dict(best_state)
    return ListwiseRanker(net, mean, std, best, best_epoch)
