"""The report's rows as a console table for the CLI and the local runner (the report itself: gr2.report)."""

from __future__ import annotations

from typing import Any

from gr2.metrics import METRICS


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
