"""Run report I/O for the pipeline steps: report.json + report.md (docs/CONTRACTS.md "Report row").

The fields and the Markdown come from gr2.report (git_sha, machine_info, render_markdown); this module only
writes them into a step's output folder (gr2.report.write_report also moves runs/latest, which belongs to
the run folder, see pipelines/run_local.py) and prints the rows as a console table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gr2.metrics import METRICS


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Add git_sha / machine, then write report.json and report.md into `out_dir`."""
    from gr2.report import git_sha, json_default, machine_info, render_markdown

    report.setdefault("git_sha", git_sha())
    report.setdefault("machine", machine_info())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=json_default))
    (out / "report.md").write_text(render_markdown(report))
    return out


def table_markdown(report: dict[str, Any]) -> str:
    """The rows as a Markdown table: metric [95% CI] and the paired delta vs the floor for R@1."""
    head = "| model | " + " | ".join(METRICS) + " | ΔR@1 vs floor [95% CI] | validity | n_users |"
    lines = [head, "|" + "---|" * (len(METRICS) + 4)]
    for r in report["rows"]:
        cells = [f"{r[m]:.4f} [{r['ci95'][m][0]:.3f}, {r['ci95'][m][1]:.3f}]" for m in METRICS]
        d = r["delta_vs_floor"]["recall@1"]
        dm = r.get("delta_vs_floor_mean", {}).get("recall@1", float("nan"))
        name = r["model"] + (f" (tau {r['tau']})" if r.get("tau") is not None else "")
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {dm:+.4f} [{d[0]:+.3f}, {d[1]:+.3f}] | {r['validity']:.3f} | {r['n_users']} |"
        )
    return "\n".join(lines)
