"""`gr2 pipeline upload|run|schedule` through the real kfp.Client against a fake KFP v2beta1 REST API served
over HTTP on 127.0.0.1, which records every request. (No Kubeflow cluster was available here; the fake
implements only the endpoints these commands use, with the JSON shapes of kfp_server_api 2.17.3.)"""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from typer.testing import CliRunner

from pipelines import ops
from pipelines.cli import app
from pipelines.pipeline import PIPELINE_NAME, compile_pipeline

API = "/apis/v2beta1"


class FakeKFP:
    """In-memory pipelines / versions / experiments / runs / recurring runs; `requests` holds every call."""

    def __init__(self):
        self.requests: list[dict] = []
        self.pipelines: list[dict] = []
        self.versions: dict[str, list[dict]] = {}
        self.experiments: list[dict] = []
        self.runs: list[dict] = []
        self.recurring: list[dict] = []

    def calls(self, method: str, path: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and r["path"] == path]

    @staticmethod
    def _filtered(items: list[dict], query: dict) -> list[dict]:
        if "filter" not in query:
            return items
        for p in json.loads(query["filter"])["predicates"]:
            assert p["operation"] in ("EQUALS", 1), p  # kfp.Client sends the enum number, ops.py the name
            items = [i for i in items if i.get(p["key"]) == p["stringValue"]]
        return items

    def handle(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        parts = path[len(API) :].strip("/").split("/")
        if path == f"{API}/healthz":
            return 200, {"multi_user": False}
        if parts[0] == "pipelines":
            if method == "GET" and len(parts) == 1:
                mine = [p for p in self.pipelines if p.get("namespace") == query.get("namespace")]
                return 200, {"pipelines": self._filtered(mine, query)}
            if method == "POST" and len(parts) == 1:
                p = {"pipeline_id": uuid.uuid4().hex, "display_name": body["display_name"]}
                p |= {"namespace": body["namespace"]} if body.get("namespace") else {}
                self.pipelines.append(p)
                self.versions[p["pipeline_id"]] = []
                return 200, p
            if method == "POST" and parts[1:] == ["upload_version"]:
                pid = query["pipelineid"]
                if any(v["display_name"] == query["name"] for v in self.versions[pid]):
                    return 409, {"error": "version name already exists"}
                v = {
                    "pipeline_id": pid,
                    "pipeline_version_id": uuid.uuid4().hex,
                    "display_name": query["name"],
                }
                self.versions[pid].append(v)
                return 200, v
            if method == "GET" and len(parts) == 3 and parts[2] == "versions":
                assert query.get("sort_by") == "created_at desc"
                newest_first = self._filtered(self.versions[parts[1]], query)[::-1]
                return 200, {"pipeline_versions": newest_first[: int(query.get("page_size", 10))]}
            if method == "GET" and len(parts) == 4:
                found = [v for v in self.versions[parts[1]] if v["pipeline_version_id"] == parts[3]]
                return (200, found[0]) if found else (404, {"error": "not found"})
        if parts[0] == "experiments":
            if method == "GET":
                return 200, {"experiments": self._filtered(self.experiments, query)}
            e = {"experiment_id": uuid.uuid4().hex, "display_name": body["display_name"]}
            self.experiments.append(e)
            return 200, e
        if parts[0] == "runs" and method == "POST":
            self.runs.append(body | {"run_id": uuid.uuid4().hex})
            return 200, self.runs[-1]
        if parts[0] == "recurringruns":
            if method == "GET":
                mine = [r for r in self.recurring if r["experiment_id"] == query.get("experiment_id")]
                return 200, {"recurringRuns": self._filtered(mine, query)}  # camelCase in v2beta1
            if method == "POST":
                self.recurring.append(body | {"recurring_run_id": uuid.uuid4().hex})
                return 200, self.recurring[-1]
            if method == "DELETE":
                self.recurring = [r for r in self.recurring if r["recurring_run_id"] != parts[1]]
                return 200, {}
        return 404, {"error": f"fake KFP: no route {method} {path}"}


def _handler(fake: FakeKFP):
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str):
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            ctype = self.headers.get("Content-Type", "")
            body, files = None, {}
            if ctype.startswith("multipart/form-data"):
                msg = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {ctype}\r\n\r\n".encode() + raw)
                for part in msg.iter_parts():
                    files[part.get_param("name", header="content-disposition")] = part.get_payload(
                        decode=True
                    )
            elif raw:
                body = json.loads(raw)
            fake.requests.append(
                {
                    "method": method,
                    "path": url.path,
                    "query": query,
                    "body": body,
                    "files": files,
                    "auth": self.headers.get("Authorization"),
                }
            )
            try:
                status, out = fake.handle(method, url.path, query, body)
            except (
                Exception
            ) as e:  # an unexpected request: answer, so the client reports it instead of retrying
                status, out = 500, {"error": repr(e)}
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def do_DELETE(self):
            self._serve("DELETE")

        def log_message(self, *args):  # quiet test output
            pass

    return Handler


