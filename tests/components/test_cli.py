"""`gr2 validate --dataset`: exit 0 on a good dataset folder, non-zero on corrupted ones."""

from __future__ import annotations

import shutil

import pandas as pd
from typer.testing import CliRunner

from pipelines.cli import app
from tests.components.slices import SLICE_USERS, require_slice


def _slice(tmp_path, n_users=SLICE_USERS):
    src = require_slice()
    inter = pd.read_csv(src / "interactions.tsv", sep="\t", dtype=str)
    users = sorted(inter["user_id"].unique())[:n_users]
    inter[inter["user_id"].isin(users)].to_csv(tmp_path / "interactions.tsv", sep="\t", index=False)
    shutil.copy(src / "items.tsv", tmp_path / "items.tsv")
    return tmp_path


def test_validate_good_dataset_exits_zero(tmp_path):
    res = CliRunner().invoke(
        app, ["validate", "--dataset", str(_slice(tmp_path)), "--out", str(tmp_path / "v")]
    )
    assert res.exit_code == 0, res.output
    assert "PASSED" in res.output and (tmp_path / "v" / "validation.json").exists()


def test_validate_too_small_dataset_exits_nonzero(tmp_path):
    res = CliRunner().invoke(app, ["validate", "--dataset", str(_slice(tmp_path, 2))])
    assert res.exit_code == 1
    assert "expect_table_row_count_to_be_between" in res.output


def test_validate_malformed_dataset_exits_nonzero(tmp_path):
    d = _slice(tmp_path)
    inter = pd.read_csv(d / "interactions.tsv", sep="\t", dtype=str)
    inter.loc[10, "item_id"] = "no-such-item"
    inter.to_csv(d / "interactions.tsv", sep="\t", index=False)
    res = CliRunner().invoke(app, ["validate", "--dataset", str(d)])
    assert res.exit_code == 1
    assert "no-such-item" in res.output
