"""Great Expectations 1.x suites for interactions, items, targets and re-ranking examples.

Checks over list columns (candidates, history) are computed in pandas into "problem" columns: None for a good
row, a short description of what is wrong for a bad one (e.g. "42:17 label 3 -> '88' but target '90'"), then
asserted with `expect_column_values_to_be_null`. GX's partial_unexpected_list therefore shows readable
examples of bad rows, and the message names the expectation, its column and its description.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from gr2.data.split import split_labels

SPLITS = ["train", "val", "test"]


@dataclass(frozen=True)
class Bounds:
    """Row-count bounds: a truncated or exploded input fails validation instead of training on it."""

    min_interactions: int = 1_000
    max_interactions: int = 100_000_000
    min_items: int = 20
    min_targets: int = 100
    min_examples: int = 50  # retrieval-hit examples over all splits
    max_rows: int = 100_000_000


@dataclass
class SuiteResult:
    suite: str
    success: bool
    n_rows: int
    evaluated: int
    failures: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ValidationReport:
    passed: bool
    suites: list[SuiteResult]
    # GX's own validation results, one per suite: what Data Docs render (`data_docs_html`); not serialized
    gx_results: list[Any] = field(default_factory=list, repr=False)

    @property
    def message(self) -> str:
        lines = []
        for s in self.suites:
            for f in s.failures:
                lines.append(
                    f"[{s.suite}] {f['expectation']}({f['column']}) failed: {f['description']}; "
                    f"{f['detail']}, e.g. {f['examples']}"
                )
        return "\n".join(lines) if lines else "all expectations passed"

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "message": self.message, "suites": [asdict(s) for s in self.suites]}

    def to_markdown(self) -> str:
        out = [
            f"# Data validation: {'PASSED' if self.passed else 'FAILED'}",
            "",
            "| suite | rows | expectations | failed |",
            "|---|---|---|---|",
        ]
        for s in self.suites:
            out.append(f"| {s.suite} | {s.n_rows} | {s.evaluated} | {len(s.failures)} |")
        if not self.passed:
            out += ["", "## Failing expectations", ""]
            out += [f"- {line}" for line in self.message.splitlines()]
        return "\n".join(out) + "\n"

    def write(
        self,
        json_path: str | Path | None = None,
        md_path: str | Path | None = None,
        html_path: str | Path | None = None,
    ) -> None:
        if json_path:
            Path(json_path).write_text(json.dumps(self.to_dict(), indent=2, default=str))
        if md_path:
            Path(md_path).write_text(self.to_markdown())
        if html_path:
            Path(html_path).write_text(data_docs_html(self.gx_results, f"Data validation: {self.head}"))

    @property
    def head(self) -> str:
        return f"{'PASSED' if self.passed else 'FAILED'} ({', '.join(s.suite for s in self.suites)})"


# Data Docs' status icons are Font Awesome glyphs loaded from a CDN. Where it cannot be reached (an air-gapped
# cluster, a sandboxed viewer) the icon is empty, so each one also says its status in words.
_OFFLINE_STATUS = """<style>
i.fas.fa-times.text-danger::after { content: " failed"; color: #c00; font: bold 1rem sans-serif; }
i.fas.fa-check-circle.text-success::after { content: " passed"; color: #080; font: 1rem sans-serif; }
</style>
"""


def data_docs_html(results: list[Any], title: str) -> str:
    """Great Expectations' Data Docs page (its ValidationResultsPageRenderer and Jinja view, the page a Data
    Docs site shows) for several suites' results as one self-contained HTML page: each suite's overview, then
    its expectations by column with their observed values and unexpected examples."""
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    docs = [ValidationResultsPageRenderer().render(r) for r in results]
    for doc, res in zip(docs, results, strict=True):
        for section in doc.sections:  # the table of contents lists every suite's sections
            name = section.section_name
            section.section_name = (
                f"Suite {res.suite_name}" if name == "Overview" else f"{res.suite_name}.{name}"
            )
    page = docs[0]
    page.sections = [section for doc in docs for section in doc.sections]
    page.page_title = title
    return DefaultJinjaPageView().render(page).replace("</head>", _OFFLINE_STATUS + "</head>", 1)


# ---------------------------------------------------------------------------------------------- derived columns
def _unknown_ids(lists: list, catalog: set[str]) -> list[str | None]:
    """First id of each list that is not in the catalog (None when all are known)."""
    out: list[str | None] = []
    for ids in lists:
        bad = next((i for i in ids if i not in catalog), None)
        out.append(bad)
    return out


def interaction_frame(interactions: pd.DataFrame, catalog: set[str]) -> pd.DataFrame:
    df = interactions[["user_id", "item_id", "seq_idx"]].copy()
    df["unknown_item_id"] = [None if i in catalog else i for i in df["item_id"]]
    if "event_ts" in interactions:
        ts = pd.to_datetime(interactions["event_ts"], utc=True)
        prev = ts.groupby(interactions["user_id"], sort=False).shift(1)
        bad = (ts <= prev).to_numpy()
        df["event_ts_not_increasing"] = [
            f"user {u} seq_idx {s}: {t} <= previous {p}" if b else None
            for u, s, t, p, b in zip(df["user_id"], df["seq_idx"], ts, prev, bad, strict=True)
        ]
    return df


def _history_before_target(ex: pd.DataFrame, interactions: pd.DataFrame) -> list[str | None]:
    """Problem per example when a history item was not consumed by the user before the target position."""
    hist = (
        ex[["example_id", "user_id", "target_pos", "history"]].explode("history").dropna(subset=["history"])
    )
    first_pos = (
        interactions.groupby(["user_id", "item_id"], sort=False)["seq_idx"]
        .min()
        .rename("item_pos")
        .reset_index()
    )
    hist = hist.merge(first_pos, left_on=["user_id", "history"], right_on=["user_id", "item_id"], how="left")
    bad = hist[~(hist["item_pos"] < hist["target_pos"])]  # NaN (never consumed) is bad too
    msg = bad.groupby("example_id", sort=False).first()
    problems = {
        e: f"{e}: history item {r.history!r} at position "
        f"{'never' if pd.isna(r.item_pos) else int(r.item_pos)} >= target_pos {r.target_pos}"
        for e, r in msg.iterrows()
    }
    return [problems.get(e) for e in ex["example_id"]]


def example_frame(
    ex: pd.DataFrame,
    interactions: pd.DataFrame,
    catalog: set[str],
    n_candidates: int | None,
    eval_positions: int = 1,
) -> pd.DataFrame:
    """Scalar view of a targets / examples table (list columns replaced by derived checks)."""
    df = ex[["example_id", "user_id", "split", "target_pos", "target"]].copy()
    df["history_len"] = [len(h) for h in ex["history"]]
    ids = [[t, *h] for t, h in zip(ex["target"], ex["history"], strict=True)]
    if n_candidates is not None:
        ids = [[*i, *c] for i, c in zip(ids, ex["candidates"], strict=True)]
    df["unknown_item_id"] = _unknown_ids(ids, catalog)
    df["history_not_before_target"] = _history_before_target(ex, interactions)
    # Split by position: a train target sits strictly before the user's validation positions.
    n_user = interactions.groupby("user_id", sort=False)["seq_idx"].size()
    n = ex["user_id"].map(n_user).to_numpy()
    pos = ex["target_pos"].to_numpy()
    expected = split_labels(pos, n, eval_positions)
    df["eval_target_in_train"] = [
        f"{e}: train example at position {p} of {m} (a {x} target)" if s == "train" and x != "train" else None
        for e, s, p, m, x in zip(ex["example_id"], ex["split"], pos, n, expected, strict=True)
    ]
    df["split_not_by_position"] = [
        f"{e}: split {s!r} at position {p} of {m}" if s != x else None
        for e, s, p, m, x in zip(ex["example_id"], ex["split"], pos, n, expected, strict=True)
    ]
    if n_candidates is not None:
        df["n_candidates"] = [len(c) for c in ex["candidates"]]
        df["n_distinct_candidates"] = [len(set(c)) for c in ex["candidates"]]
        df["n_retriever_scores"] = [len(s) for s in ex["retriever_scores"]]
        df["label"] = ex["label"].astype("int64")
        df["label_not_target"] = [
            None
            if 0 <= lab < len(c) and c[lab] == t
            else f"{e}: label {lab} -> {c[lab] if 0 <= lab < len(c) else 'out of range'!r} but target {t!r}"
            for e, lab, c, t in zip(
                ex["example_id"], ex["label"], ex["candidates"], ex["target"], strict=True
            )
        ]
    return df


# ---------------------------------------------------------------------------------------------- suites
def _suites(bounds: Bounds, n_candidates: int | None) -> dict[str, list]:
    import great_expectations.expectations as gxe

    def null(col: str, why: str):
        return gxe.ExpectColumnValuesToBeNull(column=col, description=why)

    interactions = [
        gxe.ExpectTableRowCountToBeBetween(
            min_value=bounds.min_interactions,
            max_value=bounds.max_interactions,
            description="row count within bounds",
        ),
        gxe.ExpectColumnValuesToNotBeNull(column="user_id", description="every interaction has a user"),
        gxe.ExpectColumnValuesToNotBeNull(column="item_id", description="every interaction has an item"),
        gxe.ExpectCompoundColumnsToBeUnique(
            column_list=["user_id", "seq_idx"], description="one event per position"
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="seq_idx", min_value=0, description="positions are non-negative"
        ),
        null("unknown_item_id", "every id in the catalog"),
        null("event_ts_not_increasing", "event times strictly increase per user (Feast point-in-time order)"),
    ]
    items = [
        gxe.ExpectTableRowCountToBeBetween(
            min_value=bounds.min_items, max_value=bounds.max_rows, description="row count within bounds"
        ),
        gxe.ExpectColumnValuesToNotBeNull(column="item_id", description="every item has an id"),
        gxe.ExpectColumnValuesToBeUnique(column="item_id", description="item ids are unique"),
    ]
    min_rows = bounds.min_targets if n_candidates is None else bounds.min_examples
    examples = [
        gxe.ExpectTableRowCountToBeBetween(
            min_value=min_rows, max_value=bounds.max_rows, description="row count within bounds"
        ),
        gxe.ExpectColumnValuesToBeUnique(
            column="example_id", description="one row per (user, target position)"
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="split", value_set=SPLITS, description="split is train/val/test"
        ),
        # Sparse data can pass the row count with one split empty (a few users, none of whose validation or
        # test items the retriever reached): training, model selection and the test each need examples.
        gxe.ExpectColumnDistinctValuesToContainSet(
            column="split", value_set=SPLITS, description="every split (train, val, test) has rows"
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="history_len", min_value=1, description="history is not empty"
        ),
        null("unknown_item_id", "every id in the catalog"),
        null("history_not_before_target", "history strictly before the target"),
        null("eval_target_in_train", "no test (or validation) target in training"),
        null("split_not_by_position", "split by position (last k test, k before them val)"),
    ]
    if n_candidates is not None:
        n = n_candidates
        examples += [
            gxe.ExpectColumnValuesToBeBetween(
                column="n_candidates", min_value=n, max_value=n, description=f"exactly {n} candidates"
            ),
            gxe.ExpectColumnValuesToBeBetween(
                column="n_distinct_candidates",
                min_value=n,
                max_value=n,
                description=f"exactly {n} distinct candidates",
            ),
            gxe.ExpectColumnValuesToBeBetween(
                column="n_retriever_scores",
                min_value=n,
                max_value=n,
                description="one retriever score per candidate",
            ),
            null("label_not_target", "label among the candidates (candidates[label] == target)"),
        ]
    return {"interactions": interactions, "items": items, "examples": examples}


def _run_suite(ctx, name: str, expectations: list, df: pd.DataFrame) -> tuple[SuiteResult, Any]:
    import great_expectations as gx

    bd = (
        ctx.data_sources.add_pandas(f"{name}_src")
        .add_dataframe_asset(name)
        .add_batch_definition_whole_dataframe("all")
    )
    suite = ctx.suites.add(gx.ExpectationSuite(name=name))
    for e in expectations:
        suite.add_expectation(e)
    vd = ctx.validation_definitions.add(gx.ValidationDefinition(name=f"{name}_vd", data=bd, suite=suite))
    res = vd.run(
        batch_parameters={"dataframe": df},
        result_format={"result_format": "SUMMARY", "partial_unexpected_count": 5},
    )
    failures = []
    for r in res.results:
        if r.success:
            continue
        cfg = r.expectation_config
        kw = {k: v for k, v in cfg.kwargs.items() if k != "batch_id"}
        col = kw.get("column") or kw.get("column_list") or "table"
        out = r.result or {}
        if "unexpected_count" in out:
            detail = f"{out['unexpected_count']} of {out.get('element_count', len(df))} rows unexpected"
            examples: list[Any] = [
                v if isinstance(v, str) else str(v) for v in out.get("partial_unexpected_list", [])[:5]
            ]
        else:
            detail = f"observed {out.get('observed_value')!r}, expected {kw}"
            examples = [out.get("observed_value")]
        if r.exception_info and r.exception_info.get("raised_exception"):
            detail = f"raised {r.exception_info.get('exception_message')}"
        failures.append(
            {
                "expectation": cfg.type,
                "column": col,
                "description": cfg.description or "",
                "detail": detail,
                "examples": examples,
                "kwargs": kw,
            }
        )
    return SuiteResult(name, bool(res.success), len(df), len(res.results), failures), res


def validate_tables(
    interactions: pd.DataFrame | None = None,
    items: pd.DataFrame | None = None,
    examples: pd.DataFrame | None = None,
    n_candidates: int | None = None,
    bounds: Bounds = Bounds(),
    eval_positions: int = 1,
) -> ValidationReport:
    """Run the suites for the given tables (examples need interactions and items for their checks).

    `n_candidates=None` validates a targets table (before candidate lists exist); an int validates a
    re-ranking examples table and adds the candidate-list expectations.
    """
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    suites = _suites(bounds, n_candidates)
    catalog = set(items["item_id"]) if items is not None else set()
    results = []
    if interactions is not None:
        results.append(
            _run_suite(ctx, "interactions", suites["interactions"], interaction_frame(interactions, catalog))
        )
    if items is not None:
        results.append(_run_suite(ctx, "items", suites["items"], items[["item_id"]]))
    if examples is not None:
        assert interactions is not None and items is not None, "example checks need interactions and items"
        name = "examples" if n_candidates is not None else "targets"
        frame = example_frame(examples, interactions, catalog, n_candidates, eval_positions)
        results.append(_run_suite(ctx, name, suites["examples"], frame))
    return ValidationReport(
        all(r.success for r, _ in results), [r for r, _ in results], [g for _, g in results]
    )
