"""The evaluation gate (docs/CONTRACTS.md, "Evaluation gate and rollout"): pure logic, no I/O.

Inputs: the report rows (docs/CONTRACTS.md report row), the candidate model's name, the data-validation result,
the production model's record (None when nothing is in production) and a `GateConfig`. Output: `passed`
plus one human-readable reason per rule, so the decision can be read in the report and the KFP UI.

Rules (each one line in `reasons`, prefixed PASS/FAIL/SKIP):
  data       data validation passed
  floor      candidate recall@1 > floor recall@1 (and whether the paired 95% CI of the delta excludes zero)
  ar_gap     ar recall@1 - candidate recall@1 <= max_gap_to_ar (only when an `ar` row exists)
  ltr        ltr recall@1 - candidate recall@1 <= max_gap_to_ltr (only when an `ltr` row exists): a GBDT on the
             same evidence is what the platform would serve instead
  validity   validity >= min_validity
  speedup    the lower bound of speedup_vs_ar's 95% interval over the timing repeats (speedup_ci95; the point
             estimate when the row has no interval) >= min_speedup (only when the row reports a speedup)
  production champion against challenger (only with a production model): both scored on tonight's test lists
             (components/_lib/champion.py); fails when the paired 95% CI of candidate - production recall@1
             lies wholly below -max_drop_vs_production, and when the production model could not be scored.
             The figure stored in the production record (another night's lists) is reported for history only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gr2.config import GateConfig

if TYPE_CHECKING:
    import pandas as pd

METRIC = "recall@1"  # the headline metric every comparison uses
FLOOR_MODEL = "floor"
AR_MODEL = "ar"
LTR_MODEL = "ltr"


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reasons: list[str]
    checks: dict[str, bool | None] = field(default_factory=dict)  # rule -> passed (None = skipped)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reasons": list(self.reasons), "checks": dict(self.checks)}


def find_row(rows: Sequence[Mapping[str, Any]], model: str) -> Mapping[str, Any] | None:
    """The row of `model`; "name@tau" selects one decoding threshold of a model evaluated at several."""
    name, _, tau = model.partition("@")
    matches = [r for r in rows if r.get("model") == name and (not tau or r.get("tau") == float(tau))]
    return matches[0] if matches else None


def _validation_passed(result: bool | Mapping[str, Any] | None) -> tuple[bool, str]:
    """Accept a bool or a GX-like dict ({"success": bool} or {"passed": bool}, optional "failures")."""
    if isinstance(result, bool):
        return result, ""
    if isinstance(result, Mapping):
        ok = result.get("success", result.get("passed"))
        detail = result.get("failures") or result.get("reasons") or ""
        return bool(ok) if isinstance(ok, bool) else False, f" ({detail})" if detail else ""
    return False, " (no validation result given)"


def decide(
    rows: Sequence[Mapping[str, Any]],
    candidate: str,
    data_validation: bool | Mapping[str, Any] | None,
    production: Mapping[str, Any] | None,
    cfg: GateConfig,
    paired: Mapping[str, Any] | None = None,
) -> GateDecision:
    """Apply the gate rules to `candidate`'s report row. Every rule is evaluated (no short-circuit).

    `paired`: the production model and the candidate scored on the same (tonight's) test lists
    (components/_lib/champion.py `paired`): n_lists, candidate / production recall@1, delta, ci95, or error."""
    checks: dict[str, bool | None] = {}
    reasons: list[str] = []

    def record(rule: str, ok: bool | None, text: str) -> None:
        checks[rule] = ok
        reasons.append(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {rule}: {text}")

    ok, detail = _validation_passed(data_validation)
    record("data", ok, f"data validation {'passed' if ok else 'failed'}{detail}")

    row = find_row(rows, candidate)
    if row is None:
        record(
            "candidate",
            False,
            f"no report row for candidate {candidate!r} (models: {[r.get('model') for r in rows]})",
        )
        return GateDecision(passed=False, reasons=reasons, checks=checks)
    cand = float(row[METRIC])

    floor = find_row(rows, FLOOR_MODEL)
    if floor is None:
        record(
            "floor", False if cfg.require_beats_floor else None, f"no {FLOOR_MODEL!r} row to compare against"
        )
    else:
        f1 = float(floor[METRIC])
        beats = cand > f1
        ci = (row.get("delta_vs_floor") or {}).get(METRIC)
        if ci is not None and len(ci) == 2:
            lo, hi = float(ci[0]), float(ci[1])
            excl = lo > 0 or hi < 0
            ci_text = f"; paired 95% CI of the delta [{lo:+.4f}, {hi:+.4f}] {'excludes' if excl else 'includes'} zero"
        else:
            ci_text = "; no paired CI reported"
        text = f"{METRIC} {cand:.4f} vs floor {f1:.4f} (delta {cand - f1:+.4f}){ci_text}"
        if not cfg.require_beats_floor and not beats:
            text += " (not required by config)"
        record("floor", beats or (None if not cfg.require_beats_floor else False), text)

    ar = find_row(rows, AR_MODEL)
    if ar is None:
        record("ar_gap", None, f"no {AR_MODEL!r} row in the report")
    else:
        gap = float(ar[METRIC]) - cand
        record(
            "ar_gap",
            gap <= cfg.max_gap_to_ar + 1e-12,
            f"AR {METRIC} {float(ar[METRIC]):.4f} - candidate {cand:.4f} = {gap:+.4f} (max {cfg.max_gap_to_ar})",
        )

    ltr = find_row(rows, LTR_MODEL)
    if ltr is None:
        record("ltr", None, f"no {LTR_MODEL!r} row in the report")
    else:
        gap = float(ltr[METRIC]) - cand
        record(
            "ltr",
            gap <= cfg.max_gap_to_ltr + 1e-12,
            f"ltr (GBDT) {METRIC} {float(ltr[METRIC]):.4f} - candidate {cand:.4f} = {gap:+.4f} "
            f"(max {cfg.max_gap_to_ltr})",
        )

    validity = float(row.get("validity", 0.0))
    record("validity", validity >= cfg.min_validity, f"validity {validity:.4f} (min {cfg.min_validity})")

    speedup = row.get("speedup_vs_ar")
    if speedup is None:
        record("speedup", None, "row has no speedup_vs_ar")
    else:
        ci = row.get("speedup_ci95")  # timing noise: a point estimate alone passes or fails on a lucky repeat
        low = float(ci[0]) if ci else float(speedup)
        spread = f", 95% interval [{float(ci[0]):.2f}, {float(ci[1]):.2f}]" if ci else ", no interval"
        record(
            "speedup",
            low >= cfg.min_speedup,
            f"speedup {float(speedup):.2f}x{spread}: lower bound {low:.2f}x (min {cfg.min_speedup}x)",
        )

    if production is None:
        record("production", None, "no model in production")
    else:
        record("production", *_production_rule(production, paired, cfg.max_drop_vs_production))

    passed = all(v is not False for v in checks.values())
    return GateDecision(passed=passed, reasons=reasons, checks=checks)


def _production_rule(
    production: Mapping[str, Any], paired: Mapping[str, Any] | None, tol: float
) -> tuple[bool, str]:
    """Champion against challenger on the same lists; never the stored figure, which was measured on another
    night's lists (a lucky or unlucky old figure would decide with nothing about either model changed)."""
    who = f"{production.get('model', '?')}" + (
        f" (run {production['run_id']})" if production.get("run_id") else ""
    )
    stored = production.get(METRIC)
    history = (
        f"; stored figure {float(stored):.4f} (its own night's lists, for history)"
        if stored is not None
        else ""
    )
    if paired is None or paired.get("error") or paired.get("ci95") is None:
        why = (paired or {}).get("error") or "no paired comparison on tonight's lists was made"
        return False, f"production {who} could not be scored on tonight's lists: {why}{history}"
    lo, hi = (float(x) for x in paired["ci95"])
    below = hi < -tol
    return (
        not below,
        f"{METRIC} on tonight's {paired['n_lists']} test lists: candidate {float(paired['candidate']):.4f} vs "
        f"production {who} {float(paired['production']):.4f}, delta {float(paired['delta']):+.4f}, paired 95% CI "
        f"[{lo:+.4f}, {hi:+.4f}] {'wholly' if below else 'not wholly'} below -{tol}{history}",
    )


def paired_comparison(
    examples: pd.DataFrame,
    candidate_rankings: Sequence[Sequence[int]],
    production_rankings: Sequence[Sequence[int]],
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """The production rule's input: candidate and production scored on the same lists (rankings after the
    fallback, gr2.metrics.apply_fallback), and the paired bootstrap CI of the difference (as the floor's)."""
    from gr2.metrics import evaluate

    cand = evaluate(
        examples, candidate_rankings, floor_rankings=production_rankings, n_boot=n_boot, seed=seed
    )
    prod = evaluate(examples, production_rankings, n_boot=n_boot, seed=seed)
    return {
        "n_lists": len(examples),
        "candidate": cand[METRIC],
        "production": prod[METRIC],
        "delta": cand["delta_vs_floor_mean"][METRIC],
        "ci95": cand["delta_vs_floor"][METRIC],
    }


def read_report(path: str | Path) -> dict[str, Any]:
    """A report artifact is report.json itself or a folder holding it (the evaluate step writes a folder)."""
    p = Path(path)
    return json.loads((p / "report.json" if p.is_dir() else p).read_text())


def run_gate(
    report_path: str | Path,
    out_dir: str | Path,
    candidate: str,
    data_validation: bool | Mapping[str, Any] | None,
    profile: str = "quick",
    production: Mapping[str, Any] | None = None,
    paired: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Decide on a report file, then write decision.json, report.json (with `gate`) and gate.md into out_dir.
    `paired`: the champion-against-challenger comparison (see `decide`), also written to decision.json."""
    from gr2.config import load_profile

    report = read_report(report_path)
    prof = load_profile(profile)
    rows = [r for r in report["rows"] if r.get("model") == candidate]
    if (
        "@" not in candidate and len(rows) > 1
    ):  # a model decoded at several tau: its operating one (its bundle's,
        # which the report marks; a report written before the mark: the profile's eval_tau)
        tau = next((r["tau"] for r in rows if r.get("operating")), prof.diffusion.eval_tau)
        candidate = f"{candidate}@{tau}"
    decision = decide(report["rows"], candidate, data_validation, production, prof.gate, paired)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    row = find_row(report["rows"], candidate)
    result = {
        "candidate": candidate,
        f"candidate_{METRIC}": None if row is None else row[METRIC],
        **decision.to_dict(),
        "production": production,
        "paired": paired,
    }
    (out / "decision.json").write_text(json.dumps(result, indent=2) + "\n")
    report["gate"] = {"passed": decision.passed, "reasons": decision.reasons}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Gate: {'PASSED' if decision.passed else 'FAILED'} for `{candidate}`", ""]
    lines += [f"- {r}" for r in decision.reasons]
    (out / "gate.md").write_text("\n".join(lines) + "\n")
    return result
