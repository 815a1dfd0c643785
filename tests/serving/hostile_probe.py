"""Hostile-request probe (issues 18 and 36): every bad-input kind of tests/serving/test_robustness.py, the HTTP
framing and connection cases of test_traffic.py, and a few partial failures, sent once each to
`python -m serving.serve_local` on 127.0.0.1 (the transformer with a sqlite Feast repo, and the predictor child
behind it) serving the REAL toy generative model (tests/serving/toy_model.py, trained first: about a minute).
Records each answer's status, whether its error names the field, the time it took and whether the servers still
answer a health probe and a valid request afterwards; and the servers' log (tracebacks, forged lines).

    python -m tests.serving.hostile_probe --out benchmarks/hostile_requests
    python -m tests.serving.hostile_probe --code <a checkout of another commit> --out /tmp/before

Timing: one persistent HTTP client (keep-alive) sends every request, so `ms` is the server's answer plus one
loopback round trip, not a new connection and TLS context per request. The connection cases (raw sockets) time
their own connection. `--code` runs the servers from another source tree (same interpreter), to compare against
an older commit. Model control (unload) goes last: on a server that allows it, it leaves no model behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from gr2.report import machine_info
from serving.schema import ServeConfig
from serving.serve_local import running
from tests.serving.conftest import build_feast_repo
from tests.serving.support import MODEL, load_ml_slice, raw_http
from tests.serving.test_robustness import V1, hostile
from tests.serving.toy_model import train_toy_bundle

JSON = {"content-type": "application/json"}
GOOD_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 5  # the probe's server: a short idle timeout, so that the idle case waits 5 s, not 65
HEADER_TIMEOUT_S = ServeConfig.header_timeout_s
HEAD = f"POST {V1} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"


def half_sent(port: int, wait_s: float) -> tuple[int, str]:
    """A body that declares 100 bytes and sends 15: (status, error), or (0, why) when nothing came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(
            f"POST {V1} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        )
        s.sendall(b'{"instances": [')
        answer = b""
        try:
            while b"}" not in answer and (chunk := s.recv(4096)):
                answer += chunk
        except TimeoutError:
            return 0, f"no answer within {wait_s:g} s"
    head, _, body = answer.decode(errors="replace").partition("\r\n\r\n")
    status = int(head.split(" ")[1]) if head.startswith("HTTP/") else 0
    return status, body


def idle_closed(port: int, wait_s: float) -> tuple[int, str]:
    """A connection that never sends a byte: (0, when the server closed it) or (0, still open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        t0 = time.perf_counter()
        try:
            data = s.recv(1024)
        except TimeoutError:
            return 0, f"still open after {wait_s:g} s"
    return 0, f"closed by the server after {time.perf_counter() - t0:.1f} s" + (
        f" ({data[:40]!r})" if data else ""
    )


def error_of(r: httpx.Response) -> str:
    try:
        obj = r.json()
    except ValueError:
        return r.text[:200]
    return str(obj.get("error", obj.get("detail", obj)))[:200] if isinstance(obj, dict) else str(obj)[:200]


def probe(url: str, port: int, pid: int, sl: dict, body_timeout_s: float) -> list[dict]:
    items = list(sl["items"]["item_id"])
    users = list(sl["history"])
    good = {"instances": [{"user_id": users[0], "candidates": items[:3]}]}
    rows: list[dict] = []
    client = httpx.Client(
        base_url=url, timeout=GOOD_TIMEOUT_S
    )  # every timed request: one keep-alive connection
    checker = httpx.Client(base_url=url, timeout=GOOD_TIMEOUT_S)  # the "still up" checks: another one

    def still_up() -> bool:
        try:
            ready = checker.get("/v2/health/ready").status_code == 200
            served = checker.post(V1, json=good).status_code == 200
        except httpx.HTTPError:
            return False
        return ready and served

    def record(kind, status, expect, field, err, *, ms, nbytes, note="", via="socket"):
        rows.append(
            {
                "kind": kind,
                "via": via,  # "client": the persistent keep-alive client; "socket": a connection of its own
                "status": status,
                "expected": expect,
                "field": field,
                "named": field is not None and err.startswith(field),
                "ms": round(ms, 2),
                "bytes_sent": nbytes,
                "up": still_up(),
                "error": err[:120],
                "note": note,
            }
        )

    def send(kind, path, body, ctype, expect, field, method="POST", note=None):
        headers = {"content-type": ctype} if ctype else {}
        t0 = time.perf_counter()
        try:
            r = client.request(method, path, content=body, headers=headers)
            status, err = r.status_code, error_of(r)
        except httpx.HTTPError as e:
            status, err, r = 0, f"{type(e).__name__}: {e}"[:200], None
        ms = (time.perf_counter() - t0) * 1000
        note_text = note(r) if note and r is not None else ""
        record(kind, status, expect, field, err, ms=ms, nbytes=len(body), note=note_text, via="client")

    def raw(kind, data, expect, field, pause_s=0.0):
        pieces = (
            [data[k : k + (1 << 16)] for k in range(0, len(data), 1 << 16)]
            if isinstance(data, bytes)
            else data
        )
        t0 = time.perf_counter()
        status, answer = raw_http(port, pieces, timeout_s=60, pause_s=pause_s)
        try:
            err = str(json.loads(answer).get("error", answer))
        except ValueError:
            err = answer[:200]
        ms = (time.perf_counter() - t0) * 1000
        record(kind, status, expect, field, err, ms=ms, nbytes=sum(map(len, pieces)))

    def ranked(r: httpx.Response) -> str:
        p = r.json()["predictions"]
        return "; ".join(f"{len(x['ranking'])} ranked by {x['ranker']}, valid {x['valid']}" for x in p)

    # --- valid traffic: what clients send besides full lists -------------------------------------------
    send(
        "valid request, 3 candidates (baseline)",
        V1,
        json.dumps(good).encode(),
        "application/json",
        200,
        None,
        note=ranked,
    )
    cold = {"instances": [{"user_id": "a-new-user", "candidates": items[:10]}]}
    send(
        "a user unknown to Feast (cold start)",
        V1,
        json.dumps(cold).encode(),
        "application/json",
        200,
        None,
        note=ranked,
    )
    mixed = [
        {"instances": [{"user_id": users[k], "candidates": items[k : k + (10 if k % 2 else 2)]}]}
        for k in range(8)
    ]
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=GOOD_TIMEOUT_S) as other:  # 8 clients' requests at once
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda b: other.post(V1, json=b), mixed))
    ok = sum(
        r.status_code == 200
        and sorted(r.json()["predictions"][0]["ranking"]) == sorted(b["instances"][0]["candidates"])
        for r, b in zip(answers, mixed, strict=True)
    )
    record(
        "8 clients at once, 2 and 10 candidates (mixed lengths in one batch)",
        200 if ok == 8 else 500,
        200,
        None,
        f"{ok} of 8 answered with a permutation of their own candidates",
        ms=(time.perf_counter() - t0) * 1000,
        nbytes=sum(len(json.dumps(b)) for b in mixed),
    )

    # --- bad bodies ------------------------------------------------------------------------------------
    for kind, path, body, ctype, status, field in hostile(items):
        send(kind, path, body, ctype, status, field)
    deep = b'{"instances": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    send(
        "JSON nested 1,000 levels, then a valid request on the same connection",
        V1,
        deep,
        "application/json",
        400,
        "body: JSON nested",
    )
    t0 = time.perf_counter()
    try:
        after = client.post(V1, json=good).status_code
    except httpx.HTTPError:
        after = 0
    rows[-1]["note"] = f"next on the same connection: {after} ({(time.perf_counter() - t0) * 1000:.1f} ms)"
    # one id repeated: 173 KB, under the body limit (43,292 distinct ids would be over it: 413)
    many = {"instances": [{"user_id": users[0], "candidates": ["a"] * 43_292}]}
    send(
        "43,292 candidates in one instance",
        V1,
        json.dumps(many).encode(),
        "application/json",
        400,
        "instances[0].candidates: too many",
    )
    send(
        "unknown candidate id",
        V1,
        json.dumps({"instances": [{"user_id": users[0], "candidates": [items[0], "nope"]}]}).encode(),
        "application/json",
        400,
        "instances[0].candidates[1]",
    )
    send(
        "one candidate",
        V1,
        json.dumps({"instances": [{"user_id": users[0], "candidates": items[:1]}]}).encode(),
        "application/json",
        400,
        "instances[0].candidates: too few",
    )
    send(
        "duplicate candidate",
        V1,
        json.dumps({"instances": [{"user_id": users[0], "candidates": [items[0], items[0]]}]}).encode(),
        "application/json",
        400,
        "instances[0].candidates[1]: duplicate",
    )
    send(
        "tau 7",
        V1,
        json.dumps({"instances": [{**good["instances"][0], "tau": 7}]}).encode(),
        "application/json",
        400,
        "instances[0].tau",
    )
    send(
        "65 instances",
        V1,
        json.dumps({"instances": good["instances"] * 65}).encode(),
        "application/json",
        400,
        "instances: too many",
    )
    send(
        "body of 300,000 bytes",
        V1,
        json.dumps({"instances": [{**good["instances"][0], "history": ["h" * 250] * 1180}]}).encode(),
        "application/json",
        413,
        "body: payload",
    )
    send(
        "unknown model",
        f"/v1/models/nope{MODEL}:predict",
        json.dumps(good).encode(),
        "application/json",
        404,
        None,
    )
    near = near_limit_body(sl, items)
    send(
        f"{len(near):,}-byte body of 64 instances (under the limit; Feast adds histories)",
        V1,
        near,
        "application/json",
        200,
        None,
    )
    marker = uuid.uuid4().hex[:8]
    send(
        "a field name with a newline (log forgery)",
        V1,
        json.dumps({"instances": [{**good["instances"][0], f"x\nFORGED {marker}": 1}]}).encode(),
        "application/json",
        400,
        "instances[0].x\nFORGED",
    )
    send(
        "a URL path with %0A (log forgery)",
        f"/v1/models/x%0aFORGED%20{marker}:predict",
        json.dumps(good).encode(),
        "application/json",
        404,
        None,
    )

    # --- HTTP framing and connections (raw sockets: each times its own connection) -----------------------
    t0 = time.perf_counter()
    status, err = half_sent(port, body_timeout_s + 30)
    record(
        "half-sent body (declares 100 bytes, sends 15)",
        status,
        408,
        "body: not received",
        err.removeprefix('{"error": "'),
        ms=(time.perf_counter() - t0) * 1000,
        nbytes=15,
    )
    raw(
        "a 64 MB header",
        HEAD.encode() + b"x-big: " + b"a" * (64 << 20) + b"\r\n\r\n",
        431,
        "headers: the request head exceeds",
    )
    raw(
        "5,000 headers",
        HEAD.encode() + b"".join(b"x-h%d: v\r\n" % k for k in range(5000)) + b"\r\n",
        431,
        "headers: ",
    )
    raw(
        "a 1 MB authorization header",
        HEAD.encode() + b"authorization: Bearer " + b"t" * (1 << 20) + b"\r\n\r\n",
        431,
        "headers: the request head exceeds",
    )
    raw(
        "a 50 KB head sent at once",
        HEAD.encode() + b"x-big: " + b"b" * 50_000 + b"\r\n\r\n",
        431,
        "headers: the request head exceeds",
    )
    raw(
        "150 headers (under the size cap)",
        HEAD.encode() + b"".join(b"x-h%d: v\r\n" % k for k in range(150)) + b"content-length: 2\r\n\r\n{}",
        431,
        "headers: 154 header fields",
    )
    body = json.dumps(good).encode()
    tail = b"content-length: %d\r\n\r\n" % len(body) + body
    raw(
        "two Content-Type headers",
        HEAD.encode() + b"content-type: text/plain\r\n" + tail,
        400,
        "content-type: sent 2 times",
    )
    raw(
        "two Authorization headers",
        HEAD.encode() + b"authorization: a\r\nauthorization: b\r\n" + tail,
        400,
        "authorization: sent 2 times",
    )
    raw(
        "a non-ASCII byte in x-request-id (forwarded)",
        HEAD.encode() + b"x-request-id: caf\xe9\r\n" + tail,
        400,
        "x-request-id: must be printable ASCII",
    )
    raw(
        "a control byte in authorization (forwarded)",
        HEAD.encode() + b"authorization: Bearer \x01x\r\n" + tail,
        400,
        "authorization: must be printable ASCII",
    )
    raw("a valid request in raw bytes (baseline of this section)", HEAD.encode() + tail, 200, None)
    raw(
        f"one header byte per second (header timeout {HEADER_TIMEOUT_S:g} s)",
        [bytes([b]) for b in HEAD.encode()],
        408,
        "headers: not received within",
        pause_s=1.0,
    )
    t0 = time.perf_counter()
    status, what = idle_closed(port, IDLE_TIMEOUT_S + 30)
    record(
        f"a connection that never sends a byte (idle timeout {IDLE_TIMEOUT_S} s)",
        status,
        0,
        None,
        what,
        ms=(time.perf_counter() - t0) * 1000,
        nbytes=0,
    )
    # memory: 16 unfinished 16 MB headers at once, against the transformer's idle memory
    proc = psutil.Process(pid)
    idle = proc.memory_info().rss
    peak = [idle]
    statuses: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: statuses.append(
                raw_http(port, [HEAD.encode() + b"x-big: "] + [b"a" * (1 << 16)] * 256, timeout_s=60)[0]
            )
        )
        for _ in range(16)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(proc.memory_info().rss)
        time.sleep(0.02)
    note = f"transformer RSS idle {idle / 2**20:.0f} MB, peak {max(peak) / 2**20:.0f} MB (+{(max(peak) - idle) / 2**20:.1f} MB)"
    record(
        "16 unfinished 16 MB headers at once",
        statuses.count(431) and 431,
        431,
        None,
        note,
        ms=(time.perf_counter() - t0) * 1000,
        nbytes=16 * (16 << 20),
        note=note,
    )
    send("model control: load", f"/v2/repository/models/{MODEL}/load", b"", None, 403, "model control is off")
    send(
        "model control: unload",
        f"/v2/repository/models/{MODEL}/unload",
        b"",
        None,
        403,
        "model control is off",
    )
    client.close()
    checker.close()
    return rows


def near_limit_body(sl: dict, items: list[str]) -> bytes:
    """64 instances just under the client body limit: 40 known users (Feast fills their histories) and 24
    with client-sent histories of long ids (the padding)."""
    limit = ServeConfig().max_body_bytes
    instances = [{"user_id": u, "candidates": items[:10]} for u in list(sl["history"])[:40]]
    instances += [{"user_id": "filler", "candidates": items[:3], "history": []} for _ in range(24)]

    def body() -> bytes:
        return json.dumps({"instances": instances}, separators=(",", ":")).encode()

    while len(body()) < limit - 1000:
        min(instances[40:], key=lambda i: len(i["history"]))["history"].append("h" * 200)
    return body()


def markdown(rows: list[dict], meta: dict) -> str:
    bad = [
        r["ms"]
        for r in rows
        if 400 <= r["status"] < 500 and r["bytes_sent"] < 10_000 and "(" not in r["kind"][:1]
    ]
    bad.sort()
    lines = [
        "# Hostile requests against serve_local (transformer + predictor on 127.0.0.1, the toy generative model)",
        "",
        f"`{meta['command']}`; {meta['machine']}; code at {meta['code']}; load average {meta['load_before']} before,",
        f"{meta['load_after']} after (2 cores, shared with other work). {len(rows)} kinds, each sent once to the",
        "transformer. `ms`: wall time of the one request through one persistent keep-alive client (the connection",
        "cases: their own connection, and what they wait for); the median 4xx of a small body took",
        f"{bad[len(bad) // 2] if bad else float('nan'):.2f} ms. `named`: the error message starts with the field the",
        "test expects; `up`: afterwards /v2/health/ready answers 200 and a valid request 200. The servers' log over",
        f"the whole probe: {meta['log_bytes']:,} bytes, {meta['log_tracebacks']} tracebacks, {meta['log_forged']}"
        " forged lines (a line that starts with what a client wrote after a newline).",
        "",
        "| kind | status | expected | field named | servers up | ms | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        named = "–" if r.get("field", "") is None else "yes" if r["named"] else "no"
        kind = r["kind"].replace("|", "\\|")
        note = str(r.get("note") or "").replace("|", "\\|")
        lines.append(
            f"| {kind} | {r['status']} | {r['expected']} | {named} | {'yes' if r['up'] else 'no'} | {r['ms']:g} | {note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="writes <out>.json and <out>.md")
    p.add_argument("--code", default=None, help="source tree to run the servers from (default: this one)")
    p.add_argument("--body_timeout_s", type=float, default=ServeConfig.body_timeout_s)
    a = p.parse_args(argv)
    code = Path(a.code).resolve() if a.code else Path(__file__).resolve().parents[2]
    sl = load_ml_slice()
    with tempfile.TemporaryDirectory(prefix="gr2-hostile-") as tmp:
        tmp = Path(tmp)
        model = train_toy_bundle(tmp / "toy", set(sl["history"]))
        repo = build_feast_repo(sl, tmp / "feature_repo")
        args = ["--model_uri", str(model), "--feast_repo", str(repo)]
        if a.code is None:  # an older code may not know these flags
            args += ["--body_timeout_s", str(a.body_timeout_s), "--idle_timeout_s", str(IDLE_TIMEOUT_S)]
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        with contextlib.chdir(code), running(args, MODEL, tmp / "server.log") as url:
            port = int(url.rsplit(":", 1)[1])
            (server,) = [p for p in psutil.Process().children() if str(port) in p.cmdline()]
            rows = probe(url, port, server.pid, sl, a.body_timeout_s)
            Path(f"{a.out}.partial.json").write_text(json.dumps(rows, indent=2) + "\n")  # before the shutdown
        log_text = (tmp / "server.log").read_text(errors="replace")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True)
    meta = {
        "command": "python -m tests.serving.hostile_probe " + " ".join(argv or sys.argv[1:]),
        "machine": "{cpu}, {cores} cores, Python {python}".format(**machine_info()),
        "code": rev.stdout.strip() or code.name,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "log_tracebacks": log_text.count("Traceback"),
        "log_forged": len(re.findall(r"^FORGED", log_text, re.M)),
        "log_bytes": len(log_text),
    }
    Path(f"{a.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    Path(f"{a.out}.md").write_text(markdown(rows, meta))
    Path(f"{a.out}.partial.json").unlink(missing_ok=True)
    print(markdown(rows, meta))
    print(meta)


if __name__ == "__main__":
    main()
