"""Data loading, validation errors, dataset resolution and the MovieLens-100K fetch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gr2.data import DatasetError, data_root, fetch_ml100k, load_dataset, resolve_dataset
from gr2.data.movielens import convert_ml100k

REPO = Path(__file__).resolve().parents[2]
SMALL = data_root() / "ml-latest-small"


def _write(tmp: Path, inter: str, items: str | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "interactions.tsv").write_text(inter)
    if items is not None:
        (tmp / "items.tsv").write_text(items)
    return tmp


ITEMS = "item_id\ttitle\tcategories\na\tA title\tx|y\nb\t\t\nc\tC\tz\n"


def test_load_ml_latest_small_matches_stats():
    ds = load_dataset(SMALL)
    stats = json.loads((SMALL / "stats.json").read_text())
    inter = ds.interactions
    assert ds.name == "ml-latest-small"
    assert len(inter) == 100_836 and ds.n_users == 610 and ds.n_items == 9_742
    assert inter.dtypes["timestamp"] == np.float64 and inter.dtypes["seq_idx"] == np.int64
    assert inter["user_id"].map(type).eq(str).all() and inter["item_id"].map(type).eq(str).all()
    assert len(inter) == stats["interactions"]
    # sorted by user then seq_idx, seq_idx contiguous per user
    assert (inter.groupby("user_id", sort=False).cumcount().to_numpy() == inter["seq_idx"].to_numpy()).all()
    assert inter["user_id"].is_monotonic_increasing
    toy = ds.items.set_index("item_id").loc["1"]
    assert toy["title"] == "Toy Story (1995)"
    assert toy["categories"] == ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]


def test_optional_columns_and_missing_items_file(tmp_path):
    d = _write(tmp_path / "d", "user_id\titem_id\tseq_idx\nu1\ta\t0\nu1\tb\t1\nu0\tb\t0\n")
    ds = load_dataset(d)
    assert ds.interactions["timestamp"].isna().all()
    assert ds.interactions["user_id"].tolist() == ["u0", "u1", "u1"]
    assert ds.items["item_id"].tolist() == ["a", "b"]
    assert ds.items["title"].tolist() == ["", ""] and ds.items["categories"].tolist() == [[], []]
    d2 = _write(tmp_path / "d2", "user_id\titem_id\ttimestamp\tseq_idx\nu\ta\t\t0\nu\tb\t5\t1\n", ITEMS)
    ds2 = load_dataset(d2)
    assert np.isnan(ds2.interactions["timestamp"].iat[0]) and ds2.interactions["timestamp"].iat[1] == 5.0
    items = ds2.items.set_index("item_id")
    assert items.loc["a", "categories"] == ["x", "y"] and items.loc["b", "title"] == ""
    assert items.loc["b", "categories"] == []


def test_ids_keep_their_spelling(tmp_path):
    d = _write(tmp_path, "user_id\titem_id\tseq_idx\n007\t0012\t0\n007\t12\t1\n")
    ds = load_dataset(d)
    assert ds.interactions["user_id"].tolist() == ["007", "007"]
    assert ds.interactions["item_id"].tolist() == ["0012", "12"]


@pytest.mark.parametrize(
    "inter, items, where, problem",
    [
        ("", None, "interactions.tsv", "empty file"),
        ("user_id\titem_id\tseq_idx\n", None, "interactions.tsv", "no rows"),
        ("user_id\tseq_idx\nu\t0\n", None, "interactions.tsv, line 1, column 'item_id'", "missing required"),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\n\tb\t1\n",
            None,
            "interactions.tsv, line 3, column 'user_id'",
            "empty or bad user_id",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\nu\tb\tx\n",
            None,
            "interactions.tsv, line 3, column 'seq_idx'",
            "not a non-negative integer",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\nu\tb\t1.5\n",
            None,
            "interactions.tsv, line 3, column 'seq_idx'",
            "not a non-negative integer",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\nu\tb\t0\n",
            None,
            "interactions.tsv, line 3, column 'seq_idx'",
            "duplicated row: user 'u' seq_idx 0",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\nu\tb\t2\n",
            None,
            "interactions.tsv, line 3, column 'seq_idx'",
            "breaks 0..n-1",
        ),
        (  # non-monotone: user u's rows go 1, 0 (another user in between does not hide it)
            "user_id\titem_id\tseq_idx\nu\ta\t1\nv\ta\t0\nu\tb\t0\n",
            None,
            "interactions.tsv, line 4, column 'seq_idx'",
            "seq_idx 0 of user 'u' comes after seq_idx 1",
        ),
        (  # latin-1 bytes in a title
            "user_id\titem_id\tseq_idx\nu\ta\t0\n",
            "item_id\ttitle\na\tCaf\xe9\n",
            "items.tsv",
            "not UTF-8 text",
        ),
        (
            "user_id\titem_id\ttimestamp\tseq_idx\nu\ta\tnow\t0\n",
            None,
            "interactions.tsv, line 2, column 'timestamp'",
            "not a number",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\nu\tq\t1\n",
            ITEMS,
            "interactions.tsv, line 3, column 'item_id'",
            "'q' is not in items.tsv",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\n",
            "title\nA\n",
            "items.tsv, line 1, column 'item_id'",
            "missing required column",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\n",
            "item_id\na\na\n",
            "items.tsv, line 3, column 'item_id'",
            "duplicated item_id 'a'",
        ),
        (
            "user_id\titem_id\tseq_idx\nu\ta\t0\n",
            "item_id\na\n\n",
            "items.tsv, line 3, column 'item_id'",
            "empty or bad item_id",
        ),
        ("user_id\titem_id\tseq_idx\nu\ta\t0\n", "", "items.tsv", "empty file"),
    ],
)
def test_malformed_input_names_file_line_and_problem(tmp_path, inter, items, where, problem):
    d = _write(tmp_path, inter, None)
    if items is not None:  # bytes: the latin-1 case must reach the reader undecoded
        (d / "items.tsv").write_bytes(items.encode("latin-1"))
    with pytest.raises(DatasetError) as e:
        load_dataset(d)
    assert where in str(e.value) and problem in str(e.value), str(e.value)


def test_missing_interactions_file(tmp_path):
    with pytest.raises(DatasetError, match="interactions.tsv: file not found"):
        load_dataset(tmp_path)


def test_resolve_dataset(tmp_path, monkeypatch):
    assert resolve_dataset("ml-latest-small") == SMALL
    assert resolve_dataset(str(SMALL)) == SMALL
    (tmp_path / "mine").mkdir()
    monkeypatch.setenv("GR2_DATA_ROOT", str(tmp_path))
    assert resolve_dataset("mine") == tmp_path / "mine"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_dataset("nope")


def test_convert_ml100k_orders_by_time_then_row():
    inter = pd.DataFrame(
        {
            "user_id": ["2", "10", "2", "2"],
            "item_id": ["5", "6", "7", "8"],
            "rating": ["3", "4", "5", "1"],
            "timestamp": ["30", "10", "20", "20"],
        }
    )
    item = pd.DataFrame(
        {
            "item_id": ["5", "6", "7", "8"],
            "movie_title": ["Five", "Six", "Seven", "Eight"],
            "release_year": ["1995", "", "1990", "1991"],
            "class": ["Drama Sci-Fi", "Comedy", "", "Children's"],
        }
    )
    out, items = convert_ml100k(inter, item)
    assert out["user_id"].tolist() == ["2", "2", "2", "10"]  # numeric user order
    assert out["item_id"].tolist() == ["7", "8", "5", "6"]  # 20 (row 2), 20 (row 3), 30
    assert out["seq_idx"].tolist() == [0, 1, 2, 0]
    assert items["title"].tolist() == ["Five (1995)", "Six", "Seven (1990)", "Eight (1991)"]
    assert items["categories"].tolist() == ["Drama|Sci-Fi", "Comedy", "", "Children's"]


def test_fetch_ml100k_real_and_idempotent():
    path = fetch_ml100k(REPO / ".cache")
    assert path.name == "ml-100k"
    ds = load_dataset(path)
    assert len(ds.interactions) == 100_000 and ds.n_users == 943 and ds.n_items == 1_682
    ts = ds.interactions.groupby("user_id")["timestamp"].apply(lambda s: s.is_monotonic_increasing)
    assert ts.all()
    assert "rating" in ds.interactions
    items = ds.items.set_index("item_id")
    assert items.loc["1", "title"] == "Toy Story (1995)"
    assert items.loc["1", "categories"] == ["Animation", "Children's", "Comedy"]
    mtime = (path / "interactions.tsv").stat().st_mtime_ns
    assert fetch_ml100k(REPO / ".cache") == path
    assert (path / "interactions.tsv").stat().st_mtime_ns == mtime  # cached, not rewritten
    assert resolve_dataset("ml-100k", REPO / ".cache") == path
