"""Per-candidate evidence features, computed only from per-item tables a feature store can serve.

Per item (one row of `item_tables()`, what goes to Feast): its top-K next-item transitions (item -> next
item in a training sequence) and top-K windowed co-occurrences with counts, its training popularity, its
categories and its title tokens. Per (history, candidate) we compute FEATURE_NAMES:

  trans_last        log1p T[last history item, c]
  trans_recent      log1p sum_k decay^k T[h_k, c] over the `recent` newest history items
  cooc_hist         log1p sum_k decay^k C[h_k, c] over the whole history
  popularity        log1p training count of c
  category_overlap  recency-weighted share of history items carrying c's categories (mean over them)
  title_sim         cosine of c's TF-IDF title vector with the recency-weighted history profile
  retriever_rank    position of c in the retriever's list (0 = first)
  sequence          a SASRec's score of c after the history (gr2/sequential.py; only with the profile's
                    sequence.folds >= 2: a model, not a table, saved beside the tables in `sequence/`)

A feature the data cannot supply is dropped, never served as a constant that looks like signal: with no
item carrying a category, `category_overlap`; with no item carrying a title token, `title_sim`
(`Evidence.feature_names` are the features kept, `Evidence.dropped_features` says why each content feature went;
both go into evidence.json, the prompts' vocabulary, the teacher, the LTR model and the report). `sequence` is kept
only with a sequence model, which the profile turns on (sequence.folds).

Fitting and serving both compute features from the K-truncated tables, so they agree exactly. For a
training example the example's own target interaction is subtracted from the counts (`own_target`), as
in the retriever, so training and test features have the same distribution. The SASRec cannot subtract an
interaction, so a training list's `sequence` is scored by a model fitted without its user (`users`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from gr2.config import EvidenceConfig, PromptConfig, SequenceConfig
from gr2.retriever import cooccurrence_counts, index_sequences, steps_back
from gr2.sequential import SequenceFeature, fit_sequence_feature

FEATURE_NAMES = (
    "trans_last",
    "trans_recent",
    "cooc_hist",
    "popularity",
    "category_overlap",
    "title_sim",
    "retriever_rank",
    "sequence",
)
# The features that need per-item content, and the item-table column that supplies each.
CONTENT_FEATURES = {"category_overlap": "categories", "title_sim": "title_tokens"}
SEQUENCE_DIR = "sequence"  # beside the item tables (a sources folder, an evidence folder): the SASRec models
_STOP = {"the", "and", "of", "for", "with", "in", "to", "by", "on", "an", "or", "oz", "fl", "ounce", "pack"}


def title_tokens(title: str, max_tokens: int) -> list[str]:
    """Lower-cased alphanumeric tokens of length >= 2, stop words dropped, unique, in order."""
    toks = [t for t in re.findall(r"[a-z0-9]+", title.lower()) if len(t) >= 2 and t not in _STOP]
    return list(dict.fromkeys(toks))[:max_tokens]


def _top_k(m: sp.csr_matrix, k: int) -> sp.csr_matrix:
    """Keep each row's k largest counts (ties: smaller column = smaller item id first)."""
    coo = m.tocoo()
    o = np.lexsort((coo.col, -coo.data, coo.row))
    r, c, v = coo.row[o], coo.col[o], coo.data[o]
    starts = np.searchsorted(r, np.arange(m.shape[0]))
    rank = np.arange(len(r)) - starts[r]
    keep = rank < k
    return sp.csr_matrix((v[keep], (r[keep], c[keep])), shape=m.shape)


