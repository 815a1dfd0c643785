"""Automated canary analysis: after the deploy step started the canary (deploy/rollout.py, outcome "canary"),
move its traffic through the profile's steps (`canary.steps`, e.g. 10 -> 50 -> 100 %), compare the canary
revision with the stable one at every step, and decide alone: roll back at the first step that fails, or
promote after the last one (then, and only then, the production pointer is written).

One step:
    apply canaryTrafficPercent (server-side apply, field manager gr2) -> wait until ready
    -> send the probe set (recent requests) to both revisions' tag URLs -> let live traffic run step_seconds
    -> wait until Prometheus has scraped both revisions since -> query each revision over the step -> judge.

Judged, canary against stable (thresholds: the profile's `canary` section, gr2/config.py CanaryConfig):
- error rate (5xx / requests), p99 latency, validity and fallback rate, from the predictor's Prometheus metrics
  (serving/metrics.py) over the step;
- ranking agreement on the probes: the mean top-k overlap of the two revisions' rankings; a canary probe that
  fails, or answers something other than a permutation of its candidates, fails the step.
Without a stable revision (the very first rollout) the canary is judged against a perfect baseline.

Prometheus tells revisions apart by a label (`revision_label`; default serving_knative_dev_revision, the
Knative pod label serving.knative.dev/revision as Prometheus' kubernetes_sd relabeling names it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from deploy.rollout import (
    ISVC_KIND,
    KserveKube,
    Kube,
    Plan,
    promote,
    read_manifests,
    roll_back,
    set_traffic,
    wait_latest_ready,
)
from gr2.config import CanaryConfig

REVISION_LABEL = "serving_knative_dev_revision"
# The predictor's metric names (serving/metrics.py; not imported: this runs where kserve is not installed).
REQUESTS = "gr2_requests_total"
LATENCY_BUCKET = "gr2_request_latency_seconds_bucket"
RANKINGS = "gr2_rankings_total"
TOKENS_PER_FORWARD = "gr2_tokens_per_forward"
COUNTERS = (REQUESTS, LATENCY_BUCKET, RANKINGS, f"{TOKENS_PER_FORWARD}_sum", f"{TOKENS_PER_FORWARD}_count")
# A snapshot of counters: each series (its labels, __name__ included) -> its value.
Counters = dict[frozenset[tuple[str, str]], float]


@dataclass(frozen=True)
class Revision:
    name: str
    url: str


def revisions(isvc: dict[str, Any] | None) -> tuple[Revision | None, Revision | None]:
    """(stable, canary): the predictor's `prev` and `latest` tagged revisions in the InferenceService status."""
    traffic = ((isvc or {}).get("status") or {}).get("components", {}).get("predictor", {}).get("traffic", [])
    tagged = {t.get("tag"): Revision(t["revisionName"], t["url"]) for t in traffic if t.get("url")}
    return tagged.get("prev"), tagged.get("latest")


class PrometheusError(RuntimeError):
    """Prometheus could not be asked, or answered something unexpected."""


class Prometheus:
    """Instant queries against the Prometheus HTTP API (GET /api/v1/query)."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def result(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector of `promql` at time `at` (epoch seconds; None = now): [{"metric", "value"}]."""
        params = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        try:
            r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=self.timeout_s)
            r.raise_for_status()
            return r.json()["data"]["result"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise PrometheusError(f"{promql}: {e}") from e

    def query(self, promql: str, at: float | None = None) -> float | None:
        """The single value of `promql` (a sum or a quantile) at time `at`; None when there is no data (or NaN)."""
        result = self.result(promql, at)
        if not result:
            return None
        if len(result) != 1:
            raise PrometheusError(f"{promql}: expected one series, got {len(result)}")
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    def counters(self, selector: str) -> Counters:
        """The latest value of every series of the judged counters matching `selector`, now."""
        names = "|".join(COUNTERS)
        return {
            frozenset(r["metric"].items()): float(r["value"][1])
            for r in self.result(f'{{__name__=~"{names}",{selector}}}')
        }

    def scraped_since(self, selector: str, t: float, timeout_s: float, poll_s: float = 0.25) -> float | None:
        """Wait until every live target matching `selector` has been scraped successfully after time `t`
        (epoch seconds), and return the oldest of their latest scrape times (None on timeout). A failed scrape
        (up == 0) does not count: it brings no samples."""
        deadline = time.monotonic() + timeout_s
        while True:
            last = self.query(f"min(timestamp(up{{{selector}}}) and (up{{{selector}}} == 1))")
            if last is not None and last > t:
                return last
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)