@pytest.fixture
def kfp_api(monkeypatch, tmp_path):
    """(fake, url): a fake KFP API on a free loopback port; no ~/.config/kfp context is read."""
    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "no-context.json"))
    fake = FakeKFP()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return compile_pipeline(str(tmp_path_factory.mktemp("pkg") / "pipeline.yaml"))


def _cli(args: list[str], url: str, **env):
    return CliRunner().invoke(app, args, env={"KFP_HOST": url, "GR2_GIT_SHA": "abc1234", **env})


def test_version_name_and_cron_rules(monkeypatch):
    when = dt.datetime(2026, 11, 29, 2, 0, 5, tzinfo=dt.UTC)
    assert ops.version_name("abc1234", when) == "2026-11-29-020005-abc1234"
    monkeypatch.setenv("GR2_GIT_SHA", "deadbee")
    assert ops.git_sha() == "deadbee"
    assert ops.check_cron(" 0 0 2 * * * ") == "0 0 2 * * *"
    with pytest.raises(ops.OpsError, match="6, seconds first"):
        ops.check_cron("0 2 * * *")  # a crontab line: would be read as "minute 0 of every hour 2-seconds"
    with pytest.raises(ops.OpsError, match="unknown pipeline parameter"):
        ops.run_params({"datset": "ml-100k"})
    assert ops.parse_params(["max_users=40", "dataset=ml-100k", 'bounds_json={"a": 1}']) == {
        "max_users": 40,
        "dataset": "ml-100k",
        "bounds_json": '{"a": 1}',
    }
    monkeypatch.delenv("KFP_HOST", raising=False)
    with pytest.raises(ops.OpsError, match="KFP_HOST"):
        ops.Endpoint.resolve()


def test_upload_creates_the_pipeline_once_and_names_versions_by_sha(kfp_api, package):
    fake, url = kfp_api
    r1 = _cli(["pipeline", "upload", "--package", package], url, KFP_TOKEN="s3cret")
    assert r1.exit_code == 0, r1.output
    first = json.loads(r1.output[r1.output.index("{") :])
    assert first["created_pipeline"] is True and first["name"].endswith("-abc1234")
    # First upload: an empty pipeline, then the sha version; never /pipelines/upload (its auto version, #5881).
    [create] = fake.calls("POST", f"{API}/pipelines")
    assert create["body"]["display_name"] == PIPELINE_NAME
    assert not fake.calls("POST", f"{API}/pipelines/upload")
    [up] = fake.calls("POST", f"{API}/pipelines/upload_version")
    assert up["query"]["name"] == first["name"] and up["query"]["pipelineid"] == first["pipeline_id"]
    assert "git abc1234" in up["query"]["description"]
    assert all(r["auth"] == "Bearer s3cret" for r in fake.requests)
    # The uploaded file is the compiled pipeline, both YAML documents (platform spec = GPU pool settings).
    docs = [d for d in yaml.safe_load_all(up["files"]["uploadfile"]) if d]
    assert docs[0]["pipelineInfo"]["name"] == PIPELINE_NAME and "platforms" in docs[1]

    r2 = _cli(["pipeline", "upload", "--package", package, "--version", "2026-11-30-020000-abc1234"], url)
    assert r2.exit_code == 0, r2.output
    assert len(fake.calls("POST", f"{API}/pipelines")) == 1  # the pipeline is not created again
    [versions] = fake.versions.values()
    assert [v["display_name"] for v in versions] == [first["name"], "2026-11-30-020000-abc1234"]


