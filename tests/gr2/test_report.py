"""Report writing: json + markdown, latest symlink, machine info."""

from __future__ import annotations

import json

import pandas as pd

from gr2.data.dataset import Dataset
from gr2.data.profile import dataset_profile
from gr2.generative import Answer
from gr2.prompt import render_trace
from gr2.report import floor_row, git_sha, machine_info, render_markdown, write_report
from gr2.stages.evaluate import trace_summary


def _examples():
    return pd.DataFrame(
        {"user_id": ["a", "b", "c", "d"], "candidates": [["x", "y", "z"]] * 4, "label": [0, 1, 0, 2]}
    )


def test_write_report_and_latest(tmp_path):
    ex = _examples()
    floor = floor_row(ex, n_boot=50)
    assert floor["model"] == "floor" and floor["recall@1"] == 0.5
    report = {
        "dataset": "toy",
        "profile": "quick",
        "git_sha": git_sha(),
        "machine": machine_info(),
        "rows": [floor, {**floor, "model": "ltr", "recall@1": 0.75}],
        "gate": {"passed": False, "reasons": ["speedup 1.2 < 2.4"]},
        "retriever": {"name": "cooc", "hit_rate": 0.07, "n_test_examples": 4},
    }
    runs = tmp_path / "runs"
    write_report(runs / "r1", report, link_latest=True)
    (runs / "r2").mkdir(parents=True)
    (runs / "r2" / "pr.png").write_bytes(b"png")
    write_report(runs / "r2", report, link_latest=True)
    back = json.loads((runs / "r2" / "report.json").read_text())
    assert back["rows"][1]["recall@1"] == 0.75 and back["retriever"]["hit_rate"] == 0.07
    md = (runs / "r2" / "report.md").read_text()
    assert "| floor |" in md and "| ltr |" in md and "0.750" in md
    assert "Gate: FAILED" in md and "speedup 1.2 < 2.4" in md and "hit rate 0.0700" in md
    assert "![pr](pr.png)" in md
    assert (runs / "latest").is_symlink() and (runs / "latest").resolve() == (runs / "r2").resolve()
    # A step's output folder: the same files, git sha and machine filled in, and no `latest` beside it.
    step = tmp_path / "step"
    write_report(step / "out", {"dataset": "toy", "rows": [floor]})
    back = json.loads((step / "out" / "report.json").read_text())
    assert back["git_sha"] == git_sha() and back["machine"]["cores"] >= 1
    assert (step / "out" / "report.md").exists() and not (step / "latest").exists()


def test_machine_info_and_sha():
    info = machine_info()
    assert info["cores"] >= 1 and info["cpu"] and "torch" in info and "gpu" in info
    sha = git_sha()
    assert sha == "unknown" or len(sha.split("-")[0]) == 40


def test_markdown_without_optional_parts():
    md = render_markdown({"dataset": "d", "rows": []})
    assert md.startswith("# Report: d") and "Gate" not in md and "Dataset profile" not in md


def test_markdown_has_the_dataset_profile():
    inter = pd.DataFrame(
        {"user_id": ["u", "u"], "item_id": ["a", "b"], "timestamp": float("nan"), "seq_idx": [0, 1]}
    )
    items = pd.DataFrame({"item_id": ["a", "b"], "title": "", "categories": [[], []]})
    prof = dataset_profile(Dataset("d", inter, items))
    md = render_markdown({"dataset": "d", "rows": [], "dataset_profile": prof})
    assert "## Dataset profile" in md and "lacks: titles, categories, timestamps" in md
    assert "evidence features dropped" not in md
    dropped = {"category_overlap": "no item has categories", "title_sim": "no item has title tokens"}
    md = render_markdown(
        {"dataset": "d", "rows": [], "dataset_profile": prof, "evidence": {"dropped_features": dropped}}
    )
    assert (
        "- evidence features dropped: category_overlap (no item has categories); "
        "title_sim (no item has title tokens)" in md
    )


def test_trace_summary_scores_the_trace_and_whether_the_answer_follows_it():
    answers = [
        Answer([1, 0, 2], True, None, render_trace([0, 2, 1])),  # follows its trace, whose top is the label
        Answer([2, 0, 1], True, None, render_trace([1, 1, 0])),  # ignores its trace; trace top (tie: A) wrong
        Answer([0, 1, 2], False, "duplicate label", render_trace([2, 0, 0])),  # invalid: does not follow
        Answer([0, 1, 2], True, None, None),  # no trace (e.g. ar_no_trace): left out
    ]
    t = trace_summary(answers, labels=[1, 1, 0, 0], sizes=[3] * 4)
    assert t == {"lists": 3, "recall@1": 2 / 3, "answer_follows": 0.5}
    assert trace_summary([a for a in answers if a.trace is None], [0], [3]) is None
    md = render_markdown(
        {"dataset": "d", "rows": [{"model": "ar", "tau": None, "recall@1": 0.5, "trace": t}]}
    )
    assert "## Traces" in md and "| ar | — | 3 | 0.667 | 0.500 | 0.500 |" in md