def step_counts(before: Counters, after: Counters) -> Counters:
    """What each series counted between two snapshots: exact differences of the scraped samples, where
    Prometheus' increase() would extrapolate each series to the window's edges by its own factor (it stops a
    series at zero), so the buckets of one histogram disagree: a canary whose fast buckets started at 0 and
    whose slow ones did not once read a p99 of 29 s with no slow answer in the window. A series that went down
    restarted (its pod did): its whole value counts; one born since `before` counts from zero."""
    counts = {}
    for key, value in after.items():
        start = before.get(key, 0.0)
        counts[key] = value - start if value >= start else value
    return counts


def total(counts: Counters, name: str, **match: Callable[[str], bool]) -> float:
    """The sum of the series of metric `name` whose labels satisfy every predicate in `match`."""
    return sum(
        v
        for key, v in counts.items()
        if (labels := dict(key))["__name__"] == name and all(ok(labels.get(k, "")) for k, ok in match.items())
    )


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative counts {upper bound: count}: linear inside the bucket
    that holds rank q * total (the lowest bucket starts at 0); a rank in the +Inf bucket gives the highest
    finite bound. None without observations."""
    n = buckets.get(math.inf, 0.0)
    if n <= 0:
        return None
    rank, lower, below = q * n, 0.0, 0.0
    for bound in sorted(buckets):
        count = max(buckets[bound], below)
        if count >= rank:
            return lower if bound == math.inf else lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def revision_metrics(before: Counters, after: Counters) -> dict[str, float | None]:
    """One revision's request count, error rate, p99 latency, validity, fallback rate and tokens per forward
    between two snapshots of its counters (None where it served nothing to measure)."""
    counts = step_counts(before, after)
    requests = total(counts, REQUESTS)
    errors = total(counts, REQUESTS, status=lambda s: s.startswith("5"))
    rankings = total(counts, RANKINGS)
    valid = total(counts, RANKINGS, outcome=lambda o: o == "valid")
    fallback = total(counts, RANKINGS, outcome=lambda o: o == "fallback")
    tokens, forwards = (
        total(counts, f"{TOKENS_PER_FORWARD}_sum"),
        total(counts, f"{TOKENS_PER_FORWARD}_count"),
    )
    buckets: dict[float, float] = {}
    for key, v in counts.items():
        labels = dict(key)
        if labels["__name__"] == LATENCY_BUCKET:
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + v
    return {
        "requests": requests,
        "error_rate": errors / requests if requests else None,
        "p99_latency_s": histogram_quantile(0.99, buckets),
        "validity": valid / rankings if rankings else None,
        "fallback_rate": fallback / rankings if rankings else None,
        "tokens_per_forward": tokens / forwards if forwards else None,  # reported, not judged
    }


def ranking_problem(instance: dict[str, Any], answer: dict[str, Any]) -> str | None:
    """Why an answer's ranking is unusable, or None."""
    ranking = answer.get("ranking")
    if not isinstance(ranking, list) or sorted(ranking) != sorted(instance["candidates"]):
        return f"ranking {ranking} is not a permutation of the candidates"
    return None


