"""`gr2 validate --dataset`: exit 0 on a good dataset folder, non-zero on corrupted ones. The training commands
run the step their KFP component runs (trainjob.run_step -> model_steps.<step>) with the same arguments."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
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


EX = "ex.parquet"
TRAINING_COMMANDS = [
    (
        ["train-ar", "--sft-data", "sft", "--out", "ar_nt", "--variant", "ar_no_trace"],
        "train_ar",
        {"sft_dir": "sft", "out_dir": "ar_nt", "profile": "quick", "variant": "ar_no_trace"},
    ),
    (
        [
            "rl",
            "--model",
            "ar_sft",
            "--sft-data",
            "sft",
            "--examples",
            EX,
            "--out",
            "ar",
            "--profile",
            "bench",
        ],
        "rl",
        {"model_dir": "ar_sft", "sft_dir": "sft", "examples_path": EX, "out_dir": "ar", "profile": "bench"},
    ),
    (
        ["convert-cft", "--ar-model", "ar", "--sft-data", "sft", "--naive-out", "naive", "--out", "cft"],
        "convert_cft",
        {"ar_dir": "ar", "sft_dir": "sft", "naive_dir": "naive", "cft_dir": "cft", "profile": "quick"},
    ),
    (
        [
            "distill",
            "--student",
            "cft",
            "--teacher",
            "ar",
            "--sft-data",
            "sft",
            "--examples",
            EX,
            "--out",
            "opd",
        ],
        "distill",
        {
            "student_dir": "cft",
            "teacher_dir": "ar",
            "sft_dir": "sft",
            "examples_path": EX,
            "out_dir": "opd",
            "profile": "quick",
        },
    ),
]


@pytest.mark.parametrize("argv, step, kwargs", TRAINING_COMMANDS, ids=[c[1] for c in TRAINING_COMMANDS])
def test_training_commands_run_the_components_step(monkeypatch, argv, step, kwargs):
    from components._lib import model_steps

    calls = []
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # inline, as `make run` runs the step
    monkeypatch.setattr(model_steps, step, lambda **kw: calls.append(kw) or {"steps": 3})
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert calls == [kwargs]
    assert json.loads(res.output) == {"steps": 3}  # the step's training summary, printed


def test_train_ar_rejects_an_unknown_variant(monkeypatch):
    from components._lib import model_steps

    monkeypatch.setattr(model_steps, "train_ar", lambda **kw: pytest.fail("ran with a bad variant"))
    res = CliRunner().invoke(app, ["train-ar", "--sft-data", "s", "--out", "o", "--variant", "nope"])
    assert res.exit_code == 2 and "trace | ar_no_trace" in res.output


def test_deploy_dry_run_renders_the_plan_and_uploads_the_gated_model(tmp_path):
    from components.artifact_store import open_store
    from gr2.gate import run_gate
    from gr2.inference import FloorReranker

    model = FloorReranker(name="floor", n_candidates=10).save(tmp_path / "model")
    rows = [
        {"model": "floor", "recall@1": 0.3, "validity": 1.0},
        {"model": "rl", "recall@1": 0.31, "validity": 1.0},
    ]
    (tmp_path / "report.json").write_text(json.dumps({"rows": rows}))
    assert run_gate(tmp_path / "report.json", tmp_path / "decision", "rl", True, "quick", None)["passed"]
    argv = [
        "deploy",
        "--model",
        str(model),
        "--decision",
        str(tmp_path / "decision"),
        "--out",
        str(tmp_path / "plan"),
    ]
    argv += ["--run-id", "r1", "--overlay", "manifests/overlays/dev", "--canary-percent", "30"]
    res = CliRunner().invoke(app, [*argv, "--local-root", str(tmp_path / "store")], env={"GR2_S3_BUCKET": ""})
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["outcome"] == "dry-run"
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert (plan["outcome"], plan["canary_percent"], plan["stage"]) == ("dry-run", 30, "rl")
    store = open_store(local_root=tmp_path / "store")
    assert store.manifest("r1", "rl").metadata == {"model": "rl", "run_id": "r1", "recall@1": 0.31}


@pytest.mark.parametrize("outcome, code", [("promoted", 0), ("rolled-back", 1)])
def test_canary_analysis_runs_the_components_step_and_exits_by_outcome(monkeypatch, outcome, code):
    from components._lib import rollout_steps

    calls = []

    def analysis(*args):
        calls.append(args)
        return {"outcome": outcome, "steps": [{"canary_percent": 10, "failures": []}]}

    monkeypatch.setattr(rollout_steps, "canary_analysis", analysis)
    argv = ["canary-analysis", "--plan", "p", "--examples", EX, "--out", "a", "--profile", "bench"]
    res = CliRunner().invoke(app, [*argv, "--local-root", "s"], env={"GR2_S3_BUCKET": ""})
    assert res.exit_code == code, res.output
    assert res.output.splitlines() == ["10%: passed", outcome]
    (args,) = calls
    assert [str(a) for a in args[:4]] == ["p", EX, "a", "bench"]
    assert args[-1] == {"bucket": "", "prefix": None, "endpoint_url": "", "local_root": "s"}
