"""Artifact store round trips: local folder, and S3 through boto3 against moto's real HTTP server on loopback."""

import hashlib
import json
import threading

import pytest

from components.artifact_store import (
    ArtifactError,
    ArtifactStore,
    LocalBackend,
    PromoteConflict,
    S3Backend,
    open_store,
)
from tests.s3 import use_bucket

BUCKET = "gr2-test"


@pytest.fixture
def s3_store(s3_endpoint, monkeypatch, request):
    bucket = f"{BUCKET}-{request.node.name.split('[')[0].replace('_', '-')[:40]}".lower()
    client = use_bucket(monkeypatch, s3_endpoint, bucket)
    store = open_store()  # configured from env, as components and the predictor do
    assert isinstance(store.backend, S3Backend) and store.backend.bucket == bucket
    return store, client, bucket


def make_model(path, version):
    path.mkdir(parents=True, exist_ok=True)
    (path / "reranker.json").write_text(json.dumps({"kind": "floor", "version": version}))
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "weights.bin").write_bytes(bytes(range(256)) * (4 + version))
    return path


def test_s3_upload_pointer_download(s3_store, tmp_path):
    store, client, bucket = s3_store
    model = make_model(tmp_path / "m", 1)
    m = store.upload("run1", "cft", model, report={"rows": [{"model": "cft", "recall@1": 0.4}]})
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    base = f"reranker/run1/cft/{m.attempt}"
    assert keys == sorted(
        [
            f"{base}/reranker.json",
            f"{base}/sub/weights.bin",
            f"{base}/report.json",
            f"reranker/run1/cft/manifests/{m.attempt}.json",
            "reranker/run1/cft/manifest.json",
        ]
    )
    assert m.uri == f"s3://{bucket}/{base}"
    assert store.production() is None  # uploading never touches the pointer
    p = store.promote("run1", "cft", {"model": "cft", "recall@1": 0.4})
    assert store.production() == p and p["uri"] == m.uri and p["recall@1"] == 0.4
    out = store.download_production(tmp_path / "dl")
    assert (out / "sub" / "weights.bin").read_bytes() == (model / "sub" / "weights.bin").read_bytes()
    assert json.loads((out / "report.json").read_text())["rows"][0]["recall@1"] == 0.4
    assert store.report("run1", "cft")["rows"][0]["model"] == "cft"


def test_s3_crash_mid_upload_keeps_previous_version(s3_store, tmp_path, monkeypatch):
    store, client, bucket = s3_store
    store.upload("run1", "model", make_model(tmp_path / "v1", 1))
    store.promote("run1", "model", {"recall@1": 0.3})

    # second upload of the same run/stage crashes after its first file reached S3
    real_upload = S3Backend.upload_file
    calls = []

    def crashing(self, key, path):
        if calls:
            raise ConnectionError("simulated crash mid-upload")
        calls.append(key)
        real_upload(self, key, path)

    monkeypatch.setattr(S3Backend, "upload_file", crashing)
    with pytest.raises(ConnectionError):
        store.upload("run1", "model", make_model(tmp_path / "v2", 2))
    monkeypatch.setattr(S3Backend, "upload_file", real_upload)
    assert len(calls) == 1  # one object of the new version really is in the bucket
    assert any(calls[0] == o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])

    # readers (a fresh client, as another process would be) still see version 1, complete and verified
    reader = open_store()
    out = reader.download("run1", "model", tmp_path / "read")
    assert json.loads((out / "reranker.json").read_text())["version"] == 1
    assert (out / "sub" / "weights.bin").stat().st_size == 256 * 5
    assert reader.production()["recall@1"] == 0.3

    # a never-published stage is invisible, not half-readable
    monkeypatch.setattr(S3Backend, "upload_file", crashing)
    with pytest.raises(ConnectionError):
        store.upload("run2", "model", make_model(tmp_path / "v3", 3))
    monkeypatch.setattr(S3Backend, "upload_file", real_upload)
    assert reader.manifest("run2", "model") is None
    with pytest.raises(ArtifactError, match="no complete upload"):
        reader.download("run2", "model", tmp_path / "x")
    with pytest.raises(ArtifactError, match="no complete upload to promote"):
        store.promote("run2", "model")