def test_run_sends_parameters_to_the_newest_version(kfp_api, package):
    fake, url = kfp_api
    assert _cli(["pipeline", "upload", "--package", package, "--version", "v1-abc1234"], url).exit_code == 0
    assert _cli(["pipeline", "upload", "--package", package, "--version", "v2-abc1234"], url).exit_code == 0
    args = ["pipeline", "run", "--dataset", "ml-latest-small", "--profile", "bench", "--candidate", "cft@0.5"]
    args += [
        "--bounds-json",
        '{"min_examples": 10}',
        "--param",
        "max_users=40",
        "--experiment",
        "nightly-test",
    ]
    res = _cli(args, url)
    assert res.exit_code == 0, res.output
    [run] = fake.runs
    v2 = fake.versions[run["pipeline_version_reference"]["pipeline_id"]][-1]
    assert v2["display_name"] == "v2-abc1234"
    assert run["pipeline_version_reference"]["pipeline_version_id"] == v2["pipeline_version_id"]
    assert run["runtime_config"]["parameters"] == {
        "dataset": "ml-latest-small",
        "profile": "bench",
        "candidate": "cft@0.5",
        "bounds_json": '{"min_examples": 10}',
        "max_users": 40,
        "snapshot_date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d}",  # default: today (UTC)
    }
    [exp] = fake.experiments
    assert exp["display_name"] == "nightly-test" and run["experiment_id"] == exp["experiment_id"]
    assert "pipeline_spec" not in run  # a run of the uploaded version, not an inline copy

    explicit = _cli(["pipeline", "run", "--version", "v1-abc1234", "--snapshot-date", "2026-01-01"], url)
    assert explicit.exit_code == 0, explicit.output
    run1 = fake.runs[-1]
    v1 = fake.versions[run1["pipeline_version_reference"]["pipeline_id"]][0]
    assert run1["pipeline_version_reference"]["pipeline_version_id"] == v1["pipeline_version_id"]
    assert run1["runtime_config"]["parameters"] == {"snapshot_date": "2026-01-01"}

    bad = _cli(["pipeline", "run", "--param", "datset=x"], url)
    assert bad.exit_code == 2 and "unknown pipeline parameter" in bad.output
    assert len(fake.runs) == 2


def test_schedule_nightly_once_and_replace(kfp_api, package):
    fake, url = kfp_api
    assert _cli(["pipeline", "upload", "--package", package, "--version", "v1-abc1234"], url).exit_code == 0
    res = _cli(["pipeline", "schedule", "--dataset", "ml-100k", "--profile", "quick"], url)
    assert res.exit_code == 0, res.output
    [rr] = fake.recurring
    assert rr["display_name"] == "gr2-nightly"
    assert rr["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}  # 6 fields, seconds first: 02:00:00
    assert str(rr["max_concurrency"]) == "1" and rr["no_catchup"] is True and rr["mode"] == "ENABLE"
    # No snapshot_date: the value would be frozen into every night's run (no macro expansion in KFP v2).
    assert rr["runtime_config"]["parameters"] == {"dataset": "ml-100k", "profile": "quick"}
    [v1] = next(iter(fake.versions.values()))
    assert rr["pipeline_version_reference"]["pipeline_version_id"] == v1["pipeline_version_id"]

    # A second nightly job would train twice: refused unless --replace, which re-points it at the new version.
    again = _cli(["pipeline", "schedule"], url)
    assert again.exit_code == 2 and "already exists" in again.output and len(fake.recurring) == 1
    assert _cli(["pipeline", "upload", "--package", package, "--version", "v2-abc1234"], url).exit_code == 0
    rep = _cli(["pipeline", "schedule", "--replace"], url)
    assert rep.exit_code == 0, rep.output
    [new] = fake.recurring
    assert new["recurring_run_id"] != rr["recurring_run_id"]
    assert json.loads(rep.output[rep.output.index("{") :])["replaced"] == [rr["recurring_run_id"]]
    assert fake.calls("DELETE", f"{API}/recurringruns/{rr['recurring_run_id']}")
    assert new["pipeline_version_reference"]["pipeline_version_id"] != v1["pipeline_version_id"]

    five = _cli(["pipeline", "schedule", "--replace", "--cron", "0 2 * * *"], url)
    assert five.exit_code == 2 and "seconds first" in five.output
    assert len(fake.calls("POST", f"{API}/recurringruns")) == 2


def test_run_without_an_uploaded_pipeline_says_what_to_do(kfp_api):
    fake, url = kfp_api
    res = _cli(["pipeline", "run"], url)
    assert res.exit_code == 2 and "gr2 pipeline upload" in res.output
    assert not fake.runs


def test_promote_writes_the_pointer_from_the_uploaded_record(tmp_path):
    from components.artifact_store import open_store

    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"\x00" * 16)
    store = open_store(local_root=tmp_path / "store", prefix="reranker")
    store.upload("run-7", "cft", model, metadata={"model": "cft@0.9", "recall@1": 0.31})
    env = {"GR2_ARTIFACT_ROOT": str(tmp_path / "store"), "GR2_S3_BUCKET": ""}
    res = CliRunner().invoke(app, ["promote", "--run-id", "run-7", "--stage", "cft"], env=env)
    assert res.exit_code == 0, res.output
    prod = store.production()
    assert (prod["run_id"], prod["stage"], prod["model"], prod["recall@1"]) == (
        "run-7",
        "cft",
        "cft@0.9",
        0.31,
    )
    missing = CliRunner().invoke(app, ["promote", "--run-id", "run-8"], env=env)
    assert missing.exit_code == 2 and store.production()["run_id"] == "run-7"
    # Without --stage: the stage the DAG deploys (the RL student).
    store.upload("run-8", "rl", model, metadata={"model": "rl@0.9", "recall@1": 0.33})
    res = CliRunner().invoke(app, ["promote", "--run-id", "run-8"], env=env)
    assert res.exit_code == 0, res.output
    assert (store.production()["run_id"], store.production()["stage"]) == ("run-8", "rl")


