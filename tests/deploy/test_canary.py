"""Automated canary analysis (deploy/canary.py) against a REAL Prometheus (Debian's `prometheus`, started here
on 127.0.0.1 with a temporary config) scraping two real predictor revisions on 127.0.0.1, stable and canary
(tests/deploy/canary_server.py, both serving the floor model: `floor_dir` says why; the canary's fault is switched
per scenario), with the fake Kubernetes API
(tests/deploy/fake_kube.py) playing KServe. A healthy canary walks 10 -> 50 -> 100 % and is promoted, the production pointer written; a
canary that errors, is slow or gives invalid rankings is rolled back at the first step, the pointer left alone.

The faults are deterministic and far from the thresholds (every request fails; 11 s per call, whose p99 falls in
the (10 s, 30 s] bucket, against a bound of stable p99 x 2 + 10 s, so a healthy answer delayed by a busy machine
is not "slow" (one once took 2.5-5 s in CI); every ranking invalid), and nothing is timed: the analysis waits
until Prometheus has scraped both revisions before and after each step's traffic and judges the exact difference
of the two snapshots, so one scenario's requests stay out of the next one's step (test_a_step_counts_...).
"""

from __future__ import annotations

import shutil
import sys
import time

import httpx
import pandas as pd
import pytest
import yaml
from kubernetes import client
from kubernetes.config import kube_config

from components.artifact_store import ArtifactStore, LocalBackend
from deploy.canary import (
    LATENCY_BUCKET,
    REQUESTS,
    REVISION_LABEL,
    agreement,
    analyze,
    check_steps,
    histogram_quantile,
    judge,
    probe_failures,
    probe_set,
    revision_metrics,
)
from deploy.rollout import FIELD_MANAGER, KserveKube, rollout
from gr2.config import CanaryConfig
from gr2.inference import FloorReranker
from serving.serve_local import start_server, stop
from tests.deploy.fake_kube import APPLY, FakeApi
from tests.serving.support import MODEL, ROOT

OVERLAY = ROOT / "manifests" / "overlays" / "prod"
SCRAPE_S = 1.0
STABLE, CANARY = "gr2-reranker-predictor-00001", "gr2-reranker-predictor-00002"
CFG = CanaryConfig(
    steps=(10, 50, 100), step_seconds=0, probe_size=3, min_requests=3, max_p99_ratio=2.0, p99_slack_s=10.0
)
TRAFFIC = 20  # live requests per step, split between the revisions as the canary percentage says


@pytest.fixture(scope="module")
def floor_dir(ml_slice, tmp_path_factory):
    """The model both revisions serve: the floor, whose answers take no time. The analysis compares the two
    revisions' latency percentiles, so a model that decodes (its time varies with the machine's load) would make
    the healthy canary fail or the slow one pass by chance; what a real model serves is the other serving
    tests' subject (tests/serving/toy_model.py)."""
    return FloorReranker(name="floor", n_candidates=10, items=ml_slice["items"]["item_id"]).save(
        tmp_path_factory.mktemp("floor")
    )


@pytest.fixture(scope="module")
def revisions(floor_dir, tmp_path_factory):
    """stable and canary: two canary_server revisions of the floor model; the scenario writes the canary's
    fault into its fault file (the stable one's stays "none")."""
    tmp = tmp_path_factory.mktemp("canary")
    procs, urls, faults = [], [], []
    try:
        for rev in ("stable", "canary"):
            fault_file = tmp / f"{rev}.fault"
            fault_file.write_text("none")
            proc, port = start_server(
                lambda port, fault_file=fault_file: (
                    [sys.executable, "-m", "tests.deploy.canary_server", "--model_dir", str(floor_dir)]
                    + ["--port", str(port), "--fault_file", str(fault_file)]
                ),
                lambda port: f"http://127.0.0.1:{port}/v1/models/{MODEL}",
                tmp / f"{rev}.log",
                cwd=ROOT,
            )
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
            faults.append(fault_file)
        yield {"stable": (STABLE, urls[0]), "canary": (CANARY, urls[1]), "fault_file": faults[1]}
    finally:
        for proc in procs:
            stop(proc)


