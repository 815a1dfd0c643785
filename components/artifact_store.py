"""Artifact store for models and reports: S3 via boto3, or a local folder (the default).

Layout (keys relative to the store root, `<prefix>` = GR2_S3_PREFIX or "reranker"):

    <prefix>/<run_id>/<stage>/<attempt>/...              the uploaded files of one upload attempt
    <prefix>/<run_id>/<stage>/manifests/<attempt>.json   that attempt's manifest (file hashes), never rewritten
    <prefix>/<run_id>/<stage>/manifest.json              written LAST: publishes the newest complete attempt
    <prefix>/production.json                             the production pointer; only `promote()` writes it

Atomic from a reader's view without renames (S3 has none): every upload goes to a fresh `<attempt>`
sub-prefix, and a single PUT of `manifest.json` publishes it. Readers only trust a manifest, download
exactly the files it lists and verify their sha256, so a crash mid-upload leaves orphan objects under an
unpublished attempt while readers keep seeing the previous complete version.

The production pointer pins one immutable attempt: (run_id, stage, attempt) and the sha256 of that attempt's
manifest. `promote()` writes it (one PUT) for the attempt it is given (the one a canary smoke-tested), after
checking that every file of it is present with its hash; `download_production()` then serves exactly that
attempt, whatever was uploaded since. Paths in a manifest cannot leave the download folder.

Configuration (params override env): S3_ENDPOINT_URL (MinIO / moto / any S3), GR2_S3_BUCKET (setting it
selects S3), GR2_S3_PREFIX; GR2_ARTIFACT_ROOT for the local backend (default `runs/artifacts`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from gr2.files import sha256_file

MANIFEST = "manifest.json"
ATTEMPT_MANIFESTS = "manifests"  # <run_id>/<stage>/manifests/<attempt>.json
POINTER = "production.json"
DEFAULT_PREFIX = "reranker"
DEFAULT_LOCAL_ROOT = "runs/artifacts"


class ArtifactError(RuntimeError):
    """A missing, incomplete or corrupt artifact (names the key)."""


class Backend(Protocol):
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...  # None when the key does not exist
    def upload_file(self, key: str, path: Path) -> None: ...
    def download_file(self, key: str, path: Path) -> None: ...
    def uri(self, key: str) -> str: ...


class LocalBackend:
    """A folder standing in for a bucket. Single-object writes are atomic (temp file + os.replace)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put_bytes(self, key: str, data: bytes) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)

    def get_bytes(self, key: str) -> bytes | None:
        p = self._path(key)
        return p.read_bytes() if p.is_file() else None

    def upload_file(self, key: str, path: Path) -> None:
        self.put_bytes(key, Path(path).read_bytes())

    def download_file(self, key: str, path: Path) -> None:
        data = self.get_bytes(key)
        if data is None:
            raise ArtifactError(f"{self.uri(key)}: missing")
        Path(path).write_bytes(data)

    def uri(self, key: str) -> str:
        return str(self._path(key).resolve())


def s3_client(endpoint_url: str | None = None) -> Any:
    """The one boto3 S3 client of the project (the artifact store and the nightly event log,
    components/event_log.py): `endpoint_url` (else S3_ENDPOINT_URL) points it at MinIO/moto, path-style
    addressing for those; credentials come from the environment (the Secret, pipelines/resources.py)."""
    import boto3  # lazy: the local backend must work without boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"}),
    )


class S3Backend:
    """boto3 S3 client (`s3_client`) on one bucket."""

    def __init__(self, bucket: str, endpoint_url: str | None = None, client: Any = None):
        self.bucket = bucket
        self.client = client or s3_client(endpoint_url)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def upload_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, key)

    def download_file(self, key: str, path: Path) -> None:
        try:
            self.client.download_file(self.bucket, key, str(path))
        except Exception as e:  # botocore ClientError 404 on head_object
            raise ArtifactError(f"{self.uri(key)}: download failed ({e})") from e

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


@dataclass(frozen=True)
class Manifest:
    run_id: str
    stage: str
    attempt: str
    uri: str  # where the attempt's files live (a KServe storageUri for model stages)
    files: dict[str, dict[str, Any]]  # relative path -> {"sha256", "size"}
    created_at: str
    metadata: dict[str, Any]

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    def sha256(self) -> str:
        """The content hash that identifies this attempt (its files' hashes included)."""
        return hashlib.sha256(self.to_json()).hexdigest()


