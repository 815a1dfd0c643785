"""First-stage retriever (pre-ranker): item-item co-occurrence votes from the user's recent history.

Fitted on training data only (each user's positions 0..n-3). C[a, b] counts pairs of positions of one user's
training sequence that are at most `window` apart (symmetric). A history votes for candidate c with
score(c) = sum_k decay^k * C[h_k, c] over its `recent` newest items h_0 (newest), h_1, ... Items the user
already consumed are excluded; when fewer than N items score > 0 the list is filled by training popularity
(score 0). Ties are broken by popularity, then item id, so the list is deterministic (among items with
votes the tie-break uses the full training popularity; in the fill an own target counts one less).

A training example's own target interaction is inside C and the popularity counts; `own_target` subtracts
it (docs/CONTRACTS.md, Candidates: otherwise training lists are easier than test lists). The pairs it contributes to C[h, t]
are those with the history items at most `window` positions before it, so the correction is computable
from the history alone. Pairs with the same user's *later* training items are not subtracted (the
retriever does not see the future of a request), which only matters for repeat consumption.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import scipy.sparse as sp

from gr2.config import RetrieverConfig

_ROUND = 9  # scores are rounded so equal vote sums tie exactly whatever the summation order


def index_sequences(seqs: Sequence[Sequence[str]], index: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Flatten sequences to (row, item_idx) arrays in order; unknown items get -1."""
    lens = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    flat = np.fromiter((index.get(x, -1) for s in seqs for x in s), np.int64, int(lens.sum()))
    return np.repeat(np.arange(len(seqs)), lens), flat


def steps_back(rows: np.ndarray, n_rows: int) -> np.ndarray:
    """For flattened sequences: 0 for the newest (last) element of each row, 1 for the one before, ..."""
    ends = np.cumsum(np.bincount(rows, minlength=n_rows))
    return ends[rows] - 1 - np.arange(len(rows)) if len(rows) else np.zeros(0, np.int64)


def cooccurrence_counts(
    seqs: Sequence[Sequence[str]], index: Mapping[str, int], window: int, directed: bool = False
) -> sp.csr_matrix:
    """Pairs of positions at most `window` apart inside each sequence -> sparse [I, I] counts.

    directed=False counts both (a, b) and (b, a) (co-occurrence); directed=True counts only earlier -> later.
    """
    rows, flat = index_sequences(seqs, index)
    src, dst = [], []
    for d in range(1, window + 1):
        same = (rows[d:] == rows[:-d]) & (flat[d:] >= 0) & (flat[:-d] >= 0)
        a, b = flat[:-d][same], flat[d:][same]
        src += [a] if directed else [a, b]
        dst += [b] if directed else [b, a]
    n = len(index)
    src_a = np.concatenate(src) if src else np.zeros(0, np.int64)
    dst_a = np.concatenate(dst) if dst else np.zeros(0, np.int64)
    m = sp.coo_matrix((np.ones(len(src_a), np.float64), (src_a, dst_a)), shape=(n, n)).tocsr()
    m.sum_duplicates()
    return m


