"""Semantic IDs: title embeddings, collaborative factors, RQ codes, uniqueness, de-dup level, save/load."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gr2.config import SIDConfig
from gr2.data import data_root, load_dataset, train_sequences
from gr2.sid import (
    SemanticIds,
    build_semantic_ids,
    code_stats,
    collab_factors,
    derive_codebook_size,
    residual_kmeans,
    sid_token,
    text_embeddings,
)


def test_sid_token_names():
    assert [sid_token(lv, 7) for lv in range(4)] == ["<a_7>", "<b_7>", "<c_7>", "<d_7>"]


def test_text_embeddings_are_semantic():
    e = text_embeddings(["Toy Story (1995)", "Toy Story 2 (1999)", "Red nail polish"], batch_size=2)
    assert e.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2


def test_derive_codebook_size():
    cfg = SIDConfig()
    assert derive_codebook_size(12101, cfg) == 256  # Beauty: TIGER's 3 x 256
    assert derive_codebook_size(1682, cfg) == 128
    assert derive_codebook_size(100, cfg) == 32
    assert derive_codebook_size(5, cfg) == 16
    assert derive_codebook_size(5, SIDConfig(codebook_size=8)) == 8


def test_collab_factors_follow_cooccurrence():
    # Two groups of items that co-occur only inside their group; item "z" never appears in training.
    seqs = [
        ["a", "b", "c", "d"],
        ["d", "c", "b", "a"],
        ["b", "d", "a", "c"],
        ["e", "f", "g", "h"],
        ["h", "g", "f", "e"],
    ]
    index = {x: i for i, x in enumerate("abcdefghz")}
    f = collab_factors(seqs, index, dim=2, window=3)
    assert f.shape == (9, 2)
    assert np.allclose(f[8], 0.0)  # no training co-occurrence: no collaborative vector
    assert f[0] @ f[1] > 0.9 and abs(f[0] @ f[4]) < 0.2


def test_residual_kmeans_prefix_sharing_and_unique_last_level():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(8, 16)) * 5
    blob = np.repeat(np.arange(8), 60)
    x = (centers[blob] + rng.normal(size=(480, 16))).astype(np.float32)
    plain, _ = residual_kmeans(x, [8, 8, 8], iters=15, seed=0, unique_last_level=False)
    codes, diag = residual_kmeans(x, [8, 8, 8], iters=15, seed=0, unique_last_level=True)
    assert codes.shape == (480, 3) and codes.min() >= 0 and codes.max() < 8
    # Level 1 recovers the blobs: items of one blob share their first code.
    purity = np.mean([np.bincount(codes[blob == b, 0]).max() / 60 for b in range(8)])
    assert purity > 0.95
    st_plain, st = code_stats(plain, [8] * 3), code_stats(codes, [8] * 3)
    assert diag["plain_rq_unique_prefix_frac"] == pytest.approx(st_plain["unique_prefix_frac"])
    assert st["unique_prefix_frac"] > st_plain["unique_prefix_frac"]
    # 480 items into 8 x 8 x 8 = 512 cells: groups of <= 8 items sharing 2 codes become fully distinct.
    groups = pd.Series(list(map(tuple, codes[:, :2].tolist()))).value_counts()
    n_separable = groups[groups <= 8].sum()
    assert len(set(map(tuple, codes.tolist()))) >= n_separable
    assert 0 < diag["last_level_moved_frac"] < 1


def test_dedup_level_separates_identical_items(tmp_path):
    # 40 items, two identical category patterns, no titles and no interactions: only 2 distinct embeddings.
    items = pd.DataFrame(
        {"item_id": [f"i{k}" for k in range(40)], "title": [""] * 40, "categories": [["x"], ["y", "z"]] * 20}
    )
    sids = build_semantic_ids(
        "toy", items, [], SIDConfig(codebook_size=4, kmeans_iters=5), cache_dir=tmp_path
    )
    codes = list(sids.codes.values())
    assert len(set(codes)) == 40  # the 4th level makes every ID unique
    # 20 identical items per pattern > K = 4: the last RQ level cannot separate them, the de-dup level does.
    assert sids.codebook_sizes[3] >= 5 and max(c[3] for c in codes) == sids.codebook_sizes[3] - 1
    assert sids.stats["unique_full_frac"] == 1.0


def test_items_without_any_signal_spread_over_the_codebooks(tmp_path):
    """A catalog with no titles and no categories whose items mostly never appear in training (a real catalog
    next to a small interaction log): those items embed to zero. They must not share one RQ prefix, or the
    de-dup level grows to one code per cold item."""
    items = pd.DataFrame({"item_id": [f"i{k:02d}" for k in range(60)], "title": "", "categories": [[]] * 60})
    seqs = {f"u{u}": [f"i{(u + k) % 10:02d}" for k in range(6)] for u in range(10)}  # items i00..i09 only
    sids = build_semantic_ids("cold", items, seqs, SIDConfig(kmeans_iters=5), cache_dir=tmp_path)
    assert sids.stats["items_without_signal"] == 50
    assert sids.stats["unique_full_frac"] == 1.0
    assert sids.codebook_sizes[3] <= 3  # was 50: every cold item in one prefix
    assert len({c[:3] for c in sids.codes.values()}) >= 50
    again = build_semantic_ids("cold", items, seqs, SIDConfig(kmeans_iters=5), cache_dir=tmp_path)
    assert again.codes == sids.codes  # the random directions are seeded


@pytest.fixture(scope="module")
def ml_slice():
    ds = load_dataset(data_root() / "ml-latest-small")
    # 20 light users (<= 30 ratings each) keep the catalog small (~350 items) so the title model runs fast.
    size = ds.interactions.groupby("user_id", sort=False).size()
    users = size[size <= 30].index[:20]
    inter = ds.interactions[ds.interactions["user_id"].isin(users)]
    items = ds.items[ds.items["item_id"].isin(inter["item_id"])].reset_index(drop=True)
    ds.interactions, ds.items = inter, items
    return ds


def test_build_on_real_slice_unique_and_round_trip(ml_slice, tmp_path):
    ds = ml_slice
    cfg = SIDConfig(kmeans_iters=10)
    sids = build_semantic_ids("ml-slice", ds.items, train_sequences(ds), cfg, cache_dir=tmp_path)
    n = len(ds.items)
    assert set(sids.codes) == set(ds.items["item_id"]) and n > 200
    k = derive_codebook_size(n, cfg)
    assert all(len(c) == 4 and max(c[:3]) < k for c in sids.codes.values())
    assert sids.stats["unique_prefix_frac"] >= 0.99  # DESIGN: >= 99% unique before the de-dup level
    assert sids.stats["unique_full_frac"] == 1.0
    assert sids.stats["plain_rq_unique_prefix_frac"] <= sids.stats["unique_prefix_frac"]
    assert min(sids.stats["codebook_usage"]) > 0.5
    assert len(list((tmp_path / "sid").glob("ml-slice-minilm-*.npy"))) == 1  # title embeddings cached
    path = sids.save(tmp_path / "sids.json")
    back = SemanticIds.load(path)
    assert back.codes == sids.codes and back.codebook_sizes == sids.codebook_sizes
    assert back.tokens(ds.items["item_id"][0]) == sids.tokens(ds.items["item_id"][0])
    # Same seed, same cache: identical codes.
    again = build_semantic_ids("ml-slice", ds.items, train_sequences(ds), cfg, cache_dir=tmp_path)
    assert again.codes == sids.codes
