"""Hostile-but-fair clients and partial failures (issue 18), over real HTTP on 127.0.0.1.

- The session predictor and transformer (tests/serving/support.py, tests/serving/conftest.py): model control off, every hostile body a
  4xx naming the field, keep-alive connections surviving a 1,000-level JSON, one log line per rejection.
- `edge`: a transformer whose predictor and Feast feature server are stand-ins in this process, so a test can
  freeze them, break them or take them down: 502 / 503 / 504, readiness, slow bodies, model control on.
- `serve_local --role all` stopping when its predictor child dies; the rollout promoting what its canary served.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import psutil
import pytest

from components.artifact_store import ArtifactStore, LocalBackend
from deploy.rollout import Plan, promote, rollout
from serving.schema import ServeConfig
from serving.serve_local import free_port, stop, wait_ready
from serving.transformer import FeastTransformer, TransformerConfig
from tests.deploy.fake_kube import OVERLAY, FakeKube
from tests.serving.support import MODEL, log_since, raw_http, spawn, start

JSON = {"content-type": "application/json"}
V1 = f"/v1/models/{MODEL}:predict"
V2 = f"/v2/models/{MODEL}/infer"


def v2_body(data: list, shape: list | None = None, **extra) -> dict:
    inp = {
        "name": "instances",
        "shape": [len(data)] if shape is None else shape,
        "datatype": "BYTES",
        "data": data,
    }
    return {"inputs": [inp], **extra}


def hostile(items: list[str]) -> list[tuple[str, str, bytes, str | None, int, str]]:
    """(kind, path, body, content type, expected status, what the error message starts with)."""
    good = {"user_id": "1", "candidates": items[:3]}
    good_raw = json.dumps(good)[:-1]  # the instance without its closing brace: append fields as raw JSON

    def v1(obj) -> bytes:
        return json.dumps(obj).encode()

    def inst(**fields) -> bytes:
        return v1({"instances": [{**good, **fields}]})

    return [
        ("tau literal NaN", V1, f'{{"instances": [{good_raw}, "tau": NaN}}]}}'.encode(), "application/json", 400, "instances[0].tau"),
        ("tau literal Infinity", V1, f'{{"instances": [{good_raw}, "tau": -Infinity}}]}}'.encode(), "application/json", 400, "instances[0].tau"),
        ("tau 1e999", V1, f'{{"instances": [{good_raw}, "tau": 1e999}}]}}'.encode(), "application/json", 400, "instances[0].tau"),
        ("parameters.tau NaN", V1, f'{{"instances": [{json.dumps(good)}], "parameters": {{"tau": NaN}}}}'.encode(), "application/json", 400, "parameters.tau"),
        ("empty body", V1, b"", "application/json", 400, "body: empty"),
        ("whitespace body", V1, b"  \n ", "application/json", 400, "body: empty"),
        ("malformed JSON, no content type", V1, b'{"instances": [', None, 400, "body: malformed JSON"),
        ("not UTF-8", V1, b'{"instances": ["\xff\xfe"]}', "application/json", 400, "body: not UTF-8"),
        ("JSON nested 1,000 levels", V1, b'{"instances": ' + b"[" * 1000 + b"]" * 1000 + b"}", "application/json", 400, "body: JSON nested"),
        ("content type text/plain", V1, v1({"instances": [good]}), "text/plain", 415, "content-type"),
        ("content type form (curl -d)", V1, v1({"instances": [good]}), "application/x-www-form-urlencoded", 415, "content-type"),
        ("body is a list", V1, v1([good]), "application/json", 400, "body: expected a JSON object"),
        ("unknown top-level key", V1, v1({"instances": [good], "instancez": []}), "application/json", 400, "instancez: unknown field"),
        ("unknown parameters key", V1, v1({"instances": [good], "parameters": {"temperature": 2}}), "application/json", 400, "parameters.temperature: unknown field"),
        ("parameters not an object", V1, v1({"instances": [good], "parameters": "fast"}), "application/json", 400, "parameters: must be an object"),
        ("instances null", V1, v1({"instances": None}), "application/json", 400, "instances: must be a list"),
        ("instance is a string", V1, v1({"instances": ["1"]}), "application/json", 400, "instances[0]: expected an object"),
        ("user_id 200 KB", V1, inst(user_id="u" * 200_000), "application/json", 400, "instances[0].user_id"),
        ("candidate id 300 chars", V1, inst(candidates=["i" * 300, items[0]]), "application/json", 400, "instances[0].candidates[0]"),
        ("150 candidates (edge cap)", V1, inst(candidates=[f"c{k}" for k in range(150)]), "application/json", 400, "instances[0].candidates: too many"),
        ("history of 1,001 ids", V1, inst(history=["h"] * 1001), "application/json", 400, "instances[0].history: too long"),
        ("history item a number", V1, inst(history=["h", 7]), "application/json", 400, "instances[0].history"),
        ("trace a string", V1, inst(trace="yes"), "application/json", 400, "instances[0].trace"),
        ("v2 without inputs", V2, v1({"id": "x"}), "application/json", 400, "inputs: missing"),
        ("v2 shape disagrees with data", V2, v1(v2_body([json.dumps(good)], shape=[3])), "application/json", 400, "inputs[0].shape"),
        ("v2 shape not a list", V2, v1(v2_body([json.dumps(good)], shape="1")), "application/json", 400, "inputs[0].shape"),
        ("v2 inputs an object", V2, v1({"inputs": {"data": []}}), "application/json", 400, "inputs: expected exactly one"),
        ("v2 two inputs", V2, v1({"inputs": v2_body([json.dumps(good)])["inputs"] * 2}), "application/json", 400, "inputs: expected exactly one"),
        ("v2 data element malformed", V2, v1(v2_body(["{not json"])), "application/json", 400, "inputs[0].data[0]: malformed JSON"),
        ("v2 data element nested 100 deep", V2, v1(v2_body(["[" * 100 + "]" * 100])), "application/json", 400, "inputs[0].data[0]: JSON nested"),
        ("v2 data element tau NaN", V2, v1(v2_body([json.dumps({**good, "tau": float("nan")})])), "application/json", 400, "inputs[0].data[0].tau"),
        ("v2 id a number", V2, v1(v2_body([json.dumps(good)], id=5)), "application/json", 400, "id: must be a non-empty string"),
        ("v2 unknown output", V2, v1(v2_body([json.dumps(good)], outputs=[{"name": "logits"}])), "application/json", 400, "outputs"),
        ("v2 unknown input parameter", V2, v1({"inputs": [{**v2_body([json.dumps(good)])["inputs"][0], "parameters": {"binary_data": True}}]}), "application/json", 400, "inputs[0].parameters.binary_data"),
        ("v2 unknown parameters key", V2, v1(v2_body([json.dumps(good)], parameters={"beam": 4})), "application/json", 400, "parameters.beam: unknown field"),
        # issue 36: numbers no float or int holds, lone surrogates, unbounded ids, what kserve's v2 model refuses
        ("tau an integer literal of 2^1024", V1, raw_inst(good_raw, "tau", str(2**1024)), "application/json", 400, "instances[0].tau"),
        ("tau an integer of 5,000 digits", V1, raw_inst(good_raw, "tau", "7" * 5000), "application/json", 400, "instances[0].tau"),
        ("trace an integer of 5,000 digits", V1, raw_inst(good_raw, "trace", "7" * 5000), "application/json", 400, "instances[0].trace"),
        ("parameters.tau an integer of 400 digits", V1, f'{{"instances": [{json.dumps(good)}], "parameters": {{"tau": {"9" * 400}}}}}'.encode(), "application/json", 400, "parameters.tau"),
        ("v2 shape an integer of 5,000 digits", V2, v1(v2_body([json.dumps(good)], shape=["LONG"])).replace(b'"LONG"', b"1" * 5000), "application/json", 400, "inputs[0].shape"),
        ("user_id a lone surrogate", V1, raw_inst(good_raw, "user_id", '"\\udc80"'), "application/json", 400, "instances[0].user_id: not valid Unicode"),
        ("candidate id a lone surrogate", V1, inst(candidates=[items[0], "a\udc80"]), "application/json", 400, "instances[0].candidates[1]: not valid Unicode"),
        ("v2 history with a lone surrogate", V2, v1(v2_body([json.dumps({**good, "history": [items[0], "\ud800"]})])), "application/json", 400, "inputs[0].data[0].history[1]: not valid Unicode"),
        ("unknown field name a lone surrogate", V1, inst(**{"x\udc80": 1}), "application/json", 400, "instances[0].x"),
        ("history id of 300 chars", V1, inst(history=[items[0], "h" * 300]), "application/json", 400, "instances[0].history[1]"),
        ("history id empty", V1, inst(history=[""]), "application/json", 400, "instances[0].history[0]"),
        ("v2 id of 10,000 chars", V2, v1(v2_body([json.dumps(good)], id="i" * 10_000)), "application/json", 400, "id: must be a non-empty string of at most"),
        ("v2 id a lone surrogate", V2, v1(v2_body([json.dumps(good)], id="\udfff")), "application/json", 400, "id: not valid Unicode"),
        ("v2 input name of 1,000 chars", V2, v1({"inputs": [{**v2_body([json.dumps(good)])["inputs"][0], "name": "n" * 1000}]}), "application/json", 400, "inputs[0].name"),
        ("v2 content_type an object", V2, v1({"inputs": [{**v2_body([json.dumps(good)])["inputs"][0], "parameters": {"content_type": {"a": 1}}}]}), "application/json", 400, "inputs[0].parameters.content_type"),
        ("v2 content_type null", V2, v1({"inputs": [{**v2_body([json.dumps(good)])["inputs"][0], "parameters": {"content_type": None}}]}), "application/json", 400, "inputs[0].parameters.content_type"),
        ("v2 output with parameters", V2, v1(v2_body([json.dumps(good)], outputs=[{"name": "predictions", "parameters": {"binary_data": [1]}}])), "application/json", 400, "outputs[0].parameters: unknown field"),
        ("v2 shape [1.0]", V2, v1(v2_body([json.dumps(good)], shape=[1.0])), "application/json", 400, "inputs[0].shape"),
        ("v2 shape [true]", V2, v1(v2_body([json.dumps(good)], shape=[True])), "application/json", 400, "inputs[0].shape"),
        ("11 candidates (more than the model's 10)", V1, inst(candidates=items[:11]), "application/json", 400, "instances[0].candidates: too many candidates (11 > 10"),
    ]  # fmt: skip


def raw_inst(good_raw: str, field: str, literal: str) -> bytes:
    """A v1 body whose one instance has `field` written as the raw JSON `literal` (what json.dumps cannot write:
    a 5,000-digit integer, a lone-surrogate escape)."""
    return f'{{"instances": [{good_raw}, "{field}": {literal}}}]}}'.encode()


HOSTILE_KINDS = [h[0] for h in hostile(["a", "b", "c"])]


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
def test_hostile_bodies_get_a_4xx_naming_the_field(server, items, kind):
    _, path, body, ctype, status, field = next(h for h in hostile(items) if h[0] == kind)
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(server["url"] + path, content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text[:300]
    assert r.json()["error"].startswith(field), r.json()["error"][:300]
    assert len(r.content) < 1000  # client values are echoed cut short
    assert server["proc"].poll() is None


def test_model_control_is_off_by_default(server, items):
    for action in ("unload", "load"):
        r = httpx.post(f"{server['url']}/v2/repository/models/{MODEL}/{action}", timeout=30)
        assert r.status_code == 403 and "model control is off" in r.json()["error"]
    assert httpx.get(f"{server['url']}/v2/health/ready", timeout=30).status_code == 200
    r = httpx.post(
        server["url"] + V1, json={"instances": [{"user_id": "1", "candidates": items[:3]}]}, timeout=30
    )
    assert r.status_code == 200


def test_deep_json_is_a_400_and_the_keep_alive_connection_still_serves(server, items):
    deep = b'{"instances": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # 2 KB
    good = {"instances": [{"user_id": "1", "candidates": items[:3]}]}
    with httpx.Client(base_url=server["url"], timeout=30) as client:  # one connection, kept alive
        for _ in range(3):
            r = client.post(V1, content=deep, headers=JSON)
            assert r.status_code == 400 and r.json()["error"].startswith("body: JSON nested 1001 levels")
            r = client.post(V1, json=good)
            assert r.status_code == 200 and sorted(r.json()["predictions"][0]["ranking"]) == sorted(items[:3])


PER_REQUEST = ("uvicorn.access",)  # the logger that writes a line for every request


def test_each_rejection_is_one_log_line_without_a_traceback(server, items):
    marker = uuid.uuid4().hex
    good = {"instances": [{"user_id": "1", "candidates": items[:3]}]}
    edge = {"instances": [{"user_id": "1", "candidates": items[:3], f"x{marker}": 1}]}  # refused at the edge
    model = {"instances": [{"user_id": "1", "candidates": [items[0], f"i{marker}"]}]}  # refused by the model
    cases = [
        (V1, edge, f"x{marker}", 400),
        (V1, model, f"i{marker}", 400),
        (f"/v1/models/m{marker}:predict", good, f"m{marker}", 404),  # kserve's own handler: unknown model
    ]
    for path, body, needle, status in cases:
        offset = len(server["log"].read_text(errors="replace"))
        r = httpx.post(server["url"] + path, json=body, timeout=30)
        assert r.status_code == status and needle in r.json()["error"]
        text = log_since(server["log"], offset, needle)
        # besides the access and timing lines every request gets, one line that says what was wrong
        lines = [
            line for line in text.splitlines() if needle in line and not any(p in line for p in PER_REQUEST)
        ]
        assert len(lines) == 1, text[-2000:]
        assert "Traceback" not in text, text[-2000:]


def test_kserve_timing_lines_are_left_out(server, items):
    """serving/modelserver.py: no per-request 'kserve.io.<path>' wall / cpu lines (drop_kserve_timing) and no
    'kserve.trace' latency line (enable_latency_logging off): the access line alone."""
    marker = uuid.uuid4().hex
    offset = len(server["log"].read_text(errors="replace"))
    good = {"instances": [{"user_id": "1", "candidates": items[:3]}]}
    assert httpx.post(server["url"] + V1, json=good, timeout=30).status_code == 200
    unknown = f"{server['url']}/v1/models/m{marker}:predict"
    assert httpx.post(unknown, json=good, timeout=30).status_code == 404
    text = log_since(server["log"], offset, f"m{marker}")  # once the second request's lines are written
    assert f"{MODEL}%3Apredict" in text and "kserve.io." not in text, text[-2000:]
    assert "kserve.trace" not in text, text[-2000:]


def test_a_200_kb_user_id_is_not_echoed_whole(server, items):
    offset = len(server["log"].read_text(errors="replace"))
    huge = "u" * 200_000
    r = httpx.post(
        server["url"] + V1, json={"instances": [{"user_id": huge, "candidates": items[:3]}]}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"].startswith("instances[0].user_id")
    assert len(r.content) < 1000
    text = log_since(server["log"], offset, "instances[0].user_id")
    assert "instances[0].user_id" in text and huge[:1000] not in text


def test_transformer_does_not_refuse_the_bytes_it_adds(transformer, ml_slice, items):
    """A client body just under the limit stays servable after the transformer fills in Feast histories."""
    limit = ServeConfig().max_body_bytes
    users = list(ml_slice["history"])[:40]  # known users: Feast fills 20 history ids each
    instances = [{"user_id": u, "candidates": items[:10]} for u in users]
    filler = {"user_id": "filler", "candidates": items[:3], "history": []}  # a client-sent history: kept
    instances += [dict(filler, history=[]) for _ in range(24)]

    def size() -> int:
        return len(json.dumps({"instances": instances}, separators=(",", ":")))

    hid = "h" * 200
    while size() < limit - 1000:
        min(instances[40:], key=lambda i: len(i["history"]))["history"].append(hid)
    body = json.dumps({"instances": instances}, separators=(",", ":")).encode()
    assert limit - 1000 <= len(body) < limit
    r = httpx.post(transformer["url"] + V1, content=body, headers=JSON, timeout=60)
    assert r.status_code == 200, r.text[:300]
    preds = r.json()["predictions"]
    assert [p["history_len"] for p in preds[:40]] == [len(ml_slice["history"][u]) for u in users]


def test_transformer_validates_the_whole_request_before_the_feature_lookup():
    t = FeastTransformer(
        "reranker",
        TransformerConfig("127.0.0.1:1", feast_url="http://127.0.0.1:1"),
        ServeConfig(max_candidates=10),  # serve_local's --max_candidates, the model's N
    )
    t.load()
    looked_up = []

    async def lookup(rows):
        looked_up.append(len(rows))
        return {}

    t.online_features = lookup
    many = {"instances": [{"user_id": "1", "candidates": [f"i{k}" for k in range(43_292)]}]}
    with pytest.raises(ValueError, match=r"instances\[0\]\.candidates: too many candidates \(43292 > 10\)"):
        asyncio.run(t(many))
    # the finding: 64 instances of 100 candidates took 0.45 s of Feast lookups before the predictor's 400
    wide = {
        "instances": [{"user_id": str(k), "candidates": [f"i{j}" for j in range(100)]} for k in range(64)]
    }
    with pytest.raises(ValueError, match=r"instances\[0\]\.candidates: too many candidates \(100 > 10\)"):
        asyncio.run(t(wide))
    late = {
        "instances": [
            {"user_id": "1", "candidates": ["a", "b"]},
            {"user_id": "2", "candidates": ["a", "b"], "tau": 7},
        ]
    }
    with pytest.raises(ValueError, match=r"instances\[1\]\.tau: must be within"):
        asyncio.run(t(late))
    assert looked_up == []


# --- a transformer in front of stand-in upstreams ----------------------------------------------------
class FakeUpstream:
    """A stand-in predictor or Feast feature server on 127.0.0.1. `mode`: "ok", "error" (HTTP 500) or
    "frozen" (reads the request, never answers until `thaw()`); `stop()` takes it down, `start()` back up."""

    def __init__(self, answer):
        self.answer, self.port, self.mode = answer, 0, "ok"  # port 0: the OS picks a free one, no race
        self.release = threading.Event()
        self.start()

    def start(self) -> None:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                if upstream.mode == "frozen":
                    upstream.release.wait(timeout=120)
                    return
                status, obj = (
                    (500, {"error": "boom"}) if upstream.mode == "error" else upstream.answer(self.path, body)
                )
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]  # kept: start() after stop() comes back on the same port
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def thaw(self) -> None:
        self.mode = "ok"
        self.release.set()
        self.release = threading.Event()


def feast_answer(path, body):
    n = len(body["entities"]["item_id"])
    return 200, {
        "metadata": {"feature_names": ["history", "title"]},
        "results": [{"values": [["h1", "h2"]] * n}, {"values": ["a title"] * n}],
    }


def predictor_answer(path, body):
    if path.endswith("/ready") or path == f"/v1/models/{MODEL}":  # kserve's v2 and v1 readiness
        return 200, {"name": MODEL, "ready": True}
    preds = [{"ranking": i["candidates"], "history_len": len(i["history"])} for i in body["instances"]]
    return 200, {"predictions": preds}


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    feast, pred = FakeUpstream(feast_answer), FakeUpstream(predictor_answer)
    log = tmp_path_factory.mktemp("logs") / "edge.log"
    args = ["--role", "transformer", "--predictor_host", f"127.0.0.1:{pred.port}"]
    args += [
        "--feast_url",
        f"http://127.0.0.1:{feast.port}",
        # short, so a frozen upstream's 504 comes quickly; long enough that a busy machine's healthy answer
        # (an in-process stand-in) is never mistaken for a frozen one
        "--predictor_timeout_s",
        "3",
        "--body_timeout_s",
        "3",
        "--idle_timeout_s",
        "2",
        "--header_timeout_s",
        "2",
    ]
    proc, port = start([*args, "--enable_model_control"], log)
    url = f"http://127.0.0.1:{port}"
    try:
        yield {"url": url, "port": port, "proc": proc, "log": log, "feast": feast, "predictor": pred}
    finally:
        stop(proc)
        for up in (feast, pred):
            up.thaw()
            up.stop()


GOOD = {"instances": [{"user_id": "1", "candidates": ["a", "b"]}]}


def _ready(url: str) -> int:
    return httpx.get(f"{url}/v2/health/ready", timeout=30).status_code


def test_frozen_predictor_gets_504_and_takes_the_transformer_out_of_rotation(edge):
    assert httpx.post(edge["url"] + V1, json=GOOD, timeout=30).status_code == 200
    edge["predictor"].mode = "frozen"
    try:
        r = httpx.post(edge["url"] + V1, json=GOOD, timeout=30)
        assert r.status_code == 504 and r.json()["error"].startswith(
            "predictor: no answer within the timeout"
        )
        assert _ready(edge["url"]) == 503
        assert httpx.get(f"{edge['url']}/v1/models/{MODEL}", timeout=30).status_code == 503
    finally:
        edge["predictor"].thaw()
    wait_ready(f"{edge['url']}/v2/health/ready", timeout_s=120, proc=edge["proc"])
    assert httpx.post(edge["url"] + V1, json=GOOD, timeout=30).status_code == 200


def test_dead_predictor_gets_503_and_takes_the_transformer_out_of_rotation(edge):
    edge["predictor"].stop()
    try:
        r = httpx.post(edge["url"] + V1, json=GOOD, timeout=30)
        assert r.status_code == 503 and r.json()["error"].startswith("predictor: unreachable (ConnectError")
        assert _ready(edge["url"]) == 503
    finally:
        edge["predictor"].start()
    wait_ready(f"{edge['url']}/v2/health/ready", timeout_s=120, proc=edge["proc"])


def test_failing_upstreams_get_502_or_503(edge):
    edge["predictor"].mode = "error"
    try:
        r = httpx.post(edge["url"] + V1, json=GOOD, timeout=30)
        assert r.status_code == 502 and r.json()["error"].startswith("predictor: bad answer (HTTP 500)")
    finally:
        edge["predictor"].mode = "ok"
    edge["feast"].mode = "error"
    try:
        r = httpx.post(edge["url"] + V1, json=GOOD, timeout=30)
        assert r.status_code == 502 and r.json()["error"].startswith("feature server: bad answer (HTTP 500)")
    finally:
        edge["feast"].mode = "ok"
    edge["feast"].stop()
    try:
        r = httpx.post(edge["url"] + V1, json=GOOD, timeout=30)
        assert r.status_code == 503 and r.json()["error"].startswith("feature server: unreachable")
    finally:
        edge["feast"].start()
    assert httpx.post(edge["url"] + V1, json=GOOD, timeout=30).status_code == 200


def test_a_half_sent_body_gets_408(edge):
    with socket.create_connection(("127.0.0.1", edge["port"]), timeout=30) as s:
        s.sendall(
            f"POST {V1} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        )
        s.sendall(b'{"instances": [')  # ... and nothing more
        answer = b""
        while b"}" not in answer and (chunk := s.recv(4096)):  # headers, then the JSON body
            answer += chunk
    answer = answer.decode(errors="replace")
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert '{"error": "body: not received within 3 s' in answer
    assert httpx.post(edge["url"] + V1, json=GOOD, timeout=30).status_code == 200


def test_idle_and_slow_header_connections_are_closed(edge):
    """The finding: a connection that never sends a byte, or sends one header byte every 10 s, stayed open for
    ever. `edge` runs with --idle_timeout_s 2 --header_timeout_s 2."""
    port = edge["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # never sends a byte
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server (within the socket's 30 s, else TimeoutError)
        assert time.monotonic() - t0 >= 1.5  # not at once: after the idle timeout
    status, answer = raw_http(
        port, [bytes([b]) for b in f"POST {V1} HTTP/1.1\r\nhost: x\r\n".encode()], pause_s=0.5
    )  # one byte every 0.5 s
    assert status == 408 and json.loads(answer)["error"] == "headers: not received within 2 s"
    # after a response, an idle keep-alive connection is closed too
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):  # the answer, then the server closes (else TimeoutError after 30 s)
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"live":true}')
    assert httpx.get(f"{edge['url']}/v2/health/ready", timeout=30).status_code == 200


def test_unload_with_model_control_on_takes_the_server_out_of_rotation(edge):
    """Last in this module: it leaves `edge` without a model (kserve 0.21 cannot load it back)."""
    assert _ready(edge["url"]) == 200
    r = httpx.post(f"{edge['url']}/v2/repository/models/{MODEL}/unload", timeout=30)
    assert r.status_code == 200
    assert _ready(edge["url"]) == 503
    assert httpx.post(edge["url"] + V1, json=GOOD, timeout=30).status_code == 404


# --- serve_local --role all, and the rollout -------------------------------------------------------
@pytest.mark.server
def test_serve_local_stops_when_its_predictor_child_dies(model_dir, tmp_path):
    feast = FakeUpstream(feast_answer)
    log = tmp_path / "all.log"
    proc, _ = start(["--model_uri", str(model_dir), "--feast_url", f"http://127.0.0.1:{feast.port}"], log)
    try:
        (child,) = psutil.Process(proc.pid).children()
        child.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=300) == 1  # bounded, generous: a busy machine stops slowly
        assert "the predictor exited with -9" in log.read_text()
    finally:
        stop(proc)
        feast.stop()


@pytest.mark.server
def test_serve_local_stopped_while_its_predictor_loads_takes_the_child_down(model_dir, tmp_path):
    """SIGTERM before the transformer starts (it waits for the predictor child): no orphaned predictor."""
    feast = FakeUpstream(feast_answer)
    # spawned, not started: the test stops it before it is ready, so its port is never bound
    proc = spawn(
        [
            "--model_uri",
            str(model_dir),
            "--feast_url",
            f"http://127.0.0.1:{feast.port}",
            "--port",
            str(free_port()),
        ],
        tmp_path / "all.log",
    )
    try:
        deadline = time.monotonic() + 300
        while not (kids := psutil.Process(proc.pid).children()) and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "all.log").read_text()[-2000:]
            time.sleep(0.05)
        (child,) = kids
        # at once: the child is still starting (even inside Popen), the transformer has not started
        proc.send_signal(signal.SIGTERM)
        assert (
            proc.wait(timeout=300) == 128 + signal.SIGTERM
        )  # bounded, generous: a busy machine stops slowly
        child.wait(timeout=300)  # psutil raises TimeoutExpired while the child still runs
    finally:
        stop(proc)
        feast.stop()


def test_rollout_promotes_the_attempt_it_smoke_tested(model_dir, tmp_path):
    """The canary serves one upload; a re-upload of the same run and stage meanwhile is not what gets promoted
    (deploy/rollout.py `promote`, which the canary analysis calls)."""
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "reranker.json").write_text("{}")

    def smoke_while_someone_reuploads(url, name, instance):
        store.upload("run5", "model", other)  # published while the canary is being tested
        return True, "HTTP 200"

    kube = FakeKube("http://canary")
    plan = rollout(
        model_dir,
        "run5",
        "model",
        {"model": "floor"},
        store,
        OVERLAY,
        tmp_path / "out",
        {},
        dry_run=False,
        kube=kube,
        poll_s=0,
        smoke=smoke_while_someone_reuploads,
    )
    assert plan.outcome == "canary", plan.actions
    assert Plan.read(tmp_path / "out").attempt == plan.attempt  # what a later analysis step reads
    (isvc,) = [d for d in kube.applied if d["kind"] == "InferenceService"]
    pointer = promote(kube, isvc, store, Plan.read(tmp_path / "out"))
    assert store.manifest("run5", "model").uri != plan.storage_uri  # the re-upload is the published one
    assert pointer["uri"] == plan.storage_uri == store.production()["uri"]
    out = store.download_production(tmp_path / "dl")
    assert (out / "reranker.json").read_text() == (model_dir / "reranker.json").read_text()
