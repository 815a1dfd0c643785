"""What every analysis result carries: a header that says how to reproduce it (`provenance`), and the JSON on
stdout, the same text in --out when given (`print_json`)."""

import json
import sys
from pathlib import Path
from typing import Any

from gr2.report import git_sha, machine_info


def provenance(module: str, argv: list[str] | None, machine: bool = False) -> dict:
    """The command that reproduces a result (`argv` as main received it; None: the process's own), the commit
    it ran at, and the machine where timings depend on it."""
    args = sys.argv[1:] if argv is None else argv
    out: dict[str, Any] = {"command": " ".join(["python -m", module, *args]), "git_sha": git_sha()}
    if machine:
        out["machine"] = machine_info()
    return out


def run_record(run: Path, report: dict) -> dict:
    """Which run's models a result measured: its id (the folder's name where the report has none, e.g. a report
    copied from a run stopped before its gate), dataset, profile, and the commit it was trained at."""
    return {
        "run_id": report.get("run_id") or run.name,
        "dataset": report.get("dataset"),
        "profile": report.get("profile"),
        "git_sha": report.get("git_sha"),
    }


def emit(module: str, argv: list[str] | None, result: dict, out: str | None) -> dict:
    """What a main returns: `result` under its provenance header, printed (and written to `out` when given)."""
    res = provenance(module, argv) | result
    print_json(res, out)
    return res


def print_json(result: Any, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
