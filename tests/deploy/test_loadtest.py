"""The load-test harness (the benchmark itself is `make loadtest`): percentiles, and a tiny run against the
real predictor that writes the report schema issue 7 asks for."""

import asyncio
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.loadtest import Connection, bundle_tau, main, percentile
from gr2.config import DiffusionConfig


def test_percentile_nearest_rank():
    xs = [float(x) for x in range(1, 101)]
    assert (percentile(xs, 50), percentile(xs, 95), percentile(xs, 99), percentile(xs, 100)) == (
        50,
        95,
        99,
        100,
    )
    assert percentile([7.0], 99) == 7.0 and math.isnan(percentile([], 50))


def test_tiny_run_writes_report(predictor, model_dir, tmp_path):
    out = tmp_path / "serving"
    report = main(
        [
            "--url",
            predictor["url"],
            "--model_uri",
            str(model_dir),
            "--decoders",
            "ar",
            "diffusion",
            "--concurrency",
            "1",
            "4",
            "--requests",
            "12",
            "--turns",
            "5",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert rows == report["rows"] and len(rows) == 4
    assert [(r["decoder"], r["concurrency"]) for r in rows] == [
        ("ar", 1),
        ("ar", 4),
        ("diffusion", 1),
        ("diffusion", 4),
    ]
    for r in rows:
        keys = {
            "decoder",
            "tau",
            "concurrency",
            "n",
            "p50_ms",
            "p95_ms",
            "p99_ms",
            "rps",
            "errors",
            "model_uri",
            "queue_p50_ms",
            "model_p50_ms",
            "batching",
            "client_cpu_ms",
            "dtype",
        }
        assert set(r) == keys and r["batching"] == "continuous"  # the server's default
        assert r["dtype"] is None  # --url: the running server's own, not known here
        assert r["errors"] == 0 and r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] and r["rps"] > 0
        # every request of every turn is counted once; each of the 5 turns sends 4 per client (more than 12)
        assert r["n"] == 5 * 4 * r["concurrency"]
        assert r["client_cpu_ms"] > 0  # the load generator's own share of the machine
        # the server's own split: the model call is part of what the client waited for
        assert 0 < r["model_p50_ms"] < r["p99_ms"] and r["queue_p50_ms"] >= 0
    tau = bundle_tau(str(model_dir), "tau", None)  # the bundle's operating tau: no --tau given
    assert rows[0]["tau"] is None and rows[2]["tau"] == tau
    assert f"| continuous | diffusion | {tau} | 4 |" in out.with_suffix(".md").read_text()
    assert len(report["load_average"]["before"]) == 3
    ratios = report["diffusion_vs_ar"]
    assert [c["concurrency"] for c in ratios] == [1, 4]
    assert ratios[0]["p50_ratio"] == round(rows[2]["p50_ms"] / rows[0]["p50_ms"], 3)
    assert ratios[1]["rps_ratio"] == round(rows[3]["rps"] / rows[1]["rps"], 3)


def test_spec_rows_need_a_bundle_with_its_verifier(tmp_path):
    with pytest.raises(SystemExit, match="spec needs a bundle that carries its verifier"):
        main(["--model_uri", str(tmp_path), "--decoders", "ar", "spec", "--out", str(tmp_path / "s")])
    assert not (tmp_path / "s.json").exists()


DIFFUSION = {"max_new_tokens": 40, "block_size": 4}  # what every diffusion bundle's reranker.json holds


def test_the_rows_decode_at_the_bundles_taus_unless_told(tmp_path):
    (tmp_path / "reranker.json").write_text(json.dumps({**DIFFUSION, "tau": 0.4, "spec_tau": 0.6}))
    assert (
        bundle_tau(str(tmp_path), "tau", None) == 0.4 and bundle_tau(str(tmp_path), "spec_tau", None) == 0.6
    )
    assert bundle_tau(str(tmp_path), "tau", 0.9) == 0.9
    (tmp_path / "reranker.json").write_text(json.dumps({**DIFFUSION, "name": "an old bundle"}))
    assert bundle_tau(str(tmp_path), "tau", None) == DiffusionConfig.eval_tau
    assert bundle_tau(None, "spec_tau", None) == DiffusionConfig.spec_tau  # --url without a bundle


class _Answers(BaseHTTPRequestHandler):
    """Answers a POST to /chunked in chunks, to /close with connection: close, else with content-length."""

    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        reply = json.dumps({"path": self.path, "got": json.loads(body)}).encode()
        self.send_response(201)
        if self.path == "/hang-up":  # closes the connection without an answer
            self.close_connection = True
            return
        if self.path == "/chunked":
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for part in (reply[:5], reply[5:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("content-length", str(len(reply)))
        if self.path == "/close":
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_connection_reads_every_body_kind_and_reconnects():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def go():
        conn = Connection(url)
        out = [
            await conn.post(p, json.dumps({"k": i}).encode())
            for i, p in enumerate(["/a", "/chunked", "/close", "/b"])
        ]
        conn.close()
        return out

    async def hang_up():
        conn = Connection(url)
        with pytest.raises(ConnectionError, match="no HTTP status line"):
            await conn.post("/hang-up", b"{}")
        return await conn.post("/a", b"{}")  # the next post opens a new connection

    try:
        answers = asyncio.run(go())
        after = asyncio.run(hang_up())
    finally:
        server.shutdown()
        server.server_close()
    assert [(s, json.loads(b)) for s, b in answers] == [
        (201, {"path": p, "got": {"k": i}}) for i, p in enumerate(["/a", "/chunked", "/close", "/b"])
    ]
    assert after[0] == 201
    with pytest.raises(OSError):  # nobody listens there any more
        asyncio.run(Connection(url).post("/a", b"{}"))
    with pytest.raises(ValueError, match="expected http"):
        Connection("ftp://x")
