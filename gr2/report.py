"""Run report: report.json (CONTRACTS.md "Report row") and a readable report.md, plus run metadata."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd

from gr2.data.profile import profile_markdown
from gr2.metrics import METRICS, evaluate, identity_rankings

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_sha(repo: str | Path = REPO_ROOT, short: bool = False) -> str:
    """HEAD commit (short form if `short`), "-dirty" if tracked files changed; GR2_GIT_SHA overrides (e.g. in
    an image built without .git); "unknown" outside a git checkout."""
    if os.environ.get("GR2_GIT_SHA"):
        return os.environ["GR2_GIT_SHA"]
    try:
        args = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
        sha = subprocess.run(
            args, cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict:
    """CPU model, cores, platform, torch version and GPU (if torch sees one)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"], info["gpu"] = None, None
    return info


def floor_row(examples: pd.DataFrame, n_boot: int = 1000, seed: int = 0) -> dict:
    """The pre-rank floor (retriever order) as a report row."""
    n = len(examples["candidates"].iat[0]) if len(examples) else 0
    return evaluate(examples, identity_rankings(len(examples), n), None, None, n_boot, seed, model="floor")


def json_default(o):
    """`json.dumps(default=...)` for report values: numpy scalars and arrays, and paths."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def fmt_value(x, digits: int = 4) -> str:
    """A report number for Markdown: '—' for missing, fixed decimals for floats."""
    if x is None:
        return "—"
    if isinstance(x, float) and np.isnan(x):
        return "nan"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def fmt_ci(row: dict, m: str, key: str = "ci95", sign: bool = False) -> str:
    """' [lo, hi]' of a row's 95% CI for metric m ('' when the row has none)."""
    ci = (row.get(key) or {}).get(m)
    if not ci:
        return ""
    f = "{:+.3f}" if sign else "{:.3f}"
    return f" [{f.format(ci[0])}, {f.format(ci[1])}]"


def speed_markdown(speed: list[dict]) -> list[str]:
    """The speed rows (report.json `speed`) as a Markdown table, one line per entry."""
    out = [
        "| model | tau | batch | tokens/s | nfe/seq | tokens/forward | speedup vs AR [95% CI] | ideal speedup |"
    ]
    out += ["|---|---|---|---|---|---|---|---|"]
    for s in speed:
        lo_hi = s.get("speedup_ci95")  # the 95% interval over the timing repeats (absent: one repeat)
        ci = f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" if lo_hi else ""
        out += [
            f"| {s['model']} | {fmt_value(s.get('tau'), 2)} | {s['batch']} | {s['tokens_per_s']:.1f} | "
            f"{s['nfe_per_seq']:.1f} | {s['tokens_per_forward']:.2f} | {s['speedup_vs_ar']:.2f}{ci} | "
            f"{s['ideal_speedup']:.2f} |"
        ]
    return out


def by_length_markdown(by_length: list[dict], cold: dict | None) -> list[str]:
    """The report's tables of what clients send besides full lists: `ar` and the deployed student on the test
    lists cut to each length, and the cold-start path on the test lists without their histories."""
    out: list[str] = []
    if by_length:
        out += ["", "## By list length (the test lists cut to each length, the held-out item kept)", ""]
        out += ["| model | tau | length | lists | R@1 | floor R@1 | ΔR@1 vs floor | validity |"]
        out += ["|---|---|---|---|---|---|---|---|"]
        for r in by_length:
            d = r["recall@1"] - r["floor_recall@1"]
            out += [
                f"| {r['model']} | {fmt_value(r.get('tau'), 2)} | {r['length']} | {r['lists']} "
                f"| {fmt_value(r['recall@1'], 3)}{fmt_ci(r, 'recall@1')} | {fmt_value(r['floor_recall@1'], 3)} "
                f"| {d:+.3f}{fmt_ci(r, 'recall@1', 'delta_vs_floor', sign=True)} | {fmt_value(r['validity'], 3)} |"
            ]
    if cold:
        d = (cold.get("delta_vs_floor_mean") or {}).get("recall@1", 0.0)
        out += ["", "## Cold start (the test lists with their histories removed, as serving ranks them)", ""]
        out += ["| served by | rankers | lists | R@1 | ΔR@1 vs floor | validity | lists reordered |"]
        out += ["|---|---|---|---|---|---|---|"]
        out += [
            f"| {cold.get('served_by')} | {', '.join(f'{k} {v}' for k, v in (cold.get('ranker') or {}).items())} "
            f"| {sum((cold.get('ranker') or {}).values())} | {fmt_value(cold['recall@1'], 3)}{fmt_ci(cold, 'recall@1')} "
            f"| {d:+.3f}{fmt_ci(cold, 'recall@1', 'delta_vs_floor', sign=True)} | {fmt_value(cold['validity'], 3)} "
            f"| {fmt_value(cold.get('reordered'), 3)} |"
        ]
    return out