class _Pairs:
    """Fast (row, col) -> value lookups into a sparse matrix via sorted int64 keys."""

    def __init__(self, m: sp.csr_matrix):
        coo = m.tocoo()
        self.n = m.shape[1]
        keys = coo.row.astype(np.int64) * self.n + coo.col
        o = np.argsort(keys)
        self.keys, self.vals = keys[o], coo.data[o].astype(np.float64)

    def get(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        out = np.zeros(len(rows))
        ok = (rows >= 0) & (cols >= 0)
        if not len(self.keys) or not ok.any():
            return out
        k = rows[ok] * self.n + cols[ok]
        j = np.minimum(np.searchsorted(self.keys, k), len(self.keys) - 1)
        out[ok] = np.where(self.keys[j] == k, self.vals[j], 0.0)
        return out


class Evidence:
    # The item tables and what `from_item_tables` builds from them (every constructor goes through it).
    _table: pd.DataFrame
    items: np.ndarray  # item ids, sorted
    index: dict[str, int]  # item id -> row
    pop: np.ndarray
    trans: _Pairs
    cooc: _Pairs
    cats: sp.csr_matrix
    title_vec: sp.csr_matrix

    def __init__(self, config: EvidenceConfig | None = None):
        self.config = config or EvidenceConfig()
        self.bucket_edges: np.ndarray | None = None  # [F, n_buckets - 1]
        self.feature_names: tuple[str, ...] = FEATURE_NAMES  # the features computed (FEATURE_NAMES order)
        self.dropped_features: dict[str, str] = {}  # feature -> why the data cannot supply it
        self.sequence: SequenceFeature | None = None  # the `sequence` feature's SASRec models

    # ------------------------------------------------------------------ fitting and tables
    @classmethod
    def fit(
        cls,
        train_seqs: Mapping[str, Sequence[str]],
        items: pd.DataFrame,
        config: EvidenceConfig | None = None,
        sequence: SequenceConfig | None = None,
        seed: int = 0,
    ) -> Evidence:
        """Count transitions, co-occurrences and popularity on training sequences (positions 0..n-3); with
        `sequence.folds` >= 2, fit the `sequence` feature's SASRec models on them too."""
        cfg = config or EvidenceConfig()
        seqs = list(train_seqs.values())
        ids = sorted(set(items["item_id"]) | {x for s in seqs for x in s})
        index = {x: i for i, x in enumerate(ids)}
        _, flat = index_sequences(seqs, index)
        pop = np.bincount(flat, minlength=len(ids))
        trans = _top_k(cooccurrence_counts(seqs, index, 1, directed=True), cfg.top_k)
        cooc = _top_k(cooccurrence_counts(seqs, index, cfg.window), cfg.top_k)
        meta = items.set_index("item_id").reindex(ids)
        cats = [list(c) if isinstance(c, list | tuple | np.ndarray) else [] for c in meta["categories"]]
        titles = meta["title"].fillna("").astype(str)
        table = pd.DataFrame(
            {
                "item_id": ids,
                "popularity": pop.astype(np.int64),
                "trans_ids": _row_lists(trans, np.asarray(ids, dtype=object)),
                "trans_counts": _row_lists(trans),
                "cooc_ids": _row_lists(cooc, np.asarray(ids, dtype=object)),
                "cooc_counts": _row_lists(cooc),
                "categories": cats,
                "title_tokens": [title_tokens(t, cfg.max_title_tokens) for t in titles],
            }
        )
        seq = (
            fit_sequence_feature(train_seqs, sequence, seed)
            if sequence is not None and sequence.folds
            else None
        )
        return cls.from_item_tables(table, {"config": dataclasses.asdict(cfg), "bucket_edges": None}, seq)

    def item_tables(self) -> pd.DataFrame:
        """One row per item (what the feature store serves); `attrs["evidence"]` holds config and buckets."""
        df = self._table.copy()
        df.attrs["evidence"] = self.meta()
        return df

    def meta(self) -> dict:
        edges = None if self.bucket_edges is None else self.bucket_edges.tolist()
        return {
            "config": dataclasses.asdict(self.config),
            "bucket_edges": edges,
            "features": list(self.feature_names),
            "dropped_features": dict(self.dropped_features),
        }

    @classmethod
    def from_item_tables(
        cls, df: pd.DataFrame, meta: dict | None = None, sequence: SequenceFeature | None = None
    ) -> Evidence:
        """Rebuild from the served tables (plus `meta` = config, bucket edges and the features kept; default
        `df.attrs`) and the `sequence` feature's models, if any. Without a feature list in `meta` (at fit), the
        table and the models decide which features are supplied."""
        meta = meta if meta is not None else df.attrs.get("evidence", {})
        ev = cls(EvidenceConfig(**meta.get("config", {})))
        df = df.sort_values("item_id", kind="stable").reset_index(drop=True)
        if meta.get("features") is None:
            ev.dropped_features = unsupplied_features(df)
            off = {"sequence"} if sequence is None else set()  # turned off by the profile: not a data gap
            ev.feature_names = tuple(f for f in FEATURE_NAMES if f not in ev.dropped_features.keys() | off)
        else:
            unknown = sorted(set(meta["features"]) - set(FEATURE_NAMES))
            if unknown:
                raise ValueError(
                    f"evidence meta names unknown features {unknown}: known {list(FEATURE_NAMES)}"
                )
            ev.feature_names = tuple(f for f in FEATURE_NAMES if f in meta["features"])
            ev.dropped_features = dict(meta.get("dropped_features") or {})
            if "sequence" in ev.feature_names and sequence is None:
                raise ValueError("evidence meta keeps the feature 'sequence' but no sequence model was given")
        if meta.get("bucket_edges") is not None:
            ev.bucket_edges = np.asarray(meta["bucket_edges"], dtype=np.float64)
            if len(ev.bucket_edges) != len(ev.feature_names):
                raise ValueError(
                    f"evidence meta has bucket edges for {len(ev.bucket_edges)} features, "
                    f"but {len(ev.feature_names)} features {list(ev.feature_names)}"
                )
        ev._table = df
        ev.sequence = sequence
        ev.items = df["item_id"].to_numpy(dtype=object)
        ev.index = {x: i for i, x in enumerate(ev.items)}
        n = len(ev.items)
        ev.pop = df["popularity"].to_numpy(np.float64)
        ev.trans = _Pairs(_from_lists(df["trans_ids"], df["trans_counts"], ev.index, n))
        ev.cooc = _Pairs(_from_lists(df["cooc_ids"], df["cooc_counts"], ev.index, n))
        ev.cats = _multi_hot(df["categories"])
        tf = _multi_hot(df["title_tokens"])
        idf = np.log((1 + n) / (1 + np.asarray((tf > 0).sum(0)).ravel())) + 1.0
        tfidf = sp.csr_matrix(tf.multiply(idf[None, :]))
        norms = np.sqrt(np.asarray(tfidf.multiply(tfidf).sum(1)).ravel())
        ev.title_vec = sp.csr_matrix(sp.diags(1.0 / np.maximum(norms, 1e-12)) @ tfidf)
        ev.title_vec.sort_indices()  # each row's entries in column order (`_profile_dot` sums them in it)
        return ev

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._table.to_parquet(path / "item_tables.parquet", index=False)
        (path / "evidence.json").write_text(json.dumps(self.meta(), indent=1))
        if self.sequence is not None:
            self.sequence.save(path / SEQUENCE_DIR)

    @classmethod
    def load(cls, path: str | Path) -> Evidence:
        path = Path(path)
        meta = json.loads((path / "evidence.json").read_text())
        table = pd.read_parquet(path / "item_tables.parquet")
        return cls.from_item_tables(table, meta, SequenceFeature.load(path / SEQUENCE_DIR))

    # ------------------------------------------------------------------ features
    def features(
        self, history: Sequence[str], candidates: Sequence[str], own_target: str | None = None
    ) -> np.ndarray:
        """[N, F] features of one list (history oldest -> newest, candidates in retriever order)."""
        return self.features_batch([history], [candidates], [own_target])[0]

    def features_batch(
        self,
        histories: Sequence[Sequence[str]],
        candidates: Sequence[Sequence[str]],
        own_targets: Sequence[str | None] | None = None,
        users: Sequence[str] | None = None,
        chunk: int = 5000,
    ) -> np.ndarray:
        """[B, N, F] features (F = `feature_names`), N the longest list. Lists may differ in length (serving
        batches what clients send): a shorter list's rows past its end are zeros, so read list i as
        x[i, :len(candidates[i])]. Computed in groups of one length, chunked to bound memory.

        own_targets[i]: a training list's own next item (its counts are subtracted); users[i]: its user (its
        `sequence` is scored out of fold), required with own targets when the evidence has that feature."""
        histories, candidates = list(histories), list(candidates)
        own = list(own_targets) if own_targets is not None else [None] * len(histories)
        who = list(users) if users is not None else [None] * len(histories)
        if self.sequence is not None and users is None and any(t is not None for t in own):
            raise ValueError(
                "training lists (own_targets) need their users: the 'sequence' feature scores them out of fold"
            )
        out = np.zeros((len(candidates), max(map(len, candidates), default=0), len(self.feature_names)))
        by_length: dict[int, list[int]] = {}
        for i, cs in enumerate(candidates):
            by_length.setdefault(len(cs), []).append(i)
        for n, rows in by_length.items():
            for lo in range(0, len(rows), chunk):
                part = rows[lo : lo + chunk]
                out[part, :n] = self._features(
                    [histories[i] for i in part],
                    [candidates[i] for i in part],
                    [own[i] for i in part],
                    [who[i] if own[i] is not None else None for i in part],
                )
        return out

    def _features(self, histories, candidates, own, users) -> np.ndarray:
        """[B, N, F] of lists that all have one length N (users: a training list's user, else None)."""
        cfg = self.config
        B = len(histories)
        N = len(candidates[0]) if B else 0
        cand = np.array([[self.index.get(c, -1) for c in cs] for cs in candidates], dtype=np.int64).reshape(
            B, N
        )
        tgt = np.array([self.index.get(t, -1) if t is not None else -1 for t in own], dtype=np.int64)
        rows, flat = index_sequences(histories, self.index)
        back = steps_back(rows, B)
        w = cfg.decay ** back.astype(np.float64)
        last_item = np.full(B, -1, np.int64)
        last_item[rows[back == 0]] = flat[back == 0]
        # How many of the `window` positions just before the target hold each slot's item: the pairs the
        # own target interaction added to C[h_k, target]; T[h_k, target] got one iff h_k is the last item.
        near = (back < cfg.window) & (flat >= 0)
        near_keys, near_cnt = np.unique(rows[near] * len(self.items) + flat[near], return_counts=True)
        slot_keys = np.where(flat >= 0, rows * len(self.items) + flat, -1)
        cooc_own = np.zeros(len(flat))
        if len(near_keys):
            j = np.minimum(np.searchsorted(near_keys, slot_keys), len(near_keys) - 1)
            cooc_own = np.where(near_keys[j] == slot_keys, near_cnt[j], 0).astype(np.float64)
        trans_own = (flat == last_item[rows]).astype(np.float64)

        X = np.zeros((B, N, len(FEATURE_NAMES)))
        one = np.ones(B)
        X[:, :, 0] = self._vote(self.trans, np.arange(B), last_item, one, one, cand, tgt)
        rec = back < cfg.recent
        X[:, :, 1] = self._vote(self.trans, rows[rec], flat[rec], w[rec], trans_own[rec], cand, tgt)
        X[:, :, 2] = self._vote(self.cooc, rows, flat, w, cooc_own, cand, tgt)
        X[:, :, :3] = np.log1p(X[:, :, :3])
        pop = np.where(cand >= 0, self.pop[np.maximum(cand, 0)], 0.0) - (cand == tgt[:, None]) * (cand >= 0)
        X[:, :, 3] = np.log1p(np.maximum(pop, 0.0))
        # q: each list's history items with their recency weights, an item seen twice summed, in (list, item)
        # order: the rows of the profiles below (they add the items' vectors in this order).
        ok = flat >= 0
        q_keys, at = np.unique(rows[ok] * len(self.items) + flat[ok], return_inverse=True)
        q = (q_keys // len(self.items), q_keys % len(self.items), np.bincount(at, weights=w[ok]))
        wsum = _row_sums(q[2], q[0], B)
        X[:, :, 4] = self._profile_dot(self.cats, q, cand, norm="mean") / np.maximum(wsum, 1e-12)[:, None]
        X[:, :, 5] = self._profile_dot(self.title_vec, q, cand, norm="cosine")
        X[:, :, 6] = np.arange(N)[None, :]
        if self.sequence is not None and "sequence" in self.feature_names and B and N:
            X[:, :, 7] = self.sequence.scores(histories, candidates, users)
        return X[:, :, [FEATURE_NAMES.index(f) for f in self.feature_names]]

    @staticmethod
    def _vote(pairs: _Pairs, rows, items, weights, own_cnt, cand, tgt) -> np.ndarray:
        """sum over history slots (rows, items, weights) of count[item, candidate] -> [B, N]."""
        B, N = cand.shape
        rr = np.repeat(rows, N)
        jj = np.tile(np.arange(N), len(rows))
        cc = cand[rr, jj]
        v = pairs.get(np.repeat(items, N), cc)
        is_own = (cc == tgt[rr]) & (cc >= 0)
        v = np.where(is_own, np.maximum(v - np.repeat(own_cnt, N), 0.0), v)
        return np.bincount(rr * N + jj, weights=v * np.repeat(weights, N), minlength=B * N).reshape(B, N)

    @staticmethod
    def _profile_dot(
        vecs: sp.csr_matrix, q: tuple[np.ndarray, np.ndarray, np.ndarray], cand: np.ndarray, norm: str
    ) -> np.ndarray:
        """[B, N]: each candidate's vector (its row of `vecs`) dotted with its list's history profile, the sum of
        the rows of the history items q = (list, item, weight) times their weights. norm "mean": over the
        candidate's entries (its categories); "cosine": over the profile's length (the rows are unit vectors).

        Numpy on the stored entries, not sparse products: scipy's per-call overhead cost a request of one list
        0.5 ms on the serving thread (docs/SERVING.md). Every sum adds one entry at a time in a fixed order (item,
        then column), so a list's features are the same to the bit alone or in any batch. scipy's were not (its
        sums are vectorised): on Beauty's 22,904 lists 1,807 values differed in the last bit between a list alone
        and in one batch; the two ways differ by at most 6e-16."""
        B, N = cand.shape
        ncol = vecs.shape[1]
        lists, items, weights = q
        owner, cols, vals = _row_entries(vecs, items)
        keys, at = np.unique(lists[owner] * ncol + cols, return_inverse=True)  # the profiles' entries
        prof = np.bincount(at, weights=weights[owner] * vals, minlength=len(keys))
        c_owner, c_cols, c_vals = _row_entries(vecs, np.maximum(cand, 0).ravel())  # c_owner: b * N + j
        c_keys = (c_owner // N) * ncol + c_cols
        hit = np.zeros(len(c_keys))
        if len(keys):
            j = np.minimum(np.searchsorted(keys, c_keys), len(keys) - 1)
            hit = np.where(keys[j] == c_keys, prof[j], 0.0)
        dot = _row_sums(c_vals * hit, c_owner, B * N)
        if norm == "mean":  # mean over the candidate's categories
            dot = dot / np.maximum(_row_sums(c_vals, c_owner, B * N), 1.0)
        else:  # cosine: candidate vectors are unit length already
            length = np.sqrt(_row_sums(prof * prof, keys // ncol, B))
            dot = dot / np.maximum(np.repeat(length, N), 1e-12)
        return np.where(cand.ravel() >= 0, dot, 0.0).reshape(B, N)

    # ------------------------------------------------------------------ buckets for prompts
    def fit_buckets(self, X: np.ndarray, n_buckets: int = PromptConfig.n_buckets) -> np.ndarray:
        """Edges from training features ([..., F]): bucket 0 = at the minimum (usually "no evidence"), buckets
        1..n_buckets-1 = equal-count quantile ranges of the values above it (PromptConfig.n_buckets)."""
        if n_buckets < 2:
            raise ValueError(f"n_buckets must be >= 2, got {n_buckets}")
        if X.shape[-1] != len(self.feature_names):
            raise ValueError(f"features have {X.shape[-1]} columns, evidence has {list(self.feature_names)}")
        flat = X.reshape(-1, X.shape[-1])
        edges = np.zeros((flat.shape[1], n_buckets - 1))
        inner = np.arange(1, n_buckets - 1) / (n_buckets - 1)
        for f in range(flat.shape[1]):
            x = flat[:, f]
            lo = float(x.min()) if len(x) else 0.0
            above = x[x > lo]
            qs = np.quantile(above, inner) if len(above) else np.full(len(inner), lo)
            edges[f] = [lo, *qs]
        self.bucket_edges = edges
        return edges

    def buckets(self, X: np.ndarray) -> np.ndarray:
        """Integer buckets 0..n_buckets-1 per feature (same shape as X); needs fit_buckets first."""
        if self.bucket_edges is None:
            raise RuntimeError("Evidence.buckets: call fit_buckets on training features first")
        return bucketize(X, self.bucket_edges)


def bucketize(X: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Integer buckets per feature: how many of the feature's edges ([F, n_buckets - 1]) each value of X
    ([..., F]) exceeds. The one bucketing rule, for the prompts and for a teacher that reads the same buckets."""
    return sum(
        ((X > edges[:, i]).astype(np.int64) for i in range(edges.shape[1])), np.zeros(X.shape, np.int64)
    )


def unsupplied_features(table: pd.DataFrame) -> dict[str, str]:
    """The content features (CONTENT_FEATURES) an item table cannot supply (no item has the column's values),
    with the reason: computing them would give every candidate the same value."""
    out = {}
    for feature, col in CONTENT_FEATURES.items():
        if not any(v is not None and len(v) for v in table[col]):
            out[feature] = f"no item has {col.replace('_', ' ')}"
    return out


def _row_entries(m: sp.csr_matrix, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, cols, vals): the stored entries of the CSR rows `rows` in order; owner indexes `rows`."""
    start, count = m.indptr[rows], m.indptr[rows + 1] - m.indptr[rows]
    owner = np.repeat(np.arange(len(rows)), count)
    pos = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count - start, count)
    return owner, m.indices[pos], m.data[pos]


def _row_sums(values: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    """[n]: the sums of `values` per owner, added one at a time in their order (np.bincount): the same bits
    whatever else is in the batch and wherever the arrays sit in memory (numpy's vectorised sums are neither)."""
    return np.bincount(owner, weights=values, minlength=n)


def _row_lists(m: sp.csr_matrix, ids: np.ndarray | None = None) -> list[list]:
    """Per row, neighbour ids (or counts) in descending count order (ties: id ascending)."""
    m = m.tocsr()
    out = []
    for i in range(m.shape[0]):
        a, b = m.indptr[i], m.indptr[i + 1]
        cols, vals = m.indices[a:b], m.data[a:b]
        o = np.lexsort((cols, -vals))
        out.append(ids[cols[o]].tolist() if ids is not None else vals[o].astype(np.int64).tolist())
    return out


def _from_lists(ids_col: pd.Series, counts_col: pd.Series, index: Mapping[str, int], n: int) -> sp.csr_matrix:
    rows, cols, vals = [], [], []
    for i, (ids, counts) in enumerate(zip(ids_col, counts_col, strict=True)):
        for x, c in zip(ids, counts, strict=True):
            j = index.get(x)
            if j is not None:
                rows.append(i)
                cols.append(j)
                vals.append(float(c))
    return sp.csr_matrix((vals, (rows, cols)), shape=(n, n))


def _multi_hot(lists: pd.Series) -> sp.csr_matrix:
    vocab: dict[str, int] = {}
    rows, cols = [], []
    for i, toks in enumerate(lists):
        for t in toks if toks is not None else []:
            rows.append(i)
            cols.append(vocab.setdefault(str(t), len(vocab)))
    m = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(lists), max(len(vocab), 1)))
    m.sum_duplicates()
    m.data[:] = 1.0
    return m