def test_s3_corrupted_object_is_detected(s3_store, tmp_path):
    store, client, bucket = s3_store
    m = store.upload("run1", "model", make_model(tmp_path / "v1", 1))
    client.put_object(Bucket=bucket, Key=f"reranker/run1/model/{m.attempt}/reranker.json", Body=b"tampered")
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        store.download("run1", "model", tmp_path / "dl")


def test_local_backend_is_default_and_roundtrips(tmp_path, monkeypatch):
    monkeypatch.delenv("GR2_S3_BUCKET", raising=False)
    monkeypatch.setenv("GR2_ARTIFACT_ROOT", str(tmp_path / "store"))
    store = open_store()
    assert isinstance(store.backend, LocalBackend)
    m = store.upload("r", "eval", report={"gate": {"passed": True}})
    assert (tmp_path / "store" / "reranker" / "r" / "eval" / "manifest.json").is_file()
    assert store.report("r", "eval") == {"gate": {"passed": True}}
    assert m.uri.endswith(f"reranker/r/eval/{m.attempt}")
    store.upload("r", "model", make_model(tmp_path / "m", 2))
    store.promote("r", "model", {"model": "floor"})
    out = store.download_production(tmp_path / "dl")
    assert json.loads((out / "reranker.json").read_text())["version"] == 2


def test_bad_names_and_empty_uploads(tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path))
    with pytest.raises(ValueError, match="run_id"):
        store.upload("a/b", "s", report={})
    with pytest.raises(ArtifactError, match="nothing to upload"):
        store.upload("a", "s")
    with pytest.raises(ArtifactError, match="nothing in production"):
        store.download_production(tmp_path / "x")


