"""Plots for the run report: the quality-speed frontier and the training curves (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay out, write and close a figure (every plot of the project ends here)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


def plot_frontier(report: dict, path: str | Path) -> Path:
    """recall@1 against decode tokens/s (batch 1) for every decoder row, the floor as a horizontal line."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in report["rows"]:
        if row.get("tokens_per_s"):
            label = row["model"] + (f" tau={row['tau']}" if row.get("tau") is not None else "")
            ax.scatter(row["tokens_per_s"], row["recall@1"], s=30)
            ax.annotate(
                label,
                (row["tokens_per_s"], row["recall@1"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    for row in report["rows"]:
        if row["model"] in ("floor", "ltr"):
            ax.axhline(row["recall@1"], ls="--", lw=0.8, color="grey" if row["model"] == "floor" else "green")
            ax.text(ax.get_xlim()[0], row["recall@1"], f" {row['model']}", fontsize=7, va="bottom")
    ax.set_xlabel("decode tokens/s (batch 1)")
    ax.set_ylabel("recall@1 (test)")
    ax.set_title(f"quality vs speed — {report.get('dataset', '')}")
    return save(fig, path)


def plot_training_curves(
    logs: dict[str, Path], path: str | Path, keys: tuple[str, ...] = ("loss", "reward", "kl")
) -> Path | None:
    """One panel per logged quantity (loss, and reward / KL where a stage logs them), one line per stage."""
    series: dict[str, dict[str, tuple[list, list]]] = {k: {} for k in keys}
    for name, log_path in logs.items():
        rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
            if pts:
                series[k][name] = ([p[0] for p in pts], [p[1] for p in pts])
    panels = [k for k in keys if series[k]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, k in zip(axes[0], panels, strict=True):
        for name, (x, y) in series[k].items():
            ax.plot(x, y, lw=0.8, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(k)
        ax.legend(fontsize=7)
    return save(fig, path)


def plot_nightly(nights: list[dict], path: str | Path) -> Path:
    """The replayed nights (pipelines/nightly.py): recall@1 of champion and challenger on each night's lists,
    each night's outcome, the production model's run after it, and the nights with a drift warning."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = list(range(len(nights)))
    dates = [n["snapshot_date"] for n in nights]
    style = {
        "promoted": ("o", "tab:green"),
        "held_by_gate": ("X", "tab:red"),
        "stopped_at_validation": ("s", "grey"),
    }
    for i, n in enumerate(nights):
        champ, chall = n.get("champion_recall@1"), n.get("challenger_recall@1")
        if champ is not None:
            ax.scatter(i, champ, marker="_", s=300, color="black", zorder=3)
        if chall is not None:
            marker, color = style.get(n["outcome"], ("o", "tab:blue"))
            ax.scatter(i, chall, marker=marker, s=70, color=color, zorder=3)
    known = [
        v for n in nights for v in (n.get("champion_recall@1"), n.get("challenger_recall@1")) if v is not None
    ]
    top = max(known, default=0.5) + 0.08
    bottom = max(min(known, default=0.0) - 0.08, 0.0)
    ax.set_ylim(bottom, top)
    for i, n in enumerate(nights):
        label = n["outcome"].replace("_", " ")
        if n.get("drift_warnings"):
            ax.axvspan(i - 0.4, i + 0.4, color="orange", alpha=0.2, lw=0)
            label += "\nDRIFT WARNING"
        if n.get("fault"):
            label += f"\n({n['fault']})"
        ax.text(i, top - 0.01, label, ha="center", va="top", fontsize=7)
        prod = (n.get("production_after") or "none").split("/")[0]
        ax.text(i, bottom + 0.005, f"prod: {prod}", ha="center", va="bottom", fontsize=6, color="dimgrey")
    ax.scatter([], [], marker="_", s=300, color="black", label="champion (production), tonight's lists")
    for outcome, (marker, color) in style.items():
        ax.scatter([], [], marker=marker, color=color, label=f"challenger: {outcome.replace('_', ' ')}")
    ax.set_xticks(x, dates, rotation=0, fontsize=8)
    ax.set_xlim(-0.6, len(nights) - 0.4)
    ax.set_ylabel("recall@1 on the night's test lists")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Nightly runs: champion against challenger", fontsize=10)
    return save(fig, path)
