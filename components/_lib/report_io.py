"""Run report I/O for the pipeline steps: report.json + report.md (docs/CONTRACTS.md "Report row").

Uses gr2.report.write_report when it exists (the core's one implementation); the fallback below writes the
same fields so the pipeline runs while the core module is absent.
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from components._lib.paths import REPO_ROOT

METRICS = ("recall@1", "recall@3", "recall@5", "ndcg@3", "ndcg@5")


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine() -> str:
    import os

    return f"{platform.machine()} {os.cpu_count()} cpu, {platform.system()} {platform.release()}, python {platform.python_version()}"


def table_markdown(report: dict[str, Any]) -> str:
    """The rows as a Markdown table: metric [95% CI] and the paired delta vs the floor for R@1."""
    head = "| model | " + " | ".join(METRICS) + " | ΔR@1 vs floor [95% CI] | validity | n_users |"
    lines = [head, "|" + "---|" * (len(METRICS) + 4)]
    for r in report["rows"]:
        cells = [f"{r[m]:.4f} [{r['ci95'][m][0]:.3f}, {r['ci95'][m][1]:.3f}]" for m in METRICS]
        d = r["delta_vs_floor"]["recall@1"]
        dm = r.get("delta_vs_floor_mean", {}).get("recall@1", float("nan"))
        lines.append(
            f"| {r['model']} | " + " | ".join(cells) + f" | {dm:+.4f} [{d[0]:+.3f}, {d[1]:+.3f}] | "
            f"{r['validity']:.3f} | {r['n_users']} |"
        )
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    ret = report["retriever"]
    gate = report["gate"]
    out = [
        f"# Diffusion-GR2 report: {report['dataset']} ({report['profile']} profile)",
        "",
        f"git {report['git_sha']} · {report['machine']}",
        "",
        f"Retriever `{ret['name']}`: hit rate {ret['hit_rate']:.4f} "
        f"({ret['n_test_examples']} test examples re-ranked).",
        "",
        table_markdown(report),
        "",
        f"Gate: {'PASSED' if gate['passed'] else 'NOT PASSED'}"
        + "".join(f"\n- {r}" for r in gate["reasons"]),
    ]
    return "\n".join(out) + "\n"


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Add git_sha / machine, then write report.json and report.md into `out_dir`."""
    report.setdefault("git_sha", git_sha())
    report.setdefault("machine", machine())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float))
    (out / "report.md").write_text(to_markdown(report))
    return out