# --- the production pointer pins what was tested (issue 18) ---------------------------------------------
def test_reupload_without_promote_does_not_change_what_production_downloads(tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    store.upload("r", "model", make_model(tmp_path / "v1", 1))
    pointer = store.promote("r", "model", {"model": "floor"})
    store.upload("r", "model", make_model(tmp_path / "v2", 2))  # re-uploaded, never promoted
    assert store.manifest("r", "model").attempt != pointer["attempt"]
    out = store.download_production(tmp_path / "dl")
    assert json.loads((out / "reranker.json").read_text())["version"] == 1
    assert len(pointer["manifest_sha256"]) == 64 and pointer["model"] == "floor"


def test_promote_pins_the_attempt_it_is_given(tmp_path):
    """A rollout smoke-tests one upload; a re-upload while it runs must not be what gets promoted."""
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    tested = store.upload("r", "model", make_model(tmp_path / "v1", 1))
    store.upload("r", "model", make_model(tmp_path / "v2", 2))  # published meanwhile
    pointer = store.promote("r", "model", {"attempt": "spoofed", "uri": "elsewhere"}, attempt=tested.attempt)
    assert (
        pointer["attempt"] == tested.attempt and pointer["uri"] == tested.uri
    )  # the record cannot move the pin
    assert pointer["manifest_sha256"] == tested.sha256()
    out = store.download_production(tmp_path / "dl")
    assert json.loads((out / "reranker.json").read_text())["version"] == 1
    with pytest.raises(ArtifactError, match="no complete upload to promote"):
        store.promote("r", "model", attempt="20990101T000000-deadbeef")


def test_promote_refuses_missing_or_changed_files(tmp_path):
    root = tmp_path / "store"
    store = ArtifactStore(LocalBackend(root))
    m = store.upload("r", "model", make_model(tmp_path / "v1", 1))
    (root / "reranker" / "r" / "model" / m.attempt / "sub" / "weights.bin").unlink()
    with pytest.raises(ArtifactError, match="weights.bin: missing"):
        store.promote("r", "model")
    m = store.upload("r", "model", make_model(tmp_path / "v2", 2))
    (root / "reranker" / "r" / "model" / m.attempt / "reranker.json").write_text("{}")
    with pytest.raises(ArtifactError, match="reranker.json: sha256 mismatch"):
        store.promote("r", "model")
    assert store.production() is None


def test_a_changed_pinned_manifest_is_refused(tmp_path):
    root = tmp_path / "store"
    store = ArtifactStore(LocalBackend(root))
    m = store.upload("r", "model", make_model(tmp_path / "v1", 1))
    store.promote("r", "model")
    # someone rewrites the attempt's manifest (and its file) after the promote: production must not follow
    (root / "reranker" / "r" / "model" / m.attempt / "reranker.json").write_text("{}")
    forged = {**json.loads(m.to_json()), "files": {"reranker.json": {"sha256": "0" * 64, "size": 2}}}
    (root / "reranker" / "r" / "model" / "manifests" / f"{m.attempt}.json").write_text(json.dumps(forged))
    with pytest.raises(ArtifactError, match="not the one promoted"):
        store.download_production(tmp_path / "dl")


def test_manifest_paths_cannot_leave_the_download_folder(tmp_path):
    root = tmp_path / "store"
    store = ArtifactStore(LocalBackend(root))
    m = store.upload("r", "model", make_model(tmp_path / "v1", 1))
    escape, data = "../../../../escape_probe.txt", b"escaped"
    (root / "reranker" / "r" / "model" / m.attempt / escape).resolve().write_bytes(data)  # the key it names
    files = {**m.files, escape: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    forged = {**json.loads(m.to_json()), "files": files}
    (root / "reranker" / "r" / "model" / "manifest.json").write_text(json.dumps(forged))
    dest = tmp_path / "a" / "b" / "c" / "dl"
    with pytest.raises(ArtifactError, match="escape_probe.txt.*not a plain relative path"):
        store.download("r", "model", dest)
    assert (dest / escape).resolve() == tmp_path / "escape_probe.txt"
    assert not (tmp_path / "escape_probe.txt").exists()


# --- promotes are compare-and-swap writes; every failure is an ArtifactError (issue 36) --------------------
def _race(store, n: int, tmp_path) -> tuple[list[dict], list[Exception]]:
    """`n` threads promote `n` different attempts at once: (the pointers returned, the errors raised)."""
    attempts = [store.upload(f"r{k}", "model", make_model(tmp_path / f"m{k}", k)).attempt for k in range(n)]
    gate = threading.Barrier(n)
    won, lost = [], []

    def one(k: int) -> None:
        gate.wait()
        try:
            won.append(store.promote(f"r{k}", "model", {"k": k}, attempt=attempts[k]))
        except ArtifactError as e:
            lost.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return won, lost


def test_concurrent_promotes_each_win_or_learn_they_lost(tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    won, lost = _race(store, 16, tmp_path)
    assert len(won) + len(lost) == 16 and won
    assert all(isinstance(e, PromoteConflict) and "was not promoted" in str(e) for e in lost)
    # the winners form one chain, each replacing exactly the pointer before it; the last is production
    final = store.production()
    assert final in won
    chain, p = [], final
    by_attempt = {w["attempt"]: w for w in won}
    while p is not None:
        chain.append(p["attempt"])
        p = by_attempt.get(p["replaces"]["attempt"]) if p["replaces"] else None
    assert sorted(chain) == sorted(by_attempt)


def _backend(kind: str, rival: list, request, tmp_path):
    """A local or S3 backend whose next pointer read lets rival.pop()() promote first: a promote that read the
    pointer, then lost the race to write it."""
    base = S3Backend if kind == "s3" else LocalBackend

    class Stale(base):  # type: ignore[valid-type,misc]
        def get_versioned(self, key):
            got = super().get_versioned(key)
            if key.endswith("production.json") and rival:
                rival.pop()()
            return got

    if kind == "local":
        return Stale(tmp_path / "store")
    store, _, _ = request.getfixturevalue("s3_store")
    return Stale(store.backend.bucket, client=store.backend.client)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_promote_that_lost_the_race_says_so_and_changes_nothing(kind, request, tmp_path):
    plain = ArtifactStore(_backend(kind, [], request, tmp_path))
    a = plain.upload("a", "model", make_model(tmp_path / "a", 1)).attempt
    b = plain.upload("b", "model", make_model(tmp_path / "b", 2)).attempt
    first = plain.promote("a", "model", attempt=a)  # If-None-Match: * (no pointer yet)
    assert first["replaces"] is None
    racing = ArtifactStore(
        _backend(kind, [lambda: plain.promote("a", "model", attempt=a)], request, tmp_path)
    )
    with pytest.raises(PromoteConflict, match=f"b/model/{b} was not promoted"):
        racing.promote("b", "model", attempt=b)
    now = plain.production()
    assert now["attempt"] == a and now["replaces"]["attempt"] == a  # the rival's promote, not b's
    again = racing.promote("b", "model", attempt=b)  # promoting again replaces what is there now (If-Match)
    assert plain.production() == again and again["replaces"]["manifest_sha256"] == now["manifest_sha256"]


@pytest.mark.parametrize(
    "pointer, match",
    [
        (b"{not json", "corrupt pointer"),
        (b"[1, 2]", "corrupt pointer \\(not a JSON object\\)"),
        (b'{"run_id": 5, "stage": "m", "attempt": "x", "manifest_sha256": "y"}', "run_id is not a string"),
        (b'{"run_id": "r", "stage": "m", "attempt": "x"}', "pins no manifest_sha256"),
        (b'{"run_id": "r", "stage": "m", "attempt": "../x", "manifest_sha256": "y"}', "corrupt pointer"),
    ],
)
def test_a_corrupt_pointer_is_an_artifact_error(tmp_path, pointer, match):
    store = ArtifactStore(LocalBackend(tmp_path))
    store.backend.put_bytes("reranker/production.json", pointer)
    with pytest.raises(ArtifactError, match=match):
        store.download_production(tmp_path / "dl")


@pytest.mark.parametrize(
    "manifest, match",
    [
        (b"[]", "corrupt manifest"),
        (b'{"run_id": "r"}', "corrupt manifest"),
        (b"\xff\xfe", "corrupt manifest"),
        ("files", "files and metadata must be objects"),
        ("sha256", "has no sha256"),
        ("run_id", "corrupt manifest"),
    ],
)
def test_a_malformed_manifest_is_an_artifact_error(tmp_path, manifest, match):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    m = store.upload("r", "model", make_model(tmp_path / "m", 1))
    raw = json.loads(m.to_json())
    if manifest == "files":
        raw["files"] = ["reranker.json"]
    elif manifest == "sha256":
        raw["files"]["reranker.json"] = {"size": 3}
    elif manifest == "run_id":
        raw["run_id"] = "../../etc"
    store.backend.put_bytes(
        "reranker/r/model/manifest.json",
        manifest if isinstance(manifest, bytes) else json.dumps(raw).encode(),
    )
    with pytest.raises(ArtifactError, match=match):
        store.download("r", "model", tmp_path / "dl")


def test_s3_failures_are_artifact_errors(s3_store, tmp_path):
    store, client, bucket = s3_store
    gone = ArtifactStore(S3Backend("no-such-bucket-gr2", client=client))
    for call in (
        lambda: gone.production(),
        lambda: gone.upload("r", "model", make_model(tmp_path / "m", 1)),
        lambda: gone.backend.download_file("x", tmp_path / "x"),
        lambda: store.backend.download_file("reranker/missing", tmp_path / "x"),
    ):
        with pytest.raises(ArtifactError, match="no-such-bucket-gr2|reranker/missing"):
            call()
