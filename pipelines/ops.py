"""Operations against a Kubeflow Pipelines API (kfp.Client, v2beta1 REST): upload a versioned pipeline, start
a run, create the nightly recurring run. `gr2 pipeline upload|run|schedule` (pipelines/cli.py) call these.

The endpoint comes from flags or env: KFP_HOST (e.g. http://localhost:8080 after
`kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80`), KFP_TOKEN (a bearer token, for clusters behind
auth), KFP_NAMESPACE (multi-user Kubeflow: the profile namespace).

KFP behaviours handled here (kfp 2.17; docs/DEPENDENCIES.md):
- `Client.upload_pipeline` creates the pipeline *and* a first version named after the pipeline (#5881, #13753),
  so that version would not carry a git sha. First upload therefore creates an empty pipeline
  (PipelineService.CreatePipeline), then uploads the sha-named version into it; later uploads add versions.
- Crons have 6 fields, seconds first: "0 0 2 * * *" is 02:00:00 every day; a 5-field crontab is rejected.
- `enable_caching` given to `run_pipeline` / `create_recurring_run` only rewrites an inline pipeline spec (and
  only its top-level tasks); for a run of an uploaded version the client drops it. Freshness therefore comes
  from the compiled spec: ingest never caches, and every downstream cache key contains ingest's new artifacts.
- KFP v2 does not expand `[[ScheduledTime]]` macros in recurring-run parameters (#12494), so the schedule
  never fixes `snapshot_date` (a fixed date would be stamped on every night's data).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components._lib.paths import REPO_ROOT

NIGHTLY_CRON = "0 0 2 * * *"  # sec min hour day-of-month month day-of-week: 02:00:00 every day
NIGHTLY_NAME = "gr2-nightly"
DEFAULT_EXPERIMENT = "gr2"


class OpsError(RuntimeError):
    """A usage or server-state problem, with what to do about it."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    token: str = ""
    namespace: str = ""

    @classmethod
    def resolve(
        cls, host: str | None = None, token: str | None = None, namespace: str | None = None
    ) -> Endpoint:
        """Flags first, then KFP_HOST / KFP_TOKEN / KFP_NAMESPACE."""
        host = host or os.environ.get("KFP_HOST", "")
        if not host:
            raise OpsError(
                "no KFP endpoint: pass --host or set KFP_HOST (e.g. http://localhost:8080 after "
                "`kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80`)"
            )
        return cls(
            host=host,
            token=token or os.environ.get("KFP_TOKEN", ""),
            namespace=namespace or os.environ.get("KFP_NAMESPACE", ""),
        )


def connect(ep: Endpoint):
    """A kfp.Client for the endpoint (token as `Authorization: Bearer`, namespace for multi-user clusters)."""
    import kfp

    kwargs: dict[str, Any] = {"host": ep.host}
    if ep.token:
        kwargs["existing_token"] = ep.token
    if ep.namespace:
        kwargs["namespace"] = ep.namespace
    return kfp.Client(**kwargs)


def git_sha(repo: str | Path = REPO_ROOT) -> str:
    """Short sha of HEAD (gr2.report.git_sha: GR2_GIT_SHA overrides, "-dirty" on local changes).

    Same `git rev-parse --short HEAD` as the Makefile's image TAG, so a version names the images it runs."""
    from gr2.report import git_sha as _sha

    sha = _sha(repo, short=True)
    if sha == "unknown":
        raise OpsError(f"cannot read the git sha in {repo}; set GR2_GIT_SHA")
    return sha


def version_name(sha: str, when: dt.datetime | None = None) -> str:
    """`<UTC date>-<HHMMSS>-<sha>`: sorts by time, names the code; unique per upload (KFP rejects duplicates)."""
    when = when or dt.datetime.now(dt.UTC)
    return f"{when:%Y-%m-%d-%H%M%S}-{sha}"


def pipeline_inputs() -> dict[str, Any]:
    """The pipeline's parameters and their defaults (from the DAG definition itself)."""
    from pipelines.pipeline import gr2_pipeline

    return {k: v.default for k, v in gr2_pipeline.component_spec.inputs.items()}


