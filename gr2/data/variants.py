"""Degraded copies of the shared datasets: the shapes real catalogs have and Beauty / MovieLens do not.

    python -m gr2.data.variants stripped --out .cache/datasets/amazon_beauty_stripped
    make bench DATASET=.cache/datasets/amazon_beauty_stripped

Each variant is a source folder under the data root plus a list of transforms over its TSV tables (read as
text, so ids keep their exact spelling). Every transform is deterministic (fixed seed, stable orders), so
a variant is the same files on every machine. The output is a folder in the uniform format
(../shared/data/README.md) with a `stats.json` naming its source and transforms.

| variant | source | what it lacks or adds |
|---|---|---|
| `no_text` | amazon_beauty | titles and categories emptied |
| `no_timestamps` | amazon_beauty | timestamps emptied (order from seq_idx only) |
| `stripped` | amazon_beauty | titles and timestamps emptied (categories kept): the bench recipe |
| `repeats` | amazon_beauty | earlier items consumed again (about one row in six is a repeat) |
| `long` | ml-latest-small | its 3 users with >= 2,000 interactions, 3 users cut to 2, 3 and 4 items, 40 as they are |
| `all_shapes` | amazon_beauty + `long` | all of the above at once: repeats, no titles, categories or timestamps, text and numeric ids |
"""

from __future__ import annotations

import argparse
import csv
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from gr2.data.dataset import data_root
from gr2.files import publish_folder

SEED = 0
REPEAT_SHARE = 0.2  # `repeats`: probability that an interaction is followed by a re-consumption
LONG_MIN = 2000  # `long`: users with at least this many interactions are kept whole
SHORT_LENGTHS = (2, 3, 4)  # `long`: users cut to these lengths (2 = only a test target, 4 = one train target)
ORDINARY_USERS = 40  # `long`: then users as they are, whose validation and test items the retriever reaches


@dataclass
class Tables:
    interactions: pd.DataFrame  # text columns, at least user_id, item_id, timestamp, seq_idx
    items: pd.DataFrame  # text columns, at least item_id, title, categories


def read_tables(folder: str | Path) -> Tables:
    """The TSV files of a uniform-format folder, every column as text (missing values as "")."""

    def read(name: str) -> pd.DataFrame:
        return pd.read_csv(
            Path(folder) / name, sep="\t", dtype=str, keep_default_na=False, quoting=csv.QUOTE_NONE
        )

    return Tables(read("interactions.tsv"), read("items.tsv"))


def strip_titles(t: Tables) -> Tables:
    return Tables(t.interactions, t.items.assign(title=""))


def strip_categories(t: Tables) -> Tables:
    return Tables(t.interactions, t.items.assign(categories=""))


def strip_timestamps(t: Tables) -> Tables:
    return Tables(t.interactions.assign(timestamp=""), t.items)


