"""The gate component: its plain function over a real report file, the production record read from the
artifact store, and the KFP component itself run through kfp.local inside a pipeline with dsl.If."""

import json

import pytest

from components.artifact_store import open_store, production_record
from gr2.gate import run_gate


def report(cand_r1: float) -> dict:
    rows = [
        {
            "model": "floor",
            "tau": None,
            "recall@1": 0.30,
            "validity": 1.0,
            "delta_vs_floor": {"recall@1": [0, 0]},
        },
        {"model": "ar", "tau": None, "recall@1": 0.41, "validity": 1.0},
        {"model": "ltr", "tau": None, "recall@1": 0.40, "validity": 1.0},
        {
            "model": "diffusion",
            "tau": 0.9,
            "recall@1": cand_r1,
            "validity": 1.0,
            "speedup_vs_ar": 3.1,
            "delta_vs_floor": {"recall@1": [cand_r1 - 0.35, cand_r1 - 0.25]},
        },
    ]
    return {"dataset": "ml-latest-small", "rows": rows, "gate": None}


@pytest.fixture
def local_store(tmp_path, monkeypatch):
    monkeypatch.delenv("GR2_S3_BUCKET", raising=False)
    monkeypatch.setenv("GR2_ARTIFACT_ROOT", str(tmp_path / "store"))
    return open_store()


def test_run_gate_writes_decision_into_report(tmp_path, local_store):
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "report.json").write_text(json.dumps(report(0.405)))
    assert production_record() is None  # empty store: nothing in production
    res = run_gate(tmp_path / "rep", tmp_path / "out", "diffusion", True, "quick", production_record())
    assert res["passed"] and res["checks"]["production"] is None
    gated = json.loads((tmp_path / "out" / "report.json").read_text())
    assert gated["gate"]["passed"] is True and len(gated["gate"]["reasons"]) == 7
    assert "PASSED" in (tmp_path / "out" / "gate.md").read_text()

    # once a model is in production, the candidate must be compared with it on the same lists: without that
    # comparison the production rule fails (never skipped), and with it the paired CI decides
    local_store.upload("r0", "model", report={"x": 1})
    local_store.promote("r0", "model", {"model": "diffusion", "recall@1": 0.45})
    res = run_gate(
        tmp_path / "rep" / "report.json", tmp_path / "out2", "diffusion", True, "quick", production_record()
    )
    assert not res["passed"]
    assert [k for k, v in res["checks"].items() if v is False] == ["production"]
    paired = {"n_lists": 300, "candidate": 0.405, "production": 0.41, "delta": -0.005, "ci95": [-0.03, 0.02]}
    res = run_gate(
        tmp_path / "rep", tmp_path / "out3", "diffusion", True, "quick", production_record(), paired
    )
    assert res["passed"] and res["paired"] == paired
    assert json.loads((tmp_path / "out3" / "decision.json").read_text())["checks"]["production"] is True
    assert production_record('{"model": "x", "recall@1": 0.1}')["recall@1"] == 0.1
    assert production_record("null") is None


def test_a_model_decoded_at_several_taus_is_judged_at_its_operating_one(tmp_path, local_store):
    """The report marks the student's operating row (its bundle's tau, chosen on validation); the gate judges that
    row, not the profile's eval_tau (0.4 in quick); an unmarked report falls back to eval_tau."""
    rep = report(0.405)
    slow, fast = rep["rows"][-1], {**rep["rows"][-1], "tau": 0.4, "recall@1": 0.30}
    rep["rows"].append(fast)
    for mark, want in ((0.9, "diffusion@0.9"), (0.4, "diffusion@0.4"), (None, "diffusion@0.4")):
        slow["operating"], fast["operating"] = mark == 0.9, mark == 0.4
        (tmp_path / "rep").mkdir(exist_ok=True)
        (tmp_path / "rep" / "report.json").write_text(json.dumps(rep))
        res = run_gate(tmp_path / "rep", tmp_path / f"out{mark}", "diffusion", True, "quick", None)
        assert res["candidate"] == want and res["passed"] is (want == "diffusion@0.9")


def test_gate_component_in_a_local_pipeline(tmp_path, local_store):
    from kfp import dsl, local

    from components.gate import gate

    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(report(0.405)))
    marker = tmp_path / "deployed.txt"

    @dsl.component(base_image="python:3.11")
    def fake_deploy(path: str):
        open(path, "w").write("deployed")

    @dsl.pipeline(name="gate-test")
    def p(cand: str, valid: bool):
        imp = dsl.importer(artifact_uri=str(rep), artifact_class=dsl.Artifact, reimport=False)
        g = gate(report=imp.output, candidate=cand, data_validation_passed=valid, production_json="null")
        with dsl.If(g.outputs["Output"] == True):  # noqa: E712
            fake_deploy(path=str(marker))

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "root"),
        raise_on_error=True,
    )
    p(cand="diffusion", valid=False)  # data validation failed -> gate fails -> deploy skipped
    assert not marker.exists()
    p(cand="diffusion", valid=True)
    assert marker.read_text() == "deployed"
    decisions = sorted((tmp_path / "root").rglob("decision.json"), key=lambda f: f.stat().st_mtime)
    assert [json.loads(d.read_text())["passed"] for d in decisions] == [False, True]
