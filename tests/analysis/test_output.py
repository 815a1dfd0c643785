"""analysis/output.py: the result printed as JSON, and the same text written to --out (its folder made); the
provenance header every tool puts first."""

import json

from analysis.output import print_json, provenance, run_record


def test_print_json_prints_and_writes_the_same_text(tmp_path, capsys):
    out = tmp_path / "new" / "res.json"
    print_json({"lists": 3, "identical": 3}, str(out))
    printed = capsys.readouterr().out
    assert json.loads(printed) == json.loads(out.read_text()) == {"lists": 3, "identical": 3}
    print_json([1], None)  # no --out: printed only
    assert json.loads(capsys.readouterr().out) == [1]


def test_provenance_names_the_command_main_was_given(monkeypatch):
    # main(argv) called from a test or another tool: the command is argv, not the process's own arguments.
    monkeypatch.setattr("sys.argv", ["pytest", "-x"])
    head = provenance("analysis.spec_check", ["--run", "runs/r", "--limit", "5"])
    assert head["command"] == "python -m analysis.spec_check --run runs/r --limit 5"
    assert head["git_sha"] and "machine" not in head
    assert provenance("analysis.spec_check", None)["command"] == "python -m analysis.spec_check -x"
    machine = provenance("analysis.speed_check", [], machine=True)["machine"]
    assert machine["cores"] and machine["cpu"]


def test_run_record_names_the_run_its_report_does_not(tmp_path):
    # a run stopped before its gate: its report has no run_id
    report = {"dataset": "amazon_beauty", "profile": "bench", "git_sha": "abc"}
    rec = run_record(tmp_path / "20261205-bench", report)
    assert rec == {
        "run_id": "20261205-bench",
        "dataset": "amazon_beauty",
        "profile": "bench",
        "git_sha": "abc",
    }
    assert run_record(tmp_path / "x", report | {"run_id": "r1"})["run_id"] == "r1"