def test_record_outcome_writes_the_artifact_and_the_store(tmp_path, monkeypatch, capsys):
    from kfp import dsl
    from kfp.dsl import Artifact, Markdown

    from components.artifact_store import open_store
    from components.record_outcome import record_outcome

    monkeypatch.delenv("GR2_S3_BUCKET", raising=False)
    status = dsl.PipelineTaskFinalStatus("FAILED", "job-1", "exit-handler-1", 1, "Task ingest failed.")
    art = Artifact(name="outcome", uri=str(tmp_path / "outcome"))
    md = Markdown(name="summary", uri=str(tmp_path / "outcome.md"))
    kw = {"run_id": "run-9", "pipeline": PIPELINE_NAME, "dataset": "ml-100k", "profile": "quick"}
    record_outcome.python_func(
        status=status,
        outcome=art,
        summary=md,
        snapshot_date="2026-11-29",
        store_local_root=str(tmp_path / "s"),
        **kw,
    )
    rec = json.loads((tmp_path / "outcome" / "outcome.json").read_text())
    assert (rec["status"], rec["error_message"], rec["snapshot_date"]) == (
        "FAILED",
        "Task ingest failed.",
        "2026-11-29",
    )
    assert rec["run_id"] == "run-9" and art.metadata["status"] == "FAILED"
    assert (
        rec["result"] == "failed" and art.metadata["result"] == "failed"
    )  # what the steps published: nothing
    assert open_store(local_root=tmp_path / "s", prefix="reranker").report("run-9", "outcome") == rec
    assert "gr2 run outcome:" in capsys.readouterr().out
    assert (tmp_path / "outcome.md").read_text().startswith("# Run run-9: failed")
    # No store configured: the artifact and the log line only (local runs do not litter runs/artifacts).
    monkeypatch.delenv("GR2_ARTIFACT_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)  # where the default local store (runs/artifacts) would land
    art2 = Artifact(name="outcome", uri=str(tmp_path / "o2"))
    md2 = Markdown(name="summary", uri=str(tmp_path / "o2.md"))
    record_outcome.python_func(status=status, outcome=art2, summary=md2, snapshot_date="", **kw)
    assert (tmp_path / "o2" / "outcome.json").exists() and not (tmp_path / "runs").exists()
    assert "no artifact store configured" in (tmp_path / "o2.md").read_text()


def test_cli_exposes_every_step():
    top = CliRunner().invoke(app, ["--help"])
    steps = [
        "ingest",
        "feast-apply",
        "materialize",
        "extract",
        "validate",
        "candidates",
        "evaluate-floor",
        "prepare-sft",
        "train-ar",
    ]
    steps += [
        "rl",
        "convert-cft",
        "distill",
        "evaluate-models",
        "champion",
        "gate",
        "deploy",
        "canary-analysis",
        "promote",
    ]
    for cmd in steps:
        assert cmd in top.output, cmd
        res = CliRunner().invoke(app, [cmd, "--help"])
        usage_and_help = res.output.split("Options:")[0].strip().splitlines()
        assert res.exit_code == 0 and len(usage_and_help) >= 3, (cmd, res.output)  # usage, blank, help text
    for cmd in ["compile", "run-local", "upload", "run", "schedule"]:
        assert CliRunner().invoke(app, ["pipeline", cmd, "--help"]).exit_code == 0, cmd
    assert "--variant" in CliRunner().invoke(app, ["train-ar", "--help"]).output


def test_multi_user_namespace_is_used_for_lookup_and_creation(kfp_api, package):
    fake, url = kfp_api
    for v in ["v1-abc1234", "v2-abc1234"]:
        res = _cli(["pipeline", "upload", "--package", package, "--version", v], url, KFP_NAMESPACE="team-a")
        assert res.exit_code == 0, res.output
    dup = _cli(
        ["pipeline", "upload", "--package", package, "--version", "v2-abc1234"], url, KFP_NAMESPACE="team-a"
    )
    assert dup.exit_code == 2 and "already exists" in dup.output
    [pipe] = fake.pipelines  # found again in its namespace, not created twice
    assert pipe["namespace"] == "team-a"
    assert all(r["query"]["namespace"] == "team-a" for r in fake.calls("GET", f"{API}/pipelines"))
    assert not fake.calls("GET", f"{API}/healthz")  # a namespace given: no multi-user probe