@pytest.fixture(scope="module")
def prometheus(revisions, tmp_path_factory):
    """The real Prometheus server, scraping every revision each second, its revision label set per target."""
    binary = shutil.which("prometheus")
    assert binary, (
        "the prometheus server is not installed: `make setup-test` installs it (scripts/setup-system.sh)"
    )
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = [
        {"targets": [url.removeprefix("http://")], "labels": {REVISION_LABEL: rev}}
        for rev, url in (revisions["stable"], revisions["canary"])
    ]
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": f"{SCRAPE_S:g}s"},
        "scrape_configs": [{"job_name": "gr2", "static_configs": targets}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc, port = start_server(
        lambda port: [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        lambda port: f"http://127.0.0.1:{port}/-/ready",
        tmp / "prometheus.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # every target scraped and up at least once
        while time.monotonic() < deadline:
            r = httpx.get(f"{url}/api/v1/query", params={"query": "count(up == 1)"}).json()["data"]["result"]
            if r and int(r[0]["value"][1]) == len(targets):
                break
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def examples(ml_slice, tmp_path_factory):
    """An examples table (docs/CONTRACTS.md) whose test lists are the probes."""
    items = list(ml_slice["items"]["item_id"])
    rows = [
        {"user_id": u, "split": split, "candidates": items[5 * i : 5 * i + 5], "history": h[-5:]}
        for i, (u, h) in enumerate(list(ml_slice["history"].items())[:8])
        for split in ("train", "test")
    ]
    path = tmp_path_factory.mktemp("examples") / "examples.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def kube_for(api: FakeApi) -> KserveKube:
    cfg = client.Configuration()
    cfg.host = api.url
    return KserveKube(api_client=client.ApiClient(cfg))


def start_canary(api, model_dir, tmp_path) -> ArtifactStore:
    """What the deploy step leaves: model "new" uploaded, every object applied, the canary at 10 %; model
    "old" in production."""
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    store.upload("old", "model", model_dir)
    store.promote("old", "model", {"model": "floor"})
    plan = rollout(
        model_dir,
        "new",
        "model",
        {"model": "floor", "recall@1": 0.3},
        store,
        OVERLAY,
        tmp_path / "plan",
        {},
        dry_run=False,
        kube=kube_for(api),
        poll_s=0,
        smoke=lambda url, name, inst: (True, "not under test here"),
    )
    assert plan.outcome == "canary"
    return store


def run(fault, revisions, prometheus, examples, model_dir, tmp_path):
    revisions["fault_file"].write_text(fault)
    api = FakeApi(traffic={"prev": revisions["stable"], "latest": revisions["canary"]})
    store = start_canary(api, model_dir, tmp_path)
    stable_url, canary_url = revisions["stable"][1], revisions["canary"][1]
    probes = probe_set(examples, CFG.probe_size)
    live = probes[:1] * TRAFFIC

    def traffic(seconds):
        """Live traffic during the step, routed as the InferenceService's canary percentage says."""
        pct = api.isvc()["spec"]["predictor"]["canaryTrafficPercent"]
        n_canary = round(TRAFFIC * pct / 100)
        for i, inst in enumerate(live):  # answers not checked: the analysis judges them
            url = canary_url if i < n_canary else stable_url
            httpx.post(f"{url}/v1/models/{MODEL}:predict", json={"instances": [inst]}, timeout=60)

    report = analyze(
        tmp_path / "plan",
        tmp_path / "analysis",
        store,
        CFG,
        prometheus,
        probes,
        kube=kube_for(api),
        model_name=MODEL,
        scrape_interval_s=SCRAPE_S,
        wait=traffic,
        poll_s=0,
    )
    api.close()
    return report, api, store


def test_a_healthy_canary_is_promoted(revisions, prometheus, examples, floor_dir, tmp_path):
    report, api, store = run("none", revisions, prometheus, examples, floor_dir, tmp_path)
    assert report["outcome"] == "promoted", report
    assert [s["canary_percent"] for s in report["steps"]] == [10, 50, 100]
    for s in report["steps"]:
        assert s["failures"] == [] and s["agreement"] == 1.0, s
        c = s["metrics"]["canary"]
        assert c["requests"] >= CFG.min_requests and c["error_rate"] == 0 and c["validity"] == 1
        assert c["fallback_rate"] == 0 and c["tokens_per_forward"] == pytest.approx(4.0)
        assert s["metrics"]["stable"]["requests"] >= CFG.probe_size
    # traffic moved by server-side apply (gr2), then promote removed the canary field
    isvc_applies = [
        r.body for r in api.requests if r.content_type == APPLY and r.body["kind"] == "InferenceService"
    ]
    assert [b["spec"]["predictor"].get("canaryTrafficPercent") for b in isvc_applies] == [
        10,
        10,
        50,
        100,
        None,
    ]
    assert {r.query["fieldManager"] for r in api.requests if r.content_type == APPLY} == {FIELD_MANAGER}
    assert "canaryTrafficPercent" not in api.isvc()["spec"]["predictor"]
    assert store.production()["run_id"] == "new" and report["pointer"]["run_id"] == "new"
    assert "PROMOTED" in (tmp_path / "analysis" / "analysis.md").read_text()


@pytest.mark.parametrize(
    "fault,expected",
    [("error", ["error rate"]), ("slow", ["p99 latency"]), ("invalid", ["validity", "fallback rate"])],
)
def test_a_faulty_canary_is_rolled_back(
    fault, expected, revisions, prometheus, examples, floor_dir, tmp_path
):
    report, api, store = run(fault, revisions, prometheus, examples, floor_dir, tmp_path)
    assert report["outcome"] == "rolled-back", report
    (step,) = report["steps"]  # decided at the first step, 10 %
    assert step["canary_percent"] == 10
    for word in expected:
        assert any(f.startswith(word) for f in step["failures"]), step["failures"]
    if fault != "error":  # the canary answered: only the injected fault is blamed
        assert len(step["failures"]) == len(expected), step["failures"]
    assert api.isvc()["spec"]["predictor"]["canaryTrafficPercent"] == 0  # all traffic back to stable
    assert store.production()["run_id"] == "old" and report["pointer"] is None


def test_the_component_decides_and_reports(revisions, prometheus, examples, floor_dir, tmp_path, monkeypatch):
    """components/canary_analysis.py's body, called as KFP's executor calls it (the function with artifacts),
    reaching the fake API through a kubeconfig and reading its thresholds from a profile file: an erroring
    canary is rolled back by the component too, and the pointer left alone."""
    from kfp import dsl

    from components.canary_analysis import canary_analysis

    revisions["fault_file"].write_text("error")
    api = FakeApi(traffic={"prev": revisions["stable"], "latest": revisions["canary"]})
    store = start_canary(api, floor_dir, tmp_path)
    (tmp_path / "kubeconfig").write_text(api.kubeconfig())
    # the client reads $KUBECONFIG once, at import: point its default at the file
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: use the kubeconfig
    canary = {k: list(v) if isinstance(v, tuple) else v for k, v in CFG.__dict__.items()}
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump({"canary": canary}))
    analysis, summary = (
        dsl.Artifact(uri=str(tmp_path / "analysis")),
        dsl.Markdown(uri=str(tmp_path / "summary.md")),
    )
    outcome = canary_analysis.python_func(
        plan=dsl.Artifact(uri=str(tmp_path / "plan")),
        examples=dsl.Dataset(uri=str(examples)),
        analysis=analysis,
        summary=summary,
        profile=str(tmp_path / "profile.yaml"),
        prometheus_url=prometheus,
        scrape_interval_s=SCRAPE_S,
        model_name=MODEL,
        store_local_root=str(tmp_path / "store"),
    )
    api.close()
    assert outcome == "rolled-back" and analysis.metadata["outcome"] == "rolled-back"
    assert "ROLLED-BACK" in (tmp_path / "summary.md").read_text()
    assert "error rate" in (tmp_path / "summary.md").read_text()
    assert api.isvc()["spec"]["predictor"]["canaryTrafficPercent"] == 0
    assert store.production()["run_id"] == "old"


# --- the decision rules, without servers ------------------------------------------------------------------

OK = {"requests": 100.0, "error_rate": 0.0, "p99_latency_s": 0.05, "validity": 1.0, "fallback_rate": 0.0}


def test_judge_rules():
    assert judge(OK, OK, 1.0, CFG) == []
    assert judge(None, OK, None, CFG) == []  # the first rollout: judged against a perfect baseline
    assert judge(OK, {**OK, "requests": 2.0}, 1.0, CFG)[0].startswith("the canary received 2 requests")
    assert judge(OK, OK, 0.2, CFG)[0].startswith("ranking agreement 0.200")
    bad = {
        "requests": 50.0,
        "error_rate": 1.0,
        "p99_latency_s": None,
        "validity": None,
        "fallback_rate": None,
    }
    assert [f.split(" ")[0] for f in judge(OK, bad, None, CFG)] == ["error", "no", "no"]


def test_agreement_and_probe_failures():
    a, b = ["1", "2", "3", "4"], ["4", "3", "2", "1"]
    assert agreement([a, a], [a, b], 3) == pytest.approx((1 + 2 / 3) / 2)
    assert agreement(None, [a], 3) is None and agreement(["HTTP 500"], [a], 3) is None
    assert (
        probe_failures([a, "HTTP 400"], [a, "HTTP 500"]) == []
    )  # a probe the stable fails too is no evidence
    (msg,) = probe_failures([a, a], [a, "ranking ['9'] is not a permutation of the candidates"])
    assert msg.startswith("1 of 2 probes failed on the canary (probe 1: ranking")
    for bad in [(), (50, 10), (0, 100), (10, 101), (10, 10, 100)]:
        with pytest.raises(ValueError, match="canary.steps"):
            check_steps(bad)
    check_steps((5, 25, 100))


def test_probe_set_takes_the_test_lists_with_history(examples):
    probes = probe_set(examples, 3)
    assert len(probes) == 3 and all(set(p) == {"user_id", "candidates", "history"} for p in probes)
    rows = pd.read_parquet(examples)
    first = rows[rows["split"] == "test"].iloc[0]
    assert probes[0]["candidates"] == list(first["candidates"]) and probes[0]["history"] == list(
        first["history"]
    )


def series(name: str, value: float, **labels: str) -> tuple[frozenset[tuple[str, str]], float]:
    return frozenset({"__name__": name, "instance": "pod-a", **labels}.items()), value


def test_a_step_counts_only_what_happened_between_its_snapshots():
    """The case that once failed the invalid scenario (1 run in 4): a canary whose only answers so far were 5
    slow ones (11 s: the (10, 30] bucket) answers 5 fast ones in the step. Prometheus' increase() extrapolated
    the fast buckets (starting at 0) less than the slow ones and read a p99 of 29 s; the step's p99 is fast."""
    bounds = ("0.005", "0.01", "10", "30", "+Inf")
    before = dict(series(LATENCY_BUCKET, 0.0 if b in ("0.005", "0.01", "10") else 5.0, le=b) for b in bounds)
    before |= dict([series(REQUESTS, 5.0, status="200")])
    after = dict(series(LATENCY_BUCKET, 5.0 if b in ("0.005", "0.01", "10") else 10.0, le=b) for b in bounds)
    after |= dict([series(REQUESTS, 10.0, status="200"), series(REQUESTS, 2.0, status="500")])
    m = revision_metrics(before, after)
    assert m["requests"] == 7 and m["error_rate"] == pytest.approx(2 / 7)
    assert m["p99_latency_s"] == pytest.approx(0.005 * 0.99)
    assert m["validity"] is None and m["tokens_per_forward"] is None  # nothing ranked in the step
    # a pod that restarted (its counter went down) counts its whole value; a new pod counts from zero
    restarted = dict(
        [series(REQUESTS, 3.0, status="200"), series(REQUESTS, 4.0, status="200", instance="pod-b")]
    )
    assert revision_metrics(dict([series(REQUESTS, 9.0, status="200")]), restarted)["requests"] == 7


def test_histogram_quantile_is_prometheus_rule():
    inf = float("inf")
    assert histogram_quantile(0.5, {1.0: 2.0, 2.0: 4.0, inf: 4.0}) == pytest.approx(1.0)
    assert histogram_quantile(0.99, {1.0: 0.0, 10.0: 1.0, 30.0: 3.0, inf: 3.0}) == pytest.approx(
        10 + 20 * 1.97 / 2
    )
    assert histogram_quantile(0.99, {1.0: 0.0, inf: 2.0}) == 1.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.99, {1.0: 0.0, inf: 0.0}) is None
