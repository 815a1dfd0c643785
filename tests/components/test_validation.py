"""GX suites: the real slice passes; each corrupted input fails with a message naming its expectation."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from components._lib import sources
from components._lib.validation import Bounds, validate_tables
from tests.components.slices import SLICE_BOUNDS, examples_slice

N = 10


@pytest.fixture(scope="module")
def slice_root(tmp_path_factory):
    return tmp_path_factory.mktemp("val")


@pytest.fixture(scope="module")
def tables(slice_root):
    src, examples = examples_slice(slice_root)
    targets = pd.read_parquet(slice_root / "targets.parquet")
    targets["history"] = [list(h) for h in targets["history"]]
    return sources.read_dataset(src), targets, sources.read_table(examples)


def _run(ds, table, n=N, interactions=None):
    inter = ds.interactions if interactions is None else interactions
    return validate_tables(inter, ds.items, table, n, Bounds(**SLICE_BOUNDS))


def _failed(report) -> set[tuple[str, str]]:
    return {(f["expectation"], str(f["column"])) for s in report.suites for f in s.failures}


def _copy(ex: pd.DataFrame) -> pd.DataFrame:
    out = ex.copy()
    for col in ("history", "candidates", "retriever_scores"):
        out[col] = [list(v) for v in out[col]]
    return out


def test_clean_slice_passes(tables):
    ds, targets, ex = tables
    assert _run(ds, targets, None).passed
    rep = _run(ds, ex)
    assert rep.passed, rep.message
    assert [s.suite for s in rep.suites] == ["interactions", "items", "examples"]
    assert len(ex) >= SLICE_BOUNDS["min_examples"] and set(ex["split"]) == {"train", "val", "test"}


def test_duplicate_candidates_rejected(tables):
    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[3, "candidates"][1] = (
        bad.at[3, "candidates"][0] if bad.at[3, "label"] != 1 else bad.at[3, "candidates"][2]
    )
    rep = _run(ds, bad)
    assert not rep.passed
    assert _failed(rep) == {("expect_column_values_to_be_between", "n_distinct_candidates")}
    assert f"exactly {N} distinct candidates" in rep.message and "1 of" in rep.message


def test_label_not_among_candidates_rejected(tables):
    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[0, "label"] = (bad.at[0, "label"] + 1) % N
    rep = _run(ds, bad)
    assert _failed(rep) == {("expect_column_values_to_be_null", "label_not_target")}
    assert "label among the candidates" in rep.message and bad.at[0, "example_id"] in rep.message


def test_unknown_item_id_rejected(tables):
    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[5, "candidates"][N - 1] = "no-such-item"
    rep = _run(ds, bad)
    assert _failed(rep) == {("expect_column_values_to_be_null", "unknown_item_id")}
    assert "every id in the catalog" in rep.message and "no-such-item" in rep.message


def test_unknown_item_in_interactions_rejected(tables):
    ds, _, ex = tables
    inter = ds.interactions.copy()
    inter.loc[7, "item_id"] = "ghost"
    rep = _run(ds, ex, interactions=inter)
    assert ("expect_column_values_to_be_null", "unknown_item_id") in _failed(rep)
    assert "[interactions]" in rep.message and "ghost" in rep.message


def test_history_not_before_target_rejected(tables):
    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[2, "history"] = bad.at[2, "history"][1:] + [bad.at[2, "target"]]  # the target leaks into history
    rep = _run(ds, bad)
    assert _failed(rep) == {("expect_column_values_to_be_null", "history_not_before_target")}
    assert "history strictly before the target" in rep.message


def test_test_target_in_training_rejected(tables):
    ds, _, ex = tables
    bad = _copy(ex)
    i = bad.index[bad["split"] == "test"][0]
    bad.at[i, "split"] = "train"
    rep = _run(ds, bad)
    assert ("expect_column_values_to_be_null", "eval_target_in_train") in _failed(rep)
    assert "no test (or validation) target in training" in rep.message
    assert f"{bad.at[i, 'example_id']}: train example at position" in rep.message


def test_too_few_rows_rejected(tables):
    ds, _, ex = tables
    few = ex.groupby("split").head(2)
    assert set(few["split"]) == {"train", "val", "test"}  # every split has rows: only the count is wrong
    rep = _run(ds, few)
    assert _failed(rep) == {("expect_table_row_count_to_be_between", "table")}
    assert "row count within bounds" in rep.message and f"observed {len(few)}" in rep.message


def test_a_split_without_examples_rejected(tables):
    """Enough rows, but the retriever reached none of the validation targets: stop before training."""
    ds, _, ex = tables
    rep = _run(ds, ex[ex["split"] != "val"].reset_index(drop=True))
    assert _failed(rep) == {("expect_column_distinct_values_to_contain_set", "split")}
    assert "every split (train, val, test) has rows" in rep.message


def test_report_artifacts(tables, tmp_path):
    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[0, "label"] = (bad.at[0, "label"] + 1) % N
    rep = _run(ds, bad)
    rep.write(tmp_path / "v.json", tmp_path / "v.md")
    import json

    d = json.loads((tmp_path / "v.json").read_text())
    assert d["passed"] is False and d["suites"][-1]["failures"][0]["column"] == "label_not_target"
    assert "# Data validation: FAILED" in (tmp_path / "v.md").read_text()


def test_data_docs_render_in_chromium(tables, tmp_path):
    """Great Expectations' Data Docs of a failing examples table, as headless Chromium renders the page: every
    suite with each expectation and its result, the failing one marked failed (in red) with the bad row."""
    import html
    import re

    import numpy as np
    from PIL import Image

    from components._lib.validation import _suites
    from pipelines.browser import render

    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[0, "label"] = (bad.at[0, "label"] + 1) % N
    rep = _run(ds, bad)
    rep.write(html_path=tmp_path / "docs.html")
    dom = render(tmp_path / "docs.html", tmp_path / "docs.png", size=(1280, 9000))
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))  # what the page says
    for suite, expectations in _suites(Bounds(**SLICE_BOUNDS), N).items():
        assert f"Expectation Suite: {suite} " in text and f"Suite {suite} " in text  # overview, contents
        for e in expectations:
            assert e.description in text, e.description
    assert text.count("Status: Succeeded") == 2 and text.count("Status: Failed") == 1  # the examples suite
    # one failing expectation (its row's icon, besides the suite's), with the bad row among its unexpected values
    assert dom.count('class="fas fa-times text-danger"') == 2 and bad.at[0, "example_id"] in text
    pixels = np.asarray(Image.open(tmp_path / "docs.png").convert("RGB")).astype(int)
    red = (pixels[..., 0] > 150) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)
    assert red.sum() > 50  # the page shows it: the failed status, drawn in red


def test_validate_component_returns_passed_and_writes_artifacts(tables, slice_root, tmp_path):
    """The KFP component body (python_func) with local artifacts: False on a corrupted examples table."""
    from kfp import dsl

    from components.validate import validate

    ds, _, ex = tables
    bad = _copy(ex)
    bad.at[1, "label"] = (bad.at[1, "label"] + 1) % N
    bad.to_parquet(tmp_path / "bad.parquet", index=False)

    def art(cls, name):
        return cls(name=name, uri=str(tmp_path / name))

    kwargs = dict(
        sources=dsl.Dataset(name="sources", uri=str(slice_root / "sources")),
        profile="smoke",  # leave-one-out, as the fixture built the targets
        stage="examples",
        bounds_json=json.dumps(SLICE_BOUNDS),
    )
    ok = validate.python_func(
        table=dsl.Dataset(name="t", uri=str(slice_root / "examples.parquet")),
        results=art(dsl.Artifact, "r1"),
        summary=art(dsl.Markdown, "s1"),
        data_docs=art(dsl.HTML, "d1"),
        metrics=art(dsl.Metrics, "m1"),
        **kwargs,
    )
    assert ok is True
    ok = validate.python_func(
        table=dsl.Dataset(name="t", uri=str(tmp_path / "bad.parquet")),
        results=art(dsl.Artifact, "r2"),
        summary=art(dsl.Markdown, "s2"),
        data_docs=art(dsl.HTML, "d2"),
        metrics=art(dsl.Metrics, "m2"),
        **kwargs,
    )
    assert ok is False
    assert "label_not_target" in (tmp_path / "s2").read_text()
    failed = 'class="fas fa-times text-danger"'  # Data Docs' failed-status icon
    assert failed in (tmp_path / "d2").read_text() and failed not in (tmp_path / "d1").read_text()
    assert json.loads((tmp_path / "r2" / "validation.json").read_text())["passed"] is False