def operating_tau_markdown(chosen: dict | None) -> list[str]:
    """The report's table of how the deployed student's operating tau was chosen: its validation curve against
    the AR teacher on the same lists (gr2/stages/opd_rl.py `operating_tau`)."""
    if not chosen:
        return []
    out = ["", f"## Operating tau: {fmt_value(chosen.get('tau'), 2)} ({chosen.get('chosen_by')})", ""]
    if not chosen.get("curve"):
        return out
    ar = chosen["ar"]
    out += [
        f"On {chosen['lists']} validation lists ({chosen['short_share']:.0%} of them cut to 2..N-1 candidates): the "
        f"lowest tau whose R@1 is at least `ar`'s minus {chosen['margin']} and whose validity is at least "
        f"{chosen['min_validity']}. `ar`: R@1 {ar['recall@1']:.3f}, validity {ar['validity']:.3f}.",
        "",
        "| tau | R@1 | R@1 - ar | validity | chosen |",
        "|---|---|---|---|---|",
    ]
    for c in chosen["curve"]:
        mark = "**yes**" if c["tau"] == chosen["tau"] else ""
        out += [
            f"| {c['tau']:.2f} | {c['recall@1']:.3f} | {c['recall@1'] - ar['recall@1']:+.3f} "
            f"| {c['validity']:.3f} | {mark} |"
        ]
    half = chosen.get("bfloat16")
    if half:  # the same rule for the student in bf16 at that tau: serving --dtype auto may then use it
        out += [
            "",
            f"In bfloat16 at tau {half['tau']:.2f}: R@1 {half['recall@1']:.3f} ({half['recall@1'] - ar['recall@1']:+.3f}), "
            f"validity {half['validity']:.3f}: "
            + (
                "within the rule that chose the tau, so serving `--dtype auto` decodes it in bf16 on CPUs "
                "with bf16 units."
                if half["within"]
                else "not within the rule that chose the tau, so serving decodes it in float32."
            ),
        ]
    return out


def render_markdown(report: dict, plots: list[str] | None = None) -> str:
    """Markdown: header facts, the rows table (metrics with 95% CIs, R@1 delta vs floor), retriever, gate."""
    out = [f"# Report: {report.get('dataset', '?')} / profile {report.get('profile', '?')}", ""]
    out += [f"- git: `{report.get('git_sha', 'unknown')}`"]
    mach = report.get("machine") or {}
    if mach:
        out += [
            f"- machine: {mach.get('cpu')} x{mach.get('cores')}, torch {mach.get('torch')}, gpu {mach.get('gpu')}"
        ]
    ret = report.get("retriever") or {}
    if ret:
        out += [
            f"- retriever `{ret.get('name')}`: hit rate {fmt_value(ret.get('hit_rate'))} "
            f"({ret.get('n_test_examples')} test examples reach re-ranking)"
        ]
    out += [
        "",
        "| model | tau | "
        + " | ".join(METRICS)
        + " | ΔR@1 vs floor | validity | n_users | nfe/seq | speedup |",
    ]
    out += ["|" + "---|" * (len(METRICS) + 7)]
    for row in report.get("rows", []):
        cells = [str(row.get("model", "")), fmt_value(row.get("tau"), 2)]
        cells += [fmt_value(row.get(m), 3) + fmt_ci(row, m) for m in METRICS]
        d = (row.get("delta_vs_floor_mean") or {}).get("recall@1")
        cells += [("" if d is None else f"{d:+.3f}") + fmt_ci(row, "recall@1", "delta_vs_floor", sign=True)]
        cells += [
            fmt_value(row.get("validity"), 3),
            str(row.get("n_users", "")),
            fmt_value(row.get("nfe_per_seq"), 2),
        ]
        cells += [fmt_value(row.get("speedup_vs_ar"), 2)]
        out += ["| " + " | ".join(cells) + " |"]
    traced = [r for r in report.get("rows", []) if r.get("trace")]
    if traced:
        out += ["", "## Traces (the trace's own ranking, and whether the answer follows it)", ""]
        out += [
            "| model | tau | lists with a full trace | trace R@1 | answer R@1 | answer first = trace top |"
        ]
        out += ["|---|---|---|---|---|---|"]
        for r in traced:
            t = r["trace"]
            out += [
                f"| {r.get('model')} | {fmt_value(r.get('tau'), 2)} | {t['lists']} | {fmt_value(t['recall@1'], 3)} "
                f"| {fmt_value(r.get('recall@1'), 3)} | {fmt_value(t.get('answer_follows'), 3)} |"
            ]
    out += operating_tau_markdown(report.get("operating_tau"))
    out += by_length_markdown(report.get("by_length") or [], report.get("cold_start"))
    speed = report.get("speed") or []
    if speed:
        out += ["", "## Decode speed (measured side by side in one process)", "", *speed_markdown(speed)]
    gate = report.get("gate")
    if gate is not None:
        out += ["", f"**Gate: {'PASSED' if gate.get('passed') else 'FAILED'}**"]
        out += [f"- {r}" for r in gate.get("reasons", [])]
    # What the data has and lacks, and the evidence features dropped because the data cannot supply them
    # (never computed as a constant that looks like signal: gr2/evidence.py).
    dropped = (report.get("evidence") or {}).get("dropped_features")
    if report.get("dataset_profile") or dropped:
        out += ["", "## Dataset profile", ""]
        out += profile_markdown(report["dataset_profile"]) if report.get("dataset_profile") else []
        if dropped:
            out += ["- evidence features dropped: " + "; ".join(f"{f} ({w})" for f, w in dropped.items())]
    cards = report.get("model_cards") or []
    if cards:
        out += ["", "## Model cards", "", " · ".join(f"[{Path(c).stem}]({c})" for c in cards)]
    if plots:
        out += ["", "## Plots"] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(out) + "\n"


def write_report(run_dir: str | Path, report: dict, link_latest: bool = False) -> Path:
    """Write report.json + report.md into run_dir (adding git_sha and machine when missing); with `link_latest`
    (a run's folder, not a step's output) also point `<run_dir>/../latest` at it. Returns run_dir."""
    report.setdefault("git_sha", git_sha())
    report.setdefault("machine", machine_info())
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").write_text(json.dumps(report, indent=1, default=json_default))
    plots = report.get("plots") or sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.png"))
    (run_dir / "report.md").write_text(render_markdown(report, plots))
    if not link_latest:
        return run_dir
    latest = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)  # relative, so the runs folder can be moved
    os.replace(tmp, latest)  # atomic swap: readers never see a missing link
    return run_dir