def _member(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    if not len(sorted_keys):
        return np.zeros(len(keys), bool)
    j = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[j] == keys


class CoocRetriever:
    name = "cooc"

    def __init__(self, config: RetrieverConfig | None = None):
        self.config = config or RetrieverConfig()

    def fit(self, train_seqs: Mapping[str, Sequence[str]], item_ids: Sequence[str]) -> CoocRetriever:
        """Fit on user -> training items (positions 0..n-3); `item_ids` is the catalog to retrieve from."""
        ids = np.asarray(sorted(set(item_ids)), dtype=object)
        pos = {x: i for i, x in enumerate(ids)}
        _, flat = index_sequences(list(train_seqs.values()), pos)
        pop = np.bincount(flat[flat >= 0], minlength=len(ids)).astype(np.int64)
        # Internal index = tie-break order (popularity desc, then id asc): a stable sort by score then
        # returns ties in that order.
        order = np.lexsort((np.arange(len(ids)), -pop))
        self.items = ids[order]
        self.index = {x: i for i, x in enumerate(self.items)}
        self.pop = pop[order]
        self.C = cooccurrence_counts(list(train_seqs.values()), self.index, self.config.window)
        self.train_seqs = dict(train_seqs)
        # First training position of each (user, item): "consumed before position p" lookups.
        self._user_index = {u: i for i, u in enumerate(self.train_seqs)}
        urows, uflat = index_sequences(list(self.train_seqs.values()), self.index)
        first_pos = np.arange(len(urows)) - np.searchsorted(urows, urows)
        keys = urows * len(self.items) + uflat
        self._first_keys, first = np.unique(keys[uflat >= 0], return_index=True)
        self._first_pos = first_pos[uflat >= 0][first]
        return self

    # ------------------------------------------------------------------ scoring
    def _query(self, histories: Sequence[Sequence[str]]) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
        """Sparse [B, I] vote weights of the `recent` newest known items, plus the slot arrays."""
        rows, flat = index_sequences(histories, self.index)
        back = steps_back(rows, len(histories))
        keep = (back < self.config.recent) & (flat >= 0)
        w = self.config.decay ** back[keep].astype(np.float64)
        q = sp.csr_matrix((w, (rows[keep], flat[keep])), shape=(len(histories), len(self.items)))
        q.sum_duplicates()
        return q, rows, flat

    def _own_correction(self, histories, own_targets, rows, flat) -> np.ndarray:
        """Per example: sum_k decay^k * #(positions within `window` before the target holding h_k)."""
        cfg, out = self.config, np.zeros(len(histories))
        back = steps_back(rows, len(histories))
        n_items = len(self.items)
        near = (back < cfg.window) & (flat >= 0)
        near_keys, near_cnt = np.unique(rows[near] * n_items + flat[near], return_counts=True)
        tgt = np.array([self.index.get(t, -1) if t is not None else -1 for t in own_targets])
        slot = (back < cfg.recent) & (flat >= 0) & (tgt[rows] >= 0) & (flat != tgt[rows])
        keys = rows[slot] * n_items + flat[slot]
        if len(near_keys) == 0:
            return out
        j = np.minimum(np.searchsorted(near_keys, keys), len(near_keys) - 1)
        cnt = np.where(near_keys[j] == keys, near_cnt[j], 0)
        np.add.at(out, rows[slot], cfg.decay ** back[slot].astype(np.float64) * cnt)
        return out

    def topn_batch(
        self,
        histories: Sequence[Sequence[str]],
        n: int,
        own_targets: Sequence[str | None] | None = None,
        excludes: Sequence[Sequence[str]] | None = None,
        users: Sequence[str] | None = None,
        positions: Sequence[int] | None = None,
        chunk: int = 20_000,
    ) -> tuple[list[list[str]], list[np.ndarray]]:
        """Top-n (items, scores) per history, best first.

        Excluded: `excludes` (default: the history itself) and, when `users` and `positions` (target seq_idx)
        are given, every item of the user's training sequence before that position. The latter is looked
        up per scored item instead of materialising long consumed-item lists (quadratic for long users).
        Works on the sparse vote matrix (a history reaches a few hundred items, the catalog ~10^4): sort the
        votes of each row by (score desc, popularity order), then fill short rows by popularity.
        """
        B, n_items = len(histories), len(self.items)
        own = list(own_targets) if own_targets is not None else [None] * B
        q, rows, flat = self._query(histories)
        corr = self._own_correction(histories, own, rows, flat)
        tgt = np.array([self.index.get(t, -1) if t is not None else -1 for t in own], dtype=np.int64)
        ex_rows, ex_flat = index_sequences(excludes if excludes is not None else histories, self.index)
        ok = ex_flat >= 0
        ctx = {"ex_keys": np.unique(ex_rows[ok] * n_items + ex_flat[ok])}
        if users is not None and positions is not None:
            ctx["user"] = np.array([self._user_index.get(u, -1) for u in users], dtype=np.int64)
            ctx["pos"] = np.asarray(positions, dtype=np.int64)
        out_items: list[list[str]] = []
        out_scores: list[np.ndarray] = []
        for lo in range(0, B, chunk):
            hi = min(B, lo + chunk)
            s = (q[lo:hi] @ self.C).tocsr()
            s.sum_duplicates()
            s.sort_indices()
            r = np.repeat(np.arange(lo, hi), np.diff(s.indptr))
            c, v = s.indices.astype(np.int64), np.round(s.data, _ROUND)
            keys = r * n_items + c  # sorted: csr rows in order, column indices sorted
            # Own-target correction on the target's entry (if it got votes at all).
            has = np.flatnonzero(tgt[lo:hi] >= 0) + lo
            if len(keys) and len(has):
                tk = has * n_items + tgt[has]
                j = np.minimum(np.searchsorted(keys, tk), len(keys) - 1)
                hit = keys[j] == tk
                v[j[hit]] = np.round(v[j[hit]] - corr[has[hit]], _ROUND)
            keep = v > 0
            keep[keep] = ~self._excluded(r[keep], c[keep], ctx)
            r, c, v = r[keep], c[keep], v[keep]
            o = np.lexsort((-v, r))  # stable: equal scores stay in column (= popularity) order
            r, c, v = r[o], c[o], v[o]
            bounds = np.searchsorted(r, np.arange(lo, hi + 1))
            for i in range(hi - lo):
                a, b = bounds[i], bounds[i + 1]
                idx, sc = c[a : min(b, a + n)], v[a : min(b, a + n)]
                if len(idx) < n:
                    row = lo + i
                    fill = self._fill(row, set(c[a:b].tolist()), n - len(idx), int(tgt[row]), ctx)
                    idx = np.concatenate([idx, fill])
                    sc = np.concatenate([sc, np.zeros(len(fill))])
                out_items.append(self.items[idx].tolist())
                out_scores.append(sc)
        return out_items, out_scores

    def _excluded(self, rows: np.ndarray, cols: np.ndarray, ctx: dict) -> np.ndarray:
        """Is item `cols[i]` already consumed for example `rows[i]`?"""
        n_items = len(self.items)
        out = _member(ctx["ex_keys"], rows * n_items + cols)
        if "user" in ctx and len(self._first_keys):
            u = ctx["user"][rows]
            k = u * n_items + cols
            j = np.minimum(np.searchsorted(self._first_keys, k), len(self._first_keys) - 1)
            found = (self._first_keys[j] == k) & (u >= 0)
            out |= found & (self._first_pos[j] < ctx["pos"][rows])
        return out

    def _fill(self, row: int, scored: set[int], k: int, target: int, ctx: dict) -> np.ndarray:
        """First k eligible items in popularity order. An own target without votes is placed where its
        popularity minus its own interaction puts it (pop desc, then id)."""
        t = target
        if t >= 0 and (t in scored or self._excluded(np.array([row]), np.array([t]), ctx)[0]):
            t = -1
        eligible: list[int] = []
        start, block = 0, max(64, 4 * k)
        while len(eligible) < k and start < len(self.items):
            cols = np.arange(start, min(len(self.items), start + block))
            cols = cols[~self._excluded(np.full(len(cols), row), cols, ctx)]
            eligible += [x for x in cols.tolist() if x not in scored and x != t]
            start, block = start + block, block * 2
        el = np.asarray(eligible[:k], dtype=np.int64)
        if t < 0:
            return el
        p = int(self.pop[t]) - 1
        n_gt = int(np.searchsorted(-self.pop, -p, side="left"))  # items with pop > p, the target included
        n_eq = int(np.searchsorted(-self.pop, -p, side="right"))
        ahead = n_gt - 1 + int(np.searchsorted(self.items[n_gt:n_eq].astype(str), str(self.items[t])))
        col_wo_t = np.where(el > t, el - 1, el)  # positions in the order without the target
        cut = int(np.searchsorted(col_wo_t, ahead))
        return np.concatenate([el[:cut], [t], el[cut:]])[:k].astype(np.int64)

    def topn(
        self,
        history: Sequence[str],
        n: int,
        own_target: str | None = None,
        exclude: Sequence[str] | None = None,
    ) -> tuple[list[str], np.ndarray]:
        """Top-n (items, scores) for one history (oldest -> newest); excludes `exclude` or the history."""
        items, scores = self.topn_batch(
            [history], n, [own_target], [exclude if exclude is not None else history]
        )
        return items[0], scores[0]

    def known_history(self, user_id: str, target_pos: int, history: Sequence[str]) -> list[str]:
        """Everything the user consumed before `target_pos`: training items before it plus the history."""
        return list(self.train_seqs.get(user_id, [])[:target_pos]) + list(history)