def run_params(given: dict[str, Any], snapshot_date: str | None = None) -> dict[str, Any]:
    """Parameters of one run: the values given (unknown names rejected) plus `snapshot_date` (default today, UTC).

    Only given values are sent; the rest take the pipeline's defaults."""
    known = pipeline_inputs()
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise OpsError(f"unknown pipeline parameter(s) {unknown}; the pipeline takes {sorted(known)}")
    params = {k: v for k, v in given.items() if v is not None}
    params["snapshot_date"] = snapshot_date or f"{dt.datetime.now(dt.UTC):%Y-%m-%d}"
    return params


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """`key=value` strings -> dict; values that parse as JSON numbers/bools become those types."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise OpsError(f"--param {pair!r}: expected key=value")
        try:
            val = json.loads(raw)
            out[key] = val if isinstance(val, int | float | bool) else raw
        except json.JSONDecodeError:
            out[key] = raw
    return out


def check_cron(cron: str) -> str:
    """KFP (robfig/cron) wants 6 fields, seconds first; a 5-field crontab would silently mean something else."""
    fields = cron.split()
    if len(fields) != 6:
        raise OpsError(
            f"cron {cron!r} has {len(fields)} fields; KFP needs 6, seconds first "
            f"(sec min hour dom month dow), e.g. {NIGHTLY_CRON!r} for 02:00 daily"
        )
    return " ".join(fields)


def _eq_filter(key: str, value: str) -> str:
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": key, "stringValue": value}]})


def pipeline_id(client, name: str) -> str | None:
    """The id of pipeline `name`, looked up in the client's namespace (kfp's get_pipeline_id ignores it, so
    on multi-user Kubeflow it would miss a namespaced pipeline and a second one would be created)."""
    ns = client.get_user_namespace() or None
    found = client.list_pipelines(filter=_eq_filter("display_name", name), namespace=ns).pipelines or []
    if len(found) > 1:
        raise OpsError(f"{len(found)} pipelines named {name!r}; pass --pipeline-name of a unique one")
    return found[0].pipeline_id if found else None


@dataclass(frozen=True)
class Version:
    pipeline_id: str
    version_id: str
    name: str
    created_pipeline: bool = False


def upload(
    client, package_path: str | Path, pipeline_name: str, version: str, description: str = ""
) -> Version:
    """Upload `package_path` as version `version` of `pipeline_name`, creating the pipeline on first upload."""
    from kfp_server_api import ApiException, V2beta1Pipeline

    pid = pipeline_id(client, pipeline_name)
    created = pid is None
    if pid is None:
        # Not client.upload_pipeline: it would add a version named after the pipeline (#5881), not the sha.
        ns = client.get_user_namespace() or None
        pipe = client.pipelines.pipeline_service_create_pipeline(
            pipeline=V2beta1Pipeline(
                display_name=pipeline_name, description=description or None, namespace=ns
            )
        )
        pid = pipe.pipeline_id
    try:
        v = client.upload_pipeline_version(
            str(package_path), version, pipeline_id=pid, description=description or None
        )
    except ApiException as e:
        if e.status == 409:  # AlreadyExists: version names are unique within a pipeline
            raise OpsError(
                f"version {version!r} of {pipeline_name!r} already exists; pass another --version"
            ) from e
        raise
    return Version(
        pipeline_id=pid,
        version_id=v.pipeline_version_id,
        name=v.display_name or version,
        created_pipeline=created,
    )


def find_version(client, pipeline_name: str, version: str | None = None) -> Version:
    """A version of `pipeline_name` by name (as `upload` printed it) or id; the newest one when None."""
    pid = pipeline_id(client, pipeline_name)
    if pid is None:
        raise OpsError(f"pipeline {pipeline_name!r} not found: run `gr2 pipeline upload` first")
    flt = _eq_filter("display_name", version) if version else None
    res = client.list_pipeline_versions(pid, page_size=1, sort_by="created_at desc", filter=flt)
    if res.pipeline_versions:
        v = res.pipeline_versions[0]
        return Version(pipeline_id=pid, version_id=v.pipeline_version_id, name=v.display_name)
    if version:  # not a name: treat it as a version id (the server answers 404 if it is not one)
        v = client.get_pipeline_version(pid, version)
        return Version(pipeline_id=pid, version_id=v.pipeline_version_id, name=v.display_name)
    raise OpsError(f"pipeline {pipeline_name!r} has no versions: run `gr2 pipeline upload`")


def start_run(
    client,
    version: Version,
    params: dict[str, Any],
    experiment: str = DEFAULT_EXPERIMENT,
    run_name: str = "",
    pipeline_root: str | None = None,
    service_account: str | None = None,
) -> str:
    """Start one run of `version` in `experiment` (created if missing); returns the run id."""
    exp = client.create_experiment(experiment, namespace=client.get_user_namespace() or None)
    run_name = run_name or f"gr2-{params.get('dataset', 'default')}-{params['snapshot_date']}-{version.name}"
    run = client.run_pipeline(
        exp.experiment_id,
        run_name,
        params=params,
        pipeline_id=version.pipeline_id,
        version_id=version.version_id,
        pipeline_root=pipeline_root,
        service_account=service_account,
    )
    return run.run_id


def schedule(
    client,
    version: Version,
    params: dict[str, Any],
    experiment: str = DEFAULT_EXPERIMENT,
    name: str = NIGHTLY_NAME,
    cron: str = NIGHTLY_CRON,
    replace: bool = False,
    pipeline_root: str | None = None,
    service_account: str | None = None,
) -> dict[str, Any]:
    """Create the recurring run: one at a time (max_concurrency=1), no catch-up after a pause.

    With `replace`, recurring runs of the same name in the experiment are deleted after the new one exists
    (re-pointing the nightly job at a new version); without it an existing one is an error (two nightly jobs
    would train twice)."""
    cron = check_cron(cron)
    if "snapshot_date" in params:
        raise OpsError(
            "a schedule cannot fix snapshot_date: KFP v2 does not expand [[ScheduledTime]] macros (#12494), so "
            "every night would carry the same date; leave it empty (ingest is never cached)"
        )
    exp = client.create_experiment(experiment, namespace=client.get_user_namespace() or None)
    old = client.list_recurring_runs(experiment_id=exp.experiment_id, filter=_eq_filter("display_name", name))
    old_ids = [r.recurring_run_id for r in (old.recurring_runs or [])]
    if old_ids and not replace:
        raise OpsError(f"recurring run {name!r} already exists ({old_ids}); pass --replace to re-point it")
    rr = client.create_recurring_run(
        exp.experiment_id,
        name,
        description=f"nightly retraining, version {version.name}",
        cron_expression=cron,
        max_concurrency=1,
        no_catchup=True,
        params=params,
        pipeline_id=version.pipeline_id,
        version_id=version.version_id,
        enabled=True,
        pipeline_root=pipeline_root,
        service_account=service_account,
    )
    for rid in old_ids:
        client.delete_recurring_run(rid)
    return {
        "recurring_run_id": rr.recurring_run_id,
        "replaced": old_ids,
        "cron": cron,
        "version": version.name,
    }