def inject_repeats(t: Tables, share: float = REPEAT_SHARE, seed: int = SEED) -> Tables:
    """After each interaction, with probability `share`, the user consumes again one of its earlier items
    (uniformly, the one just consumed included: both repeat purchases and immediate re-plays). The repeat
    takes its predecessor's timestamp; seq_idx is renumbered 0..n-1."""
    rng = np.random.default_rng(seed)
    inter = t.interactions
    users = inter["user_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    rows: list[int] = []  # row of `inter` each output row copies
    for s, e in zip(starts, ends, strict=True):
        for r in range(s, e):
            rows.append(r)
            if rng.random() < share:
                rows.append(int(rng.integers(s, r + 1)))
    out = inter.iloc[rows].reset_index(drop=True)
    # A repeat copies an older row but sits after row r: it takes r's time, the newest original row so far.
    out["timestamp"] = inter["timestamp"].to_numpy()[np.maximum.accumulate(rows)]
    out["seq_idx"] = out.groupby("user_id", sort=False).cumcount().astype(str)
    return Tables(out, t.items)


def long_histories(
    t: Tables, min_len: int = LONG_MIN, short: tuple[int, ...] = SHORT_LENGTHS, ordinary: int = ORDINARY_USERS
) -> Tables:
    """The users with >= `min_len` interactions; of the rest (by id), the first cut to the `short` lengths
    (their first items), then `ordinary` users as they are. The longest histories beside users at the minimum
    length; the ordinary users make sure the retriever reaches some validation and test items."""
    inter = t.interactions
    n = inter.groupby("user_id", sort=False)["user_id"].transform("size")
    long_users = set(inter.loc[n >= min_len, "user_id"])
    rest = sorted(set(inter["user_id"]) - long_users)
    keep_len = dict(zip(rest, short, strict=False))
    keep_len |= {u: np.inf for u in rest[len(short) : len(short) + ordinary]} | {
        u: np.inf for u in long_users
    }
    pos = inter["seq_idx"].astype(int)
    keep = pos < inter["user_id"].map(keep_len).fillna(0)
    return Tables(inter[keep].reset_index(drop=True), t.items)


@dataclass(frozen=True)
class Variant:
    source: str  # folder under the data root
    transforms: tuple[Callable[[Tables], Tables], ...]
    about: str
    # Other variants whose tables (each built whole, with its own source and transforms) are appended to this
    # one's slice before its transforms run: one catalog with several sources' users and items.
    also: tuple[str, ...] = ()


VARIANTS = {
    "no_text": Variant(
        "amazon_beauty", (strip_titles, strip_categories), "Beauty without titles and categories"
    ),
    "no_timestamps": Variant("amazon_beauty", (strip_timestamps,), "Beauty without timestamps"),
    "stripped": Variant(
        "amazon_beauty", (strip_titles, strip_timestamps), "Beauty without titles and timestamps"
    ),
    "repeats": Variant("amazon_beauty", (inject_repeats,), "Beauty with repeat consumption injected"),
    "long": Variant(
        "ml-latest-small",
        (long_histories,),
        f"ml-latest-small: users with >= {LONG_MIN} interactions, users cut to {SHORT_LENGTHS} items and "
        f"{ORDINARY_USERS} users as they are",
    ),
    # Every shape above in one catalog, for the one DAG run `make test` can afford: Beauty's users (text ids)
    # and `long`'s (numeric ids, the longest histories and users at the minimum length), repeats injected
    # everywhere, and no titles, no categories, no timestamps.
    "all_shapes": Variant(
        "amazon_beauty",
        (inject_repeats, strip_titles, strip_categories, strip_timestamps),
        "Beauty plus `long`'s MovieLens users: repeats, no titles, no categories, no timestamps, text and "
        "numeric ids, histories from 2 to thousands of items",
        also=("long",),
    ),
}


def first_users(t: Tables, max_users: int) -> Tables:
    """The first `max_users` users in id order (the ingest slice's order); all of them when <= 0."""
    if max_users <= 0:
        return t
    inter = t.interactions
    users = sorted(inter["user_id"].unique())[:max_users]
    return Tables(inter[inter["user_id"].isin(users)].reset_index(drop=True), t.items)


def variant_tables(name: str, source_root: Path, max_users: int = 0) -> Tables:
    """Variant `name`'s tables: its source's first `max_users` users (all when <= 0), the `also` variants'
    tables appended (whole), then its transforms."""
    v = VARIANTS[name]
    tables = first_users(read_tables(source_root / v.source), max_users)
    cols = ["item_id", "title", "categories"]
    for other in v.also:
        extra = variant_tables(other, source_root)
        tables = Tables(
            pd.concat([tables.interactions, extra.interactions], ignore_index=True, join="inner"),
            pd.concat([tables.items[cols], extra.items[cols]], ignore_index=True),
        )
    for f in v.transforms:
        tables = f(tables)
    return Tables(tables.interactions, tables.items[cols])


def build_variant(
    name: str, out: str | Path, source_root: str | Path | None = None, max_users: int = 0
) -> Path:
    """Write variant `name` (VARIANTS) as a uniform-format folder `out`; returns `out`. `max_users` > 0 keeps
    the source's first users (id order) before the transforms: a tiny slice for tests."""
    if name not in VARIANTS:
        raise KeyError(f"unknown variant {name!r}: one of {sorted(VARIANTS)}")
    v = VARIANTS[name]
    tables = variant_tables(name, Path(source_root or data_root()), max_users)
    items = tables.items
    # Written to a temp folder then renamed: a crash never leaves a half-written dataset behind.
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kw = {"sep": "\t", "index": False, "quoting": csv.QUOTE_NONE}
    tables.interactions.to_csv(tmp / "interactions.tsv", **kw)
    items.to_csv(tmp / "items.tsv", **kw)
    stats = {
        "variant": name,
        "about": v.about,
        "source": v.source,
        "transforms": [f.__name__ for f in v.transforms],
        "also": list(v.also),
        "users": int(tables.interactions["user_id"].nunique()),
        "items": len(items),
        "interactions": len(tables.interactions),
    }
    return publish_folder(tmp, out, stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("--out", required=True, help="folder to write (replaced if it exists)")
    ap.add_argument("--source-root", default=None, help="where the source folders are (default: data root)")
    ap.add_argument("--max-users", type=int, default=0, help="keep the source's first N users (0 = all)")
    a = ap.parse_args(argv)
    print(build_variant(a.variant, a.out, a.source_root, a.max_users))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
