"""Load and validate a dataset in the uniform TSV format (../shared/data/README.md).

interactions.tsv: user_id, item_id, seq_idx (required), timestamp, rating (optional), one row per event,
seq_idx 0-based, contiguous and increasing down each user's rows. items.tsv (optional): item_id (required),
title, categories (`|`-joined); every item_id of interactions.tsv must be in it. Everything is read as text
first so ids keep their exact spelling ("007" stays "007"), then checked; any problem raises `DatasetError`
naming the file, the 1-based line number, the column and the problem. What is optional may be missing or
empty everywhere (no titles, no categories, no timestamps): gr2.data.profile says what a dataset lacks.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

INTERACTION_COLUMNS = ["user_id", "item_id", "timestamp", "seq_idx"]
ITEM_COLUMNS = ["item_id", "title", "categories"]


class DatasetError(ValueError):
    """Malformed dataset input; the message names file, line and problem."""


@dataclass
class Dataset:
    name: str
    interactions: pd.DataFrame  # user_id:str, item_id:str, timestamp:float64 (NaN), seq_idx:int64 [, rating]
    items: pd.DataFrame  # item_id:str, title:str, categories:list[str]

    @property
    def n_users(self) -> int:
        return int(self.interactions["user_id"].nunique())

    @property
    def n_items(self) -> int:
        return len(self.items)


def _fail(path: Path, line: int | None, problem: str, column: str | None = None) -> DatasetError:
    where = f"{path}" if line is None else f"{path}, line {line}"
    if column is not None:
        where += f", column {column!r}"
    return DatasetError(f"{where}: {problem}")


def _read_tsv(path: Path, required: list[str]) -> pd.DataFrame:
    """Read a TSV as strings; blank lines are kept (as empty rows) so line numbers stay exact."""
    try:
        df = pd.read_csv(
            path,
            sep="\t",
            dtype=str,
            keep_default_na=False,
            na_filter=False,
            quoting=csv.QUOTE_NONE,  # titles contain quotes; the format has no quoting
            skip_blank_lines=False,
            engine="c",
        )
    except pd.errors.EmptyDataError:
        raise _fail(path, None, "empty file (no header)") from None
    except pd.errors.ParserError as e:
        raise _fail(path, None, f"cannot parse TSV ({e})") from None
    except UnicodeDecodeError as e:
        raise _fail(path, None, f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    df.columns = [str(c).strip() for c in df.columns]
    for col in required:
        if col not in df.columns:
            raise _fail(path, 1, f"missing required column (header has {list(df.columns)})", col)
    if len(df) == 0:
        raise _fail(path, None, "empty file (header but no rows)")
    # Short rows are padded by pandas with NaN even with na_filter off; treat as empty strings.
    return df.fillna("")


def _line(i: int) -> int:
    return int(i) + 2  # row 0 is on line 2 (line 1 is the header)


def _check_ids(df: pd.DataFrame, col: str, path: Path) -> None:
    ids = df[col].str.strip()
    bad = np.flatnonzero((ids == "").to_numpy() | df[col].str.contains(r"[\s|]", regex=True).to_numpy())
    if len(bad):
        i = bad[0]
        raise _fail(
            path,
            _line(i),
            f"empty or bad {col} {df[col].iat[i]!r} (ids must be non-empty, no whitespace)",
            col,
        )


def _read_items(path: Path) -> pd.DataFrame:
    raw = _read_tsv(path, ["item_id"])
    _check_ids(raw, "item_id", path)
    dup = np.flatnonzero(raw["item_id"].duplicated().to_numpy())
    if len(dup):
        raise _fail(path, _line(dup[0]), f"duplicated item_id {raw['item_id'].iat[dup[0]]!r}", "item_id")
    title = raw["title"].str.strip() if "title" in raw else pd.Series("", index=raw.index)
    if "categories" in raw:
        categories = [[c for c in s.split("|") if c.strip()] for s in raw["categories"]]
    else:
        categories = [[] for _ in range(len(raw))]
    return pd.DataFrame({"item_id": raw["item_id"], "title": title, "categories": categories})


def _to_float(col: pd.Series, path: Path, name: str) -> np.ndarray:
    num = pd.to_numeric(col.mask(col == ""), errors="coerce").to_numpy(np.float64)  # "" = unknown
    bad = np.flatnonzero(np.isnan(num) & (col != "").to_numpy())
    if len(bad):
        raise _fail(path, _line(bad[0]), f"{name} {col.iat[bad[0]]!r} is not a number", name)
    return num


def _read_interactions(path: Path) -> pd.DataFrame:
    raw = _read_tsv(path, ["user_id", "item_id", "seq_idx"])
    for col in ("user_id", "item_id"):
        _check_ids(raw, col, path)
    seq = pd.to_numeric(raw["seq_idx"].str.strip(), errors="coerce")
    bad = np.flatnonzero((seq.isna() | (seq != seq.round()) | (seq < 0)).to_numpy())
    if len(bad):
        raise _fail(
            path,
            _line(bad[0]),
            f"seq_idx {raw['seq_idx'].iat[bad[0]]!r} is not a non-negative integer",
            "seq_idx",
        )
    out = pd.DataFrame(
        {
            "user_id": raw["user_id"],
            "item_id": raw["item_id"],
            "timestamp": _to_float(raw["timestamp"], path, "timestamp")
            if "timestamp" in raw
            else np.full(len(raw), np.nan),
            "seq_idx": seq.to_numpy().astype(np.int64),
        }
    )
    if "rating" in raw:
        out["rating"] = _to_float(raw["rating"], path, "rating")
    dup = np.flatnonzero(out.duplicated(["user_id", "seq_idx"]).to_numpy())
    if len(dup):
        i = dup[0]
        raise _fail(
            path,
            _line(i),
            f"duplicated row: user {out['user_id'].iat[i]!r} seq_idx {out['seq_idx'].iat[i]} appears twice",
            "seq_idx",
        )
    # Rows follow each user's order (the format's promise): a seq_idx that goes down within a user means
    # the file was shuffled or two exports were mixed, and its order cannot be trusted.
    prev = out.groupby("user_id", sort=False)["seq_idx"].shift(1).to_numpy()
    down = np.flatnonzero(out["seq_idx"].to_numpy() < prev)  # NaN (a user's first row) compares False
    if len(down):
        i = down[0]
        raise _fail(
            path,
            _line(i),
            f"seq_idx {out['seq_idx'].iat[i]} of user {out['user_id'].iat[i]!r} comes after "
            f"seq_idx {int(prev[i])} (rows of a user must be in increasing seq_idx)",
            "seq_idx",
        )
    out["_line"] = np.arange(len(out)) + 2
    out = out.sort_values(["user_id", "seq_idx"], kind="stable").reset_index(drop=True)
    # Split is by position, so seq_idx must be exactly 0..n-1 per user (no gaps).
    expected = out.groupby("user_id", sort=False).cumcount().to_numpy()
    gap = np.flatnonzero(out["seq_idx"].to_numpy() != expected)
    if len(gap):
        i = gap[0]
        raise _fail(
            path,
            int(out["_line"].iat[i]),
            f"seq_idx {out['seq_idx'].iat[i]} of user {out['user_id'].iat[i]!r} breaks 0..n-1 (expected {expected[i]})",
            "seq_idx",
        )
    return out


def load_dataset(path: str | os.PathLike, name: str | None = None) -> Dataset:
    """Read `<path>/interactions.tsv` (+ `items.tsv` if present) into a validated `Dataset`."""
    root = Path(path)
    inter_path = root / "interactions.tsv"
    if not inter_path.exists():
        raise DatasetError(f"{inter_path}: file not found")
    inter = _read_interactions(inter_path)
    items_path = root / "items.tsv"
    if items_path.exists():
        items = _read_items(items_path)
        unknown = ~inter["item_id"].isin(items["item_id"])
        if unknown.any():
            i = int(np.flatnonzero(unknown.to_numpy())[0])
            raise _fail(
                inter_path,
                int(inter["_line"].iat[i]),
                f"item_id {inter['item_id'].iat[i]!r} is not in {items_path.name} ({int(unknown.sum())} rows affected)",
                "item_id",
            )
    else:
        ids = sorted(inter["item_id"].unique())
        items = pd.DataFrame({"item_id": ids, "title": "", "categories": [[] for _ in ids]})
    items = items.sort_values("item_id", kind="stable").reset_index(drop=True)
    inter = inter.drop(columns="_line")
    return Dataset(name=name or root.name, interactions=inter, items=items)


def data_root() -> Path:
    """../shared/data next to the repository (override with env GR2_DATA_ROOT)."""
    env = os.environ.get("GR2_DATA_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def resolve_dataset(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike = ".cache") -> Path:
    """`ml-100k` -> fetched into the cache; a folder name under the data root; or any existing path."""
    s = str(name_or_path)
    if s == "ml-100k":
        from gr2.data.movielens import fetch_ml100k

        return fetch_ml100k(cache_dir)
    shared = data_root() / s
    if "/" not in s and shared.is_dir():
        return shared
    p = Path(s)
    if p.exists():
        return p
    known = sorted(d.name for d in data_root().iterdir() if d.is_dir()) if data_root().is_dir() else []
    raise FileNotFoundError(
        f"dataset {s!r} not found: not 'ml-100k', not under {data_root()} ({known}), not a path"
    )
