"""Shared serving fixtures: a real data slice, a generative model trained on it (tests/serving/toy_model.py), a
Feast repo with a sqlite online store (contract names: entities user/item, views user_history/item_features,
service reranker_v1), and the predictor + transformer running as real HTTP servers on 127.0.0.1 in
subprocesses."""

from __future__ import annotations

import datetime as dt
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from filelock import FileLock

from gr2.inference import CONFIG_FILE
from serving.serve_local import start_server, stop
from tests.serving.toy_model import train_toy_bundle

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "ml-latest-small"
N_USERS = 200
H = 20
MODEL = "reranker"


# The fixtures below that run server processes: a test that uses one (directly or through another fixture)
# is a `server` test, which `make test-fast` leaves out.
SERVER_FIXTURES = {"predictor", "transformer", "server", "edge", "revisions", "prometheus"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


def load_ml_slice() -> dict:
    """First 200 users of ml-latest-small: interactions in seq order, their items, and each user's last H."""
    inter = pd.read_csv(DATA / "interactions.tsv", sep="\t", dtype={"user_id": str, "item_id": str})
    users = inter["user_id"].drop_duplicates().head(N_USERS)
    inter = inter[inter["user_id"].isin(users)].sort_values(["user_id", "seq_idx"])
    items = pd.read_csv(DATA / "items.tsv", sep="\t", dtype=str, keep_default_na=False)
    items = items[items["item_id"].isin(set(inter["item_id"]))].reset_index(drop=True)
    history = {u: list(g["item_id"])[-H:] for u, g in inter.groupby("user_id", sort=False)}
    return {"interactions": inter, "items": items, "history": history}


@pytest.fixture(scope="session")
def ml_slice():
    return load_ml_slice()


@pytest.fixture(scope="session")
def model_dir(ml_slice, tmp_path_factory, worker_id):
    """The toy generative bundle, trained once per test session: under pytest-xdist the first worker trains it
    into the session's shared folder and the others wait for it (FileLock)."""
    if worker_id == "master":
        return train_toy_bundle(tmp_path_factory.mktemp("toy"), set(ml_slice["history"]))
    root = tmp_path_factory.getbasetemp().parent / "toy"
    with FileLock(f"{root}.lock"):
        if not (root / "bundle" / CONFIG_FILE).exists():
            train_toy_bundle(root, set(ml_slice["history"]))
    return root / "bundle"


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m serving.serve_local <args>`, not waited for."""
    return subprocess.Popen(
        [sys.executable, "-m", "serving.serve_local", *args],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    """`python -m serving.serve_local <args> --port P` on a free port (retried if another process takes it),
    once /v1/models/<MODEL> answers."""
    return start_server(
        lambda port: [sys.executable, "-m", "serving.serve_local", *args, "--port", str(port)],
        lambda port: f"http://127.0.0.1:{port}/v1/models/{MODEL}",
        log,
        cwd=ROOT,
    )


def raw_http(
    port: int, data: bytes | list[bytes], timeout_s: float = 30.0, pause_s: float = 0.0
) -> tuple[int, str]:
    """Send raw bytes (a list: each piece `pause_s` apart) to 127.0.0.1:port and read until the server closes:
    (status, the rest of the answer), status 0 when the connection closed without an answer. For what a
    well-behaved client library will not send: duplicate headers, non-ASCII header bytes, a head sent slowly."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            for piece in [data] if isinstance(data, bytes) else data:
                if select.select([s], [], [], pause_s)[0]:  # answered already: read that, send no more
                    break
                s.sendall(piece)
        except OSError:  # the server answered and closed while this was still sending
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except (ConnectionResetError, TimeoutError):  # send "connection: close" to end a served request
            pass
    head, _, body = answer.decode(errors="replace").partition("\r\n\r\n")
    return (int(head.split(" ")[1]) if head.startswith("HTTP/1.1 ") else 0), body


def log_since(path, offset: int, marker: str) -> str:
    """The server log written after `offset`, once `marker` shows up in it (the server writes it async)."""
    for _ in range(100):
        text = path.read_text(errors="replace")[offset:]
        if marker in text:
            return text
        time.sleep(0.1)
    return text


@pytest.fixture(scope="session")
def predictor(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "predictor.log"
    proc, port = start(["--role", "predictor", "--model_uri", str(model_dir)], log)
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "log": log}
    stop(proc)


def build_feast_repo(ml_slice: dict, root: Path) -> Path:
    """A Feast repo in `root`, applied and written through the SDK (no CLI: `feast apply` imports every .py
    file)."""
    from feast import Entity, FeatureService, FeatureStore, FeatureView, Field, FileSource
    from feast.types import Array, Int64, String
    from feast.value_type import ValueType

    root.mkdir(parents=True, exist_ok=True)
    (root / "feature_store.yaml").write_text(
        "project: gr2\nprovider: local\nregistry: registry.db\n"
        "online_store: {type: sqlite, path: online.db}\noffline_store: {type: file}\n"
        "entity_key_serialization_version: 3\n"
    )
    now = pd.Timestamp(dt.datetime.now(dt.UTC))
    hist = pd.DataFrame(
        {
            "user_id": list(ml_slice["history"]),
            "history": list(ml_slice["history"].values()),
            "history_len": [len(h) for h in ml_slice["history"].values()],
            "event_timestamp": now,
        }
    )
    items = ml_slice["items"]
    feats = pd.DataFrame(
        {
            "item_id": items["item_id"],
            "title": items["title"],
            "categories": [c.split("|") if c else [] for c in items["categories"]],
            "event_timestamp": now,
        }
    )
    hist.to_parquet(root / "user_history.parquet")
    feats.to_parquet(root / "item_features.parquet")
    user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.STRING)
    item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.STRING)
    ttl = dt.timedelta(days=3650)
    uh = FeatureView(
        name="user_history",
        entities=[user],
        ttl=ttl,
        schema=[Field(name="history", dtype=Array(String)), Field(name="history_len", dtype=Int64)],
        source=FileSource(path=str(root / "user_history.parquet"), timestamp_field="event_timestamp"),
    )
    itf = FeatureView(
        name="item_features",
        entities=[item],
        ttl=ttl,
        schema=[Field(name="title", dtype=String), Field(name="categories", dtype=Array(String))],
        source=FileSource(path=str(root / "item_features.parquet"), timestamp_field="event_timestamp"),
    )
    store = FeatureStore(repo_path=str(root))
    services = [
        FeatureService(name="reranker_v1", features=[uh, itf]),
        FeatureService(name="reranker_serving_v1", features=[uh[["history"]], itf[["title"]]]),
    ]
    store.apply([user, item, uh, itf, *services])
    store.write_to_online_store("user_history", hist)
    store.write_to_online_store("item_features", feats)
    return root


@pytest.fixture(scope="session")
def feast_repo(ml_slice, tmp_path_factory):
    return build_feast_repo(ml_slice, tmp_path_factory.mktemp("feature_repo"))


@pytest.fixture(scope="session")
def transformer(predictor, feast_repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "transformer.log"
    args = ["--role", "transformer", "--predictor_host", f"127.0.0.1:{predictor['port']}"]
    # --max_candidates: the model's N: more is refused before any feature lookup
    proc, port = start([*args, "--feast_repo", str(feast_repo), "--max_candidates", "10"], log)
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    stop(proc)


@pytest.fixture(scope="module")
def items(ml_slice):
    return list(ml_slice["items"]["item_id"])


@pytest.fixture(scope="module", params=["predictor", "transformer"])
def server(request, predictor):
    """Each test runs against the predictor alone and against the transformer in front of it."""
    if request.param == "predictor":
        return {"name": "predictor", **predictor}
    return {"name": "transformer", **request.getfixturevalue("transformer")}
