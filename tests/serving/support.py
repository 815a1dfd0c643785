"""Helpers and fixtures shared by the serving tests (tests/serving) and the deploy tests (tests/deploy): a real
data slice, a generative model trained on it (tests/serving/toy_model.py), and the predictor running as a real
HTTP server on 127.0.0.1 in a subprocess. The fixtures are registered once, by tests/conftest.py, so a session
that runs both folders trains the toy model and starts the predictor once."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "ml-latest-small"
N_USERS = 200
H = 20
MODEL = "reranker"


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
    from tests.serving.toy_model import (
        train_toy_bundle,  # torch and the stages: only when a test needs the model
    )

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
