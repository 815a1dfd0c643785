"""kfp.local smoke runs of the whole DAG on a small real slice (SubprocessRunner, use_venv=False).

The full run uses the `all_shapes` variant (gr2/data/variants.py: Beauty's first 300 users and ml-latest-small's
longest and shortest histories in one catalog, repeats injected, no titles, categories or timestamps), every
degraded shape a real catalog has at once, so one DAG run covers every stage, serving, the degraded-data paths
and the dataset profile (tests/pipelines/test_variants_dag.py runs each variant on its own with
GR2_ALL_VARIANTS=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.compare_models import main as compare_models
from analysis.feature_rankers import main as feature_rankers
from analysis.pad_vs_group import main as pad_vs_group
from analysis.rounds_check import main as rounds_check
from analysis.speed_check import find_bundles
from analysis.stream_check import main as stream_check
from analysis.stream_rate import main as stream_rate
from gr2.data import data_root
from gr2.data.variants import VARIANTS, build_variant
from pipelines.run_local import run_local, run_profile
from tests.components.slices import SLICE_BOUNDS, SLICE_USERS, malformed_slice, require_slice
from tests.pipelines.test_variants_dag import check_variant_report

pytestmark = pytest.mark.slow


def test_local_run_writes_report(tmp_path):
    """Every stage of the DAG, on the `all_shapes` variant (Beauty's first 300 users and ml-latest-small's
    extremes, repeats, no titles, categories or timestamps), with the smoke profile (tiny model, a few steps
    per stage)."""
    v = VARIANTS["all_shapes"]
    if not all(
        (data_root() / VARIANTS[x].source / "interactions.tsv").exists() for x in ("all_shapes", *v.also)
    ):
        pytest.skip("shared data not available")
    data = build_variant("all_shapes", tmp_path / "data", max_users=300)
    # Profile overrides (--set seed=1), as the second-seed bench runs it: every step and the tools below read them.
    # The sequence feature on (one epoch per SASRec): every stage, the bundles and serving read it.
    res = run_local(
        str(data),
        "smoke",
        tmp_path,
        "smoke",
        "2026-01-01",
        0,
        json.dumps(SLICE_BOUNDS),
        overrides={"seed": 1, "sequence.folds": 2, "sequence.epochs": 1},
        ablation=True,
    )
    rep = res["report"]
    assert rep is not None, res["validation"]
    assert rep["profile"] == "smoke seed=1 sequence.folds=2 sequence.epochs=1"
    assert run_profile(tmp_path / "smoke").seed == 1
    check_variant_report(rep, (tmp_path / "smoke" / "report.md").read_text(), "all_shapes")
    assert rep["evidence"]["features"][-1] == "sequence"
    spec_tau = run_profile(tmp_path / "smoke").diffusion.spec_tau  # spec's draft threshold
    assert [(r["model"], r["tau"]) for r in rep["rows"]] == [
        ("floor", None),
        ("popularity", None),
        ("ltr", None),
        ("teacher", None),
        ("ar_sft", None),
        ("ar", None),
        ("naive", 0.5),
        ("cft", 1.0),
        ("cft", 0.5),
        ("opd", 0.5),
        ("rl", 1.0),
        ("rl", 0.5),
        ("spec", spec_tau),
    ]
    for r in rep["rows"]:
        assert 0 <= r["recall@1"] <= r["recall@3"] <= r["recall@5"] <= 1
        assert 0 <= r["validity"] <= 1 and (
            r["validity"] == 1.0 or r["model"] not in ("floor", "popularity", "ltr", "teacher")
        )
    assert {(s["model"], s["batch"]) for s in rep["speed"]} >= {
        ("ar", 1),
        ("cft", 1),
        ("rl", 1),
        ("ar", 4),
        ("rl", 4),
    }
    # The ablation branch ran (ablation=True): the AR teacher and its no-trace ablation, paired, beside the report.
    abl = rep["ablation"]
    assert [r["model"] for r in abl["rows"]] == ["ar", "ar_no_trace"]
    assert abl["rows"][0]["recall@1"] == next(r["recall@1"] for r in rep["rows"] if r["model"] == "ar")
    d = abl["ar_minus_ar_no_trace"]
    assert d["n_lists"] == rep["retriever"]["n_test_examples"] and d["ci95"][0] <= d["delta"] <= d["ci95"][1]
    assert d["delta"] == pytest.approx(abl["rows"][0]["recall@1"] - abl["rows"][1]["recall@1"])
    assert "what the trace buys" in (tmp_path / "smoke" / "ablation.md").read_text()
    # The gate ran on the candidate row and wrote its decision and reasons into the report.
    assert isinstance(rep["gate"]["passed"], bool) and any(
        "rl" in x or "floor" in x for x in rep["gate"]["reasons"]
    )
    # The student's operating tau was chosen on validation (gr2/stages/opd_rl.py operating_tau), the report marks
    # its row and shows the curve, and its by-length rows and the gate read that row.
    chosen = rep["operating_tau"]
    tau = chosen["tau"]
    assert [c["tau"] for c in chosen["curve"]] == [0.5, 1.0] and chosen["lists"] > 0
    assert [(r["model"], r["tau"]) for r in rep["rows"] if r.get("operating")] == [("rl", tau)]
    assert {r["tau"] for r in rep["by_length"] if r["model"] == "rl"} == {tau}
    assert f"## Operating tau: {tau:.2f}" in (tmp_path / "smoke" / "report.md").read_text()
    # and was judged in bfloat16 at that tau under the same rule: its bundles record what serving --dtype auto may
    # decode it in, and keep float32 weights
    half = chosen["bfloat16"]
    assert half["tau"] == tau and 0 <= half["recall@1"] <= 1 and isinstance(half["within"], bool)
    students = [f.parent for f in (tmp_path / "smoke").rglob("reranker.json")]
    students = [d for d in students if json.loads((d / "reranker.json").read_text()).get("stage") == "rl"]
    assert students
    for d in students:
        assert json.loads((d / "reranker.json").read_text())["serve_dtype"] == (
            "bfloat16" if half["within"] else "float32"
        )
        assert json.loads((d / "model" / "config.json").read_text())["dtype"] == "float32"
    floor = rep["rows"][0]
    assert floor["delta_vs_floor"]["recall@1"] == [0.0, 0.0]
    # Hit rate = test examples / users with a test target (>= 2 interactions) in the slice.
    inter = pd.read_csv(data / "interactions.tsv", sep="\t", dtype=str)
    n_test_targets = int((inter.groupby("user_id").size() >= 2).sum())
    ret = rep["retriever"]
    assert ret["n_test_targets"] == n_test_targets
    assert ret["hit_rate"] == pytest.approx(ret["n_test_examples"] / n_test_targets)
    assert floor["n_users"] == ret["n_test_examples"]
    assert [v["passed"] for v in res["validation"]] == [True, True]
    assert (tmp_path / "smoke" / "report.md").exists() and (tmp_path / "latest").resolve().name == "smoke"
    # Then the RL student was served on loopback behind the Feast transformer and answered real requests.
    s = rep["serving_smoke"]
    assert s["requests"] > 0 and s["ok"] == s["requests"] and s["with_history"] >= 1
    assert s["v2_status"] == 200 and 400 <= s["malformed_status"] < 500 and s["status_after_malformed"] == 200
    assert (
        s["reversed_status"] == 200
        and 0 <= s["same_top1_reversed"] <= s["ok"]
        and 0 <= s["reordered"] <= s["ok"]
    )
    assert s["example"]["model"] == "rl" and s["gate_passed"] == rep["gate"]["passed"]
    assert "## Local serving check" in (tmp_path / "smoke" / "report.md").read_text()
    # A model card per evaluated model beside the report, linked from it.
    cards = tmp_path / "smoke" / "model_cards"
    names = ["ar_sft", "ar", "naive", "cft", "opd", "rl"]
    assert sorted(p.stem for p in cards.glob("*.md")) == sorted(names)
    assert "block diffusion, block_size 4" in (cards / "rl.md").read_text()
    assert "(model_cards/rl.md)" in (tmp_path / "smoke" / "report.md").read_text()
    # The speed re-measurement for another device (scripts/gpu_check.sh -> analysis/speed_check.py) reads the same
    # run; without a GPU here, on the CPU, with 2 repeats, batch 3 in place of the profile's speed batch, and the
    # student also in bfloat16 (serving's --dtype), in the same repeats.
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "MODELS": "ar,rl,rl:bfloat16",
        "REPEATS": "2",
        "BATCH": "3",
        "OUT": str(tmp_path / "sp"),
    }
    script = Path(__file__).parents[2] / "scripts" / "gpu_check.sh"
    subprocess.run([str(script), str(tmp_path / "smoke")], env={**env, "PY": sys.executable}, check=True)
    sp = json.loads((tmp_path / "sp.json").read_text())
    assert [(s["model"], s["tau"], s["batch"]) for s in sp["speed"]] == [
        (m, t, b)
        for b in (1, 3)
        for m, t in (
            ("ar", None),
            *((r, tau) for r in ("rl", "rl:bfloat16") for tau in (1.0, 0.5)),
            ("spec", spec_tau),
        )
    ]
    assert all(s["tokens_per_s"] > 0 and s["repeats"] == 2 for s in sp["speed"])
    assert [s["speedup_vs_ar"] for s in sp["speed"] if s["model"] == "ar"] == [1.0, 1.0]
    # Mixed lengths in one padded call or one call per length (analysis/pad_vs_group.py): the same rankings.
    pad_vs_group(
        [
            "--run",
            str(tmp_path / "smoke"),
            "--batches",
            "1",
            "--batch-size",
            "6",
            "--out",
            str(tmp_path / "pg"),
        ]
    )
    pg = json.loads((tmp_path / "pg.json").read_text())["decoders"]
    assert {d: f["same_ranking"] for d, f in pg.items()} == {"diffusion": 1.0, "ar": 1.0}
    # Continuous batching (analysis/stream_check.py): lists of every length fed in waves to one running decode get
    # the tokens they get alone, for the student's diffusion and for AR.
    for model in ("rl", "ar"):
        st = stream_check(["--run", str(tmp_path / "smoke"), "--model", model, "--limit", "24"])
        assert st["identical"] == st["lists"] > 0 and st["waves_joined"] > 0, st
    # The decoding loop's rate without HTTP (analysis/stream_rate.py): a row per decoder, concurrency and mode,
    # each the median of its runs, and the report that shows them side by side.
    sr = stream_rate(
        ["--run", str(tmp_path / "smoke"), "--concurrency", "2", "5", "--lists", "12", "--repeats", "2"]
        + ["--out", str(tmp_path / "sr")]
    )
    got = {(r["decoder"], r["concurrency"], r["mode"]): r for r in sr["rows"]}
    assert set(got) == {
        (d, c, m) for d in ("ar", "diffusion") for c in (2, 5) for m in ("decode", "encode+decode")
    }
    assert all(len(r["runs"]) == 2 and r["lists_per_s"] > 0 for r in got.values())
    assert got[("diffusion", 2, "decode")]["tau"] == tau and got[("ar", 2, "decode")]["tau"] is None
    assert set(sr["encode_ms_per_list"]) == {1, 4, 16} and all(
        v > 0 for v in sr["encode_ms_per_list"].values()
    )
    assert "| 5 | encode+decode |" in (tmp_path / "sr.md").read_text()
    # Where the student's rounds go (analysis/rounds_check.py): on the speed rows' lists it counts the same
    # tokens per forward as the speed table.
    prof = run_profile(tmp_path / "smoke")
    rc = rounds_check(
        ["--run", str(tmp_path / "smoke"), "--split", "test", "--lists", str(prof.eval.speed_examples)]
    )
    b1 = next(s for s in rep["speed"] if (s["model"], s["tau"], s["batch"]) == ("rl", tau, 1))
    assert rc["tau"] == tau and rc["tokens_per_forward"] == pytest.approx(b1["tokens_per_forward"])
    assert sum(k["tokens"] for k in rc["late_share"].values()) == pytest.approx(
        rc["tokens_per_forward"] * rc["forwards_per_list"] * rc["lists"]
    )
    assert all(r >= 1 for r in rc["rounds_per_block"].values())  # (the smoke model writes no real trace)
    # The paired comparison (analysis/compare_models.py) decodes as the evaluation did: its A and B are the
    # report's rows, and the delta is their difference.
    rows = {(r["model"], r["tau"]): r for r in rep["rows"]}
    cmp = compare_models(
        ["--run", str(tmp_path / "smoke"), "--a", "rl", "--b", "ar", "--out", str(tmp_path / "c.json")]
    )
    r1 = cmp["metrics"]["recall@1"]
    assert cmp["n"] == floor["n_users"] and cmp["tau"] == tau
    assert r1["rl"] == pytest.approx(rows[("rl", tau)]["recall@1"]) and r1["ar"] == pytest.approx(
        rows[("ar", None)]["recall@1"]
    )
    assert r1["delta"] == pytest.approx(r1["rl"] - r1["ar"]) and r1["ci95"][0] <= r1["delta"] <= r1["ci95"][1]
    t = cmp["top1"]
    net = sum(t[k]["rl_wins"] - t[k]["ar_wins"] for k in ("label_first", "label_not_first"))
    assert net == pytest.approx(cmp["n"] * r1["delta"])
    assert t["label_first"]["lists"] + t["label_not_first"]["lists"] == cmp["n"]
    assert json.loads((tmp_path / "c.json").read_text()) == cmp
    # --length: the lists cut as the report's by-length table cuts them, so its rows come back
    short = min(r["length"] for r in rep["by_length"])
    cut = compare_models(["--run", str(tmp_path / "smoke"), "--a", "rl", "--b", "ar", "--length", str(short)])
    by_len = {(r["model"], r["length"]): r["recall@1"] for r in rep["by_length"]}
    assert cut["length"] == short and cut["n"] == floor["n_users"]
    assert (cut["metrics"]["recall@1"]["rl"], cut["metrics"]["recall@1"]["ar"]) == pytest.approx(
        (by_len[("rl", short)], by_len[("ar", short)])
    )
    # a bundle folder in place of a name (a recipe trained by hand on the run's sft_data), on the first lists
    rl_dir = str(find_bundles(tmp_path / "smoke", ["rl"])["rl"])
    head = [
        compare_models(["--run", str(tmp_path / "smoke"), "--a", m, "--b", "ar", "--limit", "6"])
        for m in ("rl", rl_dir)
    ]
    assert head[0]["n"] == head[1]["n"] == 6
    assert head[1]["metrics"]["recall@1"][rl_dir] == head[0]["metrics"]["recall@1"]["rl"]
    # the same bundle decoded in bf16 (serving --dtype bfloat16) against itself in float32, on the same lists
    bf = compare_models(["--run", str(tmp_path / "smoke"), "--a", "rl:bfloat16", "--b", "rl", "--limit", "6"])
    assert bf["n"] == 6 and bf["metrics"]["recall@1"]["rl"] == head[0]["metrics"]["recall@1"]["rl"]
    assert 0 <= bf["metrics"]["recall@1"]["rl:bfloat16"] <= 1
    # the run's feature-only rankers, refitted nowhere: the saved teacher and ltr give the report's rows
    r1 = compare_models(["--run", str(tmp_path / "smoke"), "--a", "teacher", "--b", "ltr"])["metrics"][
        "recall@1"
    ]
    assert (r1["teacher"], r1["ltr"]) == pytest.approx(
        (rows[("teacher", None)]["recall@1"], rows[("ltr", None)]["recall@1"])
    )
    # and analysis/feature_rankers.py scores them alike; each row's difference from ltr is its own minus ltr's
    fr = feature_rankers(
        ["--run", str(tmp_path / "smoke"), "--split", "test", "--seq-epochs", "1", "--nn-seeds", "1"]
    )
    got = {k: v["recall@1"] for k, v in fr["rankers"].items()}
    assert (got["teacher"]["value"], got["ltr"]["value"]) == pytest.approx((r1["teacher"], r1["ltr"]))
    assert set(got) == {"ltr", "teacher", "teacher_raw", "ltr+teacher", "ltr+teacher_raw"} | {
        "seq",
        "ltr+seq",
        "teacher+seq",
        "mlp",
        "listwise",
    }
    for row in got.values():
        assert row["minus_ltr"] == pytest.approx(row["value"] - got["ltr"]["value"])
        assert row["ci95"][0] <= row["minus_ltr"] <= row["ci95"][1]


def test_failed_validation_stops_the_pipeline(tmp_path):
    data = require_slice()
    res = run_local(
        str(data), "quick", tmp_path, "bad", "2026-01-01", SLICE_USERS, '{"min_targets": 10000000}'
    )
    assert res["report"] is None
    [v] = res["validation"]  # only the targets validation ran; candidates and evaluation were skipped
    assert not v["passed"] and "expect_table_row_count_to_be_between" in v["message"]
    kfp_root = tmp_path / "bad" / "kfp"
    assert not list(kfp_root.glob("**/candidates"))
    # nothing reached the online store that serving reads: only the registry was applied
    assert list(kfp_root.glob("**/feast-apply/feature_store")) and not list(kfp_root.glob("**/materialize"))


def test_malformed_dataset_fails_at_ingest_and_writes_nothing(tmp_path, capfd):
    """Truly malformed data (here a seq_idx that goes down within a user) stops the DAG in ingest, with the
    loader's error naming file, line and column, before anything reaches the feature store; the exit handler
    still records the failed outcome. (That ingest is not retried on the cluster: tests/pipelines/test_compile.py.)"""
    bad = malformed_slice(tmp_path / "bad")  # user 1's seq_idx goes down
    with pytest.raises(RuntimeError, match="Inner task failed: .*ingest"):
        run_local(str(bad), "smoke", tmp_path, "bad", "2026-01-01", serve_smoke=False)
    logs = "".join(capfd.readouterr())
    assert (
        "DatasetError" in logs
        and "interactions.tsv, line 6, column 'seq_idx': seq_idx 3 of user '1' comes after" in logs
    )
    root = tmp_path / "bad" / "kfp"
    assert not list(root.glob("**/feast-apply")) and not list(root.glob("**/*.parquet"))
    [outcome] = root.glob("**/outcome/outcome.json")
    assert json.loads(outcome.read_text())["status"] == "FAILED"


def test_set_overrides_reach_run_local(monkeypatch):
    """`--set KEY=VALUE` (repeatable) parses VALUE as YAML and hands the dotted keys to run_local; a malformed
    one is refused by name. The report's command is the one typed, with no machine path in it."""
    import pipelines.run_local as rl

    got = {}

    def fake(**kwargs):
        got.update(kwargs)
        return {"report": None, "validation": [], "seconds": 0.0, "run_dir": "x"}

    monkeypatch.setattr(rl, "run_local", fake)
    assert rl.main(["--set", "seed=1", "--set", "sft.epochs=2.5", "--set", "teacher.inputs=raw"]) == 1
    assert got["overrides"] == {"seed": 1, "sft.epochs": 2.5, "teacher.inputs": "raw"}
    assert (
        got["command"]
        == "python -m pipelines.run_local --set seed=1 --set sft.epochs=2.5 --set teacher.inputs=raw"
    )
    rl.main(["--command", "make bench"])
    assert got["command"] == "make bench"
    with pytest.raises(SystemExit):
        rl.main(["--set", "seed"])


def test_run_examples_names_a_directory_that_is_not_a_run(tmp_path):
    """The run tools read a run's candidate lists through `run_examples`: a directory without them is named."""
    from pipelines.run_local import run_examples

    with pytest.raises(FileNotFoundError, match="not a run directory"):
        run_examples(tmp_path)
    out = tmp_path / "kfp" / "p1" / "candidates" / "examples"
    out.parent.mkdir(parents=True)
    pd.DataFrame({"split": ["test"], "label": [0]}).to_parquet(out)
    assert run_examples(tmp_path)["label"].tolist() == [0]