def _check_name(what: str, value: str) -> None:
    # run ids and stage names become key segments: no separators, no hidden/relative names
    if not value or "/" in value or value.startswith(".") or value != value.strip():
        raise ValueError(f"{what} {value!r}: must be a non-empty key segment without '/' or a leading '.'")


def _check_relpath(rel: str, where: str) -> None:
    # a manifest's file paths become keys and paths under the download folder: none may climb out of it
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise ArtifactError(
            f"{where}: file path {rel!r} is not a plain relative path (it could leave the folder)"
        )


class ArtifactStore:
    def __init__(self, backend: Backend, prefix: str = DEFAULT_PREFIX):
        self.backend = backend
        self.prefix = prefix.strip("/")

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    # --- writes -------------------------------------------------------------------------------
    def upload(
        self,
        run_id: str,
        stage: str,
        src_dir: str | Path | None = None,
        report: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Manifest:
        """Upload a directory (e.g. a model dir) and/or a report dict as one attempt, then publish it.

        The report is stored as `report.json` beside the files. Publishing = writing the manifest last.
        """
        _check_name("run_id", run_id)
        _check_name("stage", stage)
        attempt = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
        base = self._key(run_id, stage, attempt)
        files: dict[str, dict[str, Any]] = {}
        if src_dir is not None:
            src = Path(src_dir)
            if not src.is_dir():
                raise ArtifactError(f"{src}: not a directory")
            for p in sorted(src.rglob("*")):
                if p.is_file():
                    rel = p.relative_to(src).as_posix()
                    files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
                    self.backend.upload_file(f"{base}/{rel}", p)
        if report is not None:
            data = (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()
            if "report.json" in files:
                raise ArtifactError(f"{src_dir}: contains report.json and a report was passed too")
            files["report.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            self.backend.put_bytes(f"{base}/report.json", data)
        if not files:
            raise ArtifactError(f"{run_id}/{stage}: nothing to upload (no files and no report)")
        manifest = Manifest(
            run_id=run_id,
            stage=stage,
            attempt=attempt,
            uri=self.backend.uri(base),
            files=files,
            created_at=dt.datetime.now(dt.UTC).isoformat(),
            metadata=dict(metadata or {}),
        )
        data = manifest.to_json()
        self.backend.put_bytes(self._key(run_id, stage, ATTEMPT_MANIFESTS, f"{attempt}.json"), data)
        self.backend.put_bytes(self._key(run_id, stage, MANIFEST), data)  # publish
        return manifest

    def promote(
        self, run_id: str, stage: str, record: dict[str, Any] | None = None, attempt: str | None = None
    ) -> dict[str, Any]:
        """Point `production` at one attempt of (run_id, stage): `attempt` (pass the one that was tested), or
        the published one. The only writer of the pointer.

        Refuses an attempt whose files are missing or differ from its manifest. The pointer pins the attempt by
        its manifest's sha256; `record` carries what the next gate compares against (model, recall@1, ...).
        """
        m = self.manifest(run_id, stage) if attempt is None else self.attempt_manifest(run_id, stage, attempt)
        if m is None:
            what = self._key(run_id, stage) if attempt is None else self._key(run_id, stage, attempt)
            raise ArtifactError(f"{self.backend.uri(what)}: no complete upload to promote")
        with tempfile.TemporaryDirectory(prefix="gr2-promote-") as tmp:
            self._fetch(m, tmp)  # every listed file present, with its hash
        pointer = {
            **(record or {}),
            "run_id": run_id,
            "stage": stage,
            "attempt": m.attempt,
            "uri": m.uri,
            "manifest_sha256": m.sha256(),
            "promoted_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        self.backend.put_bytes(
            self._key(POINTER), (json.dumps(pointer, indent=2, sort_keys=True) + "\n").encode()
        )
        return pointer

    # --- reads --------------------------------------------------------------------------------
    def _read_manifest(self, key: str) -> Manifest | None:
        raw = self.backend.get_bytes(key)
        if raw is None:
            return None
        try:
            return Manifest(**json.loads(raw))
        except (json.JSONDecodeError, TypeError) as e:
            raise ArtifactError(f"{self.backend.uri(key)}: corrupt ({e})") from e

    def manifest(self, run_id: str, stage: str) -> Manifest | None:
        """The published (newest complete) attempt of (run_id, stage)."""
        return self._read_manifest(self._key(run_id, stage, MANIFEST))

    def attempt_manifest(self, run_id: str, stage: str, attempt: str) -> Manifest | None:
        """The manifest of one attempt, published or not."""
        _check_name("attempt", attempt)
        m = self._read_manifest(self._key(run_id, stage, ATTEMPT_MANIFESTS, f"{attempt}.json"))
        if m is None:  # uploaded before per-attempt manifests: only the published one names it
            published = self.manifest(run_id, stage)
            m = published if published is not None and published.attempt == attempt else None
        return m

    def production(self) -> dict[str, Any] | None:
        """The production record, or None when nothing was promoted yet."""
        raw = self.backend.get_bytes(self._key(POINTER))
        return None if raw is None else json.loads(raw)

    def _fetch(self, m: Manifest, dest: str | Path) -> Path:
        """Download exactly the files `m` lists into `dest`, verifying every file's sha256."""
        for what, name in (("run_id", m.run_id), ("stage", m.stage), ("attempt", m.attempt)):
            _check_name(what, name)
        base = self._key(m.run_id, m.stage, m.attempt)
        for rel in m.files:
            _check_relpath(rel, self.backend.uri(base))
        dest = Path(dest)
        for rel, info in m.files.items():
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            self.backend.download_file(f"{base}/{rel}", out)
            if sha256_file(out) != info["sha256"]:
                raise ArtifactError(f"{self.backend.uri(f'{base}/{rel}')}: sha256 mismatch with the manifest")
        return dest

    def download(self, run_id: str, stage: str, dest: str | Path) -> Path:
        """Download the published attempt of (run_id, stage) into `dest`, verifying every file's sha256."""
        m = self.manifest(run_id, stage)
        if m is None:
            raise ArtifactError(
                f"{self.backend.uri(self._key(run_id, stage))}: no complete upload (no manifest)"
            )
        return self._fetch(m, dest)

    def download_production(self, dest: str | Path) -> Path:
        """Download exactly the attempt the production pointer pins (not the newest upload of its stage)."""
        p = self.production()
        where = self.backend.uri(self._key(POINTER))
        if p is None:
            raise ArtifactError(f"{where}: nothing in production")
        if "manifest_sha256" not in p:
            raise ArtifactError(
                f"{where}: the pointer pins no attempt hash (written before pinning); promote again"
            )
        m = self.attempt_manifest(p["run_id"], p["stage"], p["attempt"])
        if m is None or m.sha256() != p["manifest_sha256"]:
            raise ArtifactError(
                f"{where}: attempt {p['run_id']}/{p['stage']}/{p['attempt']} is "
                + ("missing" if m is None else "not the one promoted (its manifest hash changed)")
            )
        return self._fetch(m, dest)

    def report(self, run_id: str, stage: str) -> dict[str, Any] | None:
        m = self.manifest(run_id, stage)
        if m is None or "report.json" not in m.files:
            return None
        raw = self.backend.get_bytes(self._key(run_id, stage, m.attempt, "report.json"))
        return None if raw is None else json.loads(raw)


def open_store(
    bucket: str | None = None,
    prefix: str | None = None,
    endpoint_url: str | None = None,
    local_root: str | Path | None = None,
) -> ArtifactStore:
    """The configured store: S3 when a bucket is given (param or GR2_S3_BUCKET), else the local folder."""
    bucket = bucket or os.environ.get("GR2_S3_BUCKET") or None
    prefix = prefix if prefix is not None else os.environ.get("GR2_S3_PREFIX", DEFAULT_PREFIX)
    if bucket:
        endpoint_url = endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None
        return ArtifactStore(S3Backend(bucket, endpoint_url=endpoint_url), prefix=prefix)
    root = local_root or os.environ.get("GR2_ARTIFACT_ROOT", DEFAULT_LOCAL_ROOT)
    return ArtifactStore(LocalBackend(root), prefix=prefix)


def production_record(production_json: str = "", **store_kwargs: Any) -> dict[str, Any] | None:
    """The production record for the gate: an explicit JSON ("null" = nothing in production), else the
    configured store's pointer (store_kwargs as for `open_store`; empty values fall back to env)."""
    if production_json:
        return json.loads(production_json)
    return open_store(**{k: v for k, v in store_kwargs.items() if v}).production()


def publish(run_id: str, stage: str, report: dict[str, Any], **store_kwargs: Any) -> Manifest:
    """Record one step's result of a run as `<run_id>/<stage>/report.json` in the configured store (store_kwargs
    as for `open_store`; empty values fall back to env): the run's outcome step reads them back
    (components/record_outcome.py), since an exit handler cannot take the inner tasks' outputs."""
    return open_store(**{k: v for k, v in store_kwargs.items() if v}).upload(run_id, stage, report=report)