def probe(url: str, model_name: str, instances: list[dict[str, Any]]) -> list[list[str] | str]:
    """Each probe's ranking from one revision, or why there is none (an HTTP error, an unusable ranking)."""
    out: list[list[str] | str] = []
    for inst in instances:
        try:  # a connection per probe: a kept-alive one the server is closing would fail the probe
            r = httpx.post(
                f"{url.rstrip('/')}/v1/models/{model_name}:predict", json={"instances": [inst]}, timeout=60
            )
        except httpx.HTTPError as e:
            out.append(f"request failed: {e}")
            continue
        if r.status_code != 200:
            out.append(f"HTTP {r.status_code}")
            continue
        try:
            answer = r.json()["predictions"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            out.append(f"unreadable answer: {r.text[:200]}")
            continue
        out.append(ranking_problem(inst, answer) or answer["ranking"])
    return out


def agreement(stable: list[list[str] | str] | None, canary: list[list[str] | str], k: int) -> float | None:
    """Mean top-k overlap of the rankings both revisions gave (None without a stable revision or any pair)."""
    if stable is None:
        return None
    pairs = [
        (s, c) for s, c in zip(stable, canary, strict=True) if isinstance(s, list) and isinstance(c, list)
    ]
    if not pairs:
        return None
    return sum(len(set(s[:k]) & set(c[:k])) / min(k, len(c)) for s, c in pairs) / len(pairs)


def probe_failures(stable: list[list[str] | str] | None, canary: list[list[str] | str]) -> list[str]:
    """Probes the canary failed although the stable revision answered them (all of them without a stable)."""
    bad = [
        f"probe {i}: {c}"
        for i, c in enumerate(canary)
        if isinstance(c, str) and (stable is None or isinstance(stable[i], list))
    ]
    return [f"{len(bad)} of {len(canary)} probes failed on the canary ({bad[0]})"] if bad else []


def judge(
    stable: dict[str, float | None] | None,
    canary: dict[str, float | None],
    agree: float | None,
    cfg: CanaryConfig,
) -> list[str]:
    """Every threshold the canary breaks at this step (empty = the step passes)."""
    if (canary["requests"] or 0) < cfg.min_requests:
        return [
            f"the canary received {canary['requests'] or 0:.0f} requests (< min_requests {cfg.min_requests})"
        ]
    # no stable revision or no stable data: a perfect baseline
    base: dict[str, float] = {"error_rate": 0.0, "validity": 1.0, "fallback_rate": 0.0}
    base.update({k: v for k, v in (stable or {}).items() if v is not None})
    fails = []
    # error_rate is None only when the canary received no request (possible with min_requests 0): nothing to compare
    error_rate = canary["error_rate"]
    if error_rate is not None and error_rate > base["error_rate"] + cfg.max_error_rate_increase:
        fails.append(
            f"error rate {error_rate:.3f} > stable {base['error_rate']:.3f} + {cfg.max_error_rate_increase}"
        )
    p99, stable_p99 = canary["p99_latency_s"], base.get("p99_latency_s")
    bound = None if stable_p99 is None else stable_p99 * cfg.max_p99_ratio + cfg.p99_slack_s
    if p99 is None:
        fails.append("no answered request to measure the canary's latency")
    elif bound is not None and p99 > bound:
        fails.append(
            f"p99 latency {p99:.3f}s > stable {stable_p99:.3f}s * {cfg.max_p99_ratio} + {cfg.p99_slack_s}s"
        )
    validity, fallback_rate = canary["validity"], canary["fallback_rate"]
    if validity is None or fallback_rate is None:  # both are None exactly when there were no rankings
        fails.append("no rankings to measure the canary's validity")
    else:
        if validity < base["validity"] - cfg.max_validity_drop:
            fails.append(f"validity {validity:.3f} < stable {base['validity']:.3f} - {cfg.max_validity_drop}")
        if fallback_rate > base["fallback_rate"] + cfg.max_fallback_increase:
            fails.append(
                f"fallback rate {fallback_rate:.3f} > stable {base['fallback_rate']:.3f} + {cfg.max_fallback_increase}"
            )
    if agree is not None and agree < cfg.min_agreement:
        fails.append(f"ranking agreement {agree:.3f} < {cfg.min_agreement} (top-{cfg.agreement_k} overlap)")
    return fails


def check_steps(steps: tuple[int, ...]) -> None:
    if not steps or list(steps) != sorted(set(steps)) or not 0 < steps[0] or steps[-1] > 100:
        raise ValueError(f"canary.steps must increase within (0, 100], got {list(steps)}")


def analyze(
    plan_dir: str | Path,
    out_dir: str | Path,
    store: Any,
    cfg: CanaryConfig,
    prometheus_url: str,
    probes: list[dict[str, Any]],
    kube: Kube | None = None,
    model_name: str | None = None,
    revision_label: str = REVISION_LABEL,
    scrape_interval_s: float = 30.0,
    wait: Callable[[float], None] = time.sleep,
    wait_timeout_s: float = 600.0,
    poll_s: float = 5.0,
) -> dict[str, Any]:
    """Run the steps of the canary the deploy step left running (its plan folder: plan.json + canary.yaml);
    promote or roll back. Writes analysis.json, analysis.md and the updated plan.json to `out_dir` and returns
    the report ({"outcome": "promoted" | "rolled-back", "steps": [...]}).

    `wait(step_seconds)` is where live traffic runs (time.sleep on a cluster). `scrape_interval_s` is
    Prometheus' scrape interval (it bounds the waits for a scrape)."""
    check_steps(cfg.steps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = Plan.read(plan_dir)
    isvc = next(d for d in read_manifests(plan_dir) if d["kind"] == ISVC_KIND)
    name, ns = plan.target["name"], plan.target["namespace"]
    kube = kube or KserveKube()
    prom = Prometheus(prometheus_url)
    steps: list[dict[str, Any]] = []

    def finish(outcome: str, pointer: dict[str, Any] | None = None) -> dict[str, Any]:
        report = {
            "outcome": outcome,
            "target": plan.target,
            "run_id": plan.run_id,
            "pointer": pointer,
            "steps": steps,
        }
        (out / "analysis.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "analysis.md").write_text(to_markdown(report))
        plan.write(out)
        return report

    for pct in cfg.steps:
        t0 = time.time()
        set_traffic(kube, isvc, pct)
        plan.log("traffic", canary_percent=pct)
        ready, _ = wait_latest_ready(kube, name, ns, wait_timeout_s, poll_s)
        stable, canary = revisions(kube.get(name, ns))
        step: dict[str, Any] = {
            "canary_percent": pct,
            "stable": stable and stable.name,
            "canary": canary and canary.name,
        }
        steps.append(step)
        if not ready or canary is None:
            step["failures"] = [f"the canary revision is not ready at {pct}%"]
            roll_back(kube, isvc, plan, step["failures"][0])
            return finish("rolled-back")
        selectors = {
            k: f'{revision_label}="{r.name}"' for k, r in (("stable", stable), ("canary", canary)) if r
        }
        timeout_s = 3 * scrape_interval_s + 30
        try:
            # Each revision's counters once Prometheus has scraped all its pods after the step began (none of
            # them can predate the step), and again once it has scraped them after the step's traffic: the step
            # is their difference.
            base = {k: prom.scraped_since(sel, t0, timeout_s) for k, sel in selectors.items()}
            before = {k: prom.counters(sel) for k, sel in selectors.items()}
            stable_answers = probe(stable.url, model_name or name, probes) if stable else None
            canary_answers = probe(canary.url, model_name or name, probes)
            wait(cfg.step_seconds)
            t_end = time.time()
            end = {k: prom.scraped_since(sel, t_end, timeout_s) for k, sel in selectors.items()}
            unscraped = {k for k in selectors if base[k] is None or end[k] is None}
            measured = {k: revision_metrics(before[k], prom.counters(sel)) for k, sel in selectors.items()}
        except PrometheusError as e:
            step["failures"] = [f"Prometheus query failed: {e}"]
        else:
            agree = agreement(stable_answers, canary_answers, cfg.agreement_k)
            step.update(metrics=measured, agreement=agree)
            step["failures"] = [
                f"Prometheus did not scrape the {k} revision during the step" for k in sorted(unscraped)
            ]
            step["failures"] += probe_failures(stable_answers, canary_answers)
            step["failures"] += judge(measured.get("stable"), measured["canary"], agree, cfg)
        if step["failures"]:
            roll_back(kube, isvc, plan, "; ".join(step["failures"]))
            return finish("rolled-back")
    return finish("promoted", promote(kube, isvc, store, plan))


def to_markdown(report: dict[str, Any]) -> str:
    """The analysis as a table per step, for the KFP UI."""
    lines = [f"# Canary analysis: {report['outcome'].upper()}", ""]
    keys = ["requests", "error_rate", "p99_latency_s", "validity", "fallback_rate", "tokens_per_forward"]
    for s in report["steps"]:
        lines += [f"## {s['canary_percent']}% to {s['canary']} (stable {s['stable']})", ""]
        metrics = s.get("metrics") or {}
        if metrics:
            lines += ["| revision | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
            for rev, m in metrics.items():
                cells = ["-" if m[k] is None else f"{m[k]:.4g}" for k in keys]
                lines.append(f"| {rev} | " + " | ".join(cells) + " |")
            lines.append(f"\nranking agreement: {s.get('agreement')}")
        lines += [f"- FAILED: {f}" for f in s.get("failures", [])] or ["- passed"]
        lines.append("")
    return "\n".join(lines)


def probe_set(examples: str | Path, n: int) -> list[dict[str, Any]]:
    """The probes: the `n` newest requests we know of, the test lists of the run's examples table (each user's
    latest interaction) with their history, as the predictor receives them behind the transformer."""
    import pandas as pd

    df = pd.read_parquet(examples, columns=["user_id", "candidates", "history", "split"])
    df = df[df["split"] == "test"].head(n)
    return [
        {
            "user_id": str(r.user_id),
            "candidates": [str(c) for c in r.candidates],
            "history": [str(h) for h in r.history],
        }
        for r in df.itertuples()
    ]
