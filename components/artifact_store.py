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
manifest. `promote()` writes it for the attempt it is given (the one a canary smoke-tested), after checking that
every file of it is present with its hash; `download_production()` then serves exactly that attempt, whatever was
uploaded since. Paths in a manifest cannot leave the download folder.

Promotes are compare-and-swap writes: `promote()` reads the pointer and its version, and writes the new one only
if the pointer is still that version (S3: a conditional PUT with If-Match, or If-None-Match: * for the first; the
local backend: the same check under a file lock). So of concurrent promotes each one either replaced exactly the
pointer it read (the new pointer names it under "replaces") or learns that it lost (`PromoteConflict`); none is
silently overwritten while being told it won. Every failure of the store is an `ArtifactError` naming the key.

Configuration (params override env): S3_ENDPOINT_URL (MinIO / moto / any S3), GR2_S3_BUCKET (setting it
selects S3), GR2_S3_PREFIX; GR2_ARTIFACT_ROOT for the local backend (default `runs/artifacts`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from gr2.files import sha256_file

MANIFEST = "manifest.json"
PINNED = ("run_id", "stage", "attempt", "manifest_sha256")  # what a production pointer pins
ATTEMPT_MANIFESTS = "manifests"  # <run_id>/<stage>/manifests/<attempt>.json
POINTER = "production.json"
DEFAULT_PREFIX = "reranker"
DEFAULT_LOCAL_ROOT = "runs/artifacts"


class ArtifactError(RuntimeError):
    """A missing, incomplete or corrupt artifact, or a store that failed (names the key)."""


class PromoteConflict(ArtifactError):
    """Another promote changed the production pointer between this promote's read and its write: this one did
    not happen (promote again to replace what is there now)."""


class Backend(Protocol):
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...  # None when the key does not exist
    # The object and its version (S3: the ETag), or None when the key does not exist.
    def get_versioned(self, key: str) -> tuple[bytes, str] | None: ...
    # Write only if the object is still at `version` (None: only if it does not exist); False when it is not.
    def put_if(self, key: str, data: bytes, version: str | None) -> bool: ...
    def upload_file(self, key: str, path: Path) -> None: ...
    def download_file(self, key: str, path: Path) -> None: ...
    def uri(self, key: str) -> str: ...


class LocalBackend:
    """A folder standing in for a bucket. Single-object writes are atomic (temp file + os.replace); a conditional
    write checks and replaces under an exclusive lock on `<key>.lock` (processes of one host; a shared volume
    needs a filesystem whose locks hold across hosts). An object's version is its content's sha256."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put_bytes(self, key: str, data: bytes) -> None:
        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        except OSError as e:
            raise ArtifactError(f"{self.uri(key)}: write failed ({e})") from e

    def get_bytes(self, key: str) -> bytes | None:
        p = self._path(key)
        try:
            return p.read_bytes() if p.is_file() else None
        except OSError as e:
            raise ArtifactError(f"{self.uri(key)}: read failed ({e})") from e

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        data = self.get_bytes(key)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        lock = self._path(f"{key}.lock")
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            with lock.open("a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
                current = self.get_versioned(key)
                if (None if current is None else current[1]) != version:
                    return False
                self.put_bytes(key, data)
                return True
        except OSError as e:
            raise ArtifactError(f"{self.uri(key)}: conditional write failed ({e})") from e

    def upload_file(self, key: str, path: Path) -> None:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read it for {self.uri(key)} ({e})") from e
        self.put_bytes(key, data)

    def download_file(self, key: str, path: Path) -> None:
        data = self.get_bytes(key)
        if data is None:
            raise ArtifactError(f"{self.uri(key)}: missing")
        try:
            Path(path).write_bytes(data)
        except OSError as e:
            raise ArtifactError(f"{self.uri(key)}: cannot write it to {path} ({e})") from e

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
    """boto3 S3 client (`s3_client`) on one bucket. Every botocore failure becomes an ArtifactError naming the
    key."""

    def __init__(self, bucket: str, endpoint_url: str | None = None, client: Any = None):
        self.bucket = bucket
        self.client = client or s3_client(endpoint_url)

    @contextlib.contextmanager
    def _errors(self, key: str, what: str) -> Iterator[None]:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError, S3UploadFailedError) as e:
            raise ArtifactError(f"{self.uri(key)}: {what} failed ({e})") from e

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key, "write"):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get_bytes(self, key: str) -> bytes | None:
        got = self.get_versioned(key)
        return None if got is None else got[0]

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        with self._errors(key, "read"):
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=key)
            except self.client.exceptions.NoSuchKey:
                return None
            return obj["Body"].read(), obj["ETag"]

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        """S3 conditional writes: If-Match the ETag read, or If-None-Match: * when there was none. 412 (the
        condition failed) and 409 (a concurrent conditional write won) mean this write did not happen."""
        from botocore.exceptions import ClientError

        cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        with self._errors(key, "conditional write"):
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **cond)
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status in (409, 412) or e.response.get("Error", {}).get("Code") in CONDITION_FAILED:
                    return False
                raise
        return True

    def upload_file(self, key: str, path: Path) -> None:
        with self._errors(key, "upload"):
            self.client.upload_file(str(path), self.bucket, key)

    def download_file(self, key: str, path: Path) -> None:
        with self._errors(key, "download"):
            self.client.download_file(self.bucket, key, str(path))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


# S3's answers to a conditional write that did not happen (412 and 409 in AWS's documentation).
CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict")


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
        key = self._key(POINTER)
        current = self.backend.get_versioned(key)
        before = None if current is None else self._pointer(current[0])
        pointer = {
            **(record or {}),
            "run_id": run_id,
            "stage": stage,
            "attempt": m.attempt,
            "uri": m.uri,
            "manifest_sha256": m.sha256(),
            "promoted_at": dt.datetime.now(dt.UTC).isoformat(),
            # the pointer this one replaced: the promotes form one chain, none lost
            "replaces": None if before is None else {k: before.get(k) for k in PINNED},
        }
        data = (json.dumps(pointer, indent=2, sort_keys=True) + "\n").encode()
        if not self.backend.put_if(key, data, None if current is None else current[1]):
            now = self.production()
            raise PromoteConflict(
                f"{self.backend.uri(key)}: another promote changed the pointer meanwhile (now "
                f"{'nothing' if now is None else '/'.join(str(now.get(k)) for k in PINNED[:3])}); "
                f"{run_id}/{stage}/{m.attempt} was not promoted"
            )
        return pointer

    # --- reads --------------------------------------------------------------------------------
    def _read_manifest(self, key: str) -> Manifest | None:
        raw = self.backend.get_bytes(key)
        if raw is None:
            return None
        where = self.backend.uri(key)
        try:
            m = Manifest(**json.loads(raw))
        except (ValueError, TypeError) as e:  # not JSON, not an object, fields missing or unknown
            raise ArtifactError(f"{where}: corrupt manifest ({e})") from e
        for name in ("run_id", "stage", "attempt", "uri", "created_at"):
            if not isinstance(getattr(m, name), str):
                raise ArtifactError(f"{where}: corrupt manifest ({name} is not a string)")
        if not isinstance(m.files, dict) or not isinstance(m.metadata, dict):
            raise ArtifactError(f"{where}: corrupt manifest (files and metadata must be objects)")
        for rel, info in m.files.items():
            if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
                raise ArtifactError(f"{where}: corrupt manifest (file {rel!r} has no sha256)")
        return m

    def _pointer(self, raw: bytes) -> dict[str, Any]:
        """The production pointer's JSON, checked: an object whose pinned fields are strings."""
        where = self.backend.uri(self._key(POINTER))
        try:
            p = json.loads(raw)
        except ValueError as e:
            raise ArtifactError(f"{where}: corrupt pointer ({e})") from e
        if not isinstance(p, dict):
            raise ArtifactError(f"{where}: corrupt pointer (not a JSON object)")
        bad = [k for k in PINNED if k in p and not isinstance(p[k], str)]
        if bad:
            raise ArtifactError(f"{where}: corrupt pointer ({bad[0]} is not a string)")
        return p

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
        return None if raw is None else self._pointer(raw)

    def _fetch(self, m: Manifest, dest: str | Path) -> Path:
        """Download exactly the files `m` lists into `dest`, verifying every file's sha256."""
        for what, name in (("run_id", m.run_id), ("stage", m.stage), ("attempt", m.attempt)):
            try:
                _check_name(what, name)
            except ValueError as e:  # read from the store: corrupt, not the caller's mistake
                raise ArtifactError(f"{m.uri}: corrupt manifest ({e})") from e
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
        missing = [k for k in PINNED if k not in p]
        if missing:
            raise ArtifactError(
                f"{where}: the pointer pins no {missing[0]} (written before pinning, or corrupt); promote again"
            )
        try:
            m = self.attempt_manifest(p["run_id"], p["stage"], p["attempt"])
        except ValueError as e:  # an attempt name that is not a key segment
            raise ArtifactError(f"{where}: corrupt pointer ({e})") from e
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
        key = self._key(run_id, stage, m.attempt, "report.json")
        raw = self.backend.get_bytes(key)
        try:
            return None if raw is None else json.loads(raw)
        except ValueError as e:
            raise ArtifactError(f"{self.backend.uri(key)}: corrupt report ({e})") from e


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
